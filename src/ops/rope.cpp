#include "megacore/ops/rope.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <utility>
#include <vector>

#include "megacore/build_config.hpp"
#include "megacore/ops/ops_common.hpp"
#include "ops/cuda/rope_cuda.hpp"
#include "ops/memops_cpu.hpp"

namespace megacore::ops {
namespace {

using cpu::ld;
using cpu::st;

// cos and sin (negated for backward) of position × inv_freq for one token. F is float for the Tensor
// path (angle rounded to f32 as on the GPU) and double for the f64 reference.
template <class F, class P>
void token_angles(P position, const F* inv_freq, int64_t half, bool backward, std::vector<double>& c,
                  std::vector<double>& s) {
  for (int64_t i = 0; i < half; ++i) {
    const F ang = F(position) * inv_freq[i];
    c[i] = std::cos(double(ang));
    s[i] = backward ? -std::sin(double(ang)) : std::sin(double(ang));
  }
}

// One head: its first rot features rotated by the token's angles, the rest copied (unless in place).
// The fused QKV split and merge go through here too, so they round exactly as rope_forward/backward do.
template <class T>
void rotate_head(const T* xh, T* yh, const std::vector<double>& c, const std::vector<double>& s, int64_t d,
                 int64_t rot, bool interleaved) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t i1 = interleaved ? 2 * i : i, i2 = interleaved ? 2 * i + 1 : i + half;
    const double a = ld(xh[i1]), b = ld(xh[i2]);
    yh[i1] = st<T>(a * c[i] - b * s[i]);
    yh[i2] = st<T>(b * c[i] + a * s[i]);
  }
  if (xh != yh)
    for (int64_t j = rot; j < d; ++j) yh[j] = xh[j];
}

template <class T, class F, class P>
void rope_cpu(const T* x, const P* positions, const F* inv_freq, T* y, int64_t tokens, int64_t heads, int64_t d,
              int64_t rot, bool interleaved, bool backward) {
  const int64_t half = rot / 2;
  std::vector<double> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
  for (int64_t t = 0; t < tokens; ++t) {
    token_angles(positions[t], inv_freq, half, backward, c, s);
    for (int64_t h = 0; h < heads; ++h)
      rotate_head(x + (t * heads + h) * d, y + (t * heads + h) * d, c, s, d, rot, interleaved);
  }
}

// The grouped QKV rows [tokens, groups, hpg + 2, d] against q [tokens, groups · hpg, d], k and v
// [tokens, groups, d]: split (grouped → parts, forward angles) or merge (parts → grouped, backward).
template <class T, class P>
void qkv_rope_cpu(T* grouped, T* q, T* k, T* v, const P* positions, const float* inv_freq, int64_t tokens,
                  int64_t groups, int64_t hpg, int64_t d, int64_t rot, bool interleaved, bool merge) {
  const int64_t half = rot / 2;
  std::vector<double> c(static_cast<size_t>(half)), s(static_cast<size_t>(half));
  for (int64_t t = 0; t < tokens; ++t) {
    token_angles(positions[t], inv_freq, half, merge, c, s);
    for (int64_t g = 0; g < groups; ++g) {
      T* row = grouped + (t * groups + g) * (hpg + 2) * d;
      for (int64_t j = 0; j <= hpg; ++j) {
        T* part = j < hpg ? q + ((t * groups + g) * hpg + j) * d : k + (t * groups + g) * d;
        if (merge) rotate_head<T>(part, row + j * d, c, s, d, rot, interleaved);
        else rotate_head<T>(row + j * d, part, c, s, d, rot, interleaved);
      }
      T* vrow = v + (t * groups + g) * d;
      if (merge) std::copy(vrow, vrow + d, row + (hpg + 1) * d);
      else std::copy(row + (hpg + 1) * d, row + (hpg + 2) * d, vrow);
    }
  }
}

// The inv_freq and positions checks every entry point shares; returns rotary_dim.
int64_t check_angles(const char* op, const Tensor& positions, const Tensor& inv_freq, Device dev, int64_t d,
                     int64_t tokens, const char* xn, const Tensor& x) {
  detail::check_dtype(inv_freq, DType::F32, op, "inv_freq");
  detail::check_contiguous(inv_freq, op, "inv_freq");
  detail::check_same_device(inv_freq, dev, op, "inv_freq");
  MC_CHECK(inv_freq.dim() == 1, "{}: inv_freq must be 1-D [rotary_dim/2], got shape {}; build it with rope_inv_freq",
           op, shape_str(inv_freq.shape()));
  const int64_t rot = 2 * inv_freq.numel();
  MC_CHECK(rot >= 2 && rot <= d, "{}: rotary_dim = 2 x inv_freq.numel() = {} must be in [2, head_dim = {}]", op, rot, d);
  detail::check_index_input(positions, op, "positions");
  detail::check_same_device(positions, dev, op, "positions");
  MC_CHECK(positions.numel() == tokens,
           "{}: positions has {} elements but {} of shape {} has {} tokens (rows of heads x head_dim); give one "
           "position id per token",
           op, positions.numel(), xn, shape_str(x.shape()), tokens);
  return rot;
}

// An output of x's dtype, shape and device, contiguous.
void check_output(const char* op, const Tensor& y, const char* yn, const Tensor& x, const char* xn, const Shape& shape) {
  detail::check_defined(y, op, yn);
  MC_CHECK(y.dtype() == x.dtype(), "{}: {} has dtype {} but {} has {}", op, yn, dtype_name(y.dtype()), xn,
           dtype_name(x.dtype()));
  detail::check_shape(y, shape, op, yn);
  detail::check_contiguous(y, op, yn);
  detail::check_same_device(y, x.device(), op, yn);
}

#if MEGACORE_WITH_CUDA
void set_common(cuda::RopeCommon& a, const Tensor& positions, const Tensor& inv_freq, int64_t tokens, int64_t d,
                int64_t rot, bool interleaved) {
  a.positions = positions.data_ptr();
  a.positions_i64 = positions.dtype() == DType::I64;
  a.inv_freq = inv_freq.data<float>();
  a.tokens = tokens;
  a.head_dim = d;
  a.rotary_dim = rot;
  a.interleaved = interleaved;
}
#endif

void rope_impl(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, Tensor& y, bool interleaved,
               bool backward, const Stream& s) {
  const char* op = backward ? "rope_backward" : "rope_forward";
  const char* xn = backward ? "dy" : "x";
  const char* yn = backward ? "dx" : "y";
  detail::check_float_input(x, op, xn);
  MC_CHECK(x.dim() >= 3, "{}: {} must be [..., heads, head_dim] (at least 3 dimensions), got shape {}", op, xn,
           shape_str(x.shape()));
  const int64_t d = x.size(-1), heads = x.size(-2);
  const int64_t tokens = (d == 0 || heads == 0) ? 0 : x.numel() / (d * heads);
  const Device dev = x.device();
  const int64_t rot = check_angles(op, positions, inv_freq, dev, d, tokens, xn, x);
  check_output(op, y, yn, x, xn, x.shape());

  if (dev.is_cuda()) {
    void* stream = detail::launch_stream(s, dev, op);
#if MEGACORE_WITH_CUDA
    cuda::RopeArgs a;
    set_common(a, positions, inv_freq, tokens, d, rot, interleaved);
    a.x = x.data_ptr();
    a.y = y.data_ptr();
    a.heads = heads;
    a.backward = backward;
    cuda::rope(x.dtype(), a, dev.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  cpu::dispatch_float_index(x.dtype(), positions.dtype(), [&](auto tag, auto ptag) {
    using T = decltype(tag);
    using P = decltype(ptag);
    rope_cpu<T, float, P>(x.data<T>(), positions.data<P>(), inv_freq.data<float>(), y.data<T>(), tokens, heads, d,
                          rot, interleaved, backward);
  });
}

// qkv_split_rope (merge = false: grouped is read, q/k/v written) and qkv_merge_rope_backward (merge =
// true: dq/dk/dv read, grouped written).
void qkv_rope_impl(const Tensor& grouped, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& positions,
                   const Tensor& inv_freq, bool interleaved, bool merge, const Stream& s) {
  const char* op = merge ? "qkv_merge_rope_backward" : "qkv_split_rope";
  const char* gn = merge ? "dqkv" : "qkv";
  const char* qn = merge ? "dq" : "q";
  const char* kn = merge ? "dk" : "k";
  const char* vn = merge ? "dv" : "v";
  const Tensor& in = merge ? q : grouped;  // the first input: dtype and device of all the others
  const char* in_n = merge ? qn : gn;
  detail::check_float_input(in, op, in_n);
  detail::check_defined(grouped, op, gn);
  MC_CHECK(grouped.dim() >= 4 && grouped.size(-2) >= 3,
           "{}: {} must be [..., groups, heads_per_group + 2, head_dim] (at least 4 dimensions, at least one query "
           "head per group), got shape {}",
           op, gn, shape_str(grouped.shape()));
  const int64_t groups = grouped.size(-3), hpg = grouped.size(-2) - 2, d = grouped.size(-1);
  Shape q_shape(grouped.shape().begin(), grouped.shape().end() - 3), kv_shape = q_shape;
  const int64_t tokens = shape_numel(q_shape);
  q_shape.insert(q_shape.end(), {groups * hpg, d});
  kv_shape.insert(kv_shape.end(), {groups, d});
  const Device dev = in.device();
  const int64_t rot = check_angles(op, positions, inv_freq, dev, d, tokens, gn, grouped);
  check_output(op, grouped, gn, in, in_n, grouped.shape());
  check_output(op, q, qn, in, in_n, q_shape);
  check_output(op, k, kn, in, in_n, kv_shape);
  check_output(op, v, vn, in, in_n, kv_shape);
  for (const auto& [t, n] : {std::pair{&q, qn}, std::pair{&k, kn}, std::pair{&v, vn}})
    MC_CHECK(!detail::overlaps(grouped, *t),
             "{}: {} and {} share memory; the fused split/merge needs separate buffers (allocate {} with "
             "Tensor::empty)",
             op, gn, n, merge ? gn : n);

  if (dev.is_cuda()) {
    void* stream = detail::launch_stream(s, dev, op);
#if MEGACORE_WITH_CUDA
    cuda::QkvRopeArgs a;
    set_common(a, positions, inv_freq, tokens, d, rot, interleaved);
    a.qkv = grouped.data_ptr();
    a.q = q.data_ptr();
    a.k = k.data_ptr();
    a.v = v.data_ptr();
    a.groups = groups;
    a.hpg = hpg;
    a.merge = merge;
    a.tuning = merge ? cuda::kQkvMergeTuning : cuda::kQkvSplitTuning;
    cuda::qkv_rope(in.dtype(), a, dev.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  cpu::dispatch_float_index(in.dtype(), positions.dtype(), [&](auto tag, auto ptag) {
    using T = decltype(tag);
    using P = decltype(ptag);
    qkv_rope_cpu<T, P>(grouped.data<T>(), q.data<T>(), k.data<T>(), v.data<T>(), positions.data<P>(),
                       inv_freq.data<float>(), tokens, groups, hpg, d, rot, interleaved, merge);
  });
}

}  // namespace

Tensor rope_inv_freq(const RopeConfig& cfg, Device d, const Stream& s) {
  MC_CHECK(cfg.rotary_dim >= 2 && cfg.rotary_dim % 2 == 0, "rope_inv_freq: rotary_dim must be even and >= 2, got {}",
           cfg.rotary_dim);
  MC_CHECK(cfg.theta > 0, "rope_inv_freq: theta must be > 0, got {}", cfg.theta);
  const int64_t half = cfg.rotary_dim / 2;
  std::vector<float> f(static_cast<size_t>(half));
  const auto& sc = cfg.scaling;
  if (sc.type == RopeScaling::Type::Llama3) {
    MC_CHECK(sc.factor > 0 && sc.high_freq_factor > sc.low_freq_factor && sc.original_max_position > 0,
             "rope_inv_freq: Llama-3 scaling needs factor > 0, high_freq_factor > low_freq_factor and "
             "original_max_position > 0 (got {}, {}, {}, {})",
             sc.factor, sc.low_freq_factor, sc.high_freq_factor, sc.original_max_position);
  }
  for (int64_t i = 0; i < half; ++i) {
    double inv = 1.0 / std::pow(cfg.theta, double(2 * i) / double(cfg.rotary_dim));
    if (sc.type == RopeScaling::Type::Llama3) {
      // Wavelengths longer than the original context are stretched by `factor`; short ones are kept;
      // the band between is interpolated linearly in (context / wavelength).
      const double wavelen = 2 * std::numbers::pi / inv;
      const double low_wavelen = sc.original_max_position / sc.low_freq_factor;
      const double high_wavelen = sc.original_max_position / sc.high_freq_factor;
      if (wavelen > low_wavelen) {
        inv /= sc.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth =
            (sc.original_max_position / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor);
        inv = (1 - smooth) * inv / sc.factor + smooth * inv;
      }
    }
    f[size_t(i)] = float(inv);
  }
  return Tensor::from_vector(f, {half}).to(d, s);
}

void rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq, Tensor& y, bool interleaved,
                  const Stream& s) {
  rope_impl(x, positions, inv_freq, y, interleaved, false, s);
}

void rope_backward(const Tensor& dy, const Tensor& positions, const Tensor& inv_freq, Tensor& dx, bool interleaved,
                   const Stream& s) {
  rope_impl(dy, positions, inv_freq, dx, interleaved, true, s);
}

void qkv_split_rope(const Tensor& qkv, const Tensor& positions, const Tensor& inv_freq, Tensor& q, Tensor& k,
                    Tensor& v, bool interleaved, const Stream& s) {
  qkv_rope_impl(qkv, q, k, v, positions, inv_freq, interleaved, /*merge=*/false, s);
}

void qkv_merge_rope_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& positions,
                             const Tensor& inv_freq, Tensor& dqkv, bool interleaved, const Stream& s) {
  qkv_rope_impl(dqkv, dq, dk, dv, positions, inv_freq, interleaved, /*merge=*/true, s);
}

Tensor rope_positions_from_cu_seqlens(const Tensor& cu_seqlens) {
  const char* op = "rope_positions_from_cu_seqlens";
  detail::check_index_input(cu_seqlens, op, "cu_seqlens");
  MC_CHECK(cu_seqlens.device().is_cpu(), "{}: cu_seqlens must be on the host; copy it with .to(Device::cpu())", op);
  MC_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1, "{}: cu_seqlens must be 1-D [sequences + 1]", op);
  auto cu = cu_seqlens.to_double_vector();
  MC_CHECK(cu[0] == 0, "{}: cu_seqlens must start at 0, got {}", op, cu[0]);
  for (size_t i = 1; i < cu.size(); ++i)
    MC_CHECK(cu[i] >= cu[i - 1], "{}: cu_seqlens must be non-decreasing (entry {} is {} after {})", op, i, cu[i],
             cu[i - 1]);
  std::vector<int32_t> pos(static_cast<size_t>(cu.back()));
  for (size_t i = 1; i < cu.size(); ++i)
    for (int64_t t = int64_t(cu[i - 1]); t < int64_t(cu[i]); ++t) pos[size_t(t)] = int32_t(t - int64_t(cu[i - 1]));
  return Tensor::from_vector(pos, {int64_t(pos.size())});
}

namespace ref {
void rope_f64(const double* x, const int64_t* positions, const double* inv_freq, double* y, int64_t tokens,
              int64_t heads, int64_t head_dim, int64_t rotary_dim, bool interleaved, bool backward) {
  rope_cpu<double, double, int64_t>(x, positions, inv_freq, y, tokens, heads, head_dim, rotary_dim, interleaved,
                                    backward);
}
}  // namespace ref

}  // namespace megacore::ops
