// Device-side pieces of packed (cu_seqlens) attention through cuDNN's ragged layout
// (attention_cudnn.cpp): sequence lengths and element offsets from cu_seqlens, the log-sum-exp moved
// between megacore's [H, Tq] layout and the token-major [Tq, H] layout cuDNN reads and writes, and the
// rows cuDNN leaves alone zeroed (tokens outside every sequence, or whose sequence has no partner
// tokens on the other side), so the results match the reference everywhere.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/cuda/cuda_check.hpp"
#include "ops/cuda/attention_cuda.hpp"

namespace megacore::ops::cuda {
namespace {

// The sequence holding token t (cu has batch + 1 entries, non-decreasing), or -1 when t is at or past
// cu[batch]: the largest b with cu[b] <= t (empty sequences share their start with the next one).
__device__ __forceinline__ int sequence_of(const int32_t* cu, int batch, int64_t t) {
  if (t >= cu[batch]) return -1;
  int lo = 0, hi = batch;  // cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (cu[mid] <= t) lo = mid;
    else hi = mid;
  }
  return lo;
}

__global__ void prepare_kernel(const int32_t* cu_q, const int32_t* cu_kv, int batch, int batch_padded, int max_q,
                               int max_kv, RaggedOffsets offs, RaggedIndexLayout lay, int32_t* out) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b > batch_padded) return;
  const int bb = b < batch ? b : batch;
  if (b < batch_padded) {
    const int lq = b < batch ? cu_q[b + 1] - cu_q[b] : 0, lk = b < batch ? cu_kv[b + 1] - cu_kv[b] : 0;
    // Lengths past the graph's maxima would address rows beyond what cuDNN was told; they are cut to the
    // maxima (the call's contract is max_seqlen >= every length, as for the flash kernel).
    out[b] = lq < 0 ? 0 : (lq > max_q ? max_q : lq);
    out[lay.seq_kv + b] = lk < 0 ? 0 : (lk > max_kv ? max_kv : lk);
  }
  for (int i = 0; i < offs.n; ++i) {
    const int64_t start = offs.kv[i] ? cu_kv[bb] : cu_q[bb];
    out[lay.offsets + i * lay.offset_stride + b] = int32_t(start * offs.mult[i]);
  }
}

__global__ void stats_to_lse_kernel(const float* stats, float* lse, int64_t lse_head_stride, int64_t tq, int heads,
                                    const int32_t* cu_q, const int32_t* cu_kv, int batch) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tq * heads) return;
  const int64_t t = i / heads;
  const int h = int(i % heads);
  const int b = sequence_of(cu_q, batch, t);
  const bool has_keys = b >= 0 && cu_kv[b + 1] > cu_kv[b];
  if (!has_keys) lse[h * lse_head_stride + t] = -INFINITY;
  else if (stats) lse[h * lse_head_stride + t] = stats[i];
}

__global__ void lse_to_stats_kernel(const float* lse, int64_t lse_head_stride, float* stats, int64_t tq, int heads) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tq * heads) return;
  stats[i] = lse[(i % heads) * lse_head_stride + i / heads];
}

__global__ void zero_orphans_kernel(uint16_t* ptr, int64_t row_stride, int64_t head_stride, int64_t tokens, int heads,
                                    int dim, const int32_t* cu, const int32_t* cu_other, int batch) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * heads) return;
  const int64_t t = i / heads;
  const int h = int(i % heads);
  const int b = sequence_of(cu, batch, t);
  if (b >= 0 && cu_other[b + 1] > cu_other[b]) return;
  uint16_t* row = ptr + t * row_stride + h * head_stride;
  for (int d = 0; d < dim; ++d) row[d] = 0;  // +0.0 in bf16 and f16 alike
}

unsigned blocks_for(int64_t n, int threads) { return unsigned((n + threads - 1) / threads); }

}  // namespace

void ragged_prepare(const int32_t* cu_q, const int32_t* cu_kv, int batch, int batch_padded, int max_q, int max_kv,
                    const RaggedOffsets& offs, int32_t* out, void* stream) {
  prepare_kernel<<<blocks_for(batch_padded + 1, 128), 128, 0, static_cast<cudaStream_t>(stream)>>>(
      cu_q, cu_kv, batch, batch_padded, max_q, max_kv, offs, ragged_index_layout(batch_padded, offs.n), out);
  MC_CUDA_CHECK_LAUNCH();
}

void ragged_stats_to_lse(const float* stats, float* lse, int64_t lse_head_stride, int64_t tq, int heads,
                         const int32_t* cu_q, const int32_t* cu_kv, int batch, void* stream) {
  if (tq * heads == 0) return;
  stats_to_lse_kernel<<<blocks_for(tq * heads, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      stats, lse, lse_head_stride, tq, heads, cu_q, cu_kv, batch);
  MC_CUDA_CHECK_LAUNCH();
}

void ragged_lse_to_stats(const float* lse, int64_t lse_head_stride, float* stats, int64_t tq, int heads,
                         void* stream) {
  if (tq * heads == 0) return;
  lse_to_stats_kernel<<<blocks_for(tq * heads, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      lse, lse_head_stride, stats, tq, heads);
  MC_CUDA_CHECK_LAUNCH();
}

void ragged_zero_orphan_rows(void* ptr, int64_t row_stride, int64_t head_stride, int64_t tokens, int heads, int dim,
                             const int32_t* cu, const int32_t* cu_other, int batch, void* stream) {
  if (tokens * heads == 0) return;
  zero_orphans_kernel<<<blocks_for(tokens * heads, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<uint16_t*>(ptr), row_stride, head_stride, tokens, heads, dim, cu, cu_other, batch);
  MC_CUDA_CHECK_LAUNCH();
}

void ragged_fix_orphans_forward(const AttnProblem& p, int device, void* stream) {
  cuda_impl::DeviceGuard guard(device);
  ragged_stats_to_lse(nullptr, p.lse, p.lse_head_stride, p.total_q, p.heads, p.cu_q, p.cu_kv, p.batch, stream);
  ragged_zero_orphan_rows(p.o.ptr, p.o.row_stride, p.o.head_stride, p.total_q, p.heads, p.head_dim, p.cu_q, p.cu_kv,
                          p.batch, stream);
}

void ragged_fix_orphans_backward(const AttnProblem& p, int device, void* stream) {
  cuda_impl::DeviceGuard guard(device);
  ragged_zero_orphan_rows(p.dq.ptr, p.dq.row_stride, p.dq.head_stride, p.total_q, p.heads, p.head_dim, p.cu_q,
                          p.cu_kv, p.batch, stream);
  ragged_zero_orphan_rows(p.dk.ptr, p.dk.row_stride, p.dk.head_stride, p.total_kv, p.kv_heads, p.head_dim, p.cu_kv,
                          p.cu_q, p.batch, stream);
  ragged_zero_orphan_rows(p.dv.ptr, p.dv.row_stride, p.dv.head_stride, p.total_kv, p.kv_heads, p.head_dim, p.cu_kv,
                          p.cu_q, p.batch, stream);
}

}  // namespace megacore::ops::cuda
