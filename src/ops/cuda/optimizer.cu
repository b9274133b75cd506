// Multi-tensor kernels: every launch carries a table of up to kMaxTensors tensors and kMaxBlocks
// (tensor, chunk) pairs in its (large, sm_70+ / CUDA 12.1+) parameter block, so one launch updates many parameters without a
// device-side metadata copy. A block processes one chunk of kChunk elements with 16-byte accesses
// when the chunk's pointers allow it.
#include <array>

#include "ops/cuda/memops_common.cuh"
#include "ops/cuda/multi_tensor_pack.hpp"
#include "ops/cuda/optimizer_cuda.hpp"

namespace megacore::ops::cuda {
namespace {

// Hopper with CUDA >= 12.1 takes up to 32 KiB of kernel parameters (Meta<5> here: 25 KiB); a launch of up to
// 4096 chunks fills the GPU about eight times over (528 resident blocks on an H100/H200), so the partly filled
// last wave of each launch is a small part of it (apex's 320 chunks, sized for the old 4 KiB limit, left SMs idle).
constexpr int kMaxTensors = 96;
constexpr int kMaxBlocks = 4096;
constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;

template <int NP>
struct Meta {
  static_assert(kMaxTensors <= 256, "tensor indices are bytes");
  void* p[NP][kMaxTensors];
  int64_t n[kMaxTensors];
  uint8_t tensor[kMaxBlocks];
  int32_t chunk[kMaxBlocks];
};

static_assert(sizeof(Meta<5>) + sizeof(AdamWArgs) <= 32764, "kernel parameters above the 32 KiB CUDA 12.1+ limit");

/// Packs the tensors into launches of at most kMaxTensors tensors and kMaxBlocks chunks each.
template <int NP, class Launch>
void for_each_launch(const std::vector<std::array<void*, NP>>& ptrs, const std::vector<int64_t>& n, Launch&& launch) {
  Meta<NP> m{};
  pack_launches<NP, kMaxTensors, kMaxBlocks, kChunk>(m, ptrs, n, launch);
}

// W: the weights updated in place (f32 masters, or the bf16 parameters themselves); M, V: the moments' storage.
// Everything is computed in f32; bf16 stores round to nearest even (no stochastic rounding, as torch's bf16
// AdamW state does).
template <class G, class P, class W, class M, class V>
__global__ void __launch_bounds__(kThreads) adamw_kernel(Meta<5> m, AdamWArgs a) {
  const int t = m.tensor[blockIdx.x];
  const int64_t base = int64_t(m.chunk[blockIdx.x]) * kChunk;
  const int64_t len = min(kChunk, m.n[t] - base);
  const G* g = static_cast<const G*>(m.p[0][t]) + base;
  W* w = static_cast<W*>(m.p[1][t]) + base;
  M* m1 = static_cast<M*>(m.p[2][t]) + base;
  V* m2 = static_cast<V*>(m.p[3][t]) + base;
  P* po = static_cast<P*>(m.p[4][t]);
  if (po) po += base;
  const float gs = a.grad_scale * (a.grad_scale_ptr ? *a.grad_scale_ptr : 1.f);
  const float step = a.lr / a.bias_corr1, bc2s = sqrtf(a.bias_corr2), decay = 1.f - a.lr * a.weight_decay;
  auto update = [&](float gv, float& wv, float& mv, float& vv) {
    gv *= gs;
    wv *= decay;
    mv = a.beta1 * mv + (1.f - a.beta1) * gv;
    vv = a.beta2 * vv + (1.f - a.beta2) * gv * gv;
    wv -= step * mv / (sqrtf(vv) / bc2s + a.eps);
  };
  auto al = [](const void* p, int bytes) { return (reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes)) == 0; };
  const bool vec = al(w, 4 * sizeof(W)) && al(m1, 4 * sizeof(M)) && al(m2, 4 * sizeof(V)) && al(g, 4 * sizeof(G)) &&
                   (!po || al(po, 4 * sizeof(P)));
  int64_t i0 = 0;
  if (vec) {
    const int64_t nv = len / 4;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      float gv[4], wv[4], mv[4], vv[4];
      load_f32_stream<G, 4>(g + 4 * i, gv);
      load_f32_stream<W, 4>(w + 4 * i, wv);
      load_f32_stream<M, 4>(m1 + 4 * i, mv);
      load_f32_stream<V, 4>(m2 + 4 * i, vv);
#pragma unroll
      for (int k = 0; k < 4; ++k) update(gv[k], wv[k], mv[k], vv[k]);
      store_f32_stream<W, 4>(w + 4 * i, wv);
      store_f32_stream<M, 4>(m1 + 4 * i, mv);
      store_f32_stream<V, 4>(m2 + 4 * i, vv);
      if (po) store_f32_stream<P, 4>(po + 4 * i, wv);
    }
    i0 = nv * 4;
  }
  for (int64_t i = i0 + threadIdx.x; i < len; i += blockDim.x) {
    float wv = to_f32(w[i]), mv = to_f32(m1[i]), vv = to_f32(m2[i]);
    update(to_f32(g[i]), wv, mv, vv);
    w[i] = from_f32<W>(wv);
    m1[i] = from_f32<M>(mv);
    m2[i] = from_f32<V>(vv);
    if (po) po[i] = from_f32<P>(wv);
  }
}

template <class G, class P>
__global__ void __launch_bounds__(kThreads) sgd_kernel(Meta<4> m, SGDArgs a) {
  const int t = m.tensor[blockIdx.x];
  const int64_t base = int64_t(m.chunk[blockIdx.x]) * kChunk;
  const int64_t len = min(kChunk, m.n[t] - base);
  const G* g = static_cast<const G*>(m.p[0][t]) + base;
  float* w = static_cast<float*>(m.p[1][t]) + base;
  float* buf = static_cast<float*>(m.p[2][t]);
  if (buf) buf += base;
  P* po = static_cast<P*>(m.p[3][t]);
  if (po) po += base;
  const float gs = a.grad_scale * (a.grad_scale_ptr ? *a.grad_scale_ptr : 1.f);
  const float mu = a.momentum, damp = 1.f - a.dampening;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    float wv = w[i];
    float d = to_f32(g[i]) * gs + a.weight_decay * wv;
    if (buf) {
      const float b = a.first_step ? d : mu * buf[i] + damp * d;
      buf[i] = b;
      d = a.nesterov ? d + mu * b : b;
    }
    wv -= a.lr * d;
    w[i] = wv;
    if (po) po[i] = from_f32<P>(wv);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) l2norm_kernel(Meta<1> m, float* partial) {
  __shared__ float red[32];
  const int t = m.tensor[blockIdx.x];
  const int64_t base = int64_t(m.chunk[blockIdx.x]) * kChunk;
  const int64_t len = min(kChunk, m.n[t] - base);
  const T* x = static_cast<const T*>(m.p[0][t]) + base;
  constexpr int V = kVec16<T>;
  float acc = 0.f;
  int64_t i0 = 0;
  if (aligned16(x)) {
    const int64_t nv = len / V;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      float v[V];
      load_f32_stream<T, V>(x + V * i, v);
#pragma unroll
      for (int k = 0; k < V; ++k) acc += v[k] * v[k];
    }
    i0 = nv * V;
  }
  for (int64_t i = i0 + threadIdx.x; i < len; i += blockDim.x) {
    const float v = to_f32(x[i]);
    acc += v * v;
  }
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void l2norm_finalize(const float* partial, int64_t n, float* out) {
  __shared__ float red[32];
  float acc = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc, red);
  if (threadIdx.x == 0) *out = sqrtf(acc);
}

template <class S, class D>
__global__ void __launch_bounds__(kThreads) scale_kernel(Meta<2> m, float scale, const float* scale_ptr) {
  const int t = m.tensor[blockIdx.x];
  const int64_t base = int64_t(m.chunk[blockIdx.x]) * kChunk;
  const int64_t len = min(kChunk, m.n[t] - base);
  const S* x = static_cast<const S*>(m.p[0][t]) + base;
  D* y = static_cast<D*>(m.p[1][t]) + base;
  const float sc = scale * (scale_ptr ? *scale_ptr : 1.f);
  constexpr int V = 8;  // 16 bytes of the 16-bit side
  int64_t i0 = 0;
  if ((reinterpret_cast<uintptr_t>(x) % (V * sizeof(S))) == 0 && (reinterpret_cast<uintptr_t>(y) % (V * sizeof(D))) == 0) {
    const int64_t nv = len / V;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
      float v[V], h[4];
      if constexpr (sizeof(S) == 4) {
        load_f32_stream<S, 4>(x + V * i, h);
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = h[k];
        load_f32_stream<S, 4>(x + V * i + 4, h);
#pragma unroll
        for (int k = 0; k < 4; ++k) v[4 + k] = h[k];
      } else {
        load_f32_stream<S, V>(x + V * i, v);
      }
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] *= sc;
      if constexpr (sizeof(D) == 4) {
#pragma unroll
        for (int k = 0; k < 4; ++k) h[k] = v[k];
        store_f32_stream<D, 4>(y + V * i, h);
#pragma unroll
        for (int k = 0; k < 4; ++k) h[k] = v[4 + k];
        store_f32_stream<D, 4>(y + V * i + 4, h);
      } else {
        store_f32_stream<D, V>(y + V * i, v);
      }
    }
    i0 = nv * V;
  }
  for (int64_t i = i0 + threadIdx.x; i < len; i += blockDim.x) y[i] = from_f32<D>(to_f32(x[i]) * sc);
}

__global__ void clip_kernel(const float* norm, float max_norm, float* coef) {
  *coef = fminf(1.f, max_norm / (*norm + 1e-6f));
}

}  // namespace

void adamw(const AdamWDTypes& dt, const std::vector<std::vector<void*>>& ptrs, const std::vector<int64_t>& n,
           const AdamWArgs& a, int device, void* stream) {
  cuda_impl::DeviceGuard guard(device);
  cudaStream_t s = as_stream(stream);
  std::vector<std::array<void*, 5>> p(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i)
    for (int k = 0; k < 5; ++k) p[i][k] = ptrs[i][size_t(k)];
  auto go = [&](auto gtag, auto ptag, auto wtag, auto mtag, auto vtag) {
    for_each_launch<5>(p, n, [&](const Meta<5>& m, int blocks) {
      adamw_kernel<decltype(gtag), decltype(ptag), decltype(wtag), decltype(mtag), decltype(vtag)>
          <<<unsigned(blocks), kThreads, 0, s>>>(m, a);
      MC_CUDA_CHECK_LAUNCH();
    });
  };
  auto f32_or_bf16 = [](DType t, auto&& f) {
    if (t == DType::BF16) f(bfloat16{});
    else f(float{});
  };
  f32_or_bf16(dt.grad, [&](auto gtag) {
    f32_or_bf16(dt.exp_avg, [&](auto mtag) {
      f32_or_bf16(dt.exp_avg_sq, [&](auto vtag) {
        if (dt.master == DType::BF16) {  // the bf16 parameters themselves: no param_out
          go(gtag, bfloat16{}, bfloat16{}, mtag, vtag);
          return;
        }
        switch (dt.param) {
          case DType::BF16: go(gtag, bfloat16{}, float{}, mtag, vtag); break;
          case DType::F16: go(gtag, float16{}, float{}, mtag, vtag); break;
          default: go(gtag, float{}, float{}, mtag, vtag); break;  // f32 params_out, or none
        }
      });
    });
  });
}

void sgd(DType grad_dt, DType param_dt, const std::vector<std::vector<void*>>& ptrs, const std::vector<int64_t>& n,
         const SGDArgs& a, int device, void* stream) {
  cuda_impl::DeviceGuard guard(device);
  cudaStream_t s = as_stream(stream);
  std::vector<std::array<void*, 4>> p(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i)
    for (int k = 0; k < 4; ++k) p[i][k] = ptrs[i][size_t(k)];
  auto go = [&](auto gtag, auto ptag) {
    using G = decltype(gtag);
    using P = decltype(ptag);
    for_each_launch<4>(p, n, [&](const Meta<4>& m, int blocks) {
      sgd_kernel<G, P><<<unsigned(blocks), kThreads, 0, s>>>(m, a);
      MC_CUDA_CHECK_LAUNCH();
    });
  };
  auto with_param = [&](auto gtag) {
    switch (param_dt) {
      case DType::BF16: go(gtag, bfloat16{}); break;
      case DType::F16: go(gtag, float16{}); break;
      default: go(gtag, float{}); break;
    }
  };
  if (grad_dt == DType::BF16) with_param(bfloat16{});
  else with_param(float{});
}

size_t l2norm_workspace_bytes(const std::vector<int64_t>& n) {
  int64_t chunks = 0;
  for (int64_t k : n) chunks += (k + kChunk - 1) / kChunk;
  return size_t(chunks + 1) * sizeof(float);
}

void l2norm(DType dt, const std::vector<const void*>& ptrs, const std::vector<int64_t>& n, float* out,
            void* workspace, int device, void* stream) {
  cuda_impl::DeviceGuard guard(device);
  cudaStream_t s = as_stream(stream);
  float* partial = static_cast<float*>(workspace);
  std::vector<std::array<void*, 1>> p(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) p[i][0] = const_cast<void*>(ptrs[i]);
  int64_t done = 0;
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    for_each_launch<1>(p, n, [&](const Meta<1>& m, int blocks) {
      l2norm_kernel<T><<<unsigned(blocks), kThreads, 0, s>>>(m, partial + done);
      MC_CUDA_CHECK_LAUNCH();
      done += blocks;
    });
  });
  l2norm_finalize<<<1, 1024, 0, s>>>(partial, done, out);
  MC_CUDA_CHECK_LAUNCH();
}

void scale(DType src_dt, DType dst_dt, const std::vector<const void*>& src, const std::vector<void*>& dst,
           const std::vector<int64_t>& n, float sc, const float* scale_ptr, int device, void* stream) {
  cuda_impl::DeviceGuard guard(device);
  cudaStream_t s = as_stream(stream);
  std::vector<std::array<void*, 2>> p(src.size());
  for (size_t i = 0; i < src.size(); ++i) p[i] = {const_cast<void*>(src[i]), dst[i]};
  dispatch_float(src_dt, [&](auto stag) {
    dispatch_float(dst_dt, [&](auto dtag) {
      using S = decltype(stag);
      using D = decltype(dtag);
      for_each_launch<2>(p, n, [&](const Meta<2>& m, int blocks) {
        scale_kernel<S, D><<<unsigned(blocks), kThreads, 0, s>>>(m, sc, scale_ptr);
        MC_CUDA_CHECK_LAUNCH();
      });
    });
  });
}

void clip_coefficient(const float* norm, float max_norm, float* coef, int device, void* stream) {
  cuda_impl::DeviceGuard guard(device);
  clip_kernel<<<1, 1, 0, as_stream(stream)>>>(norm, max_norm, coef);
  MC_CUDA_CHECK_LAUNCH();
}

}  // namespace megacore::ops::cuda
