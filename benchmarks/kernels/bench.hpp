// A tiny registry for the kernel benchmark binary: each benchmarks/kernels/bench_*.cpp|.cu file
// registers functions with MC_BENCHMARK; main.cpp measures the card's ceilings first, runs every
// registered benchmark in order (or those matching a filter) and writes one JSON file.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

namespace mcbench {

struct Context {
  std::string card;                 ///< cudaDeviceProp::name of the GPU it ran on
  double gemm_bf16_tflops = 0;      ///< measured ceiling: cuBLASLt bf16 GEMM 8192^3
  double copy_tbps = 0;             ///< measured ceiling: device-to-device copy (read + write bytes)
  bool quick = false;               ///< fewer shapes/repeats (smoke runs)
  bool variants = true;             ///< also time the launch-shape variants (rows with a "variant" field)
  nlohmann::json results = nlohmann::json::array();
  /// Records one row: op, shape description, our time, bytes or flops counted, peer name and time.
  void record(nlohmann::json row) { results.push_back(std::move(row)); }
};

struct Entry {
  std::string name;
  int order;
  std::function<void(Context&)> fn;
};
std::vector<Entry>& registry();

struct Registrar {
  Registrar(const char* name, int order, std::function<void(Context&)> fn) { registry().push_back({name, order, std::move(fn)}); }
};

/// Median time in milliseconds of one fn() call (device work on the current stream), timed with CUDA
/// events after warm-up; each sample is a burst of `iters` back-to-back calls divided by `iters`, so
/// the host work of one call overlaps the device work of the one before, as in a training step where
/// the host runs ahead. iters 0: as many calls (1 to 10) as make a sample of about 2 ms, from one call
/// timed alone (torch_peers.py's bench does the same for the peers).
double time_ms(const std::function<void()>& fn, int warmup = 5, int samples = 20, int iters = 0);

}  // namespace mcbench

#define MC_BENCH_CAT2(a, b) a##b
#define MC_BENCH_CAT(a, b) MC_BENCH_CAT2(a, b)
/// MC_BENCHMARK("rmsnorm", 20) { ... uses ctx ... }
#define MC_BENCHMARK(name, order)                                                                      \
  static void MC_BENCH_CAT(mc_bench_fn_, __LINE__)(mcbench::Context & ctx);                              \
  static mcbench::Registrar MC_BENCH_CAT(mc_bench_reg_, __LINE__)(name, order, MC_BENCH_CAT(mc_bench_fn_, __LINE__)); \
  static void MC_BENCH_CAT(mc_bench_fn_, __LINE__)(mcbench::Context & ctx)
