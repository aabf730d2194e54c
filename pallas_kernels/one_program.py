"""A chain of small array operations as one Triton program (GPU).

`run(fn, *args)` calls `fn(*args)` inside a single Pallas-Triton program: every input is
loaded whole, `fn` runs on the values, every output is stored whole. Where XLA would
launch each of a long chain of small reductions as its own kernel (about a microsecond
each on a GPU, even inside a CUDA graph), this is one launch.

An argument wrapped in `Gather` is not loaded whole: `fn` reads it with `.take(idx)`,
one gathering load in the program (any length: a workload of a million requests read a
window at a time).

`fn` must use only what the Triton lowering runs on values: elementwise operations,
comparisons, `where`, broadcasts, iota, reductions along an axis, integer division and
shifts; no gathers, scatters, slices or sorts (index a small vector by comparing it with
an iota and reducing). A select between two constants (`jnp.where(p, 3, 0)` on scalars)
is refused: Pallas' Triton lowering gives both constants the predicate's type (i1), so it
would return 1 or 0 (write `3 * p.astype(jnp.int32)`). Every input and output is an
int32 array (or scalar) whose size is a power of two, and every intermediate lives in one
program's registers: this is for vectors of at most a few hundred entries.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util
from jax.experimental.pallas import triton as pltriton
from jax.extend import core as jax_core

from pallas_kernels._util import TritonCall, is_pow2


@jax.tree_util.register_pytree_node_class
class Gather:
  """An int32[N] argument of `run` that `fn` reads by index only (`take`), any N."""

  def __init__(self, source):
    self.source = source  # the array, or inside the program its ref

  def tree_flatten(self):
    return (self.source,), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(*children)

  def take(self, idx: jax.Array) -> jax.Array:
    """source[clip(idx, 0, N - 1)]: int32 of idx's shape."""
    idx = jnp.clip(idx, 0, self.source.shape[0] - 1)
    if isinstance(self.source, _Ref):
      return pltriton.load(self.source.ref.at[idx])
    return jnp.take(self.source, idx)


@dataclasses.dataclass(frozen=True)
class _Ref:
  """A Gather's source inside the program: its ref."""
  ref: Any

  @property
  def shape(self):
    return self.ref.shape


@dataclasses.dataclass(frozen=True)
class _Fn:
  fn: Callable[..., Any]
  in_tree: Any
  out_shapes: Tuple[Tuple[int, ...], ...]
  aliases: Tuple[Tuple[int, int], ...]  # (input leaf, output leaf) sharing a buffer
  gathered: Tuple[bool, ...]            # per input leaf: a Gather's source (not loaded)


def _body(*refs, p: _Fn):
  n_in = p.in_tree.num_leaves
  args = jax.tree_util.tree_unflatten(p.in_tree, [
      _Ref(r) if g else r[...] for r, g in zip(refs[:n_in], p.gathered)])
  outs = jax.tree_util.tree_leaves(p.fn(*args))
  for ref, value in zip(refs[n_in:], outs):
    ref[...] = jnp.asarray(value, jnp.int32)


def _constant_selects(jaxpr, constant, where: str = "") -> list:
  """Source lines of select_n equations whose cases are all constants (literals, or
  parameters of an inner jaxpr bound to them); `constant(var)` says which outer ones."""
  found = []
  for eqn in jaxpr.eqns:
    const = [constant(v) for v in eqn.invars]
    line = where or source_info_util.summarize(eqn.source_info)
    if eqn.primitive.name == "select_n" and all(const[1:]):
      found.append(line)
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", param)
      if hasattr(inner, "eqns") and len(inner.invars) == len(const):
        bound = {id(v): c for v, c in zip(inner.invars, const)}
        found += _constant_selects(inner, lambda v, b=bound: b.get(id(v), False), line)
  return found


@dataclasses.dataclass(frozen=True)
class _OneProgram(TritonCall):
  def spec(self):
    out = tuple(jax.ShapeDtypeStruct(s, jnp.int32) for s in self.p.out_shapes)
    return out, _body, ()

  def aliases(self) -> dict:
    return dict(self.p.aliases)


def run(fn: Callable[..., Any], *args: Any, interpret: bool = False, name: str = "fn",
        num_warps: int = 4, update: Tuple[Tuple[int, int], ...] = ()) -> Any:
  """fn(*args) as one Triton program.

  Args:
    fn: a function of pytrees of int32 arrays, returning a pytree (a tuple when `update`
      is given) of int32 or bool arrays; hashable (it is a primitive parameter).
    *args: its arguments; a `Gather` leaf is read by `take` only.
    interpret: run in Pallas' interpreter (any backend).
    name: the kernel's name (in profiles and HLO).
    num_warps: the program's warps.
    update: (argument index, result index) pairs, a result index being a position in
      the tuple fn returns, of the same tree structure and shapes: that result is
      written over that argument's buffers (input_output_aliases; in place when the
      caller donates them, as a loop's carry does).

  Returns:
    fn(*args): the same pytree, dtypes and values.

  Raises:
    ValueError naming the leaf when an argument is not int32, a result not int32 or
    bool, or a size not a power of two (a Gather's source: not 1-D); naming the line of
    a select between two constants; naming an `update` pair whose sides differ.
  """
  leaves, in_tree = jax.tree_util.tree_flatten(args)
  gathered = tuple(isinstance(x, Gather) for x in jax.tree_util.tree_leaves(
      args, is_leaf=lambda x: isinstance(x, Gather)))
  jaxpr, out = jax.make_jaxpr(fn, return_shape=True)(*args)
  out_leaves, out_tree = jax.tree_util.tree_flatten(out)
  for kind, tree, ls, ok, whole in (
      ("argument", in_tree, leaves, (jnp.int32,), gathered),
      ("result", out_tree, out_leaves, (jnp.int32, jnp.bool_), (False,) * len(out_leaves))):
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(
        jax.tree_util.tree_unflatten(tree, ls))[0]]
    for path, leaf, g in zip(paths, ls, whole):
      dtype, size = jnp.dtype(leaf.dtype), int(np.prod(leaf.shape))
      if dtype not in ok or not (len(leaf.shape) == 1 if g else is_pow2(size)):
        raise ValueError(f"one_program.run({name}): {kind} {path} is {dtype}"
                         f"{tuple(leaf.shape)}; every leaf must be int32 (a result may be "
                         "bool) of a power-of-two size, a Gather's source 1-D")
  bad = _constant_selects(jaxpr.jaxpr, lambda v: isinstance(v, jax_core.Literal))
  if bad:
    raise ValueError(f"one_program.run({name}): a select between two constants at "
                     f"{bad[0]} (the Triton lowering makes them i1: write the select as "
                     "arithmetic)")
  firsts = lambda tree: np.cumsum([0] + [t.num_leaves for t in tree.children()])
  in_first, out_first = firsts(in_tree), firsts(out_tree)
  pairs = []
  for a, r in update:
    if (jax.tree_util.tree_structure(args[a]) != jax.tree_util.tree_structure(out[r])
        or any(np.shape(x) != y.shape for x, y in zip(
            jax.tree_util.tree_leaves(args[a]), jax.tree_util.tree_leaves(out[r])))):
      raise ValueError(f"one_program.run({name}): update ({a}, {r}): argument {a} and "
                       f"result {r} differ in structure or shapes")
    pairs += [(int(in_first[a] + i), int(out_first[r] + i))
              for i in range(out_first[r + 1] - out_first[r])]
  call = _OneProgram(name=name, p=_Fn(fn, in_tree, tuple(tuple(o.shape) for o in out_leaves),
                                      tuple(pairs), gathered),
                     num_warps=num_warps, interpret=interpret)
  outs = call.run(*leaves)
  return jax.tree_util.tree_unflatten(out_tree, [
      o.astype(l.dtype) for o, l in zip(outs, out_leaves)])
