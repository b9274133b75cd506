#include "megacore/model/gpt_model.hpp"

#include <utility>

#include "megacore/core/error.hpp"
#include "megacore/ops/embedding.hpp"
#include "megacore/ops/gemm.hpp"

namespace megacore::model {

namespace ly = megacore::layers;

namespace {

constexpr uint64_t kWordEmbeddingOffset = 0, kPositionEmbeddingOffset = 1, kOutputLayerOffset = 2;

// Runs first in the member-initialiser list, so a bad config is refused before any allocation.
const TransformerConfig& validated(const TransformerConfig& cfg, comm::Communicator& tp) {
  validate(cfg, tp.size());
  return cfg;
}

std::unique_ptr<ly::NormLayer> make_norm(const TransformerConfig& cfg, Device device) {
  ly::NormOptions o{.eps = cfg.norm_eps,
                    .sequence_parallel = cfg.sequence_parallel,
                    .bias = cfg.add_bias_linear,
                    .params_dtype = cfg.params_dtype,
                    .device = device};
  if (cfg.normalization == NormType::LayerNorm) return std::make_unique<ly::LayerNorm>(cfg.hidden_size, o);
  return std::make_unique<ly::RMSNorm>(cfg.hidden_size, o);
}

void check_batch(const Tensor& t, std::string_view name, bool index) {
  MC_CHECK(t.defined(), "GPTModel.forward: {} is undefined; pass a [batch, seq] tensor", name);
  MC_CHECK(t.dim() == 2, "GPTModel.forward: {} has shape {}; it must be [batch, seq]", name, shape_str(t.shape()));
  if (index)
    MC_CHECK(t.dtype() == DType::I32 || t.dtype() == DType::I64, "GPTModel.forward: {} has dtype {}; use i32 or i64",
             name, dtype_name(t.dtype()));
  else
    MC_CHECK(t.dtype() == DType::F32, "GPTModel.forward: {} has dtype {}; use f32", name, dtype_name(t.dtype()));
}

}  // namespace

GPTModel::GPTModel(const TransformerConfig& cfg, comm::Communicator& tp, const GPTModelOptions& options)
    : tp_(tp),
      cfg_(validated(cfg, tp)),
      opts_(options),
      embedding_(tp, cfg.vocab_size, cfg.hidden_size,
                 ly::VocabParallelEmbeddingOptions{.padded_vocab_size = model::padded_vocab_size(cfg, tp.size()),
                                                   .sequence_parallel = cfg.sequence_parallel,
                                                   .params_dtype = cfg.params_dtype,
                                                   .device = options.device,
                                                   .init_std = cfg.init_method_std,
                                                   .seed = cfg.seed,
                                                   .init_offset = kWordEmbeddingOffset}),
      final_norm_(make_norm(cfg, options.device)),
      output_layer_(tp, cfg.hidden_size, model::padded_vocab_size(cfg, tp.size()),
                    ly::ColumnParallelLinearOptions{.bias = false,
                                                    .gather_output = false,
                                                    .sequence_parallel = cfg.sequence_parallel,
                                                    .params_dtype = cfg.params_dtype,
                                                    .device = options.device,
                                                    .init_std = cfg.init_method_std,
                                                    .seed = cfg.seed,
                                                    .init_offset = kOutputLayerOffset}),
      loss_(tp, cfg.vocab_size, ly::VocabParallelCrossEntropyOptions{.label_smoothing = options.label_smoothing}) {
  if (cfg_.position_embedding == PositionEmbeddingType::Learned) {
    position_.name = "weight";
    position_.data = ly::init_full_weight(cfg_.max_position_embeddings, cfg_.hidden_size, cfg_.init_method_std,
                                          cfg_.seed, kPositionEmbeddingOffset, cfg_.params_dtype, opts_.device);
    position_.main_grad = Tensor::zeros(position_.data.shape(), DType::F32, opts_.device);
    // Each rank looks up only its chunk's positions under SP, so its gradient is a partial sum.
    position_.sequence_parallel = cfg_.sequence_parallel;
  }
  for (int64_t i = 0; i < cfg_.num_layers; ++i)
    layers_.push_back(std::make_unique<TransformerLayer>(
        tp, cfg_, TransformerLayerOptions{.layer_number = i, .init_offset_base = kModelLayerInitBase,
                                          .device = opts_.device}));
  if (cfg_.tie_word_embeddings) {
    // Share the tensors themselves: the output GEMM reads the embedding table and its weight-gradient
    // GEMM accumulates (beta = 1) into the embedding's main_grad, which is how the two gradients add.
    // The output layer's own initial draw is dropped.
    output_layer_.weight().data = embedding_.weight().data;
    output_layer_.weight().main_grad = embedding_.weight().main_grad;
  }

  std::vector<std::pair<std::string, ly::Parameter*>> named;
  named.emplace_back("embedding.weight", &embedding_.weight());
  if (position_.data.defined()) named.emplace_back("position_embedding.weight", &position_);
  for (size_t i = 0; i < layers_.size(); ++i)
    for (auto& [n, p] : layers_[i]->named_parameters()) named.emplace_back(fmt::format("layers.{}.{}", i, n), p);
  named.emplace_back("final_layernorm.weight", &final_norm_->weight());
  if (final_norm_->has_bias()) named.emplace_back("final_layernorm.bias", &final_norm_->bias());
  if (!cfg_.tie_word_embeddings) named.emplace_back("output_layer.weight", &output_layer_.weight());
  for (auto& [n, p] : named) {
    p->name = n;
    params_.push_back(p);
  }
}

Tensor GPTModel::forward(const ly::ForwardContext& ctx, const Tensor& tokens, const Tensor& labels,
                         const Tensor& loss_mask) {
  const Stream& st = ctx.stream;
  check_batch(tokens, "tokens", true);
  check_batch(labels, "labels", true);
  MC_CHECK(labels.shape() == tokens.shape(), "GPTModel.forward: labels {} and tokens {} differ in shape; pass one label "
           "per token", shape_str(labels.shape()), shape_str(tokens.shape()));
  if (loss_mask.defined()) {
    check_batch(loss_mask, "loss_mask", false);
    MC_CHECK(loss_mask.shape() == tokens.shape(), "GPTModel.forward: loss_mask {} and tokens {} differ in shape; pass "
             "one mask value per token", shape_str(loss_mask.shape()), shape_str(tokens.shape()));
  }
  const int64_t b = tokens.size(0), s = tokens.size(1), tpn = tp_.size();
  MC_CHECK(s <= cfg_.max_position_embeddings,
           "GPTModel.forward: sequence length {} exceeds max_position_embeddings {}; shorten the sequences or raise "
           "max_position_embeddings", s, cfg_.max_position_embeddings);
  MC_CHECK(!cfg_.sequence_parallel || s % tpn == 0,
           "GPTModel.forward: sequence length {} is not a multiple of TP {} (sequence parallelism splits it); pad the "
           "sequences to a multiple of {}", s, tpn, tpn);

  // The layers work sequence-first ([s, b, h]) as Megatron-Core does.
  Tensor ids = tokens.transpose(0, 1).contiguous(st);
  Tensor x = embedding_.forward(ctx, ids);
  if (position_.data.defined()) {
    const int64_t s_local = cfg_.sequence_parallel ? s / tpn : s, first = cfg_.sequence_parallel ? tp_.rank() * s_local : 0;
    std::vector<int64_t> pos(size_t(s_local * b));
    for (int64_t i = 0; i < s_local; ++i)
      for (int64_t j = 0; j < b; ++j) pos[size_t(i * b + j)] = first + i;
    Tensor pos_ids = Tensor::from_vector<int64_t>(pos, {s_local, b}).to(opts_.device, st);
    Tensor pe = Tensor::empty(x.shape(), x.dtype(), x.device(), st);
    ops::embedding_forward(position_.data, pos_ids, pe, -1, st);
    x = add(x, pe, st);
    positions_ = ctx.training ? pos_ids : Tensor();
  }
  for (auto& layer : layers_) x = layer->forward(ctx, x);
  Tensor n = final_norm_->forward(ctx, x);
  logits_ = output_layer_.forward(ctx, n);

  Tensor labels_sb = labels.transpose(0, 1).contiguous(st);
  Tensor mask_sb = loss_mask.defined() ? loss_mask.transpose(0, 1).contiguous(st) : Tensor();
  Tensor per_token = loss_.forward(ctx, logits_, labels_sb, mask_sb);

  // The denominator comes from the inputs, which a data loader has on the host; reading them back from a
  // device is a sync, acceptable once per micro-batch.
  const std::vector<double> lab = labels.to_double_vector();
  const std::vector<double> msk = loss_mask.defined() ? loss_mask.to_double_vector() : std::vector<double>();
  double count = 0;
  for (size_t i = 0; i < lab.size(); ++i)
    if (int64_t(lab[i]) != loss_.options().ignore_index) count += msk.empty() ? 1.0 : msk[i];
  grad_scale_ = count > 0 ? float(1.0 / count) : 0.f;

  // Σ loss on the device as a [1, N] × [N, 1] product, scaled by 1 / count.
  const int64_t nt = per_token.numel();
  Tensor ones = Tensor::full({1, nt}, 1.0, DType::F32, per_token.device(), st);
  Tensor loss = Tensor::empty({1, 1}, DType::F32, per_token.device(), st);
  ops::GemmOptions sum;
  sum.alpha = grad_scale_;
  ops::gemm(ones, per_token.contiguous(st).view({nt, 1}), loss, sum, st);
  has_forward_ = ctx.training;
  return loss.view({1});
}

void GPTModel::backward(const ly::ForwardContext& ctx) {
  MC_CHECK(has_forward_,
           "GPTModel.backward: no saved forward; call forward with ctx.training = true before backward (each forward "
           "allows one backward)");
  has_forward_ = false;
  // Sequence-parallel gradients are partial sums until all-reduced. Reducing them here keeps every
  // main_grad complete after each backward; setting the earlier micro-batches' (already reduced)
  // totals aside first keeps that right under gradient accumulation. These are only norms, biases
  // and positions, so the copies are small. (Megatron-Core instead defers the reduction to once per
  // step; a trainer that wants that can own the schedule.)
  std::vector<std::pair<ly::Parameter*, Tensor>> earlier;
  if (cfg_.sequence_parallel)
    for (ly::Parameter* p : params_)
      if (p->sequence_parallel) {
        earlier.emplace_back(p, p->main_grad.clone(ctx.stream));
        p->main_grad.zero_(ctx.stream);
      }
  Tensor dlogits = loss_.backward(ctx, grad_scale_);
  Tensor dx = final_norm_->backward(ctx, output_layer_.backward(ctx, dlogits));
  for (auto it = layers_.rbegin(); it != layers_.rend(); ++it) dx = (*it)->backward(ctx, dx);
  if (position_.data.defined()) {
    ops::embedding_backward(dx, positions_, position_.main_grad, /*accumulate=*/true, -1, ctx.stream);
    positions_ = Tensor();
  }
  embedding_.backward(ctx, dx);
  if (cfg_.sequence_parallel) {
    ly::allreduce_sequence_parallel_grads(tp_, params_, ctx.stream);
    for (auto& [p, g] : earlier) p->main_grad.copy_(add(p->main_grad, g, ctx.stream), ctx.stream);
  }
}

Tensor GPTModel::logits() const {
  MC_CHECK(logits_.defined(), "GPTModel.logits: no forward has run yet; call forward first");
  return logits_.transpose(0, 1);
}

ly::Parameter& GPTModel::parameter(const std::string& name) const {
  std::string names;
  for (ly::Parameter* p : params_) {
    if (p->name == name) return *p;
    names += (names.empty() ? "" : ", ") + p->name;
  }
  throw ValueError(fmt::format("GPTModel.parameter: no parameter named '{}'; the model has: {}", name, names));
}

void GPTModel::zero_grad() {
  for (ly::Parameter* p : params_) p->main_grad.zero_();
}

}  // namespace megacore::model
