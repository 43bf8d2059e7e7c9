// Concat family: `cat` along channels of NHWC maps. One launch per input copies it into its
// channel slice [offset, offset + Cin) of every output row; rows = N*H*W.

template <typename T> __device__ void concat_channels(const T* x, T* y, i64 rows, int Cin, int Cout, int offset) {
    typedef Pack<T> P;
    if (Cin % P::N == 0 && Cout % P::N == 0 && offset % P::N == 0 && aligned16(x) && aligned16(y)) {
        const int packs = Cin / P::N;
        GRID_STRIDE(i, rows * packs) {
            const i64 r = i / packs;
            const int c = (int)(i % packs) * P::N;
            store_pack(y + r * Cout + offset + c, load_pack(x + r * Cin + c));
        }
        return;
    }
    GRID_STRIDE(i, rows * Cin) {
        const i64 r = i / Cin;
        y[r * Cout + offset + i % Cin] = x[i];
    }
}

#define CONCAT(T, S)                                                                                 \
    extern "C" __global__ void concat_channels_##S(const T* x, T* y, i64 rows, int Cin, int Cout, int offset) { \
        concat_channels<T>(x, y, rows, Cin, Cout, offset);                                           \
    }

CONCAT(float, f32)
CONCAT(f16, f16)
