"""Shared pytest setup: locations of the shared test data."""
import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
# ../shared beside the checkout (as laid out for sessions and CI); JAX_KVALLOC_SHARED overrides.
SHARED = pathlib.Path(os.environ.get("JAX_KVALLOC_SHARED", REPO.parent / "shared"))
GOLDEN = SHARED / "golden" / "traces.jsonl"


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
  config.addinivalue_line("markers", "slow: long-running; deselect with -m 'not slow'")


@pytest.fixture(scope="session")
def golden_path():
  if not GOLDEN.exists():
    message = f"golden traces not found at {GOLDEN} (set JAX_KVALLOC_SHARED)"
    if os.environ.get("CI"):
      pytest.fail(message)  # CI never skips them silently
    pytest.skip(message)
  return GOLDEN
