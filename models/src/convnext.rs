//! torchvision's ConvNeXt-Tiny (`torchvision.models.convnext_tiny`), with the same `state_dict`
//! names: `features.0.0` (the 4x4 stride-4 patchify conv), `features.0.1` (its LayerNorm2d),
//! `features.1.0.block.0` (a block's depthwise 7x7), `features.1.0.layer_scale`, `features.2.0`
//! (a downsampling LayerNorm2d), `classifier.0`, `classifier.2`.
//!
//! A block runs a depthwise 7x7 conv, then, channels-last (`Permute([0, 2, 3, 1])`), LayerNorm,
//! Linear to 4x, GELU (exact), Linear back, permutes back to NCHW, scales each channel by the
//! learned `layer_scale` and adds its input (stochastic depth is the identity at inference). The
//! permutes are parameter-free modules (`block.1`, `block.6`) in torchvision: inline ops here.

use crate::sequential::SequentialLoader;
use kiln::{
    nn::{AdaptiveAvgPool2d, Conv2d, Conv2dConfig, Identity, LayerNorm, LayerNorm2d, LayerNormConfig, Linear},
    plugin::Binary,
    Forward,
};
use kiln::{
    nn::{LinearConfig, Sequential, GELU},
    Module, Param, Result, Tensor, VarBuilder,
};

/// ConvNeXt's norm layers: LayerNorm (and LayerNorm2d) with eps 1e-6.
fn norm(dim: usize) -> LayerNormConfig {
    LayerNormConfig::new(&[dim]).eps(1e-6)
}

/// `CNBlock.block`, an `nn.Sequential`: `0` depthwise conv, `1` permute, `2` LayerNorm,
/// `3` Linear, `4` GELU, `5` Linear, `6` permute.
#[derive(Module)]
#[module(config = usize)]
pub struct CNBlockLayers {
    #[module(name = "0", config = Conv2dConfig::new(*cfg, *cfg, 7).padding(3).groups(*cfg))]
    dwconv: Conv2d,
    #[module(name = "2", config = norm(*cfg))]
    norm: LayerNorm,
    #[module(name = "3", config = LinearConfig::new(*cfg, 4 * cfg))]
    pwconv1: Linear,
    #[module(name = "4", config = false)]
    act: GELU,
    #[module(name = "5", config = LinearConfig::new(4 * cfg, *cfg))]
    pwconv2: Linear,
}

impl Forward for CNBlockLayers {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.dwconv.forward(x)?.permute(&[0, 2, 3, 1])?;
        let x = self.pwconv1.forward(&self.norm.forward(&x)?)?;
        let x = self.pwconv2.forward(&self.act.forward(&x)?)?;
        x.permute(&[0, 3, 1, 2])
    }
}

/// `CNBlock(dim, layer_scale, stochastic_depth_prob)`.
pub struct CNBlock {
    path: String,
    block: CNBlockLayers,
    /// `[dim, 1, 1]`, multiplied into the block's output.
    layer_scale: Param,
    stochastic_depth: Identity,
}

impl Module for CNBlock {
    /// `dim`, the block's width.
    type Config = usize;
    fn load(vb: VarBuilder, &dim: &usize) -> Result<Self> {
        Ok(Self {
            path: vb.path().to_string(),
            block: CNBlockLayers::load(vb.pp("block"), &dim)?,
            layer_scale: vb.get(&[dim, 1, 1], "layer_scale")?,
            stochastic_depth: Identity::load(vb.pp("stochastic_depth"), &())?,
        })
    }
}

impl Forward for CNBlock {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let result = self.block.forward(input)?.binary_weight(&format!("{}.layer_scale", self.path), Binary::Mul, &self.layer_scale)?;
        &self.stochastic_depth.forward(&result)? + input
    }
}

/// `features.0`: `Conv2dNormActivation(3, C, kernel_size=4, stride=4, padding=0, bias=True)` with
/// LayerNorm2d and no activation.
#[derive(Module)]
#[module(config = usize)]
pub struct Stem {
    #[module(name = "0", config = Conv2dConfig::new(3, *cfg, 4).stride(4))]
    conv: Conv2d,
    #[module(name = "1", config = norm(*cfg))]
    norm: LayerNorm2d,
}

impl Forward for Stem {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.norm.forward(&self.conv.forward(x)?)
    }
}

/// Between stages: LayerNorm2d, then a 2x2 stride-2 conv to the next width.
#[derive(Module)]
#[module(config = (usize, usize))]
pub struct Downsample {
    #[module(name = "0", config = norm(cfg.0))]
    norm: LayerNorm2d,
    #[module(name = "1", config = Conv2dConfig::new(cfg.0, cfg.1, 2).stride(2))]
    conv: Conv2d,
}

impl Forward for Downsample {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.conv.forward(&self.norm.forward(x)?)
    }
}

/// `CNBlockConfig(input_channels, out_channels, num_layers)`: a stage, and where it downsamples to.
#[derive(Clone, Copy, Debug)]
pub struct CNBlockConfig {
    pub input_channels: usize,
    pub out_channels: Option<usize>,
    pub num_layers: usize,
}

#[derive(Clone, Debug)]
pub struct ConvNeXtConfig {
    pub block_setting: Vec<CNBlockConfig>,
    pub num_classes: usize,
}

impl ConvNeXtConfig {
    fn lastconv_output_channels(&self) -> usize {
        self.block_setting.last().map_or(0, |b| b.out_channels.unwrap_or(b.input_channels))
    }
}

/// `classifier`: LayerNorm2d (`0`), `Flatten(1)` (`1`, inline here), Linear (`2`).
#[derive(Module)]
#[module(config = (usize, usize))]
pub struct Classifier {
    #[module(name = "0", config = norm(cfg.0))]
    norm: LayerNorm2d,
    #[module(name = "2", config = LinearConfig::new(cfg.0, cfg.1))]
    fc: Linear,
}

impl Forward for Classifier {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc.forward(&self.norm.forward(x)?.flatten(1)?)
    }
}

/// `features` (stem, then stages with a downsampling layer after each but the last), `avgpool`,
/// `classifier`.
pub struct ConvNeXt {
    features: Sequential,
    avgpool: AdaptiveAvgPool2d,
    classifier: Classifier,
}

impl Module for ConvNeXt {
    type Config = ConvNeXtConfig;
    fn load(vb: VarBuilder, cfg: &ConvNeXtConfig) -> Result<Self> {
        let mut features = SequentialLoader::new(vb.pp("features"));
        features.push::<Stem>(&cfg.block_setting.first().map_or(0, |b| b.input_channels))?;
        for cnf in &cfg.block_setting {
            features.push_with(|vb| {
                let mut stage = SequentialLoader::new(vb);
                for _ in 0..cnf.num_layers {
                    stage.push::<CNBlock>(&cnf.input_channels)?;
                }
                Ok(stage.finish())
            })?;
            if let Some(out_channels) = cnf.out_channels {
                features.push::<Downsample>(&(cnf.input_channels, out_channels))?;
            }
        }
        Ok(Self {
            features: features.finish(),
            avgpool: AdaptiveAvgPool2d::load(vb.pp("avgpool"), &[1, 1])?,
            classifier: Classifier::load(vb.pp("classifier"), &(cfg.lastconv_output_channels(), cfg.num_classes))?,
        })
    }
}

impl Forward for ConvNeXt {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.classifier.forward(&self.avgpool.forward(&self.features.forward(x)?)?)
    }
}

/// `torchvision.models.convnext_tiny()`: 1000 classes.
pub fn convnext_tiny(vb: VarBuilder) -> Result<ConvNeXt> {
    let stage = |input_channels, out_channels, num_layers| CNBlockConfig { input_channels, out_channels, num_layers };
    let block_setting = vec![stage(96, Some(192), 3), stage(192, Some(384), 3), stage(384, Some(768), 9), stage(768, None, 3)];
    ConvNeXt::load(vb, &ConvNeXtConfig { block_setting, num_classes: 1000 })
}
