#include "megacore/core/host_sync.hpp"

#include <atomic>
#include <mutex>

#include "megacore/core/error.hpp"

namespace megacore {

namespace {

// Process-wide by design: a test reads what every component did, whatever object did it.
struct Counter {
  std::atomic<int64_t> total{0};
  std::mutex mu;
  std::map<std::string, int64_t> by_reason;
};

Counter& counter() {
  static Counter c;
  return c;
}

thread_local const char* tls_reason = nullptr;

}  // namespace

void note_host_sync(const char* reason) {
  Counter& c = counter();
  c.total.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lk(c.mu);
  ++c.by_reason[reason ? reason : "unnamed"];
}

int64_t host_sync_count() { return counter().total.load(std::memory_order_relaxed); }

std::map<std::string, int64_t> host_sync_counts() {
  Counter& c = counter();
  std::lock_guard<std::mutex> lk(c.mu);
  return c.by_reason;
}

void reset_host_syncs() {
  Counter& c = counter();
  std::lock_guard<std::mutex> lk(c.mu);
  c.total.store(0, std::memory_order_relaxed);
  c.by_reason.clear();
}

HostSyncReason::HostSyncReason(const char* reason) : previous_(tls_reason) { tls_reason = reason; }
HostSyncReason::~HostSyncReason() { tls_reason = previous_; }
const char* HostSyncReason::current(const char* fallback) { return tls_reason ? tls_reason : fallback; }

Tensor read_to_host(const Tensor& t, const Stream& s, const char* reason) {
  MC_CHECK(t.defined(), "read_to_host({}): the tensor is undefined", reason);
  if (t.device().is_cuda()) {
    HostSyncReason r(reason);
    return t.to(Device::cpu(), s);  // counted by the copy
  }
  note_host_sync(reason);
  return t;
}

double read_scalar(const Tensor& t, const Stream& s, const char* reason) {
  MC_CHECK(t.defined() && t.numel() == 1, "read_scalar({}): needs a tensor with one element", reason);
  return read_to_host(t, s, reason).item();
}

}  // namespace megacore
