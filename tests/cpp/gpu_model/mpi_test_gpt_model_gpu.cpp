// GPTModel on GPUs under mpirun -np 2/4 (one GPU per rank, NCCL tensor or context parallelism), against the
// f32 CPU model at TP = CP = 1 built on the same rank from the same seed:
//   mpirun -np 4 build/tests/megacore_mpi_tests "[gpu][model]"
// Without a GPU every case returns early with a warning (on every rank alike).
//
// The GPU attention kernels take bf16 or f16 (an f32 model on a GPU is refused at its first forward with
// that message), so the GPU models run in bf16 and f16. Their weights are the CPU model's rounded to 16 bits
// and every activation is stored in 16 bits, so the comparison is against the f32 CPU model built from the
// same seed: loss within 1% and logits within 3% relative (||a − b|| / ||b||), every gradient within 10% —
// the tolerances of a 16-bit forward and backward, stated before the numbers were seen; the measured
// values are printed for the record.
#include <cmath>

#include "layers/layers_test_util.hpp"
#include "model/model_test_util.hpp"
#include "megacore/comm/bootstrap.hpp"
#include "megacore/comm/nccl_communicator.hpp"
#include "megacore/core/host_sync.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/parallel/context_parallel.hpp"
#include "megacore/parallel/mappings.hpp"
#include "megacore/parallel/process_grid.hpp"

using namespace megacore;
using namespace megacore::parallel;
using namespace layers_test;
namespace ly = megacore::layers;
namespace mdl = megacore::model;

namespace {

constexpr int64_t kBatch = 2, kSeq = 16;

using model_test::Batch;

Batch make_batch(int64_t vocab) { return model_test::token_batch(kBatch, kSeq, vocab, 0, /*ignored=*/6); }

// NCCL takes one GPU per rank (a single-host launch): with fewer GPUs than ranks a case says so and returns.
bool one_gpu_per_rank(const comm::Communicator& world) {
  if (cuda_device_count() >= world.size()) return true;
  WARN(world.size() << " ranks need " << world.size() << " GPUs, " << cuda_device_count() << " visible: test skipped");
  return false;
}

Device my_device() {
  comm::LaunchEnv e = comm::detect_launch_env();
  return Device::cuda(e.local_rank % cuda_device_count());
}

// A sub-communicator of NCCL ranks: the NCCL world (id over MPI), then split into groups of `tp`
// consecutive ranks (the TP groups of the default tp-first order).
std::unique_ptr<comm::Communicator> nccl_tp(comm::Communicator& mpi, int tp) {
  comm::CommOptions o;
  o.timeout = std::chrono::seconds(120);
  o.name = "world";
  auto world = comm::make_nccl_communicator_over(mpi, my_device(), o);
  if (tp == mpi.size()) return world;
  o.name = "tp";
  return world->split(mpi.rank() / tp, mpi.rank() % tp, o);
}

// A host f32 copy of this rank's shard, gathered over the MPI TP group (the NCCL group's twin) along dim.
Tensor gather_host(comm::Communicator& mpi_tp, const Tensor& shard, int64_t dim) {
  return all_gather_along(mpi_tp, shard.to(Device::cpu()).to(DType::F32).contiguous(), dim);
}

// A parameter's gradient as the full tensor: replicated ones (partition_dim −1) are taken as they are.
Tensor full_grad_host(comm::Communicator& mpi_tp, const ly::Parameter& p) {
  if (p.partition_dim < 0) return p.main_grad.to(Device::cpu()).contiguous();
  return gather_host(mpi_tp, p.main_grad, p.partition_dim);
}

double rel(const Tensor& got, const Tensor& want) {
  REQUIRE(got.shape() == want.shape());
  return mctest::rel_err(got.to_double_vector(), want.to_double_vector());
}

// Every parameter gradient of `model` (got(p): its full gradient, f32 on the host) against the f32 CPU reference's
// main_grad (SwiGLU's fc1 rows in the layout of tpn ranks), the padded vocabulary rows dropped: each within 1e-1
// relative. Returns the worst.
template <class Got>
double check_gradients(mdl::GPTModel& ref, mdl::GPTModel& model, const mdl::TransformerConfig& cfg, int tpn,
                       Got got_of) {
  double worst = 0;
  REQUIRE(model.parameters().size() == ref.parameters().size());
  for (size_t i = 0; i < ref.parameters().size(); ++i) {
    const ly::Parameter& pr = *ref.parameters()[i];
    const ly::Parameter& p = *model.parameters()[i];
    INFO("parameter " << p.name);
    REQUIRE(p.name == pr.name);
    Tensor got = got_of(p);
    Tensor want = pr.main_grad.contiguous();
    if (p.name.find("linear_fc1.weight") != std::string::npos && cfg.activation == mdl::ActivationType::SwiGLU)
      want = swiglu_rank_layout(want, tpn);
    if (got.dim() == 2 && got.size(0) == model.padded_vocab_size()) {
      got = got.narrow(0, 0, cfg.vocab_size).contiguous();
      want = want.narrow(0, 0, cfg.vocab_size).contiguous();
    }
    const double e = rel(got, want);
    worst = std::max(worst, e);
    CHECK(e <= 1e-1);
  }
  return worst;
}

void compare(comm::Communicator& mpi_tp1, comm::Communicator& mpi_tp, comm::Communicator& gpu_tp,
             mdl::TransformerConfig cfg, bool sp, DType dtype) {
  const int tpn = gpu_tp.size();
  INFO("TP " << tpn << " SP " << sp << " overlap " << cfg.tp_comm_overlap << " forward overlap "
             << cfg.tp_comm_overlap_forward << " dtype " << dtype_name(dtype) << " norm "
             << mdl::norm_type_name(cfg.normalization) << " tied " << cfg.tie_word_embeddings << " qk_layernorm "
             << cfg.qk_layernorm);
  const Batch batch = make_batch(cfg.vocab_size);
  ly::ForwardContext cpu_ctx;

  mdl::TransformerConfig ref_cfg = cfg;
  ref_cfg.tp_comm_overlap_forward = false;  // an SP-only option
  mdl::GPTModel ref(ref_cfg, mpi_tp1);
  const double ref_loss = ref.forward(cpu_ctx, batch.tokens, batch.labels, batch.mask).item();
  const Tensor ref_logits = ref.logits().contiguous().narrow(-1, 0, cfg.vocab_size).contiguous();
  ref.backward(cpu_ctx);

  const Device dev = my_device();
  ly::ForwardContext ctx;
  ctx.stream = Stream::create(dev);
  cfg.sequence_parallel = sp;
  cfg.params_dtype = dtype;
  mdl::GPTModelOptions mo;
  mo.device = dev;
  mdl::GPTModel model(cfg, gpu_tp, mo);
  const double loss = model.forward(ctx, batch.tokens.to(dev, ctx.stream), batch.labels.to(dev, ctx.stream),
                                    batch.mask.to(dev, ctx.stream)).to(Device::cpu(), ctx.stream).item();
  model.backward(ctx);
  ctx.stream.synchronize();
  Tensor logits = gather_host(mpi_tp, model.logits().contiguous(ctx.stream), -1);
  logits = logits.narrow(-1, 0, cfg.vocab_size).contiguous();
  const double loss_err = std::abs(loss - ref_loss) / std::abs(ref_loss), logits_err = rel(logits, ref_logits);
  if (mpi_tp.rank() == 0 && mpi_tp1.rank() == 0)
    std::printf("[gpu model] TP %d SP %d fwd-overlap %d %s %s%s: loss %.6f (cpu %.6f, rel %.2e) logits rel %.2e\n", tpn,
                int(sp), int(cfg.tp_comm_overlap_forward), std::string(dtype_name(dtype)).c_str(),
                cfg.tie_word_embeddings ? "tied" : "untied", cfg.qk_layernorm ? " qk_layernorm" : "", loss, ref_loss,
                loss_err, logits_err);
    CHECK(loss_err <= 1e-2);
  CHECK(logits_err <= 3e-2);
  const double worst =
      check_gradients(ref, model, cfg, tpn, [&](const ly::Parameter& p) { return full_grad_host(mpi_tp, p); });
  if (mpi_tp.rank() == 0 && mpi_tp1.rank() == 0) std::printf("[gpu model]   worst gradient rel %.2e\n", worst);
}


// The model both TP-overlap cases run: tiny Llama widened to 512 (8 heads of 64, FFN 1024), SP, bf16.
mdl::TransformerConfig overlap_test_config() {
  mdl::TransformerConfig cfg = mdl::presets::tiny_llama();
  cfg.hidden_size = 512;
  cfg.num_attention_heads = 8;
  cfg.kv_channels = 64;
  cfg.ffn_hidden_size = 1024;
  cfg.sequence_parallel = true;
  cfg.params_dtype = DType::BF16;
  return cfg;
}

// Every rank in one NCCL CP group beside NCCL TP groups of one rank (the CP tests' layout); cp stays empty where
// a rank has no GPU of its own or there is a single rank (the case then returns: nothing to compare).
struct CpOfEveryRank {
  std::unique_ptr<comm::Communicator> world, cp, tp;
};
CpOfEveryRank cp_of_every_rank() {
  CpOfEveryRank g;
  g.world = world_comm();
  if (!one_gpu_per_rank(*g.world) || g.world->size() < 2) return g;
  g.cp = nccl_tp(*g.world, g.world->size());
  g.tp = nccl_tp(*g.world, 1);
  return g;
}

}  // namespace

TEST_CASE("GPTModel on GPUs with NCCL TP (±SP, bf16 and f16) equals the CPU TP = 1 model", "[gpu][model][mpi]") {
  MC_REQUIRE_GPU();
  auto world = world_comm();
  if (!one_gpu_per_rank(*world)) return;
  ProcessGrid grid1(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  for (int tpn : tp_sizes_for(world->size())) {
    if (tpn == 1) continue;
    ProcessGrid grid(*world, ParallelConfig{.tensor = tpn}, {GroupKind::Tp});
    auto gpu_tp = nccl_tp(*world, tpn);
    REQUIRE(gpu_tp->size() == tpn);
    // The tiny presets have head_dim 8; the GPU kernels need 64 or 128, so the heads are widened.
    auto gpu_sized = [](mdl::TransformerConfig c) {
      c.hidden_size = 512;
      c.num_attention_heads = 8;
      c.kv_channels = 64;
      c.ffn_hidden_size = 1024;
      return c;
    };
    mdl::TransformerConfig llama = gpu_sized(mdl::presets::tiny_llama()), tied = llama, qwen3 = llama;
    tied.tie_word_embeddings = true;
    qwen3.qk_layernorm = true;  // per-head q/k RMSNorm before RoPE (Qwen3)
    for (mdl::TransformerConfig cfg : {llama, tied, gpu_sized(mdl::presets::tiny_gpt2()), qwen3})
      for (bool overlap : {false, true}) {  // TP collective overlapped with the weight-gradient GEMM (side stream)
        cfg.tp_comm_overlap = overlap;
        for (bool sp : {false, true})
          for (bool fwd : {false, true}) {  // with SP: the forward all-gathers / reduce-scatters as rings
            if (fwd && !sp) continue;
            cfg.tp_comm_overlap_forward = fwd;
            for (DType dt : {DType::BF16, DType::F16}) compare(grid1.tp(), grid.tp(), *gpu_tp, cfg, sp, dt);
          }
        cfg.tp_comm_overlap_forward = false;
      }
  }
}

TEST_CASE("tp_comm_overlap on GPUs, with a high-priority communication stream, changes no number",
          "[gpu][model][mpi]") {
  // Two micro-batches per model, so the second backward reuses blocks the first one freed after its
  // overlapped collectives (Allocator::release_stream_use). Exact equality between two GPU runs holds
  // because kSeq = 16 is a single key block: the attention backward's atomic dQ sum has one term.
  MC_REQUIRE_GPU();
  auto world = world_comm();
  if (!one_gpu_per_rank(*world)) return;
  for (int tpn : tp_sizes_for(world->size())) {
    if (tpn == 1) continue;
    auto gpu_tp = nccl_tp(*world, tpn);
    const mdl::TransformerConfig cfg = overlap_test_config();
    const Batch batch = make_batch(cfg.vocab_size);
    const Device dev = my_device();
    struct Run {
      std::vector<double> losses;
      std::vector<Tensor> grads;
    };
    auto run = [&](bool overlap) {
      mdl::TransformerConfig c = cfg;
      c.tp_comm_overlap = overlap;
      c.tp_comm_stream_priority = overlap ? -5 : 0;
      ly::ForwardContext ctx;
      ctx.stream = Stream::create(dev);
      mdl::GPTModelOptions mo;
      mo.device = dev;
      mdl::GPTModel model(c, *gpu_tp, mo);
      Run r;
      for (int mb = 0; mb < 2; ++mb) {
        r.losses.push_back(model.forward(ctx, batch.tokens.to(dev, ctx.stream), batch.labels.to(dev, ctx.stream),
                                         batch.mask.to(dev, ctx.stream)).to(Device::cpu(), ctx.stream).item());
        model.backward(ctx);
      }
      ctx.stream.synchronize();
      for (ly::Parameter* p : model.parameters()) r.grads.push_back(p->main_grad.to(Device::cpu(), ctx.stream));
      ctx.stream.synchronize();
      return r;
    };
    const Run off = run(false), on = run(true);
    INFO("TP " << tpn);
    REQUIRE(on.losses == off.losses);
    REQUIRE(on.grads.size() == off.grads.size());
    for (size_t i = 0; i < off.grads.size(); ++i) require_equal(on.grads[i], off.grads[i], "main_grad (tp_comm_overlap)");
  }
}

TEST_CASE("tp_comm_overlap_forward on GPUs: the ring forward against the serial one, no extra host sync",
          "[gpu][model][mpi]") {
  // The ring's GEMMs run on row slices (cuBLASLt may pick another kernel for m rows than for TP·m) and the
  // reduce-scatter side adds partials in ring order, so the comparison is within bf16 round-off: loss 1e-3,
  // logits 1e-2 and every gradient 3e-2 relative to the serial forward (the values and whether they are
  // bit-identical are printed). Two micro-batches per model, a high-priority communication stream.
  MC_REQUIRE_GPU();
  auto world = world_comm();
  if (!one_gpu_per_rank(*world)) return;
  for (int tpn : tp_sizes_for(world->size())) {
    if (tpn == 1) continue;
    auto gpu_tp = nccl_tp(*world, tpn);
    const mdl::TransformerConfig cfg = overlap_test_config();
    const Batch batch = make_batch(cfg.vocab_size);
    const Device dev = my_device();
    struct Run {
      std::vector<double> losses;
      Tensor logits;
      std::vector<Tensor> grads;
      int64_t host_syncs = 0;
    };
    auto run = [&](bool fwd) {
      mdl::TransformerConfig c = cfg;
      c.tp_comm_overlap_forward = fwd;
      c.tp_comm_stream_priority = fwd ? -5 : 0;
      ly::ForwardContext ctx;
      ctx.stream = Stream::create(dev);
      mdl::GPTModelOptions mo;
      mo.device = dev;
      mdl::GPTModel model(c, *gpu_tp, mo);
      Run r;
      const Tensor tokens = batch.tokens.to(dev, ctx.stream), labels = batch.labels.to(dev, ctx.stream),
                   mask = batch.mask.to(dev, ctx.stream);
      for (int mb = 0; mb < 2; ++mb) {
        reset_host_syncs();
        Tensor loss = model.forward(ctx, tokens, labels, mask);
        model.backward(ctx);
        r.host_syncs += host_sync_count();
        r.losses.push_back(loss.to(Device::cpu(), ctx.stream).item());
      }
      ctx.stream.synchronize();
      r.logits = model.logits().contiguous(ctx.stream).to(Device::cpu(), ctx.stream).to(DType::F32);
      for (ly::Parameter* p : model.parameters()) r.grads.push_back(p->main_grad.to(Device::cpu(), ctx.stream));
      ctx.stream.synchronize();
      return r;
    };
    const Run off = run(false), on = run(true);
    INFO("TP " << tpn);
    CHECK(on.host_syncs == off.host_syncs);
    REQUIRE(on.grads.size() == off.grads.size());
    bool same = on.losses == off.losses && on.logits.to_double_vector() == off.logits.to_double_vector();
    double worst = 0;
    for (size_t i = 0; i < off.grads.size(); ++i) {
      const double e = rel(on.grads[i], off.grads[i]);
      same = same && e == 0;
      worst = std::max(worst, e);
      CHECK(e <= 3e-2);
    }
    for (size_t m = 0; m < off.losses.size(); ++m)
      CHECK(std::abs(on.losses[m] - off.losses[m]) <= 1e-3 * std::abs(off.losses[m]));
    const double le = rel(on.logits, off.logits);
    CHECK(le <= 1e-2);
    if (world->rank() == 0)
      std::printf("[gpu model] tp_comm_overlap_forward TP %d: loss %.6f vs %.6f, logits rel %.2e, worst gradient rel "
                  "%.2e, bit-identical %s, host syncs %lld vs %lld\n",
                  tpn, on.losses.back(), off.losses.back(), le, worst, same ? "yes" : "no", (long long)on.host_syncs,
                  (long long)off.host_syncs);
  }
}

TEST_CASE("GPTModel on GPUs with the NCCL CP ring (CP = every rank) equals the CPU CP = 1 model",
          "[gpu][model][cp][mpi]") {
  // Every rank in one CP group (TP 1) on this rank's two chunks of the sequence; the ring's exchanges on the
  // layers' communication streams. Without and with selective recompute (the backward reruns the ring instead
  // of using the K/V blocks the forward kept). Two micro-batches accumulate into the
  // main gradients. The CP ranks' loss shares and
  // gradients summed over CP (host MPI) against the f32 CPU model on the full sequences, at this file's 16-bit
  // tolerances: loss 1e-2, every gradient 1e-1 (measured values printed).
  MC_REQUIRE_GPU();
  CpOfEveryRank g = cp_of_every_rank();
  if (!g.cp) return;
  auto &world = g.world, &gpu_cp = g.cp, &gpu_tp = g.tp;
  const int cpn = world->size();
  ProcessGrid grid1(*world, ParallelConfig{.tensor = 1}, {GroupKind::Tp});
  mdl::TransformerConfig llama = overlap_test_config();
  llama.sequence_parallel = false;
  llama.params_dtype = DType::F32;
  llama.max_position_embeddings = 256;
  mdl::TransformerConfig selective = llama;
  selective.recompute_granularity = mdl::RecomputeGranularity::Selective;
  const Device dev = my_device();
  for (const mdl::TransformerConfig& cfg : {llama, selective})
    for (int64_t seq : {64, 256}) {
      INFO("CP " << cpn << " seq " << seq << " recompute "
                 << mdl::recompute_granularity_name(cfg.recompute_granularity));
      const Batch a = model_test::token_batch(kBatch, seq, cfg.vocab_size, 0, 6),
                  b = model_test::token_batch(kBatch, seq, cfg.vocab_size, 1, 6);
      ly::ForwardContext cpu_ctx;
      mdl::GPTModel ref(cfg, grid1.tp());
      double ref_loss = 0;
      for (const Batch* x : {&a, &b}) {
        ref_loss += ref.forward(cpu_ctx, x->tokens, x->labels, x->mask).item();
        ref.backward(cpu_ctx);
      }
      mdl::TransformerConfig c = cfg;
      c.params_dtype = DType::BF16;
      ly::ForwardContext ctx;
      ctx.stream = Stream::create(dev);
      mdl::GPTModelOptions mo;
      mo.device = dev;
      mo.cp = gpu_cp.get();
      mdl::GPTModel model(c, *gpu_tp, mo);
      double share = 0;
      for (const Batch* x : {&a, &b}) {
        auto local = [&](const Tensor& t) { return cp_slice_sequence(t, 1, world->rank(), cpn).to(dev, ctx.stream); };
        share += model.forward(ctx, local(x->tokens), local(x->labels), local(x->mask)).to(Device::cpu(), ctx.stream)
                     .item();
        model.backward(ctx);
      }
      ctx.stream.synchronize();
      Tensor loss = Tensor::from_vector<float>({float(share)}, {1});
      world->all_reduce(loss, comm::ReduceOp::Sum)->wait();
      const double loss_err = std::abs(loss.item() - ref_loss) / std::abs(ref_loss);
      CHECK(loss_err <= 1e-2);
      const double worst = check_gradients(ref, model, cfg, 1, [&](const ly::Parameter& p) {
        Tensor g = p.main_grad.to(Device::cpu(), ctx.stream).to(DType::F32).contiguous();
        world->all_reduce(g, comm::ReduceOp::Sum)->wait();  // what DDP's reduction over DP×CP adds up
        return g;
      });
      if (world->rank() == 0)
        std::printf("[gpu model] CP %d seq %lld %s: loss %.6f (cpu %.6f, rel %.2e), worst gradient rel "
                    "%.2e\n",
                    cpn, (long long)seq,
                    std::string(mdl::recompute_granularity_name(cfg.recompute_granularity)).c_str(), loss.item(),
                    ref_loss, loss_err, worst);
    }
}

TEST_CASE("the CP ring's wait log brackets every cross-stream wait and changes no number", "[gpu][cp][mpi]") {
  // One SelfAttention over a CP ring of every rank (bf16, TP 1, exchanges on the layer's communication stream),
  // built twice from one seed: with a RingWaitLog and without. Forward + backward on the same input: the
  // output and every gradient are bit-identical (the log only records events), the log holds one event pair
  // per exchange the compute stream waits for (the forward's CP − 1 K/V passes and the backward's CP − 1
  // dK/dV passes, per call), and each stall is a finite, non-negative time no longer than the whole call.
  MC_REQUIRE_GPU();
  const CpOfEveryRank g = cp_of_every_rank();
  if (!g.cp) return;
  const int cpn = g.world->size(), rank = g.world->rank();
  const Device dev = my_device();
  const ly::AttentionConfig acfg = mdl::attention_config([] {
    mdl::TransformerConfig c = overlap_test_config();
    c.sequence_parallel = false;
    return c;
  }());
  const int64_t s_local = 64, b = 2;
  struct Run {
    Tensor y, dx;
    std::vector<Tensor> grads;
    double call_ms = 0;
  };
  auto run = [&](ly::RingWaitLog* log) {
    ly::SelfAttentionOptions o;
    o.device = dev;
    o.cp = g.cp.get();
    o.cp_wait_log = log;
    ly::SelfAttention attn(*g.tp, acfg, o);
    ly::ForwardContext ctx;
    ctx.stream = Stream::create(dev);
    const Tensor x = randn({s_local, b, acfg.hidden_size}, uint64_t(rank) * 2)
                         .to(DType::BF16)
                         .to(dev, ctx.stream);
    const Tensor dy = randn({s_local, b, acfg.hidden_size}, uint64_t(rank) * 2 + 1)
                          .to(DType::BF16)
                          .to(dev, ctx.stream);
    Run r;
    Event t0(true), t1(true);
    t0.record(ctx.stream);
    r.y = attn.forward(ctx, x).to(Device::cpu(), ctx.stream);
    r.dx = attn.backward(ctx, dy).to(Device::cpu(), ctx.stream);
    t1.record(ctx.stream);
    for (ly::Parameter* p : attn.parameters()) r.grads.push_back(p->main_grad.to(Device::cpu(), ctx.stream));
    ctx.stream.synchronize();
    r.call_ms = t0.elapsed_ms(t1);
    return r;
  };
  ly::RingWaitLog log;
  const Run plain = run(nullptr), logged = run(&log);
  REQUIRE(log.waits.size() == size_t(2 * (cpn - 1)));
  require_equal(logged.y, plain.y, "output");
  require_equal(logged.dx, plain.dx, "input gradient");
  REQUIRE(logged.grads.size() == plain.grads.size());
  for (size_t i = 0; i < plain.grads.size(); ++i) require_equal(logged.grads[i], plain.grads[i], "weight gradient");
  double sum = 0;
  for (const auto& [before, after] : log.waits) {
    after.synchronize();
    const double ms = before.elapsed_ms(after);
    CHECK(std::isfinite(ms));
    CHECK(ms >= 0.0);
    sum += ms;
  }
  CHECK(std::abs(log.stalled_ms() - sum) <= 1e-9 * std::max(1.0, sum));
  CHECK(sum <= logged.call_ms);
  if (rank == 0)
    std::printf("[gpu cp] wait log CP %d: %zu waits, stalled %.3f ms of a %.3f ms forward + backward\n", cpn,
                log.waits.size(), sum, logged.call_ms);
  log.clear();
  CHECK(log.waits.empty());
}

TEST_CASE("the CP group by copy engines (cp_comm_copy_engine) gives the NCCL group's numbers", "[gpu][cp][mpi]") {
  // One SelfAttention over a CP group of every rank (bf16, TP 1, deterministic attention backward), built from
  // one seed over two NCCL groups of the same ranks: the plain one and one whose transfers move by copy engines
  // (CommOptions::copy_engine).
  // p2p ring (plain and packed rows): the K/V and dK/dV passes move the same bytes, so the output and every
  // gradient are bit-identical. all_gather: the gathers are exact and the dK/dV reduce-scatters sum in rank
  // order in f32 (NCCL in its ring order), so those differ by f32 round-off before the bf16 rounding:
  // within 2e-2 relative (one bf16 rounding step apart at most, measured values printed).
  MC_REQUIRE_GPU();
  const CpOfEveryRank g = cp_of_every_rank();
  if (!g.cp) return;
  const int cpn = g.world->size(), rank = g.world->rank();
  const Device dev = my_device();
  comm::CommOptions co;
  co.timeout = std::chrono::seconds(120);
  co.name = "cp_ce";
  co.copy_engine = true;
  auto ce = comm::make_nccl_communicator_over(*g.world, dev, co);
  REQUIRE(ce->copy_engine_active());
  REQUIRE_FALSE(g.cp->copy_engine_active());
  const ly::AttentionConfig acfg = mdl::attention_config([] {
    mdl::TransformerConfig c = overlap_test_config();
    c.sequence_parallel = false;
    return c;
  }());
  const int64_t b = 2;
  struct Run {
    Tensor y, dx;
    std::vector<Tensor> grads;
  };
  auto run = [&](comm::Communicator& cp, ly::CpCommType type, int64_t s_local, bool packed) {
    ly::SelfAttentionOptions o;
    o.device = dev;
    o.cp = &cp;
    o.cp_comm_type = type;
    o.deterministic = true;  // run-to-run identical attention gradients (no atomic dQ sums), so equal bytes in
                             // give equal bytes out
    ly::SelfAttention attn(*g.tp, acfg, o);
    ly::ForwardContext ctx;
    ctx.stream = Stream::create(dev);
    if (packed) {  // each row of CP · s_local tokens cut into segments that cross the chunk borders
      const int32_t row = int32_t(cpn * s_local);
      std::vector<int32_t> cu{0};
      int64_t longest = 0;
      for (int64_t r = 0; r < b; ++r) {
        for (int32_t at = 37; at < row; at += 37 + (at % 51)) cu.push_back(int32_t(r) * row + at);
        cu.push_back(int32_t(r + 1) * row);
      }
      for (size_t i = 1; i < cu.size(); ++i) longest = std::max<int64_t>(longest, cu[i] - cu[i - 1]);
      ctx.cu_seqlens = Tensor::from_vector(cu, {int64_t(cu.size())}).to(dev, ctx.stream);
      ctx.max_seqlen = longest;
    }
    const Tensor x = randn({s_local, b, acfg.hidden_size}, uint64_t(rank) * 2 + 100).to(DType::BF16).to(dev, ctx.stream);
    const Tensor dy =
        randn({s_local, b, acfg.hidden_size}, uint64_t(rank) * 2 + 101).to(DType::BF16).to(dev, ctx.stream);
    Run r;
    r.y = attn.forward(ctx, x).to(Device::cpu(), ctx.stream);
    r.dx = attn.backward(ctx, dy).to(Device::cpu(), ctx.stream);
    for (ly::Parameter* p : attn.parameters()) r.grads.push_back(p->main_grad.to(Device::cpu(), ctx.stream));
    ctx.stream.synchronize();
    return r;
  };
  for (int64_t s_local : {int64_t(64), int64_t(512)}) {
    for (bool packed : {false, true}) {
      INFO("p2p ring, local sequence " << s_local << (packed ? ", packed rows" : ""));
      const Run nccl = run(*g.cp, ly::CpCommType::P2P, s_local, packed), by_ce = run(*ce, ly::CpCommType::P2P, s_local, packed);
      require_equal(by_ce.y, nccl.y, "output");
      require_equal(by_ce.dx, nccl.dx, "input gradient");
      REQUIRE(by_ce.grads.size() == nccl.grads.size());
      for (size_t i = 0; i < nccl.grads.size(); ++i) require_equal(by_ce.grads[i], nccl.grads[i], "weight gradient");
    }
    INFO("all_gather, local sequence " << s_local);
    const Run nccl = run(*g.cp, ly::CpCommType::AllGather, s_local, false),
              by_ce = run(*ce, ly::CpCommType::AllGather, s_local, false);
    double worst = std::max(rel(by_ce.y, nccl.y), rel(by_ce.dx, nccl.dx));
    CHECK(rel(by_ce.y, nccl.y) == 0.0);  // the forward only gathers: exact
    for (size_t i = 0; i < nccl.grads.size(); ++i) worst = std::max(worst, rel(by_ce.grads[i], nccl.grads[i]));
    CHECK(worst <= 2e-2);
    if (rank == 0)
      std::printf("[gpu cp] copy engines CP %d seq %lld: p2p bit-identical, all_gather worst rel %.2e\n", cpn,
                  (long long)(s_local * cpn), worst);
  }
}
