// Checks and times te_jax's own sm_90a grouped GEMMs
// (custom_calls/kernels/gemm_sm90.cuh, built on CUTLASS's pointer-array
// grouped kernels) for mixture-of-experts layers: group sizes on the device,
// rows grouped (fprop, dgrad) or the contraction grouped (wgrad), FP8 with
// per-tensor or blockwise scaling, and bf16 (the FP8-off layers' GEMMs; their
// wgrad on the row-major x (m, k) and grad (m, n) as stored: bf16_mn_major).
//
// 1. Checks against a float64 host reference: odd shapes (k, n not multiples
//    of 128), empty groups, one group, 1-row groups, rows after the last
//    group (must be 0), invalid sizes (negative, overrunning, misaligned:
//    that group must be NaN; bf16_mn_major: any sizes, odd ones included,
//    negative or overrunning ones NaN); outputs poisoned first; every run repeated and
//    compared bit for bit; and one CUDA-graph check: the launch captured
//    once, group_sizes changed on the device, the replay must compute the
//    new grouping (no host synchronization, no shapes baked in).
// 2. Timing, 16 experts, 16 x 1024 tokens, hidden 4096, expert width 2048
//    (fprop (16384, 2048, 4096), dgrad (16384, 4096, 2048), wgrad 16 x
//    (2048, 4096) over 16384 tokens), balanced and skewed (one expert with
//    half the tokens): ours against a loop of per-group cuBLASLt FP8 GEMMs
//    (same scaling; the host knows the sizes, as te_jax's loop would need),
//    a loop of per-group cuBLASLt bf16 GEMMs, one bf16 GEMM of the whole
//    size (the ceiling of any bf16 grouped GEMM), and ours in bf16 (the bf16
//    variant on the same bf16 operands and sizes, timed once per pass and
//    grouping beside the first FP8 row of it, checked against the bf16
//    loop; the column "ours_bf16", and "/ours16" the FP8 row's speed-up
//    over it: FP8 against the FP8-off layer's own grouped GEMM).
//    bf16_mn_major rows: its wgrad on row-major x and grad (that pass's
//    shape, and the MoE layer's: 64 experts, 131072 rows, hidden 1024,
//    width 512), balanced and ragged (sizes off multiples of 8) groups,
//    against the per-group cuBLASLt bf16 loop and one whole GEMM on the
//    transposed copies, and "ours_bf16" the TN bf16 variant on those copies
//    (balanced only: it needs 8-aligned groups); checked against the loop.
//
// Build: see tools/gpu_kernels.sh. Run: grouped_gemm_sm90 [--checks | --timing]
//   [--only v1,v2] [--rounds N] (default 7)
#include <cstring>
#include <map>
#include <memory>

#include "gemm_sm90_bench.cuh"
#include "kernels/gemm_sm90.cuh"

namespace {

namespace sm90 = te_jax::sm90;
using Axis = sm90::GroupedAxis;
using Scaling = sm90::GroupedScaling;
using bench::DeviceAlloc;

constexpr double kTol = 1e-2;  // bfloat16 output (tests/test_cuda_ops.py)
int failures = 0;

using Type = sm90::OperandType;

struct VariantInfo {
  sm90::GroupedVariant id;
  const char* name;
  Scaling scaling;
  Type a_type, b_type;
};
// The bfloat16-output variants: the harness reads and checks bfloat16
// outputs; the float32 wgrad variants are checked by
// tests/test_gpu_grouped_gemm.py.
std::vector<VariantInfo> AllVariants() {
  std::vector<VariantInfo> v;
#define TE_JAX_X(id, name, scaling, a_type, b_type, out_type)                            \
  if (sm90::OutputType::out_type == sm90::OutputType::kBF16)                             \
    v.push_back({sm90::GroupedVariant::id, name, Scaling::scaling, Type::a_type, Type::b_type});
  TE_JAX_SM90_GROUPED_VARIANTS(TE_JAX_X)
#undef TE_JAX_X
  return v;
}

// n random operand elements of type t (N(0, 1), rounded to t) on the device.
void FillOperand(void* p, size_t n, Type t, uint64_t seed) {
  if (t == Type::kBF16) bench::FillBf16(p, n, seed);
  else if (t == Type::kE5M2) bench::FillFp8<__nv_fp8_e5m2>(p, n, seed);
  else bench::FillFp8<__nv_fp8_e4m3>(p, n, seed);
}

// n operand elements of type t copied to the host as floats.
std::vector<float> OperandToHost(const void* p, size_t n, Type t) {
  if (t != Type::kBF16) return bench::Fp8ToFloat(bench::ToHost<uint8_t>(p, n), t == Type::kE5M2);
  const auto h = bench::ToHost<__nv_bfloat16>(p, n);
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = __bfloat162float(h[i]);
  return f;
}

// Alignment of a group's slice of the grouped axis (gemm_sm90.cuh's rule):
// any rows (kRows, kContractionRowMajor); along kContraction's columns 16
// bytes of the operand, or 128 blockwise.
int SliceMultiple(Axis axis, Scaling scaling, Type t) {
  if (axis != Axis::kContraction) return 1;
  return scaling == Scaling::kBlockwise ? 128 : 16 / sm90::OperandBytes(t);
}

// A native scale grid (outer x ld floats, the first `valid` of each outer
// row used) without its padding, its valid columns cut into the blocks
// [cuts[i], cuts[i + 1]), each block stored whole before the next: column c
// of block i, outer row o, at cuts[i] * outer + o * (cuts[i + 1] - cuts[i])
// + c - cuts[i]. One block {0, valid}: the grid unpadded.
std::vector<float> CompactBlocks(const std::vector<float>& native, int outer, int ld,
                                 const std::vector<long>& cuts) {
  std::vector<float> out(size_t(outer) * cuts.back());
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    const long c0 = cuts[i], width = cuts[i + 1] - c0;
    for (long o = 0; o < outer; ++o)
      for (long c = c0; c < cuts[i + 1]; ++c)
        out[size_t(c0) * outer + size_t(o) * width + (c - c0)] = native[size_t(o) * ld + c];
  }
  return out;
}

// One grouped problem's device operands (one input set). Rows: a (m, k),
// b (G, n, k), out (m, n). Contraction: a (m, k), b (n, k), out (G, m, n).
// ContractionRowMajor (bf16): a (m, k), b (m, n), out (G, k, n).
// sa, sb: the scales in te_jax's native grids (what the host reference and
// the cuBLASLt loop read); sa_kernel, sb_kernel: what the grouped kernel
// reads (sa, sb for per-tensor scaling; blockwise, compact per group as
// te_jax's grouped_gemm_cuda.py lays them out: see grouped_gemm_sm90_impl.cuh
// above GroupedSetupKernel; bf16: null, the kernel reads no scales, and the
// host reference takes sa = sb = 1).
struct Problem {
  Axis axis;
  Scaling scaling;
  int groups;
  long m, n, k;
  Type a_type, b_type;
  bench::ScaleGrid ga{}, gb{};  // gb: one expert's grid for rows
  uint8_t *a = nullptr, *b = nullptr;
  float *sa = nullptr, *sb = nullptr, *sa_kernel = nullptr, *sb_kernel = nullptr;
  int32_t* sizes = nullptr;
  std::vector<int32_t> host_sizes;

  Problem(Axis ax, Scaling sc, const std::vector<int32_t>& sz, long m_, long n_, long k_,
          Type ta, Type tb, uint64_t seed)
      : axis(ax), scaling(sc), groups(static_cast<int>(sz.size())), m(m_), n(n_), k(k_),
        a_type(ta), b_type(tb), host_sizes(sz) {
    const bool rows = axis == Axis::kRows;
    a = DeviceAlloc<uint8_t>(m * k * sm90::OperandBytes(ta));
    b = DeviceAlloc<uint8_t>(b_elems() * sm90::OperandBytes(tb));
    FillOperand(a, m * k, ta, seed);
    FillOperand(b, b_elems(), tb, seed + 1);
    const auto vec = sm90::ScaleMode::kVec128, blk = sm90::ScaleMode::kBlk128x128;
    if (scaling != Scaling::kBlockwise) {  // per tensor; bf16: ones, for the host reference
      ga = {1, 1, 1};
      gb = {rows ? groups : 1, 1, 1};
    } else {
      ga = bench::Grid(vec, m, k);
      gb = bench::Grid(rows ? blk : vec, n, k);
    }
    const int experts = rows && scaling == Scaling::kBlockwise ? groups : 1;
    sa = DeviceAlloc<float>(ga.count());
    sb = DeviceAlloc<float>(gb.count() * experts);
    if (scaling == Scaling::kNone) {
      const std::vector<float> ones(gb.count(), 1.0f);
      CHECK_CUDA(cudaMemcpy(sa, ones.data(), sizeof(float), cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(sb, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
    } else {
      bench::FillScales(sa, ga.outer, ga.ld, ga.valid, seed + 2);
      bench::FillScales(sb, gb.outer * experts, gb.ld, gb.valid, seed + 3);
    }
    sa_kernel = scaling == Scaling::kNone ? nullptr : sa;
    sb_kernel = scaling == Scaling::kNone ? nullptr : sb;
    if (scaling == Scaling::kBlockwise) {
      sa_kernel = DeviceAlloc<float>(size_t(ga.outer) * ga.valid);
      sb_kernel = DeviceAlloc<float>(size_t(gb.outer) * experts * gb.valid);
      // b's compact grid does not depend on the sizes: (G, nb, kb) or (kb, n).
      const auto b_grid = bench::ToHost<float>(sb, gb.count() * experts);
      const auto b_compact = CompactBlocks(b_grid, gb.outer * experts, gb.ld, {0, gb.valid});
      CHECK_CUDA(cudaMemcpy(sb_kernel, b_compact.data(), b_compact.size() * sizeof(float),
                            cudaMemcpyHostToDevice));
    }
    sizes = DeviceAlloc<int32_t>(groups);
    SetSizes(sz);
  }
  ~Problem() {
    if (sa_kernel && sa_kernel != sa) cudaFree(sa_kernel);
    if (sb_kernel && sb_kernel != sb) cudaFree(sb_kernel);
    for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(sa),
                    static_cast<void*>(sb), static_cast<void*>(sizes)})
      cudaFree(p);
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  // New group sizes, and a's kernel scales laid out for them (blockwise
  // rows: one compact block per group's rows and one for the rows past
  // the last group; contraction: the grid unpadded, whatever the sizes).
  void SetSizes(const std::vector<int32_t>& sz) {
    host_sizes = sz;
    CHECK_CUDA(cudaMemcpy(sizes, sz.data(), sz.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    if (scaling != Scaling::kBlockwise) return;
    std::vector<long> cuts = {0};
    if (axis == Axis::kRows) {
      std::vector<long> start, end;
      std::vector<bool> valid;
      Slices(&start, &end, &valid);
      cuts.insert(cuts.end(), end.begin(), end.end());
    }
    if (cuts.back() != ga.valid) cuts.push_back(ga.valid);
    const auto a_grid = bench::ToHost<float>(sa, ga.count());
    const auto a_compact = CompactBlocks(a_grid, ga.outer, ga.ld, cuts);
    CHECK_CUDA(cudaMemcpy(sa_kernel, a_compact.data(), a_compact.size() * sizeof(float),
                          cudaMemcpyHostToDevice));
  }
  size_t b_elems() const {
    return axis == Axis::kRows ? size_t(groups) * n * k
           : axis == Axis::kContraction ? size_t(n) * k : size_t(m) * n;
  }
  size_t out_elems() const {
    return axis == Axis::kRows ? size_t(m) * n
           : size_t(groups) * (axis == Axis::kContraction ? m : k) * n;
  }
  sm90::GroupedGemmArgs Args(void* out) const {
    sm90::GroupedGemmArgs p;
    p.axis = axis; p.scaling = scaling; p.groups = groups;
    p.m = m; p.n = n; p.k = k;
    p.group_sizes = sizes; p.a = a; p.b = b; p.out = out;
    p.a_sinv = sa_kernel; p.b_sinv = sb_kernel;
    return p;
  }
  // Slice [start, end) of the grouped axis per group, and whether the
  // group is valid (gemm_sm90.cuh's rules); mirrors the setup kernel.
  void Slices(std::vector<long>* start, std::vector<long>* end, std::vector<bool>* valid) const {
    const long extent = axis == Axis::kContraction ? k : m;
    const int multiple = SliceMultiple(axis, scaling, a_type);
    long s = 0;
    for (int g = 0; g < groups; ++g) {
      const long size = host_sizes[g], e = s + std::max<long>(size, 0);
      start->push_back(s);
      end->push_back(std::min(e, extent));
      valid->push_back(size >= 0 && e <= extent && size % multiple == 0 && s % multiple == 0);
      s = std::min(e, extent);
    }
  }
  long covered() const {
    std::vector<long> s, e;
    std::vector<bool> v;
    Slices(&s, &e, &v);
    long c = 0;
    for (int g = 0; g < groups; ++g) c += v[g] ? e[g] - s[g] : 0;
    return c;
  }
};

// float64 reference; NaN where the kernel must write NaN (invalid groups).
std::vector<double> HostReference(const Problem& p) {
  const bool rows = p.axis == Axis::kRows, blockwise = p.scaling == Scaling::kBlockwise;
  const auto a = OperandToHost(p.a, p.m * p.k, p.a_type);
  const auto b = OperandToHost(p.b, p.b_elems(), p.b_type);
  const int experts = rows && blockwise ? p.groups : 1;
  const auto sa = bench::ToHost<float>(p.sa, p.ga.count());
  const auto sb = bench::ToHost<float>(p.sb, p.gb.count() * experts);
  std::vector<long> start, end;
  std::vector<bool> valid;
  p.Slices(&start, &end, &valid);
  std::vector<double> out(p.out_elems(), 0.0);
  const auto vec = sm90::ScaleMode::kVec128, blk = sm90::ScaleMode::kBlk128x128;
  const size_t block = rows ? 0 : p.out_elems() / p.groups;  // one group's (m, n) or (k, n)
  for (int g = 0; g < p.groups; ++g) {
    if (!valid[g]) {
      if (rows) {
        std::fill(out.begin() + start[g] * p.n, out.begin() + end[g] * p.n, NAN);
      } else {
        std::fill(out.begin() + g * block, out.begin() + (g + 1) * block, NAN);
      }
      continue;
    }
    if (p.axis == Axis::kContractionRowMajor) {  // out[g] = a[rows]^T @ b[rows], no scales
      double* og = out.data() + g * block;
      for (long t = start[g]; t < end[g]; ++t)
        for (long i = 0; i < p.k; ++i)
          for (long j = 0; j < p.n; ++j) og[size_t(i) * p.n + j] += double(a[t * p.k + i]) * b[t * p.n + j];
    } else if (rows) {
      const float* bg = b.data() + size_t(g) * p.n * p.k;
      const std::vector<float> sbg(sb.begin() + size_t(g) * (blockwise ? p.gb.count() : 1),
                                   sb.begin() + size_t(g + 1) * (blockwise ? p.gb.count() : 1));
      for (long r = start[g]; r < end[g]; ++r)
        for (long j = 0; j < p.n; ++j)
          out[size_t(r) * p.n + j] = bench::BlockDot(&a[r * p.k], &bg[j * p.k], 0, p.k, [&](long k0) {
            return blockwise ? double(bench::ScaleAt(sa, p.ga, vec, r, k0)) *
                                   bench::ScaleAt(sbg, p.gb, blk, j, k0)
                             : double(sa[0]) * sbg[0];
          });
    } else {
      double* og = out.data() + size_t(g) * p.m * p.n;
      for (long i = 0; i < p.m; ++i)
        for (long j = 0; j < p.n; ++j)
          og[size_t(i) * p.n + j] = bench::BlockDot(&a[i * p.k], &b[j * p.k], start[g], end[g], [&](long t0) {
            return blockwise ? double(bench::ScaleAt(sa, p.ga, vec, i, t0)) *
                                   bench::ScaleAt(sb, p.gb, vec, j, t0)
                             : double(sa[0]) * sb[0];
          });
    }
  }
  return out;
}

// Where the reference is NaN the output must be NaN; elsewhere the norm
// error over the finite part, and no other non-finite element.
bool Compare(const std::vector<__nv_bfloat16>& got, const std::vector<double>& want, double* rel,
             long long* bad) {
  double d2 = 0, w2 = 0;
  *bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = __bfloat162float(got[i]);
    if (std::isnan(want[i])) {
      *bad += !std::isnan(g);
      continue;
    }
    if (!std::isfinite(g)) { ++*bad; continue; }
    d2 += (g - want[i]) * (g - want[i]);
    w2 += want[i] * want[i];
  }
  *rel = w2 > 0 ? std::sqrt(d2 / w2) : (d2 > 0 ? INFINITY : 0.0);
  return *bad == 0 && *rel < kTol;
}

// Launch with a workspace of the size asked for (grown as needed).
bool Launch(sm90::GroupedVariant v, const sm90::GroupedGemmArgs& p, int sms, cudaStream_t s) {
  static void* ws = nullptr;
  static size_t ws_bytes = 0;
  const size_t need = sm90::GroupedGemmWorkspace(v, p, sms);
  if (need > ws_bytes) {
    if (ws) CHECK_CUDA(cudaFree(ws));
    CHECK_CUDA(cudaMalloc(&ws, need));
    ws_bytes = need;
  }
  return sm90::LaunchGroupedGemm(v, p, ws, ws_bytes, sms, s) == cudaSuccess;
}

void CheckOne(const VariantInfo& v, const Problem& p, const char* what, int sms) {
  const auto want = HostReference(p);
  const size_t n_out = p.out_elems();
  void* out = DeviceAlloc<uint16_t>(n_out);
  const char* why = sm90::CheckGroupedGemm(v.id, p.Args(out));
  if (why) {
    std::printf("CHECK %-28s %-34s FAIL (rejected: %s)\n", v.name, what, why);
    ++failures;
    CHECK_CUDA(cudaFree(out));
    return;
  }
  std::vector<__nv_bfloat16> first;
  bool ok = true, same = true, pass = false;
  double rel = 0;
  long long bad = 0;
  for (int run = 0; run < 2 && ok; ++run) {
    bench::Poison(out, n_out);
    ok = Launch(v.id, p.Args(out), sms, 0) && cudaDeviceSynchronize() == cudaSuccess;
    if (!ok) break;
    auto got = bench::ToHost<__nv_bfloat16>(out, n_out);
    if (run == 0) {
      pass = Compare(got, want, &rel, &bad);
      first = std::move(got);
    } else {
      same = std::memcmp(first.data(), got.data(), n_out * 2) == 0;
    }
  }
  pass = pass && ok && same;
  failures += !pass;
  std::printf("CHECK %-28s %-34s rel_err=%.2e wrong_nonfinite=%lld repeat=%s %s\n", v.name, what,
              rel, bad, same ? "same" : "DIFFERS", pass ? "PASS" : ok ? "FAIL" : "FAIL (launch)");
  CHECK_CUDA(cudaFree(out));
}

// The launch recorded into a CUDA graph once, replayed after group_sizes
// changed on the device: the replay must follow the new sizes.
void CheckGraph(const VariantInfo& v, Problem& p, const std::vector<int32_t>& new_sizes,
                const char* what, int sms) {
  const size_t n_out = p.out_elems();
  void* out = DeviceAlloc<uint16_t>(n_out);
  const size_t ws_bytes = sm90::GroupedGemmWorkspace(v.id, p.Args(out), sms);
  void* ws = DeviceAlloc<uint8_t>(ws_bytes);
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  const cudaError_t launched = sm90::LaunchGroupedGemm(v.id, p.Args(out), ws, ws_bytes, sms, s);
  CHECK_CUDA(cudaStreamEndCapture(s, &graph));
  bool pass = launched == cudaSuccess;
  double rel = 0;
  long long bad = 0;
  if (pass) {
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    p.SetSizes(new_sizes);
    const auto want = HostReference(p);
    bench::Poison(out, n_out);
    CHECK_CUDA(cudaGraphLaunch(exec, s));
    CHECK_CUDA(cudaStreamSynchronize(s));
    pass = Compare(bench::ToHost<__nv_bfloat16>(out, n_out), want, &rel, &bad);
    CHECK_CUDA(cudaGraphExecDestroy(exec));
  }
  failures += !pass;
  std::printf("CHECK %-28s %-34s rel_err=%.2e wrong_nonfinite=%lld %s\n", v.name, what, rel, bad,
              pass ? "PASS" : "FAIL");
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamDestroy(s));
  CHECK_CUDA(cudaFree(ws));
  CHECK_CUDA(cudaFree(out));
}

void RunChecks(const std::vector<VariantInfo>& variants, int sms) {
  uint64_t seed = 500;
  for (const VariantInfo& v : variants) {
    const bool blockwise = v.scaling == Scaling::kBlockwise;
    const Type ta = v.a_type, tb = v.b_type;
    const bool rows_ok = sm90::GroupedVariantServes(v.id, Axis::kRows);
    const bool contraction_ok = sm90::GroupedVariantServes(v.id, Axis::kContraction);
    if (sm90::GroupedVariantServes(v.id, Axis::kContractionRowMajor)) {
      // x (300, 200), grad (300, 264): k, n multiples of 8, not of 64 or 128
      struct Case { const char* what; std::vector<int32_t> sizes; };
      const Case cases[] = {
          {"row-major: 3,0,120,1,0,77 (+99 tail)", {3, 0, 120, 1, 0, 77}},
          {"row-major: one group", {300}},
          {"row-major: one row", {0, 1, 0}},
          {"row-major: all empty", {0, 0, 0}},
          {"row-major: -5 and overrun -> NaN", {64, -5, 100, 200}},
      };
      for (const Case& c : cases) {
        Problem p(Axis::kContractionRowMajor, v.scaling, c.sizes, 300, 264, 200, ta, tb,
                  seed += 10);
        CheckOne(v, p, c.what, sms);
      }
      Problem p(Axis::kContractionRowMajor, v.scaling, {16, 0, 100, 3}, 300, 264, 200, ta, tb,
                seed += 10);
      CheckGraph(v, p, {50, 51, 0, 97}, "row-major: graph replay", sms);
    }
    if (rows_ok) {  // m = 200 rows, n = 272, k = 400: none a multiple of 128
      struct Case { const char* what; std::vector<int32_t> sizes; };
      const Case cases[] = {
          {"rows: 0,1,130,37 (+32 tail rows)", {0, 1, 130, 37}},
          {"rows: one group", {200}},
          {"rows: all empty", {0, 0, 0}},
          {"rows: -5 and overrun -> NaN", {64, -5, 100, 80}},
      };
      for (const Case& c : cases) {
        Problem p(Axis::kRows, v.scaling, c.sizes, 200, 272, 400, ta, tb, seed += 10);
        CheckOne(v, p, c.what, sms);
      }
      Problem p(Axis::kRows, v.scaling, {16, 0, 100, 3}, 200, 272, 400, ta, tb, seed += 10);
      CheckGraph(v, p, {50, 50, 0, 90}, "rows: graph replay, new sizes", sms);
    }
    if (contraction_ok) {  // m = 144, n = 264 (not multiples of 128), k = 640 tokens
      const int32_t u = SliceMultiple(Axis::kContraction, v.scaling, ta);  // 128, 16 or 8 (bf16)
      struct Case { const char* what; std::vector<int32_t> sizes; };
      const Case cases[] = {
          {"contraction: 0,u,3u,... (tail)", {0, u, 3 * u, blockwise ? 0 : 9 * u}},
          {"contraction: one group", {640}},
          {"contraction: misaligned -> NaN", {u, u + u / 2, u}},
      };
      for (const Case& c : cases) {
        Problem p(Axis::kContraction, v.scaling, c.sizes, 144, 264, 640, ta, tb, seed += 10);
        CheckOne(v, p, c.what, sms);
      }
      Problem p(Axis::kContraction, v.scaling, {u, 2 * u, 0}, 144, 264, 640, ta, tb, seed += 10);
      CheckGraph(v, p, {0, u, 3 * u}, "contraction: graph replay", sms);
    }
  }
}



// ------------------------------------------------------------------ timing --

// One timed pass: the problem of ours, the per-group cuBLASLt FP8 loop with
// the same scaling, a per-group bf16 loop, one whole-size bf16 GEMM and our
// bf16 variant on the bf16 operands.
struct Pass {
  const char* name;
  Axis axis;
  long m, n, k;  // rows: a (m, k) tokens x hidden; contraction: m, n outputs, k tokens
};

struct TimingRow {
  std::string label;
  double ours, loop_fp8, loop_bf16, single_bf16, ours_bf16;
};

// The bf16 variant's figure of one pass and grouping (timed with the first
// FP8 row of that pass and shown beside each): TFLOP/s and its error
// against the bf16 loop. NaN when the variant is not kept (--only).
struct Bf16Figure {
  double tflops = NAN, rel = NAN;
};

// Group sizes: balanced (16 x 1024) or skewed (one group holds half the
// tokens; the rest spread in multiples of 128).
std::vector<int32_t> Sizes(int groups, long tokens, bool skewed) {
  std::vector<int32_t> s(groups, static_cast<int32_t>(tokens / groups));
  if (!skewed) return s;
  s[0] = static_cast<int32_t>(tokens / 2);
  const long blocks = tokens / 2 / 128;
  for (int g = 1; g < groups; ++g)
    s[g] = static_cast<int32_t>(128 * (blocks / (groups - 1) + (g - 1 < blocks % (groups - 1))));
  return s;
}

// bf16: the bf16 variant, or null (not kept); bf16_figure: its figure of
// this pass and grouping, timed here when not yet (NaN tflops).
TimingRow TimeConfig(const VariantInfo& v, const Pass& pass, bool skewed, int sms,
                     cublasLtHandle_t lt, void* lt_ws, size_t lt_ws_bytes, int rounds,
                     const VariantInfo* bf16, Bf16Figure* bf16_figure) {
  const int G = 16;
  const bool rows = pass.axis == Axis::kRows, blockwise = v.scaling == Scaling::kBlockwise;
  const long tokens = rows ? pass.m : pass.k;
  const auto sizes = Sizes(G, tokens, skewed);
  const int sets = 2;  // each set's operands are > 100 MB, past the L2
  std::vector<std::unique_ptr<Problem>> ps;
  for (int i = 0; i < sets; ++i)
    ps.emplace_back(new Problem(pass.axis, v.scaling, sizes, pass.m, pass.n, pass.k, v.a_type,
                                v.b_type, 9000 + 10 * i));
  const Problem& p0 = *ps[0];
  void* out = DeviceAlloc<uint16_t>(p0.out_elems());
  void* ref = DeviceAlloc<uint16_t>(p0.out_elems());
  std::vector<long> start, end;
  std::vector<bool> valid;
  p0.Slices(&start, &end, &valid);

  // Per-group cuBLASLt FP8 GEMMs on the same buffers. Rows blockwise: each
  // group's 1x128 scales as cuBLASLt's contiguous (ceil(k/128), rows) grid.
  const auto ta = v.a_type == Type::kE5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
  const auto tb = v.b_type == Type::kE5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
  const int a_mode = blockwise ? 1 : 0, b_mode = blockwise ? (rows ? 2 : 1) : 0;
  const bool fast = v.id == sm90::GroupedVariant::kTensorE4M3Fast;
  std::vector<std::unique_ptr<bench::LtGemm>> loop;
  std::vector<std::vector<float*>> group_sa(sets);
  // Rows per tensor: each group's scale in its own allocation. p.sb + g is
  // only 4-byte aligned, and every per-tensor rows loop failed its first
  // non-aligned group on the H100 (status not success; the blockwise loop,
  // whose scale arrays are separate allocations, ran).
  std::vector<std::vector<float*>> group_sb(sets);
  for (int g = 0; g < G; ++g) {
    const long sz = end[g] - start[g];
    if (rows)
      loop.emplace_back(new bench::LtGemm(lt, sz, pass.n, pass.k, ta, tb, CUDA_R_16BF, a_mode,
                                          b_mode, fast, lt_ws, lt_ws_bytes));
    else
      loop.emplace_back(new bench::LtGemm(lt, pass.m, pass.n, sz, ta, tb, CUDA_R_16BF, a_mode,
                                          b_mode, fast, lt_ws, lt_ws_bytes, pass.k, pass.k));
    for (int i = 0; i < sets && rows && !blockwise; ++i) {
      float* s = DeviceAlloc<float>(1);
      CHECK_CUDA(cudaMemcpy(s, ps[i]->sb + g, 4, cudaMemcpyDeviceToDevice));
      group_sb[i].push_back(s);
    }
    for (int i = 0; i < sets && rows && blockwise; ++i) {
      const int kb = bench::KBlocks(pass.k);
      float* s = DeviceAlloc<float>(size_t(kb) * sz);
      CHECK_CUDA(cudaMemcpy2D(s, sz * 4, ps[i]->sa + start[g], ps[i]->ga.ld * 4, sz * 4, kb,
                              cudaMemcpyDeviceToDevice));
      group_sa[i].push_back(s);
    }
  }
  auto run_loop = [&](int r, void* o) {
    const Problem& p = *ps[r % sets];
    bool ok = true;
    for (int g = 0; g < G && ok; ++g) {
      auto* d = static_cast<__nv_bfloat16*>(o);
      if (rows) {
        const float* sa = blockwise ? group_sa[r % sets][g] : p.sa;
        const float* sb = blockwise ? p.sb + size_t(g) * p.gb.count() : group_sb[r % sets][g];
        const cublasStatus_t st = loop[g]->Run(p.a + start[g] * p.k, p.b + size_t(g) * p.n * p.k,
                                               sa, sb, d + start[g] * p.n, 0);
        ok = st == CUBLAS_STATUS_SUCCESS;
        if (!ok) std::fprintf(stderr, "loop_fp8: group %d: cuBLASLt status %d\n", g, int(st));
      } else {
        const size_t off = blockwise ? size_t(start[g] / 128) : 0;
        ok = loop[g]->Run(p.a + start[g], p.b + start[g], p.sa + off * p.ga.ld,
                          p.sb + off * p.gb.ld, d + size_t(g) * p.m * p.n, 0) ==
             CUBLAS_STATUS_SUCCESS;
      }
    }
    return ok;
  };
  // Check ours against the loop on set 0 (every group is valid here).
  bench::Poison(ref, p0.out_elems());
  bench::Poison(out, p0.out_elems());
  const bool loop_ok = run_loop(0, ref);
  const bool ours_ok = Launch(v.id, p0.Args(out), sms, 0);
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto e = bench::DeviceDiff(out, ref, p0.out_elems());
  const bool pass_ok = loop_ok && ours_ok && e.bad == 0 && e.rel < kTol;
  failures += !pass_ok;

  // bf16 operands of the same shapes (fresh random data).
  const long b_rows = rows ? long(G) * pass.n : pass.n;
  auto* a16 = DeviceAlloc<__nv_bfloat16>(pass.m * pass.k);
  auto* b16 = DeviceAlloc<__nv_bfloat16>(b_rows * pass.k);
  bench::FillBf16(a16, pass.m * pass.k, 77);
  bench::FillBf16(b16, b_rows * pass.k, 78);
  std::vector<std::unique_ptr<bench::LtGemm>> loop16;
  for (int g = 0; g < G; ++g) {
    const long sz = end[g] - start[g];
    loop16.emplace_back(rows ? new bench::LtGemm(lt, sz, pass.n, pass.k, CUDA_R_16BF, CUDA_R_16BF,
                                                 CUDA_R_16BF, 0, 0, false, lt_ws, lt_ws_bytes)
                             : new bench::LtGemm(lt, pass.m, pass.n, sz, CUDA_R_16BF, CUDA_R_16BF,
                                                 CUDA_R_16BF, 0, 0, false, lt_ws, lt_ws_bytes,
                                                 pass.k, pass.k));
  }
  bench::LtGemm single16(lt, pass.m, pass.n, pass.k, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, 0, 0,
                         false, lt_ws, lt_ws_bytes);
  auto run_loop16 = [&](void* o) {
    bool ok = true;
    for (int g = 0; g < G && ok; ++g) {
      const size_t a_off = rows ? start[g] * pass.k : start[g];
      const size_t b_off = rows ? size_t(g) * pass.n * pass.k : start[g];
      const size_t d_off = rows ? start[g] * pass.n : size_t(g) * pass.m * pass.n;
      ok = loop16[g]->Run(a16 + a_off, b16 + b_off, nullptr, nullptr,
                          static_cast<__nv_bfloat16*>(o) + d_off, 0) == CUBLAS_STATUS_SUCCESS;
    }
    return ok;
  };
  // Our bf16 variant on the same bf16 operands and sizes (no scales),
  // checked against the bf16 loop; timed once per pass and grouping.
  sm90::GroupedGemmArgs q;
  q.axis = pass.axis;
  q.scaling = Scaling::kNone;
  q.groups = G;
  q.m = pass.m; q.n = pass.n; q.k = pass.k;
  q.group_sizes = p0.sizes; q.a = a16; q.b = b16; q.out = out;
  const bool time_bf16 = bf16 && std::isnan(bf16_figure->tflops);
  bool bf16_ok = true;
  if (time_bf16) {
    bench::Poison(ref, p0.out_elems());
    bench::Poison(out, p0.out_elems());
    bf16_ok = run_loop16(ref) && Launch(bf16->id, q, sms, 0);
    CHECK_CUDA(cudaDeviceSynchronize());
    const auto e16 = bench::DeviceDiff(out, ref, p0.out_elems());
    bf16_figure->rel = e16.rel;
    bf16_ok = bf16_ok && e16.bad == 0 && e16.rel < kTol;
    failures += !bf16_ok;
  }
  std::vector<bench::Candidate> cands = {
      {"ours", [&](int r) { return Launch(v.id, ps[r % sets]->Args(out), sms, 0); }},
      {"loop_fp8", [&](int r) { return run_loop(r, out); }},
      {"loop_bf16", [&](int) { return run_loop16(out); }},
      {"single_bf16",
       [&](int) {
         return single16.Run(a16, b16, nullptr, nullptr, out, 0) == CUBLAS_STATUS_SUCCESS;
       }},
  };
  if (time_bf16) cands.push_back({"ours_bf16", [&](int) { return Launch(bf16->id, q, sms, 0); }});
  const auto ms = bench::TimeInterleaved(cands, rounds);
  const double useful = 2.0 * (rows ? p0.covered() * pass.n * pass.k
                                    : pass.m * pass.n * p0.covered());
  const double whole = 2.0 * pass.m * pass.n * pass.k;
  if (time_bf16) bf16_figure->tflops = bf16_ok ? useful / ms[4] * 1e-9 : 0.0;
  TimingRow row{std::string(pass.name) + (skewed ? " skewed" : " balanced") + " " + v.name,
                useful / ms[0] * 1e-9, useful / ms[1] * 1e-9, useful / ms[2] * 1e-9,
                whole / ms[3] * 1e-9, bf16 ? bf16_figure->tflops : NAN};
  std::printf("TIME %-52s ours %6.0f  loop_fp8 %6.0f  loop_bf16 %6.0f  single_bf16 %6.0f"
              "  ours_bf16 %6.0f TF/s  check vs loop rel=%.1e %s  bf16 vs bf16 loop rel=%.1e %s\n",
              row.label.c_str(), row.ours, row.loop_fp8, row.loop_bf16, row.single_bf16,
              row.ours_bf16, e.rel, pass_ok ? "ok" : "FAIL", bf16 ? bf16_figure->rel : NAN,
              !bf16 ? "-" : bf16_figure->tflops > 0 ? "ok" : "FAIL");
  std::fflush(stdout);
  for (auto& v2 : group_sa)
    for (float* s : v2) CHECK_CUDA(cudaFree(s));
  for (void* q : {out, ref, static_cast<void*>(a16), static_cast<void*>(b16)})
    CHECK_CUDA(cudaFree(q));
  return row;
}

// out (cols, rows) = in (rows, cols) transposed: the TN copies of the
// row-major wgrad operands (setup only; not timed).
__global__ void TransposeBf16(const __nv_bfloat16* in, __nv_bfloat16* out, long rows, long cols) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(rows) * cols;
       i += size_t(gridDim.x) * blockDim.x)
    out[(i % cols) * rows + i / cols] = in[i];
}

__nv_bfloat16* Transposed(const __nv_bfloat16* in, long rows, long cols) {
  auto* out = DeviceAlloc<__nv_bfloat16>(size_t(rows) * cols);
  TransposeBf16<<<1024, 256>>>(in, out, rows, cols);
  CHECK_CUDA(cudaGetLastError());
  return out;
}

// A wgrad of the FP8-off layers: out (G, k, n) = per group x[rows]^T @
// grad[rows] over `tokens` rows of x (tokens, k) and grad (tokens, n).
struct RowMajorPass {
  const char* name;
  int groups;
  long tokens, k, n;
};

// The row-major bf16 wgrad variant `v` on x and grad as stored, balanced
// (Sizes) or ragged (the same sizes +-5 in turn: none a multiple of 8),
// against the per-group cuBLASLt bf16 loop and one whole bf16 GEMM on the
// transposed copies (x^T (k, tokens), grad^T (n, tokens)), and our TN bf16
// variant `tn` (null: not kept) on those copies where its 8-aligned groups
// allow (balanced). Checked against the loop.
TimingRow TimeRowMajorWgrad(const VariantInfo& v, const RowMajorPass& pass, bool ragged, int sms,
                            cublasLtHandle_t lt, void* lt_ws, size_t lt_ws_bytes, int rounds,
                            const VariantInfo* tn) {
  const int G = pass.groups;
  const long tokens = pass.tokens, k = pass.k, n = pass.n;
  auto sizes = Sizes(G, tokens, false);
  for (int g = 0; g + 1 < G && ragged; g += 2) sizes[g] -= 5, sizes[g + 1] += 5;
  // x and grad as stored, and their transposes for cuBLASLt and the TN variant.
  Problem p(Axis::kContractionRowMajor, Scaling::kNone, sizes, tokens, n, k, Type::kBF16,
            Type::kBF16, 4242);
  const auto* x = reinterpret_cast<const __nv_bfloat16*>(p.a);
  const auto* grad = reinterpret_cast<const __nv_bfloat16*>(p.b);
  __nv_bfloat16* x_t = Transposed(x, tokens, k);
  __nv_bfloat16* grad_t = Transposed(grad, tokens, n);
  void* out = DeviceAlloc<uint16_t>(p.out_elems());
  void* ref = DeviceAlloc<uint16_t>(p.out_elems());
  std::vector<long> start, end;
  std::vector<bool> valid;
  p.Slices(&start, &end, &valid);
  std::vector<std::unique_ptr<bench::LtGemm>> loop16;
  for (int g = 0; g < G; ++g)
    loop16.emplace_back(new bench::LtGemm(lt, k, n, end[g] - start[g], CUDA_R_16BF, CUDA_R_16BF,
                                          CUDA_R_16BF, 0, 0, false, lt_ws, lt_ws_bytes, tokens,
                                          tokens));
  bench::LtGemm single16(lt, k, n, tokens, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, 0, 0, false,
                         lt_ws, lt_ws_bytes);
  auto run_loop16 = [&](void* o) {
    bool ok = true;
    for (int g = 0; g < G && ok; ++g)
      ok = loop16[g]->Run(x_t + start[g], grad_t + start[g], nullptr, nullptr,
                          static_cast<__nv_bfloat16*>(o) + size_t(g) * k * n, 0) ==
           CUBLAS_STATUS_SUCCESS;
    return ok;
  };
  sm90::GroupedGemmArgs q;  // the TN variant: a = x^T (k, tokens), b = grad^T (n, tokens)
  q.axis = Axis::kContraction;
  q.scaling = Scaling::kNone;
  q.groups = G;
  q.m = k; q.n = n; q.k = tokens;
  q.group_sizes = p.sizes; q.a = x_t; q.b = grad_t; q.out = out;
  const bool time_tn = tn && !ragged;
  bench::Poison(ref, p.out_elems());
  bench::Poison(out, p.out_elems());
  bool ok = run_loop16(ref) && Launch(v.id, p.Args(out), sms, 0);
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto e = bench::DeviceDiff(out, ref, p.out_elems());
  ok = ok && e.bad == 0 && e.rel < kTol;
  failures += !ok;
  std::vector<bench::Candidate> cands = {
      {"ours", [&](int) { return Launch(v.id, p.Args(out), sms, 0); }},
      {"loop_bf16", [&](int) { return run_loop16(out); }},
      {"single_bf16",
       [&](int) {
         return single16.Run(x_t, grad_t, nullptr, nullptr, out, 0) == CUBLAS_STATUS_SUCCESS;
       }},
  };
  if (time_tn) cands.push_back({"ours_bf16", [&](int) { return Launch(tn->id, q, sms, 0); }});
  const auto ms = bench::TimeInterleaved(cands, rounds);
  const double useful = 2.0 * k * n * p.covered(), whole = 2.0 * k * n * tokens;
  TimingRow row{std::string(pass.name) + (ragged ? " ragged" : " balanced") + " " + v.name,
                useful / ms[0] * 1e-9, NAN, useful / ms[1] * 1e-9, whole / ms[2] * 1e-9,
                time_tn ? useful / ms[3] * 1e-9 : NAN};
  std::printf("TIME %-52s ours %6.0f  loop_bf16 %6.0f  single_bf16 %6.0f  ours_bf16 (TN) %6.0f"
              " TF/s  check vs loop rel=%.1e %s\n",
              row.label.c_str(), row.ours, row.loop_bf16, row.single_bf16, row.ours_bf16, e.rel,
              ok ? "ok" : "FAIL");
  std::fflush(stdout);
  for (void* d : {out, ref, static_cast<void*>(x_t), static_cast<void*>(grad_t)})
    CHECK_CUDA(cudaFree(d));
  return row;
}

void RunTiming(const std::vector<VariantInfo>& variants, int sms, int rounds, const char* device) {
  // 16 experts x 1024 tokens, hidden 4096, expert width 2048.
  const Pass fprop{"fprop", Axis::kRows, 16384, 2048, 4096};
  const Pass dgrad{"dgrad", Axis::kRows, 16384, 4096, 2048};
  const Pass wgrad{"wgrad", Axis::kContraction, 2048, 4096, 16384};
  struct Job { sm90::GroupedVariant v; const Pass* pass; };
  const Job jobs[] = {
      {sm90::GroupedVariant::kTensorE4M3Fast, &fprop},
      {sm90::GroupedVariant::kTensorE4M3Split, &fprop},
      {sm90::GroupedVariant::kTensorE5M2E4M3Split, &dgrad},
      {sm90::GroupedVariant::kTensorE5M2E4M3Split, &wgrad},
      {sm90::GroupedVariant::kBlockwiseRows, &fprop},
      {sm90::GroupedVariant::kBlockwiseRows, &dgrad},
      {sm90::GroupedVariant::kBlockwiseContraction, &wgrad},
  };
  cublasLtHandle_t lt;
  CHECK_LT(cublasLtCreate(&lt));
  const size_t lt_ws_bytes = size_t(32) << 20;
  void* lt_ws = DeviceAlloc<uint8_t>(lt_ws_bytes);
  const VariantInfo* bf16 = nullptr;  // timed beside the FP8 rows when kept
  const VariantInfo* bf16_mn = nullptr;
  for (const VariantInfo& v : variants) {
    if (v.id == sm90::GroupedVariant::kBf16) bf16 = &v;
    if (v.id == sm90::GroupedVariant::kBf16MnMajor) bf16_mn = &v;
  }
  std::map<std::string, Bf16Figure> bf16_figures;  // per pass and grouping
  std::vector<TimingRow> rows;
  for (const Job& j : jobs) {
    for (bool skewed : {false, true}) {
      for (const VariantInfo& v : variants) {
        if (v.id != j.v) continue;
        Bf16Figure* fig = &bf16_figures[std::string(j.pass->name) + (skewed ? " s" : " b")];
        rows.push_back(TimeConfig(v, *j.pass, skewed, sms, lt, lt_ws, lt_ws_bytes, rounds, bf16,
                                  fig));
      }
    }
  }
  // The FP8-off wgrad on row-major operands: the wgrad pass's shape
  // (x (16384, 2048), grad (16384, 4096)) and the MoE layer's (64 experts).
  const RowMajorPass row_major[] = {{"wgrad row-major", 16, 16384, 2048, 4096},
                                    {"moe wgrad row-major", 64, 131072, 1024, 512}};
  for (const RowMajorPass& pass : row_major)
    for (bool ragged : {false, true})
      if (bf16_mn)
        rows.push_back(TimeRowMajorWgrad(*bf16_mn, pass, ragged, sms, lt, lt_ws, lt_ws_bytes,
                                         rounds, bf16));
  // ours_bf16: the bf16 variant on the bf16 operands (the FP8-off layers'
  // grouped GEMM; row-major rows: the TN variant on the transposes);
  // /ours16: the row's speed-up over it.
  std::printf("\nSUMMARY grouped (TFLOP/s of the useful FLOPs, median) on %s\n", device);
  std::printf("%-52s %7s %8s %9s %11s %9s %8s %8s %8s\n", "pass / groups / variant", "ours",
              "loop_fp8", "loop_bf16", "single_bf16", "ours_bf16", "/loop8", "/bf16", "/ours16");
  for (size_t i = 0; i < rows.size(); ++i) {
    const TimingRow& r = rows[i];
    std::printf("%-52s %7.0f %8.0f %9.0f %11.0f %9.0f %8.3f %8.3f %8.3f", r.label.c_str(), r.ours,
                r.loop_fp8, r.loop_bf16, r.single_bf16, r.ours_bf16, r.ours / r.loop_fp8,
                r.ours / r.loop_bf16, r.ours / r.ours_bf16);
    if (i % 2 == 1)
      std::printf("  %s/balanced %.3f", r.label.find(" ragged ") != std::string::npos ? "ragged"
                                                                                      : "skewed",
                  r.ours / rows[i - 1].ours);
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bench::Options opt = bench::ParseOptions(argc, argv);
  if (bench::ListVariants(opt, AllVariants())) return 0;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = bench::SmCount();
  std::printf("device: %s, %d SMs\n", prop.name, sms);
  std::vector<VariantInfo> variants;
  for (const VariantInfo& v : AllVariants())
    if (opt.Keeps(v.name)) variants.push_back(v);
  if (opt.checks) RunChecks(variants, sms);
  if (opt.timing) RunTiming(variants, sms, opt.rounds, prop.name);
  std::printf("checks: %s (%d failure(s))\n", failures ? "FAILED" : "all passed", failures);
  return failures ? 1 : 0;
}
