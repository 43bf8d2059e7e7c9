// Warp-specialised wgmma GEMM for Hopper (sm_90a): D[M, N] = act(A[M, K] · B[N, K]ᵀ + bias + R),
// f16 in, f32 accumulation, f16 out (src/engine/hopper_gemm.rs). A is the row-major activation,
// B the weight as nn.Linear stores it (both K-major), R an optional residual of D's shape (read
// and written by the same thread, so D may overwrite R in place), bias optional f32 [N].
//
// A block computes a 128 × BN tile (BN 128 or 256) with three warpgroups:
// - warpgroup 0, the producer: one thread issues TMA loads of 64-wide K slices of A (128 rows)
//   and B (BN rows) into a ring of STAGES shared-memory stages (hopper.cuh's pipeline
//   convention), and the warpgroup gives most of its registers to the others (setmaxnreg);
// - warpgroups 1 and 2, the consumers: each multiplies its 64 rows of the A stage by the whole
//   B stage with four m64nBNk16 wgmmas per stage, keeps one stage's MMAs in flight while the
//   next is issued, frees the stage before, and finally runs the epilogue (`hg_epilogue`:
//   bias, residual, activation, f16 stores guarded at the M and N edges) through its own
//   staging rows of shared memory.
// TMA fills rows past M or N and columns past K with zeros, so any M, N and K work; K must be a
// multiple of 8 (the tensor map's row pitch must be a multiple of 16 bytes; the host checks it).

#define HG_BM 128
#define HG_BK 64

// `accumulate` 0 (a tile's first MMA) overwrites the accumulators: zeroing them with ordinary
// instructions instead makes ptxas serialize every wgmma of the pipeline (C7515).
template <int BN> __device__ __forceinline__ void hg_mma(float* acc, u64 da, u64 db, int accumulate) {
    if (BN == 128) {
        wgmma_m64n128k16_f16(acc, da, db, accumulate);
    } else {
        wgmma_m64n256k16_f16(acc, da, db, accumulate);
    }
}

// Bytes per row of a consumer's staging tile: BN halves plus 16, so that the eight rows one
// warp's accumulator stores touch start four banks apart (no conflicts).
template <int BN> struct HgStage {
    static const int PITCH = BN * 2 + 16;
    static const int BYTES = 64 * PITCH;
};

// The epilogue of one consumer warpgroup (64 rows from `row0`, BN columns from `col0`), in two
// steps so that its code stays small (an unrolled per-element epilogue with bounds checks and
// five activations came to ~380 KB of SASS and ran from a thrashing instruction cache):
// 1. accumulators + bias → f16 in the warpgroup's staging rows (unrolled, no branches but the
//    bias's edge);
// 2. a loop over 16-byte chunks of those rows, coalesced along them: + residual, activation
//    (`act`: common.cuh's ACT_* code), stores guarded at the M and N edges (8 halves at a time
//    where N is a multiple of 8, one at a time otherwise).
template <int BN>
__device__ __forceinline__ void hg_epilogue(const float* acc, unsigned char* stage, int t, int half, int row0, int col0, f16* d,
                                            const float* bias, const f16* res, int m, int n, int act) {
    const int pitch = HgStage<BN>::PITCH;
    // The staging rows may still be read by the previous tile's second step (other threads).
    asm volatile("bar.sync %0, 128;" ::"r"(1 + half) : "memory");
#pragma unroll
    for (int i = 0; i < BN / 2; i += 2) {
        int r = wgmma_acc_row(t, i), c = wgmma_acc_col(t, i);
        float b0 = 0.f, b1 = 0.f;
        if (bias) {
            int gc = col0 + c;
            b0 = gc < n ? bias[gc] : 0.f;
            b1 = gc + 1 < n ? bias[gc + 1] : 0.f;
        }
        *reinterpret_cast<unsigned*>(stage + r * pitch + c * 2) = pack_f16x2(acc[i] + b0, acc[i + 1] + b1);
    }
    asm volatile("bar.sync %0, 128;" ::"r"(1 + half) : "memory"); // this warpgroup's 128 threads
    const int rows = min(64, m - row0), cols = min(BN, n - col0);
    const bool vec = (n & 7) == 0;
    for (int idx = t; idx < 64 * (BN / 8); idx += 128) {
        int r = idx / (BN / 8), c = (idx % (BN / 8)) * 8;
        if (r >= rows || c >= cols) continue;
        const f16* staged = reinterpret_cast<const f16*>(stage + r * pitch + c * 2);
        i64 at = (i64)(row0 + r) * n + col0 + c;
        if (vec) {
            Pack<f16> v = load_pack(staged);
            Pack<f16> rv;
            if (res) rv = load_pack(res + at);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float x = to_f32(v.e[e]);
                if (res) x += to_f32(rv.e[e]);
                v.e[e] = from_f32<f16>(apply_act(x, act, 0.f));
            }
            store_pack(d + at, v);
        } else {
            for (int e = 0; e < 8 && c + e < cols; ++e) {
                float x = to_f32(staged[e]);
                if (res) x += to_f32(res[at + e]);
                d[at + e] = from_f32<f16>(apply_act(x, act, 0.f));
            }
        }
    }
}

template <int BN, int STAGES>
__device__ __forceinline__ void hopper_gemm(const TensorMap* map_a, const TensorMap* map_b, f16* d, const float* bias, const f16* res,
                                            int m, int n, int k, int act) {
    constexpr int A_BYTES = HG_BM * HG_BK * 2, B_BYTES = BN * HG_BK * 2;
    __shared__ __align__(8) u64 full[STAGES], empty[STAGES];
    extern __shared__ unsigned char hg_dynamic[];
    // 128-byte swizzled tiles must start on 1024 bytes (the host asks for 1 KiB of slack).
    unsigned char* base = hg_dynamic + ((1024 - (smem_u32(hg_dynamic) & 1023)) & 1023);
    unsigned char* smem_a = base;
    unsigned char* smem_b = base + STAGES * A_BYTES;
    unsigned char* smem_stage = smem_b + STAGES * B_BYTES; // two consumers' HgStage tiles

    const int warpgroup = threadIdx.x / 128, t = threadIdx.x % 128;
    const int tiles_n = (n + BN - 1) / BN, tiles = tiles_n * ((m + HG_BM - 1) / HG_BM);
    const int k_tiles = (k + HG_BK - 1) / HG_BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], 8); // the eight consumer warps
        }
        mbar_fence_init();
        tma_prefetch_map(map_a);
        tma_prefetch_map(map_b);
    }
    __syncthreads();

    // Tiles `blockIdx.x`, `+ gridDim.x`, ...: one per block when the grid covers them all, a
    // persistent loop when the grid is one block per SM (the producer then loads the next tile's
    // stages while the consumers run the last one's epilogue). `it` counts stages across tiles in
    // both roles alike, so ring slots and barrier phases agree.
    if (warpgroup == 0) {
        setmaxnreg_dec<40>();
        if (t == 0) {
            int it = 0;
            for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
                const int row0 = (tile / tiles_n) * HG_BM, col0 = (tile % tiles_n) * BN;
                for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                    int s = it % STAGES;
                    mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
                    mbar_arrive_expect_tx(&full[s], A_BYTES + B_BYTES);
                    tma_load_2d(smem_a + s * A_BYTES, map_a, &full[s], kt * HG_BK, row0);
                    tma_load_2d(smem_b + s * B_BYTES, map_b, &full[s], kt * HG_BK, col0);
                }
            }
        }
    } else {
        setmaxnreg_inc<232>();
        const int half = warpgroup - 1; // rows 64·half .. 64·half + 63 of each tile
        const bool signals = (t & 31) == 0; // one arrival per warp on `empty`
        float acc[BN / 2];
        int it = 0;
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            const int row0 = (tile / tiles_n) * HG_BM, col0 = (tile % tiles_n) * BN;
            for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                int s = it % STAGES;
                mbar_wait(&full[s], (it / STAGES) & 1);
                u64 da = wgmma_desc_k128(smem_a + s * A_BYTES + half * (64 * 128));
                u64 db = wgmma_desc_k128(smem_b + s * B_BYTES);
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) wgmma_fence_operand(acc[i]);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < HG_BK / 16; ++kk)
                    hg_mma<BN>(acc, wgmma_desc_advance(da, kk * 32), wgmma_desc_advance(db, kk * 32), kt > 0 || kk > 0);
                wgmma_commit();
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) wgmma_fence_operand(acc[i]);
                // The previous stage's MMAs are done once at most this stage's group runs: free it.
                wgmma_wait<1>();
                if (kt > 0 && signals) mbar_arrive(&empty[(it - 1) % STAGES]);
            }
            wgmma_wait<0>();
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) wgmma_fence_operand(acc[i]);
            if (signals) mbar_arrive(&empty[(it - 1) % STAGES]); // the tile's last stage
            hg_epilogue<BN>(acc, smem_stage + half * HgStage<BN>::BYTES, t, half, row0 + half * 64, col0, d, bias, res, m, n, act);
        }
    }
}

// Entry points: hopper_gemm_f16_n<BN>_s<STAGES>. A 1-D grid of up to ceil(M / 128) · ceil(N / BN)
// blocks (tile t at rows 128·(t / tiles_n), columns BN·(t % tiles_n)), 384 threads, STAGES · (128 + BN) · 128 + 128 · (2 · BN + 16) + 1024 bytes of dynamic shared
// memory; `act` is an ACT_* code of common.cuh (none, ReLU, GELU, tanh-GELU, SiLU).
#define HOPPER_GEMM_ENTRY(BN, STAGES)                                                                                                      \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                                                   \
        hopper_gemm_f16_n##BN##_s##STAGES(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b, f16* d,      \
                                          const float* bias, const f16* res, int m, int n, int k, int act) {                             \
        hopper_gemm<BN, STAGES>(&map_a, &map_b, d, bias, res, m, n, k, act);                                                             \
    }

HOPPER_GEMM_ENTRY(128, 4)
HOPPER_GEMM_ENTRY(256, 3)
