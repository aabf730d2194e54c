"""`jax-kvalloc simulate`: the device driver (the scheduler inside a jitted loop) and the
host driver (a host scheduler, one jitted call per step) make the same decisions on the
same workload: step kinds, admissions, finishes, evictions, prefix hits, the slots of
every allocation (a checksum per step), the pool's page counts, and the final free and
release lists and request table."""
import dataclasses

import numpy as np
import pytest

from jax_kvalloc.tools import simulate
from jax_kvalloc.tools import simulate_steps as steps

# Small pools under pressure: admission waits, cached prefixes get evicted, need_sort
# merges run. One set of shapes per page size and need_sort, shared by every case.
BASE = simulate.SimConfig(
    num_requests=48, pool_size=1024, max_running=8, max_prefill_tokens=128,
    max_prefill_reqs=4, max_frees=3, prompt_len="uniform:4:90", output_len="uniform:1:48",
    prefix_len="uniform:20:120", num_prefixes=4, share_prob=0.6, rate=2.0,
    steps_per_call=32)


def _run(cfg):
  return simulate.run(cfg, progress=False).results[0]


def _check_same(cfg):
  dev = _run(dataclasses.replace(cfg, driver="device"))
  host = _run(dataclasses.replace(cfg, driver="host"))
  assert dev.records.shape == host.records.shape, (dev.steps, host.steps)
  diff = np.argwhere(dev.records != host.records)
  if diff.size:
    i, col = diff[0]
    raise AssertionError(f"step {i + 1}: {steps.RECORD[col]} device "
                         f"{dev.records[i, col]} host {host.records[i, col]}\n"
                         f"device {dict(zip(steps.RECORD, dev.records[i]))}\n"
                         f"host   {dict(zip(steps.RECORD, host.records[i]))}")
  assert dev.free_list_final == host.free_list_final
  assert dev.release_list_final == host.release_list_final
  for r in (dev, host):
    assert r.leak_check.startswith("ok") and r.alloc_failures == 0
    assert r.requests_done == cfg.num_requests
  assert dev.sim_time == host.sim_time and dev.runs_final == host.runs_final
  assert dev.calls >= dev.steps / cfg.steps_per_call
  # The report names what each driver costs.
  for res, row, absent in ((dev, "steps per host round trip", "launch time"),
                           (host, "launch time per step p50 / p99 (us)", "round trip")):
    names = [n for n, _ in simulate.summary_rows(simulate.SimResult({}, "", {}, [res]))]
    assert row in names and "wall time per step (us)" in names
    assert not any(absent in n for n in names) and "step time p50 (us)" not in names
  return dev


CASES = [(ps, sort, share) for ps in (1, 16, 64) for sort in (False, True)
         for share in (True, False)]


@pytest.mark.parametrize("ps,need_sort,share", CASES,
                         ids=[f"ps{p}-sort{int(s)}-share{int(h)}" for p, s, h in CASES])
def test_drivers_make_the_same_decisions(ps, need_sort, share):
  cfg = dataclasses.replace(BASE, page_sizes=(ps,), need_sort=need_sort,
                            share_prob=BASE.share_prob if share else 0.0)
  res = _check_same(cfg)
  c = steps.COL
  assert res.prefill_steps > 0 and res.decode_steps > 0
  if share:
    assert res.prefix_hits > 0
    assert res.evictions > 0, "the workload should make admission evict cached prefixes"
    # The pool, not the rows, limited admission at times (cached prefixes fill it).
    assert res.peak_reserved > 0.8
  else:
    assert res.prefix_hits == 0 and res.evictions == 0
  assert np.all(res.records[:, c["ok"]] == 1)


def test_branch_free_loop_makes_the_same_decisions(monkeypatch):
  # The device loop without conditionals (both allocations every step, the one not
  # taken with no rows; an option for accelerators where a branch costs a host sync).
  monkeypatch.setenv("JAX_KVALLOC_SIM_BRANCHES", "masked")
  _check_same(dataclasses.replace(BASE, page_sizes=(16,), need_sort=True))


@pytest.mark.parametrize("ps,need_sort", [(16, False), (64, True)])
def test_drivers_make_the_same_decisions_with_an_swa_pool(ps, need_sort):
  # --swa-window: both pools' counts, the window frees and which pool stopped an
  # admission are record columns, compared step by step like the rest.
  cfg = dataclasses.replace(BASE, page_sizes=(ps,), need_sort=need_sort, swa_window=40,
                            swa_ratio=0.3, pool_size=1024 if ps == 16 else 2048)
  res = _check_same(cfg)
  c = steps.COL
  assert res.records.shape[1] == len(steps.RECORD + steps.SWA_RECORD)
  assert res.window_frees > 0 and res.refused_swa > 0 and res.prefix_hits == 0
  assert np.all(res.records[:, c["swa_device_pages"]] ==
                res.swa_num_pages - res.records[:, c["swa_used"]])
