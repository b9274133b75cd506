// The parts a training run is made of, each built by one function a C++ user can call alone, replace, or
// compose with train::build_training_parts. The Trainer (train/trainer.hpp) is this composition plus the
// step loop, checkpoints and logging.
//
//   Placement p = pick_device(cfg, world);                   // CPU, or this rank's GPU and its stream
//   TransformerConfig m = cfg.transformer_config(p.device.is_cuda());
//   auto grid = build_grid(cfg, world);                      // TP × CP × DP × PP communicators
//   auto layout = build_pipeline_layout(cfg);                // layers per (virtual) stage
//   ModelChunks chunks = build_model_chunks(cfg, m, *grid, *layout, p.device);
//   OptimizerParts opt = build_optimizer(cfg, m, chunks, parameter_groups(chunks, *grid), p.stream);
//   auto engine = build_engine(cfg, m, *grid, *layout, chunks, opt);
//   auto loader = build_train_loader(cfg, m, *grid, p.device, train, /*consumed_samples=*/0);
//
// Every function is collective over the communicators it touches (the grid's constructor, LoRA's base
// checkpoint, DDP's buffers) and must run on every rank in the same order. What each returns is a plain
// owning object; the parts refer to each other's heap objects (the engine to the chunks, layout, grid and
// DDPs; DDP to the chunks' parameters), so keep them alive together — TrainingParts does, in a safe order,
// and may be moved.
//
// Parameter groups: the optimizer part is a list of groups, each a set of parameters whose gradients are
// reduced over one data-parallel communicator, with its own DDP and optimizer. A dense model has one
// group ("dense", over the grid's DP × CP group); a MoE model a second one ("expert", over expert-DP).
// The groups step together (optim::checked_step over their optimizers: one norm, one clip, one skip).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "megacore/checkpoint/dist_checkpoint.hpp"
#include "megacore/checkpoint/sharded_tensor.hpp"
#include "megacore/comm/communicator.hpp"
#include "megacore/core/device.hpp"
#include "megacore/core/stream.hpp"
#include "megacore/data/loader.hpp"
#include "megacore/data/sample_source.hpp"
#include "megacore/layers/parameter.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/model/transformer_config.hpp"
#include "megacore/optim/distributed_data_parallel.hpp"
#include "megacore/optim/distributed_optimizer.hpp"
#include "megacore/optim/fp8_param_gather.hpp"
#include "megacore/optim/loss_scaler.hpp"
#include "megacore/optim/lr_schedule.hpp"
#include "megacore/optim/optimizer.hpp"
#include "megacore/parallel/process_grid.hpp"
#include "megacore/pipeline/engine.hpp"
#include "megacore/pipeline/layout.hpp"
#include "megacore/train/run_config.hpp"

namespace megacore::train {

/// Where this rank trains: the device and the stream its model, optimizer and collectives are ordered on.
struct Placement {
  Device device = Device::cpu();
  Stream stream;
};

/// CPU when the world communicator is MPI (trainer.device cpu/auto), this rank's GPU (LOCAL_RANK or
/// OMPI_COMM_WORLD_LOCAL_RANK modulo the visible GPUs) and its default stream when it is NCCL.
/// ConfigError when trainer.device and the communicator disagree, when no GPU is visible, or for f32
/// weights on GPUs (the attention kernels take bf16/f16).
Placement pick_device(const RunConfig& cfg, const comm::Communicator& world);

/// The process grid of cfg.parallel over `world` (which must outlive it). Collective.
std::unique_ptr<parallel::ProcessGrid> build_grid(const RunConfig& cfg, comm::Communicator& world);

/// Layers per (virtual) pipeline stage: parallel.pipeline_layout when given, balanced for the embedding/
/// head costs when either is set, uniform otherwise.
std::unique_ptr<pipeline::PipelineLayout> build_pipeline_layout(const RunConfig& cfg);

/// This rank's model chunks, one per virtual stage, in stage order.
using ModelChunks = std::vector<std::unique_ptr<model::GPTModel>>;

/// This rank's chunks of the model `m` (cfg.transformer_config for the placement), freshly initialised
/// from m.seed. With peft.scheme = lora the frozen base is loaded from checkpoint.pretrained_checkpoint,
/// the adapters are added, and rank 0 prints the trainable share; parameters() are then the adapters.
/// Collective over the grid's world.
ModelChunks build_model_chunks(const RunConfig& cfg, const model::TransformerConfig& m, parallel::ProcessGrid& grid,
                               const pipeline::PipelineLayout& layout, const Placement& placement);

/// The model's tensors with their place in the global model (checkpoint sharding over the grid).
std::vector<checkpoint::ShardedTensor> model_tensors(const parallel::ProcessGrid& grid, const ModelChunks& chunks);
/// Each MoE layer's expert bias (moe_router_enable_expert_bias) as a replicated [experts] f32 tensor named
/// layers.<i>.mlp.router.expert_bias: not a parameter (no gradient, no optimizer state), but model state that
/// checkpoints keep.
std::vector<checkpoint::ShardedTensor> expert_bias_tensors(const parallel::ProcessGrid& grid, const ModelChunks& chunks);
/// Loads the chunks' parameters (and expert biases, where the checkpoint has them) from a checkpoint directory or
/// root (its latest), whatever layout wrote it; the returned reader serves the rest of the checkpoint. IOError
/// when none is complete there. Collective.
/// convert_dtype: floating-point weights stored in another precision are converted (a pretrained f32 model
/// into bf16 parameters, rounded to nearest even); false (a resume) refuses any dtype difference.
checkpoint::CheckpointReader load_model_weights(const parallel::ProcessGrid& grid, const ModelChunks& chunks,
                                                const std::string& path, bool convert_dtype = false);

/// Parameters whose gradients are reduced over one data-parallel communicator.
struct ParameterGroup {
  std::string name;                     ///< "dense" for the model's replicated-over-DP parameters
  std::vector<layers::Parameter*> params;
  comm::Communicator* dp = nullptr;     ///< the group gradients are averaged over (and ZeRO shards over)
  /// The gradients' sum over `dp` is divided by this many ranks; 0 = dp's size (optim::DDPConfig::average_size).
  int average_size = 0;
};

/// The chunks' trainable parameters (chunk order) as a "dense" group over grid.dp_cp() and, when this rank
/// holds MoE expert weights (Parameter::expert), an "expert" group over grid.expert_dp() whose gradient sum
/// is divided by DP × CP (Megatron-Core's scaling of expert gradients). The dense group is left out when it
/// would be empty beside a non-empty expert group (LoRA on the experts only).
std::vector<ParameterGroup> parameter_groups(const ModelChunks& chunks, parallel::ProcessGrid& grid);

/// One parameter group with its gradient reduction and its optimizer (`opt`, or `zero` for ZeRO-1).
struct OptimizerGroup {
  ParameterGroup group;
  std::unique_ptr<optim::DistributedDataParallel> ddp;
  std::unique_ptr<optim::Optimizer> opt;              ///< AdamW / SGD
  std::unique_ptr<optim::DistributedOptimizer> zero;  ///< ZeRO-1 (parallel.use_distributed_optimizer)
};

struct OptimizerParts {
  std::vector<OptimizerGroup> groups;
  /// Tied embedding weights this rank holds with PP > 1: held back from DDP until the engine has summed
  /// them over the embedding group; report them with notify_tied_grads() after the engine's step.
  std::vector<layers::Parameter*> tied;
  std::unique_ptr<optim::LRScheduler> sched;
  std::unique_ptr<optim::DynamicLossScaler> scaler;  ///< f16 weights only

  /// Every group: zero_grad / set_is_last_microbatch / finish_grad_sync of its DDP.
  void zero_grad();
  void set_is_last_microbatch(bool last);
  void finish_grad_sync();
  /// Reports the tied weights' gradients to their group's DDP (no-op without tied weights).
  void notify_tied_grads();
  /// Waits for ZeRO's outstanding parameter all-gathers (the weights as the last step left them).
  void finish_param_gather();
  /// FP8 under ZeRO-1: the FP8 linears' weights (in buckets of their own, whose gather ZeRO defers with
  /// trainer.fp8_param_gather).
  std::vector<optim::Fp8Weight> fp8_weights;
  /// After fp8_begin_step, before the forward: gathers the deferred FP8 weights as FP8 codes
  /// (optim::fp8_param_gather; zeros when nothing is deferred). `amax_group`: the stage's TP × CP × DP group.
  optim::Fp8GatherStats fp8_param_gather(comm::Communicator& amax_group, const Stream& s);
};

/// DDP and the optimizer of each group (AdamW, SGD or ZeRO-1 per cfg), the LR schedule (cfg.lr_schedule())
/// and, for f16 weights, the dynamic loss scaler. Wires the chunks' gradient-ready callbacks to each
/// group's DDP (and ZeRO's overlapped parameter gather to the chunks' forward). The optimizers copy the
/// current parameters into their master weights: load checkpoint weights before calling this.
OptimizerParts build_optimizer(const RunConfig& cfg, const model::TransformerConfig& m, ModelChunks& chunks,
                               std::vector<ParameterGroup> groups, const Stream& stream);

/// The pipeline engine over this rank's chunks (no pipelining, 1F1B or interleaved 1F1B from PP and VP);
/// it tells every group's DDP which backward is the last of the step, and sums tied embeddings over the
/// embedding group. `defer_reads`: PipelineEngineOptions::defer_reads.
std::unique_ptr<pipeline::PipelineEngine> build_engine(const RunConfig& cfg, const model::TransformerConfig& m,
                                                       parallel::ProcessGrid& grid,
                                                       const pipeline::PipelineLayout& layout, ModelChunks& chunks,
                                                       OptimizerParts& optimizer, bool defer_reads = false);

/// The loader settings the training and validation loaders share: this rank's DP place, the device, the
/// batch sizes and the vocabulary check.
data::LoaderConfig loader_config(const RunConfig& cfg, const model::TransformerConfig& m,
                                 const parallel::ProcessGrid& grid, Device device, int prefetch);

/// When trainer.max_epochs > 0, sets trainer.max_steps to the epochs' steps over `train` and checks the LR
/// schedule against it; rank 0 (`print`) says so. ConfigError when the data holds less than one global batch.
void resolve_run_length(RunConfig& cfg, const data::SampleSource& train, bool print);

/// This DP rank's training loader, starting at `consumed_samples` (SFT rows shuffled, repeated for runs
/// longer than one pass; rank 0 (`print`) says so). ConfigError when `train` does not hold
/// trainer.max_steps global batches, or `valid` (may be null) holds less than one global batch while
/// validation is on.
std::unique_ptr<data::DataLoader> build_train_loader(const RunConfig& cfg, const model::TransformerConfig& m,
                                                     const parallel::ProcessGrid& grid, Device device,
                                                     std::shared_ptr<const data::SampleSource> train,
                                                     const data::SampleSource* valid, int64_t consumed_samples,
                                                     bool print);

/// The next global step's micro-batches for this rank (packed rows keep their segments; with CP each rank
/// keeps its two chunks of the sequence). ValueError when the loader runs out.
std::vector<pipeline::MicroBatch> next_micro_batches(data::DataLoader& loader, const parallel::ProcessGrid& grid,
                                                     const Stream& stream);

/// Everything one run trains with, kept alive together (members are destroyed loader first, grid last).
struct TrainingParts {
  RunConfig cfg;                  ///< as resolved (trainer.max_steps from trainer.max_epochs)
  model::TransformerConfig model; ///< the model as the layers see it (precision resolved for the device)
  Placement placement;
  std::unique_ptr<parallel::ProcessGrid> grid;
  std::unique_ptr<pipeline::PipelineLayout> layout;
  ModelChunks chunks;
  OptimizerParts optimizer;
  std::unique_ptr<pipeline::PipelineEngine> engine;
  std::unique_ptr<data::DataLoader> loader;
};

struct BuildOptions {
  /// Called once the chunks exist and before the optimizer copies their weights (load a checkpoint's
  /// model here).
  std::function<void(TrainingParts&)> before_optimizer;
  /// Called after the optimizer, schedule and scaler are built, before the engine and the loader (load
  /// their state here); returns the samples already consumed, where the loader starts.
  std::function<int64_t(TrainingParts&)> after_optimizer;
  /// The engine leaves the loss and token count on the device (PipelineEngineOptions::defer_reads): the
  /// Trainer's mode, which reads them with the gradient norm, one host sync per step.
  bool defer_step_reads = false;
};

/// ConfigError unless `train` is given and its rows are data.seq_length long.
void check_training_data(const RunConfig& cfg, const data::SampleSource* train);

/// The whole composition in the order above, after the config was validated (train::check). Collective
/// over `world`, which must outlive the parts. `valid` may be null.
TrainingParts build_training_parts(const RunConfig& cfg, comm::Communicator& world,
                                   std::shared_ptr<const data::SampleSource> train,
                                   std::shared_ptr<const data::SampleSource> valid = {},
                                   const BuildOptions& options = {});

}  // namespace megacore::train
