#include "megacore/train/metrics.hpp"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "megacore/core/error.hpp"

namespace megacore::train {

namespace {

std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

uint32_t masked_crc(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(uint8_t(v) | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}

void put_tag(std::string& out, int field, int wire) { put_varint(out, uint64_t(field) << 3 | uint64_t(wire)); }

template <class T>
void put_fixed(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // protobuf fixed types are little-endian, as is every platform we build on
  out.append(b, sizeof(T));
}

void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

std::string event(double wall_time, int64_t step, const std::string& file_version, const std::string& summary) {
  std::string e;
  put_tag(e, 1, 1);
  put_fixed<double>(e, wall_time);
  put_tag(e, 2, 0);
  put_varint(e, uint64_t(step));
  if (!file_version.empty()) put_bytes(e, 3, file_version);
  if (!summary.empty()) put_bytes(e, 5, summary);
  return e;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::FILE* open_or_throw(const std::string& path, const char* mode) {
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  std::FILE* f = std::fopen(path.c_str(), mode);
  MC_CHECK_AS(IOError, f != nullptr, "cannot open '{}' for writing: {}; check the log directory (logging.log_dir)",
             path, std::strerror(errno));
  return f;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_crc32c_table();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

double known_peak_tflops(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("H200")) return 989.0;
  if (has("H100")) return has("PCIe") ? 756.0 : 989.0;
  if (has("A100")) return 312.0;
  return 0.0;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  path_ = (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(int64_t(now_seconds())) + "." + host +
                                         "." + std::to_string(::getpid()))).string();
  f_ = open_or_throw(path_, "wb");
  write_record(event(now_seconds(), 0, "brain.Event:2", ""));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (f_) std::fclose(f_);
}

void TensorBoardWriter::add_scalars(int64_t step, const std::map<std::string, double>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    put_bytes(value, 1, tag);
    put_tag(value, 2, 5);
    put_fixed<float>(value, float(v));
    put_bytes(summary, 1, value);
  }
  write_record(event(now_seconds(), step, "", summary));
}

void TensorBoardWriter::write_record(const std::string& bytes) {
  std::string rec;
  const uint64_t len = bytes.size();
  put_fixed<uint64_t>(rec, len);
  put_fixed<uint32_t>(rec, masked_crc(&len, sizeof(len)));
  rec += bytes;
  put_fixed<uint32_t>(rec, masked_crc(bytes.data(), bytes.size()));
  MC_CHECK_AS(IOError, std::fwrite(rec.data(), 1, rec.size(), f_) == rec.size() && std::fflush(f_) == 0,
             "writing '{}' failed: {}; check free disk space", path_, std::strerror(errno));
}

JsonlWriter::JsonlWriter(const std::string& path) : path_(path) { f_ = open_or_throw(path, "a"); }

JsonlWriter::~JsonlWriter() {
  if (f_) std::fclose(f_);
}

void JsonlWriter::write(const std::string& json_object) {
  const std::string line = json_object + "\n";
  MC_CHECK_AS(IOError, std::fwrite(line.data(), 1, line.size(), f_) == line.size() && std::fflush(f_) == 0,
             "writing '{}' failed: {}; check free disk space", path_, std::strerror(errno));
}

std::string to_json(const StepMetrics& m) {
  nlohmann::json j = {{"step", m.step},
                      {"loss", m.loss},
                      {"grad_norm", m.grad_norm},
                      {"lr", m.lr},
                      {"loss_scale", m.loss_scale},
                      {"skipped", m.skipped},
                      {"nonfinite", m.nonfinite},
                      {"loss_spike", m.loss_spike},
                      {"step_seconds", m.step_seconds},
                      {"tokens_per_s", m.tokens_per_s},
                      {"tflops_per_gpu", m.tflops_per_gpu},
                      {"mfu", m.mfu},
                      {"mem_allocated_gib", m.mem_allocated_gib},
                      {"mem_peak_gib", m.mem_peak_gib},
                      {"consumed_samples", m.consumed_samples}};
  if (m.moe_load_imbalance > 0) {
    j["moe_aux_loss"] = m.moe_aux_loss;
    j["moe_load_imbalance"] = m.moe_load_imbalance;
  }
  if (!m.fp8_counts.empty()) {
    nlohmann::json sat = nlohmann::json::object(), flu = nlohmann::json::object();
    for (const auto& c : m.fp8_counts) sat[c.name] = c.saturated, flu[c.name] = c.flushed;
    j["fp8_saturated"] = sat;
    j["fp8_flushed"] = flu;
  }
  if (!m.rank_compute_seconds.empty()) {
    j["compute_seconds"] = m.compute_seconds;
    j["stragglers"] = m.stragglers;
  }
  // NaN is not JSON: a non-finite loss or norm is written as a string so the line stays parseable.
  for (const char* k : {"loss", "grad_norm"})
    if (!std::isfinite(j[k].get<double>())) j[k] = std::to_string(j[k].get<double>());
  return j.dump();
}

}  // namespace megacore::train
