// Depth-to-space of the sub-pixel transposed convolution (src/engine/subpixel.rs). A stride-s
// ConvTranspose2d is computed as one stride-1 convolution whose output has s0*s1*C channels, one
// block of C per output phase (a, b), on an [N, TH, TW] grid; output pixel (oy, ox) = (s0*m + a,
// s1*l + b) is phase (a, b)'s channels at conv pixel (m + off0(a), l + off1(b)), with
// off(a) = (a + pm) / s + shift (pm = padding mod stride). NHWC in and out, bias and ReLU already
// applied by the convolution's epilogue: this is a gather of C-contiguous runs.
//
// One thread per 16 bytes of an output pixel's channels when C and the addresses allow (each
// warp then reads 512 contiguous bytes of one phase block and writes 512 contiguous bytes), one
// element otherwise.

template <typename T>
__device__ void subpixel_d2s(const T* conv, T* y, i64 n, int TH, int TW, int HO, int WO, int C, int s0, int s1, int pm0, int pm1, int sh0,
                             int sh1) {
    const int vec = (C % Pack<T>::N == 0 && aligned16(conv) && aligned16(y)) ? Pack<T>::N : 1;
    const int CV = C / vec;
    const i64 CC = (i64)C * s0 * s1;
    GRID_STRIDE(i, n * HO * WO * CV) {
        const int cv = (int)(i % CV);
        i64 p = i / CV;
        const int ox = (int)(p % WO);
        p /= WO;
        const int oy = (int)(p % HO);
        const i64 img = p / HO;
        const int m = oy / s0, a = oy - m * s0;
        const int l = ox / s1, b = ox - l * s1;
        const int ty = m + (a + pm0) / s0 + sh0, tx = l + (b + pm1) / s1 + sh1;
        const T* src = conv + ((img * TH + ty) * TW + tx) * CC + (i64)(a * s1 + b) * C + cv * vec;
        T* dst = y + ((img * HO + oy) * WO + ox) * (i64)C + cv * vec;
        if (vec > 1) {
            store_pack(dst, load_pack(src));
        } else {
            *dst = *src;
        }
    }
}

#define SUBPIXEL(S, T)                                                                                                                   \
    extern "C" __global__ void subpixel_d2s_##S(const T* conv, T* y, i64 n, int TH, int TW, int HO, int WO, int C, int s0, int s1,     \
                                                int pm0, int pm1, int sh0, int sh1) {                                                  \
        subpixel_d2s(conv, y, n, TH, TW, HO, WO, C, s0, s1, pm0, pm1, sh0, sh1);                                                       \
    }
SUBPIXEL(f32, float)
SUBPIXEL(f16, f16)
