//! Every op fixture of `tests/fixtures/ops.reference.safetensors` (PyTorch, written by
//! `python3 tools/export_reference.py --op-fixtures --out tests/fixtures`) rebuilt through Kiln's
//! layers, loading the case's parameters from that file (`<case>.weight`, ...), run on the CPU
//! executor and compared with PyTorch's output.

use kiln::compare::compare;
use kiln::graph::QuantParams;
use kiln::var_builder::read_safetensors;
use kiln::{
    AdaptiveAvgPool2d, AvgPool2d, BatchNorm2d, BatchNorm2dConfig, Binary, Conv2d, Conv2dConfig, ConvTranspose2d, Forward, Hardsigmoid,
    Hardswish, Hardtanh, LayerNorm, LayerNorm2d, LayerNormConfig, LeakyReLU, LeakyReLUConfig, Linear, LinearConfig, MaxPool2d, Module,
    Pool2dConfig, ReLU, ReLU6, Result, SiLU, Sigmoid, Softmax, Tanh, Tensor, Tracer, Upsample, UpsampleConfig, VarBuilder, GELU,
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
    let other = || other.ok_or_else(|| kiln::Error::MissingWeight { key: format!("{case}.other"), source_name: "the op fixtures".into() });
    let c = Conv2dConfig::new;
    Some(match case {
        "conv2d_stride2_pad" => conv(vb, x, c(3, 8, 3).stride(2).padding(1)),
        "conv2d_dilation2" => conv(vb, x, c(4, 5, 3).padding(2).dilation(2)),
        "conv2d_groups" => conv(vb, x, c(8, 12, 3).padding(1).groups(4)),
        "conv2d_depthwise" => conv(vb, x, c(6, 6, 3).stride(2).padding(1).groups(6)),
        "conv2d_nonsquare_batch3" => conv(vb, x, c(3, 4, 5).padding(1).bias(false)),
        "max_pool2d_ceil" => MaxPool2d::load(vb, &Pool2dConfig::new(3).stride(2).padding(1).ceil_mode(true)).and_then(|m| m.forward(x)),
        "max_pool2d_default" => MaxPool2d::load(vb, &Pool2dConfig::new(2)).and_then(|m| m.forward(x)),
        "avg_pool2d_pad" => AvgPool2d::load(vb, &Pool2dConfig::new(3).stride(2).padding(1)).and_then(|m| m.forward(x)),
        "avg_pool2d_pad_exclude" => {
            let cfg = Pool2dConfig { count_include_pad: false, ..Pool2dConfig::new(3).stride(2).padding(1) };
            AvgPool2d::load(vb, &cfg).and_then(|m| m.forward(x))
        }
        "avg_pool2d_ceil" => AvgPool2d::load(vb, &Pool2dConfig::new(2).stride(2).ceil_mode(true)).and_then(|m| m.forward(x)),
        "adaptive_avg_pool2d_3x3" => AdaptiveAvgPool2d::load(vb, &[3, 3]).and_then(|m| m.forward(x)),
        "conv_transpose2d_outpad_groups" => {
            ConvTranspose2d::load(vb, &c(4, 6, 3).stride(2).padding(1).output_padding(1).groups(2)).and_then(|m| m.forward(x))
        }
        "conv_transpose2d_k4s2" => ConvTranspose2d::load(vb, &c(6, 4, 4).stride(2).padding(1).bias(false)).and_then(|m| m.forward(x)),
        "batch_norm2d_eps" => BatchNorm2d::load(vb, &BatchNorm2dConfig { num_features: 5, eps: 1e-3 }).and_then(|m| m.forward(x)),
        "linear" => Linear::load(vb, &LinearConfig::new(20, 7)).and_then(|m| m.forward(x)),
        "leaky_relu" => LeakyReLU::load(vb, &LeakyReLUConfig { negative_slope: 0.2 }).and_then(|m| m.forward(x)),
        "sigmoid" => Sigmoid::load(vb, &()).and_then(|m| m.forward(x)),
        "relu" => ReLU::load(vb, &()).and_then(|m| m.forward(x)),
        "cat" => other().and_then(|o| Tensor::cat(&[x, o], 1)),
        "mul" => other().and_then(|o| x * o),
        "add" => other().and_then(|o| x + o),
        "flatten" => x.flatten(1),
        "softmax_dim1" => Softmax::load(vb, &1).and_then(|m| m.forward(x)),
        "softmax_last" => x.affine(4.0, 0.0).and_then(|a| a.softmax(-1)),
        "softmax_mid" => x.softmax(2),
        "layer_norm_last" => LayerNorm::load(vb, &LayerNormConfig::new(&[24])).and_then(|m| m.forward(x)),
        "layer_norm_convnext_nhwc" => LayerNorm::load(vb, &LayerNormConfig::new(&[8]).eps(1e-6)).and_then(|m| m.forward(x)),
        "layer_norm_2d_torchvision" => LayerNorm2d::load(vb, &LayerNormConfig::new(&[8]).eps(1e-6)).and_then(|m| m.forward(x)),
        "layer_norm_two_dims" => LayerNorm::load(vb, &LayerNormConfig::new(&[6, 7]).eps(1e-3)).and_then(|m| m.forward(x)),
        "layer_norm_no_affine" => LayerNorm::load(vb, &LayerNormConfig::new(&[10]).elementwise_affine(false)).and_then(|m| m.forward(x)),
        "mean_hw" => x.mean(&[2, 3], false),
        "mean_hw_keepdim" => x.mean(&[3, 2], true),
        "mean_last" => x.mean(&[x.shape().len() - 1], false),
        "mean_dim1_keepdim" => x.mean(&[1], true),
        "matmul_bmm" => other().and_then(|o| x.bmm(o)),
        "matmul_broadcast" => other().and_then(|o| x.matmul(o)),
        "matmul_weight" => vb.get(&[9, 4], "weight").and_then(|w| x.matmul_weight(case, &w)),
        "matmul_weight_batched" => vb.get(&[3, 6, 4], "weight").and_then(|w| x.matmul_weight(case, &w)),
        "linear_rank3" => Linear::load(vb, &LinearConfig::new(12, 7)).and_then(|m| m.forward(x)),
        "linear_rank4_nobias" => Linear::load(vb, &LinearConfig { bias: false, ..LinearConfig::new(8, 3) }).and_then(|m| m.forward(x)),
        "reshape_infer" => x.reshape(&[3, 2, -1, 5]),
        "reshape_view_flat" => x.view(&[2, -1]),
        "reshape_channel_shuffle" => x.view(&[2, 3, 2, 5, 7]).and_then(|v| v.transpose(1, 2)?.contiguous()?.view(&[2, 6, 5, 7])),
        "permute_nhwc" => x.permute(&[0, 2, 3, 1]),
        "permute_rank5" => x.permute(&[0, 3, 1, 4, 2]),
        "permute_transpose_last" => x.transpose(-1, -2),
        "flatten_start2" => x.flatten(2),
        "flatten_range_mid" => x.flatten_range(1, 2),
        "slice_narrow" => x.narrow(2, 1, 3),
        "slice_narrow_last" => x.narrow(-1, 2, 4),
        "slice_chunk_reversed" => x.chunk(3, 3).and_then(|c| Tensor::cat(&c.iter().rev().collect::<Vec<_>>(), 3)),
        "slice_chunk_fewer" => x.chunk(4, 1).and_then(|c| Tensor::cat(&c.iter().rev().collect::<Vec<_>>(), 1)),
        "slice_split_sizes" => x.split(&[2, 4, 1], 1).and_then(|c| Tensor::cat(&c.iter().rev().collect::<Vec<_>>(), 1)),
        "cat_dim2" => other().and_then(|o| Tensor::cat(&[x, o], 2)),
        "cat_last" => other().and_then(|o| Tensor::cat(&[x, o], 3)),
        "cat_rank2" => other().and_then(|o| Tensor::cat(&[x, o], 1)),
        "pad_constant" => x.pad(&[1, 2, 0, 3], 0.5),
        "pad_channels" => x.pad(&[1, 0, 0, 2, 2, 1], -2.0),
        "pad_zero2d" => kiln::ZeroPad2d::load(vb, &[2, 1, 1, 0]).and_then(|m| m.forward(x)),
        "pad_constant2d" => {
            kiln::ConstantPad2d::load(vb, &kiln::ConstantPad2dConfig { padding: [1, 1, 2, 2], value: -1.5 }).and_then(|m| m.forward(x))
        }
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
        "roll_swin_shift" => x.roll(&[-3, -3], &[1, 2]),
        "roll_mixed" => x.roll(&[11, -2], &[3, 1]),
        "attention_vit" => other().and_then(|o| {
            let (k, v) = kv(o)?;
            x.attention(&k, &v, None, None)
        }),
        "attention_swin_bias" => other().and_then(|o| {
            let (k, v) = kv(o)?;
            x.attention_weight(case, &k, &v, &vb.get(&[4, 3, 7, 7], "bias")?, Some(0.3))
        }),
        "attention_bias_rows" => other().and_then(|o| {
            let (k, v) = kv(o)?;
            x.attention_weight(case, &k, &v, &vb.get(&[5, 1], "bias")?, None)
        }),
        "qkv_attention_vit" => x.qkv_attention(3, None, None),
        "qkv_attention_swin_bias" => vb.get(&[4, 3, 7, 7], "bias").and_then(|b| x.qkv_attention_weight(case, 3, &b, Some(0.3))),
        "qkv_attention_head_bias" => vb.get(&[2, 5, 5], "bias").and_then(|b| x.qkv_attention_weight(case, 2, &b, None)),
        "fake_quantize_per_tensor_affine" => x.fake_quantize(QuantParams::int8(0.02)),
        "fake_quantize_per_tensor_zero_point" => x.fake_quantize(QuantParams::int8(0.03).zero_points(vec![10]).range(0, 255)),
        "fake_quantize_per_channel_affine" => x.fake_quantize(QuantParams::int8(1.0).per_channel(1, vec![0.01, 0.02, 0.05])),
        "fake_quantize_per_channel_axis0" => {
            x.fake_quantize(QuantParams::int8(1.0).range(-127, 127).per_channel(0, vec![0.004, 0.01, 0.02, 0.03]))
        }
        "fake_quantize_fp8_e4m3" => x.fake_quantize(QuantParams::fp8(0.005)),
        "fake_quantize_fp8_per_channel" => x.fake_quantize(QuantParams::fp8(1.0).per_channel(1, vec![0.001, 0.01, 0.1])),
        "quantize_int8_per_tensor" => x.quantize(QuantParams::int8(0.02)),
        "quantize_int8_per_channel" => x.quantize(QuantParams::int8(1.0).per_channel(1, vec![0.01, 0.02, 0.05])),
        "quantize_fp8" => x.quantize(QuantParams::fp8(0.02)),
        "dequantize_int8_per_tensor" => x.quantize(QuantParams::int8(0.03125)).and_then(|q| q.dequantize(QuantParams::int8(0.03125))),
        "dequantize_int8_per_channel" => {
            let p = QuantParams::int8(1.0).per_channel(1, vec![0.01, 0.02, 0.05]);
            x.quantize(p.clone()).and_then(|q| q.dequantize(p))
        }
        "dequantize_fp8" => x.quantize(QuantParams::fp8(0.03125)).and_then(|q| q.dequantize(QuantParams::fp8(0.03125))),
        _ => return None,
    })
}

/// Keys and values of the attention cases: `other[:, 0]` and `other[:, 1]`.
fn kv(o: &Tensor) -> Result<(Tensor, Tensor)> {
    let dims: Vec<isize> = std::iter::once(o.shape()[0]).chain(o.shape()[2..].iter().copied()).map(|d| d as isize).collect();
    Ok((o.narrow(1, 0, 1)?.reshape(&dims)?, o.narrow(1, 1, 1)?.reshape(&dims)?))
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

/// No op can be half-added: every built-in op (one of each variant of every family, from
/// `kiln::ops::builtin_ops`) has at least one PyTorch fixture case named after it (`<op>` or
/// `<op>_<variant>`), which `every_op_fixture_matches_pytorch` runs through its CPU reference.
/// Its shape rule, CPU reference and converter are methods of `OpDef`, which the compiler asks
/// every family to implement for every variant.
#[test]
fn every_builtin_op_has_a_pytorch_fixture() {
    let tensors = read_safetensors(fixture()).expect("op fixtures");
    let cases: Vec<&str> = tensors.keys().filter_map(|k| k.strip_suffix(".output")).collect();
    let names: std::collections::BTreeSet<String> = kiln::ops::builtin_ops().iter().map(|op| op.name().to_string()).collect();
    println!("{} built-in ops: {names:?}", names.len());
    let missing: Vec<&String> = names.iter().filter(|n| !cases.iter().any(|c| c == n || c.starts_with(&format!("{n}_")))).collect();
    assert!(missing.is_empty(), "built-in ops without a PyTorch fixture in ops.reference.safetensors: {missing:?}");
}
