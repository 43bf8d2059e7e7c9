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

pub use classify::{center_crop, resize_shorter, resize_shorter_then_crop, to_nchw, ClassifyPreset};
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

    #[error("cannot decode image {path}: it is truncated ({reason}); what is missing would decode as grey and change the answer")]
    Truncated { path: PathBuf, reason: String },

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

/// What decoding does with a truncated file: a JPEG cut short decodes without an error (its
/// missing rows come out grey), so the decoder's answer alone does not tell.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Truncated {
    /// Refuse it with [`Error::Truncated`], as PIL does.
    #[default]
    Refuse,
    /// Decode what it holds, and say why it is truncated beside the image.
    Accept,
}

/// Decodes the image file at `path` (format from its bytes) as 8-bit RGB. The path must be a
/// regular file (a FIFO or a directory is named as such, without waiting for a writer) of at
/// most [`MAX_FILE_BYTES`]. A truncated file is refused ([`Error::Truncated`]).
pub fn load_rgb(path: impl AsRef<Path>) -> Result<RgbImage> {
    load_rgb_with(path, Truncated::Refuse).map(|(img, _)| img)
}

/// [`load_rgb`], with `truncated` deciding what a truncated file gives; the second value says
/// why the image is truncated when it was accepted.
pub fn load_rgb_with(path: impl AsRef<Path>, truncated: Truncated) -> Result<(RgbImage, Option<String>)> {
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
    decode_rgb_with(&bytes, path, truncated)
}

/// Decodes an image file already in memory as 8-bit RGB; `path` names it in errors. Grey images
/// repeat their level over R, G and B; alpha is dropped (not composited), as PIL's
/// `convert("RGB")` does; 16-bit channels keep their high byte.
///
/// The dims are read from the header and checked first: each side at most [`MAX_IMAGE_SIDE`], and
/// the decoder may hold at most [`MAX_DECODED_BYTES`], so a small file claiming a huge image is
/// refused before anything is allocated for its pixels. A truncated file is refused
/// ([`Error::Truncated`]).
pub fn decode_rgb(bytes: &[u8], path: &Path) -> Result<RgbImage> {
    decode_rgb_with(bytes, path, Truncated::Refuse).map(|(img, _)| img)
}

/// [`decode_rgb`], with `truncated` deciding what a truncated file gives; the second value says
/// why the image is truncated when it was accepted.
pub fn decode_rgb_with(bytes: &[u8], path: &Path, truncated: Truncated) -> Result<(RgbImage, Option<String>)> {
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
    let reader = reader(true)?;
    let cut = match reader.format() {
        Some(image::ImageFormat::Jpeg) => jpeg_truncation(bytes),
        _ => None,
    };
    if let (Some(reason), Truncated::Refuse) = (&cut, truncated) {
        return Err(Error::Truncated { path: path.into(), reason: reason.clone() });
    }
    let decoded = reader.decode().map_err(limited)?;
    Ok((decoded.to_rgb8(), cut))
}

/// Why the JPEG `bytes` are truncated, or `None` when they are whole. The image crate decodes a
/// JPEG whose data stops early without an error, filling the rest with grey (as browsers do).
/// A whole file's last scan ends at a marker (its end-of-image, FF D9, which entropy-coded data
/// cannot hold); when none follows the last start-of-scan (FF DA), the file is decoded again
/// strictly, which fails where data is missing and passes a file that lacks only its 2-byte end
/// marker.
fn jpeg_truncation(bytes: &[u8]) -> Option<String> {
    let last_scan = bytes.windows(2).rposition(|w| w == [0xff, 0xda])?;
    if bytes[last_scan..].windows(2).any(|w| w == [0xff, 0xd9]) {
        return None;
    }
    let options = zune_core::options::DecoderOptions::default()
        .set_strict_mode(true)
        .set_max_width(MAX_IMAGE_SIDE as usize)
        .set_max_height(MAX_IMAGE_SIDE as usize);
    let mut strict = zune_jpeg::JpegDecoder::new_with_options(zune_core::bytestream::ZCursor::new(bytes), options);
    match strict.decode() {
        Ok(_) => None,
        Err(e) => Some(format!("its last scan stops after {} of its bytes: {e}", bytes.len() - last_scan)),
    }
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

    fn photo_like(w: u32, h: u32) -> image::DynamicImage {
        image::DynamicImage::ImageRgb8(RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([(x * 255 / w) as u8, (y * 255 / h) as u8, ((x * 7 + y * 13) % 256) as u8])
        }))
    }

    /// A JPEG cut in half decoded without an error, its lower half grey; it is refused now, or
    /// decoded with the reason beside it when accepted. A JPEG missing only its end marker is
    /// whole and decodes as before.
    #[test]
    fn a_truncated_jpeg_is_refused_unless_accepted() {
        let jpeg = encoded(&photo_like(96, 64), image::ImageFormat::Jpeg);
        let whole = decode_rgb(&jpeg, Path::new("cat.jpg")).expect("whole");
        assert_eq!(&jpeg[jpeg.len() - 2..], [0xff, 0xd9]);
        let no_end = decode_rgb(&jpeg[..jpeg.len() - 2], Path::new("no_end.jpg")).expect("only the end marker is missing");
        assert_eq!(no_end, whole);
        let half = &jpeg[..jpeg.len() / 2];
        let e = decode_rgb(half, Path::new("half.jpg")).expect_err("half a JPEG");
        assert!(matches!(e, Error::Truncated { .. }), "{e}");
        assert!(e.to_string().starts_with("cannot decode image half.jpg: it is truncated ("), "{e}");
        let (img, why) = decode_rgb_with(half, Path::new("half.jpg"), Truncated::Accept).expect("accepted");
        assert_eq!(img.dimensions(), (96, 64));
        assert!(why.is_some_and(|w| w.contains("its last scan stops")));
        assert_ne!(img, whole, "the missing rows are not the photo's");
        // A whole file accepted is whole: no reason beside it.
        assert_eq!(decode_rgb_with(&jpeg, Path::new("cat.jpg"), Truncated::Accept).expect("whole").1, None);
    }

    /// Every other format this build reads refuses a file cut in half (the decoders' own errors).
    #[test]
    fn other_formats_cut_in_half_are_refused() {
        use image::ImageFormat::*;
        for format in [Png, Bmp, Gif, WebP, Tiff, Pnm] {
            let bytes = encoded(&photo_like(96, 64), format);
            decode_rgb(&bytes, Path::new("whole")).unwrap_or_else(|e| panic!("{format:?}: {e}"));
            let cut = &bytes[..bytes.len() / 2];
            assert!(decode_rgb(cut, Path::new("half")).is_err(), "{format:?} cut in half decoded");
        }
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
