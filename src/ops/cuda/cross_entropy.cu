// Cross-entropy kernels. One block per row in a persistent grid: pass 1 streams the row once with an
// online (max, sum-exp) in the log2 domain; pass 2 (fused / backward) streams it again and writes the
// gradient, possibly over the logits. The grid is sized so that the rows in flight fit in part of L2
// (CeTuning::l2_fraction: by default 0.75 for rows up to 128 KiB, 0.5 above), so pass 2 mostly re-reads
// from L2 rather than from device memory, and pass 2 reads evict-first. CeTuning (cross_entropy_cuda.hpp)
// holds the launch-shape choices.
#include <cfloat>

#include <cooperative_groups.h>

#include "ops/cuda/cross_entropy_cuda.hpp"
#include "ops/cuda/fast_math.cuh"
#include "ops/cuda/memops_common.cuh"

namespace megacore::ops::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kMaxThreads = 512;

struct MaxSum {
  float m, s;  // max (log2 units) and sum of 2^(x - m)
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * fast_exp2(a.m - m) + b.s * fast_exp2(b.m - m)};
}

// combine over the 32 lanes of a warp; every lane gets the result.
__device__ __forceinline__ MaxSum warp_combine(MaxSum ms) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, ms.m, o), __shfl_xor_sync(0xffffffffu, ms.s, o)};
    ms = combine(ms, other);
  }
  return ms;
}

__device__ __forceinline__ int64_t label_at(const CeArgs& a, int64_t row) {
  return a.labels_i64 ? static_cast<const int64_t*>(a.labels)[row]
                      : int64_t(static_cast<const int32_t*>(a.labels)[row]);
}

// A row's loss from its log-sum-exp, target logit zt and logit sum sz: 0 for an ignored row, NaN for a
// label outside the vocabulary, else the label-smoothed cross-entropy times the row's mask.
__device__ __forceinline__ float row_loss(const CeArgs& a, int64_t label, bool ignored, float smooth, float lse,
                                          float zt, float sz, float mask) {
  if (ignored) return 0.f;
  const float loss = (label < 0 || label >= a.vocab_total)
                         ? NAN
                         : lse - (1.f - smooth) * zt - smooth / float(a.vocab_total) * sz;
  return loss * mask;
}

// V consecutive elements as one access: a packed 16-byte vector on the vector path, else one scalar.
template <class T, int V>
using Pack = Vec<T, V>;

template <class T, int V, bool STREAM>
__device__ __forceinline__ Pack<T, V> load_pack(const T* p) {
  if constexpr (V == kVec16<T>) return STREAM ? load_vec16_stream(p) : load_vec16(p);
  else return *reinterpret_cast<const Pack<T, V>*>(p);
}

template <class T, int V>
__device__ __forceinline__ void unpack(const Pack<T, V>& r, float (&out)[V]) {
  if constexpr (V == kVec16<T>) {
    unpack_f32<T>(r, out);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = to_f32(r.v[k]);
  }
}

// The gradient of V consecutive logits x (in place): scale * (softmax - smoothing / vocab), less
// scale * (1 - smoothing) at the target column (d = target - first column, when in [0, V)). One FFMA,
// one MUFU and one FFMA an element; the target test is one compare a vector (soff = -scale * off).
template <int V>
__device__ __forceinline__ void grad_pack(float (&x)[V], float log2e, float lse2, float scale, float soff, int64_t d,
                                          float hit) {
#pragma unroll
  for (int k = 0; k < V; ++k) x[k] = fmaf(scale, fast_exp2(fmaf(x[k], log2e, -lse2)), soff);
  if (static_cast<uint64_t>(d) < static_cast<uint64_t>(V)) {
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (k == d) x[k] -= hit;
  }
}

// kUnroll loads per thread are issued before any is used: enough bytes in flight per SM. STREAM2: the
// gradient pass reads the logits for the last time, evict-first, leaving L2 to rows still in pass 1.
template <class T, int V, int kUnroll, bool STREAM2>
__global__ void __launch_bounds__(kMaxThreads) ce_kernel(CeArgs a) {
  __shared__ MaxSum red_ms[32];
  __shared__ float red[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int64_t v = a.v;
  const float smooth = a.label_smoothing;
  const bool need_sz = smooth != 0.f || a.mode == CeMode::Stats;
  for (int64_t row = blockIdx.x; row < a.n; row += gridDim.x) {
    const T* z = static_cast<const T*>(a.logits) + row * v;
    const int64_t label = label_at(a, row);
    const bool ignored = label == a.ignore_index;
    const int64_t tl = label - a.vocab_start;  // target column in this shard
    float lse = 0.f;
    float scale = 0.f;  // gradient scale for this row
    if (a.mode != CeMode::Backward) {
      MaxSum ms{-INFINITY, 0.f};
      float sz = 0.f;
      const int64_t stride = int64_t(blockDim.x) * V;
      for (int64_t c0 = int64_t(threadIdx.x) * V; c0 < v; c0 += stride * kUnroll) {
        Pack<T, V> r[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (c0 + u * stride < v) r[u] = load_pack<T, V, false>(z + c0 + u * stride);
        float x[kUnroll][V];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (c0 + u * stride < v) {
            unpack<T, V>(r[u], x[u]);
          } else {
#pragma unroll
            for (int k = 0; k < V; ++k) x[u][k] = -INFINITY;
          }
        }
        float vm = -INFINITY;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int k = 0; k < V; ++k) vm = fmaxf(vm, x[u][k]);
        vm *= kLog2e;
        if (vm > ms.m) {
          ms.s *= fast_exp2(ms.m - vm);
          ms.m = vm;
        }
        // While every logit so far is -inf (masked padding) the terms are 0; exp2(-inf + inf) would be NaN.
        const bool finite_max = ms.m != -INFINITY;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (c0 + u * stride < v) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
              if (finite_max) ms.s += fast_exp2(fmaf(x[u][k], kLog2e, -ms.m));
              sz += x[u][k];
            }
          }
        }
      }
      ms = warp_combine(ms);
      if (need_sz) sz = warp_sum(sz);
      if (lane == 0) {
        red_ms[warp] = ms;
        red[warp] = sz;
      }
      __syncthreads();
      ms = lane < nwarps ? red_ms[lane] : MaxSum{-INFINITY, 0.f};
      sz = lane < nwarps ? red[lane] : 0.f;
      ms = warp_combine(ms);
      if (need_sz) sz = warp_sum(sz);
      // The target logit is read before the barrier: in place (dlogits == logits), pass 2 of other threads
      // overwrites it once they are past the barrier.
      const float zt = (threadIdx.x == 0 && tl >= 0 && tl < v) ? to_f32(z[tl]) : 0.f;
      __syncthreads();  // red_ms / red are reused by the next row; see zt
      if (a.mode == CeMode::Stats) {
        if (threadIdx.x == 0) {
          a.row_max[row] = ms.m * kLn2;
          a.sum_exp[row] = ms.s;
          a.target[row] = ignored ? 0.f : zt;
          a.sum_logits[row] = sz;
        }
        continue;
      }
      lse = (ms.m + log2f(ms.s)) * kLn2;
      const float mask = a.loss_mask ? a.loss_mask[row] : 1.f;
      if (threadIdx.x == 0) {
        a.loss[row] = row_loss(a, label, ignored, smooth, lse, zt, sz, mask);
        if (a.lse_out) a.lse_out[row] = lse;
      }
      if (a.mode == CeMode::Forward) continue;
      scale = ignored ? 0.f : a.grad_scale * mask;
    } else {
      lse = a.lse_in[row];
      scale = ignored ? 0.f : a.dloss[row];
    }
    // pass 2: the gradient
    T* dz = static_cast<T*>(a.dlogits) + row * v;
    const float lse2 = lse * kLog2e;
    const float off = smooth / float(a.vocab_total);
    const int64_t stride = int64_t(blockDim.x) * V;
    const float soff = -scale * off, hit = scale * (1.f - smooth);
    for (int64_t c0 = int64_t(threadIdx.x) * V; c0 < v; c0 += stride * kUnroll) {
      Pack<T, V> r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (c0 + u * stride < v) r[u] = load_pack<T, V, STREAM2>(z + c0 + u * stride);
      float x[kUnroll][V];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = c0 + u * stride;
        if (c < v) {
          unpack<T, V>(r[u], x[u]);
          grad_pack<V>(x[u], kLog2e, lse2, scale, soff, tl - c, hit);
          store_f32_stream<T, V>(dz + c, x[u]);
        }
      }
    }
  }
}

__global__ void rescale_kernel(const float* lm, const float* gm, float* se, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    se[i] = lm[i] == -INFINITY ? 0.f : se[i] * expf(lm[i] - gm[i]);
}

__global__ void loss_from_stats_kernel(const float* gmax, const float* sum_exp, const float* target,
                                       const float* sum_logits, const void* labels, bool i64, const float* mask,
                                       int64_t n, int64_t vocab, float smooth, int64_t ignore, float* loss,
                                       float* lse) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t label = i64 ? static_cast<const int64_t*>(labels)[i] : int64_t(static_cast<const int32_t*>(labels)[i]);
    const float l = gmax[i] + logf(sum_exp[i]);
    float out = 0.f;
    if (label != ignore) {
      out = (label < 0 || label >= vocab) ? NAN
                                          : l - (1.f - smooth) * target[i] - smooth / float(vocab) * sum_logits[i];
      if (mask) out *= mask[i];
    }
    loss[i] = out;
    if (lse) lse[i] = l;
  }
}


// ---- Row on chip (CeTuning::cluster >= 1, Fused mode, vector path) ---------------------------------
// One cluster of C CTAs per row; CTA r holds columns [r * slice, (r + 1) * slice) in shared memory, loaded
// by bulk asynchronous copies (TMA, cp.async.bulk) in kChunks pieces, so each logit is read from device
// memory exactly once and the gradient is computed from shared memory. The CTAs exchange their (max,
// sum-exp, sum, target) partials through distributed shared memory; every CTA combines them in rank
// order, so all of a row's CTAs use bit-identical statistics.
constexpr int kChunks = 4;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// bytes: a multiple of 16; src and dst 16-byte aligned.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

struct RowPart {
  float m, s, sz, zt;  // max (log2 units), sum 2^(x - m), sum of logits, target logit (0 if not here)
};

template <class T>
__global__ void __launch_bounds__(kMaxThreads) ce_row_smem_kernel(CeArgs a, int64_t slice) {
  constexpr int V = kVec16<T>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t bars[kChunks];
  __shared__ MaxSum red_ms[32];
  __shared__ float red[32];
  __shared__ RowPart part;     // this CTA's partial, read by the cluster
  __shared__ float2 row_stat;  // lse2, scale
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const unsigned nc = cluster.num_blocks(), rank = cluster.block_rank();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int64_t row = blockIdx.x / nc;
  const int64_t v = a.v;
  const int64_t c_begin = int64_t(rank) * slice;
  const int64_t c_end = c_begin + slice < v ? c_begin + slice : v;
  const int64_t len = c_end > c_begin ? c_end - c_begin : 0;  // multiple of V
  const T* z = static_cast<const T*>(a.logits) + row * v;
  T* buf = reinterpret_cast<T*>(smem_raw);
  // Chunk k: vectors [k * cv, min((k + 1) * cv, nvec)).
  const int64_t nvec = len / V;
  const int64_t cv = (nvec + kChunks - 1) / kChunks;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) mbar_init(&bars[k], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      const int64_t v0 = k * cv, v1 = (k + 1) * cv < nvec ? (k + 1) * cv : nvec;
      const uint32_t bytes = v1 > v0 ? uint32_t((v1 - v0) * 16) : 0u;
      mbar_expect_tx(&bars[k], bytes);
      if (bytes) bulk_g2s(buf + v0 * V, z + c_begin + v0 * V, bytes, &bars[k]);
    }
  }
  const int64_t label = label_at(a, row);
  const bool ignored = label == a.ignore_index;
  const int64_t tl = label - a.vocab_start;
  const float smooth = a.label_smoothing;
  // Pass 1 over shared memory, chunk by chunk as the copies land: per-thread max, then sum-exp.
  MaxSum ms{-INFINITY, 0.f};
  float sz = 0.f;
  for (int k = 0; k < kChunks; ++k) {
    mbar_wait(&bars[k], 0);
    const int64_t v0 = k * cv, v1 = (k + 1) * cv < nvec ? (k + 1) * cv : nvec;
    float cm = -INFINITY;
    for (int64_t i = v0 + threadIdx.x; i < v1; i += blockDim.x) {
      float x[V];
      unpack_f32<T>(*reinterpret_cast<const Vec16<T>*>(buf + i * V), x);
#pragma unroll
      for (int e = 0; e < V; ++e) cm = fmaxf(cm, x[e]);
    }
    cm *= kLog2e;
    if (cm > ms.m) {
      ms.s *= fast_exp2(ms.m - cm);
      ms.m = cm;
    }
    if (ms.m != -INFINITY) {  // all -inf so far: the terms are 0 (exp2(-inf + inf) would be NaN)
      for (int64_t i = v0 + threadIdx.x; i < v1; i += blockDim.x) {
        float x[V];
        unpack_f32<T>(*reinterpret_cast<const Vec16<T>*>(buf + i * V), x);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          ms.s += fast_exp2(fmaf(x[e], kLog2e, -ms.m));
          sz += x[e];
        }
      }
    } else {
      for (int64_t i = v0 + threadIdx.x; i < v1; i += blockDim.x) {
        float x[V];
        unpack_f32<T>(*reinterpret_cast<const Vec16<T>*>(buf + i * V), x);
#pragma unroll
        for (int e = 0; e < V; ++e) sz += x[e];
      }
    }
  }
  ms = warp_combine(ms);
  sz = warp_sum(sz);
  if (lane == 0) {
    red_ms[warp] = ms;
    red[warp] = sz;
  }
  __syncthreads();
  if (warp == 0) {
    ms = lane < nwarps ? red_ms[lane] : MaxSum{-INFINITY, 0.f};
    sz = lane < nwarps ? red[lane] : 0.f;
    ms = warp_combine(ms);
    sz = warp_sum(sz);
    if (lane == 0) {
      const float zt = (tl >= c_begin && tl < c_end) ? to_f32(buf[tl - c_begin]) : 0.f;
      part = RowPart{ms.m, ms.s, sz, zt};
    }
  }
  // Every CTA's partial is visible to the cluster after this barrier.
  cluster_arrive();
  cluster_wait();
  if (warp == 0) {
    // Lane r fetches rank r's partial (the remote loads overlap); lane 0 combines them in rank order.
    RowPart q{-INFINITY, 0.f, 0.f, 0.f};
    if (unsigned(lane) < nc) q = *cluster.map_shared_rank(&part, unsigned(lane));
    MaxSum t{-INFINITY, 0.f};
    float tsz = 0.f, tzt = 0.f;
    for (unsigned r = 0; r < nc; ++r) {
      const float m = __shfl_sync(0xffffffffu, q.m, int(r)), sm = __shfl_sync(0xffffffffu, q.s, int(r));
      t = combine(t, MaxSum{m, sm});
      tsz += __shfl_sync(0xffffffffu, q.sz, int(r));
      tzt += __shfl_sync(0xffffffffu, q.zt, int(r));
    }
    if (lane == 0) {
      const float lse = (t.m + log2f(t.s)) * kLn2;
      const float mask = a.loss_mask ? a.loss_mask[row] : 1.f;
      if (rank == 0) {
        a.loss[row] = row_loss(a, label, ignored, smooth, lse, tzt, tsz, mask);
        if (a.lse_out) a.lse_out[row] = lse;
      }
      row_stat = make_float2(lse * kLog2e, ignored ? 0.f : a.grad_scale * mask);
    }
  }
  // This CTA is done reading the others' shared memory; it waits for them (below) before it exits.
  cluster_arrive();
  __syncthreads();
  const float lse2 = row_stat.x, scale = row_stat.y;
  const float soff = -scale * (smooth / float(a.vocab_total)), hit = scale * (1.f - smooth);
  T* dz = static_cast<T*>(a.dlogits) + row * v + c_begin;
  constexpr int kU = 4;
  for (int64_t i0 = threadIdx.x; i0 < nvec; i0 += int64_t(blockDim.x) * kU) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int64_t i = i0 + int64_t(u) * blockDim.x;
      if (i < nvec) {
        float x[V];
        unpack_f32<T>(*reinterpret_cast<const Vec16<T>*>(buf + i * V), x);
        grad_pack<V>(x, kLog2e, lse2, scale, soff, tl - (c_begin + i * V), hit);
        store_f32_stream<T, V>(dz + i * V, x);
      }
    }
  }
  cluster_wait();
}

template <class T, int V, bool STREAM2>
void launch_vec(int unroll, dim3 g, dim3 b, cudaStream_t s, const CeArgs& a) {
  if (unroll >= 8) ce_kernel<T, V, 8, STREAM2><<<g, b, 0, s>>>(a);
  else if (unroll >= 4) ce_kernel<T, V, 4, STREAM2><<<g, b, 0, s>>>(a);
  else if (unroll >= 2) ce_kernel<T, V, 2, STREAM2><<<g, b, 0, s>>>(a);
  else ce_kernel<T, V, 1, STREAM2><<<g, b, 0, s>>>(a);
}


// Columns per CTA of the row-on-chip kernel (a multiple of the vector width), or 0 when that kernel does
// not apply: not Fused, not the vector path, a cluster size outside 1..8, or a slice too large for
// shared memory.
template <class T>
int64_t row_smem_slice(const CeArgs& a, int device) {
  constexpr int V = kVec16<T>;
  const int c = a.tuning.cluster;
  if (a.mode != CeMode::Fused || c < 1 || c > 8 || a.v % V != 0 || !aligned16(a.logits) || !aligned16(a.dlogits))
    return 0;
  const int64_t per = (a.v + c - 1) / c;
  const int64_t slice = (per + V - 1) / V * V;
  int optin = 0;
  MC_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  // Static shared memory of the kernel: barriers, reductions and the partials, well under 1 KiB.
  if (slice * int64_t(sizeof(T)) + 1024 > int64_t(optin)) return 0;
  return slice;
}

template <class T>
void launch_row_smem(const CeArgs& a, int64_t slice, int threads, cudaStream_t s) {
  const size_t smem = size_t(slice) * sizeof(T);
  MC_CUDA_CHECK(cudaFuncSetAttribute(ce_row_smem_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(a.n * a.tuning.cluster));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(a.tuning.cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  MC_CUDA_CHECK(cudaLaunchKernelEx(&cfg, ce_row_smem_kernel<T>, a, slice));
}

}  // namespace

CeTuning ce_default_tuning(DType, CeMode, int64_t) {
  // H100 (benchmarks/results/kernels_NVIDIA_H100.json, 2026-11-26), bf16 fused: the two-pass kernel
  // 94.5 % of copy at 8192x32000 and 89.6 % at 8192x128256, against at best 91.0 % (smem_c2_t256) and
  // 89.0 % (smem_c8_t256) for the row-on-chip kernel.
  return CeTuning{};
}

bool ce_row_on_chip(DType dt, const CeArgs& a, int device) {
  bool ok = false;
  dispatch_float(dt, [&](auto tag) { ok = row_smem_slice<decltype(tag)>(a, device) > 0; });
  return ok;
}

void cross_entropy(DType dt, const CeArgs& a, int device, void* stream) {
  if (a.n == 0) return;
  cuda_impl::DeviceGuard guard(device);
  cudaStream_t s = as_stream(stream);
  int l2 = 0;
  MC_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec16<T>;
    const bool vec = a.v % V == 0 && aligned16(a.logits) && (a.dlogits == nullptr || aligned16(a.dlogits));
    const CeTuning& tu = a.tuning;
    const int threads = tu.threads < 32 ? 32 : tu.threads > kMaxThreads ? kMaxThreads : tu.threads / 32 * 32;
    if (const int64_t slice = row_smem_slice<T>(a, device); slice > 0) {
      launch_row_smem<T>(a, slice, threads, s);
      MC_CUDA_CHECK_LAUNCH();
      return;
    }
    // Rows in flight: enough to fill every SM, few enough that their logits stay in part of L2.
    const int64_t row_bytes = a.v * int64_t(sizeof(T));
    const int sms = sm_count(device);
    int64_t grid = int64_t(sms) * (tu.blocks_per_sm < 1 ? 1 : tu.blocks_per_sm);
    // Defaults (H100, bf16 fused, benchmarks/results/kernels_NVIDIA_H100.json, 2026-11-26): 32k-vocabulary
    // rows 0.75 of L2 + unroll 4, 94.5 % of copy (84.6 % at 0.5 of L2); 128k rows 0.5 + unroll 8, 89.6 %
    // (82.3 % with unroll 4, 71.3 % with unroll 4 at 0.75).
    const bool long_rows = row_bytes > (128 << 10);
    const float l2_share = tu.l2_fraction > 0.f ? tu.l2_fraction : long_rows ? 0.5f : 0.75f;
    const int64_t fit = row_bytes > 0 ? int64_t(double(l2) * double(l2_share)) / row_bytes : grid;
    if (a.mode == CeMode::Fused && fit < grid) grid = fit < sms ? sms : fit;
    if (grid > a.n) grid = a.n;
    // unroll 0: by row length. Long rows (Llama-3's 128k vocabulary) leave one block per SM, which
    // needs several loads in flight per thread (H100, 128k bf16: 89.8 % of copy with 8, 70.7 % with 2).
    // Shorter rows run about three 512-thread blocks per SM (L2 limit): 4 loads (64 registers) leave
    // room for two, 2 loads (40 registers) keep three; two blocks with 4 loads each measured faster.
    const int unroll = tu.unroll > 0 ? tu.unroll : long_rows ? 8 : 4;
    const dim3 g = dim3(unsigned(grid)), b = dim3(unsigned(threads));
    if (!vec) ce_kernel<T, 1, 1, false><<<g, b, 0, s>>>(a);
    else if (tu.stream_pass2) launch_vec<T, V, true>(unroll, g, b, s, a);
    else launch_vec<T, V, false>(unroll, g, b, s, a);
    MC_CUDA_CHECK_LAUNCH();
  });
}

void ce_rescale(const float* local_max, const float* global_max, float* sum_exp, int64_t n, int device, void* stream) {
  if (n == 0) return;
  cuda_impl::DeviceGuard guard(device);
  rescale_kernel<<<elementwise_blocks(n, 256, device), 256, 0, as_stream(stream)>>>(local_max, global_max, sum_exp, n);
  MC_CUDA_CHECK_LAUNCH();
}

void ce_loss_from_stats(const float* gmax, const float* sum_exp, const float* target, const float* sum_logits,
                        const void* labels, bool labels_i64, const float* mask, int64_t n, int64_t vocab,
                        float label_smoothing, int64_t ignore_index, float* loss, float* lse, int device,
                        void* stream) {
  if (n == 0) return;
  cuda_impl::DeviceGuard guard(device);
  loss_from_stats_kernel<<<elementwise_blocks(n, 256, device), 256, 0, as_stream(stream)>>>(
      gmax, sum_exp, target, sum_logits, labels, labels_i64, mask, n, vocab, label_smoothing, ignore_index, loss, lse);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace megacore::ops::cuda
