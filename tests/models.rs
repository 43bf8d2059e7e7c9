//! The bundled models on Kiln's CPU executor against PyTorch, with seeded weights.
//!
//! References: `tests/fixtures/<model>.reference.safetensors`, written by
//! `python3 tools/export_reference.py --all-fixtures --out tests/fixtures` (docs/REFERENCES.md):
//! the ResNet-18/50 at 224 and CenterNet at 512 (batch 1), RegNetY-400MF and ConvNeXt-Tiny at 96x96
//! and the other classifiers at 112x112, batch 2, to keep the CPU executor's time down. Each holds `input` and the outputs only.

use kiln::files::read_safetensors;
use kiln::{compare, top1, Comparison};
use kiln::{HostTensor, VarBuilder};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Relative L2 error allowed between Kiln's CPU executor and PyTorch, both in FP32.
const TOL: f64 = 1e-5;

/// `tests/fixtures/<name>`, or under `KILN_FIXTURES` (test binaries carried to another machine).
fn fixture(name: &str) -> PathBuf {
    let dir =
        std::env::var_os("KILN_FIXTURES").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"), PathBuf::from);
    dir.join(name)
}

/// Traces `model` at the reference input's shape, runs it on the CPU and returns (ours, PyTorch's).
fn run(model: &str) -> (BTreeMap<String, HostTensor>, BTreeMap<String, HostTensor>) {
    let refs = read_safetensors(fixture(&format!("{model}.reference.safetensors"))).expect("reference file");
    let x = &refs["input"];
    // The exporter draws its input from the seeded generator, so both sides agree on it by name.
    assert_eq!(*x, kiln::dev::weight("input.0", &x.shape), "the reference input is not seeded `input.0`");
    let (batch, size) = (x.shape[0], x.shape[2]);
    let vb = VarBuilder::seeded();
    let graph = kiln_models::trace(model, vb, batch, size).expect("trace");
    let ours = kiln::run_cpu(&graph, &[("input", x)]).expect("cpu run");
    (ours, refs)
}

fn check(model: &str, name: &str, ours: &BTreeMap<String, HostTensor>, refs: &BTreeMap<String, HostTensor>) -> Comparison {
    let got = ours.get(name).unwrap_or_else(|| panic!("{model}: no output `{name}` (have {:?})", ours.keys()));
    let c = compare(&format!("{model}.{name}"), got, &refs[&format!("output.{name}")]);
    println!("{c}");
    c
}

fn check_classifier(model: &str) {
    let start = std::time::Instant::now();
    let (ours, refs) = run(model);
    println!("{model}: traced and run on the CPU at {:?} in {:.2?}", refs["input"].shape, start.elapsed());
    let c = check(model, "logits", &ours, &refs);
    assert!(c.passes(TOL), "{c} exceeds rel L2 {TOL}");
    let (got, want) = (top1(&ours["logits"]), top1(&refs["output.logits"]));
    println!("{model}: top-1 {got:?} (PyTorch {want:?})");
    assert_eq!(got, want, "{model}: top-1 differs from PyTorch");
}

/// The graph the engine builds from (BatchNorm folded, conv + ReLU fused, dead nodes dropped), run
/// on the CPU, against PyTorch: the passes keep every new structure exact (DenseNet's BatchNorms
/// after a concatenation, which cannot fold; GoogLeNet's branches; VGG's and AlexNet's classifiers).
fn check_optimized_classifier(model: &str) {
    let refs = read_safetensors(fixture(&format!("{model}.reference.safetensors"))).expect("reference file");
    let x = &refs["input"];
    let graph = kiln_models::trace(model, VarBuilder::seeded(), x.shape[0], x.shape[2]).expect("trace");
    let optimized = kiln::engine::optimize(&graph).expect("passes");
    let ours = kiln::run_cpu(&optimized, &[("input", x)]).expect("cpu run");
    let c = check(&format!("{model} (optimised)"), "logits", &ours, &refs);
    assert!(c.passes(TOL), "{c} exceeds rel L2 {TOL}");
    assert_eq!(top1(&ours["logits"]), top1(&refs["output.logits"]), "{model} (optimised): top-1 differs from PyTorch");
}

/// The bundled classifiers (one `logits` output): `kiln_models::BUNDLED` is the list. The other
/// models' outputs are checked below (CenterNet) and in tests/yolo.rs.
fn classifiers() -> Vec<&'static str> {
    let names: Vec<&str> = kiln_models::BUNDLED.iter().filter(|m| m.outputs == ["logits"]).map(|m| m.name).collect();
    assert!(names.len() > 20, "{names:?}");
    names
}

/// Every bundled classifier's traced graph against its committed reference.
#[test]
fn every_classifier_matches_pytorch() {
    classifiers().into_iter().for_each(check_classifier);
}

/// Every bundled classifier's optimised graph (the one the engine builds from) against its
/// committed reference; a test of its own, so that it runs beside the traced graphs'.
#[test]
fn every_optimized_classifier_matches_pytorch() {
    classifiers().into_iter().for_each(check_optimized_classifier);
}

/// Every bundled model has a committed reference holding only `input` and its outputs. The export
/// script lists the models with `kiln models --json`; it builds torchvision's and the YOLOs by
/// name, and the others with a builder of its own, which must exist.
#[test]
fn every_bundled_model_has_a_reference() {
    let script = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/export_reference.py")).expect("script");
    let builders = script.lines().find(|l| l.starts_with("OWN_BUILDERS = {")).expect("tools/export_reference.py has OWN_BUILDERS");
    for info in kiln_models::BUNDLED {
        if !info.torchvision && info.family() != "yolo" {
            assert!(builders.contains(&format!("\"{}\":", info.name)), "tools/export_reference.py has no builder for `{}`", info.name);
        }
        let path = fixture(&format!("{}.reference.safetensors", info.name));
        let refs = read_safetensors(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut want: Vec<String> = info.outputs.iter().map(|o| format!("output.{o}")).collect();
        want.push("input".into());
        want.sort();
        assert_eq!(refs.keys().cloned().collect::<Vec<_>>(), want, "{}", path.display());
    }
}

/// Columns of a [N, K, 6] detections tensor (x1, y1, x2, y2 | score | class) as separate tensors.
fn columns(d: &HostTensor, range: std::ops::Range<usize>) -> HostTensor {
    let rows = d.data.len() / 6;
    let data = d.data.chunks_exact(6).flat_map(|r| r[range.clone()].to_vec()).collect();
    HostTensor::new(vec![rows, range.len()], data)
}

/// The decode: the same classes, in the same order, at the same positions; scores to 1e-5.
fn check_detections(model: &str, ours: &BTreeMap<String, HostTensor>, refs: &BTreeMap<String, HostTensor>) {
    let (got, want) = (&ours["detections"], &refs["output.detections"]);
    assert_eq!(got.shape, want.shape, "{model}: detections shape");
    assert_eq!(columns(got, 5..6).data, columns(want, 5..6).data, "{model}: decoded classes differ from PyTorch");
    let scores = compare(&format!("{model}.detections.score"), &columns(got, 4..5), &columns(want, 4..5));
    let boxes = compare(&format!("{model}.detections.box"), &columns(got, 0..4), &columns(want, 0..4));
    println!("{scores}\n{boxes}");
    assert!(scores.passes(TOL), "{scores}");
    // A detection at another position moves its box centre by about one cell; matching boxes to
    // 1e-3 means every detection sits at the same position as PyTorch's.
    assert!(boxes.passes(TOL) && boxes.max_abs < 1e-3, "{boxes}");
}

#[test]
fn centernet_matches_pytorch() {
    let (ours, refs) = run("centernet");
    for head in ["hm", "wh", "reg"] {
        let c = check("centernet", head, &ours, &refs);
        assert!(c.passes(TOL), "{c} exceeds rel L2 {TOL}");
    }
    check_detections("centernet", &ours, &refs);
}

/// References exported elsewhere (e.g. with `--weights torchvision --save-weights`, at any batch
/// and size) in `KILN_REFERENCE_DIR` or its subdirectories (`tools/gpu-test.sh` writes `seeded/`
/// and `torchvision/`): every `<model>.reference.safetensors` is checked, loading
/// `<model>.weights.safetensors` beside it (seeded weights when absent). The weight file must be a
/// full `state_dict` that Kiln loads unchanged, with no key left unused.
#[test]
fn exported_references_match() {
    let Some(root) = std::env::var_os("KILN_REFERENCE_DIR").map(PathBuf::from) else {
        println!("skipped: set KILN_REFERENCE_DIR to a directory written by tools/export_reference.py");
        return;
    };
    let subdirs = std::fs::read_dir(&root).expect("KILN_REFERENCE_DIR").filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_dir());
    let mut checked = 0;
    for dir in std::iter::once(root.clone()).chain(subdirs) {
        for info in kiln_models::BUNDLED {
            let reference = dir.join(format!("{}.reference.safetensors", info.name));
            if !reference.exists() {
                continue;
            }
            println!("{}", reference.display());
            let refs = read_safetensors(&reference).expect("reference file");
            let x = &refs["input"];
            let weights = dir.join(format!("{}.weights.safetensors", info.name));
            let vb = if weights.exists() { VarBuilder::from_safetensors(&[&weights]).expect("weights") } else { VarBuilder::seeded() };
            let graph = kiln_models::trace(info.name, vb.clone(), x.shape[0], x.shape[2]).expect("trace");
            vb.check_all_used().expect("every state_dict key is a model parameter");
            let ours = kiln::run_cpu(&graph, &[("input", x)]).expect("cpu run");
            for name in info.outputs.iter().filter(|n| **n != "detections") {
                let c = check(info.name, name, &ours, &refs);
                assert!(c.passes(TOL), "{c} exceeds rel L2 {TOL}");
            }
            if info.name.starts_with("yolo") {
                // The order of NMS's boxes with near-equal scores may differ: tests/yolo.rs and
                // tests/gpu_yolo.rs compare YOLO detections as sets.
            } else if info.outputs.contains(&"detections") {
                check_detections(info.name, &ours, &refs);
            } else {
                assert_eq!(top1(&ours["logits"]), top1(&refs["output.logits"]), "{}: top-1 differs", info.name);
            }
            checked += 1;
        }
    }
    assert!(checked > 0, "no <model>.reference.safetensors in {} or its subdirectories", root.display());
}

/// CenterNet-R50-DCN (deformable convs from the `kiln-deform-conv` plugin) at 128x128, traced and
/// optimised graphs alike.
#[test]
fn centernet_dcn_matches_pytorch() {
    let (ours, refs) = run("centernet_dcn");
    for head in ["hm", "wh", "reg"] {
        let c = check("centernet_dcn", head, &ours, &refs);
        assert!(c.passes(TOL), "{c} exceeds rel L2 {TOL}");
    }
    check_detections("centernet_dcn", &ours, &refs);
    let x = &refs["input"];
    let graph = kiln_models::trace("centernet_dcn", VarBuilder::seeded(), x.shape[0], x.shape[2]).expect("trace");
    let optimized = kiln::engine::optimize(&graph).expect("passes");
    let ours = kiln::run_cpu(&optimized, &[("input", x)]).expect("cpu run");
    for head in ["hm", "wh", "reg"] {
        let c = check("centernet_dcn (optimised)", head, &ours, &refs);
        assert!(c.passes(TOL), "{c} exceeds rel L2 {TOL}");
    }
}
