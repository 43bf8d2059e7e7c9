//! INT8 and FP8 engines on the GPU: the quantisation kernels (`kernels/quant.cu`) against the CPU
//! reference, and the trained digits ResNet built from a calibration cache, compared with the CPU
//! fake-quant simulation (same scales, same rounding) and with FP32 accuracy. FP8 on a GPU below
//! sm_89 must be a clear error.
//!
//! On the device:
//! `cargo test --release --test gpu_quant -- --include-ignored --nocapture --test-threads 1`.

use kiln::calibrate::{simulate, CalibrationMethod, Calibrator};
use kiln::engine::{BuildConfig, EngineBuilder, Precision};
use kiln::graph::{Graph, HostTensor, QuantFormat, QuantParams};
use kiln::var_builder::read_safetensors;
use kiln::{Error, Forward, MaxPool2d, Module, Pool2dConfig, VarBuilder};
use std::path::PathBuf;
use std::sync::Arc;

mod common;
use common::{check, gpu, rel_l2};

/// The workspace root: where the binary was built, or (a binary carried to the device by
/// tools/gpu-build.sh) the current directory, the repository root there.
fn root() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if built.join("tests/fixtures/digits.safetensors").exists() {
        built
    } else {
        std::env::current_dir().expect("current directory")
    }
}

/// The quantisation ops alone, FP32 and FP16 engines against the CPU executor (`check`): per
/// tensor and per channel, int8 (with a zero point) and fp8, on NCHW values and on an NHWC
/// max-pool output (the channel found through the layout's strides).
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn quant_kernels_match_the_cpu() {
    let per_channel = |f: QuantParams| f.per_channel(1, vec![0.01, 0.02, 0.05, 0.1]);
    let cases: Vec<(&str, QuantParams)> = vec![
        ("int8", QuantParams::int8(0.02)),
        ("int8 zero point", QuantParams::int8(0.03).zero_points(vec![10]).range(0, 255)),
        ("int8 per channel", per_channel(QuantParams::int8(1.0))),
        ("fp8", QuantParams::fp8(0.005)),
        ("fp8 per channel", per_channel(QuantParams::fp8(1.0))),
    ];
    for (name, p) in &cases {
        check(&format!("fake_quantize {name}"), &[("x", &[4, 5, 6])], |x| Ok(vec![x[0].affine(3.0, 0.0)?.fake_quantize(p.clone())?]));
        check(&format!("quantize/dequantize {name}"), &[("x", &[4, 5, 6])], |x| {
            let q = x[0].affine(3.0, 0.0)?.quantize(p.clone())?;
            Ok(vec![q.dequantize(p.clone())?])
        });
        // Max pooling is exact on the GPU and writes NHWC: the per-channel strides are the layout's.
        check(&format!("fake_quantize {name} of an NHWC max pool"), &[("x", &[4, 6, 8])], |x| {
            let pool = MaxPool2d::load(VarBuilder::seeded().pp("pool"), &Pool2dConfig::new(2))?;
            Ok(vec![pool.forward(&x[0].affine(3.0, 0.0)?)?.fake_quantize(p.clone())?])
        });
    }
}

struct Digits {
    graph: Graph,
    heldout: HostTensor,
    labels: Vec<usize>,
    calib: HostTensor,
}

fn rgb(x: &HostTensor) -> HostTensor {
    let plane = x.shape[2] * x.shape[3];
    let data = x.data.chunks_exact(plane).flat_map(|p| p.iter().chain(p).chain(p).copied()).collect();
    HostTensor::new(vec![x.shape[0], 3, x.shape[2], x.shape[3]], data)
}

fn digits() -> Digits {
    let data = read_safetensors(root().join("tests/fixtures/digits.safetensors")).expect("digits fixture");
    let vb = VarBuilder::from_safetensors(&[root().join(kiln_models::DIGITS_WEIGHTS)]).expect("weights");
    let heldout = rgb(&data["heldout"]);
    let graph = kiln_models::trace("digits_resnet", vb, heldout.shape[0], 32).expect("trace");
    let labels = data["heldout_labels"].data.iter().map(|&l| l as usize).collect();
    Digits { graph, heldout, labels, calib: rgb(&data["calib"]) }
}

fn top1(logits: &HostTensor, labels: &[usize]) -> f64 {
    let c = logits.shape[1];
    let argmax = |row: &[f32]| row.iter().enumerate().fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0;
    let correct = logits.data.chunks_exact(c).zip(labels).filter(|(row, &l)| argmax(row) == l).count();
    100.0 * correct as f64 / labels.len() as f64
}

/// Held-out top-1 of FP32, FP16, INT8 (each calibration method) and FP8 engines, each INT8/FP8
/// engine also against the CPU simulation of itself (same cache): within 0.5 points of FP32, and
/// logits close to the simulation's.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn digits_engines_int8_fp8_accuracy() {
    let Some(gpu) = gpu() else { return };
    let d = digits();
    let n = d.labels.len();
    let cpu_fp32 = kiln::cpu::run(&d.graph, &[("input", &d.heldout)]).expect("cpu")["logits"].clone();
    let fp32_top1 = top1(&cpu_fp32, &d.labels);
    println!("held-out top-1 on {n} images: Kiln CPU FP32 {fp32_top1:.2}%");
    let dir = std::env::temp_dir().join(format!("kiln-gpu-quant-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let stats = Calibrator::new(&d.graph).expect("calibrator").collect(std::slice::from_ref(&d.calib)).expect("calibrate");

    let run = |precision: Precision, cache: Option<&PathBuf>| -> HostTensor {
        let mut config = BuildConfig::default().precision(precision).batch(1, n, n);
        if let Some(c) = cache {
            config = config.calibration_cache(c);
        }
        let engine =
            Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(&d.graph).unwrap_or_else(|e| panic!("{precision:?}: {e}")));
        if precision == Precision::Int8 {
            print!("{}{}", engine.describe(), engine.summary);
        }
        let mut ctx = engine.context().expect("context");
        ctx.run(&[("input", &d.heldout)]).expect("run")["logits"].clone()
    };
    let mut failures = vec![];
    for p in [Precision::Fp32, Precision::Fp16] {
        let acc = top1(&run(p, None), &d.labels);
        println!("  {p:?} engine: {acc:.2}% ({:+.2})", acc - fp32_top1);
    }
    let fp8_ok = gpu.info.sm >= 89;
    for (precision, format, method) in [
        (Precision::Int8, QuantFormat::Int8, CalibrationMethod::Entropy),
        (Precision::Int8, QuantFormat::Int8, CalibrationMethod::Percentile(99.99)),
        (Precision::Int8, QuantFormat::Int8, CalibrationMethod::MinMax),
        (Precision::Fp8, QuantFormat::Fp8E4m3, CalibrationMethod::MinMax),
    ] {
        let cache = stats.cache(method);
        let path = dir.join(format!("{}-{method:?}.json", format.name()));
        cache.save(&path).expect("save cache");
        if precision == Precision::Fp8 && !fp8_ok {
            let config = BuildConfig::default().precision(precision).calibration_cache(&path);
            match EngineBuilder::new(config).with_gpu(gpu.clone()).build(&d.graph) {
                Err(Error::Config { reason }) if reason.contains("8.9") => println!("  FP8 refused on sm_{}: {reason}", gpu.info.sm),
                Err(e) => failures.push(format!("FP8 below sm_89: wrong error {e}")),
                Ok(_) => failures.push("FP8 below sm_89 built an engine".into()),
            }
            continue;
        }
        let got = run(precision, Some(&path));
        let sim = kiln::cpu::run(&simulate(&d.graph, &cache, format).expect("simulate"), &[("input", &d.heldout)]).expect("cpu")["logits"]
            .clone();
        let (acc, sim_acc) = (top1(&got, &d.labels), top1(&sim, &d.labels));
        let (vs_sim, _) = rel_l2(&got.data, &sim.data);
        let (vs_fp32, _) = rel_l2(&got.data, &cpu_fp32.data);
        println!(
            "  {} {method:?}: engine {acc:.2}% ({:+.2}), CPU simulation {sim_acc:.2}%; logits rel L2 {vs_sim:.2e} vs simulation, {vs_fp32:.2e} vs FP32",
            format.name(),
            acc - fp32_top1
        );
        if (acc - fp32_top1).abs() > 0.5 {
            failures.push(format!("{} {method:?}: {acc:.2}% vs FP32 {fp32_top1:.2}%", format.name()));
        }
        // FP16 storage between layers moves a few values across rounding boundaries: close, not equal.
        if vs_sim > 3e-2 {
            failures.push(format!("{} {method:?}: rel L2 {vs_sim:.2e} against the CPU simulation", format.name()));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failures.is_empty(), "{failures:#?}");
}

/// An INT8 build without a cache, and Best (not implemented yet), are clear errors before any GPU work.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn quantised_builds_without_scales_are_refused() {
    let Some(gpu) = gpu() else { return };
    let d = digits();
    for p in [Precision::Int8, Precision::Fp8, Precision::Best] {
        let err = EngineBuilder::new(BuildConfig::default().precision(p)).with_gpu(gpu.clone()).build(&d.graph).err();
        println!("{p:?} without a cache: {err:?}");
        assert!(matches!(err, Some(Error::Config { .. })), "{p:?}: {err:?}");
    }
}

/// The FP8 GEMM (`cublaslt-gemm-fp8`) forced on a block of 1×1 convs (bias, ReLU, residual),
/// against the CPU simulation of the same FP8 engine and against FP32.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn fp8_gemm_matches_the_simulation() {
    let Some(gpu) = gpu() else { return };
    if gpu.info.sm < 89 {
        println!("skipped: sm_{} has no FP8", gpu.info.sm);
        return;
    }
    use kiln::{Conv2d, Conv2dConfig};
    let tracer = kiln::Tracer::new();
    let x = tracer.input("input", &[4, 32, 7, 7]);
    let vb = VarBuilder::seeded();
    let c1 = Conv2d::load(vb.pp("c1"), &Conv2dConfig::new(32, 64, 1)).expect("c1");
    let c2 = Conv2d::load(vb.pp("c2"), &Conv2dConfig::new(64, 32, 1)).expect("c2");
    let h = c1.forward(&x).and_then(|h| h.relu()).expect("c1");
    let y = c2.forward(&h).and_then(|y| y.add(&x)).and_then(|y| y.relu()).expect("c2");
    y.mark_output("y");
    let graph = tracer.graph();
    let input = common::random(&[4, 32, 7, 7], 11, 2.0);
    let cache =
        Calibrator::new(&graph).and_then(|c| c.calibrate(std::slice::from_ref(&input), CalibrationMethod::MinMax)).expect("calibrate");
    let path = std::env::temp_dir().join(format!("kiln-fp8-gemm-{}.json", std::process::id()));
    cache.save(&path).expect("save");
    let config =
        BuildConfig::default().precision(Precision::Fp8).batch(1, 4, 4).calibration_cache(&path).tactic_sources(&["cublaslt-gemm-fp8"]);
    let engine = Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph).expect("FP8 engine"));
    print!("{}{}", engine.describe(), engine.summary);
    let fp8_layers = engine.layers().filter(|l| l.kind() == "cublaslt-gemm-fp8").count();
    let got = engine.context().expect("context").run(&[("input", &input)]).expect("run").remove("y").expect("y");
    let sim = kiln::cpu::run(&simulate(&graph, &cache, QuantFormat::Fp8E4m3).expect("simulate"), &[("input", &input)]).expect("cpu");
    let fp32 = kiln::cpu::run(&graph, &[("input", &input)]).expect("cpu");
    let (vs_sim, max_sim) = rel_l2(&got.data, &sim["y"].data);
    let (vs_fp32, _) = rel_l2(&got.data, &fp32["y"].data);
    println!("FP8 GEMM layers: {fp8_layers}; rel L2 {vs_sim:.2e} (max-abs {max_sim:.2e}) vs the simulation, {vs_fp32:.2e} vs FP32");
    let _ = std::fs::remove_file(&path);
    assert_eq!(fp8_layers, 2, "both 1x1 convs run on FP8 tensor cores");
    assert!(vs_sim < 1e-2, "rel L2 {vs_sim:.2e} against the CPU simulation");
}
