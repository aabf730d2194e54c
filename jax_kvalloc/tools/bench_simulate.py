"""`jax-kvalloc bench simulate`: the main job per page size and driver, and its step
operation by operation.

Columns: device and host run `jax-kvalloc simulate` on its default workload under that
driver (device: the scheduler's loop on the device; host: one jitted call per step): the
median step time, its quartiles over steps, wall time per step and compile seconds.

profile runs the device driver under jax.profiler.trace (on a GPU from a second compile
without command buffers, whose kernels the trace sees, where a CUDA graph hides them) and
reads the device's operations from the trace (on a GPU the kernels, copies and memsets
on its streams; on the CPU XLA's thunks): per step, how many and their busy time, by
kind (the operation's name without its number) and by the step's named scope
(jax_kvalloc.tools.simulate_step names its table phases; the rest is the scheduler's
"plan"). It also times the loop's first lowering and XLA compile (process CPU seconds)
and counts the compiled loop body's kernel-like operations by scope. A step is an
iteration that ran a prefill or a decode; idle and trailing iterations count towards the
operations and device time, so per-step figures are slightly high. To compare two trees,
run it in each (PYTHONPATH=THAT_TREE) with the same options.

device[guard=False] (and so on) runs without the ownership record (SPEC 14);
device[plan=xla] (and profile[plan=xla]) the scheduler's plan as XLA operations where it
would be one Triton program (SimConfig.plan_kernel=False): that program's worth.
"""
from __future__ import annotations

import collections
import functools
import glob
import gzip
import json
import os
import re
import tempfile
from typing import Any, Dict, List, Tuple

import jax
import numpy as np

from jax_kvalloc.tools import bench
from jax_kvalloc.tools import report
from jax_kvalloc.tools import simulate
from jax_kvalloc.tools import simulate_step as sstep
from jax_kvalloc.tools import timing

SCOPES = ("borrow", "release", "window", "extend", "decode", "hand_over", "step_rows",
          "census", "table")
KERNEL_OPS = re.compile(r"= [^=]*? (fusion|copy|scatter|gather|sort|custom-call|"
                        r"conditional|while|dynamic-update-slice|dynamic-slice|reduce|"
                        r"select|add|compare|concatenate|triton)\(")
CONTAINERS = ("while", "conditional", "cond", "call", "command_buffer")
NO_GRAPHS = {"xla_gpu_enable_command_buffer": ""}
TOP_KINDS = 12
GUARD_TARGET_US = 1.0   # the ownership record's cost per engine step (issue 32)


def simulate_timed(cfg: simulate.SimConfig) -> bench.Timed:
  def measure(opts) -> Dict[str, Any]:
    del opts
    r = simulate.run(cfg, progress=False).results[0]
    q1, q3 = timing.quartiles(r.step_us)
    return {"us": float(np.median(r.step_us)), "q1_us": q1, "q3_us": q3,
            "min_us": min(r.step_us), "steps": r.steps, "compile_s": r.compile_s,
            "wall_s": r.wall_s, "wall_us_per_step": r.step_wall_us,
            "alloc_failures": r.alloc_failures, "leak_check": r.leak_check}
  return bench.Timed(measure)


def _scope(line: str) -> str:
  """The first of SCOPES in an HLO instruction's op_name, else "plan"."""
  m = re.search(r'op_name="([^"]*)"', line)
  path = (m.group(1) if m else "") + "/"
  return next((s for s in SCOPES if f"/{s}/" in path), "plan")


def hlo_scopes(text: str) -> Tuple[Dict[str, str], collections.Counter]:
  """({instruction name: scope} over the compiled module, Counter by scope of the
  kernel-like operations of the largest while body and what it calls: conditionals'
  branches, inner loops)."""
  comps, cur = {}, None
  for line in text.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if m:
      cur = comps.setdefault(m.group(1), [])
    elif line.startswith("}"):
      cur = None
    elif cur is not None and " = " in line:
      cur.append(line.strip())
  names = {line.split(" = ", 1)[0].split()[-1].lstrip("%"): _scope(line)
           for lines in comps.values() for line in lines}
  counts = collections.Counter()
  bodies = re.findall(r"while\(.*?body=%?([\w.\-]+)", text)
  todo, seen = [max(bodies, key=lambda b: len(comps.get(b, [])))] if bodies else [], set()
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    for line in comps.get(name, []):
      for called in re.findall(r"branch_computations=\{([^}]*)\}|body=%?([\w.\-]+)", line):
        todo += [b.strip().lstrip("%") for b in ",".join(called).split(",") if b.strip()]
      if KERNEL_OPS.search(line):
        counts[_scope(line)] += 1
  return names, counts


def device_ops(trace_dir: str) -> List[Tuple[str, float]]:
  """[(name, us)] of the device's operations in a jax.profiler trace: a GPU's stream
  activities, else XLA:CPU's thunks (loops, conditionals and markers left out)."""
  path = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)[0]
  with gzip.open(path) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  meta = lambda kind: {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
                       if e.get("ph") == "M" and e.get("name") == kind}
  gpu = {pid for (pid, _), n in meta("process_name").items() if "/device:GPU" in n}
  threads = meta("thread_name")
  out = []
  for e in events:
    thread = threads.get((e.get("pid"), e.get("tid")), "")
    base = re.sub(r"[._]\d+$", "", e.get("name", ""))
    if (e.get("ph") == "X" and thread.startswith("Stream" if gpu else "tf_XLA")
        and (not gpu or e["pid"] in gpu) and base not in CONTAINERS
        and not e["name"].startswith(("end: ", "Thunk", "ThreadpoolListener"))):
      out.append((e["name"], float(e.get("dur", 0.0))))
  return out


def profile_timed(cfg: simulate.SimConfig) -> bench.Timed:
  """The device driver's steps from the device's timeline (the module docstring)."""
  def measure(opts) -> Dict[str, Any]:
    del opts
    wl, page_size = cfg.workload(), cfg.page_sizes[0]
    jax.clear_caches()  # the loop's first lowering and compile, nothing reused
    prep = simulate.prepare(cfg, wl, page_size)
    split = {"lower_cpu_s": prep.cpu_s[0], "xla_compile_cpu_s": prep.cpu_s[1],
             "hlo_instructions": prep.fn.as_text().count(" = ")}
    if jax.default_backend() == "gpu":
      prep = simulate.prepare(cfg, wl, page_size, options=dict(
          simulate.COMPILE_OPTIONS["gpu"], **NO_GRAPHS))
    run = lambda: simulate.run_page_size(cfg, wl, prep._replace(
        carry=jax.jit(sstep.init_carry, static_argnums=0)(prep.lay)), False)
    run()  # warm-up
    plain = run()
    with tempfile.TemporaryDirectory() as tmp:
      with jax.profiler.trace(tmp):
        res = run()
      ops = device_ops(tmp)
    names, body = hlo_scopes(prep.fn.as_text())
    steps = max(res.steps, 1)
    kinds, scopes = collections.defaultdict(lambda: [0, 0.0]), collections.defaultdict(
        lambda: [0, 0.0])
    for name, us in ops:
      kind = re.sub(r"[._]\d+$", "", name)
      scope = names.get(name) or names.get(re.sub(r"_(\d+)$", r".\1", name)) or (
          "copies" if kind.lower().startswith(("memcpy", "memset")) else "?")
      for table, key in ((kinds, kind), (scopes, scope)):
        table[key][0] += 1
        table[key][1] += us
    per = lambda t: sorted(([k, n / steps, us / steps] for k, (n, us) in t.items()),
                           key=lambda r: -r[2])
    return dict(split, us=plain.step_wall_us, steps=res.steps,
                profiled_wall_us_per_step=res.step_wall_us, ops_per_step=len(ops) / steps,
                busy_us_per_step=sum(us for _, us in ops) / steps, by_kind=per(kinds),
                by_scope=per(scopes), body_ops=dict(body),
                body_ops_total=sum(body.values()))
  return bench.Timed(measure)


def cases(o):
  for ps in o.page_sizes:
    for impl in o.impls:
      base, kw = bench.parse_impl(impl)
      cfg = simulate.SimConfig(
          num_requests=o.num_requests, page_sizes=(ps,), kernel=o.kernel, seed=o.seed,
          driver="device" if base == "profile" else base, guard=kw.get("guard", True),
          plan_kernel=kw.get("plan", "auto") != "xla")
      timed = profile_timed if base == "profile" else simulate_timed
      yield bench.Case({"page_size": ps}, impl, functools.partial(timed, cfg))


def render(record: Dict[str, Any]) -> str:
  """The suite's table, then each profiled page size's operations by kind and scope."""
  lines = [bench.table(record, SUITE)]
  f = lambda x: f"{x:.2f}"
  for r in record["rows"]:
    p = r["cells"].get("profile", {})
    if "by_kind" not in p:
      continue
    lines.append(
        f"\nprofile, page size {r['page_size']}: lowering {p['lower_cpu_s']:.1f} s CPU, "
        f"XLA compile {p['xla_compile_cpu_s']:.1f} s CPU ({p['hlo_instructions']} HLO "
        f"instructions); {p['steps']} steps, wall {p['us']:.1f} us/step "
        f"({p['profiled_wall_us_per_step']:.1f} traced), {p['ops_per_step']:.1f} device "
        f"ops/step busy {p['busy_us_per_step']:.1f} us/step; loop body "
        f"{p['body_ops_total']} kernel-like ops {p['body_ops']}")
    for what, rows in (("kind", p["by_kind"][:TOP_KINDS]), ("scope", p["by_scope"])):
      lines.append(report.table([what, "per step", "us per step"],
                                [[k, f(n), f(us)] for k, n, us in rows]))
  return "\n".join(lines)


SUITE = bench.Suite(
    name="simulate", help="the main job (jax-kvalloc simulate) per page size and driver: "
    "time per scheduler step; profile: the device driver's step operation by operation",
    impls=("device", "host", "profile"), default_impls=("device", "host"), cases=cases,
    render=render, compare=(("device", "host"),), guarded=("device", "host", "profile"),
    guard_target=lambda row, col: (GUARD_TARGET_US, "us") if col == "device" else None,
    dims=(bench.Dim("--page-sizes", [1, 16, 64], "page sizes", quick=[16]),
          bench.Dim("--num-requests", 600, "requests in the workload", quick=40),
          bench.Dim("--kernel", "auto", "AllocatorConfig.kernel"),
          bench.Dim("--seed", 0, "seed of the workload")))
