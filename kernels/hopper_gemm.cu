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
//   next is issued, frees the stage before, and finally runs the epilogue from registers
//   (bias, residual, activation, f16 stores guarded at the M and N edges).
// TMA fills rows past M or N and columns past K with zeros, so any M, N and K work; K must be a
// multiple of 8 (the tensor map's row pitch must be a multiple of 16 bytes; the host checks it).

#define HG_BM 128
#define HG_BK 64
// 0 none, 1 ReLU, 2 erf-GELU, 3 tanh-GELU, 4 SiLU: `HopperAct` in src/engine/hopper_gemm.rs.
#define HG_NONE 0
#define HG_RELU 1
#define HG_GELU 2
#define HG_GELU_TANH 3
#define HG_SILU 4

template <int ACT> __device__ __forceinline__ float hg_act(float v) {
    if (ACT == HG_RELU) return apply_act(v, ACT_RELU, 0.f);
    if (ACT == HG_GELU) return apply_act(v, ACT_GELU, 0.f);
    if (ACT == HG_GELU_TANH) return apply_act(v, ACT_GELU_TANH, 0.f);
    if (ACT == HG_SILU) return apply_act(v, ACT_SILU, 0.f);
    return v;
}

template <int BN> __device__ __forceinline__ void hg_mma(float* acc, u64 da, u64 db) {
    if (BN == 128) {
        wgmma_m64n128k16_f16(acc, da, db, 1);
    } else {
        wgmma_m64n256k16_f16(acc, da, db, 1);
    }
}

// The consumer's 64 × BN accumulators → D, rows from `row0`, columns from `col0`.
template <int BN, int ACT>
__device__ __forceinline__ void hg_epilogue(const float* acc, int t, int row0, int col0, f16* d, const float* bias, const f16* res, int m,
                                            int n) {
    const bool pairs = (n & 1) == 0; // f16x2 stores need even rows of D
#pragma unroll
    for (int i = 0; i < BN / 2; i += 2) {
        int row = row0 + wgmma_acc_row(t, i), col = col0 + wgmma_acc_col(t, i);
        if (row >= m || col >= n) continue;
        float v0 = acc[i], v1 = acc[i + 1];
        bool two = col + 1 < n;
        if (bias) {
            v0 += bias[col];
            if (two) v1 += bias[col + 1];
        }
        i64 at = (i64)row * n + col;
        if (pairs && two) {
            if (res) {
                unsigned r = *reinterpret_cast<const unsigned*>(res + at);
                v0 += to_f32(f16{(unsigned short)(r & 0xffff)});
                v1 += to_f32(f16{(unsigned short)(r >> 16)});
            }
            *reinterpret_cast<unsigned*>(d + at) = pack_f16x2(hg_act<ACT>(v0), hg_act<ACT>(v1));
        } else {
            if (res) v0 += to_f32(res[at]);
            d[at] = from_f32<f16>(hg_act<ACT>(v0));
            if (two) {
                if (res) v1 += to_f32(res[at + 1]);
                d[at + 1] = from_f32<f16>(hg_act<ACT>(v1));
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

    const int warpgroup = threadIdx.x / 128, t = threadIdx.x % 128;
    const int row0 = blockIdx.y * HG_BM, col0 = blockIdx.x * BN;
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

    if (warpgroup == 0) {
        setmaxnreg_dec<40>();
        if (t == 0) {
            for (int kt = 0; kt < k_tiles; ++kt) {
                int s = kt % STAGES;
                unsigned phase = (kt / STAGES) & 1;
                mbar_wait(&empty[s], phase ^ 1);
                mbar_arrive_expect_tx(&full[s], A_BYTES + B_BYTES);
                tma_load_2d(smem_a + s * A_BYTES, map_a, &full[s], kt * HG_BK, row0);
                tma_load_2d(smem_b + s * B_BYTES, map_b, &full[s], kt * HG_BK, col0);
            }
        }
    } else {
        setmaxnreg_inc<232>();
        const int half = warpgroup - 1; // rows 64·half .. 64·half + 63 of the block's tile
        float acc[BN / 2];
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
        for (int kt = 0; kt < k_tiles; ++kt) {
            int s = kt % STAGES;
            mbar_wait(&full[s], (kt / STAGES) & 1);
            u64 da = wgmma_desc_k128(smem_a + s * A_BYTES + half * (64 * 128));
            u64 db = wgmma_desc_k128(smem_b + s * B_BYTES);
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) wgmma_fence_operand(acc[i]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < HG_BK / 16; ++kk) hg_mma<BN>(acc, wgmma_desc_advance(da, kk * 32), wgmma_desc_advance(db, kk * 32));
            wgmma_commit();
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) wgmma_fence_operand(acc[i]);
            // The previous stage's MMAs are done once at most this stage's group runs: free it.
            wgmma_wait<1>();
            if (kt > 0 && (t & 31) == 0) mbar_arrive(&empty[(kt - 1) % STAGES]);
        }
        wgmma_wait<0>();
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) wgmma_fence_operand(acc[i]);
        int r0 = row0 + half * 64;
        switch (act) {
        case HG_RELU: hg_epilogue<BN, HG_RELU>(acc, t, r0, col0, d, bias, res, m, n); break;
        case HG_GELU: hg_epilogue<BN, HG_GELU>(acc, t, r0, col0, d, bias, res, m, n); break;
        case HG_GELU_TANH: hg_epilogue<BN, HG_GELU_TANH>(acc, t, r0, col0, d, bias, res, m, n); break;
        case HG_SILU: hg_epilogue<BN, HG_SILU>(acc, t, r0, col0, d, bias, res, m, n); break;
        default: hg_epilogue<BN, HG_NONE>(acc, t, r0, col0, d, bias, res, m, n); break;
        }
    }
}

// Entry points: hopper_gemm_f16_n<BN>_s<STAGES>. Grid (ceil(N / BN), ceil(M / 128)), 384
// threads, STAGES · (128 + BN) · 128 + 1024 bytes of dynamic shared memory.
#define HOPPER_GEMM_ENTRY(BN, STAGES)                                                                                                      \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                                                   \
        hopper_gemm_f16_n##BN##_s##STAGES(const __grid_constant__ TensorMap map_a, const __grid_constant__ TensorMap map_b, f16* d,      \
                                          const float* bias, const f16* res, int m, int n, int k, int act) {                             \
        hopper_gemm<BN, STAGES>(&map_a, &map_b, d, bias, res, m, n, k, act);                                                             \
    }

HOPPER_GEMM_ENTRY(128, 4)
HOPPER_GEMM_ENTRY(256, 4)
