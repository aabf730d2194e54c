"""The GGUF's own tokenizer, built with the `tokenizers` package from the file's metadata
(`tokenizer.ggml.*`): byte-level BPE (`model = gpt2`) with its merges, the file's
pre-tokenizer, and its control tokens (e.g. `<|im_end|>`) matched whole.

Pre-tokenizers (llama.cpp's `tokenizer.ggml.pre`): "smollm" (and the StarCoder family)
isolate every digit, then split with GPT-2's pattern; anything else gets GPT-2's pattern
alone. Needs `pip install "jax_kvalloc[model]"` (or `pip install tokenizers`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from jax_kvalloc.serve.loader import INSTALL_HINT
from jax_kvalloc.serve.loader import ModelFileError

CONTROL = 3  # llama.cpp's token type of control tokens
DIGIT_SPLIT = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")


class GGUFTokenizer:
  """encode(text) -> ids, decode(ids) -> text, from a GGUF's metadata."""

  def __init__(self, meta: Dict[str, Any]):
    try:
      from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ModelFileError(f"the GGUF tokenizer needs the tokenizers package: {INSTALL_HINT}") from e
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
      raise ModelFileError(f"tokenizer.ggml.model={kind!r}: only byte-level BPE ('gpt2') "
                           "is supported")
    tokens: List[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") in DIGIT_SPLIT:
      tok.pre_tokenizer = pre_tokenizers.Sequence(
          [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
    else:
      tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types) if int(kind) == CONTROL]
    if control:
      tok.add_special_tokens(control)
    self._tok = tok
    self.vocab_size = len(tokens)
    self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    self.bos_id = int(meta.get("tokenizer.ggml.bos_token_id", 1))
    self.eos_id = int(meta.get("tokenizer.ggml.eos_token_id", 2))

  def encode(self, text: str) -> List[int]:
    """Token ids of text (the bos id first when the file says add_bos_token)."""
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return ([self.bos_id] if self.add_bos else []) + list(ids)

  def save(self, path: str) -> None:
    """Writes the tokenizer as a Hugging Face tokenizer.json (the `tokenizers` format)."""
    self._tok.save(path)

  def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
    """Text of ids (control tokens left out unless skip_special is False)."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)
