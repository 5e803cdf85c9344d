"""FP8 MLP core ``act(x @ wi + bi) @ wo + bo`` with the activation fused into quantization.

Two FP8 dense layers with an activation between them, as one custom VJP, so
that the activation output ``z`` is never written in bf16:

* forward: ``h = x @ wi`` (FP8 GEMM, bf16 out); one pass over ``h`` computes
  ``z = act(h)`` and writes ``z`` quantized rowwise for the second GEMM
  (``ops.act_quantize.act_quantize``);
* backward: ``dz = g @ wo.T`` (FP8 GEMM, bf16 out); one pass over ``dz`` and
  ``h`` computes ``dh = dz * act'(h)`` and writes it quantized both ways for
  the dgrad and wgrad GEMMs of ``wi``, and from the same activation values
  ``z`` quantized columnwise, as the forward quantized it, for the weight
  gradient of ``wo`` (``dact_quantize`` with ``act_columnwise``).

Compared with two ``fp8_dense`` calls and an XLA activation this saves a
write and a read of ``z`` (forward) and of ``dh`` (backward) -- each
``tokens x mlp`` bf16 -- and the backward's peak memory holds no bf16 ``dh``.
Residuals: ``h`` in bf16 (the activation's backward needs it, as it does
unfused; in FP8 with ``store_act_input_in_fp8``, see "Memory"), ``x.T`` in FP8
(with a norm: ``x`` itself and its row statistics, which the norm's backward
reads), the amaxes of ``z`` and ``norm(x)`` and the kernels as given. The FP8
``z.T`` and ``norm(x).T`` that the wgrad GEMMs read are made in the backward
from ``h`` (in the activation backward's pass, see above) and from ``x`` and
its statistics (a columnwise-only quantize pass,
``norm_dense.requantize_normalized``) with the forward's scales: the same
bytes. The FP8 kernels are quantized again too, so that no FP8 copy of an
activation that is kept anyway stays alive between the passes
(``save_original_input`` / ``save_original_kernel`` = False write and keep them
instead).

Numerics: ``z`` and ``dh`` are computed in float32 from the bf16 ``h`` and
quantized directly (the unfused path rounds them to bf16 first), so results
differ from the unfused path by that rounding only. With
``store_act_input_in_fp8`` the output is the same bit for bit and the
gradients differ from the default by the rounding of ``h`` to E4M3 in 1x128
tiles (at most 2**-4 of an element relative, for elements within E4M3's
normal range of their tile's max): ``act'(h)`` and, with
``save_original_input``, the ``act(h)`` the wgrad of ``wo`` reads are
computed from the rounded ``h``. Under per-tensor scaling that ``act(h)`` is
quantized with the forward's scale, so a value the rounding lifts above the
forward's amax saturates at the FP8 max.

With ``norm`` (a ``te_jax.norm_dense.NormParams``) the core is the whole
pre-norm block ``act(norm(x) @ wi + bi) @ wo + bo``: the norm is fused into
the quantization of the first GEMM's input and its backward is one kernel
(``te_jax.norm_dense``; ``te_jax.flax.LayerNormMLP`` uses it), so the
normalized input is never written in 16 or 32 bits either.

Memory. The backward's peak holds ``h``, ``g @ wo.T`` (both ``tokens x mlp`` in
bf16), both FP8 copies of ``dh`` and (with ``save_original_input``) the FP8
``z.T`` written beside them at once: one byte per ``tokens x mlp`` element more
than a backward that quantized ``z`` again in a pass of its own, whose ``z.T``
was consumed before ``dh`` existed. ``backward_chunks=n`` runs that half of the
backward (the two dgrad GEMMs and the activation backward between them) on n
row chunks, so only a chunk of ``g @ wo.T`` and of the rowwise ``dh`` is live
at once, each chunk after the last one's dgrad; the forward keeps ``h`` as one
piece per chunk, each freed when its chunk is done. The chunks' columnwise
``dh`` (kept) and dgrads are then concatenated for the wgrad and the norm
backward. The slices of ``h``, the concatenations and the smaller GEMMs cost
step time for memory (``bench_peers.py --backward-chunks``; BENCHMARKS.md).
Results equal the unchunked ones bit for bit in the reference, except float
sums over the tokens (the bias and norm parameter gradients, in another
order); on the GPU the chunks' GEMMs may pick other algorithms.

``store_act_input_in_fp8=True`` keeps ``h`` as DeepSeek-V3 keeps its SwiGLU
inputs: E4M3 with one float32 scale per 1x128 tile along the features
(whatever the recipe), 1 byte per element of ``h`` plus 4 bytes per 128
instead of 2, so that residual is about halved. The forward's activation
pass writes that copy from the ``h`` it reads for ``z``
(``act_quantize(..., h_copy=True)``: the bytes of ``quantize_blockwise``
without a pass of its own over ``h``); the backward's activation pass reads
each row chunk of the E4M3 ``h`` and its scales directly
(``act_quantize.dact_quantize`` takes the ``ScaledTensor``), so no copy of
``h`` in the compute dtype is written (only with a bias on ``wi``, whose
gradient pass dequantizes the chunk).

Shapes are not padded here: :func:`supported` says whether a problem can take
this path (token count a multiple of the recipe's ``token_block``, the other
dims multiples of 128); ``te_jax.flax.LayerNormMLP`` uses the unfused path
otherwise.

>>> import jax.numpy as jnp
>>> from te_jax import fused_mlp, recipe
>>> x = jnp.ones((256, 512), jnp.bfloat16)
>>> wi = jnp.ones((512, 2 * 1024), jnp.bfloat16) * 0.01   # gated: 2 x mlp 1024
>>> wo = jnp.ones((1024, 512), jnp.bfloat16) * 0.01
>>> fused_mlp.fp8_mlp(x, wi, wo, activations=("silu", "linear"),
...                   recipe=recipe.Float8CurrentScaling()).shape
(256, 512)
"""

from __future__ import annotations

import functools
import logging
import numbers
from typing import NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from te_jax import dense as dense_lib
from te_jax import norm_dense
from te_jax import recipe as recipe_lib
from te_jax import remat
from te_jax import scaling
from te_jax.ops import act_quantize as act_op
from te_jax.ops import fp8
from te_jax.ops.fp8 import ScaledTensor

__all__ = ["fp8_mlp", "supported", "why_not_supported", "check_backward_chunks", "chunk_bounds",
           "warn_act_input_not_in_fp8"]


class _MlpConfig(NamedTuple):
  mode: scaling.ScalingMode
  impl: str
  activations: Tuple[str, ...]
  has_bi: bool
  has_bo: bool
  dtype: jnp.dtype                      # GEMM outputs (h, y, and dgrad into a norm)
  norm: Optional[norm_dense.NormSpec]   # a norm fused into the quantization of x
  return_norm_output: bool = False      # also output norm(x) in dtype
  backward_chunks: int = 1              # row chunks of the backward's dgrad half
  save_input: bool = True    # no FP8 copy of act(h) (nor of norm(x)) kept: made again
  save_kernel: bool = True   # no FP8 copies of the kernels kept: quantized again
  store_act_input_in_fp8: bool = False   # h kept as E4M3 in 1x128 tiles, not in dtype
  add_input: bool = False    # y = x + block(x): x is the down-projection's C


@functools.lru_cache(maxsize=None)
def warn_act_input_not_in_fp8(owner: str, reason: str):
  """Warns once per (owner, reason) that ``owner`` keeps its activation's
  input in the compute dtype although the autocast's
  ``store_act_input_in_fp8`` asked for FP8 (a memory saving the user asked
  for and does not get): the MLP layers and the MoE's shared experts."""
  logging.getLogger("te_jax").warning(
      "te_jax: %s keeps its activation's input in the compute dtype, not in FP8 as "
      "fp8_autocast(store_act_input_in_fp8=True) asks: %s", owner, reason)


# h's storage format with store_act_input_in_fp8 (act_op.H_COPY_*; the module doc
# says which), not a GEMM operand, so the same under every recipe. Its
# tile scales are powers of two: an E4M3 value times one is exact in bf16, so the
# dequantized h is the same in float32 and in the compute dtype, and only values
# falling to subnormals (about 2**-15 of the tile's max) move, by one binade.


def _act_input_rows(h, r0: int, r1: int):
  """Rows [r0, r1) of h, or of its FP8 copy (data and tile scales)."""
  return h.rows(r0, r1) if isinstance(h, ScaledTensor) else h[r0:r1]


def _h_pieces(h, cfg) -> tuple:
  """The kept h as one piece per backward chunk, each freed once its chunk is done.
  Made in the forward, behind a barrier (else XLA slices the whole h in the backward)."""
  bounds = chunk_bounds(h.shape[0], cfg.backward_chunks, cfg.mode.token_block)
  return (h,) if len(bounds) == 1 else jax.lax.optimization_barrier(
      tuple(_act_input_rows(h, r0, r1) for r0, r1 in bounds))


def _in_dtype(h_rows, dtype) -> jax.Array:
  """Rows of the kept h as a ``dtype`` array: an FP8 copy dequantized (a
  tile holding a NaN or Inf has a NaN scale, so its rows come back NaN: the
  gradients stay non-finite)."""
  return h_rows.dequantize(dtype) if isinstance(h_rows, ScaledTensor) else h_rows


def check_backward_chunks(chunks, recipe: Optional[recipe_lib.Recipe] = None) -> None:
  """Raises unless ``chunks`` is a valid ``backward_chunks`` (an int >= 1; above
  1 only for a recipe whose quantization of a piece of a tensor is that of
  the whole). ``recipe`` None checks the value alone."""
  if isinstance(chunks, bool) or not isinstance(chunks, numbers.Integral):
    raise TypeError(f"backward_chunks must be an int, got {chunks!r}.")
  if chunks < 1:
    raise ValueError(f"backward_chunks must be >= 1 (1: unsplit), got {chunks}.")
  if chunks > 1 and recipe is not None and recipe.scaling_mode().scales_from_whole_tensor:
    raise ValueError(
        f"backward_chunks={chunks} needs a recipe that quantizes a piece of a tensor "
        f"as it would the whole (DelayedScaling, Float8BlockScaling); "
        f"{type(recipe).__name__} takes each scale from the whole gradient's amax. "
        f"Use backward_chunks=1 with it.")


def why_not_supported(m: int, k: int, f: int, n: int, recipe: recipe_lib.Recipe,
                      activations: Sequence[str]) -> str:
  """Why ``fp8_mlp`` cannot take x (m, k), wi (k, n_act*f), wo (f, n)
  unpadded ('' when it can): the reason the callers that fall back to
  unfused layers log."""
  acts = tuple(activations)
  if not 1 <= len(acts) <= 2 or any(a not in act_op.ACTIVATIONS for a in acts):
    return f"activations {acts}: it takes one or two of {sorted(act_op.ACTIVATIONS)}"
  block = recipe.scaling_mode().token_block
  if m % block or k % 128 or f % 128 or n % 128:
    return (f"{m} tokens, widths {k} -> {f} -> {n}: it needs tokens % {block} == 0 and "
            "every width % 128 == 0")
  return ""


def supported(m: int, k: int, f: int, n: int, recipe: recipe_lib.Recipe,
              activations: Sequence[str]) -> bool:
  """Whether ``fp8_mlp`` takes x (m, k), wi (k, n_act*f), wo (f, n) unpadded
  (:func:`why_not_supported` says why not)."""
  return not why_not_supported(m, k, f, n, recipe, activations)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _mlp(x, gamma, beta, wi, bi, wo, bo, states, cfg):
  y, _ = _mlp_fwd(x, gamma, beta, wi, bi, wo, bo, states, cfg)
  return y


def _mlp_fwd(x, gamma, beta, wi, bi, wo, bo, states, cfg):
  mode, impl = cfg.mode, cfg.impl
  si, so = states
  # With save_input the columnwise copies of norm(x) and z (wgrad operands)
  # are made in the backward: the forward writes the rowwise ones alone.
  cols = not cfg.save_input
  if cfg.norm is None:
    qx = mode.quantize(x, "x", si, impl=impl)
    norm_res = None
  else:   # norm(x), quantized in the pass that reads x
    qx, mean, rstd = norm_dense.quantize_normalized(mode, cfg.norm, x, gamma, beta, si, impl,
                                                    columnwise=cols)
    norm_res = (x, gamma, beta, mean, rstd)
  qwi = mode.quantize(wi, "kernel", si, impl=impl)
  h = mode.gemm("fprop", qx.rowwise(), qwi.columnwise(), out_dtype=cfg.dtype, bias=bi,
                impl=impl)
  # z = act(h) quantized in the pass that reads h: the input of the second GEMM.
  # With store_act_input_in_fp8 the same pass writes h's E4M3 copy, which is
  # what the forward keeps of h for the activation's backward.
  qz = mode.quantize_fused(act_op.act_quantize, "x", so, impl=impl, h=h,
                           activations=cfg.activations, columnwise=cols,
                           h_copy=cfg.store_act_input_in_fp8)
  kept_h = h
  if cfg.store_act_input_in_fp8:
    qz, kept_h = qz
  kept_h = _h_pieces(kept_h, cfg)
  qwo = mode.quantize(wo, "kernel", so, impl=impl)
  y = mode.gemm("fprop", qz.rowwise(), qwo.columnwise(), out_dtype=cfg.dtype, bias=bo,
                impl=impl, residual=x if cfg.add_input else None)
  new = (mode.update_state(si, {"x": qx.amax, "kernel": qwi.amax}),
         mode.update_state(so, {"x": qz.amax, "kernel": qwo.amax}))
  protos = tuple(jnp.zeros((0,), a.dtype) for a in (x, wi, wo))
  if cfg.return_norm_output:   # elementwise from the statistics: no second reduction
    y = (y, norm_dense.normalized(cfg.norm, *norm_res).astype(cfg.dtype))
  # h is kept for the activation's backward (in FP8 with
  # store_act_input_in_fp8), and with a norm x for the norm's: with
  # save_input the FP8 copies of act(h).T and norm(x).T are made from them
  # in the backward instead (with this forward's scales, ``states``, and
  # amaxes, kept in their place); with save_kernel the kernels are
  # quantized again.
  x_t = qx.amax if cfg.save_input and norm_res is not None else qx.columnwise()
  z_t = qz.amax if cfg.save_input else qz.columnwise()
  res = (x_t, wi if cfg.save_kernel else qwi.rowwise(), kept_h, z_t,
         wo if cfg.save_kernel else qwo.rowwise(), states, new, protos, norm_res)
  return y, res


def chunk_bounds(m: int, chunks: int, token_block: int) -> Tuple[Tuple[int, int], ...]:
  """Row ranges [r0, r1) splitting ``m`` tokens into at most ``chunks`` pieces
  as even as whole ``token_block``s allow (fewer where m has fewer blocks)."""
  blocks = m // token_block
  n = max(1, min(chunks, blocks))
  cuts = [token_block * (i * blocks // n) for i in range(n)] + [m]
  return tuple((cuts[i], cuts[i + 1]) for i in range(n))


def _dact_chunks(cfg, qg, qwo, qwi, h_pieces, si, dx_dtype, act_t):
  """dh = (g @ wo.T) * act'(h), quantized, and its dgrad ``dh @ wi.T``, one chunk of
  rows (those of ``h_pieces``, :func:`_h_pieces`) after the other: only a chunk of
  ``g @ wo.T`` and of the rowwise ``dh`` is live at once; with ``act_t`` (an
  ``ActColumnwise``) the same passes write act(h)'s columnwise copy. Returns the dgrad
  (M, K) in ``dx_dtype``, dh's columnwise operand for the wgrad, its amax (None for
  blockwise), wi's bias gradient (or None) and act(h)'s columnwise operand (or None)."""
  mode, impl = cfg.mode, cfg.impl
  dxs, cols, col_scales, amaxes, dbis, zs = [], [], [], [], [], []
  r1 = 0
  for h_rows in h_pieces:   # an FP8 h: dequantized as it is read
    r0, r1 = r1, r1 + h_rows.shape[0]
    g_rows = qg.rowwise().rows(r0, r1)
    if dxs:   # after the last chunk's dgrad, so one rowwise dh is alive (XLA put dgrads last)
      g_rows = jax.lax.optimization_barrier((dxs[-1], g_rows))[1]
    dz = mode.gemm("dgrad", g_rows, qwo, out_dtype=cfg.dtype, impl=impl)
    # dh = dz * act'(h) quantized in the pass that reads dz and h. Delayed
    # scaling quantizes with the state's scale and blockwise per tile, so a
    # chunk's FP8 values are those of the whole tensor (act(h)'s copy too:
    # the forward's scale, or tiles of 128 tokens).
    q = mode.quantize_fused(act_op.dact_quantize, "grad", si, impl=impl, dz=dz, h=h_rows,
                            activations=cfg.activations, act_columnwise=act_t)
    if act_t is not None:
      q, z_cols = q
      zs.append(z_cols)
    dxs.append(mode.gemm("dgrad", q.rowwise(), qwi, out_dtype=dx_dtype, impl=impl))
    cols.append(q.data_t)
    col_scales.append(q.scale_inv_t)
    amaxes.append(q.amax)
    if cfg.has_bi:   # one more pass over dz and h, only when wi has a bias
      dh = act_op.activation_backward(dz, _in_dtype(h_rows, cfg.dtype), cfg.activations)
      dbis.append(jnp.sum(dh.astype(jnp.float32), axis=0))
  z_t = act_op.join_columnwise(zs, impl) if zs else None
  if len(dxs) == 1:
    dbi = None if not dbis else dbis[0].astype(cfg.dtype)
    return dxs[0], q.columnwise(), q.amax, dbi, z_t
  amax = None if q.amax is None else fp8.amax(jnp.stack(amaxes))   # NaN-propagating
  if q.block_shape is None:   # delayed: one scale for every chunk ...
    # ... and any chunk's non-finite amax poisons the whole wgrad operand.
    scale_t = jnp.where(jnp.isfinite(amax), q.scale_inv_t, jnp.float32(jnp.nan))
  else:   # blockwise: tiles of 128 tokens, never across a chunk boundary
    scale_t = jnp.concatenate(col_scales, axis=1)
  col = ScaledTensor(jnp.concatenate(cols, axis=1), scale_t, q.block_shape)
  dbi = None if not dbis else sum(dbis[1:], dbis[0]).astype(cfg.dtype)
  return jnp.concatenate(dxs, axis=0), col, amax, dbi, z_t


def _mlp_bwd(cfg, res, g):
  mode, impl = cfg.mode, cfg.impl
  x_t, qwi, h, z_t, qwo, (si_fwd, so_fwd), (si, so), (x_p, wi_p, wo_p), norm_res = res
  g_norm = None
  if cfg.return_norm_output:
    g, g_norm = g
  # Everything this pass computes again from the kept tensors (the FP8
  # copies, and on the reference path the activation's and the norm's
  # intermediates) reads them through one barrier behind g: see
  # te_jax.dense.after_cotangent.
  qwi, qwo, h, norm_res = dense_lib.after_cotangent(g, qwi, qwo, h, norm_res)
  qg = mode.quantize(g, "grad", so, impl=impl)
  if cfg.save_kernel:   # the forward's quantization, rowwise only: the dgrad operands
    qwi = mode.quantize(qwi, "kernel", si_fwd, impl=impl, columnwise=False).rowwise()
    qwo = mode.quantize(qwo, "kernel", so_fwd, impl=impl, columnwise=False).rowwise()
  # With save_input z_t is the amax of the forward's act(h): act(h) is
  # quantized columnwise as the forward quantized it (its options for role
  # "x" under the forward's state, and that amax) in the dact passes. (With
  # store_act_input_in_fp8 those passes read h rounded to E4M3, so this
  # act(h) is recomputed from the rounded h, as DeepSeek-V3 does.)
  act_t = None
  if cfg.save_input:
    act_t = mode.quantize_fused(act_op.act_columnwise_like, "x", so_fwd, impl=impl, amax=z_t)
  dgamma = dbeta = None
  dx_dtype = x_p.dtype if norm_res is None else cfg.dtype
  dx, qdh_t, dh_amax, dbi, qz_t = _dact_chunks(cfg, qg, qwo, qwi, h, si, dx_dtype, act_t)
  if qz_t is None:   # kept from the forward
    qz_t = z_t
  dwo = mode.gemm("wgrad", qz_t, qg.columnwise(), out_dtype=wo_p.dtype, impl=impl)
  # With add_input, x's second use (the residual connection) has the
  # cotangent g: the norm's backward adds it as it writes dx.
  residual_ct = g if cfg.add_input else None
  if norm_res is not None:   # dx is the gradient of norm(x) (compute dtype, as unfused)
    # Both uses of norm(x), summed in its dtype by the norm's backward.
    dy_add = None if g_norm is None else g_norm.astype(cfg.dtype)
    dx, dgamma, dbeta = norm_dense.norm_grads(cfg.norm, dx, *norm_res, impl, dy_add,
                                              residual_ct)
  elif residual_ct is not None:
    dx = dx + residual_ct
  if cfg.save_input and norm_res is not None:   # norm(x).T as the forward's; x_t its amax
    x_t = norm_dense.requantize_normalized(mode, cfg.norm, *norm_res, x_t, si_fwd, impl)
  dwi = mode.gemm("wgrad", x_t, qdh_t, out_dtype=wi_p.dtype, impl=impl)
  dbo = None
  if cfg.has_bo:
    dbo = jnp.sum(g.astype(jnp.float32), axis=0).astype(g.dtype)
  new_states = (mode.update_state(si, {"grad": dh_amax}),
                mode.update_state(so, {"grad": qg.amax}))
  return dx, dgamma, dbeta, dwi, dbi, dwo, dbo, new_states


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def fp8_mlp(x: jax.Array, wi: jax.Array, wo: jax.Array, bi: Optional[jax.Array] = None,
            bo: Optional[jax.Array] = None, *, activations: Sequence[str],
            recipe: recipe_lib.Recipe, wi_state=None, wo_state=None,
            impl: str = "auto", norm: Optional[norm_dense.NormParams] = None,
            dtype=None, return_norm_output: bool = False, backward_chunks: int = 1,
            save_original_input: bool = True, save_original_kernel: bool = True,
            store_act_input_in_fp8: bool = False, add_input: bool = False):
  """``act(x @ wi + bi) @ wo + bo`` with FP8 GEMMs and fused activation-quantize.

  Args:
    x: (M, K) input (bf16/fp16/fp32); with ``norm``, the input of the norm.
    wi: (K, n_act * F) up-projection (any float dtype: quantized from it,
      its gradient returned in it); for two activations the first F columns
      feed ``activations[0]`` and the next F ``activations[1]`` (the gated
      product ``act0(h0) * act1(h1)``).
    wo: (F, N) down-projection.
    bi: optional (n_act * F,) bias of the up-projection.
    bo: optional (N,) bias of the down-projection.
    activations: one or two names of ``te_jax.ops.act_quantize.ACTIVATIONS``.
    recipe: a te_jax recipe.
    wi_state, wo_state: ``DelayedScaling`` states of the two GEMMs
      (``fp8_state.init_dense_state``); their updates come back as their
      gradients. None for the other recipes.
    impl: "auto", "cuda" or "reference".
    norm: optional ``te_jax.norm_dense.NormParams``: the block computes
      ``act(norm(x) @ wi + bi) @ wo + bo`` with the norm fused into the
      quantization of x (its gamma and beta get gradients). The shapes must
      also pass ``te_jax.norm_dense.supported(M, K, recipe)``.
    dtype: dtype of the output and of the GEMM outputs inside (default
      ``x.dtype``; with ``norm``, the compute dtype when x comes in another).
    return_norm_output: with ``norm``, also return ``norm(x)`` (M, K) in
      ``dtype`` (its gradient goes through the same norm backward).
    backward_chunks: split the backward's ``g @ wo.T``, activation backward
      and dgrad of ``wi`` into this many row chunks (whole ``token_block``s;
      default 1, unsplit) to trade speed for peak memory: see "Memory" above.
      Delayed and blockwise scaling only (current scaling needs the whole
      gradient's amax before any of it is quantized).
    save_original_input: True (default): the forward writes only the
      rowwise FP8 act(h) (and norm(x)); the backward writes act(h)'s
      columnwise copy in the activation backward's pass over h and, with a
      norm, quantizes norm(x) columnwise from x and its statistics (kept
      for the norm's backward anyway), for the two wgrad GEMMs: the same FP8
      values bit for bit, no FP8 copy of either alive between the passes,
      and one more quantize pass over x. False writes and keeps those copies
      (1 byte per element of act(h) and of x). Without a norm, x's FP8 copy
      is kept either way (x itself is not).
    save_original_kernel: True (default): the backward quantizes ``wi`` and
      ``wo`` again for the dgrad GEMMs instead of keeping their FP8 copies:
      no memory when they are parameters (as the Flax modules pass them),
      what the FP8-off dots keep when they are cast copies. False keeps the
      FP8 copies (1 byte per element).
    store_act_input_in_fp8: False (default): the backward reads the
      activation's input h (M, n_act * F) kept in ``dtype``. True: the
      forward keeps h in E4M3 with one float32 scale per 1x128 tile along
      the features (whatever the recipe: a storage format), 1 byte per
      element of h plus 4 bytes per 128 instead of 2 (bf16), and the
      backward's activation pass reads it one row chunk at a time
      (``backward_chunks``) as E4M3 bytes and scales, dequantized to
      ``dtype`` as it computes act'(h) and, with ``save_original_input``,
      act(h) again for the wgrad of ``wo``. The forward's activation pass
      writes that copy; the output is unchanged, the gradients differ from the
      default by the rounding of h to E4M3 in 1x128 tiles. See "Memory".
    add_input: return ``x + block(x)`` (a residual connection; N == K and
      x in ``dtype``): x is the down-projection GEMM's C input, added in
      float32 before the output's one rounding (a separate add would round
      the block's output first), and in the backward the norm's kernel adds
      x's second cotangent as it writes dx (bit for bit the separate add).
      Saves the two passes over (M, K) that XLA's adds would take, which it
      cannot fuse into these custom calls.

  Returns:
    (M, N) in ``dtype``, or ``(y, norm(x))`` with ``return_norm_output``.

  Raises:
    ValueError: shapes that :func:`supported` rejects, or inconsistent ones;
      ``backward_chunks`` below 1, or above 1 under current scaling.
    TypeError: ``backward_chunks`` not an int; ``store_act_input_in_fp8``
      not a bool.
  """
  acts = tuple(activations)
  mode = dense_lib.scaling_mode_of(recipe)
  check_backward_chunks(backward_chunks, recipe)
  for name, flag in (("store_act_input_in_fp8", store_act_input_in_fp8),
                     ("add_input", add_input)):
    if not isinstance(flag, bool):
      raise TypeError(f"{name} must be a bool, got {flag!r}.")
  if x.ndim != 2 or wi.ndim != 2 or wo.ndim != 2:
    raise ValueError(f"x, wi, wo must be 2-D, got {x.shape}, {wi.shape}, {wo.shape}.")
  (m, k), (f, n) = x.shape, wo.shape
  if wi.shape != (k, len(acts) * f):
    raise ValueError(f"wi must have shape (K, n_act * F) = ({k}, {len(acts) * f}) for "
                     f"x {x.shape}, wo {wo.shape} and {len(acts)} activation(s); got "
                     f"{wi.shape}.")
  if bi is not None and bi.shape != (len(acts) * f,):
    raise ValueError(f"bi must have shape ({len(acts) * f},), got {bi.shape}.")
  if bo is not None and bo.shape != (n,):
    raise ValueError(f"bo must have shape ({n},), got {bo.shape}.")
  if not supported(m, k, f, n, recipe, acts):
    raise ValueError(
        f"fp8_mlp takes M % {mode.token_block} == 0 and K, F, N % 128 == 0 with "
        f"activations from {sorted(act_op.ACTIVATIONS)}; got M={m}, K={k}, F={f}, "
        f"N={n}, activations={acts}. Use two te_jax.dense.fp8_dense calls instead.")
  spec = gamma = beta = None
  if return_norm_output and norm is None:
    raise ValueError("return_norm_output=True needs a norm.")
  if norm is not None:
    spec = norm_dense.norm_spec(norm.norm_type, norm.epsilon, norm.zero_centered_gamma)
    gamma, beta = norm.gamma, norm.beta
    if not norm_dense.supported(m, k, recipe):
      raise ValueError(f"fp8_mlp with a norm needs te_jax.norm_dense.supported(M={m}, "
                       f"K={k}), i.e. also K <= {norm_dense.MAX_HIDDEN}.")
  if (wi_state is None) != (wo_state is None):
    raise ValueError("wi_state and wo_state must both be given or both be None.")
  try:
    mode.check_state(wi_state)
  except ValueError as e:  # the states of the two GEMMs: say which arguments
    raise ValueError(f"wi_state and wo_state: {e}") from None
  out_dtype = jnp.dtype(x.dtype if dtype is None else dtype)
  if add_input and (n != k or x.dtype != out_dtype):
    raise ValueError(f"add_input=True returns x + block(x): it needs N == K and x in the "
                     f"output dtype; got x {x.shape} {x.dtype}, N={n}, dtype "
                     f"{out_dtype.name}. Add the residual after the call instead.")
  cfg = _MlpConfig(mode, impl, acts, bi is not None, bo is not None, out_dtype, spec,
                   bool(return_norm_output), int(backward_chunks), bool(save_original_input),
                   bool(save_original_kernel), store_act_input_in_fp8, add_input)
  cast = lambda b: None if b is None else b.astype(out_dtype)
  # The weights are quantized in their own dtype (float32 parameters: one
  # pass, no convert to x.dtype first); their gradients come back in it.
  out = _mlp(x, gamma, beta, wi, cast(bi), wo, cast(bo), (wi_state, wo_state), cfg)
  if return_norm_output:   # the block output is named for te_jax.remat's policies
    return remat.tag_fp8_gemm(out[0]), out[1]
  return remat.tag_fp8_gemm(out)
