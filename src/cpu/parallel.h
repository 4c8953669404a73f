// A minimal fork-join loop for the CPU backend. Tasks are handed to workers dynamically; a task's result
// must never depend on which worker ran it (workers only own scratch memory), so outputs are deterministic.
#pragma once

#include <cstdint>
#include <functional>

namespace kdakit::cpu {

// Runs fn(task, worker) for task in [0, n) on min(cpu_threads(), n) workers; rethrows the first exception.
void parallel_for(int64_t n, const std::function<void(int64_t task, int worker)>& fn);

// Workers parallel_for will use for n tasks.
int workers_for(int64_t n);

}  // namespace kdakit::cpu
