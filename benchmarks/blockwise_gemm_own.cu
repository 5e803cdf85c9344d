// Checks and times te_jax's own sm_90a blockwise FP8 GEMM
// (blockwise_gemm_own.cuh: the kernel; _ptx.cuh: its PTX; _launch.cuh: its
// launch and configurations; issue 46) against cuBLASLt's blockwise GEMM in
// the scalings of blockwise_gemm_sm90.cu: out (M, N) bf16 =
// a (M, K) @ b (N, K)^T, a 1x128 (VEC128), b 128x128 (BLK128x128; fprop,
// dgrad) or 1x128 too (wgrad), te_jax's native scale layouts, the same
// cuBLASLt call (bench::LtGemm, heuristic's first answer) and the same
// tolerance (1e-2 relative, norm-wise).
//
// 1. Checks (--checks): every configuration on small shapes against a
//    float64 host reference and on two larger ones (more tiles than SMs:
//    the persistent loop, partial N tiles) against an fp32 device reference
//    of the same promotion order; outputs poisoned with NaN first; each run
//    twice and compared bit for bit (a moving result is a race).
// 2. Timing (--timing): cuBLASLt and every configuration on the shapes of
//    blockwise_gemm_sm90.cu, rotating input sets (> L2), interleaved rounds,
//    median of CUDA-event samples; each configuration's output is compared
//    with cuBLASLt's first. The wgrad shapes are timed in the wgrad scaling
//    (b 1x128 too: the "wgrad_" configurations, cuBLASLt in that mode).
//    Diagnostic configurations (names "diag_...", own::Config::diagnostic)
//    are timed only: they compute no correct GEMM, so they are neither
//    checked nor ranked; their ratios to cuBLASLt are listed apart.
//
// A blind first run must not hang the GPU: every bounded mbarrier wait in
// the kernel traps after ~1 s, and every first launch of a configuration on
// a shape is polled with a 5 s watchdog. A hang or fault kills the CUDA
// context, so the process prints "DROP <config> (...)" and exits (124 hang,
// 125 fault); tools/gpu_kernels.sh drops that configuration and reruns.
//
// Build (tools/gpu_kernels.sh own does): nvcc -std=c++17 -O3
//   -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr
//   -Icustom_calls -Ibenchmarks -I.cutlass/include
//   benchmarks/blockwise_gemm_own.cu -lcublasLt
// Run: blockwise_gemm_own [--list | --checks | --timing] [--only c1,c2]
//   [--quick] [--sweep] [--rounds N]. --quick: 4 shapes (one wgrad); --sweep: also the
//   raster group widths 4 and 16 (default 8). TE_JAX_OWN_CLUSTERS=N: the
//   cluster-2 configurations launch N clusters, whatever the occupancy
//   query says (the header line prints each configuration's resident CTAs).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>

#include "blockwise_gemm_own_launch.cuh"
#include "gemm_sm90_bench.cuh"

namespace {

namespace sm90 = te_jax::sm90;
namespace own = te_jax::own;
using bench::DeviceAlloc;

constexpr double kTol = 1e-2;       // as blockwise_gemm_sm90.cu (tests' bf16 tolerance)
constexpr double kWatchdogS = 5.0;  // a GEMM here lasts < 50 ms
int failures = 0;

// One problem's operands (one input set): a scaled per 1x128, b per
// 128x128 (fprop, dgrad) or, `b_vec`, per 1x128 too (wgrad), the cases of
// blockwise_gemm_sm90.cu.
struct Operands : bench::BlockwiseOperands {
  Operands(long m_, long n_, long k_, uint64_t seed, bool b_vec_ = false)
      : bench::BlockwiseOperands(m_, n_, k_, sm90::ScaleMode::kVec128,
                                 b_vec_ ? sm90::ScaleMode::kVec128 : sm90::ScaleMode::kBlk128x128,
                                 seed),
        b_vec(b_vec_) {}
  bool b_vec;
  int LtMode() const { return b_vec ? 1 : 2; }  // bench::LtGemm's b scale mode
  own::GemmArgs Args(void* out, int group = 8) const {
    own::GemmArgs p;
    p.m = m; p.n = n; p.k = k;
    p.a = a; p.b = b;
    p.a_sinv = sa; p.a_ld = ga.ld;
    p.b_sinv = sb; p.b_ld = gb.ld;
    p.out = static_cast<__nv_bfloat16*>(out);
    p.group = group;
    p.b_vec = b_vec;
    return p;
  }
};

// fp32 device reference, the kernel's promotion order: per 128-block of K a
// partial sum, then acc += (sa * sb) * partial. One thread per output.
__global__ void DeviceReferenceKernel(own::GemmArgs p) {
  const long j = blockIdx.x * long(blockDim.x) + threadIdx.x, i = blockIdx.y;
  if (j >= p.n) return;
  const uint8_t* ar = p.a + i * p.k;
  const uint8_t* br = p.b + j * p.k;
  float acc = 0.f;
  for (long kb = 0; kb < p.k / 128; ++kb) {
    float part = 0.f;
    for (int t = 0; t < 128; t += 16) {
      const uint4 va = *reinterpret_cast<const uint4*>(ar + kb * 128 + t);
      const uint4 vb = *reinterpret_cast<const uint4*>(br + kb * 128 + t);
      const uint8_t* xa = reinterpret_cast<const uint8_t*>(&va);
      const uint8_t* xb = reinterpret_cast<const uint8_t*>(&vb);
      for (int u = 0; u < 16; ++u) {
        __nv_fp8_e4m3 fa, fb;
        fa.__x = xa[u];
        fb.__x = xb[u];
        part = fmaf(float(fa), float(fb), part);
      }
    }
    const float sb = p.b_vec ? p.b_sinv[kb * p.b_ld + j] : p.b_sinv[(j / 128) * p.b_ld + kb];
    acc = fmaf(p.a_sinv[kb * p.a_ld + i] * sb, part, acc);
  }
  p.out[i * p.n + j] = __float2bfloat16(acc);
}
void DeviceReference(const Operands& op, void* out) {
  DeviceReferenceKernel<<<dim3(unsigned((op.n + 255) / 256), unsigned(op.m)), 256>>>(op.Args(out));
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
}

// max |got - want| over the outputs, and max |want|: the max relative error
// printed beside the norm-wise one that decides pass / fail.
__global__ void MaxDiffKernel(const __nv_bfloat16* got, const __nv_bfloat16* want, size_t n,
                              unsigned* out) {  // non-negative floats order as their bits
  float d = 0.f, w = 0.f;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float g = __bfloat162float(got[i]), r = __bfloat162float(want[i]);
    if (isfinite(g)) d = fmaxf(d, fabsf(g - r));
    w = fmaxf(w, fabsf(r));
  }
  atomicMax(&out[0], __float_as_uint(d));
  atomicMax(&out[1], __float_as_uint(w));
}
struct Err {
  double rel = 1, max_rel = 1;
  long long bad = 1;
  bool Pass() const { return bad == 0 && rel < kTol; }
};
Err Compare(const void* got, const void* want, size_t n) {
  const bench::ErrorNorm e = bench::DeviceDiff(got, want, n);
  unsigned* mx = DeviceAlloc<unsigned>(2);
  CHECK_CUDA(cudaMemset(mx, 0, 2 * sizeof(unsigned)));
  MaxDiffKernel<<<bench::Blocks(n), 256>>>(static_cast<const __nv_bfloat16*>(got),
                                           static_cast<const __nv_bfloat16*>(want), n, mx);
  CHECK_CUDA(cudaGetLastError());
  const auto h = bench::ToHost<unsigned>(mx, 2);
  CHECK_CUDA(cudaFree(mx));
  float d, w;
  std::memcpy(&d, &h[0], 4);
  std::memcpy(&w, &h[1], 4);
  return {e.rel, w > 0 ? d / w : d, e.bad};
}

// One launch, waited for under the watchdog (see the header). False when
// the launch itself was refused (not sticky: the others go on).
bool Guarded(const own::Config& c, const own::GemmArgs& p, int sms, const char* what) {
  cudaError_t e = c.launch(p, sms, 0);
  if (e != cudaSuccess) {
    std::printf("LAUNCH-ERROR %s on %s: %s\n", c.name, what, cudaGetErrorString(e));
    cudaGetLastError();
    return false;
  }
  const auto t0 = std::chrono::steady_clock::now();
  while ((e = cudaStreamQuery(0)) == cudaErrorNotReady) {
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > kWatchdogS) {
      std::printf("DROP %s (hang: no completion on %s after %.0f s)\n", c.name, what, kWatchdogS);
      std::fflush(stdout);
      _exit(124);
    }
    usleep(100);
  }
  if (e != cudaSuccess) {
    std::printf("DROP %s (fault on %s: %s)\n", c.name, what, cudaGetErrorString(e));
    std::fflush(stdout);
    _exit(125);
  }
  return true;
}

// Part 1: every configuration against the references.
void RunChecks(const std::vector<own::Config>& configs, int sms, cublasLtHandle_t lt, void* lt_ws,
               size_t lt_ws_bytes) {
  struct Shape { long m, n, k; bool host; };
  // N 640 / 1152 / 4224 leave partial N tiles for BN 144 / 160 / 192; the
  // last two have more tiles than SMs (each CTA loops over several).
  const Shape shapes[] = {{128, 128, 128, true},    {256, 384, 512, true},
                          {512, 1152, 256, true},   {256, 640, 1024, true},
                          {256, 2304, 384, true},   {2048, 2048, 2048, false},
                          {1024, 4224, 1152, false}};
  uint64_t seed = 300;
  for (const bool b_vec : {false, true})
  for (const Shape& s : shapes) {
    if (std::none_of(configs.begin(), configs.end(),
                     [&](const own::Config& c) { return c.b_vec == b_vec; }))
      continue;  // no configuration of this scaling
    Operands op(s.m, s.n, s.k, seed += 10, b_vec);
    const size_t n_out = size_t(s.m) * s.n;
    void* out = DeviceAlloc<uint16_t>(n_out);
    void* first = DeviceAlloc<uint16_t>(n_out);
    void* want = DeviceAlloc<uint16_t>(n_out);
    std::vector<double> host_want;
    if (s.host) {
      host_want = bench::BlockwiseHostReference(op);
    } else {
      bench::Poison(want, n_out);
      DeviceReference(op, want);
      // The reference itself against cuBLASLt: the harness's semantics.
      bench::LtGemm gemm(lt, s.m, s.n, s.k, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF, 1,
                         op.LtMode(), false, lt_ws, lt_ws_bytes);
      bench::Poison(out, n_out);
      const bool ok = gemm.Run(op.a, op.b, op.sa, op.sb, out, 0) == CUBLAS_STATUS_SUCCESS &&
                      cudaDeviceSynchronize() == cudaSuccess;
      const Err e = ok ? Compare(out, want, n_out) : Err{};
      failures += !e.Pass();
      std::printf("CHECK %-16s m=%-5ld n=%-5ld k=%-5ld rel_err=%.2e max_rel=%.2e nonfinite=%lld %s"
                  " (cuBLASLt vs the device reference)\n", "cublaslt", s.m, s.n, s.k, e.rel,
                  e.max_rel, e.bad, e.Pass() ? "PASS" : "FAIL");
    }
    for (const own::Config& c : configs) {
      if (c.b_vec != b_vec) continue;  // checked on its own scaling's operands
      const own::GemmArgs p = op.Args(out);
      if (c.diagnostic) {
        std::printf("CHECK %-16s m=%-5ld n=%-5ld k=%-5ld SKIP (diagnostic: not a correct GEMM)\n",
                    c.name, s.m, s.n, s.k);
        continue;
      }
      if (const char* why = own::CheckShape(p, c.cluster, c.tma_scales(), c.tma_store, c.b_vec)) {
        std::printf("CHECK %-16s m=%-5ld n=%-5ld k=%-5ld SKIP (%s)\n", c.name, s.m, s.n, s.k, why);
        continue;
      }
      char what[64];
      std::snprintf(what, sizeof(what), "check %ldx%ldx%ld", s.m, s.n, s.k);
      Err e;
      bool ok = true, same = true;
      for (int run = 0; run < 2 && ok; ++run) {
        bench::Poison(out, n_out);
        ok = Guarded(c, p, sms, what);
        if (!ok) break;
        if (run == 0) {
          if (s.host) {
            const bench::ErrorNorm h = bench::HostDiff(bench::ToHost<__nv_bfloat16>(out, n_out), host_want);
            e = {h.rel, 0, h.bad};
            // max relative error on the host for these small shapes
            const auto got = bench::ToHost<__nv_bfloat16>(out, n_out);
            double d = 0, w = 0;
            for (size_t i = 0; i < n_out; ++i) {
              const double g = __bfloat162float(got[i]);
              if (std::isfinite(g)) d = std::max(d, std::fabs(g - host_want[i]));
              w = std::max(w, std::fabs(host_want[i]));
            }
            e.max_rel = w > 0 ? d / w : d;
          } else {
            e = Compare(out, want, n_out);
          }
          CHECK_CUDA(cudaMemcpy(first, out, n_out * 2, cudaMemcpyDeviceToDevice));
        } else {
          const auto x = bench::ToHost<uint16_t>(first, n_out), y = bench::ToHost<uint16_t>(out, n_out);
          same = std::memcmp(x.data(), y.data(), n_out * 2) == 0;
        }
      }
      const bool pass = ok && same && e.Pass();
      failures += !pass;
      std::printf("CHECK %-16s m=%-5ld n=%-5ld k=%-5ld rel_err=%.2e max_rel=%.2e nonfinite=%lld "
                  "repeat=%s %s (vs %s reference)\n", c.name, s.m, s.n, s.k, e.rel, e.max_rel, e.bad,
                  same ? "same" : "DIFFERS", pass ? "PASS" : (ok ? "FAIL" : "FAIL (launch)"),
                  s.host ? "float64 host" : "fp32 device");
      std::fflush(stdout);
    }
    CHECK_CUDA(cudaFree(out));
    CHECK_CUDA(cudaFree(first));
    CHECK_CUDA(cudaFree(want));
  }
}

struct Row {
  std::string label;
  long m, n, k;
  double lt_tflops, best_tflops = NAN;
  std::string best = "-";
};
std::map<std::string, std::vector<double>> ratios;  // per configuration, over shapes

// Part 2: one shape, cuBLASLt and every configuration (x raster widths).
Row TimeShape(const bench::BlockwiseShape& s, const std::vector<own::Config>& configs, int sms,
              cublasLtHandle_t lt, void* lt_ws, size_t lt_ws_bytes, int rounds, bool sweep) {
  const int sets = bench::RotatingSets(size_t(s.m + s.n) * s.k);
  std::vector<std::unique_ptr<Operands>> ops;
  for (int i = 0; i < sets; ++i)
    ops.emplace_back(new Operands(s.m, s.n, s.k, 1000 + 10 * i, s.wgrad));
  const size_t n_out = size_t(s.m) * s.n;
  void* ref = DeviceAlloc<uint16_t>(n_out);
  void* out = DeviceAlloc<uint16_t>(n_out);
  bench::LtGemm gemm(lt, s.m, s.n, s.k, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF, 1,
                     ops[0]->LtMode(), false, lt_ws, lt_ws_bytes);
  const Operands& o0 = *ops[0];
  bench::Poison(ref, n_out);
  if (gemm.Run(o0.a, o0.b, o0.sa, o0.sb, ref, 0) != CUBLAS_STATUS_SUCCESS) {
    std::printf("TIME %s: cuBLASLt failed\n", s.label);
    ++failures;
  }
  CHECK_CUDA(cudaDeviceSynchronize());

  std::vector<bench::Candidate> cands;
  std::vector<std::string> cand_config;
  cands.push_back({"cublaslt", [&](int r) {
                     const Operands& o = *ops[r % sets];
                     return gemm.Run(o.a, o.b, o.sa, o.sb, out, 0) == CUBLAS_STATUS_SUCCESS;
                   }});
  cand_config.push_back("");
  std::vector<int> groups = {8};
  if (sweep) groups = {8, 4, 16};
  std::string checks;
  for (const own::Config& c : configs) {
    if (c.b_vec != s.wgrad) continue;  // another scaling's configuration
    if (const char* why = own::CheckShape(o0.Args(out), c.cluster, c.tma_scales(), c.tma_store,
                                          c.b_vec)) {
      checks += std::string(" ") + c.name + "=skip(" + why + ")";
      continue;
    }
    bench::Poison(out, n_out);
    const bool ok = Guarded(c, o0.Args(out), sms, s.label);
    if (c.diagnostic) {
      // Timed, never compared (it computes no correct GEMM) nor ranked.
      if (!ok) { ++failures; continue; }
      checks += std::string(" ") + c.name + "=diagnostic";
    } else {
      const Err e = ok ? Compare(out, ref, n_out) : Err{};
      failures += !e.Pass();
      char buf[160];
      std::snprintf(buf, sizeof(buf), " %s=%.1e/max%.1e%s", c.name, e.rel, e.max_rel, e.Pass() ? "" : "(FAIL)");
      checks += buf;
      if (!e.Pass()) continue;  // a wrong kernel is not timed
    }
    for (int g : groups) {
      const own::Config* cp = &c;
      cands.push_back({std::string(c.name) + (g == 8 ? "" : "/g" + std::to_string(g)),
                       [&ops, sets, cp, g, out, sms](int r) {
                         const Operands& o = *ops[r % sets];
                         return cp->launch(o.Args(out, g), sms, 0) == cudaSuccess;
                       }});
      cand_config.push_back(c.diagnostic ? "" : c.name);  // "": not ranked
    }
  }
  const std::vector<double> ms = bench::TimeInterleaved(cands, rounds);
  const double flop = 2.0 * s.m * s.n * s.k;
  auto tflops = [&](double t) { return std::isnan(t) ? NAN : flop / t * 1e-9; };
  Row row{s.label, s.m, s.n, s.k, tflops(ms[0])};
  std::printf("TIME %-22s M=%-6ld N=%-6ld K=%-6ld cublaslt %6.3f ms %5.0f TF/s |", s.label, s.m,
              s.n, s.k, ms[0], row.lt_tflops);
  std::map<std::string, double> best_of_config;
  for (size_t c = 1; c < cands.size(); ++c) {
    const double tf = tflops(ms[c]);
    std::printf(" %s %5.0f (%.3fx)", cands[c].name.c_str(), tf, tf / row.lt_tflops);
    if (cand_config[c].empty()) {  // a diagnostic: its own ratios, not the best
      if (!std::isnan(tf)) ratios[cands[c].name].push_back(tf / row.lt_tflops);
      continue;
    }
    if (!std::isnan(tf)) {
      double& b = best_of_config[cand_config[c]];
      b = std::max(b, tf);
      if (std::isnan(row.best_tflops) || tf > row.best_tflops) {
        row.best_tflops = tf;
        row.best = cands[c].name;
      }
    }
  }
  for (const auto& kv : best_of_config) ratios[kv.first].push_back(kv.second / row.lt_tflops);
  std::printf("\nCHECK-vs-cublaslt %s:%s\n", s.label, checks.c_str());
  std::fflush(stdout);
  CHECK_CUDA(cudaFree(ref));
  CHECK_CUDA(cudaFree(out));
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Options opt = bench::ParseOptions(argc, argv);
  if (bench::ListVariants(opt, own::Configs())) return 0;
  std::vector<own::Config> configs;
  for (const own::Config& c : own::Configs())
    if (opt.Keeps(c.name)) configs.push_back(c);
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = bench::SmCount();
  std::printf("device: %s, %d SMs, %d MiB L2; configurations:", prop.name, sms, prop.l2CacheSize >> 20);
  // Resident CTAs per configuration: a cluster-2 configuration the GPU can
  // hold fewer of than its SMs runs on fewer SMs (run AP: the cluster-2
  // configurations at 0.37-0.43x of cuBLASLt, the others 0.55-0.72x).
  for (const own::Config& c : configs)
    std::printf(" %s(BN %d, %d stages, cluster %d%s%s%s%s; %d resident CTAs)", c.name, c.bn,
                c.stages, c.cluster, c.double_acc ? ", 2 accumulators" : "",
                c.scale_load == own::kScalesTma    ? ", TMA scales"
                : c.scale_load == own::kScalesTmaA ? ", TMA a scales"
                                                   : "",
                c.tma_store ? ", TMA stores" : "",
                c.diagnostic ? ", DIAGNOSTIC" : "", c.resident_ctas(sms));
  std::printf("\n");
  if (!own::EncodeTiled()) {
    std::printf("no cuTensorMapEncodeTiled from the driver\nchecks: FAILED (1 failure(s))\n");
    return 1;
  }
  cublasLtHandle_t lt;
  CHECK_LT(cublasLtCreate(&lt));
  const size_t lt_ws_bytes = size_t(32) << 20;
  void* lt_ws = DeviceAlloc<uint8_t>(lt_ws_bytes);
  if (opt.checks) RunChecks(configs, sms, lt, lt_ws, lt_ws_bytes);
  if (!opt.timing) {
    std::printf("checks: %s (%d failure(s))\n", failures ? "FAILED" : "all passed", failures);
    return failures ? 1 : 0;
  }
  std::vector<Row> rows;
  for (const auto& s : bench::BlockwiseShapes()) {
    if (opt.quick && std::strcmp(s.label, "square8k") && std::strcmp(s.label, "mlp_fc1_fprop") &&
        std::strcmp(s.label, "mlp_fc1_dgrad") && std::strcmp(s.label, "mlp_fc1_wgrad"))
      continue;
    rows.push_back(TimeShape(s, configs, sms, lt, lt_ws, lt_ws_bytes, opt.rounds, opt.sweep));
  }
  const size_t ranked = std::count_if(configs.begin(), configs.end(),
                                      [](const own::Config& c) { return !c.diagnostic; });
  std::printf("\nSUMMARY (TFLOP/s, median; best of %zu configurations%s vs cuBLASLt blockwise "
              "1x128 x 128x128; diagnostics not ranked) on %s\n", ranked,
              opt.sweep ? " x raster widths" : "", prop.name);
  std::printf("%-22s %6s %6s %6s %9s %9s %7s  %s\n", "shape", "M", "N", "K", "cublaslt", "ours",
              "ratio", "best configuration");
  for (const Row& r : rows)
    std::printf("%-22s %6ld %6ld %6ld %9.0f %9.0f %7.3f  %s\n", r.label.c_str(), r.m, r.n, r.k,
                r.lt_tflops, r.best_tflops, r.best_tflops / r.lt_tflops, r.best.c_str());
  std::printf("per configuration, vs cuBLASLt over the shapes it ran (geometric mean, min):\n");
  for (const auto& kv : ratios) {
    double lg = 0, mn = INFINITY;
    for (double x : kv.second) { lg += std::log(x); mn = std::min(mn, x); }
    std::printf("  %-16s %6.3f %6.3f  (%zu shapes)\n", kv.first.c_str(),
                std::exp(lg / kv.second.size()), mn, kv.second.size());
  }
  std::printf("checks: %s (%d failure(s))\n", failures ? "FAILED" : "all passed", failures);
  return failures ? 1 : 0;
}
