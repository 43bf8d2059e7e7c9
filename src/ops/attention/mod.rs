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
//!
//! Here: the two ops, their `Tensor` methods and shape rules; `cpu` holds the CPU references,
//! `gpu` the converters (the candidates of each op and the kernels they launch), `gemm` the
//! cuBLASLt candidates and `fused` the fused kernels' candidates.

mod cpu;
mod fused;
mod gemm;
mod gpu;

use crate::engine::Layer;
use crate::error::OpError;
use crate::graph::{HostTensor, NodeId, Op};
use crate::ops::BuildCtx;
use crate::ops::{CpuArgs, FixtureTwin, OpDef};
use crate::tensor::{Param, Tensor};
use crate::Result;
use cpu::{attention_cpu, qkv_attention_cpu};
use gpu::{entry_points, gpu_attention, gpu_qkv_attention};
use serde::{Deserialize, Serialize};

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
    use std::sync::Arc;

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
