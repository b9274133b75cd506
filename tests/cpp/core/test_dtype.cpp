#include <cmath>
#include <cstring>
#include <limits>

#include "test_helpers.hpp"

using namespace megacore;

namespace {
// Reference conversions through double arithmetic, independent of the bit tricks under test.
double round_to_grid(double x, int mant_bits, int min_exp, int max_exp, bool* overflow) {
  if (x == 0 || std::isnan(x)) return x;
  int e;
  std::frexp(std::fabs(x), &e);  // |x| = m * 2^e, m in [0.5, 1)
  int exp = std::max(e - 1, min_exp);
  double ulp = std::ldexp(1.0, exp - mant_bits);
  double r = std::nearbyint(x / ulp) * ulp;  // nearbyint rounds half to even in the default mode
  double max_finite = std::ldexp(2.0 - std::ldexp(1.0, -mant_bits), max_exp);
  *overflow = std::fabs(r) > max_finite;
  return r;
}
}  // namespace

TEST_CASE("dtype sizes and names round-trip", "[core][dtype]") {
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8}) {
    REQUIRE(dtype_from_name(dtype_name(t)) == t);
  }
  REQUIRE(dtype_size(DType::BF16) == 2);
  REQUIRE(dtype_size(DType::I64) == 8);
  REQUIRE(dtype_from_name("bfloat16") == DType::BF16);
  REQUIRE_THROWS_AS(dtype_from_name("f8"), ValueError);
  REQUIRE_THROWS_WITH(dtype_from_name("double"), Catch::Contains("use one of"));
}

TEST_CASE("bf16 and f16 conversions round to nearest even", "[core][dtype]") {
  Generator g(7);
  std::vector<float> vals = {0.f, -0.f, 1.f, -1.f, 65504.f, 65519.f, 65520.f, 1e-8f, 5.96e-8f, 2.98e-8f, 6.1e-5f,
                             3.0e38f, 1.0e-40f, 0.1f, 1.0f / 3.0f};
  // Random values spread over many binades.
  for (int i = 0; i < 20000; ++i) {
    float u = philox_uniform(99, 0, uint64_t(i));
    float n = philox_normal(99, 1, uint64_t(i));
    vals.push_back(n * std::ldexp(1.0f, int(u * 60) - 30));
  }
  for (float v : vals) {
    bool of = false;
    double ref16 = round_to_grid(v, 10, -14, 15, &of);
    float got16 = float(float16(v));
    if (of) REQUIRE(std::isinf(got16));
    else REQUIRE(double(got16) == ref16);
    double refb = round_to_grid(v, 7, -126, 127, &of);
    float gotb = float(bfloat16(v));
    if (!of) REQUIRE(double(gotb) == refb);
  }
  REQUIRE(std::isnan(float(bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  REQUIRE(std::isnan(float(float16(std::numeric_limits<float>::quiet_NaN()))));
  REQUIRE(std::isinf(float(float16(std::numeric_limits<float>::infinity()))));
}
