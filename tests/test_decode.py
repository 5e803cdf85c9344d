"""KV-cache decoding (``decode=True``) of the Linen MultiHeadAttention and
TransformerLayer: step-by-step decoding equals the full causal forward.

Compiling is most of the time here, so variables and full forwards are
computed once per module configuration (``_init``, ``_full``) and shared."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import fp8_state
from te_jax import flax as tfx
from te_jax.layers import attention as attn_lib

from flax_cases import RECIPES, rel

B, S, E, H, D = 2, 8, 32, 4, 8
# Chunkings of the S = 8 positions: one token per call, a prefill then single
# tokens, and uneven chunks (the last call shorter).
CHUNKS = {"1x8": (1,) * 8, "5+1+1+1": (5, 1, 1, 1), "3+3+2": (3, 3, 2)}
# FP8 off in float32: the decode and the full forward differ only in the
# order of float32 sums (a softmax over L cache slots with masked zeros vs a
# causal one), ~1e-7 relative.
FLOAT_TOL = 1e-5


@pytest.fixture(autouse=True)
def _float32_matmuls():
  """float32 dots at full precision (TF32 on a GPU would blur the 1e-5 identities)."""
  with jax.default_matmul_precision("float32"):
    yield


def rand(key, shape):
  return jnp.asarray(np.random.default_rng(key).standard_normal(shape), jnp.float32)


def mha(**kw):
  kw.setdefault("attention_impl", "xla")
  return tfx.MultiHeadAttention(H, **kw)


def layer(**kw):
  kw.setdefault("attention_impl", "xla")
  return tfx.TransformerLayer(hidden_size=E, mlp_hidden_size=64, num_attention_heads=H,
                              layer_type="decoder", **kw)


def init_decode(module, x):
  """Variables of ``module.clone(decode=True)`` initialized on the full-length x."""
  return nn.unbox(jax.jit(module.clone(decode=True).init)(jax.random.key(1), x))


def full_forward(module, variables, x):
  """The ordinary (cache-free) forward with the same parameters."""
  rest = {k: v for k, v in variables.items() if k != "cache"}
  return jax.jit(module.clone(decode=False).apply)(rest, x)


# Shared across tests: (module factory, frozen kwargs) -> variables / outputs.
# The variables of FP8_LAYER are initialized under DelayedScaling, so they
# hold the FP8 state that recipe needs (scales set to 16, as a few training
# steps would leave them, instead of init's 1); the other recipes and FP8 off
# ignore that state.
X = rand(4, (B, S, E))
FP8_LAYER = dict(num_gqa_groups=2, enable_rotary_pos_emb=True)


def _key(factory, kw):
  return factory, tuple(sorted(kw.items()))


@functools.lru_cache(maxsize=None)
def _init(key):
  factory, kw = key
  if dict(kw) != FP8_LAYER:
    return init_decode(factory(**dict(kw)), X)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=RECIPES["delayed"]()):
    return _with_scales(init_decode(factory(**dict(kw)), X), 16.0)


@functools.lru_cache(maxsize=None)
def _full(key, recipe_name, length=S):
  factory, kw = key
  recipe = RECIPES[recipe_name]() if recipe_name != "none" else None
  with te_jax.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
    return full_forward(factory(**dict(kw)), _init(key), X[:, :length])


def shared(factory, recipe_name="none", **kw):
  """(module, variables, full forward of X) for ``factory(**kw)`` under the recipe."""
  key = _key(factory, kw)
  return factory(**kw), _init(key), _full(key, recipe_name)


_STEPS = {}


def decode(module, variables, x, chunks, *, fresh=False):
  """Feeds x to ``module.clone(decode=True)`` in calls of ``chunks`` tokens;
  returns the concatenated outputs, the final cache and the collections each
  call returned.

  The jitted step is shared by calls with the same module and autocast (the
  recipe is read at trace time, so the autocast is part of the key);
  ``fresh`` traces a new one, kept nowhere (a test that patches the library)."""
  dec = module.clone(decode=True)
  key = (repr(dec), repr(te_jax.autocast.get_fp8_context()))
  step = None if fresh else _STEPS.get(key)
  if step is None:
    step = jax.jit(lambda v, xc: dec.apply(v, xc, mutable=["cache"]))
    if not fresh:
      _STEPS[key] = step
  rest = {k: v for k, v in variables.items() if k != "cache"}
  cache, outs, start = variables["cache"], [], 0
  for n in chunks:
    y, mut = step({**rest, "cache": cache}, x[:, start:start + n])
    cache, start = mut["cache"], start + n
    outs.append(y)
  return jnp.concatenate(outs, axis=1), cache, sorted(mut)


# ------------------------------------------------------------ FP8 off -----

# (rotary, GQA) for each chunking: MHA with the fused Q/K/V kernel and no
# rotary, and grouped-query attention (separate query / kv kernels) with rotary.
MHA_CASES = [(False, H, "1x8"), (True, 2, "1x8"), (True, 2, "5+1+1+1"), (True, 2, "3+3+2")]


@pytest.mark.parametrize("rotary,groups,chunks", MHA_CASES)
def test_mha_decode_equals_full_causal_forward(rotary, groups, chunks):
  m, v, full = shared(mha, num_gqa_groups=groups, enable_rotary_pos_emb=rotary)
  got, cache, _ = decode(m, v, X, CHUNKS[chunks])
  assert rel(got, full) < FLOAT_TOL
  assert int(cache["cache_index"]) == S


def test_transformer_decode_equals_full_causal_forward():
  m, v, full = shared(layer, **FP8_LAYER)    # GQA, rotary; FP8 state unused
  got, cache, _ = decode(m, v, X, CHUNKS["5+1+1+1"])
  assert rel(got, full) < FLOAT_TOL
  assert int(cache["self_attention"]["cache_index"]) == S


def test_rotary_offset_is_what_the_equality_checks(monkeypatch):
  """Rotary positions that restart at 0 in every call (instead of following
  cache_index) must break the equality above: the test can fail."""
  m, v, full = shared(mha, num_gqa_groups=2, enable_rotary_pos_emb=True)
  rotate = attn_lib.apply_rotary
  monkeypatch.setattr(attn_lib, "apply_rotary",
                      lambda y, positions, base=10000.0: rotate(
                          y, positions - positions[:, :1], base))
  got, _, _ = decode(m, v, X, CHUNKS["1x8"], fresh=True)
  assert rel(got[:, :1], full[:, :1]) < FLOAT_TOL   # position 0 is unaffected
  assert rel(got, full) > 100 * FLOAT_TOL


def test_no_mask_decode_sees_every_filled_position():
  """attn_mask_type="no_mask": a first call of 4 tokens is the bidirectional
  forward of those 4 alone (the 4 empty slots are masked)."""
  kw = dict(attn_mask_type="no_mask", enable_rotary_pos_emb=True)
  m = mha(**kw)
  got4, _, _ = decode(m, _init(_key(mha, kw)), X, (4,))
  assert rel(got4, _full(_key(mha, kw), "none", 4)) < FLOAT_TOL


# ------------------------------------------------------------ FP8 on ------

def _with_scales(variables, value):
  """The variables with every delayed-scaling scale set to ``value``."""
  if fp8_state.FP8_COLLECTION not in variables:
    return variables
  fp8 = jax.tree_util.tree_map_with_path(
      lambda p, a: jnp.full_like(a, value) if p[-1].key == "scale" else a,
      variables[fp8_state.FP8_COLLECTION])
  return {**variables, fp8_state.FP8_COLLECTION: fp8}


# Why these tolerances. Delayed scaling quantizes every tensor with its
# stored scale, and blockwise scaling quantizes activations in 1x128 tiles of
# one token each: either way a token gets the same FP8 codes whether it comes
# alone or in the full sequence, so decode == full up to float32 rounding
# (plus the odd code flipped by a 1e-7 difference upstream): 1e-3.
# Current scaling takes one scale from the amax of the whole tensor, which
# differs between one token and the sequence: both runs carry independent
# FP8 rounding noise of the size FP8 adds against FP8 off, so their
# difference is bounded by twice that error (sqrt(2) expected).
SAME_CODES_TOL = 1e-3


def fp8_decode_error(factory, recipe_name, chunks, impl="reference"):
  """(rel error of FP8 decode vs the FP8 full forward, rel error of that
  forward vs FP8 off, the collections a decode call returned)."""
  m, v, full_off = shared(factory, **FP8_LAYER)
  full = _full(_key(factory, FP8_LAYER), recipe_name)
  m = m.clone(impl=impl)
  with te_jax.fp8_autocast(enabled=True, fp8_recipe=RECIPES[recipe_name]()):
    if impl != "reference":
      full = full_forward(m, v, X)
    got, _, returned = decode(m, v, X, CHUNKS[chunks])
  return rel(got, full), rel(full, full_off), returned


# One chunking per recipe, to keep compiles few: single tokens, and for
# blockwise (whose every call pads to a 128-token tile) a prefill first. TransformerLayer holds a MultiHeadAttention; the attention alone
# for one recipe.
FP8_CASES = [(layer, "delayed", "1x8"), (layer, "current", "1x8"),
             (layer, "block", "5+1+1+1"), (mha, "current", "1x8")]


@pytest.mark.parametrize("factory,recipe_name,chunks", FP8_CASES,
                         ids=["layer-delayed", "layer-current", "layer-block", "mha-current"])
def test_fp8_decode_equals_full_forward(factory, recipe_name, chunks):
  err, fp8_err, returned = fp8_decode_error(factory, recipe_name, chunks)
  # Decoding needs only the cache mutable: the FP8 state stays as it was.
  assert returned == ["cache"]
  assert fp8_err > 1e-3          # FP8 really ran
  assert err < (2 * fp8_err if recipe_name == "current" else SAME_CODES_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks", ["1x8", "5+1+1+1"])
def test_gpu_fp8_transformer_decode_equals_full_forward(chunks):
  """CUDA FP8 ops (blockwise: every 1-token call pads to a 128-token tile)."""
  err, fp8_err, returned = fp8_decode_error(layer, "block", chunks, impl="cuda")
  assert returned == ["cache"]
  assert fp8_err > 1e-3
  assert err < SAME_CODES_TOL


# ------------------------------------------------------------ the cache ---

def test_cache_shapes_and_dtype():
  m = mha(num_gqa_groups=2, dtype=jnp.bfloat16, decode=True)
  cache = jax.eval_shape(m.init, jax.random.key(0), X)["cache"]    # traced only
  assert cache["cached_key"].shape == cache["cached_value"].shape == (B, S, 2, D)
  assert cache["cached_key"].dtype == cache["cached_value"].dtype == jnp.bfloat16
  assert cache["cache_index"].shape == () and cache["cache_index"].dtype == jnp.int32


def test_cache_fills_from_the_index():
  m, v, _ = shared(mha, num_gqa_groups=2, enable_rotary_pos_emb=True)
  assert int(v["cache"]["cache_index"]) == 0 and not jnp.any(v["cache"]["cached_key"])
  _, cache, _ = decode(m, v, X, (5,))
  assert int(cache["cache_index"]) == 5
  assert jnp.all(cache["cached_key"][:, 5:] == 0) and jnp.all(cache["cached_key"][:, :5] != 0)


def test_transformer_cache_is_self_attention_only():
  """With cross attention (encoded) only the self attention keeps a cache."""
  enc = rand(7, (B, 5, E))
  m = layer(decode=True)
  v = jax.eval_shape(m.init, jax.random.key(0), X, enc)
  assert list(v["cache"]) == ["self_attention"]
  y, mut = jax.eval_shape(lambda v, x: m.apply(v, x, enc, mutable=["cache"]),
                          {"params": v["params"], "cache": v["cache"]}, X[:, :2])
  assert y.shape == (B, 2, E) and list(mut) == ["cache"]


def test_past_max_length_outputs_nan():
  """The documented rule: positions >= L come out NaN, earlier ones do not."""
  m, v, _ = shared(mha, num_gqa_groups=2, enable_rotary_pos_emb=True)
  got, cache, _ = decode(m, v, jnp.concatenate([X, X[:, :2]], axis=1), (5, 1, 1, 1, 1, 1))
  assert int(cache["cache_index"]) == S + 2
  assert not jnp.any(jnp.isnan(got[:, :S]))
  assert jnp.all(jnp.isnan(got[:, S:]))


def test_call_running_past_max_length_is_nan_at_every_position():
  """Issue 44 item 10: a call that straddles the end (index 5, 5 tokens, L = 8)
  had its write clamped back over slots 3 and 4, and its positions 5..7
  came out finite but wrong. Every position of such a call is NaN, and so is
  every later call (the index has run past L)."""
  m, v, full = shared(mha, num_gqa_groups=2, enable_rotary_pos_emb=True)
  x = jnp.concatenate([X, X[:, :3]], axis=1)                 # 11 tokens
  got, cache, _ = decode(m, v, x, (5, 5, 1))
  assert rel(got[:, :5], full[:, :5]) < FLOAT_TOL
  assert bool(jnp.all(jnp.isnan(got[:, 5:])))               # positions 5..10
  assert int(cache["cache_index"]) == 11


# ------------------------------------------------------------ errors ------

GQA_ROTARY = dict(num_gqa_groups=2, enable_rotary_pos_emb=True)


def _mha_variables():
  """The module and variables (cache allocated) of a shared configuration."""
  return mha(**GQA_ROTARY), _init(_key(mha, GQA_ROTARY))


def test_decode_without_cache_is_a_clear_error():
  m, v = _mha_variables()
  with pytest.raises(ValueError, match="needs a 'cache' collection"):
    m.clone(decode=True).apply({"params": v["params"]}, X[:, :1])


def test_decode_with_immutable_cache_is_a_clear_error():
  m, v = _mha_variables()
  with pytest.raises(ValueError, match=r"pass mutable=\['cache'\]"):
    m.clone(decode=True).apply(v, X[:, :1])


@pytest.mark.parametrize("bad,match", [
    ((B, S + 1, E), "does not fit the cache of max_length 8"),
    ((B + 1, 1, E), "batch size and head layout"),
])
def test_decode_call_that_does_not_fit_the_cache(bad, match):
  m, v = _mha_variables()
  with pytest.raises(ValueError, match=match):
    m.clone(decode=True).apply(v, rand(12, bad), mutable=["cache"])


def test_decode_in_another_dtype_is_a_clear_error():
  m, v = _mha_variables()
  with pytest.raises(ValueError, match="cache holds float32 keys"):
    m.clone(decode=True, dtype=jnp.bfloat16).apply(v, X[:, :1], mutable=["cache"])


@pytest.mark.parametrize("arg", ["segment_ids", "segment_positions"])
@pytest.mark.parametrize("factory", [mha, layer], ids=["mha", "layer"])
def test_segments_with_decode_are_a_clear_error(factory, arg):
  with pytest.raises(ValueError, match=f"{arg} is not supported with decode=True"):
    factory(decode=True).init(jax.random.key(0), X, **{arg: jnp.ones((B, S), jnp.int32)})


def test_cross_attention_with_decode_is_a_clear_error():
  with pytest.raises(ValueError, match="inputs_kv must be None"):
    mha(decode=True).init(jax.random.key(0), X, X)


# ------------------------------------------------------------ the example --

def test_gpt_sampling_matches_recomputed_greedy_decoding():
  """examples/gpt_sampling.py (train_gpt --sample_tokens): the cached greedy
  tokens are those of re-running the full causal forward for every token."""
  import gpt_sampling  # examples/ is on sys.path (pyproject's pytest pythonpath)
  import train_gpt
  model = train_gpt.GPT(train_gpt.VOCAB_SIZE, hidden=32, layers=1, heads=2, mlp=64,
                        dtype=jnp.float32)
  prompt, n = np.array([[5, 9, 14, 3, 7]], np.int32), 6
  variables = jax.jit(model.init)(jax.random.key(0), jnp.asarray(prompt), None, None)
  tokens, stats = gpt_sampling.generate(model, variables, prompt, n, token_range=(1, 40))
  assert tokens.shape == (1, n) and stats["decode_tokens_per_s"] > 0

  logits_of = jax.jit(lambda t: model.apply(variables, t, None, None))
  buf = np.zeros((1, prompt.shape[1] + n), np.int32)   # one shape: one compile
  buf[:, :prompt.shape[1]] = prompt
  for i in range(n):
    last = prompt.shape[1] + i - 1
    buf[0, last + 1] = int(jnp.argmax(logits_of(jnp.asarray(buf))[0, last, 1:40])) + 1
  np.testing.assert_array_equal(tokens, buf[:, prompt.shape[1]:])


def test_one_token_apply_without_a_cache_is_a_clear_error():
  """Issue 44 item 10: a decode step given variables without their cache,
  with mutable=["cache"], silently allocated a cache of max_length 1."""
  m, v = _mha_variables()
  with pytest.raises(ValueError, match="max_length 1") as info:
    m.clone(decode=True).apply({"params": v["params"]}, X[:, :1], mutable=["cache"])
  assert "full length" in str(info.value)
  # Allocating with apply on the full-length input stays possible.
  _, mut = jax.eval_shape(lambda p: m.clone(decode=True).apply(
      {"params": p}, X, mutable=["cache"]), v["params"])
  assert mut["cache"]["cached_key"].shape == (B, S, 2, D)


@pytest.mark.parametrize("where", ["constructor", "call"])
def test_nnx_decode_is_refused_naming_the_linen_module(where):
  """Issue 44 item 10: the NNX modules rejected decode= with a bare TypeError."""
  from flax import nnx
  from te_jax import nnx as tnx
  for cls, args, linen in [(tnx.MultiHeadAttention, (H, E), "te_jax.flax.MultiHeadAttention"),
                           (tnx.TransformerLayer, (E, 64, H), "te_jax.flax.TransformerLayer")]:
    with pytest.raises(ValueError, match="decode=True.*not supported") as info:
      if where == "constructor":
        cls(*args, decode=True, rngs=nnx.Rngs(0))
      else:
        cls(*args, rngs=nnx.Rngs(0))(X, decode=True)
    assert linen in str(info.value) and "linen_variables" in str(info.value)
  tnx.MultiHeadAttention(H, E, decode=False, rngs=nnx.Rngs(0))(X, decode=False)
