// cuBLASLt implementation of ops::gemm.
//
// cuBLASLt is column-major; a row-major matrix is the column-major view of its transpose, so the
// row-major product D = op(a) op(b) is run as the column-major product D^T = op(b)^T op(a)^T:
// cuBLASLt's "A" is our b and its "B" is our a, with m and n swapped. Our BiasGradA (sum over k of
// op(a)) is therefore cuBLASLt's BGRADB, and BiasGradB its BGRADA.
#include <cublasLt.h>

#include <algorithm>
#include <cstdlib>
#include <array>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/cuda/cuda_check.hpp"
#include "ops/cuda/cublas_check.hpp"
#include "megacore/core/allocator.hpp"
#include "megacore/core/stream.hpp"
#include "megacore/ops/gemm.hpp"
#include "ops/cuda/gemm_cuda.hpp"


namespace megacore::ops::cuda {

void bias_grad_reduce(DType in_dt, const void* x, int64_t rows, int64_t k, int64_t stride_row, int64_t stride_k,
                      DType out_dt, void* out, void* stream);  // gemm_kernels.cu

namespace {

// cuBLAS's recommendation for Hopper; one workspace per call from the stream-ordered caching
// allocator, so concurrent streams never share one.
constexpr size_t kWorkspaceBytes = 32u << 20;

cudaDataType_t cuda_type(DType dt) {
  switch (dt) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    case DType::F8E4M3: return CUDA_R_8F_E4M3;
    case DType::F8E5M2: return CUDA_R_8F_E5M2;
    default: raise("gemm: dtype {} is not supported", dtype_name(dt));
  }
}

cublasLtEpilogue_t lt_epilogue(int e) {
  switch (GemmEpilogue(e)) {
    case GemmEpilogue::None: return CUBLASLT_EPILOGUE_DEFAULT;
    case GemmEpilogue::Bias: return CUBLASLT_EPILOGUE_BIAS;
    case GemmEpilogue::Gelu: return CUBLASLT_EPILOGUE_GELU;
    case GemmEpilogue::BiasGelu: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case GemmEpilogue::BiasGradA: return CUBLASLT_EPILOGUE_BGRADB;
    case GemmEpilogue::BiasGradB: return CUBLASLT_EPILOGUE_BGRADA;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

int alignment_of(const void* p) {
  auto v = reinterpret_cast<uintptr_t>(p);
  int a = 1;
  while (a < 256 && (v % (2 * a)) == 0) a *= 2;
  return a;
}

// Owns the per-device handles; a handle serves any stream of its device.
class Handles {
 public:
  cublasLtHandle_t get(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handles_.find(device);
    if (it != handles_.end()) return it->second;
    cublasLtHandle_t h;
    MC_CUBLAS_CHECK(cublasLtCreate(&h));
    handles_.emplace(device, h);
    return h;
  }

 private:
  std::mutex mu_;
  std::unordered_map<int, cublasLtHandle_t> handles_;  // never destroyed: the driver may be gone at exit
};

Handles& handles() {
  static Handles* h = new Handles();
  return *h;
}

using PlanKey = std::array<int64_t, 28>;
struct PlanKeyHash {
  template <size_t N>
  size_t operator()(const std::array<int64_t, N>& k) const {
    size_t h = 1469598103934665603ull;
    for (int64_t v : k) h = (h ^ size_t(v)) * 1099511628211ull;
    return h;
  }
};

struct Layouts {
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLASLt's A (our b), B (our a), D (and C)
  cublasLtMatrixLayout_t c_in = nullptr;  // C when it is not D (GemmProblem::c_in), else null
  cublasLtMatrixLayout_t cin() const { return c_in ? c_in : c; }
};

// The beta term's source: c_in when given (out-of-place, its own leading dimension), else c itself.
const void* c_source(const GemmProblem& p) { return p.c_in ? p.c_in : p.c; }

struct Plan {
  Layouts layouts;
  cublasLtMatmulAlgo_t algo{};
  bool has_algo = false;  // false: cuBLASLt has no kernel for this epilogue (bias grad done separately)
  bool retuned = false;   // the timed choice is not the heuristic's first
};

class PlanCache {
 public:
  std::mutex mu;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
  int64_t retuned = 0;
};
PlanCache& plan_cache() {
  static PlanCache* c = new PlanCache();
  return *c;
}

cublasLtMatrixLayout_t make_layout(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                                   int64_t stride) {
  cublasLtMatrixLayout_t l;
  MC_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, t, uint64_t(rows), uint64_t(cols), ld));
  if (batch > 1) {
    int32_t bc = int32_t(batch);
    MC_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof(bc)));
    MC_CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
  return l;
}

struct DescGuard {
  cublasLtMatmulDesc_t d = nullptr;
  ~DescGuard() {
    if (d) cublasLtMatmulDescDestroy(d);
  }
};

// The SMs a product may use: the device's count less the margin (0 = no target: all of them).
int sm_target(int device, int margin) {
  if (margin <= 0) return 0;
  int n = 0;
  MC_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return std::max(1, n - margin);
}

void make_desc(DescGuard& g, const GemmProblem& p, bool with_epilogue, int sm_count) {
  const cublasComputeType_t compute =
      p.ab_dtype == DType::F32 && p.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  MC_CUBLAS_CHECK(cublasLtMatmulDescCreate(&g.d, compute, CUDA_R_32F));
  cublasOperation_t ta = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A is our b
  cublasOperation_t tb = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  if (sm_count > 0) {
    int32_t t = sm_count;
    MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.d, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &t, sizeof(t)));
  }
  cublasLtEpilogue_t epi = with_epilogue ? lt_epilogue(p.epilogue) : CUBLASLT_EPILOGUE_DEFAULT;
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  if (epi != CUBLASLT_EPILOGUE_DEFAULT && epi != CUBLASLT_EPILOGUE_GELU) {
    cudaDataType_t bt = cuda_type(p.bias_dtype);
    MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    const void* ptr = p.bias;  // null while planning: the heuristic only needs the configuration
    MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr, sizeof(ptr)));
    if (p.batch > 1) {
      int64_t zero = 0;
      MC_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(g.d, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &zero, sizeof(zero)));
    }
  }
}

bool is_bias_grad(int e) {
  return GemmEpilogue(e) == GemmEpilogue::BiasGradA || GemmEpilogue(e) == GemmEpilogue::BiasGradB;
}

bool stream_capturing(void* stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  MC_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &st));
  return st != cudaStreamCaptureStatusNone;
}

// Candidates that sum each output element in one pass, in k order, like the first choice: no split-K
// and no separate reduction.
bool single_pass(const cublasLtMatmulAlgo_t& algo) {
  uint32_t splits = 1, scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
  size_t got = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits, sizeof(splits), &got) !=
      CUBLAS_STATUS_SUCCESS)
    return false;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme),
                                           &got) != CUBLAS_STATUS_SUCCESS)
    return false;
  return splits <= 1 && scheme == CUBLASLT_REDUCTION_SCHEME_NONE;
}

// Times `algos` on the call's own operands (beta = 0: every run overwrites the same output) and
// returns the index of the fastest; the first is kept unless another is at least 1% faster.
// The heuristic's candidates worth timing: its first choice and every other single-pass one, or only the first
// when that one is not single-pass (then no candidate keeps its summation order).
std::vector<cublasLtMatmulAlgo_t> timing_candidates(const std::vector<cublasLtMatmulHeuristicResult_t>& res, int found) {
  std::vector<cublasLtMatmulAlgo_t> algos(1, res[0].algo);
  if (found > 1 && single_pass(res[0].algo))
    for (int i = 1; i < found; ++i)
      if (res[size_t(i)].state == CUBLAS_STATUS_SUCCESS && single_pass(res[size_t(i)].algo))
        algos.push_back(res[size_t(i)].algo);
  return algos;
}

// Times candidates 0..n-1 (`run(i)` launches candidate i on the call's own operands; beta = 0, so every run
// overwrites the same output) and returns the fastest: two interleaved rounds of kReps launches (clock drift shows
// as spread); a candidate must beat the earlier pick by 1 % to replace it; one that fails to launch is skipped.
template <class Run>
size_t time_algos(Run&& run, size_t n, void* stream) {
  auto cs = static_cast<cudaStream_t>(stream);
  cudaEvent_t e0, e1;
  MC_CUDA_CHECK(cudaEventCreate(&e0));
  MC_CUDA_CHECK(cudaEventCreate(&e1));
  constexpr int kReps = 3;
  std::vector<float> best(n, 1e30f);
  for (int round = 0; round < 2; ++round)
    for (size_t i = 0; i < n; ++i) {
      if (best[i] < 0.f) continue;  // failed to launch
      if (run(i) != CUBLAS_STATUS_SUCCESS) {
        best[i] = -1.f;
        continue;
      }
      MC_CUDA_CHECK(cudaEventRecord(e0, cs));
      for (int r = 0; r < kReps; ++r) (void)run(i);
      MC_CUDA_CHECK(cudaEventRecord(e1, cs));
      MC_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0.f;
      MC_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      best[i] = std::min(best[i], ms);
    }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  MC_CUDA_CHECK(cudaGetLastError());
  size_t pick = 0;
  for (size_t i = 1; i < n; ++i)
    if (best[i] > 0.f && (best[pick] < 0.f || best[i] < best[pick] * 0.99f)) pick = i;
  return pick;
}

size_t fastest_algo(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const Layouts& l, const GemmProblem& p,
                    const std::vector<cublasLtMatmulAlgo_t>& algos, int device, void* stream) {
  Allocator& alloc = Allocator::get(Device::cuda(device));
  Stream s = Stream::from_native(Device::cuda(device), stream);
  void* ws = alloc.allocate(kWorkspaceBytes, s);
  auto run = [&](size_t i) {
    return cublasLtMatmul(handle, desc, &p.alpha, p.b, l.a, p.a, l.b, &p.beta, c_source(p), l.cin(), p.c, l.c,
                          &algos[i], ws, kWorkspaceBytes, static_cast<cudaStream_t>(stream));
  };
  const size_t pick = time_algos(run, algos.size(), stream);
  alloc.deallocate(ws);
  return pick;
}

}  // namespace

int64_t gemm_plan_cache_size() {
  auto& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mu);
  return int64_t(cache.plans.size());
}

int64_t gemm_autotuned_plan_count() {
  auto& cache = plan_cache();
  std::lock_guard<std::mutex> lock(cache.mu);
  return cache.retuned;
}

void gemm(const GemmProblem& p, int device, void* stream) {
  cuda_impl::DeviceGuard guard(device);
  cublasLtHandle_t handle = handles().get(device);
  const cudaDataType_t ab_t = cuda_type(p.ab_dtype), c_t = cuda_type(p.out_dtype);

  PlanKey key{device, int64_t(p.ab_dtype), int64_t(p.out_dtype), p.trans_a, p.trans_b, p.m, p.n, p.k, p.batch,
              p.lda, p.ldb, p.ldc, p.stride_a, p.stride_b, p.stride_c, p.epilogue, int64_t(p.bias_dtype),
              p.allow_tf32, alignment_of(p.a), alignment_of(p.b), alignment_of(p.c),
              p.bias ? alignment_of(p.bias) : 0, p.beta != 0.f, sm_target(device, p.sm_margin),
              // Timed plans only where repeating the product is harmless (see ops::GemmAutotune).
              p.autotune_candidates > 1 && p.beta == 0.f ? p.autotune_candidates : 0,
              p.c_in ? p.ldc_in : 0, p.c_in ? p.stride_c_in : 0, p.c_in ? alignment_of(p.c_in) : 0};
  Plan plan;
  {
    auto& cache = plan_cache();
    std::lock_guard<std::mutex> lock(cache.mu);
    auto it = cache.plans.find(key);
    if (it == cache.plans.end() && key[24] != 0 && stream_capturing(stream)) {
      // Only a plan still to be made asks whether the stream is being captured: a capture cannot time
      // candidates, so it takes (and caches) the heuristic's first choice under the untimed key.
      key[24] = 0;
      it = cache.plans.find(key);
    }
    if (it != cache.plans.end()) {
      plan = it->second;
    } else {
      Layouts& l = plan.layouts;
      // cuBLASLt's A = our b, stored column-major as [N, K] (b row-major [K, N]) or [K, N] (trans_b).
      l.a = p.trans_b ? make_layout(ab_t, p.k, p.n, p.ldb, p.batch, p.stride_b)
                      : make_layout(ab_t, p.n, p.k, p.ldb, p.batch, p.stride_b);
      l.b = p.trans_a ? make_layout(ab_t, p.m, p.k, p.lda, p.batch, p.stride_a)
                      : make_layout(ab_t, p.k, p.m, p.lda, p.batch, p.stride_a);
      l.c = make_layout(c_t, p.n, p.m, p.ldc, p.batch, p.stride_c);
      if (p.c_in) l.c_in = make_layout(c_t, p.n, p.m, p.ldc_in, p.batch, p.stride_c_in);

      cublasLtMatmulPreference_t pref;
      MC_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
      size_t ws = kWorkspaceBytes;
      MC_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                           sizeof(ws)));
      uint32_t al[4] = {uint32_t(alignment_of(p.b)), uint32_t(alignment_of(p.a)), uint32_t(alignment_of(c_source(p))),
                        uint32_t(alignment_of(p.c))};
      MC_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al[0], 4));
      MC_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al[1], 4));
      MC_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al[2], 4));
      MC_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al[3], 4));

      auto find_algo = [&](bool with_epilogue) {
        DescGuard d;
        make_desc(d, p, with_epilogue, int(key[23]));
        const int want = std::max<int>(1, int(key[24]));
        std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(want));
        int found = 0;
        cublasStatus_t st =
            cublasLtMatmulAlgoGetHeuristic(handle, d.d, l.a, l.b, l.cin(), l.c, pref, want, res.data(), &found);
        if (st != CUBLAS_STATUS_SUCCESS || found <= 0) return false;
        plan.algo = res[0].algo;
        const std::vector<cublasLtMatmulAlgo_t> algos = timing_candidates(res, found);
        if (algos.size() > 1) {
          const size_t pick = fastest_algo(handle, d.d, l, p, algos, device, stream);
          plan.algo = algos[pick];
          plan.retuned = pick != 0;
        }
        return true;
      };
      plan.has_algo = find_algo(true);
      if (!plan.has_algo && is_bias_grad(p.epilogue)) {
        // cuBLASLt has no fused bias-gradient kernel for this layout: plain product + our reduction.
        MC_CHECK_AS(CudaError, find_algo(false), "gemm: cuBLASLt found no algorithm for m={} n={} k={} ({} -> {})",
                    p.m, p.n, p.k, dtype_name(p.ab_dtype), dtype_name(p.out_dtype));
      } else if (!plan.has_algo) {
        cublasLtMatmulPreferenceDestroy(pref);
        raise<CudaError>("gemm: cuBLASLt found no algorithm for m={} n={} k={} batch={} trans_a={} trans_b={} "
                         "({} inputs -> {} out, epilogue {})",
                         p.m, p.n, p.k, p.batch, p.trans_a, p.trans_b, dtype_name(p.ab_dtype),
                         dtype_name(p.out_dtype), p.epilogue);
      }
      cublasLtMatmulPreferenceDestroy(pref);
      cache.plans.emplace(key, plan);
      if (plan.retuned) ++cache.retuned;
    }
  }

  const bool fused = plan.has_algo;
  DescGuard d;
  make_desc(d, p, fused, int(key[23]));
  Allocator& alloc = Allocator::get(Device::cuda(device));
  Stream s = Stream::from_native(Device::cuda(device), stream);
  void* ws = alloc.allocate(kWorkspaceBytes, s);
  cublasStatus_t st = cublasLtMatmul(handle, d.d, &p.alpha, p.b, plan.layouts.a, p.a, plan.layouts.b, &p.beta,
                                     c_source(p), plan.layouts.cin(), p.c, plan.layouts.c, &plan.algo, ws, kWorkspaceBytes,
                                     static_cast<cudaStream_t>(stream));
  alloc.deallocate(ws);  // stream-ordered: reused only by later work on this stream
  MC_CUBLAS_CHECK(st);
  if (!fused && is_bias_grad(p.epilogue)) {
    if (GemmEpilogue(p.epilogue) == GemmEpilogue::BiasGradA) {
      // op(a)[m, k]: a stored [M, K] (row stride lda) or [K, M] (trans_a).
      bias_grad_reduce(p.ab_dtype, p.a, p.m, p.k, p.trans_a ? 1 : p.lda, p.trans_a ? p.lda : 1, p.bias_dtype,
                       p.bias, stream);
    } else {
      // op(b)[k, n]: b stored [K, N] or [N, K] (trans_b).
      bias_grad_reduce(p.ab_dtype, p.b, p.n, p.k, p.trans_b ? p.ldb : 1, p.trans_b ? 1 : p.ldb, p.bias_dtype,
                       p.bias, stream);
    }
  }
}

// ---- FP8 -------------------------------------------------------------------------------------------
//
// Row-major out[M, N] = a[M, K] b[N, K]ᵀ is the column-major D[N, M] = op(A) op(B) with A = b stored
// [K, N] (ld ldb) taken transposed and B = a stored [K, M] (ld lda) as is: the "TN" layout, the only one
// cuBLASLt's FP8 kernels take. cuBLASLt's A scale is therefore b's and its B scale a's. C (the beta term)
// has out's type: bf16 with bf16 out, f32 with f32 out.

namespace {

using Fp8Key = std::array<int64_t, 17>;
struct Fp8Plan {
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};
struct Fp8PlanCache {
  std::mutex mu;
  std::unordered_map<Fp8Key, Fp8Plan, PlanKeyHash> plans;
};

void make_fp8_desc(DescGuard& g, const GemmFp8Problem& p, int sm_count) {
  MC_CUBLAS_CHECK(cublasLtMatmulDescCreate(&g.d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const int8_t fast = p.fast_accum ? 1 : 0;
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  // Null while planning: the heuristic needs only to know scales are used.
  const void* sa = p.scale_inv_b;
  const void* sb = p.scale_inv_a;
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
  MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  if (sm_count > 0) {
    int32_t t = sm_count;
    MC_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(g.d, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &t, sizeof(t)));
  }
}

}  // namespace

void gemm_fp8(const GemmFp8Problem& p, int device, void* stream) {
  cuda_impl::DeviceGuard guard(device);
  cublasLtHandle_t handle = handles().get(device);
  static Fp8PlanCache* cache = new Fp8PlanCache();
  const int sm = sm_target(device, p.sm_margin);
  Fp8Key key{device, int64_t(p.a_dtype), int64_t(p.b_dtype), int64_t(p.out_dtype), p.m, p.n, p.k, p.lda,
             p.ldb, p.ldc, p.beta != 0.f, p.fast_accum, alignment_of(p.a), alignment_of(p.b),
             alignment_of(p.c), sm, p.autotune_candidates > 1 && p.beta == 0.f ? p.autotune_candidates : 0};
  Allocator& alloc = Allocator::get(Device::cuda(device));
  Stream s = Stream::from_native(Device::cuda(device), stream);
  void* ws = alloc.allocate(kWorkspaceBytes + 256, s);
  // Scale pointers not 16-byte aligned (a slot of a packed scale array) are copied into the 256 bytes ahead
  // of the workspace first (MEGACORE_FP8_NO_SCALE_COPY=1 skips this, for diagnosis).
  GemmFp8Problem q = p;
  static const bool no_copy = std::getenv("MEGACORE_FP8_NO_SCALE_COPY") != nullptr;
  if (!no_copy && (alignment_of(p.scale_inv_a) < 16 || alignment_of(p.scale_inv_b) < 16)) {
    auto* sc = static_cast<float*>(ws);
    auto cs = static_cast<cudaStream_t>(stream);
    MC_CUDA_CHECK(cudaMemcpyAsync(sc, p.scale_inv_a, sizeof(float), cudaMemcpyDeviceToDevice, cs));
    MC_CUDA_CHECK(cudaMemcpyAsync(sc + 4, p.scale_inv_b, sizeof(float), cudaMemcpyDeviceToDevice, cs));
    q.scale_inv_a = sc;
    q.scale_inv_b = sc + 4;
  }
  void* gemm_ws = static_cast<char*>(ws) + 256;
  Fp8Plan plan;
  {
    std::lock_guard<std::mutex> lock(cache->mu);
    auto it = cache->plans.find(key);
    if (it == cache->plans.end() && key[16] != 0 && stream_capturing(stream)) {
      key[16] = 0;  // a capture cannot time candidates: the heuristic's first choice, cached untimed
      it = cache->plans.find(key);
    }
    if (it != cache->plans.end()) {
      plan = it->second;
    } else {
      plan.a = make_layout(cuda_type(p.b_dtype), p.k, p.n, p.ldb, 1, 0);
      plan.b = make_layout(cuda_type(p.a_dtype), p.k, p.m, p.lda, 1, 0);
      plan.c = make_layout(cuda_type(p.out_dtype), p.n, p.m, p.ldc, 1, 0);
      cublasLtMatmulPreference_t pref;
      MC_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
      size_t ws = kWorkspaceBytes;
      MC_CUBLAS_CHECK(
          cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
      // The operands' real alignments (the preference defaults to 256 bytes, which a kernel may then assume).
      const uint32_t al[3] = {uint32_t(alignment_of(p.b)), uint32_t(alignment_of(p.a)), uint32_t(alignment_of(p.c))};
      MC_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al[0], 4));
      MC_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al[1], 4));
      MC_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al[2], 4));
      MC_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al[2], 4));
      DescGuard d;
      make_fp8_desc(d, q, sm);  // the real (aligned) scales: timed candidates run on the call's operands
      const int want = std::max<int>(1, int(key[16]));
      std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(want));
      int found = 0;
      const cublasStatus_t st =
          cublasLtMatmulAlgoGetHeuristic(handle, d.d, plan.a, plan.b, plan.c, plan.c, pref, want, res.data(), &found);
      cublasLtMatmulPreferenceDestroy(pref);
      MC_CHECK_AS(CudaError, st == CUBLAS_STATUS_SUCCESS && found > 0,
                  "gemm_fp8: cuBLASLt found no FP8 algorithm for m={} n={} k={} ({} x {} -> {}); FP8 GEMMs need a GPU "
                  "of compute capability 8.9 or newer and cuBLASLt 12.x",
                  p.m, p.n, p.k, dtype_name(p.a_dtype), dtype_name(p.b_dtype), dtype_name(p.out_dtype));
      plan.algo = res[0].algo;
      // As the bf16 products (ops::GemmAutotune): only single-pass candidates, so every one sums in one order.
      const std::vector<cublasLtMatmulAlgo_t> algos = timing_candidates(res, found);
      if (algos.size() > 1) {
        const float alpha = 1.f;
        auto run = [&](size_t i) {
          return cublasLtMatmul(handle, d.d, &alpha, p.b, plan.a, p.a, plan.b, &p.beta, p.c, plan.c, p.c, plan.c,
                                &algos[i], gemm_ws, kWorkspaceBytes, static_cast<cudaStream_t>(stream));
        };
        plan.algo = algos[time_algos(run, algos.size(), stream)];
      }
      cache->plans.emplace(key, plan);
    }
  }
  DescGuard d;
  make_fp8_desc(d, q, sm);
  const float alpha = 1.f;
  const cublasStatus_t st = cublasLtMatmul(handle, d.d, &alpha, p.b, plan.a, p.a, plan.b, &p.beta, p.c, plan.c, p.c,
                                           plan.c, &plan.algo, gemm_ws, kWorkspaceBytes,
                                           static_cast<cudaStream_t>(stream));
  alloc.deallocate(ws);
  MC_CUBLAS_CHECK(st);
}

}  // namespace megacore::ops::cuda
