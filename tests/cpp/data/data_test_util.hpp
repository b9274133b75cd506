// Helpers for the data tests: scratch directories and small synthetic datasets.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "megacore/data/data.hpp"

namespace mctest {

/// A fresh directory removed at scope exit.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = std::filesystem::temp_directory_path() /
           ("megacore_data_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

/// Writes documents whose token t of document d is (d * 1000 + t) % 60000, with the given lengths.
inline void write_numbered_dataset(const std::string& prefix, const std::vector<int64_t>& lengths) {
  megacore::data::IndexedDatasetWriter w(prefix, megacore::data::TokenDType::U16);
  for (size_t d = 0; d < lengths.size(); ++d) {
    std::vector<int64_t> toks(size_t(lengths[d]));
    for (int64_t t = 0; t < lengths[d]; ++t) toks[size_t(t)] = int64_t((d * 1000 + size_t(t)) % 60000);
    w.add_document(toks);
  }
  w.finalize();
}

inline std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

inline void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}

}  // namespace mctest
