//! YOLO preprocessing as a custom op, `yolo_letterbox`: a decoded frame in, the model's input out.
//!
//! Input `frame`: `[N, H, W * 3]`, each row a frame row of interleaved B, G, R bytes (the `uint8`
//! HWC image OpenCV decodes). Output `[N, 3, input_h, input_w]`: Ultralytics' `LetterBox(new_shape,
//! auto=False, scaleup=True, center=True)` (resize keeping the aspect ratio to `round(w * r) x
//! round(h * r)`, pad with 114, `round(dw -/+ 0.1)` on each side), BGR to RGB, divided by 255.
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

use kiln::plugin::{Attrs, CustomOp};
use kiln::HostTensor;
use kiln::{DType, Error, Result, Tensor, Tracer};

/// The padding value of Ultralytics' letterbox.
pub const PAD: f32 = 114.0;

/// The letterbox's kernels (`models/kernels/letterbox.cu`).
pub const LETTERBOX_CU: &str = include_str!("../kernels/letterbox.cu");

pub fn letterbox_entry_points() -> Vec<String> {
    vec!["letterbox_f32".into(), "letterbox_f16".into()]
}

/// The frame input of a letterboxed model: `[batch, h, w * 3]` B, G, R bytes, declared u8 so an
/// engine uploads the decoded frame as it is.
pub fn frame_input(tracer: &Tracer, name: &str, batch: usize, [h, w]: [usize; 2]) -> Tensor {
    tracer.input_typed(name, &[batch, h, w * 3], DType::U8)
}

/// Applies `yolo_letterbox` to `frame` `[N, H, W * 3]` for a model input of `input` (h, w).
pub fn letterbox(frame: &Tensor, input: [usize; 2]) -> Result<Tensor> {
    frame.custom("yolo_letterbox", &[("input_h", input[0] as f64), ("input_w", input[1] as f64)], &[])
}

/// One output row or column: the two source taps and their weights, or `None` in the padding.
pub type Tap = Option<(usize, usize, f32, f32)>;

/// LetterBox's geometry along one axis: `src` pixels resized to `new` and padded to `dst`,
/// `before` pixels of padding first. Returns the taps of every output position.
fn axis_taps(src: usize, new: usize, dst: usize, before: usize) -> Vec<Tap> {
    // OpenCV: inv_scale = dsize / ssize, scale = 1 / inv_scale, in double.
    let scale = 1.0 / (new as f64 / src as f64);
    (0..dst)
        .map(|o| {
            let d = o.checked_sub(before).filter(|&d| d < new)?;
            if new == src {
                return Some((d, d, 1.0, 0.0));
            }
            let f = ((d as f64 + 0.5) * scale - 0.5) as f32;
            let s = f.floor();
            let (mut s0, mut w1) = (s as i64, f - s);
            if s0 < 0 {
                (s0, w1) = (0, 0.0);
            }
            if s0 >= src as i64 - 1 {
                (s0, w1) = (src as i64 - 1, 0.0);
            }
            let s0 = s0 as usize;
            Some((s0, (s0 + 1).min(src - 1), 1.0 - w1, w1))
        })
        .collect()
}

/// (row taps, column taps) of a `frame` (h, w) letterboxed to `input` (h, w).
pub fn taps(frame: [usize; 2], input: [usize; 2]) -> (Vec<Tap>, Vec<Tap>) {
    let [h, w] = frame;
    let [ih, iw] = input;
    let r = (ih as f64 / h as f64).min(iw as f64 / w as f64);
    let (nw, nh) = ((w as f64 * r).round_ties_even() as usize, (h as f64 * r).round_ties_even() as usize);
    let (nw, nh) = (nw.clamp(1, iw), nh.clamp(1, ih));
    let top = ((ih - nh) as f64 / 2.0 - 0.1).round_ties_even() as usize;
    let left = ((iw - nw) as f64 / 2.0 - 0.1).round_ties_even() as usize;
    (axis_taps(h, nh, ih, top), axis_taps(w, nw, iw, left))
}

/// One output level from the four source values and the taps' weights, in the GPU's order.
fn blend(p: [f32; 4], wx: (f32, f32), wy: (f32, f32)) -> f32 {
    let top = p[0] * wx.0 + p[1] * wx.1;
    let bottom = p[2] * wx.0 + p[3] * wx.1;
    (top * wy.0 + bottom * wy.1).round_ties_even().clamp(0.0, 255.0)
}

fn size_attr(attrs: &Attrs, key: &str) -> std::result::Result<usize, String> {
    let v = attrs.get(key).copied().ok_or_else(|| format!("attribute {key} is required"))?;
    if !(v >= 1.0 && v.fract() == 0.0 && v <= 16384.0) {
        return Err(format!("attribute {key} must be an integer in [1, 16384], got {v}"));
    }
    Ok(v as usize)
}

fn geometry(attrs: &Attrs, inputs: &[&[usize]]) -> std::result::Result<([usize; 2], [usize; 2]), String> {
    let input = [size_attr(attrs, "input_h")?, size_attr(attrs, "input_w")?];
    let [x] = inputs else {
        return Err(format!("yolo_letterbox expects 1 input (the frame), got {}", inputs.len()));
    };
    if x.len() != 3 || x[2] % 3 != 0 || x[1] == 0 || x[2] == 0 {
        return Err(format!("the frame must be [N, H, W * 3] (interleaved BGR rows), got {x:?}"));
    }
    if x[1] > 1 << 16 || x[2] / 3 > 1 << 16 {
        return Err(format!("the frame {x:?} exceeds 65536 pixels on a side"));
    }
    Ok(([x[1], x[2] / 3], input))
}

fn letterbox_shape(attrs: &Attrs, inputs: &[&[usize]]) -> std::result::Result<Vec<usize>, String> {
    let (_, [ih, iw]) = geometry(attrs, inputs)?;
    Ok(vec![inputs[0][0], 3, ih, iw])
}

fn letterbox_cpu(attrs: &Attrs, inputs: &[&HostTensor]) -> Result<HostTensor> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let ([h, w], [ih, iw]) = geometry(attrs, &shapes).map_err(|reason| Error::Shape {
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
                            // Output channel c (RGB) is frame channel 2 - c (BGR).
                            let at = |yy: usize, xx: usize| f[(yy * w + xx) * 3 + 2 - c];
                            blend([at(*y0, *x0), at(*y0, *x1), at(*y1, *x0), at(*y1, *x1)], (*wx0, *wx1), (*wy0, *wy1))
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
    fn pads_keep_the_aspect_and_centre() {
        // 40 x 80 frame into 64 x 64: r = 0.8, 32 x 64 resized, 16 rows of padding each side.
        let (rows, cols) = taps([40, 80], [64, 64]);
        assert_eq!(rows.iter().filter(|t| t.is_none()).count(), 32);
        assert!(rows[..16].iter().all(Option::is_none) && rows[48..].iter().all(Option::is_none));
        assert!(cols.iter().all(Option::is_some));
        // Odd padding: 64 - 45 = 19 rows: 9 above, 10 below (round(9.5 -/+ 0.1)).
        let (rows, _) = taps([45, 64], [64, 64]);
        assert!(rows[..9].iter().all(Option::is_none) && rows[9].is_some() && rows[53].is_some() && rows[54].is_none());
    }

    #[test]
    fn a_same_size_frame_is_copied_with_channels_swapped() {
        let frame = HostTensor::new(vec![1, 2, 2 * 3], (0..12).map(|v| (v * 20) as f32).collect());
        let out = letterbox_cpu(&attrs(2, 2), &[&frame]).expect("letterbox");
        // Pixel (0, 0) is B=0, G=20, R=40: RGB planes start with 40, 20, 0.
        assert_eq!([out.data[0], out.data[4], out.data[8]], [40.0 / 255.0, 20.0 / 255.0, 0.0]);
        assert_eq!(out.data[3] * 255.0, 220.0, "R of pixel (1, 1)");
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
    use kiln::internals::engine::launch::{grid_for, launch, CudaFunction, KArg};
    use kiln::plugin::{BuildCtx, DeviceBuf, Layer, RunCtx, ValueId};
    use kiln::Result;
    use kiln::{plugin::Op, NodeId};

    pub struct LetterboxLayer {
        path: String,
        f: CudaFunction,
        frame: ValueId,
        out: ValueId,
        rows: DeviceBuf,
        cols: DeviceBuf,
        /// H, W of the frame; input h, w; output strides (c, y, x) per image.
        dims: [usize; 4],
        strides: [usize; 3],
        sm_count: u32,
    }

    impl Layer for LetterboxLayer {
        fn path(&self) -> &str {
            &self.path
        }
        fn kind(&self) -> String {
            format!("kernel:yolo_letterbox({}x{} -> {}x{})", self.dims[0], self.dims[1], self.dims[2], self.dims[3])
        }
        fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
            let [h, w, ih, iw] = self.dims;
            let args = [
                KArg::Ptr(rt.ptr(self.frame)),
                KArg::Ptr(self.rows.ptr()),
                KArg::Ptr(self.cols.ptr()),
                KArg::I32(batch as i32),
                KArg::I32(h as i32),
                KArg::I32(w as i32),
                KArg::I32(ih as i32),
                KArg::I32(iw as i32),
                KArg::I64(self.strides[0] as i64),
                KArg::I64(self.strides[1] as i64),
                KArg::I64(self.strides[2] as i64),
                KArg::Ptr(rt.ptr(self.out)),
            ];
            launch(rt, &self.f, grid_for(batch * ih * iw, self.sm_count), (256, 1, 1), 0, &args)
        }
    }

    pub fn convert_letterbox(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        let Op::Custom(kiln::plugin::CustomCall { attrs, .. }) = &ctx.node(node).op else {
            return Err(ctx.err(node, kiln::LowerKind::Unsupported, "is not yolo_letterbox"));
        };
        let (frame, out) = (ctx.input(node, 0)?, ctx.output(node)?);
        let d = ctx.value(frame).clone();
        let per_image = [&[1][..], &d.dims].concat();
        let ([h, w], [ih, iw]) = geometry(attrs, &[&per_image]).map_err(|r| ctx.err(node, kiln::LowerKind::Operands, r))?;
        if d.layout.order() != [0, 1] {
            return Err(ctx.err(node, kiln::LowerKind::Unsupported, format!("the frame must be contiguous, got {:?}", d.layout)));
        }
        let o = ctx.value(out).clone();
        if o.elem != d.elem {
            return Err(ctx.err(
                node,
                kiln::LowerKind::Unsupported,
                format!("frame and output must share an element type, got {:?} and {:?}", d.elem, o.elem),
            ));
        }
        let s = o.layout.strides(&o.dims);
        let (rows, cols) = taps([h, w], [ih, iw]);
        let rows = ctx.upload_f32(&tap_table(&rows))?;
        let cols = ctx.upload_f32(&tap_table(&cols))?;
        ctx.kernels.add_source("letterbox.cu", super::LETTERBOX_CU)?;
        let f = ctx.kernels.get(&format!("letterbox_{}", d.elem.suffix()))?;
        Ok(Box::new(LetterboxLayer {
            path: ctx.node(node).path.clone(),
            f,
            frame,
            out,
            rows,
            cols,
            dims: [h, w, ih, iw],
            strides: [s[0], s[1], s[2]],
            sm_count: ctx.kernels.sm_count(),
        }))
    }
}

kiln::register_converter!("yolo_letterbox", gpu::convert_letterbox);
