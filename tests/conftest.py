"""Shared pytest setup: locations of the shared test data."""
import os
import pathlib

import pytest

# Several host devices for the data-parallel rank tests (test_ranks.py): XLA reads this
# when jax creates its CPU client, so it must be set before any test touches a backend.
# The default device is still the first one, so single-device tests run as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=4").strip()

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
