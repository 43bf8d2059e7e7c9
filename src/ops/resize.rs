//! Upsampling and interpolation (`nn.Upsample`, `F.interpolate`) of NCHW tensors, with
//! PyTorch's (CPU) index arithmetic:
//!
//! - `nearest` (PyTorch's legacy mode, not `nearest-exact`): `src = min(floor(dst * s), in - 1)`
//!   in f32, where `s = 1 / scale_factor` when a scale factor was given (and not recomputed),
//!   `in / out` otherwise; an output as large as the input is a copy and one twice as large reads
//!   `dst >> 1`, whatever the scale.
//! - `bilinear`: `align_corners=True` maps the corner pixels onto each other
//!   (`src = dst * (in - 1) / (out - 1)`, the scale factor is ignored); `False` maps pixel areas
//!   (`src = max((dst + 0.5) * s - 0.5, 0)` with `s` as for nearest). Out-of-range neighbours are
//!   clamped to the edge.
//!
//! The output size is `size`, or `floor(in * scale_factor)` (computed in f64, as PyTorch).

use crate::engine::launch::{nhwc, pack, same_elem, to_i32, typed_entry_points, Arg, KArg, KernelLayer};
use crate::engine::{Layer, Layout};
use crate::error::OpError;
use crate::graph::{HostTensor, NodeId, Op};
use crate::module::{Forward, Module};
use crate::ops::BuildCtx;
use crate::ops::{one_input, AtenImport, CpuArgs, FixtureTwin, LayoutPlan, NnLayer, OpDef};
use crate::tensor::Tensor;
use crate::var_builder::VarBuilder;
use crate::LowerKind;
use crate::Result;
use serde::{Deserialize, Serialize};

/// This family's layers, as `kiln::nn` shows them.
pub mod nn {
    pub use super::{InterpolateMode, Upsample, UpsampleConfig};
}

/// Resizing ops of NCHW tensors: exactly one of `size` (the output's `[H, W]`) and `scale` (the
/// `scale_factor` per spatial dim, which the index arithmetic then uses) is set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, strum::EnumIter)]
pub enum Resize {
    /// `mode="nearest"` (`aten::upsample_nearest2d`).
    Nearest { size: Option<[usize; 2]>, scale: Option<[f64; 2]> },
    /// `mode="bilinear"` (`aten::upsample_bilinear2d`).
    Bilinear { size: Option<[usize; 2]>, scale: Option<[f64; 2]>, align_corners: bool },
}

/// The largest output extent accepted (the kernels index in 32 bits).
const MAX_EXTENT: usize = i32::MAX as usize;

impl Resize {
    fn size_scale(&self) -> (Option<[usize; 2]>, Option<[f64; 2]>) {
        match *self {
            Resize::Nearest { size, scale } | Resize::Bilinear { size, scale, .. } => (size, scale),
        }
    }

    /// The output `[H, W]` for an input of `[H, W]`, or why there is none.
    pub fn output_hw(&self, input: [usize; 2]) -> Result<[usize; 2], OpError> {
        let out = match self.size_scale() {
            (Some(size), None) => size,
            (None, Some(scale)) => {
                let mut out = [0; 2];
                for i in 0..2 {
                    let s = scale[i];
                    if !(s.is_finite() && s > 0.0) {
                        return Err(format!("scale_factor {scale:?} must be positive and finite").into());
                    }
                    let o = (input[i] as f64 * s).floor();
                    if o > MAX_EXTENT as f64 {
                        return Err(format!("scale_factor {scale:?} makes input {input:?} larger than {MAX_EXTENT}").into());
                    }
                    out[i] = o as usize;
                }
                out
            }
            (size, scale) => return Err(format!("exactly one of size ({size:?}) and scale_factor ({scale:?}) must be given").into()),
        };
        if out.contains(&0) || input.contains(&0) {
            return Err(format!("input and output sizes should be greater than 0, got input {input:?} and output {out:?}").into());
        }
        if out.iter().any(|&o| o > MAX_EXTENT) {
            return Err(format!("output size {out:?} exceeds {MAX_EXTENT}").into());
        }
        Ok(out)
    }

    /// The f32 ratio PyTorch's kernels use along one axis (`compute_scales_value`): `1 / scale`
    /// when a scale factor was given, `in / out` otherwise.
    fn ratio(scale: Option<f64>, input: usize, output: usize) -> f32 {
        match scale {
            Some(s) if s > 0.0 => (1.0 / s) as f32,
            _ => input as f32 / output as f32,
        }
    }

    /// The source index of each output index along one axis, as `nearest_idx` (PyTorch CPU).
    pub fn nearest_indices(scale: Option<f64>, input: usize, output: usize) -> Vec<usize> {
        let ratio = Self::ratio(scale, input, output);
        (0..output)
            .map(|o| {
                if output == input {
                    o
                } else if output == 2 * input {
                    o >> 1
                } else {
                    ((o as f32 * ratio).floor() as usize).min(input - 1)
                }
            })
            .collect()
    }

    /// The two source indices and their weights `(i0, i1, l0, l1)` of each output index along one
    /// axis, as PyTorch CPU's `compute_source_index_and_lambda` (f32 arithmetic).
    pub fn linear_indices(scale: Option<f64>, align_corners: bool, input: usize, output: usize) -> Vec<(usize, usize, f32, f32)> {
        let ratio = if align_corners {
            if output > 1 {
                (input - 1) as f32 / (output - 1) as f32
            } else {
                0.0
            }
        } else {
            Self::ratio(scale, input, output)
        };
        (0..output)
            .map(|o| {
                if output == input {
                    return (o, o, 1.0, 0.0);
                }
                let real = if align_corners {
                    ratio * o as f32
                } else {
                    let src = ratio * (o as f32 + 0.5) - 0.5;
                    if src < 0.0 {
                        0.0
                    } else {
                        src
                    }
                };
                let i0 = (real.floor() as usize).min(input - 1);
                let l1 = (real - i0 as f32).clamp(0.0, 1.0);
                let i1 = if i0 < input - 1 { i0 + 1 } else { i0 };
                (i0, i1, 1.0 - l1, l1)
            })
            .collect()
    }
}

impl OpDef for Resize {
    fn name(&self) -> &str {
        match self {
            Resize::Nearest { .. } => "upsample_nearest2d",
            Resize::Bilinear { .. } => "upsample_bilinear2d",
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
        let x = one_input(inputs)?;
        let [n, c, h, w] = <[usize; 4]>::try_from(x).map_err(|_| format!("{} expects an NCHW input (rank 4), got {x:?}", self.name()))?;
        let [oh, ow] = self.output_hw([h, w])?;
        Ok(vec![n, c, oh, ow])
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, OpError> {
        args.expect(1)?;
        let x = args.get(0)?;
        let out = self.infer_shape(&[&x.shape])?;
        let ([h, w], [oh, ow]) = ([x.shape[2], x.shape[3]], [out[2], out[3]]);
        let (_, scale) = self.size_scale();
        let (sh, sw) = (scale.map(|s| s[0]), scale.map(|s| s[1]));
        let mut data = vec![0.0f32; out.iter().product()];
        let planes = x.data.chunks_exact(h * w).zip(data.chunks_exact_mut(oh * ow));
        match *self {
            Resize::Nearest { .. } => {
                let (iy, ix) = (Self::nearest_indices(sh, h, oh), Self::nearest_indices(sw, w, ow));
                for (src, dst) in planes {
                    for (row, &y) in dst.chunks_exact_mut(ow).zip(&iy) {
                        row.iter_mut().zip(&ix).for_each(|(d, &x)| *d = src[y * w + x]);
                    }
                }
            }
            Resize::Bilinear { align_corners, .. } => {
                let ty = Self::linear_indices(sh, align_corners, h, oh);
                let tx = Self::linear_indices(sw, align_corners, w, ow);
                for (src, dst) in planes {
                    for (row, &(y0, y1, ly0, ly1)) in dst.chunks_exact_mut(ow).zip(&ty) {
                        let (r0, r1) = (&src[y0 * w..(y0 + 1) * w], &src[y1 * w..(y1 + 1) * w]);
                        for (d, &(x0, x1, lx0, lx1)) in row.iter_mut().zip(&tx) {
                            *d = ly0 * (lx0 * r0[x0] + lx1 * r0[x1]) + ly1 * (lx0 * r1[x0] + lx1 * r1[x1]);
                        }
                    }
                }
            }
        }
        Ok(HostTensor::new(out, data))
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        LayoutPlan::all(inputs, Layout::channels_last(out_rank))
    }
    fn entry_points(&self) -> Vec<String> {
        typed_entry_points(&["resize_nearest", "resize_bilinear"])
    }
    fn colour(&self) -> &'static str {
        "#b7e4c7"
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        gpu_resize(ctx, node, self)
    }
    fn label(&self) -> String {
        let (size, scale) = self.size_scale();
        let how = match (size, scale) {
            (Some([h, w]), _) => format!(" -> {h}x{w}"),
            (_, Some([a, b])) if a == b => format!(" x{a}"),
            (_, Some([a, b])) => format!(" x{a},{b}"),
            _ => String::new(),
        };
        let corners = if matches!(self, Resize::Bilinear { align_corners: true, .. }) { " align_corners" } else { "" };
        format!("{}{how}{corners}", self.name())
    }
}

/// Nearest or bilinear resizing of an NHWC image (`resize_nearest_*`, `resize_bilinear_*` in
/// kernels/resize.cu) through per-axis index (and weight) tables, which come from the op's own
/// index arithmetic, the one the CPU reference uses.
fn gpu_resize(ctx: &mut BuildCtx, node: NodeId, op: &Resize) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let elem = same_elem(ctx, &[x, y])?;
    let (c, h, w) = nhwc(ctx, x)?;
    let (c2, oh, ow) = nhwc(ctx, y)?;
    if c2 != c || op.output_hw([h, w]).map_err(|e| ctx.err(node, LowerKind::Operands, e))? != [oh, ow] {
        return Err(ctx.err(node, LowerKind::Operands, format!("resize maps [{c}, {h}, {w}] to [{c2}, {oh}, {ow}]")));
    }
    let mut args = vec![Arg::Value(x), Arg::Value(y), Arg::Batch];
    for (name, v) in [("H", h), ("W", w), ("C", c), ("OH", oh), ("OW", ow)] {
        args.push(Arg::Const(KArg::I32(to_i32(ctx, name, v)?)));
    }
    let ints = |v: Vec<usize>| -> Vec<u8> { v.into_iter().flat_map(|i| (i as i32).to_le_bytes()).collect() };
    let (kind, tab, lam) = match *op {
        Resize::Nearest { scale, .. } => {
            let mut t = Resize::nearest_indices(scale.map(|s| s[0]), h, oh);
            t.extend(Resize::nearest_indices(scale.map(|s| s[1]), w, ow));
            ("resize_nearest", ints(t), None)
        }
        Resize::Bilinear { scale, align_corners, .. } => {
            let ty = Resize::linear_indices(scale.map(|s| s[0]), align_corners, h, oh);
            let tx = Resize::linear_indices(scale.map(|s| s[1]), align_corners, w, ow);
            let mut idx = Vec::with_capacity(2 * (oh + ow));
            let mut lam = Vec::with_capacity(2 * (oh + ow));
            for t in [&ty, &tx] {
                idx.extend(t.iter().map(|e| e.0));
                idx.extend(t.iter().map(|e| e.1));
                lam.extend(t.iter().map(|e| e.2));
                lam.extend(t.iter().map(|e| e.3));
            }
            ("resize_bilinear", ints(idx), Some(lam))
        }
    };
    args.push(Arg::buf(ctx.upload_bytes(&tab)?));
    if let Some(lam) = lam {
        args.push(Arg::buf(ctx.upload_f32(&lam)?));
    }
    let vec = if c % pack(elem) == 0 { pack(elem) } else { 1 };
    args.push(Arg::Const(KArg::I32((vec > 1) as i32)));
    let layer = KernelLayer::new(ctx, &format!("{kind}_{}", elem.suffix()), args, oh * ow * c)?;
    Ok(Box::new(layer.kind(format!("kernel:{kind}")).items(vec)))
}

/// `F.interpolate`'s modes that Kiln implements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InterpolateMode {
    /// PyTorch's `nearest` (the legacy rule, not `nearest-exact`): `nn.Upsample`'s default.
    #[default]
    Nearest,
    Bilinear,
}

/// The arguments of `nn.Upsample` / `F.interpolate`, with PyTorch's defaults (`mode="nearest"`,
/// `align_corners=None`, `recompute_scale_factor=None`). Give exactly one of `size` and
/// `scale_factor`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UpsampleConfig {
    pub size: Option<[usize; 2]>,
    pub scale_factor: Option<[f64; 2]>,
    pub mode: InterpolateMode,
    /// `None` is PyTorch's default (`False` for bilinear); `Some` with `nearest` is an error, as
    /// in PyTorch.
    pub align_corners: Option<bool>,
    /// `True`: the output size is computed from the scale factor, then the index arithmetic uses
    /// `in / out` as if that size had been given.
    pub recompute_scale_factor: bool,
}

impl UpsampleConfig {
    /// `size=(h, w)`.
    pub fn size(h: usize, w: usize) -> Self {
        Self { size: Some([h, w]), ..Self::default() }
    }
    /// `scale_factor=s` (both dims).
    pub fn scale(s: f64) -> Self {
        Self { scale_factor: Some([s, s]), ..Self::default() }
    }
    /// `scale_factor=(sh, sw)`.
    pub fn scale2(sh: f64, sw: f64) -> Self {
        Self { scale_factor: Some([sh, sw]), ..Self::default() }
    }
    /// `mode="bilinear"` with `align_corners`.
    pub fn bilinear(self, align_corners: bool) -> Self {
        Self { mode: InterpolateMode::Bilinear, align_corners: Some(align_corners), ..self }
    }
    pub fn recompute_scale_factor(self, recompute: bool) -> Self {
        Self { recompute_scale_factor: recompute, ..self }
    }

    /// The op for an input of `shape` (NCHW), or why these arguments do not fit it.
    pub fn op(&self, shape: &[usize]) -> Result<Resize, OpError> {
        let (mut size, mut scale) = (self.size, self.scale_factor);
        if self.recompute_scale_factor {
            if size.is_some() {
                return Err("recompute_scale_factor is not meaningful with an explicit size".into());
            }
            let probe = Resize::Nearest { size, scale };
            let hw = <[usize; 2]>::try_from(shape.get(2..).unwrap_or(&[]))
                .map_err(|_| format!("interpolate expects an NCHW input (rank 4), got {shape:?}"))?;
            size = Some(probe.output_hw(hw)?);
            scale = None;
        }
        match (self.mode, self.align_corners) {
            (InterpolateMode::Nearest, None) => Ok(Resize::Nearest { size, scale }),
            (InterpolateMode::Nearest, Some(_)) => {
                Err("align_corners option can only be set with the interpolating modes: linear | bilinear | bicubic | trilinear".into())
            }
            (InterpolateMode::Bilinear, a) => Ok(Resize::Bilinear { size, scale, align_corners: a.unwrap_or(false) }),
        }
    }
}

fn resize_op(x: &Tensor, config: &UpsampleConfig, path: &str) -> Result<Op> {
    config.op(x.shape()).map(Op::Resize).map_err(|reason| crate::Error::Shape {
        path: path.to_string(),
        op: "interpolate".into(),
        reason,
        got: vec![x.shape().to_vec()],
    })
}

/// `torch.nn.Upsample(size | scale_factor, mode, align_corners, recompute_scale_factor)`.
#[derive(Clone, Debug)]
pub struct Upsample {
    pub path: String,
    pub config: UpsampleConfig,
}

impl Module for Upsample {
    type Config = UpsampleConfig;
    fn load(vb: VarBuilder, config: &UpsampleConfig) -> Result<Self> {
        Ok(Self { path: vb.path().to_string(), config: *config })
    }
}

impl Forward for Upsample {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::record(&self.path, resize_op(x, &self.config, &self.path)?, &[x], &[])
    }
}

impl Tensor {
    /// `F.interpolate(x, size | scale_factor, mode, align_corners, recompute_scale_factor)`, inline.
    pub fn interpolate(&self, config: &UpsampleConfig) -> Result<Tensor> {
        Tensor::record_inline(resize_op(self, config, "interpolate")?, &[self])
    }
}

/// This family's `kiln::nn` layers, each traced on an input (for `ops::completeness`).
#[doc(hidden)]
pub const NN_LAYERS: &[NnLayer] = &[
    ("Upsample", |vb, t| nn::Upsample::load(vb, &nn::UpsampleConfig::scale(2.0))?.forward(&t.input("x", &[1, 3, 4, 4]))),
    ("Upsample", |vb, t| nn::Upsample::load(vb, &nn::UpsampleConfig::size(6, 6).bilinear(false))?.forward(&t.input("x", &[1, 3, 4, 4]))),
];

/// The ATen ops kiln-torch imports as this family's ops.
#[doc(hidden)]
pub const ATEN: &[AtenImport] = &[
    ("upsample_nearest2d", &["aten.upsample_nearest2d.vec", "aten.upsample_nearest2d.default"]),
    ("upsample_bilinear2d", &["aten.upsample_bilinear2d.vec", "aten.upsample_bilinear2d.default"]),
];

/// The Kiln twins of this family's PyTorch op fixtures (`op_cases()` in tools/export_reference.py):
/// `nn.Upsample` modules and inline `F.interpolate` calls.
#[doc(hidden)]
pub const FIXTURE_TWINS: &[FixtureTwin] = &[
    ("upsample_nearest2d_scale2", |f| Upsample::load(f.vb, &UpsampleConfig::scale(2.0))?.forward(f.x)),
    ("upsample_nearest2d_scale1_5", |f| Upsample::load(f.vb, &UpsampleConfig::scale(1.5))?.forward(f.x)),
    ("upsample_nearest2d_scale1_7", |f| f.x.interpolate(&UpsampleConfig::scale(1.7))),
    ("upsample_nearest2d_recompute", |f| f.x.interpolate(&UpsampleConfig::scale(1.7).recompute_scale_factor(true))),
    ("upsample_nearest2d_scale_hw", |f| Upsample::load(f.vb, &UpsampleConfig::scale2(2.0, 1.5))?.forward(f.x)),
    ("upsample_nearest2d_scale_near1", |f| Upsample::load(f.vb, &UpsampleConfig::scale(1.05))?.forward(f.x)),
    ("upsample_nearest2d_size", |f| Upsample::load(f.vb, &UpsampleConfig::size(11, 4))?.forward(f.x)),
    ("upsample_bilinear2d_scale2", |f| Upsample::load(f.vb, &UpsampleConfig::scale(2.0).bilinear(false))?.forward(f.x)),
    ("upsample_bilinear2d_scale2_align_corners", |f| Upsample::load(f.vb, &UpsampleConfig::scale(2.0).bilinear(true))?.forward(f.x)),
    ("upsample_bilinear2d_scale1_5", |f| Upsample::load(f.vb, &UpsampleConfig::scale(1.5).bilinear(false))?.forward(f.x)),
    ("upsample_bilinear2d_scale1_7", |f| f.x.interpolate(&UpsampleConfig::scale(1.7).bilinear(false))),
    ("upsample_bilinear2d_down", |f| f.x.interpolate(&UpsampleConfig::scale(0.6).bilinear(false))),
    ("upsample_bilinear2d_size", |f| Upsample::load(f.vb, &UpsampleConfig::size(9, 13).bilinear(false))?.forward(f.x)),
    ("upsample_bilinear2d_size_align_corners", |f| Upsample::load(f.vb, &UpsampleConfig::size(9, 4).bilinear(true))?.forward(f.x)),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_uses_the_given_scale_factor_and_pytorchs_special_cases() {
        // in 7, scale 1.7: out floor(11.9) = 11; 1/1.7 picks index 5 at 10, 7/11 would pick 6.
        let op = Resize::Nearest { size: None, scale: Some([1.7, 1.7]) };
        assert_eq!(op.output_hw([7, 7]).unwrap(), [11, 11]);
        assert_eq!(Resize::nearest_indices(Some(1.7), 7, 11)[10], 5);
        assert_eq!(Resize::nearest_indices(None, 7, 11)[10], 6);
        // An output as large as the input copies, whatever the scale.
        assert_eq!(Resize::nearest_indices(Some(1.05), 10, 10), (0..10).collect::<Vec<_>>());
        assert_eq!(Resize::nearest_indices(Some(2.0), 3, 6), [0, 0, 1, 1, 2, 2]);
    }

    #[test]
    fn bilinear_corners_and_edges() {
        let t = Resize::linear_indices(None, true, 3, 5);
        assert_eq!(t[0], (0, 1, 1.0, 0.0));
        assert_eq!(t[4], (2, 2, 1.0, 0.0));
        assert_eq!(t[1], (0, 1, 0.5, 0.5));
        let t = Resize::linear_indices(Some(2.0), false, 3, 6);
        assert_eq!(t[0], (0, 1, 1.0, 0.0), "negative source indices clamp to 0");
        // src 2.25: both neighbours clamp to the edge pixel (PyTorch keeps the weights 0.75, 0.25).
        assert_eq!(t[5], (2, 2, 0.75, 0.25), "the last neighbour clamps to the edge");
    }

    #[test]
    fn shapes_and_errors() {
        let op = UpsampleConfig::scale(1.5).bilinear(false).op(&[2, 3, 5, 7]).unwrap();
        assert_eq!(op.infer_shape(&[&[2, 3, 5, 7]]).unwrap(), [2, 3, 7, 10]);
        assert!(UpsampleConfig::scale(2.0).bilinear(true).recompute_scale_factor(true).op(&[1, 1, 3, 3]).is_ok());
        let nearest_corners = UpsampleConfig { align_corners: Some(true), ..UpsampleConfig::scale(2.0) };
        assert!(nearest_corners.op(&[1, 1, 3, 3]).unwrap_err().to_string().contains("align_corners"));
        let none = Resize::Nearest { size: None, scale: None };
        assert!(none.infer_shape(&[&[1, 1, 3, 3]]).unwrap_err().to_string().contains("exactly one"));
        let tiny = Resize::Nearest { size: None, scale: Some([0.2, 0.2]) };
        assert!(tiny.infer_shape(&[&[1, 1, 3, 3]]).unwrap_err().to_string().contains("greater than 0"));
        assert!(tiny.infer_shape(&[&[1, 3, 3]]).unwrap_err().to_string().contains("rank 4"));
        let huge = Resize::Nearest { size: None, scale: Some([1e30, 1.0]) };
        assert!(huge.infer_shape(&[&[1, 1, 3, 3]]).is_err());
        let nan = Resize::Nearest { size: None, scale: Some([f64::NAN, 1.0]) };
        assert!(nan.infer_shape(&[&[1, 1, 3, 3]]).is_err());
    }
}
