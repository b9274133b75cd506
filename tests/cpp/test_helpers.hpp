// Helpers shared by the C++ tests.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "megacore/megacore.hpp"

namespace mctest {

/// Skips the rest of a GPU test case (Catch2 v2 has no SKIP) when there is no device.
#define MC_REQUIRE_GPU()                       \
  do {                                         \
    if (!::megacore::cuda_available()) {       \
      WARN("no CUDA device: test skipped");    \
      return;                                  \
    }                                          \
  } while (0)

/// ||a - b|| / ||b|| over two equally long vectors.
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i])) return INFINITY;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / (std::sqrt(den) + 1e-300);
}

}  // namespace mctest
