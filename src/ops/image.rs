//! The geometry of the image entry stages, in one home for the CPU presets (kiln-vision's
//! `letterbox` and `ClassifyPreset`) and the GPU entry ops (kiln-models' `yolo_letterbox` and
//! `classify_preset`), so that both compute the same pixels from the same taps:
//!
//! - Ultralytics' letterbox: `Letterbox` (where the frame goes in the model input) and its
//!   per-row and per-column taps (OpenCV's `INTER_LINEAR`, half-pixel centres, f32 weights);
//! - torchvision's classification preset on a PIL image: `shorter_side_to` (`Resize(size)`),
//!   `pil_bilinear_taps` (PIL's antialiased BILINEAR, 22-bit fixed point) and `center_crop_axis`
//!   (`CenterCrop`, zero padding where the crop is larger);
//! - `ChannelOrder`: which channel of an interleaved pixel is R, G and B.

/// The order of the three interleaved channels of each pixel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChannelOrder {
    /// R, G, B: the `image` crate, PIL, most Rust and Python decoders.
    Rgb,
    /// B, G, R: OpenCV's `imread` and video capture.
    Bgr,
}

impl ChannelOrder {
    /// The channel of a source pixel that holds output channel `c` (0 R, 1 G, 2 B).
    pub fn source_channel(self, c: usize) -> usize {
        match self {
            ChannelOrder::Rgb => c,
            ChannelOrder::Bgr => 2 - c,
        }
    }

    /// The value of the entry ops' `bgr` attribute: 1 for BGR, 0 for RGB.
    pub fn bgr_attr(self) -> f64 {
        f64::from(u8::from(self == ChannelOrder::Bgr))
    }

    /// The order a `bgr` attribute names (`None`: absent, `default`), or why it names none.
    pub fn from_bgr_attr(value: Option<f64>, default: ChannelOrder) -> Result<ChannelOrder, String> {
        match value {
            None => Ok(default),
            Some(0.0) => Ok(ChannelOrder::Rgb),
            Some(1.0) => Ok(ChannelOrder::Bgr),
            Some(v) => Err(format!("attribute bgr must be 0 (RGB frames) or 1 (BGR frames), got {v}")),
        }
    }
}

// ---- Ultralytics' letterbox ---------------------------------------------------------------------

/// The padding level of Ultralytics' letterbox.
pub const LETTERBOX_PAD: u8 = 114;

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

/// One output row or column of a letterbox: the two source positions and their weights, `None`
/// in the padding.
pub type Tap = Option<(usize, usize, f32, f32)>;

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

    /// (row taps, column taps): every input row's and column's two source positions and weights.
    pub fn taps(&self) -> (Vec<Tap>, Vec<Tap>) {
        let rows = linear_taps(self.frame[0], self.resized[0], self.input[0], self.top);
        let cols = linear_taps(self.frame[1], self.resized[1], self.input[1], self.left);
        (rows, cols)
    }
}

/// The taps of `dst` outputs along an axis: `src` pixels resized to `new` (OpenCV's
/// `INTER_LINEAR`), `before` positions of padding first.
fn linear_taps(src: usize, new: usize, dst: usize, before: usize) -> Vec<Tap> {
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

/// One letterboxed level from the four source levels (`[y0x0, y0x1, y1x0, y1x1]`) and the
/// column and row weights: horizontal first, rounded half to even to a level, as the GPU does.
pub fn letterbox_level(p: [f32; 4], wx: (f32, f32), wy: (f32, f32)) -> f32 {
    let top = p[0] * wx.0 + p[1] * wx.1;
    let bottom = p[2] * wx.0 + p[3] * wx.1;
    (top * wy.0 + bottom * wy.1).round_ties_even().clamp(0.0, 255.0)
}

// ---- torchvision's classification preset -------------------------------------------------------

/// PIL's fixed-point precision for 8-bit channels: 32 bits less 8 for the value, less 2 spare.
pub const PIL_PRECISION_BITS: u32 = 32 - 8 - 2;

/// PIL's rounding start: half of one unit of the fixed point.
pub const PIL_HALF: i64 = 1 << (PIL_PRECISION_BITS - 1);

/// One output position of PIL's resampling: the first source index and its fixed-point weights.
#[derive(Clone, Debug, PartialEq)]
pub struct PilTaps {
    pub first: usize,
    pub weights: Vec<i32>,
}

/// The triangle filter of PIL's BILINEAR, support 1.
fn triangle(x: f64) -> f64 {
    let x = x.abs();
    if x < 1.0 {
        1.0 - x
    } else {
        0.0
    }
}

/// The taps of every output position along one axis, `src` pixels to `dst`, as PIL's
/// `precompute_coeffs` and `normalize_coeffs_8bpc` compute them: a triangle widened by the
/// reduction factor when shrinking (antialiasing), plain bilinear when enlarging; weights in f64,
/// normalised to sum 1, then fixed point with [`PIL_PRECISION_BITS`] fractional bits. A same-size
/// axis gets one weight of 1 per position (a copy).
pub fn pil_bilinear_taps(src: usize, dst: usize) -> Vec<PilTaps> {
    (0..dst).map(|xx| pil_bilinear_tap(src, dst, xx)).collect()
}

/// The taps of output position `xx` alone of [`pil_bilinear_taps`]`(src, dst)`: the same
/// numbers, without the `dst` taps of a whole axis.
pub fn pil_bilinear_tap(src: usize, dst: usize, xx: usize) -> PilTaps {
    let scale = src as f64 / dst as f64;
    let filterscale = scale.max(1.0);
    let support = filterscale; // the triangle's support (1) times the scale
    let ss = 1.0 / filterscale;
    let center = (xx as f64 + 0.5) * scale;
    // C's (int) casts truncate toward zero, as `as i64` does.
    let xmin = ((center - support + 0.5) as i64).max(0);
    let xmax = ((center + support + 0.5) as i64).min(src as i64);
    let w: Vec<f64> = (xmin..xmax).map(|x| triangle((x as f64 - center + 0.5) * ss)).collect();
    let total: f64 = w.iter().sum();
    let weights = w
        .iter()
        .map(|&k| {
            let k = if total != 0.0 { k / total } else { k };
            let fixed = k * f64::from(1u32 << PIL_PRECISION_BITS);
            (if k < 0.0 { fixed - 0.5 } else { fixed + 0.5 }) as i32
        })
        .collect();
    PilTaps { first: xmin as usize, weights }
}

/// torchvision's `Resize` then `CenterCrop` along one axis of `src` pixels, resized to
/// `resized` and cropped to `crop`: per crop position, the PIL taps of its resized position, or
/// `None` where the crop pads. Only the `crop` taps are computed, so a thin image whose longer
/// side would be resized to millions of pixels costs what its crop does.
pub fn pil_resize_crop_taps(src: usize, resized: usize, crop: usize) -> Vec<Option<PilTaps>> {
    center_crop_axis(resized, crop).into_iter().map(|p| p.map(|p| pil_bilinear_tap(src, resized, p))).collect()
}

/// `(sum + 2^21) >> 22`, clamped to a level (PIL's `clip8`); `sum` excludes the half.
pub fn pil_clip8(sum: i64) -> u8 {
    ((PIL_HALF + sum) >> PIL_PRECISION_BITS).clamp(0, 255) as u8
}

/// torchvision's `Resize(size)` with one number: the (height, width) of a `frame` (h, w) whose
/// shorter side becomes `size` and the longer `int(size * long / short)` (Python's float division,
/// truncated).
pub fn shorter_side_to(frame: [usize; 2], size: usize) -> [usize; 2] {
    let [h, w] = frame;
    if h == 0 || w == 0 {
        return frame;
    }
    let (short, long) = if w <= h { (w, h) } else { (h, w) };
    let new_long = (size as f64 * long as f64 / short as f64) as usize;
    if w <= h {
        [new_long, size]
    } else {
        [size, new_long]
    }
}

/// torchvision's `CenterCrop` along one axis: for each of the `crop` output positions, the
/// position in the `size` source pixels, or `None` where the crop is larger and torchvision pads
/// with zeros (`(crop - size) // 2` before, the rest after). The offset is
/// `round((size - crop) / 2)`, Python's round half to even.
pub fn center_crop_axis(size: usize, crop: usize) -> Vec<Option<usize>> {
    let pad_before = crop.saturating_sub(size) / 2;
    let padded = size.max(crop);
    let offset = ((padded - crop) as f64 / 2.0).round_ties_even() as usize;
    (0..crop).map(|o| (o + offset).checked_sub(pad_before).filter(|&s| s < size)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn letterbox_geometry_matches_ultralytics() {
        // 451x300 (w x h) into 640x640: r = 640/451, 640 x round(425.7) = 426, 214 rows of padding.
        let g = Letterbox::new([300, 451], [640, 640]);
        assert_eq!((g.resized, g.top, g.left), ([426, 640], 107, 0));
        // 40 x 80 frame into 64 x 64: 32 x 64 resized, 16 rows of padding each side.
        let (rows, cols) = Letterbox::new([40, 80], [64, 64]).taps();
        assert!(rows[..16].iter().all(Option::is_none) && rows[48..].iter().all(Option::is_none));
        assert!(rows[16..48].iter().all(Option::is_some) && cols.iter().all(Option::is_some));
        // Odd padding: 64 - 45 = 19 rows: 9 above (round(9.4)), 10 below.
        let (rows, _) = Letterbox::new([45, 64], [64, 64]).taps();
        assert!(rows[..9].iter().all(Option::is_none) && rows[9].is_some() && rows[53].is_some() && rows[54].is_none());
        // A box maps back: the input's centre is the frame's centre.
        let g = Letterbox::new([100, 200], [64, 64]);
        assert_eq!(g.unmap_box([32.0, 32.0, 64.0, 64.0]), [100.0, 50.0, 200.0, 100.0]);
    }

    #[test]
    fn pil_taps_sum_to_one_widen_when_shrinking_and_copy_at_one_size() {
        for (src, dst) in [(10, 3), (451, 256), (300, 256), (7, 20), (5, 5)] {
            for t in pil_bilinear_taps(src, dst) {
                let sum: i32 = t.weights.iter().sum();
                assert!((sum - (1 << PIL_PRECISION_BITS)).abs() <= t.weights.len() as i32, "{src}->{dst}: {sum}");
                assert!(t.first + t.weights.len() <= src);
            }
        }
        // Halving: the triangle spans 4 source pixels, weighted 1, 3, 3, 1 (/ 8).
        let one = 1i32 << PIL_PRECISION_BITS;
        assert_eq!(pil_bilinear_taps(8, 4)[1], PilTaps { first: 1, weights: vec![one / 8, 3 * one / 8, 3 * one / 8, one / 8] });
        // Enlarging keeps two taps (bilinear), never more; the same size copies.
        assert!(pil_bilinear_taps(4, 9).iter().all(|t| t.weights.iter().filter(|&&k| k != 0).count() <= 2));
        for (i, t) in pil_bilinear_taps(6, 6).iter().enumerate() {
            assert_eq!((t.first, t.weights[0]), (i, one));
            assert!(t.weights[1..].iter().all(|&k| k == 0));
            assert_eq!(pil_clip8(i64::from(t.weights[0]) * 200), 200);
        }
    }

    /// The taps of a resize-then-crop are the whole axis's taps at the cropped positions.
    #[test]
    fn resize_crop_taps_are_the_cropped_positions_of_the_whole_axis() {
        for (src, resized, crop) in [(451, 384, 224), (300, 256, 224), (7, 20, 9), (100, 30, 40), (1, 256, 224)] {
            let whole = pil_bilinear_taps(src, resized);
            let want: Vec<Option<PilTaps>> = center_crop_axis(resized, crop).into_iter().map(|p| p.map(|p| whole[p].clone())).collect();
            assert_eq!(pil_resize_crop_taps(src, resized, crop), want, "{src} -> {resized} -> {crop}");
        }
        // 32768x1 to Resize(256): the long side would be 8,388,608 pixels; 224 taps are made.
        let [h, w] = shorter_side_to([1, 32768], 256);
        assert_eq!([h, w], [256, 8_388_608]);
        let cols = pil_resize_crop_taps(32768, w, 224);
        assert_eq!(cols.len(), 224);
        assert!(cols.iter().all(|t| t.as_ref().is_some_and(|t| t.first < 32768 && t.weights.len() <= 2)));
    }

    #[test]
    fn shorter_side_and_center_crop_match_torchvision() {
        // chelsea.png is 451x300: int(256 * 451 / 300) = 384; motorcycle_left.png 741x500: 379.
        assert_eq!(shorter_side_to([300, 451], 256), [256, 384]);
        assert_eq!(shorter_side_to([451, 300], 256), [384, 256]);
        assert_eq!(shorter_side_to([500, 741], 256), [256, 379]);
        assert_eq!(shorter_side_to([20, 30], 32), [32, 48]);
        // (7 - 4) / 2 = 1.5 rounds to 2; (7 - 2) / 2 = 2.5 to 2 (half to even).
        assert_eq!(center_crop_axis(7, 4), [Some(2), Some(3), Some(4), Some(5)]);
        assert_eq!(center_crop_axis(7, 2), [Some(2), Some(3)]);
        // Larger than the image: 1 zero before, 2 after.
        assert_eq!(center_crop_axis(7, 10), [None, Some(0), Some(1), Some(2), Some(3), Some(4), Some(5), Some(6), None, None]);
    }

    #[test]
    fn bgr_attribute_round_trips() {
        for order in [ChannelOrder::Rgb, ChannelOrder::Bgr] {
            assert_eq!(ChannelOrder::from_bgr_attr(Some(order.bgr_attr()), ChannelOrder::Rgb), Ok(order));
        }
        assert_eq!(ChannelOrder::from_bgr_attr(None, ChannelOrder::Bgr), Ok(ChannelOrder::Bgr));
        assert!(ChannelOrder::from_bgr_attr(Some(0.5), ChannelOrder::Rgb).unwrap_err().contains("bgr"));
        assert_eq!(ChannelOrder::Bgr.source_channel(0), 2);
    }
}
