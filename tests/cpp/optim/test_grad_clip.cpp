// Gradient clipping on one process: the norm over known gradients, which parameters a TP rank counts,
// the skip predicate, the clip scale, NaN/Inf detection and bad input.
#include <cmath>
#include <limits>
#include <memory>

#include "megacore/optim/grad_clip.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::optim;
namespace ly = megacore::layers;

namespace {

struct Params {
  std::vector<std::unique_ptr<ly::Parameter>> owned;
  std::vector<ly::Parameter*> list;
  ly::Parameter* add(const std::string& name, std::vector<float> grad, int partition_dim) {
    auto p = std::make_unique<ly::Parameter>();
    p->name = name;
    const int64_t n = int64_t(grad.size());
    p->data = Tensor::zeros({n}, DType::BF16);
    p->main_grad = Tensor::from_vector(grad, {n});
    p->partition_dim = partition_dim;
    list.push_back(p.get());
    owned.push_back(std::move(p));
    return list.back();
  }
};

}  // namespace

TEST_CASE("Gradient norm counts replicated parameters on TP rank 0 only", "[optim]") {
  Params ps;
  ps.add("sharded", {3, 4}, 0);      // 25
  ps.add("replicated", {12}, -1);    // 144
  ps.add("embedding.weight", {0, 0, 8}, 0);  // 64
  GradNormGroups g;
  CHECK(global_grad_norm(ps.list, g).norm == Approx(std::sqrt(25.0 + 144 + 64)).epsilon(1e-7));
  g.tp_rank = 1;
  CHECK(global_grad_norm(ps.list, g).norm == Approx(std::sqrt(25.0 + 64)).epsilon(1e-7));
  g.tp_rank = 0;
  g.skip = [](const ly::Parameter& p) { return p.name == "embedding.weight"; };
  CHECK(global_grad_norm(ps.list, g).norm == Approx(13.0).epsilon(1e-7));
  CHECK(global_grad_norm({}, GradNormGroups{}).norm == 0.0);
}

TEST_CASE("clip_grad_norm scales every gradient by max_norm / norm, and only when above", "[optim]") {
  Params ps;
  ly::Parameter* a = ps.add("a", {3, 4}, 0);
  ly::Parameter* b = ps.add("b", {12}, -1);
  GradNormGroups g;
  g.tp_rank = 1;  // b is not counted here, but must still be scaled (its copies stay equal)
  GradNormResult r = clip_grad_norm(ps.list, 1.0, g);
  CHECK(r.finite);
  CHECK(r.norm == Approx(5.0).epsilon(1e-7));
  CHECK(r.clip_coef == Approx(1.0 / (5.0 + 1e-6)).epsilon(1e-12));
  CHECK(a->main_grad.to_double_vector()[0] == Approx(3.0 / 5.0).epsilon(1e-6));
  CHECK(b->main_grad.to_double_vector()[0] == Approx(12.0 / 5.0).epsilon(1e-6));
  CHECK(global_grad_norm(ps.list, g).norm == Approx(1.0).epsilon(1e-6));
  // Below the threshold nothing changes; max_norm 0 only measures.
  r = clip_grad_norm(ps.list, 10.0, g);
  CHECK(r.clip_coef == 1.0);
  CHECK(a->main_grad.to_double_vector()[0] == Approx(3.0 / 5.0).epsilon(1e-6));
  r = clip_grad_norm(ps.list, 0.0, g);
  CHECK(r.clip_coef == 1.0);
  CHECK(r.norm == Approx(1.0).epsilon(1e-6));
}

TEST_CASE("clip_grad_norm reports NaN and Inf gradients and leaves them unscaled", "[optim]") {
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    INFO("bad value " << bad);
    Params ps;
    ly::Parameter* a = ps.add("a", {3, 4}, 0);
    ps.add("b", {1, bad}, 0);
    const GradNormResult r = clip_grad_norm(ps.list, 1.0, GradNormGroups{});
    CHECK_FALSE(r.finite);
    CHECK_FALSE(std::isfinite(r.norm));
    CHECK(r.clip_coef == 1.0);
    CHECK(a->main_grad.to_double_vector()[0] == 3.0);
  }
  // A NaN in a replicated parameter that this TP rank does not count is another rank's to report.
  Params ps;
  ps.add("b", {std::numeric_limits<float>::quiet_NaN()}, -1);
  GradNormGroups g;
  g.tp_rank = 1;
  CHECK(global_grad_norm(ps.list, g).finite);
}

TEST_CASE("Gradient norm refuses a gradient listed twice", "[optim]") {
  Params ps;
  ly::Parameter* a = ps.add("embedding.weight", {1, 2}, 0);
  ly::Parameter tied = *a;
  tied.name = "output_layer.weight";
  std::vector<ly::Parameter*> list = ps.list;
  list.push_back(&tied);
  REQUIRE_THROWS_WITH(global_grad_norm(list, GradNormGroups{}),
                      Catch::Contains("'embedding.weight' and 'output_layer.weight' share one gradient"));
  ly::Parameter empty;
  empty.name = "w";
  REQUIRE_THROWS_WITH(global_grad_norm({&empty}, GradNormGroups{}), Catch::Contains("'w' has no main_grad"));
}
