//! Binary PGM and PPM images (`P5`, `P6`; 8-bit): the images of a calibration folder
//! (`kiln calibrate --data <folder>`). Every file is untrusted: only regular files are opened
//! (a FIFO named `x.pgm` is named, never waited on), no more of a file is read than its header
//! and pixels, and the folder's memory is requested with `try_reserve` before it is filled.

use crate::graph::numel;
use crate::{Error, HostTensor, Result};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The most bytes a header may take before its pixels (comments included).
const MAX_HEADER: usize = 4096;

/// A binary PGM (`P5`) or PPM (`P6`) of `size`×`size` 8-bit pixels: (channels, interleaved
/// pixels). `Err` says what is wrong with the bytes.
pub fn parse(bytes: &[u8], size: usize) -> std::result::Result<(usize, &[u8]), String> {
    let channels = match bytes.get(..2) {
        Some(b"P5") => 1,
        Some(b"P6") => 3,
        _ => return Err("not a binary PGM (P5) or PPM (P6) image".into()),
    };
    // Header: magic, width, height, maxval, separated by whitespace (with `#` comments), then one
    // whitespace byte before the pixels.
    let mut fields = Vec::new();
    let mut i = 2;
    while fields.len() < 3 {
        while i < bytes.len() && (bytes[i].is_ascii_whitespace() || bytes[i] == b'#') {
            if bytes[i] == b'#' {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            i += 1;
        }
        let start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        let v: usize = bytes
            .get(start..i)
            .and_then(|d| std::str::from_utf8(d).ok())
            .and_then(|s| s.parse().ok())
            .ok_or("a truncated or malformed header")?;
        fields.push(v);
    }
    let (w, h, maxval) = (fields[0], fields[1], fields[2]);
    if maxval != 255 {
        return Err(format!("maxval {maxval}: only 8-bit images (255) are read"));
    }
    if (w, h) != (size, size) {
        return Err(format!("{w}x{h} pixels; the model takes {size}x{size} (resize the calibration images first)"));
    }
    let n = numel(&[w, h, channels]).ok_or("a pixel count that overflows")?;
    let pixels = i
        .checked_add(1)
        .and_then(|start| bytes.get(start..start.checked_add(n)?))
        .ok_or_else(|| format!("{} pixel bytes, expected {n}", bytes.len().saturating_sub(i + 1)))?;
    Ok((channels, pixels))
}

/// Checks the per-channel normalisation: three finite means, three finite positive deviations.
pub fn check_normalisation(mean: &[f32], std: &[f32]) -> Result<()> {
    if mean.len() != 3 || mean.iter().any(|m| !m.is_finite()) {
        return Err(Error::Flag { flag: "--mean".into(), reason: format!("must be three finite values (one per channel), got {mean:?}") });
    }
    if std.len() != 3 || std.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
        return Err(Error::Flag {
            flag: "--std".into(),
            reason: format!("must be three finite, positive values (one per channel), got {std:?}"),
        });
    }
    Ok(())
}

/// The images (`.pgm`, `.ppm`, `.pnm`) of `dir`, sorted by name, at most `limit` of them, as one
/// `[N, 3, size, size]` batch: scaled to [0, 1], then `(x - mean[c]) / std[c]` per channel (a
/// PGM's one channel is repeated over three).
pub fn read_folder(dir: &Path, size: usize, mean: &[f32], std: &[f32], limit: Option<usize>) -> Result<HostTensor> {
    check_normalisation(mean, std)?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(Error::io(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().and_then(|e| e.to_str()).is_some_and(|e| matches!(e.to_ascii_lowercase().as_str(), "pgm" | "ppm" | "pnm"))
        })
        .collect();
    files.sort();
    files.truncate(limit.unwrap_or(usize::MAX));
    let per_image = numel(&[3, size, size]).ok_or_else(|| Error::TooLarge {
        what: format!("a calibration image of {size}x{size}"),
        reason: "its element count overflows".into(),
    })?;
    let total = numel(&[files.len(), per_image]).ok_or_else(|| Error::TooLarge {
        what: format!("{} calibration images of {size}x{size}", files.len()),
        reason: "their element count overflows".into(),
    })?;
    let mut data = Vec::new();
    data.try_reserve_exact(total)
        .map_err(|_| Error::OutOfMemory { what: format!("{} images of {}", files.len(), dir.display()), bytes: total.saturating_mul(4) })?;
    let mut bytes = Vec::new();
    for f in &files {
        let bad = |reason: String| Error::Image { path: f.clone(), reason };
        let file = crate::host::open_regular(f, "a binary PGM (P5) or PPM (P6) image", bad)?;
        // The header and the largest image of this size: a longer file is not read to its end.
        let most = MAX_HEADER.saturating_add(per_image).saturating_add(1);
        bytes.clear();
        file.take(most as u64).read_to_end(&mut bytes).map_err(Error::io(f))?;
        let (channels, pixels) = parse(&bytes, size).map_err(bad)?;
        for c in 0..3 {
            let src = if channels == 1 { 0 } else { c };
            data.extend(pixels.iter().skip(src).step_by(channels).map(|&p| (p as f32 / 255.0 - mean[c]) / std[c]));
        }
    }
    HostTensor::try_new(vec![files.len(), 3, size, size], data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_parsed_and_checked() {
        let mut img = b"P5\n# a comment\n2 2\n255\n".to_vec();
        img.extend([0u8, 64, 128, 255]);
        assert_eq!(parse(&img, 2), Ok((1, &[0u8, 64, 128, 255][..])));
        assert!(parse(&img, 3).unwrap_err().contains("2x2"));
        assert!(parse(&img[..img.len() - 1], 2).is_err());
        assert!(parse(b"P3\n1 1\n255\n0 0 0", 1).is_err());
        assert!(parse(b"P6\n99999999999999999999 1\n255\n", 1).unwrap_err().contains("malformed"));
    }

    #[test]
    fn normalisation_must_be_finite() {
        check_normalisation(&[0.5; 3], &[0.25; 3]).unwrap();
        let e = check_normalisation(&[f32::NAN; 3], &[0.25; 3]).unwrap_err().to_string();
        assert!(e.starts_with("--mean must be three finite values") && e.contains("NaN"), "{e}");
        let e = check_normalisation(&[0.5; 3], &[0.25, 0.0, 0.25]).unwrap_err().to_string();
        assert!(e.starts_with("--std must be three finite, positive values"), "{e}");
    }
}
