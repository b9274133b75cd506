#include <cmath>

#include "test_helpers.hpp"

using namespace megacore;

TEST_CASE("Philox4x32-10 matches the published known-answer vectors", "[core][random]") {
  // Random123's kat_vectors for philox4x32_10.
  Philox4 z = philox4x32_10(Philox4{{0, 0, 0, 0}}, 0, 0);
  CHECK(z.v[0] == 0x6627e8d5u);
  CHECK(z.v[1] == 0xe169c58du);
  CHECK(z.v[2] == 0xbc57ac4cu);
  CHECK(z.v[3] == 0x9b00dbd8u);
  Philox4 o = philox4x32_10(Philox4{{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu);
  CHECK(o.v[0] == 0x408f276du);
  CHECK(o.v[1] == 0x41c83b0eu);
  CHECK(o.v[2] == 0xa20bc7c6u);
  CHECK(o.v[3] == 0x6d5451fdu);
}

TEST_CASE("uniform and normal draws have the right moments and depend only on (seed, offset, index)",
          "[core][random]") {
  Generator g(2024);
  Tensor u = Tensor::empty({1000, 100});
  u.uniform_(g, -2.0, 3.0);
  Tensor n = Tensor::empty({1000, 100});
  n.normal_(g, 1.0, 2.0);
  auto uv = u.to_double_vector(), nv = n.to_double_vector();
  double su = 0, sn = 0, sn2 = 0, lo = 1e9, hi = -1e9;
  for (double x : uv) {
    su += x;
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  for (double x : nv) {
    sn += x;
    sn2 += x * x;
  }
  double N = double(uv.size());
  REQUIRE(lo >= -2.0);
  REQUIRE(hi < 3.0);
  REQUIRE(su / N == Approx(0.5).margin(0.02));  // std of the mean ~ 1.44/sqrt(1e5) = 0.005
  double mean = sn / N, var = sn2 / N - mean * mean;
  REQUIRE(mean == Approx(1.0).margin(0.03));
  REQUIRE(var == Approx(4.0).epsilon(0.03));
  // Each draw advanced the generator, so the two draws used different offsets.
  REQUIRE(g.offset() == 2);

  // A non-contiguous view gets the values by logical index, the same as a contiguous tensor.
  Generator g1(5), g2(5);
  Tensor a = Tensor::empty({8, 6});
  a.normal_(g1);
  Tensor b = Tensor::empty({6, 8}).transpose(0, 1);
  b.normal_(g2);
  REQUIRE(a.to_double_vector() == b.to_double_vector());
}

TEST_CASE("random fills reject integer tensors and bad parameters", "[core][random][errors]") {
  Generator g(1);
  Tensor t = Tensor::empty({4}, DType::I32);
  REQUIRE_THROWS_AS(t.uniform_(g), ValueError);
  Tensor f = Tensor::empty({4});
  REQUIRE_THROWS_AS(f.uniform_(g, 1.0, 0.0), ValueError);
  REQUIRE_THROWS_AS(f.normal_(g, 0.0, -1.0), ValueError);
}

TEST_CASE("GPU random draws equal the CPU draws for the same seed", "[gpu][core][random]") {
  MC_REQUIRE_GPU();
  for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
    Generator gc(77, 3), gg(77, 3);
    Tensor c = Tensor::empty({257, 33}, dt);
    Tensor d = Tensor::empty({257, 33}, dt, Device::cuda(0));
    c.uniform_(gc, -1, 1);
    d.uniform_(gg, -1, 1);
    REQUIRE(c.to_double_vector() == d.to_double_vector());  // integer arithmetic: bit-identical
    c.normal_(gc, 0.5, 2.0);
    d.normal_(gg, 0.5, 2.0);
    auto cv = c.to_double_vector(), dv = d.to_double_vector();
    // Box-Muller in f64: the host and device libm may differ in the last f64 bit, which changes the
    // f32 result at most by one f32 ulp.
    for (size_t i = 0; i < cv.size(); ++i) REQUIRE(std::fabs(cv[i] - dv[i]) <= 1e-6 * (1 + std::fabs(cv[i])) + (dt == DType::F32 ? 0.0 : 1e-2 * std::fabs(cv[i])));
  }
}
