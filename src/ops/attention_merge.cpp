#include "megacore/ops/attention_merge.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "megacore/build_config.hpp"
#include "megacore/core/dtype.hpp"
#include "megacore/core/error.hpp"
#include "megacore/ops/ops_common.hpp"
#include "ops/cuda/attention_merge_cuda.hpp"

namespace megacore::ops {
namespace {

// Defined, contiguous and on `dev` (the first operand's device).
void check_operand(const Tensor& t, Device dev, std::string_view op, std::string_view name) {
  detail::check_defined(t, op, name);
  detail::check_same_device(t, dev, op, name);
  MC_CHECK(t.is_contiguous(), "{}: {} must be contiguous; pass a .contiguous() copy", op, name);
}

// Reads element i of a float tensor of any of the floating dtypes as float.
template <class F>
void with_float_reader(const Tensor& t, std::string_view op, F&& f) {
  switch (t.dtype()) {
    case DType::F32: {
      const float* p = t.data<float>();
      f([p](int64_t i) { return p[i]; });
      return;
    }
    case DType::BF16: {
      const auto* p = t.data<bfloat16>();
      f([p](int64_t i) { return float(p[i]); });
      return;
    }
    case DType::F16: {
      const auto* p = t.data<float16>();
      f([p](int64_t i) { return float(p[i]); });
      return;
    }
    default:
      throw ValueError(fmt::format("{}: dtype {} is not a floating dtype; pass f32, bf16 or f16", op,
                                   dtype_name(t.dtype())));
  }
}

}  // namespace

void attention_merge_partial(Tensor& out, Tensor& lse, const Tensor& out_part, const Tensor& lse_part,
                             int64_t seq_offset, const Stream& s) {
  constexpr std::string_view op = "attention_merge_partial";
  detail::check_defined(out, op, "out");
  const Device dev = out.device();
  check_operand(out, dev, op, "out");
  check_operand(lse, dev, op, "lse");
  check_operand(out_part, dev, op, "out_part");
  check_operand(lse_part, dev, op, "lse_part");
  MC_CHECK(out.dim() == 4 && out.dtype() == DType::F32 && lse.dtype() == DType::F32 && lse_part.dtype() == DType::F32,
           "{}: out must be f32 [S, B, H, D] and lse, lse_part f32; got out {} {}", op, dtype_name(out.dtype()),
           shape_str(out.shape()));
  const int64_t S = out.size(0), B = out.size(1), H = out.size(2), D = out.size(3);
  MC_CHECK(out_part.dim() == 4 && out_part.size(1) == B && out_part.size(2) == H && out_part.size(3) == D,
           "{}: out_part {} must be [S_p, {}, {}, {}]", op, shape_str(out_part.shape()), B, H, D);
  const int64_t Sp = out_part.size(0);
  MC_CHECK(seq_offset >= 0 && seq_offset + Sp <= S, "{}: rows [{}, {}) fall outside the accumulator's {} rows", op,
           seq_offset, seq_offset + Sp, S);
  MC_CHECK(lse.shape() == Shape({B, H, S}) && lse_part.shape() == Shape({B, H, Sp}),
           "{}: lse {} must be [{}, {}, {}] and lse_part {} [{}, {}, {}]", op, shape_str(lse.shape()), B, H, S,
           shape_str(lse_part.shape()), B, H, Sp);
  MC_CHECK(is_floating(out_part.dtype()), "{}: out_part has dtype {}; pass f32, bf16 or f16", op,
           dtype_name(out_part.dtype()));
  if (dev.is_cuda()) {
    void* stream = detail::launch_stream(s, dev, op);
#if MEGACORE_WITH_CUDA
    cuda::attention_merge_partial(out_part.dtype(), out.data<float>(), lse.data<float>(), out_part.data_ptr(),
                                  lse_part.data<float>(), S, B, H, D, Sp, seq_offset, dev.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  float* o = out.data<float>();
  float* l = lse.data<float>();
  const float* lp = lse_part.data<float>();
  with_float_reader(out_part, op, [&](auto op_at) {
    for (int64_t i = 0; i < Sp; ++i)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
          float& l1 = l[(b * H + h) * S + seq_offset + i];
          const float l2 = lp[(b * H + h) * Sp + i];
          if (l2 == -std::numeric_limits<float>::infinity()) continue;  // the partial saw no key
          float* orow = o + (((seq_offset + i) * B + b) * H + h) * D;
          const int64_t prow = ((i * B + b) * H + h) * D;
          const float m = std::max(l1, l2);
          const float w1 = std::exp(l1 - m), w2 = std::exp(l2 - m);  // l1 = −inf gives w1 = 0
          const float inv = 1.f / (w1 + w2);
          for (int64_t e = 0; e < D; ++e) orow[e] = (w1 * orow[e] + w2 * op_at(prow + e)) * inv;
          l1 = m + std::log(w1 + w2);
        }
  });
}

void accumulate_f32(Tensor& dst, const Tensor& src, const Stream& s) {
  MC_CHECK(!dst.defined() || dst.dtype() == DType::F32, "accumulate_f32: dst must be f32; got {}",
           dtype_name(dst.dtype()));
  accumulate(dst, src, s);
}

void accumulate(Tensor& dst, const Tensor& src, const Stream& s) {
  constexpr std::string_view op = "accumulate";
  detail::check_defined(dst, op, "dst");
  const Device dev = dst.device();
  check_operand(dst, dev, op, "dst");
  check_operand(src, dev, op, "src");
  MC_CHECK(is_floating(dst.dtype()) && dst.numel() == src.numel(),
           "{}: dst must be f32, bf16 or f16 with src's {} elements; got {} {}", op, src.numel(),
           dtype_name(dst.dtype()), shape_str(dst.shape()));
  MC_CHECK(is_floating(src.dtype()), "{}: src has dtype {}; pass f32, bf16 or f16", op, dtype_name(src.dtype()));
  if (dev.is_cuda()) {
    void* stream = detail::launch_stream(s, dev, op);
#if MEGACORE_WITH_CUDA
    cuda::accumulate(dst.dtype(), dst.data_ptr(), src.dtype(), src.data_ptr(), dst.numel(), dev.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  const int64_t n = dst.numel();
  with_float_reader(src, op, [&](auto at) {
    switch (dst.dtype()) {
      case DType::F32: {
        float* d = dst.data<float>();
        for (int64_t i = 0; i < n; ++i) d[i] += at(i);
        return;
      }
      case DType::BF16: {
        auto* d = dst.data<bfloat16>();
        for (int64_t i = 0; i < n; ++i) d[i] = bfloat16(float(d[i]) + at(i));
        return;
      }
      default: {
        auto* d = dst.data<float16>();
        for (int64_t i = 0; i < n; ++i) d[i] = float16(float(d[i]) + at(i));
        return;
      }
    }
  });
}

}  // namespace megacore::ops
