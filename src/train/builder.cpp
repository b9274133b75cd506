#include "megacore/train/builder.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include <fmt/format.h>
#include <unordered_map>

#include "core/cuda_backend.hpp"
#include "megacore/core/error.hpp"
#include "megacore/core/log.hpp"
#include "megacore/model/fp8.hpp"
#include "megacore/core/tensor.hpp"
#include "megacore/parallel/context_parallel.hpp"
#include "megacore/pipeline/schedule.hpp"

namespace megacore::train {

namespace ly = megacore::layers;
namespace mdl = megacore::model;

Placement pick_device(const RunConfig& cfg, const comm::Communicator& world) {
  // GPUs when the world communicator runs on them.
  const bool want_cuda =
      cfg.trainer.device == "cuda" || (cfg.trainer.device == "auto" && world.backend() == comm::Backend::NCCL);
  MC_CHECK_AS(ConfigError, !want_cuda || world.backend() == comm::Backend::NCCL,
              "trainer.device is cuda but the world communicator is {} (CPU); launch with GPUs visible "
              "(python -m megacore.launch without --cpu) or set trainer.device = cpu",
              comm::backend_name(world.backend()));
  MC_CHECK_AS(ConfigError, want_cuda || world.backend() == comm::Backend::MPI,
              "trainer.device is cpu but the world communicator is NCCL; launch CPU ranks (--cpu) or set device auto");
  Placement p;
  if (!want_cuda) return p;
  const int n = cuda_device_count();
  MC_CHECK_AS(ConfigError, n > 0, "trainer.device is cuda but no GPU is visible");
  // Refused here, before any weight is allocated, rather than by the first attention call.
  MC_CHECK_AS(ConfigError, cfg.transformer_config(true).params_dtype != DType::F32,
              "trainer.precision is f32, but on GPUs the attention kernels (cuDNN SDPA and megacore's flash "
              "kernel) take bf16 or f16; set trainer.precision = bf16 (or f16), or train f32 on CPU ranks (--cpu)");
  const char* lr = std::getenv("LOCAL_RANK");
  const char* olr = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  const int local = lr ? std::atoi(lr) : olr ? std::atoi(olr) : 0;
  p.device = Device::cuda(local % n);
  // The optimizers, clipping and DDP's buffer operations issue their kernels on the device's legacy default
  // stream; the model runs there too so every step is ordered without host syncs (a separate non-blocking
  // compute stream let AdamW read gradients before their reduction had landed: no update at all).
  p.stream = Stream::default_stream(p.device);
  return p;
}

std::unique_ptr<parallel::ProcessGrid> build_grid(const RunConfig& cfg, comm::Communicator& world) {
  return std::make_unique<parallel::ProcessGrid>(world, cfg.grid_config());
}

std::unique_ptr<pipeline::PipelineLayout> build_pipeline_layout(const RunConfig& cfg) {
  const parallel::ParallelConfig pc = cfg.grid_config();
  const int pp = pc.pipeline, vp = pc.virtual_pipeline;
  const int64_t layers = cfg.model.num_layers;
  return std::make_unique<pipeline::PipelineLayout>(
      pipeline::choose_layout(layers, pp, vp, cfg.parallel.pipeline_layout, cfg.pipeline_stage_costs()));
}

std::vector<checkpoint::ShardedTensor> model_tensors(const parallel::ProcessGrid& grid, const ModelChunks& chunks) {
  const checkpoint::ShardLayout sl = checkpoint::shard_layout(grid);
  std::vector<checkpoint::ShardedTensor> out;
  for (const auto& ch : chunks)
    for (checkpoint::ShardedTensor& t : checkpoint::shard_model(*ch, sl)) out.push_back(std::move(t));
  return out;
}

std::vector<checkpoint::ShardedTensor> expert_bias_tensors(const parallel::ProcessGrid& grid, const ModelChunks& chunks) {
  // The same on every rank that holds the layer (token counts summed over DP x CP update it), so the stage's
  // DP / CP / TP rank 0 writes it, like a replicated weight.
  const checkpoint::ShardLayout sl = checkpoint::shard_layout(grid);
  std::vector<checkpoint::ShardedTensor> out;
  for (const auto& ch : chunks)
    for (ly::MoELayer* m : ch->moe_layers()) {
      if (!m->expert_bias().defined()) continue;
      const std::string& router = m->router_weight().name;  // layers.<i>.mlp.router.weight
      out.push_back(checkpoint::replicated_tensor(router.substr(0, router.rfind('.')) + ".expert_bias",
                                                  m->expert_bias(), sl.replica_writer && sl.tp_rank == 0));
    }
  return out;
}

checkpoint::CheckpointReader load_model_weights(const parallel::ProcessGrid& grid, const ModelChunks& chunks,
                                                const std::string& path, bool convert_dtype) {
  std::optional<std::string> dir = checkpoint::resolve_checkpoint(path);
  MC_CHECK_AS(IOError, dir.has_value(), "no complete checkpoint at '{}'", path);
  std::vector<checkpoint::ShardedTensor> targets = model_tensors(grid, chunks);
  for (checkpoint::ShardedTensor& t : targets) t.convert_dtype = convert_dtype;
  checkpoint::CheckpointReader reader = checkpoint::load_checkpoint(&grid.world(), *dir, targets);
  // Expert biases: part of the model (they steer the routing), so a resume and a fine-tune both start from the
  // saved ones; a checkpoint without them (a run without the bias, a converted Hugging Face model) leaves them at 0.
  // Read on each rank, then agreed: a damaged entry is that rank's error and a PeerIOError on the others.
  std::vector<checkpoint::ShardedTensor> biases = expert_bias_tensors(grid, chunks);
  std::exception_ptr err;
  try {
    for (checkpoint::ShardedTensor& t : biases) {
      if (reader.has_tensor(t.name)) {
        reader.load(t);
      } else if (t.write) {
        log_line(LogLevel::Warning, "checkpoint",
                 fmt::format("{} holds no {} (written without moe_router_enable_expert_bias): the bias starts at 0",
                             *dir, t.name));
      }
    }
  } catch (...) {
    err = std::current_exception();
  }
  checkpoint::agree(&grid.world(), err, "load (expert biases)");  // every rank: stages differ in their biases
  return reader;
}

namespace {

// Prints "trainable of total parameters" (model-wide: summed over TP and PP, replicated ones once). Collective.
void log_trainable_parameters(const RunConfig& cfg, const parallel::ProcessGrid& grid, const ModelChunks& chunks,
                              const Placement& placement) {
  // One copy of the dense weights is spread over the TP × PP ranks of DP rank 0 / CP rank 0; a TP-replicated
  // tensor is counted on TP rank 0 only. Experts (and their adapters) are spread over the expert-TP × EP × PP
  // ranks of expert-DP rank 0; an expert-TP-replicated one is counted on expert-TP rank 0.
  const auto& lay = grid.layout();
  const bool dense_copy = grid.dp_rank() == 0 && grid.cp_rank() == 0;
  const bool expert_copy = lay.expert_dp_rank(grid.rank()) == 0;
  auto counted = [&](const ly::Parameter* p) {
    if (p->expert) return expert_copy && (p->partition_dim >= 0 || lay.expert_tp_rank(grid.rank()) == 0);
    return dense_copy && (p->partition_dim >= 0 || grid.tp_rank() == 0);
  };
  int64_t counts[2] = {0, 0};
  for (const auto& ch : chunks) {
    for (ly::Parameter* p : ch->all_parameters())
      if (counted(p)) counts[1] += p->data.numel();
    for (ly::Parameter* p : ch->parameters())
      if (counted(p)) counts[0] += p->data.numel();
  }
  const Stream& s = placement.stream;
  Tensor t = Tensor::from_vector<int64_t>({counts[0], counts[1]}, {2}).to(placement.device, s);
  grid.world().all_reduce(t, comm::ReduceOp::Sum, s)->wait();
  const std::vector<double> v = t.to(Device::cpu(), s).to_double_vector();
  if (grid.rank() == 0) {
    std::string targets;
    for (const std::string& n : cfg.peft.target_modules) targets += (targets.empty() ? "" : " ") + n;
    std::printf("megacore: LoRA r=%lld alpha=%g dropout=%g on [%s]: trainable %.0f of %.0f parameters (%.4f%%)\n",
                (long long)cfg.peft.dim, cfg.peft.alpha, cfg.peft.dropout, targets.c_str(), v[0], v[1],
                v[1] > 0 ? 100.0 * v[0] / v[1] : 0.0);
    std::fflush(stdout);
  }
}

// FP8 where the run asks for it, after refusing what cannot run it (the config's own checks ran in validate).
void enable_fp8(const RunConfig& cfg, const mdl::TransformerConfig& m, const Placement& placement, ModelChunks& chunks,
                bool print) {
  const TrainerSection& t = cfg.trainer;
  if (t.fp8 == "none") return;
  const Device dev = placement.device;
  if (dev.is_cpu()) {
    MC_CHECK_AS(ConfigError, t.fp8_emulation,
                "trainer.fp8 = {} on CPU ranks: FP8 on the CPU is an emulation for tests and debugging; set "
                "trainer.fp8_emulation = true, or train on GPUs of compute capability 8.9+",
                t.fp8);
  } else {
    const int cc = cuda_impl::compute_capability(dev.index);
    MC_CHECK_AS(ConfigError, cc >= 89,
                "trainer.fp8 = {}: {} (compute capability {}.{}) has no FP8 tensor cores; FP8 needs 8.9+ (Ada, Hopper "
                "or newer): set trainer.fp8 = none",
                t.fp8, cuda_device_name(dev.index), cc / 10, cc % 10);
  }
  MC_CHECK_AS(ConfigError, m.params_dtype == DType::BF16,
              "trainer.fp8 = {} with {} parameters: FP8 training keeps bf16 parameters and activations; set "
              "trainer.precision = bf16",
              t.fp8, dtype_name(m.params_dtype));
  ly::Fp8Recipe r;
  r.scaling = ly::fp8_scaling_from_name(t.fp8);
  r.amax_history_len = t.fp8_amax_history_len;
  r.amax_compute_algo = t.fp8_amax_compute_algo == "most_recent" ? ops::Fp8AmaxAlgo::MostRecent : ops::Fp8AmaxAlgo::Max;
  r.margin = int(t.fp8_margin);
  r.grad_dtype = t.fp8_format == "e4m3" ? DType::F8E4M3 : DType::F8E5M2;
  r.wgrad = t.fp8_wgrad;
  r.keep_gathered_input = t.fp8_keep_gathered_input;
  int64_t on = 0;
  for (auto& ch : chunks) on += mdl::enable_fp8(*ch, r, t.fp8_bf16_layers);
  if (print) {
    const std::string kept = t.fp8_bf16_layers > 0 ? fmt::format(", first/last {} layers bf16", t.fp8_bf16_layers) : "";
    std::printf("megacore: FP8 %s scaling (%s, amax history %lld, %s, margin %lld)%s on %lld linears of this stage%s%s\n",
                t.fp8.c_str(), t.fp8_format.c_str(), (long long)t.fp8_amax_history_len, t.fp8_amax_compute_algo.c_str(),
                (long long)t.fp8_margin, kept.c_str(), (long long)on, t.fp8_wgrad ? "" : ", weight gradients in bf16",
                dev.is_cpu() ? " (CPU emulation)" : "");
    std::fflush(stdout);
  }
}

}  // namespace

ModelChunks build_model_chunks(const RunConfig& cfg, const mdl::TransformerConfig& m, parallel::ProcessGrid& grid,
                               const pipeline::PipelineLayout& layout, const Placement& placement) {
  ModelChunks chunks;
  const int pp_rank = grid.pp_rank();
  for (int c = 0; c < layout.virtual_stages(); ++c) {
    mdl::GPTModelOptions o;
    o.device = placement.device;
    o.layer_indices = layout.layer_indices(pp_rank, c);
    o.pre_process = layout.has_embedding(pp_rank, c);
    o.post_process = layout.has_head(pp_rank, c);
    o.recompute_num_layers = cfg.trainer.recompute_num_layers;
    o.cp = &grid.cp();
    o.cp_comm_type = cfg.parallel.cp_comm_type == "all_gather" ? ly::CpCommType::AllGather : ly::CpCommType::P2P;
    if (m.is_moe()) o.moe = mdl::moe_groups(grid);
    chunks.push_back(std::make_unique<mdl::GPTModel>(m, grid.tp(), o));
  }
  if (cfg.peft.scheme == "lora") {
    // The frozen base first (its full weights), then the adapters: from here on the model's parameters(),
    // and so DDP, the optimizer and checkpoints, are the adapters only.
    load_model_weights(grid, chunks, cfg.checkpoint.pretrained_checkpoint, /*convert_dtype=*/true);
    for (auto& ch : chunks) ch->apply_lora(cfg.peft.lora(m.seed));
    log_trainable_parameters(cfg, grid, chunks, placement);
  }
  enable_fp8(cfg, m, placement, chunks, grid.rank() == 0);
  return chunks;
}

std::vector<ParameterGroup> parameter_groups(const ModelChunks& chunks, parallel::ProcessGrid& grid) {
  ParameterGroup dense{"dense", {}, &grid.dp_cp()};
  ParameterGroup expert{"expert", {}, &grid.expert_dp(), grid.dp_cp().size()};
  for (const auto& ch : chunks)
    for (ly::Parameter* p : ch->parameters()) (p->expert ? expert : dense).params.push_back(p);
  // LoRA on experts only leaves the dense group empty: it is left out (when nothing is trainable at all, the
  // empty dense group stays, and building its buffer says so).
  std::vector<ParameterGroup> groups;
  if (!dense.params.empty() || expert.params.empty()) groups.push_back(std::move(dense));
  if (!expert.params.empty()) groups.push_back(std::move(expert));
  return groups;
}

void OptimizerParts::zero_grad() {
  for (OptimizerGroup& g : groups) g.ddp->zero_grad();
}
void OptimizerParts::set_is_last_microbatch(bool last) {
  for (OptimizerGroup& g : groups) g.ddp->set_is_last_microbatch(last);
}
void OptimizerParts::finish_grad_sync() {
  for (OptimizerGroup& g : groups) g.ddp->finish_grad_sync();
}
void OptimizerParts::finish_param_gather() {
  for (OptimizerGroup& g : groups)
    if (g.zero) g.zero->finish_param_gather();
}
optim::Fp8GatherStats OptimizerParts::fp8_param_gather(comm::Communicator& amax_group, const Stream& s) {
  optim::Fp8GatherStats total;
  for (OptimizerGroup& g : groups)
    if (g.zero && g.zero->deferred_gather()) {
      const optim::Fp8GatherStats st = optim::fp8_param_gather(*g.zero, fp8_weights, amax_group, s);
      total.buckets += st.buckets, total.weights += st.weights, total.elements += st.elements, total.bytes += st.bytes;
    }
  return total;
}

namespace {

// Which group each parameter belongs to; ValueError when two groups share one.
std::unordered_map<const ly::Parameter*, size_t> group_index(const std::vector<const ParameterGroup*>& groups) {
  std::unordered_map<const ly::Parameter*, size_t> at;
  for (size_t g = 0; g < groups.size(); ++g)
    for (const ly::Parameter* p : groups[g]->params) {
      const bool fresh = at.emplace(p, g).second;
      MC_CHECK_AS(ValueError, fresh, "parameter groups '{}' and '{}' share a parameter ('{}'); give each parameter "
                  "one group", groups[at.at(p)]->name, groups[g]->name, p->name);
    }
  return at;
}

std::unordered_map<const ly::Parameter*, size_t> group_index(const std::vector<OptimizerGroup>& groups) {
  std::vector<const ParameterGroup*> gs;
  for (const OptimizerGroup& g : groups) gs.push_back(&g.group);
  return group_index(gs);
}

// Splits `ps` by group, in order; f(g, params of g) for each group that has some. A parameter in no group is
// ValueError when `strict` (its gradient would never be reduced), skipped otherwise.
template <class F>
void for_each_group(const std::unordered_map<const ly::Parameter*, size_t>& at, size_t n,
                    const std::vector<ly::Parameter*>& ps, const std::vector<ly::Parameter*>& held_back, bool strict,
                    F&& f) {
  std::vector<std::vector<ly::Parameter*>> split(n);
  for (ly::Parameter* p : ps) {
    if (std::find(held_back.begin(), held_back.end(), p) != held_back.end()) continue;
    auto it = at.find(p);
    if (it == at.end()) {
      MC_CHECK_AS(ValueError, !strict, "parameter '{}' is trainable but in no parameter group; give build_optimizer "
                  "groups that hold every trainable parameter (parameter_groups does)", p->name);
      continue;
    }
    split[it->second].push_back(p);
  }
  for (size_t g = 0; g < n; ++g)
    if (!split[g].empty()) f(g, split[g]);
}

}  // namespace

void OptimizerParts::notify_tied_grads() {
  if (tied.empty()) return;
  for_each_group(group_index(groups), groups.size(), tied, {}, true,
                 [&](size_t g, const std::vector<ly::Parameter*>& ps) { groups[g].ddp->notify_grad_ready(ps); });
}

OptimizerParts build_optimizer(const RunConfig& cfg, const mdl::TransformerConfig& m, ModelChunks& chunks,
                               std::vector<ParameterGroup> groups, const Stream& stream) {
  const ParallelSection& ps = cfg.parallel;
  const OptimSection& os = cfg.optim;
  {
    std::vector<const ParameterGroup*> gs;
    for (const ParameterGroup& g : groups) {
      MC_CHECK_AS(ValueError, g.dp != nullptr, "parameter group '{}' has no data-parallel communicator", g.name);
      gs.push_back(&g);
    }
    group_index(gs);  // refuses a parameter in two groups before any buffer is built
  }
  OptimizerParts out;
  const bool lora = cfg.peft.scheme == "lora";
  if (m.tie_word_embeddings && cfg.grid_config().pipeline > 1 && !lora)
    for (auto& ch : chunks)
      if (ly::Parameter* t = ch->tied_embedding_weight()) out.tied.push_back(t);

  optim::DDPConfig dc;
  dc.bucket_size = ps.bucket_size;
  dc.overlap_grad_reduce = ps.overlap_grad_reduce;
  dc.use_distributed_optimizer = ps.use_distributed_optimizer;
  dc.reduce_dtype = ps.grad_reduce_in_bf16 ? DType::BF16 : DType::F32;
  const auto state_dtype = [](const std::string& s) { return s == "bf16" ? DType::BF16 : DType::F32; };
  dc.grad_dtype = state_dtype(os.main_grads_dtype);
  // "auto" precision resolves to the device only here: bf16 states need bf16 weights (validate() refused an
  // explicit f32/f16 precision already).
  MC_CHECK_AS(ConfigError,
              m.params_dtype == DType::BF16 || (os.main_params_dtype != "bf16" && os.main_grads_dtype != "bf16"),
              "optim.main_params_dtype / main_grads_dtype = bf16 need bf16 parameters, but this run's parameters are "
              "{} (trainer.precision = {}); set trainer.precision = bf16",
              dtype_name(m.params_dtype), cfg.trainer.precision);
  dc.compute_stream = stream;
  for (auto& ch : chunks)
    if (ch->post_process() && ch->pre_process() && m.tie_word_embeddings && !ch->has_lora())
      dc.shared_copies.push_back(&ch->output_layer().weight());
  // FP8 under ZeRO-1: the FP8 linears' weights in buckets of their own, whose gather trainer.fp8_param_gather
  // defers to fp8_param_gather (FP8 codes). The layout does not depend on the option, so switching it changes
  // no number (the gradient norm's summation follows the layout).
  if (cfg.trainer.fp8 != "none" && ps.use_distributed_optimizer)
    for (auto& ch : chunks)
      for (auto& [p, st] : mdl::fp8_weights(*ch)) out.fp8_weights.push_back({p, st});
  optim::AdamWConfig ac;
  ac.beta1 = float(os.adam_beta1);
  ac.beta2 = float(os.adam_beta2);
  ac.eps = float(os.adam_eps);
  ac.weight_decay = float(os.weight_decay);
  ac.main_params_dtype = state_dtype(os.main_params_dtype);
  ac.exp_avg_dtype = state_dtype(os.exp_avg_dtype);
  ac.exp_avg_sq_dtype = state_dtype(os.exp_avg_sq_dtype);
  for (ParameterGroup& pg : groups) {
    OptimizerGroup g;
    g.group = std::move(pg);
    optim::DDPConfig gdc = dc;  // the shared copies of this group's parameters (those aliasing their data)
    gdc.average_size = g.group.average_size;
    std::erase_if(gdc.shared_copies, [&](const ly::Parameter* c) {
      return std::none_of(g.group.params.begin(), g.group.params.end(), [&](const ly::Parameter* q) {
        return c->data.defined() && q->data.defined() && q->data.data_ptr() == c->data.data_ptr();
      });
    });
    for (const optim::Fp8Weight& w : out.fp8_weights)
      if (std::find(g.group.params.begin(), g.group.params.end(), w.param) != g.group.params.end())
        gdc.separate_params.push_back(w.param);
    g.ddp = std::make_unique<optim::DistributedDataParallel>(g.group.params, *g.group.dp, gdc);
    if (ps.use_distributed_optimizer) {
      g.zero = std::make_unique<optim::DistributedOptimizer>(*g.ddp, ac, ps.overlap_param_gather);
      if (!gdc.separate_params.empty() && cfg.trainer.fp8_param_gather) g.zero->set_deferred_gather(true);
    } else if (os.optimizer == "adamw") {
      g.opt = std::make_unique<optim::AdamW>(g.group.params, ac);
    } else {
      optim::SGDConfig sc;
      sc.momentum = float(os.sgd_momentum);
      sc.weight_decay = float(os.weight_decay);
      g.opt = std::make_unique<optim::SGD>(g.group.params, sc);
    }
    out.groups.push_back(std::move(g));
  }

  // Each chunk reports its parameters' gradients as they become final: to the DDP of their group, the tied
  // weights only after the engine summed them over the embedding group (notify_tied_grads).
  const auto at = group_index(out.groups);
  std::vector<std::function<void(const std::vector<ly::Parameter*>&)>> hooks;
  for (OptimizerGroup& g : out.groups) hooks.push_back(g.ddp->grad_ready_hook());
  for (auto& ch : chunks)
    ch->set_grad_ready_callback([at, hooks, tied = out.tied](const std::vector<ly::Parameter*>& ps) {
      for_each_group(at, hooks.size(), ps, tied, true, [&](size_t g, const std::vector<ly::Parameter*>& mine) {
        hooks[g](mine);
      });
    });
  if (ps.use_distributed_optimizer && ps.overlap_param_gather) {
    std::vector<optim::DistributedOptimizer*> zeros;
    for (OptimizerGroup& g : out.groups) zeros.push_back(g.zero.get());
    for (auto& ch : chunks)
      ch->set_pre_forward_callback([at, zeros](const std::vector<ly::Parameter*>& ps) {
        for_each_group(at, zeros.size(), ps, {}, false, [&](size_t g, const std::vector<ly::Parameter*>& mine) {
          zeros[g]->wait_param_gather(mine);
        });
      });
  }

  out.sched = std::make_unique<optim::LRScheduler>(cfg.lr_schedule());
  if (m.params_dtype == DType::F16) {
    optim::LossScalerConfig lc;
    lc.initial_scale = cfg.optim.initial_loss_scale;
    out.scaler = std::make_unique<optim::DynamicLossScaler>(lc);
  }
  return out;
}

std::unique_ptr<pipeline::PipelineEngine> build_engine(const RunConfig& cfg, const mdl::TransformerConfig& m,
                                                       parallel::ProcessGrid& grid,
                                                       const pipeline::PipelineLayout& layout, ModelChunks& chunks,
                                                       OptimizerParts& optimizer, bool defer_reads) {
  pipeline::PipelineEngineOptions eo;
  eo.dp = &grid.dp_cp();
  eo.defer_reads = defer_reads;
  // Tied embeddings on two stages are summed over the embedding group (LoRA leaves them frozen).
  if (m.tie_word_embeddings && grid.layout().pp_size() > 1 && cfg.peft.scheme != "lora")
    eo.embedding = &grid.embedding();
  std::vector<optim::DistributedDataParallel*> ddps;  // heap objects: the parts may move
  for (OptimizerGroup& g : optimizer.groups) ddps.push_back(g.ddp.get());
  eo.before_backward = [ddps](int, int64_t, bool last) {
    for (optim::DistributedDataParallel* d : ddps) d->set_is_last_microbatch(last);
  };
  std::vector<mdl::GPTModel*> raw;
  for (auto& ch : chunks) raw.push_back(ch.get());
  return std::make_unique<pipeline::PipelineEngine>(grid.pp(), layout, raw, eo);
}

data::LoaderConfig loader_config(const RunConfig& cfg, const mdl::TransformerConfig& m,
                                 const parallel::ProcessGrid& grid, Device device, int prefetch) {
  data::LoaderConfig lc;
  lc.micro_batch_size = cfg.data.micro_batch_size;
  lc.global_batch_size = cfg.data.global_batch_size;
  lc.dp_rank = grid.dp_rank();
  lc.dp_size = grid.layout().dp_size();
  lc.device = device;
  lc.prefetch = prefetch;
  lc.vocab_size = m.vocab_size;
  lc.cp_size = grid.layout().cp_size();
  lc.cp_rank = grid.cp_rank();
  return lc;
}

void check_training_data(const RunConfig& cfg, const data::SampleSource* train) {
  MC_CHECK_AS(ConfigError, train != nullptr, "Trainer: no training data given");
  MC_CHECK_AS(ConfigError, train->seq_length() == cfg.data.seq_length,
              "the training data has rows of {} tokens but data.seq_length is {}; rebuild the dataset for {}",
              train->seq_length(), cfg.data.seq_length, cfg.data.seq_length);
}

void resolve_run_length(RunConfig& cfg, const data::SampleSource& train, bool print) {
  if (cfg.trainer.max_epochs <= 0) return;
  // The run's length follows the data: every pass is rows // global_batch_size steps.
  const int64_t per_epoch = train.size() / cfg.data.global_batch_size;
  MC_CHECK_AS(ConfigError, per_epoch > 0,
              "trainer.max_epochs: the training data has {} rows, fewer than one global batch ({}); lower "
              "data.global_batch_size or give more examples",
              train.size(), cfg.data.global_batch_size);
  cfg.trainer.max_steps = cfg.trainer.max_epochs * per_epoch;
  optim::validate(cfg.lr_schedule());  // the warmup and decay against the length now known
  if (print)
    std::printf("megacore: %lld epoch(s) of %lld rows = %lld steps of %lld rows\n", (long long)cfg.trainer.max_epochs,
                (long long)train.size(), (long long)cfg.trainer.max_steps, (long long)cfg.data.global_batch_size);
}

std::unique_ptr<data::DataLoader> build_train_loader(const RunConfig& cfg, const mdl::TransformerConfig& m,
                                                     const parallel::ProcessGrid& grid, Device device,
                                                     std::shared_ptr<const data::SampleSource> train,
                                                     const data::SampleSource* valid, int64_t consumed_samples,
                                                     bool print) {
  check_training_data(cfg, train.get());
  data::LoaderConfig lc = loader_config(cfg, m, grid, device, cfg.data.prefetch);
  lc.consumed_samples = consumed_samples;
  // SFT rows are packed in bin order (longest examples first), so the loader shuffles them; pretraining
  // samples come shuffled by their dataset.
  const bool sft = !cfg.data.sft_path.empty();
  lc.shuffle = sft;
  lc.seed = cfg.data.seed;
  lc.epochs = std::max<int64_t>(1, cfg.trainer.max_epochs);
  if (cfg.trainer.max_epochs == 0 && sft) {
    // SFT rows are a fixed set: a run longer than one pass goes over them again, each pass reshuffled (as
    // pretraining datasets repeat their documents).
    const int64_t per_pass = train->size() / cfg.data.global_batch_size;
    if (per_pass > 0 && cfg.trainer.max_steps > per_pass) {
      lc.epochs = (cfg.trainer.max_steps + per_pass - 1) / per_pass;
      if (print)
        std::printf("megacore: trainer.max_steps %lld is more than the %lld steps of one pass over the SFT rows: "
                    "%lld passes, each reshuffled (trainer.max_epochs sets the length in passes instead)\n",
                    (long long)cfg.trainer.max_steps, (long long)per_pass, (long long)lc.epochs);
    }
  }
  auto loader = std::make_unique<data::DataLoader>(std::move(train), lc);
  // Validation needs one whole global batch: said now rather than at the first validation step.
  MC_CHECK_AS(ConfigError,
              !valid || cfg.trainer.val_check_interval == 0 || valid->size() >= cfg.data.global_batch_size,
              "the validation data has {} rows, fewer than one global batch ({}); give it more examples (a larger "
              "validation weight in data.split, or more data), lower data.global_batch_size, or set "
              "trainer.val_check_interval = 0",
              valid ? valid->size() : 0, cfg.data.global_batch_size);
  MC_CHECK_AS(ConfigError, loader->num_steps() >= cfg.trainer.max_steps,
              "the training data provides {} steps of {} samples but trainer.max_steps is {}; build the dataset with "
              "at least max_steps × global_batch_size = {} samples", loader->num_steps(), cfg.data.global_batch_size,
              cfg.trainer.max_steps, cfg.trainer.max_steps * cfg.data.global_batch_size);
  return loader;
}

std::vector<pipeline::MicroBatch> next_micro_batches(data::DataLoader& loader, const parallel::ProcessGrid& grid,
                                                     const Stream& stream) {
  std::vector<pipeline::MicroBatch> mbs;
  for (int64_t i = 0; i < loader.micro_batches_per_step(); ++i) {
    std::optional<data::Batch> b = loader.next(stream);
    MC_CHECK_AS(ValueError, b.has_value(), "the data loader ran out after {} micro-batches; the dataset is too small",
                mbs.size());
    pipeline::MicroBatch mb{b->tokens, b->labels, b->loss_mask};
    mb.loss_tokens = b->loss_tokens;  // counted by the loader on the host: no read-back in the step
    // Packed rows (more segments than rows): attention must stay within segments and positions restart.
    if (b->cu_seqlens.defined() && b->cu_seqlens.size(0) - 1 > b->tokens.size(0)) {
      mb.cu_seqlens = b->cu_seqlens, mb.max_seqlen = b->max_seqlen, mb.position_ids = b->position_ids;
    }
    // Context parallelism: the CP ranks of a DP rank read the same samples; each keeps its two chunks of the
    // sequence (the engine then counts and reduces the loss tokens over DP×CP).
    if (grid.layout().cp_size() > 1) {
      const int cr = grid.cp_rank(), cn = grid.layout().cp_size();
      mb.tokens = parallel::cp_slice_sequence(mb.tokens, 1, cr, cn, stream);
      mb.labels = parallel::cp_slice_sequence(mb.labels, 1, cr, cn, stream);
      if (mb.loss_mask.defined()) mb.loss_mask = parallel::cp_slice_sequence(mb.loss_mask, 1, cr, cn, stream);
      // Packed rows: the positions are sliced like the tokens; cu_seqlens stays that of the full rows (the
      // ring attention intersects its segments with each chunk).
      if (mb.position_ids.defined()) mb.position_ids = parallel::cp_slice_sequence(mb.position_ids, 1, cr, cn, stream);
    }
    mbs.push_back(std::move(mb));
  }
  return mbs;
}

TrainingParts build_training_parts(const RunConfig& cfg, comm::Communicator& world,
                                   std::shared_ptr<const data::SampleSource> train,
                                   std::shared_ptr<const data::SampleSource> valid, const BuildOptions& options) {
  const bool print = world.rank() == 0;
  TrainingParts p;
  p.cfg = cfg;
  p.placement = pick_device(cfg, world);
  p.model = cfg.transformer_config(p.placement.device.is_cuda());
  p.grid = build_grid(cfg, world);
  p.layout = build_pipeline_layout(cfg);
  check_training_data(cfg, train.get());
  p.chunks = build_model_chunks(cfg, p.model, *p.grid, *p.layout, p.placement);
  resolve_run_length(p.cfg, *train, print);
  if (options.before_optimizer) options.before_optimizer(p);
  p.optimizer = build_optimizer(p.cfg, p.model, p.chunks, parameter_groups(p.chunks, *p.grid), p.placement.stream);
  const int64_t consumed = options.after_optimizer ? options.after_optimizer(p) : 0;
  p.engine = build_engine(p.cfg, p.model, *p.grid, *p.layout, p.chunks, p.optimizer, options.defer_step_reads);
  p.loader = build_train_loader(p.cfg, p.model, *p.grid, p.placement.device, std::move(train), valid.get(), consumed,
                                print);
  return p;
}

}  // namespace megacore::train
