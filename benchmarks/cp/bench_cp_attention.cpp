// Context parallelism on GPUs: the ring attention layer and the whole model at long sequences, one GPU per
// rank, every rank in one CP group (TP = 1), NCCL:
//   mpirun -np 4 build/benchmarks/megacore_bench_cp --seq 32768 --out-dir benchmarks/results
//   mpirun -np 1 build/benchmarks/megacore_bench_cp --seq 8192 --out-dir benchmarks/results   (the 1-GPU base)
// Model: the Llama-1.1B of the peer figures (h2048, 16 layers, 32 heads, 8 KV groups, FFN 8192, vocab 32000,
// untied), bf16, micro-batch 1 by default; max_position_embeddings is raised to the sequence.
//
// Reported (JSON, written as cp<CP>_seq<S>_<card>.json under --out-dir and printed by rank 0):
//   attention_layer: one SelfAttention (QKV projection, RoPE, ring attention, output projection) forward +
//     backward, ms and TFLOP/s per GPU with FLOPs = causal core attention (6·a·d·S per token, the library's
//     12·a·d·S halved) + 6 · the two projections' weights per token; timed with the ring's K/V exchanges
//     overlapped (cp_overlap = true, the default) and serialised on the compute stream (cp_overlap = false);
//   ring_exchange_ms: the exchanges alone (the forward's CP−1 K/V passes and the backward's CP−1 f32 dK/dV
//     passes, same sizes) and hidden_fraction = (serial − overlapped) / exchange time, i.e. the
//     share of the communication the overlap takes off the critical path. The difference is a few percent of
//     the layer's time, so the two layers are timed in --rounds alternating rounds (overlapped, serialised,
//     the exchanges alone; --iters steps each): the ms figures are the rounds' medians, hidden_fraction the
//     median of the rounds' fractions, and hidden_fraction_rounds lists every round's. The direct measure:
//     stall_ms_per_step, the time the compute stream of the overlapped layer waited for an exchange
//     (layers::RingWaitLog: events around each wait), and hidden_by_stall = 1 − stall / exchange time;
//   model: GPTModel forward + backward on this rank's 2 chunks of the sequence, ms, tokens/s per GPU and
//     model TFLOP/s per GPU (6·N_matmul + causal attention per token, model::flops_per_token(causal)).
// --copy-engine adds a second CP group of the same ranks whose transfers move by copy engines
// (comm::CommOptions::copy_engine, the trainer's parallel.cp_comm_copy_engine): its overlapped layer and its
// exchanges alone join the same alternating rounds (ring_copy_engine: ms, stall, hidden_by_stall, and
// hidden_fraction against the same serialised layer), and the model is timed over both groups.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/bench_common.hpp"

#include "megacore/comm/bootstrap.hpp"
#include "megacore/comm/mpi_communicator.hpp"
#include "megacore/core/allocator.hpp"
#include "megacore/layers/attention.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/model/transformer_layer.hpp"
#include "megacore/parallel/context_parallel.hpp"

using namespace megacore;
namespace mdl = megacore::model;
namespace ly = megacore::layers;
using json = nlohmann::json;

namespace {

struct Args : bench::ShapeArgs {
  bool skip_model = false, copy_engine = false;
  int rounds = 5;
  std::string out_dir;
  Args() : ShapeArgs{.micro_batch = 1, .seq = 32768, .iters = 5, .warmup = 2} {}
};

Args parse(int argc, char** argv) {
  Args a;
  bench::ArgReader r(argc, argv);
  while (r.next()) {
    const std::string& k = r.key();
    if (a.read(r)) continue;
    if (k == "--skip-model") a.skip_model = true;
    else if (k == "--copy-engine") a.copy_engine = true;
    else if (k == "--rounds") a.rounds = int(std::max<int64_t>(1, r.integer()));
    else if (k == "--out-dir") a.out_dir = r.text();
    else r.unknown();
  }
  return a;
}

template <class F>
double time_it(const Args& a, comm::Communicator& world, const Stream& s, F&& f) {
  return bench::time_steps(world, s, a.warmup, a.iters, std::forward<F>(f));
}

// One ring pass of two tensors (send to rank+1, receive from rank−1), waited on the stream.
void pass(comm::Communicator& cp, const Tensor& x, const Tensor& y, Tensor& rx, Tensor& ry, const Stream& s) {
  const int n = cp.size(), r = cp.rank();
  cp.batch_send_recv({{comm::P2POp::Send, x, (r + 1) % n},
                      {comm::P2POp::Send, y, (r + 1) % n},
                      {comm::P2POp::Recv, rx, (r + n - 1) % n},
                      {comm::P2POp::Recv, ry, (r + n - 1) % n}},
                     s)
      ->wait_on(s);
}

}  // namespace

int main(int argc, char** argv) {
  return bench::mpi_main(argc, argv, "bench_cp_attention", [&] {
    const Args a = parse(argc, argv);
    auto mpi = comm::make_mpi_world();
    const Device dev = bench::local_gpu();
    auto cp = bench::nccl_over(*mpi, dev, "cp", std::chrono::seconds(600));
    std::unique_ptr<comm::Communicator> cp_ce;
    if (a.copy_engine && mpi->size() > 1) {
      cp_ce = bench::nccl_over(*mpi, dev, "cp_ce", std::chrono::seconds(600), 0, 0, /*copy_engine=*/true);
      if (!cp_ce->copy_engine_active()) throw std::runtime_error("--copy-engine: the copy engines could not be set up");
    }
    comm::CommOptions to;
    to.name = "tp";
    auto tp_host = mpi->split(mpi->rank(), 0, to);  // TP = 1, on NCCL like every group the layers use on GPUs
    auto tp = bench::nccl_over(*tp_host, dev, "tp", std::chrono::seconds(600));
    const int n = cp->size();
    const bool root = mpi->rank() == 0;
    if (a.seq % (2 * n)) throw std::runtime_error("--seq must be a multiple of 2 x the number of ranks");
    mdl::TransformerConfig cfg = bench::llama_1b();
    cfg.max_position_embeddings = std::max<int64_t>(cfg.max_position_embeddings, a.seq);
    const int64_t s_local = a.seq / n, b = a.micro_batch, h = cfg.hidden_size;
    ly::ForwardContext ctx;
    ctx.stream = Stream::create(dev);
    Allocator& al = Allocator::get(dev);

    // ---- one attention layer, ring exchanges overlapped and serialised --------------------------------
    const mdl::FlopsPerToken one = [&] {
      mdl::TransformerConfig c1 = cfg;
      c1.num_layers = 1;
      return mdl::flops_per_token(c1, a.seq, /*causal=*/true);
    }();
    const double layer_flops = double(b * a.seq) *
                               (one.attention + 6.0 * double(h * cfg.qkv_width() + cfg.attention_width() * h));
    // Both layers (same weights, ring overlapped and serialised) and the exchanges alone, timed in alternating
    // rounds so drift (clocks, the other ranks) falls on both alike.
    ly::RingWaitLog stalls, stalls_ce;
    auto make_layer = [&](bool overlap, comm::Communicator* group, ly::RingWaitLog* log) {
      ly::SelfAttentionOptions o;
      o.device = dev;
      o.cp = n > 1 ? group : nullptr;
      o.cp_overlap = overlap;
      if (overlap) o.cp_wait_log = log;
      return std::make_unique<ly::SelfAttention>(*tp, megacore::model::attention_config(cfg), o);
    };
    auto attn_overlap = make_layer(true, cp.get(), &stalls);
    auto attn_serial = n > 1 ? make_layer(false, cp.get(), nullptr) : nullptr;
    auto attn_ce = cp_ce ? make_layer(true, cp_ce.get(), &stalls_ce) : nullptr;
    Tensor x = Tensor::empty({s_local, b, h}, cfg.params_dtype, dev, ctx.stream);
    Generator g(11, uint64_t(mpi->rank()));
    x.normal_(g, 0.0, 1.0, ctx.stream);
    Tensor dy = Tensor::empty({s_local, b, h}, cfg.params_dtype, dev, ctx.stream);
    dy.normal_(g, 0.0, 1.0, ctx.stream);
    auto layer_step = [&](ly::SelfAttention& attn) {
      return time_it(a, *mpi, ctx.stream, [&] {
        attn.forward(ctx, x);
        attn.backward(ctx, dy);
      });
    };
    const int64_t G = cfg.query_groups(), d = cfg.head_dim();
    Tensor k = Tensor::zeros({s_local, b, G, d}, cfg.params_dtype, dev, ctx.stream), v = k.clone(ctx.stream);
    Tensor rk = Tensor::empty(k.shape(), k.dtype(), dev, ctx.stream), rv = rk.clone(ctx.stream);
    Tensor gk = Tensor::zeros(k.shape(), DType::F32, dev, ctx.stream), gv = gk.clone(ctx.stream);
    Tensor rgk = gk.clone(ctx.stream), rgv = gk.clone(ctx.stream);
    auto exchange_step = [&](comm::Communicator& group) {
      return time_it(a, *mpi, ctx.stream, [&] {
        for (int i = 0; i + 1 < n; ++i) pass(group, k, v, rk, rv, ctx.stream);      // forward: K/V
        for (int i = 0; i + 1 < n; ++i) pass(group, gk, gv, rgk, rgv, ctx.stream);  // backward: dK/dV (f32)
      });
    };
    std::vector<double> t_ov, t_se, t_ex, frac, stall, t_ce, t_ex_ce, frac_ce, stall_ce;
    for (int round = 0; round < a.rounds; ++round) {
      stalls.clear();
      t_ov.push_back(layer_step(*attn_overlap));
      if (n == 1) continue;
      stall.push_back(stalls.stalled_ms() / double(a.warmup + a.iters));
      t_se.push_back(layer_step(*attn_serial));
      t_ex.push_back(exchange_step(*cp));
      frac.push_back((t_se.back() - t_ov.back()) / t_ex.back());
      if (!attn_ce) continue;
      stalls_ce.clear();
      t_ce.push_back(layer_step(*attn_ce));
      stall_ce.push_back(stalls_ce.stalled_ms() / double(a.warmup + a.iters));
      t_ex_ce.push_back(exchange_step(*cp_ce));
      frac_ce.push_back((t_se.back() - t_ce.back()) / t_ex_ce.back());
    }
    json layer = json::object();
    const double t_overlap = bench::median(t_ov);
    layer["overlapped"] = {{"ms", t_overlap * 1e3}, {"tflops_per_gpu", layer_flops / t_overlap / n / 1e12}};
    json ring = nullptr;
    if (n > 1) {
      const double t_serial = bench::median(t_se), t_exchange = bench::median(t_ex), hidden = bench::median(frac);
      const double stall_ms = bench::median(stall);
      layer["serialised"] = {{"ms", t_serial * 1e3}, {"tflops_per_gpu", layer_flops / t_serial / n / 1e12}};
      ring = {{"ring_exchange_ms", t_exchange * 1e3},
              {"hidden_fraction", hidden},
              {"hidden_fraction_rounds", frac},
              {"exposed_ms_estimate", std::max(0.0, (1.0 - hidden) * t_exchange) * 1e3},
              {"stall_ms_per_step", stall_ms},
              {"stall_ms_rounds", stall},
              {"hidden_by_stall", 1.0 - stall_ms / (t_exchange * 1e3)},
              {"rounds", a.rounds},
              {"iters_per_round", a.iters}};
    }
    json ring_ce = nullptr;
    if (attn_ce) {
      const double t = bench::median(t_ce), t_exchange = bench::median(t_ex_ce), stall_ms = bench::median(stall_ce);
      layer["overlapped_copy_engine"] = {{"ms", t * 1e3}, {"tflops_per_gpu", layer_flops / t / n / 1e12}};
      ring_ce = {{"ring_exchange_ms", t_exchange * 1e3},
                 {"hidden_fraction", bench::median(frac_ce)},
                 {"hidden_fraction_rounds", frac_ce},
                 {"stall_ms_per_step", stall_ms},
                 {"stall_ms_rounds", stall_ce},
                 {"hidden_by_stall", 1.0 - stall_ms / (t_exchange * 1e3)},
                 {"layer_ms_rounds", t_ce},
                 {"nccl_layer_ms_rounds", t_ov}};
    }

    // ---- the whole model -------------------------------------------------------------------------------
    auto model_step = [&](comm::Communicator* group) -> json {
      mdl::GPTModelOptions mo;
      mo.device = dev;
      mo.cp = n > 1 ? group : nullptr;
      mdl::GPTModel m(cfg, *tp, mo);
      std::vector<int64_t> tok(size_t(b * a.seq)), lab(tok.size());
      for (size_t i = 0; i < tok.size(); ++i) {
        tok[i] = int64_t((i * 7919 + 13) % uint64_t(cfg.vocab_size));
        lab[i] = int64_t((i * 104729 + 3) % uint64_t(cfg.vocab_size));
      }
      Tensor tokens = parallel::cp_slice_sequence(Tensor::from_vector<int64_t>(tok, {b, a.seq}), 1, cp->rank(), n)
                          .to(dev, ctx.stream);
      Tensor labels = parallel::cp_slice_sequence(Tensor::from_vector<int64_t>(lab, {b, a.seq}), 1, cp->rank(), n)
                          .to(dev, ctx.stream);
      Tensor loss;
      al.reset_peak_stats();
      const double sec = time_it(a, *mpi, ctx.stream, [&] {
        loss = m.forward(ctx, tokens, labels);
        m.backward(ctx);
      });
      const mdl::FlopsPerToken fpt = mdl::flops_per_token(cfg, a.seq, /*causal=*/true);
      return {{"ms_per_step", sec * 1e3},
              {"tokens_per_s_per_gpu", double(b * a.seq) / sec / n},
              {"tflops_per_gpu", fpt.total * double(b * a.seq) / sec / n / 1e12},
              {"loss", loss.item()},
              {"peak_allocated_gib", double(al.stats().peak_allocated) / (1 << 30)}};
    };
    json model = nullptr, model_ce = nullptr;
    if (!a.skip_model) {
      model = model_step(cp.get());
      if (cp_ce) model_ce = model_step(cp_ce.get());
    }

    const std::string card = cuda_device_name(dev.index);
    json r = {{"benchmark", "cp_attention"},
              {"card", card},
              {"model", "llama-1.1b (h2048 L16 a32 g8 ffn8192 v32000)"},
              {"dtype", "bf16"},
              {"gpus", n},
              {"context_parallel", n},
              {"cp_comm_type", "p2p"},
              {"seq", a.seq},
              {"micro_batch", b},
              {"flops_convention", "causal: attention 6*a*d*S per token + 6*N_matmul"},
              {"attention_layer", layer},
              {"ring", ring},
              {"ring_copy_engine", ring_ce},
              {"model_fwd_bwd", model},
              {"model_fwd_bwd_copy_engine", model_ce}};
    if (root)
      bench::write_result(r.dump(2), a.out_dir, "cp" + std::to_string(n) + "_seq" + std::to_string(a.seq), card);
  });
}
