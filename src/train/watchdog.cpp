#include "megacore/train/watchdog.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "megacore/comm/abort.hpp"

namespace megacore::train {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double timeout_of(const WatchdogOptions& o, WatchPhase p) {
  switch (p) {
    case WatchPhase::Startup: return o.startup_timeout_s;
    case WatchPhase::FirstStep: return o.first_step_timeout_s;
    case WatchPhase::Step: return o.step_timeout_s;
    case WatchPhase::Save: return o.save_timeout_s;
    case WatchPhase::Idle: return 0;
  }
  return 0;
}

std::string describe(WatchPhase p, int64_t step) {
  switch (p) {
    case WatchPhase::Startup: return "start-up (building the model, loading a checkpoint)";
    case WatchPhase::FirstStep: return fmt::format("step {} (the first of this run)", step);
    case WatchPhase::Step: return fmt::format("step {}", step);
    case WatchPhase::Save: return fmt::format("the checkpoint save after step {}", step);
    case WatchPhase::Idle: return "idle";
  }
  return "?";
}

// Writes `text` to `path` atomically (a reader never sees half a file).
void publish(const fs::path& path, const std::string& text) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp);
    f << text;
    if (!f) return;
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
}

bool read_text(const fs::path& path, std::string& out) {
  std::ifstream f(path);
  if (!f) return false;
  std::stringstream ss;
  ss << f.rdbuf();
  out = ss.str();
  return true;
}

const comm::FlightSnapshot* same_group(const std::vector<comm::FlightSnapshot>& recs, const comm::FlightSnapshot& g) {
  for (const auto& s : recs)
    if (s.group == g.group && s.world_ranks == g.world_ranks) return &s;
  return nullptr;
}

std::string last_op(const comm::FlightSnapshot& s) {
  for (auto it = s.entries.rbegin(); it != s.entries.rend(); ++it)
    if (!it->p2p) return fmt::format("#{} {}", it->seq, it->op);
  return s.collectives == 0 ? "none" : fmt::format("#{}", s.collectives);
}

// The group (and its entry) of the newest unfinished p2p batch of any group, or nullptr.
const comm::FlightSnapshot* newest_p2p_group(const std::vector<comm::FlightSnapshot>& recs,
                                             const comm::FlightEntry** entry) {
  const comm::FlightSnapshot* g = nullptr;
  *entry = nullptr;
  for (const auto& s : recs) {
    const comm::FlightEntry* e = s.pending_p2p();
    if (e && (!*entry || e->started_ago_s < (*entry)->started_ago_s)) g = &s, *entry = e;
  }
  return g;
}

// Where a peer of this rank's p2p batch in group `pg` is, from its published record: in a collective, in a p2p batch
// (of that group, or of another: on GPUs each direction between two stages is a communicator of its own), or in no
// communication at all.
std::string whereabouts(const std::vector<comm::FlightSnapshot>& peer, const comm::FlightSnapshot& pg) {
  const comm::FlightSnapshot* cg = nullptr;
  const comm::FlightEntry* ce = nullptr;
  for (const auto& s : peer) {
    const comm::FlightEntry* e = s.pending_collective();
    if (e && (!ce || e->started_ago_s > ce->started_ago_s)) cg = &s, ce = e;
  }
  if (ce)
    return fmt::format("waits in collective #{} {} of group '{}' ({:.1f} s)", ce->seq, ce->op, cg->group,
                       ce->started_ago_s);
  const comm::FlightSnapshot* ps = same_group(peer, pg);
  const comm::FlightEntry* pe = ps ? ps->pending_p2p() : nullptr;
  if (!pe) ps = newest_p2p_group(peer, &pe);
  if (pe)
    return fmt::format("waits in its p2p batch #{} of group '{}' ({:.1f} s) {}", pe->seq, ps->group, pe->started_ago_s,
                       comm::format_p2p_peers(*pe));
  if (const comm::FlightSnapshot* same = same_group(peer, pg))
    return fmt::format("is in no collective or p2p batch (its last p2p batch in group '{}': #{}): computing, or stuck "
                       "outside communication",
                       pg.group, same->p2p);
  return "is in no collective or p2p batch: computing, or stuck outside communication";
}

}  // namespace

const char* watch_phase_field(WatchPhase p) {
  switch (p) {
    case WatchPhase::Startup: return "trainer.startup_timeout_s";
    case WatchPhase::FirstStep: return "trainer.first_step_timeout_s";
    case WatchPhase::Step: return "trainer.step_timeout_s";
    case WatchPhase::Save: return "trainer.save_timeout_s";
    case WatchPhase::Idle: return "-";
  }
  return "?";
}

Watchdog::Watchdog(WatchdogOptions options) : o_(std::move(options)), last_(Clock::now()) {
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Watchdog::enter(WatchPhase phase, int64_t step) {
  std::lock_guard<std::mutex> l(mu_);
  phase_ = phase;
  step_ = step;
  last_ = Clock::now();
}

void Watchdog::beat() {
  std::lock_guard<std::mutex> l(mu_);
  last_ = Clock::now();
}

void Watchdog::run() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_) {
    cv_.wait_for(l, std::chrono::milliseconds(200));
    if (stop_) return;
    const double timeout = timeout_of(o_, phase_);
    const double idle = std::chrono::duration<double>(Clock::now() - last_).count();
    if (timeout > 0 && idle > timeout) {
      const WatchPhase p = phase_;
      const int64_t step = step_;
      l.unlock();
      fire(idle, p, step, timeout);
      return;
    }
  }
}

std::string Watchdog::to_json(const std::vector<comm::FlightSnapshot>& records) {
  json arr = json::array();
  for (const auto& s : records) {
    json entries = json::array();
    for (const auto& e : s.entries)
      entries.push_back({{"seq", e.seq}, {"p2p", e.p2p}, {"op", e.op}, {"bytes", e.bytes},
                         {"started_ago_s", e.started_ago_s}, {"done_ago_s", e.done_ago_s}, {"send_to", e.send_to},
                         {"recv_from", e.recv_from}});
    arr.push_back({{"group", s.group}, {"world_ranks", s.world_ranks}, {"rank", s.rank},
                   {"collectives", s.collectives}, {"p2p", s.p2p}, {"entries", entries}});
  }
  return arr.dump();
}

std::vector<comm::FlightSnapshot> Watchdog::from_json(const std::string& text) {
  std::vector<comm::FlightSnapshot> out;
  for (const json& g : json::parse(text)) {
    comm::FlightSnapshot s;
    s.group = g.at("group").get<std::string>();
    s.world_ranks = g.at("world_ranks").get<std::vector<int>>();
    s.rank = g.at("rank").get<int>();
    s.collectives = g.at("collectives").get<uint64_t>();
    s.p2p = g.at("p2p").get<uint64_t>();
    for (const json& e : g.at("entries"))
      s.entries.push_back({e.at("seq").get<uint64_t>(), e.at("p2p").get<bool>(), e.at("op").get<std::string>(),
                           e.at("bytes").get<int64_t>(), e.at("started_ago_s").get<double>(),
                           e.at("done_ago_s").get<double>(), e.value("send_to", std::vector<int>{}),
                           e.value("recv_from", std::vector<int>{})});
    out.push_back(std::move(s));
  }
  return out;
}

std::string Watchdog::report(int rank, const std::string& what, const std::vector<comm::FlightSnapshot>& mine,
                             const std::vector<std::vector<comm::FlightSnapshot>>& peers,
                             const std::vector<bool>& published) {
  auto peer_record = [&](int p, const comm::FlightSnapshot& g) -> const comm::FlightSnapshot* {
    if (p < 0 || size_t(p) >= peers.size() || !published[size_t(p)]) return nullptr;
    return same_group(peers[size_t(p)], g);
  };
  std::string head = fmt::format("megacore: watchdog: rank {}: {}", rank, what);
  // The collective this rank has waited in longest.
  const comm::FlightSnapshot* g = nullptr;
  const comm::FlightEntry* pending = nullptr;
  for (const auto& s : mine) {
    const comm::FlightEntry* e = s.pending_collective();
    if (e && (!pending || e->started_ago_s > pending->started_ago_s)) g = &s, pending = e;
  }
  if (pending) {
    head += fmt::format("; waiting in collective #{} {} ({}) of group '{}' for {:.1f} s", pending->seq, pending->op,
                        comm::format_bytes(pending->bytes), g->group, pending->started_ago_s);
    std::vector<std::string> missing;
    for (int p : g->world_ranks) {
      if (p == rank) continue;
      const comm::FlightSnapshot* ps = peer_record(p, *g);
      if (!ps) {
        const bool pub = p >= 0 && size_t(p) < published.size() && published[size_t(p)];
        missing.push_back(fmt::format("rank {} ({})", p, pub ? "its record has no such group" : "sent no record: dead, "
                                                                   "hung hard, or its watchdog is off"));
      } else if (ps->collectives < pending->seq) {
        missing.push_back(fmt::format("rank {} (its last collective there: {})", p, last_op(*ps)));
      }
    }
    head += missing.empty() ? "; every rank of the group had arrived (the operation itself is stuck)"
                            : fmt::format("; ranks that had not arrived: {}", fmt::join(missing, ", "));
  } else if (const comm::FlightEntry* e = nullptr; const comm::FlightSnapshot* pg = newest_p2p_group(mine, &e)) {
    // A point-to-point batch (pipeline sends and receives): its peers, and where each of them is.
    head += fmt::format("; waiting in p2p batch #{} {} ({}) of group '{}' for {:.1f} s {}", e->seq, e->op,
                        comm::format_bytes(e->bytes), pg->group, e->started_ago_s, comm::format_p2p_peers(*e));
    std::vector<int> peer_ranks = e->send_to;
    for (int p : e->recv_from)
      if (std::find(peer_ranks.begin(), peer_ranks.end(), p) == peer_ranks.end()) peer_ranks.push_back(p);
    std::vector<std::string> where;
    for (int p : peer_ranks) {
      if (p == rank) continue;
      const bool pub = p >= 0 && size_t(p) < published.size() && published[size_t(p)];
      if (!pub) {
        where.push_back(fmt::format("rank {} sent no record: dead, hung hard, or its watchdog is off", p));
        continue;
      }
      where.push_back(fmt::format("rank {} {}", p, whereabouts(peers[size_t(p)], *pg)));
    }
    if (!where.empty()) head += fmt::format("; {}", fmt::join(where, "; "));
  } else {
    head += "; not inside a collective or a p2p batch";
    std::vector<std::string> waiting;
    for (const auto& s : mine) {
      for (int p : s.world_ranks) {
        if (p == rank) continue;
        const comm::FlightSnapshot* ps = peer_record(p, s);
        const comm::FlightEntry* pe = ps ? ps->pending_collective() : nullptr;
        if (pe && pe->seq > s.collectives)
          waiting.push_back(fmt::format("rank {} in collective #{} {} of group '{}'", p, pe->seq, pe->op, s.group));
        // A peer's send/receive batch with this rank in it (a pipeline neighbour waiting for this stage).
        const comm::FlightEntry* pp = ps ? ps->pending_p2p() : nullptr;
        auto names = [&](const std::vector<int>& v) { return std::find(v.begin(), v.end(), rank) != v.end(); };
        if (pp && (names(pp->send_to) || names(pp->recv_from)))
          waiting.push_back(fmt::format("rank {} in p2p batch #{} of group '{}' {}", p, pp->seq, s.group,
                                        comm::format_p2p_peers(*pp)));
      }
    }
    if (!waiting.empty()) head += fmt::format("; waiting for this rank: {}", fmt::join(waiting, ", "));
  }
  return head + "\n" + fmt::format("megacore: watchdog: rank {}: flight record (last operations per group):\n", rank) +
         comm::format_flight_records(mine);
}

void Watchdog::fire(double idle_s, WatchPhase phase, int64_t step, double timeout_s) {
  const std::vector<comm::FlightSnapshot> mine = comm::flight_records();
  const size_t n = size_t(std::max(o_.world_size, o_.rank + 1));
  std::vector<std::vector<comm::FlightSnapshot>> peers(n);
  std::vector<bool> published(n, false);
  peers[size_t(o_.rank)] = mine;
  published[size_t(o_.rank)] = true;
  auto record_path = [&](int r) { return fs::path(o_.job_dir) / fmt::format("flight.{}.rank{}.json", o_.attempt, r); };
  if (!o_.job_dir.empty()) {
    publish(record_path(o_.rank), to_json(mine));
    const auto deadline = Clock::now() + std::chrono::duration<double>(o_.exchange_s);
    for (;;) {
      size_t got = 0;
      for (size_t r = 0; r < n; ++r) {
        std::string text;
        if (!published[r] && read_text(record_path(int(r)), text)) {
          try {
            peers[r] = from_json(text);
            published[r] = true;
          } catch (const std::exception&) {
          }
        }
        got += published[r];
      }
      if (got == n || Clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  const std::string what = fmt::format("{} made no progress for {:.1f} s ({} = {:g})", describe(phase, step), idle_s,
                                       watch_phase_field(phase), timeout_s);
  const std::string rep = report(o_.rank, what, mine, peers, published);
  std::fprintf(stderr, "%s", rep.c_str());
  std::fflush(stderr);
  if (!o_.job_dir.empty()) {  // the launcher's one-line summary names the first failure from these
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    const std::string first = rep.substr(0, rep.find('\n'));
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    const json err{{"rank", o_.rank}, {"time", now}, {"host", host},
                   {"error", first.substr(first.find(": watchdog: ") + 2)}};
    publish(fs::path(o_.job_dir) / fmt::format("error.rank{}.json", o_.rank), err.dump());
  }
  if (o_.on_timeout) {
    o_.on_timeout(rep);
    return;
  }
  if (o_.abort) {
    try {
      o_.abort();
    } catch (...) {
    }
  }
  comm::abort_job(kExitCode);
}

}  // namespace megacore::train
