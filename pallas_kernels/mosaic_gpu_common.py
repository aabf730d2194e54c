"""What the Mosaic GPU kernels (mosaic_gpu_*.py) share: the version gate, the call, the
interpreter, and the scalar "streams" their bodies are written in.

Mosaic GPU (`plgpu.kernel`, Hopper and newer) has no masked or gathered vector access, no
in-kernel cumsum and no fetch-and-add.
What it does have, and what these kernels use:

- Scalar loads and stores at any index, in global and shared memory. Inside
  `plgpu.warp_map` each of a warpgroup's 4 warps runs its own scalar code: a *stream*.
  A program (CTA) of `num_threads` warpgroups has 4 * num_threads streams.
- Vectors of 128k int32 in one warpgroup: contiguous loads, elementwise integer ops,
  reductions to a scalar (not with several warpgroups).
- Barriers: the end of a `warp_map` joins its warpgroup's warps; `sync` joins the
  program's warpgroups (an mbarrier). Between two phases of a kernel, one of them.
- In-place operands: an array passed as `jax.new_ref(x)` is written by the kernel and
  read back (`ref[...]`); XLA aliases the custom call's operand and result.

Streams own contiguous blocks of rows, so a prefix over rows is a prefix over streams:
each stream stores its count in shared memory, and after a barrier every stream adds the
counts of the streams before it (`before_and_total`). Rows are unrolled in Python, so a
stream's loads for all of its rows are in flight together.

The ownership record (SPEC 14; jax_kvalloc.guard is the reference, bit for bit) is kept
with the same scalar stores: `held` i32[n + 1] and `status` i32[3] are in-place operands
of the kernel that already runs. An allocation stores held[page] = 1 per page it takes
(`mark_held`); a free's checks and its status are the table kernel's (mosaic_gpu_table).

Versions: the kernels need jax >= 0.11 (in-place refs and warp-level scalar code lower
from 0.11 on; jax 0.10's lowering rejects a ref operand). Lowering semantics "Lane" (warp
code may load and store scalars there; under "Warpgroup" it may not). The interpreter is
jax's private `jax._src.pallas.mosaic_gpu.interpret` (InterpretGPUParams; the public
`interpret=True` cannot bind the grid's axis names), pinned by `interpret_params`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, Tuple

import jax
import jax.numpy as jnp

from pallas_kernels import _util

Array = jax.Array
WARPS = 4                 # warps per warpgroup: streams per warpgroup
MIN_JAX = (0, 11)
# jax_kvalloc.guard's reasons (pallas_kernels imports nothing of jax_kvalloc;
# tests/test_mosaic_gpu.py checks they agree).
OUT_OF_RANGE, NOT_HELD, REPEATED = 2, 3, 4


def _jax_version() -> Tuple[int, int]:
  return tuple(int(v) for v in jax.__version__.split(".")[:2])  # type: ignore[return-value]


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether this jax can build the Mosaic GPU kernels (jax >= 0.11 with
  jax.experimental.pallas.mosaic_gpu). Whether a GPU can run them is the caller's
  question (sm_90 or newer)."""
  if _jax_version() < MIN_JAX:
    return False
  try:
    from jax.experimental.pallas import mosaic_gpu  # pylint: disable=g-import-not-at-top,unused-import
  except Exception:  # pylint: disable=broad-except
    return False
  return True


def interpret_params() -> Any:
  """jax's Mosaic GPU interpreter parameters (InterpretGPUParams, private in jax 0.11
  and 0.12): what `interpret=True` becomes. RuntimeError when this jax has none."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret import params  # pylint: disable=g-import-not-at-top
    return params.InterpretGPUParams()
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(f"this jax ({jax.__version__}) has no Mosaic GPU interpreter: "
                       f"{type(e).__name__}: {e}") from e


def gpu_name() -> str:
  """The device kind of jax's first GPU ("" without one)."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return ""
  return getattr(devices[0], "device_kind", "") if devices else ""


def call(body: Callable[..., None], out_type: Any, *, name: str, grid: int = 1,
         num_threads: int = 1, scratch: Sequence[Any] = (), interpret: Any = False):
  """`plgpu.kernel` of `body` with Lane semantics: `grid` programs named "prog" and,
  for num_threads > 1, warpgroups named "wg". `interpret`: False, True (the pinned
  interpreter) or an interpreter parameters object."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  if interpret is True:
    interpret = interpret_params()
  kwargs = dict(grid=(grid,), grid_names=("prog",))
  if num_threads > 1:
    kwargs.update(num_threads=num_threads, thread_name="wg")
  params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
  return plgpu.kernel(body, out_type=out_type, scratch_types=tuple(scratch),
                      compiler_params=params, interpret=interpret or None,
                      kernel_name=name, **kwargs)


def program_id() -> Array:
  return jax.lax.axis_index("prog")


def warpgroup_id(num_threads: int) -> Any:
  return jax.lax.axis_index("wg") if num_threads > 1 else 0


def sync(barrier, num_threads: int) -> None:
  """Joins the program's warpgroups (all their earlier memory accesses visible to all);
  nothing to do for one warpgroup, whose warp_map ends join its warps."""
  if num_threads > 1:
    from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
    plgpu.barrier_arrive(barrier)
    plgpu.barrier_wait(barrier)


def streams(num_threads: int, fn: Callable[[Array], None]) -> None:
  """Runs fn(stream) on every warp of the program, stream = warpgroup * 4 + warp: scalar
  code per warp. Only scalars and refs may be closed over."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  wg = warpgroup_id(num_threads)
  plgpu.warp_map(lambda warp: fn(wg * WARPS + warp))


def barrier_scratch(num_threads: int) -> Tuple[Any, ...]:
  """The scratch `sync` needs (an mbarrier), or none for one warpgroup."""
  if num_threads <= 1:
    return ()
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return (plgpu.Barrier(num_arrivals=num_threads),)


def smem(n: int):
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=g-import-not-at-top
  return plgpu.SMEM((max(n, 1),), jnp.int32)


def before_and_total(counts_ref, base: int, stream: Array, num_streams: int
                     ) -> Tuple[Array, Array]:
  """(sum of counts_ref[base + t] for t < stream, sum over all t < num_streams): scalar
  loads of the streams' counts (shared memory, after a barrier)."""
  before = jnp.zeros((), jnp.int32)
  total = jnp.zeros((), jnp.int32)
  for t in range(num_streams):
    v = counts_ref[base + t]
    before = before + jnp.where(t < stream, v, 0)
    total = total + v
  return before, total


def wrap(i: Array, n: int) -> Array:
  """i in [0, 2n) into the ring [0, n), clamped into it for any i (no read leaves it)."""
  i = jnp.where(i >= n, i - n, i)
  return jnp.clip(i, 0, n - 1)


def when(cond: Array, fn: Callable[[], None]) -> None:
  """fn() where cond (a scalar branch); fn() alone when cond is the Python True."""
  if cond is True:
    fn()
    return
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  pl.when(cond)(fn)


def store(ref, i: Array, value: Array, cond=True) -> None:
  """ref[i] = value where cond (a scalar branch; always when cond is the Python True)."""
  def put():
    ref[i] = value
  when(cond, put)


def as_i32_refs(*arrays: Array):
  """In-place operands: jax.new_ref of each array (int32)."""
  return tuple(jax.new_ref(jnp.asarray(a, jnp.int32)) for a in arrays)


def check_held(held: Array, n: int) -> Array:
  """The record's held pages as i32[n + 1] (n: the ring's length); TypeError or ValueError
  naming `held` otherwise."""
  (held,) = _util.check_ints(held=held)
  if held.shape != (n + 1,):
    raise ValueError(f"held must be i32[{n + 1}] (ring length + 1), got {held.shape}")
  return held


def mark_held(held_ref, page: Array, cond: Array, n: int) -> None:
  """held[page] = 1 where cond (a page an allocation takes; a page outside 0..n, which a
  consistent free list never holds, is skipped)."""
  store(held_ref, jnp.clip(page, 0, n), jnp.ones((), jnp.int32),
        cond & (page >= 0) & (page <= n))
