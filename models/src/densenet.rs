//! torchvision's DenseNets (`torchvision.models.densenet121`, and 161/169/201 by config), with the
//! same `state_dict` names: `features.conv0`, `features.denseblock1.denselayer1.norm1`,
//! `features.transition1.conv`, `features.norm5`, `classifier`.
//!
//! Each dense layer concatenates every earlier output of its block (`torch.cat(inputs, 1)`, as
//! torchvision's `bn_function`) and adds `growth_rate` channels; a transition halves the channels
//! and the resolution. Blocks and layers are named from 1 (`denseblock1`, `denselayer1`), so
//! `features` and the blocks load by hand rather than through `#[derive(Module)]`'s 0-based `Vec`s.

use kiln::{
    nn::{AvgPool2d, BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, Linear, LinearConfig, MaxPool2d},
    Forward, Module,
};
use kiln::{
    nn::{Pool2dConfig, ReLU},
    Result, Tensor, VarBuilder,
};

#[derive(Clone, Copy, Debug)]
pub struct DenseNetConfig {
    /// Channels each dense layer adds (`k` in the paper; 32, or 48 for DenseNet-161).
    pub growth_rate: usize,
    /// Dense layers per block (`[6, 12, 24, 16]` for DenseNet-121).
    pub block_config: [usize; 4],
    /// Channels of the stem conv (64, or 96 for DenseNet-161).
    pub num_init_features: usize,
    /// A layer's 1x1 bottleneck has `bn_size * growth_rate` channels.
    pub bn_size: usize,
    pub num_classes: usize,
}

impl DenseNetConfig {
    pub fn new(growth_rate: usize, block_config: [usize; 4], num_init_features: usize) -> Self {
        Self { growth_rate, block_config, num_init_features, bn_size: 4, num_classes: 1000 }
    }
    /// Channels entering block `b` (0-based) and its `features.norm5` for `b = 4`.
    fn block_input(&self, b: usize) -> usize {
        (0..b).fold(self.num_init_features, |c, i| {
            let out = c + self.block_config[i] * self.growth_rate;
            if i < 3 {
                out / 2
            } else {
                out
            }
        })
    }
}

/// A dense layer's widths: its input (all earlier features of the block) and the config.
#[derive(Clone, Copy, Debug)]
pub struct DenseLayerConfig {
    pub num_input_features: usize,
    pub growth_rate: usize,
    pub bn_size: usize,
}

/// BN-ReLU-conv1x1 to `bn_size * growth_rate`, BN-ReLU-conv3x3 to `growth_rate`.
#[derive(Module)]
#[module(config = DenseLayerConfig)]
pub struct DenseLayer {
    #[module(config = BatchNorm2dConfig::new(cfg.num_input_features))]
    norm1: BatchNorm2d,
    relu1: ReLU,
    #[module(config = Conv2dConfig::new(cfg.num_input_features, cfg.bn_size * cfg.growth_rate, 1).bias(false))]
    conv1: Conv2d,
    #[module(config = BatchNorm2dConfig::new(cfg.bn_size * cfg.growth_rate))]
    norm2: BatchNorm2d,
    relu2: ReLU,
    #[module(config = Conv2dConfig::new(cfg.bn_size * cfg.growth_rate, cfg.growth_rate, 3).padding(1).bias(false))]
    conv2: Conv2d,
}

/// `torch.cat(features, 1)`; a single tensor is passed through (PyTorch copies it, which changes
/// nothing but memory).
fn cat(features: &[Tensor]) -> Result<Tensor> {
    match features {
        [one] => Ok(one.clone()),
        _ => Tensor::cat(&features.iter().collect::<Vec<_>>(), 1),
    }
}

impl DenseLayer {
    /// The new `growth_rate` channels from all of the block's features so far.
    pub fn forward(&self, prev_features: &[Tensor]) -> Result<Tensor> {
        let concated_features = cat(prev_features)?;
        let bottleneck_output = self.conv1.forward(&self.relu1.forward(&self.norm1.forward(&concated_features)?)?)?;
        self.conv2.forward(&self.relu2.forward(&self.norm2.forward(&bottleneck_output)?)?)
    }
}

/// `num_layers` dense layers, `denselayer1` ... `denselayerN`.
pub struct DenseBlock {
    layers: Vec<DenseLayer>,
}

impl Module for DenseBlock {
    /// (number of layers, the first layer's config)
    type Config = (usize, DenseLayerConfig);
    fn load(vb: VarBuilder, (num_layers, first): &Self::Config) -> Result<Self> {
        let layers = (0..*num_layers)
            .map(|i| {
                let cfg = DenseLayerConfig { num_input_features: first.num_input_features + i * first.growth_rate, ..*first };
                DenseLayer::load(vb.pp(format!("denselayer{}", i + 1)), &cfg)
            })
            .collect::<Result<_>>()?;
        Ok(Self { layers })
    }
}

impl Forward for DenseBlock {
    /// The block's input and every layer's output, concatenated.
    fn forward(&self, init_features: &Tensor) -> Result<Tensor> {
        let mut features = vec![init_features.clone()];
        for layer in &self.layers {
            let new_features = layer.forward(&features)?;
            features.push(new_features);
        }
        cat(&features)
    }
}

/// BN-ReLU-conv1x1 to `cout`, then a 2x2 average pool.
#[derive(Module)]
#[module(config = (usize, usize))]
pub struct Transition {
    #[module(config = BatchNorm2dConfig::new(cfg.0))]
    norm: BatchNorm2d,
    relu: ReLU,
    #[module(config = Conv2dConfig::new(cfg.0, cfg.1, 1).bias(false))]
    conv: Conv2d,
    #[module(config = Pool2dConfig::new(2).stride(2))]
    pool: AvgPool2d,
}

impl Forward for Transition {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.pool.forward(&self.conv.forward(&self.relu.forward(&self.norm.forward(x)?)?)?)
    }
}

/// `features`: the stem (`conv0`, `norm0`, `relu0`, `pool0`), `denseblock1..4` with
/// `transition1..3` between them, and `norm5`.
pub struct Features {
    conv0: Conv2d,
    norm0: BatchNorm2d,
    relu0: ReLU,
    pool0: MaxPool2d,
    blocks: Vec<(DenseBlock, Option<Transition>)>,
    norm5: BatchNorm2d,
}

impl Module for Features {
    type Config = DenseNetConfig;
    fn load(vb: VarBuilder, cfg: &DenseNetConfig) -> Result<Self> {
        let blocks = (0..4)
            .map(|b| {
                let first = DenseLayerConfig { num_input_features: cfg.block_input(b), growth_rate: cfg.growth_rate, bn_size: cfg.bn_size };
                let block = DenseBlock::load(vb.pp(format!("denseblock{}", b + 1)), &(cfg.block_config[b], first))?;
                let out = cfg.block_input(b) + cfg.block_config[b] * cfg.growth_rate;
                let transition = if b < 3 { Some(Transition::load(vb.pp(format!("transition{}", b + 1)), &(out, out / 2))?) } else { None };
                Ok((block, transition))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            conv0: Conv2d::load(vb.pp("conv0"), &Conv2dConfig::new(3, cfg.num_init_features, 7).stride(2).padding(3).bias(false))?,
            norm0: BatchNorm2d::load(vb.pp("norm0"), &BatchNorm2dConfig::new(cfg.num_init_features))?,
            relu0: ReLU::load(vb.pp("relu0"), &())?,
            pool0: MaxPool2d::load(vb.pp("pool0"), &Pool2dConfig::new(3).stride(2).padding(1))?,
            blocks,
            norm5: BatchNorm2d::load(vb.pp("norm5"), &BatchNorm2dConfig::new(cfg.block_input(4)))?,
        })
    }
}

impl Forward for Features {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.pool0.forward(&self.relu0.forward(&self.norm0.forward(&self.conv0.forward(x)?)?)?)?;
        let x = self.blocks.iter().try_fold(x, |x, (block, transition)| transition.forward(&block.forward(&x)?))?;
        self.norm5.forward(&x)
    }
}

#[derive(Module)]
#[module(config = DenseNetConfig)]
pub struct DenseNet {
    #[module(config = *cfg)]
    features: Features,
    #[module(config = LinearConfig::new(cfg.block_input(4), cfg.num_classes))]
    classifier: Linear,
}

impl Forward for DenseNet {
    /// torchvision applies the last ReLU and the global pool functionally (`F.relu`,
    /// `F.adaptive_avg_pool2d`): inline ops here, named after `features.norm5`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = self.features.forward(x)?.relu()?;
        let out = out.adaptive_avg_pool2d([1, 1])?;
        self.classifier.forward(&out.flatten(1)?)
    }
}

/// `torchvision.models.densenet121()`: 1000 classes.
pub fn densenet121(vb: VarBuilder) -> Result<DenseNet> {
    DenseNet::load(vb, &DenseNetConfig::new(32, [6, 12, 24, 16], 64))
}

/// `torchvision.models.densenet161()`.
pub fn densenet161(vb: VarBuilder) -> Result<DenseNet> {
    DenseNet::load(vb, &DenseNetConfig::new(48, [6, 12, 36, 24], 96))
}

/// `torchvision.models.densenet169()`.
pub fn densenet169(vb: VarBuilder) -> Result<DenseNet> {
    DenseNet::load(vb, &DenseNetConfig::new(32, [6, 12, 32, 32], 64))
}

/// `torchvision.models.densenet201()`.
pub fn densenet201(vb: VarBuilder) -> Result<DenseNet> {
    DenseNet::load(vb, &DenseNetConfig::new(32, [6, 12, 48, 32], 64))
}
