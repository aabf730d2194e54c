"""Tooling around the allocator: the `jax-kvalloc` command (cli: one subcommand per tool,
cli.COMMANDS) and what it runs: simulate, the main job (simulate_step its policy,
simulate_cli its options, simulate_trace its replay of traces, workload its requests);
bench, the one benchmark harness (timing takes the times, bench_* are its suites); report
(tables, the verdict rule, the docs' generated tables from benchmarks/results/); traces
and parity (lock-step parity of jax_kvalloc, torch_ref and SGLang through sglang_oracle);
local_processes (several JAX processes on one machine, for ranks over processes).

Arrows run one way: this package imports the allocator core (jax_kvalloc), the kernels
(pallas_kernels) and the reference (torch_ref); none of those imports it.
"""
