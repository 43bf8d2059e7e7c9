//! `classify_preset`, torchvision's classification preset as kiln-models' entry op, on the CPU:
//! against torchvision itself (`classify_preset.reference.safetensors`, written by
//! `tools/classify_preset_reference.py`: the steps of `ImageClassification`, the preset of a
//! classifier's `weights.transforms()`, on PIL images: downscaling, upscaling, a same-size frame,
//! non-square crops, a crop larger than the resized frame; transforms.v2.functional gives the same
//! levels and differs by at most 7.2e-7 after normalising, its scaling being a multiplication by
//! 1/255) and against kiln-vision's `ClassifyPreset`, from u8 frames in either channel order.
//! The GPU layer is checked against this reference in `tests/gpu_classify_preset.rs`.

use kiln::files::read_safetensors;
use kiln::image::ChannelOrder;
use kiln::{compare, ByteTensor, HostTensor, Tracer};
use kiln_models::classify_preset::{classify_preset, frame_input, Preset};
use kiln_vision::{ClassifyPreset, RgbImage};
use std::collections::BTreeMap;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    let dir =
        std::env::var_os("KILN_FIXTURES").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"), PathBuf::from);
    dir.join(name)
}

/// The op behind a u8 `frame` input of `n` frames of (h, w), run on the CPU executor.
fn run_op(frame: &ByteTensor, preset: &Preset) -> HostTensor {
    let [n, h, w3] = frame.shape[..] else { panic!("frame shape {:?}", frame.shape) };
    let tracer = Tracer::new();
    let x = frame_input(&tracer, "frame", n, [h, w3 / 3]);
    classify_preset(&x, preset).expect("classify_preset").mark_output("input");
    let mut out = kiln::run_cpu(&tracer.graph(), &[("frame", frame)]).expect("cpu run");
    out.remove("input").expect("output")
}

fn bytes(t: &HostTensor) -> ByteTensor {
    ByteTensor::new(t.shape.clone(), t.data.iter().map(|&v| v as u8).collect()).expect("bytes")
}

/// The same pixels with R and B swapped.
fn swapped(frame: &ByteTensor) -> ByteTensor {
    ByteTensor { shape: frame.shape.clone(), data: frame.data.chunks(3).flat_map(|p| [p[2], p[1], p[0]]).collect() }
}

#[test]
fn the_op_matches_torchvision_exactly() {
    let refs: BTreeMap<String, HostTensor> = read_safetensors(fixture("classify_preset.reference.safetensors")).expect("reference file");
    let mut cases = 0;
    for (key, want) in refs.iter().filter(|(k, _)| k.starts_with("output.")) {
        let case = &key["output.".len()..];
        let frame = bytes(&refs[&format!("frame.{case}")]);
        let g = &refs[&format!("preset.{case}")].data;
        let preset = Preset { resize: g[0] as usize, crop: [g[1] as usize, g[2] as usize], ..Preset::IMAGENET };
        let got = run_op(&frame, &preset);
        let c = compare(&format!("classify_preset {case}"), &got, want);
        println!("{c}");
        assert!(c.max_abs == 0.0, "{c}: the CPU preset must equal torchvision's exactly");
        let bgr = Preset { order: ChannelOrder::Bgr, ..preset };
        assert_eq!(run_op(&swapped(&frame), &bgr), got, "{case}: BGR frames read R and B swapped");
        cases += 1;
    }
    assert!(cases >= 6, "{cases} cases in the fixture");
}

/// kiln-vision's `ClassifyPreset` on an RGB image and the op on its bytes give the same tensor.
#[test]
fn the_library_preset_equals_the_op() {
    for (w, h, size) in [(61u32, 37u32, 32usize), (40, 90, 24), (224, 224, 224), (13, 7, 16), (300, 451, 224)] {
        let img = RgbImage::from_fn(w, h, |x, y| kiln_vision::image::Rgb([(x * 7 + y * 3) as u8, (x * y) as u8, (255 - x * 2) as u8]));
        let library = ClassifyPreset::for_input(size as u32).tensor(std::slice::from_ref(&img)).expect("library preset");
        let frame = ByteTensor { shape: vec![1, h as usize, w as usize * 3], data: img.as_raw().clone() };
        assert_eq!(run_op(&frame, &Preset::for_input(size)), library, "{w}x{h} at {size}");
    }
}

/// `trace_frames` puts a classifier behind the op: on the CPU executor its logits from a u8
/// frame equal the plain model's on kiln-vision's preset of the same pixels.
#[test]
fn trace_frames_puts_a_classifier_behind_the_preset() {
    let (h, w) = (60usize, 90usize);
    let img = RgbImage::from_fn(w as u32, h as u32, |x, y| kiln_vision::image::Rgb([(x * 3) as u8, (y * 4) as u8, ((x + y) * 2) as u8]));
    let frame = ByteTensor { shape: vec![1, h, w * 3], data: img.as_raw().clone() };
    let vb = kiln::VarBuilder::seeded();
    let behind = kiln_models::trace_frames("mobilenet_v2", vb.clone(), 1, [h, w], ChannelOrder::Rgb).expect("trace_frames");
    assert_eq!(behind.input_dtype("frame"), Some(kiln::DType::U8));
    let got = kiln::run_cpu(&behind, &[("frame", &frame)]).expect("cpu")["logits"].clone();
    let plain = kiln_models::trace("mobilenet_v2", vb, 1, 224).expect("trace");
    let x = ClassifyPreset::IMAGENET.tensor(&[img]).expect("preset");
    assert_eq!(got, kiln::run_cpu(&plain, &[("input", &x)]).expect("cpu")["logits"]);
    let e = kiln_models::trace_frames("centernet", kiln::VarBuilder::seeded(), 1, [h, w], ChannelOrder::Rgb).expect_err("centernet");
    assert!(e.to_string().contains("centernet takes no frames"), "{e}");
}
