#include "cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "kdakit/kdakit.h"

namespace kdakit {

namespace {
std::atomic<int> g_threads{0};
}

void set_cpu_threads(int n) {
  if (n < 1) throw InvalidArgument("threads", "must be at least 1, got " + std::to_string(n));
  g_threads = n;
}

int cpu_threads() {
  const int n = g_threads.load();
  if (n > 0) return n;
  return std::max(1u, std::thread::hardware_concurrency());
}

namespace cpu {

int workers_for(int64_t n) { return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(cpu_threads(), n))); }

void parallel_for(int64_t n, const std::function<void(int64_t, int)>& fn) {
  if (n <= 0) return;
  const int workers = workers_for(n);
  if (workers == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i, 0);
    return;
  }
  std::exception_ptr error;
  std::mutex error_mutex;
  std::atomic<int64_t> next{0};
  auto body = [&](int worker) {
    try {
      for (int64_t i = next++; i < n; i = next++) fn(i, worker);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      next = n;
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(workers - 1);
  // A thread the system cannot start leaves its share to the others (the items are claimed one by one, so the results
  // do not depend on the worker count); the threads already started are always joined, never left joinable.
  for (int w = 1; w < workers; ++w) {
    try {
      threads.emplace_back(body, w);
    } catch (const std::system_error&) {
      break;
    }
  }
  body(0);
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace cpu
}  // namespace kdakit
