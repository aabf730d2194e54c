"""Tooling around the allocator: the `jax-kvalloc` command and what it runs.

  cli            the command line (`jax-kvalloc simulate | bench | parity | demo`)
  simulate*      the main job: a simulated serving workload (host scheduler + jitted steps)
  workload       the workload generator of `simulate`
  bench*         microbenchmarks and the serving-loop benchmark
  timing         the one timing harness every benchmark uses
  report         tables, plots, the verdict rule, and `jax-kvalloc report` (the docs'
                 generated tables from benchmarks/results/)
  traces         the JSON-lines trace format, replayers and the seeded trace generator
  parity         lock-step parity of jax_kvalloc, torch_ref and SGLang over traces
  sglang_oracle  an adapter that drives the released SGLang allocator

Arrows run one way: this package imports the allocator core (jax_kvalloc), the kernels
(pallas_kernels) and the reference (torch_ref); none of those imports it.
"""
