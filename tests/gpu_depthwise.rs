//! The depthwise convolution kernel (`kernels/depthwise.cu`, a tactic candidate of Conv2d with
//! groups == channels) against the CPU executor: forced (tactic sources restricted to it, so it
//! runs whatever cuDNN's timing says) and as timing picks, FP32 and FP16, batch 1 and 3, 3x3 and
//! 5x5 and 7x7, stride 1 and 2, with and without bias, with fused ReLU and residual, odd channel counts
//! (scalar path) and multiples of 8 (packed path).
//!
//! On the device: `cargo test --release --test gpu_depthwise -- --include-ignored --nocapture`.

use kiln::engine::{BuildConfig, EngineBuilder, Precision};
use kiln::HostTensor;
use kiln::Tracer;

mod common;
use common::{check, depthwise_block, gpu, random, rel_l2};

type Case = common::DepthwiseCase;

const CASES: [Case; 10] = [
    (16, 14, 14, 3, 1, 1, true, false, false),
    (16, 15, 13, 3, 2, 1, true, true, false),
    (5, 9, 11, 3, 1, 1, false, true, false),
    (7, 10, 9, 3, 2, 0, true, false, false),
    (32, 12, 12, 5, 1, 2, true, true, false),
    (24, 13, 11, 5, 2, 2, false, false, false),
    (16, 8, 10, 3, 1, 1, true, true, true),
    (3, 7, 7, 5, 1, 2, true, false, true),
    // ConvNeXt's 7x7 (padding 3), and over a map smaller than the kernel.
    (96, 14, 14, 7, 1, 3, true, false, false),
    (8, 2, 3, 7, 1, 3, true, false, true),
];

fn name(case: Case) -> String {
    let (c, h, w, k, s, p, bias, relu, residual) = case;
    format!("depthwise {k}x{k} s{s} p{p} [{c}, {h}, {w}] bias={bias} relu={relu} residual={residual}")
}

/// The kernel itself: the engine is built with only `kernel:depthwise*` candidates for convs.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn depthwise_kernel_forced() {
    let Some(gpu) = gpu() else { return };
    for case in CASES {
        let (c, h, w, ..) = case;
        let tracer = Tracer::new();
        let x = tracer.input("x", &[1, c, h, w]);
        tracer.output("y", &depthwise_block(&x, case).expect("trace"));
        let graph = tracer.graph();
        for (precision, tol) in [(Precision::Fp32, 1e-5), (Precision::Fp16, 1e-2)] {
            let config =
                BuildConfig::default().precision(precision).batch(1, 3, 3).cuda_graphs(false).tactic_sources(&["kernel:depthwise"]);
            let engine = std::sync::Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph).expect("build"));
            let kinds: Vec<String> = engine.layers().map(|l| l.kind()).collect();
            assert!(
                kinds.iter().any(|k| k.starts_with("kernel:depthwise")),
                "{}: the depthwise kernel was not offered: {kinds:?}",
                name(case)
            );
            let mut ctx = engine.context().expect("context");
            for batch in [1usize, 3] {
                let input: HostTensor = random(&[batch, c, h, w], 11 + batch as u64, 2.0);
                let want = kiln::run_cpu(&graph, &[("x", &input)]).expect("cpu");
                let got = ctx.run(&[("x", &input)]).expect("run");
                let (rel, max_abs) = rel_l2(&got["y"].data, &want["y"].data);
                println!("{:<70} {precision:?} batch {batch}: rel L2 {rel:.2e}, max abs {max_abs:.2e}", name(case));
                assert!(rel <= tol, "{} {precision:?} batch {batch}: rel L2 {rel:.3e} > {tol:e}", name(case));
            }
        }
    }
}

/// As per-layer timing picks (cuDNN or the kernel), through the shared harness.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn depthwise_as_timed() {
    for case in CASES {
        let (c, h, w, ..) = case;
        check(&name(case), &[("x", &[c, h, w])], |x| Ok(vec![depthwise_block(&x[0], case)?]));
    }
}
