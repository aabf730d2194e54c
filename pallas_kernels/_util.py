"""Small helpers shared by the Triton and Mosaic kernels.

- Integer arithmetic by a static page size: shifts and masks when it is a power of two
  (they equal jnp's floor `//` and `%` for every sign), jnp's `//`/`%` otherwise.
- `load` / `store`: the Triton kernels' masked gathers and scatters, every index clamped
  into its buffer (no lane ever leaves it, SGLang issue 34399).
- `quiet_triton`: runs a Pallas-Triton call so that jax's "Pallas Triton backend is
  deprecated" DeprecationWarning (jax >= 0.11, emitted when the call is lowered) is
  silenced for our kernels only. The call is wrapped in a private primitive whose lowering
  rule installs the filter around the Pallas lowering, so the filter is active exactly
  while our kernel is lowered: users' own Pallas-Triton kernels still warn, and no other
  warning is touched.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching
from jax.interpreters import mlir

Array = jax.Array
INT32_MAX = 2**31 - 1

# The text jax's deprecation starts with (jax/_src/pallas/triton/pallas_call_registration.py).
_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


def next_pow2(n: int) -> int:
  """The smallest power of two >= max(n, 1)."""
  return 1 << (max(int(n), 1) - 1).bit_length()


def is_pow2(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def floordiv(x: Array, ps: int) -> Array:
  """x // ps (floor, any sign) for a static ps >= 1."""
  if ps == 1:
    return x
  if is_pow2(ps):
    return x >> (ps.bit_length() - 1)
  return x // ps


def mod(x: Array, ps: int) -> Array:
  """x % ps (floor, any sign) for a static ps >= 1."""
  if ps == 1:
    return jnp.zeros_like(x)
  if is_pow2(ps):
    return x & (ps - 1)
  return x % ps


def cdiv(x: Array, ps: int) -> Array:
  """ceil(x / ps) as index_jnp.cdiv: -((-x) // ps)."""
  return -floordiv(-x, ps)


def highest_pow2_at_most(n: Array) -> Array:
  """The largest power of two <= n for an int32 scalar n >= 1 (bit smearing)."""
  for s in (1, 2, 4, 8, 16):
    n = n | (n >> s)
  return n - (n >> 1)


def load(ref, idx: Array, mask: Array, other=0) -> Array:
  """Masked gather of ref[idx] in a Triton kernel; idx is clamped into ref, so no lane
  ever reads outside it."""
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
  n = ref.shape[0]
  return pltriton.load(ref.at[jnp.clip(idx, 0, n - 1)], mask=mask, other=other)


def store(ref, idx: Array, value: Array, mask: Array) -> None:
  """Masked scatter in a Triton kernel. Masked-off lanes point past the end: they write
  nothing, also in interpret mode, where a lane that aliased a written one could
  otherwise win."""
  from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
  n = ref.shape[0]
  pltriton.store(ref.at[jnp.where(mask, jnp.clip(idx, 0, n - 1), n)], value, mask=mask)


# ---------------------------------------------------------------------------------------
# Scoped silencing of the Pallas-Triton deprecation warning.
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Vmapped:
  """fn vmapped over the given input axes (outputs batched on axis 0); hashable."""
  fn: Callable[..., Any]
  in_axes: Tuple[Any, ...]

  def __call__(self, *args):
    return jax.vmap(self.fn, in_axes=self.in_axes, out_axes=0)(*args)


_quiet_p = Primitive("jax_kvalloc_triton_call")
_quiet_p.multiple_results = True


def _silenced(thunk):
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION,
                            category=DeprecationWarning)
    return thunk()


def _quiet_impl(*args, fn):
  return _silenced(lambda: tuple(fn(*args)))


def _quiet_abstract_eval(*avals, fn):
  outs = jax.eval_shape(fn, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
  return [jax.core.ShapedArray(o.shape, o.dtype) for o in outs]


def _quiet_lowering(ctx, *args, fn):
  platforms = tuple(getattr(ctx.module_context, "platforms", None) or ())
  if platforms and all(p == "cpu" for p in platforms):
    raise ValueError(
        f"{getattr(fn, 'name', 'this kernel')} is a Pallas-Triton kernel: it compiles for "
        "a GPU only. On CPU use kernel='triton_interpret' (the same kernel in Pallas' "
        "interpreter) or kernel='jnp'.")
  return _silenced(lambda: mlir.lower_fun(lambda *a: tuple(fn(*a)),
                                          multiple_results=True)(ctx, *args))


def _quiet_batching(args, dims, *, fn):
  in_axes = tuple(d if isinstance(d, int) else None for d in dims)  # None: not mapped
  outs = _quiet_p.bind(*args, fn=_Vmapped(fn, in_axes))
  return outs, [0] * len(outs)


_quiet_p.def_impl(_quiet_impl)
_quiet_p.def_abstract_eval(_quiet_abstract_eval)
mlir.register_lowering(_quiet_p, _quiet_lowering)
batching.primitive_batchers[_quiet_p] = _quiet_batching


def quiet_triton(fn: Callable[..., Sequence[Array]], *args: Array) -> Tuple[Array, ...]:
  """fn(*args) (a Pallas-Triton call returning a tuple of arrays), lowered with jax's
  Triton deprecation warning silenced for this call only. `fn` must be hashable (a
  frozen dataclass or a module-level function), since it is a primitive parameter."""
  return tuple(_quiet_p.bind(*args, fn=fn))


def check_ints(**arrays: Any) -> Tuple[Array, ...]:
  """The arguments as int32 arrays, in the order given; TypeError naming the first one
  whose dtype is not an integer type (floats would be truncated, bools are not indices).
  A static check (trace time, no cost)."""
  out = []
  for name, x in arrays.items():
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
    out.append(x.astype(jnp.int32))
  return tuple(out)


def extend_contract_args(out_len: int, free_window, prefix_lens, seq_lens, last_loc,
                         tok_start, page_start):
  """The extend contract kernels' common entry: `check_ints` of the six arrays and the
  results that need no kernel. Returns (checked arrays, None), or (arrays, i32[out_len]
  zeros) when there is nothing to compute (out_len 0 or no rows)."""
  args = check_ints(free_window=free_window, prefix_lens=prefix_lens, seq_lens=seq_lens,
                    last_loc=last_loc, tok_start=tok_start, page_start=page_start)
  if out_len == 0:
    return args, jnp.zeros((0,), jnp.int32)
  if args[1].shape[0] == 0:  # prefix_lens: no rows
    return args, jnp.zeros((out_len,), jnp.int32)
  return args, None


def table_step_args(name: str, supported: Callable[..., bool], page_size: int,
                    max_tokens: int, release, extend, decode, note: str = "",
                    **table: Any) -> Tuple[Tuple[Array, ...], dict]:
  """A table-step kernel's common entry: `check_ints` of the table arrays (free_ring,
  free_head, free_len, release_len, pages, lens, owned_from, in that order) and the
  phase sizes {"release", "extend", "decode"} (0 for an absent phase). ValueError naming
  `name` when `supported` refuses the sizes (`note` is added to the message)."""
  arrays = check_ints(**table)
  pages = arrays[4]
  max_reqs, width = pages.shape
  n = arrays[0].shape[0]
  sizes = dict(release=0 if release is None else release[0].shape[0],
               extend=0 if extend is None else extend[0].shape[0],
               decode=0 if decode is None else decode[0].shape[0])
  if not supported(max_reqs=max_reqs, width=width, num_pages=n, page_size=page_size,
                   max_tokens=max_tokens, **sizes):
    raise ValueError(f"{name} does not take {sizes}, {max_tokens=}, a table of "
                     f"{max_reqs}x{width}, ring length {n} (see supported{note})")
  return arrays, sizes


def store_take(head_out, len_out, ok_out, *, head, length, ring_len: int, pages, ok) -> None:
  """The fused kernels' last write (one program): the free list's new head and length
  after taking `pages` from its front when `ok`, and `ok` itself. i32/bool[1] refs."""
  taken = jnp.where(ok, pages, 0)
  new_head = head + taken
  head_out[0] = jnp.where(new_head >= ring_len, new_head - ring_len, new_head)
  len_out[0] = length - taken
  ok_out[0] = ok


@dataclasses.dataclass(frozen=True)
class TritonCall:
  """The pallas_call of one Triton kernel configuration (hashable: a primitive
  parameter). A kernel file subclasses it and defines `spec() -> (out_shape, body,
  grid)`; `run(*args)` casts the arguments to int32 and calls it, through `quiet_triton`
  unless interpreting."""
  name: str        # the pallas_call's name, also shown in jaxprs
  p: Any           # the kernel's static parameters (a frozen dataclass)
  num_warps: int
  interpret: bool

  def spec(self):
    raise NotImplementedError

  def aliases(self) -> dict:
    """The pallas_call's input_output_aliases ({input index: output index}); none by
    default."""
    return {}

  def __call__(self, *args):
    import functools  # pylint: disable=g-import-not-at-top
    from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
    from jax.experimental.pallas import triton as pltriton  # pylint: disable=g-import-not-at-top
    out_shape, body, grid = self.spec()
    return pl.pallas_call(
        functools.partial(body, p=self.p), out_shape=out_shape, grid=grid,
        compiler_params=pltriton.CompilerParams(num_warps=self.num_warps, num_stages=1),
        input_output_aliases=self.aliases(), interpret=self.interpret,
        name=self.name)(*args)

  def run(self, *args):
    args = tuple(jnp.asarray(a, jnp.int32) for a in args)
    if self.interpret:
      return tuple(self(*args))
    return quiet_triton(self, *args)

