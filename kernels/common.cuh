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
// parameters (slope; clamp bounds; affine scale and shift; softplus beta and threshold; elu alpha;
// pow exponent).
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
#define ACT_SOFTPLUS 13
#define ACT_EXP 14
#define ACT_LOG 15
#define ACT_SQRT 16
#define ACT_RSQRT 17
#define ACT_RECIPROCAL 18
#define ACT_ABS 19
#define ACT_ERF 20
#define ACT_ELU 21
#define ACT_MISH 22
#define ACT_POW 23

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
    case ACT_SOFTPLUS: return v * p0 > p1 ? v : log1pf(expf(v * p0)) / p0;
    case ACT_EXP: return expf(v);
    case ACT_LOG: return logf(v);
    case ACT_SQRT: return sqrtf(v);
    // 1 / sqrtf rather than rsqrtf: rsqrtf is 2 ulp, PyTorch divides.
    case ACT_RSQRT: return 1.f / sqrtf(v);
    case ACT_RECIPROCAL: return 1.f / v;
    case ACT_ABS: return fabsf(v);
    case ACT_ERF: return erff(v);
    case ACT_ELU: return v > 0.f ? v : p0 * expm1f(v);
    case ACT_MISH: return v * tanhf(log1pf(expf(v)));
    case ACT_POW: return powf(v, p0);
    default: return v;
    }
}

__device__ __forceinline__ float apply_act(float v, int act, float slope) { return apply_act2(v, act, slope, 0.f); }

// ---- Tensor cores (sm_80+): the helpers of the mma.sync kernels (attention, the fused stem)

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Two f32 as one f16x2 register, `lo` in the low half.
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void mma_16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16 bytes global → shared without L1 (`.cg`), zero-filled where !valid (`src` must still be a
// mapped address); `cp_async_commit` closes a group, `cp_async_wait<N>` waits until at most N
// groups are in flight.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Four 8×8 b16 matrices from shared memory: lanes 8i .. 8i + 7 give the row addresses of matrix i
// (16-byte aligned); thread T receives row T / 4, columns 2·(T % 4) and + 1 of each in r[i].
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// ---- Block-wide sorting (the detectors' decode and NMS kernels in kiln-models)

__device__ __forceinline__ int next_pow2(int v) {
    int m = 1;
    while (m < v) m <<= 1;
    return m;
}

// Sorts s[0, m) descending in shared memory; m is a power of two; all threads of the block take part.
__device__ void bitonic_sort_desc(u64* s, int m) {
    for (int k = 2; k <= m; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < m / 2; i += blockDim.x) {
                const int lo = (i / j) * 2 * j + (i % j), hi = lo + j;
                const u64 a = s[lo], b = s[hi];
                const bool desc = (lo & k) == 0;
                if (desc ? a < b : a > b) {
                    s[lo] = b;
                    s[hi] = a;
                }
            }
            __syncthreads();
        }
    }
}
