// A complete C++ training program: `mpirun -np 4 ./cpp_trainer [steps] [tp] [pp]`.
// Builds the built-in corpus, a TP × PP × DP grid over the launched ranks, and trains a 4-layer Llama with
// AdamW and a cosine schedule, printing one line per step on rank 0. Exit status 0 when the loss fell.
// The run is made from the trainer's parts (train/builder.hpp) and stepped by its own loop, the loop
// train::Trainer runs (which adds checkpoints, validation and logging). It reads its loss history through a
// TensorView and reduces a per-rank metric with the typed comm::all_reduce_value (docs/cpp.md).
#include <megacore/megacore.hpp>
#include <megacore/comm/bootstrap.hpp>
#include <megacore/data/blended_dataset.hpp>
#include <megacore/data/corpus.hpp>
#include <megacore/optim/grad_clip.hpp>
#include <megacore/train/builder.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

int main(int argc, char** argv) {
  using namespace megacore;
  const int64_t steps = argc > 1 ? std::atoll(argv[1]) : 20;
  const int tp = argc > 2 ? std::atoi(argv[2]) : 1, pp = argc > 3 ? std::atoi(argv[3]) : 1;
  try {
    auto world = comm::init_from_env();

    // The same RunConfig a recipe JSON parses into (train/run_config.hpp); fields set in code here, or
    // from text with train::set_field(cfg, "optim.lr", "3e-3") / train::run_config_from_json(...).
    train::RunConfig cfg;
    cfg.model = train::ModelSection::preset("tiny_llama");  // 2 layers, h64, GQA, SwiGLU
    cfg.model.vocab_size = data::ByteTokenizer::kVocabSize;
    cfg.resources.num_gpus_per_node = world->size();
    cfg.parallel.tensor_model_parallel_size = tp;
    cfg.parallel.pipeline_model_parallel_size = pp;
    cfg.data.seq_length = 64;
    cfg.data.micro_batch_size = 4;
    cfg.data.global_batch_size = 16;
    cfg.trainer.max_steps = steps;
    cfg.optim.lr = 3e-3;
    cfg.optim.min_lr = 3e-4;
    cfg.optim.lr_warmup_iters = 2;

    // Rank 0 writes the corpus and the dataset indices; the others read them after the barrier.
    const std::string dir = (std::filesystem::temp_directory_path() / "megacore_cpp_trainer").string();
    auto build = [&] {
      std::filesystem::create_directories(dir);
      const std::string prefix = dir + "/corpus";
      if (!std::filesystem::exists(prefix + ".idx")) data::write_default_corpus(prefix, {1000, 0});
      data::PretrainDatasetsConfig dc;
      dc.blend = {{1.0, prefix}};
      dc.seq_length = cfg.data.seq_length;
      dc.num_samples = {cfg.trainer.max_steps * cfg.data.global_batch_size, 0, 0};
      dc.cache_dir = dir;
      return data::build_pretrain_datasets(dc);
    };
    std::array<std::shared_ptr<data::SampleSource>, 3> ds;
    if (world->rank() == 0) ds = build();
    world->barrier();
    if (world->rank() != 0) ds = build();

    // Device, grid, pipeline layout, model chunks, DDP + optimizer, engine and loader, in that order; each
    // part can be built alone (train::pick_device, build_grid, build_model_chunks, ...) and replaced.
    train::check(cfg, world->size(), {.check_paths = false});
    train::TrainingParts run = train::build_training_parts(cfg, *world, ds[0]);
    layers::ForwardContext ctx;
    ctx.stream = run.placement.stream;
    train::OptimizerParts& opt = run.optimizer;
    train::OptimizerGroup& dense = opt.groups.front();  // a dense model: one group, reduced over DP
    std::vector<double> losses, step_seconds;
    for (int64_t step = 1; step <= cfg.trainer.max_steps; ++step) {
      const auto t0 = std::chrono::steady_clock::now();
      opt.zero_grad();
      std::vector<pipeline::MicroBatch> mbs = train::next_micro_batches(*run.loader, *run.grid, ctx.stream);
      const pipeline::StepResult sr = run.engine->step(ctx, mbs);
      opt.notify_tied_grads();  // tied embeddings, once the engine summed them over the first and last stage
      opt.finish_grad_sync();
      // Global-norm clipping counts every parameter once: TP-replicated ones on TP rank 0, tied copies skipped.
      optim::GradNormGroups groups = optim::grad_norm_groups(*run.grid);
      groups.skip = [&](const layers::Parameter& p) {
        for (const auto& chunk : run.chunks)
          if (chunk->is_tied_copy(p)) return true;
        return false;
      };
      optim::CheckedStepOptions co;
      co.max_norm = cfg.optim.clip_grad;
      const double lr = opt.sched->lr();
      const optim::StepResult st = optim::checked_step(*dense.opt, lr, groups, co);
      if (!st.skipped) opt.sched->step();
      if (run.placement.device.is_cuda()) ctx.stream.synchronize();
      losses.push_back(sr.loss);
      step_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      if (world->rank() == 0)
        std::printf("step %lld | loss %.4f | grad norm %.3f | lr %.3e%s\n", (long long)step, sr.loss, st.grad_norm, lr,
                    st.skipped ? " | skipped (non-finite gradients)" : "");
    }

    // The run's history as a [steps, 2] f32 tensor of (loss, step seconds), read through a typed view:
    // the dtype and rank are checked once, then indexing is plain strided access.
    const int64_t n = int64_t(losses.size());
    Tensor history = Tensor::empty({n, 2}, DType::F32);
    TensorView<float, 2> h(history);
    float seconds = 0;
    for (int64_t i = 0; i < n; ++i) {
      h(i, 0) = float(losses[size_t(i)]);
      h(i, 1) = float(step_seconds[size_t(i)]);
      seconds += h(i, 1);
    }
    // Every rank timed its own steps; the typed scalar all-reduce gives the slowest rank's total.
    const float slowest = comm::all_reduce_value(*world, seconds, comm::ReduceOp::Max);
    const double first = h(0, 0), last = h(n - 1, 0);
    if (world->rank() == 0) {
      std::printf("cpp_trainer: loss %.4f -> %.4f over %lld steps\n", first, last, (long long)steps);
      std::printf("cpp_trainer: slowest rank spent %.3f s in steps\n", double(slowest));
    }
    return last < first ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "cpp_trainer: %s\n", e.what());
    return 1;
  }
}
