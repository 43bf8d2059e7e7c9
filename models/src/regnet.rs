//! torchvision's RegNetY-400MF (`torchvision.models.regnet_y_400mf`), with the same `state_dict`
//! names: `stem.0`, `trunk_output.block2.block2-0.proj.0`, `trunk_output.block3.block3-1.f.b.0`
//! (the grouped 3x3), `trunk_output.block4.block4-5.f.se.fc1`, `fc`.
//!
//! The stage widths and depths are not written down but generated, as torchvision's
//! `BlockParams.from_init_params` does: a linear width ramp `w_0 + w_a * i` quantised in log
//! space (base `w_m`) to multiples of 8, consecutive equal widths making one stage. Each block is
//! a residual bottleneck: 1x1 (`a`), grouped 3x3 (`b`, `group_width` channels per group), a
//! squeeze-excitation (`se`) and a linear 1x1 (`c`), plus a projection (`proj`) where the shape
//! changes.

use crate::misc::{make_divisible, Conv2dNormActivation, ConvNormConfig, SqueezeExcitation};
use kiln::{
    nn::{AdaptiveAvgPool2d, Identity, Linear, LinearConfig, ReLU, Sigmoid},
    Forward, Module, Result, Tensor, VarBuilder,
};

/// Per-stage settings, as torchvision's `BlockParams`.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockParams {
    pub depths: Vec<usize>,
    pub widths: Vec<usize>,
    pub group_widths: Vec<usize>,
    pub bottleneck_multipliers: Vec<f64>,
    pub strides: Vec<usize>,
    pub se_ratio: Option<f64>,
}

impl BlockParams {
    /// `BlockParams.from_init_params(depth, w_0, w_a, w_m, group_width, se_ratio=...)` with
    /// bottleneck multiplier 1.
    pub fn from_init_params(depth: usize, w_0: usize, w_a: f64, w_m: f64, group_width: usize, se_ratio: Option<f64>) -> Self {
        const QUANT: f64 = 8.0;
        let w_0f = w_0 as f64;
        // Each block's width: the ramp, snapped to w_0 * w_m^k, then to a multiple of 8.
        let block_widths: Vec<usize> = (0..depth)
            .map(|i| {
                let widths_cont = i as f64 * w_a + w_0f;
                let block_capacity = ((widths_cont / w_0f).ln() / w_m.ln()).round();
                ((w_0f * w_m.powf(block_capacity) / QUANT).round() * QUANT) as usize
            })
            .collect();
        // A stage starts wherever the width changes.
        let mut stage_widths: Vec<usize> = Vec::new();
        let mut stage_depths: Vec<usize> = Vec::new();
        for &w in &block_widths {
            match stage_widths.last() {
                Some(&last) if last == w => *stage_depths.last_mut().expect("a stage per width") += 1,
                _ => {
                    stage_widths.push(w);
                    stage_depths.push(1);
                }
            }
        }
        let num_stages = stage_widths.len();
        let bottleneck_multipliers = vec![1.0; num_stages];
        let (widths, group_widths) =
            Self::adjust_widths_groups_compatibilty(&stage_widths, &bottleneck_multipliers, &vec![group_width; num_stages]);
        Self { depths: stage_depths, widths, group_widths, bottleneck_multipliers, strides: vec![2; num_stages], se_ratio }
    }

    /// Makes each stage's bottleneck width a multiple of its group width (shrinking the group
    /// width to the bottleneck width if needed).
    fn adjust_widths_groups_compatibilty(
        stage_widths: &[usize],
        bottleneck_ratios: &[f64],
        group_widths: &[usize],
    ) -> (Vec<usize>, Vec<usize>) {
        let widths: Vec<usize> = stage_widths.iter().zip(bottleneck_ratios).map(|(&w, b)| (w as f64 * b) as usize).collect();
        let group_widths_min: Vec<usize> = group_widths.iter().zip(&widths).map(|(&g, &w_bot)| g.min(w_bot)).collect();
        let ws_bot = widths.iter().zip(&group_widths_min).map(|(&w_bot, &g)| make_divisible(w_bot as f64, g));
        let stage_widths = ws_bot.zip(bottleneck_ratios).map(|(w_bot, b)| (w_bot as f64 / b) as usize).collect();
        (stage_widths, group_widths_min)
    }
}

/// `ResBottleneckBlock(width_in, width_out, stride, ..., group_width, bottleneck_multiplier, se_ratio)`.
#[derive(Clone, Copy, Debug)]
pub struct BlockConfig {
    pub width_in: usize,
    pub width_out: usize,
    pub stride: usize,
    pub group_width: usize,
    pub bottleneck_multiplier: f64,
    pub se_ratio: Option<f64>,
}

impl BlockConfig {
    /// The bottleneck width `w_b`.
    fn w_b(&self) -> usize {
        (self.width_out as f64 * self.bottleneck_multiplier).round_ties_even() as usize
    }
    /// The squeeze width: `se_ratio` of the block's input width (not of `w_b`).
    fn width_se_out(&self) -> usize {
        self.se_ratio.map_or(0, |r| (r * self.width_in as f64).round_ties_even() as usize)
    }
}

/// `f`: the `a`, `b`, `se`, `c` layers (an `nn.Sequential` over an `OrderedDict`).
#[derive(Module)]
#[module(config = BlockConfig)]
pub struct BottleneckTransform {
    #[module(config = ConvNormConfig::new(cfg.width_in, cfg.w_b(), 1))]
    a: Conv2dNormActivation<ReLU>,
    #[module(config = ConvNormConfig::new(cfg.w_b(), cfg.w_b(), 3).stride(cfg.stride).groups(cfg.w_b() / cfg.group_width))]
    b: Conv2dNormActivation<ReLU>,
    #[module(when = cfg.se_ratio.is_some_and(|r| r > 0.0), config = (cfg.w_b(), cfg.width_se_out()))]
    se: Option<SqueezeExcitation<ReLU, Sigmoid>>,
    #[module(config = ConvNormConfig::new(cfg.w_b(), cfg.width_out, 1))]
    c: Conv2dNormActivation<Identity>,
}

impl Forward for BottleneckTransform {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.se.forward(&self.b.forward(&self.a.forward(x)?)?)?;
        self.c.forward(&x)
    }
}

#[derive(Module)]
#[module(config = BlockConfig)]
pub struct ResBottleneckBlock {
    #[module(when = cfg.width_in != cfg.width_out || cfg.stride != 1, config = ConvNormConfig::new(cfg.width_in, cfg.width_out, 1).stride(cfg.stride))]
    proj: Option<Conv2dNormActivation<Identity>>,
    #[module(config = *cfg)]
    f: BottleneckTransform,
    activation: ReLU,
}

impl Forward for ResBottleneckBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = match &self.proj {
            Some(proj) => (&proj.forward(x)? + &self.f.forward(x)?)?,
            None => (x + &self.f.forward(x)?)?,
        };
        self.activation.forward(&x)
    }
}

/// `AnyStage`: `depth` blocks named `block{stage_index}-{i}`, the first carrying the stride.
pub struct AnyStage {
    blocks: Vec<ResBottleneckBlock>,
}

impl Module for AnyStage {
    /// (stage index from 1, depth, the first block's config)
    type Config = (usize, usize, BlockConfig);
    fn load(vb: VarBuilder, &(stage_index, depth, first): &Self::Config) -> Result<Self> {
        let blocks = (0..depth)
            .map(|i| {
                let cfg = if i == 0 { first } else { BlockConfig { width_in: first.width_out, stride: 1, ..first } };
                ResBottleneckBlock::load(vb.pp(format!("block{stage_index}-{i}")), &cfg)
            })
            .collect::<Result<_>>()?;
        Ok(Self { blocks })
    }
}

impl Forward for AnyStage {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.blocks.iter().try_fold(x.clone(), |x, block| block.forward(&x))
    }
}

#[derive(Clone, Debug)]
pub struct RegNetConfig {
    pub block_params: BlockParams,
    pub num_classes: usize,
    pub stem_width: usize,
}

impl RegNetConfig {
    /// The last stage's width, which `fc` reads.
    fn trunk_width(&self) -> usize {
        self.block_params.widths.last().copied().unwrap_or(self.stem_width)
    }
}

/// `trunk_output`: the stages `block1` ... `blockN`.
pub struct TrunkOutput {
    stages: Vec<AnyStage>,
}

impl Module for TrunkOutput {
    type Config = RegNetConfig;
    fn load(vb: VarBuilder, cfg: &RegNetConfig) -> Result<Self> {
        let p = &cfg.block_params;
        let mut current_width = cfg.stem_width;
        let mut stages = Vec::with_capacity(p.widths.len());
        for i in 0..p.widths.len() {
            let first = BlockConfig {
                width_in: current_width,
                width_out: p.widths[i],
                stride: p.strides[i],
                group_width: p.group_widths[i],
                bottleneck_multiplier: p.bottleneck_multipliers[i],
                se_ratio: p.se_ratio,
            };
            stages.push(AnyStage::load(vb.pp(format!("block{}", i + 1)), &(i + 1, p.depths[i], first))?);
            current_width = p.widths[i];
        }
        Ok(Self { stages })
    }
}

impl Forward for TrunkOutput {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.stages.iter().try_fold(x.clone(), |x, stage| stage.forward(&x))
    }
}

/// `stem` (`SimpleStemIN`: a stride-2 3x3 `Conv2dNormActivation`), `trunk_output`, `avgpool`, `fc`.
#[derive(Module)]
#[module(config = RegNetConfig)]
pub struct RegNet {
    #[module(config = ConvNormConfig::new(3, cfg.stem_width, 3).stride(2))]
    stem: Conv2dNormActivation<ReLU>,
    #[module(config = cfg.clone())]
    trunk_output: TrunkOutput,
    #[module(config = [1, 1])]
    avgpool: AdaptiveAvgPool2d,
    #[module(config = LinearConfig::new(cfg.trunk_width(), cfg.num_classes))]
    fc: Linear,
}

impl Forward for RegNet {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.trunk_output.forward(&self.stem.forward(x)?)?;
        self.fc.forward(&self.avgpool.forward(&x)?.flatten(1)?)
    }
}

/// `torchvision.models.regnet_y_400mf()`: 1000 classes.
pub fn regnet_y_400mf(vb: VarBuilder) -> Result<RegNet> {
    let block_params = BlockParams::from_init_params(16, 48, 27.89, 2.09, 8, Some(0.25));
    RegNet::load(vb, &RegNetConfig { block_params, num_classes: 1000, stem_width: 32 })
}

#[cfg(test)]
mod tests {
    use super::BlockParams;

    #[test]
    fn regnet_y_400mf_block_params_match_torchvision() {
        let p = BlockParams::from_init_params(16, 48, 27.89, 2.09, 8, Some(0.25));
        assert_eq!(p.depths, [1, 3, 6, 6]);
        assert_eq!(p.widths, [48, 104, 208, 440]);
        assert_eq!(p.group_widths, [8, 8, 8, 8]);
        assert_eq!(p.strides, [2, 2, 2, 2]);
    }
}
