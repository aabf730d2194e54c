"""A chain of small array operations as one Triton program (GPU).

`run(fn, *args)` calls `fn(*args)` inside a single Pallas-Triton program: every input is
loaded whole, `fn` runs on the values, every output is stored whole. Where XLA would
launch each of a long chain of small reductions as its own kernel (about a microsecond
each on a GPU, even inside a CUDA graph), this is one launch.

`fn` must use only what the Triton lowering runs on values: elementwise operations,
comparisons, `where`, broadcasts, iota, reductions along an axis, integer division and
shifts; no gathers, scatters, slices or sorts (index a small vector by comparing it with
an iota and reducing). Every input and output is an int32 array (or scalar) whose size
is a power of two, so a (R, R) intermediate of R rows must fit one program: this is
for vectors of at most a few hundred entries.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._util import TritonCall, is_pow2


@dataclasses.dataclass(frozen=True)
class _Fn:
  fn: Callable[..., Any]
  in_tree: Any
  out_tree: Any
  out_shapes: Tuple[Tuple[int, ...], ...]


def _body(*refs, p: _Fn):
  n_in = p.in_tree.num_leaves
  args = jax.tree_util.tree_unflatten(p.in_tree, [r[...] for r in refs[:n_in]])
  outs = jax.tree_util.tree_leaves(p.fn(*args))
  for ref, value in zip(refs[n_in:], outs):
    ref[...] = jnp.asarray(value, jnp.int32)


@dataclasses.dataclass(frozen=True)
class _OneProgram(TritonCall):
  def spec(self):
    out = tuple(jax.ShapeDtypeStruct(s, jnp.int32) for s in self.p.out_shapes)
    return out, _body, ()


def run(fn: Callable[..., Any], *args: Any, interpret: bool = False, name: str = "fn",
        num_warps: int = 4) -> Any:
  """fn(*args) as one Triton program (pytrees in and out, int32 leaves).

  Raises ValueError naming the leaf when an input is not int32, an output not int32 or
  bool (stored as 0/1), or a size not a power of two. interpret: run in Pallas'
  interpreter (any backend)."""
  leaves, in_tree = jax.tree_util.tree_flatten(args)
  out = jax.eval_shape(fn, *args)
  out_leaves, out_tree = jax.tree_util.tree_flatten(out)
  for kind, tree, ls, ok in (("argument", in_tree, leaves, (jnp.int32,)),
                              ("result", out_tree, out_leaves, (jnp.int32, jnp.bool_))):
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(tree, ls))[0]]
    for path, leaf in zip(paths, ls):
      dtype, size = jnp.dtype(leaf.dtype), int(np.prod(leaf.shape))
      if dtype not in ok or not is_pow2(size):
        raise ValueError(f"one_program.run({name}): {kind} {path} is {dtype}"
                         f"{tuple(leaf.shape)}; every leaf must be int32 (a result may be "
                         "bool) of a power-of-two size")
  call = _OneProgram(name=name, p=_Fn(fn, in_tree, out_tree,
                                      tuple(tuple(o.shape) for o in out_leaves)),
                     num_warps=num_warps, interpret=interpret)
  outs = call.run(*leaves)
  return jax.tree_util.tree_unflatten(out_tree, [
      o.astype(l.dtype) for o, l in zip(outs, out_leaves)])
