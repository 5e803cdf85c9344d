"""tools/hlo_kernels.py: a profile's kernel names looked up in optimized HLO."""

import gzip
import importlib.util
import os
import sys

_PATH = os.path.join(os.path.dirname(__file__), "..", "tools", "hlo_kernels.py")
_spec = importlib.util.spec_from_file_location("hlo_kernels", _PATH)
hlo_kernels = importlib.util.module_from_spec(_spec)
sys.modules["hlo_kernels"] = hlo_kernels   # its dataclass looks its module up
_spec.loader.exec_module(hlo_kernels)

# The shapes of XLA:GPU's dump (run AS): a kernel named after its fusion with
# '.' written '_', a second instruction reusing it by deduplicated_name, and
# a custom call that is no kernel of XLA's.
_HLO = """\
HloModule jit_train_step

%fused_add.49 (param_0: bf16[8,16], param_1: bf16[8,16]) -> bf16[8,16] {
  %param_0 = bf16[8,16]{1,0} parameter(0)
  %param_1 = bf16[8,16]{1,0} parameter(1)
  ROOT %add.3 = bf16[8,16]{1,0} add(%param_0, %param_1), metadata={op_name="jit(train_step)/transpose(jvp(GPT))/layer_0/mlp/add_any"}
}

ENTRY %main (p0: bf16[8,16], p1: bf16[8,16]) -> bf16[8,16] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[8,16]{1,0} parameter(1)
  %ffi_call.7 = (bf16[8,16]{1,0}) custom-call(%p0), custom_call_target="te_jax_norm_backward"
  %loop_add_fusion.49 = bf16[8,16]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused_add.49, metadata={op_name="jit(train_step)/transpose(jvp(GPT))/layer_0/mlp/add_any" deduplicated_name="loop_add_fusion_49"}
  ROOT %loop_add_fusion.50 = bf16[8,16]{1,0} fusion(%loop_add_fusion.49, %p1), kind=kLoop, calls=%fused_add.49, metadata={op_name="jit(train_step)/transpose(jvp(GPT))/layer_1/mlp/add_any" deduplicated_name="loop_add_fusion_49"}
}
"""


def test_a_kernel_name_finds_its_instructions_shape_op_and_body(tmp_path):
  k = hlo_kernels.lookup(_HLO, "loop_add_fusion_49")
  assert k.count == 2                                  # by name and by deduplicated_name
  assert k.shape == "bf16[8,16]{1,0}" and k.operands == "%p0, %p1"
  assert k.op_name == "jit(train_step)/transpose(jvp(GPT))/layer_0/mlp/add_any"
  assert k.body[-1].startswith("ROOT %add.3 = bf16[8,16]{1,0} add(")
  assert hlo_kernels.lookup(_HLO, "loop_add_fusion_4").count == 0   # no prefix match
  assert hlo_kernels.lookup(_HLO, "ffi_call_7").op_name == ""        # a custom call: no op
  path = tmp_path / "step.gpu_after_optimizations.txt.gz"
  with gzip.open(path, "wt") as fh:
    fh.write(_HLO)
  assert hlo_kernels.read_hlo(str(path)) == _HLO


def test_the_command_prints_each_kernel(tmp_path, capsys):
  path = tmp_path / "step.txt"
  path.write_text(_HLO)
  assert hlo_kernels.main([str(path), "loop_add_fusion_49", "wrapped_add"]) == 0
  out = capsys.readouterr().out
  assert "loop_add_fusion_49: 2 instruction(s), bf16[8,16]{1,0} <- (%p0, %p1)" in out
  assert "layer_0/mlp/add_any" in out and "wrapped_add: no instruction" in out
  assert hlo_kernels.main([str(path)]) == 2
