"""examples/train_gpt.py as a user meets it: resume, usage errors, --help, the README quickstart.

CPU only, tiny preset, a few steps (the whole file is a CI budget item,
about a minute: three short training runs, the quickstart's five steps).
"""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import pytest

from te_jax import checkpoint

# examples/ is on sys.path through pytest's pythonpath (pyproject.toml).
import compare_recipes  # pylint: disable=import-error
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
                    "--recipe", "current"] + QUIET)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--hidden: 64 in the checkpoint, 32 now" in err
  assert "--recipe: 'delayed' in the checkpoint, 'current' now" in err
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
@pytest.mark.parametrize("script", [train_gpt, compare_recipes], ids=lambda m: m.__name__)
def test_h200_preset_on_a_cpu_stops_at_once(script, capsys):
  with pytest.raises(SystemExit) as e:
    script.main(["--preset", "h200"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--preset h200 needs a GPU" in err and "--force" in err


def _help_blocks(text: str) -> dict:
  """{option: its help text} from the "options:" section of argparse's --help output."""
  blocks, current = {}, None
  section = text.split("\noptions:\n", 1)[1].split("\n\n", 1)[0]
  for line in section.splitlines():
    m = re.match(r"^  (-\w|--\w+)", line)
    if m:
      current = re.findall(r"--\w+", line)[0] if "--" in line else m.group(1)
      blocks[current] = line
    elif line.startswith("    ") and current:
      blocks[current] += " " + line.strip()
    else:
      current = None
  return blocks


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
    assert {"--lr_horizon", "--force", "--ckpt_dir", "--resume", "--steps"} <= flags
  for flag, text in blocks.items():
    if flag != "--help":
      assert "(default:" in text, f"{flag} shows no default: {text!r}"
  assert "--preset" in blocks and "cpu 128, h200 1536, tiny 64" in blocks["--hidden"]


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
