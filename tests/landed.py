"""Waiting, in a test, for a class's device statuses to land (the classes never wait:
SPEC 14 raises a device refusal at the first call after its status has landed)."""
import jax


def settle(a, dp_rank: int = 0) -> int:
  """Waits until every held pool's running status of `a` has landed, then returns
  `a.available_size(dp_rank)`, which raises a refusal found by then."""
  for pool in a._pools:  # pylint: disable=protected-access
    if pool.backend.defers_status:
      jax.block_until_ready(pool.backend.running)
  return a.available_size(dp_rank=dp_rank)
