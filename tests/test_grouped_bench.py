"""benchmarks/bench_grouped.py on CPU: every row of the table, errors measured."""

import numpy as np
import pytest

import bench_grouped as bg  # pylint: disable=import-error  (benchmarks/ is on pytest's path)


@pytest.mark.parametrize("groups,rows", [(16, 1024), (4, 256), (8, 128)])
def test_group_sizes_sum_and_blocks(groups, rows):
  bal, skew = bg.group_sizes(groups, rows, False), bg.group_sizes(groups, rows, True)
  assert bal.tolist() == [rows] * groups
  assert skew.sum() == groups * rows and skew[0] == groups * rows // 2
  assert (skew % 128 == 0).all() and skew.max() - np.sort(skew)[-2] > 0
  assert skew[1:].max() - skew[1:].min() <= 128   # the rest shared as evenly as blocks allow


def test_every_row_runs_and_checks_its_error(capsys):
  sz = dict(groups=2, rows=128, k=128, n=128)
  rows = bg.run(sz, impl="reference", k_calls=1, repeats=1)
  variants = {"bf16 ragged_dot", "te_jax bf16", "fp8 per-tensor fast", "fp8 per-tensor split",
              "fp8 blockwise"}
  assert {(r["pass_"], r["groups"], r["variant"]) for r in rows} == {
      (p, g, v) for p in ("fprop", "dgrad", "wgrad") for g in ("balanced", "skewed")
      for v in variants}
  for r in rows:   # the reference against itself: exact; bf16 has no FP8 reference
    assert (r["err"] is None) == (r["variant"] == "bf16 ragged_dot")
    assert r["err"] in (None, 0.0) and r["tflops"] > 0
  text = bg.table(rows)
  assert len(text.splitlines()) == 2 + len(rows) and "| 1.000 |" in text
  assert "FAILED" not in capsys.readouterr().out


def test_a_wrong_result_shows_in_the_error_column():
  ref = np.ones((4, 4), np.float32)
  assert bg.rel_error(ref * 1.5, ref) == pytest.approx(0.5)
