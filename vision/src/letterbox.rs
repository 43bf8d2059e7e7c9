//! Ultralytics' `LetterBox(new_shape, auto=False, scaleup=True, center=True)`, the YOLO models'
//! preprocessing, on the CPU: resize keeping the aspect ratio to `round(w * r) x round(h * r)`
//! (`r` the smaller of the two ratios), pad with level 114 (`round(d -/+ 0.1)` on each side),
//! RGB planes divided by 255, as `[1, 3, h, w]` f32.
//!
//! The channel order of the pixels is said explicitly (`ChannelOrder`): OpenCV decodes BGR,
//! the `image` crate RGB, and the model wants RGB. The resize is bilinear with half-pixel
//! centres (OpenCV's `INTER_LINEAR`), each level rounded to an integer as OpenCV's `uint8` result
//! is, with the geometry and arithmetic of kiln-models' `yolo_letterbox` op (both from
//! `kiln::image`), so both give the same tensor.

use crate::{Error, Result};
use image::RgbImage;
use kiln::image::{letterbox_level, LETTERBOX_PAD};
use kiln::image::{ChannelOrder, Letterbox};
use kiln::{ByteTensor, HostTensor};

/// Ultralytics' padding level.
pub const PAD: u8 = LETTERBOX_PAD;

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
    let (rows, cols) = geometry.taps();
    let mut out = vec![0f32; 3 * ih * iw];
    for (y, ty) in rows.iter().enumerate() {
        for (x, tx) in cols.iter().enumerate() {
            for c in 0..3 {
                let level = match (ty, tx) {
                    (Some((y0, y1, wy0, wy1)), Some((x0, x1, wx0, wx1))) => {
                        // Output channel c is R, G, B; the source's is c or 2 - c.
                        let at = |yy: usize, xx: usize| f32::from(pixels[(yy * w + xx) * 3 + order.source_channel(c)]);
                        letterbox_level([at(*y0, *x0), at(*y0, *x1), at(*y1, *x0), at(*y1, *x1)], (*wx0, *wx1), (*wy0, *wy1))
                    }
                    _ => f32::from(PAD),
                };
                out[(c * ih + y) * iw + x] = level / 255.0;
            }
        }
    }
    Ok((HostTensor::new(vec![1, 3, ih, iw], out), geometry))
}

/// An RGB image as the frame input of kiln-models' entry ops (`yolo_letterbox`,
/// `classify_preset`): `[1, H, W * 3]` bytes, each pixel's channels in `order` (the op's
/// `ChannelOrder`: `yolo_letterbox` reads `Bgr` unless told `Rgb`).
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
