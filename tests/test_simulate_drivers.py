"""`jax-kvalloc simulate`: the drivers run one policy (jax_kvalloc.tools.simulate_step);
the device driver (many steps per call, in a loop on the device) and the host driver (one
jitted call per step) make the same decisions step by step, and so do the step's two
forms (unneeded table phases skipped in lax.cond on the CPU, or run with no rows through
the fused `step_rows`, as on accelerators). Each record holds the step kind, admissions,
finishes, evictions, prefix hits, the pool's counts on both sides and a checksum of every
allocation's slots."""
import dataclasses

import numpy as np
import pytest

from jax_kvalloc.tools import simulate
from jax_kvalloc.tools import simulate_step as steps
from gpu import needs_gpu

# Small pools under pressure: admission waits, cached prefixes get evicted, need_sort
# merges run. One set of shapes per page size and need_sort, shared by every case.
BASE = simulate.SimConfig(
    num_requests=48, pool_size=1024, max_running=8, max_prefill_tokens=128,
    max_prefill_reqs=4, max_frees=3, prompt_len="uniform:4:90", output_len="uniform:1:48",
    prefix_len="uniform:20:120", num_prefixes=4, share_prob=0.6, rate=2.0,
    steps_per_call=32)


def _run(cfg):
  return simulate.run(cfg, progress=False).results[0]


def _check_same(a, b):
  assert a.records.shape == b.records.shape, (a.steps, b.steps)
  diff = np.argwhere(a.records != b.records)
  if diff.size:
    i, col = diff[0]
    cols = steps.record_columns(bool(a.swa_window))
    raise AssertionError(f"step {i + 1}: {cols[col]} {a.records[i, col]} against "
                         f"{b.records[i, col]}\n{dict(zip(cols, a.records[i]))}\n"
                         f"{dict(zip(cols, b.records[i]))}")
  assert a.free_list_final == b.free_list_final
  assert a.release_list_final == b.release_list_final
  assert a.sim_time == b.sim_time and a.runs_final == b.runs_final


@pytest.mark.parametrize("swa", [False, True], ids=["plain", "swa"])
def test_drivers_make_the_same_decisions(swa):
  cfg = dataclasses.replace(BASE, page_sizes=(16,), need_sort=True)
  if swa:
    cfg = dataclasses.replace(cfg, swa_window=40, swa_ratio=0.3)
  dev = _run(cfg)
  host = _run(dataclasses.replace(cfg, driver="host"))
  _check_same(dev, host)
  assert dev.calls >= dev.steps / cfg.steps_per_call and host.calls >= host.steps
  assert np.any(dev.records[:, steps.COL["runs"]] > 0)
  # The report names what each driver costs.
  for res, row, absent in ((dev, "steps per host round trip", "launch time"),
                           (host, "launch time per step p50 / p99 (us)", "round trip")):
    names = [n for n, _ in simulate.summary_rows(simulate.SimResult({}, "", {}, [res]))]
    assert row in names and "wall time per step (us)" in names
    assert not any(absent in n for n in names) and "op time p50 (us)" not in names


CASES = [(ps, sort, share) for ps in (1, 16, 64) for sort in (False, True)
         for share in (True, False)]


@pytest.mark.parametrize("ps,need_sort,share", CASES,
                         ids=[f"ps{p}-sort{int(s)}-share{int(h)}" for p, s, h in CASES])
def test_policy_under_pressure(ps, need_sort, share):
  cfg = dataclasses.replace(BASE, page_sizes=(ps,), need_sort=need_sort,
                            share_prob=BASE.share_prob if share else 0.0)
  res = _run(cfg)
  c = steps.COL
  assert res.leak_check.startswith("ok") and res.alloc_failures == 0
  assert res.requests_done == cfg.num_requests
  assert res.prefill_steps > 0 and res.decode_steps > 0
  assert np.all(res.records[:, c["ok"]] == 1)
  if share:
    assert res.prefix_hits > 0
    assert res.evictions > 0, "the workload should make admission evict cached prefixes"
    assert res.peak_reserved > 0.8  # the pool, not the rows, limited admission at times
  else:
    assert res.prefix_hits == 0 and res.evictions == 0


@pytest.mark.parametrize("form", ["need_sort", "fused", "triton", "swa"])
def test_branch_free_step_makes_the_same_decisions(monkeypatch, form):
  # The accelerators' form: every table phase every step, the ones not needed with no
  # rows: need_sort's merge must stay where the branches put it; without need_sort the
  # three pool phases go through one step_rows (on a GPU pool, the Triton table kernel
  # and the plan as one Triton program: here in the interpreter, on a smaller workload).
  cfg = dataclasses.replace(BASE, page_sizes=(16,), need_sort=form in ("need_sort", "swa"))
  if form == "swa":
    cfg = dataclasses.replace(cfg, swa_window=40, swa_ratio=0.3)
  if form == "triton":
    # A census, and with the plan program an unrolled loop body, every 4 iterations: an
    # unrolled body of the default 16 iterations of interpreter kernels compiles slowly.
    cfg = dataclasses.replace(cfg, num_requests=12, output_len="uniform:1:20", max_frees=4,
                              runs_every=4)
  branched = _run(cfg)
  monkeypatch.setattr(simulate, "branches", lambda: False)
  if form == "triton":
    cfg = dataclasses.replace(cfg, kernel="triton_interpret")
    assert simulate.plan_kernel(cfg) == "triton_interpret"
  _check_same(_run(cfg), branched)


def test_step_cap_is_exact():
  # A run that needs more steps than max_steps stops after exactly max_steps, on both
  # drivers (the device loop checks the cap inside each call).
  for driver in simulate.DRIVERS:
    cfg = dataclasses.replace(BASE, page_sizes=(16,), need_sort=True, max_steps=5,
                              driver=driver)
    with pytest.raises(RuntimeError, match="no progress after 5 steps"):
      simulate.run(cfg, progress=False)


# The plan as one Triton program (Layout.plan_kernel): lowered for an abstract H200 on
# CPU (what the Triton compiler would see), and on a real GPU the same decisions as the
# plan's XLA operations. Its interpreter's run is the "triton" form above.
@pytest.mark.parametrize("swa", [False, True], ids=["plain", "swa"])
def test_plan_program_lowers_for_h200(swa):
  import functools  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import lowering_check  # pylint: disable=g-import-not-at-top
  cfg = dataclasses.replace(BASE, page_sizes=(16,), kernel="triton", max_frees=4)
  if swa:
    cfg = dataclasses.replace(cfg, swa_window=40, swa_ratio=0.3, num_prefixes=0)
  wl = cfg.workload()
  lay = dataclasses.replace(simulate.make_layout(cfg, wl, 16), branch=False)
  assert lay.plan_kernel == "triton"
  spec = lambda a: jax.ShapeDtypeStruct(np.shape(a), np.int32)
  dwl = steps.Workload(*map(spec, (wl.arrival, wl.group, wl.prompt, wl.output,
                                   np.zeros(max(cfg.num_prefixes, 1)), 0)))
  calls = {}
  for kernel in ("triton", ""):
    lay_k = dataclasses.replace(lay, plan_kernel=kernel)
    carry = jax.eval_shape(functools.partial(steps.init_carry, lay_k))
    exported = lowering_check.export_for("h200", lambda w, c, lay_k=lay_k: steps.run_steps(
        lay_k, w, c, blocks=1, runs_every=2), dwl, carry)
    calls[kernel] = lowering_check.custom_call_targets(exported).count(
        lowering_check.TRITON_CUSTOM_CALL)
  assert calls["triton"] == calls[""] + 1, calls


def test_plan_program_needs_power_of_two_vectors():
  cfg = dataclasses.replace(BASE, kernel="triton_interpret")
  assert simulate.plan_kernel(cfg) == ""  # max_frees=3
  assert simulate.plan_kernel(dataclasses.replace(cfg, max_frees=4)) == "triton_interpret"
  assert simulate.plan_kernel(dataclasses.replace(cfg, max_frees=4, plan_kernel=False)) == ""
  assert simulate.plan_kernel(dataclasses.replace(cfg, max_frees=4, kernel="jnp")) == ""


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("swa", [False, True], ids=["plain", "swa"])
def test_plan_program_on_gpu_makes_the_same_decisions(swa):
  cfg = dataclasses.replace(BASE, page_sizes=(16,), max_frees=4)
  if swa:
    cfg = dataclasses.replace(cfg, swa_window=40, swa_ratio=0.3, need_sort=True)
  assert simulate.plan_kernel(cfg) == "triton"
  _check_same(_run(cfg), _run(dataclasses.replace(cfg, plan_kernel=False)))


@pytest.mark.gpu
@needs_gpu
def test_gpu_kernels_make_the_same_decisions_as_xla():
  # On a GPU the plan and the table work (step_rows, the borrows and the hand-overs) are
  # Triton kernels; their records equal XLA's step for step.
  cfg = dataclasses.replace(BASE, page_sizes=(16,), max_frees=4)
  assert simulate.plan_kernel(cfg) == "triton"
  _check_same(_run(cfg), _run(dataclasses.replace(cfg, kernel="jnp")))
