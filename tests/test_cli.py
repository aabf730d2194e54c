"""The `jax-kvalloc` command: its contract (one-line user errors, help and defaults for
every option), tiny runs of simulate, its JSON/plot outputs, and the leak check firing on
deliberately broken runs."""
import argparse
import dataclasses
import json
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvalloc.tools import cli
from jax_kvalloc.tools import report
from jax_kvalloc.tools import timing
from jax_kvalloc.tools import simulate
from jax_kvalloc.tools import simulate_step
from jax_kvalloc.tools import workload

# One set of static shapes for every simulate run here, so the step functions compile
# once per page size for the whole module.
TINY = ["--pool-size", "4096", "--max-running", "16", "--max-prefill-tokens", "256",
        "--max-prefill-reqs", "4", "--max-frees", "4", "--prompt-len", "uniform:8:120",
        "--output-len", "uniform:1:40", "--prefix-len", "uniform:16:60",
        "--num-prefixes", "3", "--rate", "1.5", "--no-progress", "--no-compile-cache"]
TINY_CFG = simulate.SimConfig(
    num_requests=40, pool_size=4096, page_sizes=(16,), max_running=16,
    max_prefill_tokens=256, max_prefill_reqs=4, max_frees=4, prompt_len="uniform:8:120",
    output_len="uniform:1:40", prefix_len="uniform:16:60", num_prefixes=3, rate=1.5)


def _has_matplotlib():
  try:
    import matplotlib  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


def test_simulate_json_plot_and_table(tmp_path, capsys):
  out_json, out_png = tmp_path / "sim.json", tmp_path / "sim.png"
  args = ["simulate", "--num-requests", "40", "--page-size", "1,16", "--json",
          str(out_json), "--json-series"] + TINY
  if _has_matplotlib():
    args += ["--plot", str(out_png)]
  assert cli.main(args) == 0
  text = capsys.readouterr().out
  assert "page_size=1 |" in text and "page_size=16" in text and "leak check" in text
  data = json.loads(out_json.read_text())
  assert [r["page_size"] for r in data["results"]] == [1, 16]
  wl = TINY_CFG.workload()
  for r in data["results"]:
    assert r["leak_check"].startswith("ok"), r["leak_check"]
    assert r["alloc_failures"] == 0 and r["requests_done"] == 40
    assert r["prefix_hits"] > 0
    assert len(r["usage"]) == r["steps"] == len(r["step_us"]) == len(r["records"]["rows"])
    assert r["driver"] == "device" and r["calls"] >= 1
    assert 0 < r["peak_usage"] <= 1 and r["mean_usage"] <= r["peak_usage"]
    # Whole pages only: the table's pages match the request count's page total minus
    # what the prefix cache saved.
    assert r["pages_allocated"] <= int(np.sum(-(-(wl.prompt + wl.output) // r["page_size"])))
  assert data["results"][0]["waste_mean"] == 0      # page size 1 wastes nothing
  if _has_matplotlib():
    assert out_png.stat().st_size > 1000


def test_simulate_exact_page_accounting_without_sharing():
  # No shared prefixes: every request allocates exactly its prompt + output tokens, in
  # exactly ceil(total / page_size) pages however its prefill was chunked.
  cfg = dataclasses.replace(TINY_CFG, share_prob=0.0)  # same shapes: no new compile
  res = simulate.run(cfg, progress=False).results[0]
  wl = cfg.workload()
  assert res.tokens_allocated == int(np.sum(wl.prompt + wl.output))
  assert res.pages_allocated == int(np.sum(-(-(wl.prompt + wl.output) // 16)))
  assert res.in_use_final == 0 and res.free_pages_final == 4096 // 16
  # Chunking happened (prompts up to 120 tokens, 256-token prefill budget, 4 requests).
  assert res.prefill_steps > 0 and res.waste_peak_slots > 0


def test_leak_check_fires_on_a_dropped_free(drop_first_free, capsys):
  from jax_kvalloc import request_table  # pylint: disable=g-import-not-at-top
  drop_first_free(request_table)
  args = ["simulate", "--num-requests", "40", "--page-size", "16"] + TINY
  assert cli.main(args) == 2
  err = capsys.readouterr().err
  assert "LEAK CHECK FAILED" in err and "page_size=16" in err


def test_leak_check_fires_when_the_device_free_loses_pages(monkeypatch):
  # A broken free group (the device frees one page too few of the first row it releases)
  # must be caught although the scheduler's own bookkeeping is right: the device driver
  # compares the pool with its count inside the loop, every step.
  from jax_kvalloc import request_table  # pylint: disable=g-import-not-at-top
  real = request_table.release_rows

  def lossy(config, state, table, rows, *, num_rows=None):
    first = jnp.where(num_rows > 0, rows[0], table.lens.shape[0])
    table = table._replace(owned_from=table.owned_from.at[first].add(1, mode="drop"))
    return real(config, state, table, rows, num_rows=num_rows)

  monkeypatch.setattr(request_table, "release_rows", lossy)
  simulate.clear_compiled()  # drop compiled loops that traced the real one
  cfg = dataclasses.replace(TINY_CFG, num_requests=12)
  try:
    with pytest.raises(simulate.LeakCheckError, match="leak check failed at step"):
      simulate.run(cfg, progress=False)
  finally:
    simulate.clear_compiled()  # and the lossy ones, for the tests after


def test_free_list_runs():
  import jax_kvalloc as kv  # pylint: disable=g-import-not-at-top
  cfg = kv.AllocatorConfig(size=64, page_size=8)
  s = kv.init(cfg)
  assert int(simulate_step.free_list_runs(s)) == 1
  # The free list [6, 7, 2, 5] wraps around the ring's end: three runs.
  ring = np.array([2, 5, 0, 0, 0, 0, 6, 7], np.int32)
  s = s._replace(free_ring=ring, free_head=np.int32(6), free_len=np.int32(4))
  assert list(kv.live_free_pages(s)) == [6, 7, 2, 5]
  assert int(simulate_step.free_list_runs(s)) == 3
  assert int(simulate_step.free_list_runs(s._replace(free_len=np.int32(0)))) == 0


def test_distributions():
  rng = np.random.default_rng(0)
  for spec, lo, hi in [("const:7", 7, 7), ("uniform:3:9", 3, 9),
                       ("lognormal:100:0.5:300", 1, 300), ("exp:20:50", 1, 50)]:
    d = workload.parse_dist(spec)
    x = d.sample(rng, 500)
    assert x.min() >= lo and x.max() <= hi, spec
  for bad in ("foo:1", "uniform:9:3", "const:x", "lognormal:-1:1"):
    with pytest.raises(ValueError, match="length distribution"):
      workload.parse_dist(bad)
  with pytest.raises(ValueError, match="--pool-size: request .* needs 12 pages"):
    simulate.run(dataclasses.replace(TINY_CFG, pool_size=64), progress=False)


def test_trace_replay(tmp_path, capsys, golden_path):
  traces = pytest.importorskip("jax_kvalloc.tools.traces")
  recs = traces.read(str(golden_path))
  tids = [t for t in recs if recs[t][0]["args"]["page_size"] == 4][:1]
  picked = [r for t in tids for r in recs[t]]
  path = tmp_path / "t.jsonl"
  traces.write(str(path), picked)
  assert cli.main(["simulate", "--trace", str(path), "--no-progress",
                   "--no-compile-cache"]) == 0
  out = capsys.readouterr().out
  assert "page_size=4" in out and "traces replayed" in out and "ok: free" in out
  # A recorded result that the allocator does not reproduce is reported, loudly.
  bad = [dict(r) for r in picked]
  i = next(i for i, r in enumerate(bad) if r["op"] == "alloc_extend" and r["result"])
  bad[i]["result"] = [x + 1 for x in bad[i]["result"]]
  traces.write(str(path), bad)
  assert cli.main(["simulate", "--trace", str(path), "--no-progress",
                   "--no-compile-cache"]) == 3
  assert "TRACE MISMATCH" in capsys.readouterr().err


def test_trace_replay_follows_every_kind_of_free():
  # simulate --trace's own accounting of the pages in use (its leak check and waste).
  from jax_kvalloc.tools.traces import PageTracker  # pylint: disable=g-import-not-at-top
  t = PageTracker(4)
  t.apply("alloc", {}, [4, 5, 6, 8, 12, 16])
  t.apply("free", {"free_index": [16]}, None)
  t.apply("free_segment", {"free_index": [8], "start_pos": 4}, None)
  t.apply("free_page_ids", {"page_ids": [3]}, None)
  assert sorted(t.held) == [1] and t.waste == 1


@pytest.mark.parametrize("args,option", [
    (["--pool-size", "-5"], "--pool-size"),
    (["--swa-window", "-1"], "--swa-window"),
    (["--page-size", "0"], "--page-size"),
    (["--share-prob", "1.5"], "--share-prob"),
    (["--prompt-len", "uniform:9:3"], "--prompt-len"),
    (["--swa-window", "64", "--swa-ratio", "0.001"], "--swa-ratio"),
    (["--pool-size", "64"], "--pool-size"),
    (["--page-size", "128", "--pool-size", "64"], "--page-size"),
    (["--num-requests", "100000000"], "--num-requests"),
    (["--pool-size", "2000000000", "--page-size", "1"], "--pool-size"),
    (["--trace", "/no/such/file.jsonl"], "--trace"),
    (["--no-guard", "--trace", __file__], "--no-guard"),   # a trace replays the classes
    (["--json", "/no/such/folder/x.json"], "--json"),
])
def test_simulate_user_errors_are_one_line(args, option, capsys):
  # Exit status 2, no traceback, and a last line that names the option; nothing runs.
  try:
    code = cli.main(["simulate", "--no-progress", "--no-compile-cache"] + args)
  except SystemExit as e:  # argparse's own checks
    code = e.code
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and option in err[0], err


def test_simulate_persistent_cache_reports_hits(tmp_path, capsys):
  args = ["simulate", "--num-requests", "12", "--page-size", "16", "--compile-cache",
          str(tmp_path)] + TINY[:-1]  # TINY without --no-compile-cache
  import jax  # pylint: disable=g-import-not-at-top
  before = jax.config.jax_compilation_cache_dir  # CI's session-wide cache, or None
  simulate.clear_compiled()
  assert cli.main(args) == 0
  assert "0 of 1 from the persistent cache" in capsys.readouterr().out
  assert any(tmp_path.iterdir())
  simulate.clear_compiled()  # a new process, as far as compiling goes
  assert cli.main(args) == 0
  assert "1 of 1 from the persistent cache" in capsys.readouterr().out
  assert jax.config.jax_compilation_cache_dir == before  # the run put the setting back


def _parsers():
  """Every command's parser and, under bench, every suite's."""
  for name, _, _ in cli.COMMANDS:
    parser = cli.build([name])
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # pylint: disable=protected-access
    p = sub.choices[name]
    yield p
    for a in p._actions:  # pylint: disable=protected-access
      if isinstance(a, argparse._SubParsersAction):  # pylint: disable=protected-access
        yield from a.choices.values()


def test_every_option_has_help_and_a_typed_default():
  for p in _parsers():
    assert p.description and not p.description.rstrip().endswith(".."), p.prog
    text = p.format_help()
    for a in p._actions:  # pylint: disable=protected-access
      if a.help != argparse.SUPPRESS and not isinstance(a, argparse._SubParsersAction):  # pylint: disable=protected-access
        assert a.help, (p.prog, a.dest)
    for bad in ("[[", "['", "(default: None)", "(2, "):
      assert bad not in text, (p.prog, bad, text)


def test_bare_command_lists_the_commands_and_unknown_ones_fail(capsys):
  assert cli.main([]) == 2
  out = capsys.readouterr().out
  assert all(name in out for name, _, _ in cli.COMMANDS)
  with pytest.raises(SystemExit) as e:
    cli.main(["bench-tabel", "--help"])
  err = capsys.readouterr().err
  assert e.value.code == 2 and "invalid choice: 'bench-tabel'" in err
  assert len(err.strip().splitlines()) == 1


def test_user_errors_are_one_line_with_status_2(capsys):
  for argv, option in ((["simulate", "--pool-size", "-5"], "--pool-size"),
                       (["simulate", "--trace", "/missing.jsonl"], "--trace"),
                       (["simulate", "--swa-window", "-1"], "--swa-window"),
                       (["simulate", "--page-size", "1,x"], "--page-size"),
                       (["parity", "--impls", "jax,nosuch"], "--impls"),
                       (["parity"], "TRACE"),
                       (["report", "NOPE.md"], "FILE")):
    try:
      rc = cli.main(argv)
    except SystemExit as e:
      rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and option in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_plot_without_matplotlib(monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib -> ImportError
  with pytest.raises(RuntimeError, match="--plot needs matplotlib"):
    report.pyplot()


def test_helpers():
  assert cli.int_list("1, 16,64") == [1, 16, 64]
  assert cli.show([[1, 16], [64]]) == "1,16,64" and cli.show(0.25) == "0.25"
  t = report.table(["a", "b"], [["x", 1], ["yy", 22]])
  assert t.splitlines()[0] == "| a  |  b |" and t.splitlines()[1] == "|----|---:|"


def test_chain_time_reports_noise_as_an_error_not_as_zero(monkeypatch):
  """A timed run that is never slower with more iterations has no measurable slope: the
  harness first lengthens the run, then raises, instead of clamping the slope to 0."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  lengths = []

  def wall(fn):
    fn()
    lengths.append(1)
    return 1e-3  # every run "takes" the same time, however many iterations
  monkeypatch.setattr(timing, "_wall", wall)
  monkeypatch.setattr(timing, "MAX_ITERS", 64)
  with pytest.raises(timing.TimingError, match="noise dominates"):
    timing.chain_time(lambda c, x: (c + 1, x + c), jnp.zeros((), jnp.int32),
                      jnp.zeros((4,), jnp.int32), unroll=2, min_time=0.0, reps=2)
  assert len(lengths) > 8  # it tried longer runs before giving up



def _kernel_commands():
  """argv prefixes of every command and bench suite that takes --kernel."""
  out = []
  for p in _parsers():
    if any("--kernel" in a.option_strings for a in p._actions):  # pylint: disable=protected-access
      words = p.prog.split()[1:]
      out.append(words + (["--generate", "1"] if words == ["parity"] else []))
  return out


@pytest.mark.parametrize("kernel", ["triton", "mosaic", "mosaic_gpu", "pallas", "nosuch"])
def test_kernel_that_cannot_run_here_is_a_one_line_error(kernel, capsys, monkeypatch):
  import jax  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import bench, parity  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "cpu":
    pytest.skip("the kernels named here run on some accelerator")
  def ran(*a, **k):
    raise AssertionError("the run started")
  monkeypatch.setattr(simulate, "run", ran)          # nothing compiled or loaded first
  monkeypatch.setattr(bench, "run_suite", ran)
  monkeypatch.setattr(parity, "_build", ran)
  commands = _kernel_commands()
  assert {"simulate", "parity", "bench"} <= {c[0] for c in commands}
  assert len([c for c in commands if c[0] == "bench"]) >= 3
  for argv in commands:
    try:
      rc = cli.main(argv + ["--kernel", kernel])
    except SystemExit as e:  # argparse's choices (simulate, parity) for unknown names
      rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--kernel" in err[0], (argv, err)
    assert kernel in err[0], (argv, err)


def test_kernels_that_run_here_pass_the_check():
  for kernel in ("auto", "jnp", "triton_interpret", "mosaic_interpret"):
    cli.check_kernel(kernel)
    cli.check_kernel(kernel, "cpu")
  cli.check_kernel("mosaic", "tpu")
  from jax_kvalloc import kernels  # pylint: disable=g-import-not-at-top
  assert "TPU" in kernels.unavailable("mosaic", "cpu")
  assert "GPU" in kernels.unavailable("triton", "cpu")
  assert kernels.unavailable("auto", "tpu") is None
