//! torchvision's Swin Transformer (`torchvision/models/swin_transformer.py`, V1): `swin_t`, with its
//! `state_dict` names (`features.1.0.attn.qkv.weight`, `features.1.0.attn.relative_position_bias_table`,
//! `features.2.reduction.weight`, `head.weight`).
//!
//! The engine keeps the batch as dim 0, so windows are `[B, windows, 49, C]` where torchvision
//! folds them into the batch (`[B·windows, 49, C]`); the arithmetic is the same. The relative
//! position bias (the table gathered by the constant `relative_position_index`) and the shifted
//! windows' mask (torchvision's construction, for the traced input size) are constants computed
//! while tracing and added inside the attention op as one bias `[windows, heads, 49, 49]`.
//! `relative_position_index` is recomputed from the window size, not read (it is a constant
//! buffer of the module). Stochastic depth and dropout are identities at inference.

use kiln::{
    nn::{AdaptiveAvgPool2d, Conv2d, Conv2dConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig, GELU},
    Forward, HostTensor, Module, Param, Result, Tensor, VarBuilder,
};
use std::sync::Arc;

/// `swin_t`'s hyper-parameters: patch 4, embed 96, depths [2, 2, 6, 2], heads [3, 6, 12, 24], window 7.
#[derive(Clone, Debug)]
pub struct SwinConfig {
    pub patch: usize,
    pub embed_dim: usize,
    pub depths: Vec<usize>,
    pub heads: Vec<usize>,
    pub window: usize,
    pub num_classes: usize,
}

impl SwinConfig {
    pub fn swin_t() -> Self {
        Self { patch: 4, embed_dim: 96, depths: vec![2, 2, 6, 2], heads: vec![3, 6, 12, 24], window: 7, num_classes: 1000 }
    }
}

/// `ShiftedWindowAttention(dim, window, shift, heads)`: `qkv`, `proj`, `relative_position_bias_table`.
pub struct ShiftedWindowAttention {
    path: String,
    qkv: Linear,
    proj: Linear,
    /// `[(2w-1)², heads]`.
    table: Param,
    window: usize,
    shift: usize,
    heads: usize,
}

impl Module for ShiftedWindowAttention {
    /// (dim, window, shift, heads).
    type Config = (usize, usize, usize, usize);
    fn load(vb: VarBuilder, &(dim, window, shift, heads): &Self::Config) -> Result<Self> {
        let side = 2 * window - 1;
        Ok(Self {
            path: vb.path().to_string(),
            qkv: Linear::load(vb.pp("qkv"), &LinearConfig::new(dim, 3 * dim))?,
            proj: Linear::load(vb.pp("proj"), &LinearConfig::new(dim, dim))?,
            table: vb.get(&[side * side, heads], "relative_position_bias_table")?,
            window,
            shift,
            heads,
        })
    }
}

/// torchvision's `relative_position_index` for a `w`×`w` window: for positions `i`, `j` (row-major
/// in the window), `(hi - hj + w - 1)·(2w - 1) + (wi - wj + w - 1)`.
pub fn relative_position_index(w: usize) -> Vec<usize> {
    let n = w * w;
    let mut out = Vec::with_capacity(n * n);
    for i in 0..n {
        for j in 0..n {
            let (hi, wi, hj, wj) = (i / w, i % w, j / w, j % w);
            out.push((hi + w - 1 - hj) * (2 * w - 1) + (wi + w - 1 - wj));
        }
    }
    out
}

/// torchvision's shifted-window mask for a padded `ph`×`pw` map: `[windows, N, N]`, 0 where two
/// positions of a window come from the same region of the rolled map, -100 elsewhere.
pub fn shifted_window_mask(ph: usize, pw: usize, w: usize, shift: usize) -> Vec<f32> {
    // Regions along one axis: [0, size - w), [size - w, size - shift), [size - shift, size).
    let region = |x: usize, size: usize| usize::from(x >= size - w) + usize::from(x >= size - shift);
    let (nh, nw) = (ph / w, pw / w);
    let n = w * w;
    let mut windows = vec![0usize; nh * nw * n];
    for h in 0..ph {
        for x in 0..pw {
            windows[((h / w) * nw + x / w) * n + (h % w) * w + x % w] = region(h, ph) * 3 + region(x, pw);
        }
    }
    let mut mask = Vec::with_capacity(nh * nw * n * n);
    for win in windows.chunks_exact(n) {
        for i in 0..n {
            mask.extend((0..n).map(|j| if win[j] != win[i] { -100.0 } else { 0.0 }));
        }
    }
    mask
}

impl ShiftedWindowAttention {
    /// The attention bias for a padded `ph`×`pw` map: the relative position bias `[heads, N, N]`,
    /// plus the mask per window (`[windows, heads, N, N]`) when the windows are shifted.
    fn bias(&self, ph: usize, pw: usize, shift: usize) -> Param {
        let (w, heads) = (self.window, self.heads);
        let n = w * w;
        let index = relative_position_index(w);
        let table = &self.table.value.data;
        let mut rel = vec![0.0f32; heads * n * n];
        for h in 0..heads {
            for (ij, &ix) in index.iter().enumerate() {
                rel[h * n * n + ij] = table[ix * heads + h];
            }
        }
        let name = format!("{}.relative_position_bias", self.path);
        if shift == 0 {
            return Param { name, value: Arc::new(HostTensor::new(vec![heads, n, n], rel)) };
        }
        let mask = shifted_window_mask(ph, pw, w, shift);
        let windows = mask.len() / (n * n);
        let mut out = Vec::with_capacity(windows * heads * n * n);
        for m in mask.chunks_exact(n * n) {
            for r in rel.chunks_exact(n * n) {
                out.extend(r.iter().zip(m).map(|(a, b)| a + b));
            }
        }
        Param { name: format!("{name}+shifted_window_mask"), value: Arc::new(HostTensor::new(vec![windows, heads, n, n], out)) }
    }
}

impl Forward for ShiftedWindowAttention {
    /// `[B, H, W, C]` → `[B, H, W, C]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let &[b, h, w, c] = x.shape() else {
            return Err(kiln::Error::Shape {
                path: self.path.clone(),
                op: "shifted_window_attention".into(),
                reason: "expects [B, H, W, C]".into(),
                got: vec![x.shape().to_vec()],
            });
        };
        let ws = self.window;
        let (pad_r, pad_b) = ((ws - w % ws) % ws, (ws - h % ws) % ws);
        let mut x = if pad_r + pad_b > 0 { x.pad(&[0, 0, 0, pad_r as isize, 0, pad_b as isize], 0.0)? } else { x.clone() };
        let (ph, pw) = (h + pad_b, w + pad_r);
        // No shift along an axis the window covers whole (torchvision shifts both or neither
        // in effect for square windows on square maps; the per-axis rule is kept).
        let shift = [if ws >= ph { 0 } else { self.shift }, if ws >= pw { 0 } else { self.shift }];
        if shift != [0, 0] {
            x = x.roll(&[-(shift[0] as i64), -(shift[1] as i64)], &[1, 2])?;
        }
        let (nh, nw, n, heads) = (ph / ws, pw / ws, ws * ws, self.heads);
        let hd = c / heads;
        let i = |v: usize| v as isize;
        // Partition: [B, nh, ws, nw, ws, C] -> [B, nh, nw, ws, ws, C] -> [B, windows, N, C].
        let x =
            x.view(&[i(b), i(nh), i(ws), i(nw), i(ws), i(c)])?.permute(&[0, 1, 3, 2, 4, 5])?.reshape(&[i(b), i(nh * nw), i(n), i(c)])?;
        // [B, windows, N, 3·C]: q, k, v, each `heads` heads of hd, read in place by the packed op.
        let qkv = self.qkv.forward(&x)?;
        if shift[0] != shift[1] {
            return Err(kiln::Error::Shape {
                path: self.path.clone(),
                op: "shifted_window_attention".into(),
                reason: kiln::plugin::OpError::Attribute(format!("a shift along one axis only ({shift:?}) is not supported")),
                got: vec![x.shape().to_vec()],
            });
        }
        let bias = self.bias(ph, pw, shift[0]);
        let scale = (hd as f32).powf(-0.5);
        // [B, windows, N, C], the heads concatenated as `proj` reads them.
        let y = qkv.qkv_attention_weight(&format!("{}.attention", self.path), heads, &bias, Some(scale))?;
        let y = self.proj.forward(&y)?;
        // Reverse: [B, nh, nw, ws, ws, C] -> [B, nh, ws, nw, ws, C] -> [B, ph, pw, C].
        let y = y.view(&[i(b), i(nh), i(nw), i(ws), i(ws), i(c)])?.permute(&[0, 1, 3, 2, 4, 5])?.reshape(&[i(b), i(ph), i(pw), i(c)])?;
        let y = if shift != [0, 0] { y.roll(&[shift[0] as i64, shift[1] as i64], &[1, 2])? } else { y };
        let y = if pad_b > 0 { y.narrow(1, 0, h)? } else { y };
        if pad_r > 0 {
            y.narrow(2, 0, w)
        } else {
            Ok(y)
        }
    }
}

/// `SwinTransformerBlock`: `x + attn(norm1(x))`, then `x + mlp(norm2(x))` (`mlp.0`, GELU, `mlp.3`).
pub struct SwinTransformerBlock {
    norm1: LayerNorm,
    attn: ShiftedWindowAttention,
    norm2: LayerNorm,
    fc1: Linear,
    act: GELU,
    fc2: Linear,
}

impl Module for SwinTransformerBlock {
    /// (dim, heads, window, shift).
    type Config = (usize, usize, usize, usize);
    fn load(vb: VarBuilder, &(dim, heads, window, shift): &Self::Config) -> Result<Self> {
        let mlp = vb.pp("mlp");
        Ok(Self {
            norm1: LayerNorm::load(vb.pp("norm1"), &LayerNormConfig::new(&[dim]))?,
            attn: ShiftedWindowAttention::load(vb.pp("attn"), &(dim, window, shift, heads))?,
            norm2: LayerNorm::load(vb.pp("norm2"), &LayerNormConfig::new(&[dim]))?,
            fc1: Linear::load(mlp.pp(0), &LinearConfig::new(dim, 4 * dim))?,
            act: GELU::load(mlp.pp(1), &false)?,
            fc2: Linear::load(mlp.pp(3), &LinearConfig::new(4 * dim, dim))?,
        })
    }
}

impl Forward for SwinTransformerBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (x + &self.attn.forward(&self.norm1.forward(x)?)?)?;
        let y = self.fc2.forward(&self.act.forward(&self.fc1.forward(&self.norm2.forward(&x)?)?)?)?;
        &x + &y
    }
}

/// `PatchMerging(dim)`: torchvision's `_patch_merging_pad` (x0..x3 = the four 2×2 phases, cat on
/// channels), then `norm` (LayerNorm 4·dim) and `reduction` (Linear 4·dim → 2·dim, no bias).
pub struct PatchMerging {
    norm: LayerNorm,
    reduction: Linear,
}

impl Module for PatchMerging {
    type Config = usize;
    fn load(vb: VarBuilder, &dim: &usize) -> Result<Self> {
        Ok(Self {
            norm: LayerNorm::load(vb.pp("norm"), &LayerNormConfig::new(&[4 * dim]))?,
            reduction: Linear::load(vb.pp("reduction"), &LinearConfig { bias: false, ..LinearConfig::new(4 * dim, 2 * dim) })?,
        })
    }
}

impl Forward for PatchMerging {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, h, w, c) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
        let x = if h % 2 + w % 2 > 0 { x.pad(&[0, 0, 0, (w % 2) as isize, 0, (h % 2) as isize], 0.0)? } else { x.clone() };
        let (h2, w2) = (h.div_ceil(2) as isize, w.div_ceil(2) as isize);
        // cat([x0, x1, x2, x3], -1) with x0 = (even row, even col), x1 = (odd, even), x2 = (even,
        // odd), x3 = (odd, odd): channel block (col phase)·2 + (row phase). One permute:
        // [B, H/2, 2(row), W/2, 2(col), C] -> [B, H/2, W/2, 2(col), 2(row), C].
        let x = x.view(&[b as isize, h2, 2, w2, 2, c as isize])?.permute(&[0, 1, 3, 4, 2, 5])?.reshape(&[
            b as isize,
            h2,
            w2,
            4 * c as isize,
        ])?;
        self.reduction.forward(&self.norm.forward(&x)?)
    }
}

/// A stage of `features`: its blocks (`features.1`, `features.3`, ...), or a `PatchMerging`.
enum Stage {
    Blocks(Vec<SwinTransformerBlock>),
    Merge(PatchMerging),
}

/// `SwinTransformer`: `features.0` (patch embedding: conv 4×4/4, permute to NHWC, LayerNorm),
/// stages and patch mergings, then `norm`, average pool and `head`.
pub struct SwinTransformer {
    patch: Conv2d,
    patch_norm: LayerNorm,
    stages: Vec<Stage>,
    norm: LayerNorm,
    avgpool: AdaptiveAvgPool2d,
    head: Linear,
}

impl Module for SwinTransformer {
    type Config = SwinConfig;
    fn load(vb: VarBuilder, c: &SwinConfig) -> Result<Self> {
        let features = vb.pp("features");
        let mut stages = Vec::new();
        for (s, (&depth, &heads)) in c.depths.iter().zip(&c.heads).enumerate() {
            let dim = c.embed_dim << s;
            let vs = features.pp(2 * s + 1);
            let blocks = (0..depth)
                .map(|i| SwinTransformerBlock::load(vs.pp(i), &(dim, heads, c.window, if i % 2 == 0 { 0 } else { c.window / 2 })))
                .collect::<Result<_>>()?;
            stages.push(Stage::Blocks(blocks));
            if s + 1 < c.depths.len() {
                stages.push(Stage::Merge(PatchMerging::load(features.pp(2 * s + 2), &dim)?));
            }
        }
        let last = c.embed_dim << (c.depths.len() - 1);
        let stem = features.pp(0);
        Ok(Self {
            patch: Conv2d::load(stem.pp(0), &Conv2dConfig::new(3, c.embed_dim, c.patch).stride(c.patch))?,
            patch_norm: LayerNorm::load(stem.pp(2), &LayerNormConfig::new(&[c.embed_dim]))?,
            stages,
            norm: LayerNorm::load(vb.pp("norm"), &LayerNormConfig::new(&[last]))?,
            avgpool: AdaptiveAvgPool2d::load(vb.pp("avgpool"), &[1, 1])?,
            head: Linear::load(vb.pp("head"), &LinearConfig::new(last, c.num_classes))?,
        })
    }
}

impl Forward for SwinTransformer {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = self.patch_norm.forward(&self.patch.forward(x)?.permute(&[0, 2, 3, 1])?)?;
        for stage in &self.stages {
            x = match stage {
                Stage::Blocks(blocks) => blocks.iter().try_fold(x, |x, b| b.forward(&x))?,
                Stage::Merge(m) => m.forward(&x)?,
            };
        }
        let x = self.norm.forward(&x)?.permute(&[0, 3, 1, 2])?;
        self.head.forward(&self.avgpool.forward(&x)?.flatten(1)?)
    }
}

/// torchvision's `swin_t()`.
pub fn swin_t(vb: VarBuilder) -> Result<SwinTransformer> {
    SwinTransformer::load(vb, &SwinConfig::swin_t())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_position_index_matches_torchvision_corners() {
        let idx = relative_position_index(7);
        assert_eq!(idx.len(), 49 * 49);
        // Same position: offset (0, 0) is the table's centre, (6·13 + 6).
        assert_eq!(idx[0], 84);
        assert_eq!(idx[48 * 49 + 48], 84);
        // i = (0, 0), j = (6, 6): (0 - 6 + 6)·13 + (0 - 6 + 6) = 0; the reverse is the last entry.
        assert_eq!(idx[48], 0);
        assert_eq!(idx[48 * 49], 168);
    }

    #[test]
    fn swin_t_traces_with_torchvision_structure() {
        let g = crate::trace("swin_t", VarBuilder::seeded(), 1, 224).expect("trace");
        let count = |op: &str| g.nodes.iter().filter(|n| n.op.name() == op).count();
        assert_eq!(count("qkv_attention"), 12, "depths 2 + 2 + 6 + 2");
        assert_eq!(count("attention"), 0, "every block reads its packed qkv");
        // No copies around the attention: it reads the qkv Linear's output and proj reads its own.
        let id = g.nodes.iter().position(|n| n.path == "features.1.1.attn.attention").expect("the second block's attention");
        let node = &g.nodes[id];
        assert_eq!(node.op.name(), "qkv_attention");
        assert_eq!((node.shape.as_slice(), g.nodes[node.inputs[0]].path.as_str()), ([1, 64, 49, 96].as_slice(), "features.1.1.attn.qkv"));
        assert_eq!(g.nodes[node.inputs[1]].shape, [64, 3, 49, 49], "relative position bias + shifted-window mask");
        let readers: Vec<&str> = g.nodes.iter().filter(|n| n.inputs.contains(&id)).map(|n| n.path.as_str()).collect();
        assert_eq!(readers, ["features.1.1.attn.proj"]);
        // Shifted blocks (every second one) roll there and back, except in the last stage, whose
        // 7x7 map is one window (torchvision's shift is then 0).
        assert_eq!(count("roll"), 2 * (1 + 1 + 3));
        assert!(g.weights.contains_key("features.5.5.mlp.3.weight"));
        assert!(g.weights.contains_key("features.6.reduction.weight"));
        assert_eq!(g.weights["features.1.1.attn.relative_position_bias+shifted_window_mask"].shape, [64, 3, 49, 49]);
        assert_eq!(g.weights["features.7.1.attn.relative_position_bias"].shape, [24, 49, 49]);
        assert_eq!(g.weights["head.weight"].shape, [1000, 768]);
    }

    #[test]
    fn shifted_window_mask_separates_regions() {
        // 14×14 map, window 7, shift 3: 4 windows; the first window is one region (all zeros),
        // the last mixes four regions.
        let m = shifted_window_mask(14, 14, 7, 3);
        assert_eq!(m.len(), 4 * 49 * 49);
        assert!(m[..49 * 49].iter().all(|&v| v == 0.0));
        let last = &m[3 * 49 * 49..];
        // Positions (0,0) and (6,6) of the last window lie in different regions; (0,0) and (0,1) do not.
        assert_eq!(last[48], -100.0);
        assert_eq!(last[1], 0.0);
    }
}
