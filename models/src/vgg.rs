//! torchvision's VGGs (`torchvision.models.vgg11` ... `vgg19_bn`), with the same `state_dict`
//! names: `features.<i>` (convs, BatchNorms), `classifier.{0,3,6}` (linears).
//!
//! One table of layer widths (torchvision's `cfgs` A, B, D, E) gives every depth; `batch_norm`
//! inserts a BatchNorm after each conv, which shifts the indices as in torchvision.

use crate::sequential::SequentialLoader;
use kiln::{
    nn::{AdaptiveAvgPool2d, BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, Dropout, Linear, LinearConfig},
    Forward,
};
use kiln::{
    nn::{MaxPool2d, Pool2dConfig, ReLU, Sequential},
    Module, Result, Tensor, VarBuilder,
};

/// One entry of a VGG configuration: a 3x3 conv to that many channels, or a 2x2 max-pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layer {
    Conv(usize),
    MaxPool,
}

use Layer::{Conv as C, MaxPool as M};

/// VGG-11 (torchvision's "A").
#[rustfmt::skip]
pub const VGG11: &[Layer] = &[C(64), M, C(128), M, C(256), C(256), M, C(512), C(512), M, C(512), C(512), M];
/// VGG-13 ("B").
#[rustfmt::skip]
pub const VGG13: &[Layer] = &[C(64), C(64), M, C(128), C(128), M, C(256), C(256), M, C(512), C(512), M, C(512), C(512), M];
/// VGG-16 ("D").
#[rustfmt::skip]
pub const VGG16: &[Layer] = &[C(64), C(64), M, C(128), C(128), M, C(256), C(256), C(256), M, C(512), C(512), C(512), M,
                              C(512), C(512), C(512), M];
/// VGG-19 ("E").
#[rustfmt::skip]
pub const VGG19: &[Layer] = &[C(64), C(64), M, C(128), C(128), M, C(256), C(256), C(256), C(256), M,
                              C(512), C(512), C(512), C(512), M, C(512), C(512), C(512), C(512), M];

#[derive(Clone, Copy, Debug)]
pub struct VggConfig {
    pub layers: &'static [Layer],
    pub batch_norm: bool,
    pub num_classes: usize,
    /// The classifier's dropout probability (a no-op at inference).
    pub dropout: f32,
}

impl VggConfig {
    pub fn new(layers: &'static [Layer], batch_norm: bool) -> Self {
        Self { layers, batch_norm, num_classes: 1000, dropout: 0.5 }
    }
}

/// torchvision's `make_layers`: conv (+ BatchNorm) + ReLU per width, a max-pool per `M`.
fn features(vb: VarBuilder, cfg: &VggConfig) -> Result<Sequential> {
    let mut f = SequentialLoader::new(vb);
    let mut in_channels = 3;
    for layer in cfg.layers {
        match *layer {
            M => {
                f.push::<MaxPool2d>(&Pool2dConfig::new(2).stride(2))?;
            }
            C(v) => {
                f.push::<Conv2d>(&Conv2dConfig::new(in_channels, v, 3).padding(1))?;
                if cfg.batch_norm {
                    f.push::<BatchNorm2d>(&BatchNorm2dConfig::new(v))?;
                }
                f.push::<ReLU>(&())?;
                in_channels = v;
            }
        }
    }
    Ok(f.finish())
}

/// `classifier`: 25088 → 4096, ReLU, dropout, 4096 → 4096, ReLU, dropout, 4096 → classes.
fn classifier(vb: VarBuilder, cfg: &VggConfig) -> Result<Sequential> {
    let mut c = SequentialLoader::new(vb);
    c.push::<Linear>(&LinearConfig::new(512 * 7 * 7, 4096))?.push::<ReLU>(&())?.push::<Dropout>(&cfg.dropout)?;
    c.push::<Linear>(&LinearConfig::new(4096, 4096))?.push::<ReLU>(&())?.push::<Dropout>(&cfg.dropout)?;
    c.push::<Linear>(&LinearConfig::new(4096, cfg.num_classes))?;
    Ok(c.finish())
}

pub struct Vgg {
    features: Sequential,
    avgpool: AdaptiveAvgPool2d,
    classifier: Sequential,
}

impl Module for Vgg {
    type Config = VggConfig;
    fn load(vb: VarBuilder, cfg: &VggConfig) -> Result<Self> {
        Ok(Self {
            features: features(vb.pp("features"), cfg)?,
            avgpool: AdaptiveAvgPool2d::load(vb.pp("avgpool"), &[7, 7])?,
            classifier: classifier(vb.pp("classifier"), cfg)?,
        })
    }
}

impl Forward for Vgg {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.avgpool.forward(&self.features.forward(x)?)?;
        self.classifier.forward(&x.flatten(1)?)
    }
}

/// `torchvision.models.vgg16()`: 1000 classes.
pub fn vgg16(vb: VarBuilder) -> Result<Vgg> {
    Vgg::load(vb, &VggConfig::new(VGG16, false))
}

/// `torchvision.models.vgg16_bn()`: a BatchNorm after every conv.
pub fn vgg16_bn(vb: VarBuilder) -> Result<Vgg> {
    Vgg::load(vb, &VggConfig::new(VGG16, true))
}
