//! Photos in, labelled answers out. `kiln run --image` makes the batch from image files with the
//! model's own preprocessing and prints class names or labelled boxes (`--save` draws the boxes);
//! `kiln calibrate --data folder/` reads a folder of images the same way.
//!
//! The preprocessing follows the model's family: a classifier takes torchvision's preset
//! (`Resize(S * 256 / 224)`, `CenterCrop(S)`, ImageNet mean and std), a YOLO Ultralytics' RGB
//! letterbox in [0, 1], CenterNet the same letterbox in CenterNet's BGR order and COCO mean and
//! std (padded with level 114 where CenterNet's affine warp pads zeros).

use super::common::Traced;
use kiln::image::{ChannelOrder, Letterbox};
use kiln::{Error, HostTensor, Result};
use kiln_vision::{ClassifyPreset, RgbImage, Truncated};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The detection score below which boxes are neither printed nor drawn (Ultralytics' `conf`).
pub const MIN_SCORE: f32 = 0.25;

/// CenterNet's COCO mean and std, per channel in its BGR order (`CenterNet/src/lib/datasets/coco.py`).
const CENTERNET_MEAN: [f32; 3] = [0.408, 0.447, 0.470];
const CENTERNET_STD: [f32; 3] = [0.289, 0.274, 0.278];

/// What a model does with an image, which decides its preprocessing and how its answer is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Classifier,
    Yolo,
    CenterNet,
}

impl Family {
    /// A bundled model's family (also for a graph file traced from one), else one read from the
    /// outputs: class scores (`logits`, or one `[N, 1000]` output: `common::class_scores_output`),
    /// `predictions` + `detections`, or `hm` + `detections`.
    pub fn of(traced: &Traced) -> Option<Family> {
        let from_name = |name: &str| match name {
            "classifier" => Some(Family::Classifier),
            "yolo" => Some(Family::Yolo),
            "centernet" => Some(Family::CenterNet),
            _ => None,
        };
        if let Some(f) = kiln_models::bundled(&traced.model).ok().and_then(|m| from_name(m.family())) {
            return Some(f);
        }
        let has = |o: &str| traced.graph.outputs.iter().any(|(n, _)| n == o);
        let shapes = traced.graph.outputs.iter().map(|(n, id)| (n.as_str(), traced.graph.nodes[*id].shape.as_slice()));
        if crate::common::class_scores_output(shapes).is_some() {
            Some(Family::Classifier)
        } else if has("detections") && has("predictions") {
            Some(Family::Yolo)
        } else if has("detections") && has("hm") {
            Some(Family::CenterNet)
        } else {
            None
        }
    }
}

/// How the images of one model become its input.
#[derive(Clone, Debug)]
pub struct Preprocess {
    pub family: Family,
    /// The model's input height and width.
    pub hw: [usize; 2],
    /// A classifier's preset (`digits_resnet` scales to [-1, 1] instead of ImageNet's statistics).
    pub classify: ClassifyPreset,
}

impl Preprocess {
    /// The preprocessing of `traced`, or an error saying why its images cannot be made.
    pub fn of(traced: &Traced, flag: &str) -> Result<Self> {
        let bad = |reason: String| Error::Flag { flag: flag.into(), reason };
        let family = Family::of(traced).ok_or_else(|| {
            bad(format!(
                "reads images for classifiers (a `logits` or one [N, 1000] output) and detectors (YOLO, CenterNet); {} has outputs {:?}",
                traced.name,
                traced.graph.outputs.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()
            ))
        })?;
        let input = traced.graph.inputs.first().map(|&i| &traced.graph.nodes[i]);
        let hw = match input.map(|n| (n.shape.as_slice(), n.dtype)) {
            Some((&[_, 3, h, w], kiln::DType::F32)) => [h, w],
            _ => return Err(bad(format!("makes [N, 3, H, W] f32 inputs; {} takes {}", traced.name, traced.hw_text()))),
        };
        if family == Family::Classifier && hw[0] != hw[1] {
            return Err(bad(format!(
                "crops a classifier's input square (torchvision's CenterCrop); {} takes {}x{}",
                traced.name, hw[0], hw[1]
            )));
        }
        let mut classify = ClassifyPreset::for_input(hw[0] as u32);
        if traced.model == "digits_resnet" {
            // tools/train_digits.py: an 8x8 digit upsampled to 32x32, in [-1, 1].
            classify = ClassifyPreset { resize: hw[0] as u32, crop: hw[0] as u32, mean: [0.5; 3], std: [0.5; 3] };
        }
        Ok(Self { family, hw, classify })
    }

    /// One image as a `[1, 3, H, W]` input, and where a letterbox put it.
    pub fn image(&self, img: &RgbImage) -> Result<(HostTensor, Option<Letterbox>)> {
        let vision = |e: kiln_vision::Error| Error::Image { path: PathBuf::new(), reason: e.to_string() };
        match self.family {
            Family::Classifier => Ok((self.classify.tensor(std::slice::from_ref(img)).map_err(vision)?, None)),
            Family::Yolo => {
                let (x, lb) = kiln_vision::letterbox(img, self.hw).map_err(vision)?;
                Ok((x, Some(lb)))
            }
            Family::CenterNet => {
                // RGB bytes read as BGR: the planes come out B, G, R, as CenterNet's cv2 input.
                let frame = [img.height() as usize, img.width() as usize];
                let (mut x, lb) = kiln_vision::letterbox_pixels(img.as_raw(), frame, ChannelOrder::Bgr, self.hw).map_err(vision)?;
                let plane = self.hw[0] * self.hw[1];
                for (c, values) in x.data.chunks_mut(plane).enumerate() {
                    values.iter_mut().for_each(|v| *v = (*v - CENTERNET_MEAN[c]) / CENTERNET_STD[c]);
                }
                Ok((x, Some(lb)))
            }
        }
    }

    /// The class names of this model's logits, when known.
    pub fn class_names(&self, model: &str, classes: usize) -> &'static [&'static str] {
        const DIGITS: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
        match (self.family, classes) {
            (Family::Classifier, 10) if model == "digits_resnet" => &DIGITS,
            (Family::Classifier, 1000) => kiln_vision::imagenet_classes(),
            (Family::Yolo | Family::CenterNet, _) => kiln_vision::coco_classes(),
            _ => &[],
        }
    }
}

/// An image of the batch: its file, its pixels (boxes are drawn on them) and its letterbox.
pub struct Photo {
    pub path: PathBuf,
    pub image: RgbImage,
    pub letterbox: Option<Letterbox>,
}

/// Decodes the image files `paths` (JPEG, PNG, BMP, GIF, WebP, PNM, TIFF) and makes one batch;
/// `truncated` says what a truncated file gives.
pub fn batch(prep: &Preprocess, paths: &[PathBuf], truncated: Truncated) -> Result<(HostTensor, Vec<Photo>)> {
    let mut data = Vec::new();
    let mut photos = Vec::with_capacity(paths.len());
    for path in paths {
        let image = read_image(path, truncated)?;
        let (x, letterbox) = prep.image(&image).map_err(|e| with_path(e, path))?;
        data.extend_from_slice(&x.data);
        photos.push(Photo { path: path.clone(), image, letterbox });
    }
    let [h, w] = prep.hw;
    Ok((HostTensor::try_new(vec![paths.len(), 3, h, w], data)?, photos))
}

/// Names the file in an image error made without it.
fn with_path(e: Error, path: &Path) -> Error {
    match e {
        Error::Image { reason, .. } => Error::Image { path: path.into(), reason },
        e => e,
    }
}

/// The largest image file read (a photo of 100 megapixels as PNG is well under it).
const MAX_IMAGE_BYTES: u64 = 512 << 20;

/// Decodes an image file as RGB; a FIFO or directory is refused before it is read. A truncated
/// file is refused, or with `Truncated::Accept` decoded with a warning.
pub fn read_image(path: &Path, truncated: Truncated) -> Result<RgbImage> {
    use std::io::Read;
    let bad = |reason: String| Error::Image { path: path.into(), reason };
    let file = kiln::files::open_regular(path, "an image file (JPEG, PNG, BMP, GIF, WebP, PNM or TIFF)", bad)?;
    let mut bytes = Vec::new();
    file.take(MAX_IMAGE_BYTES + 1).read_to_end(&mut bytes).map_err(Error::io(path))?;
    if bytes.len() as u64 > MAX_IMAGE_BYTES {
        return Err(bad(format!("is larger than {} MiB", MAX_IMAGE_BYTES >> 20)));
    }
    let (image, cut) = kiln_vision::decode_rgb_with(&bytes, path, truncated).map_err(|e| match e {
        kiln_vision::Error::Decode { reason, .. } => bad(format!("cannot decode it: {reason}")),
        kiln_vision::Error::Truncated { reason, .. } => bad(format!(
            "it is truncated ({reason}); its missing part would decode as grey and change the answer; \
             --accept-truncated-images decodes it anyway"
        )),
        e => bad(e.to_string()),
    })?;
    if let Some(reason) = cut {
        tracing::warn!(
            "warning: {} is truncated ({reason}); decoded as it is, its missing part grey (--accept-truncated-images)",
            path.display()
        );
    }
    Ok(image)
}

/// The image files of a calibration folder: every entry with an image extension (a FIFO among them
/// is refused when read, not skipped), sorted by name, at most `limit`.
pub fn folder_images(dir: &Path, limit: Option<usize>) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(Error::io(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let ext = p.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase);
            ext.is_some_and(|e| kiln_vision::IMAGE_EXTENSIONS.contains(&e.as_str()))
        })
        .collect();
    files.sort();
    files.truncate(limit.unwrap_or(usize::MAX));
    Ok(files)
}

/// The answer for each photo, as lines for people: a classifier's top `top` names with their
/// probabilities, a detector's labelled boxes in the photo's pixels.
pub fn report(prep: &Preprocess, model: &str, photos: &[Photo], outputs: &BTreeMap<String, HostTensor>, top: usize) -> Result<String> {
    let mut s = String::new();
    match prep.family {
        Family::Classifier => {
            let shapes = outputs.iter().map(|(n, t)| (n.as_str(), t.shape.as_slice()));
            let logits = crate::common::class_scores_output(shapes).and_then(|n| outputs.get(n)).ok_or_else(|| Error::NoSuchOutput {
                name: "logits".into(),
                model: model.into(),
                outputs: outputs.keys().cloned().collect(),
                hint: "; a classifier's scores are read from `logits` or from its one [N, 1000] output (kiln-torch export --output-name logits names it)"
                    .into(),
            })?;
            let names = prep.class_names(model, logits.shape.last().copied().unwrap_or(0));
            for (photo, best) in photos.iter().zip(kiln_vision::top_k_batch(logits, top)) {
                s += &format!("{}: top-{}:\n", photo.path.display(), best.len());
                for p in best {
                    s += &format!("    p {:.3}  {} (class {})\n", p.probability, p.name(names), p.class);
                }
            }
        }
        Family::Yolo | Family::CenterNet => {
            for (n, photo) in photos.iter().enumerate() {
                let found = detections(prep, outputs, n, photo)?;
                let shown = found.len().min(top);
                s += &format!("{}: {} detections (score >= {MIN_SCORE}), boxes in image pixels:\n", photo.path.display(), found.len());
                for d in &found[..shown] {
                    let name = kiln_vision::coco_classes().get(d.class).map_or_else(|| format!("class {}", d.class), |c| c.to_string());
                    let [x1, y1, x2, y2] = d.bbox;
                    s += &format!("    {name} {:.2}  ({x1:.0}, {y1:.0}) - ({x2:.0}, {y2:.0})\n", d.score);
                }
                if found.len() > shown {
                    s += &format!("    ({} more; --top shows more)\n", found.len() - shown);
                }
            }
        }
    }
    Ok(s)
}

/// Photo `n`'s detections in its own pixels: `detections` rows moved from the model input (CenterNet:
/// from its output maps, at stride input / map) through the letterbox back onto the photo.
pub fn detections(
    prep: &Preprocess,
    outputs: &BTreeMap<String, HostTensor>,
    n: usize,
    photo: &Photo,
) -> Result<Vec<kiln_vision::Detection>> {
    let det = outputs.get("detections").ok_or_else(|| Error::NoSuchOutput {
        name: "detections".into(),
        model: "the detector".into(),
        outputs: outputs.keys().cloned().collect(),
        hint: String::new(),
    })?;
    let stride = match (prep.family, outputs.get("hm").and_then(|hm| hm.shape.get(3))) {
        (Family::CenterNet, Some(&w)) if w > 0 => prep.hw[1] as f32 / w as f32,
        _ => 1.0,
    };
    let lb = photo.letterbox;
    Ok(kiln_vision::detections(det, n, MIN_SCORE, |b| {
        let b = b.map(|v| v * stride);
        lb.map_or(b, |lb| lb.unmap_box(b))
    }))
}

/// `--save`: each photo with its boxes drawn, as PNG. One photo goes to `path`; several to
/// `path` with `_0`, `_1`, ... before its extension. Returns the files written.
pub fn save(prep: &Preprocess, outputs: &BTreeMap<String, HostTensor>, photos: &[Photo], path: &Path) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for (n, photo) in photos.iter().enumerate() {
        let out = if photos.len() == 1 { path.to_path_buf() } else { numbered(path, n) };
        let mut img = photo.image.clone();
        kiln_vision::draw_detections(&mut img, &detections(prep, outputs, n, photo)?, kiln_vision::coco_classes());
        // Writing, not reading: the error is the flag's, not an image's ("cannot read image").
        kiln_vision::save_png(&img, &out).map_err(|e| Error::Flag { flag: "--save".into(), reason: e.to_string() })?;
        written.push(out);
    }
    Ok(written)
}

/// `out.png` -> `out_3.png`.
fn numbered(path: &Path, n: usize) -> PathBuf {
    let stem = path.file_stem().map_or_else(|| "out".into(), |s| s.to_string_lossy().into_owned());
    let ext = path.extension().map_or_else(|| "png".into(), |e| e.to_string_lossy().into_owned());
    path.with_file_name(format!("{stem}_{n}.{ext}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbered_keeps_folder_and_extension() {
        assert_eq!(numbered(Path::new("a/out.png"), 2), Path::new("a/out_2.png"));
        assert_eq!(numbered(Path::new("boxes"), 0), Path::new("boxes_0.png"));
    }
}
