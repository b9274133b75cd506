#include <algorithm>
#include <map>
#include <set>

#include "data/data_test_util.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::data;
using mctest::TempDir;

namespace {
std::vector<int64_t> doc_lengths() {
  std::vector<int64_t> l;
  for (int d = 0; d < 40; ++d) l.push_back(3 + (d * 7) % 29);
  return l;
}
}  // namespace

TEST_CASE("seeded permutation is a deterministic permutation", "[data]") {
  auto p = seeded_permutation(1000, 7, 0);
  auto q = seeded_permutation(1000, 7, 0);
  CHECK(p == q);
  CHECK(p != seeded_permutation(1000, 8, 0));
  CHECK(p != seeded_permutation(1000, 7, 1));
  auto s = p;
  std::sort(s.begin(), s.end());
  for (int64_t i = 0; i < 1000; ++i) REQUIRE(s[size_t(i)] == i);
}

TEST_CASE("GPT samples are contiguous seq_length + 1 token windows over shuffled documents", "[data]") {
  TempDir dir;
  auto lens = doc_lengths();
  mctest::write_numbered_dataset(dir / "ds", lens);
  auto data = std::make_shared<IndexedDataset>(dir / "ds");
  GPTDatasetConfig cfg;
  cfg.seq_length = 16;
  cfg.num_samples = 200;  // several epochs of ~700 tokens
  cfg.seed = 3;
  GPTDataset ds(data, cfg);
  REQUIRE(ds.size() == 200);
  CHECK(ds.num_epochs() == (200 * 16 + 1 + data->num_tokens() - 1) / data->num_tokens());

  // Rebuild the token stream implied by the document index and check each unshuffled sample against it.
  std::vector<int64_t> stream;
  for (int32_t d : ds.document_index()) {
    auto seq = data->sequence(d);
    stream.insert(stream.end(), seq.begin(), seq.end());
  }
  std::vector<int64_t> inv(200);
  for (int64_t i = 0; i < 200; ++i) inv[size_t(ds.shuffle_index()[size_t(i)])] = i;
  for (int64_t s = 0; s < 200; ++s) {
    auto got = ds.sample_tokens(inv[size_t(s)]);
    std::vector<int64_t> want(stream.begin() + s * 16, stream.begin() + s * 16 + 17);
    REQUIRE(got == want);
  }
  // Each epoch holds every document exactly once.
  for (int64_t e = 0; e < ds.num_epochs(); ++e) {
    std::set<int32_t> docs(ds.document_index().begin() + e * 40, ds.document_index().begin() + (e + 1) * 40);
    CHECK(docs.size() == 40);
  }
  // Rows: labels are the tokens shifted by one.
  std::vector<int64_t> tok(16), lab(16), pos(16);
  std::vector<float> mask(16);
  std::vector<int32_t> starts;
  ds.get(5, RowView{tok.data(), lab.data(), mask.data(), pos.data(), &starts});
  auto raw = ds.sample_tokens(5);
  CHECK(std::equal(tok.begin(), tok.end(), raw.begin()));
  CHECK(std::equal(lab.begin(), lab.end(), raw.begin() + 1));
  CHECK(starts == std::vector<int32_t>{0});
  CHECK(pos[15] == 15);
}

TEST_CASE("GPT index cache is reused and keyed by the parameters", "[data]") {
  TempDir dir;
  mctest::write_numbered_dataset(dir / "ds", doc_lengths());
  auto data = std::make_shared<IndexedDataset>(dir / "ds");
  GPTDatasetConfig cfg;
  cfg.seq_length = 8;
  cfg.num_samples = 50;
  GPTDataset a(data, cfg);
  CHECK_FALSE(a.loaded_from_cache());
  CHECK(std::filesystem::exists(a.cache_path()));
  CHECK(a.cache_path().find(a.index_hash()) != std::string::npos);
  GPTDataset b(data, cfg);
  CHECK(b.loaded_from_cache());
  CHECK(b.shuffle_index() == a.shuffle_index());
  CHECK(b.sample_index() == a.sample_index());
  CHECK(b.sample_tokens(7) == a.sample_tokens(7));

  cfg.seed = 99;
  GPTDataset c(data, cfg);
  CHECK_FALSE(c.loaded_from_cache());
  CHECK(c.cache_path() != a.cache_path());

  // A damaged cache is rebuilt, not trusted.
  auto bytes = mctest::read_file(a.cache_path());
  bytes.resize(bytes.size() / 2);
  mctest::write_file(a.cache_path(), bytes);
  cfg.seed = 1234;
  GPTDataset d(data, cfg);
  CHECK_FALSE(d.loaded_from_cache());
  CHECK(d.sample_tokens(7) == a.sample_tokens(7));
}

TEST_CASE("GPT dataset rejects too little data", "[data]") {
  TempDir dir;
  mctest::write_numbered_dataset(dir / "ds", {3, 4});
  auto data = std::make_shared<IndexedDataset>(dir / "ds");
  GPTDatasetConfig cfg;
  cfg.seq_length = 16;
  cfg.use_cache = false;
  CHECK_THROWS_AS(GPTDataset(data, cfg), ValueError);
}
