//! Linear (fully connected): `y = x Wᵀ + b`.

use crate::graph::Op;
use crate::module::{Forward, Module};
use crate::tensor::{Param, Tensor};
use crate::var_builder::VarBuilder;
use crate::Result;

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

/// `torch.nn.Linear`: `weight` [out, in], `bias` [out].
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
        Tensor::record(&self.path, Op::Linear { bias: self.bias.is_some() }, &[x], &params)
    }
}

/// `inputs` = x [N, in], weight [out, in], bias? [out].
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
