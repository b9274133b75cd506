#include "megacore/layers/cross_entropy.hpp"

#include <algorithm>
#include <limits>

#include "megacore/ops/optimizer.hpp"

namespace megacore::layers {
namespace {
constexpr std::string_view kName = "VocabParallelCrossEntropy";

ops::CrossEntropyOptions op_options(const VocabParallelCrossEntropyOptions& o) {
  ops::CrossEntropyOptions c;
  c.label_smoothing = o.label_smoothing;
  c.ignore_index = o.ignore_index;
  return c;
}
}  // namespace

VocabParallelCrossEntropy::VocabParallelCrossEntropy(comm::Communicator& tp, int64_t vocab_size,
                                                     const VocabParallelCrossEntropyOptions& options)
    : tp_(tp), vocab_(vocab_size), opts_(options) {
  MC_CHECK(vocab_ > 0, "{}: vocab_size is {}; pass the tokenizer's (unpadded) vocabulary size", kName, vocab_);
  MC_CHECK(opts_.label_smoothing >= 0.f && opts_.label_smoothing < 1.f,
           "{}: label_smoothing is {}; use a value in [0, 1) (0 disables it)", kName, opts_.label_smoothing);
}

Tensor VocabParallelCrossEntropy::forward(const ForwardContext& ctx, const Tensor& logits, const Tensor& labels,
                                          const Tensor& loss_mask) {
  const Stream& s = ctx.stream;
  MC_CHECK(logits.defined() && logits.dim() >= 1,
           "{}.forward: logits must be [..., vocab/TP]; pass this rank's shard of the output layer's logits", kName);
  MC_CHECK(labels.defined(), "{}.forward: labels are undefined; pass one label per logits row", kName);
  const int64_t v_local = logits.size(-1);
  const int64_t n = logits.numel() / std::max<int64_t>(v_local, 1);
  MC_CHECK(v_local * tp_.size() >= vocab_,
           "{}.forward: logits have {} columns per rank, {} over TP = {}, fewer than vocab_size {}; pass the "
           "vocab-parallel logits [..., padded_vocab/TP]",
           kName, v_local, v_local * tp_.size(), tp_.size(), vocab_);
  MC_CHECK(labels.numel() == n,
           "{}.forward: labels have {} elements (shape {}) but logits {} have {} rows; pass one label per row", kName,
           labels.numel(), shape_str(labels.shape()), shape_str(logits.shape()), n);
  MC_CHECK(labels.device() == logits.device(), "{}.forward: labels are on {} but logits on {}; move them together",
           kName, labels.device().str(), logits.device().str());
  if (loss_mask.defined())
    MC_CHECK(loss_mask.numel() == n && loss_mask.dtype() == DType::F32,
             "{}.forward: loss_mask must be f32 with one entry per token ({}), got {} {}; convert it with "
             ".to(DType::F32)",
             kName, n, dtype_name(loss_mask.dtype()), shape_str(loss_mask.shape()));
  const Device d = logits.device();
  Tensor z = logits.contiguous(s).view({n, v_local});
  Tensor lab = labels.contiguous(s).view({n});
  Tensor mask = loss_mask.defined() ? loss_mask.contiguous(s).view({n}) : Tensor();
  start_ = int64_t(tp_.rank()) * v_local;
  valid_ = std::clamp<int64_t>(vocab_ - start_, 0, v_local);
  // Padding columns are left out by working on the real columns only (a copy on the one rank that
  // holds both; ranks holding only padding contribute neutral statistics).
  Tensor zv = valid_ == v_local ? z : (valid_ > 0 ? z.narrow(1, 0, valid_).contiguous(s) : Tensor());

  Tensor local_max = Tensor::empty({n}, DType::F32, d, s);
  Tensor sums = Tensor::empty({3, n}, DType::F32, d, s);  // sum-exp, target logit, sum of logits
  Tensor sum_exp = sums.select(0, 0), target = sums.select(0, 1), sum_logits = sums.select(0, 2);
  if (zv.defined()) {
    ops::cross_entropy_shard_stats(zv, lab, start_, local_max, sum_exp, target, sum_logits, s);
  } else {
    local_max.fill_(-std::numeric_limits<double>::infinity(), s);
    sums.zero_(s);
  }
  Tensor global_max = local_max.clone(s);
  tp_.all_reduce(global_max, comm::ReduceOp::Max, s)->wait_on(s);
  ops::cross_entropy_rescale_sum_exp(local_max, global_max, sum_exp, s);
  tp_.all_reduce(sums, comm::ReduceOp::Sum, s)->wait_on(s);  // one collective for the three sums
  Tensor loss = Tensor::empty({n}, DType::F32, d, s);
  Tensor lse = Tensor::empty({n}, DType::F32, d, s);
  ops::cross_entropy_loss_from_stats(global_max, sum_exp, target, sum_logits, lab, vocab_, loss, lse, mask,
                                     op_options(opts_), s);
  lse_ = lse;
  if (ctx.training) {
    logits_ = z;
    valid_logits_ = zv;
    labels_ = lab;
    mask_ = mask;
    logits_shape_ = logits.shape();
  } else {
    logits_ = valid_logits_ = labels_ = mask_ = Tensor();
  }
  return loss.view(labels.shape());
}

Tensor VocabParallelCrossEntropy::backward(const ForwardContext& ctx, float grad_scale) {
  MC_CHECK(logits_.defined(),
           "{}.backward: no saved forward; call forward with ctx.training = true before backward", kName);
  const int64_t n = labels_.numel();
  Tensor dloss = Tensor::empty({n}, DType::F32, logits_.device(), ctx.stream);
  if (mask_.defined())
    ops::multi_tensor_scale({mask_}, {dloss}, grad_scale, {}, ctx.stream);  // scale · mask, on the device
  else
    dloss.fill_(grad_scale, ctx.stream);
  return backward_impl(ctx, dloss);
}

Tensor VocabParallelCrossEntropy::backward(const ForwardContext& ctx, const Tensor& dloss) {
  MC_CHECK(logits_.defined(),
           "{}.backward: no saved forward; call forward with ctx.training = true before backward", kName);
  const int64_t n = labels_.numel();
  MC_CHECK(dloss.defined() && dloss.numel() == n && dloss.dtype() == DType::F32,
           "{}.backward: dloss must be f32 with one entry per token ({}); pass the gradient of forward's loss", kName,
           n);
  Tensor dl = dloss.contiguous(ctx.stream).view({n});
  if (mask_.defined()) {
    // The loss was multiplied by the mask, so its gradient is too. [N] floats: done on the host.
    Tensor a = dl.to(Device::cpu(), ctx.stream), m = mask_.to(Device::cpu(), ctx.stream);
    Tensor prod = Tensor::empty({n});
    for (int64_t i = 0; i < n; ++i) prod.data<float>()[i] = a.data<float>()[i] * m.data<float>()[i];
    dl = prod.to(logits_.device(), ctx.stream);
  }
  return backward_impl(ctx, dl);
}

Tensor VocabParallelCrossEntropy::backward_impl(const ForwardContext& ctx, const Tensor& dloss) {
  const Stream& s = ctx.stream;
  const int64_t n = logits_.size(0), v_local = logits_.size(1);
  const ops::CrossEntropyOptions o = op_options(opts_);
  Tensor dlogits = Tensor::empty({n, v_local}, logits_.dtype(), logits_.device(), s);
  if (valid_ == v_local) {
    ops::cross_entropy_backward(logits_, labels_, lse_, dloss, dlogits, o, s, start_, vocab_);
  } else {
    dlogits.zero_(s);  // padding columns get no gradient
    if (valid_ > 0) {
      Tensor part = Tensor::empty({n, valid_}, logits_.dtype(), logits_.device(), s);
      ops::cross_entropy_backward(valid_logits_, labels_, lse_, dloss, part, o, s, start_, vocab_);
      dlogits.narrow(1, 0, valid_).copy_(part, s);
    }
  }
  logits_ = valid_logits_ = labels_ = mask_ = Tensor();
  return dlogits.view(logits_shape_);
}

void VocabParallelCrossEntropy::stash_activations(ActivationStash& s) {
  // lse_ is kept for lse() after a forward but also read by backward, so it travels with the rest.
  for (Tensor* t : {&logits_, &valid_logits_, &labels_, &mask_, &lse_}) s.put(*t);
  s.put_shape(logits_shape_);
}

void VocabParallelCrossEntropy::restore_activations(ActivationStash& s) {
  for (Tensor* t : {&logits_, &valid_logits_, &labels_, &mask_, &lse_}) s.take(*t);
  logits_shape_ = s.take_shape();
}

}  // namespace megacore::layers
