"""LLVM -O1 for the simulator's CPU loops: each run a fresh process that compiles the
default workload's three page sizes one after another (simulate.prepare) with the given
XLA options and runs each once (simulate.run_page_size); the options alternate run by run.

    python measure_o1.py REPS > o1.jsonl    (from a checkout root, PYTHONPATH=.)
"""
import json, subprocess, sys

CHILD = r'''
import json, sys, time
from jax_kvalloc.tools import simulate
extra = json.loads(sys.argv[1])
cfg = simulate.SimConfig(); wl = cfg.workload()
out = {"options": extra, "page_sizes": []}
for ps in cfg.page_sizes:
    opts = dict(simulate.COMPILE_OPTIONS["cpu"]); opts.pop("xla_backend_optimization_level", None)
    opts.update(extra)
    p = simulate.prepare(cfg, wl, int(ps), opts)
    r = simulate.run_page_size(cfg, wl, p, False)
    out["page_sizes"].append({"page_size": int(ps), "compile_wall_s": p.compile_s,
        "lowering_cpu_s": p.cpu_s[0], "xla_compile_cpu_s": p.cpu_s[1],
        "options": p.options, "steps": r.steps, "run_wall_s": r.wall_s, "step_us_p50": float(simulate.percentile(r.step_us, 50))})
print(json.dumps(out))
'''
reps = int(sys.argv[1])
for i in range(reps):
    for extra in ({}, {"xla_backend_optimization_level": 1}):
        res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(extra)],
                             capture_output=True, text=True, check=True)
        print(res.stdout.strip().splitlines()[-1], flush=True)
