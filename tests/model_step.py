"""A model step queued on a device ahead of the allocator's programs, still running while
a test makes class calls: a call that waits for the device (for a status, a count, an
output) cannot return before the step has finished.

The step is a chain of matmuls, dispatched asynchronously; the device runs the programs
queued after it only once it is done. Its length is fitted once per device to at least
MIN_SECONDS, far beyond what a call that does not wait takes, and `running()` says
whether it is still running. A step that blocks in a host callback until the test
releases it is not used: JAX runs a program with a host callback inline in the
dispatching thread on the CPU (and may on a GPU), so such a step would hold the test
itself; with this step, a call that waits fails the test instead of hanging it. `negative_control` shows that a read of an allocator output
queued after the step does wait for it.
"""
import functools
import time

import jax
import jax.numpy as jnp

MIN_SECONDS = 0.5
_SIDE = 256


@jax.jit
def _busy(x, n):  # n: traced (a while loop), so one program serves every length
  return jax.lax.fori_loop(0, n, lambda i, a: jnp.tanh(a @ a) * 0.5, x)


@functools.lru_cache(maxsize=None)
def _iterations(device: jax.Device) -> int:
  """Iterations of `_busy` that take at least MIN_SECONDS on `device` (fitted once)."""
  x = jax.device_put(jnp.full((_SIDE, _SIDE), 0.01, jnp.float32), device)
  n = 16
  _busy(x, n).block_until_ready()  # compile
  while True:
    start = time.perf_counter()
    _busy(x, n).block_until_ready()
    took = time.perf_counter() - start
    if took >= MIN_SECONDS / 4:
      return int(n * 4 * MIN_SECONDS / took) + 1
    n *= 4


class ModelStep:
  """One queued step: `running()` while it has not finished; `finish()` waits for it."""

  def __init__(self, device=None):
    device = device or jax.devices()[0]
    x = jax.device_put(jnp.full((_SIDE, _SIDE), 0.01, jnp.float32), device)
    self.out = _busy(x, _iterations(device))

  def running(self) -> bool:
    return not self.out.is_ready()

  def finish(self) -> None:
    self.out.block_until_ready()
