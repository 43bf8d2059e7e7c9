//! torchvision's ShuffleNetV2 (`torchvision.models.shufflenet_v2_x1_0`), with the same
//! `state_dict` names: `conv1.0`, `stage2.0.branch1.0` (a downsampling block's depthwise conv),
//! `stage3.1.branch2.5`, `conv5.1`, `fc`.
//!
//! A stride-1 block splits the channels in two (`x.chunk(2, dim=1)`), passes one half through and
//! transforms the other (`branch2`); a stride-2 block feeds the whole input to both branches. The
//! halves are concatenated and their channels interleaved (`channel_shuffle`: view as groups,
//! transpose, view back).

use crate::misc::{Conv2dNormActivation, ConvNormConfig};
use kiln::{nn::ReLU, Result, Tensor, VarBuilder};
use kiln::{
    nn::{BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, Linear, LinearConfig, MaxPool2d, Pool2dConfig},
    Forward, Module,
};

/// `channel_shuffle(x, groups)`: channel `g * per_group + i` moves to `i * groups + g`.
pub fn channel_shuffle(x: &Tensor, groups: usize) -> Result<Tensor> {
    let [batchsize, num_channels, height, width] = x.shape().try_into().map_err(|_| kiln::Error::Shape {
        path: x.scope_path("channel_shuffle"),
        op: "reshape".into(),
        reason: "channel_shuffle needs an NCHW input".into(),
        got: vec![x.shape().to_vec()],
    })?;
    let channels_per_group = num_channels / groups;
    let x = x.view(&[batchsize, groups, channels_per_group, height, width].map(|d| d as isize))?;
    let x = x.transpose(1, 2)?.contiguous()?;
    x.view(&[batchsize, num_channels, height, width].map(|d| d as isize))
}

/// `InvertedResidual.depthwise_conv(i, o, 3, stride, padding=1)`: bias-free, `groups = i`.
fn depthwise_conv(i: usize, o: usize, stride: usize) -> Conv2dConfig {
    Conv2dConfig::new(i, o, 3).stride(stride).padding(1).groups(i).bias(false)
}

fn conv1x1(cin: usize, cout: usize) -> Conv2dConfig {
    Conv2dConfig::new(cin, cout, 1).bias(false)
}

/// `InvertedResidual(inp, oup, stride)`.
#[derive(Clone, Copy, Debug)]
pub struct InvertedResidualConfig {
    pub inp: usize,
    pub oup: usize,
    pub stride: usize,
}

impl InvertedResidualConfig {
    fn branch_features(&self) -> usize {
        self.oup / 2
    }
}

/// A downsampling block's `branch1`: depthwise 3x3 + BN, then 1x1 + BN + ReLU.
#[derive(Module)]
#[module(config = InvertedResidualConfig)]
pub struct Branch1 {
    #[module(name = "0", config = depthwise_conv(cfg.inp, cfg.inp, cfg.stride))]
    depthwise: Conv2d,
    #[module(name = "1", config = BatchNorm2dConfig::new(cfg.inp))]
    bn1: BatchNorm2d,
    #[module(name = "2", config = conv1x1(cfg.inp, cfg.branch_features()))]
    pointwise: Conv2d,
    #[module(name = "3", config = BatchNorm2dConfig::new(cfg.branch_features()))]
    bn2: BatchNorm2d,
    #[module(name = "4")]
    relu: ReLU,
}

impl Forward for Branch1 {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.bn1.forward(&self.depthwise.forward(x)?)?;
        self.relu.forward(&self.bn2.forward(&self.pointwise.forward(&x)?)?)
    }
}

/// `branch2`: 1x1 + BN + ReLU, depthwise 3x3 + BN, 1x1 + BN + ReLU. In a stride-1 block it sees
/// half the channels.
#[derive(Module)]
#[module(config = InvertedResidualConfig)]
pub struct Branch2 {
    #[module(name = "0", config = conv1x1(if cfg.stride > 1 { cfg.inp } else { cfg.branch_features() }, cfg.branch_features()))]
    conv1: Conv2d,
    #[module(name = "1", config = BatchNorm2dConfig::new(cfg.branch_features()))]
    bn1: BatchNorm2d,
    #[module(name = "2")]
    relu1: ReLU,
    #[module(name = "3", config = depthwise_conv(cfg.branch_features(), cfg.branch_features(), cfg.stride))]
    depthwise: Conv2d,
    #[module(name = "4", config = BatchNorm2dConfig::new(cfg.branch_features()))]
    bn2: BatchNorm2d,
    #[module(name = "5", config = conv1x1(cfg.branch_features(), cfg.branch_features()))]
    conv2: Conv2d,
    #[module(name = "6", config = BatchNorm2dConfig::new(cfg.branch_features()))]
    bn3: BatchNorm2d,
    #[module(name = "7")]
    relu2: ReLU,
}

impl Forward for Branch2 {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.relu1.forward(&self.bn1.forward(&self.conv1.forward(x)?)?)?;
        let x = self.bn2.forward(&self.depthwise.forward(&x)?)?;
        self.relu2.forward(&self.bn3.forward(&self.conv2.forward(&x)?)?)
    }
}

/// A ShuffleNetV2 unit; `branch1` is an empty `nn.Sequential` (no keys) at stride 1.
#[derive(Module)]
#[module(config = InvertedResidualConfig)]
pub struct InvertedResidual {
    #[module(when = cfg.stride > 1, config = *cfg)]
    branch1: Option<Branch1>,
    #[module(config = *cfg)]
    branch2: Branch2,
}

impl Forward for InvertedResidual {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = match &self.branch1 {
            None => {
                let halves = x.chunk(2, 1)?;
                Tensor::cat(&[&halves[0], &self.branch2.forward(&halves[1])?], 1)?
            }
            Some(branch1) => Tensor::cat(&[&branch1.forward(x)?, &self.branch2.forward(x)?], 1)?,
        };
        channel_shuffle(&out, 2)
    }
}

#[derive(Clone, Copy, Debug)]
pub struct ShuffleNetV2Config {
    /// Blocks in `stage2`, `stage3`, `stage4`.
    pub stages_repeats: [usize; 3],
    /// Widths of `conv1`, the three stages and `conv5`.
    pub stages_out_channels: [usize; 5],
    pub num_classes: usize,
}

impl ShuffleNetV2Config {
    /// Block `i` of stage `s` (0 for `stage2`): the first halves the resolution.
    fn block(&self, s: usize, i: usize) -> InvertedResidualConfig {
        let oup = self.stages_out_channels[s + 1];
        match i {
            0 => InvertedResidualConfig { inp: self.stages_out_channels[s], oup, stride: 2 },
            _ => InvertedResidualConfig { inp: oup, oup, stride: 1 },
        }
    }
}

/// `conv1` and `conv5` are `nn.Sequential(Conv2d(bias=False), BatchNorm2d, ReLU)`: the keys of a
/// `Conv2dNormActivation`.
#[derive(Module)]
#[module(config = ShuffleNetV2Config)]
pub struct ShuffleNetV2 {
    #[module(config = ConvNormConfig::new(3, cfg.stages_out_channels[0], 3).stride(2))]
    conv1: Conv2dNormActivation<ReLU>,
    #[module(config = Pool2dConfig::new(3).stride(2).padding(1))]
    maxpool: MaxPool2d,
    #[module(len = cfg.stages_repeats[0], config = cfg.block(0, i))]
    stage2: Vec<InvertedResidual>,
    #[module(len = cfg.stages_repeats[1], config = cfg.block(1, i))]
    stage3: Vec<InvertedResidual>,
    #[module(len = cfg.stages_repeats[2], config = cfg.block(2, i))]
    stage4: Vec<InvertedResidual>,
    #[module(config = ConvNormConfig::new(cfg.stages_out_channels[3], cfg.stages_out_channels[4], 1))]
    conv5: Conv2dNormActivation<ReLU>,
    #[module(config = LinearConfig::new(cfg.stages_out_channels[4], cfg.num_classes))]
    fc: Linear,
}

impl Forward for ShuffleNetV2 {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.maxpool.forward(&self.conv1.forward(x)?)?;
        let x = [&self.stage2, &self.stage3, &self.stage4].into_iter().flatten().try_fold(x, |x, block| block.forward(&x))?;
        let x = self.conv5.forward(&x)?.mean(&[2, 3], false)?; // globalpool
        self.fc.forward(&x)
    }
}

/// `torchvision.models.shufflenet_v2_x1_0()`: 1000 classes.
pub fn shufflenet_v2_x1_0(vb: VarBuilder) -> Result<ShuffleNetV2> {
    ShuffleNetV2::load(
        vb,
        &ShuffleNetV2Config { stages_repeats: [4, 8, 4], stages_out_channels: [24, 116, 232, 464, 1024], num_classes: 1000 },
    )
}
