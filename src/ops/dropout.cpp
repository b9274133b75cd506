#include "megacore/ops/dropout.hpp"

#include "megacore/build_config.hpp"
#include "megacore/ops/ops_common.hpp"
#include "ops/cuda/dropout_cuda.hpp"
#include "ops/dropout_math.hpp"
#include "ops/memops_cpu.hpp"

namespace megacore::ops {
namespace {

void dropout_impl(const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t offset, const Stream& s, Tensor* mask,
                  const char* op, const char* xn, const char* yn) {
  detail::check_float_input(x, op, xn);
  detail::check_defined(y, op, yn);
  MC_CHECK(y.dtype() == x.dtype(), "{}: {} has dtype {} but {} has {}", op, yn, dtype_name(y.dtype()), xn,
           dtype_name(x.dtype()));
  detail::check_shape(y, x.shape(), op, yn);
  detail::check_contiguous(y, op, yn);
  detail::check_same_device(y, x.device(), op, yn);
  MC_CHECK(p >= 0.f && p < 1.f, "{}: p must be in [0, 1), got {}", op, p);
  if (mask) {
    detail::check_dtype(*mask, DType::U8, op, "mask");
    detail::check_shape(*mask, x.shape(), op, "mask");
    detail::check_contiguous(*mask, op, "mask");
    detail::check_same_device(*mask, x.device(), op, "mask");
  }
  const uint32_t thr = dropmath::threshold(p);
  const float scale = 1.f / (1.f - p);
  const int64_t n = x.numel();
  if (x.device().is_cuda()) {
    void* stream = detail::launch_stream(s, x.device(), op);
#if MEGACORE_WITH_CUDA
    cuda::dropout(x.dtype(), x.data_ptr(), y.data_ptr(), mask ? mask->data<uint8_t>() : nullptr, n, thr, scale, seed,
                  offset, x.device().index, stream);
#else
    (void)stream;
#endif
    return;
  }
  cpu::dispatch_float(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    uint8_t* mp = mask ? mask->data<uint8_t>() : nullptr;
    for (int64_t q = 0; q < (n + 3) / 4; ++q) {
      const Philox4 w = philox_words(seed, offset, uint64_t(q));
      for (int64_t k = 0; k < 4 && 4 * q + k < n; ++k) {
        const bool keep = dropmath::keep_word(w.v[k], thr);
        // f32 product, as on the GPU
        yp[4 * q + k] = cpu::st<T>(keep ? double(float(cpu::ld(xp[4 * q + k])) * scale) : 0.0);
        if (mp) mp[4 * q + k] = uint8_t(keep);
      }
    }
  });
}

}  // namespace

void dropout_forward(const Tensor& x, Tensor& y, float p, uint64_t seed, uint64_t offset, const Stream& s,
                     Tensor* mask) {
  dropout_impl(x, y, p, seed, offset, s, mask, "dropout_forward", "x", "y");
}

void dropout_backward(const Tensor& dy, Tensor& dx, float p, uint64_t seed, uint64_t offset, const Stream& s) {
  dropout_impl(dy, dx, p, seed, offset, s, nullptr, "dropout_backward", "dy", "dx");
}

}  // namespace megacore::ops
