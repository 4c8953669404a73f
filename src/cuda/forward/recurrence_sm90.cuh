// The value-row recurrence's products on Hopper (VrowsStep, WG = true): warpgroup MMAs (common/sm90/gmma.cuh). Each
// group of four warps (64 value rows) issues them together with its register A fragments, and the workspace tiles,
// stored in the 128-byte-swizzled layout, are read from shared memory once per warpgroup instead of once per warp
// (ldmatrix). The MMAs run asynchronously: the output products of the chunk-start state are a batch of their own,
// in flight while the warps form v_new. Same products, roundings and k order as the mma.sync step
// (recurrence_sm80.cuh), so the same bits.
#pragma once

#include "cuda/common/sm90/gmma.cuh"
#include "cuda/forward/recurrence_vrows.cuh"

namespace kdakit::cuda {

template <typename Elem, int KP, int BV, bool NO_OUT, bool ONE_STAGE>
struct VrowsStep<Elem, KP, BV, NO_OUT, ONE_STAGE, true> {
  static_assert(sizeof(Elem) == 2, "warpgroup MMAs take bf16 operands");
  using L = VrowsLayout<sizeof(Elem), KP, BV, ONE_STAGE, true>;
  using Stage = RecurrenceStage<Elem>;
  static constexpr int ND = KP / 8, NC = 64 / 8, VP = 1;  // v_new rounded once to bf16

  // The MMAs read the stage through the asynchronous proxy.
  __device__ __forceinline__ static void before_handover() { sm90::fence_shared_to_async(); }

  // Every key step's A fragments first (they stay untouched until the MMAs are done), then the decay: S was last
  // written by MMAs, and a write to it after a batch is issued is made to wait for the whole batch (ptxas C7517), so
  // it goes before, not under, the products. Then vn's products, per key step lo then hi as the mma.sync step, as one
  // batch, and o's as a second batch that v_new's epilogue does not wait for (value_products' wait completes it).
  template <typename Decay>
  __device__ __forceinline__ static void state_products(FragC (&S)[ND], const Stage& t, int, FragC (&vn)[NC],
                                                        FragC (&o)[NC], Decay&& decay) {
#if KDAKIT_SM90A
    FragA sa[KP / 16][2];
#pragma unroll
    for (int kd = 0; kd < KP / 16; ++kd) {
      acc_to_parts<2>(S[2 * kd], S[2 * kd + 1], sa[kd]);
      sm90::fence_operands(sa[kd][0]);
      sm90::fence_operands(sa[kd][1]);
    }
    decay();
    sm90::fence_operands(vn);
    sm90::fence_operands(o);
    const sm90::TileDescriptors<KP, true> dw(t.w);
    const sm90::TileDescriptors<KP, true> dq(t.q);
    sm90::arrive();
#pragma unroll
    for (int kd = 0; kd < KP / 16; ++kd) {
#pragma unroll
      for (int part = 0; part < 2; ++part) sm90::mma_rs<sm90::Major::K>(vn, sa[kd][1 - part], dw(kd));
    }
    sm90::commit();
    if constexpr (!NO_OUT) {
#pragma unroll
      for (int kd = 0; kd < KP / 16; ++kd) {
#pragma unroll
        for (int part = 0; part < 2; ++part) sm90::mma_rs<sm90::Major::K>(o, sa[kd][1 - part], dq(kd));
      }
      sm90::commit();
    }
    sm90::wait<NO_OUT ? 0 : 1>();
    sm90::fence_operands(vn);
#pragma unroll
    for (int kd = 0; kd < KP / 16; ++kd) {
      sm90::fence_operands(sa[kd][0]);
      sm90::fence_operands(sa[kd][1]);
    }
#else
    (void)S, (void)t, (void)vn, (void)o, (void)decay;
    __trap();
#endif
  }

  // S^T += v_new^T kg (kg read MN-major), then o^T += v_new^T Aqk^T over every source block (the blocks above the
  // diagonal are zero: exact), lo tile first, as the mma.sync step.
  __device__ __forceinline__ static void value_products(FragC (&S)[ND], FragA (&va)[NC / 2][1], const Stage& t, int,
                                                        FragC (&o)[NC]) {
#if KDAKIT_SM90A
    sm90::fence_operands(S);
    sm90::fence_operands(o);
#pragma unroll
    for (int kt = 0; kt < NC / 2; ++kt) sm90::fence_operands(va[kt][0]);
    const sm90::TileDescriptors<KP, false> dk(t.k);
    const sm90::TileDescriptors<64, true> dalo(t.alo);
    const sm90::TileDescriptors<64, true> da(t.a);
    sm90::arrive();
#pragma unroll
    for (int kt = 0; kt < NC / 2; ++kt) sm90::mma_rs<sm90::Major::MN>(S, va[kt][0], dk(kt));
    if constexpr (!NO_OUT) {
#pragma unroll
      for (int part = 0; part < 2; ++part) {
#pragma unroll
        for (int kt = 0; kt < NC / 2; ++kt) sm90::mma_rs<sm90::Major::K>(o, va[kt][0], part ? da(kt) : dalo(kt));
      }
    }
    sm90::commit();
    sm90::wait<0>();
    sm90::fence_operands(S);
    sm90::fence_operands(o);
#pragma unroll
    for (int kt = 0; kt < NC / 2; ++kt) sm90::fence_operands(va[kt][0]);
#else
    (void)S, (void)va, (void)t, (void)o;
    __trap();
#endif
  }

  // bf16 outputs in 16-byte rows (ForwardArgs::vec_out): the warp's 16 value columns x 64 chunk rows transposed
  // through shared memory (stmatrix), then stored row by row. False where the caller stores them element by element.
  __device__ __forceinline__ static bool store_outputs(const ForwardArgs& a, const FragC (&o)[NC], Elem* sO,
                                                       int64_t orow0, int nrows, int r0, int v0) {
    if (!a.vec_out) return false;
#if KDAKIT_SM90A
    const int lane = threadIdx.x & 31;
    __syncwarp();  // this warp's reads of the previous chunk's tile are done
    const int m = lane >> 3, i = lane & 7;
#pragma unroll
    for (int p = 0; p < NC / 2; ++p) {
      const FragC &c0 = o[2 * p], &c1 = o[2 * p + 1];
      sm90::store_matrices_t(sO + (16 * p + 8 * (m >> 1) + i) * L::LDB + r0 + 8 * (m & 1), pack_bf16(c0.x[0], c0.x[1]),
                             pack_bf16(c0.x[2], c0.x[3]), pack_bf16(c1.x[0], c1.x[1]), pack_bf16(c1.x[2], c1.x[3]));
    }
    __syncwarp();
    Elem* op = static_cast<Elem*>(a.out.p) + orow0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int q = lane + 32 * j, r = q >> 1, h = 8 * (q & 1);
      if (r < nrows && v0 + h < a.V) {
        *reinterpret_cast<uint4*>(op + r * a.out.st + v0 + h) = *reinterpret_cast<const uint4*>(sO + r * L::LDB + r0 + h);
      }
    }
#else
    (void)o, (void)sO, (void)orow0, (void)nrows, (void)r0, (void)v0;
    __trap();
#endif
    return true;
  }

  template <typename Decay>
  __device__ __forceinline__ static void update_state(FragC (&)[ND], FragA (&)[NC / 2][1], const Stage&, int,
                                                      Decay&&) {}  // done in value_products
};

}  // namespace kdakit::cuda
