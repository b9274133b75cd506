// Elementwise activation kernels: 16-byte vectors over the bulk, a scalar launch for the tail.
#include "ops/cuda/activation_cuda.hpp"
#include "ops/cuda/memops_common.cuh"

#include <algorithm>

namespace megacore::ops::cuda {
namespace {

using actmath::Act;

// U vectors per thread per round, `stride` (the grid's thread count) apart: all U loads are issued
// before the first is used, so each thread keeps U 16-byte reads in flight.
template <class T, Act ACT, bool BWD, int V, int U>
__global__ void act_kernel(const T* x, const T* dy, T* out, int64_t nvec) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i0 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i0 < nvec; i0 += stride * U) {
    float xv[U][V], g[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + u * stride;
      if (i < nvec) {
        load_f32_stream<T, V>(x + i * V, xv[u]);
        if constexpr (BWD) load_f32_stream<T, V>(dy + i * V, g[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + u * stride;
      if (i >= nvec) break;
      float o[V];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if constexpr (BWD) o[k] = g[u][k] * actmath::derivative<float>(ACT, xv[u][k]);
        else o[k] = actmath::forward<float>(ACT, xv[u][k]);
      }
      store_f32_stream<T, V>(out + i * V, o);
    }
  }
}

// Rows of [gate | up]; blockIdx.y walks rows, x-threads walk vectors of a row.
template <class T, bool BWD, int V>
__global__ void swiglu_kernel(const T* x, const T* dy, T* out, int64_t rows, int64_t f) {
  const int64_t c = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * V;
  if (c >= f) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* xr = x + r * 2 * f;
    float a[V], b[V];
    load_f32_stream<T, V>(xr + c, a);
    load_f32_stream<T, V>(xr + f + c, b);
    if constexpr (BWD) {
      float g[V], da[V], db[V];
      load_f32_stream<T, V>(dy + r * f + c, g);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float sg = actmath::sigmoid(a[k]);
        db[k] = g[k] * a[k] * sg;
        da[k] = g[k] * b[k] * sg * (1.f + a[k] * (1.f - sg));
      }
      store_f32_stream<T, V>(out + r * 2 * f + c, da);
      store_f32_stream<T, V>(out + r * 2 * f + f + c, db);
    } else {
      float o[V];
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] = a[k] * actmath::sigmoid(a[k]) * b[k];
      store_f32_stream<T, V>(out + r * f + c, o);
    }
  }
}

// Blocks for `items` work items of U vectors each: capped at blocks_per_sm per SM (grid-stride rounds
// beyond), or one item per thread when blocks_per_sm is 0.
inline unsigned act_blocks(int64_t nvec, int unroll, int threads, int blocks_per_sm, int device) {
  const int64_t items = (nvec + unroll - 1) / unroll;
  if (blocks_per_sm > 0) return elementwise_blocks(items, threads, device, blocks_per_sm);
  return unsigned(std::max<int64_t>(1, (items + threads - 1) / threads));
}

template <class T, Act ACT, bool BWD>
void act_launch(const T* x, const T* dy, T* out, int64_t n, const ActTuning& tu, int device, cudaStream_t s) {
  constexpr int V = kVec16<T>;
  const int threads = tu.threads;
  int64_t done = 0;
  if (aligned16(x) && aligned16(out) && (!BWD || aligned16(dy))) {
    const int64_t nvec = n / V;
    if (nvec > 0) {
      dispatch_unroll(tu.unroll, [&](auto u_tag) {
        constexpr int U = decltype(u_tag)::value;
        act_kernel<T, ACT, BWD, V, U><<<act_blocks(nvec, U, threads, tu.blocks_per_sm, device), threads, 0, s>>>(
            x, dy, out, nvec);
      });
      MC_CUDA_CHECK_LAUNCH();
    }
    done = nvec * V;
  }
  if (done < n) {
    act_kernel<T, ACT, BWD, 1, 1><<<elementwise_blocks(n - done, 256, device), 256, 0, s>>>(
        x + done, BWD ? dy + done : nullptr, out + done, n - done);
    MC_CUDA_CHECK_LAUNCH();
  }
}

template <class T, bool BWD, int V>
void swiglu_launch_v(const T* x, const T* dy, T* out, int64_t rows, int64_t f, cudaStream_t s) {
  const int64_t nv = (f + V - 1) / V;
  const int threads = nv >= 256 ? 256 : int((nv + 31) / 32 * 32);
  dim3 grid(unsigned((nv + threads - 1) / threads), unsigned(rows < 65535 ? rows : 65535));
  swiglu_kernel<T, BWD, V><<<grid, threads, 0, s>>>(x, dy, out, rows, f);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace

void activation(DType dt, Act act, const void* x, const void* dy, void* out, int64_t n, int device, void* stream,
                const ActTuning& tuning) {
  MC_CHECK(tuning.threads >= 32 && tuning.threads <= 1024 && tuning.threads % 32 == 0 && tuning.blocks_per_sm >= 0,
           "activation: ActTuning threads must be a multiple of 32 in [32, 1024] and blocks_per_sm >= 0 (got {}, {})",
           tuning.threads, tuning.blocks_per_sm);
  if (n == 0) return;
  cuda_impl::DeviceGuard guard(device);
  cudaStream_t s = as_stream(stream);
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x);
    const T* dp = static_cast<const T*>(dy);
    T* op = static_cast<T*>(out);
    auto go = [&](auto act_tag) {
      constexpr Act A = decltype(act_tag)::value;
      if (dy) act_launch<T, A, true>(xp, dp, op, n, tuning, device, s);
      else act_launch<T, A, false>(xp, dp, op, n, tuning, device, s);
    };
    switch (act) {
      case Act::GeluErf: go(std::integral_constant<Act, Act::GeluErf>{}); break;
      case Act::GeluTanh: go(std::integral_constant<Act, Act::GeluTanh>{}); break;
      case Act::Silu: go(std::integral_constant<Act, Act::Silu>{}); break;
    }
  });
}

void swiglu(DType dt, const void* x, const void* dy, void* out, int64_t rows, int64_t f, int device, void* stream) {
  if (rows == 0 || f == 0) return;
  cuda_impl::DeviceGuard guard(device);
  cudaStream_t s = as_stream(stream);
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec16<T>;
    const T* xp = static_cast<const T*>(x);
    const T* dp = static_cast<const T*>(dy);
    T* op = static_cast<T*>(out);
    const bool vec = f % V == 0 && aligned16(x) && aligned16(out) && (!dy || aligned16(dy));
    if (dy) {
      if (vec) swiglu_launch_v<T, true, V>(xp, dp, op, rows, f, s);
      else swiglu_launch_v<T, true, 1>(xp, dp, op, rows, f, s);
    } else {
      if (vec) swiglu_launch_v<T, false, V>(xp, dp, op, rows, f, s);
      else swiglu_launch_v<T, false, 1>(xp, dp, op, rows, f, s);
    }
  });
}

}  // namespace megacore::ops::cuda
