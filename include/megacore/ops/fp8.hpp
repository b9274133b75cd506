// FP8 casts and per-tensor scaling (Transformer Engine's delayed and current scaling).
//
// A tensor x is stored in FP8 as q = fp8(x · scale) with one f32 scale per tensor; GEMMs on q multiply
// by scale_inv = 1 / scale (ops::gemm_fp8). The scale keeps |x| · scale within the format's range:
//
//   scale = fp8_max / amax / 2^margin        (fp8_max: 448 for E4M3, 57344 for E5M2)
//
// Delayed scaling takes amax from a history of the last L steps' amaxes (reduced by max, or the most
// recent), so the cast of step t uses amaxes up to step t − 1 and needs no extra pass over x. Current
// scaling computes amax of x itself first (ops::fp8_amax), then the scale, then the cast. When amax is 0
// or not finite (or the scale would not be finite), the previous scale is kept, as Transformer Engine
// does. The rounding (nearest even, saturating to ±fp8_max) is that of core/dtype.hpp's float8 types.
//
// Scales, amaxes and histories are device tensors (f32), so none of this synchronises with the host.
#pragma once

#include <cstdint>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

/// out = fp8(x · scale) (round to nearest even, saturating).
///   x       f32, bf16 or f16, contiguous, any shape (in)
///   scale   f32, one element, x's device (in)
///   out     F8E4M3 or F8E5M2, x's shape, contiguous (out)
///   amax    optional f32, one element (in/out): amax = max(amax, max |x|), NaN propagating; amax must
///           hold a value >= 0 before the call (an amax history row starts at 0)
///   counts  optional i64 [2] (in/out): counts[0] += elements whose |x · scale| exceeds fp8_max
///           (saturated), counts[1] += non-zero elements that became ±0 (flushed to zero)
void fp8_cast(const Tensor& x, const Tensor& scale, Tensor& out, const Tensor& amax = {}, const Tensor& counts = {},
              const Stream& s = {});

/// One pass over a matrix giving its FP8 codes and their transpose: the weight-gradient GEMM dW = dyᵀ x
/// needs dyᵀ and xᵀ K-contiguous (ops::gemm_fp8 takes only that layout), and the forward / input-gradient
/// products need the untransposed codes, so both come from one read of x (Transformer Engine's
/// cast-transpose).
///   x       f32, bf16 or f16 [rows, cols], contiguous (in)
///   scale   f32, one element, x's device (in)
///   out     optional F8E4M3 or F8E5M2 [rows, cols], contiguous (out): fp8_cast's codes; undefined to skip
///   out_t   F8E4M3 or F8E5M2 (out's dtype when out is given) [cols, rows], contiguous (out):
///           out_t[j, i] = out[i, j]
///   amax, counts   as fp8_cast's (each element counted once)
void fp8_cast_transpose(const Tensor& x, const Tensor& scale, const Tensor& out, const Tensor& out_t,
                        const Tensor& amax = {}, const Tensor& counts = {}, const Stream& s = {});

/// amax = max(amax, max |x|) without a cast (current scaling's first pass). x f32/bf16/f16 contiguous;
/// amax f32, one element, >= 0 before the call.
void fp8_amax(const Tensor& x, const Tensor& amax, const Stream& s = {});

/// out = float(q) · scale_inv. q F8E4M3/F8E5M2 contiguous; scale_inv f32, one element; out f32, bf16 or
/// f16 of q's shape, contiguous.
void fp8_dequant(const Tensor& q, const Tensor& scale_inv, Tensor& out, const Stream& s = {});

/// How an amax history becomes the amax a scale is computed from.
enum class Fp8AmaxAlgo { Max, MostRecent };

/// The scale update of n tensors, each with an amax history column.
///   history    f32 [L, n] (in/out): row 0 holds this step's amax (what fp8_cast / fp8_amax reduced
///              into, already reduced over the ranks that must agree), row k the amax of k steps ago
///   scale      f32 [n] (in/out), scale_inv f32 [n] (out)
///   fp8_max    f32 [n]: each tensor's format maximum (fp8_max(DType))
/// For each column j: a = max over the L rows (Max) or row 0 (MostRecent); when a > 0 and finite,
/// scale[j] = fp8_max[j] / a / 2^margin (kept when that is not finite), scale_inv[j] = 1 / scale[j].
/// Then, with `roll`, the history moves down one row (the oldest drops out) and row 0 is zeroed for the
/// next step's amax.
void fp8_update_scales(const Tensor& history, const Tensor& scale, const Tensor& scale_inv, const Tensor& fp8_max,
                       Fp8AmaxAlgo algo, int margin, bool roll = true, const Stream& s = {});

/// The first scale of n delayed-scaling tensors, from the tensors' own amaxes (what current scaling would use),
/// so a run's first step does not cast with the initial scale of 1.
///   amax      f32 [n]: this cast's amax (already reduced over the ranks that must agree); < 0 = not this tensor
///   seeded    f32 [n] (in/out): 0 until a tensor's scale has been seeded, then 1 (kept in checkpoints, so a
///             resumed run keeps its delayed scales)
/// For each j with amax[j] >= 0 and seeded[j] == 0: scale[j] and scale_inv[j] as fp8_update_scales computes
/// them from a = amax[j] (kept when a is 0), and seeded[j] = 1.
void fp8_seed_scales(const Tensor& amax, const Tensor& seeded, const Tensor& scale, const Tensor& scale_inv,
                     const Tensor& fp8_max, int margin, const Stream& s = {});

}  // namespace megacore::ops
