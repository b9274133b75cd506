#include "megacore/comm/flight_recorder.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace megacore::comm {
namespace {

// The registry of live recorders: diagnostics only (read by the watchdog thread), never consulted by the
// operations themselves. Never destroyed, so a recorder that outlives static destruction can still unlist.
struct Registry {
  std::mutex mu;
  std::vector<std::weak_ptr<FlightRecorder>> all;
};
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

}  // namespace

std::string format_bytes(int64_t b) {
  if (b >= (int64_t(1) << 20)) return fmt::format("{:.1f} MiB", double(b) / double(1 << 20));
  if (b >= 1024) return fmt::format("{:.1f} KiB", double(b) / 1024.0);
  return fmt::format("{} B", b);
}

const FlightEntry* FlightSnapshot::pending_collective() const {
  for (const FlightEntry& e : entries)
    if (!e.p2p && !e.done()) return &e;
  return nullptr;
}

const FlightEntry* FlightSnapshot::pending_p2p() const {
  for (auto it = entries.rbegin(); it != entries.rend(); ++it)
    if (it->p2p && !it->done()) return &*it;
  return nullptr;
}

std::shared_ptr<FlightRecorder> FlightRecorder::create(std::string group, std::vector<int> world_ranks, int rank,
                                                       size_t capacity) {
  std::shared_ptr<FlightRecorder> r(new FlightRecorder(std::move(group), std::move(world_ranks), rank, capacity));
  Registry& reg = registry();
  std::lock_guard<std::mutex> l(reg.mu);
  std::erase_if(reg.all, [](const auto& w) { return w.expired(); });
  reg.all.push_back(r);
  return r;
}

FlightRecorder::FlightRecorder(std::string group, std::vector<int> world_ranks, int rank, size_t capacity)
    : group_(std::move(group)), world_ranks_(std::move(world_ranks)), rank_(rank),
      ring_(std::max<size_t>(capacity, 1)) {}

uint64_t FlightRecorder::start(std::string_view op, int64_t bytes, bool p2p, const FlightPeers* peers) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> l(mu_);
  const uint64_t id = next_id_++;
  Slot& s = ring_[id % ring_.size()];
  s.id = id;
  s.seq = p2p ? ++p2p_ : ++collectives_;
  s.p2p = p2p;
  s.op.assign(op);  // op names fit the small-string buffer: no allocation
  s.bytes = bytes;
  s.peers = peers ? *peers : FlightPeers{};
  s.start = now;
  s.done = false;
  return id;
}

void FlightRecorder::done(uint64_t id) {
  const auto now = Clock::now();
  std::lock_guard<std::mutex> l(mu_);
  Slot& s = ring_[id % ring_.size()];
  if (s.id != id) return;
  s.end = now;
  s.done = true;
}

FlightSnapshot FlightRecorder::snapshot() const {
  const auto now = Clock::now();
  auto ago = [&](Clock::time_point t) { return std::chrono::duration<double>(now - t).count(); };
  std::lock_guard<std::mutex> l(mu_);
  FlightSnapshot s{group_, world_ranks_, rank_, collectives_, p2p_, {}};
  const uint64_t first = next_id_ > ring_.size() ? next_id_ - ring_.size() : 1;
  for (uint64_t id = first; id < next_id_; ++id) {
    const Slot& x = ring_[id % ring_.size()];
    if (x.id != id) continue;
    FlightEntry e{x.seq, x.p2p, x.op, x.bytes, ago(x.start), x.done ? ago(x.end) : -1.0, {}, {}};
    auto world = [&](int r) { return r >= 0 && size_t(r) < world_ranks_.size() ? world_ranks_[size_t(r)] : r; };
    for (int i = 0; i < x.peers.n_send; ++i) e.send_to.push_back(world(x.peers.send[i]));
    for (int i = 0; i < x.peers.n_recv; ++i) e.recv_from.push_back(world(x.peers.recv[i]));
    s.entries.push_back(std::move(e));
  }
  return s;
}

std::vector<FlightSnapshot> flight_records() {
  std::vector<std::shared_ptr<FlightRecorder>> live;
  {
    Registry& reg = registry();
    std::lock_guard<std::mutex> l(reg.mu);
    for (const auto& w : reg.all)
      if (auto r = w.lock()) live.push_back(std::move(r));
  }
  std::vector<FlightSnapshot> out;
  out.reserve(live.size());
  for (const auto& r : live) out.push_back(r->snapshot());
  return out;
}

std::string format_p2p_peers(const FlightEntry& e) {
  std::vector<std::string> parts;
  if (!e.send_to.empty()) parts.push_back(fmt::format("sending to rank {}", fmt::join(e.send_to, ", ")));
  if (!e.recv_from.empty()) parts.push_back(fmt::format("receiving from rank {}", fmt::join(e.recv_from, ", ")));
  return fmt::format("({})", fmt::join(parts, ", "));
}

std::string format_flight_records(const std::vector<FlightSnapshot>& records, size_t last_n) {
  std::string out;
  std::vector<std::string> idle;
  for (const FlightSnapshot& s : records) {
    if (s.collectives == 0 && s.p2p == 0) {  // one line for all the groups that never ran anything
      idle.push_back(fmt::format("'{}'", s.group));
      continue;
    }
    out += fmt::format("  group '{}' (world ranks {}), rank {}: {} collectives, {} p2p batches", s.group,
                       fmt::join(s.world_ranks, ","), s.rank, s.collectives, s.p2p);
    const size_t n = std::min(last_n, s.entries.size());
    if (n > 0) out += "; last:";
    for (size_t i = s.entries.size() - n; i < s.entries.size(); ++i) {
      const FlightEntry& e = s.entries[i];
      out += fmt::format(" {}#{} {} {}", e.p2p ? "p2p " : "", e.seq, e.op, format_bytes(e.bytes));
      if (!e.send_to.empty() || !e.recv_from.empty()) out += " " + format_p2p_peers(e);
      out += e.done() ? fmt::format(" (took {:.3f} s)", e.started_ago_s - e.done_ago_s)
                      : fmt::format(" (NOT FINISHED, started {:.1f} s ago)", e.started_ago_s);
      out += i + 1 < s.entries.size() ? ";" : "";
    }
    out += "\n";
  }
  if (!idle.empty()) out += fmt::format("  groups without operations: {}\n", fmt::join(idle, ", "));
  return out;
}

}  // namespace megacore::comm
