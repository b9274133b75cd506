// A complete C++ training program: `mpirun -np 4 ./cpp_trainer [steps] [tp] [pp]`.
// Builds the built-in corpus, a TP × PP × DP grid over the launched ranks, and trains a 4-layer Llama with
// AdamW and a cosine schedule, printing one line per step on rank 0. Exit status 0 when the loss fell.
#include <megacore/megacore.hpp>
#include <megacore/comm/bootstrap.hpp>
#include <megacore/data/blended_dataset.hpp>
#include <megacore/data/corpus.hpp>
#include <megacore/train/trainer.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

int main(int argc, char** argv) {
  using namespace megacore;
  const int64_t steps = argc > 1 ? std::atoll(argv[1]) : 20;
  const int tp = argc > 2 ? std::atoi(argv[2]) : 1, pp = argc > 3 ? std::atoi(argv[3]) : 1;
  try {
    auto world = comm::init_from_env();

    train::TrainConfig cfg;
    cfg.model = model::presets::tiny_llama();  // 2 layers, h64, GQA, SwiGLU
    cfg.model.vocab_size = data::ByteTokenizer::kVocabSize;
    cfg.parallel.tensor = tp;
    cfg.parallel.pipeline = pp;
    cfg.seq_length = 64;
    cfg.micro_batch_size = 4;
    cfg.global_batch_size = 16;
    cfg.max_steps = steps;
    cfg.lr.lr = 3e-3;
    cfg.lr.min_lr = 3e-4;
    cfg.lr.warmup_steps = 2;
    cfg.lr.decay_steps = steps;

    // Rank 0 writes the corpus and the dataset indices; the others read them after the barrier.
    const std::string dir = (std::filesystem::temp_directory_path() / "megacore_cpp_trainer").string();
    auto build = [&] {
      std::filesystem::create_directories(dir);
      const std::string prefix = dir + "/corpus";
      if (!std::filesystem::exists(prefix + ".idx")) data::write_default_corpus(prefix, {1000, 0});
      data::PretrainDatasetsConfig dc;
      dc.blend = {{1.0, prefix}};
      dc.seq_length = cfg.seq_length;
      dc.num_samples = {cfg.max_steps * cfg.global_batch_size, 0, 0};
      dc.cache_dir = dir;
      return data::build_pretrain_datasets(dc);
    };
    std::array<std::shared_ptr<data::SampleSource>, 3> ds;
    if (world->rank() == 0) ds = build();
    world->barrier();
    if (world->rank() != 0) ds = build();

    train::Trainer trainer(cfg, *world, ds[0]);
    train::TrainResult r = trainer.fit();
    const double first = r.history.front().loss, last = r.history.back().loss;
    if (world->rank() == 0) std::printf("cpp_trainer: loss %.4f -> %.4f over %lld steps\n", first, last, (long long)steps);
    return last < first ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "cpp_trainer: %s\n", e.what());
    return 1;
  }
}
