#include "megacore/model/transformer_layer.hpp"
#include "megacore/model/transformer_block.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include "megacore/core/error.hpp"
#include "megacore/ops/norm.hpp"

namespace megacore::model {

namespace ly = megacore::layers;

namespace {

std::unique_ptr<ly::NormLayer> make_norm(const TransformerConfig& cfg, Device device) {
  return make_model_norm(cfg, device);
}

uint64_t layer_base(const TransformerLayerOptions& o) {
  return o.init_offset_base + uint64_t(o.layer_number) * kTransformerLayerInitStride;
}

// Megatron's scaled init of the layers that write into the residual stream.
double output_std(const TransformerConfig& cfg) {
  return cfg.init_method_std / std::sqrt(2.0 * double(cfg.num_layers));
}

ly::MLPOptions mlp_options(const TransformerConfig& cfg, const TransformerLayerOptions& options) {
  return ly::MLPOptions{.activation = cfg.activation,
                        .bias = cfg.add_bias_linear,
                        .sequence_parallel = cfg.sequence_parallel,
                        .params_dtype = cfg.params_dtype,
                        .device = options.device,
                        .init_std = cfg.init_method_std,
                        .output_init_std = output_std(cfg),
                        .seed = cfg.seed,
                        .init_offset = layer_base(options) + 2};
}

std::unique_ptr<ly::MoELayer> make_moe(comm::Communicator& tp, const TransformerConfig& cfg,
                                       const TransformerLayerOptions& o) {
  ly::MoEGroups g = o.moe;
  g.tp = &tp;
  auto fill = [&](comm::Communicator*& c, const char* name) {
    if (c) return;
    MC_CHECK(tp.size() == 1,
             "TransformerLayer {}: a MoE layer with TP {} needs its {} group; pass TransformerLayerOptions::moe "
             "(GPTModelOptions::moe: ProcessGrid ep, expert_tp, tp_ep)",
             o.layer_number, tp.size(), name);
    c = &tp;
  };
  fill(g.ep, "ep");
  fill(g.expert_tp, "expert_tp");
  fill(g.tp_ep, "tp_ep");
  ly::MoEOptions m;
  m.num_experts = cfg.num_moe_experts;
  m.topk = int(cfg.moe_router_topk);
  m.ffn_hidden_size = cfg.moe_ffn_size();
  m.shared_expert_size = cfg.moe_shared_expert_size;
  m.activation = cfg.activation;
  m.score = cfg.moe_router_score_function;
  m.pre_softmax = cfg.moe_router_pre_softmax;
  m.topk_scaling_factor = float(cfg.moe_router_topk_scaling_factor);
  m.aux_loss_coeff = float(cfg.moe_aux_loss_coeff);
  m.z_loss_coeff = float(cfg.moe_z_loss_coeff);
  m.enable_expert_bias = cfg.moe_router_enable_expert_bias;
  m.expert_bias_update_rate = float(cfg.moe_router_bias_update_rate);
  m.capacity_factor = cfg.moe_expert_capacity_factor;
  m.dispatcher = cfg.moe_token_dispatcher_type;
  m.force_load_balancing = cfg.moe_router_force_load_balancing;
  m.sequence_parallel = cfg.sequence_parallel;
  m.params_dtype = cfg.params_dtype;
  m.device = o.device;
  m.init_std = cfg.init_method_std;
  m.output_init_std = output_std(cfg);
  m.seed = cfg.seed;
  m.init_offset = kMoEInitBase + uint64_t(o.layer_number) * ly::moe_init_offsets(cfg.num_moe_experts);
  return std::make_unique<ly::MoELayer>(g, cfg.hidden_size, m);
}

}  // namespace

layers::AttentionConfig attention_config(const TransformerConfig& cfg) {
  return {.hidden_size = cfg.hidden_size,
          .num_attention_heads = cfg.num_attention_heads,
          .num_query_groups = cfg.num_query_groups,
          .head_dim = cfg.kv_channels,
          .add_bias_linear = cfg.add_bias_linear,
          .qk_layernorm = cfg.qk_layernorm,
          .norm_eps = cfg.norm_eps,
          .sequence_parallel = cfg.sequence_parallel,
          .params_dtype = cfg.params_dtype,
          .init_method_std = cfg.init_method_std,
          .seed = cfg.seed,
          .position_embedding = cfg.position_embedding,
          .rope_theta = cfg.rope_theta,
          .rope_scaling = cfg.rope_scaling,
          .recompute_core_attention = cfg.recompute_granularity == RecomputeGranularity::Selective};
}

Tensor add(const Tensor& a, const Tensor& b, const Stream& s) {
  MC_CHECK(a.defined() && b.defined(), "model::add: both operands must be defined");
  MC_CHECK(a.shape() == b.shape() && a.dtype() == b.dtype() && a.device() == b.device(),
           "model::add: operands differ ({} {} on {} vs {} {} on {}); pass tensors of one shape, dtype and device",
           shape_str(a.shape()), dtype_name(a.dtype()), a.device().str(), shape_str(b.shape()), dtype_name(b.dtype()),
           b.device().str());
  // ops has no plain elementwise add yet; the fused residual RMSNorm writes x + residual as a
  // by-product (rounded once to the dtype, like a native add) on every device, so we borrow it and
  // discard the normalised output. Costs one extra activation-sized write.
  const int64_t h = a.dim() == 0 ? 1 : a.size(-1);
  const Shape rows_shape{a.numel() / std::max<int64_t>(h, 1), h};
  Tensor x = a.contiguous(s).view(rows_shape), r = b.contiguous(s).view(rows_shape);
  Tensor out = Tensor::empty(rows_shape, a.dtype(), a.device(), s);
  Tensor y = Tensor::empty(rows_shape, a.dtype(), a.device(), s);
  Tensor rstd = Tensor::empty({rows_shape[0]}, DType::F32, a.device(), s);
  Tensor ones = Tensor::full({h}, 1.0, a.dtype(), a.device(), s);
  ops::rmsnorm_forward_residual(x, r, ones, y, out, rstd, 1e-5f, s);
  return out.view(a.shape());
}

TransformerLayer::TransformerLayer(comm::Communicator& tp, const TransformerConfig& cfg,
                                   const TransformerLayerOptions& options)
    : cfg_(cfg),
      opts_(options),
      input_norm_(make_norm(cfg, options.device)),
      attention_(tp, attention_config(cfg),
                 ly::SelfAttentionOptions{.device = options.device,
                                          .qkv_init_offset = layer_base(options) + 0,
                                          .proj_init_offset = layer_base(options) + 1,
                                          .proj_init_std = output_std(cfg),
                                          .cp = options.cp,
                                          .cp_comm_type = options.cp_comm_type}),
      mlp_norm_(make_norm(cfg, options.device)) {
  static_assert(2 + ly::kMLPInitOffsets <= kTransformerLayerInitStride, "a layer's draws overlap the next layer's");
  MC_CHECK(options.layer_number >= 0, "TransformerLayer: layer_number is {}; pass the 0-based index of the layer",
           options.layer_number);
  if (cfg.is_moe_layer(options.layer_number))
    moe_ = make_moe(tp, cfg, options);
  else
    mlp_ = std::make_unique<ly::MLP>(tp, cfg.hidden_size, cfg.ffn_size(), mlp_options(cfg, options));
  // The column-parallel layers' backward collectives overlap their weight-gradient GEMMs.
  attention_.linear_qkv().set_overlap_grad_comm(cfg_.tp_comm_overlap, cfg_.tp_comm_stream_priority);
  if (mlp_) mlp_->fc1().set_overlap_grad_comm(cfg_.tp_comm_overlap, cfg_.tp_comm_stream_priority);
  // The sequence-parallel forward collectives of the dense linears overlap their GEMMs in row chunks.
  const bool fwd = cfg_.tp_comm_overlap_forward && cfg_.sequence_parallel;
  attention_.linear_qkv().set_overlap_sp_forward(fwd);
  attention_.linear_proj().set_overlap_sp_forward(fwd, cfg_.tp_comm_stream_priority);
  if (mlp_) {
    mlp_->fc1().set_overlap_sp_forward(fwd);
    mlp_->fc2().set_overlap_sp_forward(fwd, cfg_.tp_comm_stream_priority);
  }
}

ly::MLP& TransformerLayer::mlp() {
  MC_CHECK(mlp_ != nullptr, "TransformerLayer {} is a MoE layer (no dense MLP); use moe()", opts_.layer_number);
  return *mlp_;
}

Tensor TransformerLayer::forward_impl(const ly::ForwardContext& ctx, const Tensor& x, const Tensor& position_ids) {
  Tensor n1 = input_norm_->forward(ctx, x);
  Tensor a = attention_.forward(ctx, n1, position_ids);
  ly::NormResidualOutput h = mlp_norm_->forward_residual(ctx, a, x);  // y = norm(x + a)
  Tensor m = moe_ ? moe_->forward(ctx, h.y) : mlp_->forward(ctx, h.y);
  return add(m, h.residual_out, ctx.stream);
}

Tensor TransformerLayer::forward(const ly::ForwardContext& ctx, const Tensor& x, const Tensor& position_ids) {
  if (cfg_.recompute_granularity != RecomputeGranularity::Full || !ctx.training) {
    has_forward_ = ctx.training;
    return forward_impl(ctx, x, position_ids);
  }
  ly::ForwardContext no_save = ctx;
  no_save.training = false;
  no_save.recompute_pass = ly::ForwardContext::RecomputePass::Discarded;
  Tensor y = forward_impl(no_save, x, position_ids);
  saved_x_ = x;
  saved_positions_ = position_ids;
  saved_cu_ = ctx.cu_seqlens, saved_max_seqlen_ = ctx.max_seqlen;
  has_forward_ = true;
  return y;
}

Tensor TransformerLayer::backward(const ly::ForwardContext& ctx, const Tensor& dy) {
  MC_CHECK(has_forward_,
           "TransformerLayer {}.backward: no saved forward; call forward with ctx.training = true before backward "
           "(each forward allows one backward)",
           opts_.layer_number);
  has_forward_ = false;
  if (cfg_.recompute_granularity == RecomputeGranularity::Full) {
    // Rerun the forward with saving on; its output is not needed, only the sub-modules' saved state. The
    // packed-row boundaries are the forward's, whatever the backward's context carries.
    ly::ForwardContext rctx = ctx;
    rctx.cu_seqlens = saved_cu_, rctx.max_seqlen = saved_max_seqlen_;
    rctx.recompute_pass = ly::ForwardContext::RecomputePass::Replay;
    forward_impl(rctx, saved_x_, saved_positions_);
    saved_x_ = Tensor();
    saved_positions_ = Tensor();
    saved_cu_ = Tensor();
  }
  Tensor dn2 = moe_ ? moe_->backward(ctx, dy) : mlp_->backward(ctx, dy);
  Tensor dh = mlp_norm_->backward_residual(ctx, dn2, dy);  // gradient of both x and the attention output
  Tensor dn1 = attention_.backward(ctx, dh);
  return add(input_norm_->backward(ctx, dn1), dh, ctx.stream);
}

void TransformerLayer::stash_activations(ly::ActivationStash& s) {
  input_norm_->stash_activations(s);
  attention_.stash_activations(s);
  mlp_norm_->stash_activations(s);
  if (moe_) moe_->stash_activations(s);
  else mlp_->stash_activations(s);
  s.put(saved_x_);
  s.put(saved_positions_);
  s.put(saved_cu_);
  s.put_int(saved_max_seqlen_);
  s.put_int(std::exchange(has_forward_, false) ? 1 : 0);
}

void TransformerLayer::restore_activations(ly::ActivationStash& s) {
  input_norm_->restore_activations(s);
  attention_.restore_activations(s);
  mlp_norm_->restore_activations(s);
  if (moe_) moe_->restore_activations(s);
  else mlp_->restore_activations(s);
  s.take(saved_x_);
  s.take(saved_positions_);
  s.take(saved_cu_);
  saved_max_seqlen_ = s.take_int();
  has_forward_ = s.take_int() != 0;
}

std::vector<std::pair<std::string, ly::Parameter*>> TransformerLayer::named_parameters() {
  // Names are built from fixed leaves, not Parameter::name, because a model overwrites that field with
  // the full path.
  std::vector<std::pair<std::string, ly::Parameter*>> out;
  // With LoRA the base weights are frozen: only the adapters are listed.
  auto norm = [&](const std::string& prefix, ly::NormLayer& n) {
    if (lora_) return;
    out.emplace_back(prefix + "weight", &n.weight());
    if (n.has_bias()) out.emplace_back(prefix + "bias", &n.bias());
  };
  auto linear = [&](const std::string& prefix, auto& l) {
    if (!l.frozen()) {
      out.emplace_back(prefix + "weight", &l.weight());
      if (l.options().bias) out.emplace_back(prefix + "bias", &l.bias());
    }
    if (ly::LoRAAdapter* a = l.lora())
      for (auto& [leaf, p] : a->named_parameters()) out.emplace_back(prefix + leaf, p);
  };
  norm("input_layernorm.", *input_norm_);
  linear("self_attention.linear_qkv.", attention_.linear_qkv());
  if (attention_.q_layernorm()) {
    norm("self_attention.q_layernorm.", *attention_.q_layernorm());
    norm("self_attention.k_layernorm.", *attention_.k_layernorm());
  }
  linear("self_attention.linear_proj.", attention_.linear_proj());
  norm("pre_mlp_layernorm.", *mlp_norm_);
  if (mlp_) {
    linear("mlp.linear_fc1.", mlp_->fc1());
    linear("mlp.linear_fc2.", mlp_->fc2());
  } else {
    // Megatron-Core's names: mlp.router, mlp.experts (grouped), mlp.shared_experts.
    if (!moe_->frozen()) {
      out.emplace_back("mlp.router.weight", &moe_->router_weight());
      out.emplace_back("mlp.experts.linear_fc1.weight", &moe_->fc1_weight());
      out.emplace_back("mlp.experts.linear_fc2.weight", &moe_->fc2_weight());
    }
    for (auto [prefix, a] : {std::pair{"mlp.experts.linear_fc1.", moe_->fc1_lora()},
                             std::pair{"mlp.experts.linear_fc2.", moe_->fc2_lora()}})
      if (a)
        for (auto& [leaf, p] : a->named_parameters()) out.emplace_back(prefix + leaf, p);
    if (ly::MLP* se = moe_->shared_expert()) {
      linear("mlp.shared_experts.linear_fc1.", se->fc1());
      linear("mlp.shared_experts.linear_fc2.", se->fc2());
    }
  }
  return out;
}

void TransformerLayer::apply_lora(comm::Communicator& tp, const LoRAConfig& lora) {
  MC_CHECK(!lora_, "TransformerLayer {}.apply_lora: adapters are already attached; merge_lora first to attach new ones",
           opts_.layer_number);
  const LoRATargets t = resolve_lora_targets(lora.target_modules, cfg_);
  const uint64_t base = kLoRAInitBase + uint64_t(opts_.layer_number) * kLoRALayerStride;
  auto options = [&](uint64_t linear) {
    return ly::LoRAOptions{.rank = lora.dim, .alpha = lora.alpha, .dropout = lora.dropout, .seed = lora.seed,
                           .init_offset = base + 4 * linear};
  };
  using K = ly::LoRAAdapter::Kind;
  const int n = tp.size();
  const int64_t h = cfg_.hidden_size, d = cfg_.head_dim(), heads = cfg_.num_attention_heads,
                groups = cfg_.query_groups(), hpg = heads / groups, ffn = cfg_.ffn_size();
  if (!t.qkv.empty()) {
    // Grouped layout: per local query group [hpg query heads ; k ; v], each head d rows.
    std::vector<ly::LoRASegment> segs;
    for (const std::string& name : t.qkv) {
      const bool q = name == "q_proj";
      const int64_t col0 = q ? 0 : (name == "k_proj" ? hpg : hpg + 1) * d;
      segs.push_back({.name = name, .out_features = (q ? heads : groups) * d, .blocks = groups / n,
                      .block_width = (hpg + 2) * d, .col0 = col0, .width = (q ? hpg : 1) * d});
    }
    auto& l = attention_.linear_qkv();
    l.attach_lora(std::make_unique<ly::LoRAAdapter>(tp, K::Column, h, segs, options(0), cfg_.params_dtype, opts_.device));
  }
  if (t.proj) {
    auto& l = attention_.linear_proj();
    l.attach_lora(std::make_unique<ly::LoRAAdapter>(
        tp, K::Row, cfg_.attention_width(),
        std::vector<ly::LoRASegment>{{.out_features = h, .block_width = h, .width = h}}, options(1),
        cfg_.params_dtype, opts_.device));
  }
  // A dense MLP, or a MoE layer's shared expert: the MLP targets on its fc1 / fc2.
  auto mlp_lora = [&](ly::MLP& m, int64_t width) {
    if (!t.fc1.empty() || t.fc1_whole) {
      std::vector<ly::LoRASegment> segs;
      const int64_t fl = width / n;
      if (t.fc1_whole) segs.push_back({.out_features = width, .block_width = fl, .width = fl});
      for (const std::string& name : t.fc1)
        segs.push_back({.name = name, .out_features = width, .block_width = 2 * fl,
                        .col0 = name == "gate_proj" ? 0 : fl, .width = fl});
      m.fc1().attach_lora(
          std::make_unique<ly::LoRAAdapter>(tp, K::Column, h, segs, options(2), cfg_.params_dtype, opts_.device));
    }
    if (t.fc2)
      m.fc2().attach_lora(std::make_unique<ly::LoRAAdapter>(
          tp, K::Row, width, std::vector<ly::LoRASegment>{{.out_features = h, .block_width = h, .width = h}},
          options(3), cfg_.params_dtype, opts_.device));
    m.fc1().set_frozen(true), m.fc2().set_frozen(true);
  };
  if (mlp_) mlp_lora(*mlp_, ffn);
  if (moe_) {
    if (ly::MLP* se = moe_->shared_expert()) mlp_lora(*se, cfg_.moe_shared_expert_size);
    // Routed experts: their own Philox range per layer (kExpertLoRAStride per global expert and linear pair).
    ly::LoRAOptions eo = options(0);
    eo.init_offset = kLoRAExpertInitBase + uint64_t(opts_.layer_number) * uint64_t(cfg_.num_moe_experts) *
                                               ly::kExpertLoRAStride;
    if (!t.fc1.empty() || t.fc1_whole || t.fc2) moe_->attach_lora(t.fc1, t.fc1_whole, t.fc2, eo);
    moe_->set_frozen(true);
  }
  attention_.linear_qkv().set_frozen(true);
  attention_.linear_proj().set_frozen(true);
  lora_ = true;
}

void TransformerLayer::merge_lora() {
  if (!lora_) return;
  auto merge = [](auto& l) {
    l.merge_lora();
    l.set_frozen(false);
  };
  merge(attention_.linear_qkv());
  merge(attention_.linear_proj());
  if (mlp_) merge(mlp_->fc1()), merge(mlp_->fc2());
  if (moe_) {
    moe_->merge_lora();
    moe_->set_frozen(false);
    if (ly::MLP* se = moe_->shared_expert()) merge(se->fc1()), merge(se->fc2());
  }
  lora_ = false;
}

std::vector<ly::Parameter*> TransformerLayer::parameters() {
  std::vector<ly::Parameter*> out;
  for (auto& [name, p] : named_parameters()) out.push_back(p);
  return out;
}

void TransformerLayer::zero_grad() {
  for (ly::Parameter* p : parameters())
    if (p->main_grad.defined()) p->main_grad.zero_();
}

}  // namespace megacore::model
