#include "megacore/train/trainer.hpp"
#include "megacore/train/training_state.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

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
#include "megacore/parallel/context_parallel.hpp"
#include "megacore/parallel/mappings.hpp"
#include "megacore/pipeline/engine.hpp"
#include "megacore/pipeline/layout.hpp"
#include "megacore/train/stop_signal.hpp"
#include "megacore/train/watchdog.hpp"

namespace megacore::train {

namespace fs = std::filesystem;
using json = nlohmann::json;
namespace ly = megacore::layers;
namespace mdl = megacore::model;

// ---------------------------------------------------------------------------------------------------
// Trainer

namespace {

// Rewrites a metrics.jsonl keeping the rows of steps <= `step` (atomically: a crash leaves the old file).
void drop_rows_after(const fs::path& path, int64_t step) {
  std::ifstream in(path);
  std::string line, kept;
  bool dropped = false;
  while (std::getline(in, line)) {
    bool keep = true;
    try {
      const json j = json::parse(line);
      keep = !j.contains("step") || j["step"].get<int64_t>() <= step;
    } catch (const json::exception&) {
      keep = true;  // not ours to judge: leave a line we cannot read as it is
    }
    if (keep) kept += line + "\n";
    dropped |= !keep;
  }
  in.close();
  if (!dropped) return;
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << kept;
    MC_CHECK_AS(IOError, out.good(), "cannot rewrite {} (disk full?)", tmp.string());
  }
  fs::rename(tmp, path);
}

// Fault injection for the resilience tests, never for production: MEGACORE_TEST_SAVE_DELAY=<point>:<seconds> makes
// every rank sleep at that point of each checkpoint save (checkpoint::SaveOptions::fault_hook's points, e.g.
// shard_written), so a test can kill a rank while a save is half written.
std::function<void(const std::string&)> save_delay_hook() {
  const char* v = std::getenv("MEGACORE_TEST_SAVE_DELAY");
  if (!v || !*v) return {};
  const std::string spec = v;
  const size_t colon = spec.rfind(':');
  MC_CHECK_AS(ConfigError, colon != std::string::npos && colon > 0,
              "MEGACORE_TEST_SAVE_DELAY='{}' is not <point>:<seconds> (e.g. shard_written:3); unset it", spec);
  const std::string point = spec.substr(0, colon);
  const double seconds = std::stod(spec.substr(colon + 1));
  return [point, seconds](const std::string& at) {
    if (at == point) std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  };
}

}  // namespace

struct Trainer::Impl {
  RunConfig cfg;
  mdl::TransformerConfig mcfg;  // the model as the layers see it (precision resolved for the device)
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
  TrainingState state;  // step, data position, loss average (saved with checkpoints; train/training_state.hpp)
  int64_t num_micro = 1;
  double peak = 0;
  std::string last_checkpoint;
  bool root = false;

  Impl(const RunConfig& c, comm::Communicator& w, std::shared_ptr<const data::SampleSource> tr,
       std::shared_ptr<const data::SampleSource> va)
      : cfg(c), world(w), train_src(std::move(tr)), valid_src(std::move(va)) {}

  int dp() const { return grid->layout().dp_size(); }
  bool is_cuda() const { return device.is_cuda(); }

  void build();
  void build_optimizer();
  /// Prints "trainable of total parameters" (model-wide: summed over TP and PP, replicated ones once). Collective.
  void log_trainable_parameters();
  std::vector<checkpoint::ShardedTensor> model_tensors() const;
  std::vector<pipeline::MicroBatch> next_micro_batches(data::DataLoader& l);
  StepMetrics train_step();
  void log(const StepMetrics& m);
  /// Marks and reports a non-finite loss / gradient norm (and ends the run when on_nonfinite = stop) and a
  /// loss spike. Every rank holds the same loss and norm, so every rank decides alike.
  void check_numerics(StepMetrics& m);
  /// Gathers every rank's compute time and reports the stragglers (trainer.straggler_factor). Collective.
  void check_stragglers(StepMetrics& m);
  /// The largest stop signal any rank has seen (0: none), by an all-reduce over the world. Collective.
  int agree_stop();
  double evaluate(int64_t max_batches);
  Tensor forward_only(const pipeline::MicroBatch& mb, double* loss_tokens);
  data::LoaderConfig loader_config(int prefetch) const;
  /// `val_loss`: this step's validation loss, recorded with the checkpoint (checkpoint.keep_top_k ranks by it).
  std::string save(std::optional<double> val_loss = std::nullopt);
  void load(const std::string& path, bool optimizer);
  /// Resolves `path` and loads the model's parameters; the reader serves load_training_state.
  checkpoint::CheckpointReader load_model(const std::string& path);
  /// Optimizer state, step, scheduler, loss scaler and data position from an open checkpoint.
  void load_training_state(checkpoint::CheckpointReader& reader);
  /// Last member: stopped first, before anything it watches is torn down.
  std::unique_ptr<Watchdog> watchdog;
  void watch(WatchPhase p, int64_t at_step) {
    if (watchdog) watchdog->enter(p, at_step);
  }
  void start_watchdog();
};

void Trainer::Impl::start_watchdog() {
  const TrainerSection& t = cfg.trainer;
  if (t.startup_timeout_s <= 0 && t.first_step_timeout_s <= 0 && t.step_timeout_s <= 0 && t.save_timeout_s <= 0)
    return;
  WatchdogOptions o;
  o.startup_timeout_s = t.startup_timeout_s;
  o.first_step_timeout_s = t.first_step_timeout_s;
  o.step_timeout_s = t.step_timeout_s;
  o.save_timeout_s = t.save_timeout_s;
  o.rank = world.world_ranks()[size_t(world.rank())];
  o.world_size = world.size();
  const char* job_dir = std::getenv("MEGACORE_JOB_DIR");  // megacore.launch's folder for the job's reports
  const char* attempt = std::getenv("MEGACORE_RESTART");
  o.job_dir = job_dir ? job_dir : "";
  o.attempt = attempt && *attempt ? attempt : "0";
  // NCCL communicators are aborted so no kernel keeps waiting on the peers; MPI ranks end through MPI_Abort
  // (the MPI backend is not to be used from a second thread).
  if (world.backend() == comm::Backend::NCCL) o.abort = [this] { world.abort(); };
  watchdog = std::make_unique<Watchdog>(std::move(o));
}

void Trainer::Impl::build() {
  root = world.rank() == 0;
  // Device: GPUs when the world communicator runs on them.
  const bool want_cuda = cfg.trainer.device == "cuda" || (cfg.trainer.device == "auto" && world.backend() == comm::Backend::NCCL);
  MC_CHECK_AS(ConfigError, !want_cuda || world.backend() == comm::Backend::NCCL,
              "trainer.device is cuda but the world communicator is {} (CPU); launch with GPUs visible "
              "(python -m megacore.launch without --cpu) or set trainer.device = cpu",
              comm::backend_name(world.backend()));
  MC_CHECK_AS(ConfigError, want_cuda || world.backend() == comm::Backend::MPI,
              "trainer.device is cpu but the world communicator is NCCL; launch CPU ranks (--cpu) or set device auto");
  mcfg = cfg.transformer_config(want_cuda);
  const mdl::TransformerConfig& m = mcfg;
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

  parallel::ParallelConfig pc = cfg.grid_config();
  grid = std::make_unique<parallel::ProcessGrid>(world, pc);
  const int pp = pc.pipeline, vp = pc.virtual_pipeline;
  const ParallelSection& ps = cfg.parallel;
  const bool balance = ps.pipeline_embedding_cost != 0 || ps.pipeline_head_cost != 0;
  layout = std::make_unique<pipeline::PipelineLayout>(
      !ps.pipeline_layout.empty()
          ? pipeline::PipelineLayout::from_counts(m.num_layers, pp, vp, ps.pipeline_layout)
          : balance ? pipeline::PipelineLayout::balanced(m.num_layers, pp, vp,
                                                         {ps.pipeline_embedding_cost, ps.pipeline_head_cost})
                    : pipeline::PipelineLayout::uniform(m.num_layers, pp, vp));
  num_micro = pipeline::num_microbatches(cfg.data.global_batch_size, cfg.data.micro_batch_size, dp());
  MC_CHECK_AS(ConfigError, train_src != nullptr, "Trainer: no training data given");
  MC_CHECK_AS(ConfigError, train_src->seq_length() == cfg.data.seq_length,
              "the training data has rows of {} tokens but data.seq_length is {}; rebuild the dataset for {}",
              train_src->seq_length(), cfg.data.seq_length, cfg.data.seq_length);

  const int pp_rank = grid->pp_rank();
  for (int c = 0; c < vp; ++c) {
    mdl::GPTModelOptions o;
    o.device = device;
    o.layer_indices = layout->layer_indices(pp_rank, c);
    o.pre_process = layout->has_embedding(pp_rank, c);
    o.post_process = layout->has_head(pp_rank, c);
    o.cp = &grid->cp();
    o.cp_comm_type = cfg.parallel.cp_comm_type == "all_gather" ? ly::CpCommType::AllGather : ly::CpCommType::P2P;
    chunks.push_back(std::make_unique<mdl::GPTModel>(m, grid->tp(), o));
  }
  const CheckpointSection& cks = cfg.checkpoint;
  const bool lora = cfg.peft.scheme == "lora";
  if (lora) {
    // The frozen base first (its full weights), then the adapters: from here on the model's parameters(),
    // and so DDP, the optimizer and checkpoints, are the adapters only.
    load_model(cks.pretrained_checkpoint);
    for (auto& ch : chunks) ch->apply_lora(cfg.peft.lora(m.seed));
    log_trainable_parameters();
  }
  for (auto& ch : chunks) {
    for (ly::Parameter* p : ch->parameters()) params.push_back(p);
    if (m.tie_word_embeddings && pp > 1 && !lora)
      if (ly::Parameter* t = ch->tied_embedding_weight()) tied.push_back(t);
  }
  if (cfg.trainer.max_epochs > 0) {
    // The run's length follows the data: every pass is rows // global_batch_size steps.
    const int64_t per_epoch = train_src->size() / cfg.data.global_batch_size;
    MC_CHECK_AS(ConfigError, per_epoch > 0,
                "trainer.max_epochs: the training data has {} rows, fewer than one global batch ({}); lower "
                "data.global_batch_size or give more examples",
                train_src->size(), cfg.data.global_batch_size);
    cfg.trainer.max_steps = cfg.trainer.max_epochs * per_epoch;
    optim::validate(cfg.lr_schedule());  // the warmup and decay against the length now known
    if (root)
      std::printf("megacore: %lld epoch(s) of %lld rows = %lld steps of %lld rows\n", (long long)cfg.trainer.max_epochs,
                  (long long)train_src->size(), (long long)cfg.trainer.max_steps,
                  (long long)cfg.data.global_batch_size);
  }
  sched = std::make_unique<optim::LRScheduler>(cfg.lr_schedule());
  if (m.params_dtype == DType::F16) {
    optim::LossScalerConfig lc;
    lc.initial_scale = cfg.optim.initial_loss_scale;
    scaler = std::make_unique<optim::DynamicLossScaler>(lc);
  }

  peak = cfg.trainer.peak_tflops > 0 ? cfg.trainer.peak_tflops : (is_cuda() ? known_peak_tflops(cuda_device_name(device.index)) : 0);
  if (!cks.save_dir.empty()) {
    checkpoint::CheckpointPolicy pol;
    pol.save_every = cks.save_interval;
    pol.keep_last = cks.keep_last;
    pol.keep_top_k = cks.keep_top_k;
    pol.async = cks.async_save;
    pol.save_options.fault_hook = save_delay_hook();
    ckpt = std::make_unique<checkpoint::CheckpointManager>(world, cks.save_dir, pol);
  }

  // Parameters come from a checkpoint before the optimizer copies them into its master weights.
  std::optional<std::string> resume_dir;
  if (cks.resume == "auto") {
    if (ckpt) resume_dir = ckpt->latest();
  } else if (!cks.resume.empty()) {
    resume_dir = checkpoint::resolve_checkpoint(cks.resume);
    MC_CHECK_AS(IOError, resume_dir.has_value(),
                "checkpoint.resume '{}' holds no complete checkpoint; give a step_<N> directory or a root with "
                "'latest', or set resume = '' to start fresh", cks.resume);
  }
  std::optional<checkpoint::CheckpointReader> resumed;
  if (resume_dir) {
    resumed.emplace(load_model(*resume_dir));
  } else if (!cks.pretrained_checkpoint.empty() && !lora) {
    // Fine-tuning: the weights of another run (or of a converted Hugging Face model); everything else fresh.
    load_model(cks.pretrained_checkpoint);
    if (root) {
      std::printf("megacore: weights from %s (step, optimizer, schedule and data start fresh)\n",
                  cks.pretrained_checkpoint.c_str());
      std::fflush(stdout);
    }
  }
  build_optimizer();
  // The training state is optional (a converted Hugging Face checkpoint has none): the optimizer starts fresh then.
  if (resumed && resumed->json().count("trainer")) load_training_state(*resumed);
  if (lora && root) {
    std::printf("megacore: LoRA base weights from %s%s\n", cks.pretrained_checkpoint.c_str(),
                resume_dir ? (", adapters from " + *resume_dir).c_str() : "");
    std::fflush(stdout);
  }

  pipeline::PipelineEngineOptions eo;
  eo.dp = &grid->dp_cp();
  if (m.tie_word_embeddings && pp > 1 && !lora) eo.embedding = &grid->embedding();
  eo.before_backward = [this](int, int64_t, bool last) { ddp->set_is_last_microbatch(last); };
  std::vector<mdl::GPTModel*> raw;
  for (auto& ch : chunks) raw.push_back(ch.get());
  engine = std::make_unique<pipeline::PipelineEngine>(grid->pp(), *layout, raw, eo);

  data::LoaderConfig lc = loader_config(cfg.data.prefetch);
  lc.consumed_samples = state.consumed_samples;
  // SFT rows are packed in bin order (longest examples first), so the loader shuffles them; pretraining
  // samples come shuffled by their dataset.
  lc.shuffle = !cfg.data.sft_path.empty();
  lc.seed = cfg.data.seed;
  lc.epochs = std::max<int64_t>(1, cfg.trainer.max_epochs);
  if (cfg.trainer.max_epochs == 0 && !cfg.data.sft_path.empty()) {
    // SFT rows are a fixed set: a run longer than one pass goes over them again, each pass reshuffled (as
    // pretraining datasets repeat their documents).
    const int64_t per_pass = train_src->size() / cfg.data.global_batch_size;
    if (per_pass > 0 && cfg.trainer.max_steps > per_pass) {
      lc.epochs = (cfg.trainer.max_steps + per_pass - 1) / per_pass;
      if (root)
        std::printf("megacore: trainer.max_steps %lld is more than the %lld steps of one pass over the SFT rows: "
                    "%lld passes, each reshuffled (trainer.max_epochs sets the length in passes instead)\n",
                    (long long)cfg.trainer.max_steps, (long long)per_pass, (long long)lc.epochs);
    }
  }
  loader = std::make_unique<data::DataLoader>(train_src, lc);
  // Validation needs one whole global batch: said now rather than at the first validation step.
  MC_CHECK_AS(ConfigError,
              !valid_src || cfg.trainer.val_check_interval == 0 || valid_src->size() >= cfg.data.global_batch_size,
              "the validation data has {} rows, fewer than one global batch ({}); give it more examples (a larger "
              "validation weight in data.split, or more data), lower data.global_batch_size, or set "
              "trainer.val_check_interval = 0",
              valid_src ? valid_src->size() : 0, cfg.data.global_batch_size);
  MC_CHECK_AS(ConfigError, loader->num_steps() >= cfg.trainer.max_steps,
              "the training data provides {} steps of {} samples but trainer.max_steps is {}; build the dataset with "
              "at least max_steps × global_batch_size = {} samples", loader->num_steps(), cfg.data.global_batch_size,
              cfg.trainer.max_steps, cfg.trainer.max_steps * cfg.data.global_batch_size);

  if (root) {
    std::printf("megacore: world %d = TP %d x PP %d (VP %d) x CP %d x DP %d on %s | %lld layers, %s | micro-batch %lld x "
                "%lld, %lld micro-batches per step | %s%s%s%s\n",
                world.size(), pc.tensor, pc.pipeline, pc.virtual_pipeline, pc.context, dp(),
                is_cuda() ? cuda_device_name(device.index).c_str() : "CPU", (long long)m.num_layers,
                std::string(dtype_name(m.params_dtype)).c_str(), (long long)cfg.data.micro_batch_size,
                (long long)cfg.data.seq_length, (long long)num_micro, zero ? "ZeRO-1" : cfg.optim.optimizer.c_str(),
                m.sequence_parallel ? " | SP" : "", m.tp_comm_overlap ? " | tp_comm_overlap" : "",
                ps.overlap_param_gather ? " | overlap_param_gather" : "");
    if (pc.pipeline > 1) {
      std::string counts;
      for (int64_t c : layout->counts()) counts += (counts.empty() ? "" : ", ") + std::to_string(c);
      std::printf("megacore: pipeline layout [%s] (layers per virtual stage, model order)%s\n", counts.c_str(),
                  balance ? " balanced for the embedding/head costs" : "");
    }
    std::fflush(stdout);
  }
  const LoggingSection& lg = cfg.logging;
  if (root && !lg.log_dir.empty()) {
    const fs::path jl = fs::path(lg.log_dir) / "metrics.jsonl";
    // Rows past the step this run resumed at were logged by a run whose later checkpoints are not being used
    // (it failed, or an earlier checkpoint was chosen): they are replaced, so every step appears once.
    if (lg.jsonl && fs::exists(jl)) drop_rows_after(jl, state.step);
    if (lg.jsonl) jsonl = std::make_unique<JsonlWriter>(jl.string());
    if (lg.tensorboard) tb = std::make_unique<TensorBoardWriter>((fs::path(lg.log_dir) / "tensorboard").string());
  }
}

void Trainer::Impl::log_trainable_parameters() {
  // One copy of the model is spread over the TP × PP ranks of DP rank 0 / CP rank 0; a TP-replicated
  // tensor is counted on TP rank 0 only.
  int64_t counts[2] = {0, 0};
  if (grid->dp_rank() == 0 && grid->cp_rank() == 0)
    for (auto& ch : chunks) {
      for (ly::Parameter* p : ch->all_parameters())
        if (p->partition_dim >= 0 || grid->tp_rank() == 0) counts[1] += p->data.numel();
      for (ly::Parameter* p : ch->parameters())
        if (p->partition_dim >= 0 || grid->tp_rank() == 0) counts[0] += p->data.numel();
    }
  Tensor t = Tensor::from_vector<int64_t>({counts[0], counts[1]}, {2}).to(device, ctx.stream);
  world.all_reduce(t, comm::ReduceOp::Sum, ctx.stream)->wait();
  const std::vector<double> v = t.to(Device::cpu(), ctx.stream).to_double_vector();
  if (root) {
    std::printf("megacore: LoRA r=%lld alpha=%g dropout=%g on [%s]: trainable %.0f of %.0f parameters (%.4f%%)\n",
                (long long)cfg.peft.dim, cfg.peft.alpha, cfg.peft.dropout,
                [&] {
                  std::string out;
                  for (const std::string& n : cfg.peft.target_modules) out += (out.empty() ? "" : " ") + n;
                  return out;
                }().c_str(),
                v[0], v[1], v[1] > 0 ? 100.0 * v[0] / v[1] : 0.0);
    std::fflush(stdout);
  }
}

void Trainer::Impl::build_optimizer() {
  const ParallelSection& ps = cfg.parallel;
  const OptimSection& os = cfg.optim;
  optim::DDPConfig dc;
  dc.bucket_size = ps.bucket_size;
  dc.overlap_grad_reduce = ps.overlap_grad_reduce;
  dc.use_distributed_optimizer = ps.use_distributed_optimizer;
  dc.reduce_dtype = ps.grad_reduce_in_bf16 ? DType::BF16 : DType::F32;
  dc.compute_stream = ctx.stream;
  for (auto& ch : chunks)
    if (ch->post_process() && ch->pre_process() && mcfg.tie_word_embeddings && !ch->has_lora())
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
  ac.beta1 = float(os.adam_beta1);
  ac.beta2 = float(os.adam_beta2);
  ac.eps = float(os.adam_eps);
  ac.weight_decay = float(os.weight_decay);
  if (ps.use_distributed_optimizer) {
    zero = std::make_unique<optim::DistributedOptimizer>(*ddp, ac, ps.overlap_param_gather);
    if (ps.overlap_param_gather)
      for (auto& ch : chunks)
        ch->set_pre_forward_callback([this](const std::vector<ly::Parameter*>& ps) { zero->wait_param_gather(ps); });
  } else if (os.optimizer == "adamw") {
    opt = std::make_unique<optim::AdamW>(params, ac);
  } else {
    optim::SGDConfig sc;
    sc.momentum = float(os.sgd_momentum);
    sc.weight_decay = float(os.weight_decay);
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
  lc.micro_batch_size = cfg.data.micro_batch_size;
  lc.global_batch_size = cfg.data.global_batch_size;
  lc.dp_rank = grid->dp_rank();
  lc.dp_size = dp();
  lc.device = device;
  lc.prefetch = prefetch;
  lc.vocab_size = mcfg.vocab_size;
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
    // Context parallelism: the CP ranks of a DP rank read the same samples; each keeps its two chunks of the
    // sequence (the engine then counts and reduces the loss tokens over DP×CP).
    if (grid->layout().cp_size() > 1) {
      const int cr = grid->cp_rank(), cn = grid->layout().cp_size();
      mb.tokens = parallel::cp_slice_sequence(mb.tokens, 1, cr, cn, ctx.stream);
      mb.labels = parallel::cp_slice_sequence(mb.labels, 1, cr, cn, ctx.stream);
      if (mb.loss_mask.defined()) mb.loss_mask = parallel::cp_slice_sequence(mb.loss_mask, 1, cr, cn, ctx.stream);
      // Packed rows: the positions are sliced like the tokens; cu_seqlens stays that of the full rows (the
      // ring attention intersects its segments with each chunk).
      if (mb.position_ids.defined())
        mb.position_ids = parallel::cp_slice_sequence(mb.position_ids, 1, cr, cn, ctx.stream);
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
  // Compute time for straggler reports: on GPUs by events (no host sync inside the step), on CPU by the clock.
  const bool time_compute = cfg.trainer.straggler_factor > 0;
  Event ev_begin(true), ev_compute(true);
  if (time_compute && is_cuda()) ev_begin.record(ctx.stream);
  pipeline::StepResult sr = engine->step(ctx, mbs, float(loss_scale));
  if (!tied.empty()) ddp->notify_grad_ready(tied);
  double compute_s = 0;
  if (time_compute && is_cuda()) ev_compute.record(ctx.stream);
  else if (time_compute) compute_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
  co.max_norm = cfg.optim.clip_grad;
  co.scaler = scaler.get();
  co.skip_nonfinite = cfg.optim.skip_nonfinite_steps;
  const double lr = sched->lr();
  const optim::StepResult st = zero ? optim::checked_step(*zero, lr, groups, co) : optim::checked_step(*opt, lr, groups, co);
  StepMetrics m;
  m.lr = lr;
  m.grad_norm = st.grad_norm;
  m.skipped = st.skipped;
  m.loss_scale = st.loss_scale;
  if (!st.skipped) sched->step();  // as Megatron-Core: a skipped step does not advance the schedule
  ++state.step;
  state.consumed_samples += cfg.data.global_batch_size;
  if (is_cuda()) ctx.stream.synchronize();
  if (time_compute && is_cuda()) compute_s = ev_begin.elapsed_ms(ev_compute) / 1e3;
  m.compute_seconds = compute_s;
  m.step = state.step;
  m.loss = sr.loss;
  m.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tokens = double(cfg.data.global_batch_size * cfg.data.seq_length);
  m.tokens_per_s = tokens / m.step_seconds;
  const mdl::FlopsPerToken f = mdl::flops_per_token(mcfg, cfg.data.seq_length, false);
  m.tflops_per_gpu = f.total * tokens / m.step_seconds / world.size() / 1e12;
  m.mfu = peak > 0 ? m.tflops_per_gpu / peak : 0;
  const MemoryStats ms = Allocator::get(device).stats();
  m.mem_allocated_gib = double(ms.allocated) / double(1 << 30);
  m.mem_peak_gib = double(ms.peak_allocated) / double(1 << 30);
  m.consumed_samples = double(state.consumed_samples);
  return m;
}

void Trainer::Impl::log(const StepMetrics& m) {
  if (!root) return;
  if (jsonl) jsonl->write(to_json(m));
  if (tb)
    tb->add_scalars(m.step, {{"train/loss", m.loss}, {"train/grad_norm", m.grad_norm}, {"train/lr", m.lr},
                             {"perf/tokens_per_s", m.tokens_per_s}, {"perf/tflops_per_gpu", m.tflops_per_gpu},
                             {"perf/mfu", m.mfu}, {"memory/peak_gib", m.mem_peak_gib}});
  if (m.step % cfg.trainer.log_interval != 0 && m.step != cfg.trainer.max_steps) return;
  // The launcher says whether its own output is a terminal (ranks under mpirun always get a pty).
  const char* launcher_tty = std::getenv("MEGACORE_STDOUT_IS_TTY");
  const bool tty = launcher_tty ? std::string_view(launcher_tty) == "1" : ::isatty(fileno(stdout)) != 0;
  const bool bar = cfg.logging.progress_bar == "on" || (cfg.logging.progress_bar == "auto" && tty);
  std::string line = fmt::format(
      "step {:>{}}/{} | loss {:.4f} | grad norm {:.3f} | lr {:.3e} | {:.1f}k tok/s | {:.2f} TFLOP/s/GPU | MFU {:.1f}% | "
      "mem {:.2f}/{:.2f} GiB | {:.3f} s/step{}",
      m.step, std::to_string(cfg.trainer.max_steps).size(), cfg.trainer.max_steps, m.loss, m.grad_norm, m.lr, m.tokens_per_s / 1e3,
      m.tflops_per_gpu, 100 * m.mfu, m.mem_allocated_gib, m.mem_peak_gib, m.step_seconds,
      (m.skipped ? " | SKIPPED (non-finite gradients)" : "") +
          (scaler ? fmt::format(" | loss scale {:g}", m.loss_scale) : std::string()));
  if (bar) {
    const int width = 20, done = int(width * m.step / std::max<int64_t>(1, cfg.trainer.max_steps));
    line += " [" + std::string(size_t(done), '#') + std::string(size_t(width - done), '.') + "]";
  }
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

// The engine's forward-only pass; with CP the model would count the whole sequence's tokens on every CP
// rank, and callers sum (loss · count) over DP×CP, so each rank counts its own tokens.
Tensor Trainer::Impl::forward_only(const pipeline::MicroBatch& mb, double* loss_tokens) {
  ly::ForwardContext ectx = ctx;
  ectx.training = false;
  if (grid->layout().cp_size() > 1) ectx.loss_tokens = mdl::count_loss_tokens(mb.labels, mb.loss_mask, -100, ctx.stream);
  return engine->forward_only(ectx, mb, loss_tokens);
}

void Trainer::Impl::check_numerics(StepMetrics& m) {
  const bool bad_loss = !std::isfinite(m.loss), bad_norm = !std::isfinite(m.grad_norm) && !scaler;
  if (bad_loss || bad_norm) {
    m.nonfinite = true;
    const std::string what = fmt::format("{}{}{} (loss {}, gradient norm {})", bad_loss ? "loss" : "",
                                         bad_loss && bad_norm ? " and " : "", bad_norm ? "gradient norm" : "", m.loss,
                                         m.grad_norm);
    if (root) {
      std::printf("megacore: step %lld: non-finite %s, the global values every rank holds; %s\n", (long long)m.step,
                  what.c_str(), m.skipped ? "the update was skipped" : "the update was applied "
                  "(optim.skip_nonfinite_steps = false)");
      std::fflush(stdout);
    }
    MC_CHECK_AS(ValueError, cfg.trainer.on_nonfinite != "stop",
                "step {}: non-finite {}; trainer.on_nonfinite = stop ended the run (checkpoints before this step are "
                "intact). Lower optim.lr or raise optim.lr_warmup_iters, check the data, or set "
                "trainer.on_nonfinite = skip to skip such steps", m.step, what);
    return;
  }
  const double f = cfg.trainer.loss_spike_factor;
  double& loss_avg = state.loss_avg;
  int64_t& loss_avg_n = state.loss_avg_n;
  if (f > 0 && loss_avg_n >= 10 && m.loss > f * loss_avg) {
    m.loss_spike = true;
    if (root) {
      std::printf("megacore: step %lld: loss spike: %.4f is %.1fx its moving average %.4f (trainer.loss_spike_factor "
                  "= %g)\n", (long long)m.step, m.loss, m.loss / loss_avg, loss_avg, f);
      std::fflush(stdout);
    }
  }
  loss_avg = loss_avg_n == 0 ? m.loss : 0.9 * loss_avg + 0.1 * m.loss;
  ++loss_avg_n;
}

void Trainer::Impl::check_stragglers(StepMetrics& m) {
  Tensor mine = Tensor::from_vector<float>({float(m.compute_seconds)}, {1}).to(device, ctx.stream);
  Tensor all = Tensor::empty({int64_t(world.size())}, DType::F32, device, ctx.stream);
  world.all_gather(mine, all, ctx.stream)->wait();
  m.rank_compute_seconds = all.to(Device::cpu(), ctx.stream).to_double_vector();
  std::vector<double> sorted = m.rank_compute_seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[(sorted.size() - 1) / 2];  // the lower median: with 2 ranks, the faster one
  const double f = cfg.trainer.straggler_factor;
  std::string slow;
  for (int r = 0; r < int(sorted.size()); ++r) {
    const double t = m.rank_compute_seconds[size_t(r)];
    if (median > 0 && t > f * median) {
      m.stragglers.push_back(r);
      slow += fmt::format("{}rank {} {:.3f} s ({:.1f}x)", slow.empty() ? "" : ", ", r, t, t / median);
    }
  }
  if (root && !slow.empty()) {
    std::printf("megacore: step %lld: stragglers: %s; median compute %.3f s (trainer.straggler_factor = %g)\n",
                (long long)m.step, slow.c_str(), median, f);
    std::fflush(stdout);
  }
}

int Trainer::Impl::agree_stop() {
  Tensor t = Tensor::from_vector<float>({float(stop_requested())}, {1}).to(device, ctx.stream);
  world.all_reduce(t, comm::ReduceOp::Max, ctx.stream)->wait();
  return int(t.to(Device::cpu(), ctx.stream).to_double_vector()[0]);
}

double Trainer::Impl::evaluate(int64_t max_batches) {
  MC_CHECK(valid_src != nullptr, "Trainer.evaluate: no validation data was given");
  data::DataLoader vl(valid_src, loader_config(std::min(cfg.data.prefetch, 2)));  // short: a smaller pinned pool
  const int64_t steps = std::min(max_batches, vl.num_steps());
  MC_CHECK_AS(ConfigError, steps > 0, "the validation split holds less than one global batch ({} samples); give it "
              "more documents (data.split) or set trainer.val_check_interval = 0", cfg.data.global_batch_size);
  // [Σ loss·tokens, Σ tokens] on the last stage, summed over DP, then sent to everyone in the pipeline group.
  double sums[2] = {0, 0};
  for (int64_t k = 0; k < steps; ++k)
    for (const pipeline::MicroBatch& mb : next_micro_batches(vl)) {
      if (watchdog) watchdog->beat();
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

std::string Trainer::Impl::save(std::optional<double> val_loss) {
  MC_CHECK_AS(ConfigError, ckpt != nullptr, "Trainer.save: checkpoint.save_dir is empty; set it to save checkpoints");
  if (zero) zero->finish_param_gather();  // the weights are written as the last step left them
  checkpoint::CheckpointState st;
  st.step = state.step;
  st.val_loss = val_loss;
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
  state.scheduler_steps = sched->num_steps();
  state.loss_scaler = scaler ? std::optional(scaler->state()) : std::nullopt;
  state.write(st.json);
  st.json["recipe"] = to_json(cfg);
  ckpt->save(st);
  const std::string dir = checkpoint::checkpoint_dir(cfg.checkpoint.save_dir, state.step);
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
  state = TrainingState::read(reader.json());
  sched->set_num_steps(state.scheduler_steps);
  if (scaler && state.loss_scaler) scaler->load_state(*state.loss_scaler);
  if (loader) {  // a load after construction restarts the data at the saved position
    data::LoaderConfig lc = loader->config();
    lc.consumed_samples = state.consumed_samples;
    loader.reset();
    loader = std::make_unique<data::DataLoader>(train_src, lc);
  }
}

Trainer::Trainer(const RunConfig& cfg, comm::Communicator& world, std::shared_ptr<const data::SampleSource> train,
                 std::shared_ptr<const data::SampleSource> valid)
    : impl_(std::make_unique<Impl>(cfg, world, std::move(train), std::move(valid))) {
  // The one validation of the run as a whole (files are the launcher's to check: the data arrives here as
  // sample sources); the parts built below check only their own invariants.
  check(cfg, world.size(), {.check_paths = false});
  impl_->start_watchdog();  // phase start-up: building the model, loading a checkpoint
  impl_->build();
  impl_->watch(WatchPhase::Idle, impl_->state.step);  // a trainer that waits for its caller is not hung
}

Trainer::~Trainer() = default;

TrainResult Trainer::fit() {
  Impl& I = *impl_;
  TrainResult r;
  r.start_step = I.state.step;
  if (I.root && I.state.step > 0) std::printf("resumed at step %lld (%lld samples consumed)\n", (long long)I.state.step,
                                        (long long)I.state.consumed_samples);
  const TrainerSection& ts = I.cfg.trainer;
  const int64_t end = ts.stop_after_steps > 0 ? std::min(ts.max_steps, I.state.step + ts.stop_after_steps) : ts.max_steps;
  // However fit() ends (an exception a caller may catch included), the time after it is not a step.
  struct Unwatch {
    Impl& i;
    ~Unwatch() { i.watch(WatchPhase::Idle, i.state.step); }
  } unwatch{I};
  bool first = true;
  while (I.state.step < end) {
    I.watch(first ? WatchPhase::FirstStep : WatchPhase::Step, I.state.step + 1);
    first = false;
    StepMetrics m = I.train_step();
    if (I.watchdog) I.watchdog->beat();
    I.check_numerics(m);
    if (ts.straggler_factor > 0) I.check_stragglers(m);
    r.history.push_back(m);
    I.log(m);
    if (I.step_cb) I.step_cb(m);
    std::optional<double> val;
    if (I.valid_src && ts.val_check_interval > 0 && I.state.step % ts.val_check_interval == 0) {
      val = I.evaluate(ts.limit_val_batches);
      r.val_losses.emplace_back(I.state.step, *val);
      if (I.root) {
        std::printf("step %lld | validation loss %.4f\n", (long long)I.state.step, *val);
        std::fflush(stdout);
        if (I.jsonl) I.jsonl->write(json{{"step", I.state.step}, {"val_loss", *val}}.dump());
        if (I.tb) I.tb->add_scalars(I.state.step, {{"val/loss", *val}});
      }
    }
    // Agreed before the checkpoint decision, so a stop saves this step's state once.
    const int stop = I.state.step < end ? I.agree_stop() : 0;
    if (I.ckpt && (stop != 0 || I.ckpt->should_save(I.state.step) || (I.cfg.checkpoint.save_last && I.state.step == end))) {
      I.watch(WatchPhase::Save, I.state.step);
      I.save(val);
      I.watch(WatchPhase::Step, I.state.step);
      if (I.root) {
        std::printf("step %lld | checkpoint %s\n", (long long)I.state.step, I.last_checkpoint.c_str());
        std::fflush(stdout);
      }
    }
    if (stop != 0) {
      r.stopped_by_signal = stop;
      if (I.root) {
        std::printf("megacore: stopping after step %lld on signal %d (%s)%s\n", (long long)I.state.step, stop,
                    strsignal(stop), I.ckpt ? "; resume from the checkpoint above" : "; checkpoint.save_dir is "
                    "empty, so nothing was saved");
        std::fflush(stdout);
      }
      break;
    }
  }
  if (I.zero) I.zero->finish_param_gather();  // the caller may read the parameters next
  I.watch(WatchPhase::Save, I.state.step);
  if (I.ckpt) I.ckpt->wait();
  r.final_step = I.state.step;
  r.last_checkpoint = I.last_checkpoint;
  return r;
}

double Trainer::evaluate(int64_t max_batches) { return impl_->evaluate(max_batches); }

std::vector<int64_t> Trainer::generate(const std::vector<int64_t>& prompt, int64_t n) {
  Impl& I = *impl_;
  MC_CHECK(!prompt.empty(), "Trainer.generate: the prompt is empty; give at least one token id");
  const int tp = I.grid->layout().tp_size(), pp = I.grid->layout().pp_size();
  std::vector<int64_t> ids = prompt;
  const int64_t vocab = I.mcfg.vocab_size;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t len = int64_t(ids.size());
    MC_CHECK(len <= I.mcfg.max_position_embeddings, "Trainer.generate: {} tokens exceed max_position_embeddings {}",
             len, I.mcfg.max_position_embeddings);
    // Sequence parallelism splits the sequence over TP and context parallelism into 2·CP chunks: pad on the
    // right (causal attention never looks ahead).
    const int cpn = I.grid->layout().cp_size(), cpr = I.grid->cp_rank();
    const int64_t unit = (I.mcfg.sequence_parallel ? tp : 1) * (cpn > 1 ? 2 * cpn : 1);
    const int64_t s = (len + unit - 1) / unit * unit;
    std::vector<int64_t> tok(size_t(s), 0);
    std::copy(ids.begin(), ids.end(), tok.begin());
    Tensor tokens = Tensor::from_vector<int64_t>(tok, {1, s}).to(I.device, I.ctx.stream);
    Tensor labels = Tensor::zeros({1, s}, DType::I64, I.device, I.ctx.stream);
    tokens = parallel::cp_slice_sequence(tokens, 1, cpr, cpn, I.ctx.stream);
    labels = parallel::cp_slice_sequence(labels, 1, cpr, cpn, I.ctx.stream);
    // The CP rank holding the last prompt position, and that position's index in its local sequence.
    int owner = 0;
    int64_t local = len - 1;
    if (cpn > 1) {
      const int64_t c = s / (2 * cpn), chunk = (len - 1) / c;
      owner = int(chunk < cpn ? chunk : 2 * cpn - 1 - chunk);
      local = (chunk < cpn ? 0 : c) + (len - 1) % c;
    }
    Tensor loss = I.forward_only({tokens, labels, Tensor()}, nullptr);
    Tensor next = Tensor::zeros({1}, DType::I64, I.device, I.ctx.stream);
    if (loss.defined() && cpr == owner) {
      // The logits of the last prompt position, gathered over the vocabulary shards.
      mdl::GPTModel& last = *I.chunks.back();
      Tensor row = last.logits().narrow(1, local, 1).contiguous(I.ctx.stream).view({-1});
      Tensor full = parallel::all_gather_along(I.grid->tp(), row.to(DType::F32, I.ctx.stream), 0, I.ctx.stream);
      const std::vector<double> v = full.to(Device::cpu(), I.ctx.stream).to_double_vector();
      const int64_t best = int64_t(std::max_element(v.begin(), v.begin() + vocab) - v.begin());
      next = Tensor::from_vector<int64_t>({best}, {1}).to(I.device, I.ctx.stream);
    }
    if (cpn > 1) I.grid->cp().broadcast(next, owner, I.ctx.stream)->wait();
    I.grid->pp().broadcast(next, pp - 1, I.ctx.stream)->wait();
    ids.push_back(next.to(Device::cpu(), I.ctx.stream).to_double_vector()[0]);
  }
  return std::vector<int64_t>(ids.begin() + int64_t(prompt.size()), ids.end());
}

std::string Trainer::save() { return impl_->save(); }
void Trainer::load(const std::string& path, bool optimizer) { impl_->load(path, optimizer); }
int64_t Trainer::step() const { return impl_->state.step; }
const parallel::ProcessGrid& Trainer::grid() const { return *impl_->grid; }
void Trainer::set_step_callback(std::function<void(const StepMetrics&)> cb) { impl_->step_cb = std::move(cb); }

}  // namespace megacore::train
