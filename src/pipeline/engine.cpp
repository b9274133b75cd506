#include "megacore/pipeline/engine.hpp"

#include <cmath>

#include <chrono>
#include <map>
#include <memory>
#include <utility>

#include "megacore/core/error.hpp"
#include "megacore/core/host_sync.hpp"
#include "megacore/model/transformer_layer.hpp"
#include "megacore/ops/optimizer.hpp"
#include "megacore/pipeline/p2p.hpp"

namespace megacore::pipeline {

namespace ly = megacore::layers;

namespace {

std::string indices_str(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// Compute time of one rank: host clock on CPU, CUDA events on the compute stream otherwise.
class BusyTimer {
 public:
  explicit BusyTimer(const Stream& s) : stream_(s), cuda_(s.device().is_cuda()) {}
  void begin() {
    if (cuda_) {
      events_.emplace_back(std::make_unique<Event>(true), std::make_unique<Event>(true));
      events_.back().first->record(stream_);
    } else {
      t0_ = std::chrono::steady_clock::now();
    }
  }
  void end() {
    if (cuda_) events_.back().second->record(stream_);
    else host_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  double seconds() {  // syncs on CUDA
    double s = host_s_;
    for (auto& [a, b] : events_) {
      b->synchronize();
      s += a->elapsed_ms(*b) * 1e-3;
    }
    return s;
  }

 private:
  Stream stream_;
  bool cuda_;
  std::chrono::steady_clock::time_point t0_;
  double host_s_ = 0;
  std::vector<std::pair<std::unique_ptr<Event>, std::unique_ptr<Event>>> events_;
};

}  // namespace

PipelineEngine::PipelineEngine(comm::Communicator& pp, const PipelineLayout& layout,
                               std::vector<model::GPTModel*> chunks, const PipelineEngineOptions& options)
    : pp_(pp), layout_(layout), chunks_(std::move(chunks)), opts_(options) {
  const int rank = pp.rank();
  MC_CHECK_AS(ConfigError, layout.pipeline_parallel() == pp.size(),
              "PipelineEngine: the layout has pipeline_parallel = {} but the pipeline group '{}' has {} ranks; build "
              "the layout for the grid's PP size", layout.pipeline_parallel(), pp.name(), pp.size());
  MC_CHECK_AS(ConfigError, int(chunks_.size()) == layout.virtual_stages(),
              "PipelineEngine: {} model chunks given but the layout has virtual_stages = {}; pass one GPTModel per "
              "virtual stage of this rank", chunks_.size(), layout.virtual_stages());
  for (int c = 0; c < int(chunks_.size()); ++c) {
    model::GPTModel* m = chunks_[size_t(c)];
    MC_CHECK_AS(ConfigError, m != nullptr, "PipelineEngine: model chunk {} is null", c);
    MC_CHECK_AS(ConfigError, m->config().num_layers == layout.num_layers(),
                "PipelineEngine: chunk {} is a {}-layer model but the layout covers {} layers; build the layout "
                "from the model config's num_layers", c, m->config().num_layers, layout.num_layers());
    const std::vector<int64_t> want = layout.layer_indices(rank, c);
    MC_CHECK_AS(ConfigError, m->layer_indices() == want,
                "PipelineEngine: chunk {} of pipeline rank {} holds layers {} but the layout assigns {}; build it "
                "with GPTModelOptions::layer_indices = layout.layer_indices({}, {})", c, rank,
                indices_str(m->layer_indices()), indices_str(want), rank, c);
    MC_CHECK_AS(ConfigError, m->pre_process() == layout.has_embedding(rank, c) &&
                                 m->post_process() == layout.has_head(rank, c),
                "PipelineEngine: chunk {} of pipeline rank {} has pre_process {} / post_process {} but the layout "
                "says {} / {}; set them from layout.has_embedding / has_head", c, rank, m->pre_process(),
                m->post_process(), layout.has_embedding(rank, c), layout.has_head(rank, c));
    MC_CHECK_AS(ConfigError, m->config().hidden_size == chunks_[0]->config().hidden_size &&
                                 m->config().params_dtype == chunks_[0]->config().params_dtype &&
                                 m->config().sequence_parallel == chunks_[0]->config().sequence_parallel &&
                                 m->device() == chunks_[0]->device(),
                "PipelineEngine: chunk {} differs from chunk 0 in hidden size, dtype, sequence parallelism or "
                "device; build every chunk from one config", c);
    MC_CHECK_AS(ConfigError, !(m->tied_embedding_weight() && pp.size() > 1 && !opts_.embedding),
                "PipelineEngine: the model ties its embeddings and this rank holds a copy of the tied weight; pass "
                "PipelineEngineOptions::embedding = &grid.embedding() so the copies' gradients are summed");
  }
  p2p_ = std::make_unique<StageP2P>(pp, chunks_[0]->device());
}

PipelineEngine::~PipelineEngine() = default;

Tensor PipelineEngine::forward_only(const ly::ForwardContext& ctx, const MicroBatch& mb, double* loss_tokens) {
  MC_CHECK(!ctx.training, "PipelineEngine.forward_only: ctx.training is true; pass a context with training = false "
           "(a training forward saves activations that no backward would consume)");
  ly::ForwardContext ectx = ctx;
  ectx.cu_seqlens = mb.cu_seqlens, ectx.max_seqlen = mb.max_seqlen, ectx.position_ids = mb.position_ids;
  const int pp = pp_.size(), pp_rank = pp_.rank(), vp = int(chunks_.size());
  const Device device = chunks_[0]->device();
  Tensor x, loss;
  const int64_t b = mb.tokens.size(0), s = mb.tokens.size(1);
  for (int vs = 0; vs < pp * vp; ++vs) {
    const int owner = vs % pp, c = vs / pp, prev_owner = (vs - 1 + pp) % pp;
    if (owner != pp_rank) continue;
    model::GPTModel& ch = *chunks_[size_t(c)];
    if (vs > 0 && prev_owner != pp_rank) {
      x = Tensor::empty(ch.activation_shape(b, s), ch.config().params_dtype, device, ctx.stream);
      pp_.batch_send_recv({{comm::P2POp::Recv, x, prev_owner}}, ctx.stream)->wait();
    }
    Tensor y = ch.forward_stage(ectx, vs == 0 ? Tensor() : x, mb.tokens, mb.labels, mb.loss_mask);
    if (ch.post_process()) {
      loss = y;
      if (loss_tokens) *loss_tokens = ch.last_loss_tokens();
    } else {
      x = y.contiguous(ctx.stream);
      const int next_owner = (vs + 1) % pp;
      if (next_owner != pp_rank) pp_.batch_send_recv({{comm::P2POp::Send, x, next_owner}}, ctx.stream)->wait();
    }
  }
  return loss;
}

ScheduleConfig PipelineEngine::schedule_config(int64_t m) const {
  return make_schedule_config(layout_.pipeline_parallel(), layout_.virtual_stages(), m);
}

StepResult PipelineEngine::step(const ly::ForwardContext& ctx, const std::vector<MicroBatch>& mbs, float loss_scale) {
  MC_CHECK(loss_scale > 0 && std::isfinite(loss_scale), "PipelineEngine.step: loss_scale {} must be positive and finite",
           loss_scale);
  const auto t_start = std::chrono::steady_clock::now();
  const int64_t m = int64_t(mbs.size());
  const ScheduleConfig cfg = schedule_config(m);
  validate(cfg);  // ConfigError before any communication, the same on every rank
  const Stream& st = ctx.stream;
  const Device dev = chunks_[0]->device();

  // Shapes agreed up front: one [b, s] for every micro-batch, the same on every stage.
  MC_CHECK(m > 0 && mbs[0].labels.defined() && mbs[0].labels.dim() == 2,
           "PipelineEngine.step: micro-batch 0 has no [batch, seq] labels; every rank needs the labels of every "
           "micro-batch (the loss weighting counts their tokens)");
  const int64_t b = mbs[0].labels.size(0), s = mbs[0].labels.size(1);
  for (int64_t i = 0; i < m; ++i)
    MC_CHECK(mbs[size_t(i)].labels.defined() && mbs[size_t(i)].labels.shape() == mbs[0].labels.shape(),
             "PipelineEngine.step: micro-batch {} has labels {} but micro-batch 0 has {}; all micro-batches of a "
             "step must have one [batch, seq] shape (pad them)", i,
             mbs[size_t(i)].labels.defined() ? shape_str(mbs[size_t(i)].labels.shape()) : std::string("undefined"),
             shape_str(mbs[0].labels.shape()));
  // Shapes agreed over the pipeline when this rank's differ from the last agreed ones (the first step,
  // then only on a change; a run with fixed shapes pays this host read once).
  const std::array<int64_t, 3> shape{b, s, m};
  if (pp_.size() > 1 && shape != agreed_shape_) {
    Tensor agree = Tensor::from_vector<int64_t>({b, s, m, -b, -s, -m}, {6}).to(dev, st);
    pp_.all_reduce(agree, comm::ReduceOp::Max, st)->wait_on(st);
    const std::vector<double> a = read_to_host(agree, st, "pipeline_shape_agreement").to_double_vector();
    MC_CHECK(a[0] == -a[3] && a[1] == -a[4] && a[2] == -a[5],
             "PipelineEngine.step: the pipeline stages disagree on the step's shape (this rank: {} micro-batches of "
             "[{}, {}]); give every rank of a pipeline the same micro-batch list", m, b, s);
    agreed_shape_ = shape;
  }

  // Loss weighting: token counts (from the host when the caller gives them), all-reduced over DP.
  std::vector<double> tokens(static_cast<size_t>(m));
  double local_tokens = 0;
  bool host_counts = true;
  for (int64_t i = 0; i < m; ++i) {
    const MicroBatch& mb = mbs[size_t(i)];
    host_counts &= mb.loss_tokens >= 0;
    tokens[size_t(i)] = mb.loss_tokens >= 0 ? mb.loss_tokens : model::count_loss_tokens(mb.labels, mb.loss_mask, -100, st);
    local_tokens += tokens[size_t(i)];
  }
  const bool defer = opts_.defer_reads;
  MC_CHECK(!defer || host_counts, "PipelineEngine.step: defer_reads needs every MicroBatch::loss_tokens (the host "
           "count of its loss tokens); set them (the DataLoader's Batch::loss_tokens) or turn defer_reads off");
  double total_tokens = local_tokens;
  const int dp_size = opts_.dp ? opts_.dp->size() : 1;
  if (defer) {
    // The same constant on every rank; the caller rescales by nominal / global count after its one read.
    total_tokens = double(dp_size) * double(m) * double(b) * double(s);
  } else if (opts_.dp && dp_size > 1) {
    Tensor t = Tensor::from_vector<float>({float(local_tokens)}, {1}).to(dev, st);
    opts_.dp->all_reduce(t, comm::ReduceOp::Sum, st)->wait_on(st);
    total_tokens = read_scalar(t, st, "loss_token_count");
  }

  const Shape act = chunks_[0]->activation_shape(b, s);
  const DType act_dtype = chunks_[0]->config().params_dtype;
  const std::vector<Op> ops = rank_schedule(cfg, pp_.rank());
  // Last backward of each chunk (for before_backward's `last`).
  std::vector<int64_t> last_bwd(chunks_.size(), -1);
  for (const Op& op : ops)
    if (op.kind == OpKind::Backward) last_bwd[size_t(op.chunk)] = op.microbatch;

  StepResult r;
  r.theoretical_bubble = theoretical_bubble_fraction(cfg);
  StageP2P& p2p = *p2p_;
  p2p.begin_step(st);
  BusyTimer busy(st);
  using Key = std::pair<int64_t, int>;
  std::map<Key, Tensor> inputs, outputs, grad_outs, grad_ins;
  std::map<Key, ly::ActivationStash> stash;
  std::vector<Tensor> losses(static_cast<size_t>(m));
  auto take = [](std::map<Key, Tensor>& from, const Key& k, const Op& op) {
    auto it = from.find(k);
    MC_INTERNAL_ASSERT(it != from.end(), "PipelineEngine: at {} its tensor is missing", to_string(op));
    Tensor t = std::move(it->second);
    from.erase(it);
    return t;
  };
  int64_t in_flight = 0;

  for (const Op& op : ops) {
    if (opts_.record_ops) r.executed.push_back(op);
    const Key key{op.microbatch, op.chunk};
    model::GPTModel& chunk = *chunks_[size_t(op.chunk)];
    const MicroBatch& mb = mbs[size_t(op.microbatch)];
    switch (op.kind) {
      case OpKind::RecvForward: {
        Tensor buf = Tensor::empty(act, act_dtype, dev, st);
        p2p.recv(buf, op.peer);
        inputs[key] = buf;
        break;
      }
      case OpKind::RecvBackward: {
        Tensor buf = Tensor::empty(act, act_dtype, dev, st);
        p2p.recv(buf, op.peer);
        grad_outs[key] = buf;
        break;
      }
      case OpKind::SendForward: p2p.send(take(outputs, key, op).contiguous(st), op.peer); break;
      case OpKind::SendBackward: p2p.send(take(grad_ins, key, op).contiguous(st), op.peer); break;
      case OpKind::Forward: {
        p2p.flush();
        Tensor in = chunk.pre_process() ? Tensor() : take(inputs, key, op);
        busy.begin();
        ly::ForwardContext fctx = ctx;
        fctx.loss_tokens = tokens[size_t(op.microbatch)];  // counted above: no device read-back per micro-batch
        fctx.cu_seqlens = mb.cu_seqlens, fctx.max_seqlen = mb.max_seqlen, fctx.position_ids = mb.position_ids;
        Tensor out = chunk.forward_stage(fctx, in, mb.tokens, mb.labels, mb.loss_mask);
        stash.emplace(key, chunk.stash_activations());
        busy.end();
        if (chunk.post_process()) losses[size_t(op.microbatch)] = out;
        else outputs[key] = out;
        r.max_in_flight = std::max(r.max_in_flight, ++in_flight);
        break;
      }
      case OpKind::Backward: {
        p2p.flush();
        if (opts_.before_backward) opts_.before_backward(op.chunk, op.microbatch, op.microbatch == last_bwd[size_t(op.chunk)]);
        Tensor dy = chunk.post_process() ? Tensor() : take(grad_outs, key, op);
        auto it = stash.find(key);
        MC_INTERNAL_ASSERT(it != stash.end(), "PipelineEngine: at {} there is no stashed forward", to_string(op));
        const float scale =
            total_tokens > 0 ? float(tokens[size_t(op.microbatch)] * dp_size / total_tokens * loss_scale) : 0.f;
        busy.begin();
        chunk.restore_activations(std::move(it->second));
        stash.erase(it);
        Tensor dx = chunk.backward_stage(ctx, dy, chunk.post_process() ? scale : 1.f);
        busy.end();
        if (!chunk.pre_process()) grad_ins[key] = dx;
        --in_flight;
        break;
      }
    }
  }
  p2p.finish();

  for (model::GPTModel* c : chunks_)
    if (opts_.embedding && c->tied_embedding_weight() && !(c->pre_process() && c->post_process()))
      c->allreduce_tied_embedding_grads(*opts_.embedding, st);

  // The reported loss: Σ loss_i · tokens_i over micro-batches (last stage) and DP, / N, on every rank.
  // [Σ loss_i · tokens_i, Σ tokens_i] summed on the device, reduced over DP on the last stage and sent to
  // the other stages, all stream-ordered: nothing here waits for the device.
  const bool last = pp_.rank() == pp_.size() - 1;
  Tensor sums = Tensor::zeros({2}, DType::F32, dev, st);
  if (last) {
    Tensor acc = sums.narrow(0, 0, 1);
    for (int64_t i = 0; i < m; ++i) {
      Tensor w = Tensor::empty({1}, DType::F32, dev, st);
      ops::multi_tensor_scale({losses[size_t(i)].view({1})}, {w}, float(tokens[size_t(i)]), {}, st);
      acc.copy_(model::add(acc, w, st), st);
    }
  }
  sums.narrow(0, 1, 1).fill_(local_tokens, st);
  if (last && opts_.dp && dp_size > 1) opts_.dp->all_reduce(sums, comm::ReduceOp::Sum, st)->wait_on(st);
  if (pp_.size() > 1) pp_.broadcast(sums, pp_.size() - 1, st)->wait_on(st);
  r.device_sums = sums;
  if (defer) {
    r.nominal_tokens = total_tokens;
    if (!dev.is_cuda()) r.busy_seconds = busy.seconds();  // host clock; on GPUs it would read events back
    r.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    return r;
  }
  r.tokens = total_tokens;
  r.loss = total_tokens > 0 ? read_to_host(sums, st, "loss").to_double_vector()[0] / total_tokens : 0.0;

  r.busy_seconds = busy.seconds();
  r.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  r.idle_seconds = std::max(0.0, r.step_seconds - r.busy_seconds);
  r.idle_fraction = r.step_seconds > 0 ? r.idle_seconds / r.step_seconds : 0.0;
  return r;
}

}  // namespace megacore::pipeline
