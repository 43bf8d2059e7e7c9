//! A convolution with few input channels (the 3-channel stem of ResNet and CenterNet) as im2col
//! plus one cuBLASLt GEMM, offered as one more timed candidate beside cuDNN's (FP16 only).
//!
//! cuDNN runs a 7×7 conv on 3 channels padded to 8 at a small fraction of the tensor cores'
//! speed. In NHWC, the column matrix `[N·HO·WO, KP]` (K = KH·KW·Cin in (r, s, c) order, padded
//! to a multiple of 8) times the `[Cout, KP]` weights is the NHWC output, with bias and ReLU in
//! the GEMM's epilogue (`kernels/im2col.cu` writes the columns). The column matrix is built in
//! chunks of rows in the layer's workspace (which the arena holds for this layer alone), so a large
//! batch does not need it whole.

use super::{Activation, ConvAttrs};
use crate::engine::gemm::LtMatmul;
use crate::engine::launch::{grid_for, launch, CudaFunction, KArg, BLOCK};
use crate::engine::layer::{DeviceBuf, Elem, Layer, RunCtx, ValueId};
use crate::graph::NodeId;
use crate::ops::BuildCtx;
use crate::LowerKind;
use crate::Result;
use std::sync::Arc;

/// `kernels/im2col.cu`, compiled with NVRTC on first use like Kiln's other kernels.
pub const IM2COL_CU: &str = crate::engine::kernels::ON_DEMAND[1].1;

/// Columns the kernel's shared offset table holds (`IM2COL_MAX_K`).
const MAX_K: usize = 1024;

/// Largest column-matrix chunk of each candidate: a small one stays closer to L2 between the
/// im2col and the GEMM and takes less of the arena, a large one launches less; timing picks
/// (within the room the arena has at the layer, see `tactic::choose`).
const CHUNK_BYTES: [usize; 3] = [16 << 20, 48 << 20, 256 << 20];

/// Everything the candidates of one node share.
struct Shared {
    path: String,
    x: ValueId,
    y: ValueId,
    rows_per_image: usize,
    /// H, W, C, HO, WO, KH, KW, sh, sw, ph, pw, dh, dw, KP as the kernel takes them.
    dims: [i32; 14],
    kp: usize,
    cout: usize,
    im2col: CudaFunction,
    _w: DeviceBuf,
    _b: DeviceBuf,
    w_ptr: u64,
    /// `Yᵀ[Cout, m] = W[Cout, KP] · colᵀ[KP, m]` with bias and ReLU in its epilogue; plans by GEMM
    /// rows (a chunk, or a batch's last partial chunk).
    matmul: LtMatmul,
    sm_count: u32,
}

/// One candidate: im2col + GEMM with column chunks of at most `chunk_bytes`.
pub struct Im2colGemm {
    shared: Arc<Shared>,
    chunk_bytes: usize,
}

/// The im2col + GEMM candidates for a conv node, or none where they do not apply: FP16 only,
/// no groups, no residual, fewer than 8 input channels (where cuDNN's tensor-core kernels need
/// padding), output channels a multiple of 8 (cuBLASLt's aligned rows), K up to `MAX_K` (1024).
#[allow(clippy::too_many_arguments)]
pub fn candidates(
    ctx: &mut BuildCtx,
    node: NodeId,
    a: &ConvAttrs,
    weight: &[f32],
    shape4: [usize; 4],
    bias: &[f32],
    x: ValueId,
    y: ValueId,
    residual: bool,
) -> Result<Vec<Box<dyn Layer>>> {
    let (cin, h, w) = ctx.chw(x, "input")?;
    let (cout, ho, wo) = ctx.chw(y, "output")?;
    let [k_out, k_in, kh, kw] = shape4;
    let k = kh * kw * cin;
    let kp = k.next_multiple_of(8);
    if ctx.elem() != Elem::F16 || a.groups != 1 || residual || cin >= 8 || cout % 8 != 0 || kp > MAX_K || k_out != cout || k_in != cin {
        return Ok(Vec::new());
    }
    if weight.len() != cout * k || bias.len() != cout {
        return Err(ctx.err(
            node,
            LowerKind::Weights,
            format!("weight {} / bias {} values for a {shape4:?} convolution", weight.len(), bias.len()),
        ));
    }
    let int = |v: usize| {
        i32::try_from(v).map_err(|_| ctx.err(node, LowerKind::TooLarge, format!("{v} exceeds the im2col kernel's 32-bit range")))
    };
    let dims = [
        int(h)?,
        int(w)?,
        int(cin)?,
        int(ho)?,
        int(wo)?,
        int(kh)?,
        int(kw)?,
        int(a.stride[0])?,
        int(a.stride[1])?,
        int(a.padding[0])?,
        int(a.padding[1])?,
        int(a.dilation[0])?,
        int(a.dilation[1])?,
        int(kp)?,
    ];
    // Weights as `[Cout, KP]` rows in the columns' (r, s, c) order, zeros in the padding.
    let mut wcol = vec![0f32; cout * kp];
    for co in 0..cout {
        for c in 0..cin {
            for r in 0..kh {
                for s in 0..kw {
                    wcol[co * kp + (r * kw + s) * cin + c] = weight[((co * cin + c) * kh + r) * kw + s];
                }
            }
        }
    }
    let elem = ctx.elem();
    let wbuf = ctx.upload(&wcol)?;
    let bbuf = ctx.upload(bias)?;
    let path = ctx.node(node).path.clone();
    let matmul = LtMatmul::new(&path, ctx.precision(), elem, kp, cout, Some(&bbuf), a.act == Activation::Relu)?;
    let rows_per_image = ho * wo;
    // Chunks smaller than the whole column matrix at the max batch, and one that holds it whole.
    let whole = ctx.config.max_batch.max(1) * rows_per_image * kp * elem.size();
    let mut chunks: Vec<usize> = CHUNK_BYTES.iter().copied().filter(|&c| c < whole).collect();
    chunks.extend(CHUNK_BYTES.iter().copied().find(|&c| c >= whole));
    ctx.kernels.add_source("im2col.cu", IM2COL_CU)?;
    let shared = Arc::new(Shared {
        path,
        x,
        y,
        rows_per_image,
        dims,
        kp,
        cout,
        im2col: ctx.kernels.get("im2col_f16")?,
        w_ptr: wbuf.ptr(),
        _w: wbuf,
        _b: bbuf,
        matmul,
        sm_count: ctx.kernels.sm_count(),
    });
    Ok(chunks.into_iter().map(|chunk_bytes| Box::new(Im2colGemm { shared: shared.clone(), chunk_bytes }) as Box<dyn Layer>).collect())
}

impl Im2colGemm {
    /// GEMM rows per chunk and in all, at `batch`.
    fn chunking(&self, batch: usize) -> (usize, usize) {
        let s = &self.shared;
        let total = batch * s.rows_per_image;
        ((self.chunk_bytes / (s.kp * 2)).clamp(1, total.max(1)), total)
    }

    /// The distinct row counts of the GEMMs run at `batch` (full chunks and the last one).
    fn gemm_rows(&self, batch: usize) -> impl Iterator<Item = usize> {
        let (chunk, total) = self.chunking(batch);
        [chunk.min(total), total % chunk].into_iter().filter(|&m| m > 0)
    }

    /// Bytes of the column chunk at `batch`; the GEMM's own workspace follows it, aligned.
    fn col_bytes(&self, batch: usize) -> usize {
        (self.chunking(batch).0 * self.shared.kp * 2).next_multiple_of(crate::engine::arena::ALIGN)
    }
}

impl Layer for Im2colGemm {
    fn path(&self) -> &str {
        &self.shared.path
    }
    fn kind(&self) -> String {
        format!("im2col-gemm:{}MiB", self.chunk_bytes >> 20)
    }
    fn workspace_bytes(&self, batch: usize) -> usize {
        self.col_bytes(batch) + self.gemm_rows(batch).map(|m| self.shared.matmul.workspace(m, 1)).max().unwrap_or(0)
    }
    fn prepare(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        self.gemm_rows(batch).try_for_each(|m| self.shared.matmul.prepare(rt, m, 1))
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let s = &self.shared;
        let (chunk_rows, total) = self.chunking(batch);
        let col_bytes = self.col_bytes(batch);
        if rt.workspace_bytes < col_bytes {
            return Err(crate::Error::Lower {
                path: s.path.clone(),
                op: "conv2d".into(),
                kind: LowerKind::Workspace,
                reason: format!("im2col needs {col_bytes} bytes of workspace at batch {batch}, the run gives {}", rt.workspace_bytes),
            });
        }
        let col = rt.workspace;
        let gemm_rt = RunCtx { workspace: rt.workspace + col_bytes as u64, workspace_bytes: rt.workspace_bytes - col_bytes, ..*rt };
        let (x, y) = (rt.ptr(s.x), rt.ptr(s.y));
        let mut row0 = 0;
        while row0 < total {
            let m = chunk_rows.min(total - row0);
            let mut args = vec![KArg::Ptr(x), KArg::Ptr(col), KArg::I64(row0 as i64), KArg::I64(m as i64)];
            args.extend(s.dims.iter().map(|&d| KArg::I32(d)));
            launch(rt, &s.im2col, grid_for(m * (s.kp / 8), s.sm_count), (BLOCK, 1, 1), 0, &args)?;
            let yc = y + (row0 * s.cout * 2) as u64;
            s.matmul.enqueue(&gemm_rt, m, col, s.w_ptr, 0, yc)?;
            row0 += m;
        }
        Ok(())
    }
}
