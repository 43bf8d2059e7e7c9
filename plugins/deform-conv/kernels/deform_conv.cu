// Deformable im2col for `deform_conv2d` (torchvision's DCNv2), f32 and f16, sampling in f32.
// Compiled on demand by Kiln's NVRTC cache (`ctx.kernels.add_source`), after Kiln's prelude
// (kernels/common.cuh: f16, to_f32, from_f32, GRID_STRIDE, i64).
//
// The engine hands the converter NHWC values, so the column matrix is built in the order that
// makes the GEMM's output NHWC directly: one row per output pixel (n, oy, ox), K = KH*KW*C
// columns in (tap, channel) order (k = (i * KW + j) * C + c), zero-padded to KP (a multiple of 8,
// so f16 rows are whole 16-byte packs for cuBLASLt). The GEMM with the [Cout, KP] weights then
// writes y [N*HO*WO, Cout], which is the NHWC output (src/gpu.rs).
//
// Inputs, all NHWC: x [N, H, W, C]; offset [N, HO, WO, 2*OG*KH*KW] with (dy, dx) of offset group
// g and tap t at channels 2*(g*KH*KW + t) and +1; mask [N, HO, WO, OG*KH*KW] or null (no mask).
//
// One thread per column element: consecutive threads take consecutive channels of one tap, so
// the reads of x (4 corners) and the writes of col are coalesced; the offset and mask of a tap
// are shared by the channels of its offset group and come from L1.

// torchvision's bilinear_interpolate on channel c of an NHWC image: zero beyond one pixel
// outside, and each corner contributes only where it lies inside.
template <typename T> __device__ __forceinline__ float deform_bilinear(const T* x, int H, int W, int C, int c, float y, float xf) {
    if (y <= -1.f || (float)H <= y || xf <= -1.f || (float)W <= xf) return 0.f;
    const float y0f = floorf(y), x0f = floorf(xf);
    const int y0 = (int)y0f, x0 = (int)x0f, y1 = y0 + 1, x1 = x0 + 1;
    const float ly = y - y0f, lx = xf - x0f, hy = 1.f - ly, hx = 1.f - lx;
    float v1 = 0.f, v2 = 0.f, v3 = 0.f, v4 = 0.f;
    if (y0 >= 0 && x0 >= 0) v1 = to_f32(x[((i64)y0 * W + x0) * C + c]);
    if (y0 >= 0 && x1 <= W - 1) v2 = to_f32(x[((i64)y0 * W + x1) * C + c]);
    if (y1 <= H - 1 && x0 >= 0) v3 = to_f32(x[((i64)y1 * W + x0) * C + c]);
    if (y1 <= H - 1 && x1 <= W - 1) v4 = to_f32(x[((i64)y1 * W + x1) * C + c]);
    return hy * hx * v1 + hy * lx * v2 + ly * hx * v3 + ly * lx * v4;
}

// col [rows, KP] for the first `rows` output pixels of the batch (rows = N * HO * WO).
// Launch: 1-D grid-stride over rows * KP elements.
template <typename T>
__device__ void deform_im2col(const T* x, const T* offset, const T* mask, T* col, i64 rows, int H, int W, int C, int HO, int WO, int KH, int KW,
                              int sh, int sw, int ph, int pw, int dh, int dw, int OG, int KP) {
    const int taps = KH * KW;
    const int K = taps * C;
    const int c_per_group = C / OG;
    const i64 pixels = (i64)HO * WO;
    GRID_STRIDE(i, rows * KP) {
        const i64 row = i / KP;
        const int k = (int)(i - row * KP);
        float v = 0.f;
        if (k < K) {
            const int t = k / C, c = k - t * C;
            const int ti = t / KW, tj = t - ti * KW;
            const int g = c / c_per_group;
            const i64 n = row / pixels;
            const int p = (int)(row - n * pixels);
            const int oy = p / WO, ox = p - oy * WO;
            const T* off = offset + row * (2 * OG * taps) + 2 * (g * taps + t);
            // Integer base position first, then the offset, as torchvision computes it.
            const float y = (float)(oy * sh - ph + ti * dh) + to_f32(off[0]);
            const float xf = (float)(ox * sw - pw + tj * dw) + to_f32(off[1]);
            const float m = mask ? to_f32(mask[row * (OG * taps) + g * taps + t]) : 1.f;
            v = m * deform_bilinear(x + n * H * W * C, H, W, C, c, y, xf);
        }
        col[i] = from_f32<T>(v);
    }
}

#define DEFORM_IM2COL(T, S)                                                                                                        \
    extern "C" __global__ void deform_im2col_##S(const T* x, const T* offset, const T* mask, T* col, i64 rows, int H, int W, int C, \
                                                 int HO, int WO, int KH, int KW, int sh, int sw, int ph, int pw, int dh, int dw,     \
                                                 int OG, int KP) {                                                                 \
        deform_im2col<T>(x, offset, mask, col, rows, H, W, C, HO, WO, KH, KW, sh, sw, ph, pw, dh, dw, OG, KP);                     \
    }

DEFORM_IM2COL(float, f32)
DEFORM_IM2COL(f16, f16)
