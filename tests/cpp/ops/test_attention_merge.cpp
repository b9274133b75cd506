// The context-parallel merge ops (ops/attention_merge.hpp) and the ring's block decomposition of causal
// attention (layers/attention.cpp): every CP rank's blocks, run through the attention op and merged with
// their LSE, give full causal attention and its gradients. On CPU with the reference backend (f32, tight),
// and on GPUs with the cuDNN and flash backends (bf16/f16, against the f32 reference) and the merge kernels.
#include "megacore/ops/attention_merge.hpp"

#include <limits>

#include "megacore/ops/attention.hpp"
#include "megacore/parallel/context_parallel.hpp"
#include "ops/ops_test_util.hpp"

using namespace megacore;
using namespace mctest;

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// [S, B, H, D] sequence-first, as the layer holds it, seen as the op's [B, S, H, D].
Tensor bshd(const Tensor& t) { return t.permute({1, 0, 2, 3}); }

struct RingCase {
  int cp = 2;
  int64_t c = 8, b = 2, heads = 4, groups = 2, dim = 16;
  DType dt = DType::F32;
  Device dev = Device::cpu();
  ops::AttentionBackend backend = ops::AttentionBackend::Auto;
};

struct RingResult {
  std::vector<Tensor> out, lse, dq;  // per CP rank, local rows (f32, CPU)
  Tensor dk, dv;                     // global [L, B, G, D] f32, CPU: every rank's contribution summed
};

// Emulates the ring of layers/attention.cpp in one process: for each CP rank r, its local queries against
// the K/V block of rank src = (r − i) mod CP at step i (step 0 causal over the own block; src < r: all
// queries × the block's first chunk; src > r: the late query chunk × the whole block), partials merged
// with ops::attention_merge_partial, then the block backward with the merged output and LSE.
RingResult run_ring(const RingCase& k, const Tensor& q, const Tensor& kk, const Tensor& v, const Tensor& dout) {
  const int n = k.cp;
  const int64_t s = 2 * k.c, b = k.b, H = k.heads, G = k.groups, d = k.dim, L = s * n;
  auto local = [&](const Tensor& t, int r) { return parallel::cp_slice_sequence(t, 0, r, n).to(k.dt).to(k.dev); };
  RingResult res;
  std::vector<Tensor> dk_blk(static_cast<size_t>(n)), dv_blk(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    dk_blk[size_t(r)] = Tensor::zeros({s, b, G, d}, DType::F32, k.dev);
    dv_blk[size_t(r)] = Tensor::zeros({s, b, G, d}, DType::F32, k.dev);
  }
  for (int r = 0; r < n; ++r) {
    const Tensor ql = local(q, r), dol = local(dout, r);
    Tensor acc = Tensor::zeros({s, b, H, d}, DType::F32, k.dev);
    Tensor acc_lse = Tensor::full({b, H, s}, kNegInf, DType::F32, k.dev);
    struct Blk { int src; int64_t q_off, q_len, k_len; bool causal; };
    std::vector<Blk> blks;
    for (int i = 0; i < n; ++i) {
      const int src = (r - i + n) % n;
      if (i == 0) blks.push_back({src, 0, s, s, true});
      else if (src < r) blks.push_back({src, 0, s, k.c, false});
      else blks.push_back({src, k.c, k.c, s, false});
    }
    for (const Blk& bl : blks) {
      const Tensor kb = local(kk, bl.src), vb = local(v, bl.src);
      ops::AttentionOptions o;
      o.causal = bl.causal, o.backend = k.backend;
      Tensor op = Tensor::empty({bl.q_len, b, H, d}, k.dt, k.dev);
      Tensor lp = Tensor::empty({b, H, bl.q_len}, DType::F32, k.dev);
      Tensor op4 = bshd(op);
      ops::attention_forward(bshd(ql.narrow(0, bl.q_off, bl.q_len)), bshd(kb.narrow(0, 0, bl.k_len)),
                             bshd(vb.narrow(0, 0, bl.k_len)), op4, lp, o);
      ops::attention_merge_partial(acc, acc_lse, op, lp, bl.q_off);
    }
    const Tensor out = acc.to(k.dt);
    Tensor dq_acc = Tensor::zeros({s, b, H, d}, DType::F32, k.dev);
    for (const Blk& bl : blks) {
      const Tensor kb = local(kk, bl.src), vb = local(v, bl.src);
      ops::AttentionOptions o;
      o.causal = bl.causal, o.backend = k.backend;
      Tensor lp = acc_lse.narrow(2, bl.q_off, bl.q_len).contiguous();
      Tensor dqp = Tensor::empty({bl.q_len, b, H, d}, k.dt, k.dev);
      Tensor dkp = Tensor::empty({bl.k_len, b, G, d}, k.dt, k.dev);
      Tensor dvp = Tensor::empty({bl.k_len, b, G, d}, k.dt, k.dev);
      Tensor dq4 = bshd(dqp), dk4 = bshd(dkp), dv4 = bshd(dvp);
      ops::attention_backward(bshd(ql.narrow(0, bl.q_off, bl.q_len)), bshd(kb.narrow(0, 0, bl.k_len)),
                              bshd(vb.narrow(0, 0, bl.k_len)), bshd(out.narrow(0, bl.q_off, bl.q_len)), lp,
                              bshd(dol.narrow(0, bl.q_off, bl.q_len)), dq4, dk4, dv4, o);
      Tensor dq_rows = dq_acc.narrow(0, bl.q_off, bl.q_len);
      Tensor dk_rows = dk_blk[size_t(bl.src)].narrow(0, 0, bl.k_len), dv_rows = dv_blk[size_t(bl.src)].narrow(0, 0, bl.k_len);
      ops::accumulate_f32(dq_rows, dqp);
      ops::accumulate_f32(dk_rows, dkp);
      ops::accumulate_f32(dv_rows, dvp);
    }
    res.out.push_back(out.to(Device::cpu()).to(DType::F32));
    res.lse.push_back(acc_lse.to(Device::cpu()));
    res.dq.push_back(dq_acc.to(Device::cpu()));
  }
  std::vector<Tensor> dks, dvs;
  for (int r = 0; r < n; ++r) dks.push_back(dk_blk[size_t(r)].to(Device::cpu())), dvs.push_back(dv_blk[size_t(r)].to(Device::cpu()));
  res.dk = parallel::cp_unslice_sequence(dks, 0);
  res.dv = parallel::cp_unslice_sequence(dvs, 0);
  (void)L;
  return res;
}

// Full causal attention over the global sequence (f32 CPU reference) against the ring's pieces.
void check_ring(const RingCase& k, double tol) {
  const uint64_t seed = fresh_seed();
  INFO("CP " << k.cp << " c " << k.c << " dim " << k.dim << " " << dtype_name(k.dt) << " on " << k.dev.str()
             << " backend " << ops::attention_backend_name(k.backend) << " seed " << seed);
  const int64_t L = 2 * k.c * k.cp, b = k.b, H = k.heads, G = k.groups, d = k.dim;
  // Inputs rounded to the run's dtype first, so the reference sees the same values.
  auto input = [&](const Shape& sh, uint64_t sd) { return randn(sh, k.dt, sd).to(DType::F32); };
  const Tensor q = input({L, b, H, d}, seed), kk = input({L, b, G, d}, seed + 1), v = input({L, b, G, d}, seed + 2),
               dout = input({L, b, H, d}, seed + 3);
  ops::AttentionOptions ro;
  ro.causal = true;
  Tensor out = Tensor::empty({L, b, H, d}), lse = Tensor::empty({b, H, L});
  Tensor out4 = bshd(out);
  ops::attention_forward(bshd(q), bshd(kk), bshd(v), out4, lse, ro);
  Tensor dq = Tensor::empty({L, b, H, d}), dk = Tensor::empty({L, b, G, d}), dv = Tensor::empty({L, b, G, d});
  Tensor dq4 = bshd(dq), dk4 = bshd(dk), dv4 = bshd(dv);
  ops::attention_backward(bshd(q), bshd(kk), bshd(v), bshd(out), lse, bshd(dout), dq4, dk4, dv4, ro);

  const RingResult got = run_ring(k, q, kk, v, dout);
  for (int r = 0; r < k.cp; ++r) {
    INFO("CP rank " << r);
    CHECK(rel_err_t(got.out[size_t(r)], parallel::cp_slice_sequence(out, 0, r, k.cp)) < tol);
    CHECK(rel_err_t(got.lse[size_t(r)], parallel::cp_slice_sequence(lse, 2, r, k.cp)) < tol);
    CHECK(rel_err_t(got.dq[size_t(r)], parallel::cp_slice_sequence(dq, 0, r, k.cp)) < tol);
  }
  CHECK(rel_err_t(got.dk, dk) < tol);
  CHECK(rel_err_t(got.dv, dv) < tol);
}

}  // namespace

TEST_CASE("CP ring blocks merged by LSE equal full causal attention and its gradients (CPU reference)",
          "[ops][cp]") {
  for (int cp : {2, 3}) {
    RingCase k;
    k.cp = cp, k.c = cp == 2 ? 8 : 5;
    check_ring(k, 1e-5);
  }
}

TEST_CASE("attention merge ops refuse mismatched operands", "[ops][cp]") {
  Tensor out = Tensor::zeros({4, 1, 2, 8}), lse = Tensor::full({1, 2, 4}, kNegInf);
  Tensor part = Tensor::zeros({2, 1, 2, 8}), lp = Tensor::zeros({1, 2, 2});
  CHECK_THROWS_WITH(ops::attention_merge_partial(out, lse, part, lp, 3), Catch::Contains("fall outside"));
  Tensor bad = Tensor::zeros({1, 2, 3});
  CHECK_THROWS_WITH(ops::attention_merge_partial(out, lse, part, bad, 0), Catch::Contains("lse_part"));
  Tensor dst = Tensor::zeros({5}), src = Tensor::zeros({4});
  CHECK_THROWS_WITH(ops::accumulate_f32(dst, src), Catch::Contains("4 elements"));
  CHECK_THROWS_WITH(ops::accumulate(dst, src), Catch::Contains("4 elements"));
  Tensor ints = Tensor::zeros({4}, DType::I32);
  CHECK_THROWS_WITH(ops::accumulate(ints, src), Catch::Contains("bf16"));
}

TEST_CASE("accumulate adds in f32 and rounds once to the destination's dtype", "[ops][cp]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  for (DType dd : {DType::F32, DType::BF16, DType::F16})
    for (DType ds : {DType::F32, DType::BF16, DType::F16}) {
      INFO(dtype_name(dd) << " += " << dtype_name(ds));
      Tensor dst = randn({3, 37}, dd, seed), src = randn({3, 37}, ds, seed + 1);
      // The reference: the f64 sum of the two values (exact), rounded once to dst's dtype.
      const std::vector<double> a = dst.to_double_vector(), b = src.to_double_vector();
      Tensor want = Tensor::empty({3, 37}, DType::F32);
      for (size_t i = 0; i < a.size(); ++i) want.data<float>()[i] = float(a[i] + b[i]);
      ops::accumulate(dst, src);
      CHECK(same_bits(dst, want.to(dd)));
    }
}

TEST_CASE("attention merge CUDA kernels match the CPU implementation", "[ops][cp][gpu]") {
  MC_REQUIRE_GPU();
  const Device g = gpu();
  struct Case { int64_t S, B, H, D, Sp, off; };
  for (Case c : {Case{64, 2, 4, 128, 64, 0}, Case{96, 1, 3, 64, 48, 48}, Case{37, 3, 5, 24, 11, 13}}) {
    for (DType dt : {DType::F32, DType::BF16, DType::F16}) {
      const uint64_t seed = fresh_seed();
      INFO("S " << c.S << " Sp " << c.Sp << " offset " << c.off << " D " << c.D << " " << dtype_name(dt) << " seed "
                << seed);
      // Accumulators already holding a partial except in two rows (lse −inf: the first merge
      // copies); the partial has a −inf row (it saw no key) that must leave the accumulator alone.
      Tensor out = randn({c.S, c.B, c.H, c.D}, DType::F32, seed);
      Tensor lse = randn({c.B, c.H, c.S}, DType::F32, seed + 1, 0.0, 3.0);
      lse.narrow(2, c.off, 2).fill_(kNegInf);
      Tensor part = randn({c.Sp, c.B, c.H, c.D}, dt, seed + 2);
      Tensor lp = randn({c.B, c.H, c.Sp}, DType::F32, seed + 3, 0.0, 3.0);
      lp.narrow(2, c.Sp - 1, 1).fill_(kNegInf);
      Tensor go = out.to(g), gl = lse.to(g), gp = part.to(g), glp = lp.to(g);
      ops::attention_merge_partial(out, lse, part, lp, c.off);
      ops::attention_merge_partial(go, gl, gp, glp, c.off);
      CHECK(rel_err_t(go, out) < 1e-6);
      CHECK(rel_err_t(gl, lse) < 1e-6);
      Tensor dst = randn({c.Sp, c.B, c.H, c.D}, DType::F32, seed + 4), gdst = dst.to(g);
      ops::accumulate_f32(dst, part);
      ops::accumulate_f32(gdst, gp);
      CHECK(rel_err_t(gdst, dst) < 1e-7);
      Tensor low = randn({c.Sp, c.B, c.H, c.D}, dt, seed + 5), glow = low.to(g);
      ops::accumulate(low, part);
      ops::accumulate(glow, gp);
      CHECK(same_bits(glow, low));  // one f32 add rounded once: the same on both devices
    }
  }
}

TEST_CASE("CP ring blocks on the GPU backends equal full causal attention (cuDNN, flash, merge kernels)",
          "[ops][cp][gpu]") {
  MC_REQUIRE_GPU();
  std::vector<ops::AttentionBackend> backends{ops::AttentionBackend::Flash};
  if (ops::attention_cudnn_available()) backends.push_back(ops::AttentionBackend::Cudnn);
  for (ops::AttentionBackend be : backends)
    for (DType dt : {DType::BF16, DType::F16})
      for (int64_t dim : {64, 128})
        for (int cp : {2, 4}) {
          RingCase k;
          k.cp = cp, k.c = cp == 2 ? 96 : 40, k.heads = 8, k.groups = 2, k.dim = dim, k.dt = dt, k.dev = gpu(),
          k.backend = be;
          check_ring(k, 2e-2);
        }
}
