// Embedding kernels. Forward copies rows with 16-byte accesses. Backward sorts (id, token) pairs with a
// stable radix sort, then the first blocks of each run of equal ids (one per column slice) sum that
// run's gradient rows in token order and own the output row: no atomics, so the result does not depend
// on scheduling. The sums use 16-byte accesses (EmbeddingTuning); rows that are not a multiple of 16
// bytes, or misaligned pointers, take an element-wise kernel.
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

// V elements of W moved as 16-byte (or smaller, when V elements are fewer bytes) accesses.
template <class W, int V>
__device__ __forceinline__ void load_f32_split(const W* p, float (&out)[V]) {
  constexpr int A = V < kVec16<W> ? V : kVec16<W>;
#pragma unroll
  for (int j = 0; j < V; j += A) {
    float t[A];
    load_f32<W, A>(p + j, t);
#pragma unroll
    for (int i = 0; i < A; ++i) out[j + i] = t[i];
  }
}
template <class W, int V>
__device__ __forceinline__ void store_f32_split(W* p, const float (&in)[V]) {
  constexpr int A = V < kVec16<W> ? V : kVec16<W>;
#pragma unroll
  for (int j = 0; j < V; j += A) {
    float t[A];
#pragma unroll
    for (int i = 0; i < A; ++i) t[i] = in[j + i];
    store_f32<W, A>(p + j, t);
  }
}

// The vector form of segment_sum: block (i, y) owns columns [y * blockDim.x * U * V, ...) of the run
// starting at sorted position i; a thread sums U vectors of V columns (16 bytes of dout each), so one
// gradient row puts U 16-byte loads per thread in flight, and the loads of the next row need not wait
// for this row's adds. Same order of additions as segment_sum: the output row (when accumulating),
// then the run's rows in token order. h % V == 0; dout 16-byte aligned, dw aligned to its accesses.
template <class T, class W, int V, int U>
__global__ void segment_sum_vec(const T* dout, const int32_t* keys, const int32_t* tokens, W* dw, int64_t n,
                                int64_t v, int64_t h, bool accumulate) {
  const int64_t i = blockIdx.x;
  const int32_t k = keys[i];
  if (k >= v || (i > 0 && keys[i - 1] == k)) return;
  int64_t end = i + 1;
  while (end < n && keys[end] == k) ++end;
  const int64_t c0 = (int64_t(blockIdx.y) * blockDim.x * U + threadIdx.x) * V;
  const int64_t cstep = int64_t(blockDim.x) * V;
  W* out = dw + int64_t(k) * h;
  float acc[U][V];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t c = c0 + u * cstep;
    if (accumulate && c < h) {
      load_f32_split<W, V>(out + c, acc[u]);
    } else {
#pragma unroll
      for (int e = 0; e < V; ++e) acc[u][e] = 0.f;
    }
  }
  for (int64_t j = i; j < end; ++j) {
    const T* g = dout + int64_t(tokens[j]) * h;
    float t[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + u * cstep;
      if (c < h) load_f32_stream<T, V>(g + c, t[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (c0 + u * cstep < h)
#pragma unroll
        for (int e = 0; e < V; ++e) acc[u][e] += t[u][e];
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t c = c0 + u * cstep;
    if (c < h) store_f32_split<W, V>(out + c, acc[u]);
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
                        size_t workspace_bytes, int device, void* stream, const EmbeddingTuning& tuning) {
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
  // After zeroing, the rows need not be read: a sum that starts from 0 gives the same bits.
  const EmbeddingTuning& tu = tuning;
  dispatch_float(dt, [&](auto tag) {
    dispatch_float(wdt, [&](auto wtag) {
      using T = decltype(tag);
      using W = decltype(wtag);
      constexpr int V = kVec16<T>;
      constexpr int A = V < kVec16<W> ? V : kVec16<W>;
      const bool vec = tu.vector && h % V == 0 && aligned16(dout) &&
                       reinterpret_cast<uintptr_t>(dweight) % (uintptr_t(A) * sizeof(W)) == 0;
      if (!vec) {
        const int threads = h >= 256 ? 256 : int((h + 31) / 32 * 32);
        segment_sum<T, W><<<unsigned(n), threads, 0, s>>>(static_cast<const T*>(dout), keys_out, vals_out,
                                                           static_cast<W*>(dweight), n, v, h, accumulate);
        MC_CUDA_CHECK_LAUNCH();
        return;
      }
      auto go = [&](auto utag) {
        constexpr int U = decltype(utag)::value;
        // Threads: as asked, fewer when a row has fewer vectors (a multiple of 32).
        const int64_t vecs = h / V;
        int threads = tu.threads < 32 ? 32 : tu.threads > 1024 ? 1024 : tu.threads / 32 * 32;
        const int64_t need = ((vecs + U - 1) / U + 31) / 32 * 32;
        if (need < threads) threads = int(need);
        const int64_t per_block = int64_t(threads) * U * V;
        const dim3 grid(unsigned(n), unsigned((h + per_block - 1) / per_block));
        segment_sum_vec<T, W, V, U><<<grid, threads, 0, s>>>(static_cast<const T*>(dout), keys_out, vals_out,
                                                             static_cast<W*>(dweight), n, v, h, accumulate);
        MC_CUDA_CHECK_LAUNCH();
      };
      dispatch_unroll(tu.unroll, go);
    });
  });
}

}  // namespace megacore::ops::cuda
