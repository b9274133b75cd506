// LayerNorm / RMSNorm kernels.
//
// Fast path: one block per row, the row held in registers (NV 16-byte vectors per thread), so x is
// read once and y written once. Backward runs a persistent grid whose blocks walk rows; each thread
// keeps the weight/bias gradient of its own columns in registers and writes one partial row per
// block, which a second kernel sums in a fixed order (deterministic, no atomics).
// Rows whose length is not a multiple of 16 bytes, or whose pointers are not 16-byte aligned, take a
// generic kernel that re-reads the row (correct for any size, slower).
#include "ops/cuda/memops_common.cuh"
#include "ops/cuda/norm_cuda.hpp"

#include <initializer_list>

namespace megacore::ops::cuda {
namespace {

template <class T, int V, int NV, bool LAYER>
__global__ void __launch_bounds__(512) norm_fwd_vec(NormForwardArgs a) {
  __shared__ float2 red[32];
  const int64_t row = blockIdx.x;
  const int h = int(a.h);
  const T* x = static_cast<const T*>(a.x) + row * h;
  const T* res = a.residual ? static_cast<const T*>(a.residual) + row * h : nullptr;
  T* res_out = a.residual ? static_cast<T*>(a.residual_out) + row * h : nullptr;
  // LayerNorm takes mean and variance from one reduction of (x - k) and (x - k)^2, with k the row's
  // first input: a shift near the data keeps E[d^2] - E[d]^2 from cancelling, and one reduction
  // (one pair of barriers) instead of two matters for a kernel that only waits on memory.
  const float k0 = LAYER ? to_f32(x[0]) : 0.f;
  float v[NV][V];
  float s1 = 0.f, s2 = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int c = (k * blockDim.x + threadIdx.x) * V;
    if (c < h) {
      load_f32_stream<T, V>(x + c, v[k]);
      if (res) {
        float r[V];
        load_f32_stream<T, V>(res + c, r);
        Vec<T, V> hv;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          hv.v[i] = from_f32<T>(v[k][i] + r[i]);
          v[k][i] = to_f32(hv.v[i]);  // normalise the rounded sum: it is what backward will see
        }
        *reinterpret_cast<Vec<T, V>*>(res_out + c) = hv;
      }
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float d = v[k][i] - k0;
        s1 += d;
        s2 += d * d;
      }
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) v[k][i] = 0.f;
    }
  }
  float mean = 0.f, var;
  if constexpr (LAYER) {
    const float2 t = block_sum2(s1, s2, red);
    const float m1 = t.x / float(h);
    mean = k0 + m1;
    var = fmaxf(t.y / float(h) - m1 * m1, 0.f);
  } else {
    var = block_sum(s2, reinterpret_cast<float*>(red)) / float(h);
  }
  const float rstd = rsqrtf(var + a.eps);
  const T* w = static_cast<const T*>(a.w);
  const T* b = static_cast<const T*>(a.b);
  T* y = static_cast<T*>(a.y) + row * h;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int c = (k * blockDim.x + threadIdx.x) * V;
    if (c < h) {
      float wv[V], o[V];
      load_f32<T, V>(w + c, wv);
      if (LAYER && b) {
        float bv[V];
        load_f32<T, V>(b + c, bv);
#pragma unroll
        for (int i = 0; i < V; ++i) o[i] = (v[k][i] - mean) * rstd * wv[i] + bv[i];
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) o[i] = (v[k][i] - mean) * rstd * wv[i];
      }
      store_f32_stream<T, V>(y + c, o);
    }
  }
  if (threadIdx.x == 0) {
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

template <class T, int V, int NV, bool LAYER>
__global__ void __launch_bounds__(512) norm_bwd_vec(NormBackwardArgs a, float* part_w, float* part_b) {
  __shared__ float2 red[32];
  const int h = int(a.h);
  const T* w = static_cast<const T*>(a.w);
  float dw[NV][V], db[NV][V];
#pragma unroll
  for (int k = 0; k < NV; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) dw[k][i] = db[k][i] = 0.f;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* x = static_cast<const T*>(a.x) + row * h;
    const T* dy = static_cast<const T*>(a.dy) + row * h;
    const float mean = LAYER ? a.mean[row] : 0.f;
    const float rstd = a.rstd[row];
    float xh[NV][V], g[NV][V], dyv[NV][V];
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = (k * blockDim.x + threadIdx.x) * V;
      if (c < h) {
        float xv[V], wv[V];
        load_f32_stream<T, V>(x + c, xv);
        load_f32_stream<T, V>(dy + c, dyv[k]);
        load_f32<T, V>(w + c, wv);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          xh[k][i] = (xv[i] - mean) * rstd;
          g[k][i] = dyv[k][i] * wv[i];
          s1 += g[k][i];
          s2 += g[k][i] * xh[k][i];
        }
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) xh[k][i] = g[k][i] = dyv[k][i] = 0.f;
      }
    }
    const float2 s = block_sum2(s1, s2, red);
    const float m1 = LAYER ? s.x / float(h) : 0.f, m2 = s.y / float(h);
    T* dx = static_cast<T*>(a.dx) + row * h;
    const T* dres = a.dresidual ? static_cast<const T*>(a.dresidual) + row * h : nullptr;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = (k * blockDim.x + threadIdx.x) * V;
      if (c < h) {
        float o[V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          o[i] = rstd * (g[k][i] - m1 - xh[k][i] * m2);
          dw[k][i] += dyv[k][i] * xh[k][i];
          db[k][i] += dyv[k][i];
        }
        if (dres) {
          float r[V];
          load_f32_stream<T, V>(dres + c, r);
#pragma unroll
          for (int i = 0; i < V; ++i) o[i] += r[i];
        }
        store_f32_stream<T, V>(dx + c, o);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int c = (k * blockDim.x + threadIdx.x) * V;
    if (c < h) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        part_w[int64_t(blockIdx.x) * h + c + i] = dw[k][i];
        if (part_b) part_b[int64_t(blockIdx.x) * h + c + i] = db[k][i];
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

struct Plan {
  bool vec = false;
  int nv = 1, threads = 256;
};

// Vector path: the row in registers, at most 512 threads and `max_elems` elements per thread (the
// register budget: forward keeps one row copy, backward three plus the gradient accumulators).
template <class T>
Plan plan_for(int64_t h, int max_elems, std::initializer_list<const void*> ptrs) {
  constexpr int V = kVec16<T>;
  bool ok = h % V == 0 && h <= (int64_t(1) << 30);
  for (const void* q : ptrs) ok = ok && (q == nullptr || aligned16(q));
  if (ok) {
    const int64_t nvec = h / V;
    for (int nv : {1, 2, 4}) {
      if (nv * V > max_elems) break;
      int64_t t = ((nvec + nv - 1) / nv + 31) / 32 * 32;
      if (t <= 512) return Plan{true, nv, int(t)};
    }
  }
  Plan p;
  p.vec = false;
  p.nv = 0;
  p.threads = h >= 512 ? 512 : int((h + 31) / 32 * 32);
  if (p.threads < 32) p.threads = 32;
  return p;
}

template <class T, int NV, bool LAYER>
void launch_fwd_vec(const NormForwardArgs& a, int threads, cudaStream_t s) {
  norm_fwd_vec<T, kVec16<T>, NV, LAYER><<<unsigned(a.rows), threads, 0, s>>>(a);
}

template <class T, bool LAYER>
void forward_t(const NormForwardArgs& a, cudaStream_t s) {
  Plan p = plan_for<T>(a.h, 32, {a.x, a.residual, a.w, a.b, a.y, a.residual_out});
  if (!p.vec) {
    norm_fwd_generic<T, LAYER><<<unsigned(a.rows), p.threads, 0, s>>>(a);
  } else if (p.nv == 1) {
    launch_fwd_vec<T, 1, LAYER>(a, p.threads, s);
  } else if (p.nv == 2) {
    launch_fwd_vec<T, 2, LAYER>(a, p.threads, s);
  } else {
    launch_fwd_vec<T, 4, LAYER>(a, p.threads, s);
  }
  MC_CUDA_CHECK_LAUNCH();
}

// The backward kernel to run and its persistent grid (blocks resident at once, at most one per row).
template <class T, bool LAYER>
void backward_kernel(const NormBackwardArgs& a, int device, const void** fn, Plan* plan, int* grid) {
  Plan p = plan_for<T>(a.h, 16, {a.x, a.dy, a.dresidual, a.w, a.dx});
  const void* f;
  if (!p.vec) f = reinterpret_cast<const void*>(&norm_bwd_generic<T, LAYER>);
  else if (p.nv == 1) f = reinterpret_cast<const void*>(&norm_bwd_vec<T, kVec16<T>, 1, LAYER>);
  else if constexpr (kVec16<T> * 4 <= 16) {  // only f32 rows are split 4 ways (see plan_for)
    if (p.nv == 2) f = reinterpret_cast<const void*>(&norm_bwd_vec<T, kVec16<T>, 2, LAYER>);
    else f = reinterpret_cast<const void*>(&norm_bwd_vec<T, kVec16<T>, 4, LAYER>);
  } else {
    f = reinterpret_cast<const void*>(&norm_bwd_vec<T, kVec16<T>, 2, LAYER>);
  }
  int per_sm = 0;
  MC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, f, p.threads, 0));
  int64_t g = int64_t(sm_count(device)) * (per_sm < 1 ? 1 : per_sm);
  if (g > a.rows) g = a.rows;
  if (g < 1) g = 1;
  *fn = f;
  *plan = p;
  *grid = int(g);
}

template <class T>
void backward_kernel_any(const NormBackwardArgs& a, int device, const void** fn, Plan* plan, int* grid) {
  if (a.layer) backward_kernel<T, true>(a, device, fn, plan, grid);
  else backward_kernel<T, false>(a, device, fn, plan, grid);
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
  const void* fn = nullptr;
  Plan p;
  int grid = 0;
  dispatch_float(dt, [&](auto tag) { backward_kernel_any<decltype(tag)>(a, device, &fn, &p, &grid); });
  return size_t(grid) * size_t(a.h) * sizeof(float) * (a.db ? 2 : 1);
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
    const void* fn = nullptr;
    Plan p;
    int grid = 0;
    backward_kernel_any<T>(a, device, &fn, &p, &grid);
    float* part_w = static_cast<float*>(workspace);
    float* part_b = a.db ? part_w + int64_t(grid) * a.h : nullptr;
    NormBackwardArgs args = a;
    void* params[] = {&args, &part_w, &part_b};
    MC_CUDA_CHECK(cudaLaunchKernel(fn, dim3(unsigned(grid)), dim3(unsigned(p.threads)), params, 0, s));
    dispatch_float(a.dw_dtype, [&](auto wtag) { finalize_t<decltype(wtag)>(part_w, grid, a.h, a.dw, a.accumulate, s); });
    if (a.db)
      dispatch_float(a.db_dtype, [&](auto btag) { finalize_t<decltype(btag)>(part_b, grid, a.h, a.db, a.accumulate, s); });
  });
}

}  // namespace megacore::ops::cuda
