// Attention: the f64 CPU reference against finite differences, and every GPU backend against the
// reference on fresh random inputs (odd sequence lengths, GQA/MQA, packed sequences, strided views).
#include <cmath>
#include <numeric>
#include <vector>

#include "ops/ops_test_util.hpp"
#include "megacore/build_config.hpp"
#include "megacore/ops/attention.hpp"
#include "ops/cuda/attention_cuda.hpp"
#if MEGACORE_WITH_CUDA
#include "ops/attention_tuned.hpp"
#endif

using namespace megacore;
using namespace megacore::ops;
using mctest::fresh_seed;

namespace {

double loss_of(const ref::AttentionDims& d, const std::vector<double>& q, const std::vector<double>& k,
               const std::vector<double>& v, const std::vector<double>& g, int64_t lse_n) {
  std::vector<double> out(q.size()), lse(static_cast<size_t>(lse_n));
  ref::attention_forward_f64(d, q.data(), k.data(), v.data(), out.data(), lse.data());
  return mctest::dot(out, g);
}

void fd_check(ref::AttentionDims d, int64_t tq, int64_t tk) {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed << " causal " << d.causal << " packed " << (d.cu_q != nullptr));
  const size_t nq = size_t(tq * d.heads * d.head_dim), nk = size_t(tk * d.kv_heads * d.head_dim);
  const int64_t lse_n = tq * d.heads;
  auto q = mctest::rand_vec(nq, seed), k = mctest::rand_vec(nk, seed + 1), v = mctest::rand_vec(nk, seed + 2);
  auto g = mctest::rand_vec(nq, seed + 3);
  std::vector<double> out(nq), lse(static_cast<size_t>(lse_n)), dq(nq), dk(nk), dv(nk);
  ref::attention_forward_f64(d, q.data(), k.data(), v.data(), out.data(), lse.data());
  ref::attention_backward_f64(d, q.data(), k.data(), v.data(), out.data(), lse.data(), g.data(), dq.data(), dk.data(),
                              dv.data());
  auto nq_g = mctest::numeric_grad([&](const std::vector<double>& x) { return loss_of(d, x, k, v, g, lse_n); }, q);
  auto nk_g = mctest::numeric_grad([&](const std::vector<double>& x) { return loss_of(d, q, x, v, g, lse_n); }, k);
  auto nv_g = mctest::numeric_grad([&](const std::vector<double>& x) { return loss_of(d, q, k, x, g, lse_n); }, v);
  CHECK(mctest::rel_err(dq, nq_g) < 1e-7);
  CHECK(mctest::rel_err(dk, nk_g) < 1e-7);
  CHECK(mctest::rel_err(dv, nv_g) < 1e-7);
}

}  // namespace

TEST_CASE("attention reference: backward matches finite differences (f64)", "[ops][attention]") {
  for (bool causal : {false, true}) {
    ref::AttentionDims d;
    d.batch = 2, d.seqlen_q = 3, d.seqlen_kv = 4, d.heads = 4, d.kv_heads = 2, d.head_dim = 3, d.causal = causal;
    d.scale = 0.7;
    fd_check(d, d.batch * d.seqlen_q, d.batch * d.seqlen_kv);
  }
  // packed: three sequences, one of them empty
  std::vector<int32_t> cq{0, 2, 2, 5}, ck{0, 3, 3, 6};
  ref::AttentionDims d;
  d.batch = 3, d.heads = 2, d.kv_heads = 1, d.head_dim = 2, d.causal = true, d.cu_q = cq.data(), d.cu_kv = ck.data();
  fd_check(d, 5, 6);
}

TEST_CASE("attention reference: lse, causal first row, GQA and packing agree with their definitions",
          "[ops][attention]") {
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const int64_t B = 2, S = 5, H = 4, Hk = 2, D = 3;
  ref::AttentionDims d;
  d.batch = B, d.seqlen_q = S, d.seqlen_kv = S, d.heads = H, d.kv_heads = Hk, d.head_dim = D, d.causal = true;
  auto q = mctest::rand_vec(size_t(B * S * H * D), seed), k = mctest::rand_vec(size_t(B * S * Hk * D), seed + 1),
       v = mctest::rand_vec(size_t(B * S * Hk * D), seed + 2);
  std::vector<double> out(q.size()), lse(size_t(B * H * S));
  ref::attention_forward_f64(d, q.data(), k.data(), v.data(), out.data(), lse.data());
  // Row 0 under the causal mask sees only key 0: out = v[0], lse = scale q0.k0.
  for (int64_t h = 0; h < H; ++h) {
    const int64_t hk = h / (H / Hk);
    double s = 0;
    for (int64_t e = 0; e < D; ++e) {
      CHECK(out[size_t(h * D + e)] == Approx(v[size_t(hk * D + e)]).epsilon(1e-12));
      s += q[size_t(h * D + e)] * k[size_t(hk * D + e)];
    }
    CHECK(lse[size_t(h * S)] == Approx(s / std::sqrt(double(D))).epsilon(1e-12));
  }
  // GQA equals plain multi-head attention with the key/value heads repeated.
  ref::AttentionDims m = d;
  m.kv_heads = H;
  std::vector<double> k2(size_t(B * S * H * D)), v2(k2.size());
  for (int64_t t = 0; t < B * S; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < D; ++e) {
        k2[size_t((t * H + h) * D + e)] = k[size_t((t * Hk + h / (H / Hk)) * D + e)];
        v2[size_t((t * H + h) * D + e)] = v[size_t((t * Hk + h / (H / Hk)) * D + e)];
      }
  std::vector<double> out2(q.size()), lse2(lse.size());
  ref::attention_forward_f64(m, q.data(), k2.data(), v2.data(), out2.data(), lse2.data());
  CHECK(mctest::rel_err(out2, out) < 1e-14);
  CHECK(mctest::rel_err(lse2, lse) < 1e-14);
  // Packed with equal lengths equals the dense batch (lse moves from [B, H, S] to [H, T]).
  std::vector<int32_t> cu{0, int32_t(S), int32_t(2 * S)};
  ref::AttentionDims p = d;
  p.cu_q = cu.data(), p.cu_kv = cu.data();
  std::vector<double> out3(q.size()), lse3(lse.size());
  ref::attention_forward_f64(p, q.data(), k.data(), v.data(), out3.data(), lse3.data());
  CHECK(mctest::rel_err(out3, out) < 1e-15);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < S; ++i) CHECK(lse3[size_t(h * B * S + b * S + i)] == lse[size_t((b * H + h) * S + i)]);
}

TEST_CASE("attention cpu: tensor API runs the reference", "[ops][attention]") {
  const uint64_t seed = fresh_seed();
  Tensor q = mctest::randn({1, 7, 2, 4}, DType::F32, seed), k = mctest::randn({1, 9, 1, 4}, DType::F32, seed + 1),
         v = mctest::randn({1, 9, 1, 4}, DType::F32, seed + 2);
  Tensor out = mctest::poisoned({1, 7, 2, 4}, DType::F32, Device::cpu());
  Tensor lse = mctest::poisoned({1, 2, 7}, DType::F32, Device::cpu());
  AttentionOptions o;
  o.causal = true;
  attention_forward(q, k, v, out, lse, o);
  ref::AttentionDims d;
  d.seqlen_q = 7, d.seqlen_kv = 9, d.heads = 2, d.kv_heads = 1, d.head_dim = 4, d.causal = true;
  std::vector<double> od(out.numel()), ld(lse.numel());
  ref::attention_forward_f64(d, q.to_double_vector().data(), k.to_double_vector().data(),
                             v.to_double_vector().data(), od.data(), ld.data());
  CHECK(mctest::rel_err(out.to_double_vector(), od) < 1e-6);
  CHECK(mctest::rel_err(lse.to_double_vector(), ld) < 1e-6);
  CHECK(attention_resolve_backend(q, k, o) == AttentionBackend::Reference);
}

TEST_CASE("attention cpu: packed tokens past the last sequence belong to none", "[ops][attention]") {
  // cu_seqlens may end before the tensors do (the API checks cu.back() <= tokens): those rows are in no
  // sequence (out 0, lse -inf), and lse [H, Tq] keeps the tensor's Tq as its head stride. Compared with the
  // same call on the tensors cut at cu.back().
  const uint64_t seed = fresh_seed();
  INFO("seed " << seed);
  const int64_t tq = 12, t = 9, H = 2, D = 8;
  Tensor q = mctest::randn({tq, H, D}, DType::F32, seed), k = mctest::randn({tq, 1, D}, DType::F32, seed + 1),
         v = mctest::randn({tq, 1, D}, DType::F32, seed + 2);
  AttentionOptions o;
  o.causal = true;
  o.cu_seqlens_q = Tensor::from_vector(std::vector<int32_t>{0, 5, 9}, {3});
  o.cu_seqlens_kv = o.cu_seqlens_q;
  o.max_seqlen_q = o.max_seqlen_kv = 5;
  Tensor out = mctest::poisoned({tq, H, D}, DType::F32, Device::cpu());
  Tensor lse = mctest::poisoned({H, tq}, DType::F32, Device::cpu());
  attention_forward(q, k, v, out, lse, o);
  auto cut = [&](const Tensor& x) { return x.narrow(0, 0, t).contiguous(); };
  Tensor out9 = Tensor::zeros({t, H, D}), lse9 = Tensor::zeros({H, t});
  attention_forward(cut(q), cut(k), cut(v), out9, lse9, o);
  const std::vector<double> l = lse.to_double_vector(), l9 = lse9.to_double_vector();
  const std::vector<double> ov = out.to_double_vector(), o9 = out9.to_double_vector();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < tq; ++i) {
      INFO("head " << h << " token " << i);
      if (i < t) CHECK(l[size_t(h * tq + i)] == l9[size_t(h * t + i)]);
      else CHECK(l[size_t(h * tq + i)] == -INFINITY);
    }
  for (size_t i = 0; i < ov.size(); ++i) {
    if (int64_t(i) < t * H * D) CHECK(ov[i] == o9[i]);
    else CHECK(ov[i] == 0.0);
  }
}

TEST_CASE("attention: cuDNN ragged index arrays start on 16-byte boundaries and do not overlap", "[ops][attention]") {
  // The cuDNN graph declares its int32 length and offset tensors 16-byte aligned (cudnn-frontend's default);
  // ragged_index_layout places them in one scratch block, which the allocator aligns.
  for (int64_t bp = 1; bp <= 70; ++bp)
    for (int n : {5, 9}) {
      const ops::cuda::RaggedIndexLayout l = ops::cuda::ragged_index_layout(bp, n);
      INFO("batch_padded " << bp << " arrays " << n);
      CHECK(l.seq_kv % 4 == 0);
      CHECK(l.offsets % 4 == 0);
      CHECK(l.offset_stride % 4 == 0);
      CHECK(l.seq_kv >= bp);                  // q lengths [0, bp) end before the kv lengths
      CHECK(l.offsets >= l.seq_kv + bp);      // kv lengths end before offset array 0
      CHECK(l.offset_stride >= bp + 1);       // each offset array holds bp + 1 entries
      CHECK(l.total == l.offsets + n * l.offset_stride);
    }
}

TEST_CASE("attention: bad arguments give clear errors", "[ops][attention]") {
  Tensor q = Tensor::zeros({1, 8, 6, 4}), k = Tensor::zeros({1, 8, 4, 4}), v = Tensor::zeros({1, 8, 4, 4});
  Tensor out = Tensor::zeros({1, 8, 6, 4}), lse = Tensor::zeros({1, 6, 8});
  CHECK_THROWS_WITH(attention_forward(q, k, v, out, lse), Catch::Contains("multiple of the key/value heads"));
  Tensor k2 = Tensor::zeros({1, 8, 2, 4}), v2 = Tensor::zeros({1, 8, 2, 4});
  Tensor bad_lse = Tensor::zeros({1, 8, 6});
  CHECK_THROWS_WITH(attention_forward(q, k2, v2, out, bad_lse), Catch::Contains("lse has shape"));
  Tensor k3 = Tensor::zeros({1, 8, 2, 5});
  CHECK_THROWS_WITH(attention_forward(q, k3, k3, out, lse), Catch::Contains("head_dim"));
  Tensor q3 = Tensor::zeros({8, 6, 4});
  CHECK_THROWS_WITH(attention_forward(q3, k2, v2, out, lse), Catch::Contains("4-D"));
  Tensor q16 = Tensor::zeros({1, 8, 6, 4}, DType::BF16);
  CHECK_THROWS_WITH(attention_forward(q16, k2, v2, out, lse), Catch::Contains("must match"));
  AttentionOptions fl;
  fl.backend = AttentionBackend::Flash;
  CHECK_THROWS_WITH(attention_forward(q, k2, v2, out, lse, fl), Catch::Contains("CUDA tensors"));
  AttentionOptions pk;
  pk.cu_seqlens_q = Tensor::from_vector(std::vector<int32_t>{0, 5, 3}, {3});
  pk.cu_seqlens_kv = pk.cu_seqlens_q;
  Tensor pq = Tensor::zeros({5, 6, 4}), pkv = Tensor::zeros({5, 2, 4}), po = Tensor::zeros({5, 6, 4}),
         pl = Tensor::zeros({6, 5});
  CHECK_THROWS_WITH(attention_forward(pq, pkv, pkv, po, pl, pk), Catch::Contains("non-decreasing"));
  pk.cu_seqlens_q = Tensor::from_vector(std::vector<int64_t>{0, 5}, {2});
  CHECK_THROWS_WITH(attention_forward(pq, pkv, pkv, po, pl, pk), Catch::Contains("i32"));
}

TEST_CASE("attention: out-of-range flash tuning fields are errors on every device and backend", "[ops][attention]") {
  // Checked before any backend is chosen, so that Auto never quietly runs another kernel instead.
  Tensor q = Tensor::zeros({1, 4, 2, 8}), out = Tensor::zeros({1, 4, 2, 8}), lse = Tensor::zeros({1, 2, 4});
  Tensor dq = Tensor::zeros({1, 4, 2, 8}), dk = Tensor::zeros({1, 4, 2, 8}), dv = Tensor::zeros({1, 4, 2, 8});
  AttentionOptions o;
  o.flash_sm90_block_n = 96;
  CHECK_THROWS_WITH(attention_forward(q, q, q, out, lse, o), Catch::Contains("flash_sm90_block_n is 96"));
  o.flash_sm90_block_n = 0, o.flash_sm90_variant = 7;
  CHECK_THROWS_WITH(attention_forward(q, q, q, out, lse, o), Catch::Contains("flash_sm90_variant is 7"));
  o.flash_sm90_variant = 0, o.flash_sm90_bwd_variant = -1;
  CHECK_THROWS_WITH(attention_backward(q, q, q, out, lse, out, dq, dk, dv, o),
                    Catch::Contains("flash_sm90_bwd_variant is -1"));
}

// ---- GPU ------------------------------------------------------------------------------------------
namespace {

struct GpuCase {
  int64_t batch = 2, sq = 0, skv = 0, heads = 4, kv_heads = 2, dim = 64;
  bool causal = false;
  DType dt = DType::BF16;
  AttentionBackend backend = AttentionBackend::Flash;
  std::vector<int32_t> cu_q, cu_kv;  // packed mode when non-empty
  bool fused_qkv = false;            // q, k, v as strided views of one [B, S, Hq + 2 Hkv, D] buffer
  FlashImpl impl = FlashImpl::Auto;  // set by run_gpu_case for the Flash backend
  int sm90_block_n = 0;
  int sm90_variant = 0;  // AttentionOptions::flash_sm90_variant
};

// Whether Auto would run this call on cuDNN (the Cudnn cases run only then); WARNs `skipped` otherwise.
bool cudnn_takes(const Tensor& q, const Tensor& k, AttentionOptions o, const char* skipped) {
  o.backend = AttentionBackend::Auto;
  if (attention_resolve_backend(q, k, o) == AttentionBackend::Cudnn) return true;
  WARN(skipped);
  return false;
}

std::vector<int32_t> prefix(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu{0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

const char* impl_name(FlashImpl i) {
  return i == FlashImpl::Sm80 ? "sm80" : i == FlashImpl::Sm90 ? "sm90" : "auto";
}

// Runs forward and backward on the device and compares everything with the f64 reference.
void run_gpu_case_once(const GpuCase& c) {
  const uint64_t seed = fresh_seed();
  const bool packed = !c.cu_q.empty();
  INFO("seed " << seed << " backend " << attention_backend_name(c.backend) << " flash fwd " << impl_name(c.impl)
                << " block_n " << c.sm90_block_n << " variant " << c.sm90_variant << " dt " << dtype_name(c.dt) << " D " << c.dim << " causal "
                << c.causal << " sq " << c.sq << " skv " << c.skv << " H " << c.heads << "/" << c.kv_heads
                << " packed " << packed << " fused " << c.fused_qkv);
  const Device g = mctest::gpu();
  const int64_t tq = packed ? c.cu_q.back() : c.batch * c.sq, tk = packed ? c.cu_kv.back() : c.batch * c.skv;
  const int64_t B = packed ? int64_t(c.cu_q.size()) - 1 : c.batch;
  Shape qs = packed ? Shape{tq, c.heads, c.dim} : Shape{c.batch, c.sq, c.heads, c.dim};
  Shape ks = packed ? Shape{tk, c.kv_heads, c.dim} : Shape{c.batch, c.skv, c.kv_heads, c.dim};
  Shape ls = packed ? Shape{c.heads, tq} : Shape{c.batch, c.heads, c.sq};
  Tensor q, k, v;
  if (c.fused_qkv) {
    Tensor qkv = mctest::randn({c.batch, c.sq, c.heads + 2 * c.kv_heads, c.dim}, c.dt, seed, 0, 1, g);
    q = qkv.narrow(2, 0, c.heads);
    k = qkv.narrow(2, c.heads, c.kv_heads);
    v = qkv.narrow(2, c.heads + c.kv_heads, c.kv_heads);
  } else {
    q = mctest::randn(qs, c.dt, seed, 0, 1, g);
    k = mctest::randn(ks, c.dt, seed + 1, 0, 1, g);
    v = mctest::randn(ks, c.dt, seed + 2, 0, 1, g);
  }
  Tensor dout = mctest::randn(qs, c.dt, seed + 3, 0, 1, g);
  Tensor out = mctest::poisoned(qs, c.dt, g), lse = mctest::poisoned(ls, DType::F32, g);
  AttentionOptions o;
  o.causal = c.causal;
  o.backend = c.backend;
  o.flash_impl = c.impl;
  o.flash_sm90_block_n = c.sm90_block_n;
  o.flash_sm90_variant = c.sm90_variant;
  if (packed) {
    o.cu_seqlens_q = Tensor::from_vector(c.cu_q, {int64_t(c.cu_q.size())}).to(g);
    o.cu_seqlens_kv = Tensor::from_vector(c.cu_kv, {int64_t(c.cu_kv.size())}).to(g);
    for (size_t i = 0; i + 1 < c.cu_q.size(); ++i) {
      o.max_seqlen_q = std::max<int64_t>(o.max_seqlen_q, c.cu_q[i + 1] - c.cu_q[i]);
      o.max_seqlen_kv = std::max<int64_t>(o.max_seqlen_kv, c.cu_kv[i + 1] - c.cu_kv[i]);
    }
  }
  if (c.backend == AttentionBackend::Cudnn &&
      !cudnn_takes(q, k, o, "cuDNN SDPA does not support this case; skipped (Auto uses the flash kernel for it)"))
    return;
  attention_forward(q, k, v, out, lse, o);

  ref::AttentionDims d;
  d.batch = B, d.seqlen_q = c.sq, d.seqlen_kv = c.skv, d.heads = c.heads, d.kv_heads = c.kv_heads, d.head_dim = c.dim;
  d.causal = c.causal;
  if (packed) d.cu_q = c.cu_q.data(), d.cu_kv = c.cu_kv.data();
  std::vector<double> qd = q.to_double_vector(), kd = k.to_double_vector(), vd = v.to_double_vector(),
                      gd = dout.to_double_vector();
  std::vector<double> od(qd.size()), ld(size_t(shape_numel(ls))), dqd(qd.size()), dkd(kd.size()), dvd(vd.size());
  ref::attention_forward_f64(d, qd.data(), kd.data(), vd.data(), od.data(), ld.data());
  // Backward reference from the reference forward (the function's true gradient).
  ref::attention_backward_f64(d, qd.data(), kd.data(), vd.data(), od.data(), ld.data(), gd.data(), dqd.data(),
                              dkd.data(), dvd.data());
  const double e_out = mctest::rel_err(out.to_double_vector(), od);
  const double e_lse = mctest::rel_err(lse.to_double_vector(), ld);
  INFO("rel err out " << e_out << " lse " << e_lse);
  CHECK(e_out < 1e-2);
  CHECK(e_lse < 1e-3);

  // One backward into poisoned gradients, compared with the reference.
  auto check_backward = [&](const char* path, auto&& run) {
    INFO("backward path " << path);
    Tensor dq = mctest::poisoned(qs, c.dt, g), dk = mctest::poisoned(ks, c.dt, g), dv = mctest::poisoned(ks, c.dt, g);
    if (!run(dq, dk, dv)) return;
    const double e_dq = mctest::rel_err(dq.to_double_vector(), dqd);
    const double e_dk = mctest::rel_err(dk.to_double_vector(), dkd);
    const double e_dv = mctest::rel_err(dv.to_double_vector(), dvd);
    INFO("rel err dq " << e_dq << " dk " << e_dk << " dv " << e_dv);
    CHECK(e_dq < 1e-2);
    CHECK(e_dk < 1e-2);
    CHECK(e_dv < 1e-2);
  };
  if (c.backend == AttentionBackend::Cudnn) {
    check_backward("cudnn", [&](Tensor& dq, Tensor& dk, Tensor& dv) {
      try {
        attention_backward(q, k, v, out, lse, dout, dq, dk, dv, o);
      } catch (const ValueError& e) {
        // cuDNN supports fewer backward shapes than forward ones (s_q = s_kv = 1, for one); Auto
        // then runs the backward through the flash kernel and logs it.
        WARN("cuDNN SDPA backward skipped: " << e.what());
        CHECK(std::string(e.what()).find("cuDNN SDPA cannot run") != std::string::npos);
        return false;
      }
      return true;
    });
    return;
  }
  // Flash (and Auto): the default (atomic dQ) and the deterministic two-kernel backward, then every
  // launch shape of the atomic-dQ kernel.
  for (bool det : {false, true}) {
    AttentionOptions od_opts = o;
    od_opts.deterministic = det;
    check_backward(det ? "deterministic" : "default (atomic dQ)", [&](Tensor& dq, Tensor& dk, Tensor& dv) {
      attention_backward(q, k, v, out, lse, dout, dq, dk, dv, od_opts);
      return true;
    });
  }
  // The atomic-dQ path through each backward kernel by name (Auto above is the wgmma one on sm_90).
  if (c.backend == AttentionBackend::Flash) {
    std::vector<std::pair<FlashImpl, int>> bwd{{FlashImpl::Sm80, 0}};
    if (attention_flash_sm90_available(g)) bwd.insert(bwd.end(), {{FlashImpl::Sm90, 0}, {FlashImpl::Sm90, 1}});
    for (auto [bi, variant] : bwd) {
      AttentionOptions ob = o;
      ob.flash_bwd_impl = bi;
      ob.flash_sm90_bwd_variant = variant;
      INFO("sm90 backward variant " << variant);
      check_backward(bi == FlashImpl::Sm90 ? "atomic dQ, sm90 (wgmma) kernel" : "atomic dQ, sm80 (mma.sync) kernel",
                     [&](Tensor& dq, Tensor& dk, Tensor& dv) {
                       attention_backward(q, k, v, out, lse, dout, dq, dk, dv, ob);
                       return true;
                     });
    }
  }
#if MEGACORE_WITH_CUDA
  if (c.backend == AttentionBackend::Flash) {
    for (int warps : {4, 8}) {
      INFO("FlashBwdTuning warps " << warps);
      check_backward("atomic dQ, explicit launch shape", [&](Tensor& dq, Tensor& dk, Tensor& dv) {
        ops::detail::attention_backward_flash_tuned(q, k, v, out, lse, dout, dq, dk, dv, o,
                                                    ops::cuda::FlashBwdTuning{.warps = warps});
        return true;
      });
    }
  }
#endif
}

// The Flash backend runs every case through each forward kernel: the mma.sync one, and on sm_90 the
// wgmma one with each of its tile widths and schedules (the backward is the same kernel every time).
void run_gpu_case(GpuCase c) {
  if (c.backend != AttentionBackend::Flash) return run_gpu_case_once(c);
  c.impl = FlashImpl::Sm80, c.sm90_block_n = 0, c.sm90_variant = 0;
  run_gpu_case_once(c);
  if (!attention_flash_sm90_available(mctest::gpu())) {
    static bool said = false;
    if (!said) WARN("the sm90 flash forward is not available here (device not sm_90 or build without 90a); skipped");
    said = true;
    return;
  }
  for (int bn : {128, 64}) {
    // CTA-synchronous; warp-specialized with 2 / 3 stages; the same with ping-pong warpgroup scheduling.
    for (int variant : {0, 1, 2, 3, 4}) {
      c.impl = FlashImpl::Sm90, c.sm90_block_n = bn, c.sm90_variant = variant;
      run_gpu_case_once(c);
    }
  }
}

std::vector<AttentionBackend> gpu_backends() {
  std::vector<AttentionBackend> b{AttentionBackend::Flash};
  if (attention_cudnn_available()) b.push_back(AttentionBackend::Cudnn);
  return b;
}

}  // namespace

TEST_CASE("attention gpu: flash and cuDNN against the f64 reference (dtypes, head dims, masks, odd sizes)",
          "[ops][attention][gpu]") {
  MC_REQUIRE_GPU();
  for (AttentionBackend be : gpu_backends())
    for (DType dt : {DType::BF16, DType::F16})
      for (int64_t dim : {64, 128})
        for (bool causal : {false, true}) {
          GpuCase c;
          c.backend = be, c.dt = dt, c.dim = dim, c.causal = causal, c.sq = 200, c.skv = 200;
          run_gpu_case(c);
        }
}

TEST_CASE("attention gpu: unequal lengths, MQA, tiny and single-tile sequences", "[ops][attention][gpu]") {
  MC_REQUIRE_GPU();
  for (AttentionBackend be : gpu_backends()) {
    for (bool causal : {false, true}) {
      GpuCase a;  // more keys than queries
      a.backend = be, a.causal = causal, a.sq = 77, a.skv = 133, a.dim = 128;
      run_gpu_case(a);
      GpuCase b;  // more queries than keys
      b.backend = be, b.causal = causal, b.sq = 150, b.skv = 65, b.dim = 64;
      run_gpu_case(b);
    }
    GpuCase mqa;
    mqa.backend = be, mqa.heads = 8, mqa.kv_heads = 1, mqa.sq = mqa.skv = 129, mqa.causal = true, mqa.dim = 128;
    run_gpu_case(mqa);
    // A single query row (with one key the gradients of q and k vanish: nothing to compare against).
    GpuCase tiny;
    tiny.backend = be, tiny.batch = 3, tiny.sq = 1, tiny.skv = 3, tiny.heads = 2, tiny.kv_heads = 2;
    run_gpu_case(tiny);
  }
}

TEST_CASE("attention gpu: flash forward kernels over many key tiles (GQA, partial last tiles)",
          "[ops][attention][gpu]") {
  MC_REQUIRE_GPU();
  for (int64_t dim : {64, 128})
    for (bool causal : {false, true}) {
      GpuCase c;  // 5 query blocks of the sm90 kernel, 9 key tiles of 64, the last ones partial
      c.backend = AttentionBackend::Flash, c.dim = dim, c.causal = causal, c.batch = 1, c.heads = 6, c.kv_heads = 2;
      c.sq = 515, c.skv = 515;
      run_gpu_case(c);
      GpuCase u = c;  // Sq < Skv: causal rows past the key tiles of their own block
      u.sq = 300, u.skv = 701, u.dt = DType::F16;
      run_gpu_case(u);
    }
}

TEST_CASE("attention gpu: packed variable-length sequences", "[ops][attention][gpu]") {
  MC_REQUIRE_GPU();
  const Device g = mctest::gpu();
  for (AttentionBackend be : gpu_backends())
    for (int64_t dim : {64, 128})
      for (bool causal : {false, true}) {
        GpuCase c;
        c.backend = be, c.dim = dim, c.causal = causal, c.heads = 4, c.kv_heads = 1;
        c.cu_q = prefix({50, 0, 127, 123, 1});
        c.cu_kv = causal ? c.cu_q : prefix({70, 3, 64, 200, 9});
        run_gpu_case(c);
      }
  // On Hopper cuDNN takes packed sequences (its ragged layout): Auto must pick it there.
  if (attention_cudnn_available() && attention_flash_sm90_available(g)) {
    AttentionOptions o;
    o.causal = true;
    o.cu_seqlens_q = Tensor::from_vector(prefix({100, 28, 0, 61}), {5}).to(g);
    o.cu_seqlens_kv = o.cu_seqlens_q;
    o.max_seqlen_q = o.max_seqlen_kv = 100;
    Tensor q = Tensor::zeros({189, 8, 128}, DType::BF16, g), k = Tensor::zeros({189, 2, 128}, DType::BF16, g);
    CHECK(attention_resolve_backend(q, k, o) == AttentionBackend::Cudnn);
    // Both directions, explicitly: a refusal raises with cuDNN's reason.
    o.backend = AttentionBackend::Cudnn;
    Tensor out = Tensor::zeros({189, 8, 128}, DType::BF16, g), lse = Tensor::zeros({8, 189}, DType::F32, g);
    Tensor dq = Tensor::zeros({189, 8, 128}, DType::BF16, g), dk = Tensor::zeros({189, 2, 128}, DType::BF16, g),
           dv = Tensor::zeros({189, 2, 128}, DType::BF16, g);
    CHECK_NOTHROW(attention_forward(q, k, k, out, lse, o));
    CHECK_NOTHROW(attention_backward(q, k, k, out, lse, out, dq, dk, dv, o));
  }
  // Auto never fails on packed input: it uses whichever backend supports it (and says so once).
  GpuCase a;
  a.backend = AttentionBackend::Auto, a.causal = true, a.cu_q = prefix({100, 28}), a.cu_kv = a.cu_q;
  run_gpu_case(a);
}

TEST_CASE("attention gpu: packed sequences with an empty side, and tokens outside every sequence",
          "[ops][attention][gpu]") {
  // Sequence 0 has queries but no keys (its rows: out 0, lse -inf, dq 0), sequence 1 keys but no queries
  // (dk, dv 0), sequence 2 both; 6 trailing tokens on each side belong to no sequence (out/dq/dk/dv 0,
  // lse -inf). Every backend must give the reference's values everywhere, not leave rows unwritten.
  MC_REQUIRE_GPU();
  const Device g = mctest::gpu();
  const std::vector<int32_t> cq = prefix({20, 0, 33}), ck = prefix({0, 40, 5});
  const int64_t tq = cq.back() + 6, tk = ck.back() + 6, H = 4, Hk = 2;
  for (AttentionBackend be : gpu_backends())
    for (int64_t D : {64, 128}) {
      const uint64_t seed = fresh_seed();
      INFO("seed " << seed << " backend " << attention_backend_name(be) << " D " << D);
      Tensor q = mctest::randn({tq, H, D}, DType::BF16, seed, 0, 1, g);
      Tensor k = mctest::randn({tk, Hk, D}, DType::BF16, seed + 1, 0, 1, g);
      Tensor v = mctest::randn({tk, Hk, D}, DType::BF16, seed + 2, 0, 1, g);
      Tensor dout = mctest::randn({tq, H, D}, DType::BF16, seed + 3, 0, 1, g);
      Tensor out = mctest::poisoned({tq, H, D}, DType::BF16, g), lse = mctest::poisoned({H, tq}, DType::F32, g);
      Tensor dq = mctest::poisoned({tq, H, D}, DType::BF16, g), dk = mctest::poisoned({tk, Hk, D}, DType::BF16, g),
             dv = mctest::poisoned({tk, Hk, D}, DType::BF16, g);
      AttentionOptions o;
      o.backend = be;
      o.cu_seqlens_q = Tensor::from_vector(cq, {4}).to(g);
      o.cu_seqlens_kv = Tensor::from_vector(ck, {4}).to(g);
      o.max_seqlen_q = 33, o.max_seqlen_kv = 40;
      if (be == AttentionBackend::Cudnn &&
          !cudnn_takes(q, k, o, "cuDNN SDPA does not take packed sequences on this device; skipped"))
        continue;
      attention_forward(q, k, v, out, lse, o);
      attention_backward(q, k, v, out, lse, dout, dq, dk, dv, o);

      ref::AttentionDims d;
      d.batch = 3, d.seqlen_q = 33, d.seqlen_kv = 40, d.heads = H, d.kv_heads = Hk, d.head_dim = D;
      d.cu_q = cq.data(), d.cu_kv = ck.data(), d.total_q = tq;
      std::vector<double> qd = q.to_double_vector(), kd = k.to_double_vector(), vd = v.to_double_vector(),
                          gd = dout.to_double_vector();
      std::vector<double> od(qd.size()), ld(size_t(H * tq), -INFINITY), dqd(qd.size()), dkd(kd.size()),
          dvd(vd.size());
      ref::attention_forward_f64(d, qd.data(), kd.data(), vd.data(), od.data(), ld.data());
      ref::attention_backward_f64(d, qd.data(), kd.data(), vd.data(), od.data(), ld.data(), gd.data(), dqd.data(),
                                  dkd.data(), dvd.data());
      // lse: -inf exactly where the reference has it; the rest compared as usual.
      std::vector<double> lg = lse.to_double_vector(), lf, lr;
      int64_t inf_rows = 0;
      for (size_t i = 0; i < ld.size(); ++i) {
        if (std::isinf(ld[i])) {
          ++inf_rows;
          CHECK(lg[i] == -INFINITY);
        } else {
          lf.push_back(lg[i]), lr.push_back(ld[i]);
        }
      }
      CHECK(inf_rows == H * (20 + 6));
      CHECK(mctest::rel_err(lf, lr) < 1e-3);
      const std::vector<double> og = out.to_double_vector(), dqg = dq.to_double_vector(), dkg = dk.to_double_vector(),
                                dvg = dv.to_double_vector();
      CHECK(mctest::rel_err(og, od) < 1e-2);
      CHECK(mctest::rel_err(dqg, dqd) < 1e-2);
      CHECK(mctest::rel_err(dkg, dkd) < 1e-2);
      CHECK(mctest::rel_err(dvg, dvd) < 1e-2);
      // The rows without a partner are exactly zero (not merely small next to the rest).
      auto zero_rows = [](const std::vector<double>& x, int64_t row_elems, int64_t first, int64_t last) {
        for (int64_t i = first * row_elems; i < last * row_elems; ++i)
          if (x[size_t(i)] != 0.0) return false;
        return true;
      };
      CHECK(zero_rows(og, H * D, 0, 20));
      CHECK(zero_rows(og, H * D, tq - 6, tq));
      CHECK(zero_rows(dqg, H * D, 0, 20));
      CHECK(zero_rows(dqg, H * D, tq - 6, tq));
      CHECK(zero_rows(dkg, Hk * D, 0, 40));
      CHECK(zero_rows(dvg, Hk * D, 0, 40));
      CHECK(zero_rows(dkg, Hk * D, tk - 6, tk));
      CHECK(zero_rows(dvg, Hk * D, tk - 6, tk));
    }
}

TEST_CASE("attention gpu: q, k, v as strided views of a fused QKV projection", "[ops][attention][gpu]") {
  MC_REQUIRE_GPU();
  for (AttentionBackend be : gpu_backends()) {
    GpuCase c;
    c.backend = be, c.fused_qkv = true, c.sq = c.skv = 96, c.causal = true, c.dim = 128;
    run_gpu_case(c);
  }
}

TEST_CASE("attention gpu: flash backward is bit-identical from run to run (deterministic; dk/dv also with atomic dQ)",
          "[ops][attention][gpu]") {
  MC_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  const Device g = mctest::gpu();
  Tensor q = mctest::randn({2, 300, 8, 128}, DType::BF16, seed, 0, 1, g);
  Tensor k = mctest::randn({2, 300, 2, 128}, DType::BF16, seed + 1, 0, 1, g);
  Tensor v = mctest::randn({2, 300, 2, 128}, DType::BF16, seed + 2, 0, 1, g);
  Tensor dout = mctest::randn({2, 300, 8, 128}, DType::BF16, seed + 3, 0, 1, g);
  Tensor out = Tensor::empty(q.shape(), DType::BF16, g), lse = Tensor::empty({2, 8, 300}, DType::F32, g);
  AttentionOptions o;
  o.causal = true, o.backend = AttentionBackend::Flash, o.deterministic = true;
  attention_forward(q, k, v, out, lse, o);
  std::vector<std::vector<double>> first;
  for (int rep = 0; rep < 2; ++rep) {
    Tensor dq = mctest::poisoned(q.shape(), DType::BF16, g), dk = mctest::poisoned(k.shape(), DType::BF16, g),
           dv = mctest::poisoned(k.shape(), DType::BF16, g);
    attention_backward(q, k, v, out, lse, dout, dq, dk, dv, o);
    std::vector<std::vector<double>> now{dq.to_double_vector(), dk.to_double_vector(), dv.to_double_vector()};
    if (rep == 0) first = now;
    else CHECK(now == first);
  }
  // The default (atomic dQ) path: dk and dv are still summed in a fixed order, so bit-identical too;
  // dq is not promised to be (the atomics' order varies), only close to the deterministic one.
  o.deterministic = false;
  std::vector<std::vector<double>> atomic_first;
  for (int rep = 0; rep < 2; ++rep) {
    Tensor dq = mctest::poisoned(q.shape(), DType::BF16, g), dk = mctest::poisoned(k.shape(), DType::BF16, g),
           dv = mctest::poisoned(k.shape(), DType::BF16, g);
    attention_backward(q, k, v, out, lse, dout, dq, dk, dv, o);
    std::vector<std::vector<double>> now{dq.to_double_vector(), dk.to_double_vector(), dv.to_double_vector()};
    CHECK(mctest::rel_err(now[0], first[0]) < 1e-2);
    if (rep == 0) atomic_first = now;
    else {
      CHECK(now[1] == atomic_first[1]);
      CHECK(now[2] == atomic_first[2]);
    }
  }
}

TEST_CASE("attention gpu: unsupported calls are errors, never wrong results", "[ops][attention][gpu]") {
  MC_REQUIRE_GPU();
  const Device g = mctest::gpu();
  Tensor q = Tensor::zeros({1, 16, 2, 96}, DType::BF16, g), k = Tensor::zeros({1, 16, 2, 96}, DType::BF16, g);
  Tensor out = Tensor::zeros({1, 16, 2, 96}, DType::BF16, g), lse = Tensor::zeros({1, 2, 16}, DType::F32, g);
  AttentionOptions fl;
  fl.backend = AttentionBackend::Flash;
  CHECK_THROWS_WITH(attention_forward(q, k, k, out, lse, fl), Catch::Contains("head_dim 96"));
  Tensor q32 = Tensor::zeros({1, 16, 2, 64}, DType::F32, g), o32 = Tensor::zeros({1, 16, 2, 64}, DType::F32, g);
  CHECK_THROWS_WITH(attention_forward(q32, q32, q32, o32, lse), Catch::Contains("bf16 or f16"));
  AttentionOptions rf;
  rf.backend = AttentionBackend::Reference;
  Tensor q64 = Tensor::zeros({1, 16, 2, 64}, DType::BF16, g), o64 = Tensor::zeros({1, 16, 2, 64}, DType::BF16, g);
  CHECK_THROWS_WITH(attention_forward(q64, q64, q64, o64, lse, rf), Catch::Contains("CPU tensors only"));
  AttentionOptions pk;
  pk.cu_seqlens_q = Tensor::from_vector(std::vector<int32_t>{0, 16}, {2}).to(g);
  pk.cu_seqlens_kv = pk.cu_seqlens_q;
  Tensor pq = Tensor::zeros({16, 2, 64}, DType::BF16, g), po = Tensor::zeros({16, 2, 64}, DType::BF16, g),
         pl = Tensor::zeros({2, 16}, DType::F32, g);
  CHECK_THROWS_WITH(attention_forward(pq, pq, pq, po, pl, pk), Catch::Contains("max_seqlen"));
  AttentionOptions s90;
  s90.backend = AttentionBackend::Flash, s90.flash_impl = FlashImpl::Sm90;
  if (!attention_flash_sm90_available(g)) {
    CHECK_THROWS_WITH(attention_forward(q64, q64, q64, o64, lse, s90), Catch::Contains("sm90 forward"));
  } else {
    s90.flash_sm90_block_n = 96;
    CHECK_THROWS_WITH(attention_forward(q64, q64, q64, o64, lse, s90), Catch::Contains("flash_sm90_block_n is 96"));
    s90.flash_sm90_block_n = 0, s90.flash_sm90_variant = 5;
    CHECK_THROWS_WITH(attention_forward(q64, q64, q64, o64, lse, s90), Catch::Contains("flash_sm90_variant is 5"));
  }
  // The sm90 backward asked for: where it cannot run, or with a deterministic backward (it sums dQ
  // with atomics), the call is refused before anything is written.
  {
    AttentionOptions b90;
    b90.backend = AttentionBackend::Flash, b90.flash_bwd_impl = FlashImpl::Sm90;
    Tensor dq = Tensor::full({1, 16, 2, 64}, 7.0, DType::BF16, g);
    Tensor dk = Tensor::full({1, 16, 2, 64}, 7.0, DType::BF16, g), dv = Tensor::full({1, 16, 2, 64}, 7.0, DType::BF16, g);
    if (!attention_flash_sm90_available(g)) {
      CHECK_THROWS_WITH(attention_backward(q64, q64, q64, o64, lse, o64, dq, dk, dv, b90),
                        Catch::Contains("sm90 backward"));
    }
    if (attention_flash_sm90_available(g)) {
      b90.flash_sm90_bwd_variant = 2;
      CHECK_THROWS_WITH(attention_backward(q64, q64, q64, o64, lse, o64, dq, dk, dv, b90),
                        Catch::Contains("flash_sm90_bwd_variant is 2"));
      b90.flash_sm90_bwd_variant = 0;
    }
    b90.deterministic = true;
    CHECK_THROWS_WITH(attention_backward(q64, q64, q64, o64, lse, o64, dq, dk, dv, b90),
                      Catch::Contains("deterministic"));
    for (const Tensor* t : {&dq, &dk, &dv})
      for (double x : t->to_double_vector()) REQUIRE(x == 7.0);
  }
  if (!attention_cudnn_available()) {
    AttentionOptions cd;
    cd.backend = AttentionBackend::Cudnn;
    CHECK_THROWS_WITH(attention_forward(q64, q64, q64, o64, lse, cd), Catch::Contains("cuDNN"));
  }
}

TEST_CASE("attention gpu: cuDNN with the heuristic's first plan and with timed plan choice", "[ops][attention][gpu]") {
  MC_REQUIRE_GPU();
  if (!attention_cudnn_available()) {
    WARN("this build has no cuDNN SDPA path: test skipped");
    return;
  }
  const bool was = cudnn_attention_autotune();
  CHECK_FALSE(was);  // the library's default: the heuristic's plan
  for (bool tune : {true, false}) {
    set_cudnn_attention_autotune(tune);
    CHECK(cudnn_attention_autotune() == tune);
    for (bool causal : {false, true}) {
      GpuCase c;  // a shape no other case builds, so each setting compiles (and, on, times) its own graphs
      c.backend = AttentionBackend::Cudnn, c.dt = DType::BF16, c.dim = 128, c.causal = causal, c.sq = 161,
      c.skv = 161;
      run_gpu_case(c);
    }
  }
  set_cudnn_attention_autotune(was);
}

TEST_CASE("attention: the cuDNN switch (available = built and enabled, the reason quoted)", "[ops][attention]") {
  const bool built = attention_cudnn_built();
  REQUIRE(cudnn_attention_enabled());  // the C++ default
  CHECK(attention_cudnn_available() == built);
  set_cudnn_attention_enabled(false, "switched off by the test");
  CHECK_FALSE(cudnn_attention_enabled());
  CHECK_FALSE(attention_cudnn_available());
  if (built && cuda_available()) {
    Tensor q = Tensor::zeros({1, 128, 4, 128}, DType::BF16, mctest::gpu());
    Tensor o = Tensor::zeros({1, 128, 4, 128}, DType::BF16, mctest::gpu());
    Tensor lse = Tensor::zeros({1, 4, 128}, DType::F32, mctest::gpu());
    AttentionOptions a;
    CHECK(attention_resolve_backend(q, q, a) == AttentionBackend::Flash);
    a.backend = AttentionBackend::Cudnn;
    CHECK_THROWS_WITH(attention_forward(q, q, q, o, lse, a), Catch::Contains("switched off by the test"));
  }
  set_cudnn_attention_enabled(true);
  CHECK(cudnn_attention_enabled());
  CHECK(attention_cudnn_available() == built);
}

TEST_CASE("attention gpu: Auto picks cuDNN where it is built in", "[ops][attention][gpu]") {
  MC_REQUIRE_GPU();
  const Device g = mctest::gpu();
  Tensor q = Tensor::zeros({1, 128, 4, 128}, DType::BF16, g);
  AttentionOptions o;
  o.causal = true;
  const AttentionBackend b = attention_resolve_backend(q, q, o);
  CHECK(b == (attention_cudnn_available() ? AttentionBackend::Cudnn : AttentionBackend::Flash));
}
