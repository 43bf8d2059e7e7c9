// CenterNet decode: sigmoid of the class heatmap, 3x3 peak keeping, top-K over classes x
// positions per image, boxes from wh and reg. Matches the CPU reference in
// models/src/centernet.rs exactly in its order: score descending, ties to the lower flat index
// `class * H * W + y * W + x`; suppressed positions score 0 and still compete.
//
// Each candidate is one 64-bit key: the score's bits (scores are >= 0, so their IEEE bits order
// like the scores) above the complement of its index, so "larger key" is exactly "ranks first"
// and a selection needs no tie logic. Selection is a tree of tile sorts after a threshold:
//   decode_tile_max_*: every (tile of 4096 heatmap elements, image) block keeps a lower bound
//                    of its largest key (the key of its largest logit);
//   decode_threshold: per image, the K-th largest tile maximum (a lower bound of the K-th key);
//   decode_select_*: every tile is scored again, the keys at or above the threshold (a few per
//                    tile) are sorted in shared memory (bitonic) and its best K kept;
//   decode_merge:    blocks sort tiles of 4096 kept keys and keep K, until one tile remains;
//   decode_boxes_*:  the final K keys of each image become (x1, y1, x2, y2, score, class).
// Tiles follow the NHWC memory order (coalesced reads); the keys carry the NCHW index, so the
// result does not depend on the tiling.

#define SEL_TILE 4096
#define SEL_THREADS 1024

__device__ __forceinline__ u64 make_key(float score, unsigned idx) { return ((u64)__float_as_uint(score) << 32) | (u64)(0xffffffffu - idx); }

__device__ __forceinline__ int next_pow2(int v) {
    int m = 1;
    while (m < v) m <<= 1;
    return m;
}

// Sorts s[0, m) descending; m is a power of two; all threads of the block take part.
__device__ void bitonic_desc(u64* s, int m) {
    for (int k = 2; k <= m; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < m / 2; i += blockDim.x) {
                const int lo = (i / j) * 2 * j + (i % j), hi = lo + j;
                const u64 a = s[lo], b = s[hi];
                const bool desc = (lo & k) == 0;
                if (desc ? a < b : a > b) {
                    s[lo] = b;
                    s[hi] = a;
                }
            }
            __syncthreads();
        }
    }
}

// The CPU reference computes 1 / (1 + exp(-x)) in f32 with a (nearly) correctly rounded exp.
// CUDA's expf may be 2 ulp off, which reorders near-equal scores among a million candidates, so
// exp is taken in double and rounded once; the rest is the same f32 arithmetic as the CPU's.
__device__ __forceinline__ float sigmoid(float x) {
    const float e = (float)exp(-(double)x);
    return 1.f / (1.f + e);
}

// The key of heatmap element e (NHWC index within image x, whose logit and sigmoid v are
// given): v where it is a 3x3 peak of its class (`peak`), else 0, above the complement of its
// NCHW index. Indices within an image fit 32 bits (the converter checks), so no 64-bit division.
template <typename T>
__device__ __forceinline__ u64 element_key(const T* x, i64 e, int H, int W, int C, float logit, float v, bool& peak) {
    const unsigned eu = (unsigned)e;
    const int c = (int)(eu % (unsigned)C), p = (int)(eu / (unsigned)C);
    const int y = p / W, xx = p - y * W;
    // The reference keeps v where the 3x3 max of the sigmoids equals sigmoid(v). The f32
    // sigmoid is monotone, so that max is the sigmoid of the largest logit: two sigmoids
    // per element instead of nine, with the same outcome bit for bit.
    float top = logit;
    for (int yy = max(y - 1, 0); yy <= min(y + 1, H - 1); ++yy)
        for (int xq = max(xx - 1, 0); xq <= min(xx + 1, W - 1); ++xq) top = fmaxf(top, to_f32(x[((i64)yy * W + xq) * C + c]));
    peak = top == logit || !(sigmoid(top) > v);
    return make_key(peak ? v : 0.f, (unsigned)c * H * W + p);
}

template <typename T> __device__ __forceinline__ u64 element_key(const T* x, i64 e, int H, int W, int C, bool& peak) {
    const float logit = to_f32(x[e]);
    return element_key(x, e, H, W, C, logit, sigmoid(logit), peak);
}

// Largest float of the block (NaN ignored), in every thread. Needs a __shared__ float[32].
__device__ float block_max_f32(float v, float* warps) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = v;
    __syncthreads();
    v = warps[0];
    for (int i = 1; i < (int)(blockDim.x >> 5); ++i) v = fmaxf(v, warps[i]);
    return v;
}

// Pre-filter, pass 1: per tile, a lower bound of its largest key: the largest key among its
// elements of the largest logit (almost always a peak, so the bound is its best score). Only
// those few elements are scored. hm: [N, H, W, C]; out: [N, tiles].
// Launch: grid (tiles, N), block SEL_THREADS.
template <typename T> __device__ void decode_tile_max(const T* hm, int H, int W, int C, u64* out) {
    __shared__ float warps[32];
    __shared__ u64 best;
    const int n = blockIdx.y, t = blockIdx.x, tiles = gridDim.x;
    const i64 per_image = (i64)H * W * C;
    const T* x = hm + n * per_image;
    if (threadIdx.x == 0) best = 0;
    float lg[SEL_TILE / SEL_THREADS];
    float m = neg_inf();
#pragma unroll
    for (int r = 0; r < SEL_TILE / SEL_THREADS; ++r) {
        const i64 e = (i64)t * SEL_TILE + threadIdx.x + r * SEL_THREADS;
        lg[r] = e < per_image ? to_f32(x[e]) : neg_inf();
        m = fmaxf(m, lg[r]);
    }
    m = block_max_f32(m, warps);
#pragma unroll
    for (int r = 0; r < SEL_TILE / SEL_THREADS; ++r) {
        const i64 e = (i64)t * SEL_TILE + threadIdx.x + r * SEL_THREADS;
        if (e < per_image && lg[r] == m) {
            bool peak;
            atomicMax(&best, element_key(x, e, H, W, C, lg[r], sigmoid(lg[r]), peak));
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) out[(i64)n * tiles + t] = best;
}

// Pre-filter, pass 2: a per-image threshold no larger than the image's K-th best key. The K
// largest tile bounds are keys of K distinct elements, so the K-th of them is such a bound; only the
// first SEL_TILE tiles are looked at (still a bound), and with fewer than K tiles it is 0 (no
// filter). tile_max: [N, tiles]; thr: [N]. Launch: grid N, block SEL_THREADS.
extern "C" __global__ void decode_threshold(const u64* tile_max, int tiles, int K, u64* thr) {
    __shared__ u64 s[SEL_TILE];
    const int n = blockIdx.x;
    const int have = min(tiles, SEL_TILE);
    if (have < K) {
        if (threadIdx.x == 0) thr[n] = 0;
        return;
    }
    const int m = next_pow2(have);
    for (int i = threadIdx.x; i < m; i += blockDim.x) s[i] = i < have ? tile_max[(i64)n * tiles + i] : 0;
    __syncthreads();
    bitonic_desc(s, m);
    if (threadIdx.x == 0) thr[n] = s[K - 1];
}

// hm: [N, H, W, C] logits; thr: [N] (from decode_threshold). out: [N, tiles, K] keys, each
// tile's best first, zero keys after its last survivor.
// Launch: grid (tiles, N), block SEL_THREADS, tiles = ceil(H*W*C / SEL_TILE).
template <typename T> __device__ void decode_select(const T* hm, int H, int W, int C, int K, const u64* thr, u64* out) {
    __shared__ u64 s[SEL_TILE];
    __shared__ int kept;
    const int n = blockIdx.y, t = blockIdx.x, tiles = gridDim.x;
    const i64 per_image = (i64)H * W * C;
    const T* x = hm + n * per_image;
    // A threshold with a positive score keeps only peaks at or above it (a handful per tile):
    // every key of the image's top K is at or above it, so the selection is unchanged. Without
    // one, peaks are the usual minority: sort only them, unless fewer than K, when the zero
    // scores of suppressed positions (lowest index first) complete the tile's top K.
    const u64 bound = thr[n];
    const bool filtered = bound >> 32 != 0;
    const float bound_score = __uint_as_float((unsigned)(bound >> 32));
    if (threadIdx.x == 0) kept = 0;
    __syncthreads();
    u64 mine[SEL_TILE / SEL_THREADS];
#pragma unroll
    for (int r = 0; r < SEL_TILE / SEL_THREADS; ++r) {
        const i64 e = (i64)t * SEL_TILE + threadIdx.x + r * SEL_THREADS;
        u64 key = 0;
        if (e < per_image && filtered) {
            // Score first: below the bound's score, the key is below the bound whatever the
            // 3x3 test says, so most elements skip the neighbours and the second sigmoid.
            const float logit = to_f32(x[e]);
            const float v = sigmoid(logit);
            if (v >= bound_score) {
                bool peak;
                key = element_key(x, e, H, W, C, logit, v, peak);
                if (key >= bound) s[atomicAdd(&kept, 1)] = key;
            }
        } else if (e < per_image) {
            bool peak;
            key = element_key(x, e, H, W, C, peak);
            if (peak) s[atomicAdd(&kept, 1)] = key;
        }
        mine[r] = key;
    }
    __syncthreads();
    const int count = kept;
    int m;
    if (filtered || count >= K) {
        m = next_pow2(max(count, 1));
        for (int i = count + threadIdx.x; i < m; i += blockDim.x) s[i] = 0;
    } else {
        m = SEL_TILE;
#pragma unroll
        for (int r = 0; r < SEL_TILE / SEL_THREADS; ++r) s[threadIdx.x + r * SEL_THREADS] = mine[r];
    }
    __syncthreads();
    bitonic_desc(s, m);
    for (int i = threadIdx.x; i < K; i += blockDim.x) out[((i64)n * tiles + t) * K + i] = i < m ? s[i] : 0;
}

// in: [N, len] keys; out: [N, tiles, K]. Launch: grid (tiles, N), block SEL_THREADS,
// tiles = ceil(len / SEL_TILE). Requires K <= SEL_TILE / 2 so every pass shrinks the list.
extern "C" __global__ void decode_merge(const u64* in, int len, int K, u64* out) {
    __shared__ u64 s[SEL_TILE];
    const int n = blockIdx.y, t = blockIdx.x, tiles = gridDim.x;
    const u64* src = in + (i64)n * len + (i64)t * SEL_TILE;
    const int have = min(SEL_TILE, len - t * SEL_TILE);
    const int m = next_pow2(max(have, K));
    for (int i = threadIdx.x; i < m; i += blockDim.x) s[i] = i < have ? src[i] : 0;
    __syncthreads();
    bitonic_desc(s, m);
    for (int i = threadIdx.x; i < K; i += blockDim.x) out[((i64)n * tiles + t) * K + i] = s[i];
}

// keys: [N, K] final keys; wh, reg: [N, H, W, 2]; out: [N, K, 6].
template <typename T, typename Out> __device__ void decode_boxes(const u64* keys, const T* wh, const T* reg, int N, int H, int W, int K, Out* out) {
    const int plane = H * W;
    GRID_STRIDE(i, (i64)N * K) {
        const int n = (int)(i / K);
        const u64 key = keys[i];
        const float score = __uint_as_float((unsigned)(key >> 32));
        const unsigned idx = 0xffffffffu - (unsigned)(key & 0xffffffffu);
        const int cls = idx / plane, pos = idx % plane;
        const int y = pos / W, x = pos % W;
        const i64 at = ((i64)n * plane + pos) * 2;
        const float cx = (float)x + to_f32(reg[at]), cy = (float)y + to_f32(reg[at + 1]);
        const float bw = to_f32(wh[at]), bh = to_f32(wh[at + 1]);
        Out* o = out + i * 6;
        o[0] = from_f32<Out>(cx - bw / 2.f);
        o[1] = from_f32<Out>(cy - bh / 2.f);
        o[2] = from_f32<Out>(cx + bw / 2.f);
        o[3] = from_f32<Out>(cy + bh / 2.f);
        o[4] = from_f32<Out>(score);
        o[5] = from_f32<Out>((float)cls);
    }
}

#define DECODE_SELECT(T, S)                                                                                            \
    extern "C" __global__ void decode_select_##S(const T* hm, int H, int W, int C, int K, const u64* thr, u64* out) { \
        decode_select<T>(hm, H, W, C, K, thr, out);                                                                    \
    }                                                                                                                  \
    extern "C" __global__ void decode_tile_max_##S(const T* hm, int H, int W, int C, u64* out) {                      \
        decode_tile_max<T>(hm, H, W, C, out);                                                                          \
    }
#define DECODE_BOXES(T, Out, S)                                                                                                        \
    extern "C" __global__ void decode_boxes_##S(const u64* keys, const T* wh, const T* reg, int N, int H, int W, int K, Out* out) {  \
        decode_boxes<T, Out>(keys, wh, reg, N, H, W, K, out);                                                                          \
    }

DECODE_SELECT(float, f32)
DECODE_SELECT(f16, f16)
DECODE_BOXES(float, float, f32_f32)
DECODE_BOXES(f16, float, f16_f32)
DECODE_BOXES(float, f16, f32_f16)
DECODE_BOXES(f16, f16, f16_f16)
