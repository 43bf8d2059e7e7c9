//! Elementwise ops: activations and scalar arithmetic (`Unary`), and `+ - * /` of two tensors with
//! NumPy/PyTorch broadcasting (`Binary`). Layers: `ReLU`, `ReLU6`, `LeakyReLU`, `Sigmoid`, `SiLU`,
//! `Hardswish`, `Hardsigmoid`, `GELU`, `Tanh`, `Hardtanh`, `Softplus`, `ELU`, `Mish`.

use crate::engine::launch::{pack, same_elem, to_i32, typed_entry_points, Arg, KArg, KernelLayer};
use crate::engine::{Layer, Layout, ValueId};
use crate::error::OpError;
use crate::graph::{HostTensor, NodeId, Op};
use crate::module::{Forward, Module};
use crate::ops::BuildCtx;
use crate::ops::{one_input, CpuArgs, FixtureTwin, LayoutPlan, OpDef};
use crate::tensor::Tensor;
use crate::var_builder::VarBuilder;
use crate::LowerKind;
use crate::Result;
use serde::{Deserialize, Serialize};
use strum::IntoEnumIterator;

/// This family's layers, as `kiln::nn` shows them.
pub mod nn {
    pub use super::{
        Hardsigmoid, Hardswish, Hardtanh, LeakyReLU, LeakyReLUConfig, ReLU, ReLU6, SiLU, Sigmoid, Softplus, SoftplusConfig, Tanh, GELU,
    };
}

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
    /// `nn.Softplus(beta, threshold)`: `log1p(exp(beta * x)) / beta`, and `x` itself where
    /// `beta * x > threshold` (PyTorch's switch to the linear function).
    Softplus {
        beta: f32,
        threshold: f32,
    },
    Exp,
    /// The natural logarithm (`-inf` at 0, NaN below).
    Log,
    Sqrt,
    /// `1 / sqrt(x)`.
    Rsqrt,
    /// `1 / x` (a number divided by an activation is this and an affine).
    Reciprocal,
    Abs,
    Erf,
    /// `nn.ELU(alpha)`: `x` where `x > 0`, else `alpha * (exp(x) - 1)`.
    Elu {
        alpha: f32,
    },
    /// `nn.Mish`: `x * tanh(softplus(x))`.
    Mish,
    /// `x ** exponent` with a number exponent (`torch.pow(x, 2)`, `x ** 0.5`).
    Pow {
        exponent: f32,
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
            Unary::Softplus { beta, threshold } => {
                if v * beta > threshold {
                    v
                } else {
                    (v * beta).exp().ln_1p() / beta
                }
            }
            Unary::Exp => v.exp(),
            Unary::Log => v.ln(),
            Unary::Sqrt => v.sqrt(),
            Unary::Rsqrt => 1.0 / v.sqrt(),
            Unary::Reciprocal => 1.0 / v,
            Unary::Abs => v.abs(),
            Unary::Erf => erf(v as f64) as f32,
            Unary::Elu { alpha } => {
                if v > 0.0 {
                    v
                } else {
                    alpha * v.exp_m1()
                }
            }
            Unary::Mish => v * v.exp().ln_1p().tanh(),
            // powf(NaN, 0) is 1, as torch.pow's.
            Unary::Pow { exponent } => v.powf(exponent),
        }
    }

    /// `(code, p0, p1)` as the kernels take them (`ACT_*` in kernels/common.cuh).
    pub fn kernel_code(self) -> (i32, f32, f32) {
        let (_, code, p0, p1) = self.kernel_op();
        (code, p0, p1)
    }

    /// The op as kernels/common.cuh names it: its `ACT_*` define, that define's value, and the
    /// two parameters the kernels take.
    pub fn kernel_op(self) -> (&'static str, i32, f32, f32) {
        match self {
            Unary::Relu => ("ACT_RELU", 1, 0.0, 0.0),
            Unary::LeakyRelu { slope } => ("ACT_LEAKY", 2, slope, 0.0),
            Unary::Sigmoid => ("ACT_SIGMOID", 3, 0.0, 0.0),
            Unary::Silu => ("ACT_SILU", 4, 0.0, 0.0),
            Unary::Hardswish => ("ACT_HARDSWISH", 5, 0.0, 0.0),
            Unary::Hardsigmoid => ("ACT_HARDSIGMOID", 6, 0.0, 0.0),
            Unary::Gelu { tanh: false } => ("ACT_GELU", 7, 0.0, 0.0),
            Unary::Gelu { tanh: true } => ("ACT_GELU_TANH", 8, 0.0, 0.0),
            Unary::Tanh => ("ACT_TANH", 9, 0.0, 0.0),
            Unary::Asinh => ("ACT_ASINH", 10, 0.0, 0.0),
            Unary::Clamp { min, max } => ("ACT_CLAMP", 11, min, max),
            Unary::Affine { scale, shift } => ("ACT_AFFINE", 12, scale, shift),
            Unary::Softplus { beta, threshold } => ("ACT_SOFTPLUS", 13, beta, threshold),
            Unary::Exp => ("ACT_EXP", 14, 0.0, 0.0),
            Unary::Log => ("ACT_LOG", 15, 0.0, 0.0),
            Unary::Sqrt => ("ACT_SQRT", 16, 0.0, 0.0),
            Unary::Rsqrt => ("ACT_RSQRT", 17, 0.0, 0.0),
            Unary::Reciprocal => ("ACT_RECIPROCAL", 18, 0.0, 0.0),
            Unary::Abs => ("ACT_ABS", 19, 0.0, 0.0),
            Unary::Erf => ("ACT_ERF", 20, 0.0, 0.0),
            Unary::Elu { alpha } => ("ACT_ELU", 21, alpha, 0.0),
            Unary::Mish => ("ACT_MISH", 22, 0.0, 0.0),
            Unary::Pow { exponent } => ("ACT_POW", 23, exponent, 0.0),
        }
    }

    /// Every variant, with parameters that exercise it (several where the kernel has several
    /// paths): what the tests that cover every op run. A variant without an arm here comes in
    /// at its default parameters.
    #[doc(hidden)]
    pub fn examples() -> Vec<Unary> {
        Unary::iter()
            .flat_map(|op| match op {
                Unary::LeakyRelu { .. } => vec![Unary::LeakyRelu { slope: 0.2 }],
                Unary::Gelu { .. } => vec![Unary::Gelu { tanh: false }, Unary::Gelu { tanh: true }],
                Unary::Clamp { .. } => {
                    vec![Unary::Clamp { min: 0.0, max: 6.0 }, Unary::Clamp { min: -2.0, max: 3.0 }, Unary::Clamp { min: -0.5, max: 0.7 }]
                }
                Unary::Affine { .. } => vec![
                    Unary::Affine { scale: 0.5, shift: 3.0 },
                    Unary::Affine { scale: -1.0, shift: 1.0 },
                    Unary::Affine { scale: 1.0 / 6.0, shift: 0.0 },
                ],
                // PyTorch's default, and a threshold the tests' inputs cross.
                Unary::Softplus { .. } => {
                    vec![Unary::Softplus { beta: 1.0, threshold: 20.0 }, Unary::Softplus { beta: 2.0, threshold: 1.5 }]
                }
                Unary::Elu { .. } => vec![Unary::Elu { alpha: 1.0 }, Unary::Elu { alpha: 0.5 }],
                // Squares, roots, odd powers of negatives and a reciprocal square.
                Unary::Pow { .. } => [2.0, 0.5, 3.0, -2.0, 1.5].map(|exponent| Unary::Pow { exponent }).to_vec(),
                other => vec![other],
            })
            .collect()
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
            Unary::Softplus { .. } => "softplus",
            Unary::Exp => "exp",
            Unary::Log => "log",
            Unary::Sqrt => "sqrt",
            Unary::Rsqrt => "rsqrt",
            Unary::Reciprocal => "reciprocal",
            Unary::Abs => "abs",
            Unary::Erf => "erf",
            Unary::Elu { .. } => "elu",
            Unary::Mish => "mish",
            Unary::Pow { .. } => "pow",
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
        one_input(inputs).map(<[usize]>::to_vec)
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, OpError> {
        args.expect(1)?;
        let mut x = args.take(0)?;
        x.data.iter_mut().for_each(|v| *v = self.apply(*v));
        Ok(x)
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        let keep = inputs.first().copied().flatten().unwrap_or(Layout::contiguous(out_rank));
        LayoutPlan::any_input(inputs, keep)
    }
    fn entry_points(&self) -> Vec<String> {
        typed_entry_points(KERNELS)
    }
    fn colour(&self) -> &'static str {
        "#e9ecef"
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        activation(ctx, node, *self)
    }
    fn label(&self) -> String {
        match self {
            Unary::LeakyRelu { slope } => format!("leaky_relu slope={slope}"),
            Unary::Gelu { tanh: true } => "gelu tanh".into(),
            Unary::Clamp { min, max } => format!("clamp [{min}, {max}]"),
            Unary::Affine { scale, shift } => format!("x*{scale}+{shift}"),
            Unary::Softplus { beta, threshold } => format!("softplus beta={beta} threshold={threshold}"),
            Unary::Elu { alpha } => format!("elu alpha={alpha}"),
            Unary::Pow { exponent } => format!("pow {exponent}"),
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
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>, OpError> {
    let rank = a.len().max(b.len());
    let dim = |s: &[usize], i: usize| if i < rank - s.len() { 1 } else { s[i - (rank - s.len())] };
    (0..rank)
        .map(|i| match (dim(a, i), dim(b, i)) {
            (x, y) if x == y || y == 1 => Ok(x),
            (1, y) => Ok(y),
            (x, y) => Err(format!("shapes {a:?} and {b:?} do not broadcast: {x} against {y} at dim {i}").into()),
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
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
        match inputs {
            [a, b] => broadcast_shape(a, b),
            _ => Err(OpError::Arity { expected: "2".into(), got: inputs.len() }),
        }
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, OpError> {
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
    fn entry_points(&self) -> Vec<String> {
        typed_entry_points(KERNELS)
    }
    fn colour(&self) -> &'static str {
        "#dee2e6"
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        binary(ctx, node, *self)
    }
}

// ---- engine layers ----------------------------------------------------------------------------

/// The kernels this family's layers launch (kernels/elementwise.cu; the activation codes, `ACT_*`,
/// in kernels/common.cuh), stamped per element type.
const KERNELS: &[&str] = &[
    "activation",
    "activation_relu",
    "activation_sigmoid",
    "activation_silu",
    "activation_hardswish",
    "activation_hardsigmoid",
    "activation_gelu",
    "activation_gelu_tanh",
    "activation_clamp",
    "binary",
    "binary_bcast",
    "bias_act",
];

/// The activation kernel of `op`: its own entry point for the common ops (the op compiled in),
/// else the one that takes the op at run time (kernels/elementwise.cu).
fn activation_entry(op: Unary, elem: crate::engine::Elem) -> String {
    let own = match op {
        Unary::Relu => Some("relu"),
        Unary::Sigmoid => Some("sigmoid"),
        Unary::Silu => Some("silu"),
        Unary::Hardswish => Some("hardswish"),
        Unary::Hardsigmoid => Some("hardsigmoid"),
        Unary::Gelu { tanh: false } => Some("gelu"),
        Unary::Gelu { tanh: true } => Some("gelu_tanh"),
        Unary::Clamp { .. } => Some("clamp"),
        _ => None,
    };
    match own {
        Some(name) => format!("activation_{name}_{}", elem.suffix()),
        None => format!("activation_{}", elem.suffix()),
    }
}

/// The activation an epilogue applies, as the kernels take it: `(code, p0, p1)`.
fn act_code(act: Option<Unary>) -> (i32, f32, f32) {
    act.map_or((0, 0.0, 0.0), Unary::kernel_code)
}

fn act_suffix(act: Option<Unary>) -> String {
    act.map_or(String::new(), |a| format!("+{}", a.name()))
}

/// A unary elementwise node (activations, clamp, scalar arithmetic): `y = op(x)` over the whole
/// value, four elements a work item.
pub fn activation(ctx: &mut BuildCtx, node: NodeId, op: Unary) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let elem = same_elem(ctx, &[x, y])?;
    let (code, p0, p1) = op.kernel_code();
    let per_image = ctx.value(y).per_image_elems();
    let args = vec![Arg::Value(x), Arg::Value(y), Arg::PerBatch(per_image), i32_arg(code), f32_arg(p0), f32_arg(p1)];
    let layer = KernelLayer::new(ctx, &activation_entry(op, elem), args, per_image)?;
    Ok(Box::new(layer.kind(format!("kernel:{}", op.name())).items(4)))
}

fn i32_arg(v: i32) -> Arg {
    Arg::Const(KArg::I32(v))
}

fn f32_arg(v: f32) -> Arg {
    Arg::Const(KArg::F32(v))
}

/// A binary elementwise node (`+ - * /` with PyTorch's broadcasting). Two activations of the
/// output's dims in its layout take the packed same-shape kernel; anything else (a broadcast
/// operand, another layout, a constant such as a `[C, 1, 1]` layer scale or a `[1, L, D]` position
/// embedding, uploaded here) takes the strided broadcasting kernel.
pub fn binary(ctx: &mut BuildCtx, node: NodeId, op: Binary) -> Result<Box<dyn Layer>> {
    let y = ctx.output(node)?;
    let n_in = ctx.node(node).inputs.len();
    if n_in != 2 {
        return Err(ctx.err(node, LowerKind::Operands, format!("expects 2 operands, got {n_in}")));
    }
    let is_weight = |ctx: &BuildCtx, i: usize| ctx.graph.weight_data(ctx.node(node).inputs[i]).is_some();
    let dy = ctx.value(y).clone();
    if !is_weight(ctx, 0) && !is_weight(ctx, 1) {
        let (a, b) = (ctx.input(node, 0)?, ctx.input(node, 1)?);
        let elem = same_elem(ctx, &[a, b, y])?;
        let same = |v: ValueId| {
            let d = ctx.value(v);
            d.dims == dy.dims && d.layout.same_bytes(dy.layout, &dy.dims)
        };
        if same(a) && same(b) {
            let per_image = dy.per_image_elems();
            let args = vec![
                Arg::Value(a),
                Arg::Value(b),
                Arg::Value(y),
                Arg::PerBatch(per_image),
                i32_arg(op.kernel_code()),
                i32_arg(0),
                f32_arg(0.0),
            ];
            let layer = KernelLayer::new(ctx, &format!("binary_{}", elem.suffix()), args, per_image)?;
            return Ok(Box::new(layer.kind(format!("kernel:{}", op.name())).items(4)));
        }
    }
    broadcast_binary(ctx, node, op, y)
}

/// Element strides of each output dim (logical order) for one operand of a broadcast, and its
/// batch stride: an activation of the output's rank in its own layout, or a constant weight
/// (its own row-major shape, aligned to the output's dims from the right, batch stride 0).
fn operand_strides(ctx: &BuildCtx, node: NodeId, i: usize, out: &[usize]) -> Result<(Vec<usize>, usize, Option<Vec<f32>>)> {
    let bad = |what: String| {
        ctx.err(node, LowerKind::Operands, format!("operand {i} {what} does not broadcast to the output {out:?} (per image)"))
    };
    let src = ctx.node(node).inputs[i];
    if let Some(w) = ctx.graph.weight_data(src) {
        // The weight's dims against the full output [batch, out...]: its leading dims beyond the
        // output's per-image rank must be 1 (a constant is shared by every image).
        let rank = out.len() + 1;
        if w.shape.len() > rank {
            return Err(bad(format!("(a constant of shape {:?})", w.shape)));
        }
        let full: Vec<usize> = std::iter::repeat_n(1, rank - w.shape.len()).chain(w.shape.iter().copied()).collect();
        if full[0] != 1 {
            return Err(bad(format!(
                "(a constant of shape {:?} whose dim {} lines up with the batch; the engine keeps the batch as dim 0 and shares constants across it)",
                w.shape,
                w.shape.len() - out.len() - 1
            )));
        }
        let dims = &full[1..];
        let mut strides = vec![0; out.len()];
        let mut s = 1;
        for d in (0..out.len()).rev() {
            if dims[d] != out[d] && dims[d] != 1 {
                return Err(bad(format!("(a constant of shape {:?})", w.shape)));
            }
            strides[d] = if dims[d] == 1 { 0 } else { s };
            s *= dims[d];
        }
        return Ok((strides, 0, Some(w.data.clone())));
    }
    let v = ctx.input(node, i)?;
    let d = ctx.value(v);
    if d.dims.len() != out.len() {
        return Err(bad(format!(
            "{:?} (an activation of another rank: its batch dim would not line up with the output's; the engine keeps the batch as dim 0)",
            d.dims
        )));
    }
    let strides = activation_strides(&d.dims, d.layout, out).ok_or_else(|| bad(format!("{:?}", d.dims)))?;
    Ok((strides, d.per_image_elems(), None))
}

/// Element strides of each dim of `out` for a value of `dims` stored in `layout` (0 along the
/// dims it is broadcast over), or `None` if it does not broadcast to `out` (same rank).
fn activation_strides(dims: &[usize], layout: Layout, out: &[usize]) -> Option<Vec<usize>> {
    let mut strides = layout.strides(dims);
    for (k, s) in strides.iter_mut().enumerate() {
        match (dims[k], out[k]) {
            (a, b) if a == b => {}
            (1, _) => *s = 0,
            _ => return None,
        }
    }
    Some(strides)
}

/// The broadcasting kernel's plan: `[size, stride a, stride b]` per dim of y in its physical
/// order (outermost first), size-1 dims dropped and runs that are contiguous for both operands
/// merged; and whether the packed path applies (innermost size a multiple of `width`, innermost
/// strides 0 or 1, every other stride and both batch strides multiples of `width`).
fn broadcast_plan(out: &[usize], layout: Layout, strides: [&[usize]; 2], batch: [usize; 2], width: usize) -> (Vec<[usize; 3]>, bool) {
    let mut merged: Vec<[usize; 3]> = Vec::with_capacity(out.len());
    for k in layout.order().into_iter().filter(|&k| out[k] != 1) {
        let d = [out[k], strides[0][k], strides[1][k]];
        match merged.last_mut() {
            Some(outer) if outer[1] == d[1] * d[0] && outer[2] == d[2] * d[0] => *outer = [outer[0] * d[0], d[1], d[2]],
            _ => merged.push(d),
        }
    }
    if merged.is_empty() {
        merged.push([1, 0, 0]);
    }
    let inner = merged[merged.len() - 1];
    let aligned = |s: usize| s.is_multiple_of(width);
    let vec = aligned(inner[0])
        && inner[1] <= 1
        && inner[2] <= 1
        && merged[..merged.len() - 1].iter().all(|d| aligned(d[1]) && aligned(d[2]))
        && batch.iter().all(|&b| aligned(b));
    (merged, vec)
}

/// `y = a op b` through per-operand strides (`binary_bcast_*`): strides in the output's physical
/// order, size-1 dims dropped and runs that are contiguous for both operands merged (an SE
/// block's `[C, H, W] * [C, 1, 1]` in NHWC becomes `[HW, C]` by `[0, 1]`).
fn broadcast_binary(ctx: &mut BuildCtx, node: NodeId, op: Binary, y: ValueId) -> Result<Box<dyn Layer>> {
    let dy = ctx.value(y).clone();
    let elem = dy.elem;
    let mut operands = Vec::with_capacity(2);
    let mut strides = Vec::with_capacity(2);
    let mut batch = [0usize; 2];
    for (i, batch_stride) in batch.iter_mut().enumerate() {
        let (s, b, data) = operand_strides(ctx, node, i, &dy.dims)?;
        let operand = match data {
            Some(w) => Arg::buf(ctx.upload(&w)?),
            None => {
                let v = ctx.input(node, i)?;
                if ctx.value(v).elem != elem {
                    return Err(ctx.err(node, LowerKind::Operands, format!("mixes element types {:?} and {elem:?}", ctx.value(v).elem)));
                }
                Arg::Value(v)
            }
        };
        operands.push(operand);
        strides.push(s);
        *batch_stride = b;
    }
    if operands.iter().all(|o| matches!(o, Arg::Buf(_))) {
        return Err(ctx.err(node, LowerKind::Operands, "both operands are constants (fold them before building)"));
    }
    let (merged, vec) = broadcast_plan(&dy.dims, dy.layout, [&strides[0], &strides[1]], batch, pack(elem));
    let mut meta: Vec<i64> = merged.iter().map(|d| d[0] as i64).collect();
    meta.extend(merged.iter().map(|d| d[1] as i64));
    meta.extend(merged.iter().map(|d| d[2] as i64));
    meta.extend(batch.map(|b| b as i64));
    let bytes: Vec<u8> = meta.iter().flat_map(|v| v.to_le_bytes()).collect();
    let meta = ctx.upload_bytes(&bytes)?;
    let per_image = dy.per_image_elems();
    let mut args = operands;
    args.extend([Arg::Value(y), Arg::PerBatch(per_image), Arg::buf(meta)]);
    args.extend([merged.len() as i32, op.kernel_code(), vec as i32].map(i32_arg));
    let layer = KernelLayer::new(ctx, &format!("binary_bcast_{}", elem.suffix()), args, per_image)?;
    Ok(Box::new(layer.kind(format!("kernel:{}_broadcast", op.name())).items(if vec { 4 } else { 1 })))
}

/// `y = act(x * scale + bias + residual)` for `node`, reading `x` and writing `y` (which may be
/// `x`: in place), over NHWC (or `[N, F]`) values: the epilogue of layers whose library call
/// cannot fuse it (a deconvolution's bias, a GEMM without the epilogue, an unfolded BatchNorm with
/// its scale and shift). `scale` and `bias` have one value per channel (uploaded as f32 whatever
/// the precision).
#[allow(clippy::too_many_arguments)]
pub fn bias_act(
    ctx: &mut BuildCtx,
    node: NodeId,
    x: ValueId,
    scale: Option<&[f32]>,
    bias: Option<&[f32]>,
    residual: Option<ValueId>,
    y: ValueId,
    act: Option<Unary>,
) -> Result<Box<dyn Layer>> {
    let mut vals = vec![x, y];
    vals.extend(residual);
    let elem = same_elem(ctx, &vals)?;
    let (c, h, w) = ctx
        .value(y)
        .chw()
        .ok_or_else(|| ctx.err(node, LowerKind::Weights, format!("bias epilogue needs [C, H, W] or [F], got {:?}", ctx.value(y).dims)))?;
    if !ctx.value(y).layout.same_bytes(Layout::channels_last(ctx.value(y).dims.len()), &ctx.value(y).dims) {
        return Err(ctx.err(node, LowerKind::Weights, "bias epilogue runs on NHWC values"));
    }
    for (what, v) in [("scale", scale), ("bias", bias)] {
        if let Some(v) = v.filter(|v| v.len() != c) {
            return Err(ctx.err(node, LowerKind::Operands, format!("{what} has {} values for {c} channels", v.len())));
        }
    }
    let kind = format!(
        "kernel:{}bias{}{}",
        if scale.is_some() { "scale+" } else { "" },
        if residual.is_some() { "+residual" } else { "" },
        act_suffix(act)
    );
    let scale = scale.map(|s| ctx.upload_f32(s)).transpose()?;
    let bias = bias.map(|b| ctx.upload_f32(b)).transpose()?;
    let channels = to_i32(ctx, "channels", c)?;
    let (code, slope, _) = act_code(act);
    let args = vec![
        Arg::Value(x),
        Arg::Buf(scale),
        Arg::Buf(bias),
        Arg::MaybeValue(residual),
        Arg::Value(y),
        Arg::PerBatch(h * w),
        i32_arg(channels),
        i32_arg(code),
        f32_arg(slope),
    ];
    let layer = KernelLayer::new(ctx, &format!("bias_act_{}", elem.suffix()), args, h * w * c)?;
    Ok(Box::new(layer.kind(kind).items(4)))
}

impl Tensor {
    /// `self + other`, broadcasting as PyTorch.
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        Tensor::record_inline(Op::Binary(Binary::Add), &[self, other])
    }
    /// `self - other`, broadcasting.
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        Tensor::record_inline(Op::Binary(Binary::Sub), &[self, other])
    }
    /// `self * other`, broadcasting (a squeeze-excitation's `x * scale`).
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        Tensor::record_inline(Op::Binary(Binary::Mul), &[self, other])
    }
    /// `self / other`, broadcasting.
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        Tensor::record_inline(Op::Binary(Binary::Div), &[self, other])
    }
    /// Applies a unary elementwise op inline (`x.unary(Unary::Silu)`).
    pub fn unary(&self, op: Unary) -> Result<Tensor> {
        Tensor::record_inline(Op::Unary(op), &[self])
    }
    pub fn relu(&self) -> Result<Tensor> {
        self.unary(Unary::Relu)
    }
    pub fn leaky_relu(&self, slope: f32) -> Result<Tensor> {
        self.unary(Unary::LeakyRelu { slope })
    }
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary(Unary::Sigmoid)
    }
    pub fn silu(&self) -> Result<Tensor> {
        self.unary(Unary::Silu)
    }
    pub fn hardswish(&self) -> Result<Tensor> {
        self.unary(Unary::Hardswish)
    }
    pub fn hardsigmoid(&self) -> Result<Tensor> {
        self.unary(Unary::Hardsigmoid)
    }
    /// `nn.GELU`: exact, or with `approximate="tanh"` when `tanh`.
    pub fn gelu(&self, tanh: bool) -> Result<Tensor> {
        self.unary(Unary::Gelu { tanh })
    }
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary(Unary::Tanh)
    }
    pub fn asinh(&self) -> Result<Tensor> {
        self.unary(Unary::Asinh)
    }
    /// `torch.clamp(x, min, max)` (use `f32::NEG_INFINITY` / `f32::INFINITY` for an open side).
    pub fn clamp(&self, min: f32, max: f32) -> Result<Tensor> {
        self.unary(Unary::Clamp { min, max })
    }
    /// `F.softplus(x, beta, threshold)` (PyTorch's defaults: 1 and 20).
    pub fn softplus(&self, beta: f32, threshold: f32) -> Result<Tensor> {
        self.unary(Unary::Softplus { beta, threshold })
    }
    pub fn exp(&self) -> Result<Tensor> {
        self.unary(Unary::Exp)
    }
    /// The natural logarithm, `torch.log`.
    pub fn log(&self) -> Result<Tensor> {
        self.unary(Unary::Log)
    }
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary(Unary::Sqrt)
    }
    /// `torch.rsqrt`: `1 / sqrt(x)`.
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.unary(Unary::Rsqrt)
    }
    /// `torch.reciprocal`: `1 / x`.
    pub fn reciprocal(&self) -> Result<Tensor> {
        self.unary(Unary::Reciprocal)
    }
    pub fn abs(&self) -> Result<Tensor> {
        self.unary(Unary::Abs)
    }
    pub fn erf(&self) -> Result<Tensor> {
        self.unary(Unary::Erf)
    }
    /// `F.elu(x, alpha)` (PyTorch's default alpha is 1).
    pub fn elu(&self, alpha: f32) -> Result<Tensor> {
        self.unary(Unary::Elu { alpha })
    }
    pub fn mish(&self) -> Result<Tensor> {
        self.unary(Unary::Mish)
    }
    /// `x ** exponent` with a number exponent.
    pub fn pow(&self, exponent: f32) -> Result<Tensor> {
        self.unary(Unary::Pow { exponent })
    }
    /// `x * scale + shift` with Python scalars: `x.affine(1.0, 3.0)` is `x + 3`, `x.affine(1.0 / 6.0, 0.0)` is `x / 6`.
    pub fn affine(&self, scale: f32, shift: f32) -> Result<Tensor> {
        self.unary(Unary::Affine { scale, shift })
    }
    /// `self op weight` with a constant second operand, broadcast as PyTorch (a `[C, 1, 1]` layer
    /// scale, a `[1, L, D]` position embedding), recorded as the layer at `path`.
    pub fn binary_weight(&self, path: &str, op: Binary, weight: &crate::tensor::Param) -> Result<Tensor> {
        Tensor::record(path, Op::Binary(op), &[self], &[weight])
    }
}

/// `&a + &b` records an add; the result is a `Result` because shapes may not match.
impl std::ops::Add for &Tensor {
    type Output = Result<Tensor>;
    fn add(self, rhs: &Tensor) -> Result<Tensor> {
        Tensor::add(self, rhs)
    }
}

impl std::ops::Mul for &Tensor {
    type Output = Result<Tensor>;
    fn mul(self, rhs: &Tensor) -> Result<Tensor> {
        Tensor::mul(self, rhs)
    }
}

impl std::ops::Sub for &Tensor {
    type Output = Result<Tensor>;
    fn sub(self, rhs: &Tensor) -> Result<Tensor> {
        Tensor::sub(self, rhs)
    }
}

impl std::ops::Div for &Tensor {
    type Output = Result<Tensor>;
    fn div(self, rhs: &Tensor) -> Result<Tensor> {
        Tensor::div(self, rhs)
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

activation_module!(
    /// `torch.nn.ELU(alpha)`: the config is `alpha`.
    ELU, f32, |c| Unary::Elu { alpha: *c }
);
activation_module!(
    /// `torch.nn.Mish`.
    Mish, (), |_c| Unary::Mish
);

activation_module!(
    /// `torch.nn.Softplus(beta, threshold)`.
    Softplus, SoftplusConfig, |c| Unary::Softplus { beta: c.beta, threshold: c.threshold }
);

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoftplusConfig {
    pub beta: f32,
    pub threshold: f32,
}

impl Default for SoftplusConfig {
    fn default() -> Self {
        Self { beta: 1.0, threshold: 20.0 }
    }
}

/// `b.abs() + 0.5`: a divisor away from zero.
fn abs_plus_half(b: &Tensor) -> Result<Tensor> {
    b.abs()?.affine(1.0, 0.5)
}

/// The Kiln twins of this family's PyTorch op fixtures (`op_cases()` in tools/export_reference.py).
#[doc(hidden)]
pub const FIXTURE_TWINS: &[FixtureTwin] = &[
    ("relu", |f| ReLU::load(f.vb, &())?.forward(f.x)),
    ("leaky_relu", |f| LeakyReLU::load(f.vb, &LeakyReLUConfig { negative_slope: 0.2 })?.forward(f.x)),
    ("sigmoid", |f| Sigmoid::load(f.vb, &())?.forward(f.x)),
    ("silu", |f| SiLU::load(f.vb, &())?.forward(f.x)),
    ("hardswish", |f| Hardswish::load(f.vb, &())?.forward(f.x)),
    ("hardsigmoid", |f| Hardsigmoid::load(f.vb, &())?.forward(f.x)),
    ("gelu_exact", |f| GELU::load(f.vb, &false)?.forward(f.x)),
    ("gelu_tanh", |f| GELU::load(f.vb, &true)?.forward(f.x)),
    ("tanh", |f| Tanh::load(f.vb, &())?.forward(f.x)),
    ("asinh", |f| f.x.asinh()),
    ("clamp_relu6", |f| ReLU6::load(f.vb, &())?.forward(f.x)),
    ("clamp_hardtanh", |f| Hardtanh::load(f.vb, &(-2.0, 3.0))?.forward(f.x)),
    ("clamp_tensor", |f| f.x.clamp(-0.5, 0.7)),
    ("affine_mul_add", |f| f.x.affine(0.5, 3.0)),
    ("affine_rsub", |f| f.x.affine(-1.0, 1.0)),
    ("affine_div", |f| f.x.affine(1.0 / 6.0, 0.0)),
    ("add", |f| f.x + f.other()?),
    ("sub", |f| f.x - f.other()?),
    ("mul", |f| f.x * f.other()?),
    ("div", |f| f.x / &abs_plus_half(f.other()?)?),
    ("mul_squeeze_excitation", |f| f.x * f.other()?),
    ("sub_broadcast_rows", |f| f.x - f.other()?),
    ("add_weight_c11", |f| f.x.binary_weight(f.vb.path(), Binary::Add, &f.vb.get(&[6, 1, 1], "scale")?)),
    ("mul_weight_c11", |f| f.x.binary_weight(f.vb.path(), Binary::Mul, &f.vb.get(&[6, 1, 1], "gamma")?)),
    ("softplus", |f| Softplus::load(f.vb, &SoftplusConfig::default())?.forward(f.x)),
    ("softplus_beta2_threshold", |f| f.x.softplus(2.0, 1.5)),
    ("exp", |f| f.x.exp()),
    ("log", |f| f.x.abs()?.log()),
    ("sqrt", |f| f.x.abs()?.sqrt()),
    ("rsqrt", |f| f.x.abs()?.affine(1.0, 0.1)?.rsqrt()),
    ("reciprocal", |f| abs_plus_half(f.x)?.reciprocal()),
    ("reciprocal_signed", |f| f.x.reciprocal()),
    ("abs", |f| f.x.abs()),
    ("erf", |f| f.x.erf()),
    ("elu", |f| ELU::load(f.vb, &1.0)?.forward(f.x)),
    ("elu_alpha", |f| f.x.elu(0.5)),
    ("mish", |f| Mish::load(f.vb, &())?.forward(f.x)),
    ("pow_square", |f| f.x.pow(2.0)),
    ("pow_cube", |f| f.x.pow(3.0)),
    ("pow_sqrt", |f| f.x.abs()?.pow(0.5)),
    ("pow_minus2", |f| abs_plus_half(f.x)?.pow(-2.0)),
    ("add_position_embedding", |f| f.x.binary_weight(f.vb.path(), Binary::Add, &f.vb.get(&[1, 9, 8], "pos_embedding")?)),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kernels::{FAMILIES, PRELUDE};

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
        // Every variant, so a new op is covered by itself.
        for op in Unary::examples() {
            assert!(op.apply(f32::NAN).is_nan(), "{op:?} maps NaN to a number");
        }
    }

    #[test]
    fn broadcasting_follows_pytorch() {
        assert_eq!(broadcast_shape(&[2, 3, 4, 5], &[3, 1, 1]).unwrap(), [2, 3, 4, 5]);
        assert_eq!(broadcast_shape(&[2, 1, 4], &[5, 1]).unwrap(), [2, 5, 4]);
        assert!(broadcast_shape(&[2, 3], &[4]).unwrap_err().to_string().contains("do not broadcast"));
        assert_eq!(broadcast_strides(&[3, 1, 1], &[2, 3, 4, 5]), [0, 1, 0, 0]);
    }

    /// The value of `#define NAME value` in the kernels' prelude.
    fn define(name: &str) -> Option<i32> {
        PRELUDE.lines().find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("#define") && w.next() == Some(name)).then(|| w.next()?.parse().ok()).flatten()
        })
    }

    #[test]
    fn op_codes_match_the_kernels() {
        for op in Unary::examples() {
            let (name, code, ..) = op.kernel_op();
            assert_eq!(Some(code), define(name), "{op:?}: {name}");
        }
        assert_eq!(act_code(None).0, define("ACT_NONE").unwrap());
        let elementwise = FAMILIES.iter().find(|(n, _)| *n == "elementwise.cu").map(|(_, s)| *s).expect("elementwise.cu");
        for op in Binary::iter() {
            let name = format!("BIN_{}", op.name().to_uppercase());
            assert!(elementwise.contains(&format!("#define {name} {}", op.kernel_code())), "{name}");
        }
    }

    /// `binary_bcast`'s indexing, run on the host over the plan `broadcast_binary` makes, against
    /// the CPU reference of `Binary` (activations in NCHW and NHWC, broadcasts of every kind).
    #[test]
    fn broadcast_plans_index_like_the_cpu_reference() {
        use std::borrow::Cow;
        let (nchw, nhwc) = (Layout::contiguous(3), Layout::channels_last(3));
        // (a dims, a layout, b dims, b layout, y layout), per image.
        let cases = [
            ([8, 5, 6], nhwc, [8, 1, 1], nhwc, nhwc),
            ([8, 5, 6], nhwc, [8, 1, 1], nchw, nhwc),
            ([5, 4, 6], nchw, [5, 1, 1], nchw, nchw),
            ([3, 4, 8], nhwc, [1, 4, 8], nchw, nhwc),
            ([3, 1, 8], nchw, [1, 4, 1], nhwc, nchw),
            ([8, 4, 8], nhwc, [8, 4, 8], nchw, nhwc),
            ([1, 1, 1], nhwc, [6, 2, 3], nchw, nchw),
        ];
        for (da, la, db, lb, ly) in cases {
            let out = broadcast_shape(&da, &db).unwrap();
            let batch = 2;
            let logical = |dims: &[usize], seed: u64| crate::seeded::uniform_tensor(&[&[batch][..], dims].concat(), seed);
            let (a, b) = (logical(&da, 1), logical(&db, 2));
            // Each operand's bytes in its layout.
            let physical = |t: &HostTensor, dims: &[usize], l: Layout| -> Vec<f32> {
                let per: usize = dims.iter().product();
                let strides = l.strides(dims);
                let mut v = vec![0f32; t.data.len()];
                for (i, &x) in t.data.iter().enumerate() {
                    let (n, mut rem, mut off) = (i / per, i % per, 0);
                    for k in (0..dims.len()).rev() {
                        off += (rem % dims[k]) * strides[k];
                        rem /= dims[k];
                    }
                    v[n * per + off] = x;
                }
                v
            };
            let (pa, pb) = (physical(&a, &da, la), physical(&b, &db, lb));
            let sa = activation_strides(&da, la, &out).unwrap();
            let sb = activation_strides(&db, lb, &out).unwrap();
            let bs = [da.iter().product::<usize>(), db.iter().product::<usize>()];
            for width in [1, 4, 8] {
                let (plan, _vec) = broadcast_plan(&out, ly, [&sa, &sb], bs, width);
                let per: usize = out.iter().product();
                let y: Vec<f32> = (0..batch * per)
                    .map(|i| {
                        let (mut rem, mut oa, mut ob) = (i, 0, 0);
                        for d in plan.iter().rev() {
                            oa += (rem % d[0]) * d[1];
                            ob += (rem % d[0]) * d[2];
                            rem /= d[0];
                        }
                        pa[oa + rem * bs[0]] * pb[ob + rem * bs[1]]
                    })
                    .collect();
                let mut args = CpuArgs::new(vec![Cow::Owned(a.clone()), Cow::Owned(b.clone())]);
                let want = Binary::Mul.cpu(&mut args).unwrap();
                let want = physical(&want, &out, ly);
                assert_eq!(y, want, "{da:?} {la:?} * {db:?} {lb:?} -> {ly:?}, plan {plan:?}");
            }
        }
        // The squeeze-excitation plan: [HW, C] by [0, 1] on the packed path.
        let sa = activation_strides(&[16, 5, 6], nhwc, &[16, 5, 6]).unwrap();
        let sb = activation_strides(&[16, 1, 1], nhwc, &[16, 5, 6]).unwrap();
        assert_eq!(broadcast_plan(&[16, 5, 6], nhwc, [&sa, &sb], [480, 16], 8), (vec![[30, 16, 0], [16, 1, 1]], true));
        assert!(!broadcast_plan(&[12, 5, 6], nhwc, [&sa, &sb], [360, 12], 8).1, "12 channels are not whole packs of 8");
    }
}
