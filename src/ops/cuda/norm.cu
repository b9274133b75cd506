// LayerNorm / RMSNorm kernels.
//
// Fast path: the row held in registers as packed 16-byte vectors, so x is read once and y written
// once. A row gets a group of `tpr` threads (a multiple of 32) holding NV vectors each; short rows
// share a block. Few threads with several vectors each keep many bytes in flight per SM while the
// row's reduction needs few warps (none of the block barriers when a warp holds the whole row).
// Backward runs a persistent grid whose row groups walk rows (NormTuning::bwd_prefetch, off by default:
// loading the next row before reducing the current one); each thread keeps the weight/bias gradient of
// its own columns in its own shared-memory slots (NormTuning::bwd_smem_acc, the default; else in
// registers, one partial row per row group) and the block writes one partial row, which a second kernel
// sums in a fixed order (deterministic, no atomics).
// Rows whose length is not a multiple of 16 bytes, or whose pointers are not 16-byte aligned, take a
// generic kernel that re-reads the row (correct for any size, slower). NormTuning (norm_cuda.hpp)
// holds the launch-shape choices.
#include "ops/cuda/memops_common.cuh"
#include "ops/cuda/norm_cuda.hpp"


#include <algorithm>
#include <initializer_list>
#include <map>
#include <mutex>
#include <utility>
#include <type_traits>

namespace megacore::ops::cuda {
namespace {

// Barrier over the row group `grp` alone (its tpr = 32 * wpr threads): named barrier 1 + grp, so the
// groups of a block do not wait for each other (barrier 0 stays __syncthreads'). A block has at most 15
// groups of two or more warps (plan_for: at most 512 threads, so at most 8).
__device__ __forceinline__ void group_barrier(int grp, int wpr) {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + grp), "r"(32 * wpr) : "memory");
}

// Sum of (a, b) over the thread's row group of `wpr` warps, returned to all of its threads. OWN: the
// group's own barriers (the persistent backward: its groups drift apart); else block-wide ones (every
// thread of the block must call it). The forward keeps the block-wide barriers: with the named ones
// LayerNorm's forward measured 2.5-4 points lower on an H100.
template <bool OWN>
__device__ __forceinline__ float2 group_sum2(float a, float b, int wpr, float2* red) {
  a = warp_sum(a);
  b = warp_sum(b);
  if (wpr == 1) return make_float2(a, b);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = warp / wpr;
  if (lane == 0) red[warp] = make_float2(a, b);
  if constexpr (OWN) group_barrier(grp, wpr);
  else __syncthreads();
  float2 t = lane < wpr ? red[grp * wpr + lane] : make_float2(0.f, 0.f);
  t.x = warp_sum(t.x);
  t.y = warp_sum(t.y);
  if constexpr (OWN) group_barrier(grp, wpr);  // red is the group's again before its next sum
  else __syncthreads();
  return t;
}

__device__ __forceinline__ void add4(float4& a, const float4& b) {
  a.x += b.x;
  a.y += b.y;
  a.z += b.z;
  a.w += b.w;
}

// Thread t of a row group owns vectors k * tpr + t (k < NV) of the row: each k is one coalesced sweep.
template <class T, int NV>
__device__ __forceinline__ void load_row_stream(Vec16<T> (&r)[NV], const T* p, int t, int tpr, int h, bool live) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int c = (k * tpr + t) * kVec16<T>;
    r[k] = live && c < h ? load_vec16_stream(p + c) : zero_vec16<T>();
  }
}

template <class T, int NV>
__device__ __forceinline__ void load_row(Vec16<T> (&r)[NV], const T* p, int t, int tpr, int h) {
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int c = (k * tpr + t) * kVec16<T>;
    r[k] = c < h ? load_vec16(p + c) : zero_vec16<T>();
  }
}

// One row per group of `tpr` threads, blockDim.x / tpr rows per block.
template <class T, int NV, bool LAYER>
__global__ void __launch_bounds__(512) norm_fwd_rows(NormForwardArgs a, int tpr) {
  constexpr int V = kVec16<T>;
  // Weight (and bias) are loaded before the reduction so their latency hides behind it, when the
  // registers allow.
  constexpr bool kEarlyW = NV <= 4;
  __shared__ float2 red[32];
  const int grp = threadIdx.x / tpr, t = threadIdx.x - grp * tpr, wpr = tpr >> 5;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / tpr) + grp;
  const bool live = row < a.rows;  // a dead group still joins the barriers
  const int h = int(a.h);
  const int64_t base = live ? row * h : 0;
  const T* x = static_cast<const T*>(a.x) + base;
  const T* res = a.residual ? static_cast<const T*>(a.residual) + base : nullptr;
  T* res_out = a.residual ? static_cast<T*>(a.residual_out) + base : nullptr;
  // LayerNorm takes mean and variance from one reduction of (x - k) and (x - k)^2, with k the row's
  // first input: a shift near the data keeps E[d^2] - E[d]^2 from cancelling, and one reduction
  // (one pair of barriers) instead of two matters for a kernel that only waits on memory.
  // With a residual the row is the rounded sum x + residual, so the shift is its first element too.
  float k0 = 0.f;
  if (LAYER && live) {
    k0 = to_f32(x[0]);
    if (res) k0 = to_f32(from_f32<T>(k0 + to_f32(res[0])));
  }
  Vec16<T> v[NV];
  load_row_stream<T, NV>(v, x, t, tpr, h, live);
  if (res) {
    Vec16<T> r[NV];
    load_row_stream<T, NV>(r, res, t, tpr, h, live);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = (k * tpr + t) * V;
      if (live && c < h) {
        float xf[V], rf[V];
        unpack_f32<T>(v[k], xf);
        unpack_f32<T>(r[k], rf);
#pragma unroll
        for (int i = 0; i < V; ++i) v[k].v[i] = from_f32<T>(xf[i] + rf[i]);
        // normalise the rounded sum: it is what backward will see
        *reinterpret_cast<Vec16<T>*>(res_out + c) = v[k];
      }
    }
  }
  const T* w = static_cast<const T*>(a.w);
  const T* b = static_cast<const T*>(a.b);
  Vec16<T> wv[kEarlyW ? NV : 1], bv[kEarlyW ? NV : 1];
  if constexpr (kEarlyW) {
    load_row<T, NV>(wv, w, t, tpr, h);
    if (LAYER && b) load_row<T, NV>(bv, b, t, tpr, h);
  }
  float s1 = 0.f, s2 = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if ((k * tpr + t) * V < h) {
      float xf[V];
      unpack_f32<T>(v[k], xf);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float d = xf[i] - k0;
        s1 += d;
        s2 += d * d;
      }
    }
  }
  float mean = 0.f, var;
  const float2 tot = group_sum2<false>(LAYER ? s1 : 0.f, s2, wpr, red);
  if constexpr (LAYER) {
    const float m1 = tot.x / float(h);
    mean = k0 + m1;
    var = fmaxf(tot.y / float(h) - m1 * m1, 0.f);
  } else {
    var = tot.y / float(h);
  }
  const float rstd = rsqrtf(var + a.eps);
  if (!live) return;
  T* y = static_cast<T*>(a.y) + base;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int c = (k * tpr + t) * V;
    if (c < h) {
      float wf[V], o[V], xf[V];
      unpack_f32<T>(v[k], xf);
      if constexpr (kEarlyW) {
        unpack_f32<T>(wv[k], wf);
      } else {
        load_f32<T, V>(w + c, wf);
      }
      if (LAYER && b) {
        float bf[V];
        if constexpr (kEarlyW) {
          unpack_f32<T>(bv[k], bf);
        } else {
          load_f32<T, V>(b + c, bf);
        }
#pragma unroll
        for (int i = 0; i < V; ++i) o[i] = (xf[i] - mean) * rstd * wf[i] + bf[i];
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) o[i] = (xf[i] - mean) * rstd * wf[i];
      }
      store_f32_stream<T, V>(y + c, o);
    }
  }
  if (t == 0) {
    a.rstd[row] = rstd;
    if (LAYER) a.mean[row] = mean;
  }
}

// Any row length and alignment: three passes over the row (the re-reads hit L1/L2).
template <class T, bool LAYER>
__global__ void norm_fwd_generic(NormForwardArgs a) {
  __shared__ float red[32];
  const int64_t row = blockIdx.x, h = a.h;
  const T* x = static_cast<const T*>(a.x) + row * h;
  const T* res = a.residual ? static_cast<const T*>(a.residual) + row * h : nullptr;
  T* res_out = a.residual ? static_cast<T*>(a.residual_out) + row * h : nullptr;
  const T* src = res ? res_out : x;
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    float v = to_f32(x[j]);
    if (res) {
      T hv = from_f32<T>(v + to_f32(res[j]));
      res_out[j] = hv;
      v = to_f32(hv);
    }
    sum += LAYER ? v : v * v;
  }
  float mean = 0.f, var;
  if constexpr (LAYER) {
    mean = block_sum(sum, red) / float(h);
    float sq = 0.f;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      float d = to_f32(src[j]) - mean;
      sq += d * d;
    }
    var = block_sum(sq, red) / float(h);
  } else {
    var = block_sum(sum, red) / float(h);
  }
  const float rstd = rsqrtf(var + a.eps);
  const T* w = static_cast<const T*>(a.w);
  const T* b = static_cast<const T*>(a.b);
  T* y = static_cast<T*>(a.y) + row * h;
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    float o = (to_f32(src[j]) - mean) * rstd * to_f32(w[j]);
    if (LAYER && b) o += to_f32(b[j]);
    y[j] = from_f32<T>(o);
  }
  if (threadIdx.x == 0) {
    a.rstd[row] = rstd;
    if (LAYER) a.mean[row] = mean;
  }
}

// Programmatic dependent launch (sm_90; no-ops elsewhere and when the launch did not ask for it): the
// backward lets the finalize launch while its last rows run, and the finalize waits for the backward's
// completion (and its memory) before reading the partial rows.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Persistent backward: row group g of the grid takes rows g, g + groups, ... Every group runs the same
// number of iterations (dead rows included); a group's barriers are its own (group_barrier), so the
// groups of a block do not wait for each other. With PREFETCH the
// next row's x and dy are loaded before this row's reduction, so loads stay in flight across it.
// Without SMEM_ACC each row group keeps its sums in registers and writes its own partial row.
// With SMEM_ACC (NormTuning::bwd_smem_acc) the weight/bias gradient sums live in dynamic shared memory
// instead of registers (NV * V floats each fewer per thread): every row group has its own region of
// float4 slots, slot (k * V / 4 + i4) * tpr + t belonging to thread t alone (consecutive threads,
// consecutive slots: no bank conflicts, no barriers while rows run). At the end the block adds its groups'
// regions in group order and writes one partial row (row blockIdx.x).
template <class T, int NV, bool LAYER, bool PREFETCH, bool SMEM_ACC>
__global__ void __launch_bounds__(512) norm_bwd_rows(NormBackwardArgs a, int tpr, float* part_w, float* part_b) {
  constexpr int V = kVec16<T>;
  __shared__ float2 red[32];
  const int h = int(a.h);
  const int grp = threadIdx.x / tpr, t = threadIdx.x - grp * tpr, wpr = tpr >> 5;
  const int64_t group = int64_t(blockIdx.x) * (blockDim.x / tpr) + grp;
  const int64_t groups = int64_t(gridDim.x) * (blockDim.x / tpr);
  const int64_t iters = (a.rows + groups - 1) / groups;
  const T* xb = static_cast<const T*>(a.x);
  const T* dyb = static_cast<const T*>(a.dy);
  const T* dresb = static_cast<const T*>(a.dresidual);
  Vec16<T> wv[NV];
  load_row<T, NV>(wv, static_cast<const T*>(a.w), t, tpr, h);
  constexpr int R = SMEM_ACC ? 1 : NV;  // register accumulators (unused with SMEM_ACC)
  float dw[R][V], db[LAYER ? R : 1][V];
#pragma unroll
  for (int k = 0; k < R; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) {
      dw[k][i] = 0.f;
      if constexpr (LAYER) db[k][i] = 0.f;
    }
  // SMEM_ACC: regions of nslots float4 each, dw of groups 0..G-1 then (bias gradient asked) db of each.
  extern __shared__ float4 acc_smem[];
  const int ngroups = blockDim.x / tpr, nslots = NV * (V / 4) * tpr;
  const bool acc_b = LAYER && part_b != nullptr;
  float4* acc_w = acc_smem + grp * nslots + t;
  float4* acc_bias = acc_smem + (ngroups + grp) * nslots + t;
  if constexpr (SMEM_ACC) {
#pragma unroll
    for (int j = 0; j < NV * (V / 4); ++j) {
      acc_w[j * tpr] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (acc_b) acc_bias[j * tpr] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  Vec16<T> xv[NV], dyv[NV];
  float mean = 0.f, rstd = 0.f;
  auto fetch = [&](int64_t row, Vec16<T>(&xr)[NV], Vec16<T>(&dr)[NV], float& m, float& r) {
    const bool live = row < a.rows;
    const int64_t base = live ? row * h : 0;
    load_row_stream<T, NV>(xr, xb + base, t, tpr, h, live);
    load_row_stream<T, NV>(dr, dyb + base, t, tpr, h, live);
    m = LAYER && live ? a.mean[row] : 0.f;
    r = live ? a.rstd[row] : 0.f;
  };
  if constexpr (PREFETCH) fetch(group, xv, dyv, mean, rstd);
  int64_t row = group;
  for (int64_t it = 0; it < iters; ++it, row += groups) {
    const bool live = row < a.rows;
    Vec16<T> xn[PREFETCH ? NV : 1], dyn[PREFETCH ? NV : 1];
    float mean_n = 0.f, rstd_n = 0.f;
    if constexpr (PREFETCH) {
      if (it + 1 < iters) fetch(row + groups, xn, dyn, mean_n, rstd_n);
    } else {
      fetch(row, xv, dyv, mean, rstd);
    }
    Vec16<T> dr[NV];
    if (dresb) load_row_stream<T, NV>(dr, dresb + (live ? row * h : 0), t, tpr, h, live);
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if ((k * tpr + t) * V < h) {
        float xf[V], df[V], wf[V];
        unpack_f32<T>(xv[k], xf);
        unpack_f32<T>(dyv[k], df);
        unpack_f32<T>(wv[k], wf);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float xh = (xf[i] - mean) * rstd, g = df[i] * wf[i];
          s1 += g;
          s2 += g * xh;
        }
      }
    }
    const float2 s = group_sum2<true>(LAYER ? s1 : 0.f, s2, wpr, red);
    const float m1 = LAYER ? s.x / float(h) : 0.f, m2 = s.y / float(h);
    if (live) {
      T* dx = static_cast<T*>(a.dx) + row * h;
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int c = (k * tpr + t) * V;
        if (c < h) {
          float o[V], xf[V], df[V], wf[V], rf[V];
          unpack_f32<T>(xv[k], xf);
          unpack_f32<T>(dyv[k], df);
          unpack_f32<T>(wv[k], wf);
          if (dresb) unpack_f32<T>(dr[k], rf);
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const float xh = (xf[i] - mean) * rstd, d = df[i];
            o[i] = rstd * (d * wf[i] - m1 - xh * m2);
            if (dresb) o[i] += rf[i];
            if constexpr (SMEM_ACC) {
              xf[i] = d * xh;  // this element's dw term, added to the slot below
            } else {
              dw[k][i] += d * xh;
              if constexpr (LAYER) db[k][i] += d;
            }
          }
          if constexpr (SMEM_ACC) {
#pragma unroll
            for (int i4 = 0; i4 < V / 4; ++i4) {
              float4* q = acc_w + (k * (V / 4) + i4) * tpr;
              float4 u = *q;
              u.x += xf[4 * i4];
              u.y += xf[4 * i4 + 1];
              u.z += xf[4 * i4 + 2];
              u.w += xf[4 * i4 + 3];
              *q = u;
              if (acc_b) {
                q = acc_bias + (k * (V / 4) + i4) * tpr;
                u = *q;
                u.x += df[4 * i4];
                u.y += df[4 * i4 + 1];
                u.z += df[4 * i4 + 2];
                u.w += df[4 * i4 + 3];
                *q = u;
              }
            }
          }
          store_f32_stream<T, V>(dx + c, o);
        }
      }
    }
    if constexpr (PREFETCH) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        xv[k] = xn[k];
        dyv[k] = dyn[k];
      }
      mean = mean_n;
      rstd = rstd_n;
    }
  }
  pdl_launch_dependents();  // the finalize may start launching (it waits for this grid's partial rows)
  if constexpr (SMEM_ACC) {
    __syncthreads();
    for (int pass = 0; pass < (acc_b ? 2 : 1); ++pass) {
      const float4* reg = acc_smem + (pass == 0 ? 0 : ngroups * nslots);
      float* out = (pass == 0 ? part_w : part_b) + int64_t(blockIdx.x) * h;
      for (int sl = threadIdx.x; sl < nslots; sl += blockDim.x) {
        // slot -> the thread and vector it belongs to -> its 4 columns
        const int k = sl / ((V / 4) * tpr), rem = sl - k * (V / 4) * tpr;
        const int i4 = rem / tpr, tt = rem - i4 * tpr;
        const int c = (k * tpr + tt) * V + 4 * i4;
        if ((k * tpr + tt) * V < h) {
          float4 v = reg[sl];
          for (int g = 1; g < ngroups; ++g) add4(v, reg[g * nslots + sl]);  // group order
          *reinterpret_cast<float4*>(out + c) = v;
        }
      }
    }
    return;
  }
  // One partial row per group (16-byte aligned: h is a multiple of 4 and the scratch is aligned).
  float* pw = part_w + group * h;
  float* pb = part_b ? part_b + group * h : nullptr;
#pragma unroll
  for (int k = 0; k < R; ++k) {  // R == NV here
    const int c = (k * tpr + t) * V;
    if (c < h) {
#pragma unroll
      for (int i = 0; i < V; i += 4) {
        *reinterpret_cast<float4*>(pw + c + i) = make_float4(dw[k][i], dw[k][i + 1], dw[k][i + 2], dw[k][i + 3]);
        if constexpr (LAYER)
          if (pb) *reinterpret_cast<float4*>(pb + c + i) = make_float4(db[k][i], db[k][i + 1], db[k][i + 2], db[k][i + 3]);
      }
    }
  }
}

template <class T, bool LAYER>
__global__ void norm_bwd_generic(NormBackwardArgs a, float* part_w, float* part_b) {
  __shared__ float2 red[32];
  const int64_t h = a.h;
  const T* w = static_cast<const T*>(a.w);
  float* pw = part_w + int64_t(blockIdx.x) * h;
  float* pb = part_b ? part_b + int64_t(blockIdx.x) * h : nullptr;
  // Each thread owns the same columns in every row, so its partial sums need no synchronisation.
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    pw[j] = 0.f;
    if (pb) pb[j] = 0.f;
  }
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(a.x) + row * h;
    const T* dy = static_cast<const T*>(a.dy) + row * h;
    const float mean = LAYER ? a.mean[row] : 0.f;
    const float rstd = a.rstd[row];
    float s1 = 0.f, s2 = 0.f;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      float xh = (to_f32(x[j]) - mean) * rstd, g = to_f32(dy[j]) * to_f32(w[j]);
      s1 += g;
      s2 += g * xh;
    }
    const float2 s = block_sum2(s1, s2, red);
    const float m1 = LAYER ? s.x / float(h) : 0.f, m2 = s.y / float(h);
    T* dx = static_cast<T*>(a.dx) + row * h;
    const T* dres = a.dresidual ? static_cast<const T*>(a.dresidual) + row * h : nullptr;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
      const float xh = (to_f32(x[j]) - mean) * rstd, dyv = to_f32(dy[j]), g = dyv * to_f32(w[j]);
      float o = rstd * (g - m1 - xh * m2);
      if (dres) o += to_f32(dres[j]);
      dx[j] = from_f32<T>(o);
      pw[j] += dyv * xh;
      if (pb) pb[j] += dyv;
    }
  }
}

// out[c] (+)= sum over parts p of part[p * h + c], summed in a fixed order.
template <class W>
__global__ void column_sum_finalize(const float* part, int nparts, int64_t h, W* out, bool accumulate) {
  __shared__ float tile[16][33];
  const int64_t c = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float acc = 0.f;
  if (c < h)
    for (int p = threadIdx.y; p < nparts; p += 16) acc += part[int64_t(p) * h + c];
  tile[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < h) {
    float t = 0.f;
#pragma unroll
    for (int y = 0; y < 16; ++y) t += tile[y][threadIdx.x];
    if (accumulate) t += to_f32(out[c]);
    out[c] = from_f32<W>(t);
  }
}

template <class W>
__device__ __forceinline__ void finalize_store4(W* out, int64_t c, float4 t, bool accumulate) {
  const float v[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) out[c + j] = from_f32<W>(accumulate ? v[j] + to_f32(out[c + j]) : v[j]);
}

// NormTuning::bwd_finalize = 1: blockIdx.y 0 sums part_w into dw, 1 sums part_b into db (one launch).
// An 8 x 32 block covers 32 columns: thread (x, y) sums columns 4x..4x+3 over parts y, y + 32, ... in
// that order (8 16-byte loads issued before their adds), then row y = 0 adds the 32 slices in order.
// h is a multiple of 4 and the part rows are 16-byte aligned.
template <class W, class B>
__global__ void __launch_bounds__(256) column_sum_finalize4(const float* part_w, const float* part_b, int nparts,
                                                            int64_t h, W* dw, B* db, bool accumulate) {
  __shared__ float4 tile[32][8];
  pdl_wait();
  const bool bias = blockIdx.y == 1;
  const float* part = bias ? part_b : part_w;
  const int64_t c = (int64_t(blockIdx.x) * 8 + threadIdx.x) * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (c < h) {
    const float* q = part + c;
    // Full rounds of U parts, then one round for the rest: past the last part a load re-reads the last
    // part row and adds zero, so all U loads of a round go out before its first add (the loop this
    // replaced issued the rest one load at a time).
    constexpr int U = 8;
    int p = threadIdx.y;
    for (; p + (U - 1) * 32 < nparts; p += U * 32) {
      float4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = __ldcs(reinterpret_cast<const float4*>(q + int64_t(p + u * 32) * h));
#pragma unroll
      for (int u = 0; u < U; ++u) add4(acc, v[u]);
    }
    if (p < nparts) {
      float4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int pu = p + u * 32 < nparts ? p + u * 32 : nparts - 1;
        v[u] = __ldcs(reinterpret_cast<const float4*>(q + int64_t(pu) * h));
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const bool in = p + u * 32 < nparts;  // a select, not a branch
        add4(acc, make_float4(in ? v[u].x : 0.f, in ? v[u].y : 0.f, in ? v[u].z : 0.f, in ? v[u].w : 0.f));
      }
    }
  }
  tile[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < h) {
    float4 t = tile[0][threadIdx.x];
#pragma unroll
    for (int y = 1; y < 32; ++y) add4(t, tile[y][threadIdx.x]);
    if (bias) finalize_store4(db, c, t, accumulate);
    else finalize_store4(dw, c, t, accumulate);
  }
}

// How a row is split: vec = false means the generic kernel with `threads` threads per block.
struct Plan {
  bool vec = false;
  int nv = 1;        // 16-byte vectors per thread
  int tpr = 32;      // threads per row (a multiple of 32)
  int threads = 256; // per block
};

Plan generic_plan(int64_t h) {
  Plan p;
  p.vec = false;
  p.threads = h >= 512 ? 512 : int((h + 31) / 32 * 32);
  if (p.threads < 32) p.threads = 32;
  return p;
}

// Row in registers: at most 512 threads per row, `want` vectors per thread, raised (up to `max_nv`)
// when the row needs more threads, lowered when fewer vectors cover the same threads.
template <class T>
Plan plan_for(int64_t h, int want, int max_nv, int min_block, std::initializer_list<const void*> ptrs) {
  constexpr int V = kVec16<T>;
  bool ok = h % V == 0 && h <= (int64_t(1) << 30);
  for (const void* q : ptrs) ok = ok && (q == nullptr || aligned16(q));
  if (ok) {
    const int64_t nvec = h / V;
    int nv = 1;
    while (nv < want && nv < max_nv) nv *= 2;
    auto tpr_for = [&](int n) { return ((nvec + n - 1) / n + 31) / 32 * 32; };
    while (tpr_for(nv) > 512 && nv < max_nv) nv *= 2;
    if (tpr_for(nv) <= 512) {
      const int tpr = int(tpr_for(nv));
      while (nv > 1 && int64_t(nv / 2) * tpr >= nvec) nv /= 2;
      int rows = min_block > tpr ? min_block / tpr : 1;
      if (rows * tpr > 512) rows = 512 / tpr;
      return Plan{true, nv, tpr, rows * tpr};
    }
  }
  return generic_plan(h);
}

// Largest vectors per thread each kernel is built for (more spill registers, sm_90 ptxas): forward
// keeps one packed row copy; backward keeps x and dy, two gradient accumulators and, prefetching, a
// second x and dy.
constexpr int kFwdMaxNv = 8;
constexpr int kBwdMaxNv = 4;
constexpr int kBwdPrefetchMaxNv = 2;

template <class T, bool LAYER>
void forward_t(const NormForwardArgs& a, cudaStream_t s) {
  const NormTuning& tu = a.tuning;
  const Plan p = plan_for<T>(a.h, tu.fwd_vecs, kFwdMaxNv, tu.min_block,
                             {a.x, a.residual, a.w, a.b, a.y, a.residual_out});
  if (!p.vec) {
    norm_fwd_generic<T, LAYER><<<unsigned(a.rows), p.threads, 0, s>>>(a);
    MC_CUDA_CHECK_LAUNCH();
    return;
  }
  const int64_t rows_per_block = p.threads / p.tpr;
  const unsigned grid = unsigned((a.rows + rows_per_block - 1) / rows_per_block);
  switch (p.nv) {
    case 1: norm_fwd_rows<T, 1, LAYER><<<grid, p.threads, 0, s>>>(a, p.tpr); break;
    case 2: norm_fwd_rows<T, 2, LAYER><<<grid, p.threads, 0, s>>>(a, p.tpr); break;
    case 4: norm_fwd_rows<T, 4, LAYER><<<grid, p.threads, 0, s>>>(a, p.tpr); break;
    default: norm_fwd_rows<T, 8, LAYER><<<grid, p.threads, 0, s>>>(a, p.tpr); break;
  }
  MC_CUDA_CHECK_LAUNCH();
}

template <class T, int NV, bool LAYER>
const void* bwd_rows_fn(bool prefetch, bool smem_acc) {
  if (smem_acc)
    return prefetch ? reinterpret_cast<const void*>(&norm_bwd_rows<T, NV, LAYER, true, true>)
                    : reinterpret_cast<const void*>(&norm_bwd_rows<T, NV, LAYER, false, true>);
  return prefetch ? reinterpret_cast<const void*>(&norm_bwd_rows<T, NV, LAYER, true, false>)
                  : reinterpret_cast<const void*>(&norm_bwd_rows<T, NV, LAYER, false, false>);
}

// The backward kernel to run, its plan and its persistent grid (row groups resident at once, capped by
// NormTuning::bwd_threads_per_sm, at most one per row).
struct BwdLaunch {
  const void* fn = nullptr;
  Plan plan;
  int grid = 0;
  int parts = 0;      // partial gradient rows the kernel writes
  size_t smem = 0;    // dynamic shared memory (the shared-memory gradient sums)
};

template <class T, bool LAYER>
BwdLaunch backward_kernel(const NormBackwardArgs& a, int device) {
  const NormTuning& tu = a.tuning;
  const std::initializer_list<const void*> ptrs{a.x, a.dy, a.dresidual, a.w, a.dx};
  // Rows too long for a prefetching thread's registers run without prefetch.
  // bwd_vecs 0: 4 vectors, except LayerNorm's register sums take 2 (its 4-vector register kernel spills).
  // bwd_min_block 0: 512 threads a block with the shared-memory sums (row groups that do not wait for
  // each other, one partial row per block); with the register sums (one partial row per row group)
  // LayerNorm at least 256, RMSNorm min_block.
  const bool own_block = tu.bwd_min_block > 0;
  auto make_plan = [&](int vecs, int min_block, bool& prefetch) {
    prefetch = tu.bwd_prefetch;
    Plan p = plan_for<T>(a.h, vecs, prefetch ? kBwdPrefetchMaxNv : kBwdMaxNv, min_block, ptrs);
    if (!p.vec && prefetch) {
      prefetch = false;
      p = plan_for<T>(a.h, vecs, kBwdMaxNv, min_block, ptrs);
    }
    // RMSNorm has no bias; should a bias gradient be asked for anyway, the generic kernel computes it.
    if (!LAYER && a.db) p = generic_plan(a.h);
    return p;
  };
  bool prefetch = false;
  Plan p = make_plan(tu.bwd_vecs > 0 ? tu.bwd_vecs : 4, own_block ? tu.bwd_min_block : tu.bwd_smem_acc ? 512 : 0,
                     prefetch);
  BwdLaunch L;
  // Shared-memory gradient sums: every thread's NV vectors of floats, for dw and (asked for) db; when
  // they do not fit in a block's shared memory the register sums run instead.
  bool smem_acc = false;
  if (tu.bwd_smem_acc && p.vec) {
    const size_t bytes = size_t(p.threads) * p.nv * kVec16<T> * sizeof(float) * (LAYER && a.db ? 2 : 1);
    int optin = 0;
    MC_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    // the kernel's static shared memory (the reduction's 256 bytes) comes out of the same budget
    if (bytes + 1024 <= size_t(optin)) {
      smem_acc = true;
      L.smem = bytes;
    }
  }
  if (!smem_acc) {
    const int reg_block = own_block ? tu.bwd_min_block : LAYER ? std::max(tu.min_block, 256) : tu.min_block;
    p = make_plan(tu.bwd_vecs > 0 ? tu.bwd_vecs : LAYER ? 2 : 4, reg_block, prefetch);
  }
  const int64_t rows_per_block = p.vec ? p.threads / p.tpr : 1;
  const void* f = reinterpret_cast<const void*>(&norm_bwd_generic<T, LAYER>);
  if (p.vec) {
    if (p.nv == 1) f = bwd_rows_fn<T, 1, LAYER>(prefetch, smem_acc);
    else if (p.nv == 2) f = bwd_rows_fn<T, 2, LAYER>(prefetch, smem_acc);
    else f = smem_acc ? reinterpret_cast<const void*>(&norm_bwd_rows<T, 4, LAYER, false, true>)
                      : reinterpret_cast<const void*>(&norm_bwd_rows<T, 4, LAYER, false, false>);
  }
  int per_sm = resident_blocks(f, p.threads, L.smem, device);
  if (p.vec && tu.bwd_threads_per_sm > 0 && per_sm * p.threads > tu.bwd_threads_per_sm)
    per_sm = tu.bwd_threads_per_sm / p.threads;
  int64_t g = int64_t(sm_count(device)) * (per_sm < 1 ? 1 : per_sm);
  const int64_t need = (a.rows + rows_per_block - 1) / rows_per_block;
  if (g > need) g = need;
  if (g < 1) g = 1;
  L.fn = f;
  L.plan = p;
  L.grid = int(g);
  L.parts = int(smem_acc ? g : g * rows_per_block);
  return L;
}

template <class T>
BwdLaunch backward_kernel_any(const NormBackwardArgs& a, int device) {
  return a.layer ? backward_kernel<T, true>(a, device) : backward_kernel<T, false>(a, device);
}

// Whether `fn` (the finalize) was compiled for sm_90 or newer, so that it holds its griddepcontrol.wait:
// only then may it be launched as a programmatic dependent of the backward (remembered per kernel).
inline bool pdl_ok(const void* fn, int device) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, bool> known;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = known.find({fn, device}); it != known.end()) return it->second;
  int major = 0;
  MC_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cudaFuncAttributes fa{};
  MC_CUDA_CHECK(cudaFuncGetAttributes(&fa, fn));
  const bool ok = major >= 9 && fa.ptxVersion >= 90;
  known.emplace(std::pair{fn, device}, ok);
  return ok;
}

template <class W>
void finalize_t(const float* part, int nparts, int64_t h, void* out, bool accumulate, cudaStream_t s) {
  dim3 block(32, 16);
  column_sum_finalize<W><<<unsigned((h + 31) / 32), block, 0, s>>>(part, nparts, h, static_cast<W*>(out), accumulate);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace

void norm_forward(DType dt, const NormForwardArgs& a, int device, void* stream) {
  if (a.rows == 0) return;
  cuda_impl::DeviceGuard guard(device);
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    if (a.layer) forward_t<T, true>(a, as_stream(stream));
    else forward_t<T, false>(a, as_stream(stream));
  });
}

size_t norm_backward_workspace_bytes(const NormBackwardArgs& a, DType dt, int device) {
  if (a.rows == 0) return 0;
  cuda_impl::DeviceGuard guard(device);
  int parts = 0;
  dispatch_float(dt, [&](auto tag) { parts = backward_kernel_any<decltype(tag)>(a, device).parts; });
  return size_t(parts) * size_t(a.h) * sizeof(float) * (a.db ? 2 : 1);
}

void norm_backward(DType dt, const NormBackwardArgs& a, void* workspace, int device, void* stream) {
  cudaStream_t s = as_stream(stream);
  cuda_impl::DeviceGuard guard(device);
  if (a.rows == 0) {
    // No rows: the gradients of weight and bias are zero (or unchanged when accumulating).
    if (!a.accumulate) {
      MC_CUDA_CHECK(cudaMemsetAsync(a.dw, 0, size_t(a.h) * size_t(dtype_size(a.dw_dtype)), s));
      if (a.db) MC_CUDA_CHECK(cudaMemsetAsync(a.db, 0, size_t(a.h) * size_t(dtype_size(a.db_dtype)), s));
    }
    return;
  }
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    const BwdLaunch L = backward_kernel_any<T>(a, device);
    const int parts = L.parts;
    float* part_w = static_cast<float*>(workspace);
    float* part_b = a.db ? part_w + int64_t(parts) * a.h : nullptr;
    NormBackwardArgs args = a;
    int tpr = L.plan.tpr;
    void* generic_params[] = {&args, &part_w, &part_b};
    void* rows_params[] = {&args, &tpr, &part_w, &part_b};
    MC_CUDA_CHECK(cudaLaunchKernel(L.fn, dim3(unsigned(L.grid)), dim3(unsigned(L.plan.threads)),
                                   L.plan.vec ? rows_params : generic_params, L.smem, s));
    // The 16-byte finalize needs rows of whole float4s (and so 16-byte aligned part rows).
    if (a.tuning.bwd_finalize >= 1 && a.h % 4 == 0 && aligned16(workspace)) {
      dispatch_float(a.dw_dtype, [&](auto wtag) {
        using W = decltype(wtag);
        // Without a bias gradient the second type is unused; give it dw's to halve the instantiations.
        auto launch = [&](auto* db) {
          using B = std::remove_pointer_t<decltype(db)>;
          auto kernel = column_sum_finalize4<W, B>;
          cudaLaunchConfig_t cfg{};
          cfg.gridDim = dim3(unsigned((a.h + 31) / 32), a.db ? 2u : 1u);
          cfg.blockDim = dim3(8, 32);
          cfg.stream = s;
          cudaLaunchAttribute attr{};
          attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
          attr.val.programmaticStreamSerializationAllowed = 1;
          if (a.tuning.bwd_pdl && pdl_ok(reinterpret_cast<const void*>(kernel), device)) cfg.attrs = &attr, cfg.numAttrs = 1;
          W* dw = static_cast<W*>(a.dw);
          MC_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<const float*>(part_w),
                                           static_cast<const float*>(part_b), parts, int64_t(a.h), dw, db,
                                           bool(a.accumulate)));
        };
        if (!a.db) launch(static_cast<W*>(nullptr));
        else dispatch_float(a.db_dtype, [&](auto btag) { launch(static_cast<decltype(btag)*>(a.db)); });
      });
      return;
    }
    dispatch_float(a.dw_dtype, [&](auto wtag) { finalize_t<decltype(wtag)>(part_w, parts, a.h, a.dw, a.accumulate, s); });
    if (a.db)
      dispatch_float(a.db_dtype, [&](auto btag) { finalize_t<decltype(btag)>(part_b, parts, a.h, a.db, a.accumulate, s); });
  });
}

}  // namespace megacore::ops::cuda
