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
use kiln::image::{center_crop_axis, shorter_side_to};
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

    /// The resized and cropped image (`crop` x `crop`), before normalisation.
    pub fn crop(&self, img: &RgbImage) -> RgbImage {
        center_crop(&resize_shorter(img, self.resize), self.crop, self.crop)
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
/// An image whose size would not change is returned as it is, as torchvision does.
pub fn resize_shorter(img: &RgbImage, size: u32) -> RgbImage {
    let (w, h) = img.dimensions();
    let [nh, nw] = shorter_side_to([h as usize, w as usize], size as usize);
    if [nh, nw] == [h as usize, w as usize] {
        return img.clone();
    }
    resize_bilinear(img, nw as u32, nh as u32)
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
