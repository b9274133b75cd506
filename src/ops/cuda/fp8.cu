// CUDA kernels of the FP8 casts and scale update (ops/fp8.hpp). The cast is a grid-stride loop; each
// block reduces its amax (as f32 bits, so an integer max orders NaN above every number) and its
// saturation / flush counts, then one thread per block folds them into the global results with atomics.
// The element math is fp8_math's, the same code as the CPU path, so the two give the same bits.
//
// The cast-transpose, when rows and columns are multiples of 8 (every FP8 GEMM operand), gives each thread an
// 8 × 8 block held in registers: eight 8-element row reads issued together, each row's codes one 8-byte store
// to `out`, each column's eight codes (packed in registers, no shared memory) one 8-byte store to `out_t`.
// A warp's lanes cover 8 row groups × 4 column groups, so a row read touches 64 contiguous bytes per row
// and a column store 64 contiguous bytes of out_t. Other shapes take a 32 × 32-tile kernel through shared
// memory with one element per thread and access. The plain cast likewise moves
// 8 elements per access when it can.
//
// The scale update runs one block per history column: the amax over the history is a block reduction of
// (|h| bits, first index) pairs — the sequential loop's answer — and the roll shifts the column a block-width
// chunk at a time from its end, each chunk read before any of it is written.
#include <algorithm>

#include "ops/cuda/fp8_cuda.hpp"
#include "ops/cuda/memops_common.cuh"
#include "ops/fp8_math.hpp"

namespace megacore::ops::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ unsigned long long warp_sum(unsigned long long v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide reduction of (amax bits, overflow, underflow) into the global results (thread 0).
__device__ void fold_block(uint32_t m, unsigned long long over, unsigned long long under, float* amax,
                           int64_t* counts) {
  __shared__ uint32_t sm[kThreads / 32];
  __shared__ unsigned long long so[kThreads / 32], su[kThreads / 32];
  m = warp_max(m);
  over = warp_sum(over);
  under = warp_sum(under);
  const int t = threadIdx.y * blockDim.x + threadIdx.x;  // 1-D (casts) or 32 × 8 (cast-transpose) blocks
  const int w = t / 32, lane = t & 31;
  if (lane == 0) sm[w] = m, so[w] = over, su[w] = under;
  __syncthreads();
  if (t == 0) {
    for (int i = 1; i < kThreads / 32; ++i) m = max(m, sm[i]), over += so[i], under += su[i];
    if (amax) atomicMax(reinterpret_cast<unsigned int*>(amax), m);  // amax >= 0: its bits order like |x|
    if (counts) {
      atomicAdd(reinterpret_cast<unsigned long long*>(counts), over);
      atomicAdd(reinterpret_cast<unsigned long long*>(counts + 1), under);
    }
  }
}

// One thread's share of a cast: each element's code (fp8_math::quantize's codes, saturation and flush-to-zero
// rules, in fewer instructions: the counts are 32-bit and compare bit patterns) and the running amax bits and
// counts, folded into the global results once per block.
template <class Q>
struct CastStats {
  uint32_t m = 0, over = 0, under = 0;
  __device__ __forceinline__ uint8_t operator()(float v, float sc) {
    m = max(m, fp8_math::abs_bits(v));
    const float y = v * sc;
    const uint32_t ay = fp8_math::abs_bits(y);
    if (ay > 0x7f800000u) return 0x7f;  // NaN: one code on every device, not counted
    const uint8_t q = fp8_math::encode<Q>(y);
    over += ay > Q::kMaxF32Bits;  // |y| above the largest finite value, inf included
    under += (ay != 0u) & ((q & 0x7fu) == 0u);
    return q;
  }
  __device__ void fold(float* amax, int64_t* counts) const {
    if (amax || counts) fold_block(m, over, under, amax, counts);
  }
};

template <class T, class Q>
__global__ void cast_kernel(const T* __restrict__ x, int64_t n, const float* __restrict__ scale,
                            uint8_t* __restrict__ out, float* amax, int64_t* counts) {
  const float sc = *scale;
  CastStats<Q> st;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = to_f32(x[i]);
    out[i] = st(v, sc);
  }
  st.fold(amax, counts);
}

template <class T, class Q>
__global__ void cast_vec_kernel(const T* __restrict__ x, int64_t n8, const float* __restrict__ scale,
                                uint8_t* __restrict__ out, float* amax, int64_t* counts) {
  const float sc = *scale;
  CastStats<Q> st;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n8; i += int64_t(gridDim.x) * blockDim.x) {
    float v[8];
    load_f32<T, 8>(x + i * 8, v);
    Vec<uint8_t, 8> q;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      q.v[j] = st(v[j], sc);
    }
    reinterpret_cast<Vec<uint8_t, 8>*>(out)[i] = q;
  }
  st.fold(amax, counts);
}

// Rows and cols multiples of 8 (see the header comment): a thread owns an 8 × 8 block, a warp 64 rows × 32
// columns (lanes: 8 row groups × 4 column groups), a block of 8 warps 128 × 128.
constexpr int kRB = 8, kWarpRows = 8 * kRB, kWarpCols = 4 * kRB, kCtTileR = 2 * kWarpRows, kCtTileC = 4 * kWarpCols;
template <class T, class Q>
__global__ void __launch_bounds__(kThreads) cast_transpose_vec_kernel(const T* __restrict__ x, int64_t rows,
                                                                      int64_t cols, const float* __restrict__ scale,
                                                                      uint8_t* __restrict__ out,
                                                                      uint8_t* __restrict__ out_t, float* amax,
                                                                      int64_t* counts) {
  const float sc = *scale;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int br = (warp / 4) * kWarpRows + (lane / 4) * kRB, bc = (warp % 4) * kWarpCols + (lane % 4) * kRB;
  const int64_t tiles_c = (cols + kCtTileC - 1) / kCtTileC, tiles = ((rows + kCtTileR - 1) / kCtTileR) * tiles_c;
  CastStats<Q> st;
  for (int64_t tl = blockIdx.x; tl < tiles; tl += gridDim.x) {
    const int64_t r = (tl / tiles_c) * kCtTileR + br, c = (tl % tiles_c) * kCtTileC + bc;
    if (r >= rows || c >= cols) continue;  // multiples of 8: the thread's 8 × 8 block is whole or absent
    float v[kRB][8];
#pragma unroll
    for (int i = 0; i < kRB; ++i) load_f32<T, 8>(x + (r + i) * cols + c, v[i]);
    uint32_t lo[8] = {}, hi[8] = {};  // column j's codes of rows 0..3 and 4..7, one byte each
#pragma unroll
    for (int i = 0; i < kRB; ++i) {
      Vec<uint8_t, 8> q;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        q.v[j] = st(v[i][j], sc);
        (i < 4 ? lo[j] : hi[j]) |= uint32_t(q.v[j]) << (8 * (i % 4));
      }
      if (out) *reinterpret_cast<Vec<uint8_t, 8>*>(out + (r + i) * cols + c) = q;
    }
    // Column j of the block is 8 consecutive bytes of out_t's row c + j; a warp's 8 row groups make 64.
#pragma unroll
    for (int j = 0; j < 8; ++j) *reinterpret_cast<uint2*>(out_t + (c + j) * rows + r) = make_uint2(lo[j], hi[j]);
  }
  st.fold(amax, counts);
}

constexpr int kTile = 32, kTileRows = kThreads / kTile;

template <class T, class Q>
__global__ void cast_transpose_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                      const float* __restrict__ scale, uint8_t* __restrict__ out,
                                      uint8_t* __restrict__ out_t, float* amax, int64_t* counts) {
  __shared__ uint8_t tile[kTile][kTile + 4];  // padded: a column read hits different banks
  const float sc = *scale;
  const int64_t tiles_c = (cols + kTile - 1) / kTile, tiles = ((rows + kTile - 1) / kTile) * tiles_c;
  CastStats<Q> st;
  for (int64_t tl = blockIdx.x; tl < tiles; tl += gridDim.x) {
    const int64_t r0 = (tl / tiles_c) * kTile, c0 = (tl % tiles_c) * kTile;
    for (int i = threadIdx.y; i < kTile; i += kTileRows) {
      const int64_t r = r0 + i, c = c0 + threadIdx.x;
      if (r < rows && c < cols) {
        const float v = to_f32(x[r * cols + c]);
        const uint8_t q = st(v, sc);
        if (out) out[r * cols + c] = q;
        tile[i][threadIdx.x] = q;
      }
    }
    __syncthreads();
    for (int j = threadIdx.y; j < kTile; j += kTileRows) {
      const int64_t c = c0 + j, r = r0 + threadIdx.x;
      if (c < cols && r < rows) out_t[c * rows + r] = tile[threadIdx.x][j];
    }
    __syncthreads();  // the tile is rewritten by the next iteration
  }
  st.fold(amax, counts);
}

template <class T>
__global__ void amax_kernel(const T* __restrict__ x, int64_t n, float* amax) {
  uint32_t m = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    m = max(m, fp8_math::abs_bits(to_f32(x[i])));
  fold_block(m, 0, 0, amax, nullptr);
}

template <class Q, class T>
__global__ void dequant_kernel(const uint8_t* __restrict__ q, int64_t n, const float* __restrict__ scale_inv,
                               T* __restrict__ out) {
  const float si = *scale_inv;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = from_f32<T>(Q::to_float(q[i]) * si);
}

// One block per column j (see the header comment); the result equals fp8_math::update_column's.
__global__ void update_kernel(float* history, int64_t len, int64_t n, float* scale, float* scale_inv,
                              const float* fp8_max, bool amax_max, int margin, bool roll) {
  const int64_t j = blockIdx.x;
  float* h = history + j;
  __shared__ uint32_t sb[kThreads / 32];
  __shared__ int64_t si[kThreads / 32];
  __shared__ float amax_s;
  const int t = threadIdx.x, w = t / 32, lane = t & 31;
  uint32_t best = 0;
  int64_t at = -1;  // the first index holding the largest |h| bits
  for (int64_t l = t; l < (amax_max ? len : 1); l += blockDim.x) {
    const uint32_t b = fp8_math::abs_bits(h[l * n]);
    if (at < 0 || b > best) best = b, at = l;
  }
  for (int o = 16; o > 0; o >>= 1) {
    const uint32_t b2 = __shfl_xor_sync(0xffffffffu, best, o);
    const int64_t a2 = __shfl_xor_sync(0xffffffffu, at, o);
    if (a2 >= 0 && (at < 0 || b2 > best || (b2 == best && a2 < at))) best = b2, at = a2;
  }
  if (lane == 0) sb[w] = best, si[w] = at;
  __syncthreads();
  if (t == 0) {
    for (int i = 1; i < kThreads / 32; ++i)
      if (si[i] >= 0 && (at < 0 || sb[i] > best || (sb[i] == best && si[i] < at))) best = sb[i], at = si[i];
    amax_s = h[at * n];
  }
  __syncthreads();
  if (t == 0) {
    float tmp = amax_s;  // update_column on a one-row copy: the same scale math, no second pass
    fp8_math::update_column(&tmp, 1, 1, scale + j, scale_inv + j, fp8_max[j], false, margin, false);
  }
  if (!roll) return;
  for (int64_t base = len - 1; base >= 1; base -= blockDim.x) {
    const int64_t l = base - t;
    const float v = l >= 1 ? h[(l - 1) * n] : 0.f;
    __syncthreads();
    if (l >= 1) h[l * n] = v;
  }
  if (t == 0) h[0] = 0.f;
}

__global__ void seed_kernel(const float* amax, int64_t n, float* seeded, float* scale, float* scale_inv,
                            const float* fp8_max, int margin) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j < n) fp8_math::seed_column(amax[j], seeded + j, scale + j, scale_inv + j, fp8_max[j], margin);
}

template <class F>
void dispatch_fp8(DType dt, F&& f) {
  if (dt == DType::F8E4M3) f(float8_e4m3{});
  else f(float8_e5m2{});
}

}  // namespace

void fp8_cast(DType in_dt, const void* x, int64_t n, const float* scale, DType out_dt, void* out, float* amax,
              int64_t* counts, int device, void* stream) {
  if (n == 0) return;
  cuda_impl::DeviceGuard guard(device);
  dispatch_float(in_dt, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = n % 8 == 0 && reinterpret_cast<uintptr_t>(x) % (8 * sizeof(T)) == 0 &&
                     reinterpret_cast<uintptr_t>(out) % 8 == 0;
    const unsigned blocks = elementwise_blocks(vec ? n / 8 : n, kThreads, device, 8);
    dispatch_fp8(out_dt, [&](auto qtag) {
      using Q = decltype(qtag);
      if (vec) {
        cast_vec_kernel<T, Q><<<blocks, kThreads, 0, as_stream(stream)>>>(static_cast<const T*>(x), n / 8, scale,
                                                                         static_cast<uint8_t*>(out), amax, counts);
        MC_CUDA_CHECK_LAUNCH();
        return;
      }
      cast_kernel<T, Q><<<blocks, kThreads, 0, as_stream(stream)>>>(static_cast<const T*>(x), n, scale,
                                                                   static_cast<uint8_t*>(out), amax, counts);
      MC_CUDA_CHECK_LAUNCH();
    });
  });
}

void fp8_cast_transpose(DType in_dt, const void* x, int64_t rows, int64_t cols, const float* scale, DType out_dt,
                        void* out, void* out_t, float* amax, int64_t* counts, int device, void* stream) {
  if (rows == 0 || cols == 0) return;
  cuda_impl::DeviceGuard guard(device);
  dispatch_float(in_dt, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = rows % 8 == 0 && cols % 8 == 0 && reinterpret_cast<uintptr_t>(x) % (8 * sizeof(T)) == 0 &&
                     reinterpret_cast<uintptr_t>(out) % 8 == 0 && reinterpret_cast<uintptr_t>(out_t) % 8 == 0;
    const int tr = vec ? kCtTileR : kTile, tc = vec ? kCtTileC : kTile;
    const int64_t tiles = ((rows + tr - 1) / tr) * ((cols + tc - 1) / tc);
    const unsigned blocks = unsigned(std::min<int64_t>(tiles, int64_t(sm_count(device)) * 8));
    dispatch_fp8(out_dt, [&](auto qtag) {
      using Q = decltype(qtag);
      if (vec) {
        cast_transpose_vec_kernel<T, Q><<<blocks, kThreads, 0, as_stream(stream)>>>(
            static_cast<const T*>(x), rows, cols, scale, static_cast<uint8_t*>(out), static_cast<uint8_t*>(out_t),
            amax, counts);
        MC_CUDA_CHECK_LAUNCH();
        return;
      }
      cast_transpose_kernel<T, Q><<<blocks, dim3(kTile, kTileRows), 0, as_stream(stream)>>>(
          static_cast<const T*>(x), rows, cols, scale, static_cast<uint8_t*>(out), static_cast<uint8_t*>(out_t), amax,
          counts);
      MC_CUDA_CHECK_LAUNCH();
    });
  });
}

void fp8_amax(DType in_dt, const void* x, int64_t n, float* amax, int device, void* stream) {
  if (n == 0) return;
  cuda_impl::DeviceGuard guard(device);
  const unsigned blocks = elementwise_blocks(n, kThreads, device, 8);
  dispatch_float(in_dt, [&](auto tag) {
    using T = decltype(tag);
    amax_kernel<T><<<blocks, kThreads, 0, as_stream(stream)>>>(static_cast<const T*>(x), n, amax);
    MC_CUDA_CHECK_LAUNCH();
  });
}

void fp8_dequant(DType q_dt, const void* q, int64_t n, const float* scale_inv, DType out_dt, void* out, int device,
                 void* stream) {
  if (n == 0) return;
  cuda_impl::DeviceGuard guard(device);
  const unsigned blocks = elementwise_blocks(n, kThreads, device);
  dispatch_float(out_dt, [&](auto tag) {
    using T = decltype(tag);
    dispatch_fp8(q_dt, [&](auto qtag) {
      using Q = decltype(qtag);
      dequant_kernel<Q, T><<<blocks, kThreads, 0, as_stream(stream)>>>(static_cast<const uint8_t*>(q), n, scale_inv,
                                                                      static_cast<T*>(out));
      MC_CUDA_CHECK_LAUNCH();
    });
  });
}

void fp8_update_scales(float* history, int64_t len, int64_t n, float* scale, float* scale_inv, const float* fp8_max,
                       bool amax_max, int margin, bool roll, int device, void* stream) {
  if (n == 0) return;
  cuda_impl::DeviceGuard guard(device);
  update_kernel<<<unsigned(n), kThreads, 0, as_stream(stream)>>>(history, len, n, scale, scale_inv, fp8_max, amax_max,
                                                                margin, roll);
  MC_CUDA_CHECK_LAUNCH();
}

void fp8_seed_scales(const float* amax, int64_t n, float* seeded, float* scale, float* scale_inv, const float* fp8_max,
                     int margin, int device, void* stream) {
  if (n == 0) return;
  cuda_impl::DeviceGuard guard(device);
  seed_kernel<<<unsigned((n + 127) / 128), 128, 0, as_stream(stream)>>>(amax, n, seeded, scale, scale_inv, fp8_max,
                                                                       margin);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace megacore::ops::cuda
