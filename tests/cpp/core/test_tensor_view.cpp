// TensorView<T, Rank>: typed, non-owning views of Tensors; a wrong dtype, rank or device is a
// ValueError that names the fix.
#include <random>
#include <type_traits>

#include "megacore/core/tensor_view.hpp"
#include "test_helpers.hpp"

using namespace megacore;

static_assert(TensorElement<float> && TensorElement<const bfloat16> && TensorElement<int64_t>);
static_assert(!TensorElement<double>, "megacore has no f64 DType; TensorView<double, R> must not compile");
static_assert(std::is_same_v<compute_type_t<bfloat16>, float> && std::is_same_v<compute_type_t<int32_t>, int32_t>);
static_assert(std::is_convertible_v<TensorView<float, 2>, TensorView<const float, 2>>);
static_assert(!std::is_convertible_v<TensorView<const float, 2>, TensorView<float, 2>>);

TEST_CASE("TensorView indexes like the tensor, through strides", "[core][typed]") {
  const uint64_t seed = std::random_device{}();
  INFO("seed " << seed);
  Tensor t = Tensor::empty({3, 5, 4});
  Generator g(seed, 0);
  t.normal_(g);
  const std::vector<double> v = t.to_double_vector();

  TensorView<float, 3> a(t);
  REQUIRE(a.shape() == std::array<int64_t, 3>{3, 5, 4});
  REQUIRE(a.stride() == std::array<int64_t, 3>{20, 4, 1});
  REQUIRE(a.data() == t.data<float>());
  REQUIRE(a.numel() == 60);
  REQUIRE(a.is_contiguous());
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 5; ++j)
      for (int k = 0; k < 4; ++k) REQUIRE(a(i, j, k) == float(v[(i * 5 + j) * 4 + k]));

  // A transposed, sliced view: the view follows the tensor's strides and offset.
  Tensor s = t.select(0, 1).transpose(0, 1).slice(1, 1, 5, 2);  // [4, 2] of t[1, 1::2, :]^T
  TensorView<const float, 2> b(s);
  REQUIRE(b.shape() == std::array<int64_t, 2>{4, 2});
  REQUIRE_FALSE(b.is_contiguous());
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 2; ++j) REQUIRE(b(k, j) == float(v[(20 + (1 + 2 * j) * 4) + k]));

  // Writes through a view land in the tensor; a const view sees them.
  a(2, 4, 3) = 7.5f;
  TensorView<const float, 3> c = a;
  REQUIRE(c.at(2, 4, 3) == 7.5f);
  REQUIRE(t.to_double_vector().back() == 7.5);

  Tensor ids = Tensor::from_vector<int64_t>({4, 8, 15, 16, 23, 42}, {2, 3});
  auto iv = view_as<int64_t, 2>(ids);
  REQUIRE(iv(1, 2) == 42);
  Tensor half = Tensor::full({3}, 1.5, DType::BF16);
  TensorView<bfloat16, 1> h(half);
  REQUIRE(float(h(2)) == 1.5f);
}

TEST_CASE("TensorView: a wrong dtype, rank or device is a ValueError naming the fix", "[core][typed]") {
  Tensor t = Tensor::zeros({2, 3}, DType::BF16);
  REQUIRE_THROWS_AS((TensorView<float, 2>(t)), ValueError);
  REQUIRE_THROWS_WITH((TensorView<float, 2>(t)),
                      Catch::Contains("TensorView<float, 2>: the tensor has dtype bf16, not f32; view it as "
                                      "TensorView<bfloat16, 2> or convert it with .to(DType::F32)"));
  REQUIRE_THROWS_AS((TensorView<bfloat16, 3>(t)), ValueError);
  REQUIRE_THROWS_WITH((TensorView<bfloat16, 3>(t)),
                      Catch::Contains("has 2 dimensions (shape [2, 3]); view it as TensorView<bfloat16, 2> or reshape"));
  REQUIRE_THROWS_WITH((TensorView<const int32_t, 1>(Tensor())), Catch::Contains("the tensor is undefined"));
  REQUIRE_THROWS_WITH((TensorView<bfloat16, 2>(t, Device::cuda(0))),
                      Catch::Contains("the tensor is on cpu but cuda:0 was required; move it with .to(Device)"));
  TensorView<bfloat16, 2> ok(t, Device::cpu());
  REQUIRE_THROWS_AS(ok.at(2, 0), ValueError);
  REQUIRE_THROWS_WITH(ok.at(0, 3), Catch::Contains("index 3 of dimension 1 is outside [0, 3)"));
}
