// torchvision's classification preset on decoded frames: interleaved byte values [N, H, W * 3],
// R, G, B (bgr = 0) or B, G, R (bgr = 1), resized (PIL's antialiased BILINEAR), centre-cropped
// and normalised to the model input [N, 3, CH, CW] ((x / 255 - mean) / std per RGB plane), in the
// output value's layout (strides sc, sy, sx per image).
// Per crop row and per crop column the tables hold `first, count, weights...` (row lengths rs and
// cs; first < 0 where the crop pads with zeros): PIL's 22-bit fixed-point taps, from the CPU
// reference (models/src/classify_preset.rs). The resampling is integer (horizontal pass first,
// each pass rounded to a level, as PIL), the normalisation the CPU's f32 operations in its order,
// never contracted, so both match exactly.

__device__ __forceinline__ int pil_clip8(int sum) { return min(max((sum + (1 << 21)) >> 22, 0), 255); }

template <typename T> __device__ __forceinline__ int frame_level(T v) { return min(max(__float2int_rn(to_f32(v)), 0), 255); }

template <typename T>
__device__ void classify_preset(const T* frame, const float* rows, const float* cols, int N, int H, int W, int CH, int CW, int rs, int cs,
                                int bgr, float m0, float m1, float m2, float s0, float s1, float s2, i64 sc, i64 sy, i64 sx, T* out) {
    GRID_STRIDE(i, (i64)N * CH * CW) {
        const int x = (int)(i % CW);
        const int y = (int)((i / CW) % CH);
        const int n = (int)(i / ((i64)CH * CW));
        const float* ty = rows + (i64)y * rs;
        const float* tx = cols + (i64)x * cs;
        T* o = out + (i64)n * 3 * CH * CW + y * sy + x * sx;
        const T* f = frame + (i64)n * H * W * 3;
        const bool inside = ty[0] >= 0.f && tx[0] >= 0.f;
        const int fy = (int)ty[0], ny = (int)ty[1], fx = (int)tx[0], nx = (int)tx[1];
        for (int c = 0; c < 3; ++c) {
            int level = 0;  // torchvision pads a larger crop with zeros
            if (inside) {
                const int ch = bgr ? 2 - c : c;
                int sum = 0;
                for (int k = 0; k < ny; ++k) {
                    const T* p = f + ((i64)(fy + k) * W + fx) * 3 + ch;
                    int row = 0;
                    for (int j = 0; j < nx; ++j) row += frame_level(p[j * 3]) * (int)tx[2 + j];
                    sum += pil_clip8(row) * (int)ty[2 + k];
                }
                level = pil_clip8(sum);
            }
            const float mean = c == 0 ? m0 : (c == 1 ? m1 : m2);
            const float std = c == 0 ? s0 : (c == 1 ? s1 : s2);
            o[c * sc] = from_f32<T>(__fdiv_rn(__fsub_rn(__fdiv_rn((float)level, 255.f), mean), std));
        }
    }
}

#define CLASSIFY_PRESET(T, S)                                                                                                         \
    extern "C" __global__ void classify_preset_##S(const T* frame, const float* rows, const float* cols, int N, int H, int W, int CH, \
                                                   int CW, int rs, int cs, int bgr, float m0, float m1, float m2, float s0, float s1, \
                                                   float s2, i64 sc, i64 sy, i64 sx, T* out) {                                        \
        classify_preset<T>(frame, rows, cols, N, H, W, CH, CW, rs, cs, bgr, m0, m1, m2, s0, s1, s2, sc, sy, sx, out);                 \
    }

CLASSIFY_PRESET(float, f32)
CLASSIFY_PRESET(f16, f16)
