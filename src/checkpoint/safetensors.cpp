#include "megacore/checkpoint/safetensors.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include "checkpoint/parallel_io.hpp"
#include "megacore/checkpoint/sharded_tensor.hpp"

namespace megacore::checkpoint {

namespace {

using nlohmann::json;

// Any header larger than this is corruption, not a model: refusing it early keeps a flipped length
// byte from turning into a multi-gigabyte allocation.
constexpr uint64_t kMaxHeaderBytes = uint64_t(100) << 20;

constexpr const char* kMetadataKey = "__metadata__";

std::string errno_str() { return std::strerror(errno); }

/// Owns the temporary file until it is renamed, so every exit path without a rename removes it.
class TempFile {
 public:
  explicit TempFile(const std::string& final_path) {
    static std::atomic<uint64_t> counter{0};
    // Same directory as the target so rename() is atomic; pid + counter keeps concurrent writers apart.
    path_ = final_path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0)
      raise<IOError>("safetensors: cannot create '{}': {} (does the directory exist and is it writable?)",
                     path_, errno_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(path_.c_str());
  }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

  void commit(const std::string& final_path) {
    if (::fsync(fd_) != 0) raise<IOError>("safetensors: fsync of '{}' failed: {}", path_, errno_str());
    int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) raise<IOError>("safetensors: closing '{}' failed: {}", path_, errno_str());
    if (::rename(path_.c_str(), final_path.c_str()) != 0)
      raise<IOError>("safetensors: cannot rename '{}' to '{}': {}", path_, final_path, errno_str());
    committed_ = true;
    // The rename itself is durable only once the directory entry is on disk.
    std::string dir = std::filesystem::path(final_path).parent_path().string();
    if (dir.empty()) dir = ".";
    int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);
      ::close(dfd);
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool committed_ = false;
};

bool mul_overflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }

}  // namespace

std::string_view safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::U8: return "U8";
    case DType::F8E4M3: return "F8_E4M3";
    case DType::F8E5M2: return "F8_E5M2";
  }
  raise<ValueError>("safetensors: dtype code {} has no safetensors name", int(dtype));
}

DType safetensors_dtype_from_name(std::string_view name) {
  for (DType d : {DType::F32, DType::F16, DType::BF16, DType::I64, DType::I32, DType::U8, DType::F8E4M3, DType::F8E5M2})
    if (safetensors_dtype_name(d) == name) return d;
  raise<IOError>("safetensors: unsupported dtype '{}'; megacore reads F32, F16, BF16, I64, I32, U8, F8_E4M3 and F8_E5M2 "
                 "(convert the tensor to one of these before saving)",
                 name);
}

// ---- writer -------------------------------------------------------------------------------------

namespace {

constexpr size_t kWriteChunk = size_t(32) << 20;  // bytes per work item of the parallel writer
constexpr size_t kWriteBlock = size_t(1) << 20;   // bytes checksummed and then written while in cache

/// Writes all of buf at `offset` of fd, retrying on short writes and EINTR.
void pwrite_all(int fd, const uint8_t* p, size_t n, int64_t offset, const std::string& what) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, std::min<size_t>(n, size_t(1) << 30), off_t(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      raise<IOError>("safetensors: writing {} failed: {} (check free disk space and permissions)", what,
                     errno_str());
    }
    p += w;
    n -= size_t(w);
    offset += w;
  }
}

// The writer behind both entry points; `crcs` (when given) receives each tensor's CRC-32C.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const SafetensorsMetadata& metadata, int threads, std::vector<uint32_t>* crcs) {
  // Validate and stage everything before the temporary file exists, so argument errors leave no trace.
  std::set<std::string> seen;
  std::vector<Tensor> host;
  host.reserve(tensors.size());
  json header = json::object();
  int64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    MC_CHECK(!name.empty(), "save_safetensors('{}'): tensor names must be non-empty", path);
    MC_CHECK(name != kMetadataKey, "save_safetensors('{}'): '{}' is reserved for metadata; rename the tensor",
             path, name);
    MC_CHECK(seen.insert(name).second, "save_safetensors('{}'): tensor name '{}' appears twice; names must be unique",
             path, name);
    MC_CHECK(t.defined(), "save_safetensors('{}'): tensor '{}' is undefined", path, name);
    // Row-major host bytes are what the format stores; views and device tensors are copied once here.
    Tensor h = t.to(Device::cpu()).contiguous();
    header[name] = {{"dtype", std::string(safetensors_dtype_name(h.dtype()))},
                    {"shape", h.shape()},
                    {"data_offsets", {offset, offset + h.nbytes()}}};
    offset += h.nbytes();
    host.push_back(std::move(h));
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;

  std::string text = header.dump();
  // Padding keeps the data section 8-byte aligned, so mmapped tensors of every dtype are aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint64_t n = text.size();
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[size_t(i)] = char(uint8_t(n >> (8 * i)));
  head += text;

  TempFile tmp(path);
  const std::string what = "'" + tmp.path() + "'";
  pwrite_all(tmp.fd(), reinterpret_cast<const uint8_t*>(head.data()), head.size(), 0, what);
  // Work items of at most kWriteChunk bytes, so one large tensor spreads over every thread; each item is
  // checksummed and written one cache-sized block at a time, so the bytes are read from memory once.
  struct Item {
    size_t tensor;
    int64_t begin, length, file_offset;
    uint32_t crc = 0;
  };
  std::vector<Item> items;
  int64_t file_offset = int64_t(head.size());
  for (size_t i = 0; i < host.size(); ++i) {
    const int64_t nb = host[i].nbytes();
    for (int64_t b = 0; b < nb; b += int64_t(kWriteChunk))
      items.push_back({i, b, std::min<int64_t>(int64_t(kWriteChunk), nb - b), file_offset + b, 0});
    file_offset += nb;
  }
  detail::parallel_for(items.size(), threads, [&](size_t k) {
    Item& it = items[k];
    const auto* base = static_cast<const uint8_t*>(host[it.tensor].data_ptr()) + it.begin;
    for (int64_t b = 0; b < it.length; b += int64_t(kWriteBlock)) {
      const size_t len = size_t(std::min<int64_t>(int64_t(kWriteBlock), it.length - b));
      if (crcs) it.crc = crc32c(base + b, len, it.crc);
      pwrite_all(tmp.fd(), base + b, len, it.file_offset + b, what);
    }
#ifdef __linux__
    // Start the write-back of this item now, so the disk works while later items are copied and the
    // final fsync has little left to do. Advisory: a failure here shows up in that fsync.
    ::sync_file_range(tmp.fd(), off_t(it.file_offset), off_t(it.length), SYNC_FILE_RANGE_WRITE);
#endif
  });
  if (crcs) {
    crcs->assign(host.size(), crc32c(nullptr, 0));
    for (const Item& it : items)
      (*crcs)[it.tensor] = it.begin == 0 ? it.crc : crc32c_combine((*crcs)[it.tensor], it.crc, uint64_t(it.length));
  }
  tmp.commit(path);
}

}  // namespace

void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const SafetensorsMetadata& metadata) {
  write_safetensors(path, tensors, metadata, 1, nullptr);
}

std::vector<uint32_t> save_safetensors_crc32c(const std::string& path,
                                              const std::vector<std::pair<std::string, Tensor>>& tensors,
                                              const SafetensorsMetadata& metadata, int threads) {
  std::vector<uint32_t> crcs;
  write_safetensors(path, tensors, metadata, threads, &crcs);
  return crcs;
}

// ---- reader -------------------------------------------------------------------------------------

struct SafetensorsFile::Mapping {
  void* addr = nullptr;
  size_t size = 0;
  int fd = -1;  // kept open for read_into
  ~Mapping() {
    if (addr) ::munmap(addr, size);
    if (fd >= 0) ::close(fd);
  }
};

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  auto fail = [&](const std::string& problem) -> void {
    raise<IOError>("safetensors file '{}': {}", path_, problem);
  };

  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open: " + errno_str());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail(std::string("cannot stat: ") + std::strerror(e));
  }
  const uint64_t file_size = uint64_t(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    fail(fmt::format("too short ({} bytes): a safetensors file starts with an 8-byte header length; "
                     "the file is truncated or not safetensors", file_size));
  }
  mapping_ = std::make_shared<Mapping>();
  // Private + writable: tensor() views may be written by callers (e.g. in-place ops); copy-on-write
  // keeps those writes out of the file, and pages are only read from disk when first touched.
  void* addr = ::mmap(nullptr, file_size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  int map_errno = errno;
  mapping_->fd = fd;
  if (addr == MAP_FAILED) fail(std::string("cannot mmap: ") + std::strerror(map_errno));
  mapping_->addr = addr;
  mapping_->size = file_size;
  const auto* bytes = static_cast<const uint8_t*>(addr);

  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(bytes[i]) << (8 * i);
  if (n > file_size - 8)
    fail(fmt::format("header length {} runs past the end of the file ({} bytes); the file is truncated or "
                     "not safetensors", n, file_size));
  if (n > kMaxHeaderBytes) fail(fmt::format("header length {} exceeds the {}-byte limit", n, kMaxHeaderBytes));
  data_start_ = int64_t(8 + n);
  data_size_ = int64_t(file_size - 8 - n);

  // nlohmann keeps the last of duplicate keys silently; a stack of per-object key sets catches them,
  // because two tensors under one name means one of them would be lost without a word.
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  json::parser_callback_t cb = [&](int, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start) {
      keys.emplace_back();
    } else if (ev == json::parse_event_t::object_end) {
      if (!keys.empty()) keys.pop_back();
    } else if (ev == json::parse_event_t::key && !keys.empty()) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!keys.back().insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  json header;
  try {
    header = json::parse(bytes + 8, bytes + 8 + n, cb);
  } catch (const json::exception& e) {
    fail(fmt::format("header is not valid JSON ({})", e.what()));
  }
  if (!duplicate.empty()) fail(fmt::format("name '{}' appears more than once in the header", duplicate));
  if (!header.is_object()) fail("header is JSON but not an object of tensor entries");

  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& e = it.value();
    if (name == kMetadataKey) {
      if (!e.is_object()) fail("'__metadata__' must be an object mapping strings to strings");
      for (auto m = e.begin(); m != e.end(); ++m) {
        if (!m.value().is_string())
          fail(fmt::format("'__metadata__' value of '{}' is not a string", m.key()));
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) { fail(fmt::format("tensor '{}': {}", name, what)); };
    if (!e.is_object()) bad("entry is not an object with dtype, shape and data_offsets");
    for (const char* k : {"dtype", "shape", "data_offsets"})
      if (!e.contains(k)) bad(fmt::format("entry has no '{}'", k));
    if (!e["dtype"].is_string()) bad("'dtype' is not a string");
    SafetensorsInfo info;
    info.name = name;
    try {
      info.dtype = safetensors_dtype_from_name(e["dtype"].get<std::string>());
    } catch (const IOError&) {
      bad(fmt::format("unknown or unsupported dtype '{}' (megacore reads F32, F16, BF16, I64, I32, U8)",
                      e["dtype"].get<std::string>()));
    }
    if (!e["shape"].is_array()) bad("'shape' is not an array");
    int64_t numel = 1;
    for (const json& d : e["shape"]) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > uint64_t(INT64_MAX))
        bad(fmt::format("shape {} has an entry that is not a non-negative integer", e["shape"].dump()));
      info.shape.push_back(d.get<int64_t>());
      if (mul_overflows(numel, info.shape.back(), &numel)) bad("shape has more elements than fit in 64 bits");
    }
    const json& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad(fmt::format("'data_offsets' {} is not a pair of non-negative integers [begin, end)", off.dump()));
    uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end) bad(fmt::format("data_offsets [{}, {}) end before they begin", begin, end));
    if (end > uint64_t(data_size_))
      bad(fmt::format("data_offsets [{}, {}) lie outside the {}-byte data section; the file is truncated or "
                      "the header is corrupt", begin, end, data_size_));
    int64_t nbytes = 0;
    if (mul_overflows(numel, dtype_size(info.dtype), &nbytes) || uint64_t(nbytes) != end - begin)
      bad(fmt::format("shape {} of {} needs {} bytes but data_offsets [{}, {}) hold {}", e["shape"].dump(),
                      safetensors_dtype_name(info.dtype), nbytes, begin, end, end - begin));
    info.data_begin = int64_t(begin);
    info.nbytes = nbytes;
    infos_.push_back(std::move(info));
  }

  // The tensors must tile the data section exactly: a gap or an overlap means the header and the data
  // disagree, and silently accepting either would load some other tensor's bytes.
  std::sort(infos_.begin(), infos_.end(), [](const SafetensorsInfo& a, const SafetensorsInfo& b) {
    return std::tie(a.data_begin, a.nbytes, a.name) < std::tie(b.data_begin, b.nbytes, b.name);
  });
  int64_t expect = 0;
  const SafetensorsInfo* prev = nullptr;
  for (const SafetensorsInfo& info : infos_) {
    if (info.data_begin > expect)
      fail(fmt::format("bytes [{}, {}) of the data section belong to no tensor (a hole before '{}')", expect,
                       info.data_begin, info.name));
    if (info.data_begin < expect)
      fail(fmt::format("tensor '{}' at data_offsets [{}, {}) overlaps tensor '{}' at [{}, {}); each tensor needs "
                       "bytes of its own (the header is corrupt or aliases one tensor to another)",
                       info.name, info.data_begin, info.data_begin + info.nbytes, prev->name, prev->data_begin,
                       prev->data_begin + prev->nbytes));
    expect = info.data_begin + info.nbytes;
    prev = &info;
  }
  if (expect != data_size_)
    fail(fmt::format("bytes [{}, {}) at the end of the data section belong to no tensor", expect, data_size_));

  for (size_t i = 0; i < infos_.size(); ++i) {
    names_.push_back(infos_[i].name);
    index_[infos_[i].name] = i;
  }
}

const SafetensorsInfo& SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    std::string some;
    for (size_t i = 0; i < names_.size() && i < 5; ++i) some += (i ? ", '" : "'") + names_[i] + "'";
    if (names_.size() > 5) some += ", ...";
    raise<IOError>("safetensors file '{}' has no tensor '{}'; it holds {} tensors ({}); is this the right "
                   "checkpoint for this model?",
                   path_, name, names_.size(), some.empty() ? "none" : some);
  }
  return infos_[it->second];
}

const SafetensorsInfo& SafetensorsFile::info(const std::string& name) const { return find(name); }

const uint8_t* SafetensorsFile::data_ptr(const SafetensorsInfo& info) const {
  return static_cast<const uint8_t*>(mapping_->addr) + data_start_ + info.data_begin;
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const SafetensorsInfo& info = find(name);
  const uint8_t* p = data_ptr(info);
  if (reinterpret_cast<uintptr_t>(p) % uintptr_t(dtype_size(info.dtype)) != 0) return load(name);
  // The release callback owns a reference to the mapping, so the bytes outlive this SafetensorsFile.
  std::shared_ptr<Mapping> keep = mapping_;
  return Tensor::from_blob(const_cast<uint8_t*>(p), info.shape, contiguous_strides(info.shape), info.dtype,
                           Device::cpu(), [keep]() mutable { keep.reset(); });
}

Tensor SafetensorsFile::load(const std::string& name, Device device) const {
  const SafetensorsInfo& info = find(name);
  Tensor t = Tensor::empty(info.shape, info.dtype);
  if (info.nbytes > 0) std::memcpy(t.data_ptr(), data_ptr(info), size_t(info.nbytes));
  return device.is_cpu() ? t : t.to(device);
}

void SafetensorsFile::read_bytes(const std::string& name, int64_t begin, int64_t length, void* dst) const {
  const SafetensorsInfo& info = find(name);
  MC_CHECK(begin >= 0 && length >= 0 && begin <= info.nbytes && length <= info.nbytes - begin,
           "read_bytes('{}'): range [{}, {}) is outside the tensor's {} bytes", name, begin, begin + length,
           info.nbytes);
  if (length > 0) std::memcpy(dst, data_ptr(info) + begin, size_t(length));
}

void SafetensorsFile::read_into(const std::string& name, int64_t begin, int64_t length, void* dst,
                                const std::function<void(const uint8_t*, size_t)>& on_block) const {
  const SafetensorsInfo& info = find(name);
  MC_CHECK(begin >= 0 && length >= 0 && begin <= info.nbytes && length <= info.nbytes - begin,
           "read_into('{}'): range [{}, {}) is outside the tensor's {} bytes", name, begin, begin + length,
           info.nbytes);
  constexpr int64_t kBlock = int64_t(4) << 20;
  auto* out = static_cast<uint8_t*>(dst);
  const int64_t start = data_start_ + info.data_begin + begin;
  for (int64_t done = 0; done < length;) {
    const int64_t want = std::min(kBlock, length - done);
    int64_t got = 0;
    while (got < want) {
      ssize_t r = ::pread(mapping_->fd, out + done + got, size_t(want - got), off_t(start + done + got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) raise<IOError>("safetensors file '{}': reading tensor '{}' failed: {}", path_, name, errno_str());
      if (r == 0)
        raise<IOError>("safetensors file '{}': tensor '{}' ends early (the file shrank after it was opened)", path_,
                       name);
      got += r;
    }
    if (on_block) on_block(out + done, size_t(want));
    done += want;
  }
}

void SafetensorsFile::advise_sequential() const {
  (void)::posix_fadvise(mapping_->fd, 0, 0, POSIX_FADV_SEQUENTIAL);  // advice only: a failure changes nothing
}

}  // namespace megacore::checkpoint
