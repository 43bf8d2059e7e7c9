// Norm family: reductions along some dims with f32 arithmetic whatever the element type.
//
// softmax / layer_norm work on (outer, len, inner) in physical order: rows of `len` elements
// `inner` apart. A contiguous row (inner == 1) gets one warp, its lanes striding the row
// (coalesced); otherwise one thread per (outer, inner) column, neighbouring threads reading
// neighbouring columns (coalesced too). Softmax subtracts the row max; LayerNorm takes two passes
// (mean, then the biased variance of x - mean) before it writes.
//
// mean reduces any set of dims of any layout: one thread per output (kept dims, outermost
// first), or one warp per output when the innermost reduced dim has unit stride.
//
// Few outputs over long reductions (a squeeze-excitation mean over a channels-last image at batch
// 1, a softmax over thousands of tokens per channel) leave one thread per output with most of the
// GPU idle: a gcvit stem's SE mean took 2.2 ms over 64 channels of 112x112. The split forms
// (`mode` SPLIT, `softmax_split`) give a block of SPLIT_LANES x SPLIT_GROUPS threads SPLIT_LANES
// neighbouring outputs (the lanes: neighbouring channels in NHWC, so the loads coalesce), and its
// groups share each output's reduction, combined through shared memory.
//
// group_norm takes a (image, group) row a block, on NCHW or NHWC; for few rows (batch 1, one
// group) group_norm_partial + group_norm_split cut each row into chunks over many blocks: partial
// (count, mean, M2) per chunk into a workspace, then Chan's merge and the normalisation per chunk.
//
// matmul is a batched, broadcasting [M, K] x [K, P] product in 16x16 shared-memory tiles.

__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Every warp of the grid takes rows r = warp, warp + warps, ... (the loop is uniform per warp).
#define WARP_STRIDE(r, n)                                                                                                              \
    for (i64 r = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < (i64)(n); r += ((i64)blockDim.x * gridDim.x) >> 5)

#define SPLIT_LANES 32
#define SPLIT_GROUPS 32
#define SPLIT_BLOCK (SPLIT_LANES * SPLIT_GROUPS)
// Every block takes tiles t = block, block + blocks, ... of SPLIT_LANES outputs (uniform per block).
#define SPLIT_TILES(t, n) for (i64 t = blockIdx.x; t * SPLIT_LANES < (i64)(n); t += gridDim.x)

// The SPLIT_GROUPS partial values of each lane, combined by `op` (every thread gets its lane's);
// every thread of the block must call it.
template <typename Op> __device__ __forceinline__ float split_combine(float v, Op op) {
    __shared__ float part[SPLIT_GROUPS][SPLIT_LANES];
    const int lane = threadIdx.x % SPLIT_LANES, g = threadIdx.x / SPLIT_LANES;
    part[g][lane] = v;
    __syncthreads();
    float r = part[0][lane];
    for (int k = 1; k < SPLIT_GROUPS; ++k) r = op(r, part[k][lane]);
    __syncthreads();  // part[] is written again by the next call
    return r;
}

struct Add {
    __device__ float operator()(float a, float b) const { return a + b; }
};
struct NanMax {
    __device__ float operator()(float a, float b) const { return nan_max(a, b); }
};

// softmax along `len` for (outer, inner) columns with inner > 1, split: column q of a tile is the
// tile's lane, and group g takes rows g, g + SPLIT_GROUPS, ...: the max, the sum of exponentials,
// then the writes, as `softmax` does per column.
template <typename T> __device__ void softmax_split(const T* x, T* y, i64 outer, int len, int inner) {
    const int lane = threadIdx.x % SPLIT_LANES, g = threadIdx.x / SPLIT_LANES;
    const i64 columns = outer * inner;
    SPLIT_TILES(t, columns) {
        const i64 q = t * SPLIT_LANES + lane;
        const bool live = q < columns;
        const i64 o = live ? q / inner : 0, c = live ? q % inner : 0;
        const T* px = x + o * len * inner + c;
        T* py = y + o * len * inner + c;
        float m = neg_inf();
        if (live)
            for (int j = g; j < len; j += SPLIT_GROUPS) m = nan_max(m, to_f32(px[(i64)j * inner]));
        m = split_combine(m, NanMax());
        float s = 0.f;
        if (live)
            for (int j = g; j < len; j += SPLIT_GROUPS) s += expf(to_f32(px[(i64)j * inner]) - m);
        const float inv = 1.f / split_combine(s, Add());
        if (live)
            for (int j = g; j < len; j += SPLIT_GROUPS) py[(i64)j * inner] = from_f32<T>(expf(to_f32(px[(i64)j * inner]) - m) * inv);
    }
}

template <typename T> __device__ void softmax(const T* x, T* y, i64 outer, int len, int inner) {
    if (inner == 1) {
        const int lane = threadIdx.x & 31;
        WARP_STRIDE(r, outer) {
            const T* px = x + r * len;
            T* py = y + r * len;
            float m = neg_inf();
            for (int j = lane; j < len; j += 32) m = nan_max(m, to_f32(px[j]));
            m = warp_max(m);
            float s = 0.f;
            for (int j = lane; j < len; j += 32) s += expf(to_f32(px[j]) - m);
            const float inv = 1.f / warp_sum(s);
            for (int j = lane; j < len; j += 32) py[j] = from_f32<T>(expf(to_f32(px[j]) - m) * inv);
        }
        return;
    }
    GRID_STRIDE(i, outer * inner) {
        const i64 o = i / inner, c = i % inner;
        const T* px = x + o * len * inner + c;
        T* py = y + o * len * inner + c;
        float m = neg_inf();
        for (int j = 0; j < len; ++j) m = nan_max(m, to_f32(px[(i64)j * inner]));
        float s = 0.f;
        for (int j = 0; j < len; ++j) s += expf(to_f32(px[(i64)j * inner]) - m);
        const float inv = 1.f / s;
        for (int j = 0; j < len; ++j) py[(i64)j * inner] = from_f32<T>(expf(to_f32(px[(i64)j * inner]) - m) * inv);
    }
}

// w, b: `len` f32 values each, or null (no affine).
template <typename T> __device__ void layer_norm(const T* x, T* y, const float* w, const float* b, float eps, i64 outer, int len, int inner) {
    const float inv_len = 1.f / len;
    if (inner == 1) {
        const int lane = threadIdx.x & 31;
        WARP_STRIDE(r, outer) {
            const T* px = x + r * len;
            T* py = y + r * len;
            float s = 0.f;
            for (int j = lane; j < len; j += 32) s += to_f32(px[j]);
            const float mean = warp_sum(s) * inv_len;
            float q = 0.f;
            for (int j = lane; j < len; j += 32) {
                const float d = to_f32(px[j]) - mean;
                q += d * d;
            }
            const float rstd = rsqrtf(warp_sum(q) * inv_len + eps);
            for (int j = lane; j < len; j += 32) {
                float v = (to_f32(px[j]) - mean) * rstd;
                if (w) v = v * w[j] + b[j];
                py[j] = from_f32<T>(v);
            }
        }
        return;
    }
    GRID_STRIDE(i, outer * inner) {
        const i64 o = i / inner, c = i % inner;
        const T* px = x + o * len * inner + c;
        T* py = y + o * len * inner + c;
        float s = 0.f;
        for (int j = 0; j < len; ++j) s += to_f32(px[(i64)j * inner]);
        const float mean = s * inv_len;
        float q = 0.f;
        for (int j = 0; j < len; ++j) {
            const float d = to_f32(px[(i64)j * inner]) - mean;
            q += d * d;
        }
        const float rstd = rsqrtf(q * inv_len + eps);
        for (int j = 0; j < len; ++j) {
            float v = (to_f32(px[(i64)j * inner]) - mean) * rstd;
            if (w) v = v * w[j] + b[j];
            py[(i64)j * inner] = from_f32<T>(v);
        }
    }
}

// LayerNorm over contiguous rows held in registers: one read and one write of each element
// (layer_norm's row path above reads a row three times, in 2- or 4-byte loads). A group of G lanes
// (a power of two, G <= 32) takes a row of `len` elements as len / 16-byte packs, pack p in lane
// p % G, at most LN_PACKS packs a lane; the warp takes 32 / G rows at a time, so ConvNeXt's
// 96-channel rows keep every lane busy (G = 4, three packs each). Mean, then the biased variance
// of x - mean, from the registers, in f32. The host offers it where len is a multiple of the pack
// and len / pack <= 32 * LN_PACKS; rows must start 16-byte aligned (else the row path runs).
#define LN_PACKS 4
template <typename T>
__device__ void layer_norm_packed(const T* x, T* y, const float* w, const float* b, float eps, i64 rows, int len, int G) {
    typedef Pack<T> P;
    const int packs = len / P::N;
    if (!aligned16(x) || !aligned16(y) || packs * P::N != len || packs > G * LN_PACKS) {
        layer_norm<T>(x, y, w, b, eps, rows, len, 1);
        return;
    }
    const int lane = threadIdx.x & 31, sub = lane / G, g = lane % G, per_warp = 32 / G;
    const float inv_len = 1.f / len;
    const i64 warp0 = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5, warps = ((i64)blockDim.x * gridDim.x) >> 5;
    // Uniform per warp: every lane shuffles, rows past the end compute on zeros and store nothing.
    for (i64 base = warp0 * per_warp; base < rows; base += warps * per_warp) {
        const i64 r = base + sub;
        const bool live = r < rows;
        float v[LN_PACKS][P::N];
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < LN_PACKS; ++k) {
            const int p = g + k * G;
            P q;
            q.u = make_uint4(0, 0, 0, 0);
            if (live && p < packs) q = load_pack(x + r * len + p * P::N);
#pragma unroll
            for (int e = 0; e < P::N; ++e) {
                v[k][e] = to_f32(q.e[e]);
                s += v[k][e];
            }
        }
        for (int o = G / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const float mean = s * inv_len;
        float q2 = 0.f;
#pragma unroll
        for (int k = 0; k < LN_PACKS; ++k) {
            if (g + k * G < packs) {
#pragma unroll
                for (int e = 0; e < P::N; ++e) {
                    const float d = v[k][e] - mean;
                    q2 += d * d;
                }
            }
        }
        for (int o = G / 2; o > 0; o >>= 1) q2 += __shfl_xor_sync(0xffffffffu, q2, o);
        const float rstd = rsqrtf(q2 * inv_len + eps);
        if (!live) continue;
#pragma unroll
        for (int k = 0; k < LN_PACKS; ++k) {
            const int p = g + k * G;
            if (p >= packs) continue;
            const int j0 = p * P::N;
            P out;
#pragma unroll
            for (int e = 0; e < P::N; ++e) {
                float t = (v[k][e] - mean) * rstd;
                if (w) t = t * w[j0 + e] + b[j0 + e];
                out.e[e] = from_f32<T>(t);
            }
            store_pack(y + r * len + j0, out);
        }
    }
}

// meta: kept sizes [kept], kept strides in x [kept], reduced sizes [red], reduced strides [red],
// x's batch stride. Outputs are enumerated in the kept dims' order (innermost last), then the
// batch. The last reduced dim is the innermost loop (the converter puts the smallest stride last).
// The walk of `mean` and `reduce_max`: output i's first element, and the reduced elements as
// `outer` runs of `last` (the last reduced dim, innermost); a warp shares an output when `warp`.
struct ReduceWalk {
    const i64 *meta, *rsize, *rstride;
    int kept, red;
    i64 batch_stride, last, last_stride, outer;
    __device__ ReduceWalk(const i64* m, int k, int r) : meta(m), rsize(m + 2 * k), rstride(m + 2 * k + r), kept(k), red(r) {
        batch_stride = rstride[red];
        last = red > 0 ? rsize[red - 1] : 1;
        last_stride = red > 0 ? rstride[red - 1] : 0;
        outer = 1;
        for (int d = 0; d + 1 < red; ++d) outer *= rsize[d];
    }
    // Output i's offset in x (kept dims, then the batch).
    __device__ i64 base(i64 i) const {
        i64 off = 0;
        for (int d = kept - 1; d >= 0; --d) {
            off += (i % meta[d]) * meta[kept + d];
            i /= meta[d];
        }
        return off + i * batch_stride;
    }
    // The offset of run ro (over the reduced dims but the last) from `base`.
    __device__ i64 run(i64 base, i64 ro) const {
        for (int d = red - 2; d >= 0; --d) {
            base += (ro % rsize[d]) * rstride[d];
            ro /= rsize[d];
        }
        return base;
    }
};

// The modes of `mean` and `reduce_max`: one thread an output, one warp an output (the last reduced
// dim contiguous), or split (SPLIT_LANES outputs a block, SPLIT_GROUPS threads each).
#define REDUCE_THREAD 0
#define REDUCE_WARP 1
#define REDUCE_SPLIT 2

// The outputs this thread (or its warp) takes: first, stride; and its lane and step in a run.
#define REDUCE_OUTPUTS(i, n_out, warp, lane, step)                                                                                       \
    const int lane = warp ? (threadIdx.x & 31) : 0, step = warp ? 32 : 1;                                                             \
    for (i64 i = warp ? ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5 : (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n_out;    \
         i += warp ? ((i64)blockDim.x * gridDim.x) >> 5 : (i64)blockDim.x * gridDim.x)

// Split mode: `body(off, k)` for the reduced elements of output `i` that group g of SPLIT_GROUPS
// takes (element offset in x, flat index in the walk): every SPLIT_GROUPS-th run when there are at
// least as many runs as groups, else every SPLIT_GROUPS-th element of each run.
template <typename Body> __device__ __forceinline__ void split_walk(const ReduceWalk& w, i64 i, int g, Body body) {
    const i64 base = w.base(i);
    if (w.outer >= SPLIT_GROUPS) {
        for (i64 ro = g; ro < w.outer; ro += SPLIT_GROUPS) {
            const i64 off = w.run(base, ro);
            for (i64 j = 0; j < w.last; ++j) body(off + j * w.last_stride, ro * w.last + j);
        }
    } else {
        for (i64 ro = 0; ro < w.outer; ++ro) {
            const i64 off = w.run(base, ro);
            for (i64 j = g; j < w.last; j += SPLIT_GROUPS) body(off + j * w.last_stride, ro * w.last + j);
        }
    }
}

template <typename T> __device__ void mean(const T* x, T* y, i64 n_out, const i64* meta, int kept, int red, float scale, int mode) {
    const ReduceWalk w(meta, kept, red);
    if (mode == REDUCE_SPLIT) {
        const int lane = threadIdx.x % SPLIT_LANES, g = threadIdx.x / SPLIT_LANES;
        SPLIT_TILES(t, n_out) {
            const i64 i = t * SPLIT_LANES + lane;
            float acc = 0.f;
            if (i < n_out) split_walk(w, i, g, [&](i64 off, i64) { acc += to_f32(x[off]); });
            acc = split_combine(acc, Add());
            if (g == 0 && i < n_out) y[i] = from_f32<T>(acc * scale);
        }
        return;
    }
    const int warp = mode == REDUCE_WARP;
    REDUCE_OUTPUTS(i, n_out, warp, lane, step) {
        const i64 base = w.base(i);
        float acc = 0.f;
        for (i64 ro = 0; ro < w.outer; ++ro) {
            const i64 off = w.run(base, ro);
            for (i64 j = lane; j < w.last; j += step) acc += to_f32(x[off + j * w.last_stride]);
        }
        if (warp) acc = warp_sum(acc);
        if (lane == 0) y[i] = from_f32<T>(acc * scale);
    }
}

// The maximum over the reduced dims (`mean`'s meta and walk), or with `arg` its flat index in the
// walk (the index along the one reduced dim of argmax): the first maximum, NaN counting as the
// largest (the first NaN), as PyTorch's amax and argmax.
__device__ __forceinline__ bool better(float v, i64 k, float best, i64 at) {
    if (v != v) return best == best || k < at;
    return v > best || (v == best && k < at);
}

template <typename T> __device__ void reduce_max(const T* x, T* y, i64 n_out, const i64* meta, int kept, int red, int arg, int mode) {
    const ReduceWalk w(meta, kept, red);
    if (mode == REDUCE_SPLIT) {
        __shared__ float part_v[SPLIT_GROUPS][SPLIT_LANES];
        __shared__ i64 part_at[SPLIT_GROUPS][SPLIT_LANES];
        const int lane = threadIdx.x % SPLIT_LANES, g = threadIdx.x / SPLIT_LANES;
        SPLIT_TILES(t, n_out) {
            const i64 i = t * SPLIT_LANES + lane;
            float best = neg_inf();
            i64 at = 0x7fffffffffffffffLL;
            if (i < n_out)
                split_walk(w, i, g, [&](i64 off, i64 k) {
                    const float v = to_f32(x[off]);
                    if (better(v, k, best, at)) {
                        best = v;
                        at = k;
                    }
                });
            part_v[g][lane] = best;
            part_at[g][lane] = at;
            __syncthreads();
            if (g == 0 && i < n_out) {
                for (int k = 1; k < SPLIT_GROUPS; ++k)
                    if (better(part_v[k][lane], part_at[k][lane], best, at)) {
                        best = part_v[k][lane];
                        at = part_at[k][lane];
                    }
                y[i] = from_f32<T>(arg ? (float)at : best);
            }
            __syncthreads();  // part_* are written again by the next tile
        }
        return;
    }
    const int warp = mode == REDUCE_WARP;
    REDUCE_OUTPUTS(i, n_out, warp, lane, step) {
        const i64 base = w.base(i);
        float best = neg_inf();
        i64 at = 0x7fffffffffffffffLL;
        for (i64 ro = 0; ro < w.outer; ++ro) {
            const i64 off = w.run(base, ro);
            for (i64 j = lane; j < w.last; j += step) {
                const float v = to_f32(x[off + j * w.last_stride]);
                if (better(v, ro * w.last + j, best, at)) {
                    best = v;
                    at = ro * w.last + j;
                }
            }
        }
        if (warp) {
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, best, o);
                const i64 oa = __shfl_xor_sync(0xffffffffu, at, o);
                if (better(ov, oa, best, at)) {
                    best = ov;
                    at = oa;
                }
            }
        }
        if (lane == 0) y[i] = from_f32<T>(arg ? (float)at : best);
    }
}

// y[z] = a[z] @ b[z] for z < nbatch: a is [M, K], b is [K, P], y is [M, P], all row-major.
// meta: the batch dims' sizes [nb] (per image, outermost first), a's strides [nb], b's strides
// [nb] (0 where it broadcasts); z decomposes over them, what remains is the image, whose strides
// are a_batch and b_batch (0 for a weight). Output batches are contiguous.
#define MM_TILE 16
template <typename T>
__device__ void matmul(const T* a, const T* b, T* y, int M, int K, int P, i64 nbatch, const i64* meta, int nb, i64 a_batch, i64 b_batch) {
    __shared__ float as[MM_TILE][MM_TILE + 1];
    __shared__ float bs[MM_TILE][MM_TILE + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * MM_TILE + ty, col = blockIdx.x * MM_TILE + tx;
    for (i64 z = blockIdx.z; z < nbatch; z += gridDim.z) {
        i64 rem = z, ao = 0, bo = 0;
        for (int d = nb - 1; d >= 0; --d) {
            const i64 idx = rem % meta[d];
            rem /= meta[d];
            ao += idx * meta[nb + d];
            bo += idx * meta[2 * nb + d];
        }
        ao += rem * a_batch;
        bo += rem * b_batch;
        float acc = 0.f;
        for (int k0 = 0; k0 < K; k0 += MM_TILE) {
            as[ty][tx] = (row < M && k0 + tx < K) ? to_f32(a[ao + (i64)row * K + k0 + tx]) : 0.f;
            bs[ty][tx] = (k0 + ty < K && col < P) ? to_f32(b[bo + (i64)(k0 + ty) * P + col]) : 0.f;
            __syncthreads();
#pragma unroll
            for (int k = 0; k < MM_TILE; ++k) acc += as[ty][k] * bs[k][tx];
            __syncthreads();
        }
        if (row < M && col < P) y[z * M * P + (i64)row * P + col] = from_f32<T>(acc);
    }
}

// The sum of v over the block (every thread gets it); every thread of the block must call it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // part[] may still be read by the previous call
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = threadIdx.x < warps ? part[threadIdx.x] : 0.f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) part[0] = v;
    __syncthreads();
    return part[0];
}

// GroupNorm: row r is image r / groups, group r % groups: cpg channels x hw positions, len =
// cpg·hw elements. NCHW (nhwc = 0): the row is contiguous, element j at r·len + j (channel
// j / hw). NHWC (nhwc = 1): element j = p·cpg + k (position p, channel g·cpg + k) at
// n·C·hw + p·C + g·cpg + k, so a group is cpg consecutive channels of every pixel, and with
// groups = 1 the whole image is contiguous again. Statistics in f32: mean, then the biased
// variance of x - mean, then the per-channel affine on the way out.
struct GnRow {
    i64 base;
    int cpg, hw, C, c0, nhwc;
    __device__ GnRow(i64 r, int groups, int cpg_, int hw_, int nhwc_) : cpg(cpg_), hw(hw_), nhwc(nhwc_) {
        C = groups * cpg;
        c0 = (int)(r % groups) * cpg;
        base = nhwc ? (r / groups) * (i64)C * hw + c0 : r * (i64)cpg * hw;
    }
    __device__ __forceinline__ i64 at(int j) const { return base + (nhwc ? (i64)(j / cpg) * C + j % cpg : (i64)j); }
    __device__ __forceinline__ int channel(int j) const { return c0 + (nhwc ? j % cpg : j / hw); }
};

// Element j of a row normalised, with the per-channel affine (w, b: C values or null).
template <typename T>
__device__ __forceinline__ void gn_write(const T* x, T* y, const float* w, const float* b, const GnRow& row, int j, float mean, float rstd) {
    const i64 o = row.at(j);
    float v = (to_f32(x[o]) - mean) * rstd;
    if (w) {
        const int c = row.channel(j);
        v = v * w[c] + b[c];
    }
    y[o] = from_f32<T>(v);
}

// One block a row (the loop is uniform per block); w, b: C values or null.
template <typename T>
__device__ void group_norm(const T* x, T* y, const float* w, const float* b, float eps, i64 rows, int groups, int cpg, int hw, int nhwc) {
    const int len = cpg * hw;
    const float inv_len = 1.f / len;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const GnRow row(r, groups, cpg, hw, nhwc);
        float s = 0.f;
        for (int j = threadIdx.x; j < len; j += blockDim.x) s += to_f32(x[row.at(j)]);
        const float mean = block_sum(s) * inv_len;
        float q = 0.f;
        for (int j = threadIdx.x; j < len; j += blockDim.x) {
            const float d = to_f32(x[row.at(j)]) - mean;
            q += d * d;
        }
        const float rstd = 1.f / sqrtf(block_sum(q) * inv_len + eps);
        for (int j = threadIdx.x; j < len; j += blockDim.x) gn_write(x, y, w, b, row, j, mean, rstd);
    }
}

// The split GroupNorm, for few rows (batch 1, groups = 1: one block would do a whole image):
// each row is cut into `parts` chunks of ceil(len / parts) consecutive elements of the row, and a
// tile t = r·parts + s is chunk s of row r. group_norm_partial gives each tile a block that takes
// its chunk's count, mean and M2 (the sum of squared deviations from that mean: two passes over
// the chunk, the second from L1/L2) into part[3t ..]. group_norm_split then gives each tile a
// block again: its first warp merges the row's `parts` partials by Chan's formula (lanes merge a
// strided share, then a shuffle tree), which loses nothing to the cancellation of a sum of
// squares, and the block normalises and applies the affine to its chunk.
__device__ __forceinline__ void chan_merge(float& n, float& m, float& q, float nb, float mb, float qb) {
    if (nb == 0.f) return;
    const float t = n + nb, d = mb - m;
    m += d * (nb / t);
    q += qb + d * d * (n * (nb / t));
    n = t;
}

template <typename T>
__device__ void group_norm_partial(const T* x, float* part, i64 rows, int groups, int cpg, int hw, int nhwc, int parts) {
    const int len = cpg * hw, chunk = (len + parts - 1) / parts;
    for (i64 t = blockIdx.x; t < rows * parts; t += gridDim.x) {
        const i64 r = t / parts;
        const int j0 = (int)(t % parts) * chunk, j1 = min(len, j0 + chunk);
        const int n = max(0, j1 - j0);
        const GnRow row(r, groups, cpg, hw, nhwc);
        float s = 0.f;
        for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) s += to_f32(x[row.at(j)]);
        s = block_sum(s);
        const float mean = n ? s / n : 0.f;
        float q = 0.f;
        for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
            const float d = to_f32(x[row.at(j)]) - mean;
            q += d * d;
        }
        q = block_sum(q);
        if (threadIdx.x == 0) {
            part[3 * t] = (float)n;
            part[3 * t + 1] = mean;
            part[3 * t + 2] = q;
        }
    }
}

template <typename T>
__device__ void group_norm_split(const T* x, T* y, const float* w, const float* b, const float* part, float eps, i64 rows, int groups,
                                 int cpg, int hw, int nhwc, int parts) {
    __shared__ float stats[2];
    const int len = cpg * hw, chunk = (len + parts - 1) / parts;
    for (i64 t = blockIdx.x; t < rows * parts; t += gridDim.x) {
        const i64 r = t / parts;
        if (threadIdx.x < 32) {
            const float* pr = part + 3 * r * parts;
            float n = 0.f, m = 0.f, q = 0.f;
            for (int s = threadIdx.x; s < parts; s += 32) chan_merge(n, m, q, pr[3 * s], pr[3 * s + 1], pr[3 * s + 2]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float nb = __shfl_xor_sync(0xffffffffu, n, o), mb = __shfl_xor_sync(0xffffffffu, m, o),
                            qb = __shfl_xor_sync(0xffffffffu, q, o);
                chan_merge(n, m, q, nb, mb, qb);
            }
            if (threadIdx.x == 0) {
                stats[0] = m;
                stats[1] = 1.f / sqrtf(q / len + eps);
            }
        }
        __syncthreads();
        const float mean = stats[0], rstd = stats[1];
        const GnRow row(r, groups, cpg, hw, nhwc);
        const int j0 = (int)(t % parts) * chunk, j1 = min(len, j0 + chunk);
        for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) gn_write(x, y, w, b, row, j, mean, rstd);
        __syncthreads();  // stats[] is rewritten by the next tile
    }
}

#define NORM(T, S)                                                                                                                    \
    extern "C" __global__ void softmax_##S(const T* x, T* y, i64 outer, int len, int inner) { softmax<T>(x, y, outer, len, inner); } \
    extern "C" __global__ void __launch_bounds__(SPLIT_BLOCK) softmax_split_##S(const T* x, T* y, i64 outer, int len, int inner) {   \
        softmax_split<T>(x, y, outer, len, inner);                                                                                  \
    }                                                                                                                               \
    extern "C" __global__ void layer_norm_##S(const T* x, T* y, const float* w, const float* b, float eps, i64 outer, int len,       \
                                              int inner) {                                                                          \
        layer_norm<T>(x, y, w, b, eps, outer, len, inner);                                                                          \
    }                                                                                                                               \
    extern "C" __global__ void layer_norm_packed_##S(const T* x, T* y, const float* w, const float* b, float eps, i64 rows, int len,  \
                                                     int G) {                                                                       \
        layer_norm_packed<T>(x, y, w, b, eps, rows, len, G);                                                                        \
    }                                                                                                                               \
    extern "C" __global__ void group_norm_##S(const T* x, T* y, const float* w, const float* b, float eps, i64 rows, int groups, int cpg,  \
                                              int hw, int nhwc) {                                                                          \
        group_norm<T>(x, y, w, b, eps, rows, groups, cpg, hw, nhwc);                                                                       \
    }                                                                                                                                     \
    extern "C" __global__ void group_norm_partial_##S(const T* x, float* part, i64 rows, int groups, int cpg, int hw, int nhwc,           \
                                                      int parts) {                                                                        \
        group_norm_partial<T>(x, part, rows, groups, cpg, hw, nhwc, parts);                                                                \
    }                                                                                                                                     \
    extern "C" __global__ void group_norm_split_##S(const T* x, T* y, const float* w, const float* b, const float* part, float eps,       \
                                                    i64 rows, int groups, int cpg, int hw, int nhwc, int parts) {                         \
        group_norm_split<T>(x, y, w, b, part, eps, rows, groups, cpg, hw, nhwc, parts);                                                    \
    }                                                                                                                                     \
    extern "C" __global__ void __launch_bounds__(SPLIT_BLOCK) reduce_max_##S(const T* x, T* y, i64 n_out, const i64* meta, int kept, int red, int arg, int mode) { \
        reduce_max<T>(x, y, n_out, meta, kept, red, arg, mode);                                                                     \
    }                                                                                                                               \
    extern "C" __global__ void __launch_bounds__(SPLIT_BLOCK) mean_##S(const T* x, T* y, i64 n_out, const i64* meta, int kept, int red, float scale, int mode) {    \
        mean<T>(x, y, n_out, meta, kept, red, scale, mode);                                                                         \
    }                                                                                                                               \
    extern "C" __global__ void matmul_##S(const T* a, const T* b, T* y, int M, int K, int P, i64 nbatch, const i64* meta, int nb,   \
                                          i64 a_batch, i64 b_batch) {                                                               \
        matmul<T>(a, b, y, M, K, P, nbatch, meta, nb, a_batch, b_batch);                                                            \
    }

NORM(float, f32)
NORM(f16, f16)
