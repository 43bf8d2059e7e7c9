//! Property tests over the input paths that joined Kiln after tests/fuzz.rs: image files
//! (`kiln_vision::decode_rgb`, every format this build decodes) and Triton's side (`kiln-triton`:
//! a model's config as Triton hands it over, config.pbtxt as `kiln triton-repo` writes it, and
//! requests). Checkpoints (`.pth`) are fuzzed by tests/fuzz_pth.rs, and graph files written by
//! kiln-torch by tests/fuzz.rs. Each target runs 10,000 cases (`KILN_FUZZ_CASES` overrides);
//! every case must give `Ok` or a typed `Err`, and a panic fails the test.

use kiln_vision::image::{self, DynamicImage, ImageFormat, RgbImage};
use kiln_vision::{decode_rgb, MAX_IMAGE_SIDE};
use proptest::prelude::*;
use proptest::test_runner::Config;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;
use triton_kiln::config::{check, parse_shapes, shape_profile, Binding, ElemType, ModelConfig, ModelSpec};
use triton_kiln::request::{check_request, plan_runs, Buffer, InputData, Limits, RequestData};

mod byte_edits;
use byte_edits::{edit, Edit};

const CASES: u32 = 10_000;

fn config() -> Config {
    let cases = std::env::var("KILN_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(CASES);
    Config { cases, failure_persistence: None, ..Config::default() }
}

/// `bytes` with `edits` applied; edits land in the first 64 bytes (the headers) three times in four.
fn apply(bytes: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    for e in edits {
        let place = |at: usize, len: usize| if at.is_multiple_of(4) { (at / 4) % len } else { (at / 4) % len.min(64) };
        match e {
            Edit::Set(at, b) if !out.is_empty() => {
                let at = place(*at, out.len());
                out[at] = *b;
            }
            Edit::Splice(at, s) if !out.is_empty() => {
                let at = place(*at, out.len());
                let n = s.len().min(out.len() - at);
                out[at..at + n].copy_from_slice(&s[..n]);
            }
            Edit::Truncate(n) => out.truncate(n % (out.len() + 1)),
            Edit::Append(extra) => out.extend(extra),
            _ => {}
        }
    }
    out
}

// ---- image files ----------------------------------------------------------------------------

/// A 7x5 test picture in every format the vision crate decodes, with alpha and grey variants.
fn image_bases() -> &'static [(ImageFormat, Vec<u8>)] {
    static B: OnceLock<Vec<(ImageFormat, Vec<u8>)>> = OnceLock::new();
    B.get_or_init(|| {
        let rgb = RgbImage::from_fn(7, 5, |x, y| image::Rgb([(x * 30) as u8, (y * 50) as u8, ((x + y) * 20) as u8]));
        let rgb = DynamicImage::ImageRgb8(rgb);
        let mut out = Vec::new();
        for (format, img) in [
            (ImageFormat::Png, rgb.clone()),
            (ImageFormat::Png, DynamicImage::ImageRgba16(rgb.to_rgba16())),
            (ImageFormat::Png, DynamicImage::ImageLuma8(rgb.to_luma8())),
            (ImageFormat::Jpeg, rgb.clone()),
            (ImageFormat::Bmp, rgb.clone()),
            (ImageFormat::Gif, DynamicImage::ImageRgba8(rgb.to_rgba8())),
            (ImageFormat::WebP, DynamicImage::ImageRgba8(rgb.to_rgba8())),
            (ImageFormat::Pnm, rgb.clone()),
            (ImageFormat::Tiff, rgb.clone()),
        ] {
            let mut bytes = std::io::Cursor::new(Vec::new());
            img.write_to(&mut bytes, format).unwrap_or_else(|e| panic!("encode {format:?}: {e}"));
            let bytes = bytes.into_inner();
            let back = decode_rgb(&bytes, Path::new("base")).unwrap_or_else(|e| panic!("{format:?} base: {e}"));
            assert_eq!(back.dimensions(), (7, 5), "{format:?}");
            out.push((format, bytes));
        }
        out
    })
}

fn image_fragments() -> Vec<&'static [u8]> {
    vec![
        b"\xff\xff\xff\xff",
        b"\x7f\xff\xff\xff",
        b"\x00\x00\x00\x00",
        b"\x00\x01\x00\x00",
        b"\xff\xff",
        b"\x00\x00",
        b"\x89PNG\r\n\x1a\n",
        b"IHDR",
        b"IDAT",
        b"\xff\xd8\xff",
        b"\xff\xc0\x00\x11\x08\xff\xff\xff\xff",
        b"BM",
        b"GIF89a\xff\xff\xff\xff",
        b"RIFF\xff\xff\xff\xffWEBPVP8L",
        b"II*\x00",
        b"MM\x00*",
        b"P6\n99999 99999\n255\n",
        b"P5\n4294967295 1\n255\n",
        b"P6\n7 5\n65535\n",
        b"P6\n7 5\n0\n",
        b"P7\nWIDTH 100000\nHEIGHT 100000\nDEPTH 4\nMAXVAL 255\nTUPLTYPE RGB_ALPHA\nENDHDR\n",
    ]
}

/// A decoded image is within the limits and holds its pixels; an error names the file.
fn check_image(bytes: &[u8]) {
    let path = Path::new("fuzz-image.bin");
    match decode_rgb(bytes, path) {
        Ok(img) => {
            let (w, h) = img.dimensions();
            assert!(w >= 1 && h >= 1 && w <= MAX_IMAGE_SIDE && h <= MAX_IMAGE_SIDE, "{w}x{h}");
            assert_eq!(img.as_raw().len(), w as usize * h as usize * 3);
        }
        Err(e) => assert!(e.to_string().contains("fuzz-image.bin"), "{e}"),
    }
}

/// CRC-32 (IEEE), for PNG chunks.
fn crc32(parts: &[&[u8]]) -> u32 {
    let mut crc = !0u32;
    for &b in parts.iter().flat_map(|p| p.iter()) {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

/// An image header claiming `w` x `h` (any u32), in one of five formats, with `data` after it.
fn claimed_image(kind: u8, w: u32, h: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    match kind % 5 {
        0 => {
            out.extend(b"\x89PNG\r\n\x1a\n");
            let mut ihdr = Vec::new();
            ihdr.extend(w.to_be_bytes());
            ihdr.extend(h.to_be_bytes());
            ihdr.extend([8, 2, 0, 0, 0]);
            out.extend(13u32.to_be_bytes());
            out.extend(b"IHDR");
            out.extend(&ihdr);
            out.extend(crc32(&[b"IHDR", &ihdr]).to_be_bytes());
            out.extend((data.len() as u32).to_be_bytes());
            out.extend(b"IDAT");
            out.extend(data);
            out.extend(crc32(&[b"IDAT", data]).to_be_bytes());
        }
        1 => {
            // BMP: file header, then a BITMAPINFOHEADER (height as i32: negative is top-down).
            out.extend(b"BM");
            out.extend((54 + data.len() as u32).to_le_bytes());
            out.extend([0u8; 4]);
            out.extend(54u32.to_le_bytes());
            out.extend(40u32.to_le_bytes());
            out.extend(w.to_le_bytes());
            out.extend(h.to_le_bytes());
            out.extend(1u16.to_le_bytes());
            out.extend(24u16.to_le_bytes());
            out.extend([0u8; 24]);
            out.extend(data);
        }
        2 => {
            out.extend(format!("P6\n{w} {h}\n255\n").as_bytes());
            out.extend(data);
        }
        3 => {
            out.extend(b"GIF89a");
            out.extend((w as u16).to_le_bytes());
            out.extend((h as u16).to_le_bytes());
            out.extend([0, 0, 0, b',', 0, 0, 0, 0]);
            out.extend(((w >> 16) as u16).to_le_bytes());
            out.extend(((h >> 16) as u16).to_le_bytes());
            out.extend([0, 2]);
            out.extend(data);
        }
        _ => {
            // TIFF, little-endian: one IFD with width, length, 8-bit RGB, strips at 8.
            out.extend(b"II*\x00");
            out.extend(8u32.to_le_bytes());
            let entries: [(u16, u16, u32); 6] = [(256, 4, w), (257, 4, h), (258, 3, 8), (262, 3, 2), (273, 4, 100), (277, 3, 3)];
            out.extend((entries.len() as u16).to_le_bytes());
            for (tag, ty, value) in entries {
                out.extend(tag.to_le_bytes());
                out.extend(ty.to_le_bytes());
                out.extend(1u32.to_le_bytes());
                out.extend(value.to_le_bytes());
            }
            out.extend(0u32.to_le_bytes());
            out.resize(100, 0);
            out.extend(data);
        }
    }
    out
}

// ---- Triton ---------------------------------------------------------------------------------

/// A model of two inputs (one f32 image of 3x(16..=64)x(16..=64), one u8 vector of 8) and two
/// outputs, for batches 1..=8.
fn spec() -> ModelSpec {
    ModelSpec {
        file: "model.kiln.safetensors".into(),
        inputs: vec![
            Binding { name: "input".into(), elem: ElemType::F32, dims: vec![3, 32, 32], range: vec![(3, 3), (16, 64), (16, 64)] },
            Binding::fixed("mask", ElemType::U8, &[8]),
        ],
        outputs: vec![Binding::fixed("logits", ElemType::F32, &[10]), Binding::fixed("boxes", ElemType::F32, &[4, 4])],
        batch: Some((1, 8)),
    }
}

const CONFIG_JSON: &str = r#"{"name":"m","max_batch_size":8,"backend":"kiln",
"input":[{"name":"input","data_type":"TYPE_FP32","dims":["3","-1","-1"]},{"name":"mask","data_type":"TYPE_UINT8","dims":[8]}],
"output":[{"name":"logits","data_type":"TYPE_FP32","dims":[10]},{"name":"boxes","data_type":"TYPE_FP32","dims":[4,4]}],
"default_model_filename":"","parameters":{"precision":{"string_value":"fp16"},"opt_batch":{"string_value":"4"},
"min_shapes":{"string_value":"input:3x16x16"},"opt_shapes":{"string_value":"input:3x32x32"},"max_shapes":{"string_value":"input:3x64x64"},
"cuda_graphs":{"string_value":"true"}}}"#;

const CONFIG_PBTXT: &str = "# Written by kiln triton-repo for model.kiln.safetensors
name: \"m\"
backend: \"kiln\"
max_batch_size: 8
input [
  {
    name: \"input\"
    data_type: TYPE_FP32
    dims: [ 3, -1, -1 ]
  },
  {
    name: \"mask\"
    data_type: TYPE_UINT8
    dims: [ 8 ]
  }
]
output [
  {
    name: \"logits\"
    data_type: TYPE_FP32
    dims: [ 10 ]
  }
]
instance_group [
  {
    count: 1
    kind: KIND_CPU
  }
]
parameters {
  key: \"min_shapes\"
  value: { string_value: \"input:3x16x16\" }
}
parameters {
  key: \"max_shapes\"
  value: { string_value: \"input:3x64x64\" }
}
";

fn config_fragments() -> Vec<&'static [u8]> {
    vec![
        b"\"-1\"",
        b"-1",
        b"0",
        b"9223372036854775807",
        b"-9223372036854775808",
        b"99999999999999999999",
        b"\"x\"",
        b"null",
        b"[]",
        b"{}",
        b"[",
        b"]",
        b",",
        b":",
        b"\"TYPE_FP16\"",
        b"TYPE_UINT8",
        b"input:3x0x16",
        b"input:3x64x16",
        b"input:3x16",
        b"input:3x16x16x16",
        b"mask:8,input:3x16x16",
        b"input:3x4294967296x1",
        b"\"../../etc/passwd\"",
        b"\"reshape\":{\"shape\":[1]}",
        b"\"allow_ragged_batch\":true",
        b"max_batch_size: -1",
        b"dims: [ ]",
        b"key: \"precision\"",
        b"string_value: \"int8\"",
    ]
}

/// A config (from Triton's JSON or from config.pbtxt) goes as far as the backend takes it without
/// a model file: its Kiln parameters, its profile against the model's inputs (each range then
/// asked whether it holds the traced dims), and the check against the model.
fn check_config(c: &ModelConfig) {
    let Ok(params) = c.kiln_parameters() else { return };
    let traced = BTreeMap::from([("input".to_string(), vec![3, 32, 32]), ("mask".to_string(), vec![8])]);
    if let Some(p) = &params.profile {
        if let Ok(profile) = shape_profile(p, &traced) {
            for (name, range) in &profile {
                let _ = range.contains(&traced[name]);
            }
        }
    }
    for key in ["min_shapes", "opt_shapes", "max_shapes"] {
        if let Some(text) = c.parameter(key) {
            let _ = parse_shapes(text);
        }
    }
    if let Err(e) = check(c, &spec()) {
        let msg = e.to_string();
        assert!(!msg.is_empty());
    }
}

/// One generated request input: a name (the model's, or another), a Triton datatype, a shape
/// (the batch first) and buffers whose lengths may or may not add up.
fn request_input() -> impl Strategy<Value = InputData> {
    let name = prop::sample::select(vec!["input", "mask", "other", ""]);
    let datatype = prop_oneof![3 => prop::sample::select(vec![2u32, 11]), 1 => 0u32..20];
    let dim = prop_oneof![6 => 1i64..70, 1 => Just(0i64), 1 => Just(-1i64), 1 => any::<i64>()];
    let shape = prop::collection::vec(dim, 0..6);
    let lens = prop::collection::vec(prop_oneof![4 => 0usize..200_000, 1 => any::<usize>()], 0..4);
    (name, datatype, shape, lens, any::<bool>(), any::<u64>()).prop_map(|(name, datatype, shape, lens, exact, byte_size)| {
        // Half the time, one buffer of exactly the bytes the shape needs (as f32 or u8).
        let need =
            shape.iter().try_fold(if datatype == 2 { 1u64 } else { 4 }, |a, &d| u64::try_from(d).ok().and_then(|d| a.checked_mul(d)));
        let (byte_size, lens) = match (exact, need) {
            (true, Some(n)) if n <= 1 << 24 => (n, vec![n as usize]),
            _ => (byte_size % (1 << 24), lens),
        };
        let buffers = lens.into_iter().map(|len| Buffer { ptr: std::ptr::null(), len, memory: 0, device: 0 }).collect();
        InputData { name: name.to_string(), datatype, shape, byte_size, buffers }
    })
}

fn accepts(dims: &kiln::engine::InputDims) -> bool {
    dims.get("input").is_some_and(|d| d.len() == 3 && d[0] == 3 && (16..=64).contains(&d[1]) && (16..=64).contains(&d[2]))
        && dims.get("mask").is_some_and(|d| d == &[8])
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn images_with_mutated_bytes_decode_or_are_refused(
        base in 0usize..9,
        edits in prop::collection::vec(edit(image_fragments()), 1..6),
    ) {
        let (_, bytes) = &image_bases()[base];
        check_image(&apply(bytes, &edits));
    }

    #[test]
    fn images_claiming_any_size_are_checked_before_decoding(
        kind in any::<u8>(),
        w in prop_oneof![3 => 0u32..64, 1 => Just(MAX_IMAGE_SIDE + 1), 1 => Just(u32::MAX), 1 => any::<u32>()],
        h in prop_oneof![3 => 0u32..64, 1 => Just(MAX_IMAGE_SIDE), 1 => Just(u32::MAX), 1 => any::<u32>()],
        data in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        check_image(&claimed_image(kind, w, h, &data));
    }

    #[test]
    fn triton_configs_with_mutated_json_are_read_or_refused(edits in prop::collection::vec(edit(config_fragments()), 1..6)) {
        let bytes = apply(CONFIG_JSON.as_bytes(), &edits);
        if let Ok(text) = std::str::from_utf8(&bytes) {
            if let Ok(c) = ModelConfig::from_json(text) {
                check_config(&c);
            }
        }
    }

    #[test]
    fn config_pbtxt_with_mutated_text_is_read_or_refused(edits in prop::collection::vec(edit(config_fragments()), 1..6)) {
        let bytes = apply(CONFIG_PBTXT.as_bytes(), &edits);
        let written = triton_kiln::WrittenRepository {
            model_dir: "m".into(),
            model_file: "m/1/model.kiln.safetensors".into(),
            config_pbtxt: String::from_utf8_lossy(&bytes).into_owned(),
            serve_command: String::new(),
        };
        if let Ok(c) = triton_kiln::repository::read_written_config(&written) {
            check_config(&c);
        }
    }

    #[test]
    fn triton_requests_are_checked_before_anything_is_copied(
        inputs in prop::collection::vec(request_input(), 0..4),
        outputs in prop::collection::vec(prop::sample::select(vec!["logits", "boxes", "scores"]), 0..3),
    ) {
        let spec = spec();
        let accepted = || "input 3x16x16..3x64x64, mask 8".to_string();
        let limits = Limits { spec: &spec, max_batch: 8, declared_outputs: vec!["logits".into()], accepts: &accepts, accepted: &accepted };
        let req = RequestData { inputs, outputs: outputs.into_iter().map(String::from).collect() };
        if let Ok(c) = check_request(&limits, &req) {
            // What passed is what the engine may be given: a batch in range, accepted dims, and
            // exactly the bytes of each input.
            prop_assert!((1..=8).contains(&c.batch));
            prop_assert!(accepts(&c.dims));
            for (b, &i) in spec.inputs.iter().zip(&c.inputs) {
                let input = &req.inputs[i];
                let need = c.batch * b.elem.size() * c.dims[&b.name].iter().product::<usize>();
                prop_assert_eq!(input.buffers.iter().map(|b| b.len).sum::<usize>(), need);
            }
            let items = [(0usize, &c.dims, c.batch), (1, &c.dims, c.batch)];
            let runs = plan_runs(&items, 8);
            prop_assert_eq!(runs.iter().map(Vec::len).sum::<usize>(), 2);
        }
    }
}

/// The bases decode, so mutated cases start from valid files.
#[test]
fn image_bases_decode() {
    assert_eq!(image_bases().len(), 9);
    let c = ModelConfig::from_json(CONFIG_JSON).expect("config");
    check(&c, &spec()).expect("the base config matches the model");
    let written = triton_kiln::WrittenRepository {
        model_dir: "m".into(),
        model_file: "m".into(),
        config_pbtxt: CONFIG_PBTXT.into(),
        serve_command: String::new(),
    };
    let c = triton_kiln::repository::read_written_config(&written).expect("pbtxt");
    assert_eq!((c.input.len(), c.max_batch_size), (2, 8));
}

/// A model repository's config names files of the version folder only: `default_model_filename`
/// and the `calibration_cache` parameter may not lead out of it.
#[test]
fn config_paths_out_of_the_version_folder_are_refused() {
    let dir = std::env::temp_dir().join(format!("kiln-fuzz-inputs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    for name in ["../model.kiln", "/etc/passwd", "a/../../b"] {
        let e = triton_kiln::model::find_model_file("m", &dir, name).unwrap_err().to_string();
        assert!(e.contains("must name a file in the version folder") && e.contains(name), "{e}");
    }
    for cache in ["../calib.json", "/tmp/calib.json"] {
        let json = CONFIG_JSON
            .replace("\"precision\":{\"string_value\":\"fp16\"}", &format!("\"calibration_cache\":{{\"string_value\":\"{cache}\"}}"));
        let c = ModelConfig::from_json(&json).expect("config");
        let e = c.kiln_parameters().unwrap_err().to_string();
        assert!(e.contains("parameters[\"calibration_cache\"]") && e.contains("inside the model's version folder"), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Image files: a header claiming a huge image is refused from its dims, before its pixels are
/// allocated; a truncated file and a FIFO or directory are named (`load_rgb` does not wait on a FIFO).
#[test]
fn image_files_are_checked_before_decoding() {
    let path = Path::new("huge.png");
    for (w, h) in [(100_000, 100_000), (MAX_IMAGE_SIDE + 1, 1)] {
        let e = decode_rgb(&claimed_image(0, w, h, &[]), path).unwrap_err().to_string();
        assert!(
            e.contains("huge.png") && e.contains(&format!("is {w}x{h} pixels; an image must be 1 to 32768 pixels on each side")),
            "{e}"
        );
    }
    // Within each side's limit, but 32768 x 32768 RGB (3 GiB) exceeds the decoder's memory limit.
    let e = decode_rgb(&claimed_image(2, MAX_IMAGE_SIDE, MAX_IMAGE_SIDE, &[0; 16]), path).unwrap_err().to_string();
    assert!(e.contains("huge.png") && e.contains("more memory than the limit of 512 MiB"), "{e}");
    let (_, png) = &image_bases()[0];
    let e = decode_rgb(&png[..png.len() / 2], Path::new("cut.png")).unwrap_err().to_string();
    assert!(e.contains("cut.png"), "{e}");
    let e = decode_rgb(b"hello", Path::new("notes.png")).unwrap_err().to_string();
    assert!(e.contains("notes.png") && e.contains("is not an image this build reads"), "{e}");

    let dir = std::env::temp_dir().join(format!("kiln-fuzz-images-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("folder.png")).expect("dir");
    let fifo = dir.join("pipe.png");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo").success());
    let (tx, rx) = std::sync::mpsc::channel();
    let f = fifo.clone();
    std::thread::spawn(move || tx.send(kiln_vision::load_rgb(&f).map(|_| ()).map_err(|e| e.to_string())));
    let e = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("load_rgb waited on a FIFO").unwrap_err();
    assert!(e.contains("pipe.png") && e.contains("is not a regular file"), "{e}");
    let e = kiln_vision::load_rgb(dir.join("folder.png")).unwrap_err().to_string();
    assert!(e.contains("folder.png") && e.contains("is a directory"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `.pth` path that is a FIFO or a directory is named without waiting for a writer.
#[test]
fn pth_paths_that_are_fifos_or_directories_are_named() {
    let dir = std::env::temp_dir().join(format!("kiln-fuzz-pth-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("folder.pth")).expect("dir");
    let fifo = dir.join("pipe.pth");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo").success());
    let (tx, rx) = std::sync::mpsc::channel();
    let f = fifo.clone();
    std::thread::spawn(move || tx.send(kiln::files::read_pth(&f).map(|_| ()).map_err(|e| e.to_string())));
    let e = rx.recv_timeout(std::time::Duration::from_secs(10)).expect("read_pth waited on a FIFO").unwrap_err();
    assert!(e.contains("pipe.pth") && e.contains("is not a regular file"), "{e}");
    let e = kiln::files::read_pth(dir.join("folder.pth")).unwrap_err().to_string();
    assert!(e.contains("folder.pth") && e.contains("is a directory"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
