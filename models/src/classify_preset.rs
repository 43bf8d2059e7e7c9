//! torchvision's classification preset as a custom op, `classify_preset`: decoded frames in, a
//! classifier's input out, so an engine can take camera frames as they are.
//!
//! Input `frame`: `[N, H, W * 3]`, each row a frame row of interleaved bytes, R, G, B (the `image`
//! crate's and PIL's order) or, with the attribute `bgr` = 1, B, G, R (OpenCV's); declared u8
//! (`frame_input`), an engine uploads it one byte per element and its entry reformat gives this op
//! the byte values in the engine's precision. Output `[N, 3, crop_h, crop_w]`:
//!
//! ```text
//! F.resize(img, [resize], BILINEAR, antialias=True)   # on a PIL image: PIL's Image.resize
//! F.center_crop(img, [crop_h, crop_w])                # zeros where the crop is larger
//! F.pil_to_tensor, F.convert_image_dtype(float)       # / 255 in f32
//! F.normalize(mean, std)                              # (x - mean) / std in f32
//! ```
//!
//! which is what `weights.transforms()` of a torchvision classifier does to a PIL image, and what
//! kiln-vision's `ClassifyPreset` does on the CPU: PIL's antialiased bilinear filter with its
//! 22-bit fixed-point weights, horizontal pass first, each pass rounded to a level. The geometry
//! (`shorter_side_to`, `pil_resize_crop_taps`: PIL's taps at the crop's positions) is `kiln::image`'s,
//! shared with kiln-vision. The arithmetic is integer until the normalisation, and that is the
//! same f32 operations on the GPU (never contracted), so the GPU layer matches this CPU reference
//! exactly in FP32 and to f16 rounding (half an ulp, at most 2^-10 for |x| < 4) in FP16.
//! `tools/classify_preset_reference.py` checks it against torchvision itself.
//!
//! A frame value that is no byte level (an f32 frame input) is rounded half to even and clamped
//! to 0..=255 first.

use crate::yolo_letterbox::frame_input as letterbox_frame_input;
use kiln::image::ChannelOrder;
use kiln::image::{pil_clip8, pil_resize_crop_taps, shorter_side_to, PilTaps};
use kiln::plugin::{Attrs, CustomOp};
use kiln::{Error, HostTensor, Result, Tensor, Tracer};

/// The preset's kernels (`models/kernels/classify_preset.cu`).
pub const CLASSIFY_PRESET_CU: &str = include_str!("../kernels/classify_preset.cu");

pub fn classify_preset_entry_points() -> Vec<String> {
    vec!["classify_preset_f32".into(), "classify_preset_f16".into()]
}

/// A classifier's preprocessing: shorter side to `resize`, the centre `crop` (h, w), then
/// `(x / 255 - mean) / std` per channel (R, G, B), from frames whose pixels are in `order`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Preset {
    pub resize: usize,
    pub crop: [usize; 2],
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub order: ChannelOrder,
}

impl Default for Preset {
    fn default() -> Self {
        Self::IMAGENET
    }
}

impl Preset {
    /// torchvision's `IMAGENET1K_V1` preset of most classifiers: `Resize(256)`, `CenterCrop(224)`,
    /// ImageNet's mean and std, RGB frames.
    pub const IMAGENET: Self =
        Self { resize: 256, crop: [224, 224], mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225], order: ChannelOrder::Rgb };

    /// The preset for a model input of `size` x `size`, resizing to `size * 256 / 224` as
    /// kiln-vision's `ClassifyPreset::for_input` does.
    pub fn for_input(size: usize) -> Self {
        Self { resize: size * 256 / 224, crop: [size, size], ..Self::IMAGENET }
    }

    /// The op's attributes.
    fn attrs(&self) -> Vec<(&'static str, f64)> {
        let [m, s] = [self.mean, self.std].map(|v| v.map(f64::from));
        vec![
            ("resize", self.resize as f64),
            ("crop_h", self.crop[0] as f64),
            ("crop_w", self.crop[1] as f64),
            ("mean_r", m[0]),
            ("mean_g", m[1]),
            ("mean_b", m[2]),
            ("std_r", s[0]),
            ("std_g", s[1]),
            ("std_b", s[2]),
            ("bgr", self.order.bgr_attr()),
        ]
    }

    /// The preset the op's attributes say (`bgr` absent: RGB), or why they say none.
    fn from_attrs(attrs: &Attrs) -> std::result::Result<Self, String> {
        let size = |key: &str| {
            let v = attrs.get(key).copied().ok_or_else(|| format!("attribute {key} is required"))?;
            if !(v >= 1.0 && v.fract() == 0.0 && v <= 16384.0) {
                return Err(format!("attribute {key} must be an integer in [1, 16384], got {v}"));
            }
            Ok(v as usize)
        };
        let number = |key: &str, default: f32| -> std::result::Result<f32, String> {
            let v = attrs.get(key).map_or(default, |&v| v as f32);
            if !v.is_finite() {
                return Err(format!("attribute {key} must be finite, got {v}"));
            }
            Ok(v)
        };
        let d = Self::IMAGENET;
        let mean = [number("mean_r", d.mean[0])?, number("mean_g", d.mean[1])?, number("mean_b", d.mean[2])?];
        let std = [number("std_r", d.std[0])?, number("std_g", d.std[1])?, number("std_b", d.std[2])?];
        if let Some(s) = std.iter().find(|s| **s == 0.0) {
            return Err(format!("attributes std_r, std_g, std_b must be non-zero, got {s}"));
        }
        let order = ChannelOrder::from_bgr_attr(attrs.get("bgr").copied(), ChannelOrder::Rgb)?;
        Ok(Self { resize: size("resize")?, crop: [size("crop_h")?, size("crop_w")?], mean, std, order })
    }
}

/// The frame input of a model behind `classify_preset`: `[batch, h, w * 3]` interleaved bytes,
/// declared u8 (the same input as `yolo_letterbox`'s).
pub fn frame_input(tracer: &Tracer, name: &str, batch: usize, hw: [usize; 2]) -> Tensor {
    letterbox_frame_input(tracer, name, batch, hw)
}

/// Applies `classify_preset` to `frame` `[N, H, W * 3]`: `[N, 3, crop_h, crop_w]`.
pub fn classify_preset(frame: &Tensor, preset: &Preset) -> Result<Tensor> {
    frame.custom("classify_preset", &preset.attrs(), &[])
}

/// Where each output pixel reads: per crop row and per crop column, the PIL taps of its resized
/// row or column, or `None` where the crop pads with zeros.
pub struct Plan {
    pub frame: [usize; 2],
    pub rows: Vec<Option<PilTaps>>,
    pub cols: Vec<Option<PilTaps>>,
}

impl Plan {
    /// The taps of a `frame` (h, w) through `preset`.
    pub fn new(frame: [usize; 2], preset: &Preset) -> Self {
        let [nh, nw] = shorter_side_to(frame, preset.resize);
        // Only the cropped positions' taps: a thin frame's longer side may resize to millions.
        Self { frame, rows: pil_resize_crop_taps(frame[0], nh, preset.crop[0]), cols: pil_resize_crop_taps(frame[1], nw, preset.crop[1]) }
    }

    /// The level of output pixel (`y`, `x`) from source levels `at(row, column)`: the horizontal
    /// pass rounded to a level, then the vertical, as PIL does.
    pub fn level(&self, y: usize, x: usize, at: impl Fn(usize, usize) -> i64) -> u8 {
        let (Some(ty), Some(tx)) = (&self.rows[y], &self.cols[x]) else { return 0 };
        let mut sum = 0i64;
        for (k, &wy) in ty.weights.iter().enumerate() {
            let row: i64 = tx.weights.iter().enumerate().map(|(j, &wx)| at(ty.first + k, tx.first + j) * i64::from(wx)).sum();
            sum += i64::from(pil_clip8(row)) * i64::from(wy);
        }
        pil_clip8(sum)
    }

    /// One axis's taps as the GPU reads them: per position `first, count, weights...` padded
    /// with zeros to the longest, `first` = -1 in the padding; and that row length.
    fn table(taps: &[Option<PilTaps>]) -> (Vec<f32>, usize) {
        let stride = 2 + taps.iter().flatten().map(|t| t.weights.len()).max().unwrap_or(0);
        let mut out = vec![0f32; taps.len() * stride];
        for (row, t) in out.chunks_mut(stride).zip(taps) {
            match t {
                // Exact in f32: positions below 2^16, weights at most 2^22.
                Some(t) => {
                    row[0] = t.first as f32;
                    row[1] = t.weights.len() as f32;
                    for (w, &k) in row[2..].iter_mut().zip(&t.weights) {
                        *w = k as f32;
                    }
                }
                None => row[0] = -1.0,
            }
        }
        (out, stride)
    }
}

/// A frame value as a byte level: rounded half to even, clamped.
fn byte(v: f32) -> i64 {
    v.round_ties_even().clamp(0.0, 255.0) as i64
}

/// The frame's (h, w) and the preset, or why they do not fit.
fn geometry(attrs: &Attrs, inputs: &[&[usize]]) -> std::result::Result<([usize; 2], Preset), String> {
    let preset = Preset::from_attrs(attrs)?;
    let [x] = inputs else {
        return Err(format!("classify_preset expects 1 input (the frame), got {}", inputs.len()));
    };
    if x.len() != 3 || x[2] % 3 != 0 || x[1] == 0 || x[2] == 0 {
        return Err(format!("the frame must be [N, H, W * 3] (interleaved {:?} rows), got {x:?}", preset.order));
    }
    if x[1] > 1 << 16 || x[2] / 3 > 1 << 16 {
        return Err(format!("the frame {x:?} exceeds 65536 pixels on a side"));
    }
    Ok(([x[1], x[2] / 3], preset))
}

fn preset_shape(attrs: &Attrs, inputs: &[&[usize]]) -> std::result::Result<Vec<usize>, String> {
    let (_, p) = geometry(attrs, inputs)?;
    Ok(vec![inputs[0][0], 3, p.crop[0], p.crop[1]])
}

fn preset_cpu(attrs: &Attrs, inputs: &[&HostTensor]) -> Result<HostTensor> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let ([h, w], p) = geometry(attrs, &shapes).map_err(|reason| Error::Shape {
        path: "classify_preset".into(),
        op: "classify_preset".into(),
        reason: reason.into(),
        got: shapes.iter().map(|s| s.to_vec()).collect(),
    })?;
    let plan = Plan::new([h, w], &p);
    let ([ch, cw], n) = (p.crop, inputs[0].shape[0]);
    let mut out = vec![0f32; n * 3 * ch * cw];
    for img in 0..n {
        let f = &inputs[0].data[img * h * w * 3..(img + 1) * h * w * 3];
        for c in 0..3 {
            let sc = p.order.source_channel(c);
            for y in 0..ch {
                for x in 0..cw {
                    let level = plan.level(y, x, |sy, sx| byte(f[(sy * w + sx) * 3 + sc]));
                    out[((img * 3 + c) * ch + y) * cw + x] = (f32::from(level) / 255.0 - p.mean[c]) / p.std[c];
                }
            }
        }
    }
    Ok(HostTensor::new(vec![n, 3, ch, cw], out))
}

kiln::inventory::submit! {
    CustomOp { name: "classify_preset", infer_shape: preset_shape, cpu: preset_cpu }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(p: &Preset) -> Attrs {
        p.attrs().into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    #[test]
    fn attributes_round_trip_and_bad_ones_are_errors() {
        let p = Preset { resize: 40, crop: [32, 24], order: ChannelOrder::Bgr, ..Preset::IMAGENET };
        assert_eq!(Preset::from_attrs(&attrs(&p)), Ok(p));
        assert_eq!(preset_shape(&attrs(&p), &[&[2, 10, 30]]).expect("shape"), [2, 3, 32, 24]);
        assert!(preset_shape(&attrs(&p), &[&[1, 10, 31]]).unwrap_err().contains("W * 3"));
        let mut a = attrs(&p);
        a.remove("crop_w");
        assert!(preset_shape(&a, &[&[1, 10, 30]]).unwrap_err().contains("crop_w"));
        let mut a = attrs(&p);
        a.insert("std_g".into(), 0.0);
        assert!(preset_shape(&a, &[&[1, 10, 30]]).unwrap_err().contains("non-zero"));
        // Without `bgr` the frame is RGB.
        let mut a = attrs(&p);
        a.remove("bgr");
        assert_eq!(Preset::from_attrs(&a).expect("rgb").order, ChannelOrder::Rgb);
    }

    /// A flat frame stays flat through any resize; the zero padding of a larger crop normalises
    /// to -mean / std; BGR frames read their channels swapped.
    #[test]
    fn flat_frames_stay_flat_and_padding_is_zero() {
        let (h, w) = (9, 13);
        let frame = HostTensor::new(vec![1, h, w * 3], (0..h * w).flat_map(|_| [250.0, 3.0, 128.0]).collect());
        let p = Preset { resize: 6, crop: [8, 4], ..Preset::IMAGENET };
        let out = preset_cpu(&attrs(&p), &[&frame]).expect("preset");
        // 9x13 -> 6x8; the 8-row crop pads one row above and one below.
        let at = |c: usize, y: usize, x: usize| out.data[(c * 8 + y) * 4 + x];
        assert_eq!(at(0, 3, 2), (250.0 / 255.0 - 0.485) / 0.229);
        assert_eq!(at(2, 6, 0), (128.0 / 255.0 - 0.406) / 0.225);
        assert_eq!(at(1, 0, 1), (0.0 - 0.456) / 0.224, "padding row");
        assert_eq!(at(1, 7, 1), (0.0 - 0.456) / 0.224, "padding row");
        let bgr = Preset { order: ChannelOrder::Bgr, ..p };
        let swapped = preset_cpu(&attrs(&bgr), &[&frame]).expect("bgr");
        assert_eq!(swapped.data[(2 * 8 + 3) * 4 + 2], (250.0 / 255.0 - 0.406) / 0.225);
    }
}

// ---- GPU converter (kernels/classify_preset.cu) ------------------------------------------------

mod gpu {
    use super::{geometry, Plan};
    use crate::frame_stage::frame_stage;
    use kiln::plugin::{BuildCtx, KArg, Layer};
    use kiln::{NodeId, Result};

    pub fn convert_preset(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        let stage = frame_stage(ctx, node, "classify_preset")?;
        let ([h, w], preset) = geometry(stage.attrs, &[&stage.per_image]).map_err(|r| ctx.err(node, kiln::LowerKind::Operands, r))?;
        let plan = Plan::new([h, w], &preset);
        let ((rows, rs), (cols, cs)) = (Plan::table(&plan.rows), Plan::table(&plan.cols));
        let [ch, cw] = preset.crop;
        let mut dims: Vec<KArg> = [h, w, ch, cw, rs, cs].map(|v| KArg::I32(v as i32)).to_vec();
        dims.push(KArg::I32(i32::from(preset.order == super::ChannelOrder::Bgr)));
        dims.extend(preset.mean.iter().chain(&preset.std).map(|&v| KArg::F32(v)));
        dims.extend(stage.strides());
        let kind = format!("kernel:classify_preset({h}x{w} {:?} -> {} -> {ch}x{cw})", preset.order, preset.resize);
        let source = ("classify_preset.cu", super::CLASSIFY_PRESET_CU);
        stage.layer(ctx, source, [&rows, &cols], dims, ch * cw, kind)
    }
}

kiln::register_converter!("classify_preset", gpu::convert_preset);
