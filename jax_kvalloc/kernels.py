"""The one selector: which implementation runs each allocator operation.

`AllocatorConfig.kernel` (default: the environment variable JAX_KVALLOC_KERNEL, else
"auto") names an implementation family, and each operation runs that family's
implementation where it has one that suits the call, else XLA's::

  "jnp"      XLA only: jax_kvalloc.index_jnp, freeing's sort or bitmap. The truth that
             every kernel is checked against.
  "triton"   the Pallas-Triton kernels of pallas_kernels (GPU).
  "mosaic_gpu"
             the Pallas Mosaic GPU kernels of pallas_kernels (GPU, Hopper and newer;
             jax >= 0.11).
  "mosaic"   the Pallas-Mosaic kernels of pallas_kernels (TPU).
  "triton_interpret", "mosaic_gpu_interpret", "mosaic_interpret"
             the same kernels in Pallas' interpreters (any platform; for tests).
  "auto"     the pool's platform decides: on a GPU, per operation, the first usable
             family of GPU_PREFERENCE (`gpu_choice`); "mosaic" on a TPU; "jnp" elsewhere
             (CPU).
  "pallas", "pallas_interpret"
             the older names: the Pallas kernels of the pool's platform ("mosaic" on a
             TPU, "triton" elsewhere), in the interpreter for the second.

REGISTRY lists each operation's implementations. Where a family has none for an
operation, or the call does not suit it, the operation runs XLA's::

  alloc           jnp
  alloc_extend    jnp; triton: the whole allocation in one launch (`alloc_extend_fused`),
                  or, in debug mode and for batches past `extend_fused_preferred`, XLA's
                  bookkeeping around the index kernel; mosaic: the index kernel
  alloc_decode    jnp; triton: one launch (`alloc_decode_fused`), or the index kernel
                  (debug mode, past `decode_fused_supported`); mosaic_gpu: one launch
                  (outside debug mode); mosaic: the index kernel
  release_decode  jnp (free_page_ids, then alloc_decode); triton: one launch for a paged
                  pool without need_sort or debug (`release_alloc_decode_fused`);
                  mosaic_gpu: free_page_ids, then its alloc_decode
  table           the request table's step (request_table.step_rows and each of its
                  operations): jnp (the composition); triton, mosaic_gpu: one launch that
                  writes the pool and the table (two with extend) for a paged pool
                  without need_sort or debug; its borrows (borrow_pages,
                  borrow_from_rows): jnp; triton: one launch for any pool
  free            sort or bitmap (XLA, by size: freeing.free_method); triton: one memset
                  and three launches for a paged pool outside debug mode, for sizes
                  `pallas_kernels.free_preferred` takes

The fused Triton calls exist because on a GPU each separate XLA op of the bookkeeping is
a launch of its own. A need_sort merge stays with the caller, before them.

"auto" on a GPU never breaks: a family that this process cannot use is skipped (Pallas'
Triton backend missing, or failing to lower a probe kernel: `usable`; Mosaic GPU before
jax 0.11 or on a GPU older than Hopper; JAX_KVALLOC_NO_TRITON=1 in the environment makes
Triton unusable, to run or measure that fallback), and the choice is said once, as a log line of
the "jax_kvalloc" logger, not a warning per compile. Pallas' Triton backend is deprecated
by jax (0.11 on); our kernels silence jax's warning about it (pallas_kernels._util.
quiet_triton), and the first "auto" that picks it logs one note.

"auto" (and the older names) resolve by the platform of the pool (`by_device`): a
concrete state's arrays say where they live; under tracing, the platform the program
will be lowered for when that is known at trace time: the device of an abstract mesh in
scope (`jax.sharding.use_abstract_mesh`, as tests/lowering_check.py exports for an
abstract H200 or TPU), else the platform of the only backend this process has (a
CPU-only host). Only where several backends could run it (a GPU host has a CPU backend
too) does the choice fall to `lax.platform_dependent` over those platforms, decided when
lowering.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
from typing import Callable, Iterator, Optional, Tuple, TypeVar

import jax
# Imported here, not lazily where a kernel is first traced: on jax >= 0.12 importing Pallas
# registers config options that join every later jit cache key, so a first import inside
# a step's trace makes the next call of that step compile again.
import jax.experimental.pallas  # pylint: disable=unused-import
import jax.numpy as jnp

from jax_kvalloc import index_jnp
from jax_kvalloc.config import AllocatorConfig
from jax_kvalloc.state import AllocatorState

Array = jax.Array
AllocResult = Tuple[AllocatorState, Array, Array]
T = TypeVar("T")
logger = logging.getLogger("jax_kvalloc")

# Names that resolve to themselves on every platform.
CONCRETE = ("jnp", "triton", "mosaic_gpu", "mosaic", "triton_interpret",
            "mosaic_gpu_interpret", "mosaic_interpret")
# Names whose meaning depends on the pool's platform.
BY_PLATFORM = ("auto", "pallas", "pallas_interpret")

REGISTRY = {
    "alloc": ("jnp",),
    "alloc_extend": ("jnp", "triton", "mosaic"),
    "alloc_decode": ("jnp", "triton", "mosaic_gpu", "mosaic"),
    "release_decode": ("jnp", "triton", "mosaic_gpu"),
    "free": ("sort", "bitmap", "triton"),
    "table": ("jnp", "triton", "mosaic_gpu"),
}

# "auto" on a GPU: per operation, the families in order of preference; the first usable
# one runs it (jnp, always usable, last). The order is what the committed H200 run shows
# (BENCHMARKS.md, "Mosaic GPU"; benchmarks/results/2026-12-01-h200-mosaic-gpu): Mosaic
# GPU would go before Triton only where it is at least as fast, which it is nowhere
# there; it follows Triton only where it beat XLA: the table's step (decode step at
# bs 64 and 256 faster, 1024 a tie), not alloc_decode (bs 1: slower than XLA's call).
GPU_PREFERENCE = {
    "alloc": ("jnp",),
    "alloc_extend": ("triton", "jnp"),
    "alloc_decode": ("triton", "jnp"),
    "release_decode": ("triton", "jnp"),
    "free": ("triton", "jnp"),
    "table": ("triton", "mosaic_gpu", "jnp"),
}

# lax.platform_dependent's keys.
_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def for_platform(kernel: str, platform: str, op: Optional[str] = None) -> str:
  """The concrete name (one of CONCRETE) that `kernel` selects for a pool on `platform`
  ("cpu", "gpu", "cuda", "rocm", "tpu", ...) for operation `op` (a key of
  GPU_PREFERENCE; None: the allocator's decode, the family most operations take)."""
  if kernel not in BY_PLATFORM:
    return kernel
  gpu = platform in ("gpu", "cuda", "rocm")
  if kernel == "auto":
    if gpu:
      return gpu_choice(op or "alloc_decode")
    if platform == "tpu":
      return "mosaic"
    if _SIMULATED_GPU and platform == "cpu":
      name = gpu_choice(op or "alloc_decode")
      return name if name == "jnp" else name + "_interpret"
    return "jnp"
  name = "mosaic" if platform == "tpu" else "triton"
  return name + ("_interpret" if kernel == "pallas_interpret" else "")


def resolve(kernel: str, op: Optional[str] = None) -> str:
  """The concrete name `kernel` selects on the default backend (eager code and tools;
  the allocator itself resolves by the pool's device, `by_device`)."""
  return for_platform(kernel, jax.default_backend(), op)


def unavailable(kernel: str, platform: Optional[str] = None) -> Optional[str]:
  """None when `kernel` (a name of config.KERNELS) can run on `platform` (None: the
  default backend's), else why not, in a few words: Triton needs a GPU and a working
  Pallas Triton backend, Mosaic GPU a Hopper GPU and jax >= 0.11, Mosaic a TPU; jnp and
  the interpreters (`*_interpret`) run anywhere (Mosaic GPU's interpreter needs a jax
  that builds its kernels). Looks at the backend only: nothing is compiled."""
  platform = platform or jax.default_backend()
  base, interpret = family(for_platform(kernel, platform))
  gpu = platform in ("gpu", "cuda", "rocm")
  if base == "mosaic_gpu":
    from pallas_kernels import mosaic_gpu_common  # pylint: disable=g-import-not-at-top
    if not mosaic_gpu_common.available():
      return f"jax {jax.__version__} does not build the Mosaic GPU kernels (jax >= 0.11 does)"
  if base == "jnp" or interpret:
    return None
  if base == "triton":
    return None if gpu and usable("triton") else (
        f"Pallas' Triton kernels need a GPU{'' if gpu else f', and this backend is {platform}'}"
        + ("" if not gpu else f": {_triton_problem()}"))
  if base == "mosaic_gpu":
    return None if gpu and usable("mosaic_gpu") else (
        f"the Mosaic GPU kernels need an NVIDIA Hopper GPU"
        + (f": {_mosaic_gpu_problem()}" if gpu else f", and this backend is {platform}"))
  return None if platform == "tpu" else (
      f"the Mosaic kernels need a TPU, and this backend is {platform}")


def family(name: str) -> Tuple[str, bool]:
  """("jnp" | "triton" | "mosaic_gpu" | "mosaic", interpret) of a concrete name."""
  base, sep, _ = name.partition("_interpret")
  return base, bool(sep)


# ---------------------------------------------------------------------------------------
# Which GPU families this process can use ("auto" on a GPU).
# ---------------------------------------------------------------------------------------

def gpu_choice(op: str) -> str:
  """The family "auto" runs `op` with on a GPU: the first usable one of
  GPU_PREFERENCE[op] (jnp when none is). A preferred family that is not usable is said
  once per process (`_say_fallback`), the use of Pallas' Triton backend once too."""
  prefs = GPU_PREFERENCE.get(op, ("triton", "jnp"))
  choice = next((name for name in prefs if usable(name)), "jnp")
  for name in prefs[:prefs.index(choice)] if choice in prefs else prefs:
    _say_fallback(name)
  if choice == "triton":
    _note_triton()
  return choice


def usable(name: str) -> bool:
  """Whether this process can run family `name` on its GPU: "jnp" always; "triton" when
  Pallas' Triton backend imports and lowers a probe kernel (`_triton_problem`);
  "mosaic_gpu" when this jax builds the Mosaic GPU kernels and the GPU (if one is
  attached) is Hopper or newer."""
  if name == "jnp":
    return True
  if name == "triton":
    return _triton_problem() is None
  if name == "mosaic_gpu":
    return _mosaic_gpu_problem() is None
  return False


@functools.lru_cache(maxsize=None)
def _triton_problem() -> Optional[str]:
  """None when Pallas' Triton backend works here, else why not (once per process): it
  must import, its deprecation must not have been made an error, and a small kernel of
  ours must lower for an abstract H200 (no GPU needed; in a thread of its own, so that a
  first use inside a trace starts from a clean trace state). JAX_KVALLOC_NO_TRITON=1
  makes it unusable whatever jax has."""
  if os.environ.get("JAX_KVALLOC_NO_TRITON", "0") not in ("", "0"):
    return "JAX_KVALLOC_NO_TRITON is set"
  try:
    from jax.experimental.pallas import triton  # pylint: disable=g-import-not-at-top,unused-import
  except Exception as e:  # pylint: disable=broad-except
    return f"it does not import ({type(e).__name__}: {e})"
  try:
    from jax._src import deprecations  # pylint: disable=g-import-not-at-top
    if deprecations.is_accelerated("jax-pallas-triton"):
      return "jax made its deprecation an error"
  except Exception:  # pylint: disable=broad-except  (no such registry: nothing accelerated)
    pass
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(_lower_triton_probe).result()


def _lower_triton_probe() -> Optional[str]:
  """Exports our one-launch decode kernel for an abstract H200 (jax.export: the Python
  side of Pallas' Triton lowering, on any machine); None, or why it failed."""
  try:
    from jax import export  # pylint: disable=g-import-not-at-top
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    from jax.sharding import AbstractMesh  # pylint: disable=g-import-not-at-top
    try:  # jax >= 0.11 exports it from jax.sharding
      from jax.sharding import AbstractDevice  # type: ignore[attr-defined]  # pylint: disable=g-import-not-at-top
    except ImportError:  # jax 0.10
      from jax._src.mesh import AbstractDevice  # type: ignore[no-redef]  # pylint: disable=g-import-not-at-top
    from pallas_kernels import triton_decode  # pylint: disable=g-import-not-at-top
    spec = jax.ShapeDtypeStruct
    probe = functools.partial(triton_decode.alloc_decode_triton, page_size=4)
    target = getattr(pltriton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device)):
      export.export(jax.jit(probe), platforms=["cuda"],
                    disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(
                        spec((8,), jnp.int32), *[spec((), jnp.int32)] * 3,
                        *[spec((4,), jnp.int32)] * 2)
  except Exception as e:  # pylint: disable=broad-except  (any failure means: not usable)
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return f"a kernel does not lower ({type(e).__name__}: {first})"
  return None


@functools.lru_cache(maxsize=None)
def _mosaic_gpu_problem() -> Optional[str]:
  """None when the Mosaic GPU kernels can run here, else why not (once per process)."""
  from pallas_kernels import mosaic_gpu_common  # pylint: disable=g-import-not-at-top
  if not mosaic_gpu_common.available():
    return f"jax {jax.__version__} does not build them (jax >= 0.11 does)"
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return None  # no GPU attached: exported or simulated, for a Hopper target
  capability = getattr(devices[0], "compute_capability", None) if devices else None
  try:
    if capability is not None and float(capability) < 9.0:
      return f"the GPU ({devices[0].device_kind}, sm {capability}) is older than Hopper"
  except (TypeError, ValueError):
    pass
  return None


@functools.lru_cache(maxsize=None)
def _say_fallback(family_name: str) -> None:
  """One log line (once per process and family): why the family is not usable and what
  "auto" runs each operation with instead."""
  why = {"triton": _triton_problem, "mosaic_gpu": _mosaic_gpu_problem}[family_name]()
  runs = {}
  for op, prefs in GPU_PREFERENCE.items():
    if family_name in prefs:
      chosen = next((n for n in prefs if n != family_name and usable(n)), "jnp")
      runs.setdefault(_FAMILY_TEXT.get(chosen, chosen), []).append(op)
  logger.warning("jax_kvalloc: %s is not usable here (%s); kernel='auto' on a GPU runs %s",
                 _FAMILY_TEXT.get(family_name, family_name), why,
                 "; ".join(f"{', '.join(ops)} with {text}" for text, ops in runs.items()))


@functools.lru_cache(maxsize=None)
def _note_triton() -> None:
  logger.info("jax_kvalloc: kernel='auto' runs Pallas' Triton kernels on this GPU; jax "
              "deprecates that backend (its warning is silenced for our kernels), and "
              "kernel='mosaic_gpu' runs the Mosaic GPU kernels instead")


_FAMILY_TEXT = {"triton": "Pallas' Triton backend", "mosaic_gpu": "Mosaic GPU",
                "jnp": "XLA"}

_SIMULATED_GPU = False


@contextlib.contextmanager
def simulated_gpu() -> Iterator[None]:
  """Within it, "auto" on a CPU pool resolves as on a GPU (`gpu_choice`), each kernel in
  its interpreter: the GPU selection, runnable on CPU (tests). Call sites that trace
  inside it must not be cached across it (jit retraces: the config is the same)."""
  global _SIMULATED_GPU
  old, _SIMULATED_GPU = _SIMULATED_GPU, True
  try:
    yield
  finally:
    _SIMULATED_GPU = old


def platform_of(x) -> Optional[str]:
  """The platform ("cpu", "gpu", "tpu", ...) of the device holding a concrete jax array;
  None for a tracer or anything else."""
  if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
    return None
  try:
    return next(iter(x.devices())).platform
  except Exception:  # pylint: disable=broad-except
    return None


def _abstract_mesh_platform() -> Optional[str]:
  """The platform of the abstract device of the abstract mesh in scope, if any."""
  get = getattr(jax.sharding, "get_abstract_mesh", None)
  try:
    if get is None:
      from jax._src.mesh import get_abstract_mesh as get  # pylint: disable=g-import-not-at-top
    device = getattr(get(), "abstract_device", None)
  except Exception:  # pylint: disable=broad-except
    return None
  return getattr(device, "platform", None)


@functools.lru_cache(maxsize=None)
def _backend_platforms() -> Tuple[str, ...]:
  """lax.platform_dependent keys of the backends this process has (sorted); every
  platform where jax does not say."""
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    names = set(xla_bridge.backends())
  except Exception:  # pylint: disable=broad-except
    return _PLATFORMS
  out = set()
  for name in names:
    out.update(("cuda", "rocm") if name == "gpu" else (name,))
  return tuple(sorted(p for p in out if p in _PLATFORMS)) or ("cpu",)


def trace_platforms(pool: Array) -> Tuple[str, ...]:
  """The platforms a computation on `pool` may be lowered for, as far as is known now:
  one for a concrete array, an abstract mesh's device, or a process with one backend;
  else every backend's."""
  platform = platform_of(pool) or _abstract_mesh_platform()
  if platform is not None:
    return (platform,)
  return _backend_platforms()


def by_device(kernel: str, pool: Array, fn: Callable[[str], T],
              op: Optional[str] = None) -> T:
  """fn(name): the allocator's work for operation `op` (a key of GPU_PREFERENCE) with
  `kernel` resolved to a concrete name (one of CONCRETE) for the platform of the device
  that holds `pool` (an array of the state).

  Only the names in BY_PLATFORM depend on it; those trace the one branch of the
  platform known at trace time (`trace_platforms`), or, where several are possible, a
  `lax.platform_dependent` over the distinct names they select (resolved when lowering,
  so the compiled program holds the chosen branch alone).
  """
  if kernel not in BY_PLATFORM:
    return fn(kernel)
  platforms = trace_platforms(pool)
  names = {p: for_platform(kernel, p, op) for p in platforms}
  if len(set(names.values())) == 1:
    return fn(next(iter(names.values())))
  branches = {p: (lambda name=name: fn(name)) for p, name in names.items()
              if p in _PLATFORMS}
  return jax.lax.platform_dependent(**branches, default=branches[platforms[0]])


def by_branch_cost(pool: Array, fn: Callable[[bool], T]) -> T:
  """fn(cheap): the work on a pool where a data-dependent branch (lax.cond) is cheap
  (CPU, TPU: cheap=True) or waits for the host (GPU: False), for the platforms of the
  device that holds `pool` as `trace_platforms` knows them; where both kinds are
  possible, a `lax.platform_dependent` of the two (resolved when lowering)."""
  gpu = {p: p in ("gpu", "cuda", "rocm") for p in trace_platforms(pool)}
  if all(gpu.values()):
    return fn(False)
  if not any(gpu.values()):
    return fn(True)
  return jax.lax.platform_dependent(cuda=lambda: fn(False), rocm=lambda: fn(False),
                                    default=lambda: fn(True))


def extend_indices(name: str, free_window: Array, prefix_lens: Array, seq_lens: Array,
                   last_loc: Array, tok_start: Array, page_start: Array, *,
                   page_size: int, out_len: int, held: Optional[Array] = None):
  """`index_jnp.extend_indices` (i32[out_len]) through the implementation of the
  concrete `name`. held (only where `extend_keeps_record(name)`): the ownership
  record's held pages, marked in the kernel's own launch; returns (out, held) then."""
  base, interpret = family(name)
  args = (free_window, prefix_lens, seq_lens, last_loc, tok_start, page_start)
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  if held is not None:
    if not extend_keeps_record(name):
      raise ValueError(f"the {name!r} extend kernel does not keep the ownership record")
    return pallas_kernels.extend_indices_triton(*args, page_size=page_size,
                                                out_len=out_len, interpret=interpret,
                                                held=held)
  if base not in ("triton", "mosaic"):  # jnp, and families with no index kernel
    return index_jnp.extend_indices(*args, page_size=page_size, out_len=out_len)
  return pallas_kernels.extend_indices(*args, page_size=page_size, out_len=out_len,
                                       interpret=interpret, backend=base)


def extend_keeps_record(name: str) -> bool:
  """Whether `extend_indices` of the concrete `name` marks the ownership record's held
  pages in its own launch (the Triton kernel); elsewhere XLA marks them around it."""
  return family(name)[0] == "triton"


def decode_indices(name: str, free_window: Array, seq_lens: Array, last_loc: Array,
                   page_start: Array, *, page_size: int) -> Array:
  """`index_jnp.decode_indices` (i32[B]) through the implementation of the concrete
  `name`."""
  base, interpret = family(name)
  args = (free_window, seq_lens, last_loc, page_start)
  if base not in ("triton", "mosaic"):  # jnp, and families with no index kernel
    return index_jnp.decode_indices(*args, page_size=page_size)
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  return pallas_kernels.decode_indices(*args, page_size=page_size, interpret=interpret,
                                       backend=base)


def fused_triton(config: AllocatorConfig, name: Optional[str]) -> Optional[bool]:
  """The interpret flag when the one-launch Triton calls apply to `name` (None: the
  config's kernel on the default backend), else None."""
  base, interpret = family(name or resolve(config.kernel))
  if base != "triton" or config.debug:
    return None
  return interpret


def _num_reqs(num_reqs: Optional[Array], num_rows: int) -> Array:
  if num_reqs is None:
    return jnp.full((), num_rows, jnp.int32)
  return jnp.asarray(num_reqs, jnp.int32)


def alloc_extend_fused(config: AllocatorConfig, state: AllocatorState, prefix_lens: Array,
                       seq_lens: Array, last_loc: Array, num_reqs: Optional[Array], *,
                       max_tokens: int, name: Optional[str] = None) -> Optional[AllocResult]:
  """allocation.alloc_extend after its need_sort merge, as one Triton kernel launch.

  Args: as allocation.alloc_extend (i32[B] rows, raw: padded rows are masked inside);
  `state` is the state after any merge; `name` the concrete implementation `by_device`
  handed out (None: config.kernel on the default backend). Returns (state,
  i32[max_tokens], bool[] ok), bit-identical to the jnp path, or None where the fused
  kernel does not apply.
  """
  interpret = fused_triton(config, name)
  if interpret is None:
    return None
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  num_rows = prefix_lens.shape[0]
  if not pallas_kernels.extend_fused_preferred(num_rows, max_tokens, config.num_pages):
    return None  # large batches: XLA prefix sums + the contract kernel scale better
  res = pallas_kernels.alloc_extend_triton(
      state.free_ring, state.free_head, state.free_len, _num_reqs(num_reqs, num_rows),
      prefix_lens, seq_lens, last_loc, page_size=config.page_size, out_len=max_tokens,
      interpret=interpret, held=_held(state))
  return _taken(state, res), res[0], res[3]


def alloc_decode_fused(config: AllocatorConfig, state: AllocatorState, seq_lens: Array,
                       last_loc: Array, num_reqs: Optional[Array], *,
                       name: Optional[str] = None) -> Optional[AllocResult]:
  """allocation.alloc_decode after its need_sort merge, as one kernel launch (Triton or
  Mosaic GPU, by `name`'s family).

  Args: as allocation.alloc_decode (i32[B] rows, raw); `state` is the state after any
  merge; `name` as in `alloc_extend_fused`. Returns (state, i32[B], bool[] ok),
  bit-identical to the jnp path, or None where no one-launch kernel applies.
  """
  base, interpret = family(name or resolve(config.kernel, "alloc_decode"))
  if config.debug or base not in ("triton", "mosaic_gpu"):
    return None
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  b, n = seq_lens.shape[0], config.num_pages
  if base == "triton":
    if not pallas_kernels.decode_fused_supported(b, n):
      return None
    res = pallas_kernels.alloc_decode_triton(
        state.free_ring, state.free_head, state.free_len, _num_reqs(num_reqs, b),
        seq_lens, last_loc, page_size=config.page_size, interpret=interpret,
        held=_held(state))
    return _taken(state, res), res[0], res[3]
  if not pallas_kernels.decode_mosaic_gpu_supported(b, n):
    return None
  res = pallas_kernels.alloc_decode_mosaic_gpu(
      state.free_ring, state.free_head, state.free_len, _num_reqs(num_reqs, b), seq_lens,
      last_loc, page_size=config.page_size, interpret=interpret, held=_held(state))
  return _taken(state, res), res[0], res[3]


def _held(state: AllocatorState) -> Optional[Array]:
  """The ownership record's held pages, which the fused kernels keep (None: no record)."""
  return None if state.guard is None else state.guard.held


def _taken(state: AllocatorState, res: Tuple[Array, ...]) -> AllocatorState:
  """The state after a fused allocation (slots, head, length, ok[, held])."""
  state = state._replace(free_head=res[1], free_len=res[2])
  if state.guard is None:
    return state
  return state._replace(guard=state.guard._replace(held=res[4]))


def release_alloc_decode_fused(config: AllocatorConfig, state: AllocatorState,
                               page_ids: Array, num: Optional[Array], seq_lens: Array,
                               last_loc: Array, num_reqs: Optional[Array], *,
                               name: Optional[str] = None) -> Optional[AllocResult]:
  """allocation.release_and_alloc_decode (free_page_ids, then alloc_decode) as one Triton
  kernel launch.

  Args: as allocation.release_and_alloc_decode (page_ids i32[M], num i32[] or None, i32[B]
  rows, raw: the kernel masks padding itself); `name` as in `alloc_extend_fused`.
  Returns (state, i32[B], bool[] ok), bit-identical to the composition on the jnp path,
  or None where the kernel does not apply: a family other than Triton, debug mode,
  need_sort (its release goes to release_pages and its decode may merge first), the
  token allocator, and sizes `pallas_kernels.release_decode_supported` refuses.
  """
  if config.kind != "paged" or config.need_sort:
    return None
  interpret = fused_triton(config, name)
  if interpret is None:
    return None
  import pallas_kernels  # pylint: disable=g-import-not-at-top
  m, b = page_ids.shape[0], seq_lens.shape[0]
  if not pallas_kernels.release_decode_supported(b, m, config.num_pages):
    return None
  from jax_kvalloc import guard  # pylint: disable=g-import-not-at-top
  res = pallas_kernels.release_alloc_decode_triton(
      state.free_ring, state.free_head, state.free_len, state.release_len, page_ids,
      jnp.full((), m, jnp.int32) if num is None else num, _num_reqs(num_reqs, b),
      seq_lens, last_loc, page_size=config.page_size, interpret=interpret,
      record=state.guard, op=guard.OP_RELEASE_AND_ALLOC_DECODE)
  ring, head, length, out, ok = res[:5]
  state = state._replace(free_ring=ring, free_head=head, free_len=length)
  if state.guard is not None:
    state = state._replace(guard=guard.GuardState(*res[5:]))
  return state, out, ok
