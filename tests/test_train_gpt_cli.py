"""examples/train_gpt.py as a user meets it: resume, usage errors, --help, the README
quickstart, the Llama-style presets, tokens/s and MFU.

CPU only, tiny presets, a few steps (the whole file is a CI budget item,
about 80 s: three short training runs of the tiny GPT and one of llama_tiny,
the quickstart's five steps). Multi-process runs: tests/test_multihost.py.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import checkpoint
from te_jax import flax as tfx

# examples/ is on sys.path through pytest's pythonpath (pyproject.toml).
import compare_recipes  # pylint: disable=import-error
import gpt_cli  # pylint: disable=import-error
import train_gpt  # pylint: disable=import-error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
QUIET = ["--no_progress", "--sample_chars", "0", "--eval_batches", "0", "--out_dir", ""]


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
  """The documented flow (--steps N, then --steps 2N --resume) and one uninterrupted run."""
  ckpt = str(tmp_path_factory.mktemp("gpt") / "ckpt")
  whole = train_gpt.main(["--preset", "tiny", "--steps", "6", "--lr_horizon", "3"] + QUIET)
  first = train_gpt.main(["--preset", "tiny", "--steps", "3", "--ckpt_dir", ckpt] + QUIET)
  # Only --steps and --resume: the preset and the rest come from the checkpoint.
  second = train_gpt.main(["--ckpt_dir", ckpt, "--steps", "6", "--resume"] + QUIET)
  return ckpt, whole, first, second


def test_resume_is_bit_identical_to_an_uninterrupted_run(resumed_run):
  ckpt, whole, first, second = resumed_run
  assert first["steps"] == [0, 1, 2] and second["steps"] == [3, 4, 5]
  # The resumed part keeps the first part's LR horizon (its --steps, 3): every
  # loss equals the uninterrupted run of that schedule, bit for bit.
  assert first["losses"] + second["losses"] == whole["losses"]
  assert second["config"]["preset"] == "tiny" and second["config"]["lr_horizon"] == 3
  stored = json.loads(open(os.path.join(ckpt, "6", train_gpt.RUN_CONFIG_FILE)).read())
  assert stored["steps"] == 6 and stored["lr_horizon"] == 3
  assert {k: stored[k] for k in train_gpt.RUN_FIELDS} == {
      k: second["config"][k] for k in train_gpt.RUN_FIELDS}
  if jax.default_backend() == "cpu":       # no known peak: tokens/s, and no MFU
    assert whole["mfu"] is None and whole["peak_flops_per_device"] is None
    assert whole["tokens_per_s"] > 0


def test_resuming_a_finished_run_says_so_and_exits_0(resumed_run):
  ckpt = resumed_run[0]
  proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_gpt.py"),
                         "--ckpt_dir", ckpt, "--resume"],
                        env=_env(), capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert "the run is finished (--steps 6)" in proc.stdout
  assert "Pass a larger --steps" in proc.stdout
  assert "Traceback" not in proc.stderr


def test_resume_with_changed_flags_names_them(resumed_run, capsys):
  ckpt = resumed_run[0]
  with pytest.raises(SystemExit) as e:
    train_gpt.main(["--ckpt_dir", ckpt, "--resume", "--steps", "8", "--hidden", "32",
                    "--recipe", "current", "--experts", "2", "--experts_per_token", "1"] + QUIET)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--hidden: 64 in the checkpoint, 32 now" in err
  assert "--recipe: 'delayed' in the checkpoint, 'current' now" in err
  assert "--experts: " in err and ", 2 now" in err
  msg = err.split("error:", 1)[1]
  assert "--layers" not in msg and len(msg) < 1000
  # The same through the Python API (no flags filled in: every field compared).
  cfg = train_gpt.Config(preset="tiny", recipe="delayed", lr=1e-3, steps=8, ckpt_dir=ckpt,
                         resume=True, out_dir=None)
  with pytest.raises(train_gpt.ResumeError, match=r"--lr: 0\.003 in the checkpoint, 0\.001 now"):
    train_gpt.train(cfg)
  assert checkpoint.available_steps(ckpt) == [3, 6]          # nothing written


def test_old_checkpoint_without_run_config_gives_a_short_error(resumed_run, tmp_path, capsys):
  """A checkpoint from before train_gpt_run.json, resumed into another model."""
  old = str(tmp_path / "old")
  shutil.copytree(resumed_run[0], old)
  for step in os.listdir(old):
    os.remove(os.path.join(old, step, train_gpt.RUN_CONFIG_FILE))
  with pytest.raises(SystemExit) as e:
    train_gpt.main(["--preset", "tiny", "--ckpt_dir", old, "--resume", "--steps", "8",
                    "--hidden", "32"] + QUIET)
  assert e.value.code == 2
  out = capsys.readouterr()
  assert f"cannot restore {old}/6 into this model" in out.err
  assert "--hidden" in out.err and len(out.err) < 2000      # not orbax's tree dump
  assert "no train_gpt_run.json" in out.out


def test_resume_without_ckpt_dir_is_a_usage_error(capsys):
  with pytest.raises(SystemExit) as e:
    train_gpt.main(["--resume", "--preset", "tiny"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("usage:") and "--resume needs --ckpt_dir" in err


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the check is for CPU-only jax")
@pytest.mark.parametrize("preset", ["h200", "llama"])
@pytest.mark.parametrize("script", [train_gpt, compare_recipes], ids=lambda m: m.__name__)
def test_gpu_presets_on_a_cpu_stop_at_once(script, preset, capsys):
  with pytest.raises(SystemExit) as e:
    script.main(["--preset", preset])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"--preset {preset} needs a GPU" in err and "--force" in err
  assert ("--preset llama_tiny" in err) == (preset == "llama")


def _help_blocks(text: str) -> dict:
  """{option: its help text} from the "options:" section of argparse's --help output
  (every spelling of an option, e.g. ``--doc_window, --no-doc_window``, maps to
  the one text)."""
  texts, current = {}, None
  section = text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
  for line in section.splitlines():
    m = re.match(r"^  (-\w|--\w+)", line)
    if m:
      names = re.findall(r"(?<![\w-])--\w[\w-]*", line.split("  ")[1]) or [m.group(1)]
      current = tuple(dict.fromkeys(names))
      texts[current] = line
    elif line.startswith("    ") and current:
      texts[current] += " " + line.strip()
    else:
      current = None
  return {name: t for names, t in texts.items() for name in names}


@pytest.mark.parametrize("script", [train_gpt, compare_recipes], ids=lambda m: m.__name__)
def test_help_lists_every_flag_with_its_default(script, capsys, monkeypatch):
  monkeypatch.setenv("COLUMNS", "100")
  with pytest.raises(SystemExit) as e:
    script.main(["--help"])
  assert e.value.code == 0
  blocks = _help_blocks(capsys.readouterr().out)
  parser = train_gpt.build_parser() if script is train_gpt else None
  if parser is not None:
    flags = {s for a in parser._actions for s in a.option_strings  # pylint: disable=protected-access
             if s.startswith("--") and s != "--help"}
    assert flags <= set(blocks), flags - set(blocks)
    assert {"--lr_horizon", "--force", "--ckpt_dir", "--resume", "--steps", "--kv_groups",
            "--peak_tflops", "--coordinator_address", "--num_processes",
            "--process_id"} <= flags
  for flag, text in blocks.items():
    if flag != "--help":
      assert "(default:" in text, f"{flag} shows no default: {text!r}"
  assert "--preset" in blocks
  assert "cpu 128, h200 1536, llama 2048, llama_tiny 64, tiny 64" in blocks["--hidden"]
  if script is train_gpt:
    assert "llama 8, llama_tiny 2; the others --heads" in blocks["--kv_groups"]


def _readme_quickstart() -> str:
  text = open(os.path.join(ROOT, "README.md")).read()
  section = text.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_quickstart_runs_and_shows_fp8_at_work(capsys):
  code = _readme_quickstart()
  assert "jnp.ones" not in code
  exec(compile(code, "README.md:Quickstart", "exec"), {})  # pylint: disable=exec-used
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step ")]
  assert len(lines) == 5, lines
  losses, amaxes, scales = [], [], []
  for line in lines:
    m = re.match(r"step \d: loss ([\d.]+) \| MLP input GEMM: amax history \[([^\]]*)\], "
                 r"scale ([\d.]+)$", line)
    assert m, line
    losses.append(float(m.group(1)))
    amaxes.append([float(a) for a in m.group(2).split(",")])
    scales.append(float(m.group(3)))
  assert all(b < a for a, b in zip(losses, losses[1:])), losses       # it trains
  assert all(h[0] > 0.5 for h in amaxes), amaxes                      # LayerNorm outputs not 0
  assert amaxes[1][1] == amaxes[0][0]                                 # the history shifts
  # The scale quantizing the next step: e4m3's 448 over the history's max.
  assert scales[-1] == pytest.approx(448 / max(max(h) for h in amaxes), rel=2e-3)


# ------------------------------------------------- the Llama-style preset ----

def _modules_and_params(preset):
  """({module path: module} of each TransformerLayer and norm the model calls, its params)."""
  trainer = train_gpt.Trainer(train_gpt.Config(preset=preset))
  seen = {}

  def record(next_fun, args, kwargs, context):
    m = context.module
    if isinstance(m, (tfx.TransformerLayer, tfx.LayerNorm, tfx.RMSNorm)):
      seen["/".join(m.scope.path)] = m
    return next_fun(*args, **kwargs)

  tokens = np.zeros((1, trainer.cfg.seq_len), np.int32)
  with nn.intercept_methods(record), trainer._ctx():  # pylint: disable=protected-access
    variables = jax.eval_shape(                       # traced, not run
        lambda: trainer.model.init(jax.random.PRNGKey(0), tokens, tokens + 1, tokens))
  return seen, nn.meta.unbox(variables["params"])


def test_llama_tiny_is_the_llama_architecture():
  seen, params = _modules_and_params("llama_tiny")
  layers = {k: m for k, m in seen.items() if isinstance(m, tfx.TransformerLayer)}
  assert sorted(layers) == ["layer_0", "layer_1"]
  for m in layers.values():
    assert m.layernorm_type == "rmsnorm" and tuple(m.activations) == ("silu", "linear")
    assert m.enable_rotary_pos_emb and not m.use_bias
    assert m.num_attention_heads == 4 and m.num_gqa_groups == 2       # GQA: 2 < 4
  assert type(seen["final_norm"]) is tfx.RMSNorm
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  assert not [n for n in names if "bias" in n], names                # no biases, no LN beta
  # (hidden, 4 query heads + 2 key and 2 value groups, head_dim 16), one fused
  # kernel; SwiGLU: gate and up projections of 192.
  assert params["layer_0"]["self_attention"]["qkv"]["kernel"].shape == (64, 4 + 2 * 2, 16)
  assert params["layer_0"]["mlp"]["wi_kernel"].shape == (64, 2, 192)
  # The GPT presets keep their architecture.
  gpt, _ = _modules_and_params("tiny")
  assert gpt["layer_0"].layernorm_type == "layernorm" and gpt["layer_0"].num_gqa_groups is None
  assert tuple(gpt["layer_0"].activations) == ("gelu",)
  assert type(gpt["final_norm"]) is tfx.LayerNorm


def test_llama_preset_is_a_1b_gqa_model_at_seq_4096():
  cfg = train_gpt.Config(preset="llama").resolved()
  assert (cfg.arch, cfg.seq_len, cfg.dtype) == ("llama", 4096, "bfloat16")
  assert 1 < cfg.kv_groups < cfg.heads and cfg.heads % cfg.kv_groups == 0
  assert cfg.hidden // cfg.heads == 128                # head_dim of cuDNN flash attention
  model = train_gpt.GPT(train_gpt.VOCAB_SIZE, cfg.hidden, cfg.layers, cfg.heads, cfg.mlp,
                        dtype=jnp.bfloat16, arch=cfg.arch, kv_groups=cfg.kv_groups)
  tokens = jnp.zeros((1, 128), jnp.int32)            # shapes only: nothing is allocated
  abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens, tokens, tokens))
  n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nn.meta.unbox(abstract["params"])))
  assert 1.0e9 <= n <= 1.5e9, n


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU output")
def test_llama_tiny_trains_and_reports_tokens_per_s_and_mfu(capsys):
  res = train_gpt.main(["--preset", "llama_tiny", "--steps", "6", "--peak_tflops", "0.5"]
                       + QUIET)
  out = capsys.readouterr().out
  losses = res["losses"]
  assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.2
  assert res["config"]["arch"] == "llama" and res["config"]["kv_groups"] == 2
  n = res["params"] - train_gpt.VOCAB_SIZE * 64                   # without the embedding
  assert res["model_flops_per_token"] == 6 * n + 12 * 2 * 128 * 64
  assert res["peak_flops_per_device"] == 0.5e12 and res["tokens_per_s"] > 0
  # MFU: model FLOPs of the 4 x 128 (padded) tokens of a step / step time / peak
  # (the step time here a median, in the MFU a mean: only roughly equal).
  assert res["mfu"] == pytest.approx(
      res["model_flops_per_token"] * 4 * 128 / res["step_time_s"] / 0.5e12, rel=0.5)
  assert "MFU against the dense bf16 peak, 0.5 TFLOP/s per device x 1" in out
  done = [l for l in out.splitlines() if l.startswith("done:")][0]
  assert " tok/s | " in done and done.endswith(f"MFU {res['mfu']:.1%}")


class _Device:
  def __init__(self, platform, kind):
    self.platform, self.device_kind = platform, kind


@pytest.mark.parametrize("platform, kind, peak", [
    ("gpu", "NVIDIA H200", 989e12), ("gpu", "NVIDIA H100 80GB HBM3", 989e12),
    ("gpu", "NVIDIA H100 PCIe", 756e12), ("gpu", "NVIDIA A100-SXM4-80GB", 312e12),
    ("gpu", "NVIDIA GeForce RTX 4090", None), ("cpu", "cpu", None)])
def test_peak_flops_by_device_kind(platform, kind, peak):
  assert train_gpt.peak_flops(_Device(platform, kind)) == peak
  assert train_gpt.peak_flops(_Device(platform, kind), peak_tflops=100) == 100e12


def test_kv_groups_that_do_not_divide_heads_are_a_usage_error(capsys):
  with pytest.raises(SystemExit) as e:
    train_gpt.main(["--preset", "llama_tiny", "--kv_groups", "3"] + QUIET)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("usage:") and "--kv_groups 3 must divide --heads 4" in err


def test_small_vocabulary_embedding_is_a_one_hot_product_with_nn_embed_variables():
  """gpt_model.OneHotEmbed (used for vocabularies up to ONE_HOT_VOCAB_MAX):
  nn.Embed's variable and forward values exactly, and a table gradient at
  least as close to the float32 one as nn.Embed's bf16 scatter-add."""
  import gpt_model  # pylint: disable=import-error
  tokens = jax.random.randint(jax.random.key(0), (4, 256), 0, 64)
  one_hot = gpt_model.OneHotEmbed(64, 32, dtype=jnp.bfloat16)
  embed = nn.Embed(64, 32, dtype=jnp.bfloat16, embedding_init=nn.initializers.normal(1.0))
  v = one_hot.init(jax.random.key(1), tokens)
  ve = embed.init(jax.random.key(1), tokens)
  assert jax.tree.structure(v) == jax.tree.structure(ve)
  np.testing.assert_array_equal(v["params"]["embedding"], ve["params"]["embedding"])
  y = one_hot.apply(v, tokens)
  assert y.dtype == jnp.bfloat16 and y.shape == (4, 256, 32)
  np.testing.assert_array_equal(y, embed.apply(v, tokens))
  cot = jax.random.normal(jax.random.key(2), y.shape, jnp.float32)

  def grad(module):
    return jax.jit(jax.grad(lambda v: jnp.sum(module.apply(v, tokens).astype(jnp.float32) *
                                              cot)))(v)["params"]["embedding"]

  exact = jax.jit(jax.grad(lambda t: jnp.sum(jnp.take(t, tokens, axis=0) * cot)))(
      v["params"]["embedding"])
  err = float(jnp.abs(grad(one_hot) - exact).max())
  err_embed = float(jnp.abs(grad(embed) - exact).max())
  scale = float(jnp.abs(exact).max())
  # the product sums in float32 and rounds once: a few bf16 ulps of the
  # cotangent's rounding, against the scatter-add's bf16 partial sums
  assert err <= err_embed and err < 2.0 ** -4 * scale, (err, err_embed, scale)
  with pytest.raises(TypeError, match="tokens must be integers"):
    one_hot.apply(v, tokens.astype(jnp.float32))
  model = gpt_model.GPT(vocab_size=64, hidden=32, layers=1, heads=2, mlp=64)
  assert gpt_model.ONE_HOT_VOCAB_MAX >= 64
  seg = jnp.ones((1, 16), jnp.int32)
  pos = jnp.arange(16)[None]
  # shapes only (the jaxpr below needs no values)
  mv = jax.eval_shape(lambda: model.init(jax.random.key(3), tokens[:1, :16], seg, pos))
  assert mv["params"]["embed"]["embedding"].shape == (64, 32)
  # the model's gradient has no scatter-add into the table (nn.Embed's has one)
  loss = lambda v: jnp.sum(model.apply(v, tokens[:1, :16], seg, pos))
  assert "scatter" not in str(jax.make_jaxpr(jax.grad(loss))(mv))
  embed_loss = lambda v: jnp.sum(embed.apply(v, tokens))
  assert "scatter" in str(jax.make_jaxpr(jax.grad(embed_loss))(ve))


def test_document_window_is_the_longest_document_in_whole_tiles():
  docs = [np.zeros(n) for n in (5, 300, 129)]
  assert train_gpt.document_window(docs, 4096) == 384
  assert train_gpt.document_window(docs, 384) is None          # the whole row: no band
  assert train_gpt.document_window([np.zeros(5000)], 4096) is None
  assert train_gpt.document_window([np.zeros(100)], 4096, multiple=64) == 128


def test_doc_window_is_on_for_the_llama_preset_and_can_be_turned_off():
  """The band was measured on the llama preset (attention 200 -> 61 ms of a
  step, run V): on by default there, off elsewhere, and the flag overrides
  the preset either way."""
  resolved = lambda **kw: train_gpt.Config(**kw).resolved().doc_window
  assert resolved(preset="llama") is True
  assert resolved(preset="h200") is False and resolved(preset="tiny") is False
  assert resolved(preset="llama", doc_window=False) is False
  assert resolved(preset="tiny", doc_window=True) is True
  parser = train_gpt.build_parser()
  assert parser.parse_args([]).doc_window is None                 # the preset decides
  assert parser.parse_args(["--no-doc_window"]).doc_window is False
  assert parser.parse_args(["--doc_window"]).doc_window is True


def test_doc_window_bands_the_model_without_changing_its_loss_or_gradients():
  """--doc_window bands the layers' self attention (the corpus's documents
  are at most 370 characters: a 384-token band of 512-token rows), and the
  loss and every parameter gradient on a packed batch are those of the full
  attention, bit for bit."""
  # One layer: the band is per layer, and compiling is most of the cost.
  cfg = train_gpt.Config(preset="llama_tiny", seq_len=512, batch=1, doc_window=True,
                         layers=1, num_docs=300, out_dir=None, progress=False)
  trainer = train_gpt.Trainer(cfg)
  assert trainer.doc_window == 384 and trainer.model.max_document_length == 384
  tokens, seg, pos = (jnp.asarray(a) for a in train_gpt.make_batch(trainer.docs, 0, 1, 512))
  assert int(train_gpt.packing.documents_per_row(seg).max()) > 1     # a packed row
  full = trainer.model.clone(max_document_length=None)
  v = jax.jit(full.init)(jax.random.key(0), tokens, seg, pos)

  def loss_grad(model):
    def loss(v):
      logits = model.apply(v, tokens, seg, pos)
      return jnp.mean(jnp.square(logits) * (seg != 0)[..., None])
    return jax.jit(jax.value_and_grad(loss))(v)

  for a, b in zip(jax.tree.leaves(loss_grad(trainer.model)), jax.tree.leaves(loss_grad(full))):
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------- first-hour edges ----

import gpt_runs  # pylint: disable=import-error,wrong-import-position


def test_progress_bar_turns_itself_off_when_output_is_not_a_terminal(capsys, monkeypatch):
  assert gpt_runs.progress_bar(5, 0, True) is None        # pytest captures: no terminal
  assert "not a terminal" in capsys.readouterr().out
  pytest.importorskip("tqdm")
  monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
  bar = gpt_runs.progress_bar(5, 0, True)
  assert bar is not None
  bar.close()
  assert gpt_runs.progress_bar(5, 0, False) is None


def test_lr_schedule_note_says_what_the_extra_steps_get():
  cfg = train_gpt.Config(preset="tiny", steps=200, lr_horizon=100).resolved()
  past = gpt_runs.lr_schedule_note(cfg, 100)
  assert "steps 100-199 are past its horizon (100 steps" in past
  assert "lr/10 = 0.0003" in past and "--lr_horizon 200" in past
  both = gpt_runs.lr_schedule_note(cfg, 40)
  assert "steps 40-99 finish its decay" in both and "steps 100-199 run at" in both
  within = gpt_runs.lr_schedule_note(train_gpt.Config(preset="tiny", steps=80,
                                                      lr_horizon=100).resolved(), 40)
  assert within.startswith("LR schedule: steps 40-79 continue its decay (horizon 100")


@pytest.mark.parametrize("field", ["keep_fp8_copies", "store_act_input_in_fp8"])
def test_memory_plan_flags_reach_the_autocast(field):
  """``--keep_fp8_copies`` and ``--store_act_input_in_fp8`` (and their
  ``--no-`` forms) set their Config fields, and the trainer's autocast (what
  its steps trace under) carries them. Without the flag the preset decides:
  on for llama, off for the others. The trainer is not built: its autocast
  reads only its config, recipe and mesh resource."""
  cases = (("tiny", [], False), ("tiny", [f"--{field}"], True),
           ("llama", [], True), ("llama", [f"--no-{field}"], False))
  for preset, flags, want in cases:
    args = gpt_cli.build_parser("x").parse_args(flags)
    assert getattr(args, field) is (None if not flags else not flags[0].startswith("--no-"))
    trainer = train_gpt.Trainer.__new__(train_gpt.Trainer)
    trainer.cfg = train_gpt.Config(preset=preset, **{field: getattr(args, field)}).resolved()
    trainer.recipe, trainer.mesh_resource = train_gpt.make_recipe("delayed"), None
    with trainer.autocast() as ctx:
      assert ctx.enabled and getattr(ctx, field) is want, (preset, flags)


def test_short_runs_report_a_final_loss_of_their_last_steps():
  assert [gpt_runs.final_loss_window(n) for n in (1, 3, 8, 40, 200)] == [1, 1, 2, 10, 10]
  blank = gpt_runs.describe_sample("the cat ", "the cat " + " " * 80, 8)
  assert "80 blank characters" in blank and "after 8 steps" in blank
  assert gpt_runs.describe_sample("the cat ", "the cat sat.", 200) == repr("the cat sat.")


def test_final_loss_is_the_mean_of_the_last_quarter_of_a_short_run(resumed_run):
  whole = resumed_run[1]                   # 6 steps: the last 1
  assert whole["final_loss_steps"] == 1 and whole["final_loss"] == whole["losses"][-1]


_NO_JAX = """
import runpy, sys
sys.argv = ["train_gpt.py"] + sys.argv[1:]
sys.path.insert(0, {examples!r})
try:
  runpy.run_path({script!r}, run_name="__main__")
except SystemExit as e:
  print("EXIT", e.code, "jax" in sys.modules, "flax" in sys.modules)
"""


def _run_without_training(*flags):
  code = _NO_JAX.format(examples=EXAMPLES, script=os.path.join(EXAMPLES, "train_gpt.py"))
  return subprocess.run([sys.executable, "-c", code, *flags], env=_env(),
                        capture_output=True, text=True, timeout=120, check=False)


def test_help_answers_before_jax_loads():
  proc = _run_without_training("--help")
  assert "EXIT 0 False False" in proc.stdout, proc.stdout[-1500:] + proc.stderr[-1500:]
  assert "--offload_optimizer" in proc.stdout and "--resume" in proc.stdout


def test_usage_errors_print_the_error_not_the_usage_of_every_flag():
  proc = _run_without_training("--recipe", "fp4")
  assert "EXIT 2 False False" in proc.stdout, proc.stdout[-1500:] + proc.stderr[-1500:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 2 and lines[0].startswith("usage:") and "--help" in lines[0]
  assert "invalid choice: 'fp4'" in lines[1]


def test_a_batch_that_does_not_fit_the_mesh_is_a_usage_error():
  env = dict(_env(), XLA_FLAGS="--xla_force_host_platform_device_count=8")
  proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "train_gpt.py"), "--preset",
                         "tiny"] + QUIET, env=env, capture_output=True, text=True, timeout=300,
                        check=False)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert "--batch 4 must be divisible by the 8 batch shards" in proc.stderr
  assert "use --batch 8" in proc.stderr


# ------------------------------------------------ the mixture-of-experts presets ----

import gpt_model  # pylint: disable=import-error,wrong-import-position

@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU output")
def test_moe_tiny_trains_with_the_aux_loss_and_logs_dropped_assignments(capsys):
  """A capacity makes drops: the log shows them per step, the loss (which
  includes the aux loss) goes down, the router biases move, and the FLOPs
  count 2 of the 8 experts' kernels."""
  res = train_gpt.main(["--preset", "moe_tiny", "--steps", "6", "--capacity_factor", "0.5",
                        "--log_every", "1"] + QUIET)
  out = capsys.readouterr().out
  losses = res["losses"]
  assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.2
  assert min(res["aux_losses"]) > 0 and min(res["dropped"]) > 0
  lines = [l for l in out.splitlines() if l.startswith("step ")]
  assert len(lines) == 6
  for line, d, aux in zip(lines, res["dropped"], res["aux_losses"]):
    assert f"aux {aux:.4f}  dropped {d}  " in line, line
  assert "8 experts of width 64, 2 per token, a shared expert of width 64" in out
  assert "capacity factor 0.5" in out and "pure-JAX reference" in out
  biases = res["state"].model_state["router_bias"]
  assert set(biases) == {"layer_0", "layer_1"}
  assert all(np.asarray(b["moe"]["bias"]).any() for b in biases.values())
  cfg = train_gpt.Config(preset="moe_tiny").resolved()
  params = res["state"].params["params"]
  expert = sum(int(np.prod(params[l]["moe"][k].shape)) for l in ("layer_0", "layer_1")
               for k in ("wi_kernel", "wo_kernel"))
  n = res["params"] - train_gpt.VOCAB_SIZE * 64 - expert + expert * 2 // 8
  assert res["model_flops_per_token"] == 6 * n + 12 * cfg.layers * cfg.seq_len * cfg.hidden


def test_moe_preset_is_deepseek_style_and_sized_for_one_gpu():
  cfg = train_gpt.Config(preset="moe").resolved()
  assert 32 <= cfg.experts <= 64 and 4 <= cfg.experts_per_token <= 8 and cfg.shared_mlp
  assert cfg.hidden // cfg.heads == 128 and cfg.dtype == "bfloat16"
  moe_cfg = train_gpt.moe_config(cfg)
  assert moe_cfg.score_function == "sigmoid" and moe_cfg.router_bias_update_rate > 0
  assert moe_cfg.capacity_factor is None                 # dropless
  model = train_gpt.GPT(train_gpt.VOCAB_SIZE, cfg.hidden, cfg.layers, cfg.heads, cfg.mlp,
                        dtype=jnp.bfloat16, arch=cfg.arch, kv_groups=cfg.kv_groups,
                        moe=moe_cfg)
  tokens = jnp.zeros((1, 128), jnp.int32)            # shapes only: nothing is allocated
  abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), tokens, tokens, tokens))
  params = nn.meta.unbox(abstract["params"])
  n = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  assert 1.0e9 <= n <= 3.0e9, n
  # AdamW: fp32 parameters, gradients and two moments, 16 bytes each, within 80 GB
  assert 16 * n < 0.5 * 80e9
  assert abstract["router_bias"]["layer_0"]["moe"]["bias"].shape == (cfg.experts,)
  # a token uses 8 of the 64 experts: about a sixth of the parameters
  assert gpt_model.active_params(cfg, params) < n / 4


@pytest.mark.parametrize("flags, msg", [
    (["--preset", "moe_tiny", "--ep", "3"], "--ep 3 must divide --experts 8"),
    (["--preset", "tiny", "--ep", "2"], "--ep 2 needs a mixture of experts"),
    (["--preset", "moe_tiny", "--experts_per_token", "9"], "--experts_per_token 9 must be in"),
    (["--preset", "tiny", "--sp"], "--sp splits each row's 128 tokens over --tp"),
])
def test_moe_flags_that_do_not_fit_are_usage_errors(flags, msg, capsys):
  with pytest.raises(SystemExit) as e:
    train_gpt.main(flags + QUIET)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("usage:") and msg in err


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the check is for CPU-only jax")
def test_moe_preset_on_a_cpu_stops_at_once_and_names_moe_tiny(capsys):
  with pytest.raises(SystemExit) as e:
    train_gpt.main(["--preset", "moe"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--preset moe needs a GPU" in err and "--preset moe_tiny" in err
