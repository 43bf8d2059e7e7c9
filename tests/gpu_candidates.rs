//! Issue 12's layer candidates on the GPU, each forced (`tactic_sources`) and compared with the CPU
//! executor: the sub-pixel transposed convolution (`ops::conv::subpixel`: a stride-1 convolution with
//! one block of output channels per phase, then `kernels/subpixel.cu`'s depth-to-space), whole
//! batch and in slices, the strided-batched cuBLASLt GEMM of strided 1×1 convolutions
//! (`ops::conv::strided_gemm`) and the fused ResNet stem (`ops::conv::stem`). Then every candidate's
//! tactic time at the shapes that motivated them (CenterNet's last deconv at batch 32, ResNet-18's
//! `layer2.0.downsample.0` at batch 256, the stem at batch 256 and 1), as `TIMING` lines.
//!
//! `#[ignore]`d (CI has no GPU); on the device: `bash tools/gpu-test.sh` (docs/ENGINE.md).

use kiln::compare;
use kiln::engine::{BuildConfig, EngineBuilder, Precision};
use kiln::{
    nn::{BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, ConvTranspose2d},
    Tensor, Tracer, VarBuilder,
};
use kiln::{Forward, Module};

mod common;
use common::{gpu, random};

/// Traces `f` on `dims` (per image), builds it with each tactic source forced for FP32 and FP16
/// (batch 1..=3), checks the forced kind is in the engine, and compares batch 1 and 3 with the
/// CPU executor.
fn check_forced(name: &str, dims: &[usize], sources: &[&str], f: impl Fn(&Tensor, VarBuilder) -> kiln::Result<Tensor>) {
    check_forced_in(name, dims, &[Precision::Fp32, Precision::Fp16], sources, f)
}

/// `check_forced` in the given precisions only (a candidate that exists in FP16 alone).
fn check_forced_in(
    name: &str,
    dims: &[usize],
    precisions: &[Precision],
    sources: &[&str],
    f: impl Fn(&Tensor, VarBuilder) -> kiln::Result<Tensor>,
) {
    let Some(gpu) = gpu() else { return };
    let tracer = Tracer::new();
    let x = tracer.input("x", &[&[1][..], dims].concat());
    let y = f(&x, VarBuilder::seeded()).unwrap_or_else(|e| panic!("{name}: trace: {e}"));
    tracer.output("y", &y);
    let graph = tracer.graph();
    for &precision in precisions {
        let tol = if precision == Precision::Fp32 { 1e-4 } else { 1e-2 };
        for &source in sources {
            let config = BuildConfig::default().precision(precision).batch(1, 3, 3).cuda_graphs(false).tactic_sources(&[source]);
            let engine = EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph).unwrap_or_else(|e| panic!("{name}: build: {e}"));
            let kinds: Vec<String> = engine.layers().map(|l| l.kind()).collect();
            assert!(kinds.iter().any(|k| k.starts_with(source)), "{name}: asked for {source}, engine has {kinds:?}");
            let engine = std::sync::Arc::new(engine);
            let mut ctx = engine.context().expect("context");
            for batch in [1, 3] {
                let input = random(&[&[batch][..], dims].concat(), batch as u64 * 17 + name.len() as u64, 1.0);
                let want = kiln::run_cpu(&graph, &[("x", &input)]).expect("cpu run");
                let got = ctx.run(&[("x", &input)]).unwrap_or_else(|e| panic!("{name} {precision:?} {source} batch {batch}: {e}"));
                let c = compare(name, &got["y"], &want["y"]);
                println!("{name:<44} {precision:?} {source:<22} batch {batch}: {c}  [{}]", kinds.join(", "));
                assert!(c.passes(tol), "{name} {precision:?} {source} batch {batch}: {c} over {tol:e}");
            }
        }
    }
}

/// The sub-pixel candidates: whole batch, and in slices of 2 (batch 3 = 2 + 1); cuDNN's beside them.
const SUBPIXEL: &[&str] = &["subpixel+", "subpixel:by2+", "cudnn-deconv"];

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn candidates_subpixel_deconv_matches_the_cpu() {
    let deconv = |c: Conv2dConfig| move |x: &Tensor, vb: VarBuilder| ConvTranspose2d::load(vb.pp("deconv"), &c)?.forward(x);
    check_forced(
        "deconv k4 s2 p1 (CenterNet)",
        &[32, 8, 8],
        SUBPIXEL,
        deconv(Conv2dConfig::new(32, 16, 4).stride(2).padding(1).bias(false)),
    );
    check_forced("deconv k4 s2 p1 64->64 at 32x32", &[64, 32, 32], SUBPIXEL, deconv(Conv2dConfig::new(64, 64, 4).stride(2).padding(1)));
    check_forced(
        "deconv k3 s2 p1 output_padding 1 bias",
        &[16, 7, 5],
        SUBPIXEL,
        deconv(Conv2dConfig::new(16, 24, 3).stride(2).padding(1).output_padding(1)),
    );
    check_forced("deconv k2 s2 (no overlap), 5 channels", &[8, 6, 9], SUBPIXEL, deconv(Conv2dConfig::new(8, 5, 2).stride(2)));
    let with_bn_relu = |x: &Tensor, vb: VarBuilder| {
        let y = ConvTranspose2d::load(vb.pp("deconv"), &Conv2dConfig::new(32, 16, 4).stride(2).padding(1).bias(false))?.forward(x)?;
        BatchNorm2d::load(vb.pp("bn"), &BatchNorm2dConfig::new(16))?.forward(&y)?.relu()
    };
    check_forced("deconv + bn + relu (folded, fused)", &[32, 8, 8], SUBPIXEL, with_bn_relu);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn candidates_strided_gemm_matches_the_cpu() {
    const SOURCES: &[&str] = &["cublaslt-strided-gemm", "cudnn-fused", "cudnn-conv"];
    let conv = |c: Conv2dConfig| move |x: &Tensor, vb: VarBuilder| Conv2d::load(vb.pp("conv"), &c)?.forward(x);
    check_forced("conv 1x1 s2 downsample (no bias)", &[32, 14, 14], SOURCES, conv(Conv2dConfig::new(32, 64, 1).stride(2).bias(false)));
    check_forced("conv 1x1 s2 bias, odd width", &[16, 8, 11], SOURCES, conv(Conv2dConfig::new(16, 24, 1).stride(2)));
    // ResNet's downsample: conv → BN, the block's conv2 + BN, their sum and ReLU; the passes fuse
    // the add + ReLU into one of the two convs, so the strided GEMM may carry the residual.
    let block = |x: &Tensor, vb: VarBuilder| {
        let d = Conv2d::load(vb.pp("down"), &Conv2dConfig::new(32, 64, 1).stride(2).bias(false))?.forward(x)?;
        let d = BatchNorm2d::load(vb.pp("down_bn"), &BatchNorm2dConfig::new(64))?.forward(&d)?;
        let m = Conv2d::load(vb.pp("conv"), &Conv2dConfig::new(32, 64, 3).stride(2).padding(1).bias(false))?.forward(x)?;
        m.add(&d)?.relu()
    };
    check_forced("downsample + residual + relu", &[32, 12, 12], &["cublaslt-strided-gemm"], block);
}

/// The ResNet stem (conv 7×7/2 → BN → ReLU → max-pool 3×3/2, fused into one conv node by the
/// passes): Kiln's one-kernel stem (`ops::conv::stem`, FP16), and cuDNN's conv followed by the pooling
/// kernel, on inputs whose pooled tiles are partial, with 1 to 4 channels and a ceil-mode pool.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn candidates_stem_pool_matches_the_cpu() {
    let stem = |cin: usize, ceil: bool| {
        move |x: &Tensor, vb: VarBuilder| {
            let y = Conv2d::load(vb.pp("conv1"), &Conv2dConfig::new(cin, 64, 7).stride(2).padding(3).bias(false))?.forward(x)?;
            let y = BatchNorm2d::load(vb.pp("bn1"), &BatchNorm2dConfig::new(64))?.forward(&y)?.relu()?;
            kiln::nn::MaxPool2d::load(vb.pp("maxpool"), &kiln::nn::Pool2dConfig::new(3).stride(2).padding(1).ceil_mode(ceil))?.forward(&y)
        }
    };
    let fp16 = &[Precision::Fp16][..];
    const STEM: &[&str] = &["kernel:stem_conv_pool_f16"];
    check_forced_in("stem 3ch 224x224 (ResNet)", &[3, 224, 224], fp16, &[STEM, &["cudnn"]].concat(), stem(3, false));
    check_forced_in("stem 3ch 61x45 (partial tiles)", &[3, 61, 45], fp16, &[STEM, &["cudnn"]].concat(), stem(3, false));
    check_forced_in("stem 3ch 61x45 (conv, then pool)", &[3, 61, 45], &[Precision::Fp32], &["cudnn"], stem(3, false));
    check_forced_in("stem 1ch 30x33", &[1, 30, 33], fp16, STEM, stem(1, false));
    check_forced_in("stem 4ch 40x29, ceil-mode pool", &[4, 40, 29], fp16, STEM, stem(4, true));
    check_forced_in("stem 2ch 9x7 (one tile, mostly padding)", &[2, 9, 7], fp16, STEM, stem(2, false));
}

/// Every candidate's tactic time (FP16, the engine's own timing: CUDA-graph replays at the opt
/// batch) for one layer, and the chosen one's profile.
fn time_candidates(label: &str, dims: &[usize], batch: usize, f: impl Fn(&Tensor, VarBuilder) -> kiln::Result<Tensor>) {
    let Some(gpu) = gpu() else { return };
    let tracer = Tracer::new();
    let x = tracer.input("x", &[&[1][..], dims].concat());
    let y = f(&x, VarBuilder::seeded()).unwrap_or_else(|e| panic!("{label}: trace: {e}"));
    tracer.output("y", &y);
    let graph = tracer.graph();
    let config = BuildConfig::default().precision(Precision::Fp16).batch(batch, batch, batch);
    let engine = std::sync::Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph).expect("build"));
    for (key, candidates) in &engine.summary.tactic_log {
        let mut c = candidates.clone();
        c.sort_by(|a, b| a.1.total_cmp(&b.1));
        println!("TIMING {label} batch {batch}: {key}");
        for (kind, ms) in c {
            println!("TIMING   {ms:>8.4} ms  {kind}");
        }
    }
    let mut ctx = engine.context().expect("context");
    let input = random(&[&[batch][..], dims].concat(), 99, 1.0);
    ctx.run(&[("x", &input)]).expect("run");
    let times = ctx.profile_layers(batch, 20).expect("profile");
    for (l, t) in engine.layers().zip(times) {
        println!("TIMING {label} batch {batch} layer {:>8.4} ms  {:<44} {}", t, l.kind(), l.path());
    }
    println!("TIMING {label} batch {batch} memory: {}", engine.summary.memory);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn candidates_timed_at_the_issue_shapes() {
    // CenterNet-R50's last deconv (+ folded BN + ReLU): 256 → 256, 64×64 → 128×128, batch 32.
    let deconv_bn_relu = |x: &Tensor, vb: VarBuilder| {
        let y = ConvTranspose2d::load(vb.pp("deconv"), &Conv2dConfig::new(256, 256, 4).stride(2).padding(1).bias(false))?.forward(x)?;
        BatchNorm2d::load(vb.pp("bn"), &BatchNorm2dConfig::new(256))?.forward(&y)?.relu()
    };
    time_candidates("centernet deconv3", &[256, 64, 64], 32, deconv_bn_relu);
    // ResNet-18's layer2.0.downsample.0 (+ folded BN): 64 → 128, stride 2, 56×56, batch 256.
    let down = |x: &Tensor, vb: VarBuilder| {
        let d = Conv2d::load(vb.pp("down"), &Conv2dConfig::new(64, 128, 1).stride(2).bias(false))?.forward(x)?;
        BatchNorm2d::load(vb.pp("bn"), &BatchNorm2dConfig::new(128))?.forward(&d)
    };
    time_candidates("resnet18 layer2.0.downsample.0", &[64, 56, 56], 256, down);
    // The ResNet stem (+ folded BN, ReLU, max-pool), at batch 256 and 1.
    let stem = |x: &Tensor, vb: VarBuilder| {
        let y = Conv2d::load(vb.pp("conv1"), &Conv2dConfig::new(3, 64, 7).stride(2).padding(3).bias(false))?.forward(x)?;
        let y = BatchNorm2d::load(vb.pp("bn1"), &BatchNorm2dConfig::new(64))?.forward(&y)?.relu()?;
        kiln::nn::MaxPool2d::load(vb.pp("maxpool"), &kiln::nn::Pool2dConfig::new(3).stride(2).padding(1))?.forward(&y)
    };
    time_candidates("resnet stem + maxpool", &[3, 224, 224], 256, stem);
    time_candidates("resnet stem + maxpool", &[3, 224, 224], 1, stem);
}
