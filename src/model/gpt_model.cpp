#include "megacore/model/gpt_model.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <utility>

#include "megacore/core/error.hpp"
#include "megacore/ops/embedding.hpp"
#include "megacore/ops/gemm.hpp"
#include "megacore/parallel/context_parallel.hpp"
#include "megacore/parallel/process_grid.hpp"

namespace megacore::model {

namespace ly = megacore::layers;

namespace {

constexpr uint64_t kWordEmbeddingOffset = 0, kPositionEmbeddingOffset = 1, kOutputLayerOffset = 2;

// Runs first in the member-initialiser list, so a bad config or stage description is refused before
// any allocation.
const TransformerConfig& validated(const TransformerConfig& cfg, comm::Communicator& tp, const GPTModelOptions& o) {
  validate(cfg, tp.size());
  if (o.layer_indices) {
    const std::vector<int64_t>& li = *o.layer_indices;
    for (size_t i = 0; i < li.size(); ++i) {
      MC_CHECK_AS(ConfigError, li[i] >= 0 && li[i] < cfg.num_layers,
                  "GPTModel: layer index {} is outside the model's {} layers; pass global indices 0..{} (e.g. from "
                  "PipelineLayout::layer_indices)", li[i], cfg.num_layers, cfg.num_layers - 1);
      MC_CHECK_AS(ConfigError, i == 0 || li[i] > li[i - 1],
                  "GPTModel: layer_indices must be strictly increasing, got {} after {}; list each layer once, in "
                  "model order", li[i], li[i - 1]);
    }
  }
  return cfg;
}

std::vector<int64_t> indices_of(const TransformerConfig& cfg, const GPTModelOptions& o) {
  if (o.layer_indices) return *o.layer_indices;
  std::vector<int64_t> all(size_t(cfg.num_layers));
  for (int64_t i = 0; i < cfg.num_layers; ++i) all[size_t(i)] = i;
  return all;
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

int64_t double_bits(double v) { return std::bit_cast<int64_t>(v); }
double bits_double(int64_t v) { return std::bit_cast<double>(v); }

}  // namespace

double count_loss_tokens(const Tensor& labels, const Tensor& loss_mask, int64_t ignore_index, const Stream& s) {
  // Device tensors are read on `s` (the stream they are ready on), host tensors directly.
  const std::vector<double> lab = labels.to(Device::cpu(), s).to_double_vector();
  const std::vector<double> msk =
      loss_mask.defined() ? loss_mask.to(Device::cpu(), s).to_double_vector() : std::vector<double>();
  MC_CHECK(msk.empty() || msk.size() == lab.size(),
           "count_loss_tokens: loss_mask has {} elements but labels {}; pass one mask value per label", msk.size(),
           lab.size());
  double count = 0;
  for (size_t i = 0; i < lab.size(); ++i)
    if (int64_t(lab[i]) != ignore_index) count += msk.empty() ? 1.0 : msk[i];
  return count;
}

GPTModel::GPTModel(const TransformerConfig& cfg, comm::Communicator& tp, const GPTModelOptions& options)
    : tp_(tp), cfg_(validated(cfg, tp, options)), opts_(options), layer_indices_(indices_of(cfg, options)) {
  const bool tied_copy = cfg_.tie_word_embeddings && opts_.post_process && !opts_.pre_process;
  if (opts_.pre_process || tied_copy)
    embedding_ = std::make_unique<ly::VocabParallelEmbedding>(
        tp, cfg_.vocab_size, cfg_.hidden_size,
        ly::VocabParallelEmbeddingOptions{.padded_vocab_size = model::padded_vocab_size(cfg_, tp.size()),
                                          .sequence_parallel = cfg_.sequence_parallel,
                                          .params_dtype = cfg_.params_dtype,
                                          .device = opts_.device,
                                          .init_std = cfg_.init_method_std,
                                          .seed = cfg_.seed,
                                          .init_offset = kWordEmbeddingOffset});
  if (opts_.pre_process && cfg_.position_embedding == PositionEmbeddingType::Learned) {
    position_.name = "weight";
    position_.data = ly::init_full_weight(cfg_.max_position_embeddings, cfg_.hidden_size, cfg_.init_method_std,
                                          cfg_.seed, kPositionEmbeddingOffset, cfg_.params_dtype, opts_.device);
    position_.main_grad = Tensor::zeros(position_.data.shape(), DType::F32, opts_.device);
    // Each rank looks up only its chunk's positions under SP, so its gradient is a partial sum.
    position_.sequence_parallel = cfg_.sequence_parallel;
  }
  block_ = std::make_unique<TransformerBlock>(tp, cfg_,
                                              TransformerBlockOptions{.layer_indices = layer_indices_,
                                                                      .final_layernorm = opts_.post_process,
                                                                      .recompute_num_layers = opts_.recompute_num_layers,
                                                                      .init_offset_base = kModelLayerInitBase,
                                                                      .device = opts_.device,
                                                                      .cp = opts_.cp,
                                                                      .cp_comm_type = opts_.cp_comm_type,
                                                                      .moe = opts_.moe});
  if (opts_.post_process) {
    output_layer_ = std::make_unique<ly::ColumnParallelLinear>(
        tp, cfg_.hidden_size, model::padded_vocab_size(cfg_, tp.size()),
        ly::ColumnParallelLinearOptions{.bias = false,
                                        .gather_output = false,
                                        .sequence_parallel = cfg_.sequence_parallel,
                                        .params_dtype = cfg_.params_dtype,
                                        .device = opts_.device,
                                        .init_std = cfg_.init_method_std,
                                        .seed = cfg_.seed,
                                        .init_offset = kOutputLayerOffset,
                                        .overlap_grad_comm = cfg_.tp_comm_overlap,
                                        .overlap_sp_forward = cfg_.tp_comm_overlap_forward && cfg_.sequence_parallel,
                                        .comm_stream_priority = cfg_.tp_comm_stream_priority});
    loss_ = std::make_unique<ly::VocabParallelCrossEntropy>(
        tp, cfg_.vocab_size, ly::VocabParallelCrossEntropyOptions{.label_smoothing = opts_.label_smoothing});
    if (cfg_.tie_word_embeddings) {
      // Share the tensors themselves: the output GEMM reads the embedding table (or the last stage's copy
      // of it, drawn identically) and its weight-gradient GEMM accumulates (beta = 1) into the same
      // main_grad, which is how the two gradients add. The output layer's own initial draw is dropped.
      output_layer_->weight().data = embedding_->weight().data;
      output_layer_->weight().main_grad = embedding_->weight().main_grad;
    }
  }

  collect_parameters();
}

void GPTModel::collect_parameters() {
  embedding_group_.clear();
  head_extra_.clear();
  auto add = [&](std::vector<ly::Parameter*>& group, const std::string& name, ly::Parameter* p) {
    p->name = name;
    if (!lora_) group.push_back(p);  // with LoRA these weights are frozen
  };
  const bool tied_copy = cfg_.tie_word_embeddings && opts_.post_process && !opts_.pre_process;
  if (opts_.pre_process) {
    add(embedding_group_, "embedding.weight", &embedding_->weight());
    if (position_.data.defined()) add(embedding_group_, "position_embedding.weight", &position_);
  }
  // The block names its parameters "layers.<i>.*" and "final_layernorm.*"; the head's own weight is
  // reported with the final norm's grad-ready group.
  if (opts_.post_process) {
    if (!cfg_.tie_word_embeddings) add(head_extra_, "output_layer.weight", &output_layer_->weight());
    if (tied_copy) add(head_extra_, "embedding.weight", &embedding_->weight());
    block_->set_final_norm_group_extra(head_extra_);
  }
  // parameters() in model order: embedding, positions, layers, final norm, output layer (or tied copy).
  params_ = embedding_group_;
  for (auto& [n, p] : block_->named_parameters()) params_.push_back(p);
  params_.insert(params_.end(), head_extra_.begin(), head_extra_.end());
}

void GPTModel::apply_lora(const LoRAConfig& lora) {
  const std::vector<std::string> problems = lora_problems(lora, cfg_);
  if (!problems.empty()) {
    std::string msg;
    for (const std::string& p : problems) msg += (msg.empty() ? "" : "; ") + p;
    MC_CHECK_AS(ConfigError, false, "LoRA: {}", msg);
  }
  MC_CHECK(!lora_, "GPTModel.apply_lora: adapters are already attached; merge_lora first to attach new ones");
  block_->apply_lora(lora);
  if (output_layer_) output_layer_->set_frozen(true);
  if (embedding_) embedding_->weight().main_grad = Tensor();
  if (position_.data.defined()) position_.main_grad = Tensor();
  lora_ = true;
  collect_parameters();
}

void GPTModel::merge_lora() {
  if (!lora_) return;
  block_->merge_lora();
  if (output_layer_) output_layer_->set_frozen(false);
  for (ly::Parameter* p : {embedding_ ? &embedding_->weight() : nullptr, &position_})
    if (p && p->data.defined()) p->main_grad = Tensor::zeros(p->data.shape(), DType::F32, p->data.device());
  lora_ = false;
  collect_parameters();
  sync_tied_output_weight();
}

std::vector<ly::Parameter*> GPTModel::all_parameters() {
  if (!lora_) return params_;
  std::vector<ly::Parameter*> out;
  if (opts_.pre_process) {
    out.push_back(&embedding_->weight());
    if (position_.data.defined()) out.push_back(&position_);
  }
  for (int64_t i = 0; i < block_->num_layers(); ++i) {
    TransformerLayer& l = block_->layer(i);
    const std::string pre = fmt::format("layers.{}.", layer_indices_[size_t(i)]);
    auto norm = [&](const std::string& prefix, ly::NormLayer& n) {
      n.weight().name = pre + prefix + "weight";
      out.push_back(&n.weight());
      if (n.has_bias()) n.bias().name = pre + prefix + "bias", out.push_back(&n.bias());
    };
    auto linear = [&](const std::string& prefix, auto& lin) {
      lin.weight().name = pre + prefix + "weight";
      out.push_back(&lin.weight());
      if (lin.options().bias) lin.bias().name = pre + prefix + "bias", out.push_back(&lin.bias());
    };
    norm("input_layernorm.", l.input_layernorm());
    linear("self_attention.linear_qkv.", l.self_attention().linear_qkv());
    if (ly::NormLayer* qn = l.self_attention().q_layernorm()) {
      norm("self_attention.q_layernorm.", *qn);
      norm("self_attention.k_layernorm.", *l.self_attention().k_layernorm());
    }
    linear("self_attention.linear_proj.", l.self_attention().linear_proj());
    norm("pre_mlp_layernorm.", l.pre_mlp_layernorm());
    if (ly::MoELayer* moe = l.moe()) {
      for (auto [leaf, p] : {std::pair{"router", &moe->router_weight()}, std::pair{"experts.linear_fc1", &moe->fc1_weight()},
                             std::pair{"experts.linear_fc2", &moe->fc2_weight()}})
        p->name = pre + "mlp." + leaf + ".weight", out.push_back(p);
      if (ly::MLP* se = moe->shared_expert()) {
        linear("mlp.shared_experts.linear_fc1.", se->fc1());
        linear("mlp.shared_experts.linear_fc2.", se->fc2());
      }
      continue;
    }
    linear("mlp.linear_fc1.", l.mlp().fc1());
    linear("mlp.linear_fc2.", l.mlp().fc2());
  }
  if (opts_.post_process) {
    ly::NormLayer& n = block_->final_layernorm();
    n.weight().name = "final_layernorm.weight";
    out.push_back(&n.weight());
    if (n.has_bias()) n.bias().name = "final_layernorm.bias", out.push_back(&n.bias());
    if (!cfg_.tie_word_embeddings) out.push_back(&output_layer_->weight());
    else if (!opts_.pre_process) out.push_back(&embedding_->weight());
  }
  out.insert(out.end(), params_.begin(), params_.end());
  return out;
}

int64_t GPTModel::padded_vocab_size() const { return model::padded_vocab_size(cfg_, tp_.size()); }

Shape GPTModel::activation_shape(int64_t batch, int64_t seq) const {
  const int64_t s = cfg_.sequence_parallel ? seq / tp_.size() : seq;
  return {s, batch, cfg_.hidden_size};
}

Tensor GPTModel::forward(const ly::ForwardContext& ctx, const Tensor& tokens, const Tensor& labels,
                         const Tensor& loss_mask) {
  MC_CHECK(opts_.pre_process && opts_.post_process,
           "GPTModel.forward: this model is a pipeline stage (pre_process {}, post_process {}); run it with "
           "forward_stage, or build it with both set for the whole model", opts_.pre_process, opts_.post_process);
  return forward_stage(ctx, Tensor(), tokens, labels, loss_mask);
}

void GPTModel::backward(const ly::ForwardContext& ctx) {
  MC_CHECK(opts_.pre_process && opts_.post_process,
           "GPTModel.backward: this model is a pipeline stage; run it with backward_stage");
  backward_stage(ctx, Tensor(), 1.f);
}

Tensor GPTModel::forward_stage(const ly::ForwardContext& ctx, const Tensor& input, const Tensor& tokens,
                               const Tensor& labels, const Tensor& loss_mask) {
  const Stream& st = ctx.stream;
  const int64_t tpn = tp_.size();
  int64_t b = -1, s = -1;
  if (opts_.pre_process) {
    MC_CHECK(!input.defined(),
             "GPTModel.forward_stage: this stage embeds the tokens (pre_process) but got an input hidden state "
             "{}; pass an undefined input", shape_str(input.shape()));
    check_batch(tokens, "tokens", true);
    b = tokens.size(0), s = tokens.size(1);
  }
  if (opts_.post_process) {
    check_batch(labels, "labels", true);
    if (b >= 0)
      MC_CHECK(labels.shape() == tokens.shape(), "GPTModel.forward: labels {} and tokens {} differ in shape; pass one "
               "label per token", shape_str(labels.shape()), shape_str(tokens.shape()));
    b = labels.size(0), s = labels.size(1);
    if (loss_mask.defined()) {
      check_batch(loss_mask, "loss_mask", false);
      MC_CHECK(loss_mask.shape() == labels.shape(), "GPTModel.forward: loss_mask {} and labels {} differ in shape; "
               "pass one mask value per token", shape_str(loss_mask.shape()), shape_str(labels.shape()));
    }
  }
  if (s >= 0) {
    const int64_t cpn = cp_active() ? opts_.cp->size() : 1;  // s is this CP rank's local part of s·CP tokens
    MC_CHECK(s * cpn <= cfg_.max_position_embeddings,
             "GPTModel.forward: sequence length {} exceeds max_position_embeddings {}; shorten the sequences or "
             "raise max_position_embeddings", s * cpn, cfg_.max_position_embeddings);
    MC_CHECK(!cfg_.sequence_parallel || s % tpn == 0,
             "GPTModel.forward: sequence length {} is not a multiple of TP {} (sequence parallelism splits it); pad "
             "the sequences to a multiple of {}", s, tpn, tpn);
  }

  Tensor x;
  if (opts_.pre_process) {
    if (pre_forward_) pre_forward_(embedding_group_);
    // The layers work sequence-first ([s, b, h]) as Megatron-Core does.
    Tensor ids = tokens.transpose(0, 1).contiguous(st);
    x = embedding_->forward(ctx, ids);
    if (position_.data.defined()) {
      const int64_t s_local = cfg_.sequence_parallel ? s / tpn : s,
                    first = cfg_.sequence_parallel ? tp_.rank() * s_local : 0;
      // Positions restart at every segment of packed rows (ctx.position_ids, [b, s]); else 0..s-1.
      const Tensor& given = ctx.position_ids;
      // (Under context parallelism they are this rank's [b, s] part, cp_slice_sequence of the full rows'.)
      if (given.defined())
        MC_CHECK(given.dim() == 2 && given.size(0) == b && given.size(1) == s,
                 "GPTModel.forward: ctx.position_ids has shape {}; it must be the batch's [b, s] = [{}, {}]",
                 shape_str(given.shape()), b, s);
      Tensor pos_ids;
      if (given.defined() && given.dtype() == DType::I64 && given.device() == opts_.device) {
        // The loader's ids on the model's device: this rank's [s_local, b] slice, without a host trip.
        pos_ids = given.narrow(1, first, s_local).transpose(0, 1).contiguous(st);
      } else {
        const std::vector<double> ids = given.defined() ? given.to_double_vector() : std::vector<double>();
        std::vector<int64_t> pos(size_t(s_local * b));
        const int cr = cp_active() ? opts_.cp->rank() : 0, cn = cp_active() ? opts_.cp->size() : 1;
        for (int64_t i = 0; i < s_local; ++i)
          for (int64_t j = 0; j < b; ++j)
            pos[size_t(i * b + j)] = ids.empty() ? parallel::cp_global_position(first + i, s, cr, cn)
                                                 : int64_t(ids[size_t(j * s + first + i)]);
        pos_ids = Tensor::from_vector<int64_t>(pos, {s_local, b}).to(opts_.device, st);
      }
      Tensor pe = Tensor::empty(x.shape(), x.dtype(), x.device(), st);
      ops::embedding_forward(position_.data, pos_ids, pe, -1, st);
      x = add(x, pe, st);
      positions_ = ctx.training ? pos_ids : Tensor();
    }
  } else {
    MC_CHECK(input.defined(),
             "GPTModel.forward_stage: this stage has no embedding (pre_process = false) and needs the previous "
             "stage's hidden states; pass them as input");
    MC_CHECK(input.dim() == 3 && input.size(2) == cfg_.hidden_size,
             "GPTModel.forward_stage: input has shape {}; it must be [s, b, {}] ([s/TP, b, {}] with sequence "
             "parallelism)", shape_str(input.shape()), cfg_.hidden_size, cfg_.hidden_size);
    if (b >= 0)
      MC_CHECK(input.shape() == activation_shape(b, s),
               "GPTModel.forward_stage: input has shape {} but labels [{}, {}] need {}; pass the previous stage's "
               "output for this micro-batch", shape_str(input.shape()), b, s, shape_str(activation_shape(b, s)));
    MC_CHECK(input.dtype() == cfg_.params_dtype && input.device() == opts_.device,
             "GPTModel.forward_stage: input is {} on {}; the model runs in {} on {}", dtype_name(input.dtype()),
             input.device().str(), dtype_name(cfg_.params_dtype), opts_.device.str());
    x = input;
  }
  // The block ends with the final norm on a post_process stage (same shape as its layers' output).
  // RoPE layers take the packed rows' positions (learned positions were added at the embedding above).
  x = block_->forward(ctx, x,
                      cfg_.position_embedding == PositionEmbeddingType::RoPE ? ctx.position_ids : Tensor());
  out_shape_ = x.shape();
  has_forward_ = ctx.training;
  if (!opts_.post_process) return x;

  sync_tied_output_weight();
  const Tensor& n = x;
  logits_ = output_layer_->forward(ctx, n);
  Tensor labels_sb = labels.transpose(0, 1).contiguous(st);
  Tensor mask_sb = loss_mask.defined() ? loss_mask.transpose(0, 1).contiguous(st) : Tensor();
  Tensor per_token = loss_->forward(ctx, logits_, labels_sb, mask_sb);

  // The denominator comes from the inputs, which a data loader has on the host; reading them back from a
  // device is a sync, acceptable once per micro-batch.
  if (ctx.loss_tokens >= 0) {
    loss_tokens_ = ctx.loss_tokens;
  } else {
    loss_tokens_ = count_loss_tokens(labels, loss_mask, loss_->options().ignore_index, st);
    if (cp_active()) {  // the denominator of the whole sequence: this rank's loss is its share of the mean
      Tensor t = Tensor::from_vector<float>({float(loss_tokens_)}, {1}).to(opts_.device, st);
      opts_.cp->all_reduce(t, comm::ReduceOp::Sum, st)->wait();
      loss_tokens_ = t.to(Device::cpu(), st).item();
    }
  }
  grad_scale_ = loss_tokens_ > 0 ? float(1.0 / loss_tokens_) : 0.f;

  // Σ loss on the device as a [1, N] × [N, 1] product, scaled by 1 / count.
  const int64_t nt = per_token.numel();
  Tensor ones = Tensor::full({1, nt}, 1.0, DType::F32, per_token.device(), st);
  Tensor loss = Tensor::empty({1, 1}, DType::F32, per_token.device(), st);
  ops::GemmOptions sum;
  sum.alpha = grad_scale_;
  ops::gemm(ones, per_token.contiguous(st).view({nt, 1}), loss, sum, st);
  return loss.view({1});
}

Tensor GPTModel::backward_stage(const ly::ForwardContext& ctx, const Tensor& grad_output, float loss_grad_scale) {
  MC_CHECK(has_forward_,
           "GPTModel.backward: no saved forward; call forward with ctx.training = true before backward (each forward "
           "allows one backward; with several micro-batches in flight, restore_activations the micro-batch first)");
  const Stream& st = ctx.stream;
  Tensor dx;
  if (opts_.post_process) {
    MC_CHECK(!grad_output.defined(),
             "GPTModel.backward_stage: this stage computes the loss (post_process), so it takes no output gradient; "
             "pass an undefined grad_output (scale the loss with loss_grad_scale)");
    sync_tied_output_weight();
    // The head group {final norm, output layer weight} is reported by the block after the final norm.
    Tensor dlogits = loss_->backward(ctx, grad_scale_ * loss_grad_scale);
    dx = output_layer_->backward(ctx, dlogits);
  } else {
    MC_CHECK(grad_output.defined() && grad_output.shape() == out_shape_,
             "GPTModel.backward_stage: grad_output {} does not match this stage's output {}; pass the next stage's "
             "input gradient for the same micro-batch", grad_output.defined() ? shape_str(grad_output.shape())
                                                                                : std::string("(undefined)"),
             shape_str(out_shape_));
    dx = grad_output;
  }
  has_forward_ = false;
  dx = block_->backward(ctx, dx);  // final norm (post_process), then the layers, last first
  if (!opts_.pre_process) return dx;
  if (lora_) {  // frozen embedding: nothing to compute
    positions_ = Tensor();
    return Tensor();
  }
  run_grad_group(tp_, cfg_, embedding_group_, grad_ready_, st, [&] {
    if (position_.data.defined()) {
      ops::embedding_backward(dx, positions_, position_.main_grad, /*accumulate=*/true, -1, st);
      positions_ = Tensor();
    }
    embedding_->backward(ctx, dx);
  });
  return Tensor();
}

ly::ActivationStash GPTModel::stash_activations() {
  ly::ActivationStash s;
  s.put_int(int64_t(reinterpret_cast<intptr_t>(this)));  // whose stash it is
  if (opts_.pre_process) embedding_->stash_activations(s);
  block_->stash_activations(s);
  if (opts_.post_process) {
    output_layer_->stash_activations(s);
    loss_->stash_activations(s);
  }
  s.put(logits_);
  s.put(positions_);
  s.put_shape(out_shape_);
  s.put_int(double_bits(double(grad_scale_)));
  s.put_int(double_bits(loss_tokens_));
  s.put_int(std::exchange(has_forward_, false) ? 1 : 0);
  return s;
}

void GPTModel::restore_activations(ly::ActivationStash&& s) {
  MC_CHECK(!has_forward_,
           "GPTModel.restore_activations: the model still holds an un-backpropagated forward; stash_activations it "
           "(or run its backward) before restoring another micro-batch");
  MC_CHECK(!s.empty() && s.take_int() == int64_t(reinterpret_cast<intptr_t>(this)),
           "GPTModel.restore_activations: this stash was not taken from this model (chunk); restore each stash into "
           "the model chunk whose stash_activations made it");
  if (opts_.pre_process) embedding_->restore_activations(s);
  block_->restore_activations(s);
  if (opts_.post_process) {
    output_layer_->restore_activations(s);
    loss_->restore_activations(s);
  }
  s.take(logits_);
  s.take(positions_);
  out_shape_ = s.take_shape();
  grad_scale_ = float(bits_double(s.take_int()));
  loss_tokens_ = bits_double(s.take_int());
  has_forward_ = s.take_int() != 0;
  MC_CHECK(s.empty(),
           "GPTModel.restore_activations: the stash holds more than this model saved; restore a stash only into the "
           "model (chunk) it was taken from");
}

void GPTModel::sync_tied_output_weight() {
  // A DDP / distributed optimizer may rebind the listed parameter's data and main_grad to views of its
  // contiguous buffers; the output layer's alias (not listed in parameters()) follows it here.
  if (!cfg_.tie_word_embeddings || !output_layer_) return;
  output_layer_->weight().data = embedding_->weight().data;
  output_layer_->weight().main_grad = embedding_->weight().main_grad;
}

bool GPTModel::is_tied_copy(const ly::Parameter& p) const {
  return cfg_.tie_word_embeddings && opts_.post_process && !opts_.pre_process && embedding_ &&
         &p == &embedding_->weight();
}

ly::Parameter* GPTModel::tied_embedding_weight() {
  return cfg_.tie_word_embeddings && embedding_ ? &embedding_->weight() : nullptr;
}

void GPTModel::allreduce_tied_embedding_grads(comm::Communicator& embedding_group, const Stream& s) {
  ly::Parameter* w = tied_embedding_weight();
  if (!w || lora_ || (opts_.pre_process && opts_.post_process) || embedding_group.size() == 1) return;
  MC_CHECK(w->main_grad.is_contiguous(), "GPTModel.allreduce_tied_embedding_grads: main_grad of '{}' is not "
           "contiguous; allocate gradients contiguous", w->name);
  embedding_group.all_reduce(w->main_grad, comm::ReduceOp::Sum, s)->wait_on(s);
}

Tensor GPTModel::logits() const {
  MC_CHECK(logits_.defined(), "GPTModel.logits: no forward has run yet (or it was stashed, or this stage has no output "
           "layer); call forward on a post_process model first");
  return logits_.transpose(0, 1);
}

ly::VocabParallelEmbedding& GPTModel::embedding() {
  MC_CHECK(embedding_ != nullptr, "GPTModel.embedding: this stage holds no embedding (pre_process = false, untied); "
           "ask the first pipeline stage");
  return *embedding_;
}

ly::ColumnParallelLinear& GPTModel::output_layer() {
  MC_CHECK(output_layer_ != nullptr, "GPTModel.output_layer: this stage has no output layer (post_process = false); "
           "ask the last pipeline stage");
  return *output_layer_;
}

ly::NormLayer& GPTModel::final_layernorm() {
  MC_CHECK(block_->has_final_layernorm(), "GPTModel.final_layernorm: this stage has no final norm (post_process = "
           "false); ask the last pipeline stage");
  return block_->final_layernorm();
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

layers::MoEGroups moe_groups(const parallel::ProcessGrid& grid) {
  layers::MoEGroups g;
  g.tp = &grid.tp();
  g.ep = &grid.ep();
  g.expert_tp = &grid.expert_tp();
  if (grid.has_group(parallel::GroupKind::TpEp)) g.tp_ep = &grid.group(parallel::GroupKind::TpEp);
  return g;
}

std::vector<ly::MoELayer*> GPTModel::moe_layers() {
  std::vector<ly::MoELayer*> out;
  for (int64_t i = 0; i < block_->num_layers(); ++i)
    if (ly::MoELayer* m = block_->layer(i).moe()) out.push_back(m);
  return out;
}

double GPTModel::moe_aux_loss() const {
  double sum = 0;
  for (ly::MoELayer* m : const_cast<GPTModel*>(this)->moe_layers())
    for (const Tensor* t : {&m->aux_loss(), &m->z_loss()})
      if (t->defined()) sum += t->to(Device::cpu()).item();
  return sum;
}

void GPTModel::reset_moe_step_stats(const Stream& s) {
  for (ly::MoELayer* m : moe_layers()) m->reset_step_stats(s);
}

void GPTModel::set_moe_routing_step(uint64_t step, uint64_t replica) {
  for (ly::MoELayer* m : moe_layers()) m->set_routing_step(step, replica);
}

MoEStepMetrics moe_step_metrics(const std::vector<GPTModel*>& chunks, const parallel::ProcessGrid& grid,
                                int64_t micro_batches, const Stream& s) {
  MoEStepMetrics out;
  if (chunks.empty() || !chunks.front()->config().is_moe()) return out;
  const TransformerConfig& cfg = chunks.front()->config();
  MC_CHECK(micro_batches > 0, "moe_step_metrics: micro_batches is {}; pass the step's forwards per chunk (>= 1)",
           micro_batches);
  // Slot of each global MoE layer: every rank fills the layers it holds, zeros elsewhere, and the sums over
  // the world add every stage's layers and every rank's tokens (each rank routes its own tokens).
  std::vector<int64_t> slot(size_t(cfg.num_layers), -1);
  int64_t layers = 0;
  for (int64_t i = 0; i < cfg.num_layers; ++i)
    if (cfg.is_moe_layer(i)) slot[size_t(i)] = layers++;
  const int64_t e = cfg.num_moe_experts;
  comm::Communicator& world = grid.world();
  const Device dev = world.device();
  Tensor loss = Tensor::zeros({layers}, DType::F32, dev, s);
  std::vector<int64_t> counts(size_t(layers * e), 0);
  for (GPTModel* ch : chunks) {
    const std::vector<int64_t>& idx = ch->layer_indices();
    for (size_t j = 0; j < idx.size(); ++j) {
      ly::MoELayer* m = ch->layer(int64_t(j)).moe();
      if (!m) continue;
      const int64_t l = slot[size_t(idx[j])];
      loss.narrow(0, l, 1).copy_(m->step_loss_sum().to(dev, s), s);
      const std::vector<int64_t>& c = m->step_tokens_per_expert();
      std::copy(c.begin(), c.end(), counts.begin() + l * e);
    }
  }
  Tensor ct = Tensor::from_vector(counts, {layers * e});
  if (dev != Device::cpu()) ct = ct.to(dev, s);
  world.all_reduce(loss, comm::ReduceOp::Sum, s)->wait_on(s);
  world.all_reduce(ct, comm::ReduceOp::Sum, s)->wait_on(s);
  const std::vector<double> lh = loss.to(Device::cpu(), s).to_double_vector();
  const std::vector<double> ch = ct.to(Device::cpu(), s).to_double_vector();
  // Σ over the world of a layer's loss sums = Σ over DP×CP replicas and micro-batches of the loss of the
  // micro-batch's tokens (a TP group's local losses add up to its tokens' loss).
  const double per = double(micro_batches) * double(grid.dp_cp().size());
  for (int64_t l = 0; l < layers; ++l) {
    out.aux_loss += lh[size_t(l)] / per / double(layers);
    double total = 0, mx = 0;
    for (int64_t i = 0; i < e; ++i) total += ch[size_t(l * e + i)], mx = std::max(mx, ch[size_t(l * e + i)]);
    if (total > 0) out.load_imbalance = std::max(out.load_imbalance, mx / (total / double(e)));
  }
  return out;
}

void GPTModel::set_moe_aux_loss_grad_scale(float s) {
  MC_CHECK(std::isfinite(s) && s >= 0, "GPTModel.set_moe_aux_loss_grad_scale: scale {} must be finite and >= 0 (it "
           "multiplies the aux/z-loss gradients: loss scale / micro-batches); compute it without dividing by a "
           "micro-batch's token weight, which is 0 when none of its tokens is in the loss", s);
  for (ly::MoELayer* m : moe_layers()) m->set_aux_loss_grad_scale(s);
}

void GPTModel::update_expert_bias(comm::Communicator& dp, const Stream& s) {
  for (ly::MoELayer* m : moe_layers()) m->update_expert_bias(dp, s);
}

}  // namespace megacore::model
