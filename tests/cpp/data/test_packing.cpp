#include <algorithm>
#include <numeric>

#include "data/data_test_util.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::data;

TEST_CASE("first-fit-decreasing packs like the textbook algorithm", "[data]") {
  std::vector<int64_t> lens{5, 7, 3, 2, 8, 4, 1, 6};
  auto bins = pack_first_fit_decreasing(lens, 10);
  // Sorted: 8(4) 7(1) 6(7) 5(0) 4(5) 3(2) 2(3) 1(6)
  // 8->b0, 7->b1, 6->b2, 5->b3, 4->b2(10), 3->b1(10), 2->b0(10), 1->b3(6)
  std::vector<std::vector<int64_t>> want{{4, 3}, {1, 2}, {7, 5}, {0, 6}};
  CHECK(bins == want);

  // Randomised: every item placed once, no bin over capacity, and the naive O(n * bins) FFD agrees.
  std::vector<int64_t> big;
  for (int i = 0; i < 500; ++i) big.push_back(1 + (i * 37 + i * i) % 64);
  auto fast = pack_first_fit_decreasing(big, 64);
  std::vector<int64_t> order(big.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return big[size_t(a)] > big[size_t(b)]; });
  std::vector<std::vector<int64_t>> naive;
  std::vector<int64_t> room;
  for (int64_t it : order) {
    size_t b = 0;
    while (b < room.size() && room[b] < big[size_t(it)]) ++b;
    if (b == room.size()) {
      room.push_back(64);
      naive.emplace_back();
    }
    room[b] -= big[size_t(it)];
    naive[b].push_back(it);
  }
  CHECK(fast == naive);
  CHECK_THROWS_AS(pack_first_fit_decreasing(std::vector<int64_t>{65}, 64), ValueError);
  CHECK_THROWS_AS(pack_first_fit_decreasing(std::vector<int64_t>{0}, 64), ValueError);
}

TEST_CASE("packed rows: boundaries, restarting positions, labels and loss mask", "[data]") {
  // Three sequences: prompt tokens (mask 0) then answer tokens (mask 1).
  std::vector<int64_t> tokens{10, 11, 12, 13, /**/ 20, 21, 22, /**/ 30, 31, 32, 33, 34};
  std::vector<uint8_t> answer{0, 0, 1, 1, /**/ 0, 1, 1, /**/ 0, 0, 0, 1, 1};
  std::vector<int64_t> offsets{0, 4, 7, 12};
  PackingConfig cfg;
  cfg.seq_length = 10;
  cfg.pad_id = 99;
  PackedSequenceDataset ds(tokens, answer, offsets, cfg);
  // FFD: 5 (seq 2) + 4 (seq 0) in row 0, 3 (seq 1) in row 1.
  REQUIRE(ds.size() == 2);
  CHECK(ds.row_sequences(0) == std::vector<int64_t>{2, 0});
  std::vector<int64_t> tok(10), lab(10), pos(10);
  std::vector<float> mask(10);
  std::vector<int32_t> starts;
  ds.get(0, RowView{tok.data(), lab.data(), mask.data(), pos.data(), &starts});
  CHECK(tok == std::vector<int64_t>{30, 31, 32, 33, 34, 10, 11, 12, 13, 99});
  CHECK(lab == std::vector<int64_t>{31, 32, 33, 34, 99, 11, 12, 13, 99, 99});
  CHECK(pos == std::vector<int64_t>{0, 1, 2, 3, 4, 0, 1, 2, 3, 0});
  CHECK(mask == std::vector<float>{0, 0, 1, 1, 0, 0, 1, 1, 0, 0});
  CHECK(starts == std::vector<int32_t>{0, 5, 9});
  // No label crosses a boundary: each label is the next token of the same sequence or padding.
  for (size_t s = 0; s + 1 < starts.size(); ++s) CHECK(lab[size_t(starts[s + 1] - 1)] == 99);

  cfg.pack = false;
  PackedSequenceDataset unpacked(tokens, answer, offsets, cfg);
  CHECK(unpacked.size() == 3);
  unpacked.get(1, RowView{tok.data(), lab.data(), mask.data(), pos.data(), &starts});
  CHECK(starts == std::vector<int32_t>{0, 3});
  CHECK(mask == std::vector<float>{1, 1, 0, 0, 0, 0, 0, 0, 0, 0});
}

TEST_CASE("packing truncates or rejects long sequences and rejects bad input", "[data]") {
  std::vector<int64_t> tokens(12, 5);
  std::vector<uint8_t> answer(12, 1);
  PackingConfig cfg;
  cfg.seq_length = 8;
  PackedSequenceDataset ds(tokens, answer, {0, 12}, cfg);
  CHECK(ds.num_truncated() == 1);
  CHECK(ds.fill_ratio() == Approx(1.0));
  cfg.truncate = false;
  CHECK_THROWS_AS(PackedSequenceDataset(tokens, answer, {0, 12}, cfg), ValueError);
  cfg.truncate = true;
  CHECK_THROWS_AS(PackedSequenceDataset(tokens, answer, {0, 11, 12}, cfg), ValueError);  // 1-token sequence
  CHECK_THROWS_AS(PackedSequenceDataset(tokens, std::vector<uint8_t>(3), {0, 12}, cfg), ValueError);
  CHECK_THROWS_AS(PackedSequenceDataset(tokens, answer, {0, 10}, cfg), ValueError);
}
