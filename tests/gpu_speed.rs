//! The kernels issue 28 adds as tactic candidates, each forced in turn (tactic sources restricted
//! to it, so it runs whatever timing would pick) and checked against the CPU executor, FP32 and
//! FP16, batch 1 and 3:
//! - the register-tiled depthwise convolution (`dw_tile_k{K}_s{S}_h{TH}`, kernels/depthwise.cu):
//!   3x3, 5x5, 7x7, stride 1 and 2, ragged tiles (OW not a multiple of the tile's 8 or 4 columns,
//!   OH odd), bias, residual, ReLU, maps smaller than the kernel;
//! - the shared-memory depthwise convolution (`dw_smem_k{K}`, kernels/depthwise.cu): stride 1,
//!   channels a multiple of 32, tiles ragged in both directions, several channel blocks, maps
//!   smaller than the kernel;
//! - LayerNorm with the row in registers (`layer_norm_packed`, kernels/norm.cu): ConvNeXt's and
//!   ViT's widths, rows not a multiple of the rows a warp takes, channels-last after a conv.
//!
//! Then ConvNeXt-style and ViT-style blocks as timing picks, through the shared harness.
//!
//! On the device: `.carry/bin/gpu_speed --include-ignored --nocapture --test-threads 1`.

use kiln::engine::{BuildConfig, EngineBuilder, Precision};
use kiln::{
    nn::{Conv2d, Conv2dConfig, LayerNorm, LayerNorm2d, LayerNormConfig},
    Forward, Module, Tensor, Tracer, VarBuilder,
};
use kiln::{Graph, HostTensor};

mod common;
use common::{check, depthwise_block, gpu, random, rel_l2};

/// Builds `graph` with only the tactics whose kind starts with `source` (for the layers that offer
/// one), checks that one was chosen, and compares with the CPU executor at batch 1 and 3.
fn forced(name: &str, graph: &Graph, dims: &[usize], source: &str) {
    let Some(gpu) = gpu() else { return };
    for (precision, tol) in [(Precision::Fp32, 1e-5), (Precision::Fp16, 1e-2)] {
        let config = BuildConfig::default().precision(precision).batch(1, 3, 3).cuda_graphs(false).tactic_sources(&[source]);
        let engine = std::sync::Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(graph).expect("build"));
        let kinds: Vec<String> = engine.layers().map(|l| l.kind()).collect();
        // FP32 has no tiled depthwise entry where C is odd, and no packed LayerNorm for rows over
        // 512 floats: the forced kind must be there whenever the FP16 engine has it.
        let offered = kinds.iter().any(|k| k.starts_with(source));
        if precision == Precision::Fp16 {
            assert!(offered, "{name}: `{source}` was not offered: {kinds:?}");
        }
        if !offered {
            println!("{name:<64} {precision:?}: `{source}` not offered here");
            continue;
        }
        let mut ctx = engine.context().expect("context");
        for batch in [1usize, 3] {
            let shape: Vec<usize> = [&[batch][..], dims].concat();
            let input: HostTensor = random(&shape, 17 + batch as u64, 2.0);
            let want = kiln::run_cpu(graph, &[("x", &input)]).expect("cpu");
            let got = ctx.run(&[("x", &input)]).expect("run");
            let (rel, max_abs) = rel_l2(&got["y"].data, &want["y"].data);
            println!("{name:<64} {precision:?} batch {batch}: rel L2 {rel:.2e}, max abs {max_abs:.2e}");
            assert!(rel <= tol, "{name} {precision:?} batch {batch}: rel L2 {rel:.3e} > {tol:e}");
        }
    }
}

fn trace(dims: &[usize], f: impl Fn(&Tensor) -> kiln::Result<Tensor>) -> Graph {
    let tracer = Tracer::new();
    let x = tracer.input("x", &[&[1][..], dims].concat());
    tracer.output("y", &f(&x).expect("trace"));
    tracer.graph()
}

type Case = common::DepthwiseCase;

const DEPTHWISE: [Case; 9] = [
    // ConvNeXt's 7x7 at stage-1 width, a ragged strip (W = 13) and odd rows.
    (96, 15, 13, 7, 1, 3, true, false, false),
    (16, 14, 14, 3, 1, 1, true, false, false),
    (16, 15, 13, 3, 2, 1, true, true, false),
    (32, 12, 11, 5, 1, 2, true, true, false),
    (24, 13, 11, 5, 2, 2, false, false, false),
    (8, 9, 10, 3, 1, 1, true, true, true),
    (8, 11, 9, 7, 2, 3, true, false, false),
    // A map smaller than the kernel, with a residual.
    (8, 2, 3, 7, 1, 3, true, false, true),
    // MobileNetV3-like: 72 channels (f16: 18 packs of 4), 5x5 stride 2 on an odd map.
    (72, 17, 19, 5, 2, 2, true, false, false),
];

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/speed-check.sh)"]
fn depthwise_tiled_forced() {
    for case in DEPTHWISE {
        let (c, h, w, k, s, p, bias, relu, residual) = case;
        let graph = trace(&[c, h, w], |x| depthwise_block(x, case));
        for th in [1, 2] {
            let name = format!("dw_tile h{th} {k}x{k} s{s} p{p} [{c}, {h}, {w}] bias={bias} relu={relu} res={residual}");
            forced(&name, &graph, &[c, h, w], &format!("kernel:dw_tile_k{k}_s{s}_h{th}"));
        }
    }
}

/// The shared-memory kernel's cases: stride 1 and channels a multiple of its 32.
const DEPTHWISE_SMEM: [Case; 5] = [
    // ConvNeXt's 7x7, one tile ragged in both directions.
    (96, 15, 13, 7, 1, 3, true, false, false),
    // Three tiles down and across, both ragged, two channel blocks, a residual.
    (64, 19, 35, 7, 1, 3, true, false, true),
    (32, 12, 11, 5, 1, 2, true, true, false),
    (64, 9, 17, 3, 1, 1, true, true, true),
    // A map smaller than the kernel, no bias.
    (32, 2, 3, 7, 1, 3, false, false, true),
];

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/speed-check.sh)"]
fn depthwise_shared_forced() {
    for case in DEPTHWISE_SMEM {
        let (c, h, w, k, _, p, bias, relu, residual) = case;
        let graph = trace(&[c, h, w], |x| depthwise_block(x, case));
        let name = format!("dw_smem {k}x{k} p{p} [{c}, {h}, {w}] bias={bias} relu={relu} res={residual}");
        forced(&name, &graph, &[c, h, w], &format!("kernel:dw_smem_k{k}"));
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/speed-check.sh)"]
fn layer_norm_packed_forced() {
    let ln = |shape: &[usize], eps: f32, x: &Tensor| {
        LayerNorm::load(VarBuilder::seeded().pp("ln"), &LayerNormConfig::new(shape).eps(eps))?.forward(x)
    };
    for (dims, width) in [(vec![5usize, 96], 96), (vec![197, 768], 768), (vec![7, 384], 384), (vec![3, 8], 8), (vec![9, 40], 40)] {
        let graph = trace(&dims, |x| ln(&[width], 1e-6, x));
        forced(&format!("layer_norm_packed [{width}] of {dims:?}"), &graph, &dims, "kernel:layer_norm_packed");
    }
    // No affine.
    let graph = trace(&[11, 64], |x| {
        LayerNorm::load(VarBuilder::seeded().pp("ln"), &LayerNormConfig::new(&[64]).elementwise_affine(false))?.forward(x)
    });
    forced("layer_norm_packed no affine [64] of [11, 64]", &graph, &[11, 64], "kernel:layer_norm_packed");
    // LayerNorm2d (ConvNeXt's stem and downsample norms) on a conv's NHWC output: channels innermost.
    let graph = trace(&[3, 9, 7], |x| {
        let y = Conv2d::load(VarBuilder::seeded().pp("conv"), &Conv2dConfig::new(3, 96, 3).padding(1))?.forward(x)?;
        LayerNorm2d::load(VarBuilder::seeded().pp("ln2d"), &LayerNormConfig::new(&[96]).eps(1e-6))?.forward(&y)
    });
    forced("layer_norm_packed LayerNorm2d of an NHWC conv [96, 9, 7]", &graph, &[3, 9, 7], "kernel:layer_norm_packed");
}

/// A ConvNeXt block (depthwise 7x7, channels-last LayerNorm, Linear, GELU, Linear, layer scale,
/// residual) and a ViT MLP half-block as per-layer timing picks.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/speed-check.sh)"]
fn blocks_as_timed() {
    use kiln::nn::{Linear, LinearConfig, GELU};
    let vb = VarBuilder::seeded();
    check("convnext block [96, 14, 14]", &[("x", &[96, 14, 14])], |x| {
        let c = 96;
        let dw = Conv2d::load(vb.pp("dw"), &Conv2dConfig::new(c, c, 7).padding(3).groups(c))?.forward(&x[0])?;
        let t = dw.permute(&[0, 2, 3, 1])?;
        let t = LayerNorm::load(vb.pp("ln"), &LayerNormConfig::new(&[c]).eps(1e-6))?.forward(&t)?;
        let t = Linear::load(vb.pp("fc1"), &LinearConfig::new(c, 4 * c))?.forward(&t)?;
        let t = GELU::load(vb.pp("act"), &false)?.forward(&t)?;
        let t = Linear::load(vb.pp("fc2"), &LinearConfig::new(4 * c, c))?.forward(&t)?;
        let t = t.permute(&[0, 3, 1, 2])?;
        let scale = vb.get(&[c, 1, 1], "layer_scale")?;
        let t = t.binary_weight("layer_scale", kiln::plugin::Binary::Mul, &scale)?;
        Ok(vec![(&t + &x[0])?])
    });
    check("vit mlp half-block [197, 768]", &[("x", &[197, 768])], |x| {
        let t = LayerNorm::load(vb.pp("ln"), &LayerNormConfig::new(&[768]).eps(1e-6))?.forward(&x[0])?;
        let t = Linear::load(vb.pp("fc1"), &LinearConfig::new(768, 3072))?.forward(&t)?;
        let t = GELU::load(vb.pp("act"), &false)?.forward(&t)?;
        let t = Linear::load(vb.pp("fc2"), &LinearConfig::new(3072, 768))?.forward(&t)?;
        Ok(vec![(&x[0] + &t)?])
    });
}
