// Megatron-compatible indexed dataset: a `.bin` of raw tokens and an `.idx` describing it.
//
// `.idx` layout (little-endian, no padding):
//   9 bytes  magic "MMIDIDX\0\0"
//   u64      version (1)
//   u8       token dtype code (1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16)
//   u64      sequence count S
//   u64      document-index count D (number of documents + 1)
//   i32[S]   sequence lengths, in tokens
//   i64[S]   byte offset of each sequence in `.bin`
//   i64[D]   document indices: document d is sequences [doc[d], doc[d+1]); doc[0] = 0, doc[D-1] = S
// Files written by Megatron-LM's preprocess_data.py load here and the reverse.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace megacore::data {

/// Token dtype codes of the `.idx` header (Megatron's numbering).
enum class TokenDType : uint8_t { U8 = 1, I8 = 2, I16 = 3, I32 = 4, I64 = 5, F64 = 6, F32 = 7, U16 = 8 };

/// Bytes per token of a dtype code.
int64_t token_dtype_size(TokenDType t);
/// "u16", "i32", ... as used in messages and the Python API.
std::string_view token_dtype_name(TokenDType t);
/// Parses a name ("u8", "u16", "uint16", "i32", "int32", "i64", ...); throws ValueError listing the names.
TokenDType token_dtype_from_name(std::string_view name);
/// The smallest integer dtype holding ids below vocab_size (u16 below 65536, else i32), as Megatron picks.
TokenDType token_dtype_for_vocab(int64_t vocab_size);

/// `prefix.bin` and `prefix.idx` of a dataset prefix.
std::string bin_path(const std::string& prefix);
std::string idx_path(const std::string& prefix);

/// A read-only, memory-mapped indexed dataset. Thread-safe (it never changes after opening).
///
/// Opening checks the whole index against the data file: magic, version, dtype code, counts, that
/// pointers are consecutive and that `.bin` has exactly the bytes the index describes. Any mismatch
/// is an IOError naming the file and what to do.
class IndexedDataset {
 public:
  /// Opens `prefix.idx` and `prefix.bin`.
  explicit IndexedDataset(const std::string& prefix);
  ~IndexedDataset();
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;

  const std::string& prefix() const { return prefix_; }
  TokenDType dtype() const { return dtype_; }
  /// Number of sequences (S).
  int64_t num_sequences() const { return int64_t(lengths_.size()); }
  /// Number of documents (D - 1).
  int64_t num_documents() const { return int64_t(doc_index_.size()) - 1; }
  /// Sum of all sequence lengths.
  int64_t num_tokens() const { return num_tokens_; }
  std::span<const int32_t> sequence_lengths() const { return lengths_; }
  std::span<const int64_t> sequence_pointers() const { return pointers_; }
  std::span<const int64_t> document_indices() const { return doc_index_; }
  /// Tokens in document d (all its sequences).
  int64_t document_length(int64_t d) const;
  /// Index of the first token of document d, counted in tokens from the start of `.bin`.
  int64_t document_token_offset(int64_t d) const;

  /// Copies `count` tokens starting at token `start` of `.bin` into out, converted to int64.
  void read_tokens(int64_t start, int64_t count, int64_t* out) const;
  /// All tokens of sequence i as int64.
  std::vector<int64_t> sequence(int64_t i) const;
  /// Raw bytes of the `.bin` file (the mapped region).
  std::span<const uint8_t> bin_bytes() const;

 private:
  std::string prefix_;
  TokenDType dtype_ = TokenDType::U16;
  int64_t num_tokens_ = 0;
  // Copied out of the .idx because its arrays sit at unaligned offsets (34 + 4S, ...).
  std::vector<int32_t> lengths_;
  std::vector<int64_t> pointers_;
  std::vector<int64_t> doc_index_;
  struct Mapping;
  std::unique_ptr<Mapping> idx_map_, bin_map_;
};

/// Writes an indexed dataset. Output goes to temporary names and appears under the final names only
/// when finalize() succeeds, so a crash or error never leaves a half-written dataset behind
/// (the destructor removes the temporaries of an unfinished writer).
class IndexedDatasetWriter {
 public:
  IndexedDatasetWriter(const std::string& prefix, TokenDType dtype);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  /// Appends one sequence. Values must fit the dtype (ValueError otherwise).
  void add_sequence(std::span<const int64_t> tokens);
  void add_sequence(std::span<const int32_t> tokens);
  /// Closes the current document (a no-op if no sequence was added since the last call).
  void end_document();
  /// Appends a one-sequence document.
  void add_document(std::span<const int64_t> tokens) {
    add_sequence(tokens);
    end_document();
  }
  /// Appends every document of another dataset with the same dtype (merging shards).
  void add_dataset(const IndexedDataset& other);
  /// Writes the index, flushes, and renames both files into place. Ends an open document first.
  void finalize();
  /// Drops everything written so far and removes the temporary files (for error paths).
  void abort();

  int64_t num_sequences() const { return int64_t(lengths_.size()); }
  int64_t num_documents() const { return int64_t(doc_index_.size()) - 1; }
  int64_t num_tokens() const { return num_tokens_; }

 private:
  template <class T>
  void add_impl(std::span<const T> tokens);
  std::string prefix_, bin_tmp_, idx_tmp_;
  TokenDType dtype_;
  std::FILE* bin_ = nullptr;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> doc_index_{0};
  int64_t num_tokens_ = 0;
  std::vector<uint8_t> scratch_;
  bool finalized_ = false;
};

}  // namespace megacore::data
