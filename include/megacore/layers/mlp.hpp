// The transformer MLP block: ColumnParallelLinear fc1 → activation → RowParallelLinear fc2
// (input_is_parallel), with explicit forward and backward.
//
//   SwiGLU (Llama):  fc1: h → 2·ffn as [gate | up] per rank, y = fc2(silu(gate) · up)
//   GELU (GPT-2):    fc1: h → ffn, y = fc2(gelu_tanh(fc1(x)))
//
// Under sequence parallelism the input is this rank's sequence chunk [s/TP, b, h]; fc1 all-gathers it
// and fc2 reduce-scatters its output back to [s/TP, b, h]. Without SP input and output are replicated.
//
// SwiGLU layout: rank r's fc1 shard is [gate rows of rank r ; up rows of rank r] ([2·ffn/TP, h]) so
// that the elementwise SwiGLU needs no communication. The full gate and up weights are drawn
// separately with Philox (offsets init_offset and init_offset + 1), so the model does not depend on
// TP; fc2's full weight uses init_offset + 2 (GELU's fc1 uses init_offset). A model gives each MLP
// its own range of 3 offsets.
#pragma once

#include <cstdint>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/activation_stash.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/linear.hpp"
#include "megacore/layers/parameter.hpp"
#include "megacore/layers/layer_types.hpp"

namespace megacore::layers {

struct MLPOptions {
  ActivationType activation = ActivationType::SwiGLU;
  bool bias = false;  ///< biases on fc1 and fc2 (GPT-2 style)
  bool sequence_parallel = false;
  DType params_dtype = DType::F32;
  Device device = Device::cpu();
  double init_std = 0.02;
  /// Std of fc2's weight (Megatron scales it by 1/sqrt(2·layers)); < 0 means init_std.
  double output_init_std = -1.0;
  uint64_t seed = 1234;
  /// First of the three Philox offsets this block uses (see the header comment).
  uint64_t init_offset = 0;
};

/// Philox offsets used by an MLP built with init_offset = base: gate (or GELU fc1), up, fc2.
constexpr uint64_t kMLPInitOffsets = 3;

class MLP {
 public:
  /// `tp` must outlive the block. Throws ValueError naming the fix when ffn_hidden_size is not
  /// divisible by TP or a size is not positive.
  MLP(comm::Communicator& tp, int64_t hidden_size, int64_t ffn_hidden_size, const MLPOptions& options = {});

  /// x: [s, ..., h] replicated, or [s/TP, ..., h] with sequence_parallel. Returns the same layout.
  Tensor forward(const ForwardContext& ctx, const Tensor& x);
  /// dy: gradient of forward's output. Accumulates fc1/fc2 main grads and returns dx (x's layout).
  Tensor backward(const ForwardContext& ctx, const Tensor& dy);

  /// Moves the saved state of the last forward into `s` (the block (fc1 and fc2 included) is left with nothing saved) /
  /// back from `s`, in a fixed order; see activation_stash.hpp.
  void stash_activations(ActivationStash& s);
  void restore_activations(ActivationStash& s);

  ColumnParallelLinear& fc1() { return fc1_; }
  RowParallelLinear& fc2() { return fc2_; }
  std::vector<Parameter*> parameters();
  void zero_grad();
  int64_t hidden_size() const { return hidden_; }
  int64_t ffn_hidden_size() const { return ffn_; }
  const MLPOptions& options() const { return opts_; }

 private:
  comm::Communicator& tp_;
  int64_t hidden_, ffn_;
  MLPOptions opts_;
  ColumnParallelLinear fc1_;
  RowParallelLinear fc2_;
  Tensor saved_fc1_out_;  // activation input, for its backward
};

}  // namespace megacore::layers
