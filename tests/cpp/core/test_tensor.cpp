#include <numeric>

#include "test_helpers.hpp"

using namespace megacore;

namespace {
Tensor iota(const Shape& shape, DType dt = DType::F32) {
  std::vector<float> v(size_t(shape_numel(shape)));
  std::iota(v.begin(), v.end(), 0.f);
  return Tensor::from_vector(v, shape).to(dt);
}
}  // namespace

TEST_CASE("tensor basics: shape, strides, contiguity", "[core][tensor]") {
  Tensor t = Tensor::zeros({2, 3, 4});
  REQUIRE(t.numel() == 24);
  REQUIRE(t.strides() == Shape{12, 4, 1});
  REQUIRE(t.is_contiguous());
  REQUIRE(t.nbytes() == 96);
  REQUIRE(t.size(-1) == 4);
  REQUIRE(t.str() == "Tensor(shape=[2, 3, 4], dtype=f32, device=cpu)");
  for (double v : t.to_double_vector()) REQUIRE(v == 0.0);
  Tensor e = Tensor::empty({0, 5});
  REQUIRE(e.numel() == 0);
  Tensor s = Tensor::full({}, 3.5);
  REQUIRE(s.item() == 3.5);
}

TEST_CASE("views share storage and index correctly", "[core][tensor]") {
  Tensor t = iota({3, 4});
  Tensor tt = t.transpose(0, 1);
  REQUIRE_FALSE(tt.is_contiguous());
  REQUIRE(tt.shape() == Shape{4, 3});
  auto c = tt.contiguous().to_double_vector();
  REQUIRE(c == std::vector<double>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});
  Tensor sl = t.slice(1, 1, 4, 2);  // columns 1 and 3
  REQUIRE(sl.to_double_vector() == std::vector<double>{1, 3, 5, 7, 9, 11});
  REQUIRE(t.select(0, -1).to_double_vector() == std::vector<double>{8, 9, 10, 11});
  REQUIRE(t.view({2, -1}).shape() == Shape{2, 6});
  REQUIRE(t.unsqueeze(0).shape() == Shape{1, 3, 4});
  REQUIRE(t.unsqueeze(0).squeeze(0).shape() == Shape{3, 4});
  Tensor p = iota({2, 3, 4}).permute({2, 0, 1});
  REQUIRE(p.shape() == Shape{4, 2, 3});
  REQUIRE(p.contiguous().to_double_vector()[1] == 4.0);  // p[0,0,1] = x[0,1,0]
  // writes through a view are visible in the base
  t.slice(0, 1, 2).fill_(-1.0);
  REQUIRE(t.to_double_vector()[4] == -1.0);
  REQUIRE(t.to_double_vector()[8] == 8.0);
  REQUIRE(t.reshape({12}).numel() == 12);
  REQUIRE(tt.reshape({12}).to_double_vector()[1] == -1.0);  // copies (non-contiguous), in transposed order
}

TEST_CASE("copies convert between every pair of dtypes", "[core][tensor]") {
  Tensor base = iota({5, 7});
  for (DType a : {DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8}) {
    for (DType b : {DType::F32, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8}) {
      Tensor x = base.to(a).to(b);
      REQUIRE(x.dtype() == b);
      REQUIRE(x.to_double_vector() == base.to_double_vector());  // 0..34 is exact in every dtype
    }
  }
  Tensor h = Tensor::full({3}, 0.1, DType::BF16);
  REQUIRE(h.select(0, 0).item() != 0.1);  // rounded
  REQUIRE(h.to_double_vector()[0] == double(float(bfloat16(0.1f))));
}

TEST_CASE("bad shapes, dtypes and views raise ValueError with a clear message", "[core][tensor][errors]") {
  Tensor t = iota({3, 4});
  REQUIRE_THROWS_WITH(t.view({5, 3}), Catch::Contains("has 15 elements"));
  REQUIRE_THROWS_WITH(t.transpose(0, 1).view({12}), Catch::Contains("non-contiguous"));
  REQUIRE_THROWS_WITH(t.slice(0, 4, 5), Catch::Contains("out of range"));
  REQUIRE_THROWS_WITH(t.select(1, 4), Catch::Contains("out of range"));
  REQUIRE_THROWS_WITH(t.transpose(0, 2), Catch::Contains("dimension 2 is out of range"));
  REQUIRE_THROWS_WITH(t.permute({0, 0}), Catch::Contains("appears twice"));
  REQUIRE_THROWS_WITH(t.data<int32_t>(), Catch::Contains("dtype f32, not i32"));
  REQUIRE_THROWS_WITH(t.view_as_dtype(DType::BF16), Catch::Contains("bytes per element"));
  REQUIRE_THROWS_AS(Tensor::empty({2, -3}), ValueError);
  REQUIRE_THROWS_WITH(t.copy_(iota({4, 3})), Catch::Contains("does not match"));
  REQUIRE_THROWS_WITH(t.item(), Catch::Contains("one element"));
  REQUIRE_THROWS_WITH(Tensor().view({1}), Catch::Contains("undefined tensor"));
  // An out-of-range view over existing storage is refused, not silently read past the end.
  REQUIRE_THROWS_WITH(Tensor(t.storage(), {4, 4}, {4, 1}, DType::F32), Catch::Contains("outside its storage"));
  REQUIRE_THROWS_WITH(Tensor(t.storage(), {3, 4}, {4, 1}, DType::F32, 1), Catch::Contains("outside its storage"));
}

TEST_CASE("device errors name the fix", "[core][tensor][errors]") {
  REQUIRE_THROWS_AS(Device::parse("gpu0"), ValueError);
  REQUIRE(Device::parse("cuda:3") == Device::cuda(3));
  int n = cuda_device_count();
  if (n == 0) {
    REQUIRE_THROWS_WITH(Tensor::empty({2}, DType::F32, Device::cuda(n + 1)),
                        Catch::Contains("no CUDA device") || Catch::Contains("without CUDA"));
  } else {
    REQUIRE_THROWS_WITH(Tensor::empty({2}, DType::F32, Device::cuda(n + 1)), Catch::Contains("does not exist"));
  }
}

TEST_CASE("CPU allocation statistics and failed allocations", "[core][allocator]") {
  Allocator& a = Allocator::get(Device::cpu());
  a.reset_peak_stats();
  MemoryStats s0 = a.stats();
  {
    Tensor t = Tensor::empty({1000, 1000});
    MemoryStats s1 = a.stats();
    REQUIRE(s1.allocated - s0.allocated >= 4000000);
    REQUIRE(s1.peak_allocated >= s1.allocated);
  }
  MemoryStats s2 = a.stats();
  REQUIRE(s2.allocated == s0.allocated);
  REQUIRE(s2.peak_allocated >= s0.allocated + 4000000);
  a.reset_peak_stats();
  REQUIRE(a.stats().peak_allocated == s2.allocated);
  // An allocation that cannot succeed is a typed error, not a crash.
  REQUIRE_THROWS_AS(Tensor::empty({int64_t(1) << 40, int64_t(1) << 20}), OutOfMemoryError);
  a.set_memory_limit(int64_t(1) << 20);
  REQUIRE_THROWS_WITH(Tensor::empty({1 << 20}), Catch::Contains("memory limit"));
  a.set_memory_limit(0);
}

// ---- GPU ------------------------------------------------------------------------------------------

TEST_CASE("host/device copies, views and casts on the GPU match the CPU", "[gpu][core][tensor]") {
  MC_REQUIRE_GPU();
  Device d = Device::cuda(0);
  Stream s = Stream::create(d);
  Generator g(11);
  Tensor h = Tensor::empty({37, 19, 5});
  h.normal_(g);
  Tensor x = h.to(d, s);
  REQUIRE(x.device() == d);
  // strided device copy (permute) and casts
  Tensor hp = h.permute({2, 0, 1}).contiguous();
  Tensor xp = x.permute({2, 0, 1}).contiguous(s);
  REQUIRE(xp.to(Device::cpu(), s).to_double_vector() == hp.to_double_vector());
  for (DType dt : {DType::BF16, DType::F16}) {
    auto hc = h.to(dt).to_double_vector();
    auto xc = x.to(dt, s).to(Device::cpu(), s).to_double_vector();
    REQUIRE(hc == xc);
  }
  // writes into a non-contiguous device view
  Tensor dst = Tensor::full({19, 37}, -7.0, DType::F32, d, s);
  dst.copy_(x.select(2, 1).transpose(0, 1), s);
  REQUIRE(dst.to(Device::cpu(), s).to_double_vector() == h.select(2, 1).transpose(0, 1).contiguous().to_double_vector());
  // host -> device into a strided destination with conversion
  Tensor dst2 = Tensor::full({5, 37, 19}, 99.0, DType::BF16, d, s);
  dst2.copy_(h.permute({2, 0, 1}), s);
  REQUIRE(dst2.to(Device::cpu(), s).to_double_vector() == hp.to(DType::BF16).to_double_vector());
  // fill on a device slice leaves the rest untouched
  Tensor z = Tensor::zeros({4, 4}, DType::F16, d, s);
  z.slice(1, 1, 3).fill_(2.5, s);
  auto zv = z.to(Device::cpu(), s).to_double_vector();
  for (int i = 0; i < 16; ++i) REQUIRE(zv[i] == ((i % 4 == 1 || i % 4 == 2) ? 2.5 : 0.0));
}

TEST_CASE("every device copy and fill path (memcpy, vector rows, strided walk) equals the CPU copy", "[gpu][core][tensor]") {
  MC_REQUIRE_GPU();
  Device d = Device::cuda(0);
  Stream s = Stream::create(d);
  Generator g(12);
  // A fused-QKV-like buffer [s, b, groups, hpg + 2, dh]: narrowing out q (hpg heads) and selecting k or v gives
  // rows whose byte length and offsets allow 16-, 8-, 4- or 2-byte vectors depending on dh and the dtype.
  for (DType dt : {DType::BF16, DType::F32, DType::F16}) {
    for (int64_t dh : {64, 4, 2, 1, 3, 24}) {
      Tensor h = Tensor::empty({5, 3, 2, 4, dh});
      h.normal_(g);
      h = h.to(dt);
      Tensor x = h.to(d, s);
      auto cpu = [&](const Tensor& t) { return t.contiguous().to_double_vector(); };
      auto gpu = [&](const Tensor& t) { return t.contiguous(s).to(Device::cpu(), s).to_double_vector(); };
      CHECK(gpu(x.narrow(3, 0, 2)) == cpu(h.narrow(3, 0, 2)));          // q: 2 of 4 heads per group
      CHECK(gpu(x.select(3, 2)) == cpu(h.select(3, 2)));                  // k
      CHECK(gpu(x.narrow(3, 1, 3).narrow(4, 0, dh > 1 ? dh - 1 : 1)) ==   // unaligned offset, short rows
            cpu(h.narrow(3, 1, 3).narrow(4, 0, dh > 1 ? dh - 1 : 1)));
      CHECK(gpu(x.permute({1, 0, 2, 3, 4})) == cpu(h.permute({1, 0, 2, 3, 4})));  // rows of whole heads
      CHECK(gpu(x.permute({4, 3, 2, 1, 0})) == cpu(h.permute({4, 3, 2, 1, 0})));  // innermost not contiguous
      CHECK(gpu(x.slice(0, 1, 5, 2)) == cpu(h.slice(0, 1, 5, 2)));                 // stepped outer dim
      // strided destination, same dtype and with a conversion
      Tensor dst = Tensor::full({5, 3, 2, 6, dh}, -3.0, dt, d, s);
      dst.narrow(3, 1, 4).copy_(x, s);
      Tensor ref = Tensor::full({5, 3, 2, 6, dh}, -3.0, dt);
      ref.narrow(3, 1, 4).copy_(h);
      CHECK(dst.to(Device::cpu(), s).to_double_vector() == ref.to_double_vector());
      Tensor conv = Tensor::full({5, 3, 2, 6, dh}, -3.0, DType::F32, d, s);
      conv.narrow(3, 1, 4).copy_(x, s);
      Tensor cref = Tensor::full({5, 3, 2, 6, dh}, -3.0, DType::F32);
      cref.narrow(3, 1, 4).copy_(h);
      CHECK(conv.to(Device::cpu(), s).to_double_vector() == cref.to_double_vector());
      // contiguous copies (one range) and fills: zero (memset), non-zero contiguous, strided
      CHECK(gpu(x.view({5 * 3, 2 * 4 * dh}).narrow(0, 2, 7)) == cpu(h.view({5 * 3, 2 * 4 * dh}).narrow(0, 2, 7)));
      Tensor f = Tensor::full({7, 2 * dh}, 5.0, dt, d, s);
      f.narrow(0, 1, 3).fill_(0.0, s);
      f.narrow(1, 0, dh).fill_(-1.5, s);
      f.narrow(0, 5, 2).fill_(2.0, s);
      auto fv = f.to(Device::cpu(), s).to_double_vector();
      for (int64_t r = 0; r < 7; ++r)
        for (int64_t c = 0; c < 2 * dh; ++c) {
          const double want = r >= 5 ? 2.0 : c < dh ? -1.5 : (r >= 1 && r <= 3) ? 0.0 : 5.0;
          CHECK(fv[size_t(r * 2 * dh + c)] == want);
        }
    }
  }
}

TEST_CASE("the CUDA caching allocator reuses blocks and keeps statistics", "[gpu][core][allocator]") {
  MC_REQUIRE_GPU();
  Device d = Device::cuda(0);
  Allocator& a = Allocator::get(d);
  Stream s = Stream::create(d);
  a.empty_cache();
  MemoryStats s0 = a.stats();
  void* first = nullptr;
  {
    Tensor t = Tensor::empty({1 << 20}, DType::F32, d, s);  // 4 MiB
    first = t.data_ptr();
    REQUIRE(a.stats().allocated - s0.allocated == 4 << 20);
  }
  MemoryStats s1 = a.stats();
  REQUIRE(s1.allocated == s0.allocated);
  REQUIRE(s1.reserved - s0.reserved == 4 << 20);  // cached, not returned
  {
    Tensor t = Tensor::empty({1 << 20}, DType::F32, d, s);
    REQUIRE(t.data_ptr() == first);  // served from the cache
  }
  REQUIRE(a.stats().num_device_mallocs == s1.num_device_mallocs);
  a.empty_cache();
  REQUIRE(a.stats().reserved == s0.reserved);
  // Asking for more than the card has is OutOfMemoryError with the figures, never managed memory.
  REQUIRE_THROWS_WITH(Tensor::empty({int64_t(1) << 40}, DType::F32, d, s), Catch::Contains("CUDA out of memory"));
  REQUIRE(a.stats().num_ooms >= 1);
  // A limit below the card's memory turns into the same error.
  a.set_memory_limit(a.stats().reserved + (8 << 20));
  REQUIRE_THROWS_AS(Tensor::empty({int64_t(16) << 20}, DType::F32, d, s), OutOfMemoryError);
  a.set_memory_limit(0);
}

// Allocator::pin (the copy-engine transfers pin what another process maps through CUDA IPC): a pinned block
// stays reserved through empty_cache and the out-of-memory retry, free or live, and is still reused; only a
// block's own start address pins; unpin counts.
TEST_CASE("a pinned block is never returned to the driver but stays reusable", "[gpu][core][allocator]") {
  MC_REQUIRE_GPU();
  Device d = Device::cuda(0);
  Allocator& a = Allocator::get(d);
  Stream s = Stream::create(d);
  a.empty_cache();
  const MemoryStats s0 = a.stats();
  CHECK_FALSE(Allocator::get(Device::cpu()).pin(nullptr));
  void* p = nullptr;
  {
    Tensor t = Tensor::empty({1 << 20}, DType::F32, d, s);  // 4 MiB
    p = t.data_ptr();
    CHECK_FALSE(a.pin(static_cast<char*>(p) + 512));  // a view's address is not a block
    REQUIRE(a.pin(p));
    REQUIRE(a.pin(p));  // counted
    a.empty_cache();    // live: nothing to return anyway
  }
  a.empty_cache();  // free now, but pinned: stays
  CHECK(a.stats().reserved - s0.reserved == 4 << 20);
  {
    Tensor t = Tensor::empty({1 << 20}, DType::F32, d, s);
    CHECK(t.data_ptr() == p);  // reused from the cache
  }
  // The out-of-memory retry empties the cache too, and leaves the pinned block.
  CHECK_THROWS_AS(Tensor::empty({int64_t(1) << 40}, DType::F32, d, s), OutOfMemoryError);
  CHECK(a.stats().reserved - s0.reserved == 4 << 20);
  a.unpin(p);
  a.empty_cache();
  CHECK(a.stats().reserved - s0.reserved == 4 << 20);  // one pin left
  a.unpin(p);
  a.unpin(p);  // an extra unpin is ignored
  a.empty_cache();
  CHECK(a.stats().reserved == s0.reserved);
  CHECK_FALSE(a.pin(p));  // returned to the driver: no longer a block of this allocator
}

TEST_CASE("a block used on another stream is not reused before that stream finishes, unless the use is withdrawn",
          "[gpu][core][allocator]") {
  MC_REQUIRE_GPU();
  Device d = Device::cuda(0);
  Allocator& a = Allocator::get(d);
  // No cached block of an earlier stream that happened to have s1's handle may serve the requests below.
  a.empty_cache();
  Stream s1 = Stream::create(d), s2 = Stream::create(d);
  void* p = a.allocate(1 << 20, s1);
  a.record_stream(p, s2);
  // Queue a large amount of work on s2 so it is still busy when the block is freed.
  Tensor big = Tensor::empty({int64_t(64) << 20}, DType::F32, d, s2);
  for (int i = 0; i < 4; ++i) big.fill_(double(i), s2);
  SECTION("marked: parked until s2 has passed the free") {
    a.deallocate(p);
    bool busy = !s2.query();
    void* q = a.allocate(1 << 20, s1);
    if (busy) REQUIRE(q != p);
    a.deallocate(q);
  }
  SECTION("withdrawn after s1 waits for s2: back in s1's pool at once") {
    // As ColumnParallelLinear's overlapped backward does before freeing: stream order protects the block.
    s1.wait(s2);
    a.release_stream_use(p, s2);
    a.deallocate(p);
    const bool busy = !s2.query();
    void* q = a.allocate(1 << 20, s1);
    REQUIRE(q == p);
    // Withdrawing a mark never made, or for a pointer the allocator does not know, changes nothing.
    a.release_stream_use(q, s2);
    a.release_stream_use(&big, s2);
    a.deallocate(q);
    if (!busy) WARN("s2 finished before the free: the reuse above did not depend on the withdrawal");
  }
  SECTION("several parked on one stream: all back once it has finished") {
    void* p2 = a.allocate(1 << 20, s1);
    a.record_stream(p2, s2);
    a.deallocate(p);
    a.deallocate(p2);
    s2.synchronize();
    const int64_t mallocs = a.stats().num_device_mallocs;
    void* q = a.allocate(1 << 20, s1);
    void* q2 = a.allocate(1 << 20, s1);
    REQUIRE(((q == p && q2 == p2) || (q == p2 && q2 == p)));
    REQUIRE(a.stats().num_device_mallocs == mallocs);
    a.deallocate(q);
    a.deallocate(q2);
  }
  s2.synchronize();
}

TEST_CASE("tensor work on a device other than the current one runs on the tensor's device", "[gpu][core][tensor]") {
  MC_REQUIRE_GPU();
  if (cuda_device_count() < 2) {
    WARN("needs 2 GPUs: test skipped");
    return;
  }
  // The thread's current device stays 0; every operation must still run on cuda:1 (a kernel launched on
  // device 0 with device-1 pointers is an illegal access without peer mapping).
  Device d1 = Device::cuda(1);
  Generator g1(3), g2(3);
  Tensor h = Tensor::empty({129, 7});
  h.normal_(g1);
  Tensor x = Tensor::empty({129, 7}, DType::F32, d1);
  x.normal_(g2);
  REQUIRE(x.to(Device::cpu()).to_double_vector() == h.to_double_vector());
  Tensor y = x.transpose(0, 1).contiguous().to(DType::BF16);
  REQUIRE(y.to(Device::cpu()).to_double_vector() == h.transpose(0, 1).contiguous().to(DType::BF16).to_double_vector());
  Tensor z = Tensor::full({33}, 4.0, DType::F16, d1);
  REQUIRE(z.to(Device::cpu()).to_double_vector() == std::vector<double>(33, 4.0));
  Stream s1 = Stream::create(d1);
  Tensor w = h.to(d1, s1);
  s1.synchronize();
  REQUIRE(w.to(Device::cpu(), s1).to_double_vector() == h.to_double_vector());
}
