"""Nsight Compute's CSV (``ncu --csv --page details``) as one markdown table
per kernel configuration: launches, and the median of each metric that the
kernel budget of issue 46 reads (time, SM and memory throughput against
peak, the tensor pipe's active cycles, occupancy, issue stalls).

  python3 tools/ncu_summary.py ncu_blockwise.csv [more.csv ...]

Rows group the launches by kernel name (its first 70 characters), grid and
block size; a metric missing from the CSV (a section not collected) is "-".
A "%" column reads only rows whose unit is "%" (ncu also names a byte rate
"Memory Throughput"). When the CSV has the issue-stall metrics
(``smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio``), a
second table gives each kernel's largest stall reasons: warps stalled for
that reason per issued instruction, summing to about "cycles / issue".
"""

from __future__ import annotations

import csv
import re
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
_PERCENT_COLUMNS = {name for title, names in COLUMNS if title.endswith("%") for name in names}
_STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
_STALLS_SHOWN = 6
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
      if name in _PERCENT_COLUMNS and row.get("Metric Unit", "") != "%":
        continue
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


def stall_table(groups) -> str:
  """Each kernel's largest stall reasons (median over launches), or "" when
  the CSV has no stall metrics."""
  out = []
  for (kernel, grid, block), metrics in sorted(groups.items(), key=lambda kv: kv[0]):
    stalls = {m.group(1): statistics.median(v) for n, v in metrics.items()
              if (m := _STALL.match(n)) and v}
    if not stalls:
      continue
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:_STALLS_SHOWN]
    out.append(f"| {kernel} | {grid} | {sum(stalls.values()):.3g} | "
               + ", ".join(f"{reason} {value:.2f}" for reason, value in top) + " |")
  if not out:
    return ""
  return "\n".join(["| kernel | grid | stalls / issue (sum) | largest reasons |",
                    "|---|---|---|---|"] + out)


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
  stalls = stall_table(groups)
  if stalls:
    print("\nissue stalls (warps stalled per issued instruction, by reason):")
    print(stalls)
  return 0


if __name__ == "__main__":
  sys.exit(main())
