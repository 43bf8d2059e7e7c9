//! `Upsample` / `interpolate` engines (nearest and bilinear, NHWC kernels) against the CPU
//! executor: FP32 and FP16, batch 1 and 3, odd and non-square maps, integer and fractional
//! scales, explicit sizes, channel counts on the vector path (multiples of 8) and off it.
//!
//! On the device: `cargo test --release --test gpu_resize -- --include-ignored --nocapture`.

use kiln::nn::UpsampleConfig;

mod common;
use common::check;

fn cases() -> Vec<(&'static str, UpsampleConfig)> {
    let s = UpsampleConfig::scale;
    vec![
        ("scale 2", s(2.0)),
        ("scale 1.5", s(1.5)),
        ("scale 1.7", s(1.7)),
        ("scale 1.7 recomputed", s(1.7).recompute_scale_factor(true)),
        ("scale (2, 1.5)", UpsampleConfig::scale2(2.0, 1.5)),
        ("scale 0.6", s(0.6)),
        ("size 11x4", UpsampleConfig::size(11, 4)),
    ]
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn upsample_nearest() {
    for dims in [[3usize, 5, 7], [16, 6, 5]] {
        for (name, cfg) in cases() {
            check(&format!("nearest {name} {dims:?}"), &[("x", &dims)], |x| Ok(vec![x[0].interpolate(&cfg)?]));
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn upsample_bilinear() {
    for dims in [[3usize, 5, 7], [16, 6, 5]] {
        for (name, cfg) in cases() {
            for align_corners in [false, true] {
                let cfg = cfg.bilinear(align_corners);
                check(&format!("bilinear {name} ac={align_corners} {dims:?}"), &[("x", &dims)], |x| Ok(vec![x[0].interpolate(&cfg)?]));
            }
        }
    }
}

/// An FPN-style top-down merge: upsample a coarse map 2x and add it to a finer one, then a
/// bilinear resize to an explicit size, in one engine.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn upsample_in_a_graph() {
    check("fpn merge", &[("fine", &[8, 10, 14]), ("coarse", &[8, 5, 7])], |x| {
        let up = x[1].interpolate(&UpsampleConfig::scale(2.0))?;
        let merged = x[0].add(&up)?.relu()?;
        Ok(vec![merged.interpolate(&UpsampleConfig::size(13, 9).bilinear(false))?])
    });
}
