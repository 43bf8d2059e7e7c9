//! The bundled models on Kiln's CPU executor against PyTorch, with seeded weights.
//!
//! References: `tests/fixtures/<model>.reference.safetensors`, written by
//! `python3 tools/export_reference.py --all-fixtures --out tests/fixtures` (docs/REFERENCES.md):
//! the ResNet-18/50 at 224 and CenterNet at 512 (batch 1), RegNetY-400MF and ConvNeXt-Tiny at 96x96
//! and the other classifiers at 112x112, batch 2, to keep the CPU executor's time down. Each holds `input` and the outputs only.

use kiln::compare::{compare, top1, Comparison};
use kiln::var_builder::read_safetensors;
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
    assert_eq!(*x, kiln::seeded::weight("input.0", &x.shape), "the reference input is not seeded `input.0`");
    let (batch, size) = (x.shape[0], x.shape[2]);
    let vb = VarBuilder::seeded();
    let graph = kiln_models::trace(model, vb, batch, size).expect("trace");
    let ours = kiln::cpu::run(&graph, &[("input", x)]).expect("cpu run");
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
    let optimized = kiln::passes::optimize(&graph).expect("passes");
    let ours = kiln::cpu::run(&optimized, &[("input", x)]).expect("cpu run");
    let c = check(&format!("{model} (optimised)"), "logits", &ours, &refs);
    assert!(c.passes(TOL), "{c} exceeds rel L2 {TOL}");
    assert_eq!(top1(&ours["logits"]), top1(&refs["output.logits"]), "{model} (optimised): top-1 differs from PyTorch");
}

/// The models added with torchvision's classifier table and issue 7's mobile and modern families
/// (the ResNets 18 and 50 are checked by `tests/passes.rs`).
const NEW_CLASSIFIERS: &[&str] = &[
    "resnet34",
    "resnet101",
    "resnet152",
    "resnext50_32x4d",
    "wide_resnet50_2",
    "alexnet",
    "vgg16",
    "vgg16_bn",
    "squeezenet1_0",
    "squeezenet1_1",
    "densenet121",
    "googlenet",
    "mobilenet_v2",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "shufflenet_v2_x1_0",
    "regnet_y_400mf",
    "convnext_tiny",
];

#[test]
fn optimized_graphs_match_pytorch() {
    for model in NEW_CLASSIFIERS {
        check_optimized_classifier(model);
    }
}

/// torchvision's Swin-T at 224 (seeded weights): roll, window partition, relative position bias
/// and shifted-window mask, patch merging.
#[test]
fn swin_t_matches_pytorch() {
    check_classifier("swin_t");
    check_optimized_classifier("swin_t");
}

/// torchvision's ViT-B/16 at 224 (seeded weights): class token, position embedding, multi-head
/// attention with `in_proj_weight`.
#[test]
fn vit_b_16_matches_pytorch() {
    check_classifier("vit_b_16");
}

#[test]
fn resnet18_matches_pytorch() {
    check_classifier("resnet18");
}

#[test]
fn resnet50_matches_pytorch() {
    check_classifier("resnet50");
}

#[test]
fn resnet34_matches_pytorch() {
    check_classifier("resnet34");
}

#[test]
fn resnet101_matches_pytorch() {
    check_classifier("resnet101");
}

#[test]
fn resnet152_matches_pytorch() {
    check_classifier("resnet152");
}

#[test]
fn resnext50_32x4d_matches_pytorch() {
    check_classifier("resnext50_32x4d");
}

#[test]
fn wide_resnet50_2_matches_pytorch() {
    check_classifier("wide_resnet50_2");
}

#[test]
fn alexnet_matches_pytorch() {
    check_classifier("alexnet");
}

#[test]
fn vgg16_matches_pytorch() {
    check_classifier("vgg16");
}

#[test]
fn vgg16_bn_matches_pytorch() {
    check_classifier("vgg16_bn");
}

#[test]
fn squeezenet1_0_matches_pytorch() {
    check_classifier("squeezenet1_0");
}

#[test]
fn squeezenet1_1_matches_pytorch() {
    check_classifier("squeezenet1_1");
}

#[test]
fn densenet121_matches_pytorch() {
    check_classifier("densenet121");
}

#[test]
fn googlenet_matches_pytorch() {
    check_classifier("googlenet");
}

/// A classifier of issue 7's mobile and modern families: its parameters and `state_dict` keys are
/// torchvision's (count of learnable values, count of entries without `num_batches_tracked`, and
/// a few keys with their shapes), and its CPU run matches PyTorch.
fn check_torchvision_classifier(model: &str, params: usize, entries: usize, keys: &[(&str, &[usize])]) {
    let g = kiln_models::trace(model, VarBuilder::seeded(), 1, 64).expect("trace");
    let ours: usize = g.weights.iter().filter(|(k, _)| !k.contains("running")).map(|(_, w)| w.numel()).sum();
    println!("{model}: {ours} parameters in {} tensors", g.weights.len());
    assert_eq!(ours, params, "{model}: torchvision's parameter count");
    assert_eq!(g.weights.len(), entries, "{model}: torchvision's state_dict entries");
    for (key, shape) in keys {
        let w = g.weights.get(*key).unwrap_or_else(|| panic!("{model}: no `{key}`"));
        assert_eq!(w.shape, *shape, "{model}: {key}");
    }
    check_classifier(model);
}

#[test]
fn mobilenet_v2_matches_pytorch() {
    let keys: &[(&str, &[usize])] = &[
        ("features.0.0.weight", &[32, 3, 3, 3]),
        ("features.1.conv.0.0.weight", &[32, 1, 3, 3]),
        ("features.2.conv.1.0.weight", &[96, 1, 3, 3]),
        ("features.9.conv.3.running_mean", &[64]),
        ("features.18.1.running_var", &[1280]),
        ("classifier.1.weight", &[1000, 1280]),
    ];
    check_torchvision_classifier("mobilenet_v2", 3_504_872, 262, keys);
}

#[test]
fn mobilenet_v3_large_matches_pytorch() {
    let keys: &[(&str, &[usize])] = &[
        ("features.0.0.weight", &[16, 3, 3, 3]),
        ("features.4.block.2.fc1.weight", &[24, 72, 1, 1]),
        ("features.4.block.2.fc2.bias", &[72]),
        ("features.9.block.0.1.running_mean", &[184]),
        ("features.16.0.weight", &[960, 160, 1, 1]),
        ("classifier.0.weight", &[1280, 960]),
        ("classifier.3.weight", &[1000, 1280]),
    ];
    check_torchvision_classifier("mobilenet_v3_large", 5_483_032, 266, keys);
}

#[test]
fn efficientnet_b0_matches_pytorch() {
    let keys: &[(&str, &[usize])] = &[
        ("features.1.0.block.0.0.weight", &[32, 1, 3, 3]),
        ("features.1.0.block.1.fc1.weight", &[8, 32, 1, 1]),
        ("features.5.0.block.1.0.weight", &[480, 1, 5, 5]),
        ("features.6.3.block.2.fc2.weight", &[1152, 48, 1, 1]),
        ("features.8.1.running_var", &[1280]),
        ("classifier.1.weight", &[1000, 1280]),
    ];
    check_torchvision_classifier("efficientnet_b0", 5_288_548, 311, keys);
}

#[test]
fn shufflenet_v2_x1_0_matches_pytorch() {
    let keys: &[(&str, &[usize])] = &[
        ("conv1.0.weight", &[24, 3, 3, 3]),
        ("stage2.0.branch1.0.weight", &[24, 1, 3, 3]),
        ("stage2.0.branch2.0.weight", &[58, 24, 1, 1]),
        ("stage3.3.branch2.6.running_mean", &[116]),
        ("conv5.1.running_var", &[1024]),
        ("fc.weight", &[1000, 1024]),
    ];
    check_torchvision_classifier("shufflenet_v2_x1_0", 2_278_604, 282, keys);
}

#[test]
fn regnet_y_400mf_matches_pytorch() {
    let keys: &[(&str, &[usize])] = &[
        ("stem.0.weight", &[32, 3, 3, 3]),
        ("trunk_output.block1.block1-0.proj.0.weight", &[48, 32, 1, 1]),
        ("trunk_output.block1.block1-0.f.se.fc1.weight", &[8, 48, 1, 1]),
        ("trunk_output.block2.block2-1.f.b.0.weight", &[104, 8, 3, 3]),
        ("trunk_output.block3.block3-3.f.se.fc2.weight", &[208, 52, 1, 1]),
        ("trunk_output.block4.block4-5.f.c.1.running_var", &[440]),
        ("fc.weight", &[1000, 440]),
    ];
    check_torchvision_classifier("regnet_y_400mf", 4_344_144, 331, keys);
}

#[test]
fn convnext_tiny_matches_pytorch() {
    let keys: &[(&str, &[usize])] = &[
        ("features.0.0.weight", &[96, 3, 4, 4]),
        ("features.0.1.weight", &[96]),
        ("features.1.0.block.0.weight", &[96, 1, 7, 7]),
        ("features.1.0.block.2.bias", &[96]),
        ("features.2.0.weight", &[96]),
        ("features.2.1.weight", &[192, 96, 2, 2]),
        ("features.5.2.block.5.weight", &[384, 1536]),
        ("features.5.3.layer_scale", &[384, 1, 1]),
        ("classifier.0.bias", &[768]),
        ("classifier.2.weight", &[1000, 768]),
    ];
    check_torchvision_classifier("convnext_tiny", 28_589_128, 182, keys);
}

/// Every bundled model has a committed reference holding only `input` and its outputs, and the
/// export script knows it by the same name.
#[test]
fn every_bundled_model_has_a_reference() {
    let script = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/export_reference.py")).expect("script");
    for info in kiln_models::BUNDLED {
        assert!(script.contains(&format!("\"{}\"", info.name)), "tools/export_reference.py does not list `{}`", info.name);
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
            let ours = kiln::cpu::run(&graph, &[("input", x)]).expect("cpu run");
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
    let optimized = kiln::passes::optimize(&graph).expect("passes");
    let ours = kiln::cpu::run(&optimized, &[("input", x)]).expect("cpu run");
    for head in ["hm", "wh", "reg"] {
        let c = check("centernet_dcn (optimised)", head, &ours, &refs);
        assert!(c.passes(TOL), "{c} exceeds rel L2 {TOL}");
    }
}
