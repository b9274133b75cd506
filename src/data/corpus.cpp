#include "megacore/data/corpus.hpp"

#include <fmt/format.h>

#include "megacore/core/error.hpp"
#include "megacore/core/random.hpp"
#include "megacore/data/indexed_dataset.hpp"

namespace megacore::data {

std::vector<int64_t> ByteTokenizer::encode(std::string_view text, bool add_eos) {
  std::vector<int64_t> ids;
  ids.reserve(text.size() + 1);
  for (unsigned char c : text) ids.push_back(int64_t(c));
  if (add_eos) ids.push_back(kEos);
  return ids;
}

std::string ByteTokenizer::decode(std::span<const int64_t> ids) {
  std::string s;
  s.reserve(ids.size());
  for (int64_t id : ids)
    if (id >= 0 && id < 256) s.push_back(char(uint8_t(id)));
  return s;
}

namespace {

// Fixed facts so that a model can only lower its loss on them by memorising the association.
constexpr const char* kAnimals[] = {"cat", "dog", "fox", "owl", "bee", "cow", "elk", "ant", "bat", "yak", "emu", "pig"};
constexpr const char* kColours[] = {"black", "brown", "red", "white", "yellow", "grey",
                                    "tan", "green", "purple", "blue", "pink", "orange"};
constexpr const char* kWords[] = {"sun", "moon", "tree", "river", "stone", "cloud", "rain", "wind"};
constexpr const char* kNames[] = {"ada", "bob", "eve", "max", "sam", "zoe"};

class Draws {
 public:
  Draws(uint64_t seed, uint64_t doc) : seed_(seed), doc_(doc) {}
  // Uniform in [0, n) from the doc's own counter stream, so documents are independent of each other.
  int64_t below(int64_t n) {
    Philox4 w = philox_words(seed_, doc_, k_++);
    return int64_t(w.v[0] % uint32_t(n));
  }

 private:
  uint64_t seed_, doc_, k_ = 0;
};

std::string sentence(Draws& r) {
  switch (r.below(6)) {
    case 0: {
      int64_t a = r.below(20), b = r.below(20);
      return fmt::format("{} plus {} is {}.", a, b, a + b);
    }
    case 1: {
      int64_t a = r.below(10), b = r.below(10);
      return fmt::format("{} times {} is {}.", a, b, a * b);
    }
    case 2: {
      int64_t start = r.below(50), n = 4 + r.below(5);
      std::string s = "count:";
      for (int64_t i = 0; i < n; ++i) s += fmt::format(" {}", start + i);
      return s + ".";
    }
    case 3: {
      int64_t a = r.below(12);
      return fmt::format("the {} is {}.", kAnimals[a], kColours[a]);
    }
    case 4: {
      const char* w = kWords[r.below(8)];
      return fmt::format("{} says {} {} {}.", kNames[r.below(6)], w, w, w);
    }
    default: {
      int64_t start = r.below(20), n = 5 + r.below(6);
      std::string s;
      for (int64_t i = 0; i < n; ++i) s.push_back(char('a' + start + i));
      return s + " is in order.";
    }
  }
}

}  // namespace

std::string default_corpus_document(int64_t i, uint64_t seed) {
  MC_CHECK(i >= 0, "document index must be >= 0, got {}", i);
  Draws r(seed, uint64_t(i));
  int64_t n = 4 + r.below(9);
  std::string doc;
  for (int64_t k = 0; k < n; ++k) {
    if (k) doc.push_back(' ');
    doc += sentence(r);
  }
  doc.push_back('\n');
  return doc;
}

CorpusInfo write_default_corpus(const std::string& prefix, const CorpusConfig& cfg) {
  MC_CHECK(cfg.num_documents >= 1, "num_documents must be >= 1, got {}", cfg.num_documents);
  IndexedDatasetWriter w(prefix, TokenDType::U16);
  for (int64_t i = 0; i < cfg.num_documents; ++i) {
    std::vector<int64_t> ids = ByteTokenizer::encode(default_corpus_document(i, cfg.seed), true);
    w.add_document(ids);
  }
  CorpusInfo info{w.num_documents(), w.num_tokens()};
  w.finalize();
  return info;
}

}  // namespace megacore::data
