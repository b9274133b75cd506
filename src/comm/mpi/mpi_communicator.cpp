// MPI backend of Communicator (host tensors).
//
// Every operation is a nonblocking MPI call; Work::wait() polls MPI_Test so a collective that some
// rank never joins becomes a CommError after CommOptions::timeout instead of a hang. Nonblocking
// MPI collectives cannot be cancelled, so an operation that timed out stays posted forever: its
// buffers are kept alive and the communicator is abandoned (never freed) rather than reused, since
// a later collective on it would match the stale one. Peers learn about an abort through a notice
// sent on a second, private communicator, so the whole group fails fast, not one rank at a time.
//
// A destroyed communicator's MPI communicators are freed only once every member has destroyed its
// own without an abort (a nonblocking barrier on the control communicator, see Retired): a peer may
// still send an abort notice after this rank let go, and Open MPI delivers a message that arrives for
// a freed context id to the next communicator that reuses the id (it crashed there, in MPI_Comm_dup).
#include "megacore/comm/mpi_communicator.hpp"

#include <mpi.h>

#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <numeric>
#include <thread>

#include "comm/comm_detail.hpp"
#include "megacore/core/host_sync.hpp"

namespace megacore::comm {
namespace {

// Set once any communicator of this process was aborted: a peer may be gone, and MPI_Finalize can
// then wait for it forever.
std::atomic<bool> g_any_aborted{false};

using Clock = std::chrono::steady_clock;
using namespace detail;

constexpr int kAbortTag = 0x4d43;  // on the control communicator only
constexpr int kP2PTag = 0;

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(buf, size_t(len));
}

// ---- datatypes and reduction ops -----------------------------------------------------------------

MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::F32: return MPI_FLOAT;
    case DType::BF16:
    case DType::F16: return MPI_UINT16_T;  // moved as raw bits; reductions use the ops below
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::U8:
    case DType::F8E4M3:
    case DType::F8E5M2: return MPI_UINT8_T;  // FP8 moves as raw bytes; mpi_op refuses reductions
  }
  return MPI_BYTE;
}

// MPI has no 16-bit float types, so bf16/f16 reductions are user ops that compute in f32 and round
// back, the way a GPU reduction kernel does.
template <class T, ReduceOp R>
void half_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    float x = float(a[i]), y = float(b[i]), r;
    if constexpr (R == ReduceOp::Sum) r = x + y;
    else if constexpr (R == ReduceOp::Max) r = (x > y || std::isnan(x)) ? x : y;
    else r = (x < y || std::isnan(x)) ? x : y;
    b[i] = T(r);
  }
}

struct HalfOps {
  MPI_Op op[2][3];  // [bf16, f16][sum, max, min]
  HalfOps() {
    MPI_Op_create(&half_reduce<bfloat16, ReduceOp::Sum>, 1, &op[0][0]);
    MPI_Op_create(&half_reduce<bfloat16, ReduceOp::Max>, 1, &op[0][1]);
    MPI_Op_create(&half_reduce<bfloat16, ReduceOp::Min>, 1, &op[0][2]);
    MPI_Op_create(&half_reduce<float16, ReduceOp::Sum>, 1, &op[1][0]);
    MPI_Op_create(&half_reduce<float16, ReduceOp::Max>, 1, &op[1][1]);
    MPI_Op_create(&half_reduce<float16, ReduceOp::Min>, 1, &op[1][2]);
  }
};

MPI_Op mpi_op(DType d, ReduceOp r) {
  int k = r == ReduceOp::Max ? 1 : r == ReduceOp::Min ? 2 : 0;  // Avg is Sum, then a division
  MC_CHECK(!is_fp8(d), "reductions of {} tensors are not supported (FP8 is a storage format); reduce in f32 or "
           "bf16 and cast afterwards", dtype_name(d));
  if (d == DType::BF16 || d == DType::F16) {
    // Process-wide constants, created once after MPI_Init and released by MPI_Finalize.
    static const HalfOps ops;
    return ops.op[d == DType::BF16 ? 0 : 1][k];
  }
  return k == 0 ? MPI_SUM : k == 1 ? MPI_MAX : MPI_MIN;
}

// Avg on integers truncates toward zero, like NCCL's ncclAvg.
void divide_(const Tensor& t, int n) {
  dispatch_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* p = static_cast<T*>(t.data_ptr());
    for (int64_t i = 0; i < t.numel(); ++i) {
      if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>) p[i] = T(float(p[i]) / float(n));
      else p[i] = T(p[i] / T(n));
    }
  });
}

int checked_count(int64_t n, std::string_view op) {
  MC_CHECK(n <= INT_MAX, "{}: the MPI backend moves at most {} elements per call, got {}; split the tensor", op,
           INT_MAX, n);
  return int(n);
}

// ---- shared state of a communicator and its Work handles ----------------------------------------

// An operation MPI still owns: its requests and everything MPI may read or write until they finish.
struct Pending {
  std::vector<MPI_Request> reqs;
  std::vector<Tensor> keep;
  std::vector<int> ints;          // alltoallv counts/displacements, read by MPI until completion
  std::vector<int64_t> words;     // check_shapes buffers
  // Returns MPI's error code; `done` is set once every request has finished.
  int test(bool& done) {
    int flag = 0;
    int rc = reqs.empty() ? MPI_SUCCESS : MPI_Testall(int(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE);
    done = reqs.empty() || flag || rc != MPI_SUCCESS;
    return rc;
  }
};

// Buffers of operations abandoned after an abort (see ~MpiState). Held through a static pointer so they
// stay reachable, and leak checkers report them as retained, not lost.
struct Abandoned {
  std::mutex mutex;
  std::vector<std::unique_ptr<Pending>> pending;
  std::vector<std::pair<MPI_Request, std::unique_ptr<std::string>>> notices;
};
Abandoned& abandoned() {
  static Abandoned* a = new Abandoned;
  return *a;
}

// MPI communicators of destroyed megacore communicators. A pair (data, control) is freed when the
// barrier every member posts on its control communicator as it lets go completes: then no member
// aborted the group (an aborting rank never posts it), so no abort notice was sent on the pair and
// none can arrive after the free. A pair whose barrier never completes (a peer aborted it, or died)
// stays allocated for the life of the process, as does one that this rank saw aborted.
struct Retired {
  struct Waiting {
    MPI_Request barrier;
    MPI_Comm comm, ctrl;
  };
  std::mutex mutex;
  std::vector<Waiting> waiting;
  std::vector<std::pair<MPI_Comm, MPI_Comm>> kept;

  // Frees the pairs whose barrier has completed.
  void reap() {
    std::erase_if(waiting, [this](Waiting& w) {
      int flag = 0;
      if (MPI_Test(&w.barrier, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        kept.emplace_back(w.comm, w.ctrl);
        return true;
      }
      if (!flag) return false;
      MPI_Comm_free(&w.ctrl);
      MPI_Comm_free(&w.comm);
      return true;
    });
  }
};
Retired& retired() {
  static Retired* r = new Retired;
  return *r;
}

// Hands a destroyed communicator's pair to the retired list; `releasable` when this rank may post the
// release barrier (it never aborted the pair nor saw it aborted, and nothing is pending on it).
void retire(MPI_Comm comm, MPI_Comm ctrl, bool releasable) {
  Retired& r = retired();
  std::lock_guard<std::mutex> lock(r.mutex);
  MPI_Request req = MPI_REQUEST_NULL;
  if (releasable && ctrl != MPI_COMM_NULL && MPI_Ibarrier(ctrl, &req) == MPI_SUCCESS) {
    r.waiting.push_back({req, comm, ctrl});
  } else if (comm != MPI_COMM_NULL || ctrl != MPI_COMM_NULL) {
    r.kept.emplace_back(comm, ctrl);
  }
  r.reap();
}

void reap_retired() {
  Retired& r = retired();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.reap();
}

struct MpiState {
  MPI_Comm comm = MPI_COMM_NULL;  // data traffic
  MPI_Comm ctrl = MPI_COMM_NULL;  // abort notices
  int rank = 0, size = 1;
  std::vector<int> world_ranks;
  // Random identity agreed at creation and sent with abort notices: MPI may reuse a freed
  // communicator's context for a new one, and a stale notice must not abort the newcomer.
  uint64_t token = 0;
  bool aborted = false;
  std::string abort_reason;
  std::vector<std::unique_ptr<Pending>> orphans;  // dropped Work handles whose requests still run
  std::vector<std::pair<MPI_Request, std::unique_ptr<std::string>>> notices;

  ~MpiState() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;  // MPI no longer touches any buffer; nothing to free
    bool quiet = sweep();
    for (auto& [req, msg] : notices) {
      int flag = 0;
      if (req != MPI_REQUEST_NULL && (MPI_Test(&req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || !flag)) quiet = false;
    }
    if (aborted || !quiet) {
      // Operations that will never finish still reference these buffers and communicators; freeing
      // either is undefined behaviour, so they are kept for the life of the process (once per abort).
      Abandoned& a = abandoned();
      std::lock_guard<std::mutex> lock(a.mutex);
      for (auto& p : orphans) a.pending.push_back(std::move(p));
      for (auto& n : notices) a.notices.push_back(std::move(n));
    }
    // Not freed here even when this rank is done with it: a peer that has not finished may still abort
    // the group and send a notice on ctrl (or leave parts of a collective on comm), and Open MPI would
    // hand those to the next communicator that reuses the context id.
    retire(comm, ctrl, /*releasable=*/!aborted && quiet);
  }

  // Receives one abort notice that has arrived on ctrl (its text and sender); false when none has.
  bool receive_notice(std::string& msg, int& src) {
    if (ctrl == MPI_COMM_NULL) return false;
    int flag = 0;
    MPI_Status st;
    if (MPI_Iprobe(MPI_ANY_SOURCE, kAbortTag, ctrl, &flag, &st) != MPI_SUCCESS || !flag) return false;
    int len = 0;
    MPI_Get_count(&st, MPI_CHAR, &len);
    msg.assign(size_t(std::max(len, 0)), '\0');
    src = st.MPI_SOURCE;
    return MPI_Recv(msg.data(), len, MPI_CHAR, src, kAbortTag, ctrl, MPI_STATUS_IGNORE) == MPI_SUCCESS;
  }

  // Drops orphans that have finished; true when none is left.
  bool sweep() {
    std::erase_if(orphans, [](auto& p) {
      bool done = false;
      p->test(done);
      return done;
    });
    return orphans.empty();
  }

  void mark_aborted(std::string reason, bool notify) {
    if (aborted) return;
    aborted = true;
    g_any_aborted = true;
    abort_reason = std::move(reason);
    if (!notify || ctrl == MPI_COMM_NULL) return;
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      auto msg = std::make_unique<std::string>(reinterpret_cast<const char*>(&token), sizeof(token));
      *msg += abort_reason;
      MPI_Request req = MPI_REQUEST_NULL;
      // Best effort: a peer that is gone cannot be told, and that must not hide the original error.
      if (MPI_Isend(msg->data(), int(msg->size()), MPI_CHAR, p, kAbortTag, ctrl, &req) == MPI_SUCCESS) {
        notices.emplace_back(req, std::move(msg));
      }
    }
  }

  // Receives an abort notice from a peer if one has arrived; true when the communicator is aborted.
  bool poll_notices() {
    if (aborted) return true;
    std::string msg;
    int src = 0;
    if (!receive_notice(msg, src)) return false;
    uint64_t from = 0;
    if (msg.size() < sizeof(from)) return false;
    std::memcpy(&from, msg.data(), sizeof(from));
    if (from != token) return false;  // meant for an earlier communicator
    mark_aborted(fmt::format("rank {} (world rank {}) aborted the communicator: {}", src,
                             src < int(world_ranks.size()) ? world_ranks[src] : -1, msg.substr(sizeof(from))),
                 /*notify=*/false);
    return true;
  }
};


class MpiWork final : public Work {
 public:
  MpiWork(std::shared_ptr<MpiState> st, std::string context, std::chrono::milliseconds timeout,
          std::unique_ptr<Pending> p, std::function<void()> finish, std::shared_ptr<FlightRecorder> flight,
          uint64_t flight_id)
      : st_(std::move(st)), context_(std::move(context)), timeout_(timeout), start_(Clock::now()),
        p_(std::move(p)), finish_(std::move(finish)), flight_(std::move(flight)), flight_id_(flight_id) {}

  ~MpiWork() override {
    if (p_ && !done_) {
      bool done = false;
      p_->test(done);
      if (!done) st_->orphans.push_back(std::move(p_));
    }
  }

  bool is_completed() override {
    step();
    return done_;
  }

  // The host blocks on a collective: counted as a host sync (the same control flow as NCCL's wait()).
  void wait() override {
    note_host_sync(HostSyncReason::current("collective_wait"));
    block();
  }
  // MPI progresses on the host, so stream order means finishing here; not a sync the stream-ordered path
  // would have on a GPU, so not counted.
  void wait_on(const Stream&) override { block(); }

 private:
  void block() {
    auto backoff = std::chrono::microseconds(0);
    while (!step()) {
      if (st_->poll_notices()) fail(fmt::format("{} failed: {}", context_, st_->abort_reason));
      double elapsed = seconds_since(start_);
      if (elapsed * 1000.0 > double(timeout_.count())) {
        std::string msg = fmt::format(
            "{} timed out after {:.1f} s (timeout {:.1f} s): not every rank of the group joined it (a rank skipped "
            "it, posted a different operation, or died); the communicator is aborted",
            context_, elapsed, timeout_.count() / 1000.0);
        st_->mark_aborted(msg, /*notify=*/true);
        fail(msg);
      }
      // Spin briefly for latency, then back off so oversubscribed ranks leave the cores to peers.
      if (backoff.count() > 0) std::this_thread::sleep_for(backoff);
      backoff = std::min(std::chrono::microseconds(1000), backoff + std::chrono::microseconds(20));
    }
    if (!error_.empty()) throw CommError(error_);
  }

  // Tests the requests; runs the finishing step once. True once done (successfully or not).
  bool step() {
    if (done_) return true;
    bool done = false;
    int rc = p_->test(done);
    if (!done) return false;
    done_ = true;
    if (rc == MPI_SUCCESS) flight_->done(flight_id_);
    if (rc != MPI_SUCCESS) {
      error_ = fmt::format("{} failed: {}", context_, mpi_error_string(rc));
      st_->mark_aborted(error_, /*notify=*/true);
    } else if (finish_) {
      try {
        finish_();
      } catch (const std::exception& e) {
        error_ = e.what();
      }
    }
    p_.reset();
    return true;
  }

  [[noreturn]] void fail(const std::string& msg) {
    error_ = msg;
    throw CommError(msg);
  }

  std::shared_ptr<MpiState> st_;
  std::string context_;
  std::chrono::milliseconds timeout_;
  Clock::time_point start_;
  std::unique_ptr<Pending> p_;
  std::function<void()> finish_;
  std::shared_ptr<FlightRecorder> flight_;
  uint64_t flight_id_;
  bool done_ = false;
  std::string error_;
};

std::vector<int> translate_to_world(MPI_Comm comm, int size) {
  MPI_Group g, wg;
  MPI_Comm_group(comm, &g);
  MPI_Comm_group(MPI_COMM_WORLD, &wg);
  std::vector<int> in(static_cast<size_t>(size)), out(static_cast<size_t>(size));
  std::iota(in.begin(), in.end(), 0);
  MPI_Group_translate_ranks(g, size, in.data(), wg, out.data());
  MPI_Group_free(&g);
  MPI_Group_free(&wg);
  return out;
}

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (already private to megacore).
  MpiCommunicator(MPI_Comm comm, const CommOptions& options) : st_(std::make_shared<MpiState>()) {
    reap_retired();  // frees released groups, so their context ids serve the duplicate below and later groups
    options_ = options;
    st_->comm = comm;
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    check(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm, &size_), "MPI_Comm_size");
    check(MPI_Comm_dup(comm, &st_->ctrl), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(st_->ctrl, MPI_ERRORS_RETURN);
    world_ranks_ = translate_to_world(comm, size_);
    if (rank_ == 0) st_->token = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
    check(MPI_Bcast(&st_->token, 1, MPI_UINT64_T, 0, comm), "MPI_Bcast");
    st_->rank = rank_;
    st_->size = size_;
    st_->world_ranks = world_ranks_;
    flight_ = FlightRecorder::create(options_.name, world_ranks_, rank_);
    std::string cname = "megacore:" + options_.name;
    MPI_Comm_set_name(comm, cname.c_str());  // shows up in MPI's own error messages and tools
  }

  Backend backend() const override { return Backend::MPI; }

  WorkPtr all_reduce(Tensor& t, ReduceOp op, const Stream&) override {
    constexpr std::string_view name = "all_reduce";
    usable(name);
    check_tensor(*this, name, "t", t, Device::cpu());
    int n = checked_count(t.numel(), name);
    OpSignature sig{int64_t(OpKind::AllReduce), int64_t(t.dtype()), t.numel(), int64_t(op)};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, nullptr);
    auto p = pending({t}, 1);
    post_check(MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr(), n, mpi_type(t.dtype()), mpi_op(t.dtype(), op), st_->comm,
                              &p->reqs[0]),
               what);
    std::function<void()> finish;
    if (op == ReduceOp::Avg) finish = [t, s = size_] { divide_(t, s); };
    return make_work(what, std::move(p), std::move(finish), name, t.nbytes());
  }

  WorkPtr all_gather(const Tensor& in, Tensor& out, const Stream&) override {
    constexpr std::string_view name = "all_gather";
    usable(name);
    check_tensor(*this, name, "in", in, Device::cpu());
    check_tensor(*this, name, "out", out, Device::cpu());
    check_same_dtype(*this, name, in, out);
    MC_CHECK(out.numel() == in.numel() * size_,
             "all_gather on group '{}': out has {} elements, need size() * in.numel() = {} * {} = {}", options_.name,
             out.numel(), size_, in.numel(), in.numel() * size_);
    int n = checked_count(in.numel(), name);
    checked_count(out.numel(), name);
    OpSignature sig{int64_t(OpKind::AllGather), int64_t(in.dtype()), in.numel(), 0};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, nullptr);
    auto p = pending({in, out}, 1);
    char* slot = static_cast<char*>(out.data_ptr()) + int64_t(rank_) * in.nbytes();
    const void* src = (slot == in.data_ptr() && n > 0) ? MPI_IN_PLACE : in.data_ptr();
    MPI_Datatype ty = mpi_type(in.dtype());
    post_check(MPI_Iallgather(src, n, ty, out.data_ptr(), n, ty, st_->comm, &p->reqs[0]), what);
    return make_work(what, std::move(p), nullptr, name, in.nbytes());
  }

  WorkPtr reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op, const Stream&) override {
    constexpr std::string_view name = "reduce_scatter";
    usable(name);
    check_tensor(*this, name, "in", in, Device::cpu());
    check_tensor(*this, name, "out", out, Device::cpu());
    check_same_dtype(*this, name, in, out);
    MC_CHECK(in.numel() == out.numel() * size_,
             "reduce_scatter on group '{}': in has {} elements, need size() * out.numel() = {} * {} = {}",
             options_.name, in.numel(), size_, out.numel(), out.numel() * size_);
    checked_count(in.numel(), name);
    int n = checked_count(out.numel(), name);
    OpSignature sig{int64_t(OpKind::ReduceScatter), int64_t(out.dtype()), out.numel(), int64_t(op)};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, nullptr);
    auto p = pending({in, out}, 1);
    post_check(MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(), n, mpi_type(in.dtype()),
                                         mpi_op(in.dtype(), op), st_->comm, &p->reqs[0]),
               what);
    std::function<void()> finish;
    if (op == ReduceOp::Avg) finish = [out, s = size_] { divide_(out, s); };
    return make_work(what, std::move(p), std::move(finish), name, in.nbytes());
  }

  WorkPtr broadcast(Tensor& t, int root, const Stream&) override {
    constexpr std::string_view name = "broadcast";
    usable(name);
    check_tensor(*this, name, "t", t, Device::cpu());
    check_root(*this, name, root);
    int n = checked_count(t.numel(), name);
    OpSignature sig{int64_t(OpKind::Broadcast), int64_t(t.dtype()), t.numel(), root};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, nullptr);
    auto p = pending({t}, 1);
    post_check(MPI_Ibcast(t.data_ptr(), n, mpi_type(t.dtype()), root, st_->comm, &p->reqs[0]), what);
    return make_work(what, std::move(p), nullptr, name, t.nbytes());
  }

  WorkPtr all_to_all(const Tensor& in, Tensor& out, const std::vector<int64_t>& send_counts,
                     const std::vector<int64_t>& recv_counts, const Stream&) override {
    constexpr std::string_view name = "all_to_all";
    usable(name);
    check_tensor(*this, name, "in", in, Device::cpu());
    check_tensor(*this, name, "out", out, Device::cpu());
    check_same_dtype(*this, name, in, out);
    AllToAllLayout l = all_to_all_layout(*this, in, out, send_counts, recv_counts);
    checked_count(in.numel(), name);
    checked_count(out.numel(), name);
    OpSignature sig{int64_t(OpKind::AllToAll), int64_t(in.dtype()), size_, 0};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, &l);
    auto p = pending({in, out}, 1);
    p->ints.resize(size_t(4 * size_));
    int* sc = p->ints.data();
    int *sd = sc + size_, *rc = sd + size_, *rd = rc + size_;
    for (int r = 0; r < size_; ++r) {
      sc[r] = int(l.send_counts[r]);
      sd[r] = int(l.send_offsets[r]);
      rc[r] = int(l.recv_counts[r]);
      rd[r] = int(l.recv_offsets[r]);
    }
    MPI_Datatype ty = mpi_type(in.dtype());
    post_check(MPI_Ialltoallv(in.data_ptr(), sc, sd, ty, out.data_ptr(), rc, rd, ty, st_->comm, &p->reqs[0]), what);
    return make_work(what, std::move(p), nullptr, name, in.nbytes());
  }

  WorkPtr batch_send_recv(const std::vector<P2POp>& ops, const Stream&) override {
    constexpr std::string_view name = "batch_send_recv";
    usable(name);
    std::vector<Tensor> keep;
    int64_t bytes = 0;
    for (const auto& op : ops) {
      check_tensor(*this, name, op.kind == P2POp::Send ? "a send tensor" : "a recv tensor", op.tensor, Device::cpu());
      MC_CHECK(op.peer >= 0 && op.peer < size_, "batch_send_recv on group '{}': peer {} is out of range [0, {})",
               options_.name, op.peer, size_);
      checked_count(op.tensor.numel(), name);
      keep.push_back(op.tensor);
      bytes += op.tensor.nbytes();
    }
    std::string what = fmt::format("batch_send_recv ({} ops)", ops.size());
    FlightPeers peers;
    for (const auto& op : ops) peers.add(op.kind == P2POp::Send, op.peer);
    auto p = pending(std::move(keep), ops.size());
    // Receives first, so sends to ranks that are already waiting can complete at once. Several ops to
    // the same peer match in posting order (MPI's non-overtaking rule).
    size_t k = 0;
    for (int pass = 0; pass < 2; ++pass) {
      for (const auto& op : ops) {
        bool recv = op.kind == P2POp::Recv;
        if (recv != (pass == 0)) continue;
        MPI_Datatype ty = mpi_type(op.tensor.dtype());
        int n = int(op.tensor.numel());
        int rc = recv ? MPI_Irecv(op.tensor.data_ptr(), n, ty, op.peer, kP2PTag, st_->comm, &p->reqs[k])
                      : MPI_Isend(op.tensor.data_ptr(), n, ty, op.peer, kP2PTag, st_->comm, &p->reqs[k]);
        if (rc != MPI_SUCCESS) {
          p->reqs.resize(k);  // the ones already posted stay owned by the orphan list
          st_->orphans.push_back(std::move(p));
          post_check(rc, what);
        }
        ++k;
      }
    }
    return make_work(what, std::move(p), nullptr, name, bytes, /*p2p=*/true, &peers);
  }

  void barrier() override {
    usable("barrier");
    OpSignature sig{int64_t(OpKind::Barrier), -1, 0, 0};
    std::string what = signature_str(sig);
    if (options_.check_shapes) agree(sig, what, nullptr);
    auto p = pending({}, 1);
    post_check(MPI_Ibarrier(st_->comm, &p->reqs[0]), what);
    make_work(what, std::move(p), nullptr, "barrier", 0)->wait();
  }

  std::unique_ptr<Communicator> split(int color, int key, const CommOptions& options) override {
    usable("split");
    // Gather (color, key) under the timeout first: it proves every rank entered split, so the
    // blocking MPI_Comm_split after it cannot hang.
    auto p = pending({}, 1);
    p->words = {color, key};
    p->words.resize(2 + 2 * size_t(size_));
    post_check(MPI_Iallgather(p->words.data(), 2, MPI_INT64_T, p->words.data() + 2, 2, MPI_INT64_T, st_->comm,
                              &p->reqs[0]),
               "split");
    make_work(fmt::format("split(color={}, key={})", color, key), std::move(p), nullptr, "split",
              2 * int64_t(sizeof(int64_t)))
        ->wait();
    MPI_Comm nc = MPI_COMM_NULL;
    check(MPI_Comm_split(st_->comm, color < 0 ? MPI_UNDEFINED : color, key, &nc), "MPI_Comm_split");
    if (nc == MPI_COMM_NULL) return nullptr;
    return std::make_unique<MpiCommunicator>(nc, options);
  }

  void abort() override { st_->mark_aborted(fmt::format("abort() called on rank {}", rank_), /*notify=*/true); }
  bool aborted() const override { return st_->poll_notices(); }

 private:
  void check(int rc, std::string_view call) {
    if (rc != MPI_SUCCESS) raise<CommError>("group '{}': {} failed: {}", options_.name, call, mpi_error_string(rc));
  }

  void usable(std::string_view op) {
    if (st_->poll_notices()) {
      raise<CommError>("{}: the communicator was aborted ({}); make a new one", error_context(*this, op),
                       st_->abort_reason);
    }
    st_->sweep();
  }

  std::unique_ptr<Pending> pending(std::vector<Tensor> keep, size_t nreq) {
    auto p = std::make_unique<Pending>();
    p->keep = std::move(keep);
    p->reqs.assign(nreq, MPI_REQUEST_NULL);
    return p;
  }

  void post_check(int rc, std::string_view what) {
    if (rc == MPI_SUCCESS) return;
    std::string msg = fmt::format("{} could not be started: {}", error_context(*this, what), mpi_error_string(rc));
    st_->mark_aborted(msg, /*notify=*/true);
    throw CommError(msg);
  }

  // `op` and `bytes` go to the flight record (a collective unless `p2p`; a p2p batch with its `peers`).
  WorkPtr make_work(std::string_view what, std::unique_ptr<Pending> p, std::function<void()> finish,
                    std::string_view op, int64_t bytes, bool p2p = false, const FlightPeers* peers = nullptr) {
    const uint64_t id = flight_->start(op, bytes, p2p, peers);
    return std::make_shared<MpiWork>(st_, error_context(*this, what), options_.timeout, std::move(p),
                                     std::move(finish), flight_, id);
  }

  // check_shapes: every rank gathers every rank's signature (and for all-to-all its counts), so all
  // reach the same verdict and throw together; the communicator stays usable afterwards.
  void agree(const OpSignature& sig, const std::string& what, const AllToAllLayout* l) {
    auto p = pending({}, 1);
    p->words = {sig.op, sig.dtype, sig.numel, sig.extra};
    p->words.resize(size_t(OpSignature::kWords) * (1 + size_));
    int64_t* mine = p->words.data();
    post_check(MPI_Iallgather(mine, OpSignature::kWords, MPI_INT64_T, mine + OpSignature::kWords,
                              OpSignature::kWords, MPI_INT64_T, st_->comm, &p->reqs[0]),
               what);
    Pending* raw = p.get();
    std::vector<int64_t> all;
    make_work(what + " (check_shapes)", std::move(p), [&] { all.assign(raw->words.begin() + 4, raw->words.end()); },
              "check_shapes", OpSignature::kWords * int64_t(sizeof(int64_t)))
        ->wait();
    std::vector<OpSignature> sigs(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) sigs[r] = {all[4 * r], all[4 * r + 1], all[4 * r + 2], all[4 * r + 3]};
    std::string bad = signature_mismatch(sigs);
    if (!bad.empty()) raise<CommError>("{}: check_shapes: {}", error_context(*this, what), bad);
    if (!l) return;
    auto q = pending({}, 1);
    q->words = l->send_counts;
    q->words.insert(q->words.end(), l->recv_counts.begin(), l->recv_counts.end());
    const size_t w = q->words.size();
    q->words.resize(w * (1 + size_));
    post_check(MPI_Iallgather(q->words.data(), int(w), MPI_INT64_T, q->words.data() + w, int(w), MPI_INT64_T,
                              st_->comm, &q->reqs[0]),
               what);
    raw = q.get();
    make_work(what + " (check_shapes)", std::move(q),
              [&] { all.assign(raw->words.begin() + std::ptrdiff_t(w), raw->words.end()); }, "check_shapes",
              int64_t(w * sizeof(int64_t)))
        ->wait();
    bad = all_to_all_count_mismatch(all, size_);
    if (!bad.empty()) raise<CommError>("{}: check_shapes: {}", error_context(*this, what), bad);
  }

  std::shared_ptr<MpiState> st_;
};

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (g_any_aborted) {
    // After an abort a dead peer can make MPI_Finalize block forever; a job must end, not hang.
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::seconds(10));
      std::fprintf(stderr, "megacore: MPI_Finalize did not return within 10 s after a communicator was aborted "
                           "(a peer is probably gone); exiting with code 70\n");
      std::_Exit(70);
    }).detach();
  }
  MPI_Finalize();
}

void ensure_mpi_initialized() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  MC_CHECK_AS(ConfigError, !finalized, "MPI was already finalised in this process; make communicators before MPI_Finalize");
  if (initialized) return;
  int provided = 0;
  int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  MC_CHECK_AS(ConfigError, rc == MPI_SUCCESS, "MPI_Init_thread failed: {}", mpi_error_string(rc));
  std::atexit(finalize_at_exit);
}

}  // namespace

bool mpi_available() { return true; }

size_t mpi_retained_communicators() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return 0;
  Retired& r = retired();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.reap();
  return r.waiting.size() + r.kept.size();
}

namespace detail {
void mpi_abort_world(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
}
}  // namespace detail

std::unique_ptr<Communicator> make_mpi_world(const CommOptions& options) {
  ensure_mpi_initialized();
  MPI_Comm world = MPI_COMM_WORLD;
  return make_mpi_communicator(&world, options);
}

std::unique_ptr<Communicator> make_mpi_communicator(const void* mpi_comm, const CommOptions& options) {
  MC_CHECK(mpi_comm != nullptr, "make_mpi_communicator: mpi_comm is null; pass the address of an MPI_Comm");
  int initialized = 0;
  MPI_Initialized(&initialized);
  MC_CHECK_AS(ConfigError, initialized, "make_mpi_communicator: MPI is not initialised; call MPI_Init first or use "
              "make_mpi_world()");
  MPI_Comm user = *static_cast<const MPI_Comm*>(mpi_comm);
  MC_CHECK(user != MPI_COMM_NULL, "make_mpi_communicator: the MPI communicator is MPI_COMM_NULL");
  MC_CHECK(options.timeout.count() > 0, "CommOptions.timeout must be positive, got {} ms", options.timeout.count());
  MPI_Comm dup = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(user, &dup);
  if (rc != MPI_SUCCESS) raise<CommError>("MPI_Comm_dup failed: {}", mpi_error_string(rc));
  return std::make_unique<MpiCommunicator>(dup, options);
}

}  // namespace megacore::comm
