"""Ranks over several processes (SPEC 12 across hosts): which ranks a process holds, how
it hands in its ranks' inputs, how it reads back its ranks' outputs.

With `jax.distributed.initialize()` every process (one per host on a TPU pod) sees all
devices in `jax.devices()` but can only touch its own (`jax.local_devices()`). A ranked
state sharded over a mesh axis (jax_kvalloc.ranks, `ranks.rank_sharding(mesh, axis)`)
keeps rank r on the devices of mesh position r // (dp_size // mesh.shape[axis]), so each
process holds the ranks of its devices, and the ranked operations, having no collective,
run on every process without any process waiting for another. A global array such as
i32[dp_size, B] is then never built on one host: each process supplies the rows of its own
ranks (`put_ranks`) and reads back only those (`get_ranks`). Both work the same in one
process (every rank is local there), so one code path serves both.

Every process must make the same calls in the same order (each call is one program
over all processes' devices). Read each step's outputs before the next step, as a
scheduler does: on jax 0.10.2 with CPU devices, hundreds of steps dispatched back to back
without waiting can hang.

The local rows of a process are always in the order of `process_ranks` (ascending global
rank). A rank replicated over devices of several processes (a mesh with another axis
that spans processes) is held by all of them, and each must supply the same rows for it.

    mine = multiprocess.process_ranks(mesh, "dp", dp)        # e.g. (4, 5, 6, 7)
    seq = multiprocess.put_ranks(local_seq, mesh, "dp", dp)  # local_seq: i32[len(mine), B]
    state, slots, ok = r.alloc_decode(state, seq, last)
    my_slots = multiprocess.get_ranks(slots)                 # np i32[len(mine), B]
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np

Array = jax.Array


def _sharding(mesh: jax.sharding.Mesh, axis_name: str) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis_name))


def check_axis(mesh: jax.sharding.Mesh, axis_name: str, dp_size: int) -> int:
  """The ranks per device; ValueError unless `axis_name` is an axis of `mesh` whose size
  divides dp_size."""
  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh "
                     f"(axes: {tuple(mesh.shape)})")
  n = mesh.shape[axis_name]
  if dp_size % n:
    raise ValueError(f"dp_size={dp_size} must be a multiple of the mesh axis "
                     f"{axis_name!r} of size {n}: each device holds whole ranks")
  return dp_size // n


def _rank_slices(mesh: jax.sharding.Mesh, axis_name: str, dp_size: int
                 ) -> Dict[jax.Device, range]:
  """The ranks on each device of the mesh (a range of global ranks)."""
  per = check_axis(mesh, axis_name, dp_size)
  axis = tuple(mesh.shape).index(axis_name)
  out = {}
  for pos, device in np.ndenumerate(mesh.devices):
    out[device] = range(pos[axis] * per, (pos[axis] + 1) * per)
  return out


def process_ranks(mesh: jax.sharding.Mesh, axis_name: str, dp_size: int,
                  process_index: Optional[int] = None) -> Tuple[int, ...]:
  """The global ranks held by a process's devices, ascending.

  Args:
    mesh: the mesh the ranked state is sharded over (may span processes).
    axis_name: the mesh axis of the rank axis.
    dp_size: the number of ranks (a multiple of the axis size).
    process_index: which process (default: this one, `jax.process_index()`).

  Returns:
    A tuple of ints: the ranks whose rows this process supplies to `put_ranks` and gets
    from `get_ranks`, in that order; empty when the process has no device in the mesh.

  Raises:
    ValueError for an axis not in the mesh or a dp_size it does not divide.
  """
  if process_index is None:
    process_index = jax.process_index()
  mine = set()
  for device, ranks in _rank_slices(mesh, axis_name, dp_size).items():
    if device.process_index == process_index:
      mine.update(ranks)
  return tuple(sorted(mine))


def put_ranks(local: Any, mesh: jax.sharding.Mesh, axis_name: str, dp_size: int) -> Any:
  """A global ranked array (or pytree of them) from this process's rows.

  Each leaf of `local` is array-like of shape [len(process_ranks(...)), ...]: the rows of
  this process's ranks in process_ranks order. The result has shape [dp_size, ...],
  sharded over `axis_name` (ranks.rank_sharding), and is built from local data only
  (`jax.make_array_from_callback`): nothing is sent to or checked with other processes.
  In one process, `local` is simply every rank's rows.

  Raises:
    ValueError naming the leaf's shape when its leading axis is not this process's rank
    count.
  """
  mine = process_ranks(mesh, axis_name, dp_size)
  where = {r: i for i, r in enumerate(mine)}
  sharding = _sharding(mesh, axis_name)

  def one(x):
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[0] != len(mine):
      raise ValueError(f"local rows must have a leading axis of this process's "
                       f"{len(mine)} ranks {mine}, got shape {x.shape}")

    def rows(index):
      # index: the device's slice of the global array; its first entry, of the rank axis.
      want = range(dp_size)[index[0]]
      return x[[where[r] for r in want]]

    return jax.make_array_from_callback((dp_size,) + x.shape[1:], sharding, rows)

  return jax.tree.map(one, local)


def get_ranks(x: Any) -> Any:
  """This process's rows of a ranked array (or pytree of them), as NumPy.

  Reads only addressable shards (`np.asarray` of a global array that other processes
  share would fail): each leaf [dp_size, ...] gives np [k, ...], the rows of the k ranks
  this process holds in ascending rank order (process_ranks order for an array sharded
  by ranks.rank_sharding). In one process: every rank's rows.

  Raises:
    ValueError when a leaf is split along an axis other than the leading one.
  """
  def one(a):
    if not isinstance(a, jax.Array):
      return np.asarray(a)
    if a.ndim == 0:
      raise ValueError("get_ranks needs a leading rank axis, got a scalar")
    rows: Dict[int, np.ndarray] = {}
    for shard in a.addressable_shards:
      for i, full in zip(shard.index[1:], a.shape[1:]):
        if range(full)[i] != range(full):
          raise ValueError(f"array of shape {a.shape} is split along an inner axis "
                           f"({shard.index}); expected ranks.rank_sharding")
      data = None
      for k, r in enumerate(range(a.shape[0])[shard.index[0]]):
        if r not in rows:
          data = np.asarray(shard.data) if data is None else data
          rows[r] = data[k]
    order = sorted(rows)
    if not order:
      return np.zeros((0,) + a.shape[1:], a.dtype)
    return np.stack([rows[r] for r in order])

  return jax.tree.map(one, x)
