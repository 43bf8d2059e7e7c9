// Quantisation family (src/ops/quant.rs): quantize, dequantize and fake-quantize, int8 and fp8
// e4m3, per tensor or per channel, in the engine's activation type. The arithmetic mirrors the CPU
// reference exactly: q = clamp(rint(x * (1/scale)) + zp, qmin, qmax) for int8 (round half to
// even), q = e4m3(clamp(x * (1/scale), +-448)) for fp8; dequantize (q - zp) * scale.
// The channel of element i is (i / inner) % channels (inner: the physical stride of the channel
// dim; per tensor: channels = inner = 1).

// Mode codes shared with src/ops/quant.rs (`Quant::kernel_mode`).
#define QMODE_FAKE 0
#define QMODE_QUANTIZE 1
#define QMODE_DEQUANTIZE 2
// Format codes (`QuantFormat` order).
#define QFMT_INT8 0
#define QFMT_E4M3 1

#define E4M3_MAX 448.0f

// v rounded to the nearest e4m3 value (ties to even, subnormals kept), |v| <= 448. Scaling by a
// power of two is exact, so rintf is the only rounding, as in `round_e4m3` on the CPU.
__device__ __forceinline__ float round_e4m3(float v) {
    if (v != v || v == 0.0f) return v;
    float a = fminf(fabsf(v), E4M3_MAX);
    int e = (int)((__float_as_uint(a) >> 23) & 0xff) - 127;
    e = e < -6 ? -6 : e;
    float step = __uint_as_float((unsigned)(e - 3 + 127) << 23);
    float inv_step = __uint_as_float((unsigned)(3 - e + 127) << 23);
    return copysignf(rintf(a * inv_step) * step, v);
}

// inv_scale is 1/scale rounded to f32 (the CPU reference's `1/s`).
__device__ __forceinline__ float quantize_value(float x, float inv_scale, float zp, int fmt, float qmin, float qmax) {
    float t = x * inv_scale;
    if (fmt == QFMT_E4M3) return round_e4m3(fminf(fmaxf(t, -E4M3_MAX), E4M3_MAX));
    return fminf(fmaxf(rintf(t) + zp, qmin), qmax);
}

__device__ __forceinline__ float dequantize_value(float q, float scale, float zp) { return (q - zp) * scale; }

template <typename T>
__device__ void quant(const T* x, T* y, i64 n, const float* scale, const float* zp, i64 inner, int channels, int mode, int fmt, float qmin,
                      float qmax) {
    GRID_STRIDE(i, n) {
        int c = channels > 1 ? (int)((i / inner) % channels) : 0;
        float s = scale[c], z = zp[c], v = to_f32(x[i]);
        if (mode != QMODE_DEQUANTIZE) v = quantize_value(v, 1.0f / s, z, fmt, qmin, qmax);
        if (mode != QMODE_QUANTIZE) v = dequantize_value(v, s, z);
        y[i] = from_f32<T>(v);
    }
}

// Per tensor, 16 bytes per thread and step (8 f16 or 4 f32), 32-bit-free indexing of vectors: the
// activation quantisers of 8-bit engines, which read and write whole feature maps. The per-element
// kernel above recomputed a 64-bit channel index and an f32 division per element and ran at a
// tenth of memory speed. nvec = n / (16 / sizeof(T)); x and y 16-byte aligned.
template <typename T>
__device__ void quant_tensor(const uint4* x, uint4* y, i64 nvec, float s, float inv_s, float z, int mode, int fmt, float qmin, float qmax) {
    constexpr int V = 16 / sizeof(T);
    GRID_STRIDE(i, nvec) {
        uint4 r = x[i];
        T* e = reinterpret_cast<T*>(&r);
#pragma unroll
        for (int k = 0; k < V; k++) {
            float v = to_f32(e[k]);
            if (mode != QMODE_DEQUANTIZE) v = quantize_value(v, inv_s, z, fmt, qmin, qmax);
            if (mode != QMODE_QUANTIZE) v = dequantize_value(v, s, z);
            e[k] = from_f32<T>(v);
        }
        y[i] = r;
    }
}

// The e4m3 bits of a value already on the e4m3 grid (|v| <= 448): sign, 4 exponent bits (bias
// 7), 3 mantissa bits; below 2^-6 the subnormals m * 2^-9. Mirrors `encode_e4m3` in src/ops/quant.rs.
__device__ __forceinline__ unsigned char encode_e4m3(float v) {
    unsigned int b = __float_as_uint(v);
    unsigned char sign = (b >> 24) & 0x80;
    float a = fabsf(v);
    if (a == 0.0f) return sign;
    if (a < 0.015625f) return sign | (unsigned char)(a * 512.0f);
    int e = (int)((b >> 23) & 0xff) - 127;
    return sign | (unsigned char)(((e + 7) << 3) | ((b >> 20) & 7));
}

// The codes of a per-tensor, symmetric quantiser: int8 as two's complement, fp8 as e4m3 bits
// (saturated, nearest even). They are the stored value of an 8-bit engine's quantiser
// (src/engine/conv8.rs) and an FP8 GEMM's activation operand (`to_e4m3_*`). Eight per thread and
// step when n is a multiple of 8 and the pointers are aligned (arena values are), else one.
template <typename T> __device__ __forceinline__ unsigned char code_of(T x, float inv_s, int fmt, float qmin, float qmax) {
    float v = quantize_value(to_f32(x), inv_s, 0.f, fmt, qmin, qmax);
    return fmt == QFMT_E4M3 ? encode_e4m3(v) : (unsigned char)(signed char)(int)v;
}
template <typename T> __device__ void quant_codes(const T* x, unsigned char* q, i64 n, float inv_s, int fmt, float qmin, float qmax) {
    if (n % 8 == 0 && ((size_t)x % 16) == 0 && ((size_t)q % 8) == 0) {
        GRID_STRIDE(i, n / 8) {
            T e[8];
#pragma unroll
            for (int h = 0; h < 8 * (int)sizeof(T); h += 16) *reinterpret_cast<uint4*>(reinterpret_cast<char*>(e) + h) = *reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(x + i * 8) + h);
            unsigned char b[8];
#pragma unroll
            for (int k = 0; k < 8; k++) b[k] = code_of(e[k], inv_s, fmt, qmin, qmax);
            reinterpret_cast<uint2*>(q)[i] = *reinterpret_cast<uint2*>(b);
        }
        return;
    }
    GRID_STRIDE(i, n) { q[i] = code_of(x[i], inv_s, fmt, qmin, qmax); }
}

#define QUANT(T, S)                                                                                                                   \
    extern "C" __global__ void quant_##S(const T* x, T* y, i64 n, const float* scale, const float* zp, i64 inner, int channels, int mode, \
                                         int fmt, float qmin, float qmax) {                                                         \
        quant<T>(x, y, n, scale, zp, inner, channels, mode, fmt, qmin, qmax);                                                       \
    }                                                                                                                               \
    extern "C" __global__ void to_e4m3_##S(const T* x, unsigned char* q, i64 n, float inv_scale) {                                \
        quant_codes<T>(x, q, n, inv_scale, QFMT_E4M3, 0.f, 0.f);                                                                     \
    }                                                                                                                               \
    extern "C" __global__ void quant_tensor_##S(const uint4* x, uint4* y, i64 nvec, float s, float inv_s, float z, int mode, int fmt,  \
                                                float qmin, float qmax) {                                                           \
        quant_tensor<T>(x, y, nvec, s, inv_s, z, mode, fmt, qmin, qmax);                                                            \
    }                                                                                                                               \
    extern "C" __global__ void quant_codes_##S(const T* x, unsigned char* q, i64 n, float inv_s, int fmt, float qmin, float qmax) {   \
        quant_codes<T>(x, q, n, inv_s, fmt, qmin, qmax);                                                                              \
    }

QUANT(float, f32)
QUANT(f16, f16)
