"""A rarely taken update that stays a branch under `jax.vmap`.

`lax.cond(pred, update, identity, x)` skips `update` at run time, but under `vmap` with a
batched `pred` JAX turns it into a `select` of both branches, so `update` runs on every
call. For the need_sort merge (a sort of the whole pool) that made every vmapped
allocation, over data-parallel ranks for instance, cost a sort of every rank's pool,
although a merge only runs on a shortfall.

`gated(update)(x, pred, *operands)` is `update(x, pred, *operands)` when any entry of
`pred` holds, else `x`, where `update` masks its own effect by `pred` (entries whose pred
is False come back unchanged) and only reads `operands` (arrays it needs beside x, which
the branch does not hand back). Unbatched, it is one `lax.cond`. Under `vmap` its
batching rule keeps the branch at the outer level: `lax.cond(any(pred over the batch),
vmap(update), identity)`, so a call in which no entry needs the update does no work
proportional to `x`, and one in which some do runs the update, masked, on the whole
batch (the same cost as a single update per entry, paid only then). Nested `vmap`s nest
the same rule.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

Array = jax.Array


def _keep(x: Any, pred: Array, *operands: Any) -> Any:
  del pred, operands
  return x


def gated(update: Callable[..., Any]) -> Callable[..., Any]:
  """`update` behind a branch on `jnp.any(pred)` that batching keeps a branch.

  Args:
    update: (x, pred, *operands) -> x', a pytree of the same structure, shapes and
      dtypes as x, equal to x wherever pred is False (update masks itself; it must be
      correct for any pred, since the rule runs it for the whole batch when one entry
      needs it). `operands` (pytrees of arrays, possibly none) are read only.

  Returns:
    (x, pred: bool[...], *operands) -> x' (update's result when any pred holds, else x).
  """
  @custom_vmap
  def run(x, pred, operands):
    return jax.lax.cond(jnp.any(pred), update, _keep, x, pred, *operands)

  @run.def_vmap
  def _rule(axis_size, in_batched, x, pred, operands):  # pylint: disable=unused-variable
    widen = lambda v, b: v if b else jnp.broadcast_to(v, (axis_size,) + jnp.shape(v))
    x, pred, operands = jax.tree.map(widen, (x, pred, operands), tuple(in_batched))
    # One level up, the same gate over the batched update: an outer vmap meets this
    # custom_vmap again instead of turning the branch into a select.
    out = gated(jax.vmap(update))(x, pred, *operands)
    return out, jax.tree.map(lambda _: True, out)

  return lambda x, pred, *operands: run(x, pred, operands)
