// Permute family: the engine's general reformat. Copies a value into another memory order (and
// element type): y is written in its own physical order; for each of its rank dims (outermost
// first) `meta` holds the size, then the element stride of that dim in x, then x's batch stride.
// One thread per output element; the index arithmetic is 64-bit.

template <typename TI, typename TO> __device__ void permute(const TI* x, TO* y, i64 n, const i64* meta, int rank) {
    const i64* size = meta;
    const i64* stride = meta + rank;
    const i64 batch_stride = meta[2 * rank];
    GRID_STRIDE(i, n) {
        i64 rem = i, off = 0;
        for (int d = rank - 1; d >= 0; --d) {
            const i64 idx = rem % size[d];
            rem /= size[d];
            off += idx * stride[d];
        }
        y[i] = from_f32<TO>(to_f32(x[off + rem * batch_stride]));
    }
}

#define PERMUTE(TI, SI, TO, SO)                                                                                 \
    extern "C" __global__ void permute_##SI##_##SO(const TI* x, TO* y, i64 n, const i64* meta, int rank) { \
        permute<TI, TO>(x, y, n, meta, rank);                                                               \
    }

PERMUTE(float, f32, float, f32)
PERMUTE(float, f32, f16, f16)
PERMUTE(f16, f16, float, f32)
PERMUTE(f16, f16, f16, f16)
// From an input binding declared u8 into another layout.
PERMUTE(unsigned char, u8, float, f32)
PERMUTE(unsigned char, u8, f16, f16)
