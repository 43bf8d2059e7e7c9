//! Every op fixture of `tests/fixtures/ops.reference.safetensors` (PyTorch, written by
//! `python3 tools/export_reference.py --op-fixtures --out tests/fixtures`) rebuilt through Kiln's
//! layers, loading the case's parameters from that file (`<case>.weight`, ...), run on the CPU
//! executor and compared with PyTorch's output.

use kiln::compare::compare;
use kiln::var_builder::read_safetensors;
use kiln::{
    AdaptiveAvgPool2d, AvgPool2d, BatchNorm2d, BatchNorm2dConfig, Binary, Conv2d, Conv2dConfig, ConvTranspose2d, Forward, Hardsigmoid,
    Hardswish, Hardtanh, LeakyReLU, LeakyReLUConfig, Linear, LinearConfig, MaxPool2d, Module, Pool2dConfig, ReLU, ReLU6, Result, SiLU,
    Sigmoid, Tanh, Tensor, Tracer, Upsample, UpsampleConfig, VarBuilder, GELU,
};
use std::path::PathBuf;

const TOL: f64 = 1e-5;

/// `tests/fixtures/ops.reference.safetensors`, or under `KILN_FIXTURES` (carried test binaries).
fn fixture() -> PathBuf {
    let dir =
        std::env::var_os("KILN_FIXTURES").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"), PathBuf::from);
    dir.join("ops.reference.safetensors")
}

/// `b.abs() + 0.5` as `relu(b) + relu(-b) + 0.5` (a divisor away from zero).
fn abs_plus_half(b: &Tensor) -> Result<Tensor> {
    b.relu()?.add(&b.affine(-1.0, 0.0)?.relu()?)?.affine(1.0, 0.5)
}

fn upsample(vb: VarBuilder, x: &Tensor, c: UpsampleConfig) -> Result<Tensor> {
    Upsample::load(vb, &c)?.forward(x)
}

fn conv(vb: VarBuilder, x: &Tensor, c: Conv2dConfig) -> Result<Tensor> {
    Conv2d::load(vb, &c)?.forward(x)
}

/// The Kiln twin of each PyTorch case in `op_cases()` of the export script. `None`: unknown case.
fn build(case: &str, vb: VarBuilder, x: &Tensor, other: Option<&Tensor>) -> Option<Result<Tensor>> {
    let other = || other.ok_or_else(|| kiln::Error::Graph(format!("case {case} needs `{case}.other`")));
    let c = Conv2dConfig::new;
    Some(match case {
        "conv_stride2_pad" => conv(vb, x, c(3, 8, 3).stride(2).padding(1)),
        "conv_dilation2" => conv(vb, x, c(4, 5, 3).padding(2).dilation(2)),
        "conv_groups" => conv(vb, x, c(8, 12, 3).padding(1).groups(4)),
        "conv_depthwise" => conv(vb, x, c(6, 6, 3).stride(2).padding(1).groups(6)),
        "conv_nonsquare_batch3" => conv(vb, x, c(3, 4, 5).padding(1).bias(false)),
        "maxpool_ceil" => MaxPool2d::load(vb, &Pool2dConfig::new(3).stride(2).padding(1).ceil_mode(true)).and_then(|m| m.forward(x)),
        "maxpool_default" => MaxPool2d::load(vb, &Pool2dConfig::new(2)).and_then(|m| m.forward(x)),
        "avgpool_pad" => AvgPool2d::load(vb, &Pool2dConfig::new(3).stride(2).padding(1)).and_then(|m| m.forward(x)),
        "avgpool_pad_exclude" => {
            let cfg = Pool2dConfig { count_include_pad: false, ..Pool2dConfig::new(3).stride(2).padding(1) };
            AvgPool2d::load(vb, &cfg).and_then(|m| m.forward(x))
        }
        "avgpool_ceil" => AvgPool2d::load(vb, &Pool2dConfig::new(2).stride(2).ceil_mode(true)).and_then(|m| m.forward(x)),
        "adaptive_avgpool_3x3" => AdaptiveAvgPool2d::load(vb, &[3, 3]).and_then(|m| m.forward(x)),
        "conv_transpose_outpad_groups" => {
            ConvTranspose2d::load(vb, &c(4, 6, 3).stride(2).padding(1).output_padding(1).groups(2)).and_then(|m| m.forward(x))
        }
        "conv_transpose_k4s2" => ConvTranspose2d::load(vb, &c(6, 4, 4).stride(2).padding(1).bias(false)).and_then(|m| m.forward(x)),
        "batchnorm_eps" => BatchNorm2d::load(vb, &BatchNorm2dConfig { num_features: 5, eps: 1e-3 }).and_then(|m| m.forward(x)),
        "linear" => Linear::load(vb, &LinearConfig::new(20, 7)).and_then(|m| m.forward(x)),
        "leaky_relu" => LeakyReLU::load(vb, &LeakyReLUConfig { negative_slope: 0.2 }).and_then(|m| m.forward(x)),
        "sigmoid" => Sigmoid::load(vb, &()).and_then(|m| m.forward(x)),
        "relu" => ReLU::load(vb, &()).and_then(|m| m.forward(x)),
        "cat" => other().and_then(|o| Tensor::cat(&[x, o], 1)),
        "mul" => other().and_then(|o| x * o),
        "add" => other().and_then(|o| x + o),
        "flatten" => x.flatten(1),
        "silu" => SiLU::load(vb, &()).and_then(|m| m.forward(x)),
        "hardswish" => Hardswish::load(vb, &()).and_then(|m| m.forward(x)),
        "hardsigmoid" => Hardsigmoid::load(vb, &()).and_then(|m| m.forward(x)),
        "gelu_exact" => GELU::load(vb, &false).and_then(|m| m.forward(x)),
        "gelu_tanh" => GELU::load(vb, &true).and_then(|m| m.forward(x)),
        "tanh" => Tanh::load(vb, &()).and_then(|m| m.forward(x)),
        "asinh" => x.asinh(),
        "clamp_relu6" => ReLU6::load(vb, &()).and_then(|m| m.forward(x)),
        "clamp_hardtanh" => Hardtanh::load(vb, &(-2.0, 3.0)).and_then(|m| m.forward(x)),
        "clamp_tensor" => x.clamp(-0.5, 0.7),
        "affine_mul_add" => x.affine(0.5, 3.0),
        "affine_rsub" => x.affine(-1.0, 1.0),
        "affine_div" => x.affine(1.0 / 6.0, 0.0),
        "sub" => other().and_then(|o| x - o),
        "div" => other().and_then(|o| x / &abs_plus_half(o)?),
        "mul_squeeze_excitation" => other().and_then(|o| x * o),
        "sub_broadcast_rows" => other().and_then(|o| x - o),
        "add_weight_c11" => vb.get(&[6, 1, 1], "scale").and_then(|p| x.binary_weight(vb.path(), Binary::Add, &p)),
        "mul_weight_c11" => vb.get(&[6, 1, 1], "gamma").and_then(|p| x.binary_weight(vb.path(), Binary::Mul, &p)),
        "add_position_embedding" => vb.get(&[1, 9, 8], "pos_embedding").and_then(|p| x.binary_weight(vb.path(), Binary::Add, &p)),
        "upsample_nearest2d_scale2" => upsample(vb, x, UpsampleConfig::scale(2.0)),
        "upsample_nearest2d_scale1_5" => upsample(vb, x, UpsampleConfig::scale(1.5)),
        "upsample_nearest2d_scale1_7" => x.interpolate(&UpsampleConfig::scale(1.7)),
        "upsample_nearest2d_recompute" => x.interpolate(&UpsampleConfig::scale(1.7).recompute_scale_factor(true)),
        "upsample_nearest2d_scale_hw" => upsample(vb, x, UpsampleConfig::scale2(2.0, 1.5)),
        "upsample_nearest2d_scale_near1" => upsample(vb, x, UpsampleConfig::scale(1.05)),
        "upsample_nearest2d_size" => upsample(vb, x, UpsampleConfig::size(11, 4)),
        "upsample_bilinear2d_scale2" => upsample(vb, x, UpsampleConfig::scale(2.0).bilinear(false)),
        "upsample_bilinear2d_scale2_align_corners" => upsample(vb, x, UpsampleConfig::scale(2.0).bilinear(true)),
        "upsample_bilinear2d_scale1_5" => upsample(vb, x, UpsampleConfig::scale(1.5).bilinear(false)),
        "upsample_bilinear2d_scale1_7" => x.interpolate(&UpsampleConfig::scale(1.7).bilinear(false)),
        "upsample_bilinear2d_down" => x.interpolate(&UpsampleConfig::scale(0.6).bilinear(false)),
        "upsample_bilinear2d_size" => upsample(vb, x, UpsampleConfig::size(9, 13).bilinear(false)),
        "upsample_bilinear2d_size_align_corners" => upsample(vb, x, UpsampleConfig::size(9, 4).bilinear(true)),
        _ => return None,
    })
}

#[test]
fn every_op_fixture_matches_pytorch() {
    let path = fixture();
    let tensors = read_safetensors(&path).expect("op fixtures");
    let weights = VarBuilder::from_safetensors(&[&path]).expect("op fixtures");
    let cases: Vec<&str> = tensors.keys().filter_map(|k| k.strip_suffix(".output")).collect();
    assert!(cases.len() >= 20, "expected the full set of op fixtures, found {cases:?}");
    let mut failures = vec![];
    for case in &cases {
        let tracer = Tracer::new();
        let x = tracer.input("input", &tensors[&format!("{case}.input")].shape);
        let other_value = tensors.get(&format!("{case}.other"));
        let other = other_value.map(|o| tracer.input("other", &o.shape));
        let out = build(case, weights.pp(case), &x, other.as_ref()).unwrap_or_else(|| panic!("no Kiln twin for op fixture `{case}`"));
        let out = out.unwrap_or_else(|e| panic!("{case}: trace failed: {e}"));
        out.mark_output("output");
        let graph = tracer.graph();

        let mut inputs = vec![("input", &tensors[&format!("{case}.input")])];
        if let Some(o) = other_value {
            inputs.push(("other", o));
        }
        let got = kiln::cpu::run(&graph, &inputs).unwrap_or_else(|e| panic!("{case}: cpu run failed: {e}"));
        let c = compare(case, &got["output"], &tensors[&format!("{case}.output")]);
        println!("{c}");
        if !c.passes(TOL) {
            failures.push(c.to_string());
        }
    }
    // Every parameter PyTorch stored for a case was loaded by its Kiln twin (no bias silently
    // dropped, no buffer ignored); inputs and outputs are not parameters.
    let unused: Vec<String> =
        weights.unused().into_iter().filter(|k| !(k.ends_with(".input") || k.ends_with(".other") || k.ends_with(".output"))).collect();
    assert!(unused.is_empty(), "parameters in the fixture that no Kiln layer loaded: {unused:?}");
    assert!(failures.is_empty(), "op fixtures above rel L2 {TOL}:\n{}", failures.join("\n"));
}
