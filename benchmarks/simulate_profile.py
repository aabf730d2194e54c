"""The simulator's device step, operation by operation, from the device's own timeline.

    python benchmarks/simulate_profile.py --out DIR [--before ROOT] [--page-sizes 16,64]

For this checkout's jax_kvalloc (and, with --before, the one in ROOT: another checkout,
such as main's), and each page size, a subprocess with that checkout on PYTHONPATH
compiles `jax-kvalloc simulate`'s device driver on the default workload (fewer requests:
--num-requests), runs it once to warm up, once timed and once under jax.profiler.trace,
then reads the trace (on a GPU, of a second compile without CUDA graphs, whose kernels
the trace cannot see): the device's operations (on a GPU, the kernels, copies and memsets
on its streams; on the CPU, XLA's thunks) and their durations. It reports per step: the
wall time, the operations and the device's busy time, both by kind (the operation's name
without its number) and by the step's named scope (jax_kvalloc.tools.simulate_step
names its table phases; other operations are the scheduler's "plan"), and the kernel-like
operations of the compiled loop body by scope. Writes DIR/profile.json and prints the
tables that BENCHMARKS.md quotes.

A step here is an iteration that ran a prefill or a decode; a loop's idle and trailing
iterations (the last call's, after the workload is done) count towards the operations
and the device time, so per-step figures are slightly high for both.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time

SCOPES = ("borrow", "release", "window", "extend", "decode", "hand_over", "step_rows",
          "census", "table")
KERNEL_OPS = ("fusion", "copy", "scatter", "gather", "sort", "custom-call", "conditional",
              "while", "dynamic-update-slice", "dynamic-slice", "reduce", "select", "add",
              "compare", "concatenate", "triton")
CONTAINERS = ("while", "conditional", "cond", "call", "command_buffer")


def _computations(text: str) -> dict:
  comps, cur = {}, None
  for line in text.splitlines():
    m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if m and not line.startswith(" "):
      cur = comps.setdefault(m.group(2), [])
      continue
    if line.startswith("}"):
      cur = None
    elif cur is not None and " = " in line:
      cur.append(line.strip())
  return comps


def _op(line: str) -> str:
  rhs = line.split(" = ", 1)[1]
  if rhs.startswith("("):  # a tuple shape: skip to its closing parenthesis
    depth = 0
    for i, ch in enumerate(rhs):
      depth += (ch == "(") - (ch == ")")
      if depth == 0:
        rhs = rhs[i + 1:]
        break
  else:
    rhs = rhs.split(" ", 1)[-1]
  m = re.match(r"\s*([\w\-]+)\(", rhs)
  return m.group(1) if m else "?"


def _scope(line: str) -> str:
  m = re.search(r'op_name="([^"]*)"', line)
  path = (m.group(1) if m else "") + "/"
  return next((s for s in SCOPES if f"/{s}/" in path), "plan")


def hlo_scopes(text: str) -> tuple:
  """({instruction name: scope} over the module, Counter of the loop body's kernel-like
  operations by scope, the conditionals' branches included)."""
  comps = _computations(text)
  names = {}
  for lines in comps.values():
    for line in lines:
      names[line.split(" = ", 1)[0].split()[-1].lstrip("%")] = _scope(line)
  bodies = re.findall(r"while\(.*?body=%?([\w.\-]+)", text)
  counts = collections.Counter()
  if not bodies:
    return names, counts
  todo, seen = [max(bodies, key=lambda b: len(comps.get(b, [])))], set()
  while todo:
    name = todo.pop()
    if name in seen:
      continue
    seen.add(name)
    for line in comps.get(name, []):
      op = _op(line)
      if op in ("conditional", "while"):
        todo += [b.strip().lstrip("%") for b in re.findall(
            r"(?:branch_computations=\{([^}]*)\}|body=%?([\w.\-]+))", line)
                 for b in ",".join(b).split(",") if b.strip()]
      if op in KERNEL_OPS:
        counts[_scope(line)] += 1
  return names, counts


def _device_ops(trace_dir: str) -> list:
  """[(name, microseconds)] of the device's operations in a jax.profiler trace."""
  path = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)[0]
  with gzip.open(path) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  procs = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  gpu = [p for p, n in procs.items() if "/device:GPU" in n]
  out = []
  for e in events:
    if e.get("ph") != "X":
      continue
    name = e["name"]
    if gpu:  # the streams' activities (not the derived "XLA Ops" / "Steps" lines)
      if e["pid"] not in gpu or not threads.get((e["pid"], e.get("tid")), "").startswith(
          "Stream"):
        continue
    elif not threads.get((e["pid"], e.get("tid")), "").startswith("tf_XLA"):
      continue
    base = re.sub(r"[._]\d+$", "", name)
    if name.startswith(("end: ", "Thunk", "ThreadpoolListener")) or base in CONTAINERS:
      continue
    out.append((name, float(e.get("dur", 0.0))))
  return out


NO_GRAPHS = {"xla_gpu_enable_command_buffer": ""}


def compile_split(cfg, wl, page_size: int) -> dict:
  """The loop's first lowering (tracing included) and XLA compile, each as wall and
  process CPU seconds, and the compiled module's HLO instructions (the first compile in
  the process: nothing cached)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import simulate as sim  # pylint: disable=g-import-not-at-top
  backend = jax.default_backend()
  lay = sim.make_layout(cfg, wl, page_size)
  if hasattr(sim, "prepare"):
    from jax_kvalloc.tools import simulate_step as sstep  # pylint: disable=g-import-not-at-top
    dwl = sim.device_workload(cfg, wl)
    carry = jax.jit(sstep.init_carry, static_argnums=0)(lay)
    blocks = -(-cfg.steps_per_call // cfg.runs_every)
    lower = lambda: sstep.run_steps.lower(lay, dwl, carry, blocks=blocks,
                                          runs_every=cfg.runs_every)
    options = sim.COMPILE_OPTIONS.get(backend, {})
  else:
    from jax_kvalloc.tools import simulate_device as sd  # pylint: disable=g-import-not-at-top
    dwl = sd.DeviceWorkload(*(jnp.asarray(a, jnp.int32) for a in (
        wl.arrival, wl.group, wl.prompt, wl.output, wl.prefix_len)))
    carry = sd.Carry(*sim.init_pool(lay), sd.init_sched(lay))
    lower = lambda: sd.run_steps.lower(lay, dwl, carry, steps_per_call=cfg.steps_per_call,
                                       runs_every=cfg.runs_every, branch=True)
    options = sd.CPU_OPTIONS if backend == "cpu" else sd.GPU_OPTIONS
  c0, w0 = time.process_time(), time.perf_counter()
  lowered = lower()
  c1, w1 = time.process_time(), time.perf_counter()
  try:
    compiled = lowered.compile(options)
  except Exception:  # pylint: disable=broad-except
    compiled = lowered.compile()
  c2, w2 = time.process_time(), time.perf_counter()
  return {"lower_s": w1 - w0, "lower_cpu_s": c1 - c0, "xla_compile_s": w2 - w1,
          "xla_compile_cpu_s": c2 - c1,
          "hlo_instructions": compiled.as_text().count(" = ")}


def worker(page_size: int, num_requests: int, steps_per_call: int) -> dict:
  """Runs in the subprocess: compile, warm up, time, profile one page size. The timed run
  uses the driver's own compile options (on a GPU: CUDA graphs); the traced run a second
  compile without command buffers, since the trace does not see the kernels inside a
  graph (its wall time per step is reported too)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.tools import simulate as sim  # pylint: disable=g-import-not-at-top
  cfg = sim.SimConfig(page_sizes=(page_size,), num_requests=num_requests,
                      steps_per_call=steps_per_call)
  wl = cfg.workload()
  gpu = jax.default_backend() == "gpu"
  if hasattr(sim, "prepare"):  # one policy (simulate_step)
    from jax_kvalloc.tools import simulate_step as sstep  # pylint: disable=g-import-not-at-top

    def prepare(graphs: bool):
      sim.clear_compiled()
      sim.COMPILE_OPTIONS["gpu"] = dict(sim.COMPILE_OPTIONS.get("gpu", {}),
                                        **({} if graphs else NO_GRAPHS))
      return sim.prepare(cfg, wl, page_size)
    hlo_of = lambda p: p.fn.as_text()
    fresh = lambda p: p._replace(carry=jax.jit(sstep.init_carry, static_argnums=0)(p.lay))
    run = lambda p: sim.run_page_size(cfg, wl, p, False)
  else:  # main before issue 34: simulate_device
    from jax_kvalloc.tools import simulate_device as sd  # pylint: disable=g-import-not-at-top

    def prepare(graphs: bool):
      sd.GPU_OPTIONS = dict(sd.GPU_OPTIONS, **({} if graphs else NO_GRAPHS))
      return sd.prepare(cfg, wl, page_size)
    hlo_of = lambda p: p.compiled.as_text()
    fresh = lambda p: p._replace(carry=sd.Carry(*sim.init_pool(p.lay), sd.init_sched(p.lay)))
    run = lambda p: sd.run_page_size(cfg, wl, p, False)
  split = compile_split(cfg, wl, page_size)
  t0 = time.perf_counter()
  prep = prepare(True)
  compile_s = time.perf_counter() - t0
  hlo = hlo_of(prep)
  run(prep)
  timed = run(fresh(prep))
  if gpu:
    prep = prepare(False)
    run(prep)
  plain = run(fresh(prep))
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      res = run(fresh(prep))
    ops = _device_ops(tmp)
  names, body = hlo_scopes(hlo)
  names.update(hlo_scopes(hlo_of(prep))[0])
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
  return {"page_size": page_size, "backend": jax.default_backend(),
          "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
          "steps": res.steps, "calls": res.calls, "compile_s": compile_s, **split,
          "wall_us_per_step": timed.step_wall_us,
          "graphless_wall_us_per_step": plain.step_wall_us if gpu else None,
          "profiled_wall_us_per_step": res.step_wall_us,
          "ops_per_step": len(ops) / steps,
          "busy_us_per_step": sum(us for _, us in ops) / steps,
          "by_kind": per(kinds), "by_scope": per(scopes),
          "body_ops": dict(body), "body_ops_total": sum(body.values())}


def _table(rows: list, top: int) -> str:
  out = []
  for r in rows:
    out.append(f"\n{r['label']}, page size {r['page_size']} ({r['device']}, jax {r['jax']}):"
               f" lowering {r['lower_cpu_s']:.1f} s CPU, XLA compile "
               f"{r['xla_compile_cpu_s']:.1f} s CPU ({r['hlo_instructions']} HLO "
               f"instructions); {r['steps']} steps, wall {r['wall_us_per_step']:.1f} us/step, "
               f"{r['ops_per_step']:.1f} device ops/step busy {r['busy_us_per_step']:.1f} "
               f"us/step; loop body {r['body_ops_total']} kernel-like ops "
               f"{r['body_ops']}")
    out.append("| kind | per step | us per step |\n|---|---:|---:|")
    out += [f"| {k} | {n:.2f} | {us:.2f} |" for k, n, us in r["by_kind"][:top]]
    out.append("| scope | per step | us per step |\n|---|---:|---:|")
    out += [f"| {k} | {n:.2f} | {us:.2f} |" for k, n, us in r["by_scope"]]
  return "\n".join(out)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True, help="folder for profile.json")
  p.add_argument("--before", help="another checkout's root to profile too (e.g. main)")
  p.add_argument("--page-sizes", default="16,64", help="comma-separated (default: 16,64)")
  p.add_argument("--num-requests", type=int, default=200, help="workload size (default: 200)")
  p.add_argument("--steps-per-call", type=int, default=256, help="(default: 256)")
  p.add_argument("--top", type=int, default=10, help="kinds per table (default: 10)")
  p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker is not None:
    json.dump(worker(args.worker, args.num_requests, args.steps_per_call), sys.stdout)
    return 0
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  roots = [("after", here)] + ([("before", os.path.abspath(args.before))]
                               if args.before else [])
  rows = []
  os.makedirs(args.out, exist_ok=True)
  page_sizes = [int(x) for x in args.page_sizes.split(",")]
  for ps in page_sizes:
    for label, root in roots:
      env = dict(os.environ, PYTHONPATH=root)
      proc = subprocess.run(
          [sys.executable, os.path.abspath(__file__), "--out", args.out, "--worker",
           str(ps), "--num-requests", str(args.num_requests), "--steps-per-call",
           str(args.steps_per_call)], env=env, capture_output=True, text=True, cwd=root)
      if proc.returncode:
        rows.append({"label": label, "page_size": ps, "error": proc.stderr[-3000:]})
        print(f"{label} page size {ps} failed:\n{proc.stderr[-3000:]}", flush=True)
      else:
        row = dict(json.loads(proc.stdout.strip().splitlines()[-1]), label=label,
                   root=root)
        rows.append(row)
        print(_table([row], args.top), flush=True)
      with open(os.path.join(args.out, "profile.json"), "w") as f:  # after every run
        json.dump({"command": " ".join(sys.argv), "xla_flags": os.environ.get(
            "XLA_FLAGS", ""), "rows": rows}, f, indent=1)
        f.write("\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
