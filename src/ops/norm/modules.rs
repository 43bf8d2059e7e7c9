//! The normalisation family's `torch.nn` layers: `BatchNorm2d`, `Softmax`, `LayerNorm`,
//! torchvision's `LayerNorm2d` and `GroupNorm`, each recording its `Norm` op under its module path;
//! and their table for `ops::completeness`.

use super::{nn, resolve_dim, Norm};
use crate::graph::Op;
use crate::module::{Forward, Module};
use crate::ops::NnLayer;
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
        Tensor::record(&self.path, Op::Norm(Norm::BatchNorm2d { eps: self.eps }), &[x], &[a, b, c, d])
    }
}

/// `torch.nn.Softmax(dim)`; a negative `dim` counts from the end, as in PyTorch.
#[derive(Clone, Debug)]
pub struct Softmax {
    pub path: String,
    pub dim: isize,
}

impl Module for Softmax {
    type Config = isize;
    fn load(vb: VarBuilder, dim: &isize) -> Result<Self> {
        Ok(Self { path: vb.path().to_string(), dim: *dim })
    }
}

impl Forward for Softmax {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dim = resolve_dim(x.shape(), self.dim).map_err(|reason| crate::Error::Shape {
            path: self.path.clone(),
            op: "softmax".into(),
            reason,
            got: vec![x.shape().to_vec()],
        })?;
        Tensor::record(&self.path, Op::Norm(Norm::Softmax { dim }), &[x], &[])
    }
}

/// Options of `nn.LayerNorm` with PyTorch's defaults (eps 1e-5, affine).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormConfig {
    pub normalized_shape: Vec<usize>,
    pub eps: f32,
    pub elementwise_affine: bool,
}

impl LayerNormConfig {
    pub fn new(normalized_shape: &[usize]) -> Self {
        Self { normalized_shape: normalized_shape.to_vec(), eps: 1e-5, elementwise_affine: true }
    }
    pub fn eps(self, eps: f32) -> Self {
        Self { eps, ..self }
    }
    pub fn elementwise_affine(self, elementwise_affine: bool) -> Self {
        Self { elementwise_affine, ..self }
    }
}

impl Default for LayerNormConfig {
    fn default() -> Self {
        Self::new(&[1])
    }
}

/// `torch.nn.LayerNorm`: normalises the trailing `normalized_shape` dims; `weight`, `bias` of
/// that shape when `elementwise_affine`.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    pub path: String,
    pub shape: Vec<usize>,
    pub eps: f32,
    pub params: Option<[Param; 2]>,
}

impl Module for LayerNorm {
    type Config = LayerNormConfig;
    fn load(vb: VarBuilder, c: &LayerNormConfig) -> Result<Self> {
        let s = &c.normalized_shape;
        if s.is_empty() || s.contains(&0) {
            return Err(crate::Error::Shape {
                path: vb.path().to_string(),
                op: "layer_norm".into(),
                reason: format!("LayerNorm needs a non-empty positive normalized_shape, got {s:?}").into(),
                got: vec![],
            });
        }
        let params = if c.elementwise_affine { Some([vb.get(s, "weight")?, vb.get(s, "bias")?]) } else { None };
        Ok(Self { path: vb.path().to_string(), shape: s.clone(), eps: c.eps, params })
    }
}

impl LayerNorm {
    fn record(&self, x: &Tensor, dim: usize) -> Result<Tensor> {
        let op = Op::Norm(Norm::LayerNorm { dim, shape: self.shape.clone(), eps: self.eps, affine: self.params.is_some() });
        let params: Vec<&Param> = self.params.iter().flatten().collect();
        Tensor::record(&self.path, op, &[x], &params)
    }
}

impl Forward for LayerNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dim = x.shape().len().checked_sub(self.shape.len()).ok_or_else(|| crate::Error::Shape {
            path: self.path.clone(),
            op: "layer_norm".into(),
            reason: format!("normalized_shape {:?} has more dims than the input", self.shape).into(),
            got: vec![x.shape().to_vec()],
        })?;
        self.record(x, dim)
    }
}

/// torchvision's `LayerNorm2d` (ConvNeXt): a LayerNorm over the channels (dim 1) of an NCHW
/// input, `normalized_shape = [C]`; PyTorch permutes to NHWC and back, Kiln normalises in place.
#[derive(Clone, Debug)]
pub struct LayerNorm2d(pub LayerNorm);

impl Module for LayerNorm2d {
    type Config = LayerNormConfig;
    fn load(vb: VarBuilder, c: &LayerNormConfig) -> Result<Self> {
        LayerNorm::load(vb, c).map(Self)
    }
}

impl Forward for LayerNorm2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.record(x, 1)
    }
}

/// Options of `nn.GroupNorm(num_groups, num_channels)` with PyTorch's defaults (eps 1e-5,
/// affine); `InstanceNorm2d(C, affine=True)` is `GroupNormConfig::new(C, C)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupNormConfig {
    pub num_groups: usize,
    pub num_channels: usize,
    pub eps: f32,
    pub affine: bool,
}

impl GroupNormConfig {
    pub fn new(num_groups: usize, num_channels: usize) -> Self {
        Self { num_groups, num_channels, eps: 1e-5, affine: true }
    }
}

impl Default for GroupNormConfig {
    fn default() -> Self {
        Self::new(1, 1)
    }
}

/// `torch.nn.GroupNorm`: `weight`, `bias` of `[C]` when `affine`.
#[derive(Clone, Debug)]
pub struct GroupNorm {
    pub path: String,
    pub groups: usize,
    pub eps: f32,
    pub params: Option<[Param; 2]>,
}

impl Module for GroupNorm {
    type Config = GroupNormConfig;
    fn load(vb: VarBuilder, c: &GroupNormConfig) -> Result<Self> {
        let n = [c.num_channels];
        let params = if c.affine { Some([vb.get(&n, "weight")?, vb.get(&n, "bias")?]) } else { None };
        Ok(Self { path: vb.path().to_string(), groups: c.num_groups, eps: c.eps, params })
    }
}

impl Forward for GroupNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let op = Op::Norm(Norm::GroupNorm { groups: self.groups, eps: self.eps, affine: self.params.is_some() });
        let params: Vec<&Param> = self.params.iter().flatten().collect();
        Tensor::record(&self.path, op, &[x], &params)
    }
}

/// This family's `kiln::nn` layers, each traced on an input (for `ops::completeness`).
#[doc(hidden)]
pub const NN_LAYERS: &[NnLayer] = &[
    ("BatchNorm2d", |vb, t| nn::BatchNorm2d::load(vb, &nn::BatchNorm2dConfig::new(4))?.forward(&t.input("x", &[1, 4, 3, 3]))),
    ("Softmax", |vb, t| nn::Softmax::load(vb, &1)?.forward(&t.input("x", &[2, 5]))),
    ("LayerNorm", |vb, t| nn::LayerNorm::load(vb, &nn::LayerNormConfig::new(&[5]))?.forward(&t.input("x", &[2, 3, 5]))),
    ("LayerNorm2d", |vb, t| nn::LayerNorm2d::load(vb, &nn::LayerNormConfig::new(&[4]))?.forward(&t.input("x", &[1, 4, 3, 3]))),
    ("GroupNorm", |vb, t| nn::GroupNorm::load(vb, &nn::GroupNormConfig::new(2, 4))?.forward(&t.input("x", &[1, 4, 3, 3]))),
];
