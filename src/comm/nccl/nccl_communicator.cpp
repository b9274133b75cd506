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
#include <map>
#include <mutex>
#include <thread>

#include "comm/comm_detail.hpp"
#include "megacore/core/allocator.hpp"
#include "core/cuda/cuda_check.hpp"

namespace megacore::comm {
namespace {

using Clock = std::chrono::steady_clock;
using cuda_impl::DeviceGuard;
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
    case DType::U8: return ncclUint8;
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
ncclResult_t poll_state(ncclComm_t comm, Clock::time_point deadline) {
  Backoff backoff;
  for (;;) {
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
  return cfg;
}

void check_options(const CommOptions& o) {
  MC_CHECK(o.timeout.count() > 0, "CommOptions.timeout must be positive, got {} ms", o.timeout.count());
  MC_CHECK(o.nccl_min_ctas >= 0 && o.nccl_max_ctas >= 0, "CommOptions.nccl_min_ctas/nccl_max_ctas must be >= 0");
  MC_CHECK(o.nccl_min_ctas == 0 || o.nccl_max_ctas == 0 || o.nccl_min_ctas <= o.nccl_max_ctas,
           "CommOptions.nccl_min_ctas ({}) exceeds nccl_max_ctas ({})", o.nccl_min_ctas, o.nccl_max_ctas);
}

struct NcclState {
  ncclComm_t comm = nullptr;
  int device = 0;
  std::string name;  // backs ncclConfig_t::commName
  std::chrono::milliseconds timeout{0};
  // Held by the calling thread around every NCCL call on `comm`, so that an abort never frees the
  // communicator under a call. A call stuck inside NCCL (a blocking enqueue waiting for a dead peer)
  // keeps it: the watchdog then aborts without it, since ncclCommAbort is what makes that call return.
  std::timed_mutex mu;
  std::atomic<bool> aborting{false};
  std::atomic<bool> aborted{false};
  // The NCCL call in progress on the calling thread (for the watchdog): its start (0 when none) and name
  // (the caller's string, alive until end_call, which clears it under call_mu).
  std::atomic<int64_t> call_start_ns{0};
  std::mutex call_mu;
  std::string_view call_what;
  std::mutex reason_mu;
  std::string abort_reason;

  ~NcclState() {
    if (!comm || aborting.load()) return;
    try {
      DeviceGuard g(device);
      // Finalize waits for the peers to quiesce; a peer that never does must not hang the destructor.
      ncclResult_t r = ncclCommFinalize(comm);
      if (r == ncclSuccess || r == ncclInProgress) r = poll_state(comm, Clock::now() + timeout);
      if (r == ncclSuccess) ncclCommDestroy(comm);
      else ncclCommAbort(comm);
    } catch (...) {
      ncclCommAbort(comm);
    }
  }

  std::string reason() {
    std::lock_guard<std::mutex> l(reason_mu);
    return abort_reason;
  }

  // Marks the start and the end of an NCCL call made under `mu`.
  void begin_call(std::string_view what) {
    {
      std::lock_guard<std::mutex> l(call_mu);
      call_what = what;
    }
    call_start_ns.store(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count());
  }
  void end_call() {
    call_start_ns.store(0);
    std::lock_guard<std::mutex> l(call_mu);
    call_what = {};
  }
  // Seconds the current call has been running (0 when none), and its name.
  double call_seconds(std::string* what) {
    int64_t s = call_start_ns.load();
    if (s == 0) return 0.0;
    {
      std::lock_guard<std::mutex> l(call_mu);
      if (call_what.empty()) return 0.0;  // ended meanwhile
      *what = std::string(call_what);
    }
    int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
    return double(now - s) * 1e-9;
  }

  // The communicator's asynchronous error state (ncclSuccess, ncclInProgress or an error); ncclInvalidUsage
  // once aborted; ncclInProgress when `mu` is busy and `wait` is false (the watchdog does not queue behind
  // a call in progress).
  ncclResult_t async_error(bool wait = true) {
    std::unique_lock<std::timed_mutex> l(mu, std::defer_lock);
    if (wait) l.lock();
    else if (!l.try_lock()) return ncclInProgress;
    if (!comm || aborted.load()) return ncclInvalidUsage;
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &st);
    return r != ncclSuccess ? r : st;
  }

  // Aborts once with `reason`. Never call it while holding `mu`.
  void abort_now(std::string reason) {
    if (aborting.exchange(true)) return;
    {
      std::lock_guard<std::mutex> l(reason_mu);
      abort_reason = std::move(reason);
    }
    std::unique_lock<std::timed_mutex> l(mu, std::defer_lock);
    const bool locked = l.try_lock_for(std::chrono::seconds(2));
    aborted.store(true);
    if (comm) {
      try {
        DeviceGuard g(device);
        ncclCommAbort(comm);
      } catch (...) {
        ncclCommAbort(comm);
      }
      if (locked) comm = nullptr;  // else the stuck call still holds it; nobody uses it once `aborted` is set
    }
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

  ~PendingOp() {
    if (event) EventPool::put(device, event);
  }
  // Marks the op finished and releases its tensors; true for the one caller that did so.
  bool finish() {
    if (finished.exchange(true)) return false;
    keep.clear();
    return true;
  }
};

// Reasons of the watchdog's aborts not yet reported by check_health().
std::mutex g_unreported_mu;
std::vector<std::string> g_unreported;

// The watchdog: one thread that follows every live NCCL communicator and every operation enqueued on
// one until its event completes, so that operations nobody host-waits (Work::wait_on) and calls stuck
// inside NCCL still get the timeout and the error checks. When an operation has been pending, or a call
// has been running, longer than its communicator's timeout, or NCCL reports an asynchronous error, it
// aborts that communicator (ncclCommAbort stops the kernels stuck on it, so streams waiting for them
// move on, and makes a stuck call return) and records why: the next operation or wait on the
// communicator throws CommError with that reason. It runs while at least one NCCL communicator exists,
// polls every millisecond while operations are pending and every 50 ms otherwise.
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
      if (thread_.joinable()) thread_.join();
      stop_ = false;
      thread_ = std::thread([this] { run(); });
    }
  }

  void remove_communicator() {
    std::thread t;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (--users_ > 0) return;
      stop_ = true;
      t = std::move(thread_);
    }
    cv_.notify_all();
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
  void run() {
    std::vector<std::shared_ptr<PendingOp>> mine;
    std::vector<std::weak_ptr<NcclState>> states;
    for (;;) {
      {
        std::unique_lock<std::mutex> l(mu_);
        idle_ = mine.empty();
        cv_.wait_for(l, std::chrono::milliseconds(mine.empty() ? 50 : 1),
                     [&] { return stop_ || (idle_ && !pending_.empty()); });
        idle_ = false;
        if (stop_) return;
        for (auto& p : pending_) mine.push_back(std::move(p));
        pending_.clear();
        states_.erase(std::remove_if(states_.begin(), states_.end(), [](const auto& w) { return w.expired(); }),
                      states_.end());
        states = states_;
      }
      // Decide first, abort afterwards (abort_now may wait for the state's lock).
      std::vector<std::pair<std::shared_ptr<NcclState>, std::string>> aborts;
      auto abort_later = [&](std::shared_ptr<NcclState> st, std::string why) {
        for (auto& [s, w] : aborts)
          if (s == st) return;
        aborts.emplace_back(std::move(st), std::move(why));
      };
      // Calls stuck inside NCCL, and asynchronous errors of communicators with nothing pending.
      for (auto& w : states) {
        std::shared_ptr<NcclState> st = w.lock();
        if (!st || st->aborting.load()) continue;
        std::string what;
        double s = st->call_seconds(&what);
        if (s * 1000.0 > double(st->timeout.count())) {
          abort_later(st, fmt::format("{} has been inside NCCL for {:.1f} s (timeout {:.1f} s, found by the "
                                      "watchdog): a peer it needs (connection setup, a blocking call) never came; "
                                      "the communicator is aborted",
                                      what, s, st->timeout.count() / 1000.0));
        }
      }
      std::vector<NcclState*> error_checked;
      for (size_t i = 0; i < mine.size();) {
        PendingOp& op = *mine[i];
        std::shared_ptr<NcclState> st = op.st.lock();
        bool drop = op.finished.load() || !st || st->aborting.load();
        if (!drop) {
          DeviceGuard g(op.device);
          cudaError_t e = cudaEventQuery(op.event);
          if (e == cudaSuccess) {
            op.finish();
            drop = true;
          } else if (e != cudaErrorNotReady) {
            (void)cudaGetLastError();
            abort_later(st, fmt::format("{} failed: CUDA error {} ({})", op.context, cudaGetErrorName(e),
                                        cudaGetErrorString(e)));
          } else {
            double elapsed = seconds_since(op.start);
            if (elapsed * 1000.0 > double(st->timeout.count())) {
              abort_later(st, fmt::format("{} timed out after {:.1f} s (timeout {:.1f} s, found by the watchdog): "
                                          "not every rank of the group joined it (a rank skipped it, posted a "
                                          "different operation, or died); the communicator is aborted",
                                          op.context, elapsed, st->timeout.count() / 1000.0));
            } else if (std::find(error_checked.begin(), error_checked.end(), st.get()) == error_checked.end()) {
              error_checked.push_back(st.get());
              ncclResult_t r = st->async_error(/*wait=*/false);
              if (r != ncclSuccess && r != ncclInProgress && !st->aborting.load()) {
                abort_later(st, fmt::format("{} failed after {:.1f} s (found by the watchdog): {}", op.context, elapsed,
                                            nccl_error(r, nullptr)));
              }
            }
          }
        }
        if (drop) {
          mine[i] = std::move(mine.back());
          mine.pop_back();
        } else {
          ++i;
        }
      }
      for (auto& [st, why] : aborts) {
        fmt::print(stderr, "megacore: {}\n", why);
        {
          // Recorded before the abort: the abort is what lets a host synchronisation return, and
          // check_health() right after it must see the reason.
          std::lock_guard<std::mutex> l(g_unreported_mu);
          g_unreported.push_back(fmt::format("group '{}': {}", st->name, why));
        }
        st->abort_now(why);
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<PendingOp>> pending_;
  std::vector<std::weak_ptr<NcclState>> states_;
  std::thread thread_;
  int users_ = 0;
  bool stop_ = false;
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
// held until the operation has finished.
std::vector<Tensor> protect_buffers(std::vector<Tensor> tensors, int device, cudaStream_t stream) {
  std::vector<Tensor> held;
  const Device dev = Device::cuda(device);
  for (Tensor& t : tensors) {
    const auto& st = t.storage();
    if (!st || !st->data()) continue;
    bool recorded = false;
    if (st->owned() && st->device() == dev) {
      try {
        Allocator::get(dev).record_stream(st->data(), Stream::from_native(dev, stream));
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
  NcclWork(std::shared_ptr<NcclState> st, std::string context, cudaStream_t stream, std::vector<Tensor> keep,
           Clock::time_point start)
      : st_(std::move(st)), op_(std::make_shared<PendingOp>()) {
    op_->st = st_;
    op_->device = st_->device;
    op_->stream = stream;
    op_->start = start;
    op_->context = std::move(context);
    op_->keep = protect_buffers(std::move(keep), st_->device, stream);
    op_->event = EventPool::get(st_->device);
    DeviceGuard g(st_->device);
    MC_CUDA_CHECK(cudaEventRecord(op_->event, stream));
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
    Backoff backoff;
    while (!poll()) {
      double elapsed = seconds_since(op_->start);
      if (elapsed * 1000.0 > double(st_->timeout.count())) {
        fail(fmt::format("{} timed out after {:.1f} s (timeout {:.1f} s): not every rank of the group joined it (a "
                         "rank skipped it, posted a different operation, or died); the communicator is aborted",
                         op_->context, elapsed, st_->timeout.count() / 1000.0));
      }
      backoff.pause();
    }
    if (!error_.empty()) throw CommError(error_);
  }

  void wait_on(const Stream& s) override {
    if (!error_.empty()) throw CommError(error_);
    if (st_->aborted.load())
      fail(fmt::format("{} failed: the communicator was aborted ({})", op_->context, st_->reason()));
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
    if (st_->aborted.load())
      fail(fmt::format("{} failed: the communicator was aborted ({})", op_->context, st_->reason()));
    cudaError_t e = cudaEventQuery(op_->event);
    if (e == cudaSuccess) {
      done_ = true;
      op_->finish();
      return true;
    }
    if (e != cudaErrorNotReady) {
      (void)cudaGetLastError();
      fail(fmt::format("{} failed: CUDA error {} ({})", op_->context, cudaGetErrorName(e), cudaGetErrorString(e)));
    }
    ncclResult_t st = st_->async_error();
    if (st != ncclSuccess && st != ncclInProgress) {
      if (st_->aborted.load())
        fail(fmt::format("{} failed: the communicator was aborted ({})", op_->context, st_->reason()));
      fail(fmt::format("{} failed after {:.1f} s: {}", op_->context, seconds_since(op_->start),
                       nccl_error(st, nullptr)));
    }
    return false;
  }

  [[noreturn]] void fail(std::string msg) {
    done_ = true;
    error_ = msg;
    st_->abort_now(msg);
    // The buffers may still be in use by kernels the abort is tearing down; keep them until then.
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
  }

  Backend backend() const override { return Backend::NCCL; }
  Device device() const override { return Device::cuda(st_->device); }

  WorkPtr all_reduce(Tensor& t, ReduceOp op, const Stream& s) override {
    constexpr std::string_view name = "all_reduce";
    usable(name);
    check_tensor(*this, name, "t", t, device());
    cudaStream_t stream = stream_of(s, name);
    OpSignature sig{int64_t(OpKind::AllReduce), int64_t(t.dtype()), t.numel(), int64_t(op)};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, nullptr);
    return enqueue(what, stream, {t}, [&] {
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
    cudaStream_t stream = stream_of(s, name);
    OpSignature sig{int64_t(OpKind::AllGather), int64_t(in.dtype()), in.numel(), 0};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, nullptr);
    return enqueue(what, stream, {in, out}, [&] {
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
    cudaStream_t stream = stream_of(s, name);
    OpSignature sig{int64_t(OpKind::ReduceScatter), int64_t(out.dtype()), out.numel(), int64_t(op)};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, nullptr);
    return enqueue(what, stream, {in, out}, [&] {
      return ncclReduceScatter(in.data_ptr(), out.data_ptr(), size_t(out.numel()), nccl_type(in.dtype()),
                               nccl_op(op), st_->comm, stream);
    });
  }

  WorkPtr broadcast(Tensor& t, int root, const Stream& s) override {
    constexpr std::string_view name = "broadcast";
    usable(name);
    check_tensor(*this, name, "t", t, device());
    check_root(*this, name, root);
    cudaStream_t stream = stream_of(s, name);
    OpSignature sig{int64_t(OpKind::Broadcast), int64_t(t.dtype()), t.numel(), root};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, nullptr);
    return enqueue(what, stream, {t}, [&] {
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
    cudaStream_t stream = stream_of(s, name);
    OpSignature sig{int64_t(OpKind::AllToAll), int64_t(in.dtype()), size_, 0};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, &l);
    const int64_t es = in.element_size();
    const ncclDataType_t ty = nccl_type(in.dtype());
    char* src = static_cast<char*>(in.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    // Grouped send/recv pairs handle uneven splits (ncclAlltoAll, 2.28.3+, is even-only).
    return enqueue_group(what, stream, {in, out}, [&]() -> ncclResult_t {
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
    cudaStream_t stream = stream_of(s, name);
    return enqueue_group(fmt::format("batch_send_recv ({} ops)", ops.size()), stream, std::move(keep),
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
    enqueue("barrier", nullptr, {t}, [&] {
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
      if (!st_->comm || st_->aborted.load()) {
        r = ncclInvalidUsage;
        detail = "the communicator was aborted";
      } else {
        st_->begin_call("split");
        r = ncclCommSplit(st_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &nc, &cfg);
        if (r == ncclInProgress || (r == ncclSuccess && !options.nccl_blocking)) {
          r = poll_state(nc ? nc : st_->comm, start + options_.timeout);
        }
        st_->end_call();
        if (st_->aborted.load()) r = ncclInvalidUsage, detail = "the communicator was aborted (" + st_->reason() + ")";
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
  bool aborted() const override { return st_->aborted.load(); }

 private:
  void usable(std::string_view op) {
    if (st_->aborted.load()) {
      raise<CommError>("{}: the communicator was aborted ({}); make a new one", error_context(*this, op),
                       st_->reason());
    }
  }

  cudaStream_t stream_of(const Stream& s, std::string_view op) {
    if (s.device().is_cpu()) return nullptr;  // default Stream{}: the device's legacy default stream
    MC_CHECK(s.device() == device(), "{} on group '{}': stream is on {}, but the communicator is on {}", op,
             options_.name, s.device().str(), device().str());
    return static_cast<cudaStream_t>(s.native());
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
  WorkPtr enqueue(std::string_view what, cudaStream_t stream, std::vector<Tensor> keep, F&& call) {
    DeviceGuard g(st_->device);
    auto start = Clock::now();
    bool empty = !keep.empty() && std::all_of(keep.begin(), keep.end(), [](const Tensor& t) { return t.numel() == 0; });
    ncclResult_t r = ncclSuccess;
    std::string detail;
    bool was_aborted = false;
    {
      std::lock_guard<std::timed_mutex> l(st_->mu);
      if (!st_->comm || st_->aborted.load()) {
        was_aborted = true;
      } else {
        st_->begin_call(what);
        r = empty ? ncclSuccess : call();
        if (r == ncclInProgress) r = poll_state(st_->comm, start + options_.timeout);
        st_->end_call();
        if (st_->aborted.load()) was_aborted = true;  // the watchdog ended a call stuck inside NCCL
        else if (r != ncclSuccess && r != ncclInProgress) detail = nccl_error(r, st_->comm);
      }
    }
    if (was_aborted) usable(what);  // throws: the watchdog aborted it since the op's first check
    if (r != ncclSuccess) fail(std::string(what), start, r, detail);
    if (context_prefix_.empty()) context_prefix_ = error_context(*this, "");  // "group '..' (...) op "
    return std::make_shared<NcclWork>(st_, context_prefix_ + std::string(what), stream, std::move(keep), start);
  }

  template <class F>
  WorkPtr enqueue_group(std::string_view what, cudaStream_t stream, std::vector<Tensor> keep, F&& calls) {
    return enqueue(what, stream, std::move(keep), [&]() -> ncclResult_t {
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      ncclResult_t inner = calls();
      r = ncclGroupEnd();  // always closes the group, even after a failed call inside it
      return inner != ncclSuccess ? inner : r;
    });
  }

  // A small all-gather of host integers through the device (split and check_shapes).
  std::vector<int64_t> gather_host(const std::vector<int64_t>& mine, std::string_view what) {
    const int64_t w = int64_t(mine.size());
    Tensor in = Tensor::from_vector(mine, {w}).to(device());
    Tensor out = Tensor::empty({w * size_}, DType::I64, device());
    enqueue(fmt::format("{} (exchange)", what), nullptr, {in, out}, [&] {
      return ncclAllGather(in.data_ptr(), out.data_ptr(), size_t(w), ncclInt64, st_->comm, cudaStream_t(nullptr));
    })->wait();
    std::vector<double> v = out.to_double_vector();
    return std::vector<int64_t>(v.begin(), v.end());
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
  Tensor barrier_buf_;
  std::string context_prefix_;
};

}  // namespace

void check_health() {
  std::vector<std::string> errs;
  {
    std::lock_guard<std::mutex> l(g_unreported_mu);
    errs.swap(g_unreported);
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
