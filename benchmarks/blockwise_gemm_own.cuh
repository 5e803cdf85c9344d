// te_jax's own sm_90a blockwise FP8 GEMM (issue 46): DeepSeek-style scaling,
// a (M, K) e4m3 scaled per 1x128 along K, b (N, K) e4m3 scaled per 128x128,
// out (M, N) bf16 = a @ b^T, fp32 promotion of the tensor cores' partial sums
// once per 128 of K. Layouts are te_jax's (custom_calls/kernels/gemm_sm90.cuh):
//   a_sinv: VEC128     (K/128, a_ld) floats, a_ld >= M, rows contiguous;
//   b_sinv: BLK128x128 (ceil(N/128), b_ld) floats, b_ld >= K/128 (fprop,
//           dgrad), or (kBVec, wgrad) VEC128 as a's: (K/128, b_ld), b_ld >= N.
//
// Why our own: CUTLASS's blockwise collective and cuBLASLt both run a
// 128x128 tile with the two math warpgroups in lockstep, so the promotion
// (FFMAs after a wgmma wait) leaves the tensor cores idle; per-tensor FP8 is
// ~25% faster on the same card. This kernel (design facts from DeepGEMM's
// README, no code from it):
// - persistent: one 384-thread CTA per SM walks tiles (grouped raster);
// - warp-specialized: warpgroup 0 = one TMA producer thread (40 registers),
//   warpgroups 1-2 = math (232 registers), 64 rows of the 128-row tile each;
// - a kStages-deep smem ring of (A 128x128, B BNx128) stages, 128B-swizzled
//   by TMA, guarded by a full (TMA bytes) and an empty (math warps) mbarrier;
// - per 128-K block each math warpgroup issues 4 wgmma m64nBNk32 into a
//   scratch accumulator, waits, and promotes: fin += sa[row]*sb[col] * acc;
// - kDoubleAcc: two scratch accumulators; k-block kb+1's wgmmas are issued
//   before kb's promotion, so the tensor cores run during the FFMAs (needs
//   3 x BN/2 registers: BN <= 128);
// - BN up to 192 (not only 128) to cut smem traffic per FLOP; a BN that is
//   not a multiple of 128 spans two b-scale blocks, picked per 8 columns;
// - kCluster 2: two CTAs on adjacent M tiles of the same N tile; each loads
//   half of B and TMA-multicasts it to both (halves B's L2->SM traffic).
// Scale factors, two ways (kScaleTma): TMA copies each k-block's scales into
// the stage beside its tiles (a's 128 row scales, b's two block scales), so
// the math threads read them from shared memory once the stage is full; or
// (the first design) the math threads read them from global memory
// (L2-resident, a few KB), one k-block ahead of their use.
// Epilogue, two ways (kTmaStore): each math thread stores its bf16 pairs
// straight to global memory, the warpgroup waiting for nothing but leaving
// the next tile's first wgmmas behind its stores; or it writes them into a
// 128B-swizzled smem tile (bank-conflict free for the accumulator's
// fragment layout) that one thread hands to TMA stores of 64 x 64 boxes,
// and the warpgroup goes on to the next tile while the stores drain.
// Diagnostic configurations (kDiag != kNone) time one part of the design and
// compute no correct GEMM: kNoPromote accumulates all of K in one fp32
// accumulator (per-tensor FP8's loop: the ceiling of this pipeline, tiles
// and epilogue without the promotion); kNoLoad loads nothing (the producer
// only arrives on the full barriers, the tiles hold a fixed pseudo-random
// FP8 pattern, the scales are 1): the math warps' ceiling, wgmma and
// promotion without waiting for data.
//
// Every mbarrier wait is bounded (TE_JAX_OWN_WAIT_TRAP tries, ~1 s): a
// pipeline bug traps with a message instead of hanging the GPU.
#pragma once

#include <cuda.h>  // CUtensorMap (types only; the encoder is fetched at run time)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>

#ifndef TE_JAX_OWN_WAIT_TRAP
#define TE_JAX_OWN_WAIT_TRAP (1u << 26)
#endif

namespace te_jax {
namespace own {

struct GemmArgs {
  long m = 0, n = 0, k = 0;
  const uint8_t* a = nullptr;  // (m, k) e4m3, row-major
  const uint8_t* b = nullptr;  // (n, k) e4m3, row-major
  const float* a_sinv = nullptr;
  int a_ld = 0;
  const float* b_sinv = nullptr;
  int b_ld = 0;
  __nv_bfloat16* out = nullptr;  // (m, n) row-major
  int group = 8;                 // raster: N tiles per group (L2 reuse of A and B)
  bool b_vec = false;            // b_sinv is VEC128 (wgrad), else BLK128x128
};

namespace ptx {

__device__ __forceinline__ uint32_t Smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(Smem(bar)), "r"(count));
}
__device__ __forceinline__ void MbarExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(Smem(bar)),
               "r"(bytes) : "memory");
}
__device__ __forceinline__ void MbarArrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(Smem(bar)) : "memory");
}
// Arrive on the barrier at the same smem offset in CTA `cta` of the cluster.
__device__ __forceinline__ void MbarArriveRemote(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n\t.reg .b32 ra;\n\t"
      "mapa.shared::cluster.u32 ra, %0, %1;\n\t"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n\t}" ::"r"(Smem(bar)),
      "r"(cta) : "memory");
}
// Waits for the phase of parity `parity` to complete; traps after
// TE_JAX_OWN_WAIT_TRAP failed tries (a legitimate wait lasts microseconds),
// so a pipeline bug fails the launch instead of hanging the GPU. No printf
// here: any function call in the kernel makes ptxas serialize every wgmma
// (C7510); the harness names the configuration that faulted.
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  const uint32_t addr = Smem(bar);
  for (uint32_t tries = 0;; ++tries) {
    uint32_t done;
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done) : "r"(addr), "r"(parity) : "memory");
    if (done) return;
    if (tries == TE_JAX_OWN_WAIT_TRAP) asm volatile("trap;");
  }
}
__device__ __forceinline__ void FenceBarrierInit() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ uint32_t ClusterRank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
               "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void TmaLoad(const CUtensorMap* map, uint64_t* bar, void* dst, int c0,
                                        int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(Smem(dst)), "l"(map), "r"(Smem(bar)), "r"(c0), "r"(c1)
      : "memory");
}
// The box lands at the same smem offset, and signals the barrier at the same
// offset, in every CTA of `mask`.
__device__ __forceinline__ void TmaLoadMulticast(const CUtensorMap* map, uint64_t* bar, void* dst,
                                                 int c0, int c1, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(Smem(dst)), "l"(map),
      "r"(Smem(bar)), "r"(c0), "r"(c1), "h"(mask) : "memory");
}
// TMA store of a box from smem (bulk-group completion, no mbarrier).
__device__ __forceinline__ void TmaStore(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(map),
      "r"(Smem(src)), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void BulkCommit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Every committed bulk store has read its smem (the buffer may be rewritten).
__device__ __forceinline__ void BulkWaitRead() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
// Every committed bulk store is complete (before the CTA exits).
__device__ __forceinline__ void BulkWaitAll() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Generic-proxy smem writes made visible to the async proxy (TMA).
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Named barrier `kId` of `kThreads` threads (id 0 is __syncthreads').
template <int kId, int kThreads>
__device__ __forceinline__ void NamedBarrier() {
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of `r` across the wgmma
// issue/wait asm statements (it cannot see that wgmma writes them late).
template <int N>
__device__ __forceinline__ void FenceRegs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
// wgmma descriptor of a K-major operand tile in smem written by TMA with
// 128B swizzle: rows of 128 bytes, 8-row groups 1024 bytes apart (SBO), the
// tile 1024-byte aligned; LBO unused for this layout.
__device__ __forceinline__ uint64_t Desc(const void* p) {
  return uint64_t((Smem(p) >> 4) & 0x3FFF) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

}  // namespace ptx

// wgmma m64 x BN x k32, e4m3 x e4m3 -> f32, both operands from smem.
template <int BN> struct MmaAtom;
#define TE_JAX_OWN_ATOM(N) \
  template <> struct MmaAtom<N> { using T = cute::SM90::GMMA::MMA_64x##N##x32_F32E4M3E4M3_SS_TN<>; };
TE_JAX_OWN_ATOM(96)
TE_JAX_OWN_ATOM(112)
TE_JAX_OWN_ATOM(128)
TE_JAX_OWN_ATOM(144)
TE_JAX_OWN_ATOM(160)
TE_JAX_OWN_ATOM(192)
#undef TE_JAX_OWN_ATOM

template <class Atom, int N, size_t... I>
__device__ __forceinline__ void MmaImpl(uint64_t da, uint64_t db, float (&d)[N], bool accumulate,
                                        std::index_sequence<I...>) {
  Atom::fma(da, db, d[I]..., accumulate ? cute::SM90::GMMA::ScaleOut::One
                                        : cute::SM90::GMMA::ScaleOut::Zero);
}

enum Diag { kNone = 0, kNoPromote = 1, kNoLoad = 2 };

// Tile configuration and its shared memory.
template <int BN_, int kStages_, bool kDoubleAcc_, int kCluster_, bool kScaleTma_ = false,
          int kDiag_ = kNone, bool kTmaStore_ = false, bool kBVec_ = false>
struct Cfg {
  static constexpr bool kBVec = kBVec_;  // b scaled per 1x128 (wgrad), else per 128x128
  static constexpr int BM = 128, BK = 128, BN = BN_, kStages = kStages_, kCluster = kCluster_;
  static constexpr bool kDoubleAcc = kDoubleAcc_, kScaleTma = kScaleTma_, kTmaStore = kTmaStore_;
  static constexpr int kDiag = kDiag_;
  static constexpr int kBytesA = BM * BK, kBytesB = BN * BK;
  // A stage's scales (kScaleTma): a's 128 row scales (512 B), then b's: a
  // TMA box of 2 block rows x 4 k-blocks (32 B, of which [0] and [4] are
  // read), or (kBVec) the tile's BN column scales; padded to 128 B.
  static constexpr int kBytesScaleA = BM * 4, kBytesScaleB = kBVec ? BN * 4 : 2 * 4 * 4;
  static constexpr int kBytesScales = kScaleTma ? (kBytesScaleA + kBytesScaleB + 127) / 128 * 128 : 0;
  static constexpr int kAcc = BN / 2;  // fp32 accumulator registers per thread (m64 x BN / 128)
  // The bf16 output tile staged for TMA stores (kTmaStore): per math
  // warpgroup 64 rows, as BN / 64 boxes of 64 rows x 128 B.
  static constexpr int kBytesOut = kTmaStore ? BM * BN * 2 : 0;
  static constexpr size_t kSmem = 1024 /* alignment slack */ +
                                  size_t(kStages) * (kBytesA + kBytesB + kBytesScales) +
                                  kBytesOut + 2 * kStages * sizeof(uint64_t);
  static_assert(BN % 16 == 0 && BN <= 192, "BN: multiple of 16 (B halves 1024-B aligned), <= 192");
  static_assert(!kDoubleAcc || BN <= 128, "double accumulators need 3 x BN/2 registers");
  static_assert(kDiag == kNone || kDiag == kNoPromote || kDiag == kNoLoad, "unknown diagnostic");
  static_assert(kDiag != kNoLoad || (!kScaleTma && kCluster == 1), "kNoLoad: no scale TMA, one CTA");
  static_assert(!kTmaStore || BN % 64 == 0, "TMA-stored tiles are whole 64-column boxes");
  static_assert(!kBVec || (kScaleTma && kDiag == kNone),
                "1x128-scaled b reads its BN column scales from the stage (kScaleTma)");
  static_assert(kCluster == 1 || kCluster == 2, "cluster of 1 or 2 CTAs along M");
  static_assert(kSmem <= 232448, "more shared memory than an sm_90 CTA may have");
  // A tile's columns [n0, n0 + BN) must span at most two 128-blocks of b's
  // scales for every tile start n0 = t * BN.
  static constexpr bool TwoScaleBlocks() {
    for (int t = 0; t < 128; ++t)
      if ((t * BN) % 128 + BN > 256) return false;
    return true;
  }
  static_assert(TwoScaleBlocks(), "a tile would span three b scale blocks");
};

template <class C>
__global__ void __launch_bounds__(384, 1)
    BlockwiseGemmKernel(const __grid_constant__ CUtensorMap map_a,
                        const __grid_constant__ CUtensorMap map_b,
                        const __grid_constant__ CUtensorMap map_sa,
                        const __grid_constant__ CUtensorMap map_sb,
                        const __grid_constant__ CUtensorMap map_out, const GemmArgs p) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  constexpr int BN = C::BN, kStages = C::kStages, kCl = C::kCluster, kAcc = C::kAcc;
  constexpr bool kTmaScales = C::kScaleTma;
  extern __shared__ uint8_t smem_raw[];
  // TMA's 128B swizzle and the wgmma descriptors assume 1024-B aligned tiles.
  uint8_t* smem = smem_raw + ((1024 - (ptx::Smem(smem_raw) & 1023)) & 1023);
  uint8_t* sa = smem;
  uint8_t* sb = sa + kStages * C::kBytesA;
  uint8_t* so = sb + kStages * C::kBytesB;  // the output tile (kTmaStore), 1024-B aligned
  uint8_t* ss = so + C::kBytesOut;          // kStages x kBytesScales (kScaleTma)
  uint64_t* full = reinterpret_cast<uint64_t*>(ss + kStages * C::kBytesScales);
  uint64_t* empty = full + kStages;

  const int wg = threadIdx.x / 128, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t rank = kCl > 1 ? ptx::ClusterRank() : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::MbarInit(&full[s], 1);           // the local producer's arrive.expect_tx
      ptx::MbarInit(&empty[s], 8 * kCl);    // every math warp of every CTA reading the stage
    }
    ptx::FenceBarrierInit();
  }
  if constexpr (C::kDiag == kNoLoad) {
    // Tiles nothing will load: a fixed pattern of finite e4m3 values (no
    // 0x7F / 0xFF NaNs), not zeros, so the tensor cores toggle as on data.
    uint32_t* words = reinterpret_cast<uint32_t*>(sa);
    const int n = kStages * (C::kBytesA + C::kBytesB) / 4;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
      words[i] = (static_cast<uint32_t>(i) * 2654435761u) & 0x77777777u;
    ptx::FenceProxyAsync();  // the generic writes, before wgmma reads them
  }
  if (kCl > 1) ptx::ClusterSync(); else __syncthreads();

  const int num_m = static_cast<int>(p.m / 128), num_n = static_cast<int>((p.n + BN - 1) / BN);
  const int num_mc = num_m / kCl;  // M tiles per CTA of a cluster
  const int tiles = num_mc * num_n, nkb = static_cast<int>(p.k / 128);
  const int cluster = blockIdx.x / kCl, clusters = gridDim.x / kCl;
  // Grouped raster: groups of `group` N tiles; inside a group N runs
  // fastest, then M, so the tiles in flight on all SMs at once cover about
  // (SMs / group) x group tiles and share their A rows and B columns in L2.
  auto coords = [&](int t, int& mb, int& nb) {
    const int per_group = p.group * num_mc, g = t / per_group, first_n = g * p.group;
    const int width = min(p.group, num_n - first_n), local = t - g * per_group;
    mb = (local / width) * kCl + static_cast<int>(rank);
    nb = first_n + local % width;
  };

  if (wg == 0) {
    // ---------------------------------------------------------- producer --
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (warp == 0 && lane == 0) {
      int s = 0;
      uint32_t phase = 0;
      for (int t = cluster; t < tiles; t += clusters) {
        int mb, nb;
        coords(t, mb, nb);
        // Cluster: each CTA loads half of B. A half that starts past N (last
        // N tile) only feeds columns that are never stored: it reads row 0
        // instead of asking TMA for a box wholly outside the tensor. A half
        // that starts inside is zero-filled past N by TMA.
        int b_row = nb * BN + static_cast<int>(rank) * (BN / 2);
        if (kCl > 1 && b_row >= p.n) b_row = 0;
        const int nb_lo = nb * BN / 128;  // b's first scale block row of this tile
        for (int kb = 0; kb < nkb; ++kb) {
          ptx::MbarWait(&empty[s], phase ^ 1);  // every reader (both CTAs) freed it
          if constexpr (C::kDiag == kNoLoad) {
            ptx::MbarArrive(&full[s]);  // "full" at once: no bytes to wait for
            if (++s == kStages) { s = 0; phase ^= 1; }
            continue;
          }
          ptx::MbarExpectTx(&full[s], C::kBytesA + C::kBytesB +
                                          (kTmaScales ? C::kBytesScaleA + C::kBytesScaleB : 0));
          ptx::TmaLoad(&map_a, &full[s], sa + s * C::kBytesA, kb * 128, mb * 128);
          if (kCl == 1)
            ptx::TmaLoad(&map_b, &full[s], sb + s * C::kBytesB, kb * 128, b_row);
          else
            ptx::TmaLoadMulticast(&map_b, &full[s], sb + s * C::kBytesB + rank * (C::kBytesB / 2),
                                  kb * 128, b_row, 0x3);
          if constexpr (kTmaScales) {
            uint8_t* sc = ss + s * C::kBytesScales;
            ptx::TmaLoad(&map_sa, &full[s], sc, mb * 128, kb);
            if constexpr (C::kBVec)
              ptx::TmaLoad(&map_sb, &full[s], sc + C::kBytesScaleA, nb * BN, kb);
            else
              ptx::TmaLoad(&map_sb, &full[s], sc + C::kBytesScaleA, kb, nb_lo);
          }
          if (++s == kStages) { s = 0; phase ^= 1; }
        }
      }
    }
    __syncwarp();
  } else {
    // -------------------------------------------------------------- math --
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    using Atom = typename MmaAtom<BN>::T;
    const int half = wg - 1;                                   // rows half*64.. of the tile
    const int wrow = (warp % 4) * 16 + lane / 4;               // this thread's rows: wrow, wrow + 8
    const int num_nb = static_cast<int>((p.n + 127) / 128);    // b scale blocks
    float acc0[kAcc], acc1[C::kDoubleAcc ? kAcc : 1], fin[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc0[i] = 0.f;
#pragma unroll
    for (int i = 0; i < (C::kDoubleAcc ? kAcc : 1); ++i) acc1[i] = 0.f;
    int s = 0;
    uint32_t phase = 0;
    // Scales of one k-block: a of rows row, row + 8; b of both blocks.
    struct Sc { float a0, a1, bl, bh; };
    // A stage in flight: its slot and its k-block's scales.
    struct Issued { int st; Sc sc; };

    // Waits for the next stage and issues its 4 wgmmas (K = 4 x 32) into
    // acc (accumulating onto it when `onto`). `sc`: the k-block's scales,
    // read from the stage (kScaleTma) or handed in.
    auto issue = [&](auto& acc, Sc sc, bool onto) -> Issued {
      const int st = s;
      ptx::MbarWait(&full[st], phase);
      if (++s == kStages) { s = 0; phase ^= 1; }
      if constexpr (kTmaScales) {
        const float* sc_a = reinterpret_cast<const float*>(ss + st * C::kBytesScales);
        const float* sc_b = sc_a + C::BM;
        sc = C::kBVec ? Sc{sc_a[half * 64 + wrow], sc_a[half * 64 + wrow + 8], 0.f, 0.f}
                      : Sc{sc_a[half * 64 + wrow], sc_a[half * 64 + wrow + 8], sc_b[0], sc_b[4]};
      }
      ptx::FenceRegs(acc);
      ptx::WgmmaFence();
      const uint64_t da = ptx::Desc(sa + st * C::kBytesA + half * 64 * 128);
      const uint64_t db = ptx::Desc(sb + st * C::kBytesB);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)  // +32 bytes along K = +2 in the descriptor's address
        MmaImpl<Atom>(da + 2 * kk, db + 2 * kk, acc, onto || kk > 0,
                      std::make_index_sequence<kAcc>{});
      ptx::WgmmaCommit();
      ptx::FenceRegs(acc);
      return Issued{st, sc};
    };
    auto release = [&](int st) {
      if (lane == 0) {
        ptx::MbarArrive(&empty[st]);
        if (kCl > 1) ptx::MbarArriveRemote(&empty[st], rank ^ 1);
      }
    };

    for (int t = cluster; t < tiles; t += clusters) {
      int mb, nb;
      coords(t, mb, nb);
      const long row = mb * 128L + half * 64 + wrow;
      const int n0 = nb * BN, nb_lo = n0 / 128, nb_hi = min(nb_lo + 1, num_nb - 1);
      const int j_split = ((nb_lo + 1) * 128 - n0) / 8;  // 8-column groups j < j_split: block nb_lo
      const float* a_s = p.a_sinv + row;
      const float* b_lo = p.b_sinv + size_t(nb_lo) * p.b_ld;
      const float* b_hi = p.b_sinv + size_t(nb_hi) * p.b_ld;
      // Global-memory scales (not kScaleTma): k-block kb's, loaded when
      // k-block kb - 1 is issued, used when kb's wgmmas are done.
      auto load = [&](int kb) {
        if constexpr (kTmaScales) {
          return Sc{0.f, 0.f, 0.f, 0.f};
        } else if constexpr (C::kDiag == kNoLoad) {
          return Sc{1.f, 1.f, 1.f, 1.f};
        } else {
          if (kb >= nkb) return Sc{0.f, 0.f, 0.f, 0.f};
          const float* a = a_s + size_t(kb) * p.a_ld;
          return Sc{__ldg(a), __ldg(a + 8), __ldg(b_lo + kb), __ldg(b_hi + kb)};
        }
      };
      auto promote = [&](const auto& acc, const Sc& c) {
        const float l0 = c.a0 * c.bl, l1 = c.a1 * c.bl, h0 = c.a0 * c.bh, h1 = c.a1 * c.bh;
#pragma unroll
        for (int j = 0; j < kAcc / 4; ++j) {
          const bool lo = j < j_split;
          const float s0 = lo ? l0 : h0, s1 = lo ? l1 : h1;
          fin[4 * j + 0] = fmaf(s0, acc[4 * j + 0], fin[4 * j + 0]);
          fin[4 * j + 1] = fmaf(s0, acc[4 * j + 1], fin[4 * j + 1]);
          fin[4 * j + 2] = fmaf(s1, acc[4 * j + 2], fin[4 * j + 2]);
          fin[4 * j + 3] = fmaf(s1, acc[4 * j + 3], fin[4 * j + 3]);
        }
      };
      // 1x128-scaled b: each column its own scale, read from the stage
      // (columns 8j + 2 (lane % 4) + {0, 1}: one float2 per j).
      auto promote_vec = [&](const auto& acc, const Sc& c, int st) {
        const float* sb_cols = reinterpret_cast<const float*>(ss + st * C::kBytesScales +
                                                              C::kBytesScaleA) + (lane % 4) * 2;
#pragma unroll
        for (int j = 0; j < kAcc / 4; ++j) {
          const float2 b = *reinterpret_cast<const float2*>(sb_cols + 8 * j);
          fin[4 * j + 0] = fmaf(c.a0 * b.x, acc[4 * j + 0], fin[4 * j + 0]);
          fin[4 * j + 1] = fmaf(c.a0 * b.y, acc[4 * j + 1], fin[4 * j + 1]);
          fin[4 * j + 2] = fmaf(c.a1 * b.x, acc[4 * j + 2], fin[4 * j + 2]);
          fin[4 * j + 3] = fmaf(c.a1 * b.y, acc[4 * j + 3], fin[4 * j + 3]);
        }
      };
      // k-block kb's wgmmas are done: free its stage, promote it (with
      // 1x128-scaled b, promote first: its scales are read from the stage).
      auto finish = [&](auto& acc, const Issued& i) {
        ptx::FenceRegs(acc);
        if constexpr (C::kBVec) {
          promote_vec(acc, i.sc, i.st);
          release(i.st);
        } else {
          release(i.st);
          promote(acc, i.sc);
        }
      };
#pragma unroll
      for (int i = 0; i < kAcc; ++i) fin[i] = 0.f;
      Sc next = load(0);

      if constexpr (C::kDiag == kNoPromote) {
        // Diagnostic: all of K in acc0, stage kb freed once kb + 1 is issued
        // (per-tensor FP8's loop); fin = acc0, no scales.
        Issued prev = issue(acc0, next, false);
        for (int kb = 1; kb < nkb; ++kb) {
          const Issued cur = issue(acc0, next, true);
          ptx::WgmmaWait<1>();
          release(prev.st);
          prev = cur;
        }
        ptx::WgmmaWait<0>();
        ptx::FenceRegs(acc0);
        release(prev.st);
#pragma unroll
        for (int i = 0; i < kAcc; ++i) fin[i] = acc0[i];
      } else if constexpr (!C::kDoubleAcc) {
        for (int kb = 0; kb < nkb; ++kb) {
          const Issued i = issue(acc0, next, false);
          next = load(kb + 1);  // a k-block of latency to hide
          ptx::WgmmaWait<0>();
          finish(acc0, i);
        }
      } else {
        // acc0 holds even k-blocks, acc1 odd ones; k-block kb + 1 is issued
        // before kb is promoted. Unrolled by two so that the register arrays
        // are never indexed at run time, and every exit from the loop sits
        // right after a wait_group 0: ptxas must see on every path that no
        // wgmma is in flight when the loop ends, or it serializes them all.
        Issued i0 = issue(acc0, next, false), i1{};
        next = load(1);
        for (int kb = 0;; kb += 2) {
          if (kb + 1 < nkb) {
            i1 = issue(acc1, next, false);
            next = load(kb + 2);
            ptx::WgmmaWait<1>();  // k-block kb done, kb + 1 may still run
            finish(acc0, i0);
          } else {
            ptx::WgmmaWait<0>();
            finish(acc0, i0);
            break;
          }
          if (kb + 2 < nkb) {
            i0 = issue(acc0, next, false);
            next = load(kb + 3);
            ptx::WgmmaWait<1>();
            finish(acc1, i1);
          } else {
            ptx::WgmmaWait<0>();
            finish(acc1, i1);
            break;
          }
        }
      }

      if constexpr (C::kTmaStore) {
        // Epilogue through smem and TMA: wait until the previous tile's
        // stores have read the buffer, write this tile's pairs swizzled as
        // TMA's 128B mode reads them (16-B chunk c of row r at c ^ (r % 8):
        // a warp's 8 rows x 16 B land in 8 different chunks, all 32 banks),
        // then one thread stores the warpgroup's 64-row half.
        const bool leader = threadIdx.x % 128 == 0;
        if (leader) ptx::BulkWaitRead();
        if (half == 0) ptx::NamedBarrier<1, 128>(); else ptx::NamedBarrier<2, 128>();
        const int x = lane / 4;  // = row % 8 of both of this thread's rows
        uint8_t* base = so + half * (64 * BN * 2) + wrow * 128 + (lane % 4) * 4;
#pragma unroll
        for (int j = 0; j < kAcc / 4; ++j) {
          const int box = j / 8, chunk = j % 8;  // 8 columns (16 B) per j, 64 per box
          uint8_t* dst = base + box * 8192 + ((chunk ^ x) << 4);
          *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(fin[4 * j], fin[4 * j + 1]);
          *reinterpret_cast<__nv_bfloat162*>(dst + 8 * 128) =  // row + 8: same swizzle
              __floats2bfloat162_rn(fin[4 * j + 2], fin[4 * j + 3]);
        }
        uint8_t* out_half = so + half * (64 * BN * 2);
        ptx::FenceProxyAsync();
        if (half == 0) ptx::NamedBarrier<1, 128>(); else ptx::NamedBarrier<2, 128>();
        if (leader) {
#pragma unroll
          for (int box = 0; box < BN / 64; ++box)
            if (n0 + box * 64 < p.n)  // a box wholly past N (last N tile) is not stored
              ptx::TmaStore(&map_out, out_half + box * 8192, n0 + box * 64,
                            static_cast<int>(mb * 128 + half * 64));
          ptx::BulkCommit();
          // The last tile's stores complete before the CTA exits. (Waited
          // for here, not after the tile loop: there, ptxas capped the
          // math warps at ~176 registers and spilled the accumulators.)
          if (t + clusters >= tiles) ptx::BulkWaitAll();
        }
      } else {
        // Epilogue: bf16 pairs straight to global memory (4-B stores; the
        // other math warpgroup and the producer keep the SM busy meanwhile).
        __nv_bfloat16* o0 = p.out + size_t(row) * p.n;
        __nv_bfloat16* o1 = o0 + 8 * p.n;
        const int c0 = n0 + (lane % 4) * 2;
#pragma unroll
        for (int j = 0; j < kAcc / 4; ++j) {
          const int col = c0 + 8 * j;
          if (col < p.n) {
            *reinterpret_cast<__nv_bfloat162*>(o0 + col) =
                __floats2bfloat162_rn(fin[4 * j], fin[4 * j + 1]);
            *reinterpret_cast<__nv_bfloat162*>(o1 + col) =
                __floats2bfloat162_rn(fin[4 * j + 2], fin[4 * j + 3]);
          }
        }
      }
    }
  }
  // A cluster peer may still arrive on our barriers (and, in principle,
  // multicast into our smem) until it is done: leave together.
  if (kCl > 1) ptx::ClusterSync();
#endif
}

// ------------------------------------------------------------------ host --

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                   const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                   const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                   CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
// The driver's tensor-map encoder, fetched through the runtime so that
// nothing links libcuda directly.
inline EncodeTiledFn EncodeTiled() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess || q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// TMA map of a (rows, k) e4m3 row-major matrix: boxes of 128 (K, = one
// 128-byte swizzle row) x box_rows, zero fill past the edges.
inline bool MakeMap(CUtensorMap* map, const void* ptr, long rows, long k, int box_rows) {
  const EncodeTiledFn enc = EncodeTiled();
  if (!enc) return false;
  const cuuint64_t dims[2] = {cuuint64_t(k), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(k)};
  const cuuint32_t box[2] = {128, cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(ptr), dims, strides, box,
             elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// TMA map of a scale grid, `outer` rows of `ld` floats (te_jax's native
// layouts: ld a multiple of 4, rows 16-byte aligned), boxes of box_inner x
// box_outer floats, no swizzle, zero fill past the edges.
inline bool MakeScaleMap(CUtensorMap* map, const float* ptr, long outer, long ld, int box_inner,
                         int box_outer) {
  const EncodeTiledFn enc = EncodeTiled();
  if (!enc) return false;
  const cuuint64_t dims[2] = {cuuint64_t(ld), cuuint64_t(outer)};
  const cuuint64_t strides[1] = {cuuint64_t(ld) * 4};
  const cuuint32_t box[2] = {cuuint32_t(box_inner), cuuint32_t(box_outer)};
  const cuuint32_t elem[2] = {1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, const_cast<float*>(ptr), dims, strides, box,
             elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
             CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// TMA map of the (m, n) bf16 output for stores of 64 x 64 boxes, 128B
// swizzle (one box row = 128 B), clipped at the edges.
inline bool MakeOutMap(CUtensorMap* map, void* ptr, long m, long n) {
  const EncodeTiledFn enc = EncodeTiled();
  if (!enc) return false;
  const cuuint64_t dims[2] = {cuuint64_t(n), cuuint64_t(m)};
  const cuuint64_t strides[1] = {cuuint64_t(n) * 2};
  const cuuint32_t box[2] = {64, 64};
  const cuuint32_t elem[2] = {1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, dims, strides, box, elem,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// nullptr when a configuration of cluster size `cluster` (TMA-loaded scales
// when `tma_scales`, TMA-stored output when `tma_store`) can run p, else why not.
inline const char* CheckShape(const GemmArgs& p, int cluster, bool tma_scales = false,
                              bool tma_store = false, bool b_vec = false) {
  if (p.b_vec != b_vec)
    return b_vec ? "this configuration scales b per 1x128 (wgrad); the operands' b is 128x128"
                 : "this configuration scales b per 128x128; the operands' b is 1x128 (wgrad)";
  if (p.m <= 0 || p.n <= 0 || p.k <= 0) return "empty problem";
  if (p.m % 128 || p.n % 128 || p.k % 128) return "M, N and K must be multiples of 128";
  if (cluster == 2 && p.m % 256) return "cluster 2 needs M % 256 == 0";
  if (p.m >= (1L << 31) || p.n >= (1L << 31) || p.k >= (1L << 31)) return "a dimension >= 2^31";
  if (p.a_ld < p.m || p.b_ld < (b_vec ? p.n : p.k / 128)) return "scale grid smaller than the problem";
  if (reinterpret_cast<uintptr_t>(p.a) % 16 || reinterpret_cast<uintptr_t>(p.b) % 16 ||
      reinterpret_cast<uintptr_t>(p.out) % 4)
    return "a, b must be 16-byte aligned, out 4-byte aligned";
  if (tma_scales && (p.a_ld % 4 || p.b_ld % 4 || reinterpret_cast<uintptr_t>(p.a_sinv) % 16 ||
                     reinterpret_cast<uintptr_t>(p.b_sinv) % 16))
    return "TMA-loaded scales need a_ld, b_ld % 4 == 0 and 16-byte aligned scale grids";
  if (tma_store && reinterpret_cast<uintptr_t>(p.out) % 16)
    return "a TMA-stored output must be 16-byte aligned";
  if (p.group < 1) return "group must be >= 1";
  return nullptr;
}

// The launch configuration of C (its grid left to the caller): 384 threads,
// C's shared memory, clusters of C::kCluster along x. `attr` must outlive it.
template <class C>
cudaLaunchConfig_t LaunchConfig(cudaLaunchAttribute (&attr)[1], cudaStream_t stream) {
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = C::kCluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(384);
  cfg.dynamicSmemBytes = C::kSmem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = C::kCluster > 1 ? 1 : 0;
  return cfg;
}

// CTAs a persistent launch of configuration C runs on `sms` SMs (before the
// cap at one per tile): every SM, or for clusters of 2 as many clusters as
// the occupancy API says fit at once (GPCs with an odd SM count fit fewer
// than sms / 2; a grid beyond that would run a second, tail wave).
template <class C>
int ResidentCtas(int sms) {
  static int units = -1;  // one per configuration (template)
  if (units >= 0) return units * C::kCluster;
  auto* kernel = BlockwiseGemmKernel<C>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(C::kSmem)) != cudaSuccess)
    return -1;
  units = sms;
  if (C::kCluster > 1) {
    cudaLaunchAttribute attr[1];
    cudaLaunchConfig_t cfg = LaunchConfig<C>(attr, 0);
    cfg.gridDim = dim3(sms / C::kCluster * C::kCluster);
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
      units = -1;
      return -1;
    }
    units = clusters > 0 ? clusters : sms / C::kCluster;
    // TE_JAX_OWN_CLUSTERS=N overrides the query (N clusters), to time the
    // cluster-2 configurations on every SM whatever it answered.
    if (const char* force = std::getenv("TE_JAX_OWN_CLUSTERS")) units = std::atoi(force);
  }
  return units * C::kCluster;
}

template <class C>
cudaError_t Launch(const GemmArgs& p, int sms, cudaStream_t stream) {
  if (CheckShape(p, C::kCluster, C::kScaleTma, C::kTmaStore, C::kBVec)) return cudaErrorInvalidValue;
  CUtensorMap map_a, map_b, map_sa{}, map_sb{}, map_out{};
  if (!MakeMap(&map_a, p.a, p.m, p.k, 128) ||
      !MakeMap(&map_b, p.b, p.n, p.k, C::kCluster == 1 ? C::BN : C::BN / 2))
    return cudaErrorInvalidValue;
  // a's scales: (K/128, a_ld), a box of the tile's 128 rows of one k-block;
  // b's: (ceil(N/128), b_ld), a box of 4 k-blocks x the tile's 2 block rows,
  // or (kBVec) (K/128, b_ld), a box of the tile's BN columns of one k-block.
  if (C::kScaleTma &&
      (!MakeScaleMap(&map_sa, p.a_sinv, p.k / 128, p.a_ld, 128, 1) ||
       !(C::kBVec ? MakeScaleMap(&map_sb, p.b_sinv, p.k / 128, p.b_ld, C::BN, 1)
                  : MakeScaleMap(&map_sb, p.b_sinv, (p.n + 127) / 128, p.b_ld, 4, 2))))
    return cudaErrorInvalidValue;
  if (C::kTmaStore && !MakeOutMap(&map_out, p.out, p.m, p.n)) return cudaErrorInvalidValue;
  const int ctas = ResidentCtas<C>(sms);
  if (ctas <= 0) return cudaErrorInvalidConfiguration;
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = LaunchConfig<C>(attr, stream);
  const long tiles = (p.m / 128 / C::kCluster) * ((p.n + C::BN - 1) / C::BN);
  cfg.gridDim = dim3(static_cast<unsigned>(std::min<long>(tiles, ctas / C::kCluster) * C::kCluster));
  return cudaLaunchKernelEx(&cfg, BlockwiseGemmKernel<C>, map_a, map_b, map_sa, map_sb, map_out,
                            p);
}

// The configurations the harness times (one template instance each).
// `diagnostic`: times one part of the design, computes no correct GEMM (the
// harness neither checks nor ranks it).
struct Config {
  const char* name;
  int bn, stages, cluster;
  bool double_acc, tma_scales, tma_store, b_vec;
  int diagnostic;
  cudaError_t (*launch)(const GemmArgs&, int sms, cudaStream_t);
  int (*resident_ctas)(int sms);
};
inline std::vector<Config> Configs() {
// name, BN, stages, two accumulators, cluster, TMA scales, TMA stores,
// diagnostic; _VEC: b scaled per 1x128 (wgrad).
#define TE_JAX_OWN_CFG(name, bn, st, dbl, cl, tma, store, diag)                                \
  {name, bn, st, cl, dbl, tma, store, false, diag,                                            \
   Launch<Cfg<bn, st, dbl, cl, tma, diag, store>>, ResidentCtas<Cfg<bn, st, dbl, cl, tma, diag, store>>}
#define TE_JAX_OWN_CFG_VEC(name, bn, st, dbl, cl, store)                                      \
  {name, bn, st, cl, dbl, true, store, true, kNone,                                           \
   Launch<Cfg<bn, st, dbl, cl, true, kNone, store, true>>,                                    \
   ResidentCtas<Cfg<bn, st, dbl, cl, true, kNone, store, true>>}
  return {
      TE_JAX_OWN_CFG("n128_s6_dbl", 128, 6, true, 1, false, false, kNone),
      TE_JAX_OWN_CFG("n128_s6_dbl_tma", 128, 6, true, 1, true, false, kNone),
      TE_JAX_OWN_CFG("n128_s5_dbl_tma_st", 128, 5, true, 1, true, true, kNone),
      TE_JAX_OWN_CFG("n128_s6", 128, 6, false, 1, false, false, kNone),
      TE_JAX_OWN_CFG("n128_s5_tma_st", 128, 5, false, 1, true, true, kNone),
      TE_JAX_OWN_CFG("n160_s6", 160, 6, false, 1, false, false, kNone),
      TE_JAX_OWN_CFG("n160_s6_tma", 160, 6, false, 1, true, false, kNone),
      TE_JAX_OWN_CFG("n192_s4_tma_st", 192, 4, false, 1, true, true, kNone),
      TE_JAX_OWN_CFG("n128_s6_dbl_c2", 128, 6, true, 2, false, false, kNone),
      TE_JAX_OWN_CFG("n128_s5_dbl_tma_st_c2", 128, 5, true, 2, true, true, kNone),
      // Diagnostics: the pipeline without the promotion.
      TE_JAX_OWN_CFG("diag_nopromote_n128", 128, 6, false, 1, false, false, kNoPromote),
      TE_JAX_OWN_CFG("diag_nopromote_n128_s5_st", 128, 5, false, 1, false, true, kNoPromote),
      TE_JAX_OWN_CFG("diag_nopromote_n128_c2", 128, 6, false, 2, false, false, kNoPromote),
      // ... and the math warps without data: promotion with one and two accumulators.
      TE_JAX_OWN_CFG("diag_noload_n128", 128, 6, false, 1, false, false, kNoLoad),
      TE_JAX_OWN_CFG("diag_noload_n128_dbl", 128, 6, true, 1, false, false, kNoLoad),
      // wgrad: 1x128 x 1x128.
      TE_JAX_OWN_CFG_VEC("wgrad_n128_s6_dbl", 128, 6, true, 1, false),
      TE_JAX_OWN_CFG_VEC("wgrad_n128_s5_dbl_st", 128, 5, true, 1, true),
      TE_JAX_OWN_CFG_VEC("wgrad_n128_s5_st", 128, 5, false, 1, true),
  };
#undef TE_JAX_OWN_CFG
#undef TE_JAX_OWN_CFG_VEC
}

}  // namespace own
}  // namespace te_jax
