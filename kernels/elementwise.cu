// Elementwise family: activations, add/mul with a fused activation, and the bias + activation
// (+ residual) epilogue for layers whose library call cannot fuse it.
// Every entry point may run in place (y == x or y == a); each element is read before it is
// written by the same thread.

// y = act(x) over `n` values. `activation_*` takes the op at run time (a switch per value);
// the common ops also have their own small entry points, `activation_<op>_*`, with the op a
// compile-time constant, so the switch folds away and only its function is inlined (a switch per
// value costs a branch and stops the compiler interleaving values; one kernel holding a loop per
// op was slower to launch than either, on small tensors).
template <typename T> __device__ __forceinline__ void activation(const T* x, T* y, i64 n, int act, float p0, float p1) {
    typedef Pack<T> P;
    i64 head = 0;
    if (aligned16(x) && aligned16(y)) {
        head = n / P::N * P::N;
        GRID_STRIDE(v, n / P::N) {
            P p = load_pack(x + v * P::N);
#pragma unroll
            for (int k = 0; k < P::N; ++k) p.e[k] = from_f32<T>(apply_act2(to_f32(p.e[k]), act, p0, p1));
            store_pack(y + v * P::N, p);
        }
    }
    GRID_STRIDE(i, n - head) { y[head + i] = from_f32<T>(apply_act2(to_f32(x[head + i]), act, p0, p1)); }
}

// Binary op codes shared with src/ops/elementwise.rs (`Binary::kernel_code`).
#define BIN_ADD 0
#define BIN_SUB 1
#define BIN_MUL 2
#define BIN_DIV 3

__device__ __forceinline__ float combine(float a, float b, int op) {
    switch (op) {
    case BIN_SUB: return a - b;
    case BIN_MUL: return a * b;
    case BIN_DIV: return a / b;
    default: return a + b;
    }
}

// y = act(a op b) for two operands of the same shape and layout.
template <typename T> __device__ void binary(const T* a, const T* b, T* y, i64 n, int op, int act, float slope) {
    typedef Pack<T> P;
    i64 head = 0;
    if (aligned16(a) && aligned16(b) && aligned16(y)) {
        head = n / P::N * P::N;
        GRID_STRIDE(v, n / P::N) {
            P pa = load_pack(a + v * P::N);
            P pb = load_pack(b + v * P::N);
#pragma unroll
            for (int k = 0; k < P::N; ++k) pa.e[k] = from_f32<T>(apply_act(combine(to_f32(pa.e[k]), to_f32(pb.e[k]), op), act, slope));
            store_pack(y + v * P::N, pa);
        }
    }
    GRID_STRIDE(i, n - head) {
        i64 j = head + i;
        y[j] = from_f32<T>(apply_act(combine(to_f32(a[j]), to_f32(b[j]), op), act, slope));
    }
}

// y = a op b with broadcasting: every operand is read through its own strides, so operands may
// be in any layout, broadcast along any dims (stride 0) or be a constant shared by every image
// (batch stride 0). y is written in its own physical order; `meta` holds, for each of its rank
// dims (outermost first, size-1 dims dropped and contiguous runs merged by the host), the size,
// then a's stride, then b's stride, then a's and b's batch strides. With `vec`, the innermost
// dim is a multiple of the pack width and each operand's innermost stride is 1 (a pack is
// loaded) or 0 (one value is repeated), every other stride a multiple of the pack width.
template <typename T> __device__ __forceinline__ void bcast_offsets(i64 e, const i64* meta, int rank, i64& oa, i64& ob) {
    const i64* size = meta;
    const i64* sa = meta + rank;
    const i64* sb = meta + 2 * rank;
    i64 rem = e;
    oa = 0;
    ob = 0;
    for (int d = rank - 1; d >= 0; --d) {
        const i64 idx = rem % size[d];
        rem /= size[d];
        oa += idx * sa[d];
        ob += idx * sb[d];
    }
    oa += rem * meta[3 * rank];
    ob += rem * meta[3 * rank + 1];
}

template <typename T> __device__ void binary_bcast(const T* a, const T* b, T* y, i64 n, const i64* meta, int rank, int op, int vec) {
    typedef Pack<T> P;
    if (vec && aligned16(a) && aligned16(b) && aligned16(y)) {
        const bool pa = meta[2 * rank - 1] != 0, pb = meta[3 * rank - 1] != 0;
        GRID_STRIDE(v, n / P::N) {
            i64 oa, ob;
            bcast_offsets<T>(v * P::N, meta, rank, oa, ob);
            P x, z;
            if (pa) x = load_pack(a + oa);
            if (pb) z = load_pack(b + ob);
            const float sa = pa ? 0.f : to_f32(a[oa]);
            const float sb = pb ? 0.f : to_f32(b[ob]);
#pragma unroll
            for (int k = 0; k < P::N; ++k) x.e[k] = from_f32<T>(combine(pa ? to_f32(x.e[k]) : sa, pb ? to_f32(z.e[k]) : sb, op));
            store_pack(y + v * P::N, x);
        }
        return;
    }
    GRID_STRIDE(i, n) {
        i64 oa, ob;
        bcast_offsets<T>(i, meta, rank, oa, ob);
        y[i] = from_f32<T>(combine(to_f32(a[oa]), to_f32(b[ob]), op));
    }
}

// y[r, c] = act(x[r, c] * scale[c] + bias[c] + residual[r, c]) over rows = N*H*W of C channels
// (NHWC). `scale` and `bias` are always f32 (BatchNorm's scale and shift lose precision in f16);
// `scale`, `bias` and `residual` may be null.
template <typename T>
__device__ void bias_act(const T* x, const float* scale, const float* bias, const T* residual, T* y, i64 rows, int C, int act, float slope) {
    typedef Pack<T> P;
    const i64 n = rows * C;
    if (C % P::N == 0 && aligned16(x) && aligned16(y) && (residual == 0 || aligned16(residual))) {
        GRID_STRIDE(v, n / P::N) {
            const i64 base = v * P::N;
            const int c0 = (int)(base % C);
            P p = load_pack(x + base);
            P r;
            if (residual) r = load_pack(residual + base);
#pragma unroll
            for (int k = 0; k < P::N; ++k) {
                float t = to_f32(p.e[k]);
                if (scale) t *= scale[c0 + k];
                if (bias) t += bias[c0 + k];
                if (residual) t += to_f32(r.e[k]);
                p.e[k] = from_f32<T>(apply_act(t, act, slope));
            }
            store_pack(y + base, p);
        }
        return;
    }
    GRID_STRIDE(i, n) {
        float t = to_f32(x[i]);
        if (scale) t *= scale[i % C];
        if (bias) t += bias[i % C];
        if (residual) t += to_f32(residual[i]);
        y[i] = from_f32<T>(apply_act(t, act, slope));
    }
}

#define ELEMENTWISE(T, S)                                                                                                                    \
    extern "C" __global__ void activation_##S(const T* x, T* y, i64 n, int act, float p0, float p1) { activation<T>(x, y, n, act, p0, p1); }   \
    extern "C" __global__ void activation_relu_##S(const T* x, T* y, i64 n, int, float p0, float p1) { activation<T>(x, y, n, ACT_RELU, p0, p1); } \
    extern "C" __global__ void activation_sigmoid_##S(const T* x, T* y, i64 n, int, float p0, float p1) {                                     \
        activation<T>(x, y, n, ACT_SIGMOID, p0, p1);                                                                                         \
    }                                                                                                                                        \
    extern "C" __global__ void activation_silu_##S(const T* x, T* y, i64 n, int, float p0, float p1) { activation<T>(x, y, n, ACT_SILU, p0, p1); } \
    extern "C" __global__ void activation_hardswish_##S(const T* x, T* y, i64 n, int, float p0, float p1) {                                   \
        activation<T>(x, y, n, ACT_HARDSWISH, p0, p1);                                                                                       \
    }                                                                                                                                        \
    extern "C" __global__ void activation_hardsigmoid_##S(const T* x, T* y, i64 n, int, float p0, float p1) {                                 \
        activation<T>(x, y, n, ACT_HARDSIGMOID, p0, p1);                                                                                     \
    }                                                                                                                                        \
    extern "C" __global__ void activation_gelu_##S(const T* x, T* y, i64 n, int, float p0, float p1) { activation<T>(x, y, n, ACT_GELU, p0, p1); } \
    extern "C" __global__ void activation_gelu_tanh_##S(const T* x, T* y, i64 n, int, float p0, float p1) {                                   \
        activation<T>(x, y, n, ACT_GELU_TANH, p0, p1);                                                                                       \
    }                                                                                                                                        \
    extern "C" __global__ void activation_clamp_##S(const T* x, T* y, i64 n, int, float p0, float p1) {                                       \
        activation<T>(x, y, n, ACT_CLAMP, p0, p1);                                                                                           \
    }                                                                                                                                        \
    extern "C" __global__ void binary_##S(const T* a, const T* b, T* y, i64 n, int op, int act, float slope) {                                 \
        binary<T>(a, b, y, n, op, act, slope);                                                                                               \
    }                                                                                                                                        \
    extern "C" __global__ void binary_bcast_##S(const T* a, const T* b, T* y, i64 n, const i64* meta, int rank, int op, int vec) {          \
        binary_bcast<T>(a, b, y, n, meta, rank, op, vec);                                                                                 \
    }                                                                                                                                        \
    extern "C" __global__ void bias_act_##S(const T* x, const float* scale, const float* bias, const T* residual, T* y, i64 rows, int C, int act, \
                                            float slope) {                                                                                 \
        bias_act<T>(x, scale, bias, residual, y, rows, C, act, slope);                                                                                \
    }

ELEMENTWISE(float, f32)
ELEMENTWISE(f16, f16)
