// The 8-bit convolutions' shared contract (prepended to kernels/conv8.cu and kernels/conv8_hopper.cu,
// after kernels/eight_bit.cuh): the arguments every 8-bit conv entry point takes, and the end of
// the epilogue they all run, so that the mma.sync tiles, split-K's finishing kernel and the
// Hopper wgmma kernel compute the same numbers. The arithmetic is described in conv8.cu's header.

// Output and residual storage codes (`Store8` in src/ops/conv/conv8.rs).
#define C8_NONE 0
#define C8_F16 1
#define C8_Q8 2

struct Conv8Args {
    const unsigned char* x;
    const unsigned char* w;
    const float* alpha;
    const float* bias;
    const void* z;
    void* y;
    float z_scale, inv_y_scale, qmin, qmax;
    int z_store, y_store, relu;
    int n, h, w_, c, k, r, s, p, q;
    int stride_h, stride_w, pad_h, pad_w, dil_h, dil_w;
    // Split-K: `splits` blocks share a tile's reduction, each writing its f32 partial sums to
    // ws[split][row][k]; conv8_finish then adds them and runs the epilogue. 1: no split.
    float* ws;
    int splits;
};

// Two codes (a u16, the first in the low byte) added to v0, v1 as values: code · scale. int8
// through integer extraction; e4m3 through the hardware's e4m3x2 → f16x2 conversion (sm_89+).
template <bool FP8> __device__ __forceinline__ void decode2(unsigned pair, float scale, float& v0, float& v1) {
    if constexpr (!FP8) {
        v0 += (float)(signed char)(pair & 0xff) * scale;
        v1 += (float)(signed char)((pair >> 8) & 0xff) * scale;
    } else {
#if __CUDA_ARCH__ >= 890
        unsigned f2;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(f2) : "h"((unsigned short)pair));
        f16 lo, hi;
        lo.bits = f2 & 0xffff;
        hi.bits = f2 >> 16;
        v0 += to_f32(lo) * scale;
        v1 += to_f32(hi) * scale;
#else
        __trap();
#endif
    }
}

// 16 codes (one uint4) added to v as values, pair by pair as decode2.
template <bool FP8> __device__ __forceinline__ void decode16(uint4 q, float scale, float* v) {
    const unsigned* w = reinterpret_cast<const unsigned*>(&q);
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) decode2<FP8>(w[i] >> (16 * h), scale, v[4 * i + 2 * h], v[4 * i + 2 * h + 1]);
}

// The end of the epilogue for 16 consecutive channels at output offset o, given v = acc · alpha
// + bias: the residual (f16, or the codes zq), ReLU, then f16 or codes, stored as 16-byte vectors.
template <bool FP8> __device__ __forceinline__ void finish16(const Conv8Args& a, float* v, long long o, uint4 zq) {
    if (a.z_store == C8_F16) {
        const uint4* zp = reinterpret_cast<const uint4*>(reinterpret_cast<const f16*>(a.z) + o);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            uint4 zz = zp[h];
            const unsigned* w = reinterpret_cast<const unsigned*>(&zz);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                f16 lo, hi;
                lo.bits = w[i] & 0xffff;
                hi.bits = w[i] >> 16;
                v[h * 8 + 2 * i] += to_f32(lo);
                v[h * 8 + 2 * i + 1] += to_f32(hi);
            }
        }
    } else if (a.z_store == C8_Q8) {
        decode16<FP8>(zq, a.z_scale, v);
    }
    if (a.relu) {
#pragma unroll
        for (int i = 0; i < 16; i++) v[i] = fmaxf(v[i], 0.f);
    }
    if (a.y_store == C8_F16) {
        uint4* yp = reinterpret_cast<uint4*>(reinterpret_cast<f16*>(a.y) + o);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            uint4 r;
            r.x = pack_f16x2(v[h * 8 + 0], v[h * 8 + 1]);
            r.y = pack_f16x2(v[h * 8 + 2], v[h * 8 + 3]);
            r.z = pack_f16x2(v[h * 8 + 4], v[h * 8 + 5]);
            r.w = pack_f16x2(v[h * 8 + 6], v[h * 8 + 7]);
            yp[h] = r;
        }
    } else {
        uint4 r;
        unsigned* w = reinterpret_cast<unsigned*>(&r);
#pragma unroll
        for (int i = 0; i < 4; i++)
            w[i] = encode4<FP8>(v + 4 * i, a.inv_y_scale, a.qmin, a.qmax);
        *reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(a.y) + o) = r;
    }
}

// Both entry kinds take the arguments flattened (the launcher passes scalars and pointers), in
// `Conv8Layer::enqueue`'s order, and gather them into one Conv8Args.
#define CONV8_PARAMS                                                                                                                 \
    const unsigned char *x, const unsigned char *w, const float *alpha, const float *bias, const void *z, void *y, float z_scale,     \
        float inv_y_scale, float qmin, float qmax, int z_store, int y_store, int relu, int n, int h, int wd, int c, int k, int r,    \
        int s, int p, int q, int sh, int sw, int ph, int pw, int dh, int dw, float *ws, int splits
#define CONV8_ARGS                                                                                                                   \
    Conv8Args a = {x, w, alpha, bias, z, y, z_scale, inv_y_scale, qmin, qmax, z_store, y_store, relu, n, h, wd, c, k, r, s, p, q,    \
                   sh, sw, ph, pw, dh, dw, ws, splits}

