"""Several JAX processes on one machine, the way a pod runs one per host: for tests and
benchmarks of ranks over processes (jax_kvalloc.multiprocess) on CPU. The parent runs
the children (`run`, environment from `child_env`, port from `free_port`); each child
calls `start(...)` before anything touches a JAX backend.

    results = run([[sys.executable, "worker.py", str(i), str(port)] for i in range(2)],
                  deadline_s=120, env=child_env())
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import subprocess
import time
from typing import Dict, Iterator, List, Optional, Sequence


def free_port() -> int:
  """A TCP port free on localhost now (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def child_env(extra_xla_flags: Sequence[str] = (),
              pythonpath: Sequence[str] = ()) -> Dict[str, str]:
  """The environment of a child: the caller's, on CPU, without a forced device count
  (each child asks for its devices in `start`), with `extra_xla_flags` added and
  `pythonpath` in front of PYTHONPATH."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags + list(extra_xla_flags))
  env["JAX_PLATFORMS"] = "cpu"
  if pythonpath:
    env["PYTHONPATH"] = os.pathsep.join(
        list(pythonpath) + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  return env


@dataclasses.dataclass
class Result:
  """One child's exit: returncode -9 when the deadline killed it."""
  returncode: int
  stdout: str
  stderr: str
  seconds: float


def run(commands: Sequence[Sequence[str]], *, deadline_s: float,
        env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None) -> List[Result]:
  """Starts every command at once, each under `timeout -s KILL deadline_s` (JAX's
  preemption handler catches SIGTERM), and waits for all. Never hangs: past the deadline
  (plus a grace) the parent kills whatever it started that still runs."""
  t0 = time.monotonic()
  procs = []
  try:
    for cmd in commands:
      procs.append(subprocess.Popen(
          ["timeout", "-s", "KILL", str(int(deadline_s))] + list(cmd), env=env, cwd=cwd,
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
      left = max(1.0, deadline_s + 5 - (time.monotonic() - t0))
      try:
        stdout, stderr = p.communicate(timeout=left)
      except subprocess.TimeoutExpired:
        p.kill()
        stdout, stderr = p.communicate()
      out.append(Result(p.returncode, stdout, stderr, time.monotonic() - t0))
    return out
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


@contextlib.contextmanager
def start(process_id: int, num_processes: int, port: int, devices_per_process: int,
          *, timeout_s: int = 60) -> Iterator[None]:
  """In a child, before anything touches a JAX backend: `devices_per_process` CPU
  devices, gloo collectives, and (num_processes > 1) jax.distributed against
  localhost:port (process 0 the coordinator), shut down on the way out whatever
  happens. One process skips the distributed service: a single-process reference run."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", devices_per_process)
  if num_processes == 1:
    yield
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                             num_processes=num_processes, process_id=process_id,
                             initialization_timeout=timeout_s)
  try:
    yield
  finally:
    jax.distributed.shutdown()
