"""Plain-text tables, JSON files and (optional) matplotlib for the CLI's reports."""
from __future__ import annotations

import json
import math
from typing import Any, Sequence


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], *,
          align: str = "") -> str:
  """A GitHub-markdown table. `align` is one character per column ("l" or "r");
  by default the first column is left-aligned and the others right-aligned."""
  cells = [[str(h) for h in header]] + [["" if c is None else str(c) for c in r]
                                         for r in rows]
  ncol = len(header)
  align = align or "l" + "r" * (ncol - 1)
  width = [max(len(r[i]) for r in cells) for i in range(ncol)]

  def fmt(r):
    return "| " + " | ".join(c.ljust(w) if a == "l" else c.rjust(w)
                             for c, w, a in zip(r, width, align)) + " |"

  rule = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2))
                        for w, a in zip(width, align)) + "|"
  return "\n".join([fmt(cells[0]), rule] + [fmt(r) for r in cells[1:]])


def fmt_us(x: Any) -> str:
  """Microseconds with sensible precision; '-' for missing."""
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return "-"
  x = float(x)
  if x < 10:
    return f"{x:.2f}"
  if x < 100:
    return f"{x:.1f}"
  return f"{x:.0f}"


def fmt_ratio(x: Any) -> str:
  if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
    return "-"
  return f"{float(x):.2f}x"


def write_json(path: str, data: Any) -> None:
  with open(path, "w") as f:
    json.dump(data, f, indent=1, default=_default)
    f.write("\n")


def _default(o):
  import numpy as np  # pylint: disable=g-import-not-at-top
  if isinstance(o, np.integer):
    return int(o)
  if isinstance(o, np.floating):
    return float(o)
  if isinstance(o, np.ndarray):
    return o.tolist()
  raise TypeError(f"cannot write {type(o).__name__} as JSON")


def pyplot():
  """matplotlib.pyplot with a non-interactive backend; a clear error if absent."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise RuntimeError("--plot needs matplotlib: pip install 'jax_kvalloc[plot]' "
                       "(or pip install matplotlib)") from e
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt
