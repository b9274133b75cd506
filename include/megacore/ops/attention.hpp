// Scaled dot-product attention, forward and backward, with the log-sum-exp of each query row.
//
// Layouts (the last dimension must be contiguous; other strides are free, so q/k/v may be views
// into a fused QKV projection):
//   dense:  q, out, dout, dq  [B, Sq, H, D];   k, v, dk, dv  [B, Skv, Hkv, D];   lse f32 [B, H, Sq]
//   packed: q, out, dout, dq  [Tq, H, D];      k, v, dk, dv  [Tkv, Hkv, D];      lse f32 [H, Tq]
// Packed (variable-length) mode is selected by passing cu_seqlens_q / cu_seqlens_kv (i32 [B + 1],
// prefix sums of the sequence lengths, on the tensors' device): sequence b holds tokens
// [cu[b], cu[b + 1]) and attends only within itself.
// H must be a multiple of Hkv (GQA; Hkv = 1 is MQA). D is 64 or 128 on the GPU (any on the CPU).
// causal masks key j > query i (top-left aligned, as torch's is_causal; every query row then sees
// at least key 0). lse[i] = log sum_j exp(scale * q_i . k_j) over the keys row i sees; it is what
// backward needs and what context parallelism merges partial results with.
//
// Backends: the CPU reference (plain loops in f64; f32/bf16/f16 tensors); on CUDA, cuDNN's fused
// SDPA (cudnn-frontend graphs cached by shape) or megacore's own flash-attention kernels (online
// softmax on tensor-core tiles, bf16/f16: mma.sync on any sm_80+, and wgmma forward and backward
// kernels on sm_90 that opts.flash_impl / opts.flash_bwd_impl can pin either way). Auto picks cuDNN where it is built in and
// supports the call, else the flash kernel, and logs the choice once per configuration; asking for
// a backend explicitly never falls back (ValueError/CudaError instead). Both GPU backends compute
// the same function; they differ only in rounding.
#pragma once

#include <cstdint>
#include <string>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

enum class AttentionBackend {
  Auto,    ///< cuDNN if available and supported, else Flash (logged once); CPU tensors use Reference
  Cudnn,   ///< cuDNN SDPA through cudnn-frontend
  Flash,   ///< megacore's own kernel
  Reference,  ///< the CPU f64 reference (CPU tensors only)
};

/// Which of megacore's flash kernels runs when the Flash backend does: AttentionOptions::flash_impl for
/// the forward, flash_bwd_impl for the (non-deterministic) backward.
enum class FlashImpl {
  Auto,  ///< the Hopper wgmma kernel where it can run (sm_90 device, library built for 90a), else Sm80
  Sm80,  ///< the mma.sync kernel (any sm_80 or newer device)
  Sm90,  ///< the wgmma kernel (sm_90a); asking for it where it cannot run is a ValueError
};

struct AttentionOptions {
  bool causal = false;
  /// Multiplies q . k; 0 means 1 / sqrt(D).
  float softmax_scale = 0.f;
  AttentionBackend backend = AttentionBackend::Auto;
  /// Backward gives bit-identical gradients from run to run. megacore's flash kernel: true runs
  /// separate dK/dV and dQ kernels with no atomics (7 matrix products per tile pair); false (the
  /// default) runs one FlashAttention-2-style kernel (5 products) that sums dQ over key blocks with
  /// f32 atomics, so dq's rounding can differ between runs (dk and dv are still bit-identical).
  /// cuDNN is asked for its deterministic algorithm.
  bool deterministic = false;
  /// Packed mode: i32 [B + 1] prefix sums, on the tensors' device (see the header comment).
  Tensor cu_seqlens_q;
  Tensor cu_seqlens_kv;
  /// Packed mode: the longest sequence (bounds the launch grid without reading cu_seqlens on the host).
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_kv = 0;
  /// Flash forward kernel (see FlashImpl); Auto unless a test or benchmark pins one.
  FlashImpl flash_impl = FlashImpl::Auto;
  /// Tuning of the sm90 forward: keys per K/V tile, 0 (the default, 128), 64 or 128.
  int flash_sm90_block_n = 0;
  /// Tuning of the sm90 forward schedule: 0 (the default) CTA-synchronous double buffering; 1 / 2 a
  /// producer warpgroup + mbarrier pipeline of 2 / 3 K/V stages (consumer warpgroups decoupled); 3 / 4
  /// the same with ping-pong scheduling (the consumer warpgroups take turns issuing their wgmmas).
  int flash_sm90_variant = 0;
  /// Flash backward kernel of the default (non-deterministic, atomic-dQ) path: Auto is the wgmma
  /// kernel where it can run (as for the forward), else the mma.sync one; Sm90 where it cannot run is a
  /// ValueError. The deterministic backward is the mma.sync two-kernel path on every device.
  FlashImpl flash_bwd_impl = FlashImpl::Auto;
  /// Tuning of the sm90 backward (head_dim 128): 0 (the default) the dQ tile goes through shared memory
  /// and one bulk reduce-add (cp.reduce.async.bulk) per tile; 1 every thread adds its dQ rows into the f32
  /// accumulator with red.global.add (head_dim 64 always does).
  int flash_sm90_bwd_variant = 0;
};

/// out = softmax(scale q k^T + mask) v and lse (f32). out and lse must be allocated (see layouts).
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       const AttentionOptions& opts = {}, const Stream& s = {});

/// Gradients of sum(out * dout) for q, k, v, from forward's out and lse. dq/dk/dv are overwritten.
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionOptions& opts = {},
                        const Stream& s = {});

/// The backend Auto would use for this call (for logs and benchmarks); throws what the call would.
AttentionBackend attention_resolve_backend(const Tensor& q, const Tensor& k, const AttentionOptions& opts);

/// "auto", "cudnn", "flash", "reference".
const char* attention_backend_name(AttentionBackend b);

/// True when megacore's sm90 (wgmma) flash kernels can run on device d: a CUDA device of compute
/// capability 9.0 and a library built for sm_90a.
bool attention_flash_sm90_available(const Device& d);

/// True when this build contains the cuDNN SDPA path (cuDNN and cudnn-frontend found at build time) and it
/// is enabled (set_cudnn_attention_enabled).
bool attention_cudnn_available();
/// True when this build contains the cuDNN SDPA path, enabled or not.
bool attention_cudnn_built();

/// Process-wide switch for the cuDNN SDPA path (on by default where built in). Off: Auto uses megacore's
/// flash kernel, and asking for AttentionBackend::Cudnn is a ValueError that quotes `reason`. Python:
/// megacore.ops.set_cudnn_attention_enabled (docs/kernels.md, "cuDNN inside the Python module").
void set_cudnn_attention_enabled(bool on, const std::string& reason = "");
bool cudnn_attention_enabled();

/// cuDNN SDPA plan choice, process-wide. Off (the default): the heuristic's first plan, untimed. On: the
/// first call of a shape builds every engine configuration cuDNN offers and times each on that call's own
/// tensors (cudnn-frontend's autotune: the outputs are written several times, then by the fastest plan,
/// which later calls of the shape reuse); that call synchronises the device, so it must not happen inside
/// CUDA-graph capture or beside communication it would stall. Graphs built under each setting are cached
/// apart. Measured on H100 with cuDNN 9.19 (docs/kernels.md): 2 plans per causal d=128 shape, and the
/// heuristic's first was the faster one in every case, hence off.
void set_cudnn_attention_autotune(bool on);
bool cudnn_attention_autotune();

namespace ref {
/// Sizes for the f64 references. Tensors are contiguous in the layouts above (dense unless cu_q is
/// given; cu_q/cu_kv are host arrays of batch + 1 prefix sums).
struct AttentionDims {
  int64_t batch = 1, seqlen_q = 0, seqlen_kv = 0, heads = 1, kv_heads = 1, head_dim = 0;
  bool causal = false;
  double scale = 0;  ///< 0: 1 / sqrt(head_dim)
  const int32_t* cu_q = nullptr;
  const int32_t* cu_kv = nullptr;
  /// Packed: rows of q (lse is [heads, total_q]); 0 means cu_q[batch]. Tokens past cu_q[batch] belong to
  /// no sequence: their out/dq rows stay 0 and their lse -inf (as the caller initialised them).
  int64_t total_q = 0;
};
void attention_forward_f64(const AttentionDims& d, const double* q, const double* k, const double* v, double* out,
                           double* lse);
void attention_backward_f64(const AttentionDims& d, const double* q, const double* k, const double* v,
                            const double* out, const double* lse, const double* dout, double* dq, double* dk,
                            double* dv);
}  // namespace ref

}  // namespace megacore::ops
