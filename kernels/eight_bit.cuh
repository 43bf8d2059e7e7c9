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

// 16 (4) bytes global → shared through L1 (`.ca`), zero-filled where !valid: a k×k conv reads
// each input pixel for several taps and neighbouring output rows (the weights, read once per
// block, take common.cuh's `cp_async16`, which bypasses L1).
__device__ __forceinline__ void cp_async16_ca(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4_ca(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}

// Conversions without the conversion unit (the pointwise conv's epilogue). sm_80 and sm_90 convert 16 values per clock per SM
// between integers and floats, an eighth of their FP32 rate, and an 8-bit epilogue converts two or
// three times per output (accumulator, residual code, output code): Nsight Compute found the
// pointwise conv bound by it. Whole numbers are exact floats in [2^23, 2^24), one apart, and the
// bits of 2^23 + n are 2^23's bits + n: so an integer added to a float's bits, or a float rounded
// by adding 1.5 · 2^23, crosses between the two with full-rate integer and FP32 instructions.
#define F_MAGIC 12582912.f  // 1.5 · 2^23
#define I_MAGIC 0x4B400000  // its bits

// x as a float, exactly, for |x| <= 2^22: an int8 dot product of at most 256 terms (|x| <= 256 ·
// 128 · 128), which the pointwise conv's accumulators are.
__device__ __forceinline__ float small_int_to_float(int x) { return __int_as_float(x + I_MAGIC) - F_MAGIC; }

// The accumulator of a dot product of at most 256 terms (the pointwise conv's, C <= 256) as a
// float: int8's exactly without the conversion unit; e4m3's is one already.
__device__ __forceinline__ float short_dot_value(int acc) { return small_int_to_float(acc); }
__device__ __forceinline__ float short_dot_value(float acc) { return acc; }

// Byte B of an int8 code word as a float, given the word with its sign bits flipped (w ^
// 0x80808080, so that the byte is the code + 128): 2^23 + code + 128, less 2^23 + 128.
template <int B> __device__ __forceinline__ float int8_code_value(unsigned flipped) {
    return __uint_as_float(__byte_perm(flipped, 0x4B000000u, 0x7540 + B)) - 8388736.f;
}

// v · inv_s rounded half to even and clamped to [lo, hi] (kernels/quant.cu's quantize_value),
// returned as the bits of 1.5 · 2^23 + code, whose low byte is the int8 code. The product is
// rounded on its own (no FMA) as quantize_value's is; beyond ±2^22 the sum is no longer whole but
// still beyond the clamp.
__device__ __forceinline__ unsigned int8_code_bits(float v, float inv_s, float lo, float hi) {
    return __float_as_uint(fminf(fmaxf(__fadd_rn(__fmul_rn(v, inv_s), F_MAGIC), lo + F_MAGIC), hi + F_MAGIC));
}

// The low bytes of two code-bearing words, first in the low byte.
__device__ __forceinline__ unsigned pack2_low_bytes(unsigned a, unsigned b) { return __byte_perm(a, b, 0x0040) & 0xffff; }

// Four values requantised to four codes (one u32, first value in the low byte): int8 as
// kernels/quant.cu's quantize_value (round half to even, clamped to [qmin, qmax]); e4m3 with
// saturation, nearest even (the hardware conversion, sm_89+).
template <bool FP8> __device__ __forceinline__ unsigned encode4(const float* v, float inv_s, float qmin, float qmax);
template <> __device__ __forceinline__ unsigned encode4<false>(const float* v, float inv_s, float qmin, float qmax) {
    if (qmin == -128.f && qmax == 127.f) {
        // The full int8 range: round to nearest even (cvt.rni), then saturate and pack two pairs
        // (cvt.pack.sat: d = c's low half << 16 | sat(a) << 8 | sat(b)): 6 instructions for 4
        // codes instead of about 30. The conversion-free int8_code_bits measured slower here
        // (the tile kernel's and the stem's epilogues are not bound by the conversion unit).
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

// Two values requantised to two codes (a u16, first value in the low byte), as encode4: the
// pointwise conv's epilogue, which is bound by the conversion unit, so int8 takes
// int8_code_bits.
template <bool FP8> __device__ __forceinline__ unsigned encode2(float v0, float v1, float inv_s, float qmin, float qmax) {
    if (!FP8) return pack2_low_bytes(int8_code_bits(v0, inv_s, qmin, qmax), int8_code_bits(v1, inv_s, qmin, qmax));
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(v1 * inv_s), "f"(v0 * inv_s));
    return r;
#else
    __trap();
    return 0;
#endif
}

// Two values requantised to two codes as encode4 (cvt), for an epilogue the conversion unit does
// not bind (the stem's): half encode4's conversions where only two values are real.
template <bool FP8> __device__ __forceinline__ unsigned encode2_cvt(float v0, float v1, float inv_s, float qmin, float qmax) {
    if (FP8 || qmin != -128.f || qmax != 127.f) {
        const float v[4] = {v0, v1, 0.f, 0.f};
        return encode4<FP8>(v, inv_s, qmin, qmax) & 0xffff;
    }
    const int q0 = __float2int_rn(v0 * inv_s), q1 = __float2int_rn(v1 * inv_s);
    unsigned r;
    asm("cvt.pack.sat.s8.s32.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(q1), "r"(q0), "r"(0));
    return r;
}
