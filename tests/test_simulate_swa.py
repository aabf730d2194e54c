"""`jax-kvalloc simulate --swa-window W --swa-ratio R` (the SWA allocator under the device
driver): every step's counts of both pools against a host model of the policy written
here from the module docstrings (numpy, one request at a time), the leak check of both
pools, window 0 equal to the run without an SWA pool, and the arguments' errors."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvalloc.tools import simulate
from jax_kvalloc.tools import simulate_step as steps

# A small pool under pressure: prompts longer than the window and than the prefill
# budget (chunked), both pools stop admissions at times.
BASE = simulate.SimConfig(
    num_requests=24, pool_size=1024, page_sizes=(16,), max_running=6,
    max_prefill_tokens=64, max_prefill_reqs=3, max_frees=2, prompt_len="uniform:4:150",
    output_len="uniform:1:60", num_prefixes=2, prefix_len="uniform:8:40", share_prob=0.5,
    rate=1.0, steps_per_call=64, swa_window=40, swa_ratio=0.25)


def cdiv(a, b):
  return -(-a // b)


def model(cfg: simulate.SimConfig, lay: simulate.Layout):
  """The device scheduler's policy in SWA mode, one request at a time: i64[steps, k]
  records of the columns MODEL_COLS. The SWA count is checked against a direct count of
  the live requests' pages still inside their windows. The sizes are the layout's
  (rows, batch and token budget bucketed)."""
  ps, width = lay.acfg.page_size, lay.width
  wl = cfg.workload()
  n_req = wl.num_requests
  n_full = cfg.pool_size // ps
  n_swa = int(round(cfg.swa_ratio * cfg.pool_size / ps))
  w, t_, b_, f_, r_ = cfg.swa_window, lay.tokens, lay.batch, lay.frees, lay.rows
  empty, prefill, decode, freeing = 0, 1, 2, 3
  phase = [empty] * r_
  seq, prompt, out, gen = [0] * r_, [0] * r_, [0] * r_, [0] * r_
  res, res_swa, swa_from, adm_at = [0] * r_, [0] * r_, [0] * r_, [0] * r_
  fifo, free, swa_free = [], n_full, n_swa
  clock = head = done = 0
  recs = []
  while not (done >= n_req and not fifo):
    arrived = int(np.sum(wl.arrival <= clock))
    empties = [r for r in range(r_) if phase[r] == empty]  # before this step's frees
    pops, fifo = fifo[:f_], fifo[f_:]
    for r in pops:
      free += cdiv(seq[r], ps)
      swa_free += cdiv(seq[r], ps) - swa_from[r]
      phase[r] = empty
    freed = 0
    for r in range(r_):
      if phase[r] != empty:
        end = min(max(seq[r] - w, 0) // ps, width)
        if end > swa_from[r]:
          freed += end - swa_from[r]
          swa_from[r] = end
    swa_free += freed
    live = [r for r in range(r_) if phase[r] in (prefill, decode)]
    avail = free - sum(res[r] - cdiv(seq[r], ps) for r in live)
    avail_swa = swa_free - sum(max(res_swa[r] - (cdiv(seq[r], ps) - swa_from[r]), 0)
                               for r in live)
    batch, budget = [], t_
    for r in sorted((r for r in live if phase[r] == prefill), key=lambda r: (adm_at[r], r)):
      if len(batch) == b_ or budget == 0:
        break
      batch.append((r, min(prompt[r] - seq[r], budget)))
      budget -= batch[-1][1]
    admitted = refused = 0
    need_f = need_s = 0
    while len(batch) < b_ and budget > 0 and admitted < len(empties) and \
        head + admitted < arrived:
      q = head + admitted
      p, o = int(wl.prompt[q]), int(wl.output[q])
      nf = cdiv(p + o, ps)
      ns = min(nf, cdiv(w + min(p, t_), ps) + 1)
      if need_f + nf > avail or need_s + ns > avail_swa:
        refused = int(need_f + nf > avail) + 2 * int(need_s + ns > avail_swa)
        break
      need_f, need_s = need_f + nf, need_s + ns
      r = empties[admitted]
      phase[r], seq[r], prompt[r], out[r], gen[r] = prefill, 0, p, o, 0
      res[r], res_swa[r], swa_from[r], adm_at[r] = nf, ns, 0, clock
      batch.append((r, min(p, budget)))
      budget -= batch[-1][1]
      admitted += 1
    reserved_for_step = list(res_swa)
    head += admitted
    decoding = [r for r in range(r_) if phase[r] == decode]
    if batch:
      kind, finished = steps.KIND_PREFILL, 0
      tokens = sum(n for _, n in batch)
      pages = sum(cdiv(seq[r] + n, ps) - cdiv(seq[r], ps) for r, n in batch)
      for r, n in batch:
        seq[r] += n
        if seq[r] == prompt[r]:
          phase[r] = decode  # from now on: the window and one token
          res_swa[r] = min(cdiv(prompt[r] + out[r], ps), cdiv(w + 1, ps) + 1)
    elif decoding or pops:
      kind, tokens = steps.KIND_DECODE, len(decoding)
      pages = sum(cdiv(seq[r] + 1, ps) - cdiv(seq[r], ps) for r in decoding)
      fin = []
      for r in decoding:
        seq[r] += 1
        gen[r] += 1
        if gen[r] >= out[r]:
          phase[r] = freeing
          fin.append(r)
      fifo += fin
      finished = len(fin)
      done += finished
    else:  # idle: the clock jumps to the next arrival, no step
      assert arrived < n_req and head == arrived, "the model is stuck"
      clock = max(clock + 1, int(wl.arrival[arrived]))
      continue
    free -= pages
    swa_free -= pages
    clock += 1
    held = [r for r in range(r_) if phase[r] != empty]
    assert n_swa - swa_free == sum(cdiv(seq[r], ps) - swa_from[r] for r in held)
    assert n_full - free == sum(cdiv(seq[r], ps) for r in held)
    # No request holds more SWA pages than it had reserved for the step.
    assert all(cdiv(seq[r], ps) - swa_from[r] <= reserved_for_step[r] for r in held)
    # Each live request's SWA pages: from the page of its token seq - window on.
    assert all(swa_from[r] * ps <= max(seq[r] - w, 0) or seq[r] <= w for r in held)
    recs.append([kind, admitted, finished, tokens, pages, n_full - free, n_swa - swa_free,
                 freed, refused])
  return np.asarray(recs, np.int64)


MODEL_COLS = ("kind", "admitted", "finished", "tokens", "pages", "used", "swa_used",
              "window_freed", "refused")


def _check_against_model(cfg):
  result = simulate.run(cfg, progress=False)
  res = result.results[0]
  ps = res.page_size
  lay = simulate.make_layout(cfg, cfg.workload(), ps)
  want = model(cfg, lay)
  got = res.records[:, [steps.COL[k] for k in MODEL_COLS]]
  assert got.shape == want.shape, (got.shape, want.shape)
  diff = np.argwhere(got != want)
  if diff.size:
    i, col = diff[0]
    raise AssertionError(f"step {i + 1}: {MODEL_COLS[col]} simulate {got[i, col]} model "
                         f"{want[i, col]}\nsimulate {dict(zip(MODEL_COLS, got[i]))}\n"
                         f"model    {dict(zip(MODEL_COLS, want[i]))}")
  c = steps.COL
  # The device's pools after every step (checked inside run; once more here).
  assert np.all(res.records[:, c["device_pages"]] == res.num_pages - got[:, 5])
  assert np.all(res.records[:, c["swa_device_pages"]] == res.swa_num_pages - got[:, 6])
  assert np.all(res.records[:, c["ok"]] == 1) and res.alloc_failures == 0
  assert res.leak_check.startswith("ok") and res.requests_done == cfg.num_requests
  assert res.prefix_hits == 0  # SWA mode shares no prefixes
  assert res.window_frees == int(want[:, 7].sum()) > 0
  assert res.swa_peak_pages == int(want[:, 6].max()) <= res.swa_num_pages
  assert res.full_peak_pages == int(want[:, 5].max())
  return result


def test_swa_pool_counts_follow_the_model():
  result = _check_against_model(BASE)
  res = result.results[0]
  assert res.refused_swa > 0, "the SWA pool should stop some admissions"
  names = [n for n, _ in simulate.summary_rows(result)]
  assert "SWA pool usage peak" in names and "SWA pages freed by the window" in names
  d = json.loads(json.dumps(simulate.to_json(result)))
  r = d["results"][0]
  assert d["config"]["swa_window"] == BASE.swa_window
  assert r["records"]["columns"] == list(steps.RECORD + steps.SWA_RECORD)
  assert r["swa_peak_pages"] == res.swa_peak_pages and len(r["swa_usage"]) == res.steps


@pytest.mark.parametrize("ps,need_sort,window", [(64, True, 100), (16, False, 8)])
def test_swa_pool_counts_follow_the_model_more(ps, need_sort, window):
  # A window shorter than a page, a full pool that is the tighter one, need_sort merges.
  _check_against_model(dataclasses.replace(
      BASE, page_sizes=(ps,), need_sort=need_sort, swa_window=window,
      pool_size=4096 if ps == 64 else 1024, swa_ratio=0.5))


def test_window_zero_is_the_run_without_an_swa_pool():
  plain = dataclasses.replace(BASE, swa_window=0, swa_ratio=0.25, steps_per_call=32)
  off = dataclasses.replace(plain, swa_ratio=-3.0)  # ignored without a window
  a, b = (simulate.run(c, progress=False) for c in (plain, off))
  assert np.array_equal(a.results[0].records, b.results[0].records)
  assert a.results[0].records.shape[1] == len(steps.RECORD)
  ja, jb = (simulate.to_json(x, series=False) for x in (a, b))
  for j in (ja, jb):
    assert "swa_window" not in j["config"] and "swa_ratio" not in j["config"]
    assert not any(k.startswith(("swa_", "full_", "window_", "refused_"))
                   for k in j["results"][0])
  names = [n for n, _ in simulate.summary_rows(a)]
  assert not any("SWA" in n for n in names)
  assert a.results[0].prefix_hits > 0  # sharing stays on without an SWA pool


def test_leak_check_fires_on_a_dropped_swa_free(drop_first_free):
  # A finished request's free is dropped: its pages leak in both pools.
  from jax_kvalloc import swa_table  # pylint: disable=g-import-not-at-top
  drop_first_free(swa_table)
  with pytest.raises(simulate.LeakCheckError, match="leak check failed at step"):
    simulate.run(BASE, progress=False)


def test_final_leak_check_covers_both_pools_and_the_mapping():
  lay = simulate.make_layout(BASE, BASE.workload(), 16)
  state, table = jax.jit(steps.init_carry, static_argnums=0)(lay)[:2]
  res = simulate.PageSizeResult(16, lay.num_pages, "auto")
  simulate.final_leak_check(res, lay, state, table)
  assert res.leak_check.startswith("ok") and f"SWA free {lay.swa_pages}" in res.leak_check
  lost = state._replace(swa=state.swa._replace(free_len=state.swa.free_len - 1))
  with pytest.raises(simulate.LeakCheckError, match="SWA pool.*1 pages missing"):
    simulate.final_leak_check(res, lay, lost, table)
  mapped = state._replace(mapping=state.mapping.at[17].set(5))
  with pytest.raises(simulate.LeakCheckError, match="1 full slots still map"):
    simulate.final_leak_check(res, lay, mapped, table)
  busy = table._replace(lens=table.lens.at[2].set(3))
  with pytest.raises(simulate.LeakCheckError, match=r"rows \[2\]"):
    simulate.final_leak_check(res, lay, state, busy)
  # The ownership record of each pool: a free page marked held, a refusal recorded.
  swa = state.swa._replace(guard=state.swa.guard._replace(
      held=state.swa.guard.held.at[1].set(1)))
  with pytest.raises(simulate.LeakCheckError, match="SWA pool.*holds 1 free pages"):
    simulate.final_leak_check(res, lay, state._replace(swa=swa), table)
  full = state.full._replace(guard=state.full.guard._replace(
      status=jnp.asarray([5, 3, 7], jnp.int32)))
  with pytest.raises(simulate.LeakCheckError, match="refused a free.*full pool.*page 7"):
    simulate.final_leak_check(res, lay, state._replace(full=full), table)
  assert not simulate.make_layout(dataclasses.replace(BASE, guard=False), BASE.workload(),
                                  16).swa.full.guard


@pytest.mark.parametrize("change,match", [
    (dict(swa_window=-1), "--swa-window"),
    (dict(swa_ratio=0.0), "--swa-ratio"),
    (dict(swa_ratio=-0.5), "--swa-ratio"),
    (dict(swa_ratio=0.02), "--swa-ratio"),   # a pool smaller than one request's window
    (dict(page_sizes=(1,)), "page size > 1"),
])
def test_bad_swa_arguments_name_the_argument(change, match):
  with pytest.raises(ValueError, match=match):
    simulate.run(dataclasses.replace(BASE, **change), progress=False)
