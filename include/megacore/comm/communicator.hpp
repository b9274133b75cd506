// Communicator: collectives and point-to-point transfers over a group of ranks.
//
// Two backends implement it: NCCL for CUDA tensors and MPI for host tensors. Every operation is
// asynchronous and returns a Work handle; Work::wait() blocks the host until the operation is done,
// Work::wait_on(stream) only orders a stream after it (NCCL; MPI waits on the host). Every wait has a timeout
// (CommOptions::timeout): when it expires, when NCCL reports an error, or when a peer dies, the
// communicator is aborted and CommError names the group, the operation, the ranks and the elapsed
// time. Groups are values: make sub-groups with split(), pass them to layers explicitly.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "megacore/comm/flight_recorder.hpp"
#include "megacore/core/stream.hpp"
#include "megacore/core/tensor.hpp"

namespace megacore::comm {

enum class ReduceOp { Sum, Avg, Max, Min };
enum class Backend { MPI, NCCL };

std::string_view reduce_op_name(ReduceOp op);
std::string_view backend_name(Backend b);

/// Options of one communicator (and of those split from it, unless overridden).
struct CommOptions {
  /// Longest time any one operation may take before the communicator is aborted with CommError.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  /// Name used in logs and errors ("world", "tp", "dp", ...), and as NCCL's commName.
  std::string name = "world";
  /// Before each collective, agree on (op, dtype, element count) across ranks, so a mismatch is a
  /// clear error instead of a hang or corrupted data. Costs one small extra exchange per operation.
  bool check_shapes = false;
  /// NCCL only: operations are enqueued by blocking NCCL calls (ncclConfig_t.blocking = 1, as
  /// PyTorch does). NCCL (2.2x) launches each operation of a non-blocking communicator from a new
  /// thread, which costs ~100-200 µs per call; blocking calls cost a few µs. Both modes are timed out:
  /// initialisation is always non-blocking (a blocking communicator is split off the initialised one),
  /// a Work that does not complete is aborted by wait() or by the watchdog, and a call stuck inside
  /// NCCL (connection setup with a dead peer) is aborted by the watchdog, which makes it return.
  /// false keeps every call non-blocking and polled (slower; for debugging enqueue-side hangs).
  bool nccl_blocking = true;
  /// NCCL only: CTA limits (0 = NCCL's default).
  int nccl_min_ctas = 0;
  int nccl_max_ctas = 0;
  /// NCCL only: ncclConfig_t.CTAPolicy. 0 = NCCL's default; 1 = efficiency (as few CTAs as give
  /// decent speed: for collectives that overlap compute); 2 = zero-CTA where NCCL can (copy engines;
  /// needs registered symmetric buffers, otherwise NCCL falls back to its kernels).
  int nccl_cta_policy = 0;
  /// NCCL only: all-gathers, sum reduce-scatters and send/receive batches move by the GPUs' copy engines
  /// over NVLink/P2P (CUDA IPC staging buffers and stream-ordered flags) instead of NCCL's kernels, so they
  /// need no SM and run beside kernels that hold every SM (cuDNN's attention), when every rank of the group
  /// is on this host and can map its peers' memory; otherwise the group says so once in the log and keeps
  /// NCCL. Set up when the communicator is made (collective). Other ops and reductions stay on NCCL. The
  /// context-parallel group's setting is parallel.cp_comm_copy_engine.
  bool copy_engine = false;
  /// Device memory each rank of a copy-engine group stages its all-gathers and reduce-scatters through (two
  /// slots; a collective larger than a slot's share per rank is moved in chunks). Send/receive batches stage
  /// nothing: the receiver reads the sender's tensor.
  size_t copy_engine_buffer_bytes = size_t(128) << 20;
};

/// Handle of an asynchronous operation.
class Work {
 public:
  virtual ~Work() = default;
  /// Blocks until the operation is done; throws CommError on timeout or failure.
  virtual void wait() = 0;
  /// True once the operation has finished (never throws; a failure surfaces in wait()).
  virtual bool is_completed() = 0;
  /// Orders the work queued on stream `s` after the operation without blocking the host where the
  /// backend allows it: NCCL makes `s` wait for the operation's completion event (nothing at all when
  /// `s` is the stream it ran on); MPI, whose operations progress on the host, waits as wait() does.
  /// The timeout and the error checks of an operation nobody host-waits are the NCCL watchdog's: it
  /// aborts the communicator, which lets the waiting streams go on, and the next operation or wait on
  /// that communicator throws CommError with the reason. Use it where the result is consumed on a
  /// stream (the layers' TP collectives, pipeline receives); use wait() where the host needs it.
  virtual void wait_on(const Stream& s) {
    (void)s;
    wait();
  }
};
using WorkPtr = std::shared_ptr<Work>;

/// One send or receive of a batch (see Communicator::batch_send_recv).
struct P2POp {
  enum Kind { Send, Recv } kind;
  Tensor tensor;  ///< contiguous; for Recv it is written
  int peer;       ///< rank in this communicator
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return options_.name; }
  const CommOptions& options() const { return options_; }
  /// World ranks of this group's members, in group-rank order.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  virtual Backend backend() const = 0;
  /// Where this communicator's tensors must live: the CPU for MPI, its CUDA device for NCCL.
  virtual Device device() const { return Device::cpu(); }
  /// True when this group's all-gathers, sum reduce-scatters and send/receive batches move by copy engines
  /// (CommOptions::copy_engine, and the setup found every rank able).
  virtual bool copy_engine_active() const { return false; }

  /// In place: every rank ends with op over all ranks' t.
  virtual WorkPtr all_reduce(Tensor& t, ReduceOp op = ReduceOp::Sum, const Stream& s = {}) = 0;
  /// out (size() * in.numel() elements, contiguous) holds rank r's `in` at [r * n, (r + 1) * n).
  virtual WorkPtr all_gather(const Tensor& in, Tensor& out, const Stream& s = {}) = 0;
  /// in has size() * out.numel() elements; rank r gets op over all ranks of in[r * n, (r + 1) * n).
  virtual WorkPtr reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op = ReduceOp::Sum, const Stream& s = {}) = 0;
  /// In place: every rank ends with root's t.
  virtual WorkPtr broadcast(Tensor& t, int root, const Stream& s = {}) = 0;
  /// Rank r sends in[send_offsets[p] .. +send_counts[p]) to p and receives recv_counts[p] elements
  /// from p, stored consecutively in `out` in rank order. Empty counts mean an even split.
  virtual WorkPtr all_to_all(const Tensor& in, Tensor& out, const std::vector<int64_t>& send_counts = {},
                             const std::vector<int64_t>& recv_counts = {}, const Stream& s = {}) = 0;
  /// Posts all sends and receives together (no ordering deadlock between them).
  virtual WorkPtr batch_send_recv(const std::vector<P2POp>& ops, const Stream& s = {}) = 0;
  /// Returns when every rank has entered it (within the timeout).
  virtual void barrier() = 0;
  /// Collective over this communicator: ranks with the same color form a new communicator, ordered
  /// by (key, rank). A negative color returns nullptr (the rank joins no group).
  virtual std::unique_ptr<Communicator> split(int color, int key, const CommOptions& options) = 0;
  /// Tears the communicator down without waiting for peers; later operations throw CommError.
  virtual void abort() = 0;
  virtual bool aborted() const = 0;
  /// The record of this communicator's last operations (comm/flight_recorder.hpp); null for backends
  /// that keep none.
  const FlightRecorder* flight_recorder() const { return flight_.get(); }

 protected:
  int rank_ = 0;
  int size_ = 1;
  CommOptions options_;
  std::vector<int> world_ranks_;
  std::shared_ptr<FlightRecorder> flight_;  ///< made by the backend once rank_ and world_ranks_ are known
};

/// Throws CommError if the NCCL watchdog has aborted a communicator of this process since the last call
/// (each abort is reported once, with its reason). Operations nobody host-waits (Work::wait_on) fail
/// silently on the device once aborted: call this at host synchronisation points (the trainer does it
/// every step; Python's megacore.synchronize does it after synchronising).
void check_health();

}  // namespace megacore::comm
