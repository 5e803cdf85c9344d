"""The memory tools the GPU runs use: benchmarks/model_memory.py and bench_model's memory columns.

On the CPU: the compile mode end to end on a tiny model (fresh processes,
XLA's dump parsed for the buffers live at the peak), the parsers on dump
text, and bench_model's device-memory column.
"""

import json

import pytest

import bench_model  # pylint: disable=import-error  (benchmarks/ is on pytest's path)
import model_memory  # pylint: disable=import-error

_LIVE_RANGE = """HloLiveRange (max 9):
  InstructionSequence:
    0:p
  Live ranges at 5 (peak):
    fusion.1{}: 100 bytes (cumulative: 100 bytes)
    custom-call.7{0}: 4096 bytes (cumulative: 4196 bytes)
    p{}: 12 bytes (cumulative: 4208 bytes)
  Stack trace breakdown for peak usage: 4208 bytes
"""

_ASSIGNMENT = """BufferAssignment:
allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
 value: <1 p @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 4196, preallocated-temp:
 value: <2 fusion.1 @0> (size=100,offset=0): f32[25]{0}
 value: <3 custom-call.7 @0> (size=4096,offset=128): u8[4096]{0}
"""

_HLO = """ENTRY %main (p: f32[16]) -> f32[16] {
  %fusion.1 = f32[25]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(step)/layer_0/mlp/mul"}
  ROOT %custom-call.7 = u8[4096]{0} custom-call(), metadata={op_name="jit(step)/gemm" source_file="x.py"}
}
"""


def test_dump_parsers_find_the_peak_buffers_and_their_ops():
  assert model_memory.peak_buffers(_LIVE_RANGE) == [("custom-call.7", 4096), ("fusion.1", 100),
                                                     ("p", 12)]
  assert model_memory.temp_values(_ASSIGNMENT) == [("custom-call.7", 4096, "u8[4096]{0}"),
                                                   ("fusion.1", 100, "f32[25]{0}")]
  assert model_memory.op_names(_HLO) == {"fusion.1": "jit(step)/layer_0/mlp/mul",
                                         "custom-call.7": "jit(step)/gemm"}


def test_remat_instructions_counts_the_copies_xla_made():
  hlo = """ENTRY %main (p: f32[16]) -> f32[16] {
  %fusion.1 = f32[25]{0} fusion(%p), kind=kLoop
  %fusion.1.remat = f32[25]{0} fusion(%p), kind=kLoop
  %fusion.1.remat2 = f32[25]{0} fusion(%p), kind=kLoop
  %convert.7.remat.clone = bf16[16]{0} convert(%p)
  ROOT %add.3 = f32[16]{0} add(%fusion.1.remat, %p)
}
"""
  assert model_memory.remat_instructions(hlo) == 3
  assert model_memory.remat_instructions(_HLO) == 0


def test_overrides_parse_to_config_values():
  assert model_memory.parse_overrides("layers=2,lr=0.5,doc_window=false,dtype=bfloat16") == {
      "layers": 2, "lr": 0.5, "doc_window": False, "dtype": "bfloat16"}
  with pytest.raises(SystemExit, match="name=value"):
    model_memory.parse_overrides("layers")


def test_compile_mode_tables_memory_and_peak_buffers(tmp_path, capsys):
  out = tmp_path / "mem.json"
  rc = model_memory.main(["compile", "--preset", "llama_tiny", "--batches", "4",
                          "--recipes", "none,delayed", "--set", "num_docs=20", "--jobs", "1",
                          "--dump", str(tmp_path / "dump"), "--top", "5",
                          "--json-out", str(out)])
  text = capsys.readouterr().out
  assert rc == 0, text
  results = json.loads(out.read_text())
  assert [(r["recipe"], r["batch"]) for r in results] == [("none", 4), ("delayed", 4)]
  for r in results:
    assert r["stats"]["argument"] > 0 and r["stats"]["temp"] > 0
    assert r["peak"]["source"] and len(r["peak"]["buffers"]) == 5
    sizes = [b for _, b, _ in r["peak"]["buffers"]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 0
    assert any("train_step" in op for _, _, op in r["peak"]["buffers"])   # op_names found
  assert "| 4 | delayed |" in text and "largest buffers at the peak" in text
  row = [l for l in text.splitlines() if l.startswith("| 4 | delayed |")][0]
  cells = [c.strip() for c in row.strip(" |").split("|")]
  assert cells[-2].endswith("x")                                        # ratio to bf16
  assert cells[-1] == str(results[1]["remat"]) and results[1]["remat"] >= 0


def test_bench_model_reports_device_memory_per_recipe():
  res = bench_model.run_one("cpu", "delayed", k=1, repeats=1, profile_steps=1, small=True)
  assert res["memory"]["args_temp"] > 0
  base = dict(res, recipe="none", memory={"args_temp": res["memory"]["args_temp"] * 2,
                                          "peak_in_use": None})

  class Args:  # pylint: disable=too-few-public-methods
    preset, repeats, k, profile_steps = "cpu", 1, 1, 1

  table = bench_model.format_tables([base, res], Args)
  row = [l for l in table.splitlines() if l.startswith("| delayed |")][0]
  assert "| 0.500x |" in row and "args+temp GiB" in table


def test_keep_variant_restores_the_previous_residuals_and_only_within():
  """``delayed+keep`` keeps the FP8 copies (the layers' old residuals); the
  switch is undone afterwards."""
  small = dict(preset="llama", hidden=256, layers=1, heads=2, kv_groups=1, mlp=768,
               seq_len=256, batch=1, doc_window=False, keep_fp8_copies=False,
               store_act_input_in_fp8=False)   # the preset keeps them; the library does not

  def fp8_in_mlp(recipe):
    return sum(r.nbytes for r in model_memory.model_residuals(recipe, small)
               if r.dtype.startswith("float8") and not r.argument
               and model_memory.layer_of(r.where).endswith("/mlp"))

  assert fp8_in_mlp("delayed+keep") > 0
  assert fp8_in_mlp("delayed") == 0
