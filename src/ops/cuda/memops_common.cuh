// Device helpers shared by the memory-bound op kernels: 16-byte vectors of f32/bf16/f16, f32
// conversions, warp/block reductions and launch helpers. Included only by .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <type_traits>
#include <unordered_map>

#include "core/cuda/cuda_check.hpp"
#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

template <class T>
__device__ __forceinline__ float to_f32(T v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return float(v);  // bf16: a shift; f16: the exact widening in dtype.hpp
}

template <class T>
__device__ __forceinline__ T from_f32(float v) {
  // The hardware conversions round to nearest even, like dtype.hpp's host versions, in one instruction.
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    T r;
    r.bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
    return r;
  } else {
    T r;
    r.bits = __half_as_ushort(__float2half_rn(v));
    return r;
  }
}

template <>
__device__ __forceinline__ float to_f32<float16>(float16 v) {
  return __half2float(__ushort_as_half(v.bits));
}

/// N consecutive elements moved as one access (16 bytes when N = 16 / sizeof(T)).
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <class T, int N>
__device__ __forceinline__ void load_f32(const T* p, float (&out)[N]) {
  Vec<T, N> t = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_f32(t.v[i]);
}

template <class T, int N>
__device__ __forceinline__ void store_f32(T* p, const float (&in)[N]) {
  Vec<T, N> t;
#pragma unroll
  for (int i = 0; i < N; ++i) t.v[i] = from_f32<T>(in[i]);
  *reinterpret_cast<Vec<T, N>*>(p) = t;
}

/// Streaming variants: data read or written once, so keep it from evicting what is reused.
template <class T, int N>
__device__ __forceinline__ void load_f32_stream(const T* p, float (&out)[N]) {
  static_assert(sizeof(Vec<T, N>) == 16 || sizeof(Vec<T, N>) <= 8, "vector width");
  Vec<T, N> t;
  if constexpr (sizeof(Vec<T, N>) == 16) {
    int4 r = __ldcs(reinterpret_cast<const int4*>(p));
    t = *reinterpret_cast<Vec<T, N>*>(&r);
  } else {
    t = *reinterpret_cast<const Vec<T, N>*>(p);
  }
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_f32(t.v[i]);
}

template <class T, int N>
__device__ __forceinline__ void store_f32_stream(T* p, const float (&in)[N]) {
  Vec<T, N> t;
#pragma unroll
  for (int i = 0; i < N; ++i) t.v[i] = from_f32<T>(in[i]);
  if constexpr (sizeof(Vec<T, N>) == 16) {
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<int4*>(&t));
  } else {
    *reinterpret_cast<Vec<T, N>*>(p) = t;
  }
}

/// Elements per 16-byte access.
template <class T>
inline constexpr int kVec16 = int(16 / sizeof(T));

/// One 16-byte vector of T, kept packed in registers (4 registers whatever T is) until it is used.
template <class T>
using Vec16 = Vec<T, kVec16<T>>;

template <class T>
__device__ __forceinline__ Vec16<T> load_vec16(const T* p) {
  return *reinterpret_cast<const Vec16<T>*>(p);
}
/// Read once: evict-first, so it does not push out what is reused.
template <class T>
__device__ __forceinline__ Vec16<T> load_vec16_stream(const T* p) {
  int4 r = __ldcs(reinterpret_cast<const int4*>(p));
  return *reinterpret_cast<Vec16<T>*>(&r);
}
/// The f32 values of a packed vector. The conversion is an asm statement the compiler will not merge
/// with an earlier one, so a kernel that reads a packed row twice (reduce, then write) converts it
/// twice instead of keeping a second, f32 copy of the row alive: half the registers per byte in flight.
template <class T>
__device__ __forceinline__ void unpack_f32(const Vec16<T>& p, float (&out)[kVec16<T>]) {
  constexpr int V = kVec16<T>;
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = p.v[i];  // already f32: nothing to save
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    const uint32_t* u = reinterpret_cast<const uint32_t*>(p.v);
#pragma unroll
    for (int i = 0; i < V / 2; ++i) {
      uint32_t lo, hi;
      asm volatile("shl.b32 %0, %1, 16;" : "=r"(lo) : "r"(u[i]));
      asm volatile("and.b32 %0, %1, 0xffff0000;" : "=r"(hi) : "r"(u[i]));
      out[2 * i] = __uint_as_float(lo);
      out[2 * i + 1] = __uint_as_float(hi);
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) asm volatile("cvt.f32.f16 %0, %1;" : "=f"(out[i]) : "h"(p.v[i].bits));
  }
}

template <class T>
__device__ __forceinline__ Vec16<T> zero_vec16() {
  int4 r = make_int4(0, 0, 0, 0);
  return *reinterpret_cast<Vec16<T>*>(&r);
}

__host__ __device__ inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/// Sum over the block, returned to every thread. `red` holds 32 floats of shared memory; the
/// trailing barrier lets the caller reuse it right away.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? red[lane] : 0.f;
  t = warp_sum(t);
  __syncthreads();
  return t;
}

/// Two sums at once (one pair of barriers instead of two).
__device__ __forceinline__ float2 block_sum2(float a, float b, float2* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  if (lane == 0) red[warp] = make_float2(a, b);
  __syncthreads();
  float2 t = lane < nwarps ? red[lane] : make_float2(0.f, 0.f);
  t.x = warp_sum(t.x);
  t.y = warp_sum(t.y);
  __syncthreads();
  return t;
}

__device__ __forceinline__ float block_max(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_max(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = lane < nwarps ? red[lane] : -INFINITY;
  t = warp_max(t);
  __syncthreads();
  return t;
}

inline int sm_count(int device) {
  int n = 0;
  MC_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

/// Resident blocks per SM of kernel `fn` at this launch shape on `device` (cudaOccupancy..., remembered:
/// the query costs microseconds of host time on every call otherwise). With dynamic shared memory above
/// the default 48 KiB it also makes sure the kernel's limit is at least `smem` (the limit only ever rises,
/// so a launch with a size seen before never finds it lowered by a later, smaller one).
inline int resident_blocks(const void* fn, int threads, size_t smem, int device) {
  struct Key {
    const void* fn;
    int threads, device;
    size_t smem;
    bool operator==(const Key& o) const {
      return fn == o.fn && threads == o.threads && device == o.device && smem == o.smem;
    }
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.fn) ^ (size_t(k.threads) << 1) ^ (size_t(k.device) << 20) ^ (k.smem << 24);
    }
  };
  static std::mutex mu;
  static std::unordered_map<Key, int, Hash> cache;
  static std::unordered_map<Key, size_t, Hash> smem_limit;  // per (fn, device): the largest limit set
  const Key key{fn, threads, device, smem};
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  if (smem + 1024 > 48 * 1024) {  // the kernels' few static bytes count against the default limit too
    size_t& lim = smem_limit[Key{fn, 0, device, 0}];
    if (smem > lim) {
      MC_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      lim = smem;
    }
  }
  int per_sm = 0;
  MC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, threads, smem));
  cache.emplace(key, per_sm);
  return per_sm;
}

/// Blocks for a grid-stride elementwise launch over n items of `threads` threads each: enough for every
/// item, at most blocks_per_sm per SM.
inline unsigned elementwise_blocks(int64_t n, int threads, int device, int blocks_per_sm = 16) {
  int64_t want = (n + threads - 1) / threads;
  int64_t cap = int64_t(sm_count(device)) * (blocks_per_sm < 1 ? 1 : blocks_per_sm);
  if (want > cap) want = cap;
  return unsigned(want < 1 ? 1 : want);
}

/// Calls f(std::integral_constant<int, U>{}) for U = 4, 2 or 1, the largest not above `unroll` (1 below 2):
/// a launch-time loads-in-flight choice turned into a kernel template argument.
template <class F>
void dispatch_unroll(int unroll, F&& f) {
  if (unroll >= 4) f(std::integral_constant<int, 4>{});
  else if (unroll >= 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

/// Calls f(T{}) for a floating DType.
template <class F>
void dispatch_float(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: f(float{}); break;
    case DType::BF16: f(bfloat16{}); break;
    case DType::F16: f(float16{}); break;
    default: raise<ValueError>("internal: dtype {} is not a floating type", dtype_name(dt));
  }
}

}  // namespace megacore::ops::cuda
