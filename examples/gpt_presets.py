"""The presets of the GPT examples: model sizes and training defaults by name.

Pure Python (no jax import), so that ``train_gpt.py --help`` and its usage
errors answer before jax loads. ``gpt_model.py`` re-exports every name.
"""

RECIPES = ("none", "delayed", "current", "blockwise")

PRESETS = {
    # 0.4M parameters; about 70 s on two CPU cores (200 steps at ~0.2 s).
    "cpu": dict(hidden=128, layers=2, heads=4, mlp=512, seq_len=128, batch=16,
                steps=200, lr=3e-3, warmup=30, dtype="float32", num_docs=4000),
    # ~340M parameters, bf16 compute, 32k tokens per step: an H200 workload
    # (~0.28 s/step). 12M characters of corpus, so 300 steps are < 1 epoch.
    "h200": dict(hidden=1536, layers=12, heads=12, mlp=6144, seq_len=2048, batch=16,
                 steps=1000, lr=6e-4, warmup=100, dtype="bfloat16", num_docs=100000),
    # Tiny, for tests and notebooks.
    "tiny": dict(hidden=64, layers=2, heads=2, mlp=128, seq_len=128, batch=4,
                 steps=8, lr=3e-3, warmup=2, dtype="float32", num_docs=1000),
}

ARCHS = ("gpt", "llama")

# Llama-style presets (arch "llama": RMSNorm, SwiGLU, rotary, grouped-query
# attention, no biases). Kept apart from PRESETS because train_gpt_nnx.py
# takes PRESETS and builds only the GPT architecture; --preset here takes
# ALL_PRESETS.
LLAMA_PRESETS = {
    # 1.13B parameters for one H200 with AdamW; head_dim 128 (cuDNN flash). Per layer: attention
    # 2 x 2048^2 (Q, out) + 2 x 2048 x 1024 (K, V: 8 groups of head_dim 128)
    # = 12.6M, SwiGLU 3 x 2048 x 5632 = 34.6M (5632 = 8/3 x 2048 rounded up
    # to a multiple of 256, as Llama does); 24 layers = 1.13B. The
    # character vocabulary (64) makes the embedding and LM head 0.26M, so
    # the parameters are all in the layers.
    # Memory (estimate, to be measured on the H200): fp32 parameters,
    # gradients and AdamW's two moments are 16 B/param = 18 GB. Saved
    # activations without --remat are roughly 70 kB per token and layer in
    # bf16/FP8 (x, normed x, Q/K/V before and after rotary, attention out,
    # the 2 x 5632 gate/up outputs and their product), 1.7 MB per token for
    # 24 layers: 8 x 4096 tokens = 57 GB; about 80-95 GB with the attention
    # masks below and temporaries, inside 141 GB. 16 rows (~115 GB of
    # activations) would not fit without --remat. 32k tokens per step, as
    # --preset h200.
    # Attention: rows of 4096 characters hold ~34 documents (up to ~106 in
    # the last row first-fit-decreasing packing fills), more than
    # TransformerLayer's default 8 of the packed cuDNN layout, so it runs
    # cuDNN under the (B, 1, S, S) segment mask: 8 x 4096^2 bf16 = 0.27 GB
    # per layer, 6.4 GB if all 24 are kept for the backward. Raising
    # max_segments_per_seq instead costs jax's cuDNN backward scratch
    # B x max_segments rows of S tokens (~260 MiB per unit for the h200
    # preset's rows) and was slower than the masked path for many short
    # documents (docs/benchmarks-log-2026-11.md, 2026-12-01). --doc_window
    # (train_gpt.py, on by default here) bands the masked path to the
    # longest document instead (370 characters: a 384-token band, about a
    # fifth of the causal triangle's logits). Measured on the H200
    # (2026-12-03, run V in docs/benchmarks-log-2026-12.md): attention
    # 200 -> 61 ms of a delayed-scaling step, the step 472 -> 334 ms.
    # 100k documents = 12M characters: 1000 steps see it ~2.7 times
    # (each step draws documents at random).
    "llama": dict(arch="llama", hidden=2048, layers=24, heads=16, kv_groups=8, mlp=5632,
                  seq_len=4096, batch=8, steps=1000, lr=3e-4, warmup=100,
                  dtype="bfloat16", num_docs=100000, doc_window=True,
                  # Together the two hold about what the library's plan holds and
                  # skip the backward's second quantize passes; the preset's FP8
                  # figures in BENCHMARKS.md are measured with both.
                  keep_fp8_copies=True, store_act_input_in_fp8=True),
    # The same architecture at test size (a few seconds on a CPU): 4 query
    # heads share 2 key/value heads; mlp = 3 x 64, as 8/3 x hidden rounded up.
    "llama_tiny": dict(arch="llama", hidden=64, layers=2, heads=4, kv_groups=2, mlp=192,
                       seq_len=128, batch=4, steps=8, lr=3e-3, warmup=2,
                       dtype="float32", num_docs=1000),
}
# Mixture-of-experts presets (DeepSeek-V3 / Qwen3-MoE style): the Llama-style
# layers with a mixture of experts in place of each MLP (TransformerLayer's
# mlp_type="moe"): many narrow SwiGLU experts (width ``mlp``), each token routed
# to ``experts_per_token`` of them, plus one shared expert every token goes
# through (width ``shared_mlp``); sigmoid router scores, normalized top-k
# weights, DeepSeek-V3's bias-based balancing and a small load-balancing loss
# (gpt_model.moe_config). The experts shard over --ep devices.
MOE_PRESETS = {
    # 1.71B parameters, 0.30B active per token, for one 80 GB H100 with AdamW.
    # Per layer: attention 3.1M (Q and out 1024^2 each; K and V 1024 x 512: 4
    # groups of head_dim 128), 64 experts of 3 x 1024 x 512 = 1.57M each
    # (100.7M), one shared expert 3 x 1024^2 = 3.1M, the router 1024 x 64;
    # 16 layers = 1.71B; a token uses 8 experts: 18.9M per layer, 0.30B.
    # Memory: fp32 parameters and AdamW's moments 12 B/param (the step's
    # arguments, 19 GiB), plus what the backward keeps of 8 x 2048 tokens'
    # 131k expert assignments per layer (BENCHMARKS.md: the compiled step).
    "moe": dict(arch="llama", hidden=1024, layers=16, heads=8, kv_groups=4, mlp=512,
                experts=64, experts_per_token=8, shared_mlp=1024, seq_len=2048, batch=8,
                steps=500, lr=3e-4, warmup=50, dtype="bfloat16", num_docs=100000,
                doc_window=True),
    # The same at test size (seconds per step on a CPU): 8 experts, 2 per token.
    "moe_tiny": dict(arch="llama", hidden=64, layers=2, heads=4, kv_groups=2, mlp=64,
                     experts=8, experts_per_token=2, shared_mlp=64, seq_len=128, batch=4,
                     steps=8, lr=3e-3, warmup=2, dtype="float32", num_docs=1000),
}
ALL_PRESETS = {**PRESETS, **LLAMA_PRESETS, **MOE_PRESETS}

# Presets sized for a GPU: refused at start where jax sees only the CPU
# (unless --force), with what they need.
GPU_PRESETS = {
    "h200": "it is sized for one H200 (340M parameters, 16 x 2048 tokens per step; on a "
            "CPU it runs out of memory asking for ~186 GB)",
    "llama": "it is sized for one H200 (1.13B parameters, 8 x 4096 tokens per step, "
             "an estimated 80-95 GB of GPU memory with AdamW)",
    "moe": "it is sized for one 80 GB H100 (1.71B parameters in 64 experts per layer, "
           "8 x 2048 tokens per step, about 42 GiB of GPU memory with AdamW as compiled "
           "for an H100, 37 GiB in FP8)",
}
