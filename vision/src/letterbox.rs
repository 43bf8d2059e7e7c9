//! Ultralytics' `LetterBox(new_shape, auto=False, scaleup=True, center=True)`, the YOLO models'
//! preprocessing, on the CPU: resize keeping the aspect ratio to `round(w * r) x round(h * r)`
//! (`r` the smaller of the two ratios), pad with level 114 (`round(d -/+ 0.1)` on each side),
//! RGB planes divided by 255, as `[1, 3, h, w]` f32.
//!
//! The channel order of the pixels is said explicitly (`ChannelOrder`): OpenCV decodes BGR,
//! the `image` crate RGB, and the model wants RGB. The resize is bilinear with half-pixel
//! centres (OpenCV's `INTER_LINEAR`), each level rounded to an integer as OpenCV's `uint8` result
//! is, with the arithmetic of kiln-models' `yolo_letterbox` op (which reads BGR frames:
//! `frame_bytes` makes one from an RGB image), so both give the same tensor.

use crate::{Error, Result};
use image::RgbImage;
use kiln::{ByteTensor, HostTensor};

/// Ultralytics' padding level.
pub const PAD: u8 = 114;

/// The order of the three interleaved channels of each pixel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChannelOrder {
    /// R, G, B: the `image` crate, PIL, most Rust and Python decoders.
    Rgb,
    /// B, G, R: OpenCV's `imread` and video capture.
    Bgr,
}

/// The geometry of one letterbox: where the frame went in the model input.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Letterbox {
    /// Frame (height, width).
    pub frame: [usize; 2],
    /// Model input (height, width).
    pub input: [usize; 2],
    /// The resized frame (height, width) inside the input.
    pub resized: [usize; 2],
    /// Rows of padding above and columns to the left of the resized frame.
    pub top: usize,
    pub left: usize,
    /// The resize ratio, `min(input_h / frame_h, input_w / frame_w)`.
    pub gain: f64,
}

impl Letterbox {
    /// The letterbox of a `frame` (h, w) into a model `input` (h, w); both non-zero.
    pub fn new(frame: [usize; 2], input: [usize; 2]) -> Self {
        let ([h, w], [ih, iw]) = (frame, input);
        let gain = (ih as f64 / h as f64).min(iw as f64 / w as f64);
        // Python's round() of Ultralytics: half to even.
        let nw = ((w as f64 * gain).round_ties_even() as usize).clamp(1, iw);
        let nh = ((h as f64 * gain).round_ties_even() as usize).clamp(1, ih);
        let top = ((ih - nh) as f64 / 2.0 - 0.1).round_ties_even() as usize;
        let left = ((iw - nw) as f64 / 2.0 - 0.1).round_ties_even() as usize;
        Self { frame, input, resized: [nh, nw], top, left, gain }
    }

    /// A box `[x1, y1, x2, y2]` in model-input pixels mapped back onto the frame, as
    /// Ultralytics' `scale_boxes` does: minus the padding, divided by the gain, clipped.
    pub fn unmap_box(&self, b: [f32; 4]) -> [f32; 4] {
        let ([fh, fw], [ih, iw]) = (self.frame.map(|v| v as f64), self.input.map(|v| v as f64));
        let pad_x = ((iw - fw * self.gain) / 2.0 - 0.1).round_ties_even();
        let pad_y = ((ih - fh * self.gain) / 2.0 - 0.1).round_ties_even();
        let map = |v: f32, pad: f64, limit: f64| ((f64::from(v) - pad) / self.gain).clamp(0.0, limit) as f32;
        [map(b[0], pad_x, fw), map(b[1], pad_y, fh), map(b[2], pad_x, fw), map(b[3], pad_y, fh)]
    }
}

/// One output row or column: the two source positions and their weights, `None` in the padding.
type Tap = Option<(usize, usize, f32, f32)>;

/// The taps of `dst` outputs along an axis: `src` pixels resized to `new`, `before` padding first.
fn axis_taps(src: usize, new: usize, dst: usize, before: usize) -> Vec<Tap> {
    // OpenCV: inv_scale = dsize / ssize, scale = 1 / inv_scale, in f64; the position in f32.
    let scale = 1.0 / (new as f64 / src as f64);
    (0..dst)
        .map(|o| {
            let d = o.checked_sub(before).filter(|&d| d < new)?;
            if new == src {
                return Some((d, d, 1.0, 0.0));
            }
            let f = ((d as f64 + 0.5) * scale - 0.5) as f32;
            let s = f.floor();
            let (s0, w1) = if s < 0.0 {
                (0, 0.0)
            } else if s as usize >= src - 1 {
                (src - 1, 0.0)
            } else {
                (s as usize, f - s)
            };
            Some((s0, (s0 + 1).min(src - 1), 1.0 - w1, w1))
        })
        .collect()
}

/// Letterboxes an RGB image into a model input of (h, w) `input`: `[1, 3, h, w]` RGB in [0, 1].
pub fn letterbox(img: &RgbImage, input: [usize; 2]) -> Result<(HostTensor, Letterbox)> {
    letterbox_pixels(img.as_raw(), [img.height() as usize, img.width() as usize], ChannelOrder::Rgb, input)
}

/// Letterboxes interleaved 8-bit pixels (`frame` (h, w), channels in `order`) into a model input
/// of (h, w) `input`: `[1, 3, h, w]` RGB in [0, 1], and where the frame went.
pub fn letterbox_pixels(pixels: &[u8], frame: [usize; 2], order: ChannelOrder, input: [usize; 2]) -> Result<(HostTensor, Letterbox)> {
    let [h, w] = frame;
    let size_err = |reason: String| Error::Size { what: "letterbox".into(), reason };
    if h == 0 || w == 0 || input.contains(&0) {
        return Err(size_err(format!("frame {h}x{w} and input {}x{} must be non-empty", input[0], input[1])));
    }
    if h.checked_mul(w).and_then(|n| n.checked_mul(3)) != Some(pixels.len()) {
        return Err(size_err(format!("{} bytes are not a {h}x{w} frame of 3 channels", pixels.len())));
    }
    let geometry = Letterbox::new(frame, input);
    let [ih, iw] = input;
    let rows = axis_taps(h, geometry.resized[0], ih, geometry.top);
    let cols = axis_taps(w, geometry.resized[1], iw, geometry.left);
    let mut out = vec![0f32; 3 * ih * iw];
    for (y, ty) in rows.iter().enumerate() {
        for (x, tx) in cols.iter().enumerate() {
            for c in 0..3 {
                let level = match (ty, tx) {
                    (Some((y0, y1, wy0, wy1)), Some((x0, x1, wx0, wx1))) => {
                        // Output channel c is R, G, B; the source's is c or 2 - c.
                        let sc = if order == ChannelOrder::Rgb { c } else { 2 - c };
                        let at = |yy: usize, xx: usize| f32::from(pixels[(yy * w + xx) * 3 + sc]);
                        let top = at(*y0, *x0) * wx0 + at(*y0, *x1) * wx1;
                        let bottom = at(*y1, *x0) * wx0 + at(*y1, *x1) * wx1;
                        (top * wy0 + bottom * wy1).round_ties_even().clamp(0.0, 255.0)
                    }
                    _ => f32::from(PAD),
                };
                out[(c * ih + y) * iw + x] = level / 255.0;
            }
        }
    }
    Ok((HostTensor::new(vec![1, 3, ih, iw], out), geometry))
}

/// An RGB image as the frame input of kiln-models' `yolo_letterbox` op: `[1, H, W * 3]` bytes,
/// each pixel's channels in `order` (the op reads `Bgr`).
pub fn frame_bytes(img: &RgbImage, order: ChannelOrder) -> ByteTensor {
    let (w, h) = (img.width() as usize, img.height() as usize);
    let data = match order {
        ChannelOrder::Rgb => img.as_raw().clone(),
        ChannelOrder::Bgr => img.pixels().flat_map(|p| [p.0[2], p.0[1], p.0[0]]).collect(),
    };
    ByteTensor { shape: vec![1, h, w * 3], data }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_matches_ultralytics() {
        // 451x300 (w x h) into 640x640: r = 640/451, 640 x round(425.7) = 426, 214 rows of padding.
        let g = Letterbox::new([300, 451], [640, 640]);
        assert_eq!(g.resized, [426, 640]);
        assert_eq!((g.top, g.left), (107, 0));
        // Odd padding: 64 - 45 = 19 rows: 9 above (round(9.4)), 10 below.
        let g = Letterbox::new([45, 64], [64, 64]);
        assert_eq!((g.resized, g.top), ([45, 64], 9));
        // A box maps back: the input's centre is the frame's centre.
        let g = Letterbox::new([100, 200], [64, 64]);
        let b = g.unmap_box([32.0, 32.0, 64.0, 64.0]);
        assert_eq!(b, [100.0, 50.0, 200.0, 100.0]);
    }

    #[test]
    fn channel_order_is_explicit() {
        let img = RgbImage::from_fn(4, 2, |x, y| image::Rgb([10 * x as u8, 50 + y as u8, 200]));
        let (rgb, _) = letterbox(&img, [4, 4]).expect("letterbox");
        // A same-width frame is copied: row 1 of the input is frame row 0; R plane first.
        assert_eq!(rgb.data[4 + 3] * 255.0, 30.0);
        assert_eq!(rgb.data[16 + 4] * 255.0, 50.0);
        assert_eq!(rgb.data[32 + 4] * 255.0, 200.0);
        assert_eq!(rgb.data[0] * 255.0, 114.0, "padding");
        // The same bytes read as BGR swap R and B.
        let (bgr, _) = letterbox_pixels(img.as_raw(), [2, 4], ChannelOrder::Bgr, [4, 4]).expect("bgr");
        assert_eq!(bgr.data[4] * 255.0, 200.0);
        assert_eq!(bgr.data[32 + 4 + 3] * 255.0, 30.0);
        // frame_bytes(Bgr) read as BGR gives the RGB result back.
        let frame = frame_bytes(&img, ChannelOrder::Bgr);
        assert_eq!(frame.shape, [1, 2, 12]);
        let (back, _) = letterbox_pixels(&frame.data, [2, 4], ChannelOrder::Bgr, [4, 4]).expect("frame");
        assert_eq!(back, rgb);
    }

    #[test]
    fn bad_sizes_are_errors() {
        assert!(letterbox_pixels(&[0; 5], [1, 2], ChannelOrder::Rgb, [4, 4]).is_err());
        assert!(letterbox_pixels(&[], [0, 0], ChannelOrder::Rgb, [4, 4]).is_err());
        assert!(letterbox(&RgbImage::new(3, 3), [0, 4]).is_err());
    }
}
