//! CenterNet-R50-DCN: CenterNet-R50 (`centernet`) with a deformable 3×3 conv before each
//! upsampling deconv, as the original CenterNet's `resnet_dcn` does. The deformable conv is the
//! `deform_conv2d` op of the `kiln-deform-conv` plugin crate (a user's op, registered from
//! outside Kiln); this model only uses it.
//!
//! PyTorch twin (`tools/export_reference.py`, `CenterNetDCN`): the backbone and heads of
//! `centernet`; `upsampler.deconv_layers` = 3 × [DCN(cin, 256), BatchNorm2d, ReLU,
//! ConvTranspose2d(256, 256, 4, s=2, p=1, bias=False), BatchNorm2d, ReLU] (indices 0..17), where
//! `DCN` is `torchvision.ops.DeformConv2d(cin, 256, 3, padding=1)` (keys `weight`, `bias`) with a
//! `conv_offset_mask` = Conv2d(cin, 27, 3, padding=1): channels 0..18 are the (dy, dx) offsets of
//! the 9 taps, 18..27 the mask logits (DCNv2's `DCN` module; its `state_dict` names too).

use crate::centernet::{CenterNetOutput, Head, Upsampler};
use crate::resnet::{ResNet50, ResNetConfig};
use kiln::{
    nn::{BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, ReLU},
    Forward, Module, Result, Tensor, VarBuilder,
};
use kiln_deform_conv::{DeformConv2d, DeformConv2dConfig};

/// Kernel taps of the 3×3 deformable conv; `conv_offset_mask` predicts 3 values per tap.
const TAPS: usize = 9;

/// DCNv2's `DCN(cin, cout, 3, padding=1)`: offsets and mask from a plain 3×3 conv of the input.
pub struct Dcn {
    conv_offset_mask: Conv2d,
    dcn: DeformConv2d,
}

impl Module for Dcn {
    /// `(in_channels, out_channels)`.
    type Config = (usize, usize);
    fn load(vb: VarBuilder, &(cin, cout): &(usize, usize)) -> Result<Self> {
        let conv_offset_mask = Conv2d::load(vb.pp("conv_offset_mask"), &Conv2dConfig::new(cin, 3 * TAPS, 3).padding(1))?;
        // The module's own `weight` and `bias` are the deformable conv's (torchvision's keys).
        let dcn = DeformConv2d::load(vb, &DeformConv2dConfig::new(cin, cout, 3).padding(1))?;
        Ok(Self { conv_offset_mask, dcn })
    }
}

impl Forward for Dcn {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let om = self.conv_offset_mask.forward(x)?;
        let offset = om.narrow(1, 0, 2 * TAPS)?;
        let mask = om.narrow(1, 2 * TAPS, TAPS)?.sigmoid()?;
        self.dcn.forward(x, &offset, Some(&mask))
    }
}

/// `upsampler.deconv_layers`: 3 × [DCN, BatchNorm2d, ReLU, ConvTranspose2d(4, s=2, p=1), BatchNorm2d,
/// ReLU], one flat `nn.Sequential`, 2048 → 256 → 256 → 256 channels: CenterNet's upsampler with a
/// DCN in front of each transposed conv.
pub struct UpsamplerDcn(Upsampler);

impl Module for UpsamplerDcn {
    type Config = ();
    fn load(vb: VarBuilder, _: &()) -> Result<Self> {
        let upsampler = Upsampler::load_stages(vb, 6, |layers, vb, at, cin, cout| {
            layers.push(Dcn::load(vb.pp(at), &(cin, cout))?);
            layers.push(BatchNorm2d::load(vb.pp(at + 1), &BatchNorm2dConfig::new(cout))?);
            layers.push(ReLU::load(vb.pp(at + 2), &())?);
            Ok(cout)
        })?;
        Ok(Self(upsampler))
    }
}

impl Forward for UpsamplerDcn {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)
    }
}

/// CenterNet-R50-DCN with `num_classes` classes (the `Config`).
#[derive(Module)]
#[module(config = usize)]
pub struct CenterNetDcn {
    #[module(config = ResNetConfig::new([3, 4, 6, 3], None))]
    backbone: ResNet50,
    upsampler: UpsamplerDcn,
    #[module(config = *cfg)]
    head: Head,
}

impl CenterNetDcn {
    pub fn forward(&self, x: &Tensor) -> Result<CenterNetOutput> {
        self.head.forward(&self.upsampler.forward(&self.backbone.features(x)?)?)
    }
}

/// `centernet_dcn_r50(num_classes)`: the model of the module docs.
pub fn centernet_dcn_r50(vb: VarBuilder, num_classes: usize) -> Result<CenterNetDcn> {
    CenterNetDcn::load(vb, &num_classes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dcn_stages_have_centernet_dcn_names_and_shapes() {
        let tracer = kiln::Tracer::new();
        let x = tracer.input("input", &[1, 3, 128, 160]);
        let out = centernet_dcn_r50(VarBuilder::seeded(), 80).expect("load").forward(&x).expect("trace");
        assert_eq!(out.hm.shape(), [1, 80, 32, 40]);
        let g = tracer.graph();
        let dcns: Vec<(&str, &[usize])> =
            g.nodes.iter().filter(|n| n.op.name() == kiln_deform_conv::OP).map(|n| (n.path.as_str(), n.shape.as_slice())).collect();
        assert_eq!(
            dcns,
            [
                ("upsampler.deconv_layers.0", &[1, 256, 4, 5][..]),
                ("upsampler.deconv_layers.6", &[1, 256, 8, 10][..]),
                ("upsampler.deconv_layers.12", &[1, 256, 16, 20][..])
            ]
        );
        assert_eq!(g.weights["upsampler.deconv_layers.0.weight"].shape, [256, 2048, 3, 3]);
        assert_eq!(g.weights["upsampler.deconv_layers.0.conv_offset_mask.weight"].shape, [27, 2048, 3, 3]);
        assert_eq!(g.weights["upsampler.deconv_layers.9.weight"].shape, [256, 256, 4, 4]);
        assert!(g.weights.contains_key("upsampler.deconv_layers.16.running_var"));
        assert!(g.weights.contains_key("upsampler.deconv_layers.12.bias"));
    }
}
