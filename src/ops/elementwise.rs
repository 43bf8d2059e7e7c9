//! Elementwise ops: ReLU, LeakyReLU, Sigmoid, Add, Mul.

use crate::graph::Op;
use crate::module::{Forward, Module};
use crate::tensor::Tensor;
use crate::var_builder::VarBuilder;
use crate::Result;

/// A parameter-free layer: `ReLU`, `LeakyReLU`, `Sigmoid` are this with their op.
#[derive(Clone, Debug)]
pub struct Activation {
    pub path: String,
    pub op: Op,
}

impl Forward for Activation {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::record(&self.path, self.op.clone(), &[x], &[])
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
    ReLU, (), |_c| Op::Relu
);
activation_module!(
    /// `torch.nn.Sigmoid`.
    Sigmoid, (), |_c| Op::Sigmoid
);
activation_module!(
    /// `torch.nn.LeakyReLU(negative_slope)`.
    LeakyReLU, LeakyReLUConfig, |c| Op::LeakyRelu { slope: c.negative_slope }
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

pub fn unary_shape(inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
    match inputs {
        [x] => Ok(x.to_vec()),
        _ => Err(format!("expected 1 input, got {}", inputs.len())),
    }
}

/// Add and Mul take two tensors of the same shape (no broadcasting).
pub fn binary_shape(inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
    match inputs {
        [a, b] if a == b => Ok(a.to_vec()),
        [a, b] => Err(format!("operands must have the same shape, got {a:?} and {b:?}")),
        _ => Err(format!("expected 2 inputs, got {}", inputs.len())),
    }
}
