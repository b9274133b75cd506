// Helpers shared by the CPU references of the memory-bound ops: element loads/stores through double,
// and the DType dispatch of the public entry points.
#pragma once

#include <type_traits>

#include "megacore/core/dtype.hpp"
#include "megacore/core/error.hpp"

namespace megacore::ops::cpu {

template <class T>
inline double ld(T v) {
  if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>) return double(float(v));
  else return double(v);
}

/// Rounds once to T's precision (16-bit types go through f32, as the GPU kernels do).
template <class T>
inline T st(double v) {
  if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>) return T(float(v));
  else return T(v);
}

/// Value as the kernels see it after storing in T (used where a stored intermediate is re-read).
template <class T>
inline double round_to(double v) { return ld(st<T>(v)); }

template <class F>
void dispatch_float(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: f(float{}); break;
    case DType::BF16: f(bfloat16{}); break;
    case DType::F16: f(float16{}); break;
    default: raise<ValueError>("internal: dtype {} is not a floating type", dtype_name(dt));
  }
}

template <class F>
void dispatch_index(DType dt, F&& f) {
  switch (dt) {
    case DType::I32: f(int32_t{}); break;
    case DType::I64: f(int64_t{}); break;
    default: raise<ValueError>("internal: dtype {} is not an index type", dtype_name(dt));
  }
}

/// f(T{}, L{}) for a floating dtype `ft` and an index dtype `it` (e.g. logits and their labels).
template <class F>
void dispatch_float_index(DType ft, DType it, F&& f) {
  dispatch_float(ft, [&](auto t) { dispatch_index(it, [&](auto i) { f(t, i); }); });
}

}  // namespace megacore::ops::cpu
