// Elementwise kernels behind Tensor: fill, Philox random draws, strided copy with conversion.
// All of them walk the logical (row-major) index, so a value depends only on its index, not on the
// layout in memory or the launch configuration.
//
// Copies and fills first collapse the layout (size-1 dims dropped, neighbouring dims merged where both
// tensors are contiguous across them), then take the cheapest path that is exact for it:
//   - one contiguous range of the same dtype: cudaMemcpyAsync (fill of zero bits: cudaMemsetAsync);
//   - the same dtype with a contiguous innermost dim (e.g. q/k/v narrowed out of a fused QKV row): rows of
//     16/8/4/2/1-byte vectors (the widest that divides the row, every outer stride and both addresses),
//     with 32-bit index arithmetic when the sizes allow it;
//   - otherwise the per-element strided walk, in 32-bit index arithmetic when the sizes allow it (64-bit
//     division is a long instruction sequence on the GPU and dominated the strided copy).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "core/cuda/cuda_check.hpp"
#include "core/cuda_backend.hpp"
#include "megacore/core/random.hpp"

namespace megacore::cuda_impl {
namespace {

template <class Idx = int64_t>
__device__ __forceinline__ int64_t strided_offset(Idx i, const StridedDesc& d) {
  int64_t off = 0;
  for (int k = d.ndim - 1; k >= 0; --k) {
    const Idx n = Idx(d.shape[k]);
    const Idx q = i / n;
    off += int64_t(i - q * n) * d.stride[k];
    i = q;
  }
  return off;
}

// Both descs with the same shape, after drop of size-1 dims and merging of dims contiguous in both.
struct Collapsed {
  StridedDesc a, b;
};
Collapsed collapse(const StridedDesc& a, const StridedDesc& b) {
  Collapsed c;
  int n = 0;
  for (int k = 0; k < a.ndim; ++k) {
    if (a.shape[k] == 1) continue;
    if (n > 0 && c.a.stride[n - 1] == a.stride[k] * a.shape[k] && c.b.stride[n - 1] == b.stride[k] * b.shape[k]) {
      c.a.shape[n - 1] *= a.shape[k], c.b.shape[n - 1] *= a.shape[k];
      c.a.stride[n - 1] = a.stride[k], c.b.stride[n - 1] = b.stride[k];
      continue;
    }
    c.a.shape[n] = c.b.shape[n] = a.shape[k];
    c.a.stride[n] = a.stride[k], c.b.stride[n] = b.stride[k];
    ++n;
  }
  if (n == 0) c.a.shape[0] = c.b.shape[0] = 1, c.a.stride[0] = c.b.stride[0] = 1, n = 1;
  c.a.ndim = c.b.ndim = n;
  c.a.numel = c.b.numel = a.numel;
  return c;
}

constexpr int64_t kIdx32Limit = int64_t(1) << 31;

// The largest offset (in magnitude, strides may be negative) the walk over d can reach.
int64_t max_offset(const StridedDesc& d) {
  int64_t off = 0;
  for (int k = 0; k < d.ndim; ++k) off += (d.shape[k] - 1) * (d.stride[k] < 0 ? -d.stride[k] : d.stride[k]);
  return off;
}

// True when the element count and every offset the walk can produce fit 32-bit index arithmetic.
bool fits_u32(const StridedDesc& d) { return d.numel < kIdx32Limit && max_offset(d) + 1 < kIdx32Limit; }

template <class D, class S> __device__ __forceinline__ D convert(S v) {
  if constexpr (is_narrow_float_v<S>) {
    return convert<D, float>(float(v));
  } else if constexpr (is_narrow_float_v<D>) {
    return D(float(v));
  } else {
    return static_cast<D>(v);
  }
}

template <class T>
__global__ void fill_kernel(T* data, StridedDesc d, T value) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < d.numel; i += int64_t(gridDim.x) * blockDim.x)
    data[strided_offset(i, d)] = value;
}

template <class T>
__global__ void random_kernel(T* data, StridedDesc d, RandomKind kind, uint64_t seed, uint64_t offset, double a,
                              double b) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < d.numel; i += int64_t(gridDim.x) * blockDim.x) {
    float r = kind == RandomKind::Uniform ? philox_uniform(seed, offset, uint64_t(i)) : philox_normal(seed, offset, uint64_t(i));
    // The affine map is done in f32 on both host and device so both round identically.
    float v = kind == RandomKind::Uniform ? float(a) + (float(b) - float(a)) * r : float(a) + float(b) * r;
    data[strided_offset(i, d)] = convert<T, float>(v);
  }
}

template <class T>
__global__ void fill_contiguous_kernel(T* data, int64_t n, T value) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    data[i] = value;
}

template <class D, class S, class Idx>
__global__ void copy_kernel(D* dst, StridedDesc dd, const S* src, StridedDesc sd) {
  for (Idx i = blockIdx.x * Idx(blockDim.x) + threadIdx.x; i < Idx(dd.numel); i += Idx(gridDim.x) * blockDim.x)
    dst[strided_offset<Idx>(i, dd)] = convert<D, S>(src[strided_offset<Idx>(i, sd)]);
}

// Rows of vectors V: the innermost dim (contiguous in both) holds `per_row` vectors; dd/sd describe the outer
// dims with strides in units of V.
template <class V, class Idx>
__global__ void copy_rows_kernel(V* dst, StridedDesc dd, const V* src, StridedDesc sd, Idx per_row, Idx total) {
  for (Idx i = blockIdx.x * Idx(blockDim.x) + threadIdx.x; i < total; i += Idx(gridDim.x) * blockDim.x) {
    const Idx row = i / per_row, c = i - row * per_row;
    dst[strided_offset<Idx>(row, dd) + c] = src[strided_offset<Idx>(row, sd) + c];
  }
}

unsigned grid_for(int64_t n) {
  int64_t blocks = (n + 255) / 256;
  return unsigned(blocks < 65535 * 8 ? (blocks < 1 ? 1 : blocks) : 65535 * 8);
}

template <class F>
void dispatch(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: f(float{}); break;
    case DType::BF16: f(bfloat16{}); break;
    case DType::F16: f(float16{}); break;
    case DType::I32: f(int32_t{}); break;
    case DType::I64: f(int64_t{}); break;
    case DType::U8: f(uint8_t{}); break;
    case DType::F8E4M3: f(float8_e4m3{}); break;
    case DType::F8E5M2: f(float8_e5m2{}); break;
  }
}

}  // namespace

void fill(void* data, DType dt, const StridedDesc& d, double value, void* stream, int device) {
  if (d.numel == 0) return;
  DeviceGuard g(device);
  const StridedDesc c = collapse(d, d).a;
  const bool contiguous = c.ndim == 1 && c.stride[0] == 1;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    T v;
    if constexpr (is_narrow_float_v<T>) v = T(float(value));
    else v = static_cast<T>(value);
    const T zero{};
    if (contiguous && std::memcmp(&v, &zero, sizeof(T)) == 0) {
      MC_CUDA_CHECK(cudaMemsetAsync(data, 0, size_t(d.numel) * sizeof(T), st));
      return;
    }
    if (contiguous) fill_contiguous_kernel<T><<<grid_for(d.numel), 256, 0, st>>>(static_cast<T*>(data), d.numel, v);
    else fill_kernel<T><<<grid_for(d.numel), 256, 0, st>>>(static_cast<T*>(data), d, v);
  });
  MC_CUDA_CHECK_LAUNCH();
}

void random(void* data, DType dt, const StridedDesc& d, RandomKind kind, uint64_t seed, uint64_t offset, double a,
            double b, void* stream, int device) {
  if (d.numel == 0) return;
  DeviceGuard g(device);
  dispatch(dt, [&](auto tag) {
    using T = decltype(tag);
    random_kernel<T><<<grid_for(d.numel), 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<T*>(data), d, kind,
                                                                                        seed, offset, a, b);
  });
  MC_CUDA_CHECK_LAUNCH();
}

namespace {
// Same dtype, innermost dim contiguous in both: rows of the widest vector that divides the row bytes, every
// outer stride's bytes and both addresses. False when the layout does not allow it.
bool copy_rows(void* dst, const StridedDesc& dd, const void* src, const StridedDesc& sd, int64_t esize,
               cudaStream_t st) {
  const int n = dd.ndim;
  if (dd.stride[n - 1] != 1 || sd.stride[n - 1] != 1) return false;
  const int64_t row_bytes = dd.shape[n - 1] * esize;
  auto gcd_ok = [&](int64_t vb) {
    if (row_bytes % vb || reinterpret_cast<uintptr_t>(dst) % vb || reinterpret_cast<uintptr_t>(src) % vb) return false;
    for (int k = 0; k + 1 < n; ++k)
      if ((dd.stride[k] * esize) % vb || (sd.stride[k] * esize) % vb) return false;
    return true;
  };
  int64_t vb = 16;
  while (vb > 1 && !gcd_ok(vb)) vb /= 2;
  StridedDesc od = dd, os = sd;  // the outer dims, strides in vectors
  od.ndim = os.ndim = n - 1;
  for (int k = 0; k + 1 < n; ++k) od.stride[k] = dd.stride[k] * esize / vb, os.stride[k] = sd.stride[k] * esize / vb;
  od.numel = os.numel = dd.numel / dd.shape[n - 1];
  const int64_t per_row = row_bytes / vb, total = od.numel * per_row;
  // 32-bit index arithmetic when the vector count and the largest vector offset either side reaches (its
  // outer dims' largest offset plus the last vector of a row) fit.
  const bool idx32 =
      total < kIdx32Limit && max_offset(od) + per_row < kIdx32Limit && max_offset(os) + per_row < kIdx32Limit;
  auto launch = [&](auto vtag) {
    using V = decltype(vtag);
    if (idx32)
      copy_rows_kernel<V, uint32_t><<<grid_for(total), 256, 0, st>>>(static_cast<V*>(dst), od, static_cast<const V*>(src),
                                                                     os, uint32_t(per_row), uint32_t(total));
    else
      copy_rows_kernel<V, int64_t><<<grid_for(total), 256, 0, st>>>(static_cast<V*>(dst), od, static_cast<const V*>(src),
                                                                    os, per_row, total);
  };
  switch (vb) {
    case 16: launch(uint4{}); break;
    case 8: launch(uint2{}); break;
    case 4: launch(uint32_t{}); break;
    case 2: launch(uint16_t{}); break;
    default: launch(uint8_t{}); break;
  }
  return true;
}
}  // namespace

void copy(void* dst, DType dst_dt, const StridedDesc& dd, const void* src, DType src_dt, const StridedDesc& sd,
          void* stream, int device) {
  if (dd.numel == 0) return;
  DeviceGuard g(device);
  const Collapsed c = collapse(dd, sd);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (dst_dt == src_dt) {
    const int64_t esize = dtype_size(dst_dt);
    if (c.a.ndim == 1 && c.a.stride[0] == 1 && c.b.stride[0] == 1) {
      MC_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(dd.numel * esize), cudaMemcpyDeviceToDevice, st));
      return;
    }
    if (copy_rows(dst, c.a, src, c.b, esize, st)) {
      MC_CUDA_CHECK_LAUNCH();
      return;
    }
  }
  const bool small = fits_u32(c.a) && fits_u32(c.b);
  dispatch(dst_dt, [&](auto dtag) {
    using D = decltype(dtag);
    dispatch(src_dt, [&](auto stag) {
      using S = decltype(stag);
      if (small)
        copy_kernel<D, S, uint32_t><<<grid_for(dd.numel), 256, 0, st>>>(static_cast<D*>(dst), c.a,
                                                                          static_cast<const S*>(src), c.b);
      else
        copy_kernel<D, S, int64_t><<<grid_for(dd.numel), 256, 0, st>>>(static_cast<D*>(dst), c.a,
                                                                         static_cast<const S*>(src), c.b);
    });
  });
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace megacore::cuda_impl
