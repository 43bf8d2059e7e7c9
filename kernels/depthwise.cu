// Depthwise family: a K x K depthwise convolution (groups == channels, one filter per channel) of
// NHWC images, dilation 1, any stride and padding, with the bias, an optional residual and ReLU
// fused. A candidate beside cuDNN's (whose NHWC depthwise kernels are often slow); per-layer
// timing picks.
//
// Weights are f32 in [K*K, C] order (tap-major, channels innermost, so neighbouring threads read
// neighbouring weights); bias is f32 [C] (or null); residual has y's shape (or null).
// One thread per output pixel and VEC channels: VEC = the 16-byte pack when C allows (`vec`).

template <typename T, int K, int VEC>
__device__ __forceinline__ void depthwise_px(const T* x, const float* w, const float* bias, const T* residual, T* y, i64 i, int H,
                                             int W, int C, int OH, int OW, int sh, int sw, int ph, int pw, int relu) {
    const int CV = C / VEC;
    const int cv = (int)(i % CV);
    i64 p = i / CV;
    const int ox = (int)(p % OW);
    p /= OW;
    const int oy = (int)(p % OH);
    const i64 n = p / OH;
    const int c0 = cv * VEC;
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = bias ? bias[c0 + k] : 0.f;
    const int iy0 = oy * sh - ph, ix0 = ox * sw - pw;
    const T* img = x + n * H * W * C + c0;
#pragma unroll
    for (int r = 0; r < K; ++r) {
        const int iy = iy0 + r;
        if (iy < 0 || iy >= H) continue;
#pragma unroll
        for (int s = 0; s < K; ++s) {
            const int ix = ix0 + s;
            if (ix < 0 || ix >= W) continue;
            const T* src = img + ((i64)iy * W + ix) * C;
            const float* wt = w + (r * K + s) * C + c0;
            if (VEC > 1) {
                Pack<T> v = load_pack(src);
#pragma unroll
                for (int k = 0; k < VEC; ++k) acc[k] += wt[k] * to_f32(v.e[k]);
            } else {
                acc[0] += wt[0] * to_f32(src[0]);
            }
        }
    }
    const i64 out = (((n * OH + oy) * OW + ox) * C) + c0;
    if (VEC > 1) {
        Pack<T> o, z;
        if (residual) z = load_pack(residual + out);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            float t = acc[k] + (residual ? to_f32(z.e[k]) : 0.f);
            o.e[k] = from_f32<T>(relu && t < 0.f ? 0.f : t);
        }
        store_pack(y + out, o);
    } else {
        float t = acc[0] + (residual ? to_f32(residual[out]) : 0.f);
        y[out] = from_f32<T>(relu && t < 0.f ? 0.f : t);
    }
}

template <typename T, int K>
__device__ void depthwise(const T* x, const float* w, const float* bias, const T* residual, T* y, int N, int H, int W, int C, int OH,
                          int OW, int sh, int sw, int ph, int pw, int relu, int vec) {
    const int P = Pack<T>::N;
    if (vec && C % P == 0 && aligned16(x) && aligned16(y) && (residual == 0 || aligned16(residual))) {
        GRID_STRIDE(i, (i64)N * OH * OW * (C / P)) { depthwise_px<T, K, Pack<T>::N>(x, w, bias, residual, y, i, H, W, C, OH, OW, sh, sw, ph, pw, relu); }
        return;
    }
    GRID_STRIDE(i, (i64)N * OH * OW * C) { depthwise_px<T, K, 1>(x, w, bias, residual, y, i, H, W, C, OH, OW, sh, sw, ph, pw, relu); }
}

#define DEPTHWISE_ARGS(T)                                                                                                                \
    const T *x, const float *w, const float *bias, const T *residual, T *y, int N, int H, int W, int C, int OH, int OW, int sh, int sw, \
        int ph, int pw, int relu, int vec
#define DEPTHWISE_PASS x, w, bias, residual, y, N, H, W, C, OH, OW, sh, sw, ph, pw, relu, vec

#define DEPTHWISE(T, S)                                                                                                                 \
    extern "C" __global__ void depthwise_k3_##S(DEPTHWISE_ARGS(T)) { depthwise<T, 3>(DEPTHWISE_PASS); }                                    \
    extern "C" __global__ void depthwise_k5_##S(DEPTHWISE_ARGS(T)) { depthwise<T, 5>(DEPTHWISE_PASS); }                                    \
    extern "C" __global__ void depthwise_k7_##S(DEPTHWISE_ARGS(T)) { depthwise<T, 7>(DEPTHWISE_PASS); }

#if !defined(DW_PART) || DW_PART == 0
DEPTHWISE(float, f32)
DEPTHWISE(f16, f16)
#endif

// Register-tiled variant (a separate tactic candidate): one thread computes a TH x TW tile of
// output pixels for V channels (one 8-byte load: 4 halves or 2 floats). It walks the
// (TH - 1) * S + K input rows the tile needs once, holding one row's (TW - 1) * S + K columns in
// registers, and adds each row into every output row whose window contains it. The simple kernel
// above reloads K * K inputs and weights per output pixel (ConvNeXt's 7x7: 49 16-byte loads per
// 16 bytes written); here each input load serves up to TH * min(TW, K) taps. Accumulation is f32,
// taps in the same order as the simple kernel. Needs C % V == 0 and 8-byte aligned x, y, residual.
template <typename T> struct Pack8 {
    static const int N = 8 / sizeof(T);
    union {
        uint2 u;
        T e[8 / sizeof(T)];
    };
};

template <int V> __device__ __forceinline__ void load_w(const float* p, float* w) {
    if (V == 4) {
        const float4 q = *reinterpret_cast<const float4*>(p);
        w[0] = q.x, w[1] = q.y, w[2] = q.z, w[3] = q.w;
    } else {
        const float2 q = *reinterpret_cast<const float2*>(p);
        w[0] = q.x, w[1] = q.y;
    }
}

template <typename T, int K, int S, int TH, int TW>
__device__ void depthwise_tile(const T* x, const float* w, const float* bias, const T* residual, T* y, int N, int H, int W, int C, int OH,
                               int OW, int ph, int pw, int relu) {
    typedef Pack8<T> P;
    const int V = P::N;
    const int L = (TW - 1) * S + K;  // input columns of a tile
    const int R = (TH - 1) * S + K;  // input rows of a tile
    const int CG = C / V, NS = (OW + TW - 1) / TW, NR = (OH + TH - 1) / TH;
    const u64 any = reinterpret_cast<u64>(x) | reinterpret_cast<u64>(y) | reinterpret_cast<u64>(residual);
    if ((any & 7) != 0 || C % V != 0) {
        // Not this kernel's case (the host offers it only where it is): the simple kernel, scalar.
        depthwise<T, K>(x, w, bias, residual, y, N, H, W, C, OH, OW, S, S, ph, pw, relu, 0);
        return;
    }
    GRID_STRIDE(i, (i64)N * NR * NS * CG) {
        const int cg = (int)(i % CG);
        i64 rest = i / CG;
        const int sx = (int)(rest % NS);
        rest /= NS;
        const int ry = (int)(rest % NR);
        const i64 n = rest / NR;
        const int c0 = cg * V, ox0 = sx * TW, oy0 = ry * TH;
        float acc[TH][TW][V];
#pragma unroll
        for (int v = 0; v < V; ++v) {
            const float b = bias ? bias[c0 + v] : 0.f;
#pragma unroll
            for (int j = 0; j < TH; ++j)
#pragma unroll
                for (int t = 0; t < TW; ++t) acc[j][t][v] = b;
        }
        const T* img = x + n * H * W * C + c0;
        const int iy0 = oy0 * S - ph, ix0 = ox0 * S - pw;
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
            const int iy = iy0 + rr;
            if (iy < 0 || iy >= H) continue;
            const T* row = img + (i64)iy * W * C;
            float in[L][V];
#pragma unroll
            for (int l = 0; l < L; ++l) {
                const int ix = ix0 + l;
                if (ix >= 0 && ix < W) {
                    P p;
                    p.u = *reinterpret_cast<const uint2*>(row + (i64)ix * C);
#pragma unroll
                    for (int v = 0; v < V; ++v) in[l][v] = to_f32(p.e[v]);
                } else {
#pragma unroll
                    for (int v = 0; v < V; ++v) in[l][v] = 0.f;
                }
            }
#pragma unroll
            for (int j = 0; j < TH; ++j) {
                const int r = rr - j * S;  // this input row's filter row for output row j
                if (r < 0 || r >= K) continue;
#pragma unroll
                for (int s = 0; s < K; ++s) {
                    float wv[V];
                    load_w<V>(w + (r * K + s) * C + c0, wv);
#pragma unroll
                    for (int t = 0; t < TW; ++t)
#pragma unroll
                        for (int v = 0; v < V; ++v) acc[j][t][v] += wv[v] * in[t * S + s][v];
                }
            }
        }
#pragma unroll
        for (int j = 0; j < TH; ++j) {
            const int oy = oy0 + j;
            if (oy >= OH) break;
#pragma unroll
            for (int t = 0; t < TW; ++t) {
                const int ox = ox0 + t;
                if (ox >= OW) break;
                const i64 o = ((n * OH + oy) * OW + ox) * C + c0;
                P z, out;
                if (residual) z.u = *reinterpret_cast<const uint2*>(residual + o);
#pragma unroll
                for (int v = 0; v < V; ++v) {
                    const float tv = acc[j][t][v] + (residual ? to_f32(z.e[v]) : 0.f);
                    out.e[v] = from_f32<T>(relu && tv < 0.f ? 0.f : tv);
                }
                *reinterpret_cast<uint2*>(y + o) = out.u;
            }
        }
    }
}

#define DW_TILE_ARGS(T)                                                                                                              \
    const T *x, const float *w, const float *bias, const T *residual, T *y, int N, int H, int W, int C, int OH, int OW, int ph, int pw, \
        int relu
#define DW_TILE_PASS x, w, bias, residual, y, N, H, W, C, OH, OW, ph, pw, relu
// dw_tile_k{K}_s{S}_h{TH}_{type}: 8 output columns a tile at stride 1, 4 at stride 2.
// One macro a kernel size, each entry point's name spelled out (so that it can be found).
#define DW_TILE_K3(T, S)                                                                                              \
    extern "C" __global__ void dw_tile_k3_s1_h1_##S(DW_TILE_ARGS(T)) { depthwise_tile<T, 3, 1, 1, 8>(DW_TILE_PASS); } \
    extern "C" __global__ void dw_tile_k3_s1_h2_##S(DW_TILE_ARGS(T)) { depthwise_tile<T, 3, 1, 2, 8>(DW_TILE_PASS); } \
    extern "C" __global__ void dw_tile_k3_s2_h1_##S(DW_TILE_ARGS(T)) { depthwise_tile<T, 3, 2, 1, 4>(DW_TILE_PASS); } \
    extern "C" __global__ void dw_tile_k3_s2_h2_##S(DW_TILE_ARGS(T)) { depthwise_tile<T, 3, 2, 2, 4>(DW_TILE_PASS); }

#define DW_TILE_K5(T, S)                                                                                              \
    extern "C" __global__ void dw_tile_k5_s1_h1_##S(DW_TILE_ARGS(T)) { depthwise_tile<T, 5, 1, 1, 8>(DW_TILE_PASS); } \
    extern "C" __global__ void dw_tile_k5_s1_h2_##S(DW_TILE_ARGS(T)) { depthwise_tile<T, 5, 1, 2, 8>(DW_TILE_PASS); } \
    extern "C" __global__ void dw_tile_k5_s2_h1_##S(DW_TILE_ARGS(T)) { depthwise_tile<T, 5, 2, 1, 4>(DW_TILE_PASS); } \
    extern "C" __global__ void dw_tile_k5_s2_h2_##S(DW_TILE_ARGS(T)) { depthwise_tile<T, 5, 2, 2, 4>(DW_TILE_PASS); }

#define DW_TILE_K7(T, S)                                                                                              \
    extern "C" __global__ void dw_tile_k7_s1_h1_##S(DW_TILE_ARGS(T)) { depthwise_tile<T, 7, 1, 1, 8>(DW_TILE_PASS); } \
    extern "C" __global__ void dw_tile_k7_s1_h2_##S(DW_TILE_ARGS(T)) { depthwise_tile<T, 7, 1, 2, 8>(DW_TILE_PASS); } \
    extern "C" __global__ void dw_tile_k7_s2_h1_##S(DW_TILE_ARGS(T)) { depthwise_tile<T, 7, 2, 1, 4>(DW_TILE_PASS); } \
    extern "C" __global__ void dw_tile_k7_s2_h2_##S(DW_TILE_ARGS(T)) { depthwise_tile<T, 7, 2, 2, 4>(DW_TILE_PASS); }

// The register-tiled kernels are most of this family's NVRTC time (about 30 s on one core for
// all of them), so src/engine/kernels.rs compiles the family as DW_PARTS programs side by side,
// each with its DW_PART: part 0 the simple and shared-memory kernels, parts 1 to 6 the tiles of
// one type and kernel size. Without DW_PART the file is every kernel at once.
#if !defined(DW_PART) || DW_PART == 1
DW_TILE_K3(float, f32)
#endif
#if !defined(DW_PART) || DW_PART == 2
DW_TILE_K5(float, f32)
#endif
#if !defined(DW_PART) || DW_PART == 3
DW_TILE_K7(float, f32)
#endif
#if !defined(DW_PART) || DW_PART == 4
DW_TILE_K3(f16, f16)
#endif
#if !defined(DW_PART) || DW_PART == 5
DW_TILE_K5(f16, f16)
#endif
#if !defined(DW_PART) || DW_PART == 6
DW_TILE_K7(f16, f16)
#endif

// dw_smem_k{K}_{type}: stride 1, C a multiple of 32. A block of 256 threads takes an 8 x 16 tile of
// output pixels and 32 channels: it stages the tile's (8 + K - 1) x (16 + K - 1) input pixels in
// shared memory as f32 (zeros outside the image), then each warp computes one output row of the
// tile, a lane a channel, with the channel's K*K weights in registers and 16 accumulators. Every
// input value is read from global memory once a tile instead of once a tap. Same f32 sums in the
// same tap order as the simple kernel. Blocks stride over the tiles (the grid is capped).
#define DWS_TH 8
#define DWS_TW 16
#define DWS_CB 32
template <typename T, int K>
__device__ __forceinline__ void depthwise_smem(const T* x, const float* w, const float* bias, const T* residual, T* y, int N, int H, int W,
                                               int C, int OH, int OW, int ph, int pw, int relu) {
    constexpr int IH = DWS_TH + K - 1, IW = DWS_TW + K - 1;
    __shared__ float tile[IH * IW * DWS_CB];
    const int lane = threadIdx.x & 31, row = threadIdx.x >> 5;
    const int tiles_x = (OW + DWS_TW - 1) / DWS_TW, tiles_y = (OH + DWS_TH - 1) / DWS_TH, cblocks = C / DWS_CB;
    const i64 total = (i64)N * tiles_y * tiles_x * cblocks;
    for (i64 b = blockIdx.x; b < total; b += gridDim.x) {
        const int cb = (int)(b % cblocks);
        i64 rest = b / cblocks;
        const int tx = (int)(rest % tiles_x);
        rest /= tiles_x;
        const int ty = (int)(rest % tiles_y);
        const i64 n = rest / tiles_y;
        const int c0 = cb * DWS_CB, ox0 = tx * DWS_TW, oy0 = ty * DWS_TH;
        const int iy0 = oy0 - ph, ix0 = ox0 - pw;
        const T* img = x + n * H * W * C + c0;
        __syncthreads();  // the previous tile's readers are done with `tile`
        for (int e = threadIdx.x; e < IH * IW * DWS_CB; e += blockDim.x) {
            const int c = e % DWS_CB, p = e / DWS_CB;
            const int iy = iy0 + p / IW, ix = ix0 + p % IW;
            tile[e] = (iy >= 0 && iy < H && ix >= 0 && ix < W) ? to_f32(img[((i64)iy * W + ix) * C + c]) : 0.f;
        }
        __syncthreads();
        const int c = c0 + lane;
        float wr[K * K];
#pragma unroll
        for (int t = 0; t < K * K; ++t) wr[t] = w[t * C + c];
        float acc[DWS_TW];
        const float b0 = bias ? bias[c] : 0.f;
#pragma unroll
        for (int t = 0; t < DWS_TW; ++t) acc[t] = b0;
#pragma unroll
        for (int r = 0; r < K; ++r) {
            const float* src = tile + (row + r) * IW * DWS_CB + lane;
            float in[IW];
#pragma unroll
            for (int l = 0; l < IW; ++l) in[l] = src[l * DWS_CB];
#pragma unroll
            for (int s = 0; s < K; ++s)
#pragma unroll
                for (int t = 0; t < DWS_TW; ++t) acc[t] += wr[r * K + s] * in[t + s];
        }
        const int oy = oy0 + row;
        if (oy < OH) {
#pragma unroll
            for (int t = 0; t < DWS_TW; ++t) {
                const int ox = ox0 + t;
                if (ox < OW) {
                    const i64 o = ((n * OH + oy) * OW + ox) * C + c;
                    const float v = acc[t] + (residual ? to_f32(residual[o]) : 0.f);
                    y[o] = from_f32<T>(relu && v < 0.f ? 0.f : v);
                }
            }
        }
    }
}

#define DW_SMEM(T, S)                                                                                                  \
    extern "C" __global__ void dw_smem_k3_##S(DW_TILE_ARGS(T)) { depthwise_smem<T, 3>(DW_TILE_PASS); } \
    extern "C" __global__ void dw_smem_k5_##S(DW_TILE_ARGS(T)) { depthwise_smem<T, 5>(DW_TILE_PASS); } \
    extern "C" __global__ void dw_smem_k7_##S(DW_TILE_ARGS(T)) { depthwise_smem<T, 7>(DW_TILE_PASS); }

#if !defined(DW_PART) || DW_PART == 0
DW_SMEM(float, f32)
DW_SMEM(f16, f16)
#endif
