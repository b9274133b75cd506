// FlightRecorder: sequence numbers per kind, the ring's bound, done marks, the process-wide listing and the
// text format the watchdog prints.
#include <thread>

#include "test_helpers.hpp"
#include "megacore/comm/flight_recorder.hpp"

using namespace megacore::comm;

namespace {
const FlightSnapshot* find(const std::vector<FlightSnapshot>& all, const std::string& group) {
  for (const auto& s : all)
    if (s.group == group) return &s;
  return nullptr;
}
}  // namespace

TEST_CASE("flight recorder numbers collectives and p2p batches apart and keeps the newest", "[comm][flight]") {
  auto r = FlightRecorder::create("fr_test_tp", {4, 5}, 1, /*capacity=*/4);
  const uint64_t a = r->start("all_reduce", 64);
  FlightPeers peers;
  peers.add(/*is_send=*/true, 0), peers.add(false, 1), peers.add(true, 0);  // the repeated send peer is kept once
  const uint64_t b = r->start("batch_send_recv", 32, /*p2p=*/true, &peers);
  r->done(a);
  FlightSnapshot s = r->snapshot();
  CHECK(s.group == "fr_test_tp");
  CHECK(s.world_ranks == std::vector<int>{4, 5});
  CHECK(s.rank == 1);
  CHECK(s.collectives == 1);
  CHECK(s.p2p == 1);
  REQUIRE(s.entries.size() == 2);
  CHECK(s.entries[0].op == "all_reduce");
  CHECK(s.entries[0].seq == 1);
  CHECK(s.entries[0].bytes == 64);
  CHECK(s.entries[0].done());
  CHECK(s.entries[0].started_ago_s >= s.entries[0].done_ago_s);
  CHECK(s.entries[1].p2p);
  CHECK_FALSE(s.entries[1].done());
  CHECK(s.entries[1].send_to == std::vector<int>{4});  // group ranks 0 and 1 are world ranks 4 and 5
  CHECK(s.entries[1].recv_from == std::vector<int>{5});
  CHECK(s.entries[0].send_to.empty());
  CHECK(s.pending_collective() == nullptr);  // the open p2p batch is no collective
  REQUIRE(s.pending_p2p() == &s.entries[1]);
  CHECK(format_p2p_peers(s.entries[1]) == "(sending to rank 4, receiving from rank 5)");

  // Six more collectives: the ring keeps the last 4 operations, in order; done() of a dropped id is a no-op.
  std::vector<uint64_t> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(r->start(i % 2 ? "all_gather" : "reduce_scatter", 100 + i));
  for (size_t i = 0; i + 1 < ids.size(); ++i) r->done(ids[i]);
  r->done(b);
  s = r->snapshot();
  CHECK(s.collectives == 7);
  REQUIRE(s.entries.size() == 4);
  for (size_t i = 0; i < 4; ++i) CHECK(s.entries[i].seq == 4 + i);
  CHECK(s.entries[3].op == "all_gather");
  CHECK(s.entries[3].bytes == 105);
  REQUIRE(s.pending_collective() != nullptr);
  CHECK(s.pending_collective()->seq == 7);

  const std::string text = format_flight_records({s}, 2);
  CHECK(text.find("group 'fr_test_tp' (world ranks 4,5), rank 1: 7 collectives, 1 p2p batches") != std::string::npos);
  CHECK(text.find("#6 reduce_scatter 104 B (took") != std::string::npos);
  CHECK(text.find("#7 all_gather 105 B (NOT FINISHED") != std::string::npos);
  CHECK(text.find("#5") == std::string::npos);  // only the last 2
}

TEST_CASE("flight_records lists live recorders only and is safe from another thread", "[comm][flight]") {
  auto keep = FlightRecorder::create("fr_live", {0}, 0);
  { auto gone = FlightRecorder::create("fr_gone", {0}, 0); }
  std::vector<FlightSnapshot> seen;
  std::thread reader([&] {
    for (int i = 0; i < 200; ++i) seen = flight_records();
  });
  for (int i = 0; i < 2000; ++i) keep->done(keep->start("all_reduce", i));
  reader.join();
  const auto all = flight_records();
  REQUIRE(find(all, "fr_live") != nullptr);
  CHECK(find(all, "fr_live")->collectives == 2000);
  CHECK(find(all, "fr_gone") == nullptr);
}
