//! Normalisations along some dims: BatchNorm2d (inference: running statistics; folded into the
//! preceding conv by `passes::fold_batchnorm`, a per-channel scale and shift otherwise), softmax
//! LayerNorm and GroupNorm / InstanceNorm (our kernels in `kernels/norm.cu`, f32 statistics
//! whatever the precision). The layers (`BatchNorm2d`, `LayerNorm`, ...) are in `norm/modules.rs`.

use crate::engine::{DeviceBuf, Layer, Layout, ValueDesc, ValueId};
use crate::error::OpError;
use crate::graph::{NodeId, Op};
use crate::module::{Forward, Module};
use crate::ops::BuildCtx;
use crate::ops::{AtenImport, CpuArgs, FixtureTwin, LayoutPlan, OpDef};
use crate::tensor::Tensor;
use crate::LowerKind;
use crate::Result;
use serde::{Deserialize, Serialize};

mod modules;
pub use modules::*;

/// This family's layers, as `kiln::nn` shows them.
pub mod nn {
    pub use super::{BatchNorm2d, BatchNorm2dConfig, GroupNorm, GroupNormConfig, LayerNorm, LayerNorm2d, LayerNormConfig, Softmax};
}

/// Normalisations. Inputs: BatchNorm2d: x, weight, bias, running_mean, running_var; Softmax: x;
/// LayerNorm: x, and weight, bias (both of `shape`) when `affine`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, strum::EnumIter)]
pub enum Norm {
    BatchNorm2d {
        eps: f32,
    },
    /// `torch.softmax(x, dim)` (`dim` >= 1: the batch is dim 0), max-subtracted, in f32.
    Softmax {
        dim: usize,
    },
    /// `F.layer_norm` over the dims `dim .. dim + shape.len()`, which must equal `shape`:
    /// `nn.LayerNorm` normalises the trailing dims (`dim = rank - shape.len()`), torchvision's
    /// `LayerNorm2d` the channels of NCHW (`dim = 1`, `shape = [C]`). Biased variance, as PyTorch.
    LayerNorm {
        dim: usize,
        shape: Vec<usize>,
        eps: f32,
        affine: bool,
    },
    /// `F.group_norm(x, groups)` on `[N, C, *]`: each image's channels in `groups` groups of
    /// consecutive channels, each group normalised over its channels and positions (biased
    /// variance), then `x * weight[c] + bias[c]` when `affine`. `InstanceNorm2d` (no running
    /// statistics) is the case `groups = C`.
    GroupNorm {
        groups: usize,
        eps: f32,
        affine: bool,
    },
}

impl OpDef for Norm {
    fn name(&self) -> &str {
        match self {
            Norm::BatchNorm2d { .. } => "batch_norm2d",
            Norm::Softmax { .. } => "softmax",
            Norm::LayerNorm { .. } => "layer_norm",
            Norm::GroupNorm { .. } => "group_norm",
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
        // A zero or negative eps divides by zero or takes the root of a negative variance: NaN
        // outputs from a graph that validated. PyTorch's layers default to 1e-5.
        if let Norm::BatchNorm2d { eps } | Norm::LayerNorm { eps, .. } | Norm::GroupNorm { eps, .. } = self {
            if !(eps.is_finite() && *eps > 0.0) {
                return Err(OpError::Attribute(format!("eps must be positive and finite, got {eps}")));
            }
        }
        match self {
            Norm::BatchNorm2d { .. } => batch_norm2d_shape(inputs),
            Norm::Softmax { dim } => softmax_shape(*dim, inputs),
            Norm::LayerNorm { dim, shape, affine, .. } => layer_norm_shape(*dim, shape, *affine, inputs),
            Norm::GroupNorm { groups, affine, .. } => group_norm_shape(*groups, *affine, inputs),
        }
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, OpError> {
        match self {
            Norm::BatchNorm2d { eps } => {
                args.expect(5)?;
                let x = args.take(0)?;
                let [g, b, m, v] = [args.get(1)?, args.get(2)?, args.get(3)?, args.get(4)?];
                batch_norm2d_cpu(*eps, x, [g, b, m, v])
            }
            Norm::Softmax { dim } => {
                args.expect(1)?;
                softmax_cpu(*dim, args.take(0)?)
            }
            Norm::LayerNorm { dim, shape, eps, affine } => {
                args.expect(1 + 2 * *affine as usize)?;
                let x = args.take(0)?;
                let wb = if *affine { Some((args.get(1)?, args.get(2)?)) } else { None };
                layer_norm_cpu(*dim, shape, *eps, x, wb)
            }
            Norm::GroupNorm { groups, eps, affine } => {
                args.expect(1 + 2 * *affine as usize)?;
                let x = args.take(0)?;
                let wb = if *affine { Some((args.get(1)?, args.get(2)?)) } else { None };
                group_norm_cpu(*groups, *eps, x, wb)
            }
        }
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        match self {
            Norm::BatchNorm2d { .. } => LayoutPlan::all(inputs, Layout::channels_last(out_rank)),
            Norm::Softmax { dim } => rows_layout(inputs, out_rank, *dim, 1),
            Norm::LayerNorm { dim, shape, .. } => rows_layout(inputs, out_rank, *dim, shape.len()),
            // A group's channels and positions: one contiguous row of NCHW, or the same `C /
            // groups` channels of every pixel of NHWC; a channels-last input (a conv's output,
            // PoolFormer's residual stream) is read as it is, with no copy either side.
            Norm::GroupNorm { .. } => {
                let chosen = match inputs.first().copied().flatten() {
                    Some(l) if l.rank() == out_rank && l.is_channels_last() => l,
                    _ => Layout::contiguous(out_rank),
                };
                LayoutPlan::all(inputs, chosen)
            }
        }
    }
    fn entry_points(&self) -> Vec<String> {
        // Softmax and LayerNorm; BatchNorm runs as cuDNN or the elementwise family's `bias_act`.
        crate::engine::launch::typed_entry_points(&[
            "softmax",
            "softmax_split",
            "layer_norm",
            "layer_norm_packed",
            "group_norm",
            "group_norm_partial",
            "group_norm_split",
        ])
    }
    fn colour(&self) -> &'static str {
        "#ffe08a"
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        match self {
            Norm::BatchNorm2d { eps } => gpu_batch_norm2d(ctx, node, *eps),
            Norm::Softmax { dim } => gpu_rows(ctx, node, RowOp::Softmax, *dim, 1),
            Norm::LayerNorm { dim, shape, eps, affine } => {
                gpu_rows(ctx, node, RowOp::LayerNorm { eps: *eps, affine: *affine }, *dim, shape.len())
            }
            Norm::GroupNorm { groups, eps, affine } => gpu_group_norm(ctx, node, *groups, *eps, *affine),
        }
    }
    fn label(&self) -> String {
        match self {
            Norm::BatchNorm2d { eps } => format!("batch_norm2d eps={eps}"),
            Norm::Softmax { dim } => format!("softmax dim={dim}"),
            Norm::LayerNorm { dim, shape, eps, affine } => {
                format!("layer_norm {shape:?} dim={dim} eps={eps}{}", if *affine { "" } else { " no-affine" })
            }
            Norm::GroupNorm { groups, eps, affine } => {
                format!("group_norm groups={groups} eps={eps}{}", if *affine { "" } else { " no-affine" })
            }
        }
    }
}

/// A PyTorch dim (negative counts from the end) as an index >= 1 of `shape`, or why not.
pub fn resolve_dim(shape: &[usize], dim: isize) -> Result<usize, OpError> {
    let rank = shape.len() as isize;
    let d = if dim < 0 { dim + rank } else { dim };
    if d == 0 {
        return Err(format!("dim {dim} of {shape:?} is the batch (the engine keeps the batch as dim 0)").into());
    }
    if d < 1 || d >= rank {
        return Err(format!("dim {dim} is out of range for shape {shape:?}").into());
    }
    Ok(d as usize)
}

impl Tensor {
    /// `torch.softmax(x, dim)` inline (`dim` may be negative: `-1` is the last dim; not the batch).
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        let d = resolve_dim(self.shape(), dim).map_err(|reason| crate::Error::Shape {
            path: self.scope_path("softmax"),
            op: "softmax".into(),
            reason,
            got: vec![self.shape().to_vec()],
        })?;
        Tensor::record_inline(Op::Norm(Norm::Softmax { dim: d }), &[self])
    }

    /// `F.group_norm(x, groups, eps=eps)` inline, without weight and bias (`groups` = C is
    /// `F.instance_norm` without running statistics).
    pub fn group_norm(&self, groups: usize, eps: f32) -> Result<Tensor> {
        Tensor::record_inline(Op::Norm(Norm::GroupNorm { groups, eps, affine: false }), &[self])
    }

    /// `F.layer_norm(x, normalized_shape, eps=eps)` inline, without weight and bias.
    pub fn layer_norm(&self, normalized_shape: &[usize], eps: f32) -> Result<Tensor> {
        let dim = self.shape().len().saturating_sub(normalized_shape.len());
        let op = Op::Norm(Norm::LayerNorm { dim, shape: normalized_shape.to_vec(), eps, affine: false });
        Tensor::record_inline(op, &[self])
    }
}

/// `inputs` = x, weight, bias, running_mean, running_var.
pub fn batch_norm2d_shape(inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    if inputs.len() != 5 {
        return Err(format!("batch_norm2d expects 5 inputs, got {}", inputs.len()).into());
    }
    let x = inputs[0];
    if x.len() != 4 {
        return Err(format!("input must be NCHW (rank 4), got {x:?}").into());
    }
    if let Some(bad) = inputs[1..].iter().find(|p| **p != [x[1]]) {
        return Err(format!("input has {} channels, but the layer has {bad:?} features", x[1]).into());
    }
    Ok(x.to_vec())
}

pub fn softmax_shape(dim: usize, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    let x = crate::ops::one_input(inputs)?;
    if dim == 0 {
        return Err(format!("softmax over dim 0 of {x:?}: the engine keeps the batch as dim 0").into());
    }
    if dim >= x.len() {
        return Err(format!("softmax dim {dim} is out of range for shape {x:?}").into());
    }
    Ok(x.to_vec())
}

/// `inputs` = x, and weight, bias (both `shape`) when `affine`.
pub fn layer_norm_shape(dim: usize, shape: &[usize], affine: bool, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    let want = 1 + 2 * affine as usize;
    if inputs.len() != want {
        return Err(format!("layer_norm expects {want} inputs, got {}", inputs.len()).into());
    }
    let x = inputs[0];
    if shape.is_empty() || shape.contains(&0) {
        return Err(format!("layer_norm needs a non-empty positive normalized_shape, got {shape:?}").into());
    }
    if dim == 0 {
        return Err(format!("layer_norm over {shape:?} of {x:?} would include dim 0: the engine keeps the batch as dim 0").into());
    }
    if x.get(dim..dim + shape.len()) != Some(shape) {
        return Err(format!("layer_norm over {shape:?} from dim {dim}: input shape {x:?} does not end in it there").into());
    }
    if let Some(bad) = inputs[1..].iter().find(|p| **p != shape) {
        return Err(format!("layer_norm weight and bias must have shape {shape:?}, got {bad:?}").into());
    }
    Ok(x.to_vec())
}

/// `inputs` = x `[N, C, *]`, and weight, bias (both `[C]`) when `affine`; `groups` divides C.
pub fn group_norm_shape(groups: usize, affine: bool, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    let want = 1 + 2 * affine as usize;
    if inputs.len() != want {
        return Err(format!("group_norm expects {want} inputs, got {}", inputs.len()).into());
    }
    let x = inputs[0];
    let c = *x.get(1).ok_or_else(|| format!("group_norm needs [N, C, *], got {x:?}"))?;
    if groups == 0 || !c.is_multiple_of(groups) {
        return Err(format!("group_norm of {c} channels in {groups} groups: the groups must divide the channels").into());
    }
    if let Some(bad) = inputs[1..].iter().find(|p| **p != [c]) {
        return Err(format!("group_norm weight and bias must have shape [{c}], got {bad:?}").into());
    }
    Ok(x.to_vec())
}

/// `(outer, len, inner)` of `shape` for an op over the dims `dim .. dim + count` (contiguous order).
pub fn split_dims(shape: &[usize], dim: usize, count: usize) -> (usize, usize, usize) {
    let end = (dim + count).min(shape.len());
    let p = |s: &[usize]| s.iter().product::<usize>();
    (p(&shape[..dim.min(end)]), p(&shape[dim.min(end)..end]), p(&shape[end..]))
}

// ---- CPU reference

use crate::graph::HostTensor;

/// `torch.softmax` on `x` in place: max-subtracted, sums in f64.
pub fn softmax_cpu(dim: usize, mut x: HostTensor) -> Result<HostTensor, OpError> {
    softmax_shape(dim, &[&x.shape])?;
    let (outer, len, inner) = split_dims(&x.shape, dim, 1);
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| o * len * inner + j * inner + i;
            // NaN propagates (as PyTorch): a NaN max makes every exp NaN.
            let m = (0..len).map(|j| x.data[at(j)]).fold(f32::NEG_INFINITY, |m, v| if v > m || v.is_nan() { v } else { m });
            let mut sum = 0f64;
            for j in 0..len {
                let e = (x.data[at(j)] - m).exp();
                x.data[at(j)] = e;
                sum += e as f64;
            }
            let inv = (1.0 / sum) as f32;
            (0..len).for_each(|j| x.data[at(j)] *= inv);
        }
    }
    Ok(x)
}

/// `F.layer_norm` on `x` in place over the dims `dim .. dim + shape.len()`: biased variance, in
/// f64; `wb` = weight and bias of `shape`.
pub fn layer_norm_cpu(
    dim: usize,
    shape: &[usize],
    eps: f32,
    mut x: HostTensor,
    wb: Option<(&HostTensor, &HostTensor)>,
) -> Result<HostTensor, OpError> {
    let mut shapes: Vec<&[usize]> = vec![&x.shape];
    if let Some((w, b)) = wb {
        shapes.extend([w.shape.as_slice(), b.shape.as_slice()]);
    }
    layer_norm_shape(dim, shape, wb.is_some(), &shapes)?;
    let (outer, len, inner) = split_dims(&x.shape, dim, shape.len());
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| o * len * inner + j * inner + i;
            let mean = (0..len).map(|j| x.data[at(j)] as f64).sum::<f64>() / len as f64;
            let var = (0..len).map(|j| (x.data[at(j)] as f64 - mean).powi(2)).sum::<f64>() / len as f64;
            let rstd = 1.0 / (var + eps as f64).sqrt();
            for j in 0..len {
                let mut v = (x.data[at(j)] as f64 - mean) * rstd;
                if let Some((w, b)) = wb {
                    v = v * w.data[j] as f64 + b.data[j] as f64;
                }
                x.data[at(j)] = v as f32;
            }
        }
    }
    Ok(x)
}

/// `F.group_norm` on `x` in place: per image and group, the mean and biased variance of its
/// channels and positions in f64, then the per-channel affine.
pub fn group_norm_cpu(groups: usize, eps: f32, mut x: HostTensor, wb: Option<(&HostTensor, &HostTensor)>) -> Result<HostTensor, OpError> {
    let mut shapes: Vec<&[usize]> = vec![&x.shape];
    if let Some((w, b)) = wb {
        shapes.extend([w.shape.as_slice(), b.shape.as_slice()]);
    }
    group_norm_shape(groups, wb.is_some(), &shapes)?;
    let (c, spatial) = (x.shape[1], x.shape[2..].iter().product::<usize>());
    let len = c / groups * spatial;
    for (r, row) in x.data.chunks_exact_mut(len.max(1)).enumerate() {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / len as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / len as f64;
        let rstd = 1.0 / (var + eps as f64).sqrt();
        for (j, v) in row.iter_mut().enumerate() {
            let mut y = (*v as f64 - mean) * rstd;
            if let Some((w, b)) = wb {
                let ch = (r % groups) * (c / groups) + j / spatial;
                y = y * w.data[ch] as f64 + b.data[ch] as f64;
            }
            *v = y as f32;
        }
    }
    Ok(x)
}

/// Per-channel `(scale, shift)` of an inference BatchNorm: `y = x·scale + shift`, computed in f64.
/// Shared by the CPU reference and `passes::fold_batchnorm`.
pub fn batch_norm_scale_shift(gamma: &[f32], beta: &[f32], mean: &[f32], var: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    gamma
        .iter()
        .zip(beta)
        .zip(mean.iter().zip(var))
        .map(|((&g, &b), (&m, &v))| {
            let scale = g as f64 / (v as f64 + eps as f64).sqrt();
            (scale as f32, (b as f64 - m as f64 * scale) as f32)
        })
        .unzip()
}

/// Inference BatchNorm on `x` (taken by value so the executor can reuse its buffer); `params` =
/// weight, bias, running_mean, running_var.
pub fn batch_norm2d_cpu(eps: f32, mut x: HostTensor, params: [&HostTensor; 4]) -> Result<HostTensor, OpError> {
    let shapes: Vec<&[usize]> = std::iter::once(x.shape.as_slice()).chain(params.iter().map(|p| p.shape.as_slice())).collect();
    batch_norm2d_shape(&shapes)?;
    let [gamma, beta, mean, var] = params;
    let (scale, shift) = batch_norm_scale_shift(&gamma.data, &beta.data, &mean.data, &var.data, eps);
    let (c, plane) = (x.shape[1], x.shape[2] * x.shape[3]);
    for (i, chunk) in x.data.chunks_exact_mut(plane.max(1)).enumerate() {
        let (s, t) = (scale[i % c], shift[i % c]);
        chunk.iter_mut().for_each(|v| *v = *v * s + t);
    }
    Ok(x)
}

// ---- GPU converter (engine::cudnn)

/// A BatchNorm2d the passes could not fold (its input is not a conv's, as DenseNet's
/// pre-activation norms) runs as what it is at inference, a per-channel scale and shift: our
/// scale+shift kernel (memory-bound, one pass), or cuDNN's depthwise 1×1 convolution with bias;
/// timing picks.
fn gpu_batch_norm2d(ctx: &mut BuildCtx, node: NodeId, eps: f32) -> Result<Box<dyn Layer>> {
    use crate::engine::cudnn::{conv_candidates_with, ConvGeometry, ConvProblem, Epilogue};
    use crate::ops::elementwise::bias_act;
    let params = [ctx.weight(node, 1)?, ctx.weight(node, 2)?, ctx.weight(node, 3)?, ctx.weight(node, 4)?];
    let (scale, shift) = batch_norm_scale_shift(&params[0].data, &params[1].data, &params[2].data, &params[3].data, eps);
    let c = scale.len();
    let (geometry, epilogue) = (ConvGeometry { groups: c, ..Default::default() }, Epilogue { bias: true, relu: false });
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let problem = ConvProblem { geometry, epilogue, weight: &scale, weight_shape: [c, 1, 1, 1], bias: &shift, x, y, z: None };
    let key = ctx.problem_key(node);
    let mut candidates = conv_candidates_with(ctx, problem)?;
    candidates.push(bias_act(ctx, node, x, Some(&scale), Some(&shift), None, y, None)?);
    ctx.choose(&key, candidates)
}

/// The input and output of a norm that writes its input's shape and type, and their values. The
/// input may be stored in another layout than the output when the two have the same bytes (a
/// reformat between them is skipped: a one-channel conv output, NHWC, read by a softmax over W
/// that the plan gave NCHW); the kernels then address both as the output's.
fn same_bytes_operands(ctx: &BuildCtx, node: NodeId) -> Result<(ValueId, ValueId, ValueDesc, ValueDesc)> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let (dx, dy) = (ctx.value(x).clone(), ctx.value(y).clone());
    if dx.elem != dy.elem || dx.dims != dy.dims || !dx.layout.same_bytes(dy.layout, &dx.dims) {
        return Err(ctx.err(
            node,
            LowerKind::Operands,
            format!("input {:?} {:?} and output {:?} {:?} differ", dx.layout, dx.dims, dy.layout, dy.dims),
        ));
    }
    Ok((x, y, dx, dy))
}

/// GroupNorm on NCHW or NHWC: `group_norm_*`, one block per (image, group) row of `C / groups · HW`
/// elements (statistics in f32, two passes), the per-channel affine applied on the way out; and,
/// timed beside it for long rows, the split form ([`GroupNormSplit`]) for few rows.
fn gpu_group_norm(ctx: &mut BuildCtx, node: NodeId, groups: usize, eps: f32, affine: bool) -> Result<Box<dyn Layer>> {
    use crate::engine::launch::{Arg, KArg, KernelLayer, BLOCK};
    let (x, y, dx, dy) = same_bytes_operands(ctx, node)?;
    let nhwc = if dy.layout.is_channels_last() {
        1
    } else if dy.layout == Layout::contiguous(dy.dims.len()) {
        0
    } else {
        return Err(ctx.err(node, LowerKind::Operands, format!("reads NCHW or NHWC, got {:?}", dy.layout)));
    };
    let c = dx.dims[0];
    let spatial: usize = dx.dims[1..].iter().product();
    let upload_affine = |ctx: &mut BuildCtx| -> Result<(Option<DeviceBuf>, Option<DeviceBuf>)> {
        if !affine {
            return Ok((None, None));
        }
        let (w, b) = (ctx.weight(node, 1)?.clone(), ctx.weight(node, 2)?.clone());
        Ok((Some(ctx.upload_f32(&w.data)?), Some(ctx.upload_f32(&b.data)?)))
    };
    let int = |what: &str, v: usize| {
        i32::try_from(v).map_err(|_| ctx.err(node, LowerKind::TooLarge, format!("{what} = {v} exceeds the kernels' 32-bit range")))
    };
    let (g, cpg, hw) = (int("groups", groups)?, int("channels per group", c / groups.max(1))?, int("positions", spatial)?);
    let len = int("row length", c / groups.max(1) * spatial)?;
    let (w, b) = upload_affine(ctx)?;
    let args = vec![
        Arg::Value(x),
        Arg::Value(y),
        Arg::Buf(w),
        Arg::Buf(b),
        Arg::Const(KArg::F32(eps)),
        Arg::PerBatch(groups),
        Arg::Const(KArg::I32(g)),
        Arg::Const(KArg::I32(cpg)),
        Arg::Const(KArg::I32(hw)),
        Arg::Const(KArg::I32(nhwc)),
    ];
    // A block a row: `groups · BLOCK` work items per image.
    let layer = KernelLayer::new(ctx, &format!("group_norm_{}", dx.elem.suffix()), args, groups * BLOCK as usize)?;
    let row = Box::new(layer.kind("kernel:group_norm".into()));
    if (len as usize) < GROUP_NORM_SPLIT_MIN_LEN {
        return Ok(row);
    }
    let (w, b) = upload_affine(ctx)?;
    let split = GroupNormSplit {
        path: ctx.node(node).path.clone(),
        partial: ctx.kernels.get(&format!("group_norm_partial_{}", dx.elem.suffix()))?,
        normalise: ctx.kernels.get(&format!("group_norm_split_{}", dx.elem.suffix()))?,
        x,
        y,
        w,
        b,
        eps,
        groups: g,
        cpg,
        hw,
        nhwc,
        sm_count: ctx.kernels.sm_count(),
    };
    let key = ctx.problem_key(node);
    ctx.choose(&key, vec![row, Box::new(split)])
}

/// Rows at least this long get the split GroupNorm as a timed candidate.
const GROUP_NORM_SPLIT_MIN_LEN: usize = 8192;
/// The fewest elements a chunk of the split GroupNorm takes.
const GROUP_NORM_MIN_CHUNK: usize = 2048;

/// GroupNorm for few long rows (batch 1, one group: MobileViTv2, PoolFormer): each row is cut into
/// `parts` chunks over as many blocks; `group_norm_partial` writes each chunk's count, mean and sum
/// of squared deviations to the workspace, `group_norm_split` merges a row's (Chan's formula) and
/// normalises its chunk.
struct GroupNormSplit {
    path: String,
    partial: crate::engine::launch::CudaFunction,
    normalise: crate::engine::launch::CudaFunction,
    x: ValueId,
    y: ValueId,
    w: Option<DeviceBuf>,
    b: Option<DeviceBuf>,
    eps: f32,
    groups: i32,
    cpg: i32,
    hw: i32,
    nhwc: i32,
    sm_count: u32,
}

impl GroupNormSplit {
    fn rows(&self, batch: usize) -> usize {
        batch * self.groups as usize
    }
    /// Chunks a row: enough blocks for two an SM over all rows, chunks of at least
    /// `GROUP_NORM_MIN_CHUNK` elements.
    fn parts(&self, batch: usize) -> usize {
        let len = self.cpg as usize * self.hw as usize;
        let rows = self.rows(batch).max(1);
        (2 * self.sm_count as usize).div_ceil(rows).min(len.div_ceil(GROUP_NORM_MIN_CHUNK)).max(1)
    }
}

impl Layer for GroupNormSplit {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "kernel:group_norm_split".into()
    }
    fn workspace_bytes(&self, batch: usize) -> usize {
        // (count, mean, M2) in f32 per chunk.
        self.rows(batch) * self.parts(batch) * 3 * 4
    }
    fn enqueue(&self, rt: &crate::engine::RunCtx, batch: usize) -> Result<()> {
        use crate::engine::launch::{launch, KArg, BLOCK};
        let (rows, parts) = (self.rows(batch), self.parts(batch));
        let tiles = (rows * parts).clamp(1, self.sm_count as usize * 16) as u32;
        let (w, b) = (self.w.as_ref().map_or(0, |w| w.ptr()), self.b.as_ref().map_or(0, |b| b.ptr()));
        let shape = [KArg::I32(self.groups), KArg::I32(self.cpg), KArg::I32(self.hw), KArg::I32(self.nhwc), KArg::I32(parts as i32)];
        let mut args = vec![KArg::Ptr(rt.ptr(self.x)), KArg::Ptr(rt.workspace), KArg::I64(rows as i64)];
        args.extend(shape);
        launch(rt, &self.partial, (tiles, 1, 1), (BLOCK, 1, 1), 0, &args)?;
        let mut args = vec![
            KArg::Ptr(rt.ptr(self.x)),
            KArg::Ptr(rt.ptr(self.y)),
            KArg::Ptr(w),
            KArg::Ptr(b),
            KArg::Ptr(rt.workspace),
            KArg::F32(self.eps),
            KArg::I64(rows as i64),
        ];
        args.extend(shape);
        launch(rt, &self.normalise, (tiles, 1, 1), (BLOCK, 1, 1), 0, &args)
    }
}

// ---- GPU converters for softmax and LayerNorm (kernels/norm.cu)

/// Where the dims `dim .. dim + count` (of the full shape, batch first) sit in `layout`: their
/// physical position, when they are stored together and in their logical order.
fn rows_position(layout: Layout, dim: usize, count: usize) -> Option<usize> {
    let order = layout.order();
    let first = dim.checked_sub(1)?;
    let p = order.iter().position(|&d| d == first)?;
    let run = order.get(p..p + count)?;
    run.iter().enumerate().all(|(k, &d)| d == first + k).then_some(p)
}

/// Softmax and LayerNorm read their input as it is when it keeps their dims together, in order
/// and innermost (so LayerNorm2d runs on NHWC with unit stride, one warp per row), else the
/// contiguous one; the output is written in the layout the input is read in. A run that is
/// together but not innermost is not kept: one thread per column over a strided row was 30x
/// slower than a reformat plus the row kernel (ViT-B/16's LayerNorms on a channels-last residual
/// stream: 0.18 ms each at batch 1 on an H100).
fn rows_layout(inputs: &[Option<Layout>], out_rank: usize, dim: usize, count: usize) -> LayoutPlan {
    let chosen = match inputs.first().copied().flatten() {
        Some(l) if l.rank() == out_rank && out_rank.checked_sub(count).is_some_and(|p| rows_position(l, dim, count) == Some(p)) => l,
        _ => Layout::contiguous(out_rank),
    };
    LayoutPlan { inputs: inputs.iter().map(|l| l.map(|_| chosen)).collect(), output: chosen }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum RowOp {
    Softmax,
    LayerNorm { eps: f32, affine: bool },
}

/// A softmax or LayerNorm over `(outer, len, inner)` in physical order: one warp per row when
/// the row is contiguous (`inner == 1`), one thread per column otherwise, or (`split`, a softmax)
/// a block per 32 columns whose thread groups share each column.
struct RowsLayer {
    path: String,
    op: RowOp,
    f: crate::engine::launch::CudaFunction,
    x: ValueId,
    y: ValueId,
    params: Option<(crate::engine::DeviceBuf, crate::engine::DeviceBuf)>,
    /// Per image.
    outer: usize,
    len: i32,
    inner: i32,
    /// `layer_norm_packed`'s lanes per row (the row held in registers); `None`: the row kernel.
    packed_lanes: Option<i32>,
    /// `softmax_split`: columns (`inner > 1`) too few to fill the GPU one thread each.
    split: bool,
    sm_count: u32,
}

impl Layer for RowsLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        let what = match self.op {
            RowOp::Softmax => "softmax",
            RowOp::LayerNorm { .. } => "layer_norm",
        };
        match self.packed_lanes {
            Some(_) => format!("kernel:{what}_packed"),
            None if self.split => format!("kernel:{what}_split"),
            None => format!("kernel:{what}{}", if self.inner == 1 { "_rows" } else { "_cols" }),
        }
    }
    fn enqueue(&self, rt: &crate::engine::RunCtx, batch: usize) -> Result<()> {
        use crate::engine::launch::{grid_for, launch, split_grid, KArg, BLOCK, SPLIT_BLOCK};
        let outer = batch * self.outer;
        let threads = match self.packed_lanes {
            Some(g) => outer * g as usize,
            None if self.inner == 1 => outer * 32,
            None => outer * self.inner as usize,
        };
        let mut args = vec![KArg::Ptr(rt.ptr(self.x)), KArg::Ptr(rt.ptr(self.y))];
        if let RowOp::LayerNorm { eps, .. } = self.op {
            let (w, b) = self.params.as_ref().map_or((0, 0), |(w, b)| (w.ptr(), b.ptr()));
            args.extend([KArg::Ptr(w), KArg::Ptr(b), KArg::F32(eps)]);
        }
        args.extend([KArg::I64(outer as i64), KArg::I32(self.len), KArg::I32(self.packed_lanes.unwrap_or(self.inner))]);
        if self.split {
            return launch(rt, &self.f, split_grid(threads, self.sm_count), (SPLIT_BLOCK, 1, 1), 0, &args);
        }
        launch(rt, &self.f, grid_for(threads, self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

fn gpu_rows(ctx: &mut BuildCtx, node: NodeId, op: RowOp, dim: usize, count: usize) -> Result<Box<dyn Layer>> {
    // The rows are the output layout's (an input with the same bytes in another layout is read
    // as the output's).
    let (x, y, dx, dy) = same_bytes_operands(ctx, node)?;
    let p = rows_position(dy.layout, dim, count).ok_or_else(|| {
        ctx.err(node, LowerKind::Operands, format!("dims {dim}..{} are not stored together in {:?}", dim + count, dy.layout))
    })?;
    let phys: Vec<usize> = dy.layout.order().iter().map(|&d| dy.dims[d]).collect();
    let prod = |s: &[usize]| s.iter().product::<usize>();
    let (outer, len, inner) = (prod(&phys[..p]), prod(&phys[p..p + count]), prod(&phys[p + count..]));
    let int = |what: &str, v: usize| {
        i32::try_from(v).map_err(|_| ctx.err(node, LowerKind::TooLarge, format!("{what} = {v} exceeds the kernels' 32-bit range")))
    };
    let (len, inner) = (int("row length", len)?, int("inner size", inner)?);
    let upload_params = |ctx: &mut BuildCtx| match op {
        RowOp::LayerNorm { affine: true, .. } => {
            let (w, b) = (ctx.weight(node, 1)?.clone(), ctx.weight(node, 2)?.clone());
            Ok::<_, crate::Error>(Some((ctx.upload_f32(&w.data)?, ctx.upload_f32(&b.data)?)))
        }
        _ => Ok(None),
    };
    let name = match op {
        RowOp::Softmax => "softmax",
        RowOp::LayerNorm { .. } => "layer_norm",
    };
    let f = ctx.kernels.get(&format!("{name}_{}", dx.elem.suffix()))?;
    let path = ctx.node(node).path.clone();
    let sm_count = ctx.kernels.sm_count();
    let params = upload_params(ctx)?;
    let rows = RowsLayer { path: path.clone(), op, f, x, y, params, outer, len, inner, packed_lanes: None, split: false, sm_count };
    let lanes = packed_lanes(len as usize, inner as usize, dx.elem.size());
    match (op, lanes) {
        (RowOp::Softmax, _) if inner > 1 && len as usize >= SPLIT_MIN_LEN => {
            // Few long columns (a softmax over the tokens of each channel, CoaT's factorised
            // attention) want the split kernel, many short ones a thread each: timing picks.
            let f = ctx.kernels.get(&format!("softmax_split_{}", dx.elem.suffix()))?;
            let split = RowsLayer { path, op, f, x, y, params: None, outer, len, inner, packed_lanes: None, split: true, sm_count };
            let key = ctx.problem_key(node);
            ctx.choose(&key, vec![Box::new(rows), Box::new(split)])
        }
        (RowOp::LayerNorm { .. }, Some(g)) => {
            // The register-held row kernel beside the row kernel: timing picks (a tactic, so the
            // slower cannot be chosen, and `tactic_sources` can force either).
            let f = ctx.kernels.get(&format!("layer_norm_packed_{}", dx.elem.suffix()))?;
            let params = upload_params(ctx)?;
            let packed = RowsLayer { path, op, f, x, y, params, outer, len, inner, packed_lanes: Some(g), split: false, sm_count };
            let key = ctx.problem_key(node);
            ctx.choose(&key, vec![Box::new(rows), Box::new(packed)])
        }
        _ => Ok(Box::new(rows)),
    }
}

/// Softmax columns at least this long get `softmax_split` as a timed candidate.
const SPLIT_MIN_LEN: usize = 64;

/// Packs of 16 bytes a lane holds at most in `layer_norm_packed` (`LN_PACKS` in kernels/norm.cu).
const LN_PACKS: usize = 4;

/// The lanes per row `layer_norm_packed` takes for contiguous rows of `len` elements of
/// `elem_size` bytes: the fewest (a power of two up to a warp) that hold the row in at most
/// `LN_PACKS` 16-byte packs each; `None` where the row is strided, not whole packs or too long.
fn packed_lanes(len: usize, inner: usize, elem_size: usize) -> Option<i32> {
    let per_pack = 16 / elem_size;
    if inner != 1 || len == 0 || !len.is_multiple_of(per_pack) {
        return None;
    }
    let packs = len / per_pack;
    [1i32, 2, 4, 8, 16, 32].into_iter().find(|&g| g as usize * LN_PACKS >= packs)
}

/// The ATen ops (and modules) kiln-torch imports as this family's ops; `nn.InstanceNorm2d` is a
/// GroupNorm of one channel a group, or with running statistics a BatchNorm.
#[doc(hidden)]
pub const ATEN: &[AtenImport] = &[
    ("batch_norm2d", &["aten._native_batch_norm_legit_no_training.default", "aten.batch_norm.default", "aten.instance_norm.default"]),
    ("softmax", &["aten.softmax.int", "aten._softmax.default"]),
    ("layer_norm", &["aten.layer_norm.default", "aten.native_layer_norm.default", "torchvision.models.convnext.LayerNorm2d"]),
    ("group_norm", &["aten.group_norm.default", "aten.native_group_norm.default", "aten.instance_norm.default"]),
];

/// The Kiln twins of this family's PyTorch op fixtures (`op_cases()` in tools/export_reference.py).
#[doc(hidden)]
pub const FIXTURE_TWINS: &[FixtureTwin] = &[
    ("batch_norm2d_eps", |f| BatchNorm2d::load(f.vb, &BatchNorm2dConfig { num_features: 5, eps: 1e-3 })?.forward(f.x)),
    ("softmax_dim1", |f| Softmax::load(f.vb, &1)?.forward(f.x)),
    ("softmax_last", |f| f.x.affine(4.0, 0.0)?.softmax(-1)),
    ("softmax_mid", |f| f.x.softmax(2)),
    ("layer_norm_last", |f| LayerNorm::load(f.vb, &LayerNormConfig::new(&[24]))?.forward(f.x)),
    ("layer_norm_convnext_nhwc", |f| LayerNorm::load(f.vb, &LayerNormConfig::new(&[8]).eps(1e-6))?.forward(f.x)),
    ("layer_norm_2d_torchvision", |f| LayerNorm2d::load(f.vb, &LayerNormConfig::new(&[8]).eps(1e-6))?.forward(f.x)),
    ("layer_norm_two_dims", |f| LayerNorm::load(f.vb, &LayerNormConfig::new(&[6, 7]).eps(1e-3))?.forward(f.x)),
    ("group_norm", |f| GroupNorm::load(f.vb, &GroupNormConfig::new(2, 6))?.forward(f.x)),
    ("group_norm_eps_rank3", |f| GroupNorm::load(f.vb, &GroupNormConfig { eps: 1e-3, ..GroupNormConfig::new(3, 6) })?.forward(f.x)),
    ("group_norm_instance_norm_affine", |f| GroupNorm::load(f.vb, &GroupNormConfig::new(4, 4))?.forward(f.x)),
    ("group_norm_instance_norm", |f| f.x.group_norm(5, 1e-5)),
    ("layer_norm_no_affine", |f| LayerNorm::load(f.vb, &LayerNormConfig::new(&[10]).elementwise_affine(false))?.forward(f.x)),
];

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize], data: Vec<f32>) -> HostTensor {
        HostTensor::new(shape.to_vec(), data)
    }

    /// A graph file's BatchNorm with eps -1 passed `Graph::validate` and gave NaN logits; eps
    /// must be positive and finite, for every norm that has one, at trace time and in `validate`.
    #[test]
    fn a_norm_whose_eps_is_not_positive_is_refused() {
        use crate::graph::Graph;
        use std::sync::Arc;
        let mut g = Graph::default();
        let x = g.push_unchecked(Op::Input { name: "input".into() }, vec![], vec![1, 3, 4, 4], "input".into());
        let params: Vec<NodeId> =
            ["weight", "bias", "running_mean", "running_var"].map(|n| g.weight(&format!("bn.{n}"), Arc::new(t(&[3], vec![1.0; 3])))).into();
        let inputs = [vec![x], params].concat();
        for eps in [-1.0, 0.0, f32::NAN, f32::INFINITY] {
            let e = g.push(Op::Norm(Norm::BatchNorm2d { eps }), inputs.clone(), "bn".into()).expect_err("traced");
            assert!(e.to_string().contains(&format!("eps must be positive and finite, got {eps}")), "{e}");
        }
        for norm in
            [Norm::LayerNorm { dim: 1, shape: vec![3], eps: -1.0, affine: false }, Norm::GroupNorm { groups: 3, eps: 0.0, affine: false }]
        {
            assert!(norm.infer_shape(&[&[1, 3, 4, 4]]).is_err(), "{norm:?}");
        }
        // A file's graph: the node is stored as it is, and validation refuses it.
        let bn = g.push_unchecked(Op::Norm(Norm::BatchNorm2d { eps: -1.0 }), inputs.clone(), vec![1, 3, 4, 4], "bn".into());
        g.inputs.push(x);
        g.mark_output("y", bn);
        let e = g.validate().expect_err("eps -1");
        assert!(matches!(e, crate::Error::InvalidGraph { node, .. } if node == bn), "{e}");
        assert!(e.to_string().contains("eps must be positive and finite, got -1"), "{e}");
        g.nodes[bn].op = Op::Norm(Norm::BatchNorm2d { eps: 1e-5 });
        g.validate().expect("eps 1e-5");
    }

    #[test]
    fn softmax_shape_errors_name_the_shape() {
        assert!(softmax_shape(0, &[&[2, 3]]).unwrap_err().to_string().contains("batch"));
        assert!(softmax_shape(2, &[&[2, 3]]).unwrap_err().to_string().contains("[2, 3]"));
        assert!(softmax_shape(1, &[&[2, 3], &[2, 3]]).is_err());
        assert_eq!(softmax_shape(1, &[&[2, 3]]), Ok(vec![2, 3]));
    }

    #[test]
    fn resolve_dim_counts_from_the_end_and_refuses_the_batch() {
        assert_eq!(resolve_dim(&[2, 3, 4], -1), Ok(2));
        assert_eq!(resolve_dim(&[2, 3, 4], 1), Ok(1));
        assert!(resolve_dim(&[2, 3, 4], -3).unwrap_err().to_string().contains("batch"));
        assert!(resolve_dim(&[2, 3, 4], 3).is_err());
        assert!(resolve_dim(&[2, 3, 4], -4).is_err());
    }

    #[test]
    fn softmax_rows_sum_to_one_and_nan_propagates() {
        let y = softmax_cpu(1, t(&[1, 3, 2], vec![1.0, 0.0, 2.0, 0.0, 3.0, f32::NAN])).unwrap();
        let col0: f32 = [0, 2, 4].iter().map(|&i| y.data[i]).sum();
        assert!((col0 - 1.0).abs() < 1e-6, "{y:?}");
        assert!(y.data[1].is_nan() && y.data[5].is_nan(), "a NaN makes its whole column NaN, as PyTorch");
        // Large logits do not overflow (max-subtracted).
        let y = softmax_cpu(1, t(&[1, 2], vec![1000.0, 1000.0])).unwrap();
        assert_eq!(y.data, vec![0.5, 0.5]);
    }

    #[test]
    fn layer_norm_shape_errors() {
        assert!(layer_norm_shape(1, &[4], false, &[&[2, 3]]).unwrap_err().to_string().contains("[2, 3]"));
        assert!(layer_norm_shape(0, &[2, 3], false, &[&[2, 3]]).unwrap_err().to_string().contains("batch"));
        assert!(layer_norm_shape(1, &[], false, &[&[2, 3]]).is_err());
        assert!(layer_norm_shape(1, &[3], true, &[&[2, 3]]).unwrap_err().to_string().contains("3 inputs"));
        assert!(layer_norm_shape(1, &[3], true, &[&[2, 3], &[3], &[4]]).unwrap_err().to_string().contains("[4]"));
        assert!(layer_norm_shape(1, &[3, 4], false, &[&[2, 3]]).is_err(), "normalized dims past the end");
        assert_eq!(layer_norm_shape(1, &[3], true, &[&[2, 3, 5], &[3], &[3]]), Ok(vec![2, 3, 5]));
    }

    #[test]
    fn layer_norm_over_a_middle_dim_normalises_each_column() {
        // [1, 2, 2]: normalise over dim 1 (LayerNorm2d's channels): columns (1, 3) and (2, 6).
        let y = layer_norm_cpu(1, &[2], 0.0, t(&[1, 2, 2], vec![1.0, 2.0, 3.0, 6.0]), None).unwrap();
        assert_eq!(y.data, vec![-1.0, -1.0, 1.0, 1.0]);
        let (w, b) = (t(&[2], vec![2.0, 3.0]), t(&[2], vec![0.5, -0.5]));
        let y = layer_norm_cpu(1, &[2], 0.0, t(&[1, 2, 2], vec![1.0, 2.0, 3.0, 6.0]), Some((&w, &b))).unwrap();
        assert_eq!(y.data, vec![-1.5, -1.5, 2.5, 2.5]);
    }

    #[test]
    fn packed_layer_norm_lanes_hold_the_row_in_at_most_four_packs() {
        // ConvNeXt's widths in f16 (8 halves a pack): 12, 24, 48, 96 packs -> 3 packs a lane.
        assert_eq!(packed_lanes(96, 1, 2), Some(4));
        assert_eq!(packed_lanes(192, 1, 2), Some(8));
        assert_eq!(packed_lanes(384, 1, 2), Some(16));
        assert_eq!(packed_lanes(768, 1, 2), Some(32));
        assert_eq!(packed_lanes(8, 1, 2), Some(1));
        assert_eq!(packed_lanes(768, 1, 4), None, "192 f32 packs exceed 32 lanes x 4");
        assert_eq!(packed_lanes(24, 1, 4), Some(2));
        assert_eq!(packed_lanes(20, 1, 2), None, "not whole packs");
        assert_eq!(packed_lanes(96, 5, 2), None, "strided rows");
        assert_eq!(packed_lanes(1032, 1, 2), None);
    }

    #[test]
    fn split_dims_and_rows_positions() {
        assert_eq!(split_dims(&[2, 3, 4, 5], 1, 1), (2, 3, 20));
        assert_eq!(split_dims(&[2, 3, 4, 5], 2, 2), (6, 20, 1));
        // NHWC of [C, H, W]: channels (dim 1) are innermost; H, W (dims 2, 3) are together first.
        let nhwc = Layout::channels_last(3);
        assert_eq!(rows_position(nhwc, 1, 1), Some(2));
        assert_eq!(rows_position(nhwc, 2, 2), Some(0));
        assert_eq!(rows_position(nhwc, 1, 2), None, "C and H are not stored together in NHWC");
        assert_eq!(rows_position(Layout::contiguous(3), 1, 3), Some(0));
        let plan = rows_layout(&[Some(nhwc)], 3, 1, 2);
        assert_eq!(plan.output, Layout::contiguous(3));
        assert_eq!(rows_layout(&[Some(nhwc), None, None], 3, 1, 1).inputs, vec![Some(nhwc), None, None]);
    }
}
