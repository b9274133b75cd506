// The host-sync counter (core/host_sync.hpp): every primitive that makes the host wait counts, on CPU too.
#include <catch2/catch.hpp>

#include "megacore/core/host_sync.hpp"
#include "megacore/core/stream.hpp"
#include "test_helpers.hpp"

using namespace megacore;

TEST_CASE("host syncs are counted by reason, on CPU too, and reset", "[core][host_sync]") {
  reset_host_syncs();
  REQUIRE(host_sync_count() == 0);
  Stream s;
  s.synchronize();
  Event e;
  e.synchronize();
  synchronize_device(Device::cpu());
  Tensor t = Tensor::from_vector<float>({2.5f}, {1});
  REQUIRE(read_scalar(t, s, "test_read") == 2.5);
  {
    HostSyncReason outer("outer");
    s.synchronize();
    {
      HostSyncReason inner("inner");
      s.synchronize();
    }
    s.synchronize();
  }
  s.synchronize();
  REQUIRE(host_sync_count() == 8);
  const std::map<std::string, int64_t> want{{"stream_synchronize", 2}, {"event_synchronize", 1},
                                            {"device_synchronize", 1}, {"test_read", 1}, {"outer", 2},
                                            {"inner", 1}};
  REQUIRE(host_sync_counts() == want);
  reset_host_syncs();
  REQUIRE(host_sync_count() == 0);
  REQUIRE(host_sync_counts().empty());
}

TEST_CASE("a device-to-host read counts once with its reason", "[core][host_sync][gpu]") {
  MC_REQUIRE_GPU();
  const Device d = Device::cuda(0);
  Stream s = Stream::create(d);
  Tensor t = Tensor::from_vector<float>({3.f}, {1}).to(d, s);
  reset_host_syncs();
  REQUIRE(read_scalar(t, s, "gpu_read") == 3.0);
  REQUIRE(host_sync_counts() == std::map<std::string, int64_t>{{"gpu_read", 1}});
  Tensor h = t.to(Device::cpu(), s);
  REQUIRE(host_sync_counts().at("copy_to_host") == 1);
}
