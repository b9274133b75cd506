// Dropout kernel. Element i keeps or drops by word i mod 4 of Philox call i / 4, whatever the launch
// shape. The vector kernel gives a thread E consecutive elements per step (E / 4 Philox calls) and
// issues the loads of U steps before using any, so that the loads stay in flight while the Philox
// rounds (integer multiplies, the other half of this kernel's cost) run. A grid of SMs x blocks_per_sm
// blocks (or one resident wave) walks the tensor. Misaligned pointers take the scalar kernel (groups of
// four, element accesses).
#include "ops/cuda/dropout_cuda.hpp"
#include "ops/cuda/memops_common.cuh"
#include "ops/dropout_math.hpp"

namespace megacore::ops::cuda {
namespace {

// Elements per memory access: 16 bytes, or all E when that is less.
template <class T, int E>
inline constexpr int kAccess = E < kVec16<T> ? E : kVec16<T>;

// Elements [4q, 4q + 4) for the Philox groups q of [q0, q1), element accesses.
template <class T>
__device__ __forceinline__ void dropout_groups(const T* x, T* y, uint8_t* mask, int64_t n, uint32_t thr, float scale,
                                               uint64_t seed, uint64_t offset, int64_t q0, int64_t q1, int64_t step) {
  for (int64_t q = q0; q < q1; q += step) {
    const Philox4 w = philox_words(seed, offset, uint64_t(q));
    for (int k = 0; k < 4 && 4 * q + k < n; ++k) {
      const bool keep = dropmath::keep_word(w.v[k], thr);
      y[4 * q + k] = from_f32<T>(keep ? to_f32(x[4 * q + k]) * scale : 0.f);
      if (mask) mask[4 * q + k] = uint8_t(keep);
    }
  }
}

template <class T>
__global__ void dropout_scalar(const T* x, T* y, uint8_t* mask, int64_t n, uint32_t thr, float scale, uint64_t seed,
                               uint64_t offset) {
  dropout_groups(x, y, mask, n, thr, scale, seed, offset, blockIdx.x * int64_t(blockDim.x) + threadIdx.x, (n + 3) / 4,
                 int64_t(gridDim.x) * blockDim.x);
}

// x and y aligned to kAccess<T, E> elements, mask to E bytes.
// No __restrict__: dropout may run in place (y == x); each element is read before it is written, by
// the same thread.
template <class T, int E, int U>
__global__ void dropout_vec(const T* x, T* y, uint8_t* mask, int64_t n, uint32_t thr, float scale, uint64_t seed,
                            uint64_t offset) {
  static_assert(E == 4 || E == 8, "elements per step");
  constexpr int A = kAccess<T, E>;
  const int64_t chunks = n / E;
  const int64_t per_block = int64_t(blockDim.x) * U;
  for (int64_t c0 = blockIdx.x * per_block + threadIdx.x; c0 < chunks; c0 += int64_t(gridDim.x) * per_block) {
    float v[U][E];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + int64_t(u) * blockDim.x;
#pragma unroll
      for (int j = 0; j < E; j += A) {
        float t[A];
        if (c < chunks) load_f32_stream<T, A>(x + c * E + j, t);
        else
#pragma unroll
          for (int i = 0; i < A; ++i) t[i] = 0.f;
#pragma unroll
        for (int i = 0; i < A; ++i) v[u][j + i] = t[i];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t c = c0 + int64_t(u) * blockDim.x;
      if (c < chunks) {
        uint32_t mbits[E / 4];
#pragma unroll
        for (int g = 0; g < E / 4; ++g) {
          const Philox4 w = philox_words(seed, offset, uint64_t(c * (E / 4) + g));
          mbits[g] = 0;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const bool keep = dropmath::keep_word(w.v[k], thr);
            v[u][4 * g + k] = keep ? v[u][4 * g + k] * scale : 0.f;
            mbits[g] |= uint32_t(keep) << (8 * k);
          }
        }
#pragma unroll
        for (int j = 0; j < E; j += A) {
          float t[A];
#pragma unroll
          for (int i = 0; i < A; ++i) t[i] = v[u][j + i];
          store_f32_stream<T, A>(y + c * E + j, t);
        }
        if (mask) {
          if constexpr (E == 8) *reinterpret_cast<uint2*>(mask + c * E) = make_uint2(mbits[0], mbits[1]);
          else *reinterpret_cast<uint32_t*>(mask + c * E) = mbits[0];
        }
      }
    }
  }
  // The last n mod E elements (fewer than two Philox groups).
  const int64_t first = chunks * (E / 4) + blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  dropout_groups(x, y, mask, n, thr, scale, seed, offset, first, (n + 3) / 4, int64_t(gridDim.x) * blockDim.x);
}

template <class T, int E, int U>
void launch_vec(const T* x, T* y, uint8_t* mask, int64_t n, uint32_t thr, float scale, uint64_t seed, uint64_t offset,
                int threads, int blocks_per_sm, int device, cudaStream_t s) {
  const int64_t steps = (n / E + U - 1) / U;
  int per_sm = blocks_per_sm;
  if (per_sm <= 0) per_sm = resident_blocks(reinterpret_cast<const void*>(&dropout_vec<T, E, U>), threads, 0, device);
  const unsigned blocks = elementwise_blocks(steps < 1 ? 1 : steps, threads, device, per_sm);
  dropout_vec<T, E, U><<<blocks, threads, 0, s>>>(x, y, mask, n, thr, scale, seed, offset);
}

}  // namespace

void dropout(DType dt, const void* x, void* y, uint8_t* mask, int64_t n, uint32_t thr, float scale, uint64_t seed,
             uint64_t offset, int device, void* stream, const DropoutTuning& tu) {
  if (n == 0) return;
  cuda_impl::DeviceGuard guard(device);
  cudaStream_t s = as_stream(stream);
  int threads = tu.threads < 32 ? 32 : tu.threads > 1024 ? 1024 : tu.threads / 32 * 32;
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x);
    T* yp = static_cast<T*>(y);
    auto aligned = [&](int e, int access) {
      const uintptr_t a = uintptr_t(access) * sizeof(T);
      return reinterpret_cast<uintptr_t>(x) % a == 0 && reinterpret_cast<uintptr_t>(y) % a == 0 &&
             (mask == nullptr || reinterpret_cast<uintptr_t>(mask) % uintptr_t(e) == 0);
    };
    const bool e8 = tu.elems >= 8 && aligned(8, kAccess<T, 8>);
    if (e8 || aligned(4, kAccess<T, 4>)) {
      dispatch_unroll(tu.unroll, [&](auto u) {
        constexpr int U = decltype(u)::value;
        if (e8) launch_vec<T, 8, U>(xp, yp, mask, n, thr, scale, seed, offset, threads, tu.blocks_per_sm, device, s);
        else launch_vec<T, 4, U>(xp, yp, mask, n, thr, scale, seed, offset, threads, tu.blocks_per_sm, device, s);
      });
    } else {
      const unsigned blocks = elementwise_blocks((n + 3) / 4, threads, device);
      dropout_scalar<T><<<blocks, threads, 0, s>>>(xp, yp, mask, n, thr, scale, seed, offset);
    }
    MC_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace megacore::ops::cuda
