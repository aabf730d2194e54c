"""Diagnostics for the accelerator run: where host time and kernels go (issues 12, 13).

    python benchmarks/device_probe.py [--flags-sweep]

Prints, on the default device:
  1. the kernels XLA launches for one call (ENTRY's fusions, custom calls, sorts,
     scatters, ...) of the class's decode / extend / free programs and of the bare
     benchmark loop body of decode bs 1 (what runs besides our one kernel);
  2. host microseconds per dispatch (median of consecutive calls, one wait at the end):
     a trivial jit, the class decode program with device / numpy / pinned-host inputs,
     device_put alone;
  3. with --flags-sweep: `jax-kvalloc simulate` (page size 16, 300 requests) and the
     class call, each in a subprocess under several XLA_FLAGS (CUDA-graph command
     buffers on/off, min graph size), their step p50 and call medians.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from class_call_breakdown import per_call_us  # same folder: the same host timer


LAUNCH = re.compile(r"= [^=]*? (fusion|custom-call|gather|scatter|sort|reduce|copy|"
                    r"dynamic-update-slice|dynamic-slice|while|conditional|call)\(")


def kernels(text):
  body = text[text.index("ENTRY"):]
  ops = LAUNCH.findall(body)
  return len(ops), {k: ops.count(k) for k in sorted(set(ops))}


def class_programs():
  import jax_kvalloc as kv
  import jax_kvalloc.sglang as kvs  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.sglang.backends import device as device_ops
  a = kvs.PagedTokenToKVPoolAllocator(1 << 24, 64)
  ops = device_ops.ops_for(a.config)
  st = kv.init(a.config)
  out = {}
  for key, args in (
      (("decode", 64), (np.zeros(129, np.int32),)),
      (("extend", 16, 1024), (np.zeros(49, np.int32),)),
      (("free", 1024, True), ()),
  ):
    fn = ops._fn(key)
    if key[0] == "free":
      lowered = fn.lower(st.free_ring, st.free_head, st.free_len, st.release_len,
                         np.zeros(1024, np.int32))
    else:
      lowered = fn.lower(st.free_ring, st.free_head, st.free_len, *args)
    text = lowered.compile().as_text()
    out[str(key)] = kernels(text)
    print(f"class program {key}: {out[str(key)]}")
  return out


def bare_loop():
  from jax_kvalloc.tools import bench_micro, timing
  res = {}
  for op, bs, tokens in (("decode", 1, 1), ("extend", 16, 32768)):
    case = bench_micro.make_case(op, bs, tokens, 64, 0)
    _, call, carry, inputs = bench_micro.jax_call(case, "pallas")
    one = jax.jit(call).lower(carry, inputs).compile().as_text()
    res[f"{op} bs{bs} call"] = kernels(one)
    print(f"{op} bs={bs} pallas call: {res[f'{op} bs{bs} call']}")
    ent = one[one.index("ENTRY"):]
    print("\n".join(l for l in ent.splitlines() if LAUNCH.search(l))[:3000])
  return res


def dispatch():
  import jax_kvalloc as kv
  import jax_kvalloc.sglang as kvs  # pylint: disable=g-import-not-at-top
  from jax_kvalloc.sglang.backends import device as device_ops
  a = kvs.PagedTokenToKVPoolAllocator(1 << 24, 64)
  fn = device_ops.ops_for(a.config)._fn(("decode", 64))
  st = kv.init(a.config)
  packed = np.zeros(129, np.int32)
  packed[:64] = 65
  packed[64:128] = np.arange(64) * 256 + 191
  packed[128] = 64
  dpacked = jax.device_put(packed)
  dev = jax.devices()[0]
  res = {}
  trivial = jax.jit(lambda x: x + 1)
  res["trivial jit, device arg"] = per_call_us(lambda: trivial(dpacked))
  res["trivial jit, numpy arg"] = per_call_us(lambda: trivial(packed))
  res["device_put(numpy 516 B)"] = per_call_us(lambda: jax.device_put(packed, dev))
  res["decode program, device packed"] = per_call_us(
      lambda: fn(st.free_ring, st.free_head, st.free_len, dpacked))
  res["decode program, numpy packed"] = per_call_us(
      lambda: fn(st.free_ring, st.free_head, st.free_len, packed))
  try:
    from jax.sharding import SingleDeviceSharding
    host = SingleDeviceSharding(dev, memory_kind="pinned_host")
    devs = SingleDeviceSharding(dev, memory_kind="device")
    res["device_put(numpy -> pinned_host)"] = per_call_us(
        lambda: jax.device_put(packed, host))
    from jax_kvalloc import allocation
    acfg = device_ops.ops_for(a.config)._alloc_cfg

    @jax.jit
    def pinned_fn(ring, head, length, p):
      p = jax.device_put(p, devs)
      s, out, _ = allocation.alloc_decode(acfg, device_ops._alloc_state(ring, head, length),
                                          p[:64], p[64:128], num_reqs=p[128])
      return s.free_head, s.free_len, out
    res["decode program, pinned_host packed (put + call)"] = per_call_us(
        lambda: pinned_fn(st.free_ring, st.free_head, st.free_len,
                          jax.device_put(packed, host)))
  except Exception as e:  # pylint: disable=broad-except
    res["pinned_host error"] = repr(e)[:300]
  seq = np.full(64, 65, np.int64)
  last = np.arange(64, dtype=np.int64) * 256 + 191
  a2 = kvs.PagedTokenToKVPoolAllocator(1 << 24, 64)

  def class_call():
    snap = a2.backup_state()
    out = a2.alloc_decode(seq, seq, last)
    a2.restore_state(snap)
    return out
  res["class alloc_decode(64) + backup/restore"] = per_call_us(class_call)
  for k, v in res.items():
    print(f"  {k:52s} {v if isinstance(v, str) else f'{v:8.1f} us'}")
  return res


SWEEP = {
    "default": "",
    "no command buffers": "--xla_gpu_enable_command_buffer=",
    "min graph size 1": "--xla_gpu_graph_min_graph_size=1",
    "cmd buffers incl. conditional/while, min 1":
        "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
        "CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1",
}


def sweep():
  res = {}
  for name, flags in SWEEP.items():
    env = dict(os.environ, XLA_FLAGS=flags)
    t0 = time.perf_counter()
    sim = subprocess.run([sys.executable, "-m", "jax_kvalloc", "simulate", "--page-size",
                          "16", "--num-requests", "300", "--no-progress"],
                         env=env, capture_output=True, text=True, timeout=120)
    lines = [l for l in sim.stdout.splitlines()
             if "step time p50" in l or "prefill / decode" in l or "wall time per" in l]
    call = subprocess.run([sys.executable, "-c",
                           "import sys; sys.argv=['x']; sys.path.insert(0,'benchmarks'); "
                           "import device_probe as d; d.dispatch()"],
                          env=env, capture_output=True, text=True, timeout=120)
    res[name] = {"simulate": lines, "rc": sim.returncode,
                 "stderr": sim.stderr[-500:] if sim.returncode else "",
                 "dispatch": call.stdout[-2000:], "dispatch_rc": call.returncode,
                 "dispatch_err": call.stderr[-500:] if call.returncode else "",
                 "wall_s": time.perf_counter() - t0}
    print(f"== XLA_FLAGS={flags!r} ({name}): rc {sim.returncode}")
    print("\n".join(lines) or sim.stderr[-500:])
    print(call.stdout[-2000:] or call.stderr[-500:])
  return res


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--flags-sweep", action="store_true")
  p.add_argument("--json")
  args = p.parse_args()
  print(jax.devices()[0], "jax", jax.__version__)
  rec = {}
  for name, fn in (("class_programs", class_programs), ("bare_loop", bare_loop),
                   ("dispatch", dispatch)):
    try:
      rec[name] = fn()
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name} failed: {e!r}")
      rec[name] = repr(e)
  if args.flags_sweep:
    rec["sweep"] = sweep()
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rec, f, indent=1, default=str)


if __name__ == "__main__":
  main()
