// The decode's state-output write path on its own: each sequence's state read once and written to T random slots of a
// pool ([N, T] ids, as a verify call writes per-token states), no math, by four store methods:
//   registers        16-byte stores from registers, default cache policy
//   registers .cs    the same with evict-first stores (st.global.cs, what the decode kernels use)
//   bulk             the piece staged in shared memory, then one bulk copy (cp.async.bulk shared -> global, CuTe's
//                    SM90_BULK_COPY_S2G) per output, waited for (reads done) before the CTA exits
//   bulk rows        the same by one bulk copy per ROW bytes, issued by a thread each
// and a write-only fill, each as a share of the copy bandwidth (read + write bytes of a 2 GiB device copy) that the
// decode benchmark measures against. A CTA of 256 threads moves one PIECE-byte part of one (sequence, v-head) state.
// H32, K = V = 128, fp32 and bf16 states, T 1 / 4, N 256 / 1024; medians of 20 CUDA-event timings, L2 flushed before
// each. Built and run by `tools/gpu/run write-paths` (sm_90a; CuTe headers from .deps/cutlass/include).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#define CHECK(x)                                                                  \
  do {                                                                            \
    const cudaError_t e_ = (x);                                                   \
    if (e_ != cudaSuccess) {                                                      \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));     \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

namespace {

constexpr int kThreads = 256;
enum Method { kRegisters, kRegistersCs, kBulk, kBulkRows };

// The CTA's part: (sequence n, v-head hv, part) of a state of `state_vecs` 16-byte vectors.
struct Part {
  long long n;
  int hv, part;
  __device__ Part(int parts, int HV) {
    const long long blk = blockIdx.x;
    part = static_cast<int>(blk % parts);
    const long long nh = blk / parts;
    hv = static_cast<int>(nh % HV);
    n = nh / HV;
  }
};

template <int METHOD, int PIECE, int ROW>
__global__ void __launch_bounds__(kThreads) fan_out(const uint4* __restrict__ src, uint4* __restrict__ pool,
                                                    const int* __restrict__ ids, int T, int HV, int parts,
                                                    long long state_vecs) {
  constexpr int PV = PIECE / 16, PER = PV / kThreads;
  static_assert(PER * kThreads == PV, "whole vectors a thread");
  const Part c(parts, HV);
  const uint4* s = src + (c.n * HV + c.hv) * state_vecs + static_cast<long long>(c.part) * PV;
  uint4 r[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) r[i] = __ldcs(s + threadIdx.x + i * kThreads);
  auto dest = [&](int t) {
    const long long slot = ids[c.n * T + t];
    return pool + (slot * HV + c.hv) * state_vecs + static_cast<long long>(c.part) * PV;
  };
  if constexpr (METHOD == kRegisters || METHOD == kRegistersCs) {
    for (int t = 0; t < T; ++t) {
      uint4* d = dest(t);
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        if constexpr (METHOD == kRegisters) d[threadIdx.x + i * kThreads] = r[i];
        else __stcs(d + threadIdx.x + i * kThreads, r[i]);
      }
    }
  } else {
    extern __shared__ __align__(128) uint4 tile[];
#pragma unroll
    for (int i = 0; i < PER; ++i) tile[threadIdx.x + i * kThreads] = r[i];
    cutlass::arch::fence_view_async_shared();  // the tile's writes, visible to the bulk copies
    __syncthreads();
    bool issued = false;
    for (int t = 0; t < T; ++t) {
      char* d = reinterpret_cast<char*>(dest(t));
      if constexpr (METHOD == kBulk) {
        if (threadIdx.x == 0) {
          cute::SM90_BULK_COPY_S2G::copy(tile, d, PIECE);
          issued = true;
        }
      } else {
        for (int j = threadIdx.x; j < PIECE / ROW; j += kThreads) {
          cute::SM90_BULK_COPY_S2G::copy(reinterpret_cast<const char*>(tile) + j * ROW, d + j * ROW, ROW);
          issued = true;
        }
      }
    }
    if (issued) {
      cute::tma_store_arrive();
      cute::tma_store_wait<0>();  // the tile outlives the copies' reads
    }
  }
}

template <int PIECE>
__global__ void __launch_bounds__(kThreads) fill_only(uint4* __restrict__ pool, const int* __restrict__ ids, int T,
                                                      int HV, int parts, long long state_vecs) {
  constexpr int PV = PIECE / 16, PER = PV / kThreads;
  const Part c(parts, HV);
  const uint4 v = make_uint4(1u, 2u, 3u, static_cast<uint32_t>(blockIdx.x));
  for (int t = 0; t < T; ++t) {
    const long long slot = ids[c.n * T + t];
    uint4* d = pool + (slot * HV + c.hv) * state_vecs + static_cast<long long>(c.part) * PV;
#pragma unroll
    for (int i = 0; i < PER; ++i) d[threadIdx.x + i * kThreads] = v;
  }
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  const size_t flush_bytes = size_t(512) << 20, copy_bytes = size_t(2) << 30;
  char *flush, *ca, *cb;
  CHECK(cudaMalloc(&flush, flush_bytes));
  CHECK(cudaMalloc(&ca, copy_bytes));
  CHECK(cudaMalloc(&cb, copy_bytes));
  CHECK(cudaMemset(ca, 1, copy_bytes));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  auto time_ms = [&](auto launch, int reps) {
    std::vector<float> v;
    for (int i = 0; i < reps; ++i) {
      CHECK(cudaMemsetAsync(flush, i, flush_bytes));
      CHECK(cudaEventRecord(e0));
      launch();
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      v.push_back(ms);
    }
    CHECK(cudaGetLastError());
    return median(v);
  };
  const double bw = 2.0 * copy_bytes / (time_ms([&] { CHECK(cudaMemcpyAsync(cb, ca, copy_bytes, cudaMemcpyDeviceToDevice)); }, 10) * 1e-3);
  CHECK(cudaFree(ca));
  CHECK(cudaFree(cb));
  std::printf("copy bandwidth %.3f TB/s (read + write)\n", bw / 1e12);
  std::printf("%-6s %-3s %-6s %-26s %10s %8s\n", "state", "T", "N", "method", "us", "% copy");
  const int HV = 32;
  for (const int esize : {4, 2}) {
    for (const int T : {1, 4}) {
      for (const int N : {256, 1024}) {
        const long long state_bytes = 128LL * 128 * esize, vecs = state_bytes / 16;
        uint4 *src, *pool;
        int* ids;
        CHECK(cudaMalloc(&src, N * HV * state_bytes));
        CHECK(cudaMalloc(&pool, size_t(N) * T * HV * state_bytes));
        CHECK(cudaMalloc(&ids, N * T * sizeof(int)));
        CHECK(cudaMemset(src, 3, N * HV * state_bytes));
        std::vector<int> h(N * T);
        for (int i = 0; i < N * T; ++i) h[i] = i;
        std::mt19937 rng(1);
        std::shuffle(h.begin(), h.end(), rng);
        CHECK(cudaMemcpy(ids, h.data(), N * T * sizeof(int), cudaMemcpyHostToDevice));
        const double moved = double(N) * HV * state_bytes * (1 + T), written = double(N) * HV * state_bytes * T;
        auto row = [&](const char* name, double bytes, auto launch) {
          const float ms = time_ms(launch, 20);
          std::printf("%-6s T%-2d N%-5d %-26s %10.1f %7.1f%%\n", esize == 4 ? "fp32" : "bf16", T, N, name, ms * 1e3,
                      100.0 * bytes / (ms * 1e-3) / bw);
        };
        auto fan = [&](auto kernel, const char* name, int piece, bool staged) {
          const int parts = static_cast<int>(state_bytes / piece);
          CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536));
          row(name, moved, [&] {
            kernel<<<N * HV * parts, kThreads, staged ? piece : 0>>>(src, pool, ids, T, HV, parts, vecs);
          });
        };
        fan(fan_out<kRegisters, 16384, 0>, "registers 16K", 16384, false);
        fan(fan_out<kRegistersCs, 16384, 0>, "registers .cs 16K", 16384, false);
        fan(fan_out<kBulk, 8192, 0>, "bulk 8K", 8192, true);
        fan(fan_out<kBulk, 16384, 0>, "bulk 16K", 16384, true);
        fan(fan_out<kBulk, 32768, 0>, "bulk 32K", 32768, true);
        fan(fan_out<kBulkRows, 16384, 128>, "bulk rows 128 B (16K)", 16384, true);
        fan(fan_out<kBulkRows, 16384, 256>, "bulk rows 256 B (16K)", 16384, true);
        fan(fan_out<kBulkRows, 16384, 1024>, "bulk rows 1 KB (16K)", 16384, true);
        {
          const int parts = static_cast<int>(state_bytes / 16384);
          row("fill only (write) 16K", written,
              [&] { fill_only<16384><<<N * HV * parts, kThreads>>>(pool, ids, T, HV, parts, vecs); });
        }
        CHECK(cudaFree(src));
        CHECK(cudaFree(pool));
        CHECK(cudaFree(ids));
      }
    }
  }
  return 0;
}
