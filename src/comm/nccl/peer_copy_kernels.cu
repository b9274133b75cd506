// The finishing kernels of the copy-engine all-gather and reduce-scatter (peer_copy.hpp has the protocol).
//
// One launch per chunk on the caller's stream. Each block's thread 0 waits for the peers' ready flags (in
// this device's memory, written by the peers' push streams after their copies), then the block copies or
// sums its share of the chunk; the last block to finish tells the peers their pieces were consumed. The
// all-gather copies this rank's own piece before waiting, so that copy runs while the pushes are in flight.
// Pieces written by a peer's copy engine are read with L1-bypassing loads (__ldcg). The sum accumulates in
// f32 in rank order and rounds once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "comm/nccl/peer_copy.hpp"

namespace megacore::comm::detail {
namespace {

constexpr int kThreads = 512;

// Thread 0 of a block waits for peer p's piece: an acquire load at system scope, so that the block's reads of
// the piece (after the __syncthreads that follows) see what the peer's copy engine wrote before its flag.
__device__ __forceinline__ void wait_ready(const FinishArgs& a, int p) {
  if (p == a.rank) return;
  for (;;) {
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(a.ready[p]) : "memory");
    if (static_cast<long long>(v - a.q) >= 0) break;
    __nanosleep(128);
  }
}

// Every block done with the slot: the last one resets the counter for the slot's next use, then (after a
// barrier and a system-scope fence, so that neither the reset nor any block's reads can come after it) tells
// the peers their pieces were consumed. The reset must be visible first: once a peer sees "consumed" it may
// refill the slot, and the next chunk's kernel on this slot (possibly on another stream) counts from zero.
__device__ __forceinline__ void finish(const FinishArgs& a) {
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(a.counter, 1ULL) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  if (threadIdx.x == 0) {
    *reinterpret_cast<volatile unsigned long long*>(a.counter) = 0;
    __threadfence_system();
  }
  __syncthreads();
  if (threadIdx.x < a.size && int(threadIdx.x) != a.rank) {
    __threadfence_system();
    *reinterpret_cast<volatile unsigned long long*>(a.consumed[threadIdx.x]) = a.q;
  }
}

__device__ __forceinline__ void copy_piece(const void* src, void* dst, int64_t bytes, bool cached) {
  const bool vec = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16) == 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  int64_t done = 0;
  if (vec) {
    const uint4* s = static_cast<const uint4*>(src);
    uint4* d = static_cast<uint4*>(dst);
    const int64_t n = bytes / 16;
    for (int64_t i = first; i < n; i += stride) d[i] = cached ? s[i] : __ldcg(s + i);
    done = n * 16;
  }
  const unsigned char* s = static_cast<const unsigned char*>(src);
  unsigned char* d = static_cast<unsigned char*>(dst);
  for (int64_t i = done + first; i < bytes; i += stride) d[i] = cached ? s[i] : __ldcg(s + i);
}

__global__ void __launch_bounds__(kThreads) finish_gather(FinishArgs a) {
  copy_piece(a.piece[a.rank], a.dst[a.rank], a.bytes, true);
  for (int i = 1; i < a.size; ++i) {
    const int p = (a.rank + a.size - i) % a.size;
    if (threadIdx.x == 0) wait_ready(a, p);
    __syncthreads();
    copy_piece(a.piece[p], a.dst[p], a.bytes, false);
  }
  finish(a);
}

template <class T>
__device__ __forceinline__ float to_f(T v) {
  return static_cast<float>(v);
}
template <class T>
__device__ __forceinline__ T from_f(float v) {
  return static_cast<T>(v);
}
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ float to_f<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}

template <class T>
__global__ void __launch_bounds__(kThreads) finish_sum(FinishArgs a) {
  if (threadIdx.x == 0)
    for (int p = 0; p < a.size; ++p) wait_ready(a, p);
  __syncthreads();
  const int64_t count = a.bytes / int64_t(sizeof(T));
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  T* out = static_cast<T*>(a.dst[0]);
  uintptr_t align = reinterpret_cast<uintptr_t>(out);
  for (int p = 0; p < a.size; ++p) align |= reinterpret_cast<uintptr_t>(a.piece[p]);
  constexpr int V = 16 / sizeof(T);
  int64_t done = 0;
  if (align % 16 == 0) {
    const int64_t n = count / V;
    for (int64_t i = first; i < n; i += stride) {
      float acc[V];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = 0.f;
      for (int p = 0; p < a.size; ++p) {
        const uint4* src = static_cast<const uint4*>(a.piece[p]) + i;
        uint4 raw = p == a.rank ? *src : __ldcg(src);
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < V; ++k) acc[k] += to_f(v[k]);
      }
      uint4 res;
      T* o = reinterpret_cast<T*>(&res);
#pragma unroll
      for (int k = 0; k < V; ++k) o[k] = from_f<T>(acc[k]);
      reinterpret_cast<uint4*>(out)[i] = res;
    }
    done = n * V;
  }
  for (int64_t i = done + first; i < count; i += stride) {
    float acc = 0.f;
    for (int p = 0; p < a.size; ++p) {
      const T* src = static_cast<const T*>(a.piece[p]) + i;
      acc += to_f(p == a.rank ? *src : __ldcg(src));
    }
    out[i] = from_f<T>(acc);
  }
  finish(a);
}

int grid_for(int64_t bytes) {
  static const int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 80;
  }();
  const int64_t want = (bytes / 16 + kThreads - 1) / kThreads;
  return int(std::max<int64_t>(1, std::min<int64_t>(sms, want)));
}

}  // namespace

cudaError_t peer_copy_finish_gather(const FinishArgs& a, cudaStream_t stream) {
  finish_gather<<<grid_for(a.bytes), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t peer_copy_finish_sum(const FinishArgs& a, DType dtype, cudaStream_t stream) {
  const int grid = grid_for(a.bytes);
  switch (dtype) {
    case DType::F32: finish_sum<float><<<grid, kThreads, 0, stream>>>(a); break;
    case DType::BF16: finish_sum<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a); break;
    case DType::F16: finish_sum<__half><<<grid, kThreads, 0, stream>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace megacore::comm::detail
