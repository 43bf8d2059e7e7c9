// Depthwise family: a K x K depthwise convolution (groups == channels, one filter per channel) of
// NHWC images, dilation 1, any stride and padding, with the bias, an optional residual and ReLU
// fused. A candidate beside cuDNN's (whose NHWC depthwise kernels are often slow); per-layer
// timing picks.
//
// Weights are f32 in [K*K, C] order (tap-major, channels innermost, so neighbouring threads read
// neighbouring weights); bias is f32 [C] (or null); residual has y's shape (or null).
// One thread per output pixel and VEC channels: VEC = the 16-byte pack when C allows (`vec`).

template <typename T, int K, int VEC>
__device__ __forceinline__ void depthwise_px(const T* x, const float* w, const float* bias, const T* residual, T* y, i64 i, int H,
                                             int W, int C, int OH, int OW, int sh, int sw, int ph, int pw, int relu) {
    const int CV = C / VEC;
    const int cv = (int)(i % CV);
    i64 p = i / CV;
    const int ox = (int)(p % OW);
    p /= OW;
    const int oy = (int)(p % OH);
    const i64 n = p / OH;
    const int c0 = cv * VEC;
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = bias ? bias[c0 + k] : 0.f;
    const int iy0 = oy * sh - ph, ix0 = ox * sw - pw;
    const T* img = x + n * H * W * C + c0;
#pragma unroll
    for (int r = 0; r < K; ++r) {
        const int iy = iy0 + r;
        if (iy < 0 || iy >= H) continue;
#pragma unroll
        for (int s = 0; s < K; ++s) {
            const int ix = ix0 + s;
            if (ix < 0 || ix >= W) continue;
            const T* src = img + ((i64)iy * W + ix) * C;
            const float* wt = w + (r * K + s) * C + c0;
            if (VEC > 1) {
                Pack<T> v = load_pack(src);
#pragma unroll
                for (int k = 0; k < VEC; ++k) acc[k] += wt[k] * to_f32(v.e[k]);
            } else {
                acc[0] += wt[0] * to_f32(src[0]);
            }
        }
    }
    const i64 out = (((n * OH + oy) * OW + ox) * C) + c0;
    if (VEC > 1) {
        Pack<T> o, z;
        if (residual) z = load_pack(residual + out);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            float t = acc[k] + (residual ? to_f32(z.e[k]) : 0.f);
            o.e[k] = from_f32<T>(relu && t < 0.f ? 0.f : t);
        }
        store_pack(y + out, o);
    } else {
        float t = acc[0] + (residual ? to_f32(residual[out]) : 0.f);
        y[out] = from_f32<T>(relu && t < 0.f ? 0.f : t);
    }
}

template <typename T, int K>
__device__ void depthwise(const T* x, const float* w, const float* bias, const T* residual, T* y, int N, int H, int W, int C, int OH,
                          int OW, int sh, int sw, int ph, int pw, int relu, int vec) {
    const int P = Pack<T>::N;
    if (vec && C % P == 0 && aligned16(x) && aligned16(y) && (residual == 0 || aligned16(residual))) {
        GRID_STRIDE(i, (i64)N * OH * OW * (C / P)) { depthwise_px<T, K, Pack<T>::N>(x, w, bias, residual, y, i, H, W, C, OH, OW, sh, sw, ph, pw, relu); }
        return;
    }
    GRID_STRIDE(i, (i64)N * OH * OW * C) { depthwise_px<T, K, 1>(x, w, bias, residual, y, i, H, W, C, OH, OW, sh, sw, ph, pw, relu); }
}

#define DEPTHWISE_ARGS(T)                                                                                                                \
    const T *x, const float *w, const float *bias, const T *residual, T *y, int N, int H, int W, int C, int OH, int OW, int sh, int sw, \
        int ph, int pw, int relu, int vec
#define DEPTHWISE_PASS x, w, bias, residual, y, N, H, W, C, OH, OW, sh, sw, ph, pw, relu, vec

#define DEPTHWISE(T, S)                                                                                                                 \
    extern "C" __global__ void depthwise_k3_##S(DEPTHWISE_ARGS(T)) { depthwise<T, 3>(DEPTHWISE_PASS); }                                    \
    extern "C" __global__ void depthwise_k5_##S(DEPTHWISE_ARGS(T)) { depthwise<T, 5>(DEPTHWISE_PASS); }                                    \
    extern "C" __global__ void depthwise_k7_##S(DEPTHWISE_ARGS(T)) { depthwise<T, 7>(DEPTHWISE_PASS); }

DEPTHWISE(float, f32)
DEPTHWISE(f16, f16)
