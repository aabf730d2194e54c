"""Replays the traces recorded from SGLang's own allocator (../shared/golden) into the
SGLang-compatible classes and compares every result and the full lists after every op."""
import collections
import json

import numpy as np
import pytest

import jax_kvalloc as kv
import jax_kvalloc.sglang as kvs


def _load(path):
  traces = collections.defaultdict(list)
  with open(path) as f:
    for line in f:
      rec = json.loads(line)
      traces[rec["trace"]].append(rec)
  return traces


def _make(args, backend="device"):
  if args["page_size"] == 1:
    return kvs.TokenToKVPoolAllocator(args["size"], need_sort=args["need_sort"],
                                     backend=backend)
  return kvs.PagedTokenToKVPoolAllocator(args["size"], args["page_size"],
                                        need_sort=args["need_sort"], backend=backend)


def replay(records, backend="device"):
  """Replays one trace; asserts on the first mismatch, naming the step."""
  alloc = None
  snapshot = None
  for step, rec in enumerate(records):
    op, args = rec["op"], rec["args"]
    if op == "init":
      alloc = _make(args, backend)
      result = None
    elif op == "alloc":
      result = alloc.alloc(args["need_size"])
    elif op == "alloc_extend":
      pre, seq = np.array(args["prefix_lens"]), np.array(args["seq_lens"])
      result = alloc.alloc_extend(pre, pre, seq, seq, np.array(args["last_loc"]),
                                  int((seq - pre).sum()))
    elif op == "alloc_decode":
      seq = np.array(args["seq_lens"])
      result = alloc.alloc_decode(seq, seq, np.array(args["last_loc"]))
    elif op == "free":
      result = alloc.free(np.array(args["free_index"], np.int64))
    elif op == "backup_state":
      snapshot = alloc.backup_state()
      result = None
    elif op == "restore_state":
      alloc.restore_state(snapshot)
      result = None
    else:
      result = getattr(alloc, op)()
    where = f"trace {rec['trace']} step {step} ({op} {args})"
    if rec["result"] is None:
      assert result is None, f"{where}: expected None, got {result}"
    else:
      assert result is not None, f"{where}: expected {rec['result']}, got None"
      np.testing.assert_array_equal(np.asarray(result), rec["result"], err_msg=where)
    np.testing.assert_array_equal(alloc.free_pages, rec["free_pages"], err_msg=where)
    np.testing.assert_array_equal(alloc.release_pages, rec["release_pages"], err_msg=where)
    assert alloc.available_size() == rec["available_size"], where


# Every trace on the host backend; on the device backend traces 0-9 (every page size,
# need_sort on and off) and every third one after them (its compiles dominate CI's time).
GOLDEN_CASES = ([(t, "host") for t in range(40)]
                + [(t, "device") for t in range(40) if t < 10 or t % 3 == 1])


@pytest.mark.parametrize("trace_id,backend", GOLDEN_CASES)
def test_golden_trace(golden_path, trace_id, backend):
  traces = _load_cached(str(golden_path))
  assert len(traces) == 40
  replay(traces[trace_id], backend)


_CACHE = {}


def _load_cached(path):
  if path not in _CACHE:
    _CACHE[path] = _load(path)
  return _CACHE[path]
