//! PIL's `Image.resize(size, Image.BILINEAR)` on 8-bit RGB, bit for bit.
//!
//! PIL resamples separably, horizontally first, each pass rounding to 8 bits. Per output pixel
//! the filter is a triangle (support 1) widened by the reduction factor when shrinking, so a
//! reduction averages every source pixel under it (antialiasing) while an enlargement is plain
//! bilinear interpolation. Weights are computed in f64, normalised to sum 1, then converted to
//! fixed point with 22 fractional bits; each output is `(sum + 2^21) >> 22`, clamped to 0..=255.
//! torchvision's `Resize(antialias=True)` on a PIL image calls exactly this. The taps are
//! `kiln::image::pil_bilinear_taps`, which kiln-models' GPU `classify_preset`
//! reads too.

use image::RgbImage;
use kiln::image::{pil_bilinear_taps as taps, pil_clip8};

/// Resizes `img` to `width` x `height` as PIL's `Image.resize((width, height), Image.BILINEAR)`
/// does on an RGB image: the same pixels, bit for bit. An axis whose size does not change is
/// not resampled (PIL skips that pass). A zero size gives an empty image.
pub fn resize_bilinear(img: &RgbImage, width: u32, height: u32) -> RgbImage {
    let (w, h) = (img.width() as usize, img.height() as usize);
    if width == 0 || height == 0 || w == 0 || h == 0 {
        return RgbImage::new(width, height);
    }
    let (nw, nh) = (width as usize, height as usize);
    let src = img.as_raw();
    // Horizontal pass: h rows of nw pixels.
    let horizontal: Vec<u8> = if nw == w {
        src.clone()
    } else {
        let cols = taps(w, nw);
        let mut out = vec![0u8; h * nw * 3];
        for y in 0..h {
            let row = &src[y * w * 3..(y + 1) * w * 3];
            for (x, t) in cols.iter().enumerate() {
                for c in 0..3 {
                    let sum = t.weights.iter().enumerate().map(|(i, &k)| i64::from(row[(t.first + i) * 3 + c]) * i64::from(k)).sum::<i64>();
                    out[(y * nw + x) * 3 + c] = pil_clip8(sum);
                }
            }
        }
        out
    };
    // Vertical pass: nh rows from the h resampled rows.
    let pixels = if nh == h {
        horizontal
    } else {
        let rows = taps(h, nh);
        let mut out = vec![0u8; nh * nw * 3];
        for (y, t) in rows.iter().enumerate() {
            for i in 0..nw * 3 {
                let sum = t
                    .weights
                    .iter()
                    .enumerate()
                    .map(|(j, &k)| i64::from(horizontal[(t.first + j) * nw * 3 + i]) * i64::from(k))
                    .sum::<i64>();
                out[y * nw * 3 + i] = pil_clip8(sum);
            }
        }
        out
    };
    RgbImage::from_raw(width, height, pixels).expect("width * height * 3 bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_images_stay_flat_and_identity_is_a_copy() {
        let flat = RgbImage::from_pixel(37, 23, image::Rgb([17, 128, 255]));
        for (w, h) in [(10, 7), (80, 50), (37, 5), (1, 1)] {
            let out = resize_bilinear(&flat, w, h);
            assert!(out.pixels().all(|p| p.0 == [17, 128, 255]), "{w}x{h}");
        }
        let img = RgbImage::from_fn(9, 4, |x, y| image::Rgb([x as u8 * 20, y as u8 * 50, (x * y) as u8]));
        assert_eq!(resize_bilinear(&img, 9, 4), img);
        assert_eq!(resize_bilinear(&img, 0, 4).dimensions(), (0, 4));
    }

    /// Values PIL 13 gives for `Image.fromarray(a).resize((3, 2), Image.BILINEAR)` with
    /// `a[y, x] = (16 * x + 30 * y, 255 - 16 * x, 7 * y)` on a 7x5 image.
    #[test]
    fn matches_pil_on_a_small_ramp() {
        let img = RgbImage::from_fn(7, 5, |x, y| image::Rgb([(16 * x + 30 * y) as u8, (255 - 16 * x) as u8, (7 * y) as u8]));
        let out = resize_bilinear(&img, 3, 2);
        let got: Vec<[u8; 3]> = out.pixels().map(|p| p.0).collect();
        assert_eq!(got, PIL_RAMP_3X2);
    }

    const PIL_RAMP_3X2: [[u8; 3]; 6] = [[44, 241, 7], [78, 207, 7], [112, 173, 7], [104, 241, 21], [138, 207, 21], [172, 173, 21]];
}
