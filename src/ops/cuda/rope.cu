// RoPE kernel. A thread owns VP rotary pairs of one token and walks every head of that token, so
// each sin/cos is computed once per (token, frequency) rather than once per head. Rotate-half pairs
// are read as two 16-byte vectors (x[i..], x[i + rot/2 ..]); interleaved pairs as one vector.
#include "ops/cuda/memops_common.cuh"
#include "ops/cuda/rope_cuda.hpp"

namespace megacore::ops::cuda {
namespace {

template <class T, int VP, bool IL>
__global__ void rope_kernel(RopeArgs a, int groups) {
  const int tpb = blockDim.x / groups;
  const int tg = threadIdx.x / groups, gi = threadIdx.x % groups;
  const int64_t token = int64_t(blockIdx.x) * tpb + tg;
  if (tg >= tpb || token >= a.tokens) return;
  const int64_t pos = a.positions_i64 ? static_cast<const int64_t*>(a.positions)[token]
                                      : int64_t(static_cast<const int32_t*>(a.positions)[token]);
  const int64_t half = a.rotary_dim / 2, d = a.head_dim;
  const T* x = static_cast<const T*>(a.x) + token * a.heads * d;
  T* y = static_cast<T*>(a.y) + token * a.heads * d;
  const float fpos = float(pos);
  for (int64_t i0 = int64_t(gi) * VP; i0 < half; i0 += int64_t(groups) * VP) {
    float c[VP], s[VP];
#pragma unroll
    for (int p = 0; p < VP; ++p) {
      const float ang = fpos * a.inv_freq[i0 + p];
      sincosf(ang, &s[p], &c[p]);
      if (a.backward) s[p] = -s[p];
    }
#pragma unroll 4
    for (int64_t h = 0; h < a.heads; ++h) {
      const T* xh = x + h * d;
      T* yh = y + h * d;
      if constexpr (!IL) {
        float x1[VP], x2[VP], y1[VP], y2[VP];
        load_f32<T, VP>(xh + i0, x1);
        load_f32<T, VP>(xh + half + i0, x2);
#pragma unroll
        for (int p = 0; p < VP; ++p) {
          y1[p] = x1[p] * c[p] - x2[p] * s[p];
          y2[p] = x2[p] * c[p] + x1[p] * s[p];
        }
        store_f32<T, VP>(yh + i0, y1);
        store_f32<T, VP>(yh + half + i0, y2);
      } else if constexpr (VP == 1) {  // element accesses: an odd head_dim leaves pairs unaligned
        const float x0 = to_f32(xh[2 * i0]), x1 = to_f32(xh[2 * i0 + 1]);
        yh[2 * i0] = from_f32<T>(x0 * c[0] - x1 * s[0]);
        yh[2 * i0 + 1] = from_f32<T>(x1 * c[0] + x0 * s[0]);
      } else {
        float xv[2 * VP], yv[2 * VP];
        load_f32<T, 2 * VP>(xh + 2 * i0, xv);
#pragma unroll
        for (int p = 0; p < VP; ++p) {
          yv[2 * p] = xv[2 * p] * c[p] - xv[2 * p + 1] * s[p];
          yv[2 * p + 1] = xv[2 * p + 1] * c[p] + xv[2 * p] * s[p];
        }
        store_f32<T, 2 * VP>(yh + 2 * i0, yv);
      }
    }
  }
  if (a.rotary_dim < d && a.x != a.y) {
    for (int64_t h = 0; h < a.heads; ++h)
      for (int64_t j = a.rotary_dim + gi; j < d; j += groups) y[h * d + j] = x[h * d + j];
  }
}

template <class T, int VP, bool IL>
void launch(const RopeArgs& a, cudaStream_t s) {
  const int64_t half = a.rotary_dim / 2;
  int64_t groups = (half + VP - 1) / VP;
  if (groups > 256) groups = 256;
  if (groups < 1) groups = 1;
  // 128-thread blocks: at 16k tokens this still gives each SM several blocks to overlap.
  const int tpb = int(128 / groups) < 1 ? 1 : int(128 / groups);
  const int threads = tpb * int(groups);
  const int64_t blocks = (a.tokens + tpb - 1) / tpb;
  rope_kernel<T, VP, IL><<<unsigned(blocks), threads, 0, s>>>(a, int(groups));
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace

void rope(DType dt, const RopeArgs& a, int device, void* stream) {
  if (a.tokens == 0 || a.heads == 0) return;
  cuda_impl::DeviceGuard guard(device);
  cudaStream_t s = as_stream(stream);
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec16<T>;
    const bool aligned = aligned16(a.x) && aligned16(a.y) && a.head_dim % V == 0;
    if (!a.interleaved) {
      if (aligned && (a.rotary_dim / 2) % V == 0) launch<T, V, false>(a, s);
      else launch<T, 1, false>(a, s);
    } else {
      if (aligned && a.rotary_dim % V == 0) launch<T, V / 2, true>(a, s);
      else launch<T, 1, true>(a, s);
    }
  });
}

}  // namespace megacore::ops::cuda
