//! torchvision's ResNets, ResNeXts and Wide ResNets (`torchvision.models.resnet18` ... `resnet152`,
//! `resnext50_32x4d`, `wide_resnet50_2`), with the same `state_dict` names: `conv1`, `bn1`,
//! `layer1.0.conv1`, `layer2.0.downsample.{0,1}`, `fc`.
//!
//! Fields are declared in torchvision's order and each `forward` follows torchvision's line by
//! line, so the traced nodes come in the order PyTorch runs them: the block's `relu` module is
//! reused (one path, several nodes), the downsample branch runs after the last BatchNorm, and
//! `out += identity` is the inline `layerX.Y.add`.

use kiln::{
    nn::{AdaptiveAvgPool2d, BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, Linear, LinearConfig, MaxPool2d, Pool2dConfig, ReLU},
    Forward, Module, Result, Tensor, VarBuilder,
};

/// A bias-free convolution with "same" padding, as torchvision's `conv1x1` / `conv3x3`.
fn conv(cin: usize, cout: usize, k: usize, stride: usize) -> Conv2dConfig {
    Conv2dConfig::new(cin, cout, k).stride(stride).padding(k / 2).bias(false)
}

/// Where a block sits: its input channels, its width (`planes`), the stride of its first
/// spatial conv, and the ResNeXt / Wide ResNet knobs of its 3x3 conv.
#[derive(Clone, Copy, Debug)]
pub struct BlockConfig {
    pub inplanes: usize,
    pub planes: usize,
    pub stride: usize,
    /// Groups of the 3x3 conv (32 in ResNeXt-50 32x4d).
    pub groups: usize,
    /// torchvision's `base_width`: channels per group at `planes = 64` (64; 4 in 32x4d; 128 in
    /// Wide ResNet-50-2).
    pub width_per_group: usize,
}

impl BlockConfig {
    /// The bottleneck's inner width, `int(planes * (base_width / 64.0)) * groups` in torchvision.
    fn width(&self) -> usize {
        self.planes * self.width_per_group / 64 * self.groups
    }
    /// torchvision adds a projection when the identity's shape changes.
    fn needs_downsample(&self, expansion: usize) -> bool {
        self.stride != 1 || self.inplanes != self.planes * expansion
    }
    fn downsample(&self, expansion: usize) -> Conv2dConfig {
        conv(self.inplanes, self.planes * expansion, 1, self.stride)
    }
}

/// `downsample = nn.Sequential(conv1x1(stride), BatchNorm2d)`, hence the numeric names.
#[derive(Module)]
#[module(config = Conv2dConfig)]
pub struct Downsample {
    #[module(name = "0", config = *cfg)]
    conv: Conv2d,
    #[module(name = "1", config = BatchNorm2dConfig::new(cfg.out_channels))]
    bn: BatchNorm2d,
}

impl Forward for Downsample {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.bn.forward(&self.conv.forward(x)?)
    }
}

/// A residual block type: loads from a `BlockConfig`, multiplies `planes` by `EXPANSION`.
pub trait Block: Module<Config = BlockConfig> + Forward {
    const EXPANSION: usize;
}

/// ResNet-18/34's block: two 3x3 convs. It has no `groups` or `width_per_group` (torchvision
/// rejects anything but 1 and 64; here they are ignored).
#[derive(Module)]
#[module(config = BlockConfig)]
pub struct BasicBlock {
    #[module(config = conv(cfg.inplanes, cfg.planes, 3, cfg.stride))]
    conv1: Conv2d,
    #[module(config = BatchNorm2dConfig::new(cfg.planes))]
    bn1: BatchNorm2d,
    relu: ReLU,
    #[module(config = conv(cfg.planes, cfg.planes, 3, 1))]
    conv2: Conv2d,
    #[module(config = BatchNorm2dConfig::new(cfg.planes))]
    bn2: BatchNorm2d,
    #[module(when = cfg.needs_downsample(1), config = cfg.downsample(1))]
    downsample: Option<Downsample>,
}

impl Block for BasicBlock {
    const EXPANSION: usize = 1;
}

impl Forward for BasicBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = self.relu.forward(&self.bn1.forward(&self.conv1.forward(x)?)?)?;
        let out = self.bn2.forward(&self.conv2.forward(&out)?)?;
        let identity = self.downsample.forward(x)?;
        self.relu.forward(&(&out + &identity)?)
    }
}

/// ResNet-50's block: 1x1 reduce, 3x3 carrying the stride (torchvision's "ResNet V1.5") and the
/// groups, 1x1 expand by 4. Its inner width is `planes` for ResNets, wider for ResNeXt and Wide ResNet.
#[derive(Module)]
#[module(config = BlockConfig)]
pub struct Bottleneck {
    #[module(config = conv(cfg.inplanes, cfg.width(), 1, 1))]
    conv1: Conv2d,
    #[module(config = BatchNorm2dConfig::new(cfg.width()))]
    bn1: BatchNorm2d,
    #[module(config = conv(cfg.width(), cfg.width(), 3, cfg.stride).groups(cfg.groups))]
    conv2: Conv2d,
    #[module(config = BatchNorm2dConfig::new(cfg.width()))]
    bn2: BatchNorm2d,
    #[module(config = conv(cfg.width(), cfg.planes * 4, 1, 1))]
    conv3: Conv2d,
    #[module(config = BatchNorm2dConfig::new(cfg.planes * 4))]
    bn3: BatchNorm2d,
    relu: ReLU,
    #[module(when = cfg.needs_downsample(4), config = cfg.downsample(4))]
    downsample: Option<Downsample>,
}

impl Block for Bottleneck {
    const EXPANSION: usize = 4;
}

impl Forward for Bottleneck {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = self.relu.forward(&self.bn1.forward(&self.conv1.forward(x)?)?)?;
        let out = self.relu.forward(&self.bn2.forward(&self.conv2.forward(&out)?)?)?;
        let out = self.bn3.forward(&self.conv3.forward(&out)?)?;
        let identity = self.downsample.forward(x)?;
        self.relu.forward(&(&out + &identity)?)
    }
}

#[derive(Clone, Copy, Debug)]
pub struct ResNetConfig {
    /// Blocks per stage (`[2, 2, 2, 2]` for ResNet-18, `[3, 4, 6, 3]` for ResNet-50).
    pub layers: [usize; 4],
    /// `Some(n)`: `avgpool` + `fc` to `n` classes; `None`: a backbone ending at `layer4`.
    pub num_classes: Option<usize>,
    /// Groups of every bottleneck's 3x3 conv (1; 32 for ResNeXt-50 32x4d).
    pub groups: usize,
    /// Channels per group at the first stage (64; 4 for 32x4d, 128 for Wide ResNet-50-2).
    pub width_per_group: usize,
}

impl ResNetConfig {
    /// A plain ResNet (`groups = 1`, `width_per_group = 64`) with `num_classes` classes.
    pub fn new(layers: [usize; 4], num_classes: Option<usize>) -> Self {
        Self { layers, num_classes, groups: 1, width_per_group: 64 }
    }
    pub fn groups(self, groups: usize) -> Self {
        Self { groups, ..self }
    }
    pub fn width_per_group(self, width_per_group: usize) -> Self {
        Self { width_per_group, ..self }
    }
    /// Block `i` of stage `stage` (0-based): stages double the width and halve the resolution
    /// (from `layer2` on), in their first block.
    fn block(&self, stage: usize, i: usize, expansion: usize) -> BlockConfig {
        let planes = 64 << stage;
        let inplanes = match (stage, i) {
            (0, 0) => 64,
            (_, 0) => (planes / 2) * expansion,
            _ => planes * expansion,
        };
        let stride = if i == 0 && stage > 0 { 2 } else { 1 };
        BlockConfig { inplanes, planes, stride, groups: self.groups, width_per_group: self.width_per_group }
    }
    fn fc(&self, expansion: usize) -> LinearConfig {
        LinearConfig::new(512 * expansion, self.num_classes.unwrap_or_default())
    }
}

/// A torchvision ResNet over residual blocks `B`. Without a classifier it is a backbone.
#[derive(Module)]
#[module(config = ResNetConfig)]
pub struct ResNet<B: Block> {
    #[module(config = Conv2dConfig::new(3, 64, 7).stride(2).padding(3).bias(false))]
    conv1: Conv2d,
    #[module(config = BatchNorm2dConfig::new(64))]
    bn1: BatchNorm2d,
    relu: ReLU,
    #[module(config = Pool2dConfig::new(3).stride(2).padding(1))]
    maxpool: MaxPool2d,
    #[module(len = cfg.layers[0], config = cfg.block(0, i, B::EXPANSION))]
    layer1: Vec<B>,
    #[module(len = cfg.layers[1], config = cfg.block(1, i, B::EXPANSION))]
    layer2: Vec<B>,
    #[module(len = cfg.layers[2], config = cfg.block(2, i, B::EXPANSION))]
    layer3: Vec<B>,
    #[module(len = cfg.layers[3], config = cfg.block(3, i, B::EXPANSION))]
    layer4: Vec<B>,
    #[module(when = cfg.num_classes.is_some(), config = [1, 1])]
    avgpool: Option<AdaptiveAvgPool2d>,
    #[module(when = cfg.num_classes.is_some(), config = cfg.fc(B::EXPANSION))]
    fc: Option<Linear>,
}

impl<B: Block> ResNet<B> {
    /// The stem and the four stages: `layer4`'s output (stride 32, `512 * EXPANSION` channels).
    pub fn features(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.maxpool.forward(&self.relu.forward(&self.bn1.forward(&self.conv1.forward(x)?)?)?)?;
        [&self.layer1, &self.layer2, &self.layer3, &self.layer4].into_iter().flatten().try_fold(x, |x, block| block.forward(&x))
    }
}

impl<B: Block> Forward for ResNet<B> {
    /// Logits; for a backbone (no classifier), `features`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.features(x)?;
        match (&self.avgpool, &self.fc) {
            (Some(avgpool), Some(fc)) => fc.forward(&avgpool.forward(&x)?.flatten(1)?),
            _ => Ok(x),
        }
    }
}

/// ResNet-18/34: basic blocks.
pub type ResNet18 = ResNet<BasicBlock>;
/// ResNet-50/101/152, ResNeXt, Wide ResNet: bottleneck blocks.
pub type ResNet50 = ResNet<Bottleneck>;

/// `torchvision.models.resnet18()`: 1000 classes.
pub fn resnet18(vb: VarBuilder) -> Result<ResNet18> {
    ResNet::load(vb, &ResNetConfig::new([2, 2, 2, 2], Some(1000)))
}

/// `torchvision.models.resnet34()`.
pub fn resnet34(vb: VarBuilder) -> Result<ResNet18> {
    ResNet::load(vb, &ResNetConfig::new([3, 4, 6, 3], Some(1000)))
}

/// `torchvision.models.resnet50()`: 1000 classes.
pub fn resnet50(vb: VarBuilder) -> Result<ResNet50> {
    ResNet::load(vb, &ResNetConfig::new([3, 4, 6, 3], Some(1000)))
}

/// `torchvision.models.resnet101()`.
pub fn resnet101(vb: VarBuilder) -> Result<ResNet50> {
    ResNet::load(vb, &ResNetConfig::new([3, 4, 23, 3], Some(1000)))
}

/// `torchvision.models.resnet152()`.
pub fn resnet152(vb: VarBuilder) -> Result<ResNet50> {
    ResNet::load(vb, &ResNetConfig::new([3, 8, 36, 3], Some(1000)))
}

/// `torchvision.models.resnext50_32x4d()`: 32 groups of 4 channels (at the first stage).
pub fn resnext50_32x4d(vb: VarBuilder) -> Result<ResNet50> {
    ResNet::load(vb, &ResNetConfig::new([3, 4, 6, 3], Some(1000)).groups(32).width_per_group(4))
}

/// `torchvision.models.wide_resnet50_2()`: bottlenecks twice as wide inside.
pub fn wide_resnet50_2(vb: VarBuilder) -> Result<ResNet50> {
    ResNet::load(vb, &ResNetConfig::new([3, 4, 6, 3], Some(1000)).width_per_group(128))
}

/// ResNet-50 without `avgpool` and `fc`: 2048 channels at stride 32.
pub fn resnet50_backbone(vb: VarBuilder) -> Result<ResNet50> {
    ResNet::load(vb, &ResNetConfig::new([3, 4, 6, 3], None))
}
