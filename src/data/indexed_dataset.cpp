#include "megacore/data/indexed_dataset.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include "megacore/core/error.hpp"

namespace megacore::data {

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kVersion = 1;
constexpr int64_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;

template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <class F>
decltype(auto) dispatch_token(TokenDType t, F&& f) {
  switch (t) {
    case TokenDType::U8: return f(uint8_t{});
    case TokenDType::I8: return f(int8_t{});
    case TokenDType::I16: return f(int16_t{});
    case TokenDType::I32: return f(int32_t{});
    case TokenDType::I64: return f(int64_t{});
    case TokenDType::F64: return f(double{});
    case TokenDType::F32: return f(float{});
    case TokenDType::U16: return f(uint16_t{});
  }
  raise<ValueError>("unknown token dtype code {}", int(t));
}

bool valid_code(uint8_t c) { return c >= 1 && c <= 8; }

}  // namespace

int64_t token_dtype_size(TokenDType t) {
  return dispatch_token(t, [](auto v) { return int64_t(sizeof(v)); });
}

std::string_view token_dtype_name(TokenDType t) {
  switch (t) {
    case TokenDType::U8: return "u8";
    case TokenDType::I8: return "i8";
    case TokenDType::I16: return "i16";
    case TokenDType::I32: return "i32";
    case TokenDType::I64: return "i64";
    case TokenDType::F64: return "f64";
    case TokenDType::F32: return "f32";
    case TokenDType::U16: return "u16";
  }
  return "?";
}

TokenDType token_dtype_from_name(std::string_view n) {
  if (n == "u8" || n == "uint8") return TokenDType::U8;
  if (n == "i8" || n == "int8") return TokenDType::I8;
  if (n == "i16" || n == "int16") return TokenDType::I16;
  if (n == "i32" || n == "int32") return TokenDType::I32;
  if (n == "i64" || n == "int64") return TokenDType::I64;
  if (n == "f64" || n == "float64") return TokenDType::F64;
  if (n == "f32" || n == "float32") return TokenDType::F32;
  if (n == "u16" || n == "uint16") return TokenDType::U16;
  raise<ValueError>("unknown token dtype '{}'; use one of u8, i8, i16, u16, i32, i64, f32, f64", n);
}

TokenDType token_dtype_for_vocab(int64_t vocab_size) {
  MC_CHECK(vocab_size > 0, "vocab_size must be positive, got {}", vocab_size);
  return vocab_size <= 65536 ? TokenDType::U16 : TokenDType::I32;
}

std::string bin_path(const std::string& prefix) { return prefix + ".bin"; }
std::string idx_path(const std::string& prefix) { return prefix + ".idx"; }

// ---- reader ----------------------------------------------------------------------------------------

struct IndexedDataset::Mapping {
  const uint8_t* data = nullptr;
  int64_t size = 0;
  ~Mapping() {
    if (data && size > 0) munmap(const_cast<uint8_t*>(data), size_t(size));
  }
};

IndexedDataset::IndexedDataset(const std::string& prefix) : prefix_(prefix) {
  auto open_map = [](const std::string& path, const char* missing_fix) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    MC_CHECK_AS(IOError, fd >= 0, "cannot open '{}': {}; {}", path, std::strerror(errno), missing_fix);
    struct stat st {};
    if (fstat(fd, &st) != 0) {
      int e = errno;
      ::close(fd);
      raise<IOError>("cannot stat '{}': {}", path, std::strerror(e));
    }
    auto m = std::make_unique<Mapping>();
    m->size = int64_t(st.st_size);
    if (m->size > 0) {
      void* p = mmap(nullptr, size_t(m->size), PROT_READ, MAP_SHARED, fd, 0);
      int e = errno;
      ::close(fd);
      MC_CHECK_AS(IOError, p != MAP_FAILED, "cannot mmap '{}' ({} bytes): {}", path, m->size, std::strerror(e));
      m->data = static_cast<const uint8_t*>(p);
    } else {
      ::close(fd);
    }
    return m;
  };
  const std::string ipath = idx_path(prefix), bpath = bin_path(prefix);
  const char* fix = "pass the dataset prefix without extension (e.g. data/corpus_text_document for "
                    "data/corpus_text_document.bin/.idx), or create it with `megacore preprocess`";
  idx_map_ = open_map(ipath, fix);
  bin_map_ = open_map(bpath, fix);

  const uint8_t* p = idx_map_->data;
  const int64_t n = idx_map_->size;
  MC_CHECK_AS(IOError, n >= kHeaderBytes,
              "'{}' is {} bytes, shorter than the {}-byte header of an indexed dataset index; the file is "
              "truncated or not an .idx file: regenerate it with `megacore preprocess`",
              ipath, n, kHeaderBytes);
  MC_CHECK_AS(IOError, std::memcmp(p, kMagic, 9) == 0,
              "'{}' does not start with the magic MMIDIDX\\x00\\x00 of a Megatron indexed dataset index; it is "
              "not an .idx file (or was written by an incompatible tool): regenerate it with `megacore preprocess`",
              ipath);
  uint64_t version = load<uint64_t>(p + 9);
  MC_CHECK_AS(IOError, version == kVersion,
              "'{}' has index version {}, only version 1 is supported; regenerate it with `megacore preprocess`",
              ipath, version);
  uint8_t code = p[17];
  MC_CHECK_AS(IOError, valid_code(code),
              "'{}' has unknown token dtype code {} (known: 1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16); "
              "the index is corrupt: regenerate it with `megacore preprocess`",
              ipath, int(code));
  dtype_ = TokenDType(code);
  uint64_t s = load<uint64_t>(p + 18), d = load<uint64_t>(p + 26);
  // Each count is bounded by the file size before multiplying, so the size check cannot overflow.
  MC_CHECK_AS(IOError, s <= uint64_t(n) && d <= uint64_t(n) && d >= 1,
              "'{}' declares {} sequences and {} document indices, impossible for a {}-byte file; the index is "
              "corrupt: regenerate it",
              ipath, s, d, n);
  const int64_t expect = kHeaderBytes + int64_t(s) * 12 + int64_t(d) * 8;
  MC_CHECK_AS(IOError, n == expect,
              "'{}' is {} bytes but its header ({} sequences, {} document indices) needs {} bytes; the index is "
              "{}: regenerate it with `megacore preprocess`",
              ipath, n, s, d, expect, n < expect ? "truncated" : "followed by extra bytes (wrong format?)");

  lengths_.resize(s);
  pointers_.resize(s);
  doc_index_.resize(d);
  std::memcpy(lengths_.data(), p + kHeaderBytes, s * 4);
  std::memcpy(pointers_.data(), p + kHeaderBytes + s * 4, s * 8);
  std::memcpy(doc_index_.data(), p + kHeaderBytes + s * 12, d * 8);
  auto* lengths = &lengths_;
  auto* pointers = &pointers_;
  auto* docs = &doc_index_;

  const int64_t item = token_dtype_size(dtype_);
  int64_t offset = 0;
  for (uint64_t i = 0; i < s; ++i) {
    int32_t len = (*lengths)[i];
    MC_CHECK_AS(IOError, len >= 0, "'{}': sequence {} has negative length {}; the index is corrupt: regenerate it",
                ipath, i, len);
    MC_CHECK_AS(IOError, (*pointers)[i] == offset,
                "'{}': sequence {} starts at byte {} but the previous sequences end at byte {}; the index does not "
                "match a contiguous .bin: regenerate both files with `megacore preprocess`",
                ipath, i, (*pointers)[i], offset);
    offset += int64_t(len) * item;
    num_tokens_ += len;
  }
  MC_CHECK_AS(IOError, (*docs)[0] == 0 && (*docs)[d - 1] == int64_t(s),
              "'{}': document indices must start at 0 and end at the sequence count {}, found {} .. {}; the index "
              "is corrupt: regenerate it",
              ipath, s, (*docs)[0], (*docs)[d - 1]);
  for (uint64_t i = 1; i < d; ++i)
    MC_CHECK_AS(IOError, (*docs)[i] >= (*docs)[i - 1],
                "'{}': document indices decrease at entry {} ({} after {}); the index is corrupt: regenerate it",
                ipath, i, (*docs)[i], (*docs)[i - 1]);
  MC_CHECK_AS(IOError, bin_map_->size == offset,
              "'{}' is {} bytes but its index '{}' describes {} bytes ({} tokens of {}); {} — regenerate both files "
              "with `megacore preprocess` (do not mix .bin and .idx from different runs)",
              bpath, bin_map_->size, ipath, offset, num_tokens_, token_dtype_name(dtype_),
              bin_map_->size < offset ? "the .bin file is truncated" : "the .bin file has extra data");
}

IndexedDataset::~IndexedDataset() = default;

int64_t IndexedDataset::document_length(int64_t d) const {
  MC_CHECK(d >= 0 && d < num_documents(), "document {} out of range [0, {}) in '{}'", d, num_documents(), prefix_);
  int64_t total = 0;
  for (int64_t i = doc_index_[d]; i < doc_index_[d + 1]; ++i) total += lengths_[i];
  return total;
}

int64_t IndexedDataset::document_token_offset(int64_t d) const {
  MC_CHECK(d >= 0 && d < num_documents(), "document {} out of range [0, {}) in '{}'", d, num_documents(), prefix_);
  int64_t first = doc_index_[d];
  if (first < num_sequences()) return pointers_[first] / token_dtype_size(dtype_);
  return num_tokens_;
}

void IndexedDataset::read_tokens(int64_t start, int64_t count, int64_t* out) const {
  MC_CHECK(start >= 0 && count >= 0 && start + count <= num_tokens_,
           "token range [{}, {}) is outside '{}' ({} tokens)", start, start + count, bin_path(prefix_), num_tokens_);
  if (count == 0) return;
  const uint8_t* base = bin_map_->data;
  dispatch_token(dtype_, [&](auto v) {
    using T = decltype(v);
    const uint8_t* src = base + start * int64_t(sizeof(T));
    for (int64_t i = 0; i < count; ++i) out[i] = int64_t(load<T>(src + i * int64_t(sizeof(T))));
    return 0;
  });
}

std::vector<int64_t> IndexedDataset::sequence(int64_t i) const {
  MC_CHECK(i >= 0 && i < num_sequences(), "sequence {} out of range [0, {}) in '{}'", i, num_sequences(), prefix_);
  std::vector<int64_t> out(size_t(lengths_[i]));
  read_tokens(pointers_[i] / token_dtype_size(dtype_), lengths_[i], out.data());
  return out;
}

std::span<const uint8_t> IndexedDataset::bin_bytes() const {
  return {bin_map_->data, size_t(bin_map_->size)};
}

// ---- writer ----------------------------------------------------------------------------------------

IndexedDatasetWriter::IndexedDatasetWriter(const std::string& prefix, TokenDType dtype)
    : prefix_(prefix), dtype_(dtype) {
  MC_CHECK(valid_code(uint8_t(dtype)), "unknown token dtype code {}", int(dtype));
  // The pid keeps concurrent writers of the same prefix (several ranks) from clobbering each other.
  std::string tag = ".tmp-" + std::to_string(::getpid());
  bin_tmp_ = bin_path(prefix) + tag;
  idx_tmp_ = idx_path(prefix) + tag;
  std::filesystem::path parent = std::filesystem::path(prefix).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
  }
  bin_ = std::fopen(bin_tmp_.c_str(), "wb");
  MC_CHECK_AS(IOError, bin_ != nullptr, "cannot create '{}': {}; check that the output directory is writable",
              bin_tmp_, std::strerror(errno));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (bin_) std::fclose(bin_);
  if (!finalized_) {
    std::remove(bin_tmp_.c_str());
    std::remove(idx_tmp_.c_str());
  }
}

template <class T>
void IndexedDatasetWriter::add_impl(std::span<const T> tokens) {
  MC_CHECK(!finalized_, "add_sequence after finalize() on the writer of '{}'", prefix_);
  MC_CHECK(tokens.size() <= size_t(std::numeric_limits<int32_t>::max()),
           "a sequence of {} tokens does not fit the i32 length field; split the document", tokens.size());
  const int64_t item = token_dtype_size(dtype_);
  scratch_.resize(tokens.size() * size_t(item));
  dispatch_token(dtype_, [&](auto v) {
    using D = decltype(v);
    for (size_t i = 0; i < tokens.size(); ++i) {
      T x = tokens[i];
      if constexpr (std::is_integral_v<D>) {
        MC_CHECK(int64_t(x) >= int64_t(std::numeric_limits<D>::min()) &&
                     (x < 0 || uint64_t(x) <= uint64_t(std::numeric_limits<D>::max())),
                 "token id {} does not fit the dataset dtype {} of '{}'; pick a wider dtype (i32) for this vocabulary",
                 int64_t(x), token_dtype_name(dtype_), prefix_);
      }
      D d = static_cast<D>(x);
      std::memcpy(scratch_.data() + i * sizeof(D), &d, sizeof(D));
    }
    return 0;
  });
  if (!scratch_.empty())
    MC_CHECK_AS(IOError, std::fwrite(scratch_.data(), 1, scratch_.size(), bin_) == scratch_.size(),
                "writing '{}' failed: {}; check free disk space", bin_tmp_, std::strerror(errno));
  lengths_.push_back(int32_t(tokens.size()));
  num_tokens_ += int64_t(tokens.size());
}

void IndexedDatasetWriter::add_sequence(std::span<const int64_t> tokens) { add_impl(tokens); }
void IndexedDatasetWriter::add_sequence(std::span<const int32_t> tokens) { add_impl(tokens); }

void IndexedDatasetWriter::end_document() {
  if (int64_t(lengths_.size()) > doc_index_.back()) doc_index_.push_back(int64_t(lengths_.size()));
}

void IndexedDatasetWriter::add_dataset(const IndexedDataset& other) {
  MC_CHECK(other.dtype() == dtype_, "cannot merge '{}' (dtype {}) into a {} dataset; re-tokenise with the same dtype",
           other.prefix(), token_dtype_name(other.dtype()), token_dtype_name(dtype_));
  end_document();
  auto bytes = other.bin_bytes();
  if (!bytes.empty())
    MC_CHECK_AS(IOError, std::fwrite(bytes.data(), 1, bytes.size(), bin_) == bytes.size(),
                "writing '{}' failed: {}; check free disk space", bin_tmp_, std::strerror(errno));
  int64_t base = int64_t(lengths_.size());
  for (int32_t len : other.sequence_lengths()) lengths_.push_back(len);
  auto docs = other.document_indices();
  for (size_t i = 1; i < docs.size(); ++i) doc_index_.push_back(base + docs[i]);
  num_tokens_ += other.num_tokens();
}

void IndexedDatasetWriter::abort() {
  if (finalized_) return;
  if (bin_) std::fclose(bin_);
  bin_ = nullptr;
  std::remove(bin_tmp_.c_str());
  std::remove(idx_tmp_.c_str());
  finalized_ = true;  // nothing more may be written, and the destructor has nothing left to remove
}

void IndexedDatasetWriter::finalize() {
  MC_CHECK(!finalized_, "finalize() called twice on the writer of '{}'", prefix_);
  end_document();
  MC_CHECK_AS(IOError, std::fflush(bin_) == 0 && std::fclose(bin_) == 0, "flushing '{}' failed: {}", bin_tmp_,
              std::strerror(errno));
  bin_ = nullptr;

  std::vector<uint8_t> idx;
  idx.reserve(size_t(kHeaderBytes) + lengths_.size() * 12 + doc_index_.size() * 8);
  auto put = [&](const void* p, size_t n) {
    auto* b = static_cast<const uint8_t*>(p);
    idx.insert(idx.end(), b, b + n);
  };
  put(kMagic, 9);
  put(&kVersion, 8);
  uint8_t code = uint8_t(dtype_);
  put(&code, 1);
  uint64_t s = lengths_.size(), d = doc_index_.size();
  put(&s, 8);
  put(&d, 8);
  put(lengths_.data(), lengths_.size() * 4);
  const int64_t item = token_dtype_size(dtype_);
  int64_t ptr = 0;
  for (int32_t len : lengths_) {
    put(&ptr, 8);
    ptr += int64_t(len) * item;
  }
  put(doc_index_.data(), doc_index_.size() * 8);

  std::FILE* f = std::fopen(idx_tmp_.c_str(), "wb");
  MC_CHECK_AS(IOError, f != nullptr, "cannot create '{}': {}", idx_tmp_, std::strerror(errno));
  bool ok = std::fwrite(idx.data(), 1, idx.size(), f) == idx.size();
  ok = (std::fclose(f) == 0) && ok;
  MC_CHECK_AS(IOError, ok, "writing '{}' failed: {}; check free disk space", idx_tmp_, std::strerror(errno));
  // .bin first: a reader that finds the new .idx then always finds the matching .bin.
  std::error_code ec;
  std::filesystem::rename(bin_tmp_, bin_path(prefix_), ec);
  MC_CHECK_AS(IOError, !ec, "renaming '{}' to '{}' failed: {}", bin_tmp_, bin_path(prefix_), ec.message());
  std::filesystem::rename(idx_tmp_, idx_path(prefix_), ec);
  MC_CHECK_AS(IOError, !ec, "renaming '{}' to '{}' failed: {}", idx_tmp_, idx_path(prefix_), ec.message());
  finalized_ = true;
}

}  // namespace megacore::data
