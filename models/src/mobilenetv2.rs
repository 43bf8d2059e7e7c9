//! torchvision's MobileNetV2 (`torchvision.models.mobilenet_v2`), with the same `state_dict`
//! names: `features.0.0` (the stem's conv), `features.1.conv.0.0` (an inverted residual's first
//! `Conv2dNormActivation`), `features.18.1`, `classifier.1`.
//!
//! An inverted residual expands with a 1x1 conv (skipped when `expand_ratio` is 1), filters with
//! a depthwise 3x3, projects back with a linear 1x1 and BatchNorm, and adds its input when the
//! shape allows. Its `conv` is an `nn.Sequential` whose length depends on the expansion, so it
//! loads through `SequentialLoader`, as `features` does.

use crate::misc::{make_divisible, Conv2dNormActivation, ConvNormConfig};
use crate::sequential::SequentialLoader;
use kiln::{nn::Sequential, Result, Tensor, VarBuilder};
use kiln::{
    nn::{BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, Dropout, Linear, LinearConfig, ReLU6},
    Forward, Module,
};

/// Conv + BatchNorm + ReLU6, MobileNetV2's only activation.
type ConvBNReLU6 = Conv2dNormActivation<ReLU6>;

/// `InvertedResidual(inp, oup, stride, expand_ratio)`.
#[derive(Clone, Copy, Debug)]
pub struct InvertedResidualConfig {
    pub inp: usize,
    pub oup: usize,
    pub stride: usize,
    pub expand_ratio: usize,
}

pub struct InvertedResidual {
    conv: Sequential,
    use_res_connect: bool,
}

impl Module for InvertedResidual {
    type Config = InvertedResidualConfig;
    fn load(vb: VarBuilder, cfg: &InvertedResidualConfig) -> Result<Self> {
        let hidden_dim = cfg.inp * cfg.expand_ratio;
        let mut layers = SequentialLoader::new(vb.pp("conv"));
        if cfg.expand_ratio != 1 {
            layers.push::<ConvBNReLU6>(&ConvNormConfig::new(cfg.inp, hidden_dim, 1))?;
        }
        layers
            .push::<ConvBNReLU6>(&ConvNormConfig::new(hidden_dim, hidden_dim, 3).stride(cfg.stride).groups(hidden_dim))?
            .push::<Conv2d>(&Conv2dConfig::new(hidden_dim, cfg.oup, 1).bias(false))?
            .push::<BatchNorm2d>(&BatchNorm2dConfig::new(cfg.oup))?;
        Ok(Self { conv: layers.finish(), use_res_connect: cfg.stride == 1 && cfg.inp == cfg.oup })
    }
}

impl Forward for InvertedResidual {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.use_res_connect {
            x + &self.conv.forward(x)?
        } else {
            self.conv.forward(x)
        }
    }
}

#[derive(Clone, Debug)]
pub struct MobileNetV2Config {
    pub num_classes: usize,
    /// Scales every width (rounded to multiples of 8); the last conv never shrinks below 1280.
    pub width_mult: f64,
    /// `[t, c, n, s]` per stage: expansion, output channels, blocks, first block's stride.
    pub inverted_residual_setting: Vec<[usize; 4]>,
    /// Dropout before the classifier (a no-op at inference).
    pub dropout: f32,
}

impl Default for MobileNetV2Config {
    fn default() -> Self {
        let inverted_residual_setting =
            vec![[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2], [6, 320, 1, 1]];
        Self { num_classes: 1000, width_mult: 1.0, inverted_residual_setting, dropout: 0.2 }
    }
}

impl MobileNetV2Config {
    fn last_channel(&self) -> usize {
        make_divisible(1280.0 * self.width_mult.max(1.0), 8)
    }
}

/// `features` (stem, 17 inverted residuals, a 1x1 conv to 1280) and `classifier` (dropout, linear).
pub struct MobileNetV2 {
    features: Sequential,
    classifier: Sequential,
}

impl Module for MobileNetV2 {
    type Config = MobileNetV2Config;
    fn load(vb: VarBuilder, cfg: &MobileNetV2Config) -> Result<Self> {
        let mut input_channel = make_divisible(32.0 * cfg.width_mult, 8);
        let mut features = SequentialLoader::new(vb.pp("features"));
        features.push::<ConvBNReLU6>(&ConvNormConfig::new(3, input_channel, 3).stride(2))?;
        for &[t, c, n, s] in &cfg.inverted_residual_setting {
            let output_channel = make_divisible(c as f64 * cfg.width_mult, 8);
            for i in 0..n {
                let stride = if i == 0 { s } else { 1 };
                features.push::<InvertedResidual>(&InvertedResidualConfig {
                    inp: input_channel,
                    oup: output_channel,
                    stride,
                    expand_ratio: t,
                })?;
                input_channel = output_channel;
            }
        }
        features.push::<ConvBNReLU6>(&ConvNormConfig::new(input_channel, cfg.last_channel(), 1))?;
        let mut classifier = SequentialLoader::new(vb.pp("classifier"));
        classifier.push::<Dropout>(&cfg.dropout)?.push::<Linear>(&LinearConfig::new(cfg.last_channel(), cfg.num_classes))?;
        Ok(Self { features: features.finish(), classifier: classifier.finish() })
    }
}

impl Forward for MobileNetV2 {
    /// The global pool is functional in torchvision (`nn.functional.adaptive_avg_pool2d`).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.features.forward(x)?.adaptive_avg_pool2d([1, 1])?;
        self.classifier.forward(&x.flatten(1)?)
    }
}

/// `torchvision.models.mobilenet_v2()`: 1000 classes.
pub fn mobilenet_v2(vb: VarBuilder) -> Result<MobileNetV2> {
    MobileNetV2::load(vb, &MobileNetV2Config::default())
}
