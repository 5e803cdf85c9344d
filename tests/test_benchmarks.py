"""Benchmark helpers that decide what a timing measures."""

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import te_jax
from te_jax import fp8_state
from te_jax import flax as tfx
from te_jax import recipe as recipe_lib

# benchmarks/ is on sys.path through pytest's pythonpath (pyproject.toml).
import bench_floor  # pylint: disable=import-error
import bench_layer  # pylint: disable=import-error
from _fp8_carry import carry_fp8_state  # pylint: disable=import-error


def _scales(variables):
  return [float(s) for p, s in jax.tree_util.tree_leaves_with_path(
      variables[fp8_state.FP8_COLLECTION]) if "'scale'" in jax.tree_util.keystr(p)]


def test_carry_advances_delayed_state_and_leaves_params():
  rec = recipe_lib.DelayedScaling(amax_history_len=4)
  model = tfx.LayerNormMLP(intermediate_dim=64, activations=("gelu",))
  x = jax.random.normal(jax.random.key(0), (2, 16, 32), jnp.float32)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=rec):
    variables = model.init(jax.random.key(1), x)

  def loss(v):
    with te_jax.fp8_autocast(enabled=True, fp8_recipe=rec):
      return jnp.mean(jnp.square(model.apply(v, x)))

  assert len(_scales(variables)) == 6
  assert all(s == 1.0 for s in _scales(variables))       # fresh state: scale 1
  grads = jax.grad(loss)(variables)
  carried = carry_fp8_state(variables, grads)
  assert carried["params"] is variables["params"]
  # The x/kernel/grad scales now come from the amaxes of the step just run.
  assert all(s > 1.0 for s in _scales(carried))   # fp8_max / amax, amaxes below fp8_max
  assert carried[fp8_state.FP8_COLLECTION] is grads[fp8_state.FP8_COLLECTION]


def test_carry_without_fp8_collection_is_identity():
  variables = {"params": {"w": jnp.ones(3)}}
  assert carry_fp8_state(variables, {"params": {"w": jnp.zeros(3)}}) is variables


def test_step_shares_split_each_layer_step():
  ms = {"layer/te_off": 30.0, "mlp/te_off": 18.0, "attn/module_off": 10.0, "attn/core": 2.5,
        "layer/te_block": 20.0, "mlp/te_block": 12.0, "attn/te_block": 6.5,
        "layer/te_delayed": 19.0, "mlp/te_delayed": 11.0}       # no attn/te_delayed row
  by = {name: {"ms": v} for name, v in ms.items()}
  rows = [line for line in bench_layer.step_shares(by) if line.startswith("| off")
          or line.startswith("| block") or line.startswith("| delayed")]
  assert rows == [
      "| off | 30.000 | 18.00 (60%) | 2.50 (8%) | 7.50 (25%) | 2.00 (7%) |",
      "| block | 20.000 | 12.00 (60%) | 2.50 (12%) | 4.00 (20%) | 1.50 (8%) |"]
  del by["attn/core"]
  assert bench_layer.step_shares(by) == []


# ------------------------------------------------------------- bench_floor --

_TINY = dict(batch=2, seq=128, hidden=128, mlp=256, heads=2)


def _relerr(a, b):
  a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("precision", bench_floor.PRECISIONS)
def test_floor_step_runs_the_three_gemms_of_each_dense_layer(precision):
  ops = bench_floor.make_operands("mlp", precision, _TINY, seed=0)
  bf16 = bench_floor.make_operands("mlp", "bf16", _TINY, seed=0)  # same N(0, 1) data
  out = bench_floor.make_step(precision)(ops)
  assert len(out) == 3 * len(bench_floor.dense_shapes("mlp", _TINY))
  # FP8 of N(0, 1) data: a relative error of a few percent (E4M3 keeps 3
  # mantissa bits, E5M2 2); bf16 against the float32 product: rounding only.
  tol = 0.02 if precision == "bf16" else 0.15
  for i, (x, w, g) in enumerate(bf16[0]):
    x, w, g = (a.astype(jnp.float32) for a in (x, w, g))
    for got, want in zip(out[3 * i:3 * i + 3], (x @ w, g @ w.T, x.T @ g)):
      assert got.shape == want.shape
      assert _relerr(got, want) < tol


def test_floor_layer_step_adds_projections_and_attention_core():
  out = bench_floor.make_step("bf16")(bench_floor.make_operands("layer", "bf16", _TINY, 0))
  b, s, h = _TINY["batch"], _TINY["seq"], _TINY["heads"]
  assert len(out) == 3 * 4 + 4          # 4 dense layers x 3 GEMMs, attention out + dq, dk, dv
  assert all(o.shape == (b, s, h, _TINY["hidden"] // h) for o in out[-4:])
  assert bench_floor.gemm_flops("layer", _TINY) > bench_floor.gemm_flops("mlp", _TINY)


def test_floor_budget_rows():
  targets = bench_floor.parse_targets(["mlp/te_delayed=2.0", "mlp/te_block=1.5",
                                       "layer/te_current=1.5"])
  floors = {("mlp", "fp8"): 8.0, ("mlp", "block"): 9.5}
  layer = {"mlp/te_off": {"ms": 20.0}, "mlp/te_delayed": {"ms": 11.0, "gemm_kernel_ms": 7.5}}
  rows = bench_floor.budget_rows(floors, layer, targets)
  assert [r["target"] for r in rows] == ["mlp/te_delayed", "mlp/te_block"]  # no layer rows
  delayed, block = rows
  assert delayed["need_ms"] == 10.0 and delayed["left_ms"] == 2.0
  assert delayed["bound"] == 2.5 and delayed["measured_ms"] == 11.0
  assert delayed["step_gemm_ms"] == 7.5 and delayed["left_step_ms"] == 2.5
  assert block["floor"] == "block" and block["left_ms"] == pytest.approx(20 / 1.5 - 9.5)
  assert block["measured_ms"] is None and block["left_step_ms"] is None
  text = bench_floor.table([], rows, _TINY)
  assert "| mlp/te_delayed >= 2.0x | 20.000 | 10.000 | 8.000 (fp8) | 2.50x | 2.000 | " \
         "11.000 (1.82x) | 7.500 (2.500) |" in text
  assert "| 9.500 (block) | 2.11x | 3.833 | - | - |" in text


@pytest.mark.parametrize("bad", ["mlp/te_delayed", "attn/te_delayed=1.5", "mlp/te_off=1.0"])
def test_floor_rejects_bad_targets(bad):
  with pytest.raises(ValueError, match="target"):
    bench_floor.parse_targets([bad])


def test_gemm_kernel_names():
  for name in ("nvjet_sm90_qqtst_128x256_64x4_2x1_v_bz_coopB_TNT",
               "sm90_xmma_gemm_e4m3e4m3_bf16f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1",
               "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn>"):
    assert bench_layer.is_gemm_kernel(name), name
  for name in ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3",
               "loop_multiply_fusion_2", "input_reduce_fusion",
               "void te_jax::ActQuantizeKernel<__nv_bfloat16, 0, 1>(...)"):
    assert not bench_layer.is_gemm_kernel(name), name


# ---------------------------------------------------------- bench_peers.py --

def test_peers_carry_replaces_every_non_params_collection():
  import bench_peers
  variables = {"params": {"w": 1}, "fp8_metas": {"s": 1}, "_overwrite_with_gradient": {"a": 1}}
  grads = {"params": {"w": 9}, "fp8_metas": {"s": 2}, "_overwrite_with_gradient": {"a": 3}}
  out = bench_peers.carry_state(variables, grads)
  assert out == {"params": {"w": 1}, "fp8_metas": {"s": 2}, "_overwrite_with_gradient": {"a": 3}}


def test_peers_table_ratios_are_against_each_librarys_own_fp8_off_row():
  import bench_peers
  row = lambda ms: {"ms": ms, "dx_abs_max": 1e-3, "temp_mib": 10.0}
  text = bench_peers.table({"mlp": [("te_jax off", row(20.0)), ("te_jax delayed", row(10.0)),
                                    ("TE-JAX off", row(30.0)), ("TE-JAX delayed", row(12.0)),
                                    ("Flax x", {"error": "boom"})]}, ["a note"])
  assert "| mlp | te_jax delayed | 10.000 | 2.000x |" in text
  assert "| mlp | TE-JAX delayed | 12.000 | 2.500x |" in text
  assert "failed: boom" in text and "Note: a note" in text


def test_peers_table_survives_a_failed_fp8_off_row():
  import bench_peers
  row = {"ms": 10.0, "dx_abs_max": 1e-3, "temp_mib": 10.0}
  text = bench_peers.table({"mlp": [("te_jax off", {"error": "oom"}),
                                    ("te_jax delayed", row)]}, [])
  assert "| mlp | te_jax off | failed: oom |" in text
  assert "| mlp | te_jax delayed | 10.000 | - |" in text   # no base: no ratio


def test_peers_te_rows_say_why_when_transformer_engine_is_missing():
  import bench_peers
  rows, why = bench_peers.te_rows("mlp", bench_peers.sizes(True))
  try:
    import transformer_engine.jax  # noqa: F401  pylint: disable=unused-import
  except Exception:  # pylint: disable=broad-except
    assert rows is None and "transformer_engine.jax does not import" in why
  else:
    assert [label for label, _, _ in rows] == ["TE-JAX off", "TE-JAX delayed", "TE-JAX current"]


def test_peers_rows_time_a_carried_te_jax_step_on_cpu():
  import bench_peers
  sz = bench_peers.sizes(True)
  label, module, ctx = bench_peers.te_jax_rows("mlp", sz)[1]
  assert label == "te_jax delayed"
  r = bench_peers.time_row(module, ctx, sz, k=1, repeats=1)
  assert r["ms"] > 0 and r["dx_abs_max"] > 0 and r["temp_mib"] is not None


def test_peers_keep_rows_run_with_the_fp8_copies_kept():
  """--keep-fp8-copies: delayed, current and blockwise rows whose autocast
  keeps the forward's FP8 copies, after the default rows (which do not)."""
  import bench_peers
  from te_jax import autocast
  sz = bench_peers.sizes(True)
  rows = bench_peers.te_jax_rows("mlp", sz, keep_fp8_copies=True)
  labels = [label for label, _, _ in rows]
  assert labels[-3:] == ["te_jax delayed keep", "te_jax current keep", "te_jax blockwise keep"]
  for label, _, ctx in rows:
    with ctx() as c:
      assert c is autocast.get_fp8_context()
      assert c.keep_fp8_copies == label.endswith(" keep"), label
  assert "te_jax delayed keep" not in [l for l, _, _ in bench_peers.te_jax_rows("mlp", sz)]
  r = bench_peers.time_row(*rows[-3][1:], sz, k=1, repeats=1)
  assert r["ms"] > 0 and r["dx_abs_max"] > 0
  # with --act-input-fp8 too: delayed and blockwise rows doing both
  both = bench_peers.te_jax_rows("mlp", sz, act_input_fp8=True, keep_fp8_copies=True)
  assert [label for label, _, _ in both][-2:] == ["te_jax delayed keep h-e4m3",
                                                  "te_jax blockwise keep h-e4m3"]
  for label, _, ctx in both:
    with ctx() as c:
      assert c.keep_fp8_copies == (" keep" in label), label
      assert c.store_act_input_in_fp8 == label.endswith("h-e4m3"), label


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float32])
def test_peers_te_jax_and_flax_rows_hold_the_requested_parameter_dtype(param_dtype):
  """bf16 by default: TE-JAX's rows hold bf16 parameters (its dtype=bf16 sets
  both), so te_jax's and Flax's must too for a like-for-like step."""
  import bench_peers
  sz = bench_peers.sizes(True)
  x = jnp.zeros((sz["batch"], sz["seq"], sz["hidden"]), jnp.bfloat16)
  rows = bench_peers.te_jax_rows("mlp", sz, param_dtype=param_dtype)[:1] + \
      bench_peers.flax_rows("mlp", sz, param_dtype=param_dtype)
  for label, module, ctx in rows:
    with ctx():
      shapes = jax.eval_shape(module.init, jax.random.key(0), x)
    dtypes = {p.dtype for p in jax.tree.leaves(nn.meta.unbox(shapes["params"]))}
    assert dtypes == {jnp.dtype(param_dtype)}, (label, dtypes)


def test_peers_profile_reports_kernel_time_by_kind():
  import bench_peers
  sz = bench_peers.sizes(True)
  label, module, ctx = bench_peers.te_jax_rows("mlp", sz)[1]
  r = bench_peers.time_row(module, ctx, sz, k=1, repeats=1, profile=True)
  # CPU traces hold no GPU kernels: every kind is present and zero.
  assert set(r["kernel_ms"]) == {"gemm", "attention", "te_jax", "other", "idle"}
  assert isinstance(r["largest"], list) and isinstance(r["kernels"], list)
  fake = {"kernel_ms": {"gemm": 9.5, "attention": 0.0, "te_jax": 1.25, "other": 0.5,
                        "idle": 0.125}}
  text = bench_peers.kernel_table({"mlp": [("te_jax delayed", fake), ("TE-JAX off", {"ms": 1})]})
  lines = text.splitlines()
  assert len(lines) == 3 and "| mlp | te_jax delayed | 9.500 | 0.000 | 1.250 | 0.500 | 0.125 |" in lines
  assert bench_peers.kernel_table({"mlp": [("TE-JAX off", {"ms": 1})]}) == ""


def test_layer_noguard_config_turns_the_outlier_guard_off():
  sz = bench_layer.sizes(True)
  for config, factor in (("mlp/te_delayed", recipe_lib.DelayedScaling().outlier_factor),
                         ("mlp/te_delayed_noguard", None)):
    apply = bench_layer._build(config, sz)[0]   # pylint: disable=protected-access
    r = apply.__defaults__[1]                  # the recipe the step runs under
    assert isinstance(r, recipe_lib.DelayedScaling) and r.outlier_factor == factor, config
  assert factor is None and recipe_lib.DelayedScaling().outlier_factor is not None


def test_nnx_bench_times_both_apis_with_the_state_carried():
  import bench_nnx
  ms, times, dx = bench_nnx.bench("mlp", "delayed", bench_layer.sizes(True), k=1, repeats=2)
  assert set(ms) == {"linen", "nnx"} and all(len(t) == 2 for t in times.values())
  assert all(v > 0 for v in ms.values())
  # Nonzero input gradients in both: neither state was frozen at scale 1.
  assert dx["linen"] > 0 and dx["nnx"] > 0


def test_remat_bench_runs_each_policy_with_the_state_carried():
  import bench_remat
  sz = bench_layer.sizes(True)
  res = bench_remat.bench("fp8_gemms", "delayed", 1, sz, k=1, repeats=1)
  assert res["ms"] > 0 and res["dx_abs_max"] > 0     # nonzero: the state was not frozen
  assert res["gemm_calls"] >= 0 and len(res["times_ms"]) == 1
  with pytest.raises(KeyError):
    bench_remat.bench("no_such_policy", "delayed", 1, sz, k=1, repeats=1)


def test_model_bench_sorts_kernels_and_carries_the_state():
  import bench_model
  kinds = {n: bench_model.kernel_kind(n) for n in (
      "nvjet_qqtst_128x160_128x5_1x2_h_bz_coopA_NNT", "cudnn_generated_fort_native_sdpa_sm90",
      "void te_jax::QuantizeTileKernel<256>(...)", "loop_multiply_fusion_3",
      "flash_fwd_kernel", "sm90_xmma_gemm_e4m3")}
  assert list(kinds.values()) == ["gemm", "attention", "te_jax", "other", "attention", "gemm"]
  res = bench_model.run_one("cpu", "delayed", k=1, repeats=2, profile_steps=1, small=True)
  assert res["ms"] > 0 and len(res["times"]) == 2 and res["steps_timed"] == 2
  assert res["loss"] == res["loss"] and res["params"] > 0          # finite loss
  assert res["fp8_scales_moved"] > 0                              # state carried, not frozen
  # Launches per step are given for exactly the kernels kept per kind.
  assert set(res["launches"]) == {n for rows in res["top"].values() for n, _ in rows}


def test_peers_hlo_dir_writes_each_rows_optimized_hlo(tmp_path):
  import bench_peers
  out = tmp_path / "rows.json"
  bench_peers.main(["--small", "--libs", "te_jax", "--blocks", "mlp", "--k", "1",
                    "--repeats", "1", "--hlo-dir", str(tmp_path / "hlo"),
                    "--json-out", str(out)])
  files = sorted(p.name for p in (tmp_path / "hlo").iterdir())
  assert files == ["mlp_te_jax_blockwise.hlo.txt", "mlp_te_jax_current.hlo.txt",
                   "mlp_te_jax_delayed.hlo.txt", "mlp_te_jax_off.hlo.txt"], files
  text = (tmp_path / "hlo" / "mlp_te_jax_off.hlo.txt").read_text()
  assert "HloModule" in text and "ENTRY" in text
  assert json.loads(out.read_text())["results"]["mlp"]


def test_peers_fastacc_rows_turn_fast_accumulation_on_in_every_gemm():
  import bench_peers
  sz = bench_peers.sizes(True)
  plain = [label for label, _, _ in bench_peers.te_jax_rows("mlp", sz)]
  rows = bench_peers.te_jax_rows("mlp", sz, fastacc=True)
  labels = [label for label, _, _ in rows]
  assert labels == plain + ["te_jax delayed fastacc", "te_jax current fastacc"]
  for label, _, ctx in rows:
    with ctx():
      r = te_jax.get_fp8_context().recipe
    if label.endswith("fastacc"):
      assert (r.fast_accum_fprop, r.fast_accum_dgrad, r.fast_accum_wgrad) == (True,) * 3
    elif label != "te_jax off" and label != "te_jax blockwise":
      assert (r.fast_accum_dgrad, r.fast_accum_wgrad) == (False, False), label


@pytest.mark.parametrize("block", ["mlp", "layer"])
def test_peers_backward_chunks_rows_chunk_the_mlp_backward(block):
  import bench_peers
  sz = bench_peers.sizes(True)
  plain = [label for label, _, _ in bench_peers.te_jax_rows(block, sz)]
  rows = bench_peers.te_jax_rows(block, sz, backward_chunks=4)
  assert [label for label, _, _ in rows] == plain + ["te_jax delayed chunks4",
                                                     "te_jax blockwise chunks4"]
  for label, module, _ in rows:
    mlp = module.block if block == "mlp" else module
    got = mlp.backward_chunks if block == "mlp" else mlp.mlp_backward_chunks
    assert got == (4 if label.endswith("chunks4") else 1), label


@pytest.mark.parametrize("chunks", [1, 4])
def test_peers_act_input_fp8_rows_keep_h_in_e4m3(chunks):
  """--act-input-fp8: delayed and blockwise rows whose autocast keeps the
  activation's input in E4M3, chunked as --backward-chunks says; the other
  rows' autocast does not."""
  import bench_peers
  import te_jax
  sz = bench_peers.sizes(True)
  rows = bench_peers.te_jax_rows("layer", sz, backward_chunks=chunks, act_input_fp8=True)
  tag = f" chunks{chunks}" if chunks > 1 else ""
  h_rows = [f"te_jax delayed{tag} h-e4m3", f"te_jax blockwise{tag} h-e4m3"]
  assert [label for label, _, _ in rows][-2:] == h_rows
  for label, module, ctx in rows:
    with ctx():
      kept = te_jax.autocast.get_fp8_context().store_act_input_in_fp8
    assert kept == (label in h_rows), label
    if label in h_rows:
      assert module.mlp_backward_chunks == chunks


def test_peers_backward_chunks_below_one_is_a_usage_error(capsys):
  import bench_peers
  with pytest.raises(SystemExit):
    bench_peers.main(["--small", "--libs", "te_jax", "--backward-chunks", "0"])
  assert "--backward-chunks must be >= 1, got 0" in capsys.readouterr().err


def test_packed_attention_bench_runs_its_xla_path_on_cpu(capsys):
  import bench_packed_attention
  assert bench_packed_attention.main(["--small", "--paths", "xla", "--k", "1",
                                      "--repeats", "1"]) == 0
  rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| xla |")]
  assert len(rows) == 1 and float(rows[0].split("|")[2]) > 0


def test_peers_keep_rows_selects_by_recipe_and_names_an_unknown_one():
  import bench_peers
  rows = [("te_jax off", 1, 2), ("te_jax delayed fastacc", 3, 4), ("TE-JAX off", 5, 6)]
  assert bench_peers.keep_rows(rows, ["off"]) == [rows[0], rows[2]]
  assert bench_peers.keep_rows(rows, [" delayed fastacc"]) == [rows[1]]
  with pytest.raises(ValueError, match="blockwise"):
    bench_peers.keep_rows(rows, ["blockwise"])


# ------------------------------------------------------------ _gpu_clocks.py --

def test_clock_samples_parse_and_summarize_over_a_window():
  import _gpu_clocks
  text = ("timestamp, clocks.current.sm [MHz], clocks_throttle_reasons.active\n"
          "2026/12/04 16:21:20.000, 1980, 0x0000000000000000\n"
          "2026/12/04 16:21:20.500, 1400, 0x0000000000000004\n"
          "Field \"x\" is not a valid field to query.\n"
          "2026/12/04 16:21:21.000, 1500, 0x0000000000000005\n"
          "2026/12/04 16:21:2")   # a half-written last line
  samples = _gpu_clocks.parse_samples(text)
  assert [s[1:] for s in samples] == [(1980.0, 0), (1400.0, 4), (1500.0, 5)]
  t0 = samples[0][0]
  assert samples[2][0] - t0 == pytest.approx(1.0)
  got = _gpu_clocks.summarize(samples, t0 + 0.25, t0 + 1.0)
  assert got == {"sm_mhz": 1450.0, "power_capped": 1.0, "samples": 2}
  assert _gpu_clocks.summarize(samples, t0, t0 + 0.6)["power_capped"] == 0.5
  assert _gpu_clocks.summarize(samples, t0 + 2, t0 + 3) is None


def test_peers_table_shows_the_clock_column_only_with_a_clock_log():
  import bench_peers
  row = lambda ms, clock=None: {"ms": ms, "dx_abs_max": 1e-3, "temp_mib": 10.0, "clock": clock}
  plain = bench_peers.table({"mlp": [("te_jax off", row(20.0))]}, [])
  assert "SM MHz" not in plain
  text = bench_peers.table({"mlp": [("te_jax off", row(20.0)),
                                    ("te_jax delayed", row(10.0, {"sm_mhz": 1468.4,
                                                                 "power_capped": 0.9,
                                                                 "samples": 9}))]}, [])
  assert "SM MHz (power-capped)" in text
  assert "| mlp | te_jax delayed | 10.000 | 2.000x | 0.001 | 10 | 1468 (90%) |" in text
  assert "| mlp | te_jax off | 20.000 | 1.000x | 0.001 | 10 | - |" in text


def test_clock_log_says_why_when_nvidia_smi_is_missing(monkeypatch):
  import _gpu_clocks
  monkeypatch.setattr(_gpu_clocks.shutil, "which", lambda name: None)
  assert _gpu_clocks.ClockLog.start() is None
  assert "nvidia-smi is not on PATH" in _gpu_clocks.ClockLog.why_not


def test_peers_versus_table_pairs_te_jax_rows_with_te_jax_s_same_recipe():
  import bench_peers
  row = lambda ms: {"ms": ms, "dx_abs_max": 1e-3, "temp_mib": 10.0}
  results = {"layer": [("te_jax delayed", row(20.5)), ("te_jax delayed fastacc", row(19.8)),
                       ("te_jax blockwise", row(24.0)), ("te_jax current", {"error": "x"}),
                       ("TE-JAX delayed", row(20.0)), ("TE-JAX current", row(21.0))]}
  text = bench_peers.peer_table(results)
  assert "| layer | te_jax delayed | TE-JAX delayed | 1.025 |" in text
  assert "| layer | te_jax delayed fastacc | TE-JAX delayed | 0.990 |" in text
  assert "blockwise" not in text and "te_jax current" not in text
  assert bench_peers.peer_table({"mlp": [("te_jax off", row(1.0))]}) == ""


def test_peers_merge_rounds_keeps_the_median_and_every_sample():
  import bench_peers
  rounds = [{"ms": 3.0, "temp_mib": 7.0, "kernels": ["k"]}, {"ms": 1.0, "temp_mib": 7.0},
            {"ms": 2.0, "temp_mib": 7.0}]
  merged = bench_peers.merge_rounds(rounds)
  assert merged["ms"] == 2.0 and merged["ms_rounds"] == [3.0, 1.0, 2.0]
  assert merged["kernels"] == ["k"] and "ms_rounds" not in rounds[0]   # the first round's extras
  assert bench_peers.merge_rounds([{"ms": 1.0}, {"error": "boom"}]) == {"error": "boom"}


def test_peers_rounds_alternate_the_row_order_and_report_medians(tmp_path, capsys):
  import bench_peers
  out = tmp_path / "rows.json"
  bench_peers.main(["--small", "--libs", "te_jax", "--blocks", "mlp", "--recipes",
                    "off,delayed", "--k", "1", "--repeats", "1", "--rounds", "3",
                    "--json-out", str(out)])
  timed = [json.loads(line) for line in capsys.readouterr().out.splitlines()
           if line.startswith("{")]
  assert [(r["round"], r["row"]) for r in timed] == [
      (0, "te_jax off"), (0, "te_jax delayed"), (1, "te_jax delayed"), (1, "te_jax off"),
      (2, "te_jax off"), (2, "te_jax delayed")]
  rows = dict(json.loads(out.read_text())["results"]["mlp"])
  for label, r in rows.items():
    samples = [t["ms"] for t in timed if t["row"] == label]
    assert r["ms_rounds"] == samples and r["ms"] == sorted(samples)[1], label
  with pytest.raises(SystemExit):
    bench_peers.main(["--small", "--rounds", "0"])


def test_layer_keep_config_keeps_the_fp8_copies(monkeypatch):
  from te_jax import fused_mlp   # pylint: disable=import-outside-toplevel
  seen = []
  real = fused_mlp.fp8_mlp

  @functools.wraps(real)   # its signature: bench_layer asks whether the choice exists
  def recording(*args, **kwargs):
    seen.append(kwargs.get("save_original_input", "default"))
    return real(*args, **kwargs)
  monkeypatch.setattr(fused_mlp, "fp8_mlp", recording)
  sz = bench_layer.sizes(True)
  called = {}
  for config in ("mlp/te_delayed", "mlp/te_delayed_keep"):
    apply, variables, xs = bench_layer._build(config, sz)[:3]  # pylint: disable=protected-access
    seen.clear()
    jax.eval_shape(apply, variables, xs[0])
    called[config] = list(seen)
  # The default plan, then the copies kept (the autocast's keep_fp8_copies);
  # the module's function left as it was.
  assert called == {"mlp/te_delayed": [True], "mlp/te_delayed_keep": [False]}
  assert fused_mlp.fp8_mlp is recording
