"""tools/deviceless_memory.py's pure helpers, on CPU without the jax CUDA
plugin: finding XLA's GpuTargetConfigProto texts embedded in a binary, and
the memory-size calibration. Importing the tool must not need jax or CUDA."""

import importlib.util
import os
import subprocess
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "tools", "deviceless_memory.py")
_spec = importlib.util.spec_from_file_location("deviceless_memory", _PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

H100_BYTES = 84942979072


def _config(name: str, memory: int = H100_BYTES, extra: str = "") -> str:
  """A made-up target config in the layout XLA embeds (license comment, proto
  markers, fields)."""
  return ("# Copyright 2024 The OpenXLA Authors.\n#\n"
          "# proto-file: third_party/tensorflow/compiler/xla/stream_executor/"
          "device_description.proto\n"
          "# proto-message: stream_executor.GpuTargetConfigProto\n\n"
          "gpu_device_info {\n  core_count: 132\n"
          f"  device_memory_size: {memory}\n{extra}"
          "  cuda_compute_capability {\n    major: 9\n  }\n"
          f'  name: "{name}"\n'
          "}\n"
          'platform_name: "CUDA"\n'
          f'device_description_str: "{name}"\n')


def _binary(*texts: str) -> bytes:
  """Texts as NUL-terminated C strings between unrelated binary data."""
  out = b"\x7fELF\x02\x01\x01\x00" + bytes(range(1, 200))
  for text in texts:
    out += b"\x00" + text.encode() + b"\x00" + b"\x90\x00other string\x00"
  return out


def test_import_and_help_need_neither_jax_nor_the_cuda_plugin():
  # In a fresh process where importing jax or any jax plugin fails.
  code = ("import sys, importlib.util\n"
          "sys.modules.update(jax=None, jax_plugins=None, jaxlib=None)\n"
          f"spec = importlib.util.spec_from_file_location('t', {_PATH!r})\n"
          "tool = importlib.util.module_from_spec(spec); spec.loader.exec_module(tool)\n"
          "sys.exit(tool.main(['-h']))\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        check=False, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert "--raw-memory-base" in proc.stdout


def test_extracts_each_embedded_config_whole_by_its_description():
  h100 = _config(tool.H100_SXM)
  pcie = _config("NVIDIA H100 PCIe", extra="  l2_cache_size: 52428800\n")
  mig = _config("NVIDIA H100 80GB HBM3 MIG 1g.10gb", memory=10 << 30)
  blob = _binary(pcie, mig, h100)
  configs = tool.find_target_configs(blob)
  assert configs == {"NVIDIA H100 PCIe": pcie, "NVIDIA H100 80GB HBM3 MIG 1g.10gb": mig,
                     tool.H100_SXM: h100}
  # The exact name, not a prefix of the MIG slice's name.
  assert tool.extract_target_config(blob) == h100
  assert tool.extract_target_config(blob, "NVIDIA H100 PCIe") == pcie
  # A config at the very start or end of the data (no NUL around it).
  assert tool.extract_target_config(h100.encode()) == h100


def test_a_missing_device_names_the_ones_found():
  blob = _binary(_config("NVIDIA H100 PCIe"), "not a config")
  with pytest.raises(LookupError, match="NVIDIA H100 PCIe"):
    tool.extract_target_config(blob, tool.H100_SXM)


def test_calibration_scales_device_memory_to_the_gpu_clients_limit():
  text = _config(tool.H100_SXM)
  factor = tool.GPU_CLIENT_MEMORY_FRACTION / tool.DEVICELESS_MEMORY_FRACTION
  assert factor == pytest.approx(0.9375)
  scaled = tool.scale_device_memory(text, factor)
  # What the H100 runs measured against: 0.75 / 0.80 of 84942979072 bytes.
  assert "  device_memory_size: 79634042880\n" in scaled
  assert scaled.replace("79634042880", str(H100_BYTES)) == text   # nothing else changes
  assert tool.scale_device_memory(text, 1.0) == text


@pytest.mark.parametrize("text", ["gpu_device_info {\n  core_count: 132\n}\n",
                                  "device_memory_size: 1\ndevice_memory_size: 2\n"])
def test_calibration_wants_exactly_one_memory_field(text):
  with pytest.raises(ValueError, match="device_memory_size"):
    tool.scale_device_memory(text, 0.9375)


def test_peers_tool_compiles_the_step_bench_peers_times():
  """tools/deviceless_peers_memory.py's step is bench_peers.time_row's: on
  the CPU, with abstract arguments, it compiles to the same temp memory as
  the step bench_peers compiles from real ones (a different step, e.g. one
  without the input gradient, would not)."""
  import jax
  path = os.path.join(os.path.dirname(__file__), "..", "tools", "deviceless_peers_memory.py")
  spec = importlib.util.spec_from_file_location("deviceless_peers_memory", path)
  peers_tool = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(peers_tool)
  import bench_peers
  sz = bench_peers.sizes(True)
  rows = bench_peers.te_jax_rows("layer", sz, backward_chunks=2, act_input_fp8=True)
  (label, module, ctx), = bench_peers.keep_rows(rows, ["delayed chunks2 h-e4m3"])
  got = peers_tool.row_temp_mib(module, ctx, sz, jax.devices("cpu")[0])
  want = bench_peers.time_row(module, ctx, sz, k=1, repeats=1)["temp_mib"]
  assert label == "te_jax delayed chunks2 h-e4m3" and got == pytest.approx(want) and got > 0
