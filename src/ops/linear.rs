//! Linear (fully connected): `y = x Wᵀ + b` over the last dim.

use crate::engine::{BuildCtx, Layer, Layout};
use crate::graph::{NodeId, Op};
use crate::module::{Forward, Module};
use crate::ops::{CpuArgs, LayoutPlan, OpDef};
use crate::tensor::{Param, Tensor};
use crate::var_builder::VarBuilder;
use crate::Result;
use serde::{Deserialize, Serialize};

/// Matrix products. Inputs: Linear: x `[N, ..., in]`, weight `[out, in]`, bias? `[out]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, strum::EnumIter)]
pub enum Gemm {
    Linear { bias: bool },
}

impl OpDef for Gemm {
    fn name(&self) -> &str {
        match self {
            Gemm::Linear { .. } => "linear",
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match *self {
            Gemm::Linear { bias } => linear_shape(bias, inputs),
        }
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, String> {
        match *self {
            Gemm::Linear { bias } => linear_cpu(bias, &args.all()?),
        }
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        LayoutPlan::all(inputs, Layout::contiguous(out_rank))
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        match *self {
            Gemm::Linear { bias } => gpu_linear(ctx, node, bias),
        }
    }
    fn label(&self) -> String {
        match self {
            Gemm::Linear { bias } => format!("linear{}", if *bias { " +bias" } else { "" }),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearConfig {
    pub in_features: usize,
    pub out_features: usize,
    pub bias: bool,
}

impl LinearConfig {
    pub fn new(in_features: usize, out_features: usize) -> Self {
        Self { in_features, out_features, bias: true }
    }
}

impl Default for LinearConfig {
    fn default() -> Self {
        Self::new(1, 1)
    }
}

/// `torch.nn.Linear`: `weight` `[out, in]`, `bias` `[out]`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub path: String,
    pub weight: Param,
    pub bias: Option<Param>,
}

impl Module for Linear {
    type Config = LinearConfig;
    fn load(vb: VarBuilder, c: &LinearConfig) -> Result<Self> {
        let weight = vb.get(&[c.out_features, c.in_features], "weight")?;
        let bias = if c.bias { Some(vb.get(&[c.out_features], "bias")?) } else { None };
        Ok(Self { path: vb.path().to_string(), weight, bias })
    }
}

impl Forward for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let params: Vec<&Param> = std::iter::once(&self.weight).chain(&self.bias).collect();
        Tensor::record(&self.path, Op::Gemm(Gemm::Linear { bias: self.bias.is_some() }), &[x], &params)
    }
}

/// `inputs` = x `[N, in]`, weight `[out, in]`, bias? `[out]`.
pub fn linear_shape(bias: bool, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
    if inputs.len() != 2 + bias as usize {
        return Err(format!("linear expects {} inputs, got {}", 2 + bias as usize, inputs.len()));
    }
    let (x, w) = (inputs[0], inputs[1]);
    if x.len() != 2 || w.len() != 2 {
        return Err(format!("linear expects a [N, in] input and an [out, in] weight (flatten first), got {x:?} and {w:?}"));
    }
    if x[1] != w[1] {
        return Err(format!("input has {} features, but the weight {w:?} expects {}", x[1], w[1]));
    }
    if bias && inputs[2] != [w[0]] {
        return Err(format!("bias must have shape [{}], got {:?}", w[0], inputs[2]));
    }
    Ok(vec![x[0], w[0]])
}

// ---- CPU reference

use crate::graph::HostTensor;

/// `x·Wᵀ + b` with `inputs` = x `[N, in]`, weight `[out, in]`, bias? `[out]`: one GEMM onto the bias.
pub fn linear_cpu(bias: bool, inputs: &[&HostTensor]) -> Result<HostTensor, String> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let out_shape = linear_shape(bias, &shapes)?;
    let (x, w) = (inputs[0], inputs[1]);
    let (n, fin, fout) = (x.shape[0], x.shape[1], w.shape[0]);
    let mut out = vec![0.0f32; n * fout];
    if bias {
        for row in out.chunks_exact_mut(fout.max(1)) {
            row.copy_from_slice(&inputs[2].data);
        }
    }
    if n > 0 && fin > 0 && fout > 0 {
        // SAFETY: x is n×fin row-major, W is fout×fin read transposed (strides 1, fin), out is n×fout;
        // the shape rule checked these extents and `out` is a distinct buffer.
        unsafe {
            matrixmultiply::sgemm(
                n,
                fin,
                fout,
                1.0,
                x.data.as_ptr(),
                fin as isize,
                1,
                w.data.as_ptr(),
                1,
                fin as isize,
                1.0,
                out.as_mut_ptr(),
                fout as isize,
                1,
            )
        }
    }
    Ok(HostTensor::new(out_shape, out))
}

// ---- GPU converter (engine::gemm)

/// Linear as one cuBLASLt GEMM with the bias in its epilogue.
fn gpu_linear(ctx: &mut BuildCtx, node: NodeId, bias: bool) -> Result<Box<dyn Layer>> {
    use crate::engine::gemm::{GemmLayer, GemmSpec};
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let w = ctx.weight(node, 1)?;
    let b = if bias { Some(ctx.weight(node, 2)?.data.as_slice()) } else { None };
    let spec = GemmSpec { x, y, residual: None, rows_per_image: 1, weight: &w.data, bias: b, relu: false };
    Ok(Box::new(GemmLayer::new(ctx, node, spec)?))
}
