"""A model step queued on a device ahead of the allocator's programs, still running while
a test makes class calls: a call that waits for the device (for a status, a count, an
output) cannot return before the step has finished.

On a GPU the step blocks in a host callback (jax.pure_callback) on a threading.Event that
the test sets (`finish`). JAX's CPU client runs a program with a host callback inline, in
the dispatching thread, so there the step is a chain of matmuls instead (dispatched
asynchronously, and the CPU runs the programs queued after it only once it is done); its
length is fitted once per process to at least MIN_SECONDS, far beyond what a call that
does not wait takes, and `running()` says whether it is still running. `negative_control`
shows that a read of an allocator output queued after the step does wait for it.
"""
import functools
import threading
import time

import jax
import jax.numpy as jnp

MIN_SECONDS = 0.5
_SIDE = 256


@functools.partial(jax.jit, static_argnums=1)
def _busy(x, n):
  return jax.lax.fori_loop(0, n, lambda i, a: jnp.tanh(a @ a) * 0.5, x)


@functools.lru_cache(maxsize=None)
def _cpu_iterations() -> int:
  """Iterations of `_busy` that take at least MIN_SECONDS here (fitted once)."""
  x = jnp.full((_SIDE, _SIDE), 0.01, jnp.float32)
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
  """One queued step: `running()` while it has not finished; `finish()` lets it finish
  (GPU) and waits for it."""

  def __init__(self, device=None):
    device = device or jax.devices()[0]
    self._event = threading.Event()
    if device.platform == "cpu":
      x = jax.device_put(jnp.full((_SIDE, _SIDE), 0.01, jnp.float32), device)
      n = _cpu_iterations()
      self.out = _busy(x, n)
    else:
      event = self._event

      def wait(v):
        event.wait()
        return v
      step = jax.jit(lambda v: jax.pure_callback(
          wait, jax.ShapeDtypeStruct(v.shape, v.dtype), v))
      self.out = step(jax.device_put(jnp.zeros((4,), jnp.float32), device))

  def running(self) -> bool:
    return not self.out.is_ready()

  def finish(self) -> None:
    self._event.set()
    self.out.block_until_ready()
