// safetensors writer and reader: round trips, files built byte by byte, every kind of corruption, and
// the writer's crash-safety promise (no temporary file left behind).
#include "megacore/checkpoint/safetensors.hpp"
#include "megacore/checkpoint/sharded_tensor.hpp"

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "test_helpers.hpp"

namespace fs = std::filesystem;
using namespace megacore;
using namespace megacore::checkpoint;

namespace {

/// A fresh directory per test case, removed afterwards.
struct TmpDir {
  fs::path path;
  TmpDir() {
    static std::atomic<int> n{0};
    path = fs::temp_directory_path() /
           ("mc_safetensors_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TmpDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path)) out.push_back(e.path().filename().string());
    return out;
  }
};

Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937& rng) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  for (int64_t i = 0; i < t.nbytes(); ++i) p[i] = uint8_t(rng());
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  Tensor ca = a.contiguous(), cb = b.contiguous();
  return a.nbytes() == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), size_t(a.nbytes())) == 0;
}

/// Writes raw bytes, header length first; `n_override` lets a test lie about the header length.
void write_raw(const std::string& path, const std::string& header, const std::string& data,
               int64_t n_override = -1) {
  uint64_t n = n_override >= 0 ? uint64_t(n_override) : header.size();
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = char(uint8_t(n >> (8 * i)));
  bytes += header + data;
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
}

/// Expects opening `path` to throw IOError whose message names the file and contains `problem`.
void expect_bad(const std::string& path, const std::string& problem) {
  try {
    SafetensorsFile f(path);
    FAIL("expected IOError containing '" << problem << "'");
  } catch (const IOError& e) {
    std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find(path) != std::string::npos);
    CHECK(msg.find(problem) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("safetensors round trip of every dtype with metadata", "[checkpoint]") {
  TmpDir dir;
  std::mt19937 rng(1234);
  std::vector<std::pair<std::string, Tensor>> tensors;
  const DType dtypes[] = {DType::F32, DType::F16, DType::BF16, DType::I64, DType::I32, DType::U8};
  for (DType d : dtypes) {
    std::string n(safetensors_dtype_name(d));
    tensors.emplace_back("w." + n, random_tensor({3, 5, 2}, d, rng));
    tensors.emplace_back("odd." + n, random_tensor({7}, d, rng));  // odd sizes shift later offsets
  }
  tensors.emplace_back("scalar", random_tensor({}, DType::F32, rng));
  tensors.emplace_back("empty", random_tensor({0, 4}, DType::BF16, rng));
  // A non-contiguous view must be written in row-major order of its logical shape.
  Tensor base = random_tensor({4, 6}, DType::F32, rng);
  tensors.emplace_back("transposed", base.transpose(0, 1));
  SafetensorsMetadata meta{{"format", "pt"}, {"step", "42"}, {"note", "unicode \xc3\xa9 ok"}};

  const std::string path = dir.file("model.safetensors");
  save_safetensors(path, tensors, meta);

  std::vector<Tensor> views;
  {
    SafetensorsFile f(path);
    CHECK(f.metadata() == meta);
    REQUIRE(f.names().size() == tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) CHECK(f.names()[i] == tensors[i].first);  // data order
    for (const auto& [name, t] : tensors) {
      INFO(name);
      const SafetensorsInfo& info = f.info(name);
      CHECK(info.dtype == t.dtype());
      CHECK(info.shape == t.shape());
      CHECK(info.nbytes == t.nbytes());
      Tensor v = f.tensor(name);
      CHECK(same_bytes(v, t));
      CHECK(v.is_contiguous());
      CHECK(same_bytes(f.load(name), t));
      views.push_back(v);
    }
    // The views point into the mapping rather than holding a copy.
    CHECK(f.tensor("w.F32").data_ptr() == f.tensor("w.F32").data_ptr());
    // Partial reads return exactly the requested bytes.
    const Tensor& w = tensors[0].second;
    std::vector<uint8_t> part(8);
    f.read_bytes("w.F32", 12, 8, part.data());
    CHECK(std::memcmp(part.data(), static_cast<uint8_t*>(w.data_ptr()) + 12, 8) == 0);
    CHECK_THROWS_AS(f.read_bytes("w.F32", 100, 30, part.data()), ValueError);
  }
  // The mapping outlives the SafetensorsFile through the views' release callbacks.
  for (size_t i = 0; i < tensors.size(); ++i) CHECK(same_bytes(views[i], tensors[i].second));

  // Writes to a view are private: the file does not change.
  {
    SafetensorsFile f(path);
    Tensor v = f.tensor("w.F32");
    v.fill_(7.0);
    SafetensorsFile g(path);
    CHECK(same_bytes(g.tensor("w.F32"), tensors[0].second));
  }

  // Overwriting an existing file works, and data order follows the argument order.
  std::map<std::string, Tensor> by_name{{"b", tensors[0].second}, {"a", tensors[1].second}};
  save_safetensors(path, {by_name.begin(), by_name.end()});
  SafetensorsFile f(path);
  CHECK(f.names() == std::vector<std::string>{"a", "b"});
  CHECK(f.metadata().empty());
  CHECK(same_bytes(f.tensor("b"), tensors[0].second));
}

TEST_CASE("safetensors reads a file built byte by byte", "[checkpoint]") {
  TmpDir dir;
  const std::string path = dir.file("hand.safetensors");
  // Written independently of the writer: tensors listed out of data order, metadata last, header
  // padded with spaces to a multiple of 8 as the format asks.
  std::string header =
      R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[8,24]},)"
      R"("w":{"dtype":"F32","shape":[2,1],"data_offsets":[0,8]},)"
      R"("h":{"dtype":"F16","shape":[1],"data_offsets":[24,26]},)"
      R"("b":{"dtype":"BF16","shape":[1],"data_offsets":[26,28]},)"
      R"("u":{"dtype":"U8","shape":[4],"data_offsets":[28,32]},)"
      R"("i":{"dtype":"I32","shape":[1],"data_offsets":[32,36]},)"
      R"("__metadata__":{"format":"pt"}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string data;
  auto put = [&](uint64_t v, int n) {
    for (int i = 0; i < n; ++i) data.push_back(char(uint8_t(v >> (8 * i))));
  };
  put(0x3fc00000u, 4);  // 1.5f
  put(0xc0000000u, 4);  // -2.0f
  put(42, 8);
  put(uint64_t(-7), 8);
  put(0x3c00, 2);       // 1.0 in f16
  put(0xc040, 2);       // -3.0 in bf16
  put(0x04030201u, 4);  // u8 1, 2, 3, 4
  put(uint32_t(-5), 4);
  write_raw(path, header, data);

  SafetensorsFile f(path);
  CHECK(f.names() == std::vector<std::string>{"w", "ids", "h", "b", "u", "i"});
  CHECK(f.metadata() == SafetensorsMetadata{{"format", "pt"}});
  CHECK(f.tensor("w").shape() == Shape{2, 1});
  CHECK(f.tensor("w").to_double_vector() == std::vector<double>{1.5, -2.0});
  CHECK(f.tensor("ids").to_double_vector() == std::vector<double>{42, -7});
  CHECK(f.tensor("h").item() == 1.0);
  CHECK(f.tensor("b").item() == -3.0);
  CHECK(f.tensor("u").to_double_vector() == std::vector<double>{1, 2, 3, 4});
  CHECK(f.tensor("i").item() == -5);

  // An unpadded header from another tool puts the I64 data off 8-byte alignment; reading still works
  // (it falls back to a copy).
  std::string unpadded = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                         R"("z":{"dtype":"I64","shape":[1],"data_offsets":[1,9]}})";
  std::string d2(1, '\x09');
  d2 += std::string("\x05\0\0\0\0\0\0\0", 8);
  write_raw(path, unpadded, d2);
  SafetensorsFile g(path);
  CHECK(g.tensor("a").item() == 9);
  CHECK(g.tensor("z").item() == 5);
}

TEST_CASE("safetensors writer produces the documented layout", "[checkpoint]") {
  TmpDir dir;
  const std::string path = dir.file("w.safetensors");
  save_safetensors(path, {{"x", Tensor::from_vector<float>({1.0f, 2.0f, 3.0f}, {3})}}, {{"k", "v"}});
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE(bytes.size() >= 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  CHECK(n % 8 == 0);
  REQUIRE(bytes.size() == 8 + n + 12);
  std::string header = bytes.substr(8, n);
  CHECK(header.find(R"("x":{"data_offsets":[0,12],"dtype":"F32","shape":[3]})") != std::string::npos);
  CHECK(header.find(R"("__metadata__":{"k":"v"})") != std::string::npos);
  CHECK(header.find_last_not_of(' ') == header.find_last_of('}'));  // only spaces pad
  float v[3];
  std::memcpy(v, bytes.data() + 8 + n, 12);
  CHECK((v[0] == 1.0f && v[1] == 2.0f && v[2] == 3.0f));
}

TEST_CASE("safetensors rejects bad files with a clear IOError", "[checkpoint]") {
  TmpDir dir;
  const std::string p = dir.file("bad.safetensors");
  auto entry = [](const std::string& name, const std::string& dtype, const std::string& shape, int b, int e) {
    return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
           std::to_string(b) + "," + std::to_string(e) + "]}";
  };

  SECTION("missing file") { expect_bad(p, "cannot open"); }
  SECTION("too short") {
    std::ofstream(p, std::ios::binary) << "abc";
    expect_bad(p, "too short");
  }
  SECTION("header length beyond the file") {
    write_raw(p, "{}", "", 1000);
    expect_bad(p, "runs past the end of the file");
  }
  SECTION("bad JSON") {
    write_raw(p, "{\"a\": [1, 2", "");
    expect_bad(p, "not valid JSON");
  }
  SECTION("header not an object") {
    write_raw(p, "[1, 2]  ", "");
    expect_bad(p, "not an object");
  }
  SECTION("unknown dtype") {
    write_raw(p, "{" + entry("a", "Q7", "[1]", 0, 1) + "}", "x");
    expect_bad(p, "unknown or unsupported dtype 'Q7'");
  }
  SECTION("missing field") {
    write_raw(p, R"({"a":{"dtype":"U8","shape":[1]}})", "x");
    expect_bad(p, "no 'data_offsets'");
  }
  SECTION("negative shape") {
    write_raw(p, "{" + entry("a", "U8", "[-1]", 0, 1) + "}", "x");
    expect_bad(p, "non-negative integer");
  }
  SECTION("offsets out of range") {
    write_raw(p, "{" + entry("a", "U8", "[8]", 0, 8) + "}", "1234");
    expect_bad(p, "outside the 4-byte data section");
  }
  SECTION("offsets reversed") {
    write_raw(p, "{" + entry("a", "U8", "[0]", 4, 2) + "}", "1234");
    expect_bad(p, "end before they begin");
  }
  SECTION("overlapping tensors") {
    write_raw(p, "{" + entry("a", "U8", "[4]", 0, 4) + "," + entry("b", "U8", "[4]", 2, 6) + "}", "123456");
    expect_bad(p, "overlaps");
  }
  SECTION("hole between tensors") {
    write_raw(p, "{" + entry("a", "U8", "[2]", 0, 2) + "," + entry("b", "U8", "[2]", 4, 6) + "}", "123456");
    expect_bad(p, "belong to no tensor");
  }
  SECTION("hole at the start") {
    write_raw(p, "{" + entry("a", "U8", "[2]", 2, 4) + "}", "1234");
    expect_bad(p, "bytes [0, 2)");
  }
  SECTION("trailing bytes") {
    write_raw(p, "{" + entry("a", "U8", "[2]", 0, 2) + "}", "1234");
    expect_bad(p, "at the end of the data section");
  }
  SECTION("shape times dtype size mismatch") {
    write_raw(p, "{" + entry("a", "F32", "[3]", 0, 8) + "}", "12345678");
    expect_bad(p, "needs 12 bytes");
  }
  SECTION("duplicate names") {
    write_raw(p, "{" + entry("a", "U8", "[2]", 0, 2) + "," + entry("a", "U8", "[2]", 2, 4) + "}", "1234");
    expect_bad(p, "'a' appears more than once");
  }
  SECTION("metadata values must be strings") {
    write_raw(p, R"({"__metadata__":{"step":3}})", "");
    expect_bad(p, "is not a string");
  }
  SECTION("asking for a tensor the file lacks") {
    save_safetensors(p, {{"present", Tensor::zeros({2})}});
    SafetensorsFile f(p);
    try {
      f.tensor("absent");
      FAIL("expected IOError");
    } catch (const IOError& e) {
      std::string msg = e.what();
      CHECK(msg.find("no tensor 'absent'") != std::string::npos);
      CHECK(msg.find("'present'") != std::string::npos);
    }
  }
}

TEST_CASE("safetensors writer leaves no temporary file behind", "[checkpoint]") {
  TmpDir dir;
  Tensor t = Tensor::full({3}, 1.0);

  save_safetensors(dir.file("ok.safetensors"), {{"t", t}});
  CHECK(dir.entries() == std::vector<std::string>{"ok.safetensors"});

  // Argument errors are caught before anything is created.
  CHECK_THROWS_AS(save_safetensors(dir.file("dup.safetensors"), {{"t", t}, {"t", t}}), ValueError);
  CHECK_THROWS_AS(save_safetensors(dir.file("meta.safetensors"), {{"__metadata__", t}}), ValueError);
  CHECK_THROWS_AS(save_safetensors(dir.file("empty.safetensors"), {{"", t}}), ValueError);

  // A failure after the temporary file exists: the target is a directory, so the rename fails.
  fs::create_directories(dir.path / "taken");
  try {
    save_safetensors(dir.file("taken"), {{"t", t}});
    FAIL("expected IOError");
  } catch (const IOError& e) {
    CHECK(std::string(e.what()).find("cannot rename") != std::string::npos);
  }
  // A directory that does not exist.
  CHECK_THROWS_AS(save_safetensors(dir.file("no/such/dir.safetensors"), {{"t", t}}), IOError);

  auto entries = dir.entries();
  std::sort(entries.begin(), entries.end());
  CHECK(entries == std::vector<std::string>{"ok.safetensors", "taken"});
  CHECK(fs::is_empty(dir.path / "taken"));
  // The good file is still intact.
  CHECK(SafetensorsFile(dir.file("ok.safetensors")).tensor("t").to_double_vector() == std::vector<double>{1, 1, 1});
}

TEST_CASE("the parallel writer's CRC-32C of each tensor is that of its bytes, across chunk boundaries; read_into "
          "reads them back", "[checkpoint]") {
  TmpDir dir;
  // 40 MiB spans two 32 MiB write chunks (joined with crc32c_combine); odd sizes shift every later offset.
  std::vector<uint32_t> big_raw(10 << 20);
  std::mt19937 rng(99);
  for (auto& v : big_raw) v = rng();
  Tensor big = Tensor::from_vector<int32_t>(std::vector<int32_t>(big_raw.begin(), big_raw.end()),
                                            {int64_t(big_raw.size())});
  Tensor odd = Tensor::from_vector<uint8_t>({1, 2, 3, 4, 5}, {5});
  Tensor empty = Tensor::empty({0, 3});
  Tensor strided = Tensor::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3}).narrow(1, 1, 2);  // not contiguous
  const std::string path = dir.file("x.safetensors");
  const std::vector<uint32_t> crcs =
      save_safetensors_crc32c(path, {{"odd", odd}, {"big", big}, {"empty", empty}, {"strided", strided}}, {}, 3);
  REQUIRE(crcs.size() == 4);
  CHECK(crcs[0] == crc32c(odd.data_ptr(), 5));
  CHECK(crcs[1] == crc32c(big.data_ptr(), size_t(big.nbytes())));
  CHECK(crcs[2] == crc32c(nullptr, 0));
  const Tensor sc = strided.contiguous();
  CHECK(crcs[3] == crc32c(sc.data_ptr(), size_t(sc.nbytes())));

  SafetensorsFile f(path);
  std::vector<int32_t> back(big_raw.size());
  uint32_t crc = 0;
  size_t blocks = 0;
  f.read_into("big", 0, big.nbytes(), back.data(), [&](const uint8_t* p, size_t n) {
    crc = crc32c(p, n, crc);
    ++blocks;
  });
  CHECK(blocks > 1);
  CHECK(crc == crcs[1]);
  CHECK(std::memcmp(back.data(), big.data_ptr(), size_t(big.nbytes())) == 0);
  float two[2];
  f.read_into("strided", 4, 8, two);
  CHECK(two[0] == 3.f);
  CHECK(two[1] == 5.f);
  CHECK_THROWS_AS(f.read_into("strided", 4, 16, two), ValueError);
}
