//! torchvision's MobileNetV3-Large (`torchvision.models.mobilenet_v3_large`), with the same
//! `state_dict` names: `features.0.0`, `features.4.block.2.fc1` (a squeeze-excitation),
//! `features.16.1`, `classifier.0`, `classifier.3`.
//!
//! Each block expands with a 1x1 conv (when the width changes), filters depthwise, optionally
//! squeezes and excites (ReLU, then Hardsigmoid), and projects linearly; ReLU ("RE") or Hardswish
//! ("HS") per block. Every BatchNorm has eps 0.001 (`partial(nn.BatchNorm2d, eps=0.001)`).

use crate::misc::{make_divisible, Conv2dNormActivation, ConvNormConfig, SqueezeExcitation};
use crate::sequential::SequentialLoader;
use kiln::{nn::Sequential, Tensor, VarBuilder};
use kiln::{
    nn::{AdaptiveAvgPool2d, Dropout, Hardsigmoid, Hardswish, Identity, Linear, LinearConfig, ReLU},
    Forward, Module, Result,
};

/// MobileNetV3's `norm_layer`: BatchNorm with eps 0.001.
const EPS: f32 = 1e-3;

/// `InvertedResidualConfig(input_channels, kernel, expanded_channels, out_channels, use_se,
/// activation, stride, dilation)` at width multiplier 1 (all widths are already multiples of 8).
#[derive(Clone, Copy, Debug)]
pub struct InvertedResidualConfig {
    pub input_channels: usize,
    pub kernel: usize,
    pub expanded_channels: usize,
    pub out_channels: usize,
    pub use_se: bool,
    /// Hardswish ("HS") rather than ReLU ("RE").
    pub use_hs: bool,
    pub stride: usize,
}

const fn bneck(
    input_channels: usize,
    kernel: usize,
    expanded_channels: usize,
    out_channels: usize,
    use_se: bool,
    use_hs: bool,
    stride: usize,
) -> InvertedResidualConfig {
    InvertedResidualConfig { input_channels, kernel, expanded_channels, out_channels, use_se, use_hs, stride }
}

/// The blocks `block`'s layers load from, then the residual add when the shape is kept.
pub struct InvertedResidual {
    block: Sequential,
    use_res_connect: bool,
}

/// Pushes a `Conv2dNormActivation` with ReLU or Hardswish.
fn push_conv(layers: &mut SequentialLoader, cfg: ConvNormConfig, use_hs: bool) -> Result<()> {
    if use_hs {
        layers.push::<Conv2dNormActivation<Hardswish>>(&cfg)?;
    } else {
        layers.push::<Conv2dNormActivation<ReLU>>(&cfg)?;
    }
    Ok(())
}

impl Module for InvertedResidual {
    type Config = InvertedResidualConfig;
    fn load(vb: VarBuilder, cnf: &InvertedResidualConfig) -> Result<Self> {
        let mut layers = SequentialLoader::new(vb.pp("block"));
        if cnf.expanded_channels != cnf.input_channels {
            push_conv(&mut layers, ConvNormConfig::new(cnf.input_channels, cnf.expanded_channels, 1).eps(EPS), cnf.use_hs)?;
        }
        let depthwise = ConvNormConfig::new(cnf.expanded_channels, cnf.expanded_channels, cnf.kernel)
            .stride(cnf.stride)
            .groups(cnf.expanded_channels)
            .eps(EPS);
        push_conv(&mut layers, depthwise, cnf.use_hs)?;
        if cnf.use_se {
            let squeeze_channels = make_divisible((cnf.expanded_channels / 4) as f64, 8);
            layers.push::<SqueezeExcitation<ReLU, Hardsigmoid>>(&(cnf.expanded_channels, squeeze_channels))?;
        }
        layers.push::<Conv2dNormActivation<Identity>>(&ConvNormConfig::new(cnf.expanded_channels, cnf.out_channels, 1).eps(EPS))?;
        Ok(Self { block: layers.finish(), use_res_connect: cnf.stride == 1 && cnf.input_channels == cnf.out_channels })
    }
}

impl Forward for InvertedResidual {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let result = self.block.forward(input)?;
        if self.use_res_connect {
            &result + input
        } else {
            Ok(result)
        }
    }
}

#[derive(Clone, Debug)]
pub struct MobileNetV3Config {
    pub inverted_residual_setting: Vec<InvertedResidualConfig>,
    /// Width of the classifier's hidden layer.
    pub last_channel: usize,
    pub num_classes: usize,
    pub dropout: f32,
}

impl MobileNetV3Config {
    /// `_mobilenet_v3_conf("mobilenet_v3_large")`.
    pub fn large() -> Self {
        let (f, t) = (false, true);
        let inverted_residual_setting = vec![
            bneck(16, 3, 16, 16, f, f, 1),
            bneck(16, 3, 64, 24, f, f, 2),
            bneck(24, 3, 72, 24, f, f, 1),
            bneck(24, 5, 72, 40, t, f, 2),
            bneck(40, 5, 120, 40, t, f, 1),
            bneck(40, 5, 120, 40, t, f, 1),
            bneck(40, 3, 240, 80, f, t, 2),
            bneck(80, 3, 200, 80, f, t, 1),
            bneck(80, 3, 184, 80, f, t, 1),
            bneck(80, 3, 184, 80, f, t, 1),
            bneck(80, 3, 480, 112, t, t, 1),
            bneck(112, 3, 672, 112, t, t, 1),
            bneck(112, 5, 672, 160, t, t, 2),
            bneck(160, 5, 960, 160, t, t, 1),
            bneck(160, 5, 960, 160, t, t, 1),
        ];
        Self { inverted_residual_setting, last_channel: 1280, num_classes: 1000, dropout: 0.2 }
    }
    fn lastconv_output_channels(&self) -> usize {
        6 * self.inverted_residual_setting.last().map_or(0, |c| c.out_channels)
    }
}

/// `features` (stem, the blocks, a 1x1 conv to 6x the last width), `avgpool`, and `classifier`
/// (linear, Hardswish, dropout, linear).
pub struct MobileNetV3 {
    features: Sequential,
    avgpool: AdaptiveAvgPool2d,
    classifier: Sequential,
}

impl Module for MobileNetV3 {
    type Config = MobileNetV3Config;
    fn load(vb: VarBuilder, cfg: &MobileNetV3Config) -> Result<Self> {
        let setting = &cfg.inverted_residual_setting;
        let firstconv_output_channels = setting.first().map_or(0, |c| c.input_channels);
        let mut features = SequentialLoader::new(vb.pp("features"));
        features.push::<Conv2dNormActivation<Hardswish>>(&ConvNormConfig::new(3, firstconv_output_channels, 3).stride(2).eps(EPS))?;
        for cnf in setting {
            features.push::<InvertedResidual>(cnf)?;
        }
        let lastconv_input_channels = setting.last().map_or(0, |c| c.out_channels);
        let last = ConvNormConfig::new(lastconv_input_channels, cfg.lastconv_output_channels(), 1).eps(EPS);
        features.push::<Conv2dNormActivation<Hardswish>>(&last)?;
        let mut classifier = SequentialLoader::new(vb.pp("classifier"));
        classifier
            .push::<Linear>(&LinearConfig::new(cfg.lastconv_output_channels(), cfg.last_channel))?
            .push::<Hardswish>(&())?
            .push::<Dropout>(&cfg.dropout)?
            .push::<Linear>(&LinearConfig::new(cfg.last_channel, cfg.num_classes))?;
        Ok(Self {
            features: features.finish(),
            avgpool: AdaptiveAvgPool2d::load(vb.pp("avgpool"), &[1, 1])?,
            classifier: classifier.finish(),
        })
    }
}

impl Forward for MobileNetV3 {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.avgpool.forward(&self.features.forward(x)?)?;
        self.classifier.forward(&x.flatten(1)?)
    }
}

/// `torchvision.models.mobilenet_v3_large()`: 1000 classes.
pub fn mobilenet_v3_large(vb: VarBuilder) -> Result<MobileNetV3> {
    MobileNetV3::load(vb, &MobileNetV3Config::large())
}
