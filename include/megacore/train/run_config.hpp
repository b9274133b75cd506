// RunConfig: everything one training run needs, in the sections a recipe has (model, parallel, data,
// optim, trainer, checkpoint, logging, resources). It is the single declaration of every run setting:
// each field's name, type, default and doc live here (or, for the model's shape, in TransformerConfig),
// and the recipe JSON/YAML, the Python `Recipe` dataclasses, `--set` (with its short aliases) and the
// schema are generated from these lists (core/fields.hpp). Adding a setting is a change to this file.
//
// Validation happens once, at the boundary: `validate(cfg, world_size)` collects every problem of the
// run as a whole (layout, batch, model shape for its TP degree, schedule, files), each with its fix;
// the launcher calls it before any rank starts and the Trainer calls it on entry. Constructors below
// check only their own local invariants.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "megacore/core/fields.hpp"
#include "megacore/model/lora.hpp"
#include "megacore/model/transformer_config.hpp"
#include "megacore/optim/lr_schedule.hpp"
#include "megacore/parallel/process_grid.hpp"
#include "megacore/pipeline/layout.hpp"

namespace megacore::train {

/// The model section: the architecture fields of TransformerConfig plus the preset it started from.
/// Defaults are the tiny 4-layer Llama that trains on CPU ranks.
struct ModelSection : model::TransformerConfig {
  std::string name = "tiny";
  ModelSection();
  /// The section of a C++ preset (tiny_llama, tiny_gpt2, llama32_1b, llama3_8b, gpt2_124m); ConfigError
  /// listing the presets for an unknown name.
  static ModelSection preset(const std::string& name);

  template <class Self, class F>
  static void fields(Self& s, F&& f) {
    f(Field{"name", "Model name (the preset it started from); informational."}, s.name);
    model::TransformerConfig::fields(s, f);
  }
};

struct ParallelSection {
  int tensor_model_parallel_size = 1;
  int pipeline_model_parallel_size = 1;
  int virtual_pipeline_model_parallel_size = 1;
  int context_parallel_size = 1;
  std::string cp_comm_type = "p2p";
  bool cp_comm_copy_engine = false;
  int expert_model_parallel_size = 1;
  int expert_tensor_parallel_size = 0;
  bool sequence_parallel = false;
  std::vector<int64_t> pipeline_layout;
  double pipeline_embedding_cost = -1.0;
  double pipeline_head_cost = -1.0;
  bool use_distributed_optimizer = false;
  bool overlap_grad_reduce = true;
  bool overlap_param_gather = false;
  int64_t bucket_size = 0;
  bool grad_reduce_in_bf16 = false;
  bool tp_comm_overlap = false;
  bool tp_comm_overlap_forward = false;
  int tp_comm_stream_priority = 0;

  template <class Self, class F>
  static void fields(Self& s, F&& f) {
    f(Field{.name = "tensor_model_parallel_size", .doc = "TP: tensor-parallel size.", .alias = "tp"},
      s.tensor_model_parallel_size);
    f(Field{.name = "pipeline_model_parallel_size", .doc = "PP: pipeline stages.", .alias = "pp"},
      s.pipeline_model_parallel_size);
    f(Field{.name = "virtual_pipeline_model_parallel_size",
            .doc = "Model chunks per pipeline stage (interleaved 1F1B); 1 = none.", .alias = "vp"},
      s.virtual_pipeline_model_parallel_size);
    f(Field{.name = "context_parallel_size", .doc = "CP: context-parallel size (splits the sequence).",
            .alias = "cp"},
      s.context_parallel_size);
    f(Field{"cp_comm_type",
            "CP: how attention reaches the other ranks' keys and values. p2p: a ring of CP steps passing K/V blocks "
            "on (Megatron-Core's default; load-balanced causal chunks). all_gather: gather K/V over the CP group "
            "first, then attend locally (simpler, no overlap; dK/dV reduce-scattered back).",
            "p2p|all_gather"},
      s.cp_comm_type);
    f(Field{"cp_comm_copy_engine",
            "GPUs: the CP group's transfers move by the GPUs' copy engines over NVLink/P2P instead of NCCL's "
            "kernels, which need SMs and so wait while cuDNN's attention kernels hold them all: the p2p ring's "
            "K/V and dK/dV passes are read by the receiving GPU straight from the sender's tensor (CUDA IPC), "
            "all_gather's gathers and reduce-scatters go through a 32 MiB staging buffer per rank. Needs the CP "
            "group on one host with peer access between its GPUs (else logged once, and NCCL stays). Same "
            "numbers. Off by default: a peer's allocations stay mapped until the group ends (memory an OOM retry "
            "frees is not returned) and a receive waits on the host for the peer's post. CPU ranks ignore it."},
      s.cp_comm_copy_engine);
    f(Field{.name = "expert_model_parallel_size",
            .doc = "EP: MoE layers spread their experts over this many ranks, carved from DP x CP (must divide it and "
                   "model.num_moe_experts).",
            .alias = "ep"},
      s.expert_model_parallel_size);
    f(Field{.name = "expert_tensor_parallel_size",
            .doc = "Expert-TP: tensor-parallel size inside MoE experts (splits their FFN width); 0 = TP.",
            .alias = "etp"},
      s.expert_tensor_parallel_size);
    f(Field{.name = "sequence_parallel",
            .doc = "Split norms, dropout and residuals along the sequence over the TP group (needs TP > 1).",
            .alias = "sp"},
      s.sequence_parallel);
    f(Field{"pipeline_layout",
            "Explicit layers per (virtual) pipeline stage in model order, e.g. [5, 6, 6, 5]; empty = the split "
            "balanced for pipeline_embedding_cost / pipeline_head_cost."},
      s.pipeline_layout);
    f(Field{"pipeline_embedding_cost",
            "Extra work of the first stage (embedding), in transformer layers; -1 = derived from the model's shape "
            "(the lookup does no matmul work: 0). Without pipeline_layout the layers are split to even out the "
            "stages (PipelineLayout::balanced); with both costs 0 the split is even."},
      s.pipeline_embedding_cost);
    f(Field{"pipeline_head_cost",
            "Extra work of the last stage (output layer + loss), in transformer layers; -1 = derived from the "
            "model's shape (output-layer matmul FLOPs over a layer's, e.g. ~4.0 for Llama 3.2 1B at seq 2048); "
            "0 = none (with pipeline_embedding_cost 0: the even split). See pipeline_embedding_cost."},
      s.pipeline_head_cost);
    f(Field{.name = "use_distributed_optimizer", .doc = "ZeRO-1: shard the optimizer state over DP.",
            .alias = "zero"},
      s.use_distributed_optimizer);
    f(Field{"overlap_grad_reduce", "Reduce gradient buckets while backward still runs."}, s.overlap_grad_reduce);
    f(Field{"overlap_param_gather",
            "ZeRO-1: the parameter all-gathers after a step overlap the next forward (each layer waits for its "
            "own)."},
      s.overlap_param_gather);
    f(Field{"bucket_size", "Gradient buffer bucket size in elements; 0 = Megatron-Core's max(40M, 1M x DP)."},
      s.bucket_size);
    f(Field{"grad_reduce_in_bf16", "Reduce gradients in bf16 instead of f32."}, s.grad_reduce_in_bf16);
    f(Field{"tp_comm_overlap",
            "Overlap the column-parallel layers' backward TP collective with their weight-gradient GEMM."},
      s.tp_comm_overlap);
    f(Field{"tp_comm_overlap_forward",
            "With sequence_parallel: overlap the forward's sequence-parallel all-gathers (before QKV, fc1 and the "
            "output layer) and reduce-scatters (after the attention projection and fc2) with their GEMMs, as rings "
            "of TP send/recv steps over row chunks. The all-gather side is exact; the reduce-scatter side adds "
            "partial sums in ring order (equal at TP 2, within round-off above). Layers with FP8 or LoRA keep the "
            "serial forward (logged once)."},
      s.tp_comm_overlap_forward);
    f(Field{"tp_comm_stream_priority",
            "CUDA priority of the tp_comm_overlap / tp_comm_overlap_forward communication streams: 0 = normal, negative = higher (CUDA clamps "
            "it to the device's range, -5 on H100/H200). A higher one lets the collective's kernels take SMs before "
            "the GEMM it overlaps when both become ready together. Same results."},
      s.tp_comm_stream_priority);
  }
};

struct DataSection {
  BlendList paths{std::string("embedded")};
  std::string tokenizer = "byte";
  int64_t seq_length = 128;
  int64_t micro_batch_size = 4;
  int64_t global_batch_size = 16;
  std::string split = "969,30,1";
  uint64_t seed = 1234;
  std::string cache_dir;
  int64_t embedded_documents = 4000;
  int prefetch = 4;
  std::string sft_path;
  bool sft_pack = true;
  std::string sft_on_error = "fail";

  template <class Self, class F>
  static void fields(Self& s, F&& f) {
    f(Field{"paths",
            "Pretraining data: a prefix, a list of prefixes or a weighted blend [0.3, \"data/a\", 0.7, \"data/b\"] of "
            "`megacore preprocess` outputs (without .bin/.idx); [\"embedded\"] is the built-in corpus."},
      s.paths);
    f(Field{"tokenizer", "'byte' (259 ids) or the path of a Hugging Face tokenizer.json (or its folder)."},
      s.tokenizer);
    f(Field{.name = "seq_length", .doc = "Tokens per training sample.", .alias = "seq"}, s.seq_length);
    f(Field{.name = "micro_batch_size", .doc = "Samples per micro-batch on one DP rank.", .alias = "mbs"},
      s.micro_batch_size);
    f(Field{.name = "global_batch_size", .doc = "Samples per optimizer step over all DP ranks.", .alias = "gbs"},
      s.global_batch_size);
    f(Field{"split", "Train/validation/test split of the documents, as weights 'a,b,c'."}, s.split);
    f(Field{"seed", "Seed of the sample order (and of the SFT row shuffle)."}, s.seed);
    f(Field{"cache_dir", "Where dataset index caches go; empty = <run dir>/data."}, s.cache_dir);
    f(Field{"embedded_documents", "Documents of the embedded corpus."}, s.embedded_documents);
    f(Field{"prefetch", "Micro-batches the data loader prepares ahead of the step (>= 1)."}, s.prefetch);
    f(Field{"sft_path",
            "SFT: a JSONL file ({\"input\", \"output\"} or chat \"messages\"); when set, paths is ignored and the "
            "loss counts answer tokens only."},
      s.sft_path);
    f(Field{"sft_pack", "SFT: pack several examples into one row (attention and positions restart per example)."},
      s.sft_pack);
    f(Field{"sft_on_error",
            "SFT: a bad JSONL line (malformed, missing fields, no answer) fails the run naming file and line, or is "
            "skipped and counted.",
            "fail|skip"},
      s.sft_on_error);
  }
};

struct OptimSection {
  std::string optimizer = "adamw";
  double lr = 3e-4;
  double min_lr = 3e-5;
  double weight_decay = 0.1;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.95;
  double adam_eps = 1e-8;
  double sgd_momentum = 0.9;
  double clip_grad = 1.0;
  int64_t lr_warmup_iters = 0;
  double lr_warmup_fraction = 0;
  optim::LRDecayStyle lr_decay_style = optim::LRDecayStyle::Cosine;
  int64_t lr_decay_iters = 0;
  int64_t lr_wsd_decay_iters = 0;
  double initial_loss_scale = 65536.0;
  bool skip_nonfinite_steps = true;
  std::string main_params_dtype = "f32";
  std::string main_grads_dtype = "f32";
  std::string exp_avg_dtype = "f32";
  std::string exp_avg_sq_dtype = "f32";

  template <class Self, class F>
  static void fields(Self& s, F&& f) {
    f(Field{"optimizer", "adamw or sgd.", "adamw|sgd"}, s.optimizer);
    f(Field{"lr", "Peak learning rate."}, s.lr);
    f(Field{"min_lr", "Learning rate at the end of the decay."}, s.min_lr);
    f(Field{"weight_decay", "Decoupled weight decay."}, s.weight_decay);
    f(Field{"adam_beta1", "AdamW beta1."}, s.adam_beta1);
    f(Field{"adam_beta2", "AdamW beta2."}, s.adam_beta2);
    f(Field{"adam_eps", "AdamW epsilon."}, s.adam_eps);
    f(Field{"sgd_momentum", "SGD momentum."}, s.sgd_momentum);
    f(Field{"clip_grad", "Global gradient-norm clipping; 0 disables."}, s.clip_grad);
    f(Field{"lr_warmup_iters", "Linear warmup steps."}, s.lr_warmup_iters);
    f(Field{"lr_warmup_fraction",
            "Warmup as a fraction of the decay steps (so it follows max_steps); 0 = use lr_warmup_iters."},
      s.lr_warmup_fraction);
    f(Field{"lr_decay_style", "Decay after warmup."}, s.lr_decay_style);
    f(Field{"lr_decay_iters", "Step at which the decay ends (warmup included); 0 = trainer.max_steps."},
      s.lr_decay_iters);
    f(Field{"lr_wsd_decay_iters", "WSD: length of the final decay phase; 0 = a tenth of the decay."},
      s.lr_wsd_decay_iters);
    f(Field{"initial_loss_scale", "f16 only: the initial dynamic loss scale."}, s.initial_loss_scale);
    f(Field{"skip_nonfinite_steps",
            "Skip the update when a gradient is NaN or Inf (false applies it anyway: debugging only). What the run "
            "then does is trainer.on_nonfinite."},
      s.skip_nonfinite_steps);
    f(Field{"main_params_dtype",
            "Master weights. f32: an f32 copy of the parameters that AdamW updates (12 bytes of state per parameter "
            "with f32 moments). bf16: no copy; AdamW updates the bf16 parameters in place, rounding to nearest even "
            "(the precision of torch's AdamW on bf16 weights). bf16 needs trainer.precision = bf16 and adamw.",
            "f32|bf16"},
      s.main_params_dtype);
    f(Field{"main_grads_dtype",
            "Main gradients (the DDP grad buffer): f32, or bf16 (accumulated and data-parallel-reduced in bf16; half "
            "the gradient memory). bf16 needs trainer.precision = bf16.",
            "f32|bf16"},
      s.main_grads_dtype);
    f(Field{"exp_avg_dtype", "AdamW first moment's storage (computed in f32 either way; bf16 rounds to nearest).",
            "f32|bf16"},
      s.exp_avg_dtype);
    f(Field{"exp_avg_sq_dtype", "AdamW second moment's storage (computed in f32 either way; bf16 rounds to nearest).",
            "f32|bf16"},
      s.exp_avg_sq_dtype);
  }
};

struct TrainerSection {
  int64_t max_steps = 100;
  int64_t max_epochs = 0;
  int64_t stop_after_steps = 0;
  int64_t val_check_interval = 0;
  int64_t limit_val_batches = 4;
  int64_t log_interval = 1;
  std::string precision = "auto";
  std::string device = "auto";
  std::string memory_check = "error";
  model::RecomputeGranularity recompute = model::RecomputeGranularity::None;
  int64_t recompute_num_layers = -1;
  uint64_t seed = 1234;
  double peak_tflops = 0;
  int64_t generate_tokens = 0;
  std::string generate_prompt;
  double comm_timeout_s = 300;
  int64_t max_restarts = 0;
  std::string on_nonfinite = "skip";
  double loss_spike_factor = 3.0;
  double straggler_factor = 0;
  double startup_timeout_s = 1800;
  double first_step_timeout_s = 1800;
  double step_timeout_s = 600;
  double save_timeout_s = 1800;
  std::string fp8 = "none";
  int64_t fp8_amax_history_len = 1024;
  std::string fp8_amax_compute_algo = "max";
  int64_t fp8_margin = 0;
  std::string fp8_format = "hybrid";
  int64_t fp8_bf16_layers = 0;
  bool fp8_wgrad = true;
  bool fp8_keep_gathered_input = false;
  bool fp8_emulation = false;
  bool fp8_param_gather = false;

  template <class Self, class F>
  static void fields(Self& s, F&& f) {
    f(Field{.name = "max_steps", .doc = "Optimizer steps of the whole run.", .alias = "steps"}, s.max_steps);
    f(Field{.name = "max_epochs",
            .doc = "When > 0, the run is this many passes over the training rows (each pass reshuffled) and "
                   "max_steps becomes max_epochs x (rows // global_batch_size).",
            .alias = "epochs"},
      s.max_epochs);
    f(Field{"stop_after_steps",
            "End this run after this many steps (0 = run to max_steps); the LR schedule and data order still "
            "follow max_steps, so a later run resumes exactly (time-limited jobs)."},
      s.stop_after_steps);
    f(Field{"val_check_interval", "Validate every N steps (0 = never)."}, s.val_check_interval);
    f(Field{"limit_val_batches", "Global batches per validation."}, s.limit_val_batches);
    f(Field{"log_interval", "Print and record metrics every N steps."}, s.log_interval);
    f(Field{"precision",
            "Parameter and activation dtype; f32 master weights and gradients always. auto = bf16 on GPUs, f32 on "
            "CPU ranks.",
            "auto|f32|bf16|f16"},
      s.precision);
    f(Field{"device", "auto (GPUs when present), cpu or cuda.", "auto|cpu|cuda"}, s.device);
    f(Field{"memory_check",
            "Before GPU ranks start, the busiest rank's memory as `megacore plan` estimates it for this recipe is "
            "compared with the GPU's memory (docs/performance.md). error = a layout whose estimate exceeds the GPU's "
            "memory less plan's headroom is refused with the layout `megacore plan --fit` picks, and one that fits "
            "with little to spare gets a warning; warn = both only warn; off = no check. CPU ranks and LoRA runs (plan does not model frozen base weights) are "
            "not checked.",
            "error|warn|off"},
      s.memory_check);
    f(Field{"recompute", "Activation recompute in backward: none, selective (core attention) or full (layer)."},
      s.recompute);
    f(Field{"recompute_num_layers",
            "With recompute = full: recompute only the first N layers of each model chunk (a pipeline stage, or "
            "each virtual stage under interleaving) and keep every activation of the others (Megatron-Core's "
            "recompute_method = block); -1 = every layer. Trades memory for speed: a recomputed layer saves all but "
            "its input and costs about a third of its forward + backward again, which the pipeline split prices per "
            "chunk."},
      s.recompute_num_layers);
    f(Field{"seed", "Seed of the run (kept for reproducibility; the model's init uses model.seed)."}, s.seed);
    f(Field{"peak_tflops", "Peak dense bf16 TFLOP/s per GPU for MFU; 0 = the card's known figure."}, s.peak_tflops);
    f(Field{"generate_tokens",
            "After training, rank 0 greedily generates this many tokens from generate_prompt (0 = no sample)."},
      s.generate_tokens);
    f(Field{"generate_prompt", "Prompt of the sample printed after training."}, s.generate_prompt);
    f(Field{"comm_timeout_s", "Seconds a collective may hang before the run fails with CommError."},
      s.comm_timeout_s);
    f(Field{"max_restarts",
            "When a rank fails, megacore.launch restarts every rank from the latest checkpoint, up to this many "
            "times (each restart must get further than the last); 0 = the job fails."},
      s.max_restarts);
    f(Field{"on_nonfinite",
            "A step whose loss or gradient norm is NaN/Inf is reported (step, values) and then: skip = the run goes "
            "on (the update itself is skipped unless optim.skip_nonfinite_steps = false); stop = every rank ends "
            "the run with ValueError (the last checkpoint predates it). With f16 loss scaling an Inf gradient norm "
            "is the scaler's business (it backs off) and only a non-finite loss counts.",
            "skip|stop"},
      s.on_nonfinite);
    f(Field{"loss_spike_factor",
            "Report a step whose loss exceeds this factor times the loss's moving average (after 10 steps); "
            "0 = off."},
      s.loss_spike_factor);
    f(Field{"straggler_factor",
            "Every step, gather each rank's compute time (the step up to the data-parallel gradient reduction) and "
            "report ranks slower than this factor times the median; 0 = off (it costs one all-gather per step)."},
      s.straggler_factor);
    f(Field{"startup_timeout_s",
            "Watchdog (train/watchdog.hpp): seconds the trainer's construction (building the model, loading a "
            "checkpoint) may take before the rank reports its last collectives and the ranks that had not arrived, "
            "aborts its communicators and exits with code 124; 0 = not watched."},
      s.startup_timeout_s);
    f(Field{"first_step_timeout_s",
            "Watchdog: seconds the first step of a run may go without progress (it warms caches and plans); 0 = not "
            "watched."},
      s.first_step_timeout_s);
    f(Field{"step_timeout_s",
            "Watchdog: seconds any later step (with its validation and step callbacks) may go without progress; 0 = "
            "not watched. Below comm_timeout_s it reports a hang before the collective's own timeout does."},
      s.step_timeout_s);
    f(Field{"save_timeout_s", "Watchdog: seconds a checkpoint save may take; 0 = not watched."}, s.save_timeout_s);
    f(Field{"fp8",
            "FP8 linear layers (QKV, output projection, FC1, FC2; docs/fp8.md): none, delayed (scales from an amax "
            "history, Transformer Engine's DelayedScaling) or current (each tensor's own amax). Needs precision "
            "bf16 and a GPU of compute capability 8.9+ (or fp8_emulation on CPU ranks).",
            "none|delayed|current"},
      s.fp8);
    f(Field{"fp8_amax_history_len", "Delayed scaling: steps of amax history per tensor."}, s.fp8_amax_history_len);
    f(Field{"fp8_amax_compute_algo", "Delayed scaling: the history's max, or its most recent amax.",
            "max|most_recent"},
      s.fp8_amax_compute_algo);
    f(Field{"fp8_margin", "scale = fp8_max / amax / 2^margin."}, s.fp8_margin);
    f(Field{"fp8_format",
            "hybrid = E4M3 forward (activations, weights), E5M2 output gradients; e4m3 = E4M3 everywhere.",
            "hybrid|e4m3"},
      s.fp8_format);
    f(Field{"fp8_bf16_layers", "The first and the last this many transformer layers stay in bf16."},
      s.fp8_bf16_layers);
    f(Field{"fp8_wgrad",
            "Run the weight-gradient GEMM (dW = dyᵀ x) in FP8 too, as Transformer Engine; false keeps it in bf16 "
            "from the saved bf16 input."},
      s.fp8_wgrad);
    f(Field{"fp8_keep_gathered_input",
            "With sequence parallelism, the QKV and FC1 layers keep the all-gathered input's transposed FP8 codes "
            "from forward for the weight gradient (1 byte per element of the whole sequence) instead of their bf16 "
            "chunk (2 bytes per element of 1/TP of it): backward skips re-gathering and re-casting the input. "
            "More activation memory for TP > 2, less time."},
      s.fp8_keep_gathered_input);
    f(Field{"fp8_emulation",
            "Allow fp8 on CPU ranks, emulated (decode to f32, f32 GEMM): for tests and debugging, not speed."},
      s.fp8_emulation);
    f(Field{"fp8_param_gather",
            "ZeRO-1: all-gather the FP8 linears' updated weights over DP as E4M3 codes (1 byte per element) instead "
            "of bf16, each rank casting its own shard (Megatron's --fp8-param-gather). The training is the same bit "
            "for bit. Needs trainer.fp8, parallel.use_distributed_optimizer and optim.main_params_dtype = f32; "
            "with DP x CP = 1 there is nothing to gather and it does nothing."},
      s.fp8_param_gather);
  }
};

struct CheckpointSection {
  std::string save_dir;
  int64_t save_interval = 0;
  int keep_last = 2;
  int keep_top_k = 0;
  std::string resume = "auto";
  std::string pretrained_checkpoint;
  bool async_save = false;
  bool save_last = true;

  template <class Self, class F>
  static void fields(Self& s, F&& f) {
    f(Field{"save_dir", "Checkpoint root (step_<N> folders and 'latest'); empty = no checkpoints."}, s.save_dir);
    f(Field{"save_interval", "Save every N steps (0 = only at the end, see save_last)."}, s.save_interval);
    f(Field{"keep_last", "Keep the newest k checkpoints (0 = all)."}, s.keep_last);
    f(Field{"keep_top_k", "Also keep the k best by validation loss (0 = off)."}, s.keep_top_k);
    f(Field{"resume",
            "'' (start fresh), 'auto' (resume from save_dir/latest when there is one) or a checkpoint path."},
      s.resume);
    f(Field{"pretrained_checkpoint",
            "Weights to start from when there is nothing to resume (fine-tuning): a megacore checkpoint (directory "
            "or root with 'latest', trainer-written or converted from Hugging Face). Weights only: step, optimizer, "
            "schedule and data start fresh; weights stored in another float precision are converted (f32 into bf16 "
            "parameters rounds to nearest even). Once the run has saved, resume ('auto') continues from its own "
            "checkpoints."},
      s.pretrained_checkpoint);
    f(Field{"async_save", "Write checkpoints in the background while training goes on."}, s.async_save);
    f(Field{"save_last", "Save at the end of training."}, s.save_last);
  }
};

struct LoggingSection {
  std::string log_dir;
  bool jsonl = true;
  bool tensorboard = true;
  std::string progress_bar = "auto";
  int64_t metrics_port = 0;
  std::string metrics_host = "127.0.0.1";

  template <class Self, class F>
  static void fields(Self& s, F&& f) {
    f(Field{"log_dir", "metrics.jsonl, TensorBoard events and the recipe go here; empty = none."}, s.log_dir);
    f(Field{"jsonl", "Append each logged step to log_dir/metrics.jsonl."}, s.jsonl);
    f(Field{"tensorboard", "Write TensorBoard event files under log_dir/tensorboard."}, s.tensorboard);
    f(Field{"progress_bar", "auto (only when the launcher's output is a terminal), on or off.", "auto|on|off"},
      s.progress_bar);
    f(Field{"metrics_port",
            "Rank 0 serves the latest step's metrics in Prometheus text format on http://metrics_host:port/metrics "
            "(0 = off)."},
      s.metrics_port);
    f(Field{"metrics_host", "Address the metrics endpoint binds to (0.0.0.0 = every interface)."}, s.metrics_host);
  }
};

struct ResourcesSection {
  int num_nodes = 1;
  int num_gpus_per_node = 1;

  template <class Self, class F>
  static void fields(Self& s, F&& f) {
    f(Field{.name = "num_nodes", .doc = "Nodes of the job.", .alias = "nodes"}, s.num_nodes);
    f(Field{.name = "num_gpus_per_node", .doc = "Ranks (GPUs, or CPU ranks) per node.", .alias = "gpus"},
      s.num_gpus_per_node);
  }
};

struct PeftSection {
  std::string scheme = "none";
  int64_t dim = 8;
  double alpha = 16.0;
  double dropout = 0.0;
  std::vector<std::string> target_modules{"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"};

  template <class Self, class F>
  static void fields(Self& s, F&& f) {
    f(Field{"scheme",
            "Parameter-efficient fine-tuning. none: train every weight. lora: freeze the base model and train "
            "low-rank adapters on the target modules (the base comes from checkpoint.pretrained_checkpoint; "
            "checkpoints then hold only the adapters and their optimizer state).",
            "none|lora"},
      s.scheme);
    f(Field{"dim", "LoRA rank r (at most the smallest dimension of every targeted layer)."}, s.dim);
    f(Field{"alpha", "LoRA alpha: the adapter output is scaled by alpha / dim."}, s.alpha);
    f(Field{"dropout", "Dropout on the adapters' input, in [0, 1)."}, s.dropout);
    f(Field{"target_modules",
            "Layers that get adapters: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (Hugging Face "
            "names) or linear_qkv linear_proj linear_fc1 linear_fc2 (Megatron-Core names)."},
      s.target_modules);
  }
  /// The LoRA settings for the model (seed from the model's).
  model::LoRAConfig lora(uint64_t seed) const {
    return model::LoRAConfig{.dim = dim, .alpha = alpha, .dropout = dropout, .target_modules = target_modules,
                             .seed = seed};
  }
};

struct RunConfig {
  std::string name = "custom";
  ModelSection model;
  ParallelSection parallel;
  DataSection data;
  OptimSection optim;
  TrainerSection trainer;
  CheckpointSection checkpoint;
  LoggingSection logging;
  ResourcesSection resources;
  PeftSection peft;

  template <class Self, class F>
  static void fields(Self& s, F&& f) {
    f(Field{"name", "Run name (recipes use it for runs/<name>)."}, s.name);
    f(Field{"model", "The model's shape and flavour (Megatron-Core TransformerConfig names)."}, s.model);
    f(Field{"parallel", "Parallel layout: world = TP x PP x CP x DP."}, s.parallel);
    f(Field{"data", "Training data, tokenizer and batch."}, s.data);
    f(Field{"optim", "Optimizer and learning-rate schedule."}, s.optim);
    f(Field{"trainer", "Steps, precision, device, validation and sampling."}, s.trainer);
    f(Field{"checkpoint", "Saving, retention and resuming."}, s.checkpoint);
    f(Field{"logging", "Metrics files and the progress bar."}, s.logging);
    f(Field{"resources", "Nodes and ranks per node of the job."}, s.resources);
    f(Field{"peft", "Parameter-efficient fine-tuning (LoRA)."}, s.peft);
  }

  int world_size() const { return resources.num_nodes * resources.num_gpus_per_node; }
  /// The process-grid sizes of this run.
  parallel::ParallelConfig grid_config() const;
  /// The model as the layers see it, with the trainer's precision (auto resolved for `on_gpu`),
  /// sequence parallelism, recompute and TP overlap filled in.
  model::TransformerConfig transformer_config(bool on_gpu) const;
  /// The costs the pipeline split is balanced for, in layers: the parallel section's embedding/head costs, each -1
  /// replaced by pipeline::stage_costs_from_model's for this model, sequence, TP and recompute, and under full
  /// recompute trainer.recompute_num_layers (block recompute: each chunk's first N layers cost 4/3 of the others).
  pipeline::StageCosts pipeline_stage_costs() const;
  /// The learning-rate schedule (decay length max_steps when lr_decay_iters is 0, WSD's default phase).
  optim::LRScheduleConfig lr_schedule() const;
};

/// Every problem found, each naming the field and its fix, and warnings (e.g. a large pipeline bubble).
struct ValidationReport {
  std::vector<std::string> errors;
  std::vector<std::string> warnings;
};

struct ValidateOptions {
  /// Also check files: data prefixes, the SFT file, the tokenizer, and that a resume checkpoint exists
  /// and holds this model.
  bool check_paths = true;
};

/// Checks the run as a whole for `world_size` ranks. Never throws for a bad config: the report lists it.
ValidationReport validate(const RunConfig& cfg, int world_size, const ValidateOptions& opts = {});
/// validate(), then ConfigError listing every error when there is any; returns the warnings.
std::vector<std::string> check(const RunConfig& cfg, int world_size, const ValidateOptions& opts = {});

/// The config as JSON (the recipe format; every field written).
std::string to_json(const RunConfig& cfg, int indent = 2);
/// Parses a recipe JSON. Missing fields keep their defaults; an unknown section or field, a value of the
/// wrong type, or a name outside a field's accepted values is a ConfigError naming the field and listing
/// what is accepted.
RunConfig run_config_from_json(const std::string& json);
/// Sets one field from its text form (`--set section.field=value`; aliases accepted); ConfigError as above.
void set_field(RunConfig& cfg, const std::string& key, const std::string& value);
/// Every section and field with its type, default, doc, accepted values and alias, as JSON (what the
/// Python recipe classes are generated from).
std::string run_config_schema();
/// One section of `model` as JSON (for the Python presets).
std::string model_section_json(const ModelSection& m);

}  // namespace megacore::train
