//! Detections drawn onto an image: a 2-pixel box per detection in its class's colour, and a
//! label (`name 0.87`) in white on that colour above the box (inside it when the box touches the
//! top). Glyphs are the public-domain 8x8 bitmaps of `font8x8`; characters outside ASCII are
//! drawn as `?`.

use image::{Rgb, RgbImage};
use kiln::HostTensor;

/// One detection in image pixels.
#[derive(Clone, Debug, PartialEq)]
pub struct Detection {
    /// `[x1, y1, x2, y2]`, corners in pixels of the image drawn on.
    pub bbox: [f32; 4],
    pub score: f32,
    pub class: usize,
}

/// The detections of image `n` in a detector's `[N, K, 6]` output (rows `x1, y1, x2, y2, score,
/// class`, as kiln-models' `yolo_nms` and CenterNet's decode give them) whose score is at least
/// `min_score`; padding rows (class < 0) are skipped. `map` moves each box onto the image
/// (`Letterbox::unmap_box`, or the identity).
pub fn detections(output: &HostTensor, n: usize, min_score: f32, map: impl Fn([f32; 4]) -> [f32; 4]) -> Vec<Detection> {
    let [_, k, 6] = output.shape[..] else { return vec![] };
    let rows = output.data.get(n * k * 6..(n + 1) * k * 6).unwrap_or(&[]);
    rows.chunks_exact(6)
        .filter(|r| r[5] >= 0.0 && r[4] >= min_score)
        .map(|r| Detection { bbox: map([r[0], r[1], r[2], r[3]]), score: r[4], class: r[5] as usize })
        .collect()
}

/// A distinct, saturated colour per class (hues a golden angle apart).
pub fn class_colour(class: usize) -> Rgb<u8> {
    let hue = (class as f64 * 0.618_033_988_75).fract() * 6.0;
    let (sector, f) = (hue.floor() as usize, hue.fract());
    let (v, p, q, t) = (230.0, 40.0, 230.0 - 190.0 * f, 40.0 + 190.0 * f);
    let (r, g, b) = match sector {
        0 => (v, t, p),
        1 => (q, v, p),
        2 => (p, v, t),
        3 => (p, q, v),
        4 => (t, p, v),
        _ => (v, p, q),
    };
    Rgb([r as u8, g as u8, b as u8])
}

/// Draws every detection onto `img`: its box, and `names[class]` (or `class N`) with its score.
pub fn draw_detections(img: &mut RgbImage, detections: &[Detection], names: &[&str]) {
    for d in detections {
        let colour = class_colour(d.class);
        let (w, h) = (img.width() as f32, img.height() as f32);
        if w == 0.0 || h == 0.0 {
            return;
        }
        let clamp = |v: f32, limit: f32| if v.is_finite() { v.clamp(0.0, limit - 1.0) as u32 } else { 0 };
        let [x1, y1, x2, y2] = [clamp(d.bbox[0], w), clamp(d.bbox[1], h), clamp(d.bbox[2], w), clamp(d.bbox[3], h)];
        let (x1, x2, y1, y2) = (x1.min(x2), x1.max(x2), y1.min(y2), y1.max(y2));
        for t in 0..2 {
            fill(img, x1, y1 + t, x2, y1 + t, colour);
            fill(img, x1, y2.saturating_sub(t), x2, y2.saturating_sub(t), colour);
            fill(img, x1 + t, y1, x1 + t, y2, colour);
            fill(img, x2.saturating_sub(t), y1, x2.saturating_sub(t), y2, colour);
        }
        let name = names.get(d.class).map_or_else(|| format!("class {}", d.class), |n| n.to_string());
        let label = format!("{name} {:.2}", d.score);
        let label_h = GLYPH + 2;
        let top = if y1 >= label_h { y1 - label_h } else { y1 };
        draw_label(img, x1, top, &label, colour);
    }
}

/// Glyph size in pixels.
const GLYPH: u32 = 8;

/// Fills the rectangle from (x1, y1) to (x2, y2) inclusive, clipped to the image.
fn fill(img: &mut RgbImage, x1: u32, y1: u32, x2: u32, y2: u32, colour: Rgb<u8>) {
    for y in y1..=y2.min(img.height().saturating_sub(1)) {
        for x in x1..=x2.min(img.width().saturating_sub(1)) {
            img.put_pixel(x, y, colour);
        }
    }
}

/// `text` in white on a `background` box whose top-left corner is (x, y), clipped to the image.
fn draw_label(img: &mut RgbImage, x: u32, y: u32, text: &str, background: Rgb<u8>) {
    let width = text.chars().count() as u32 * GLYPH + 2;
    fill(img, x, y, x.saturating_add(width - 1), y + GLYPH + 1, background);
    for (i, ch) in text.chars().enumerate() {
        let glyph = font8x8::legacy::BASIC_LEGACY[if ch.is_ascii() { ch as usize } else { '?' as usize }];
        for (row, bits) in glyph.iter().enumerate() {
            for col in 0..GLYPH {
                if bits >> col & 1 == 1 {
                    let (px, py) = (x + 1 + i as u32 * GLYPH + col, y + 1 + row as u32);
                    if px < img.width() && py < img.height() {
                        img.put_pixel(px, py, Rgb([255, 255, 255]));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxes_and_labels_land_where_asked() {
        let mut img = RgbImage::new(64, 48);
        let d = Detection { bbox: [10.0, 20.0, 40.0, 45.0], score: 0.875, class: 16 };
        draw_detections(&mut img, &[d], crate::coco_classes());
        let c = class_colour(16);
        assert_eq!(*img.get_pixel(10, 30), c, "left edge");
        assert_eq!(*img.get_pixel(40, 30), c, "right edge");
        assert_eq!(*img.get_pixel(25, 45), c, "bottom edge");
        assert_eq!(*img.get_pixel(25, 30), Rgb([0, 0, 0]), "inside stays");
        // The label box sits above the box (rows 10..19) and holds white glyph pixels.
        let label: Vec<Rgb<u8>> = (10..20).flat_map(|y| (10..60).map(move |x| (x, y))).map(|(x, y)| *img.get_pixel(x, y)).collect();
        assert!(label.contains(&Rgb([255, 255, 255])) && label.contains(&c));
        assert_eq!(*img.get_pixel(5, 5), Rgb([0, 0, 0]), "outside stays");
    }

    #[test]
    fn boxes_off_the_image_and_nan_are_clipped() {
        let mut img = RgbImage::new(16, 16);
        let ds = [
            Detection { bbox: [-50.0, -5.0, 100.0, 300.0], score: 1.0, class: 999 },
            Detection { bbox: [f32::NAN, 2.0, 3.0, f32::INFINITY], score: 0.5, class: 0 },
        ];
        draw_detections(&mut img, &ds, &[]);
        assert_eq!(*img.get_pixel(15, 15), class_colour(999));
        draw_detections(&mut RgbImage::new(0, 0), &ds, &[]);
    }

    #[test]
    fn detections_skip_padding_and_low_scores() {
        let out = HostTensor::new(
            vec![2, 2, 6],
            vec![1.0, 2.0, 3.0, 4.0, 0.9, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 5.0, 5.0, 6.0, 6.0, 0.2, 1.0, 7.0, 7.0, 8.0, 8.0, 0.6, 2.0],
        );
        let first = detections(&out, 0, 0.25, |b| b);
        assert_eq!(first, [Detection { bbox: [1.0, 2.0, 3.0, 4.0], score: 0.9, class: 5 }]);
        let second = detections(&out, 1, 0.25, |b| b.map(|v| v * 2.0));
        assert_eq!(second, [Detection { bbox: [14.0, 14.0, 16.0, 16.0], score: 0.6, class: 2 }]);
        assert!(detections(&out, 5, 0.0, |b| b).is_empty());
        assert_ne!(class_colour(0), class_colour(1));
    }
}
