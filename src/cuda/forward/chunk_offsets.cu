// chunk_offsets[n] = chunks of the sequences before n (a block-wide scan over per-thread ranges).
#include "cuda/forward/kernels.cuh"

namespace kdakit::cuda {

__global__ void chunk_offsets_kernel(const ForwardArgs a) {
  __shared__ int64_t partial[1024];
  const int nt = blockDim.x, tid = threadIdx.x;
  const int per = (a.N + nt - 1) / nt;
  const int lo = min(a.N, tid * per), hi = min(a.N, lo + per);
  auto chunks = [&](int n) {
    int64_t b, t0, len;
    a.sequence(n, b, t0, len);
    return (len + a.chunk - 1) / a.chunk;
  };
  int64_t own = 0;
  for (int n = lo; n < hi; ++n) own += chunks(n);
  partial[tid] = own;
  __syncthreads();
  for (int off = 1; off < nt; off <<= 1) {  // inclusive scan
    const int64_t add = tid >= off ? partial[tid - off] : 0;
    __syncthreads();
    partial[tid] += add;
    __syncthreads();
  }
  int64_t run = partial[tid] - own;
  if (tid == 0) a.chunk_offsets[0] = 0;
  for (int n = lo; n < hi; ++n) {
    run += chunks(n);
    a.chunk_offsets[n + 1] = run;
  }
}

}  // namespace kdakit::cuda
