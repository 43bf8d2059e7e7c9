// YOLO letterbox: a frame of interleaved byte values [N, H, W * 3], B, G, R (bgr = 1) or R, G, B
// (bgr = 0), to the model input [N, 3, IH, IW] (RGB, / 255), in the output value's layout
// (strides sc, sy, sx per image).
// The per-row and per-column taps (rows: [IH, 4], cols: [IW, 4] of s0, s1, w0, w1; s0 < 0 in the
// padding) come from the CPU reference (models/src/yolo_letterbox.rs), and the arithmetic is
// the same f32 operations in the same order, never contracted into FMAs, so both match exactly.

template <typename T>
__device__ void letterbox(const T* frame, const float* rows, const float* cols, int N, int H, int W, int IH, int IW, i64 sc, i64 sy,
                          i64 sx, int bgr, T* out) {
    GRID_STRIDE(i, (i64)N * IH * IW) {
        const int x = (int)(i % IW);
        const int y = (int)((i / IW) % IH);
        const int n = (int)(i / ((i64)IH * IW));
        const float* ty = rows + y * 4;
        const float* tx = cols + x * 4;
        T* o = out + (i64)n * 3 * IH * IW + y * sy + x * sx;
        if (ty[0] < 0.f || tx[0] < 0.f) {
            const T pad = from_f32<T>(__fdiv_rn(114.f, 255.f));
            o[0] = pad;
            o[sc] = pad;
            o[2 * sc] = pad;
            continue;
        }
        const int y0 = (int)ty[0], y1 = (int)ty[1], x0 = (int)tx[0], x1 = (int)tx[1];
        const T* f = frame + (i64)n * H * W * 3;
        for (int c = 0; c < 3; ++c) {
            const int ch = bgr ? 2 - c : c;  // RGB out of BGR or RGB
            const float p00 = to_f32(f[((i64)y0 * W + x0) * 3 + ch]), p01 = to_f32(f[((i64)y0 * W + x1) * 3 + ch]);
            const float p10 = to_f32(f[((i64)y1 * W + x0) * 3 + ch]), p11 = to_f32(f[((i64)y1 * W + x1) * 3 + ch]);
            const float top = __fadd_rn(__fmul_rn(p00, tx[2]), __fmul_rn(p01, tx[3]));
            const float bottom = __fadd_rn(__fmul_rn(p10, tx[2]), __fmul_rn(p11, tx[3]));
            float v = rintf(__fadd_rn(__fmul_rn(top, ty[2]), __fmul_rn(bottom, ty[3])));
            v = fminf(fmaxf(v, 0.f), 255.f);
            o[c * sc] = from_f32<T>(__fdiv_rn(v, 255.f));
        }
    }
}

#define LETTERBOX(T, S)                                                                                                                 \
    extern "C" __global__ void letterbox_##S(const T* frame, const float* rows, const float* cols, int N, int H, int W, int IH, int IW, \
                                             i64 sc, i64 sy, i64 sx, int bgr, T* out) {                                                 \
        letterbox<T>(frame, rows, cols, N, H, W, IH, IW, sc, sy, sx, bgr, out);                                                         \
    }

LETTERBOX(float, f32)
LETTERBOX(f16, f16)
