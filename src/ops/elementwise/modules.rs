//! The family's Module DSL: the `Tensor` methods and operators that record its ops inline, and
//! its layers (`ReLU`, `GELU`, `Softplus`, ...), each a `Unary` op recorded under its module path.

use super::{Binary, Unary};
use crate::graph::Op;
use crate::module::{Forward, Module};
use crate::tensor::Tensor;
use crate::var_builder::VarBuilder;
use crate::Result;

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
    /// `torch.nn.ELU(alpha)`: `x` where `x > 0`, else `alpha * (exp(x) - 1)`.
    ELU, ELUConfig, |c| Unary::Elu { alpha: c.alpha }
);

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ELUConfig {
    pub alpha: f32,
}

impl Default for ELUConfig {
    fn default() -> Self {
        Self { alpha: 1.0 }
    }
}
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
