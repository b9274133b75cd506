// ParamAndGradBuffer layout, DistributedOptimizer at DP = 1 against AdamW, state layout checks,
// DynamicLossScaler and checked_step (single process; the multi-rank cases are in mpi_test_ddp.cpp).
#include <algorithm>
#include <cmath>
#include <memory>

#include <fmt/format.h>

#include "layers/layers_test_util.hpp"
#include "megacore/optim/distributed_optimizer.hpp"
#include "megacore/optim/loss_scaler.hpp"
#include "megacore/optim/param_and_grad_buffer.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::optim;
namespace ly = megacore::layers;

namespace {

struct Params {
  std::vector<std::unique_ptr<ly::Parameter>> owned;
  std::vector<ly::Parameter*> list;
  ly::Parameter* add(const std::string& name, const Shape& shape, DType dt, double seed) {
    auto p = std::make_unique<ly::Parameter>();
    p->name = name;
    p->data = layers_test::randn(shape, uint64_t(seed * 100)).to(dt);
    p->main_grad = layers_test::randn(shape, uint64_t(seed * 100 + 1));
    list.push_back(p.get());
    owned.push_back(std::move(p));
    return list.back();
  }
};

Params make_params() {
  Params m;
  m.add("embedding.weight", {10, 7}, DType::F32, 1);
  m.add("layers.0.linear_fc1.weight", {9, 5}, DType::BF16, 2);
  m.add("layers.0.norm.weight", {5}, DType::F32, 3);
  m.add("layers.0.linear_fc2.bias", {13}, DType::BF16, 4);
  m.add("output_layer.weight", {6, 11}, DType::F32, 5);
  return m;
}

void set_grads(const std::vector<ly::Parameter*>& ps, int step) {
  for (size_t i = 0; i < ps.size(); ++i) ps[i]->main_grad.copy_(layers_test::randn(ps[i]->data.shape(), 1000 + 10 * uint64_t(step) + i));
}

}  // namespace

TEST_CASE("ParamAndGradBuffer: reverse order, buckets, alignment, padding, values kept", "[optim][ddp]") {
  Params m = make_params();
  std::vector<std::vector<double>> data0, grad0;
  for (ly::Parameter* p : m.list) {
    data0.push_back(p->data.to_double_vector());
    grad0.push_back(p->main_grad.to_double_vector());
  }
  const int dp = 4;
  ParamAndGradBuffer buf(m.list, {.bucket_size = 70, .dp_size = dp, .param_align = 8});
  REQUIRE(buf.num_groups() == 2);
  // Groups in the order dtypes appear going backward: output (f32) first, then the bf16 bias.
  REQUIRE(buf.group_dtype(0) == DType::F32);
  REQUIRE(buf.group_dtype(1) == DType::BF16);
  for (size_t i = 0; i < m.list.size(); ++i) {
    ly::Parameter* p = m.list[i];
    INFO(p->name);
    REQUIRE(p->data.to_double_vector() == data0[i]);   // values copied in
    REQUIRE(p->main_grad.to_double_vector() == grad0[i]);
    const ParamLocation& l = buf.location(p);
    REQUIRE(l.offset % 8 == 0);
    REQUIRE(p->data.data_ptr() == static_cast<char*>(buf.param_buffer(l.group).data_ptr()) + l.offset * p->data.element_size());
    REQUIRE(p->main_grad.data_ptr() == static_cast<float*>(buf.grad_buffer(l.group).data_ptr()) + l.offset);
    const Bucket& b = buf.buckets()[size_t(l.bucket)];
    REQUIRE(l.offset >= b.offset);
    REQUIRE(l.offset + l.numel <= b.offset + b.numel);
  }
  // Within a group, later parameters of the list come first (backward order).
  REQUIRE(buf.location(m.list[4]).offset < buf.location(m.list[2]).offset);
  REQUIRE(buf.location(m.list[2]).offset < buf.location(m.list[0]).offset);
  REQUIRE(buf.location(m.list[3]).offset < buf.location(m.list[1]).offset);
  // Buckets: padded to dp × align, contiguous, a bucket closes once it reaches 70 elements.
  int64_t total = 0;
  for (const Bucket& b : buf.buckets()) {
    REQUIRE(b.numel % (dp * 8) == 0);
    REQUIRE(!b.params.empty());
    total += b.numel;
  }
  REQUIRE(total == buf.numel());
  // f32: output (66) < 70, + norm (at 72, 5 elements) reaches 77 ≥ 70 and closes bucket 0; the embedding
  // (70) fills bucket 1; bf16: bias (13) + fc1 (at 16, 45) = 61, closed at the end as bucket 2.
  REQUIRE(buf.buckets().size() == 3);
  REQUIRE(buf.buckets()[0].params == std::vector<size_t>{4, 2});
  REQUIRE(buf.buckets()[1].params == std::vector<size_t>{0});
  REQUIRE(buf.buckets()[2].params == std::vector<size_t>{3, 1});
  // Writing through a parameter writes the buffer.
  m.list[0]->main_grad.fill_(2.0);
  REQUIRE(buf.bucket_grads(1).to_double_vector()[0] == 2.0);
  buf.zero_grads();
  for (double v : m.list[0]->main_grad.to_double_vector()) REQUIRE(v == 0.0);
  REQUIRE(buf.param_numel() == 70 + 45 + 5 + 13 + 66);
  REQUIRE(default_bucket_size(1) == 40'000'000);
  REQUIRE(default_bucket_size(64) == 64'000'000);
}

TEST_CASE("ParamAndGradBuffer: separate parameters fill buckets of their own", "[optim][ddp]") {
  // A layer-like order: norm, weight, norm, weight, ... (all bf16); the weights are the separate ones.
  Params m;
  std::vector<const ly::Parameter*> sep;
  for (int l = 0; l < 4; ++l) {
    m.add(fmt::format("layers.{}.norm.weight", l), {5 + l}, DType::BF16, 10 + l);
    sep.push_back(m.add(fmt::format("layers.{}.fc.weight", l), {6, 4 + l}, DType::BF16, 20 + l));
  }
  m.add("final_norm.weight", {7}, DType::BF16, 30);
  for (int64_t bucket_size : {int64_t(-1), int64_t(40), int64_t(1)}) {
    INFO("bucket_size " << bucket_size);
    const int dp = 2;
    ParamAndGradBuffer plain(m.list, {.bucket_size = bucket_size, .dp_size = dp, .param_align = 4});
    ParamAndGradBuffer buf(m.list, {.bucket_size = bucket_size, .dp_size = dp, .param_align = 4, .separate = sep});
    int64_t end = 0;
    int n_sep = 0;
    for (const Bucket& b : buf.buckets()) {
      REQUIRE(b.offset == end);  // contiguous, in order
      REQUIRE(b.numel % (dp * 4) == 0);
      end += b.numel;
      n_sep += b.separate ? 1 : 0;
      for (size_t i : b.params) {
        const bool is_sep = std::find(sep.begin(), sep.end(), m.list[i]) != sep.end();
        REQUIRE(is_sep == b.separate);  // never mixed
        const ParamLocation& l = buf.location(i);
        REQUIRE(l.bucket == b.index);
        REQUIRE(l.offset >= b.offset);
        REQUIRE(l.offset + l.numel <= b.offset + b.numel);
        REQUIRE(l.offset % 4 == 0);
      }
    }
    REQUIRE(end == buf.param_buffer(0).numel());
    REQUIRE(n_sep >= 1);
    REQUIRE(n_sep < int(buf.buckets().size()));
    if (bucket_size < 0) REQUIRE(buf.buckets().size() == 2);               // one bucket per kind
    if (bucket_size == 1) REQUIRE(buf.buckets().size() == m.list.size());  // one per parameter, as without
    // Without separate parameters the layout is the plain one; the first bucket still starts with the last
    // parameter (backward order).
    REQUIRE(buf.buckets().front().params.front() == m.list.size() - 1);
    REQUIRE(std::none_of(plain.buckets().begin(), plain.buckets().end(), [](const Bucket& b) { return b.separate; }));
    for (ly::Parameter* p : m.list) REQUIRE(p->data.data_ptr() != nullptr);
  }
  // Values survive the re-pointing.
  const std::vector<double> before = m.list[1]->data.to_double_vector();
  ParamAndGradBuffer again(m.list, {.bucket_size = 40, .dp_size = 2, .param_align = 4, .separate = sep});
  REQUIRE(m.list[1]->data.to_double_vector() == before);
  Params other;
  other.add("x", {3}, DType::BF16, 1);
  REQUIRE_THROWS_AS(ParamAndGradBuffer(other.list, {.separate = sep}), ValueError);
}

TEST_CASE("ParamAndGradBuffer: shared copies follow, bad input is a ValueError", "[optim][ddp]") {
  Params m = make_params();
  ly::Parameter tied;  // e.g. a tied output layer's Parameter object
  tied.name = "head";
  tied.data = m.list[0]->data;
  tied.main_grad = m.list[0]->main_grad;
  ParamAndGradBuffer buf(m.list, {.bucket_size = -1}, {&tied});
  REQUIRE(buf.buckets().size() == 2);  // one per dtype
  REQUIRE(tied.data.data_ptr() == m.list[0]->data.data_ptr());
  REQUIRE(tied.main_grad.data_ptr() == m.list[0]->main_grad.data_ptr());
  REQUIRE(buf.index_of(&tied) == 0);

  ly::Parameter stranger;
  stranger.name = "stranger";
  stranger.data = Tensor::zeros({2});
  stranger.main_grad = Tensor::zeros({2});
  REQUIRE_THROWS_WITH(buf.index_of(&stranger), Catch::Contains("'stranger' is not registered"));
  Params m2 = make_params();
  REQUIRE_THROWS_WITH(ParamAndGradBuffer(m2.list, {}, {&stranger}), Catch::Contains("aliases none"));
  std::vector<ly::Parameter*> dup = m2.list;
  dup.push_back(m2.list[1]);
  REQUIRE_THROWS_WITH(ParamAndGradBuffer(dup), Catch::Contains("listed twice"));
  REQUIRE_THROWS_AS(ParamAndGradBuffer(m2.list, {.dp_size = 0}), ValueError);
  REQUIRE_THROWS_AS(ParamAndGradBuffer({}), ValueError);
}

TEST_CASE("DistributedOptimizer at DP 1 equals AdamW bit for bit; state layout is checked", "[optim][ddp]") {
  Params a = make_params(), b = make_params();
  AdamWConfig cfg;
  cfg.weight_decay = 0.1f;
  AdamW ref(a.list, cfg);
  layers_test::NoCommCommunicator one(0, 1);  // DP = 1: no collective may run
  DDPConfig dc;
  dc.use_distributed_optimizer = true;
  dc.bucket_size = 60;
  DistributedDataParallel ddp(b.list, one, dc);
  DistributedOptimizer opt(ddp, cfg);
  REQUIRE(ddp.buffer().buckets().size() >= 3);
  for (int step = 0; step < 4; ++step) {
    set_grads(a.list, step);
    set_grads(b.list, step);
    ddp.finish_grad_sync();
    ref.step(0.01f, 0.5f);
    opt.step(0.01f, 0.5f);
  }
  for (size_t i = 0; i < a.list.size(); ++i) layers_test::require_equal(b.list[i]->data, a.list[i]->data, a.list[i]->name.c_str());
  const std::vector<NamedTensor> want = ref.state(), got = opt.gathered_state();
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    REQUIRE(got[i].name == want[i].name);
    layers_test::require_equal(got[i].tensor, want[i].tensor, got[i].name.c_str());
  }
  REQUIRE(opt.state_bytes() == 12 * ddp.buffer().numel());

  // Sharded state round trip, then a different bucket layout is refused.
  Params c = make_params();
  DistributedDataParallel ddp2(c.list, one, dc);
  DistributedOptimizer opt2(ddp2, cfg);
  opt2.load_state(opt.state(), opt.step_count());
  for (size_t i = 0; i < a.list.size(); ++i) layers_test::require_equal(c.list[i]->data, a.list[i]->data, "loaded");
  Params d = make_params();
  DDPConfig other = dc;
  other.bucket_size = 1000;
  DistributedDataParallel ddp3(d.list, one, other);
  DistributedOptimizer opt3(ddp3, cfg);
  REQUIRE_THROWS_WITH(opt3.load_state(opt.state(), 4), Catch::Contains("bucket layout differs"));
  // ... but the gathered (per-parameter) state loads into any layout.
  opt3.load_gathered_state(opt.gathered_state(), 4);
  for (size_t i = 0; i < a.list.size(); ++i) layers_test::require_equal(d.list[i]->data, a.list[i]->data, "resharded");
  std::vector<NamedTensor> bad = want;
  bad[4].tensor = Tensor::zeros({3, 3});
  REQUIRE_THROWS_WITH(opt3.load_gathered_state(bad, 4), Catch::Contains("a different TP layout"));
  bad = want;
  bad.pop_back();
  REQUIRE_THROWS_AS(opt3.load_gathered_state(bad, 4), ValueError);
  // And AdamW takes the gathered state (same names, shapes and order).
  Params e = make_params();
  AdamW plain(e.list, cfg);
  plain.load_state(opt.gathered_state(), 4);
  for (size_t i = 0; i < a.list.size(); ++i) layers_test::require_equal(e.list[i]->data, a.list[i]->data, "AdamW");
}

TEST_CASE("DynamicLossScaler follows growth, hysteresis, back-off and bounds", "[optim][scaler]") {
  LossScalerConfig c;
  c.initial_scale = 1024;
  c.growth_interval = 3;
  c.hysteresis = 2;
  c.min_scale = 256;
  c.max_scale = 4096;
  DynamicLossScaler s(c);
  // An independent statement of the rule, stepped alongside.
  double scale = 1024;
  int64_t good = 0;
  int hyst = 2;
  const std::vector<bool> pattern = {false, false, false, true,  false, true, true,  true, true,
                                     true,  false, false, false, false, false, false, false, false, false, false,
                                     false, false, false, false, false, false};
  for (bool inf : pattern) {
    if (inf) {
      good = 0;
      if (--hyst <= 0) {
        scale = std::max(scale / 2, 256.0);
        hyst = 0;
      }
    } else if (++good == 3) {
      good = 0;
      hyst = 2;
      scale = std::min(scale * 2, 4096.0);
    }
    s.update(inf);
    REQUIRE(s.scale() == scale);
    REQUIRE(s.state().growth_tracker == good);
  }
  REQUIRE(s.scale() == 4096);  // capped
  DynamicLossScaler t(c);
  t.load_state(s.state());
  REQUIRE(t.scale() == s.scale());
  REQUIRE_THROWS_AS(DynamicLossScaler(LossScalerConfig{.initial_scale = 0, .growth_factor = 0.5}), ConfigError);
  REQUIRE_THROWS_AS(t.load_state({.scale = -1}), ValueError);
}

TEST_CASE("checked_step: scaled gradients, clipping, skip on overflow", "[optim][scaler]") {
  Params a = make_params(), b = make_params();
  AdamW ref(a.list, {}), opt(b.list, {});
  DynamicLossScaler scaler({.initial_scale = 256, .hysteresis = 1});
  const double gs = 0.5, max_norm = 0.7;
  for (int step = 0; step < 3; ++step) {
    set_grads(a.list, step);
    // b carries the loss scale; both are weighted by gs.
    for (size_t i = 0; i < a.list.size(); ++i) {
      std::vector<Tensor> src{a.list[i]->main_grad}, dst{b.list[i]->main_grad};
      ops::multi_tensor_scale(src, dst, float(scaler.scale()));
    }
    std::vector<double> sq;
    for (ly::Parameter* p : a.list)
      for (double v : p->main_grad.to_double_vector()) sq.push_back(v * gs);
    double n2 = 0;
    for (double v : sq) n2 += v * v;
    const double norm = std::sqrt(n2), coef = std::min(1.0, max_norm / (norm + 1e-6));
    const double scale_before = scaler.scale();
    StepResult r = checked_step(opt, 0.01, {}, {.max_norm = max_norm, .grad_scale = gs, .scaler = &scaler});
    REQUIRE(!r.skipped);
    REQUIRE(r.loss_scale == scale_before);
    REQUIRE(std::abs(r.grad_norm - norm) <= 1e-5 * norm);
    REQUIRE(std::abs(r.clip_coef - coef) <= 1e-6);
    ref.step(0.01f, float(coef * gs));
  }
  for (size_t i = 0; i < a.list.size(); ++i) layers_test::require_close(b.list[i]->data.to(DType::F32), a.list[i]->data.to(DType::F32), 1e-5, "stepped");
  // An Inf gradient: reported, skipped, parameters unchanged, scale backed off (hysteresis 1).
  std::vector<std::vector<double>> before;
  for (ly::Parameter* p : b.list) before.push_back(p->data.to_double_vector());
  b.list[1]->main_grad.fill_(INFINITY);
  const double s0 = scaler.scale();
  StepResult r = checked_step(opt, 0.01, {}, {.scaler = &scaler});
  REQUIRE(r.found_inf);
  REQUIRE(r.skipped);
  REQUIRE(!std::isfinite(r.grad_norm));
  REQUIRE(scaler.scale() == s0 / 2);
  REQUIRE(opt.step_count() == 3);
  for (size_t i = 0; i < b.list.size(); ++i) REQUIRE(b.list[i]->data.to_double_vector() == before[i]);
  // NaN without a scaler is detected too.
  b.list[0]->main_grad.fill_(NAN);
  REQUIRE(checked_step(opt, 0.01, {}).skipped);
}
