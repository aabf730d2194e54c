"""`jax-kvalloc bench`: the harness on a toy suite (no compile), then every suite once,
tiny and noisy (the slow set). Speed itself is never asserted."""
import argparse
import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.tools import bench
from jax_kvalloc.tools import bench_classes
from jax_kvalloc.tools import bench_table
from jax_kvalloc.tools import cli
from jax_kvalloc.tools import report


def _toy(fail_impl=None):
  """A suite whose columns return fixed figures; `b` outputs a different list than `a`
  on row 2, `c` cannot run."""
  def case(row, impl):
    if impl == "c":
      return bench.skipped("no such device")
    if impl == fail_impl:
      raise RuntimeError("broken")
    us = {"a": 10.0, "b": 2.0}[impl]
    out = [1, 2, 3] if impl == "a" or row["n"] == 1 else [1, 2, 4]
    return bench.Timed(lambda o: {"us": us * o.reps, "q1_us": us - 1, "q3_us": us + 1},
                       lambda: out)
  return bench.Suite(
      name="toy", help="a toy", impls=("a", "b", "c"), compare=(("b", "a"),),
      cases=lambda o: [bench.Case({"n": n}, i, functools.partial(case, {"n": n}, i))
                       for n in o.sizes for i in ("a", "b", "c")],
      dims=(bench.Dim("--sizes", [1, 2], "sizes", quick=[1]),))


def _opts(**kw):
  o = dict(impls=["a", "b", "c"], reps=1, min_time=0.0, unroll=1, budget_s=None, sizes=[1, 2])
  o.update(kw)
  return argparse.Namespace(**o)


def test_harness_records_cells_checks_outputs_and_skips(capsys):
  rec = bench.run_suite(_toy(), _opts())
  assert [r["n"] for r in rec["rows"]] == [1, 2]
  assert rec["skipped"] == {"c": "no such device"}
  assert rec["rows"][0]["cells"]["b"] == {"us": 2.0, "q1_us": 1.0, "q3_us": 3.0}
  assert rec["rows"][1]["cells"]["b"]["check"] == "MISMATCH: b differs from a"
  assert bench.mismatches(rec) == ["2 b: MISMATCH: b differs from a"]
  text = bench.table(rec, _toy())
  assert "| 1   | 10.0 [9.00, 11.0] | 2.00 [1.00, 3.00] | faster |" in text
  assert "skipped c: no such device" in text
  broken = bench.run_suite(_toy("b"), _opts(impls=["a", "b"]))
  assert broken["rows"][0]["cells"]["b"] == {"error": "RuntimeError: broken"}
  assert "2 b: broken" not in capsys.readouterr().out


def test_quick_values_fill_only_what_was_not_given():
  s = _toy()
  p = cli.Parser()
  sub = p.add_subparsers(dest="suite")
  q = sub.add_parser("toy", formatter_class=cli.Formatter)
  for d in s.dims:
    q.add_argument(d.flag, default=None, type=cli.int_list)
  q.add_argument("--quick", action="store_true")
  for name in ("reps", "min_time", "unroll"):
    q.add_argument("--" + name.replace("_", "-"), type=float, default=None)
  q.set_defaults(dims=s.dims, suite_defaults={"unroll": 8})
  o = bench.resolve(p.parse_args(["toy", "--quick", "--reps", "7"]))
  assert (o.sizes, o.reps, o.min_time, o.unroll) == ([1], 7, 0.005, 4)
  o = bench.resolve(p.parse_args(["toy"]))
  assert (o.sizes, o.reps, o.unroll) == ([1, 2], 5, 8)


def test_impl_specs_carry_arguments():
  parse = bench.impl_list(("jnp", "fused", "sglang"))
  assert parse("jnp,fused[layout=rows,num_warps=8],jnp[guard=False]") == [
      "jnp", "fused[layout=rows,num_warps=8]", "jnp[guard=False]"]
  assert bench.parse_impl("fused[layout=rows,num_warps=8]") == (
      "fused", {"layout": "rows", "num_warps": 8})
  assert bench.parse_impl("jnp[guard=False]") == ("jnp", {"guard": False})
  with pytest.raises(argparse.ArgumentTypeError, match="comma list of jnp,fused,sglang"):
    parse("jnp,nosuch")


def test_guard_runs_each_column_with_and_without_the_record():
  guarded = ("jnp", "eager")
  assert bench.guard_impls(["jnp", "jnp[free=sort]", "torch_ref", "eager"], ["on", "off"],
                           guarded) == ["jnp", "jnp[guard=False]", "jnp[free=sort]",
                                        "jnp[free=sort,guard=False]", "torch_ref", "eager",
                                        "eager[guard=False]"]
  assert bench.guard_impls(["jnp", "torch_ref"], ["off"], guarded) == [
      "jnp[guard=False]", "torch_ref"]
  assert bench.guard_impls(["jnp[guard=False]"], ["on", "off"], guarded) == [
      "jnp[guard=False]"]
  assert bench.guard_pairs(["jnp", "jnp[free=sort]", "jnp[free=sort,guard=False]",
                            "eager[guard=False]"]) == [
                                ("jnp[free=sort]", "jnp[free=sort,guard=False]")]
  cell = lambda us, q1, q3: {"us": us, "q1_us": q1, "q3_us": q3}
  rec = {"rows": [
      {"bs": 64, "cells": {"jnp": cell(10.5, 10.4, 10.6), "jnp[guard=False]": cell(
          10.0, 9.9, 10.1)}},
      {"bs": 128, "cells": {"jnp": cell(12.0, 11.9, 12.1), "jnp[guard=False]": cell(
          10.0, 9.9, 10.1)}},
      {"bs": 256, "cells": {"jnp": cell(12.0, 9.0, 15.0), "jnp[guard=False]": cell(
          10.0, 9.0, 11.0)}},
      {"bs": 1, "cells": {"jnp": cell(2.0, 1.9, 2.1), "jnp[guard=False]": cell(
          1.0, 0.9, 1.1)}}]}
  target = lambda row, col: (10.0, "%") if row["bs"] >= 64 else None
  rows = [line for line in bench.guard_cost(rec, target).splitlines()
          if line.startswith("| ")][1:]
  assert [[c.strip() for c in line.split("|")[1:-1]] for line in rows] == [
      ["64", "jnp", "10.5 [10.4, 10.6]", "10.0 [9.90, 10.1]", "1.05x", "+0.50", "slower",
       "met (<= +10%)"],
      ["128", "jnp", "12.0 [11.9, 12.1]", "10.0 [9.90, 10.1]", "1.20x", "+2.00", "slower",
       "MISSED (<= +10%)"],
      ["256", "jnp", "12.0 [9.00, 15.0]", "10.0 [9.00, 11.0]", "1.20x", "+2.00", "tie",
       "over (tie) (<= +10%)"],
      ["1", "jnp", "2.00 [1.90, 2.10]", "1.00 [0.90, 1.10]", "2.00x", "+1.00", "slower",
       "-"]]
  assert bench.guard_cost({"rows": [{"bs": 1, "cells": {"jnp": cell(1, 1, 1)}}]}) == ""


def test_bench_options_fail_in_one_line(capsys):
  for argv, want in ((["bench", "kernels", "--impls", "jnp,nosuch"], "--impls"),
                     (["bench", "swa", "--ops", "swa_free"], "--ops"),
                     (["bench", "kernels", "--extend-cases", "4by512"], "BSxTOKENS"),
                     (["bench", "class", "--reps", "0"], "--reps")):
    with pytest.raises(SystemExit) as e:
      cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and want in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # compiles three chain loops
def test_kernels_decode(capsys):
  """One tiny decode case on the jnp path: its figure and its floor; a column that
  cannot run says why."""
  assert cli.main(["bench", "kernels", "--quick", "--ops", "decode", "--batch-sizes", "8",
                   "--impls", "pallas,jnp"]) == 0
  text = capsys.readouterr().out
  assert "| 8  |      8 |" in text and "jnp floor (us)" in text and "harness floor:" in text
  if jax.default_backend() == "cpu":
    assert "note: pallas column skipped: no GPU/TPU" in text and "pallas (us)" not in text


@pytest.mark.slow  # torch_ref, the eager free, the record printed again
def test_kernels_free_and_torch_ref(tmp_path, capsys):
  out = tmp_path / "k.json"
  assert cli.main(["bench", "kernels", "--quick", "--ops", "decode,free", "--batch-sizes",
                   "8", "--extend-cases", "2x64", "--impls", "jnp,eager,torch_ref",
                   "--guard", "on,off", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  rec = json.loads(out.read_text())
  assert rec["suite"] == "kernels" and rec["settings"]["batch_sizes"] == [8]
  cells = {(r["op"], r["bs"]): r["cells"] for r in rec["rows"]}
  assert cells[("free", 2)]["eager"]["us"] > 0 and cells[("free", 2)]["jnp"]["us"] > 0
  if "torch_ref" in rec["skipped"]:  # no torch here (the 3.12 venv)
    assert "note: torch_ref column skipped: torch unavailable" in text
  else:
    assert "torch_ref (us)" in text and "torch_ref / eager" in text
  assert "MISMATCH" not in text   # guard=False columns included: the same outputs
  for row, col in (("decode/8/8", "jnp"), ("free/2/64", "jnp"), ("free/2/64", "eager")):
    assert re.search(rf"\| {row} +\| {col} +\|", text), (row, col)
  report.run_report([str(out)])
  rows = lambda t: [line for line in t.splitlines() if line.startswith("|")]
  assert rows(capsys.readouterr().out) == rows(text)


@pytest.mark.slow
def test_serving(tmp_path, capsys):
  """jit per step, the scans and torch_ref: the same final state (parity)."""
  out = tmp_path / "s.json"
  assert cli.main(["bench", "serving", "--quick", "--steps", "20", "--warmup", "2",
                   "--impls", "jit,scan,scan_none,torch", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  (row,) = json.loads(out.read_text())["rows"]
  assert row["cells"]["jit"]["us"] > 0 and row["cells"]["scan"]["us"] > 0
  assert "serving loop (page_size 64, 20 decode steps" in text and "targets" in text
  assert ("| identical |" in text) or ("torch" not in row["cells"])


CASE = bench_table.TableCase(bs=8, page_size=4, prompt=16, len_lo=8, len_hi=40,
                             max_frees=4, kernel="jnp")


@pytest.mark.slow  # the loop compiled twice
@pytest.mark.parametrize("extend", (True, False))
def test_table_loop_keeps_every_page(extend):
  case = dataclasses.replace(CASE, extend=extend)
  step = functools.partial(bench_table.table_step, case, variant="calls")
  run = jax.jit(lambda c: jax.lax.fori_loop(
      0, 150, lambda _, c: step(c, jnp.zeros((), jnp.int32))[0], c))
  state, table, _, _, ok = run(bench_table.initial_carry(case))
  assert bool(ok)
  held = int(jnp.sum(cdiv(table.lens, case.page_size)))
  assert held + int(state.free_len) == case.config.num_pages
  rows = np.asarray(table.pages)
  used = rows[rows > 0]
  assert used.size == held and np.unique(used).size == held   # no page held twice


@pytest.mark.slow  # the loop compiled twice with the kernel in Pallas' interpreter
def test_table_step_variant_equals_calls():
  # step_rows (one launch) runs the same loop as the separate calls, carry for carry.
  case = dataclasses.replace(CASE, kernel="pallas_interpret")
  run = lambda v: jax.jit(lambda c: jax.lax.fori_loop(0, 40, lambda _, c: functools.partial(
      bench_table.table_step, case, variant=v)(c, jnp.zeros((), jnp.int32))[0], c))
  a = run("calls")(bench_table.initial_carry(case))
  b = run("step")(bench_table.initial_carry(case))
  assert bool(a[-1])
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # compiles three variants
def test_table(tmp_path, capsys):
  out = tmp_path / "t.json"
  assert cli.main(["bench", "table", "--quick", "--steps", "decode", "--kernel", "jnp",
                   "--impls", "none,step,sglang", "--reps", "1", "--unroll", "2",
                   "--guard", "on,off", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  assert "share: step_rows" in text and re.search(r"\| decode \|\s+8 \|", text)
  assert re.search(r"\| decode/8/4 \| step +\|.*\(<= \+1 us\) \|", text)
  (row,) = json.loads(out.read_text())["rows"]
  assert all(row["cells"][v]["ok"] for v in ("none", "step", "step[guard=False]"))
  assert "check" not in row["cells"]["step[guard=False]"]   # the same steps, slots, pool
  sglang = row["cells"].get("sglang")
  assert sglang is None or sglang["us"] > 0, sglang


@pytest.mark.slow  # a class run of every implementation
def test_class(tmp_path, capsys):
  out = tmp_path / "c.json"
  assert cli.main(["bench", "class", "--quick", "--reps", "2", "--stalls", "3",
                   "--stall-max-batch", "4", "--impls", "device,host,sgljax",
                   "--guard", "on,off", "--json", str(out)]) == 0
  rec = json.loads(out.read_text())
  rows = {bench.label(r): r["cells"] for r in rec["rows"]}
  assert set(rows) == {"decode/1", "decode/9", "extend/2", "free/64",
                       "decode_after_restore/8", "free_after_restore/64",
                       "restore_after_decode/8", "restore_after_free/64", "floor/jit",
                       "stalls/cold", "stalls/warm"}
  ours = ("device", "host", "device[guard=False]", "host[guard=False]")
  for key in ("decode/1", "extend/2", "free/64", "free_after_restore/64",
              "restore_after_free/64"):
    for name in ours + (() if "sgljax" in rec["skipped"] else ("sgljax",)):
      assert rows[key][name]["us"] > 0, (key, name, rows[key][name])
  # sglang-jax is timed where its checkout is there; where not, the record says why.
  assert ("sgljax" in rec["skipped"]) != (
      bench_classes.DEFAULT_SGLJAX / "sgljax_allocator.py").exists()
  assert rows["stalls/warm"]["device"]["calls"] == 3
  assert rows["decode/1"]["device"]["status_waits"] >= 0  # counted (SPEC 14)
  text = capsys.readouterr().out
  assert "device calls that waited for a status" in text
  assert ("host vs sgljax" in text) == ("sgljax" not in rec["skipped"])
  assert re.search(r"\| free/64 +\| host +\|.*\(<= \+5%\) \|", text)  # the record's cost


def _swa_opts(**kw):
  o = dict(size=2048, size_swa=1024, page_size=4, device=None, extend_tokens=6,
           sglang_bundle=None)
  o.update(kw)
  return argparse.Namespace(**o)


@pytest.mark.slow  # compiles every SWA op of two implementations
def test_swa(tmp_path):
  out = tmp_path / "swa.json"
  assert cli.main(["bench", "swa", "--quick", "--json", str(out)]) == 0
  rec = json.loads(out.read_text())
  assert [bench.label(r) for r in rec["rows"]] == ["swa_extend/2", "swa_decode/5",
                                                   "swa_window_free/3"]
  for r in rec["rows"]:
    for name, c in r["cells"].items():
      assert 0 < c["min_us"] <= c["q1_us"] <= c["us"] <= c["q3_us"], (r, name)
  text = report.tables(rec)
  assert "swa_window_free/3" in text and ("class vs sglang" in text) == (
      "sglang" not in rec["skipped"])


def test_swa_missing_bundle_skips_sglang(monkeypatch):
  sglang_oracle = pytest.importorskip("jax_kvalloc.tools.sglang_oracle")  # needs torch
  monkeypatch.setattr(sglang_oracle, "import_error", lambda: "sglang is not importable")
  with pytest.raises(bench.Skip, match="does not exist"):
    bench_classes.SWAImpl("sglang", _swa_opts(sglang_bundle="/nonexistent/b"))


@pytest.mark.slow  # compiles the class's SWA calls
def test_swa_class_calls_compile_nothing_after_warmup():
  """The timed class calls (extend, decode, window free through free_swa, finishes
  through free / free_full) run their second round without compiling."""
  impl = bench_classes.SWAImpl("class", _swa_opts())
  seq = bench.decode_lens(5, 4, np.random.default_rng(0))
  last = impl.prefill(seq - 1)[impl.ints(np.cumsum(seq - 1) - 1)]

  def round_():
    impl("free", impl.prefill(np.full(2, 6)))
    impl.sync(impl("alloc_decode", impl.ints(seq), impl.host(seq), last))
    idx = impl.prefill(np.full(3, 4))
    impl("free_swa", idx)
    impl("free_full", idx)
    impl.sync(None)

  round_()
  compiles = []
  listener = lambda name, *a, **k: compiles.append(name) if "compil" in name else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    round_()
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiles == []


HLO = """HloModule m

%body.1 (p: (s32[])) -> (s32[]) {
  %p = (s32[]) parameter(0)
  %add.2 = s32[] add(s32[] %a, s32[] %b), metadata={op_name="jit(f)/while/body/borrow/add"}
  %fusion.3 = s32[4] fusion(s32[4] %x), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/add"}
  %conditional.4 = s32[] conditional(pred[] %c, s32[] %t, s32[] %f), branch_computations={%branch_a.5, %branch_b.6}
}

%branch_a.5 (x: s32[]) -> s32[] {
  %copy.7 = s32[] copy(s32[] %x), metadata={op_name="jit(f)/decode/copy"}
}

%branch_b.6 (x: s32[]) -> s32[] {
  %x = s32[] parameter(0)
}

ENTRY %main.9 (a: s32[]) -> (s32[]) {
  %while.8 = (s32[]) while((s32[]) %init), condition=%cond.10, body=%body.1
}
"""


def test_profile_reads_scopes_and_device_operations(tmp_path):
  """`bench simulate --impls profile`'s readers: the loop body's kernel-like operations
  by named scope (conditionals' branches included), and a trace's device operations."""
  import gzip  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import bench_simulate  # pylint: disable=g-import-not-at-top
  names, body = bench_simulate.hlo_scopes(HLO)
  assert dict(body) == {"borrow": 1, "plan": 2, "decode": 1}
  assert names["add.2"] == "borrow" and names["copy.7"] == "decode"
  meta = lambda kind, pid, tid, name: dict(ph="M", name=kind, pid=pid, tid=tid,
                                           args=dict(name=name))
  op = lambda name, tid, dur: dict(ph="X", name=name, pid=1, tid=tid, dur=dur)
  events = [meta("process_name", 1, 0, "/host:CPU"), meta("thread_name", 1, 7, "tf_XLA1"),
            meta("thread_name", 1, 8, "python"), op("fusion.3", 7, 2.0),
            op("while.8", 7, 9.0), op("ThunkExecutor", 7, 1.0), op("fusion.3", 8, 5.0)]
  (tmp_path / "x").mkdir()
  with gzip.open(tmp_path / "x" / "h.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  assert bench_simulate.device_ops(str(tmp_path)) == [("fusion.3", 2.0)]
