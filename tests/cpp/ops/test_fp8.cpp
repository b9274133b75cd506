// FP8 formats, casts, scale updates and the FP8 GEMM: the CPU path against independent references
// written here (a decoder from the bit fields with ldexp, a nearest-value search over every code, a
// plain amax-history model), and the CUDA path against the CPU path on the same inputs.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <random>
#include <vector>

#include "ops/ops_test_util.hpp"
#include "megacore/ops/fp8.hpp"
#include "megacore/ops/gemm.hpp"
#include "megacore/ops/gemm_fp8.hpp"

using namespace megacore;
using namespace megacore::ops;
using mctest::fresh_seed;

namespace {

struct Format {
  DType dt;
  int man, bias;
  double max;
  int max_code;
};
const Format kE4M3{DType::F8E4M3, 3, 7, 448.0, 0x7e};
const Format kE5M2{DType::F8E5M2, 2, 15, 57344.0, 0x7b};

// The value of a code from its fields (NaN for NaN codes, ±inf for E5M2's infinities).
double ref_decode(const Format& f, int code) {
  const int sign = code >> 7, ebits = 7 - f.man, e = (code >> f.man) & ((1 << ebits) - 1), m = code & ((1 << f.man) - 1);
  double v;
  if (f.dt == DType::F8E4M3 && e == 15 && m == 7) return NAN;
  if (f.dt == DType::F8E5M2 && e == 31) v = m == 0 ? INFINITY : NAN;
  else if (e == 0) v = std::ldexp(double(m), 1 - f.bias - f.man);
  else v = std::ldexp(double((1 << f.man) + m), e - f.bias - f.man);
  return sign ? -v : v;
}

float decode(DType dt, uint8_t b) {
  return dt == DType::F8E4M3 ? float8_e4m3::to_float(b) : float8_e5m2::to_float(b);
}
uint8_t encode(DType dt, float v) {
  return dt == DType::F8E4M3 ? float8_e4m3::from_float(v) : float8_e5m2::from_float(v);
}

// Round to nearest (ties to the even code), saturating at ±max, by search over every finite code.
int ref_encode(const Format& f, double x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xff : 0x7f;
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  int best = 0;
  double best_d = INFINITY;
  for (int c = 0; c < 0x80; ++c) {
    const double v = ref_decode(f, c);
    if (!std::isfinite(v)) continue;
    const double d = std::fabs(v - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) best = c, best_d = d;
  }
  if (a >= f.max) best = f.max_code;
  return sign | best;
}

Tensor scalar(float v, Device d = Device::cpu()) { return Tensor::full({1}, v, DType::F32).to(d); }

struct Shp {
  int64_t r, c;
};
// body(shape, input dtype, FP8 dtype) over the shapes × {f32, bf16} × {E4M3, E5M2}.
template <class F>
void for_cast_transpose_cases(std::initializer_list<Shp> shapes, F&& body) {
  for (Shp sh : shapes)
    for (DType in : {DType::F32, DType::BF16})
      for (DType q : {DType::F8E4M3, DType::F8E5M2}) {
        INFO(sh.r << "x" << sh.c << " " << dtype_name(in) << " -> " << dtype_name(q));
        body(sh, in, q);
      }
}

}  // namespace

TEST_CASE("fp8 formats: every code decodes like the bit-field reference and round-trips", "[ops][fp8]") {
  for (const Format& f : {kE4M3, kE5M2}) {
    INFO(dtype_name(f.dt));
    int nan_codes = 0;
    for (int c = 0; c < 256; ++c) {
      INFO("code " << c);
      const double want = ref_decode(f, c);
      const float got = decode(f.dt, uint8_t(c));
      if (std::isnan(want)) {
        CHECK(std::isnan(got));
        ++nan_codes;
        continue;
      }
      CHECK(double(got) == want);
      CHECK(std::signbit(got) == bool(c & 0x80));
      if (std::isinf(want)) {
        CHECK(int(encode(f.dt, got)) == ((c & 0x80) | f.max_code));  // inf saturates to max
      } else {
        CHECK(int(encode(f.dt, got)) == c);
      }
    }
    CHECK(nan_codes == (f.dt == DType::F8E4M3 ? 2 : 6));
    CHECK(decode(f.dt, uint8_t(f.max_code)) == float(f.max));
    CHECK(fp8_max(f.dt) == float(f.max));
    CHECK(dtype_size(f.dt) == 1);
    CHECK(dtype_from_name(dtype_name(f.dt)) == f.dt);
  }
  CHECK(dtype_name(DType::F8E4M3) == "f8e4m3");
  CHECK(dtype_name(DType::F8E5M2) == "f8e5m2");
}

TEST_CASE("fp8 formats: f32 values round to the nearest code, ties to even, saturating", "[ops][fp8]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  auto f32 = [](uint32_t u) { float v; std::memcpy(&v, &u, 4); return v; };
  for (const Format& f : {kE4M3, kE5M2}) {
    INFO(dtype_name(f.dt));
    std::vector<float> xs;
    std::uniform_real_distribution<double> lg(-22.0, std::log2(f.max) + 3.0);
    for (int i = 0; i < 20000; ++i) {
      const double v = std::exp2(lg(rng)) * (rng() & 1 ? -1.0 : 1.0);
      xs.push_back(float(v));
    }
    // Arbitrary f32 bit patterns: every exponent, f32 subnormals, infinities and NaN payloads.
    for (int i = 0; i < 20000; ++i) xs.push_back(f32(uint32_t(rng())));
    // Every code's value, the exact midpoints between neighbouring codes (the ties) and the f32 values
    // either side of each midpoint, up to the largest finite code.
    for (int c = 0; c <= f.max_code; ++c) {
      const double lo = ref_decode(f, c);
      xs.push_back(float(lo));
      if (c == f.max_code) break;
      const float mid = float((lo + ref_decode(f, c + 1)) / 2);
      REQUIRE(double(mid) == (lo + ref_decode(f, c + 1)) / 2);
      for (float v : {mid, std::nextafter(mid, 0.f), std::nextafter(mid, INFINITY)}) xs.push_back(v);
    }
    // Around max, beyond it, zeros, f32 subnormals and the smallest normal, NaNs.
    for (float v : {float(f.max), std::nextafter(float(f.max), 0.f), std::nextafter(float(f.max), INFINITY),
                    float(f.max) * 1.0625f, 1e30f, FLT_MAX, INFINITY, 0.f, 1e-30f, std::numeric_limits<float>::denorm_min(),
                    std::nextafter(FLT_MIN, 0.f), FLT_MIN, NAN, f32(0x7f800001u), f32(0x7fffffffu)})
      xs.push_back(v);
    for (size_t i = 0, n = xs.size(); i < n; ++i) xs.push_back(-xs[i]);
    int mismatches = 0;
    for (float x : xs) {
      const int want = ref_encode(f, x), got = encode(f.dt, x);
      if (want != got && ++mismatches < 5) FAIL_CHECK("x = " << x << ": want code " << want << ", got " << got);
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("fp8_cast: scaled rounding, amax, saturation and flush-to-zero counts (CPU)", "[ops][fp8]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  for (DType in : {DType::F32, DType::BF16}) {
    for (const Format& f : {kE4M3, kE5M2}) {
      Tensor x = mctest::randn({37, 19}, in, seed, 0.0, 3.0);
      // Plant values that saturate and values that flush to zero at this scale.
      auto xd = x.to_double_vector();
      const float scale = f.dt == DType::F8E4M3 ? 50.f : 4000.f;
      Tensor xs = x.to(DType::F32);
      float* p = xs.data<float>();
      p[3] = float(f.max / scale * 2);
      p[5] = -float(f.max / scale * 1.5);
      p[7] = float(std::ldexp(1.0, -30));
      xs = xs.to(in);
      xd = xs.to_double_vector();
      Tensor q = Tensor::empty(x.shape(), f.dt);
      Tensor amax = scalar(0.25f);  // a running amax, reduced into
      Tensor counts = Tensor::zeros({2}, DType::I64);
      fp8_cast(xs, scalar(scale), q, amax, counts);
      const auto* qb = static_cast<const uint8_t*>(q.data_ptr());
      int64_t over = 0, under = 0;
      double am = 0.25;
      for (size_t i = 0; i < xd.size(); ++i) {
        const double y = double(float(xd[i]) * scale);  // the f32 product the cast rounds
        REQUIRE(int(qb[i]) == ref_encode(f, y));
        over += std::fabs(y) > f.max;
        under += y != 0 && ref_decode(f, ref_encode(f, y)) == 0;
        am = std::max(am, std::fabs(xd[i]));
      }
      CHECK(over >= 2);
      CHECK(under >= 1);
      CHECK(counts.to_double_vector() == std::vector<double>{double(over), double(under)});
      CHECK(amax.item() == am);
      // Dequantising gives the decoded values times 1 / scale.
      Tensor back = Tensor::empty(x.shape(), DType::F32);
      fp8_dequant(q, scalar(1.f / scale), back);
      auto bd = back.to_double_vector();
      for (size_t i = 0; i < xd.size(); ++i) REQUIRE(bd[i] == double(float(ref_decode(f, qb[i])) * (1.f / scale)));
    }
  }
  // amax alone, NaN propagating.
  Tensor a = scalar(0.f);
  Tensor x = Tensor::from_vector<float>({1.f, -5.f, 2.f}, {3});
  fp8_amax(x, a);
  CHECK(a.item() == 5.0);
  x.data<float>()[1] = NAN;
  fp8_amax(x, a);
  CHECK(std::isnan(a.item()));
  // Refusals name the problem.
  Tensor q = Tensor::empty({3}, DType::F8E4M3);
  CHECK_THROWS_WITH(fp8_cast(x, Tensor::full({2}, 1.0, DType::F32), q), Catch::Contains("one element"));
  Tensor wrong = Tensor::empty({3}, DType::BF16);
  CHECK_THROWS_WITH(fp8_cast(x, scalar(1.f), wrong), Catch::Contains("f8e4m3 or f8e5m2"));
}

TEST_CASE("fp8_update_scales: delayed scaling over a sequence of steps matches a reference model", "[ops][fp8]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  std::mt19937_64 rng(seed);
  for (Fp8AmaxAlgo algo : {Fp8AmaxAlgo::Max, Fp8AmaxAlgo::MostRecent}) {
    for (int margin : {0, 2}) {
      const int64_t len = 5, n = 3;
      const std::vector<float> maxes{448.f, 448.f, 57344.f};
      Tensor hist = Tensor::zeros({len, n}, DType::F32);
      Tensor scale = Tensor::full({n}, 1.0), scale_inv = Tensor::full({n}, 1.0);
      Tensor fmax = Tensor::from_vector<float>(maxes, {n});
      // Reference: per tensor a deque of the last len amaxes, newest first, and the scale.
      std::vector<std::deque<double>> ref_hist(size_t(n), std::deque<double>(size_t(len), 0.0));
      std::vector<double> ref_scale(size_t(n), 1.0);
      std::uniform_real_distribution<double> u(-6.0, 6.0);
      for (int step = 0; step < 40; ++step) {
        INFO("step " << step << " algo " << int(algo) << " margin " << margin);
        for (int64_t j = 0; j < n; ++j) {
          double a = std::exp2(u(rng));
          if (step == 7 && j == 0) a = 0.0;              // an all-zero tensor: keep the scale
          if (step == 11 && j == 1) a = INFINITY;        // overflowed step: keep the scale while in history
          if (step == 13 && j == 2) a = NAN;
          hist.data<float>()[j] = float(a);              // row 0: this step's amax
          ref_hist[size_t(j)][0] = double(float(a));
        }
        fp8_update_scales(hist, scale, scale_inv, fmax, algo, margin);
        for (int64_t j = 0; j < n; ++j) {
          auto& h = ref_hist[size_t(j)];
          double a = h[0];
          if (algo == Fp8AmaxAlgo::Max)
            for (double v : h) a = (std::isnan(v) || v > a) ? v : a;
          if (a > 0 && std::isfinite(a)) ref_scale[size_t(j)] = double(float(float(maxes[size_t(j)] / float(a)) * std::exp2(-margin)));
          h.pop_back();
          h.push_front(0.0);
          CHECK(scale.to_double_vector()[size_t(j)] == ref_scale[size_t(j)]);
          CHECK(scale_inv.to_double_vector()[size_t(j)] == double(1.f / float(ref_scale[size_t(j)])));
        }
        // The history rolled: row k holds the amax of k steps ago, row 0 is zero for the next step.
        auto hv = hist.to_double_vector();
        for (int64_t l = 0; l < len; ++l)
          for (int64_t j = 0; j < n; ++j) {
            const double want = ref_hist[size_t(j)][size_t(l)], got = hv[size_t(l * n + j)];
            CHECK((got == want || (std::isnan(got) && std::isnan(want))));
          }
      }
    }
  }
  Tensor h = Tensor::zeros({4, 2}, DType::F32);
  Tensor s3 = Tensor::full({3}, 1.0);
  CHECK_THROWS_WITH(fp8_update_scales(h, s3, s3, s3, Fp8AmaxAlgo::Max, 0), Catch::Contains("expected 2"));
}

namespace {
// a [m, k] and b [n, k] random FP8 codes from random values scaled into range.
Tensor random_fp8(const Shape& shape, DType dt, uint64_t seed, float scale) {
  Tensor x = mctest::randn(shape, DType::F32, seed);
  Tensor q = Tensor::empty(shape, dt);
  fp8_cast(x, scalar(scale), q);
  return q;
}
}  // namespace

TEST_CASE("fp8_seed_scales: a fresh tensor's first scale from its own amax, once", "[ops][fp8]") {
  const float e4 = 448.f, e5 = 57344.f;
  // Columns: unseeded with an amax; unseeded, not this call (-1); already seeded; amax 0; margin applied.
  Tensor amax = Tensor::from_vector<float>({2.5f, -1.f, 7.f, 0.f}, {4});
  Tensor seeded = Tensor::from_vector<float>({0.f, 0.f, 1.f, 0.f}, {4});
  Tensor scale = Tensor::full({4}, 1.0), scale_inv = Tensor::full({4}, 1.0);
  Tensor mx = Tensor::from_vector<float>({e4, e4, e5, e5}, {4});
  fp8_seed_scales(amax, seeded, scale, scale_inv, mx, 1);
  const std::vector<double> sc = scale.to_double_vector(), si = scale_inv.to_double_vector(),
                            sd = seeded.to_double_vector();
  CHECK(sc[0] == double(e4 / 2.5f * 0.5f));
  CHECK(si[0] == double(1.f / (e4 / 2.5f * 0.5f)));
  CHECK(sc[1] == 1.0);
  CHECK(sc[2] == 1.0);  // seeded before: its delayed scale stays
  CHECK(sc[3] == 1.0);  // amax 0: no information, scale kept
  CHECK(sd == std::vector<double>{1.0, 0.0, 1.0, 1.0});
  // A second call changes nothing.
  Tensor again = Tensor::from_vector<float>({100.f, -1.f, 1.f, 5.f}, {4});
  fp8_seed_scales(again, seeded, scale, scale_inv, mx, 1);
  CHECK(scale.to_double_vector() == sc);
  CHECK_THROWS_AS(fp8_seed_scales(amax, Tensor::zeros({3}), scale, scale_inv, mx, 0), ValueError);
}

TEST_CASE("gemm_fp8 CPU emulation: decoded f64 reference, beta, bf16 out, refusals", "[ops][fp8][gemm]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const int64_t m = 32, n = 48, k = 64;
  for (auto [da, db] : {std::pair{DType::F8E4M3, DType::F8E4M3}, std::pair{DType::F8E5M2, DType::F8E4M3},
                        std::pair{DType::F8E4M3, DType::F8E5M2}}) {
    Tensor a = random_fp8({m, k}, da, seed, 100.f), b = random_fp8({n, k}, db, seed + 1, 60.f);
    const float sa = 1.f / 100.f, sb = 1.f / 60.f;
    auto ad = a.to(DType::F32).to_double_vector(), bd = b.to(DType::F32).to_double_vector();
    for (DType odt : {DType::F32, DType::BF16}) {
      for (float beta : {0.f, 1.f}) {
        if (beta != 0.f && odt == DType::BF16) continue;
        Tensor out = mctest::randn({m, n}, odt, seed + 2);
        auto od = out.to_double_vector();
        gemm_fp8(a, b, out, scalar(sa), scalar(sb), {.beta = beta});
        auto got = out.to_double_vector();
        std::vector<double> want(size_t(m * n));
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            double acc = 0;
            for (int64_t p = 0; p < k; ++p) acc += ad[size_t(i * k + p)] * bd[size_t(j * k + p)];
            want[size_t(i * n + j)] = double(float(sa * sb)) * acc + beta * od[size_t(i * n + j)];
          }
        CHECK(mctest::rel_err(got, want) < (odt == DType::F32 ? 1e-6 : 5e-3));
      }
    }
  }
  Tensor a = random_fp8({m, k}, DType::F8E4M3, seed, 1.f), out = Tensor::empty({m, n}, DType::F32);
  Tensor odd = random_fp8({n, 40}, DType::F8E4M3, seed, 1.f), a40 = random_fp8({m, 40}, DType::F8E4M3, seed, 1.f);
  CHECK_THROWS_WITH(gemm_fp8(a40, odd, out, scalar(1), scalar(1)), Catch::Contains("multiple of 16"));
  Tensor e5 = random_fp8({m, k}, DType::F8E5M2, seed, 1.f), e5b = random_fp8({n, k}, DType::F8E5M2, seed, 1.f);
  CHECK_THROWS_WITH(gemm_fp8(e5, e5b, out, scalar(1), scalar(1)), Catch::Contains("both f8e5m2"));
  Tensor bt = random_fp8({k, n}, DType::F8E4M3, seed, 1.f);
  CHECK_THROWS_WITH(gemm_fp8(a, bt.transpose(0, 1), out, scalar(1), scalar(1)), Catch::Contains("contiguous"));
  Tensor bf = Tensor::empty({m, k}, DType::BF16);
  CHECK_THROWS_WITH(gemm_fp8(bf, bt, out, scalar(1), scalar(1)), Catch::Contains("f8e4m3 or f8e5m2"));
  CHECK(gemm_fp8_supported(16, 32, 4096));
  CHECK_FALSE(gemm_fp8_supported(16, 40, 4096));
}

TEST_CASE("fp8_cast_transpose: fp8_cast's codes and their transpose, amax and counts (CPU)", "[ops][fp8]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  for_cast_transpose_cases({{1, 1}, {37, 50}, {64, 16}, {5, 130}}, [&](Shp sh, DType in, DType q) {
    // Wide values so some saturate and some flush to zero.
    Tensor x = mctest::randn({sh.r, sh.c}, in, seed + uint64_t(sh.r * 1000 + sh.c), 0.0, 40.0);
    const float scale = q == DType::F8E4M3 ? 9.f : 1200.f;
    Tensor ref_q = Tensor::empty(x.shape(), q), ref_a = scalar(0.5f), ref_c = Tensor::zeros({2}, DType::I64);
    fp8_cast(x, scalar(scale), ref_q, ref_a, ref_c);
    const std::vector<double> codes = ref_q.view_as_dtype(DType::U8).to_double_vector();
    std::vector<double> codes_t(codes.size());
    for (int64_t i = 0; i < sh.r; ++i)
      for (int64_t j = 0; j < sh.c; ++j) codes_t[size_t(j * sh.r + i)] = codes[size_t(i * sh.c + j)];

    Tensor got_q = Tensor::empty(x.shape(), q), got_t = Tensor::empty({sh.c, sh.r}, q);
    Tensor got_a = scalar(0.5f), got_c = Tensor::zeros({2}, DType::I64);
    fp8_cast_transpose(x, scalar(scale), got_q, got_t, got_a, got_c);
    CHECK(got_q.view_as_dtype(DType::U8).to_double_vector() == codes);
    CHECK(got_t.view_as_dtype(DType::U8).to_double_vector() == codes_t);
    CHECK(got_a.item() == ref_a.item());
    CHECK(got_c.to_double_vector() == ref_c.to_double_vector());
    // The transposed copy alone, nothing recorded.
    Tensor only_t = Tensor::empty({sh.c, sh.r}, q);
    fp8_cast_transpose(x, scalar(scale), Tensor(), only_t);
    CHECK(only_t.view_as_dtype(DType::U8).to_double_vector() == codes_t);
  });
  Tensor x = mctest::randn({32, 48}, DType::F32, seed);
  Tensor t_bad = Tensor::empty({32, 48}, DType::F8E4M3);
  REQUIRE_THROWS_WITH(fp8_cast_transpose(x, scalar(1.f), Tensor(), t_bad), Catch::Contains("out_t"));
  Tensor t = Tensor::empty({48, 32}, DType::F8E4M3), q5 = Tensor::empty({32, 48}, DType::F8E5M2);
  REQUIRE_THROWS_WITH(fp8_cast_transpose(x, scalar(1.f), q5, t), Catch::Contains("give both the same FP8 dtype"));
  REQUIRE_THROWS_WITH(fp8_cast_transpose(x.view({32, 4, 12}), scalar(1.f), Tensor(), t),
                      Catch::Contains("2-D matrix"));
}

// ---- CUDA against the CPU path -----------------------------------------------------------------------

TEST_CASE("fp8 gpu: casts, amax and counts equal the CPU path bit for bit", "[ops][fp8][gpu]") {
  MC_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  for (DType in : {DType::F32, DType::BF16, DType::F16}) {
    for (DType q : {DType::F8E4M3, DType::F8E5M2}) {
      Tensor x = mctest::randn({1000, 333}, in, seed, 0.0, 5.0);
      const float scale = q == DType::F8E4M3 ? 30.f : 3000.f;
      Tensor q_cpu = Tensor::empty(x.shape(), q), q_gpu = Tensor::empty(x.shape(), q, mctest::gpu());
      Tensor a_cpu = scalar(0.f), a_gpu = scalar(0.f, mctest::gpu());
      Tensor c_cpu = Tensor::zeros({2}, DType::I64), c_gpu = Tensor::zeros({2}, DType::I64, mctest::gpu());
      fp8_cast(x, scalar(scale), q_cpu, a_cpu, c_cpu);
      fp8_cast(x.to(mctest::gpu()), scalar(scale, mctest::gpu()), q_gpu, a_gpu, c_gpu);
      CHECK(q_gpu.to(Device::cpu()).view_as_dtype(DType::U8).to_double_vector() ==
            q_cpu.view_as_dtype(DType::U8).to_double_vector());
      CHECK(a_gpu.item() == a_cpu.item());
      CHECK(c_gpu.to_double_vector() == c_cpu.to_double_vector());
      Tensor d_cpu = Tensor::empty(x.shape(), DType::BF16), d_gpu = Tensor::empty(x.shape(), DType::BF16, mctest::gpu());
      fp8_dequant(q_cpu, scalar(1.f / scale), d_cpu);
      fp8_dequant(q_gpu, scalar(1.f / scale, mctest::gpu()), d_gpu);
      CHECK(d_gpu.to_double_vector() == d_cpu.to_double_vector());
    }
  }
  Tensor hist = mctest::randu({16, 7}, DType::F32, seed, 0.0, 10.0);
  Tensor sc = Tensor::full({7}, 1.0), si = Tensor::full({7}, 1.0), mx = Tensor::full({7}, 448.0, DType::F32);
  Tensor hg = hist.to(mctest::gpu()), sg = sc.to(mctest::gpu()), sig = si.to(mctest::gpu()), mg = mx.to(mctest::gpu());
  fp8_update_scales(hist, sc, si, mx, Fp8AmaxAlgo::Max, 1);
  fp8_update_scales(hg, sg, sig, mg, Fp8AmaxAlgo::Max, 1);
  CHECK(hg.to_double_vector() == hist.to_double_vector());
  CHECK(sg.to_double_vector() == sc.to_double_vector());
  CHECK(sig.to_double_vector() == si.to_double_vector());
  // A history longer than a block (the update kernel's chunked roll), with repeated maxima, both algorithms.
  for (auto algo : {Fp8AmaxAlgo::Max, Fp8AmaxAlgo::MostRecent}) {
    Tensor h2 = mctest::randu({1030, 3}, DType::F32, seed + 7, 0.0, 4.0);
    auto* hp = static_cast<float*>(h2.data_ptr());
    hp[700 * 3 + 1] = hp[1000 * 3 + 1] = 9.f;
    Tensor s2 = Tensor::full({3}, 1.0), i2 = Tensor::full({3}, 1.0), m2 = Tensor::full({3}, 57344.0, DType::F32);
    Tensor h2g = h2.to(mctest::gpu()), s2g = s2.to(mctest::gpu()), i2g = i2.to(mctest::gpu()), m2g = m2.to(mctest::gpu());
    fp8_update_scales(h2, s2, i2, m2, algo, 0);
    fp8_update_scales(h2g, s2g, i2g, m2g, algo, 0);
    CHECK(h2g.to_double_vector() == h2.to_double_vector());
    CHECK(s2g.to_double_vector() == s2.to_double_vector());
    CHECK(i2g.to_double_vector() == i2.to_double_vector());
  }
}

TEST_CASE("fp8 gpu: every bf16 value casts like the CPU path; seeding equals it", "[ops][fp8][gpu]") {
  MC_REQUIRE_GPU();
  // All 65536 bf16 bit patterns (NaNs, infinities, subnormals, both zeros) at scales that put them around
  // both formats' saturation and flush-to-zero points.
  std::vector<uint16_t> bits(65536);
  for (size_t i = 0; i < bits.size(); ++i) bits[i] = uint16_t(i);
  Tensor x = Tensor::empty({65536}, DType::BF16);
  std::memcpy(x.data_ptr(), bits.data(), bits.size() * 2);
  Tensor xg = x.to(mctest::gpu());
  for (DType q : {DType::F8E4M3, DType::F8E5M2}) {
    for (float scale : {1.f, 1e-3f, 37.f, 3.0e4f}) {
      INFO(dtype_name(q) << " scale " << scale);
      Tensor qc = Tensor::empty(x.shape(), q), qg = Tensor::empty(x.shape(), q, mctest::gpu());
      Tensor ac = scalar(0.f), ag = scalar(0.f, mctest::gpu());
      Tensor cc = Tensor::zeros({2}, DType::I64), cg = Tensor::zeros({2}, DType::I64, mctest::gpu());
      fp8_cast(x, scalar(scale), qc, ac, cc);
      fp8_cast(xg, scalar(scale, mctest::gpu()), qg, ag, cg);
      CHECK(qg.to(Device::cpu()).view_as_dtype(DType::U8).to_double_vector() ==
            qc.view_as_dtype(DType::U8).to_double_vector());
      CHECK(cg.to_double_vector() == cc.to_double_vector());
    }
  }
  Tensor amax = Tensor::from_vector<float>({2.5f, -1.f, 0.f}, {3}), mx = Tensor::from_vector<float>({448.f, 448.f, 57344.f}, {3});
  Tensor sd = Tensor::zeros({3}), sc = Tensor::full({3}, 1.0), si = Tensor::full({3}, 1.0);
  Tensor sdg = sd.to(mctest::gpu()), scg = sc.to(mctest::gpu()), sig = si.to(mctest::gpu());
  fp8_seed_scales(amax, sd, sc, si, mx, 0);
  fp8_seed_scales(amax.to(mctest::gpu()), sdg, scg, sig, mx.to(mctest::gpu()), 0);
  CHECK(sdg.to_double_vector() == sd.to_double_vector());
  CHECK(scg.to_double_vector() == sc.to_double_vector());
  CHECK(sig.to_double_vector() == si.to_double_vector());
}

TEST_CASE("gemm_fp8 gpu: cuBLASLt equals the CPU emulation up to f32 summation order", "[ops][fp8][gemm][gpu]") {
  MC_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  struct Shp { int64_t m, n, k; };
  for (Shp sh : {Shp{16, 16, 16}, Shp{128, 256, 512}, Shp{1024, 768, 2048}}) {
    for (auto [da, db] : {std::pair{DType::F8E4M3, DType::F8E4M3}, std::pair{DType::F8E5M2, DType::F8E4M3}}) {
      for (DType odt : {DType::F32, DType::BF16}) {
        for (bool fast : {false, true}) {
          INFO("m=" << sh.m << " n=" << sh.n << " k=" << sh.k << " a=" << dtype_name(da) << " out=" << dtype_name(odt)
                    << " fast_accum=" << fast);
          Tensor a = random_fp8({sh.m, sh.k}, da, seed, 80.f), b = random_fp8({sh.n, sh.k}, db, seed + 1, 40.f);
          const float beta = odt == DType::F32 ? 1.f : 0.f;
          Tensor out0 = mctest::randn({sh.m, sh.n}, odt, seed + 2);
          Tensor ref = out0.clone(), got = out0.to(mctest::gpu());
          gemm_fp8(a, b, ref, scalar(1.f / 80), scalar(1.f / 40), {.beta = beta});
          gemm_fp8(a.to(mctest::gpu()), b.to(mctest::gpu()), got, scalar(1.f / 80, mctest::gpu()),
                   scalar(1.f / 40, mctest::gpu()), {.beta = beta, .fast_accum = fast});
          // f32 sums of exact products in another order. Hopper's FP8 tensor cores keep their partial sums below
          // f32 precision in both modes: without fast accumulation cuBLASLt promotes them to f32 every few k-blocks
          // (measured up to 1.3e-4 relative on an H200 at k = 2048, 2026-11-27), with it only at the end.
          const double tol = odt == DType::BF16 ? 1e-2 : (fast ? 2e-3 : 5e-4);
          CHECK(mctest::rel_err_t(got.to(Device::cpu()), ref) < tol);
        }
      }
    }
  }
}

TEST_CASE("gemm_fp8 gpu: scales given as slots of one packed array", "[ops][fp8][gemm][gpu]") {
  // The FP8 linears keep their scales as one [3] array and pass slots of it: pointers 4 and 8 bytes past an
  // allocation's start.
  MC_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const int64_t m = 256, n = 384, k = 512;
  Tensor a = random_fp8({m, k}, DType::F8E4M3, seed, 80.f), b = random_fp8({n, k}, DType::F8E4M3, seed + 1, 40.f);
  Tensor packed = Tensor::empty({3}, DType::F32);
  float* pv = static_cast<float*>(packed.data_ptr());
  pv[0] = 0.5f, pv[1] = 1.f / 80, pv[2] = 1.f / 40;
  Tensor ref = Tensor::empty({m, n}, DType::BF16);
  gemm_fp8(a, b, ref, scalar(1.f / 80), scalar(1.f / 40), {});
  Tensor pg = packed.to(mctest::gpu());
  for (bool fast : {false, true}) {
    INFO("fast_accum=" << fast);
    Tensor got = Tensor::empty({m, n}, DType::BF16, mctest::gpu());
    gemm_fp8(a.to(mctest::gpu()), b.to(mctest::gpu()), got, pg.narrow(0, 1, 1), pg.narrow(0, 2, 1),
             {.fast_accum = fast});
    CHECK(mctest::rel_err_t(got.to(Device::cpu()), ref) < 1e-2);
  }
}

TEST_CASE("fp8_cast_transpose gpu: codes, transpose, amax and counts equal the CPU path bit for bit",
          "[ops][fp8][gpu]") {
  MC_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  // Edge tiles in both dimensions (8-multiple shapes smaller than a 128 × 128 tile and cut ones), one tile, and more
  // tiles than the grid holds blocks.
  for_cast_transpose_cases({{33, 70}, {32, 32}, {8, 8}, {136, 40}, {1000, 48}, {4096, 2080}}, [&](Shp sh, DType in, DType q) {
    Tensor x = mctest::randn({sh.r, sh.c}, in, seed, 0.0, 5.0);
    const float scale = q == DType::F8E4M3 ? 30.f : 3000.f;
    Tensor q_cpu = Tensor::empty(x.shape(), q), t_cpu = Tensor::empty({sh.c, sh.r}, q);
    Tensor q_gpu = Tensor::empty(x.shape(), q, mctest::gpu()), t_gpu = Tensor::empty({sh.c, sh.r}, q, mctest::gpu());
    Tensor a_cpu = scalar(0.f), a_gpu = scalar(0.f, mctest::gpu());
    Tensor c_cpu = Tensor::zeros({2}, DType::I64), c_gpu = Tensor::zeros({2}, DType::I64, mctest::gpu());
    fp8_cast_transpose(x, scalar(scale), q_cpu, t_cpu, a_cpu, c_cpu);
    fp8_cast_transpose(x.to(mctest::gpu()), scalar(scale, mctest::gpu()), q_gpu, t_gpu, a_gpu, c_gpu);
    CHECK(q_gpu.to(Device::cpu()).view_as_dtype(DType::U8).to_double_vector() ==
          q_cpu.view_as_dtype(DType::U8).to_double_vector());
    CHECK(t_gpu.to(Device::cpu()).view_as_dtype(DType::U8).to_double_vector() ==
          t_cpu.view_as_dtype(DType::U8).to_double_vector());
    CHECK(a_gpu.item() == a_cpu.item());
    CHECK(c_gpu.to_double_vector() == c_cpu.to_double_vector());
    Tensor only_t = Tensor::empty({sh.c, sh.r}, q, mctest::gpu());
    fp8_cast_transpose(x.to(mctest::gpu()), scalar(scale, mctest::gpu()), Tensor(), only_t);
    CHECK(only_t.to(Device::cpu()).view_as_dtype(DType::U8).to_double_vector() ==
          t_cpu.view_as_dtype(DType::U8).to_double_vector());
  });
}
