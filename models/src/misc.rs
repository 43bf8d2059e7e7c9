//! The building blocks of `torchvision.ops.misc` that the mobile classifiers share:
//! `Conv2dNormActivation` (an `nn.Sequential` of conv `0`, BatchNorm `1` and an optional
//! activation `2`), `SqueezeExcitation` (`avgpool`, `fc1`, `fc2`, then a channel scale), and
//! `_make_divisible`, which rounds every MobileNet / EfficientNet / RegNet width.

use kiln::{
    nn::{AdaptiveAvgPool2d, BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig},
    Forward, Module, Result, Tensor,
};

/// torchvision's `_make_divisible(v, divisor)` (from the TF MobileNet code): the nearest multiple
/// of `divisor`, at least `divisor`, and never more than 10% below `v`.
pub fn make_divisible(v: f64, divisor: usize) -> usize {
    let d = divisor as f64;
    let new_v = divisor.max(((v + d / 2.0) as usize) / divisor * divisor);
    if (new_v as f64) < 0.9 * v {
        new_v + divisor
    } else {
        new_v
    }
}

/// `Conv2dNormActivation`'s arguments: its conv (bias-free by default, as torchvision's when a
/// norm follows; "same" padding `(k - 1) / 2`) and its BatchNorm's eps.
#[derive(Clone, Copy, Debug)]
pub struct ConvNormConfig {
    pub conv: Conv2dConfig,
    /// `norm_layer`'s eps: 1e-5, or 1e-3 where torchvision passes `partial(nn.BatchNorm2d, eps=0.001)`.
    pub eps: f32,
}

impl ConvNormConfig {
    /// `Conv2dNormActivation(in_channels, out_channels, kernel_size)`.
    pub fn new(in_channels: usize, out_channels: usize, kernel_size: usize) -> Self {
        let conv = Conv2dConfig::new(in_channels, out_channels, kernel_size).padding((kernel_size - 1) / 2).bias(false);
        Self { conv, eps: 1e-5 }
    }
    pub fn stride(self, stride: usize) -> Self {
        Self { conv: self.conv.stride(stride), ..self }
    }
    pub fn groups(self, groups: usize) -> Self {
        Self { conv: self.conv.groups(groups), ..self }
    }
    pub fn eps(self, eps: f32) -> Self {
        Self { eps, ..self }
    }
}

/// Conv, BatchNorm, then the activation `A`; `Identity` for torchvision's `activation_layer=None`
/// (which has no module `2`, and `Identity` loads nothing).
#[derive(Module)]
#[module(config = ConvNormConfig)]
pub struct Conv2dNormActivation<A: Module<Config = ()> + Forward> {
    #[module(name = "0", config = cfg.conv)]
    conv: Conv2d,
    #[module(name = "1", config = BatchNorm2dConfig { eps: cfg.eps, ..BatchNorm2dConfig::new(cfg.conv.out_channels) })]
    norm: BatchNorm2d,
    #[module(name = "2")]
    activation: A,
}

impl<A: Module<Config = ()> + Forward> Forward for Conv2dNormActivation<A> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.activation.forward(&self.norm.forward(&self.conv.forward(x)?)?)
    }
}

/// `SqueezeExcitation(input_channels, squeeze_channels, activation, scale_activation)`: the
/// channels' global mean through two 1x1 convs (with bias) gives a per-channel scale in [0, 1].
#[derive(Module)]
#[module(config = (usize, usize))]
pub struct SqueezeExcitation<A: Module<Config = ()> + Forward, S: Module<Config = ()> + Forward> {
    #[module(config = [1, 1])]
    avgpool: AdaptiveAvgPool2d,
    #[module(config = Conv2dConfig::new(cfg.0, cfg.1, 1))]
    fc1: Conv2d,
    #[module(config = Conv2dConfig::new(cfg.1, cfg.0, 1))]
    fc2: Conv2d,
    activation: A,
    scale_activation: S,
}

impl<A: Module<Config = ()> + Forward, S: Module<Config = ()> + Forward> Forward for SqueezeExcitation<A, S> {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let scale = self.fc1.forward(&self.avgpool.forward(input)?)?;
        let scale = self.scale_activation.forward(&self.fc2.forward(&self.activation.forward(&scale)?)?)?;
        &scale * input
    }
}

#[cfg(test)]
mod tests {
    use super::make_divisible;

    #[test]
    fn make_divisible_matches_torchvision() {
        // `_make_divisible(72 // 4, 8)` is 24, not 16: 16 is more than 10% below 18.
        assert_eq!(make_divisible(18.0, 8), 24);
        assert_eq!(make_divisible(32.0, 8), 32);
        assert_eq!(make_divisible(120.0 / 4.0, 8), 32);
        assert_eq!(make_divisible(4.0, 8), 8);
    }
}
