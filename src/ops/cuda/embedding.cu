// Embedding kernels. Forward copies rows with 16-byte accesses. Backward sorts (id, token) pairs with a
// stable radix sort, then the first blocks of each run of equal ids (one per column slice) sum that
// run's gradient rows in token order and own the output row: no atomics, so the result does not depend
// on scheduling. The sums use 16-byte accesses (EmbeddingTuning); rows that are not a multiple of 16
// bytes, or misaligned pointers, take an element-wise kernel.
#include <cooperative_groups.h>
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

// One thread's share of a gradient row in the segment sums: U vectors of V columns, c0, c0 + cstep,
// ... (columns at or past h are skipped). Starts from the row's old values when accumulating (else 0),
// adds dout rows in the order given, stores once.
template <class T, class W, int V, int U>
struct RowSlice {
  float acc[U][V];
  int64_t c0, cstep, h;
  __device__ __forceinline__ RowSlice(const W* out, int64_t c0_, int64_t cstep_, int64_t h_, bool accumulate)
      : c0(c0_), cstep(cstep_), h(h_) {
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
  }
  __device__ __forceinline__ void add(const T* g) {
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
  __device__ __forceinline__ void store(W* out) const {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + u * cstep;
      if (c < h) store_f32_split<W, V>(out + c, acc[u]);
    }
  }
};

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
  W* out = dw + int64_t(k) * h;
  RowSlice<T, W, V, U> row(out, c0, int64_t(blockDim.x) * V, h, accumulate);
  for (int64_t j = i; j < end; ++j) row.add(dout + int64_t(tokens[j]) * h);
  row.store(out);
}


// ---- Counting sort (EmbeddingTuning::sort = 1) -----------------------------------------------------
// One cooperative launch groups the tokens by id: zero the v + 1 counters, histogram (integer atomics:
// the counts do not depend on order), exclusive scan of the counters across the grid, scatter. Runs are
// contiguous in keys_out as after the radix sort, but the scatter's atomics leave the tokens of a run in
// an order that varies from run to run; segment_sum_ordered puts them back in token order before it
// adds, so the sums are bit-identical to the radix-sort path's.
constexpr int kSortThreads = 512;
constexpr int kMaxSortBlocks = 1024;

__device__ __forceinline__ int32_t block_exclusive_scan(int32_t x, int32_t* warp_tot, int32_t& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int32_t incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) warp_tot[warp] = incl;
  __syncthreads();
  int32_t before = 0;
  total = 0;
  for (int w = 0; w < nwarps; ++w) {
    if (w < warp) before += warp_tot[w];
    total += warp_tot[w];
  }
  __syncthreads();  // warp_tot is reused by the next call
  return before + incl - x;
}

__global__ void __launch_bounds__(kSortThreads) counting_sort_kernel(const void* ids, bool i64, int64_t n, int64_t v,
                                                                     int64_t vocab_start, int32_t* keys_tok,
                                                                     int32_t* count, int32_t* block_tot,
                                                                     int32_t* keys_out, int32_t* vals_out) {
  namespace cg = cooperative_groups;
  cg::grid_group grid = cg::this_grid();
  __shared__ int32_t warp_tot[32];
  const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, nthreads = int64_t(gridDim.x) * blockDim.x;
  const int64_t buckets = v + 1;  // bucket v: ids outside the table (sorted last, skipped)
  for (int64_t i = tid; i < buckets; i += nthreads) count[i] = 0;
  grid.sync();
  for (int64_t i = tid; i < n; i += nthreads) {
    const int64_t id = id_at(ids, i64, i) - (vocab_start < 0 ? 0 : vocab_start);
    const int32_t k = (id >= 0 && id < v) ? int32_t(id) : int32_t(v);
    keys_tok[i] = k;
    atomicAdd(&count[k], 1);
  }
  grid.sync();
  // Block b scans buckets [b * per, (b + 1) * per).
  const int64_t per = (buckets + gridDim.x - 1) / gridDim.x;
  const int64_t b0 = int64_t(blockIdx.x) * per, b1 = b0 + per < buckets ? b0 + per : buckets;
  int32_t mine = 0;
  for (int64_t base = b0; base < b1; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    int32_t total;
    block_exclusive_scan(i < b1 ? count[i] : 0, warp_tot, total);
    mine += total;
  }
  if (threadIdx.x == 0) block_tot[blockIdx.x] = mine;
  grid.sync();
  int32_t offset = 0;
  {
    int32_t part = 0;
    for (int64_t b = threadIdx.x; b < blockIdx.x; b += blockDim.x) part += block_tot[b];
    int32_t total;
    block_exclusive_scan(part, warp_tot, total);
    offset = total;
  }
  for (int64_t base = b0; base < b1; base += blockDim.x) {
    const int64_t i = base + threadIdx.x;
    const int32_t c = i < b1 ? count[i] : 0;
    int32_t total;
    const int32_t ex = block_exclusive_scan(c, warp_tot, total);
    if (i < b1) count[i] = offset + ex;  // the bucket's start
    offset += total;
  }
  grid.sync();
  for (int64_t i = tid; i < n; i += nthreads) {
    const int32_t k = keys_tok[i];
    const int32_t pos = atomicAdd(&count[k], 1);
    keys_out[pos] = k;
    vals_out[pos] = int32_t(i);
  }
}

// segment_sum_vec for runs whose tokens are in no particular order: the block first lists the run's tokens
// in increasing order (runs up to blockDim.x tokens: each token's rank is the number of smaller ones;
// longer runs: a walk over keys_tok in token order), then adds the rows in that order.
template <class T, class W, int V, int U>
__global__ void segment_sum_ordered(const T* dout, const int32_t* keys, const int32_t* tokens,
                                    const int32_t* keys_tok, W* dw, int64_t n, int64_t v, int64_t h,
                                    bool accumulate) {
  constexpr int kMax = 1024;
  __shared__ int32_t s_tok[kMax];
  __shared__ int32_t s_ord[kMax];
  __shared__ int32_t warp_cnt[32];
  const int64_t i = blockIdx.x;
  // The four lookups have independent addresses: one round trip before the rows' loads (a run of one token,
  // the common case, needs nothing more).
  const int32_t k = keys[i];
  const int32_t k_prev = i > 0 ? keys[i - 1] : -1;
  const int32_t k_next = i + 1 < n ? keys[i + 1] : -1;
  const int32_t tok0 = tokens[i];
  if (k >= v || k_prev == k) return;
  int64_t end = i + 1;
  if (k_next == k) {
    end = i + 2;
    while (end < n && keys[end] == k) ++end;
  }
  const int64_t len = end - i;
  const int64_t c0 = (int64_t(blockIdx.y) * blockDim.x * U + threadIdx.x) * V;
  W* out = dw + int64_t(k) * h;
  RowSlice<T, W, V, U> row(out, c0, int64_t(blockDim.x) * V, h, accumulate);
  auto add_row = [&](int32_t tok) { row.add(dout + int64_t(tok) * h); };
  if (len == 1) {
    add_row(tok0);
  } else {
    // One list when the run fits the block (each token's rank is the number of smaller ones), else one
    // list per tile of keys_tok, in token order.
    const bool walk = len > blockDim.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int64_t base = 0;; base += blockDim.x) {
      int cnt = int(len);
      if (!walk) {
        if (threadIdx.x < len) s_tok[threadIdx.x] = tokens[i + threadIdx.x];
        __syncthreads();
        if (threadIdx.x < len) {
          const int32_t me = s_tok[threadIdx.x];
          int r = 0;
          for (int j = 0; j < int(len); ++j) r += s_tok[j] < me;
          s_ord[r] = me;
        }
      } else {
        const int64_t t = base + threadIdx.x;
        const bool hit = t < n && keys_tok[t] == k;
        const unsigned bal = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_cnt[warp] = __popc(bal);
        __syncthreads();
        int before = 0;
        cnt = 0;
        for (int w = 0; w < nwarps; ++w) {
          if (w < warp) before += warp_cnt[w];
          cnt += warp_cnt[w];
        }
        if (hit) s_ord[before + __popc(bal & ((1u << lane) - 1u))] = int32_t(t);
      }
      __syncthreads();
      for (int j = 0; j < cnt; ++j) add_row(s_ord[j]);
      if (!walk || base + blockDim.x >= n) break;
      __syncthreads();  // s_ord and warp_cnt are rewritten by the next tile
    }
  }
  row.store(out);
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
  // The counting sort uses the temp region for its v + 1 counters and per-block totals.
  const size_t counting = up(size_t(v + 1) * 4) + size_t(kMaxSortBlocks) * 4;
  l.total = 4 * a + up(temp_bytes > counting ? temp_bytes : counting);
  return l;
}


// Launches the counting sort (keys by token into keys_in, runs into keys_out / vals_out); false when the
// device cannot run it as one cooperative grid (the caller then takes the radix sort).
bool counting_sort(const void* ids, bool ids_i64, int64_t n, int64_t v, int64_t vocab_start, char* ws,
                   const Layout& l, int device, cudaStream_t s) {
  if (n > INT32_MAX || v + 1 > INT32_MAX) return false;
  int coop = 0;
  MC_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device));
  if (!coop) return false;
  const int per_sm = resident_blocks(reinterpret_cast<const void*>(&counting_sort_kernel), kSortThreads, 0, device);
  if (per_sm < 1) return false;
  int64_t blocks = int64_t(sm_count(device)) * (per_sm < 2 ? per_sm : 2);
  if (blocks > kMaxSortBlocks) blocks = kMaxSortBlocks;
  auto* keys_tok = reinterpret_cast<int32_t*>(ws + l.keys_in);
  auto* keys_out = reinterpret_cast<int32_t*>(ws + l.keys_out);
  auto* vals_out = reinterpret_cast<int32_t*>(ws + l.vals_out);
  auto* count = reinterpret_cast<int32_t*>(ws + l.temp);
  auto* block_tot = count + (size_t(v + 1) + 63) / 64 * 64;
  void* args[] = {const_cast<void**>(&ids), &ids_i64, &n, &v, &vocab_start, &keys_tok, &count, &block_tot,
                  &keys_out, &vals_out};
  MC_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(counting_sort_kernel), dim3(unsigned(blocks)),
                                            dim3(kSortThreads), args, 0, s));
  MC_CUDA_CHECK_LAUNCH();
  return true;
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
  MC_INTERNAL_ASSERT(workspace_bytes >= l.total, "the embedding workspace has {} bytes, its layout needs {}",
                     workspace_bytes, l.total);
  char* ws = static_cast<char*>(workspace);
  auto* keys_in = reinterpret_cast<int32_t*>(ws + l.keys_in);
  auto* keys_out = reinterpret_cast<int32_t*>(ws + l.keys_out);
  auto* vals_in = reinterpret_cast<int32_t*>(ws + l.vals_in);
  auto* vals_out = reinterpret_cast<int32_t*>(ws + l.vals_out);
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
      // The counting sort: vector path only (the element kernel adds the run in sorted order).
      const bool counting = vec && tu.sort == 1 && counting_sort(ids, ids_i64, n, v, vocab_start, ws, l, device, s);
      const bool ordered = vec && (counting || tu.sort == 2);
      if (!counting) {
        // keys_in keeps the keys by token (segment_sum_ordered's walk reads them; the sort does not alter it).
        make_keys<<<elementwise_blocks(n, 256, device), 256, 0, s>>>(ids, ids_i64, keys_in, vals_in, n, v,
                                                                     vocab_start);
        MC_CUDA_CHECK_LAUNCH();
        size_t temp_bytes = l.temp_bytes;
        MC_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws + l.temp, temp_bytes, keys_in, keys_out, vals_in, vals_out,
                                                      int(n), 0, key_bits(v), s));
      }
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
        if (ordered)
          segment_sum_ordered<T, W, V, U><<<grid, threads, 0, s>>>(static_cast<const T*>(dout), keys_out, vals_out,
                                                                   keys_in, static_cast<W*>(dweight), n, v, h,
                                                                   accumulate);
        else
          segment_sum_vec<T, W, V, U><<<grid, threads, 0, s>>>(static_cast<const T*>(dout), keys_out, vals_out,
                                                               static_cast<W*>(dweight), n, v, h, accumulate);
        MC_CUDA_CHECK_LAUNCH();
      };
      dispatch_unroll(tu.unroll, go);
    });
  });
}

}  // namespace megacore::ops::cuda
