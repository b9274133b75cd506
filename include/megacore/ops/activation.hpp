// Elementwise activations for the MLP block: GELU (erf and tanh forms), SiLU and SwiGLU, forward and
// backward, on f32/bf16/f16 tensors with f32 arithmetic (CPU reference: f64).
#pragma once

#include <cstdint>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

enum class Activation {
  GeluErf,   ///< x/2 (1 + erf(x / sqrt 2)), torch's gelu(approximate="none")
  GeluTanh,  ///< x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's gelu_new
  Silu,      ///< x sigmoid(x)
};

/// y = act(x); y has x's shape and dtype and may be x.
void activation_forward(Activation act, const Tensor& x, Tensor& y, const Stream& s = {});
/// dx = dy * act'(x); dx may be dy.
void activation_backward(Activation act, const Tensor& dy, const Tensor& x, Tensor& dx, const Stream& s = {});

inline void gelu_forward(const Tensor& x, Tensor& y, bool tanh_approx = false, const Stream& s = {}) {
  activation_forward(tanh_approx ? Activation::GeluTanh : Activation::GeluErf, x, y, s);
}
inline void gelu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, bool tanh_approx = false,
                          const Stream& s = {}) {
  activation_backward(tanh_approx ? Activation::GeluTanh : Activation::GeluErf, dy, x, dx, s);
}
inline void silu_forward(const Tensor& x, Tensor& y, const Stream& s = {}) {
  activation_forward(Activation::Silu, x, y, s);
}
inline void silu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, const Stream& s = {}) {
  activation_backward(Activation::Silu, dy, x, dx, s);
}

/// SwiGLU on the fused fc1 output: x is [..., 2F] holding [gate | up] (Megatron's layout), y is
/// [..., F] = silu(gate) * up.
void swiglu_forward(const Tensor& x, Tensor& y, const Stream& s = {});
/// dx [..., 2F] = [dy * up * silu'(gate) | dy * silu(gate)].
void swiglu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, const Stream& s = {});

namespace ref {
/// Float64 references: forward writes act(x) to out; backward writes dy * act'(x).
void activation_f64(Activation act, bool backward, const double* x, const double* dy, double* out, int64_t n);
/// x is [rows, 2f], dy and forward's out [rows, f], backward's out [rows, 2f].
void swiglu_f64(bool backward, const double* x, const double* dy, double* out, int64_t rows, int64_t f);
}  // namespace ref

}  // namespace megacore::ops
