// Tensor-parallel self-attention (Megatron-Core's SelfAttention): fused QKV projection, GQA, RoPE,
// causal core attention and the output projection, with explicit forward and backward.
//
// Data flow (activations [s, b, h], sequence first, as the linear layers):
//
//   x [s, b, h] (or [s/TP, b, h] with SP)
//     → linear_qkv (ColumnParallelLinear; with SP it all-gathers the sequence)  → [s, b, qkv_width/TP]
//     → split into q [s, b, heads/TP, d], k and v [s, b, groups/TP, d]
//     → (qk_layernorm) RMSNorm of every q and k head over d
//     → RoPE on q and k (rotate-half unless rotary_interleaved; partial rotary with rotary_percent)
//     → causal core attention (ops::attention_forward, GQA native)              → [s, b, heads/TP · d]
//     → linear_proj (RowParallelLinear, input_is_parallel; with SP it reduce-scatters the sequence)
//   y [s, b, h] (or [s/TP, b, h] with SP)
//
// Fused QKV layout: the full weight's rows (qkv_width = (heads + 2·groups)·d of them) are ordered by
// query group g as [the heads/groups query heads of g ; k_g ; v_g], each head d rows. A contiguous TP
// slice of the rows is therefore groups/TP whole groups with their query heads, so each rank runs
// attention on its own heads with no communication (this is why groups % TP == 0 is required).
// fuse_qkv_weight / split_qkv_weight convert from and to separate Wq [heads·d, h], Wk, Wv [groups·d, h]
// (the Hugging Face layout, query head i belonging to group i / (heads/groups)).
//
// Saved activations per forward (the linear layers keep their own inputs: linear_qkv the input x —
// with SP only this rank's chunk — and linear_proj the core attention output):
//   recompute None:      q, k (after RoPE) and v, the core attention output and its LSE f32 [b, heads/TP, s];
//                        with the CP ring also the CP − 1 received K/V blocks ((CP − 1)× k and v).
//   recompute Selective: q, k (after RoPE) and v only; backward reruns ops::attention_forward for the
//                        output and LSE. The output tensor is still held by linear_proj (it needs it for its
//                        weight gradient, as in Megatron-Core), so what this frees is the LSE and the
//                        separately materialised output in a layer that does not share it; with a fused
//                        attention kernel the s×s scores that selective recompute exists to avoid are never
//                        stored in either mode. The recomputation is deterministic, so both modes give
//                        bit-identical gradients (on GPUs with deterministic = true: the flash kernel's
//                        default backward adds dq with atomics, so dq's rounding varies run to run).
//   recompute Full is the TransformerLayer's business (it reruns the whole layer); here it acts as None.
//
// Context parallelism (SelfAttentionOptions::cp with CP > 1; Megatron-Core's "p2p" cp_comm_type): each
// CP rank holds the local sequence of chunks r and 2·CP−1−r (2c tokens of the 2·CP·c; with SP the
// sequence is split by CP first and the local part by TP). Core attention runs as a ring of CP steps:
// at step i the rank holds the K/V block of rank src = (r − i) mod CP, posts the exchange that passes it
// to rank r+1 and receives the next one from r−1 (Communicator::batch_send_recv), and computes its
// queries against the block it holds. On CUDA the exchange runs on the layer's own communication stream
// (ordered after the block's producer by an event; the compute stream waits for the exchange only before
// it uses the received block), so the transfer overlaps the attention of the block held; on CPU ranks
// both are the host stream. The blocks:
//   i = 0 (its own block): causal over the local sequence (chunk r sees itself causally, the late chunk
//         sees chunk r fully and itself causally, which is exactly the top-left causal mask of 2c × 2c);
//   src < r: both query chunks against the block's first chunk (src), full;
//   src > r: the late query chunk against the whole block, full (the block's early chunk src > r is
//         after chunk r, so chunk r sees nothing of it).
// Partial outputs are merged with their LSE in f32 (ops/attention_merge.hpp); the saved LSE is the
// merged one. The forward keeps the CP − 1 K/V blocks it received (with recompute Selective the backward's
// rerun of the ring brings them instead), so the backward moves no K/V: it visits the blocks in the order
// src = r − 1, r − 2, …, r + 1 and its own block last, with the merged output and LSE (so each block's
// gradient is its exact share). dQ accumulates locally; a block's dK/dV accumulator (f32) starts at rank
// src + 1 and moves one rank on after each step, so after CP − 1 exchanges it reaches its owner just in
// time for the owner's own (last) step: every exchange overlaps the next step's attention backward (only
// the accumulation waits for it) and none is left after the last step. GQA runs natively in every block.
// CpCommType::AllGather (Megatron-Core's "all_gather") instead all-gathers K and V over the CP group into the
// global sequence, and each local query chunk g attends fully to keys [0, g·c) and causally to chunk g
// (merged with their LSE as above); backward gathers again, sums dK/dV of the whole sequence in f32 and
// reduce-scatters each rank's chunks back to it. Simpler, no overlap, CP× the K/V memory during attention.
// Packed rows with CP (P2P only): ctx.cu_seqlens are the full rows' boundaries and position_ids this rank's
// [b, s] part; each block runs as one packed attention call over the (row, segment) runs of its query and key
// chunks (layers/attention.cpp, packed_block). CPU and CUDA tensors; on GPUs both attention backends
// (cuDNN SDPA, the flash kernel) run the blocks and ops/attention_merge.hpp has CUDA kernels.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "megacore/comm/communicator.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/layers/activation_stash.hpp"
#include "megacore/layers/forward_context.hpp"
#include "megacore/layers/linear.hpp"
#include "megacore/layers/norm.hpp"
#include "megacore/layers/parameter.hpp"
#include "megacore/layers/layer_types.hpp"
#include "megacore/ops/attention.hpp"

namespace megacore::layers {

/// How context-parallel attention reaches the other CP ranks' keys and values (Megatron-Core's cp_comm_type).
enum class CpCommType {
  P2P,        ///< the ring: K/V blocks passed on in CP steps, overlapping the attention of the block held
  AllGather,  ///< all-gather K/V over the CP group first, then attend locally; dK/dV reduce-scattered back
};

/// The shape and flavour of one attention layer (model::attention_config derives it from a
/// TransformerConfig). Zero means "derived" for num_query_groups (= heads) and head_dim (hidden / heads).
struct AttentionConfig {
  int64_t hidden_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_query_groups = 0;  ///< KV heads (GQA); 0 = num_attention_heads
  int64_t head_dim = 0;          ///< 0 = hidden_size / num_attention_heads
  bool add_bias_linear = false;  ///< biases on linear_qkv and linear_proj
  /// RMSNorm of every query and key head over head_dim before RoPE (Qwen3's q_norm / k_norm), with one
  /// weight [head_dim] for the queries and one for the keys, replicated over TP (each rank's gradient covers
  /// its heads only: the Parameters are flagged sequence_parallel, so the TP sum completes them). The split
  /// q and k heads are then copied out of the fused QKV output, normalised, and rotated in place (the fused
  /// split + RoPE kernel is not used); the norms keep their inputs (the un-normalised heads) and f32
  /// statistics for the backward, on top of the saved q, k, v.
  bool qk_layernorm = false;
  double norm_eps = 1e-5;  ///< epsilon of the q/k norms
  /// Input and output are this rank's sequence chunk [s/TP, b, h] (needs TP > 1).
  bool sequence_parallel = false;
  DType params_dtype = DType::F32;
  double init_method_std = 0.02;  ///< std of linear_qkv's init (and linear_proj's unless proj_init_std is set)
  uint64_t seed = 1234;
  PositionEmbeddingType position_embedding = PositionEmbeddingType::RoPE;  ///< Learned: no RoPE in the layer
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  /// Selective recompute: keep q, k, v only and rerun core attention in backward.
  bool recompute_core_attention = false;

  int64_t groups() const { return num_query_groups > 0 ? num_query_groups : num_attention_heads; }
  int64_t head_size() const { return head_dim > 0 ? head_dim : (num_attention_heads > 0 ? hidden_size / num_attention_heads : 0); }
  int64_t qkv_width() const { return (num_attention_heads + 2 * groups()) * head_size(); }
  int64_t attention_width() const { return num_attention_heads * head_size(); }
};

/// Where the ring's exchanges stall the compute stream (diagnostics; SelfAttentionOptions::cp_wait_log). Every
/// wait of the compute stream on a ring exchange (the forward's K/V, the backward's dK/dV) is bracketed by two
/// timing events on that stream: the first completes when the work before the wait is done, the second when
/// the exchange has also arrived, so the time between them is how long the exchange held the attention up.
/// Only waits across streams are logged (CUDA with cp_overlap); serialised exchanges are on the stream itself.
struct RingWaitLog {
  std::vector<std::pair<Event, Event>> waits;
  /// The summed stall in milliseconds (synchronises on the events).
  double stalled_ms() const;
  void clear() { waits.clear(); }
};

struct SelfAttentionOptions {
  Device device = Device::cpu();
  /// Philox offsets of the two full weights' draws; give every layer of a model its own pair.
  uint64_t qkv_init_offset = 0;
  uint64_t proj_init_offset = 1;
  /// Std of the output projection's init; 0 uses the config's init_method_std (a model passes Megatron's
  /// scaled init, init_method_std / sqrt(2 · num_layers)).
  double proj_init_std = 0.0;
  /// Fraction of each head's channels that RoPE rotates (GPT-NeoX / Phi style partial rotary); the rotary
  /// dimension, head_dim × rotary_percent, must be even.
  double rotary_percent = 1.0;
  /// Rotate pairs (2i, 2i+1) (GPT-J / Megatron rotary_interleaved) instead of (i, i + rotary_dim/2).
  bool rotary_interleaved = false;
  /// Core attention backend (Auto: the CPU reference for host tensors, cuDNN or the flash kernel on GPUs).
  ops::AttentionBackend backend = ops::AttentionBackend::Auto;
  /// Ask the GPU backends for run-to-run identical gradients (see ops::AttentionOptions::deterministic).
  bool deterministic = false;
  /// Context-parallel group (must outlive the layer); nullptr or size 1 = no context parallelism. With
  /// CP > 1 the layer's input is this rank's local sequence (parallel/context_parallel.hpp: chunks r and
  /// 2·CP−1−r), RoPE uses the chunks' global positions and core attention runs as a ring over the group
  /// (see "Context parallelism" above).
  comm::Communicator* cp = nullptr;
  /// With CP > 1: the ring (P2P, the default) or AllGather (see "Context parallelism" above).
  CpCommType cp_comm_type = CpCommType::P2P;
  /// P2P on CUDA: run the ring's exchanges on the layer's communication stream, overlapping the attention
  /// (default). false enqueues them on the compute stream, serialised with it: the same results, for
  /// measuring how much of the exchange the overlap hides (benchmarks/cp/bench_cp_attention.cpp).
  bool cp_overlap = true;
  /// Diagnostics: when set, the ring logs its stream waits here (RingWaitLog; must outlive the layer's calls).
  RingWaitLog* cp_wait_log = nullptr;
};

/// Causal multi-head / grouped-query self-attention over one TP group. Biases, sequence parallelism,
/// RoPE and selective recompute follow the AttentionConfig.
class SelfAttention {
 public:
  /// `tp` must outlive the layer. Checks the layer's own invariants (positive sizes, groups dividing the
  /// heads and divisible by TP, an even rotary dimension, SP only with TP > 1, distinct init offsets) and
  /// throws ValueError naming the fix; a whole run configuration is validated before (train::validate).
  SelfAttention(comm::Communicator& tp, const AttentionConfig& cfg, const SelfAttentionOptions& options = {});

  /// x: [s, b, hidden] replicated over TP, or this rank's chunk [s/TP, b, hidden] with sequence_parallel.
  /// position_ids (optional, i32/i64 on any device): [s] shared by the batch or [b, s], for the FULL sequence
  /// even with SP (under CP: this rank's [b, s] part, parallel::cp_slice_sequence of the full rows' ids);
  /// undefined means 0..s-1. With ctx.cu_seqlens defined (packed rows), attention stays within
  /// the segments it marks (q/k/v are copied into token-major [b·s, heads, d] for the packed op and the
  /// results copied back). Returns y in x's layout.
  Tensor forward(const ForwardContext& ctx, const Tensor& x, const Tensor& position_ids = {});
  /// dy: gradient of forward's output (same shape). Accumulates every parameter's main_grad and returns
  /// the gradient of x in x's layout. One backward per forward.
  Tensor backward(const ForwardContext& ctx, const Tensor& dy);

  /// Moves the saved state of the last forward into `s` (the layer (its linear layers included) is left with nothing saved) /
  /// back from `s`, in a fixed order; see activation_stash.hpp.
  void stash_activations(ActivationStash& s);
  void restore_activations(ActivationStash& s);

  ColumnParallelLinear& linear_qkv() { return qkv_; }
  RowParallelLinear& linear_proj() { return proj_; }
  /// The query / key head norms (AttentionConfig::qk_layernorm); null without them.
  NormLayer* q_layernorm() { return q_norm_.get(); }
  NormLayer* k_layernorm() { return k_norm_.get(); }
  /// linear_qkv's weight (and bias), the q / k norm weights (qk_layernorm), then linear_proj's.
  std::vector<Parameter*> parameters();
  void zero_grad();
  const AttentionConfig& config() const { return cfg_; }
  int64_t heads_per_rank() const { return heads_local_; }
  int64_t groups_per_rank() const { return groups_local_; }
  /// 0 when the layer does not use RoPE (learned positions).
  int64_t rotary_dim() const { return rotary_dim_; }
  bool recompute_core_attention() const { return recompute_; }

 private:
  Tensor positions_for(const Tensor& position_ids, int64_t s, int64_t b, const Stream& st) const;
  ops::AttentionOptions attention_options() const;

  comm::Communicator& tp_;
  AttentionConfig cfg_;
  SelfAttentionOptions opts_;
  int64_t head_dim_ = 0, heads_local_ = 0, groups_local_ = 0, rotary_dim_ = 0;
  bool recompute_ = false;
  Tensor inv_freq_;  // f32 [rotary_dim / 2] on the layer's device, empty without RoPE
  ColumnParallelLinear qkv_;
  RowParallelLinear proj_;
  std::unique_ptr<RMSNorm> q_norm_, k_norm_;  // qk_layernorm
  // Saved between forward and backward (see the header comment for what each mode keeps).
  Tensor q_, k_, v_, out_, lse_, positions_;
  int64_t seq_ = 0, batch_ = 0;
  Tensor cu_;  // packed rows: the forward's ctx.cu_seqlens (undefined: dense)
  int64_t max_seqlen_ = 0;
  ops::AttentionOptions packed_options() const;
  // Core attention on [s, b, heads, d] q/k/v (sequence-major) into out [s, b, heads·d]; returns lse,
  // [b, heads, s] dense or [heads, b·s] for packed rows (cu_ defined: token-major copies for the packed op).
  // `keep`: the ring's K/V blocks for the backward (ring_forward).
  Tensor core_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, const Stream& st,
                      std::vector<Tensor>* keep = nullptr) const;
  // Context parallelism: the ring forward (writes out [s, b, heads·d], returns the merged lse [b, heads, s])
  // and backward (writes dq, dk, dv [s, b, heads or groups, d]).
  bool cp_active() const { return opts_.cp != nullptr && opts_.cp->size() > 1; }
  // With `keep`, the ring forward leaves the other ranks' K/V blocks there ([2·src] = K, [2·src + 1] = V; its
  // own pair stays undefined: it is k and v) for the backward.
  Tensor ring_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, const Stream& st,
                      std::vector<Tensor>* keep = nullptr) const;
  Tensor gather_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, const Stream& st) const;
  void gather_backward(const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                       const Stream& st) const;
  // K or V [s, b, groups, d] of every CP rank, all-gathered into the global sequence order [CP·s, b, groups, d].
  Tensor gather_sequence(const Tensor& t, const Stream& st) const;
  void ring_backward(const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                     const std::vector<Tensor>& blocks, const Stream& st) const;
  std::vector<Tensor> ring_kv_;  // the ring forward's K/V blocks, saved for backward (recompute None)
  // The stream the ring's exchanges run on: st on CPU ranks or with cp_overlap off, else cp_stream_
  // (created on the first CUDA ring).
  Stream ring_stream(const Stream& st) const;
  mutable Stream cp_stream_;
};

/// The fused QKV weight [(heads + 2·groups)·d, hidden] in the grouped layout above, from separate
/// Wq [heads·d, hidden], Wk and Wv [groups·d, hidden] (contiguous host or device tensors of one dtype).
/// Also works for the bias (1-D [heads·d] etc.).
Tensor fuse_qkv_weight(const Tensor& wq, const Tensor& wk, const Tensor& wv, int64_t heads, int64_t groups,
                       const Stream& s = {});
/// The inverse of fuse_qkv_weight: {Wq, Wk, Wv} as contiguous tensors.
std::vector<Tensor> split_qkv_weight(const Tensor& wqkv, int64_t heads, int64_t groups, const Stream& s = {});

}  // namespace megacore::layers
