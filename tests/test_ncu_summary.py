"""tools/ncu_summary.py: Nsight Compute's CSV read into the kernel budget table."""

import importlib.util
import math
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "tools", "ncu_summary.py")
_spec = importlib.util.spec_from_file_location("ncu_summary", _PATH)
ncu_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_summary)

_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
           '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
           '"Metric Value"\n')


def _row(launch, kernel, grid, metric, unit, value):
  return (f'"{launch}","1","h","host","{kernel}","1","7","(384, 1, 1)","{grid}","0","9.0",'
          f'"GPU Speed Of Light Throughput","{metric}","{unit}","{value}"\n')


def _write(tmp_path, rows):
  path = tmp_path / "ncu.csv"
  # ncu prints its own lines (==PROF==) before the CSV; they must be skipped.
  path.write_text("==PROF== Connected to process 1\n" + _HEADER + "".join(rows))
  return str(path)


def test_medians_per_kernel_with_durations_in_ms(tmp_path):
  rows = [_row(0, "nvjet_a", "(132, 1, 1)", "Duration", "usecond", "1,000.0"),
          _row(0, "nvjet_a", "(132, 1, 1)", "Compute (SM) Throughput", "%", "80"),
          _row(1, "nvjet_a", "(132, 1, 1)", "Duration", "msecond", "3.0"),
          _row(1, "nvjet_a", "(132, 1, 1)", "Compute (SM) Throughput", "%", "90"),
          _row(2, "nvjet_a", "(132, 1, 1)", "Duration", "nsecond", "2000000"),
          _row(2, "nvjet_a", "(132, 1, 1)", "Compute (SM) Throughput", "%", "70"),
          _row(3, "device_kernel", "(66, 2, 1)", "Duration", "us", "500"),
          _row(3, "device_kernel", "(66, 2, 1)", "Memory Throughput", "%", "n/a")]
  groups = ncu_summary.read([_write(tmp_path, rows)])
  assert groups[("nvjet_a", "(132, 1, 1)", "(384, 1, 1)")]["Duration"] == pytest.approx(
      [1.0, 3.0, 2.0])
  text = ncu_summary.table(groups)
  lines = {ln.split(" | ")[0].strip("| "): ln for ln in text.splitlines()[2:]}
  # median of 1, 3, 2 ms and of 80, 90, 70 %; the other kernel's
  # unparsable memory figure and its uncollected metrics are "-".
  assert "| 3 | 2 | 80 | - |" in lines["nvjet_a"]
  assert "| 1 | 0.5 | - | - |" in lines["device_kernel"]


def test_no_metric_rows_is_an_error(tmp_path, capsys):
  assert ncu_summary.main([_write(tmp_path, [])]) == 1
  assert "no metric rows" in capsys.readouterr().out


def test_an_unknown_duration_unit_is_named(tmp_path, capsys):
  rows = [_row(0, "nvjet_a", "(132, 1, 1)", "Duration", "fortnight", "1")]
  groups = ncu_summary.read([_write(tmp_path, rows)])
  assert math.isnan(groups[("nvjet_a", "(132, 1, 1)", "(384, 1, 1)")]["Duration"][0])
  assert "unknown Duration unit 'fortnight'" in capsys.readouterr().err


def test_percent_columns_ignore_byte_rates(tmp_path):
  # ncu's "Memory Throughput" is also a byte rate in some sections (run AO's
  # act table printed 1.2e+12 under "memory %").
  rows = [_row(0, "act", "(128, 1, 1)", "Memory Throughput", "byte/second", "1.2e+12"),
          _row(0, "act", "(128, 1, 1)", "Memory Throughput", "%", "71.5")]
  groups = ncu_summary.read([_write(tmp_path, rows)])
  assert groups[("act", "(128, 1, 1)", "(384, 1, 1)")]["Memory Throughput"] == [71.5]


def test_stall_reasons_table(tmp_path, capsys):
  stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
  rows = [_row(0, "own", "(132, 1, 1)", stall.format("long_scoreboard"), "ratio", "2.5"),
          _row(1, "own", "(132, 1, 1)", stall.format("long_scoreboard"), "ratio", "3.5"),
          _row(0, "own", "(132, 1, 1)", stall.format("barrier"), "ratio", "0.5"),
          _row(0, "own", "(132, 1, 1)", stall.format("wait"), "ratio", "1.0"),
          _row(0, "nvjet", "(2, 66, 1)", "Duration", "ms", "1.0")]
  assert ncu_summary.main([_write(tmp_path, rows)]) == 0
  out = capsys.readouterr().out
  line = next(ln for ln in out.splitlines() if ln.startswith("| own | (132, 1, 1) | 4.5"))
  # largest first: the median of 2.5 and 3.5, then wait, then barrier
  assert line.endswith("long_scoreboard 3.00, wait 1.00, barrier 0.50 |")
  # a kernel without stall metrics has no row in the stall table
  assert "| nvjet |" not in out.split("issue stalls")[1]
