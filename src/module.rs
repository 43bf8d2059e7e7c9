//! Modules: structs of layers that load their parameters by name and trace their `forward`.

use crate::tensor::Tensor;
use crate::var_builder::VarBuilder;
use crate::Result;

/// A layer or a network that loads its parameters from a `VarBuilder` scoped to its module path.
///
/// `#[derive(Module)]` writes `load` for a struct of modules: each field loads from `vb.pp(field)`.
/// `forward` is an ordinary method (it may take and return several tensors, as CenterNet's head).
pub trait Module: Sized {
    /// What `load` needs besides weights (channels, kernel size...). `()` for most composites.
    type Config;
    fn load(vb: VarBuilder, config: &Self::Config) -> Result<Self>;
}

/// A module with one input and one output, the kind `Sequential` chains.
pub trait Forward {
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
}

/// Modules applied in order; their `state_dict` names are their indices (`0`, `1`, ...), as
/// `torch.nn.Sequential`. Load each child from `vb.pp(i)`.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Forward>>,
}

impl Sequential {
    pub fn new() -> Self {
        Self::default()
    }
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, layer: impl Forward + 'static) -> Self {
        self.layers.push(Box::new(layer));
        self
    }
    pub fn push(&mut self, layer: impl Forward + 'static) {
        self.layers.push(Box::new(layer));
    }
    pub fn len(&self) -> usize {
        self.layers.len()
    }
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl Forward for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.layers.iter().try_fold(x.clone(), |x, layer| layer.forward(&x))
    }
}

impl<M: Forward> Forward for Option<M> {
    /// An absent optional module is the identity (as `downsample = None` in torchvision).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Some(m) => m.forward(x),
            None => Ok(x.clone()),
        }
    }
}

impl<T: Forward> Forward for Box<T> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (**self).forward(x)
    }
}

/// `torch.nn.Identity`: returns its input; records nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct Identity;

impl Module for Identity {
    type Config = ();
    fn load(_vb: VarBuilder, _config: &()) -> Result<Self> {
        Ok(Self)
    }
}

impl Forward for Identity {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }
}

/// `torch.nn.Dropout(p)` (and `StochasticDepth`): the identity at inference, so nothing is
/// recorded. The config is the drop probability, kept for readers of the model file.
#[derive(Clone, Copy, Debug, Default)]
pub struct Dropout;

impl Module for Dropout {
    type Config = f32;
    fn load(_vb: VarBuilder, _p: &f32) -> Result<Self> {
        Ok(Self)
    }
}

impl Forward for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }
}
