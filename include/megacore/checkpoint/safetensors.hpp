// safetensors files: an atomic writer and a lazy, mmap-backed reader.
//
// Layout (the format is fixed by the safetensors project, so other tools read our files and we read
// theirs): an 8-byte little-endian u64 header length N, N bytes of JSON padded with spaces, then the
// tensor bytes. The JSON maps each name to {"dtype", "shape", "data_offsets": [begin, end)} with offsets
// relative to the start of the data; tensors are row-major and tile the data with no holes. An optional
// "__metadata__" entry maps strings to strings.
//
// Checkpoints are where users lose days, so the reader validates everything before handing out a
// byte, and every problem is an IOError that names the file and what is wrong with it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "megacore/core/tensor.hpp"

namespace megacore::checkpoint {

/// The safetensors spelling of a dtype ("F32", "BF16", ...).
std::string_view safetensors_dtype_name(DType dtype);
/// Parses a safetensors dtype name; throws IOError for names megacore has no DType for.
DType safetensors_dtype_from_name(std::string_view name);

/// Free-form string metadata stored under "__metadata__".
using SafetensorsMetadata = std::map<std::string, std::string>;

/// Writes `tensors` (any device, any strides; copied to host row-major as needed) to `path`, with data
/// laid out in the order given. The file is written under a temporary name in the same directory,
/// fsynced and renamed over `path`, so a crash leaves either the old file or the complete new one and
/// never a partial file under `path`. Throws ValueError for bad names (empty, duplicate, "__metadata__")
/// and IOError when the file system fails; the temporary file is removed on every failure.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const SafetensorsMetadata& metadata = {});

/// save_safetensors on `threads` threads (0: min(8, hardware threads)) writing at offsets, returning each
/// tensor's CRC-32C (in the order given). The checksums are computed from the very memory handed to the
/// file system, one cache-sized block at a time just before that block is written, so the bytes are read
/// from memory once; write-back to the disk starts while later tensors are still being copied.
std::vector<uint32_t> save_safetensors_crc32c(const std::string& path,
                                              const std::vector<std::pair<std::string, Tensor>>& tensors,
                                              const SafetensorsMetadata& metadata = {}, int threads = 0);

/// What the header says about one tensor.
struct SafetensorsInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  int64_t data_begin = 0;  ///< byte offset relative to the start of the data section
  int64_t nbytes = 0;
};

/// A read-only safetensors file. Opening reads and validates only the header; the data stays mapped
/// and pages come in only when a tensor's bytes are touched, so a rank that needs one shard of one
/// tensor reads just those bytes.
class SafetensorsFile {
 public:
  /// Maps `path` and validates its header; throws IOError naming the file and the problem.
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return path_; }
  /// Tensor names in data order.
  const std::vector<std::string>& names() const { return names_; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  /// Header entry of `name`; throws IOError (listing a few names the file does have) if absent.
  const SafetensorsInfo& info(const std::string& name) const;
  const SafetensorsMetadata& metadata() const { return metadata_; }
  /// Size of the data section in bytes.
  int64_t data_size() const { return data_size_; }

  /// A CPU tensor viewing the mapped bytes, without copying. The mapping stays alive as long as any
  /// such tensor does, even after this object is gone. The mapping is private copy-on-write, so
  /// writing to the tensor never changes the file. Falls back to a copy only when the bytes are not
  /// aligned for the dtype (possible in files written by other tools).
  Tensor tensor(const std::string& name) const;
  /// A tensor owning a copy of the bytes, on `device`.
  Tensor load(const std::string& name, Device device = Device::cpu()) const;
  /// Copies `length` bytes starting `begin` bytes into tensor `name` to `dst`; touches only those pages.
  void read_bytes(const std::string& name, int64_t begin, int64_t length, void* dst) const;
  /// Copies `length` bytes starting `begin` bytes into tensor `name` to `dst` with pread() from the file
  /// rather than through the mapping (large reads of a cold file run at the disk's speed instead of
  /// one page fault per readahead window), in blocks of a few MiB; on_block(p, n) is called on each block
  /// once it has landed in `dst` (while it is still in cache), e.g. to checksum it.
  void read_into(const std::string& name, int64_t begin, int64_t length, void* dst,
                 const std::function<void(const uint8_t*, size_t)>& on_block = {}) const;
  /// Tells the kernel this file will be read front to back (a larger readahead for read_into).
  void advise_sequential() const;

 private:
  struct Mapping;
  const SafetensorsInfo& find(const std::string& name) const;
  const uint8_t* data_ptr(const SafetensorsInfo& info) const;

  std::string path_;
  std::shared_ptr<Mapping> mapping_;
  int64_t data_start_ = 0;  // file offset of the data section
  int64_t data_size_ = 0;
  std::vector<std::string> names_;
  std::vector<SafetensorsInfo> infos_;  // same order as names_
  std::map<std::string, size_t> index_;
  SafetensorsMetadata metadata_;
};

}  // namespace megacore::checkpoint
