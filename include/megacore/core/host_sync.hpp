// Host synchronisation accounting. Every point where the host waits for a device (a stream, event or device
// synchronize, a device→host copy the host then reads) goes through note_host_sync(), which counts it in one
// process-wide counter, by reason. The count is kept on CPU devices too (where the wait is a no-op), so a CPU
// test sees the same control flow as a GPU run: tests/cpp/train/test_host_syncs.cpp asserts the training
// step's documented minimum (docs/performance.md).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "megacore/core/tensor.hpp"

namespace megacore {

/// Counts one host synchronisation. `reason` names the call site's purpose (a string literal: it must
/// outlive the process); a HostSyncReason in scope overrides the generic reasons of the core primitives.
void note_host_sync(const char* reason);

/// Host synchronisations counted since start-up or the last reset_host_syncs(), over every thread.
int64_t host_sync_count();
/// The same count split by reason.
std::map<std::string, int64_t> host_sync_counts();
void reset_host_syncs();

/// Names the reason of the synchronisations the core primitives (Stream::synchronize, a device→host
/// copy, ...) count on this thread while it lives; nests (the innermost wins).
class HostSyncReason {
 public:
  explicit HostSyncReason(const char* reason);
  ~HostSyncReason();
  HostSyncReason(const HostSyncReason&) = delete;
  HostSyncReason& operator=(const HostSyncReason&) = delete;
  /// The reason in scope on this thread, or `fallback` when none is.
  static const char* current(const char* fallback);

 private:
  const char* previous_;
};

/// `t` on the host, read after the work queued on `s` (a device tensor is copied back and the host waits:
/// one counted sync; a host tensor is returned as it is and counted all the same).
Tensor read_to_host(const Tensor& t, const Stream& s, const char* reason);

/// The one value of a [1] tensor as a double (read_to_host, one counted sync).
double read_scalar(const Tensor& t, const Stream& s, const char* reason);

}  // namespace megacore
