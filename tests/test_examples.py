"""The user-facing examples: data pipeline, training, checkpoint resume, recipe comparison.

Tiny sizes only (the whole file is a CI budget item): a 2-layer, hidden-64
GPT on 4 x 128 packed tokens.
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import checkpoint, fp8_state, packing
# examples/ is on sys.path through pytest's pythonpath (pyproject.toml).
import compare_recipes  # pylint: disable=import-error
import train_gpt  # pylint: disable=import-error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


def test_corpus_tokenizer_roundtrip():
  docs = train_gpt.make_corpus(50, seed=3)
  assert len(docs) == 50
  assert all(d.dtype == np.int32 and d.min() >= 1 and d.max() < train_gpt.VOCAB_SIZE
             for d in docs)
  text = "the cat sees 12+30=42.\n"
  assert train_gpt.decode(train_gpt.encode(text)) == text
  again = train_gpt.make_corpus(50, seed=3)
  assert all(np.array_equal(a, b) for a, b in zip(docs, again))


def test_make_batch_is_packed_deterministic_and_aligned():
  docs = train_gpt.make_corpus(300, seed=0)
  t, s, p = train_gpt.make_batch(docs, step=7, rows=6, seq_len=96, block=128, num_shards=2)
  t2, _, _ = train_gpt.make_batch(docs, step=7, rows=6, seq_len=96, block=128, num_shards=2)
  np.testing.assert_array_equal(t, t2)
  rows = t.shape[0]
  assert rows >= 6 and rows % 2 == 0 and (rows // 2) * 96 % 128 == 0
  assert np.all((t == 0) == (s == 0))                 # padding <=> segment 0
  assert (s[:6] > 0).mean() > 0.6                      # rows are well filled
  # Positions restart at every document.
  starts = np.argwhere(p == 0)
  for r, c in starts:
    if s[r, c]:
      assert c == 0 or s[r, c - 1] != s[r, c]
  _, mask = packing.next_token_targets(t, s)
  assert not mask[:, -1].any()
  other = train_gpt.make_batch(docs, step=8, rows=6, seq_len=96)[0]
  assert not np.array_equal(other, t[:other.shape[0]])


def test_checkpoint_numpy_backend_roundtrip_exact(tmp_path):
  tree = {"params": {"w": jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4) / 7},
          fp8_state.FP8_COLLECTION: {"d": fp8_state.init_dense_state(4)},
          "step": jnp.asarray(5, jnp.int32)}
  checkpoint.save(str(tmp_path), 5, tree, backend="numpy")
  checkpoint.save(str(tmp_path), 6, tree, backend="numpy", keep=1)
  assert checkpoint.available_steps(str(tmp_path)) == [6]
  target = jax.tree.map(jnp.zeros_like, tree)
  out = checkpoint.restore(str(tmp_path), target=target)
  for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(out)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  with pytest.raises(FileNotFoundError):
    checkpoint.restore(str(tmp_path), 3, target=target)


def test_resume_gives_bit_identical_next_step_loss(tmp_path):
  """4 uninterrupted steps (checkpoint at 2 and 4) vs a fresh process resuming at 2.

  The resumed process initializes a new state (new random parameters, empty
  FP8 state) and gets everything else from the orbax checkpoint.
  """
  ckpt = str(tmp_path / "ckpt")
  cfg = train_gpt.Config(recipe="delayed", preset="tiny", steps=4, ckpt_dir=ckpt,
                         ckpt_every=2, out_dir=str(tmp_path / "a"), sample_chars=0,
                         eval_batches=0, progress=False)
  full = train_gpt.train(cfg)
  assert full["steps"] == [0, 1, 2, 3]
  assert all(np.isfinite(full["losses"]))
  assert checkpoint.available_steps(ckpt) == [2, 4]
  assert os.path.exists(os.path.join(str(tmp_path / "a"), "metrics.json"))
  # The FP8 delayed-scaling state is part of what was saved, and it has moved.
  restored = checkpoint.restore(ckpt, 2, target=full["state"])
  assert int(restored.step) == 2
  hist = [np.asarray(x) for x in jax.tree.leaves(restored.params[fp8_state.FP8_COLLECTION])]
  assert hist and any(np.any(h[:2] > 0) for h in hist if h.ndim)

  shutil.rmtree(os.path.join(ckpt, "4"))
  out_b = tmp_path / "b"
  proc = subprocess.run(
      [sys.executable, os.path.join(EXAMPLES, "train_gpt.py"), "--preset", "tiny",
       "--recipe", "delayed", "--steps", "4", "--ckpt_dir", ckpt, "--resume",
       "--sample_chars", "2", "--eval_batches", "0", "--no_progress", "--out_dir", str(out_b)],
      env=_env(), capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "resumed from" in proc.stdout and "done: 2 steps" in proc.stdout
  assert "sample:" in proc.stdout
  # Said at the start: what the LR schedule does for the steps to come.
  assert "LR schedule: steps 2-3 continue its decay (horizon 4 steps" in proc.stdout
  resumed = json.loads((out_b / "metrics.json").read_text())
  assert resumed["steps"] == [2, 3] and resumed["start_step"] == 2
  # Exact equality (JSON floats round-trip): same data, parameters, optimizer
  # and FP8 state.
  assert resumed["losses"] == full["losses"][2:], (resumed["losses"], full["losses"])
  # metrics.json (and the plot) cover the whole run: steps 0-1 from the
  # checkpoint's history, 2-3 from this process.
  assert resumed["run_steps"] == [0, 1, 2, 3] and resumed["run_losses"] == full["losses"]
  assert resumed["first_loss"] == full["losses"][0]
  assert "at step 0 ->" in proc.stdout
  assert (out_b / "loss_curve.png").exists() or "matplotlib is not installed" in proc.stdout


def test_compare_recipes_writes_summary(tmp_path, monkeypatch):
  """compare() bookkeeping, with train_gpt.train replaced by canned curves."""
  def fake_train(cfg):
    k = {"none": 1.0, "delayed": 1.01, "blockwise": 1.05}[cfg.recipe]
    losses = list(k * np.linspace(4.0, 1.0, 20))
    return {"losses": losses, "steps": list(range(20)), "step_time_s": 0.01,
            "tokens_per_s": 1e5, "eval_loss": k, "backend": "cpu", "state": None}

  monkeypatch.setattr(train_gpt, "train", fake_train)
  base = train_gpt.Config(preset="tiny", steps=20)
  summary = compare_recipes.compare(["none", "delayed", "blockwise"], base, str(tmp_path))
  by = {r["recipe"]: r for r in summary["results"]}
  assert by["none"]["ratio_vs_bf16"] == 1.0
  assert by["delayed"]["ratio_vs_bf16"] == pytest.approx(1.01)
  assert by["delayed"]["within_tolerance"] and not by["blockwise"]["within_tolerance"]
  md = (tmp_path / "summary.md").read_text()
  assert "| blockwise |" in md and "1.0500" in md
  assert json.loads((tmp_path / "summary.json").read_text())["results"]
  try:
    import matplotlib  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    assert (tmp_path / "loss_curves.png").stat().st_size > 1000
  except ImportError:
    pass


def test_npz_restore_refuses_a_different_dtype(tmp_path):
  """Raw-byte leaves (bfloat16) are never reinterpreted as the target's dtype."""
  from te_jax import checkpoint
  tree = {"w": jnp.arange(8, dtype=jnp.bfloat16)}
  checkpoint.save(str(tmp_path), 1, tree, backend="numpy")
  back = checkpoint.restore(str(tmp_path), 1, target=tree, backend="numpy")
  np.testing.assert_array_equal(np.asarray(back["w"], np.float32), np.arange(8))
  with pytest.raises(ValueError, match="dtype"):
    checkpoint.restore(str(tmp_path), 1, target={"w": jnp.zeros(8, jnp.float16)},
                       backend="numpy")


@pytest.mark.parametrize("backend", ["numpy", "orbax"])
def test_failed_save_keeps_the_existing_step(tmp_path, backend):
  from te_jax import checkpoint
  if backend == "orbax" and not checkpoint.orbax_available():
    pytest.skip("orbax-checkpoint not installed")
  good = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
  checkpoint.save(str(tmp_path), 5, good, backend=backend)

  class Unsaveable:   # a leaf neither backend can write
    def __array__(self, *a, **k):
      raise RuntimeError("cannot convert")

  with pytest.raises(Exception):
    checkpoint.save(str(tmp_path), 5, {"w": Unsaveable()}, backend=backend)
  assert checkpoint.latest_step(str(tmp_path)) == 5
  restored = checkpoint.restore(str(tmp_path), 5, target=good, backend=backend)
  np.testing.assert_array_equal(restored["w"], good["w"])
  # and a successful save replaces it
  checkpoint.save(str(tmp_path), 5, {"w": good["w"] + 1}, backend=backend)
  np.testing.assert_array_equal(
      checkpoint.restore(str(tmp_path), 5, target=good, backend=backend)["w"], good["w"] + 1)
