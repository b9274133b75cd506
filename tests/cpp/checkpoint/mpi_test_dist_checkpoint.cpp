// Distributed checkpoints under mpirun (np 2, 4, 8): save in one (TP, PP, DP) layout, load into every
// other layout that fits the world, and compare with an independent reference.
//
// Reference: every rank builds the TP = 1, PP = 1 model and overwrites each parameter with a random
// full tensor (so norms and zero-initialised biases are tested too). The source layout's shards are cut
// out of those full tensors by this file's own slicing (the rule documented on layers::Parameter:
// partition_chunks blocks, each split over TP; vocabulary padding rows beyond vocab_size), not by the
// checkpoint code. After loading, each target gathers its shards with all_gather_along and must equal
// the reference bit for bit (tolerance 0); logits and loss must match the reference's to the TP
// tolerances of mpi_test_gpt_model.cpp (1e-5 relative for logits, 1e-6 for the loss: only the order
// of additions differs).
//
// Optimizer state: a TP2 × DP model takes an AdamW step (plain AdamW, and ZeRO-1 DistributedOptimizer,
// whose every DP rank writes the shard it owns), saves, and every TP × DP target (AdamW, or ZeRO reading
// in place into its owned ranges) loads model + state: parameters and state equal the source's
// gathered tensors exactly, and the next step's loss agrees (1e-6 relative).
// Exact resume: 10 steps vs 5 + save + fresh objects + load + 5: bit-identical losses (sync and async).
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "checkpoint/shared_tmp.hpp"
#include "layers/layers_test_util.hpp"
#include "megacore/checkpoint/checkpoint_manager.hpp"
#include "megacore/checkpoint/dist_checkpoint.hpp"
#include "megacore/core/peer_error.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/optim/distributed_data_parallel.hpp"
#include "megacore/optim/distributed_optimizer.hpp"
#include "megacore/optim/optimizer.hpp"
#include "megacore/parallel/mappings.hpp"
#include "megacore/parallel/process_grid.hpp"
#include "megacore/pipeline/layout.hpp"

using namespace megacore;
using namespace megacore::parallel;
using namespace layers_test;
namespace ck = megacore::checkpoint;
namespace ly = megacore::layers;
namespace mdl = megacore::model;
namespace fs = std::filesystem;

namespace {

constexpr double kLossTol = 1e-6, kLogitsTol = 1e-5;
constexpr int64_t kBatch = 2, kSeq = 8;

struct Batch {
  Tensor tokens, labels;
};

Batch make_batch(int64_t vocab, int salt) {
  std::vector<int64_t> tok, lab;
  for (int64_t i = 0; i < kBatch * kSeq; ++i) {
    tok.push_back((i * 37 + 5 + salt * 11) % vocab);
    lab.push_back((i * 53 + 11 + salt * 7) % vocab);
  }
  return {Tensor::from_vector<int64_t>(tok, {kBatch, kSeq}), Tensor::from_vector<int64_t>(lab, {kBatch, kSeq})};
}

mdl::TransformerConfig four_layers(mdl::TransformerConfig c, uint64_t seed) {
  c.num_layers = 4;  // PP up to 4
  c.seed = seed;
  return c;
}

// A directory every rank sees: rank 0 creates it, the name is broadcast.
using ckpt_test::SharedTmp;

bool is_vocab(const ly::Parameter& p) { return p.name == "embedding.weight" || p.name == "output_layer.weight"; }

// This rank's shard of `full` for parameter `p` (the documented layout), zero padding rows included.
Tensor local_from_full(const Tensor& full, const ly::Parameter& p, int tp_rank, int tp_size) {
  if (p.partition_dim < 0) return full.clone();
  const int64_t d = p.partition_dim, c = p.partition_chunks, L = p.data.size(d), b = L / c;
  Tensor out = Tensor::zeros(p.data.shape(), full.dtype());
  for (int64_t j = 0; j < c; ++j)
    for (int64_t i = 0; i < b; ++i) {
      const int64_t g = j * b * tp_size + tp_rank * b + i;
      if (g < full.size(d)) out.narrow(d, j * b + i, 1).copy_(full.narrow(d, g, 1));
    }
  return out;
}

// The full (unpadded, [gate; up]) tensor of a parameter or of a tensor shaped like it, gathered over TP.
Tensor gather_full(comm::Communicator& tp, const ly::Parameter& p, const Tensor& local, int64_t vocab) {
  if (p.partition_dim < 0) return local.contiguous().clone();
  Tensor g = all_gather_along(tp, local.contiguous(), p.partition_dim);  // rank blocks in rank order
  const int64_t d = p.partition_dim, c = p.partition_chunks, b = local.size(d) / c, T = tp.size();
  if (c > 1) {
    Tensor out = Tensor::empty(g.shape(), g.dtype());
    for (int q = 0; q < T; ++q)
      for (int64_t j = 0; j < c; ++j) out.narrow(d, j * b * T + q * b, b).copy_(g.narrow(d, q * c * b + j * b, b));
    g = out;
  }
  if (is_vocab(p)) g = g.narrow(0, 0, vocab).contiguous();
  return g;
}

// The reference: the TP1/PP1 model with every parameter replaced by a random full tensor.
struct Reference {
  std::unique_ptr<mdl::GPTModel> model;
  std::map<std::string, Tensor> full;  // unpadded
};

Reference make_reference(comm::Communicator& tp1, const mdl::TransformerConfig& cfg) {
  Reference r;
  r.model = std::make_unique<mdl::GPTModel>(cfg, tp1);
  uint64_t k = 1000;
  for (ly::Parameter* p : r.model->parameters()) {
    Tensor t = randn(p->data.shape(), k++, 99);
    if (is_vocab(*p)) t.narrow(0, cfg.vocab_size, t.size(0) - cfg.vocab_size).zero_();  // padding stays 0
    p->data.copy_(t);
    r.full[p->name] = is_vocab(*p) ? t.narrow(0, 0, cfg.vocab_size).contiguous() : t;
  }
  return r;
}

struct Stage {
  std::unique_ptr<ProcessGrid> grid;
  std::unique_ptr<mdl::GPTModel> model;
};

Stage build(comm::Communicator& world, const mdl::TransformerConfig& cfg, int tp, int pp) {
  Stage s;
  s.grid = std::make_unique<ProcessGrid>(world, ParallelConfig{.tensor = tp, .pipeline = pp},
                                         std::vector<GroupKind>{GroupKind::Tp, GroupKind::Pp, GroupKind::Dp});
  const auto layout = pipeline::PipelineLayout::uniform(cfg.num_layers, pp);
  mdl::GPTModelOptions o;
  const int r = s.grid->pp_rank();
  o.layer_indices = layout.layer_indices(r, 0);
  o.pre_process = layout.has_embedding(r, 0);
  o.post_process = layout.has_head(r, 0);
  s.model = std::make_unique<mdl::GPTModel>(cfg, s.grid->tp(), o);
  return s;
}

// Forward through the pipeline by hand (send/recv between stages); loss and vocab-gathered logits on the
// last stage, {NaN, {}} elsewhere.
std::pair<double, Tensor> pp_forward(Stage& s, const Batch& batch, int64_t vocab) {
  ly::ForwardContext ctx;
  comm::Communicator& pp = s.grid->pp();
  const int r = pp.rank(), n = pp.size();
  Tensor in;
  if (r > 0) {
    in = Tensor::empty(s.model->activation_shape(kBatch, kSeq));
    pp.batch_send_recv({comm::P2POp{comm::P2POp::Recv, in, r - 1}})->wait();
  }
  Tensor out = s.model->forward_stage(ctx, in, batch.tokens, batch.labels);
  if (r < n - 1) {
    pp.batch_send_recv({comm::P2POp{comm::P2POp::Send, out.contiguous(), r + 1}})->wait();
    return {std::nan(""), Tensor()};
  }
  Tensor logits = all_gather_along(s.grid->tp(), s.model->logits().contiguous(), -1);
  return {out.item(), logits.narrow(-1, 0, vocab).contiguous()};
}

std::vector<std::pair<int, int>> layouts_for(int world) {
  std::vector<std::pair<int, int>> out;
  for (int tp : {1, 2, 4})
    for (int pp : {1, 2, 4})
      if (world % (tp * pp) == 0) out.push_back({tp, pp});
  return out;
}

}  // namespace

TEST_CASE("a checkpoint saved with TP2 x PP2 (x DP) loads into every TP x PP x DP layout", "[checkpoint][mpi]") {
  auto world = world_comm();
  SharedTmp tmp(*world);
  ProcessGrid grid1(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  const int src_pp = world->size() % 4 == 0 ? 2 : 1;
  for (const mdl::TransformerConfig& base : {mdl::presets::tiny_llama(), mdl::presets::tiny_gpt2()}) {
    const mdl::TransformerConfig cfg = four_layers(base, 11);
    INFO("config " << mdl::norm_type_name(cfg.normalization) << " tied " << cfg.tie_word_embeddings);
    Reference ref = make_reference(grid1.tp(), cfg);
    const Batch batch = make_batch(cfg.vocab_size, 0);
    ly::ForwardContext ctx;
    const double ref_loss = ref.model->forward(ctx, batch.tokens, batch.labels).item();
    const Tensor ref_logits = ref.model->logits().narrow(-1, 0, cfg.vocab_size).contiguous();

    const std::string root = tmp.path + "/" + std::string(mdl::norm_type_name(cfg.normalization));
    {
      Stage src = build(*world, cfg, 2, src_pp);
      for (ly::Parameter* p : src.model->parameters())
        p->data.copy_(local_from_full(ref.full.at(p->name), *p, src.grid->tp_rank(), 2));
      ck::CheckpointState st;
      st.step = 3;
      st.tensors = ck::shard_model(*src.model, ck::shard_layout(*src.grid));
      st.json["config"] = R"({"layers":4})";
      ck::save_checkpoint(*world, root, st);
    }
    for (auto [tp, pp] : layouts_for(world->size())) {
      INFO("target TP " << tp << " PP " << pp << " DP " << world->size() / (tp * pp));
      Stage dst = build(*world, four_layers(base, 22), tp, pp);  // another seed: loading must overwrite all
      std::vector<ck::ShardedTensor> targets = ck::shard_model(*dst.model, ck::shard_layout(*dst.grid));
      ck::CheckpointReader reader = ck::load_checkpoint(world.get(), root, targets);
      REQUIRE(reader.step() == 3);
      REQUIRE(reader.json("config") == R"({"layers":4})");
      for (ly::Parameter* p : dst.model->parameters()) {
        INFO("parameter " << p->name);
        require_equal(gather_full(dst.grid->tp(), *p, p->data, cfg.vocab_size), ref.full.at(p->name), p->name.c_str());
      }
      auto [loss, logits] = pp_forward(dst, batch, cfg.vocab_size);
      if (dst.grid->is_last_stage()) {
        CHECK(std::abs(loss - ref_loss) <= kLossTol * std::abs(ref_loss));
        require_close(logits, ref_logits, kLogitsTol, "logits");
      }
    }
  }
}

namespace {

struct Trainer {
  Stage s;
  std::unique_ptr<optim::AdamW> adamw;
  std::unique_ptr<optim::DistributedDataParallel> ddp;
  std::unique_ptr<optim::DistributedOptimizer> zero;

  Trainer(comm::Communicator& world, const mdl::TransformerConfig& cfg, int tp, bool use_zero) {
    s = build(world, cfg, tp, 1);
    if (use_zero) {
      optim::DDPConfig dc;
      dc.use_distributed_optimizer = true;
      dc.overlap_grad_reduce = false;
      ddp = std::make_unique<optim::DistributedDataParallel>(s.model->parameters(), s.grid->dp(), dc);
      zero = std::make_unique<optim::DistributedOptimizer>(*ddp);
    } else {
      adamw = std::make_unique<optim::AdamW>(s.model->parameters());
    }
  }
  // One step on `batch` (the same batch on every DP rank); returns the loss before the update.
  double step(const Batch& batch) {
    ly::ForwardContext ctx;
    const double loss = s.model->forward(ctx, batch.tokens, batch.labels).item();
    s.model->backward(ctx);
    if (zero) {
      ddp->finish_grad_sync();
      zero->step(1e-2f);
      zero->zero_grad();
    } else {
      adamw->step(1e-2f);  // DP replicas see the same batch, so their gradients are already equal
      adamw->zero_grad();
    }
    return loss;
  }
  // The full TP-local state: AdamW's, or ZeRO's gathered over DP (the test's reference; the checkpoint
  // itself is written and read per rank through shard_zero_state).
  std::vector<optim::NamedTensor> opt_state() const { return zero ? zero->gathered_state() : adamw->state(); }
  std::vector<ck::ShardedTensor> opt_tensors(const std::vector<ck::ShardedTensor>& params) const {
    if (zero) return ck::shard_zero_state(*zero, params, ck::shard_layout(*s.grid));
    return ck::shard_optimizer_state(adamw->state(), params);
  }
  void save(comm::Communicator& world, const std::string& root, int64_t step) {
    ck::CheckpointState st;
    st.step = step;
    st.tensors = ck::shard_model(*s.model, ck::shard_layout(*s.grid));
    auto params = st.tensors;
    for (auto& t : opt_tensors(params)) st.tensors.push_back(t);
    st.json["optimizer"] = fmt::format(R"({{"step":{}}})", zero ? zero->step_count() : adamw->step_count());
    ck::save_checkpoint(world, root, st);
  }
  void load(comm::Communicator& world, const std::string& root) {
    auto params = ck::shard_model(*s.model, ck::shard_layout(*s.grid));
    auto targets = params;
    std::vector<optim::NamedTensor> state;
    if (zero) {
      for (auto& t : ck::shard_zero_state(*zero, params, ck::shard_layout(*s.grid))) targets.push_back(t);
    } else {
      state = adamw->state();
      for (auto& nt : state) nt.tensor = nt.tensor.clone();
      for (auto& t : ck::shard_optimizer_state(state, params)) targets.push_back(t);
    }
    ck::CheckpointReader r = ck::load_checkpoint(&world, root, targets);
    const std::string js = r.json("optimizer");
    const int64_t step = std::stoll(js.substr(js.find(':') + 1));
    if (zero)
      zero->finish_load(step);  // the state was read in place into the owned ranges
    else
      adamw->load_state(state, step);
  }
};

}  // namespace

TEST_CASE("model + optimizer state saved at TP2 x DP (AdamW and ZeRO-1) load into every TP x DP layout",
          "[checkpoint][mpi]") {
  auto world = world_comm();
  SharedTmp tmp(*world);
  const mdl::TransformerConfig cfg = four_layers(mdl::presets::tiny_llama(), 5);
  for (bool src_zero : {false, true}) {
    INFO("source ZeRO " << src_zero);
    const std::string root = tmp.path + (src_zero ? "/zero" : "/adamw");
    Trainer src(*world, cfg, 2, src_zero);
    src.step(make_batch(cfg.vocab_size, 1));
    src.save(*world, root, 1);
    if (src_zero && src.s.grid->dp().size() > 1) {
      // ZeRO: the optimizer state was written by every DP rank (its own shard), not gathered to one.
      std::ifstream f(root + "/step_1/metadata.json");
      const nlohmann::json meta = nlohmann::json::parse(f);
      std::set<std::string> files;
      for (const auto& [name, t] : meta.at("tensors").items())
        if (name.rfind("optimizer.", 0) == 0)
          for (const auto& s : t.at("shards")) files.insert(s.at("file").get<std::string>());
      CHECK(int(files.size()) == world->size());  // TP2 × DP: every rank holds a distinct part
    }
    // The source's own full tensors, gathered independently of the checkpoint code.
    std::map<std::string, Tensor> want;
    for (ly::Parameter* p : src.s.model->parameters())
      want[p->name] = gather_full(src.s.grid->tp(), *p, p->data, cfg.vocab_size);
    const std::vector<optim::NamedTensor> src_state = src.opt_state();
    for (const auto& nt : src_state) {
      const ly::Parameter& p = src.s.model->parameter(nt.name.substr(0, nt.name.rfind('.')));
      want[nt.name] = gather_full(src.s.grid->tp(), p, nt.tensor, cfg.vocab_size);
    }
    const Batch next = make_batch(cfg.vocab_size, 2), after = make_batch(cfg.vocab_size, 3);
    src.step(next);
    const double src_after = src.step(after);

    for (int tp : tp_sizes_for(world->size()))
      for (bool dst_zero : {false, true}) {
        INFO("target TP " << tp << " DP " << world->size() / tp << " ZeRO " << dst_zero);
        Trainer dst(*world, four_layers(mdl::presets::tiny_llama(), 77), tp, dst_zero);
        dst.load(*world, root);
        for (ly::Parameter* p : dst.s.model->parameters())
          require_equal(gather_full(dst.s.grid->tp(), *p, p->data, cfg.vocab_size), want.at(p->name), p->name.c_str());
        for (const auto& nt : dst.opt_state()) {
          const ly::Parameter& p = dst.s.model->parameter(nt.name.substr(0, nt.name.rfind('.')));
          require_equal(gather_full(dst.s.grid->tp(), p, nt.tensor, cfg.vocab_size), want.at(nt.name), nt.name.c_str());
        }
        REQUIRE((dst_zero ? dst.zero->step_count() : dst.adamw->step_count()) == 1);
        dst.step(next);
        const double loss = dst.step(after);  // the loss after the first step taken from the checkpoint
        CHECK(std::abs(loss - src_after) <= kLossTol * std::abs(src_after));
      }
  }
}

TEST_CASE("a damaged shard fails the load on the rank that reads it and is a PeerIOError naming it on the others",
          "[checkpoint][mpi]") {
  auto world = world_comm();
  SharedTmp tmp(*world);
  const int n = world->size(), me = world->rank();
  // "x" [n, 8]: rank r writes and reads row r only (its own shard file).
  auto sharded = [&](Tensor local) {
    ck::ShardedTensor t;
    t.name = "x";
    t.global_shape = {n, 8};
    t.local = local;
    t.pieces.push_back({{0, 0}, {me, 0}, {1, 8}, Tensor()});
    return t;
  };
  ck::CheckpointState st;
  st.step = 3;
  st.tensors.push_back(sharded(Tensor::full({1, 8}, float(me))));
  const std::string dir = ck::save_checkpoint(*world, tmp.path, st);
  const int bad = n - 1;
  if (me == 0) {  // one byte of the last rank's shard flipped: its CRC check fails
    const std::string shard = fmt::format("{}/shard_{:05d}.safetensors", dir, bad);
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-4, std::ios::end);
    char c = 0;
    f.get(c);
    f.seekp(-4, std::ios::end);
    f.put(char(c ^ 1));
  }
  world->barrier();
  std::vector<ck::ShardedTensor> targets{sharded(Tensor::zeros({1, 8}))};
  try {
    (void)ck::load_checkpoint(world.get(), dir, targets);
    FAIL("the load went through on rank " << me);
  } catch (const PeerIOError& e) {
    CHECK(me != bad);
    CHECK(e.failed_rank() == bad);
    CHECK(std::string(e.what()) ==
          fmt::format("checkpoint load: rank {} failed (its own error message says why)", bad));
  } catch (const IOError& e) {
    CHECK(me == bad);
    CHECK(std::string(e.what()).find("CRC") != std::string::npos);
  }
  // Every rank is past the agreement: the communicator still works.
  world->barrier();
}

TEST_CASE("exact resume: 10 steps equal 5 steps, save, fresh objects, load, 5 steps (bit for bit)", "[checkpoint][mpi]") {
  auto world = world_comm();
  SharedTmp tmp(*world);
  const int tp = world->size() % 2 == 0 ? 2 : 1;
  const mdl::TransformerConfig cfg = four_layers(mdl::presets::tiny_llama(), 9);
  for (bool use_zero : {false, true})
    for (bool async : {false, true}) {
      INFO("ZeRO " << use_zero << " async " << async);
      std::vector<double> straight;
      {
        Trainer t(*world, cfg, tp, use_zero);
        for (int i = 0; i < 10; ++i) straight.push_back(t.step(make_batch(cfg.vocab_size, 10 + i)));
      }
      const std::string root = tmp.path + "/resume_" + std::to_string(use_zero) + std::to_string(async);
      {
        Trainer t(*world, cfg, tp, use_zero);
        for (int i = 0; i < 5; ++i) REQUIRE(t.step(make_batch(cfg.vocab_size, 10 + i)) == straight[size_t(i)]);
        ck::CheckpointPolicy pol;
        pol.async = async;
        ck::CheckpointManager mgr(*world, root, pol);
        ck::CheckpointState st;
        st.step = 5;
        st.tensors = ck::shard_model(*t.s.model, ck::shard_layout(*t.s.grid));
        auto params = st.tensors;
        for (auto& x : t.opt_tensors(params)) st.tensors.push_back(x);
        st.json["optimizer"] = fmt::format(R"({{"step":{}}})", 5);
        mgr.save(st);
        if (async) t.step(make_batch(cfg.vocab_size, 999));  // keeps training while the writer runs
        mgr.wait();
      }
      Trainer t(*world, four_layers(mdl::presets::tiny_llama(), 1234), tp, use_zero);  // other init
      t.load(*world, root);
      for (int i = 5; i < 10; ++i) {
        INFO("step " << i);
        REQUIRE(t.step(make_batch(cfg.vocab_size, 10 + i)) == straight[size_t(i)]);
      }
    }
}
