// Optimizers over a model's parameters: AdamW (decoupled weight decay, via ops::multi_tensor_adamw)
// and SGD with momentum. By default both own f32 master weights — a copy of the parameters made at
// construction — and update those; the parameters (bf16, f16 or f32) receive the master weights rounded
// to their dtype after every step, so low-precision rounding never accumulates across steps.
//
// State precision (AdamW, Megatron-Core's names): main_params_dtype = BF16 keeps no master copy — the
// optimizer updates the parameters themselves in place (bf16 parameters are rounded to nearest even
// each step, as torch's AdamW on bf16 weights does; no stochastic rounding); exp_avg_dtype and
// exp_avg_sq_dtype = BF16 store the moments in bf16. The arithmetic stays f32 inside the kernel. With
// everything bf16 the state is 4 bytes per parameter instead of 12.
//
// Gradients are read from Parameter::main_grad (f32, or bf16 when the grad buffer keeps bf16 main grads). The optimizer does not reduce them over DP,
// clip them or zero them on its own: the caller (or DDP) does that, so the same optimizer serves
// plain, data-parallel and pipelined training.
//
// Weight decay is skipped for parameters the no-decay rule selects: by default 1-D tensors and names
// containing "norm" or "bias" (norm gains and biases, as in Megatron-Core and most recipes).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "megacore/core/tensor.hpp"
#include "megacore/layers/parameter.hpp"
#include "megacore/ops/optimizer.hpp"

namespace megacore::optim {

/// A tensor of optimizer state with its name ("<param name>.<kind>"), for checkpoints.
struct NamedTensor {
  std::string name;
  Tensor tensor;
};

/// True when weight decay must not apply to the parameter.
using NoDecayRule = std::function<bool(const layers::Parameter&)>;
/// The default rule: 1-D parameters and names containing "norm" or "bias".
bool default_no_decay(const layers::Parameter& p);

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
  /// Which parameters get no weight decay; empty = default_no_decay. Return false always to decay all.
  NoDecayRule no_decay;
  /// F32: f32 master weights; BF16: none, the (bf16 or f32) parameters are updated in place (f16
  /// parameters are refused: their range needs f32 masters).
  DType main_params_dtype = DType::F32;
  /// Storage of the first and second moments: F32 or BF16.
  DType exp_avg_dtype = DType::F32;
  DType exp_avg_sq_dtype = DType::F32;
};

/// ValueError unless cfg's state dtypes are F32 or BF16 (`who` names the caller).
void check_state_dtypes(const AdamWConfig& cfg, const char* who);

/// The kernel's hyper-parameters for one AdamW step of a group (decaying or not), shared by AdamW and the
/// ZeRO-1 DistributedOptimizer so both apply the same update.
ops::AdamWHyper adamw_hyper(const AdamWConfig& cfg, float lr, bool decay, int64_t step, float grad_scale);

struct SGDConfig {
  float momentum = 0.9f;
  float dampening = 0.f;
  bool nesterov = false;
  /// L2 penalty added to the gradient (coupled, as torch.optim.SGD does).
  float weight_decay = 0.f;
  NoDecayRule no_decay;
};

/// Common interface: step, state for checkpoints, and the parameters' gradient buffers.
class Optimizer {
 public:
  /// `params` must outlive the optimizer; each appears once (ValueError naming the duplicate), has a
  /// contiguous data tensor and an f32 or bf16 main_grad of the same shape on the same device. With
  /// separate_masters false the master weights are the parameters themselves (no copy).
  explicit Optimizer(std::vector<layers::Parameter*> params, bool separate_masters = true);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// One update with learning rate `lr`. Gradients are multiplied by grad_scale (and, when given, by
  /// the f32 [1] device tensor grad_scale_tensor — a clip coefficient or 1/loss-scale that stays on the
  /// device) before use; main_grad itself is left unchanged.
  virtual void step(float lr, float grad_scale = 1.f, const Tensor& grad_scale_tensor = {}) = 0;
  /// Zeroes every parameter's main_grad.
  void zero_grad();

  /// Number of steps taken (AdamW's bias correction uses it).
  int64_t step_count() const { return step_; }
  /// All state tensors, named "<param>.master", "<param>.exp_avg", ... (views of the live state: copy
  /// them to save; without separate masters "<param>.master" is the parameter itself). The step count is
  /// separate (step_count()).
  virtual std::vector<NamedTensor> state() const = 0;
  /// Restores state produced by state() of an optimizer over the same parameters (names, shapes and
  /// kinds must match exactly; ValueError naming the first difference; dtypes may differ: each tensor is
  /// converted, so a run can resume with another state precision), sets the step count and writes the
  /// restored master weights into the parameters.
  void load_state(const std::vector<NamedTensor>& state, int64_t step_count);

  const std::vector<layers::Parameter*>& parameters() const { return params_; }
  /// Whether weight decay applies to parameters()[i].
  bool decays(size_t i) const { return decay_[i]; }
  const Tensor& master(size_t i) const { return master_[i]; }
  /// Whether the master weights are copies (false: they are the parameters' own data).
  bool separate_masters() const { return separate_masters_; }
  /// Bytes of optimizer state: every state() tensor that is not a parameter's own data, at its dtype.
  int64_t state_bytes() const;

 protected:
  void init_decay(const NoDecayRule& rule);
  /// Copies the master weights into the parameters (rounded to their dtype).
  void write_back();

  std::vector<layers::Parameter*> params_;
  std::vector<Tensor> master_;  // f32 copies of the parameters, or the parameters' data (no separate masters)
  bool separate_masters_ = true;
  std::vector<bool> decay_;
  int64_t step_ = 0;
};

/// AdamW (Loshchilov & Hutter): w ← w − lr·(m̂ / (sqrt(v̂) + eps) + wd·w), bias-corrected moments.
class AdamW : public Optimizer {
 public:
  AdamW(std::vector<layers::Parameter*> params, const AdamWConfig& cfg = {});
  void step(float lr, float grad_scale = 1.f, const Tensor& grad_scale_tensor = {}) override;
  std::vector<NamedTensor> state() const override;
  const AdamWConfig& config() const { return cfg_; }
  const Tensor& exp_avg(size_t i) const { return exp_avg_[i]; }
  const Tensor& exp_avg_sq(size_t i) const { return exp_avg_sq_[i]; }

 private:
  AdamWConfig cfg_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
};

/// SGD with momentum (torch.optim.SGD semantics: g ← g + wd·w; buf ← μ·buf + (1 − dampening)·g, buf = g
/// on the first step; w ← w − lr·(nesterov ? g + μ·buf : buf)), via ops::multi_tensor_sgd on CPU and CUDA.
class SGD : public Optimizer {
 public:
  SGD(std::vector<layers::Parameter*> params, const SGDConfig& cfg = {});
  void step(float lr, float grad_scale = 1.f, const Tensor& grad_scale_tensor = {}) override;
  std::vector<NamedTensor> state() const override;
  const SGDConfig& config() const { return cfg_; }
  const Tensor& momentum_buffer(size_t i) const { return momentum_[i]; }

 private:
  SGDConfig cfg_;
  std::vector<Tensor> momentum_;
};

}  // namespace megacore::optim
