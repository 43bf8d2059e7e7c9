// Shape family: the strided copies of slice, pad, permute (gathers) and cat (scatters), in any
// layout. `meta` describes the dims of the side that is walked linearly (outermost first, in that
// value's physical order); the batch index is what remains of the linear index. Same element
// type in and out; one thread per element; 64-bit index arithmetic.

// Gather: y (n elements, its own physical order) from x. For each of y's dims: size, x's stride,
// padding before (the x index is the y index minus it), x's size (outside it y gets `fill`);
// then x's element offset and x's batch stride.
template <typename T> __device__ void shape_gather(const T* x, T* y, i64 n, const i64* meta, int rank, float fill) {
    const i64* size = meta;
    const i64* stride = meta + rank;
    const i64* before = meta + 2 * rank;
    const i64* bound = meta + 3 * rank;
    const i64 offset = meta[4 * rank];
    const i64 batch_stride = meta[4 * rank + 1];
    const T pad = from_f32<T>(fill);
    GRID_STRIDE(i, n) {
        i64 rem = i, off = offset;
        bool inside = true;
        for (int d = rank - 1; d >= 0; --d) {
            const i64 idx = rem % size[d] - before[d];
            rem /= size[d];
            inside = inside && idx >= 0 && idx < bound[d];
            off += idx * stride[d];
        }
        y[i] = inside ? x[off + rem * batch_stride] : pad;
    }
}

// Scatter: all of x (n elements, its own physical order) into y. For each of x's dims: size,
// y's stride; then y's element offset and y's batch stride.
template <typename T> __device__ void shape_scatter(const T* x, T* y, i64 n, const i64* meta, int rank) {
    const i64* size = meta;
    const i64* stride = meta + rank;
    const i64 offset = meta[2 * rank];
    const i64 batch_stride = meta[2 * rank + 1];
    GRID_STRIDE(i, n) {
        i64 rem = i, off = offset;
        for (int d = rank - 1; d >= 0; --d) {
            off += (rem % size[d]) * stride[d];
            rem /= size[d];
        }
        y[off + rem * batch_stride] = x[i];
    }
}

#define SHAPE(T, S)                                                                                              \
    extern "C" __global__ void shape_gather_##S(const T* x, T* y, i64 n, const i64* meta, int rank, float fill) { \
        shape_gather<T>(x, y, n, meta, rank, fill);                                                              \
    }                                                                                                            \
    extern "C" __global__ void shape_scatter_##S(const T* x, T* y, i64 n, const i64* meta, int rank) {           \
        shape_scatter<T>(x, y, n, meta, rank);                                                                   \
    }

SHAPE(float, f32)
SHAPE(f16, f16)

// Roll (torch.roll): y and x share one layout; y's element at index i along each dim reads x's at
// (i - shift) mod size. `meta`: each dim's size, then its shift in [0, size), in physical order.
template <typename T> __device__ void shape_roll(const T* x, T* y, i64 n, const i64* meta, int rank) {
    const i64* size = meta;
    const i64* shift = meta + rank;
    GRID_STRIDE(i, n) {
        i64 rem = i, off = 0, stride = 1;
        for (int d = rank - 1; d >= 0; --d) {
            const i64 idx = rem % size[d];
            rem /= size[d];
            i64 src = idx - shift[d];
            if (src < 0) src += size[d];
            off += src * stride;
            stride *= size[d];
        }
        y[i] = x[off + rem * stride];
    }
}

#define ROLL(T, S)                                                                                     \
    extern "C" __global__ void shape_roll_##S(const T* x, T* y, i64 n, const i64* meta, int rank) { \
        shape_roll<T>(x, y, n, meta, rank);                                                         \
    }

ROLL(float, f32)
ROLL(f16, f16)
