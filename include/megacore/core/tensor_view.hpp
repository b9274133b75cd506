// TensorView<T, Rank>: a non-owning view of a Tensor with its element type and rank fixed at compile time.
//
// A Tensor carries its dtype and shape at run time; code that knows them (a C++ trainer reading a loss
// history, a test building a reference, a user kernel launcher) checks them once when it makes the view
// and then indexes without per-access dtype dispatch. The checks are the same typed errors as the rest of
// the library (ValueError with the fix). The view holds a raw pointer: the Tensor (or another owner of
// the storage) must outlive it.
//
//   Tensor t = Tensor::zeros({4, 8});
//   TensorView<float, 2> v(t);            // ValueError if t is not f32 or not 2-D
//   v(1, 2) = 3.f;                        // strided, host memory only
//   TensorView<const float, 2> c = v;     // read-only view of the same elements
//
// T may be const-qualified (a read-only view). Element types: see core/element_traits.hpp.
#pragma once

#include <array>
#include <concepts>
#include <cstdint>
#include <string>

#include "megacore/core/element_traits.hpp"
#include "megacore/core/error.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore {

namespace detail {
/// "TensorView<float, 2>"-style name for messages.
template <class T, int Rank>
std::string tensor_view_name() {
  std::string n = std::is_const_v<T> ? "const " : "";
  switch (dtype_of_v<std::remove_cv_t<T>>) {
    case DType::F32: n += "float"; break;
    case DType::BF16: n += "bfloat16"; break;
    case DType::F16: n += "float16"; break;
    case DType::I32: n += "int32_t"; break;
    case DType::I64: n += "int64_t"; break;
    case DType::U8: n += "uint8_t"; break;
    case DType::F8E4M3: n += "float8_e4m3"; break;
    case DType::F8E5M2: n += "float8_e5m2"; break;
  }
  return fmt::format("TensorView<{}, {}>", n, Rank);
}
/// The DType enumerator's spelling ("F32", "BF16", ...), for `.to(DType::X)` in messages.
inline std::string_view dtype_enum_name(DType d) {
  switch (d) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
    case DType::F8E4M3: return "F8E4M3";
    case DType::F8E5M2: return "F8E5M2";
  }
  return "?";
}
/// C++ element type spelled for a DType ("float", "bfloat16", ...), for the fix in messages.
inline std::string_view cpp_type_name(DType d) {
  switch (d) {
    case DType::F32: return "float";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    case DType::I32: return "int32_t";
    case DType::I64: return "int64_t";
    case DType::U8: return "uint8_t";
    case DType::F8E4M3: return "float8_e4m3";
    case DType::F8E5M2: return "float8_e5m2";
  }
  return "?";
}
}  // namespace detail

/// Non-owning strided view of `Rank` dimensions of elements of type T (shape and strides in elements).
template <class T, int Rank>
class TensorView {
  static_assert(Rank >= 0, "TensorView: Rank must be >= 0");
  static_assert(TensorElement<T>,
                "TensorView<T, Rank>: T has no megacore DType. Use float, bfloat16, float16, int32_t, int64_t or "
                "uint8_t (optionally const); megacore has no f64");

 public:
  using element_type = T;
  using value_type = std::remove_cv_t<T>;
  static constexpr int rank = Rank;
  static constexpr DType dtype = dtype_of_v<value_type>;

  /// An empty view (data() is nullptr).
  TensorView() = default;

  /// Views t. Throws ValueError, naming the fix, when t is undefined, its dtype is not T's, or it does
  /// not have Rank dimensions.
  explicit TensorView(const Tensor& t) {
    // The name is formatted only on failure (MC_CHECK evaluates its arguments only then).
#define MC_TV_NAME detail::tensor_view_name<T, Rank>()
    MC_CHECK(t.defined(), "{}: the tensor is undefined; view a defined tensor", MC_TV_NAME);
    MC_CHECK(t.dtype() == dtype, "{}: the tensor has dtype {}, not {}; view it as TensorView<{}, {}> or convert it with .to(DType::{})",
             MC_TV_NAME, dtype_name(t.dtype()), dtype_name(dtype), detail::cpp_type_name(t.dtype()), Rank,
             detail::dtype_enum_name(dtype));
    MC_CHECK(t.dim() == Rank, "{}: the tensor has {} dimensions (shape {}); view it as TensorView<{}, {}> or reshape it with .view()",
             MC_TV_NAME, t.dim(), shape_str(t.shape()), detail::cpp_type_name(dtype), t.dim());
#undef MC_TV_NAME
    data_ = static_cast<T*>(t.data_ptr());
    device_ = t.device();
    for (int d = 0; d < Rank; ++d) {
      shape_[d] = t.shape()[d];
      stride_[d] = t.strides()[d];
    }
  }

  /// Views t and also requires it to live on `device` (ValueError naming where it is and how to move it).
  TensorView(const Tensor& t, Device device) : TensorView(t) {
    MC_CHECK(device_ == device, "{}: the tensor is on {} but {} was required; move it with .to(Device)",
             detail::tensor_view_name<T, Rank>(), device_.str(), device.str());
  }

  /// Views raw memory (no checks beyond a non-negative shape): for memory a Tensor does not own.
  TensorView(T* data, const std::array<int64_t, Rank>& shape, const std::array<int64_t, Rank>& stride,
             Device device = Device::cpu())
      : data_(data), shape_(shape), stride_(stride), device_(device) {
    for (int d = 0; d < Rank; ++d) MC_CHECK(shape_[d] >= 0, "TensorView: dimension {} is negative ({})", d, shape_[d]);
  }

  /// A view of T converts to a view of const T.
  template <class U>
    requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
  TensorView(const TensorView<U, Rank>& o) : data_(o.data()), shape_(o.shape()), stride_(o.stride()), device_(o.device()) {}

  T* data() const { return data_; }
  const std::array<int64_t, Rank>& shape() const { return shape_; }
  const std::array<int64_t, Rank>& stride() const { return stride_; }
  int64_t size(int d) const { return shape_[d]; }
  int64_t stride(int d) const { return stride_[d]; }
  Device device() const { return device_; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    return n;
  }
  bool is_contiguous() const {
    int64_t expect = 1;
    for (int d = Rank - 1; d >= 0; --d) {
      if (shape_[d] != 1 && stride_[d] != expect) return false;
      expect *= shape_[d];
    }
    return true;
  }

  /// Element (i0, i1, ...), unchecked like mdspan: host memory only, indices in range (use at() for checks).
  template <std::integral... I>
    requires(sizeof...(I) == Rank)
  T& operator()(I... idx) const {
    const std::array<int64_t, Rank> ix{int64_t(idx)...};
    int64_t off = 0;
    for (int d = 0; d < Rank; ++d) off += ix[d] * stride_[d];
    return data_[off];
  }

  /// Element (i0, i1, ...) with checks: ValueError for device memory or an index out of range.
  template <std::integral... I>
    requires(sizeof...(I) == Rank)
  T& at(I... idx) const {
    MC_CHECK(device_.is_cpu(), "{}: element access needs host memory but the view is on {}; copy the tensor with .to(Device::cpu())",
             detail::tensor_view_name<T, Rank>(), device_.str());
    const std::array<int64_t, Rank> ix{int64_t(idx)...};
    for (int d = 0; d < Rank; ++d)
      MC_CHECK(ix[d] >= 0 && ix[d] < shape_[d], "{}: index {} of dimension {} is outside [0, {})",
               detail::tensor_view_name<T, Rank>(), ix[d], d, shape_[d]);
    return (*this)(idx...);
  }

 private:
  T* data_ = nullptr;
  std::array<int64_t, Rank> shape_{};
  std::array<int64_t, Rank> stride_{};
  Device device_ = Device::cpu();
};

/// TensorView<T, Rank>(t), for call sites that read better with a function.
template <class T, int Rank>
TensorView<T, Rank> view_as(const Tensor& t) {
  return TensorView<T, Rank>(t);
}

}  // namespace megacore
