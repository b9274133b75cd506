// CUDA kernels of the MoE ops (router, capacity, losses, permutation).
//
// Router kernels run one warp per token: E <= 256 scores fit in eight registers per lane, and top-k
// is k rounds of a warp arg-max (ties to the lower expert id, as on the CPU). Everything that orders
// slots is deterministic without atomics on the order: moe_permute_map and router_apply_capacity run
// one block per expert that walks the slots in (t, j) order with block-wide prefix counts, so the
// result never depends on scheduling. That costs E passes over the T * k slot indices (int32, L2
// resident): for 256 experts and 64k slots about 64 MB of L2 reads, a few microseconds on H100,
// next to milliseconds of expert GEMMs. Losses reduce per-token terms in a fixed order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "core/cuda/cuda_check.hpp"
#include "megacore/core/random.hpp"
#include "ops/cuda/moe_cuda.hpp"

namespace megacore::ops::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kPerLane = kMoeMaxExperts / kWarp;  // scores held per lane
constexpr int kRouterWarps = 4;                   // tokens per block
constexpr float kSigmoidEps = 1e-20f;

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
/// exp for the router: the fast intrinsic, or (Precise) expf, within 2 ulp, where a score decides the
/// selection (top-k with an expert bias selects on score + bias, so the score's error moves near-ties).
template <bool Precise = false>
__device__ __forceinline__ float router_exp(float x) {
  if constexpr (Precise) return expf(x);
  else return __expf(x);
}
template <bool Precise = false>
__device__ __forceinline__ float sigmoidf(float z) { return 1.f / (1.f + router_exp<Precise>(-z)); }
/// The token of this warp (kRouterWarps tokens per block).
__device__ __forceinline__ int64_t warp_token() { return int64_t(blockIdx.x) * kRouterWarps + threadIdx.x / kWarp; }

// One token's row in registers: z (logits, -inf past E) and base (what the probabilities come from:
// the logits for softmax-after-top-k, softmax over all E, or the sigmoids).
struct Row {
  float z[kPerLane];
  float base[kPerLane];
};

template <bool Precise = false>
__device__ void load_row(const float* logits, int64_t t, int e, bool sigmoid, bool softmax_all, Row& r) {
  const int lane = threadIdx.x % kWarp;
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + i * kWarp;
    r.z[i] = c < e ? logits[t * e + c] : -INFINITY;
    mx = fmaxf(mx, r.z[i]);
  }
  if (sigmoid) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) r.base[i] = lane + i * kWarp < e ? sigmoidf<Precise>(r.z[i]) : 0.f;
  } else if (softmax_all) {
    mx = warp_max(mx);
    float s = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) s += (r.base[i] = lane + i * kWarp < e ? router_exp<Precise>(r.z[i] - mx) : 0.f);
    s = warp_sum(s);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) r.base[i] /= s;
  } else {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) r.base[i] = r.z[i];
  }
}

__global__ void router_topk_kernel(RouterArgs a, float* probs, int32_t* indices) {
  const int64_t t = warp_token();
  if (t >= a.t) return;
  const int lane = threadIdx.x % kWarp;
  const bool post = !a.sigmoid && !a.pre_softmax;
  Row r;
  load_row<true>(a.logits, t, a.e, a.sigmoid, !a.sigmoid && a.pre_softmax, r);
  // Selection score: the logits without a bias (softmax and sigmoid are strictly increasing, so their
  // top-k is the logits' top-k, exact and free of rounding ties), score + bias with one.
  float sel[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + i * kWarp;
    sel[i] = c >= a.e ? -INFINITY : a.bias ? r.base[i] + a.bias[c] : r.z[i];
  }
  int chosen[kMoeMaxTopk];
  float cbase[kMoeMaxTopk];
  bool taken[kPerLane] = {};
  for (int j = 0; j < a.k; ++j) {
    // Lane-local best, then a warp arg-max on (score, -id).
    float bv = -INFINITY, bb = 0.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int c = lane + i * kWarp;
      if (c < a.e && !taken[i] && (sel[i] > bv || bi == 0x7fffffff)) bv = sel[i], bi = c, bb = r.base[i];
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      const float ob = __shfl_xor_sync(0xffffffffu, bb, o);
      if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi, bb = ob;
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (lane + i * kWarp == bi) taken[i] = true;
    chosen[j] = bi;
    cbase[j] = bb;
  }
  // Every lane holds the same choice; lane j writes slot j.
  float norm = 1.f, mx = -INFINITY;
  if (post) {
    for (int j = 0; j < a.k; ++j) mx = fmaxf(mx, cbase[j]);
    norm = 0.f;
    for (int j = 0; j < a.k; ++j) norm += expf(cbase[j] - mx);
  } else if (a.sigmoid && a.k > 1) {
    norm = kSigmoidEps;
    for (int j = 0; j < a.k; ++j) norm += cbase[j];
  }
  for (int j = lane; j < a.k; j += kWarp) {
    float p = 0.f;
#pragma unroll
    for (int jj = 0; jj < kMoeMaxTopk; ++jj)
      if (jj == j) p = post ? expf(cbase[jj] - mx) / norm : cbase[jj] / norm;
    int id = 0;
#pragma unroll
    for (int jj = 0; jj < kMoeMaxTopk; ++jj)
      if (jj == j) id = chosen[jj];
    probs[t * a.k + j] = p * a.scaling;
    indices[t * a.k + j] = id;
  }
}

__global__ void router_topk_backward_kernel(RouterArgs a, const int32_t* indices, const float* dprobs,
                                            float* dlogits) {
  const int64_t t = warp_token();
  if (t >= a.t) return;
  const int lane = threadIdx.x % kWarp;
  const float* z = a.logits + t * a.e;
  float* dz = dlogits + t * a.e;
  const int32_t* idx = indices + t * a.k;
  const float* dp = dprobs + t * a.k;
  auto valid = [&](int j) { return idx[j] >= 0 && idx[j] < a.e; };
  if (!a.sigmoid && !a.pre_softmax) {
    // p = softmax over the chosen logits: dz_j = s p_j (dp_j - sum_l p_l dp_l).
    float mx = -INFINITY;
    for (int j = 0; j < a.k; ++j)
      if (valid(j)) mx = fmaxf(mx, z[idx[j]]);
    float s = 0, dot = 0;
    for (int j = 0; j < a.k; ++j)
      if (valid(j)) s += __expf(z[idx[j]] - mx);
    for (int j = 0; j < a.k; ++j)
      if (valid(j)) dot += __expf(z[idx[j]] - mx) / s * dp[j];
    for (int j = lane; j < a.k; j += kWarp)
      if (valid(j)) dz[idx[j]] += a.scaling * (__expf(z[idx[j]] - mx) / s) * (dp[j] - dot);
    return;
  }
  if (a.sigmoid) {
    // Only the chosen sigmoids reach the probabilities.
    float s = kSigmoidEps, dot = 0;
    for (int j = 0; j < a.k; ++j)
      if (valid(j)) s += sigmoidf(z[idx[j]]), dot += dp[j] * sigmoidf(z[idx[j]]);
    for (int j = lane; j < a.k; j += kWarp) {
      if (!valid(j)) continue;
      const float g = sigmoidf(z[idx[j]]);
      const float dg = a.k > 1 ? a.scaling * (dp[j] / s - dot / (s * s)) : a.scaling * dp[j];
      dz[idx[j]] += dg * g * (1.f - g);
    }
    return;
  }
  // Softmax over all E, then top-k: dz = sc (dsc - <sc, dsc>), dsc = s dp at the chosen experts.
  Row r;
  load_row(a.logits, t, a.e, false, true, r);
  float part = 0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + i * kWarp;
    float dsc = 0;
    for (int j = 0; j < a.k; ++j)
      if (idx[j] == c) dsc = a.scaling * dp[j];
    part += r.base[i] * dsc;
  }
  const float dot = warp_sum(part);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int c = lane + i * kWarp;
    if (c >= a.e) continue;
    float dsc = 0;
    for (int j = 0; j < a.k; ++j)
      if (idx[j] == c) dsc = a.scaling * dp[j];
    dz[c] += r.base[i] * (dsc - dot);
  }
}

// ---- block-wide prefix counts (one block walks the slots in order) -----------------------------------

constexpr int kScanThreads = 1024;

/// Exclusive prefix count of `pred` over the block's threads (in thread order) and the block total.
/// Every thread of the block must call it.
__device__ int block_prefix_count(bool pred, int& total) {
  __shared__ int warp_counts[kScanThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const unsigned ballot = __ballot_sync(0xffffffffu, pred);
  const int in_warp = __popc(ballot & ((1u << lane) - 1u));
  __syncthreads();  // the previous call's readers are done with warp_counts
  if (lane == 0) warp_counts[warp] = __popc(ballot);
  __syncthreads();
  int before = 0;
  total = 0;
  for (int w = 0; w < int(blockDim.x) / kWarp; ++w) {
    const int c = warp_counts[w];
    if (w < warp) before += c;
    total += c;
  }
  return before + in_warp;
}

/// Sum over the block (every thread gets it).
__device__ long long block_sum(long long v) {
  __shared__ long long partial[kScanThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  long long s = 0;
  for (int w = 0; w < int(blockDim.x) / kWarp; ++w) s += partial[w];
  return s;
}

// Block e: offset = slots of experts < e, then the ranks of expert e's slots in (t, j) order.
__global__ void permute_map_kernel(const int32_t* indices, int64_t slots, int e, int32_t* row_map, int64_t* counts) {
  const int ex = blockIdx.x;
  long long lt = 0, bad = 0;
  for (int64_t i = threadIdx.x; i < slots; i += blockDim.x) {
    const int v = indices[i];
    lt += (v >= 0 && v < ex);
    bad += (v < -1 || v >= e);
  }
  const long long offset = block_sum(lt);
  const long long n_bad = block_sum(bad);
  long long rank = 0;
  for (int64_t base = 0; base < slots; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const int v = i < slots ? indices[i] : -1;
    int total = 0;
    const int r = block_prefix_count(v == ex, total);
    if (v == ex) row_map[i] = int32_t(offset + rank + r);
    if (ex == 0 && i < slots && (v < 0 || v >= e)) row_map[i] = -1;
    rank += total;
  }
  if (threadIdx.x == 0) counts[ex] = n_bad ? -1 : rank;
}

// Float bits in an order-preserving unsigned form (larger float, larger key).
__device__ __forceinline__ unsigned ordered_key(float f) {
  const unsigned u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Block e keeps expert e's `capacity` most probable slots: a bitwise radix select finds the
// capacity-th largest key, then one ordered pass keeps the larger ones and the first equal ones.
__global__ void capacity_kernel(float* probs, int32_t* indices, int64_t slots, int64_t capacity) {
  const int ex = blockIdx.x;
  auto count_if = [&](auto pred) {
    long long c = 0;
    for (int64_t i = threadIdx.x; i < slots; i += blockDim.x)
      if (indices[i] == ex && pred(ordered_key(probs[i]))) ++c;
    return block_sum(c);
  };
  const long long n = count_if([](unsigned) { return true; });
  if (n <= capacity) return;
  unsigned thr = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const unsigned cand = thr | (1u << bit);
    if (count_if([cand](unsigned k) { return k >= cand; }) >= capacity) thr = cand;
  }
  const long long greater = count_if([thr](unsigned k) { return k > thr; });
  const long long keep_equal = capacity - greater;
  long long seen_equal = 0;
  for (int64_t base = 0; base < slots; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const bool mine = i < slots && indices[i] == ex;
    const unsigned key = mine ? ordered_key(probs[i]) : 0u;
    int total = 0;
    const int r = block_prefix_count(mine && key == thr, total);
    __syncthreads();  // every thread has read indices[i] of this chunk before any is rewritten
    if (mine && (key < thr || (key == thr && seen_equal + r >= keep_equal))) {
      indices[i] = -1;
      probs[i] = 0.f;
    }
    seen_equal += total;
  }
}

// ---- losses ----------------------------------------------------------------------------------------

// The aux loss's row prologue, shared by its forward and backward: token t's scores (softmax, or sigmoid)
// into r.base, and over the warp dot = sum_e scores[t, e] n_e and norm = sum_e scores[t, e] + kSigmoidEps
// (the sigmoid scores' normaliser).
struct AuxSums {
  float dot, norm;
};
__device__ AuxSums aux_row(const float* logits, bool sigmoid, const float* tpe, int64_t t, int e, Row& r) {
  const int lane = threadIdx.x % kWarp;
  load_row(logits, t, e, sigmoid, true, r);
  float dot = 0, norm = 0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int col = lane + i * kWarp;
    if (col < e) dot += r.base[i] * tpe[col], norm += r.base[i];
  }
  return {warp_sum(dot), warp_sum(norm) + kSigmoidEps};
}

// Per-token terms: aux: sum_e scores[t, e] n_e; z: lse^2.
__global__ void aux_terms_kernel(const float* logits, bool sigmoid, const float* tpe, int64_t t_rows, int e,
                                 float* work) {
  const int64_t t = warp_token();
  if (t >= t_rows) return;
  Row r;
  const AuxSums a = aux_row(logits, sigmoid, tpe, t, e, r);
  if (threadIdx.x % kWarp == 0) work[t] = sigmoid ? a.dot / a.norm : a.dot;
}

__device__ float row_lse(const Row& r, int e) {
  const int lane = threadIdx.x % kWarp;
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) mx = fmaxf(mx, r.z[i]);
  mx = warp_max(mx);
  float s = 0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    if (lane + i * kWarp < e) s += __expf(r.z[i] - mx);
  return mx + __logf(warp_sum(s));
}

__global__ void z_terms_kernel(const float* logits, int64_t t_rows, int e, float* work) {
  const int64_t t = warp_token();
  if (t >= t_rows) return;
  Row r;
  load_row(logits, t, e, false, false, r);
  const float l = row_lse(r, e);
  if (threadIdx.x % kWarp == 0) work[t] = l * l;
}

// loss[0] = scale * sum(work), in a fixed order (f64 accumulation).
__global__ void reduce_terms_kernel(const float* work, int64_t n, float scale, float* loss) {
  __shared__ double part[kScanThreads];
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += work[i];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) loss[0] = float(double(scale) * part[0]);
}

__global__ void aux_backward_kernel(const float* logits, bool sigmoid, const float* tpe, int64_t t_rows, int e,
                                    float c, float* dlogits) {
  const int64_t t = warp_token();
  if (t >= t_rows) return;
  const int lane = threadIdx.x % kWarp;
  Row r;
  const auto [dot, norm] = aux_row(logits, sigmoid, tpe, t, e, r);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int col = lane + i * kWarp;
    if (col >= e) continue;
    const float n = tpe[col], g = r.base[i];
    dlogits[t * e + col] +=
        sigmoid ? c * (n / norm - dot / (norm * norm)) * g * (1.f - g) : c * g * (n - dot);
  }
}

__global__ void z_backward_kernel(const float* logits, int64_t t_rows, int e, float c, float* dlogits) {
  const int64_t t = warp_token();
  if (t >= t_rows) return;
  const int lane = threadIdx.x % kWarp;
  Row r;
  load_row(logits, t, e, false, false, r);
  const float l = row_lse(r, e);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int col = lane + i * kWarp;
    if (col < e) dlogits[t * e + col] += c * l * __expf(r.z[i] - l);
  }
}

// ---- permutation -------------------------------------------------------------------------------------

// One block per token: each chunk of the row is read once and written to the token's k rows.
template <class V>
__global__ void permute_kernel(const V* x, const int32_t* row_map, V* permuted, int k, int64_t row_vecs) {
  const int64_t t = blockIdx.x;
  const int32_t* m = row_map + t * k;
  for (int64_t c = threadIdx.x; c < row_vecs; c += blockDim.x) {
    const V v = x[t * row_vecs + c];
    for (int j = 0; j < k; ++j)
      if (m[j] >= 0) permuted[int64_t(m[j]) * row_vecs + c] = v;
  }
}

template <class T>
__device__ __forceinline__ float to_f(T v) { return float(v); }
template <>
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <class T>
__device__ __forceinline__ T from_f(float v) { return T(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16(v); }
template <>
__device__ __forceinline__ __half from_f(float v) { return __float2half(v); }

// Elements per 16-byte vector, and the vector loop over a row of h elements starting at element 0.
template <class T>
constexpr int kVec = 16 / int(sizeof(T));

template <class T>
struct alignas(16) Pack {
  T v[kVec<T>];
};

// One block per token; f32 accumulation over the token's k rows.
template <class T, bool kVectorised>
__global__ void unpermute_kernel(const T* permuted, const int32_t* row_map, const float* probs, T* y, int k,
                                 int64_t h) {
  const int64_t t = blockIdx.x;
  const int32_t* m = row_map + t * k;
  if constexpr (kVectorised) {
    constexpr int V = kVec<T>;
    for (int64_t c = threadIdx.x; c < h / V; c += blockDim.x) {
      float acc[V] = {};
      for (int j = 0; j < k; ++j) {
        if (m[j] < 0) continue;
        const float w = probs ? probs[t * k + j] : 1.f;
        const Pack<T> p = reinterpret_cast<const Pack<T>*>(permuted + int64_t(m[j]) * h)[c];
#pragma unroll
        for (int u = 0; u < V; ++u) acc[u] += w * to_f(p.v[u]);
      }
      Pack<T> out;
#pragma unroll
      for (int u = 0; u < V; ++u) out.v[u] = from_f<T>(acc[u]);
      reinterpret_cast<Pack<T>*>(y + t * h)[c] = out;
    }
  } else {
    for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
      float acc = 0;
      for (int j = 0; j < k; ++j)
        if (m[j] >= 0) acc += (probs ? probs[t * k + j] : 1.f) * to_f(permuted[int64_t(m[j]) * h + c]);
      y[t * h + c] = from_f<T>(acc);
    }
  }
}

// One block per token: dpermuted rows = w dy, dprobs = <dy, permuted row> (block reduction per slot).
template <class T>
__global__ void unpermute_backward_kernel(const T* dy, const T* permuted, const int32_t* row_map, const float* probs,
                                          T* dpermuted, float* dprobs, int k, int64_t h) {
  __shared__ float part[kScanThreads / kWarp];
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int j = 0; j < k; ++j) {
    const int32_t r = row_map[t * k + j];
    float dot = 0;
    if (r >= 0) {
      const float w = probs[t * k + j];
      for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
        const float g = to_f(dy[t * h + c]);
        dot += g * to_f(permuted[int64_t(r) * h + c]);
        dpermuted[int64_t(r) * h + c] = from_f<T>(w * g);
      }
    }
    dot = warp_sum(dot);
    __syncthreads();
    if (lane == 0) part[warp] = dot;
    __syncthreads();
    if (threadIdx.x == 0) {
      float s = 0;
      for (int w = 0; w < int(blockDim.x) / kWarp; ++w) s += part[w];
      dprobs[t * k + j] = s;
    }
  }
}

constexpr int kPointersPerLaunch = 256;  // 2 KiB of kernel arguments
struct PointerChunk {
  const void* p[kPointersPerLaunch];
};
__global__ void upload_pointers_kernel(PointerChunk chunk, int n, void** dev) {
  if (int(threadIdx.x) < n) dev[threadIdx.x] = const_cast<void*>(chunk.p[threadIdx.x]);
}

template <class T>
__global__ void scale_kernel(T* x, int64_t n, float alpha) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = from_f<T>(alpha * to_f(x[i]));
}

template <class F>
void dispatch(DType dt, F&& f) {
  switch (dt) {
    case DType::BF16: f(__nv_bfloat16{}); break;
    case DType::F16: f(__half{}); break;
    default: f(float{}); break;
  }
}

unsigned router_blocks(int64_t t) { return unsigned((t + kRouterWarps - 1) / kRouterWarps); }

}  // namespace

void router_topk(const RouterArgs& a, float* probs, int32_t* indices, int device, void* stream) {
  if (a.t == 0) return;
  cuda_impl::DeviceGuard g(device);
  router_topk_kernel<<<router_blocks(a.t), kRouterWarps * kWarp, 0, static_cast<cudaStream_t>(stream)>>>(a, probs,
                                                                                                        indices);
  MC_CUDA_CHECK_LAUNCH();
}

void router_topk_backward(const RouterArgs& a, const int32_t* indices, const float* dprobs, float* dlogits, int device,
                          void* stream) {
  if (a.t == 0) return;
  cuda_impl::DeviceGuard g(device);
  router_topk_backward_kernel<<<router_blocks(a.t), kRouterWarps * kWarp, 0, static_cast<cudaStream_t>(stream)>>>(
      a, indices, dprobs, dlogits);
  MC_CUDA_CHECK_LAUNCH();
}

void router_apply_capacity(float* probs, int32_t* indices, int64_t slots, int k, int e, int64_t capacity, int device,
                           void* stream) {
  if (slots == 0) return;
  cuda_impl::DeviceGuard g(device);
  capacity_kernel<<<unsigned(e), kScanThreads, 0, static_cast<cudaStream_t>(stream)>>>(probs, indices, slots,
                                                                                       capacity);
  MC_CUDA_CHECK_LAUNCH();
}

void router_aux_loss(const float* logits, bool sigmoid, const float* tpe, int64_t t, int e, float scale, float* work,
                     float* loss, int device, void* stream) {
  cuda_impl::DeviceGuard g(device);
  auto cs = static_cast<cudaStream_t>(stream);
  if (t > 0) aux_terms_kernel<<<router_blocks(t), kRouterWarps * kWarp, 0, cs>>>(logits, sigmoid, tpe, t, e, work);
  MC_CUDA_CHECK_LAUNCH();
  reduce_terms_kernel<<<1, kScanThreads, 0, cs>>>(work, t, scale, loss);
  MC_CUDA_CHECK_LAUNCH();
}

void router_aux_loss_backward(const float* logits, bool sigmoid, const float* tpe, int64_t t, int e, float scale,
                              float* dlogits, int device, void* stream) {
  if (t == 0) return;
  cuda_impl::DeviceGuard g(device);
  aux_backward_kernel<<<router_blocks(t), kRouterWarps * kWarp, 0, static_cast<cudaStream_t>(stream)>>>(
      logits, sigmoid, tpe, t, e, scale, dlogits);
  MC_CUDA_CHECK_LAUNCH();
}

namespace {
__global__ void random_logits_kernel(float* logits, int64_t n, uint64_t seed, uint64_t offset, uint64_t first) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    logits[i] = philox_normal(seed, offset, first + uint64_t(i));
}
}  // namespace

void router_random_logits(float* logits, int64_t t, int e, uint64_t seed, uint64_t offset, int64_t first_token,
                          int device, void* stream) {
  const int64_t n = t * int64_t(e);
  if (n == 0) return;
  cuda_impl::DeviceGuard g(device);
  constexpr int kThreads = 256;
  const auto blocks = unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
  random_logits_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      logits, n, seed, offset, uint64_t(first_token) * uint64_t(e));
  MC_CUDA_CHECK_LAUNCH();
}

void router_z_loss(const float* logits, int64_t t, int e, float scale, float* work, float* loss, int device,
                   void* stream) {
  cuda_impl::DeviceGuard g(device);
  auto cs = static_cast<cudaStream_t>(stream);
  z_terms_kernel<<<router_blocks(t), kRouterWarps * kWarp, 0, cs>>>(logits, t, e, work);
  MC_CUDA_CHECK_LAUNCH();
  reduce_terms_kernel<<<1, kScanThreads, 0, cs>>>(work, t, scale, loss);
  MC_CUDA_CHECK_LAUNCH();
}

void router_z_loss_backward(const float* logits, int64_t t, int e, float scale, float* dlogits, int device,
                            void* stream) {
  cuda_impl::DeviceGuard g(device);
  z_backward_kernel<<<router_blocks(t), kRouterWarps * kWarp, 0, static_cast<cudaStream_t>(stream)>>>(logits, t, e,
                                                                                                     scale, dlogits);
  MC_CUDA_CHECK_LAUNCH();
}

void moe_permute_map(const int32_t* indices, int64_t slots, int e, int32_t* row_map, int64_t* counts, int device,
                     void* stream) {
  cuda_impl::DeviceGuard g(device);
  permute_map_kernel<<<unsigned(e), kScanThreads, 0, static_cast<cudaStream_t>(stream)>>>(indices, slots, e, row_map,
                                                                                          counts);
  MC_CUDA_CHECK_LAUNCH();
}

namespace {

// One block per segment (block c, source-and-expert i): thread 0 finds where the segment's rows sit in the
// received buffer (rows of the earlier segments of block c) and where they go (the start of local expert
// j = i mod El plus the rows of j in earlier segments, in (block, source) order); the block's threads then
// write the segment's consecutive targets. Segments number chunks · E (a few thousand at most), so the
// O(chunks · E) prefix per block is cheap next to a host round trip.
__global__ void sort_map_kernel(const int64_t* layout, int64_t chunks, int64_t e, int64_t el, int64_t pad_rows,
                                int32_t* map) {
  __shared__ long long src, dst;
  const int64_t seg = blockIdx.x, c = seg / e, i = seg % e, j = i % el;
  if (threadIdx.x == 0) {
    long long so = 0, d = 0;
    for (int64_t q = 0; q < i; ++q) so += layout[c * e + q];
    for (int64_t x = 0; x < chunks * e; ++x) {
      const int64_t jx = (x % e) % el;
      if (jx < j || (jx == j && x < seg)) d += layout[x];
    }
    src = c * pad_rows + so;
    dst = d;
  }
  __syncthreads();
  const int64_t rows = layout[seg];
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) map[src + r] = int32_t(dst + r);
}

}  // namespace

void moe_sort_map(const int64_t* layout, int64_t chunks, int64_t e, int64_t local_experts, int64_t pad_rows,
                  int32_t* map, int device, void* stream) {
  cuda_impl::DeviceGuard g(device);
  auto cs = static_cast<cudaStream_t>(stream);
  MC_CUDA_CHECK(cudaMemsetAsync(map, 0xff, size_t(chunks * pad_rows) * sizeof(int32_t), cs));  // -1: padding
  sort_map_kernel<<<unsigned(chunks * e), 256, 0, cs>>>(layout, chunks, e, local_experts, pad_rows, map);
  MC_CUDA_CHECK_LAUNCH();
}

void moe_permute(const void* x, const int32_t* row_map, void* permuted, int64_t t, int k, int64_t row_bytes,
                 int device, void* stream) {
  if (t == 0 || row_bytes == 0) return;
  cuda_impl::DeviceGuard g(device);
  auto cs = static_cast<cudaStream_t>(stream);
  const auto aligned = [&](int64_t a) {
    return row_bytes % a == 0 && reinterpret_cast<uintptr_t>(x) % a == 0 &&
           reinterpret_cast<uintptr_t>(permuted) % a == 0;
  };
  if (aligned(16)) {
    permute_kernel<<<unsigned(t), 256, 0, cs>>>(static_cast<const uint4*>(x), row_map, static_cast<uint4*>(permuted),
                                                k, row_bytes / 16);
  } else if (aligned(4)) {
    permute_kernel<<<unsigned(t), 256, 0, cs>>>(static_cast<const uint32_t*>(x), row_map,
                                                static_cast<uint32_t*>(permuted), k, row_bytes / 4);
  } else {
    permute_kernel<<<unsigned(t), 256, 0, cs>>>(static_cast<const uint16_t*>(x), row_map,
                                                static_cast<uint16_t*>(permuted), k, row_bytes / 2);
  }
  MC_CUDA_CHECK_LAUNCH();
}

void moe_unpermute(DType dt, const void* permuted, const int32_t* row_map, const float* probs, void* y, int64_t t,
                   int k, int64_t h, int device, void* stream) {
  if (t == 0 || h == 0) return;
  cuda_impl::DeviceGuard g(device);
  auto cs = static_cast<cudaStream_t>(stream);
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = h % kVec<T> == 0 && reinterpret_cast<uintptr_t>(permuted) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(y) % 16 == 0;
    if (vec)
      unpermute_kernel<T, true><<<unsigned(t), 256, 0, cs>>>(static_cast<const T*>(permuted), row_map, probs,
                                                             static_cast<T*>(y), k, h);
    else
      unpermute_kernel<T, false><<<unsigned(t), 256, 0, cs>>>(static_cast<const T*>(permuted), row_map, probs,
                                                              static_cast<T*>(y), k, h);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void moe_unpermute_backward(DType dt, const void* dy, const void* permuted, const int32_t* row_map, const float* probs,
                            void* dpermuted, int64_t n_rows, float* dprobs, int64_t t, int k, int64_t h, int device,
                            void* stream) {
  cuda_impl::DeviceGuard g(device);
  auto cs = static_cast<cudaStream_t>(stream);
  const int64_t elem = dt == DType::F32 ? 4 : 2;
  // Rows no slot maps to are zero; the mapped rows are overwritten below.
  if (n_rows * h > 0) MC_CUDA_CHECK(cudaMemsetAsync(dpermuted, 0, size_t(n_rows * h * elem), cs));
  if (t == 0) return;
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    unpermute_backward_kernel<T><<<unsigned(t), 256, 0, cs>>>(static_cast<const T*>(dy),
                                                              static_cast<const T*>(permuted), row_map, probs,
                                                              static_cast<T*>(dpermuted), dprobs, k, h);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void upload_pointers(const void* const* host, int64_t count, void** dev, int device, void* stream) {
  cuda_impl::DeviceGuard g(device);
  for (int64_t base = 0; base < count; base += kPointersPerLaunch) {
    const int n = int(std::min<int64_t>(kPointersPerLaunch, count - base));
    PointerChunk chunk{};
    for (int i = 0; i < n; ++i) chunk.p[i] = host[base + i];
    upload_pointers_kernel<<<1, kPointersPerLaunch, 0, static_cast<cudaStream_t>(stream)>>>(chunk, n, dev + base);
    MC_CUDA_CHECK_LAUNCH();
  }
}

void moe_scale(DType dt, void* x, int64_t n, float alpha, int device, void* stream) {
  if (n == 0) return;
  cuda_impl::DeviceGuard g(device);
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    const unsigned blocks = unsigned(std::min<int64_t>((n + 255) / 256, 4096));
    scale_kernel<T><<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<T*>(x), n, alpha);
  });
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace megacore::ops::cuda
