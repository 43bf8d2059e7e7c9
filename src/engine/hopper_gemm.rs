//! The Hopper-native GEMM (`kernels/hopper_gemm.cu`, compiled for `sm_90a`): `Y = act(X · Wᵀ +
//! bias + R)` in FP16 with f32 accumulation, TMA loads into a shared-memory ring, warp-specialised
//! wgmma. A tactic candidate beside cuBLASLt's GEMM on sm_90 devices (the Linear converter times
//! both), and the one that fuses the exact erf-GELU, which cuBLASLt's epilogues lack (theirs is
//! the tanh form).
//!
//! The weight's tensor map is encoded once; the activation's is encoded at every enqueue (its
//! address and row count change with the batch and the arena), a host-only call of a microsecond
//! whose 128 bytes travel as a kernel parameter (`__grid_constant__`), so CUDA-graph capture keeps
//! them.

use super::gpu::cuda_err;
use super::kernels::{hopper_arch, Kernels, HOPPER_GEMM};
use super::layer::{DeviceBuf, Elem, Layer, LayerCtx, RunCtx, ValueDesc, ValueId};
use super::tma::{TiledMap, TmaElem, TmaSwizzle};
use crate::{Error, LowerKind, Result};
use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use std::sync::Arc;

/// Rows of a block's tile (two consumer warpgroups of 64).
const BM: usize = 128;
/// K elements per pipeline stage: one 128-byte swizzled row of halves.
const BK: usize = 64;
/// Threads per block: a producer warpgroup and two consumer warpgroups.
const THREADS: u32 = 384;

/// The activation fused into the epilogue (passed as kernels/common.cuh's `ACT_*` code).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HopperAct {
    None,
    Relu,
    /// `0.5·x·(1 + erf(x/√2))`, PyTorch's default GELU.
    Gelu,
    /// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    GeluTanh,
    Silu,
}

impl HopperAct {
    pub const ALL: [HopperAct; 5] = [HopperAct::None, HopperAct::Relu, HopperAct::Gelu, HopperAct::GeluTanh, HopperAct::Silu];

    fn code(self) -> i32 {
        match self {
            HopperAct::None => 0,
            HopperAct::Relu => 1,
            HopperAct::Silu => 4,
            HopperAct::Gelu => 7,
            HopperAct::GeluTanh => 8,
        }
    }
}

/// How the grid covers the tiles: one block per tile, or one block per SM looping over them
/// (persistent: the next tile's loads overlap the last one's epilogue).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HopperGrid {
    PerTile,
    Persistent,
}

/// A block's tile shape: 128 rows by `bn` columns, with as many pipeline stages as fit beside the
/// epilogue's staging rows (4 for 128 columns, 3 for 256).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HopperTile {
    N128,
    N256,
}

impl HopperTile {
    pub const ALL: [HopperTile; 2] = [HopperTile::N128, HopperTile::N256];

    pub fn bn(self) -> usize {
        match self {
            HopperTile::N128 => 128,
            HopperTile::N256 => 256,
        }
    }
    fn stages(self) -> usize {
        match self {
            HopperTile::N128 => 4,
            HopperTile::N256 => 3,
        }
    }
    fn entry(self) -> String {
        format!("hopper_gemm_f16_n{}_s{}", self.bn(), self.stages())
    }
    /// Dynamic shared memory: the ring of A and B stages, the two consumers' staging rows
    /// (`HgStage`: 64 rows of `bn` halves + 16 bytes each), 1 KiB to align the ring to 1024 bytes.
    fn shared_bytes(self) -> usize {
        self.stages() * (BM + self.bn()) * BK * 2 + 2 * 64 * (2 * self.bn() + 16) + 1024
    }
    /// The layer kind (`wgmma-gemm:128x256`, `wgmma-gemm:128x256:persistent`), what tactics record.
    pub fn kind(self, grid: HopperGrid) -> String {
        let persistent = if grid == HopperGrid::Persistent { ":persistent" } else { "" };
        format!("wgmma-gemm:{BM}x{}{persistent}", self.bn())
    }
}

/// Why the wgmma GEMM cannot run a `k → n` problem in `elem` on a device of `arch`, or `Ok`.
pub fn supports(arch: &str, elem: Elem, k: usize, n: usize) -> std::result::Result<(), String> {
    if hopper_arch(arch).is_none() {
        return Err(format!("needs an sm_90 device (this one is {arch})"));
    }
    if elem != Elem::F16 {
        return Err(format!("runs FP16 only, not {elem:?}"));
    }
    if k == 0 || n == 0 || !k.is_multiple_of(8) {
        return Err(format!("needs K a non-zero multiple of 8 (TMA's 16-byte row pitch), got K = {k}, N = {n}"));
    }
    if k >= 1 << 31 || n >= 1 << 31 {
        return Err(format!("K = {k} or N = {n} exceeds the kernel's 32-bit range"));
    }
    Ok(())
}

/// A row-major `[rows, k]` f16 matrix at `ptr` as a TMA tensor map with `box_rows × 64` boxes,
/// 128-byte swizzled (the layout `wgmma_desc_k128` reads), zero-filled outside the matrix.
fn tensor_map(ptr: u64, rows: usize, k: usize, box_rows: usize) -> std::result::Result<sys::CUtensorMap, String> {
    TiledMap {
        elem: TmaElem::F16,
        address: ptr,
        dims: vec![k as u64, rows as u64],
        strides: vec![(k * 2) as u64],
        boxes: vec![BK as u32, box_rows as u32],
        element_strides: vec![1, 1],
        swizzle: TmaSwizzle::B128,
    }
    .encode()
    .map_err(|e| format!("{rows} × {k} rows, box {box_rows} × {BK}: {e}"))
}

/// One wgmma GEMM problem: `k → n` with a fixed weight, any number of rows per call.
pub struct HopperGemm {
    path: String,
    f: CudaFunction,
    tile: HopperTile,
    grid: HopperGrid,
    sm_count: u32,
    k: usize,
    n: usize,
    act: HopperAct,
    w_map: sys::CUtensorMap,
}

// SAFETY: `CUtensorMap` is 128 bytes of plain data (the encoded descriptor, no host pointers of
// its own); the function handle is cudarc's, itself Send + Sync.
unsafe impl Send for HopperGemm {}
// SAFETY: as above; nothing is mutated after construction.
unsafe impl Sync for HopperGemm {}

impl HopperGemm {
    /// The GEMM over the `[n, k]` f16 weight at `w` (device memory that outlives it), compiling
    /// and loading `kernels/hopper_gemm.cu` for `sm_90a` on first use. `Error::Lower`
    /// (`Unsupported`) where the device or the problem does not fit ([`supports`]).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        path: &str,
        kernels: &Kernels,
        tile: HopperTile,
        grid: HopperGrid,
        k: usize,
        n: usize,
        w: u64,
        act: HopperAct,
    ) -> Result<Self> {
        let unsupported =
            |reason: String| Error::Lower { path: path.to_string(), op: "wgmma-gemm".into(), kind: LowerKind::Unsupported, reason };
        supports(kernels.arch(), Elem::F16, k, n).map_err(unsupported)?;
        let arch = hopper_arch(kernels.arch()).expect("checked by supports");
        let (name, source) = HOPPER_GEMM;
        kernels.add_source_for(name, source, &arch)?;
        let f = kernels.get(&tile.entry())?;
        f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, tile.shared_bytes() as i32)
            .map_err(cuda_err("raising the wgmma GEMM's dynamic shared memory limit"))?;
        let w_map = tensor_map(w, n, k, tile.bn()).map_err(unsupported)?;
        Ok(Self { path: path.to_string(), f, tile, grid, sm_count: kernels.sm_count(), k, n, act, w_map })
    }

    /// The layer kind of this tile and grid.
    pub fn kind(&self) -> String {
        self.tile.kind(self.grid)
    }

    /// Enqueues `Y[m, n] = act(X[m, k] · Wᵀ + bias + R)` on `stream` (`bias`: f32 `[n]`, 0 for
    /// none; `residual`: f16 `[m, n]`, 0 for none, may be `y`). X must be 16-byte aligned, Y and R
    /// 4-byte aligned.
    pub fn enqueue(&self, stream: &Arc<CudaStream>, m: usize, x: u64, bias: u64, residual: u64, y: u64) -> Result<()> {
        if m == 0 {
            return Ok(());
        }
        let fail = |reason: String| Error::Cuda { context: format!("wgmma GEMM `{}` with {m} rows", self.path), reason };
        let tiles = m.div_ceil(BM) * self.n.div_ceil(self.tile.bn());
        if tiles >= 1 << 31 || m >= 1 << 31 {
            return Err(fail(format!("{m} rows of {} columns exceed the kernel's 32-bit tile index", self.n)));
        }
        let blocks = match self.grid {
            HopperGrid::PerTile => tiles,
            HopperGrid::Persistent => tiles.min(self.sm_count as usize),
        };
        if !y.is_multiple_of(4) || !residual.is_multiple_of(4) {
            return Err(fail("the output and residual must be 4-byte aligned".into()));
        }
        let x_map = tensor_map(x, m, self.k, BM).map_err(fail)?;
        let cfg =
            LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: self.tile.shared_bytes() as u32 };
        let (mi, ni, ki, act) = (m as i32, self.n as i32, self.k as i32, self.act.code());
        let mut lb = stream.launch_builder(&self.f);
        lb.arg(&x_map.opaque).arg(&self.w_map.opaque).arg(&y).arg(&bias).arg(&residual).arg(&mi).arg(&ni).arg(&ki).arg(&act);
        // SAFETY: the arguments are the entry point's parameters in order (two 128-byte tensor
        // maps, three device pointers, four i32: kernels/hopper_gemm.cu's HOPPER_GEMM_ENTRY).
        // The maps describe X (m × k, as the caller passes it) and the weight (n × k, alive as
        // long as the layer); Y and R hold m × n halves and bias n floats, as the caller
        // guarantees. The dynamic shared memory is the size the function's limit was raised to.
        unsafe { lb.launch(cfg) }.map_err(cuda_err("launching the wgmma GEMM"))?;
        Ok(())
    }
}

/// `Y = act(X · Wᵀ + bias + residual)` over the rows of contiguous values, on the wgmma GEMM.
pub struct HopperGemmLayer {
    path: String,
    x: ValueId,
    y: ValueId,
    z: Option<ValueId>,
    rows_per_image: usize,
    _w: DeviceBuf,
    bias: Option<DeviceBuf>,
    gemm: HopperGemm,
}

/// What a wgmma GEMM layer computes: row-major `[.., K]` → `[.., N]` values, the `[N, K]` weight,
/// an optional bias and residual, the fused activation.
#[derive(Clone, Copy)]
pub struct HopperGemmSpec<'a> {
    pub x: ValueId,
    pub y: ValueId,
    pub residual: Option<ValueId>,
    pub rows_per_image: usize,
    pub weight: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub act: HopperAct,
}

impl HopperGemmLayer {
    /// The layer for `spec` with `tile`; `Unsupported` where the device, the precision or the
    /// operands do not fit (the Linear converter then keeps its other candidates).
    pub fn new(ctx: &mut LayerCtx, spec: HopperGemmSpec, tile: HopperTile, grid: HopperGrid) -> Result<Self> {
        let (dx, dy) = (ctx.value(spec.x).clone(), ctx.value(spec.y).clone());
        let contiguous = |d: &ValueDesc| d.layout.same_bytes(super::layer::Layout::contiguous(d.dims.len()), &d.dims);
        let (k, n) = match (dx.dims.last(), dy.dims.last()) {
            (Some(&k), Some(&n)) if contiguous(&dx) && contiguous(&dy) => (k, n),
            _ => return Err(ctx.err(LowerKind::Unsupported, "the wgmma GEMM needs contiguous rows")),
        };
        let mut vals = vec![dx.elem, dy.elem];
        if let Some(r) = spec.residual {
            let dr = ctx.value(r);
            if dr.dims != dy.dims || !contiguous(dr) {
                return Err(ctx.err(LowerKind::Operands, "the residual must be stored as the output"));
            }
            vals.push(dr.elem);
        }
        if let Some(e) = vals.iter().find(|&&e| e != Elem::F16) {
            return Err(ctx.err(LowerKind::Unsupported, format!("the wgmma GEMM runs FP16 only, not {e:?}")));
        }
        let rows = spec.rows_per_image;
        if rows.checked_mul(k) != Some(dx.per_image_elems()) || rows.checked_mul(n) != Some(dy.per_image_elems()) {
            return Err(ctx.err(LowerKind::Operands, format!("{rows} rows per image do not fit {:?} -> {:?}", dx.dims, dy.dims)));
        }
        if spec.weight.len() != n * k || spec.bias.is_some_and(|b| b.len() != n) {
            return Err(ctx.err(LowerKind::Weights, format!("weight or bias does not fit a {k} → {n} GEMM")));
        }
        supports(ctx.kernels.arch(), ctx.elem(), k, n).map_err(|why| ctx.err(LowerKind::Unsupported, why))?;
        let w = ctx.upload_bytes(&super::layer::to_elem_bytes(spec.weight, Elem::F16))?;
        let bias = spec.bias.map(|b| ctx.upload_f32(b)).transpose()?;
        let path = ctx.path().to_string();
        let gemm = HopperGemm::new(&path, ctx.kernels, tile, grid, k, n, w.ptr(), spec.act)?;
        Ok(Self { path, x: spec.x, y: spec.y, z: spec.residual, rows_per_image: rows, _w: w, bias, gemm })
    }
}

impl Layer for HopperGemmLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.gemm.kind()
    }
    fn overwrites(&self) -> Option<(ValueId, ValueId)> {
        // Each thread reads a residual element just before it writes the same output element.
        self.z.map(|z| (self.y, z))
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let bias = self.bias.as_ref().map_or(0, DeviceBuf::ptr);
        let res = self.z.map_or(0, |z| rt.ptr(z));
        self.gemm.enqueue(rt.stream, batch * self.rows_per_image, rt.ptr(self.x), bias, res, rt.ptr(self.y))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_outside_the_kernel_are_refused_with_the_reason() {
        assert!(supports("sm_90", Elem::F16, 768, 3072).is_ok());
        assert!(supports("sm_90", Elem::F16, 8, 1).is_ok(), "any N, K a multiple of 8");
        assert!(supports("sm_80", Elem::F16, 768, 3072).unwrap_err().contains("sm_90"));
        assert!(supports("sm_90", Elem::F32, 768, 3072).unwrap_err().contains("FP16"));
        assert!(supports("sm_90", Elem::F16, 770, 3072).unwrap_err().contains("multiple of 8"));
        assert!(supports("sm_90", Elem::F16, 0, 3072).is_err());
    }

    #[test]
    fn tiles_fit_the_shared_memory_of_one_block() {
        for tile in HopperTile::ALL {
            // sm_90's opt-in limit per block is 227 KiB.
            assert!(tile.shared_bytes() <= 227 * 1024, "{tile:?}: {} bytes", tile.shared_bytes());
            assert!(tile.entry().contains(&tile.bn().to_string()));
        }
    }
}
