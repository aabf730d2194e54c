"""The ownership record (SPEC 14) inside the Triton kernels: the rules of
jax_kvalloc.guard (the jnp reference, bit for bit), written for a kernel body.

The record is two refs aliased in and out of the kernel that already runs (the kernel
reads and writes the output refs), so keeping it costs no launch: `held` i32[n + 1] (1 where page p is handed out) and `status` i32[3]
(op, why, page of the first refused free; op 0: none).

- An allocation stores held[p] = 1 at each page it takes (`mark_taken`).
- A free of page ids that must be distinct (one program, `check_distinct`): each lane
  loads its page's held value, then (a CTA barrier after every step) stores a tag unique
  to the lane at the page, loads it back (a lane that finds another tag shares its page
  with another lane), the losers store -1 there, and every lane loads once more: -1 marks
  a page named twice, for every lane naming it. No sort, no atomics (integer atomics do
  not lower on jax 0.10 and are not atomic in Pallas' interpreter).
- `first_offence` picks the status of the first offending lane (argument order), and
  `finish` stores held (0, or the old value back when refused) at every given page.

The reason codes and the ops are jax_kvalloc.guard's (repeated here, since
pallas_kernels imports nothing of jax_kvalloc; tests/test_guard.py checks they agree).
"""
from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _util

Array = jax.Array

PAGE_ZERO, OUT_OF_RANGE, NOT_HELD, REPEATED = 1, 2, 3, 4
_BIG = 2**31 - 1


def _barrier(barrier: bool) -> None:
  if barrier:
    pltriton.debug_barrier()


def mark_taken(held_ref, pages: Array, mask: Array) -> None:
  """held[pages] = 1 where mask (the pages an allocation takes)."""
  _util.store(held_ref, pages, jnp.ones_like(pages), mask)


def reasons(held_ref, pages: Array, given: Array, n: int, *, distinct: bool,
            barrier: bool) -> Tuple[Array, Array, Array]:
  """guard.reasons for one program's lanes: (i32[L] why, i32[L] held before the call,
  bool[L] given and inside the pool). With `distinct` it writes scratch into held at
  the given pages (`finish` overwrites exactly those) and needs CTA barriers
  (`barrier`: False in interpret mode, where the program runs in order)."""
  lanes = jnp.arange(pages.shape[0], dtype=jnp.int32)
  inside = given & (pages >= 1) & (pages <= n)
  h0 = _util.load(held_ref, pages, inside)
  why = jnp.where(~given, 0, jnp.where(
      pages == 0, PAGE_ZERO, jnp.where(~inside, OUT_OF_RANGE,
                                       jnp.where(h0 != 1, NOT_HELD, 0))))
  if distinct:
    tag = -(lanes + 2)
    _barrier(barrier)   # every lane's h0, before any tag lands on its page
    _util.store(held_ref, pages, tag, inside)
    _barrier(barrier)
    lost = inside & (_util.load(held_ref, pages, inside) != tag)
    # A lane that reads a -1 stored by a loser below also counts as a loser: its page is
    # named twice either way, so no barrier is needed here.
    _util.store(held_ref, pages, jnp.full_like(pages, -1), lost)
    _barrier(barrier)
    repeated = inside & (_util.load(held_ref, pages, inside) == -1)
    why = jnp.where((why == 0) & repeated, REPEATED, why)
  return why, h0, inside


def why_of(page: Array, n: int) -> Array:
  """i32[] the reason a free naming `page` (not held) offends: PAGE_ZERO, OUT_OF_RANGE or
  NOT_HELD. Arithmetic, not a select of literals: Triton's lowering gives a scalar
  select_n of weak-typed literals the predicate's i1 type, which its verifier rejects."""
  zero = (page == 0).astype(jnp.int32)
  outside = ((page < 0) | (page > n)).astype(jnp.int32)
  return (NOT_HELD + (OUT_OF_RANGE - NOT_HELD) * outside * (1 - zero)
          + (PAGE_ZERO - NOT_HELD) * zero)


def first_offence(why: Array, pages: Array) -> Tuple[Array, Array, Array]:
  """(bool[] any lane offends, i32[] why, i32[] page of the first offending lane)."""
  lanes = jnp.arange(why.shape[0], dtype=jnp.int32)
  first = jnp.min(jnp.where(why != 0, lanes, _BIG))
  at = lanes == first
  return (first < _BIG, jnp.sum(jnp.where(at, why, 0)), jnp.sum(jnp.where(at, pages, 0)))


def finish(held_ref, pages: Array, inside: Array, h0: Array, refused: Array) -> None:
  """held at every given page in the pool: 0 (freed) or, when refused, its old value."""
  _util.store(held_ref, pages, jnp.where(refused, h0, 0), inside)


def record_status(status_ref, found: Array, op: int, why: Array, page: Array) -> None:
  """The sticky status (one program; status_ref aliased in and out): (op, why, page)
  when found and nothing is recorded yet."""
  old = [status_ref[i] for i in range(3)]
  new = found & (old[0] == 0)
  for i, v in enumerate((jnp.int32(op), why, page)):
    status_ref[i] = jnp.where(new, v, old[i])
