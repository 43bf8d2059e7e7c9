//! Loading an `nn.Sequential` written out layer by layer, as torchvision's model files write
//! `features` and `classifier`: each pushed layer loads from the next index (`features.0`,
//! `features.1`, ...), parameter-free layers included, so the `state_dict` names line up.

use kiln::{nn::Sequential, Forward, Module, Result, VarBuilder};

/// Builds a `Sequential` whose children load from `vb.pp(0)`, `vb.pp(1)`, ... in push order.
pub struct SequentialLoader {
    vb: VarBuilder,
    layers: Sequential,
}

impl SequentialLoader {
    pub fn new(vb: VarBuilder) -> Self {
        Self { vb, layers: Sequential::new() }
    }

    /// Loads an `M` from the next index and appends it.
    pub fn push<M: Module + Forward + 'static>(&mut self, config: &M::Config) -> Result<&mut Self> {
        self.push_with(|vb| M::load(vb, config))
    }

    /// Appends what `load` builds from the next index: a nested `nn.Sequential` (a stage of
    /// blocks), or any layer not loaded through `Module`.
    pub fn push_with<F: Forward + 'static>(&mut self, load: impl FnOnce(VarBuilder) -> Result<F>) -> Result<&mut Self> {
        let layer = load(self.vb.pp(self.layers.len()))?;
        self.layers.push(layer);
        Ok(self)
    }

    pub fn finish(self) -> Sequential {
        self.layers
    }
}
