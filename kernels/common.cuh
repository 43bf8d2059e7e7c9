// Prepended by src/engine/kernels.rs to every kernels/*.cu before NVRTC compiles it, so the
// families share one definition of the element types and helpers without an #include (NVRTC has
// no CUDA headers of its own, and CI has none installed).
//
// Conventions of every kernel:
// - activations are NHWC, batch-major; N is a kernel argument (the batch is known only at run time);
// - element type `float` or `f16` (IEEE binary16 bits); arithmetic accumulates in float;
// - entry points are `extern "C"` and stamped out per dtype with a macro: `relu_f32`, `relu_f16`;
// - grid-stride loops, so any grid size is correct and the host sizes grids for occupancy.

typedef unsigned long long u64;
typedef long long i64;

// binary16 as its bits; conversions through PTX (round to nearest even), as cuda_fp16.h does.
struct __align__(2) f16 {
    unsigned short bits;
};

__device__ __forceinline__ float to_f32(float x) { return x; }
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

// Activation codes shared with src/engine/kernel_layers.rs (`KernelAct`).
#define ACT_NONE 0
#define ACT_RELU 1
#define ACT_LEAKY 2
#define ACT_SIGMOID 3

// NaN propagates through ReLU as in PyTorch (`x < 0` is false for NaN).
__device__ __forceinline__ float apply_act(float v, int act, float slope) {
    switch (act) {
    case ACT_RELU: return v < 0.f ? 0.f : v;
    case ACT_LEAKY: return v < 0.f ? v * slope : v;
    case ACT_SIGMOID: return 1.f / (1.f + expf(-v));
    default: return v;
    }
}
