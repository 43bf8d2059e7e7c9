//! YOLO preprocessing as a custom op, `yolo_letterbox`: a decoded frame in, the model's input out.
//!
//! Input `frame`: `[N, H, W * 3]`, each row a frame row of interleaved bytes, B, G, R (the `uint8`
//! HWC image OpenCV decodes) or, with the attribute `bgr` = 0 (`letterbox_with(..,
//! ChannelOrder::Rgb)`), R, G, B (the `image` crate's and PIL's); without it the frame is BGR, as
//! it always was. Output `[N, 3, input_h, input_w]`: Ultralytics' `LetterBox(new_shape,
//! auto=False, scaleup=True, center=True)` (resize keeping the aspect ratio to `round(w * r) x
//! round(h * r)`, pad with 114, `round(dw -/+ 0.1)` on each side), RGB planes divided by 255.
//! The geometry and the per-level arithmetic are `kiln::image`'s, which
//! kiln-vision's CPU `letterbox` uses too.
//!
//! The frame is a u8 input (`frame_input`, `Tracer::input_typed(.., DType::U8)`): an engine
//! uploads it one byte per element (a 1080p frame: 6 MB, where f32 values took 25 MB) and its
//! entry reformat converts the bytes to the engine's precision, so this op reads f32 or f16
//! values 0..=255 (exact in both) as any op reads its input. `ExecutionContext::run` and
//! `cpu::run` take the bytes as a `ByteTensor`; f32 values that are integers in 0..=255 are
//! accepted too. A frame traced as an f32 input (`Tracer::input`) still works, at 4 bytes a value.
//!
//! Resize: bilinear with half-pixel centres, as OpenCV's `INTER_LINEAR` (source coordinate
//! `(d + 0.5) * (src / dst) - 0.5`, clamped to the edge), rounded to an integer level as
//! OpenCV's `uint8` output is. OpenCV computes with 11-bit fixed-point weights, this op with f32
//! weights, so a pixel may differ from OpenCV's by one level (1/255 after scaling); it matches the
//! numpy reference (`tools/yolo_letterbox_reference.py`) exactly. The GPU layer reads the same
//! per-row and per-column tables (computed here, uploaded once) and does the same f32 arithmetic
//! without contraction, so it matches this CPU reference exactly.
//!
//! Map detections back with `yolo_nms`' `frame_h`/`frame_w`/`input_h`/`input_w` attributes.

use kiln::image::ChannelOrder;
use kiln::image::{letterbox_level, Letterbox, Tap, LETTERBOX_PAD};
use kiln::plugin::{Attrs, CustomOp};
use kiln::HostTensor;
use kiln::{DType, Error, Result, Tensor, Tracer};

/// The padding value of Ultralytics' letterbox.
pub const PAD: f32 = LETTERBOX_PAD as f32;

/// The letterbox's kernels (`models/kernels/letterbox.cu`).
pub const LETTERBOX_CU: &str = include_str!("../kernels/letterbox.cu");

pub fn letterbox_entry_points() -> Vec<String> {
    vec!["letterbox_f32".into(), "letterbox_f16".into()]
}

/// The frame input of a letterboxed model: `[batch, h, w * 3]` interleaved bytes (B, G, R unless
/// the op is told RGB), declared u8 so an engine uploads the decoded frame as it is.
pub fn frame_input(tracer: &Tracer, name: &str, batch: usize, [h, w]: [usize; 2]) -> Tensor {
    tracer.input_typed(name, &[batch, h, w * 3], DType::U8)
}

/// Applies `yolo_letterbox` to a BGR `frame` `[N, H, W * 3]` for a model input of `input` (h, w).
pub fn letterbox(frame: &Tensor, input: [usize; 2]) -> Result<Tensor> {
    frame.custom("yolo_letterbox", &[("input_h", input[0] as f64), ("input_w", input[1] as f64)], &[])
}

/// Applies `yolo_letterbox` to a `frame` `[N, H, W * 3]` whose pixels are in `order`.
pub fn letterbox_with(frame: &Tensor, input: [usize; 2], order: ChannelOrder) -> Result<Tensor> {
    let attrs = [("input_h", input[0] as f64), ("input_w", input[1] as f64), ("bgr", order.bgr_attr())];
    frame.custom("yolo_letterbox", &attrs, &[])
}

/// (row taps, column taps) of a `frame` (h, w) letterboxed to `input` (h, w).
pub fn taps(frame: [usize; 2], input: [usize; 2]) -> (Vec<Tap>, Vec<Tap>) {
    Letterbox::new(frame, input).taps()
}

fn size_attr(attrs: &Attrs, key: &str) -> std::result::Result<usize, String> {
    let v = attrs.get(key).copied().ok_or_else(|| format!("attribute {key} is required"))?;
    if !(v >= 1.0 && v.fract() == 0.0 && v <= 16384.0) {
        return Err(format!("attribute {key} must be an integer in [1, 16384], got {v}"));
    }
    Ok(v as usize)
}

/// The frame's (h, w), the input's (h, w) and the frame's channel order, or why they do not fit.
fn geometry(attrs: &Attrs, inputs: &[&[usize]]) -> std::result::Result<([usize; 2], [usize; 2], ChannelOrder), String> {
    let input = [size_attr(attrs, "input_h")?, size_attr(attrs, "input_w")?];
    let order = ChannelOrder::from_bgr_attr(attrs.get("bgr").copied(), ChannelOrder::Bgr)?;
    let [x] = inputs else {
        return Err(format!("yolo_letterbox expects 1 input (the frame), got {}", inputs.len()));
    };
    if x.len() != 3 || x[2] % 3 != 0 || x[1] == 0 || x[2] == 0 {
        return Err(format!("the frame must be [N, H, W * 3] (interleaved {order:?} rows), got {x:?}"));
    }
    if x[1] > 1 << 16 || x[2] / 3 > 1 << 16 {
        return Err(format!("the frame {x:?} exceeds 65536 pixels on a side"));
    }
    Ok(([x[1], x[2] / 3], input, order))
}

fn letterbox_shape(attrs: &Attrs, inputs: &[&[usize]]) -> std::result::Result<Vec<usize>, String> {
    let (_, [ih, iw], _) = geometry(attrs, inputs)?;
    Ok(vec![inputs[0][0], 3, ih, iw])
}

fn letterbox_cpu(attrs: &Attrs, inputs: &[&HostTensor]) -> Result<HostTensor> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let ([h, w], [ih, iw], order) = geometry(attrs, &shapes).map_err(|reason| Error::Shape {
        path: "yolo_letterbox".into(),
        op: "yolo_letterbox".into(),
        reason: reason.into(),
        got: shapes.iter().map(|s| s.to_vec()).collect(),
    })?;
    let (rows, cols) = taps([h, w], [ih, iw]);
    let n = inputs[0].shape[0];
    let mut out = vec![0f32; n * 3 * ih * iw];
    for img in 0..n {
        let f = &inputs[0].data[img * h * w * 3..(img + 1) * h * w * 3];
        for (y, ty) in rows.iter().enumerate() {
            for (x, tx) in cols.iter().enumerate() {
                for c in 0..3 {
                    let v = match (ty, tx) {
                        (Some((y0, y1, wy0, wy1)), Some((x0, x1, wx0, wx1))) => {
                            let at = |yy: usize, xx: usize| f[(yy * w + xx) * 3 + order.source_channel(c)];
                            letterbox_level([at(*y0, *x0), at(*y0, *x1), at(*y1, *x0), at(*y1, *x1)], (*wx0, *wx1), (*wy0, *wy1))
                        }
                        _ => PAD,
                    };
                    out[((img * 3 + c) * ih + y) * iw + x] = v / 255.0;
                }
            }
        }
    }
    Ok(HostTensor::new(vec![n, 3, ih, iw], out))
}

kiln::inventory::submit! {
    CustomOp { name: "yolo_letterbox", infer_shape: letterbox_shape, cpu: letterbox_cpu }
}

/// The taps as the GPU reads them: per position (s0, s1, w0, w1), s0 = -1 in the padding.
fn tap_table(taps: &[Tap]) -> Vec<f32> {
    taps.iter().flat_map(|t| t.map_or([-1.0, -1.0, 0.0, 0.0], |(a, b, w0, w1)| [a as f32, b as f32, w0, w1])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(h: usize, w: usize) -> Attrs {
        [("input_h".to_string(), h as f64), ("input_w".to_string(), w as f64)].into_iter().collect()
    }

    #[test]
    fn a_same_size_frame_is_copied_with_channels_swapped() {
        let frame = HostTensor::new(vec![1, 2, 2 * 3], (0..12).map(|v| (v * 20) as f32).collect());
        let out = letterbox_cpu(&attrs(2, 2), &[&frame]).expect("letterbox");
        // Pixel (0, 0) is B=0, G=20, R=40: RGB planes start with 40, 20, 0.
        assert_eq!([out.data[0], out.data[4], out.data[8]], [40.0 / 255.0, 20.0 / 255.0, 0.0]);
        assert_eq!(out.data[3] * 255.0, 220.0, "R of pixel (1, 1)");
        // Told RGB, the same bytes are R=0, G=20, B=40; BGR said explicitly is the default.
        let mut rgb = attrs(2, 2);
        rgb.insert("bgr".into(), ChannelOrder::Rgb.bgr_attr());
        let out_rgb = letterbox_cpu(&rgb, &[&frame]).expect("rgb");
        assert_eq!([out_rgb.data[0], out_rgb.data[4], out_rgb.data[8]], [0.0, 20.0 / 255.0, 40.0 / 255.0]);
        rgb.insert("bgr".into(), ChannelOrder::Bgr.bgr_attr());
        assert_eq!(letterbox_cpu(&rgb, &[&frame]).expect("bgr"), out);
        rgb.insert("bgr".into(), 2.0);
        assert!(letterbox_cpu(&rgb, &[&frame]).unwrap_err().to_string().contains("bgr"));
    }

    #[test]
    fn bad_frames_are_errors() {
        assert!(letterbox_shape(&attrs(64, 64), &[&[1, 10, 31]]).unwrap_err().contains("W * 3"));
        assert!(letterbox_shape(&Attrs::new(), &[&[1, 10, 30]]).unwrap_err().contains("input_h"));
        assert_eq!(letterbox_shape(&attrs(64, 96), &[&[2, 10, 30]]).expect("shape"), [2, 3, 64, 96]);
    }
}

// ---- GPU converter (kernels/letterbox.cu) ------------------------------------------------------

mod gpu {
    use super::{geometry, tap_table, taps};
    use crate::frame_stage::frame_stage;
    use kiln::plugin::{BuildCtx, KArg, Layer};
    use kiln::{NodeId, Result};

    pub fn convert_letterbox(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        let stage = frame_stage(ctx, node, "yolo_letterbox")?;
        let ([h, w], [ih, iw], order) =
            geometry(stage.attrs, &[&stage.per_image]).map_err(|r| ctx.err(node, kiln::LowerKind::Operands, r))?;
        let (rows, cols) = taps([h, w], [ih, iw]);
        let bgr = order == super::ChannelOrder::Bgr;
        let mut dims: Vec<KArg> = [h, w, ih, iw].map(|v| KArg::I32(v as i32)).to_vec();
        dims.extend(stage.strides());
        dims.push(KArg::I32(i32::from(bgr)));
        let kind = format!("kernel:yolo_letterbox({h}x{w} {} -> {ih}x{iw})", if bgr { "BGR" } else { "RGB" });
        let source = ("letterbox.cu", super::LETTERBOX_CU);
        stage.layer(ctx, source, [&tap_table(&rows), &tap_table(&cols)], dims, ih * iw, kind)
    }
}

kiln::register_converter!("yolo_letterbox", gpu::convert_letterbox);
