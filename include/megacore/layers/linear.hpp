// Tensor-parallel linear layers (Megatron-Core's ColumnParallelLinear / RowParallelLinear), with
// explicit forward and backward.
//
// Weights are [out, in] as in PyTorch/Megatron (y = x W^T + b). A column-parallel layer splits W's
// rows (the output features) over TP; a row-parallel layer splits W's columns (the input features).
// The usual pairing is column → (elementwise) → row, which needs one collective per direction:
//
//   without SP:  x (replicated) → copy_to_tp → col → [..., out/TP] → row → reduce_from_tp → y (replicated)
//   with SP:     x [s/TP, ...] → all_gather_from_sp → col → row → reduce_scatter_to_sp → y [s/TP, ...]
//
// Activations are [..., features] with the sequence in dim 0 ([s, b, h]); every dimension but the
// last is flattened into rows for the GEMMs. Gradients accumulate in f32 `main_grad` (gemm beta = 1).
//
// Saved activations: forward keeps a handle to its input (with SP, only this rank's sequence chunk,
// re-gathered in backward as Megatron-Core does, trading an all-gather for s·b·h·(TP−1)/TP of memory).
// One forward is held at a time: backward consumes it. The caller must not modify x in place between
// forward and backward.
//
// Overlapped gradient communication (ColumnParallelLinearOptions::overlap_grad_comm, Megatron-Core's
// async grad all-reduce / reduce-scatter): the TP collective of the input gradient runs while the
// weight-gradient GEMM computes. backward then does, without SP:
//   dX = dY W  →  start all-reduce(dX)  →  dW += dYᵀ X (+ bias grad)  →  wait
// and with SP (the saved input is this rank's sequence chunk):
//   start all-gather(X chunk)  →  dX = dY W  →  wait  →  start reduce-scatter(dX)  →  dW += dYᵀ X  →  wait
// The operations and their operands are exactly those of the non-overlapped path, so the results are
// bit-identical (tested on CPU for TP 2/4 with and without SP through the GPT model). On CUDA each
// collective runs on the layer's own communication stream: an event recorded on the compute stream
// after the producer (and the output buffer's allocation) makes the comm stream wait, the collective is
// launched there, and before the result is used the compute stream waits for the comm stream. The
// host-side Work::wait() (which blocks on NCCL) is called only after the overlapped GEMM is enqueued.
// The option defaults to OFF: the CUDA path compiles but has not yet been run on a GPU. On the CPU the
// communicator's own asynchrony (if any) provides the overlap.
//
// Overlapped sequence-parallel forward (overlap_sp_forward on either layer, set for a model's SP linears by
// TransformerConfig::tp_comm_overlap_forward): the SP all-gather before a column-parallel GEMM and the
// reduce-scatter after a row-parallel GEMM are split into TP steps over the ring, each step's send/recv
// (Communicator::batch_send_recv to rank r + 1, from rank r − 1) running while a row slice of the GEMM computes.
// Rows are in chunks of m = (s/TP)·b, chunk c being rank c's sequence chunk.
//   column: at step i rank r multiplies the chunk it holds, rank (r − i) mod TP's, into output rows
//           [((r − i) mod TP)·m, +m) while that chunk moves on to r + 1 and the next arrives from r − 1.
//           Every output row is the serial GEMM's row (same operands, K unsplit): identical wherever the GEMM
//           sums K in the same order for m rows as for TP·m (tested on CPU through the GPT model).
//   row:    at step i rank r computes the partial product of chunk (r − i − 1) mod TP, adds the partial sum
//           of that chunk received from r − 1 (ops::accumulate: f32 add, rounded to the dtype) and sends it
//           to r + 1; at the last step the chunk is its own and the sum complete. The partials are added in
//           ring order (rank c + 1, c + 2, ..., c), not the collective's: same result at TP 2, within
//           round-off otherwise. Two partial and two receive buffers of [m, out] alternate.
// On CUDA the exchanges run on the layer's communication stream (comm_stream_priority) and the compute
// stream waits for each one (an event, no host wait) only before it uses what arrived; the buffers' stream
// marks are withdrawn as in the backward overlap. The saved input and the backward are those of the serial
// layer. With FP8 or a LoRA adapter the forward stays serial (logged once).
//
// Initialisation: every rank draws the FULL weight with Philox from (seed, init_offset) and keeps its
// slice, so the model is the same whatever the TP degree. This costs out·in random draws and one
// full-size temporary per layer on every rank — fine for tests and models up to a few billion
// parameters; Philox's counter design allows drawing only the shard's elements if that ever matters.
// Biases start at zero.
//
// LoRA and frozen weights (layers/lora.hpp): attach_lora adds a low-rank path to the layer's GEMM, run on
// the same input rows and added before the layer's TP reduction; where it can, the adapter fuses with the
// base GEMM (the weight then lives in the adapter's [W ; A] buffer, weight().data viewing its rows).
// set_frozen(true) skips the weight and bias gradients (the dW GEMM and its main_grad buffer) while still
// returning the input gradient. With LoRA or frozen weights the non-overlapped backward is used
// (overlap_grad_comm is ignored). Both layers share this part (ParallelLinearBase).
//
// FP8 (layers/fp8.hpp): enable_fp8 runs the forward, input-gradient and (Fp8Recipe::wgrad) weight-gradient
// GEMMs in FP8 with per-tensor scales agreed over the TP group. The forward then keeps its input's
// transposed FP8 codes (half the bytes of bf16) for the weight gradient instead of the input itself,
// except the sequence-parallel column layer, which keeps its bf16 sequence chunk (re-gathered and cast
// again in backward). With FP8 on, the non-overlapped backward is used, and a LoRA adapter keeps the
// layer in its own dtype.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/activation_stash.hpp"
#include "megacore/layers/fp8.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/lora.hpp"
#include "megacore/layers/parameter.hpp"

namespace megacore::layers {

struct ColumnParallelLinearOptions {
  bool bias = true;
  /// All-gather the output features so every rank gets [..., out] (else [..., out/TP]).
  bool gather_output = false;
  /// Input is this rank's sequence chunk [s/TP, ...]; it is all-gathered along dim 0 before the GEMM.
  bool sequence_parallel = false;
  DType params_dtype = DType::F32;
  Device device = Device::cpu();
  double init_std = 0.02;
  uint64_t seed = 1234;
  /// Philox offset of the full weight's draw: give each layer of a model its own.
  uint64_t init_offset = 0;
  /// Overlap the input-gradient collective (all-reduce, or reduce-scatter with SP) and, with SP, the
  /// re-gather of the saved input, with the backward GEMMs (see the header comment). Same results;
  /// default off because the CUDA path (separate comm stream + events) is not yet validated on a GPU.
  bool overlap_grad_comm = false;
  /// With sequence_parallel and TP > 1: the input all-gather runs as a ring of TP steps, each overlapping the
  /// GEMM of the chunk already here (see the header comment). Same results as off.
  bool overlap_sp_forward = false;
  /// CUDA priority of the communication stream of overlap_grad_comm and overlap_sp_forward (0 = normal;
  /// negative = higher, clamped by CUDA to the device's range): a higher one gets the collective's kernels
  /// onto SMs ahead of the GEMM they overlap when both become ready at once. Same results.
  int comm_stream_priority = 0;
};

struct RowParallelLinearOptions {
  bool bias = true;
  /// Input is already split along its last dimension ([..., in/TP], e.g. a column-parallel output);
  /// otherwise it is [..., in] and this rank keeps its slice.
  bool input_is_parallel = false;
  /// Output is reduce-scattered along dim 0 ([s/TP, ..., out]) instead of all-reduced.
  bool sequence_parallel = false;
  DType params_dtype = DType::F32;
  Device device = Device::cpu();
  double init_std = 0.02;
  uint64_t seed = 1234;
  uint64_t init_offset = 0;
  /// With sequence_parallel and TP > 1: the output reduce-scatter runs as a ring of TP steps, each step's
  /// exchange overlapping the next chunk's GEMM (see the header comment). Partial sums are added in ring
  /// order: equal at TP 2, within round-off of the collective otherwise.
  bool overlap_sp_forward = false;
  /// CUDA priority of the communication stream of overlap_sp_forward (see ColumnParallelLinearOptions).
  int comm_stream_priority = 0;
};

/// The full [out, in] weight every TP degree slices: normal(0, std) from Philox (seed, offset), drawn
/// in f32 and rounded to `dtype`. Tests use it to build the single-rank reference.
Tensor init_full_weight(int64_t out_features, int64_t in_features, double std, uint64_t seed, uint64_t offset,
                        DType dtype = DType::F32, Device device = Device::cpu(), const Stream& s = {});

/// What both parallel linear layers share: the weight and bias parameters, the saved input, an attached
/// LoRA adapter (fused with the base GEMM where it can be, see layers/lora.hpp) and the frozen flag.
class ParallelLinearBase {
 public:
  /// Column: [out/TP, in], partition_dim 0. Row: [out, in/TP], partition_dim 1.
  Parameter& weight() { return weight_; }
  /// Column: [out/TP], partition_dim 0. Row: [out], replicated; with sequence_parallel its main_grad holds
  /// only this rank's sequence chunk's share (Parameter::sequence_parallel is set) until
  /// allreduce_sequence_parallel_grads. Undefined without bias.
  Parameter& bias() { return bias_; }
  std::vector<Parameter*> parameters();
  void zero_grad();
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }

  /// Moves the saved state of the last forward into `s` (the layer is left with nothing saved) /
  /// back from `s`, in a fixed order; see activation_stash.hpp.
  void stash_activations(ActivationStash& s);
  void restore_activations(ActivationStash& s);

  /// Attaches a LoRA adapter built for this layer (Kind matching, the layer's full in_features and output
  /// width) and binds it to the weight (the fused path moves the weight into the adapter's [W ; A] buffer;
  /// weight().data then views its rows). It runs in every later forward/backward. Throws ValueError when it
  /// does not fit.
  void attach_lora(std::unique_ptr<LoRAAdapter> adapter);
  /// The attached adapter, or nullptr.
  LoRAAdapter* lora() { return lora_.get(); }
  /// Adds the adapter's scale · B A into the weight and detaches it (the layer then computes the same
  /// function without the low-rank path; the weight gets its own storage again).
  void merge_lora(const Stream& s = {});
  /// Frozen: backward computes no weight or bias gradient and their main_grad buffers are released
  /// (unfreezing allocates them again, zeroed).
  void set_frozen(bool frozen);
  bool frozen() const { return frozen_; }

  /// Runs this layer's GEMMs in FP8 with `recipe` (layers/fp8.hpp; the weight gradient too with recipe.wgrad). The
  /// weight must be bf16 or f32. Returns false, with one log line, when the weight's dimensions are not
  /// multiples of 16 (the layer then stays in its dtype).
  bool enable_fp8(const Fp8Recipe& recipe, std::string_view name = {});
  /// The FP8 state, or nullptr when FP8 is off.
  Fp8LinearState* fp8() { return fp8_.get(); }
  /// Once per optimizer step, before the first forward of the step (see Fp8LinearState::begin_step).
  void fp8_begin_step(const Stream& s = {});

 protected:
  ParallelLinearBase(comm::Communicator& tp, LoRAAdapter::Kind kind, int64_t in_features, int64_t out_features,
                     std::string_view name);
  /// x2 [rows, in local] → x2 Wᵀ (+ bias when defined) plus the adapter's low-rank path, [rows, W's rows].
  /// With FP8 in training and `keep_fp8_input`, x2's transposed FP8 codes go to saved_input_t_ for the
  /// weight gradient (the caller then does not keep x2); otherwise saved_input_t_ is left undefined.
  Tensor product(const ForwardContext& ctx, const Tensor& x2, const Tensor& bias, bool keep_fp8_input);
  /// Backward's products for dY [rows, W's rows]: dW += dYᵀ X into the weight's main_grad (unless frozen)
  /// and the returned input gradient dY W (plus the adapter's), contiguous [rows, in local]; in FP8 where it
  /// applies. x2: the saved input's rows, undefined when forward kept only saved_input_t_ (consumed here).
  Tensor backward_products(const ForwardContext& ctx, const Tensor& x2, const Tensor& dy2);
  bool has_saved_input() const { return saved_input_.defined() || saved_input_t_.defined(); }
  /// The streams of an overlapped collective: on CUDA the compute stream (the legacy default stream, named,
  /// when `given` is the host stream) and this layer's own communication stream (created on first use with
  /// `priority`); on the CPU `given` twice.
  std::pair<Stream, Stream> overlap_streams(const Stream& given, int priority);
  /// Whether an overlapped sequence-parallel forward (`asked`) can run: TP > 1, no FP8 and no adapter (those
  /// run serially, said once in the log).
  bool sp_forward_overlap_applies(bool asked);

  comm::Communicator& tp_;
  int64_t in_, out_;
  Parameter weight_, bias_;
  Tensor saved_input_;
  /// FP8 weight gradient: forward's input codes transposed ([in local, rows]) and the scale_inv they were
  /// cast with (current scaling changes the slot's scale with every cast), kept instead of saved_input_;
  /// saved_shape_ is then the input's shape.
  Tensor saved_input_t_, saved_input_t_scale_inv_;
  Shape saved_shape_;
  std::unique_ptr<LoRAAdapter> lora_;
  bool frozen_ = false;
  std::unique_ptr<Fp8LinearState> fp8_;
  Stream comm_stream_;  // CUDA: created by the first overlap_streams

 private:
  /// FP8 applies to a product of `rows` rows (no adapter, every dimension a multiple of 16).
  bool fp8_applies(int64_t rows);

  LoRAAdapter::Kind kind_;
  std::string_view name_;
};

/// Y = X W^T + b with W's output features split over the TP group.
class ColumnParallelLinear : public ParallelLinearBase {
 public:
  /// `tp` must outlive the layer. Throws ValueError naming the fix when out_features is not divisible
  /// by TP or the options contradict each other (gather_output with sequence_parallel).
  ColumnParallelLinear(comm::Communicator& tp, int64_t in_features, int64_t out_features,
                       const ColumnParallelLinearOptions& options = {});

  /// x: [..., in] (replicated), or [s/TP, ..., in] with sequence_parallel. Returns [..., out/TP], or
  /// [..., out] with gather_output.
  Tensor forward(const ForwardContext& ctx, const Tensor& x);
  /// dy: the gradient of forward's output (same shape). Accumulates weight/bias main_grad and returns
  /// the gradient of x (summed over TP; reduce-scattered to [s/TP, ...] with sequence_parallel).
  Tensor backward(const ForwardContext& ctx, const Tensor& dy);

  int64_t out_features_per_rank() const { return out_local_; }
  const ColumnParallelLinearOptions& options() const { return opts_; }
  /// Turns overlap_grad_comm on or off after construction, with the communication stream's priority
  /// (a model built from a TransformerConfig uses it for the layers it does not construct itself).
  void set_overlap_grad_comm(bool on, int comm_stream_priority = 0) {
    opts_.overlap_grad_comm = on;
    opts_.comm_stream_priority = comm_stream_priority;
  }
  /// Turns overlap_sp_forward on or off after construction (the stream priority is comm_stream_priority's).
  void set_overlap_sp_forward(bool on) { opts_.overlap_sp_forward = on; }

 private:
  Tensor backward_overlapped(const Stream& s, const Tensor& dyl);
  Tensor forward_sp_overlapped(const Stream& s, const Tensor& x);

  int64_t out_local_;
  ColumnParallelLinearOptions opts_;
  // saved_input_: x as given (with SP: the local chunk; re-gathered in backward)
};

/// Y = X W^T + b with W's input features split over the TP group; the partial products are summed
/// (all-reduce, or reduce-scatter along the sequence with SP) and the bias is added once after that.
class RowParallelLinear : public ParallelLinearBase {
 public:
  /// Throws ValueError naming the fix when in_features is not divisible by TP or sequence_parallel
  /// is asked without input_is_parallel.
  RowParallelLinear(comm::Communicator& tp, int64_t in_features, int64_t out_features,
                    const RowParallelLinearOptions& options = {});

  /// x: [..., in/TP] with input_is_parallel, else [..., in]. Returns [..., out] replicated, or
  /// [s/TP, ..., out] with sequence_parallel.
  Tensor forward(const ForwardContext& ctx, const Tensor& x);
  /// dy: gradient of forward's output (same shape). Returns the gradient of x in x's layout.
  Tensor backward(const ForwardContext& ctx, const Tensor& dy);

  int64_t in_features_per_rank() const { return in_local_; }
  const RowParallelLinearOptions& options() const { return opts_; }
  /// Turns overlap_sp_forward on or off after construction, with the communication stream's priority.
  void set_overlap_sp_forward(bool on, int comm_stream_priority = 0) {
    opts_.overlap_sp_forward = on;
    opts_.comm_stream_priority = comm_stream_priority;
  }

 private:
  Tensor forward_sp_overlapped(const Stream& s, const Tensor& x2, int64_t chunk_rows);

  int64_t in_local_;
  RowParallelLinearOptions opts_;
  // saved_input_: this rank's [..., in/TP] input
};

/// Sums over `tp` the main_grad of every parameter flagged sequence_parallel (once per step, before
/// the optimizer or the DP gradient reduction).
void allreduce_sequence_parallel_grads(comm::Communicator& tp, const std::vector<Parameter*>& params,
                                       const Stream& s = {});

}  // namespace megacore::layers
