// Metrics writers: CRC-32C against its published check value, TensorBoard event files read back with an
// independent decoder written here (TFRecord framing, masked CRCs, the Event/Summary protobuf fields), JSONL.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "test_helpers.hpp"
#include "megacore/train/metrics.hpp"

using namespace megacore;
using namespace megacore::train;

namespace {

std::string read_file(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

uint32_t unmask(uint32_t m) {
  const uint32_t r = m - 0xa282ead8u;
  return (r >> 17) | (r << 15);
}

uint64_t varint(const std::string& s, size_t& i) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    const uint8_t b = uint8_t(s.at(i++));
    v |= uint64_t(b & 0x7F) << shift;
    if (!(b & 0x80)) return v;
  }
}

struct Decoded {
  double wall_time = 0;
  int64_t step = -1;
  std::string file_version;
  std::map<std::string, float> scalars;
};

// Minimal protobuf reader for Event { 1: double, 2: int64, 3: string, 5: Summary { 1: Value { 1: tag, 2: float } } }.
Decoded decode_event(const std::string& e) {
  Decoded d;
  size_t i = 0;
  while (i < e.size()) {
    const uint64_t key = varint(e, i);
    const int field = int(key >> 3), wire = int(key & 7);
    if (wire == 1) {
      REQUIRE(field == 1);
      std::memcpy(&d.wall_time, e.data() + i, 8);
      i += 8;
    } else if (wire == 0) {
      REQUIRE(field == 2);
      d.step = int64_t(varint(e, i));
    } else {
      REQUIRE(wire == 2);
      const size_t n = size_t(varint(e, i));
      const std::string sub = e.substr(i, n);
      i += n;
      if (field == 3) {
        d.file_version = sub;
      } else {
        REQUIRE(field == 5);
        size_t j = 0;
        while (j < sub.size()) {
          REQUIRE(varint(sub, j) == (1u << 3 | 2));
          const size_t vn = size_t(varint(sub, j));
          const std::string val = sub.substr(j, vn);
          j += vn;
          size_t k = 0;
          std::string tag;
          float x = 0;
          while (k < val.size()) {
            const uint64_t vk = varint(val, k);
            if (vk == (1u << 3 | 2)) {
              const size_t tn = size_t(varint(val, k));
              tag = val.substr(k, tn);
              k += tn;
            } else {
              REQUIRE(vk == (2u << 3 | 5));
              std::memcpy(&x, val.data() + k, 4);
              k += 4;
            }
          }
          d.scalars[tag] = x;
        }
      }
    }
  }
  return d;
}

}  // namespace

TEST_CASE("CRC-32C matches its check value", "[train]") {
  const char* s = "123456789";
  CHECK(crc32c(s, 9) == 0xE3069283u);
  CHECK(crc32c("", 0) == 0u);
  // Incremental: CRC of the halves chained equals the CRC of the whole.
  CHECK(crc32c(s + 4, 5, crc32c(s, 4)) == 0xE3069283u);
}

TEST_CASE("TensorBoard event files decode back to the logged scalars", "[train]") {
  const auto dir = std::filesystem::temp_directory_path() / ("mc_tb_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::string path;
  {
    TensorBoardWriter w(dir.string());
    w.add_scalars(1, {{"train/loss", 5.25}, {"train/lr", 1e-3}});
    w.add_scalars(2, {{"train/loss", 4.5}});
    path = w.path();
  }
  const std::string bytes = read_file(path);
  std::vector<Decoded> events;
  size_t i = 0;
  while (i < bytes.size()) {
    REQUIRE(i + 12 <= bytes.size());
    uint64_t len;
    uint32_t len_crc, data_crc;
    std::memcpy(&len, bytes.data() + i, 8);
    std::memcpy(&len_crc, bytes.data() + i + 8, 4);
    CHECK(unmask(len_crc) == crc32c(bytes.data() + i, 8));
    const std::string data = bytes.substr(i + 12, size_t(len));
    std::memcpy(&data_crc, bytes.data() + i + 12 + len, 4);
    CHECK(unmask(data_crc) == crc32c(data.data(), data.size()));
    events.push_back(decode_event(data));
    i += 12 + size_t(len) + 4;
  }
  REQUIRE(i == bytes.size());
  REQUIRE(events.size() == 3);
  CHECK(events[0].file_version == "brain.Event:2");
  CHECK(events[1].step == 1);
  CHECK(events[1].scalars.at("train/loss") == 5.25f);
  CHECK(events[1].scalars.at("train/lr") == 1e-3f);
  CHECK(events[2].step == 2);
  CHECK(events[2].scalars.at("train/loss") == 4.5f);
  CHECK(events[2].wall_time > 1.7e9);
  std::filesystem::remove_all(dir);
}

TEST_CASE("JSONL metrics lines parse and keep non-finite values readable", "[train]") {
  const auto p = std::filesystem::temp_directory_path() / ("mc_metrics_" + std::to_string(::getpid()) + ".jsonl");
  std::filesystem::remove(p);
  {
    JsonlWriter w(p.string());
    StepMetrics m;
    m.step = 3;
    m.loss = 2.5;
    m.grad_norm = std::nan("");
    m.skipped = true;
    w.write(to_json(m));
    m.step = 4;
    m.grad_norm = 1.0;
    w.write(to_json(m));
  }
  std::ifstream f(p);
  std::string line;
  std::vector<nlohmann::json> rows;
  while (std::getline(f, line)) rows.push_back(nlohmann::json::parse(line));
  REQUIRE(rows.size() == 2);
  CHECK(rows[0]["step"] == 3);
  CHECK(rows[0]["skipped"] == true);
  CHECK(rows[0]["grad_norm"].is_string());
  CHECK(rows[1]["grad_norm"] == 1.0);
  std::filesystem::remove(p);
  CHECK_THROWS_AS(JsonlWriter("/proc/definitely/not/writable.jsonl"), IOError);
}

TEST_CASE("known peak TFLOP/s by card name", "[train]") {
  CHECK(known_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0);
  CHECK(known_peak_tflops("NVIDIA H200") == 989.0);
  CHECK(known_peak_tflops("NVIDIA H100 PCIe") == 756.0);
  CHECK(known_peak_tflops("cpu") == 0.0);
}
