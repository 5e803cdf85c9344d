"""benchmarks/bench_moe.py on a CPU with --small: every row runs, the tables
come out, and the compiled step's ops are sorted into the MoE's parts by
their named scopes (what the GPU kernel time by part rests on)."""

import json

import pytest

import bench_moe  # pylint: disable=import-error  (benchmarks/ is on pytest's pythonpath)
import moe_trace  # pylint: disable=import-error


def test_part_of_takes_the_innermost_moe_scope():
  assert moe_trace.part_of("jit(step)/jvp(moe_experts)/dot_general") == "experts"
  # the backward of the combine inside the experts' custom VJP names both
  assert moe_trace.part_of("transpose(jvp(moe_experts))/moe_combine/mul") == "combine"
  assert moe_trace.part_of("jit(step)/self_attention/dot") == "other"


def test_gpu_events_are_sorted_by_their_annotation_or_their_hlo_op():
  parts = {"fusion.3": "dispatch"}
  assert moe_trace._event_part(  # pylint: disable=protected-access
      {"args": {"tf_op": "jit(step)/moe_router/top_k"}}, parts) == "router"
  assert moe_trace._event_part({"args": {"hlo_op": "fusion.3"}}, parts) == "dispatch"  # pylint: disable=protected-access
  assert moe_trace._event_part({"args": {"hlo_op": "fusion.9"}}, parts) == "other"  # pylint: disable=protected-access


HLO = """HloModule jit_loss

%fused_select.1 (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %c = f32[4]{0} constant({0, 0, 0, 0})
  ROOT %select = f32[4]{0} select(%p, %p0, %c), metadata={op_name="jit(loss)/transpose(jvp(MoE))/moe_dispatch/select_n"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %loop_select_fusion.1 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_select.1
}
"""


def test_a_fusion_without_op_name_takes_its_computations():
  names = moe_trace.hlo_op_names(HLO)
  assert names["loop_select_fusion.1"].endswith("moe_dispatch/select_n")
  # the trace names kernels with underscores
  assert moe_trace.hlo_parts(HLO)["loop_select_fusion_1"] == "dispatch"
  assert moe_trace._event_op({"args": {"hlo_op": "loop_select_fusion_1"}}) == (  # pylint: disable=protected-access
      "loop_select_fusion_1")
  # Under a command buffer the event names the buffer; the kernel is the fusion.
  event = {"name": "loop_select_fusion_1", "args": {"hlo_op": "command_buffer_32"}}
  assert moe_trace._event_part(event, moe_trace.hlo_parts(HLO)) == "dispatch"  # pylint: disable=protected-access


def test_each_parts_budget_by_kernel_name(monkeypatch):
  import bench_layer  # pylint: disable=import-error,import-outside-toplevel
  # two steps traced: the dispatch fusion twice a step, a grouped GEMM in
  # the experts' scope once, and a kernel of no MoE op
  events = [{"name": "loop_select_fusion_1", "dur": 1000, "args": {"hlo_op": "loop_select_fusion_1"}},
            {"name": "loop_select_fusion_1", "dur": 3000, "args": {"hlo_op": "loop_select_fusion_1"}},
            {"name": "loop_select_fusion_1", "dur": 2000, "args": {"hlo_op": "loop_select_fusion_1"}},
            {"name": "loop_select_fusion_1", "dur": 2000, "args": {"hlo_op": "loop_select_fusion_1"}},
            {"name": "GroupedGemm", "dur": 5000, "args": {"annotation": "jit(f)/moe_experts/ffi_call"}},
            {"name": "GroupedGemm", "dur": 7000, "args": {"annotation": "jit(f)/moe_experts/ffi_call"}},
            {"name": "other_kernel", "dur": 500, "args": {"hlo_op": "fusion.9"}}]
  monkeypatch.setattr(bench_layer, "gpu_kernel_events", lambda run, steps: events)
  ms = moe_trace.kernel_time_by_part(None, 2, HLO, top=3)
  assert ms["dispatch"] == pytest.approx(4.0) and ms["experts"] == pytest.approx(6.0)
  # summed over launches, per step: (ms, launches, name)
  assert ms["by_name"]["dispatch"] == [(4.0, 2.0, "loop_select_fusion_1")]
  assert ms["by_name"]["experts"] == [(6.0, 1.0, "GroupedGemm")]
  assert ms["by_name"]["other"] == [(0.25, 0.5, "other_kernel")]
  assert ms["by_name"]["router"] == []


def test_kernel_events_keep_the_gpu_stream_kernels_only():
  import bench_layer  # pylint: disable=import-error,import-outside-toplevel
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "XLA Ops"}}]
  kernel = {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "ts": 0, "dur": 5}
  op_line = {"ph": "X", "pid": 1, "tid": 9, "name": "fusion", "ts": 0, "dur": 5}
  host = {"ph": "X", "pid": 2, "tid": 7, "name": "dispatch", "ts": 0, "dur": 5}
  assert bench_layer.kernel_events(meta + [kernel, op_line, host]) == [kernel]
  # Without stream names, every X event of a GPU process counts.
  assert bench_layer.kernel_events(meta[:2] + [kernel, op_line, host]) == [kernel, op_line]
  assert bench_layer.kernel_events([host]) == []


def test_small_run_on_cpu_times_every_row_and_sorts_the_ops(tmp_path, capsys):
  out_json = tmp_path / "rows.json"
  code = bench_moe.main(["--small", "--in-process", "--k", "1", "--repeats", "1",
                         "--profile-steps", "1", "--recipes", "blockwise",
                         "--json-out", str(out_json)])
  out = capsys.readouterr().out
  assert code == 0, out
  assert bench_moe.grouped_gemm_note() in out   # which grouped GEMM the FP8 rows ran
  rows = json.loads(out_json.read_text())
  assert [(r["part"], r["row"]) for r in rows] == [
      ("layer", "none"), ("layer", "blockwise"), ("layer", "ragged_dot"),
      ("model", "none"), ("model", "blockwise")]
  for r in rows:
    assert r["ms"] > 0 and r["args_temp"] > 0
    assert r["kernels_ms"] is None        # no GPU trace on a CPU
  for r in rows[:3]:
    assert r["max_abs_dx"] > 0
    assert all(r["hlo_ops"][part] > 0 for part in bench_moe.PARTS), r["hlo_ops"]
  for line in ("| none | ", "| blockwise | ", "| ragged_dot | "):
    assert line in out
  assert "train_gpt.py --preset moe_tiny" in out


def test_model_set_overrides_the_model_rows_preset(tmp_path, capsys):
  """--model-set changes the model part's Config (here one layer of
  moe_tiny's two): fewer parameters, and the table says which."""
  out_json = tmp_path / "rows.json"
  args = ["--small", "--in-process", "--parts", "model", "--recipes", "none", "--k", "1",
          "--repeats", "1", "--profile-steps", "1", "--json-out", str(out_json)]
  assert bench_moe.main(args) == 0
  (whole,) = json.loads(out_json.read_text())
  assert bench_moe.main(args + ["--model-set", "layers=1"]) == 0
  (one,) = json.loads(out_json.read_text())
  assert 0 < one["params"] < whole["params"]
  assert "train_gpt.py --preset moe_tiny --set layers=1 (" in capsys.readouterr().out


def test_unknown_recipe_is_a_usage_error():
  with pytest.raises(SystemExit):
    bench_moe.main(["--small", "--recipes", "fp4"])


def test_layer_sizes_reach_the_layer_and_the_child_process(monkeypatch):
  """--layer-sizes wide builds the GEMM-bound layer, and a row run in a
  fresh process gets the same sizes."""
  case = bench_moe.layer_case("none", small=False, sizes="wide")
  assert case["sizes"] == bench_moe.LAYER_SIZES["wide"]
  assert case["module"].intermediate_dim == 2048 and case["xs"][0].shape == (4, 2048, 4096)
  seen = {}

  def fake_run(cmd, **_):
    seen["cmd"] = cmd
    return type("P", (), {"stdout": 'JSON {"ms": 1.0}', "stderr": "", "returncode": 0})()
  monkeypatch.setattr(bench_moe.subprocess, "run", fake_run)
  args = bench_moe.argparse.Namespace(k=1, repeats=1, profile_steps=1, top_kernels=0,
                                      layer_sizes="wide", small=False, timeout=5,
                                      model_set="layers=1")
  assert bench_moe._child("layer", "none", args) == {"ms": 1.0}  # pylint: disable=protected-access
  assert seen["cmd"][seen["cmd"].index("--layer-sizes") + 1] == "wide"
  assert seen["cmd"][seen["cmd"].index("--model-set") + 1] == "layers=1"
  with pytest.raises(SystemExit):
    bench_moe.main(["--layer-sizes", "huge"])


def test_ragged_dot_row_computes_what_the_fp8_off_row_does():
  """The ragged_dot row swaps every grouped GEMM of the FP8-off layer
  (fprop, dgrad and the row-major wgrad) for jax.lax.ragged_dot: same loss
  and gradients, so its timing compares kernels, not different work."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from te_jax.ops import grouped_gemm as op  # pylint: disable=import-outside-toplevel

  original = op.grouped_wgrad_rows
  results = {}
  for row in ("none", "ragged_dot"):
    case = bench_moe.layer_case(row, small=True)
    with case["context"]():
      variables = jax.jit(case["module"].init)(jax.random.PRNGKey(0), case["xs"][0])
      if row == "ragged_dot":
        assert op.grouped_wgrad_rows is not original
      results[row] = case["grad_step"](variables, case["xs"][0], case["g"])
  assert op.grouped_wgrad_rows is original  # restored
  flat_none, flat_ragged = (jax.tree_util.tree_leaves(results[r]) for r in ("none", "ragged_dot"))
  assert len(flat_none) == len(flat_ragged)
  for a, b in zip(flat_none, flat_ragged):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=2e-2, atol=2e-3)
