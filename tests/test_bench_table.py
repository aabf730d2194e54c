"""`jax-kvalloc bench-table`: the request-table serving loop runs inside one jit without a
refusal and without losing a page; the CLI prints its table (tiny, noisy settings)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvalloc.index_jnp import cdiv
from jax_kvalloc.tools import bench_table
from jax_kvalloc.tools import cli

CASE = bench_table.TableCase(bs=8, page_size=4, prompt=16, len_lo=8, len_hi=40,
                             max_frees=4)


def test_loop_keeps_every_page():
  step = functools.partial(bench_table.table_step, CASE)
  run = jax.jit(lambda c: jax.lax.fori_loop(
      0, 150, lambda _, c: step(c, jnp.zeros((), jnp.int32))[0], c))
  state, table, _, _, ok = run(bench_table.initial_carry(CASE))
  assert bool(ok)
  held = int(jnp.sum(cdiv(table.lens, CASE.page_size)))
  assert held + int(state.free_len) == CASE.config.num_pages
  rows = np.asarray(table.pages)
  used = rows[rows > 0]
  assert used.size == held and np.unique(used).size == held   # no page held twice


@pytest.mark.slow  # five variants, each compiled and timed
def test_cli_prints_the_table(capsys):
  args = ["bench-table", "--batch-sizes", "8", "--page-size", "4", "--prompt", "16",
          "--max-frees", "4", "--unroll", "2", "--min-time", "0.001", "--reps", "1"]
  assert cli.main(args) == 0
  out = capsys.readouterr().out
  assert "allocator (us)" in out and "| 8 " in out
