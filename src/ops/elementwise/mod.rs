//! Elementwise ops: activations and scalar arithmetic (`Unary`), and `+ - * /` of two tensors with
//! NumPy/PyTorch broadcasting (`Binary`). Layers: `ReLU`, `ReLU6`, `LeakyReLU`, `Sigmoid`, `SiLU`,
//! `Hardswish`, `Hardsigmoid`, `GELU`, `Tanh`, `Hardtanh`, `Softplus`, `ELU`, `Mish`.
//!
//! `unary.rs` holds the one-input ops and their layers, `forms.rs` how each is written outside
//! the graph (its method, `kiln::nn` layer and ATen ops), `binary.rs` the broadcasting
//! arithmetic, `modules.rs` the `Tensor` methods and the layers; the fixture twins are here.

mod binary;
mod forms;
mod modules;
mod unary;

pub use binary::Binary;
pub use forms::{ConfigForm, FormArg};
pub use modules::*;
pub(crate) use unary::activation_in_place;
pub use unary::{bias_act, Unary};

use crate::engine::launch::{Arg, KArg};
use crate::module::{Forward, Module};
use crate::ops::{AtenImport, FixtureTwin, NnLayer};
use crate::tensor::Tensor;
use crate::Result;

/// This family's layers, as `kiln::nn` shows them.
pub mod nn {
    pub use super::{
        ELUConfig, Hardsigmoid, Hardswish, Hardtanh, LeakyReLU, LeakyReLUConfig, Mish, ReLU, ReLU6, SiLU, Sigmoid, Softplus,
        SoftplusConfig, Tanh, ELU, GELU,
    };
}

/// The kernels this family's layers launch (kernels/elementwise.cu; the activation codes, `ACT_*`,
/// in kernels/common.cuh), stamped per element type.
pub(super) const KERNELS: &[&str] = &[
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

pub(super) fn i32_arg(v: i32) -> Arg {
    Arg::Const(KArg::I32(v))
}

pub(super) fn f32_arg(v: f32) -> Arg {
    Arg::Const(KArg::F32(v))
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
    ("elu", |f| ELU::load(f.vb, &ELUConfig::default())?.forward(f.x)),
    ("elu_alpha", |f| f.x.elu(0.5)),
    ("mish", |f| Mish::load(f.vb, &())?.forward(f.x)),
    ("pow_square", |f| f.x.pow(2.0)),
    ("pow_cube", |f| f.x.pow(3.0)),
    ("pow_sqrt", |f| f.x.abs()?.pow(0.5)),
    ("pow_minus2", |f| abs_plus_half(f.x)?.pow(-2.0)),
    ("add_position_embedding", |f| f.x.binary_weight(f.vb.path(), Binary::Add, &f.vb.get(&[1, 9, 8], "pos_embedding")?)),
];

/// The ATen ops kiln-torch imports as this family's binary ops (the unary ops' are in their
/// forms, `Unary::form`).
#[doc(hidden)]
pub const ATEN: &[AtenImport] = &[
    // `expand` is an add of zeros.
    ("add", &["aten.add.Tensor", "aten.expand.default"]),
    ("sub", &["aten.sub.Tensor", "aten.rsub.Tensor"]),
    ("mul", &["aten.mul.Tensor"]),
    ("div", &["aten.div.Tensor", "aten.div.Tensor_mode"]),
];

/// This family's `kiln::nn` layers, each traced on an input (for `ops::completeness`).
#[doc(hidden)]
pub const NN_LAYERS: &[NnLayer] = &[
    ("ReLU", |vb, t| nn::ReLU::load(vb, &())?.forward(&t.input("x", &[2, 3, 4]))),
    ("ReLU6", |vb, t| nn::ReLU6::load(vb, &())?.forward(&t.input("x", &[2, 3, 4]))),
    ("Hardtanh", |vb, t| nn::Hardtanh::load(vb, &(-1.0, 1.0))?.forward(&t.input("x", &[2, 3, 4]))),
    ("LeakyReLU", |vb, t| nn::LeakyReLU::load(vb, &nn::LeakyReLUConfig::default())?.forward(&t.input("x", &[2, 3, 4]))),
    ("Sigmoid", |vb, t| nn::Sigmoid::load(vb, &())?.forward(&t.input("x", &[2, 3, 4]))),
    ("SiLU", |vb, t| nn::SiLU::load(vb, &())?.forward(&t.input("x", &[2, 3, 4]))),
    ("Hardswish", |vb, t| nn::Hardswish::load(vb, &())?.forward(&t.input("x", &[2, 3, 4]))),
    ("Hardsigmoid", |vb, t| nn::Hardsigmoid::load(vb, &())?.forward(&t.input("x", &[2, 3, 4]))),
    ("GELU", |vb, t| nn::GELU::load(vb, &false)?.forward(&t.input("x", &[2, 3, 4]))),
    ("Tanh", |vb, t| nn::Tanh::load(vb, &())?.forward(&t.input("x", &[2, 3, 4]))),
    ("Softplus", |vb, t| nn::Softplus::load(vb, &nn::SoftplusConfig::default())?.forward(&t.input("x", &[2, 3, 4]))),
    ("ELU", |vb, t| nn::ELU::load(vb, &nn::ELUConfig::default())?.forward(&t.input("x", &[2, 3, 4]))),
    ("Mish", |vb, t| nn::Mish::load(vb, &())?.forward(&t.input("x", &[2, 3, 4]))),
];

#[cfg(test)]
mod tests {
    use super::unary::act_code;
    use super::*;
    use crate::engine::kernels::{FAMILIES, PRELUDE};
    use crate::ops::OpDef;
    use strum::IntoEnumIterator;

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
}
