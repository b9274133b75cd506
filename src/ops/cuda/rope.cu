// RoPE kernel. A thread owns VP rotary pairs of one token and walks a chunk of that token's heads
// (RopeTuning::head_chunk), so each sin/cos is computed once per (token, frequency, head chunk) rather
// than once per head; chunks give the grid several waves of short-lived threads instead of one wave of
// long ones. The loads of U heads are issued before any of them is used: the compiler cannot hoist them
// itself, since y may alias x (in-place RoPE; every element is read and written by one thread only).
// Rotate-half pairs are read as two vectors (x[i..], x[i + rot/2 ..]); interleaved pairs as one vector
// (VP > 1) or as two elements (VP = 1, any head_dim).
//
// The same kernel splits the fused QKV projection's grouped output (Layout::Split) or merges the
// gradients back into it (Layout::Merge): the "heads" of a token are then the groups · (hpg + 2) rows of
// the grouped tensor, each read from one place and written to another, and the value rows are moved
// without rotation. One pass instead of three strided copies plus RoPE over q and over k; the rotation
// is the same expression on the same f32 values, so the results equal the unfused sequence bit for bit.
#include "ops/cuda/memops_common.cuh"
#include "ops/cuda/rope_cuda.hpp"

namespace megacore::ops::cuda {
namespace {

enum class Layout { Plain, Split, Merge };

// Everything a launch needs, whichever entry point it came from. In Plain, x and y are [tokens, heads, d];
// otherwise heads = groups · (hpg + 2) rows of qkv per token.
struct Job : RopeCommon {
  const void* x = nullptr;
  void* y = nullptr;
  void *qkv = nullptr, *q = nullptr, *k = nullptr, *v = nullptr;
  int64_t heads = 0;
  int groups = 0, hpg = 0;
  bool backward = false;
};

// The rows of one token that the kernel reads from and writes to.
template <class T, Layout L>
struct TokenRows {
  const T* x;  // Plain: x's row
  T* y;        // Plain: y's row
  T *g, *q, *k, *v;
  int groups, hpg;
  int64_t d;

  __device__ TokenRows(const Job& a, int64_t token) : groups(a.groups), hpg(a.hpg), d(a.head_dim) {
    if constexpr (L == Layout::Plain) {
      x = static_cast<const T*>(a.x) + token * a.heads * d;
      y = static_cast<T*>(a.y) + token * a.heads * d;
    } else {
      g = static_cast<T*>(a.qkv) + token * a.heads * d;
      q = static_cast<T*>(a.q) + token * int64_t(groups) * hpg * d;
      k = static_cast<T*>(a.k) + token * int64_t(groups) * d;
      v = static_cast<T*>(a.v) + token * int64_t(groups) * d;
    }
  }
  // Row h of q, k or v (the grouped tensor's row h of group h / (hpg + 2)).
  __device__ __forceinline__ T* part(int64_t h) const {
    const int w = hpg + 2, gi = int(h) / w, j = int(h) - gi * w;
    return j < hpg ? q + (int64_t(gi) * hpg + j) * d : j == hpg ? k + int64_t(gi) * d : v + int64_t(gi) * d;
  }
  // Source and destination of head (row) h, each computed where it is used, so that an unrolled loop
  // does not hold U pairs of pointers across its loads.
  __device__ __forceinline__ const T* src(int64_t h) const {
    if constexpr (L == Layout::Plain) return x + h * d;
    else if constexpr (L == Layout::Split) return g + h * d;
    else return part(h);
  }
  __device__ __forceinline__ T* dst(int64_t h) const {
    if constexpr (L == Layout::Plain) return y + h * d;
    else if constexpr (L == Layout::Split) return part(h);
    else return g + h * d;
  }
  // False for a value row, which is moved without rotation.
  __device__ __forceinline__ bool rotates(int64_t h) const {
    if constexpr (L == Layout::Plain) return true;
    else return int(h) % (hpg + 2) <= hpg;
  }
};

template <class T, int VP, bool IL, int U, Layout L>
__global__ void rope_kernel(Job a, int groups, int64_t head_chunk) {
  const int tpb = blockDim.x / groups;
  const int tg = threadIdx.x / groups, gi = threadIdx.x % groups;
  const int64_t token = int64_t(blockIdx.x) * tpb + tg;
  if (tg >= tpb || token >= a.tokens) return;
  const int64_t h_begin = int64_t(blockIdx.y) * head_chunk;
  const int64_t h_end = h_begin + head_chunk < a.heads ? h_begin + head_chunk : a.heads;
  const int64_t pos = a.positions_i64 ? static_cast<const int64_t*>(a.positions)[token]
                                      : int64_t(static_cast<const int32_t*>(a.positions)[token]);
  const int64_t half = a.rotary_dim / 2, d = a.head_dim;
  const TokenRows<T, L> rows(a, token);
  const float fpos = float(pos);
  // Interleaved pairs in one vector, or the two halves of VP pairs in two vectors.
  constexpr bool kOneVec = IL && VP > 1;
  using Half = Vec<T, VP>;
  using Both = Vec<T, 2 * VP>;
  for (int64_t i0 = int64_t(gi) * VP; i0 < half; i0 += int64_t(groups) * VP) {
    float c[VP], s[VP];
#pragma unroll
    for (int p = 0; p < VP; ++p) {
      const float ang = fpos * a.inv_freq[i0 + p];
      sincosf(ang, &s[p], &c[p]);
      if (a.backward) s[p] = -s[p];
    }
    // Offsets of the first and second element of pair group i0 within a head.
    const int64_t oa = IL ? 2 * i0 : i0, ob = IL ? 2 * i0 + 1 : half + i0;
    for (int64_t h = h_begin; h < h_end; h += U) {
      if constexpr (kOneVec) {
        Both v[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (h + u < h_end) v[u] = *reinterpret_cast<const Both*>(rows.src(h + u) + oa);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (h + u < h_end) {
            Both o = v[u];
            if (rows.rotates(h + u)) {
#pragma unroll
              for (int p = 0; p < VP; ++p) {
                const float x0 = to_f32(v[u].v[2 * p]), x1 = to_f32(v[u].v[2 * p + 1]);
                o.v[2 * p] = from_f32<T>(x0 * c[p] - x1 * s[p]);
                o.v[2 * p + 1] = from_f32<T>(x1 * c[p] + x0 * s[p]);
              }
            }
            *reinterpret_cast<Both*>(rows.dst(h + u) + oa) = o;
          }
        }
      } else {
        Half va[U], vb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (h + u < h_end) {
            const T* src = rows.src(h + u);
            va[u] = *reinterpret_cast<const Half*>(src + oa);
            vb[u] = *reinterpret_cast<const Half*>(src + ob);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          if (h + u < h_end) {
            Half oa_v = va[u], ob_v = vb[u];
            if (rows.rotates(h + u)) {
#pragma unroll
              for (int p = 0; p < VP; ++p) {
                const float x1 = to_f32(va[u].v[p]), x2 = to_f32(vb[u].v[p]);
                oa_v.v[p] = from_f32<T>(x1 * c[p] - x2 * s[p]);
                ob_v.v[p] = from_f32<T>(x2 * c[p] + x1 * s[p]);
              }
            }
            T* dst = rows.dst(h + u);
            *reinterpret_cast<Half*>(dst + oa) = oa_v;
            *reinterpret_cast<Half*>(dst + ob) = ob_v;
          }
        }
      }
    }
  }
  if (a.rotary_dim < d && (L != Layout::Plain || a.x != a.y)) {
    for (int64_t h = h_begin; h < h_end; ++h) {
      const T* src = rows.src(h);
      T* dst = rows.dst(h);
      for (int64_t j = a.rotary_dim + gi; j < d; j += groups) dst[j] = src[j];
    }
  }
}

template <class T, int VP, bool IL, Layout L>
void launch(const Job& a, cudaStream_t s) {
  const RopeTuning& tu = a.tuning;
  const int64_t half = a.rotary_dim / 2;
  int64_t groups = (half + VP - 1) / VP;
  if (groups > 256) groups = 256;
  if (groups < 1) groups = 1;
  int block = tu.threads < 32 ? 32 : tu.threads > 1024 ? 1024 : tu.threads;
  const int tpb = int(block / groups) < 1 ? 1 : int(block / groups);
  const int threads = tpb * int(groups);
  const int64_t blocks = (a.tokens + tpb - 1) / tpb;
  int64_t chunk = tu.head_chunk > 0 && tu.head_chunk < a.heads ? tu.head_chunk : a.heads;
  if ((a.heads + chunk - 1) / chunk > 65535) chunk = (a.heads + 65534) / 65535;
  const dim3 grid(unsigned(blocks), unsigned((a.heads + chunk - 1) / chunk));
  dispatch_unroll(tu.unroll, [&](auto u) {
    rope_kernel<T, VP, IL, decltype(u)::value, L><<<grid, threads, 0, s>>>(a, int(groups), chunk);
  });
  MC_CUDA_CHECK_LAUNCH();
}

// Picks the vector width: 16-byte accesses where every row start is 16-byte aligned and the pairs fill
// whole vectors, else one pair (or element pair) per access.
template <Layout L>
void run(DType dt, const Job& a, bool aligned_ptrs, int device, void* stream) {
  if (a.tokens == 0 || a.heads == 0) return;
  cuda_impl::DeviceGuard guard(device);
  cudaStream_t s = as_stream(stream);
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec16<T>;
    const bool aligned = aligned_ptrs && a.head_dim % V == 0;
    if (!a.interleaved) {
      if (aligned && (a.rotary_dim / 2) % V == 0) launch<T, V, false, L>(a, s);
      else launch<T, 1, false, L>(a, s);
    } else {
      if (aligned && a.rotary_dim % V == 0) launch<T, V / 2, true, L>(a, s);
      else launch<T, 1, true, L>(a, s);
    }
  });
}

}  // namespace

void rope(DType dt, const RopeArgs& a, int device, void* stream) {
  Job j;
  static_cast<RopeCommon&>(j) = a;
  j.x = a.x;
  j.y = a.y;
  j.heads = a.heads;
  j.backward = a.backward;
  run<Layout::Plain>(dt, j, aligned16(a.x) && aligned16(a.y), device, stream);
}

void qkv_rope(DType dt, const QkvRopeArgs& a, int device, void* stream) {
  Job j;
  static_cast<RopeCommon&>(j) = a;
  j.qkv = a.qkv;
  j.q = a.q;
  j.k = a.k;
  j.v = a.v;
  j.groups = int(a.groups);
  j.hpg = int(a.hpg);
  j.heads = a.groups * (a.hpg + 2);
  j.backward = a.merge;
  const bool aligned = aligned16(a.qkv) && aligned16(a.q) && aligned16(a.k) && aligned16(a.v);
  if (a.merge) run<Layout::Merge>(dt, j, aligned, device, stream);
  else run<Layout::Split>(dt, j, aligned, device, stream);
}

}  // namespace megacore::ops::cuda
