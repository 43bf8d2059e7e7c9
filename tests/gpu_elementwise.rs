//! Elementwise engines against the CPU executor: every `Unary` op, and `+ - * /` with PyTorch's
//! broadcasting (a squeeze-excitation's `[C, H, W] * [C, 1, 1]`, row broadcasts, operands in
//! different layouts, constant operands such as a layer scale or a position embedding), FP32 and
//! FP16, batch 1 and 3, odd channel counts (scalar paths) and multiples of 8 (packed paths).
//!
//! On the device: `cargo test --release --test gpu_elementwise -- --include-ignored --nocapture`.

use kiln::{
    nn::{Conv2d, Conv2dConfig},
    plugin::{Binary, Unary},
    Forward, Module, Param, Tensor, VarBuilder,
};
use std::sync::Arc;

mod common;
use common::check;

/// `b.abs() + 0.5`: a divisor away from zero.
fn abs_plus_half(b: &Tensor) -> kiln::Result<Tensor> {
    b.relu()?.add(&b.affine(-1.0, 0.0)?.relu()?)?.affine(1.0, 0.5)
}

/// A constant with seeded values in [-1, 1).
fn param(name: &str, shape: &[usize]) -> Param {
    let seed = name.bytes().fold(17u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    Param { name: name.to_string(), value: Arc::new(kiln::dev::uniform_tensor(shape, seed)) }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn unary_ops() {
    // Every variant, with the parameters its family lists (`Unary::examples`).
    let ops = Unary::examples();
    for dims in [[7usize, 5, 9], [16, 6, 5]] {
        for &op in &ops {
            // Inputs span [-8, 8): past every op's kinks (ReLU6's 6, Hardswish's ±3); ops defined
            // for positive inputs only get [0.5, 8.5).
            let positive = matches!(op, Unary::Log | Unary::Sqrt | Unary::Rsqrt | Unary::Reciprocal)
                || matches!(op, Unary::Pow { exponent } if exponent.fract() != 0.0 || exponent < 0.0);
            check(&format!("{op:?} {dims:?}"), &[("x", &dims)], |x| {
                let x = if positive { x[0].abs()?.affine(8.0, 0.5)? } else { x[0].affine(4.0, 0.0)? };
                Ok(vec![x.unary(op)?])
            });
        }
    }
    // F.normalize of a zero row (SwinV2's keys where a window is padded): clamp(‖x‖, min=1e-12)
    // must not store 0 in FP16, or the division gives NaN where PyTorch's FP32 gives 0.
    check("x + 0 / clamp(norm(0), 1e-12) [4, 6, 32]", &[("x", &[4, 6, 32])], |x| {
        let zero = x[0].affine(0.0, 0.0)?;
        let norm = zero.mul(&zero)?.mean(&[3], true)?.unary(Unary::Sqrt)?.clamp(1e-12, f32::MAX)?;
        Ok(vec![x[0].add(&zero.div(&norm)?)?])
    });
    // On a flat [N, F] value and a [N, L, D] one.
    check("silu [21]", &[("x", &[21])], |x| Ok(vec![x[0].silu()?]));
    check("gelu [5, 12]", &[("x", &[5, 12])], |x| Ok(vec![x[0].gelu(false)?]));
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn same_shape_binary_ops() {
    for dims in [[3usize, 4, 5], [24, 7, 3]] {
        check(&format!("sub {dims:?}"), &[("a", &dims), ("b", &dims)], |x| Ok(vec![x[0].sub(&x[1])?]));
        check(&format!("div {dims:?}"), &[("a", &dims), ("b", &dims)], |x| Ok(vec![x[0].div(&abs_plus_half(&x[1])?)?]));
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn broadcasting_binary_ops() {
    for c in [5usize, 16] {
        // Squeeze-excitation: [C, H, W] * [C, 1, 1], both activations.
        check(&format!("mul [{c}, 6, 7] * [{c}, 1, 1]"), &[("x", &[c, 6, 7]), ("s", &[c, 1, 1])], |x| Ok(vec![x[0].mul(&x[1])?]));
        // The broadcast operand first, and a division.
        check(&format!("div [{c}, 1, 1] / [{c}, 6, 7]"), &[("s", &[c, 1, 1]), ("x", &[c, 6, 7])], |x| {
            Ok(vec![x[0].div(&abs_plus_half(&x[1])?)?])
        });
        // A row broadcast: [C, H, W] - [1, H, W].
        check(&format!("sub [{c}, 6, 7] - [1, 6, 7]"), &[("x", &[c, 6, 7]), ("m", &[1, 6, 7])], |x| Ok(vec![x[0].sub(&x[1])?]));
        // Both operands broadcast: [C, 1, W] + [1, H, 1].
        check(&format!("add [{c}, 1, 7] + [1, 6, 1]"), &[("a", &[c, 1, 7]), ("b", &[1, 6, 1])], |x| Ok(vec![x[0].add(&x[1])?]));
        // Constants: a layer scale and a bias-like shift.
        check(&format!("mul [{c}, 6, 7] * weight [{c}, 1, 1]"), &[("x", &[c, 6, 7])], |x| {
            Ok(vec![x[0].binary_weight("gamma", Binary::Mul, &param("gamma", &[c, 1, 1]))?])
        });
        check(&format!("add [{c}, 6, 7] + weight [{c}, 1, 1]"), &[("x", &[c, 6, 7])], |x| {
            Ok(vec![x[0].binary_weight("shift", Binary::Add, &param("shift", &[c, 1, 1]))?])
        });
    }
    // A position embedding: [L, D] + weight [1, L, D], and a weight of lower rank ([D]).
    check("add [9, 8] + weight [1, 9, 8]", &[("x", &[9, 8])], |x| {
        Ok(vec![x[0].binary_weight("pos", Binary::Add, &param("pos", &[1, 9, 8]))?])
    });
    check("sub [9, 8] - weight [8]", &[("x", &[9, 8])], |x| Ok(vec![x[0].binary_weight("b", Binary::Sub, &param("b", &[8]))?]));
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn operands_in_different_layouts() {
    // A conv's output (NHWC) plus a graph input (NCHW) of the same dims: read through strides.
    for c in [6usize, 16] {
        check(&format!("conv(x) + y [{c}, 5, 7]"), &[("x", &[3, 5, 7]), ("y", &[c, 5, 7])], |x| {
            let conv = Conv2d::load(VarBuilder::seeded().pp("conv"), &Conv2dConfig::new(3, c, 3).padding(1))?;
            Ok(vec![conv.forward(&x[0])?.mul(&x[1])?])
        });
    }
}

/// torchvision's `SqueezeExcitation`: `x * sigmoid(fc2(relu(fc1(avgpool(x)))))`, the fcs 1x1
/// convolutions, traced with real layers.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn squeeze_excitation_block() {
    for (c, squeeze, hw) in [(16usize, 4usize, [7usize, 9]), (24, 8, [14, 14]), (5, 2, [5, 6])] {
        check(&format!("squeeze-excitation c={c} s={squeeze} {hw:?}"), &[("x", &[c, hw[0], hw[1]])], |x| {
            let vb = VarBuilder::seeded().pp("se");
            let fc1 = Conv2d::load(vb.pp("fc1"), &Conv2dConfig::new(c, squeeze, 1))?;
            let fc2 = Conv2d::load(vb.pp("fc2"), &Conv2dConfig::new(squeeze, c, 1))?;
            let scale = fc2.forward(&fc1.forward(&x[0].adaptive_avg_pool2d([1, 1])?)?.relu()?)?.sigmoid()?;
            Ok(vec![x[0].mul(&scale)?])
        });
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn adaptive_max_pooling() {
    // Odd channels (scalar path) and multiples of 8 (packs); cells of unequal sizes; 1x1.
    for c in [5usize, 16] {
        check(&format!("adaptive_max_pool2d 3x3 [{c}, 7, 10]"), &[("x", &[c, 7, 10])], |x| Ok(vec![x[0].adaptive_max_pool2d([3, 3])?]));
        check(&format!("adaptive_max_pool2d 1x1 [{c}, 5, 6]"), &[("x", &[c, 5, 6])], |x| Ok(vec![x[0].adaptive_max_pool2d([1, 1])?]));
    }
}
