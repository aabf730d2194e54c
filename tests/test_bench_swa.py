"""`jax-kvalloc bench-swa` (jax_kvalloc/tools/bench_swa.py) on CPU: every row and column
is measured with quartiles, verdicts follow the IQR rule, the JSON and table come out; and
the timed class calls compile nothing after their warm-up (what a steady serving step
must not do). Speed itself is never asserted."""
import argparse
import json

import jax
import numpy as np
import pytest

from jax_kvalloc.tools import bench_swa

try:
  from jax_kvalloc.tools import sglang_oracle  # imports torch
except ImportError:
  sglang_oracle = None


def _args(*extra):
  p = argparse.ArgumentParser()
  bench_swa.add_arguments(p)
  return p.parse_args(["--size", "2048", "--size-swa", "1024", "--page-size", "4",
                       "--extend", "2", "--extend-tokens", "6", "--decode", "5",
                       "--window-free", "3", "--reps", "3", *extra])


def test_bench_swa_record_and_table(tmp_path):
  sglang = sglang_oracle is not None and sglang_oracle.import_error() is None
  out = tmp_path / "swa.json"
  assert bench_swa.main_args(_args("--json", str(out))) == 0
  rec = json.loads(out.read_text())
  assert set(rec["rows"]) == {"swa_extend/2", "swa_decode/5", "swa_window_free/3"}
  impls = ["class", "core"] + (["sglang"] if sglang else [])
  for key, cells in rec["rows"].items():
    for name in impls:
      c = cells[name]
      assert "error" not in c, (key, name, c)
      assert 0 < c["min_us"] <= c["q1_us"] <= c["median_us"] <= c["q3_us"], (key, name)
      assert c["reps"] == 3
    if sglang:
      for ours in ("class", "core"):
        v = cells["verdicts"][f"{ours}_vs_sglang"]
        q, t = cells[ours], cells["sglang"]
        want = ("faster" if q["q3_us"] < t["q1_us"] else
                "slower" if q["q1_us"] > t["q3_us"] else "tie")
        assert v == want
  text = bench_swa.table(rec)
  assert "swa_window_free/3" in text and "class vs sglang" in text


def test_bench_swa_rejects_unknown_op():
  with pytest.raises(SystemExit, match="swa_free"):
    bench_swa.main_args(_args("--ops", "swa_free"))


@pytest.mark.skipif(sglang_oracle is None, reason="needs torch")
def test_bench_swa_missing_bundle_skips_sglang(monkeypatch):
  monkeypatch.setattr(sglang_oracle, "import_error", lambda: "sglang is not importable")
  rec = bench_swa.run(_args("--impls", "sglang", "--sglang-bundle", "/nonexistent/b"))
  assert "does not exist" in rec["skipped"]["sglang"] and not rec["rows"]


def test_class_calls_compile_nothing_after_warmup():
  """The timed class calls (extend, decode, window free through free_swa, finishes
  through free / free_full) run their second round without compiling."""
  args = _args()
  impl = bench_swa._Impl("class", args)  # pylint: disable=protected-access
  seq = bench_swa.decode_lens(5, 4)
  full = impl.prefill(seq - 1)
  last = full[impl.ints(np.cumsum(seq - 1) - 1)]

  def round_():
    out = impl.prefill(np.full(2, 6))
    impl.free(out)
    impl.sync(impl.decode(impl.ints(seq), impl.host(seq), last))
    idx = impl.prefill(np.full(3, 4))
    impl.free_swa(idx)
    impl.free_full(idx)
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
