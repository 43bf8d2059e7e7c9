//! Images for Kiln: from a photo to a model's input, and from its output to names and boxes.
//!
//! - `load_rgb` / `decode_rgb`: JPEG, PNG, BMP, GIF, WebP, PNM and TIFF through the `image` crate,
//!   as 8-bit RGB (grey is repeated, alpha dropped, as PIL's `convert("RGB")` does);
//!   `image_files` lists a folder's images (a calibration set) in a fixed order.
//! - `classify`: torchvision's classification preset (`Resize(256)` with PIL's antialiased
//!   bilinear filter, `CenterCrop(224)`, ImageNet mean/std) to an NCHW f32 `HostTensor`.
//!   `resize` is PIL's `Image.resize(..., BILINEAR)`, bit for bit.
//! - `letterbox`: Ultralytics' `LetterBox` for YOLO, from pixels in a stated channel order.
//! - `labels`: ImageNet-1k and COCO-80 class names, softmax and top-k.
//! - `draw`: labelled boxes drawn onto an RGB image, saved as PNG.

pub mod classify;
pub mod draw;
pub mod labels;
pub mod letterbox;
pub mod resize;

pub use classify::{center_crop, resize_shorter, to_nchw, ClassifyPreset};
pub use draw::{detections, draw_detections, Detection};
pub use image::{self, RgbImage};
pub use labels::{coco_classes, imagenet_classes, softmax, top_k, top_k_batch, Prediction};
pub use letterbox::{frame_bytes, letterbox, letterbox_pixels};
pub use resize::resize_bilinear;

use std::path::{Path, PathBuf};

/// What can go wrong between a file and a tensor; every variant names the file or the sizes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot decode image {path}: {reason}")]
    Decode { path: PathBuf, reason: String },

    #[error("cannot write image {path}: {reason}")]
    Encode { path: PathBuf, reason: String },

    #[error("{what}: {reason}")]
    Size { what: String, reason: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The largest width or height `decode_rgb` reads (checked in the file's header, before decoding).
pub const MAX_IMAGE_SIDE: u32 = 32_768;

/// The most memory a decoder may hold for one image (the decoded pixels included), 512 MiB.
pub const MAX_DECODED_BYTES: u64 = 512 << 20;

/// The largest image file `load_rgb` reads, 1 GiB.
pub const MAX_FILE_BYTES: u64 = 1 << 30;

/// Decodes the image file at `path` (format from its bytes) as 8-bit RGB. The path must be a
/// regular file (a FIFO or a directory is named as such, without waiting for a writer) of at
/// most [`MAX_FILE_BYTES`].
pub fn load_rgb(path: impl AsRef<Path>) -> Result<RgbImage> {
    let path = path.as_ref();
    let decode_err = |reason: String| Error::Decode { path: path.into(), reason };
    let file = kiln::files::open_regular(path, "an image file (JPEG, PNG, BMP, GIF, WebP, PNM or TIFF)", |reason| kiln::Error::Image {
        path: path.into(),
        reason,
    })
    .map_err(|e| match e {
        kiln::Error::Image { reason, .. } => decode_err(reason),
        other => decode_err(other.to_string()),
    })?;
    let len = file.metadata().map_err(|e| decode_err(e.to_string()))?.len();
    if len > MAX_FILE_BYTES {
        return Err(decode_err(format!("the file holds {len} bytes, more than the limit of {MAX_FILE_BYTES} for an image")));
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(file, MAX_FILE_BYTES), &mut bytes).map_err(|e| decode_err(e.to_string()))?;
    decode_rgb(&bytes, path)
}

/// Decodes an image file already in memory as 8-bit RGB; `path` names it in errors. Grey images
/// repeat their level over R, G and B; alpha is dropped (not composited), as PIL's
/// `convert("RGB")` does; 16-bit channels keep their high byte.
///
/// The dims are read from the header and checked first: each side at most [`MAX_IMAGE_SIDE`], and
/// the decoder may hold at most [`MAX_DECODED_BYTES`], so a small file claiming a huge image is
/// refused before anything is allocated for its pixels.
pub fn decode_rgb(bytes: &[u8], path: &Path) -> Result<RgbImage> {
    let bad = |reason: String| Error::Decode { path: path.into(), reason };
    let limited = |e: image::ImageError| match e {
        image::ImageError::Limits(l) => {
            bad(format!("decoding it needs more memory than the limit of {} MiB for one image ({l})", MAX_DECODED_BYTES >> 20))
        }
        other => bad(other.to_string()),
    };
    // The dims from the header alone (the decoder's memory limit applies already), then the
    // pixels with every limit.
    let reader = |sides: bool| -> Result<image::ImageReader<std::io::Cursor<&[u8]>>> {
        let mut reader = image::ImageReader::new(std::io::Cursor::new(bytes)).with_guessed_format().map_err(|e| bad(e.to_string()))?;
        if reader.format().is_none() {
            return Err(bad("is not an image this build reads (JPEG, PNG, BMP, GIF, WebP, PNM or TIFF)".into()));
        }
        let mut limits = image::Limits::default();
        if sides {
            limits.max_image_width = Some(MAX_IMAGE_SIDE);
            limits.max_image_height = Some(MAX_IMAGE_SIDE);
        }
        limits.max_alloc = Some(MAX_DECODED_BYTES);
        reader.limits(limits);
        Ok(reader)
    };
    let (width, height) = reader(false)?.into_dimensions().map_err(|e| match e {
        image::ImageError::Limits(_) => limited(e),
        other => bad(format!("its header: {other}")),
    })?;
    if width == 0 || height == 0 || width > MAX_IMAGE_SIDE || height > MAX_IMAGE_SIDE {
        return Err(bad(format!("is {width}x{height} pixels; an image must be 1 to {MAX_IMAGE_SIDE} pixels on each side")));
    }
    let decoded = reader(true)?.decode().map_err(limited)?;
    Ok(decoded.to_rgb8())
}

/// The file extensions `image_files` lists (compared without case).
pub const IMAGE_EXTENSIONS: &[&str] = &["jpg", "jpeg", "png", "bmp", "gif", "webp", "ppm", "pgm", "pnm", "tif", "tiff"];

/// The image files directly in `dir` (by extension, see `IMAGE_EXTENSIONS`), sorted by name, so
/// a calibration folder is read in the same order everywhere.
pub fn image_files(dir: impl AsRef<Path>) -> Result<Vec<PathBuf>> {
    let dir = dir.as_ref();
    let io = |e: std::io::Error| Error::Decode { path: dir.into(), reason: format!("cannot list the folder: {e}") };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        let ext = path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
        if path.is_file() && ext.is_some_and(|e| IMAGE_EXTENSIONS.contains(&e.as_str())) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Writes `img` as a PNG file.
pub fn save_png(img: &RgbImage, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    img.save_with_format(path, image::ImageFormat::Png).map_err(|e| Error::Encode { path: path.into(), reason: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(img: &image::DynamicImage, format: image::ImageFormat) -> Vec<u8> {
        let mut out = std::io::Cursor::new(Vec::new());
        img.write_to(&mut out, format).expect("encode");
        out.into_inner()
    }

    #[test]
    fn decodes_png_jpeg_bmp_and_grey_to_rgb() {
        let rgb = RgbImage::from_fn(8, 6, |x, y| image::Rgb([x as u8 * 30, y as u8 * 40, 200]));
        let dynamic = image::DynamicImage::ImageRgb8(rgb.clone());
        for format in [image::ImageFormat::Png, image::ImageFormat::Bmp] {
            assert_eq!(decode_rgb(&encoded(&dynamic, format), Path::new("x")).expect("lossless"), rgb, "{format:?}");
        }
        let jpeg = decode_rgb(&encoded(&dynamic, image::ImageFormat::Jpeg), Path::new("x.jpg")).expect("jpeg");
        assert_eq!(jpeg.dimensions(), (8, 6));
        let grey = image::DynamicImage::ImageLuma8(image::GrayImage::from_fn(3, 2, |x, _| image::Luma([x as u8 * 100])));
        let out = decode_rgb(&encoded(&grey, image::ImageFormat::Png), Path::new("g.png")).expect("grey");
        assert_eq!(out.get_pixel(2, 1).0, [200, 200, 200]);
        let rgba = image::DynamicImage::ImageRgba8(image::RgbaImage::from_pixel(2, 2, image::Rgba([10, 20, 30, 0])));
        let out = decode_rgb(&encoded(&rgba, image::ImageFormat::Png), Path::new("a.png")).expect("rgba");
        assert_eq!(out.get_pixel(0, 0).0, [10, 20, 30], "alpha dropped, not composited");
    }

    #[test]
    fn garbage_is_a_decode_error_naming_the_file() {
        let e = decode_rgb(b"not an image", Path::new("cat.png")).expect_err("garbage");
        assert!(matches!(e, Error::Decode { .. }) && e.to_string().contains("cat.png"), "{e}");
        let e = load_rgb("/nonexistent/cat.jpg").expect_err("missing");
        assert!(e.to_string().contains("/nonexistent/cat.jpg"), "{e}");
    }

    #[test]
    fn image_files_lists_images_sorted() {
        let dir = std::env::temp_dir().join(format!("kiln-vision-files-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub.png")).expect("dir");
        for name in ["b.JPG", "a.png", "notes.txt", "c.webp"] {
            std::fs::write(dir.join(name), b"x").expect("write");
        }
        let names: Vec<String> =
            image_files(&dir).expect("list").iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["a.png", "b.JPG", "c.webp"]);
        assert!(image_files(dir.join("missing")).expect_err("missing").to_string().contains("missing"));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn png_round_trips() {
        let img = RgbImage::from_fn(5, 4, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let path = std::env::temp_dir().join(format!("kiln-vision-{}.png", std::process::id()));
        save_png(&img, &path).expect("save");
        assert_eq!(load_rgb(&path).expect("load"), img);
        std::fs::remove_file(&path).ok();
    }
}
