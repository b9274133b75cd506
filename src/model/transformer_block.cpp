#include "megacore/model/transformer_block.hpp"

#include <fmt/format.h>

#include "megacore/core/error.hpp"
#include "megacore/layers/linear.hpp"

namespace megacore::model {

namespace ly = megacore::layers;

namespace {

// Runs first in the member-initialiser list, so bad input is refused before any allocation. The block
// checks its own options; the config as a whole is validated at the boundary (GPTModel, train::validate)
// and each layer checks its local invariants.
const TransformerConfig& checked(const TransformerConfig& cfg, const TransformerBlockOptions& o) {
  if (o.layer_indices) {
    const std::vector<int64_t>& li = *o.layer_indices;
    for (size_t i = 0; i < li.size(); ++i) {
      MC_CHECK_AS(ConfigError, li[i] >= 0 && li[i] < cfg.num_layers,
                  "TransformerBlock: layer index {} is outside the model's {} layers; pass global indices 0..{} (e.g. "
                  "from PipelineLayout::layer_indices)", li[i], cfg.num_layers, cfg.num_layers - 1);
      MC_CHECK_AS(ConfigError, i == 0 || li[i] > li[i - 1],
                  "TransformerBlock: layer_indices must be strictly increasing, got {} after {}; list each layer once, "
                  "in model order", li[i], li[i - 1]);
    }
  }
  return cfg;
}

std::vector<int64_t> indices_of(const TransformerConfig& cfg, const TransformerBlockOptions& o) {
  if (o.layer_indices) return *o.layer_indices;
  std::vector<int64_t> all(size_t(cfg.num_layers));
  for (int64_t i = 0; i < cfg.num_layers; ++i) all[size_t(i)] = i;
  return all;
}

}  // namespace

std::unique_ptr<ly::NormLayer> make_model_norm(const TransformerConfig& cfg, Device device) {
  ly::NormOptions o{.eps = cfg.norm_eps,
                    .sequence_parallel = cfg.sequence_parallel,
                    .bias = cfg.add_bias_linear,
                    .params_dtype = cfg.params_dtype,
                    .device = device};
  if (cfg.normalization == NormType::LayerNorm) return std::make_unique<ly::LayerNorm>(cfg.hidden_size, o);
  return std::make_unique<ly::RMSNorm>(cfg.hidden_size, o);
}

void run_grad_group(comm::Communicator& tp, const TransformerConfig& cfg, const std::vector<ly::Parameter*>& group,
                    const GradReadyCallback& cb, const Stream& s, const std::function<void()>& backward) {
  // Sequence-parallel gradients are partial sums until all-reduced over TP. Each group reduces its own
  // right after its backward (so the group can be reported complete); setting the earlier
  // micro-batches' (already reduced) totals aside first keeps that right under gradient accumulation.
  // These are only norms, biases and positions, so the copies are small. (Megatron-Core instead defers
  // the reduction to once per step.)
  std::vector<std::pair<ly::Parameter*, Tensor>> earlier;
  // (LoRA's TP-partial adapter gradients carry the same flag, with or without SP.)
  if (tp.size() > 1)
    for (ly::Parameter* p : group)
      if (p->sequence_parallel) {
        earlier.emplace_back(p, p->main_grad.clone(s));
        p->main_grad.zero_(s);
      }
  backward();
  if (!earlier.empty()) {
    std::vector<ly::Parameter*> sp;
    for (auto& [p, g] : earlier) sp.push_back(p);
    ly::allreduce_sequence_parallel_grads(tp, sp, s);
    for (auto& [p, g] : earlier) p->main_grad.copy_(add(p->main_grad, g, s), s);
  }
  if (cb && !group.empty()) cb(group);
}

TransformerBlock::TransformerBlock(comm::Communicator& tp, const TransformerConfig& cfg,
                                   const TransformerBlockOptions& options)
    : tp_(tp), cfg_(checked(cfg, options)), opts_(options), layer_indices_(indices_of(cfg, options)) {
  for (size_t i = 0; i < layer_indices_.size(); ++i) {
    TransformerConfig layer_cfg = cfg_;
    if (cfg_.recompute_granularity == RecomputeGranularity::Full && opts_.recompute_num_layers >= 0 &&
        int64_t(i) >= opts_.recompute_num_layers)
      layer_cfg.recompute_granularity = RecomputeGranularity::None;
    layers_.push_back(std::make_unique<TransformerLayer>(
        tp, layer_cfg, TransformerLayerOptions{.layer_number = layer_indices_[i],
                                               .init_offset_base = opts_.init_offset_base,
                                               .device = opts_.device,
                                               .cp = opts_.cp,
                                               .cp_comm_type = opts_.cp_comm_type,
                                               .moe = opts_.moe}));
  }
  if (opts_.final_layernorm) final_norm_ = make_model_norm(cfg_, opts_.device);

  collect_parameters();
}

void TransformerBlock::collect_parameters() {
  named_.clear();
  layer_groups_.clear();
  final_group_.clear();
  for (size_t i = 0; i < layers_.size(); ++i) {
    layer_groups_.emplace_back();
    for (auto& [n, p] : layers_[i]->named_parameters()) {
      p->name = fmt::format("layers.{}.{}", layer_indices_[i], n);
      named_.emplace_back(p->name, p);
      layer_groups_.back().push_back(p);
    }
  }
  if (final_norm_ && !lora_) {
    auto add_final = [&](const char* name, ly::Parameter* p) {
      p->name = name;
      named_.emplace_back(p->name, p);
      final_group_.push_back(p);
    };
    add_final("final_layernorm.weight", &final_norm_->weight());
    if (final_norm_->has_bias()) add_final("final_layernorm.bias", &final_norm_->bias());
  }
  final_norm_params_ = final_group_.size();
  final_group_.insert(final_group_.end(), final_extra_.begin(), final_extra_.end());
}

void TransformerBlock::set_final_norm_group_extra(std::vector<ly::Parameter*> extra) {
  MC_CHECK(final_norm_ != nullptr || extra.empty(),
           "TransformerBlock.set_final_norm_group_extra: the block has no final norm; build it with "
           "final_layernorm = true (the last pipeline stage)");
  final_extra_ = extra;
  final_group_.resize(final_norm_params_);
  final_group_.insert(final_group_.end(), extra.begin(), extra.end());
}

void TransformerBlock::apply_lora(const LoRAConfig& lora) {
  for (auto& l : layers_) l->apply_lora(tp_, lora);
  lora_ = true;
  collect_parameters();
}

void TransformerBlock::merge_lora() {
  for (auto& l : layers_) l->merge_lora();
  lora_ = false;
  collect_parameters();
}

std::vector<ly::Parameter*> TransformerBlock::parameters() const {
  std::vector<ly::Parameter*> out;
  for (auto& [n, p] : named_) out.push_back(p);
  return out;
}

void TransformerBlock::zero_grad() {
  for (auto& [n, p] : named_) p->main_grad.zero_();
}

ly::NormLayer& TransformerBlock::final_layernorm() {
  MC_CHECK(final_norm_ != nullptr, "TransformerBlock.final_layernorm: this block has no final norm; build it with "
           "final_layernorm = true (the last pipeline stage)");
  return *final_norm_;
}

Tensor TransformerBlock::forward(const ly::ForwardContext& ctx, const Tensor& x, const Tensor& position_ids) {
  MC_CHECK(x.defined(), "TransformerBlock.forward: the input is undefined; pass the hidden states [s, b, {}]",
           cfg_.hidden_size);
  MC_CHECK(x.dim() == 3 && x.size(2) == cfg_.hidden_size,
           "TransformerBlock.forward: input has shape {}; it must be [s, b, {}] ([s/TP, b, {}] with sequence "
           "parallelism)", shape_str(x.shape()), cfg_.hidden_size, cfg_.hidden_size);
  MC_CHECK(x.dtype() == cfg_.params_dtype && x.device() == opts_.device,
           "TransformerBlock.forward: input is {} on {}; the block runs in {} on {}; convert it with .to()",
           dtype_name(x.dtype()), x.device().str(), dtype_name(cfg_.params_dtype), opts_.device.str());
  Tensor y = x;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (pre_forward_) pre_forward_(layer_groups_[i]);
    y = layers_[i]->forward(ctx, y, position_ids);
  }
  if (final_norm_) {
    if (pre_forward_) pre_forward_(final_group_);  // with the head's weight (the extras)
    y = final_norm_->forward(ctx, y);
  }
  out_shape_ = y.shape();
  has_forward_ = ctx.training;
  return y;
}

Tensor TransformerBlock::backward(const ly::ForwardContext& ctx, const Tensor& dy) {
  MC_CHECK(has_forward_,
           "TransformerBlock.backward: no saved forward; call forward with ctx.training = true before backward (each "
           "forward allows one backward; restore_activations a stashed micro-batch first)");
  MC_CHECK(dy.defined() && dy.shape() == out_shape_,
           "TransformerBlock.backward: dy {} does not match forward's output {}; pass the gradient of forward's output",
           dy.defined() ? shape_str(dy.shape()) : std::string("(undefined)"), shape_str(out_shape_));
  const Stream& st = ctx.stream;
  has_forward_ = false;
  Tensor dx = dy;
  if (final_norm_)
    run_grad_group(tp_, cfg_, final_group_, grad_ready_, st, [&] { dx = final_norm_->backward(ctx, dx); });
  for (size_t i = layers_.size(); i-- > 0;)
    run_grad_group(tp_, cfg_, layer_groups_[i], grad_ready_, st, [&] { dx = layers_[i]->backward(ctx, dx); });
  return dx;
}

void TransformerBlock::stash_activations(ly::ActivationStash& s) {
  for (auto& layer : layers_) layer->stash_activations(s);
  if (final_norm_) final_norm_->stash_activations(s);
  s.put_shape(out_shape_);
  s.put_int(std::exchange(has_forward_, false) ? 1 : 0);
}

void TransformerBlock::restore_activations(ly::ActivationStash& s) {
  for (auto& layer : layers_) layer->restore_activations(s);
  if (final_norm_) final_norm_->restore_activations(s);
  out_shape_ = s.take_shape();
  has_forward_ = s.take_int() != 0;
}

}  // namespace megacore::model
