"""A pytest plugin for running sglang-jax's tests patched (`pytest -p
jax_kvalloc.sgl_jax.pytest_check`): every allocator the patched classes build during a
test (its setup included) is kept alive until the test's call phase ends, then checked
(`check()`: on the device backend, a wait for each pool's statuses), so a refusal
still pending when a test ends fails that test: no test passes with a state that
differs silently.
"""
import pytest

from jax_kvalloc.sgl_jax import patching


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):  # pylint: disable=unused-argument
  patching.track_allocators(True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):  # pylint: disable=unused-argument
  result = yield
  for allocator in patching.track_allocators(True):
    try:
      allocator.check()
    except ValueError as e:
      raise AssertionError(f"jax_kvalloc refused a call during this test that it had "
                           f"not raised yet: {e}") from e
  return result


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):  # pylint: disable=unused-argument
  patching.track_allocators(False)
