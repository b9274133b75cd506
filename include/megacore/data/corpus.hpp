// The built-in byte-level tokenizer and the embedded default corpus (generated, no files, no network).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace megacore::data {

/// Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, then three special tokens. Needs no files; the
/// Python `megacore.tokenizers.ByteTokenizer` produces identical ids.
struct ByteTokenizer {
  static constexpr int64_t kEos = 256;
  static constexpr int64_t kPad = 257;
  static constexpr int64_t kBos = 258;
  static constexpr int64_t kVocabSize = 259;
  /// The bytes of text as ids, followed by kEos when add_eos.
  static std::vector<int64_t> encode(std::string_view text, bool add_eos = false);
  /// Bytes back to text; special tokens are dropped.
  static std::string decode(std::span<const int64_t> ids);
};

/// Size and seed of the default corpus.
struct CorpusConfig {
  int64_t num_documents = 4000;
  uint64_t seed = 0;
};

/// What write_default_corpus wrote.
struct CorpusInfo {
  int64_t documents = 0;
  int64_t tokens = 0;
};

/// Document i of the default corpus: lower-case English-like sentences built from templates with
/// learnable regularities (small-number arithmetic, counting runs, fixed animal-colour facts, echoed
/// words, alphabet runs). Deterministic in (i, seed).
std::string default_corpus_document(int64_t i, uint64_t seed = 0);

/// Writes the default corpus, byte-tokenised with an end-of-document token, to prefix.bin/.idx (u16).
CorpusInfo write_default_corpus(const std::string& prefix, const CorpusConfig& cfg = {});

}  // namespace megacore::data
