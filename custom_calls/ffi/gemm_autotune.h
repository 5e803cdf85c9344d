// GEMM algorithm selection by measurement, for ffi/gemm.cc (header-only,
// included there and nowhere else; plain CUDA runtime + cuBLASLt, no XLA).
//
// cuBLASLt's heuristic ranks algorithms by a model, and its first answer is
// not always the fastest kernel on the machine (on the H200 it picked
// slower FP8 kernels than Transformer Engine for the layer shapes). So on
// the first use of a problem gemm.cc asks for up to AlgoCount() answers and
// Measure() times them; the winner is cached for the process.
//
// Where the timing runs, and why that is safe inside XLA command buffers:
// gemm.cc may be called while XLA captures its stream into a CUDA graph, and
// nothing may then be enqueued on that stream except the real matmul. So the
// candidates run on a private stream of the device (created once, non-
// blocking, never captured), into private scratch memory (an output D of the
// problem's size and a workspace of the problem's size, from a private
// stream-ordered memory pool on that stream, freed again on that stream
// after the timing). They read the real A, B and scale (and bias) buffers,
// read-only; what those hold at that moment (possibly not yet written, under
// capture) does not matter for the time. XLA's output and workspace buffers
// are never touched here. The private stream waits on nothing else, so the
// host wait at the end (cudaStreamSynchronize of the private stream only;
// no device-wide synchronization) depends on no other stream or thread: it
// cannot deadlock against collectives in flight on other devices. Everything
// here runs inside gemm.cc's RelaxedCapture scope, which allows the stream
// and pool creation and the synchronization while the calling thread
// captures another stream.
//
// Cost: the host thread that calls the handler blocks for the timing once
// per problem (tens of milliseconds for large shapes); GPU work already
// enqueued keeps running meanwhile, and may share the GPU with the timed
// kernels. Candidates are therefore timed in interleaved rounds (each round
// times every candidate once) so that such interference hits all of them,
// and each candidate's median is kept.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace te_jax {
namespace gemm_autotune {

// TE_JAX_GEMM_AUTOTUNE_ALGOS when unset: the heuristic's first answer,
// untimed. Timing 8 answers made whole training steps slower, not faster
// (BENCHMARKS.md, "GEMM algorithm"): an isolated timing does not predict the
// GEMM's time beside the rest of the step. So selection by timing is opt-in
// until a step shows it winning.
constexpr int kDefaultAlgos = 1;
constexpr int kMaxAlgos = 32;           // larger requests are clamped
constexpr size_t kRounds = 5;           // timed samples per candidate (median kept)
constexpr float kTargetSampleMs = 0.1f; // each sample repeats the call to last about this long
constexpr int kMaxReps = 100;
// A later candidate (in the heuristic's order) must beat the current best by
// more than this to win, so near-ties keep the heuristic's order and the
// choice does not flip between processes on timing noise.
constexpr float kMargin = 0.01f;

// A non-negative decimal integer and nothing else (not empty); false otherwise.
inline bool ParseNonNegative(const char* text, long* out) {
  if (*text == '\0') return false;
  char* end = nullptr;
  const long x = std::strtol(text, &end, 10);
  if (*end != '\0' || x < 0) return false;
  *out = x;
  return true;
}

// TE_JAX_GEMM_AUTOTUNE_ALGOS: how many heuristic answers to time. Unset or
// empty: kDefaultAlgos (1); 0 or 1: the heuristic's first answer, no timing;
// anything else that is not a non-negative integer: a warning and the
// default. Read once per process, at the first GEMM.
inline int AlgoCount() {
  static const int n = [] {
    const char* v = std::getenv("TE_JAX_GEMM_AUTOTUNE_ALGOS");
    if (v == nullptr || *v == '\0') return kDefaultAlgos;
    long x = 0;
    if (!ParseNonNegative(v, &x)) {
      std::fprintf(stderr,
                   "te_jax: ignoring TE_JAX_GEMM_AUTOTUNE_ALGOS=%s (not an integer >= 0); "
                   "using the default, %d\n",
                   v, kDefaultAlgos);
      return kDefaultAlgos;
    }
    return static_cast<int>(std::min<long>(std::max<long>(x, 1), kMaxAlgos));
  }();
  return n;
}

// TE_JAX_GEMM_PICK: an experiment knob, unset by default. The timed steps of
// a training run hold the GPU at its power cap (the SM clock well below its
// maximum, lowest for the split-accumulation GEMMs; BENCHMARKS.md), so
// an algorithm's cost beside the rest of the step depends on the energy it
// spends as well as on its isolated speed, which the timing above measures
// at full clock. This knob lets a whole step be timed with another of the
// heuristic's answers: "K" takes the K-th usable answer (0-based, untimed;
// the last one where there are fewer) for every GEMM, "split=K" only for
// GEMMs with split accumulation (the per-tensor dgrad and wgrad by default,
// and every blockwise GEMM), "fast=K" only for those with fast
// accumulation; "fast=K,split=L" sets both. Where it applies it replaces
// the timing. Anything else: a warning, and the knob is off.
struct PickSetting {
  int fast = -1;   // < 0: not set
  int split = -1;
};

inline bool ParsePickIndex(const std::string& text, int* out) {
  long x = 0;
  if (!ParseNonNegative(text.c_str(), &x) || x >= kMaxAlgos) return false;
  *out = static_cast<int>(x);
  return true;
}

// "K", "split=K", "fast=K" or "fast=K,split=L" (either order); false for
// anything else.
inline bool ParsePick(const std::string& value, PickSetting* out) {
  PickSetting p;
  int k = 0;
  if (ParsePickIndex(value, &k)) {
    p.fast = p.split = k;
    *out = p;
    return true;
  }
  size_t start = 0;
  while (start <= value.size()) {
    const size_t comma = std::min(value.find(',', start), value.size());
    const std::string part = value.substr(start, comma - start);
    const size_t eq = part.find('=');
    if (eq == std::string::npos || !ParsePickIndex(part.substr(eq + 1), &k)) return false;
    const std::string name = part.substr(0, eq);
    int* slot = name == "fast" ? &p.fast : name == "split" ? &p.split : nullptr;
    if (slot == nullptr || *slot >= 0) return false;  // unknown or repeated
    *slot = k;
    start = comma + 1;
  }
  *out = p;
  return true;
}

// The answer TE_JAX_GEMM_PICK names for a GEMM with (fast) or without fast
// accumulation, or -1. Read once per process, at the first GEMM.
inline int PickFor(bool fast) {
  static const PickSetting p = [] {
    PickSetting s;
    const char* v = std::getenv("TE_JAX_GEMM_PICK");
    if (v == nullptr || *v == '\0') return s;
    if (!ParsePick(v, &s)) {
      std::fprintf(stderr,
                   "te_jax: ignoring TE_JAX_GEMM_PICK=%s (want K, split=K, fast=K or "
                   "fast=K,split=L with 0 <= K < %d)\n",
                   v, kMaxAlgos);
      return PickSetting{};
    }
    return s;
  }();
  return fast ? p.fast : p.split;
}

// TE_JAX_GEMM_SM90: te_jax's own sm_90a blockwise GEMMs (kernels/gemm_sm90.cuh,
// built on CUTLASS; in the module only when CMake found the CUTLASS headers)
// as candidates beside cuBLASLt's answers, for the pairs they serve (1x128 a
// with 128x128 or 1x128 b, E4M3, bfloat16 out; a variant that rejects the
// problem is not offered). Off by default until measurements say where they
// win. Unset, "" or "0": off; "1": added to cuBLASLt's answers (with more
// than one candidate the candidates are timed, whatever
// TE_JAX_GEMM_AUTOTUNE_ALGOS says); "only": the variants alone, cuBLASLt
// only where none takes the problem. Anything else, or a request in a build
// without them: a warning, and off. Read once per process.
enum class Sm90Use { kOff, kAdd, kOnly };

inline Sm90Use Sm90Setting(bool built) {
  static const Sm90Use use = [built] {
    const char* v = std::getenv("TE_JAX_GEMM_SM90");
    if (v == nullptr || *v == '\0' || std::strcmp(v, "0") == 0) return Sm90Use::kOff;
    const bool add = std::strcmp(v, "1") == 0, only = std::strcmp(v, "only") == 0;
    if (!add && !only) {
      std::fprintf(stderr, "te_jax: ignoring TE_JAX_GEMM_SM90=%s (want 0, 1 or only)\n", v);
      return Sm90Use::kOff;
    }
    if (!built) {
      std::fprintf(stderr,
                   "te_jax: ignoring TE_JAX_GEMM_SM90=%s: this build of te_jax has no sm90 "
                   "GEMMs (no CUTLASS headers at build time; custom_calls/README.md)\n", v);
      return Sm90Use::kOff;
    }
    return only ? Sm90Use::kOnly : Sm90Use::kAdd;
  }();
  return use;
}

// TE_JAX_GEMM_LOG: set and not "0" prints each problem's selection to stderr.
inline bool LogEnabled() {
  static const bool on = [] {
    const char* v = std::getenv("TE_JAX_GEMM_LOG");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }();
  return on;
}

// Every selection (heuristic query + Measure) runs under this one process-
// wide lock: a second thread that misses the cache for the same problem
// waits and then finds the first thread's plan, and the per-device
// resources below need no lock of their own. Selections are rare (once per
// problem) and none waits on anything but its own private stream, so
// serializing them costs little and cannot deadlock.
inline std::mutex& SelectionMutex() {
  static std::mutex* mu = new std::mutex;  // leaked on purpose, like gemm.cc's State
  return *mu;
}

// Devices of one model (name, compute capability, SM count) share selected
// algorithms: the smallest such ordinal stands for all. A cublasLtMatmulAlgo_t
// is plain data, valid on any device of the same kind, and sharing keeps the
// replicas of one SPMD program on the same kernels (the same bits).
// Processes still select independently (see custom_calls/README.md).
// gemm.cc calls this once per device and keeps the answer.
inline int DeviceClass(int dev) {
  int cls = dev;
  cudaDeviceProp mine;
  if (cudaGetDeviceProperties(&mine, dev) == cudaSuccess) {
    for (int i = 0; i < dev; ++i) {
      cudaDeviceProp p;
      if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
      if (std::strncmp(p.name, mine.name, sizeof(p.name)) == 0 && p.major == mine.major &&
          p.minor == mine.minor && p.multiProcessorCount == mine.multiProcessorCount) {
        cls = i;
        break;
      }
    }
  }
  cudaGetLastError();  // a failed query leaves no error behind (cls = dev then)
  return cls;
}

// One answer of the heuristic, or one of te_jax's sm90 variants, and what
// timing it gave.
struct Candidate {
  cublasLtMatmulHeuristicResult_t heuristic;  // algo, workspaceSize, wavesCount
  int index = 0;                              // position in the candidate list
  float ms = -1.f;                            // median time per call; < 0: not timed
  std::string skipped;                        // why it was dropped ("" = usable)
  int sm90 = -1;                              // >= 0: sm90::BlockwiseVariant, not cuBLASLt
  int sm90_swizzle = 1;                       // that variant's tile swizzle (sm90::TileOrder)
  std::string label;                          // the sm90 variant's description
};

// One matmul problem as gemm.cc passes it to cublasLtMatmul, minus the
// buffers the tuning must not touch (XLA's D and workspace).
struct Problem {
  cublasLtHandle_t handle;
  cublasLtMatmulDesc_t desc;  // holds the real scale (and bias) pointers
  cublasLtMatrixLayout_t a_layout, b_layout, d_layout;  // cuBLAS A, B, C = D
  const void* a;              // cuBLAS A, read only
  const void* b;              // cuBLAS B, read only
  size_t d_bytes;             // size of D
  uint32_t d_align;           // alignment of the real D (the scratch D copies it)
  size_t workspace_bytes;     // usable workspace of the real call
  // The real call's beta: 1 when it adds a residual (C). The timing runs
  // with C = the scratch D, so that its reads of C are timed too.
  float beta;
  // Runs an sm90 candidate into (d, workspace) on the stream (gemm.cc binds
  // the problem's operands); unset when there are none.
  std::function<cudaError_t(const Candidate&, void* d, void* ws, cudaStream_t)> run_sm90;
};

// "algo=.. tile=.. ..." from cublasLtMatmulAlgoConfigGetAttribute. The ids
// are the enums of cublasLt.h (cublasLtMatmulTile_t, cublasLtMatmulStages_t,
// cublasLtReductionScheme_t, cublasLtMatmulInnerShape_t,
// cublasLtClusterShape_t); -1 where the attribute could not be read.
inline std::string Describe(const cublasLtMatmulAlgo_t& algo) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr, auto zero) -> long long {
    decltype(zero) v = zero;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) !=
        CUBLAS_STATUS_SUCCESS)
      return -1;
    return static_cast<long long>(v);
  };
  char s[256];
  std::snprintf(s, sizeof(s),
                "algo=%lld tile=%lld stages=%lld splitk=%lld reduction=%lld swizzle=%lld "
                "custom=%lld inner=%lld cluster=%lld",
                get(CUBLASLT_ALGO_CONFIG_ID, int32_t{0}), get(CUBLASLT_ALGO_CONFIG_TILE_ID, uint32_t{0}),
                get(CUBLASLT_ALGO_CONFIG_STAGES_ID, uint32_t{0}),
                get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, int32_t{0}),
                get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, uint32_t{0}),
                get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, uint32_t{0}),
                get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, uint32_t{0}),
                get(CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, uint16_t{0}),
                get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, uint16_t{0}));
  return s;
}

// The per-device private stream, memory pool and timing events. Created on
// first use and kept for the process; guarded by SelectionMutex().
struct DeviceResources {
  cudaStream_t stream = nullptr;
  cudaMemPool_t pool = nullptr;
  std::vector<cudaEvent_t> events;
};

inline std::string CudaMessage(cudaError_t e, const char* what) {
  cudaGetLastError();  // clear a non-sticky error: later launch checks read it
  return std::string(what) + ": " + cudaGetErrorName(e);
}

// `dev` must be the current device. Returns "" or what failed.
inline std::string GetResources(int dev, DeviceResources** out) {
  static std::map<int, DeviceResources>* all = new std::map<int, DeviceResources>;
  DeviceResources& r = (*all)[dev];
  if (r.stream == nullptr) {
    int pools = 0;
    if (cudaError_t e = cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, dev); e)
      return CudaMessage(e, "cudaDeviceGetAttribute(MemoryPoolsSupported)");
    if (!pools) return "the device has no stream-ordered memory pools";
    cudaMemPoolProps props;
    std::memset(&props, 0, sizeof(props));
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = dev;
    // Release threshold left at 0: the scratch goes back to the driver at the
    // synchronization that ends each measurement instead of staying reserved.
    if (cudaError_t e = cudaMemPoolCreate(&r.pool, &props); e)
      return CudaMessage(e, "cudaMemPoolCreate");
    if (cudaError_t e = cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking); e) {
      r.stream = nullptr;
      return CudaMessage(e, "cudaStreamCreateWithFlags");
    }
  }
  *out = &r;
  return "";
}

// The scratch D and workspace of one measurement, freed on the private
// stream (then synchronized, so nothing of the measurement outlives it).
struct Scratch {
  cudaStream_t stream;
  void* d = nullptr;
  void* ws = nullptr;
  ~Scratch() {
    if (d) cudaFreeAsync(d, stream);
    if (ws) cudaFreeAsync(ws, stream);
    cudaStreamSynchronize(stream);
    cudaGetLastError();
  }
};

inline char* AlignUp(void* p, uintptr_t a) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<char*>((v + a - 1) / a * a);
}

// Times the usable candidates (skipped empty) of problem `p` on device `dev`
// (the current device), in heuristic order; sets each one's ms, or skipped
// when cublasLtMatmul rejects it. *reps: calls per timed sample. Returns ""
// or why the measurement could not be made (then no ms is set). Call under
// SelectionMutex() and inside gemm.cc's RelaxedCapture.
inline std::string Measure(int dev, const Problem& p, std::vector<Candidate>* cands, int* reps) {
  DeviceResources* r = nullptr;
  if (std::string err = GetResources(dev, &r); !err.empty()) return err;
  cudaStream_t s = r->stream;
  Scratch scratch{s};
  // The scratch D gets the real D's alignment (cuBLASLt was told it), the
  // workspace cuBLASLt's 256 bytes, as in the real call.
  if (cudaError_t e = cudaMallocFromPoolAsync(&scratch.d, p.d_bytes + 512, r->pool, s); e) {
    scratch.d = nullptr;
    return CudaMessage(e, "scratch D (cudaMallocFromPoolAsync)");
  }
  if (p.workspace_bytes) {
    if (cudaError_t e = cudaMallocFromPoolAsync(&scratch.ws, p.workspace_bytes + 256, r->pool, s);
        e) {
      scratch.ws = nullptr;
      return CudaMessage(e, "scratch workspace (cudaMallocFromPoolAsync)");
    }
  }
  void* d = AlignUp(scratch.d, 256) + (p.d_align < 256 ? p.d_align : 0);
  void* ws = p.workspace_bytes ? AlignUp(scratch.ws, 256) : nullptr;
  const float alpha = 1.f, beta = p.beta;
  auto run = [&](Candidate& c) {
    if (c.sm90 >= 0) {
      const cudaError_t e = p.run_sm90 ? p.run_sm90(c, d, ws, s) : cudaErrorInvalidValue;
      if (e != cudaSuccess) c.skipped = CudaMessage(e, "sm90 launch");
      return e == cudaSuccess;
    }
    cublasStatus_t st = cublasLtMatmul(p.handle, p.desc, &alpha, p.a, p.a_layout, p.b, p.b_layout,
                                       &beta, d, p.d_layout, d, p.d_layout, &c.heuristic.algo, ws,
                                       p.workspace_bytes, s);
    if (st != CUBLAS_STATUS_SUCCESS) {
      c.skipped = std::string("cublasLtMatmul: ") + cublasLtGetStatusName(st);
      cudaGetLastError();
    }
    return st == CUBLAS_STATUS_SUCCESS;
  };

  // 1. One untimed call each: loads the kernels (lazy module loading) and
  //    drops the candidates cuBLASLt refuses to run.
  std::vector<Candidate*> live;
  for (Candidate& c : *cands)
    if (c.skipped.empty() && run(c)) live.push_back(&c);
  if (live.empty()) return "";
  const size_t n = live.size();
  while (r->events.size() < n * kRounds + 1) {
    cudaEvent_t e;
    if (cudaError_t err = cudaEventCreate(&e); err) return CudaMessage(err, "cudaEventCreate");
    r->events.push_back(e);
  }
  cudaEvent_t* ev = r->events.data();
  auto elapsed = [&](size_t i, float* ms) { return cudaEventElapsedTime(ms, ev[i], ev[i + 1]); };

  // 2. One timed call each, to size the samples: short kernels are repeated
  //    so that a sample lasts about kTargetSampleMs (event resolution is
  //    about a microsecond).
  if (cudaError_t e = cudaEventRecord(ev[0], s); e) return CudaMessage(e, "cudaEventRecord");
  for (size_t i = 0; i < n; ++i) {
    run(*live[i]);
    if (cudaError_t e = cudaEventRecord(ev[i + 1], s); e) return CudaMessage(e, "cudaEventRecord");
  }
  if (cudaError_t e = cudaStreamSynchronize(s); e) return CudaMessage(e, "cudaStreamSynchronize");
  float fastest = kTargetSampleMs;
  for (size_t i = 0; i < n; ++i) {
    float ms = 0.f;
    if (cudaError_t e = elapsed(i, &ms); e) return CudaMessage(e, "cudaEventElapsedTime");
    if (live[i]->skipped.empty()) fastest = std::min(fastest, std::max(ms, 1e-4f));
  }
  *reps = std::min(static_cast<int>(std::ceil(kTargetSampleMs / fastest)), kMaxReps);

  // 3. kRounds rounds, every candidate once per round, back to back.
  if (cudaError_t e = cudaEventRecord(ev[0], s); e) return CudaMessage(e, "cudaEventRecord");
  for (size_t round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < n; ++i) {
      for (int k = 0; k < *reps && live[i]->skipped.empty(); ++k) run(*live[i]);
      if (cudaError_t e = cudaEventRecord(ev[round * n + i + 1], s); e)
        return CudaMessage(e, "cudaEventRecord");
    }
  }
  if (cudaError_t e = cudaStreamSynchronize(s); e) return CudaMessage(e, "cudaStreamSynchronize");
  for (size_t i = 0; i < n; ++i) {
    if (!live[i]->skipped.empty()) continue;
    std::vector<float> t(kRounds);
    for (size_t round = 0; round < kRounds; ++round) {
      if (cudaError_t e = elapsed(round * n + i, &t[round]); e)
        return CudaMessage(e, "cudaEventElapsedTime");
      t[round] /= static_cast<float>(*reps);
    }
    std::nth_element(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(kRounds / 2), t.end());
    live[i]->ms = t[kRounds / 2];
  }
  return "";
}

// Index (into cands) of the fastest timed candidate, preferring the
// heuristic's order within kMargin; -1 when none was timed.
inline int PickWinner(const std::vector<Candidate>& cands) {
  size_t best = cands.size();
  for (size_t i = 0; i < cands.size(); ++i) {
    if (cands[i].ms < 0.f) continue;
    if (best == cands.size() || cands[i].ms < cands[best].ms * (1.f - kMargin)) best = i;
  }
  return best == cands.size() ? -1 : static_cast<int>(best);
}

// The log lines of one selection, after `header` (one line naming the
// problem). flops = 2 M N K, for the TFLOP/s column.
inline std::string Report(const std::string& header, const std::vector<Candidate>& cands,
                          int winner, double flops, const std::string& note) {
  std::string out = header + "\n";
  char line[512];
  for (size_t i = 0; i < cands.size(); ++i) {
    const Candidate& c = cands[i];
    if (c.sm90 >= 0) {
      std::snprintf(line, sizeof(line), "te_jax gemm autotune:   candidate %d: %s ws=%zu: ",
                    c.index, c.label.c_str(), c.heuristic.workspaceSize);
    } else {
      std::snprintf(line, sizeof(line),
                    "te_jax gemm autotune:   candidate %d: %s waves=%.2f ws=%zu: ", c.index,
                    Describe(c.heuristic.algo).c_str(), c.heuristic.wavesCount,
                    c.heuristic.workspaceSize);
    }
    out += line;
    if (c.ms >= 0.f) {
      std::snprintf(line, sizeof(line), "median %.4f ms (%.0f TFLOP/s)\n", c.ms,
                    flops / (c.ms * 1e-3) / 1e12);
      out += line;
    } else {
      out += (c.skipped.empty() ? std::string("not timed") : "skipped (" + c.skipped + ")") + "\n";
    }
  }
  if (winner >= 0) {
    const Candidate& w = cands[static_cast<size_t>(winner)];
    std::snprintf(line, sizeof(line), "te_jax gemm autotune:   winner: candidate %d [%s]", w.index,
                  (w.sm90 >= 0 ? w.label : Describe(w.heuristic.algo)).c_str());
    out += line;
    if (w.ms >= 0.f && cands[0].ms >= 0.f) {
      std::snprintf(line, sizeof(line), " %.4f ms, %s first %.4f ms", w.ms,
                    cands[0].sm90 >= 0 ? "the list's" : "heuristic's", cands[0].ms);
      out += line;
    }
    out += note.empty() ? "\n" : "; " + note + "\n";
  }
  return out;
}

}  // namespace gemm_autotune
}  // namespace te_jax
