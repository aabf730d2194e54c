"""Ranks over several processes (jax_kvalloc.multiprocess): 2 processes x 2 CPU devices,
started here with jax.distributed, replay a ranked random trace of every operation of
jax_kvalloc.ranks (pool and request table); each process's ranks must equal, bit for
bit and step by step, a single-process run of the same trace (4 devices, one process),
and the host mirrors' hashes, exchanged at the end, must agree.

Every process also checks each step against the model (tests/rank_trace.py). The
children run under `timeout -s KILL` with a deadline, so a hang fails the test instead
of stalling CI; all three runs start at once and compile at XLA's lowest backend
optimization level (integer programs: the results do not depend on it).
"""
import json
import pathlib
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import rank_trace
from jax_kvalloc import multiprocess
from jax_kvalloc import ranks
from jax_kvalloc.tools import local_processes

TESTS = pathlib.Path(__file__).resolve().parent
WORKER = TESTS / "multiprocess_worker.py"
DEADLINE_S = 240
FAST_FLAGS = ("--xla_backend_optimization_level=0",)


# ---------------------------------------------------------------------------------------
# The helpers in this process (conftest.py's 4 host devices): one process holds every
# rank, in whatever order the mesh puts its devices.
# ---------------------------------------------------------------------------------------

def _devices(n):
  if len(jax.devices("cpu")) < n:
    pytest.skip(f"needs {n} host devices")
  return jax.devices("cpu")[:n]


def test_put_and_get_ranks_round_trip_on_a_permuted_mesh():
  devs = _devices(4)
  mesh = Mesh(np.array([devs[2], devs[0], devs[3], devs[1]]), ("dp",))
  assert multiprocess.process_ranks(mesh, "dp", 8) == tuple(range(8))
  assert multiprocess.process_ranks(mesh, "dp", 8, process_index=1) == ()
  assert rank_trace.rank_processes(mesh, "dp", 8) == ((0,),) * 8
  rows = np.arange(8 * 3, dtype=np.int32).reshape(8, 3)
  tree = {"a": rows, "b": rows[:, 0] > 9}
  x = multiprocess.put_ranks(tree, mesh, "dp", 8)
  assert x["a"].sharding == ranks.rank_sharding(mesh, "dp")
  # Rank 0's rows on mesh position 0, which is device 2.
  assert {s.device: s.index[0] for s in x["a"].addressable_shards}[devs[2]] == slice(0, 2)
  back = multiprocess.get_ranks(x)
  np.testing.assert_array_equal(back["a"], rows)
  np.testing.assert_array_equal(back["b"], rows[:, 0] > 9)
  assert rank_trace.held_ranks(x["a"]) == tuple(range(8))


def test_get_ranks_of_ranks_replicated_over_a_second_axis():
  devs = _devices(4)
  mesh = Mesh(np.array(devs).reshape(2, 2), ("dp", "tp"))  # each rank on two devices
  x = multiprocess.put_ranks(np.arange(4, dtype=np.int32) * 10, mesh, "dp", 4)
  assert len(x.addressable_shards) == 4
  np.testing.assert_array_equal(multiprocess.get_ranks(x), [0, 10, 20, 30])
  assert multiprocess.process_ranks(mesh, "tp", 4) == (0, 1, 2, 3)


def test_helpers_refuse_bad_input():
  devs = _devices(2)
  mesh = Mesh(np.array(devs), ("dp",))
  with pytest.raises(ValueError, match="leading axis of this process's 4 ranks"):
    multiprocess.put_ranks(np.zeros((3, 2), np.int32), mesh, "dp", 4)
  with pytest.raises(ValueError, match="must be a multiple of the mesh axis"):
    multiprocess.process_ranks(mesh, "dp", 3)
  with pytest.raises(ValueError, match="is not an axis of the mesh"):
    multiprocess.put_ranks(np.zeros((4,), np.int32), mesh, "tp", 4)
  inner = jax.device_put(np.zeros((2, 4), np.int32),
                         jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "dp")))
  with pytest.raises(ValueError, match="split along an inner axis"):
    multiprocess.get_ranks(inner)


def test_placed_init_equals_unplaced():
  mesh = Mesh(np.array(_devices(2)), ("dp",))
  cfg = rank_trace.Shape().config()
  r = ranks.ranks_allocator(cfg, 4 * 2, mesh=mesh, axis_name="dp")
  jax.tree.map(np.testing.assert_array_equal, multiprocess.get_ranks(r.init()),
               ranks.init_ranks(cfg, 8))
  table = r.init_table(3, 5)
  assert table.pages.shape == (8, 3, 5) and table.pages.sharding == ranks.rank_sharding(mesh, "dp")
  jax.tree.map(np.testing.assert_array_equal, multiprocess.get_ranks(table),
               ranks.init_tables(cfg, 8, 3, 5))


# ---------------------------------------------------------------------------------------
# Two processes.
# ---------------------------------------------------------------------------------------

def _launch(tmp_path, steps, seed, need_sort, ops, tries=2):
  """The two-process run and the one-process reference, side by side (again on a new
  port if the coordinator could not bind the one picked)."""
  port = local_processes.free_port()
  env = local_processes.child_env(FAST_FLAGS, pythonpath=[str(TESTS.parent), str(TESTS)])
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
  args = [str(tmp_path), str(steps), str(seed), "1" if need_sort else "0", ops]
  cmds = [[sys.executable, str(WORKER), str(i), "2", str(port)] + args for i in range(2)]
  cmds.append([sys.executable, str(WORKER), "0", "1", "0"] + args)
  results = local_processes.run(cmds, deadline_s=DEADLINE_S, env=env, cwd=str(TESTS.parent))
  if tries > 1 and any("already in use" in res.stderr.lower() for res in results):
    return _launch(tmp_path, steps, seed, need_sort, ops, tries - 1)
  for cmd, res in zip(cmds, results):
    assert res.returncode == 0, (
        f"{cmd[2:5]} exited {res.returncode} after {res.seconds:.0f} s"
        f"{' (killed at the deadline)' if res.returncode == -9 else ''}:\n"
        f"{res.stdout[-2000:]}\n{res.stderr[-6000:]}")
  return results


def _check(tmp_path, ops):
  ref = np.load(tmp_path / "p0_of_1.npz")
  ref_meta = json.loads((tmp_path / "p0_of_1.json").read_text())
  assert ref_meta["ranks"] == list(range(8))
  held = []
  for p in range(2):
    got = np.load(tmp_path / f"p{p}_of_2.npz")
    meta = json.loads((tmp_path / f"p{p}_of_2.json").read_text())
    mine = meta["ranks"]
    held += mine
    assert mine == [r for r in range(8) if (r // 2) % 2 == p]  # the interleaved mesh
    assert sorted(got.files) == sorted(ref.files)
    for key in ref.files:  # every step's outputs and the final state and table
      np.testing.assert_array_equal(got[key], ref[key][mine], err_msg=f"process {p}: {key}")
    assert meta["schedule"] == ref_meta["schedule"]
    assert meta["digests"] == ref_meta["digests"]  # exchanged: every rank, both processes
    assert meta["checked_programs"] == ref_meta["checked_programs"]
  assert sorted(held) == list(range(8))
  programs = set(ref_meta["checked_programs"])  # every operation's, without collectives
  assert {"available_size", "get_all_free_pages"} <= programs, programs
  assert set(ref_meta["schedule"]) == set(ops)  # every operation ran


def test_two_processes_equal_one(tmp_path):
  """A serving step's operations (the default set: few programs to compile)."""
  _launch(tmp_path, steps=2 * len(rank_trace.SERVING_OPS), seed=0, need_sort=True,
          ops="serving")
  _check(tmp_path, rank_trace.SERVING_OPS)


@pytest.mark.parametrize("need_sort", [False, True])
def test_two_processes_equal_one_every_op(tmp_path, need_sort):
  """Every ranked operation, longer traces (the slow set)."""
  _launch(tmp_path, steps=6 * len(rank_trace.OPS), seed=1 + need_sort, need_sort=need_sort,
          ops="all")
  _check(tmp_path, rank_trace.OPS)


def test_bench_processes_runs(tmp_path):
  """The measurement's tool, tiny (the slow set)."""
  from jax_kvalloc.tools import cli  # pylint: disable=g-import-not-at-top
  out = tmp_path / "processes.json"
  assert cli.main(["bench", "processes", "--quick", "--reps", "1", "--deadline",
                   str(DEADLINE_S), "--json", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [r["layout"] for r in rows] == ["1x2", "2x1"]
  for r in rows:
    call = r["cells"]["call"]
    assert call["collectives"] == {} and len(call["per_process"]) == int(r["layout"][0])
    assert call["per_process"][0]["n"] == 4 and r["cells"]["chained"]["us"] > 0
