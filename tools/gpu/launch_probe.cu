// Probe kernels for tools/gpu/launch_floor.py: the floor of a short decode call's event-timed span. Built on the
// GPU machine into a shared library (nvcc -shared) and called through ctypes on torch's current stream.
//   probe_empty:      one warp, no work (the launch and event overhead alone).
//   probe_empty_wide: 64 CTAs of 128 threads with a 304-byte argument block (the one-token decode entry's size).
//   probe_chain:      the decode chain without its math: every CTA loads a slot id, then its 16 KB tile of that
//                     slot's state (fp32, 16-byte loads), and stores it back scaled (two dependent memory round
//                     trips and the stores, as T1 N1 H16 fp32).
//   probe_args<B>:    64 CTAs of 128 threads, no work, a B-byte argument block (B = 8 ... 4096).
//   probe_chain_inputs: the chain, plus 8 loads from separate small tensors issued beside the slot id's (as the
//                     decode's q, k, v, g, beta, A_log, dt_bias rows) and a 4-byte store per thread to a ninth
//                     (the output): more pages touched, the same chain.
//   probe_chain_code: the chain with ~1,500 instructions of dependent arithmetic between the loads and the stores
//                     (code fetched from memory after the flush, as a long kernel body).
#include <cuda_runtime.h>

struct WideArgs {
  char bytes[304];
};

__global__ void probe_empty_kernel(int*) {}

__global__ void probe_empty_wide_kernel(const WideArgs) {}

// A CTA's 16 KB tile of slot `slot`: 128 threads x 8 vectors each, loaded (chain_tile), and stored back with
// its four lanes scaled by x, 0.5, z and 0.5 (chain_store).
__device__ __forceinline__ float4* chain_tile(float4* pool, int slot, int tile_vecs, float4 (&v)[8]) {
  float4* tile = pool + (static_cast<long long>(slot) * gridDim.x + blockIdx.x) * tile_vecs;
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = tile[i * 128 + threadIdx.x];
  return tile;
}

__device__ __forceinline__ void chain_store(float4* tile, float4 (&v)[8], float x, float z) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i].x *= x;
    v[i].y *= 0.5f;
    v[i].z *= z;
    v[i].w *= 0.5f;
    tile[i * 128 + threadIdx.x] = v[i];
  }
}

__global__ void __launch_bounds__(128) probe_chain_kernel(const int* __restrict__ idx, float4* pool, int tile_vecs) {
  float4 v[8];
  float4* tile = chain_tile(pool, idx[0], tile_vecs, v);
  chain_store(tile, v, 0.5f, 0.5f);
}

struct Inputs {
  const float* p[8];
};

__global__ void __launch_bounds__(128)
    probe_chain_inputs_kernel(const int* __restrict__ idx, float4* pool, int tile_vecs, const Inputs inputs,
                              float* out) {
  float extra = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) extra += inputs.p[i][blockIdx.x * 128 + threadIdx.x];
  float4 v[8];
  float4* tile = chain_tile(pool, idx[0], tile_vecs, v);
  chain_store(tile, v, extra, 0.5f);
  out[blockIdx.x * 128 + threadIdx.x] = extra;
}

__global__ void __launch_bounds__(128)
    probe_chain_code_kernel(const int* __restrict__ idx, float4* pool, int tile_vecs) {
  float4 v[8];
  float4* tile = chain_tile(pool, idx[0], tile_vecs, v);
  float a = v[0].x, b = v[1].y;
#pragma unroll
  for (int i = 0; i < 750; ++i) {  // distinct constants: no loop in the SASS
    a = fmaf(a, 1.0f + 1e-7f * i, b);
    b = fmaf(b, 1.0f - 1e-7f * i, a);
  }
  chain_store(tile, v, a, b);
}

extern "C" int probe_empty(void* stream) {
  probe_empty_kernel<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(nullptr);
  return static_cast<int>(cudaGetLastError());
}

extern "C" int probe_empty_wide(void* stream) {
  probe_empty_wide_kernel<<<64, 128, 0, static_cast<cudaStream_t>(stream)>>>(WideArgs{});
  return static_cast<int>(cudaGetLastError());
}

// pool: slots x ctas x 1024 float4 (16 KB per CTA); 128 threads x 8 vectors cover one tile.
extern "C" int probe_chain(void* stream, const int* idx, void* pool, int ctas) {
  probe_chain_kernel<<<ctas, 128, 0, static_cast<cudaStream_t>(stream)>>>(idx, static_cast<float4*>(pool), 1024);
  return static_cast<int>(cudaGetLastError());
}

// inputs: host array of 8 device pointers to float tensors of ctas * 128 elements (passed by value, as kernel
// arguments); out: ctas * 128 floats.
extern "C" int probe_chain_inputs(void* stream, const int* idx, void* pool, int ctas, const float* const* inputs,
                                  void* out) {
  Inputs in;
  for (int i = 0; i < 8; ++i) in.p[i] = inputs[i];
  probe_chain_inputs_kernel<<<ctas, 128, 0, static_cast<cudaStream_t>(stream)>>>(
      idx, static_cast<float4*>(pool), 1024, in, static_cast<float*>(out));
  return static_cast<int>(cudaGetLastError());
}

extern "C" int probe_chain_code(void* stream, const int* idx, void* pool, int ctas) {
  probe_chain_code_kernel<<<ctas, 128, 0, static_cast<cudaStream_t>(stream)>>>(idx, static_cast<float4*>(pool), 1024);
  return static_cast<int>(cudaGetLastError());
}

template <int B>
struct ArgBlock {
  char bytes[B];
};

template <int B>
__global__ void probe_args_kernel(const ArgBlock<B>) {}

// An empty 64-CTA launch with an argument block of `bytes` bytes (8, 64, 128, 160, 192, 224, 256, 304, 384, 512,
// 1024 or 4096).
extern "C" int probe_args(void* stream, int bytes) {
  const auto s = static_cast<cudaStream_t>(stream);
  switch (bytes) {
#define KDAKIT_PROBE_ARGS(B) \
  case B: probe_args_kernel<B><<<64, 128, 0, s>>>(ArgBlock<B>{}); break;
    KDAKIT_PROBE_ARGS(8) KDAKIT_PROBE_ARGS(64) KDAKIT_PROBE_ARGS(128) KDAKIT_PROBE_ARGS(160) KDAKIT_PROBE_ARGS(192)
    KDAKIT_PROBE_ARGS(224) KDAKIT_PROBE_ARGS(256) KDAKIT_PROBE_ARGS(304) KDAKIT_PROBE_ARGS(384) KDAKIT_PROBE_ARGS(512)
    KDAKIT_PROBE_ARGS(1024) KDAKIT_PROBE_ARGS(4096)
#undef KDAKIT_PROBE_ARGS
    default: return -1;
  }
  return static_cast<int>(cudaGetLastError());
}
