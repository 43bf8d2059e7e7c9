//! Scaled dot-product attention, `softmax(scale · Q·Kᵀ + bias) · V`: PyTorch's
//! `F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)` with an additive float
//! mask. ViT's `nn.MultiheadAttention` and Swin's window attention are written with it
//! (`models/src/vit.rs`, `models/src/swin.rs`); Swin's relative position bias and shifted-window
//! mask are constants computed at trace time and passed as one bias.
//!
//! On the GPU two candidates are timed per layer (`BuildCtx::choose`):
//! - `cublaslt-attention`: a strided-batched cuBLASLt GEMM for f32 scores, our softmax kernel
//!   (bias added, f32 statistics) writing probabilities, and a second batched GEMM for `P·V`;
//! - `kernel:flash_attn`: our flash-attention-style kernel (`kernels/attention.cu`: online
//!   softmax, K/V tiles in shared memory, f32 accumulators), for head dims 32 and 64.

use crate::engine::gemm::{Batched, LtMatmul, GEMM_WORKSPACE};
use crate::engine::kernel_layers::{launch, CudaFunction, KArg};
use crate::engine::{BuildCtx, DeviceBuf, Elem, Layer, RunCtx, ValueId};
use crate::graph::{HostTensor, NodeId, Op};
use crate::ops::{CpuArgs, OpDef};
use crate::tensor::{Param, Tensor};
use crate::Result;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Attention. Inputs: q `[N, ..., L, D]`, k `[N, ..., S, D]`, v `[N, ..., S, Dv]` (the same
/// leading dims), then, when `bias`, an additive bias that broadcasts to `[N, ..., L, S]`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attention {
    /// Multiplies `Q·Kᵀ` (PyTorch's default is `1 / sqrt(D)`; tracing fills it in).
    pub scale: f32,
    pub bias: bool,
}

impl Default for Attention {
    fn default() -> Self {
        Self { scale: 1.0, bias: false }
    }
}

impl OpDef for Attention {
    fn name(&self) -> &str {
        "attention"
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        attention_shape(self.bias, inputs)
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, String> {
        attention_cpu(self.scale, self.bias, &args.all()?)
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        gpu_attention(ctx, node, *self)
    }
    fn label(&self) -> String {
        format!("attention scale={}{}", self.scale, if self.bias { " +bias" } else { "" })
    }
}

impl Tensor {
    /// `F.scaled_dot_product_attention(self, k, v, attn_mask=bias, scale=scale)` with `self` the
    /// queries; `scale` defaults to `1 / sqrt(D)`. A constant bias is `attention_weight`'s.
    pub fn attention(&self, k: &Tensor, v: &Tensor, bias: Option<&Tensor>, scale: Option<f32>) -> Result<Tensor> {
        let op = Op::Attention(Attention { scale: self.default_scale(scale), bias: bias.is_some() });
        let inputs: Vec<&Tensor> = [self, k, v].into_iter().chain(bias).collect();
        Tensor::record_inline(op, &inputs)
    }
    /// `attention` with a constant additive bias (Swin's relative position bias and window mask),
    /// recorded as the layer at `path`.
    pub fn attention_weight(&self, path: &str, k: &Tensor, v: &Tensor, bias: &Param, scale: Option<f32>) -> Result<Tensor> {
        let op = Op::Attention(Attention { scale: self.default_scale(scale), bias: true });
        Tensor::record(path, op, &[self, k, v], &[bias])
    }
    fn default_scale(&self, scale: Option<f32>) -> f32 {
        scale.unwrap_or_else(|| 1.0 / (self.shape().last().copied().unwrap_or(1).max(1) as f32).sqrt())
    }
}

/// `inputs` = q, k, v (and the bias when `bias`): the output `[N, ..., L, Dv]`.
pub fn attention_shape(bias: bool, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
    let want = 3 + bias as usize;
    if inputs.len() != want {
        return Err(format!("attention expects {want} inputs (q, k, v{}), got {}", if bias { ", bias" } else { "" }, inputs.len()));
    }
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    let r = q.len();
    if r < 3 || k.len() != r || v.len() != r {
        return Err(format!("attention expects q, k, v of one rank >= 3 ([N, ..., L, D]), got {q:?}, {k:?}, {v:?}"));
    }
    if q[..r - 2] != k[..r - 2] || q[..r - 2] != v[..r - 2] {
        return Err(format!("q {q:?}, k {k:?} and v {v:?} must have the same leading dims"));
    }
    if q[r - 1] != k[r - 1] || k[r - 2] != v[r - 2] {
        return Err(format!("q {q:?}, k {k:?}, v {v:?}: q and k need one head dim, k and v one length"));
    }
    if bias {
        let scores: Vec<usize> = [&q[..r - 1], &[k[r - 2]][..]].concat();
        bias_strides(inputs[3], &scores)?;
    }
    Ok([&q[..r - 1], &[v[r - 1]][..]].concat())
}

/// The element strides of `bias` broadcast (aligned right, as PyTorch) to `scores`, 0 where it
/// broadcasts; an error naming both shapes where it does not fit.
fn bias_strides(bias: &[usize], scores: &[usize]) -> Result<Vec<usize>, String> {
    if bias.len() > scores.len() {
        return Err(format!("the attention bias {bias:?} has more dims than the scores {scores:?}"));
    }
    let lead = scores.len() - bias.len();
    let mut strides = vec![0; scores.len()];
    let mut stride = 1usize;
    for (i, &b) in bias.iter().enumerate().rev() {
        let s = scores[lead + i];
        if b == s && b != 1 {
            strides[lead + i] = stride;
        } else if b != 1 {
            return Err(format!("the attention bias {bias:?} does not broadcast to the scores {scores:?}"));
        }
        stride = stride.checked_mul(b).ok_or_else(|| format!("the attention bias {bias:?} is too large"))?;
    }
    Ok(strides)
}

// ---- CPU reference

/// Per (image, head) problem: `scale · Q·Kᵀ` by one GEMM, the bias added, softmax in f32 with the
/// row maximum subtracted (PyTorch's), then `P·V` by a second GEMM.
pub fn attention_cpu(scale: f32, bias: bool, inputs: &[&HostTensor]) -> Result<HostTensor, String> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let out_shape = attention_shape(bias, &shapes)?;
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    let r = q.shape.len();
    let (l, d, s, dv) = (q.shape[r - 2], q.shape[r - 1], k.shape[r - 2], v.shape[r - 1]);
    let lead = &q.shape[..r - 2];
    let count: usize = lead.iter().product();
    let scores_shape: Vec<usize> = [lead, &[l, s][..]].concat();
    let bias = if bias { Some((inputs[3], bias_strides(&inputs[3].shape, &scores_shape)?)) } else { None };
    let mut out = vec![0.0f32; count * l * dv];
    let mut p = vec![0.0f32; l * s];
    for z in 0..count {
        if l * s == 0 {
            break;
        }
        if d > 0 {
            // SAFETY: q's block at z is l×d row-major, k's is s×d read transposed (strides 1, d),
            // p is l×s; the shape rule checked the extents.
            unsafe {
                matrixmultiply::sgemm(
                    l,
                    d,
                    s,
                    scale,
                    q.data[z * l * d..].as_ptr(),
                    d as isize,
                    1,
                    k.data[z * s * d..].as_ptr(),
                    1,
                    d as isize,
                    0.0,
                    p.as_mut_ptr(),
                    s as isize,
                    1,
                )
            }
        } else {
            p.fill(0.0);
        }
        if let Some((b, st)) = &bias {
            // The bias offset of problem z from its leading indices.
            let (mut rem, mut base) = (z, 0);
            for i in (0..lead.len()).rev() {
                base += (rem % lead[i]) * st[i];
                rem /= lead[i];
            }
            let (sl, ss) = (st[r - 2], st[r - 1]);
            for (i, row) in p.chunks_exact_mut(s).enumerate() {
                row.iter_mut().enumerate().for_each(|(j, x)| *x += b.data[base + i * sl + j * ss]);
            }
        }
        for row in p.chunks_exact_mut(s) {
            let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            row.iter_mut().for_each(|x| {
                *x = (*x - m).exp();
                sum += *x;
            });
            row.iter_mut().for_each(|x| *x /= sum);
        }
        if dv > 0 {
            // SAFETY: p is l×s, v's block at z is s×dv row-major, out's block is l×dv.
            unsafe {
                matrixmultiply::sgemm(
                    l,
                    s,
                    dv,
                    1.0,
                    p.as_ptr(),
                    s as isize,
                    1,
                    v.data[z * s * dv..].as_ptr(),
                    dv as isize,
                    1,
                    0.0,
                    out[z * l * dv..].as_mut_ptr(),
                    dv as isize,
                    1,
                )
            }
        }
    }
    Ok(HostTensor::new(out_shape, out))
}

// ---- GPU converter

/// The problem of one attention node: `zimg` (head, window, ...) problems per image.
#[derive(Clone, Copy)]
struct Dims {
    zimg: usize,
    l: usize,
    s: usize,
    d: usize,
    dv: usize,
}

/// Broadcasts a constant bias to f32 `[zimg, L, S]` (the same for every image): the layout both
/// candidates read.
fn host_bias(bias: &HostTensor, q: &[usize], dims: Dims) -> std::result::Result<Vec<f32>, String> {
    // Full scores shape with a batch of 1: the bias must not vary along the batch.
    let scores: Vec<usize> = [&[1usize][..], &q[..q.len() - 1], &[dims.s][..]].concat();
    let st = bias_strides(&bias.shape, &scores)?;
    let lead = &scores[1..scores.len() - 2];
    let r = scores.len();
    let mut out = Vec::with_capacity(dims.zimg * dims.l * dims.s);
    for z in 0..dims.zimg {
        let (mut rem, mut base) = (z, 0);
        for i in (0..lead.len()).rev() {
            base += (rem % lead[i]) * st[i + 1];
            rem /= lead[i];
        }
        for i in 0..dims.l {
            out.extend((0..dims.s).map(|j| bias.data[base + i * st[r - 2] + j * st[r - 1]]));
        }
    }
    Ok(out)
}

fn gpu_attention(ctx: &mut BuildCtx, node: NodeId, attrs: Attention) -> Result<Box<dyn Layer>> {
    let (q, k, v, y) = (ctx.input(node, 0)?, ctx.input(node, 1)?, ctx.input(node, 2)?, ctx.output(node)?);
    let (dq, dk, dvv, dy) = (ctx.value(q).clone(), ctx.value(k).clone(), ctx.value(v).clone(), ctx.value(y).clone());
    let contiguous = |d: &crate::engine::ValueDesc| d.layout.same_bytes(crate::engine::Layout::contiguous(d.dims.len()), &d.dims);
    if ![&dq, &dk, &dvv, &dy].iter().all(|d| contiguous(d)) {
        return Err(ctx.err(node, format!("attention reads contiguous q, k, v, got {:?} {:?} {:?}", dq.layout, dk.layout, dvv.layout)));
    }
    let r = dq.dims.len();
    if r < 2 {
        return Err(ctx.err(node, format!("q {:?} needs [.., L, D] per image", dq.dims)));
    }
    let dims =
        Dims { zimg: dq.dims[..r - 2].iter().product(), l: dq.dims[r - 2], s: dk.dims[r - 2], d: dq.dims[r - 1], dv: dvv.dims[r - 1] };
    let bias = if attrs.bias {
        let b = ctx.weight(node, 3).map_err(|_| ctx.err(node, "the GPU engine takes a constant attention bias only (a weight)".into()))?;
        let host = host_bias(b, &dq.dims, dims).map_err(|e| ctx.err(node, e))?;
        Some(Arc::new(ctx.upload_f32(&host)?))
    } else {
        None
    };
    let int = |what: &str, v: usize| i32::try_from(v).map_err(|_| ctx.err(node, format!("{what} = {v} exceeds the kernels' 32-bit range")));
    let (li, si) = (int("L", dims.l)?, int("S", dims.s)?);
    let elem = ctx.elem();
    let path = ctx.node(node).path.clone();
    let mut candidates: Vec<Box<dyn Layer>> = Vec::new();

    // (a) cuBLASLt: scores (f32) = scale · Q·Kᵀ, softmax kernel, Y = P·V. Score and probability
    // rows are `ld` = S rounded up to 8 apart, so every f16 row and matrix is 16-byte aligned.
    let ld = dims.s.next_multiple_of(8);
    let ldi = int("S rounded up to 8", ld)?;
    let scores_bytes = dims.zimg.checked_mul(dims.l * ld).ok_or_else(|| ctx.err(node, "scores too large".into()))?;
    let scores = ctx.scratch(scores_bytes * Elem::F32.size());
    let probs = ctx.scratch(scores_bytes * elem.size());
    let qk = LtMatmul::new_batched(
        &path,
        ctx.precision(),
        elem,
        dims.d,
        dims.s,
        Batched {
            w_kn: false,
            stride_x: dims.l * dims.d,
            stride_w: dims.s * dims.d,
            stride_y: dims.l * ld,
            alpha: attrs.scale,
            out_elem: Elem::F32,
            ld_x: 0,
            ld_y: ld,
        },
    )?;
    let pv = LtMatmul::new_batched(
        &path,
        ctx.precision(),
        elem,
        dims.s,
        dims.dv,
        Batched {
            w_kn: true,
            stride_x: dims.l * ld,
            stride_w: dims.s * dims.dv,
            stride_y: dims.l * dims.dv,
            alpha: 1.0,
            out_elem: elem,
            ld_x: ld,
            ld_y: 0,
        },
    )?;
    candidates.push(Box::new(GemmAttention {
        path: path.clone(),
        qk,
        pv,
        softmax: ctx.kernels.get(&format!("attn_softmax_{}", elem.suffix()))?,
        io: [q, k, v, y],
        scores,
        probs,
        bias: bias.clone(),
        dims,
        li,
        si,
        ldi,
        sm_count: ctx.kernels.sm_count(),
    }));

    // (b) the fused kernels, for the head dims they are stamped for: on CUDA cores, and for f16 on
    // tensor cores.
    if dims.d == dims.dv && matches!(dims.d, 32 | 64) {
        let f = ctx.kernels.get(&format!("flash_attn_d{}_{}", dims.d, elem.suffix()))?;
        let io = [q, k, v, y];
        candidates.push(Box::new(FusedAttention {
            path: path.clone(),
            f,
            tc: false,
            io,
            bias: bias.clone(),
            dims,
            li,
            si,
            scale: attrs.scale,
        }));
        if elem == Elem::F16 {
            let f = ctx.kernels.get(&format!("flash_attn_tc_d{}_f16", dims.d))?;
            candidates.push(Box::new(FusedAttention { path, f, tc: true, io, bias, dims, li, si, scale: attrs.scale }));
        }
    }
    let key = ctx.problem_key(node);
    ctx.choose(&key, candidates)
}

/// Attention as two strided-batched cuBLASLt GEMMs around our softmax kernel.
struct GemmAttention {
    path: String,
    qk: LtMatmul,
    pv: LtMatmul,
    softmax: CudaFunction,
    /// q, k, v, y.
    io: [ValueId; 4],
    scores: ValueId,
    probs: ValueId,
    bias: Option<Arc<DeviceBuf>>,
    dims: Dims,
    li: i32,
    si: i32,
    /// Row stride of the scores and probabilities (S rounded up to 8).
    ldi: i32,
    sm_count: u32,
}

impl Layer for GemmAttention {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "cublaslt-attention".into()
    }
    fn workspace_bytes(&self, _batch: usize) -> usize {
        GEMM_WORKSPACE
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let [q, k, v, y] = self.io.map(|v| rt.ptr(v));
        let count = batch * self.dims.zimg;
        let (scores, probs) = (rt.ptr(self.scores), rt.ptr(self.probs));
        self.qk.enqueue_batched(rt, self.dims.l, count, q, k, 0, scores)?;
        let rows = count * self.dims.l;
        // One warp a row, 8 warps a block; the kernel strides over the rest.
        let blocks = (rows.div_ceil(8) as u64).min(self.sm_count as u64 * 64).max(1) as u32;
        let args = [
            KArg::Ptr(scores),
            KArg::Ptr(self.bias.as_ref().map_or(0, |b| b.ptr())),
            KArg::Ptr(probs),
            KArg::I64(rows as i64),
            KArg::I32(self.li),
            KArg::I32(self.si),
            KArg::I32(self.ldi),
            KArg::I64(self.dims.zimg.max(1) as i64),
        ];
        launch(rt, &self.softmax, (blocks, 1, 1), (256, 1, 1), 0, &args)?;
        self.pv.enqueue_batched(rt, self.dims.l, count, probs, v, 0, y)
    }
}

/// Attention as one launch of our fused kernel: grid (problems, query tiles of 64 rows).
struct FusedAttention {
    path: String,
    f: CudaFunction,
    /// The tensor-core kernel (4 warps of 16 rows a block) rather than the CUDA-core one.
    tc: bool,
    io: [ValueId; 4],
    bias: Option<Arc<DeviceBuf>>,
    dims: Dims,
    li: i32,
    si: i32,
    scale: f32,
}

/// Query rows per block of the fused kernel (`ATTN_BQ` in kernels/attention.cu).
const FUSED_ROWS: usize = 64;

impl Layer for FusedAttention {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        format!("kernel:flash_attn{}_d{}", if self.tc { "_tc" } else { "" }, self.dims.d)
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let [q, k, v, y] = self.io.map(|v| rt.ptr(v));
        let z = u32::try_from(batch * self.dims.zimg).map_err(|_| crate::Error::Lower {
            path: self.path.clone(),
            op: "attention".into(),
            reason: format!("{} problems exceed the grid", batch * self.dims.zimg),
        })?;
        let tiles = self.dims.l.div_ceil(FUSED_ROWS).clamp(1, 65535) as u32;
        let args = [
            KArg::Ptr(q),
            KArg::Ptr(k),
            KArg::Ptr(v),
            KArg::Ptr(self.bias.as_ref().map_or(0, |b| b.ptr())),
            KArg::Ptr(y),
            KArg::I32(self.li),
            KArg::I32(self.si),
            // Contiguous [Z, L, D] operands: one head per problem, rows D apart.
            KArg::I32(1),
            KArg::I64(self.dims.d as i64),
            KArg::I64(self.dims.d as i64),
            KArg::I64(self.dims.d as i64),
            KArg::I64(self.dims.zimg.max(1) as i64),
            KArg::F32(self.scale),
        ];
        let threads = if self.tc { 128 } else { FUSED_ROWS as u32 };
        launch(rt, &self.f, (z.max(1), tiles, 1), (threads, 1, 1), 0, &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_shape_checks_heads_lengths_and_bias() {
        assert_eq!(attention_shape(false, &[&[2, 3, 5, 8], &[2, 3, 7, 8], &[2, 3, 7, 4]]), Ok(vec![2, 3, 5, 4]));
        assert_eq!(attention_shape(true, &[&[2, 3, 5, 8], &[2, 3, 7, 8], &[2, 3, 7, 8], &[3, 5, 7]]), Ok(vec![2, 3, 5, 8]));
        assert!(attention_shape(true, &[&[2, 3, 5, 8], &[2, 3, 7, 8], &[2, 3, 7, 8], &[4, 5, 7]]).unwrap_err().contains("[4, 5, 7]"));
        assert!(attention_shape(false, &[&[2, 3, 5, 8], &[2, 3, 7, 6], &[2, 3, 7, 8]]).unwrap_err().contains("[2, 3, 7, 6]"));
        assert!(attention_shape(false, &[&[2, 3, 5, 8], &[2, 4, 7, 8], &[2, 4, 7, 8]]).is_err());
        assert!(attention_shape(false, &[&[2, 3, 5, 8], &[2, 3, 7, 8]]).is_err());
    }

    #[test]
    fn host_bias_broadcasts_per_problem() {
        // q [N, 2 windows, 3 heads, L=2, D]; bias [2, 1, 2, 2] varies by window, not by head.
        let bias = HostTensor::new(vec![2, 1, 2, 2], (0..8).map(|v| v as f32).collect());
        let dims = Dims { zimg: 6, l: 2, s: 2, d: 4, dv: 4 };
        let out = host_bias(&bias, &[2, 3, 2, 4], dims).unwrap();
        assert_eq!(&out[..4], &[0.0, 1.0, 2.0, 3.0]);
        assert_eq!(&out[8..12], &[0.0, 1.0, 2.0, 3.0], "head 2 of window 0 reads window 0's bias");
        assert_eq!(&out[12..16], &[4.0, 5.0, 6.0, 7.0], "window 1");
    }
}
