// Private interface between src/ops/attention.cpp and its CUDA backends: megacore's flash kernels
// (flash_attention.cu: mma.sync, any sm_80+; flash_attention_sm90.cu: the Hopper wgmma forward and
// atomic-dQ backward) and
// cuDNN SDPA (attention_cudnn.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "megacore/core/dtype.hpp"

namespace megacore::ops::cuda {

/// A 4-D strided view [batch, row (token), head, dim] in elements; dim is contiguous. In packed
/// mode batch_stride is unused (sequence b starts at row cu[b]).
struct AttnTensor {
  void* ptr = nullptr;
  int64_t batch_stride = 0, row_stride = 0, head_stride = 0;
};

struct AttnProblem {
  DType dtype = DType::BF16;
  int batch = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int seqlen_q = 0, seqlen_kv = 0;  ///< per sequence (dense) or the maxima (packed)
  int64_t total_q = 0, total_kv = 0;  ///< packed: token counts (rows of q and k)
  const int32_t* cu_q = nullptr;      ///< device pointers, packed mode only
  const int32_t* cu_kv = nullptr;
  bool causal = false;
  bool deterministic = false;
  float scale = 0.f;
  AttnTensor q, k, v, o, dout, dq, dk, dv;
  float* lse = nullptr;  ///< [B, H, Sq] (dense) or [H, Tq] (packed)
  int64_t lse_batch_stride = 0, lse_head_stride = 0;
  /// Flash forward kernel: 0 = Auto (sm90 where flash_sm90_unsupported_reason is "", else sm80),
  /// 1 = the mma.sync kernel, 2 = the wgmma kernel (the caller has checked that it can run).
  int fwd_impl = 0;
  /// sm90 forward: keys per K/V tile, 0 (default, 128), 64 or 128.
  int sm90_block_n = 0;
  /// sm90 forward schedule: 0 (default) all 256 threads load each K/V tile and meet at a CTA barrier
  /// per tile; 1 / 2 a producer warpgroup loads 2 / 3 stages through mbarriers and the two consumer
  /// warpgroups run decoupled (warp-specialized); 3 / 4 the same with ping-pong scheduling.
  int sm90_variant = 0;
  /// Flash backward kernel of the atomic-dQ path (deterministic false): 0 = Auto (the wgmma kernel
  /// where flash_sm90_unsupported_reason is "", else mma.sync), 1 = the mma.sync kernel, 2 = the wgmma
  /// kernel (the caller has checked that it can run). The deterministic path is mma.sync always.
  int bwd_impl = 0;
  /// sm90 backward: 0 (default) the dQ tile through shared memory and one bulk reduce-add
  /// (cp.reduce.async.bulk) per tile at D = 128 (D = 64 runs 1); 1 dQ added with red.global.add from
  /// every thread.
  int sm90_bwd_variant = 0;
};

/// Launch shape of the flash backward's mma.sync atomic-dQ kernel (p.deterministic false): a block of `warps`
/// warps owns 16 * warps keys (8: 128 keys, 4: 64 keys; queries per step 32 at D = 128, 64 at D = 64).
/// attention_backward uses {}; the benchmark and the [gpu] tests run each.
struct FlashBwdTuning {
  int warps = 8;
};

/// Why the flash kernel cannot run this problem ("" when it can).
std::string flash_unsupported_reason(const AttnProblem& p);
void flash_forward(const AttnProblem& p, int device, void* stream);
/// True when this build holds the sm_90a wgmma kernels (CMAKE_CUDA_ARCHITECTURES names 90a).
bool flash_sm90_built();
/// Why the sm_90a kernels cannot run this problem on this device ("" when it can). Checks
/// flash_unsupported_reason's conditions and the sm90 tuning fields too.
std::string flash_sm90_unsupported_reason(const AttnProblem& p, int device);
/// The wgmma forward; only after flash_sm90_unsupported_reason returned "".
void flash_forward_sm90(const AttnProblem& p, int device, void* stream);
/// The wgmma backward's main kernel alone (dK, dV, and dQ added into dq_acc); flash_backward runs it.
void flash_backward_sm90_main(const AttnProblem& p, const float* dsum, float* dq_acc, void* stream);
/// Needs p.o and p.lse from the forward; dsum is f32 scratch with lse's layout and size. With
/// p.deterministic: separate dK/dV and dQ kernels, no atomics, bit-identical results (dq_acc unused,
/// may be null). Without: one kernel for dK/dV/dQ adding dQ into dq_acc with f32 atomics (f32 scratch
/// of lse's size times head_dim, zeroed here on the stream), then a pass that scales and casts it into
/// p.dq; faster, but dq's rounding varies from run to run.
void flash_backward(const AttnProblem& p, float* dsum, float* dq_acc, int device, void* stream,
                    const FlashBwdTuning& tuning = {});

/// Packed sequences through cuDNN's ragged layout: device helpers (attention_ragged.cu).
/// Element-offset arrays ragged_prepare writes: array i holds, for b in [0, batch_padded], cu[min(b, batch)]
/// * mult[i], where cu is cu_kv when kv[i] and cu_q otherwise.
struct RaggedOffsets {
  static constexpr int kMax = 10;
  int n = 0;
  int64_t mult[kMax] = {};
  bool kv[kMax] = {};
};
/// Where ragged_prepare puts each array in its int32 block (entries from the block's start): every array
/// starts on a 16-byte boundary, the alignment the cuDNN graph declares for these tensors.
struct RaggedIndexLayout {
  int64_t seq_kv = 0;         ///< the kv lengths (the q lengths start at 0)
  int64_t offsets = 0;        ///< offset array 0
  int64_t offset_stride = 0;  ///< from one offset array to the next
  int64_t total = 0;          ///< entries to allocate
};
inline RaggedIndexLayout ragged_index_layout(int64_t batch_padded, int n_offsets) {
  auto up4 = [](int64_t v) { return (v + 3) / 4 * 4; };
  RaggedIndexLayout l;
  l.seq_kv = up4(batch_padded);
  l.offsets = 2 * l.seq_kv;
  l.offset_stride = up4(batch_padded + 1);
  l.total = l.offsets + n_offsets * l.offset_stride;
  return l;
}
/// Writes into out (int32, laid out by ragged_index_layout(batch_padded, offs.n), 16-byte aligned): the q
/// lengths [batch_padded], the kv lengths [batch_padded] (sequences past `batch` are empty; lengths are cut
/// to max_q / max_kv), then the offset arrays [batch_padded + 1] each.
void ragged_prepare(const int32_t* cu_q, const int32_t* cu_kv, int batch, int batch_padded, int max_q, int max_kv,
                    const RaggedOffsets& offs, int32_t* out, void* stream);
/// Token-major stats [tq, heads] into lse (lse[h * lse_head_stride + t]); -inf for tokens outside every
/// sequence or whose sequence has no keys. stats null: only those -inf entries are written.
void ragged_stats_to_lse(const float* stats, float* lse, int64_t lse_head_stride, int64_t tq, int heads,
                         const int32_t* cu_q, const int32_t* cu_kv, int batch, void* stream);
/// lse [heads, tq] (head stride lse_head_stride) into token-major stats [tq, heads].
void ragged_lse_to_stats(const float* lse, int64_t lse_head_stride, float* stats, int64_t tq, int heads,
                         void* stream);
/// Zeroes rows [t, h, 0:dim] of a 2-byte tensor for tokens t outside every sequence of cu, or whose
/// sequence b has no tokens in cu_other (cu_other[b + 1] == cu_other[b]).
void ragged_zero_orphan_rows(void* ptr, int64_t row_stride, int64_t head_stride, int64_t tokens, int heads, int dim,
                             const int32_t* cu, const int32_t* cu_other, int batch, void* stream);

/// Packed calls, after either backend: the rows no kernel computes get the reference's values. Forward:
/// lse -inf and out rows 0 for queries outside every sequence or in a sequence without keys. Backward:
/// dq rows 0 for those queries, dk/dv rows 0 for keys outside every sequence or in one without queries.
void ragged_fix_orphans_forward(const AttnProblem& p, int device, void* stream);
void ragged_fix_orphans_backward(const AttnProblem& p, int device, void* stream);

/// True when the build has the cuDNN SDPA path.
bool cudnn_sdpa_built();
/// Why cuDNN SDPA cannot run this problem ("" when it can); may build (and cache) the graph to ask.
std::string cudnn_unsupported_reason(const AttnProblem& p, bool backward, int device);
void cudnn_forward(const AttnProblem& p, int device, void* stream);
void cudnn_backward(const AttnProblem& p, int device, void* stream);

}  // namespace megacore::ops::cuda
