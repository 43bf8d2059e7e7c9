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

// ---- CPU reference

use crate::graph::HostTensor;

/// ReLU, LeakyReLU or Sigmoid applied in place to `x` (taken by value so the executor can reuse
/// its buffer).
pub fn unary_cpu(op: &Op, mut x: HostTensor) -> Result<HostTensor, String> {
    match op {
        Op::Relu => x.data.iter_mut().for_each(|v| *v = v.max(0.0)),
        Op::LeakyRelu { slope } => x.data.iter_mut().for_each(|v| {
            if *v < 0.0 {
                *v *= slope
            }
        }),
        Op::Sigmoid => x.data.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp())),
        other => return Err(format!("`{}` is not a unary elementwise op", other.name())),
    }
    Ok(x)
}

/// Add or Mul of two same-shaped tensors, written into `a`'s buffer.
pub fn binary_cpu(op: &Op, mut a: HostTensor, b: &HostTensor) -> Result<HostTensor, String> {
    binary_shape(&[&a.shape, &b.shape])?;
    match op {
        Op::Add => a.data.iter_mut().zip(&b.data).for_each(|(x, y)| *x += y),
        Op::Mul => a.data.iter_mut().zip(&b.data).for_each(|(x, y)| *x *= y),
        other => return Err(format!("`{}` is not a binary elementwise op", other.name())),
    }
    Ok(a)
}

// ---- GPU converter (kernels/elementwise.cu through engine::kernel_layers)

mod gpu {
    use crate::engine::kernel_layers::{activation, binary, KernelAct};
    use crate::engine::{BuildCtx, Layer};
    use crate::graph::{NodeId, Op};
    use crate::Result;

    fn relu(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        activation(ctx, node, KernelAct::Relu)
    }
    fn leaky_relu(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        let Op::LeakyRelu { slope } = ctx.node(node).op else { return Err(ctx.err(node, "is not a leaky_relu".into())) };
        activation(ctx, node, KernelAct::Leaky(slope))
    }
    fn sigmoid(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        activation(ctx, node, KernelAct::Sigmoid)
    }
    fn add(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        binary(ctx, node, false, KernelAct::None)
    }
    fn mul(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        binary(ctx, node, true, KernelAct::None)
    }

    crate::register_converter!("relu", relu);
    crate::register_converter!("leaky_relu", leaky_relu);
    crate::register_converter!("sigmoid", sigmoid);
    crate::register_converter!("add", add);
    crate::register_converter!("mul", mul);
}
