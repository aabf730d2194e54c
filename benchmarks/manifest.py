"""The manifest of one result folder (benchmarks/run_device.sh writes it after its steps).

  python benchmarks/manifest.py --machine-tag          # 'h200x2', 'h200', 'cpu', ...
  python benchmarks/manifest.py --dir DIR --steps TSV --command CMD [--sglang-kernels F]

manifest.json: {"command", "commit", "date", "machine", "gpus", "driver", "cpu",
"versions": {python, jax, jaxlib, torch, triton, numpy}, "sglang": {"wheel", "file",
"sha256"}, "steps": [{"name", "exit", "seconds", "command"}], "files", "reconstructed": []}.
A field that cannot be read is null (never guessed); `reconstructed` lists the fields
of an old run's manifest that were inferred afterwards (empty for a run this wrote).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import json
import os
import platform
import re
import subprocess
import sys
from typing import Any, Dict, List, Optional


def _out(cmd: List[str]) -> Optional[str]:
  try:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None


def gpus() -> List[Dict[str, str]]:
  """[{"name", "driver", "memory"}] from nvidia-smi (empty without one)."""
  text = _out(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
               "--format=csv,noheader"])
  rows = []
  for line in (text or "").splitlines():
    name, driver, memory = (c.strip() for c in line.split(","))
    rows.append({"name": name, "driver": driver, "memory": memory})
  return rows


def machine_tag() -> str:
  """'h200' / 'h200x2' for NVIDIA H200s, the GPU's last word otherwise, 'cpu' without."""
  g = gpus()
  if not g:
    return "cpu"
  word = re.sub(r"[^a-z0-9]", "", g[0]["name"].split()[-1].lower()) or "gpu"
  return word + (f"x{len(g)}" if len(g) > 1 else "")


VERSION_MODULES = ("jax", "jaxlib", "torch", "triton", "numpy")


def versions() -> Dict[str, Optional[str]]:
  """{"python", and each of VERSION_MODULES: its __version__, None where it does not
  import}."""
  out: Dict[str, Optional[str]] = {"python": platform.python_version()}
  for mod in VERSION_MODULES:
    try:
      out[mod] = importlib.import_module(mod).__version__
    except Exception:  # pylint: disable=broad-except  (absent or broken: say so)
      out[mod] = None
  return out


def sglang(kernels: Optional[str]) -> Optional[Dict[str, Optional[str]]]:
  """The SGLang kernels file's sha256 and the wheel its VERSION file names."""
  if not kernels or not os.path.exists(kernels):
    return None
  with open(kernels, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
  version = os.path.join(os.path.dirname(kernels), "VERSION")
  wheel = None
  if os.path.exists(version):
    with open(version) as f:
      wheel = f.read().strip()
  return {"wheel": wheel, "file": kernels, "sha256": digest}


def commit() -> Optional[str]:
  return os.environ.get("COMMIT") or _out(["git", "rev-parse", "HEAD"])


def steps(tsv: Optional[str]) -> List[Dict[str, Any]]:
  rows = []
  if tsv and os.path.exists(tsv):
    with open(tsv) as f:
      for line in f:
        name, rc, secs, cmd = line.rstrip("\n").split("\t", 3)
        rows.append({"name": name, "exit": int(rc), "seconds": int(secs),
                     "command": cmd.strip()})
  return rows


def manifest(directory: str, command: str, steps_tsv: Optional[str],
             kernels: Optional[str]) -> Dict[str, Any]:
  g = gpus()
  cpu = None
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
    cpu = f"{names[0]} x {len(names)}" if names else None
  return {"command": command, "commit": commit(),
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "machine": machine_tag(), "gpus": len(g),
          "gpu": g[0]["name"] if g else None, "driver": g[0]["driver"] if g else None,
          "cpu": cpu, "versions": versions(), "sglang": sglang(kernels),
          "steps": steps(steps_tsv),
          "files": sorted(f for f in os.listdir(directory) if f != "manifest.json"),
          "reconstructed": []}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--machine-tag", action="store_true", help="print the machine's tag")
  p.add_argument("--dir", help="the result folder")
  p.add_argument("--steps", help="the runner's step log (name, exit, seconds, command)")
  p.add_argument("--command", default=" ".join(sys.argv), help="the run's command")
  p.add_argument("--sglang-kernels", help="SGLang's kernels file, if the run used it")
  args = p.parse_args(argv)
  if args.machine_tag:
    print(machine_tag())
    return 0
  if not args.dir:
    p.error("--dir is required")
  data = manifest(args.dir, args.command, args.steps, args.sglang_kernels)
  with open(os.path.join(args.dir, "manifest.json"), "w") as f:
    json.dump(data, f, indent=1)
    f.write("\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
