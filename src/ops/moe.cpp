#include "megacore/ops/moe.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <string_view>
#include <vector>

#include "megacore/build_config.hpp"
#include "megacore/core/random.hpp"
#include "megacore/core/log.hpp"
#include "megacore/ops/gemm.hpp"
#include "megacore/ops/ops_common.hpp"
#include "ops/cuda/grouped_gemm_sm90.hpp"
#include "ops/cuda/moe_cuda.hpp"
#include "ops/memops_cpu.hpp"
#if MEGACORE_WITH_CUDA
#include "core/cuda/cuda_check.hpp"
#endif

namespace megacore::ops {
namespace {

using cpu::ld;
using cpu::st;

// Megatron-Core's guard against an all-zero sigmoid row sum.
constexpr double kSigmoidEps = 1e-20;

double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

/// Checks a contiguous f32 [T, E] logits tensor; returns (T, E).
std::pair<int64_t, int> check_logits(const Tensor& logits, const char* op) {
  detail::check_dtype(logits, DType::F32, op, "logits");
  detail::check_contiguous(logits, op, "logits");
  MC_CHECK(logits.dim() == 2, "{}: logits must be [tokens, experts], got shape {}; flatten the leading dimensions", op,
           shape_str(logits.shape()));
  MC_CHECK(logits.size(1) >= 1, "{}: logits have no expert column (shape {})", op, shape_str(logits.shape()));
  MC_CHECK(logits.size(1) <= std::numeric_limits<int>::max(), "{}: {} experts is too many", op, logits.size(1));
  if (logits.device().is_cuda())
    MC_CHECK(logits.size(1) <= cuda::kMoeMaxExperts, "{}: {} experts; the CUDA router takes at most {}", op,
             logits.size(1), cuda::kMoeMaxExperts);
  return {logits.size(0), int(logits.size(1))};
}

void check_f32(const Tensor& t, const Shape& shape, Device d, const char* op, const char* name) {
  detail::check_dtype(t, DType::F32, op, name);
  detail::check_shape(t, shape, op, name);
  detail::check_contiguous(t, op, name);
  detail::check_same_device(t, d, op, name);
}

void check_i32(const Tensor& t, const Shape& shape, Device d, const char* op, const char* name) {
  detail::check_dtype(t, DType::I32, op, name);
  detail::check_shape(t, shape, op, name);
  detail::check_contiguous(t, op, name);
  detail::check_same_device(t, d, op, name);
}

void check_topk(int k, int e, Device d, const char* op) {
  MC_CHECK(k >= 1, "{}: topk is {}; it must be at least 1", op, k);
  MC_CHECK(k <= e, "{}: topk {} is larger than the number of experts {}; lower topk or add experts", op, k, e);
  if (d.is_cuda())
    MC_CHECK(k <= cuda::kMoeMaxTopk, "{}: topk {}; the CUDA router takes at most {}", op, k, cuda::kMoeMaxTopk);
}

/// [T, k] slot tensors: returns (T, k) from a 2-D tensor.
std::pair<int64_t, int> slots_shape(const Tensor& t, const char* op, const char* name) {
  detail::check_defined(t, op, name);
  MC_CHECK(t.dim() == 2, "{}: {} must be [tokens, topk], got shape {}", op, name, shape_str(t.shape()));
  return {t.size(0), int(t.size(1))};
}

/// CPU: every index of a [T, k] i32 tensor lies in [lo, e); `hint` ends the message.
void check_index_values(const Tensor& indices, int lo, int e, const char* op, const char* hint) {
  if (!indices.device().is_cpu()) return;
  const int32_t* p = indices.data<int32_t>();
  for (int64_t i = 0; i < indices.numel(); ++i)
    MC_CHECK(p[i] >= lo && p[i] < e, "{}: indices[{}, {}] = {} is outside [{}, {}); {}", op, i / indices.size(1),
             i % indices.size(1), p[i], lo, e, hint);
}

constexpr const char* kExpertIdHint = "expert ids are 0..E-1 and -1 marks a dropped slot";

// ---- router: CPU reference (f64) --------------------------------------------------------------------

/// Scores of one row the probabilities come from (softmax over all E, or sigmoid), f64.
void row_scores(const float* z, int e, RouterScore score, std::vector<double>& sc) {
  sc.resize(size_t(e));
  if (score == RouterScore::Sigmoid) {
    for (int i = 0; i < e; ++i) sc[size_t(i)] = sigmoid(z[i]);
    return;
  }
  double mx = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < e; ++i) mx = std::max(mx, double(z[i]));
  double sum = 0;
  for (int i = 0; i < e; ++i) sum += (sc[size_t(i)] = std::exp(double(z[i]) - mx));
  for (auto& v : sc) v /= sum;
}

/// What the router selects on, before the bias: the logits (softmax after top-k) or the scores.
bool selects_on_logits(const RouterTopkOptions& o) { return o.score == RouterScore::Softmax && !o.pre_softmax; }

/// The k experts of one row: descending `sel`, ties to the lower id.
void select_topk(const std::vector<double>& sel, int k, int32_t* idx) {
  const int e = int(sel.size());
  std::vector<char> taken(size_t(e), 0);
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int i = 0; i < e; ++i)
      if (!taken[size_t(i)] && (best < 0 || sel[size_t(i)] > sel[size_t(best)])) best = i;
    taken[size_t(best)] = 1;
    idx[j] = best;
  }
}

/// The unscaled probabilities of the chosen experts of one row (f64), given the row's scores
/// (sc: softmax or sigmoid over all E; for softmax-after-top-k, the logits).
void chosen_probs(const std::vector<double>& sc, const int32_t* idx, int k, const RouterTopkOptions& o, double* p) {
  if (selects_on_logits(o)) {
    double mx = -std::numeric_limits<double>::infinity();
    for (int j = 0; j < k; ++j) mx = std::max(mx, sc[size_t(idx[j])]);
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += (p[j] = std::exp(sc[size_t(idx[j])] - mx));
    for (int j = 0; j < k; ++j) p[j] /= sum;
    return;
  }
  double sum = 0;
  for (int j = 0; j < k; ++j) sum += (p[j] = sc[size_t(idx[j])]);
  if (o.score == RouterScore::Sigmoid && k > 1)
    for (int j = 0; j < k; ++j) p[j] /= sum + kSigmoidEps;
}

void row_base(const float* z, int e, const RouterTopkOptions& o, std::vector<double>& sc) {
  if (selects_on_logits(o)) {
    sc.assign(z, z + e);
  } else {
    row_scores(z, e, o.score, sc);
  }
}

void router_topk_cpu(const Tensor& logits, const Tensor& bias, const RouterTopkOptions& o, Tensor& probs,
                     Tensor& indices, int64_t t, int e) {
  const int k = o.topk;
  std::vector<double> sc, sel, p(static_cast<size_t>(k));
  for (int64_t r = 0; r < t; ++r) {
    const float* z = logits.data<float>() + r * e;
    row_base(z, e, o, sc);
    // Selection score: the logits without a bias (every score function is strictly increasing, so
    // this is the scores' top-k without their rounding), score + bias with one.
    if (bias.defined()) {
      sel = sc;
      for (int i = 0; i < e; ++i) sel[size_t(i)] += bias.data<float>()[i];
    } else {
      sel.assign(z, z + e);
    }
    int32_t* idx = indices.data<int32_t>() + r * k;
    select_topk(sel, k, idx);
    chosen_probs(sc, idx, k, o, p.data());
    for (int j = 0; j < k; ++j) probs.data<float>()[r * k + j] = float(p[size_t(j)] * o.scaling_factor);
  }
}

void router_topk_backward_cpu(const Tensor& logits, const Tensor& indices, const Tensor& dprobs,
                              const RouterTopkOptions& o, Tensor& dlogits, int64_t t, int e) {
  const int k = o.topk;
  std::vector<double> sc, p(static_cast<size_t>(k)), dsc(static_cast<size_t>(e));
  for (int64_t r = 0; r < t; ++r) {
    const float* z = logits.data<float>() + r * e;
    const int32_t* idx = indices.data<int32_t>() + r * k;
    const float* dp = dprobs.data<float>() + r * k;
    float* dz = dlogits.data<float>() + r * e;
    row_base(z, e, o, sc);
    chosen_probs(sc, idx, k, o, p.data());
    std::fill(dsc.begin(), dsc.end(), 0.0);
    if (selects_on_logits(o)) {
      // p = softmax over the chosen logits: dz_j = s p_j (dp_j - sum_l p_l dp_l).
      double dot = 0;
      for (int j = 0; j < k; ++j) dot += p[size_t(j)] * dp[j];
      for (int j = 0; j < k; ++j) dz[idx[j]] += float(o.scaling_factor * p[size_t(j)] * (dp[j] - dot));
      continue;
    }
    if (o.score == RouterScore::Sigmoid && k > 1) {
      // p_j = g_j / (S + eps), S = sum of the chosen sigmoids.
      double s = kSigmoidEps, dot = 0;
      for (int j = 0; j < k; ++j) s += sc[size_t(idx[j])];
      for (int j = 0; j < k; ++j) dot += dp[j] * sc[size_t(idx[j])];
      for (int j = 0; j < k; ++j) dsc[size_t(idx[j])] = o.scaling_factor * (dp[j] / s - dot / (s * s));
    } else {
      for (int j = 0; j < k; ++j) dsc[size_t(idx[j])] = o.scaling_factor * double(dp[j]);
    }
    if (o.score == RouterScore::Sigmoid) {
      for (int i = 0; i < e; ++i) dz[i] += float(dsc[size_t(i)] * sc[size_t(i)] * (1 - sc[size_t(i)]));
    } else {
      double dot = 0;
      for (int i = 0; i < e; ++i) dot += sc[size_t(i)] * dsc[size_t(i)];
      for (int i = 0; i < e; ++i) dz[i] += float(sc[size_t(i)] * (dsc[size_t(i)] - dot));
    }
  }
}

/// Aux-loss scores of a row: softmax, or sigmoid normalised by the row sum.
void aux_scores(const float* z, int e, RouterScore score, std::vector<double>& sc) {
  row_scores(z, e, score, sc);
  if (score == RouterScore::Sigmoid) {
    const double s = std::accumulate(sc.begin(), sc.end(), 0.0) + kSigmoidEps;
    for (auto& v : sc) v /= s;
  }
}

double lse_row(const float* z, int e) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int i = 0; i < e; ++i) mx = std::max(mx, double(z[i]));
  double s = 0;
  for (int i = 0; i < e; ++i) s += std::exp(double(z[i]) - mx);
  return mx + std::log(s);
}

struct AuxArgs {
  int64_t t;
  int e;
  double scale;  // coeff * E / (total^2 * topk)
};

AuxArgs check_aux(const Tensor& logits, const Tensor& tpe, int64_t total_tokens, int topk, const char* op) {
  auto [t, e] = check_logits(logits, op);
  check_f32(tpe, {e}, logits.device(), op, "tokens_per_expert");
  MC_CHECK(total_tokens >= 1, "{}: total_tokens is {}; it must count the routed tokens (>= 1)", op, total_tokens);
  MC_CHECK(topk >= 1 && topk <= e, "{}: topk {} must be in [1, {}] (the number of experts)", op, topk, e);
  return {t, e, double(e) / (double(total_tokens) * double(total_tokens) * topk)};
}

}  // namespace

void router_topk(const Tensor& logits, const Tensor& expert_bias, const RouterTopkOptions& o, Tensor& probs,
                 Tensor& indices, const Stream& s) {
  constexpr const char* op = "router_topk";
  auto [t, e] = check_logits(logits, op);
  const Device d = logits.device();
  check_topk(o.topk, e, d, op);
  if (expert_bias.defined()) check_f32(expert_bias, {e}, d, op, "expert_bias");
  check_f32(probs, {t, o.topk}, d, op, "probs");
  check_i32(indices, {t, o.topk}, d, op, "indices");
  if (d.is_cpu()) return router_topk_cpu(logits, expert_bias, o, probs, indices, t, e);
  void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
  cuda::RouterArgs a{logits.data<float>(), expert_bias.defined() ? expert_bias.data<float>() : nullptr, t, e, o.topk,
                     o.score == RouterScore::Sigmoid, o.pre_softmax, o.scaling_factor};
  cuda::router_topk(a, probs.data<float>(), indices.data<int32_t>(), d.index, stream);
#else
  (void)stream;
#endif
}

void router_topk_backward(const Tensor& logits, const Tensor& indices, const Tensor& dprobs,
                          const RouterTopkOptions& o, Tensor& dlogits, const Stream& s) {
  constexpr const char* op = "router_topk_backward";
  auto [t, e] = check_logits(logits, op);
  const Device d = logits.device();
  check_topk(o.topk, e, d, op);
  check_i32(indices, {t, o.topk}, d, op, "indices");
  check_f32(dprobs, {t, o.topk}, d, op, "dprobs");
  check_f32(dlogits, {t, e}, d, op, "dlogits");
  check_index_values(indices, 0, e, op, "pass router_topk's indices from before router_apply_capacity");
  if (d.is_cpu()) return router_topk_backward_cpu(logits, indices, dprobs, o, dlogits, t, e);
  void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
  cuda::RouterArgs a{logits.data<float>(), nullptr, t, e, o.topk, o.score == RouterScore::Sigmoid, o.pre_softmax,
                     o.scaling_factor};
  cuda::router_topk_backward(a, indices.data<int32_t>(), dprobs.data<float>(), dlogits.data<float>(), d.index, stream);
#else
  (void)stream;
#endif
}

void router_apply_capacity(Tensor& probs, Tensor& indices, int num_experts, int64_t capacity, const Stream& s) {
  constexpr const char* op = "router_apply_capacity";
  auto [t, k] = slots_shape(indices, op, "indices");
  const Device d = indices.device();
  check_i32(indices, {t, k}, d, op, "indices");
  check_f32(probs, {t, k}, d, op, "probs");
  MC_CHECK(num_experts >= 1, "{}: num_experts is {}; it must be at least 1", op, num_experts);
  MC_CHECK(capacity >= 1, "{}: capacity is {}; each expert must keep at least one slot (raise the capacity factor)",
           op, capacity);
  check_index_values(indices, -1, num_experts, op, kExpertIdHint);
  if (d.is_cpu()) {
    int32_t* idx = indices.data<int32_t>();
    float* p = probs.data<float>();
    std::vector<std::vector<int64_t>> slots(static_cast<size_t>(num_experts));
    for (int64_t i = 0; i < t * k; ++i)
      if (idx[i] >= 0) slots[size_t(idx[i])].push_back(i);
    for (auto& v : slots) {
      if (int64_t(v.size()) <= capacity) continue;
      // Slots are listed in (t, j) order, so a stable sort by descending probability breaks ties by token.
      std::stable_sort(v.begin(), v.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
      for (size_t i = size_t(capacity); i < v.size(); ++i) idx[v[i]] = -1, p[v[i]] = 0.f;
    }
    return;
  }
  void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
  cuda::router_apply_capacity(probs.data<float>(), indices.data<int32_t>(), t * k, k, num_experts, capacity, d.index,
                              stream);
#else
  (void)stream;
#endif
}

void router_aux_loss(const Tensor& logits, RouterScore score, const Tensor& tokens_per_expert, int64_t total_tokens,
                     int topk, float coeff, Tensor& loss, const Stream& s) {
  constexpr const char* op = "router_aux_loss";
  const AuxArgs a = check_aux(logits, tokens_per_expert, total_tokens, topk, op);
  const Device d = logits.device();
  check_f32(loss, {1}, d, op, "loss");
  if (d.is_cpu()) {
    std::vector<double> sc;
    double sum = 0;
    for (int64_t r = 0; r < a.t; ++r) {
      aux_scores(logits.data<float>() + r * a.e, a.e, score, sc);
      for (int i = 0; i < a.e; ++i) sum += sc[size_t(i)] * tokens_per_expert.data<float>()[i];
    }
    loss.data<float>()[0] = float(coeff * a.scale * sum);
    return;
  }
  void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
  Tensor work = Tensor::empty({std::max<int64_t>(a.t, 1)}, DType::F32, d, s);
  cuda::router_aux_loss(logits.data<float>(), score == RouterScore::Sigmoid, tokens_per_expert.data<float>(), a.t,
                        a.e, float(coeff * a.scale), work.data<float>(), loss.data<float>(), d.index, stream);
#else
  (void)stream;
#endif
}

void router_aux_loss_backward(const Tensor& logits, RouterScore score, const Tensor& tokens_per_expert,
                              int64_t total_tokens, int topk, float coeff, float dloss, Tensor& dlogits,
                              const Stream& s) {
  constexpr const char* op = "router_aux_loss_backward";
  const AuxArgs a = check_aux(logits, tokens_per_expert, total_tokens, topk, op);
  const Device d = logits.device();
  check_f32(dlogits, {a.t, a.e}, d, op, "dlogits");
  const double c = double(dloss) * coeff * a.scale;
  if (d.is_cpu()) {
    std::vector<double> sc, sg;
    const float* n = tokens_per_expert.data<float>();
    for (int64_t r = 0; r < a.t; ++r) {
      const float* z = logits.data<float>() + r * a.e;
      float* dz = dlogits.data<float>() + r * a.e;
      // d loss / d scores[t, e] = c * n_e.
      if (score == RouterScore::Softmax) {
        row_scores(z, a.e, score, sc);
        double dot = 0;
        for (int i = 0; i < a.e; ++i) dot += sc[size_t(i)] * n[i];
        for (int i = 0; i < a.e; ++i) dz[i] += float(c * sc[size_t(i)] * (n[i] - dot));
      } else {
        row_scores(z, a.e, score, sg);
        const double sum = std::accumulate(sg.begin(), sg.end(), 0.0) + kSigmoidEps;
        double dot = 0;
        for (int i = 0; i < a.e; ++i) dot += n[i] * sg[size_t(i)];
        for (int i = 0; i < a.e; ++i) {
          const double dg = c * (n[i] / sum - dot / (sum * sum));
          dz[i] += float(dg * sg[size_t(i)] * (1 - sg[size_t(i)]));
        }
      }
    }
    return;
  }
  void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
  cuda::router_aux_loss_backward(logits.data<float>(), score == RouterScore::Sigmoid, tokens_per_expert.data<float>(),
                                 a.t, a.e, float(c), dlogits.data<float>(), d.index, stream);
#else
  (void)stream;
#endif
}

void router_random_logits(Tensor& logits, uint64_t seed, uint64_t offset, int64_t first_token, const Stream& s) {
  constexpr const char* op = "router_random_logits";
  auto [t, e] = check_logits(logits, op);
  MC_CHECK(first_token >= 0, "{}: first_token {} must be >= 0 (the global index of the first row's token)", op,
           first_token);
  const Device d = logits.device();
  if (d.is_cpu()) {
    float* z = logits.data<float>();
    for (int64_t i = 0; i < t * e; ++i) z[i] = philox_normal(seed, offset, uint64_t(first_token * e + i));
    return;
  }
  void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
  cuda::router_random_logits(logits.data<float>(), t, e, seed, offset, first_token, d.index, stream);
#else
  (void)stream;
#endif
}

void router_z_loss(const Tensor& logits, float coeff, Tensor& loss, const Stream& s) {
  constexpr const char* op = "router_z_loss";
  auto [t, e] = check_logits(logits, op);
  const Device d = logits.device();
  check_f32(loss, {1}, d, op, "loss");
  MC_CHECK(t >= 1, "{}: logits have no token rows; the mean over tokens is undefined", op);
  if (d.is_cpu()) {
    double sum = 0;
    for (int64_t r = 0; r < t; ++r) {
      const double l = lse_row(logits.data<float>() + r * e, e);
      sum += l * l;
    }
    loss.data<float>()[0] = float(coeff * sum / double(t));
    return;
  }
  void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
  Tensor work = Tensor::empty({t}, DType::F32, d, s);
  cuda::router_z_loss(logits.data<float>(), t, e, float(double(coeff) / double(t)), work.data<float>(),
                      loss.data<float>(), d.index, stream);
#else
  (void)stream;
#endif
}

void router_z_loss_backward(const Tensor& logits, float coeff, float dloss, Tensor& dlogits, const Stream& s) {
  constexpr const char* op = "router_z_loss_backward";
  auto [t, e] = check_logits(logits, op);
  const Device d = logits.device();
  check_f32(dlogits, {t, e}, d, op, "dlogits");
  MC_CHECK(t >= 1, "{}: logits have no token rows; the mean over tokens is undefined", op);
  // d/dz_e of coeff/T * lse^2 = 2 coeff/T * lse * softmax_e.
  const double c = 2.0 * double(dloss) * coeff / double(t);
  if (d.is_cpu()) {
    std::vector<double> sc;
    for (int64_t r = 0; r < t; ++r) {
      const float* z = logits.data<float>() + r * e;
      const double l = lse_row(z, e);
      row_scores(z, e, RouterScore::Softmax, sc);
      for (int i = 0; i < e; ++i) dlogits.data<float>()[r * e + i] += float(c * l * sc[size_t(i)]);
    }
    return;
  }
  void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
  cuda::router_z_loss_backward(logits.data<float>(), t, e, float(c), dlogits.data<float>(), d.index, stream);
#else
  (void)stream;
#endif
}

// ---- permutation --------------------------------------------------------------------------------------

void moe_permute_map(const Tensor& indices, int num_experts, Tensor& row_map, Tensor& tokens_per_expert,
                     const Stream& s) {
  constexpr const char* op = "moe_permute_map";
  auto [t, k] = slots_shape(indices, op, "indices");
  const Device d = indices.device();
  check_i32(indices, {t, k}, d, op, "indices");
  MC_CHECK(num_experts >= 1, "{}: num_experts is {}; it must be at least 1", op, num_experts);
  check_i32(row_map, {t, k}, d, op, "row_map");
  detail::check_dtype(tokens_per_expert, DType::I64, op, "tokens_per_expert");
  detail::check_shape(tokens_per_expert, {num_experts}, op, "tokens_per_expert");
  detail::check_same_device(tokens_per_expert, d, op, "tokens_per_expert");
  check_index_values(indices, -1, num_experts, op, kExpertIdHint);
  MC_CHECK(t * k <= std::numeric_limits<int32_t>::max(), "{}: {} slots do not fit the i32 row map", op, t * k);
  if (d.is_cpu()) {
    const int32_t* idx = indices.data<int32_t>();
    int64_t* cnt = tokens_per_expert.data<int64_t>();
    std::fill(cnt, cnt + num_experts, 0);
    for (int64_t i = 0; i < t * k; ++i)
      if (idx[i] >= 0) ++cnt[idx[i]];
    std::vector<int64_t> next(size_t(num_experts), 0);
    std::exclusive_scan(cnt, cnt + num_experts, next.begin(), int64_t{0});
    // Slots in (t, j) order, so each expert's rows come out ordered by token, then j.
    for (int64_t i = 0; i < t * k; ++i) row_map.data<int32_t>()[i] = idx[i] >= 0 ? int32_t(next[size_t(idx[i])]++) : -1;
    return;
  }
  void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
  cuda::moe_permute_map(indices.data<int32_t>(), t * k, num_experts, row_map.data<int32_t>(),
                        tokens_per_expert.data<int64_t>(), d.index, stream);
#else
  (void)stream;
#endif
}

void moe_sort_map(const Tensor& layout, int64_t local_experts, int64_t pad_rows, Tensor& map, const Stream& s) {
  constexpr const char* op = "moe_sort_map";
  const Device d = layout.device();
  detail::check_dtype(layout, DType::I64, op, "layout");
  detail::check_contiguous(layout, op, "layout");
  MC_CHECK(layout.dim() == 1 && layout.numel() > 0, "{}: layout must be [chunks · experts], got shape {}", op,
           shape_str(layout.shape()));
  MC_CHECK(local_experts >= 1 && pad_rows >= 0, "{}: local_experts {} must be >= 1 and pad_rows {} >= 0", op,
           local_experts, pad_rows);
  MC_CHECK(map.defined() && map.dim() == 2 && map.size(1) == 1, "{}: map must be [chunks · pad_rows, 1], got {}", op,
           map.defined() ? shape_str(map.shape()) : std::string("undefined"));
  const int64_t n = layout.numel(), rows = map.size(0);
  const int64_t chunks = pad_rows > 0 ? rows / pad_rows : 1;
  MC_CHECK(pad_rows > 0 ? rows % pad_rows == 0 && chunks > 0 && n % chunks == 0 : rows == 0,
           "{}: map has {} rows; it must be chunks · pad_rows ({} per chunk), chunks dividing the {} layout entries",
           op, rows, pad_rows, n);
  const int64_t e = n / chunks;
  MC_CHECK(e % local_experts == 0, "{}: {} experts per chunk are not a multiple of {} local experts", op, e,
           local_experts);
  check_i32(map, {rows, 1}, d, op, "map");
  MC_CHECK(rows <= std::numeric_limits<int32_t>::max(), "{}: {} rows do not fit the i32 map", op, rows);
  if (rows == 0) return;
  if (d.is_cpu()) {
    const int64_t* lay = layout.data<int64_t>();
    int32_t* out = map.data<int32_t>();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t held = std::accumulate(lay + c * e, lay + (c + 1) * e, int64_t{0});
      MC_CHECK(held <= pad_rows, "{}: chunk {} holds {} rows, more than pad_rows {}", op, c, held, pad_rows);
    }
    std::fill(out, out + rows, -1);
    // Start of each local expert in the sorted rows, then the rows in (chunk, source, row) order.
    std::vector<int64_t> next(size_t(local_experts), 0);
    for (int64_t i = 0; i < n; ++i) next[size_t(i % local_experts)] += lay[i];
    std::exclusive_scan(next.begin(), next.end(), next.begin(), int64_t{0});
    for (int64_t c = 0; c < chunks; ++c) {
      int64_t row = c * pad_rows;
      for (int64_t i = 0; i < e; ++i)
        for (int64_t r = 0; r < lay[c * e + i]; ++r) out[row++] = int32_t(next[size_t(i % local_experts)]++);
    }
    return;
  }
  void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
  cuda::moe_sort_map(layout.data<int64_t>(), chunks, e, local_experts, pad_rows, map.data<int32_t>(), d.index, stream);
#else
  (void)stream;
#endif
}

namespace {

/// Checks a [T, k] row map against x [T, H] and a permuted [N, H] of x's dtype; returns (T, k, H, N).
struct PermShape {
  int64_t t;
  int k;
  int64_t h, n;
};
PermShape check_perm(const Tensor& x, const char* xname, const Tensor& row_map, const Tensor& permuted,
                     const char* pname, const char* op) {
  detail::check_float_input(x, op, xname);
  MC_CHECK(x.dim() == 2, "{}: {} must be [tokens, hidden], got shape {}", op, xname, shape_str(x.shape()));
  detail::check_float_input(permuted, op, pname);
  MC_CHECK(permuted.dim() == 2 && permuted.size(1) == x.size(1),
           "{}: {} must be [rows, {}] (the hidden size of {}), got shape {}", op, pname, x.size(1), xname,
           shape_str(permuted.shape()));
  MC_CHECK(permuted.dtype() == x.dtype(), "{}: {} has dtype {} but {} has {}", op, pname,
           dtype_name(permuted.dtype()), xname, dtype_name(x.dtype()));
  detail::check_same_device(permuted, x.device(), op, pname);
  auto [t, k] = slots_shape(row_map, op, "row_map");
  MC_CHECK(t == x.size(0), "{}: row_map has {} token rows but {} has {}", op, t, xname, x.size(0));
  check_i32(row_map, {t, k}, x.device(), op, "row_map");
  const int64_t n = permuted.size(0);
  if (x.device().is_cpu()) {
    const int32_t* m = row_map.data<int32_t>();
    for (int64_t i = 0; i < t * k; ++i)
      MC_CHECK(m[i] >= -1 && m[i] < n,
               "{}: row_map[{}, {}] = {} is outside [-1, {}) (the rows of {}); size {} from moe_permute_map's counts",
               op, i / k, i % k, m[i], n, pname, pname);
  }
  return {t, k, x.size(1), n};
}

void check_probs_opt(const Tensor& probs, int64_t t, int k, Device d, const char* op) {
  if (probs.defined()) check_f32(probs, {t, k}, d, op, "probs");
}

}  // namespace

void moe_permute(const Tensor& x, const Tensor& row_map, Tensor& permuted, const Stream& s) {
  constexpr const char* op = "moe_permute";
  const PermShape p = check_perm(x, "x", row_map, permuted, "permuted", op);
  const int64_t row_bytes = p.h * x.element_size();
  if (x.device().is_cpu()) {
    const auto* src = static_cast<const char*>(x.data_ptr());
    auto* dst = static_cast<char*>(permuted.data_ptr());
    const int32_t* m = row_map.data<int32_t>();
    for (int64_t i = 0; i < p.t * p.k; ++i)
      if (m[i] >= 0) std::memcpy(dst + m[i] * row_bytes, src + (i / p.k) * row_bytes, size_t(row_bytes));
    return;
  }
  void* stream = detail::launch_stream(s, x.device(), op);
#if MEGACORE_WITH_CUDA
  cuda::moe_permute(x.data_ptr(), row_map.data<int32_t>(), permuted.data_ptr(), p.t, p.k, row_bytes,
                    x.device().index, stream);
#else
  (void)stream;
#endif
}

void moe_unpermute(const Tensor& permuted, const Tensor& row_map, const Tensor& probs, Tensor& y, const Stream& s) {
  constexpr const char* op = "moe_unpermute";
  const PermShape p = check_perm(y, "y", row_map, permuted, "permuted", op);
  check_probs_opt(probs, p.t, p.k, y.device(), op);
  if (y.device().is_cpu()) {
    cpu::dispatch_float(y.dtype(), [&](auto tag) {
      using T = decltype(tag);
      const T* src = permuted.data<T>();
      const int32_t* m = row_map.data<int32_t>();
      std::vector<double> acc(size_t(p.h));
      for (int64_t t = 0; t < p.t; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int j = 0; j < p.k; ++j) {
          const int32_t r = m[t * p.k + j];
          if (r < 0) continue;
          const double w = probs.defined() ? double(probs.data<float>()[t * p.k + j]) : 1.0;
          for (int64_t i = 0; i < p.h; ++i) acc[size_t(i)] += w * ld(src[r * p.h + i]);
        }
        for (int64_t i = 0; i < p.h; ++i) y.data<T>()[t * p.h + i] = st<T>(acc[size_t(i)]);
      }
    });
    return;
  }
  void* stream = detail::launch_stream(s, y.device(), op);
#if MEGACORE_WITH_CUDA
  cuda::moe_unpermute(y.dtype(), permuted.data_ptr(), row_map.data<int32_t>(),
                      probs.defined() ? probs.data<float>() : nullptr, y.data_ptr(), p.t, p.k, p.h, y.device().index,
                      stream);
#else
  (void)stream;
#endif
}

void moe_unpermute_backward(const Tensor& dy, const Tensor& permuted, const Tensor& row_map, const Tensor& probs,
                            Tensor& dpermuted, Tensor& dprobs, const Stream& s) {
  constexpr const char* op = "moe_unpermute_backward";
  const PermShape p = check_perm(dy, "dy", row_map, permuted, "permuted", op);
  const Device d = dy.device();
  check_f32(probs, {p.t, p.k}, d, op, "probs");
  detail::check_shape(dpermuted, permuted.shape(), op, "dpermuted");
  MC_CHECK(dpermuted.dtype() == dy.dtype(), "{}: dpermuted has dtype {} but dy has {}", op,
           dtype_name(dpermuted.dtype()), dtype_name(dy.dtype()));
  detail::check_contiguous(dpermuted, op, "dpermuted");
  detail::check_same_device(dpermuted, d, op, "dpermuted");
  check_f32(dprobs, {p.t, p.k}, d, op, "dprobs");
  if (d.is_cpu()) {
    cpu::dispatch_float(dy.dtype(), [&](auto tag) {
      using T = decltype(tag);
      const int32_t* m = row_map.data<int32_t>();
      T* dp = dpermuted.data<T>();
      std::fill(dp, dp + dpermuted.numel(), st<T>(0.0));
      for (int64_t t = 0; t < p.t; ++t)
        for (int j = 0; j < p.k; ++j) {
          const int64_t slot = t * p.k + j;
          const int32_t r = m[slot];
          double dot = 0;
          if (r >= 0) {
            const double w = probs.data<float>()[slot];
            for (int64_t i = 0; i < p.h; ++i) {
              const double g = ld(dy.data<T>()[t * p.h + i]);
              dot += g * ld(permuted.data<T>()[r * p.h + i]);
              dp[r * p.h + i] = st<T>(w * g);
            }
          }
          dprobs.data<float>()[slot] = float(dot);
        }
    });
    return;
  }
  void* stream = detail::launch_stream(s, d, op);
#if MEGACORE_WITH_CUDA
  cuda::moe_unpermute_backward(dy.dtype(), dy.data_ptr(), permuted.data_ptr(), row_map.data<int32_t>(),
                               probs.data<float>(), dpermuted.data_ptr(), p.n, dprobs.data<float>(), p.t, p.k, p.h,
                               d.index, stream);
#else
  (void)stream;
#endif
}

// ---- grouped GEMM -------------------------------------------------------------------------------------

namespace {

enum class GroupedKind { Forward, Dgrad, Wgrad };

const char* grouped_name(GroupedKind k) {
  switch (k) {
    case GroupedKind::Forward: return "grouped_gemm_forward";
    case GroupedKind::Dgrad: return "grouped_gemm_dgrad";
    default: return "grouped_gemm_wgrad";
  }
}

/// All rows of the groups, and how many groups have any.
struct GroupRows {
  int64_t rows = 0, used = 0;
};
GroupRows count_rows(std::span<const int64_t> sizes) {
  GroupRows c;
  for (int64_t r : sizes) c.rows += r, c.used += r > 0;
  return c;
}

/// Checks the group sizes against N rows; returns their offsets (G + 1 entries).
std::vector<int64_t> group_offsets(std::span<const int64_t> sizes, int64_t groups, int64_t n, const char* op) {
  MC_CHECK(int64_t(sizes.size()) == groups, "{}: {} group sizes for {} expert weights; pass one size per group", op,
           sizes.size(), groups);
  std::vector<int64_t> off(sizes.size() + 1, 0);
  for (size_t g = 0; g < sizes.size(); ++g) {
    MC_CHECK(sizes[g] >= 0, "{}: group_sizes[{}] = {} is negative", op, g, sizes[g]);
    off[g + 1] = off[g] + sizes[g];
  }
  MC_CHECK(off.back() == n, "{}: group sizes sum to {} but the input has {} rows; they must sum to the rows", op,
           off.back(), n);
  return off;
}

void check_2d(const Tensor& t, const char* op, const char* name) {
  detail::check_float_input(t, op, name);
  MC_CHECK(t.dim() == 2, "{}: {} must be 2-D [rows, features], got shape {}", op, name, shape_str(t.shape()));
}

/// dw_g = beta · dw_g for the groups without rows (an empty sum leaves only the beta term).
void scale_empty_groups(const std::vector<int64_t>& off, Tensor& dw, float beta, const Stream& s) {
  if (beta == 1.f) return;
  for (size_t g = 0; g + 1 < off.size(); ++g) {
    if (off[g + 1] != off[g]) continue;
    Tensor dwg = dw.select(0, int64_t(g));
    if (beta == 0.f) {
      dwg.zero_(s);
    } else if (dwg.device().is_cpu()) {
      cpu::dispatch_float(dwg.dtype(), [&](auto tag) {
        using T = decltype(tag);
        for (int64_t i = 0; i < dwg.numel(); ++i) dwg.data<T>()[i] = st<T>(beta * ld(dwg.data<T>()[i]));
      });
    } else {
#if MEGACORE_WITH_CUDA
      cuda::moe_scale(dwg.dtype(), dwg.data_ptr(), dwg.numel(), beta, dwg.device().index,
                      detail::launch_stream(s, dwg.device(), "grouped_gemm_wgrad"));
#endif
    }
  }
}

std::atomic<int>& loop_streams_setting() {
  static std::atomic<int> v{-1};  // -1: not set yet (MEGACORE_MOE_GEMM_STREAMS, else 0 = default, at first use)
  return v;
}

int checked_loop_streams(int n, std::string_view source) {
  if (n < 0 || n > 16)
    raise<ConfigError>("{} is {}; the grouped GEMM loop runs on 1 to 16 CUDA streams (0: the default)", source, n);
  return n;
}

#if MEGACORE_WITH_CUDA
// The loop's side streams of device d (made once, kept for the process): streams[0, n).
const std::vector<Stream>& loop_side_streams(Device d, int n) {
  static std::mutex mu;
  static std::map<int, std::vector<Stream>> streams;
  std::lock_guard<std::mutex> l(mu);
  std::vector<Stream>& v = streams[d.index];
  while (int(v.size()) < n) v.push_back(Stream::create(d));
  return v;
}
#endif

/// One ops::gemm per group with rows: forward/dgrad write rows [off_g, off_g+1) of out from the rows of a
/// and weight b[g]; wgrad writes dw[g] (out) from the rows of dy (a) and x (b). The heuristic kernel,
/// untimed: row counts follow the routing. On CUDA the GEMMs go round-robin to grouped_gemm_loop_streams()
/// streams forked from s and joined back into it (every group writes its own rows, so the order is free).
void grouped_loop(GroupedKind kind, const Tensor& a, const Tensor& b, const std::vector<int64_t>& off, Tensor& out,
                  float beta, const Stream& s) {
  std::vector<size_t> used;
  for (size_t g = 0; g + 1 < off.size(); ++g)
    if (off[g + 1] > off[g]) used.push_back(g);
  auto run = [&](size_t g, const Stream& st) {
    const int64_t r0 = off[g], rows = off[g + 1] - off[g];
    GemmOptions o;
    o.autotune = false;
    if (kind == GroupedKind::Wgrad) {
      o.trans_a = true;
      o.beta = beta;
      Tensor dwg = out.select(0, int64_t(g));
      gemm(a.narrow(0, r0, rows), b.narrow(0, r0, rows), dwg, o, st);
    } else {
      o.trans_b = kind == GroupedKind::Forward;
      Tensor og = out.narrow(0, r0, rows);
      gemm(a.narrow(0, r0, rows), b.select(0, int64_t(g)), og, o, st);
    }
  };
  const int n = a.device().is_cuda()
                    ? std::min<int>(grouped_gemm_loop_streams_for(kind == GroupedKind::Wgrad), int(used.size()))
                    : 1;
  if (n <= 1) {
    for (size_t g : used) run(g, s);
  } else {
#if MEGACORE_WITH_CUDA
    const std::vector<Stream>& side = loop_side_streams(a.device(), n);
    for (int k = 0; k < n; ++k) side[size_t(k)].wait(s);
    for (size_t i = 0; i < used.size(); ++i) run(used[i], side[i % size_t(n)]);
    for (int k = 0; k < n; ++k) s.wait(side[size_t(k)]);
#endif
  }
  if (kind == GroupedKind::Wgrad) scale_empty_groups(off, out, beta, s);
}

#if MEGACORE_WITH_CUDA
/// All groups in one cuBLAS grouped launch; false when cuBLAS cannot do the case. Groups with 0 rows
/// are left out of the launch (forward/dgrad have nothing to write; wgrad handles them in the caller).
bool grouped_cuda(GroupedKind kind, const Tensor& a, const Tensor& b, const std::vector<int64_t>& off, Tensor& out,
                  float beta, const Stream& s) {
  const int64_t groups = int64_t(off.size()) - 1;
  std::vector<int64_t> m, n, k, lda, ldb, ldc;
  std::vector<const void*> pa, pb;
  std::vector<void*> pc;
  const int64_t ea = a.element_size(), eb = b.element_size(), ec = out.element_size();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = off[size_t(g)], rows = off[size_t(g) + 1] - r0;
    if (rows == 0) continue;
    const auto* a0 = static_cast<const char*>(a.data_ptr());
    const auto* b0 = static_cast<const char*>(b.data_ptr());
    auto* c0 = static_cast<char*>(out.data_ptr());
    if (kind == GroupedKind::Wgrad) {
      // dw_g [M, K] = dy_g^T [M, rows] · x_g [rows, K]
      m.push_back(a.size(1)), n.push_back(b.size(1)), k.push_back(rows);
      pa.push_back(a0 + r0 * a.size(1) * ea), lda.push_back(a.size(1));
      pb.push_back(b0 + r0 * b.size(1) * eb), ldb.push_back(b.size(1));
      pc.push_back(c0 + g * out.size(1) * out.size(2) * ec), ldc.push_back(out.size(2));
    } else {
      // forward: y_g [rows, M] = x_g [rows, K] · w_g^T;  dgrad: dx_g [rows, K] = dy_g [rows, M] · w_g
      m.push_back(rows), n.push_back(out.size(1)), k.push_back(a.size(1));
      pa.push_back(a0 + r0 * a.size(1) * ea), lda.push_back(a.size(1));
      pb.push_back(b0 + g * b.size(1) * b.size(2) * eb), ldb.push_back(b.size(2));
      pc.push_back(c0 + r0 * out.size(1) * ec), ldc.push_back(out.size(1));
    }
  }
  if (m.empty()) return true;
  cuda::GroupedGemm p;
  p.ab = a.dtype(), p.c = out.dtype();
  p.trans_a = kind == GroupedKind::Wgrad;
  p.trans_b = kind == GroupedKind::Forward;
  p.groups = int(m.size());
  p.m = m.data(), p.n = n.data(), p.k = k.data();
  p.a = pa.data(), p.b = pb.data(), p.cptr = pc.data();
  p.lda = lda.data(), p.ldb = ldb.data(), p.ldc = ldc.data();
  p.beta = kind == GroupedKind::Wgrad ? beta : 0.f;
  return cuda::grouped_gemm(p, out.device().index, detail::launch_stream(s, out.device(), grouped_name(kind)));
}
#endif

std::atomic<int64_t>& sm90_launch_count() {
  static std::atomic<int64_t> n{0};
  return n;
}

#if MEGACORE_WITH_CUDA
static_assert(kGroupedSm90MaxGroups == cuda::kGroupedSm90MaxGroups);

/// The Sm90 kernel's description of this call, and why it cannot run it (nullptr: it can).
const char* sm90_problem(GroupedKind kind, const Tensor& a, const Tensor& b, const std::vector<int64_t>& off,
                         Tensor& out, float beta, cuda::GroupedSm90& q) {
  using K = cuda::GroupedSm90::Kind;
  q.kind = kind == GroupedKind::Forward ? K::Forward : kind == GroupedKind::Dgrad ? K::Dgrad : K::Wgrad;
  q.out_f32 = out.dtype() == DType::F32;
  q.groups = int(off.size()) - 1;
  q.rows = a.size(0);
  // forward: w [G, mo, k], x [rows, k]; dgrad: w [G, mo, k], dy [rows, mo]; wgrad: dy [rows, mo], x [rows, k].
  q.mo = kind == GroupedKind::Wgrad ? a.size(1) : b.size(1);
  q.k = kind == GroupedKind::Wgrad ? b.size(1) : b.size(2);
  q.a = a.data_ptr(), q.b = b.data_ptr(), q.out = out.data_ptr();
  q.offsets = off.data();
  q.beta = kind == GroupedKind::Wgrad ? beta : 0.f;
  if (a.dtype() != DType::BF16) return "the kernel takes bf16 inputs only";
  if (!a.is_contiguous() || !b.is_contiguous() || !out.is_contiguous()) return "an operand is not contiguous";
  return cuda::grouped_sm90_unsupported(q, out.device().index);
}
#endif

std::atomic<int>& path_setting() {
  static std::atomic<int> v{-1};  // -1: not set yet (MEGACORE_MOE_GEMM, else Auto, at first use)
  return v;
}

GroupedGemmPath path_from_env() {
  const char* v = std::getenv("MEGACORE_MOE_GEMM");
  return v == nullptr || *v == '\0' ? GroupedGemmPath::Auto : parse_grouped_gemm_path(v);
}

#if MEGACORE_WITH_CUDA
/// Says once per op and path which CUDA path the grouped GEMM takes and why.
void log_path_once(const char* op, GroupedGemmPath setting, GroupedGemmPath path, bool supported, DType in,
                   DType out, std::span<const int64_t> sizes, int64_t macs_per_row) {
  const char* name = path == GroupedGemmPath::Grouped ? "one cuBLAS grouped launch" : "one cuBLASLt GEMM per group";
  std::string why;
  if (!supported) {
    why = fmt::format("cuBLAS has no grouped GEMM for {} inputs with {} output", dtype_name(in), dtype_name(out));
  } else if (setting != GroupedGemmPath::Auto) {
    why = fmt::format("MEGACORE_MOE_GEMM / set_grouped_gemm_path = {}", grouped_gemm_path_name(setting));
  } else {
    const GroupRows c = count_rows(sizes);
    why = fmt::format("auto: {} rows of {} multiply-adds over {} groups with rows, {} 2^30 multiply-adds per group "
                      "on average",
                      c.rows, macs_per_row, c.used, path == GroupedGemmPath::Grouped ? "fewer than" : "at least");
  }
  log_once(LogLevel::Info, fmt::format("{}:path:{}:{}", op, grouped_gemm_path_name(path), supported), "ops",
           fmt::format("{}: {} ({})", op, name, why));
}
#endif

void grouped_run(GroupedKind kind, const Tensor& a, const Tensor& b, std::span<const int64_t> sizes, Tensor& out,
                 float beta, const Stream& s) {
  const char* op = grouped_name(kind);
  const bool wgrad = kind == GroupedKind::Wgrad;
  check_2d(a, op, wgrad ? "dy" : kind == GroupedKind::Forward ? "x" : "dy");
  const Device d = a.device();
  const int64_t rows = a.size(0);
  int64_t groups = 0;
  if (wgrad) {
    check_2d(b, op, "x");
    MC_CHECK(b.size(0) == rows, "{}: dy has {} rows but x has {}; both are the permuted rows", op, rows, b.size(0));
    MC_CHECK(b.dtype() == a.dtype(), "{}: x has dtype {} but dy has {}", op, dtype_name(b.dtype()),
             dtype_name(a.dtype()));
    detail::check_same_device(b, d, op, "x");
    detail::check_defined(out, op, "dw");
    MC_CHECK(out.dim() == 3 && out.size(1) == a.size(1) && out.size(2) == b.size(1),
             "{}: dw must be [groups, {}, {}] (dy's and x's features), got shape {}", op, a.size(1), b.size(1),
             shape_str(out.shape()));
    MC_CHECK(out.dtype() == DType::F32 || out.dtype() == a.dtype(),
             "{}: dw has dtype {}; use f32 (the main grad) or the inputs' dtype {}", op, dtype_name(out.dtype()),
             dtype_name(a.dtype()));
    detail::check_contiguous(out, op, "dw");
    detail::check_same_device(out, d, op, "dw");
    groups = out.size(0);
  } else {
    detail::check_float_input(b, op, "w");
    MC_CHECK(b.dim() == 3, "{}: w must be [groups, M, K] (one weight per expert), got shape {}", op,
             shape_str(b.shape()));
    MC_CHECK(b.dtype() == a.dtype(), "{}: w has dtype {} but the input has {}", op, dtype_name(b.dtype()),
             dtype_name(a.dtype()));
    detail::check_same_device(b, d, op, "w");
    const int64_t in_f = kind == GroupedKind::Forward ? b.size(2) : b.size(1);
    const int64_t out_f = kind == GroupedKind::Forward ? b.size(1) : b.size(2);
    MC_CHECK(a.size(1) == in_f, "{}: the input has {} features but w {} expects {}", op, a.size(1),
             shape_str(b.shape()), in_f);
    const char* oname = kind == GroupedKind::Forward ? "y" : "dx";
    detail::check_shape(out, {rows, out_f}, op, oname);
    MC_CHECK(out.dtype() == a.dtype(), "{}: {} has dtype {}; it must be the input's dtype {}", op, oname,
             dtype_name(out.dtype()), dtype_name(a.dtype()));
    detail::check_contiguous(out, op, oname);
    detail::check_same_device(out, d, op, oname);
    groups = b.size(0);
  }
  const std::vector<int64_t> off = group_offsets(sizes, groups, rows, op);
#if MEGACORE_WITH_CUDA
  if (d.is_cuda()) {
    const GroupedGemmPath setting = grouped_gemm_path();
    if (setting == GroupedGemmPath::Auto || setting == GroupedGemmPath::Sm90) {
      cuda::GroupedSm90 q;
      const char* why = sm90_problem(kind, a, b, off, out, beta, q);
      if (why == nullptr) {
        log_once(LogLevel::Info, fmt::format("{}:path:sm90", op), "ops",
                 fmt::format("{}: megacore's Hopper grouped kernel (one launch for all {} groups)", op, q.groups));
        cuda_impl::DeviceGuard guard(d.index);
        bool launched = false;
        const cudaError_t err = cudaError_t(cuda::grouped_sm90(q, d.index, detail::launch_stream(s, d, op), &launched));
        if (err != cudaSuccess)
          raise<CudaError>("{}: the Hopper grouped kernel failed to launch: {} ({})", op, cudaGetErrorString(err),
                           cudaGetErrorName(err));
        if (launched) sm90_launch_count().fetch_add(1);
        if (wgrad) scale_empty_groups(off, out, beta, s);
        return;
      }
      if (setting == GroupedGemmPath::Sm90)
        log_once(LogLevel::Info, fmt::format("{}:sm90-unavailable:{}", op, why), "ops",
                 fmt::format("{}: MEGACORE_MOE_GEMM / set_grouped_gemm_path = sm90, but the Hopper grouped kernel "
                             "cannot run this call ({}); taking the cuBLAS path auto picks",
                             op, why));
    }
    // cuBLAS documents grouped kernels for A = B = C only.
    const bool supported = a.dtype() == out.dtype();
    // Multiply-adds per row: forward/dgrad a's features × the output's, wgrad dy's × x's.
    const int64_t macs_per_row = a.size(1) * (wgrad ? b.size(1) : out.size(1));
    const GroupedGemmPath cublas_setting = setting == GroupedGemmPath::Sm90 ? GroupedGemmPath::Auto : setting;
    const GroupedGemmPath path = grouped_gemm_choice(cublas_setting, sizes, macs_per_row, supported);
    log_path_once(op, cublas_setting, path, supported, a.dtype(), out.dtype(), sizes, macs_per_row);
    if (path == GroupedGemmPath::Grouped) {
      if (grouped_cuda(kind, a, b, off, out, beta, s)) {
        if (wgrad) scale_empty_groups(off, out, beta, s);
        return;
      }
      log_once(LogLevel::Info, fmt::format("{}:unsupported:{}:{}", op, dtype_name(a.dtype()), dtype_name(out.dtype())),
               "ops",
               fmt::format("{}: cuBLAS declined the grouped GEMM for {} inputs with {} output; running one GEMM per "
                           "group",
                           op, dtype_name(a.dtype()), dtype_name(out.dtype())));
    }
  }
#endif
  grouped_loop(kind, a, b, off, out, beta, s);
}

}  // namespace

const char* grouped_gemm_path_name(GroupedGemmPath path) {
  switch (path) {
    case GroupedGemmPath::Loop: return "loop";
    case GroupedGemmPath::Grouped: return "grouped";
    case GroupedGemmPath::Sm90: return "sm90";
    default: return "auto";
  }
}

GroupedGemmPath parse_grouped_gemm_path(std::string_view name, std::string_view source) {
  for (GroupedGemmPath p : {GroupedGemmPath::Auto, GroupedGemmPath::Loop, GroupedGemmPath::Grouped, GroupedGemmPath::Sm90})
    if (name == grouped_gemm_path_name(p)) return p;
  raise<ConfigError>("{} is '{}'; the grouped GEMM path is auto, loop, grouped or sm90", source, name);
}

GroupedGemmPath grouped_gemm_path() {
  int v = path_setting().load();
  if (v < 0) {
    int unset = -1;
    path_setting().compare_exchange_strong(unset, int(path_from_env()));
    v = path_setting().load();
  }
  return GroupedGemmPath(v);
}

void set_grouped_gemm_path(GroupedGemmPath path) { path_setting().store(int(path)); }

int grouped_gemm_loop_streams() {
  int v = loop_streams_setting().load();
  if (v < 0) {
    const char* e = std::getenv("MEGACORE_MOE_GEMM_STREAMS");
    int from_env = 0;
    if (e != nullptr && *e != '\0') {
      char* end = nullptr;
      const long n = std::strtol(e, &end, 10);
      if (end == e || *end != '\0')
        raise<ConfigError>("MEGACORE_MOE_GEMM_STREAMS is '{}'; give a number of CUDA streams from 1 to 16 (0: the "
                           "default)",
                           e);
      from_env = checked_loop_streams(int(std::clamp<long>(n, -1, 17)), "MEGACORE_MOE_GEMM_STREAMS");
    }
    int unset = -1;
    loop_streams_setting().compare_exchange_strong(unset, from_env);
    v = loop_streams_setting().load();
  }
  return v;
}

int grouped_gemm_loop_streams_for(bool wgrad) {
  const int v = grouped_gemm_loop_streams();
  return v > 0 ? v : wgrad ? kGroupedGemmWgradStreams : 1;
}

void set_grouped_gemm_loop_streams(int streams) {
  loop_streams_setting().store(checked_loop_streams(streams, "set_grouped_gemm_loop_streams"));
}

GroupedGemmPath grouped_gemm_choice(GroupedGemmPath path, std::span<const int64_t> group_sizes, int64_t macs_per_row,
                                    bool grouped_supported) {
  if (!grouped_supported) return GroupedGemmPath::Loop;
  if (path == GroupedGemmPath::Loop || path == GroupedGemmPath::Grouped) return path;
  const GroupRows c = count_rows(group_sizes);
  // Mean multiply-adds per group with rows < the bound, in doubles (rows · M · K overflows nothing there).
  return c.used > 0 && double(c.rows) * double(macs_per_row) < double(kGroupedGemmMaxMeanMacs) * double(c.used)
             ? GroupedGemmPath::Grouped
             : GroupedGemmPath::Loop;
}

bool grouped_gemm_sm90_available(Device d) {
#if MEGACORE_WITH_CUDA
  return d.is_cuda() && cuda::grouped_sm90_device_unsupported(d.index) == nullptr;
#else
  (void)d;
  return false;
#endif
}

int64_t grouped_gemm_sm90_launches() { return sm90_launch_count().load(); }

void grouped_gemm_forward(const Tensor& x, const Tensor& w, std::span<const int64_t> group_sizes, Tensor& y,
                          const Stream& s) {
  grouped_run(GroupedKind::Forward, x, w, group_sizes, y, 0.f, s);
}

void grouped_gemm_dgrad(const Tensor& dy, const Tensor& w, std::span<const int64_t> group_sizes, Tensor& dx,
                        const Stream& s) {
  grouped_run(GroupedKind::Dgrad, dy, w, group_sizes, dx, 0.f, s);
}

void grouped_gemm_wgrad(const Tensor& dy, const Tensor& x, std::span<const int64_t> group_sizes, Tensor& dw,
                        float beta, const Stream& s) {
  grouped_run(GroupedKind::Wgrad, dy, x, group_sizes, dw, beta, s);
}

}  // namespace megacore::ops
