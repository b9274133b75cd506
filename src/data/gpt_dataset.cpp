#include "megacore/data/gpt_dataset.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>

#include "megacore/core/error.hpp"
#include "megacore/core/random.hpp"

namespace megacore::data {

namespace {

constexpr char kCacheMagic[8] = {'M', 'C', 'G', 'P', 'T', 'I', 'D', 'X'};
constexpr uint64_t kCacheVersion = 1;
// Bumped whenever the index-building algorithm changes, so stale caches are never reused.
constexpr const char* kAlgorithm = "megacore-gpt-index-v1";
constexpr uint64_t kShuffleStream = uint64_t(1) << 40;

uint64_t fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

// Uniform integer in [0, bound) from 64 random bits (multiply-shift; bias < bound / 2^64).
uint64_t bounded(uint64_t r, uint64_t bound) { return uint64_t((unsigned __int128)r * bound >> 64); }

}  // namespace

std::vector<int64_t> seeded_permutation(int64_t n, uint64_t seed, uint64_t stream) {
  MC_CHECK(n >= 0, "permutation size must be >= 0, got {}", n);
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[size_t(i)] = i;
  for (int64_t i = n - 1; i > 0; --i) {
    Philox4 w = philox_words(seed, stream, uint64_t(i));
    uint64_t r = uint64_t(w.v[0]) | (uint64_t(w.v[1]) << 32);
    std::swap(p[size_t(i)], p[size_t(bounded(r, uint64_t(i) + 1))]);
  }
  return p;
}

GPTDataset::GPTDataset(std::shared_ptr<const IndexedDataset> data, GPTDatasetConfig cfg)
    : data_(std::move(data)), cfg_(std::move(cfg)) {
  MC_CHECK(data_ != nullptr, "GPTDataset needs an IndexedDataset");
  const int64_t ndocs_all = data_->num_documents();
  if (cfg_.doc_end < 0) cfg_.doc_end = ndocs_all;
  MC_CHECK(cfg_.seq_length >= 1, "seq_length must be >= 1, got {}", cfg_.seq_length);
  MC_CHECK(cfg_.num_samples >= 0, "num_samples must be >= 0, got {}", cfg_.num_samples);
  MC_CHECK(0 <= cfg_.doc_begin && cfg_.doc_begin <= cfg_.doc_end && cfg_.doc_end <= ndocs_all,
           "document range [{}, {}) is outside the {} documents of '{}'", cfg_.doc_begin, cfg_.doc_end, ndocs_all,
           data_->prefix());
  const int64_t ndocs = cfg_.doc_end - cfg_.doc_begin;
  doc_len_.resize(size_t(ndocs));
  doc_start_.resize(size_t(ndocs));
  int64_t tokens_per_epoch = 0;
  uint64_t h = fnv1a(kAlgorithm, std::strlen(kAlgorithm));
  for (int64_t d = 0; d < ndocs; ++d) {
    doc_len_[size_t(d)] = data_->document_length(cfg_.doc_begin + d);
    doc_start_[size_t(d)] = data_->document_token_offset(cfg_.doc_begin + d);
    tokens_per_epoch += doc_len_[size_t(d)];
    h = fnv1a(&doc_len_[size_t(d)], 8, h);
  }
  MC_CHECK(tokens_per_epoch >= cfg_.seq_length + 1,
           "documents [{}, {}) of '{}' hold {} tokens, fewer than one sample of seq_length + 1 = {}; use a shorter "
           "seq_length, a larger split, or more data",
           cfg_.doc_begin, cfg_.doc_end, data_->prefix(), tokens_per_epoch, cfg_.seq_length + 1);
  if (cfg_.num_samples == 0) {
    num_samples_ = (tokens_per_epoch - 1) / cfg_.seq_length;
    num_epochs_ = 1;
  } else {
    num_samples_ = cfg_.num_samples;
    // Samples share one token with their neighbour, so n samples need n * seq_length + 1 tokens.
    int64_t needed = num_samples_ * cfg_.seq_length + 1;
    num_epochs_ = (needed + tokens_per_epoch - 1) / tokens_per_epoch;
  }
  int64_t params[] = {ndocs_all, data_->num_tokens(), cfg_.doc_begin, cfg_.doc_end, cfg_.seq_length,
                      num_samples_, int64_t(cfg_.seed)};
  h = fnv1a(params, sizeof(params), h);
  hash_ = fmt::format("{:016x}", h);

  if (cfg_.use_cache) {
    std::filesystem::path p(data_->prefix());
    std::filesystem::path dir = cfg_.cache_dir.empty() ? p.parent_path() : std::filesystem::path(cfg_.cache_dir);
    cache_path_ = (dir / (p.filename().string() + ".gpt-" + hash_ + ".idxcache")).string();
    from_cache_ = load_cache();
  }
  if (!from_cache_) {
    build_indices();
    if (cfg_.use_cache) save_cache();
  }
}

void GPTDataset::build_indices() {
  const int64_t ndocs = int64_t(doc_len_.size());
  MC_CHECK(ndocs <= INT32_MAX, "{} documents exceed the i32 document index; split the dataset", ndocs);
  doc_idx_.clear();
  doc_idx_.reserve(size_t(ndocs * num_epochs_));
  for (int64_t e = 0; e < num_epochs_; ++e)
    for (int64_t d : seeded_permutation(ndocs, cfg_.seed, uint64_t(e))) doc_idx_.push_back(int32_t(d));

  sample_idx_.assign(size_t(2 * (num_samples_ + 1)), 0);
  int64_t entry = 0, off = 0;
  for (int64_t s = 0; s < num_samples_; ++s) {
    int64_t need = cfg_.seq_length;
    while (need > 0) {
      int64_t avail = doc_len_[size_t(doc_idx_[size_t(entry)])] - off;
      if (avail > need) {
        off += need;
        need = 0;
      } else {
        need -= avail;
        ++entry;
        off = 0;
      }
    }
    sample_idx_[size_t(2 * (s + 1))] = entry;
    sample_idx_[size_t(2 * (s + 1) + 1)] = off;
  }
  shuffle_idx_ = seeded_permutation(num_samples_, cfg_.seed, kShuffleStream);
}

bool GPTDataset::load_cache() {
  std::FILE* f = std::fopen(cache_path_.c_str(), "rb");
  if (!f) return false;
  auto read = [&](void* p, size_t n) { return std::fread(p, 1, n, f) == n; };
  char magic[8];
  uint64_t version = 0, sizes[3] = {};
  bool ok = read(magic, 8) && std::memcmp(magic, kCacheMagic, 8) == 0 && read(&version, 8) &&
            version == kCacheVersion && read(sizes, sizeof(sizes)) &&
            sizes[1] == uint64_t(2 * (num_samples_ + 1)) && sizes[2] == uint64_t(num_samples_) &&
            sizes[0] == uint64_t(doc_len_.size()) * uint64_t(num_epochs_);
  if (ok) {
    doc_idx_.resize(sizes[0]);
    sample_idx_.resize(sizes[1]);
    shuffle_idx_.resize(sizes[2]);
    ok = read(doc_idx_.data(), sizes[0] * 4) && read(sample_idx_.data(), sizes[1] * 8) &&
         read(shuffle_idx_.data(), sizes[2] * 8);
    char extra;
    ok = ok && std::fread(&extra, 1, 1, f) == 0;
  }
  std::fclose(f);
  if (!ok) {
    // The name carries the parameter hash, so a bad file here is damage, not a different configuration.
    fmt::print(stderr, "megacore: index cache '{}' is unreadable or truncated; rebuilding it\n", cache_path_);
    doc_idx_.clear();
    sample_idx_.clear();
    shuffle_idx_.clear();
  }
  return ok;
}

void GPTDataset::save_cache() const {
  std::string tmp = cache_path_ + ".tmp-" + std::to_string(::getpid());
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(cache_path_).parent_path(), ec);
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) {
    // A read-only data directory must not stop training: the indices are already in memory.
    fmt::print(stderr, "megacore: cannot write index cache '{}' ({}); continuing without it (set cache_dir to a "
               "writable directory to keep it)\n", tmp, std::strerror(errno));
    return;
  }
  uint64_t sizes[3] = {doc_idx_.size(), sample_idx_.size(), shuffle_idx_.size()};
  bool ok = std::fwrite(kCacheMagic, 1, 8, f) == 8 && std::fwrite(&kCacheVersion, 8, 1, f) == 1 &&
            std::fwrite(sizes, sizeof(sizes), 1, f) == 1 &&
            std::fwrite(doc_idx_.data(), 4, doc_idx_.size(), f) == doc_idx_.size() &&
            std::fwrite(sample_idx_.data(), 8, sample_idx_.size(), f) == sample_idx_.size() &&
            std::fwrite(shuffle_idx_.data(), 8, shuffle_idx_.size(), f) == shuffle_idx_.size();
  ok = (std::fclose(f) == 0) && ok;
  if (ok) std::filesystem::rename(tmp, cache_path_, ec);
  if (!ok || ec) {
    std::remove(tmp.c_str());
    fmt::print(stderr, "megacore: writing index cache '{}' failed; continuing without it\n", cache_path_);
  }
}

void GPTDataset::sample_tokens(int64_t i, int64_t* out) const {
  MC_CHECK(i >= 0 && i < num_samples_, "sample {} out of range [0, {}) of GPT dataset over '{}'", i, num_samples_,
           data_->prefix());
  int64_t s = shuffle_idx_[size_t(i)];
  int64_t entry = sample_idx_[size_t(2 * s)], off = sample_idx_[size_t(2 * s + 1)];
  int64_t need = cfg_.seq_length + 1, written = 0;
  while (need > 0) {
    MC_CHECK(entry < int64_t(doc_idx_.size()), "GPT sample index of '{}' runs past its document index; delete the "
             "cache file '{}' and retry", data_->prefix(), cache_path_);
    size_t d = size_t(doc_idx_[size_t(entry)]);
    int64_t take = std::min(need, doc_len_[d] - off);
    data_->read_tokens(doc_start_[d] + off, take, out + written);
    written += take;
    need -= take;
    ++entry;
    off = 0;
  }
}

std::vector<int64_t> GPTDataset::sample_tokens(int64_t i) const {
  std::vector<int64_t> v(size_t(cfg_.seq_length + 1));
  sample_tokens(i, v.data());
  return v;
}

void GPTDataset::get(int64_t i, const RowView& out) const {
  const int64_t n = cfg_.seq_length;
  // One read of seq_length + 1 tokens gives both the inputs and the labels (the same tokens shifted by one).
  std::vector<int64_t> buf(size_t(n + 1));
  sample_tokens(i, buf.data());
  std::memcpy(out.tokens, buf.data(), size_t(n) * 8);
  std::memcpy(out.labels, buf.data() + 1, size_t(n) * 8);
  for (int64_t t = 0; t < n; ++t) {
    out.loss_mask[t] = 1.0f;
    out.position_ids[t] = t;
  }
  out.seq_starts->assign(1, 0);
}

}  // namespace megacore::data
