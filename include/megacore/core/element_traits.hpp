// Compile-time element types: which C++ types a tensor can hold, and what math on them runs in.
//
// dtype_of<T> (core/dtype.hpp) maps float, bfloat16, float16, int32_t, int64_t and uint8_t to their
// DType. The typed API (TensorView, comm's typed collectives, the typed layers) is written against the
// concept below, so an unsupported T is a compile error at the call, not a runtime dtype mismatch.
#pragma once

#include <type_traits>

#include "megacore/core/dtype.hpp"

namespace megacore {

/// A C++ type that is some DType's element type (cv-qualifiers ignored). megacore has no f64 DType,
/// so double is not one.
template <class T>
concept TensorElement = requires { dtype_of<std::remove_cv_t<T>>::value; };

/// A floating TensorElement (float, bfloat16, float16): what layer parameters may be.
template <class T>
concept FloatElement = TensorElement<T> && is_floating(dtype_of<std::remove_cv_t<T>>::value);

/// The type elementwise math on T runs in: float for the 16-bit floats (as megacore's kernels do),
/// T itself otherwise.
template <class T> struct compute_type { using type = std::remove_cv_t<T>; };
template <> struct compute_type<bfloat16> { using type = float; };
template <> struct compute_type<float16> { using type = float; };
template <> struct compute_type<const bfloat16> { using type = float; };
template <> struct compute_type<const float16> { using type = float; };
template <class T> using compute_type_t = typename compute_type<T>::type;

/// The DType of T. For a T without one, a static_assert naming the supported types; the compiler's
/// instantiation trace names the typed call that asked.
template <class T>
consteval DType element_dtype() {
  static_assert(TensorElement<T>,
                "megacore: this element type has no DType. Use float, megacore::bfloat16, megacore::float16, "
                "int32_t, int64_t or uint8_t (megacore has no f64: hold doubles as float, or as int64_t fixed point)");
  if constexpr (TensorElement<T>) return dtype_of<std::remove_cv_t<T>>::value;
  else return DType::F32;
}

}  // namespace megacore
