#include "megacore/train/trainer.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "megacore/checkpoint/checkpoint_manager.hpp"
#include "megacore/checkpoint/dist_checkpoint.hpp"
#include "megacore/checkpoint/sharded_tensor.hpp"
#include "megacore/core/allocator.hpp"
#include "megacore/core/error.hpp"
#include "megacore/data/loader.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/optim/distributed_data_parallel.hpp"
#include "megacore/optim/distributed_optimizer.hpp"
#include "megacore/optim/grad_clip.hpp"
#include "megacore/optim/loss_scaler.hpp"
#include "megacore/optim/optimizer.hpp"
#include "megacore/parallel/mappings.hpp"
#include "megacore/pipeline/engine.hpp"
#include "megacore/pipeline/layout.hpp"

namespace megacore::train {

namespace fs = std::filesystem;
using json = nlohmann::json;
namespace ly = megacore::layers;
namespace mdl = megacore::model;

// ---------------------------------------------------------------------------------------------------
// Recipe JSON → TrainConfig

namespace {

const json& section(const json& j, const char* name) {
  MC_CHECK_AS(ConfigError, j.contains(name) && j[name].is_object(),
              "recipe JSON has no '{}' section; save the recipe with Recipe.to_json()", name);
  return j[name];
}

template <class T>
T get(const json& s, const char* sec, const char* key) {
  MC_CHECK_AS(ConfigError, s.contains(key), "recipe field {}.{} is missing; save the recipe with Recipe.to_json()",
              sec, key);
  try {
    return s[key].get<T>();
  } catch (const json::exception& e) {
    raise<ConfigError>("recipe field {}.{} has the wrong type ({}): {}", sec, key, s[key].dump(), e.what());
  }
}

DType precision_dtype(const std::string& p) {
  if (p == "f32") return DType::F32;
  if (p == "bf16") return DType::BF16;
  if (p == "f16") return DType::F16;
  raise<ConfigError>("trainer.precision '{}' is not one of f32, bf16, f16", p);
}

}  // namespace

TrainConfig TrainConfig::from_recipe_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    raise<ConfigError>("the recipe is not valid JSON: {}", e.what());
  }
  TrainConfig c;
  c.recipe_json = text;
  const json& m = section(j, "model");
  mdl::TransformerConfig& t = c.model;
  t.num_layers = get<int64_t>(m, "model", "num_layers");
  t.hidden_size = get<int64_t>(m, "model", "hidden_size");
  t.num_attention_heads = get<int64_t>(m, "model", "num_attention_heads");
  t.num_query_groups = get<int64_t>(m, "model", "num_query_groups");
  t.ffn_hidden_size = get<int64_t>(m, "model", "ffn_hidden_size");
  t.kv_channels = get<int64_t>(m, "model", "kv_channels");
  t.vocab_size = get<int64_t>(m, "model", "vocab_size");
  t.max_position_embeddings = get<int64_t>(m, "model", "max_position_embeddings");
  t.make_vocab_size_divisible_by = get<int64_t>(m, "model", "make_vocab_size_divisible_by");
  const auto norm = get<std::string>(m, "model", "normalization");
  MC_CHECK_AS(ConfigError, norm == "RMSNorm" || norm == "LayerNorm",
              "model.normalization '{}' is not RMSNorm or LayerNorm", norm);
  t.normalization = norm == "RMSNorm" ? mdl::NormType::RMSNorm : mdl::NormType::LayerNorm;
  t.norm_eps = get<double>(m, "model", "norm_eps");
  const auto act = get<std::string>(m, "model", "activation");
  MC_CHECK_AS(ConfigError, act == "SwiGLU" || act == "GELU", "model.activation '{}' is not SwiGLU or GELU", act);
  t.activation = act == "SwiGLU" ? mdl::ActivationType::SwiGLU : mdl::ActivationType::GELU;
  t.add_bias_linear = get<bool>(m, "model", "add_bias_linear");
  t.tie_word_embeddings = get<bool>(m, "model", "tie_word_embeddings");
  const auto pos = get<std::string>(m, "model", "position_embedding");
  MC_CHECK_AS(ConfigError, pos == "RoPE" || pos == "Learned", "model.position_embedding '{}' is not RoPE or Learned",
              pos);
  t.position_embedding = pos == "RoPE" ? mdl::PositionEmbeddingType::RoPE : mdl::PositionEmbeddingType::Learned;
  t.rope_theta = get<double>(m, "model", "rope_theta");
  const auto rs = get<std::string>(m, "model", "rope_scaling");
  MC_CHECK_AS(ConfigError, rs == "none" || rs == "llama3", "model.rope_scaling '{}' is not none or llama3", rs);
  t.rope_scaling.type = rs == "llama3" ? mdl::RopeScalingType::Llama3 : mdl::RopeScalingType::None;
  t.rope_scaling.factor = get<double>(m, "model", "rope_scaling_factor");
  t.rope_scaling.low_freq_factor = get<double>(m, "model", "rope_low_freq_factor");
  t.rope_scaling.high_freq_factor = get<double>(m, "model", "rope_high_freq_factor");
  t.rope_scaling.original_max_position_embeddings = get<int64_t>(m, "model", "rope_original_max_position_embeddings");
  t.init_method_std = get<double>(m, "model", "init_method_std");
  t.seed = get<uint64_t>(m, "model", "seed");

  const json& p = section(j, "parallel");
  c.parallel.tensor = get<int>(p, "parallel", "tensor_model_parallel_size");
  c.parallel.pipeline = get<int>(p, "parallel", "pipeline_model_parallel_size");
  c.parallel.virtual_pipeline = get<int>(p, "parallel", "virtual_pipeline_model_parallel_size");
  c.parallel.context = get<int>(p, "parallel", "context_parallel_size");
  c.parallel.expert = get<int>(p, "parallel", "expert_model_parallel_size");
  MC_CHECK_AS(ConfigError, c.parallel.context == 1,
              "parallel.context_parallel_size {} is not supported by the trainer yet; set it to 1", c.parallel.context);
  t.sequence_parallel = get<bool>(p, "parallel", "sequence_parallel");
  c.pipeline_layout = get<std::vector<int64_t>>(p, "parallel", "pipeline_layout");
  if (p.contains("pipeline_embedding_cost")) c.pipeline_embedding_cost = get<double>(p, "parallel", "pipeline_embedding_cost");
  if (p.contains("pipeline_head_cost")) c.pipeline_head_cost = get<double>(p, "parallel", "pipeline_head_cost");
  c.use_distributed_optimizer = get<bool>(p, "parallel", "use_distributed_optimizer");
  if (p.contains("overlap_param_gather")) c.overlap_param_gather = get<bool>(p, "parallel", "overlap_param_gather");
  MC_CHECK_AS(ConfigError, !c.overlap_param_gather || c.use_distributed_optimizer,
              "parallel.overlap_param_gather needs parallel.use_distributed_optimizer (ZeRO-1): only then are the "
              "parameters all-gathered after the step; enable ZeRO or turn the overlap off");
  c.overlap_grad_reduce = get<bool>(p, "parallel", "overlap_grad_reduce");
  c.bucket_size = get<int64_t>(p, "parallel", "bucket_size");
  c.grad_reduce_in_bf16 = get<bool>(p, "parallel", "grad_reduce_in_bf16");
  t.tp_comm_overlap = p.contains("tp_comm_overlap") && get<bool>(p, "parallel", "tp_comm_overlap");

  const json& d = section(j, "data");
  c.seq_length = get<int64_t>(d, "data", "seq_length");
  c.micro_batch_size = get<int64_t>(d, "data", "micro_batch_size");
  c.global_batch_size = get<int64_t>(d, "data", "global_batch_size");
  if (d.contains("prefetch")) c.prefetch = get<int>(d, "data", "prefetch");
  c.shuffle_rows = d.contains("sft_path") && !get<std::string>(d, "data", "sft_path").empty();
  if (d.contains("seed")) c.data_seed = get<uint64_t>(d, "data", "seed");
  MC_CHECK_AS(ConfigError, c.prefetch >= 1, "data.prefetch is {}; it counts micro-batches prepared ahead, >= 1",
              c.prefetch);

  const json& o = section(j, "optim");
  c.optimizer = get<std::string>(o, "optim", "optimizer");
  MC_CHECK_AS(ConfigError, c.optimizer == "adamw" || c.optimizer == "sgd", "optim.optimizer '{}' is not adamw or sgd",
              c.optimizer);
  c.weight_decay = get<double>(o, "optim", "weight_decay");
  c.adam_beta1 = get<double>(o, "optim", "adam_beta1");
  c.adam_beta2 = get<double>(o, "optim", "adam_beta2");
  c.adam_eps = get<double>(o, "optim", "adam_eps");
  c.sgd_momentum = get<double>(o, "optim", "sgd_momentum");
  c.clip_grad = get<double>(o, "optim", "clip_grad");
  c.skip_nonfinite_steps = get<bool>(o, "optim", "skip_nonfinite_steps");
  c.initial_loss_scale = get<double>(o, "optim", "initial_loss_scale");

  const json& tr = section(j, "trainer");
  c.max_steps = get<int64_t>(tr, "trainer", "max_steps");
  c.stop_after_steps = get<int64_t>(tr, "trainer", "stop_after_steps");
  c.val_check_interval = get<int64_t>(tr, "trainer", "val_check_interval");
  c.limit_val_batches = get<int64_t>(tr, "trainer", "limit_val_batches");
  c.log_interval = get<int64_t>(tr, "trainer", "log_interval");
  t.params_dtype = precision_dtype(get<std::string>(tr, "trainer", "precision"));
  c.device = get<std::string>(tr, "trainer", "device");
  const auto rc = get<std::string>(tr, "trainer", "recompute");
  t.recompute_granularity = rc == "full"        ? mdl::RecomputeGranularity::Full
                            : rc == "selective" ? mdl::RecomputeGranularity::Selective
                                                : mdl::RecomputeGranularity::None;
  c.peak_tflops = get<double>(tr, "trainer", "peak_tflops");
  c.comm_timeout_s = get<double>(tr, "trainer", "comm_timeout_s");

  c.lr.lr = get<double>(o, "optim", "lr");
  c.lr.min_lr = get<double>(o, "optim", "min_lr");
  c.lr.warmup_steps = get<int64_t>(o, "optim", "lr_warmup_iters");
  const int64_t decay = get<int64_t>(o, "optim", "lr_decay_iters");
  c.lr.decay_steps = decay > 0 ? decay : c.max_steps;
  c.lr.style = optim::lr_decay_style_from_name(get<std::string>(o, "optim", "lr_decay_style"));
  c.lr.wsd_decay_steps = get<int64_t>(o, "optim", "lr_wsd_decay_iters");
  if (c.lr.style == optim::LRDecayStyle::WSD && c.lr.wsd_decay_steps == 0)
    c.lr.wsd_decay_steps = std::max<int64_t>(1, (c.lr.decay_steps - c.lr.warmup_steps) / 10);

  const json& ck = section(j, "checkpoint");
  c.save_dir = get<std::string>(ck, "checkpoint", "save_dir");
  c.save_interval = get<int64_t>(ck, "checkpoint", "save_interval");
  c.keep_last = get<int>(ck, "checkpoint", "keep_last");
  c.keep_top_k = get<int>(ck, "checkpoint", "keep_top_k");
  c.resume = get<std::string>(ck, "checkpoint", "resume");
  c.async_save = get<bool>(ck, "checkpoint", "async_save");
  c.save_last = get<bool>(ck, "checkpoint", "save_last");

  const json& lg = section(j, "logging");
  c.log_dir = get<std::string>(lg, "logging", "log_dir");
  c.jsonl = get<bool>(lg, "logging", "jsonl");
  c.tensorboard = get<bool>(lg, "logging", "tensorboard");
  c.progress_bar = get<std::string>(lg, "logging", "progress_bar");
  return c;
}

// ---------------------------------------------------------------------------------------------------
// Trainer

struct Trainer::Impl {
  TrainConfig cfg;
  comm::Communicator& world;
  std::shared_ptr<const data::SampleSource> train_src, valid_src;
  std::unique_ptr<parallel::ProcessGrid> grid;
  std::unique_ptr<pipeline::PipelineLayout> layout;
  Device device = Device::cpu();
  ly::ForwardContext ctx;
  std::vector<std::unique_ptr<mdl::GPTModel>> chunks;
  std::vector<ly::Parameter*> params;  // every chunk's parameters, chunk order
  std::vector<ly::Parameter*> tied;    // tied embedding weights this rank holds (held back from DDP until summed)
  std::unique_ptr<optim::DistributedDataParallel> ddp;
  std::unique_ptr<optim::Optimizer> opt;               // AdamW / SGD
  std::unique_ptr<optim::DistributedOptimizer> zero;   // ZeRO-1
  std::unique_ptr<optim::LRScheduler> sched;
  std::unique_ptr<optim::DynamicLossScaler> scaler;  // f16 only
  std::unique_ptr<pipeline::PipelineEngine> engine;
  std::unique_ptr<data::DataLoader> loader;
  std::unique_ptr<checkpoint::CheckpointManager> ckpt;
  std::unique_ptr<TensorBoardWriter> tb;
  std::unique_ptr<JsonlWriter> jsonl;
  std::function<void(const StepMetrics&)> step_cb;
  int64_t step = 0;
  int64_t consumed_samples = 0;
  int64_t num_micro = 1;
  double peak = 0;
  std::string last_checkpoint;
  bool root = false;

  Impl(const TrainConfig& c, comm::Communicator& w, std::shared_ptr<const data::SampleSource> tr,
       std::shared_ptr<const data::SampleSource> va)
      : cfg(c), world(w), train_src(std::move(tr)), valid_src(std::move(va)) {}

  int dp() const { return grid->layout().dp_size(); }
  bool is_cuda() const { return device.is_cuda(); }

  void build();
  void build_optimizer();
  std::vector<checkpoint::ShardedTensor> model_tensors() const;
  std::vector<pipeline::MicroBatch> next_micro_batches(data::DataLoader& l);
  StepMetrics train_step();
  void log(const StepMetrics& m);
  double evaluate(int64_t max_batches);
  Tensor forward_only(const pipeline::MicroBatch& mb, double* loss_tokens);
  data::LoaderConfig loader_config(int prefetch) const;
  std::string save();
  void load(const std::string& path, bool optimizer);
  /// Resolves `path` and loads the model's parameters; the reader serves load_training_state.
  checkpoint::CheckpointReader load_model(const std::string& path);
  /// Optimizer state, step, scheduler, loss scaler and data position from an open checkpoint.
  void load_training_state(checkpoint::CheckpointReader& reader);
};

void Trainer::Impl::build() {
  root = world.rank() == 0;
  mdl::TransformerConfig& m = cfg.model;
  // Device: GPUs when the world communicator runs on them.
  const bool want_cuda = cfg.device == "cuda" || (cfg.device == "auto" && world.backend() == comm::Backend::NCCL);
  MC_CHECK_AS(ConfigError, !want_cuda || world.backend() == comm::Backend::NCCL,
              "trainer.device is cuda but the world communicator is {} (CPU); launch with GPUs visible "
              "(python -m megacore.launch without --cpu) or set trainer.device = cpu",
              comm::backend_name(world.backend()));
  MC_CHECK_AS(ConfigError, want_cuda || world.backend() == comm::Backend::MPI,
              "trainer.device is cpu but the world communicator is NCCL; launch CPU ranks (--cpu) or set device auto");
  if (want_cuda) {
    const int n = cuda_device_count();
    MC_CHECK_AS(ConfigError, n > 0, "trainer.device is cuda but no GPU is visible");
    // Refused here, before any weight is allocated, rather than by the first attention call.
    MC_CHECK_AS(ConfigError, m.params_dtype != DType::F32,
                "trainer.precision is f32, but on GPUs the attention kernels (cuDNN SDPA and megacore's flash "
                "kernel) take bf16 or f16; set trainer.precision = bf16 (or f16), or train f32 on CPU ranks (--cpu)");
    const char* lr = std::getenv("LOCAL_RANK");
    const char* olr = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    const int local = lr ? std::atoi(lr) : olr ? std::atoi(olr) : 0;
    device = Device::cuda(local % n);
    // The optimizers, clipping and DDP's buffer operations issue their kernels on the device's legacy default
    // stream; the model runs there too so every step is ordered without host syncs (a separate non-blocking
    // compute stream let AdamW read gradients before their reduction had landed: no update at all).
    ctx.stream = Stream::default_stream(device);
  }

  parallel::ParallelConfig pc = cfg.parallel;
  grid = std::make_unique<parallel::ProcessGrid>(world, pc);
  const int tp = pc.tensor, pp = pc.pipeline, vp = pc.virtual_pipeline;
  const bool balance = cfg.pipeline_embedding_cost != 0 || cfg.pipeline_head_cost != 0;
  MC_CHECK_AS(ConfigError, cfg.pipeline_layout.empty() || !balance,
              "parallel.pipeline_layout is given together with pipeline_embedding_cost/pipeline_head_cost; give "
              "explicit counts or the costs to balance for, not both");
  layout = std::make_unique<pipeline::PipelineLayout>(
      !cfg.pipeline_layout.empty()
          ? pipeline::PipelineLayout::from_counts(m.num_layers, pp, vp, cfg.pipeline_layout)
          : balance ? pipeline::PipelineLayout::balanced(m.num_layers, pp, vp,
                                                         {cfg.pipeline_embedding_cost, cfg.pipeline_head_cost})
                    : pipeline::PipelineLayout::uniform(m.num_layers, pp, vp));
  num_micro = pipeline::num_microbatches(cfg.global_batch_size, cfg.micro_batch_size, dp());
  pipeline::validate(pipeline::make_schedule_config(pp, vp, num_micro));
  mdl::validate(m, tp);
  MC_CHECK_AS(ConfigError, cfg.seq_length <= m.max_position_embeddings,
              "data.seq_length {} exceeds model.max_position_embeddings {}", cfg.seq_length, m.max_position_embeddings);
  MC_CHECK_AS(ConfigError, !m.sequence_parallel || cfg.seq_length % tp == 0,
              "data.seq_length {} is not divisible by TP {} (sequence parallelism); use a multiple of {}",
              cfg.seq_length, tp, tp);
  MC_CHECK_AS(ConfigError, train_src != nullptr, "Trainer: no training data given");
  MC_CHECK_AS(ConfigError, train_src->seq_length() == cfg.seq_length,
              "the training data has rows of {} tokens but data.seq_length is {}; rebuild the dataset for {}",
              train_src->seq_length(), cfg.seq_length, cfg.seq_length);

  const int pp_rank = grid->pp_rank();
  for (int c = 0; c < vp; ++c) {
    mdl::GPTModelOptions o;
    o.device = device;
    o.layer_indices = layout->layer_indices(pp_rank, c);
    o.pre_process = layout->has_embedding(pp_rank, c);
    o.post_process = layout->has_head(pp_rank, c);
    chunks.push_back(std::make_unique<mdl::GPTModel>(m, grid->tp(), o));
  }
  for (auto& ch : chunks) {
    for (ly::Parameter* p : ch->parameters()) params.push_back(p);
    if (m.tie_word_embeddings && pp > 1)
      if (ly::Parameter* t = ch->tied_embedding_weight()) tied.push_back(t);
  }
  sched = std::make_unique<optim::LRScheduler>(cfg.lr);
  if (m.params_dtype == DType::F16) {
    optim::LossScalerConfig lc;
    lc.initial_scale = cfg.initial_loss_scale;
    scaler = std::make_unique<optim::DynamicLossScaler>(lc);
  }

  peak = cfg.peak_tflops > 0 ? cfg.peak_tflops : (is_cuda() ? known_peak_tflops(cuda_device_name(device.index)) : 0);
  if (!cfg.save_dir.empty()) {
    checkpoint::CheckpointPolicy pol;
    pol.save_every = cfg.save_interval;
    pol.keep_last = cfg.keep_last;
    pol.keep_top_k = cfg.keep_top_k;
    pol.async = cfg.async_save;
    ckpt = std::make_unique<checkpoint::CheckpointManager>(world, cfg.save_dir, pol);
  }

  // Parameters come from a checkpoint before the optimizer copies them into its master weights.
  std::optional<std::string> resume_dir;
  if (cfg.resume == "auto") {
    if (ckpt) resume_dir = ckpt->latest();
  } else if (!cfg.resume.empty()) {
    resume_dir = checkpoint::resolve_checkpoint(cfg.resume);
    MC_CHECK_AS(IOError, resume_dir.has_value(),
                "checkpoint.resume '{}' holds no complete checkpoint; give a step_<N> directory or a root with "
                "'latest', or set resume = '' to start fresh", cfg.resume);
  }
  std::optional<checkpoint::CheckpointReader> resumed;
  if (resume_dir) resumed.emplace(load_model(*resume_dir));
  build_optimizer();
  // The training state is optional (a converted Hugging Face checkpoint has none): the optimizer starts fresh then.
  if (resumed && resumed->json().count("trainer")) load_training_state(*resumed);

  pipeline::PipelineEngineOptions eo;
  eo.dp = &grid->dp_cp();
  if (m.tie_word_embeddings && pp > 1) eo.embedding = &grid->embedding();
  eo.before_backward = [this](int, int64_t, bool last) { ddp->set_is_last_microbatch(last); };
  std::vector<mdl::GPTModel*> raw;
  for (auto& ch : chunks) raw.push_back(ch.get());
  engine = std::make_unique<pipeline::PipelineEngine>(grid->pp(), *layout, raw, eo);

  data::LoaderConfig lc = loader_config(cfg.prefetch);
  lc.consumed_samples = consumed_samples;
  lc.shuffle = cfg.shuffle_rows;
  lc.seed = cfg.data_seed;
  loader = std::make_unique<data::DataLoader>(train_src, lc);
  MC_CHECK_AS(ConfigError, loader->num_steps() >= cfg.max_steps,
              "the training data provides {} steps of {} samples but trainer.max_steps is {}; build the dataset with "
              "at least max_steps × global_batch_size = {} samples", loader->num_steps(), cfg.global_batch_size,
              cfg.max_steps, cfg.max_steps * cfg.global_batch_size);

  if (root) {
    std::printf("megacore: world %d = TP %d x PP %d (VP %d) x CP %d x DP %d on %s | %lld layers, %s | micro-batch %lld x "
                "%lld, %lld micro-batches per step | %s%s%s%s\n",
                world.size(), pc.tensor, pc.pipeline, pc.virtual_pipeline, pc.context, dp(),
                is_cuda() ? cuda_device_name(device.index).c_str() : "CPU", (long long)m.num_layers,
                std::string(dtype_name(m.params_dtype)).c_str(), (long long)cfg.micro_batch_size,
                (long long)cfg.seq_length, (long long)num_micro, zero ? "ZeRO-1" : cfg.optimizer.c_str(),
                m.sequence_parallel ? " | SP" : "", m.tp_comm_overlap ? " | tp_comm_overlap" : "",
                cfg.overlap_param_gather ? " | overlap_param_gather" : "");
    if (pc.pipeline > 1) {
      std::string counts;
      for (int64_t c : layout->counts()) counts += (counts.empty() ? "" : ", ") + std::to_string(c);
      std::printf("megacore: pipeline layout [%s] (layers per virtual stage, model order)%s\n", counts.c_str(),
                  balance ? " balanced for the embedding/head costs" : "");
    }
    std::fflush(stdout);
  }
  if (root && !cfg.log_dir.empty()) {
    if (cfg.jsonl) jsonl = std::make_unique<JsonlWriter>((fs::path(cfg.log_dir) / "metrics.jsonl").string());
    if (cfg.tensorboard) tb = std::make_unique<TensorBoardWriter>((fs::path(cfg.log_dir) / "tensorboard").string());
  }
}

void Trainer::Impl::build_optimizer() {
  optim::DDPConfig dc;
  dc.bucket_size = cfg.bucket_size;
  dc.overlap_grad_reduce = cfg.overlap_grad_reduce;
  dc.use_distributed_optimizer = cfg.use_distributed_optimizer;
  dc.reduce_dtype = cfg.grad_reduce_in_bf16 ? DType::BF16 : DType::F32;
  dc.compute_stream = ctx.stream;
  for (auto& ch : chunks)
    if (ch->post_process() && ch->pre_process() && cfg.model.tie_word_embeddings)
      dc.shared_copies.push_back(&ch->output_layer().weight());
  ddp = std::make_unique<optim::DistributedDataParallel>(params, grid->dp_cp(), dc);
  // The tied weights are reported to DDP only after the engine summed them over the embedding group.
  auto hook = ddp->grad_ready_hook();
  for (auto& ch : chunks)
    ch->set_grad_ready_callback([this, hook](const std::vector<ly::Parameter*>& ps) {
      if (tied.empty()) return hook(ps);
      std::vector<ly::Parameter*> rest;
      for (ly::Parameter* p : ps)
        if (std::find(tied.begin(), tied.end(), p) == tied.end()) rest.push_back(p);
      if (!rest.empty()) hook(rest);
    });
  optim::AdamWConfig ac;
  ac.beta1 = float(cfg.adam_beta1);
  ac.beta2 = float(cfg.adam_beta2);
  ac.eps = float(cfg.adam_eps);
  ac.weight_decay = float(cfg.weight_decay);
  if (cfg.use_distributed_optimizer) {
    MC_CHECK_AS(ConfigError, cfg.optimizer == "adamw", "parallel.use_distributed_optimizer needs optim.optimizer adamw");
    zero = std::make_unique<optim::DistributedOptimizer>(*ddp, ac, cfg.overlap_param_gather);
    if (cfg.overlap_param_gather)
      for (auto& ch : chunks)
        ch->set_pre_forward_callback([this](const std::vector<ly::Parameter*>& ps) { zero->wait_param_gather(ps); });
  } else if (cfg.optimizer == "adamw") {
    opt = std::make_unique<optim::AdamW>(params, ac);
  } else {
    optim::SGDConfig sc;
    sc.momentum = float(cfg.sgd_momentum);
    sc.weight_decay = float(cfg.weight_decay);
    opt = std::make_unique<optim::SGD>(params, sc);
  }
}

std::vector<checkpoint::ShardedTensor> Trainer::Impl::model_tensors() const {
  const checkpoint::ShardLayout sl = checkpoint::shard_layout(*grid);
  std::vector<checkpoint::ShardedTensor> out;
  for (const auto& ch : chunks)
    for (checkpoint::ShardedTensor& t : checkpoint::shard_model(*ch, sl)) out.push_back(std::move(t));
  return out;
}

// What the training and validation loaders share: this rank's place in DP, the device, and the vocabulary check.
data::LoaderConfig Trainer::Impl::loader_config(int prefetch) const {
  data::LoaderConfig lc;
  lc.micro_batch_size = cfg.micro_batch_size;
  lc.global_batch_size = cfg.global_batch_size;
  lc.dp_rank = grid->dp_rank();
  lc.dp_size = dp();
  lc.device = device;
  lc.prefetch = prefetch;
  lc.vocab_size = cfg.model.vocab_size;
  return lc;
}

std::vector<pipeline::MicroBatch> Trainer::Impl::next_micro_batches(data::DataLoader& l) {
  std::vector<pipeline::MicroBatch> mbs;
  for (int64_t i = 0; i < l.micro_batches_per_step(); ++i) {
    std::optional<data::Batch> b = l.next(ctx.stream);
    MC_CHECK_AS(ValueError, b.has_value(), "the data loader ran out after {} micro-batches; the dataset is too small",
                mbs.size());
    pipeline::MicroBatch mb{b->tokens, b->labels, b->loss_mask};
    // Packed rows (more segments than rows): attention must stay within segments and positions restart.
    if (b->cu_seqlens.defined() && b->cu_seqlens.size(0) - 1 > b->tokens.size(0)) {
      mb.cu_seqlens = b->cu_seqlens, mb.max_seqlen = b->max_seqlen, mb.position_ids = b->position_ids;
    }
    mbs.push_back(std::move(mb));
  }
  return mbs;
}

StepMetrics Trainer::Impl::train_step() {
  const auto t0 = std::chrono::steady_clock::now();
  if (is_cuda()) Allocator::get(device).reset_peak_stats();
  ddp->zero_grad();
  std::vector<pipeline::MicroBatch> mbs = next_micro_batches(*loader);
  const double loss_scale = scaler ? scaler->scale() : 1.0;
  pipeline::StepResult sr = engine->step(ctx, mbs, float(loss_scale));
  if (!tied.empty()) ddp->notify_grad_ready(tied);
  ddp->finish_grad_sync();
  comm::check_health();  // a TP/PP collective the NCCL watchdog aborted during the step (stream-ordered waits)

  // Norm (tied copies counted once), NaN/Inf check, clipping and the update in one place; with f16 the
  // gradients carry the loss scale, which checked_step divides out and adjusts.
  optim::GradNormGroups groups = optim::grad_norm_groups(*grid, zero != nullptr);
  groups.skip = [this](const ly::Parameter& p) {
    for (const auto& ch : chunks)
      if (ch->is_tied_copy(p)) return true;
    return false;
  };
  optim::CheckedStepOptions co;
  co.max_norm = cfg.clip_grad;
  co.scaler = scaler.get();
  co.skip_nonfinite = cfg.skip_nonfinite_steps;
  const double lr = sched->lr();
  const optim::StepResult st = zero ? optim::checked_step(*zero, lr, groups, co) : optim::checked_step(*opt, lr, groups, co);
  StepMetrics m;
  m.lr = lr;
  m.grad_norm = st.grad_norm;
  m.skipped = st.skipped;
  m.loss_scale = st.loss_scale;
  if (!st.skipped) sched->step();  // as Megatron-Core: a skipped step does not advance the schedule
  ++step;
  consumed_samples += cfg.global_batch_size;
  if (is_cuda()) ctx.stream.synchronize();
  m.step = step;
  m.loss = sr.loss;
  m.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tokens = double(cfg.global_batch_size * cfg.seq_length);
  m.tokens_per_s = tokens / m.step_seconds;
  const mdl::FlopsPerToken f = mdl::flops_per_token(cfg.model, cfg.seq_length, false);
  m.tflops_per_gpu = f.total * tokens / m.step_seconds / world.size() / 1e12;
  m.mfu = peak > 0 ? m.tflops_per_gpu / peak : 0;
  const MemoryStats ms = Allocator::get(device).stats();
  m.mem_allocated_gib = double(ms.allocated) / double(1 << 30);
  m.mem_peak_gib = double(ms.peak_allocated) / double(1 << 30);
  m.consumed_samples = double(consumed_samples);
  return m;
}

void Trainer::Impl::log(const StepMetrics& m) {
  if (!root) return;
  if (jsonl) jsonl->write(to_json(m));
  if (tb)
    tb->add_scalars(m.step, {{"train/loss", m.loss}, {"train/grad_norm", m.grad_norm}, {"train/lr", m.lr},
                             {"perf/tokens_per_s", m.tokens_per_s}, {"perf/tflops_per_gpu", m.tflops_per_gpu},
                             {"perf/mfu", m.mfu}, {"memory/peak_gib", m.mem_peak_gib}});
  if (m.step % cfg.log_interval != 0 && m.step != cfg.max_steps) return;
  const bool tty = ::isatty(fileno(stdout)) != 0;
  const bool bar = cfg.progress_bar == "on" || (cfg.progress_bar == "auto" && tty);
  std::string line = fmt::format(
      "step {:>{}}/{} | loss {:.4f} | grad norm {:.3f} | lr {:.3e} | {:.1f}k tok/s | {:.2f} TFLOP/s/GPU | MFU {:.1f}% | "
      "mem {:.2f}/{:.2f} GiB | {:.3f} s/step{}",
      m.step, std::to_string(cfg.max_steps).size(), cfg.max_steps, m.loss, m.grad_norm, m.lr, m.tokens_per_s / 1e3,
      m.tflops_per_gpu, 100 * m.mfu, m.mem_allocated_gib, m.mem_peak_gib, m.step_seconds,
      (m.skipped ? " | SKIPPED (non-finite gradients)" : "") +
          (scaler ? fmt::format(" | loss scale {:g}", m.loss_scale) : std::string()));
  if (bar) {
    const int width = 20, done = int(width * m.step / std::max<int64_t>(1, cfg.max_steps));
    line += " [" + std::string(size_t(done), '#') + std::string(size_t(width - done), '.') + "]";
  }
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// One forward of the whole model on [b, s] tokens with no saved activations, through every virtual stage
// in model order (stage s on pipeline rank s % PP, chunk s / PP); activations move with the pipeline
// group. On the post-process rank returns the mean loss (and its token count), elsewhere an empty tensor.
Tensor Trainer::Impl::forward_only(const pipeline::MicroBatch& mb, double* loss_tokens) {
  const Tensor &tokens = mb.tokens, &labels = mb.labels, &mask = mb.loss_mask;
  ly::ForwardContext ectx = ctx;
  ectx.training = false;
  ectx.cu_seqlens = mb.cu_seqlens, ectx.max_seqlen = mb.max_seqlen, ectx.position_ids = mb.position_ids;
  const int pp = grid->layout().pp_size(), pp_rank = grid->pp_rank(), vp = int(chunks.size());
  comm::Communicator& ppc = grid->pp();
  Tensor x, loss;
  const int64_t b = tokens.size(0), s = tokens.size(1);
  for (int vs = 0; vs < pp * vp; ++vs) {
    const int owner = vs % pp, c = vs / pp;
    const int prev_owner = (vs - 1 + pp) % pp;
    if (owner != pp_rank) continue;
    mdl::GPTModel& ch = *chunks[size_t(c)];
    if (vs > 0 && prev_owner != pp_rank) {
      x = Tensor::empty(ch.activation_shape(b, s), cfg.model.params_dtype, device, ctx.stream);
      ppc.batch_send_recv({{comm::P2POp::Recv, x, prev_owner}}, ctx.stream)->wait();
    }
    Tensor y = ch.forward_stage(ectx, vs == 0 ? Tensor() : x, tokens, labels, mask);
    if (ch.post_process()) {
      loss = y;
      if (loss_tokens) *loss_tokens = ch.last_loss_tokens();
    } else {
      x = y.contiguous(ctx.stream);
      const int next_owner = (vs + 1) % pp;
      if (next_owner != pp_rank) ppc.batch_send_recv({{comm::P2POp::Send, x, next_owner}}, ctx.stream)->wait();
    }
  }
  return loss;
}

double Trainer::Impl::evaluate(int64_t max_batches) {
  MC_CHECK(valid_src != nullptr, "Trainer.evaluate: no validation data was given");
  data::DataLoader vl(valid_src, loader_config(std::min(cfg.prefetch, 2)));  // short: a smaller pinned pool
  const int64_t steps = std::min(max_batches, vl.num_steps());
  MC_CHECK_AS(ConfigError, steps > 0, "the validation split holds less than one global batch ({} samples); give it "
              "more documents (data.split) or set trainer.val_check_interval = 0", cfg.global_batch_size);
  // [Σ loss·tokens, Σ tokens] on the last stage, summed over DP, then sent to everyone in the pipeline group.
  double sums[2] = {0, 0};
  for (int64_t k = 0; k < steps; ++k)
    for (const pipeline::MicroBatch& mb : next_micro_batches(vl)) {
      double n = 0;
      Tensor l = forward_only(mb, &n);
      if (l.defined()) {
        sums[0] += l.item() * n;
        sums[1] += n;
      }
    }
  Tensor t = Tensor::from_vector<float>({float(sums[0]), float(sums[1])}, {2}).to(device, ctx.stream);
  grid->dp_cp().all_reduce(t, comm::ReduceOp::Sum, ctx.stream)->wait();
  grid->pp().broadcast(t, grid->layout().pp_size() - 1, ctx.stream)->wait();
  const std::vector<double> v = t.to(Device::cpu(), ctx.stream).to_double_vector();
  return v[1] > 0 ? v[0] / v[1] : 0.0;
}

std::string Trainer::Impl::save() {
  MC_CHECK_AS(ConfigError, ckpt != nullptr, "Trainer.save: checkpoint.save_dir is empty; set it to save checkpoints");
  if (zero) zero->finish_param_gather();  // the weights are written as the last step left them
  checkpoint::CheckpointState st;
  st.step = step;
  st.tensors = model_tensors();
  if (zero) {
    // Each rank writes the ZeRO shard it owns (no gather); the pieces reshard on load like any other.
    const std::vector<checkpoint::ShardedTensor> params_only = st.tensors;
    for (auto& t : checkpoint::shard_zero_state(*zero, params_only, checkpoint::shard_layout(*grid)))
      st.tensors.push_back(std::move(t));
    st.json["optimizer"] = json{{"step", zero->step_count()}}.dump();
  } else {
    const std::vector<checkpoint::ShardedTensor> params_only = st.tensors;
    checkpoint::add_optimizer_state(st, *opt, params_only);
  }
  st.json["trainer"] = json{{"step", step}, {"consumed_samples", consumed_samples}, {"scheduler_steps",
                                                                                       sched->num_steps()}}.dump();
  if (scaler)
    st.json["loss_scaler"] = json{{"scale", scaler->state().scale},
                                  {"growth_tracker", scaler->state().growth_tracker},
                                  {"hysteresis_tracker", scaler->state().hysteresis_tracker}}.dump();
  st.json["recipe"] = cfg.recipe_json;
  ckpt->save(st);
  const std::string dir = checkpoint::checkpoint_dir(cfg.save_dir, step);
  last_checkpoint = dir;
  return dir;
}

checkpoint::CheckpointReader Trainer::Impl::load_model(const std::string& path) {
  std::optional<std::string> dir = checkpoint::resolve_checkpoint(path);
  MC_CHECK_AS(IOError, dir.has_value(), "no complete checkpoint at '{}'", path);
  std::vector<checkpoint::ShardedTensor> targets = model_tensors();
  return checkpoint::load_checkpoint(&world, *dir, targets);
}

void Trainer::Impl::load(const std::string& path, bool optimizer) {
  checkpoint::CheckpointReader reader = load_model(path);
  if (optimizer) load_training_state(reader);
}

void Trainer::Impl::load_training_state(checkpoint::CheckpointReader& reader) {
  // Only the parameters' shard mapping is needed here (the optimizer state is mapped like its parameter).
  const std::vector<checkpoint::ShardedTensor> targets = model_tensors();
  if (zero) {
    // Straight into the owned ranges of the live state, whatever layout wrote the checkpoint.
    std::vector<checkpoint::ShardedTensor> st = checkpoint::shard_zero_state(*zero, targets, checkpoint::shard_layout(*grid));
    reader.load_all(st);
    const json oj = json::parse(reader.json("optimizer"));
    zero->finish_load(oj.at("step").get<int64_t>());
  } else {
    checkpoint::load_optimizer_state(reader, *opt, targets);
  }
  const json tj = json::parse(reader.json("trainer"));
  step = tj.at("step").get<int64_t>();
  consumed_samples = tj.at("consumed_samples").get<int64_t>();
  sched->set_num_steps(tj.at("scheduler_steps").get<int64_t>());
  if (scaler && reader.json().count("loss_scaler")) {
    const json sj = json::parse(reader.json("loss_scaler"));
    optim::LossScalerState ls;
    ls.scale = sj.at("scale").get<double>();
    ls.growth_tracker = sj.at("growth_tracker").get<int64_t>();
    ls.hysteresis_tracker = sj.at("hysteresis_tracker").get<int>();
    scaler->load_state(ls);
  }
  if (loader) {  // a load after construction restarts the data at the saved position
    data::LoaderConfig lc = loader->config();
    lc.consumed_samples = consumed_samples;
    loader.reset();
    loader = std::make_unique<data::DataLoader>(train_src, lc);
  }
}

Trainer::Trainer(const TrainConfig& cfg, comm::Communicator& world, std::shared_ptr<const data::SampleSource> train,
                 std::shared_ptr<const data::SampleSource> valid)
    : impl_(std::make_unique<Impl>(cfg, world, std::move(train), std::move(valid))) {
  impl_->build();
}

Trainer::~Trainer() = default;

TrainResult Trainer::fit() {
  Impl& I = *impl_;
  TrainResult r;
  r.start_step = I.step;
  if (I.root && I.step > 0) std::printf("resumed at step %lld (%lld samples consumed)\n", (long long)I.step,
                                        (long long)I.consumed_samples);
  const int64_t end = I.cfg.stop_after_steps > 0 ? std::min(I.cfg.max_steps, I.step + I.cfg.stop_after_steps)
                                                 : I.cfg.max_steps;
  while (I.step < end) {
    StepMetrics m = I.train_step();
    r.history.push_back(m);
    I.log(m);
    if (I.step_cb) I.step_cb(m);
    std::optional<double> val;
    if (I.valid_src && I.cfg.val_check_interval > 0 && I.step % I.cfg.val_check_interval == 0) {
      val = I.evaluate(I.cfg.limit_val_batches);
      r.val_losses.emplace_back(I.step, *val);
      if (I.root) {
        std::printf("step %lld | validation loss %.4f\n", (long long)I.step, *val);
        std::fflush(stdout);
        if (I.jsonl) I.jsonl->write(json{{"step", I.step}, {"val_loss", *val}}.dump());
        if (I.tb) I.tb->add_scalars(I.step, {{"val/loss", *val}});
      }
    }
    if (I.ckpt && (I.ckpt->should_save(I.step) || (I.cfg.save_last && I.step == end))) {
      I.save();
      if (I.root) {
        std::printf("step %lld | checkpoint %s\n", (long long)I.step, I.last_checkpoint.c_str());
        std::fflush(stdout);
      }
    }
  }
  if (I.zero) I.zero->finish_param_gather();  // the caller may read the parameters next
  if (I.ckpt) I.ckpt->wait();
  r.final_step = I.step;
  r.last_checkpoint = I.last_checkpoint;
  return r;
}

double Trainer::evaluate(int64_t max_batches) { return impl_->evaluate(max_batches); }

std::vector<int64_t> Trainer::generate(const std::vector<int64_t>& prompt, int64_t n) {
  Impl& I = *impl_;
  MC_CHECK(!prompt.empty(), "Trainer.generate: the prompt is empty; give at least one token id");
  const int tp = I.grid->layout().tp_size(), pp = I.grid->layout().pp_size();
  std::vector<int64_t> ids = prompt;
  const int64_t vocab = I.cfg.model.vocab_size;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t len = int64_t(ids.size());
    MC_CHECK(len <= I.cfg.model.max_position_embeddings, "Trainer.generate: {} tokens exceed max_position_embeddings {}",
             len, I.cfg.model.max_position_embeddings);
    // Sequence parallelism splits the sequence over TP: pad on the right (causal attention never looks ahead).
    const int64_t s = I.cfg.model.sequence_parallel ? (len + tp - 1) / tp * tp : len;
    std::vector<int64_t> tok(size_t(s), 0);
    std::copy(ids.begin(), ids.end(), tok.begin());
    Tensor tokens = Tensor::from_vector<int64_t>(tok, {1, s}).to(I.device, I.ctx.stream);
    Tensor labels = Tensor::zeros({1, s}, DType::I64, I.device, I.ctx.stream);
    Tensor loss = I.forward_only({tokens, labels, Tensor()}, nullptr);
    Tensor next = Tensor::zeros({1}, DType::I64, I.device, I.ctx.stream);
    if (loss.defined()) {
      // The logits of the last prompt position, gathered over the vocabulary shards.
      mdl::GPTModel& last = *I.chunks.back();
      Tensor row = last.logits().narrow(1, len - 1, 1).contiguous(I.ctx.stream).view({-1});
      Tensor full = parallel::all_gather_along(I.grid->tp(), row.to(DType::F32, I.ctx.stream), 0, I.ctx.stream);
      const std::vector<double> v = full.to(Device::cpu(), I.ctx.stream).to_double_vector();
      const int64_t best = int64_t(std::max_element(v.begin(), v.begin() + vocab) - v.begin());
      next = Tensor::from_vector<int64_t>({best}, {1}).to(I.device, I.ctx.stream);
    }
    I.grid->pp().broadcast(next, pp - 1, I.ctx.stream)->wait();
    ids.push_back(next.to(Device::cpu(), I.ctx.stream).to_double_vector()[0]);
  }
  return std::vector<int64_t>(ids.begin() + int64_t(prompt.size()), ids.end());
}

std::string Trainer::save() { return impl_->save(); }
void Trainer::load(const std::string& path, bool optimizer) { impl_->load(path, optimizer); }
int64_t Trainer::step() const { return impl_->step; }
const parallel::ProcessGrid& Trainer::grid() const { return *impl_->grid; }
void Trainer::set_step_callback(std::function<void(const StepMetrics&)> cb) { impl_->step_cb = std::move(cb); }

}  // namespace megacore::train
