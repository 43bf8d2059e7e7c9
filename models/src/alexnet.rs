//! torchvision's AlexNet (`torchvision.models.alexnet`), with the same `state_dict` names:
//! `features.{0,3,6,8,10}` (convs), `classifier.{1,4,6}` (linears).
//!
//! `avgpool` (adaptive, to 6x6) makes the classifier independent of the input size; inputs down
//! to 63x63 reach it with at least one pixel.

use crate::sequential::SequentialLoader;
use kiln::{nn::Sequential, Result, Tensor, VarBuilder};
use kiln::{
    nn::{AdaptiveAvgPool2d, Conv2d, Conv2dConfig, Dropout, Linear, LinearConfig, MaxPool2d, Pool2dConfig, ReLU},
    Forward, Module,
};

#[derive(Clone, Copy, Debug)]
pub struct AlexNetConfig {
    pub num_classes: usize,
    /// The classifier's dropout probability (a no-op at inference).
    pub dropout: f32,
}

impl Default for AlexNetConfig {
    fn default() -> Self {
        Self { num_classes: 1000, dropout: 0.5 }
    }
}

/// `features`: five convs with ReLUs, max-pooling after the first, second and last.
fn features(vb: VarBuilder) -> Result<Sequential> {
    let pool = Pool2dConfig::new(3).stride(2);
    let mut f = SequentialLoader::new(vb);
    f.push::<Conv2d>(&Conv2dConfig::new(3, 64, 11).stride(4).padding(2))?.push::<ReLU>(&())?.push::<MaxPool2d>(&pool)?;
    f.push::<Conv2d>(&Conv2dConfig::new(64, 192, 5).padding(2))?.push::<ReLU>(&())?.push::<MaxPool2d>(&pool)?;
    f.push::<Conv2d>(&Conv2dConfig::new(192, 384, 3).padding(1))?.push::<ReLU>(&())?;
    f.push::<Conv2d>(&Conv2dConfig::new(384, 256, 3).padding(1))?.push::<ReLU>(&())?;
    f.push::<Conv2d>(&Conv2dConfig::new(256, 256, 3).padding(1))?.push::<ReLU>(&())?.push::<MaxPool2d>(&pool)?;
    Ok(f.finish())
}

/// `classifier`: dropout, 9216 → 4096, ReLU, dropout, 4096 → 4096, ReLU, 4096 → classes.
fn classifier(vb: VarBuilder, cfg: &AlexNetConfig) -> Result<Sequential> {
    let mut c = SequentialLoader::new(vb);
    c.push::<Dropout>(&cfg.dropout)?.push::<Linear>(&LinearConfig::new(256 * 6 * 6, 4096))?.push::<ReLU>(&())?;
    c.push::<Dropout>(&cfg.dropout)?.push::<Linear>(&LinearConfig::new(4096, 4096))?.push::<ReLU>(&())?;
    c.push::<Linear>(&LinearConfig::new(4096, cfg.num_classes))?;
    Ok(c.finish())
}

pub struct AlexNet {
    features: Sequential,
    avgpool: AdaptiveAvgPool2d,
    classifier: Sequential,
}

impl Module for AlexNet {
    type Config = AlexNetConfig;
    fn load(vb: VarBuilder, cfg: &AlexNetConfig) -> Result<Self> {
        Ok(Self {
            features: features(vb.pp("features"))?,
            avgpool: AdaptiveAvgPool2d::load(vb.pp("avgpool"), &[6, 6])?,
            classifier: classifier(vb.pp("classifier"), cfg)?,
        })
    }
}

impl Forward for AlexNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.avgpool.forward(&self.features.forward(x)?)?;
        self.classifier.forward(&x.flatten(1)?)
    }
}

/// `torchvision.models.alexnet()`: 1000 classes.
pub fn alexnet(vb: VarBuilder) -> Result<AlexNet> {
    AlexNet::load(vb, &AlexNetConfig::default())
}
