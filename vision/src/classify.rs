//! torchvision's classification preset (`weights.transforms()` of every torchvision classifier,
//! `ImageClassification`): resize the shorter side, crop the centre, scale to [0, 1] and
//! normalise with the ImageNet mean and std, as torchvision does on a PIL image:
//!
//! ```text
//! F.resize(img, [256], BILINEAR, antialias=True)   # PIL's Image.resize: `resize_bilinear`
//! F.center_crop(img, [224])
//! F.pil_to_tensor, F.convert_image_dtype(float)    # / 255 in f32
//! F.normalize(mean, std)                           # (x - mean) / std in f32
//! ```

use crate::resize::resize_bilinear;
use crate::{Error, Result};
use image::RgbImage;
use kiln::image::{center_crop_axis, pil_clip8, pil_resize_crop_taps, shorter_side_to, PilTaps};
use kiln::HostTensor;

/// A classifier's preprocessing: shorter side to `resize`, centre crop of `crop`, then
/// `(x / 255 - mean) / std` per channel (R, G, B).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClassifyPreset {
    pub resize: u32,
    pub crop: u32,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

impl Default for ClassifyPreset {
    fn default() -> Self {
        Self::IMAGENET
    }
}

impl ClassifyPreset {
    /// torchvision's `IMAGENET1K_V1` preset of most classifiers: `Resize(256)`, `CenterCrop(224)`.
    pub const IMAGENET: Self = Self { resize: 256, crop: 224, mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225] };

    /// The preset for a model input of `size` x `size`, resizing to `size * 256 / 224` as torchvision does.
    pub fn for_input(size: u32) -> Self {
        Self { resize: size * 256 / 224, crop: size, ..Self::IMAGENET }
    }

    /// The resized and cropped image (`crop` x `crop`), before normalisation: the pixels of
    /// `center_crop(&resize_shorter(img, resize), crop, crop)`, computed for the crop alone
    /// ([`resize_shorter_then_crop`]).
    pub fn crop(&self, img: &RgbImage) -> RgbImage {
        resize_shorter_then_crop(img, self.resize, self.crop, self.crop)
    }

    /// The model input for the image files `paths`, decoded as `crate::load_rgb` does.
    pub fn load(&self, paths: &[impl AsRef<std::path::Path>]) -> Result<HostTensor> {
        let images = paths.iter().map(crate::load_rgb).collect::<Result<Vec<_>>>()?;
        self.tensor(&images)
    }

    /// The model input for `images`: `[N, 3, crop, crop]` f32.
    pub fn tensor(&self, images: &[RgbImage]) -> Result<HostTensor> {
        let crops: Vec<RgbImage> = images.iter().map(|img| self.crop(img)).collect();
        to_nchw(&crops, self.mean, self.std)
    }
}

/// torchvision's `Resize(size)` with one number: the shorter side becomes `size`, the longer
/// `int(size * long / short)` (Python's float division, truncated), with PIL's bilinear filter.
/// An image whose size would not change is returned as it is, as torchvision does. The whole
/// resized image is made: a thin image's longer side grows with its aspect ratio (32768x1 to
/// `Resize(256)` is 8,388,608x256 pixels), so a preprocessing that crops next should call
/// [`resize_shorter_then_crop`].
pub fn resize_shorter(img: &RgbImage, size: u32) -> RgbImage {
    let (w, h) = img.dimensions();
    let [nh, nw] = shorter_side_to([h as usize, w as usize], size as usize);
    if [nh, nw] == [h as usize, w as usize] {
        return img.clone();
    }
    resize_bilinear(img, nw as u32, nh as u32)
}

/// `center_crop(&resize_shorter(img, size), width, height)`, the same pixels bit for bit, with
/// only the cropped pixels resampled: PIL's horizontal pass (rounded to a level) for the source
/// rows the crop's rows read and the crop's columns, then the vertical pass for the crop's rows.
/// Its memory and time follow the source's height and the crop, whatever the aspect ratio.
pub fn resize_shorter_then_crop(img: &RgbImage, size: u32, width: u32, height: u32) -> RgbImage {
    let (w, h) = (img.width() as usize, img.height() as usize);
    let [nh, nw] = shorter_side_to([h, w], size as usize);
    let cols = pil_resize_crop_taps(w, nw, width as usize);
    let rows = pil_resize_crop_taps(h, nh, height as usize);
    let src = img.as_raw();
    // The source rows the vertical pass reads.
    let first = rows.iter().flatten().map(|t| t.first).min().unwrap_or(0);
    let end = rows.iter().flatten().map(|t| t.first + t.weights.len()).max().unwrap_or(0);
    let crop_w = width as usize;
    let mut horizontal = vec![0u8; end.saturating_sub(first) * crop_w * 3];
    for y in first..end {
        let row = &src[y * w * 3..(y + 1) * w * 3];
        for (x, t) in cols.iter().enumerate() {
            let Some(t) = t else { continue };
            for c in 0..3 {
                let sum = t.weights.iter().enumerate().map(|(i, &k)| i64::from(row[(t.first + i) * 3 + c]) * i64::from(k)).sum();
                horizontal[((y - first) * crop_w + x) * 3 + c] = pil_clip8(sum);
            }
        }
    }
    let level = |t: &PilTaps, x: usize, c: usize| {
        let sum =
            t.weights.iter().enumerate().map(|(j, &k)| i64::from(horizontal[((t.first + j - first) * crop_w + x) * 3 + c]) * i64::from(k));
        pil_clip8(sum.sum())
    };
    RgbImage::from_fn(width, height, |x, y| match (&cols[x as usize], &rows[y as usize]) {
        (Some(_), Some(t)) => image::Rgb([0, 1, 2].map(|c| level(t, x as usize, c))),
        _ => image::Rgb([0, 0, 0]),
    })
}

/// torchvision's `CenterCrop((height, width))`: the offsets are `round((size - crop) / 2)` with
/// Python's round half to even; an image smaller than the crop is first padded with zeros
/// (`(crop - size) // 2` before, the rest after).
pub fn center_crop(img: &RgbImage, width: u32, height: u32) -> RgbImage {
    let cols = center_crop_axis(img.width() as usize, width as usize);
    let rows = center_crop_axis(img.height() as usize, height as usize);
    RgbImage::from_fn(width, height, |x, y| match (cols[x as usize], rows[y as usize]) {
        (Some(sx), Some(sy)) => *img.get_pixel(sx as u32, sy as u32),
        _ => image::Rgb([0, 0, 0]),
    })
}

/// Images of one size as `[N, 3, H, W]` f32: `(v / 255 - mean[c]) / std[c]`, each step in f32 as
/// torchvision computes it (so the values equal torchvision's bit for bit).
pub fn to_nchw(images: &[RgbImage], mean: [f32; 3], std: [f32; 3]) -> Result<HostTensor> {
    let Some(first) = images.first() else {
        return Err(Error::Size { what: "a batch of images".into(), reason: "is empty".into() });
    };
    let (w, h) = first.dimensions();
    if let Some(other) = images.iter().find(|i| i.dimensions() != (w, h)) {
        return Err(Error::Size {
            what: "a batch of images".into(),
            reason: format!("mixes {w}x{h} and {}x{} images; resize them to one size first", other.width(), other.height()),
        });
    }
    let plane = (w as usize) * (h as usize);
    let mut data = Vec::with_capacity(images.len() * 3 * plane);
    for img in images {
        for c in 0..3 {
            data.extend(img.pixels().map(|p| (f32::from(p.0[c]) / 255.0 - mean[c]) / std[c]));
        }
    }
    Ok(HostTensor::new(vec![images.len(), 3, h as usize, w as usize], data))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shorter_side_rule_matches_torchvision() {
        // chelsea.png is 451x300: int(256 * 451 / 300) = 384.
        let img = RgbImage::new(451, 300);
        assert_eq!(resize_shorter(&img, 256).dimensions(), (384, 256));
        assert_eq!(resize_shorter(&RgbImage::new(300, 451), 256).dimensions(), (256, 384));
        // 741x500 (motorcycle_left.png): 256 * 741 / 500 = 379.39 -> 379.
        assert_eq!(resize_shorter(&RgbImage::new(741, 500), 256).dimensions(), (379, 256));
        assert_eq!(resize_shorter(&RgbImage::new(256, 256), 256).dimensions(), (256, 256));
    }

    /// The crop-only resize gives the pixels of the whole resize then the crop, bit for bit,
    /// shrinking, enlarging, padding and at one size.
    #[test]
    fn resize_then_crop_equals_the_crop_of_the_whole_resize() {
        let img =
            |w: u32, h: u32| RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 37 + y * 11) as u8, (x * y) as u8, (255 - x * 3 - y) as u8]));
        for (w, h, size, crop) in [
            (451, 300, 256, 224),
            (300, 451, 256, 224),
            (60, 40, 73, 64),
            (9, 14, 9, 8),
            (50, 50, 20, 32),
            (7, 3, 9, 8),
            (256, 256, 256, 224),
        ] {
            let src = img(w, h);
            let want = center_crop(&resize_shorter(&src, size), crop, crop);
            assert_eq!(resize_shorter_then_crop(&src, size, crop, crop), want, "{w}x{h} to {size}, crop {crop}");
        }
    }

    /// A 32768x1 image, which `Resize(256)` makes 8,388,608x256 (6.4 GB), is cropped at the cost
    /// of its crop: each column of the crop repeats its one source row's resampled level.
    #[test]
    fn a_thin_image_is_cropped_without_its_whole_resize() {
        let thin = RgbImage::from_fn(32768, 1, |x, _| image::Rgb([(x % 251) as u8, 128, 7]));
        let started = std::time::Instant::now();
        let out = ClassifyPreset::IMAGENET.crop(&thin);
        assert!(started.elapsed().as_secs_f64() < 1.0, "{:?}", started.elapsed());
        assert_eq!(out.dimensions(), (224, 224));
        // One source row: every output row is that row enlarged, the same levels.
        assert!((0..224).all(|y| out.get_pixel(10, y) == out.get_pixel(10, 0)));
        // Columns: the centre of 8,388,608 is source pixel 16384 (level 16384 % 251 = 69), enlarged 256 times.
        assert_eq!(out.get_pixel(112, 0).0[1..], [128, 7]);
    }

    #[test]
    fn center_crop_rounds_half_to_even_and_pads() {
        let img = RgbImage::from_fn(7, 4, |x, y| image::Rgb([x as u8, y as u8, 0]));
        // (7 - 4) / 2 = 1.5 rounds to 2; (4 - 2) / 2 = 1.
        let c = center_crop(&img, 4, 2);
        assert_eq!(c.get_pixel(0, 0).0, [2, 1, 0]);
        // (7 - 2) / 2 = 2.5 rounds to 2 (half to even).
        assert_eq!(center_crop(&img, 2, 4).get_pixel(0, 0).0, [2, 0, 0]);
        // Larger than the image: 1 zero column left, 2 right, as torchvision pads.
        let p = center_crop(&img, 10, 4);
        assert_eq!(p.get_pixel(0, 0).0, [0, 0, 0]);
        assert_eq!(p.get_pixel(1, 3).0, [0, 3, 0]);
        assert_eq!(p.get_pixel(7, 0).0, [6, 0, 0]);
        assert_eq!(p.get_pixel(8, 0).0, [0, 0, 0]);
    }

    #[test]
    fn tensor_is_nchw_and_normalised() {
        let preset = ClassifyPreset::for_input(8);
        assert_eq!((preset.resize, preset.crop), (9, 8));
        let img = RgbImage::from_pixel(12, 9, image::Rgb([255, 0, 128]));
        let t = preset.tensor(&[img.clone(), img]).expect("tensor");
        assert_eq!(t.shape, [2, 3, 8, 8]);
        let at = |n: usize, c: usize| t.data[(n * 3 + c) * 64 + 9];
        assert_eq!(at(1, 0), (1.0 - 0.485) / 0.229);
        assert_eq!(at(0, 1), (0.0 - 0.456) / 0.224);
        assert_eq!(at(0, 2), (128.0f32 / 255.0 - 0.406) / 0.225);
        let path = std::env::temp_dir().join(format!("kiln-vision-preset-{}.png", std::process::id()));
        crate::save_png(&RgbImage::from_pixel(12, 9, image::Rgb([255, 0, 128])), &path).expect("save");
        assert_eq!(preset.load(&[&path, &path]).expect("load"), t);
        std::fs::remove_file(&path).ok();
        let e = to_nchw(&[RgbImage::new(2, 2), RgbImage::new(3, 2)], [0.0; 3], [1.0; 3]).expect_err("mixed sizes");
        assert!(e.to_string().contains("2x2 and 3x2"), "{e}");
    }
}
