"""`jax-kvalloc report`: BENCHMARKS.md's and the README's generated tables equal what the
command prints from the committed result folders, byte for byte; the verdict rule
(faster / slower only where interquartile ranges do not overlap); the device runner and
its manifest."""
import copy
import json
import os
import pathlib
import re
import subprocess

import jax
import numpy as np
import pytest

from jax_kvalloc.tools import bench, bench_kernels, cli, report, timing

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RUN13 = "benchmarks/results/2026-11-30-h200x2-run13/decode.json"


@pytest.mark.parametrize("doc", ["BENCHMARKS.md", "README.md"])
def test_committed_tables_are_generated(doc):
  text = (ROOT / doc).read_text()
  if doc == "BENCHMARKS.md":  # the README may hold none: its figures live in BENCHMARKS.md
    assert report.blocks(text), f"{doc} has no generated block"
  new = report.regenerate(text, str(ROOT))
  assert new == text, (f"{doc}'s generated tables differ from the result folders: run "
                       "`jax-kvalloc report` and commit")


def test_every_block_cites_its_run_folder():
  for doc in ("BENCHMARKS.md", "README.md"):
    text = (ROOT / doc).read_text()
    for spec in report.blocks(text):
      body = report.generate_block(spec, str(ROOT))
      for path in [w.split("=", 1)[-1].split(":")[0] for w in spec.split()[1:]]:
        assert path.startswith("benchmarks/results/") and f"]({path})" in body, (spec, path)


def test_every_result_folder_has_a_manifest():
  folders = [p for p in RESULTS.iterdir() if p.is_dir()]
  assert folders
  for folder in folders:
    m = json.loads((folder / "manifest.json").read_text())
    for key in ("command", "commit", "date", "machine", "driver", "versions", "sglang",
                "files", "reconstructed"):
      assert key in m, (folder.name, key)
    assert folder.name.startswith(m["date"][:10] + "-" + m["machine"] + "-"), folder.name
    assert sorted(m["files"]) == sorted(f.name for f in folder.iterdir()
                                        if f.name != "manifest.json"), folder.name


def test_a_stale_table_is_found():
  text = (ROOT / "BENCHMARKS.md").read_text()
  # One figure of the first generated table changed by one in its last digit.
  body = next(report._BLOCK.finditer(text)).group("body")  # pylint: disable=protected-access
  row = next(line for line in body.splitlines() if re.search(r"\|\s*[\d.]+\s*\|", line))
  cell = re.search(r"(\d)(\s*\|)", row)
  bumped = row[:cell.start(1)] + str((int(cell.group(1)) + 1) % 10) + row[cell.end(1):]
  stale = text.replace(row, bumped, 1)
  assert stale != text
  assert report.regenerate(stale, str(ROOT)) == text


def test_a_missing_file_or_kind_is_named(tmp_path):
  doc = "<!-- report: bench benchmarks/results/nope/decode.json -->\n<!-- end report -->\n"
  with pytest.raises(report.ReportError, match="nope/decode.json"):
    report.regenerate(doc, str(ROOT))
  with pytest.raises(report.ReportError, match="kind 'plot'"):
    report.regenerate("<!-- report: plot x -->\n<!-- end report -->\n", str(ROOT))
  (tmp_path / "A.md").write_text(f"x\n<!-- report: bench {RUN13} -->\nold\n<!-- end report -->\n")
  # --check leaves the file alone and fails; a plain run prints; --write rewrites it
  (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
  doc = str(tmp_path / "A.md")
  assert report.run_report([doc], check=True) == 1
  assert report.run_report([doc]) == 0
  assert "old" in (tmp_path / "A.md").read_text()
  assert report.run_report([doc], write=True) == 0
  assert "old" not in (tmp_path / "A.md").read_text()
  assert report.run_report([doc], check=True) == 0
  (tmp_path / "old.json").write_text('{"rows": {}}')   # not a harness record
  with pytest.raises(cli.UsageError, match="names no suite"):
    report.run_report([str(tmp_path / "old.json")])


@pytest.mark.parametrize("ours, theirs, word", [
    ((1.0, 1.1), (1.2, 1.3), "faster"),
    ((1.2, 1.3), (1.0, 1.1), "slower"),
    ((1.0, 1.2), (1.1, 1.3), "tie"),
    ((1.0, 1.1), (1.1, 1.3), "tie"),      # touching ranges overlap
    ((1.0, 1.0), (1.0, 1.0), "tie"),
    (None, (1.0, 1.1), report.NO_SPREAD),
    ((1.0, 1.1), None, report.NO_SPREAD),
])
def test_verdict(ours, theirs, word):
  assert report.verdict(ours, theirs) == word


def _row(pallas_q, sglang_q):
  row = json.loads((ROOT / RUN13).read_text())["rows"][2]   # decode bs 16
  pb, sg = row["cells"]["pallas"], row["cells"]["sglang"]
  for cell, q in ((pb, pallas_q), (sg, sglang_q)):
    if q is not None:
      cell["bare_q1_us"], cell["bare_q3_us"] = q
  return row


def test_bare_verdicts_follow_the_quartiles():
  assert bench_kernels.bare_verdict(_row(None, None)) == report.NO_SPREAD
  assert bench_kernels.bare_verdict(_row((1.10, 1.20), (1.10, 1.15))) == "tie"
  assert bench_kernels.bare_verdict(_row((1.10, 1.12), (1.20, 1.30))) == "faster"
  assert bench_kernels.bare_verdict(_row((1.30, 1.40), (1.10, 1.15))) == "slower"


def test_targets_never_judge_linked_ratios_and_miss_only_on_a_clear_loss():
  data = json.loads((ROOT / RUN13).read_text())
  rows = bench_kernels.targets(data)
  assert not any("linked" in t or "torch_ref (same run)" in t for t, _, _ in rows)
  bare = [r for r in rows if "both bare" in r[0] and "every size" in r[0]]
  assert bare and bare[0][2] == report.NO_SPREAD   # run 13 kept no quartiles
  for r in data["rows"][1:]:   # ties everywhere: met, though the medians differ
    pb, sg = r["cells"]["pallas"], r["cells"]["sglang"]
    pb.update(bare_q1_us=pb["bare_us"] - 0.5, bare_q3_us=pb["bare_us"] + 0.5)
    sg.update(bare_q1_us=sg["bare_us"] - 0.5, bare_q3_us=sg["bare_us"] + 0.5)
  verdicts = {t: v for t, _, v in bench_kernels.targets(data)}
  key = next(t for t in verdicts if "both bare" in t and "every size" in t)
  assert verdicts[key] == "met"
  pb, sg = data["rows"][3]["cells"]["pallas"], data["rows"][3]["cells"]["sglang"]
  pb.update(bare_q1_us=sg["bare_q3_us"] + 0.1, bare_q3_us=sg["bare_q3_us"] + 0.2)  # bs 64
  verdicts = {t: v for t, _, v in bench_kernels.targets(data)}
  assert verdicts[key] == "MISSED at 1/7"


def test_chain_time_result_has_quartiles_of_its_slopes():
  ta, tb = [1.0, 1.0, 1.0, 1.0, 1.0], [2.0, 3.0, 4.0, 5.0, 6.0]
  res = timing._result(ta, tb, n=2, unroll=1, compile_s=0.0)  # pylint: disable=protected-access
  assert res["s"] == 3.0
  assert (res["q1_s"], res["q3_s"]) == (2.0, 4.0)
  assert timing.quartiles([5.0]) == (5.0, 5.0)
  acts = [(float(i), d, "kernel", "k") for i, d in enumerate([1.0, 2.0, 3.0, 4.0, 100.0])]
  kt = timing.kernel_time(acts, "k", min_count=5)
  assert kt["s"] == pytest.approx(3e-6)
  assert (kt["q1_s"], kt["q3_s"]) == pytest.approx((2e-6, 4e-6))
  assert np.isclose(kt["spread"], (100 - 1) / 3)


RUNNER = ROOT / "benchmarks" / "run_device.sh"


def _runner(*args):
  return subprocess.run(["bash", str(RUNNER), *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=30, check=False)


def test_runner_lists_and_dry_runs_its_steps():
  steps = [l.split()[0] for l in _runner("--list").stdout.splitlines()]
  assert {"gpu-tests", "decode", "extend", "free", "free-methods", "extend-layouts",
          "serving", "table", "class", "swa", "simulate", "ranks"} <= set(steps)
  out = _runner("--dry-run", "smoke", "decode", "simulate")
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert len(lines) == 2 and "bench kernels --ops decode" in lines[0] and "--bare" in lines[0]
  assert "/decode.json" in lines[0] and "-smoke/" in lines[0] and " simulate " in lines[1]
  bad = _runner("--dry-run", "smoke", "nosuchstep")
  assert bad.returncode == 2 and "unknown step: nosuchstep" in bad.stderr
  assert _runner("--dry-run", "bad name", "serving").returncode == 2


def test_every_runner_step_parses(capsys):
  """Each step's command line is accepted by the command it runs (no GPU needed)."""
  from jax_kvalloc.tools import cli  # pylint: disable=g-import-not-at-top
  steps = [l.split()[0] for l in _runner("--list").stdout.splitlines()]
  env = dict(os.environ, SGLANG_KERNELS=str(RUNNER))  # any file: only parsed here
  out = subprocess.run(["bash", str(RUNNER), "--dry-run", "x", *steps], cwd=ROOT,
                       capture_output=True, text=True, timeout=30, env=env, check=True)
  for line in out.stdout.splitlines():
    argv = line.split()
    if "jax_kvalloc" in argv:
      argv = argv[argv.index("jax_kvalloc") + 1:]
      parser = cli.build(argv)
      parser.parse_args(argv)


def test_runner_passes_per_step_arguments():
  env = dict(os.environ, ARGS_serving="--steps 10", TIMEOUT_serving="7")
  out = subprocess.run(["bash", str(RUNNER), "--dry-run", "x", "serving"], cwd=ROOT,
                       capture_output=True, text=True, timeout=30, env=env, check=False)
  words = out.stdout.split()
  assert words[:2] == ["timeout", "7"] and words[-2:] == ["--steps", "10"]


def test_round5_lines_name_runner_steps():
  # benchmarks/round5.sh: three lines of existing steps (the runner refuses an unknown
  # one), each into its own folder; the CPU forms' arguments come last.
  script = str(ROOT / "benchmarks" / "round5.sh")
  counts = {}
  for line in "abc":
    for cpu in ([], ["--cpu"]):
      out = subprocess.run(["bash", script, "--dry-run", *cpu, line], cwd=ROOT,
                           capture_output=True, text=True, timeout=30, check=False)
      assert out.returncode == 0, out.stderr
      lines = out.stdout.splitlines()
      assert lines and all(f"-r5{line}" in ln for ln in lines if "--json" in ln)
      counts.setdefault(line, set()).add(len(lines))
      if cpu:
        assert all(ln.startswith("timeout 900 ") for ln in lines)
  assert all(len(c) == 1 for c in counts.values()), counts
  assert subprocess.run(["bash", script, "x"], cwd=ROOT, capture_output=True,
                        timeout=30, check=False).returncode == 2


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
  """The CLI tests add --plot only where matplotlib imports; without it, --plot fails up
  front with this message (so those tests' other branch is this behaviour)."""
  import sys  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib -> ImportError
  with pytest.raises(RuntimeError, match="--plot needs matplotlib"):
    report.pyplot()


def test_manifest_of_a_run(tmp_path, monkeypatch):
  (tmp_path / "decode.json").write_text("{}")
  steps = tmp_path / "steps.tsv"
  steps.write_text("decode\t0\t42\tpython -m jax_kvalloc bench kernels --ops decode\n"
                   "serving\t-1\t0\tskipped: 5 s of BUDGET left\n")
  kernels = tmp_path / "allocator.py"
  kernels.write_text("# kernels\n")
  (tmp_path / "VERSION").write_text("sglang 0.5.23 (wheel x.whl)\n")
  monkeypatch.setenv("COMMIT", "abc1234")
  # torch and triton take long to import here; the rule is the same for any module
  monkeypatch.setattr(bench, "VERSION_MODULES", ("numpy", "jax", "no_such_module_x"))
  m = bench.manifest(str(tmp_path), "bash benchmarks/run_device.sh t decode", str(steps),
                     str(kernels))
  assert m["commit"] == "abc1234" and m["command"].endswith("t decode")
  assert m["steps"][0] == {"name": "decode", "exit": 0, "seconds": 42,
                           "command": "python -m jax_kvalloc bench kernels --ops decode"}
  assert m["steps"][1]["exit"] == -1
  import hashlib  # pylint: disable=g-import-not-at-top
  assert m["sglang"]["sha256"] == hashlib.sha256(b"# kernels\n").hexdigest()
  assert m["sglang"]["wheel"] == "sglang 0.5.23 (wheel x.whl)"
  assert "decode.json" in m["files"] and m["reconstructed"] == []
  assert m["versions"]["python"] and m["versions"]["jax"] == jax.__version__
  assert m["versions"]["no_such_module_x"] is None


def test_verdicts_compare_runs_row_by_row(tmp_path):
  src = json.loads((RESULTS / "2026-12-01-h200-b" / "decode.json").read_text())
  flipped = copy.deepcopy(src)
  row = next(r for r in flipped["rows"] if r["bs"] == 16)
  row["cells"]["sglang"].update(bare_us=9.0, bare_q1_us=8.9, bare_q3_us=9.1)  # a clear win now
  for name, data in (("a", src), ("b", flipped)):
    (tmp_path / f"2026-12-01-h200-{name}").mkdir()
    (tmp_path / f"2026-12-01-h200-{name}" / "decode.json").write_text(json.dumps(data))
  paths = ["2026-12-01-h200-a/decode.json", "2026-12-01-h200-b/decode.json"]
  body = report.generate_block("verdicts " + " ".join(paths), str(tmp_path))
  lines = {ln.split("|")[2].strip(): ln for ln in body.splitlines()
           if ln.startswith("| decode")}
  assert sorted(map(int, lines)) == [1, 4, 16, 64]
  assert lines["16"].rstrip(" |").endswith("NO") and "faster" in lines["16"]
  assert all(lines[b].rstrip(" |").endswith("yes") for b in ("1", "4", "64"))
  assert "3 of 4 verdicts agree." in body
  with pytest.raises(report.ReportError, match="two or more"):
    report.generate_block("verdicts " + paths[0], str(tmp_path))
