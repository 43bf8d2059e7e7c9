// Prepended by src/engine/kernels.rs to every kernels/*.cu before NVRTC compiles it, so the
// families share one definition of the element types and helpers without an #include (NVRTC has
// no CUDA headers of its own, and CI has none installed).
//
// Conventions of every kernel:
// - activations are NHWC, batch-major; N is a kernel argument (the batch is known only at run time);
// - element type `float` or `f16` (IEEE binary16 bits); arithmetic accumulates in float (the
//   entry reformats also read `unsigned char`, the bytes of an input declared u8);
// - entry points are `extern "C"` and stamped out per dtype with a macro: `relu_f32`, `relu_f16`;
// - grid-stride loops, so any grid size is correct and the host sizes grids for occupancy.

typedef unsigned long long u64;
typedef long long i64;

// binary16 as its bits; conversions through PTX (round to nearest even), as cuda_fp16.h does.
struct __align__(2) f16 {
    unsigned short bits;
};

__device__ __forceinline__ float to_f32(float x) { return x; }
// Bytes: only read, from an input binding declared u8 (the entry reformats), never written.
__device__ __forceinline__ float to_f32(unsigned char x) { return (float)x; }
__device__ __forceinline__ float to_f32(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ f16 from_f32<f16>(float x) {
    f16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
}

// 16 bytes of elements (4 floats or 8 halves), moved with one 128-bit load or store.
template <typename T> struct Pack {
    static const int N = 16 / sizeof(T);
    union {
        uint4 u;
        T e[16 / sizeof(T)];
    };
};

template <typename T> __device__ __forceinline__ Pack<T> load_pack(const T* p) {
    Pack<T> r;
    r.u = *reinterpret_cast<const uint4*>(p);
    return r;
}
template <typename T> __device__ __forceinline__ void store_pack(T* p, const Pack<T>& r) { *reinterpret_cast<uint4*>(p) = r.u; }

// No math headers under NVRTC: -inf from its bits.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<u64>(p) & 15) == 0; }

#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n); i += (i64)blockDim.x * gridDim.x)

// Unary op codes shared with src/ops/elementwise.rs (`Unary::kernel_code`); p0, p1 are its
// parameters (slope; clamp bounds; affine scale and shift).
#define ACT_NONE 0
#define ACT_RELU 1
#define ACT_LEAKY 2
#define ACT_SIGMOID 3
#define ACT_SILU 4
#define ACT_HARDSWISH 5
#define ACT_HARDSIGMOID 6
#define ACT_GELU 7
#define ACT_GELU_TANH 8
#define ACT_TANH 9
#define ACT_ASINH 10
#define ACT_CLAMP 11
#define ACT_AFFINE 12

__device__ __forceinline__ float relu6f(float v) { return v < 0.f ? 0.f : (v > 6.f ? 6.f : v); }

// NaN propagates as in PyTorch (comparisons with NaN are false, so NaN falls through).
__device__ __forceinline__ float apply_act2(float v, int act, float p0, float p1) {
    switch (act) {
    case ACT_RELU: return v < 0.f ? 0.f : v;
    case ACT_LEAKY: return v < 0.f ? v * p0 : v;
    case ACT_SIGMOID: return 1.f / (1.f + expf(-v));
    case ACT_SILU: return v / (1.f + expf(-v));
    case ACT_HARDSWISH: return v * relu6f(v + 3.f) * (1.f / 6.f);
    case ACT_HARDSIGMOID: return relu6f(v + 3.f) * (1.f / 6.f);
    case ACT_GELU: return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
    case ACT_GELU_TANH: return 0.5f * v * (1.f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    case ACT_TANH: return tanhf(v);
    case ACT_ASINH: return asinhf(v);
    case ACT_CLAMP: return v < p0 ? p0 : (v > p1 ? p1 : v);
    case ACT_AFFINE: return v * p0 + p1;
    default: return v;
    }
}

__device__ __forceinline__ float apply_act(float v, int act, float slope) { return apply_act2(v, act, slope, 0.f); }
