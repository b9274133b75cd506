// Helpers shared by the model, pipeline and context-parallel tests: the deterministic token batches they
// feed, the tied tiny Llama, and a TP-sharded tensor gathered as the TP = 1 model holds it.
#pragma once

#include <cstdint>
#include <vector>

#include "layers/layers_test_util.hpp"
#include "megacore/model/gpt_model.hpp"
#include "megacore/parallel/mappings.hpp"

namespace model_test {

using namespace ::megacore;

struct Batch {
  Tensor tokens, labels, mask;
};

/// A [batch, seq] batch the same on every rank: token i is (37 i + 5 + 11 salt) mod vocab, label i
/// (53 i + 11 + 7 salt) mod vocab, position i is out of the loss (mask 0) where masked(i), and label
/// `ignored` is -100 (none when negative).
template <class Masked>
Batch token_batch(int64_t batch, int64_t seq, int64_t vocab, int64_t salt, int64_t ignored, Masked&& masked) {
  std::vector<int64_t> tok, lab;
  std::vector<float> mask;
  for (int64_t i = 0; i < batch * seq; ++i) {
    tok.push_back((i * 37 + 5 + salt * 11) % vocab);
    lab.push_back((i * 53 + 11 + salt * 7) % vocab);
    mask.push_back(masked(i) ? 0.f : 1.f);
  }
  if (ignored >= 0) lab[size_t(ignored)] = -100;
  return {Tensor::from_vector<int64_t>(tok, {batch, seq}), Tensor::from_vector<int64_t>(lab, {batch, seq}),
          Tensor::from_vector<float>(mask, {batch, seq})};
}
/// token_batch with every fifth position (i % 5 == 3) out of the loss.
inline Batch token_batch(int64_t batch, int64_t seq, int64_t vocab, int64_t salt = 0, int64_t ignored = -1) {
  return token_batch(batch, seq, vocab, salt, ignored, [](int64_t i) { return i % 5 == 3; });
}

/// The tiny Llama with tied input and output embeddings.
inline model::TransformerConfig llama_tied() {
  model::TransformerConfig c = model::presets::tiny_llama();
  c.tie_word_embeddings = true;
  return c;
}

/// A tensor of p's shape (its gradient, its data) as the full TP = 1 tensor: gathered over `tp` along
/// p.partition_dim (replicated ones as they are), vocabulary padding rows (`padded` → `vocab`) dropped.
inline Tensor full_tensor(comm::Communicator& tp, const layers::Parameter& p, const Tensor& t, int64_t padded,
                          int64_t vocab) {
  Tensor g = p.partition_dim < 0 || tp.size() == 1 ? t.contiguous()
                                                   : parallel::all_gather_along(tp, t.contiguous(), p.partition_dim);
  if (g.dim() == 2 && g.size(0) == padded) g = g.narrow(0, 0, vocab).contiguous();
  return g;
}

}  // namespace model_test
