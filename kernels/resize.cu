// Resize family: nearest and bilinear upsampling of NHWC images. The per-axis source indices and
// weights are computed once on the host with PyTorch's arithmetic (src/ops/resize.rs) and read
// from tables, so the GPU picks exactly the pixels the CPU reference does:
//   nearest:  tab = iy[OH], ix[OW]
//   bilinear: tab = iy0[OH], iy1[OH], ix0[OW], ix1[OW]; lam = ly0[OH], ly1[OH], lx0[OW], lx1[OW]
// One thread per output element, or per 16-byte pack of channels when C allows (`vec`).

// Output element (or channel pack) i of an NHWC [N, OH, OW, C] tensor as (n, oy, ox, c).
struct OutPixel {
    i64 n;
    int oy, ox, c;
};
__device__ __forceinline__ OutPixel out_pixel(i64 i, int C, int OH, int OW) {
    OutPixel o;
    o.c = (int)(i % C);
    i64 p = i / C;
    o.ox = (int)(p % OW);
    p /= OW;
    o.oy = (int)(p % OH);
    o.n = p / OH;
    return o;
}

template <typename T>
__device__ void resize_nearest(const T* x, T* y, int N, int H, int W, int C, int OH, int OW, const int* tab, int vec) {
    const int* iy = tab;
    const int* ix = tab + OH;
    typedef Pack<T> P;
    if (vec && aligned16(x) && aligned16(y)) {
        const int CP = C / P::N;
        GRID_STRIDE(i, (i64)N * OH * OW * CP) {
            const OutPixel at = out_pixel(i, CP, OH, OW);
            const int cp = at.c, ox = at.ox, oy = at.oy;
            const i64 n = at.n;
            store_pack(y + i * P::N, load_pack(x + ((n * H + iy[oy]) * W + ix[ox]) * C + (i64)cp * P::N));
        }
        return;
    }
    GRID_STRIDE(i, (i64)N * OH * OW * C) {
        const OutPixel at = out_pixel(i, C, OH, OW);
        const int c = at.c, ox = at.ox, oy = at.oy;
        const i64 n = at.n;
        y[i] = x[((n * H + iy[oy]) * W + ix[ox]) * C + c];
    }
}

// out = ly0 * (lx0 * x00 + lx1 * x01) + ly1 * (lx0 * x10 + lx1 * x11), in PyTorch's order.
__device__ __forceinline__ float lerp2(float x00, float x01, float x10, float x11, float ly0, float ly1, float lx0, float lx1) {
    return ly0 * (lx0 * x00 + lx1 * x01) + ly1 * (lx0 * x10 + lx1 * x11);
}

template <typename T>
__device__ void resize_bilinear(const T* x, T* y, int N, int H, int W, int C, int OH, int OW, const int* tab, const float* lam, int vec) {
    const int *iy0 = tab, *iy1 = tab + OH, *ix0 = tab + 2 * OH, *ix1 = tab + 2 * OH + OW;
    const float *ly0 = lam, *ly1 = lam + OH, *lx0 = lam + 2 * OH, *lx1 = lam + 2 * OH + OW;
    typedef Pack<T> P;
    if (vec && aligned16(x) && aligned16(y)) {
        const int CP = C / P::N;
        GRID_STRIDE(i, (i64)N * OH * OW * CP) {
            const OutPixel at = out_pixel(i, CP, OH, OW);
            const int cp = at.c, ox = at.ox, oy = at.oy;
            const i64 n = at.n;
            const T* img = x + n * H * W * C + (i64)cp * P::N;
            const i64 r0 = (i64)iy0[oy] * W, r1 = (i64)iy1[oy] * W;
            P a = load_pack(img + (r0 + ix0[ox]) * C), b = load_pack(img + (r0 + ix1[ox]) * C);
            P c = load_pack(img + (r1 + ix0[ox]) * C), d = load_pack(img + (r1 + ix1[ox]) * C);
            const float wy0 = ly0[oy], wy1 = ly1[oy], wx0 = lx0[ox], wx1 = lx1[ox];
            P o;
#pragma unroll
            for (int k = 0; k < P::N; ++k)
                o.e[k] = from_f32<T>(lerp2(to_f32(a.e[k]), to_f32(b.e[k]), to_f32(c.e[k]), to_f32(d.e[k]), wy0, wy1, wx0, wx1));
            store_pack(y + i * P::N, o);
        }
        return;
    }
    GRID_STRIDE(i, (i64)N * OH * OW * C) {
        const OutPixel at = out_pixel(i, C, OH, OW);
        const int ch = at.c, ox = at.ox, oy = at.oy;
        const i64 n = at.n;
        const T* img = x + n * H * W * C + ch;
        const i64 r0 = (i64)iy0[oy] * W, r1 = (i64)iy1[oy] * W;
        y[i] = from_f32<T>(lerp2(to_f32(img[(r0 + ix0[ox]) * C]), to_f32(img[(r0 + ix1[ox]) * C]), to_f32(img[(r1 + ix0[ox]) * C]),
                                 to_f32(img[(r1 + ix1[ox]) * C]), ly0[oy], ly1[oy], lx0[ox], lx1[ox]));
    }
}

#define RESIZE(T, S)                                                                                                                   \
    extern "C" __global__ void resize_nearest_##S(const T* x, T* y, int N, int H, int W, int C, int OH, int OW, const int* tab,         \
                                                  int vec) {                                                                           \
        resize_nearest<T>(x, y, N, H, W, C, OH, OW, tab, vec);                                                                         \
    }                                                                                                                                  \
    extern "C" __global__ void resize_bilinear_##S(const T* x, T* y, int N, int H, int W, int C, int OH, int OW, const int* tab,        \
                                                   const float* lam, int vec) {                                                        \
        resize_bilinear<T>(x, y, N, H, W, C, OH, OW, tab, lam, vec);                                                                   \
    }

RESIZE(float, f32)
RESIZE(f16, f16)
