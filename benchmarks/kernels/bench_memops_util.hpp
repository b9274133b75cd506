// Helpers for the memory-bound op benchmarks: random device tensors and the bandwidth row format.
// Each benchmark counts the fewest bytes its op must move (every input read once, every output
// written once) and reports them against the measured copy ceiling.
#pragma once

#include <cstdio>
#include <string>

#include "kernels/bench.hpp"
#include "megacore/megacore.hpp"

namespace mcbench {

inline megacore::Tensor dev_randn(const megacore::Shape& shape, megacore::DType dt, uint64_t seed, double std = 1.0) {
  megacore::Tensor t = megacore::Tensor::empty(shape, dt, megacore::Device::cuda(0));
  megacore::Generator g(seed, 0);
  t.normal_(g, 0.0, std);
  return t;
}

/// `variant` names a launch-shape variant of an op that has them ("default" for the library's own
/// choice, which is recorded first); rows of ops without variants carry no such field.
inline void record_bw(Context& ctx, const std::string& op, const std::string& shape, const std::string& dtype,
                      double ms, double bytes, const std::string& variant = "", const std::string& tuning = "") {
  const double tbps = bytes / (ms * 1e-3) / 1e12;
  nlohmann::json row{{"op", op},
                     {"shape", shape},
                     {"dtype", dtype},
                     {"ms", ms},
                     {"bytes", bytes},
                     {"tbps", tbps},
                     {"frac_copy", tbps / ctx.copy_tbps},
                     {"card", ctx.card}};
  if (!variant.empty()) row["variant"] = variant;
  if (!tuning.empty()) row["tuning"] = tuning;
  ctx.record(std::move(row));
  const std::string what = variant.empty() || variant == "default" ? shape : shape + " [" + variant + "]";
  std::printf("  %-24s %-30s %8.4f ms %7.3f TB/s %5.1f%% of copy\n", op.c_str(), what.c_str(), ms, tbps,
              100.0 * tbps / ctx.copy_tbps);
}

/// A named launch-shape variant of an op's internal tuning struct (ops::cuda::NormTuning, CeTuning).
template <class Tuning>
struct Variant {
  const char* name;
  Tuning t;
};

inline int bench_samples(const Context& ctx) { return ctx.quick ? 5 : 20; }

}  // namespace mcbench
