// Reformat family: the layout and precision changes at the engine's edges (the user's NCHW f32,
// or u8 bytes, in; NCHW f32 out) and inside it (flatten of an NHWC map, precision casts).
//
// Both directions are a batched transpose of a [C, HW] matrix through a 32x32 shared tile, so
// reads and writes are both coalesced. The NHWC side has a channel stride `cs` >= C: the input
// side may be padded (e.g. 3 -> 8 channels for a tensor-core friendly stem), and padding channels
// are written as zeros, so the padded conv sees exact zeros.

#define TILE 32
#define ROWS 8

// x: [N, C, HW] (In), y: [N, HW, cs] (Out); channels C..cs-1 of y are zeroed.
template <typename In, typename Out> __device__ void nchw_to_nhwc(const In* x, Out* y, int C, int HW, int cs) {
    __shared__ float tile[TILE][TILE + 1];
    const int n = blockIdx.z;
    const int p0 = blockIdx.x * TILE, c0 = blockIdx.y * TILE;
    const In* xn = x + (i64)n * C * HW;
    Out* yn = y + (i64)n * HW * cs;
    for (int r = threadIdx.y; r < TILE; r += ROWS) {
        const int c = c0 + r, p = p0 + threadIdx.x;
        tile[r][threadIdx.x] = (c < C && p < HW) ? to_f32(xn[(i64)c * HW + p]) : 0.f;
    }
    __syncthreads();
    for (int r = threadIdx.y; r < TILE; r += ROWS) {
        const int p = p0 + r, c = c0 + threadIdx.x;
        if (p < HW && c < cs) yn[(i64)p * cs + c] = from_f32<Out>(tile[threadIdx.x][r]);
    }
}

// x: [N, HW, cs] (In), y: [N, C, HW] (Out); padding channels of x are ignored.
template <typename In, typename Out> __device__ void nhwc_to_nchw(const In* x, Out* y, int C, int HW, int cs) {
    __shared__ float tile[TILE][TILE + 1];
    const int n = blockIdx.z;
    const int p0 = blockIdx.x * TILE, c0 = blockIdx.y * TILE;
    const In* xn = x + (i64)n * HW * cs;
    Out* yn = y + (i64)n * C * HW;
    for (int r = threadIdx.y; r < TILE; r += ROWS) {
        const int p = p0 + r, c = c0 + threadIdx.x;
        tile[r][threadIdx.x] = (p < HW && c < C) ? to_f32(xn[(i64)p * cs + c]) : 0.f;
    }
    __syncthreads();
    for (int r = threadIdx.y; r < TILE; r += ROWS) {
        const int c = c0 + r, p = p0 + threadIdx.x;
        if (c < C && p < HW) yn[(i64)c * HW + p] = from_f32<Out>(tile[threadIdx.x][r]);
    }
}

// Few channels (image inputs, CenterNet's 2-channel heads): the 32x32 tile would leave most of
// its threads idle (3 of 32 channels), so one thread per pixel instead. Consecutive threads take
// consecutive pixels, so each plane read (NCHW side) is coalesced and the NHWC side is one
// contiguous run per warp; an 8-channel f16 pixel (a padded stem input) is one 16-byte store.
// x: [N, C, HW], y: [N, HW, cs]; channels C..cs-1 of y are zeroed. cs <= SMALL_C.
#define SMALL_C 8
template <typename In, typename Out> __device__ void nchw_to_nhwc_small(const In* x, Out* y, int C, i64 HW, int cs, i64 pixels) {
    GRID_STRIDE(i, pixels) {
        const i64 n = i / HW, p = i - n * HW;
        const In* src = x + n * C * HW + p;
        Out* dst = y + i * cs;
        Out v[SMALL_C];
#pragma unroll
        for (int c = 0; c < SMALL_C; ++c) v[c] = from_f32<Out>(c < C ? to_f32(src[(i64)c * HW]) : 0.f);
        if (sizeof(Out) * cs == 16 && aligned16(dst)) {
            Pack<Out> pk;
#pragma unroll
            for (int c = 0; c < Pack<Out>::N; ++c) pk.e[c] = v[c];
            store_pack(dst, pk);
        } else {
#pragma unroll
            for (int c = 0; c < SMALL_C; ++c)
                if (c < cs) dst[c] = v[c];
        }
    }
}

// x: [N, HW, cs], y: [N, C, HW]; C <= cs <= SMALL_C. One thread per pixel, plane writes coalesced.
template <typename In, typename Out> __device__ void nhwc_to_nchw_small(const In* x, Out* y, int C, i64 HW, int cs, i64 pixels) {
    GRID_STRIDE(i, pixels) {
        const i64 n = i / HW, p = i - n * HW;
        const In* src = x + i * cs;
        Out* dst = y + n * C * HW + p;
#pragma unroll
        for (int c = 0; c < SMALL_C; ++c)
            if (c < C) dst[(i64)c * HW] = from_f32<Out>(to_f32(src[c]));
    }
}

// Same layout, other precision.
template <typename In, typename Out> __device__ void cast(const In* x, Out* y, i64 n) {
    GRID_STRIDE(i, n) { y[i] = from_f32<Out>(to_f32(x[i])); }
}

// Launch: block (32, 8), grid (ceil(HW/32), ceil(max(C, cs)/32), N); the _small ones 1-D grid-stride.
// Into the engine's layout (and the plain cast):
#define REFORMAT_IN(In, Out, S)                                                                                                         \
    extern "C" __global__ void nchw_to_nhwc_##S(const In* x, Out* y, int C, int HW, int cs) { nchw_to_nhwc<In, Out>(x, y, C, HW, cs); } \
    extern "C" __global__ void cast_##S(const In* x, Out* y, i64 n) { cast<In, Out>(x, y, n); }                                      \
    extern "C" __global__ void nchw_to_nhwc_small_##S(const In* x, Out* y, int C, i64 HW, int cs, i64 pixels) {                         \
        nchw_to_nhwc_small<In, Out>(x, y, C, HW, cs, pixels);                                                                        \
    }
// Out of it:
#define REFORMAT_OUT(In, Out, S)                                                                                                        \
    extern "C" __global__ void nhwc_to_nchw_##S(const In* x, Out* y, int C, int HW, int cs) { nhwc_to_nchw<In, Out>(x, y, C, HW, cs); } \
    extern "C" __global__ void nhwc_to_nchw_small_##S(const In* x, Out* y, int C, i64 HW, int cs, i64 pixels) {                         \
        nhwc_to_nchw_small<In, Out>(x, y, C, HW, cs, pixels);                                                                        \
    }
#define REFORMAT(In, Out, S) REFORMAT_IN(In, Out, S) REFORMAT_OUT(In, Out, S)

REFORMAT(float, float, f32_f32)
REFORMAT(float, f16, f32_f16)
REFORMAT(f16, float, f16_f32)
REFORMAT(f16, f16, f16_f16)
// An input binding declared u8 holds bytes (1/4 of the f32 upload); they only ever come in.
REFORMAT_IN(unsigned char, float, u8_f32)
REFORMAT_IN(unsigned char, f16, u8_f16)
