// Watchdog: the report names the collective a rank waits in and the ranks that had not arrived (from the
// peers' published records), the p2p batch it waits in and where each of its peers is, or the peers waiting for a
// rank outside any collective; the records survive
// their JSON exchange; a watchdog fires once its phase's timeout passes without a beat, and not while beaten.
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "test_helpers.hpp"
#include "megacore/train/watchdog.hpp"

using namespace megacore;
using namespace megacore::train;
using comm::FlightEntry;
using comm::FlightSnapshot;

namespace {

FlightSnapshot group(std::string name, std::vector<int> ranks, int rank, uint64_t done_collectives, bool pending) {
  FlightSnapshot s;
  s.group = std::move(name);
  s.world_ranks = std::move(ranks);
  s.rank = rank;
  s.collectives = done_collectives + (pending ? 1 : 0);
  for (uint64_t k = done_collectives > 2 ? done_collectives - 2 : 1; k <= done_collectives; ++k)
    s.entries.push_back(FlightEntry{k, false, "all_gather", 4096, 5.0, 4.9});
  if (pending) s.entries.push_back(FlightEntry{s.collectives, false, "all_reduce", 4, 3.2, -1});
  return s;
}

}  // namespace

TEST_CASE("watchdog report names the waiting collective and the ranks that had not arrived", "[train][watchdog]") {
  // World of 4; group 'tp' = {0, 1}, 'dp' = {0, 2}. Rank 0 waits in tp collective #8; rank 1 stopped at #7;
  // rank 3 published nothing (dead); in 'dp' rank 2 is level with rank 0.
  std::vector<FlightSnapshot> r0{group("tp", {0, 1}, 0, 7, true), group("dp", {0, 2}, 0, 3, false)};
  std::vector<FlightSnapshot> r1{group("tp", {0, 1}, 1, 7, false)};
  std::vector<FlightSnapshot> r2{group("dp", {0, 2}, 1, 3, false)};
  std::vector<std::vector<FlightSnapshot>> peers{r0, r1, r2, {}};
  const std::vector<bool> published{true, true, true, false};

  const std::string a = Watchdog::report(0, "step 5 made no progress", r0, peers, published);
  const std::string head0 = a.substr(0, a.find('\n'));
  CHECK(head0 == "megacore: watchdog: rank 0: step 5 made no progress; waiting in collective #8 all_reduce (4 B) of "
                 "group 'tp' for 3.2 s; ranks that had not arrived: rank 1 (its last collective there: #7 all_gather)");
  CHECK(a.find("group 'dp' (world ranks 0,2), rank 0: 3 collectives") != std::string::npos);

  const std::string b = Watchdog::report(1, "step 4 made no progress", r1, peers, published);
  CHECK(b.substr(0, b.find('\n')) == "megacore: watchdog: rank 1: step 4 made no progress; not inside a collective or "
                                     "a p2p batch; waiting for this rank: rank 0 in collective #8 all_reduce of group "
                                     "'tp'");

  // A group with a member that sent no record: it is named as such.
  std::vector<FlightSnapshot> w0{group("world", {0, 3}, 0, 2, true)};
  const std::string c = Watchdog::report(0, "x", w0, {w0, {}, {}, {}}, published);
  CHECK(c.find("ranks that had not arrived: rank 3 (sent no record: dead, hung hard, or its watchdog is off)") !=
        std::string::npos);
  // Everyone arrived: the operation itself is stuck.
  std::vector<FlightSnapshot> w3{group("world", {0, 3}, 1, 2, true)};
  const std::string d = Watchdog::report(0, "x", w0, {w0, {}, {}, w3}, {true, false, false, true});
  CHECK(d.find("every rank of the group had arrived") != std::string::npos);
}

TEST_CASE("watchdog report names a waiting p2p batch's peers and where each of them is", "[train][watchdog]") {
  // World of 4, pipeline group 'pp' = {0, 1, 2}, 'dp' = {1, 3}. Rank 0 waits in p2p batch #5 (sending to rank 1,
  // receiving from rank 2); rank 1 waits in dp's all_reduce #4; rank 2 waits in its own p2p batch with rank 0.
  auto pp = [](int rank, uint64_t batches, bool pending, std::vector<int> to, std::vector<int> from) {
    FlightSnapshot s = group("pp", {0, 1, 2}, rank, 0, false);
    s.p2p = batches;
    s.entries.push_back(FlightEntry{batches - 1, true, "batch_send_recv", 64, 9.0, 8.9, {}, {}});
    s.entries.push_back(FlightEntry{batches, true, "batch_send_recv", 128, 6.5, pending ? -1.0 : 6.4, to, from});
    return s;
  };
  std::vector<FlightSnapshot> r0{pp(0, 5, true, {1}, {2})};
  std::vector<FlightSnapshot> r1{pp(1, 5, false, {2}, {0}), group("dp", {1, 3}, 0, 3, true)};
  std::vector<FlightSnapshot> r2{pp(2, 5, true, {0}, {1})};
  const std::vector<bool> all{true, true, true, true};
  const std::string a = Watchdog::report(0, "step 7 made no progress", r0, {r0, r1, r2, {}}, all);
  CHECK(a.substr(0, a.find('\n')) ==
        "megacore: watchdog: rank 0: step 7 made no progress; waiting in p2p batch #5 batch_send_recv (128 B) of group "
        "'pp' for 6.5 s (sending to rank 1, receiving from rank 2); rank 1 waits in collective #4 all_reduce of group "
        "'dp' (3.2 s); rank 2 waits in its p2p batch #5 of group 'pp' (6.5 s) (sending to rank 0, receiving from rank 1)");
  // The flight record lines carry the peers too.
  CHECK(a.find("p2p #5 batch_send_recv 128 B (sending to rank 1, receiving from rank 2) (NOT FINISHED") !=
        std::string::npos);
  // A peer that published nothing, and one outside any communication.
  std::vector<FlightSnapshot> r1_idle{pp(1, 5, false, {2}, {0})};
  const std::string b = Watchdog::report(0, "x", r0, {r0, r1_idle, {}, {}}, {true, true, false, false});
  CHECK(b.find("rank 1 is in no collective or p2p batch (its last p2p batch in group 'pp': #5): computing, or stuck "
               "outside communication") != std::string::npos);
  CHECK(b.find("rank 2 sent no record: dead, hung hard, or its watchdog is off") != std::string::npos);
  // GPU pipelines: each direction between two stages is a two-rank communicator of its own. Rank 0 receives on
  // 'p2p_1to0' (its older, unfinished send batch on 'p2p_0to1' is not what it waits in), rank 1 on 'p2p_0to1'.
  auto one = [](std::string name, int rank, uint64_t seq, double ago, std::vector<int> to, std::vector<int> from) {
    FlightSnapshot s = group(std::move(name), {0, 1}, rank, 0, false);
    s.p2p = seq;
    s.entries.push_back(FlightEntry{seq, true, "batch_send_recv", 256, ago, -1.0, to, from});
    return s;
  };
  std::vector<FlightSnapshot> g0{one("p2p_0to1", 0, 3, 9.0, {1}, {}), one("p2p_1to0", 0, 2, 4.0, {}, {1})};
  std::vector<FlightSnapshot> g1{one("p2p_0to1", 1, 3, 5.0, {}, {0}), one("p2p_1to0", 1, 1, 30.0, {0}, {})};
  g1[1].entries.back().done_ago_s = 29.0;
  const std::string d = Watchdog::report(0, "x", g0, {g0, g1, {}, {}}, {true, true, false, false});
  CHECK(d.substr(0, d.find('\n')) ==
        "megacore: watchdog: rank 0: x; waiting in p2p batch #2 batch_send_recv (256 B) of group 'p2p_1to0' for 4.0 s "
        "(receiving from rank 1); rank 1 waits in its p2p batch #3 of group 'p2p_0to1' (5.0 s) (receiving from rank 0)");
  // Rank 1, outside any communication, learns that rank 0 waits for it in a p2p batch.
  const std::string c = Watchdog::report(1, "step 7 made no progress", r1_idle, {r0, r1_idle, {}, {}},
                                         {true, true, false, false});
  CHECK(c.substr(0, c.find('\n')) == "megacore: watchdog: rank 1: step 7 made no progress; not inside a collective or "
                                     "a p2p batch; waiting for this rank: rank 0 in p2p batch #5 of group 'pp' "
                                     "(sending to rank 1, receiving from rank 2)");
}

TEST_CASE("watchdog records survive their JSON exchange", "[train][watchdog]") {
  std::vector<FlightSnapshot> r{group("tp", {2, 3}, 1, 9, true), group("pp", {1, 3}, 1, 0, false)};
  r[1].p2p = 4;
  r[1].entries.push_back(FlightEntry{4, true, "batch_send_recv", 96, 1.5, 1.25, {3}, {1, 3}});
  const auto back = Watchdog::from_json(Watchdog::to_json(r));
  REQUIRE(back.size() == 2);
  CHECK(back[0].group == "tp");
  CHECK(back[0].world_ranks == std::vector<int>{2, 3});
  CHECK(back[0].collectives == 10);
  REQUIRE(back[0].pending_collective() != nullptr);
  CHECK(back[0].pending_collective()->seq == 10);
  CHECK(back[1].p2p == 4);
  REQUIRE(back[1].entries.size() == 1);
  CHECK(back[1].entries[0].op == "batch_send_recv");
  CHECK(back[1].entries[0].bytes == 96);
  CHECK(back[1].entries[0].done_ago_s == 1.25);
  CHECK(back[1].entries[0].send_to == std::vector<int>{3});
  CHECK(back[1].entries[0].recv_from == std::vector<int>{1, 3});
}

TEST_CASE("watchdog fires after its phase's timeout without a beat, not while beaten", "[train][watchdog]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("mc_watchdog_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::atomic<int> fired{0};
  std::string report;
  std::mutex mu;
  WatchdogOptions o;
  o.startup_timeout_s = 0;  // not watched
  o.step_timeout_s = 0.6;
  o.save_timeout_s = 5;
  o.rank = 0;
  o.world_size = 2;  // rank 1 never publishes: the wait for it ends after exchange_s
  o.job_dir = dir.string();
  o.exchange_s = 0.3;
  o.on_timeout = [&](const std::string& r) {
    std::lock_guard<std::mutex> l(mu);
    report = r;
    ++fired;
  };
  auto t0 = std::chrono::steady_clock::now();
  {
    Watchdog w(o);
    std::this_thread::sleep_for(std::chrono::milliseconds(900));  // start-up is not watched
    CHECK(fired == 0);
    w.enter(WatchPhase::Step, 3);
    for (int i = 0; i < 8; ++i) {  // 1.6 s of steps, each beaten within its timeout
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      w.beat();
    }
    CHECK(fired == 0);
    w.enter(WatchPhase::Save, 3);  // a long save under its own, larger timeout
    std::this_thread::sleep_for(std::chrono::milliseconds(900));
    CHECK(fired == 0);
    w.enter(WatchPhase::Step, 4);
    t0 = std::chrono::steady_clock::now();
    while (fired == 0 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  REQUIRE(fired == 1);
  CHECK(took > 0.6);
  CHECK(took < 0.6 + 0.3 + 1.0);
  CHECK(report.rfind("megacore: watchdog: rank 0: step 4 made no progress for ", 0) == 0);
  CHECK(report.find("(trainer.step_timeout_s = 0.6)") != std::string::npos);
  // It published its record and its error for the launcher.
  CHECK(fs::exists(dir / "flight.0.rank0.json"));
  std::ifstream ef(dir / "error.rank0.json");
  const nlohmann::json err = nlohmann::json::parse(ef);
  CHECK(err.at("rank") == 0);
  CHECK(err.at("error").get<std::string>().rfind("watchdog: rank 0: step 4 made no progress", 0) == 0);
  fs::remove_all(dir);
}
