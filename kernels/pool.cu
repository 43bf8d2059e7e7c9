// Pooling family, NHWC: max and average pooling with PyTorch's padding, ceil_mode and
// count_include_pad semantics, and adaptive average pooling to any output size (the global
// average pool of ResNet is its 1x1 case).
//
// One thread per output (n, oh, ow, channel pack): neighbouring threads read neighbouring
// channels, so every window read is coalesced; a pack is 16 bytes when C allows it.

struct PoolGeom {
    int N, H, W, C, OH, OW;
    int kh, kw, sh, sw, ph, pw;
};

// Calls f(n, oh, ow, c0, lanes) for every output position and channel pack.
template <typename T, typename F> __device__ __forceinline__ void for_each_output(const T* x, T* y, int N, int OH, int OW, int C, F f) {
    const int vec = (C % Pack<T>::N == 0 && aligned16(x) && aligned16(y)) ? Pack<T>::N : 1;
    const int packs = C / vec;
    const i64 total = (i64)N * OH * OW * packs;
    GRID_STRIDE(i, total) {
        const int cp = (int)(i % packs);
        i64 r = i / packs;
        const int ow = (int)(r % OW);
        r /= OW;
        const int oh = (int)(r % OH);
        const int n = (int)(r / OH);
        f(n, oh, ow, cp * vec, vec);
    }
}

// Reduces the window rows [h0, h1) x cols [w0, w1) of channels c0..c0+lanes; `max` or sum.
template <typename T, bool MAX> __device__ __forceinline__ void reduce_window(const T* x, int n, int H, int W, int C, int h0, int h1, int w0, int w1, int c0, int lanes, float* acc) {
    typedef Pack<T> P;
    for (int k = 0; k < P::N; ++k) acc[k] = MAX ? neg_inf() : 0.f;
    for (int h = h0; h < h1; ++h) {
        for (int w = w0; w < w1; ++w) {
            const T* px = x + (((i64)n * H + h) * W + w) * C + c0;
            if (lanes == P::N) {
                P p = load_pack(px);
#pragma unroll
                for (int k = 0; k < P::N; ++k) {
                    const float v = to_f32(p.e[k]);
                    // fmaxf drops NaN; PyTorch's max pool propagates it.
                    acc[k] = MAX ? ((v > acc[k] || v != v) ? v : acc[k]) : acc[k] + v;
                }
            } else {
                const float v = to_f32(*px);
                acc[0] = MAX ? ((v > acc[0] || v != v) ? v : acc[0]) : acc[0] + v;
            }
        }
    }
}

template <typename T> __device__ __forceinline__ void store_lanes(T* py, int lanes, const float* acc, float scale) {
    typedef Pack<T> P;
    if (lanes == P::N) {
        P p;
#pragma unroll
        for (int k = 0; k < P::N; ++k) p.e[k] = from_f32<T>(acc[k] * scale);
        store_pack(py, p);
    } else {
        *py = from_f32<T>(acc[0] * scale);
    }
}

// Padding is -inf: windows are clipped to the input (PyTorch guarantees each window holds at
// least one input element: padding <= kernel / 2, and ceil_mode windows start inside).
template <typename T> __device__ void max_pool2d(const T* x, T* y, PoolGeom g) {
    for_each_output(x, y, g.N, g.OH, g.OW, g.C, [&](int n, int oh, int ow, int c0, int lanes) {
        const int hs = oh * g.sh - g.ph, ws = ow * g.sw - g.pw;
        float acc[Pack<T>::N];
        reduce_window<T, true>(x, n, g.H, g.W, g.C, max(hs, 0), min(hs + g.kh, g.H), max(ws, 0), min(ws + g.kw, g.W), c0, lanes, acc);
        store_lanes(y + (((i64)n * g.OH + oh) * g.OW + ow) * g.C + c0, lanes, acc, 1.f);
    });
}

// PyTorch's divisor: with count_include_pad the window clipped to the *padded* input, else the
// window clipped to the input. (A ceil_mode window hanging past the padding is not counted.)
template <typename T> __device__ void avg_pool2d(const T* x, T* y, PoolGeom g, int count_include_pad) {
    for_each_output(x, y, g.N, g.OH, g.OW, g.C, [&](int n, int oh, int ow, int c0, int lanes) {
        int hs = oh * g.sh - g.ph, ws = ow * g.sw - g.pw;
        int he = min(hs + g.kh, g.H + g.ph), we = min(ws + g.kw, g.W + g.pw);
        const int padded = (he - hs) * (we - ws);
        hs = max(hs, 0);
        ws = max(ws, 0);
        he = min(he, g.H);
        we = min(we, g.W);
        const int inside = (he - hs) * (we - ws);
        const int div = count_include_pad ? padded : inside;
        float acc[Pack<T>::N];
        reduce_window<T, false>(x, n, g.H, g.W, g.C, hs, he, ws, we, c0, lanes, acc);
        store_lanes(y + (((i64)n * g.OH + oh) * g.OW + ow) * g.C + c0, lanes, acc, div > 0 ? 1.f / div : 0.f);
    });
}

// Output cell o of O over an input of I covers [floor(o*I/O), ceil((o+1)*I/O)).
template <typename T> __device__ void adaptive_avg_pool2d(const T* x, T* y, int N, int H, int W, int C, int OH, int OW) {
    for_each_output(x, y, N, OH, OW, C, [&](int n, int oh, int ow, int c0, int lanes) {
        const int hs = oh * H / OH, he = ((oh + 1) * H + OH - 1) / OH;
        const int ws = ow * W / OW, we = ((ow + 1) * W + OW - 1) / OW;
        float acc[Pack<T>::N];
        reduce_window<T, false>(x, n, H, W, C, hs, he, ws, we, c0, lanes, acc);
        store_lanes(y + (((i64)n * OH + oh) * OW + ow) * C + c0, lanes, acc, 1.f / ((he - hs) * (we - ws)));
    });
}

// The maximum over adaptive_avg_pool2d's cells (NaN wins, as in PyTorch).
template <typename T> __device__ void adaptive_max_pool2d(const T* x, T* y, int N, int H, int W, int C, int OH, int OW) {
    for_each_output(x, y, N, OH, OW, C, [&](int n, int oh, int ow, int c0, int lanes) {
        const int hs = oh * H / OH, he = ((oh + 1) * H + OH - 1) / OH;
        const int ws = ow * W / OW, we = ((ow + 1) * W + OW - 1) / OW;
        float acc[Pack<T>::N];
        reduce_window<T, true>(x, n, H, W, C, hs, he, ws, we, c0, lanes, acc);
        store_lanes(y + (((i64)n * OH + oh) * OW + ow) * C + c0, lanes, acc, 1.f);
    });
}

// Global average pooling of NHWC maps (adaptive pooling to 1x1, squeeze-excitation's pool): one
// block of 32 x GAP_ROWS threads per (image, 32 channel packs). A lane owns one pack (16 bytes
// of channels where C and the pointers allow, else one channel), so a warp reads 512 contiguous
// bytes of a pixel; the GAP_ROWS rows stride over the pixels, and shared memory adds the rows'
// partial sums. (One 2-byte channel per lane, as before, read 64 bytes per warp and request.)
#define GAP_ROWS 8
template <typename T> __device__ void global_avg_pool(const T* x, T* y, int HW, int C) {
    typedef Pack<T> P;
    __shared__ float part[GAP_ROWS][32][P::N + 1];
    const int lane = threadIdx.x & 31, row = threadIdx.x >> 5;
    const int vec = (C % P::N == 0 && aligned16(x) && aligned16(y)) ? P::N : 1;
    const int packs = C / vec, n = blockIdx.x, pk = blockIdx.y * 32 + lane, c0 = pk * vec;
    float acc[P::N];
#pragma unroll
    for (int k = 0; k < P::N; ++k) acc[k] = 0.f;
    if (pk < packs) {
        const T* p = x + (i64)n * HW * C + c0;
        if (vec == P::N) {
#pragma unroll 4
            for (int i = row; i < HW; i += GAP_ROWS) {
                const P v = load_pack(p + (i64)i * C);
#pragma unroll
                for (int k = 0; k < P::N; ++k) acc[k] += to_f32(v.e[k]);
            }
        } else {
            for (int i = row; i < HW; i += GAP_ROWS) acc[0] += to_f32(p[(i64)i * C]);
        }
    }
#pragma unroll
    for (int k = 0; k < P::N; ++k) part[row][lane][k] = acc[k];
    __syncthreads();
    if (row == 0 && pk < packs) {
        const float inv = 1.f / (float)HW;
        for (int k = 0; k < vec; ++k) {
            float s = 0.f;
            for (int r = 0; r < GAP_ROWS; ++r) s += part[r][lane][k];
            acc[k] = s;
        }
        store_lanes(y + (i64)n * C + c0, vec, acc, inv);
    }
}

#define POOL(T, S)                                                                                                                            \
    extern "C" __global__ void max_pool2d_##S(const T* x, T* y, int N, int H, int W, int C, int OH, int OW, int kh, int kw, int sh, int sw,  \
                                              int ph, int pw) {                                                                             \
        max_pool2d<T>(x, y, PoolGeom{N, H, W, C, OH, OW, kh, kw, sh, sw, ph, pw});                                                          \
    }                                                                                                                                       \
    extern "C" __global__ void avg_pool2d_##S(const T* x, T* y, int N, int H, int W, int C, int OH, int OW, int kh, int kw, int sh, int sw,  \
                                              int ph, int pw, int count_include_pad) {                                                      \
        avg_pool2d<T>(x, y, PoolGeom{N, H, W, C, OH, OW, kh, kw, sh, sw, ph, pw}, count_include_pad);                                       \
    }                                                                                                                                       \
    extern "C" __global__ void adaptive_avg_pool2d_##S(const T* x, T* y, int N, int H, int W, int C, int OH, int OW) {                        \
        adaptive_avg_pool2d<T>(x, y, N, H, W, C, OH, OW);                                                                                   \
    }                                                                                                                                       \
    extern "C" __global__ void adaptive_max_pool2d_##S(const T* x, T* y, int N, int H, int W, int C, int OH, int OW) {                        \
        adaptive_max_pool2d<T>(x, y, N, H, W, C, OH, OW);                                                                                   \
    }                                                                                                                                       \
    extern "C" __global__ void global_avg_pool_##S(const T* x, T* y, int HW, int C) { global_avg_pool<T>(x, y, HW, C); }

POOL(float, f32)
POOL(f16, f16)
