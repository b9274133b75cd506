#include "megacore/core/allocator.hpp"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "core/cuda_backend.hpp"
#include "megacore/core/error.hpp"

namespace megacore {

namespace {
constexpr size_t kSmallRound = 512;
constexpr size_t kLargeRound = size_t(2) << 20;
constexpr size_t kSmallLimit = size_t(1) << 20;
constexpr size_t kHostAlign = 64;

size_t round_size(size_t n) {
  if (n == 0) n = 1;
  size_t r = n < kSmallLimit ? kSmallRound : kLargeRound;
  return (n + r - 1) / r * r;
}

// A cached block may serve a request if it does not waste too much of itself.
bool fits(size_t block, size_t want) {
  return block >= want && (want < kSmallLimit ? block <= 2 * want : block - want <= want / 8);
}
}  // namespace

std::string format_bytes(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(b);
  int u = 0;
  while (std::abs(v) >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

struct Allocator::Impl {
  struct Block {
    void* ptr = nullptr;
    size_t size = 0;       // rounded
    size_t requested = 0;  // asked for
    void* stream = nullptr;
    std::vector<Stream> uses;  // other streams the block was used on
  };
  struct Pending {
    Block block;
    std::vector<Event> events;
  };
  mutable std::mutex mu;
  std::unordered_map<void*, Block> live;
  std::map<void*, std::multimap<size_t, Block>> free_by_stream;
  std::vector<Pending> pending;
  std::unordered_map<void*, int> pinned;  // block address -> pin count
  MemoryStats st;
  int64_t limit = 0;

  void on_alloc(const Block& b) {
    st.allocated += int64_t(b.size);
    st.requested += int64_t(b.requested);
    st.peak_allocated = std::max(st.peak_allocated, st.allocated);
    ++st.num_allocs;
  }
  void on_reserve(size_t n) {
    st.reserved += int64_t(n);
    st.peak_reserved = std::max(st.peak_reserved, st.reserved);
    ++st.num_device_mallocs;
  }
  // Events recorded on one stream complete in order, and `pending` keeps the order of the frees: once an
  // event of a stream is not ready, the later ones of that stream are not queried. Every allocation runs
  // this, so that is one query per busy stream instead of one per parked block.
  void process_pending() {
    std::vector<void*> busy;
    size_t kept = 0;
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      bool done = true;
      for (size_t k = 0; k < p.events.size(); ++k) {
        void* stream = p.block.uses[k].native();
        if (std::find(busy.begin(), busy.end(), stream) != busy.end()) {
          done = false;
        } else if (!p.events[k].query()) {
          busy.push_back(stream);
          done = false;
        }
      }
      if (done) {
        Block b = std::move(p.block);
        b.uses.clear();
        free_by_stream[b.stream].emplace(b.size, std::move(b));
      } else {
        if (kept != i) pending[kept] = std::move(p);
        ++kept;
      }
    }
    pending.erase(pending.begin() + std::ptrdiff_t(kept), pending.end());
  }
  void release_cached(int device) {
    for (auto& [stream, pool] : free_by_stream)
      for (auto it = pool.begin(); it != pool.end();) {
        if (pinned.count(it->second.ptr)) {
          ++it;
          continue;
        }
        cuda_impl::raw_free(it->second.ptr, device);
        st.reserved -= int64_t(it->second.size);
        ++st.num_device_frees;
        it = pool.erase(it);
      }
  }
  bool owns(void* p) const {
    if (live.count(p)) return true;
    for (const auto& [stream, pool] : free_by_stream)
      for (const auto& [size, b] : pool)
        if (b.ptr == p) return true;
    for (const Pending& q : pending)
      if (q.block.ptr == p) return true;
    return false;
  }
};

Allocator& Allocator::get(Device d) {
  static std::mutex mu;
  // Allocators live until the process ends: destroying them during static destruction would race
  // the CUDA runtime's own teardown.
  static auto* table = new std::map<std::pair<int, int>, Allocator*>();
  check_device(d);
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(int(d.type), d.index);
  auto it = table->find(key);
  if (it == table->end()) it = table->emplace(key, new Allocator(d)).first;
  return *it->second;
}

Allocator::Allocator(Device d) : device_(d), impl_(new Impl) {}
Allocator::~Allocator() { delete impl_; }

void Allocator::set_memory_limit(int64_t bytes) {
  MC_CHECK(bytes >= 0, "memory limit must be >= 0 (0 means no limit), got {}", bytes);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->limit = bytes;
}

void* Allocator::allocate(size_t nbytes, const Stream& s) {
  auto& I = *impl_;
  std::lock_guard<std::mutex> lock(I.mu);
  MC_CHECK(nbytes <= (size_t(1) << 62), "cannot allocate {} bytes: size is negative or absurdly large", nbytes);
  if (device_.is_cpu()) {
    size_t size = (std::max<size_t>(nbytes, 1) + kHostAlign - 1) / kHostAlign * kHostAlign;
    if (I.limit > 0 && I.st.reserved + int64_t(size) > I.limit) {
      ++I.st.num_ooms;
      raise<OutOfMemoryError>("host allocation of {} exceeds the memory limit of {} ({} in use)",
                              format_bytes(int64_t(nbytes)), format_bytes(I.limit), format_bytes(I.st.allocated));
    }
    void* p = std::aligned_alloc(kHostAlign, size);
    if (!p) {
      ++I.st.num_ooms;
      raise<OutOfMemoryError>("host allocation of {} failed ({} already allocated by megacore); free memory or use "
                              "smaller tensors",
                              format_bytes(int64_t(nbytes)), format_bytes(I.st.allocated));
    }
    Impl::Block b{p, size, nbytes, nullptr, {}};
    I.on_reserve(size);
    I.on_alloc(b);
    I.live.emplace(p, std::move(b));
    return p;
  }

  MC_CHECK(s.device() == device_ || s.device().is_cpu(), "allocation on {} was given a stream of {}", device_.str(),
           s.device().str());
  void* stream = s.device().is_cpu() ? nullptr : s.native();
  size_t size = round_size(nbytes);
  I.process_pending();
  auto& pool = I.free_by_stream[stream];
  auto it = pool.lower_bound(size);
  if (it != pool.end() && fits(it->first, size)) {
    Impl::Block b = std::move(it->second);
    pool.erase(it);
    b.requested = nbytes;
    I.on_alloc(b);
    void* p = b.ptr;
    I.live.emplace(p, std::move(b));
    return p;
  }
  auto over_limit = [&] { return I.limit > 0 && I.st.reserved + int64_t(size) > I.limit; };
  void* p = over_limit() ? nullptr : cuda_impl::raw_malloc(size, device_.index);
  if (!p) {
    // Return the cache to the driver and try once more before giving up.
    ++I.st.num_cache_flushes;
    I.release_cached(device_.index);
    p = over_limit() ? nullptr : cuda_impl::raw_malloc(size, device_.index);
  }
  if (!p) {
    ++I.st.num_ooms;
    size_t free_b = 0, total_b = 0;
    cuda_impl::mem_get_info(device_.index, &free_b, &total_b);
    raise<OutOfMemoryError>(
        "CUDA out of memory on {}: tried to allocate {}; the device has {} free of {}; megacore holds {} allocated, "
        "{} reserved{}. Reduce the micro-batch size, enable activation recompute, or shard more (TP/PP/ZeRO)",
        device_.str(), format_bytes(int64_t(nbytes)), format_bytes(int64_t(free_b)), format_bytes(int64_t(total_b)),
        format_bytes(I.st.allocated), format_bytes(I.st.reserved),
        I.limit > 0 ? fmt::format(" (memory limit {})", format_bytes(I.limit)) : std::string());
  }
  Impl::Block b{p, size, nbytes, stream, {}};
  I.on_reserve(size);
  I.on_alloc(b);
  I.live.emplace(p, std::move(b));
  return p;
}

void Allocator::deallocate(void* p) {
  if (!p) return;
  auto& I = *impl_;
  std::lock_guard<std::mutex> lock(I.mu);
  auto it = I.live.find(p);
  MC_CHECK(it != I.live.end(), "deallocate: pointer {} was not allocated by megacore's allocator for {}", p,
           device_.str());
  Impl::Block b = std::move(it->second);
  I.live.erase(it);
  I.st.allocated -= int64_t(b.size);
  I.st.requested -= int64_t(b.requested);
  ++I.st.num_frees;
  if (device_.is_cpu()) {
    std::free(b.ptr);
    I.st.reserved -= int64_t(b.size);
    ++I.st.num_device_frees;
    return;
  }
  if (b.uses.empty()) {
    I.free_by_stream[b.stream].emplace(b.size, std::move(b));
    return;
  }
  Impl::Pending pend{std::move(b), {}};
  for (const Stream& s : pend.block.uses) {  // events[k] is recorded on uses[k] (process_pending relies on it)
    Event e;
    e.record(s);
    pend.events.push_back(std::move(e));
  }
  I.pending.push_back(std::move(pend));
}

void Allocator::record_stream(void* p, const Stream& s) {
  if (device_.is_cpu() || s.device().is_cpu()) return;
  auto& I = *impl_;
  std::lock_guard<std::mutex> lock(I.mu);
  auto it = I.live.find(p);
  MC_CHECK(it != I.live.end(), "record_stream: pointer {} was not allocated by megacore's allocator", p);
  auto& b = it->second;
  if (s.native() == b.stream) return;
  for (const Stream& u : b.uses)
    if (u == s) return;
  b.uses.push_back(s);
}

void Allocator::release_stream_use(void* p, const Stream& s) {
  if (device_.is_cpu() || s.device().is_cpu()) return;
  auto& I = *impl_;
  std::lock_guard<std::mutex> lock(I.mu);
  auto it = I.live.find(p);
  if (it == I.live.end()) return;
  auto& uses = it->second.uses;
  uses.erase(std::remove(uses.begin(), uses.end(), s), uses.end());
}

void Allocator::empty_cache() {
  if (device_.is_cpu()) return;
  auto& I = *impl_;
  std::lock_guard<std::mutex> lock(I.mu);
  I.process_pending();
  I.release_cached(device_.index);
}

bool Allocator::pin(void* p) {
  if (device_.is_cpu() || !p) return false;
  auto& I = *impl_;
  std::lock_guard<std::mutex> lock(I.mu);
  if (!I.owns(p)) return false;
  ++I.pinned[p];
  return true;
}

void Allocator::unpin(void* p) {
  auto& I = *impl_;
  std::lock_guard<std::mutex> lock(I.mu);
  auto it = I.pinned.find(p);
  if (it != I.pinned.end() && --it->second <= 0) I.pinned.erase(it);
}

MemoryStats Allocator::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->st;
}

void Allocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->st.peak_allocated = impl_->st.allocated;
  impl_->st.peak_reserved = impl_->st.reserved;
}

}  // namespace megacore
