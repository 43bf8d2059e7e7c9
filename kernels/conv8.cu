// 8-bit convolution (src/engine/conv8.rs): an implicit GEMM over NHWC activations and [K][R][S][C]
// weights, both int8 or both fp8 e4m3, on mma.sync tensor cores (m16n8k32: s8 → s32 on sm_80+,
// e4m3 → f32 on sm_89+), with the whole epilogue fused:
//
//     v = acc · alpha[k] + bias[k] (+ residual) ; ReLU ; then either f16, or requantised to 8 bits
//
// alpha[k] = s_x · s_w[k] dequantises the product (per-output-channel weight scales), and a
// requantised output is q = clamp(rint(v · (1/s_y)), qmin, qmax) for int8 and
// e4m3(sat(v · (1/s_y))) for fp8: the arithmetic of kernels/quant.cu's quantisers, so the next
// layer reads what the CPU's fake-quant simulation computes. The residual is f16, or 8-bit with
// its own scale.
//
// GEMM view: M = N·P·Q output pixels (rows, NHWC order), N = K output channels, K = R·S·C
// (channel fastest, so a 16-byte chunk of the reduction is 16 channels of one filter tap: C must be
// a multiple of 16; K too, for the epilogue's 16-channel vectors). A block computes BM × BN
// outputs (BM 128 or 64: small batches need more blocks) with warps of BM/2 × 32; each stage holds 64
// bytes of the reduction for A (im2col rows gathered on the fly with cp.async, zero-filled outside
// the image) and B, in a 3-stage cp.async pipeline. Shared-memory rows are 64 bytes, their four
// 16-byte chunks XOR-swizzled by (row / 2) % 4 so that ldmatrix's eight rows hit distinct banks.
//
// The arguments (`Conv8Args`, the `C8_*` storage codes) and the epilogue's end (`finish16`) are
// kernels/conv8_epilogue.cuh's, shared with the Hopper wgmma kernel (kernels/conv8_hopper.cu).

#define C8_BK 64
#define C8_STAGES 3

// Byte offset of (row, 16-byte chunk) in a stage's 64-byte-row tile.
__device__ __forceinline__ unsigned swz(int row, int chunk) { return row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4); }

template <bool FP8, int BM, int BN>
__device__ __forceinline__ void conv8(const Conv8Args& a) {
    constexpr int THREADS = 128 * (BN / 64), MT = BM / 32;  // MT: m16 tiles per warp (2 warps along M)
    constexpr int TPR = THREADS / BM;  // threads per A row
    constexpr int CPT = 4 / TPR;          // A chunks per thread
    constexpr int A_BYTES = BM * C8_BK, B_BYTES = BN * C8_BK, STAGE = A_BYTES + B_BYTES;
    typedef typename Acc<FP8>::T AccT;
    extern __shared__ __align__(128) unsigned char smem[];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warp_m = warp & 1, warp_n = warp >> 1;
    const int m_total = a.n * a.p * a.q;
    const int kg = a.r * a.s * a.c;
    // A 1-D grid, output-channel tiles fastest: the blocks sharing an activation tile run together,
    // so it is read from DRAM once and from L2 by the others.
    // With split-K, the splits of a tile are adjacent blocks; each reduces its share of k-blocks.
    const int n_tiles = (a.k + BN - 1) / BN, split = blockIdx.x % a.splits, tile = blockIdx.x / a.splits;
    const int block_m = (tile / n_tiles) * BM, block_n = (tile % n_tiles) * BN;
    const int kblocks_all = (kg + C8_BK - 1) / C8_BK, per_split = (kblocks_all + a.splits - 1) / a.splits;
    const int kb0 = min(split * per_split, kblocks_all), kblocks = min(kblocks_all - kb0, per_split);
    const unsigned base = smem_u32(smem);

    // This thread's A row (an output pixel) and its chunks' filter position (c, s, r), advanced
    // by 64 bytes of the reduction per stage.
    const int a_row = tid / TPR, a_chunk0 = (tid % TPR) * CPT;
    const int m = block_m + a_row;
    const bool m_ok = m < m_total;
    int ih0 = 0, iw0 = 0;
    const unsigned char* xb = a.x;
    if (m_ok) {
        int img = m / (a.p * a.q), pq = m - img * a.p * a.q, pp = pq / a.q, qq = pq - pp * a.q;
        ih0 = pp * a.stride_h - a.pad_h;
        iw0 = qq * a.stride_w - a.pad_w;
        xb = a.x + (long long)img * a.h * a.w_ * a.c;
    }
    int pc[CPT], ps[CPT], pr[CPT];
#pragma unroll
    for (int j = 0; j < CPT; j++) {
        int kk = kb0 * C8_BK + (a_chunk0 + j) * 16;
        pc[j] = kk % a.c;
        int rs = kk / a.c;
        ps[j] = rs % a.s;
        pr[j] = rs / a.s;
    }

    auto load_stage = [&](int stage, int kb) {
        const unsigned sa = base + stage * STAGE, sb = sa + A_BYTES;
#pragma unroll
        for (int j = 0; j < CPT; j++) {
            int kk = (kb0 + kb) * C8_BK + (a_chunk0 + j) * 16;
            int ih = ih0 + pr[j] * a.dil_h, iw = iw0 + ps[j] * a.dil_w;
            bool ok = m_ok && kk < kg && ih >= 0 && ih < a.h && iw >= 0 && iw < a.w_;
            const unsigned char* src = ok ? xb + ((long long)(ih * a.w_ + iw) * a.c + pc[j]) : a.x;
            cp_async16_ca(sa + swz(a_row, a_chunk0 + j), src, ok);
            // Advance this chunk by one stage (64 channels' worth of the reduction).
            pc[j] += C8_BK;
            while (pc[j] >= a.c) {
                pc[j] -= a.c;
                if (++ps[j] == a.s) {
                    ps[j] = 0;
                    ++pr[j];
                }
            }
        }
#pragma unroll
        for (int j = 0; j < BN * 4 / THREADS; j++) {
            int idx = tid + j * THREADS, row = idx >> 2, chunk = idx & 3;
            int kk = (kb0 + kb) * C8_BK + chunk * 16, nn = block_n + row;
            bool ok = nn < a.k && kk < kg;
            const unsigned char* src = ok ? a.w + (long long)nn * kg + kk : a.w;
            cp_async16(sb + swz(row, chunk), src, ok);
        }
    };

    // An 8-bit residual is loaded before the main loop, so that its latency overlaps the
    // reduction's (a residual 1×1 conv has one or two k-blocks: without this, the block waits
    // for its input, then again for its residual).
    constexpr int CHUNKS = BN / 16, ITEMS = BM * CHUNKS / THREADS;
    uint4 zpre[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; i++) {
        int item = tid + i * THREADS, row = block_m + item / CHUNKS, col = block_n + (item % CHUNKS) * 16;
        zpre[i] = make_uint4(0, 0, 0, 0);
        if (a.splits == 1 && a.z_store == C8_Q8 && row < m_total && col < a.k)
            zpre[i] = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(a.z) + (long long)row * a.k + col);
    }

    AccT acc[MT][4][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int t = 0; t < 4; t++) acc[i][j][t] = 0;

#pragma unroll
    for (int st = 0; st < C8_STAGES - 1; st++) {
        if (st < kblocks) load_stage(st, st);
        cp_async_commit();
    }
    for (int kb = 0; kb < kblocks; kb++) {
        cp_async_wait<C8_STAGES - 2>();
        __syncthreads();
        // Refill the stage read C8_STAGES - 1 iterations ago (every warp is past it).
        int next = kb + C8_STAGES - 1;
        if (next < kblocks) load_stage(next % C8_STAGES, next);
        cp_async_commit();

        const unsigned sa = base + (kb % C8_STAGES) * STAGE, sb = sa + A_BYTES;
#pragma unroll
        for (int ks = 0; ks < 2; ks++) {
            unsigned af[MT][4], bf[4][2];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                int row = warp_m * (BM / 2) + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                ldmatrix_x4(af[mt], sa + swz(row, 2 * ks + (lane >> 4)));
            }
#pragma unroll
            for (int np = 0; np < 2; np++) {
                int row = warp_n * 32 + np * 16 + (lane & 7) + (lane >> 4) * 8;
                unsigned r[4];
                ldmatrix_x4(r, sb + swz(row, 2 * ks + ((lane >> 3) & 1)));
                bf[2 * np][0] = r[0];
                bf[2 * np][1] = r[1];
                bf[2 * np + 1][0] = r[2];
                bf[2 * np + 1][1] = r[3];
            }
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < 4; nt++) mma_8bit(acc[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
        }
    }
    cp_async_wait<0>();
    const int g = lane >> 2, t4 = lane & 3;
    if (a.splits > 1) {
        // This split's partial sums, as they are: conv8_finish adds the splits and runs the epilogue.
        float* ws = a.ws + (long long)split * m_total * a.k;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            int col = block_n + warp_n * 32 + nt * 8 + t4 * 2;
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    int row = block_m + warp_m * (BM / 2) + mt * 16 + g + half * 8;
                    if (row < m_total && col < a.k)
                        *reinterpret_cast<float2*>(ws + (long long)row * a.k + col) =
                            make_float2((float)acc[mt][nt][2 * half], (float)acc[mt][nt][2 * half + 1]);
                }
        }
        return;
    }

    // Epilogue, in two passes through shared memory (the pipeline's buffers, now idle):
    // 1. each thread stores its accumulators, scaled and biased, as f32 at their (row, channel);
    // 2. each thread takes 16 consecutive channels of one row: adds the residual (read above
    //    with 16-byte loads), applies ReLU and writes 16 bytes of codes (32 of f16), so that rows are
    //    read and written in whole sectors. K is a multiple of 16.
    __syncthreads();
    constexpr int LD = BN + 4;  // f32 row stride of the staging tile (padded against bank conflicts)
    float* stage_tile = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int nt = 0; nt < 4; nt++) {
        int lc = warp_n * 32 + nt * 8 + t4 * 2, col = block_n + lc;
        bool ok = col < a.k;
        float al0 = ok ? a.alpha[col] : 0.f, al1 = ok ? a.alpha[col + 1] : 0.f;
        float b0 = ok && a.bias ? a.bias[col] : 0.f, b1 = ok && a.bias ? a.bias[col + 1] : 0.f;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int half = 0; half < 2; half++) {
                int lr = warp_m * (BM / 2) + mt * 16 + g + half * 8;
                float2 v = make_float2((float)acc[mt][nt][2 * half] * al0 + b0, (float)acc[mt][nt][2 * half + 1] * al1 + b1);
                *reinterpret_cast<float2*>(stage_tile + lr * LD + lc) = v;
            }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < ITEMS; i++) {
        int item = tid + i * THREADS, lr = item / CHUNKS, lc = (item % CHUNKS) * 16;
        int row = block_m + lr, col = block_n + lc;
        if (row >= m_total || col >= a.k) continue;
        float v[16];
#pragma unroll
        for (int i = 0; i < 16; i += 4) *reinterpret_cast<float4*>(v + i) = *reinterpret_cast<const float4*>(stage_tile + lr * LD + lc + i);
        finish16<FP8>(a, v, (long long)row * a.k + col, zpre[i]);
    }
}

// Split-K's second step: one thread per 16 channels of an output row adds the splits' partial sums,
// scales and biases them, and finishes as the one-step epilogue does.
template <bool FP8> __device__ __forceinline__ void conv8_finish(const Conv8Args& a) {
    const int m_total = a.n * a.p * a.q, chunks = a.k / 16;
    GRID_STRIDE(i, (i64)m_total * chunks) {
        int row = (int)(i / chunks), col = (int)(i % chunks) * 16;
        long long o = (long long)row * a.k + col;
        float v[16] = {};
        for (int sp = 0; sp < a.splits; sp++) {
            const float* w = a.ws + (long long)sp * m_total * a.k + o;
#pragma unroll
            for (int j = 0; j < 16; j += 4) {
                float4 t = *reinterpret_cast<const float4*>(w + j);
                v[j] += t.x;
                v[j + 1] += t.y;
                v[j + 2] += t.z;
                v[j + 3] += t.w;
            }
        }
#pragma unroll
        for (int j = 0; j < 16; j++) v[j] = v[j] * a.alpha[col + j] + (a.bias ? a.bias[col + j] : 0.f);
        uint4 zq = make_uint4(0, 0, 0, 0);
        if (a.z_store == C8_Q8) zq = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(a.z) + o);
        finish16<FP8>(a, v, o, zq);
    }
}

#define CONV8(NAME, FP8, BM, BN)                                                                                                     \
    extern "C" __global__ void __launch_bounds__(128 * (BN / 64)) NAME(CONV8_PARAMS) {                                               \
        CONV8_ARGS;                                                                                                                   \
        conv8<FP8, BM, BN>(a);                                                                                                        \
    }

CONV8(conv8_i8_m128n64, false, 128, 64)
CONV8(conv8_i8_m128n128, false, 128, 128)
CONV8(conv8_i8_m64n64, false, 64, 64)
CONV8(conv8_e4m3_m128n64, true, 128, 64)
CONV8(conv8_e4m3_m128n128, true, 128, 128)
CONV8(conv8_e4m3_m64n64, true, 64, 64)

#define CONV8_FINISH(NAME, FP8)                                                                                                      \
    extern "C" __global__ void NAME(CONV8_PARAMS) {                                                                                   \
        CONV8_ARGS;                                                                                                                   \
        conv8_finish<FP8>(a);                                                                                                         \
    }

CONV8_FINISH(conv8_finish_i8, false)
CONV8_FINISH(conv8_finish_e4m3, true)

// ---- Pointwise (1×1, stride 1) convs: persistent and pipelined across tiles --------------------
//
// A 1×1 conv with a short reduction (C <= 256: ResNet's bottleneck expansions) is a GEMM that
// moves far more bytes than it multiplies: ResNet-50's layer1 conv3 reads 64 codes and a 256-code
// residual per pixel and writes 256. conv8 above handles one tile per block and waits for its
// input, then computes, then writes, so few bytes are in flight. Here a block keeps its 128 output
// channels' weights (128 × C codes) in shared memory and walks 128-pixel tiles (block b takes
// tiles b, b + gridDim.x, ...; gridDim.x is a multiple of the channel tiles, so a block's channel
// tile never changes) through a cp.async pipeline of 2 or 3 stages: while it computes tile i, the
// input rows and residual codes of the next one or two are on their way (3 stages at C = 128 leave
// room for one block per SM, 2 for two). The epilogue reads the
// residual from shared memory, writes the requantised codes in its place, and the block then
// stores the tile in 16-byte vectors.
//
// Warps: 4 along M (32 rows each) × 2 along N (64 channels each), m16n8k32 MMAs. Shared-memory
// rows are padded by 16 bytes so that ldmatrix's 8 rows and the epilogue's 8 rows fall in distinct
// banks. C is 32, 64, 128 or 256, K a multiple of 16; the output is 8-bit codes.
#define PW_BM 128
#define PW_BN 128
#define PW_THREADS 256

__device__ __forceinline__ void decode2(unsigned short q, float scale, float* v, bool fp8) {
    if (!fp8) {
        const unsigned f = (unsigned)q ^ 0x8080u;
        v[0] += int8_code_value<0>(f) * scale;
        v[1] += int8_code_value<1>(f) * scale;
        return;
    }
#if __CUDA_ARCH__ >= 890
    unsigned f2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(f2) : "h"(q));
    f16 lo, hi;
    lo.bits = f2 & 0xffff;
    hi.bits = f2 >> 16;
    v[0] += to_f32(lo) * scale;
    v[1] += to_f32(hi) * scale;
#else
    __trap();
#endif
}

template <bool FP8, int PW_STAGES> __device__ __forceinline__ void conv8_pw(const Conv8Args& a) {
    typedef typename Acc<FP8>::T AccT;
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warp_m = warp & 3, warp_n = warp >> 2;
    const int g = lane >> 2, t4 = lane & 3;
    const int C = a.c, K = a.k, m_total = a.n * a.p * a.q;
    const int a_ld = C + 16, z_ld = PW_BN + 16;  // row strides in bytes
    const int a_bytes = PW_BM * a_ld, stage_bytes = a_bytes + PW_BM * z_ld;
    float* s_alpha = reinterpret_cast<float*>(smem);  // alpha and bias of the block's channels
    float* s_bias = s_alpha + PW_BN;
    unsigned char* sb = smem + 2 * PW_BN * 4;          // weights: PW_BN rows × a_ld
    unsigned char* stages = sb + PW_BN * a_ld;         // PW_STAGES × (A tile, Z tile)
    const int n_tiles = (K + PW_BN - 1) / PW_BN, m_tiles = (m_total + PW_BM - 1) / PW_BM;
    const int block_n = (blockIdx.x % n_tiles) * PW_BN;
    // This block's tiles: m = (blockIdx.x + i · gridDim.x) / n_tiles for i = 0, 1, ...
    const int first = blockIdx.x / n_tiles, step = gridDim.x / n_tiles;
    const int my_tiles = first < m_tiles ? (m_tiles - first + step - 1) / step : 0;
    const bool residual = a.z_store == C8_Q8;
    // int8's ReLU is its clamp's lower end: with inv_s > 0, codes of max(v, 0) are codes of v
    // clamped at max(qmin, 0).
    const float qlo = !FP8 && a.relu ? fmaxf(a.qmin, 0.f) : a.qmin;
    // Copies of 16-byte chunks: a thread always takes the same chunk column of every
    // `rows_step`-th row (C / 16 divides the 256 threads: C is 32, 64, 128 or 256), so the
    // per-tile loops need no division.
    const int chunks_c = C / 16, a_rows_step = PW_THREADS / chunks_c, a_row0 = tid / chunks_c, a_ch = tid % chunks_c;
    const int z_rows_step = PW_THREADS / (PW_BN / 16), z_row0 = tid / (PW_BN / 16), z_ch = tid % (PW_BN / 16);
    const bool z_col_ok = block_n + z_ch * 16 < K;

    for (int row = a_row0; row < PW_BN; row += a_rows_step) {
        const int nn = block_n + row;
        const bool ok = nn < K;
        cp_async16(smem_u32(sb + row * a_ld + a_ch * 16), ok ? a.w + (long long)nn * C + a_ch * 16 : a.w, ok);
    }
    auto load_tile = [&](int i) {
        unsigned char* st = stages + (i % PW_STAGES) * stage_bytes;
        const int m0 = (first + i * step) * PW_BM;
        for (int row = a_row0; row < PW_BM; row += a_rows_step) {
            const bool ok = m0 + row < m_total;
            cp_async16_ca(smem_u32(st + row * a_ld + a_ch * 16), ok ? a.x + (long long)(m0 + row) * C + a_ch * 16 : a.x, ok);
        }
        if (residual) {
            const unsigned char* z = reinterpret_cast<const unsigned char*>(a.z);
            for (int row = z_row0; row < PW_BM; row += z_rows_step) {
                const bool ok = m0 + row < m_total && z_col_ok;
                cp_async16(smem_u32(st + a_bytes + row * z_ld + z_ch * 16), ok ? z + (long long)(m0 + row) * K + block_n + z_ch * 16 : z, ok);
            }
        }
    };
#pragma unroll
    for (int i = 0; i < PW_STAGES - 1; i++) {
        if (i < my_tiles) load_tile(i);
        cp_async_commit();
    }
    for (int j = tid; j < PW_BN; j += PW_THREADS) {
        const int col = block_n + j;
        s_alpha[j] = col < K ? a.alpha[col] : 0.f;
        s_bias[j] = col < K && a.bias ? a.bias[col] : 0.f;
    }

    for (int i = 0; i < my_tiles; i++) {
        cp_async_wait<PW_STAGES - 2>();
        __syncthreads();
        if (i + PW_STAGES - 1 < my_tiles) load_tile(i + PW_STAGES - 1);
        cp_async_commit();
        unsigned char* st = stages + (i % PW_STAGES) * stage_bytes;
        const unsigned sa = smem_u32(st), sbw = smem_u32(sb);
        AccT acc[2][8][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mt][nt][e] = 0;
        for (int kk = 0; kk < C; kk += 32) {
            unsigned af[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                const int row = warp_m * 32 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                ldmatrix_x4(af[mt], sa + row * a_ld + kk + 16 * (lane >> 4));
            }
#pragma unroll
            for (int np = 0; np < 4; np++) {
                const int row = warp_n * 64 + np * 16 + (lane & 7) + (lane >> 4) * 8;
                unsigned r[4];
                ldmatrix_x4(r, sbw + row * a_ld + kk + 16 * ((lane >> 3) & 1));
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    mma_8bit(acc[mt][2 * np], af[mt], r[0], r[1]);
                    mma_8bit(acc[mt][2 * np + 1], af[mt], r[2], r[3]);
                }
            }
        }
        // Epilogue in place: each pair of channels' residual codes become its output codes.
        unsigned char* zt = st + a_bytes + (warp_m * 32 + g) * z_ld + warp_n * 64 + t4 * 2;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            const int lc = warp_n * 64 + nt * 8 + t4 * 2;
            const float2 al = *reinterpret_cast<const float2*>(s_alpha + lc), bi = *reinterpret_cast<const float2*>(s_bias + lc);
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    unsigned short* zp = reinterpret_cast<unsigned short*>(zt + (mt * 16 + 8 * half) * z_ld + nt * 8);
                    float v[2];
                    v[0] = short_dot_value(acc[mt][nt][2 * half]) * al.x + bi.x;
                    v[1] = short_dot_value(acc[mt][nt][2 * half + 1]) * al.y + bi.y;
                    if (residual) decode2(*zp, a.z_scale, v, FP8);
                    if (FP8 && a.relu) {
                        v[0] = fmaxf(v[0], 0.f);
                        v[1] = fmaxf(v[1], 0.f);
                    }
                    *zp = (unsigned short)encode2<FP8>(v[0], v[1], a.inv_y_scale, qlo, a.qmax);
                }
        }
        __syncthreads();
        const int m0 = (first + i * step) * PW_BM;
        unsigned char* y = reinterpret_cast<unsigned char*>(a.y);
        const unsigned char* zs = st + a_bytes;
        for (int row = z_row0; row < PW_BM; row += z_rows_step)
            if (m0 + row < m_total && z_col_ok)
                *reinterpret_cast<uint4*>(y + (long long)(m0 + row) * K + block_n + z_ch * 16) =
                    *reinterpret_cast<const uint4*>(zs + row * z_ld + z_ch * 16);
    }
    cp_async_wait<0>();
}

#define CONV8_PW(NAME, FP8, STAGES)                                                                                                  \
    extern "C" __global__ void __launch_bounds__(PW_THREADS, 2) NAME(CONV8_PARAMS) {                                                 \
        CONV8_ARGS;                                                                                                                   \
        conv8_pw<FP8, STAGES>(a);                                                                                                     \
    }

CONV8_PW(conv8_i8_pw2, false, 2)
CONV8_PW(conv8_i8_pw3, false, 3)
CONV8_PW(conv8_e4m3_pw2, true, 2)
CONV8_PW(conv8_e4m3_pw3, true, 3)
