"""Input checks of MultiHeadAttention and TransformerLayer (issue 23, items 8 and 9).

Bad input ranks and segment id / position shapes must raise at trace time,
naming the argument, the shape it got and the shape it needs. Everything is
traced with ``jax.eval_shape`` (nothing is computed).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import flax as tfx

B, S, E, H = 2, 16, 32, 4
S_KV, E_KV = 7, 24
MLP = 64
KEY = jax.random.key(0)


def spec(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def ids(shape, dtype=jnp.int32):
  return spec(shape, dtype)


def trace(module, *args, **kwargs):
  return jax.eval_shape(module.init, KEY, *args, **kwargs)


def expect(exc, message):
  return pytest.raises(exc, match=re.escape(message))


X = spec((B, S, E))
ENC = spec((B, S_KV, E_KV))
BAD_IDS = [(B, 1), (B, S - 1), (B, S + 1), (B,), (B, S, 1), (1, S), (S,)]
BAD_KV_IDS = [(B, 1), (B, S_KV - 1), (B, S), (B,), (B, S_KV, 1), (1, S_KV)]
BAD_INPUTS = [(E,), (S, E), (B, 1, S, E)]


# ---- item 8: inputs that are not (batch, seq, hidden) ----

@pytest.mark.parametrize("shape", BAD_INPUTS, ids=str)
def test_attention_rejects_inputs_q_not_3d(shape):
  with expect(ValueError, f"inputs_q must have shape (batch, seq, hidden), got {shape}"):
    trace(tfx.MultiHeadAttention(H), spec(shape))


@pytest.mark.parametrize("shape", [(E_KV,), (S_KV, E_KV), (B, 1, S_KV, E_KV)], ids=str)
def test_attention_rejects_inputs_kv_not_3d(shape):
  with expect(ValueError, f"inputs_kv must have shape (batch, seq, hidden), got {shape}"):
    trace(tfx.MultiHeadAttention(H), X, spec(shape))


@pytest.mark.parametrize("shape", BAD_INPUTS, ids=str)
def test_transformer_rejects_inputs_not_3d(shape):
  with expect(ValueError, f"inputs must have shape (batch, seq, hidden), got {shape}"):
    trace(tfx.TransformerLayer(E, MLP, H), spec(shape))


@pytest.mark.parametrize("shape", [(E_KV,), (S_KV, E_KV), (B, 1, S_KV, E_KV)], ids=str)
def test_transformer_rejects_encoded_not_3d(shape):
  with expect(ValueError, f"encoded must have shape (batch, seq, hidden), got {shape}"):
    trace(tfx.TransformerLayer(E, MLP, H, layer_type="decoder"), X, spec(shape))


# ---- item 9: segment ids / positions that are not (batch, seq) ----

def _need(name, want, like, got):
  return f"{name} must have shape (batch, seq) = {want} matching {like}, got {got}"


@pytest.mark.parametrize("name", ["segment_ids", "segment_positions"])
@pytest.mark.parametrize("shape", BAD_IDS, ids=str)
def test_attention_rejects_query_ids_of_wrong_shape(name, shape):
  m = tfx.MultiHeadAttention(H, enable_rotary_pos_emb=True, attention_impl="xla")
  with expect(ValueError, _need(name, (B, S), "inputs_q", shape)):
    trace(m, X, **{name: ids(shape)})


@pytest.mark.parametrize("name", ["kv_segment_ids", "kv_segment_positions"])
@pytest.mark.parametrize("shape", BAD_KV_IDS, ids=str)
def test_attention_rejects_kv_ids_of_wrong_shape(name, shape):
  m = tfx.MultiHeadAttention(H, enable_rotary_pos_emb=True, attention_impl="xla")
  kwargs = {"segment_ids": ids((B, S)), "kv_segment_ids": ids((B, S_KV))}
  kwargs[name] = ids(shape)
  with expect(ValueError, _need(name, (B, S_KV), "inputs_kv", shape)):
    trace(m, X, ENC, **kwargs)


@pytest.mark.parametrize("shape", [(B, 1), (B, S - 1), (B, S, 1)], ids=str)
def test_attention_self_kv_ids_checked_against_inputs_q(shape):
  m = tfx.MultiHeadAttention(H, attention_impl="xla")
  with expect(ValueError, _need("kv_segment_ids", (B, S), "inputs_q", shape)):
    trace(m, X, segment_ids=ids((B, S)), kv_segment_ids=ids(shape))


@pytest.mark.parametrize("name", ["segment_ids", "segment_positions", "kv_segment_ids"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bool_])
def test_attention_rejects_non_integer_ids(name, dtype):
  m = tfx.MultiHeadAttention(H, enable_rotary_pos_emb=True, attention_impl="xla")
  kwargs = {"segment_ids": ids((B, S))} if name == "kv_segment_ids" else {}
  kwargs[name] = ids((B, S), dtype)
  with expect(TypeError, f"{name} must have an integer dtype, got {np.dtype(dtype).name}"):
    trace(m, X, **kwargs)


@pytest.mark.parametrize("name", ["segment_ids", "segment_positions"])
@pytest.mark.parametrize("shape", BAD_IDS, ids=str)
def test_transformer_rejects_ids_of_wrong_shape(name, shape):
  layer = tfx.TransformerLayer(E, MLP, H, enable_rotary_pos_emb=True, attention_impl="xla")
  with expect(ValueError, _need(name, (B, S), "inputs", shape)):
    trace(layer, X, **{name: ids(shape)})


@pytest.mark.parametrize("shape", BAD_KV_IDS, ids=str)
def test_transformer_rejects_encoder_ids_of_wrong_shape(shape):
  layer = tfx.TransformerLayer(E, MLP, H, layer_type="decoder", attention_impl="xla")
  with expect(ValueError, _need("encoder_segment_ids", (B, S_KV), "encoded", shape)):
    trace(layer, X, ENC, segment_ids=ids((B, S)), encoder_segment_ids=ids(shape))


@pytest.mark.parametrize("name", ["segment_ids", "segment_positions", "encoder_segment_ids"])
def test_transformer_rejects_float_ids(name):
  layer = tfx.TransformerLayer(E, MLP, H, layer_type="decoder", enable_rotary_pos_emb=True,
                               attention_impl="xla")
  kwargs = {"segment_ids": ids((B, S)), "encoder_segment_ids": ids((B, S_KV))}
  kwargs[name] = ids(kwargs.get(name, ids((B, S))).shape, jnp.float32)
  with expect(TypeError, f"{name} must have an integer dtype, got float32"):
    trace(layer, X, ENC, **kwargs)


# ---- what is right still traces ----

@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int64, jnp.uint8])
def test_well_formed_inputs_trace(dtype):
  m = tfx.MultiHeadAttention(H, enable_rotary_pos_emb=True, attention_impl="xla")
  out = trace(m, X, segment_ids=ids((B, S), dtype), segment_positions=ids((B, S), dtype))
  assert out["params"]
  trace(m, X, ENC, segment_ids=ids((B, S)), kv_segment_ids=ids((B, S_KV), dtype),
        kv_segment_positions=ids((B, S_KV)))
  layer = tfx.TransformerLayer(E, MLP, H, layer_type="decoder", enable_rotary_pos_emb=True,
                               attention_impl="xla")
  trace(layer, X, ENC, segment_ids=ids((B, S), dtype), segment_positions=ids((B, S)),
        encoder_segment_ids=ids((B, S_KV), dtype))
  # concrete numpy / jax arrays as well as abstract ones
  seg = np.ones((B, S), np.int32)
  trace(m, jnp.zeros((B, S, E)), segment_ids=seg, segment_positions=jnp.asarray(seg))
