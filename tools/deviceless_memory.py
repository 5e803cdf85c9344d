"""benchmarks/model_memory.py's compile-only memory tables for an H100 on a
machine with no GPU: jax's CUDA plugin compiles for a target description
(deviceless) and memory_analysis() is read as on the GPU.

model_memory.py's own code runs, after patching what asks for a real GPU:
* devices: a CUDA topology built from XLA's H100 SXM GpuTargetConfigProto
  (text the jax CUDA plugin embeds; extracted from xla_cuda_plugin.so at run
  time) stands in for jax.devices() (train_gpt's mesh, te_jax's capability
  checks); jax.default_backend() says "gpu" (te_jax stages its CUDA custom
  calls, cuDNN attention is chosen); jax's cuDNN attention checks (which
  ask for a local GPU) answer for the target's compute capability;
* --offload_optimizer: compile-only devices have no memory spaces, so jax
  drops the "pinned_host" kind of the step's shardings; the lowering is
  wrapped to put it back on the arguments/results named "opt_state" (as
  train_gpt's offload.host_shardings does on a GPU), and te_jax.offload's
  host-memory check is skipped;
* libcuda.so.1, which cuDNN's engine selection opens: without a driver, a
  stub whose every call fails (tools/deviceless/libcuda_stub.c, built with
  gcc into the cache directory).
Memory base: with no limit in the module config XLA:GPU sizes remat and
scheduling to 0.80 x device_memory_size; a GPU client passes its
allocator's limit, 0.75 x the GPU memory at jax's default memory fraction.
By default device_memory_size is scaled by 0.75/0.80 so the two agree (llama
bf16 batch 8: 57.71 GiB args+temp, 433 remat copies; the H100: 57.45, 426).

  python tools/deviceless_memory.py [-h: own flags] [model_memory.py flags]
  e.g. ... compile --one delayed:8 --preset llama --offload_optimizer
Cache (target configs, stub): $DEVICELESS_CACHE, else ~/.cache/te_jax_deviceless.
tools/deviceless_memory.sh: the venv and the four tables.
"""

# pylint: disable=import-outside-toplevel,protected-access  (jax loads after set-up)
from __future__ import annotations

import argparse
import collections
import ctypes
import glob
import importlib.util
import mmap
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUB_SOURCE = os.path.join(REPO, "tools", "deviceless", "libcuda_stub.c")
H100_SXM = "NVIDIA H100 80GB HBM3"
CONFIG_MARKER = b"proto-message: stream_executor.GpuTargetConfigProto"
GPU_CLIENT_MEMORY_FRACTION = 0.75   # jax's default XLA_PYTHON_CLIENT_MEM_FRACTION
DEVICELESS_MEMORY_FRACTION = 0.80   # XLA:GPU's limit when the module names none
ENV_CONFIG, ENV_SRC, ENV_HLO = "DEVICELESS_TARGET_CONFIG", "TE_JAX_SRC", "DEVICELESS_HLO_DIR"
ENV_OFFLOAD = "DEVICELESS_OFFLOAD"   # set per compile: which step gets host memory kinds
OFFLOADED_NAME = re.compile(r"opt_state")


def find_target_configs(blob) -> dict:
  """{device_description_str: text} of every GpuTargetConfigProto text
  embedded in ``blob`` (bytes or mmap of a binary: NUL-terminated strings)."""
  out, at = {}, blob.find(CONFIG_MARKER)
  while at != -1:
    start, end = blob.rfind(b"\0", 0, at) + 1, blob.find(b"\0", at)
    text = bytes(blob[start:end if end != -1 else len(blob)]).decode("utf-8", "replace")
    name = re.search(r'^device_description_str:\s*"([^"]*)"', text, re.MULTILINE)
    if name:
      out.setdefault(name.group(1), text)
    at = blob.find(CONFIG_MARKER, at + 1)
  return out


def extract_target_config(blob, device: str = H100_SXM) -> str:
  """The embedded config whose device_description_str is ``device``."""
  configs = find_target_configs(blob)
  if device not in configs:
    raise LookupError(f"no target config for {device!r}; found: {sorted(configs)}")
  return configs[device]


def scale_device_memory(text: str, factor: float) -> str:
  """The config with its one ``device_memory_size`` multiplied by ``factor``."""
  field = re.compile(r"^(\s*device_memory_size:\s*)(\d+)\s*$", re.MULTILINE)
  if len(field.findall(text)) != 1:
    raise ValueError("expected exactly one device_memory_size field")
  return field.sub(lambda m: f"{m.group(1)}{round(int(m.group(2)) * factor)}", text)


def cache_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
  path = os.environ.get("DEVICELESS_CACHE", os.path.join(base, "te_jax_deviceless"))
  os.makedirs(path, exist_ok=True)
  return path


def cuda_plugin_library() -> str:
  """xla_cuda_plugin.so of the installed jax CUDA plugin (not imported)."""
  spec = importlib.util.find_spec("jax_plugins")
  for where in (spec.submodule_search_locations if spec else None) or []:
    found = sorted(glob.glob(os.path.join(where, "xla_cuda*", "xla_cuda_plugin.so")))
    if found:
      return found[-1]
  raise SystemExit("no jax CUDA plugin installed: pip install 'jax[cuda13]'")


def write_target_config(raw_memory_base: bool, device: str = H100_SXM) -> str:
  """The plugin's config for ``device``, calibrated unless ``raw_memory_base``,
  written to the cache directory; returns its path."""
  with open(cuda_plugin_library(), "rb") as fh, \
       mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as blob:
    text = extract_target_config(blob, device)
  if not raw_memory_base:
    text = scale_device_memory(text, GPU_CLIENT_MEMORY_FRACTION / DEVICELESS_MEMORY_FRACTION)
  slug = re.sub(r"\W+", "_", device).strip("_").lower()
  path = os.path.join(cache_dir(), f"{slug}{'_raw' if raw_memory_base else ''}.txtpb")
  with tempfile.NamedTemporaryFile("w", dir=cache_dir(), delete=False) as tmp:
    tmp.write(text)
  os.replace(tmp.name, path)   # atomic: a concurrent run never reads half a file
  return path


def load_libcuda():
  """The driver if there is one, else the stub (global, so that cuDNN's own
  dlopen("libcuda.so.1") finds it by soname)."""
  try:
    return ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
  except OSError:
    pass
  stub = os.path.join(cache_dir(), "libcuda_stub", "libcuda.so.1")
  if not os.path.exists(stub) or os.path.getmtime(stub) < os.path.getmtime(STUB_SOURCE):
    os.makedirs(os.path.dirname(stub), exist_ok=True)
    building = f"{stub}.{os.getpid()}"   # concurrent runs each build their own
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", building,
                    STUB_SOURCE], check=True)
    os.replace(building, stub)
  return ctypes.CDLL(stub, mode=ctypes.RTLD_GLOBAL)


def patch_jax(target_config: str):
  """Compile-only H100 devices in place of jax's; returns them."""
  import jax
  import jax.numpy as jnp
  from jax.experimental import topologies
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
  from jax._src.interpreters import mlir

  with open(target_config, encoding="utf-8") as fh:
    topology = topologies.get_topology_desc(platform="cuda", target_config=fh.read(),
                                            topology="1x1x1")
  devices = list(topology.devices)
  real_devices, real_local_devices = jax.devices, jax.local_devices
  wants_gpu = lambda backend: backend in (None, "gpu", "cuda")
  jax.devices = lambda backend=None: list(devices) if wants_gpu(backend) else real_devices(backend)
  jax.local_devices = lambda process_index=None, backend=None, host_id=None: (
      list(devices) if wants_gpu(backend) else real_local_devices(process_index, backend, host_id))
  jax.default_backend = lambda: "gpu"
  jax.device_count = jax.local_device_count = lambda backend=None: len(devices)
  # Nothing can run eagerly on compile-only devices; compile_step only hands
  # PRNGKey(0) to jax.eval_shape, so its shape is enough.
  jax.random.PRNGKey = lambda seed, impl=None: jax.ShapeDtypeStruct((2,), jnp.uint32)

  target_cc = tuple(int(x) for x in str(devices[0].compute_capability).split("."))
  as_cc = lambda cap: tuple(int(x) for x in cap.split("."))
  cudnn_attention.check_compute_capability = lambda cap: target_cc >= as_cc(cap)
  cudnn_attention.is_cuda_compute_capability_equal = lambda cap: target_cc == as_cc(cap)

  real_lower = mlir.lower_jaxpr_to_module

  def lower_with_host_kinds(module_name, *args, **kw):
    """Memory kinds "pinned_host" on the train step's opt_state arguments and
    results, "device" on the rest (what a GPU client's lowering emits)."""
    if os.environ.get(ENV_OFFLOAD) != "1" or "train_step" not in str(module_name):
      return real_lower(module_name, *args, **kw)
    # Names cover the jaxpr's arguments; hoisted constants come first, unnamed.
    arg_names = list(kw.get("arg_names") or [])
    result_names = list(kw.get("result_names") or [])
    names = ([""] * (len(kw["arg_shardings"]) - len(arg_names)) + arg_names + result_names +
             [""] * (len(kw["result_shardings"]) - len(result_names)))
    kinds = iter(["pinned_host" if OFFLOADED_NAME.search(n or "") else "device" for n in names])
    real_kind = mlir._get_mem_kind
    mlir._get_mem_kind = lambda sharding: next(kinds)
    try:
      return real_lower(module_name, *args, **dict(kw, all_default_mem_kind=False))
    finally:
      mlir._get_mem_kind = real_kind

  mlir.lower_jaxpr_to_module = lower_with_host_kinds
  return devices


def compile_only_devices(target_config: str):
  """The whole set-up before jax starts: the environment (no driver check,
  the CPU client, cuDNN's deviceless graphs), the libcuda stub, and jax
  patched (:func:`patch_jax`); returns the compile-only H100 devices."""
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check
  os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the plugin compiles; no CUDA client
  if "xla_gpu_cudnn_deviceless_compilation_mode" not in os.environ.get("XLA_FLAGS", ""):
    # cuDNN attention graphs from the target's device properties, no handle.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_cudnn_deviceless"
                               "_compilation_mode=CUDNN_DEVICELESS_COMPILATION_ALWAYS").strip()
  load_libcuda()
  return patch_jax(target_config)


def patch_model_memory(src: str, devices):
  """model_memory with te_jax's GPU checks answered and its run_one adding
  the compiled HLO's custom calls; its children re-run this file."""
  sys.path[:0] = [os.path.join(src, "benchmarks"), os.path.join(src, "examples")]
  import jax
  from te_jax import offload
  from te_jax.ops import _native
  import model_memory  # pylint: disable=import-error

  if not _native.cuda_available():   # the installed te_jax must have its kernels
    raise SystemExit(f"te_jax: no CUDA custom calls: {_native._load_native()[1]}")
  offload._check_host_memory = lambda: None
  offload.host_memory_kind = lambda devices=None: offload.HOST_MEMORY_KIND
  real_compile_step, real_run_one, last = model_memory.compile_step, model_memory.run_one, {}

  def compile_step(preset, recipe, batch, overrides, offload_optimizer=False):
    os.environ[ENV_OFFLOAD] = "1" if offload_optimizer else "0"
    last["compiled"] = real_compile_step(preset, recipe, batch, overrides, offload_optimizer)
    return last["compiled"]

  def run_one(args):
    out = real_run_one(args)
    hlo = last["compiled"].as_text()
    out["custom_calls"] = dict(collections.Counter(
        re.findall(r'custom_call_target="([^"]+)"', hlo)))
    out["deviceless"] = {"device": str(devices[0]), "jax": jax.__version__,
                         "target_config": os.environ[ENV_CONFIG]}
    if os.environ.get(ENV_HLO):
      tag = re.sub(r"[^\w.=+-]", "_", f"{args.one}_{args.set or 'default'}" +
                   ("_offload" if args.offload_optimizer else ""))
      os.makedirs(os.environ[ENV_HLO], exist_ok=True)
      with open(os.path.join(os.environ[ENV_HLO], tag + ".hlo.txt"), "w", encoding="utf-8") as fh:
        fh.write(hlo)
    return out

  model_memory.compile_step, model_memory.run_one = compile_step, run_one
  # child() runs `sys.executable model_memory.__file__ compile --one ...`.
  model_memory.__file__ = os.path.abspath(__file__)
  return model_memory


def main(argv=None):
  p = argparse.ArgumentParser(prog="deviceless_memory.py", add_help=False, allow_abbrev=False,
                              description="This tool's flags; the rest go to model_memory.py "
                              "(python benchmarks/model_memory.py -h).")
  p.add_argument("--raw-memory-base", action="store_true",
                 help="keep the plugin's device_memory_size (0.80 x it, not the GPU's 0.75)")
  p.add_argument("--target-config", help="a GpuTargetConfigProto text file to use as is")
  p.add_argument("--hlo-dir", help="write each run's compiled HLO text here")
  p.add_argument("--te-jax-src", help="repository whose benchmarks/ and examples/ run (default: "
                 "this one, or $TE_JAX_SRC); te_jax itself is the installed package")
  own, rest = p.parse_known_args(argv)
  if {"-h", "--help"} & set(rest):
    p.print_help()
    return 0
  # model_memory's children (`compile --one ...`) get none of our flags:
  # the parent hands them its choices in the environment.
  if own.target_config:
    os.environ[ENV_CONFIG] = os.path.abspath(own.target_config)
  elif not ("--one" in rest and ENV_CONFIG in os.environ):
    os.environ[ENV_CONFIG] = write_target_config(own.raw_memory_base)
  if own.hlo_dir:
    os.environ[ENV_HLO] = os.path.abspath(own.hlo_dir)
  src = os.path.abspath(own.te_jax_src or os.environ.get(ENV_SRC, REPO))
  os.environ[ENV_SRC] = src
  model_memory = patch_model_memory(src, compile_only_devices(os.environ[ENV_CONFIG]))
  return model_memory.main(rest)


if __name__ == "__main__":
  sys.exit(main())
