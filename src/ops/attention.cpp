#include "megacore/ops/attention.hpp"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "megacore/build_config.hpp"
#include "megacore/core/log.hpp"
#include "megacore/ops/ops_common.hpp"
#include "ops/attention_tuned.hpp"
#include "ops/cuda/attention_cuda.hpp"

namespace megacore::ops {

namespace {
std::atomic<bool> g_cudnn_autotune{false};
std::atomic<bool> g_cudnn_enabled{true};
std::mutex g_cudnn_reason_mu;
std::string g_cudnn_off_reason;  // guarded by g_cudnn_reason_mu

[[maybe_unused]] std::string cudnn_off_reason() {
  std::lock_guard<std::mutex> lock(g_cudnn_reason_mu);
  return g_cudnn_off_reason.empty() ? "it was turned off with set_cudnn_attention_enabled(false)" : g_cudnn_off_reason;
}
}  // namespace

// ---- f64 reference ------------------------------------------------------------------------------
namespace ref {
namespace {

struct Seq {
  int64_t q0, nq, k0, nk;  // first token row and length of sequence b in q and in k
};

Seq seq_of(const AttentionDims& d, int64_t b) {
  if (d.cu_q) return {d.cu_q[b], d.cu_q[b + 1] - d.cu_q[b], d.cu_kv[b], d.cu_kv[b + 1] - d.cu_kv[b]};
  return {b * d.seqlen_q, d.seqlen_q, b * d.seqlen_kv, d.seqlen_kv};
}

int64_t lse_index(const AttentionDims& d, int64_t b, int64_t h, int64_t i, const Seq& s) {
  if (d.cu_q) return h * (d.total_q > 0 ? d.total_q : d.cu_q[d.batch]) + s.q0 + i;
  return (b * d.heads + h) * d.seqlen_q + i;
}

double scale_of(const AttentionDims& d) { return d.scale != 0 ? d.scale : 1.0 / std::sqrt(double(d.head_dim)); }

}  // namespace

void attention_forward_f64(const AttentionDims& d, const double* q, const double* k, const double* v, double* out,
                           double* lse) {
  const int64_t H = d.heads, Hk = d.kv_heads, D = d.head_dim, group = H / Hk;
  const double scale = scale_of(d);
  std::vector<double> p;
  for (int64_t b = 0; b < d.batch; ++b) {
    const Seq s = seq_of(d, b);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < s.nq; ++i) {
        const double* qi = q + ((s.q0 + i) * H + h) * D;
        double* oi = out + ((s.q0 + i) * H + h) * D;
        const int64_t nk = d.causal ? std::min(s.nk, i + 1) : s.nk;
        p.assign(size_t(nk), 0.0);
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < nk; ++j) {
          const double* kj = k + ((s.k0 + j) * Hk + hk) * D;
          double acc = 0;
          for (int64_t e = 0; e < D; ++e) acc += qi[e] * kj[e];
          p[size_t(j)] = acc * scale;
          mx = std::max(mx, p[size_t(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j < nk; ++j) sum += (p[size_t(j)] = std::exp(p[size_t(j)] - mx));
        for (int64_t e = 0; e < D; ++e) oi[e] = 0;
        for (int64_t j = 0; j < nk; ++j) {
          const double* vj = v + ((s.k0 + j) * Hk + hk) * D;
          const double w = p[size_t(j)] / sum;
          for (int64_t e = 0; e < D; ++e) oi[e] += w * vj[e];
        }
        lse[lse_index(d, b, h, i, s)] = nk > 0 ? mx + std::log(sum) : -std::numeric_limits<double>::infinity();
      }
    }
  }
}

void attention_backward_f64(const AttentionDims& d, const double* q, const double* k, const double* v,
                            const double* out, const double* lse, const double* dout, double* dq, double* dk,
                            double* dv) {
  const int64_t H = d.heads, Hk = d.kv_heads, D = d.head_dim, group = H / Hk;
  const double scale = scale_of(d);
  const int64_t tq = d.cu_q ? d.cu_q[d.batch] : d.batch * d.seqlen_q;
  const int64_t tk = d.cu_kv ? d.cu_kv[d.batch] : d.batch * d.seqlen_kv;
  std::fill(dq, dq + tq * H * D, 0.0);
  std::fill(dk, dk + tk * Hk * D, 0.0);
  std::fill(dv, dv + tk * Hk * D, 0.0);
  for (int64_t b = 0; b < d.batch; ++b) {
    const Seq s = seq_of(d, b);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = h / group;
      for (int64_t i = 0; i < s.nq; ++i) {
        const int64_t qoff = ((s.q0 + i) * H + h) * D;
        double drow = 0;
        for (int64_t e = 0; e < D; ++e) drow += dout[qoff + e] * out[qoff + e];
        const double l = lse[lse_index(d, b, h, i, s)];
        const int64_t nk = d.causal ? std::min(s.nk, i + 1) : s.nk;
        for (int64_t j = 0; j < nk; ++j) {
          const int64_t koff = ((s.k0 + j) * Hk + hk) * D;
          double sc = 0, dp = 0;
          for (int64_t e = 0; e < D; ++e) {
            sc += q[qoff + e] * k[koff + e];
            dp += dout[qoff + e] * v[koff + e];
          }
          const double pij = std::exp(sc * scale - l);
          const double ds = pij * (dp - drow);
          for (int64_t e = 0; e < D; ++e) {
            dv[koff + e] += pij * dout[qoff + e];
            dq[qoff + e] += scale * ds * k[koff + e];
            dk[koff + e] += scale * ds * q[qoff + e];
          }
        }
      }
    }
  }
}

}  // namespace ref

// ---- argument checks -----------------------------------------------------------------------------
namespace {

struct Geometry {
  bool packed = false;
  int64_t batch = 0, sq = 0, skv = 0, heads = 0, kv_heads = 0, dim = 0, total_q = 0, total_kv = 0;
  Shape lse_shape;
};

void check_tensor(const Tensor& t, DType dt, Device dev, const Shape& shape, const char* op, const char* name) {
  detail::check_defined(t, op, name);
  MC_CHECK(t.dtype() == dt, "{}: {} has dtype {} but q has {}; they must match", op, name, dtype_name(t.dtype()),
           dtype_name(dt));
  detail::check_same_device(t, dev, op, name);
  MC_CHECK(t.shape() == shape, "{}: {} has shape {}, expected {}", op, name, shape_str(t.shape()), shape_str(shape));
  MC_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, "{}: {} must have a contiguous last (head) dimension, strides {}", op,
           name, shape_str(t.strides()));
}

Geometry check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& o, const char* op) {
  detail::check_defined(q, op, "q");
  detail::check_defined(k, op, "k");
  detail::check_defined(v, op, "v");
  MC_CHECK(is_floating(q.dtype()), "{}: q has dtype {}; it must be f32, bf16 or f16", op, dtype_name(q.dtype()));
  Geometry g;
  g.packed = o.cu_seqlens_q.defined() || o.cu_seqlens_kv.defined();
  const int64_t nd = g.packed ? 3 : 4;
  MC_CHECK(q.dim() == nd && k.dim() == nd,
           "{}: q {} and k {} must be {}; {}", op, shape_str(q.shape()), shape_str(k.shape()),
           g.packed ? "3-D [tokens, heads, head_dim] in packed mode" : "4-D [batch, seq, heads, head_dim]",
           g.packed ? "drop cu_seqlens for padded batches" : "pass cu_seqlens_q/kv for packed 3-D tensors");
  g.heads = q.size(-2), g.kv_heads = k.size(-2), g.dim = q.size(-1);
  MC_CHECK(k.size(-1) == g.dim, "{}: q has head_dim {} but k has {}; they must match", op, g.dim, k.size(-1));
  MC_CHECK(g.kv_heads > 0 && g.heads % g.kv_heads == 0,
           "{}: q has {} heads and k has {}; the query heads must be a multiple of the key/value heads (GQA)", op,
           g.heads, g.kv_heads);
  MC_CHECK(g.dim > 0, "{}: head_dim must be positive", op);
  // The sm90 tuning fields are checked whatever kernel runs: Auto must not quietly take another kernel
  // because one of them is out of range.
  MC_CHECK(o.flash_sm90_block_n == 0 || o.flash_sm90_block_n == 64 || o.flash_sm90_block_n == 128,
           "{}: flash_sm90_block_n is {}; use 0 (the default), 64 or 128", op, o.flash_sm90_block_n);
  MC_CHECK(o.flash_sm90_variant >= 0 && o.flash_sm90_variant <= 4,
           "{}: flash_sm90_variant is {}; use 0 (the default) to 4", op, o.flash_sm90_variant);
  MC_CHECK(o.flash_sm90_bwd_variant == 0 || o.flash_sm90_bwd_variant == 1,
           "{}: flash_sm90_bwd_variant is {}; use 0 (the default) or 1", op, o.flash_sm90_bwd_variant);
  if (g.packed) {
    MC_CHECK(o.cu_seqlens_q.defined() && o.cu_seqlens_kv.defined(),
             "{}: packed mode needs both cu_seqlens_q and cu_seqlens_kv (pass the same tensor twice for self-attention)",
             op);
    for (const Tensor* c : {&o.cu_seqlens_q, &o.cu_seqlens_kv}) {
      detail::check_dtype(*c, DType::I32, op, "cu_seqlens");
      MC_CHECK(c->dim() == 1 && c->numel() >= 2 && c->is_contiguous(),
               "{}: cu_seqlens must be a contiguous i32 vector of batch + 1 prefix sums, got shape {}", op,
               shape_str(c->shape()));
      detail::check_same_device(*c, q.device(), op, "cu_seqlens");
    }
    MC_CHECK(o.cu_seqlens_q.numel() == o.cu_seqlens_kv.numel(),
             "{}: cu_seqlens_q has {} entries and cu_seqlens_kv {}; both must be batch + 1", op,
             o.cu_seqlens_q.numel(), o.cu_seqlens_kv.numel());
    g.batch = o.cu_seqlens_q.numel() - 1;
    g.total_q = q.size(0), g.total_kv = k.size(0);
    g.sq = o.max_seqlen_q, g.skv = o.max_seqlen_kv;
    if (q.device().is_cuda())
      MC_CHECK(g.sq > 0 && g.skv > 0,
               "{}: packed mode on the GPU needs max_seqlen_q and max_seqlen_kv (the longest sequence lengths)", op);
    g.lse_shape = {g.heads, g.total_q};
  } else {
    MC_CHECK(k.size(0) == q.size(0), "{}: q has batch {} but k has {}", op, q.size(0), k.size(0));
    g.batch = q.size(0), g.sq = q.size(1), g.skv = k.size(1);
    g.total_q = g.batch * g.sq, g.total_kv = g.batch * g.skv;
    g.lse_shape = {g.batch, g.heads, g.sq};
  }
  check_tensor(q, q.dtype(), q.device(), q.shape(), op, "q");
  check_tensor(k, q.dtype(), q.device(), q.shape().size() == 4 ? Shape{g.batch, g.skv, g.kv_heads, g.dim}
                                                                 : Shape{g.total_kv, g.kv_heads, g.dim},
               op, "k");
  check_tensor(v, q.dtype(), q.device(), k.shape(), op, "v");
  return g;
}

void check_lse(const Tensor& lse, const Geometry& g, Device dev, const char* op) {
  detail::check_defined(lse, op, "lse");
  MC_CHECK(lse.dtype() == DType::F32, "{}: lse has dtype {}; it must be f32", op, dtype_name(lse.dtype()));
  detail::check_same_device(lse, dev, op, "lse");
  MC_CHECK(lse.shape() == g.lse_shape, "{}: lse has shape {}, expected {} ({})", op, shape_str(lse.shape()),
           shape_str(g.lse_shape), g.packed ? "[heads, tokens]" : "[batch, heads, seq_q]");
  MC_CHECK(lse.is_contiguous(), "{}: lse must be contiguous", op);
}

// ---- CPU path ------------------------------------------------------------------------------------
std::vector<int32_t> host_ints(const Tensor& t) {
  std::vector<double> d = t.to_double_vector();
  return std::vector<int32_t>(d.begin(), d.end());
}

ref::AttentionDims dims_of(const Geometry& g, const AttentionOptions& o, const std::vector<int32_t>& cq,
                           const std::vector<int32_t>& ck) {
  ref::AttentionDims d;
  d.batch = g.batch, d.seqlen_q = g.sq, d.seqlen_kv = g.skv, d.heads = g.heads, d.kv_heads = g.kv_heads,
  d.head_dim = g.dim, d.causal = o.causal, d.scale = o.softmax_scale;
  if (g.packed) {
    d.cu_q = cq.data(), d.cu_kv = ck.data(), d.total_q = g.total_q;
  }
  return d;
}

void check_cu(const std::vector<int32_t>& cu, int64_t total, const char* op, const char* name) {
  MC_CHECK(cu.front() == 0, "{}: {}[0] is {}; it must be 0", op, name, cu.front());
  for (size_t i = 1; i < cu.size(); ++i)
    MC_CHECK(cu[i] >= cu[i - 1], "{}: {} is not non-decreasing at entry {}", op, name, i);
  MC_CHECK(cu.back() <= total, "{}: {} ends at {} but the tensor has {} tokens", op, name, cu.back(), total);
}

void write_back(Tensor& dst, const std::vector<double>& src) {
  std::vector<float> f(src.begin(), src.end());
  Tensor tmp = Tensor::from_vector(f, dst.shape());
  dst.copy_(tmp);
}

// ---- CUDA problem --------------------------------------------------------------------------------
#if MEGACORE_WITH_CUDA
cuda::AttnTensor view_of(const Tensor& t, bool packed) {
  cuda::AttnTensor a;
  if (!t.defined()) return a;
  a.ptr = t.data_ptr();
  if (packed) {
    a.row_stride = t.stride(0), a.head_stride = t.stride(1);
  } else {
    a.batch_stride = t.stride(0), a.row_stride = t.stride(1), a.head_stride = t.stride(2);
  }
  return a;
}

cuda::AttnProblem problem_of(const Geometry& g, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& o) {
  cuda::AttnProblem p;
  p.dtype = q.dtype();
  p.batch = int(g.batch), p.heads = int(g.heads), p.kv_heads = int(g.kv_heads), p.head_dim = int(g.dim);
  p.seqlen_q = int(g.sq), p.seqlen_kv = int(g.skv);
  p.total_q = g.total_q, p.total_kv = g.total_kv;
  if (g.packed) {
    p.cu_q = o.cu_seqlens_q.data<int32_t>();
    p.cu_kv = o.cu_seqlens_kv.data<int32_t>();
  }
  p.causal = o.causal;
  p.deterministic = o.deterministic;
  p.scale = o.softmax_scale != 0.f ? o.softmax_scale : float(1.0 / std::sqrt(double(g.dim)));
  p.q = view_of(q, g.packed), p.k = view_of(k, g.packed), p.v = view_of(v, g.packed);
  p.fwd_impl = o.flash_impl == FlashImpl::Sm80 ? 1 : o.flash_impl == FlashImpl::Sm90 ? 2 : 0;
  p.sm90_block_n = o.flash_sm90_block_n;
  p.sm90_variant = o.flash_sm90_variant;
  p.bwd_impl = o.flash_bwd_impl == FlashImpl::Sm80 ? 1 : o.flash_bwd_impl == FlashImpl::Sm90 ? 2 : 0;
  p.sm90_bwd_variant = o.flash_sm90_bwd_variant;
  if (g.packed) {
    p.lse_batch_stride = 0, p.lse_head_stride = g.total_q;
  } else {
    p.lse_batch_stride = g.heads * g.sq, p.lse_head_stride = g.sq;
  }
  return p;
}

std::string shape_key(const cuda::AttnProblem& p, bool backward) {
  // Packed calls: the sequence count and lengths change from batch to batch, so they are left out (one
  // log line per configuration, not per batch).
  if (p.cu_q)
    return fmt::format("{} packed H={}/{} D={}{}{}", backward ? "backward" : "forward", p.heads, p.kv_heads,
                       p.head_dim, p.causal ? " causal" : "", p.deterministic ? " deterministic" : "");
  return fmt::format("{} B={} H={}/{} D={} Sq={} Skv={}{}{}", backward ? "backward" : "forward", p.batch, p.heads,
                     p.kv_heads, p.head_dim, p.seqlen_q, p.seqlen_kv, p.causal ? " causal" : "",
                     p.deterministic ? " deterministic" : "");
}

AttentionBackend resolve_cuda(const cuda::AttnProblem& p, AttentionBackend want, bool backward, int device) {
  const char* op = backward ? "attention_backward" : "attention_forward";
  if (want == AttentionBackend::Reference)
    raise("{}: the Reference backend runs on CPU tensors only; move the tensors with .to(Device::cpu())", op);
  std::string flash_why = cuda::flash_unsupported_reason(p);
  if (flash_why.empty() && !backward && p.fwd_impl == 2) {
    const std::string why = cuda::flash_sm90_unsupported_reason(p, device);
    if (!why.empty()) flash_why = "the sm90 forward (asked for with FlashImpl::Sm90) cannot run: " + why;
  }
  if (flash_why.empty() && backward && p.bwd_impl == 2) {
    if (p.deterministic) {
      flash_why = "the sm90 backward (asked for with flash_bwd_impl = FlashImpl::Sm90) sums dQ with atomics; "
                  "for a deterministic backward leave flash_bwd_impl at Auto (the mma.sync two-kernel path runs)";
    } else {
      const std::string why = cuda::flash_sm90_unsupported_reason(p, device);
      if (!why.empty()) flash_why = "the sm90 backward (asked for with flash_bwd_impl = FlashImpl::Sm90) cannot run: " + why;
    }
  }
  if (want == AttentionBackend::Flash) {
    MC_CHECK(flash_why.empty(), "{}: megacore's flash kernel cannot run this call: {}", op, flash_why);
    return AttentionBackend::Flash;
  }
  std::string cudnn_why;
  if (!cuda::cudnn_sdpa_built()) {
    cudnn_why = "megacore was built without cuDNN SDPA (cuDNN and cudnn-frontend headers are needed at build time)";
  } else if (!cudnn_attention_enabled()) {
    cudnn_why = "the cuDNN SDPA path is off: " + cudnn_off_reason();
  } else {
    cudnn_why = cuda::cudnn_unsupported_reason(p, backward, device);
  }
  if (want == AttentionBackend::Cudnn) {
    MC_CHECK(cudnn_why.empty(), "{}: cuDNN SDPA cannot run this call: {}", op, cudnn_why);
    return AttentionBackend::Cudnn;
  }
  if (cudnn_why.empty()) {
    // Once per process and at debug level: the choice is the expected one, and with a new shape per generated
    // token a line per shape (on every rank) would bury the log.
    log_once(LogLevel::Debug, "attention cudnn", "attention",
             fmt::format("using cuDNN SDPA (first call: {})", shape_key(p, backward)));
    return AttentionBackend::Cudnn;
  }
  MC_CHECK(flash_why.empty(), "{}: no GPU attention backend can run this call: cuDNN: {}; flash kernel: {}", op,
           cudnn_why, flash_why);
  // A fallback is worth saying (once per reason, not per shape).
  log_once(LogLevel::Info, "attention flash " + cudnn_why, "attention",
           fmt::format("using megacore's flash kernel for {} (cuDNN SDPA unavailable: {})", shape_key(p, backward),
                       cudnn_why));
  return AttentionBackend::Flash;
}
#endif  // MEGACORE_WITH_CUDA

}  // namespace

const char* attention_backend_name(AttentionBackend b) {
  switch (b) {
    case AttentionBackend::Auto: return "auto";
    case AttentionBackend::Cudnn: return "cudnn";
    case AttentionBackend::Flash: return "flash";
    case AttentionBackend::Reference: return "reference";
  }
  return "?";
}

bool attention_flash_sm90_available(const Device& d) {
#if MEGACORE_WITH_CUDA
  if (!d.is_cuda() || !cuda::flash_sm90_built()) return false;
  cuda::AttnProblem p;  // a shape the kernel supports: only the build and the device are in question
  p.dtype = DType::BF16, p.head_dim = 128, p.heads = p.kv_heads = 1;
  return cuda::flash_sm90_unsupported_reason(p, d.index).empty();
#else
  (void)d;
  return false;
#endif
}


void set_cudnn_attention_autotune(bool on) { g_cudnn_autotune.store(on); }
bool cudnn_attention_autotune() { return g_cudnn_autotune.load(); }

void set_cudnn_attention_enabled(bool on, const std::string& reason) {
  std::lock_guard<std::mutex> lock(g_cudnn_reason_mu);
  g_cudnn_off_reason = on ? "" : reason;
  g_cudnn_enabled.store(on);
}
bool cudnn_attention_enabled() { return g_cudnn_enabled.load(); }

bool attention_cudnn_built() {
#if MEGACORE_WITH_CUDA
  return cuda::cudnn_sdpa_built();
#else
  return false;
#endif
}

bool attention_cudnn_available() { return attention_cudnn_built() && cudnn_attention_enabled(); }

AttentionBackend attention_resolve_backend(const Tensor& q, const Tensor& k, const AttentionOptions& opts) {
  const Geometry g = check_inputs(q, k, k, opts, "attention");
  if (q.device().is_cpu()) {
    MC_CHECK(opts.backend == AttentionBackend::Auto || opts.backend == AttentionBackend::Reference,
             "attention: backend {} needs CUDA tensors; these are on the CPU", attention_backend_name(opts.backend));
    return AttentionBackend::Reference;
  }
#if MEGACORE_WITH_CUDA
  cuda::AttnProblem p = problem_of(g, q, k, k, opts);
  p.o = p.q;  // the output is laid out like q
  return resolve_cuda(p, opts.backend, false, q.device().index);
#else
  (void)g;
  raise<CudaError>("attention: tensors are on {} but megacore was built without CUDA", q.device().str());
#endif
}

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       const AttentionOptions& opts, const Stream& s) {
  const char* op = "attention_forward";
  const Geometry g = check_inputs(q, k, v, opts, op);
  check_tensor(out, q.dtype(), q.device(), q.shape(), op, "out");
  check_lse(lse, g, q.device(), op);
  if (q.device().is_cpu()) {
    MC_CHECK(opts.backend == AttentionBackend::Auto || opts.backend == AttentionBackend::Reference,
             "{}: backend {} needs CUDA tensors; these are on the CPU", op, attention_backend_name(opts.backend));
    std::vector<int32_t> cq, ck;
    if (g.packed) {
      cq = host_ints(opts.cu_seqlens_q), ck = host_ints(opts.cu_seqlens_kv);
      check_cu(cq, g.total_q, op, "cu_seqlens_q");
      check_cu(ck, g.total_kv, op, "cu_seqlens_kv");
    }
    const ref::AttentionDims d = dims_of(g, opts, cq, ck);
    std::vector<double> qd = q.to_double_vector(), kd = k.to_double_vector(), vd = v.to_double_vector();
    std::vector<double> od(qd.size(), 0.0), ld(size_t(shape_numel(g.lse_shape)), -INFINITY);
    ref::attention_forward_f64(d, qd.data(), kd.data(), vd.data(), od.data(), ld.data());
    write_back(out, od);
    write_back(lse, ld);
    return;
  }
#if MEGACORE_WITH_CUDA
  MC_CHECK(q.dtype() != DType::F32, "{}: the GPU backends take bf16 or f16 q/k/v (got f32); convert with .to(DType::BF16)",
           op);
  void* stream = detail::launch_stream(s, q.device(), op);
  cuda::AttnProblem p = problem_of(g, q, k, v, opts);
  p.o = view_of(out, g.packed);
  p.lse = lse.data<float>();
  const AttentionBackend b = resolve_cuda(p, opts.backend, false, q.device().index);
  if (b == AttentionBackend::Cudnn) cuda::cudnn_forward(p, q.device().index, stream);
  else cuda::flash_forward(p, q.device().index, stream);
  if (g.packed) cuda::ragged_fix_orphans_forward(p, q.device().index, stream);
#else
  raise<CudaError>("{}: tensors are on {} but megacore was built without CUDA", op, q.device().str());
#endif
}

namespace {

// attention_backward; `tuning` (non-null: the flash kernel's atomic-dQ path with that launch shape,
// whatever opts.backend and opts.deterministic say) is for tests and benchmarks.
void backward_impl(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                   const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionOptions& opts_in,
                   const Stream& s, const cuda::FlashBwdTuning* tuning) {
  const char* op = "attention_backward";
  AttentionOptions opts = opts_in;
  // The launch shape is the mma.sync kernel's.
  if (tuning) opts.backend = AttentionBackend::Flash, opts.deterministic = false, opts.flash_bwd_impl = FlashImpl::Sm80;
  const Geometry g = check_inputs(q, k, v, opts, op);
  check_tensor(out, q.dtype(), q.device(), q.shape(), op, "out");
  check_tensor(dout, q.dtype(), q.device(), q.shape(), op, "dout");
  check_tensor(dq, q.dtype(), q.device(), q.shape(), op, "dq");
  check_tensor(dk, q.dtype(), q.device(), k.shape(), op, "dk");
  check_tensor(dv, q.dtype(), q.device(), k.shape(), op, "dv");
  check_lse(lse, g, q.device(), op);
  if (q.device().is_cpu()) {
    MC_CHECK(opts.backend == AttentionBackend::Auto || opts.backend == AttentionBackend::Reference,
             "{}: backend {} needs CUDA tensors; these are on the CPU", op, attention_backend_name(opts.backend));
    std::vector<int32_t> cq, ck;
    if (g.packed) {
      cq = host_ints(opts.cu_seqlens_q), ck = host_ints(opts.cu_seqlens_kv);
      check_cu(cq, g.total_q, op, "cu_seqlens_q");
      check_cu(ck, g.total_kv, op, "cu_seqlens_kv");
    }
    const ref::AttentionDims d = dims_of(g, opts, cq, ck);
    std::vector<double> qd = q.to_double_vector(), kd = k.to_double_vector(), vd = v.to_double_vector(),
                        od = out.to_double_vector(), ld = lse.to_double_vector(), gd = dout.to_double_vector();
    std::vector<double> dqd(qd.size()), dkd(kd.size()), dvd(vd.size());
    ref::attention_backward_f64(d, qd.data(), kd.data(), vd.data(), od.data(), ld.data(), gd.data(), dqd.data(),
                                dkd.data(), dvd.data());
    write_back(dq, dqd);
    write_back(dk, dkd);
    write_back(dv, dvd);
    return;
  }
#if MEGACORE_WITH_CUDA
  MC_CHECK(q.dtype() != DType::F32, "{}: the GPU backends take bf16 or f16 q/k/v (got f32); convert with .to(DType::BF16)",
           op);
  void* stream = detail::launch_stream(s, q.device(), op);
  cuda::AttnProblem p = problem_of(g, q, k, v, opts);
  p.o = view_of(out, g.packed);
  p.dout = view_of(dout, g.packed);
  p.dq = view_of(dq, g.packed), p.dk = view_of(dk, g.packed), p.dv = view_of(dv, g.packed);
  p.lse = const_cast<float*>(lse.data<float>());
  const AttentionBackend b = resolve_cuda(p, opts.backend, true, q.device().index);
  if (b == AttentionBackend::Cudnn) cuda::cudnn_backward(p, q.device().index, stream);
  else {
    Tensor dsum = Tensor::empty(g.lse_shape, DType::F32, q.device(), s);
    // Non-deterministic path: dQ is summed over key blocks with f32 atomics into [lse's shape, D]
    // (dense [B, H, Sq, D], packed [H, Tq, D]); flash_backward zeroes it on the stream.
    Tensor dq_acc;
    if (!p.deterministic) {
      Shape acc_shape = g.lse_shape;
      acc_shape.push_back(g.dim);
      dq_acc = Tensor::empty(acc_shape, DType::F32, q.device(), s);
    }
    cuda::flash_backward(p, dsum.data<float>(), dq_acc.defined() ? dq_acc.data<float>() : nullptr,
                         q.device().index, stream, tuning ? *tuning : cuda::FlashBwdTuning{});
  }
  if (g.packed) cuda::ragged_fix_orphans_backward(p, q.device().index, stream);
#else
  (void)tuning;
  raise<CudaError>("{}: tensors are on {} but megacore was built without CUDA", op, q.device().str());
#endif
}

}  // namespace

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionOptions& opts,
                        const Stream& s) {
  backward_impl(q, k, v, out, lse, dout, dq, dk, dv, opts, s, nullptr);
}

namespace detail {
void attention_backward_flash_tuned(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                                    const AttentionOptions& opts, const cuda::FlashBwdTuning& tuning,
                                    const Stream& s) {
  backward_impl(q, k, v, out, lse, dout, dq, dk, dv, opts, s, &tuning);
}
}  // namespace detail

}  // namespace megacore::ops
