"""Greedy sampling with the key/value cache of ``decode=True`` (te_jax Linen).

``train_gpt.py --sample_tokens N`` calls :func:`sample_with_cache` after
training: it prefills a prompt from the validation documents in one call,
then decodes N - 1 more tokens one at a time inside one jitted ``lax.scan``,
and prints the text and the decode throughput.

The model is any Linen module called as ``model(tokens, None, None)`` ->
logits (B, S, vocab) that has a ``decode`` attribute reaching its
``te_jax.flax.TransformerLayer`` blocks (train_gpt's ``GPT``). The cache
follows Flax's convention (``te_jax.flax.kv_cache``): allocated by a call on
the full-length input with ``mutable=["cache"]``, then each call appends its
tokens. With FP8, the recipe is read when the functions are traced, so call
these inside the training's ``fp8_autocast``; the delayed-scaling state is
used as trained and not changed.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import te_jax

__all__ = ["allocate_cache", "generate", "sample_with_cache"]


def _apply(model, variables, cache, tokens):
  """(logits (B, n, vocab), new cache) of one decode call on ``tokens`` (B, n)."""
  logits, mut = model.apply({**variables, "cache": cache}, tokens, None, None,
                            mutable=["cache"])
  return logits, mut["cache"]


def allocate_cache(model, variables, batch: int, max_len: int):
  """The zero cache of ``model`` (decode=True) for ``batch`` rows of up to
  ``max_len`` tokens, from the shapes of an allocating call (traced only)."""
  tokens = jax.ShapeDtypeStruct((batch, max_len), jnp.int32)
  shapes = jax.eval_shape(
      lambda v, t: model.apply(v, t, None, None, mutable=["cache"])[1]["cache"],
      variables, tokens)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def generate(model, variables, prompt, num_tokens: int, *,
             token_range: Optional[Tuple[int, int]] = None):
  """Greedy continuation of ``prompt`` by ``num_tokens`` tokens with the cache.

  Args:
    model: the module (its ``decode`` attribute is set here; ``remat`` too,
      to False, where it has one: nothing is differentiated).
    variables: its variables without a cache (parameters, FP8 state).
    prompt: (B, P) int token ids, P >= 1.
    num_tokens: tokens to generate, >= 1.
    token_range: (lo, hi): only ids lo..hi-1 are picked (None: all).

  Returns:
    ``(tokens, stats)``: (B, num_tokens) numpy ids, and a dict of
    ``prefill_s``, ``decode_s`` (wall time of the prefill call and of the
    decode loop, compilation excluded) and ``decode_tokens_per_s``
    (B * (num_tokens - 1) / decode_s; NaN when num_tokens is 1).
  """
  if num_tokens < 1:
    raise ValueError(f"num_tokens must be >= 1, got {num_tokens}.")
  prompt = jnp.asarray(prompt, jnp.int32)
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"prompt must be (batch, length >= 1) ids, got shape {prompt.shape}.")
  changes = {"decode": True}
  if hasattr(model, "remat"):
    changes["remat"] = False
  dec = model.clone(**changes)
  b, p = prompt.shape
  cache = allocate_cache(dec, variables, b, p + num_tokens)

  def pick(logits):                                   # (B, vocab) -> (B,)
    lo, hi = token_range or (0, logits.shape[-1])
    return jnp.argmax(logits[:, lo:hi], axis=-1).astype(jnp.int32) + lo

  def prefill(v, cache, tokens):
    logits, cache = _apply(dec, v, cache, tokens)
    return pick(logits[:, -1]), cache

  def decode_loop(v, cache, first):
    def body(carry, _):
      tok, cache = carry
      logits, cache = _apply(dec, v, cache, tok[:, None])
      nxt = pick(logits[:, -1])
      return (nxt, cache), nxt
    _, rest = lax.scan(body, (first, cache), None, length=num_tokens - 1)
    return rest.T                                     # (B, num_tokens - 1)

  # Compile first, so the timings below are the runs alone.
  prefill_c = jax.jit(prefill).lower(variables, cache, prompt).compile()
  first_shape = jax.ShapeDtypeStruct((b,), jnp.int32)
  loop_c = jax.jit(decode_loop).lower(variables, cache, first_shape).compile()
  t0 = time.perf_counter()
  first, cache = prefill_c(variables, cache, prompt)
  first.block_until_ready()
  t1 = time.perf_counter()
  rest = loop_c(variables, cache, first)
  rest.block_until_ready()
  t2 = time.perf_counter()
  tokens = np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1)
  decode_s = t2 - t1
  rate = b * (num_tokens - 1) / decode_s if num_tokens > 1 else float("nan")
  return tokens, {"prefill_s": t1 - t0, "decode_s": decode_s, "decode_tokens_per_s": rate}


def sample_with_cache(trainer, state, num_tokens: int, *, to_text: Callable,
                      token_range: Optional[Tuple[int, int]] = None,
                      max_prompt: int = 48) -> dict:
  """Samples ``num_tokens`` after a prompt from ``trainer``'s validation data
  and prints the text and the decode tokens/s.

  The prompt is the first half (at most ``max_prompt`` tokens, at least 1) of
  the first validation document (``trainer.eval_docs[0]``). Every process
  calls this (the parameters are gathered with ``trainer.host_params``) and
  decodes on its own default device, under ``trainer.recipe``.

  Returns:
    A JSON-ready dict: ``prompt``, ``text`` (the continuation), and the
    timings of :func:`generate`.
  """
  doc = np.asarray(trainer.eval_docs[0])
  prompt = doc[:max(1, min(len(doc) // 2, max_prompt))][None]
  gather = getattr(trainer, "host_params", None)      # multi-host aware where present
  variables = gather(state) if gather is not None else jax.device_get(state.params)
  # One device, whole parameters: the recipe without the training's mesh resource.
  with te_jax.fp8_autocast(enabled=trainer.recipe is not None, fp8_recipe=trainer.recipe):
    tokens, stats = generate(trainer.model, variables, prompt, num_tokens,
                             token_range=token_range)
  out = {"prompt": to_text(prompt[0]), "text": to_text(tokens[0]), **stats}
  print(f"kv-cache sample ({num_tokens} tokens, prefill {prompt.shape[1]}): "
        f"{out['prompt']!r} -> {out['text']!r}")
  print(f"kv-cache decode: {stats['decode_tokens_per_s']:,.1f} tokens/s "
        f"(batch 1, {stats['decode_s'] * 1e3:.1f} ms for {num_tokens - 1} steps; "
        f"prefill {stats['prefill_s'] * 1e3:.1f} ms)")
  return out
