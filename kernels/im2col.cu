// im2col for convolutions with few input channels (the 3-channel stem), FP16: the rows
// [row0, row0 + rows) of the column matrix of an NHWC input, one row per output pixel
// (n, oy, ox) in NHWC order, K = KH*KW*C columns in (r, s, c) order, zero-padded to KP (a
// multiple of 8) so that every row is whole 16-byte packs and cuBLASLt gets aligned rows. The
// GEMM with the [Cout, KP] weights then writes the NHWC output directly (src/engine/im2col.rs).
//
// One thread per 8 columns of a row: consecutive threads write consecutive 16-byte packs, so the
// stores (the bulk of the traffic) are coalesced; the reads hit the small input in L1/L2. The
// (dy, dx, c) of each column comes from a shared table, so the inner loop has no divisions.

#define IM2COL_MAX_K 1024

extern "C" __global__ void im2col_f16(const f16* x, f16* col, i64 row0, i64 rows, int H, int W, int C, int HO, int WO, int KH, int KW,
                                      int sh, int sw, int ph, int pw, int dh, int dw, int KP) {
    __shared__ int off_y[IM2COL_MAX_K], off_x[IM2COL_MAX_K], chan[IM2COL_MAX_K];
    const int K = KH * KW * C;
    for (int k = threadIdx.x; k < KP; k += blockDim.x) {
        if (k < K) {
            const int rs = k / C;
            off_y[k] = (rs / KW) * dh - ph;
            off_x[k] = (rs % KW) * dw - pw;
            chan[k] = k % C;
        } else {
            // Padding columns: an offset that is out of bounds for any output pixel reads zero.
            off_y[k] = -(1 << 28);
            off_x[k] = 0;
            chan[k] = 0;
        }
    }
    __syncthreads();
    const int groups = KP / 8;
    const i64 hwo = (i64)HO * WO;
    GRID_STRIDE(i, rows * groups) {
        const i64 local = i / groups;
        const int g = (int)(i - local * groups);
        const i64 row = row0 + local;
        const i64 n = row / hwo;
        const int pix = (int)(row - n * hwo);
        const int oy = pix / WO, ox = pix - oy * WO;
        const f16* xn = x + n * H * W * C;
        const int by = oy * sh, bx = ox * sw;
        Pack<f16> pk;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int k = g * 8 + j;
            const int iy = by + off_y[k], ix = bx + off_x[k];
            const bool in = (unsigned)iy < (unsigned)H && (unsigned)ix < (unsigned)W;
            pk.e[j] = in ? xn[((i64)iy * W + ix) * C + chan[k]] : from_f32<f16>(0.f);
        }
        store_pack(col + i * 8, pk);
    }
}
