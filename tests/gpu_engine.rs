//! The CUDA engine on the GPU: every converter of this file's families (conv, transposed conv,
//! linear, batch norm, fused conv+bias+residual+ReLU, the cuBLASLt 1×1 path, u8 inputs) against the CPU
//! executor; ResNet-18/50 and CenterNet against PyTorch; batch 1 and 64 from one engine; CUDA
//! graphs; save/load; the timing cache; several contexts on threads. Prints rel L2 / max-abs.
//!
//! PyTorch references: `tests/fixtures` (seeded weights) always; with `KILN_REFERENCE_DIR` set
//! (by `tools/gpu-test.sh` on the device), also `$KILN_REFERENCE_DIR/{seeded,torchvision}/`,
//! written there by `tools/export_reference.py` (with `<model>.weights.safetensors`).
//! Every test is `#[ignore]`d (CI has no GPU); the device runs them with `--include-ignored`.
//!
//! On the device: `bash tools/gpu-test.sh` (see docs/ENGINE.md).

use kiln::engine::{BuildConfig, Engine, EngineBuilder, Gpu, Precision};
use kiln::files::read_safetensors;
use kiln::{compare, top1, Comparison};
use kiln::{
    nn::{BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, ConvTranspose2d, Linear, LinearConfig},
    ByteTensor, DType, Graph, HostTensor, Tensor, Tracer, VarBuilder,
};
use kiln::{Forward, Module};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod common;
use common::{gpu, matching_detections, random};

/// One timing cache for every build of this process: equal problems are timed once.
fn cache_path() -> PathBuf {
    std::env::temp_dir().join(format!("kiln-gpu-engine-{}.timing.json", std::process::id()))
}

fn build(gpu: &Arc<Gpu>, graph: &Graph, config: BuildConfig) -> Arc<Engine> {
    let what = format!("{:?} batch {}..{}", config.precision, config.min_batch, config.max_batch);
    let engine = EngineBuilder::new(config.timing_cache(cache_path()))
        .with_gpu(gpu.clone())
        .build(graph)
        .unwrap_or_else(|e| panic!("build ({what}): {e}"));
    Arc::new(engine)
}

/// `n` copies of a batch-1 tensor along the batch.
fn tile(t: &HostTensor, n: usize) -> HostTensor {
    let mut shape = t.shape.clone();
    shape[0] *= n;
    HostTensor::new(shape, (0..n).flat_map(|_| t.data.iter().copied()).collect())
}

// ---- converters against the CPU executor ---------------------------------------------------

/// Traces `f` on one input of `dims` (per image), builds it for each precision (and each tactic
/// source, so every implementation of a layer runs), and compares with the CPU executor on
/// random inputs at batch 1 and 3.
fn check_op(name: &str, dims: &[usize], sources: &[Option<&str>], f: impl Fn(&Tensor, VarBuilder) -> kiln::Result<Tensor>) {
    let Some(gpu) = gpu() else { return };
    let tracer = Tracer::new();
    let x = tracer.input("x", &[&[1][..], dims].concat());
    let y = f(&x, VarBuilder::seeded()).unwrap_or_else(|e| panic!("{name}: trace: {e}"));
    tracer.output("y", &y);
    let graph = tracer.graph();
    for (precision, tol) in [(Precision::Fp32, 1e-5), (Precision::Tf32, 5e-3), (Precision::Fp16, 1e-2)] {
        for source in sources {
            let mut config = BuildConfig::default().precision(precision).batch(1, 3, 3).cuda_graphs(false);
            if let Some(s) = source {
                config = config.tactic_sources(&[s]);
            }
            let engine = build(&gpu, &graph, config);
            let kinds: Vec<String> = engine.layers().map(|l| l.kind()).collect();
            // Channel padding exists only for FP16 (tensor cores); elsewhere the layer keeps its own kinds.
            // So does im2col + GEMM (few input channels, FP16 only).
            let applies = |s: &str| !(s.starts_with("pad") || s.starts_with("im2col")) || precision == Precision::Fp16;
            if let Some(s) = source.filter(|s| applies(s)) {
                assert!(kinds.iter().any(|k| k.starts_with(s)), "{name}: asked for {s}, engine has {kinds:?}");
            }
            let mut ctx = engine.context().expect("context");
            for batch in [1, 3] {
                let input = random(&[&[batch][..], dims].concat(), batch as u64 * 31 + dims.len() as u64, 1.0);
                let want = kiln::run_cpu(&graph, &[("x", &input)]).expect("cpu run");
                let got = ctx.run(&[("x", &input)]).unwrap_or_else(|e| panic!("{name} {precision:?} batch {batch}: {e}"));
                let c = compare(name, &got["y"], &want["y"]);
                println!("{name:<40} {precision:?} {:<12} batch {batch}: {c}  [{}]", source.unwrap_or("any"), kinds.join(", "));
                assert!(c.passes(tol), "{name} {precision:?} {source:?} batch {batch}: {c} over {tol:e}");
            }
        }
    }
}

const ANY: &[Option<&str>] = &[None];
/// Every implementation of a forward convolution.
const CONV_SOURCES: &[Option<&str>] = &[Some("cudnn-fused"), Some("cudnn-conv")];
/// A convolution on fewer than 8 input channels also runs on a zero-padded input (FP16) and as
/// im2col + cuBLASLt GEMM (FP16).
const STEM_SOURCES: &[Option<&str>] = &[Some("cudnn-fused"), Some("cudnn-conv"), Some("pad8"), Some("im2col")];
/// A stride-1 1×1 convolution also runs as a cuBLASLt GEMM.
const POINTWISE_SOURCES: &[Option<&str>] = &[Some("cublaslt"), Some("cudnn-fused"), Some("cudnn-conv")];

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn conv2d_variants() {
    let conv = |c: Conv2dConfig| move |x: &Tensor, vb: VarBuilder| Conv2d::load(vb.pp("conv"), &c)?.forward(x);
    check_op("conv 3x3 s1 p1 bias", &[16, 12, 10], CONV_SOURCES, conv(Conv2dConfig::new(16, 32, 3).padding(1)));
    check_op(
        "conv 3x3 s2 p1 no-bias non-square",
        &[8, 13, 9],
        CONV_SOURCES,
        conv(Conv2dConfig::new(8, 16, 3).stride(2).padding(1).bias(false)),
    );
    check_op(
        "conv 3x3 dilation 2 groups 4",
        &[16, 11, 11],
        CONV_SOURCES,
        conv(Conv2dConfig::new(16, 32, 3).padding(2).dilation(2).groups(4)),
    );
    check_op(
        "conv 7x7 s2 p3 stem (3 channels)",
        &[3, 32, 32],
        STEM_SOURCES,
        conv(Conv2dConfig::new(3, 64, 7).stride(2).padding(3).bias(false)),
    );
    let stem_relu = |x: &Tensor, vb: VarBuilder| Conv2d::load(vb.pp("conv"), &Conv2dConfig::new(5, 24, 5).padding(2))?.forward(x)?.relu();
    check_op("conv 5x5 p2 + bias + relu (5 channels)", &[5, 15, 17], STEM_SOURCES, stem_relu);
    check_op("conv 1x1 s2 downsample", &[32, 14, 14], CONV_SOURCES, conv(Conv2dConfig::new(32, 64, 1).stride(2).bias(false)));
    check_op("conv 1x1 s1 (GEMM)", &[64, 7, 9], POINTWISE_SOURCES, conv(Conv2dConfig::new(64, 48, 1)));
}

/// An input declared u8 enters through each image reformat: 3 channels (one thread per pixel
/// into NHWC, then in FP16 also the padded stem or im2col) and 40 (the tiled transpose), run from
/// raw bytes against the CPU executor on the same bytes; the binding holds one byte per element.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn u8_inputs_enter_through_the_image_reformats() {
    let Some(gpu) = gpu() else { return };
    for (name, dims, conv) in [
        ("u8 conv 3x3 p1 (3 channels)", [3, 20, 24], Conv2dConfig::new(3, 16, 3).padding(1)),
        ("u8 conv 1x1 (40 channels)", [40, 9, 11], Conv2dConfig::new(40, 24, 1)),
    ] {
        let tracer = Tracer::new();
        let x = tracer.input_typed("x", &[1, dims[0], dims[1], dims[2]], DType::U8);
        tracer.output("y", &Conv2d::load(VarBuilder::seeded().pp("conv"), &conv).and_then(|c| c.forward(&x)).expect("trace"));
        let graph = tracer.graph();
        for (precision, tol) in [(Precision::Fp32, 1e-5), (Precision::Fp16, 1e-2)] {
            let engine = build(&gpu, &graph, BuildConfig::default().precision(precision).batch(1, 3, 3));
            let entry = engine.layers().next().expect("the entry reformat").kind();
            let mut ctx = engine.context().expect("context");
            assert_eq!(ctx.binding_bytes("x").expect("binding"), 3 * dims.iter().product::<usize>(), "1 byte per element");
            for batch in [1, 3] {
                let values = random(&[batch, dims[0], dims[1], dims[2]], batch as u64 * 7 + dims[0] as u64, 1.0);
                let bytes =
                    ByteTensor::new(values.shape.clone(), values.data.iter().map(|v| ((v + 1.0) * 127.9) as u8).collect()).expect("bytes");
                let want = kiln::run_cpu(&graph, &[("x", &bytes)]).expect("cpu run");
                let got = ctx.run(&[("x", &bytes)]).unwrap_or_else(|e| panic!("{name} {precision:?} batch {batch}: {e}"));
                let c = compare(name, &got["y"], &want["y"]);
                println!("{name:<32} {precision:?} batch {batch}: {c}  [{entry}]");
                assert!(entry.contains("_u8_"), "{name}: the entry reformat {entry} does not read bytes");
                assert!(c.passes(tol), "{name} {precision:?} batch {batch}: {c} over {tol:e}");
            }
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn fused_conv_bias_residual_relu() {
    // conv → BN → (+ x) → ReLU: the passes fold the BN and fuse add + ReLU into the conv.
    let block = |k: usize| {
        move |x: &Tensor, vb: VarBuilder| {
            let c = x.shape()[1];
            let y = Conv2d::load(vb.pp("conv"), &Conv2dConfig::new(c, c, k).padding(k / 2).bias(false))?.forward(x)?;
            let y = BatchNorm2d::load(vb.pp("bn"), &BatchNorm2dConfig::new(c))?.forward(&y)?;
            y.add(x)?.relu()
        }
    };
    check_op("conv 3x3 + bn + residual + relu", &[32, 10, 12], CONV_SOURCES, block(3));
    check_op("conv 1x1 + bn + residual + relu", &[32, 10, 12], POINTWISE_SOURCES, block(1));
    let relu_only = |x: &Tensor, vb: VarBuilder| Conv2d::load(vb.pp("conv"), &Conv2dConfig::new(24, 40, 3).padding(1))?.forward(x)?.relu();
    check_op("conv 3x3 + bias + relu", &[24, 9, 9], CONV_SOURCES, relu_only);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn conv_transpose2d_variants() {
    let deconv = |c: Conv2dConfig| move |x: &Tensor, vb: VarBuilder| ConvTranspose2d::load(vb.pp("deconv"), &c)?.forward(x);
    check_op("deconv k4 s2 p1 (CenterNet)", &[32, 8, 8], ANY, deconv(Conv2dConfig::new(32, 16, 4).stride(2).padding(1).bias(false)));
    check_op(
        "deconv k3 s2 p1 output_padding 1 bias",
        &[16, 7, 5],
        ANY,
        deconv(Conv2dConfig::new(16, 24, 3).stride(2).padding(1).output_padding(1)),
    );
    check_op("deconv k3 s1 groups 2 bias", &[16, 6, 6], ANY, deconv(Conv2dConfig::new(16, 8, 3).padding(1).groups(2)));
    let with_bn_relu = |x: &Tensor, vb: VarBuilder| {
        let y = ConvTranspose2d::load(vb.pp("deconv"), &Conv2dConfig::new(32, 16, 4).stride(2).padding(1).bias(false))?.forward(x)?;
        BatchNorm2d::load(vb.pp("bn"), &BatchNorm2dConfig::new(16))?.forward(&y)?.relu()
    };
    check_op("deconv + bn + relu (folded, fused)", &[32, 8, 8], ANY, with_bn_relu);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn linear_and_batchnorm() {
    let linear = |x: &Tensor, vb: VarBuilder| Linear::load(vb.pp("fc"), &LinearConfig::new(96, 40))?.forward(&x.flatten(1)?);
    check_op("linear 96 -> 40 with bias (after flatten)", &[96, 1, 1], ANY, linear);
    let bn = |x: &Tensor, vb: VarBuilder| BatchNorm2d::load(vb.pp("bn"), &BatchNorm2dConfig::new(24))?.forward(&x.relu()?);
    check_op("batchnorm (unfoldable, after relu)", &[24, 7, 6], ANY, bn);
}

// ---- bundled models against PyTorch ----------------------------------------------------------

struct Reference {
    label: String,
    refs: BTreeMap<String, HostTensor>,
    vb: VarBuilder,
}

/// The references for `model`: the committed seeded fixture, plus those exported on the device.
fn references(model: &str) -> Vec<Reference> {
    let mut out = Vec::new();
    // Test binaries carried to the device run from another checkout path: KILN_FIXTURES says where.
    let fixtures = std::env::var_os("KILN_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"));
    let fixture = fixtures.join(format!("{model}.reference.safetensors"));
    if let Ok(refs) = read_safetensors(&fixture) {
        out.push(Reference { label: "fixture/seeded".into(), refs, vb: VarBuilder::seeded() });
    }
    match std::env::var_os("KILN_REFERENCE_DIR") {
        None => println!("{model}: KILN_REFERENCE_DIR is unset: only the committed seeded fixture is checked"),
        Some(dir) => {
            for kind in ["seeded", "torchvision"] {
                let d = Path::new(&dir).join(kind);
                let Ok(refs) = read_safetensors(d.join(format!("{model}.reference.safetensors"))) else {
                    println!("{model}: no {kind} reference in {}", d.display());
                    continue;
                };
                let weights = d.join(format!("{model}.weights.safetensors"));
                let vb =
                    if weights.exists() { VarBuilder::from_safetensors(&[&weights]).expect("weights file") } else { VarBuilder::seeded() };
                out.push(Reference { label: format!("device/{kind}"), refs, vb });
            }
        }
    }
    out
}

/// The models checked by `check_model` with their own tests; the rest of the zoo is checked
/// together by `zoo_models_match_pytorch`. The YOLOs are checked by `tests/gpu_yolo.rs`.
const FLAGSHIPS: [&str; 5] = ["resnet18", "resnet50", "centernet", "yolov8n", "yolo11n"];

/// Engines are built for batch 1..=max; CenterNet's maps are 16× ResNet's, so its range is smaller,
/// and the zoo is checked at batch 1 and 8 from one engine built for 1–8.
fn max_batch(model: &str, precision: Precision) -> usize {
    match (model, precision) {
        ("centernet", Precision::Fp16) => 32,
        ("centernet", _) => 8,
        (m, _) if !FLAGSHIPS.contains(&m) => 8,
        _ => 64,
    }
}

fn check_output(label: &str, name: &str, got: &HostTensor, want: &HostTensor, tol: f64) -> Comparison {
    let c = compare(&format!("{label} {name}"), got, want);
    println!("  {c}");
    assert!(c.passes(tol), "{label} {name}: {c} over rel L2 {tol:e}");
    c
}

/// Per-layer precisions an FP16 engine of `model` is built with (trtexec's `--layerPrecisions`).
///
/// RegNetY-400MF with torchvision's random init and measured BatchNorm statistics amplifies any
/// perturbation about 12x from input to logits (FP32, input noise of rel 1e-3 gives logits 0.8-1.5e-2),
/// so FP16's rounding anywhere early ends over the bound: emulated on the CPU (f16 weights after
/// BatchNorm folding, f16 activations, f32 accumulation; `tools/fp16_emulate.py`) all-FP16 is
/// 1.60e-2 (the H100: 1.7-1.9e-2; PyTorch's own FP16 on it 1.48e-2), and no single stage or layer
/// kind kept in FP32 brings it under 1e-2. The stem and the first two stages (about a third of
/// the FLOPs at 224) in FP32 give 3.7e-3.
fn fp16_layer_precisions(model: &str) -> &'static [(&'static str, Precision)] {
    match model {
        "regnet_y_400mf" => {
            &[("stem", Precision::Fp32), ("trunk_output.block1", Precision::Fp32), ("trunk_output.block2", Precision::Fp32)]
        }
        _ => &[],
    }
}

fn check_model(model: &str) {
    check_model_with(model, |_| true, true);
}

/// Checks `model` against the references `keep` selects; `timings` adds latency and a profile.
fn check_model_with(model: &str, keep: impl Fn(&str) -> bool, timings: bool) {
    let Some(gpu) = gpu() else { return };
    for reference in references(model).into_iter().filter(|r| keep(&r.label)) {
        let x = &reference.refs["input"];
        let (batch, size) = (x.shape[0], x.shape[2]);
        let graph = kiln_models::trace(model, reference.vb.clone(), batch, size).expect("trace");
        for (precision, tol) in [(Precision::Fp32, 1e-4), (Precision::Fp16, 1e-2)] {
            let max = max_batch(model, precision);
            let mut label = format!("{model} {} {precision:?}", reference.label);
            let mut config = BuildConfig::default().precision(precision).batch(1, max, max);
            if precision == Precision::Fp16 {
                for &(pattern, p) in fp16_layer_precisions(model) {
                    config = config.layer_precision(pattern, p);
                    label.push_str(&format!(" {pattern}:{}", p.short_name()));
                }
            }
            let engine = build(&gpu, &graph, config);
            println!("{label}: {}", engine.summary);
            let mut ctx = engine.context().expect("context");
            for b in [1, max] {
                let input = tile(x, b);
                let got = ctx.run(&[("input", &input)]).unwrap_or_else(|e| panic!("{label} batch {b}: {e}"));
                println!("{label} batch {b}:");
                for (name, want) in reference.refs.iter().filter_map(|(k, v)| k.strip_prefix("output.").map(|n| (n, v))) {
                    let want = tile(want, b);
                    if name == "detections" {
                        let min = (0..b).map(|i| matching_detections(&got[name], &want, i)).min().unwrap_or(0);
                        println!("  {label} detections: {min} of {} identical in class and position (worst image of {b})", want.shape[1]);
                        assert!(min >= 98, "{label} batch {b}: only {min} detections match PyTorch");
                        continue;
                    }
                    check_output(&label, name, &got[name], &want, tol);
                    if name == "logits" {
                        let (g, w) = (top1(&got[name]), top1(&want));
                        println!("  top-1 {:?} (PyTorch {:?})", &g[..g.len().min(4)], &w[..w.len().min(4)]);
                        assert_eq!(g, w, "{label} batch {b}: top-1 differs from PyTorch");
                    }
                }
            }
            if precision == Precision::Fp16 && timings {
                time_engine(&label, &mut ctx, x, max);
                profile(&label, &mut ctx, x, max);
            }
        }
    }
}

/// Median latency with and without CUDA graphs at batch 1 and the max batch.
fn time_engine(label: &str, ctx: &mut kiln::engine::ExecutionContext, x: &HostTensor, max: usize) {
    for b in [1, max] {
        let input = tile(x, b);
        ctx.run(&[("input", &input)]).expect("bind");
        for graphs in [true, false] {
            ctx.set_cuda_graphs(graphs);
            let iters = if b == 1 { 200 } else { 30 };
            let ms = ctx.time(b, 10, iters).expect("timing");
            println!("TIMING {label} batch {b} cuda_graphs={graphs}: {ms:.3} ms median, {:.0} images/s", b as f64 / ms * 1e3);
        }
        ctx.set_cuda_graphs(true);
    }
}

/// The slowest layers at `batch`, launched one by one (where the time goes).
fn profile(label: &str, ctx: &mut kiln::engine::ExecutionContext, x: &HostTensor, batch: usize) {
    ctx.run(&[("input", &tile(x, batch))]).expect("bind");
    let times = ctx.profile_layers(batch, 10).expect("profile");
    let engine = ctx.engine().clone();
    let layers: Vec<_> = engine.layers().collect();
    let total: f64 = times.iter().sum();
    let mut order: Vec<usize> = (0..times.len()).collect();
    order.sort_by(|&a, &b| times[b].total_cmp(&times[a]));
    println!("PROFILE {label} batch {batch}: sum of layers {total:.3} ms");
    for &i in order.iter().take(12) {
        println!("PROFILE   {:>8.3} ms {:>5.1}%  {:<36} {}", times[i], 100.0 * times[i] / total, layers[i].kind(), layers[i].path());
    }
    let mut by_kind: BTreeMap<String, f64> = BTreeMap::new();
    for (l, t) in layers.iter().zip(&times) {
        *by_kind.entry(l.kind().split(':').next().unwrap_or("").to_string()).or_default() += t;
    }
    println!("PROFILE   by kind: {by_kind:.3?}");
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn resnet18_matches_pytorch() {
    check_model("resnet18");
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn resnet50_matches_pytorch() {
    check_model("resnet50");
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn centernet_matches_pytorch() {
    check_model("centernet");
}

/// Every other bundled model (torchvision's classifiers) against torchvision's own model with its
/// random init and randomised BatchNorm statistics, exported on the device: FP32 and FP16 at batch
/// 1 and 8 from one engine. `KILN_ZOO` (comma-separated) picks models.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn zoo_models_match_pytorch() {
    let pick = std::env::var("KILN_ZOO").ok();
    let zoo: Vec<&str> = kiln_models::BUNDLED
        .iter()
        .map(|m| m.name)
        .filter(|m| !FLAGSHIPS.contains(m))
        .filter(|m| match pick.as_deref() {
            None => true,
            Some(p) => p.split(',').any(|x| x == *m),
        })
        .collect();
    // Every model is checked; the failures are listed together at the end.
    let failed: Vec<&str> = zoo
        .into_iter()
        .filter(|model| std::panic::catch_unwind(|| check_model_with(model, |label| label == "device/torchvision", false)).is_err())
        .collect();
    assert!(failed.is_empty(), "zoo models that do not match PyTorch: {failed:?}");
}

/// A mixed engine (TensorRT's `--layerPrecisions` with obeyed constraints): ResNet-18 in FP16 with
/// `layer3`, `layer4` and `fc` in FP32 matches PyTorch like the FP16 engine, converts f16 to f32
/// once where the precisions meet, lists both precisions in `describe()`, and keeps its rules
/// through save and load.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn mixed_precision_resnet18_matches_pytorch() {
    let Some(gpu) = gpu() else { return };
    for reference in references("resnet18") {
        let x = &reference.refs["input"];
        let want = &reference.refs["output.logits"];
        let graph = kiln_models::trace("resnet18", reference.vb.clone(), x.shape[0], x.shape[2]).expect("trace");
        let fp16 = BuildConfig::default().precision(Precision::Fp16).batch(1, 8, 8);
        let mixed =
            fp16.clone().layer_precisions(kiln::engine::LayerPrecision::parse_list("layer3:fp32,layer4:fp32,fc:fp32").expect("spec"));
        let mut errors = Vec::new();
        for (what, config) in [("fp16", fp16), ("mixed", mixed)] {
            let engine = build(&gpu, &graph, config);
            let describe = engine.describe();
            let mut ctx = engine.context().expect("context");
            for b in [1, 8] {
                let got = ctx.run(&[("input", &tile(x, b))]).expect("run");
                let c =
                    check_output(&format!("resnet18 {} {what} batch {b}", reference.label), "logits", &got["logits"], &tile(want, b), 1e-2);
                assert_eq!(top1(&got["logits"]), top1(&tile(want, b)), "{what} batch {b}: top-1 differs from PyTorch");
                errors.push((what, c.rel_l2));
            }
            if what == "mixed" {
                println!("{describe}");
                let line = |path: &str| {
                    describe
                        .lines()
                        .find(|l| l.split_whitespace().any(|w| w == path) && !l.contains("kernel:cast"))
                        .unwrap_or("")
                        .to_string()
                };
                assert!(line("layer2.1.conv2").contains("fp16"), "layer2 must stay FP16: {}", line("layer2.1.conv2"));
                assert!(line("layer3.0.conv1").contains("fp32"), "layer3 must be FP32: {}", line("layer3.0.conv1"));
                assert!(line("fc").contains("fp32"), "fc must be FP32: {}", line("fc"));
                assert!(engine.layers().any(|l| l.kind().contains("f16_f32")), "no f16 -> f32 conversion where layer3 begins");
                let path = std::env::temp_dir().join(format!("kiln-mixed-{}.engine", std::process::id()));
                engine.save(&path).expect("save");
                let loaded = Engine::load(&path, &gpu).expect("load");
                assert_eq!(loaded.config.layer_precisions, engine.config.layer_precisions);
                assert_eq!(loaded.describe(), describe, "a loaded engine lowers in the same precisions");
                let _ = std::fs::remove_file(&path);
            }
        }
        println!("resnet18 {} rel L2 (fp16 / mixed, batch 1 and 8): {errors:?}", reference.label);
    }
}

// ---- engine files, timing cache, contexts on threads ---------------------------------------

fn resnet18_graph() -> Graph {
    kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 224).expect("trace")
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn saved_engine_loads_and_gives_bit_identical_outputs() {
    let Some(gpu) = gpu() else { return };
    let engine = build(&gpu, &resnet18_graph(), BuildConfig::default().precision(Precision::Fp16).batch(1, 4, 4));
    let path = std::env::temp_dir().join(format!("kiln-test-{}.engine", std::process::id()));
    engine.save(&path).expect("save");
    let loaded = Arc::new(Engine::load(&path, &gpu).expect("load"));
    println!(
        "loaded in {:.3} s (built in {:.3} s), {} tactics replayed",
        loaded.summary.build_seconds,
        engine.summary.build_seconds,
        loaded.tactics().len()
    );
    assert_eq!(loaded.summary.tactics_timed, 0, "loading must not time tactics");
    assert_eq!(engine.tactics(), loaded.tactics());
    let kinds = |e: &Engine| e.layers().map(|l| l.kind()).collect::<Vec<_>>();
    assert_eq!(kinds(&engine), kinds(&loaded));
    for b in [1, 4] {
        let x = random(&[b, 3, 224, 224], 7 + b as u64, 1.0);
        let a = engine.context().expect("ctx").run(&[("input", &x)]).expect("run built");
        let l = loaded.context().expect("ctx").run(&[("input", &x)]).expect("run loaded");
        assert_eq!(a["logits"].data, l["logits"].data, "batch {b}: loaded engine differs from the built one");
    }

    let bytes = std::fs::read(&path).expect("read back");
    let mut corrupt = bytes.clone();
    let at = bytes.len() / 2;
    corrupt[at] ^= 0x01;
    std::fs::write(&path, &corrupt).expect("write");
    let err = Engine::load(&path, &gpu).err().expect("a corrupted byte must be rejected").to_string();
    println!("corrupted byte {at}: {err}");
    assert!(err.contains("checksum"), "{err}");
    std::fs::write(&path, &bytes[..bytes.len() - 100]).expect("write");
    let err = Engine::load(&path, &gpu).err().expect("a truncated file must be rejected").to_string();
    println!("truncated: {err}");
    assert!(err.contains("truncated"), "{err}");
    let _ = std::fs::remove_file(&path);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn a_timing_cache_makes_a_rebuild_time_nothing() {
    let Some(gpu) = gpu() else { return };
    let cache = std::env::temp_dir().join(format!("kiln-test-cache-{}.json", std::process::id()));
    let _ = std::fs::remove_file(&cache);
    let graph = resnet18_graph();
    let config = BuildConfig::default().precision(Precision::Fp16).batch(1, 2, 2).timing_cache(&cache);
    let first = EngineBuilder::new(config.clone()).with_gpu(gpu.clone()).build(&graph).expect("first build");
    let second = EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph).expect("second build");
    println!("first build: {}second build: {}", first.summary, second.summary);
    assert!(first.summary.tactics_timed > 0);
    assert_eq!(second.summary.tactics_timed, 0, "the rebuild timed tactics despite the cache");
    assert_eq!(first.tactics(), second.tactics());
    let _ = std::fs::remove_file(&cache);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn contexts_run_concurrently_on_threads() {
    let Some(gpu) = gpu() else { return };
    let engine = build(&gpu, &resnet18_graph(), BuildConfig::default().precision(Precision::Fp16).batch(1, 2, 2));
    let inputs: Vec<HostTensor> = (0..4).map(|i| random(&[2, 3, 224, 224], 100 + i, 1.0)).collect();
    let mut ctx = engine.context().expect("ctx");
    let expected: Vec<Vec<f32>> = inputs.iter().map(|x| ctx.run(&[("input", x)]).expect("run")["logits"].data.clone()).collect();
    let inputs = Arc::new(inputs);
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (engine, inputs) = (engine.clone(), inputs.clone());
            std::thread::spawn(move || {
                let mut ctx = engine.context().expect("context on a thread");
                (0..12)
                    .map(|i| (i % 4, ctx.run(&[("input", &inputs[(i + t) % 4])]).expect("run on a thread")["logits"].data.clone()))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for (t, h) in threads.into_iter().enumerate() {
        for (i, got) in h.join().expect("thread") {
            let want = &expected[(i + t) % 4];
            assert_eq!(&got, want, "thread {t} run {i}: differs from the single-threaded result");
        }
    }
    println!("4 threads × 12 runs on their own contexts: identical to the single-threaded results");
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn device_buffers_run_asynchronously_on_the_context_stream() {
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    let Some(gpu) = gpu() else { return };
    let engine = build(&gpu, &resnet18_graph(), BuildConfig::default().precision(Precision::Fp16).batch(1, 2, 2));
    let x = random(&[2, 3, 224, 224], 5, 1.0);
    let mut ctx = engine.context().expect("ctx");
    let want = ctx.run(&[("input", &x)]).expect("host run")["logits"].clone();
    let stream = ctx.stream().clone();
    let input = stream.clone_htod(&x.data).expect("upload");
    let mut output = stream.alloc_zeros::<f32>(want.data.len()).expect("alloc");
    {
        let (pin, _i) = input.device_ptr(&stream);
        let (pout, _o) = output.device_ptr_mut(&stream);
        // SAFETY: both buffers live on this engine's GPU, hold 2 images, and outlive the sync below.
        unsafe { ctx.enqueue_device(2, &[("input", pin)], &[("logits", pout)]) }.expect("enqueue");
    }
    ctx.synchronize().expect("sync");
    let got = stream.clone_dtoh(&output).expect("download");
    assert_eq!(got, want.data, "device-to-device run differs from the host run");
    println!("enqueue_device: {} logits equal to the host run", got.len());
}

/// Throughput of the ResNets at batch 256 (the large-batch anchors), FP16, CUDA graphs.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn resnet_fp16_throughput_at_batch_256() {
    let Some(gpu) = gpu() else { return };
    for model in ["resnet18", "resnet50"] {
        let graph = kiln_models::trace(model, VarBuilder::seeded(), 1, 224).expect("trace");
        let engine = build(&gpu, &graph, BuildConfig::default().precision(Precision::Fp16).batch(1, 256, 256));
        let mut ctx = engine.context().expect("ctx");
        let x = random(&[256, 3, 224, 224], 3, 1.0);
        let logits = &ctx.run(&[("input", &x)]).expect("run")["logits"];
        assert!(logits.data.iter().all(|v| v.is_finite()), "{model}: non-finite logits at batch 256");
        let ms = ctx.time(256, 5, 20).expect("timing");
        println!("TIMING {model} Fp16 batch 256 cuda_graphs=true: {ms:.3} ms median, {:.0} images/s", 256.0 / ms * 1e3);
    }
}
