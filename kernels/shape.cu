// Shape family: the strided copies of slice, pad, permute (gathers), cat (scatters) and roll, in
// any layout. `meta` describes the dims of the side that is walked linearly (outermost first, in
// that value's physical order), after the host merged the dims that stay contiguous on both sides
// (src/engine/strided.rs).
//
// Grid: (blocks, images); each block strides over one image's `n` units. Index arithmetic inside
// an image is 32-bit (the host checks that an image's elements fit), which is what makes these
// copies run near memory speed: 64-bit division per dim per element made them compute-bound.
// `T` is an element (f32, f16) or, where the innermost dim is contiguous on both sides and every
// offset a multiple of 16 bytes, a 16-byte unit (`uint4`) of them: the `_v16` entry points.
#define SHAPE_MAX_RANK 8

// The meta (`count` i64 values, all < 2^32: the host checks) into shared memory as u32.
__device__ __forceinline__ void load_meta(unsigned* m, const i64* meta, int count) {
    for (int i = threadIdx.x; i < count; i += blockDim.x) m[i] = (unsigned)meta[i];
    __syncthreads();
}

// Gather: y (n units per image, its own physical order) from x. For each of y's dims: size, x's
// stride, padding before (the x index is the y index minus it), x's size (outside it y gets
// `pad`); then x's unit offset and x's units per image.
template <typename T> __device__ void shape_gather(const T* x, T* y, unsigned n, const i64* meta, int rank, T pad) {
    __shared__ unsigned m[4 * SHAPE_MAX_RANK + 2];
    load_meta(m, meta, 4 * rank + 2);
    const unsigned *size = m, *stride = m + rank, *before = m + 2 * rank, *bound = m + 3 * rank;
    const T* xi = x + (i64)blockIdx.y * m[4 * rank + 1];
    T* yi = y + (i64)blockIdx.y * n;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        unsigned rem = i, off = m[4 * rank];
        bool inside = true;
        for (int d = rank - 1; d >= 0; --d) {
            const unsigned q = rem / size[d];
            // Unsigned: an index before the padding wraps to a huge value, which fails the bound.
            const unsigned idx = rem - q * size[d] - before[d];
            rem = q;
            inside = inside && idx < bound[d];
            off += idx * stride[d];
        }
        yi[i] = inside ? xi[off] : pad;
    }
}

// Scatter: all of x (n units per image, its own physical order) into y. For each of x's dims:
// size, y's stride; then y's unit offset and y's units per image.
template <typename T> __device__ void shape_scatter(const T* x, T* y, unsigned n, const i64* meta, int rank) {
    __shared__ unsigned m[2 * SHAPE_MAX_RANK + 2];
    load_meta(m, meta, 2 * rank + 2);
    const unsigned *size = m, *stride = m + rank;
    const T* xi = x + (i64)blockIdx.y * n;
    T* yi = y + (i64)blockIdx.y * m[2 * rank + 1];
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        unsigned rem = i, off = m[2 * rank];
        for (int d = rank - 1; d >= 0; --d) {
            const unsigned q = rem / size[d];
            off += (rem - q * size[d]) * stride[d];
            rem = q;
        }
        yi[off] = xi[i];
    }
}

// Roll (torch.roll): y and x share one layout; y's unit at index i along each dim reads x's at
// (i - shift) mod size. `meta`: each dim's size, then its shift in [0, size), in physical order.
template <typename T> __device__ void shape_roll(const T* x, T* y, unsigned n, const i64* meta, int rank) {
    __shared__ unsigned m[2 * SHAPE_MAX_RANK];
    load_meta(m, meta, 2 * rank);
    const unsigned *size = m, *shift = m + rank;
    const T* xi = x + (i64)blockIdx.y * n;
    T* yi = y + (i64)blockIdx.y * n;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        unsigned rem = i, off = 0, stride = 1;
        for (int d = rank - 1; d >= 0; --d) {
            const unsigned q = rem / size[d];
            const unsigned idx = rem - q * size[d];
            rem = q;
            off += (idx >= shift[d] ? idx - shift[d] : idx + size[d] - shift[d]) * stride;
            stride *= size[d];
        }
        yi[i] = xi[off];
    }
}

// Reflect or replicate padding (F.pad's modes) over contiguous per-image dims; n is the output's
// elements in all (every image). `meta`: the output's sizes, the input's sizes, the pads before,
// the input's strides (rank values each), then the output's and the input's elements per image.
template <typename T> __device__ void shape_pad_edge(const T* x, T* y, i64 n, const i64* meta, int rank, int reflect) {
    const i64 *ys = meta, *xs = meta + rank, *before = meta + 2 * rank, *stride = meta + 3 * rank;
    const i64 per_y = meta[4 * rank], per_x = meta[4 * rank + 1];
    GRID_STRIDE(i, n) {
        const i64 img = i / per_y;
        i64 rem = i - img * per_y, off = img * per_x;
        for (int d = rank - 1; d >= 0; --d) {
            const i64 q = rem / ys[d];
            i64 j = rem - q * ys[d] - before[d];
            rem = q;
            const i64 last = xs[d] - 1;
            if (j < 0) j = reflect ? -j : 0;
            else if (j > last) j = reflect ? 2 * last - j : last;
            off += j * stride[d];
        }
        y[i] = x[off];
    }
}

#define SHAPE(T, S)                                                                                                  \
    extern "C" __global__ void shape_gather_##S(const T* x, T* y, unsigned n, const i64* meta, int rank, float fill) { \
        shape_gather<T>(x, y, n, meta, rank, from_f32<T>(fill));                                                     \
    }                                                                                                                \
    extern "C" __global__ void shape_gather_v16_##S(const uint4* x, uint4* y, unsigned n, const i64* meta, int rank,  \
                                                    float fill) {                                                    \
        Pack<T> pad;                                                                                                 \
        for (int e = 0; e < Pack<T>::N; ++e) pad.e[e] = from_f32<T>(fill);                                           \
        shape_gather<uint4>(x, y, n, meta, rank, pad.u);                                                             \
    }                                                                                                                \
    extern "C" __global__ void shape_scatter_##S(const T* x, T* y, unsigned n, const i64* meta, int rank) {          \
        shape_scatter<T>(x, y, n, meta, rank);                                                                       \
    }                                                                                                                \
    extern "C" __global__ void shape_roll_##S(const T* x, T* y, unsigned n, const i64* meta, int rank) {             \
        shape_roll<T>(x, y, n, meta, rank);                                                                          \
    }                                                                                                                \
    extern "C" __global__ void shape_pad_edge_##S(const T* x, T* y, i64 n, const i64* meta, int rank, int reflect) { \
        shape_pad_edge<T>(x, y, n, meta, rank, reflect);                                                             \
    }

SHAPE(float, f32)
SHAPE(f16, f16)

// 16-byte units need no element type where nothing is filled.
extern "C" __global__ void shape_scatter_v16(const uint4* x, uint4* y, unsigned n, const i64* meta, int rank) {
    shape_scatter<uint4>(x, y, n, meta, rank);
}
extern "C" __global__ void shape_roll_v16(const uint4* x, uint4* y, unsigned n, const i64* meta, int rank) {
    shape_roll<uint4>(x, y, n, meta, rank);
}
