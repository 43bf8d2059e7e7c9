//! Scaled dot-product attention, `softmax(scale · Q·Kᵀ + bias) · V`: PyTorch's
//! `F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)` with an additive float
//! mask, in two ops:
//! - `attention` (`Attention`): q, k and v as three tensors `[N, ..., L, D]`;
//! - `qkv_attention` (`QkvAttention`): multi-head self-attention straight on a packed projection
//!   `[N, G..., L, 3·H·D]` (q, k, v, each H heads of D, the order of `nn.MultiheadAttention`'s
//!   `in_proj` and Swin's `qkv` Linear), writing the heads concatenated `[N, G..., L, H·D]`. Written
//!   with `attention`, a transformer block needs reshape → permute → narrow before it and permute →
//!   reshape after it, which the engine runs as copies (~0.26 ms per Swin-T block at batch 64 on an
//!   H100); here the kernels read q, k and v where the projection wrote them and write each head's
//!   rows into place. ViT's `nn.MultiheadAttention` and Swin's window attention use it
//!   (`models/src/vit.rs`, `models/src/swin.rs`); Swin's relative position bias and shifted-window
//!   mask are constants computed at trace time and passed as one bias.
//!
//! On the GPU the candidates are timed per layer (`BuildCtx::choose`):
//! - `cublaslt-attention`: a strided-batched cuBLASLt GEMM for f32 scores, our softmax kernel
//!   (bias added, f32 statistics) writing probabilities, and a second batched GEMM for `P·V`; for
//!   `qkv_attention`, `cublaslt-attention:unpacked`: the same between a copy of q, k and v out of
//!   the packed rows into scratch and a copy of the result back (any head dim);
//! - `kernel:flash_attn_d{32,64}`: our flash-attention-style kernel on CUDA cores
//!   (`kernels/attention.cu`: online softmax, K/V tiles in shared memory, f32 accumulators);
//! - `kernel:flash_attn_tc_d{32,64}`: its tensor-core twin, FP16 engines only;
//! - `kernel:flash_attn_tcs_q64_d{32,64}` and `kernel:flash_attn_tcs_qall_d{32,64}`: the
//!   tensor-core kernel with all of a problem's keys and values resident in shared memory (one
//!   copy, no masking but on the last keys), where they fit the GPU's shared memory per block; a
//!   block takes 64 query rows, or every query row of its problem (K and V read once).
//!
//! Both fused kernels take row strides and a head count, so one signature serves both ops: problem
//! `z` of a batch is head `z % heads` of row block `z / heads`, whose q rows are `ldq` elements
//! apart and start `h·D` into the row (k and v alike with `ldkv`, y with `ldy`).

use crate::engine::arena::ALIGN;
use crate::engine::gemm::{Batched, LtMatmul, GEMM_WORKSPACE};
use crate::engine::launch::{grid_for, launch, CudaFunction, KArg, BLOCK};
use crate::engine::{DeviceBuf, Elem, Layer, Layout, RunCtx, ValueDesc, ValueId};
use crate::error::OpError;
use crate::graph::{HostTensor, NodeId, Op};
use crate::ops::BuildCtx;
use crate::ops::{CpuArgs, FixtureTwin, OpDef};
use crate::tensor::{Param, Tensor};
use crate::LowerKind;
use crate::Result;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
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
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
        attention_shape(self.bias, inputs)
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, OpError> {
        attention_cpu(self.scale, self.bias, &args.all()?)
    }
    fn entry_points(&self) -> Vec<String> {
        entry_points()
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        gpu_attention(ctx, node, *self)
    }
    fn label(&self) -> String {
        format!("attention scale={}{}", self.scale, if self.bias { " +bias" } else { "" })
    }
}

/// Multi-head self-attention on a packed projection. Inputs: qkv `[N, G..., L, 3·H·D]`, whose last
/// dim holds q, k and v in that order, each `heads` heads of D (`reshape(.., L, 3, H, D)`), then,
/// when `bias`, an additive bias that broadcasts to one image's scores `[G..., H, L, L]` (it may
/// not vary with the batch). Output `[N, G..., L, H·D]`: each head's rows in place, as
/// `attention`'s `[N, G..., H, L, D]` permuted to `[N, G..., L, H, D]` and reshaped.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct QkvAttention {
    pub heads: usize,
    /// Multiplies `Q·Kᵀ` (PyTorch's default is `1 / sqrt(D)`; tracing fills it in).
    pub scale: f32,
    pub bias: bool,
}

impl Default for QkvAttention {
    fn default() -> Self {
        Self { heads: 1, scale: 1.0, bias: false }
    }
}

impl OpDef for QkvAttention {
    fn name(&self) -> &str {
        "qkv_attention"
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
        qkv_attention_shape(self.heads, self.bias, inputs)
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, OpError> {
        qkv_attention_cpu(*self, &args.all()?)
    }
    fn entry_points(&self) -> Vec<String> {
        entry_points()
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        gpu_qkv_attention(ctx, node, *self)
    }
    fn label(&self) -> String {
        format!("qkv_attention heads={} scale={}{}", self.heads, self.scale, if self.bias { " +bias" } else { "" })
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

    /// Multi-head self-attention on `self`, a packed projection `[N, ..., L, 3·heads·D]` (q, k, v,
    /// each `heads` heads of D): `[N, ..., L, heads·D]`, the heads concatenated. The same as
    /// splitting q, k and v into `[N, ..., heads, L, D]`, `attention`, and moving the heads back
    /// next to D, without the copies. `scale` defaults to `1 / sqrt(D)`; `bias` broadcasts to
    /// `[..., heads, L, L]`. A constant bias is `qkv_attention_weight`'s.
    pub fn qkv_attention(&self, heads: usize, bias: Option<&Tensor>, scale: Option<f32>) -> Result<Tensor> {
        let op = Op::QkvAttention(QkvAttention { heads, scale: self.packed_scale(heads, scale), bias: bias.is_some() });
        let inputs: Vec<&Tensor> = [self].into_iter().chain(bias).collect();
        Tensor::record_inline(op, &inputs)
    }
    /// `qkv_attention` with a constant additive bias (Swin's relative position bias and window
    /// mask, `[windows, heads, L, L]`), recorded as the layer at `path`.
    pub fn qkv_attention_weight(&self, path: &str, heads: usize, bias: &Param, scale: Option<f32>) -> Result<Tensor> {
        let op = Op::QkvAttention(QkvAttention { heads, scale: self.packed_scale(heads, scale), bias: true });
        Tensor::record(path, op, &[self], &[bias])
    }
    /// `1 / sqrt(D)` with D the head dim of a packed projection (a shape that does not divide is
    /// the shape rule's error, so any value does here).
    fn packed_scale(&self, heads: usize, scale: Option<f32>) -> f32 {
        let d = self.shape().last().copied().unwrap_or(1).checked_div(heads.saturating_mul(3)).unwrap_or(1);
        scale.unwrap_or_else(|| 1.0 / (d.max(1) as f32).sqrt())
    }
}

/// `inputs` = q, k, v (and the bias when `bias`): the output `[N, ..., L, Dv]`.
pub fn attention_shape(bias: bool, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    let want = 3 + bias as usize;
    if inputs.len() != want {
        return Err(format!("attention expects {want} inputs (q, k, v{}), got {}", if bias { ", bias" } else { "" }, inputs.len()).into());
    }
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    let r = q.len();
    if r < 3 || k.len() != r || v.len() != r {
        return Err(format!("attention expects q, k, v of one rank >= 3 ([N, ..., L, D]), got {q:?}, {k:?}, {v:?}").into());
    }
    if q[..r - 2] != k[..r - 2] || q[..r - 2] != v[..r - 2] {
        return Err(format!("q {q:?}, k {k:?} and v {v:?} must have the same leading dims").into());
    }
    if q[r - 1] != k[r - 1] || k[r - 2] != v[r - 2] {
        return Err(format!("q {q:?}, k {k:?}, v {v:?}: q and k need one head dim, k and v one length").into());
    }
    if bias {
        let scores: Vec<usize> = [&q[..r - 1], &[k[r - 2]][..]].concat();
        bias_strides(inputs[3], &scores)?;
    }
    Ok([&q[..r - 1], &[v[r - 1]][..]].concat())
}

/// The element strides of `bias` broadcast (aligned right, as PyTorch) to `scores`, 0 where it
/// broadcasts; an error naming both shapes where it does not fit.
fn bias_strides(bias: &[usize], scores: &[usize]) -> Result<Vec<usize>, OpError> {
    if bias.len() > scores.len() {
        return Err(format!("the attention bias {bias:?} has more dims than the scores {scores:?}").into());
    }
    let lead = scores.len() - bias.len();
    let mut strides = vec![0; scores.len()];
    let mut stride = 1usize;
    for (i, &b) in bias.iter().enumerate().rev() {
        let s = scores[lead + i];
        if b == s && b != 1 {
            strides[lead + i] = stride;
        } else if b != 1 {
            return Err(format!("the attention bias {bias:?} does not broadcast to the scores {scores:?}").into());
        }
        stride = stride.checked_mul(b).ok_or_else(|| format!("the attention bias {bias:?} is too large"))?;
    }
    Ok(strides)
}

/// `inputs` = qkv (and the bias when `bias`): the output `[N, G..., L, heads·D]`.
pub fn qkv_attention_shape(heads: usize, bias: bool, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    let want = 1 + bias as usize;
    if inputs.len() != want {
        return Err(format!("qkv_attention expects {want} inputs (qkv{}), got {}", if bias { ", bias" } else { "" }, inputs.len()).into());
    }
    let qkv = inputs[0];
    let r = qkv.len();
    if r < 3 {
        return Err(format!("qkv_attention expects qkv of rank >= 3 ([N, ..., L, 3·heads·D]), got {qkv:?}").into());
    }
    if heads == 0 {
        return Err(format!("qkv_attention needs at least one head (qkv {qkv:?})").into());
    }
    let packed = heads.checked_mul(3).ok_or_else(|| format!("qkv_attention: {heads} heads is too many"))?;
    if !qkv[r - 1].is_multiple_of(packed) {
        return Err(format!(
            "the last dim of qkv {qkv:?} ({}) is not divisible by 3 · {heads} heads = {packed} (q, k and v of {heads} heads each)",
            qkv[r - 1]
        )
        .into());
    }
    if bias {
        bias_strides(inputs[1], &packed_scores(qkv, heads))?;
    }
    Ok([&qkv[..r - 1], &[qkv[r - 1] / 3][..]].concat())
}

/// One image's scores of a packed attention, `[1, G..., H, L, L]`: what its bias broadcasts to
/// (a constant bias is the same for every image, so its batch dim, if any, is 1).
fn packed_scores(qkv: &[usize], heads: usize) -> Vec<usize> {
    let r = qkv.len();
    [&[1][..], &qkv[1..r - 2], &[heads, qkv[r - 2], qkv[r - 2]][..]].concat()
}

// ---- CPU reference

/// Per (image, head) problem: `scale · Q·Kᵀ` by one GEMM, the bias added, softmax in f32 with the
/// row maximum subtracted (PyTorch's), then `P·V` by a second GEMM.
pub fn attention_cpu(scale: f32, bias: bool, inputs: &[&HostTensor]) -> Result<HostTensor, OpError> {
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

/// The packed op on the CPU: q, k and v copied out of the packed rows into `[N, G..., H, L, D]`,
/// `attention_cpu` (so the arithmetic is exactly `attention`'s), the result's heads moved back
/// into each row. The two copies cost nothing next to the GEMMs.
pub fn qkv_attention_cpu(attrs: QkvAttention, inputs: &[&HostTensor]) -> Result<HostTensor, OpError> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let out_shape = qkv_attention_shape(attrs.heads, attrs.bias, &shapes)?;
    let x = inputs[0];
    let r = x.shape.len();
    let (rows, l, h) = (x.shape[..r - 2].iter().product::<usize>(), x.shape[r - 2], attrs.heads);
    let d = x.shape[r - 1] / (3 * h);
    let split: Vec<usize> = [&x.shape[..r - 2], &[h, l, d][..]].concat();
    let mut parts = [vec![0.0f32; rows * h * l * d], vec![0.0f32; rows * h * l * d], vec![0.0f32; rows * h * l * d]];
    if d > 0 {
        // Row `i` of block `o` holds q's heads, then k's, then v's, D values each.
        for (oi, row) in x.data.chunks_exact(3 * h * d).enumerate() {
            let (o, i) = (oi / l, oi % l);
            for (p, part) in parts.iter_mut().enumerate() {
                for hh in 0..h {
                    let at = ((o * h + hh) * l + i) * d;
                    part[at..at + d].copy_from_slice(&row[(p * h + hh) * d..][..d]);
                }
            }
        }
    }
    let [q, k, v] = parts.map(|p| HostTensor::new(split.clone(), p));
    let mut args = vec![&q, &k, &v];
    args.extend(inputs.get(1).copied().filter(|_| attrs.bias));
    let y = attention_cpu(attrs.scale, attrs.bias, &args)?;
    let mut out = vec![0.0f32; rows * l * h * d];
    if l * d > 0 {
        for (ohi, head_rows) in y.data.chunks_exact(l * d).enumerate() {
            let (o, hh) = (ohi / h, ohi % h);
            for (i, src) in head_rows.chunks_exact(d).enumerate() {
                let at = ((o * l + i) * h + hh) * d;
                out[at..at + d].copy_from_slice(src);
            }
        }
    }
    Ok(HostTensor::new(out_shape, out))
}

// ---- GPU converter

/// The problem of one attention node: `zimg` (head, window, ...) problems per image.
#[derive(Clone, Copy, Debug)]
struct Dims {
    zimg: usize,
    l: usize,
    s: usize,
    d: usize,
    dv: usize,
}

/// Broadcasts a constant bias to f32 `[zimg, L, S]` (the same for every image): the layout every
/// candidate reads. `q` is one image's q `[..., L, D]` (for the packed op, `[G..., H, L, D]`).
fn host_bias(bias: &HostTensor, q: &[usize], dims: Dims) -> std::result::Result<Vec<f32>, OpError> {
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

/// The node's constant bias (input `index`) broadcast by `host_bias` and uploaded, when it has one.
fn upload_bias(ctx: &mut BuildCtx, node: NodeId, index: usize, q: &[usize], dims: Dims) -> Result<Option<Arc<DeviceBuf>>> {
    let b = ctx
        .weight(node, index)
        .map_err(|_| ctx.err(node, LowerKind::Weights, "the GPU engine takes a constant attention bias only (a weight)"))?;
    let host = host_bias(b, q, dims).map_err(|e| ctx.err(node, LowerKind::Operands, e))?;
    Ok(Some(Arc::new(ctx.upload_f32(&host)?)))
}

fn is_contiguous(d: &ValueDesc) -> bool {
    d.layout.same_bytes(Layout::contiguous(d.dims.len()), &d.dims)
}

/// `v` as a kernel's 32-bit argument, or an error naming what it is.
fn int(ctx: &BuildCtx, node: NodeId, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| ctx.err(node, LowerKind::TooLarge, format!("{what} = {v} exceeds the kernels' 32-bit range")))
}

/// `v` as a kernel's 64-bit argument (row strides), or an error naming what it is.
fn long(ctx: &BuildCtx, node: NodeId, what: &str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| ctx.err(node, LowerKind::TooLarge, format!("{what} = {v} exceeds the kernels' 64-bit range")))
}

/// `a · b`, or an error naming the product.
fn mul(ctx: &BuildCtx, node: NodeId, what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| ctx.err(node, LowerKind::TooLarge, format!("{what} ({a} × {b}) overflows")))
}

fn gpu_attention(ctx: &mut BuildCtx, node: NodeId, attrs: Attention) -> Result<Box<dyn Layer>> {
    let (q, k, v, y) = (ctx.input(node, 0)?, ctx.input(node, 1)?, ctx.input(node, 2)?, ctx.output(node)?);
    let (dq, dk, dvv, dy) = (ctx.value(q).clone(), ctx.value(k).clone(), ctx.value(v).clone(), ctx.value(y).clone());
    if ![&dq, &dk, &dvv, &dy].iter().all(|d| is_contiguous(d)) {
        return Err(ctx.err(
            node,
            LowerKind::Operands,
            format!(
                "attention reads contiguous q, k, v and writes a contiguous y, got {:?} {:?} {:?} {:?}",
                dq.layout, dk.layout, dvv.layout, dy.layout
            ),
        ));
    }
    let r = dq.dims.len();
    if r < 2 || dk.dims.len() != r || dvv.dims.len() != r {
        return Err(ctx.err(
            node,
            LowerKind::Unsupported,
            format!("q {:?}, k {:?} and v {:?} need [.., L, D] per image", dq.dims, dk.dims, dvv.dims),
        ));
    }
    let dims =
        Dims { zimg: dq.dims[..r - 2].iter().product(), l: dq.dims[r - 2], s: dk.dims[r - 2], d: dq.dims[r - 1], dv: dvv.dims[r - 1] };
    let bias = if attrs.bias { upload_bias(ctx, node, 3, &dq.dims, dims)? } else { None };
    let elem = ctx.elem();
    let path = ctx.node(node).path.clone();
    let mut candidates: Vec<Box<dyn Layer>> = Vec::new();

    // (a) cuBLASLt: scores (f32) = scale · Q·Kᵀ, softmax kernel, Y = P·V.
    let core = GemmCore::new(ctx, node, dims, attrs.scale, bias.clone())?;
    let (scores_bytes, probs_bytes) =
        (mul(ctx, node, "scores", core.scores_elems, Elem::F32.size())?, mul(ctx, node, "probabilities", core.scores_elems, elem.size())?);
    let (scores, probs) = (ctx.scratch(scores_bytes), ctx.scratch(probs_bytes));
    candidates.push(Box::new(GemmAttention { path: path.clone(), core, io: [q, k, v, y], scores, probs }));

    // (b), (c) the fused kernels, for the head dims they are stamped for: q, k, v and y are
    // `[Z, L, D]` blocks, i.e. one head per problem with rows D apart.
    if dims.d == dims.dv && FUSED_HEAD_DIMS.contains(&dims.d) {
        let ld = long(ctx, node, "D", dims.d)?;
        let io = FusedIo { q: (q, 0), k: (k, 0), v: (v, 0), y, heads: 1, ldq: ld, ldkv: ld, ldy: ld };
        for kernel in FusedKernel::for_elem(elem) {
            if let Some(c) = FusedAttention::new(ctx, node, kernel, io, dims, attrs.scale, bias.clone())? {
                candidates.push(Box::new(c));
            }
        }
    }
    let key = ctx.problem_key(node);
    ctx.choose(&key, candidates)
}

fn gpu_qkv_attention(ctx: &mut BuildCtx, node: NodeId, attrs: QkvAttention) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let (dx, dy) = (ctx.value(x).clone(), ctx.value(y).clone());
    if !is_contiguous(&dx) || !is_contiguous(&dy) {
        return Err(ctx.err(
            node,
            LowerKind::Operands,
            format!("qkv_attention reads a contiguous qkv and writes a contiguous y, got {:?} and {:?}", dx.layout, dy.layout),
        ));
    }
    let r = dx.dims.len();
    let h = attrs.heads;
    let packed = mul(ctx, node, "3 · heads", 3, h)?;
    if r < 2 || h == 0 || !dx.dims[r - 1].is_multiple_of(packed) || dy.dims.len() != r {
        return Err(ctx.err(
            node,
            LowerKind::Unsupported,
            format!("qkv {:?} needs [.., L, 3·{h}·D] per image (output {:?})", dx.dims, dy.dims),
        ));
    }
    let (groups, l, d) = (&dx.dims[..r - 2], dx.dims[r - 2], dx.dims[r - 1] / packed);
    let hd = h * d;
    let zimg = mul(ctx, node, "problems per image", groups.iter().product(), h)?;
    let dims = Dims { zimg, l, s: l, d, dv: d };
    // One image's q as `attention` would see it, `[G..., H, L, D]`: the problems are (G..., H).
    let q_dims: Vec<usize> = [groups, &[h, l, d][..]].concat();
    let bias = if attrs.bias { upload_bias(ctx, node, 1, &q_dims, dims)? } else { None };
    let elem = ctx.elem();
    let hd_bytes = mul(ctx, node, "H·D bytes", hd, elem.size())? as u64;
    let path = ctx.node(node).path.clone();
    let mut candidates: Vec<Box<dyn Layer>> = Vec::new();

    // (a), (b) the fused kernels read q, k and v in place: rows 3·H·D apart, k and v H·D and
    // 2·H·D elements after q; y's rows are H·D apart, head h at h·D.
    if FUSED_HEAD_DIMS.contains(&d) {
        let (ld_in, ld_out) = (long(ctx, node, "3·H·D", 3 * hd)?, long(ctx, node, "H·D", hd)?);
        let heads = int(ctx, node, "heads", h)?;
        let io = FusedIo { q: (x, 0), k: (x, hd_bytes), v: (x, 2 * hd_bytes), y, heads, ldq: ld_in, ldkv: ld_in, ldy: ld_out };
        for kernel in FusedKernel::for_elem(elem).into_iter().rev() {
            if let Some(c) = FusedAttention::new(ctx, node, kernel, io, dims, attrs.scale, bias.clone())? {
                candidates.push(Box::new(c));
            }
        }
    }

    // (c) any head dim: q, k and v copied into scratch `[Z, L, D]` blocks, the cuBLASLt path, and
    // the result copied into place. Its scratch is one prologue buffer (the copy of qkv), held by
    // the arena only if this candidate is chosen.
    let core = GemmCore::new(ctx, node, dims, attrs.scale, bias)?;
    let part = mul(ctx, node, "q, k or v per image", mul(ctx, node, "q, k or v per image", zimg, l)?, d)?;
    let regions = Regions {
        part: mul(ctx, node, "q, k or v bytes", part, elem.size())?,
        scores: mul(ctx, node, "scores bytes", core.scores_elems, Elem::F32.size())?,
        probs: mul(ctx, node, "probabilities bytes", core.scores_elems, elem.size())?,
    };
    let per_image = regions
        .per_image()
        .ok_or_else(|| ctx.err(node, LowerKind::TooLarge, format!("the scratch of {zimg} problems of {l}×{d} overflows")))?;
    let scratch = ctx.prologue_scratch(per_image);
    let src_strides = Layout::contiguous(r).strides(&dx.dims);
    let g = groups.len();
    // Unpack: one image of q (k, v) as `[G..., H, L, D]`, read from the packed rows.
    let unpack_strides: Vec<usize> = [&src_strides[..g], &[d, 3 * hd, 1][..]].concat();
    let unpack = Repack::new(ctx, node, &q_dims, &unpack_strides, dx.per_image_elems(), elem)?;
    // Pack: one image of y `[G..., L, H, D]`, read from the `[G..., H, L, D]` scratch.
    let y_strides = Layout::contiguous(q_dims.len()).strides(&q_dims);
    let pack_sizes: Vec<usize> = [groups, &[l, h, d][..]].concat();
    let pack_strides: Vec<usize> = [&y_strides[..g], &[y_strides[g + 1], y_strides[g], 1][..]].concat();
    let pack = Repack::new(ctx, node, &pack_sizes, &pack_strides, part, elem)?;
    candidates.push(Box::new(UnpackedGemmAttention {
        path,
        core,
        unpack,
        pack,
        io: [x, y],
        scratch,
        regions,
        part_offset: hd_bytes,
        sm_count: ctx.kernels.sm_count(),
    }));
    let key = ctx.problem_key(node);
    ctx.choose(&key, candidates)
}

/// The cuBLASLt path's fixed part: `scale · Q·Kᵀ` to f32 scores by a strided-batched GEMM, our
/// softmax kernel (bias added) writing probabilities, `P·V` by a second batched GEMM. Q, K, V and
/// Y are contiguous `[Z, L, D]` blocks at addresses given per run.
struct GemmCore {
    qk: LtMatmul,
    pv: LtMatmul,
    softmax: CudaFunction,
    bias: Option<Arc<DeviceBuf>>,
    dims: Dims,
    li: i32,
    si: i32,
    /// Row stride of the scores and probabilities (S rounded up to 8).
    ldi: i32,
    /// Scores (and probabilities) per image: `zimg · L · ld`.
    scores_elems: usize,
    sm_count: u32,
}

impl GemmCore {
    fn new(ctx: &mut BuildCtx, node: NodeId, dims: Dims, scale: f32, bias: Option<Arc<DeviceBuf>>) -> Result<Self> {
        let (li, si) = (int(ctx, node, "L", dims.l)?, int(ctx, node, "S", dims.s)?);
        // Score and probability rows are `ld` = S rounded up to 8 apart, so every f16 row and
        // matrix is 16-byte aligned.
        let ld = dims.s.next_multiple_of(8);
        let ldi = int(ctx, node, "S rounded up to 8", ld)?;
        let scores_elems = mul(ctx, node, "scores per image", dims.zimg, mul(ctx, node, "scores per problem", dims.l, ld)?)?;
        let (elem, precision, path) = (ctx.elem(), ctx.precision(), ctx.node(node).path.clone());
        let qk = LtMatmul::new_batched(
            &path,
            precision,
            elem,
            dims.d,
            dims.s,
            Batched {
                w_kn: false,
                stride_x: dims.l * dims.d,
                stride_w: dims.s * dims.d,
                stride_y: dims.l * ld,
                alpha: scale,
                out_elem: Elem::F32,
                ld_x: 0,
                ld_y: ld,
            },
        )?;
        let pv = LtMatmul::new_batched(
            &path,
            precision,
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
        let softmax = ctx.kernels.get(&format!("attn_softmax_{}", elem.suffix()))?;
        Ok(Self { qk, pv, softmax, bias, dims, li, si, ldi, scores_elems, sm_count: ctx.kernels.sm_count() })
    }

    /// `[q, k, v, y]`, the f32 scores and the probabilities: device addresses for `batch` images.
    fn enqueue(&self, rt: &RunCtx, batch: usize, [q, k, v, y]: [u64; 4], scores: u64, probs: u64) -> Result<()> {
        let count = batch * self.dims.zimg;
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

/// Attention as two strided-batched cuBLASLt GEMMs around our softmax kernel.
struct GemmAttention {
    path: String,
    core: GemmCore,
    /// q, k, v, y.
    io: [ValueId; 4],
    scores: ValueId,
    probs: ValueId,
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
        self.core.enqueue(rt, batch, self.io.map(|v| rt.ptr(v)), rt.ptr(self.scores), rt.ptr(self.probs))
    }
}

/// One launch of the general permute kernel (`kernels/permute.cu`) between addresses given per
/// run, in one element type: `meta` holds the output's sizes (outermost first), the input's
/// element strides of those dims, and the input's batch stride.
struct Repack {
    f: CudaFunction,
    meta: DeviceBuf,
    rank: i32,
    /// Output elements per image.
    per_image: usize,
}

impl Repack {
    fn new(ctx: &mut BuildCtx, node: NodeId, sizes: &[usize], src_strides: &[usize], batch_stride: usize, elem: Elem) -> Result<Self> {
        let meta = repack_meta(sizes, src_strides, batch_stride)
            .ok_or_else(|| ctx.err(node, LowerKind::TooLarge, format!("{sizes:?} exceeds the 64-bit range")))?;
        let bytes: Vec<u8> = meta.iter().flat_map(|v| v.to_le_bytes()).collect();
        let meta = ctx.upload_bytes(&bytes)?;
        let f = ctx.kernels.get(&format!("permute_{0}_{0}", elem.suffix()))?;
        Ok(Self { f, meta, rank: int(ctx, node, "rank", sizes.len())?, per_image: sizes.iter().product() })
    }

    fn launch(&self, rt: &RunCtx, sm_count: u32, batch: usize, src: u64, dst: u64) -> Result<()> {
        let n = batch * self.per_image;
        let args = [KArg::Ptr(src), KArg::Ptr(dst), KArg::I64(n as i64), KArg::Ptr(self.meta.ptr()), KArg::I32(self.rank)];
        launch(rt, &self.f, grid_for(n, sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

/// The permute kernel's `meta`: sizes, then source strides, then the source's batch stride.
fn repack_meta(sizes: &[usize], src_strides: &[usize], batch_stride: usize) -> Option<Vec<i64>> {
    sizes.iter().chain(src_strides).chain([&batch_stride]).map(|&v| i64::try_from(v).ok()).collect()
}

/// The unpacked candidate's scratch, one buffer for `batch` images: q, k, v and y blocks
/// (`part` bytes per image each), f32 scores and probabilities, each region `ALIGN`ed.
#[derive(Clone, Copy, Debug)]
struct Regions {
    part: usize,
    scores: usize,
    probs: usize,
}

impl Regions {
    /// Bytes per image that hold every region for any batch (each region rounds up once).
    fn per_image(self) -> Option<usize> {
        self.part.checked_mul(4)?.checked_add(self.scores)?.checked_add(self.probs)?.checked_add(6 * ALIGN)
    }
    /// Byte offsets of q, k, v, y, the scores and the probabilities for `batch` images.
    fn offsets(self, batch: usize) -> [usize; 6] {
        let up = |b: usize| b.next_multiple_of(ALIGN);
        let part = up(batch * self.part);
        let scores = 4 * part;
        [0, part, 2 * part, 3 * part, scores, scores + up(batch * self.scores)]
    }
}

/// `qkv_attention` for any head dim: q, k and v copied out of the packed rows into scratch
/// `[Z, L, D]` blocks (three launches of the permute kernel), `GemmCore`, and the result copied
/// into the heads' places of the output rows.
struct UnpackedGemmAttention {
    path: String,
    core: GemmCore,
    unpack: Repack,
    pack: Repack,
    /// qkv, y.
    io: [ValueId; 2],
    scratch: ValueId,
    regions: Regions,
    /// Bytes from q's first element in a packed row to k's (and from k's to v's): H·D elements.
    part_offset: u64,
    sm_count: u32,
}

impl Layer for UnpackedGemmAttention {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "cublaslt-attention:unpacked".into()
    }
    fn workspace_bytes(&self, _batch: usize) -> usize {
        GEMM_WORKSPACE
    }
    /// The copy out of qkv comes first and only the scratch is read afterwards: the arena may
    /// reuse qkv's bytes (for y) once it is done.
    fn prologue(&self) -> Option<(ValueId, ValueId)> {
        Some((self.io[0], self.scratch))
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let [x, y] = self.io.map(|v| rt.ptr(v));
        let base = rt.ptr(self.scratch);
        let [q, k, v, ys, scores, probs] = self.regions.offsets(batch).map(|o| base + o as u64);
        for (i, dst) in [q, k, v].into_iter().enumerate() {
            self.unpack.launch(rt, self.sm_count, batch, x + i as u64 * self.part_offset, dst)?;
        }
        self.core.enqueue(rt, batch, [q, k, v, ys], scores, probs)?;
        self.pack.launch(rt, self.sm_count, batch, ys, y)
    }
}

/// The two fused kernels of `kernels/attention.cu` (one signature).
#[derive(Clone, Copy, Debug, PartialEq)]
enum FusedKernel {
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
const FUSED_HEAD_DIMS: [usize; 2] = [32, 64];

/// The kernels this family's layers launch (kernels/attention.cu): the GEMM path's softmax, and
/// each fused kernel for every head dim and element type it runs on. (The GEMM path's repacking
/// is the engine's permute.)
fn entry_points() -> Vec<String> {
    let mut names = Vec::new();
    for elem in [Elem::F32, Elem::F16] {
        names.push(format!("attn_softmax_{}", elem.suffix()));
        for kernel in FusedKernel::for_elem(elem) {
            names.extend(FUSED_HEAD_DIMS.map(|d| kernel.entry(d, elem)));
        }
    }
    names
}

/// Query rows per block of the fused kernels (`ATTN_BQ` in kernels/attention.cu).
const FUSED_ROWS: usize = 64;
/// The most blocks along a grid's y (the query tiles).
const MAX_GRID_Y: usize = 65535;

impl FusedKernel {
    /// The kernels an engine of `elem` can run.
    fn for_elem(elem: Elem) -> Vec<Self> {
        match elem {
            Elem::F16 => vec![Self::CudaCores, Self::TensorCores, Self::Resident { all_rows: false }, Self::Resident { all_rows: true }],
            Elem::F32 => vec![Self::CudaCores],
            // A binding, or 8-bit codes only 8-bit convs read: no attention runs on bytes.
            Elem::U8 | Elem::I8 | Elem::E4m3 => vec![],
        }
    }
    fn entry(self, d: usize, elem: Elem) -> String {
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
struct FusedIo {
    q: (ValueId, u64),
    k: (ValueId, u64),
    v: (ValueId, u64),
    y: ValueId,
    heads: i32,
    ldq: i64,
    ldkv: i64,
    ldy: i64,
}

/// Attention as one launch of a fused kernel: grid (problems, blocks of query rows: tiles of 64,
/// or one for `Resident { all_rows }`).
struct FusedAttention {
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
    fn new(
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

/// Keys and values of the attention fixtures: `other[:, 0]` and `other[:, 1]`.
fn fixture_kv(o: &Tensor) -> Result<(Tensor, Tensor)> {
    let dims: Vec<isize> = std::iter::once(o.shape()[0]).chain(o.shape()[2..].iter().copied()).map(|d| d as isize).collect();
    Ok((o.narrow(1, 0, 1)?.reshape(&dims)?, o.narrow(1, 1, 1)?.reshape(&dims)?))
}

/// The Kiln twins of this family's PyTorch op fixtures (`op_cases()` in tools/export_reference.py).
#[doc(hidden)]
pub const FIXTURE_TWINS: &[FixtureTwin] = &[
    ("attention_vit", |f| {
        let (k, v) = fixture_kv(f.other()?)?;
        f.x.attention(&k, &v, None, None)
    }),
    ("attention_swin_bias", |f| {
        let (k, v) = fixture_kv(f.other()?)?;
        f.x.attention_weight(f.case, &k, &v, &f.vb.get(&[4, 3, 7, 7], "bias")?, Some(0.3))
    }),
    ("attention_bias_rows", |f| {
        let (k, v) = fixture_kv(f.other()?)?;
        f.x.attention_weight(f.case, &k, &v, &f.vb.get(&[5, 1], "bias")?, None)
    }),
    ("qkv_attention_vit", |f| f.x.qkv_attention(3, None, None)),
    ("qkv_attention_swin_bias", |f| f.x.qkv_attention_weight(f.case, 3, &f.vb.get(&[4, 3, 7, 7], "bias")?, Some(0.3))),
    ("qkv_attention_head_bias", |f| f.x.qkv_attention_weight(f.case, 2, &f.vb.get(&[2, 5, 5], "bias")?, None)),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_shape_checks_heads_lengths_and_bias() {
        assert_eq!(attention_shape(false, &[&[2, 3, 5, 8], &[2, 3, 7, 8], &[2, 3, 7, 4]]), Ok(vec![2, 3, 5, 4]));
        assert_eq!(attention_shape(true, &[&[2, 3, 5, 8], &[2, 3, 7, 8], &[2, 3, 7, 8], &[3, 5, 7]]), Ok(vec![2, 3, 5, 8]));
        assert!(attention_shape(true, &[&[2, 3, 5, 8], &[2, 3, 7, 8], &[2, 3, 7, 8], &[4, 5, 7]])
            .unwrap_err()
            .to_string()
            .contains("[4, 5, 7]"));
        assert!(attention_shape(false, &[&[2, 3, 5, 8], &[2, 3, 7, 6], &[2, 3, 7, 8]]).unwrap_err().to_string().contains("[2, 3, 7, 6]"));
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

    #[test]
    fn qkv_attention_shape_checks_heads_and_bias() {
        assert_eq!(qkv_attention_shape(12, false, &[&[2, 197, 2304]]), Ok(vec![2, 197, 768]), "ViT-B/16");
        assert_eq!(qkv_attention_shape(3, true, &[&[2, 4, 49, 288], &[4, 3, 49, 49]]), Ok(vec![2, 4, 49, 96]), "Swin-T, shifted");
        assert_eq!(qkv_attention_shape(3, true, &[&[2, 4, 49, 288], &[3, 49, 49]]), Ok(vec![2, 4, 49, 96]), "a bias per head only");
        assert_eq!(qkv_attention_shape(3, true, &[&[2, 4, 49, 288], &[1, 4, 3, 49, 49]]), Ok(vec![2, 4, 49, 96]), "a batch dim of 1");
        let e = qkv_attention_shape(12, false, &[&[2, 197, 2300]]).unwrap_err();
        assert!(e.to_string().contains("[2, 197, 2300]") && e.to_string().contains("36"), "{e}");
        let e = qkv_attention_shape(3, true, &[&[2, 4, 49, 288], &[4, 6, 49, 49]]).unwrap_err();
        assert!(e.to_string().contains("[4, 6, 49, 49]") && e.to_string().contains("[1, 4, 3, 49, 49]"), "names both shapes: {e}");
        let e = qkv_attention_shape(3, true, &[&[2, 4, 49, 288], &[2, 4, 3, 49, 49]]).unwrap_err();
        assert!(e.to_string().contains("[2, 4, 3, 49, 49]"), "a bias that varies with the batch is not a constant one: {e}");
        assert!(qkv_attention_shape(0, false, &[&[2, 5, 12]]).unwrap_err().to_string().contains("head"));
        assert!(qkv_attention_shape(2, false, &[&[5, 12]]).unwrap_err().to_string().contains("[5, 12]"));
        assert!(qkv_attention_shape(2, true, &[&[2, 5, 12]]).unwrap_err().to_string().contains("2 inputs"));
        assert!(qkv_attention_shape(usize::MAX, false, &[&[2, 5, 12]]).is_err(), "no overflow");
    }

    #[test]
    fn qkv_attention_traces_with_errors_naming_the_path() {
        let t = crate::Tracer::new();
        let x = t.input("x", &[1, 5, 30]);
        let e = x.qkv_attention(4, None, None).unwrap_err().to_string();
        assert!(e.contains("qkv_attention") && e.contains("[1, 5, 30]"), "{e}");
        let bias = Param { name: "blk.bias".into(), value: Arc::new(HostTensor::zeros(vec![3, 5, 4])) };
        let e = x.qkv_attention_weight("blk.attention", 2, &bias, None).unwrap_err().to_string();
        assert!(e.contains("blk.attention") && e.contains("[3, 5, 4]") && e.contains("[1, 2, 5, 5]"), "{e}");
        let y = x.qkv_attention(2, None, None).expect("valid");
        assert_eq!(y.shape(), [1, 5, 10]);
        let g = t.graph();
        assert_eq!(g.nodes[y.id()].op, Op::QkvAttention(QkvAttention { heads: 2, scale: 1.0 / 5f32.sqrt(), bias: false }));
    }

    /// What the models did before `qkv_attention`: the packed projection reshaped, permuted and
    /// narrowed into q, k and v `[N, G..., H, L, D]`, `attention`, then permuted and reshaped back.
    fn unpacked(x: &crate::Tensor, heads: usize, bias: Option<&Param>, scale: Option<f32>) -> crate::Result<crate::Tensor> {
        let s: Vec<isize> = x.shape().iter().map(|&v| v as isize).collect();
        let r = s.len();
        let (h, d) = (heads as isize, s[r - 1] / (3 * heads as isize));
        // [N, G.., L, 3, H, D] -> [N, 3, G.., H, L, D].
        let split: Vec<isize> = [&s[..r - 1], &[3, h, d][..]].concat();
        let g = r - 3; // group dims after N
        let order: Vec<isize> =
            [vec![0, r - 1], (1..=g).collect(), vec![r, r - 2, r + 1]].concat().into_iter().map(|v| v as isize).collect();
        let qkv = x.reshape(&split)?.permute(&order)?;
        let part_shape: Vec<isize> = [&s[..r - 2], &[h, s[r - 2], d][..]].concat();
        let part = |k: usize| qkv.narrow(1, k, 1)?.reshape(&part_shape);
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        let y = match bias {
            Some(b) => q.attention_weight("attn", &k, &v, b, scale)?,
            None => q.attention(&k, &v, None, scale)?,
        };
        // [N, G.., H, L, D] -> [N, G.., L, H, D] -> [N, G.., L, H·D].
        let back: Vec<isize> = [(0..=g).collect(), vec![g + 2, g + 1, g + 3]].concat().into_iter().map(|v| v as isize).collect();
        y.permute(&back)?.reshape(&[&s[..r - 1], &[h * d][..]].concat())
    }

    #[test]
    fn qkv_attention_cpu_equals_the_unpacked_graph_bit_for_bit() {
        let rel = |heads: usize, l: usize| Param { name: "rel".into(), value: Arc::new(crate::seeded::weight("rel", &[heads, l, l])) };
        let windows = |g: usize, heads: usize, l: usize| Param {
            name: "win".into(),
            value: Arc::new(crate::seeded::weight("win", &[g, heads, l, l])),
        };
        // (name, qkv shape, heads, bias, scale)
        type Case = (&'static str, Vec<usize>, usize, Option<Param>, Option<f32>);
        let cases: Vec<Case> = vec![
            ("ViT-like, 2 heads of 4", vec![2, 7, 24], 2, None, None),
            ("one head of 5, scale 0.3", vec![3, 6, 15], 1, None, Some(0.3)),
            ("Swin-like windows, a bias per head", vec![2, 3, 9, 72], 3, Some(rel(3, 9)), None),
            ("Swin-like windows, a bias per window and head", vec![2, 3, 9, 72], 3, Some(windows(3, 3, 9)), Some(0.25)),
            ("two group dims", vec![1, 2, 2, 4, 36], 2, Some(rel(2, 4)), None),
        ];
        for (name, shape, heads, bias, scale) in cases {
            let run = |packed: bool| {
                let t = crate::Tracer::new();
                let x = t.input("x", &shape);
                let y = match (&bias, packed) {
                    (Some(b), true) => x.qkv_attention_weight("attn", heads, b, scale),
                    (None, true) => x.qkv_attention(heads, None, scale),
                    (b, false) => unpacked(&x, heads, b.as_ref(), scale),
                }
                .unwrap_or_else(|e| panic!("{name}: {e}"));
                t.output("y", &y);
                let g = t.graph();
                let ops = g.nodes.iter().filter(|n| n.op.name().contains("attention")).count();
                assert_eq!(ops, 1, "{name}");
                let input = crate::seeded::weight(&format!("{name}.x"), &shape);
                crate::cpu::run(&g, &[("x", &input)]).expect("cpu").remove("y").expect("y")
            };
            let (got, want) = (run(true), run(false));
            assert_eq!(got.shape, want.shape, "{name}");
            assert!(got.data == want.data, "{name}: qkv_attention differs from the unpacked graph");
        }
    }

    /// The permute kernel's indexing (kernels/permute.cu) on the host.
    fn permute_on_host(src: &[f32], meta: &[i64], rank: usize, n: usize) -> Vec<f32> {
        let (size, stride, batch_stride) = (&meta[..rank], &meta[rank..2 * rank], meta[2 * rank]);
        (0..n as i64)
            .map(|i| {
                let (mut rem, mut off) = (i, 0);
                for d in (0..rank).rev() {
                    off += rem % size[d] * stride[d];
                    rem /= size[d];
                }
                src[(off + rem * batch_stride) as usize]
            })
            .collect()
    }

    #[test]
    fn unpacked_candidate_copies_are_the_cpu_split() {
        // The metas `gpu_qkv_attention` builds for [G=2, L=3, 3·H·D] with H = 2, D = 5, batch 2.
        let (g, l, h, d, batch) = (2usize, 3usize, 2usize, 5usize, 2usize);
        let dims = [g, l, 3 * h * d];
        let x = crate::seeded::weight("x", &[batch, g, l, 3 * h * d]);
        let q_dims = [g, h, l, d];
        let src_strides = Layout::contiguous(3).strides(&dims);
        let unpack = repack_meta(&q_dims, &[src_strides[0], d, 3 * h * d, 1], dims.iter().product()).unwrap();
        let part = g * h * l * d;
        // Each part is the same elements the CPU reference copies out (q, k, v in order).
        for p in 0..3 {
            let got = permute_on_host(&x.data[p * h * d..], &unpack, 4, batch * part);
            for (i, &v) in got.iter().enumerate() {
                let (b, gi, hh, li, di) = (i / part, i / (h * l * d) % g, i / (l * d) % h, i / d % l, i % d);
                assert_eq!(v, x.data[(((b * g + gi) * l + li) * 3 + p) * h * d + hh * d + di], "part {p} element {i}");
            }
        }
        // Packing writes [G, L, H·D] rows from [G, H, L, D] blocks.
        let y = crate::seeded::weight("y", &[batch, g, h, l, d]);
        let ys = Layout::contiguous(4).strides(&q_dims);
        let pack = repack_meta(&[g, l, h, d], &[ys[0], ys[2], ys[1], 1], part).unwrap();
        let got = permute_on_host(&y.data, &pack, 4, batch * part);
        for (i, &v) in got.iter().enumerate() {
            let (b, gi, li, hh, di) = (i / part, i / (l * h * d) % g, i / (h * d) % l, i / d % h, i % d);
            assert_eq!(v, y.data[(((b * g + gi) * h + hh) * l + li) * d + di], "packed element {i}");
        }
    }

    #[test]
    fn unpacked_scratch_regions_fit_and_align() {
        let r = Regions { part: 1000, scores: 3000, probs: 1500 };
        for batch in 1..5 {
            let o = r.offsets(batch);
            assert!(o.iter().all(|&v| v % ALIGN == 0), "{o:?}");
            let ends =
                [o[0] + batch * r.part, o[1] + batch * r.part, o[2] + batch * r.part, o[3] + batch * r.part, o[4] + batch * r.scores];
            assert!(ends.iter().zip(&o[1..]).all(|(end, next)| end <= next), "no overlap at batch {batch}: {o:?}");
            assert!(o[5] + batch * r.probs <= batch * r.per_image().unwrap(), "fits at batch {batch}");
        }
        assert_eq!(Regions { part: usize::MAX / 2, scores: 0, probs: 0 }.per_image(), None);
    }

    #[test]
    fn qkv_attention_survives_graph_files_codegen_dot_and_new_dims() {
        let t = crate::Tracer::new();
        let x = t.input("x", &[1, 5, 30]);
        let bias = Param { name: "blk.bias".into(), value: Arc::new(crate::seeded::weight("bias", &[2, 5, 5])) };
        let y = x.qkv_attention_weight("blk.attention", 2, &bias, Some(0.5)).expect("trace");
        t.output("y", &y);
        let g = t.graph();
        // Graph files (and engine files, the same JSON) keep the op and its attributes.
        let bytes = crate::graph_file::encode(&g, &Default::default()).expect("encode");
        let back = crate::graph_file::decode(&bytes, std::path::Path::new("qkv.kiln.safetensors")).expect("decode").graph;
        assert_eq!(back.nodes, g.nodes);
        let input = crate::seeded::weight("x", &[1, 5, 30]);
        assert_eq!(crate::cpu::run(&back, &[("x", &input)]).expect("cpu")["y"], crate::cpu::run(&g, &[("x", &input)]).expect("cpu")["y"]);
        // Codegen writes the op's serde form; its type is importable from the plugin face.
        let src = crate::codegen::generate(&g, &Default::default()).expect("codegen");
        let flat: String = src.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(flat.contains("Op::QkvAttention(QkvAttention { heads: 2, scale: 0.5, bias: true, })"), "{src}");
        assert!(flat.contains("use kiln::plugin::{Op, QkvAttention};"), "{src}");
        assert!(flat.contains("use kiln::{Graph, Result,"), "{src}");
        // DOT: the bias's rank 4 is not read as a kernel size.
        let id = g.nodes.iter().position(|n| n.path == "blk.attention").expect("node");
        assert_eq!(crate::dot::describe_op(&g, &g.nodes[id]), "qkv_attention heads=2 scale=0.5 +bias");
    }

    #[test]
    fn qkv_attention_reinfers_at_new_lengths() {
        let t = crate::Tracer::new();
        let x = t.input("x", &[1, 5, 30]);
        t.output("y", &x.qkv_attention(2, None, None).expect("trace"));
        let g = t.graph();
        let moved = g.with_input_dims(&[("x".to_string(), vec![9, 30])].into()).expect("re-inferred");
        assert_eq!(moved.nodes.last().map(|n| n.shape.clone()), Some(vec![1, 9, 10]));
        let e = g.with_input_dims(&[("x".to_string(), vec![9, 32])].into()).unwrap_err().to_string();
        assert!(e.contains("qkv_attention") && e.contains("[1, 9, 32]"), "{e}");
    }
}
