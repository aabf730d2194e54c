"""torch_ref: a torch + Triton reference of SGLang's token-to-KV-pool allocators, written
from ../shared/SPEC.md, and the parity harness that checks jax_kvalloc against it.

Allocators (same class and method names as jax_kvalloc's SGLang-compatible classes):
  TokenToKVPoolAllocator(size, dtype, device, kvcache, need_sort)
  PagedTokenToKVPoolAllocator(size, page_size, dtype, device, kvcache, need_sort,
                              *, kernel="auto"|"triton"|"torch")
The free and release lists are int64 torch tensors on `device`; outputs are int64
tensors, None on failure. The paged allocator checks capacity on the host, then computes
extend/decode slots with Triton kernels of one program per request
(torch_ref.triton_kernels) or with plain torch (torch_ref.index_torch). Triton runs on
CUDA, or on CPU under TRITON_INTERPRET=1 (set it before torch_ref.triton_kernels is first
imported). Importing torch_ref needs torch but no GPU and not triton.

Parity command
--------------
    python -m torch_ref.parity TRACE.jsonl [TRACE2.jsonl ...] [options]
    python -m torch_ref.parity --generate N --seed S [--steps K] [options]

replays traces (the JSON-lines format documented in jax_kvalloc.traces: one operation a
line, optionally with its expected result, free_pages, release_pages and available_size)
through jax_kvalloc, torch_ref and, when the `sglang` package is importable, SGLang's own
allocator, in lock step. After every step it compares each one's result (slot ids or
failure), full free and release lists (SGLang's release list as a set: newer releases
keep it unordered) and available_size with the trace and with jax_kvalloc. `--generate`
makes seeded serving workloads instead (arrivals, shared prefixes, chunked prefill
batches, decode, speculative steps with snapshots and rollbacks, random finishes, free
groups, evictions; page sizes 1, 4, 16, 64; need_sort on and off; pools that run out),
driven by jax_kvalloc, with a leak check at every step.

Options: --device cpu|cuda (default cpu); --kernel jnp|pallas|pallas_interpret|auto
(jax_kvalloc's index kernel, default jnp); --torch-kernel triton|torch|auto or a comma
list such as triton,torch to compare both (default triton; on cpu it sets
TRITON_INTERPRET=1); --impls jax,torch (which to run besides SGLang, the first one
leading; `--impls torch` checks torch_ref alone against a file's recorded results);
--sglang auto|on|off; --steps K (default 300) --page-sizes 1,4,16,64 --scale ci|long
(pool and batch sizes, default ci on cpu and long on cuda) --need-sort mixed|on|off;
--write OUT.jsonl saves the generated traces (and, on a mismatch, the trace up to it,
for replay); --quiet.

It prints one line per trace and a summary ("parity OK: ... steps ... matched by ..."),
or the first mismatch: trace, step, op and arguments, which implementations disagree,
and the field (result, free_pages, release_pages, available_size) with its first
differing index (or, if one raised, its exception), and saves the trace up to there.
Exit status 0 (all matched), 1 (mismatch or exception), 2 (bad arguments or trace
file), 3 (a requested implementation is unavailable).

Examples:
    python -m torch_ref.parity my_trace.jsonl --torch-kernel torch      # quick, CPU
    python -m torch_ref.parity --generate 12 --seed 300 --steps 250     # Triton interp.
    python -m torch_ref.parity --device cuda --kernel pallas --torch-kernel triton,torch
        --generate 4 --seed 1000 --steps 3000                           # H200, one line
"""
from torch_ref.base import TorchAllocatorSnapshot
from torch_ref.paged import PagedTokenToKVPoolAllocator
from torch_ref.token import TokenToKVPoolAllocator

__all__ = [
    "PagedTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "TorchAllocatorSnapshot",
]
