// Channel padding for the engine's convolutions (src/engine/cudnn.rs): NHWC with C channels to
// NHWC with CP >= C channels, zeros after C. cuDNN's tensor-core kernels want C % 8 == 0 in FP16,
// so a 3-channel stem runs far faster on 8 channels (zero weights for the extra ones) even with
// this extra pass. Written for the tiny C of image inputs: one thread per pixel.

// A padded pixel of exactly 16 bytes (8 halves, 4 floats) is built in registers and written with
// one vector store: scalar 2-byte stores at a 16-byte stride waste most of each write transaction.
template <typename T> __device__ void pad_channels(const T* x, T* y, i64 pixels, int c, int cp) {
    const bool vec = cp == Pack<T>::N && aligned16(y);
    GRID_STRIDE(p, pixels) {
        const T* src = x + p * c;
        T* dst = y + p * cp;
        if (vec) {
            Pack<T> pk;
#pragma unroll
            for (int k = 0; k < Pack<T>::N; ++k) pk.e[k] = k < c ? src[k] : from_f32<T>(0.f);
            store_pack(dst, pk);
        } else {
            for (int k = 0; k < cp; ++k) dst[k] = k < c ? src[k] : from_f32<T>(0.f);
        }
    }
}

extern "C" __global__ void pad_channels_f32(const float* x, float* y, i64 pixels, int c, int cp) { pad_channels(x, y, pixels, c, cp); }
extern "C" __global__ void pad_channels_f16(const f16* x, f16* y, i64 pixels, int c, int cp) { pad_channels(x, y, pixels, c, cp); }
