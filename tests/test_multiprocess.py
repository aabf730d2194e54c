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

import numpy as np
import pytest

import rank_trace
from jax_kvalloc.tools import local_processes

TESTS = pathlib.Path(__file__).resolve().parent
WORKER = TESTS / "multiprocess_worker.py"
DEADLINE_S = 240
FAST_FLAGS = ("--xla_backend_optimization_level=0",)


def _launch(tmp_path, steps, seed, need_sort, ops):
  """The two-process run and the one-process reference, side by side."""
  port = local_processes.free_port()
  env = local_processes.child_env(FAST_FLAGS, pythonpath=[str(TESTS.parent), str(TESTS)])
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
  args = [str(tmp_path), str(steps), str(seed), "1" if need_sort else "0", ops]
  cmds = [[sys.executable, str(WORKER), str(i), "2", str(port)] + args for i in range(2)]
  cmds.append([sys.executable, str(WORKER), "0", "1", "0"] + args)
  results = local_processes.run(cmds, deadline_s=DEADLINE_S, env=env, cwd=str(TESTS.parent))
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
  assert sorted(held) == list(range(8))
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
