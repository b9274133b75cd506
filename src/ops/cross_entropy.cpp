#include "megacore/ops/cross_entropy.hpp"

#include <cmath>
#include <limits>

#include "megacore/build_config.hpp"
#include "megacore/ops/ops_common.hpp"
#include "ops/cuda/cross_entropy_cuda.hpp"
#include "ops/memops_cpu.hpp"

namespace megacore::ops {
namespace {

using cpu::ld;
using cpu::st;

struct RowStats {
  double max, sum_exp, target, sum;
};

template <class T>
RowStats row_stats(const T* z, int64_t v, int64_t target_col) {
  RowStats r{-std::numeric_limits<double>::infinity(), 0, 0, 0};
  for (int64_t j = 0; j < v; ++j) r.max = std::max(r.max, ld(z[j]));
  for (int64_t j = 0; j < v; ++j) {
    r.sum_exp += std::exp(ld(z[j]) - r.max);
    r.sum += ld(z[j]);
  }
  if (target_col >= 0 && target_col < v) r.target = ld(z[target_col]);
  return r;
}

double row_loss(double lse, double target, double sum, int64_t label, int64_t vocab, double eps, int64_t ignore) {
  if (label == ignore) return 0.0;
  return lse - (1 - eps) * target - eps / double(vocab) * sum;
}

template <class T>
void row_grad(const T* z, T* dz, int64_t v, double lse, double scale, int64_t target_col, int64_t vocab, double eps) {
  for (int64_t j = 0; j < v; ++j) {
    double g = std::exp(ld(z[j]) - lse) - eps / double(vocab);
    if (j == target_col) g -= 1 - eps;
    dz[j] = st<T>(scale * g);
  }
}

template <class L>
void check_labels_cpu(const L* labels, int64_t n, int64_t vocab, int64_t ignore, const char* op) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t l = int64_t(labels[i]);
    MC_CHECK(l == ignore || (l >= 0 && l < vocab),
             "{}: label {} of row {} is outside the vocabulary [0, {}) and is not ignore_index {}", op, l, i, vocab,
             ignore);
  }
}

void check_rowvec(const Tensor& t, int64_t n, Device d, const char* op, const char* name) {
  detail::check_dtype(t, DType::F32, op, name);
  detail::check_numel(t, n, op, name);
  detail::check_contiguous(t, op, name);
  detail::check_same_device(t, d, op, name);
}

void check_opts(const CrossEntropyOptions& o, const char* op) {
  MC_CHECK(o.label_smoothing >= 0.f && o.label_smoothing < 1.f, "{}: label_smoothing must be in [0, 1), got {}", op,
           o.label_smoothing);
}

/// Checks logits [N, V] and labels [N]; returns (N, V).
std::pair<int64_t, int64_t> check_logits(const Tensor& logits, const Tensor& labels, const char* op) {
  detail::check_float_input(logits, op, "logits");
  MC_CHECK(logits.dim() == 2, "{}: logits must be [tokens, vocab], got shape {}; flatten the leading dimensions", op,
           shape_str(logits.shape()));
  detail::check_index_input(labels, op, "labels");
  detail::check_numel(labels, logits.size(0), op, "labels");
  detail::check_same_device(labels, logits.device(), op, "labels");
  return {logits.size(0), logits.size(1)};
}

void check_grad_out(const Tensor& d, const Tensor& logits, const char* op) {
  detail::check_defined(d, op, "dlogits");
  MC_CHECK(d.dtype() == logits.dtype(), "{}: dlogits has dtype {} but logits have {}", op, dtype_name(d.dtype()),
           dtype_name(logits.dtype()));
  detail::check_shape(d, logits.shape(), op, "dlogits");
  detail::check_contiguous(d, op, "dlogits");
  detail::check_same_device(d, logits.device(), op, "dlogits");
}

// Fused (dlogits given) or forward-only.
void ce_forward_impl(const Tensor& logits, const Tensor& labels, Tensor& loss, Tensor& lse, Tensor* dlogits,
                     float grad_scale, const Tensor& mask, const CrossEntropyOptions& o, const Stream& s,
                     const char* op) {
  auto [n, v] = check_logits(logits, labels, op);
  check_opts(o, op);
  const Device d = logits.device();
  check_rowvec(loss, n, d, op, "loss");
  if (lse.defined()) check_rowvec(lse, n, d, op, "lse");
  if (mask.defined()) check_rowvec(mask, n, d, op, "loss_mask");
  if (dlogits) check_grad_out(*dlogits, logits, op);
  MC_CHECK(v > 0 || n == 0, "{}: the vocabulary is empty", op);
  if (d.is_cuda()) {
    void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
    cuda::CeArgs a;
    a.mode = dlogits ? cuda::CeMode::Fused : cuda::CeMode::Forward;
    a.logits = logits.data_ptr();
    a.dlogits = dlogits ? dlogits->data_ptr() : nullptr;
    a.labels = labels.data_ptr();
    a.labels_i64 = labels.dtype() == DType::I64;
    a.loss_mask = mask.defined() ? mask.data<float>() : nullptr;
    a.loss = loss.data<float>();
    a.lse_out = lse.defined() ? lse.data<float>() : nullptr;
    a.n = n;
    a.v = v;
    a.vocab_total = v;
    a.grad_scale = grad_scale;
    a.label_smoothing = o.label_smoothing;
    a.ignore_index = o.ignore_index;
    a.tuning = cuda::ce_default_tuning(logits.dtype(), a.mode, v);
    cuda::cross_entropy(logits.dtype(), a, d.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  cpu::dispatch_float_index(logits.dtype(), labels.dtype(), [&](auto tag, auto ltag) {
    using T = decltype(tag);
    using L = decltype(ltag);
    const L* lab = labels.data<L>();
    check_labels_cpu(lab, n, v, o.ignore_index, op);
    const T* z = logits.data<T>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t label = int64_t(lab[i]);
      RowStats r = row_stats(z + i * v, v, label);
      const double l = r.max + std::log(r.sum_exp);
      const double m = mask.defined() ? double(mask.data<float>()[i]) : 1.0;
      loss.data<float>()[i] = float(m * row_loss(l, r.target, r.sum, label, v, o.label_smoothing, o.ignore_index));
      if (lse.defined()) lse.data<float>()[i] = float(l);
      if (dlogits) {
        const double scale = label == o.ignore_index ? 0.0 : double(grad_scale) * m;
        row_grad(z + i * v, dlogits->data<T>() + i * v, v, l, scale, label, v, o.label_smoothing);
      }
    }
  });
}

}  // namespace

void cross_entropy_fused(const Tensor& logits, const Tensor& labels, Tensor& loss, Tensor& lse, Tensor& dlogits,
                         float grad_scale, const Tensor& loss_mask, const CrossEntropyOptions& opts, const Stream& s) {
  ce_forward_impl(logits, labels, loss, lse, &dlogits, grad_scale, loss_mask, opts, s, "cross_entropy_fused");
}

void cross_entropy_forward(const Tensor& logits, const Tensor& labels, Tensor& loss, Tensor& lse,
                           const Tensor& loss_mask, const CrossEntropyOptions& opts, const Stream& s) {
  ce_forward_impl(logits, labels, loss, lse, nullptr, 1.f, loss_mask, opts, s, "cross_entropy_forward");
}

void cross_entropy_backward(const Tensor& logits, const Tensor& labels, const Tensor& lse, const Tensor& dloss,
                            Tensor& dlogits, const CrossEntropyOptions& o, const Stream& s, int64_t vocab_start,
                            int64_t vocab_size) {
  const char* op = "cross_entropy_backward";
  auto [n, v] = check_logits(logits, labels, op);
  check_opts(o, op);
  const Device d = logits.device();
  check_rowvec(lse, n, d, op, "lse");
  check_rowvec(dloss, n, d, op, "dloss");
  check_grad_out(dlogits, logits, op);
  if (vocab_size < 0) vocab_size = v;
  MC_CHECK(vocab_start >= 0 && vocab_start + v <= vocab_size,
           "{}: the shard [{}, {}) does not lie inside the vocabulary of {} entries", op, vocab_start, vocab_start + v,
           vocab_size);
  if (d.is_cuda()) {
    void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
    cuda::CeArgs a;
    a.mode = cuda::CeMode::Backward;
    a.logits = logits.data_ptr();
    a.dlogits = dlogits.data_ptr();
    a.labels = labels.data_ptr();
    a.labels_i64 = labels.dtype() == DType::I64;
    a.lse_in = lse.data<float>();
    a.dloss = dloss.data<float>();
    a.n = n;
    a.v = v;
    a.vocab_start = vocab_start;
    a.vocab_total = vocab_size;
    a.label_smoothing = o.label_smoothing;
    a.ignore_index = o.ignore_index;
    cuda::cross_entropy(logits.dtype(), a, d.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  cpu::dispatch_float_index(logits.dtype(), labels.dtype(), [&](auto tag, auto ltag) {
    using T = decltype(tag);
    using L = decltype(ltag);
    const L* lab = labels.data<L>();
    check_labels_cpu(lab, n, vocab_size, o.ignore_index, op);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t label = int64_t(lab[i]);
      const double scale = label == o.ignore_index ? 0.0 : double(dloss.data<float>()[i]);
      row_grad(logits.data<T>() + i * v, dlogits.data<T>() + i * v, v, double(lse.data<float>()[i]), scale,
               label - vocab_start, vocab_size, o.label_smoothing);
    }
  });
}

void cross_entropy_shard_stats(const Tensor& logits, const Tensor& labels, int64_t vocab_start, Tensor& row_max,
                               Tensor& sum_exp, Tensor& target_logit, Tensor& sum_logits, const Stream& s) {
  const char* op = "cross_entropy_shard_stats";
  auto [n, v] = check_logits(logits, labels, op);
  MC_CHECK(vocab_start >= 0, "{}: vocab_start must be >= 0, got {}", op, vocab_start);
  MC_CHECK(v > 0 || n == 0, "{}: the vocabulary shard is empty", op);
  const Device d = logits.device();
  check_rowvec(row_max, n, d, op, "row_max");
  check_rowvec(sum_exp, n, d, op, "sum_exp");
  check_rowvec(target_logit, n, d, op, "target_logit");
  check_rowvec(sum_logits, n, d, op, "sum_logits");
  if (d.is_cuda()) {
    void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
    cuda::CeArgs a;
    a.mode = cuda::CeMode::Stats;
    a.logits = logits.data_ptr();
    a.labels = labels.data_ptr();
    a.labels_i64 = labels.dtype() == DType::I64;
    a.row_max = row_max.data<float>();
    a.sum_exp = sum_exp.data<float>();
    a.target = target_logit.data<float>();
    a.sum_logits = sum_logits.data<float>();
    a.n = n;
    a.v = v;
    a.vocab_start = vocab_start;
    a.vocab_total = vocab_start + v;
    a.ignore_index = std::numeric_limits<int64_t>::min();  // target is 0 for ignored rows anyway (outside the shard)
    cuda::cross_entropy(logits.dtype(), a, d.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  cpu::dispatch_float_index(logits.dtype(), labels.dtype(), [&](auto tag, auto ltag) {
    using T = decltype(tag);
    using L = decltype(ltag);
    for (int64_t i = 0; i < n; ++i) {
      RowStats r = row_stats(logits.data<T>() + i * v, v, int64_t(labels.data<L>()[i]) - vocab_start);
      row_max.data<float>()[i] = float(r.max);
      sum_exp.data<float>()[i] = float(r.sum_exp);
      target_logit.data<float>()[i] = float(r.target);
      sum_logits.data<float>()[i] = float(r.sum);
    }
  });
}

void cross_entropy_rescale_sum_exp(const Tensor& local_max, const Tensor& global_max, Tensor& sum_exp,
                                   const Stream& s) {
  const char* op = "cross_entropy_rescale_sum_exp";
  detail::check_dtype(sum_exp, DType::F32, op, "sum_exp");
  const int64_t n = sum_exp.numel();
  const Device d = sum_exp.device();
  check_rowvec(sum_exp, n, d, op, "sum_exp");
  check_rowvec(local_max, n, d, op, "local_max");
  check_rowvec(global_max, n, d, op, "global_max");
  if (d.is_cuda()) {
    void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
    cuda::ce_rescale(local_max.data<float>(), global_max.data<float>(), sum_exp.data<float>(), n, d.index, stream);
#else
    (void)stream;
#endif
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const double lm = local_max.data<float>()[i];
    float& se = sum_exp.data<float>()[i];
    se = std::isinf(lm) && lm < 0 ? 0.f : float(double(se) * std::exp(lm - double(global_max.data<float>()[i])));
  }
}

void cross_entropy_loss_from_stats(const Tensor& global_max, const Tensor& sum_exp, const Tensor& target_logit,
                                   const Tensor& sum_logits, const Tensor& labels, int64_t vocab_size, Tensor& loss,
                                   Tensor& lse, const Tensor& mask, const CrossEntropyOptions& o, const Stream& s) {
  const char* op = "cross_entropy_loss_from_stats";
  check_opts(o, op);
  detail::check_index_input(labels, op, "labels");
  const int64_t n = labels.numel();
  const Device d = labels.device();
  check_rowvec(global_max, n, d, op, "global_max");
  check_rowvec(sum_exp, n, d, op, "sum_exp");
  check_rowvec(target_logit, n, d, op, "target_logit");
  check_rowvec(sum_logits, n, d, op, "sum_logits");
  check_rowvec(loss, n, d, op, "loss");
  if (lse.defined()) check_rowvec(lse, n, d, op, "lse");
  if (mask.defined()) check_rowvec(mask, n, d, op, "loss_mask");
  MC_CHECK(vocab_size > 0, "{}: vocab_size must be > 0, got {}", op, vocab_size);
  if (d.is_cuda()) {
    void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
    cuda::ce_loss_from_stats(global_max.data<float>(), sum_exp.data<float>(), target_logit.data<float>(),
                             sum_logits.data<float>(), labels.data_ptr(), labels.dtype() == DType::I64,
                             mask.defined() ? mask.data<float>() : nullptr, n, vocab_size, o.label_smoothing,
                             o.ignore_index, loss.data<float>(), lse.defined() ? lse.data<float>() : nullptr, d.index,
                             stream);
#else
    (void)stream;
#endif
    return;
  }
  cpu::dispatch_index(labels.dtype(), [&](auto ltag) {
    using L = decltype(ltag);
    const L* lab = labels.data<L>();
    check_labels_cpu(lab, n, vocab_size, o.ignore_index, op);
    for (int64_t i = 0; i < n; ++i) {
      const double l = double(global_max.data<float>()[i]) + std::log(double(sum_exp.data<float>()[i]));
      const double m = mask.defined() ? double(mask.data<float>()[i]) : 1.0;
      loss.data<float>()[i] = float(m * row_loss(l, target_logit.data<float>()[i], sum_logits.data<float>()[i],
                                                 int64_t(lab[i]), vocab_size, o.label_smoothing, o.ignore_index));
      if (lse.defined()) lse.data<float>()[i] = float(l);
    }
  });
}

namespace ref {
void cross_entropy_f64(const double* logits, const int64_t* labels, const double* dloss, double* loss,
                       double* dlogits, int64_t n, int64_t v, double eps, int64_t ignore_index) {
  check_labels_cpu(labels, n, v, ignore_index, "ref::cross_entropy_f64");
  for (int64_t i = 0; i < n; ++i) {
    RowStats r = row_stats(logits + i * v, v, labels[i]);
    const double l = r.max + std::log(r.sum_exp);
    loss[i] = row_loss(l, r.target, r.sum, labels[i], v, eps, ignore_index);
    if (dlogits)
      row_grad(logits + i * v, dlogits + i * v, v, l, labels[i] == ignore_index ? 0.0 : dloss[i], labels[i], v, eps);
  }
}
}  // namespace ref

}  // namespace megacore::ops
