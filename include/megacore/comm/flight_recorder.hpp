// FlightRecorder: the last operations of one communicator, kept for the post-mortem of a hang.
//
// Every MPI and NCCL communicator appends one entry per operation it starts (op name, this rank's bytes, a
// sequence number, start time) and marks it done when it sees the operation finish. Collectives are numbered
// in their own sequence, separate from point-to-point batches: every rank of a group posts the same
// collectives in the same order, so collective number k names the same operation on every rank, and a rank
// whose last started collective is below k has not arrived at it. The buffer is a fixed ring (a few dozen
// entries), so recording costs one short critical section and no allocation per operation.
//
// flight_records() snapshots every live communicator of the process: the trainer's watchdog
// (train/watchdog.hpp) prints it, with the ranks that had not arrived, when a step stops making progress.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace megacore::comm {

/// The peers of a point-to-point batch, as ranks of its communicator: the first kMax distinct ones it sends to and
/// receives from (a pipeline batch has at most two of each). Fixed arrays: recording one allocates nothing.
struct FlightPeers {
  static constexpr int kMax = 4;
  int send[kMax] = {}, recv[kMax] = {};
  int n_send = 0, n_recv = 0;
  void add(bool is_send, int peer) {
    int* v = is_send ? send : recv;
    int& n = is_send ? n_send : n_recv;
    for (int i = 0; i < n; ++i)
      if (v[i] == peer) return;
    if (n < kMax) v[n++] = peer;
  }
};

/// One recorded operation.
struct FlightEntry {
  uint64_t seq = 0;            ///< 1-based, per kind (collectives and point-to-point batches count apart)
  bool p2p = false;            ///< a send/receive batch, not a collective
  std::string op;              ///< "all_reduce", "all_gather", "batch_send_recv", "barrier", ...
  int64_t bytes = 0;           ///< this rank's payload (its input buffer; sends plus receives for a batch)
  double started_ago_s = 0;    ///< seconds before the snapshot that it started
  double done_ago_s = -1;      ///< seconds before the snapshot that it was seen finished; < 0 = not finished
  std::vector<int> send_to, recv_from;  ///< a p2p batch's peers as world ranks (FlightPeers' first ones)
  bool done() const { return done_ago_s >= 0; }
};

/// What one communicator has recorded, at one moment.
struct FlightSnapshot {
  std::string group;             ///< the communicator's name ("world", "tp", "dp", ...)
  std::vector<int> world_ranks;  ///< its members, in group-rank order
  int rank = 0;                  ///< this process's rank in it
  uint64_t collectives = 0;      ///< collectives started (= the last one's seq)
  uint64_t p2p = 0;              ///< point-to-point batches started
  std::vector<FlightEntry> entries;  ///< the newest ones, oldest first
  /// The oldest collective that has started but not finished, or nullptr.
  const FlightEntry* pending_collective() const;
  /// The newest point-to-point batch that has started but not finished, or nullptr: the one the host waits in (an
  /// older unfinished one is a send batch a pipeline waits for only at the end of its schedule).
  const FlightEntry* pending_p2p() const;
};

class FlightRecorder {
 public:
  static constexpr size_t kDefaultCapacity = 32;

  /// A recorder listed by flight_records() for as long as it lives.
  static std::shared_ptr<FlightRecorder> create(std::string group, std::vector<int> world_ranks, int rank,
                                                size_t capacity = kDefaultCapacity);

  /// Records the start of an operation; returns its id for done(). `peers`: a p2p batch's (ranks of this group).
  uint64_t start(std::string_view op, int64_t bytes, bool p2p = false, const FlightPeers* peers = nullptr);
  /// Marks operation `id` finished (a no-op when the ring has already dropped it).
  void done(uint64_t id);
  FlightSnapshot snapshot() const;

 private:
  FlightRecorder(std::string group, std::vector<int> world_ranks, int rank, size_t capacity);
  using Clock = std::chrono::steady_clock;
  struct Slot {
    uint64_t id = 0;  // 0 = empty
    uint64_t seq = 0;
    bool p2p = false;
    std::string op;
    int64_t bytes = 0;
    FlightPeers peers;
    Clock::time_point start, end;
    bool done = false;
  };
  mutable std::mutex mu_;
  std::string group_;
  std::vector<int> world_ranks_;
  int rank_;
  std::vector<Slot> ring_;
  uint64_t next_id_ = 1, collectives_ = 0, p2p_ = 0;
};

/// Snapshots of every live communicator of this process (creation order). Thread-safe.
std::vector<FlightSnapshot> flight_records();

/// "512 B", "4.0 KiB", "1.5 MiB".
std::string format_bytes(int64_t bytes);

/// A p2p batch's peers: "(sending to rank 3, receiving from rank 1)" (world ranks).
std::string format_p2p_peers(const FlightEntry& e);

/// Human-readable lines, one per communicator, with its last `last_n` operations.
std::string format_flight_records(const std::vector<FlightSnapshot>& records, size_t last_n = 4);

}  // namespace megacore::comm
