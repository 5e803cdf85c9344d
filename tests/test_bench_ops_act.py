"""benchmarks/bench_ops.py's activation and stack-quantize rows: every case
traces and runs (the reference standing in for the kernel on the CPU) and
counts its bytes; the h_copy row and the two calls it replaces, and the
stack quantize and the loop it replaces, return the same bits."""

import jax
import numpy as np

import bench_ops  # pylint: disable=import-error  (benchmarks/ is on pytest's path)


def _same_bits(a, b, what):
  np.testing.assert_array_equal(np.asarray(a).reshape(-1).view(np.uint8),
                                np.asarray(b).reshape(-1).view(np.uint8),
                                err_msg=what)


def test_act_rows_run_every_case(monkeypatch, capsys):
  seen = []

  def once(fn, arg_sets, k=1, reps=1):
    out = fn(*arg_sets[0])
    seen.append(out)
    return 1e-3   # one "millisecond": the figure is then bytes / 1e9
  monkeypatch.setattr(bench_ops, "bench", once)
  m, f = 256, 128
  rows = bench_ops.act_rows(m=m, f=f, impls=("reference", "reference"))
  names = [r["name"].rsplit(" ", 2)[0] for r in rows]
  want = []
  for mode in ("tensorwise", "current", "blockwise"):
    want += [f"act fwd, {mode}, rowwise z", f"act fwd, {mode}, rowwise z + h E4M3",
             f"act fwd, {mode}, rowwise z + h E4M3, 2 calls",
             f"dact bwd, {mode}, dh both ways + z.T"]
  assert names == want
  h, dz, z, dh = 2 * m * 2 * f, 2 * m * f, m * f, m * 2 * f
  h_copy = dh * (1 + 4 / 128)   # E4M3 h and a float32 scale per 128
  tb = lambda nbytes: nbytes / 1e-3 / 1e12
  # per-tensor: h read, z written; h and dz read, dh both ways and z.T written
  assert rows[0]["ours"] == tb(h + z)
  assert rows[1]["ours"] == tb(h + z + h_copy)
  assert rows[2]["ours"] == tb(2 * h + z + h_copy)   # quantize_blockwise reads h again
  assert rows[3]["ours"] == tb(h + dz + 2 * dh + z)
  # current scaling: the amax pass reads the inputs once more
  assert rows[4]["ours"] == tb(2 * h + z)
  assert rows[7]["ours"] == tb(2 * (h + dz) + 2 * dh + z)
  assert rows[11]["ours"] == tb(h + dz + (2 * dh + z) * (1 + 4 / 128))   # + a scale per 128
  # each case runs twice (baseline, ours): seen[2 * i + 1] is case i's result.
  # A dact case returns dh both ways and z's columnwise copy.
  q, z_t = seen[2 * 11 + 1]
  assert q.data.shape == (m, 2 * f) and q.data_t.shape == (2 * f, m) and z_t.data.shape == (f, m)
  # h_copy=True and the two calls it replaces: the same z and h copy, bit for bit
  for mode_case in (1, 5, 9):
    (q1, h1), (q2, h2) = seen[2 * mode_case + 1], seen[2 * (mode_case + 1) + 1]
    assert h1.data.shape == (m, 2 * f) and h1.scale_inv.shape == (m, 2 * f // 128)
    for name in ("data", "scale_inv"):
      _same_bits(getattr(q1, name), getattr(q2, name), f"{names[mode_case]} z {name}")
      _same_bits(getattr(h1, name), getattr(h2, name), f"{names[mode_case]} h {name}")
  bench_ops.report(rows)
  assert "activation quantize (Llama MLP shape)" in capsys.readouterr().out


def test_stack_rows_time_the_stack_beside_the_loop_it_replaced(monkeypatch, capsys):
  """bench_ops' stack rows (issue 47): each case traces and runs both the
  one-launch stack op and the lax.map of the 2-D op, on the references here,
  and the two give the same FP8 bytes (so the row compares equal work)."""
  outs = []

  def once(fn, arg_sets, **_):
    outs.append(jax.block_until_ready(fn(*arg_sets[0])))
    return 1e-3

  monkeypatch.setattr(bench_ops, "bench", once)
  rows = bench_ops.stack_rows(e=3, m=128, k=256, impls=("reference", "reference"))
  assert [r["kind"] for r in rows] == ["stack", "stack"]
  assert all(r["ours"] > 0 and r["loop"] > 0 for r in rows)
  for stack, loop in zip(outs[0::2], outs[1::2]):
    _same_bits(stack.data, loop.data, "data")
    _same_bits(stack.data_t, loop.data_t, "data_t")
  # The summary prints them (run AK's bench_ops crashed here on rows without an error).
  bench_ops.report(rows)
  out = capsys.readouterr().out
  assert "quantize a stack of expert weights" in out and "(lax.map)" in out
