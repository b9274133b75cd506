// Argument checks shared by the memory-bound ops (norms, RoPE, activations, cross-entropy, embedding,
// dropout, optimizer kernels, casts).
//
// Every op validates all of its arguments before it launches anything, so a bad call throws
// ValueError naming the argument, what was expected and how to fix it, and never runs half-way.
#pragma once

#include <algorithm>
#include <string_view>

#include "megacore/core/tensor.hpp"

namespace megacore::ops::detail {

/// The stream to launch on for tensors on device d: a host Stream means the device's legacy default
/// stream; a CUDA stream must be on d.
inline void* launch_stream(const Stream& s, Device d, std::string_view op) {
  if (s.device().is_cpu()) return nullptr;
  MC_CHECK(s.device() == d, "{}: the stream is on {} but the tensors are on {}; pass a stream of {}", op,
           s.device().str(), d.str(), d.str());
  return s.native();
}

inline void check_defined(const Tensor& t, std::string_view op, std::string_view name) {
  MC_CHECK(t.defined(), "{}: {} is undefined; allocate it (Tensor::empty) before the call", op, name);
}

/// Defined, contiguous and of a floating dtype (f32, bf16, f16).
inline void check_float_input(const Tensor& t, std::string_view op, std::string_view name) {
  check_defined(t, op, name);
  MC_CHECK(is_floating(t.dtype()), "{}: {} has dtype {}; it must be f32, bf16 or f16", op, name, dtype_name(t.dtype()));
  MC_CHECK(t.is_contiguous(), "{}: {} {} is not contiguous; call .contiguous() first", op, name, shape_str(t.shape()));
}

inline void check_dtype(const Tensor& t, DType want, std::string_view op, std::string_view name) {
  check_defined(t, op, name);
  MC_CHECK(t.dtype() == want, "{}: {} has dtype {}, expected {}; convert it with .to(DType::...)", op, name,
           dtype_name(t.dtype()), dtype_name(want));
}

inline void check_contiguous(const Tensor& t, std::string_view op, std::string_view name) {
  MC_CHECK(t.is_contiguous(), "{}: {} {} is not contiguous; call .contiguous() first", op, name, shape_str(t.shape()));
}

inline void check_shape(const Tensor& t, const Shape& want, std::string_view op, std::string_view name) {
  check_defined(t, op, name);
  MC_CHECK(t.shape() == want, "{}: {} has shape {}, expected {}", op, name, shape_str(t.shape()), shape_str(want));
}

inline void check_numel(const Tensor& t, int64_t want, std::string_view op, std::string_view name) {
  check_defined(t, op, name);
  MC_CHECK(t.numel() == want, "{}: {} has {} elements (shape {}), expected {}", op, name, t.numel(),
           shape_str(t.shape()), want);
}

inline void check_same_device(const Tensor& t, Device d, std::string_view op, std::string_view name) {
  MC_CHECK(t.device() == d, "{}: {} is on {} but the other tensors are on {}; move it with .to(Device)", op, name,
           t.device().str(), d.str());
}

/// Whether two tensors' element ranges share any byte (dense views: [data, data + numel · itemsize)), for the ops
/// whose outputs must not alias an input.
inline bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto* pa = static_cast<const char*>(a.data_ptr());
  const auto* pb = static_cast<const char*>(b.data_ptr());
  const int64_t na = a.numel() * dtype_size(a.dtype()), nb = b.numel() * dtype_size(b.dtype());
  return pa < pb + nb && pb < pa + na;
}

/// Integer index tensors (token ids, labels, positions) are i32 or i64.
inline void check_index_input(const Tensor& t, std::string_view op, std::string_view name) {
  check_defined(t, op, name);
  MC_CHECK(t.dtype() == DType::I32 || t.dtype() == DType::I64, "{}: {} has dtype {}; it must be i32 or i64", op, name,
           dtype_name(t.dtype()));
  check_contiguous(t, op, name);
}

/// Number of rows when the last dimension is the feature dimension.
inline int64_t leading_rows(const Tensor& t) { return t.dim() == 0 ? 1 : t.numel() / std::max<int64_t>(t.size(-1), 1); }

}  // namespace megacore::ops::detail
