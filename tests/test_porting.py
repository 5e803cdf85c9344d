"""docs/porting.md: its checkpoint-conversion code runs and its checks hold
(each te_jax module, FP8 off, gives the Flax module's output from converted
parameters)."""

import pathlib
import re

import jax.numpy as jnp
import pytest

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "porting.md"


def _python_blocks():
  return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def ns():
  blocks = _python_blocks()
  assert blocks, "docs/porting.md lost its conversion code"
  out = {}
  exec(compile("\n".join(blocks), str(DOC), "exec"), out)   # asserts inside
  return out


def test_porting_guide_conversions_match_flax(ns):
  # The checks ran to the end: the last module checked is the attention.
  assert "te_attn" in ns and ns["y"].shape == (2, 16, 64)


def test_attention_conversion_is_not_trivially_equal(ns):
  """The check can fail: a wrong stacking order (value first) breaks it."""
  p = ns["flax_attn"].init(ns["key"], ns["x"])["params"]
  good = ns["attention_params"](p)
  bad = dict(good, qkv={"kernel": good["qkv"]["kernel"][:, ::-1],
                        "bias": good["qkv"]["bias"][::-1]})
  want = ns["flax_attn"].apply({"params": p}, ns["x"])
  y_bad = ns["te_attn"].apply({"params": bad}, ns["x"])
  assert not jnp.allclose(y_bad, want, atol=1e-3)
