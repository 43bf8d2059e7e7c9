//! YOLO on the GPU: the `yolo_nms` and `yolo_letterbox` (BGR and RGB frames) layers against their CPU references,
//! and YOLOv8n / YOLO11n engines (FP32, FP16) against the CPU executor (which matches
//! Ultralytics to rel L2 1e-8 in `tests/yolo.rs`) and, where `KILN_REFERENCE_DIR` holds
//! `<model>.reference.safetensors` exported on the device, against Ultralytics itself.
//!
//! Run on the device: `cargo test --release -p kiln --test gpu_yolo -- --include-ignored --nocapture`.

mod common;

use common::{gpu, random, rel_l2};
use kiln::engine::{BuildConfig, Engine, EngineBuilder, Gpu, Precision};
use kiln::files::read_safetensors;
use kiln::image::ChannelOrder;
use kiln::{ByteTensor, DType, Tracer, VarBuilder};
use kiln::{Graph, HostTensor};
use kiln_models::yolo_nms::{detections, nms, NmsConfig};
use std::path::PathBuf;
use std::sync::Arc;

fn fixture(name: &str) -> PathBuf {
    let dir =
        std::env::var_os("KILN_FIXTURES").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"), PathBuf::from);
    dir.join(name)
}

/// `KILN_LAYER_PRECISIONS` (the `--layer-precisions` syntax) adds rules to the FP16 engines, for
/// finding which layers FP16 detections are sensitive to.
fn engine(gpu: &Arc<Gpu>, graph: &Graph, precision: Precision, max_batch: usize) -> Arc<Engine> {
    let mut config = BuildConfig::default().precision(precision).batch(1, max_batch, max_batch);
    if let (Precision::Fp16, Some(spec)) = (precision, std::env::var("KILN_LAYER_PRECISIONS").ok().filter(|s| !s.is_empty())) {
        config.layer_precisions = kiln::engine::LayerPrecision::parse_list(&spec).expect("KILN_LAYER_PRECISIONS");
        println!("FP16 engines with the extra rules {spec}");
    }
    Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(graph).unwrap_or_else(|e| panic!("build ({precision:?}): {e}")))
}

/// A tiny deterministic generator (the inputs below must be exact in f16, so they are built
/// from integers rather than drawn as floats).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// Crowded predictions `[n, 4 + c, a]` whose every value is exact in f16: boxes with integer
/// centres around 12 cluster centres and integer sizes, best-class scores distinct multiples of
/// 1/1024 (no ties, also in f16), the other classes' scores lower.
fn crowded(n: usize, c: usize, a: usize, seed: u64) -> HostTensor {
    assert!(a <= 760, "distinct scores in (0.25, 1) at 1/1024 steps");
    let mut g = Lcg(seed);
    let mut data = vec![0f32; n * (4 + c) * a];
    for img in 0..n {
        let p = &mut data[img * (4 + c) * a..(img + 1) * (4 + c) * a];
        let centres: Vec<(u64, u64)> = (0..12).map(|_| (40 + g.next(500), 40 + g.next(500))).collect();
        let mut levels: Vec<u64> = (260..1020).collect();
        for i in (1..levels.len()).rev() {
            levels.swap(i, g.next(i as u64 + 1) as usize);
        }
        for i in 0..a {
            let (cx, cy) = centres[g.next(12) as usize];
            p[i] = (cx + g.next(9)) as f32 - 4.0;
            p[a + i] = (cy + g.next(9)) as f32 - 4.0;
            p[2 * a + i] = (16 + g.next(48)) as f32;
            p[3 * a + i] = (16 + g.next(48)) as f32;
            let best = g.next(c as u64) as usize;
            let score = levels[i] as f32 / 1024.0;
            for k in 0..c {
                p[(4 + k) * a + i] = if k == best { score } else { (g.next(levels[i]) as f32) / 1024.0 };
            }
        }
    }
    HostTensor::new(vec![n, 4 + c, a], data)
}

fn nms_graph(shape: &[usize], config: &NmsConfig) -> Graph {
    let tracer = Tracer::new();
    let x = tracer.input("predictions", shape);
    tracer.output("detections", &nms(&x, config).expect("nms"));
    tracer.graph()
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device"]
fn nms_layer_matches_the_cpu_reference_exactly() {
    let Some(gpu) = gpu() else { return };
    let mapped = NmsConfig { frame: Some(([720, 1280], [640, 640])), ..NmsConfig::default() };
    let settings = [
        ("default", NmsConfig::default()),
        ("strict", NmsConfig { conf: 0.5, iou: 0.3, max_det: 1000, ..NmsConfig::default() }),
        ("k=10", NmsConfig { max_det: 10, ..NmsConfig::default() }),
        ("cap=64", NmsConfig { max_candidates: 64, ..NmsConfig::default() }),
        ("mapped", mapped),
    ];
    for (name, config) in settings {
        let graph = nms_graph(&[1, 4 + 3, 700], &config);
        for precision in [Precision::Fp32, Precision::Fp16] {
            let mut ctx = engine(&gpu, &graph, precision, 3).context().expect("context");
            for batch in [1, 3] {
                let x = crowded(batch, 3, 700, 11 + batch as u64);
                let want = kiln::run_cpu(&graph, &[("predictions", &x)]).expect("cpu")["detections"].clone();
                let got = ctx.run(&[("predictions", &x)]).expect("run")["detections"].clone();
                let kept: Vec<usize> = (0..batch).map(|n| detections(&want, n).len()).collect();
                let same = got.data == want.data;
                println!("yolo_nms {name} {precision:?} batch {batch}: {kept:?} detections, identical to the CPU: {same}");
                assert_eq!(got.shape, want.shape);
                assert!(same, "yolo_nms {name} {precision:?} batch {batch}: rows differ from the CPU reference");
            }
        }
    }
    // More candidates than the cap (radix select), crowded boxes: torchvision's set, in FP32.
    let refs = read_safetensors(fixture("yolo_nms.reference.safetensors")).expect("reference file");
    let x = &refs["input"];
    let graph = nms_graph(&[1, x.shape[1], x.shape[2]], &NmsConfig::default());
    let got = engine(&gpu, &graph, Precision::Fp32, 2).context().expect("context").run(&[("predictions", x)]).expect("run");
    let want = kiln::run_cpu(&graph, &[("predictions", x)]).expect("cpu");
    assert_eq!(got["detections"].data, want["detections"].data, "the fixture's NMS differs from the CPU reference");
    println!("yolo_nms fixture (4922 candidates, cap 4096): identical to the CPU reference");
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device"]
fn letterbox_layer_matches_the_cpu_reference() {
    let Some(gpu) = gpu() else { return };
    for (h, w, ih, iw) in [(37, 53, 64, 64), (50, 30, 64, 96), (64, 64, 64, 64), (720, 1280, 640, 640), (480, 640, 320, 320)] {
        let mut frame = random(&[2, h, w * 3], (h * w) as u64, 1.0);
        frame.data.iter_mut().for_each(|v| *v = ((*v + 1.0) * 127.9).floor());
        // The same pixels stored R, G, B: an RGB letterbox of them is the BGR letterbox of `frame`.
        let swapped = HostTensor::new(frame.shape.clone(), frame.data.chunks(3).flat_map(|p| [p[2], p[1], p[0]]).collect());
        for (precision, tol) in [(Precision::Fp32, 0.0), (Precision::Fp16, 2.5e-4)] {
            let mut outputs = Vec::new();
            for (order, frame) in [(ChannelOrder::Bgr, &frame), (ChannelOrder::Rgb, &swapped)] {
                let tracer = Tracer::new();
                let x = tracer.input("frame", &[1, h, w * 3]);
                tracer.output("input", &kiln_models::yolo_letterbox::letterbox_with(&x, [ih, iw], order).expect("letterbox"));
                let graph = tracer.graph();
                let mut ctx = engine(&gpu, &graph, precision, 2).context().expect("context");
                let want = kiln::run_cpu(&graph, &[("frame", frame)]).expect("cpu")["input"].clone();
                let got = ctx.run(&[("frame", frame)]).expect("run")["input"].clone();
                let (rel, max_abs) = rel_l2(&got.data, &want.data);
                println!("letterbox {h}x{w} {order:?} -> {ih}x{iw} {precision:?}: rel L2 {rel:.2e}, max abs {max_abs:.2e}");
                assert!(max_abs <= tol, "letterbox {h}x{w} {order:?} {precision:?}: max abs {max_abs} > {tol}");
                outputs.push(got);
            }
            assert_eq!(outputs[0], outputs[1], "letterbox {h}x{w} {precision:?}: RGB of the swapped frame = BGR of the frame");
        }
    }
}

/// The letterbox front with its frame declared u8 (`frame_input`), run from raw bytes: FP32 and
/// FP16 engines match the CPU reference as the f32 frame above does, the frame's binding holds one
/// byte per element, the entry reformat reads bytes, the same frame as f32 byte values gives the
/// same outputs, and a value that is no byte is `Error::NotAByte` naming it.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device"]
fn letterbox_from_u8_frames_matches_the_cpu_reference() {
    let Some(gpu) = gpu() else { return };
    let max_batch = 2;
    let cases = [(37, 53, 64, 64), (50, 30, 64, 96), (64, 64, 64, 64), (720, 1280, 640, 640), (480, 640, 320, 320)];
    for ((h, w, ih, iw), order) in cases.into_iter().flat_map(|c| [(c, ChannelOrder::Bgr), (c, ChannelOrder::Rgb)]) {
        let tracer = Tracer::new();
        let x = kiln_models::yolo_letterbox::frame_input(&tracer, "frame", 1, [h, w]);
        tracer.output("input", &kiln_models::yolo_letterbox::letterbox_with(&x, [ih, iw], order).expect("letterbox"));
        let graph = tracer.graph();
        for (precision, tol) in [(Precision::Fp32, 0.0), (Precision::Fp16, 2.5e-4)] {
            let engine = engine(&gpu, &graph, precision, max_batch);
            assert_eq!(engine.input_dtype("frame"), Some(DType::U8));
            let entry = engine.layers().next().expect("the entry reformat").kind();
            assert_eq!(entry, format!("kernel:cast_u8_{}", precision.elem().suffix()), "the entry reformat converts the bytes");
            let mut ctx = engine.context().expect("context");
            let bytes_held = ctx.binding_bytes("frame").expect("frame binding");
            assert_eq!(bytes_held, max_batch * h * w * 3, "the frame binding holds 1 byte per element at the max batch");
            for batch in [1, max_batch] {
                let mut values = random(&[batch, h, w * 3], (h * w + batch) as u64, 1.0);
                values.data.iter_mut().for_each(|v| *v = ((*v + 1.0) * 127.9).floor());
                let bytes = ByteTensor::new(values.shape.clone(), values.data.iter().map(|&v| v as u8).collect()).expect("bytes");
                let want = kiln::run_cpu(&graph, &[("frame", &bytes)]).expect("cpu")["input"].clone();
                let got = ctx.run(&[("frame", &bytes)]).expect("run from bytes")["input"].clone();
                let (rel, max_abs) = rel_l2(&got.data, &want.data);
                println!(
                    "letterbox u8 {h}x{w} {order:?} -> {ih}x{iw} {precision:?} batch {batch}: rel L2 {rel:.2e}, max abs {max_abs:.2e}; frame binding {bytes_held} bytes"
                );
                assert!(max_abs <= tol, "letterbox u8 {h}x{w} {precision:?} batch {batch}: max abs {max_abs} > {tol}");
                let from_values = ctx.run(&[("frame", &values)]).expect("run from f32 byte values")["input"].clone();
                assert_eq!(from_values.data, got.data, "f32 byte values upload the same bytes");
                values.data[7] = 0.5;
                match ctx.run(&[("frame", &values)]) {
                    Err(kiln::Error::NotAByte { name, index, value }) => {
                        assert_eq!((name.as_str(), index, value), ("frame", vec![0, 0, 7], 0.5));
                    }
                    other => panic!("a frame value of 0.5: expected NotAByte, got {other:?}"),
                }
            }
        }
    }
}

/// Share of `want`'s detections (image `n`) that `got` has too: same class, IoU >= 0.9.
fn matched(got: &HostTensor, want: &HostTensor, n: usize) -> (usize, usize) {
    let (g, w) = (detections(got, n), detections(want, n));
    let iou = |a: &[f32; 6], b: &[f32; 6]| {
        let iw = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
        let ih = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
        let inter = iw * ih;
        inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)
    };
    (w.iter().filter(|wr| g.iter().any(|gr| gr[5] == wr[5] && iou(gr, wr) >= 0.9)).count(), w.len())
}

/// Checks an engine's outputs against a reference: predictions by rel L2, detections by the
/// share matched (same class, IoU >= 0.9).
fn check(
    label: &str,
    got: &std::collections::BTreeMap<String, HostTensor>,
    want: &HostTensor,
    want_det: &HostTensor,
    tol: f64,
    min_share: Option<f64>,
) {
    let (rel, max_abs) = rel_l2(&got["predictions"].data, &want.data);
    println!("{label} predictions {:?}: rel L2 {rel:.2e}, max abs {max_abs:.2e}", want.shape);
    assert!(rel <= tol, "{label}: predictions rel L2 {rel:.3e} > {tol:e}");
    let (mut all_m, mut all_total) = (0, 0);
    for n in 0..want.shape[0] {
        let (m, total) = matched(&got["detections"], want_det, n);
        (all_m, all_total) = (all_m + m, all_total + total);
        let share = if total == 0 { 1.0 } else { m as f64 / total as f64 };
        println!("{label} image {n}: {m} of {total} detections matched (same class, IoU >= 0.9): {:.1}%", share * 100.0);
        if let Some(min_share) = min_share {
            assert!(share >= min_share, "{label} image {n}: only {:.1}% of the detections match", share * 100.0);
        }
    }
    let share = if all_total == 0 { 100.0 } else { 100.0 * all_m as f64 / all_total as f64 };
    println!("MATCHED {label}: {all_m} of {all_total} detections ({share:.1}%, at least {:?} asserted)", min_share.map(|s| s * 100.0));
}

/// The Detect head's decode and the NMS run in FP32 inside an FP16 engine (`Graph::fp32_layers`,
/// set by `Detect::forward` and `yolo_nms::nms`); the branches' convolutions stay FP16.
fn assert_decode_in_fp32(model: &str, engine: &Engine) {
    let describe = engine.describe();
    let head = if model == "yolov8n" { "model.22" } else { "model.23" };
    let precision_of = |suffix: &str| {
        describe
            .lines()
            .filter(|l| l.split_whitespace().any(|t| t == format!("{head}.{suffix}")) && !l.contains("kernel:cast"))
            .map(|l| l.split_whitespace().nth(1).unwrap_or("").to_string())
            .collect::<Vec<_>>()
    };
    for (suffix, want) in [("dfl.conv", "fp32"), ("decode.stride", "fp32"), ("decode.yolo_nms", "fp32"), ("cv2.0.2", "fp16")] {
        let got = precision_of(suffix);
        assert!(!got.is_empty() && got.iter().all(|p| p == want), "{model} {head}.{suffix}: {got:?}, expected {want}\n{describe}");
    }
}

/// YOLOv8n and YOLO11n at 640x640: FP32 and FP16 engines against the CPU executor with seeded
/// weights, and against Ultralytics where `KILN_REFERENCE_DIR` has a reference (with its weights
/// when `<model>.weights.safetensors` is beside it). Then FP16 latency at batch 1 and 32.
///
/// Seeded weights give every anchor a score near 0.5 and tiny boxes, so NMS keeps the 300 best
/// scores out of 8400 near-ties: FP16's score rounding (about 2e-4 at 0.5) reorders that cut
/// (4.7% kept on the H100), so with seeded weights the FP16 share is printed, not asserted, and the
/// predictions are checked by rel L2. With Ultralytics' references (calibrated head, separated
/// scores) it must reach 98%, or PyTorch's own FP16 share where that is lower: on YOLO11n's random
/// network (its calibrated head amplifies FP16 rounding) Ultralytics' FP16 model keeps 86% of its
/// own FP32 detections on the H100 (`tools/yolo_fp16_baseline.py`).
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device"]
fn yolo_models_match_the_cpu_and_ultralytics() {
    let Some(gpu) = gpu() else { return };
    for model in ["yolov8n", "yolo11n"] {
        let graph = kiln_models::trace(model, VarBuilder::seeded(), 1, 640).expect("trace");
        let x = kiln::dev::weight("input.0", &[2, 3, 640, 640]);
        let want = kiln::run_cpu(&graph, &[("input", &x)]).expect("cpu");
        for (precision, tol, share) in [(Precision::Fp32, 1e-4, Some(0.98)), (Precision::Fp16, 1e-2, None)] {
            let label = format!("{model} seeded {precision:?}");
            let e = engine(&gpu, &graph, precision, 32);
            println!("{label}: {}", e.summary);
            let mut ctx = e.context().expect("context");
            let got = ctx.run(&[("input", &x)]).expect("run");
            check(&label, &got, &want["predictions"], &want["detections"], tol, share);
            if precision == Precision::Fp16 {
                for b in [1, 32] {
                    let input = HostTensor::new(vec![b, 3, 640, 640], x.data.iter().copied().cycle().take(b * 3 * 640 * 640).collect());
                    ctx.run(&[("input", &input)]).expect("bind");
                    let ms = ctx.time(b, 10, if b == 1 { 200 } else { 30 }).expect("timing");
                    println!(
                        "TIMING {model} FP16 640 batch {b} cuda_graphs=true (NMS included): {ms:.3} ms median, {:.0} images/s",
                        b as f64 / ms * 1e3
                    );
                }
            }
        }
        let Some(root) = std::env::var_os("KILN_REFERENCE_DIR").map(PathBuf::from) else { continue };
        // tools/gpu-test.sh writes `seeded/` and `torchvision/` (Ultralytics' init) under the root.
        for dir in [root.clone(), root.join("torchvision"), root.join("seeded")] {
            let path = dir.join(format!("{model}.reference.safetensors"));
            if !path.exists() {
                println!("{model}: no {}", path.display());
                continue;
            }
            let refs = read_safetensors(&path).expect("reference");
            let x = &refs["input"];
            let weights = dir.join(format!("{model}.weights.safetensors"));
            let vb = if weights.exists() { VarBuilder::from_safetensors(&[&weights]).expect("weights") } else { VarBuilder::seeded() };
            let graph = kiln_models::trace(model, vb.clone(), 1, x.shape[2]).expect("trace");
            vb.check_all_used().expect("every state_dict key is used");
            for (precision, tol) in [(Precision::Fp32, 1e-4), (Precision::Fp16, 1e-2)] {
                let e = engine(&gpu, &graph, precision, x.shape[0]);
                if precision == Precision::Fp16 {
                    assert_decode_in_fp32(model, &e);
                }
                let mut ctx = e.context().expect("context");
                let got = ctx.run(&[("input", x)]).expect("run");
                let label = format!("{model} Ultralytics {} {precision:?}", path.display());
                // Seeded weights: the FP16 share is only printed (see above). Otherwise FP16 must keep
                // 98% of the FP32 detections, or, where PyTorch's own FP16 run of the model keeps
                // fewer (`output.detections_fp16`, tools/export_reference.py), at least as many as it.
                let share = match (precision, refs.get("output.detections_fp16")) {
                    (Precision::Fp16, _) if dir.ends_with("seeded") => None,
                    (Precision::Fp16, Some(torch16)) => {
                        let (m, total) = (0..x.shape[0])
                            .map(|n| matched(torch16, &refs["output.detections"], n))
                            .fold((0, 0), |(a, b), (m, t)| (a + m, b + t));
                        let torch_share = if total == 0 { 1.0 } else { m as f64 / total as f64 };
                        println!("BASELINE {model}: PyTorch's own FP16 keeps {m} of {total} FP32 detections ({:.1}%)", torch_share * 100.0);
                        Some(torch_share.min(0.98))
                    }
                    _ => Some(0.98),
                };
                check(&label, &got, &refs["output.predictions"], &refs["output.detections"], tol, share);
            }
        }
    }
}
