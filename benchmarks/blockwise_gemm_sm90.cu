// Checks and times te_jax's own sm_90a blockwise FP8 GEMM variants
// (custom_calls/kernels/gemm_sm90.cuh, built on CUTLASS) against cuBLASLt's
// blockwise GEMM, the one te_jax calls today, in te_jax's layout and scale
// layouts: out (M, N) bf16 = a (M, K) @ b (N, K)^T, a 1x128 (VEC128) and b
// 128x128 (BLK128x128) for fprop / dgrad, both 1x128 for wgrad.
//
// 1. Checks: every variant on odd shapes (1 row, M, N, K not multiples of
//    128) against a float64 host reference; outputs poisoned with NaN first,
//    scale padding NaN; each variant run twice and compared bit for bit
//    (a moving result is a race).
// 2. Timing: cuBLASLt (heuristic's first answer, as te_jax runs it) and
//    every variant on the shapes of BENCHMARKS.md and DeepGEMM's table, with
//    rotating input sets (> L2), interleaved rounds, median of CUDA-event
//    samples; each variant's output is also compared with cuBLASLt's.
//
// Build (tools/gpu_kernels.sh does): nvcc -std=c++17 -O3
//   -gencode=arch=compute_90a,code=sm_90a -Icustom_calls -I.cutlass/include
//   benchmarks/blockwise_gemm_sm90.cu <kernel objects> -lcublasLt
// Run: blockwise_gemm_sm90 [--checks | --timing] [--only v1,v2] [--quick]
//   [--sweep] [--rounds N]. --quick: 3 shapes; --sweep: also time raster
//   order x swizzle for each variant on each shape (prints the best).
// Prints CHECK lines, one TIME line per shape, and a summary table last.
#include <cstring>
#include <memory>

#include "gemm_sm90_bench.cuh"
#include "kernels/gemm_sm90.cuh"

namespace {

namespace sm90 = te_jax::sm90;
using bench::DeviceAlloc;

// bfloat16 output tolerance of te_jax's blockwise GEMM tests
// (tests/test_cuda_ops.py _TOL[bfloat16]).
constexpr double kTol = 1e-2;

using Operands = bench::BlockwiseOperands;

// The te_jax kernel's arguments for the operands `op`, writing to `out`.
sm90::BlockwiseGemmArgs Args(const Operands& op, void* out, sm90::TileOrder order = {}) {
  sm90::BlockwiseGemmArgs p;
  p.m = op.m; p.n = op.n; p.k = op.k;
  p.a = op.a; p.b = op.b; p.a_sinv = op.sa; p.b_sinv = op.sb;
  p.a_mode = op.a_mode; p.b_mode = op.b_mode;
  p.out = out;
  p.order = order;
  return p;
}

struct Variant {
  sm90::BlockwiseVariant id;
  const char* name;
  sm90::ScaleMode a_mode, b_mode;
};
std::vector<Variant> AllVariants() {
  std::vector<Variant> v;
#define TE_JAX_X(id, name, a_mode, b_mode) \
  v.push_back({sm90::BlockwiseVariant::id, name, sm90::ScaleMode::a_mode, sm90::ScaleMode::b_mode});
  TE_JAX_SM90_BLOCKWISE_VARIANTS(TE_JAX_X)
#undef TE_JAX_X
  return v;
}

// Launches a variant with a workspace of the size it asks for (kept per call
// site; the variants here ask for none).
bool Launch(const Variant& v, const sm90::BlockwiseGemmArgs& p, int sms, cudaStream_t s) {
  static void* ws = nullptr;
  static size_t ws_bytes = 0;
  const size_t need = sm90::BlockwiseGemmWorkspace(v.id, p, sms);
  if (need > ws_bytes) {
    if (ws) CHECK_CUDA(cudaFree(ws));
    CHECK_CUDA(cudaMalloc(&ws, need));
    ws_bytes = need;
  }
  return sm90::LaunchBlockwiseGemm(v.id, p, ws, ws_bytes, sms, s) == cudaSuccess;
}

int failures = 0;

// Part 1: every variant against the float64 reference on odd shapes.
void RunChecks(const std::vector<Variant>& variants, int sms) {
  struct Shape { long m, n, k; };
  const Shape shapes[] = {{1, 128, 128},    {16, 272, 400},  {200, 384, 528},
                          {144, 2112, 1040}, {384, 640, 256}, {256, 256, 4096}};
  const sm90::ScaleMode modes[][2] = {{sm90::ScaleMode::kVec128, sm90::ScaleMode::kBlk128x128},
                                      {sm90::ScaleMode::kVec128, sm90::ScaleMode::kVec128}};
  uint64_t seed = 100;
  for (const auto& mode : modes) {
    for (const Shape& s : shapes) {
      Operands op(s.m, s.n, s.k, mode[0], mode[1], seed += 10);
      const auto want = bench::BlockwiseHostReference(op);
      const size_t n_out = size_t(s.m) * s.n;
      void* out = DeviceAlloc<uint16_t>(n_out);
      for (const Variant& v : variants) {
        if (v.a_mode != mode[0] || v.b_mode != mode[1]) continue;
        const auto p = Args(op, out);
        const char* why = sm90::CheckBlockwiseGemm(v.id, p);
        if (why) {
          std::printf("CHECK %-30s m=%-5ld n=%-5ld k=%-5ld SKIP (%s)\n", v.name, s.m, s.n, s.k, why);
          continue;
        }
        std::vector<__nv_bfloat16> first;
        bool ok = true, same = true;
        bench::ErrorNorm e;
        for (int run = 0; run < 2; ++run) {
          bench::Poison(out, n_out);
          ok = ok && Launch(v, p, sms, 0) && cudaDeviceSynchronize() == cudaSuccess;
          if (!ok) break;
          auto got = bench::ToHost<__nv_bfloat16>(out, n_out);
          if (run == 0) {
            e = bench::HostDiff(got, want);
            first = std::move(got);
          } else {
            same = std::memcmp(first.data(), got.data(), n_out * 2) == 0;
          }
        }
        const bool pass = ok && same && e.bad == 0 && e.rel < kTol;
        failures += !pass;
        std::printf("CHECK %-30s m=%-5ld n=%-5ld k=%-5ld rel_err=%.2e nonfinite=%lld repeat=%s %s\n",
                    v.name, s.m, s.n, s.k, e.rel, e.bad, same ? "same" : "DIFFERS",
                    pass ? "PASS" : (ok ? "FAIL" : "FAIL (launch)"));
      }
      CHECK_CUDA(cudaFree(out));
    }
  }
}

struct Row {
  std::string label;
  long m, n, k;
  double lt_tflops;
  std::string best;
  double best_tflops;
};

// Part 2: one shape, cuBLASLt and every matching variant.
Row TimeShape(const bench::BlockwiseShape& s, const std::vector<Variant>& variants, int sms,
              cublasLtHandle_t lt, void* lt_ws, size_t lt_ws_bytes, int rounds, bool sweep) {
  const sm90::ScaleMode am = sm90::ScaleMode::kVec128;
  const sm90::ScaleMode bm = s.wgrad ? sm90::ScaleMode::kVec128 : sm90::ScaleMode::kBlk128x128;
  const int sets = bench::RotatingSets(size_t(s.m + s.n) * s.k);
  std::vector<std::unique_ptr<Operands>> ops;
  for (int i = 0; i < sets; ++i)
    ops.emplace_back(new Operands(s.m, s.n, s.k, am, bm, 1000 + 10 * i));
  const size_t n_out = size_t(s.m) * s.n;
  void* ref = DeviceAlloc<uint16_t>(n_out);
  void* out = DeviceAlloc<uint16_t>(n_out);
  bench::LtGemm gemm(lt, s.m, s.n, s.k, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF, 1,
                     s.wgrad ? 1 : 2, false, lt_ws, lt_ws_bytes);
  const Operands& o0 = *ops[0];
  bench::Poison(ref, n_out);
  if (gemm.Run(o0.a, o0.b, o0.sa, o0.sb, ref, 0) != CUBLAS_STATUS_SUCCESS) {
    std::printf("TIME %s: cuBLASLt failed\n", s.label);
    ++failures;
  }
  CHECK_CUDA(cudaDeviceSynchronize());

  std::vector<bench::Candidate> cands;
  std::vector<const Variant*> cand_variant;
  std::vector<sm90::TileOrder> cand_order;
  cands.push_back({"cublaslt", [&](int r) {
                     const Operands& o = *ops[r % sets];
                     return gemm.Run(o.a, o.b, o.sa, o.sb, out, 0) == CUBLAS_STATUS_SUCCESS;
                   }});
  cand_variant.push_back(nullptr);
  cand_order.push_back({});
  std::vector<sm90::TileOrder> orders = {{}};
  if (sweep) {
    for (int raster : {1, 2})
      for (int swz : {1, 2, 4, 8}) orders.push_back({raster, swz});
  }
  std::string checks;
  for (const Variant& v : variants) {
    if (v.a_mode != am || v.b_mode != bm) continue;
    const char* why = sm90::CheckBlockwiseGemm(v.id, Args(o0, out));
    if (why) {
      checks += std::string(" ") + v.name + "=skip(" + why + ")";
      continue;
    }
    bench::Poison(out, n_out);
    const bool ok = Launch(v, Args(o0, out), sms, 0) && cudaDeviceSynchronize() == cudaSuccess;
    const bench::ErrorNorm e = ok ? bench::DeviceDiff(out, ref, n_out) : bench::ErrorNorm{1, 1};
    const bool pass = ok && e.bad == 0 && e.rel < kTol;
    failures += !pass;
    char buf[160];
    std::snprintf(buf, sizeof(buf), " %s=%.1e%s", v.name, e.rel, pass ? "" : "(FAIL)");
    checks += buf;
    for (const sm90::TileOrder& order : orders) {
      const Variant* vp = &v;
      cands.push_back({v.name, [&ops, sets, vp, order, out, sms](int r) {
                         const Operands& o = *ops[r % sets];
                         return Launch(*vp, Args(o, out, order), sms, 0);
                       }});
      cand_variant.push_back(vp);
      cand_order.push_back(order);
    }
  }
  const std::vector<double> ms = bench::TimeInterleaved(cands, rounds);
  const double flop = 2.0 * s.m * s.n * s.k;
  auto tflops = [&](double t) { return std::isnan(t) ? NAN : flop / t * 1e-9; };
  Row row{s.label, s.m, s.n, s.k, tflops(ms[0]), "-", NAN};
  std::printf("TIME %-14s M=%-6ld N=%-6ld K=%-6ld cublaslt %6.3f ms %5.0f TF/s |", s.label, s.m,
              s.n, s.k, ms[0], row.lt_tflops);
  for (size_t c = 1; c < cands.size(); ++c) {
    const double tf = tflops(ms[c]);
    const sm90::TileOrder& order = cand_order[c];
    if (order.raster == 0 || !sweep)
      std::printf(" %s %5.0f (%.3fx)", cands[c].name.c_str(), tf, tf / row.lt_tflops);
    if (!std::isnan(tf) && (std::isnan(row.best_tflops) || tf > row.best_tflops)) {
      row.best_tflops = tf;
      row.best = cands[c].name + (order.raster ? "/r" + std::to_string(order.raster) + "s" +
                                                     std::to_string(order.swizzle)
                                               : "");
    }
  }
  std::printf("\nCHECK-vs-cublaslt %s:%s\n", s.label, checks.c_str());
  std::fflush(stdout);
  CHECK_CUDA(cudaFree(ref));
  CHECK_CUDA(cudaFree(out));
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Options opt = bench::ParseOptions(argc, argv);
  if (bench::ListVariants(opt, AllVariants())) return 0;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = bench::SmCount();
  std::printf("device: %s, %d SMs, %d MiB L2\n", prop.name, sms, prop.l2CacheSize >> 20);
  std::vector<Variant> variants;
  for (const Variant& v : AllVariants())
    if (opt.Keeps(v.name)) variants.push_back(v);
  if (opt.checks) RunChecks(variants, sms);
  if (!opt.timing) {
    std::printf("checks: %s (%d failure(s))\n", failures ? "FAILED" : "all passed", failures);
    return failures ? 1 : 0;
  }

  std::vector<bench::BlockwiseShape> shapes;
  for (const auto& s : bench::BlockwiseShapes()) {
    if (!opt.quick || !std::strcmp(s.label, "square8k") || !std::strcmp(s.label, "mlp_fc1_fprop") ||
        !std::strcmp(s.label, "mlp_fc1_wgrad"))
      shapes.push_back(s);
  }
  cublasLtHandle_t lt;
  CHECK_LT(cublasLtCreate(&lt));
  const size_t lt_ws_bytes = size_t(32) << 20;
  void* lt_ws = DeviceAlloc<uint8_t>(lt_ws_bytes);
  std::vector<Row> rows;
  for (const auto& s : shapes)
    rows.push_back(TimeShape(s, variants, sms, lt, lt_ws, lt_ws_bytes, opt.rounds, opt.sweep));

  std::printf("\nSUMMARY (TFLOP/s, median; best of %zu variants%s vs cuBLASLt blockwise) on %s\n",
              variants.size(), opt.sweep ? " x tile orders" : "", prop.name);
  std::printf("%-20s %6s %6s %6s %9s %9s %7s  %s\n", "shape", "M", "N", "K", "cublaslt", "ours",
              "ratio", "best variant");
  for (const Row& r : rows)
    std::printf("%-20s %6ld %6ld %6ld %9.0f %9.0f %7.3f  %s\n", r.label.c_str(), r.m, r.n, r.k,
                r.lt_tflops, r.best_tflops, r.best_tflops / r.lt_tflops, r.best.c_str());
  std::printf("checks: %s (%d failure(s))\n", failures ? "FAILED" : "all passed", failures);
  return failures ? 1 : 0;
}
