"""benchmarks/bench_ops.py's activation rows: every case traces and runs (the
reference standing in for the kernel on the CPU) and counts its bytes."""

import bench_ops  # pylint: disable=import-error  (benchmarks/ is on pytest's path)


def test_act_rows_run_every_case(monkeypatch, capsys):
  seen = []

  def once(fn, arg_sets, k=1, reps=1):
    out = fn(*arg_sets[0])
    seen.append(out)
    return 1e-3   # one "millisecond": the figure is then bytes / 1e9
  monkeypatch.setattr(bench_ops, "bench", once)
  m, f = 256, 128
  rows = bench_ops.act_rows(m=m, f=f, impls=("reference", "reference"))
  assert [r["name"].split(",")[:2] for r in rows] == [
      ["act fwd", " tensorwise"], ["dact bwd", " tensorwise"],
      ["act fwd", " blockwise"], ["dact bwd", " blockwise"]]
  h, dz, z, dh = 2 * m * 2 * f, 2 * m * f, m * f, m * 2 * f
  tb = lambda nbytes: nbytes / 1e-3 / 1e12
  # per-tensor: h read, z written; h and dz read, dh both ways and z.T written
  assert rows[0]["ours"] == tb(h + z)
  assert rows[1]["ours"] == tb(h + dz + 2 * dh + z)
  assert rows[3]["ours"] == tb(h + dz + (2 * dh + z) * (1 + 4 / 128))   # + a scale per 128
  # a dact case (each case runs twice: baseline, ours) returns dh both
  # ways and z's columnwise copy
  q, z_t = seen[3]
  assert q.data.shape == (m, 2 * f) and q.data_t.shape == (2 * f, m) and z_t.data.shape == (f, m)
  bench_ops.report(rows)
  assert "activation quantize (Llama MLP shape)" in capsys.readouterr().out
