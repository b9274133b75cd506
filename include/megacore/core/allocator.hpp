// Device memory: a caching allocator per device, with statistics.
//
// CUDA memory is taken with plain cudaMalloc (never managed memory) in 512-byte-rounded blocks
// (2 MiB-rounded above 1 MiB), kept on free lists per stream and reused without calling the
// driver. A block used on another stream (record_stream) returns to its pool only when that
// stream's work has finished. On out-of-memory the cache is released and the allocation retried
// once before OutOfMemoryError is thrown. A pinned block (pin) is never returned to the driver:
// another process maps it through CUDA IPC (the copy-engine transfers), and it stays cached and
// reusable instead. Host memory goes through the same interface (aligned to
// 64 bytes, not cached) so that host statistics are available too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "megacore/core/device.hpp"
#include "megacore/core/stream.hpp"

namespace megacore {

/// Allocation statistics of one device, in bytes (counts for the num_ fields).
struct MemoryStats {
  int64_t allocated = 0;       ///< bytes in live blocks handed out (rounded sizes)
  int64_t reserved = 0;        ///< bytes held from the driver (live + cached)
  int64_t peak_allocated = 0;  ///< maximum of allocated since the last reset_peak_stats
  int64_t peak_reserved = 0;
  int64_t requested = 0;       ///< bytes asked for by live blocks (unrounded)
  int64_t num_allocs = 0;
  int64_t num_frees = 0;
  int64_t num_device_mallocs = 0;  ///< calls to cudaMalloc (or the host allocator)
  int64_t num_device_frees = 0;
  int64_t num_cache_flushes = 0;   ///< times the cache was emptied to satisfy an allocation
  int64_t num_ooms = 0;
};

/// The allocator of one device. Thread-safe.
class Allocator {
 public:
  /// The process-wide allocator of a device (one per device, like the device itself).
  static Allocator& get(Device d);

  /// Allocates nbytes usable on stream s; throws OutOfMemoryError with the figures on failure.
  void* allocate(size_t nbytes, const Stream& s);
  /// Returns a block; it becomes reusable once the streams it was used on have finished with it.
  void deallocate(void* p);
  /// Marks a block as used on another stream, so it is not reused before that stream's work ends.
  void record_stream(void* p, const Stream& s);
  /// Withdraws a record_stream mark. Call it only once the block's own stream has been made to wait for
  /// everything queued on s so far and no further work using the block will be queued on s: the block
  /// then returns to its pool at once when freed (stream order already protects it), instead of waiting
  /// on a host-polled event. Unknown pointers and unmarked streams are ignored.
  void release_stream_use(void* p, const Stream& s);
  /// Returns cached blocks to the driver (pinned ones stay).
  void empty_cache();
  /// Keeps the block that starts at p (an address this allocator returned) from going back to the driver
  /// until as many unpin calls: empty_cache and the out-of-memory retry leave it cached, free or not. For
  /// memory another process has mapped (CUDA IPC). False, and nothing pinned, when p does not start a
  /// block of this allocator (a view's address, memory from elsewhere).
  bool pin(void* p);
  /// Withdraws one pin of p; unknown or unpinned addresses are ignored.
  void unpin(void* p);
  MemoryStats stats() const;
  void reset_peak_stats();
  Device device() const { return device_; }
  /// A limit on reserved bytes, below the card's memory (0 = none); allocations beyond it fail as OOM.
  void set_memory_limit(int64_t bytes);

  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

 private:
  explicit Allocator(Device d);
  struct Impl;
  Device device_;
  Impl* impl_;
};

/// Human-readable byte count ("1.50 GiB").
std::string format_bytes(int64_t bytes);

}  // namespace megacore
