// Matrix products: out = alpha * op(a) @ op(b) + beta * out, with fused epilogues.
//
// Row-major convention: a is [M, K] (or [K, M] with trans_a), b is [K, N] (or [N, K] with trans_b),
// out is [M, N]. A matrix view whose rows are not contiguous but whose columns are (a transposed
// view, stride(-2) == 1) is taken as the transposed operand, so a.transpose(0, 1) needs no copy.
// 3-D operands are batched (strided-batched): [B, M, K] etc.; a 2-D operand next to 3-D ones is
// shared by every batch entry.
//
// Inputs are f32, bf16 or f16 (a and b the same); arithmetic accumulates in f32. out is a's dtype,
// or f32 when a and b are 16-bit (beta = 1 then accumulates bf16 products into f32 main grads).
// f32 inputs use full-precision f32 unless allow_tf32 is set (tf32: relative error near 3e-4).
//
// On CUDA the product runs through cuBLASLt with a heuristic plan cached per (device, shape, dtypes,
// layout, epilogue, alignment); on the CPU through Eigen (f32 accumulation).
#pragma once

#include <cstdint>
#include <span>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

/// What happens to the product before (or beside) the store.
enum class GemmEpilogue {
  None,
  Bias,        ///< out[m, n] += bias[n]
  Gelu,        ///< out = gelu_tanh(product)
  BiasGelu,    ///< out = gelu_tanh(product + bias[n])
  BiasGradA,   ///< also writes bias[m] = sum_k op(a)[m, k] (a linear layer's db from a = dY^T)
  BiasGradB,   ///< also writes bias[n] = sum_k op(b)[k, n]
};

struct GemmOptions {
  bool trans_a = false;
  bool trans_b = false;
  float alpha = 1.f;
  /// 0 overwrites out; 1 accumulates into it (gradient accumulation). out's old values are read only
  /// when beta != 0.
  float beta = 0.f;
  GemmEpilogue epilogue = GemmEpilogue::None;
  /// Bias vector for Bias/BiasGelu (read, out's dtype), or the bias-gradient output for BiasGrad*
  /// (written, overwritten even when beta = 1, out's dtype). [N] (or [M] for BiasGradA); with
  /// batched operands the same bias serves every batch entry (bias epilogues) — BiasGrad* needs B = 1.
  Tensor bias;
  /// f32 only: let the tensor cores round inputs to tf32.
  bool allow_tf32 = false;
  /// When defined, the beta term reads this tensor instead of out: out = alpha * op(a) @ op(b) + beta * c
  /// (+ epilogue). Same shape and dtype as out, last dimension contiguous, any row (and batch) stride, e.g.
  /// a column range of a wider product; it must not overlap out. Saves the copy into out before an
  /// accumulating product (LoRA's fused path adds its low-rank term this way).
  Tensor c;
  /// false: this product keeps cuBLASLt's heuristic first choice even while autotuning is on (see
  /// GemmAutotune), for shapes that change from call to call (one product per expert, whose row count
  /// follows the routing), where timing each new shape would synchronise the stream every time.
  bool autotune = true;
};

/// out = alpha * op(a) @ op(b) + beta * out (+ epilogue). out must be allocated with the right shape
/// and dtype (see the header comment); its last dimension must be contiguous.
void gemm(const Tensor& a, const Tensor& b, Tensor& out, const GemmOptions& opts = {}, const Stream& s = {});

/// Allocates out (a's dtype, or f32 when out_f32 is set for 16-bit inputs) and computes it with beta = 0.
Tensor matmul(const Tensor& a, const Tensor& b, const GemmOptions& opts = {}, const Stream& s = {},
              bool out_f32 = false);

/// SMs the GEMMs on a CUDA device leave to work running beside them.
///
/// cuBLASLt's Hopper kernels are often persistent: one CTA per SM, each looping over output tiles.
/// When a collective (DDP's overlapped gradient reduction, ZeRO's parameter all-gather) holds some SMs,
/// the CTAs that find no free SM only start when others have finished their whole share, and the
/// product can take up to twice as long. With a margin, products are planned and launched for
/// (SM count - margin) SMs (cuBLASLt's SM-count target), so they fit beside the collective.
///
/// A request holds a margin for a device while it lives; the margin in force is the largest held
/// (0: none, the default). It applies to GEMMs *enqueued* while it is held: hold it from before the
/// collective is enqueued until after the last product that may run beside it is enqueued. CPU devices
/// ignore it.
class GemmSmMarginRequest {
 public:
  GemmSmMarginRequest() = default;
  /// margin >= 0 SMs on CUDA device `device` (ValueError otherwise).
  GemmSmMarginRequest(int device, int margin);
  ~GemmSmMarginRequest() { release(); }
  GemmSmMarginRequest(GemmSmMarginRequest&& o) noexcept : device_(o.device_), margin_(o.margin_) { o.device_ = -1; }
  GemmSmMarginRequest& operator=(GemmSmMarginRequest&& o) noexcept;
  GemmSmMarginRequest(const GemmSmMarginRequest&) = delete;
  GemmSmMarginRequest& operator=(const GemmSmMarginRequest&) = delete;
  void release();
  bool active() const { return device_ >= 0; }

 private:
  int device_ = -1;
  int margin_ = 0;
};

/// The margin in force on CUDA device `device` (the largest held request; 0 when none).
int gemm_sm_margin(int device);

/// Timed choice among cuBLASLt's candidate kernels (CUDA only).
///
/// cuBLASLt's heuristic ranks its kernels by a model; its first choice is sometimes a few percent
/// slower than another candidate (on H100, the 8192x14336x4096 data-gradient product of a Llama FFN).
/// With autotuning on, the first call of a shape times the heuristic's candidates on the call's own
/// operands and keeps the fastest in the plan cache. Only candidates without split-K or a separate
/// reduction are timed, so every candidate sums each output in the same order as the first choice.
/// Calls that cannot be repeated harmlessly keep the first heuristic choice: beta != 0 (the output is
/// read) and streams being captured into a CUDA graph. The timing synchronises the calling stream
/// once per shape (tens of milliseconds for the largest products). ops::gemm_fp8 follows the same policy.
struct GemmAutotune {
  bool enabled = true;      ///< default on; MEGACORE_GEMM_AUTOTUNE=0 in the environment turns it off
  double min_gflop = 20.0;  ///< smaller products (2*m*n*k*batch/1e9) keep the heuristic's first choice
  int candidates = 8;       ///< heuristic candidates asked for (2..32)
  /// Candidates to time for a product of `gflop` GFLOP that overwrites its output (0: the heuristic's first choice).
  int candidates_for(double gflop) const { return enabled && gflop >= min_gflop ? candidates : 0; }
};
/// Sets the policy for products planned from now on (plans already cached keep their choice).
/// ValueError for candidates outside [2, 32] or a negative min_gflop.
void set_gemm_autotune(const GemmAutotune& policy);
GemmAutotune gemm_autotune();

/// Several independent products with the same options (e.g. one per expert or per micro-batch);
/// equal shapes reuse one cached plan.
void gemm_batched(std::span<const Tensor> a, std::span<const Tensor> b, std::span<Tensor> out,
                  const GemmOptions& opts = {}, const Stream& s = {});

namespace ref {
/// Float64 plain-loop reference: c[M, N] (row-major, contiguous) = alpha * op(a) op(b) + beta * c, with
/// a, b row-major contiguous in their stored shapes. Used by tests.
void gemm_f64(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
              const double* b, double beta, double* c);
/// The tanh GELU the epilogues apply.
double gelu_tanh(double x);
}  // namespace ref

}  // namespace megacore::ops
