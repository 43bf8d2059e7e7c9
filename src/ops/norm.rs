//! Normalisations along some dims: BatchNorm2d (inference: running statistics; folded into the
//! preceding conv by `passes::fold_batchnorm`, a per-channel scale and shift otherwise).

use crate::engine::{BuildCtx, Layer, Layout};
use crate::graph::{NodeId, Op};
use crate::module::{Forward, Module};
use crate::ops::{CpuArgs, LayoutPlan, OpDef};
use crate::tensor::{Param, Tensor};
use crate::var_builder::VarBuilder;
use crate::Result;
use serde::{Deserialize, Serialize};

/// Normalisations. Inputs: BatchNorm2d: x, weight, bias, running_mean, running_var.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, strum::EnumIter)]
pub enum Norm {
    BatchNorm2d { eps: f32 },
}

impl OpDef for Norm {
    fn name(&self) -> &str {
        match self {
            Norm::BatchNorm2d { .. } => "batch_norm2d",
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match self {
            Norm::BatchNorm2d { .. } => batch_norm2d_shape(inputs),
        }
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, String> {
        match *self {
            Norm::BatchNorm2d { eps } => {
                args.expect(5)?;
                let x = args.take(0)?;
                let [g, b, m, v] = [args.get(1)?, args.get(2)?, args.get(3)?, args.get(4)?];
                batch_norm2d_cpu(eps, x, [g, b, m, v])
            }
        }
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        match self {
            Norm::BatchNorm2d { .. } => LayoutPlan::all(inputs, Layout::channels_last(out_rank)),
        }
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        match *self {
            Norm::BatchNorm2d { eps } => gpu_batch_norm2d(ctx, node, eps),
        }
    }
    fn label(&self) -> String {
        match self {
            Norm::BatchNorm2d { eps } => format!("batch_norm2d eps={eps}"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNorm2dConfig {
    pub num_features: usize,
    pub eps: f32,
}

impl BatchNorm2dConfig {
    pub fn new(num_features: usize) -> Self {
        Self { num_features, eps: 1e-5 }
    }
}

impl Default for BatchNorm2dConfig {
    fn default() -> Self {
        Self::new(1)
    }
}

/// `torch.nn.BatchNorm2d` in eval mode: `weight`, `bias`, `running_mean`, `running_var`.
#[derive(Clone, Debug)]
pub struct BatchNorm2d {
    pub path: String,
    pub params: [Param; 4],
    pub eps: f32,
}

impl Module for BatchNorm2d {
    type Config = BatchNorm2dConfig;
    fn load(vb: VarBuilder, c: &BatchNorm2dConfig) -> Result<Self> {
        let n = [c.num_features];
        let params = [vb.get(&n, "weight")?, vb.get(&n, "bias")?, vb.get(&n, "running_mean")?, vb.get(&n, "running_var")?];
        Ok(Self { path: vb.path().to_string(), params, eps: c.eps })
    }
}

impl Forward for BatchNorm2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [a, b, c, d] = &self.params;
        Tensor::record(&self.path, Op::Norm(Norm::BatchNorm2d { eps: self.eps }), &[x], &[a, b, c, d])
    }
}

/// `inputs` = x, weight, bias, running_mean, running_var.
pub fn batch_norm2d_shape(inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
    if inputs.len() != 5 {
        return Err(format!("batch_norm2d expects 5 inputs, got {}", inputs.len()));
    }
    let x = inputs[0];
    if x.len() != 4 {
        return Err(format!("input must be NCHW (rank 4), got {x:?}"));
    }
    if let Some(bad) = inputs[1..].iter().find(|p| **p != [x[1]]) {
        return Err(format!("input has {} channels, but the layer has {bad:?} features", x[1]));
    }
    Ok(x.to_vec())
}

// ---- CPU reference

use crate::graph::HostTensor;

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
pub fn batch_norm2d_cpu(eps: f32, mut x: HostTensor, params: [&HostTensor; 4]) -> Result<HostTensor, String> {
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

/// A BatchNorm2d the passes could not fold (its input is not a conv's) runs as what it is at
/// inference: a per-channel scale and shift, i.e. a depthwise 1×1 convolution with bias.
fn gpu_batch_norm2d(ctx: &mut BuildCtx, node: NodeId, eps: f32) -> Result<Box<dyn Layer>> {
    use crate::engine::cudnn::{conv_candidates_with, conv_key, ConvProblem};
    let params = [ctx.weight(node, 1)?, ctx.weight(node, 2)?, ctx.weight(node, 3)?, ctx.weight(node, 4)?];
    let (scale, shift) = batch_norm_scale_shift(&params[0].data, &params[1].data, &params[2].data, &params[3].data, eps);
    let c = scale.len();
    let attrs = crate::ConvAttrs { groups: c, bias: true, ..Default::default() };
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let problem = ConvProblem { attrs, weight: &scale, weight_shape: [c, 1, 1, 1], bias: &shift, x, y, z: None };
    let key = conv_key(ctx, node);
    let candidates = conv_candidates_with(ctx, node, problem)?;
    ctx.choose(&key, candidates)
}
