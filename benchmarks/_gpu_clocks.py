"""The GPU's SM clock and power-cap state beside a benchmark, from nvidia-smi.

Why: the H200 runs the FP8 training steps of these benchmarks at its
software power cap (700 W). While a step is timed the SM clock falls from
1980 MHz to 1365-1770 MHz (run Z, 2026-12-04), so a step's time follows the
energy it spends as well as its kernel time at full clock, and two rows can
differ by their clocks alone. :class:`ClockLog` samples the clock and the
throttle reasons in a background ``nvidia-smi`` process;
:meth:`ClockLog.summary` gives a row's mean clock and the share of samples
throttled by the power cap over the row's wall-clock window.

``nvidia-smi``'s ``power.draw`` is not used: on this driver it is a one-second
average, too coarse for rows that time 50 steps in about a second.
"""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess
import tempfile

# clocks_throttle_reasons.active bit: the software power cap holds the clock down.
SW_POWER_CAP = 0x4
QUERY = "timestamp,clocks.sm,clocks_throttle_reasons.active"


def parse_samples(text: str) -> list[tuple[float, float, int]]:
  """``nvidia-smi --query-gpu=<QUERY> --format=csv,noheader,nounits`` lines ->
  [(Unix time, SM MHz, throttle-reason bits)]; lines that do not parse
  (a header, an error, a half-written last line) are skipped.

  nvidia-smi writes its timestamp in local time; it is read back as local
  time, so it compares with ``time.time()`` taken on the same machine.
  """
  samples = []
  for line in text.splitlines():
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
      continue
    try:
      t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
      samples.append((t, float(parts[1]), int(parts[2], 16)))
    except ValueError:
      continue
  return samples


def summarize(samples, start: float, end: float) -> dict | None:
  """{"sm_mhz": mean SM clock, "power_capped": share of samples with the
  power-cap bit, "samples": how many} over [start, end] (Unix seconds), or
  None when no sample falls inside."""
  inside = [s for s in samples if start <= s[0] <= end]
  if not inside:
    return None
  return {"sm_mhz": round(statistics.mean(s[1] for s in inside), 1),
          "power_capped": round(sum(1 for s in inside if s[2] & SW_POWER_CAP) / len(inside), 3),
          "samples": len(inside)}


class ClockLog:
  """A background ``nvidia-smi`` sampling GPU 0 every ``interval_ms``
  (nvidia-smi's index, which ignores ``CUDA_VISIBLE_DEVICES``: the
  benchmarks run on the machine's first GPU).

  ``ClockLog.start()`` returns None (and says why in ``ClockLog.why_not``)
  where nvidia-smi is missing; use as a context manager otherwise.
  """

  why_not = ""

  def __init__(self, proc, path):
    self._proc, self._path = proc, path

  @classmethod
  def start(cls, interval_ms: int = 100):
    exe = shutil.which("nvidia-smi")
    if exe is None:
      cls.why_not = "nvidia-smi is not on PATH: no clock log"
      return None
    fd, path = tempfile.mkstemp(prefix="gpu_clocks_", suffix=".csv")
    with os.fdopen(fd, "w") as out:
      proc = subprocess.Popen(   # pylint: disable=consider-using-with
          [exe, "-i", "0", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
           "-lms", str(interval_ms)], stdout=out, stderr=subprocess.STDOUT)
    return cls(proc, path)

  def summary(self, start: float, end: float) -> dict | None:
    """The clock over [start, end]; see :func:`summarize`."""
    with open(self._path, encoding="utf-8") as f:
      return summarize(parse_samples(f.read()), start, end)

  def close(self):
    self._proc.terminate()
    self._proc.wait()
    os.unlink(self._path)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
