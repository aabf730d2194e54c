"""Tooling around the allocator: the `jax-kvalloc` command and what it runs.

  cli            the command line: one subcommand per tool (cli.COMMANDS)
  simulate       the main job: a simulated serving workload, its drivers and report;
                 simulate_step its policy (one jitted step), simulate_cli its options,
                 simulate_trace its replay of recorded traces
  workload       the workload generator of `simulate`
  bench          the one benchmark harness (cases, suites, one parser); bench_* its suites
  timing         how every benchmark takes a time
  report         tables, the verdict rule, and `jax-kvalloc report` (the docs' generated
                 tables from benchmarks/results/)
  traces         the JSON-lines trace format, replayers and the seeded trace generator
  parity         lock-step parity of jax_kvalloc, torch_ref and SGLang over traces
  sglang_oracle  an adapter that drives the released SGLang allocator
  local_processes  several JAX processes on one machine (ranks over processes)

Arrows run one way: this package imports the allocator core (jax_kvalloc), the kernels
(pallas_kernels) and the reference (torch_ref); none of those imports it.
"""
