//! A small ResNet trained on scikit-learn's `load_digits` (`tools/train_digits.py`, which defines
//! the same module in PyTorch): the trained network the INT8/FP8 accuracy checks run on. Input
//! `[N, 3, 32, 32]` (an 8x8 digit upsampled, in [-1, 1], repeated over 3 channels), 10 logits.
//! Its trained weights are `models/weights/digits_resnet.safetensors` (`DIGITS_WEIGHTS`).

use crate::resnet::{BasicBlock, BlockConfig};
use kiln::{
    nn::{AdaptiveAvgPool2d, BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, Linear, LinearConfig, ReLU},
    Forward, Module, Result, Tensor, VarBuilder,
};

/// The committed trained weights, relative to the workspace root.
pub const DIGITS_WEIGHTS: &str = "models/weights/digits_resnet.safetensors";

/// Stage `s` (0-based): 16, 32, 64 channels, the last two halving the resolution.
fn stage(s: usize) -> BlockConfig {
    let planes = 16 << s;
    BlockConfig {
        inplanes: if s == 0 { 16 } else { planes / 2 },
        planes,
        stride: if s == 0 { 1 } else { 2 },
        groups: 1,
        width_per_group: 64,
    }
}

/// `DigitsResNet` of `tools/train_digits.py`: a 3x3 stem and one BasicBlock per stage.
#[derive(Module)]
#[module(config = usize)]
pub struct DigitsResNet {
    #[module(config = Conv2dConfig::new(3, 16, 3).padding(1).bias(false))]
    conv1: Conv2d,
    #[module(config = BatchNorm2dConfig::new(16))]
    bn1: BatchNorm2d,
    relu: ReLU,
    #[module(len = 1, config = stage(0))]
    layer1: Vec<BasicBlock>,
    #[module(len = 1, config = stage(1))]
    layer2: Vec<BasicBlock>,
    #[module(len = 1, config = stage(2))]
    layer3: Vec<BasicBlock>,
    #[module(config = [1, 1])]
    avgpool: AdaptiveAvgPool2d,
    #[module(config = LinearConfig::new(64, *cfg))]
    fc: Linear,
}

impl Forward for DigitsResNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.relu.forward(&self.bn1.forward(&self.conv1.forward(x)?)?)?;
        let x = [&self.layer1, &self.layer2, &self.layer3].into_iter().flatten().try_fold(x, |x, block| block.forward(&x))?;
        self.fc.forward(&self.avgpool.forward(&x)?.flatten(1)?)
    }
}

/// The digits ResNet with 10 classes.
pub fn digits_resnet(vb: VarBuilder) -> Result<DigitsResNet> {
    DigitsResNet::load(vb, &10)
}
