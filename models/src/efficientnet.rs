//! torchvision's EfficientNet-B0 (`torchvision.models.efficientnet_b0`), with the same
//! `state_dict` names: `features.0.0` (stem conv), `features.2.1.block.2.fc1` (a stage's MBConv
//! block and its squeeze-excitation), `features.8.1`, `classifier.1`.
//!
//! `features.1` to `features.7` are stages (`nn.Sequential`s) of MBConv blocks: an expanding 1x1
//! conv (when the expansion is not 1), a depthwise conv, a squeeze-excitation (SiLU, then
//! Sigmoid) and a linear 1x1 projection, plus the input when the shape is kept. Stochastic depth
//! is the identity at inference. B0 keeps BatchNorm's default eps (1e-5; B5 to B7 use 1e-3).

use crate::misc::{make_divisible, Conv2dNormActivation, ConvNormConfig, SqueezeExcitation};
use crate::sequential::SequentialLoader;
use kiln::{
    nn::{AdaptiveAvgPool2d, Dropout, Identity, Linear, LinearConfig, Sequential, SiLU, Sigmoid},
    Forward, Module, Result,
};
use kiln::{Tensor, VarBuilder};

/// `MBConvConfig(expand_ratio, kernel, stride, input_channels, out_channels, num_layers)` at
/// width and depth multipliers 1.
#[derive(Clone, Copy, Debug)]
pub struct MBConvConfig {
    pub expand_ratio: f64,
    pub kernel: usize,
    pub stride: usize,
    pub input_channels: usize,
    pub out_channels: usize,
    pub num_layers: usize,
}

const fn bneck(
    expand_ratio: f64,
    kernel: usize,
    stride: usize,
    input_channels: usize,
    out_channels: usize,
    num_layers: usize,
) -> MBConvConfig {
    MBConvConfig { expand_ratio, kernel, stride, input_channels, out_channels, num_layers }
}

/// The MBConv block: `block` (an `nn.Sequential` of 3 or 4 layers) and the residual add.
pub struct MBConv {
    block: Sequential,
    stochastic_depth: Identity,
    use_res_connect: bool,
}

impl Module for MBConv {
    type Config = MBConvConfig;
    fn load(vb: VarBuilder, cnf: &MBConvConfig) -> Result<Self> {
        let expanded_channels = make_divisible(cnf.input_channels as f64 * cnf.expand_ratio, 8);
        let mut layers = SequentialLoader::new(vb.pp("block"));
        if expanded_channels != cnf.input_channels {
            layers.push::<Conv2dNormActivation<SiLU>>(&ConvNormConfig::new(cnf.input_channels, expanded_channels, 1))?;
        }
        let depthwise = ConvNormConfig::new(expanded_channels, expanded_channels, cnf.kernel).stride(cnf.stride).groups(expanded_channels);
        layers.push::<Conv2dNormActivation<SiLU>>(&depthwise)?;
        let squeeze_channels = (cnf.input_channels / 4).max(1);
        layers.push::<SqueezeExcitation<SiLU, Sigmoid>>(&(expanded_channels, squeeze_channels))?;
        layers.push::<Conv2dNormActivation<Identity>>(&ConvNormConfig::new(expanded_channels, cnf.out_channels, 1))?;
        Ok(Self {
            block: layers.finish(),
            stochastic_depth: Identity::load(vb.pp("stochastic_depth"), &())?,
            use_res_connect: cnf.stride == 1 && cnf.input_channels == cnf.out_channels,
        })
    }
}

impl Forward for MBConv {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let result = self.block.forward(input)?;
        if self.use_res_connect {
            &self.stochastic_depth.forward(&result)? + input
        } else {
            Ok(result)
        }
    }
}

#[derive(Clone, Debug)]
pub struct EfficientNetConfig {
    pub inverted_residual_setting: Vec<MBConvConfig>,
    pub num_classes: usize,
    pub dropout: f32,
}

impl EfficientNetConfig {
    /// `_efficientnet_conf("efficientnet_b0", width_mult=1.0, depth_mult=1.0)`.
    pub fn b0() -> Self {
        let inverted_residual_setting = vec![
            bneck(1.0, 3, 1, 32, 16, 1),
            bneck(6.0, 3, 2, 16, 24, 2),
            bneck(6.0, 5, 2, 24, 40, 2),
            bneck(6.0, 3, 2, 40, 80, 3),
            bneck(6.0, 5, 1, 80, 112, 3),
            bneck(6.0, 5, 2, 112, 192, 4),
            bneck(6.0, 3, 1, 192, 320, 1),
        ];
        Self { inverted_residual_setting, num_classes: 1000, dropout: 0.2 }
    }
    fn lastconv_output_channels(&self) -> usize {
        4 * self.inverted_residual_setting.last().map_or(0, |c| c.out_channels)
    }
}

/// `features` (stem, seven stages, a 1x1 conv to 4x the last width), `avgpool`, `classifier`.
pub struct EfficientNet {
    features: Sequential,
    avgpool: AdaptiveAvgPool2d,
    classifier: Sequential,
}

impl Module for EfficientNet {
    type Config = EfficientNetConfig;
    fn load(vb: VarBuilder, cfg: &EfficientNetConfig) -> Result<Self> {
        let setting = &cfg.inverted_residual_setting;
        let firstconv_output_channels = setting.first().map_or(0, |c| c.input_channels);
        let mut features = SequentialLoader::new(vb.pp("features"));
        features.push::<Conv2dNormActivation<SiLU>>(&ConvNormConfig::new(3, firstconv_output_channels, 3).stride(2))?;
        for cnf in setting {
            // A stage: its first block changes the width and carries the stride.
            features.push_with(|vb| {
                let mut stage = SequentialLoader::new(vb);
                for i in 0..cnf.num_layers {
                    let block_cnf = if i == 0 { *cnf } else { MBConvConfig { input_channels: cnf.out_channels, stride: 1, ..*cnf } };
                    stage.push::<MBConv>(&block_cnf)?;
                }
                Ok(stage.finish())
            })?;
        }
        let lastconv_input_channels = setting.last().map_or(0, |c| c.out_channels);
        features.push::<Conv2dNormActivation<SiLU>>(&ConvNormConfig::new(lastconv_input_channels, cfg.lastconv_output_channels(), 1))?;
        let mut classifier = SequentialLoader::new(vb.pp("classifier"));
        classifier.push::<Dropout>(&cfg.dropout)?.push::<Linear>(&LinearConfig::new(cfg.lastconv_output_channels(), cfg.num_classes))?;
        Ok(Self {
            features: features.finish(),
            avgpool: AdaptiveAvgPool2d::load(vb.pp("avgpool"), &[1, 1])?,
            classifier: classifier.finish(),
        })
    }
}

impl Forward for EfficientNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.avgpool.forward(&self.features.forward(x)?)?;
        self.classifier.forward(&x.flatten(1)?)
    }
}

/// `torchvision.models.efficientnet_b0()`: 1000 classes.
pub fn efficientnet_b0(vb: VarBuilder) -> Result<EfficientNet> {
    EfficientNet::load(vb, &EfficientNetConfig::b0())
}
