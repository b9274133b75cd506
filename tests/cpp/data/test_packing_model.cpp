// Packing acceptance (issue 9): a packed row's loss equals the sum of its sequences' losses computed
// separately, with a tiny causal language model built only from megacore's own CPU ops:
//   embedding -> q/k/v projections (gemm) -> RoPE on the packed position ids -> causal varlen attention
//   driven by cu_seqlens -> output projection + residual (gemm) -> logits (gemm) -> masked cross-entropy.
// Rows come from the real data path (PackedSequenceDataset through the DataLoader, which builds
// cu_seqlens). A negative control shows the same row with attention allowed across boundaries gives a
// different loss, so the equality is not vacuous.
#include <algorithm>
#include <cmath>
#include <iomanip>
#include <memory>
#include <numeric>

#include "megacore/data/data.hpp"
#include "megacore/ops/attention.hpp"
#include "megacore/ops/cross_entropy.hpp"
#include "megacore/ops/embedding.hpp"
#include "megacore/ops/gemm.hpp"
#include "megacore/ops/rope.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::data;

namespace {

/// A one-layer causal LM with random weights (f32, CPU).
struct TinyLM {
  static constexpr int64_t kVocab = 41, kHidden = 32, kHeads = 4, kKvHeads = 2, kHeadDim = 8;
  Tensor emb, wq, wk, wv, wo, wout, inv_freq;

  explicit TinyLM(uint64_t seed) {
    Generator g(seed);
    auto w = [&](Shape shape, double std) {
      Tensor t = Tensor::empty(shape);
      t.normal_(g, 0.0, std);
      return t;
    };
    emb = w({kVocab, kHidden}, 1.0);
    // Somewhat large q/k weights make attention sharp, so cross-boundary leakage would be visible.
    wq = w({kHidden, kHeads * kHeadDim}, 2.0 / std::sqrt(double(kHidden)));
    wk = w({kHidden, kKvHeads * kHeadDim}, 2.0 / std::sqrt(double(kHidden)));
    wv = w({kHidden, kKvHeads * kHeadDim}, 1.0 / std::sqrt(double(kHidden)));
    wo = w({kHeads * kHeadDim, kHidden}, 1.0 / std::sqrt(double(kHeads * kHeadDim)));
    wout = w({kHidden, kVocab}, 1.0 / std::sqrt(double(kHidden)));
    ops::RopeConfig rc;
    rc.rotary_dim = kHeadDim;
    inv_freq = ops::rope_inv_freq(rc);
  }

  /// Masked per-token losses (f64) of T packed tokens. tokens/labels/positions i64 [T], loss_mask f32 [T],
  /// cu_seqlens i32 [segments + 1] over the T tokens.
  std::vector<double> token_losses(const Tensor& tokens, const Tensor& labels, const Tensor& loss_mask,
                                   const Tensor& positions, const Tensor& cu_seqlens, int64_t max_seqlen) const {
    const int64_t T = tokens.numel();
    Tensor x = Tensor::empty({T, kHidden});
    ops::embedding_forward(emb, tokens, x);

    Tensor q = ops::matmul(x, wq).view({T, kHeads, kHeadDim});
    Tensor k = ops::matmul(x, wk).view({T, kKvHeads, kHeadDim});
    Tensor v = ops::matmul(x, wv).view({T, kKvHeads, kHeadDim});
    ops::rope_forward(q, positions, inv_freq, q, /*interleaved=*/false);
    ops::rope_forward(k, positions, inv_freq, k, /*interleaved=*/false);

    ops::AttentionOptions ao;
    ao.causal = true;
    ao.backend = ops::AttentionBackend::Auto;
    ao.cu_seqlens_q = cu_seqlens;
    ao.cu_seqlens_kv = cu_seqlens;
    ao.max_seqlen_q = max_seqlen;
    ao.max_seqlen_kv = max_seqlen;
    REQUIRE(ops::attention_resolve_backend(q, k, ao) == ops::AttentionBackend::Reference);
    Tensor attn = Tensor::empty({T, kHeads, kHeadDim});
    Tensor lse = Tensor::empty({kHeads, T});
    ops::attention_forward(q, k, v, attn, lse, ao);

    // h = x + attn @ wo (residual through beta = 1), logits = h @ wout.
    Tensor h = x.clone();
    ops::GemmOptions acc;
    acc.beta = 1.f;
    ops::gemm(attn.view({T, kHeads * kHeadDim}), wo, h, acc);
    Tensor logits = ops::matmul(h, wout);

    Tensor loss = Tensor::empty({T}), ce_lse = Tensor::empty({T});
    ops::cross_entropy_forward(logits, labels, loss, ce_lse, loss_mask);
    return loss.to_double_vector();
  }
};

double sum(const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0); }

/// One SFT-like example: a prompt (answer flag 0) followed by an answer (flag 1).
struct Example {
  std::vector<int64_t> tokens;
  std::vector<uint8_t> answer;
};

/// The example's masked per-token losses from its own forward pass: positions 0..L-1, one segment, labels
/// its next tokens, loss where the label is an answer token, nothing to predict at the last position.
/// Built from the raw example, independently of the packer.
std::vector<double> separate_losses(const TinyLM& m, const Example& e) {
  const int64_t L = int64_t(e.tokens.size());
  std::vector<int64_t> labels(size_t(L), 0);
  std::vector<int64_t> pos(size_t(L), 0);
  std::vector<float> mask(size_t(L), 0.f);
  for (int64_t t = 0; t < L; ++t) {
    pos[size_t(t)] = t;
    if (t + 1 < L) {
      labels[size_t(t)] = e.tokens[size_t(t + 1)];
      mask[size_t(t)] = e.answer[size_t(t + 1)] ? 1.f : 0.f;
    }
  }
  return m.token_losses(Tensor::from_vector(e.tokens, {L}), Tensor::from_vector(labels, {L}),
                        Tensor::from_vector(mask, {L}), Tensor::from_vector(pos, {L}),
                        Tensor::from_vector(std::vector<int32_t>{0, int32_t(L)}, {2}), L);
}

}  // namespace

TEST_CASE("packing: a packed row's loss through megacore's ops equals its sequences' separate losses", "[data]") {
  // Relative tolerance for f32 (attention runs in f64 on the CPU; gemm/embedding/CE in f32).
  constexpr double kRelTol = 1e-5;
  // The negative control must move the loss by far more than the tolerance.
  constexpr double kMinLeak = 1e-3;

  const TinyLM model(20240609);

  // Ten SFT-like examples of different lengths (prompt + answer), random tokens from a Philox stream.
  const std::vector<std::pair<int64_t, int64_t>> shapes{{3, 6}, {5, 2}, {2, 9}, {4, 4}, {6, 7},
                                                        {2, 2}, {7, 5}, {3, 3}, {8, 6}, {1, 4}};
  std::vector<Example> examples;
  std::vector<int64_t> all_tokens, offsets{0};
  std::vector<uint8_t> all_answer;
  uint64_t draw = 0;
  for (auto [prompt, answer] : shapes) {
    Example e;
    for (int64_t t = 0; t < prompt + answer; ++t) {
      const float u = philox_uniform(7, 0, draw++);
      e.tokens.push_back(1 + int64_t(u * float(TinyLM::kVocab - 1)));  // 0 is the pad id
      e.answer.push_back(t >= prompt ? 1 : 0);
    }
    all_tokens.insert(all_tokens.end(), e.tokens.begin(), e.tokens.end());
    all_answer.insert(all_answer.end(), e.answer.begin(), e.answer.end());
    offsets.push_back(int64_t(all_tokens.size()));
    examples.push_back(std::move(e));
  }

  PackingConfig pc;
  pc.seq_length = 24;
  pc.pad_id = 0;
  auto ds = std::make_shared<PackedSequenceDataset>(all_tokens, all_answer, offsets, pc);
  REQUIRE(ds->num_truncated() == 0);
  const int64_t rows = ds->size(), S = pc.seq_length;
  REQUIRE(rows >= 2);
  REQUIRE(rows < int64_t(examples.size()));  // several sequences share rows

  // Per-sequence reference losses, each from its own forward pass.
  std::vector<std::vector<double>> sep(examples.size());
  for (size_t i = 0; i < examples.size(); ++i) {
    sep[i] = separate_losses(model, examples[i]);
    REQUIRE(sum(sep[i]) > 0.0);  // every example has answer tokens to predict
  }

  // All rows as one micro-batch from the real loader: tokens [rows, S], cu_seqlens over the flattened
  // [rows * S] tokens (THD).
  DataLoader loader(ds, {.micro_batch_size = rows, .global_batch_size = rows, .dp_rank = 0, .dp_size = 1,
                         .prefetch = 1});
  auto batch = loader.next();
  REQUIRE(batch.has_value());
  const int64_t T = rows * S;
  Tensor tokens = batch->tokens.view({T}), labels = batch->labels.view({T});
  Tensor mask = batch->loss_mask.view({T}), pos = batch->position_ids.view({T});
  const std::vector<double> cu = batch->cu_seqlens.to_double_vector();
  // The loader's position ids are exactly the restart-at-every-boundary ids RoPE expects.
  CHECK(ops::rope_positions_from_cu_seqlens(batch->cu_seqlens).to_double_vector() == pos.to_double_vector());

  SECTION("the whole micro-batch in one forward pass") {
    const std::vector<double> packed = model.token_losses(tokens, labels, mask, pos, batch->cu_seqlens,
                                                          batch->max_seqlen);
    double want = 0;
    for (const auto& s : sep) want += sum(s);
    INFO(std::setprecision(10) << "packed micro-batch loss " << sum(packed) << ", sum of separate losses " << want);
    REQUIRE(sum(packed) == Approx(want).epsilon(kRelTol));
  }

  SECTION("each packed row alone, token by token, and the cross-boundary negative control") {
    int64_t rows_with_leak = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t begin = r * S;
      // The row's own boundaries from the loader's cu_seqlens.
      std::vector<int32_t> row_cu;
      for (double c : cu)
        if (c >= double(begin) && c <= double(begin + S)) row_cu.push_back(int32_t(c) - int32_t(begin));
      REQUIRE(row_cu.front() == 0);
      REQUIRE(row_cu.back() == S);
      int64_t max_len = 0;
      for (size_t i = 0; i + 1 < row_cu.size(); ++i) max_len = std::max<int64_t>(max_len, row_cu[i + 1] - row_cu[i]);

      Tensor rt = tokens.narrow(0, begin, S), rl = labels.narrow(0, begin, S);
      Tensor rm = mask.narrow(0, begin, S), rp = pos.narrow(0, begin, S);
      const std::vector<double> packed =
          model.token_losses(rt, rl, rm, rp, Tensor::from_vector(row_cu, {int64_t(row_cu.size())}), max_len);

      // Token by token: sequence k of the row occupies [row_cu[k], row_cu[k] + len_k).
      const std::vector<int64_t>& seqs = ds->row_sequences(r);
      REQUIRE(row_cu.size() >= seqs.size() + 1);
      double want = 0;
      for (size_t k = 0; k < seqs.size(); ++k) {
        const auto& s = sep[size_t(seqs[k])];
        REQUIRE(row_cu[k + 1] - row_cu[k] == int64_t(s.size()));
        for (size_t t = 0; t < s.size(); ++t) {
          INFO("row " << r << ", sequence " << seqs[k] << ", position " << t);
          CHECK(packed[size_t(row_cu[k]) + t] == Approx(s[t]).epsilon(kRelTol).margin(1e-6));
        }
        want += sum(s);
      }
      // Padding positions carry no loss.
      for (size_t t = size_t(row_cu[seqs.size()]); t < size_t(S); ++t) CHECK(packed[t] == 0.0);
      INFO(std::setprecision(10) << "row " << r << ": packed loss " << sum(packed) << ", sum of separate losses " << want);
      REQUIRE(sum(packed) == Approx(want).epsilon(kRelTol));

      // Negative control: one segment spanning the row, so later sequences attend to earlier ones.
      const std::vector<double> leaky = model.token_losses(
          rt, rl, rm, rp, Tensor::from_vector(std::vector<int32_t>{0, int32_t(S)}, {2}), S);
      if (seqs.size() >= 2) {
        const double rel = std::abs(sum(leaky) - want) / want;
        INFO("row " << r << ": loss with attention across boundaries " << sum(leaky) << " (relative change " << rel
                    << ")");
        CHECK(rel > kMinLeak);
        ++rows_with_leak;
      } else {
        // A row holding one sequence (plus padding after it) is unaffected: causal attention never looks ahead.
        CHECK(sum(leaky) == Approx(want).epsilon(kRelTol));
      }
    }
    REQUIRE(rows_with_leak >= 1);
  }
}
