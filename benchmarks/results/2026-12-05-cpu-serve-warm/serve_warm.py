"""`jax-kvalloc serve` cold and warm, bad prompts, and a small pool's retractions.

  PYTHONPATH=$PWD python benchmarks/results/2026-12-05-cpu-serve-warm/serve_warm.py [PAIRS]

From the repository root. PAIRS (default 3) pairs of the default `serve` (six built-in
prompts, 32 new tokens, SmolLM2-135M fp32): cold (an empty XDG_CACHE_HOME: no compiled
steps, no kept weights) then warm (the same folder). Then, warm: an empty prompt and a
prompt longer than the context (each must fail, exit 2, before the weights load), and the
default prompts with up to 100 new tokens (stopping at end-of-sequence) in a pool of 12
pages of 16 (retractions). Each run's
wall time (the subprocess, start to exit) and the 1-minute load average before and after
it go to results.json; each run's JSON output to run-*.json; manifest.json beside them.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def load() -> float:
  with open("/proc/loadavg") as f:
    return float(f.read().split()[0])


def serve(name, args, env):
  out = os.path.join(HERE, f"run-{name}.json")
  before = load()
  t0 = time.perf_counter()
  p = subprocess.run([sys.executable, "-m", "jax_kvalloc", "serve", *args, "--json", out],
                     env=env, capture_output=True, text=True)
  wall = time.perf_counter() - t0
  shown = [a if len(a) < 40 else f"{a[:12]}... ({len(a)} characters)" for a in args]
  rec = dict(name=name, args=shown, rc=p.returncode, wall_s=round(wall, 2),
             load_before=before, load_after=load(),
             stderr_last=(p.stderr.strip().splitlines() or [""])[-1])
  if p.returncode == 0:
    stats = json.load(open(out), parse_constant=lambda c: 1 / 0)["stats"]
    rec.update({k: stats[k] for k in ("load_s", "total_s", "process_cpu_s",
                                      "weights_from_cache", "retractions",
                                      "recomputed_tokens", "late_compiles", "generated")})
  print(json.dumps(rec), flush=True)
  return rec


def spread(values):
  return dict(median=statistics.median(values), min=min(values), max=max(values))


def main():
  pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
  runs = []
  for i in range(1, pairs + 1):
    home = tempfile.mkdtemp()
    env = dict(os.environ, XDG_CACHE_HOME=home)
    runs.append(serve(f"cold{i}", [], env))
    runs.append(serve(f"warm{i}", [], env))
    if i < pairs:
      shutil.rmtree(home)
  runs.append(serve("empty-prompt", ["--prompt", ""], env))
  runs.append(serve("too-long-prompt", ["--prompt", "x " * 8300], env))
  runs.append(serve("small-pool", ["--pool-pages", "12", "--max-new-tokens", "100"], env))
  shutil.rmtree(home)
  doc = dict(runs=runs,
             cold_wall_s=spread([r["wall_s"] for r in runs if r["name"].startswith("cold")]),
             warm_wall_s=spread([r["wall_s"] for r in runs if r["name"].startswith("warm")]))
  with open(os.path.join(HERE, "results.json"), "w") as f:
    json.dump(doc, f, indent=1, allow_nan=False)
  from jax_kvalloc.tools import bench  # pylint: disable=g-import-not-at-top
  command = "PYTHONPATH=$PWD python " + os.path.relpath(__file__) + " " + str(pairs)
  with open(os.path.join(HERE, "manifest.json"), "w") as f:
    json.dump(bench.manifest(HERE, command), f, indent=1)
  print(json.dumps({k: v for k, v in doc.items() if k != "runs"}))


if __name__ == "__main__":
  main()
