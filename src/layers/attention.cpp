#include "megacore/layers/attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include <fmt/format.h>

#include "megacore/ops/attention_merge.hpp"
#include "megacore/ops/rope.hpp"
#include "megacore/parallel/context_parallel.hpp"

namespace megacore::layers {
namespace {

constexpr std::string_view kName = "SelfAttention";

// The layer's own invariants (a whole run configuration is validated before, by train::validate).
const AttentionConfig& checked(const AttentionConfig& c, const comm::Communicator& tp) {
  MC_CHECK(c.hidden_size > 0 && c.num_attention_heads > 0 && c.num_query_groups >= 0 && c.head_dim >= 0,
           "{}: hidden_size {}, num_attention_heads {}, num_query_groups {}, head_dim {}; give positive sizes (0 derives "
           "the groups and the head dimension)",
           kName, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.head_dim);
  MC_CHECK(c.head_size() > 0 && (c.head_dim > 0 || c.hidden_size % c.num_attention_heads == 0),
           "{}: hidden_size {} is not divisible by num_attention_heads {}; set head_dim explicitly or change the heads",
           kName, c.hidden_size, c.num_attention_heads);
  const int64_t heads = c.num_attention_heads, groups = c.groups(), t = tp.size();
  MC_CHECK(heads % groups == 0,
           "{}: num_attention_heads {} is not divisible by num_query_groups {}; use a group count that divides the heads",
           kName, heads, groups);
  MC_CHECK(heads % t == 0 && groups % t == 0,
           "{}: {} heads and {} KV groups do not split over TP {}; use a TP that divides both", kName, heads, groups, t);
  MC_CHECK(!c.sequence_parallel || t > 1,
           "{}: sequence_parallel splits the sequence over the TP group but TP is 1; turn sequence_parallel off or raise TP",
           kName);
  MC_CHECK(c.position_embedding != PositionEmbeddingType::RoPE || c.rope_theta > 0,
           "{}: rope_theta is {}; set it to the RoPE base (10000 for Llama 2, 500000 for Llama 3)", kName, c.rope_theta);
  MC_CHECK(c.init_method_std > 0, "{}: init_method_std is {}; give a positive standard deviation", kName,
           c.init_method_std);
  return c;
}

double proj_std(const AttentionConfig& cfg, const SelfAttentionOptions& o) {
  return o.proj_init_std > 0 ? o.proj_init_std : cfg.init_method_std;
}

ops::RopeScaling rope_scaling_of(const RopeScaling& r) {
  ops::RopeScaling s;
  if (r.type == RopeScalingType::Llama3) s.type = ops::RopeScaling::Type::Llama3;
  s.factor = r.factor;
  s.low_freq_factor = r.low_freq_factor;
  s.high_freq_factor = r.high_freq_factor;
  s.original_max_position = double(r.original_max_position_embeddings);
  return s;
}

std::vector<int32_t> host_cu(const Tensor& cu) {
  const std::vector<double> v = cu.to_double_vector();
  return std::vector<int32_t>(v.begin(), v.end());
}

// [s, b, H, D] (sequence first) seen as the op's dense [B, S, H, D]: a strided view, no copy.
Tensor bshd(const Tensor& t) { return t.permute({1, 0, 2, 3}); }

}  // namespace

SelfAttention::SelfAttention(comm::Communicator& tp, const AttentionConfig& cfg, const SelfAttentionOptions& options)
    : tp_(tp),
      cfg_(checked(cfg, tp)),
      opts_(options),
      head_dim_(cfg.head_size()),
      heads_local_(cfg.num_attention_heads / tp.size()),
      groups_local_(cfg.groups() / tp.size()),
      recompute_(cfg.recompute_core_attention),
      qkv_(tp, cfg.hidden_size, cfg.qkv_width(),
           {.bias = cfg.add_bias_linear,
            .gather_output = false,
            .sequence_parallel = cfg.sequence_parallel,
            .params_dtype = cfg.params_dtype,
            .device = options.device,
            .init_std = cfg.init_method_std,
            .seed = cfg.seed,
            .init_offset = options.qkv_init_offset}),
      proj_(tp, cfg.attention_width(), cfg.hidden_size,
            {.bias = cfg.add_bias_linear,
             .input_is_parallel = true,
             .sequence_parallel = cfg.sequence_parallel,
             .params_dtype = cfg.params_dtype,
             .device = options.device,
             .init_std = proj_std(cfg, options),
             .seed = cfg.seed,
             .init_offset = options.proj_init_offset}) {
  MC_CHECK(opts_.qkv_init_offset != opts_.proj_init_offset,
           "{}: qkv_init_offset and proj_init_offset are both {}; give the two weights different Philox offsets "
           "or they start from correlated draws",
           kName, opts_.qkv_init_offset);
  if (cfg_.position_embedding == PositionEmbeddingType::RoPE) {
    MC_CHECK(opts_.rotary_percent > 0 && opts_.rotary_percent <= 1,
             "{}: rotary_percent is {}; it must be in (0, 1] (1 rotates the whole head)", kName, opts_.rotary_percent);
    const double rd = double(head_dim_) * opts_.rotary_percent;
    rotary_dim_ = int64_t(std::llround(rd));
    MC_CHECK(std::abs(rd - double(rotary_dim_)) < 1e-9 && rotary_dim_ >= 2 && rotary_dim_ % 2 == 0,
             "{}: head_dim {} × rotary_percent {} = {} is not an even whole number of channels; pick a "
             "rotary_percent that makes it one (e.g. {})",
             kName, head_dim_, opts_.rotary_percent, rd, double(std::max<int64_t>(2, (int64_t(rd) / 2) * 2)) / head_dim_);
    ops::RopeConfig rc{.rotary_dim = rotary_dim_, .theta = cfg_.rope_theta, .scaling = rope_scaling_of(cfg_.rope_scaling)};
    inv_freq_ = ops::rope_inv_freq(rc, opts_.device);
  }
  if (cfg_.qk_layernorm) {
    // Each TP rank normalises its own heads: the weights' gradients are partial sums over the heads, which
    // the sequence_parallel flag has summed over TP before the optimizer (with or without SP).
    const NormOptions no{.eps = cfg_.norm_eps, .sequence_parallel = tp.size() > 1, .params_dtype = cfg_.params_dtype,
                         .device = opts_.device};
    q_norm_ = std::make_unique<RMSNorm>(head_dim_, no);
    k_norm_ = std::make_unique<RMSNorm>(head_dim_, no);
  }
}

ops::AttentionOptions SelfAttention::attention_options() const {
  ops::AttentionOptions o;
  o.causal = true;
  o.backend = opts_.backend;
  o.deterministic = opts_.deterministic;
  return o;
}

ops::AttentionOptions SelfAttention::packed_options() const {
  ops::AttentionOptions o = attention_options();
  o.cu_seqlens_q = o.cu_seqlens_kv = cu_;
  o.max_seqlen_q = o.max_seqlen_kv = max_seqlen_;
  return o;
}

namespace {
// [s, b, h, d] (sequence-major) → a contiguous token-major [b·s, h, d] copy, row 0's tokens first.
Tensor token_major(const Tensor& t, const Stream& st) {
  return t.permute({1, 0, 2, 3}).contiguous(st).view({t.size(0) * t.size(1), t.size(2), t.size(3)});
}
// The inverse into dst [s, b, h, d] (any strides).
void from_token_major(Tensor dst, const Tensor& src, const Stream& st) {
  dst.permute({1, 0, 2, 3}).copy_(src.view({dst.size(1), dst.size(0), dst.size(2), dst.size(3)}), st);
}
}  // namespace

Tensor SelfAttention::core_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, const Stream& st,
                                  std::vector<Tensor>* keep) const {
  const int64_t s = q.size(0), b = q.size(1), d = head_dim_;
  if (cp_active())
    return opts_.cp_comm_type == CpCommType::AllGather ? gather_forward(q, k, v, out, st)
                                                        : ring_forward(q, k, v, out, st, keep);
  if (!cu_.defined()) {
    Tensor lse = Tensor::empty({b, heads_local_, s}, DType::F32, q.device(), st);
    Tensor out4 = bshd(out.view({s, b, heads_local_, d}));
    ops::attention_forward(bshd(q), bshd(k), bshd(v), out4, lse, attention_options(), st);
    return lse;
  }
  Tensor lse = Tensor::empty({heads_local_, b * s}, DType::F32, q.device(), st);
  Tensor op = Tensor::empty({b * s, heads_local_, d}, q.dtype(), q.device(), st);
  ops::attention_forward(token_major(q, st), token_major(k, st), token_major(v, st), op, lse, packed_options(), st);
  from_token_major(out.view({s, b, heads_local_, d}), op, st);
  return lse;
}

Tensor SelfAttention::positions_for(const Tensor& position_ids, int64_t s, int64_t b, const Stream& st) const {
  // One id per token of the [s, b] activations, in their (sequence-major) order.
  std::vector<int64_t> pos(size_t(s * b));
  if (!position_ids.defined()) {
    // Under context parallelism the local sequence is two chunks of the global one (their global positions).
    const int cr = cp_active() ? opts_.cp->rank() : 0, cn = cp_active() ? opts_.cp->size() : 1;
    for (int64_t i = 0; i < s; ++i)
      for (int64_t j = 0; j < b; ++j) pos[size_t(i * b + j)] = parallel::cp_global_position(i, s, cr, cn);
  } else {
    MC_CHECK(!cp_active() || (position_ids.dim() == 2 && position_ids.size(0) == b && position_ids.size(1) == s),
             "{}.forward: position_ids has shape {} under context parallelism (CP = {}); pass this rank's [b, s] = "
             "[{}, {}] ids (parallel::cp_slice_sequence of the full rows' ids along dimension 1), or none for "
             "0..S-1",
             kName, shape_str(position_ids.shape()), opts_.cp->size(), b, s);
    MC_CHECK(position_ids.dtype() == DType::I32 || position_ids.dtype() == DType::I64,
             "{}.forward: position_ids has dtype {}; pass integer ids (i32 or i64)", kName,
             dtype_name(position_ids.dtype()));
    const bool shared = position_ids.dim() == 1 && position_ids.size(0) == s;
    const bool per_sample = position_ids.dim() == 2 && position_ids.size(0) == b && position_ids.size(1) == s;
    MC_CHECK(shared || per_sample,
             "{}.forward: position_ids has shape {}; pass [s] = [{}] or [b, s] = [{}, {}] for the full sequence "
             "(with sequence_parallel too)",
             kName, shape_str(position_ids.shape()), s, b, s);
    // The loader's [b, s] i64 ids on the layer's device (packed rows): transposed on the device, no host trip.
    if (per_sample && position_ids.dtype() == DType::I64 && position_ids.device() == opts_.device)
      return position_ids.transpose(0, 1).contiguous(st).view({s * b});
    const std::vector<double> ids = position_ids.to_double_vector();
    for (int64_t i = 0; i < s; ++i)
      for (int64_t j = 0; j < b; ++j) pos[size_t(i * b + j)] = int64_t(ids[size_t(shared ? i : j * s + i)]);
  }
  return Tensor::from_vector(pos, {s * b}).to(opts_.device, st);
}

Tensor SelfAttention::forward(const ForwardContext& ctx, const Tensor& x, const Tensor& position_ids) {
  const Stream& st = ctx.stream;
  MC_CHECK(x.defined() && x.dim() == 3,
           "{}.forward: the input must be [s, b, hidden] (sequence first){}, got {}; transpose a [b, s, h] batch "
           "with .transpose(0, 1)",
           kName, cfg_.sequence_parallel ? " with s the local chunk under sequence_parallel" : "",
           x.defined() ? shape_str(x.shape()) : std::string("an undefined tensor"));
  Tensor qkv = qkv_.forward(ctx, x);  // [s, b, groups/TP · (hpg + 2) · d], the sequence gathered under SP
  const int64_t s = qkv.size(0), b = qkv.size(1), d = head_dim_, hpg = heads_local_ / groups_local_;
  Tensor grouped = qkv.view({s, b, groups_local_, hpg + 2, d});
  // Contiguous q, k, v: attention and RoPE want contiguous heads, and they are what backward keeps.
  Tensor q, k, v, positions;
  if (q_norm_) {
    // Split, normalise each query and key head, then rotate (the norms sit between the split and RoPE, so
    // the fused split + RoPE kernel does not apply).
    q = q_norm_->forward(ctx, grouped.narrow(3, 0, hpg).contiguous(st).view({s, b, heads_local_, d}));
    k = k_norm_->forward(ctx, grouped.select(3, hpg).contiguous(st));
    v = grouped.select(3, hpg + 1).contiguous(st);
    if (rotary_dim_ > 0) {
      positions = positions_for(position_ids, s, b, st);
      ops::rope_forward(q, positions, inv_freq_, q, opts_.rotary_interleaved, st);
      ops::rope_forward(k, positions, inv_freq_, k, opts_.rotary_interleaved, st);
    }
  } else if (rotary_dim_ > 0) {
    positions = positions_for(position_ids, s, b, st);
    q = Tensor::empty({s, b, heads_local_, d}, qkv.dtype(), qkv.device(), st);
    k = Tensor::empty({s, b, groups_local_, d}, qkv.dtype(), qkv.device(), st);
    v = Tensor::empty({s, b, groups_local_, d}, qkv.dtype(), qkv.device(), st);
    ops::qkv_split_rope(grouped, positions, inv_freq_, q, k, v, opts_.rotary_interleaved, st);
  }
  MC_CHECK(rotary_dim_ > 0 || !position_ids.defined(),
           "{}.forward: position_ids were given but this layer has no RoPE (position_embedding is learned); add "
           "the positions at the embedding instead",
           kName);
  if (rotary_dim_ == 0 && !q_norm_) {
    q = grouped.narrow(3, 0, hpg).contiguous(st).view({s, b, heads_local_, d});
    k = grouped.select(3, hpg).contiguous(st);
    v = grouped.select(3, hpg + 1).contiguous(st);
  }
  Tensor out = Tensor::empty({s, b, heads_local_ * d}, x.dtype(), x.device(), st);
  cu_ = Tensor(), max_seqlen_ = 0;
  const int64_t cpn = cp_active() ? opts_.cp->size() : 1;
  if (cp_active()) {
    MC_CHECK(!ctx.cu_seqlens.defined() || opts_.cp_comm_type == CpCommType::P2P,
             "{}.forward: packed rows (ctx.cu_seqlens) with cp_comm_type all_gather are not supported; use the p2p "
             "ring (cp_comm_type = p2p)",
             kName);
    MC_CHECK(s % 2 == 0,
             "{}.forward: the local sequence has {} tokens under context parallelism; it must be the two equal chunks "
             "of parallel::cp_slice_sequence (a global length divisible by 2·CP = {})",
             kName, s, 2 * opts_.cp->size());
  }
  if (ctx.cu_seqlens.defined()) {
    const Tensor& cu = ctx.cu_seqlens;
    MC_CHECK(cu.dtype() == DType::I32 && cu.dim() == 1 && cu.size(0) >= 2 && cu.device() == x.device(),
             "{}.forward: ctx.cu_seqlens must be i32 [segments + 1] on {} (the DataLoader's Batch.cu_seqlens), got "
             "{} {} on {}",
             kName, x.device().str(), dtype_name(cu.dtype()), shape_str(cu.shape()), cu.device().str());
    MC_CHECK(ctx.max_seqlen > 0 && ctx.max_seqlen <= s * cpn,
             "{}.forward: ctx.max_seqlen is {} but must be the longest segment, in [1, {}] (the row length); pass "
             "Batch.max_seqlen",
             kName, ctx.max_seqlen, s * cpn);
    if (cp_active()) {
      const int32_t last = host_cu(cu).back();
      MC_CHECK(last <= b * s * cpn,
               "{}.forward: ctx.cu_seqlens ends at {} but the full rows hold {} tokens; under context parallelism "
               "pass the full rows' cu_seqlens (the loader's, before parallel::cp_slice_sequence)",
               kName, last, b * s * cpn);
    }
    cu_ = cu, max_seqlen_ = ctx.max_seqlen;
  }
  // The ring's K/V blocks stay for the backward unless selective recompute reruns the ring there.
  std::vector<Tensor> blocks;
  Tensor lse = core_forward(q, k, v, out, st, ctx.training && !recompute_ ? &blocks : nullptr);
  Tensor y = proj_.forward(ctx, out);
  ring_kv_ = std::move(blocks);
  if (ctx.training) {
    q_ = q, k_ = k, v_ = v, positions_ = positions;
    seq_ = s, batch_ = b;
    // Selective recompute drops the output and LSE here; backward recomputes them from q, k, v.
    out_ = recompute_ ? Tensor() : out;
    lse_ = recompute_ ? Tensor() : lse;
  } else {
    q_ = k_ = v_ = out_ = lse_ = positions_ = cu_ = Tensor();
  }
  return y;
}

Tensor SelfAttention::backward(const ForwardContext& ctx, const Tensor& dy) {
  const Stream& st = ctx.stream;
  MC_CHECK(q_.defined(),
           "{}.backward: nothing saved; call forward with ctx.training = true before backward (each forward allows "
           "one backward)",
           kName);
  const int64_t s = seq_, b = batch_, d = head_dim_, hpg = heads_local_ / groups_local_;
  Tensor dout = proj_.backward(ctx, dy).contiguous(st);  // [s, b, heads/TP · d]
  Tensor out = out_, lse = lse_;
  if (recompute_) {
    out = Tensor::empty({s, b, heads_local_ * d}, q_.dtype(), q_.device(), st);
    lse = core_forward(q_, k_, v_, out, st, &ring_kv_);
  }
  // dQKV in the fused grouped layout; the merge (with RoPE's backward) writes q's, k's and v's gradients into it.
  Tensor dqkv = Tensor::empty({s, b, groups_local_, hpg + 2, d}, q_.dtype(), q_.device(), st);
  Tensor dq = Tensor::empty({s, b, heads_local_, d}, q_.dtype(), q_.device(), st);
  Tensor dk = Tensor::empty({s, b, groups_local_, d}, q_.dtype(), q_.device(), st);
  Tensor dv = Tensor::empty({s, b, groups_local_, d}, q_.dtype(), q_.device(), st);
  if (cp_active()) {
    if (opts_.cp_comm_type == CpCommType::AllGather) gather_backward(out, lse, dout, dq, dk, dv, st);
    else ring_backward(out, lse, dout, dq, dk, dv, ring_kv_, st);
  } else if (cu_.defined()) {
    Tensor dqp = Tensor::empty({b * s, heads_local_, d}, q_.dtype(), q_.device(), st);
    Tensor dkp = Tensor::empty({b * s, groups_local_, d}, q_.dtype(), q_.device(), st);
    Tensor dvp = Tensor::empty({b * s, groups_local_, d}, q_.dtype(), q_.device(), st);
    ops::attention_backward(token_major(q_, st), token_major(k_, st), token_major(v_, st),
                            token_major(out.view({s, b, heads_local_, d}), st), lse,
                            token_major(dout.view({s, b, heads_local_, d}), st), dqp, dkp, dvp, packed_options(), st);
    from_token_major(dq, dqp, st);
    from_token_major(dk, dkp, st);
    from_token_major(dv, dvp, st);
  } else {
    Tensor dq4 = bshd(dq), dk4 = bshd(dk), dv4 = bshd(dv);
    ops::attention_backward(bshd(q_), bshd(k_), bshd(v_), bshd(out.view({s, b, heads_local_, d})), lse,
                            bshd(dout.view({s, b, heads_local_, d})), dq4, dk4, dv4, attention_options(), st);
  }
  if (q_norm_) {
    if (rotary_dim_ > 0) {
      ops::rope_backward(dq, positions_, inv_freq_, dq, opts_.rotary_interleaved, st);
      ops::rope_backward(dk, positions_, inv_freq_, dk, opts_.rotary_interleaved, st);
    }
    dqkv.narrow(3, 0, hpg).copy_(q_norm_->backward(ctx, dq).view({s, b, groups_local_, hpg, d}), st);
    dqkv.select(3, hpg).copy_(k_norm_->backward(ctx, dk), st);
    dqkv.select(3, hpg + 1).copy_(dv, st);
  } else if (rotary_dim_ > 0) {
    ops::qkv_merge_rope_backward(dq, dk, dv, positions_, inv_freq_, dqkv, opts_.rotary_interleaved, st);
  } else {
    dqkv.narrow(3, 0, hpg).copy_(dq.view({s, b, groups_local_, hpg, d}), st);
    dqkv.select(3, hpg).copy_(dk, st);
    dqkv.select(3, hpg + 1).copy_(dv, st);
  }
  q_ = k_ = v_ = out_ = lse_ = positions_ = cu_ = Tensor();
  ring_kv_.clear();
  return qkv_.backward(ctx, dqkv.view({s, b, groups_local_ * (hpg + 2) * d}));
}

// ---- context parallelism: the ring ----------------------------------------------------------------

namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Which of this rank's queries attend to which keys of rank src's K/V block (see the header comment): its own
// block causal over everything; an earlier rank's block: all queries × its first chunk; a later rank's block:
// the late query chunk × the whole block.
struct RingBlock {
  int64_t q_off, q_len, k_len;
  bool causal;
};
RingBlock ring_block(int src, int rank, int64_t s) {
  const int64_t c = s / 2;
  if (src == rank) return {0, s, s, true};
  if (src < rank) return {0, s, c, false};
  return {c, c, s, false};
}

// One ring exchange: the pair this rank holds goes to the next CP rank while the previous rank's pair arrives
// in fresh buffers of the same shape. The exchange runs on `comm`, which first waits for everything enqueued
// on `compute` so far (the pair's producers, the buffers' allocation); finish() makes `compute` wait for it
// (call it after the work that should overlap is enqueued). With comm == compute (CPU ranks) the events
// are skipped and finish() is the Work's own stream-ordered wait.
class RingPass {
 public:
  Tensor a, b;

  RingPass() = default;
  RingPass(comm::Communicator& cp, const Tensor& x, const Tensor& y, int next, int prev, const Stream& compute,
           const Stream& comm, RingWaitLog* log = nullptr)
      : a(Tensor::empty(x.shape(), x.dtype(), x.device(), compute)),
        b(Tensor::empty(y.shape(), y.dtype(), y.device(), compute)),
        compute_(compute),
        log_(comm == compute ? nullptr : log) {
    if (!(comm == compute)) {
      Event ready;
      ready.record(compute);
      comm.wait(ready);
    }
    work_ = cp.batch_send_recv({{comm::P2POp::Send, x, next},
                                {comm::P2POp::Send, y, next},
                                {comm::P2POp::Recv, a, prev},
                                {comm::P2POp::Recv, b, prev}},
                               comm);
  }
  RingPass(RingPass&&) = default;
  RingPass& operator=(RingPass&&) = default;
  ~RingPass() {
    // Only reached pending when an exception unwinds mid-ring: do not leave the exchange running on
    // buffers about to be freed.
    if (work_) try {
        work_->wait();
      } catch (...) {
      }
  }

  bool pending() const { return work_ != nullptr; }
  // Orders `compute` after the exchange (the NCCL op's own event: later exchanges queued on `comm` are not
  // waited for).
  void finish() {
    if (!work_) return;
    comm::WorkPtr w = std::move(work_);
    if (!log_) {
      w->wait_on(compute_);
      return;
    }
    Event before(true), after(true);
    before.record(compute_);
    w->wait_on(compute_);
    after.record(compute_);
    log_->waits.emplace_back(std::move(before), std::move(after));
  }

 private:
  Stream compute_;
  RingWaitLog* log_ = nullptr;
  comm::WorkPtr work_;
};

// Packed rows under CP: ctx.cu_seqlens describes the full rows (b rows of S = CP·s tokens, token-major, no
// segment crossing a row). A ring block pairs some of this rank's local queries (local rows [q_off, q_off +
// q_len) of every batch row) with the first k_len local tokens of rank `krank`'s block. Within a row, both
// sides' global positions increase with the local index (the early chunk precedes the late one), so each
// segment's queries and keys are contiguous runs: the block is one packed attention call with, per (row,
// segment), the segment's query count and key count (cu_seqlens_q / cu_seqlens_kv; a zero on either side is
// a segment the block does not touch on that side). Tokens after the last segment count as one segment per
// row. Causal blocks (the own block) have equal query and key runs, so the top-left causal mask is exact.
struct PackedBlock {
  Tensor cu_q, cu_k;
  int64_t max_q = 1, max_k = 1;
};

PackedBlock packed_block(const std::vector<int32_t>& cu, int64_t b, int64_t s, int n, int qrank, int64_t q_off,
                         int64_t q_len, int krank, int64_t k_len, Device dev, const Stream& st) {
  const int64_t S = s * n;
  const int64_t nseg = int64_t(cu.size()) - 1;
  auto seg_of = [&](int64_t row, int64_t p) -> int64_t {
    const int64_t g = row * S + p;
    if (g >= cu.back()) return nseg + row;  // trailing tokens: a segment of their own per row
    return int64_t(std::upper_bound(cu.begin(), cu.end(), int32_t(g)) - cu.begin()) - 1;
  };
  std::vector<int32_t> cq{0}, ck{0};
  PackedBlock pb;
  for (int64_t row = 0; row < b; ++row) {
    std::vector<std::pair<int64_t, int64_t>> runs_q, runs_k;  // (segment, count), segments increasing
    auto add = [&](std::vector<std::pair<int64_t, int64_t>>& runs, int64_t seg) {
      if (runs.empty() || runs.back().first != seg) runs.emplace_back(seg, 0);
      ++runs.back().second;
    };
    for (int64_t i = q_off; i < q_off + q_len; ++i) add(runs_q, seg_of(row, parallel::cp_global_position(i, s, qrank, n)));
    for (int64_t i = 0; i < k_len; ++i) add(runs_k, seg_of(row, parallel::cp_global_position(i, s, krank, n)));
    size_t a = 0, c = 0;
    while (a < runs_q.size() || c < runs_k.size()) {
      const int64_t sq = a < runs_q.size() ? runs_q[a].first : INT64_MAX, sk = c < runs_k.size() ? runs_k[c].first : INT64_MAX;
      const int64_t seg = std::min(sq, sk);
      const int64_t nq = sq == seg ? runs_q[a++].second : 0, nk = sk == seg ? runs_k[c++].second : 0;
      cq.push_back(int32_t(cq.back() + nq));
      ck.push_back(int32_t(ck.back() + nk));
      pb.max_q = std::max(pb.max_q, nq), pb.max_k = std::max(pb.max_k, nk);
    }
  }
  pb.cu_q = Tensor::from_vector(cq, {int64_t(cq.size())}).to(dev, st);
  pb.cu_k = Tensor::from_vector(ck, {int64_t(ck.size())}).to(dev, st);
  return pb;
}

// [len, b, h, d] rows [off, off + len) of a sequence-first tensor as a token-major [b·len, h, d] copy, and back.
Tensor rows_token_major(const Tensor& t, int64_t off, int64_t len, const Stream& st) {
  return bshd(t).narrow(1, off, len).contiguous(st).view({t.size(1) * len, t.size(2), t.size(3)});
}
Tensor seq_first(const Tensor& tm, int64_t b, const Stream& st) {
  return tm.view({b, tm.size(0) / b, tm.size(1), tm.size(2)}).permute({1, 0, 2, 3}).contiguous(st);
}

// One ring over the CP group: this rank's place, the compute stream `st` and the exchange stream `cs`, and
// for packed rows (cu_full defined) the host copy of the full rows' cu_seqlens.
struct Ring {
  comm::Communicator& cp;
  int n, r, next, prev;
  Stream st, cs;
  Device dev;
  bool packed;
  std::vector<int32_t> cu;

  RingWaitLog* log;

  Ring(comm::Communicator& c, const Stream& compute, const Stream& exchange, Device d, const Tensor& cu_full,
       RingWaitLog* wait_log)
      : cp(c), n(c.size()), r(c.rank()), next((r + 1) % n), prev((r + n - 1) % n), st(compute), cs(exchange),
        dev(d), packed(cu_full.defined()), cu(packed ? host_cu(cu_full) : std::vector<int32_t>()), log(wait_log) {}

  // Starts passing (x, y) to the next rank (and receiving the previous rank's pair).
  RingPass pass(const Tensor& x, const Tensor& y) const { return RingPass(cp, x, y, next, prev, st, cs, log); }

  // Step i (b rows of s local tokens) with the K/V block (kc, vc) held now: the block goes on to the next rank
  // unless this is the last step, and the step says which rank's block it is, the rows it pairs, and the
  // attention options `o` set for it (causal for the own block; for packed rows, the block's per-segment
  // query and key counts).
  struct Step {
    RingPass kv;
    int src;
    RingBlock blk;
    ops::AttentionOptions o;
  };
  Step step(int i, ops::AttentionOptions o, int64_t b, int64_t s, const Tensor& kc, const Tensor& vc) const {
    Step out;
    if (i + 1 < n) out.kv = pass(kc, vc);
    out.src = (r - i + n) % n;
    out.blk = ring_block(out.src, r, s);
    out.o = block_options(std::move(o), out.blk, out.src, b, s);
    return out;
  }
  // `o` set for rank src's block: causal for the own block; for packed rows, the block's per-segment query
  // and key counts.
  ops::AttentionOptions block_options(ops::AttentionOptions o, const RingBlock& blk, int src, int64_t b,
                                      int64_t s) const {
    o.causal = blk.causal;
    if (packed) {
      const PackedBlock pb = packed_block(cu, b, s, n, r, blk.q_off, blk.q_len, src, blk.k_len, dev, st);
      o.cu_seqlens_q = pb.cu_q, o.cu_seqlens_kv = pb.cu_k, o.max_seqlen_q = pb.max_q, o.max_seqlen_kv = pb.max_k;
    }
    return o;
  }
};
}  // namespace

double RingWaitLog::stalled_ms() const {
  double ms = 0;
  for (const auto& [before, after] : waits) {
    after.synchronize();
    ms += double(before.elapsed_ms(after));
  }
  return ms;
}

Stream SelfAttention::ring_stream(const Stream& st) const {
  if (!opts_.device.is_cuda() || !opts_.cp_overlap) return st;
  if (cp_stream_.device() != opts_.device || cp_stream_.is_default()) cp_stream_ = Stream::create(opts_.device);
  return cp_stream_;
}

Tensor SelfAttention::ring_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                                   const Stream& given, std::vector<Tensor>* keep) const {
  // A host Stream with CUDA tensors means the legacy default stream: name it so events can be recorded.
  const Device dev = q.device();
  const Stream st = dev.is_cuda() && given.device().is_cpu() ? Stream::default_stream(dev) : given;
  const Ring ring(*opts_.cp, st, ring_stream(st), dev, cu_, opts_.cp_wait_log);
  const int64_t s = q.size(0), b = q.size(1), d = head_dim_, H = heads_local_;
  Tensor acc = Tensor::zeros({s, b, H, d}, DType::F32, dev, st);
  Tensor acc_lse = Tensor::full({b, H, s}, double(kNegInf), DType::F32, dev, st);
  Tensor kc = k, vc = v;  // contiguous [s, b, groups, d]: the block held at this step
  if (keep) keep->assign(size_t(2 * ring.n), Tensor());
  for (int i = 0; i < ring.n; ++i) {
    Ring::Step rs = ring.step(i, attention_options(), b, s, kc, vc);  // passes the block on while computing
    RingPass& kv = rs.kv;
    const RingBlock& blk = rs.blk;
    const ops::AttentionOptions& o = rs.o;
    Tensor op, lp;  // [q_len, b, H, d] and f32 [b, H, q_len]
    if (ring.packed) {
      Tensor ot = Tensor::empty({b * blk.q_len, H, d}, q.dtype(), dev, st);
      Tensor lt = Tensor::empty({H, b * blk.q_len}, DType::F32, dev, st);
      ops::attention_forward(rows_token_major(q, blk.q_off, blk.q_len, st), rows_token_major(kc, 0, blk.k_len, st),
                             rows_token_major(vc, 0, blk.k_len, st), ot, lt, o, st);
      op = seq_first(ot, b, st);
      lp = lt.view({H, b, blk.q_len}).permute({1, 0, 2}).contiguous(st);
    } else {
      op = Tensor::empty({blk.q_len, b, H, d}, q.dtype(), dev, st);
      lp = Tensor::empty({b, H, blk.q_len}, DType::F32, dev, st);
      Tensor op4 = bshd(op);
      ops::attention_forward(bshd(q.narrow(0, blk.q_off, blk.q_len)), bshd(kc.narrow(0, 0, blk.k_len)),
                             bshd(vc.narrow(0, 0, blk.k_len)), op4, lp, o, st);
    }
    ops::attention_merge_partial(acc, acc_lse, op, lp, blk.q_off, st);
    if (keep && rs.src != ring.r) (*keep)[size_t(2 * rs.src)] = kc, (*keep)[size_t(2 * rs.src + 1)] = vc;
    if (kv.pending()) {
      kv.finish();
      kc = kv.a, vc = kv.b;
    }
  }
  out.view({s, b, H, d}).copy_(acc, st);
  return acc_lse;
}

void SelfAttention::ring_backward(const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
                                  Tensor& dv, const std::vector<Tensor>& blocks, const Stream& given) const {
  const int64_t s = seq_, b = batch_, d = head_dim_, H = heads_local_, G = groups_local_;
  const Device dev = q_.device();
  const Stream st = dev.is_cuda() && given.device().is_cpu() ? Stream::default_stream(dev) : given;
  const Ring ring(*opts_.cp, st, ring_stream(st), dev, cu_, opts_.cp_wait_log);
  MC_CHECK(blocks.size() == size_t(2 * ring.n),
           "{}.backward: the ring forward's K/V blocks are missing ({} of {} tensors); run forward with ctx.training = "
           "true before backward",
           kName, blocks.size(), 2 * ring.n);
  const Tensor out4 = out.view({s, b, H, d}), dout4 = dout.view({s, b, H, d});
  Tensor dq_acc = Tensor::zeros({s, b, H, d}, DType::F32, dev, st);
  // Step i works on rank src = r − 1 − i's block (its own block last) with the accumulator of that block's dK/dV
  // (f32) that rank r − 1 passed on after step i − 1; after the own block's step it holds the block's total.
  Tensor dk_acc, dv_acc;
  RingPass grads;  // the previous step's dK/dV on their way; only this step's accumulation waits for them
  for (int i = 0; i < ring.n; ++i) {
    const int src = i + 1 < ring.n ? (ring.r - 1 - i + 2 * ring.n) % ring.n : ring.r;
    const RingBlock blk = ring_block(src, ring.r, s);
    const ops::AttentionOptions o = ring.block_options(attention_options(), blk, src, b, s);
    const Tensor& kc = src == ring.r ? k_ : blocks[size_t(2 * src)];
    const Tensor& vc = src == ring.r ? v_ : blocks[size_t(2 * src + 1)];
    // The merged output and LSE make each block's backward its exact share of the full gradient.
    Tensor dqp, dkp, dvp;  // [q_len or k_len, b, heads or groups, d]
    if (ring.packed) {
      Tensor lt = lse.narrow(2, blk.q_off, blk.q_len).permute({1, 0, 2}).contiguous(st).view({H, b * blk.q_len});
      Tensor dqt = Tensor::empty({b * blk.q_len, H, d}, q_.dtype(), dev, st);
      Tensor dkt = Tensor::empty({b * blk.k_len, G, d}, q_.dtype(), dev, st);
      Tensor dvt = Tensor::empty({b * blk.k_len, G, d}, q_.dtype(), dev, st);
      ops::attention_backward(rows_token_major(q_, blk.q_off, blk.q_len, st), rows_token_major(kc, 0, blk.k_len, st),
                              rows_token_major(vc, 0, blk.k_len, st), rows_token_major(out4, blk.q_off, blk.q_len, st),
                              lt, rows_token_major(dout4, blk.q_off, blk.q_len, st), dqt, dkt, dvt, o, st);
      dqp = seq_first(dqt, b, st), dkp = seq_first(dkt, b, st), dvp = seq_first(dvt, b, st);
    } else {
      Tensor lp = blk.q_len == s ? lse : lse.narrow(2, blk.q_off, blk.q_len).contiguous(st);
      dqp = Tensor::empty({blk.q_len, b, H, d}, q_.dtype(), dev, st);
      dkp = Tensor::empty({blk.k_len, b, G, d}, q_.dtype(), dev, st);
      dvp = Tensor::empty({blk.k_len, b, G, d}, q_.dtype(), dev, st);
      Tensor dq4 = bshd(dqp), dk4 = bshd(dkp), dv4 = bshd(dvp);
      ops::attention_backward(bshd(q_.narrow(0, blk.q_off, blk.q_len)), bshd(kc.narrow(0, 0, blk.k_len)),
                              bshd(vc.narrow(0, 0, blk.k_len)), bshd(out4.narrow(0, blk.q_off, blk.q_len)), lp,
                              bshd(dout4.narrow(0, blk.q_off, blk.q_len)), dq4, dk4, dv4, o, st);
    }
    if (grads.pending()) {
      grads.finish();
      dk_acc = grads.a, dv_acc = grads.b;
    } else {
      dk_acc = Tensor::zeros({s, b, G, d}, DType::F32, dev, st);
      dv_acc = Tensor::zeros({s, b, G, d}, DType::F32, dev, st);
    }
    Tensor dq_rows = dq_acc.narrow(0, blk.q_off, blk.q_len), dk_rows = dk_acc.narrow(0, 0, blk.k_len),
           dv_rows = dv_acc.narrow(0, 0, blk.k_len);
    ops::accumulate_f32(dq_rows, dqp, st);
    ops::accumulate_f32(dk_rows, dkp, st);
    ops::accumulate_f32(dv_rows, dvp, st);
    if (i + 1 < ring.n) grads = ring.pass(dk_acc, dv_acc);  // on to rank r + 1, which works on src next
  }
  dq.copy_(dq_acc, st);
  dk.copy_(dk_acc, st);
  dv.copy_(dv_acc, st);
}

// ---- context parallelism: all-gather ------------------------------------------------------------------

Tensor SelfAttention::gather_sequence(const Tensor& t, const Stream& st) const {
  comm::Communicator& cp = *opts_.cp;
  const int n = cp.size();
  const int64_t s = t.size(0);
  Shape shape = t.shape();
  shape[0] = n * s;
  Tensor ranks = Tensor::empty(shape, t.dtype(), t.device(), st);  // rank-major: rank i's local sequence at i·s
  Tensor in = t.contiguous(st);
  cp.all_gather(in, ranks, st)->wait_on(st);
  std::vector<Tensor> parts;
  for (int i = 0; i < n; ++i) parts.push_back(ranks.narrow(0, i * s, s));
  return parallel::cp_unslice_sequence(parts, 0, st);
}

namespace {
// Local query chunk j (0: the early one, 1: the late one) of CP rank r of n is global chunk g; it sees keys
// [0, g·c) fully and chunk g causally.
int64_t global_chunk(int j, int r, int n) { return j == 0 ? r : 2 * int64_t(n) - 1 - r; }
}  // namespace

Tensor SelfAttention::gather_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                                     const Stream& st) const {
  comm::Communicator& cp = *opts_.cp;
  const int n = cp.size(), r = cp.rank();
  const int64_t s = q.size(0), c = s / 2, b = q.size(1), d = head_dim_, H = heads_local_;
  const Device dev = q.device();
  const Tensor kg = gather_sequence(k, st), vg = gather_sequence(v, st);
  Tensor acc = Tensor::zeros({s, b, H, d}, DType::F32, dev, st);
  Tensor acc_lse = Tensor::full({b, H, s}, double(kNegInf), DType::F32, dev, st);
  for (int j = 0; j < 2; ++j) {
    const int64_t g = global_chunk(j, r, n);
    const Tensor qj = q.narrow(0, j * c, c);
    for (bool diag : {false, true}) {
      if (!diag && g == 0) continue;  // nothing before the first chunk
      const int64_t k0 = diag ? g * c : 0, kl = diag ? c : g * c;
      ops::AttentionOptions o = attention_options();
      o.causal = diag;
      Tensor op = Tensor::empty({c, b, H, d}, q.dtype(), dev, st);
      Tensor lp = Tensor::empty({b, H, c}, DType::F32, dev, st);
      Tensor op4 = bshd(op);
      ops::attention_forward(bshd(qj), bshd(kg.narrow(0, k0, kl)), bshd(vg.narrow(0, k0, kl)), op4, lp, o, st);
      ops::attention_merge_partial(acc, acc_lse, op, lp, j * c, st);
    }
  }
  out.view({s, b, H, d}).copy_(acc, st);
  return acc_lse;
}

void SelfAttention::gather_backward(const Tensor& out, const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
                                    Tensor& dv, const Stream& st) const {
  comm::Communicator& cp = *opts_.cp;
  const int n = cp.size(), r = cp.rank();
  const int64_t s = seq_, c = s / 2, b = batch_, d = head_dim_, H = heads_local_, G = groups_local_;
  const Device dev = q_.device();
  const Tensor kg = gather_sequence(k_, st), vg = gather_sequence(v_, st);
  const Tensor out4 = out.view({s, b, H, d}), dout4 = dout.view({s, b, H, d});
  Tensor dq_acc = Tensor::zeros({s, b, H, d}, DType::F32, dev, st);
  Tensor dkg = Tensor::zeros({n * s, b, G, d}, DType::F32, dev, st);
  Tensor dvg = Tensor::zeros({n * s, b, G, d}, DType::F32, dev, st);
  for (int j = 0; j < 2; ++j) {
    const int64_t g = global_chunk(j, r, n);
    const Tensor lj = lse.narrow(2, j * c, c).contiguous(st);
    for (bool diag : {false, true}) {
      if (!diag && g == 0) continue;
      const int64_t k0 = diag ? g * c : 0, kl = diag ? c : g * c;
      ops::AttentionOptions o = attention_options();
      o.causal = diag;
      Tensor dqp = Tensor::empty({c, b, H, d}, q_.dtype(), dev, st);
      Tensor dkp = Tensor::empty({kl, b, G, d}, q_.dtype(), dev, st);
      Tensor dvp = Tensor::empty({kl, b, G, d}, q_.dtype(), dev, st);
      Tensor dq4 = bshd(dqp), dk4 = bshd(dkp), dv4 = bshd(dvp);
      ops::attention_backward(bshd(q_.narrow(0, j * c, c)), bshd(kg.narrow(0, k0, kl)), bshd(vg.narrow(0, k0, kl)),
                              bshd(out4.narrow(0, j * c, c)), lj, bshd(dout4.narrow(0, j * c, c)), dq4, dk4, dv4, o,
                              st);
      Tensor dq_rows = dq_acc.narrow(0, j * c, c), dk_rows = dkg.narrow(0, k0, kl), dv_rows = dvg.narrow(0, k0, kl);
      ops::accumulate_f32(dq_rows, dqp, st);
      ops::accumulate_f32(dk_rows, dkp, st);
      ops::accumulate_f32(dv_rows, dvp, st);
    }
  }
  // Every rank holds partial dK/dV of the whole sequence: reduce-scatter each rank's chunks back to it.
  auto scatter_back = [&](const Tensor& full, Tensor& dst) {
    Tensor ranks = Tensor::empty({n * s, b, G, d}, DType::F32, dev, st);
    for (int i = 0; i < n; ++i) ranks.narrow(0, i * s, s).copy_(parallel::cp_slice_sequence(full, 0, i, n, st), st);
    Tensor mine = Tensor::empty({s, b, G, d}, DType::F32, dev, st);
    cp.reduce_scatter(ranks, mine, comm::ReduceOp::Sum, st)->wait_on(st);
    dst.copy_(mine, st);
  };
  scatter_back(dkg, dk);
  scatter_back(dvg, dv);
  dq.copy_(dq_acc, st);
}

std::vector<Parameter*> SelfAttention::parameters() {
  std::vector<Parameter*> p = qkv_.parameters();
  if (q_norm_) p.push_back(&q_norm_->weight()), p.push_back(&k_norm_->weight());
  for (Parameter* q : proj_.parameters()) p.push_back(q);
  return p;
}

void SelfAttention::zero_grad() {
  qkv_.zero_grad();
  if (q_norm_) q_norm_->zero_grad(), k_norm_->zero_grad();
  proj_.zero_grad();
}

// ---- layout conversion ------------------------------------------------------------------------------

Tensor fuse_qkv_weight(const Tensor& wq, const Tensor& wk, const Tensor& wv, int64_t heads, int64_t groups,
                       const Stream& s) {
  constexpr std::string_view op = "fuse_qkv_weight";
  MC_CHECK(heads > 0 && groups > 0 && heads % groups == 0,
           "{}: heads {} must be a positive multiple of groups {}; pass the model's num_attention_heads and "
           "num_query_groups",
           op, heads, groups);
  MC_CHECK(wq.defined() && wk.defined() && wv.defined() && wq.dim() >= 1 && wq.size(0) % heads == 0,
           "{}: wq must be [heads · head_dim, ...] with heads = {}; got {}", op, heads,
           wq.defined() ? shape_str(wq.shape()) : std::string("undefined"));
  const int64_t d = wq.size(0) / heads, hpg = heads / groups;
  Shape kv_shape = wq.shape();
  kv_shape[0] = groups * d;
  MC_CHECK(wk.shape() == kv_shape && wv.shape() == kv_shape && wk.dtype() == wq.dtype() && wv.dtype() == wq.dtype(),
           "{}: wk and wv must both be {} ({} groups × head_dim {}) of wq's dtype; got {} and {}", op,
           shape_str(kv_shape), groups, d, shape_str(wk.shape()), shape_str(wv.shape()));
  const int64_t rest = wq.numel() / wq.size(0);
  Tensor out = Tensor::empty({groups, hpg + 2, d, rest}, wq.dtype(), wq.device(), s);
  out.narrow(1, 0, hpg).copy_(wq.contiguous(s).view({groups, hpg, d, rest}), s);
  out.select(1, hpg).copy_(wk.contiguous(s).view({groups, d, rest}), s);
  out.select(1, hpg + 1).copy_(wv.contiguous(s).view({groups, d, rest}), s);
  Shape full = wq.shape();
  full[0] = (heads + 2 * groups) * d;
  return out.view(full);
}

std::vector<Tensor> split_qkv_weight(const Tensor& wqkv, int64_t heads, int64_t groups, const Stream& s) {
  constexpr std::string_view op = "split_qkv_weight";
  MC_CHECK(heads > 0 && groups > 0 && heads % groups == 0,
           "{}: heads {} must be a positive multiple of groups {}; pass the model's num_attention_heads and "
           "num_query_groups",
           op, heads, groups);
  MC_CHECK(wqkv.defined() && wqkv.dim() >= 1 && wqkv.size(0) % (heads + 2 * groups) == 0,
           "{}: wqkv must be [(heads + 2·groups) · head_dim, ...] = [({} + 2·{}) · head_dim, ...]; got {}", op, heads,
           groups, wqkv.defined() ? shape_str(wqkv.shape()) : std::string("undefined"));
  const int64_t d = wqkv.size(0) / (heads + 2 * groups), hpg = heads / groups;
  const int64_t rest = wqkv.numel() / wqkv.size(0);
  Tensor g = wqkv.contiguous(s).view({groups, hpg + 2, d, rest});
  Shape qs = wqkv.shape(), ks = wqkv.shape();
  qs[0] = heads * d;
  ks[0] = groups * d;
  return {g.narrow(1, 0, hpg).contiguous(s).view(qs), g.select(1, hpg).contiguous(s).view(ks),
          g.select(1, hpg + 1).contiguous(s).view(ks)};
}

void SelfAttention::stash_activations(ActivationStash& s) {
  qkv_.stash_activations(s);
  if (q_norm_) q_norm_->stash_activations(s), k_norm_->stash_activations(s);
  proj_.stash_activations(s);
  for (Tensor* t : {&q_, &k_, &v_, &out_, &lse_, &positions_, &cu_}) s.put(*t);
  s.put_int(int64_t(ring_kv_.size()));
  for (Tensor& t : ring_kv_) s.put(t);
  ring_kv_.clear();
  s.put_int(seq_);
  s.put_int(batch_);
  s.put_int(max_seqlen_);
}

void SelfAttention::restore_activations(ActivationStash& s) {
  qkv_.restore_activations(s);
  if (q_norm_) q_norm_->restore_activations(s), k_norm_->restore_activations(s);
  proj_.restore_activations(s);
  for (Tensor* t : {&q_, &k_, &v_, &out_, &lse_, &positions_, &cu_}) s.take(*t);
  ring_kv_.assign(size_t(s.take_int()), Tensor());
  for (Tensor& t : ring_kv_) s.take(t);
  seq_ = s.take_int();
  batch_ = s.take_int();
  max_seqlen_ = s.take_int();
}

}  // namespace megacore::layers
