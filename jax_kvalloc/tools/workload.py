"""Synthetic serving workloads for `jax-kvalloc simulate`: arrivals, shared prefixes and
prompt/output lengths, drawn once from a seed so that every page size sees the same
requests.

Length distributions are written `NAME:PARAMS`:
  const:N              every value N
  uniform:LO:HI        integers in [LO, HI]
  lognormal:MEDIAN:SIGMA[:MAX]   exp(N(log MEDIAN, SIGMA)), rounded, in [1, MAX]
                       (MAX defaults to MEDIAN * e^(3 SIGMA))
  exp:MEAN[:MAX]       exponential with mean MEAN, in [1, MAX] (MAX defaults to 8 MEAN)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

ARRIVALS = ("poisson", "uniform", "burst")
FORMS = "const:N, uniform:LO:HI, lognormal:MEDIAN:SIGMA[:MAX] or exp:MEAN[:MAX]"


@dataclasses.dataclass(frozen=True)
class Dist:
  """A parsed length distribution; `sample(rng, n)` gives i64[n] values in [lo, hi]."""
  lo: int
  hi: int
  draw: Callable[[np.random.Generator, int], np.ndarray]

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    x = np.asarray(self.draw(rng, n), dtype=np.float64)
    return np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)


def parse_dist(spec: str) -> Dist:
  """Parses a `NAME:PARAMS` length distribution (see the module docstring).

  Raises ValueError with the accepted forms on anything else.
  """
  name, _, rest = str(spec).partition(":")
  try:
    p = [float(v) for v in rest.split(":")]
  except ValueError:
    p = []
  n = len(p)
  if name == "const" and n == 1 and p[0] >= 1:
    return Dist(int(p[0]), int(p[0]), lambda rng, k: np.full(k, int(p[0])))
  if name == "uniform" and n == 2 and 1 <= p[0] <= p[1]:
    lo, hi = int(p[0]), int(p[1])
    return Dist(lo, hi, lambda rng, k: rng.integers(lo, hi + 1, k))
  hi = 0  # lognormal and exp draw in [1, MAX]
  if name == "lognormal" and n in (2, 3) and p[0] > 0 and p[1] >= 0:
    hi = int(p[2]) if n == 3 else int(math.ceil(p[0] * math.exp(3 * p[1])))
    draw = lambda rng, k: rng.lognormal(math.log(p[0]), p[1], k)  # noqa: E731
  elif name == "exp" and n in (1, 2) and p[0] > 0:
    hi = int(p[1]) if n == 2 else int(math.ceil(8 * p[0]))
    draw = lambda rng, k: rng.exponential(p[0], k)  # noqa: E731
  if hi < 1:
    raise ValueError(f"length distribution {spec!r} is not one of {FORMS} "
                     f"(with positive numbers, LO <= HI)")
  return Dist(1, hi, draw)


@dataclasses.dataclass(frozen=True)
class Workload:
  """Requests in arrival order. Request i arrives at step `arrival[i]`, has
  `prompt[i]` prompt tokens (its group's shared prefix included) and generates
  `output[i]` tokens; `group[i]` is its shared-prefix group or -1."""
  arrival: np.ndarray     # i64[N] step of arrival, non-decreasing
  group: np.ndarray       # i64[N] prefix group in [0, G) or -1
  prompt: np.ndarray      # i64[N] prompt tokens, shared prefix included
  output: np.ndarray      # i64[N] tokens generated (decode steps)
  prefix_len: np.ndarray  # i64[G] tokens of each group's shared prefix

  @property
  def num_requests(self) -> int:
    return int(self.arrival.shape[0])

  @property
  def max_context(self) -> int:
    """The longest request, prompt plus output (sizes the token table)."""
    return int((self.prompt + self.output).max()) if self.num_requests else 1


def make_workload(*, num_requests: int, arrival: str, rate: float, prompt_len: str,
                  output_len: str, num_prefixes: int, prefix_len: str, share_prob: float,
                  seed: int) -> Workload:
  """Draws a workload (same seed, same requests). The settings are checked by the
  caller (jax_kvalloc.tools.simulate.check_config).

  Args:
    num_requests: N.
    arrival: "poisson" (exponential gaps, mean 1/rate steps), "uniform" (one request every
      1/rate steps) or "burst" (all at step 0).
    rate: requests per step (poisson, uniform).
    prompt_len, output_len, prefix_len: length distributions (module docstring); a
      grouped request's prompt is its group's prefix followed by prompt_len tokens.
    num_prefixes: G shared-prefix groups (0: no sharing).
    share_prob: probability that a request belongs to a (uniformly chosen) group.
    seed: RNG seed.
  """
  rng = np.random.default_rng(seed)
  n = num_requests
  if arrival == "poisson":
    arrive = np.floor(np.cumsum(rng.exponential(1.0 / rate, n))).astype(np.int64)
  elif arrival == "uniform":
    arrive = np.floor(np.arange(n) / rate).astype(np.int64)
  else:
    arrive = np.zeros(n, np.int64)
  plen = parse_dist(prefix_len).sample(rng, max(num_prefixes, 0))
  group = np.full(n, -1, np.int64)
  shared_tokens = np.zeros(n, np.int64)
  if num_prefixes > 0:
    shared = rng.random(n) < share_prob
    group = np.where(shared, rng.integers(0, num_prefixes, n), -1)
    shared_tokens = np.where(shared, plen[np.maximum(group, 0)], 0)
  prompt = parse_dist(prompt_len).sample(rng, n) + shared_tokens
  output = parse_dist(output_len).sample(rng, n)
  return Workload(arrive, group, prompt, output, plen)
