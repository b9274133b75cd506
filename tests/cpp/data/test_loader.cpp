#include <algorithm>
#include <map>
#include <set>
#include <thread>

#include "data/data_test_util.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::data;
using mctest::TempDir;

namespace {
std::shared_ptr<GPTDataset> small_gpt(const TempDir& dir, int64_t samples) {
  std::vector<int64_t> lens;
  for (int d = 0; d < 60; ++d) lens.push_back(5 + (d * 13) % 31);
  mctest::write_numbered_dataset(dir / "ds", lens);
  GPTDatasetConfig cfg;
  cfg.seq_length = 12;
  cfg.num_samples = samples;
  cfg.use_cache = false;
  return std::make_shared<GPTDataset>(std::make_shared<IndexedDataset>(dir / "ds"), cfg);
}

std::vector<int64_t> row_tokens(const Batch& b, int64_t row) {
  auto all = b.tokens.to_double_vector();
  int64_t S = b.tokens.size(1);
  std::vector<int64_t> out;
  for (int64_t t = 0; t < S; ++t) out.push_back(int64_t(all[size_t(row * S + t)]));
  return out;
}
}  // namespace

TEST_CASE("loader: DP=4 ranks together see exactly DP=1's batches", "[data]") {
  TempDir dir;
  auto ds = small_gpt(dir, 96);
  // Per step: samples -> tokens, from DP=1 with 4 micro-batches of 2 (global batch 8).
  std::map<int64_t, std::map<int64_t, std::vector<int64_t>>> one;
  {
    DataLoader l(ds, {.micro_batch_size = 2, .global_batch_size = 8, .dp_rank = 0, .dp_size = 1});
    CHECK(l.num_steps() == 12);
    CHECK(l.micro_batches_per_step() == 4);
    while (auto b = l.next())
      for (int64_t r = 0; r < 2; ++r) one[b->step][b->sample_indices[size_t(r)]] = row_tokens(*b, r);
    CHECK(l.consumed_samples() == 96);
  }
  std::map<int64_t, std::map<int64_t, std::vector<int64_t>>> four;
  for (int rank = 0; rank < 4; ++rank) {
    DataLoader l(ds, {.micro_batch_size = 2, .global_batch_size = 8, .dp_rank = rank, .dp_size = 4});
    CHECK(l.micro_batches_per_step() == 1);
    int64_t n = 0;
    while (auto b = l.next()) {
      ++n;
      for (int64_t r = 0; r < 2; ++r) {
        int64_t idx = b->sample_indices[size_t(r)];
        CHECK(four[b->step].count(idx) == 0);  // no sample read by two ranks
        four[b->step][idx] = row_tokens(*b, r);
      }
    }
    CHECK(n == 12);
  }
  CHECK(four == one);
}

TEST_CASE("loader resumes exactly from consumed_samples", "[data]") {
  TempDir dir;
  auto ds = small_gpt(dir, 64);
  LoaderConfig cfg{.micro_batch_size = 2, .global_batch_size = 8, .dp_rank = 1, .dp_size = 2};
  std::vector<std::vector<int64_t>> full;
  int64_t resume_at = 0;
  {
    DataLoader l(ds, cfg);
    int k = 0;
    while (auto b = l.next()) {
      full.push_back(b->sample_indices);
      if (++k == 6) resume_at = l.consumed_samples();
    }
  }
  CHECK(resume_at == 24);
  cfg.consumed_samples = resume_at;
  DataLoader l(ds, cfg);
  std::vector<std::vector<int64_t>> rest;
  while (auto b = l.next()) rest.push_back(b->sample_indices);
  CHECK(rest == std::vector<std::vector<int64_t>>(full.begin() + 6, full.end()));
  cfg.consumed_samples = 3;
  CHECK_THROWS_AS(DataLoader(ds, cfg), ValueError);
}

TEST_CASE("loader: epochs visit every sample once per pass, each pass in its own order, and resume", "[data]") {
  TempDir dir;
  auto ds = small_gpt(dir, 40);  // 40 samples, global batch 8: 5 steps a pass
  LoaderConfig cfg{.micro_batch_size = 2, .global_batch_size = 8, .shuffle = true, .seed = 7, .epochs = 3};
  std::vector<std::vector<int64_t>> passes(3);  // dataset index of every row, per pass
  std::vector<std::vector<int64_t>> full;
  {
    DataLoader l(ds, cfg);
    CHECK(l.steps_per_epoch() == 5);
    CHECK(l.num_steps() == 15);
    while (auto b = l.next()) {
      full.push_back(b->sample_indices);
      for (int64_t i : b->sample_indices) passes[size_t(b->step / 5)].push_back(i);
    }
    CHECK(l.consumed_samples() == 120);
  }
  for (auto& p : passes) {
    std::vector<int64_t> sorted = p;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> all(40);
    for (int64_t i = 0; i < 40; ++i) all[size_t(i)] = i;
    CHECK(sorted == all);  // each pass is a permutation of the whole dataset
  }
  CHECK(passes[0] != passes[1]);
  CHECK(passes[1] != passes[2]);
  // The first pass is the order a one-epoch loader gives.
  {
    LoaderConfig one = cfg;
    one.epochs = 1;
    DataLoader l(ds, one);
    std::vector<int64_t> seen;
    while (auto b = l.next())
      for (int64_t i : b->sample_indices) seen.push_back(i);
    CHECK(seen == passes[0]);
  }
  // Resuming in the second pass continues with that pass's order.
  cfg.consumed_samples = 56;  // 7 steps
  DataLoader l(ds, cfg);
  std::vector<std::vector<int64_t>> rest;
  while (auto b = l.next()) rest.push_back(b->sample_indices);
  CHECK(rest == std::vector<std::vector<int64_t>>(full.begin() + 28, full.end()));
  cfg.epochs = 0;
  CHECK_THROWS_AS(DataLoader(ds, cfg), ValueError);
}

TEST_CASE("loader: packed rows give cu_seqlens over the flattened batch", "[data]") {
  std::vector<int64_t> tokens;
  std::vector<uint8_t> answer;
  std::vector<int64_t> offsets{0};
  for (int k = 0; k < 9; ++k) {
    for (int t = 0; t < 3 + k % 4; ++t) {
      tokens.push_back(k * 10 + t);
      answer.push_back(t > 0);
    }
    offsets.push_back(int64_t(tokens.size()));
  }
  PackingConfig pc;
  pc.seq_length = 8;
  auto ds = std::make_shared<PackedSequenceDataset>(tokens, answer, offsets, pc);
  DataLoader l(ds, {.micro_batch_size = 2, .shuffle = true, .seed = 5});
  std::set<int64_t> seen;
  while (auto b = l.next()) {
    auto cu = b->cu_seqlens.to_double_vector();
    auto pos = b->position_ids.to_double_vector();
    REQUIRE(cu.front() == 0);
    REQUIRE(cu.back() == 16);
    CHECK(std::find(cu.begin(), cu.end(), 8.0) != cu.end());  // the row boundary
    for (size_t s = 0; s + 1 < cu.size(); ++s) {
      REQUIRE(cu[s + 1] > cu[s]);
      CHECK(pos[size_t(cu[s])] == 0);  // positions restart at each segment start
      CHECK(b->max_seqlen >= int64_t(cu[s + 1] - cu[s]));
      for (int64_t t = int64_t(cu[s]) + 1; t < int64_t(cu[s + 1]); ++t) CHECK(pos[size_t(t)] == pos[size_t(t - 1)] + 1);
    }
    for (auto i : b->sample_indices) seen.insert(i);
  }
  CHECK(int64_t(seen.size()) == (ds->size() / 2) * 2);
}

namespace {
// A dataset that fails on one sample, to check that producer errors reach the consumer.
struct Failing : SampleSource {
  int64_t size() const override { return 10; }
  int64_t seq_length() const override { return 4; }
  void get(int64_t i, const RowView& out) const override {
    if (i == 3) raise<IOError>("sample {} is broken", i);
    for (int t = 0; t < 4; ++t) {
      out.tokens[t] = out.labels[t] = out.position_ids[t] = t;
      out.loss_mask[t] = 1;
    }
    out.seq_starts->assign(1, 0);
  }
};
}  // namespace

TEST_CASE("loader surfaces producer errors and prefetches in the background", "[data]") {
  DataLoader l(std::make_shared<Failing>(), {.micro_batch_size = 1, .prefetch = 2});
  CHECK(l.next().has_value());
  CHECK(l.next().has_value());
  CHECK(l.next().has_value());
  CHECK_THROWS_AS(l.next(), IOError);

  TempDir dir;
  auto ds = small_gpt(dir, 40);
  DataLoader p(ds, {.micro_batch_size = 4, .prefetch = 3});
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let the producer fill its queue
  auto b = p.next();
  REQUIRE(b.has_value());
  CHECK(p.stats().max_wait_seconds < 0.05);
  // Batches held by the caller stay valid while later ones are produced.
  std::vector<Batch> held;
  while (auto x = p.next()) held.push_back(*x);
  CHECK(held.size() == 9);
  auto want = ds->sample_tokens(held[0].sample_indices[0]);
  want.pop_back();
  CHECK(row_tokens(held[0], 0) == want);
}

TEST_CASE("default corpus and byte tokenizer", "[data]") {
  CHECK(ByteTokenizer::encode("hi", true) == std::vector<int64_t>{104, 105, ByteTokenizer::kEos});
  CHECK(ByteTokenizer::decode(std::vector<int64_t>{104, 105, 256}) == "hi");
  CHECK(default_corpus_document(3) == default_corpus_document(3));
  CHECK(default_corpus_document(3) != default_corpus_document(4));
  TempDir dir;
  auto info = write_default_corpus(dir / "corpus", {.num_documents = 50});
  IndexedDataset ds(dir / "corpus");
  CHECK(ds.num_documents() == 50);
  CHECK(ds.num_tokens() == info.tokens);
  auto doc = ds.sequence(0);
  CHECK(doc.back() == ByteTokenizer::kEos);
  CHECK(ByteTokenizer::decode(doc) == default_corpus_document(0));
}

TEST_CASE("loader: ids outside the model's vocabulary are a ValueError naming the sample", "[data]") {
  // The numbered dataset's documents d hold ids d * 1000 + t: documents from 30 on exceed 30000.
  TempDir dir;
  auto ds = small_gpt(dir, 40);
  int64_t max_id = 0;
  for (int64_t i = 0; i < ds->size(); ++i)
    for (int64_t id : ds->sample_tokens(i)) max_id = std::max(max_id, id);
  REQUIRE(max_id >= 30000);
  {
    DataLoader ok(ds, {.micro_batch_size = 4, .vocab_size = max_id + 1});
    int n = 0;
    while (ok.next()) ++n;
    CHECK(n == 10);
  }
  DataLoader bad(ds, {.micro_batch_size = 4, .vocab_size = 30000});
  try {
    while (bad.next()) {
    }
    FAIL("no error for ids past the vocabulary");
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    CHECK(msg.find("outside the model's vocabulary [0, 30000)") != std::string::npos);
    CHECK(msg.find("sample ") != std::string::npos);
    CHECK(msg.find("model.vocab_size") != std::string::npos);
  }
}
