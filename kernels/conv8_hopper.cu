// 8-bit convolution on Hopper's asynchronous tensor cores (sm_90a): the same conv, operands and
// epilogue as kernels/conv8.cu (its header is the contract: NHWC codes in, [K][R][S][C] weight
// codes, v = acc · alpha[k] + bias[k] (+ residual) ; ReLU ; f16 or requantised codes out), but
// its operands are brought by TMA and multiplied by wgmma (s8·s8 → s32; the e4m3 form is not compiled: see the end) in a
// warp-specialised pipeline. One more tactic of the conv8 family (src/ops/conv/conv8/hopper.rs),
// timed against the mma.sync tiles and cuDNN; nothing forces it.
//
// GEMM view and tiles. A block computes 128 output pixels × BN output channels (BN 64, 128 or
// 256); the reduction runs over filter taps (r, s), then channel blocks of BK codes (64 or 128
// bytes: one swizzled shared-memory row). Its 128 pixels are
// - in GEMM mode (a 1×1 stride-1 conv without padding, `patch_w` 0): rows m0 .. m0 + 127 of the
//   activation seen as the row-major matrix [N·H·W, C], loaded by a 2-D tiled TMA box;
// - in patch mode (every other conv): a patch of patch_h × patch_w output pixels (patch_w ·
//   patch_h = 128) of one image. For tap (r, s) its input pixels are one 4-D tiled TMA box of the
//   NHWC tensor [N][H][W][C]: starting at (c0, q0·stride_w − pad_w + s·dil_w, p0·stride_h −
//   pad_h + r·dil_h, n), taking every stride-th pixel (the map's traversal strides; its box is
//   patch · stride wide). TMA fills what lies outside the image (padding, the patch's overhang
//   past P or Q) and channels past C with zeros, so no bounds are checked while loading: the
//   epilogue drops the rows past P or Q. The host picks the patch shape that wastes fewest rows.
//   Why not TMA's im2col mode: its boxes follow rows of the *input* between corner offsets, so a
//   strided conv needs per-row bookkeeping of its own; tiled boxes with traversal strides give
//   stride 1 and 2 (up to 8), dilation and padding from one address rule.
// The weight is a 3-D map [K][R·S][C]: the stage's B box is BN channels × BK codes of one tap
// (zeros past K and past C, where the A box has zeros too).
//
// Pipeline (kernels/hopper.cuh's convention). Persistent: a grid of at most BLOCKS blocks per SM
// walks the tiles (blockIdx.x, then every gridDim.x-th), so the loads of a block's next tile run
// while its consumers finish the last one. 384 threads: warpgroup 0 is the producer (it gives
// registers back with setmaxnreg; one thread issues the loads), warpgroups 1 and 2 the consumers:
// in ping-pong (BN ≤ 128) each takes every other tile of the block, all 128 pixels and BN
// channels, so that one's epilogue runs while the other's MMAs do; cooperatively (BN 256) both
// take every tile, 64 pixels each. A ring of STAGES stages, each an A box (128 rows of BK
// bytes) and a B box (BN rows of BK bytes), both 1024-byte aligned and swizzled over their row
// width, with a `full` barrier (the producer's arrival + the boxes' bytes) and an `empty` barrier
// (one arrival per consumer warp that reads the stage: 4 in ping-pong, 8 cooperatively).
// Producer and consumers count the same stages across tiles (stage g % STAGES, phase
// (g / STAGES) & 1; the block's k-th tile has stages k·k_iters ..). The producer waits `empty`,
// announces the stage's bytes on `full` and issues both boxes, tile after tile; a consumer waits
// `full`, issues its wgmmas over the stage, commits them, waits until only this stage's group is
// in flight and frees the previous stage; after a tile's last stage it waits for every group and
// frees that stage too, then runs the epilogue in staging rows of its own (after the ring), 64
// rows at a time, while the producer fills the freed stages with later tiles' boxes.
//
// Epilogue, codes out (an 8-bit residual or none): TMA moves whole tiles of codes, so no consumer
// waits on a global load or stores to global memory, and the arithmetic needs no conversion
// unit (`c8h_finish_codes`). The block's k-th tile has code tile k % 4
// (four lie where the f32 staging rows would). A second producer thread, the tile mover, brings
// the residual's codes into it on `zfull` (without a residual it only arrives there), up to four
// tiles ahead of the consumers. They wait `zfull`, and each thread runs conv8's arithmetic (acc ·
// alpha + bias, + the residual's code · its scale, ReLU, requantised) on its own accumulator
// pairs in place, reading two codes of the tile and writing its two over them; after an
// async-proxy fence each warp arrives on `written`. The mover then stores the tile with TMA, and
// once the store has read it fills the code tile for tile k + 4. The tiles' rows are swizzled
// over 64 bytes, boxes 64 channels wide, so the pairs a warp touches fall in distinct banks
// (`c8h_code_offset`).
// Epilogue, f16 out or an f16 residual: conv8's, in the same two passes: accumulators · alpha +
// bias → f32 staging rows; then 16 channels of one pixel per step through conv8_epilogue.cuh's
// `finish16` (residual, ReLU, f16 or codes). Both forms compute the mma.sync kernel's numbers
// (int8 bit for bit: the s32 sums are exact in both, the epilogue's operations the same). A thread's items (their offsets and 8-bit residuals) are loaded before the
// first pass, under the tile's last MMAs. Each consumer stages and finishes its own 64 rows at a
// time, so only its own 128 threads meet at a barrier (before and after the second pass). No split-K: deep reductions of
// small batches stay with conv8's split-K.

#define C8H_BM 128
#define C8H_THREADS 384

// One k32 step of a consumer's 64 × BN tile.
template <bool FP8, int BN>
__device__ __forceinline__ void c8h_mma(typename Acc<FP8>::T* acc, u64 da, u64 db, int accumulate) {
    if constexpr (!FP8) {
        if constexpr (BN == 64) wgmma_m64n64k32_s8(acc, da, db, accumulate);
        else if constexpr (BN == 128) wgmma_m64n128k32_s8(acc, da, db, accumulate);
        else wgmma_m64n256k32_s8(acc, da, db, accumulate);
    } else {
        if constexpr (BN == 64) wgmma_m64n64k32_e4m3(acc, da, db, accumulate);
        else if constexpr (BN == 128) wgmma_m64n128k32_e4m3(acc, da, db, accumulate);
        else wgmma_m64n256k32_e4m3(acc, da, db, accumulate);
    }
}

// Where a block's 128 pixels are: rows m0.. of the GEMM (patch_w 0), or the patch of image `img`
// whose first output pixel is (p0, q0).
struct C8hTile {
    int m0, img, p0, q0;
};

__device__ __forceinline__ C8hTile c8h_tile(const Conv8Args& a, int tile_m, int patch_w, int patch_h) {
    C8hTile t = {0, 0, 0, 0};
    if (patch_w == 0) {
        t.m0 = tile_m * C8H_BM;
        return t;
    }
    const int tiles_p = (a.p + patch_h - 1) / patch_h, tiles_q = (a.q + patch_w - 1) / patch_w;
    t.img = tile_m / (tiles_p * tiles_q);
    const int rest = tile_m - t.img * tiles_p * tiles_q;
    t.p0 = (rest / tiles_q) * patch_h;
    t.q0 = (rest % tiles_q) * patch_w;
    return t;
}

// Where channel `lc` of tile row `lr` lies in a tile of codes as TMA moves it: BN / 64 boxes of
// 128 rows × 64 bytes, each row's four 16-byte chunks swizzled by the row pair (64-byte swizzle:
// chunk ^= (lr / 2) % 4), so that a warp's accumulator pairs (8 rows × 8 bytes) meet no bank twice.
__device__ __forceinline__ int c8h_code_offset(int lr, int lc) {
    return (lc >> 6) * (C8H_BM * 64) + lr * 64 + ((((lc >> 4) & 3) ^ ((lr >> 1) & 3)) << 4) + (lc & 15);
}

// The codes-out epilogue of one consumer thread, on its accumulators in place: channels (lc, lc +
// 1) of row lr take acc · alpha + bias, the residual's two codes from the code tile (· its scale),
// ReLU, and leave their own two codes there. Its arithmetic is the mma.sync kernel's, without the
// conversion unit (16 values a clock an SM; the pointwise conv's epilogue was bound by it:
// eight_bit.cuh): codes and small accumulators cross to floats by their bits, requantised codes
// by the 1.5 · 2^23 rounding, and ReLU is the int8 clamp's lower end (rint(max(v, 0) · 1/s) is
// max(rint(v · 1/s), 0)). SHORT: a reduction of at most 256 codes, whose sums are exact through
// their bits; longer ones convert each accumulator.
template <bool FP8, int BN, int MS, bool SHORT>
__device__ __forceinline__ void c8h_finish_codes(const Conv8Args& a, const typename Acc<FP8>::T (&acc)[MS][BN / 2], unsigned char* codes, int t,
                                                 int row0, int col0, bool z_codes) {
    constexpr int PAIRS = BN / 4;  // a thread's pairs of channels per m64 row block
    // The residual's codes first, all of them: a load issued after the stores of earlier pairs
    // (which may alias it, for all the compiler knows) would wait for them, one round trip a pair.
    unsigned z[MS][PAIRS];
#pragma unroll
    for (int m = 0; m < MS; ++m)
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
            const int i = 2 * j, lr = row0 + 64 * m + wgmma_acc_row(t, i), lc = wgmma_acc_col(t, i);
            z[m][j] = z_codes ? *reinterpret_cast<const unsigned short*>(codes + c8h_code_offset(lr, lc)) : 0u;
        }
    const float lo = a.relu ? fmaxf(a.qmin, 0.f) : a.qmin;
#pragma unroll
    for (int j = 0; j < PAIRS; ++j) {
        const int i = 2 * j, lc = wgmma_acc_col(t, i), col = col0 + lc;
        const bool ok = col < a.k;  // K is a multiple of 16 and col even: col + 1 < K too
        const float2 al = ok ? __ldg(reinterpret_cast<const float2*>(a.alpha + col)) : make_float2(0.f, 0.f);
        const float2 bs = ok && a.bias ? __ldg(reinterpret_cast<const float2*>(a.bias + col)) : make_float2(0.f, 0.f);
#pragma unroll
        for (int m = 0; m < MS; ++m) {
            const int lr = row0 + 64 * m + wgmma_acc_row(t, i);
            float v0, v1;
            if constexpr (SHORT) {
                v0 = short_dot_value(acc[m][i]) * al.x + bs.x;
                v1 = short_dot_value(acc[m][i + 1]) * al.y + bs.y;
            } else {
                v0 = (float)acc[m][i] * al.x + bs.x;
                v1 = (float)acc[m][i + 1] * al.y + bs.y;
            }
            if (z_codes) {
                if constexpr (FP8) {
                    decode2<FP8>(z[m][j], a.z_scale, v0, v1);
                } else {
                    const unsigned flipped = z[m][j] ^ 0x8080u;
                    v0 += int8_code_value<0>(flipped) * a.z_scale;
                    v1 += int8_code_value<1>(flipped) * a.z_scale;
                }
            }
            if (FP8 && a.relu) {
                v0 = fmaxf(v0, 0.f);
                v1 = fmaxf(v1, 0.f);
            }
            *reinterpret_cast<unsigned short*>(codes + c8h_code_offset(lr, lc)) = (unsigned short)encode2<FP8>(v0, v1, a.inv_y_scale, lo, a.qmax);
        }
    }
}

template <bool FP8, int BN, int BK, int STAGES, int BLOCKS>
__device__ __forceinline__ void conv8_hopper(const TensorMap* map_x, const TensorMap* map_w, const TensorMap* map_y, const TensorMap* map_z,
                                             const Conv8Args& a, int patch_w, int patch_h, int tiles) {
    typedef typename Acc<FP8>::T AccT;
    constexpr int A_BYTES = C8H_BM * BK, B_BYTES = BN * BK, STAGE_BYTES = A_BYTES + B_BYTES;
    // Ping-pong (BN ≤ 128): each consumer warpgroup takes every other tile of the block, all 128
    // of its pixels (two m64 wgmmas a k-step, BN accumulators a thread), so one's epilogue runs
    // under the other's MMAs. Cooperative (BN 256, whose 64 pixels alone take 128 accumulators a
    // thread, as do two blocks an SM, whose threads have 80): both warpgroups take every tile, 64
    // pixels each.
    constexpr bool PP = BN <= 128 && BLOCKS == 1;
    constexpr int MS = PP ? 2 : 1;  // the m64 row blocks a warpgroup computes
    static_assert(STAGE_BYTES % 1024 == 0, "stages stay 1024-byte aligned");
    // Codes out (and 8-bit or no residual in): the tile's codes go through shared memory, TMA
    // brings the residual's and stores the output's. TILES code tiles lie where the f32 staging
    // rows would (128 · (BN + 8) · 4 bytes hold four of 128 · BN).
    constexpr int TILE_BYTES = C8H_BM * BN, TILES = 4;
    static_assert(TILES * TILE_BYTES <= C8H_BM * (BN + 8) * 4, "the code tiles fit the staging rows");
    const bool codes_out = a.y_store == C8_Q8 && a.z_store != C8_F16, z_codes = codes_out && a.z_store == C8_Q8;
    __shared__ __align__(8) u64 full[STAGES], empty[STAGES], order[2], zfull[TILES], written[TILES];
    extern __shared__ unsigned char c8h_dynamic[];
    // Swizzled boxes start on 1024 bytes (the host asks for 1 KiB of slack).
    unsigned char* ring = c8h_dynamic + ((1024 - (smem_u32(c8h_dynamic) & 1023)) & 1023);
    unsigned char* code_tiles = ring + STAGES * STAGE_BYTES;

    const int warpgroup = threadIdx.x / 128, t = threadIdx.x % 128;
    // Output-channel tiles fastest: the blocks sharing a pixel tile run together and read it
    // from L2.
    const int n_tiles = (a.k + BN - 1) / BN;
    const int c_blocks = (a.c + BK - 1) / BK, k_iters = a.r * a.s * c_blocks;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], PP ? 4 : 8);  // the consumer warps that read a stage
        }
        mbar_init(&order[0], 4);  // a warpgroup's four warps
        mbar_init(&order[1], 4);
        for (int b = 0; b < TILES; ++b) {
            mbar_init(&zfull[b], 1);              // the tile mover (and the residual's bytes)
            mbar_init(&written[b], PP ? 4 : 8);  // the consumer warps that write the tile
        }
        mbar_fence_init();
        tma_prefetch_map(map_x);
        tma_prefetch_map(map_w);
        if (codes_out) tma_prefetch_map(map_y);
        if (z_codes) tma_prefetch_map(map_z);
    }
    __syncthreads();

    if (warpgroup == 0) {
        setmaxnreg_dec<BLOCKS == 1 ? 40 : 24>();
        if (t == 0) {
            int g = 0;  // stages issued, over every tile of this block
            for (int tile_id = blockIdx.x; tile_id < tiles; tile_id += gridDim.x) {
                const int col0 = (tile_id % n_tiles) * BN;
                const C8hTile tile = c8h_tile(a, tile_id / n_tiles, patch_w, patch_h);
                for (int it = 0; it < k_iters; ++it, ++g) {
                    const int s = g % STAGES, tap = it / c_blocks, c0 = (it % c_blocks) * BK;
                    unsigned char* stage = ring + s * STAGE_BYTES;
                    mbar_wait(&empty[s], ((g / STAGES) & 1) ^ 1);
                    mbar_arrive_expect_tx(&full[s], STAGE_BYTES);
                    if (patch_w == 0) {
                        tma_load_2d(stage, map_x, &full[s], c0, tile.m0);
                    } else {
                        const int r = tap / a.s, fs = tap % a.s;
                        const int iw = tile.q0 * a.stride_w - a.pad_w + fs * a.dil_w, ih = tile.p0 * a.stride_h - a.pad_h + r * a.dil_h;
                        tma_load_4d(stage, map_x, &full[s], c0, iw, ih, tile.img);
                    }
                    tma_load_3d(stage + A_BYTES, map_w, &full[s], c0, tap, col0);
                }
            }
        } else if (t == 32 && codes_out) {
            // The tile mover: the block's k-th tile of codes is code tile k % TILES. It brings the
            // residual's codes there (without a residual it only arrives on `zfull`), and once
            // the consumers have written the tile's output codes over them it stores them; the
            // code tile takes tile k + TILES once that store has read it (checked a tile later,
            // so that two stores are in flight).
            const int mine = (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;  // this block's tiles
            auto fill = [&](int kb) {
                const int tile_id = blockIdx.x + kb * gridDim.x, b = kb % TILES, col0 = (tile_id % n_tiles) * BN;
                if (!z_codes) {
                    mbar_arrive(&zfull[b]);
                    return;
                }
                const C8hTile tile = c8h_tile(a, tile_id / n_tiles, patch_w, patch_h);
                mbar_arrive_expect_tx(&zfull[b], TILE_BYTES);
                for (int h = 0; h < BN / 64; ++h) {
                    unsigned char* dst = code_tiles + b * TILE_BYTES + h * (C8H_BM * 64);
                    if (patch_w == 0) tma_load_2d(dst, map_z, &zfull[b], col0 + 64 * h, tile.m0);
                    else tma_load_4d(dst, map_z, &zfull[b], col0 + 64 * h, tile.q0, tile.p0, tile.img);
                }
            };
            for (int kb = 0; kb < TILES && kb < mine; ++kb) fill(kb);
            for (int kb = 0; kb < mine; ++kb) {
                const int tile_id = blockIdx.x + kb * gridDim.x, b = kb % TILES, col0 = (tile_id % n_tiles) * BN;
                const C8hTile tile = c8h_tile(a, tile_id / n_tiles, patch_w, patch_h);
                mbar_wait(&written[b], (kb / TILES) & 1);
                for (int h = 0; h < BN / 64; ++h) {
                    const unsigned char* src = code_tiles + b * TILE_BYTES + h * (C8H_BM * 64);
                    if (patch_w == 0) tma_store_2d(map_y, src, col0 + 64 * h, tile.m0);
                    else tma_store_4d(map_y, src, col0 + 64 * h, tile.q0, tile.p0, tile.img);
                }
                tma_store_commit();
                // Two stores in flight: once the previous tile's has read its code tile, that
                // tile takes the residual of the tile TILES after it.
                if (kb >= 1 && kb - 1 + TILES < mine) {
                    tma_store_wait_read<1>();
                    fill(kb - 1 + TILES);
                }
            }
            // The last stores must be done before the block's shared memory goes.
            tma_store_wait<0>();
        }
        return;
    }

    // A block's registers are 384 · 168 (one block an SM) or 384 · 80 (two): the producer keeps
    // 40 or 24 of its share and the consumers take the rest. (ptxas allocates every thread's
    // code within the launch bound, 168 or 80.)
    setmaxnreg_inc<BLOCKS == 1 ? 232 : 104>();
    const int wg = warpgroup - 1;
    const int row0 = PP ? 0 : wg * 64;   // the warpgroup's first pixel of a tile
    const bool signals = (t & 31) == 0;  // one arrival per warp on `empty`
    // The f32 staging rows after the ring, 64 a warpgroup. Rows are BN + 8 floats apart (8
    // banks): the float2 stores of a half-warp (4 rows × 4 column pairs) fall in 16 distinct banks.
    constexpr int LD = BN + 8;
    float* staging = reinterpret_cast<float*>(ring + STAGES * STAGE_BYTES) + wg * 64 * LD;
    // Stage s is at a constant offset from stage 0: its barriers 8·s bytes on, its descriptors
    // (STAGE_BYTES·s) >> 4 on (the address field cannot carry: shared memory is under 256 KiB);
    // row block m of the A box 64·m·BK bytes on.
    const unsigned full0 = smem_u32(&full[0]), empty0 = smem_u32(&empty[0]);
    const u64 da0 = wgmma_desc_k<BK>(ring + row0 * BK), db0 = wgmma_desc_k<BK>(ring + A_BYTES);
    // Each thread's epilogue rows within a tile (the same in every tile): the divisions by the
    // patch width, done once.
    constexpr int CHUNKS = BN / 16, ITEMS = 64 * CHUNKS / 128;
    int row_p[MS][ITEMS], row_q[MS][ITEMS];
#pragma unroll
    for (int m = 0; m < MS; ++m)
#pragma unroll
        for (int j = 0; j < ITEMS; ++j) {
            const int lr = row0 + 64 * m + (t + 128 * j) / CHUNKS;
            row_p[m][j] = patch_w ? lr / patch_w : 0;
            row_q[m][j] = patch_w ? lr % patch_w : lr;
        }
    AccT acc[MS][BN / 2];
    // The block's k-th tile is blockIdx.x + k·gridDim.x, and its stages are k·k_iters ..
    // (k + 1)·k_iters − 1 of the producer's sequence. Ping-pong: this warpgroup takes k = wg,
    // wg + 2, ...; cooperative: every k.
    // In ping-pong the main loops alternate (`order`): warpgroup 0 starts its i-th once warpgroup
    // 1 has issued its (i - 1)-th, warpgroup 1 its i-th once warpgroup 0 has issued its i-th. A
    // parity wait cannot tell a stage's next use from the one after, so no warpgroup may wait on
    // a stage whose previous use is still pending: once the other's main loop is issued, every
    // earlier stage has been loaded and read (the host test `the_ring_feeds_each_warpgroup_...`
    // runs this protocol).
    constexpr int STEP = PP ? 2 : 1;
    const unsigned order_mine = smem_u32(&order[wg]), order_other = smem_u32(&order[1 - wg]);
    int mine = 0;  // this warpgroup's tiles so far
    for (int k = PP ? wg : 0, tile_id = blockIdx.x + k * gridDim.x; tile_id < tiles; k += STEP, tile_id += STEP * gridDim.x, ++mine) {
        if (PP && (wg == 1 || mine > 0)) mbar_wait(order_mine, (unsigned)(wg == 0 ? mine - 1 : mine) & 1);
        const int col0 = (tile_id % n_tiles) * BN;
        const C8hTile tile = c8h_tile(a, tile_id / n_tiles, patch_w, patch_h);
        const unsigned g0 = (unsigned)k * (unsigned)k_iters;
        int s = g0 % STAGES, prev = 0;
        unsigned phase = (g0 / STAGES) & 1;
        for (int it = 0; it < k_iters; ++it) {
            mbar_wait(full0 + 8u * s, phase);
            const u64 off = (u64)((unsigned)(s * STAGE_BYTES) >> 4);
            const u64 da = da0 + off, db = db0 + off;
#pragma unroll
            for (int m = 0; m < MS; ++m)
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) wgmma_fence_operand(acc[m][i]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 32; ++kk)
#pragma unroll
                for (int m = 0; m < MS; ++m)
                    c8h_mma<FP8, BN>(acc[m], wgmma_desc_advance(da, m * 64 * BK + kk * 32), wgmma_desc_advance(db, kk * 32),
                                     it > 0 || kk > 0);
            wgmma_commit();
#pragma unroll
            for (int m = 0; m < MS; ++m)
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) wgmma_fence_operand(acc[m][i]);
            // The previous stage's MMAs are done once at most this stage's group runs: free it.
            wgmma_wait<1>();
            if (it > 0 && signals) mbar_arrive(empty0 + 8u * prev);
            prev = s;
            if (++s == STAGES) {
                s = 0;
                phase ^= 1;
            }
        }
        // The main loop is issued: the other warpgroup's may start.
        if (PP && signals) mbar_arrive(order_other);
        if (codes_out) {
            wgmma_wait<0>();
#pragma unroll
            for (int m = 0; m < MS; ++m)
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) wgmma_fence_operand(acc[m][i]);
            if (signals) mbar_arrive(empty0 + 8u * prev);
            // The whole epilogue on the accumulators in place (`c8h_finish_codes`).
            const int b = k % TILES;
            unsigned char* codes = code_tiles + b * TILE_BYTES;
            mbar_wait(smem_u32(&zfull[b]), (unsigned)(k / TILES) & 1);
            // Reductions of at most 256 codes (|acc| <= 2^22) take no conversion unit at all.
            if (a.r * a.s * a.c <= 256) c8h_finish_codes<FP8, BN, MS, true>(a, acc, codes, t, row0, col0, z_codes);
            else c8h_finish_codes<FP8, BN, MS, false>(a, acc, codes, t, row0, col0, z_codes);
            // The tile's codes, for the mover's TMA store: visible to the async proxy, then
            // one arrival a warp.
            fence_proxy_async();
            __syncwarp();
            if (signals) mbar_arrive(smem_u32(&written[b]));
            continue;
        }
        // Each of this thread's epilogue items (16 channels of one output pixel): its element
        // offset (-1 past P, Q or K), and its 8-bit residual, loaded now so that the loads' latency
        // runs under the last MMAs and the staging pass. Loaded in the second pass, one item's
        // round trip after another's, they were the epilogue's time on a 1×1 conv with a residual
        // (K = 64: one stage of MMAs a tile, 8 items a thread).
        long long item_o[MS][ITEMS];
        uint4 item_z[MS][ITEMS];
#pragma unroll
        for (int m = 0; m < MS; ++m)
#pragma unroll
            for (int j = 0; j < ITEMS; ++j) {
                const int item = t + 128 * j;
                const int col = col0 + (item % CHUNKS) * 16;
                int row;
                if (patch_w == 0) {
                    const int lr = row0 + 64 * m + item / CHUNKS;
                    row = tile.m0 + lr < a.n * a.p * a.q ? tile.m0 + lr : -1;
                } else {
                    const int p = tile.p0 + row_p[m][j], q = tile.q0 + row_q[m][j];
                    row = p < a.p && q < a.q ? (tile.img * a.p + p) * a.q + q : -1;
                }
                item_o[m][j] = row < 0 || col >= a.k ? -1 : (long long)row * a.k + col;
                item_z[m][j] = make_uint4(0, 0, 0, 0);
                if (a.z_store == C8_Q8 && item_o[m][j] >= 0)
                    item_z[m][j] = __ldg(reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned char*>(a.z) + item_o[m][j]));
            }
        wgmma_wait<0>();
#pragma unroll
        for (int m = 0; m < MS; ++m)
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) wgmma_fence_operand(acc[m][i]);
        // The tile's last stage is read: the producer may refill it with a later tile's boxes
        // (in ping-pong, the other warpgroup's MMAs run on them while this one finishes).
        if (signals) mbar_arrive(empty0 + 8u * prev);

#pragma unroll
        for (int m = 0; m < MS; ++m) {
#pragma unroll
            for (int i = 0; i < BN / 2; i += 2) {
                const int r = wgmma_acc_row(t, i), lc = wgmma_acc_col(t, i), col = col0 + lc;
                const bool ok = col < a.k;  // K is a multiple of 16 and lc even: col + 1 < K too
                const float al0 = ok ? a.alpha[col] : 0.f, al1 = ok ? a.alpha[col + 1] : 0.f;
                const float b0 = ok && a.bias ? a.bias[col] : 0.f, b1 = ok && a.bias ? a.bias[col + 1] : 0.f;
                *reinterpret_cast<float2*>(staging + r * LD + lc) =
                    make_float2((float)acc[m][i] * al0 + b0, (float)acc[m][i + 1] * al1 + b1);
            }
            asm volatile("bar.sync %0, 128;" ::"r"(2 + wg) : "memory");  // this warpgroup's 64 rows are staged
#pragma unroll
            for (int j = 0; j < ITEMS; ++j) {
                if (item_o[m][j] < 0) continue;
                const int item = t + 128 * j;
                const int r = item / CHUNKS, lc = (item % CHUNKS) * 16;
                float v[16];
#pragma unroll
                for (int e = 0; e < 16; e += 4)
                    *reinterpret_cast<float4*>(v + e) = *reinterpret_cast<const float4*>(staging + r * LD + lc + e);
                finish16<FP8>(a, v, item_o[m][j], item_z[m][j]);
            }
            asm volatile("bar.sync %0, 128;" ::"r"(2 + wg) : "memory");  // its rows are read: the next rows may stage
        }
    }
}

// Entry points: conv8_<i8|e4m3>_wgmma_n<BN>_bk<BK>_s<STAGES>[_x<BLOCKS>]. A 1-D grid of at most
// BLOCKS blocks per SM (each walks the tiles: (pixel tiles) × ceil(K / BN) of them, `tiles`) of 384
// threads, STAGES · (128 + BN) · BK + 128 · (BN + 8) · 4 + 1024 bytes of dynamic shared memory
// (`HopperVariant::shared_bytes`). Two blocks an SM double the warps that hide the epilogue's
// latencies, at 80 registers a thread instead of 168, so cooperatively (BN 64 only: 32
// accumulators a thread). The parameters: the activation's map (2-D [N·H·W][C] in GEMM mode, 4-D
// [N][H][W][C] with traversal strides otherwise), the weight's 3-D map, the output's and the
// residual's maps (read only where codes go out: the [N·P·Q][K] matrix in GEMM mode, 4-D
// [N][P][Q][K] otherwise, boxes 64 codes wide and one tile of pixels, swizzled over 64 bytes),
// conv8's arguments (`CONV8_PARAMS`; split-K's must be 1), the patch's width and height in output
// pixels (0, 0: GEMM mode) and the tile count.
#define CONV8_HOPPER(NAME, FP8, BN, BK, STAGES, BLOCKS)                                                                              \
    extern "C" __global__ void __launch_bounds__(C8H_THREADS, BLOCKS)                                                                \
        NAME(const __grid_constant__ TensorMap map_x, const __grid_constant__ TensorMap map_w, const __grid_constant__ TensorMap map_y, \
             const __grid_constant__ TensorMap map_z, CONV8_PARAMS, int patch_w, int patch_h, int tiles) {                            \
        CONV8_ARGS;                                                                                                                   \
        conv8_hopper<FP8, BN, BK, STAGES, BLOCKS>(&map_x, &map_w, &map_y, &map_z, a, patch_w, patch_h, tiles);                       \
    }

CONV8_HOPPER(conv8_i8_wgmma_n64_bk64_s8, false, 64, 64, 8, 1)
CONV8_HOPPER(conv8_i8_wgmma_n64_bk64_s4_x2, false, 64, 64, 4, 2)
CONV8_HOPPER(conv8_i8_wgmma_n128_bk64_s8, false, 128, 64, 8, 1)
CONV8_HOPPER(conv8_i8_wgmma_n128_bk128_s4, false, 128, 128, 4, 1)
CONV8_HOPPER(conv8_i8_wgmma_n256_bk64_s3, false, 256, 64, 3, 1)
// No e4m3 entry points: the FP8 form (FP8 = true) ran on an H200 and its sums drifted from f32
// ones (rel L2 1.4e-3 after one requantised conv, 1.3-3e-2 after four, where the mma.sync kernel
// stays under 1e-3), also when each stage's sums were promoted to f32 registers; wgmma's e4m3
// accumulation keeps fewer bits inside an instruction. FP8 convs stay on kernels/conv8.cu.
