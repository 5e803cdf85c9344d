// FP8 quantize kernels (plain CUDA, no XLA headers). See quantize.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace te_jax {

enum class InType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };
enum class Fp8Type : int { kE4M3 = 0, kE5M2 = 1 };

// Elementwise prologue of the tile kernel: what is quantized.
//   kNone:   x itself.
//   kAct:    v = act0(h0) (not gated) or act0(h0) * act1(h1) (gated), (M, F).
//   kDAct:   v = dz * act0'(h0) (not gated) or, gated, the (M, 2F)
//            concatenation [dz * act0'(h0) * act1(h1), dz * act0(h0) * act1'(h1)].
//   kConcat: v = [parts[0] | parts[1] | ...], (M, sum of the widths F_i),
//            from n_parts separate (M, F_i) tensors: the gradients of a fused
//            projection's outputs (Q, K, V; of grouped-query attention, K and
//            V narrower than Q), quantized without being concatenated first.
//   kNorm:   v = ((h - mean) * rstd) * gamma' + beta (layernorm) or
//            (h * rstd) * gamma' (rmsnorm: mean == nullptr), (M, F), with
//            gamma' = gamma or 1 + gamma (zero_centered) and the per-row
//            statistics mean, rstd computed beforehand (kernels/normalization.cu).
// h is (M, n_act*F) with h0 = h[:, :F], h1 = h[:, F:] (the layout of a fused
// up-projection); dz is (M, F). Activations: kernels/activation.h.
enum class Prologue : int { kNone = 0, kAct = 1, kDAct = 2, kConcat = 3, kNorm = 4 };
constexpr int kMaxConcatParts = 4;

// Activation ids (device code: kernels/activation.h), shared with
// te_jax/ops/act_quantize_cuda.py (_ACT_IDS), which sends "swish" as kActSilu.
// Runtime values, not template parameters: one kernel serves every
// activation (a switch that is uniform across the block costs a few
// instructions per element, nothing next to the memory traffic).
enum ActId : int {
  kActLinear = 0,
  kActGelu = 1,       // tanh approximation (flax nn.gelu(approximate=True))
  kActGeluExact = 2,  // 0.5 x erfc(-x / sqrt 2)
  kActRelu = 3,
  kActSilu = 4,       // x sigmoid(x), also "swish"
  kActSigmoid = 5,
  kActTanh = 6,
  kActQuickGelu = 7,  // x sigmoid(1.702 x)
  kNumAct = 8,
  kActAny = -2,       // device code only: "the runtime id", see prologue.h
};

// How scales are chosen; each CUDA block handles one 128x128 tile of x.
// The values are the GEMM mode ids of te_jax/ops/tiling.py's layouts
// (tests/test_tiling.py checks them).
enum class ScaleMode : int {
  kTensor = 0,    // one scale for the whole tensor (given or from amax_in)
  kVec128 = 1,    // 1x128 rowwise tiles (+ 128x1 tiles for the columnwise copy)
  kBlock128 = 2,  // 128x128 blocks (the columnwise copy reuses the scale)
};

struct QuantizeArgs {
  const void* x = nullptr;  // (M, K) row-major; unused with a prologue
  int64_t M = 0, K = 0;     // shape of the quantized tensor (x, or v of the prologue)
  InType in = InType::kBF16;
  Fp8Type out = Fp8Type::kE4M3;
  ScaleMode mode = ScaleMode::kTensor;
  bool pow2 = false;             // blockwise, or kTensor with amax_in: round scales down to 2^n
  uint8_t* data = nullptr;       // (M, K) FP8
  uint8_t* data_t = nullptr;     // (K, M) FP8, or null for no columnwise copy
  // kTensor: exactly one of `scale` (given) or `amax_in` (current scaling:
  // scale computed on device) is set.
  const float* scale = nullptr;
  const float* amax_in = nullptr;
  float* amax_out = nullptr;     // kTensor: atomicMax target (zeroed by caller)
  float* scale_inv = nullptr;    // kTensor: 1/scale written by block 0 (optional)
  // Blockwise scale_inv in the layouts cuBLASLt reads (see quantize.cu).
  float* sinv = nullptr;
  float* sinv_t = nullptr;
  int64_t sinv_ld = 0, sinv_t_ld = 0;
};

// Inputs of the prologue. A separate kernel parameter rather than more
// QuantizeArgs fields: growing QuantizeArgs alone made ptxas spill in the
// existing 16-bit 1x128 kernels (seen with nvcc 13.0), which sit at their
// 80-register cap.
struct PrologueArgs {
  Prologue kind = Prologue::kNone;
  const void* h = nullptr;   // (M, n_act*F), element type QuantizeArgs::in
  const void* dz = nullptr;  // (M, F), same type; kDAct only
  int64_t F = 0;
  int act0 = 0, act1 = -1;   // ActId (activation.h); act1 < 0: not gated
  // kConcat only: the parts, part i (M, F_i) of element type
  // QuantizeArgs::in (F is unused: part_end below gives the widths).
  const void* parts[kMaxConcatParts] = {};
  int n_parts = 0;
  // kNorm only (h is x (M, F), F the normalized dim): per-row statistics
  // (M,) (mean null for rmsnorm), gamma (F,) and beta (F,) or null, all
  // float32; zero_centered != 0: the scale is 1 + gamma. Appended after the
  // other fields, which keep their offsets.
  const float* mean = nullptr;
  const float* rstd = nullptr;
  const float* gamma = nullptr;
  const float* beta = nullptr;
  int zero_centered = 0;
  // kConcat only: part i holds columns [part_end[i - 1], part_end[i]) of v
  // (part_end[-1] = 0), so F_i = part_end[i] - part_end[i - 1], its row
  // stride; part_end[n_parts - 1] == K. Every F_i > 0 and F_i % 8 == 0, so
  // that a thread's 8 columns lie in one part. Column ends rather than
  // widths: the kernel finds a column's part by comparing against them.
  int64_t part_end[kMaxConcatParts] = {};
};

// A stack of E independent (M, K) problems stored back to back, as a batch
// of expert weights is: x and data (E, M, K), data_t (E, K, M), the
// per-tensor scale / amax_in / amax_out / scale_inv one float per entry (E,),
// the blockwise native scale grids (E, rows, ld) (one entry's native grid
// each, the layout LaunchQuantize writes for one (M, K) tensor). A separate
// kernel parameter, not QuantizeArgs fields, for the reason PrologueArgs is.
struct StackArgs {
  int64_t E = 0;              // entries (grid.z; at most kMaxStackEntries)
  int64_t sinv_stride = 0;    // floats from one entry's sinv to the next's
  int64_t sinv_t_stride = 0;  // the same for sinv_t
};
constexpr int64_t kMaxStackEntries = 65535;  // CUDA's grid.z limit

// Launches the tiled quantize (+ transpose) kernel on `stream`. With a
// prologue only ScaleMode kTensor and kVec128 exist, with the columnwise copy
// (data_t set), gated units need F % 8 == 0 and kConcat every F_i % 8 == 0
// (PrologueArgs::part_end); anything else returns cudaErrorInvalidValue.
cudaError_t LaunchQuantize(const QuantizeArgs& args, cudaStream_t stream,
                           const PrologueArgs& pro = PrologueArgs());

// The prologue part of LaunchQuantize (kernels/act_quantize.cu), which calls
// it after its grid check and amax_out zeroing.
cudaError_t LaunchActQuantize(const QuantizeArgs& args, const PrologueArgs& pro,
                              cudaStream_t stream);

// amax_out = max|v| over the (args.M, args.K) tensor v of the prologue `pro`
// (NaN-propagating), exactly the values LaunchQuantize(args, stream, pro)
// quantizes; zeroes it first. The first pass of current scaling.
cudaError_t LaunchPrologueAmax(const QuantizeArgs& args, const PrologueArgs& pro,
                               float* amax_out, cudaStream_t stream);

// amax_out = max(|x|) over n elements (NaN-propagating); zeroes it first.
cudaError_t LaunchAmax(const void* x, int64_t n, InType in, float* amax_out,
                       cudaStream_t stream);

// Quantizes every entry of the stack `s` exactly as LaunchQuantize(a) would
// quantize that entry alone (no prologue), in one launch of the tile kernel
// (grid.z = entry). `a` describes entry 0: its pointers address the start of
// the (E, ...) arrays, M and K are one entry's shape. kTensor: one scale
// (`scale`, or from `amax_in`) per entry, `amax_out` (E,) zeroed first by
// one memset, `scale_inv` (E,) optional. E, M or K of 0 launches nothing
// (amax_out is still zeroed when E > 0).
cudaError_t LaunchQuantizeStack(const QuantizeArgs& a, const StackArgs& s, cudaStream_t stream);

// amax_out[e] = max(|x[e]|) over the n elements of each of the E entries of
// x (E, n) (NaN-propagating), in one launch (grid.y = entry); zeroes
// amax_out (E,) first. The first pass of current scaling over a stack.
cudaError_t LaunchAmaxStack(const void* x, int64_t n, int64_t E, InType in, float* amax_out,
                            cudaStream_t stream);

}  // namespace te_jax
