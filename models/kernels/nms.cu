// YOLO post-processing: confidence threshold, top candidates, class-aware greedy NMS, top-K.
// Matches the CPU reference in models/src/yolo_nms.rs exactly in its order and arithmetic.
//
// pred: [N, 4 + C, A] (cx, cy, w, h, then C class scores per anchor), contiguous.
// Each anchor's candidate is its best class (the first of equal maxima) when that score is
// > conf. A candidate is one 64-bit key: the score's bits (scores > conf >= 0, so their IEEE bits
// order like the scores) above the complement of its anchor, so "larger key" is exactly "ranks
// first" (ties to the lower anchor) and keys are unique.
//   nms_keys_*:   every anchor's key (0 when rejected);
//   nms_select:   per image, the `cap` largest keys (radix select of the cap-th key, then a
//                 bitonic sort in shared memory), and their count;
//   nms_boxes_*:  the sorted candidates' xyxy boxes, classes and scores;
//   nms_mask:     per pair (i < j) of the same class, bit j of row i when IoU > thr;
//   nms_scan:     per image, the greedy scan over the sorted candidates, K rows out.

#define NMS_CAP 4096
#define NMS_THREADS 1024

// The best class of anchor a and its score: strict > keeps the first of equal maxima; NaN never wins.
template <typename T> __device__ __forceinline__ int best_class(const T* p, int C, int A, int a, float& best) {
    int cls = -1;
    best = 0.f;
    for (int c = 0; c < C; ++c) {
        const float v = to_f32(p[(i64)(4 + c) * A + a]);
        if (cls < 0 ? v == v : v > best) {
            best = v;
            cls = c;
        }
    }
    return cls;
}

// keys: [N, A]. Launch: grid (ceil(A / 256), N), block 256.
template <typename T> __device__ void nms_keys(const T* pred, int C, int A, float conf, u64* keys) {
    const int n = blockIdx.y;
    const int a = blockIdx.x * blockDim.x + threadIdx.x;
    if (a >= A) return;
    const T* p = pred + (i64)n * (4 + C) * A;
    float best;
    const int cls = best_class(p, C, A, a, best);
    keys[(i64)n * A + a] = cls >= 0 && best > conf ? ((u64)__float_as_uint(best) << 32) | (u64)(0xffffffffu - (unsigned)a) : 0ull;
}

// keys: [N, A]; sorted: [N, cap]; count: [N]. Launch: grid N, block NMS_THREADS.
extern "C" __global__ void nms_select(const u64* keys, int A, int cap, u64* sorted, int* count) {
    __shared__ u64 s[NMS_CAP];
    __shared__ int hist[256];
    __shared__ u64 prefix;
    __shared__ int need, total, kept;
    const int n = blockIdx.x;
    const u64* k = keys + (i64)n * A;
    if (threadIdx.x == 0) {
        total = 0;
        kept = 0;
        prefix = 0;
    }
    __syncthreads();
    int mine = 0;
    for (int a = threadIdx.x; a < A; a += blockDim.x) mine += k[a] != 0;
    atomicAdd(&total, mine);
    __syncthreads();
    // The cap-th largest key, one byte at a time from the top (keys are unique, so exactly
    // `cap` keys are >= it); with fewer candidates, every nonzero key is kept.
    u64 thr = 1;
    if (total > cap) {
        if (threadIdx.x == 0) need = cap;
        u64 mask = 0;
        for (int shift = 56; shift >= 0; shift -= 8) {
            for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
            __syncthreads();
            const u64 pre = prefix;
            for (int a = threadIdx.x; a < A; a += blockDim.x) {
                const u64 v = k[a];
                if (v != 0 && (v & mask) == pre) atomicAdd(&hist[(v >> shift) & 0xff], 1);
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                int d = 255;
                while (d > 0 && hist[d] < need) need -= hist[d--];
                prefix = pre | ((u64)d << shift);
            }
            mask |= 0xffull << shift;
            __syncthreads();
        }
        thr = prefix;
    }
    for (int a = threadIdx.x; a < A; a += blockDim.x) {
        const u64 v = k[a];
        if (v != 0 && v >= thr) {
            const int at = atomicAdd(&kept, 1);
            if (at < NMS_CAP) s[at] = v;
        }
    }
    __syncthreads();
    const int c = min(kept, cap);
    const int m = next_pow2(max(c, 1));
    for (int i = c + threadIdx.x; i < m; i += blockDim.x) s[i] = 0;
    __syncthreads();
    bitonic_sort_desc(s, m);
    for (int i = threadIdx.x; i < c; i += blockDim.x) sorted[(i64)n * cap + i] = s[i];
    if (threadIdx.x == 0) count[n] = c;
}

// boxes: [N, cap, 4] xyxy; cls: [N, cap]; scores: [N, cap]. Launch: grid (ceil(cap / 256), N), block 256.
template <typename T>
__device__ void nms_boxes(const T* pred, int C, int A, const u64* sorted, const int* count, int cap, float* boxes, int* cls, float* scores) {
    const int n = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count[n]) return;
    const u64 key = sorted[(i64)n * cap + i];
    const int a = (int)(0xffffffffu - (unsigned)(key & 0xffffffffu));
    const T* p = pred + (i64)n * (4 + C) * A;
    float best;
    const int c = best_class(p, C, A, a, best);
    const float cx = to_f32(p[a]), cy = to_f32(p[(i64)A + a]);
    const float hw = to_f32(p[(i64)2 * A + a]) / 2.f, hh = to_f32(p[(i64)3 * A + a]) / 2.f;
    float* b = boxes + ((i64)n * cap + i) * 4;
    b[0] = cx - hw;
    b[1] = cy - hh;
    b[2] = cx + hw;
    b[3] = cy + hh;
    cls[(i64)n * cap + i] = c;
    scores[(i64)n * cap + i] = __uint_as_float((unsigned)(key >> 32));
}

// IoU > thr of boxes a and b, with torchvision's nms arithmetic (areas from the corners,
// inter / (area_a + area_b - inter)). `thr` is the largest float whose `>` agrees with
// torchvision's double comparison (the converter computes it).
__device__ __forceinline__ bool overlaps(const float* a, const float* b, float thr) {
    const float area_a = (a[2] - a[0]) * (a[3] - a[1]);
    const float area_b = (b[2] - b[0]) * (b[3] - b[1]);
    const float w = fmaxf(0.f, fminf(a[2], b[2]) - fmaxf(a[0], b[0]));
    const float h = fmaxf(0.f, fminf(a[3], b[3]) - fmaxf(a[1], b[1]));
    const float inter = __fmul_rn(w, h);
    const float iou = __fdiv_rn(inter, __fsub_rn(__fadd_rn(area_a, area_b), inter));
    return iou > thr;
}

// mask: [N, cap, words] with words = ceil(cap / 64): bit jj of word cb of row i is candidate
// j = cb * 64 + jj, set when j > i, same class, IoU > thr. Launch: grid (words, words, N), block 64.
extern "C" __global__ void nms_mask(const float* boxes, const int* cls, const int* count, int cap, int words, float thr, u64* mask) {
    __shared__ float col[64 * 4];
    __shared__ int col_cls[64];
    const int n = blockIdx.z, rb = blockIdx.y, cb = blockIdx.x;
    const int cnt = count[n];
    const int i = rb * 64 + threadIdx.x;
    if (rb * 64 >= cnt) return;
    const int j0 = cb * 64;
    if (j0 + threadIdx.x < cnt) {
        for (int q = 0; q < 4; ++q) col[threadIdx.x * 4 + q] = boxes[((i64)n * cap + j0 + threadIdx.x) * 4 + q];
        col_cls[threadIdx.x] = cls[(i64)n * cap + j0 + threadIdx.x];
    }
    __syncthreads();
    if (i >= cnt) return;
    u64 bits = 0;
    if (cb >= rb) {
        const float* bi = boxes + ((i64)n * cap + i) * 4;
        const float box[4] = {bi[0], bi[1], bi[2], bi[3]};
        const int ci = cls[(i64)n * cap + i];
        for (int jj = 0; jj < 64; ++jj) {
            const int j = j0 + jj;
            if (j > i && j < cnt && col_cls[jj] == ci && overlaps(box, &col[jj * 4], thr)) bits |= 1ull << jj;
        }
    }
    mask[((i64)n * cap + i) * words + cb] = bits;
}

// out: [N, K, 6] rows (x1, y1, x2, y2, score, class), kept boxes first (best first), then rows
// (0, 0, 0, 0, 0, -1). With map != 0 boxes go back to the frame: (v - pad) / gain, clipped to
// [0, fw] x [0, fh]. Launch: grid N, block 64 (words <= 64).
extern "C" __global__ void nms_scan(const float* boxes, const int* cls, const float* scores, const int* count, const u64* mask, int cap,
                                    int words, int K, int map, float padx, float pady, float gain, float fw, float fh, float* out) {
    __shared__ u64 removed[64];
    const int n = blockIdx.x, t = threadIdx.x;
    if (t < 64) removed[t] = 0;
    __syncthreads();
    const int cnt = count[n];
    int kept = 0;
    for (int i = 0; i < cnt && kept < K; ++i) {
        // Every thread reads the same bit; row i's mask never changes bit i (it holds j > i only).
        if ((removed[i >> 6] >> (i & 63)) & 1ull) continue;
        if (t == 0) {
            const float* b = boxes + ((i64)n * cap + i) * 4;
            float* o = out + ((i64)n * K + kept) * 6;
            for (int q = 0; q < 4; ++q) {
                float v = b[q];
                if (map) {
                    v = __fdiv_rn(__fsub_rn(v, q % 2 == 0 ? padx : pady), gain);
                    v = fminf(fmaxf(v, 0.f), q % 2 == 0 ? fw : fh);
                }
                o[q] = v;
            }
            o[4] = scores[(i64)n * cap + i];
            o[5] = (float)cls[(i64)n * cap + i];
        }
        ++kept;
        if (t < words) removed[t] |= mask[((i64)n * cap + i) * words + t];
        __syncthreads();
    }
    for (int r = kept * 6 + t; r < K * 6; r += blockDim.x) out[(i64)n * K * 6 + r] = r % 6 == 5 ? -1.f : 0.f;
}

#define NMS_TYPED(T, S)                                                                                                             \
    extern "C" __global__ void nms_keys_##S(const T* pred, int C, int A, float conf, u64* keys) { nms_keys<T>(pred, C, A, conf, keys); } \
    extern "C" __global__ void nms_boxes_##S(const T* pred, int C, int A, const u64* sorted, const int* count, int cap, float* boxes,   \
                                             int* cls, float* scores) {                                                             \
        nms_boxes<T>(pred, C, A, sorted, count, cap, boxes, cls, scores);                                                           \
    }

NMS_TYPED(float, f32)
NMS_TYPED(f16, f16)
