// The activation functions and their derivatives, shared by the CPU reference (F = double) and the
// CUDA kernels (F = float), so both evaluate the same formulas.
#pragma once

#include <math.h>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::actmath {

/// Mirrors ops::Activation (activation.hpp pulls in C++20 headers that nvcc's C++17 does not take);
/// activation.cpp checks that the values agree.
enum class Act : int { GeluErf = 0, GeluTanh = 1, Silu = 2 };

MC_HOST_DEVICE float m_erfc(float x) { return erfcf(x); }
MC_HOST_DEVICE double m_erfc(double x) { return erfc(x); }
MC_HOST_DEVICE double m_exp(double x) { return exp(x); }
MC_HOST_DEVICE double m_inv1p(double e) { return 1.0 / (1.0 + e); }
// The kernels' f32 (the device pass): ex2.approx-based exp (relative error ~2^-21) and a
// reciprocal-based divide instead of expf and an IEEE divide (about 30 instructions a value between
// them); the error stays far below the f32 tests' 2e-5. The host pass (the f32 CPU paths) keeps expf
// and the IEEE divide.
MC_HOST_DEVICE float m_exp(float x) {
#ifdef __CUDA_ARCH__
  return __expf(x);
#else
  return expf(x);
#endif
}
MC_HOST_DEVICE float m_inv1p(float e) {  // 1 / (1 + e); e = +inf gives 0
#ifdef __CUDA_ARCH__
  return __fdividef(1.f, 1.f + e);
#else
  return 1.f / (1.f + e);
#endif
}

template <class F>
MC_HOST_DEVICE F sigmoid(F x) { return m_inv1p(m_exp(-x)); }

// Written without 1 + erf(x) and 1 + tanh(u), which cancel to a few correct bits for negative x:
// 1 + erf(x / sqrt 2) = erfc(-x / sqrt 2) and (1 + tanh u) / 2 = sigmoid(2u).
template <class F>
MC_HOST_DEVICE F forward(Act act, F x) {
  switch (act) {
    case Act::GeluErf: return F(0.5) * x * m_erfc(x * F(-0.70710678118654752440));
    case Act::GeluTanh: {
      const F u = F(0.79788456080286535588) * (x + F(0.044715) * x * x * x);
      return x * sigmoid(F(2) * u);
    }
    case Act::Silu: return x * sigmoid(x);
  }
  return x;
}

template <class F>
MC_HOST_DEVICE F derivative(Act act, F x) {
  switch (act) {
    case Act::GeluErf:
      return F(0.5) * m_erfc(x * F(-0.70710678118654752440)) + x * F(0.39894228040143267794) * m_exp(F(-0.5) * x * x);
    case Act::GeluTanh: {
      const F u = F(0.79788456080286535588) * (x + F(0.044715) * x * x * x);
      const F s = sigmoid(F(2) * u);
      // d/dx [x s(2u)] = s + x * 2 s (1 - s) * du/dx
      return s + F(2) * x * s * (F(1) - s) * F(0.79788456080286535588) * (F(1) + F(3 * 0.044715) * x * x);
    }
    case Act::Silu: {
      const F s = sigmoid(x);
      return s * (F(1) + x * (F(1) - s));
    }
  }
  return F(1);
}

}  // namespace megacore::ops::actmath
