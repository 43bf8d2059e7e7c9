// Attention family (src/ops/attention.rs): softmax(scale·Q·Kᵀ + bias)·V over `Z` independent
// (image, window, head) problems. The optional bias is f32 [zimg, L, S] and problem z reads its
// slice z % zimg (the bias has no batch: it is the same for every image). Softmax statistics and
// accumulators are f32.
//
// The fused kernels read q, k, v and write y as strided rows, so that multi-head attention on a
// packed projection ([.., L, 3·H·D], nn.MultiheadAttention's in_proj) needs no copies: problem z
// is head h = z % heads of group g = z / heads, and
//   q row i at q + (g·L + i)·ldq + h·D,   k and v row j at k|v + (g·S + j)·ldkv + h·D,
//   y row i at y + (g·L + i)·ldy + h·D    (D contiguous elements each).
// Contiguous [Z, L, D] operands are heads = 1, ld = D.

// The second half of the unfused candidate: scores (f32 [Z, L, S], rows `ld` apart, already
// scaled by the GEMM) plus the bias, softmax along S, written as probabilities in T (rows `ld`
// apart; the padding is never read) for the P·V GEMM. One warp a row.
template <typename T>
__device__ void attn_softmax(const float* scores, const float* bias, T* probs, i64 rows, int L, int S, int ld, i64 zimg) {
    const int lane = threadIdx.x & 31;
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 r = warp; r < rows; r += warps) {
        const float* s = scores + r * ld;
        // Row r is row (r % L) of problem r / L; its bias row is that problem's modulo zimg.
        const float* b = bias ? bias + (((r / L) % zimg) * L + r % L) * S : nullptr;
        float m = neg_inf();
        for (int j = lane; j < S; j += 32) m = fmaxf(m, s[j] + (b ? b[j] : 0.f));
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float sum = 0.f;
        for (int j = lane; j < S; j += 32) sum += expf(s[j] + (b ? b[j] : 0.f) - m);
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        const float inv = 1.f / sum;
        T* p = probs + r * ld;
        for (int j = lane; j < S; j += 32) p[j] = from_f32<T>(expf(s[j] + (b ? b[j] : 0.f) - m) * inv);
    }
}

// The CUDA-core fused candidate (flash-attention style): one thread per query row holds its
// scaled q and its f32 accumulator in registers; the block's 64 rows stream K and V through shared
// memory in tiles of ATTN_BK keys, with the online softmax (running max and sum, rescaling the
// accumulator when the max grows). Grid: (Z, ceil(L / 64)). Any element type.
#define ATTN_BQ 64
#define ATTN_BK 32
template <typename T, int D>
__device__ void attn_fused(const T* q, const T* k, const T* v, const float* bias, T* y, int L, int S, int heads, i64 ldq, i64 ldkv,
                           i64 ldy, i64 zimg, float scale) {
    // Rows of D floats (D a multiple of 4), read as float4: a quarter of the shared-memory loads.
    __shared__ __align__(16) float ks[ATTN_BK][D];
    __shared__ __align__(16) float vs[ATTN_BK][D];
    const i64 z = blockIdx.x;
    const i64 g = z / heads, hd = (z % heads) * D;
    const int row = blockIdx.y * ATTN_BQ + threadIdx.x;
    const bool live = row < L;
    float qr[D], acc[D];
    const T* qp = q + (g * L + (live ? row : 0)) * ldq + hd;
#pragma unroll
    for (int d = 0; d < D; ++d) {
        qr[d] = live ? to_f32(qp[d]) * scale : 0.f;
        acc[d] = 0.f;
    }
    const float* brow = (bias && live) ? bias + ((z % zimg) * L + row) * (i64)S : nullptr;
    float m = neg_inf(), l = 0.f;
    const T* kz = k + g * S * ldkv + hd;
    const T* vz = v + g * S * ldkv + hd;
    for (int s0 = 0; s0 < S; s0 += ATTN_BK) {
        const int nk = min(ATTN_BK, S - s0);
        for (int e = threadIdx.x; e < ATTN_BK * D; e += ATTN_BQ) {
            const int j = e / D, d = e % D;
            const bool in = j < nk;
            ks[j][d] = in ? to_f32(kz[(i64)(s0 + j) * ldkv + d]) : 0.f;
            vs[j][d] = in ? to_f32(vz[(i64)(s0 + j) * ldkv + d]) : 0.f;
        }
        __syncthreads();
        if (live) {
            for (int j = 0; j < nk; ++j) {
                float s = 0.f;
#pragma unroll
                for (int d = 0; d < D; d += 4) {
                    const float4 kv = *reinterpret_cast<const float4*>(&ks[j][d]);
                    s += qr[d] * kv.x + qr[d + 1] * kv.y + qr[d + 2] * kv.z + qr[d + 3] * kv.w;
                }
                if (brow) s += brow[s0 + j];
                if (s > m) {
                    // exp(-inf) = 0 on the first key: the empty accumulator stays empty.
                    const float c = expf(m - s);
                    l *= c;
#pragma unroll
                    for (int d = 0; d < D; ++d) acc[d] *= c;
                    m = s;
                }
                const float p = expf(s - m);
                l += p;
#pragma unroll
                for (int d = 0; d < D; d += 4) {
                    const float4 vv = *reinterpret_cast<const float4*>(&vs[j][d]);
                    acc[d] += p * vv.x;
                    acc[d + 1] += p * vv.y;
                    acc[d + 2] += p * vv.z;
                    acc[d + 3] += p * vv.w;
                }
            }
        }
        __syncthreads();
    }
    if (live) {
        const float inv = 1.f / l;
        T* yp = y + (g * L + row) * ldy + hd;
#pragma unroll
        for (int d = 0; d < D; ++d) yp[d] = from_f32<T>(acc[d] * inv);
    }
}

// ---- The tensor-core fused candidates (f16; flash-attention 2's structure)
//
// A block of 4 warps takes 64 query rows, 16 per warp. Per key tile each warp computes its 16×NK
// scores with mma.m16n8k16 (f16 in, f32 accumulate), applies the scale, bias and key mask,
// updates the online softmax in registers, and multiplies the probabilities (rounded to f16, as
// any f16 P·V GEMM does) by V with the score fragments reused directly as the A operand.
// Statistics and the output accumulator stay f32. Two kernels share that step (`tc_step`):
// - `flash_attn_tc_*` streams K and V through shared memory in tiles of 64 keys, with a barrier
//   before and after each tile;
// - `flash_attn_tcs_*` copies all S keys and values of its problem into shared memory at once
//   (cp.async, two barriers), and its warps then run through them with no further barrier: tiles
//   of 64 keys while 64 remain, then tiles of 16, only the last one masked. Dynamic shared memory:
//   2 · S16 · (D + 8) halves, S16 = S rounded up to 16. A warp may take several query tiles
//   (`tiles_per_warp`), so that a block reads its problem's K and V once for all its rows.
// Both require ldq, ldkv, ldy and h·D multiples of 8 (16-byte rows) and 16-byte aligned pointers.
#define TC_BQ 64
#define TC_BK 64

// One warp's state over the key tiles: its two query rows, Q as A fragments, the accumulator and
// the online-softmax statistics (max in log2 units, sum).
template <int D>
struct TcRows {
    int rows[2];
    int r, c2, lane;
    unsigned qa[D / 16][4];
    float o[D / 8][4];
    float m[2], l[2];

    __device__ void load(const f16* q, i64 g, i64 hd, int L, i64 ldq, int q0) {
        lane = threadIdx.x & 31;
        r = lane >> 2;
        c2 = (lane & 3) * 2;
        rows[0] = q0 + r;
        rows[1] = q0 + r + 8;
        // Row-major 16×16 A fragments: a0 = (r, c2..), a1 = (r + 8, c2..), a2 = (r, c2 + 8..),
        // a3 = (r + 8, c2 + 8..); rows past L are zeros.
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int row = rows[half];
                const unsigned* p = reinterpret_cast<const unsigned*>(q + (g * L + (row < L ? row : 0)) * ldq + hd + kk * 16 + c2);
                qa[kk][half] = row < L ? p[0] : 0u;
                qa[kk][half + 2] = row < L ? p[4] : 0u;  // 8 halves on
            }
        }
#pragma unroll
        for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
        m[0] = m[1] = neg_inf();
        l[0] = l[1] = 0.f;
    }

    // Keys s0 .. s0 + NK - 1, whose K and V rows are `ks` and `vs` (rows LDS halves apart). MASK:
    // keys at or past S score -inf (their K and V rows must be zeros, not garbage).
    template <int NK, bool MASK>
    __device__ __forceinline__ void step(const unsigned short* ks, const unsigned short* vs, int s0, int S, int L, const float* bias_z,
                                         float qk_scale) {
        constexpr int LDS = D + 8;
        // S = Q·Kᵀ: NK/8 tiles of 8 keys. B (k = d, n = key) is K's row `key`: two halves at (key, d).
        float s[NK / 8][4];
#pragma unroll
        for (int j = 0; j < NK / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
            const unsigned short* kr = &ks[(j * 8 + r) * LDS + c2];
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                const unsigned b0 = *reinterpret_cast<const unsigned*>(kr + kk * 16);
                const unsigned b1 = *reinterpret_cast<const unsigned*>(kr + kk * 16 + 8);
                mma_16816(s[j], qa[kk], b0, b1);
            }
        }
        // Scale, bias, mask; row maxima (fragment element e: row rows[e / 2], key j·8 + c2 + e % 2).
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int j = 0; j < NK / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = s0 + j * 8 + c2 + (e & 1);
                const int row = rows[e >> 1];
                float x = s[j][e] * qk_scale;
                if (bias_z && row < L && (!MASK || key < S)) x += bias_z[(i64)row * S + key] * 1.4426950408889634f;
                if (MASK) x = key < S ? x : neg_inf();
                s[j][e] = x;
                mx[e >> 1] = fmaxf(mx[e >> 1], x);
            }
        }
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            // The row's 4 threads (lanes 4r .. 4r + 3) share its maximum.
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            // A row with every key masked so far keeps max -inf: exponentiate against 0 instead.
            const float base = mx[h] == neg_inf() ? 0.f : mx[h];
            corr[h] = exp2f(m[h] - base);
            m[h] = mx[h];
            l[h] *= corr[h];
        }
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            o[n][0] *= corr[0];
            o[n][1] *= corr[0];
            o[n][2] *= corr[1];
            o[n][3] *= corr[1];
        }
        // P = exp2(S - max), row sums (this thread's share; the row's 4 threads add up at the end).
        unsigned pa[NK / 16][4];
#pragma unroll
        for (int j = 0; j < NK / 8; ++j) {
            float p[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float base = m[e >> 1] == neg_inf() ? 0.f : m[e >> 1];
                p[e] = exp2f(s[j][e] - base);
                l[e >> 1] += p[e];
            }
            // Score tiles 2t and 2t + 1 form the A fragment of keys 16t .. 16t + 15.
            pa[j / 2][(j & 1) * 2] = pack_f16x2(p[0], p[1]);
            pa[j / 2][(j & 1) * 2 + 1] = pack_f16x2(p[2], p[3]);
        }
        // O += P·V: B (k = key, n = d) from V's rows with ldmatrix.trans (V is [key][d] in shared).
#pragma unroll
        for (int t = 0; t < NK / 16; ++t) {
            // ldmatrix .x2: lanes 0-15 give the addresses of keys 16t .. 16t + 15.
            const unsigned short* vr = &vs[(t * 16 + (lane & 15)) * LDS];
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                unsigned b0, b1;
                asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];"
                             : "=r"(b0), "=r"(b1)
                             : "r"(smem_u32(vr + n * 8)));
                mma_16816(o[n], pa[t], b0, b1);
            }
        }
    }

    // y rows = O / l (rows past L are not written).
    __device__ void store(f16* y, i64 g, i64 hd, int L, i64 ldy) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
            l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = rows[h];
            if (row >= L) continue;
            const float inv = 1.f / l[h];
            unsigned* yp = reinterpret_cast<unsigned*>(y + (g * L + row) * ldy + hd + c2);
#pragma unroll
            for (int n = 0; n < D / 8; ++n) yp[n * 4] = pack_f16x2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
        }
    }
};

// Scores in log2 units: exp2(x·scale·log2 e) = exp(x·scale).
#define TC_LOG2E 1.4426950408889634f

template <int D>
__device__ void attn_tc(const f16* q, const f16* k, const f16* v, const float* bias, f16* y, int L, int S, int heads, i64 ldq, i64 ldkv,
                        i64 ldy, i64 zimg, float scale) {
    // Rows padded by 8 halves (16 bytes): the 8 rows a fragment load touches fall in distinct banks.
    constexpr int LDS = D + 8;
    __shared__ __align__(16) unsigned short ks[TC_BK * LDS];
    __shared__ __align__(16) unsigned short vs[TC_BK * LDS];
    const i64 z = blockIdx.x;
    const i64 g = z / heads, hd = (z % heads) * D;
    TcRows<D> w;
    w.load(q, g, hd, L, ldq, blockIdx.y * TC_BQ + (threadIdx.x >> 5) * 16);
    const float* bias_z = bias ? bias + (z % zimg) * (i64)L * S : nullptr;
    const f16* kz = k + g * S * ldkv + hd;
    const f16* vz = v + g * S * ldkv + hd;
    for (int s0 = 0; s0 < S; s0 += TC_BK) {
        // K and V tiles, 16 bytes a thread a step; keys past S are zeros (masked).
        for (int e = threadIdx.x; e < TC_BK * (D / 8); e += blockDim.x) {
            const int j = e / (D / 8), c = (e % (D / 8)) * 8;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (s0 + j < S) {
                kv = *reinterpret_cast<const uint4*>(kz + (i64)(s0 + j) * ldkv + c);
                vv = *reinterpret_cast<const uint4*>(vz + (i64)(s0 + j) * ldkv + c);
            }
            *reinterpret_cast<uint4*>(&ks[j * LDS + c]) = kv;
            *reinterpret_cast<uint4*>(&vs[j * LDS + c]) = vv;
        }
        __syncthreads();
        w.template step<TC_BK, true>(ks, vs, s0, S, L, bias_z, scale * TC_LOG2E);
        __syncthreads();
    }
    w.store(y, g, hd, L, ldy);
}

// `rows_per_warp` tiles of 16 query rows a warp: warp w of block y takes tiles
// (y · rows_per_warp + i) · 4 + w, so one block can cover every query row of its problem and read
// its K and V once. The first 64 keys arrive in their own cp.async group and are used while the
// rest are in flight.
template <int D>
__device__ void attn_tcs(const f16* q, const f16* k, const f16* v, const float* bias, f16* y, int L, int S, int heads, i64 ldq, i64 ldkv,
                         i64 ldy, i64 zimg, float scale, int tiles_per_warp) {
    constexpr int LDS = D + 8;
    extern __shared__ __align__(16) unsigned short kv_resident[];
    const int s16 = (S + 15) & ~15;
    unsigned short* ks = kv_resident;
    unsigned short* vs = kv_resident + (i64)s16 * LDS;
    const i64 z = blockIdx.x;
    const i64 g = z / heads, hd = (z % heads) * D;
    const f16* kz = k + g * S * ldkv + hd;
    const f16* vz = v + g * S * ldkv + hd;
    // Key rows [0, first) in one group, [first, s16) in the next; rows S .. s16 - 1 zero-filled.
    const int first = min(s16, 64);
    for (int part = 0; part < 2; ++part) {
        const int lo = part == 0 ? 0 : first, hi = part == 0 ? first : s16;
        for (int e = lo * (D / 8) + threadIdx.x; e < hi * (D / 8); e += blockDim.x) {
            const int j = e / (D / 8), c = (e % (D / 8)) * 8;
            const bool in = j < S;
            const i64 off = (i64)(in ? j : 0) * ldkv + c;
            cp_async16(smem_u32(&ks[j * LDS + c]), kz + off, in);
            cp_async16(smem_u32(&vs[j * LDS + c]), vz + off, in);
        }
        cp_async_commit();
    }
    const int tile0 = blockIdx.y * tiles_per_warp * 4 + (threadIdx.x >> 5);
    TcRows<D> w;
    w.load(q, g, hd, L, ldq, tile0 * 16);
    const float* bias_z = bias ? bias + (z % zimg) * (i64)L * S : nullptr;
    const float qk_scale = scale * TC_LOG2E;
    // The first 64 keys (when S has that many), while the others arrive.
    const bool early = S >= 64;
    cp_async_wait<1>();
    __syncthreads();
    if (early && tile0 * 16 < L) w.template step<64, false>(ks, vs, 0, S, L, bias_z, qk_scale);
    cp_async_wait<0>();
    __syncthreads();
    // No barrier follows.
    for (int i = 0; i < tiles_per_warp; ++i) {
        const int q0 = (tile0 + 4 * i) * 16;
        if (q0 >= L) break;
        if (i > 0) w.load(q, g, hd, L, ldq, q0);
        int s0 = i == 0 && early ? 64 : 0;
        for (; s0 + 64 <= S; s0 += 64) w.template step<64, false>(ks + s0 * LDS, vs + s0 * LDS, s0, S, L, bias_z, qk_scale);
        for (; s0 + 16 <= S; s0 += 16) w.template step<16, false>(ks + s0 * LDS, vs + s0 * LDS, s0, S, L, bias_z, qk_scale);
        if (s0 < S) w.template step<16, true>(ks + s0 * LDS, vs + s0 * LDS, s0, S, L, bias_z, qk_scale);
        w.store(y, g, hd, L, ldy);
    }
}

#define ATTENTION(T, S)                                                                                                          \
    extern "C" __global__ void attn_softmax_##S(const float* scores, const float* bias, T* probs, i64 rows, int L, int Sk, int ld, \
                                                i64 zimg) {                                                                      \
        attn_softmax<T>(scores, bias, probs, rows, L, Sk, ld, zimg);                                                             \
    }                                                                                                                            \
    extern "C" __global__ void __launch_bounds__(ATTN_BQ)                                                                        \
        flash_attn_d32_##S(const T* q, const T* k, const T* v, const float* bias, T* y, int L, int Sk, int heads, i64 ldq,       \
                           i64 ldkv, i64 ldy, i64 zimg, float scale) {                                                           \
        attn_fused<T, 32>(q, k, v, bias, y, L, Sk, heads, ldq, ldkv, ldy, zimg, scale);                                          \
    }                                                                                                                            \
    extern "C" __global__ void __launch_bounds__(ATTN_BQ)                                                                        \
        flash_attn_d64_##S(const T* q, const T* k, const T* v, const float* bias, T* y, int L, int Sk, int heads, i64 ldq,       \
                           i64 ldkv, i64 ldy, i64 zimg, float scale) {                                                           \
        attn_fused<T, 64>(q, k, v, bias, y, L, Sk, heads, ldq, ldkv, ldy, zimg, scale);                                          \
    }

ATTENTION(float, f32)
ATTENTION(f16, f16)

// The tensor-core entry points, written out (not pasted by a macro) so that each name appears
// in this source as the engine looks it up.
#define TC_ARGS const f16 *q, const f16 *k, const f16 *v, const float *bias, f16 *y, int L, int Sk, int heads, i64 ldq, i64 ldkv, i64 ldy, i64 zimg, float scale
#define TC_PASS q, k, v, bias, y, L, Sk, heads, ldq, ldkv, ldy, zimg, scale
extern "C" __global__ void __launch_bounds__(128) flash_attn_tc_d32_f16(TC_ARGS) { attn_tc<32>(TC_PASS); }
extern "C" __global__ void __launch_bounds__(128) flash_attn_tc_d64_f16(TC_ARGS) { attn_tc<64>(TC_PASS); }
extern "C" __global__ void __launch_bounds__(128) flash_attn_tcs_d32_f16(TC_ARGS, int tiles_per_warp) { attn_tcs<32>(TC_PASS, tiles_per_warp); }
extern "C" __global__ void __launch_bounds__(128) flash_attn_tcs_d64_f16(TC_ARGS, int tiles_per_warp) { attn_tcs<64>(TC_PASS, tiles_per_warp); }
