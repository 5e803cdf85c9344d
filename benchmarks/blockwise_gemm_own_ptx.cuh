// The PTX wrappers and wgmma atoms of te_jax's own sm_90a blockwise GEMM
// (blockwise_gemm_own.cuh): mbarriers, TMA loads and stores, bulk groups,
// fences, named barriers, the wgmma descriptor of a 128B-swizzled K-major
// tile, and the m64 x BN x k32 e4m3 atoms.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma_ext.hpp>

#ifndef TE_JAX_OWN_WAIT_TRAP
#define TE_JAX_OWN_WAIT_TRAP (1u << 26)
#endif

namespace te_jax {
namespace own {

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
// Arrive on the barrier at the same smem offset in CTA `cta` of the cluster,
// with mbarrier.arrive's default semantics (release at CTA scope), as
// CUTLASS's ClusterBarrier does: it orders this warp's finished wgmma reads
// of a stage before the peer's TMA overwrites it, without a cluster-scope
// release on every stage of every math warp.
__device__ __forceinline__ void MbarArriveRemote(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n\t.reg .b32 ra;\n\t"
      "mapa.shared::cluster.u32 ra, %0, %1;\n\t"
      "mbarrier.arrive.shared::cluster.b64 _, [ra];\n\t}" ::"r"(Smem(bar)),
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

}  // namespace own
}  // namespace te_jax
