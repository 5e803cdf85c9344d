"""benchmarks/bench_moe.py builds its layer step without giant constants and
reports the build phases (issue 47: a row that timed out could not say
whether init, lowering or compiling took the time)."""

import argparse
import re

import jax
import pytest

import bench_moe  # pylint: disable=import-error  (benchmarks/ is on pytest's pythonpath)

# The largest constant a layer step may hold, in bytes. Its own constants are
# scalars, iotas and small index tables; the loss's output offset g alone is
# 64 KiB at the --small sizes (64 MiB at the full ones), so it fails this
# bound when the loss closes over it instead of taking it as an argument.
MAX_CONSTANT_BYTES = 4096


def largest_constant_bytes(stablehlo: str) -> int:
  """Bytes of the largest hex-encoded dense constant of a StableHLO text."""
  return max((len(h) // 2 for h in re.findall(r'dense<"0x([0-9A-Fa-f]+)">', stablehlo)),
             default=0)


@pytest.mark.parametrize("row", ["none", "delayed"])
def test_layer_step_takes_the_output_offset_as_an_argument(row):
  case = bench_moe.layer_case(row, small=True)
  with case["context"]():
    variables = jax.eval_shape(case["module"].init, jax.random.key(0), case["xs"][0])
    text = case["grad_step"].lower(variables, case["xs"][0], case["g"]).as_text()
  assert largest_constant_bytes(text) <= MAX_CONSTANT_BYTES


def test_largest_constant_reads_hex_constants():
  text = ('%0 = stablehlo.constant dense<"0x0000803F00000040"> : tensor<2xf32>\n'
          '%1 = stablehlo.constant dense<1.0> : tensor<f32>')
  assert largest_constant_bytes(text) == 8
  assert largest_constant_bytes("%1 = stablehlo.constant dense<1.0> : tensor<f32>") == 0


def test_layer_row_prints_and_returns_each_build_phase(capsys):
  r = bench_moe.run_layer("none", small=True, k=1, repeats=1, profile_steps=1)
  err = capsys.readouterr().err
  phases = re.findall(r"^phase: (.+?) [0-9.]+ s$", err, re.M)
  assert phases[:4] == ["init (trace + compile + run)", "step lower", "step compile",
                        "1 timed steps"], err
  assert set(r["build_s"]) == {"init", "lower", "compile"}
  assert all(v > 0 for v in r["build_s"].values()), r["build_s"]


def test_model_row_prints_and_returns_each_build_phase(capsys):
  r = bench_moe.run_model("none", small=True, k=1, repeats=1, profile_steps=1)
  err = capsys.readouterr().err
  phases = re.findall(r"^phase: (.+?) [0-9.]+ s$", err, re.M)
  assert phases[:4] == ["init (Trainer built + state initialized)", "step lower",
                        "step compile", "1 timed steps"], err
  assert all(r["build_s"][p] > 0 for p in ("init", "lower", "compile")), r["build_s"]
  table = bench_moe.format_tables([r], argparse.Namespace(small=True, repeats=1, k=1,
                                                         profile_steps=1))
  build = " / ".join(f"{r['build_s'][p]:.1f}" for p in ("init", "lower", "compile"))
  assert f"| {build} |" in table and "init / lower / compile s |" in table, table


def test_trace_program_turns_command_buffers_off_on_a_gpu(monkeypatch):
  """The traced steps' program is compiled with XLA's command buffers off on a
  GPU (inside one, a kernel is named after its buffer, not its op, and the
  grouped GEMMs counted as "other"); on a CPU it is the compiled step itself.
  XLA rejects an unknown option name, so compiling with the option proves
  its spelling."""
  lowered = jax.jit(lambda x: x * 2).lower(jax.numpy.ones(3))
  compiled = lowered.compile()
  phases = []
  assert bench_moe._trace_program(lowered, compiled, phases.append) is compiled  # pylint: disable=protected-access
  assert phases == []
  asked = []
  real_compile = type(lowered).compile

  def compile_and_record(self, compiler_options=None):
    asked.append(compiler_options)
    return real_compile(self, compiler_options=compiler_options)
  monkeypatch.setattr(type(lowered), "compile", compile_and_record)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  traced = bench_moe._trace_program(lowered, compiled, phases.append)  # pylint: disable=protected-access
  assert asked == [bench_moe.NO_COMMAND_BUFFERS] and traced is not compiled
  assert len(phases) == 1 and "without command buffers" in phases[0]
  assert list(traced(jax.numpy.ones(3))) == [2.0, 2.0, 2.0]
