// CenterNet decode: sigmoid of the class heatmap, 3x3 peak keeping, top-K over classes x
// positions per image, boxes from wh and reg. Matches the CPU reference in
// models/src/centernet.rs exactly in its order: score descending, ties to the lower flat index
// `class * H * W + y * W + x`; suppressed positions score 0 and still compete.
//
// Each candidate is one 64-bit key: the score's bits (scores are >= 0, so their IEEE bits order
// like the scores) above the complement of its index, so "larger key" is exactly "ranks first"
// and a selection needs no tie logic. Selection is a tree of tile sorts:
//   decode_select_*: every (tile of 4096 heatmap elements, image) block scores its tile, sorts it
//                    in shared memory (bitonic) and keeps its best K keys;
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

// hm: [N, H, W, C] logits. out: [N, tiles, K] keys, each tile's best first.
// Launch: grid (tiles, N), block SEL_THREADS, tiles = ceil(H*W*C / SEL_TILE).
template <typename T> __device__ void decode_select(const T* hm, int H, int W, int C, int K, u64* out) {
    __shared__ u64 s[SEL_TILE];
    __shared__ int peaks;
    const int n = blockIdx.y, t = blockIdx.x, tiles = gridDim.x;
    const i64 per_image = (i64)H * W * C;
    const T* x = hm + n * per_image;
    if (threadIdx.x == 0) peaks = 0;
    __syncthreads();
    // Peaks are the usual minority: sort only them, unless fewer than K, when the zero scores
    // of suppressed positions (lowest index first) complete the tile's top K.
    u64 mine[SEL_TILE / SEL_THREADS];
#pragma unroll
    for (int r = 0; r < SEL_TILE / SEL_THREADS; ++r) {
        const i64 e = (i64)t * SEL_TILE + threadIdx.x + r * SEL_THREADS;
        u64 key = 0;
        if (e < per_image) {
            const int c = (int)(e % C), p = (int)(e / C);
            const int y = p / W, xx = p % W;
            // The reference keeps v where the 3x3 max of the sigmoids equals sigmoid(v). The f32
            // sigmoid is monotone, so that max is the sigmoid of the largest logit: two sigmoids
            // per element instead of nine, with the same outcome bit for bit.
            const float logit = to_f32(x[e]);
            float top = logit;
            for (int yy = max(y - 1, 0); yy <= min(y + 1, H - 1); ++yy)
                for (int xq = max(xx - 1, 0); xq <= min(xx + 1, W - 1); ++xq) top = fmaxf(top, to_f32(x[((i64)yy * W + xq) * C + c]));
            const float v = sigmoid(logit);
            const bool peak = top == logit || !(sigmoid(top) > v);
            key = make_key(peak ? v : 0.f, (unsigned)c * H * W + p);
            if (peak) s[atomicAdd(&peaks, 1)] = key;
        }
        mine[r] = key;
    }
    __syncthreads();
    const int count = peaks;
    int m;
    if (count >= K) {
        m = next_pow2(count);
        for (int i = count + threadIdx.x; i < m; i += blockDim.x) s[i] = 0;
    } else {
        m = SEL_TILE;
#pragma unroll
        for (int r = 0; r < SEL_TILE / SEL_THREADS; ++r) s[threadIdx.x + r * SEL_THREADS] = mine[r];
    }
    __syncthreads();
    bitonic_desc(s, m);
    for (int i = threadIdx.x; i < K; i += blockDim.x) out[((i64)n * tiles + t) * K + i] = s[i];
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

#define DECODE_SELECT(T, S)                                                                                    \
    extern "C" __global__ void decode_select_##S(const T* hm, int H, int W, int C, int K, u64* out) {         \
        decode_select<T>(hm, H, W, C, K, out);                                                                 \
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
