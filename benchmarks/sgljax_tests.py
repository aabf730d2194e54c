"""sglang-jax's own allocator and cache tests, unchanged, on its own allocator and on
jax_kvalloc's flavour (jax_kvalloc.sgl_jax.patch), one pytest process per test file.

  python benchmarks/sgljax_tests.py --sglang-jax ../shared/anchors/sglang-jax \
      [--configs own,host-noguard,host-guard,device-noguard,device-guard] [--out DIR]
      [--jobs N] [--baseline DIR]   # N files at once; DIR/own.json as the own counts
  python benchmarks/sgljax_tests.py --table DIR   # the README's table of a result folder

Needs Python >= 3.12 with sglang-jax's test requirements (README, "Use with
sglang-jax") and this tree importable. Each file runs with USE_DEVICE_TYPE=cpu
JAX_PLATFORMS=cpu and XLA_FLAGS=--xla_force_host_platform_device_count=8 (1 for
test_hicache_e2e, which needs one device), and, patched, with
`-p jax_kvalloc.sgl_jax.pytest_check` (a refusal still pending at a test's end fails
it). Writes DIR/<config>.json (per file: passed, failed, errors, skipped, the ids
that did not pass, seconds) and DIR/manifest.json; prints a table. Exit status 1 when a
patched configuration fails a test that sglang-jax's own allocator passes, except
with the guard on the tests of KNOWN_GUARD_FAILURES (they free slots never allocated).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from typing import Dict, List

FILES = [
    "python/sgl_jax/test/mem_cache/test_paged_allocator_multi_dp.py",
    "python/sgl_jax/test/mem_cache/test_swa_allocator.py",
    "python/sgl_jax/test/mem_cache/test_radix_cache.py",
    "python/sgl_jax/test/mem_cache/test_swa_radix_cache.py",
    "python/sgl_jax/test/mem_cache/test_unified_radix_cache.py",
    "python/sgl_jax/test/mem_cache/test_unified_radix_tree_flag.py",
    "python/sgl_jax/test/mem_cache/test_hicache_e2e.py",
    "python/sgl_jax/test/test_kv_cache_builder.py",
    "python/sgl_jax/test/test_mixed_chunk_dp.py",
    "python/sgl_jax/test/test_scheduler_chunked_ownership.py",
    "python/sgl_jax/test/test_swa_schedule_budget.py",
    "test/srt/test_prepare_for_extend_protected_len.py",
    "test/srt/test_recurrent_boundary_split.py",
    "test/srt/test_merge_cache_loc.py",
    "test/srt/disaggregation/test_pd_decode.py",
    "test/srt/disaggregation/test_pathways_pd.py",
]
ONE_DEVICE = ("test_hicache_e2e.py",)
CONFIGS = {  # name: (backend, guard); None: sglang-jax's own allocator
    "own": None,
    "host-noguard": ("host", False),
    "host-guard": ("host", True),
    "device-noguard": ("device", False),
    "device-guard": ("device", True),
}
# Tests that free slots they never allocated: with the guard on, the ownership record
# refuses them (README, "Use with sglang-jax", says where each makes up its slots).
_U = "python.sgl_jax.test.mem_cache.test_unified_radix_cache."
KNOWN_GUARD_FAILURES: List[str] = [
    "python.sgl_jax.test.mem_cache.test_radix_cache.TestRadixCache::test_eviction",
] + [_U + t for t in (
    "TestUnifiedRadixCache::test_dp_rank_isolation",
    "TestUnifiedRadixCache::test_equivalence_with_radix_cache_page1",
    "TestUnifiedRadixCache::test_equivalence_with_radix_cache_page128",
    "TestUnifiedRadixCache::test_evict_device_leaf_tombstones_and_unlinks",
    "TestUnifiedRadixCache::test_lock_protects_from_eviction",
    "TestUnifiedRadixCache::test_lru_eviction_order",
    "TestUnifiedRadixCacheRecurrent::test_abort_and_retract_release_recurrent_slots",
    "TestUnifiedRadixCacheRecurrent::test_commit_match_cow_evict_ledger",
    "TestUnifiedRadixCacheRecurrent::test_hicache_tombstone_blocks_recurrent_match",
    "TestUnifiedRadixCacheRecurrent::test_lock_protects_recurrent_leaf",
    "TestUnifiedRadixCacheRecurrent::test_longer_prefix_after_shorter_frees_parent",
    "TestUnifiedRadixCacheRecurrentExtraBuffer::"
    "test_alloc_req_slots_evicts_exact_three_x_shortfall_dp1",
    "TestUnifiedRadixCacheRecurrentExtraBuffer::"
    "test_alloc_req_slots_evicts_exact_three_x_shortfall_dp2")]

RUN = """
import sys
import jax_kvalloc.sgl_jax as s
s.patch(backend={backend!r}, guard={guard!r})
import pytest
sys.exit(pytest.main(sys.argv[1:] + ["-p", "jax_kvalloc.sgl_jax.pytest_check"]))
"""


def run_file(root: str, path: str, config, tree: str, timeout: float) -> Dict:
  env = dict(os.environ, USE_DEVICE_TYPE="cpu", JAX_PLATFORMS="cpu",
             SGLANG_TEST_MAX_RETRY="0",  # its CustomTestCase retries failures in CI
             XLA_FLAGS=" ".join(
                 [f for f in os.environ.get("XLA_FLAGS", "").split()
                  if "device_count" not in f]
                 + ["--xla_force_host_platform_device_count="
                    + ("1" if os.path.basename(path) in ONE_DEVICE else "8")]))
  env.pop("JAX_KVALLOC_SGL_JAX", None)
  env["PYTHONPATH"] = os.pathsep.join([tree, os.path.join(root, "python")]
                                      + [p for p in [env.get("PYTHONPATH")] if p])
  with tempfile.TemporaryDirectory() as tmp:
    xml = os.path.join(tmp, "junit.xml")
    args = [os.path.join(root, path), "-q", "-p", "no:cacheprovider",
            f"--junitxml={xml}", "-o", "junit_family=xunit2", "--rootdir", root]
    if config is None:
      cmd = [sys.executable, "-m", "pytest"] + args
    else:
      cmd = [sys.executable, "-c", RUN.format(backend=config[0], guard=config[1])] + args
    t0 = time.perf_counter()
    try:
      proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True,
                            timeout=timeout)
      rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
      rc, tail = -1, f"timeout after {timeout} s: {e}"
    seconds = time.perf_counter() - t0
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    not_passed: Dict[str, str] = {}
    has_xml = os.path.exists(xml)
    if has_xml:
      for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = [c.tag for c in case]
        if "failure" in kinds:
          counts["failed"] += 1
        elif "error" in kinds:
          counts["errors"] += 1
        elif "skipped" in kinds:
          counts["skipped"] += 1
          continue
        else:
          counts["passed"] += 1
          continue
        bad = case.find("failure") if "failure" in kinds else case.find("error")
        not_passed[name] = _cause(bad)
  return dict(counts, rc=rc, seconds=round(seconds, 2), not_passed=not_passed,
              tail=tail if rc not in (0, 1) or not has_xml else "")


def _cause(element) -> str:
  """The first exception of a failure's traceback (sglang-jax's test case wraps it in
  its retry() Exception), else the failure's message."""
  for line in (element.text or "").splitlines():
    line = line.strip()
    if line.startswith("E ") and "Error" in line.split(":")[0]:
      return line[1:].strip()[:300]
  return (element.get("message") or "")[:300]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sglang-jax", help="sglang-jax's checkout")
  parser.add_argument("--table", default="", help="print a result folder's table")
  parser.add_argument("--configs", default=",".join(CONFIGS))
  parser.add_argument("--files", default="", help="comma-separated subset of FILES")
  parser.add_argument("--out", default="")
  parser.add_argument("--timeout", type=float, default=900)
  parser.add_argument("--jobs", type=int, default=1, help="test files run at once")
  parser.add_argument("--baseline", default="",
                      help="a result folder whose own.json stands for --configs own")
  args = parser.parse_args()
  if args.table:
    print(table(args.table))
    return 0
  if not args.sglang_jax:
    parser.error("--sglang-jax is required")
  root = os.path.abspath(args.sglang_jax)
  tree = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  files = [f for f in FILES if not args.files
           or any(f.endswith(x) for x in args.files.split(","))]
  configs = args.configs.split(",")
  unknown = [c for c in configs if c not in CONFIGS]
  if unknown:
    parser.error(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
  results = {}
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(max(args.jobs, 1)) as pool:
    for name in configs:
      runs = [(path, pool.submit(run_file, root, path, CONFIGS[name], tree, args.timeout))
              for path in files]
      results[name] = {}
      for path, future in runs:
        r = results[name][path] = future.result()
        print(f"{name:15s} {os.path.basename(path):45s} passed={r['passed']:3d} "
              f"failed={r['failed']:3d} errors={r['errors']:3d} "
              f"skipped={r['skipped']:2d} {r['seconds']:6.1f} s", flush=True)
        if r["tail"]:
          print(r["tail"], flush=True)
  print(f"wall time {time.perf_counter() - t0:.0f} s ({args.jobs} at once)")
  baseline = None
  if args.baseline and "own" not in results:
    with open(os.path.join(args.baseline, "own.json")) as f:
      baseline = {p: r for p, r in json.load(f).items() if p in files}
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    for name, per_file in results.items():
      with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(per_file, f, indent=1, sort_keys=True, allow_nan=False)
    from jax_kvalloc.tools import bench  # the result folders' one manifest format
    manifest = bench.manifest(args.out, " ".join(sys.argv))
    manifest.update({"python": sys.version, "platform": platform.platform(),
                     "configs": configs, "test_files": files, "sglang_jax": _commit(root),
                     "jobs": args.jobs,
                     "totals": {n: {k: sum(r[k] for r in per.values())
                                    for k in ("passed", "failed", "errors", "skipped")}
                                for n, per in results.items()}})
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
      json.dump(manifest, f, indent=1, sort_keys=True, allow_nan=False)
  print("totals:")
  for n, per in results.items():
    print(f"  {n:15s} " + " ".join(f"{k}={sum(r[k] for r in per.values())}"
                                    for k in ("passed", "failed", "errors", "skipped")))
  return _verdict(results, baseline)


def _verdict(results, baseline=None) -> int:
  """1 when a patched configuration fails what the own allocator passes (guard on:
  except KNOWN_GUARD_FAILURES)."""
  own = results.get("own", baseline)
  bad = []
  for name, per in results.items():
    if name == "own":
      continue
    for path, r in per.items():
      own_failed = set(own[path]["not_passed"]) if own else set()
      for test in r["not_passed"]:
        if test in own_failed:
          continue
        if (CONFIGS[name][1] and test in KNOWN_GUARD_FAILURES
            and "is not held" in r["not_passed"][test]):
          continue  # the guard's refusal, not another failure
        bad.append(f"{name}: {test}")
      if r["rc"] not in (0, 1):
        bad.append(f"{name}: {path} ended with rc={r['rc']}")
  for b in bad:
    print("NOT AS EXPECTED:", b)
  return 1 if bad else 0


def table(folder: str) -> str:
  """Markdown: per configuration, the totals and the files where any test failed."""
  names = {"own": "sglang-jax's own allocator", "host-noguard": "host, guard=False",
           "host-guard": "host, guard on", "device-noguard": "device, guard=False",
           "device-guard": "device, guard on"}
  rows = ["| allocator | passed | failed | errors | files with a failure (failed/total) |",
          "|---|---|---|---|---|"]
  for name in CONFIGS:
    path = os.path.join(folder, f"{name}.json")
    if not os.path.exists(path):
      continue
    with open(path) as f:
      per = json.load(f)
    tot = {k: sum(r[k] for r in per.values()) for k in ("passed", "failed", "errors")}
    where = ", ".join(f"{os.path.basename(p)[:-3]} {r['failed'] + r['errors']}/"
                      f"{r['passed'] + r['failed'] + r['errors']}"
                      for p, r in per.items() if r["failed"] + r["errors"])
    rows.append(f"| {names[name]} | {tot['passed']} | {tot['failed']} | {tot['errors']} "
                f"| {where} |")
  return "\n".join(rows)


def _commit(root: str) -> str:
  try:
    with open(os.path.join(root, "PROVENANCE.txt")) as f:
      return f.readline().strip()
  except OSError:
    return "unknown"


if __name__ == "__main__":
  sys.exit(main())
