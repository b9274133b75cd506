// Copy-engine transfers for a group whose ranks share one host and NVLink/P2P (CommOptions::copy_engine):
// all-gathers, sum reduce-scatters and send/receive batches. The group's use is the context-parallel ring
// (parallel.cp_comm_copy_engine), whose K/V and dK/dV passes must run while the attention kernels hold every
// SM: NCCL's send/receive kernels then wait for the attention kernel to end, copy engines do not need SMs.
//
// Each rank owns one device buffer, opened by its peers through CUDA IPC, in two areas and a block of
// 64-bit flags. Every wait reads a flag in the waiting rank's own memory; every write goes to the peer's.
//
// Collectives (the first area: two staging slots, each cut into one piece per rank). A collective is cut
// into chunks; chunk q (a sequence number every rank counts alike, since collectives are issued in the same
// order) uses slot q % 2. Per chunk:
//   on a push stream forked from the caller's stream:
//   1. wait until every peer has consumed what this rank pushed into its slot the last time
//      (consumed[p][slot] >= q - 2, written by the peer; cuStreamWaitValue64);
//   2. push this rank's piece into each peer's slot (cudaMemcpyAsync to the peer's mapping: a copy
//      engine writing over NVLink), then write q into the peer's ready[me][slot] flag
//      (cuStreamWriteValue64, which fences the copy first);
//   on the caller's stream, one kernel:
//   3. all-gather: copy this rank's own piece into `out` while the pushes run, wait for ready[p][slot] >= q
//      from each peer, copy the peer's piece from the slot into `out`; reduce-scatter: wait for every
//      peer's piece, sum the own piece and the peers' pieces in rank order (f32 accumulation) into `out`;
//   4. the kernel's last block writes q into each peer's consumed[me][slot].
// Waiting inside the kernel rather than with stream memory operations on the caller's stream matters there:
// each wait or write on that stream drains it first and costs several microseconds of bubble.
//
// Send/receive batches move no byte through the slots: the receiver's copy engine reads the sender's tensor
// straight into its own (a peer copy, cudaMemcpyAsync from the sender's memory as mapped here). A copy
// within one GPU would not do: the driver runs it as a kernel, which waits for SMs like NCCL's (measured on
// H200: a 64 MB local copy issued beside a kernel holding every SM ends with that kernel, 10 ms later; a
// peer copy, push or pull, ends in 0.2 ms). Sends and receives pair per directed pair of ranks in issue
// order, as NCCL's do: the k-th send of rank a to rank b is b's k-th receive from a, each side counting its
// own. The receiver's host must know where the sender's tensor is before it enqueues the copy, so the
// group shares a small host mailbox (POSIX shared memory; the group is on one host): per directed pair, the
// sender posts k with the tensor's CUDA IPC handle (its allocation's), offset and size when it enqueues
// the send, and the receiver's host reads it (waiting for the post, under the communicator's timeout and
// abort) when it enqueues the receive, opening the allocation once and keeping the mapping. A batch posts
// all its sends before it waits for any receive, so ranks that issue batches in the same order never wait
// for each other's hosts in a circle. Then on the GPUs:
//   sender, on the push stream (forked from the caller's stream, so after the tensor's producers): write k
//   into b's p2p_ready[a], then wait for its own p2p_consumed[b] >= k (b has read it) before joining the
//   caller's stream, so the tensor is neither freed nor overwritten while it is read;
//   receiver, on a second stream: wait for its own p2p_ready[a] >= k, copy (peer read, copy engine), write k
//   into a's p2p_consumed[b].
// A receive's byte count must equal the send's, as for NCCL; here a mismatch is an error naming both.
// Nothing blocks the host but the mailbox. A batch posts and reads in one progress loop (a send waits for
// mailbox room while the receives already posted to this rank are read), so any number of transfers per
// pair fits the mailbox's fixed depth.
//
// A mapped sender allocation must not be returned to the driver while a peer maps it, or the peer's mapping
// keeps memory the sender believes freed. So the sender pins the allocation in megacore's caching allocator
// (Allocator::pin) the first time it posts it: empty_cache and the out-of-memory retry leave it cached and
// reusable at least until the communicator ends (see teardown below). A send tensor that is not the caching
// allocator's (memory from torch or the user) is posted as "by NCCL": both sides then move it with NCCL's
// send/receive, in the batch's order, after the copy-engine part (PeerCopyTransfer::nccl).
//
// An abort of the communicator writes every flag to its largest value (release()), which lets a stream or
// kernel waiting for a dead peer go on; the abort itself is what reports the failure. Teardown waits for the
// device under the communicator's timeout, writing the flags to their largest value again while it waits
// (a slower peer's late write can lower one), then closes every mapping, and unpins this rank's allocations
// if every rank of the group has already closed its mappings or ended (the mailbox records both; no waiting:
// otherwise, and after an abort, they stay pinned, cached and reusable, until the process ends).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "megacore/core/dtype.hpp"

namespace megacore::comm::detail {

constexpr int kPeerCopyMaxRanks = 16;

/// One chunk's work for the finishing kernel (peer_copy_kernels.cu), indexed by rank: the peers' pieces
/// arrive in this rank's slot (piece[p], announced by ready[p] >= q); piece[rank] is this rank's own piece.
/// All-gather: piece[r] goes to dst[r]. Reduce-scatter: dst[0] = sum over r of piece[r], in rank order.
/// After every block is done reading the slot, the last one writes q into each peer's consumed[p].
struct FinishArgs {
  const void* piece[kPeerCopyMaxRanks];
  void* dst[kPeerCopyMaxRanks];
  uint64_t* ready[kPeerCopyMaxRanks];
  uint64_t* consumed[kPeerCopyMaxRanks];
  unsigned long long* counter;  // blocks done with this slot (reset by the last)
  uint64_t q;
  int64_t bytes;
  int rank, size;
};

/// One transfer of a send/receive batch: `bytes` from `data` to rank `peer` (send), or from rank `peer` into
/// `data` (receive). Both ranks give the same byte count, as NCCL's send/receive require. `source` is filled
/// by PeerCopy::post_and_match for receives: the sender's tensor as mapped here.
struct PeerCopyTransfer {
  bool send = false;
  int peer = 0;
  void* data = nullptr;
  size_t bytes = 0;
  const void* source = nullptr;
  uint64_t seq = 0;  // set by post_and_match: the pair's sequence number of this transfer
  bool nccl = false;  // set by post_and_match: moved by NCCL (the send tensor is not the caching allocator's)
};

struct PeerCopyMailbox;  // the host mailbox (peer_copy.cpp)

class PeerCopy {
 public:
  /// An all-gather of host integers over the group (every rank's `mine`, concatenated in rank order).
  using GatherFn = std::function<std::vector<int64_t>(const std::vector<int64_t>&)>;

  /// Collective over the group: allocates this rank's buffer (`buffer_bytes`, split into two slots, plus the
  /// flags) and the host mailbox,
  /// exchanges IPC handles through `gather` and opens the peers'. Every rank returns the same answer: an
  /// object, or null with `why` saying what the group lacks (ranks on different hosts, no IPC or stream
  /// memory operations on this device), in which case the caller keeps NCCL's kernels.
  static std::shared_ptr<PeerCopy> create(int rank, int size, int device, size_t buffer_bytes,
                                          std::chrono::milliseconds timeout, const GatherFn& gather,
                                          std::string* why);
  ~PeerCopy();
  PeerCopy(const PeerCopy&) = delete;
  PeerCopy& operator=(const PeerCopy&) = delete;

  /// out (size * bytes_per_rank) holds rank r's `in` at r * bytes_per_rank. Enqueued on `stream`.
  cudaError_t all_gather(const void* in, void* out, size_t bytes_per_rank, cudaStream_t stream);
  /// out (count elements) = sum over ranks of in[rank * count, +count); f32, bf16 or f16.
  cudaError_t reduce_scatter_sum(const void* in, void* out, int64_t count, DType dtype, cudaStream_t stream);
  /// Host half of a send/receive batch: posts every send's tensor in the mailbox and reads the peers' posts
  /// of every receive, mapping their tensors (t.source) or marking the transfer t.nccl. An empty string, or
  /// what went wrong (a peer that posted nothing within `timeout` or before `aborted()` turned true, a size
  /// mismatch, a mapping that failed). Every transfer of a batch goes through this once, then through
  /// send_recv (which skips the t.nccl ones: the caller moves those with NCCL).
  std::string post_and_match(std::vector<PeerCopyTransfer>& transfers, std::chrono::milliseconds timeout,
                             const std::function<bool()>& aborted);
  /// Device half: the flags and peer copies, on streams forked from `stream`, which waits for them all.
  /// Transfers marked nccl are left out.
  cudaError_t send_recv(const std::vector<PeerCopyTransfer>& transfers, cudaStream_t stream);
  /// True when the copy-engine reduce-scatter handles `dtype`.
  static bool sums(DType dtype) { return dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16; }

  /// Lets every stream waiting on one of this rank's flags go on (writes them to their largest value);
  /// called by the communicator's abort. The data of the collectives it releases is garbage.
  void release() noexcept;

 private:
  PeerCopy() = default;
  // Flag addresses: this rank's own flags (waited on), and the same flag in a peer's buffer (written).
  uint64_t* ready_flag(int base_rank, int from, int slot) const;
  uint64_t* consumed_flag(int base_rank, int from, int slot) const;
  // Send/receive: in base_rank's memory, the flag `from` writes when its latest send to base_rank may be
  // read, and the flag `to` writes when it has read base_rank's latest send to it.
  uint64_t* p2p_ready_flag(int base_rank, int from) const;
  uint64_t* p2p_consumed_flag(int base_rank, int to) const;
  char* slot_piece(int owner, int slot, int from) const;
  size_t flag_count() const { return size_t(2) * size_ * kSlots + size_t(2) * size_; }  // released by release()
  // The peer allocation behind an IPC handle, opened once (null with `why` set when opening failed).
  char* mapped(const void* handle, std::string* why);
  // Pins a send tensor's allocation (once per allocation): false when it is not the caching allocator's.
  bool pin_allocation(void* base);
  // The device sync of teardown, bounded (see the header comment); false when it gave up waiting.
  bool drain_device();
  cudaError_t wait_flag(cudaStream_t s, uint64_t* flag, uint64_t value) const;
  cudaError_t write_flag(cudaStream_t s, uint64_t* flag, uint64_t value) const;
  unsigned long long* counter(int slot) const;
  cudaError_t begin_chunk(cudaStream_t s, uint64_t q) const;  // step 1
  FinishArgs finish_args(uint64_t q, int slot) const;
  cudaError_t fork(cudaStream_t s);  // push_ waits for s
  cudaError_t join(cudaStream_t s);  // s waits for push_

  int rank_ = 0, size_ = 1, device_ = 0;
  static constexpr int kSlots = 2;
  size_t slot_bytes_ = 0, chunk_bytes_ = 0, flags_offset_ = 0;
  std::vector<uint64_t> sent_, received_;  // sends / receives so far, per peer
  std::shared_ptr<PeerCopyMailbox> mailbox_;
  std::vector<std::pair<std::string, char*>> opened_;  // IPC handle bytes -> the peer allocation mapped here
  std::vector<void*> pinned_;                          // this rank's allocations pinned for its peers
  std::chrono::milliseconds timeout_{0};
  std::atomic<bool> released_{false};
  char* own_ = nullptr;           // this rank's buffer
  std::vector<char*> base_;       // base_[r]: rank r's buffer as mapped here (own_ for r == rank_)
  uint64_t seq_ = 0;              // chunks issued so far
  void* wait_fn_ = nullptr;       // cuStreamWaitValue64
  void* write_fn_ = nullptr;      // cuStreamWriteValue64
  void* range_fn_ = nullptr;      // cuMemGetAddressRange
  cudaStream_t push_ = nullptr;   // the pushes (copy engine) and their flags, beside the finishing kernels
  cudaStream_t recv_ = nullptr;   // the send/receive batches' receives: peer copies and their flags
  cudaEvent_t fork_ = nullptr, join_ = nullptr, join_recv_ = nullptr;
};

/// The finishing kernels (peer_copy_kernels.cu): wait for the peers' pieces, copy or sum them into place,
/// then tell the peers the slot is free.
cudaError_t peer_copy_finish_gather(const FinishArgs& a, cudaStream_t stream);
cudaError_t peer_copy_finish_sum(const FinishArgs& a, DType dtype, cudaStream_t stream);

}  // namespace megacore::comm::detail
