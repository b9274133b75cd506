#include <cstring>

#include "data/data_test_util.hpp"
#include "test_helpers.hpp"

using namespace megacore;
using namespace megacore::data;
using mctest::TempDir;

namespace {
// Little-endian serialisation written independently of the library's writer.
template <class T>
void put(std::vector<uint8_t>& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(uint8_t((uint64_t(v) >> (8 * i)) & 0xff));
}

bool throws_containing(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
  } catch (const IOError& e) {
    if (std::string(e.what()).find(needle) != std::string::npos) return true;
    FAIL("message lacks '" << needle << "': " << e.what());
  }
  return false;
}
}  // namespace

TEST_CASE("indexed dataset bytes match the Megatron layout", "[data]") {
  TempDir dir;
  std::string prefix = dir / "ds";
  {
    IndexedDatasetWriter w(prefix, TokenDType::U16);
    std::vector<int64_t> a{1, 2, 3}, b{65535}, c{7, 8};
    w.add_sequence(a);
    w.add_sequence(b);  // document 0 = two sequences
    w.end_document();
    w.add_document(c);
    w.finalize();
  }
  std::vector<uint8_t> idx;
  for (char ch : std::string("MMIDIDX")) idx.push_back(uint8_t(ch));
  idx.push_back(0);
  idx.push_back(0);
  put<uint64_t>(idx, 1);   // version
  put<uint8_t>(idx, 8);    // u16
  put<uint64_t>(idx, 3);   // sequences
  put<uint64_t>(idx, 3);   // document indices (2 documents + 1)
  for (int32_t len : {3, 1, 2}) put<int32_t>(idx, len);
  for (int64_t ptr : {0, 6, 8}) put<int64_t>(idx, ptr);
  for (int64_t d : {0, 2, 3}) put<int64_t>(idx, d);
  CHECK(mctest::read_file(prefix + ".idx") == idx);

  std::vector<uint8_t> bin;
  for (uint16_t t : {1, 2, 3, 65535, 7, 8}) put<uint16_t>(bin, t);
  CHECK(mctest::read_file(prefix + ".bin") == bin);

  // ...and a hand-written file reads back.
  IndexedDataset ds(prefix);
  CHECK(ds.dtype() == TokenDType::U16);
  CHECK(ds.num_sequences() == 3);
  CHECK(ds.num_documents() == 2);
  CHECK(ds.num_tokens() == 6);
  CHECK(ds.sequence(1) == std::vector<int64_t>{65535});
  CHECK(ds.document_length(0) == 4);
  CHECK(ds.document_token_offset(1) == 4);
  std::vector<int64_t> out(4);
  ds.read_tokens(2, 4, out.data());
  CHECK(out == std::vector<int64_t>{3, 65535, 7, 8});
}

TEST_CASE("indexed dataset round trip in every dtype", "[data]") {
  TempDir dir;
  for (TokenDType t : {TokenDType::U8, TokenDType::I8, TokenDType::I16, TokenDType::I32, TokenDType::I64,
                       TokenDType::F64, TokenDType::F32, TokenDType::U16}) {
    std::string prefix = dir / std::string(token_dtype_name(t));
    std::vector<std::vector<int64_t>> docs{{0, 1, 2, 100}, {}, {5}, {127, 3}};
    {
      IndexedDatasetWriter w(prefix, t);
      for (auto& d : docs) {
        w.add_sequence(d);
        w.end_document();
      }
      w.finalize();
    }
    IndexedDataset ds(prefix);
    REQUIRE(ds.num_documents() == 4);
    for (size_t i = 0; i < docs.size(); ++i) CHECK(ds.sequence(int64_t(i)) == docs[i]);
    CHECK(std::filesystem::file_size(prefix + ".bin") == size_t(7 * token_dtype_size(t)));
  }
}

TEST_CASE("writer rejects ids the dtype cannot hold and leaves nothing behind", "[data]") {
  TempDir dir;
  std::string prefix = dir / "bad";
  {
    IndexedDatasetWriter w(prefix, TokenDType::U8);
    std::vector<int64_t> ok{1, 2}, bad{300};
    w.add_document(ok);
    CHECK_THROWS_AS(w.add_document(bad), ValueError);
  }  // not finalized: temporaries are removed
  CHECK(std::filesystem::is_empty(dir.path));
}

TEST_CASE("writer merges datasets", "[data]") {
  TempDir dir;
  mctest::write_numbered_dataset(dir / "a", {3, 4});
  mctest::write_numbered_dataset(dir / "b", {2});
  {
    IndexedDatasetWriter w(dir / "m", TokenDType::U16);
    w.add_dataset(IndexedDataset(dir / "a"));
    w.add_dataset(IndexedDataset(dir / "b"));
    w.finalize();
  }
  IndexedDataset m(dir / "m");
  CHECK(m.num_documents() == 3);
  CHECK(m.sequence(2) == IndexedDataset(dir / "b").sequence(0));
}

TEST_CASE("bad indexed datasets are clear IOErrors", "[data]") {
  TempDir dir;
  std::string p = dir / "ds";
  mctest::write_numbered_dataset(p, {5, 6, 7});
  auto idx = mctest::read_file(p + ".idx"), bin = mctest::read_file(p + ".bin");
  auto restore = [&] {
    mctest::write_file(p + ".idx", idx);
    mctest::write_file(p + ".bin", bin);
  };
  auto open = [&] { IndexedDataset ds(p); };

  SECTION("missing files") { CHECK(throws_containing([&] { IndexedDataset ds(dir / "nope"); }, "nope.idx")); }
  SECTION("bad magic") {
    auto b = idx;
    b[0] = 'X';
    mctest::write_file(p + ".idx", b);
    CHECK(throws_containing(open, "magic"));
  }
  SECTION("unknown dtype code") {
    auto b = idx;
    b[17] = 42;
    mctest::write_file(p + ".idx", b);
    CHECK(throws_containing(open, "unknown token dtype code 42"));
  }
  SECTION("truncated idx") {
    auto b = idx;
    b.resize(b.size() - 3);
    mctest::write_file(p + ".idx", b);
    CHECK(throws_containing(open, "truncated"));
  }
  SECTION("truncated bin") {
    auto b = bin;
    b.resize(b.size() - 4);
    mctest::write_file(p + ".bin", b);
    CHECK(throws_containing(open, "the .bin file is truncated"));
  }
  SECTION("index/data mismatch: bin from another run") {
    auto b = bin;
    b.resize(b.size() + 10);
    mctest::write_file(p + ".bin", b);
    CHECK(throws_containing(open, "do not mix .bin and .idx"));
  }
  SECTION("index/data mismatch: pointers") {
    auto b = idx;
    b[34 + 3 * 4 + 8] ^= 2;  // second pointer
    mctest::write_file(p + ".idx", b);
    CHECK(throws_containing(open, "sequence 1 starts at byte"));
  }
  restore();
  CHECK_NOTHROW(open());
}
