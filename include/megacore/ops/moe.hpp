// Mixture-of-experts ops: the router (top-k, capacity, load-balancing and z losses), the token
// permutation that groups token copies by expert, and the grouped GEMM that runs every local expert's
// linear layer over its group of rows.
//
// Shapes: T tokens, E experts, k experts per token (top-k), H hidden features. A "slot" (t, j) is the
// j-th expert chosen for token t. Router semantics follow Megatron-Core's router
// (topk_softmax_with_capacity, switch_load_balancing_loss_func, z_loss_func), so a model trained with
// megacore routes its tokens the way a Megatron-Core or Hugging Face checkpoint expects.
//
// Every op checks its arguments before launching anything (ValueError naming the argument and the fix).
// Index values are checked on the CPU; on CUDA, where checking values would need a host sync, the ops
// say below what an out-of-range value produces. Results are deterministic on both devices: no op
// depends on the order in which atomics land.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

/// How router logits become expert scores.
enum class RouterScore { Softmax, Sigmoid };

struct RouterTopkOptions {
  int topk = 2;  ///< experts per token, 1 <= topk <= E
  RouterScore score = RouterScore::Softmax;
  /// Softmax only. false: the k largest logits are chosen, then softmax over those k (Mixtral).
  /// true: softmax over all E, then the k largest probabilities, not renormalised (Qwen2-MoE).
  /// Sigmoid: the k largest sigmoid(logits) (+ bias) are chosen; probs = the chosen sigmoids divided
  /// by their sum when k > 1 (DeepSeek-V3), the sigmoid itself when k = 1.
  bool pre_softmax = false;
  float scaling_factor = 1.f;  ///< probs *= scaling_factor
};

/// Top-k routing. logits f32 [T, E] (in). expert_bias f32 [E] or undefined (in): added to the scores
/// for the *selection only*, so the combine weights stay those of the unbiased scores (aux-loss-free
/// load balancing). probs f32 [T, k] (out): combine weights. indices i32 [T, k] (out): distinct experts
/// per row in descending selection score, ties to the lower expert id. The selection score is the
/// logit when there is no bias (softmax and sigmoid are strictly increasing, so this is the top-k of
/// the scores, and CPU and CUDA choose identically), and score + bias with one (the logit + bias for
/// softmax after top-k); there the CPU computes it in f64 and CUDA in f32 with expf, so experts whose
/// selection scores lie within about 1e-6 of each other may be ordered differently. On CUDA the router ops (top-k,
/// its backward, aux and z losses) take E <= 256 (a warp per token holds the row in registers) and k <= 8.
void router_topk(const Tensor& logits, const Tensor& expert_bias, const RouterTopkOptions& o, Tensor& probs,
                 Tensor& indices, const Stream& s = {});

/// Backward of router_topk: dprobs f32 [T, k] (in) → dlogits f32 [T, E] (accumulated: dlogits += ..., so
/// the aux and z-loss gradients can go into the same buffer). indices are router_topk's output from
/// *before* router_apply_capacity: a dropped slot still took part in the normalisation of its row's
/// probabilities, and its own dprobs is 0 (moe_unpermute_backward gives 0 there).
void router_topk_backward(const Tensor& logits, const Tensor& indices, const Tensor& dprobs, const RouterTopkOptions& o,
                          Tensor& dlogits, const Stream& s = {});

/// Capacity (token dropping), in place on router_topk's outputs: each expert keeps at most `capacity`
/// slots, those with the largest probs (ties to the lower token index); a dropped slot gets
/// indices = -1 and probs = 0. capacity >= 1. A slot whose index is already -1 stays dropped.
void router_apply_capacity(Tensor& probs, Tensor& indices, int num_experts, int64_t capacity, const Stream& s = {});

/// Switch load-balancing loss, as Megatron-Core computes it:
///   scores = softmax(logits) (Softmax) or sigmoid(logits) / row sum (Sigmoid), f32 [T, E]
///   loss   = coeff * E / (total_tokens^2 * topk) * sum_e (sum_t scores[t, e]) * tokens_per_expert[e]
/// logits f32 [T, E]; tokens_per_expert f32 [E] (may already be summed over a TP/CP/SP group; then
/// total_tokens counts the same tokens). loss f32 [1] (out, written).
void router_aux_loss(const Tensor& logits, RouterScore score, const Tensor& tokens_per_expert, int64_t total_tokens,
                     int topk, float coeff, Tensor& loss, const Stream& s = {});
/// dlogits f32 [T, E] += dloss * d loss / d logits (the gradient flows through the scores only; the
/// token counts are constants).
void router_aux_loss_backward(const Tensor& logits, RouterScore score, const Tensor& tokens_per_expert,
                              int64_t total_tokens, int topk, float coeff, float dloss, Tensor& dlogits,
                              const Stream& s = {});

/// Random router logits for forced load balancing (benchmarking only; model.moe_router_force_load_balancing):
/// logits[t, e] = philox_normal(seed, offset, (first_token + t) * E + e) (core/random.hpp), f32 [T, E] (out).
/// A token's scores depend only on (seed, offset, its global index first_token + t), so every rank layout
/// that routes the token draws the same scores, on the CPU and on CUDA alike (bit-identical: Box-Muller in
/// f64 on both). router_topk over them picks k experts uniformly at random per token.
void router_random_logits(Tensor& logits, uint64_t seed, uint64_t offset, int64_t first_token, const Stream& s = {});

/// z-loss: loss f32 [1] = coeff * mean_t (logsumexp_e logits[t, e])^2, logits f32 [T, E].
void router_z_loss(const Tensor& logits, float coeff, Tensor& loss, const Stream& s = {});
/// dlogits f32 [T, E] += dloss * d loss / d logits.
void router_z_loss_backward(const Tensor& logits, float coeff, float dloss, Tensor& dlogits, const Stream& s = {});

/// Where each slot goes in the expert-grouped ("permuted") buffer. Slots are grouped by expert (expert 0
/// first); within an expert they are ordered by token t, then j. Dropped slots (index -1) are skipped.
/// indices i32 [T, k] (in). row_map i32 [T, k] (out): destination row of slot (t, j), -1 for a dropped
/// slot. tokens_per_expert i64 [E] (out, same device): rows per expert; the caller copies them to the
/// host (its one sync) to size the permuted buffer and the grouped GEMM. On CUDA an index outside
/// [-1, E) makes every count -1, which the caller's host copy shows.
void moe_permute_map(const Tensor& indices, int num_experts, Tensor& row_map, Tensor& tokens_per_expert,
                     const Stream& s = {});

/// The all-to-all dispatcher's sort map, built where the layout lives (a kernel on CUDA, no host copy).
/// Received rows come in `chunks` blocks of `pad_rows` rows (one block per expert-TP rank after the
/// gather; one block without expert-TP); inside block c the rows are grouped by source EP rank q, then
/// local expert j: layout i64 [chunks · E] (in), layout[c·E + q·El + j] = rows of local expert j from q
/// in block c (E = EP · El, El = `local_experts`), the block's rows first, padding after. map i32
/// [chunks · pad_rows, 1] (out): the row's position once sorted by local expert (stable: block, source,
/// row order kept inside an expert), -1 for padding rows. The caller knows pad_rows (>= every block's
/// row count) from its host copy of the counts.
void moe_sort_map(const Tensor& layout, int64_t local_experts, int64_t pad_rows, Tensor& map, const Stream& s = {});

/// permuted[row_map[t, j]] = x[t]. x [T, H] (in), permuted [N, H] (out, x's dtype, N = kept slots),
/// any float dtype. Rows of permuted that no slot maps to are left as they are.
void moe_permute(const Tensor& x, const Tensor& row_map, Tensor& permuted, const Stream& s = {});

/// y[t] = sum_j w(t, j) * permuted[row_map[t, j]] with w = probs[t, j] (f32 [T, k]), or 1 when probs is
/// undefined (then this is the backward of moe_permute). Accumulates in f32; y [T, H] (out, overwritten,
/// permuted's dtype). A token whose slots are all dropped gets y[t] = 0.
void moe_unpermute(const Tensor& permuted, const Tensor& row_map, const Tensor& probs, Tensor& y,
                   const Stream& s = {});

/// Backward of moe_unpermute with probs. dy [T, H] (in), permuted [N, H] (in, the forward's input),
/// dpermuted [N, H] (out): dpermuted[row_map[t, j]] = probs[t, j] * dy[t], rows no slot maps to are
/// zeroed. dprobs f32 [T, k] (out): <dy[t], permuted[row_map[t, j]]> accumulated in f32, 0 for a
/// dropped slot.
void moe_unpermute_backward(const Tensor& dy, const Tensor& permuted, const Tensor& row_map, const Tensor& probs,
                            Tensor& dpermuted, Tensor& dprobs, const Stream& s = {});

/// Grouped GEMM over experts, each group a linear layer (y = x W^T). The rows of x are grouped
/// contiguously: group g has group_sizes[g] rows (host values, may be 0, summing to N). w is [G, M, K],
/// one [M, K] weight per group. Dtypes as ops::gemm: f32, bf16 or f16, accumulating in f32.
///   forward: y_g  = x_g · w_g^T                 x [N, K]  → y [N, M]   (x's dtype)
///   dgrad:   dx_g = dy_g · w_g                  dy [N, M] → dx [N, K]  (dy's dtype)
///   wgrad:   dw_g = beta · dw_g + dy_g^T · x_g  dw [G, M, K], f32 (the main grad) when the inputs are
///            16-bit, else their dtype; beta = 1 accumulates; a group with 0 rows leaves beta · dw_g
///            (forward/dgrad write nothing for it: it has no rows).
/// On CUDA the products run on the path grouped_gemm_path() selects (see GroupedGemmPath); on the CPU
/// one ops::gemm per group.
void grouped_gemm_forward(const Tensor& x, const Tensor& w, std::span<const int64_t> group_sizes, Tensor& y,
                          const Stream& s = {});
void grouped_gemm_dgrad(const Tensor& dy, const Tensor& w, std::span<const int64_t> group_sizes, Tensor& dx,
                        const Stream& s = {});
void grouped_gemm_wgrad(const Tensor& dy, const Tensor& x, std::span<const int64_t> group_sizes, Tensor& dw,
                        float beta = 1.f, const Stream& s = {});

/// How the grouped GEMMs run on CUDA.
///   Sm90:    megacore's own Hopper kernel (src/ops/cuda/grouped_gemm_sm90.cu): every group in one
///            persistent launch (TMA loads, wgmma, two consumer warpgroups taking turns so one tile's
///            epilogue runs beside the next one's main loop). bf16 inputs, features a multiple of 8,
///            contiguous 16-byte-aligned tensors, at most kGroupedSm90MaxGroups groups, a library built
///            for sm_90a and a compute-capability 9.0 GPU (grouped_gemm_sm90_available); wgrad into an f32
///            or bf16 dw with any beta. Elsewhere it is not available and the call runs as Auto below.
///   Loop:    one cuBLASLt product per group with rows, enqueued back to back on the call's stream (no
///            host sync, no allocation per group beyond ops::gemm's stream-ordered workspace). Products
///            keep cuBLASLt's heuristic kernel (no timed autotuning: the row counts change every step).
///   Grouped: all groups in one cublasGemmGroupedBatchedEx launch. cuBLAS has no grouped kernel for
///            16-bit inputs into an f32 output (wgrad into the main grad): that case runs Loop.
///   Auto:    Sm90 where it is available (forward, dgrad and wgrad at every size: on H200, 2026-11-29,
///            benchmarks/results/moe_gemm_sm90_NVIDIA_H200.json, it is the fastest path or within 3 % of it
///            on all 192 shapes, every path timed in turn); otherwise Grouped when the groups with rows average fewer than
///            kGroupedGemmMaxMeanMacs multiply-adds (rows · M · K per group: many small products, where
///            launching one per group costs more than the grouped kernel loses), else Loop (the per-group
///            cuBLASLt products reach the dense GEMM's speed; the grouped kernel reaches 35-46 % of it with
///            1024+ rows per group on H200). The work per group, not its rows, decides: on H200
///            (benchmarks/results/moe_gemm_NVIDIA_H200.json) 256 rows of a 2048×1408 product (0.74 G MACs)
///            ran 1.4-1.6× faster grouped, 256 rows of 2816×2048 (1.48 G) 1.1× faster looped; the bound
///            sits between them.
/// The first call of each op says once in the log which path it takes and why.
enum class GroupedGemmPath { Auto, Loop, Grouped, Sm90 };
inline constexpr int64_t kGroupedGemmMaxMeanMacs = int64_t(1) << 30;
inline constexpr int kGroupedSm90MaxGroups = 256;

/// Whether the Sm90 kernel can run on device d: the library holds sm_90a code and d is a Hopper GPU.
bool grouped_gemm_sm90_available(Device d);
/// How many grouped GEMMs this process has launched on the Sm90 kernel (tests see which path ran; a call with
/// no rows launches nothing and is not counted).
int64_t grouped_gemm_sm90_launches();

/// The path setting: set_grouped_gemm_path's last value, else MEGACORE_MOE_GEMM (auto, loop, grouped or sm90;
/// read once; another value is a ConfigError naming the accepted ones), else Auto.
GroupedGemmPath grouped_gemm_path();
void set_grouped_gemm_path(GroupedGemmPath path);
/// The cuBLAS path a CUDA call with these group sizes takes under `path` where the Sm90 kernel does not
/// run (Auto and Sm90 resolved to Loop or Grouped;
/// wgrad into an f32 output from 16-bit inputs is always Loop). `macs_per_row` is M · K, the multiply-adds
/// one row of a group costs (forward: out × in features of w; dgrad the same product; wgrad dy's × x's
/// features).
GroupedGemmPath grouped_gemm_choice(GroupedGemmPath path, std::span<const int64_t> group_sizes, int64_t macs_per_row,
                                    bool grouped_supported = true);
const char* grouped_gemm_path_name(GroupedGemmPath path);

/// CUDA streams the per-group loop (GroupedGemmPath::Loop) spreads its GEMMs over, round-robin: the
/// caller's stream forks to them and joins them again, so small per-expert GEMMs share the SMs and one
/// GEMM's epilogue (wgrad's read-modify-write of the f32 main grads) runs beside the next one's main loop.
/// 1 = every GEMM on the caller's stream. The setting: set_grouped_gemm_loop_streams's last value, else
/// MEGACORE_MOE_GEMM_STREAMS (read once), else 0 = the measured default (grouped_gemm_loop_streams_for);
/// outside [0, 16] is a ConfigError.
int grouped_gemm_loop_streams();
/// The streams a loop of this kind runs on: the setting when it is not 0; by default
/// kGroupedGemmWgradStreams for wgrad and 1 for forward and dgrad (on an H100, 2026-11-28,
/// benchmarks/results/moe_gemm_streams_NVIDIA_H100.json: wgrad 1.10x (8 experts) and 1.24x (64/128)
/// on 2 streams against 1, geometric means; forward and dgrad within 0.96-1.08x either way).
inline constexpr int kGroupedGemmWgradStreams = 2;
int grouped_gemm_loop_streams_for(bool wgrad);
void set_grouped_gemm_loop_streams(int streams);
/// "auto", "loop", "grouped" or "sm90" → the path; another value is a ConfigError naming the accepted ones.
GroupedGemmPath parse_grouped_gemm_path(std::string_view name, std::string_view source = "MEGACORE_MOE_GEMM");

}  // namespace megacore::ops
