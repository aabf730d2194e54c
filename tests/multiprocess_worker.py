"""One process of tests/test_multiprocess.py: replays the ranked random trace
(tests/rank_trace.py) on the ranks its devices hold, saves every output of those ranks
and the final state and table (NumPy), then exchanges the host mirrors' hashes with the
other processes (a collective after the trace, never inside a step) and checks that they
agree.

    python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR STEPS SEED \
        NEED_SORT OPS

OPS: "all" (rank_trace.OPS) or "serving" (rank_trace.SERVING_OPS).

With NUM_PROCESSES == 1 it is the single-process reference: the same mesh shape (4
devices, one process) and the same trace. The mesh interleaves processes (device j of
process p at position j * NUM_PROCESSES + p), so process 0 holds ranks 0-1 and 4-5:
the ranks a process holds need not be contiguous.
"""
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jax_kvalloc.tools import local_processes  # pylint: disable=g-import-not-at-top

DEVICES = 4  # in all, whatever the process count


def _stamp(what, t0=time.monotonic()):
  print(f"{what}: {time.monotonic() - t0:.1f} s wall, {time.process_time():.1f} s cpu",
        flush=True)


def main(argv):
  pid, nproc, port = int(argv[0]), int(argv[1]), int(argv[2])
  out, steps, seed, need_sort = pathlib.Path(argv[3]), int(argv[4]), int(argv[5]), argv[6]
  which = argv[7]
  with local_processes.start(pid, nproc, port, DEVICES // nproc):
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    from jax_kvalloc import multiprocess  # pylint: disable=g-import-not-at-top
    from jax_kvalloc import ranks  # pylint: disable=g-import-not-at-top
    import rank_trace  # pylint: disable=g-import-not-at-top

    _stamp("started")
    assert jax.process_count() == nproc and len(jax.devices()) == DEVICES, jax.devices()
    per = DEVICES // nproc
    by_process = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    order = [by_process[p * per + j] for j in range(per) for p in range(nproc)]
    mesh = jax.sharding.Mesh(np.array(order), ("dp",))
    shape = rank_trace.Shape(need_sort=need_sort == "1")
    allocator = ranks.ranks_allocator(shape.config(), shape.dp, mesh=mesh, axis_name="dp")
    ops = {"all": rank_trace.OPS, "serving": rank_trace.SERVING_OPS}[which]
    trace = rank_trace.RankTrace(shape, allocator, seed, ops).run(steps)
    _stamp("trace")
    # No step sends anything between devices, hence processes: the compiled programs
    # hold no collective. Negative control: a sum over ranks does.
    found = trace.collectives()
    assert found and not any(found.values()), found
    total = ranks.shard(lambda s: jax.lax.psum(s.free_len, "dp")[None], mesh, "dp")
    assert "all-reduce" in ranks.collectives_in(
        jax.jit(total).lower(trace.state).compile().as_text())
    np.savez(out / f"p{pid}_of_{nproc}.npz", **trace.record, **trace.final())

    # The hashes: every rank's mirror digest (zeros where this process holds none) and
    # the schedule's, gathered from every process.
    mine = trace.digests()
    table = np.zeros((shape.dp + 1, 32), np.uint8)
    for r, d in mine.items():
      table[r] = np.frombuffer(bytes.fromhex(d), np.uint8)
    table[shape.dp] = np.frombuffer(bytes.fromhex(trace.schedule_digest()), np.uint8)
    every = np.asarray(multihost_utils.process_allgather(table)).reshape(nproc, *table.shape)
    holders = rank_trace.rank_processes(mesh, "dp", shape.dp)
    for p in range(nproc):
      assert (every[p, shape.dp] == table[shape.dp]).all(), f"process {p}'s schedule differs"
    agreed = {}
    for r in range(shape.dp):
      got = {bytes(every[p, r]).hex() for p in holders[r]}
      assert len(got) == 1, f"processes {holders[r]} disagree on rank {r}"
      agreed[r] = got.pop()
    (out / f"p{pid}_of_{nproc}.json").write_text(json.dumps({
        "ranks": list(trace.mine), "digests": agreed, "schedule": trace.schedule,
        "schedule_digest": trace.schedule_digest(), "holders": holders,
        "checked_programs": sorted(found),
        "devices": [str(d) for d in jax.local_devices()]}))
    _stamp("exchanged")
  _stamp(f"process {pid} of {nproc}: ranks {trace.mine}, {steps} steps ok")


if __name__ == "__main__":
  main(sys.argv[1:])
