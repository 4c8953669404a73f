#include "cuda/tuning.h"

#include <atomic>
#include <initializer_list>
#include <cstdlib>
#include <memory>
#include <mutex>

namespace kdakit::cuda {
namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

int env_choice(const char* name, std::initializer_list<int> allowed) {
  const int v = env_int(name, 0);
  for (const int a : allowed) {
    if (v == a) return v;
  }
  return 0;
}

std::mutex reload_mutex;
// Snapshots are never freed while the process runs: a caller may still hold the previous one.
std::atomic<const Tuning*> current{nullptr};

}  // namespace

Tuning Tuning::from_environment() {
  Tuning t;
  t.forward_bv = env_choice("KDAKIT_FORWARD_BV", {16, 32, 64, 128});
  t.forward_wgmma = env_int("KDAKIT_FORWARD_WGMMA", 1) != 0;
  t.backward_grad_cache = env_int("KDAKIT_BACKWARD_GRAD_CACHE", 1) != 0;
  t.backward_wgmma = env_int("KDAKIT_BACKWARD_WGMMA", 1) != 0;
  t.backward_scan_bv = env_choice("KDAKIT_BACKWARD_SCAN_BV", {16, 32, 64});
  t.forward_segments = env_int("KDAKIT_FORWARD_SEGMENTS", -1);
  t.forward_segment_tokens = env_int("KDAKIT_FORWARD_SEGMENT_TOKENS", 4096);
  const char* limit = std::getenv("KDAKIT_SMEM_LIMIT");
  t.smem_limit = limit != nullptr ? std::atol(limit) : 0;
  t.decode_warps = env_choice("KDAKIT_DECODE_WARPS", {1, 2, 4});
  t.decode_passes = env_choice("KDAKIT_DECODE_PASSES", {1, 2, 4});
  t.decode_general = std::getenv("KDAKIT_DECODE_GENERAL") != nullptr;
  t.decode_one_staged = std::getenv("KDAKIT_DECODE_ONE_STAGED") != nullptr ? (env_int("KDAKIT_DECODE_ONE_STAGED", 1) != 0) : -1;
  t.decode_vt_inner = env_int("KDAKIT_DECODE_VT_INNER", -1);
  t.decode_kv_regs = env_int("KDAKIT_DECODE_KV_REGS", 1) != 0;
  t.decode_wide_kv =
      std::getenv("KDAKIT_DECODE_WIDE_KV") != nullptr ? env_choice("KDAKIT_DECODE_WIDE_KV", {0, 4, 8}) : -1;
  const char* ahead = std::getenv("KDAKIT_DECODE_PREFETCH");
  t.decode_prefetch = ahead != nullptr ? std::strtof(ahead, nullptr) : 1.f;
  return t;
}

const Tuning& tuning() {
  const Tuning* t = current.load(std::memory_order_acquire);
  if (t == nullptr) {
    reload_tuning();
    t = current.load(std::memory_order_acquire);
  }
  return *t;
}

void reload_tuning() {
  std::lock_guard<std::mutex> lock(reload_mutex);
  current.store(new Tuning(Tuning::from_environment()), std::memory_order_release);
}

}  // namespace kdakit::cuda
