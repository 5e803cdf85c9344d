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
// Scale factors, three ways (kScaleTma): TMA copies each k-block's scales
// into the stage beside its tiles (a's 128 row scales, b's two block
// scales), so the math threads read them from shared memory once the stage
// is full; or TMA copies a's and the math threads read b's two (the same
// address in every thread) from global memory; or (the first design) the
// math threads read both from global memory (L2-resident, a few KB), one
// k-block ahead of their use.
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

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "blockwise_gemm_own_ptx.cuh"

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

enum Diag { kNone = 0, kNoPromote = 1, kNoLoad = 2 };
// Where the math threads find a k-block's scales (kScaleTma).
enum ScaleLoad { kScalesGlobal = 0, kScalesTma = 1, kScalesTmaA = 2 };

// Tile configuration and its shared memory.
template <int BN_, int kStages_, bool kDoubleAcc_, int kCluster_, int kScaleLoad_ = kScalesGlobal,
          int kDiag_ = kNone, bool kTmaStore_ = false, bool kBVec_ = false>
struct Cfg {
  static constexpr bool kBVec = kBVec_;  // b scaled per 1x128 (wgrad), else per 128x128
  static constexpr int BM = 128, BK = 128, BN = BN_, kStages = kStages_, kCluster = kCluster_;
  static constexpr bool kDoubleAcc = kDoubleAcc_, kTmaStore = kTmaStore_;
  // kScaleTma: a's scales come with the stage; kBScaleTma: b's too.
  static constexpr bool kScaleTma = kScaleLoad_ != kScalesGlobal,
                        kBScaleTma = kScaleLoad_ == kScalesTma;
  static constexpr int kDiag = kDiag_;
  static constexpr int kBytesA = BM * BK, kBytesB = BN * BK;
  // A stage's scales (kScaleTma): a's 128 row scales (512 B), then b's: a
  // TMA box of 2 block rows x 4 k-blocks starting at k-block kb & ~3, so
  // that it starts 16-byte aligned in the grid and stays inside its rows
  // (32 B, of which [kb & 3] and [4 + (kb & 3)] are read), or (kBVec) the
  // tile's BN column scales; padded to 128 B.
  static constexpr int kBytesScaleA = BM * 4,
                       kBytesScaleB = !kBScaleTma ? 0 : kBVec ? BN * 4 : 2 * 4 * 4;
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
  static_assert(kScaleLoad_ >= kScalesGlobal && kScaleLoad_ <= kScalesTmaA, "unknown ScaleLoad");
  static_assert(!kBVec || (kBScaleTma && kDiag == kNone),
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
            else if constexpr (C::kBScaleTma)
              ptx::TmaLoad(&map_sb, &full[s], sc + C::kBytesScaleA, kb & ~3, nb_lo);
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
    int issued_kb = 0;  // k-blocks of the current tile issued so far
    // Scales of one k-block: a of rows row, row + 8; b of both blocks.
    struct Sc { float a0, a1, bl, bh; };
    // A stage in flight: its slot and its k-block's scales.
    struct Issued { int st; Sc sc; };

    // Waits for the next stage and issues its 4 wgmmas (K = 4 x 32) into
    // acc (accumulating onto it when `onto`). `sc`: the k-block's scales,
    // read from the stage (kScaleTma) or handed in.
    auto issue = [&](auto& acc, Sc sc, bool onto) -> Issued {
      const int st = s, kq = issued_kb++ & 3;  // kq: this k-block's column in b's scale box
      ptx::MbarWait(&full[st], phase);
      if (++s == kStages) { s = 0; phase ^= 1; }
      if constexpr (kTmaScales) {
        const float* sc_a = reinterpret_cast<const float*>(ss + st * C::kBytesScales);
        const float a0 = sc_a[half * 64 + wrow], a1 = sc_a[half * 64 + wrow + 8];
        if constexpr (C::kBVec)
          sc = Sc{a0, a1, 0.f, 0.f};
        else if constexpr (C::kBScaleTma)
          sc = Sc{a0, a1, sc_a[C::BM + kq], sc_a[C::BM + 4 + kq]};  // b's box after a's
        else
          sc = Sc{a0, a1, sc.bl, sc.bh};  // b's handed in (load)
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
      issued_kb = 0;
      const long row = mb * 128L + half * 64 + wrow;
      const int n0 = nb * BN, nb_lo = n0 / 128, nb_hi = min(nb_lo + 1, num_nb - 1);
      const int j_split = ((nb_lo + 1) * 128 - n0) / 8;  // 8-column groups j < j_split: block nb_lo
      const float* a_s = p.a_sinv + row;
      const float* b_lo = p.b_sinv + size_t(nb_lo) * p.b_ld;
      const float* b_hi = p.b_sinv + size_t(nb_hi) * p.b_ld;
      // Global-memory scales (not kScaleTma): k-block kb's, loaded when
      // k-block kb - 1 is issued, used when kb's wgmmas are done.
      auto load = [&](int kb) {
        if constexpr (C::kBScaleTma) {
          return Sc{0.f, 0.f, 0.f, 0.f};
        } else if constexpr (kTmaScales) {  // a's from the stage, b's two here
          if (kb >= nkb) return Sc{0.f, 0.f, 0.f, 0.f};
          return Sc{0.f, 0.f, __ldg(b_lo + kb), __ldg(b_hi + kb)};
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

}  // namespace own
}  // namespace te_jax
