//! torchvision's GoogLeNet (Inception v1, `torchvision.models.googlenet`) on its inference path,
//! with the same `state_dict` names: `conv1.conv`, `conv1.bn`, `inception3a.branch2.1.conv`,
//! `fc`.
//!
//! As built with `aux_logits=False, transform_input=False` (the auxiliary classifiers only run in
//! training). torchvision's `BasicConv2d` uses BatchNorm eps = 0.001, and its "5x5" branch is a
//! 3x3 conv (kept from the original port for its pretrained weights).

use kiln::{
    nn::{AdaptiveAvgPool2d, BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, Dropout, Linear, LinearConfig},
    Forward,
};
use kiln::{
    nn::{MaxPool2d, Pool2dConfig},
    Module, Result, Tensor, VarBuilder,
};

/// Conv (no bias) + BatchNorm (eps 0.001) + ReLU; the ReLU is functional (`F.relu`), so it is the
/// inline `<path>.bn.relu`.
#[derive(Module)]
#[module(config = Conv2dConfig)]
pub struct BasicConv2d {
    #[module(config = cfg.bias(false))]
    conv: Conv2d,
    #[module(config = BatchNorm2dConfig { eps: 0.001, ..BatchNorm2dConfig::new(cfg.out_channels) })]
    bn: BatchNorm2d,
}

impl Forward for BasicConv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.bn.forward(&self.conv.forward(x)?)?.relu()
    }
}

/// `BasicConv2d(cin, cout, kernel_size=k, padding=k / 2)`.
fn basic(cin: usize, cout: usize, k: usize) -> Conv2dConfig {
    Conv2dConfig::new(cin, cout, k).padding(k / 2)
}

/// An Inception module's widths, in torchvision's argument order.
#[derive(Clone, Copy, Debug)]
pub struct InceptionConfig {
    pub in_channels: usize,
    pub ch1x1: usize,
    pub ch3x3red: usize,
    pub ch3x3: usize,
    pub ch5x5red: usize,
    pub ch5x5: usize,
    pub pool_proj: usize,
}

const fn inception(
    in_channels: usize,
    ch1x1: usize,
    ch3x3red: usize,
    ch3x3: usize,
    ch5x5red: usize,
    ch5x5: usize,
    pool_proj: usize,
) -> InceptionConfig {
    InceptionConfig { in_channels, ch1x1, ch3x3red, ch3x3, ch5x5red, ch5x5, pool_proj }
}

/// A 1x1 reduction then a 3x3 conv: `branch2` and `branch3` (`nn.Sequential`, so `0` and `1`).
#[derive(Module)]
#[module(config = (usize, usize, usize))]
pub struct ReduceConv {
    #[module(name = "0", config = basic(cfg.0, cfg.1, 1))]
    reduce: BasicConv2d,
    #[module(name = "1", config = basic(cfg.1, cfg.2, 3))]
    conv: BasicConv2d,
}

impl Forward for ReduceConv {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.conv.forward(&self.reduce.forward(x)?)
    }
}

/// `branch4`: a 3x3 stride-1 max-pool then a 1x1 projection.
#[derive(Module)]
#[module(config = (usize, usize))]
pub struct PoolProj {
    #[module(name = "0", config = Pool2dConfig::new(3).stride(1).padding(1).ceil_mode(true))]
    pool: MaxPool2d,
    #[module(name = "1", config = basic(cfg.0, cfg.1, 1))]
    proj: BasicConv2d,
}

impl Forward for PoolProj {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.proj.forward(&self.pool.forward(x)?)
    }
}

/// Four branches side by side, concatenated: 1x1; 1x1 → 3x3; 1x1 → 3x3 ("5x5"); pool → 1x1.
#[derive(Module)]
#[module(config = InceptionConfig)]
pub struct Inception {
    #[module(config = basic(cfg.in_channels, cfg.ch1x1, 1))]
    branch1: BasicConv2d,
    #[module(config = (cfg.in_channels, cfg.ch3x3red, cfg.ch3x3))]
    branch2: ReduceConv,
    #[module(config = (cfg.in_channels, cfg.ch5x5red, cfg.ch5x5))]
    branch3: ReduceConv,
    #[module(config = (cfg.in_channels, cfg.pool_proj))]
    branch4: PoolProj,
}

impl Forward for Inception {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let branch1 = self.branch1.forward(x)?;
        let branch2 = self.branch2.forward(x)?;
        let branch3 = self.branch3.forward(x)?;
        let branch4 = self.branch4.forward(x)?;
        Tensor::cat(&[&branch1, &branch2, &branch3, &branch4], 1)
    }
}

#[derive(Clone, Copy, Debug)]
pub struct GoogLeNetConfig {
    pub num_classes: usize,
    /// Dropout before `fc` (a no-op at inference).
    pub dropout: f32,
}

impl Default for GoogLeNetConfig {
    fn default() -> Self {
        Self { num_classes: 1000, dropout: 0.2 }
    }
}

/// `MaxPool2d(k, stride=2, ceil_mode=True)`, between the stages.
fn pool(k: usize) -> Pool2dConfig {
    Pool2dConfig::new(k).stride(2).ceil_mode(true)
}

#[derive(Module)]
#[module(config = GoogLeNetConfig)]
pub struct GoogLeNet {
    #[module(config = Conv2dConfig::new(3, 64, 7).stride(2).padding(3))]
    conv1: BasicConv2d,
    #[module(config = pool(3))]
    maxpool1: MaxPool2d,
    #[module(config = basic(64, 64, 1))]
    conv2: BasicConv2d,
    #[module(config = basic(64, 192, 3))]
    conv3: BasicConv2d,
    #[module(config = pool(3))]
    maxpool2: MaxPool2d,
    #[module(config = inception(192, 64, 96, 128, 16, 32, 32))]
    inception3a: Inception,
    #[module(config = inception(256, 128, 128, 192, 32, 96, 64))]
    inception3b: Inception,
    #[module(config = pool(3))]
    maxpool3: MaxPool2d,
    #[module(config = inception(480, 192, 96, 208, 16, 48, 64))]
    inception4a: Inception,
    #[module(config = inception(512, 160, 112, 224, 24, 64, 64))]
    inception4b: Inception,
    #[module(config = inception(512, 128, 128, 256, 24, 64, 64))]
    inception4c: Inception,
    #[module(config = inception(512, 112, 144, 288, 32, 64, 64))]
    inception4d: Inception,
    #[module(config = inception(528, 256, 160, 320, 32, 128, 128))]
    inception4e: Inception,
    #[module(config = pool(2))]
    maxpool4: MaxPool2d,
    #[module(config = inception(832, 256, 160, 320, 32, 128, 128))]
    inception5a: Inception,
    #[module(config = inception(832, 384, 192, 384, 48, 128, 128))]
    inception5b: Inception,
    #[module(config = [1, 1])]
    avgpool: AdaptiveAvgPool2d,
    #[module(config = cfg.dropout)]
    dropout: Dropout,
    #[module(config = LinearConfig::new(1024, cfg.num_classes))]
    fc: Linear,
}

impl Forward for GoogLeNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.maxpool1.forward(&self.conv1.forward(x)?)?;
        let x = self.maxpool2.forward(&self.conv3.forward(&self.conv2.forward(&x)?)?)?;
        let x = self.maxpool3.forward(&self.inception3b.forward(&self.inception3a.forward(&x)?)?)?;
        let x = [&self.inception4a, &self.inception4b, &self.inception4c, &self.inception4d, &self.inception4e]
            .into_iter()
            .try_fold(x, |x, m| m.forward(&x))?;
        let x = self.maxpool4.forward(&x)?;
        let x = self.inception5b.forward(&self.inception5a.forward(&x)?)?;
        let x = self.avgpool.forward(&x)?.flatten(1)?;
        self.fc.forward(&self.dropout.forward(&x)?)
    }
}

/// `torchvision.models.googlenet(aux_logits=False)`: 1000 classes.
pub fn googlenet(vb: VarBuilder) -> Result<GoogLeNet> {
    GoogLeNet::load(vb, &GoogLeNetConfig::default())
}
