"""Medians [q1, q3] over the runs of o1.jsonl (measure_o1.py): per option set, the XLA
compile's process CPU seconds and compile wall seconds of the three page sizes summed,
and per page size the step's p50 us."""
import json, sys
import numpy as np
runs = [json.loads(l) for l in open(sys.argv[1] if len(sys.argv) > 1 else "o1.jsonl")]
def q(v):
    a = np.percentile(v, [50, 25, 75]); return f"{a[0]:.2f} [{a[1]:.2f}, {a[2]:.2f}]"
print("| XLA options | runs | XLA compile CPU s (3 page sizes) | compile wall s (one after another) | step p50 us, page size 1 / 16 / 64 |")
print("|---|---:|---:|---:|---|")
for opts in ({}, {"xla_backend_optimization_level": 1}):
    sel = [r for r in runs if r["options"] == opts]
    cpu = [sum(p["xla_compile_cpu_s"] for p in r["page_sizes"]) for r in sel]
    wall = [sum(p["compile_wall_s"] for p in r["page_sizes"]) for r in sel]
    steps = " / ".join(q([r["page_sizes"][i]["step_us_p50"] for r in sel]) for i in range(3))
    print(f"| {sel[0]['page_sizes'][0]['options']} | {len(sel)} | {q(cpu)} | {q(wall)} | {steps} |")
same = all(len({tuple(p['steps'] for p in r['page_sizes']) for r in runs}) == 1 for _ in [0])
print(f"\nsteps per page size identical in every run: {same}")
