// Hopper (sm_90a) building blocks, prepended after kernels/common.cuh to every Hopper-native
// family (`engine::kernels::HOPPER`, compiled for `sm_90a`): mbarriers, the tensor-memory
// accelerator's tiled loads and stores (TMA), wgmma's shared-memory descriptors and its
// asynchronous MMAs, the async-proxy fence and register reallocation between warpgroups. Written
// for the GEMM in
// hopper_gemm.cu and used by the 8-bit implicit-GEMM convolution (conv8_hopper.cu) too, whose
// 8-bit MMAs are the `wgmma_m64n*k32_s8` / `_e4m3` wrappers at the end.
//
// Pipeline convention (what hopper_gemm.cu does, and what a new kernel should copy):
// - a ring of STAGES shared-memory stages, each guarded by a `full` barrier (count 1, plus the
//   bytes its TMA loads bring) and an `empty` barrier (one arrive per consumer warp);
// - the producer waits `empty[s]` with parity `phase ^ 1` (a fresh barrier counts as having
//   completed the phase before its first, so the first lap does not wait), expects the bytes
//   on `full[s]` and issues the loads; consumers wait `full[s]` with parity `phase`, run their
//   wgmmas and arrive on `empty[s]` once `wgmma_wait` says the stage's MMAs have read it.
// - shared-memory tiles loaded with 128-byte swizzle are 1024-byte aligned, rows of 128 bytes
//   (64 halves): the layout `wgmma_desc_k128` describes.

// `CUtensorMap` of cuda.h (NVRTC has no cuda.h): 128 opaque bytes, 64-byte aligned, encoded on
// the host by `cuTensorMapEncodeTiled` and passed by value as a `const __grid_constant__` kernel
// parameter, so the TMA unit reads it from parameter space.
struct __align__(64) TensorMap {
    u64 opaque[16];
};

// ---- mbarrier (shared-memory transaction barriers)

__device__ __forceinline__ void mbar_init(u64* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Makes initialised barriers visible to the other threads and to the async proxy (TMA). Call once
// after the inits, before the __syncthreads that publishes them.
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// One arrival that also announces `bytes` of transactions (the TMA loads that complete them).
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

// The barrier ops also take the barrier's shared-window address (`smem_u32`), so that a loop
// over a ring of barriers adds a constant stride instead of converting a generic pointer each time.
__device__ __forceinline__ void mbar_arrive(unsigned addr) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(addr) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) { mbar_arrive(smem_u32(bar)); }

// Spins until the phase of parity `parity` has completed (try_wait suspends the thread for a
// while inside each try, so the loop is not a busy spin).
__device__ __forceinline__ void mbar_wait(unsigned addr, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(addr), "r"(parity)
                     : "memory");
    } while (!done);
}
__device__ __forceinline__ void mbar_wait(u64* bar, unsigned parity) { mbar_wait(smem_u32(bar), parity); }

// ---- TMA (cp.async.bulk.tensor): tiled loads global → shared, completing on an mbarrier

// Brings the descriptor into the cache before its first use (optional, one thread).
__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// The box of `map` whose first element is at (inner, outer) (elements; inner is the contiguous
// dim) into shared memory at `dst`, counted on `bar` as the box's bytes. Elements outside the
// tensor are filled with zeros (and still counted).
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap* map, u64* bar, int inner, int outer) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
                     smem_u32(dst)),
                 "l"(reinterpret_cast<u64>(map)), "r"(smem_u32(bar)), "r"(inner), "r"(outer)
                 : "memory");
}

// The same for a 3-D (4-D) tensor map: the box whose first element is at (c0, c1, c2[, c3]), c0
// the contiguous dim. Coordinates may be negative or past the end: what lies outside is zeros.
// A map encoded with traversal strides (`elementStrides`) takes every stride-th element of its
// box along that dim, so the box brings box / stride elements there.
__device__ __forceinline__ void tma_load_3d(void* dst, const TensorMap* map, u64* bar, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(
                     smem_u32(dst)),
                 "l"(reinterpret_cast<u64>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap* map, u64* bar, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(
                     smem_u32(dst)),
                 "l"(reinterpret_cast<u64>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}

// ---- TMA stores (cp.async.bulk.tensor): tiled stores shared → global, in bulk groups
// The box of `map` whose first element is at (c0, c1[, c2, c3]) from shared memory at `src`
// (laid out and swizzled as a load of the same box would leave it). Elements outside the tensor
// are not written. Write `src` before with ordinary stores, then `fence_proxy_async` and a
// barrier, then one thread stores; it commits the group and waits before `src` is written again.
__device__ __forceinline__ void tma_store_2d(const TensorMap* map, const void* src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(reinterpret_cast<u64>(map)),
                 "r"(smem_u32(src)), "r"(c0), "r"(c1)
                 : "memory");
}
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, const void* src, int c0, int c1, int c2, int c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];" ::"l"(reinterpret_cast<u64>(map)),
                 "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
                 : "memory");
}
// Closes this thread's stores issued since the last commit into one group.
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's groups still read their shared memory (it may be
// written again), or (`tma_store_wait`) are still writing global memory.
template <int N> __device__ __forceinline__ void tma_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }
template <int N> __device__ __forceinline__ void tma_store_wait() { asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory"); }

// ---- Proxies and registers

// Orders this thread's ordinary shared-memory writes before later async-proxy reads (wgmma
// operands or TMA stores written with st.shared / stmatrix), and the other way round.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Register reallocation between warpgroups (takes effect only under __launch_bounds__(t, 1)):
// the producer gives registers back, the consumers take them. Immediate operands, multiples of 8.
template <int REGS> __device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS)); }
template <int REGS> __device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS)); }

// ---- wgmma

// Shared-memory matrix descriptor of a K-major tile stored as 128-byte rows with 128-byte
// swizzle (what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B from a 64-half-wide box): start
// address >> 4 in bits 0-13, leading-byte offset (unused for swizzled K-major; 1 by convention)
// in 16-29, stride-byte offset 1024 (eight 128-byte rows, one swizzle atom) in 32-45, swizzle
// mode 1 (128 B) in 62-63. `tile` must be 1024-byte aligned; the k-th 16-wide slice of the 64
// halves of a row starts `k * 32` bytes further (`wgmma_desc_advance`).
__device__ __forceinline__ u64 wgmma_desc_k128(const void* tile) {
    u64 addr = (smem_u32(tile) & 0x3FFFF) >> 4;
    return addr | (1ull << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}
// The same for rows of ROW_BYTES (128 or 64) bytes swizzled over as many bytes (what TMA writes
// with CU_TENSOR_MAP_SWIZZLE_128B / _64B from a box ROW_BYTES wide): swizzle mode 1 (128 B) or 2
// (64 B), stride-byte offset eight rows (one swizzle atom). `tile` must be aligned to the atom
// (1024 or 512 bytes); slices along K advance by bytes within the row, as above.
template <int ROW_BYTES> __device__ __forceinline__ u64 wgmma_desc_k(const void* tile) {
    static_assert(ROW_BYTES == 128 || ROW_BYTES == 64, "128- or 64-byte swizzled rows");
    if (ROW_BYTES == 128) return wgmma_desc_k128(tile);
    u64 addr = (smem_u32(tile) & 0x3FFFF) >> 4;
    return addr | (1ull << 16) | ((u64)((8 * 64) >> 4) << 32) | (2ull << 62);
}
__device__ __forceinline__ u64 wgmma_desc_advance(u64 desc, int bytes) { return desc + (u64)(bytes >> 4); }

// Before the first wgmma of a group, and between ordinary register accesses to the accumulators
// and the wgmmas that use them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Pins an accumulator register around the asynchronous MMAs, so the compiler neither moves its
// ordinary reads and writes across them nor copies it elsewhere while they run.
__device__ __forceinline__ void wgmma_fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void wgmma_fence_operand(int& r) { asm volatile("" : "+r"(r)::"memory"); }
// Waits until at most `N` committed groups of this warpgroup are still running.
template <int N> __device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// Where accumulator `i` of an m64nN wgmma lives, for thread `t` (0..127) of the warpgroup: row
// 16·warp + lane/4 (+8 for the second pair of each quad), column 8·(i/4) + 2·(lane%4) + i%2.
__device__ __forceinline__ int wgmma_acc_row(int t, int i) { return (t >> 5) * 16 + ((t & 31) >> 2) + ((i >> 1) & 1) * 8; }
__device__ __forceinline__ int wgmma_acc_col(int t, int i) { return (i >> 2) * 8 + (t & 3) * 2 + (i & 1); }

// D[64×128] (+)= A[64×16]·B[16×128], A and B from shared memory through K-major descriptors;
// `accumulate` 0 overwrites D. 64 f32 accumulators per thread (`wgmma_acc_row/col`).
__device__ __forceinline__ void wgmma_m64n128k16_f16(float* d, u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 :
                   "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64×256] (+)= A[64×16]·B[16×256], A and B from shared memory through K-major descriptors;
// `accumulate` 0 overwrites D. 128 f32 accumulators per thread (`wgmma_acc_row/col`).
__device__ __forceinline__ void wgmma_m64n256k16_f16(float* d, u64 desc_a, u64 desc_b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
                 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 :
                   "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
                   "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
                   "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
                   "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
                   "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
                   "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
                   "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
                   "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// ---- 8-bit wgmma (k32: 32 bytes of the reduction per MMA, K-major operands from shared memory)

// The accumulator operands of an m64nN wgmma: `WG_D<n>` writes the n registers' numbers as PTX
// operands (%0 .. %n-1), `WG_ACC<n>(C, d)` binds d[0 .. n) with the constraint macro C (`WG_S32`:
// "+r", `WG_F32`: "+f"). An m64nN wgmma has N / 2 accumulators per thread.
#define WG_S32(x) "+r"(x)
#define WG_F32(x) "+f"(x)
#define WG_D32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_ACC32(C, d) \
    C(d[0]), C(d[1]), C(d[2]), C(d[3]), C(d[4]), C(d[5]), C(d[6]), C(d[7]), \
    C(d[8]), C(d[9]), C(d[10]), C(d[11]), C(d[12]), C(d[13]), C(d[14]), C(d[15]), \
    C(d[16]), C(d[17]), C(d[18]), C(d[19]), C(d[20]), C(d[21]), C(d[22]), C(d[23]), \
    C(d[24]), C(d[25]), C(d[26]), C(d[27]), C(d[28]), C(d[29]), C(d[30]), C(d[31])
#define WG_D64 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_ACC64(C, d) \
    C(d[0]), C(d[1]), C(d[2]), C(d[3]), C(d[4]), C(d[5]), C(d[6]), C(d[7]), \
    C(d[8]), C(d[9]), C(d[10]), C(d[11]), C(d[12]), C(d[13]), C(d[14]), C(d[15]), \
    C(d[16]), C(d[17]), C(d[18]), C(d[19]), C(d[20]), C(d[21]), C(d[22]), C(d[23]), \
    C(d[24]), C(d[25]), C(d[26]), C(d[27]), C(d[28]), C(d[29]), C(d[30]), C(d[31]), \
    C(d[32]), C(d[33]), C(d[34]), C(d[35]), C(d[36]), C(d[37]), C(d[38]), C(d[39]), \
    C(d[40]), C(d[41]), C(d[42]), C(d[43]), C(d[44]), C(d[45]), C(d[46]), C(d[47]), \
    C(d[48]), C(d[49]), C(d[50]), C(d[51]), C(d[52]), C(d[53]), C(d[54]), C(d[55]), \
    C(d[56]), C(d[57]), C(d[58]), C(d[59]), C(d[60]), C(d[61]), C(d[62]), C(d[63])
#define WG_D128 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WG_ACC128(C, d) \
    C(d[0]), C(d[1]), C(d[2]), C(d[3]), C(d[4]), C(d[5]), C(d[6]), C(d[7]), \
    C(d[8]), C(d[9]), C(d[10]), C(d[11]), C(d[12]), C(d[13]), C(d[14]), C(d[15]), \
    C(d[16]), C(d[17]), C(d[18]), C(d[19]), C(d[20]), C(d[21]), C(d[22]), C(d[23]), \
    C(d[24]), C(d[25]), C(d[26]), C(d[27]), C(d[28]), C(d[29]), C(d[30]), C(d[31]), \
    C(d[32]), C(d[33]), C(d[34]), C(d[35]), C(d[36]), C(d[37]), C(d[38]), C(d[39]), \
    C(d[40]), C(d[41]), C(d[42]), C(d[43]), C(d[44]), C(d[45]), C(d[46]), C(d[47]), \
    C(d[48]), C(d[49]), C(d[50]), C(d[51]), C(d[52]), C(d[53]), C(d[54]), C(d[55]), \
    C(d[56]), C(d[57]), C(d[58]), C(d[59]), C(d[60]), C(d[61]), C(d[62]), C(d[63]), \
    C(d[64]), C(d[65]), C(d[66]), C(d[67]), C(d[68]), C(d[69]), C(d[70]), C(d[71]), \
    C(d[72]), C(d[73]), C(d[74]), C(d[75]), C(d[76]), C(d[77]), C(d[78]), C(d[79]), \
    C(d[80]), C(d[81]), C(d[82]), C(d[83]), C(d[84]), C(d[85]), C(d[86]), C(d[87]), \
    C(d[88]), C(d[89]), C(d[90]), C(d[91]), C(d[92]), C(d[93]), C(d[94]), C(d[95]), \
    C(d[96]), C(d[97]), C(d[98]), C(d[99]), C(d[100]), C(d[101]), C(d[102]), C(d[103]), \
    C(d[104]), C(d[105]), C(d[106]), C(d[107]), C(d[108]), C(d[109]), C(d[110]), C(d[111]), \
    C(d[112]), C(d[113]), C(d[114]), C(d[115]), C(d[116]), C(d[117]), C(d[118]), C(d[119]), \
    C(d[120]), C(d[121]), C(d[122]), C(d[123]), C(d[124]), C(d[125]), C(d[126]), C(d[127])

// D[64×N] (+)= A[64×32]·B[32×N] on 8-bit codes, A and B through K-major descriptors; `accumulate`
// 0 overwrites D. `_s8`: int8 × int8 into exact s32 accumulators, wrapping (the conv's host side
// refuses reductions of more than (2^31 − 1) / 2^14 products); `_e4m3`: e4m3 × e4m3 into f32.
// Accumulator layout as the f16 wgmmas' (`wgmma_acc_row/col`).
#define WGMMA_K32(N, NACC, DA, DB, P, SUFFIX, TYPES, T, C, TAIL)                                                                   \
    __device__ __forceinline__ void wgmma_m64n##N##k32_##SUFFIX(T* d, u64 desc_a, u64 desc_b, int accumulate) {                   \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                                                           \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k32." TYPES " {" WG_D##NACC "}, %" #DA ", %" #DB ", p" TAIL ";\n}\n" \
                     : WG_ACC##NACC(C, d)                                                                                         \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                               \
    }
// (NACC accumulators are operands 0 .. NACC-1; the descriptors and the flag follow them.) The
// integer form takes no scale or transpose immediates; e4m3's takes the scales (1: no negation).
WGMMA_K32(64, 32, 32, 33, 34, s8, "s32.s8.s8", int, WG_S32, "")
WGMMA_K32(128, 64, 64, 65, 66, s8, "s32.s8.s8", int, WG_S32, "")
WGMMA_K32(256, 128, 128, 129, 130, s8, "s32.s8.s8", int, WG_S32, "")
WGMMA_K32(64, 32, 32, 33, 34, e4m3, "f32.e4m3.e4m3", float, WG_F32, ", 1, 1")
WGMMA_K32(128, 64, 64, 65, 66, e4m3, "f32.e4m3.e4m3", float, WG_F32, ", 1, 1")
WGMMA_K32(256, 128, 128, 129, 130, e4m3, "f32.e4m3.e4m3", float, WG_F32, ", 1, 1")
