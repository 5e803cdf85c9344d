"""Nsight Compute's CSV (``ncu --csv --page details``) as one markdown table
per kernel configuration: launches, and the median of each metric that the
kernel budget of issue 46 reads (time, SM and memory throughput against
peak, the tensor pipe's active cycles, occupancy, issue stalls).

  python3 tools/ncu_summary.py ncu_blockwise.csv [more.csv ...]

Rows group the launches by kernel name (its first 70 characters), grid and
block size; a metric missing from the CSV (a section not collected) is "-".
"""

from __future__ import annotations

import csv
import statistics
import sys
from collections import defaultdict
from typing import Dict, List, Tuple

# (column title, metric names in the CSV: the first one present is used)
COLUMNS = (
    ("ms", ("Duration",)),
    ("SM %", ("Compute (SM) Throughput",)),
    ("memory %", ("Memory Throughput",)),
    ("DRAM %", ("DRAM Throughput",)),
    ("tensor pipe %", ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                       "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active")),
    ("issue slots %", ("Issue Slots Busy",)),
    ("cycles / issue", ("Warp Cycles Per Issued Instruction",)),
    ("occupancy %", ("Achieved Occupancy",)),
    ("registers", ("Registers Per Thread",)),
)
# Durations are converted to ms, in either spelling of the unit; another
# unit is named on stderr (run AN's table had nan durations, and its CSV did
# not come back to say which unit ncu wrote).
_TO_MS = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3,
          "ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def _number(text: str):
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return None


def read(paths: List[str]) -> Dict[Tuple[str, str, str], Dict[str, List[float]]]:
  """{(kernel, grid, block): {metric: [value per launch]}} from ncu CSV files
  (lines before the header, ncu's own messages, are skipped)."""
  groups: Dict[Tuple[str, str, str], Dict[str, List[float]]] = defaultdict(
      lambda: defaultdict(list))
  for path in paths:
    with open(path, newline="") as fh:
      lines = [ln for ln in fh if ln.startswith('"')]
    for row in csv.DictReader(lines):
      value = _number(row.get("Metric Value", ""))
      if value is None:
        continue
      name = row.get("Metric Name", "")
      if name == "Duration":
        unit = row.get("Metric Unit", "")
        if unit not in _TO_MS:
          print(f"ncu_summary: unknown Duration unit {unit!r} in {path}", file=sys.stderr)
        value *= _TO_MS.get(unit, float("nan"))
      key = (row.get("Kernel Name", "?")[:70], row.get("Grid Size", ""), row.get("Block Size", ""))
      groups[key][name].append(value)
  return groups


def table(groups) -> str:
  head = "| kernel | grid | block | launches | " + " | ".join(c for c, _ in COLUMNS) + " |"
  out = [head, "|" + "---|" * (4 + len(COLUMNS))]
  for (kernel, grid, block), metrics in sorted(groups.items(), key=lambda kv: kv[0]):
    cells = []
    launches = max((len(v) for v in metrics.values()), default=0)
    for _, names in COLUMNS:
      found = next((metrics[n] for n in names if n in metrics), None)
      cells.append("-" if not found else f"{statistics.median(found):.3g}")
    out.append(f"| {kernel} | {grid} | {block} | {launches} | " + " | ".join(cells) + " |")
  return "\n".join(out)


def main(argv=None) -> int:
  paths = sys.argv[1:] if argv is None else argv
  if not paths:
    print(__doc__)
    return 2
  groups = read(paths)
  if not groups:
    print("ncu_summary: no metric rows in " + ", ".join(paths))
    return 1
  print(table(groups))
  return 0


if __name__ == "__main__":
  sys.exit(main())
