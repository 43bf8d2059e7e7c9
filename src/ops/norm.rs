//! BatchNorm2d (inference: running statistics). Folded into the preceding conv by
//! `passes::fold_batchnorm`; run as a per-channel scale and shift otherwise.

use crate::graph::Op;
use crate::module::{Forward, Module};
use crate::tensor::{Param, Tensor};
use crate::var_builder::VarBuilder;
use crate::Result;

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
        Tensor::record(&self.path, Op::BatchNorm2d { eps: self.eps }, &[x], &[a, b, c, d])
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
