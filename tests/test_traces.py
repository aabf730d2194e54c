"""jax_kvalloc.traces: the trace format, the workload generator and replay (no torch)."""
import collections
import json

import pytest

from jax_kvalloc.tools import traces
from trace_helpers import jax_replayer, model_replayer, replay


def _generate(seed, steps=150, **kw):
  return traces.generate(traces.random_config(seed, steps=steps, **kw), model_replayer(),
                         trace_id=seed)


# -- format -------------------------------------------------------------------------------

def test_write_read_round_trip(tmp_path):
  recs = _generate(3, steps=60) + _generate(4, steps=60)
  path = tmp_path / "t.jsonl"
  assert traces.write(str(path), recs) == len(recs)
  by_id = traces.read(str(path))
  assert list(by_id) == [3, 4]
  assert by_id[3] + by_id[4] == recs


def test_golden_file_reads(golden_path):
  by_id = traces.read(str(golden_path))
  assert len(by_id) == 40
  assert all(recs[0]["op"] == "init" for recs in by_id.values())


@pytest.mark.parametrize("line, message", [
    ('{"trace": 0, "op": "init", "args": {"size": 8}}', "missing args \\['page_size'\\]"),
    ('{"trace": 0, "op": "explode"}', "unknown op 'explode'"),
    ('{"op": "init"}', "needs 'trace' and 'op'"),
    ('{"trace": 0, "op": "free", "args": [1]}', "'args' must be an object"),
    ("{not json", "not JSON"),
])
def test_bad_records_name_the_line(tmp_path, line, message):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"trace": 0, "op": "init", "args": {"size": 8, "page_size": 1}}\n'
                  + line + "\n")
  with pytest.raises(ValueError, match=message) as e:
    traces.read(str(path))
  assert f"{path}:2" in str(e.value)


def test_trace_must_start_with_init(tmp_path):
  path = tmp_path / "t.jsonl"
  path.write_text('{"trace": 1, "op": "alloc", "args": {"need_size": 1}}\n')
  with pytest.raises(ValueError, match="starts with 'alloc'"):
    traces.read(str(path))


# -- comparison -------------------------------------------------------------------------

def test_compare_names_field_and_first_differing_index():
  want = {"result": [4, 5, 6], "free_pages": [2, 3], "release_pages": [9, 7],
          "available_size": 16}
  assert traces.compare(want, dict(want)) is None
  assert traces.compare(want, dict(want, result=[4, 5, 7])) == (
      "result: first differing index 2: expected 6, got 7")
  assert traces.compare(want, dict(want, result=None)) == (
      "result: expected 3 slots, got None (failure)")
  assert "lengths differ (2 expected, 3 got); first differing index 2: got 4" in (
      traces.compare(want, dict(want, free_pages=[2, 3, 4])))
  assert traces.compare(want, dict(want, available_size=12)) == (
      "available_size: expected 16, got 12")
  swapped = dict(want, release_pages=[7, 9])
  assert traces.compare(want, swapped).startswith("release_pages: first differing index 0")
  assert traces.compare(want, swapped, release_unordered=True) is None
  # Fields the expectation lacks are not checked (a user's trace of ops only).
  assert traces.compare({"op": "free"}, want) is None


# -- the generator ----------------------------------------------------------------------

def test_generator_is_seeded_and_reproducible():
  assert _generate(11) == _generate(11)
  assert _generate(11) != _generate(12)


def test_generated_traces_cover_the_workload():
  ops = collections.Counter()
  page_sizes = set()
  fails = merges = sort_modes = 0
  for seed in range(24):
    recs = _generate(seed)
    init = recs[0]["args"]
    page_sizes.add((init["page_size"], init["kind"]))
    sort_modes |= 1 << int(init["need_sort"])
    for prev, rec in zip(recs, recs[1:]):
      ops[rec["op"]] += 1
      alloc = rec["op"].startswith("alloc")
      fails += alloc and rec["result"] is None
      merges += alloc and bool(prev["release_pages"]) and not rec["release_pages"]
    assert recs[-1]["available_size"] == init["size"] // init["page_size"] * init["page_size"]
  # SPEC 10's frees are opt-in (segment_prob; test_newer_ops covers them)
  assert set(ops) == set(traces.OPS) - {"init", "clear", "free_page_ids", "free_segment"}, ops
  assert {1, 4, 16, 64} <= {ps for ps, _ in page_sizes}
  assert (1, "paged") in page_sizes and (1, "token") in page_sizes
  assert sort_modes == 3
  assert fails >= 20 and merges >= 20, (fails, merges)
  # Speculative rows that extend by zero, and prefixes ending mid-page.
  ext = [r["args"] for recs in map(_generate, range(24)) for r in recs
         if r["op"] == "alloc_extend"]
  assert any(0 < sum(s - p for p, s in zip(a["prefix_lens"], a["seq_lens"]))
             and any(s == p for p, s in zip(a["prefix_lens"], a["seq_lens"])) for a in ext)
  assert any(p % 4 for a in ext for p in a["prefix_lens"])


def test_leak_check_catches_a_lost_free():
  class Leaky(traces.Replayer):
    def apply(self, op, args=None):
      if op == "free" and len(args["free_index"]) > 3:
        args = dict(args, free_index=args["free_index"][:-1])
        if self.allocator.page_size > 1:
          args["free_index"] = args["free_index"][:1]
      return super().apply(op, args)
  import trace_helpers  # pylint: disable=g-import-not-at-top
  with pytest.raises(traces.TraceMismatch, match="available_size"):
    for seed in range(8):
      traces.generate(traces.random_config(seed, steps=150),
                      Leaky(trace_helpers.model_factory), trace_id=seed)


def test_replay_reports_trace_step_and_index():
  recs = _generate(5, steps=80)
  step = next(i for i, r in enumerate(recs) if r["op"] == "alloc_extend" and r["result"])
  bad = [dict(r) for r in recs]
  bad[step]["result"] = list(bad[step]["result"])
  bad[step]["result"][-1] += 1
  assert replay(recs, model_replayer()) == len(recs)
  with pytest.raises(traces.TraceMismatch) as e:
    replay(bad, model_replayer())
  n = len(bad[step]["result"]) - 1
  assert f"trace 5 step {step} (alloc_extend): result: first differing index {n}" in (
      str(e.value))


@pytest.mark.parametrize("backend", ["device", "host"])
def test_jax_kvalloc_replays_generated_traces(backend):
  """jax_kvalloc against traces recorded from the independent model (two small pools,
  so that few shapes compile)."""
  for seed in (2, 11):   # paged ps=16 need_sort, token ps=1 need_sort
    recs = _generate(seed, steps=120)
    assert replay(recs, jax_replayer(backend=backend)) == len(recs)


def test_records_are_plain_json():
  recs = _generate(1, steps=40)
  assert json.loads(json.dumps(recs)) == recs
