// 8-bit tensor-core helpers shared by the 8-bit convs (conv8.cu) and the 8-bit stem (stem.cu):
// prepended to both sources (src/engine/kernels.rs, `ON_DEMAND`), after kernels/common.cuh.

// The accumulator type: exact s32 for int8 products, f32 for e4m3's.
template <bool FP8> struct Acc;
template <> struct Acc<false> {
    typedef int T;
};
template <> struct Acc<true> {
    typedef float T;
};

__device__ __forceinline__ void mma_8bit(int* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_8bit(float* c, const unsigned* a, unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 890
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

// Four values requantised to four codes (one u32, first value in the low byte): int8 as
// kernels/quant.cu's quantize_value (round half to even, clamped to [qmin, qmax]); e4m3 with
// saturation, nearest even (the hardware conversion, sm_89+).
template <bool FP8> __device__ __forceinline__ unsigned encode4(const float* v, float inv_s, float qmin, float qmax);
template <> __device__ __forceinline__ unsigned encode4<false>(const float* v, float inv_s, float qmin, float qmax) {
    if (qmin == -128.f && qmax == 127.f) {
        // The full int8 range: round to nearest even (cvt.rni), then saturate and pack two pairs
        // (cvt.pack.sat: d = c's low half << 16 | sat(a) << 8 | sat(b)). The epilogue is
        // instruction-bound, and this is 6 instructions for 4 codes instead of about 30.
        int q0 = __float2int_rn(v[0] * inv_s), q1 = __float2int_rn(v[1] * inv_s);
        int q2 = __float2int_rn(v[2] * inv_s), q3 = __float2int_rn(v[3] * inv_s);
        unsigned hi, r;
        asm("cvt.pack.sat.s8.s32.b32 %0, %1, %2, %3;" : "=r"(hi) : "r"(q3), "r"(q2), "r"(0));
        asm("cvt.pack.sat.s8.s32.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(q1), "r"(q0), "r"(hi));
        return r;
    }
    unsigned r = 0;
#pragma unroll
    for (int b = 0; b < 4; b++) r |= ((unsigned)(int)fminf(fmaxf(rintf(v[b] * inv_s), qmin), qmax) & 0xff) << (8 * b);
    return r;
}
template <> __device__ __forceinline__ unsigned encode4<true>(const float* v, float inv_s, float, float) {
#if __CUDA_ARCH__ >= 890
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(v[1] * inv_s), "f"(v[0] * inv_s));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(v[3] * inv_s), "f"(v[2] * inv_s));
    return (unsigned)lo | ((unsigned)hi << 16);
#else
    __trap();
    return 0;
#endif
}

