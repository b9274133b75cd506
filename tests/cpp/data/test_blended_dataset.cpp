#include <cmath>

#include "data/data_test_util.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::data;
using mctest::TempDir;

TEST_CASE("blending indices hit the weights within 1% at every prefix", "[data]") {
  std::vector<double> w{0.2, 0.5, 0.3};
  auto idx = build_blending_indices(w, 10000);
  std::vector<int64_t> count(3, 0);
  for (int64_t n = 0; n < 10000; ++n) {
    count[size_t(idx.dataset_index[size_t(n)])]++;
    REQUIRE(idx.dataset_sample_index[size_t(n)] == count[size_t(idx.dataset_index[size_t(n)])] - 1);
    if (n >= 100)
      for (int i = 0; i < 3; ++i) REQUIRE(std::abs(double(count[size_t(i)]) / double(n + 1) - w[size_t(i)]) < 0.01);
  }
  // The greedy rule keeps every count within one sample of its target.
  for (int i = 0; i < 3; ++i) CHECK(std::abs(double(count[size_t(i)]) - w[size_t(i)] * 10000) <= 1.0);
  // Unnormalised weights give the same assignment.
  CHECK(build_blending_indices({2, 5, 3}, 10000).dataset_index == idx.dataset_index);
}

TEST_CASE("split parsing and document ranges", "[data]") {
  auto f = parse_split("969,30,1");
  CHECK(f[0] == Approx(0.969));
  auto r = split_document_ranges(1000, f);
  CHECK(r[0] == std::pair<int64_t, int64_t>{0, 969});
  CHECK(r[1] == std::pair<int64_t, int64_t>{969, 999});
  CHECK(r[2] == std::pair<int64_t, int64_t>{999, 1000});
  auto g = split_document_ranges(7, parse_split("1/1/1"));
  CHECK(g[0].first == 0);
  CHECK(g[2].second == 7);
  CHECK(g[0].second == g[1].first);
  CHECK_THROWS_AS(parse_split("a,b"), ValueError);
  CHECK_THROWS_AS(parse_split("0,0,0"), ValueError);
  CHECK_THROWS_AS(parse_split("1,1,1,1"), ValueError);
}

TEST_CASE("pretraining datasets blend two corpora with exact proportions", "[data]") {
  TempDir dir;
  std::vector<int64_t> la(50, 40), lb(30, 25);
  mctest::write_numbered_dataset(dir / "a", la);
  mctest::write_numbered_dataset(dir / "b", lb);
  PretrainDatasetsConfig cfg;
  cfg.blend = {{0.3, dir / "a"}, {0.7, dir / "b"}};
  cfg.split = "90,10,0";
  cfg.seq_length = 32;
  cfg.num_samples = {1000, 20, 0};
  auto sets = build_pretrain_datasets(cfg);
  REQUIRE(sets[0] != nullptr);
  REQUIRE(sets[1] != nullptr);
  CHECK(sets[2] == nullptr);
  auto* blend = dynamic_cast<BlendedDataset*>(sets[0].get());
  REQUIRE(blend != nullptr);
  CHECK(blend->size() == 1000);
  int64_t from_a = 0;
  for (int64_t i = 0; i < 1000; ++i) from_a += blend->locate(i).first == 0;
  CHECK(std::abs(double(from_a) / 1000.0 - 0.3) < 0.01);

  // Documents of dataset a have ids d*1000+t: the train split uses documents [0, 45), valid [45, 50).
  std::vector<int64_t> tok(32), lab(32), pos(32);
  std::vector<float> mask(32);
  std::vector<int32_t> starts;
  RowView row{tok.data(), lab.data(), mask.data(), pos.data(), &starts};
  auto* valid = dynamic_cast<BlendedDataset*>(sets[1].get());
  REQUIRE(valid != nullptr);
  for (int64_t i = 0; i < valid->size(); ++i) {
    if (valid->locate(i).first != 0) continue;
    valid->get(i, row);
    for (int64_t t : tok) CHECK(t / 1000 >= 45);
  }
  for (int64_t i = 0; i < 50; ++i) {
    if (blend->locate(i).first != 0) continue;
    blend->get(i, row);
    for (int64_t t : tok) CHECK(t / 1000 < 45);
  }
}

TEST_CASE("blend rejects undersized components and bad weights", "[data]") {
  TempDir dir;
  mctest::write_numbered_dataset(dir / "a", std::vector<int64_t>(20, 30));
  auto data = std::make_shared<IndexedDataset>(dir / "a");
  GPTDatasetConfig g;
  g.seq_length = 8;
  g.num_samples = 10;
  g.use_cache = false;
  auto ds = std::make_shared<GPTDataset>(data, g);
  CHECK_THROWS_AS(BlendedDataset({ds, ds}, {0.5, 0.5}, 100), ValueError);
  CHECK_THROWS_AS(BlendedDataset({ds, ds}, {0.5, -1}, 10), ValueError);
  CHECK_THROWS_AS(BlendedDataset({ds}, {0.5, 0.5}, 10), ValueError);
  CHECK_NOTHROW(BlendedDataset({ds, ds}, {0.5, 0.5}, 20));
}
