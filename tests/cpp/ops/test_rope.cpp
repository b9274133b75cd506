#include "megacore/ops/rope.hpp"

#include <numbers>

#include "ops/ops_test_util.hpp"
#include "megacore/build_config.hpp"
#if MEGACORE_WITH_CUDA
#include "ops/cuda/rope_cuda.hpp"
#endif

using namespace megacore;
using namespace mctest;

TEST_CASE("rope backward matches finite differences (f64)", "[ops][rope]") {
  const int64_t tokens = 3, heads = 2, d = 10;
  for (bool il : {false, true}) {
    for (int64_t rot : {int64_t(10), int64_t(6)}) {
      const uint64_t seed = fresh_seed();
      INFO("interleaved " << il << " rot " << rot << " seed " << seed);
      auto x = rand_vec(tokens * heads * d, seed), g = rand_vec(tokens * heads * d, seed + 1);
      auto inv = rand_vec(rot / 2, seed + 2, 0.01, 1.0);
      std::vector<int64_t> pos{5, 0, 17};
      std::vector<double> y(x.size()), dx(x.size());
      auto loss = [&](const std::vector<double>& xx) {
        ops::ref::rope_f64(xx.data(), pos.data(), inv.data(), y.data(), tokens, heads, d, rot, il, false);
        return dot(y, g);
      };
      ops::ref::rope_f64(g.data(), pos.data(), inv.data(), dx.data(), tokens, heads, d, rot, il, true);
      CHECK(rel_err(dx, numeric_grad(loss, x)) < 1e-8);
    }
  }
}

TEST_CASE("rope inverse frequencies, Llama-3 scaling and packed positions", "[ops][rope]") {
  ops::RopeConfig cfg;
  cfg.rotary_dim = 128;
  cfg.theta = 500000;
  auto plain = ops::rope_inv_freq(cfg).to_double_vector();
  REQUIRE(plain.size() == 64);
  REQUIRE(plain[0] == 1.0);
  REQUIRE(plain[1] == Approx(std::pow(500000.0, -2.0 / 128)).epsilon(1e-6));
  cfg.scaling.type = ops::RopeScaling::Type::Llama3;
  auto scaled = ops::rope_inv_freq(cfg).to_double_vector();
  for (size_t i = 0; i < 64; ++i) {
    const double wavelen = 2 * std::numbers::pi / plain[i];
    if (wavelen < 8192.0 / 4) REQUIRE(scaled[i] == plain[i]);                          // high frequencies kept
    else if (wavelen > 8192.0) REQUIRE(scaled[i] == Approx(plain[i] / 8).epsilon(1e-6));  // low ones divided
    else REQUIRE((scaled[i] <= plain[i] && scaled[i] >= plain[i] / 8 * (1 - 1e-6)));
  }
  Tensor cu = Tensor::from_vector(std::vector<int32_t>{0, 3, 3, 5}, {4});
  REQUIRE(ops::rope_positions_from_cu_seqlens(cu).to_double_vector() == std::vector<double>{0, 1, 2, 0, 1});
  Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, 3, 2}, {3});
  REQUIRE_THROWS_WITH(ops::rope_positions_from_cu_seqlens(bad), Catch::Contains("non-decreasing"));
}

TEST_CASE("rope arguments are validated", "[ops][rope]") {
  Tensor x = Tensor::zeros({4, 2, 8}), y = Tensor::empty({4, 2, 8});
  Tensor pos = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3}, {4});
  ops::RopeConfig cfg;
  cfg.rotary_dim = 8;
  Tensor inv = ops::rope_inv_freq(cfg);
  REQUIRE_NOTHROW(ops::rope_forward(x, pos, inv, y, false));
  Tensor pos3 = Tensor::from_vector(std::vector<int32_t>{0, 1, 2}, {3});
  REQUIRE_THROWS_WITH(ops::rope_forward(x, pos3, inv, y, false), Catch::Contains("one position id per token"));
  Tensor posf = Tensor::zeros({4});
  REQUIRE_THROWS_WITH(ops::rope_forward(x, posf, inv, y, false), Catch::Contains("must be i32 or i64"));
  cfg.rotary_dim = 10;
  Tensor inv10 = ops::rope_inv_freq(cfg);
  REQUIRE_THROWS_WITH(ops::rope_forward(x, pos, inv10, y, false), Catch::Contains("rotary_dim"));
  Tensor x2 = Tensor::zeros({4, 8});
  REQUIRE_THROWS_WITH(ops::rope_forward(x2, pos, inv, y, false), Catch::Contains("[..., heads, head_dim]"));
  cfg.rotary_dim = 7;
  REQUIRE_THROWS_AS(ops::rope_inv_freq(cfg), ValueError);
}

TEST_CASE("rope CUDA kernel matches the CPU reference", "[ops][rope][gpu]") {
  MC_REQUIRE_GPU();
  struct Case { int64_t tokens, heads, d, rot; };
  for (Case c : {Case{37, 3, 64, 64}, Case{129, 8, 128, 128}, Case{33, 5, 128, 64}, Case{17, 3, 10, 6},
                 Case{11, 2, 9, 4}}) {
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
      for (bool il : {false, true}) {
        for (bool bwd : {false, true}) {
          const uint64_t seed = fresh_seed();
          INFO("tokens " << c.tokens << " heads " << c.heads << " d " << c.d << " rot " << c.rot << " " << dtype_name(dt)
                         << " interleaved " << il << " backward " << bwd << " seed " << seed);
          ops::RopeConfig cfg;
          cfg.rotary_dim = c.rot;
          cfg.theta = 500000;
          cfg.scaling.type = ops::RopeScaling::Type::Llama3;
          const Shape sh{c.tokens, c.heads, c.d};
          Tensor x = randn(sh, dt, seed);
          // packed sequences: positions restart, and reach large values
          std::vector<int64_t> pv(static_cast<size_t>(c.tokens));
          for (int64_t t = 0; t < c.tokens; ++t) pv[size_t(t)] = t < c.tokens / 2 ? t * 997 : t - c.tokens / 2;
          Tensor pos = Tensor::from_vector(pv, {c.tokens});
          if (dt == DType::BF16) pos = pos.to(DType::I32);
          Tensor inv = ops::rope_inv_freq(cfg);
          Tensor y = Tensor::empty(sh, dt);
          Device g = gpu();
          Tensor gx = x.to(g), gy = poisoned(sh, dt, g), gpos = pos.to(g), ginv = inv.to(g);
          if (bwd) {
            ops::rope_backward(x, pos, inv, y, il);
            ops::rope_backward(gx, gpos, ginv, gy, il);
          } else {
            ops::rope_forward(x, pos, inv, y, il);
            ops::rope_forward(gx, gpos, ginv, gy, il);
          }
          CHECK(rel_err_t(gy, y) < tol_for(dt));
          // in place gives the same
          ops::rope_forward(gx, gpos, ginv, gx, il);
          if (!bwd) CHECK(rel_err_t(gx, y) < tol_for(dt));
        }
      }
    }
  }
}

#if MEGACORE_WITH_CUDA
TEST_CASE("rope kernel launch shapes all match the CPU reference", "[ops][rope][gpu]") {
  MC_REQUIRE_GPU();
  const ops::cuda::RopeTuning shapes[] = {{},
                                          {.threads = 128, .head_chunk = 0, .unroll = 1},
                                          {.threads = 128, .head_chunk = 0, .unroll = 4},
                                          {.threads = 64, .head_chunk = 3, .unroll = 2},
                                          {.threads = 256, .head_chunk = 4, .unroll = 4},
                                          {.threads = 32, .head_chunk = 1, .unroll = 1}};
  struct Case { int64_t tokens, heads, d, rot; };
  for (Case c : {Case{37, 11, 128, 128}, Case{33, 5, 64, 32}, Case{17, 7, 10, 6}}) {
    for (DType dt : {DType::F32, DType::BF16}) {
      for (bool il : {false, true}) {
        const uint64_t seed = fresh_seed();
        ops::RopeConfig cfg;
        cfg.rotary_dim = c.rot;
        const Shape sh{c.tokens, c.heads, c.d};
        Tensor x = randn(sh, dt, seed);
        std::vector<int32_t> pv(static_cast<size_t>(c.tokens));
        for (int64_t t = 0; t < c.tokens; ++t) pv[size_t(t)] = int32_t(t * 131);
        Tensor pos = Tensor::from_vector(pv, {c.tokens});
        Tensor inv = ops::rope_inv_freq(cfg);
        Tensor y = Tensor::empty(sh, dt);
        ops::rope_forward(x, pos, inv, y, il);
        Device g = gpu();
        // A blocking stream: ordered after the default-stream poison fills and copies.
        Stream s = Stream::create(g, /*non_blocking=*/false);
        Tensor gx = x.to(g), gpos = pos.to(g), ginv = inv.to(g);
        for (const auto& t : shapes) {
          INFO("tokens " << c.tokens << " heads " << c.heads << " d " << c.d << " rot " << c.rot << " "
                         << dtype_name(dt) << " interleaved " << il << " seed " << seed << " threads " << t.threads
                         << " head_chunk " << t.head_chunk << " unroll " << t.unroll);
          Tensor gy = poisoned(sh, dt, g);
          ops::cuda::RopeArgs a;
          a.x = gx.data_ptr();
          a.y = gy.data_ptr();
          a.positions = gpos.data_ptr();
          a.positions_i64 = false;
          a.inv_freq = ginv.data<float>();
          a.tokens = c.tokens;
          a.heads = c.heads;
          a.head_dim = c.d;
          a.rotary_dim = c.rot;
          a.interleaved = il;
          a.tuning = t;
          ops::cuda::rope(dt, a, g.index, s.native());
          s.synchronize();
          CHECK(rel_err_t(gy, y) < tol_for(dt));
        }
      }
    }
  }
}
#endif

// ---- the fused QKV split / merge ---------------------------------------------------------------------

namespace {

struct QkvCase {
  Shape lead;  // token dimensions, e.g. [s, b]
  int64_t groups, hpg, d, rot;
};

// Shapes: GQA (hpg > 1), MHA (hpg = 1), partial rotary, one token dimension, odd head dims, 16-byte vectors.
const QkvCase kQkvCases[] = {{{5, 3}, 2, 4, 16, 16}, {{7, 2}, 4, 1, 8, 8},   {{6, 1}, 3, 2, 12, 4},
                             {{9}, 1, 3, 10, 6},     {{4, 2}, 2, 2, 64, 32}, {{3, 5}, 2, 3, 128, 128}};

Shape with(Shape lead, std::initializer_list<int64_t> tail) {
  lead.insert(lead.end(), tail);
  return lead;
}

// Packed rows: positions restart at every segment start, and the first segment reaches large ids.
Tensor packed_positions(int64_t tokens, bool i64) {
  std::vector<int64_t> pv(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) pv[size_t(t)] = t < tokens / 2 ? t * 997 : (t - tokens / 2) % 3;
  Tensor p = Tensor::from_vector(pv, {tokens});
  return i64 ? p : p.to(DType::I32);
}

Tensor llama3_inv_freq(int64_t rot) {
  ops::RopeConfig cfg;
  cfg.rotary_dim = rot;
  cfg.theta = 500000;
  cfg.scaling.type = ops::RopeScaling::Type::Llama3;
  return ops::rope_inv_freq(cfg);
}

// The unfused forward: strided copies of q, k and v, then RoPE in place on q and on k.
void unfused_split(const Tensor& qkv, const Tensor& pos, const Tensor& inv, bool il, const QkvCase& c, Tensor& q,
                   Tensor& k, Tensor& v) {
  const int64_t r = qkv.dim() - 2;
  q = qkv.narrow(r, 0, c.hpg).contiguous().view(with(c.lead, {c.groups * c.hpg, c.d}));
  k = qkv.select(r, c.hpg).contiguous();
  v = qkv.select(r, c.hpg + 1).contiguous();
  ops::rope_forward(q, pos, inv, q, il);
  ops::rope_forward(k, pos, inv, k, il);
}

// The unfused backward: RoPE's backward on dq and dk, then strided copies into the grouped layout.
Tensor unfused_merge(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& pos, const Tensor& inv,
                     bool il, const QkvCase& c) {
  Tensor rq = Tensor::empty(dq.shape(), dq.dtype(), dq.device()), rk = Tensor::empty(dk.shape(), dk.dtype(), dk.device());
  ops::rope_backward(dq, pos, inv, rq, il);
  ops::rope_backward(dk, pos, inv, rk, il);
  Tensor dqkv = Tensor::empty(with(c.lead, {c.groups, c.hpg + 2, c.d}), dq.dtype(), dq.device());
  const int64_t r = dqkv.dim() - 2;
  dqkv.narrow(r, 0, c.hpg).copy_(rq.view(with(c.lead, {c.groups, c.hpg, c.d})));
  dqkv.select(r, c.hpg).copy_(rk);
  dqkv.select(r, c.hpg + 1).copy_(dv);
  return dqkv;
}

// Fresh inputs of one case: the grouped qkv for the split, dq/dk/dv for the merge, on the host.
struct QkvRun {
  QkvCase c;
  DType dt;
  bool il;
  Shape gs, qs, ks;  // grouped, q, k/v shapes
  Tensor pos, inv, qkv, dq, dk, dv;
};

// Calls f(run) for every case × dtype × layout, with i32 or i64 positions, inside an INFO naming it.
template <class F>
void each_qkv_run(F&& f) {
  for (const QkvCase& c : kQkvCases) {
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
      for (bool il : {false, true}) {
        const uint64_t seed = fresh_seed();
        const bool i64 = (seed & 1) != 0;
        INFO("lead " << shape_str(c.lead) << " groups " << c.groups << " hpg " << c.hpg << " d " << c.d << " rot "
                     << c.rot << " " << dtype_name(dt) << " interleaved " << il << " i64 positions " << i64
                     << " seed " << seed);
        QkvRun r{c, dt, il, with(c.lead, {c.groups, c.hpg + 2, c.d}), with(c.lead, {c.groups * c.hpg, c.d}),
                 with(c.lead, {c.groups, c.d})};
        r.pos = packed_positions(shape_numel(c.lead), i64);
        r.inv = llama3_inv_freq(c.rot);
        r.qkv = randn(r.gs, dt, seed);
        r.dq = randn(r.qs, dt, seed + 1), r.dk = randn(r.ks, dt, seed + 2), r.dv = randn(r.ks, dt, seed + 3);
        f(r);
      }
    }
  }
}

struct QkvOut {
  Tensor q, k, v, dqkv;
};

// The fused split and merge on device d (outputs poisoned first), checked bit for bit against the unfused
// sequence on the same device; returns the fused outputs.
QkvOut check_fused_equals_unfused(const QkvRun& r, Device d) {
  const Tensor pos = r.pos.to(d), inv = r.inv.to(d), qkv = r.qkv.to(d);
  QkvOut o{poisoned(r.qs, r.dt, d), poisoned(r.ks, r.dt, d), poisoned(r.ks, r.dt, d), poisoned(r.gs, r.dt, d)};
  ops::qkv_split_rope(qkv, pos, inv, o.q, o.k, o.v, r.il);
  Tensor rq, rk, rv;
  unfused_split(qkv, pos, inv, r.il, r.c, rq, rk, rv);
  CHECK(same_bits(o.q, rq));
  CHECK(same_bits(o.k, rk));
  CHECK(same_bits(o.v, rv));
  const Tensor dq = r.dq.to(d), dk = r.dk.to(d), dv = r.dv.to(d);
  ops::qkv_merge_rope_backward(dq, dk, dv, pos, inv, o.dqkv, r.il);
  CHECK(same_bits(o.dqkv, unfused_merge(dq, dk, dv, pos, inv, r.il, r.c)));
  return o;
}

}  // namespace

TEST_CASE("qkv_split_rope and qkv_merge_rope_backward equal the unfused copies and RoPE bit for bit",
          "[ops][rope]") {
  each_qkv_run([](const QkvRun& r) { check_fused_equals_unfused(r, Device::cpu()); });
}

TEST_CASE("qkv_split_rope arguments are validated", "[ops][rope]") {
  const Shape gs{4, 2, 2, 3, 8};  // [s, b, groups, hpg + 2, d] with hpg 1
  Tensor qkv = Tensor::zeros(gs), pos = Tensor::from_vector(std::vector<int32_t>(8, 0), {8});
  ops::RopeConfig cfg;
  cfg.rotary_dim = 8;
  Tensor inv = ops::rope_inv_freq(cfg);
  Tensor q = Tensor::empty({4, 2, 2, 8}), k = Tensor::empty({4, 2, 2, 8}), v = Tensor::empty({4, 2, 2, 8});
  REQUIRE_NOTHROW(ops::qkv_split_rope(qkv, pos, inv, q, k, v, false));
  Tensor q_bad = Tensor::empty({4, 2, 3, 8});
  REQUIRE_THROWS_WITH(ops::qkv_split_rope(qkv, pos, inv, q_bad, k, v, false),
                      Catch::Contains("q has shape [4, 2, 3, 8], expected [4, 2, 2, 8]"));
  Tensor k16 = Tensor::empty({4, 2, 2, 8}, DType::BF16);
  REQUIRE_THROWS_WITH(ops::qkv_split_rope(qkv, pos, inv, q, k16, v, false), Catch::Contains("k has dtype bf16"));
  Tensor pos7 = Tensor::from_vector(std::vector<int32_t>(7, 0), {7});
  REQUIRE_THROWS_WITH(ops::qkv_split_rope(qkv, pos7, inv, q, k, v, false), Catch::Contains("one position id per token"));
  Tensor no_q = Tensor::zeros({4, 2, 2, 2, 8});  // hpg + 2 = 2: no query head
  REQUIRE_THROWS_WITH(ops::qkv_split_rope(no_q, pos, inv, q, k, v, false), Catch::Contains("heads_per_group + 2"));
  Tensor strided = Tensor::zeros({4, 2, 2, 3, 16}).narrow(4, 0, 8);
  REQUIRE_THROWS_WITH(ops::qkv_split_rope(strided, pos, inv, q, k, v, false), Catch::Contains("not contiguous"));
  // An output inside the input: the single pass would read what it already overwrote.
  Tensor inside = qkv.view({4 * 2 * 2 * 3 * 8}).narrow(0, 0, 4 * 2 * 2 * 8).view({4, 2, 2, 8});
  REQUIRE_THROWS_WITH(ops::qkv_split_rope(qkv, pos, inv, q, inside, v, false), Catch::Contains("share memory"));
  Tensor dqkv = Tensor::empty(gs);
  REQUIRE_THROWS_WITH(ops::qkv_merge_rope_backward(q, k, v, pos, inv, inside, false),
                      Catch::Contains("dqkv must be [..., groups, heads_per_group + 2, head_dim]"));
  REQUIRE_NOTHROW(ops::qkv_merge_rope_backward(q, k, v, pos, inv, dqkv, false));
}

TEST_CASE("qkv_split_rope and qkv_merge_rope_backward on CUDA equal the unfused CUDA sequence bit for bit",
          "[ops][rope][gpu]") {
  MC_REQUIRE_GPU();
  each_qkv_run([](const QkvRun& r) {
    const QkvOut g = check_fused_equals_unfused(r, gpu()), c = check_fused_equals_unfused(r, Device::cpu());
    // ... and the CPU path within the RoPE kernel's tolerance (f32 sincosf against f64 sin/cos).
    CHECK(rel_err_t(g.q, c.q) < tol_for(r.dt));
    CHECK(rel_err_t(g.k, c.k) < tol_for(r.dt));
    CHECK(same_bits(g.v, c.v));
    CHECK(rel_err_t(g.dqkv, c.dqkv) < tol_for(r.dt));
  });
}
