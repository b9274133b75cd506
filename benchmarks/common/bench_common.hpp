// What the model-level benchmarks (model, training, pipeline, CP) share: their main under MPI, this rank's
// GPU, the command line (with the batch-shape and timing flags), the Llama-1.1B shape they measure and an
// NCCL communicator over the MPI world (the unique id made on rank 0 and broadcast through MPI).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "megacore/comm/bootstrap.hpp"
#include "megacore/comm/communicator.hpp"
#include "megacore/comm/nccl_communicator.hpp"
#include "megacore/model/transformer_config.hpp"

namespace bench {

/// A benchmark's main under mpirun: MPI_Init, body(), MPI_Finalize. An exception from body is printed as
/// "<name>: <what>" on stderr and makes the exit status 1.
template <class F>
int mpi_main(int argc, char** argv, const char* name, F&& body) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  try {
    body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}

/// This rank's GPU: the launcher's local rank modulo the visible GPUs.
inline megacore::Device local_gpu() {
  return megacore::Device::cuda(megacore::comm::detect_launch_env().local_rank % megacore::cuda_device_count());
}

/// Llama-3.2-1B's layers with a 32000-token untied vocabulary, no RoPE scaling, 4096 positions, bf16:
/// the ~1.1B-parameter model of ../shared/NOTES.md that the peers are measured on too.
inline megacore::model::TransformerConfig llama_1b() {
  megacore::model::TransformerConfig c = megacore::model::presets::llama32_1b();
  c.vocab_size = 32000;
  c.tie_word_embeddings = false;
  c.rope_scaling = {};
  c.max_position_embeddings = 4096;
  c.params_dtype = megacore::DType::BF16;
  return c;
}

/// An NCCL communicator over all ranks of `mpi` on `dev` (collective over `mpi`); max_ctas > 0 caps
/// NCCL's CTAs (CommOptions::nccl_max_ctas), cta_policy is CommOptions::nccl_cta_policy.
inline std::unique_ptr<megacore::comm::Communicator> nccl_over(megacore::comm::Communicator& mpi,
                                                               megacore::Device dev, const std::string& name,
                                                               std::chrono::seconds timeout, int max_ctas = 0,
                                                               int cta_policy = 0, bool copy_engine = false) {
  megacore::comm::CommOptions o;
  o.name = name;
  o.timeout = timeout;
  o.nccl_max_ctas = max_ctas;
  o.nccl_cta_policy = cta_policy;
  o.copy_engine = copy_engine;
  return megacore::comm::make_nccl_communicator_over(mpi, dev, o);
}

/// Mean seconds of f over `iters` calls after `warmup` calls, every rank of `world` in step (the stream synchronised
/// and a barrier before and after the timed loop).
template <class F>
double time_steps(megacore::comm::Communicator& world, const megacore::Stream& s, int64_t warmup, int64_t iters, F&& f) {
  for (int64_t i = 0; i < warmup; ++i) f();
  s.synchronize();
  world.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) f();
  s.synchronize();
  world.barrier();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(iters);
}

/// The median of timing samples (0 for none): what a benchmark reports from rounds that alternate its variants.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// Prints a result (JSON text) and, when out_dir is set, writes it to out_dir/<stem>_<card>.json (spaces in the
/// card's name become '_'), saying where.
inline void write_result(const std::string& json_text, const std::string& out_dir, const std::string& stem,
                         std::string card) {
  std::printf("%s\n", json_text.c_str());
  if (out_dir.empty()) return;
  std::replace(card.begin(), card.end(), ' ', '_');
  const std::string path = out_dir + "/" + stem + "_" + card + ".json";
  std::ofstream f(path);
  f << json_text << "\n";
  if (!f) throw std::runtime_error("cannot write " + path + "; check that --out-dir exists and is writable");
  std::printf("wrote %s\n", path.c_str());
}

/// The benchmarks' command line: `while (r.next())` walks the arguments; key() is the current one and
/// text()/integer()/number()/list() consume its value (runtime_error naming the flag when it is missing
/// or malformed); unknown() rejects the key.
class ArgReader {
 public:
  ArgReader(int argc, char** argv) : argc_(argc), argv_(argv) {}
  bool next() {
    if (++i_ >= argc_) return false;
    key_ = argv_[i_];
    return true;
  }
  const std::string& key() const { return key_; }
  std::string text() {
    if (i_ + 1 >= argc_) throw std::runtime_error("missing value after " + key_);
    return argv_[++i_];
  }
  int64_t integer() { return parse<int64_t>(text(), [](const std::string& v, size_t* n) { return std::stoll(v, n); }); }
  double number() { return parse<double>(text(), [](const std::string& v, size_t* n) { return std::stod(v, n); }); }
  /// A comma-separated list of integers, e.g. "4,8,16".
  std::vector<int64_t> list() { return int_list(key_, text()); }
  /// `v` as a comma-separated list of integers; runtime_error naming `flag` when an item is not one.
  static std::vector<int64_t> int_list(const std::string& flag, const std::string& v) {
    std::vector<int64_t> out;
    for (size_t p = 0; p <= v.size();) {
      size_t q = v.find(',', p);
      if (q == std::string::npos) q = v.size();
      const std::string item = v.substr(p, q - p);
      size_t n = 0;
      try {
        out.push_back(std::stoll(item, &n));
      } catch (const std::exception&) {
        n = std::string::npos;
      }
      if (n != item.size()) throw std::runtime_error(flag + " takes comma-separated integers, got '" + v + "'");
      p = q + 1;
    }
    return out;
  }
  [[noreturn]] void unknown() const {
    throw std::runtime_error("unknown argument " + key_ + " (the benchmark's header comment lists its flags)");
  }

 private:
  template <class T, class F>
  T parse(const std::string& v, F f) const {
    try {
      size_t n = 0;
      const T x = f(v, &n);
      if (n == v.size()) return x;
    } catch (const std::exception&) {
    }
    throw std::runtime_error(key_ + " needs a number, got '" + v + "'");
  }

  int argc_;
  char** argv_;
  int i_ = 0;
  std::string key_;
};

/// The batch shape and timing flags the model-level benchmarks share, with each benchmark's defaults.
struct ShapeArgs {
  int64_t micro_batch = 0, seq = 0, iters = 0, warmup = 0;
  /// Reads the current flag when it is --micro-batch, --seq, --iters or --warmup; false for any other.
  bool read(ArgReader& r) {
    const std::string& k = r.key();
    if (k == "--micro-batch") micro_batch = r.integer();
    else if (k == "--seq") seq = r.integer();
    else if (k == "--iters") iters = r.integer();
    else if (k == "--warmup") warmup = r.integer();
    else return false;
    return true;
  }
};

}  // namespace bench
