//! The fused kernels' candidates (`kernels/attention.cu`): one launch reads q, k and v where they
//! lie (row strides and a head count) and writes each head's rows into place.

use super::gpu::{int, Dims};
use crate::engine::launch::{launch, CudaFunction, KArg};
use crate::engine::{DeviceBuf, Elem, Layer, RunCtx, ValueId};
use crate::graph::NodeId;
use crate::ops::BuildCtx;
use crate::LowerKind;
use crate::Result;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use std::sync::Arc;

/// The two fused kernels of `kernels/attention.cu` (one signature).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum FusedKernel {
    /// `flash_attn_d{32,64}_{f32,f16}`: CUDA cores, one thread a query row.
    CudaCores,
    /// `flash_attn_tc_d{32,64}_f16`: tensor cores, FP16 only; rows and head offsets in multiples
    /// of 8 elements and 16-byte aligned pointers.
    TensorCores,
    /// `flash_attn_tcs_d{32,64}_f16`: `TensorCores` with K and V resident in dynamic shared
    /// memory ([`FusedKernel::shared_bytes`]); the same requirements. A block takes 64 query rows,
    /// or with `all_rows` every query row of its problem.
    Resident { all_rows: bool },
}

/// The head dims the fused kernels are stamped for (`flash_attn_d32_*`, `flash_attn_d64_*`).
pub(super) const FUSED_HEAD_DIMS: [usize; 2] = [32, 64];

/// Query rows per block of the fused kernels (`ATTN_BQ` in kernels/attention.cu).
const FUSED_ROWS: usize = 64;
/// The most blocks along a grid's y (the query tiles).
const MAX_GRID_Y: usize = 65535;

impl FusedKernel {
    /// The kernels an engine of `elem` can run.
    pub(super) fn for_elem(elem: Elem) -> Vec<Self> {
        match elem {
            Elem::F16 => vec![Self::CudaCores, Self::TensorCores, Self::Resident { all_rows: false }, Self::Resident { all_rows: true }],
            Elem::F32 => vec![Self::CudaCores],
            // A binding, or 8-bit codes only 8-bit convs read: no attention runs on bytes.
            Elem::U8 | Elem::I8 | Elem::E4m3 => vec![],
        }
    }
    pub(super) fn entry(self, d: usize, elem: Elem) -> String {
        match self {
            Self::CudaCores => format!("flash_attn_d{d}_{}", elem.suffix()),
            Self::TensorCores => format!("flash_attn_tc_d{d}_f16"),
            Self::Resident { .. } => format!("flash_attn_tcs_d{d}_f16"),
        }
    }
    fn kind(self, d: usize) -> String {
        match self {
            Self::CudaCores => format!("kernel:flash_attn_d{d}"),
            Self::TensorCores => format!("kernel:flash_attn_tc_d{d}"),
            Self::Resident { all_rows } => format!("kernel:flash_attn_tcs_{}_d{d}", if all_rows { "qall" } else { "q64" }),
        }
    }
    fn threads(self) -> u32 {
        match self {
            Self::CudaCores => 64,
            Self::TensorCores | Self::Resident { .. } => 128,
        }
    }
    /// Whether the kernel runs on tensor cores (16-byte rows and pointers).
    fn tensor_cores(self) -> bool {
        matches!(self, Self::TensorCores | Self::Resident { .. })
    }
    /// The dynamic shared memory of a launch with `s` keys of head dim `d`: `Resident` holds K
    /// and V, `s` rounded up to 16 rows of `d + 8` halves each (`attn_tcs` in
    /// kernels/attention.cu); the others use static shared memory only.
    fn shared_bytes(self, s: usize, d: usize) -> Option<usize> {
        match self {
            Self::Resident { .. } => s.checked_next_multiple_of(16)?.checked_mul(d + 8)?.checked_mul(2 * 2),
            Self::CudaCores | Self::TensorCores => Some(0),
        }
    }
}

/// Where a fused kernel reads and writes: q, k and v as (value, byte offset into it), y, and the
/// kernels' row strides (elements) and heads per row block.
#[derive(Clone, Copy, Debug)]
pub(super) struct FusedIo {
    pub(super) q: (ValueId, u64),
    pub(super) k: (ValueId, u64),
    pub(super) v: (ValueId, u64),
    pub(super) y: ValueId,
    pub(super) heads: i32,
    pub(super) ldq: i64,
    pub(super) ldkv: i64,
    pub(super) ldy: i64,
}

/// Attention as one launch of a fused kernel: grid (problems, blocks of query rows: tiles of 64,
/// or one for `Resident { all_rows }`).
pub(super) struct FusedAttention {
    path: String,
    /// The op's name, for errors.
    op: String,
    kernel: FusedKernel,
    d: usize,
    f: CudaFunction,
    io: FusedIo,
    bias: Option<Arc<DeviceBuf>>,
    /// Problems per image.
    zimg: usize,
    li: i32,
    si: i32,
    tiles: u32,
    /// `Resident`'s 16-row query tiles a warp takes (its last argument).
    tiles_per_warp: i32,
    /// Dynamic shared memory of a launch (bytes).
    shared: u32,
    scale: f32,
}

impl FusedAttention {
    /// The candidate, or `None` where the kernel cannot take the problem (more query tiles than a
    /// grid holds; for tensor cores, rows or head offsets off 8 elements; for `Resident`, more
    /// keys than the GPU's shared memory per block holds).
    pub(super) fn new(
        ctx: &BuildCtx,
        node: NodeId,
        kernel: FusedKernel,
        io: FusedIo,
        dims: Dims,
        scale: f32,
        bias: Option<Arc<DeviceBuf>>,
    ) -> Result<Option<Self>> {
        let mut tiles = dims.l.div_ceil(FUSED_ROWS).max(1);
        // A block of 4 warps covers 64 rows per tile each warp takes.
        let tiles_per_warp = match kernel {
            FusedKernel::Resident { all_rows: true } if tiles == 1 => return Ok(None), // the same as 64 rows a block
            FusedKernel::Resident { all_rows: true } => std::mem::replace(&mut tiles, 1),
            _ => 1,
        };
        let rows8 = [io.ldq, io.ldkv, io.ldy].iter().all(|ld| ld % 8 == 0) && dims.d.is_multiple_of(8);
        if tiles > MAX_GRID_Y || (kernel.tensor_cores() && !rows8) {
            return Ok(None);
        }
        let f = ctx.kernels.get(&kernel.entry(dims.d, ctx.elem()))?;
        let shared = match kernel.shared_bytes(dims.s, dims.d) {
            Some(0) => 0,
            Some(bytes) => {
                // The limit belongs to the function, which every layer shares, so it is set to
                // the GPU's most (the same for every layer) and this launch checked against it.
                let most = ctx.gpu.ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).unwrap_or(0);
                if bytes > most.max(0) as usize
                    || f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, most).is_err()
                {
                    return Ok(None);
                }
                bytes as u32
            }
            None => return Ok(None),
        };
        let (li, si) = (int(ctx, node, "L", dims.l)?, int(ctx, node, "S", dims.s)?);
        let (path, op) = (ctx.node(node).path.clone(), ctx.node(node).op.name().to_string());
        let tiles_per_warp = int(ctx, node, "query tiles per warp", tiles_per_warp)?;
        Ok(Some(Self {
            path,
            op,
            kernel,
            d: dims.d,
            f,
            io,
            bias,
            zimg: dims.zimg,
            li,
            si,
            tiles: tiles as u32,
            tiles_per_warp,
            shared,
            scale,
        }))
    }

    fn lower_err(&self, kind: LowerKind, reason: String) -> crate::Error {
        crate::Error::Lower { path: self.path.clone(), op: self.op.clone(), kind, reason }
    }
}

impl Layer for FusedAttention {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.kernel.kind(self.d)
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let problems = batch * self.zimg;
        if problems == 0 {
            return Ok(());
        }
        let z = u32::try_from(problems)
            .ok()
            .filter(|&z| z <= i32::MAX as u32)
            .ok_or_else(|| self.lower_err(LowerKind::TooLarge, format!("{problems} problems exceed the grid")))?;
        let at = |(v, offset): (ValueId, u64)| rt.ptr(v) + offset;
        let (q, k, v, y) = (at(self.io.q), at(self.io.k), at(self.io.v), rt.ptr(self.io.y));
        if self.kernel.tensor_cores() && [q, k, v, y].iter().any(|p| p % 16 != 0) {
            return Err(self.lower_err(
                LowerKind::Operands,
                format!("the tensor-core kernel needs 16-byte aligned q, k, v and y, got {q:#x} {k:#x} {v:#x} {y:#x}"),
            ));
        }
        let mut args = vec![
            KArg::Ptr(q),
            KArg::Ptr(k),
            KArg::Ptr(v),
            KArg::Ptr(self.bias.as_ref().map_or(0, |b| b.ptr())),
            KArg::Ptr(y),
            KArg::I32(self.li),
            KArg::I32(self.si),
            KArg::I32(self.io.heads),
            KArg::I64(self.io.ldq),
            KArg::I64(self.io.ldkv),
            KArg::I64(self.io.ldy),
            KArg::I64(self.zimg.max(1) as i64),
            KArg::F32(self.scale),
        ];
        if matches!(self.kernel, FusedKernel::Resident { .. }) {
            args.push(KArg::I32(self.tiles_per_warp));
        }
        launch(rt, &self.f, (z, self.tiles, 1), (self.kernel.threads(), 1, 1), self.shared, &args)
    }
}
