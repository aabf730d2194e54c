"""`jax-kvalloc bench-table`: the request-table serving loop runs inside one jit without a
refusal and without losing a page; the CLI prints its table (tiny, noisy settings)."""
import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.tools import bench_table
from jax_kvalloc.tools import cli

CASE = bench_table.TableCase(bs=8, page_size=4, prompt=16, len_lo=8, len_hi=40,
                             max_frees=4, kernel="jnp")


@pytest.mark.parametrize("extend", (True, pytest.param(False, marks=pytest.mark.slow)))
def test_loop_keeps_every_page(extend):
  case = dataclasses.replace(CASE, extend=extend)
  step = functools.partial(bench_table.table_step, case, variant="calls")
  run = jax.jit(lambda c: jax.lax.fori_loop(
      0, 150, lambda _, c: step(c, jnp.zeros((), jnp.int32))[0], c))
  state, table, _, _, ok = run(bench_table.initial_carry(case))
  assert bool(ok)
  held = int(jnp.sum(cdiv(table.lens, case.page_size)))
  assert held + int(state.free_len) == case.config.num_pages
  rows = np.asarray(table.pages)
  used = rows[rows > 0]
  assert used.size == held and np.unique(used).size == held   # no page held twice


@pytest.mark.slow  # the loop compiled twice with the kernel in Pallas' interpreter
def test_step_variant_equals_calls():
  # step_rows (one launch) runs the same loop as the separate calls, carry for carry.
  case = dataclasses.replace(CASE, kernel="pallas_interpret")
  run = lambda v: jax.jit(lambda c: jax.lax.fori_loop(0, 40, lambda _, c: functools.partial(
      bench_table.table_step, case, variant=v)(c, jnp.zeros((), jnp.int32))[0], c))
  a = run("calls")(bench_table.initial_carry(case))
  b = run("step")(bench_table.initial_carry(case))
  assert bool(a[-1])
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # imports SGLang
def test_sglang_eager_step_runs():
  # The SGLang column: the eager class calls of one step (torch on CPU here).
  pytest.importorskip("torch")
  res = bench_table.sglang_step(CASE, min_time=0.001, reps=1)
  assert res["impl"] in ("sglang", "torch_ref") and res["us"] > 0


@pytest.mark.slow  # five variants, each compiled and timed
def test_cli_prints_the_table(capsys, tmp_path):
  args = ["bench-table", "--batch-sizes", "8", "--page-size", "4", "--prompt", "16",
          "--max-frees", "4", "--unroll", "2", "--min-time", "0.001", "--reps", "1",
          "--kernel", "jnp", "--steps", "decode", "--json", str(tmp_path / "t.json")]
  assert cli.main(args) == 0
  out = capsys.readouterr().out
  assert "share: step_rows" in out and re.search(r"\| decode \|\s+8 \|", out)
  record = json.loads((tmp_path / "t.json").read_text())
  sglang = record["results"][0]["sglang"]
  assert sglang.get("us", 0) > 0 or "torch" in sglang.get("error", ""), sglang
