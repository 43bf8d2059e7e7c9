//! The CPU executor's ops against naive direct implementations written here, on small random
//! shapes covering the non-default settings; and the executor's binding and error behaviour.

use kiln::compare;
use kiln::{
    plugin::{Activation, Binary, ConvAttrs, CustomCall, Gemm, Norm, Op, Pool, PoolAttrs, ShapeOp, Unary},
    Graph, HostTensor,
};
use kiln::{ByteTensor, DType, Error, HostInput};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Fresh pseudo-random values in [-1, 1): a new stream per call and per process run.
fn rand(shape: &[usize]) -> HostTensor {
    kiln::dev::uniform_tensor(shape, kiln::dev::fresh_seed())
}

/// Positive values in [0.5, 1.5) (variances).
fn rand_pos(shape: &[usize]) -> HostTensor {
    let mut t = rand(shape);
    t.data.iter_mut().for_each(|v| *v = 1.0 + *v * 0.5);
    t
}

/// A graph of one `op` over graph input `x` (and `others` as inputs named `in1`, `in2`...) plus
/// weight constants, run on the CPU.
fn run_op(op: Op, x: &HostTensor, others: &[&HostTensor], weights: &[&HostTensor]) -> HostTensor {
    let mut g = Graph::default();
    let mut ids = vec![];
    let mut bindings = vec![];
    let names: Vec<String> = (0..=others.len()).map(|i| if i == 0 { "x".to_string() } else { format!("in{i}") }).collect();
    for (name, t) in names.iter().zip(std::iter::once(x).chain(others.iter().copied())) {
        let id = g.push_unchecked(Op::Input { name: name.clone() }, vec![], t.shape.clone(), name.clone());
        g.inputs.push(id);
        ids.push(id);
        bindings.push((name.as_str(), t));
    }
    for (i, w) in weights.iter().enumerate() {
        ids.push(g.weight(&format!("op.w{i}"), Arc::new((*w).clone())));
    }
    let y = g.push(op, ids, "op".into()).expect("shape rule accepts the test case");
    g.mark_output("y", y);
    kiln::run_cpu(&g, &bindings).expect("cpu run").remove("y").expect("output y")
}

fn assert_close(name: &str, got: &HostTensor, want: &HostTensor) {
    let c = compare(name, got, want);
    println!("{c}");
    assert!(c.passes(1e-5), "{c}");
}

fn at(t: &HostTensor, idx: [usize; 4]) -> f32 {
    let s = &t.shape;
    t.data[((idx[0] * s[1] + idx[1]) * s[2] + idx[2]) * s[3] + idx[3]]
}

// ---- naive references --------------------------------------------------------------------------

fn naive_conv2d(x: &HostTensor, w: &HostTensor, b: Option<&HostTensor>, r: Option<&HostTensor>, a: &ConvAttrs) -> HostTensor {
    let [n, _, h, wd] = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
    let [cout, cpg, kh, kw] = [w.shape[0], w.shape[1], w.shape[2], w.shape[3]];
    let oh = (h + 2 * a.padding[0] - a.dilation[0] * (kh - 1) - 1) / a.stride[0] + 1;
    let ow = (wd + 2 * a.padding[1] - a.dilation[1] * (kw - 1) - 1) / a.stride[1] + 1;
    let mut out = HostTensor::zeros(vec![n, cout, oh, ow]);
    let mut i = 0;
    for b_ in 0..n {
        for co in 0..cout {
            let group = co / (cout / a.groups);
            for oy in 0..oh {
                for ox in 0..ow {
                    let mut sum = b.map_or(0.0, |b| b.data[co] as f64);
                    for ci in 0..cpg {
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let iy = (oy * a.stride[0] + ky * a.dilation[0]) as isize - a.padding[0] as isize;
                                let ix = (ox * a.stride[1] + kx * a.dilation[1]) as isize - a.padding[1] as isize;
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < wd {
                                    let xv = at(x, [b_, group * cpg + ci, iy as usize, ix as usize]);
                                    sum += xv as f64 * at(w, [co, ci, ky, kx]) as f64;
                                }
                            }
                        }
                    }
                    if let Some(r) = r {
                        sum += r.data[i] as f64;
                    }
                    if a.act == Activation::Relu {
                        sum = sum.max(0.0);
                    }
                    out.data[i] = sum as f32;
                    i += 1;
                }
            }
        }
    }
    out
}

/// The transposed convolution as the scatter it is defined by: every input pixel adds its kernel,
/// scaled, into the output.
fn naive_conv_transpose2d(x: &HostTensor, w: &HostTensor, b: Option<&HostTensor>, a: &ConvAttrs) -> HostTensor {
    let [n, cin, h, wd] = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
    let [_, cout_g, kh, kw] = [w.shape[0], w.shape[1], w.shape[2], w.shape[3]];
    let cout = cout_g * a.groups;
    let oh = (h - 1) * a.stride[0] + a.dilation[0] * (kh - 1) + a.output_padding[0] + 1 - 2 * a.padding[0];
    let ow = (wd - 1) * a.stride[1] + a.dilation[1] * (kw - 1) + a.output_padding[1] + 1 - 2 * a.padding[1];
    let mut acc = vec![0.0f64; n * cout * oh * ow];
    for b_ in 0..n {
        for ci in 0..cin {
            let group = ci / (cin / a.groups);
            for iy in 0..h {
                for ix in 0..wd {
                    let xv = at(x, [b_, ci, iy, ix]) as f64;
                    for j in 0..cout_g {
                        let co = group * cout_g + j;
                        for ky in 0..kh {
                            for kx in 0..kw {
                                let oy = (iy * a.stride[0] + ky * a.dilation[0]) as isize - a.padding[0] as isize;
                                let ox = (ix * a.stride[1] + kx * a.dilation[1]) as isize - a.padding[1] as isize;
                                if oy >= 0 && ox >= 0 && (oy as usize) < oh && (ox as usize) < ow {
                                    acc[((b_ * cout + co) * oh + oy as usize) * ow + ox as usize] += xv * at(w, [ci, j, ky, kx]) as f64;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    let plane = oh * ow;
    let data = acc.iter().enumerate().map(|(i, v)| (v + b.map_or(0.0, |b| b.data[(i / plane) % cout] as f64)) as f32).collect();
    HostTensor::new(vec![n, cout, oh, ow], data)
}

/// Pooling by enumerating each window's kernel taps; `ceil` decides the output count as PyTorch
/// documents it (a window must start inside the input or the left padding).
fn naive_pool(x: &HostTensor, a: &PoolAttrs, max: bool) -> HostTensor {
    let [n, c, h, w] = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
    let count = |len: usize, i: usize| {
        let span = (len + 2 * a.padding[i] - a.kernel[i]) as f64 / a.stride[i] as f64;
        let mut o = if a.ceil_mode { span.ceil() } else { span.floor() } as usize + 1;
        if a.ceil_mode && (o - 1) * a.stride[i] >= len + a.padding[i] {
            o -= 1;
        }
        o
    };
    let (oh, ow) = (count(h, 0), count(w, 1));
    let mut out = HostTensor::zeros(vec![n, c, oh, ow]);
    let mut i = 0;
    for b in 0..n {
        for ch in 0..c {
            for oy in 0..oh {
                for ox in 0..ow {
                    let (mut best, mut sum, mut in_padded, mut in_input) = (f32::NEG_INFINITY, 0.0f64, 0usize, 0usize);
                    for ky in 0..a.kernel[0] {
                        for kx in 0..a.kernel[1] {
                            let iy = (oy * a.stride[0] + ky) as isize - a.padding[0] as isize;
                            let ix = (ox * a.stride[1] + kx) as isize - a.padding[1] as isize;
                            // Taps past the right/bottom padding (ceil_mode's overhang) count nowhere.
                            if iy < (h + a.padding[0]) as isize && ix < (w + a.padding[1]) as isize {
                                in_padded += 1;
                            }
                            if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                                let v = at(x, [b, ch, iy as usize, ix as usize]);
                                best = best.max(v);
                                sum += v as f64;
                                in_input += 1;
                            }
                        }
                    }
                    out.data[i] = if max { best } else { (sum / if a.count_include_pad { in_padded } else { in_input } as f64) as f32 };
                    i += 1;
                }
            }
        }
    }
    out
}

fn naive_adaptive_avg(x: &HostTensor, o: [usize; 2]) -> HostTensor {
    let [n, c, h, w] = [x.shape[0], x.shape[1], x.shape[2], x.shape[3]];
    let mut out = HostTensor::zeros(vec![n, c, o[0], o[1]]);
    let mut i = 0;
    for b in 0..n {
        for ch in 0..c {
            for oy in 0..o[0] {
                for ox in 0..o[1] {
                    let y0 = (oy as f64 * h as f64 / o[0] as f64).floor() as usize;
                    let y1 = ((oy + 1) as f64 * h as f64 / o[0] as f64).ceil() as usize;
                    let x0 = (ox as f64 * w as f64 / o[1] as f64).floor() as usize;
                    let x1 = ((ox + 1) as f64 * w as f64 / o[1] as f64).ceil() as usize;
                    let mut sum = 0.0f64;
                    for iy in y0..y1 {
                        for ix in x0..x1 {
                            sum += at(x, [b, ch, iy, ix]) as f64;
                        }
                    }
                    out.data[i] = (sum / ((y1 - y0) * (x1 - x0)) as f64) as f32;
                    i += 1;
                }
            }
        }
    }
    out
}

// ---- convolutions -------------------------------------------------------------------------------

fn conv_case(x: [usize; 4], cout: usize, k: [usize; 2], a: ConvAttrs) {
    let xt = rand(&x);
    let w = rand(&[cout, x[1] / a.groups, k[0], k[1]]);
    let b = rand(&[cout]);
    let want_shape = {
        let oh = (x[2] + 2 * a.padding[0] - a.dilation[0] * (k[0] - 1) - 1) / a.stride[0] + 1;
        let ow = (x[3] + 2 * a.padding[1] - a.dilation[1] * (k[1] - 1) - 1) / a.stride[1] + 1;
        vec![x[0], cout, oh, ow]
    };
    let r = rand(&want_shape);
    let want = naive_conv2d(&xt, &w, a.bias.then_some(&b), a.residual.then_some(&r), &a);
    let others: Vec<&HostTensor> = if a.residual { vec![&r] } else { vec![] };
    // Graph order is x, weight, bias?, residual?: the residual is a graph input, so push by hand.
    let mut g = Graph::default();
    let xi = g.push_unchecked(Op::Input { name: "x".into() }, vec![], x.to_vec(), "x".into());
    g.inputs.push(xi);
    let mut ids = vec![xi, g.weight("conv.weight", Arc::new(w.clone()))];
    if a.bias {
        ids.push(g.weight("conv.bias", Arc::new(b.clone())));
    }
    let mut bindings = vec![("x", &xt)];
    if let Some(r) = others.first() {
        let ri = g.push_unchecked(Op::Input { name: "r".into() }, vec![], r.shape.clone(), "r".into());
        g.inputs.push(ri);
        ids.push(ri);
        bindings.push(("r", r));
    }
    let y = g.push(Op::Conv(a), ids, "conv".into()).expect("conv shape");
    g.mark_output("y", y);
    let got = kiln::run_cpu(&g, &bindings).expect("cpu run").remove("y").expect("y");
    assert_close(&format!("conv2d {x:?} k{k:?} {a:?}"), &got, &want);
}

#[test]
fn conv2d_matches_direct_loops() {
    let base = ConvAttrs::default();
    conv_case([1, 3, 9, 9], 4, [3, 3], base);
    conv_case([2, 4, 11, 7], 6, [3, 3], ConvAttrs { stride: [2, 2], padding: [1, 1], bias: true, ..base });
    conv_case([1, 4, 12, 10], 4, [3, 3], ConvAttrs { padding: [2, 2], dilation: [2, 2], bias: true, ..base });
    conv_case([2, 6, 8, 9], 9, [3, 3], ConvAttrs { groups: 3, padding: [1, 1], bias: true, ..base });
    // Depthwise, asymmetric stride/padding/dilation, a non-square kernel.
    conv_case([1, 5, 13, 8], 5, [3, 2], ConvAttrs { groups: 5, stride: [2, 1], padding: [1, 0], dilation: [1, 2], ..base });
    // 1×1 convolutions: the direct GEMM path and the strided (gathering) path.
    conv_case([3, 8, 5, 6], 16, [1, 1], ConvAttrs { bias: true, ..base });
    conv_case([2, 8, 7, 7], 4, [1, 1], ConvAttrs { stride: [2, 2], ..base });
    conv_case([1, 3, 15, 15], 8, [7, 7], ConvAttrs { stride: [2, 2], padding: [3, 3], ..base });
}

#[test]
fn fused_conv_adds_residual_before_relu() {
    let base = ConvAttrs::default();
    conv_case([2, 4, 6, 5], 4, [3, 3], ConvAttrs { padding: [1, 1], bias: true, residual: true, act: Activation::Relu, ..base });
    conv_case([1, 4, 6, 6], 8, [1, 1], ConvAttrs { residual: true, ..base });
    conv_case([1, 4, 6, 6], 8, [3, 3], ConvAttrs { bias: true, act: Activation::Relu, stride: [2, 2], ..base });
}

fn deconv_case(x: [usize; 4], cout: usize, k: usize, a: ConvAttrs) {
    let xt = rand(&x);
    let w = rand(&[x[1], cout / a.groups, k, k]);
    let b = rand(&[cout]);
    let weights: Vec<&HostTensor> = if a.bias { vec![&w, &b] } else { vec![&w] };
    let got = run_op(Op::Conv(ConvAttrs { transposed: true, ..a }), &xt, &[], &weights);
    let want = naive_conv_transpose2d(&xt, &w, a.bias.then_some(&b), &a);
    assert_close(&format!("conv_transpose2d {x:?} k{k} {a:?}"), &got, &want);
}

#[test]
fn conv_transpose2d_matches_scatter() {
    let base = ConvAttrs::default();
    // CenterNet's upsampler layer: k=4, s=2, p=1.
    deconv_case([1, 8, 5, 5], 6, 4, ConvAttrs { stride: [2, 2], padding: [1, 1], ..base });
    deconv_case([2, 4, 4, 6], 4, 3, ConvAttrs { stride: [2, 2], padding: [1, 1], output_padding: [1, 1], bias: true, ..base });
    deconv_case([1, 6, 5, 4], 9, 3, ConvAttrs { groups: 3, stride: [2, 2], bias: true, ..base });
    deconv_case([2, 4, 5, 5], 4, 3, ConvAttrs { dilation: [2, 2], padding: [2, 2], output_padding: [1, 1], stride: [1, 1], ..base });
    deconv_case([1, 3, 3, 7], 2, 2, ConvAttrs { stride: [3, 3], output_padding: [2, 2], bias: true, ..base });
}

#[test]
fn fused_conv_transpose_applies_residual_and_relu() {
    let a = ConvAttrs { stride: [2, 2], padding: [1, 1], bias: true, residual: true, act: Activation::Relu, ..Default::default() };
    let (x, w, b) = (rand(&[1, 4, 3, 3]), rand(&[4, 3, 4, 4]), rand(&[3]));
    let plain = ConvAttrs { residual: false, act: Activation::None, ..a };
    let mut want = naive_conv_transpose2d(&x, &w, Some(&b), &plain);
    let r = rand(&want.shape);
    want.data.iter_mut().zip(&r.data).for_each(|(v, r)| *v = (*v + r).max(0.0));
    let got = kiln::dev::ops::conv_transpose2d_cpu(&a, &[&x, &w, &b, &r]).expect("fused deconv");
    assert_close("fused conv_transpose2d", &got, &want);
    let wrong = rand(&[1, 3, 5, 5]);
    let err = kiln::dev::ops::conv_transpose2d_cpu(&a, &[&x, &w, &b, &wrong]).expect_err("residual shape is checked");
    assert!(err.to_string().contains("residual"), "{err}");
}

// ---- pooling ------------------------------------------------------------------------------------

fn pool_case(x: [usize; 4], a: PoolAttrs) {
    let xt = rand(&x);
    for max in [true, false] {
        let op = if max { Op::Pool(Pool::Max(a)) } else { Op::Pool(Pool::Avg(a)) };
        let got = run_op(op, &xt, &[], &[]);
        let want = naive_pool(&xt, &a, max);
        assert_close(&format!("{} {x:?} {a:?}", if max { "max_pool2d" } else { "avg_pool2d" }), &got, &want);
    }
}

#[test]
fn pools_match_window_enumeration() {
    let p = |k: usize, s: usize, pad: usize, ceil_mode: bool, count_include_pad: bool| PoolAttrs {
        kernel: [k; 2],
        stride: [s; 2],
        padding: [pad; 2],
        ceil_mode,
        count_include_pad,
    };
    pool_case([1, 2, 8, 8], p(2, 2, 0, false, true));
    // ResNet's stem pool.
    pool_case([2, 3, 11, 9], p(3, 2, 1, false, true));
    pool_case([1, 2, 6, 6], p(3, 2, 0, true, true));
    pool_case([2, 2, 7, 10], p(3, 2, 1, true, true));
    pool_case([1, 3, 7, 10], p(3, 2, 1, true, false));
    pool_case([1, 2, 9, 5], p(2, 3, 1, true, false));
    pool_case([1, 1, 5, 5], p(3, 1, 1, false, false));
    pool_case([1, 2, 6, 6], PoolAttrs { kernel: [3, 2], stride: [2, 1], padding: [1, 1], ceil_mode: true, count_include_pad: true });
}

#[test]
fn ceil_mode_matches_pytorch_on_known_cases() {
    // From torch.nn.AvgPool2d(3, 2, ceil_mode=True) on a 6×6 ones input: 3×3 output; the last
    // window overhangs by one column and divides by 2·3 = 6 taps, so ones average to 1.
    let ones = HostTensor::new(vec![1, 1, 6, 6], vec![1.0; 36]);
    let a = PoolAttrs { kernel: [3, 3], stride: [2, 2], padding: [0, 0], ceil_mode: true, count_include_pad: true };
    let y = run_op(Op::Pool(Pool::Avg(a)), &ones, &[], &[]);
    assert_eq!(y.shape, vec![1, 1, 3, 3]);
    assert!(y.data.iter().all(|&v| (v - 1.0).abs() < 1e-6), "{:?}", y.data);
    // With padding 1 and count_include_pad the corner window counts its padded taps: 4 of 9 are
    // input, so ones average to 4/9 (PyTorch: AvgPool2d(3, 2, 1)(ones(1,1,5,5))[0,0,0,0] = 0.4444).
    let ones5 = HostTensor::new(vec![1, 1, 5, 5], vec![1.0; 25]);
    let a = PoolAttrs { padding: [1, 1], ceil_mode: false, ..a };
    let y = run_op(Op::Pool(Pool::Avg(a)), &ones5, &[], &[]);
    assert_eq!(y.shape, vec![1, 1, 3, 3]);
    assert!((y.data[0] - 4.0 / 9.0).abs() < 1e-6 && (y.data[4] - 1.0).abs() < 1e-6, "{:?}", y.data);
    // ceil_mode drops a window that would start in the right padding: 5 wide, k=2, s=2, p=1 → 3, not 4.
    let a = PoolAttrs { kernel: [2, 2], stride: [2, 2], padding: [1, 1], ceil_mode: true, count_include_pad: true };
    assert_eq!(run_op(Op::Pool(Pool::Max(a)), &ones5, &[], &[]).shape, vec![1, 1, 3, 3]);
}

#[test]
fn max_pool_pads_with_minus_infinity() {
    let mut x = rand(&[1, 1, 4, 4]);
    x.data.iter_mut().for_each(|v| *v = -1.0 - v.abs());
    let a = PoolAttrs { kernel: [3, 3], stride: [2, 2], padding: [1, 1], ceil_mode: false, count_include_pad: true };
    let y = run_op(Op::Pool(Pool::Max(a)), &x, &[], &[]);
    assert!(y.data.iter().all(|&v| v < -1.0), "padding leaked into the max: {:?}", y.data);
}

#[test]
fn adaptive_avg_pool_matches_floor_ceil_bins() {
    for (x, o) in [([2, 3, 7, 7], [3, 3]), ([1, 2, 10, 5], [3, 3]), ([1, 4, 7, 7], [1, 1]), ([1, 2, 4, 6], [5, 4]), ([1, 1, 8, 6], [3, 2])]
    {
        let xt = rand(&x);
        let got = run_op(Op::Pool(Pool::AdaptiveAvg { output: o }), &xt, &[], &[]);
        assert_close(&format!("adaptive_avg_pool2d {x:?} -> {o:?}"), &got, &naive_adaptive_avg(&xt, o));
    }
}

// ---- the rest -----------------------------------------------------------------------------------

#[test]
fn batchnorm_linear_and_elementwise() {
    let x = rand(&[2, 3, 4, 5]);
    let (g, b, m, v) = (rand_pos(&[3]), rand(&[3]), rand(&[3]), rand_pos(&[3]));
    let got = run_op(Op::Norm(Norm::BatchNorm2d { eps: 1e-5 }), &x, &[], &[&g, &b, &m, &v]);
    let want: Vec<f32> = x
        .data
        .iter()
        .enumerate()
        .map(|(i, &xv)| {
            let c = (i / 20) % 3;
            ((xv as f64 - m.data[c] as f64) / (v.data[c] as f64 + 1e-5).sqrt() * g.data[c] as f64 + b.data[c] as f64) as f32
        })
        .collect();
    assert_close("batch_norm2d", &got, &HostTensor::new(x.shape.clone(), want));

    let (xl, w, bias) = (rand(&[3, 7]), rand(&[5, 7]), rand(&[5]));
    let want: Vec<f32> = (0..15)
        .map(|i| {
            let (n, o) = (i / 5, i % 5);
            ((0..7).map(|k| xl.data[n * 7 + k] as f64 * w.data[o * 7 + k] as f64).sum::<f64>() + bias.data[o] as f64) as f32
        })
        .collect();
    assert_close(
        "linear",
        &run_op(Op::Gemm(Gemm::Linear { bias: true, residual: false }), &xl, &[], &[&w, &bias]),
        &HostTensor::new(vec![3, 5], want),
    );
    let want_nb: Vec<f32> =
        (0..15).map(|i| (0..7).map(|k| xl.data[(i / 5) * 7 + k] as f64 * w.data[(i % 5) * 7 + k] as f64).sum::<f64>() as f32).collect();
    assert_close(
        "linear no bias",
        &run_op(Op::Gemm(Gemm::Linear { bias: false, residual: false }), &xl, &[], &[&w]),
        &HostTensor::new(vec![3, 5], want_nb),
    );

    let map = |f: &dyn Fn(f32) -> f32| HostTensor::new(x.shape.clone(), x.data.iter().map(|&v| f(v)).collect());
    assert_close("relu", &run_op(Op::Unary(Unary::Relu), &x, &[], &[]), &map(&|v| if v > 0.0 { v } else { 0.0 }));
    assert_close(
        "leaky_relu",
        &run_op(Op::Unary(Unary::LeakyRelu { slope: 0.1 }), &x, &[], &[]),
        &map(&|v| if v > 0.0 { v } else { 0.1 * v }),
    );
    assert_close("sigmoid", &run_op(Op::Unary(Unary::Sigmoid), &x, &[], &[]), &map(&|v| (1.0 / (1.0 + (-v as f64).exp())) as f32));
    let y = rand(&x.shape);
    let zip = |f: &dyn Fn(f32, f32) -> f32| HostTensor::new(x.shape.clone(), x.data.iter().zip(&y.data).map(|(&a, &b)| f(a, b)).collect());
    assert_close("add", &run_op(Op::Binary(Binary::Add), &x, &[&y], &[]), &zip(&|a, b| a + b));
    assert_close("mul", &run_op(Op::Binary(Binary::Mul), &x, &[&y], &[]), &zip(&|a, b| a * b));
}

#[test]
fn flatten_and_cat() {
    let x = rand(&[2, 3, 4, 5]);
    let f = run_op(Op::Shape(ShapeOp::Flatten { start: 1 }), &x, &[], &[]);
    assert_eq!((f.shape.as_slice(), &f.data), ([2usize, 60].as_slice(), &x.data));
    let f2 = run_op(Op::Shape(ShapeOp::Flatten { start: 2 }), &x, &[], &[]);
    assert_eq!(f2.shape, vec![2, 3, 20]);

    let (a, b) = (rand(&[2, 2, 3, 3]), rand(&[2, 5, 3, 3]));
    let got = run_op(Op::Shape(ShapeOp::Cat { dim: 1 }), &a, &[&b], &[]);
    assert_eq!(got.shape, vec![2, 7, 3, 3]);
    for n in 0..2 {
        for c in 0..7 {
            for i in 0..9 {
                let want = if c < 2 { a.data[(n * 2 + c) * 9 + i] } else { b.data[(n * 5 + c - 2) * 9 + i] };
                assert_eq!(got.data[(n * 7 + c) * 9 + i], want);
            }
        }
    }
    let c = rand(&[2, 2, 3, 3]);
    let got = run_op(Op::Shape(ShapeOp::Cat { dim: 0 }), &a, &[&c], &[]);
    assert_eq!(got.data, [a.data.clone(), c.data.clone()].concat());
    let (p, q) = (rand(&[1, 2, 3, 1]), rand(&[1, 2, 3, 2]));
    let got = run_op(Op::Shape(ShapeOp::Cat { dim: 3 }), &p, &[&q], &[]);
    assert_eq!(got.shape, vec![1, 2, 3, 3]);
    for row in 0..6 {
        assert_eq!(got.data[row * 3..row * 3 + 3], [p.data[row], q.data[row * 2], q.data[row * 2 + 1]]);
    }
}

// ---- the executor --------------------------------------------------------------------------------

/// A small traced network: conv → BN → ReLU → maxpool → adaptive pool → flatten → linear.
fn small_net(batch: usize) -> Graph {
    small_net_typed(batch, kiln::DType::F32)
}

/// `small_net` with its input `x` declared `dtype`.
fn small_net_typed(batch: usize, dtype: kiln::DType) -> Graph {
    use kiln::{nn::Pool2dConfig, Tracer, VarBuilder};
    use kiln::{
        nn::{AdaptiveAvgPool2d, BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, Linear, LinearConfig, MaxPool2d},
        Forward, Module,
    };
    let vb = VarBuilder::seeded();
    let conv = Conv2d::load(vb.pp("conv"), &Conv2dConfig::new(3, 8, 3).padding(1).stride(2)).expect("conv");
    let bn = BatchNorm2d::load(vb.pp("bn"), &BatchNorm2dConfig::new(8)).expect("bn");
    let pool = MaxPool2d::load(vb.pp("pool"), &Pool2dConfig::new(3).stride(2).padding(1)).expect("pool");
    let gap = AdaptiveAvgPool2d::load(vb.pp("gap"), &[1, 1]).expect("gap");
    let fc = Linear::load(vb.pp("fc"), &LinearConfig::new(8, 5)).expect("fc");
    let t = Tracer::new();
    let x = t.input_typed("x", &[batch, 3, 16, 12], dtype);
    let y = conv.forward(&x).and_then(|y| bn.forward(&y)).and_then(|y| y.relu()).expect("trace");
    let y = pool.forward(&y).and_then(|y| gap.forward(&y)).and_then(|y| y.flatten(1)).and_then(|y| fc.forward(&y)).expect("trace");
    t.output("logits", &y);
    t.graph()
}

#[test]
fn batch_may_differ_from_the_traced_one() {
    let g = small_net(1);
    let x = rand(&[3, 3, 16, 12]);
    let out = kiln::run_cpu(&g, &[("x", &x)]).expect("batch 3 on a batch-1 trace");
    assert_eq!(out["logits"].shape, vec![3, 5]);
    // Each image's row equals that image run alone.
    for i in 0..3 {
        let one = HostTensor::new(vec![1, 3, 16, 12], x.data[i * 576..(i + 1) * 576].to_vec());
        let alone = kiln::run_cpu(&g, &[("x", &one)]).expect("batch 1")["logits"].clone();
        let row = HostTensor::new(vec![1, 5], out["logits"].data[i * 5..(i + 1) * 5].to_vec());
        assert_close(&format!("image {i}"), &row, &alone);
    }
}

#[test]
fn bad_bindings_are_typed_errors_naming_the_input() {
    let g = small_net(2);
    let x = rand(&[2, 3, 16, 12]);
    let binding = |r: kiln::Result<BTreeMap<String, HostTensor>>| match r {
        Err(Error::Binding { name, reason }) => (name, reason),
        other => panic!("expected a binding error, got {other:?}"),
    };
    let (name, reason) = binding(kiln::run_cpu::<&HostTensor>(&g, &[]));
    assert_eq!((name.as_str(), reason.as_str()), ("x", "not given"));
    let (name, reason) = binding(kiln::run_cpu(&g, &[("x", &x), ("image", &x)]));
    assert_eq!(name, "image");
    assert!(reason.contains("no such input"), "{reason}");
    let (name, _) = binding(kiln::run_cpu(&g, &[("x", &x), ("x", &x)]));
    assert_eq!(name, "x");
    let (_, reason) = binding(kiln::run_cpu(&g, &[("x", &rand(&[2, 4, 16, 12]))]));
    assert!(reason.contains("[2, 3, 16, 12]"), "{reason}");
    binding(kiln::run_cpu(&g, &[("x", &rand(&[2, 3, 12, 16]))]));
    binding(kiln::run_cpu(&g, &[("x", &HostTensor { shape: vec![0, 3, 16, 12], data: vec![] })]));
    binding(kiln::run_cpu(&g, &[("x", &HostTensor { shape: vec![2, 3, 16, 12], data: vec![0.5; 7] })]));
}

/// Random bytes, and the same values as f32.
fn rand_bytes(shape: &[usize]) -> (ByteTensor, HostTensor) {
    let values = rand(shape);
    let bytes = ByteTensor::new(shape.to_vec(), values.data.iter().map(|v| ((v + 1.0) * 128.0) as u8).collect()).expect("bytes");
    let values = bytes.to_f32();
    (bytes, values)
}

#[test]
fn a_u8_input_takes_bytes_or_byte_valued_f32_and_computes_in_f32() {
    let (g8, g32) = (small_net_typed(2, DType::U8), small_net(2));
    assert_eq!(g8.input_dtype("x"), Some(DType::U8));
    let (bytes, values) = rand_bytes(&[2, 3, 16, 12]);
    let want = kiln::run_cpu(&g32, &[("x", &values)]).expect("f32 input");
    // Bytes are their f32 values: the outputs are the f32 graph's, bit for bit.
    assert_eq!(kiln::run_cpu(&g8, &[("x", &bytes)]).expect("bytes"), want);
    assert_eq!(kiln::run_cpu(&g8, &[("x", &values)]).expect("byte-valued f32"), want);
    assert_eq!(kiln::run_cpu(&g8, &[("x", HostInput::from(&bytes))]).expect("a HostInput list"), want);
    // A batch other than the traced one, as for f32 inputs.
    let (three, values3) = rand_bytes(&[3, 3, 16, 12]);
    assert_eq!(kiln::run_cpu(&g8, &[("x", &three)]).expect("batch 3"), kiln::run_cpu(&g32, &[("x", &values3)]).expect("f32 batch 3"));
}

#[test]
fn values_a_u8_input_cannot_hold_are_typed_errors_naming_the_first() {
    let g = small_net_typed(2, DType::U8);
    let (_, clean) = rand_bytes(&[2, 3, 16, 12]);
    // (flat index, value, multi-index): a fraction, past 255, negative, NaN, infinity.
    let cases = [
        (5, 2.5, [0, 0, 0, 5]),
        (17, 256.0, [0, 0, 1, 5]),
        (600, -1.0, [1, 0, 2, 0]),
        (1000, f32::NAN, [1, 2, 3, 4]),
        (0, f32::INFINITY, [0, 0, 0, 0]),
    ];
    for (at, bad, want) in cases {
        let mut x = clean.clone();
        x.data[at] = bad;
        // A later bad value too: the first is named.
        x.data[1151] = 0.5;
        match kiln::run_cpu(&g, &[("x", &x)]) {
            Err(e @ Error::NotAByte { .. }) => {
                let text = e.to_string();
                let Error::NotAByte { name, index, value } = e else { unreachable!() };
                assert_eq!((name.as_str(), index.as_slice()), ("x", want.as_slice()), "{text}");
                assert!(value.to_bits() == bad.to_bits() || value.is_nan() && bad.is_nan(), "{text}");
                assert!(
                    text.starts_with("input `x` is declared u8, but its element [") && text.contains("not an integer in 0..=255"),
                    "{text}"
                );
                println!("{text}");
            }
            other => panic!("value {bad} at {at}: expected NotAByte, got {other:?}"),
        }
    }
    // Bytes for an input declared f32 are refused, naming the input and both types.
    let (bytes, _) = rand_bytes(&[2, 3, 16, 12]);
    match kiln::run_cpu(&small_net(2), &[("x", &bytes)]) {
        Err(Error::Binding { name, reason }) => {
            assert!(name == "x" && reason.contains("declared f32") && reason.contains("u8"), "{reason}")
        }
        other => panic!("expected a binding error, got {other:?}"),
    }
    // Sizes that do not match: a typed error, at construction or (fields set by hand) at the run.
    assert!(matches!(ByteTensor::new(vec![2, 3], vec![0; 5]), Err(Error::TensorSize { .. })));
    assert!(matches!(ByteTensor::new(vec![usize::MAX, 2], vec![]), Err(Error::TensorSize { .. })));
    let short = ByteTensor { shape: vec![2, 3, 16, 12], data: vec![1; 7] };
    match kiln::run_cpu(&g, &[("x", &short)]) {
        Err(Error::Binding { name, reason }) => assert!(name == "x" && reason.contains("does not match its 7 values"), "{reason}"),
        other => panic!("expected a binding error, got {other:?}"),
    }
}

#[test]
fn mismatched_batches_fail_with_the_module_path() {
    use kiln::Tracer;
    let t = Tracer::new();
    let (a, b) = (t.input("a", &[1, 2, 3, 3]), t.input("b", &[1, 2, 3, 3]));
    let s = a.add(&b).expect("trace");
    t.output("s", &s);
    let g = t.graph();
    let (x1, x2) = (rand(&[2, 2, 3, 3]), rand(&[1, 2, 3, 3]));
    match kiln::run_cpu(&g, &[("a", &x1), ("b", &x2)]) {
        Err(Error::Binding { name, reason }) => {
            assert!(name == "b" && reason.contains("batch 1") && reason.contains("batch 2"), "{reason}")
        }
        other => panic!("expected a batch mismatch, got {other:?}"),
    }
}

fn scale_shape(_: &kiln::plugin::Attrs, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
    Ok(inputs[0].to_vec())
}

fn scale_cpu(attrs: &kiln::plugin::Attrs, inputs: &[&HostTensor]) -> kiln::Result<HostTensor> {
    let k = kiln::plugin::attr(attrs, "cpu_ops_test_scale", "k")? as f32;
    Ok(HostTensor::new(inputs[0].shape.clone(), inputs[0].data.iter().map(|v| v * k).collect()))
}

fn broken_cpu(_: &kiln::plugin::Attrs, inputs: &[&HostTensor]) -> kiln::Result<HostTensor> {
    Ok(HostTensor::new(vec![inputs[0].numel()], inputs[0].data.clone()))
}

kiln::inventory::submit! { kiln::plugin::CustomOp { name: "cpu_ops_test_scale", infer_shape: scale_shape, cpu: scale_cpu } }
kiln::inventory::submit! { kiln::plugin::CustomOp { name: "cpu_ops_test_broken", infer_shape: scale_shape, cpu: broken_cpu } }

#[test]
fn custom_ops_run_their_registered_reference() {
    use kiln::Tracer;
    let t = Tracer::new();
    let x = t.input("x", &[1, 2, 3, 3]);
    let y = x.custom("cpu_ops_test_scale", &[("k", 2.5)], &[]).expect("trace");
    t.output("y", &y);
    let broken = x.custom("cpu_ops_test_broken", &[], &[]).expect("trace");
    let mut g = t.graph();
    let xt = rand(&[2, 2, 3, 3]);
    let out = kiln::run_cpu(&g, &[("x", &xt)]).expect("custom op runs; the unmarked broken op is dead and skipped");
    assert_eq!(out["y"].data, xt.data.iter().map(|v| v * 2.5).collect::<Vec<_>>());

    g.mark_output("broken", broken.id());
    match kiln::run_cpu(&g, &[("x", &xt)]) {
        Err(Error::Shape { op, reason, .. }) => {
            assert!(op == "cpu_ops_test_broken" && reason.to_string().contains("shape rule"), "{reason}")
        }
        other => panic!("expected a shape error, got {other:?}"),
    }

    let mut g = t.graph();
    let missing = g.push_unchecked(
        Op::Custom(CustomCall { name: "not_registered".into(), attrs: Default::default() }),
        vec![x.id()],
        vec![1, 2, 3, 3],
        "head.mystery".into(),
    );
    g.mark_output("m", missing);
    match kiln::run_cpu(&g, &[("x", &xt)]) {
        Err(Error::NoConverter { op, path, .. }) => assert_eq!((op.as_str(), path.as_str()), ("not_registered", "head.mystery")),
        other => panic!("expected a missing-op error, got {other:?}"),
    }
}

#[test]
fn an_intermediate_marked_as_output_keeps_its_value() {
    use kiln::Tracer;
    let t = Tracer::new();
    let x = t.input("x", &[1, 2, 4, 4]);
    let s = x.sigmoid().expect("trace");
    let r = s.relu().expect("trace");
    let m = r.mul(&s).expect("trace");
    t.output("s", &s);
    t.output("m", &m);
    t.output("s_again", &s);
    let xt = rand(&[1, 2, 4, 4]);
    let out = kiln::run_cpu(&t.graph(), &[("x", &xt)]).expect("run");
    assert_eq!(out["s"], out["s_again"]);
    let sig: Vec<f32> = xt.data.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect();
    assert_close("s", &out["s"], &HostTensor::new(xt.shape.clone(), sig.clone()));
    assert_close("m", &out["m"], &HostTensor::new(xt.shape.clone(), sig.iter().map(|v| v * v).collect()));
}

#[test]
fn malformed_graphs_are_errors() {
    let mut g = small_net(1);
    let x = rand(&[1, 3, 16, 12]);
    let key = "conv.weight";
    g.weights.remove(key);
    match kiln::run_cpu(&g, &[("x", &x)]) {
        Err(Error::MissingWeight { key: k, .. }) => assert_eq!(k, key),
        other => panic!("expected a missing-weight error, got {other:?}"),
    }
    let mut g = small_net(1);
    let conv = g.nodes.iter().position(|n| n.path == "conv" && n.op.name() == "conv2d").expect("conv");
    g.nodes[conv].inputs[0] = g.nodes.len() - 1;
    match kiln::run_cpu(&g, &[("x", &x)]) {
        Err(Error::InvalidGraph { path, reason, .. }) => assert!(path == "conv" && reason.contains("does not precede"), "{reason}"),
        other => panic!("expected a graph-order error, got {other:?}"),
    }
}

/// A 7×7 kernel with padding 3 over a 2×2 map (ConvNeXt's last stage at 64×64): most taps miss
/// the input entirely; the unfold must skip them, not index outside the row.
#[test]
fn conv_taps_that_miss_the_input_read_nothing() {
    let x = rand(&[1, 2, 2, 2]);
    let w = rand(&[2, 1, 7, 7]);
    let a = ConvAttrs { padding: [3, 3], groups: 2, ..ConvAttrs::default() };
    let got = run_op(Op::Conv(a), &x, &[], &[&w]);
    assert_eq!(got.shape, vec![1, 2, 2, 2]);
    // Depthwise: output (c, oy, ox) sums x[c, iy, ix] * w[c, 0, iy - oy + 3, ix - ox + 3].
    for c in 0..2 {
        for oy in 0..2 {
            for ox in 0..2 {
                let mut want = 0.0f32;
                for iy in 0..2 {
                    for ix in 0..2 {
                        want += x.data[(c * 2 + iy) * 2 + ix] * w.data[(c * 7 + (iy + 3 - oy)) * 7 + (ix + 3 - ox)];
                    }
                }
                let g = got.data[(c * 2 + oy) * 2 + ox];
                assert!((g - want).abs() < 1e-5, "c{c} ({oy}, {ox}): {g} vs {want}");
            }
        }
    }
}
