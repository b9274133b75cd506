// CUDA kernels of the context-parallel attention merge (ops/attention_merge.hpp): one warp merges one
// (query row, batch, head) partial into the f32 accumulators; the gradient accumulation is an elementwise
// grid-stride add (into f32, bf16 or f16).
#include "ops/cuda/attention_merge_cuda.hpp"
#include "ops/cuda/memops_common.cuh"

namespace megacore::ops::cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps, 8 rows per block

template <class T>
__global__ void merge_rows(float* __restrict__ out, float* __restrict__ lse, const T* __restrict__ part,
                           const float* __restrict__ lse_part, int64_t S, int64_t B, int64_t H, int64_t D, int64_t Sp,
                           int64_t seq_offset) {
  const int64_t rows = Sp * B * H;
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; row < rows; row += warps) {
    // row = (i · B + b) · H + h: the partial's own [Sp, B, H] order.
    const int64_t h = row % H, b = (row / H) % B, i = row / (H * B);
    const float l2 = lse_part[(b * H + h) * Sp + i];
    if (l2 == -INFINITY) continue;  // the partial saw no key
    float* l1p = lse + (b * H + h) * S + seq_offset + i;
    const float l1 = *l1p;
    const float m = fmaxf(l1, l2);
    const float w1 = __expf(l1 - m), w2 = __expf(l2 - m);  // l1 = −inf gives w1 = 0
    const float inv = 1.f / (w1 + w2);
    float* o = out + ((seq_offset + i) * B + b) * H * D + h * D;
    const T* p = part + row * D;
    for (int64_t e = lane; e < D; e += 32) o[e] = (w1 * o[e] + w2 * to_f32(p[e])) * inv;
    __syncwarp();  // every lane has read l1 before lane 0 replaces it
    if (lane == 0) *l1p = m + logf(w1 + w2);
  }
}

template <class D, class T>
__global__ void accumulate_kernel(D* __restrict__ dst, const T* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_f32<D>(to_f32(dst[i]) + to_f32(src[i]));
}

}  // namespace

void attention_merge_partial(DType dt, float* out, float* lse, const void* part, const float* lse_part, int64_t S,
                             int64_t B, int64_t H, int64_t D, int64_t Sp, int64_t seq_offset, int device,
                             void* stream) {
  const int64_t rows = Sp * B * H;
  if (rows == 0 || D == 0) return;
  cuda_impl::DeviceGuard guard(device);
  const unsigned blocks = elementwise_blocks(rows * 32, kThreads, device);  // a warp per row
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    merge_rows<T><<<blocks, kThreads, 0, as_stream(stream)>>>(out, lse, static_cast<const T*>(part), lse_part, S, B,
                                                               H, D, Sp, seq_offset);
    MC_CUDA_CHECK_LAUNCH();
  });
}

void accumulate(DType dd, void* dst, DType ds, const void* src, int64_t n, int device, void* stream) {
  if (n == 0) return;
  cuda_impl::DeviceGuard guard(device);
  const unsigned blocks = elementwise_blocks(n, kThreads, device);
  dispatch_float(dd, [&](auto dtag) {
    using D = decltype(dtag);
    dispatch_float(ds, [&](auto stag) {
      using T = decltype(stag);
      accumulate_kernel<D, T><<<blocks, kThreads, 0, as_stream(stream)>>>(static_cast<D*>(dst),
                                                                          static_cast<const T*>(src), n);
      MC_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace megacore::ops::cuda
