//! Softmax, LayerNorm, mean, matmul and Linear on rank-3+ inputs through their converters inside
//! real engines, against the CPU executor (FP32 and FP16, batch 1 and 3): contiguous rows (one warp
//! per row), strided rows (one thread per column), NHWC inputs straight from a convolution, the
//! cuBLASLt path of `x @ W` and Linear, and our tiled kernel for batched, broadcasting matmul.
//!
//! On the device: `cargo test --release --test gpu_norm -- --include-ignored --nocapture --test-threads 1`.

use kiln::{
    nn::{Conv2d, Conv2dConfig, LayerNorm, LayerNorm2d, LayerNormConfig, Linear, LinearConfig},
    Forward, Module, Tensor, VarBuilder,
};

mod common;
use common::{check, check_forced};

fn vb(path: &str) -> VarBuilder {
    VarBuilder::seeded().pp(path)
}

/// A 3×3 convolution (padding 1): its output is NHWC in the engine.
fn conv(x: &Tensor, cin: usize, cout: usize) -> kiln::Result<Tensor> {
    Conv2d::load(vb("conv"), &Conv2dConfig::new(cin, cout, 3).padding(1))?.forward(x)
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn softmax() {
    for (dims, dim) in [(&[5usize, 7, 9][..], 1isize), (&[5, 7, 9], -1), (&[5, 7, 9], 2), (&[37], 1), (&[4, 300], -1)] {
        check(&format!("softmax {dims:?} dim {dim}"), &[("x", dims)], |x| Ok(vec![x[0].softmax(dim)?]));
    }
    check("softmax(dim 1) of an NHWC conv [4, 6, 5]", &[("x", &[4, 6, 5])], |x| Ok(vec![conv(&x[0], 4, 6)?.softmax(1)?]));
    check("softmax(dim -1) of an NHWC conv [4, 6, 5]", &[("x", &[4, 6, 5])], |x| Ok(vec![conv(&x[0], 4, 6)?.softmax(-1)?]));
    // One output channel: the NHWC conv output has the bytes of NCHW, so the softmax reads it as it
    // is (MobileViTv2's context scores).
    check("softmax(dim -1) of a one-channel NHWC conv [4, 4, 33]", &[("x", &[4, 4, 33])], |x| Ok(vec![conv(&x[0], 4, 1)?.softmax(-1)?]));
    // Few long columns: CoaT's factorised attention, a softmax over the tokens of each of a head's
    // channels, [heads, tokens, channels], tokens not a multiple of the block's groups; and over
    // a conv's columns. Timing picks, then the split kernel forced.
    for kind in [None, Some("kernel:softmax_split")] {
        check_forced("softmax(dim 2) of [8, 3137, 8]", kind, &[("x", &[8, 3137, 8])], |x| Ok(vec![x[0].softmax(2)?]));
        check_forced("softmax(dim 2) of [3, 70, 45]", kind, &[("x", &[3, 70, 45])], |x| Ok(vec![x[0].softmax(2)?]));
        check_forced("softmax(dim 2) of a conv [3, 70, 6]", kind, &[("x", &[3, 70, 6])], |x| Ok(vec![conv(&x[0], 3, 80)?.softmax(2)?]));
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn layer_norm() {
    let ln = |shape: &[usize], c: LayerNormConfig, x: &Tensor| {
        LayerNorm::load(vb("ln"), &LayerNormConfig { normalized_shape: shape.to_vec(), ..c })?.forward(x)
    };
    let c = LayerNormConfig::new(&[1]);
    check("layer_norm [24] of [5, 24]", &[("x", &[5, 24])], |x| Ok(vec![ln(&[24], c.clone(), &x[0])?]));
    check("layer_norm [768] eps 1e-6 of [3, 768]", &[("x", &[3, 768])], |x| Ok(vec![ln(&[768], c.clone().eps(1e-6), &x[0])?]));
    check("layer_norm [6, 7] of [4, 6, 7]", &[("x", &[4, 6, 7])], |x| Ok(vec![ln(&[6, 7], c.clone().eps(1e-3), &x[0])?]));
    check("layer_norm no affine [10] of [3, 10]", &[("x", &[3, 10])], |x| Ok(vec![ln(&[10], c.clone().elementwise_affine(false), &x[0])?]));
    let ln2d = |x: &Tensor, ch: usize| LayerNorm2d::load(vb("ln2d"), &LayerNormConfig::new(&[ch]).eps(1e-6))?.forward(x);
    check("layer_norm2d [8, 5, 6]", &[("x", &[8, 5, 6])], |x| Ok(vec![ln2d(&x[0], 8)?]));
    check("layer_norm2d of an NHWC conv [3, 7, 5]", &[("x", &[3, 7, 5])], |x| Ok(vec![ln2d(&conv(&x[0], 3, 12)?, 12)?]));
    check("layer_norm [5] of an NHWC conv [3, 4, 5]", &[("x", &[3, 4, 5])], |x| Ok(vec![ln(&[5], c.clone(), &conv(&x[0], 3, 6)?)?]));
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn group_norm() {
    use kiln::nn::{GroupNorm, GroupNormConfig};
    let gn = |x: &Tensor, c: GroupNormConfig| GroupNorm::load(vb("gn"), &c)?.forward(x);
    check("group_norm 2 groups [6, 5, 7]", &[("x", &[6, 5, 7])], |x| Ok(vec![gn(&x[0], GroupNormConfig::new(2, 6))?]));
    check("group_norm 32 groups of an NHWC conv [3, 9, 10]", &[("x", &[3, 9, 10])], |x| {
        Ok(vec![gn(&conv(&x[0], 3, 64)?, GroupNormConfig::new(32, 64))?])
    });
    check("instance_norm affine [4, 6, 5]", &[("x", &[4, 6, 5])], |x| Ok(vec![gn(&x[0], GroupNormConfig::new(4, 4))?]));
    check("instance_norm [5, 33, 40] (rows longer than a block)", &[("x", &[5, 33, 40])], |x| Ok(vec![x[0].group_norm(5, 1e-5)?]));
    check("group_norm rank 3 [6, 11]", &[("x", &[6, 11])], |x| Ok(vec![x[0].group_norm(3, 1e-3)?]));
    // Channels-last in and out: a conv's output read as it is (PoolFormer, MobileViTv2: one group
    // over the whole image), and long rows split over many blocks: timing picks, then the split
    // kernels forced (chunks that do not divide the row, a group's channels inside a pixel).
    for kind in [None, Some("kernel:group_norm_split")] {
        check_forced("group_norm 1 group of an NHWC conv [3, 61, 67]", kind, &[("x", &[3, 61, 67])], |x| {
            Ok(vec![gn(&conv(&x[0], 3, 24)?, GroupNormConfig::new(1, 24))?])
        });
        check_forced("group_norm 4 groups of an NHWC conv [3, 50, 45]", kind, &[("x", &[3, 50, 45])], |x| {
            Ok(vec![gn(&conv(&x[0], 3, 40)?, GroupNormConfig::new(4, 40))?])
        });
        check_forced("group_norm 2 groups no affine [6, 97, 89]", kind, &[("x", &[6, 97, 89])], |x| Ok(vec![x[0].group_norm(2, 1e-5)?]));
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn amax() {
    check("amax (2, 3) [6, 5, 7]", &[("x", &[6, 5, 7])], |x| Ok(vec![x[0].amax(&[2, 3], false)?]));
    check("amax 1 keepdim of an NHWC conv [3, 7, 6]", &[("x", &[3, 7, 6])], |x| Ok(vec![conv(&x[0], 3, 16)?.amax(&[1], true)?]));
    check("amax -1 [4, 300] (a warp a row)", &[("x", &[4, 300])], |x| Ok(vec![x[0].amax(&[2], false)?]));
    // Few outputs over long strided reductions, split over a block's groups: timing picks, then
    // the split kernel forced.
    for kind in [None, Some("kernel:amax_split")] {
        check_forced("amax (2, 3) of an NHWC conv [3, 61, 67]", kind, &[("x", &[3, 61, 67])], |x| {
            Ok(vec![conv(&x[0], 3, 40)?.amax(&[2, 3], true)?])
        });
        check_forced("amax 1 of [200, 70]", kind, &[("x", &[200, 70])], |x| Ok(vec![x[0].amax(&[1], false)?]));
    }
}

/// Argmax in an FP32 engine, exactly as the CPU executor (an FP16 engine rounds near-equal
/// maxima together, so its indices may differ where PyTorch's would too).
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn argmax() {
    let Some(gpu) = common::gpu() else { return };
    type Case = (&'static str, &'static [usize], fn(&Tensor) -> kiln::Result<Tensor>);
    // The split kernel (few outputs, long reductions) forced on the last two; in the last every
    // element is 0 (inputs within ±2, less 3, through ReLU), so each group's first maximum ties
    // and the first index must win.
    let cases: [(Case, Option<&[&str]>); 5] = [
        (("argmax 1 of [21, 6, 7]", &[21, 6, 7], |x| x.argmax(1, false)), None),
        (("argmax 1 of an NHWC conv [3, 9, 8]", &[3, 9, 8], |x| conv(x, 3, 21)?.argmax(1, true)), None),
        (("argmax -1 of [4, 300] (a warp a row)", &[4, 300], |x| x.argmax(2, false)), None),
        (("argmax 1 of [500, 24] (split)", &[500, 24], |x| x.argmax(1, false)), Some(&["kernel:argmax_split"])),
        (
            ("argmax 1 of relu(x - 3) [300, 16] (split, all tied)", &[300, 16], |x| x.affine(1.0, -3.0)?.relu()?.argmax(1, false)),
            Some(&["kernel:argmax_split"]),
        ),
    ];
    for ((name, dims, f), sources) in cases {
        let tracer = kiln::Tracer::new();
        let x = tracer.input("x", &[&[1][..], dims].concat());
        tracer.output("y", &f(&x).expect("trace"));
        let graph = tracer.graph();
        let engine = common::build_with(&gpu, &graph, kiln::engine::Precision::Fp32, sources);
        if let Some(kind) = sources {
            assert!(engine.layers().any(|l| l.kind() == kind[0]), "{name}: no {} layer", kind[0]);
        }
        let mut ctx = engine.context().expect("context");
        for batch in common::BATCHES {
            let host = common::random(&[&[batch][..], dims].concat(), batch as u64, 2.0);
            let want = kiln::run_cpu(&graph, &[("x", &host)]).expect("cpu");
            let got = ctx.run(&[("x", &host)]).expect("run");
            let same = got["y"].data.iter().zip(&want["y"].data).filter(|(a, b)| a == b).count();
            println!("{name} batch {batch}: {same} of {} indices agree", want["y"].data.len());
            assert_eq!(got["y"].data, want["y"].data, "{name} batch {batch}");
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn mean() {
    check("mean (2, 3) [6, 5, 7]", &[("x", &[6, 5, 7])], |x| Ok(vec![x[0].mean(&[2, 3], false)?]));
    check("mean (2, 3) keepdim [4, 3, 5]", &[("x", &[4, 3, 5])], |x| Ok(vec![x[0].mean(&[2, 3], true)?]));
    check("mean (2, 3) of an NHWC conv [3, 7, 6]", &[("x", &[3, 7, 6])], |x| Ok(vec![conv(&x[0], 3, 16)?.mean(&[2, 3], false)?]));
    check("mean -1 [4, 64]", &[("x", &[4, 64])], |x| Ok(vec![x[0].mean(&[2], false)?]));
    check("mean -1 [4, 9]", &[("x", &[4, 9])], |x| Ok(vec![x[0].mean(&[2], false)?]));
    check("mean 1 keepdim [5, 3, 4]", &[("x", &[5, 3, 4])], |x| Ok(vec![x[0].mean(&[1], true)?]));
    check("mean (1, 3) [5, 3, 4]", &[("x", &[5, 3, 4])], |x| Ok(vec![x[0].mean(&[1, 3], false)?]));
    // Few outputs over long strided reductions: a squeeze-excitation mean of a channels-last image
    // (more runs than the block's groups, and fewer: 5 rows of 300), and a mean over channels.
    // Timing picks, then the split kernel forced.
    for kind in [None, Some("kernel:mean_split")] {
        check_forced("mean (2, 3) of an NHWC conv [3, 112, 97]", kind, &[("x", &[3, 112, 97])], |x| {
            Ok(vec![conv(&x[0], 3, 64)?.mean(&[2, 3], true)?])
        });
        check_forced("mean (2, 3) of an NHWC conv [3, 5, 300]", kind, &[("x", &[3, 5, 300])], |x| {
            Ok(vec![conv(&x[0], 3, 33)?.mean(&[2, 3], false)?])
        });
        check_forced("mean 1 of [300, 40]", kind, &[("x", &[300, 40])], |x| Ok(vec![x[0].mean(&[1], true)?]));
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn matmul() {
    check("bmm [5, 7] @ [7, 3]", &[("a", &[5, 7]), ("b", &[7, 3])], |x| Ok(vec![x[0].bmm(&x[1])?]));
    check("matmul [33, 40] @ [40, 17]", &[("a", &[33, 40]), ("b", &[40, 17])], |x| Ok(vec![x[0].matmul(&x[1])?]));
    check("matmul [3, 4, 6] @ [1, 6, 5]", &[("a", &[3, 4, 6]), ("b", &[1, 6, 5])], |x| Ok(vec![x[0].matmul(&x[1])?]));
    check("matmul [2, 3, 4, 6] @ [2, 1, 6, 5]", &[("a", &[2, 3, 4, 6]), ("b", &[2, 1, 6, 5])], |x| Ok(vec![x[0].matmul(&x[1])?]));
    check("[5, 9] @ W[9, 4] (cuBLASLt)", &[("x", &[5, 9])], |x| {
        let w = vb("mm").get(&[9, 4], "weight")?;
        Ok(vec![x[0].matmul_weight("mm", &w)?])
    });
    check("[3, 5, 6] @ W[3, 6, 4]", &[("x", &[3, 5, 6])], |x| {
        let w = vb("mm").get(&[3, 6, 4], "weight")?;
        Ok(vec![x[0].matmul_weight("mm", &w)?])
    });
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn linear_rank3() {
    let lin = |x: &Tensor, c: LinearConfig| Linear::load(vb("fc"), &c)?.forward(x);
    check("linear [5, 12] -> 7", &[("x", &[5, 12])], |x| Ok(vec![lin(&x[0], LinearConfig::new(12, 7))?]));
    check("linear no bias [3, 4, 8] -> 3", &[("x", &[3, 4, 8])], |x| {
        Ok(vec![lin(&x[0], LinearConfig { bias: false, ..LinearConfig::new(8, 3) })?])
    });
    check("linear [20] -> 7", &[("x", &[20])], |x| Ok(vec![lin(&x[0], LinearConfig::new(20, 7))?]));
    check("linear then softmax [6, 16] -> 10", &[("x", &[6, 16])], |x| Ok(vec![lin(&x[0], LinearConfig::new(16, 10))?.softmax(-1)?]));
}
