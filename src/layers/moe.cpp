#include "megacore/layers/moe.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "megacore/layers/linear.hpp"
#include "megacore/ops/activation.hpp"
#include "megacore/ops/attention_merge.hpp"
#include "megacore/ops/gemm.hpp"
#include "megacore/ops/moe.hpp"
#include "megacore/parallel/mappings.hpp"

namespace megacore::layers {
namespace {

constexpr std::string_view kName = "MoELayer";

bool is_swiglu(const MoEOptions& o) { return o.activation == ActivationType::SwiGLU; }

ops::RouterTopkOptions router_options(const MoEOptions& o) {
  ops::RouterTopkOptions r;
  r.topk = o.topk;
  r.score = o.score == MoERouterScore::Softmax ? ops::RouterScore::Softmax : ops::RouterScore::Sigmoid;
  r.pre_softmax = o.pre_softmax;
  r.scaling_factor = o.topk_scaling_factor;
  return r;
}

// Host reads and writes go through the layer's stream: a kernel or collective on a non-blocking stream is not
// ordered with the legacy default stream.
std::vector<int64_t> to_host_i64(const Tensor& t, const Stream& s) {
  Tensor c = t.to(Device::cpu(), s).contiguous();
  return std::vector<int64_t>(c.data<int64_t>(), c.data<int64_t>() + c.numel());
}

// A host vector as a tensor on `d` (the communicators' and the layer's device).
template <class T>
Tensor on_device(const std::vector<T>& v, Device d, const Stream& s) {
  Tensor t = Tensor::from_vector(v, {int64_t(v.size())});
  return d == Device::cpu() ? t : t.to(d, s);
}

Tensor to_f32(const Tensor& t, const Stream& s) { return t.dtype() == DType::F32 ? t : t.to(DType::F32, s); }

// a (f32) + b as a tensor of `dtype`, accumulated in f32.
Tensor add_in_f32(Tensor a, const Tensor& b, DType dtype, const Stream& s) {
  if (a.dtype() != DType::F32) a = a.to(DType::F32, s);
  ops::accumulate_f32(a, b.contiguous(s), s);
  return a.dtype() == dtype ? a : a.to(dtype, s);
}

// [rows, h] padded with zero rows to `pad` rows, then all-gathered: [size · pad, h].
Tensor gather_padded(comm::Communicator& c, const Tensor& in, int64_t pad, const Stream& s) {
  Tensor p = Tensor::zeros({pad, in.size(1)}, in.dtype(), in.device(), s);
  if (in.size(0) > 0) p.narrow(0, 0, in.size(0)).copy_(in, s);
  Tensor out = Tensor::empty({c.size() * pad, in.size(1)}, in.dtype(), in.device(), s);
  c.all_gather(p, out, s)->wait_on(s);
  return out;
}

// Sum over `c` of [size · pad, h], this rank's first `rows` rows of its chunk.
Tensor reduce_scatter_trim(comm::Communicator& c, const Tensor& in, int64_t pad, int64_t rows, const Stream& s) {
  Tensor out = Tensor::empty({pad, in.size(1)}, in.dtype(), in.device(), s);
  c.reduce_scatter(in, out, comm::ReduceOp::Sum, s)->wait_on(s);
  return out.narrow(0, 0, rows).contiguous(s);
}

// y[t] = x[map[t]] (rows whose map is -1 skipped): moe_permute with one slot per row.
Tensor gather_rows(const Tensor& x, const Tensor& map, int64_t n, const Stream& s) {
  Tensor y = Tensor::empty({n, x.size(1)}, x.dtype(), x.device(), s);
  if (n > 0) ops::moe_permute(x, map, y, s);
  return y;
}

// y[t] = x[map[t]] or 0 where map[t] = -1, y has map's rows: moe_unpermute without probabilities.
Tensor scatter_rows(const Tensor& x, const Tensor& map, const Stream& s) {
  Tensor y = Tensor::empty({map.size(0), x.size(1)}, x.dtype(), x.device(), s);
  if (x.size(0) == 0) return y.zero_(s);
  ops::moe_unpermute(x, map, Tensor(), y, s);
  return y;
}

// y [rows, h] = sum over each row's slots of (probs ·) permuted[map]; zeros when nothing was kept.
Tensor combine(const Tensor& permuted, const Tensor& map, const Tensor& probs, int64_t rows, const Stream& s) {
  Tensor y = Tensor::empty({rows, permuted.size(1)}, permuted.dtype(), permuted.device(), s);
  if (permuted.size(0) == 0) return y.zero_(s);
  ops::moe_unpermute(permuted, map, probs, y, s);
  return y;
}

}  // namespace

MoEExchangePlan moe_exchange_counts(comm::Communicator& ep, const Tensor& counts, int64_t local_experts,
                                    comm::Communicator* expert_tp, const Tensor& also, const Stream& s) {
  const int p = ep.size();
  const int64_t e = counts.numel();
  MC_CHECK(local_experts > 0 && e == local_experts * p && counts.dtype() == DType::I64,
           "moe_exchange_counts: {} expert counts ({}) do not match {} local experts x EP = {}; pass one i64 count per "
           "global expert",
           e, dtype_name(counts.dtype()), local_experts, p);
  const Device dev = counts.device();
  Tensor recv = counts.contiguous(s);
  if (p > 1) {
    recv = Tensor::empty({e}, DType::I64, dev, s);
    ep.all_to_all(counts.contiguous(s), recv, {}, {}, s)->wait_on(s);
  }
  const int chunks = expert_tp ? expert_tp->size() : 1;
  Tensor layout = recv;
  if (chunks > 1) {
    layout = Tensor::empty({chunks * e}, DType::I64, dev, s);
    expert_tp->all_gather(recv, layout, s)->wait_on(s);
  }
  // One transfer to the host: [sent counts ; layout ; also].
  const int64_t n_also = also.defined() ? also.numel() : 0;
  Tensor pack = Tensor::empty({e + chunks * e + n_also}, DType::I64, dev, s);
  pack.narrow(0, 0, e).copy_(counts.contiguous(s).view({e}), s);
  pack.narrow(0, e, chunks * e).copy_(layout, s);
  if (n_also > 0) pack.narrow(0, e + chunks * e, n_also).copy_(also.contiguous(s).view({n_also}), s);
  const std::vector<int64_t> host = to_host_i64(pack, s);
  MoEExchangePlan plan;
  plan.send_counts.assign(host.begin(), host.begin() + e);
  plan.layout.assign(host.begin() + e, host.begin() + e + chunks * e);
  plan.also.assign(host.begin() + e + chunks * e, host.end());
  plan.layout_device = layout;
  const int me = chunks > 1 ? expert_tp->rank() : 0;
  plan.recv_counts.assign(plan.layout.begin() + me * e, plan.layout.begin() + (me + 1) * e);
  plan.send_rows.assign(size_t(p), 0);
  plan.recv_rows.assign(size_t(p), 0);
  for (int64_t i = 0; i < e; ++i) {
    plan.send_rows[size_t(i / local_experts)] += plan.send_counts[size_t(i)];
    plan.recv_rows[size_t(i / local_experts)] += plan.recv_counts[size_t(i)];
  }
  return plan;
}

MoEExchangePlan moe_exchange_counts(comm::Communicator& ep, const std::vector<int64_t>& counts, int64_t local_experts,
                                    const Stream& s) {
  MC_CHECK(local_experts > 0 && int64_t(counts.size()) == local_experts * ep.size(),
           "moe_exchange_counts: {} expert counts do not match {} local experts x EP = {}; pass one count per global "
           "expert",
           counts.size(), local_experts, ep.size());
  return moe_exchange_counts(ep, on_device(counts, ep.device(), s), local_experts, nullptr, Tensor(), s);
}

// Uneven all-to-all of [rows, h] tensors: `send[p]` rows go to peer p, `recv[p]` rows come from p.
Tensor moe_exchange_rows(comm::Communicator& c, const Tensor& in, const std::vector<int64_t>& send,
                         const std::vector<int64_t>& recv, const Stream& s) {
  const int64_t h = in.size(1);
  const int64_t total = std::accumulate(recv.begin(), recv.end(), int64_t{0});
  Tensor out = Tensor::empty({total, h}, in.dtype(), in.device(), s);
  if (c.size() == 1) return out.copy_(in, s);
  std::vector<int64_t> se(send.size()), re(recv.size());
  for (size_t i = 0; i < send.size(); ++i) se[i] = send[i] * h, re[i] = recv[i] * h;
  c.all_to_all(in.contiguous(s), out, se, re, s)->wait_on(s);
  return out;
}

MoELayer::MoELayer(const MoEGroups& groups, int64_t hidden_size, const MoEOptions& options)
    : g_(groups), hidden_(hidden_size), opts_(options) {
  MC_CHECK(g_.tp && g_.ep && g_.expert_tp,
           "{}: the tp, ep and expert_tp groups must be given (a group of one rank where there is no parallelism)",
           kName);
  MC_CHECK(opts_.dispatcher != MoETokenDispatcher::AllGather || g_.tp_ep,
           "{}: the all-gather dispatcher needs the expert-TP × EP group (MoEGroups::tp_ep, ProcessGrid GroupKind::TpEp)",
           kName);
  const int64_t e = opts_.num_experts, ep = g_.ep->size(), etp = g_.expert_tp->size();
  MC_CHECK(hidden_ > 0 && opts_.ffn_hidden_size > 0, "{}: hidden_size {} and ffn_hidden_size {} must be positive", kName,
           hidden_, opts_.ffn_hidden_size);
  MC_CHECK(e >= 1 && e % ep == 0,
           "{}: num_experts {} is not divisible by the EP size {}; use an expert count that is a multiple of EP", kName,
           e, ep);
  MC_CHECK(opts_.topk >= 1 && opts_.topk <= e, "{}: topk {} must be in [1, num_experts = {}]", kName, opts_.topk, e);
  MC_CHECK(opts_.ffn_hidden_size % etp == 0,
           "{}: ffn_hidden_size {} is not divisible by the expert-TP size {}; make it a multiple of {}", kName,
           opts_.ffn_hidden_size, etp, etp);
  MC_CHECK(opts_.capacity_factor >= 0, "{}: capacity_factor {} must be >= 0 (0 = dropless)", kName,
           opts_.capacity_factor);
  local_experts_ = e / ep;
  expert_offset_ = int64_t(g_.ep->rank()) * local_experts_;
  ffn_local_ = opts_.ffn_hidden_size / etp;
  const int64_t fc1_local = is_swiglu(opts_) ? 2 * ffn_local_ : ffn_local_;
  const DType dt = opts_.params_dtype;
  const Device dev = opts_.device;
  const uint64_t base = opts_.init_offset;

  router_w_.name = "router.weight";
  router_w_.data = init_full_weight(e, hidden_, opts_.init_std, opts_.seed, base, dt, dev);
  router_w_.sequence_parallel = g_.tp->size() > 1;

  // Each expert's full weights are drawn from its own Philox offsets, then this rank keeps its expert-TP
  // rows (fc1: [gate rows r ; up rows r]) or columns (fc2).
  const int64_t row0 = int64_t(g_.expert_tp->rank()) * ffn_local_;
  const double out_std = opts_.output_init_std >= 0 ? opts_.output_init_std : opts_.init_std;
  fc1_w_.data = Tensor::empty({local_experts_, fc1_local, hidden_}, dt, dev);
  fc2_w_.data = Tensor::empty({local_experts_, hidden_, ffn_local_}, dt, dev);
  for (int64_t le = 0; le < local_experts_; ++le) {
    const uint64_t off = base + 1 + 3 * uint64_t(expert_offset_ + le);
    const int64_t f = opts_.ffn_hidden_size;
    Tensor w1 = fc1_w_.data.select(0, le);
    Tensor gate = init_full_weight(f, hidden_, opts_.init_std, opts_.seed, off, dt, dev);
    w1.narrow(0, 0, ffn_local_).copy_(gate.narrow(0, row0, ffn_local_));
    if (is_swiglu(opts_)) {
      Tensor up = init_full_weight(f, hidden_, opts_.init_std, opts_.seed, off + 1, dt, dev);
      w1.narrow(0, ffn_local_, ffn_local_).copy_(up.narrow(0, row0, ffn_local_));
    }
    Tensor w2 = init_full_weight(hidden_, f, out_std, opts_.seed, off + 2, dt, dev);
    fc2_w_.data.select(0, le).copy_(w2.narrow(1, row0, ffn_local_));
  }
  fc1_w_.name = "experts.fc1.weight";
  fc1_w_.partition_dim = 1;
  fc1_w_.partition_chunks = is_swiglu(opts_) ? 2 : 1;
  fc2_w_.name = "experts.fc2.weight";
  fc2_w_.partition_dim = 2;
  for (Parameter* p : {&fc1_w_, &fc2_w_}) {
    p->expert = true;
    p->expert_offset = expert_offset_;
    p->num_experts = e;
  }
  for (Parameter* p : {&router_w_, &fc1_w_, &fc2_w_}) p->main_grad = Tensor::zeros(p->data.shape(), DType::F32, dev);

  if (opts_.enable_expert_bias) expert_bias_ = Tensor::zeros({e}, DType::F32, dev);
  if (opts_.shared_expert_size > 0) {
    MLPOptions m;
    m.activation = opts_.activation;
    m.sequence_parallel = opts_.sequence_parallel;
    m.params_dtype = dt;
    m.device = dev;
    m.init_std = opts_.init_std;
    m.output_init_std = opts_.output_init_std;
    m.seed = opts_.seed;
    m.init_offset = base + 1 + 3 * uint64_t(e);
    shared_ = std::make_unique<MLP>(*g_.tp, hidden_, opts_.shared_expert_size, m);
    for (Parameter* p : shared_->parameters()) p->name = "shared_expert." + p->name;
  }
  aux_loss_ = Tensor::zeros({1}, DType::F32, dev);
  z_loss_ = Tensor::zeros({1}, DType::F32, dev);
  bias_counts_.assign(size_t(e), 0.0);
  reset_step_stats();
}

Tensor MoELayer::to_experts(const Tensor& permuted, const Stream& s) {
  comm::Communicator& etp = *g_.expert_tp;
  Tensor recv = moe_exchange_rows(*g_.ep, permuted, send_rows_, recv_rows_, s);
  if (etp.size() > 1) recv = gather_padded(etp, recv, pad_rows_, s);
  return gather_rows(recv, sort_map_, std::accumulate(group_sizes_.begin(), group_sizes_.end(), int64_t{0}), s);
}

Tensor MoELayer::from_experts(const Tensor& sorted, const Stream& s) {
  comm::Communicator& etp = *g_.expert_tp;
  Tensor back = scatter_rows(sorted, sort_map_, s);
  if (etp.size() > 1) back = reduce_scatter_trim(etp, back, pad_rows_, recv_total_, s);
  return moe_exchange_rows(*g_.ep, back, recv_rows_, send_rows_, s);
}

Tensor MoELayer::experts_forward(const ForwardContext& ctx, const Tensor& xs, const std::vector<int64_t>& sizes) {
  const Stream& s = ctx.stream;
  const int64_t n = xs.size(0);
  const DType dt = opts_.params_dtype;
  Tensor h = Tensor::empty({n, fc1_w_.data.size(1)}, dt, xs.device(), s);
  Tensor a = Tensor::empty({n, ffn_local_}, dt, xs.device(), s);
  Tensor o = Tensor::empty({n, hidden_}, dt, xs.device(), s);
  if (n > 0) {
    ops::grouped_gemm_forward(xs, fc1_w_.data, sizes, h, s);
    if (fc1_lora_) fc1_lora_->forward(ctx, xs, sizes, h);
    if (is_swiglu(opts_))
      ops::swiglu_forward(h, a, s);
    else
      ops::activation_forward(ops::Activation::GeluTanh, h, a, s);
    ops::grouped_gemm_forward(a, fc2_w_.data, sizes, o, s);
    if (fc2_lora_) fc2_lora_->forward(ctx, a, sizes, o);
  }
  xs_ = xs, h_ = h, a_ = a;
  return o;
}

namespace {

// The input gradient of one expert linear: with an adapter its low-rank term first, then the base's dgrad
// accumulated into it per expert (beta = 1); without, the grouped dgrad.
Tensor expert_dgrad(ExpertLoRAAdapter* lora, const ForwardContext& ctx, const Tensor& x, const Tensor& dy,
                    const Tensor& w, const std::vector<int64_t>& sizes) {
  const Stream& s = ctx.stream;
  if (lora) {
    Tensor dx = lora->backward(ctx, x, sizes, dy);
    looped_gemm(dy, w, sizes, dx, /*trans_w=*/false, 1.f, 1.f, s);
    return dx;
  }
  Tensor dx = Tensor::empty(x.shape(), dy.dtype(), dy.device(), s);
  ops::grouped_gemm_dgrad(dy, w, sizes, dx, s);
  return dx;
}

}  // namespace

Tensor MoELayer::experts_backward(const ForwardContext& ctx, const Tensor& dys) {
  const Stream& s = ctx.stream;
  const int64_t n = dys.size(0);
  Tensor dxs = Tensor::empty({n, hidden_}, opts_.params_dtype, dys.device(), s);
  if (n > 0) {
    Tensor da = expert_dgrad(fc2_lora_.get(), ctx, a_, dys, fc2_w_.data, group_sizes_);
    if (!frozen_) ops::grouped_gemm_wgrad(dys, a_, group_sizes_, fc2_w_.main_grad, 1.f, s);
    Tensor dh = Tensor::empty(h_.shape(), h_.dtype(), h_.device(), s);
    if (is_swiglu(opts_))
      ops::swiglu_backward(da, h_, dh, s);
    else
      ops::activation_backward(ops::Activation::GeluTanh, da, h_, dh, s);
    dxs = expert_dgrad(fc1_lora_.get(), ctx, xs_, dh, fc1_w_.data, group_sizes_);
    if (!frozen_) ops::grouped_gemm_wgrad(dh, xs_, group_sizes_, fc1_w_.main_grad, 1.f, s);
  }
  // No rows: the adapters ran no forward either. Every expert-TP rank holds the same rows (the dispatchers
  // gather them), so their expert-TP gradient sums are skipped on all of the group together.
  xs_ = h_ = a_ = Tensor();
  return dxs;
}

Tensor MoELayer::forward(const ForwardContext& ctx, const Tensor& x) {
  const Stream& s = ctx.stream;
  MC_CHECK(x.dim() >= 2 && x.size(-1) == hidden_, "{}.forward: x must be [..., {}] (hidden_size), got {}", kName,
           hidden_, shape_str(x.shape()));
  comm::Communicator& tp = *g_.tp;
  const int tpn = tp.size();
  const int64_t e = opts_.num_experts, k = opts_.topk;
  const Device dev = x.device();
  in_shape_ = x.shape();

  Tensor xt = x.contiguous(s).view({-1, hidden_});
  // Without SP each TP rank routes its share of the tokens and the outputs are gathered. Outside training a token
  // count that does not split evenly (generation grows the sequence one token at a time) is routed whole on every
  // TP rank instead: the experts' work repeats over TP, and each token's output is what TP = 1 gives it (the
  // capacity, if any, counts all the tokens, as at TP = 1).
  const bool split = tpn > 1 && !opts_.sequence_parallel && (ctx.training || xt.size(0) % tpn == 0);
  if (split) {
    MC_CHECK(xt.size(0) % tpn == 0,
             "{}.forward: {} tokens do not split evenly over TP = {} (each TP rank routes its share); use a sequence "
             "length × micro-batch that is a multiple of {}",
             kName, xt.size(0), tpn, tpn);
    const int64_t tl = xt.size(0) / tpn;
    xt = xt.narrow(0, int64_t(tp.rank()) * tl, tl).contiguous(s);
  }
  const int64_t t = xt.size(0);

  // ---- router (f32)
  Tensor x32 = to_f32(xt, s);
  Tensor w32 = to_f32(router_w_.data, s);
  ops::GemmOptions nt;
  nt.trans_b = true;
  Tensor logits = ops::matmul(x32, w32, nt, s);  // [T, E]
  const ops::RouterTopkOptions ro = router_options(opts_);
  Tensor probs = Tensor::empty({t, k}, DType::F32, dev, s);
  Tensor topk_idx = Tensor::empty({t, k}, DType::I32, dev, s);
  if (opts_.force_load_balancing) {
    // A replay under full recompute reuses its forward's draw; this rank's tokens start at tp.rank() · t in
    // the TP group's micro-batch (both the SP chunk and the even split of the flattened tokens; 0 when routed whole).
    if (ctx.recompute_pass != ForwardContext::RecomputePass::Replay) draw_ = next_draw_++;
    Tensor random_logits = Tensor::empty({t, e}, DType::F32, dev, s);
    ops::router_random_logits(random_logits, force_seed(), (force_step_ << 24) | (draw_ & 0xFFFFFFu),
                              split || opts_.sequence_parallel ? int64_t(tp.rank()) * t : 0, s);
    ops::router_topk(random_logits, Tensor(), ro, probs, topk_idx, s);
  } else {
    ops::router_topk(logits, expert_bias_, ro, probs, topk_idx, s);
  }

  Tensor row_map = Tensor::empty({t, k}, DType::I32, dev, s);
  Tensor tpe = Tensor::empty({e}, DType::I64, dev, s);
  ops::moe_permute_map(topk_idx, int(e), row_map, tpe, s);
  Tensor kept_dev = tpe, idx = topk_idx;  // after capacity: the slots kept and their counts
  if (opts_.capacity_factor > 0) {
    const auto cap = std::max<int64_t>(1, int64_t(std::ceil(opts_.capacity_factor * double(t) * double(k) / double(e))));
    idx = topk_idx.clone(s);
    ops::router_apply_capacity(probs, idx, int(e), cap, s);
    kept_dev = Tensor::empty({e}, DType::I64, dev, s);
    ops::moe_permute_map(idx, int(e), row_map, kept_dev, s);
  }

  // ---- losses (local; see the header comment), from the device counts
  Tensor tpe_f32;
  aux_loss_ = Tensor::zeros({1}, DType::F32, dev, s);
  z_loss_ = Tensor::zeros({1}, DType::F32, dev, s);
  if (opts_.aux_loss_coeff > 0) {
    tpe_f32 = tpe.to(DType::F32, s);
    if (tpn > 1) tp.all_reduce(tpe_f32, comm::ReduceOp::Sum, s)->wait_on(s);
    ops::router_aux_loss(logits, ro.score, tpe_f32, t * tpn, int(k), opts_.aux_loss_coeff, aux_loss_, s);
  }
  if (opts_.z_loss_coeff > 0) ops::router_z_loss(logits, opts_.z_loss_coeff / float(tpn), z_loss_, s);
  if (ctx.training) {
    ops::accumulate_f32(step_loss_sum_, aux_loss_, s);
    ops::accumulate_f32(step_loss_sum_, z_loss_, s);
  }

  // ---- dispatch, experts, combine
  const bool dropping = opts_.capacity_factor > 0;
  std::vector<int64_t> kept;
  MoEExchangePlan plan;
  if (opts_.dispatcher == MoETokenDispatcher::AllToAll) {
    // Per-expert counts first (recv_counts[q·El + j] = rows of local expert j from EP rank q), gathered over
    // expert-TP, with the router's counts: the dispatcher's one host sync.
    comm::Communicator& etp = *g_.expert_tp;
    plan = moe_exchange_counts(*g_.ep, kept_dev, local_experts_, etp.size() > 1 ? &etp : nullptr,
                               dropping ? tpe : Tensor(), s);
    kept = plan.send_counts;
    tokens_per_expert_ = dropping ? plan.also : plan.send_counts;
  } else {
    tokens_per_expert_ = to_host_i64(tpe, s);
    kept = dropping ? to_host_i64(kept_dev, s) : tokens_per_expert_;
  }
  if (ctx.training) {
    for (int64_t i = 0; i < e; ++i) step_tokens_[size_t(i)] += tokens_per_expert_[size_t(i)];
    if (opts_.enable_expert_bias)
      for (int64_t i = 0; i < e; ++i) bias_counts_[size_t(i)] += double(tokens_per_expert_[size_t(i)]);
  }
  const int64_t n = std::accumulate(kept.begin(), kept.end(), int64_t{0});
  Tensor permuted = Tensor::empty({n, hidden_}, xt.dtype(), dev, s);
  if (n > 0) ops::moe_permute(xt, row_map, permuted, s);
  Tensor expert_out, y;
  if (opts_.dispatcher == MoETokenDispatcher::AllToAll) {
    const int64_t el = local_experts_;
    send_rows_ = std::move(plan.send_rows);
    recv_rows_ = std::move(plan.recv_rows);
    recv_total_ = std::accumulate(recv_rows_.begin(), recv_rows_.end(), int64_t{0});
    // With expert-TP every shard of an expert needs all of its tokens: the rows are gathered over expert-TP,
    // each rank's padded to the largest rank's count. layout holds the counts per gathered chunk.
    const std::vector<int64_t>& layout = plan.layout;
    const auto chunks = int64_t(layout.size()) / e;
    pad_rows_ = 0;
    for (int64_t c = 0; c < chunks; ++c)
      pad_rows_ = std::max(pad_rows_, std::accumulate(layout.begin() + c * e, layout.begin() + (c + 1) * e, int64_t{}));
    group_sizes_.assign(size_t(el), 0);
    for (size_t i = 0; i < layout.size(); ++i) group_sizes_[i % size_t(el)] += layout[i];
    // Received rows → sorted by local expert, built on the device from the device layout (no host copy).
    sort_map_ = Tensor::empty({chunks * pad_rows_, 1}, DType::I32, dev, s);
    ops::moe_sort_map(plan.layout_device, el, pad_rows_, sort_map_, s);
    expert_out = from_experts(experts_forward(ctx, to_experts(permuted, s), group_sizes_), s);
    y = combine(expert_out, row_map, probs, t, s);
  } else {
    comm::Communicator& c = *g_.tp_ep;
    const int p = c.size();
    Tensor gathered_x = p > 1 ? parallel::all_gather_along(c, xt, 0, s) : xt;
    gathered_probs_ = p > 1 ? parallel::all_gather_along(c, probs, 0, s) : probs;
    Tensor all_idx = p > 1 ? parallel::all_gather_along(c, idx, 0, s) : idx;
    // Keep the slots of this rank's experts (renumbered locally); the others are -1.
    Tensor hi = all_idx.to(Device::cpu(), s).contiguous();
    std::vector<int32_t> local(size_t(hi.numel()));
    for (size_t i = 0; i < local.size(); ++i) {
      const int64_t gi = hi.data<int32_t>()[i];
      local[i] = gi >= expert_offset_ && gi < expert_offset_ + local_experts_ ? int32_t(gi - expert_offset_) : -1;
    }
    Tensor local_idx = on_device(local, dev, s).view(all_idx.shape());
    local_map_ = Tensor::empty(all_idx.shape(), DType::I32, dev, s);
    Tensor lc = Tensor::empty({local_experts_}, DType::I64, dev, s);
    ops::moe_permute_map(local_idx, int(local_experts_), local_map_, lc, s);
    group_sizes_ = to_host_i64(lc, s);
    const int64_t ns = std::accumulate(group_sizes_.begin(), group_sizes_.end(), int64_t{0});
    Tensor xs = Tensor::empty({ns, hidden_}, xt.dtype(), dev, s);
    if (ns > 0) ops::moe_permute(gathered_x, local_map_, xs, s);
    expert_out = experts_forward(ctx, xs, group_sizes_);
    Tensor yfull = combine(expert_out, local_map_, gathered_probs_, gathered_x.size(0), s);
    y = p > 1 ? parallel::reduce_scatter_along_first(c, yfull, s) : yfull;
    row_map = Tensor();
  }

  if (ctx.training) {
    x_tokens_ = xt, logits_ = logits, probs_ = probs, indices_ = topk_idx, row_map_ = row_map, tpe_f32_ = tpe_f32;
    expert_out_ = expert_out;
  } else {
    xs_ = h_ = a_ = gathered_probs_ = local_map_ = sort_map_ = Tensor();
  }
  Tensor out = split ? parallel::all_gather_along(tp, y, 0, s) : y;
  if (shared_) out = add_in_f32(out, shared_->forward(ctx, x).view(out.shape()), opts_.params_dtype, s);
  return out.view(in_shape_);
}

Tensor MoELayer::backward(const ForwardContext& ctx, const Tensor& dy) {
  const Stream& s = ctx.stream;
  MC_CHECK(logits_.defined(),
           "{}.backward: no saved activations; call forward with ctx.training = true before backward (each forward "
           "allows one backward)",
           kName);
  comm::Communicator& tp = *g_.tp;
  const int tpn = tp.size();
  const bool split = tpn > 1 && !opts_.sequence_parallel;
  const int64_t t = x_tokens_.size(0), k = opts_.topk;
  const Device dev = x_tokens_.device();
  Tensor dyt = dy.contiguous(s).view({-1, hidden_});
  if (split) dyt = dyt.narrow(0, int64_t(tp.rank()) * t, t).contiguous(s);

  Tensor dprobs, dx_tokens;
  if (opts_.dispatcher == MoETokenDispatcher::AllToAll) {
    const int64_t n = expert_out_.size(0);
    Tensor dperm = Tensor::empty({n, hidden_}, opts_.params_dtype, dev, s);
    dprobs = Tensor::zeros({t, k}, DType::F32, dev, s);
    if (n > 0) ops::moe_unpermute_backward(dyt, expert_out_, row_map_, probs_, dperm, dprobs, s);
    dx_tokens = combine(from_experts(experts_backward(ctx, to_experts(dperm, s)), s), row_map_, Tensor(), t, s);
  } else {
    comm::Communicator& c = *g_.tp_ep;
    const int p = c.size();
    Tensor dyfull = p > 1 ? parallel::all_gather_along(c, dyt, 0, s) : dyt;
    const int64_t ns = expert_out_.size(0);
    Tensor dxs_in = Tensor::empty({ns, hidden_}, opts_.params_dtype, dev, s);
    Tensor dprobs_full = Tensor::zeros(gathered_probs_.shape(), DType::F32, dev, s);
    if (ns > 0) ops::moe_unpermute_backward(dyfull, expert_out_, local_map_, gathered_probs_, dxs_in, dprobs_full, s);
    Tensor dxs = experts_backward(ctx, dxs_in);
    Tensor dxfull = combine(dxs, local_map_, Tensor(), dyfull.size(0), s);
    dx_tokens = p > 1 ? parallel::reduce_scatter_along_first(c, dxfull, s) : dxfull;
    dprobs = p > 1 ? parallel::reduce_scatter_along_first(c, dprobs_full, s) : dprobs_full;
    gathered_probs_ = local_map_ = Tensor();
  }

  // ---- router: dlogits from the combine weights, the aux loss and the z-loss; then dW_r and dx.
  const ops::RouterTopkOptions ro = router_options(opts_);
  Tensor dlogits = Tensor::zeros(logits_.shape(), DType::F32, dev, s);
  // Forced routing took its top-k and weights from random scores: no gradient reaches the router through them.
  if (!opts_.force_load_balancing) ops::router_topk_backward(logits_, indices_, dprobs, ro, dlogits, s);
  if (opts_.aux_loss_coeff > 0)
    ops::router_aux_loss_backward(logits_, ro.score, tpe_f32_, t * tpn, int(k), opts_.aux_loss_coeff, aux_grad_scale_,
                                  dlogits, s);
  if (opts_.z_loss_coeff > 0)
    ops::router_z_loss_backward(logits_, opts_.z_loss_coeff / float(tpn), aux_grad_scale_, dlogits, s);
  Tensor x32 = to_f32(x_tokens_, s);
  ops::GemmOptions tn;
  tn.trans_a = true;
  tn.beta = 1.f;
  if (!frozen_) ops::gemm(dlogits, x32, router_w_.main_grad, tn, s);  // [E, h] += dlogits^T x
  dx_tokens = to_f32(dx_tokens, s);
  ops::GemmOptions nn;
  nn.beta = 1.f;
  ops::gemm(dlogits, to_f32(router_w_.data, s), dx_tokens, nn, s);  // [T, h] += dlogits W_r
  Tensor dx = dx_tokens.dtype() == opts_.params_dtype ? dx_tokens : dx_tokens.to(opts_.params_dtype, s);

  x_tokens_ = logits_ = probs_ = indices_ = row_map_ = tpe_f32_ = expert_out_ = sort_map_ = Tensor();
  if (split) dx = parallel::all_gather_along(tp, dx, 0, s);
  if (shared_) dx = add_in_f32(dx, shared_->backward(ctx, dy).view(dx.shape()), opts_.params_dtype, s);
  return dx.view(in_shape_);
}

uint64_t MoELayer::force_seed() const {
  // A key of its own per layer and replica (odd multipliers keep distinct inputs apart).
  return opts_.seed ^ (0xD1B54A32D192ED03ull * (opts_.init_offset + 1)) ^ (0x94D049BB133111EBull * (force_replica_ + 1));
}

double MoELayer::load_imbalance() const {
  if (tokens_per_expert_.empty()) return 0.0;
  const double total = double(std::accumulate(tokens_per_expert_.begin(), tokens_per_expert_.end(), int64_t{0}));
  if (total == 0) return 0.0;
  const double mx = double(*std::max_element(tokens_per_expert_.begin(), tokens_per_expert_.end()));
  return mx / (total / double(tokens_per_expert_.size()));
}

void MoELayer::reset_step_stats(const Stream& s) {
  step_loss_sum_ = Tensor::zeros({1}, DType::F32, opts_.device, s);
  step_tokens_.assign(size_t(opts_.num_experts), 0);
}

void MoELayer::update_expert_bias(comm::Communicator& dp, const Stream& s) {
  if (!opts_.enable_expert_bias) return;
  std::vector<float> c(bias_counts_.begin(), bias_counts_.end());
  for (comm::Communicator* g : {g_.tp, &dp}) {
    if (g->size() == 1) continue;
    Tensor t = on_device(c, g->device(), s);
    g->all_reduce(t, comm::ReduceOp::Sum, s)->wait_on(s);
    Tensor h = t.to(Device::cpu(), s);
    c.assign(h.data<float>(), h.data<float>() + h.numel());
  }
  const double mean = std::accumulate(c.begin(), c.end(), 0.0) / double(c.size());
  Tensor bias = expert_bias_.to(Device::cpu(), s).contiguous();
  for (size_t i = 0; i < c.size(); ++i) {
    const double d = mean - double(c[i]);
    bias.data<float>()[i] += opts_.expert_bias_update_rate * float((d > 0) - (d < 0));
  }
  expert_bias_.copy_(bias.to(expert_bias_.device(), s), s);
  std::fill(bias_counts_.begin(), bias_counts_.end(), 0.0);
}

void MoELayer::attach_lora(const std::vector<std::string>& fc1_segments, bool fc1_whole, bool fc2,
                           const LoRAOptions& options) {
  MC_CHECK(!fc1_lora_ && !fc2_lora_, "{}.attach_lora: adapters are already attached; merge_lora first", kName);
  MC_CHECK(fc1_segments.empty() || is_swiglu(opts_),
           "{}.attach_lora: gate_proj/up_proj adapters need SwiGLU experts; adapt the whole fc1 (linear_fc1)", kName);
  using K = ExpertLoRAAdapter::Kind;
  comm::Communicator& etp = *g_.expert_tp;
  const int64_t f = opts_.ffn_hidden_size, fl = ffn_local_, e = opts_.num_experts;
  std::vector<LoRASegment> segs;
  if (fc1_whole) segs.push_back({.name = {}, .out_features = f, .block_width = fl, .width = fl});
  for (const std::string& name : fc1_segments) {
    MC_CHECK(name == "gate_proj" || name == "up_proj", "{}.attach_lora: unknown fc1 segment '{}' (gate_proj, up_proj)",
             kName, name);
    segs.push_back({.name = name, .out_features = f, .block_width = 2 * fl, .col0 = name == "gate_proj" ? 0 : fl,
                    .width = fl});
  }
  const DType dt = opts_.params_dtype;
  if (!segs.empty())
    fc1_lora_ = std::make_unique<ExpertLoRAAdapter>(etp, K::Column, local_experts_, expert_offset_, e, hidden_, segs,
                                                    options, dt, opts_.device);
  if (fc2) {
    LoRAOptions o2 = options;
    o2.init_offset += 2;
    fc2_lora_ = std::make_unique<ExpertLoRAAdapter>(
        etp, K::Row, local_experts_, expert_offset_, e, f,
        std::vector<LoRASegment>{{.name = {}, .out_features = hidden_, .block_width = hidden_, .width = hidden_}}, o2, dt,
        opts_.device);
  }
}

void MoELayer::merge_lora(const Stream& s) {
  if (fc1_lora_) fc1_lora_->merge_into(fc1_w_.data, s);
  if (fc2_lora_) fc2_lora_->merge_into(fc2_w_.data, s);
  fc1_lora_.reset();
  fc2_lora_.reset();
}

void MoELayer::set_frozen(bool frozen) {
  frozen_ = frozen;
  for (Parameter* p : {&router_w_, &fc1_w_, &fc2_w_})
    p->main_grad = frozen ? Tensor() : Tensor::zeros(p->data.shape(), DType::F32, p->data.device());
}

std::vector<Parameter*> MoELayer::parameters() {
  std::vector<Parameter*> p;
  if (!frozen_) p = {&router_w_, &fc1_w_, &fc2_w_};
  for (ExpertLoRAAdapter* l : {fc1_lora_.get(), fc2_lora_.get()})
    if (l)
      for (auto& [name, q] : l->named_parameters()) p.push_back(q);
  if (shared_)
    for (Parameter* q : shared_->parameters()) p.push_back(q);
  return p;
}

void MoELayer::zero_grad() {
  for (Parameter* p : parameters())
    if (p->main_grad.defined()) p->main_grad.zero_();
  if (shared_) shared_->zero_grad();
}

void MoELayer::stash_activations(ActivationStash& st) {
  if (shared_) shared_->stash_activations(st);
  for (ExpertLoRAAdapter* l : {fc1_lora_.get(), fc2_lora_.get()})
    if (l) l->stash_activations(st);
  for (Tensor* t : {&x_tokens_, &logits_, &probs_, &indices_, &row_map_, &tpe_f32_, &expert_out_, &xs_, &h_, &a_,
                    &sort_map_, &gathered_probs_, &local_map_})
    st.put(*t);
  for (auto* v : {&send_rows_, &recv_rows_, &group_sizes_}) {
    st.put_int(int64_t(v->size()));
    for (int64_t x : *v) st.put_int(x);
    v->clear();
  }
  st.put_int(pad_rows_);
  st.put_int(recv_total_);
  st.put_int(int64_t(draw_));
  st.put_shape(in_shape_);
}

void MoELayer::restore_activations(ActivationStash& st) {
  if (shared_) shared_->restore_activations(st);
  for (ExpertLoRAAdapter* l : {fc1_lora_.get(), fc2_lora_.get()})
    if (l) l->restore_activations(st);
  for (Tensor* t : {&x_tokens_, &logits_, &probs_, &indices_, &row_map_, &tpe_f32_, &expert_out_, &xs_, &h_, &a_,
                    &sort_map_, &gathered_probs_, &local_map_})
    st.take(*t);
  for (auto* v : {&send_rows_, &recv_rows_, &group_sizes_}) {
    v->resize(size_t(st.take_int()));
    for (int64_t& x : *v) x = st.take_int();
  }
  pad_rows_ = st.take_int();
  recv_total_ = st.take_int();
  draw_ = uint64_t(st.take_int());
  in_shape_ = st.take_shape();
}

}  // namespace megacore::layers
