//! torchvision's ResNets (`torchvision.models.resnet18` / `resnet50`), with the same `state_dict`
//! names: `conv1`, `bn1`, `layer1.0.conv1`, `layer2.0.downsample.{0,1}`, `fc`.
//!
//! Each `forward` follows torchvision's line by line, so the traced nodes come in the order PyTorch
//! runs them: the block's `relu` module is reused (one path, several nodes), the downsample branch
//! runs after `bn3`, and `out += identity` is the inline `layerX.Y.add`.

use kiln::{
    AdaptiveAvgPool2d, BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, Forward, Linear, LinearConfig, MaxPool2d, Module,
    Pool2dConfig, ReLU, Result, Sequential, Tensor, VarBuilder,
};

fn conv(vb: VarBuilder, cin: usize, cout: usize, k: usize, stride: usize) -> Result<Conv2d> {
    Conv2d::load(vb, &Conv2dConfig::new(cin, cout, k).stride(stride).padding(k / 2).bias(false))
}

fn bn(vb: VarBuilder, c: usize) -> Result<BatchNorm2d> {
    BatchNorm2d::load(vb, &BatchNorm2dConfig::new(c))
}

/// Where a block sits: its input channels, its width (`planes`) and the stride of its first conv.
#[derive(Clone, Copy, Debug)]
pub struct BlockConfig {
    pub inplanes: usize,
    pub planes: usize,
    pub stride: usize,
}

/// `downsample = Sequential(conv1x1(stride), BatchNorm2d)` when the shape of the identity changes.
fn downsample(vb: VarBuilder, c: &BlockConfig, expansion: usize) -> Result<Option<Sequential>> {
    let out = c.planes * expansion;
    if c.stride == 1 && c.inplanes == out {
        return Ok(None);
    }
    Ok(Some(Sequential::new().add(conv(vb.pp(0), c.inplanes, out, 1, c.stride)?).add(bn(vb.pp(1), out)?)))
}

/// ResNet-18/34's block: two 3x3 convs.
pub struct BasicBlock {
    conv1: Conv2d,
    bn1: BatchNorm2d,
    relu: ReLU,
    conv2: Conv2d,
    bn2: BatchNorm2d,
    downsample: Option<Sequential>,
}

impl Module for BasicBlock {
    type Config = BlockConfig;
    fn load(vb: VarBuilder, c: &BlockConfig) -> Result<Self> {
        Ok(Self {
            conv1: conv(vb.pp("conv1"), c.inplanes, c.planes, 3, c.stride)?,
            bn1: bn(vb.pp("bn1"), c.planes)?,
            relu: ReLU::load(vb.pp("relu"), &())?,
            conv2: conv(vb.pp("conv2"), c.planes, c.planes, 3, 1)?,
            bn2: bn(vb.pp("bn2"), c.planes)?,
            downsample: downsample(vb.pp("downsample"), c, 1)?,
        })
    }
}

impl Forward for BasicBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = self.relu.forward(&self.bn1.forward(&self.conv1.forward(x)?)?)?;
        let out = self.bn2.forward(&self.conv2.forward(&out)?)?;
        let identity = self.downsample.forward(x)?;
        self.relu.forward(&(&out + &identity)?)
    }
}

/// ResNet-50's block: 1x1 reduce, 3x3 (carrying the stride, torchvision's "ResNet V1.5"), 1x1
/// expand by 4.
pub struct Bottleneck {
    conv1: Conv2d,
    bn1: BatchNorm2d,
    conv2: Conv2d,
    bn2: BatchNorm2d,
    conv3: Conv2d,
    bn3: BatchNorm2d,
    relu: ReLU,
    downsample: Option<Sequential>,
}

impl Module for Bottleneck {
    type Config = BlockConfig;
    fn load(vb: VarBuilder, c: &BlockConfig) -> Result<Self> {
        let out = c.planes * 4;
        Ok(Self {
            conv1: conv(vb.pp("conv1"), c.inplanes, c.planes, 1, 1)?,
            bn1: bn(vb.pp("bn1"), c.planes)?,
            conv2: conv(vb.pp("conv2"), c.planes, c.planes, 3, c.stride)?,
            bn2: bn(vb.pp("bn2"), c.planes)?,
            conv3: conv(vb.pp("conv3"), c.planes, out, 1, 1)?,
            bn3: bn(vb.pp("bn3"), out)?,
            relu: ReLU::load(vb.pp("relu"), &())?,
            downsample: downsample(vb.pp("downsample"), c, 4)?,
        })
    }
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    Basic,
    Bottleneck,
}

impl Block {
    fn expansion(self) -> usize {
        match self {
            Block::Basic => 1,
            Block::Bottleneck => 4,
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct ResNetConfig {
    pub block: Block,
    /// Blocks per stage (`[2, 2, 2, 2]` for ResNet-18, `[3, 4, 6, 3]` for ResNet-50).
    pub layers: [usize; 4],
    /// `Some(n)`: `avgpool` + `fc` to `n` classes; `None`: a backbone ending at `layer4`.
    pub num_classes: Option<usize>,
}

/// A torchvision ResNet. Without a classifier it is a backbone (CenterNet's).
pub struct ResNet {
    conv1: Conv2d,
    bn1: BatchNorm2d,
    relu: ReLU,
    maxpool: MaxPool2d,
    layers: [Sequential; 4],
    classifier: Option<(AdaptiveAvgPool2d, Linear)>,
}

impl Module for ResNet {
    type Config = ResNetConfig;
    fn load(vb: VarBuilder, c: &ResNetConfig) -> Result<Self> {
        let mut inplanes = 64;
        let mut stage = |i: usize, planes: usize, stride: usize| -> Result<Sequential> {
            let vb = vb.pp(format!("layer{}", i + 1));
            let mut seq = Sequential::new();
            for b in 0..c.layers[i] {
                let bc = BlockConfig { inplanes, planes, stride: if b == 0 { stride } else { 1 } };
                match c.block {
                    Block::Basic => seq.push(BasicBlock::load(vb.pp(b), &bc)?),
                    Block::Bottleneck => seq.push(Bottleneck::load(vb.pp(b), &bc)?),
                }
                inplanes = planes * c.block.expansion();
            }
            Ok(seq)
        };
        let layers = [stage(0, 64, 1)?, stage(1, 128, 2)?, stage(2, 256, 2)?, stage(3, 512, 2)?];
        let classifier = match c.num_classes {
            Some(n) => Some((
                AdaptiveAvgPool2d::load(vb.pp("avgpool"), &[1, 1])?,
                Linear::load(vb.pp("fc"), &LinearConfig::new(512 * c.block.expansion(), n))?,
            )),
            None => None,
        };
        Ok(Self {
            conv1: Conv2d::load(vb.pp("conv1"), &Conv2dConfig::new(3, 64, 7).stride(2).padding(3).bias(false))?,
            bn1: bn(vb.pp("bn1"), 64)?,
            relu: ReLU::load(vb.pp("relu"), &())?,
            maxpool: MaxPool2d::load(vb.pp("maxpool"), &Pool2dConfig::new(3).stride(2).padding(1))?,
            layers,
            classifier,
        })
    }
}

impl ResNet {
    /// The stem and the four stages: `layer4`'s output (stride 32).
    pub fn features(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.maxpool.forward(&self.relu.forward(&self.bn1.forward(&self.conv1.forward(x)?)?)?)?;
        self.layers.iter().try_fold(x, |x, stage| stage.forward(&x))
    }
}

impl Forward for ResNet {
    /// Logits; for a backbone (no classifier), `features`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.features(x)?;
        match &self.classifier {
            Some((avgpool, fc)) => fc.forward(&avgpool.forward(&x)?.flatten(1)?),
            None => Ok(x),
        }
    }
}

/// `torchvision.models.resnet18()`: 1000 classes.
pub fn resnet18(vb: VarBuilder) -> Result<ResNet> {
    ResNet::load(vb, &ResNetConfig { block: Block::Basic, layers: [2, 2, 2, 2], num_classes: Some(1000) })
}

/// `torchvision.models.resnet50()`: 1000 classes.
pub fn resnet50(vb: VarBuilder) -> Result<ResNet> {
    ResNet::load(vb, &ResNetConfig { block: Block::Bottleneck, layers: [3, 4, 6, 3], num_classes: Some(1000) })
}

/// ResNet-50 without `avgpool` and `fc`: 2048 channels at stride 32.
pub fn resnet50_backbone(vb: VarBuilder) -> Result<ResNet> {
    ResNet::load(vb, &ResNetConfig { block: Block::Bottleneck, layers: [3, 4, 6, 3], num_classes: None })
}
