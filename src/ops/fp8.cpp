#include "megacore/ops/fp8.hpp"

#include <algorithm>
#include <initializer_list>
#include <utility>

#include "megacore/build_config.hpp"
#include "megacore/ops/ops_common.hpp"
#include "ops/fp8_math.hpp"
#if MEGACORE_WITH_CUDA
#include "ops/cuda/fp8_cuda.hpp"
#endif

namespace megacore::ops {
namespace {

void check_scalar_f32(const Tensor& t, Device d, std::string_view op, std::string_view name) {
  detail::check_dtype(t, DType::F32, op, name);
  MC_CHECK(t.numel() == 1, "{}: {} must hold one element (a per-tensor scale or amax), got shape {}", op, name,
           shape_str(t.shape()));
  detail::check_same_device(t, d, op, name);
}

void check_fp8(const Tensor& t, std::string_view op, std::string_view name) {
  detail::check_defined(t, op, name);
  MC_CHECK(is_fp8(t.dtype()), "{}: {} has dtype {}; it must be f8e4m3 or f8e5m2", op, name, dtype_name(t.dtype()));
  detail::check_contiguous(t, op, name);
}

#if !MEGACORE_WITH_CUDA
[[noreturn]] void no_cuda(std::string_view op, Device d) {
  raise<CudaError>("{}: tensors are on {} but megacore was built without CUDA", op, d.str());
}
#endif

// The optional amax / counts outputs of the casts.
void check_amax_counts(const Tensor& amax, const Tensor& counts, Device dev, std::string_view op) {
  if (amax.defined()) check_scalar_f32(amax, dev, op, "amax");
  if (counts.defined()) {
    detail::check_dtype(counts, DType::I64, op, "counts");
    MC_CHECK(counts.numel() == 2 && counts.is_contiguous(),
             "{}: counts must be a contiguous i64 tensor of 2 elements (saturated, flushed to zero), got shape {}", op,
             shape_str(counts.shape()));
    detail::check_same_device(counts, dev, op, "counts");
  }
}

void add_counts(const Tensor& counts, int64_t over, int64_t under) {
  if (!counts.defined()) return;
  auto* c = static_cast<int64_t*>(counts.data_ptr());
  c[0] += over;
  c[1] += under;
}

template <class F>
void dispatch_fp8(DType dt, F&& f) {
  if (dt == DType::F8E4M3) f(float8_e4m3{});
  else f(float8_e5m2{});
}

template <class T>
float max_abs_cpu(const T* x, int64_t n, float start) {
  uint32_t m = fp8_math::abs_bits(start);
  for (int64_t i = 0; i < n; ++i) m = std::max(m, fp8_math::abs_bits(float(x[i])));
  return bits_f32(m);
}

// The CPU casts of x read as [rows, cols]: the codes go to `out` (row-major) and / or `out_t` (transposed),
// either may be null; amax and counts as fp8_cast's.
void cast_cpu(const Tensor& x, const Tensor& scale, int64_t rows, int64_t cols, DType q_dt, uint8_t* out,
              uint8_t* out_t, const Tensor& amax, const Tensor& counts) {
  const float sc = *static_cast<const float*>(scale.data_ptr());
  int64_t over = 0, under = 0;
  dispatch_dtype(x.dtype(), [&](auto xtag) {
    using T = decltype(xtag);
    if constexpr (is_floating(dtype_of_v<T>)) {
      const T* xp = static_cast<const T*>(x.data_ptr());
      dispatch_fp8(q_dt, [&](auto qtag) {
        using Q = decltype(qtag);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < cols; ++j) {
            bool o = false, u = false;
            const uint8_t q = fp8_math::quantize<Q>(float(xp[i * cols + j]), sc, o, u);
            if (out) out[i * cols + j] = q;
            if (out_t) out_t[j * rows + i] = q;
            over += o;
            under += u;
          }
      });
      if (amax.defined()) {
        auto* a = static_cast<float*>(amax.data_ptr());
        *a = max_abs_cpu(xp, rows * cols, *a);
      }
    }
  });
  add_counts(counts, over, under);
}

}  // namespace

void fp8_cast(const Tensor& x, const Tensor& scale, Tensor& out, const Tensor& amax, const Tensor& counts,
              const Stream& s) {
  constexpr std::string_view kOp = "fp8_cast";
  detail::check_float_input(x, kOp, "x");
  const Device dev = x.device();
  check_scalar_f32(scale, dev, kOp, "scale");
  check_fp8(out, kOp, "out");
  detail::check_shape(out, x.shape(), kOp, "out");
  detail::check_same_device(out, dev, kOp, "out");
  check_amax_counts(amax, counts, dev, kOp);
  const int64_t n = x.numel();
  if (dev.is_cpu()) {
    cast_cpu(x, scale, 1, n, out.dtype(), static_cast<uint8_t*>(out.data_ptr()), nullptr, amax, counts);
    return;
  }
#if MEGACORE_WITH_CUDA
  void* stream = detail::launch_stream(s, dev, kOp);
  cuda::fp8_cast(x.dtype(), x.data_ptr(), n, static_cast<const float*>(scale.data_ptr()), out.dtype(), out.data_ptr(),
                 amax.defined() ? static_cast<float*>(amax.data_ptr()) : nullptr,
                 counts.defined() ? static_cast<int64_t*>(counts.data_ptr()) : nullptr, dev.index, stream);
#else
  (void)s;
  no_cuda(kOp, dev);
#endif
}

void fp8_cast_transpose(const Tensor& x, const Tensor& scale, const Tensor& out, const Tensor& out_t,
                        const Tensor& amax, const Tensor& counts, const Stream& s) {
  constexpr std::string_view kOp = "fp8_cast_transpose";
  detail::check_float_input(x, kOp, "x");
  MC_CHECK(x.dim() == 2, "{}: x must be a 2-D matrix [rows, cols], got shape {}; view it as rows first", kOp,
           shape_str(x.shape()));
  const Device dev = x.device();
  const int64_t rows = x.size(0), cols = x.size(1);
  check_scalar_f32(scale, dev, kOp, "scale");
  check_fp8(out_t, kOp, "out_t");
  detail::check_shape(out_t, Shape{cols, rows}, kOp, "out_t");
  detail::check_same_device(out_t, dev, kOp, "out_t");
  if (out.defined()) {
    check_fp8(out, kOp, "out");
    detail::check_shape(out, x.shape(), kOp, "out");
    detail::check_same_device(out, dev, kOp, "out");
    MC_CHECK(out.dtype() == out_t.dtype(), "{}: out is {} but out_t is {}; give both the same FP8 dtype", kOp,
             dtype_name(out.dtype()), dtype_name(out_t.dtype()));
  }
  check_amax_counts(amax, counts, dev, kOp);
  if (dev.is_cpu()) {
    cast_cpu(x, scale, rows, cols, out_t.dtype(), out.defined() ? static_cast<uint8_t*>(out.data_ptr()) : nullptr,
             static_cast<uint8_t*>(out_t.data_ptr()), amax, counts);
    return;
  }
#if MEGACORE_WITH_CUDA
  cuda::fp8_cast_transpose(x.dtype(), x.data_ptr(), rows, cols, static_cast<const float*>(scale.data_ptr()),
                           out_t.dtype(), out.defined() ? out.data_ptr() : nullptr, out_t.data_ptr(),
                           amax.defined() ? static_cast<float*>(amax.data_ptr()) : nullptr,
                           counts.defined() ? static_cast<int64_t*>(counts.data_ptr()) : nullptr, dev.index,
                           detail::launch_stream(s, dev, kOp));
#else
  (void)s;
  no_cuda(kOp, dev);
#endif
}

void fp8_amax(const Tensor& x, const Tensor& amax, const Stream& s) {
  constexpr std::string_view kOp = "fp8_amax";
  detail::check_float_input(x, kOp, "x");
  const Device dev = x.device();
  check_scalar_f32(amax, dev, kOp, "amax");
  if (dev.is_cpu()) {
    dispatch_dtype(x.dtype(), [&](auto tag) {
      using T = decltype(tag);
      if constexpr (is_floating(dtype_of_v<T>)) {
        auto* a = static_cast<float*>(amax.data_ptr());
        *a = max_abs_cpu(static_cast<const T*>(x.data_ptr()), x.numel(), *a);
      }
    });
    return;
  }
#if MEGACORE_WITH_CUDA
  cuda::fp8_amax(x.dtype(), x.data_ptr(), x.numel(), static_cast<float*>(amax.data_ptr()), dev.index,
                 detail::launch_stream(s, dev, kOp));
#else
  (void)s;
  no_cuda(kOp, dev);
#endif
}

void fp8_dequant(const Tensor& q, const Tensor& scale_inv, Tensor& out, const Stream& s) {
  constexpr std::string_view kOp = "fp8_dequant";
  check_fp8(q, kOp, "q");
  const Device dev = q.device();
  check_scalar_f32(scale_inv, dev, kOp, "scale_inv");
  detail::check_float_input(out, kOp, "out");
  detail::check_shape(out, q.shape(), kOp, "out");
  detail::check_same_device(out, dev, kOp, "out");
  if (dev.is_cpu()) {
    const float si = *static_cast<const float*>(scale_inv.data_ptr());
    const auto* qp = static_cast<const uint8_t*>(q.data_ptr());
    dispatch_dtype(out.dtype(), [&](auto otag) {
      using T = decltype(otag);
      if constexpr (is_floating(dtype_of_v<T>)) {
        T* op = static_cast<T*>(out.data_ptr());
        dispatch_fp8(q.dtype(), [&](auto qtag) {
          using Q = decltype(qtag);
          for (int64_t i = 0; i < q.numel(); ++i) op[i] = T(Q::to_float(qp[i]) * si);
        });
      }
    });
    return;
  }
#if MEGACORE_WITH_CUDA
  cuda::fp8_dequant(q.dtype(), q.data_ptr(), q.numel(), static_cast<const float*>(scale_inv.data_ptr()), out.dtype(),
                    out.data_ptr(), dev.index, detail::launch_stream(s, dev, kOp));
#else
  (void)s;
  no_cuda(kOp, dev);
#endif
}

namespace {
// The scale updates' per-tensor f32 [n] vectors on one device, and the margin's range.
void check_scale_vectors(std::string_view op, int64_t n, Device dev, int margin,
                         std::initializer_list<std::pair<const Tensor*, const char*>> vectors) {
  for (auto [t, name] : vectors) {
    detail::check_dtype(*t, DType::F32, op, name);
    detail::check_contiguous(*t, op, name);
    detail::check_numel(*t, n, op, name);
    detail::check_same_device(*t, dev, op, name);
  }
  MC_CHECK(margin >= -64 && margin <= 64, "{}: margin {} is out of range; use a small non-negative integer (0)", op,
           margin);
}
}  // namespace

void fp8_update_scales(const Tensor& history, const Tensor& scale, const Tensor& scale_inv, const Tensor& fp8_max,
                       Fp8AmaxAlgo algo, int margin, bool roll, const Stream& s) {
  constexpr std::string_view kOp = "fp8_update_scales";
  detail::check_dtype(history, DType::F32, kOp, "history");
  detail::check_contiguous(history, kOp, "history");
  MC_CHECK(history.dim() == 2 && history.size(0) >= 1,
           "{}: history must be f32 [L, n] (L >= 1 steps of n tensors' amaxes), got shape {}", kOp,
           shape_str(history.shape()));
  const int64_t len = history.size(0), n = history.size(1);
  const Device dev = history.device();
  check_scale_vectors(kOp, n, dev, margin, {{&scale, "scale"}, {&scale_inv, "scale_inv"}, {&fp8_max, "fp8_max"}});
  const bool amax_max = algo == Fp8AmaxAlgo::Max;
  if (dev.is_cpu()) {
    auto* h = static_cast<float*>(history.data_ptr());
    auto* sc = static_cast<float*>(scale.data_ptr());
    auto* si = static_cast<float*>(scale_inv.data_ptr());
    const auto* mx = static_cast<const float*>(fp8_max.data_ptr());
    for (int64_t j = 0; j < n; ++j)
      fp8_math::update_column(h + j, len, n, sc + j, si + j, mx[j], amax_max, margin, roll);
    return;
  }
#if MEGACORE_WITH_CUDA
  cuda::fp8_update_scales(static_cast<float*>(history.data_ptr()), len, n, static_cast<float*>(scale.data_ptr()),
                          static_cast<float*>(scale_inv.data_ptr()), static_cast<const float*>(fp8_max.data_ptr()),
                          amax_max, margin, roll, dev.index, detail::launch_stream(s, dev, kOp));
#else
  (void)s;
  no_cuda(kOp, dev);
#endif
}

void fp8_seed_scales(const Tensor& amax, const Tensor& seeded, const Tensor& scale, const Tensor& scale_inv,
                     const Tensor& fp8_max, int margin, const Stream& s) {
  constexpr std::string_view kOp = "fp8_seed_scales";
  detail::check_dtype(amax, DType::F32, kOp, "amax");
  detail::check_contiguous(amax, kOp, "amax");
  const int64_t n = amax.numel();
  const Device dev = amax.device();
  check_scale_vectors(kOp, n, dev, margin,
                      {{&seeded, "seeded"}, {&scale, "scale"}, {&scale_inv, "scale_inv"}, {&fp8_max, "fp8_max"}});
  if (dev.is_cpu()) {
    const auto* a = static_cast<const float*>(amax.data_ptr());
    auto* sd = static_cast<float*>(seeded.data_ptr());
    auto* sc = static_cast<float*>(scale.data_ptr());
    auto* si = static_cast<float*>(scale_inv.data_ptr());
    const auto* mx = static_cast<const float*>(fp8_max.data_ptr());
    for (int64_t j = 0; j < n; ++j) fp8_math::seed_column(a[j], sd + j, sc + j, si + j, mx[j], margin);
    return;
  }
#if MEGACORE_WITH_CUDA
  cuda::fp8_seed_scales(static_cast<const float*>(amax.data_ptr()), n, static_cast<float*>(seeded.data_ptr()),
                        static_cast<float*>(scale.data_ptr()), static_cast<float*>(scale_inv.data_ptr()),
                        static_cast<const float*>(fp8_max.data_ptr()), margin, dev.index,
                        detail::launch_stream(s, dev, kOp));
#else
  (void)s;
  no_cuda(kOp, dev);
#endif
}

}  // namespace megacore::ops
