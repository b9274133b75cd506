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

inline void record_bw(Context& ctx, const std::string& op, const std::string& shape, const std::string& dtype,
                      double ms, double bytes) {
  const double tbps = bytes / (ms * 1e-3) / 1e12;
  ctx.record({{"op", op},
              {"shape", shape},
              {"dtype", dtype},
              {"ms", ms},
              {"bytes", bytes},
              {"tbps", tbps},
              {"frac_copy", tbps / ctx.copy_tbps},
              {"card", ctx.card}});
  std::printf("  %-24s %-30s %8.4f ms %7.3f TB/s %5.1f%% of copy\n", op.c_str(), shape.c_str(), ms, tbps,
              100.0 * tbps / ctx.copy_tbps);
}

inline int bench_samples(const Context& ctx) { return ctx.quick ? 5 : 20; }

}  // namespace mcbench
