#include "megacore/ops/gemm_fp8.hpp"

#include "megacore/build_config.hpp"
#include "megacore/ops/fp8.hpp"
#include "megacore/ops/gemm.hpp"
#include "megacore/ops/ops_common.hpp"
#if MEGACORE_WITH_CUDA
#include "ops/cuda/gemm_cuda.hpp"
#endif

namespace megacore::ops {

bool gemm_fp8_supported(int64_t m, int64_t n, int64_t k) {
  return m > 0 && n > 0 && k > 0 && m % 16 == 0 && n % 16 == 0 && k % 16 == 0;
}

void gemm_fp8(const Tensor& a, const Tensor& b, Tensor& out, const Tensor& scale_inv_a, const Tensor& scale_inv_b,
              const GemmFp8Options& opts, const Stream& s) {
  constexpr std::string_view kOp = "gemm_fp8";
  for (auto [t, name] : {std::pair{&a, "a"}, std::pair{&b, "b"}}) {
    detail::check_defined(*t, kOp, name);
    MC_CHECK(is_fp8(t->dtype()), "{}: {} has dtype {}; it must be f8e4m3 or f8e5m2 (cast with ops::fp8_cast)", kOp,
             name, dtype_name(t->dtype()));
    MC_CHECK(t->dim() == 2 && t->is_contiguous(),
             "{}: {} must be a contiguous 2-D matrix with K as its last dimension (the TN layout FP8 kernels take), got "
             "shape {}; transpose it into a contiguous copy first",
             kOp, name, shape_str(t->shape()));
  }
  MC_CHECK(!(a.dtype() == DType::F8E5M2 && b.dtype() == DType::F8E5M2),
           "{}: a and b are both f8e5m2; FP8 kernels need at least one f8e4m3 operand", kOp);
  detail::check_defined(out, kOp, "out");
  MC_CHECK(out.dtype() == DType::BF16 || out.dtype() == DType::F32, "{}: out has dtype {}; it must be bf16 or f32",
           kOp, dtype_name(out.dtype()));
  const int64_t m = a.size(0), k = a.size(1), n = b.size(0);
  MC_CHECK(b.size(1) == k, "{}: a is [{}, {}] and b is [{}, {}]; both must have K = {} columns (out = a bᵀ)", kOp, m,
           k, b.size(0), b.size(1), k);
  detail::check_shape(out, Shape{m, n}, kOp, "out");
  detail::check_contiguous(out, kOp, "out");
  MC_CHECK(gemm_fp8_supported(m, n, k),
           "{}: M = {}, N = {}, K = {}; FP8 GEMMs need every dimension a positive multiple of 16 (run this product "
           "in bf16 instead)",
           kOp, m, n, k);
  const Device dev = a.device();
  detail::check_same_device(b, dev, kOp, "b");
  detail::check_same_device(out, dev, kOp, "out");
  for (auto [t, name] : {std::pair{&scale_inv_a, "scale_inv_a"}, std::pair{&scale_inv_b, "scale_inv_b"}}) {
    detail::check_dtype(*t, DType::F32, kOp, name);
    MC_CHECK(t->numel() == 1, "{}: {} must hold one element, got shape {}", kOp, name, shape_str(t->shape()));
    detail::check_same_device(*t, dev, kOp, name);
  }

  if (dev.is_cpu()) {
    // The emulation: exact decode, f32 product of the decoded values, the scales applied to the sum.
    const float alpha = *static_cast<const float*>(scale_inv_a.data_ptr()) *
                        *static_cast<const float*>(scale_inv_b.data_ptr());
    const Tensor a32 = a.to(DType::F32), b32 = b.to(DType::F32);
    GemmOptions o;
    o.trans_b = true;
    o.alpha = alpha;
    o.beta = opts.beta;
    if (out.dtype() == DType::F32) {
      gemm(a32, b32, out, o, s);
    } else {
      Tensor acc = opts.beta != 0.f ? out.to(DType::F32) : Tensor::empty({m, n}, DType::F32, dev);
      gemm(a32, b32, acc, o, s);
      out.copy_(acc);
    }
    return;
  }
#if MEGACORE_WITH_CUDA
  cuda::GemmFp8Problem p;
  p.a_dtype = a.dtype(), p.b_dtype = b.dtype(), p.out_dtype = out.dtype();
  p.m = m, p.n = n, p.k = k;
  p.a = a.data_ptr(), p.lda = k;
  p.b = b.data_ptr(), p.ldb = k;
  p.c = out.data_ptr(), p.ldc = n;
  p.scale_inv_a = static_cast<const float*>(scale_inv_a.data_ptr());
  p.scale_inv_b = static_cast<const float*>(scale_inv_b.data_ptr());
  p.beta = opts.beta;
  p.fast_accum = opts.fast_accum;
  p.sm_margin = gemm_sm_margin(dev.index);
  // The bf16 products' policy (GemmAutotune): products that overwrite their output are timed once per shape.
  const double gflop = 2.0 * double(m) * double(n) * double(k) * 1e-9;
  p.autotune_candidates = opts.beta == 0.f ? gemm_autotune().candidates_for(gflop) : 0;
  cuda::gemm_fp8(p, dev.index, detail::launch_stream(s, dev, kOp));
#else
  raise<CudaError>("{}: tensors are on {} but megacore was built without CUDA", kOp, dev.str());
#endif
}

}  // namespace megacore::ops
