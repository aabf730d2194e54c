"""sglang-jax's own serving path on CPU, driven in-process, every allocator call recorded.

Its `Scheduler` (ModelRunner, ScheduleBatch, the radix cache, chunked prefill, its
schedule policy) is built with a queue in place of its ZeroMQ sockets and stepped the way
its `event_loop_normal` steps it, over SmolLM2-135M written as a Hugging Face folder
(`jax-kvalloc export-hf`). ROUNDS of requests sharing prefixes go in one round at a time
into a pool small enough that the radix cache evicts and freed slots come back. The
allocator is sglang-jax's own (`allocator="sgljax"`) or, through
`jax_kvalloc.sgl_jax.patch`, the flavour on a backend.

    python tests/sgljax_engine.py MODEL_DIR --page-size 1 --trace calls.json
    python tests/sgljax_engine.py MODEL_DIR --engine          # the full sgl_jax.Engine

Needs sgl_jax importable (Python 3.12, the packages its PROVENANCE.txt lists; e.g.
PYTHONPATH=.:/work/shared/anchors/sglang-jax/python). Nothing of sglang-jax is edited:
its bit-rot is worked around from outside (`install_workarounds`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
          "Hugging Face<|im_end|>\n<|im_start|>user\n")
ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"
STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman who "
         "had never seen the city. Every morning he rowed out past the rocks, cast his nets, "
         "and sang the songs his father had taught him.")
chat = lambda q: SYSTEM + q + ASSISTANT
# Rounds of prompts: a shared system prompt, repeats (whole-prompt hits), a long story
# prefix (chunked prefill), then the chats again after the pool has turned over.
ROUNDS = (
    (chat("What is the capital of France?"), chat("Name three prime numbers."),
     chat("Write a haiku about the sea."), chat("What is 2+2?")),
    (chat("What is the capital of France?"), "The capital of France is",
     chat("Who wrote Hamlet?"), chat("Name three prime numbers.")),
    (STORY + " One day", STORY + " Then a storm came and", "def fibonacci(n):",
     STORY + " His daughter"),
    (chat("What color is the sky?"), chat("What is the capital of France?"),
     STORY + " One day", chat("Translate 'good morning' into French.")),
)
NEW_TOKENS = 12
# Allocator methods the engine calls; a call made inside another (merge_and_sort_free in
# alloc, free in free_group_end) is the allocator's own business and is not recorded.
RECORDED = ("alloc", "alloc_extend", "alloc_decode", "free", "free_group_begin",
            "free_group_end", "available_size", "merge_and_sort_free", "clear",
            "backup_state", "restore_state", "free_swa")


def _head_dim_fix(forward_attention):
  """sglang-jax's native (CPU) attention pads K/V's head_dim to a multiple of 128 in its
  KV pool and returns the padded width (64 -> 128 here), which the model's o_proj cannot
  take; the padding lanes of V are zeros, so the first head_dim lanes are the output."""
  if getattr(forward_attention, "head_dim_fix", False):
    return forward_attention

  def fixed(q, k_cache, v_cache, seq_lengths, loc, extend_prefix_lens, extend_seq_lens,
            num_heads, *args, **kwargs):
    out = forward_attention(q, k_cache, v_cache, seq_lengths, loc, extend_prefix_lens,
                            extend_seq_lens, num_heads, *args, **kwargs)
    dh = q.shape[-1] if q.ndim == 3 else q.shape[-1] // num_heads
    if out.shape[-1] != num_heads * dh:
      out = out.reshape(out.shape[0], num_heads, -1)[:, :, :dh]
      out = out.reshape(out.shape[0], num_heads * dh)
    return out

  fixed.head_dim_fix = True
  return fixed


def install_workarounds() -> None:
  """sglang-jax's CPU bit-rot, fixed from outside (idempotent): see _head_dim_fix."""
  from sgl_jax.srt.layers.attention import native_backend  # pylint: disable=g-import-not-at-top
  native_backend.forward_attention = _head_dim_fix(native_backend.forward_attention)


def _plain(x: Any) -> Any:
  """x as JSON: arrays as {"array": [...], "dtype": ...}, containers element-wise."""
  if isinstance(x, np.ndarray):
    return {"array": x.tolist(), "dtype": str(x.dtype)}
  if isinstance(x, (np.integer, np.bool_)):
    return x.item()
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  if x is None or isinstance(x, (bool, int, float, str)):
    return x
  return {"object": type(x).__name__}


class Recorder:
  """Records every call the engine makes to one allocator instance: {"kind", "args",
  "kwargs", "result", "site"} in order (site: "evict" inside the radix cache's evict)."""

  def __init__(self, allocator: Any, tree_cache: Any = None, sink=None):
    self.calls: List[Dict[str, Any]] = []
    self._sink = sink or self.calls.append
    self._depth = 0
    self._site: Optional[str] = None
    for kind in RECORDED:
      if hasattr(allocator, kind):
        setattr(allocator, kind, self._wrap(kind, getattr(allocator, kind)))
    if tree_cache is not None and hasattr(tree_cache, "evict"):
      evict = tree_cache.evict

      def evicting(*args, **kwargs):
        self._site = "evict"
        try:
          return evict(*args, **kwargs)
        finally:
          self._site = None

      tree_cache.evict = evicting

  def _wrap(self, kind, method):
    def call(*args, **kwargs):
      if self._depth:
        return method(*args, **kwargs)
      record = {"kind": kind, "args": _plain(list(args)),
                "kwargs": {k: _plain(v) for k, v in kwargs.items()}, "site": self._site}
      self._depth += 1
      try:
        result = method(*args, **kwargs)
      finally:
        self._depth -= 1
      record["result"] = _plain(result)
      self._sink(record)
      return result

    return call


def server_args(model_dir: str, page_size: int, pool_tokens: int, max_running: int,
                chunk: int = 32, **extra):
  """sglang-jax's ServerArgs for the run: CPU, fp32, native attention, no overlap thread,
  no precompile, the radix cache and chunked prefill on."""
  from sgl_jax.srt.server_args import ServerArgs  # pylint: disable=g-import-not-at-top
  return ServerArgs(model_path=model_dir, device="cpu", dtype="float32", page_size=page_size,
                    max_total_tokens=pool_tokens, chunked_prefill_size=chunk,
                    max_prefill_tokens=2 * chunk, max_running_requests=max_running,
                    disable_overlap_schedule=True, disable_precompile=True,
                    attention_backend="native", random_seed=0, skip_server_warmup=True,
                    mem_fraction_static=0.5, log_level="error", device_indexes=[0], **extra)


@contextlib.contextmanager
def allocator_in_place(allocator: str, guard: bool = True):
  """sglang-jax's own allocator ("sgljax") or jax_kvalloc's flavour on a backend
  ("host", "device") while the block runs."""
  if allocator == "sgljax":
    yield
    return
  from jax_kvalloc import sgl_jax  # pylint: disable=g-import-not-at-top
  sgl_jax.patch(backend=allocator, guard=guard)
  try:
    yield
  finally:
    sgl_jax.unpatch()


def _sampling(tokenizer, vocab: int):
  from sgl_jax.srt.sampling.sampling_params import SamplingParams  # pylint: disable=g-import-not-at-top
  sp = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
  sp.normalize(tokenizer)
  sp.verify(vocab)
  return sp


def step(s, seen: Dict[str, Any]) -> Any:
  """One iteration of sglang-jax's event_loop_normal (its body, without the wait); the
  requests it takes in are added to `seen` (rid -> its Req)."""
  recv = s.select_dp_for_request(s._comm_backend.recv_requests())  # pylint: disable=protected-access
  s.process_input_requests(recv)
  seen.update((q.rid, q) for q in s.waiting_queue)
  batch = s.get_next_batch_to_run()
  s.cur_batch = batch
  if batch:
    s.process_batch_result(batch, s.run_batch(batch))
  s.last_batch = batch
  return batch


def run(model_dir: str, page_size: int = 1, pool_tokens: int = 192, max_running: int = 4,
        allocator: str = "sgljax", guard: bool = True, rounds=ROUNDS) -> Dict[str, Any]:
  """Serves `rounds` (one after another, each round's requests at once) through
  sglang-jax's Scheduler; returns {"tokens": {rid: new ids}, "calls": the recorded
  allocator calls, "allocator": the class used, "steps", "seconds"}."""
  from sgl_jax.srt.managers.communication import QueueBackend  # pylint: disable=g-import-not-at-top
  from sgl_jax.srt.managers.io_struct import TokenizedGenerateReqInput  # pylint: disable=g-import-not-at-top
  from sgl_jax.srt.managers.scheduler import Scheduler  # pylint: disable=g-import-not-at-top
  install_workarounds()
  t0 = time.perf_counter()
  with allocator_in_place(allocator, guard):
    args = server_args(model_dir, page_size, pool_tokens, max_running)
    s = Scheduler(args, None, communication_backend=QueueBackend(queue.Queue(), queue.Queue()))
    alloc = s.token_to_kv_pool_allocator
    rec = Recorder(alloc, s.tree_cache)
    inbox = s._comm_backend._in_queue  # pylint: disable=protected-access
    reqs, steps = {}, 0
    for r, prompts in enumerate(rounds):
      for i, text in enumerate(prompts):
        inbox.put(TokenizedGenerateReqInput(
            rid=f"{r}.{i}", text=text, input_ids=s.tokenizer.encode(text),
            sampling_params=_sampling(s.tokenizer, s.model_config.vocab_size)))
      while True:
        batch = step(s, reqs)
        steps += 1
        if batch is None and inbox.empty() and all(q.finished() for q in reqs.values()):
          break
        if steps > 2000:
          raise RuntimeError(f"round {r} did not finish in 2000 steps")
    leaked = s.max_total_num_tokens - (alloc.available_size() + s.tree_cache.evictable_size())
  return {"allocator": f"{type(alloc).__module__}.{type(alloc).__name__}",
          "constructor": {"class": type(alloc).__name__, "size": int(alloc.size),
                          "page_size": int(alloc.page_size), "dp_size": int(alloc.dp_size)},
          "page_size": page_size, "pool_tokens": pool_tokens, "max_running": max_running,
          "tokens": {rid: [int(t) for t in q.output_ids] for rid, q in sorted(reqs.items())},
          "texts": {rid: s.tokenizer.decode(q.output_ids) for rid, q in sorted(reqs.items())},
          "calls": rec.calls, "leaked": int(leaked), "steps": steps,
          "seconds": time.perf_counter() - t0}


TRACE_ENV = "SGLJAX_ENGINE_TRACE"  # the spawned scheduler appends its calls here


def record_to_file(path: str) -> None:
  """In a process about to build sglang-jax's Scheduler: record its allocator's calls as
  JSON lines appended to `path` (the first line names the allocator's class)."""
  from sgl_jax.srt.managers.scheduler import Scheduler  # pylint: disable=g-import-not-at-top
  build = Scheduler.init_memory_pool_and_cache
  if getattr(build, "recording", False):
    return

  def recording(self):
    build(self)
    alloc = self.token_to_kv_pool_allocator
    f = open(path, "a", encoding="utf-8")  # pylint: disable=consider-using-with
    write = lambda doc: (f.write(json.dumps(doc) + "\n"), f.flush())
    write({"allocator": f"{type(alloc).__module__}.{type(alloc).__name__}"})
    Recorder(alloc, self.tree_cache, sink=write)

  recording.recording = True
  Scheduler.init_memory_pool_and_cache = recording


def run_engine(model_dir: str, page_size: int = 1, pool_tokens: int = 192,
               max_running: int = 4, rounds=ROUNDS, trace: str = "",
               batched: bool = False) -> Dict[str, Any]:
  """The same rounds through the full `sgl_jax.Engine` (tokenizer in this process, the
  scheduler and detokenizer in spawned ones): one request at a time, or with `batched`
  each round's prompts in one generate call (whose requests reach the scheduler over
  one or more of its loop iterations, as timing has it: the schedule, and so the slots,
  may differ from run to run, on any allocator).
  The scheduler process records its allocator calls to `trace` (a JSON-lines file)
  where this file is the main module (`python tests/sgljax_engine.py --engine`): it
  runs this file again as `__mp_main__`. Returns {"tokens": {rid: ids}, "allocator",
  "calls"} (the last two from `trace`, if given). The allocator is whatever the
  scheduler process gets: JAX_KVALLOC_SGL_JAX patches it at interpreter start."""
  from sgl_jax.srt.entrypoints.engine import Engine  # pylint: disable=g-import-not-at-top
  install_workarounds()
  if trace:
    open(trace, "w", encoding="utf-8").close()
    os.environ[TRACE_ENV] = trace
  args = server_args(model_dir, page_size, pool_tokens, max_running)
  engine = Engine(server_args=args)
  tokens = {}
  try:
    sampling = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    for r, prompts in enumerate(rounds):
      if batched:
        out = engine.generate(prompt=list(prompts), sampling_params=sampling)
      else:
        out = [engine.generate(prompt=text, sampling_params=sampling) for text in prompts]
      for i, o in enumerate(out):
        tokens[f"{r}.{i}"] = [int(t) for t in o["output_ids"]]
  finally:
    engine.shutdown()
  res = {"tokens": tokens}
  if trace:
    with open(trace, encoding="utf-8") as f:
      lines = [json.loads(line) for line in f]
    res.update(allocator=lines[0]["allocator"] if lines else None, calls=lines[1:])
  return res


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("model_dir", help="SmolLM2-135M as a Hugging Face folder (export-hf)")
  p.add_argument("--page-size", type=int, default=1)
  p.add_argument("--pool-tokens", type=int, default=192)
  p.add_argument("--max-running", type=int, default=4)
  p.add_argument("--allocator", choices=("sgljax", "host", "device"), default="sgljax")
  p.add_argument("--no-guard", action="store_true")
  p.add_argument("--engine", action="store_true", help="the full sgl_jax.Engine")
  p.add_argument("--batched", action="store_true", help="with --engine: each round's "
                 "prompts in one generate call (default: one request at a time)")
  p.add_argument("--out", help="write the run (tokens, recorded calls) as JSON")
  a = p.parse_args(argv)
  if a.engine:
    trace = (a.out + ".calls.jsonl") if a.out else ""
    res = run_engine(a.model_dir, a.page_size, a.pool_tokens, a.max_running, trace=trace,
                     batched=a.batched)
    print(f"engine: scheduler's allocator {res.get('allocator')}, "
          f"{len(res.get('calls', []))} calls", file=sys.stderr)
  else:
    res = run(a.model_dir, a.page_size, a.pool_tokens, a.max_running, a.allocator,
              not a.no_guard)
    kinds = {}
    for c in res["calls"]:
      kinds[c["kind"]] = kinds.get(c["kind"], 0) + 1
    print(f"{res['allocator']}: {res['steps']} steps, {res['seconds']:.1f} s, calls {kinds}, "
          f"leaked {res['leaked']}", file=sys.stderr)
  for rid, ids in res["tokens"].items():
    print(rid, ids)
  if a.out:
    with open(a.out, "w", encoding="utf-8") as f:
      json.dump(res, f)
  return 0


if __name__ in ("__main__", "__mp_main__"):
  # The engine's scheduler runs in a spawned process that imports this file as
  # __mp_main__: the workaround has to be in place there too.
  if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    install_workarounds()
  if __name__ == "__mp_main__" and os.environ.get(TRACE_ENV):
    record_to_file(os.environ[TRACE_ENV])
  if __name__ == "__main__":
    raise SystemExit(main())
