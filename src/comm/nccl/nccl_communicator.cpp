// NCCL backend of Communicator (CUDA tensors).
//
// The communicator is created non-blocking (unless CommOptions::nccl_blocking) so that neither
// init nor an enqueue can block the host forever: every call that returns ncclInProgress is polled
// with ncclCommGetAsyncError under the timeout, and Work::wait() polls a CUDA event recorded after
// the operation together with the async error. On error or timeout the communicator is aborted
// (ncclCommAbort, which also stops kernels stuck waiting for a peer) and CommError is thrown.
#include "megacore/comm/nccl_communicator.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "comm/comm_detail.hpp"
#include "comm/nccl/peer_copy.hpp"
#include "megacore/core/log.hpp"
#include "megacore/core/allocator.hpp"
#include "megacore/core/host_sync.hpp"
#include "core/cuda/cuda_check.hpp"

namespace megacore::comm {
namespace {

using Clock = std::chrono::steady_clock;
using cuda_impl::DeviceGuard;
using cuda_impl::QuietDeviceGuard;
using namespace detail;

std::string nccl_error(ncclResult_t r, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  return fmt::format("{} ({}){}{}", ncclGetErrorString(r), int(r), last && *last ? ": " : "", last ? last : "");
}

#define MC_NCCL_CHECK(expr)                                                                        \
  do {                                                                                             \
    ncclResult_t mc_r_ = (expr);                                                                   \
    if (mc_r_ != ncclSuccess && mc_r_ != ncclInProgress)                                           \
      ::megacore::raise<::megacore::CommError>("{} failed: {}", #expr, nccl_error(mc_r_, nullptr)); \
  } while (0)

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::F32: return ncclFloat32;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    case DType::U8:
    case DType::F8E4M3:
    case DType::F8E5M2: return ncclUint8;  // FP8 moves as raw bytes (reductions are refused before)
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

// Host polling cadence: the first ~64 polls spin (an enqueue or a small collective usually finishes within
// tens of microseconds, and a sleep costs 50–100 µs of timer slack each time, which is what made every
// host-waited collective cost 150–220 µs more than raw NCCL), then the sleeps grow by 20 µs up to 1 ms.
struct Backoff {
  int spins = 0;
  std::chrono::microseconds sleep{0};
  void pause() {
    if (spins < 64) {
      ++spins;
      return;
    }
    sleep = std::min(std::chrono::microseconds(1000), sleep + std::chrono::microseconds(20));
    std::this_thread::sleep_for(sleep);
  }
};

// Polls the communicator's state until it leaves ncclInProgress or `deadline` passes.
// Returns the state (ncclInProgress on timeout).
// A set `stop` flag (the state's `aborting`) ends the wait early with ncclInProgress, so a thread polling
// under the state's lock lets go of it as soon as an abort is claimed.
ncclResult_t poll_state(ncclComm_t comm, Clock::time_point deadline, const std::atomic<bool>* stop = nullptr) {
  Backoff backoff;
  for (;;) {
    if (stop && stop->load()) return ncclInProgress;
    ncclResult_t st = ncclInProgress;
    ncclResult_t r = ncclCommGetAsyncError(comm, &st);
    if (r != ncclSuccess) return r;
    if (st != ncclInProgress) return st;
    if (Clock::now() > deadline) return ncclInProgress;
    backoff.pause();
  }
}

ncclConfig_t make_config(const CommOptions& o, const std::string& name) {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = o.nccl_blocking ? 1 : 0;
  cfg.commName = name.c_str();
  if (o.nccl_min_ctas > 0) cfg.minCTAs = o.nccl_min_ctas;
  if (o.nccl_max_ctas > 0) cfg.maxCTAs = o.nccl_max_ctas;
#if defined(NCCL_CTA_POLICY_ZERO)
  if (o.nccl_cta_policy == 1) cfg.CTAPolicy = NCCL_CTA_POLICY_EFFICIENCY;
  if (o.nccl_cta_policy == 2) cfg.CTAPolicy = NCCL_CTA_POLICY_ZERO;
#else
  MC_CHECK(o.nccl_cta_policy == 0, "CommOptions.nccl_cta_policy {} needs NCCL >= 2.28 (built against {}.{}); use 0",
           o.nccl_cta_policy, NCCL_MAJOR, NCCL_MINOR);
#endif
  return cfg;
}

void check_options(const CommOptions& o) {
  MC_CHECK(o.timeout.count() > 0, "CommOptions.timeout must be positive, got {} ms", o.timeout.count());
  MC_CHECK(o.nccl_min_ctas >= 0 && o.nccl_max_ctas >= 0, "CommOptions.nccl_min_ctas/nccl_max_ctas must be >= 0");
  MC_CHECK(o.nccl_min_ctas == 0 || o.nccl_max_ctas == 0 || o.nccl_min_ctas <= o.nccl_max_ctas,
           "CommOptions.nccl_min_ctas ({}) exceeds nccl_max_ctas ({})", o.nccl_min_ctas, o.nccl_max_ctas);
  MC_CHECK(o.nccl_cta_policy >= 0 && o.nccl_cta_policy <= 2,
           "CommOptions.nccl_cta_policy must be 0 (default), 1 (efficiency) or 2 (zero), got {}", o.nccl_cta_policy);
}

struct NcclState {
  ncclComm_t comm = nullptr;
  int device = 0;
  std::string name;  // backs ncclConfig_t::commName
  std::chrono::milliseconds timeout{0};
  // Held by the calling thread around every NCCL call on `comm`, so that an abort never frees the
  // communicator under a call. A call stuck inside NCCL (a blocking enqueue waiting for a dead peer)
  // keeps it: the watchdog then aborts without it, since ncclCommAbort is what makes that call return;
  // every path that holds `mu` re-checks `aborting` after its NCCL call and then leaves `comm` alone.
  std::timed_mutex mu;
  std::atomic<bool> aborting{false};  // claimed by the one abort that runs
  std::atomic<bool> aborted{false};   // the abort has been issued
  // The NCCL call in progress on the calling thread (for the watchdog): its start (0 when none) and name
  // (the caller's string, alive until the call ends, which clears it under call_mu).
  std::mutex call_mu;
  int64_t call_start_ns = 0;
  std::string_view call_what;
  std::mutex reason_mu;
  std::string abort_reason;
  // Run by the abort after `before` (the copy-engine collectives' release of their flags, so that a stream
  // waiting for a dead peer goes on); set and cleared by the communicator under hook_mu.
  std::mutex hook_mu;
  std::function<void()> abort_hook;

  ~NcclState() {
    if (!comm || aborting.load()) return;
    // Normally shut down by ~NcclCommunicator (shutdown()); this is the fallback for a state whose last
    // user is a Work: never wait for peers here (this may run on any thread), just abort locally.
    ncclCommAbort(comm);
  }

  std::string reason() {
    std::lock_guard<std::mutex> l(reason_mu);
    return abort_reason;
  }

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  }

  // RAII bracket of an NCCL call made under `mu`, for the watchdog's stuck-call check.
  struct CallScope {
    NcclState& st;
    CallScope(NcclState& s, std::string_view what) : st(s) {
      std::lock_guard<std::mutex> l(st.call_mu);
      st.call_what = what;
      st.call_start_ns = now_ns();
    }
    ~CallScope() {
      std::lock_guard<std::mutex> l(st.call_mu);
      st.call_start_ns = 0;
      st.call_what = {};
    }
  };
  // Seconds the current call has been running (0 when none), and its name.
  double call_seconds(std::string* what) {
    std::lock_guard<std::mutex> l(call_mu);
    if (call_start_ns == 0) return 0.0;
    *what = std::string(call_what);
    return double(now_ns() - call_start_ns) * 1e-9;
  }

  // The communicator's asynchronous error state (ncclSuccess, ncclInProgress or an error); ncclInvalidUsage
  // once aborting; ncclInProgress when `mu` is busy and `wait` is false (the watchdog does not queue behind
  // a call in progress).
  ncclResult_t async_error(bool wait = true) {
    std::unique_lock<std::timed_mutex> l(mu, std::defer_lock);
    if (wait) l.lock();
    else if (!l.try_lock()) return ncclInProgress;
    if (!comm || aborting.load()) return ncclInvalidUsage;
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &st);
    return r != ncclSuccess ? r : st;
  }

  // Aborts once with `reason`; false when another abort got there first. `before` runs after the claim and
  // before ncclCommAbort (the watchdog records the reason there, so that whoever is released by the abort
  // finds it). Never call it while holding `mu`.
  bool abort_now(std::string reason, const std::function<void()>& before = {}) {
    if (aborting.exchange(true)) return false;
    {
      std::lock_guard<std::mutex> l(reason_mu);
      abort_reason = std::move(reason);
    }
    if (before) before();
    {
      std::lock_guard<std::mutex> hl(hook_mu);
      if (abort_hook) abort_hook();
    }
    // Polling loops under `mu` see `aborting` and let go within a poll; only a call stuck inside NCCL keeps
    // the lock past that.
    std::unique_lock<std::timed_mutex> l(mu, std::defer_lock);
    const bool locked = l.try_lock_for(std::chrono::seconds(2));
    if (comm) {
      QuietDeviceGuard g(device);
      ncclCommAbort(comm);
      if (locked) comm = nullptr;  // else the stuck call's thread still holds it; it never uses it again
    }
    aborted.store(true);
    return true;
  }

  // Orderly teardown from the communicator's destructor: finalize (waits for outstanding operations) under
  // the watchdog's stuck-call check, then destroy; abort when it fails or the watchdog aborted meanwhile.
  void shutdown() {
    std::lock_guard<std::timed_mutex> l(mu);
    if (!comm || aborting.load()) return;
    QuietDeviceGuard g(device);
    ncclResult_t r;
    {
      CallScope c(*this, "finalize");
      r = ncclCommFinalize(comm);
      if (r == ncclInProgress || r == ncclSuccess) r = poll_state(comm, Clock::now() + timeout, &aborting);
    }
    if (aborting.exchange(true)) return;  // the watchdog aborted it (and owns the teardown)
    if (r == ncclSuccess) ncclCommDestroy(comm);
    else ncclCommAbort(comm);
    comm = nullptr;
    aborted.store(true);
    std::lock_guard<std::mutex> rl(reason_mu);
    abort_reason = "the communicator was destroyed";
  }
};

// Completion events are reused (cudaEventCreate costs about a microsecond per operation otherwise).
class EventPool {
 public:
  static cudaEvent_t get(int device) {
    {
      std::lock_guard<std::mutex> l(mu());
      auto& v = free()[device];
      if (!v.empty()) {
        cudaEvent_t e = v.back();
        v.pop_back();
        return e;
      }
    }
    DeviceGuard g(device);
    cudaEvent_t e = nullptr;
    MC_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  static void put(int device, cudaEvent_t e) {
    std::lock_guard<std::mutex> l(mu());
    free()[device].push_back(e);
  }

 private:
  static std::mutex& mu() {
    static std::mutex* m = new std::mutex();
    return *m;
  }
  static std::map<int, std::vector<cudaEvent_t>>& free() {
    static auto* f = new std::map<int, std::vector<cudaEvent_t>>();  // never destroyed (used at exit)
    return *f;
  }
};

// Tensors whose release must not run on the watchdog thread: external memory (DLPack, from_blob) may run
// a callback that needs the Python GIL, which a thread waiting for the watchdog (a communicator's
// destructor joining it) can hold. They are released by calling threads instead (drain_deferred).
std::mutex g_deferred_mu;
std::vector<Tensor>* g_deferred = new std::vector<Tensor>();  // never destroyed (used at exit)

void defer_release(std::vector<Tensor>&& ts) {
  if (ts.empty()) return;
  std::lock_guard<std::mutex> l(g_deferred_mu);
  for (Tensor& t : ts) g_deferred->push_back(std::move(t));
  ts.clear();
}

void drain_deferred() {
  std::vector<Tensor> ts;
  {
    std::lock_guard<std::mutex> l(g_deferred_mu);
    if (g_deferred->empty()) return;
    ts.swap(*g_deferred);
  }
  // ts goes out of scope here, on the calling thread.
}

// The failure reasons of an enqueued operation, the same whether a waiting thread or the watchdog finds them.
std::string op_timeout_reason(const std::string& context, double elapsed, std::chrono::milliseconds timeout,
                              bool by_watchdog) {
  return fmt::format("{} timed out after {:.1f} s (timeout {:.1f} s{}): not every rank of the group joined it (a rank "
                     "skipped it, posted a different operation, or died); the communicator is aborted",
                     context, elapsed, timeout.count() / 1000.0, by_watchdog ? ", found by the watchdog" : "");
}
std::string op_cuda_error_reason(const std::string& context, cudaError_t e) {
  return fmt::format("{} failed: CUDA error {} ({})", context, cudaGetErrorName(e), cudaGetErrorString(e));
}

// One enqueued operation: its completion event, when it was enqueued, and the external-memory tensors it
// uses (kept alive until it has finished, so a stream-ordered wait can drop its Work at once; memory of
// megacore's allocator is instead marked as used on the operation's stream, see protect_buffers).
struct PendingOp {
  std::weak_ptr<NcclState> st;
  int device = 0;
  cudaEvent_t event = nullptr;
  cudaStream_t stream = nullptr;
  Clock::time_point start;
  std::string context;
  std::vector<Tensor> keep;
  std::atomic<bool> finished{false};
  std::shared_ptr<FlightRecorder> flight;  // told when the op is seen finished
  uint64_t flight_id = 0;

  ~PendingOp() {
    if (event) EventPool::put(device, event);
    defer_release(std::move(keep));  // whatever thread this is, external memory is released elsewhere
  }
  // Marks the op finished (its event completed) and hands its tensors over for release.
  void finish() {
    if (finished.exchange(true)) return;
    if (flight) flight->done(flight_id);
    defer_release(std::move(keep));
  }
};

// Reasons of the watchdog's aborts not yet reported by check_health().
std::mutex g_unreported_mu;
std::vector<std::string>* g_unreported = new std::vector<std::string>();  // never destroyed (used at exit)

// The watchdog: one thread that follows every live NCCL communicator and every operation enqueued on
// one until its event completes, so that operations nobody host-waits (Work::wait_on) and calls stuck
// inside NCCL still get the timeout and the error checks. When an operation has been pending, or a call
// has been running, longer than its communicator's timeout, or NCCL reports an asynchronous error, it
// aborts that communicator (ncclCommAbort stops the kernels stuck on it, so streams waiting for them
// move on, and makes a stuck call return) and records why: the next operation or wait on the
// communicator throws CommError with that reason, and check_health() reports it. Operations of an
// aborted communicator are followed until their events complete (their buffers stay protected until
// the abort has really stopped the kernels). It runs while at least one NCCL communicator exists, polls
// every millisecond while operations are pending and every 50 ms otherwise; it never releases external
// memory itself and survives any exception.
class Watchdog {
 public:
  static Watchdog& get() {
    static Watchdog* w = new Watchdog();  // never destroyed: the thread is joined when the last communicator goes
    return *w;
  }

  void add_communicator(const std::shared_ptr<NcclState>& st) {
    std::lock_guard<std::mutex> l(mu_);
    states_.push_back(st);
    if (users_++ == 0) {
      // A fresh stop token per thread: a thread being stopped by remove_communicator never sees this one.
      stop_ = std::make_shared<std::atomic<bool>>(false);
      threads_.emplace_back([this, stop = stop_] { run(stop); });
    }
  }

  void remove_communicator() {
    std::vector<std::thread> done;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (--users_ > 0) return;
      stop_->store(true);
      done.swap(threads_);
    }
    cv_.notify_all();
    for (std::thread& t : done)
      if (t.joinable()) t.join();
  }

  void watch(std::shared_ptr<PendingOp> op) {
    bool wake;
    {
      std::lock_guard<std::mutex> l(mu_);
      wake = pending_.empty() && idle_;
      pending_.push_back(std::move(op));
    }
    if (wake) cv_.notify_one();
  }

 private:
  void run(std::shared_ptr<std::atomic<bool>> stop) {
    std::vector<std::shared_ptr<PendingOp>> mine;
    while (!stop->load()) {
      std::vector<std::weak_ptr<NcclState>> states;
      {
        std::unique_lock<std::mutex> l(mu_);
        idle_ = mine.empty();
        cv_.wait_for(l, std::chrono::milliseconds(mine.empty() ? 50 : 1),
                     [&] { return stop->load() || (idle_ && !pending_.empty()); });
        idle_ = false;
        if (stop->load()) break;
        for (auto& p : pending_) mine.push_back(std::move(p));
        pending_.clear();
        states_.erase(std::remove_if(states_.begin(), states_.end(), [](const auto& w) { return w.expired(); }),
                      states_.end());
        states = states_;
      }
      try {
        pass(mine, states);
      } catch (...) {
        // Keep watching: a failure here (out of memory formatting a message) must not end the process.
      }
    }
    // Stopping (no communicator left): unfinished operations are handed back, never released here.
    std::lock_guard<std::mutex> l(mu_);
    for (auto& p : mine) pending_.push_back(std::move(p));
  }

  void pass(std::vector<std::shared_ptr<PendingOp>>& mine, const std::vector<std::weak_ptr<NcclState>>& states) {
    // Decide first, abort afterwards (abort_now may wait for a state's lock).
    std::vector<std::pair<std::shared_ptr<NcclState>, std::string>> aborts;
    auto abort_later = [&](std::shared_ptr<NcclState> st, std::string why) {
      for (auto& [s, w] : aborts)
        if (s == st) return;
      aborts.emplace_back(std::move(st), std::move(why));
    };
    // Calls stuck inside NCCL.
    for (const auto& w : states) {
      std::shared_ptr<NcclState> st = w.lock();
      if (!st || st->aborting.load()) continue;
      std::string what;
      const double s = st->call_seconds(&what);
      if (s * 1000.0 > double(st->timeout.count()))
        abort_later(st, fmt::format("{} has been inside NCCL for {:.1f} s (timeout {:.1f} s, found by the watchdog): "
                                    "a peer it needs (connection setup, a blocking call) never came; the "
                                    "communicator is aborted",
                                    what, s, st->timeout.count() / 1000.0));
    }
    std::vector<NcclState*> error_checked;
    // Events recorded on one stream complete in order, and `mine` keeps the enqueue order: once an op's event
    // is not ready, the later ops of its stream are not either, and their events are not queried in this
    // pass. With the host a whole step ahead that is one query per busy stream instead of one per op (each
    // query takes the driver's locks, which the launching thread needs too).
    std::vector<std::pair<int, cudaStream_t>> busy_streams;
    size_t kept = 0;
    for (size_t i = 0; i < mine.size(); ++i) {
      PendingOp& op = *mine[i];
      std::shared_ptr<NcclState> st = op.st.lock();
      bool drop = op.finished.load();
      if (!drop) {
        const std::pair<int, cudaStream_t> key{op.device, op.stream};
        cudaError_t e = cudaErrorNotReady;
        if (std::find(busy_streams.begin(), busy_streams.end(), key) == busy_streams.end()) {
          QuietDeviceGuard g(op.device);
          e = cudaEventQuery(op.event);
          if (e == cudaErrorNotReady) busy_streams.push_back(key);
        }
        if (e == cudaSuccess) {
          op.finish();
          drop = true;
        } else if (e != cudaErrorNotReady) {
          (void)cudaGetLastError();
          if (st && !st->aborting.load())
            abort_later(st, op_cuda_error_reason(op.context, e));
          drop = true;  // the event will never tell more
        } else if (st && !st->aborting.load()) {
          const double elapsed = seconds_since(op.start);
          if (elapsed * 1000.0 > double(st->timeout.count())) {
            abort_later(st, op_timeout_reason(op.context, elapsed, st->timeout, /*by_watchdog=*/true));
          } else if (std::find(error_checked.begin(), error_checked.end(), st.get()) == error_checked.end()) {
            error_checked.push_back(st.get());
            const ncclResult_t r = st->async_error(/*wait=*/false);
            if (r != ncclSuccess && r != ncclInProgress && !st->aborting.load())
              abort_later(st, fmt::format("{} failed after {:.1f} s (found by the watchdog): {}", op.context, elapsed,
                                          nccl_error(r, nullptr)));
          }
        }
        // An op of an aborted (or destroyed) communicator stays until its event completes: the abort stops
        // its kernels, and until then its buffers must stay protected.
      }
      if (!drop) {
        if (kept != i) mine[kept] = std::move(mine[i]);
        ++kept;
      }
    }
    mine.resize(kept);
    for (auto& [st, why] : aborts) {
      const std::string full = fmt::format("group '{}': {}", st->name, why);
      const bool won = st->abort_now(why, [&] {
        // Recorded before ncclCommAbort: the abort is what lets a host synchronisation return, and
        // check_health() right after it must see the reason.
        std::lock_guard<std::mutex> l(g_unreported_mu);
        g_unreported->push_back(full);
      });
      if (won) fmt::print(stderr, "megacore: {}\n", full);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<PendingOp>> pending_;
  std::vector<std::weak_ptr<NcclState>> states_;
  std::vector<std::thread> threads_;
  std::shared_ptr<std::atomic<bool>> stop_;
  int users_ = 0;
  bool idle_ = false;
};

// Registers a communicator's state with the watchdog for the communicator's lifetime.
struct WatchdogUser {
  explicit WatchdogUser(const std::shared_ptr<NcclState>& st) { Watchdog::get().add_communicator(st); }
  ~WatchdogUser() { Watchdog::get().remove_communicator(); }
  WatchdogUser(const WatchdogUser&) = delete;
  WatchdogUser& operator=(const WatchdogUser&) = delete;
};

// The buffers of an operation must not be reused before it has finished. Blocks of megacore's allocator
// are marked as used on the operation's stream (Allocator::record_stream: a freed block returns to its
// pool once that stream has passed the free), so they are released as soon as their owners drop them, in
// stream order; holding them until the watchdog sees the op complete would let a host that runs ahead
// of the device pile up activation-sized buffers. Anything else (DLPack, from_blob) is returned to be
// held until the operation has finished. `stream` is the caller's Stream object (it owns the CUDA stream,
// so the allocator's record of it stays valid).
std::vector<Tensor> protect_buffers(std::vector<Tensor> tensors, int device, const Stream& stream) {
  std::vector<Tensor> held;
  const Device dev = Device::cuda(device);
  for (Tensor& t : tensors) {
    const auto& st = t.storage();
    if (!st || !st->data()) continue;
    bool recorded = false;
    if (st->owned() && st->device() == dev) {
      try {
        Allocator::get(dev).record_stream(st->data(), stream);
        recorded = true;
      } catch (const std::exception&) {
        recorded = false;  // not a block the allocator knows: hold it instead
      }
    }
    if (!recorded) held.push_back(std::move(t));
  }
  return held;
}

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclState> st, std::string context, const Stream& stream, std::vector<Tensor> keep,
           Clock::time_point start, std::shared_ptr<FlightRecorder> flight, uint64_t flight_id)
      : st_(std::move(st)), op_(std::make_shared<PendingOp>()) {
    op_->st = st_;
    op_->flight = std::move(flight);
    op_->flight_id = flight_id;
    op_->device = st_->device;
    op_->stream = static_cast<cudaStream_t>(stream.native());
    op_->start = start;
    op_->context = std::move(context);
    op_->keep = protect_buffers(std::move(keep), st_->device, stream);
    op_->event = EventPool::get(st_->device);
    DeviceGuard g(st_->device);
    MC_CUDA_CHECK(cudaEventRecord(op_->event, op_->stream));
    Watchdog::get().watch(op_);
  }

  bool is_completed() override {
    if (done_) return true;
    try {
      return poll();
    } catch (const std::exception&) {
      return true;  // the failure is reported by wait()
    }
  }

  void wait() override {
    note_host_sync(HostSyncReason::current("collective_wait"));
    Backoff backoff;
    while (!poll()) {
      double elapsed = seconds_since(op_->start);
      if (elapsed * 1000.0 > double(st_->timeout.count())) {
        fail(op_timeout_reason(op_->context, elapsed, st_->timeout, /*by_watchdog=*/false));
      }
      backoff.pause();
    }
    drain_deferred();
    if (!error_.empty()) throw CommError(error_);
  }

  void wait_on(const Stream& s) override {
    if (!error_.empty()) throw CommError(error_);
    if (st_->aborting.load())
      fail_aborted();
    cudaStream_t target = nullptr;
    if (!s.device().is_cpu()) {
      MC_CHECK(s.device() == Device::cuda(st_->device), "{}: wait_on got a stream on {}, but the operation runs on "
               "cuda:{}; pass a stream of the communicator's device", op_->context, s.device().str(), st_->device);
      target = static_cast<cudaStream_t>(s.native());
    }
    if (done_ || target == op_->stream) return;  // stream order already holds
    DeviceGuard g(st_->device);
    MC_CUDA_CHECK(cudaStreamWaitEvent(target, op_->event, 0));
  }

 private:
  // True once finished (successfully or with error_ set); throws CommError on a new failure.
  bool poll() {
    if (done_) return true;
    if (st_->aborting.load())
      fail_aborted();
    cudaError_t e = cudaEventQuery(op_->event);
    if (e == cudaSuccess) {
      done_ = true;
      op_->finish();
      return true;
    }
    if (e != cudaErrorNotReady) {
      (void)cudaGetLastError();
      fail(op_cuda_error_reason(op_->context, e));
    }
    ncclResult_t st = st_->async_error();
    if (st != ncclSuccess && st != ncclInProgress) {
      if (st_->aborting.load())
        fail_aborted();
      fail(fmt::format("{} failed after {:.1f} s: {}", op_->context, seconds_since(op_->start),
                       nccl_error(st, nullptr)));
    }
    return false;
  }

  [[noreturn]] void fail_aborted() {
    fail(fmt::format("{} failed: the communicator was aborted ({})", op_->context, st_->reason()));
  }

  [[noreturn]] void fail(std::string msg) {
    done_ = true;
    error_ = msg;
    st_->abort_now(msg);
    // The buffers may still be in use by kernels the abort is tearing down: the op (and the watchdog's
    // reference to it) keeps them until its event completes.
    throw CommError(msg);
  }

  std::shared_ptr<NcclState> st_;
  std::shared_ptr<PendingOp> op_;
  bool done_ = false;
  std::string error_;
};

class NcclCommunicator final : public Communicator {
 public:
  // Takes ownership of an initialised communicator.
  NcclCommunicator(std::shared_ptr<NcclState> st, const CommOptions& options, std::vector<int> world_ranks)
      : st_(std::move(st)), watchdog_(st_) {
    options_ = options;
    MC_NCCL_CHECK(ncclCommUserRank(st_->comm, &rank_));
    MC_NCCL_CHECK(ncclCommCount(st_->comm, &size_));
    world_ranks_ = std::move(world_ranks);
    MC_CHECK_AS(CommError, int(world_ranks_.size()) == size_, "NCCL communicator '{}' has {} ranks, expected {}",
                options_.name, size_, world_ranks_.size());
    flight_ = FlightRecorder::create(options_.name, world_ranks_, rank_);
    // Creation is collective over the group, so the copy engines' setup (which exchanges IPC handles) happens
    // here, not at a first send/receive batch that only some ranks of the group may issue.
    if (options_.copy_engine) peer_copy();
  }

  // Orderly teardown on the owner's thread (finalize under the watchdog's stuck-call check, then destroy),
  // so it never happens on the watchdog thread through a Work that outlives the communicator.
  ~NcclCommunicator() override {
    try {
      st_->shutdown();
    } catch (...) {
    }
    {
      std::lock_guard<std::mutex> hl(st_->hook_mu);
      st_->abort_hook = nullptr;
    }
    peer_copy_.reset();  // after the device has finished every operation (its destructor synchronises)
    drain_deferred();
  }

  Backend backend() const override { return Backend::NCCL; }
  Device device() const override { return Device::cuda(st_->device); }
  bool copy_engine_active() const override { return peer_copy_ != nullptr; }

  WorkPtr all_reduce(Tensor& t, ReduceOp op, const Stream& s) override {
    constexpr std::string_view name = "all_reduce";
    usable(name);
    check_tensor(*this, name, "t", t, device());
    const Stream sobj = stream_of(s, name);
    cudaStream_t stream = static_cast<cudaStream_t>(sobj.native());
    OpSignature sig{int64_t(OpKind::AllReduce), int64_t(t.dtype()), t.numel(), int64_t(op)};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, nullptr);
    return enqueue(what, sobj, {t}, [&] {
      return ncclAllReduce(t.data_ptr(), t.data_ptr(), size_t(t.numel()), nccl_type(t.dtype()), nccl_op(op),
                           st_->comm, stream);
    });
  }

  WorkPtr all_gather(const Tensor& in, Tensor& out, const Stream& s) override {
    constexpr std::string_view name = "all_gather";
    usable(name);
    check_tensor(*this, name, "in", in, device());
    check_tensor(*this, name, "out", out, device());
    check_same_dtype(*this, name, in, out);
    MC_CHECK(out.numel() == in.numel() * size_,
             "all_gather on group '{}': out has {} elements, need size() * in.numel() = {} * {} = {}", options_.name,
             out.numel(), size_, in.numel(), in.numel() * size_);
    const Stream sobj = stream_of(s, name);
    cudaStream_t stream = static_cast<cudaStream_t>(sobj.native());
    OpSignature sig{int64_t(OpKind::AllGather), int64_t(in.dtype()), in.numel(), 0};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, nullptr);
    if (detail::PeerCopy* pc = peer_copy(); pc && in.numel() > 0) {
      return enqueue(what, sobj, {in, out}, [&] {
        return ce_result(pc->all_gather(in.data_ptr(), out.data_ptr(), size_t(in.nbytes()), stream));
      });
    }
    return enqueue(what, sobj, {in, out}, [&] {
      return ncclAllGather(in.data_ptr(), out.data_ptr(), size_t(in.numel()), nccl_type(in.dtype()), st_->comm,
                           stream);
    });
  }

  WorkPtr reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op, const Stream& s) override {
    constexpr std::string_view name = "reduce_scatter";
    usable(name);
    check_tensor(*this, name, "in", in, device());
    check_tensor(*this, name, "out", out, device());
    check_same_dtype(*this, name, in, out);
    MC_CHECK(in.numel() == out.numel() * size_,
             "reduce_scatter on group '{}': in has {} elements, need size() * out.numel() = {} * {} = {}",
             options_.name, in.numel(), size_, out.numel(), out.numel() * size_);
    const Stream sobj = stream_of(s, name);
    cudaStream_t stream = static_cast<cudaStream_t>(sobj.native());
    OpSignature sig{int64_t(OpKind::ReduceScatter), int64_t(out.dtype()), out.numel(), int64_t(op)};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, nullptr);
    if (op == ReduceOp::Sum && detail::PeerCopy::sums(out.dtype())) {
      if (detail::PeerCopy* pc = peer_copy(); pc && out.numel() > 0) {
        return enqueue(what, sobj, {in, out}, [&] {
          return ce_result(pc->reduce_scatter_sum(in.data_ptr(), out.data_ptr(), out.numel(), out.dtype(), stream));
        });
      }
    }
    return enqueue(what, sobj, {in, out}, [&] {
      return ncclReduceScatter(in.data_ptr(), out.data_ptr(), size_t(out.numel()), nccl_type(in.dtype()),
                               nccl_op(op), st_->comm, stream);
    });
  }

  WorkPtr broadcast(Tensor& t, int root, const Stream& s) override {
    constexpr std::string_view name = "broadcast";
    usable(name);
    check_tensor(*this, name, "t", t, device());
    check_root(*this, name, root);
    const Stream sobj = stream_of(s, name);
    cudaStream_t stream = static_cast<cudaStream_t>(sobj.native());
    OpSignature sig{int64_t(OpKind::Broadcast), int64_t(t.dtype()), t.numel(), root};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, nullptr);
    return enqueue(what, sobj, {t}, [&] {
      return ncclBroadcast(t.data_ptr(), t.data_ptr(), size_t(t.numel()), nccl_type(t.dtype()), root, st_->comm,
                           stream);
    });
  }

  WorkPtr all_to_all(const Tensor& in, Tensor& out, const std::vector<int64_t>& send_counts,
                     const std::vector<int64_t>& recv_counts, const Stream& s) override {
    constexpr std::string_view name = "all_to_all";
    usable(name);
    check_tensor(*this, name, "in", in, device());
    check_tensor(*this, name, "out", out, device());
    check_same_dtype(*this, name, in, out);
    AllToAllLayout l = all_to_all_layout(*this, in, out, send_counts, recv_counts);
    const Stream sobj = stream_of(s, name);
    cudaStream_t stream = static_cast<cudaStream_t>(sobj.native());
    OpSignature sig{int64_t(OpKind::AllToAll), int64_t(in.dtype()), size_, 0};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, &l);
    const int64_t es = in.element_size();
    const ncclDataType_t ty = nccl_type(in.dtype());
    char* src = static_cast<char*>(in.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    // Grouped send/recv pairs handle uneven splits (ncclAlltoAll, 2.28.3+, is even-only).
    return enqueue_group(what, sobj, {in, out}, [&]() -> ncclResult_t {
      // Empty transfers are skipped on both sides alike (rank r's send count to p is p's receive
      // count from r), so no rank waits for a message that never comes.
      for (int p = 0; p < size_; ++p) {
        ncclResult_t r = ncclSuccess;
        if (l.send_counts[p] > 0)
          r = ncclSend(src + l.send_offsets[p] * es, size_t(l.send_counts[p]), ty, p, st_->comm, stream);
        if (r == ncclSuccess && l.recv_counts[p] > 0)
          r = ncclRecv(dst + l.recv_offsets[p] * es, size_t(l.recv_counts[p]), ty, p, st_->comm, stream);
        if (r != ncclSuccess) return r;
      }
      return ncclSuccess;
    });
  }

  WorkPtr batch_send_recv(const std::vector<P2POp>& ops, const Stream& s) override {
    constexpr std::string_view name = "batch_send_recv";
    usable(name);
    std::vector<Tensor> keep;
    for (const auto& op : ops) {
      check_tensor(*this, name, op.kind == P2POp::Send ? "a send tensor" : "a recv tensor", op.tensor, device());
      MC_CHECK(op.peer >= 0 && op.peer < size_, "batch_send_recv on group '{}': peer {} is out of range [0, {})",
               options_.name, op.peer, size_);
      keep.push_back(op.tensor);
    }
    const Stream sobj = stream_of(s, name);
    cudaStream_t stream = static_cast<cudaStream_t>(sobj.native());
    FlightPeers peers;  // for the flight record (the watchdog names them when the batch hangs)
    for (const auto& op : ops) peers.add(op.kind == P2POp::Send, op.peer);
    if (detail::PeerCopy* pc = peer_copy()) {
      std::vector<detail::PeerCopyTransfer> transfers;
      for (const auto& op : ops)
        transfers.push_back({op.kind == P2POp::Send, op.peer, op.tensor.data_ptr(), size_t(op.tensor.nbytes())});
      const std::string what = fmt::format("batch_send_recv ({} ops, copy engines)", ops.size());
      // The host half (peer_copy.hpp): post the sends' addresses, wait for the receives' (timed out, abortable).
      const std::string err =
          pc->post_and_match(transfers, options_.timeout, [this] { return st_->aborting.load(); });
      if (!err.empty()) {
        usable(what);  // throws when the communicator was aborted meanwhile, with the abort's reason
        const std::string msg = fmt::format("{}: {}; the communicator is aborted", error_context(*this, what), err);
        st_->abort_now(msg);
        throw CommError(msg);
      }
      // Transfers whose send tensor is not the caching allocator's were marked by both sides: NCCL moves them,
      // in the batch's order, after the copy engines' part is enqueued.
      const bool any_nccl =
          std::any_of(transfers.begin(), transfers.end(), [](const detail::PeerCopyTransfer& t) { return t.nccl; });
      auto copy_engines = [&] { return ce_result(pc->send_recv(transfers, stream)); };
      if (!any_nccl) return enqueue(what, sobj, std::move(keep), copy_engines, &peers);
      return enqueue_group(what, sobj, std::move(keep), &peers, [&]() -> ncclResult_t {
        ncclResult_t r = copy_engines();
        for (const detail::PeerCopyTransfer& t : transfers) {
          if (!t.nccl || r != ncclSuccess) continue;
          r = t.send ? ncclSend(t.data, t.bytes, ncclUint8, t.peer, st_->comm, stream)
                     : ncclRecv(t.data, t.bytes, ncclUint8, t.peer, st_->comm, stream);
        }
        return r;
      });
    }
    return enqueue_group(fmt::format("batch_send_recv ({} ops)", ops.size()), sobj, std::move(keep), &peers,
                         [&]() -> ncclResult_t {
                           for (const auto& op : ops) {
                             if (op.tensor.numel() == 0) continue;  // the peer's matching op is empty too
                             void* p = op.tensor.data_ptr();
                             size_t n = size_t(op.tensor.numel());
                             ncclDataType_t ty = nccl_type(op.tensor.dtype());
                             ncclResult_t r = op.kind == P2POp::Send ? ncclSend(p, n, ty, op.peer, st_->comm, stream)
                                                                     : ncclRecv(p, n, ty, op.peer, st_->comm, stream);
                             if (r != ncclSuccess) return r;
                           }
                           return ncclSuccess;
                         });
  }

  void barrier() override {
    usable("barrier");
    if (!barrier_buf_.defined()) barrier_buf_ = Tensor::zeros({1}, DType::F32, device());
    OpSignature sig{int64_t(OpKind::Barrier), -1, 0, 0};
    if (options_.check_shapes) agree(sig, "barrier", nullptr);
    Tensor& t = barrier_buf_;
    enqueue("barrier", Stream::default_stream(device()), {t}, [&] {
      return ncclAllReduce(t.data_ptr(), t.data_ptr(), 1, ncclFloat32, ncclSum, st_->comm, cudaStream_t(nullptr));
    })->wait();
  }

  std::unique_ptr<Communicator> split(int color, int key, const CommOptions& options) override {
    usable("split");
    check_options(options);
    // Everyone's (color, key), gathered under the timeout: proves all ranks entered split (so
    // ncclCommSplit cannot wait forever) and gives the world ranks of the new group.
    std::vector<int64_t> mine{color < 0 ? -1 : color, key};
    std::vector<int64_t> all = gather_host(mine, "split");
    std::vector<int> members;
    if (color >= 0) {
      for (int r = 0; r < size_; ++r)
        if (all[2 * r] == color) members.push_back(r);
      std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return all[2 * a + 1] < all[2 * b + 1]; });
    }
    auto st = std::make_shared<NcclState>();
    st->device = st_->device;
    st->name = options.name;
    st->timeout = options.timeout;
    ncclConfig_t cfg = make_config(options, st->name);
    auto start = Clock::now();
    DeviceGuard g(st_->device);
    ncclComm_t nc = nullptr;
    ncclResult_t r = ncclSuccess;
    std::string detail;
    {
      std::lock_guard<std::timed_mutex> l(st_->mu);
      if (!st_->comm || st_->aborting.load()) {
        r = ncclInvalidUsage;
        detail = "the communicator was aborted";
      } else {
        {
          NcclState::CallScope call(*st_, "split");
          r = ncclCommSplit(st_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &nc, &cfg);
          if (r == ncclInProgress || (r == ncclSuccess && !options.nccl_blocking)) {
            r = poll_state(nc ? nc : st_->comm, start + options_.timeout, &st_->aborting);
          }
        }
        if (st_->aborting.load()) r = ncclInvalidUsage, detail = "the communicator was aborted (" + st_->reason() + ")";
        else if (r != ncclSuccess && r != ncclInProgress) detail = nccl_error(r, st_->comm);
      }
    }
    if (r != ncclSuccess) {
      if (nc) ncclCommAbort(nc);
      std::string msg = r == ncclInProgress
                            ? fmt::format("{} timed out after {:.1f} s", error_context(*this, "split"),
                                          seconds_since(start))
                            : fmt::format("{} failed: {}", error_context(*this, "split"), detail);
      st_->abort_now(msg);
      throw CommError(msg);
    }
    if (!nc) return nullptr;
    st->comm = nc;
    std::vector<int> world;
    for (int m : members) world.push_back(world_ranks_[m]);
    return std::make_unique<NcclCommunicator>(std::move(st), options, std::move(world));
  }

  void abort() override { st_->abort_now(fmt::format("abort() called on rank {}", rank_)); }
  bool aborted() const override { return st_->aborting.load(); }

 private:
  // The copy-engine path of this group (CommOptions::copy_engine), set up when the communicator is made
  // (collective over the group). Null when the option is off, the group has one rank, or the setup found the
  // group unable (said once in the log).
  detail::PeerCopy* peer_copy() {
    if (!options_.copy_engine || size_ == 1) return nullptr;
    if (!peer_copy_tried_) {
      peer_copy_tried_ = true;
      std::string why;
      DeviceGuard g(st_->device);
      peer_copy_ = detail::PeerCopy::create(
          rank_, size_, st_->device, options_.copy_engine_buffer_bytes, options_.timeout,
          [this](const std::vector<int64_t>& v) { return gather_host(v, "copy-engine setup"); }, &why);
      if (peer_copy_) {
        std::weak_ptr<detail::PeerCopy> weak = peer_copy_;
        std::lock_guard<std::mutex> hl(st_->hook_mu);
        st_->abort_hook = [weak] {
          if (auto pc = weak.lock()) pc->release();
        };
        log_once(LogLevel::Info, "copy_engine:" + options_.name, "comm",
                 fmt::format("group '{}': all-gathers, reduce-scatters and send/receive batches move by copy "
                             "engines ({} MiB staging buffer per rank)", options_.name, options_.copy_engine_buffer_bytes >> 20));
      } else {
        log_once(LogLevel::Warning, "copy_engine:" + options_.name, "comm",
                 fmt::format("group '{}': copy-engine collectives are unavailable ({}); its transfers stay on "
                             "NCCL's kernels", options_.name, why));
      }
    }
    return peer_copy_.get();
  }

  static ncclResult_t ce_result(cudaError_t e) {
    if (e == cudaSuccess) return ncclSuccess;
    (void)cudaGetLastError();
    return ncclUnhandledCudaError;
  }

  void usable(std::string_view op) {
    if (st_->aborting.load()) {
      raise<CommError>("{}: the communicator was aborted ({}); make a new one", error_context(*this, op),
                       st_->reason());
    }
  }

  // The caller's stream object (it owns the CUDA stream; see protect_buffers); the host Stream{} means the
  // device's legacy default stream.
  Stream stream_of(const Stream& s, std::string_view op) {
    if (s.device().is_cpu()) return Stream::default_stream(device());
    MC_CHECK(s.device() == device(), "{} on group '{}': stream is on {}, but the communicator is on {}", op,
             options_.name, s.device().str(), device().str());
    return s;
  }

  [[noreturn]] void fail(const std::string& what, Clock::time_point start, ncclResult_t r, const std::string& detail) {
    std::string msg =
        r == ncclInProgress
            ? fmt::format("{} timed out after {:.1f} s (timeout {:.1f} s) while being enqueued: not every rank of the "
                          "group joined it (a rank skipped it, posted a different operation, or died); the "
                          "communicator is aborted",
                          error_context(*this, what), seconds_since(start), options_.timeout.count() / 1000.0)
            : fmt::format("{} failed after {:.1f} s: {}; the communicator is aborted", error_context(*this, what),
                          seconds_since(start), detail);
    st_->abort_now(msg);
    throw CommError(msg);
  }

  // Issues one NCCL call (or a group, see enqueue_group), waits out ncclInProgress, records the Work
  // (which the watchdog follows from then on). An empty tensor (equal on every rank, or check_shapes
  // would have said so) is not handed to NCCL, whose argument checks reject the null data pointer of a
  // zero-byte tensor in some versions. The state's lock is held while NCCL is called, so the watchdog
  // cannot abort the communicator under the call.
  template <class F>
  WorkPtr enqueue(std::string_view what, const Stream& stream, std::vector<Tensor> keep, F&& call,
                  const FlightPeers* peers = nullptr) {
    drain_deferred();  // external buffers of finished operations, released here on the calling thread
    DeviceGuard g(st_->device);
    auto start = Clock::now();
    bool empty = !keep.empty() && std::all_of(keep.begin(), keep.end(), [](const Tensor& t) { return t.numel() == 0; });
    // Flight record: the op's name is `what` up to its arguments; its bytes are the first tensor's (the input
    // of a collective), or every tensor's for a send/receive batch. Recorded before the call, so one stuck
    // inside NCCL shows as unfinished.
    const std::string_view op_name = what.substr(0, what.find_first_of("( "));
    const bool p2p = op_name == "batch_send_recv";
    int64_t op_bytes = 0;
    for (const Tensor& t : keep) {
      op_bytes += t.nbytes();
      if (!p2p) break;
    }
    const uint64_t flight_id = flight_->start(op_name, op_bytes, p2p, peers);
    ncclResult_t r = ncclSuccess;
    std::string detail;
    bool was_aborted = false;
    {
      std::lock_guard<std::timed_mutex> l(st_->mu);
      if (!st_->comm || st_->aborting.load()) {
        was_aborted = true;
      } else {
        {
          NcclState::CallScope scope(*st_, what);
          r = empty ? ncclSuccess : call();
          if (r == ncclInProgress) r = poll_state(st_->comm, start + options_.timeout, &st_->aborting);
        }
        if (st_->aborting.load()) was_aborted = true;  // aborted meanwhile (e.g. a call stuck inside NCCL)
        else if (r != ncclSuccess && r != ncclInProgress) detail = nccl_error(r, st_->comm);
      }
    }
    if (was_aborted) usable(what);  // throws: the watchdog aborted it since the op's first check
    if (r != ncclSuccess) fail(std::string(what), start, r, detail);
    if (context_prefix_.empty()) context_prefix_ = error_context(*this, "");  // "group '..' (...) op "
    return std::make_shared<NcclWork>(st_, context_prefix_ + std::string(what), stream, std::move(keep), start,
                                      flight_, flight_id);
  }

  template <class F>
  WorkPtr enqueue_group(std::string_view what, const Stream& stream, std::vector<Tensor> keep, F&& calls) {
    return enqueue_group(what, stream, std::move(keep), nullptr, std::forward<F>(calls));
  }
  template <class F>
  WorkPtr enqueue_group(std::string_view what, const Stream& stream, std::vector<Tensor> keep,
                        const FlightPeers* peers, F&& calls) {
    return enqueue(
        what, stream, std::move(keep),
        [&]() -> ncclResult_t {
          ncclResult_t r = ncclGroupStart();
          if (r != ncclSuccess) return r;
          ncclResult_t inner = calls();
          r = ncclGroupEnd();  // always closes the group, even after a failed call inside it
          return inner != ncclSuccess ? inner : r;
        },
        peers);
  }

  // A small all-gather of host integers through the device (split and check_shapes).
  std::vector<int64_t> gather_host(const std::vector<int64_t>& mine, std::string_view what) {
    const int64_t w = int64_t(mine.size());
    Tensor in = Tensor::from_vector(mine, {w}).to(device());
    Tensor out = Tensor::empty({w * size_}, DType::I64, device());
    enqueue(fmt::format("{} (exchange)", what), Stream::default_stream(device()), {in, out}, [&] {
      return ncclAllGather(in.data_ptr(), out.data_ptr(), size_t(w), ncclInt64, st_->comm, cudaStream_t(nullptr));
    })->wait();
    // Exact: read as int64 (a trip through double would round values above 2^53).
    Tensor host = out.to(Device::cpu());
    const int64_t* p = static_cast<const int64_t*>(host.data_ptr());
    return std::vector<int64_t>(p, p + w * size_);
  }

  void agree(const OpSignature& sig, const std::string& what, const AllToAllLayout* l) {
    std::vector<int64_t> all = gather_host({sig.op, sig.dtype, sig.numel, sig.extra}, what + " check_shapes");
    std::vector<OpSignature> sigs(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) sigs[r] = {all[4 * r], all[4 * r + 1], all[4 * r + 2], all[4 * r + 3]};
    std::string bad = signature_mismatch(sigs);
    if (!bad.empty()) raise<CommError>("{}: check_shapes: {}", error_context(*this, what), bad);
    if (!l) return;
    std::vector<int64_t> counts = l->send_counts;
    counts.insert(counts.end(), l->recv_counts.begin(), l->recv_counts.end());
    bad = all_to_all_count_mismatch(gather_host(counts, what + " check_shapes"), size_);
    if (!bad.empty()) raise<CommError>("{}: check_shapes: {}", error_context(*this, what), bad);
  }

  std::shared_ptr<NcclState> st_;
  WatchdogUser watchdog_;
  std::shared_ptr<detail::PeerCopy> peer_copy_;
  bool peer_copy_tried_ = false;
  Tensor barrier_buf_;
  std::string context_prefix_;
};

}  // namespace

void check_health() {
  drain_deferred();
  std::vector<std::string> errs;
  {
    std::lock_guard<std::mutex> l(g_unreported_mu);
    errs.swap(*g_unreported);
  }
  if (errs.empty()) return;
  std::string more = errs.size() > 1 ? fmt::format(" (and {} more aborted communicators)", errs.size() - 1) : "";
  raise<CommError>("the NCCL watchdog aborted a communicator: {}{}; results computed since then are invalid",
                   errs.front(), more);
}

bool nccl_available() { return true; }

int nccl_version() {
  int v = 0;
  MC_NCCL_CHECK(ncclGetVersion(&v));
  // NCCL >= 2.9 encodes major*10000 + minor*100 + patch; older ones major*1000 + minor*100 + patch.
  return v >= 10000 ? v : (v / 1000) * 10000 + (v % 1000);
}

NcclUniqueId nccl_unique_id() {
  static_assert(sizeof(ncclUniqueId) == std::tuple_size_v<NcclUniqueId>);
  ncclUniqueId id;
  MC_NCCL_CHECK(ncclGetUniqueId(&id));
  NcclUniqueId out;
  std::memcpy(out.data(), &id, out.size());
  return out;
}

std::unique_ptr<Communicator> make_nccl_communicator(int rank, int size, const NcclUniqueId& id, Device device,
                                                     const CommOptions& options) {
  MC_CHECK(size >= 1, "make_nccl_communicator: size must be >= 1, got {}", size);
  MC_CHECK(rank >= 0 && rank < size, "make_nccl_communicator: rank {} is out of range [0, {})", rank, size);
  MC_CHECK(device.is_cuda(), "make_nccl_communicator: NCCL needs a CUDA device, got {}", device.str());
  check_device(device);
  check_options(options);
  auto st = std::make_shared<NcclState>();
  st->device = device.index;
  st->name = options.name;
  st->timeout = options.timeout;
  // Initialisation is always non-blocking, so a rank that never arrives ends in a timeout instead of a
  // hang. A blocking communicator (the default, see CommOptions::nccl_blocking) is then split off it
  // (every rank is known to be present by then) and the non-blocking one retired.
  CommOptions init_options = options;
  init_options.nccl_blocking = false;
  ncclConfig_t cfg = make_config(init_options, st->name);
  ncclUniqueId nid;
  std::memcpy(&nid, id.data(), id.size());
  DeviceGuard g(device.index);
  auto start = Clock::now();
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, nid, rank, &cfg);
  if (comm && (r == ncclInProgress || r == ncclSuccess)) r = poll_state(comm, start + options.timeout);
  if (r != ncclSuccess) {
    std::string why = r == ncclInProgress
                          ? fmt::format("timed out after {:.1f} s: not every rank called it with the same id and size, "
                                        "or a peer cannot be reached (check NCCL_SOCKET_IFNAME, NCCL_DEBUG=INFO)",
                                        seconds_since(start))
                          : fmt::format("failed after {:.1f} s: {}", seconds_since(start), nccl_error(r, comm));
    if (comm) ncclCommAbort(comm);
    raise<CommError>("NCCL init of group '{}' (rank {} of {}, {}) {}", options.name, rank, size, device.str(), why);
  }
  if (options.nccl_blocking) {
    ncclConfig_t bcfg = make_config(options, st->name);
    ncclComm_t child = nullptr;
    r = ncclCommSplit(comm, 0, rank, &child, &bcfg);
    if (r == ncclInProgress || r == ncclSuccess) r = poll_state(child ? child : comm, start + options.timeout);
    if (r != ncclSuccess || !child) {
      std::string why = fmt::format("{} after {:.1f} s", r == ncclInProgress ? "timed out" : nccl_error(r, comm),
                                    seconds_since(start));
      if (child) ncclCommAbort(child);
      ncclCommAbort(comm);
      raise<CommError>("NCCL init of group '{}' (rank {} of {}, {}): making the blocking communicator failed: {}",
                       options.name, rank, size, device.str(), why);
    }
    // Retire the init communicator: finalize (non-blocking, under the timeout), else abort it.
    ncclResult_t f = ncclCommFinalize(comm);
    if (f == ncclSuccess || f == ncclInProgress) f = poll_state(comm, Clock::now() + options.timeout);
    if (f == ncclSuccess) ncclCommDestroy(comm);
    else ncclCommAbort(comm);
    comm = child;
  }
  st->comm = comm;
  std::vector<int> world(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) world[i] = i;
  return std::make_unique<NcclCommunicator>(std::move(st), options, std::move(world));
}

}  // namespace megacore::comm
