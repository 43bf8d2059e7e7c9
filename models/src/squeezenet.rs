//! torchvision's SqueezeNets (`torchvision.models.squeezenet1_0` / `squeezenet1_1`), with the same
//! `state_dict` names: `features.0` (stem conv), `features.<i>.{squeeze,expand1x1,expand3x3}`
//! (Fire modules), `classifier.1` (the final 1x1 conv).
//!
//! The classifier is convolutional: a 1x1 conv to the classes, ReLU and a global average pool, so
//! the logits are non-negative.

use crate::sequential::SequentialLoader;
use kiln::{
    nn::{AdaptiveAvgPool2d, Conv2d, Conv2dConfig, Dropout, MaxPool2d, Pool2dConfig, ReLU, Sequential},
    Forward, Module, Result,
};
use kiln::{Tensor, VarBuilder};

/// A Fire module's widths: input, squeeze, and each of the two expand branches.
#[derive(Clone, Copy, Debug)]
pub struct FireConfig {
    pub inplanes: usize,
    pub squeeze_planes: usize,
    pub expand1x1_planes: usize,
    pub expand3x3_planes: usize,
}

const fn fire(inplanes: usize, squeeze_planes: usize, expand1x1_planes: usize, expand3x3_planes: usize) -> FireConfig {
    FireConfig { inplanes, squeeze_planes, expand1x1_planes, expand3x3_planes }
}

/// Squeeze to few channels with a 1x1 conv, then expand with a 1x1 and a 3x3 conv side by side.
#[derive(Module)]
#[module(config = FireConfig)]
pub struct Fire {
    #[module(config = Conv2dConfig::new(cfg.inplanes, cfg.squeeze_planes, 1))]
    squeeze: Conv2d,
    squeeze_activation: ReLU,
    #[module(config = Conv2dConfig::new(cfg.squeeze_planes, cfg.expand1x1_planes, 1))]
    expand1x1: Conv2d,
    expand1x1_activation: ReLU,
    #[module(config = Conv2dConfig::new(cfg.squeeze_planes, cfg.expand3x3_planes, 3).padding(1))]
    expand3x3: Conv2d,
    expand3x3_activation: ReLU,
}

impl Forward for Fire {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.squeeze_activation.forward(&self.squeeze.forward(x)?)?;
        let a = self.expand1x1_activation.forward(&self.expand1x1.forward(&x)?)?;
        let b = self.expand3x3_activation.forward(&self.expand3x3.forward(&x)?)?;
        Tensor::cat(&[&a, &b], 1)
    }
}

/// The two published versions: 1.1 has a 3x3 stem with 64 channels and pools earlier (2.4x
/// cheaper at the same accuracy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    V1_0,
    V1_1,
}

#[derive(Clone, Copy, Debug)]
pub struct SqueezeNetConfig {
    pub version: Version,
    pub num_classes: usize,
    /// The classifier's dropout probability (a no-op at inference).
    pub dropout: f32,
}

impl SqueezeNetConfig {
    pub fn new(version: Version) -> Self {
        Self { version, num_classes: 1000, dropout: 0.5 }
    }
}

/// `features`: the stem, then Fire modules with a ceil-mode max-pool between groups.
fn features(vb: VarBuilder, version: Version) -> Result<Sequential> {
    let pool = Pool2dConfig::new(3).stride(2).ceil_mode(true);
    let mut f = SequentialLoader::new(vb);
    match version {
        Version::V1_0 => {
            f.push::<Conv2d>(&Conv2dConfig::new(3, 96, 7).stride(2))?.push::<ReLU>(&())?.push::<MaxPool2d>(&pool)?;
            f.push::<Fire>(&fire(96, 16, 64, 64))?.push::<Fire>(&fire(128, 16, 64, 64))?.push::<Fire>(&fire(128, 32, 128, 128))?;
            f.push::<MaxPool2d>(&pool)?;
            f.push::<Fire>(&fire(256, 32, 128, 128))?.push::<Fire>(&fire(256, 48, 192, 192))?;
            f.push::<Fire>(&fire(384, 48, 192, 192))?.push::<Fire>(&fire(384, 64, 256, 256))?;
            f.push::<MaxPool2d>(&pool)?;
            f.push::<Fire>(&fire(512, 64, 256, 256))?;
        }
        Version::V1_1 => {
            f.push::<Conv2d>(&Conv2dConfig::new(3, 64, 3).stride(2))?.push::<ReLU>(&())?.push::<MaxPool2d>(&pool)?;
            f.push::<Fire>(&fire(64, 16, 64, 64))?.push::<Fire>(&fire(128, 16, 64, 64))?;
            f.push::<MaxPool2d>(&pool)?;
            f.push::<Fire>(&fire(128, 32, 128, 128))?.push::<Fire>(&fire(256, 32, 128, 128))?;
            f.push::<MaxPool2d>(&pool)?;
            f.push::<Fire>(&fire(256, 48, 192, 192))?.push::<Fire>(&fire(384, 48, 192, 192))?;
            f.push::<Fire>(&fire(384, 64, 256, 256))?.push::<Fire>(&fire(512, 64, 256, 256))?;
        }
    }
    Ok(f.finish())
}

/// `classifier`: dropout, `final_conv` (1x1, 512 → classes), ReLU, global average pool.
fn classifier(vb: VarBuilder, cfg: &SqueezeNetConfig) -> Result<Sequential> {
    let mut c = SequentialLoader::new(vb);
    c.push::<Dropout>(&cfg.dropout)?.push::<Conv2d>(&Conv2dConfig::new(512, cfg.num_classes, 1))?;
    c.push::<ReLU>(&())?.push::<AdaptiveAvgPool2d>(&[1, 1])?;
    Ok(c.finish())
}

pub struct SqueezeNet {
    features: Sequential,
    classifier: Sequential,
}

impl Module for SqueezeNet {
    type Config = SqueezeNetConfig;
    fn load(vb: VarBuilder, cfg: &SqueezeNetConfig) -> Result<Self> {
        Ok(Self { features: features(vb.pp("features"), cfg.version)?, classifier: classifier(vb.pp("classifier"), cfg)? })
    }
}

impl Forward for SqueezeNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.classifier.forward(&self.features.forward(x)?)?.flatten(1)
    }
}

/// `torchvision.models.squeezenet1_0()`: 1000 classes.
pub fn squeezenet1_0(vb: VarBuilder) -> Result<SqueezeNet> {
    SqueezeNet::load(vb, &SqueezeNetConfig::new(Version::V1_0))
}

/// `torchvision.models.squeezenet1_1()`: 1000 classes.
pub fn squeezenet1_1(vb: VarBuilder) -> Result<SqueezeNet> {
    SqueezeNet::load(vb, &SqueezeNetConfig::new(Version::V1_1))
}
