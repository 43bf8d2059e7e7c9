//! The shape ops (src/ops/shape.rs) inside real engines against the CPU executor: reshape,
//! flatten and permute (aliases, with the reformats the builder inserts around them), slice,
//! pad and cat (strided copies, kernels/shape.cu), in contiguous, NHWC and permuted layouts;
//! FP32 and FP16, batch 1 and 3, odd and non-square sizes.
//!
//! An identity adaptive pool (output size = input size) puts a value in NHWC, the layout the
//! engine's convolutions and pools use, so the ops also see the layout real models give them.
//!
//! On the device: `cargo test --release --test gpu_shape -- --include-ignored --nocapture --test-threads 1`.

use kiln::{
    nn::{ConstantPad2d, ConstantPad2dConfig, ZeroPad2d},
    Forward, Module, Tensor, VarBuilder,
};

mod common;
use common::check;

/// `x` in NHWC: an adaptive average pool to its own size (windows of one pixel).
fn nhwc(x: &Tensor) -> kiln::Result<Tensor> {
    let s = x.shape();
    x.adaptive_avg_pool2d([s[2], s[3]])
}

fn cat_rev(parts: &[Tensor], dim: usize) -> kiln::Result<Tensor> {
    Tensor::cat(&parts.iter().rev().collect::<Vec<_>>(), dim)
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn reshape_and_flatten() {
    check("reshape [6, 5, 7] -> [3, 2, 35]", &[("x", &[6, 5, 7])], |x| Ok(vec![x[0].reshape(&[-1, 3, 2, 35])?]));
    // NHWC input: the builder reformats to contiguous, then the reshape aliases; the result
    // goes back to NHWC for a pool.
    check("reshape(nhwc) [6, 5, 7] -> [3, 10, 7]", &[("x", &[6, 5, 7])], |x| {
        let r = nhwc(&x[0])?.reshape(&[-1, 3, 10, 7])?;
        Ok(vec![nhwc(&r)?, r])
    });
    check("view [5, 3, 4] -> [60] -> sigmoid", &[("x", &[5, 3, 4])], |x| Ok(vec![x[0].view(&[-1, 60])?.sigmoid()?]));
    check("flatten(1) of nhwc [7, 3, 5]", &[("x", &[7, 3, 5])], |x| Ok(vec![nhwc(&x[0])?.flatten(1)?]));
    check("flatten(1) of nhwc [9, 1, 1]", &[("x", &[9, 1, 1])], |x| Ok(vec![nhwc(&x[0])?.flatten(1)?]));
    check("flatten(2) of nhwc [3, 4, 5]", &[("x", &[3, 4, 5])], |x| Ok(vec![nhwc(&x[0])?.flatten(2)?]));
    check("flatten_range(1, 2) [3, 4, 5]", &[("x", &[3, 4, 5])], |x| Ok(vec![x[0].flatten_range(1, 2)?.relu()?]));
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn permute() {
    // Contiguous in, permuted layout out; the output binding reformats.
    check("permute(0,2,3,1) [3, 4, 5]", &[("x", &[3, 4, 5])], |x| Ok(vec![x[0].permute(&[0, 2, 3, 1])?]));
    // ConvNeXt: NHWC in, the permute is free and contiguous.
    check("permute(0,2,3,1) of nhwc [6, 5, 7]", &[("x", &[6, 5, 7])], |x| {
        let p = nhwc(&x[0])?.permute(&[0, 2, 3, 1])?;
        Ok(vec![p.relu()?.permute(&[0, 3, 1, 2])?, p])
    });
    // A permuted value read by an op that wants NHWC (reformat from an arbitrary order).
    check("transpose(2,3) -> pool [5, 4, 7]", &[("x", &[5, 4, 7])], |x| Ok(vec![nhwc(&x[0].transpose(2, 3)?)?]));
    check("permute rank 5 (0,3,1,4,2) [2, 3, 4, 5]", &[("x", &[2, 3, 4, 5])], |x| Ok(vec![x[0].permute(&[0, 3, 1, 4, 2])?]));
    check("transpose(-1,-2) [5, 7]", &[("x", &[5, 7])], |x| Ok(vec![x[0].transpose(-1, -2)?.sigmoid()?]));
}

/// ShuffleNet's channel shuffle: `x.view(n, g, c/g, h, w).transpose(1, 2).contiguous().view(n, c, h, w)`.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn reshape_channel_shuffle() {
    for (c, g, h, w) in [(6usize, 3usize, 5usize, 7usize), (24, 2, 4, 3)] {
        check(&format!("channel shuffle c{c} g{g} {h}x{w}"), &[("x", &[c, h, w])], |x| {
            let (c, g, h, w) = (c as isize, g as isize, h as isize, w as isize);
            let y = nhwc(&x[0])?.view(&[-1, g, c / g, h, w])?.transpose(1, 2)?.contiguous()?.view(&[-1, c, h, w])?;
            Ok(vec![nhwc(&y)?])
        });
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn slice() {
    check("narrow(1, 2, 3) [7, 4, 5]", &[("x", &[7, 4, 5])], |x| Ok(vec![x[0].narrow(1, 2, 3)?]));
    check("narrow(2, 1, 3) of nhwc [5, 6, 7]", &[("x", &[5, 6, 7])], |x| Ok(vec![nhwc(&x[0])?.narrow(2, 1, 3)?]));
    check("narrow(-1, 4, 5) of nhwc [3, 4, 9]", &[("x", &[3, 4, 9])], |x| Ok(vec![nhwc(&x[0])?.narrow(-1, 4, 5)?]));
    check("narrow(1, 1, 4) of nhwc [16, 3, 5]", &[("x", &[16, 3, 5])], |x| Ok(vec![nhwc(&x[0])?.narrow(1, 1, 4)?]));
    check("chunk(3, 3) [3, 4, 7]", &[("x", &[3, 4, 7])], |x| x[0].chunk(3, 3));
    check("chunk(4, 1) of nhwc [6, 3, 5]", &[("x", &[6, 3, 5])], |x| nhwc(&x[0])?.chunk(4, 1));
    check("split([2, 4, 1], 1) [7, 2, 5]", &[("x", &[7, 2, 5])], |x| x[0].split(&[2, 4, 1], 1));
    check("narrow of a permuted value [4, 5, 6]", &[("x", &[4, 5, 6])], |x| Ok(vec![x[0].permute(&[0, 3, 1, 2])?.narrow(2, 1, 3)?]));
    check("narrow [F] [11]", &[("x", &[11])], |x| Ok(vec![x[0].narrow(1, 3, 7)?]));
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn cat() {
    check("cat dim 2 [3, 4, 5] + [3, 6, 5]", &[("a", &[3, 4, 5]), ("b", &[3, 6, 5])], |x| Ok(vec![Tensor::cat(&[&x[0], &x[1]], 2)?]));
    check("cat dim 3 of nhwc [2, 5, 3] + [2, 5, 4]", &[("a", &[2, 5, 3]), ("b", &[2, 5, 4])], |x| {
        Ok(vec![Tensor::cat(&[&nhwc(&x[0])?, &nhwc(&x[1])?], 3)?])
    });
    check("cat dim 1 of nhwc [3, 4, 5] + [5, 4, 5] (channels)", &[("a", &[3, 4, 5]), ("b", &[5, 4, 5])], |x| {
        Ok(vec![Tensor::cat(&[&nhwc(&x[0])?, &nhwc(&x[1])?], 1)?])
    });
    check("cat dim 1 rank 2 [5, 3] + [7, 3]", &[("a", &[5, 3]), ("b", &[7, 3])], |x| Ok(vec![Tensor::cat(&[&x[0], &x[1]], 1)?]));
    check("cat dim 2 rank 2 [3, 5] + [3, 7]", &[("a", &[3, 5]), ("b", &[3, 7])], |x| Ok(vec![Tensor::cat(&[&x[0], &x[1]], 2)?]));
    check("cat dim 4 rank 5 [2, 3, 4, 2] x3", &[("a", &[2, 3, 4, 2]), ("b", &[2, 3, 4, 5])], |x| {
        Ok(vec![Tensor::cat(&[&x[0], &x[1], &x[0]], 4)?])
    });
    // Inputs in different layouts (a permuted one and a contiguous one).
    check("cat dim 2 of permuted + contiguous [4, 5, 3] + [4, 2, 3]", &[("a", &[5, 4, 3]), ("b", &[4, 2, 3])], |x| {
        let p = x[0].transpose(1, 2)?;
        Ok(vec![Tensor::cat(&[&p, &x[1]], 2)?])
    });
    check("chunks cat reversed [3, 4, 7]", &[("x", &[3, 4, 7])], |x| Ok(vec![cat_rev(&nhwc(&x[0])?.chunk(3, 3)?, 3)?]));
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn pad() {
    check("pad (1, 2, 0, 3) value 0.5 [3, 4, 5]", &[("x", &[3, 4, 5])], |x| Ok(vec![x[0].pad(&[1, 2, 0, 3], 0.5)?]));
    check("pad of nhwc (2, 1, 1, 0) [5, 4, 7]", &[("x", &[5, 4, 7])], |x| Ok(vec![nhwc(&x[0])?.pad(&[2, 1, 1, 0], -1.0)?]));
    check("pad channels (0, 0, 0, 0, 1, 2) of nhwc [3, 4, 5]", &[("x", &[3, 4, 5])], |x| {
        Ok(vec![nhwc(&x[0])?.pad(&[0, 0, 0, 0, 1, 2], 2.0)?])
    });
    check("pad last dim [F] [9]", &[("x", &[9])], |x| Ok(vec![x[0].pad(&[3, 1], 0.0)?]));
    check("ZeroPad2d + ConstantPad2d [3, 5, 4]", &[("x", &[3, 5, 4])], |x| {
        let z = ZeroPad2d::load(VarBuilder::seeded().pp("zp"), &[2, 1, 1, 0])?;
        let c = ConstantPad2d::load(VarBuilder::seeded().pp("cp"), &ConstantPad2dConfig { padding: [1, 1, 2, 2], value: -1.5 })?;
        Ok(vec![c.forward(&nhwc(&z.forward(&x[0])?)?)?])
    });
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn reflect_and_replicate_pads() {
    check("reflection_pad (2, 1, 3, 1) [3, 5, 4]", &[("x", &[3, 5, 4])], |x| Ok(vec![x[0].reflection_pad(&[2, 1, 3, 1])?]));
    // From an NHWC producer: the builder gives the kernel the contiguous layout.
    check("reflection_pad of nhwc (1, 1, 1, 1) [6, 4, 5]", &[("x", &[6, 4, 5])], |x| Ok(vec![nhwc(&x[0])?.reflection_pad(&[1, 1, 1, 1])?]));
    check("reflection_pad 1-D (3, 2) [4, 6]", &[("x", &[4, 6])], |x| Ok(vec![x[0].reflection_pad(&[3, 2])?]));
    check("replication_pad (1, 3, 2, 0) [3, 4, 5]", &[("x", &[3, 4, 5])], |x| Ok(vec![x[0].replication_pad(&[1, 3, 2, 0])?]));
    check("replication_pad channels too (1, 1, 0, 2, 1, 0) [2, 3, 4]", &[("x", &[2, 3, 4])], |x| {
        Ok(vec![x[0].replication_pad(&[1, 1, 0, 2, 1, 0])?])
    });
}
