"""Data-parallel ranks (SPEC 12, jax_kvalloc.ranks): every rank exactly a single pool of
size // dp_size slots, checked against the model on random traces; ranks independent;
placement over a mesh of forced host devices with no collective in the compiled
program; the need_sort merge a branch under vmap (no sort on calls that do not merge).

conftest.py asks XLA for 4 host devices before jax starts; the mesh tests skip when
fewer are there (XLA_FLAGS set otherwise by the caller).
"""
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_kvalloc as kv
from jax_kvalloc import allocation
from jax_kvalloc import gated
from jax_kvalloc import ranks
from model import ModelAllocator

NDEV = 4


def _mesh(n):
  if len(jax.devices("cpu")) < n:
    pytest.skip(f"needs {n} host devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
  return Mesh(np.array(jax.devices("cpu")[:n]), ("dp",))


# ---------------------------------------------------------------------------------------
# HLO: sorts outside conditional branches.
# ---------------------------------------------------------------------------------------

def _computations(hlo):
  comps, cur = {}, None
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if m and not line.startswith(" "):
      cur = m.group(1)
      comps[cur] = []
    elif line.startswith("}"):
      cur = None
    elif cur is not None:
      comps[cur].append(line)
  return comps


def _branches(line):
  out = []
  m = re.search(r"branch_computations=\{([^}]*)\}", line)
  if m:
    out += [s.strip().lstrip("%") for s in m.group(1).split(",")]
  for key in ("true_computation", "false_computation"):
    m = re.search(key + r"=%?([\w.\-]+)", line)
    if m:
      out.append(m.group(1))
  return out


def ungated_sorts(hlo: str) -> int:
  """Sort ops of compiled HLO text that run on every call: those in no computation that
  is reachable only through a branch of a `conditional`."""
  comps = _computations(hlo)
  gated_comps, todo = set(), [b for lines in comps.values() for l in lines for b in _branches(l)]
  while todo:
    name = todo.pop()
    if name in gated_comps:
      continue
    gated_comps.add(name)
    for line in comps.get(name, []):
      todo += _branches(line)
      todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line)
  return sum(1 for name, lines in comps.items() if name not in gated_comps
             for line in lines if re.search(r"\bsort\(", line))


def _decode_args(dp, bs=8):
  return jnp.ones((dp, bs), jnp.int32), jnp.full((dp, bs), -1, jnp.int32)


def test_vmapped_need_sort_decode_sorts_only_in_a_branch():
  cfg = kv.AllocatorConfig(size=4 * 1024, page_size=4, need_sort=True, kernel="jnp")
  state = ranks.init_ranks(cfg, 4)
  seq, last = _decode_args(4)
  hlo = jax.jit(functools.partial(ranks.alloc_decode, cfg)).lower(state, seq, last)
  assert ungated_sorts(hlo.compile().as_text()) == 0
  for op, args in ((functools.partial(ranks.alloc, cfg, max_size=64), (seq[:, 0] * 16,)),
                   (functools.partial(ranks.alloc_extend, cfg, max_tokens=64),
                    (seq * 0, seq * 4, last))):
    assert ungated_sorts(jax.jit(op).lower(state, *args).compile().as_text()) == 0
  # Plain vmap of the single-pool function, and vmap of vmap, too.
  rc = ranks.rank_config(cfg, 4)
  dec = functools.partial(allocation.alloc_decode, rc)
  two = jax.tree.map(lambda x: jnp.stack([x, x]), state)
  for fn, args in ((jax.vmap(dec), (state, seq, last)),
                   (jax.vmap(jax.vmap(dec)), (two, jnp.stack([seq] * 2),
                                              jnp.stack([last] * 2)))):
    assert ungated_sorts(jax.jit(fn).lower(*args).compile().as_text()) == 0
  # Negative control: the counter sees the sort of a vmapped lax.cond (a select).
  plain = lambda x, p: jax.lax.cond(p, jnp.sort, lambda v: v, x)
  hlo = jax.jit(jax.vmap(plain)).lower(jnp.zeros((4, 64), jnp.int32),
                                       jnp.zeros((4,), bool)).compile().as_text()
  assert ungated_sorts(hlo) == 1


def test_gated_matches_a_cond_per_entry():
  update = lambda x, p: jnp.where(p, jnp.sort(x), x)
  x = jnp.asarray(np.random.default_rng(0).integers(0, 99, (3, 4, 16)), jnp.int32)
  for pred in (np.zeros((3, 4), bool), np.eye(3, 4, dtype=bool)):
    got = jax.jit(jax.vmap(jax.vmap(gated.gated(update))))(x, jnp.asarray(pred))
    want = np.where(pred[..., None], np.sort(np.asarray(x), -1), np.asarray(x))
    np.testing.assert_array_equal(got, want)
  # Unbatched: a plain branch; a state not batched but its pred batched is widened.
  np.testing.assert_array_equal(gated.gated(update)(x[0, 0], jnp.bool_(True)),
                                np.sort(np.asarray(x[0, 0])))
  got = jax.vmap(gated.gated(update), in_axes=(None, 0))(x[0, 0], jnp.asarray([True, False]))
  np.testing.assert_array_equal(got[0], np.sort(np.asarray(x[0, 0])))
  np.testing.assert_array_equal(got[1], x[0, 0])


# ---------------------------------------------------------------------------------------
# Random traces against one model per rank.
# ---------------------------------------------------------------------------------------

ROWS, MAX_TOKENS, MAX_FREE, MAX_ALLOC = 4, 64, 64, 32


class RankedDriver:
  """The functional ranked API (jitted), all ranks per call, each with its own input."""

  def __init__(self, cfg, dp, mesh=None):
    self.cfg, self.dp = cfg, dp
    r = ranks.ranks_allocator(cfg, dp, mesh=mesh, axis_name=None if mesh is None else "dp")
    if mesh is None:
      jit = lambda f, *s: jax.jit(f, static_argnames=s)
      r = r._replace(alloc=jit(r.alloc, "max_size"), alloc_extend=jit(r.alloc_extend, "max_tokens"),
                     alloc_decode=jit(r.alloc_decode), free=jit(r.free),
                     merge_and_sort_free=jit(r.merge_and_sort_free))
    self.r = r
    self.state = r.init()

  def lists(self, rank):
    s = ranks.rank_state(self.state, rank)
    return kv.live_free_pages(s).tolist(), kv.live_release_pages(s).tolist()


def _pad(rows, width, fill=0):
  out = np.full((len(rows), width), fill, np.int32)
  for i, row in enumerate(rows):
    out[i, :len(row)] = row
  return out


def run_ranked_trace(driver, *, kind, ps, need_sort, steps, seed, dry_rank=None):
  """Random steps over all ranks at once; every rank's outputs and lists must equal its
  own model's. `dry_rank` asks for far more than it has at every alloc (it keeps
  failing), which must not change any other rank."""
  rng = np.random.default_rng(seed)
  dp, size = driver.dp, driver.cfg.size // driver.dp
  models = [ModelAllocator(size, ps, need_sort, kind) for _ in range(dp)]
  reqs = [[] for _ in range(dp)]  # per rank: live requests, each a list of slots
  fails = np.zeros(dp, int)
  for step in range(steps):
    op = rng.choice(["alloc", "extend", "extend", "decode", "decode", "free", "merge"])
    busy = rng.random(dp) < 0.8  # idle ranks pass empty input
    want = [None] * dp
    if op == "alloc":
      need = [int(rng.integers(0, MAX_ALLOC // ps + 1)) * ps if busy[r] else 0
              for r in range(dp)]
      if dry_rank is not None:
        need[dry_rank] = MAX_ALLOC // ps * ps
      want = [models[r].alloc(need[r]) for r in range(dp)]
      driver.state, out, ok = driver.r.alloc(driver.state, jnp.asarray(need, jnp.int32),
                                             max_size=MAX_ALLOC)
      lens = need
    elif op == "extend":
      pre, seq, last, picks = [], [], [], []
      for r in range(dp):
        n = int(rng.integers(1, ROWS + 1)) if busy[r] else 0
        pick = rng.permutation(len(reqs[r]))[:n].tolist()
        rows = [(len(reqs[r][i]), reqs[r][i][-1]) for i in pick]
        rows += [(0, -1)] * (n - len(rows))  # new requests
        ext = rng.integers(0, 2 * ps + 3, n)
        while ext.sum() > MAX_TOKENS:
          ext //= 2
        if dry_rank == r and n:
          ext[0] = MAX_TOKENS - ext[1:].sum()
        pre.append([p for p, _ in rows])
        seq.append([p + int(e) for (p, _), e in zip(rows, ext)])
        last.append([l for _, l in rows])
        want[r] = models[r].alloc_extend(pre[r], seq[r], last[r])
        picks.append(pick)
      driver.state, out, ok = driver.r.alloc_extend(
          driver.state, _pad(pre, ROWS), _pad(seq, ROWS), _pad(last, ROWS, -1),
          max_tokens=MAX_TOKENS, num_reqs=np.asarray([len(p) for p in pre], np.int32))
      lens = [sum(s) - sum(p) for p, s in zip(pre, seq)]
      for r in range(dp):
        if want[r] is None:
          continue
        at = 0
        for k, (p, s) in enumerate(zip(pre[r], seq[r])):
          new = list(want[r][at:at + s - p])
          at += s - p
          if k < len(picks[r]):
            reqs[r][picks[r][k]] += new
          elif new:
            reqs[r].append(new)
    elif op == "decode":
      seq, last, picks = [], [], []
      for r in range(dp):
        n = min(len(reqs[r]), int(rng.integers(1, ROWS + 1))) if busy[r] else 0
        pick = rng.permutation(len(reqs[r]))[:n].tolist()
        picks.append(pick)
        seq.append([len(reqs[r][i]) + 1 for i in pick])
        last.append([reqs[r][i][-1] for i in pick])
        want[r] = models[r].alloc_decode(seq[r], last[r])
      driver.state, out, ok = driver.r.alloc_decode(
          driver.state, _pad(seq, ROWS, 1), _pad(last, ROWS, -1),
          num_reqs=np.asarray([len(s) for s in seq], np.int32))
      lens = [len(s) for s in seq]
      for r in range(dp):
        if want[r] is not None:
          for i, slot in zip(picks[r], want[r]):
            reqs[r][i].append(slot)
    elif op == "free":
      rows = []
      for r in range(dp):
        slots = []
        for k in sorted(rng.permutation(len(reqs[r]))[:int(rng.integers(0, 3))], reverse=True):
          if busy[r] and len(slots) + len(reqs[r][k]) <= MAX_FREE:
            slots += reqs[r].pop(k)
        models[r].free(slots)
        rows.append(slots)
      driver.state = driver.r.free(driver.state, _pad(rows, MAX_FREE))
      out = None
    else:
      which = busy
      for r in range(dp):
        if which[r]:
          models[r].merge_and_sort_free()
      driver.state = driver.r.merge_and_sort_free(driver.state, jnp.asarray(which))
      out = None
    if out is not None:
      out, ok = np.asarray(out), np.asarray(ok)
      for r in range(dp):
        assert bool(ok[r]) == (want[r] is not None), (step, op, r, want[r])
        if want[r] is None:
          fails[r] += 1
          assert not out[r].any(), (step, op, r)
        else:
          assert out[r][:lens[r]].tolist() == list(want[r]), (step, op, r)
    for r in range(dp):
      assert driver.lists(r) == (models[r].free_pages, models[r].release_pages), (step, op, r)
  return fails


CASES = [  # (kind, ps, pages per rank, need_sort)
    ("paged", 4, 16, False), ("paged", 4, 16, True), ("token", 1, 48, True),
    pytest.param("token", 1, 48, False, marks=pytest.mark.slow),
    pytest.param("paged", 1, 48, False, marks=pytest.mark.slow),
    pytest.param("paged", 1, 48, True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind,ps,pages,need_sort", CASES)
def test_every_rank_matches_its_model(kind, ps, pages, need_sort):
  dp = 3
  cfg = kv.AllocatorConfig(size=dp * pages * ps + 2, page_size=ps, need_sort=need_sort,
                           kind=kind, kernel="jnp")  # + 2: size // dp_size floors
  fails = run_ranked_trace(RankedDriver(cfg, dp), kind=kind, ps=ps, need_sort=need_sort,
                           steps=60, seed=1)
  assert fails.sum() > 0  # the small pools run out


@pytest.mark.parametrize("need_sort", [False, True])
def test_a_rank_running_dry_leaves_the_others_untouched(need_sort):
  cfg = kv.AllocatorConfig(size=4 * 12 * 4, page_size=4, need_sort=need_sort, kernel="jnp")
  fails = run_ranked_trace(RankedDriver(cfg, 4), kind="paged", ps=4, need_sort=need_sort,
                           steps=50, seed=3, dry_rank=2)
  assert fails[2] >= 10 and fails[2] > max(fails[r] for r in (0, 1, 3)), fails


@pytest.mark.parametrize("need_sort", [False, True])
def test_a_refused_rank_changes_no_other_rank(need_sort):
  cfg = kv.AllocatorConfig(size=4 * 8 * 4, page_size=4, need_sort=need_sort, kernel="jnp")
  state = ranks.init_ranks(cfg, 4)
  alloc = jax.jit(functools.partial(ranks.alloc, cfg), static_argnames="max_size")
  state, out, ok = alloc(state, jnp.asarray([28, 8, 0, 32], jnp.int32), max_size=32)
  state = jax.jit(functools.partial(ranks.free, cfg))(state, out[:, :8])  # need_sort: released
  asked, ok = alloc(state, jnp.asarray([32, 12, 4, 8], jnp.int32), max_size=32)[::2]
  alone, _ = alloc(state, jnp.asarray([0, 12, 4, 8], jnp.int32), max_size=32)[::2]
  np.testing.assert_array_equal(ok, [False, True, True, True])
  for r in (1, 2, 3):
    jax.tree.map(np.testing.assert_array_equal, ranks.rank_state(asked, r),
                 ranks.rank_state(alone, r))
  before, after = ranks.rank_state(state, 0), ranks.rank_state(asked, 0)
  if need_sort:  # the shortfall's merge stays done (SPEC 4.2), nothing else
    before = kv.merge_and_sort_free(ranks.rank_config(cfg, 4), before)
  assert kv.live_free_pages(after).tolist() == kv.live_free_pages(before).tolist()
  assert kv.live_release_pages(after).tolist() == kv.live_release_pages(before).tolist()


def test_sharded_ranks_match_the_model():
  cfg = kv.AllocatorConfig(size=4 * 16 * 4, page_size=4, need_sort=True, kernel="jnp")
  driver = RankedDriver(cfg, 4, mesh=_mesh(2))
  run_ranked_trace(driver, kind="paged", ps=4, need_sort=True, steps=40, seed=5)
  shards = driver.state.free_ring.addressable_shards
  assert len(shards) == 2 and {s.data.shape for s in shards} == {(2, 16)}


# ---------------------------------------------------------------------------------------
# Placement: no communication between devices.
# ---------------------------------------------------------------------------------------

def test_sharded_programs_have_no_collectives():
  mesh = _mesh(NDEV)
  dp = 2 * NDEV
  cfg = kv.AllocatorConfig(size=dp * 64 * 4, page_size=4, need_sort=True, kernel="jnp")
  r = ranks.ranks_allocator(cfg, dp, mesh=mesh, axis_name="dp")
  state = r.init()
  assert state.free_ring.sharding.spec == jax.sharding.PartitionSpec("dp")
  i32 = lambda *shape: jnp.ones(shape, jnp.int32)
  calls = {
      "alloc": (lambda s: r.alloc(s, i32(dp), max_size=16)),
      "alloc_extend": (lambda s: r.alloc_extend(s, i32(dp, 4) * 0, i32(dp, 4), -i32(dp, 4),
                                                max_tokens=32, num_reqs=i32(dp))),
      "alloc_decode": (lambda s: r.alloc_decode(s, i32(dp, 4), -i32(dp, 4))),
      "free": (lambda s: r.free(s, i32(dp, 8) * 4)),
      "free_page_ids": (lambda s: r.free_page_ids(s, i32(dp, 8))),
      "merge_and_sort_free": (lambda s: r.merge_and_sort_free(s)),
      "clear": (lambda s: r.clear(s, jnp.arange(dp) % 2 == 0)),
      "available_size": (lambda s: r.available_size(s)),
  }
  for name, call in calls.items():
    hlo = jax.jit(call).lower(state).compile().as_text()
    assert ranks.collectives_in(hlo) == {}, name
  # kernel="auto" under shard_map (its abstract mesh names no device): the platform of
  # the process's backends decides, and the jnp path runs here.
  auto = ranks.ranks_allocator(kv.AllocatorConfig(size=dp * 64 * 4, page_size=4,
                                                  kernel="auto"), dp, mesh=mesh, axis_name="dp")
  state_auto = auto.init()
  for call in (lambda s: auto.alloc_decode(s, i32(dp, 4), -i32(dp, 4)),
               lambda s: auto.alloc_extend(s, i32(dp, 4) * 0, i32(dp, 4), -i32(dp, 4),
                                           max_tokens=32)):
    assert ranks.collectives_in(jax.jit(call).lower(state_auto).compile().as_text()) == {}
  # Negative control: a sum over ranks needs an all-reduce, and the check sees it.
  total = ranks.shard(lambda s: jax.lax.psum(s.free_len, "dp")[None], mesh, "dp")
  hlo = jax.jit(total).lower(state).compile().as_text()
  assert "all-reduce" in ranks.collectives_in(hlo)


def test_sharded_results_equal_unsharded():
  mesh = _mesh(NDEV)
  dp = NDEV
  cfg = kv.AllocatorConfig(size=dp * 32 * 4, page_size=4, need_sort=True, kernel="jnp")
  plain = ranks.ranks_allocator(cfg, dp)
  plain = plain._replace(alloc=jax.jit(plain.alloc, static_argnames="max_size"),
                         free=jax.jit(plain.free))
  placed = ranks.ranks_allocator(cfg, dp, mesh=mesh, axis_name="dp")
  rng = np.random.default_rng(0)
  need = jnp.asarray(rng.integers(0, 9, dp) * 4, jnp.int32)
  a, b = plain.init(), placed.init()
  a, out_a, ok_a = plain.alloc(a, need, max_size=32)
  b, out_b, ok_b = placed.alloc(b, need, max_size=32)
  a, b = plain.free(a, out_a), placed.free(b, out_b)
  a, out_a, ok_a = plain.alloc(a, jnp.full((dp,), 31 * 4, jnp.int32), max_size=128)
  b, out_b, ok_b = placed.alloc(b, jnp.full((dp,), 31 * 4, jnp.int32), max_size=128)
  np.testing.assert_array_equal(out_a, out_b)
  np.testing.assert_array_equal(ok_a, ok_b)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  np.testing.assert_array_equal(placed.available_size(b), plain.available_size(a))


def test_ranks_compose_with_scan_and_donation():
  cfg = kv.AllocatorConfig(size=2 * 8 * 4, page_size=4, need_sort=True, kernel="jnp")
  r = ranks.ranks_allocator(cfg, 2)

  @functools.partial(jax.jit, donate_argnums=0)
  def run(state):
    def step(c, _):  # every step: one decode row per rank, freed at once (need_sort)
      state, seq = c
      state, out, ok = r.alloc_decode(state, seq[:, None], jnp.full((2, 1), -1, jnp.int32))
      return (r.free(state, out), seq), ok
    return jax.lax.scan(step, (state, jnp.ones((2,), jnp.int32)), None, length=20)

  (state, _), ok = run(r.init())
  assert np.asarray(ok).all()  # 8 pages per rank, 20 steps: the shortfall merges kept it going
  np.testing.assert_array_equal(r.available_size(state), [32, 32])


# ---------------------------------------------------------------------------------------
# Shapes, configs and errors.
# ---------------------------------------------------------------------------------------

def test_init_ranks_layout():
  cfg = kv.AllocatorConfig(size=1000, page_size=16)
  state = ranks.init_ranks(cfg, 3)  # 62 pages -> 20 per rank (the rest unused)
  assert state.free_ring.shape == (3, 20) and state.free_len.shape == (3,)
  for r in range(3):
    assert kv.live_free_pages(ranks.rank_state(state, r)).tolist() == list(range(1, 21))
  np.testing.assert_array_equal(ranks.available_size(cfg, state), [320] * 3)
  assert ranks.rank_config(cfg, 3).size == 333
  again = ranks.stack_ranks([ranks.rank_state(state, r) for r in range(3)])
  jax.tree.map(np.testing.assert_array_equal, again, state)


def test_bad_arguments_raise_clear_errors():
  cfg = kv.AllocatorConfig(size=64, page_size=4)
  with pytest.raises(ValueError, match="dp_size must be >= 1"):
    ranks.init_ranks(cfg, 0)
  with pytest.raises(TypeError, match="dp_size must be an int"):
    ranks.init_ranks(cfg, 2.0)
  with pytest.raises(ValueError, match="less than one page"):
    ranks.init_ranks(cfg, 32)
  state = ranks.init_ranks(cfg, 2)
  with pytest.raises(ValueError, match="need_size must have a leading rank axis"):
    ranks.alloc(cfg, state, jnp.zeros((3,), jnp.int32), max_size=8)
  with pytest.raises(ValueError, match="pass the whole pool's config"):
    ranks.alloc(ranks.rank_config(cfg, 2), state, jnp.zeros((2,), jnp.int32), max_size=8)
  with pytest.raises(ValueError, match="expected a ranked state"):
    ranks.available_size(cfg, kv.init(cfg))
  with pytest.raises(ValueError, match="ranks must be bool"):
    ranks.merge_and_sort_free(cfg, state, jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="dp_rank=2 is out of range"):
    ranks.rank_state(state, 2)
  mesh = _mesh(2)
  with pytest.raises(ValueError, match="must be a multiple of the mesh axis"):
    ranks.ranks_allocator(cfg, 3, mesh=mesh, axis_name="dp")
  with pytest.raises(ValueError, match="is not an axis of the mesh"):
    ranks.ranks_allocator(cfg, 2, mesh=mesh, axis_name="tp")
  with pytest.raises(ValueError, match="needs axis_name"):
    ranks.ranks_allocator(cfg, 2, mesh=mesh)


def test_bench_ranks_runs_on_host_devices(tmp_path, capsys):
  _mesh(2)
  from jax_kvalloc.tools import cli  # pylint: disable=g-import-not-at-top
  out = tmp_path / "ranks.json"
  assert cli.main(["bench", "ranks", "--quick", "--ops", "decode", "--devices", "1,2",
                   "--ranks-per-device", "2", "--reps", "1", "--min-time", "0.001",
                   "--unroll", "1", "--kernel", "jnp", "--json", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [(r["devices"], sorted(r["cells"])) for r in rows] == [
      (1, ["pool", "ranks"]), (2, ["ranks"])]
  assert all(r["cells"]["ranks"]["collectives"] == {} for r in rows)
  assert "| decode/2/2 |" in capsys.readouterr().out
