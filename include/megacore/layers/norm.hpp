// RMSNorm and LayerNorm layers over the last dimension, with explicit forward and backward and an
// optional fused residual add (pre-norm blocks: h = x + residual; y = norm(h)).
//
// Parameters are replicated over TP (partition_dim -1): weight [h] (ones) and, for LayerNorm with
// bias, bias [h] (zeros). Under sequence parallelism each TP rank normalises only its sequence chunk
// [s/TP, b, h], so its weight/bias gradient is a partial sum; the Parameters are then flagged
// sequence_parallel and layers::allreduce_sequence_parallel_grads completes them once per step.
//
// Saved activations: the normalised input (x, or h when fused) and the f32 per-row statistics. One
// forward is held at a time; the caller must not modify x in place before backward.
#pragma once

#include <cstdint>
#include <vector>

#include "megacore/core/tensor.hpp"
#include "megacore/layers/activation_stash.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/parameter.hpp"

namespace megacore::layers {

struct NormOptions {
  double eps = 1e-5;
  /// Inputs are sequence chunks: flags the Parameters sequence_parallel (see the header comment).
  bool sequence_parallel = false;
  /// LayerNorm only: add a bias (GPT-2 has one). RMSNorm has no bias and ignores this.
  bool bias = true;
  DType params_dtype = DType::F32;
  Device device = Device::cpu();
};

/// Output of a fused residual forward.
struct NormResidualOutput {
  Tensor y;             ///< norm(x + residual) * weight (+ bias)
  Tensor residual_out;  ///< x + residual: the next residual stream
};

/// Common implementation; use RMSNorm or LayerNorm.
class NormLayer {
 public:
  virtual ~NormLayer() = default;  // held as NormLayer by models that pick the type at run time
  /// x: [..., h] in the params dtype. Returns y of x's shape.
  Tensor forward(const ForwardContext& ctx, const Tensor& x);
  /// dy: gradient of forward's output. Accumulates weight (and bias) main_grad; returns dx.
  Tensor backward(const ForwardContext& ctx, const Tensor& dy);
  /// Fused pre-norm: h = x + residual, y = norm(h).
  NormResidualOutput forward_residual(const ForwardContext& ctx, const Tensor& x, const Tensor& residual);
  /// Backward of forward_residual: dy for y and dresidual_out for residual_out; returns the gradient
  /// of both x and residual (they are the same tensor).
  Tensor backward_residual(const ForwardContext& ctx, const Tensor& dy, const Tensor& dresidual_out);

  /// Moves the saved state of the last forward into `s` (the layer is left with nothing saved) /
  /// back from `s`, in a fixed order; see activation_stash.hpp.
  void stash_activations(ActivationStash& s);
  void restore_activations(ActivationStash& s);

  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }  ///< undefined without bias (and always for RMSNorm)
  bool has_bias() const { return bias_.data.defined(); }
  std::vector<Parameter*> parameters();
  void zero_grad();
  int64_t hidden_size() const { return hidden_; }
  bool is_layernorm() const { return layer_; }
  const NormOptions& options() const { return opts_; }

 protected:
  NormLayer(bool layernorm, int64_t hidden_size, const NormOptions& options);

 private:
  void check_input(const Tensor& t, std::string_view where, std::string_view what) const;
  Tensor backward_common(const ForwardContext& ctx, const Tensor& dy, const Tensor* dresidual_out);

  bool layer_;
  int64_t hidden_;
  NormOptions opts_;
  Parameter weight_, bias_;
  Tensor saved_x_, saved_mean_, saved_rstd_;
  bool saved_fused_ = false;
};

/// y = x / sqrt(mean(x²) + eps) * weight (Llama).
class RMSNorm : public NormLayer {
 public:
  /// Throws ValueError naming the fix for hidden_size <= 0 or eps <= 0.
  RMSNorm(int64_t hidden_size, const NormOptions& options = {}) : NormLayer(false, hidden_size, options) {}
};

/// y = (x - mean) / sqrt(var + eps) * weight + bias (GPT-2).
class LayerNorm : public NormLayer {
 public:
  LayerNorm(int64_t hidden_size, const NormOptions& options = {}) : NormLayer(true, hidden_size, options) {}
};

}  // namespace megacore::layers
