// FP8 execution of a tensor-parallel linear layer (Transformer Engine's recipe on megacore's layers).
//
// With FP8 on, a linear layer runs its three GEMMs in FP8 (ops::gemm_fp8, which takes only K-contiguous
// operands, "TN"):
//   forward  y  = x Wᵀ       x → E4M3 (scale from the recipe), W → E4M3 (cast once per step, cached)
//   dgrad    dx = dy W       dy → E5M2 ("hybrid") or E4M3, times the cached transposed FP8 weight
//   wgrad    dW += dyᵀ x     dyᵀ and xᵀ as FP8 copies, f32 out accumulated into the main gradient
// The FP8 copies with the other dimension contiguous come from the same pass as the plain cast
// (ops::fp8_cast_transpose): the weight's transpose when it is cast, xᵀ in the forward (kept for backward in
// place of the bf16 input), dyᵀ with dy's cast in backward. Recipe::wgrad = false keeps the weight gradient
// in the layer's dtype. The forward product uses fast accumulation, the gradient products do not (as
// Transformer Engine).
//
// Scaling state: three tensors per layer (input, weight, output gradient), each with an amax history
// column (f32 [L, 3]), a scale and scale_inv (f32 [3]) and saturation / flush-to-zero counts (i64 [3, 2]),
// all on the layer's device. Every rank of the TP group uses the same scales: the amaxes are reduced
// (max) over the TP group before a scale is computed from them.
//   delayed: a fresh state's first cast of each tensor takes its scale from that tensor's own amax (as current
//            scaling; the initial scale of 1 would flush most gradients to zero and saturate nothing useful);
//            casts reduce |x| into history row 0; begin_step() (once per optimizer step, before the first
//            micro-batch) reduces row 0 over TP, computes the scales and rolls the history. A model
//            reduces all its layers' rows at once over the whole TP × CP × DP group of its stage
//            (fp8_begin_step over many states: one all-reduce per step), so data-parallel replicas also
//            agree on every scale.
//   current: each cast first computes the tensor's amax, reduces it over TP, derives the scale
//            (margin applied), then casts (one extra pass and one small all-reduce per cast).
// begin_step() also drops the cached FP8 weight (the optimizer has changed W). A layer used on its own
// must call it after each optimizer step; GPTModel::fp8_begin_step does it for a model.
//
// Products whose dimensions are not multiples of 16 run in the layer's dtype (the layer's features are
// checked when FP8 is enabled, the row count per call), each case reported once in the log.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/ops/fp8.hpp"

namespace megacore::layers {

enum class Fp8Scaling { None, Delayed, Current };

/// Parses none | delayed | current (ConfigError otherwise) and names it back.
Fp8Scaling fp8_scaling_from_name(std::string_view name);
std::string_view fp8_scaling_name(Fp8Scaling s);

/// The recipe (trainer.fp8* in the run config).
struct Fp8Recipe {
  Fp8Scaling scaling = Fp8Scaling::Delayed;
  int64_t amax_history_len = 1024;
  ops::Fp8AmaxAlgo amax_compute_algo = ops::Fp8AmaxAlgo::Max;
  int margin = 0;
  /// Output gradients' format: F8E5M2 (Transformer Engine's "hybrid") or F8E4M3.
  DType grad_dtype = DType::F8E5M2;
  /// Run the weight gradient in FP8 too (else in the layer's dtype from its saved input).
  bool wgrad = true;
  /// Sequence-parallel column layers keep the gathered input's transposed FP8 codes for the weight gradient
  /// instead of their bf16 chunk (no all-gather and cast of the input in backward; more memory for TP > 2).
  bool keep_gathered_input = false;
};

/// A matrix's FP8 codes and their transpose (either may be undefined when not asked for).
struct Fp8Pair {
  Tensor q, qt;
};

/// One linear layer's FP8 scaling state and weight cache.
class Fp8LinearState {
 public:
  enum Slot : int { kInput = 0, kWeight = 1, kGradOutput = 2 };
  static constexpr int kSlots = 3;

  Fp8LinearState(const Fp8Recipe& recipe, Device device);

  const Fp8Recipe& recipe() const { return recipe_; }
  /// Casts x (contiguous, f32/bf16/f16) into the slot's format with the slot's scale; the amax goes
  /// where the recipe wants it (see the header comment). Returns the FP8 tensor.
  Tensor cast(comm::Communicator& tp, int slot, const Tensor& x, const Stream& s);
  /// One pass over a matrix x [rows, cols]: the slot's codes (with `want_q`) and their transpose [cols, rows]
  /// (ops::fp8_cast_transpose). With `record` false the cast adds nothing to the slot's amax history or
  /// counters (a second cast of a tensor already cast and counted; with current scaling its amax is still
  /// computed, as the scale needs it).
  Fp8Pair cast_transpose(comm::Communicator& tp, int slot, const Tensor& x, bool want_q, bool record,
                         const Stream& s);
  /// The weight in E4M3 [rows, cols] and its transpose [cols, rows], cast on the first call of a step.
  const Tensor& weight(comm::Communicator& tp, const Tensor& w, const Stream& s);
  const Tensor& weight_t(comm::Communicator& tp, const Tensor& w, const Stream& s);
  /// The slot's scale_inv as a one-element view for ops::gemm_fp8: a copy of scale_inv()[slot] kept 16 bytes
  /// apart from the other slots' (cuBLASLt's FP8 kernels take only 16-byte aligned scale pointers), refreshed
  /// whenever the scales change.
  Tensor scale_inv(int slot) const { return gemm_scale_inv_.select(0, slot).narrow(0, 0, 1); }
  /// Start of an optimizer step: drop the FP8 weight, and with delayed scaling reduce the last step's
  /// amaxes over TP and update the scales.
  void begin_step(comm::Communicator& tp, const Stream& s);
  /// This step's amaxes (history row 0, f32 [3]: input, weight, output gradient; a view into the state).
  Tensor amax_row() const { return history_.select(0, 0); }
  /// begin_step once the caller has reduced amax_row() over a group containing the TP group.
  void begin_step_reduced(const Stream& s);

  /// The weight cast in pieces (ZeRO-1's FP8 parameter gather, optim/fp8_param_gather.hpp): each data-parallel
  /// rank casts its shard of the weight with this step's weight scale, the ranks all-gather the codes, and each
  /// takes the codes as its cached FP8 weight.
  ///   weight_amax_needed()  the weight's scale needs the full weight's amax first: current scaling, or delayed
  ///                         scaling whose weight scale has not been seeded by a cast in this process yet
  ///   set_weight_amax       `amax` (f32 [1]): the pieces' amaxes reduced (max) over a group containing the TP
  ///                         and DP ranks; sets the weight scale as the full weight's cast would
  ///   cast_weight_piece     codes of one piece x (contiguous, any shape) into `q` (F8E4M3, x's shape) with the
  ///                         weight scale; its amax and saturation counts go to the weight slot
  ///   set_weight_codes      `q` (F8E4M3, the weight's shape, contiguous; kept as a view, not copied) becomes
  ///                         this step's FP8 weight, and its transpose is built from it
  bool weight_amax_needed() const;
  void set_weight_amax(const Tensor& amax, const Stream& s);
  void cast_weight_piece(const Tensor& x, Tensor& q, const Stream& s);
  void set_weight_codes(Tensor q, const Stream& s);

  /// The scaling state: the live tensors ("amax_history" [L, 3], "scale" [3], "scale_inv" [3], "counts"
  /// [3, 2], "seeded" [3]) in the slot order input, weight, output gradient; checkpoints save and load them
  /// in place.
  std::vector<std::pair<std::string, Tensor>> state();

 private:
  void cast_weight(comm::Communicator& tp, const Tensor& w, const Stream& s);
  /// The slot's aligned GEMM copy of scale_inv (gemm_scale_inv_) from scale_inv_.
  void refresh_gemm_scale(int slot, const Stream& s);
  /// Current scaling: the slot's scale from the amax in history row 0 (agreed over the ranks sharing the tensor).
  void scale_from_row(int slot, const Stream& s);
  /// Delayed scaling: the slot's first scale from `amax` (f32 [1], agreed likewise; ops::fp8_seed_scales leaves a
  /// slot seeded already as it is).
  void seed_from(int slot, const Tensor& amax, const Stream& s);
  /// Current scaling: the slot's scale from x's own amax (reduced over TP), written into history row 0.
  void current_scale(comm::Communicator& tp, int slot, const Tensor& x, const Stream& s);
  /// Delayed scaling, the slot's first cast of a fresh state: its scale from x's own amax (reduced over TP),
  /// as current scaling would, instead of the initial 1 (ops::fp8_seed_scales; a loaded state is seeded already).
  void seed_scale(comm::Communicator& tp, int slot, const Tensor& x, const Stream& s);

  Fp8Recipe recipe_;
  Tensor history_, scale_, scale_inv_, fp8_max_, counts_;
  Tensor gemm_scale_inv_;  // [kSlots, 4] f32: scale_inv_ in column 0, one 16-byte row per slot
  Tensor seeded_;          // [kSlots] f32: 1 once a delayed slot's first scale came from its own amax
  bool seed_pending_[kSlots] = {true, true, true};  // this process has not yet checked the slot's seed
  Tensor w_fp8_, wt_fp8_;
};

/// begin_step of many layers with one collective: with delayed scaling their amax rows are packed into one
/// buffer, all-reduced (max) over `group` and unpacked, then each layer's scales are updated. `group` must
/// contain each layer's TP group (the TP × CP × DP ranks of a pipeline stage), so every rank in it ends
/// with the same scales. Every rank of `group` must pass its states in the same order (its chunks' FP8
/// linears); states with current scaling only drop their FP8 weights.
void fp8_begin_step(const std::vector<Fp8LinearState*>& states, comm::Communicator& group, const Stream& s = {});

}  // namespace megacore::layers
