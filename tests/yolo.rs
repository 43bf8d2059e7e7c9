//! The YOLO detectors and their post-processing on Kiln's CPU executor against Ultralytics and
//! torchvision, with seeded weights.
//!
//! References (`python3 tools/export_reference.py --all-fixtures --out tests/fixtures`):
//! `yolov8n` / `yolo11n.reference.safetensors` (Ultralytics' `DetectionModel`, batch 2 at
//! 160x160: `input`, `output.predictions` [2, 84, 525], `output.detections` [2, 300, 6]) and
//! `yolo_nms.reference.safetensors` (synthetic crowded predictions and `batched_nms`' result).
//! The letterbox's reference is `letterbox.reference.safetensors` (`tools/yolo_letterbox_reference.py`; its `rgb_`
//! cases hold RGB frames, read with `bgr` = 0).

use kiln::compare;
use kiln::files::read_safetensors;
use kiln::image::ChannelOrder;
use kiln::{plugin::lookup, plugin::Attrs};
use kiln::{HostTensor, VarBuilder};
use kiln_models::yolo_nms::detections;
use std::collections::BTreeMap;
use std::path::PathBuf;

const TOL: f64 = 1e-5;

fn fixture(name: &str) -> PathBuf {
    let dir =
        std::env::var_os("KILN_FIXTURES").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"), PathBuf::from);
    dir.join(name)
}

/// Rows of `out` (`[N, K, 6]`) for image `n`, sorted, for a comparison as sets.
fn as_set(out: &HostTensor, n: usize) -> Vec<[f32; 6]> {
    let mut rows = detections(out, n);
    rows.sort_by(|a, b| a.iter().zip(b).map(|(x, y)| x.total_cmp(y)).find(|o| o.is_ne()).unwrap_or(std::cmp::Ordering::Equal));
    rows
}

/// Exactly the same detections, as a set, per image.
fn assert_same_set(what: &str, got: &HostTensor, want: &HostTensor) {
    assert_eq!(got.shape, want.shape, "{what}");
    for n in 0..want.shape[0] {
        let (g, w) = (as_set(got, n), as_set(want, n));
        println!("{what} image {n}: {} detections (torchvision {})", g.len(), w.len());
        assert_eq!(g.len(), w.len(), "{what} image {n}: detection counts differ");
        assert_eq!(g, w, "{what} image {n}: detections differ");
    }
}

fn run_nms(attrs: &[(&str, f64)], pred: &HostTensor) -> HostTensor {
    let attrs: Attrs = attrs.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    (lookup("yolo_nms").expect("registered").cpu)(&attrs, &[pred]).expect("yolo_nms")
}

#[test]
fn nms_matches_torchvision_batched_nms() {
    let refs = read_safetensors(fixture("yolo_nms.reference.safetensors")).expect("reference file");
    let pred = &refs["input"];
    assert_same_set("yolo_nms default", &run_nms(&[], pred), &refs["output.default"]);
    let strict = run_nms(&[("conf", 0.5), ("iou", 0.3), ("k", 1000.0)], pred);
    assert_same_set("yolo_nms strict", &strict, &refs["output.strict"]);
    // Kept boxes come first, best first; padding after.
    for n in 0..2 {
        let rows: Vec<&[f32]> = strict.data[n * 6000..(n + 1) * 6000].chunks(6).collect();
        let kept = rows.iter().take_while(|r| r[5] >= 0.0).count();
        assert!(kept < 1000 && rows[kept..].iter().all(|r| r == &[0.0, 0.0, 0.0, 0.0, 0.0, -1.0]));
        assert!(rows[..kept].windows(2).all(|w| w[0][4] > w[1][4]), "scores descend");
    }
}

/// Traces a bundled YOLO at the reference's input, runs it on the CPU, checks the predictions
/// (rel L2) and the NMS (on PyTorch's own predictions: exactly torchvision's set; on ours: the
/// same boxes to 1e-4).
fn check_model(model: &str) {
    let refs = read_safetensors(fixture(&format!("{model}.reference.safetensors"))).expect("reference file");
    let x = &refs["input"];
    assert_eq!(*x, kiln::dev::weight("input.0", &x.shape), "the reference input is not seeded `input.0`");
    let start = std::time::Instant::now();
    let graph = kiln_models::trace(model, VarBuilder::seeded(), x.shape[0], x.shape[2]).expect("trace");
    for (name, g) in [("traced", graph.clone()), ("optimised", kiln::engine::optimize(&graph).expect("passes"))] {
        let ours = kiln::run_cpu(&g, &[("input", x)]).expect("cpu run");
        let c = compare(&format!("{model} ({name}).predictions"), &ours["predictions"], &refs["output.predictions"]);
        println!("{c} ({:.2?})", start.elapsed());
        assert!(c.passes(TOL), "{c} exceeds rel L2 {TOL}");
        let (got, want) = (&ours["detections"], &refs["output.detections"]);
        for n in 0..x.shape[0] {
            let (g, w) = (as_set(got, n), as_set(want, n));
            let worst = g.iter().zip(&w).flat_map(|(a, b)| a.iter().zip(b).map(|(p, q)| (p - q).abs())).fold(0f32, f32::max);
            println!("{model} ({name}) image {n}: {} detections (PyTorch {}), max abs difference {worst:.2e}", g.len(), w.len());
            assert_eq!(g.len(), w.len());
            assert!(worst < 1e-4, "{model}: detections differ by {worst}");
        }
    }
    assert_same_set(
        &format!("{model} NMS of PyTorch's predictions"),
        &run_nms(&[], &refs["output.predictions"]),
        &refs["output.detections"],
    );
}

#[test]
fn yolov8n_matches_ultralytics() {
    check_model("yolov8n");
}

#[test]
fn yolo11n_matches_ultralytics() {
    check_model("yolo11n");
}

/// (parameters, state_dict tensors) of a traced YOLO: its weights without the anchors and
/// strides constants, parameters without the BatchNorm statistics.
fn params(g: &kiln::Graph) -> (usize, usize) {
    let state: Vec<_> = g.weights.iter().filter(|(k, _)| !k.ends_with(".anchors") && !k.ends_with(".strides")).collect();
    (state.iter().filter(|(k, _)| !k.contains("running")).map(|(_, w)| w.numel()).sum(), state.len())
}

/// Parameter counts and `state_dict` sizes (without `num_batches_tracked`) of Ultralytics'
/// `DetectionModel(yaml)` (ultralytics 8.4, also the yaml's summary lines), and a few keys.
#[test]
fn yolos_have_ultralytics_parameters_and_names() {
    type Load = fn(VarBuilder) -> kiln::Result<kiln_models::Yolo>;
    type Keys = &'static [(&'static str, &'static [usize])];
    let table: [(&str, Load, usize, usize, Keys); 4] = [
        (
            "yolov8n",
            kiln_models::yolov8n,
            3_157_200,
            298,
            &[
                ("model.0.conv.weight", &[16, 3, 3, 3]),
                ("model.2.m.0.cv1.conv.weight", &[16, 16, 3, 3]),
                ("model.9.cv2.bn.running_var", &[256]),
                ("model.22.cv2.0.0.conv.weight", &[64, 64, 3, 3]),
                ("model.22.cv3.2.2.bias", &[80]),
                ("model.22.dfl.conv.weight", &[1, 16, 1, 1]),
            ],
        ),
        ("yolov8s", kiln_models::yolov8s, 11_166_560, 298, &[("model.21.cv2.conv.weight", &[512, 768, 1, 1])]),
        (
            "yolo11n",
            kiln_models::yolo11n,
            2_624_080,
            418,
            &[
                ("model.2.m.0.cv1.conv.weight", &[8, 16, 3, 3]),
                ("model.6.m.0.m.1.cv2.conv.weight", &[32, 32, 3, 3]),
                ("model.10.m.0.attn.qkv.conv.weight", &[256, 128, 1, 1]),
                ("model.10.m.0.attn.pe.conv.weight", &[128, 1, 3, 3]),
                ("model.10.m.0.ffn.1.bn.bias", &[128]),
                ("model.23.cv3.0.0.0.conv.weight", &[64, 1, 3, 3]),
                ("model.23.cv3.1.1.1.bn.running_mean", &[80]),
                ("model.23.dfl.conv.weight", &[1, 16, 1, 1]),
            ],
        ),
        ("yolo11s", kiln_models::yolo11s, 9_458_752, 418, &[("model.10.m.0.attn.qkv.conv.weight", &[512, 256, 1, 1])]),
    ];
    for (name, load, count, tensors, keys) in table {
        let tracer = kiln::Tracer::new();
        let x = tracer.input("input", &[1, 3, 64, 96]);
        let y = kiln::Forward::forward(&load(VarBuilder::seeded()).expect("load"), &x).expect("forward");
        assert_eq!(y.shape(), [1, 84, 8 * 12 + 4 * 6 + 2 * 3], "{name}: [N, 84, anchors] at 64x96");
        tracer.output("predictions", &y);
        let g = tracer.graph();
        assert_eq!(params(&g), (count, tensors), "{name}: Ultralytics' parameter count and state_dict entries");
        for (key, shape) in keys {
            let w = g.weights.get(*key).unwrap_or_else(|| panic!("{name}: no `{key}`"));
            assert_eq!(w.shape, *shape, "{name}: {key}");
        }
        let attention = g.nodes.iter().filter(|n| n.op.name() == "softmax").count();
        println!("{name}: {count} parameters, {tensors} tensors, {attention} softmax nodes");
    }
}

/// The preprocessing op against the Python letterbox (numpy; cv2 is not needed).
#[test]
fn letterbox_matches_the_python_reference() {
    let refs: BTreeMap<String, HostTensor> = read_safetensors(fixture("letterbox.reference.safetensors")).expect("reference file");
    for (key, want) in refs.iter().filter(|(k, _)| k.starts_with("output.")) {
        let case = &key["output.".len()..];
        let frame = &refs[&format!("frame.{case}")];
        let size = want.shape[2..].to_vec();
        let mut attrs: Attrs = [("input_h".to_string(), size[0] as f64), ("input_w".to_string(), size[1] as f64)].into_iter().collect();
        if case.starts_with("rgb_") {
            attrs.insert("bgr".into(), ChannelOrder::Rgb.bgr_attr());
        }
        let got = (lookup("yolo_letterbox").expect("registered").cpu)(&attrs, &[frame]).expect("letterbox");
        let c = compare(&format!("letterbox {case}"), &got, want);
        println!("{c}");
        assert!(c.passes(1e-7) && c.max_abs == 0.0, "{c}: the CPU letterbox must match the Python reference exactly");
    }
}

/// The letterbox front of a model: the reference frames as a u8 `frame` input (`frame_input`),
/// run from their bytes and from their f32 values, give the reference exactly; the graph keeps
/// the input's type through a graph file.
#[test]
fn a_u8_frame_runs_from_bytes_as_from_f32_values() {
    let refs: BTreeMap<String, HostTensor> = read_safetensors(fixture("letterbox.reference.safetensors")).expect("reference file");
    for (key, want) in refs.iter().filter(|(k, _)| k.starts_with("output.")) {
        let case = &key["output.".len()..];
        let frame = &refs[&format!("frame.{case}")];
        let [n, h, w3] = frame.shape[..] else { panic!("frame {case}: {:?}", frame.shape) };
        let tracer = kiln::Tracer::new();
        let x = kiln_models::yolo_letterbox::frame_input(&tracer, "frame", n, [h, w3 / 3]);
        let order = if case.starts_with("rgb_") { ChannelOrder::Rgb } else { ChannelOrder::Bgr };
        let input = kiln_models::yolo_letterbox::letterbox_with(&x, [want.shape[2], want.shape[3]], order).expect("letterbox");
        tracer.output("input", &input);
        let graph = tracer.graph();
        assert_eq!(graph.input_dtype("frame"), Some(kiln::DType::U8));
        let bytes = kiln::ByteTensor::new(frame.shape.clone(), frame.data.iter().map(|&v| v as u8).collect()).expect("bytes");
        assert_eq!(bytes.to_f32(), *frame, "the reference frames hold bytes");
        let from_bytes = kiln::run_cpu(&graph, &[("frame", &bytes)]).expect("bytes")["input"].clone();
        let from_values = kiln::run_cpu(&graph, &[("frame", frame)]).expect("f32 values")["input"].clone();
        assert_eq!(from_bytes, *want, "letterbox {case} from bytes");
        assert_eq!(from_values, *want, "letterbox {case} from f32 values");
        let path = std::env::temp_dir().join(format!("kiln-u8-frame-{}-{case}.kiln.safetensors", std::process::id()));
        graph.save(&path).expect("save");
        assert_eq!(kiln::Graph::load(&path).expect("load").input_dtype("frame"), Some(kiln::DType::U8));
        let _ = std::fs::remove_file(&path);
    }
}

/// The Detect head's decode and the NMS are required in FP32 by the model itself
/// (`Graph::fp32_layers`): in an FP16 engine every node under `model.22.decode` and `model.22.dfl`
/// computes in FP32 and the branches' convolutions in FP16; a user's rule may override them.
#[test]
fn yolo_decode_and_nms_compute_in_fp32_in_fp16_engines() {
    use kiln::{
        dev::plan::node_precisions,
        engine::{BuildConfig, Precision},
    };
    for (model, head) in [("yolov8n", "model.22"), ("yolo11n", "model.23")] {
        let graph = kiln::engine::optimize(&kiln_models::trace(model, kiln::VarBuilder::seeded(), 1, 160).expect("trace")).expect("passes");
        assert_eq!(graph.fp32_layers, [format!("{head}.decode"), format!("{head}.dfl"), format!("{head}.decode.yolo_nms")], "{model}");
        let check = |config: &BuildConfig, decode: Precision| {
            let p = node_precisions(&graph, config);
            let mut seen = (0, 0);
            for (node, p) in graph.nodes.iter().zip(p).filter(|(n, _)| !n.op.is_leaf()) {
                let in_decode = node.path.starts_with(&format!("{head}.decode.")) || node.path.starts_with(&format!("{head}.dfl."));
                let want = if in_decode { decode } else { Precision::Fp16 };
                assert_eq!(p, want, "{model} {} ({})", node.path, node.op.name());
                if in_decode {
                    seen.0 += 1;
                } else {
                    seen.1 += 1;
                }
            }
            let nms = graph.nodes.iter().position(|n| n.op.name() == "yolo_nms").expect("an NMS node");
            assert_eq!(graph.nodes[nms].path, format!("{head}.decode.yolo_nms"));
            assert!(seen.0 >= 12 && seen.1 > 50, "{model}: {seen:?} decode / other nodes");
        };
        check(&BuildConfig::default(), Precision::Fp32);
        check(&BuildConfig::default().layer_precision(&format!("{head}.*"), Precision::Fp16), Precision::Fp16);
    }
}
