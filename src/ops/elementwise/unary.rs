//! `Unary`: the one-input elementwise ops (activations, clamp, scalar arithmetic, math
//! functions), their CPU reference and kernel codes, and the layers that apply them: the
//! activation kernel and the `bias_act` epilogue.

use super::{f32_arg, i32_arg, KERNELS};
use crate::engine::launch::{same_elem, to_i32, typed_entry_points, Arg, KernelLayer};
use crate::engine::{Elem, Layer, Layout, ValueId};
use crate::error::OpError;
use crate::graph::{HostTensor, NodeId};
use crate::ops::BuildCtx;
use crate::ops::{one_input, CpuArgs, LayoutPlan, OpDef};
use crate::LowerKind;
use crate::Result;
use serde::{Deserialize, Serialize};
use strum::IntoEnumIterator;

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

    /// The op as a layer that stores `elem` runs it: a clamp's finite bounds rounded into `elem`
    /// towards the inside, so that what it stores stays within them. `F.normalize`'s
    /// `clamp(norm, min=1e-12)` would otherwise store 0 in FP16 (its smallest step is 2^-24), and
    /// the division after it give NaN where PyTorch's FP32 gives 0.
    pub fn stored_as(self, elem: Elem) -> Self {
        let Unary::Clamp { min, max } = self else { return self };
        if elem != Elem::F16 {
            return self;
        }
        let (lo, hi) = (f16_inside(min, true), f16_inside(max, false));
        // Bounds that cross once rounded keep their f32 values: the kernel still computes in f32.
        if lo > hi {
            return self;
        }
        Unary::Clamp { min: lo, max: hi }
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

// ---- engine layers ----------------------------------------------------------------------------

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

/// The FP16 value nearest `bound` on its inside: at or above it for a lower bound (`up`), at or
/// below it for an upper one. A bound FP16 holds exactly, or that is past FP16's range, is kept.
fn f16_inside(bound: f32, up: bool) -> f32 {
    let h = half::f16::from_f32(bound);
    let v = h.to_f32();
    if !h.is_finite() || v == bound || (v > bound) == up {
        return if h.is_finite() { v } else { bound };
    }
    // One FP16 step further towards the inside: within a sign, FP16 bits are ordered like integers.
    // Up from a positive value, or down from a negative one, the magnitude grows by one step.
    let bits = h.to_bits();
    let next = match (v == 0.0, up) {
        (true, true) => 0x0001,
        (true, false) => 0x8001,
        (false, _) if (v > 0.0) == up => bits + 1,
        (false, _) => bits - 1,
    };
    half::f16::from_bits(next).to_f32()
}

/// The activation an epilogue applies, as the kernels take it: `(code, p0, p1)`.
pub(super) fn act_code(act: Option<Unary>) -> (i32, f32, f32) {
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
    let (code, p0, p1) = op.stored_as(elem).kernel_code();
    let per_image = ctx.value(y).per_image_elems();
    let args = vec![Arg::Value(x), Arg::Value(y), Arg::PerBatch(per_image), i32_arg(code), f32_arg(p0), f32_arg(p1)];
    let layer = KernelLayer::new(ctx, &activation_entry(op, elem), args, per_image)?;
    Ok(Box::new(layer.kind(format!("kernel:{}", op.name())).items(4)))
}

/// `op` applied in place to every element of `v` (any layout): the activation of a fused Linear
/// whose GEMM cannot apply it (`Gemm::LinearAct` on cuBLASLt).
pub(crate) fn activation_in_place(ctx: &crate::engine::layer::LayerCtx, v: ValueId, op: Unary) -> Result<KernelLayer> {
    let elem = ctx.value(v).elem;
    let (code, p0, p1) = op.stored_as(elem).kernel_code();
    let per_image = ctx.value(v).per_image_elems();
    let args = vec![Arg::Value(v), Arg::Value(v), Arg::PerBatch(per_image), i32_arg(code), f32_arg(p0), f32_arg(p1)];
    Ok(KernelLayer::new(ctx, &activation_entry(op, elem), args, per_image)?.kind(format!("kernel:{}", op.name())).items(4))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clamp_stored_in_fp16_keeps_its_bounds_inside() {
        let tiny = 2f32.powi(-24); // FP16's smallest positive value
        let clamp = |min, max| Unary::Clamp { min, max };
        // F.normalize's eps: 0 in FP16, so the smallest positive FP16 instead.
        assert_eq!(clamp(1e-12, f32::MAX).stored_as(Elem::F16), clamp(tiny, f32::MAX));
        assert_eq!(clamp(f32::MIN, -1e-12).stored_as(Elem::F16), clamp(f32::MIN, -tiny));
        // Bounds FP16 holds exactly, and other storage, are unchanged.
        assert_eq!(clamp(0.0, 6.0).stored_as(Elem::F16), clamp(0.0, 6.0));
        assert_eq!(clamp(1e-12, 1.0).stored_as(Elem::F32), clamp(1e-12, 1.0));
        // Inexact bounds round inwards: 0.1 is between two FP16 values.
        let Unary::Clamp { min, max } = clamp(0.1, 0.1 + 1e-3).stored_as(Elem::F16) else { unreachable!() };
        assert!(min >= 0.1 && half::f16::from_f32(min).to_f32() == min, "{min}");
        assert!(max <= 0.101 && half::f16::from_f32(max).to_f32() == max, "{max}");
        assert!(min < max);
        // And on the negative side.
        let Unary::Clamp { min, max } = clamp(-0.1 - 1e-3, -0.1).stored_as(Elem::F16) else { unreachable!() };
        assert!(min >= -0.101 && half::f16::from_f32(min).to_f32() == min, "{min}");
        assert!(max <= -0.1 && half::f16::from_f32(max).to_f32() == max, "{max}");
        assert!(min < max);
        // Bounds that would cross keep their f32 values.
        assert_eq!(clamp(0.1, 0.1 + 1e-6).stored_as(Elem::F16), clamp(0.1, 0.1 + 1e-6));
        // Other ops are unchanged.
        assert_eq!(Unary::Relu.stored_as(Elem::F16), Unary::Relu);
    }

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
}
