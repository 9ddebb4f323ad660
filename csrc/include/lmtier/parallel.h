// lmtier — a small CPU thread helper shared by the CPU codec paths (rANS, quantize).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace lmtier {

// Threads to use for `work_items` independent items: num_threads > 0 as given, else
// min(16, hardware threads); never more than the items (at least 1).
inline int pick_threads(int32_t num_threads, uint64_t work_items) {
  int t = num_threads > 0
              ? num_threads
              : static_cast<int>(std::min(16u, std::max(1u, std::thread::hardware_concurrency())));
  if (static_cast<uint64_t>(t) > work_items)
    t = static_cast<int>(std::max<uint64_t>(1, work_items));
  return t;
}

// Runs fn(i) for i in [0, n) on `threads` threads (work-stealing by an atomic counter); the calling
// thread is one of them. Results must not depend on the thread count (callers write disjoint
// outputs). Exception-safe: the first exception fn throws (on any thread) stops the remaining items
// and is rethrown here once every thread has joined; a thread that cannot be created (resource
// limits) leaves the work to the threads that exist.
template <typename Fn>
void parallel_for(uint64_t n, int threads, Fn&& fn) {
  if (n == 0) return;
  if (threads <= 1 || n == 1) {
    for (uint64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<uint64_t> next{0};
  std::mutex error_lock;
  std::exception_ptr error;
  auto worker = [&]() noexcept {
    try {
      for (uint64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> g(error_lock);
      if (!error) error = std::current_exception();
      next.store(n);  // the other threads stop after their current item
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(worker);
    } catch (const std::system_error&) {
      break;  // no more threads: the ones started and this one do the work
    }
  }
  worker();
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace lmtier
