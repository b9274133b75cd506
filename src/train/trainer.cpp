#include "megacore/train/trainer.hpp"
#include "megacore/train/builder.hpp"
#include "megacore/train/training_state.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
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
#include "megacore/core/host_sync.hpp"
#include "megacore/data/loader.hpp"
#include "megacore/core/log.hpp"
#include "megacore/model/fp8.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/optim/distributed_data_parallel.hpp"
#include "megacore/optim/distributed_optimizer.hpp"
#include "megacore/optim/grad_clip.hpp"
#include "megacore/optim/loss_scaler.hpp"
#include "megacore/optim/optimizer.hpp"
#include "megacore/parallel/context_parallel.hpp"
#include "megacore/parallel/mappings.hpp"
#include "megacore/pipeline/engine.hpp"
#include "core/cuda_backend.hpp"
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

// The start banner's recompute entry: "" without recompute, else its granularity and, for block recompute,
// how many layers of each chunk.
std::string recompute_text(const TrainerSection& t) {
  if (t.recompute == mdl::RecomputeGranularity::None) return "";
  std::string s = fmt::format(" | recompute {}", mdl::recompute_granularity_name(t.recompute));
  if (t.recompute == mdl::RecomputeGranularity::Full && t.recompute_num_layers >= 0)
    s += fmt::format(" (first {} layer{} per model chunk)", t.recompute_num_layers,
                     t.recompute_num_layers == 1 ? "" : "s");
  return s;
}

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
  RunConfig cfg;  // as resolved by the build (trainer.max_steps from trainer.max_epochs)
  comm::Communicator& world;
  std::shared_ptr<const data::SampleSource> train_src, valid_src;
  TrainingParts parts;  // device, grid, layout, chunks, optimizer groups, engine, loader (train/builder.hpp)
  ly::ForwardContext ctx;
  std::unique_ptr<checkpoint::CheckpointManager> ckpt;
  std::unique_ptr<TensorBoardWriter> tb;
  std::unique_ptr<JsonlWriter> jsonl;
  std::function<void(const StepMetrics&)> step_cb;
  TrainingState state;  // step, data position, loss average (saved with checkpoints; train/training_state.hpp)
  int64_t num_micro = 1;
  double peak = 0;
  double moe_aux_loss = 0, moe_imbalance = 0;  // the last step's (MoE models)
  std::string last_checkpoint;
  bool root = false;
  bool fp8_gather_logged = false;

  Impl(const RunConfig& c, comm::Communicator& w, std::shared_ptr<const data::SampleSource> tr,
       std::shared_ptr<const data::SampleSource> va)
      : cfg(c), world(w), train_src(std::move(tr)), valid_src(std::move(va)) {}

  int dp() const { return parts.grid->layout().dp_size(); }
  bool is_cuda() const { return parts.placement.device.is_cuda(); }
  const Device& device() const { return parts.placement.device; }
  const mdl::TransformerConfig& mcfg() const { return parts.model; }
  parallel::ProcessGrid& grid() const { return *parts.grid; }
  /// ZeRO-1 (every group's optimizer is a DistributedOptimizer) or not.
  bool zero() const { return parts.optimizer.groups.front().zero != nullptr; }

  void build();
  StepMetrics train_step();
  void log(const StepMetrics& m);
  /// Marks and reports a non-finite loss / gradient norm (and ends the run when on_nonfinite = stop) and a
  /// loss spike. Every rank holds the same loss and norm, so every rank decides alike.
  void check_numerics(StepMetrics& m);
  /// Gathers every rank's compute time and reports the stragglers (trainer.straggler_factor). Collective.
  void check_stragglers(StepMetrics& m);
  /// The largest stop signal any rank has seen (0: none), by an all-reduce over the world. Collective; one
  /// host sync (the host decides on the checkpoint and the stop).
  int agree_stop();
  double evaluate(int64_t max_batches);
  Tensor forward_only(const pipeline::MicroBatch& mb, double* loss_tokens);
  /// `val_loss`: this step's validation loss, recorded with the checkpoint (checkpoint.keep_top_k ranks by it).
  std::string save(std::optional<double> val_loss = std::nullopt);
  /// The tensors and JSON a checkpoint of the current state holds (views of the live tensors).
  checkpoint::CheckpointState checkpoint_state(std::optional<double> val_loss);
  void load(const std::string& path, bool optimizer);
  /// Optimizer state, step, scheduler, loss scaler and (when `p` has a loader) data position from an open
  /// checkpoint into the parts `p` (this->parts, or those being built).
  void load_training_state(TrainingParts& p, checkpoint::CheckpointReader& reader);
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
  const CheckpointSection& cks = cfg.checkpoint;
  const bool lora = cfg.peft.scheme == "lora";
  BuildOptions bo;
  std::optional<std::string> resume_dir;
  std::optional<checkpoint::CheckpointReader> resumed;
  // Parameters come from a checkpoint before the optimizer copies them into its master weights.
  bo.before_optimizer = [&](TrainingParts& p) {
    const Device& dev = p.placement.device;
    peak = cfg.trainer.peak_tflops > 0 ? cfg.trainer.peak_tflops
                                       : (dev.is_cuda() ? known_peak_tflops(cuda_device_name(dev.index)) : 0);
    if (!cks.save_dir.empty()) {
      checkpoint::CheckpointPolicy pol;
      pol.save_every = cks.save_interval;
      pol.keep_last = cks.keep_last;
      pol.keep_top_k = cks.keep_top_k;
      pol.async = cks.async_save;
      pol.save_options.fault_hook = save_delay_hook();
      ckpt = std::make_unique<checkpoint::CheckpointManager>(world, cks.save_dir, pol);
    }
    if (cks.resume == "auto") {
      if (ckpt) resume_dir = ckpt->latest();
    } else if (!cks.resume.empty()) {
      resume_dir = checkpoint::resolve_checkpoint(cks.resume);
      MC_CHECK_AS(IOError, resume_dir.has_value(),
                  "checkpoint.resume '{}' holds no complete checkpoint; give a step_<N> directory or a root with "
                  "'latest', or set resume = '' to start fresh", cks.resume);
    }
    if (resume_dir) {
      resumed.emplace(load_model_weights(*p.grid, p.chunks, *resume_dir));
    } else if (!cks.pretrained_checkpoint.empty() && !lora) {
      // Fine-tuning: the weights of another run (or of a converted Hugging Face model); everything else fresh.
      load_model_weights(*p.grid, p.chunks, cks.pretrained_checkpoint, /*convert_dtype=*/true);
      if (root) {
        std::printf("megacore: weights from %s (step, optimizer, schedule and data start fresh)\n",
                    cks.pretrained_checkpoint.c_str());
        std::fflush(stdout);
      }
    }
  };
  bo.after_optimizer = [&](TrainingParts& p) {
    // The training state is optional (a converted Hugging Face checkpoint has none): the optimizer starts fresh.
    if (resumed && resumed->json().count("trainer")) load_training_state(p, *resumed);
    if (lora && root) {
      std::printf("megacore: LoRA base weights from %s%s\n", cks.pretrained_checkpoint.c_str(),
                  resume_dir ? (", adapters from " + *resume_dir).c_str() : "");
      std::fflush(stdout);
    }
    return state.consumed_samples;
  };
  bo.defer_step_reads = true;
  parts = build_training_parts(cfg, world, train_src, valid_src, bo);
  cfg = parts.cfg;
  ctx.stream = parts.placement.stream;
  num_micro = pipeline::num_microbatches(cfg.data.global_batch_size, cfg.data.micro_batch_size, dp());

  if (root) {
    const parallel::ParallelConfig pc = cfg.grid_config();
    const mdl::TransformerConfig& m = mcfg();
    const ParallelSection& ps = cfg.parallel;
    std::printf("megacore: world %d = TP %d x PP %d (VP %d) x CP %d x DP %d on %s | %lld layers, %s | micro-batch %lld x "
                "%lld, %lld micro-batches per step | %s%s%s%s%s%s\n",
                world.size(), pc.tensor, pc.pipeline, pc.virtual_pipeline, pc.context, dp(),
                is_cuda() ? cuda_device_name(device().index).c_str() : "CPU", (long long)m.num_layers,
                std::string(dtype_name(m.params_dtype)).c_str(), (long long)cfg.data.micro_batch_size,
                (long long)cfg.data.seq_length, (long long)num_micro,
                ps.use_distributed_optimizer ? "ZeRO-1" : cfg.optim.optimizer.c_str(),
                m.sequence_parallel ? " | SP" : "", m.tp_comm_overlap ? " | tp_comm_overlap" : "",
                m.tp_comm_overlap_forward ? " | tp_comm_overlap_forward" : "",
                ps.overlap_param_gather ? " | overlap_param_gather" : "", recompute_text(cfg.trainer).c_str());
    if (m.is_moe()) {
      // The expert layout (EP carved from DP x CP), as the grid built it.
      const parallel::GridLayout& gl = grid().layout();
      std::printf("megacore: MoE %lld experts (top-%lld, %lld of %lld layers), %s dispatcher | EP %d x expert-TP %d x "
                  "expert-DP %d per stage, %lld experts per EP rank\n",
                  (long long)m.num_moe_experts, (long long)m.moe_router_topk, (long long)m.num_moe_layers(),
                  (long long)m.num_layers, std::string(enum_name(m.moe_token_dispatcher_type)).c_str(), gl.ep_size(),
                  gl.expert_tp_size(), gl.expert_dp_size(), (long long)(m.num_moe_experts / gl.ep_size()));
    }
    if (cfg.trainer.fp8_param_gather)
      std::printf("megacore: fp8_param_gather: the FP8 linears' weights are all-gathered over DP as E4M3 codes%s\n",
                  dp() * pc.context > 1 ? "" : " (DP x CP = 1: nothing to gather)");
    if (pc.pipeline > 1) {
      const pipeline::StageCosts costs = cfg.pipeline_stage_costs();
      std::printf("megacore: pipeline %s%s\n", pipeline::describe_layout(*parts.layout, costs).c_str(),
                  !ps.pipeline_layout.empty()           ? " [parallel.pipeline_layout]"
                  : costs.embedding > 0 || costs.head > 0 ? " [balanced for the embedding/head costs]"
                                                          : " [even split]");
    }
    std::fflush(stdout);
  }
  // Async checkpoints: the snapshot buffers (page-locked for GPU tensors) are allocated now, so that no save, the
  // first included, blocks a step for more than its copies.
  if (ckpt && cks.async_save) {
    const int64_t held = ckpt->reserve(checkpoint_state(std::nullopt));
    if (root)
      std::printf("megacore: async checkpoints: %.2f GB of host snapshot buffers reserved on rank 0\n",
                  double(held) / 1e9);
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

StepMetrics Trainer::Impl::train_step() {
  const auto t0 = std::chrono::steady_clock::now();
  OptimizerParts& op = parts.optimizer;
  if (is_cuda()) Allocator::get(device()).reset_peak_stats();
  op.zero_grad();
  // FP8: the optimizer has changed the weights (drop their FP8 copies) and, with delayed scaling, the
  // last step's amaxes, reduced over the stage's TP × CP × DP ranks in one all-reduce, give this step's scales.
  if (cfg.trainer.fp8 != "none") {
    std::vector<mdl::GPTModel*> chunks;
    for (auto& ch : parts.chunks) chunks.push_back(ch.get());
    mdl::fp8_begin_step(chunks, grid().group(parallel::GroupKind::TpDpCp), ctx.stream);
    // trainer.fp8_param_gather: the FP8 weights the last optimizer step left ungathered, cast with this step's
    // scales by their owners and all-gathered as codes.
    const optim::Fp8GatherStats g = op.fp8_param_gather(grid().group(parallel::GroupKind::TpDpCp), ctx.stream);
    if (g.buckets > 0 && root && !fp8_gather_logged) {
      fp8_gather_logged = true;
      std::printf("megacore: fp8_param_gather: %lld FP8 weights in %lld buckets gathered as %lld bytes for %lld "
                  "elements (bf16: %lld bytes)\n",
                  (long long)g.weights, (long long)g.buckets, (long long)g.bytes, (long long)g.elements,
                  (long long)(2 * g.elements));
      std::fflush(stdout);
    }
  }
  std::vector<pipeline::MicroBatch> mbs = next_micro_batches(*parts.loader, grid(), ctx.stream);
  const double loss_scale = op.scaler ? op.scaler->scale() : 1.0;
  // Compute time for straggler reports: on GPUs by events (no host sync inside the step), on CPU by the clock.
  const bool time_compute = cfg.trainer.straggler_factor > 0;
  Event ev_begin(true), ev_compute(true);
  if (time_compute && is_cuda()) ev_begin.record(ctx.stream);
  // The MoE aux/z-loss gradients carry the LM loss's scaling: the loss scale over the micro-batches.
  for (auto& ch : parts.chunks) {
    ch->set_moe_aux_loss_grad_scale(float(loss_scale / double(mbs.size())));
    ch->reset_moe_step_stats(ctx.stream);
    ch->set_moe_routing_step(uint64_t(state.step), uint64_t(grid().dp_cp().rank()));
  }
  pipeline::StepResult sr = parts.engine->step(ctx, mbs, float(loss_scale));
  op.notify_tied_grads();
  double compute_s = 0;
  if (time_compute && is_cuda()) ev_compute.record(ctx.stream);
  else if (time_compute) compute_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  op.finish_grad_sync();
  comm::check_health();  // a TP/PP collective the NCCL watchdog aborted during the step (stream-ordered waits)

  // Norm (tied copies counted once), NaN/Inf check, clipping and the update in one place; with f16 the
  // gradients carry the loss scale, which checked_step divides out and adjusts.
  optim::GradNormGroups groups = optim::grad_norm_groups(grid(), zero(), mcfg().is_moe());
  groups.skip = [this](const ly::Parameter& p) {
    for (const auto& ch : parts.chunks)
      if (ch->is_tied_copy(p)) return true;
    return false;
  };
  optim::CheckedStepOptions co;
  co.max_norm = cfg.optim.clip_grad;
  co.scaler = op.scaler.get();
  co.skip_nonfinite = cfg.optim.skip_nonfinite_steps;
  // The step's one host sync: the gradient norm's read also brings the loss and the global token count
  // (the engine weighted the backward by a nominal count, corrected here through grad_scale), which the
  // clip and skip decisions, on_nonfinite, the loss-spike report and the log then use on the host
  // (docs/performance.md).
  co.read_along = {sr.device_sums.narrow(0, 0, 1), sr.device_sums.narrow(0, 1, 1)};
  const double nominal = sr.nominal_tokens;
  co.grad_scale_from_values = [nominal](const std::vector<double>& v) { return v[1] > 0 ? nominal / v[1] : 1.0; };
  const double lr = op.sched->lr();
  // Every group (dense, and expert for MoE) in one checked step: one norm, one clip, one skip decision.
  std::vector<optim::OptimizerPart> opt_parts;
  for (OptimizerGroup& g : op.groups) opt_parts.push_back({g.opt.get(), g.zero.get()});
  const optim::StepResult st = optim::checked_step(opt_parts, lr, groups, co);
  const double loss_sum = st.values[0], tokens_sum = st.values[1];
  if (mcfg().is_moe()) {
    // Aux-loss-free balancing moves the expert biases after the update (a no-op unless enabled).
    if (!st.skipped)
      for (auto& ch : parts.chunks) ch->update_expert_bias(grid().dp_cp(), ctx.stream);
    // The step's aux loss per MoE layer (mean over layers, micro-batches and DP × CP) and load imbalance.
    std::vector<mdl::GPTModel*> chunks;
    for (auto& ch : parts.chunks) chunks.push_back(ch.get());
    const mdl::MoEStepMetrics mm = mdl::moe_step_metrics(chunks, grid(), int64_t(mbs.size()), ctx.stream);
    moe_aux_loss = mm.aux_loss;
    moe_imbalance = mm.load_imbalance;
  }
  StepMetrics m;
  m.moe_aux_loss = moe_aux_loss;
  m.moe_load_imbalance = moe_imbalance;
  m.lr = lr;
  m.grad_norm = st.grad_norm;
  m.skipped = st.skipped;
  m.loss_scale = st.loss_scale;
  if (!st.skipped) op.sched->step();  // as Megatron-Core: a skipped step does not advance the schedule
  ++state.step;
  state.consumed_samples += cfg.data.global_batch_size;
  // The compute events were recorded before the norm's read, which waited for them. The step's time is
  // the host's: the optimizer's kernels may still run, and the next step's read waits for them.
  if (time_compute && is_cuda()) compute_s = ev_begin.elapsed_ms(ev_compute) / 1e3;
  m.compute_seconds = compute_s;
  m.step = state.step;
  m.loss = tokens_sum > 0 ? loss_sum / tokens_sum : 0.0;
  m.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double tokens = double(cfg.data.global_batch_size * cfg.data.seq_length);
  m.tokens_per_s = tokens / m.step_seconds;
  const mdl::FlopsPerToken f = mdl::flops_per_token(mcfg(), cfg.data.seq_length, false);
  m.tflops_per_gpu = f.total * tokens / m.step_seconds / world.size() / 1e12;
  m.mfu = peak > 0 ? m.tflops_per_gpu / peak : 0;
  const MemoryStats ms = Allocator::get(device()).stats();
  m.mem_allocated_gib = double(ms.allocated) / double(1 << 30);
  m.mem_peak_gib = double(ms.peak_allocated) / double(1 << 30);
  m.consumed_samples = double(state.consumed_samples);
  if (cfg.trainer.fp8 != "none" && root &&
      (state.step % cfg.trainer.log_interval == 0 || state.step == cfg.trainer.max_steps))
    for (auto& ch : parts.chunks)
      for (const mdl::Fp8LayerCounts& c : mdl::fp8_counts(*ch))
        m.fp8_counts.push_back({c.name, c.saturated[0] + c.saturated[1] + c.saturated[2],
                                c.flushed[0] + c.flushed[1] + c.flushed[2]});
  return m;
}

namespace {
// FP8 scaling state in checkpoints: every rank's own (amaxes differ over TP until their reduction at the next
// step, and over DP always). A layer lives on the world / PP ranks of one pipeline stage, so each tensor is
// stored as [world / PP, ...] with this rank's entry at its index within the stage (the rank order puts PP
// outermost), and a resume on the same layout continues exactly.
std::vector<checkpoint::ShardedTensor> fp8_tensors(const ModelChunks& chunks, const parallel::ProcessGrid& grid) {
  const int per_stage = grid.world().size() / grid.layout().pp_size(), index = grid.rank() % per_stage;
  MC_INTERNAL_ASSERT(grid.rank() / per_stage == grid.pp_rank(), "pipeline rank {} of world rank {} is not outermost",
                     grid.pp_rank(), grid.rank());
  std::vector<checkpoint::ShardedTensor> out;
  for (const auto& ch : chunks)
    for (auto& [name, t] : mdl::fp8_state(*ch)) {
      checkpoint::ShardedTensor st;
      st.name = "fp8_state." + name;
      st.global_shape = t.shape();
      st.global_shape.insert(st.global_shape.begin(), per_stage);
      st.dtype = t.dtype();
      st.local = t.unsqueeze(0);
      checkpoint::ShardPiece p;
      p.local_offsets = Shape(st.local.shape().size(), 0);
      p.global_offsets = p.local_offsets;
      p.global_offsets[0] = index;
      p.shape = st.local.shape();
      st.pieces.push_back(p);
      out.push_back(std::move(st));
    }
  return out;
}

// " | fp8 delayed: saturated N, flushed M" over rank 0's FP8 linears (empty without FP8 counts).
std::string fp8_summary(const StepMetrics& m) {
  if (m.fp8_counts.empty()) return {};
  int64_t sat = 0, flu = 0;
  for (const auto& c : m.fp8_counts) sat += c.saturated, flu += c.flushed;
  return fmt::format(" | fp8 saturated {} flushed {}", sat, flu);
}
}  // namespace

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
          (parts.optimizer.scaler ? fmt::format(" | loss scale {:g}", m.loss_scale) : std::string()) +
          (mcfg().is_moe() ? fmt::format(" | aux loss {:.4f} | load max/mean {:.2f}", m.moe_aux_loss, m.moe_load_imbalance)
                           : std::string()) +
          fp8_summary(m));
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
  if (grid().layout().cp_size() > 1) ectx.loss_tokens = mdl::count_loss_tokens(mb.labels, mb.loss_mask, -100, ctx.stream);
  return parts.engine->forward_only(ectx, mb, loss_tokens);
}

void Trainer::Impl::check_numerics(StepMetrics& m) {
  const bool bad_loss = !std::isfinite(m.loss), bad_norm = !std::isfinite(m.grad_norm) && !parts.optimizer.scaler;
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
  Tensor mine = Tensor::from_vector<float>({float(m.compute_seconds)}, {1}).to(device(), ctx.stream);
  Tensor all = Tensor::empty({int64_t(world.size())}, DType::F32, device(), ctx.stream);
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
  Tensor t = Tensor::from_vector<float>({float(stop_requested())}, {1}).to(device(), ctx.stream);
  world.all_reduce(t, comm::ReduceOp::Max, ctx.stream)->wait_on(ctx.stream);
  return int(read_scalar(t, ctx.stream, "stop_agreement"));
}

double Trainer::Impl::evaluate(int64_t max_batches) {
  MC_CHECK(valid_src != nullptr, "Trainer.evaluate: no validation data was given");
  // Short: a smaller pinned pool.
  data::DataLoader vl(valid_src, loader_config(cfg, mcfg(), grid(), device(), std::min(cfg.data.prefetch, 2)));  // short: a smaller pinned pool
  const int64_t steps = std::min(max_batches, vl.num_steps());
  MC_CHECK_AS(ConfigError, steps > 0, "the validation split holds less than one global batch ({} samples); give it "
              "more documents (data.split) or set trainer.val_check_interval = 0", cfg.data.global_batch_size);
  // [Σ loss·tokens, Σ tokens] on the last stage, summed over DP, then sent to everyone in the pipeline group.
  double sums[2] = {0, 0};
  for (int64_t k = 0; k < steps; ++k)
    for (const pipeline::MicroBatch& mb : next_micro_batches(vl, grid(), ctx.stream)) {
      if (watchdog) watchdog->beat();
      double n = 0;
      Tensor l = forward_only(mb, &n);
      if (l.defined()) {
        sums[0] += l.item() * n;
        sums[1] += n;
      }
    }
  Tensor t = Tensor::from_vector<float>({float(sums[0]), float(sums[1])}, {2}).to(device(), ctx.stream);
  grid().dp_cp().all_reduce(t, comm::ReduceOp::Sum, ctx.stream)->wait();
  grid().pp().broadcast(t, grid().layout().pp_size() - 1, ctx.stream)->wait();
  const std::vector<double> v = t.to(Device::cpu(), ctx.stream).to_double_vector();
  return v[1] > 0 ? v[0] / v[1] : 0.0;
}

std::string Trainer::Impl::save(std::optional<double> val_loss) {
  MC_CHECK_AS(ConfigError, ckpt != nullptr, "Trainer.save: checkpoint.save_dir is empty; set it to save checkpoints");
  parts.optimizer.finish_param_gather();  // the weights are written as the last step left them
  ckpt->save(checkpoint_state(val_loss));
  const std::string dir = checkpoint::checkpoint_dir(cfg.checkpoint.save_dir, state.step);
  last_checkpoint = dir;
  return dir;
}

checkpoint::CheckpointState Trainer::Impl::checkpoint_state(std::optional<double> val_loss) {
  checkpoint::CheckpointState st;
  st.step = state.step;
  st.val_loss = val_loss;
  st.tensors = model_tensors(grid(), parts.chunks);
  const std::vector<checkpoint::ShardedTensor> params_only = st.tensors;
  for (OptimizerGroup& g : parts.optimizer.groups) {  // dense, and expert for MoE: state named by parameter
    if (g.zero) {
      // Each rank writes the ZeRO shard it owns (no gather); the pieces reshard on load like any other.
      for (auto& t : checkpoint::shard_zero_state(*g.zero, params_only, checkpoint::shard_layout(grid())))
        st.tensors.push_back(std::move(t));
      st.json["optimizer"] = json{{"step", g.zero->step_count()}}.dump();
    } else {
      checkpoint::add_optimizer_state(st, *g.opt, params_only);
    }
  }
  state.scheduler_steps = parts.optimizer.sched->num_steps();
  state.loss_scaler = parts.optimizer.scaler ? std::optional(parts.optimizer.scaler->state()) : std::nullopt;
  for (auto& t : fp8_tensors(parts.chunks, grid())) st.tensors.push_back(std::move(t));
  for (auto& t : expert_bias_tensors(grid(), parts.chunks)) st.tensors.push_back(std::move(t));
  state.write(st.json);
  st.json["recipe"] = to_json(cfg);
  return st;
}

void Trainer::Impl::load(const std::string& path, bool optimizer) {
  checkpoint::CheckpointReader reader = load_model_weights(grid(), parts.chunks, path);
  if (optimizer) load_training_state(parts, reader);
}

void Trainer::Impl::load_training_state(TrainingParts& p, checkpoint::CheckpointReader& reader) {
  // Only the parameters' shard mapping is needed here (the optimizer state is mapped like its parameter).
  const std::vector<checkpoint::ShardedTensor> targets = model_tensors(*p.grid, p.chunks);
  // The reads first, ended by an agreement: a rank whose shard is damaged raises its error, every other rank a
  // PeerIOError naming it, before any rank goes on to a collective (ZeRO's parameter gather below, the first step).
  std::vector<int64_t> zero_steps;
  std::vector<checkpoint::ShardedTensor> fp8 = fp8_tensors(p.chunks, *p.grid);
  bool fp8_saved = false;
  std::exception_ptr err;
  try {
    for (OptimizerGroup& g : p.optimizer.groups) {
      if (g.zero) {
        // Straight into the owned ranges of the live state, whatever layout wrote the checkpoint.
        std::vector<checkpoint::ShardedTensor> st =
            checkpoint::shard_zero_state(*g.zero, targets, checkpoint::shard_layout(*p.grid));
        reader.load_all(st);
        const json oj = json::parse(reader.json("optimizer"));
        zero_steps.push_back(oj.at("step").get<int64_t>());
      } else {
        checkpoint::load_optimizer_state(reader, *g.opt, targets);
      }
    }
    fp8_saved = std::all_of(fp8.begin(), fp8.end(), [&](const checkpoint::ShardedTensor& t) {
      return reader.has_tensor(t.name) && reader.meta(t.name).global_shape == t.global_shape;
    });
    if (fp8_saved)
      for (auto& t : fp8) reader.load(t);  // into the live state; the next step's begin_step goes on from it
    state = TrainingState::read(reader.json());
  } catch (...) {
    err = std::current_exception();
  }
  checkpoint::agree(&world, err, "load (optimizer and training state)");
  size_t z = 0;
  for (OptimizerGroup& g : p.optimizer.groups)
    if (g.zero) g.zero->finish_load(zero_steps[z++]);
  if (!fp8_saved && !fp8.empty() && world.rank() == 0) {
    log_line(LogLevel::Warning, "fp8",
             "the checkpoint has no FP8 scaling state for this layout (a bf16 run, or another world size or "
             "amax history length): the scales start again from 1");
  }
  p.optimizer.sched->set_num_steps(state.scheduler_steps);
  if (p.optimizer.scaler && state.loss_scaler) p.optimizer.scaler->load_state(*state.loss_scaler);
  if (p.loader) {  // a load after construction restarts the data at the saved position
    data::LoaderConfig lc = p.loader->config();
    lc.consumed_samples = state.consumed_samples;
    p.loader.reset();
    p.loader = std::make_unique<data::DataLoader>(train_src, lc);
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
  // MEGACORE_PROFILE_RANGE=first:last (steps, inclusive) brackets those steps with cudaProfilerStart/Stop for a
  // profiler that honours them (benchmarks/tools/step_profile, nsys --capture-range=cudaProfilerApi); the device
  // is synchronised at both ends so the range holds exactly those steps' work.
  int64_t prof_first = 0, prof_last = -1;
  if (const char* pr = std::getenv("MEGACORE_PROFILE_RANGE"); pr && I.is_cuda())
    MC_CHECK_AS(ConfigError, std::sscanf(pr, "%" SCNd64 ":%" SCNd64, &prof_first, &prof_last) == 2 &&
                                 prof_first <= prof_last,
                "MEGACORE_PROFILE_RANGE is '{}'; give first:last steps, e.g. 10:19", pr);
  while (I.state.step < end) {
    I.watch(first ? WatchPhase::FirstStep : WatchPhase::Step, I.state.step + 1);
    first = false;
    if (I.state.step + 1 == prof_first) {
      synchronize_device(I.device());
      cuda_impl::profiler_range(true);
    }
    StepMetrics m = I.train_step();
    if (I.state.step == prof_last) {
      synchronize_device(I.device());
      cuda_impl::profiler_range(false);
    }
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
        // An async save is committed (complete on disk, named by 'latest', what a restart resumes from) by the
        // next save or at the end of the run: until then the directory is .tmp.step_<N>.
        std::printf("step %lld | checkpoint %s%s\n", (long long)I.state.step, I.last_checkpoint.c_str(),
                    I.ckpt->policy().async ? " (writing in the background; committed at the next save or the end)"
                                           : "");
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
  I.parts.optimizer.finish_param_gather();  // the caller may read the parameters next
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
  const int tp = I.grid().layout().tp_size(), pp = I.grid().layout().pp_size();
  std::vector<int64_t> ids = prompt;
  const int64_t vocab = I.mcfg().vocab_size;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t len = int64_t(ids.size());
    MC_CHECK(len <= I.mcfg().max_position_embeddings, "Trainer.generate: {} tokens exceed max_position_embeddings {}",
             len, I.mcfg().max_position_embeddings);
    // Sequence parallelism splits the sequence over TP and context parallelism into 2·CP chunks: pad on the
    // right (causal attention never looks ahead).
    const int cpn = I.grid().layout().cp_size(), cpr = I.grid().cp_rank();
    const int64_t unit = (I.mcfg().sequence_parallel ? tp : 1) * (cpn > 1 ? 2 * cpn : 1);
    const int64_t s = (len + unit - 1) / unit * unit;
    std::vector<int64_t> tok(size_t(s), 0);
    std::copy(ids.begin(), ids.end(), tok.begin());
    Tensor tokens = Tensor::from_vector<int64_t>(tok, {1, s}).to(I.device(), I.ctx.stream);
    Tensor labels = Tensor::zeros({1, s}, DType::I64, I.device(), I.ctx.stream);
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
    Tensor next = Tensor::zeros({1}, DType::I64, I.device(), I.ctx.stream);
    if (loss.defined() && cpr == owner) {
      // The logits of the last prompt position, gathered over the vocabulary shards.
      mdl::GPTModel& last = *I.parts.chunks.back();
      Tensor row = last.logits().narrow(1, local, 1).contiguous(I.ctx.stream).view({-1});
      Tensor full = parallel::all_gather_along(I.grid().tp(), row.to(DType::F32, I.ctx.stream), 0, I.ctx.stream);
      const std::vector<double> v = full.to(Device::cpu(), I.ctx.stream).to_double_vector();
      const int64_t best = int64_t(std::max_element(v.begin(), v.begin() + vocab) - v.begin());
      next = Tensor::from_vector<int64_t>({best}, {1}).to(I.device(), I.ctx.stream);
    }
    if (cpn > 1) I.grid().cp().broadcast(next, owner, I.ctx.stream)->wait();
    I.grid().pp().broadcast(next, pp - 1, I.ctx.stream)->wait();
    ids.push_back(next.to(Device::cpu(), I.ctx.stream).to_double_vector()[0]);
  }
  return std::vector<int64_t>(ids.begin() + int64_t(prompt.size()), ids.end());
}

std::string Trainer::save() { return impl_->save(); }
void Trainer::load(const std::string& path, bool optimizer) { impl_->load(path, optimizer); }
int64_t Trainer::step() const { return impl_->state.step; }
const parallel::ProcessGrid& Trainer::grid() const { return impl_->grid(); }
void Trainer::set_step_callback(std::function<void(const StepMetrics&)> cb) { impl_->step_cb = std::move(cb); }

}  // namespace megacore::train
