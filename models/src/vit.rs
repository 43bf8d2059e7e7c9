//! torchvision's Vision Transformer (`torchvision/models/vision_transformer.py`): `vit_b_16`, with
//! its `state_dict` names (`conv_proj.weight`, `class_token`, `encoder.pos_embedding`,
//! `encoder.layers.encoder_layer_0.self_attention.in_proj_weight`, `heads.head.weight`).
//!
//! The class token is concatenated in front of the patch tokens and the position embedding added;
//! both are constants, so Kiln pads one zero token in front and adds one constant,
//! `pos_embedding` with `class_token` added to its row 0: the same f32 sums as `cat` then `+`.
//! The position embedding is read at trace time for the traced input size (`[1, (size/16)² + 1,
//! 768]`, torchvision's `image_size` argument). Dropout is the identity at inference.

use kiln::{
    nn::{Conv2d, Conv2dConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig, GELU},
    plugin::{Binary, Gemm, Op},
    Forward, HostTensor, Module, Param, Result, Tensor, VarBuilder,
};
use std::sync::Arc;

/// `vit_b_16`'s hyper-parameters: patch 16, 12 layers, 12 heads, width 768, MLP 3072.
#[derive(Clone, Copy, Debug)]
pub struct VitConfig {
    pub patch: usize,
    pub layers: usize,
    pub heads: usize,
    pub hidden: usize,
    pub mlp: usize,
    pub num_classes: usize,
}

impl VitConfig {
    pub fn vit_b_16() -> Self {
        Self { patch: 16, layers: 12, heads: 12, hidden: 768, mlp: 3072, num_classes: 1000 }
    }
}

fn ln(vb: VarBuilder, dim: usize) -> Result<LayerNorm> {
    LayerNorm::load(vb, &LayerNormConfig::new(&[dim]).eps(1e-6))
}

/// `nn.MultiheadAttention(E, heads, batch_first=True)` as self-attention: `in_proj_weight`
/// `[3E, E]`, `in_proj_bias`, `out_proj`.
pub struct MultiheadAttention {
    path: String,
    in_proj_weight: Param,
    in_proj_bias: Param,
    out_proj: Linear,
    heads: usize,
}

impl Module for MultiheadAttention {
    /// (embed dim, heads).
    type Config = (usize, usize);
    fn load(vb: VarBuilder, &(e, heads): &(usize, usize)) -> Result<Self> {
        Ok(Self {
            path: vb.path().to_string(),
            in_proj_weight: vb.get(&[3 * e, e], "in_proj_weight")?,
            in_proj_bias: vb.get(&[3 * e], "in_proj_bias")?,
            out_proj: Linear::load(vb.pp("out_proj"), &LinearConfig::new(e, e))?,
            heads,
        })
    }
}

impl Forward for MultiheadAttention {
    /// `[N, L, E]` → `[N, L, E]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let qkv = Tensor::record(
            &format!("{}.in_proj", self.path),
            Op::Gemm(Gemm::Linear { bias: true, residual: false }),
            &[x],
            &[&self.in_proj_weight, &self.in_proj_bias],
        )?;
        // `in_proj`'s rows are q, k, v, each `heads` heads of E / heads: the packed op reads them
        // where they are and writes the heads concatenated, `[N, L, E]`, ready for `out_proj`.
        self.out_proj.forward(&qkv.qkv_attention(self.heads, None, None)?)
    }
}

/// `EncoderBlock`: `x + self_attention(ln_1(x))`, then `x + mlp(ln_2(x))` (`mlp.0`, GELU, `mlp.3`).
pub struct EncoderBlock {
    ln_1: LayerNorm,
    self_attention: MultiheadAttention,
    ln_2: LayerNorm,
    fc1: Linear,
    act: GELU,
    fc2: Linear,
}

impl Module for EncoderBlock {
    type Config = VitConfig;
    fn load(vb: VarBuilder, c: &VitConfig) -> Result<Self> {
        let mlp = vb.pp("mlp");
        Ok(Self {
            ln_1: ln(vb.pp("ln_1"), c.hidden)?,
            self_attention: MultiheadAttention::load(vb.pp("self_attention"), &(c.hidden, c.heads))?,
            ln_2: ln(vb.pp("ln_2"), c.hidden)?,
            fc1: Linear::load(mlp.pp(0), &LinearConfig::new(c.hidden, c.mlp))?,
            act: GELU::load(mlp.pp(1), &false)?,
            fc2: Linear::load(mlp.pp(3), &LinearConfig::new(c.mlp, c.hidden))?,
        })
    }
}

impl Forward for EncoderBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (x + &self.self_attention.forward(&self.ln_1.forward(x)?)?)?;
        let y = self.fc2.forward(&self.act.forward(&self.fc1.forward(&self.ln_2.forward(&x)?)?)?)?;
        &x + &y
    }
}

/// `VisionTransformer`: `conv_proj`, `class_token`, `encoder` (`pos_embedding`, `layers`, `ln`),
/// `heads.head`.
pub struct VisionTransformer {
    config: VitConfig,
    conv_proj: Conv2d,
    class_token: Param,
    /// `encoder`: `pos_embedding` is read when tracing, for the input size.
    encoder: VarBuilder,
    layers: Vec<EncoderBlock>,
    ln: LayerNorm,
    head: Linear,
}

impl Module for VisionTransformer {
    type Config = VitConfig;
    fn load(vb: VarBuilder, c: &VitConfig) -> Result<Self> {
        let encoder = vb.pp("encoder");
        let layers =
            (0..c.layers).map(|i| EncoderBlock::load(encoder.pp("layers").pp(format!("encoder_layer_{i}")), c)).collect::<Result<_>>()?;
        Ok(Self {
            config: *c,
            conv_proj: Conv2d::load(vb.pp("conv_proj"), &Conv2dConfig::new(3, c.hidden, c.patch).stride(c.patch))?,
            class_token: vb.get(&[1, 1, c.hidden], "class_token")?,
            ln: ln(encoder.pp("ln"), c.hidden)?,
            encoder,
            layers,
            head: Linear::load(vb.pp("heads").pp("head"), &LinearConfig::new(c.hidden, c.num_classes))?,
        })
    }
}

impl Forward for VisionTransformer {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let e = self.config.hidden;
        let x = self.conv_proj.forward(x)?;
        let (n, tokens) = (x.shape()[0] as isize, x.shape()[2] * x.shape()[3]);
        // torchvision reshapes to [N, E, h·w] and permutes to [N, h·w, E]; permuting to [N, h, w, E]
        // first and then merging h and w is the same tensor, and both steps alias the NHWC
        // convolution's output instead of copying it to NCHW and back.
        let x = x.permute(&[0, 2, 3, 1])?.reshape(&[n, tokens as isize, e as isize])?;
        // cat([class_token, x], 1) + pos_embedding == pad(x, one token in front) + (pos_embedding
        // with class_token added to row 0).
        let pos = self.encoder.get(&[1, tokens + 1, e], "pos_embedding")?;
        let mut merged = pos.value.data.clone();
        merged[..e].iter_mut().zip(&self.class_token.value.data).for_each(|(p, c)| *p += c);
        let merged = Param { name: format!("{}+class_token", pos.name), value: Arc::new(HostTensor::new(vec![1, tokens + 1, e], merged)) };
        let x = x.pad(&[0, 0, 1, 0], 0.0)?.binary_weight(&format!("{}.add_pos_embedding", self.encoder.path()), Binary::Add, &merged)?;
        let x = self.layers.iter().try_fold(x, |x, l| l.forward(&x))?;
        let x = self.ln.forward(&x)?;
        self.head.forward(&x.narrow(1, 0, 1)?.reshape(&[n, e as isize])?)
    }
}

/// torchvision's `vit_b_16()`.
pub fn vit_b_16(vb: VarBuilder) -> Result<VisionTransformer> {
    VisionTransformer::load(vb, &VitConfig::vit_b_16())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vit_b_16_traces_with_torchvision_structure() {
        let g = crate::trace("vit_b_16", VarBuilder::seeded(), 2, 224).expect("trace");
        let attention: Vec<_> = (0..g.nodes.len()).filter(|&i| g.nodes[i].op.name() == "qkv_attention").collect();
        assert_eq!(attention.len(), 12);
        let first = &g.nodes[attention[0]];
        assert_eq!(first.shape, [2, 197, 768], "[N, 1 + 14·14 tokens, 12 heads · 64]");
        assert_eq!(first.op, Op::QkvAttention(kiln::plugin::QkvAttention { heads: 12, scale: 0.125, bias: false }));
        // No copies around the attention: it reads in_proj's output and out_proj reads its own.
        let layer = "encoder.layers.encoder_layer_0.self_attention";
        assert_eq!(g.nodes[first.inputs[0]].path, format!("{layer}.in_proj"));
        assert_eq!(g.nodes[first.inputs[0]].shape, [2, 197, 2304]);
        let readers: Vec<&str> = g.nodes.iter().filter(|n| n.inputs.contains(&attention[0])).map(|n| n.path.as_str()).collect();
        assert_eq!(readers, [format!("{layer}.out_proj")]);
        assert_eq!(g.weights["encoder.layers.encoder_layer_11.self_attention.in_proj_weight"].shape, [2304, 768]);
        assert_eq!(g.weights["encoder.pos_embedding+class_token"].shape, [1, 197, 768]);
        assert_eq!(g.weights["heads.head.weight"].shape, [1000, 768]);
        let out = g.outputs.iter().find(|(n, _)| n == "logits").map(|(_, id)| g.nodes[*id].shape.clone());
        assert_eq!(out, Some(vec![2, 1000]));
    }
}
