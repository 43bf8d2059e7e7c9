// Attention family (src/ops/attention.rs): softmax(scale·Q·Kᵀ + bias)·V over `Z` independent
// (image, head) problems. Q is [Z, L, D], K [Z, S, D], V [Z, S, D], Y [Z, L, D], all contiguous;
// the optional bias is f32 [zimg, L, S] and problem z reads its slice z % zimg (the bias has no
// batch: it is the same for every image). Softmax statistics and accumulators are f32.

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

// The fused candidate (flash-attention style, on CUDA cores): one thread per query row holds
// its scaled q and its f32 accumulator in registers; the block's 64 rows stream K and V through
// shared memory in tiles of ATTN_BK keys, with the online softmax (running max and sum,
// rescaling the accumulator when the max grows). Grid: (Z, ceil(L / 64)).
#define ATTN_BQ 64
#define ATTN_BK 32
template <typename T, int D>
__device__ void attn_fused(const T* q, const T* k, const T* v, const float* bias, T* y, int L, int S, i64 zimg, float scale) {
    // Rows of D floats (D a multiple of 4), read as float4: a quarter of the shared-memory loads.
    __shared__ __align__(16) float ks[ATTN_BK][D];
    __shared__ __align__(16) float vs[ATTN_BK][D];
    const i64 z = blockIdx.x;
    const int row = blockIdx.y * ATTN_BQ + threadIdx.x;
    const bool live = row < L;
    float qr[D], acc[D];
    const T* qp = q + (z * L + (live ? row : 0)) * D;
#pragma unroll
    for (int d = 0; d < D; ++d) {
        qr[d] = live ? to_f32(qp[d]) * scale : 0.f;
        acc[d] = 0.f;
    }
    const float* brow = (bias && live) ? bias + ((z % zimg) * L + row) * (i64)S : nullptr;
    float m = neg_inf(), l = 0.f;
    const T* kz = k + z * (i64)S * D;
    const T* vz = v + z * (i64)S * D;
    for (int s0 = 0; s0 < S; s0 += ATTN_BK) {
        const int nk = min(ATTN_BK, S - s0);
        for (int e = threadIdx.x; e < ATTN_BK * D; e += ATTN_BQ) {
            const int j = e / D, d = e % D;
            const bool in = j < nk;
            ks[j][d] = in ? to_f32(kz[(i64)(s0 + j) * D + d]) : 0.f;
            vs[j][d] = in ? to_f32(vz[(i64)(s0 + j) * D + d]) : 0.f;
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
        T* yp = y + (z * L + row) * D;
#pragma unroll
        for (int d = 0; d < D; ++d) yp[d] = from_f32<T>(acc[d] * inv);
    }
}

#define ATTENTION(T, S)                                                                                                          \
    extern "C" __global__ void attn_softmax_##S(const float* scores, const float* bias, T* probs, i64 rows, int L, int Sk, int ld, \
                                                i64 zimg) {                                                                      \
        attn_softmax<T>(scores, bias, probs, rows, L, Sk, ld, zimg);                                                             \
    }                                                                                                                            \
    extern "C" __global__ void __launch_bounds__(ATTN_BQ) flash_attn_d32_##S(const T* q, const T* k, const T* v, const float* bias, \
                                                                          T* y, int L, int Sk, i64 zimg, float scale) {         \
        attn_fused<T, 32>(q, k, v, bias, y, L, Sk, zimg, scale);                                                                 \
    }                                                                                                                            \
    extern "C" __global__ void __launch_bounds__(ATTN_BQ) flash_attn_d64_##S(const T* q, const T* k, const T* v, const float* bias, \
                                                                          T* y, int L, int Sk, i64 zimg, float scale) {         \
        attn_fused<T, 64>(q, k, v, bias, y, L, Sk, zimg, scale);                                                                 \
    }

ATTENTION(float, f32)
ATTENTION(f16, f16)
