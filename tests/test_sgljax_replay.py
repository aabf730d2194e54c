"""`jax-kvalloc bench sgljax-replay` on the committed traces of sglang-jax's engine
(benchmarks/results/2026-12-05-cpu-sgljax-replay): both allocators give every recorded
result; a trace whose recorded result is changed is a MISMATCH and exit status 1.
Speed is never asserted. Needs neither sgl_jax nor a model: the traces are files."""
import json
import os

import pytest

from jax_kvalloc.tools import bench_sgljax
from jax_kvalloc.tools import cli

TRACES = bench_sgljax.DEFAULT_TRACES


@pytest.fixture
def columns():
  if not os.path.exists(os.path.join(bench_sgljax.DEFAULT_SGLJAX, "sgljax_allocator.py")):
    pytest.skip(f"no sglang-jax allocator at {bench_sgljax.DEFAULT_SGLJAX}")
  return "host,sgljax"


def test_replays_every_recorded_result_through_both(columns, tmp_path, capsys):
  out = tmp_path / "replay.json"
  assert cli.main(["bench", "sgljax-replay", "--impls", columns, "--reps", "2",
                   "--json", str(out)]) == 0
  rec = json.loads(out.read_text())
  rows = {(r["trace"], r["kind"], r["n"]): r["cells"] for r in rec["rows"]}
  for name in ("ps1", "ps4"):
    trace = bench_sgljax.load_trace(os.path.join(TRACES, f"trace-{name}.json"))
    whole = rows[name, bench_sgljax.WHOLE, str(len(trace["calls"]))]
    assert set(whole) == {"host", "sgljax"} and whole["host"]["reps"] == 2
    calls = sum(c["calls"] for (t, kind, _), cells in rows.items()
                if t == name and kind != bench_sgljax.WHOLE for c in [cells["host"]])
    assert calls == len(trace["calls"])         # every call in exactly one row
  assert ("ps1", "free in group", "1") in rows  # frees inside a free group apart
  assert "host vs sgljax" in capsys.readouterr().out


def test_a_changed_result_is_a_mismatch(columns, tmp_path, capsys):
  trace = bench_sgljax.load_trace(os.path.join(TRACES, "trace-ps4.json"))
  i = next(i for i, c in enumerate(trace["calls"]) if c["kind"] == "alloc_decode")
  trace["calls"][i]["result"]["array"][0] += 4     # a slot the allocator never gives
  path = tmp_path / "trace-bad.json"
  path.write_text(json.dumps(trace))
  assert cli.main(["bench", "sgljax-replay", "--traces", str(path), "--impls", columns,
                   "--reps", "1"]) == 1
  out = capsys.readouterr().out
  assert f"call {i} (alloc_decode) returned" in out
  assert "MISMATCH: host differs from the trace" in out
  assert "MISMATCH: sgljax differs from the trace" in out
  assert cli.main(["bench", "sgljax-replay", "--traces", str(tmp_path / "none.json")]) == 2
  assert "error: --traces: no such file or folder" in capsys.readouterr().err
