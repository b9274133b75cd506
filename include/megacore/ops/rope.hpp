// Rotary position embedding (RoPE), forward and backward.
//
// x is [..., heads, head_dim] (f32/bf16/f16, contiguous); every token (a row of heads × head_dim) has
// one position id from `positions` (i32/i64, as many elements as x has tokens), so packed sequences
// simply restart their ids (see rope_positions_from_cu_seqlens). The first rotary_dim = 2 ×
// inv_freq.numel() features of each head are rotated; the rest pass through unchanged.
// Layouts: rotate-half (Llama / Hugging Face: pairs (i, i + rotary_dim/2)) or interleaved (GPT-J,
// Megatron's `rotary_interleaved`: pairs (2i, 2i+1)). Angles are position × inv_freq in f32, then
// sin/cos to full precision (the CPU reference rounds the same angle and evaluates in f64).
#pragma once

#include <cstdint>

#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::ops {

/// Frequency scaling for long context.
struct RopeScaling {
  enum class Type { None, Llama3 };
  Type type = Type::None;
  double factor = 8.0;                  ///< Llama 3.1/3.2: 8 (3.2 1B/3B: 32)
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position = 8192;  ///< context length of the unscaled model
};

struct RopeConfig {
  int64_t rotary_dim = 128;  ///< even; head_dim for full rotary, less for partial rotary
  double theta = 10000.0;    ///< base (Llama 3: 500000)
  RopeScaling scaling;
};

/// inv_freq[i] = theta^(-2i / rotary_dim) for i < rotary_dim / 2, with the scaling applied; f32 on d.
/// Compute it once per model and pass it to every call.
Tensor rope_inv_freq(const RopeConfig& cfg, Device d = Device::cpu(), const Stream& s = {});

/// y = rotate(x, positions × inv_freq). y may be x (in place).
void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, Tensor& y, bool interleaved,
                  const Stream& s = {});
/// dx = rotate(dy, -positions × inv_freq) (the transpose of forward). dx may be dy.
void rope_backward(const Tensor& dy, const Tensor& positions, const Tensor& inv_freq, Tensor& dx, bool interleaved,
                   const Stream& s = {});

/// The fused QKV projection's output split into contiguous q, k and v with RoPE applied to q and k, in
/// one pass over the tensor (equal, bit for bit, to three strided copies followed by rope_forward on q
/// and on k).
///   qkv:  [..., groups, hpg + 2, head_dim] (f32/bf16/f16, contiguous), in: per KV group its hpg query
///         heads, then its key head, then its value head (the layout of SelfAttention's fused weight)
///   positions: one id per token (i32/i64, tokens = the elements of the leading dimensions), in
///   inv_freq:  f32 [rotary_dim / 2] from rope_inv_freq, in
///   q:    [..., groups · hpg, head_dim], out; query head g·hpg + j is qkv's [g, j]
///   k, v: [..., groups, head_dim], out
/// q, k and v are contiguous, of qkv's dtype and device, and must not overlap qkv.
void qkv_split_rope(const Tensor& qkv, const Tensor& positions, const Tensor& inv_freq, Tensor& q, Tensor& k,
                    Tensor& v, bool interleaved, const Stream& s = {});
/// The transpose of qkv_split_rope: dqkv = the grouped layout of (rope_backward(dq), rope_backward(dk), dv),
/// in one pass (equal, bit for bit, to rope_backward on dq and on dk followed by three strided copies).
///   dq: [..., groups · hpg, head_dim], dk, dv: [..., groups, head_dim] (contiguous, one dtype), in
///   positions, inv_freq: as for qkv_split_rope
///   dqkv: [..., groups, hpg + 2, head_dim], contiguous, out; must not overlap the inputs
void qkv_merge_rope_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& positions,
                             const Tensor& inv_freq, Tensor& dqkv, bool interleaved, const Stream& s = {});

/// Position ids of packed sequences on the host: for cu_seqlens [0, 3, 5] gives [0, 1, 2, 0, 1] (i32).
Tensor rope_positions_from_cu_seqlens(const Tensor& cu_seqlens);

namespace ref {
/// Float64 reference on raw arrays: x and y are [tokens, heads, head_dim]; inv_freq has rotary_dim/2
/// entries; backward rotates by the negative angle.
void rope_f64(const double* x, const int64_t* positions, const double* inv_freq, double* y, int64_t tokens,
              int64_t heads, int64_t head_dim, int64_t rotary_dim, bool interleaved, bool backward);
}  // namespace ref

}  // namespace megacore::ops
