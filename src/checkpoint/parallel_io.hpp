// Helpers shared by the checkpoint writers and readers (private to src/checkpoint).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace megacore::checkpoint::detail {

/// Threads a checkpoint operation uses when its options say 0: min(8, hardware threads).
inline int default_io_threads(int threads) {
  if (threads > 0) return threads;
  return int(std::min<unsigned>(8, std::max(1u, std::thread::hardware_concurrency())));
}

/// Runs fn(i) for i in [0, n) on up to `threads` threads (0: default_io_threads); once one call throws,
/// no new ones start, and the first exception is rethrown after every thread has stopped.
inline void parallel_for(size_t n, int threads, const std::function<void(size_t)>& fn) {
  threads = int(std::min<size_t>(size_t(default_io_threads(threads)), n));
  if (threads <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::exception_ptr err;
  std::mutex mu;
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!err) err = std::current_exception();
        next = n;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  if (err) std::rethrow_exception(err);
}

}  // namespace megacore::checkpoint::detail
