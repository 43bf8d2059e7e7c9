//! Elementwise ops: activations and scalar arithmetic (`Unary`), and `+ - * /` of two tensors with
//! NumPy/PyTorch broadcasting (`Binary`). Layers: `ReLU`, `ReLU6`, `LeakyReLU`, `Sigmoid`, `SiLU`,
//! `Hardswish`, `Hardsigmoid`, `GELU`, `Tanh`, `Hardtanh`.

use crate::engine::{BuildCtx, Layer, Layout};
use crate::graph::{HostTensor, NodeId, Op};
use crate::module::{Forward, Module};
use crate::ops::{one_input, CpuArgs, LayoutPlan, OpDef};
use crate::tensor::Tensor;
use crate::var_builder::VarBuilder;
use crate::Result;
use serde::{Deserialize, Serialize};

/// One-input elementwise ops, with PyTorch's definitions. NaN propagates through every one of
/// them, as in PyTorch.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, strum::EnumIter)]
pub enum Unary {
    Relu,
    LeakyRelu {
        slope: f32,
    },
    Sigmoid,
    /// `x * sigmoid(x)` (`nn.SiLU`, Swish).
    Silu,
    /// `x * relu6(x + 3) / 6`.
    Hardswish,
    /// `relu6(x + 3) / 6`.
    Hardsigmoid,
    /// `nn.GELU`, exact (erf) or with the tanh approximation.
    Gelu {
        tanh: bool,
    },
    Tanh,
    Asinh,
    /// `clamp(x, min, max)`: `ReLU6`, `Hardtanh`, `Tensor::clamp`.
    Clamp {
        min: f32,
        max: f32,
    },
    /// `x * scale + shift`: arithmetic with a Python scalar (`x + 3`, `x / 6`, `1 - x`).
    Affine {
        scale: f32,
        shift: f32,
    },
}

/// `erf` to f32 precision (Abramowitz–Stegun 7.1.26 is too coarse for 1e-5 checks): computed in
/// f64 with its series / continued-fraction split.
fn erf(x: f64) -> f64 {
    // W. J. Cody's rational approximations would do; a Taylor series converges fast for |x| < 3
    // and erfc's asymptote beyond that is 1 to f64 precision for our purposes.
    let ax = x.abs();
    let r = if ax < 3.0 {
        let (mut term, mut sum, x2) = (ax, ax, ax * ax);
        let mut n = 0.0;
        while term.abs() > 1e-17 * sum.abs() {
            n += 1.0;
            term *= -x2 / n;
            sum += term / (2.0 * n + 1.0);
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    } else {
        // erfc(x) ~ exp(-x²)/(x√π) · (1 - 1/(2x²) + 3/(4x⁴) - ...), below 2e-5 here.
        let x2 = ax * ax;
        1.0 - (-x2).exp() / (ax * std::f64::consts::PI.sqrt()) * (1.0 - 0.5 / x2 + 0.75 / (x2 * x2) - 1.875 / (x2 * x2 * x2))
    };
    r.copysign(x)
}

impl Unary {
    /// The op on one value.
    pub fn apply(self, v: f32) -> f32 {
        // f32::clamp keeps NaN, as PyTorch's relu6 does.
        let relu6 = |t: f32| t.clamp(0.0, 6.0);
        match self {
            Unary::Relu => {
                if v < 0.0 {
                    0.0
                } else {
                    v
                }
            }
            Unary::LeakyRelu { slope } => {
                if v < 0.0 {
                    v * slope
                } else {
                    v
                }
            }
            Unary::Sigmoid => 1.0 / (1.0 + (-v).exp()),
            Unary::Silu => v / (1.0 + (-v).exp()),
            Unary::Hardswish => v * relu6(v + 3.0) / 6.0,
            Unary::Hardsigmoid => relu6(v + 3.0) / 6.0,
            Unary::Gelu { tanh: false } => (0.5 * v as f64 * (1.0 + erf(v as f64 / std::f64::consts::SQRT_2))) as f32,
            Unary::Gelu { tanh: true } => {
                let v = v as f64;
                let inner = (2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v);
                (0.5 * v * (1.0 + inner.tanh())) as f32
            }
            Unary::Tanh => v.tanh(),
            Unary::Asinh => v.asinh(),
            Unary::Clamp { min, max } => {
                if v < min {
                    min
                } else if v > max {
                    max
                } else {
                    v
                }
            }
            Unary::Affine { scale, shift } => v * scale + shift,
        }
    }

    /// `(code, p0, p1)` as the kernels take them (`ACT_*` in kernels/common.cuh).
    pub fn kernel_code(self) -> (i32, f32, f32) {
        match self {
            Unary::Relu => (1, 0.0, 0.0),
            Unary::LeakyRelu { slope } => (2, slope, 0.0),
            Unary::Sigmoid => (3, 0.0, 0.0),
            Unary::Silu => (4, 0.0, 0.0),
            Unary::Hardswish => (5, 0.0, 0.0),
            Unary::Hardsigmoid => (6, 0.0, 0.0),
            Unary::Gelu { tanh: false } => (7, 0.0, 0.0),
            Unary::Gelu { tanh: true } => (8, 0.0, 0.0),
            Unary::Tanh => (9, 0.0, 0.0),
            Unary::Asinh => (10, 0.0, 0.0),
            Unary::Clamp { min, max } => (11, min, max),
            Unary::Affine { scale, shift } => (12, scale, shift),
        }
    }
}

impl OpDef for Unary {
    fn name(&self) -> &str {
        match self {
            Unary::Relu => "relu",
            Unary::LeakyRelu { .. } => "leaky_relu",
            Unary::Sigmoid => "sigmoid",
            Unary::Silu => "silu",
            Unary::Hardswish => "hardswish",
            Unary::Hardsigmoid => "hardsigmoid",
            Unary::Gelu { .. } => "gelu",
            Unary::Tanh => "tanh",
            Unary::Asinh => "asinh",
            Unary::Clamp { .. } => "clamp",
            Unary::Affine { .. } => "affine",
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        one_input(inputs).map(<[usize]>::to_vec)
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, String> {
        args.expect(1)?;
        let mut x = args.take(0)?;
        x.data.iter_mut().for_each(|v| *v = self.apply(*v));
        Ok(x)
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        let keep = inputs.first().copied().flatten().unwrap_or(Layout::contiguous(out_rank));
        LayoutPlan::any_input(inputs, keep)
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        crate::engine::kernel_layers::activation(ctx, node, *self)
    }
    fn label(&self) -> String {
        match self {
            Unary::LeakyRelu { slope } => format!("leaky_relu slope={slope}"),
            Unary::Gelu { tanh: true } => "gelu tanh".into(),
            Unary::Clamp { min, max } => format!("clamp [{min}, {max}]"),
            Unary::Affine { scale, shift } => format!("x*{scale}+{shift}"),
            other => other.name().to_string(),
        }
    }
}

/// Two-input elementwise arithmetic with broadcasting (trailing dims aligned, size-1 dims
/// stretched), as PyTorch's `+ - * /` on tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, strum::EnumIter)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
}

impl Binary {
    pub fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            Binary::Add => a + b,
            Binary::Sub => a - b,
            Binary::Mul => a * b,
            Binary::Div => a / b,
        }
    }
    /// The op's code in the kernels (`BIN_*` in kernels/elementwise.cu).
    pub fn kernel_code(self) -> i32 {
        match self {
            Binary::Add => 0,
            Binary::Sub => 1,
            Binary::Mul => 2,
            Binary::Div => 3,
        }
    }
}

/// The broadcast of two shapes, as PyTorch: dims aligned from the right, each pair equal or 1.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>, String> {
    let rank = a.len().max(b.len());
    let dim = |s: &[usize], i: usize| if i < rank - s.len() { 1 } else { s[i - (rank - s.len())] };
    (0..rank)
        .map(|i| match (dim(a, i), dim(b, i)) {
            (x, y) if x == y || y == 1 => Ok(x),
            (1, y) => Ok(y),
            (x, y) => Err(format!("shapes {a:?} and {b:?} do not broadcast: {x} against {y} at dim {i}")),
        })
        .collect()
}

/// Row-major strides of `shape` read as a broadcast into `out` (0 along stretched dims).
pub fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let pad = out.len() - shape.len();
    let mut strides = vec![0; out.len()];
    let mut s = 1;
    for i in (0..shape.len()).rev() {
        strides[pad + i] = if shape[i] == 1 { 0 } else { s };
        s *= shape[i];
    }
    strides
}

impl OpDef for Binary {
    fn name(&self) -> &str {
        match self {
            Binary::Add => "add",
            Binary::Sub => "sub",
            Binary::Mul => "mul",
            Binary::Div => "div",
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match inputs {
            [a, b] => broadcast_shape(a, b),
            _ => Err(format!("expected 2 inputs, got {}", inputs.len())),
        }
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, String> {
        args.expect(2)?;
        let out = self.infer_shape(&args.shapes()?)?;
        if args.get(0)?.shape == out && args.get(1)?.shape == out {
            let mut a = args.take(0)?;
            let b = args.get(1)?;
            a.data.iter_mut().zip(&b.data).for_each(|(x, y)| *x = self.apply(*x, *y));
            return Ok(a);
        }
        let (a, b) = (args.get(0)?, args.get(1)?);
        let (sa, sb) = (broadcast_strides(&a.shape, &out), broadcast_strides(&b.shape, &out));
        let n: usize = out.iter().product();
        let mut data = Vec::with_capacity(n);
        let mut index = vec![0usize; out.len()];
        for _ in 0..n {
            let ia: usize = index.iter().zip(&sa).map(|(i, s)| i * s).sum();
            let ib: usize = index.iter().zip(&sb).map(|(i, s)| i * s).sum();
            data.push(self.apply(a.data[ia], b.data[ib]));
            for d in (0..out.len()).rev() {
                index[d] += 1;
                if index[d] < out[d] {
                    break;
                }
                index[d] = 0;
            }
        }
        Ok(HostTensor::new(out, data))
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        // The output takes the engine's native layout if an operand of the output's rank has it,
        // else the first such operand's; operands are read through strides, in whatever layout
        // they are. Preferring the native layout ends a permuted layout at the first add that
        // meets a native operand: ViT's residual stream, permuted by the patch embedding, made
        // every residual add read one operand transposed and every LayerNorm reformat its input.
        let same_rank = || inputs.iter().flatten().filter(|l| l.rank() == out_rank).copied();
        let native = Layout::native(out_rank);
        let out = same_rank().find(|&l| l == native).or_else(|| same_rank().next()).unwrap_or(Layout::contiguous(out_rank));
        LayoutPlan::any_input(inputs, out)
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        crate::engine::kernel_layers::binary(ctx, node, *self)
    }
}

impl Tensor {
    /// `self op weight` with a constant second operand, broadcast as PyTorch (a `[C, 1, 1]` layer
    /// scale, a `[1, L, D]` position embedding), recorded as the layer at `path`.
    pub fn binary_weight(&self, path: &str, op: Binary, weight: &crate::tensor::Param) -> Result<Tensor> {
        Tensor::record(path, Op::Binary(op), &[self], &[weight])
    }
}

/// A parameter-free layer applying a `Unary` op: `ReLU`, `Sigmoid`, `SiLU`, ... are this.
#[derive(Clone, Debug)]
pub struct Activation {
    pub path: String,
    pub op: Unary,
}

impl Forward for Activation {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::record(&self.path, Op::Unary(self.op), &[x], &[])
    }
}

macro_rules! activation_module {
    ($(#[$doc:meta])* $name:ident, $config:ty, |$c:ident| $op:expr) => {
        $(#[$doc])*
        #[derive(Clone, Debug)]
        pub struct $name(pub Activation);

        impl Module for $name {
            type Config = $config;
            fn load(vb: VarBuilder, $c: &$config) -> Result<Self> {
                Ok(Self(Activation { path: vb.path().to_string(), op: $op }))
            }
        }

        impl Forward for $name {
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                self.0.forward(x)
            }
        }
    };
}

activation_module!(
    /// `torch.nn.ReLU`.
    ReLU, (), |_c| Unary::Relu
);
activation_module!(
    /// `torch.nn.ReLU6`.
    ReLU6, (), |_c| Unary::Clamp { min: 0.0, max: 6.0 }
);
activation_module!(
    /// `torch.nn.Hardtanh(min_val, max_val)`.
    Hardtanh, (f32, f32), |c| Unary::Clamp { min: c.0, max: c.1 }
);
activation_module!(
    /// `torch.nn.Sigmoid`.
    Sigmoid, (), |_c| Unary::Sigmoid
);
activation_module!(
    /// `torch.nn.SiLU`.
    SiLU, (), |_c| Unary::Silu
);
activation_module!(
    /// `torch.nn.Hardswish`.
    Hardswish, (), |_c| Unary::Hardswish
);
activation_module!(
    /// `torch.nn.Hardsigmoid`.
    Hardsigmoid, (), |_c| Unary::Hardsigmoid
);
activation_module!(
    /// `torch.nn.Tanh`.
    Tanh, (), |_c| Unary::Tanh
);
activation_module!(
    /// `torch.nn.GELU(approximate)`: the config is `approximate == "tanh"`.
    GELU, bool, |c| Unary::Gelu { tanh: *c }
);
activation_module!(
    /// `torch.nn.LeakyReLU(negative_slope)`.
    LeakyReLU, LeakyReLUConfig, |c| Unary::LeakyRelu { slope: c.negative_slope }
);

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LeakyReLUConfig {
    pub negative_slope: f32,
}

impl Default for LeakyReLUConfig {
    fn default() -> Self {
        Self { negative_slope: 0.01 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_is_accurate_to_f32() {
        // Values from a table of erf (Abramowitz & Stegun, table 7.1).
        for (x, want) in [(0.0, 0.0), (0.5, 0.5204998778), (1.0, 0.8427007929), (2.0, 0.9953222650), (3.5, 0.9999992569)] {
            assert!((erf(x) - want).abs() < 1e-9, "erf({x}) = {} not {want}", erf(x));
            assert!((erf(-x) + want).abs() < 1e-9);
        }
    }

    #[test]
    fn nan_propagates_through_every_unary_op() {
        // Every variant (at its default parameters), so a new op is covered by itself.
        for op in <Unary as strum::IntoEnumIterator>::iter() {
            assert!(op.apply(f32::NAN).is_nan(), "{op:?} maps NaN to a number");
        }
    }

    #[test]
    fn broadcasting_follows_pytorch() {
        assert_eq!(broadcast_shape(&[2, 3, 4, 5], &[3, 1, 1]).unwrap(), [2, 3, 4, 5]);
        assert_eq!(broadcast_shape(&[2, 1, 4], &[5, 1]).unwrap(), [2, 5, 4]);
        assert!(broadcast_shape(&[2, 3], &[4]).unwrap_err().contains("do not broadcast"));
        assert_eq!(broadcast_strides(&[3, 1, 1], &[2, 3, 4, 5]), [0, 1, 0, 0]);
    }
}
