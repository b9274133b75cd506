// Helpers for the ops tests: fresh random inputs, poisoned outputs, comparisons and finite differences.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "test_helpers.hpp"

namespace mctest {

/// A fresh seed per call (printed by the INFO of the caller), so every run draws new inputs. To rerun a failure
/// with its inputs, run that test case alone with MEGACORE_TEST_SEEDS set to the seeds of its fresh_seed calls in
/// order, comma-separated; `_` keeps a call's seed fresh (`_,_,1234` replays only the third). Later calls draw
/// fresh seeds again. Not thread-safe (tests call it from one thread).
inline uint64_t fresh_seed() {
  static std::mt19937_64 rng{std::random_device{}()};
  // Each entry: the seed to return, or nullopt for a fresh one.
  static const std::vector<std::optional<uint64_t>> given = [] {
    std::vector<std::optional<uint64_t>> v;
    const char* e = std::getenv("MEGACORE_TEST_SEEDS");
    if (e == nullptr || *e == '\0') return v;
    const std::string all(e);
    size_t pos = 0;
    while (true) {
      const size_t comma = all.find(',', pos);
      const std::string tok = all.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
      if (tok == "_" || tok.empty()) {
        v.emplace_back(std::nullopt);
      } else {
        char* end = nullptr;
        errno = 0;
        const unsigned long long x = std::strtoull(tok.c_str(), &end, 10);
        if (errno != 0 || end == tok.c_str() || *end != '\0' || tok[0] == '-') {
          std::fprintf(stderr, "MEGACORE_TEST_SEEDS=%s: '%s' is not a seed; give unsigned decimal seeds or _, comma-separated\n",
                       e, tok.c_str());
          std::abort();
        }
        v.emplace_back(uint64_t(x));
      }
      if (comma == std::string::npos) break;
      pos = comma + 1;
    }
    return v;
  }();
  static size_t next = 0;
  const size_t i = next++;
  if (i < given.size() && given[i]) return *given[i];
  return rng();
}

/// Normal(mean, std) values of dtype dt on device d.
inline megacore::Tensor randn(const megacore::Shape& shape, megacore::DType dt, uint64_t seed, double mean = 0.0,
                              double std = 1.0, megacore::Device d = megacore::Device::cpu()) {
  megacore::Generator g(seed, 0);
  megacore::Tensor t = megacore::Tensor::empty(shape, dt);
  t.normal_(g, mean, std);
  return t.to(d);
}

/// Uniform [lo, hi) values.
inline megacore::Tensor randu(const megacore::Shape& shape, megacore::DType dt, uint64_t seed, double lo, double hi) {
  megacore::Generator g(seed, 0);
  megacore::Tensor t = megacore::Tensor::empty(shape, dt);
  t.uniform_(g, lo, hi);
  return t;
}

/// An output tensor full of NaN, so an element the kernel does not write shows up in the comparison.
inline megacore::Tensor poisoned(const megacore::Shape& shape, megacore::DType dt, megacore::Device d) {
  megacore::Tensor t = megacore::Tensor::empty(shape, dt, d);
  if (megacore::is_floating(dt)) t.fill_(NAN);
  else t.fill_(-7777);
  return t;
}

inline megacore::Device gpu() { return megacore::Device::cuda(0); }

/// Tolerance on ||a - b|| / ||b|| for outputs of dtype dt (METHOD.md: f32 far under 1e-3, 16-bit 1e-3..1e-2).
inline double tol_for(megacore::DType dt) { return dt == megacore::DType::F32 ? 2e-5 : 1e-2; }

inline double rel_err_t(const megacore::Tensor& a, const megacore::Tensor& b) {
  return rel_err(a.to_double_vector(), b.to_double_vector());
}

/// True when a and b hold the same bytes (same dtype and shape; either may be on a GPU or strided).
inline bool same_bits(const megacore::Tensor& a, const megacore::Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  const megacore::Tensor ca = a.to(megacore::Device::cpu()).contiguous(), cb = b.to(megacore::Device::cpu()).contiguous();
  return a.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), size_t(a.nbytes())) == 0;
}

/// Central finite differences of f at x for every coordinate.
inline std::vector<double> numeric_grad(const std::function<double(const std::vector<double>&)>& f,
                                        std::vector<double> x, double h = 1e-6) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f(x);
    x[i] = x0 - h;
    const double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

inline std::vector<double> rand_vec(size_t n, uint64_t seed, double lo = -1, double hi = 1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (auto& e : v) e = u(rng);
  return v;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace mctest
