// Embedding kernels. Forward copies rows with 16-byte accesses. Backward sorts (id, token) pairs with a
// stable radix sort, then the first block of each run of equal ids sums that run's gradient rows in
// token order and owns the output row: no atomics, so the result does not depend on scheduling.
#include <cub/device/device_radix_sort.cuh>

#include "ops/cuda/embedding_cuda.hpp"
#include "ops/cuda/memops_common.cuh"

namespace megacore::ops::cuda {
namespace {

__device__ __forceinline__ int64_t id_at(const void* ids, bool i64, int64_t i) {
  return i64 ? static_cast<const int64_t*>(ids)[i] : int64_t(static_cast<const int32_t*>(ids)[i]);
}

template <class T, int V>
__global__ void embed_fwd(const T* w, const void* ids, bool i64, T* out, int64_t n, int64_t v, int64_t h,
                          int64_t vocab_start) {
  const int64_t c = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * V;
  if (c >= h) return;
  for (int64_t r = blockIdx.y; r < n; r += gridDim.y) {
    const int64_t id = id_at(ids, i64, r) - (vocab_start < 0 ? 0 : vocab_start);
    Vec<T, V> val;
    if (id >= 0 && id < v) {
      val = *reinterpret_cast<const Vec<T, V>*>(w + id * h + c);
    } else {
      const float fill = vocab_start < 0 ? NAN : 0.f;
#pragma unroll
      for (int k = 0; k < V; ++k) val.v[k] = from_f32<T>(fill);
    }
    *reinterpret_cast<Vec<T, V>*>(out + r * h + c) = val;
  }
}

__global__ void make_keys(const void* ids, bool i64, int32_t* keys, int32_t* vals, int64_t n, int64_t v,
                          int64_t vocab_start) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = id_at(ids, i64, i) - (vocab_start < 0 ? 0 : vocab_start);
    keys[i] = (id >= 0 && id < v) ? int32_t(id) : int32_t(v);  // v: no row (sorted last, skipped)
    vals[i] = int32_t(i);
  }
}

template <class T, class W>
__global__ void segment_sum(const T* dout, const int32_t* keys, const int32_t* tokens, W* dw, int64_t n, int64_t v,
                            int64_t h, bool accumulate) {
  const int64_t i = blockIdx.x;
  const int32_t k = keys[i];
  if (k >= v || (i > 0 && keys[i - 1] == k)) return;  // not the first of its run, or no row
  int64_t end = i + 1;
  while (end < n && keys[end] == k) ++end;
  for (int64_t c = threadIdx.x; c < h; c += blockDim.x) {
    float acc = accumulate ? to_f32(dw[int64_t(k) * h + c]) : 0.f;
    for (int64_t j = i; j < end; ++j) acc += to_f32(dout[int64_t(tokens[j]) * h + c]);
    dw[int64_t(k) * h + c] = from_f32<W>(acc);
  }
}

int key_bits(int64_t v) {
  int b = 1;
  while ((int64_t(1) << b) <= v) ++b;
  return b;
}

struct Layout {
  size_t keys_in, keys_out, vals_in, vals_out, temp, temp_bytes, total;
};

Layout layout(int64_t n, int64_t v) {
  size_t temp_bytes = 0;
  MC_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, static_cast<int32_t*>(nullptr),
                                                static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                                static_cast<int32_t*>(nullptr), int(n), 0, key_bits(v)));
  auto up = [](size_t x) { return (x + 255) / 256 * 256; };
  Layout l;
  const size_t a = up(size_t(n) * 4);
  l.keys_in = 0;
  l.keys_out = a;
  l.vals_in = 2 * a;
  l.vals_out = 3 * a;
  l.temp = 4 * a;
  l.temp_bytes = temp_bytes;
  l.total = 4 * a + up(temp_bytes);
  return l;
}

}  // namespace

void embedding_forward(DType dt, const void* weight, const void* ids, bool ids_i64, void* out, int64_t n, int64_t v,
                       int64_t h, int64_t vocab_start, int device, void* stream) {
  if (n == 0 || h == 0) return;
  cuda_impl::DeviceGuard guard(device);
  cudaStream_t s = as_stream(stream);
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec16<T>;
    auto go = [&](auto vtag) {
      constexpr int VV = decltype(vtag)::value;
      const int64_t nv = (h + VV - 1) / VV;
      const int threads = nv >= 256 ? 256 : int((nv + 31) / 32 * 32);
      dim3 grid(unsigned((nv + threads - 1) / threads), unsigned(n < 65535 ? n : 65535));
      embed_fwd<T, VV><<<grid, threads, 0, s>>>(static_cast<const T*>(weight), ids, ids_i64, static_cast<T*>(out), n,
                                                v, h, vocab_start);
      MC_CUDA_CHECK_LAUNCH();
    };
    if (h % V == 0 && aligned16(weight) && aligned16(out)) go(std::integral_constant<int, V>{});
    else go(std::integral_constant<int, 1>{});
  });
}

size_t embedding_backward_workspace_bytes(int64_t n, int64_t v, int device) {
  cuda_impl::DeviceGuard guard(device);
  return n == 0 ? 0 : layout(n, v).total;
}

void embedding_backward(DType dt, DType wdt, const void* dout, const void* ids, bool ids_i64, void* dweight, int64_t n,
                        int64_t v, int64_t h, int64_t vocab_start, bool accumulate, void* workspace,
                        size_t workspace_bytes, int device, void* stream) {
  cuda_impl::DeviceGuard guard(device);
  cudaStream_t s = as_stream(stream);
  if (!accumulate) MC_CUDA_CHECK(cudaMemsetAsync(dweight, 0, size_t(v) * size_t(h) * size_t(dtype_size(wdt)), s));
  if (n == 0 || h == 0) return;
  const Layout l = layout(n, v);
  MC_CHECK(workspace_bytes >= l.total, "internal: embedding workspace too small");
  char* ws = static_cast<char*>(workspace);
  auto* keys_in = reinterpret_cast<int32_t*>(ws + l.keys_in);
  auto* keys_out = reinterpret_cast<int32_t*>(ws + l.keys_out);
  auto* vals_in = reinterpret_cast<int32_t*>(ws + l.vals_in);
  auto* vals_out = reinterpret_cast<int32_t*>(ws + l.vals_out);
  make_keys<<<elementwise_blocks(n, 256, device), 256, 0, s>>>(ids, ids_i64, keys_in, vals_in, n, v, vocab_start);
  MC_CUDA_CHECK_LAUNCH();
  size_t temp_bytes = l.temp_bytes;
  MC_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws + l.temp, temp_bytes, keys_in, keys_out, vals_in, vals_out, int(n),
                                                0, key_bits(v), s));
  // After zeroing, accumulation into the zeroed rows is the same as overwriting them.
  dispatch_float(dt, [&](auto tag) {
    dispatch_float(wdt, [&](auto wtag) {
      using T = decltype(tag);
      using W = decltype(wtag);
      const int threads = h >= 256 ? 256 : int((h + 31) / 32 * 32);
      segment_sum<T, W><<<unsigned(n), threads, 0, s>>>(static_cast<const T*>(dout), keys_out, vals_out,
                                                         static_cast<W*>(dweight), n, v, h, true);
      MC_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace megacore::ops::cuda
