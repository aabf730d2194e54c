"""The README's Python examples run as written and print what their comments say."""
import contextlib
import io
import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks():
  return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run():
  blocks = _python_blocks()
  assert len(blocks) >= 2
  for block in blocks:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(block, str(README), "exec"), {})  # pylint: disable=exec-used
    # Every "print(x)   # expected" comment must match what was printed.
    expected = [m.group(1).split(":")[0].strip()
                for m in re.finditer(r"^print\(.*?\)\s+# (.*)$", block, flags=re.M)]
    printed = out.getvalue().splitlines()
    assert len(printed) == len(expected), (printed, expected)
    for got, want in zip(printed, expected):
      assert got.strip() == want, (got, want)


def test_functional_example_step_runs():
  ns = {}
  exec(compile(_python_blocks()[0], str(README), "exec"), ns)  # pylint: disable=exec-used
  jnp = ns["jnp"]
  state, ext_loc, dec_loc, ok = ns["serving_step"](
      ns["state"], jnp.zeros(64, jnp.int32), jnp.zeros(8, jnp.int32),
      jnp.full(8, 100, jnp.int32), jnp.full(8, -1, jnp.int32), jnp.int32(3),
      jnp.full(4, 17, jnp.int32), jnp.full(4, 15, jnp.int32))
  assert bool(ok)
  ext = np.asarray(ext_loc)
  assert len(set(ext[:300].tolist())) == 300 and (ext[300:] == 0).all()
  assert (np.asarray(dec_loc) % 16 == 0).all()  # seq 17 starts a new page of 16
