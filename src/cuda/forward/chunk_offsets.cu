// chunk_offsets[n] and seg_offsets[n]: chunks and context-parallel segments of the sequences before n (a block-wide
// scan over per-thread ranges); seq_order: the sequences longest first (ties in index order), by rank counting.
#include "cuda/forward/launch.cuh"

namespace kdakit::cuda {

__global__ void chunk_offsets_kernel(const ForwardArgs a) {
  // Inclusive scans of chunks and segments per sequence; sequences split evenly over the threads.
  __shared__ int64_t partial[2][kMaxOrdered];  // the kernel runs one block of kMaxOrdered threads
  const int nt = blockDim.x, tid = threadIdx.x;
  const int per = (a.N + nt - 1) / nt;
  const int lo = min(a.N, tid * per), hi = min(a.N, lo + per);
  auto counts = [&](int n, int64_t& segs) {
    int64_t b, t0, len, unused;
    sequence(a, n, b, t0, len);
    const int64_t nch = (len + a.chunk - 1) / a.chunk;
    segs = a.segments_of(nch, unused);
    return nch;
  };
  int64_t own = 0, own_s = 0;
  for (int n = lo; n < hi; ++n) {
    int64_t s;
    own += counts(n, s);
    own_s += s;
  }
  partial[0][tid] = own;
  partial[1][tid] = own_s;
  __syncthreads();
  for (int off = 1; off < nt; off <<= 1) {
    const int64_t add = tid >= off ? partial[0][tid - off] : 0, add_s = tid >= off ? partial[1][tid - off] : 0;
    __syncthreads();
    partial[0][tid] += add;
    partial[1][tid] += add_s;
    __syncthreads();
  }
  int64_t run = partial[0][tid] - own, run_s = partial[1][tid] - own_s;
  if (tid == 0) {
    a.chunk_offsets[0] = 0;
    if (a.seg_offsets != nullptr) a.seg_offsets[0] = 0;
  }
  for (int n = lo; n < hi; ++n) {
    int64_t s;
    run += counts(n, s);
    run_s += s;
    a.chunk_offsets[n + 1] = run;
    if (a.seg_offsets != nullptr) a.seg_offsets[n + 1] = run_s;
  }
  if (a.seq_order != nullptr) {  // N <= kMaxOrdered = blockDim.x: one sequence per thread
    __shared__ int64_t lens[kMaxOrdered];
    int64_t len = -1;
    if (tid < a.N) {
      int64_t b, t0;
      sequence(a, tid, b, t0, len);
      lens[tid] = len;
    }
    __syncthreads();
    if (tid < a.N) {
      int rank = 0;
      for (int m = 0; m < a.N; ++m) rank += lens[m] > len || (lens[m] == len && m < tid);
      a.seq_order[rank] = tid;
    }
  }
}

}  // namespace kdakit::cuda
