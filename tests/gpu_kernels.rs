//! Every kernel layer (through its converter, inside a real engine) against the CPU executor on
//! fresh random inputs: FP32 and FP16, batch 1 and > 1, non-square maps, odd channel counts (the
//! kernels' scalar paths) and multiples of 8 (their 16-byte vector paths). Every engine also runs
//! the NCHW f32 -> NHWC and back reformats at its edges. Skips with the reason without a GPU.
//!
//! On the device: `cargo test --release --test gpu_kernels -- --nocapture --test-threads 1`.

use kiln::engine::{BuildConfig, EngineBuilder, Gpu, Precision};
use kiln::{
    plugin::{Op, Pool, PoolAttrs},
    Graph, HostTensor,
};
use kiln::{Tensor, Tracer};

mod common;
use common::{check, gpu, random, to_f16};
use std::sync::Arc;

fn record(op: Op, x: &Tensor) -> kiln::Result<Tensor> {
    Tensor::record("op", op, &[x], &[])
}

fn pool(kernel: [usize; 2], stride: [usize; 2], padding: [usize; 2], ceil_mode: bool, count_include_pad: bool) -> PoolAttrs {
    PoolAttrs { kernel, stride, padding, ceil_mode, count_include_pad }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn activations() {
    for dims in [[7usize, 5, 9], [16, 6, 5]] {
        check(&format!("relu {dims:?}"), &[("x", &dims)], |x| Ok(vec![x[0].relu()?]));
        check(&format!("leaky_relu(0.1) {dims:?}"), &[("x", &dims)], |x| Ok(vec![x[0].leaky_relu(0.1)?]));
        check(&format!("sigmoid {dims:?}"), &[("x", &dims)], |x| Ok(vec![x[0].sigmoid()?]));
    }
    // Activations on a flat [N, F] value (after a flatten).
    check("relu(flatten) [3, 4, 5]", &[("x", &[3, 4, 5])], |x| Ok(vec![x[0].flatten(1)?.sigmoid()?]));
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn add_and_mul() {
    for dims in [[3usize, 4, 5], [24, 7, 3]] {
        check(&format!("add {dims:?}"), &[("a", &dims), ("b", &dims)], |x| Ok(vec![x[0].add(&x[1])?]));
        check(&format!("mul {dims:?}"), &[("a", &dims), ("b", &dims)], |x| Ok(vec![x[0].mul(&x[1])?]));
    }
    // Chained: one operand is computed, results reused by two outputs.
    check("relu(a + b) * a [9, 5, 6]", &[("a", &[9, 5, 6]), ("b", &[9, 5, 6])], |x| {
        let s = x[0].add(&x[1])?.relu()?;
        Ok(vec![s.mul(&x[0])?, s])
    });
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn max_pool() {
    let cases = [
        ("max 3x3 s2 p1", [5usize, 11, 8], pool([3, 3], [2, 2], [1, 1], false, true)),
        ("max 3x3 s2 p1 (ResNet stem)", [64, 16, 16], pool([3, 3], [2, 2], [1, 1], false, true)),
        ("max 3x3 s2 ceil_mode", [16, 10, 7], pool([3, 3], [2, 2], [0, 0], true, true)),
        ("max 2x3 s(2,1) p1", [6, 9, 10], pool([2, 3], [2, 1], [1, 1], false, true)),
        ("max 2x2 s2 ceil p1", [3, 7, 6], pool([2, 2], [2, 2], [1, 1], true, true)),
    ];
    for (name, dims, attrs) in cases {
        check(&format!("{name} {dims:?}"), &[("x", &dims)], |x| Ok(vec![record(Op::Pool(Pool::Max(attrs)), &x[0])?]));
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn avg_pool() {
    let cases = [
        ("avg 3x3 s2 p1 incl", [6usize, 9, 10], pool([3, 3], [2, 2], [1, 1], false, true)),
        ("avg 3x3 s2 p1 excl", [6, 9, 10], pool([3, 3], [2, 2], [1, 1], false, false)),
        ("avg 3x3 s2 p1 ceil incl", [16, 10, 7], pool([3, 3], [2, 2], [1, 1], true, true)),
        ("avg 3x3 s2 p1 ceil excl", [16, 10, 7], pool([3, 3], [2, 2], [1, 1], true, false)),
        ("avg 2x2 s2 ceil", [5, 7, 5], pool([2, 2], [2, 2], [0, 0], true, true)),
        ("avg 3x2 s(1,2) p(1,0)", [8, 6, 9], pool([3, 2], [1, 2], [1, 0], false, false)),
    ];
    for (name, dims, attrs) in cases {
        check(&format!("{name} {dims:?}"), &[("x", &dims)], |x| Ok(vec![record(Op::Pool(Pool::Avg(attrs)), &x[0])?]));
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn adaptive_avg_pool() {
    let cases = [([64usize, 7, 7], [1usize, 1]), ([5, 7, 7], [1, 1]), ([5, 10, 9], [3, 3]), ([16, 9, 11], [4, 2]), ([3, 5, 4], [5, 4])];
    for (dims, output) in cases {
        check(&format!("adaptive_avg {dims:?} -> {output:?}"), &[("x", &dims)], |x| {
            Ok(vec![record(Op::Pool(Pool::AdaptiveAvg { output }), &x[0])?])
        });
    }
    // ResNet's head: global pool then flatten (an alias: nothing moves).
    check("global pool + flatten [24, 7, 5]", &[("x", &[24, 7, 5])], |x| {
        Ok(vec![record(Op::Pool(Pool::AdaptiveAvg { output: [1, 1] }), &x[0])?.flatten(1)?])
    });
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn flatten_and_cat() {
    check("flatten [6, 3, 4]", &[("x", &[6, 3, 4])], |x| Ok(vec![x[0].flatten(1)?]));
    check("flatten [5, 1, 7] then relu", &[("x", &[5, 1, 7])], |x| Ok(vec![x[0].flatten(1)?.relu()?]));
    check("cat odd channels [5|8|3, 4, 6]", &[("a", &[5, 4, 6]), ("b", &[8, 4, 6]), ("c", &[3, 4, 6])], |x| {
        Ok(vec![Tensor::cat(&[&x[0], &x[1].relu()?, &x[2]], 1)?])
    });
    check("cat vector channels [16|8, 5, 3]", &[("a", &[16, 5, 3]), ("b", &[8, 5, 3])], |x| Ok(vec![Tensor::cat(&[&x[0], &x[1]], 1)?]));
}

// ---- bias + activation (+ residual) epilogue ------------------------------------------------
// No built-in op lowers to it alone (convolutions fuse their own epilogue), so a test op drives
// `ops::elementwise::bias_act` through the same converter mechanism a user's op would.

mod bias_act_op {
    use kiln::plugin::bias_act;
    use kiln::plugin::Unary;
    use kiln::plugin::{attr, Attrs, CustomOp};
    use kiln::plugin::{BuildCtx, Layer};
    use kiln::{plugin::Op, HostTensor, NodeId};

    pub const NAME: &str = "test_bias_act";

    /// Per-channel bias: distinct, signed, so a wrong channel index shows.
    fn bias(c: usize) -> Vec<f32> {
        (0..c).map(|i| i as f32 * 0.37 - 1.1).collect()
    }

    /// Per-channel scale (an unfolded BatchNorm's), distinct per channel.
    fn scale(c: usize) -> Vec<f32> {
        (0..c).map(|i| 0.5 + i as f32 * 0.11).collect()
    }

    fn act(attrs: &Attrs) -> kiln::Result<Option<Unary>> {
        Ok(match attr(attrs, NAME, "act")? as i32 {
            0 => None,
            1 => Some(Unary::Relu),
            2 => Some(Unary::LeakyRelu { slope: 0.1 }),
            _ => Some(Unary::Sigmoid),
        })
    }

    fn apply(a: Option<Unary>, v: f32) -> f32 {
        a.map_or(v, |a| a.apply(v))
    }

    /// x, r: [N, C, H, W]; `residual` = 0 ignores r.
    fn shape(_: &Attrs, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match inputs {
            [x, r] if x == r && x.len() == 4 => Ok(x.to_vec()),
            _ => Err(format!("expects two equal NCHW shapes, got {inputs:?}")),
        }
    }

    fn cpu(attrs: &Attrs, inputs: &[&HostTensor]) -> kiln::Result<HostTensor> {
        let (x, r) = (inputs[0], inputs[1]);
        let (c, hw) = (x.shape[1], x.shape[2] * x.shape[3]);
        let (a, b, with_res) = (act(attrs)?, bias(c), attr(attrs, NAME, "residual")? != 0.0);
        let sc = scale(c);
        let data = x
            .data
            .iter()
            .enumerate()
            .map(|(i, &v)| apply(a, v * sc[(i / hw) % c] + b[(i / hw) % c] + if with_res { r.data[i] } else { 0.0 }))
            .collect();
        Ok(HostTensor::new(x.shape.clone(), data))
    }

    fn convert(ctx: &mut BuildCtx, node: NodeId) -> kiln::Result<Box<dyn Layer>> {
        let Op::Custom(kiln::plugin::CustomCall { attrs, .. }) = &ctx.node(node).op else {
            return Err(ctx.err(node, kiln::LowerKind::Unsupported, "not a custom op"));
        };
        let (a, with_res) = (act(attrs)?, attr(attrs, NAME, "residual")? != 0.0);
        let (x, r, y) = (ctx.input(node, 0)?, ctx.input(node, 1)?, ctx.output(node)?);
        let c = ctx.value(y).dims[0];
        bias_act(ctx, node, x, Some(&scale(c)), Some(&bias(c)), with_res.then_some(r), y, a)
    }

    kiln::inventory::submit! { CustomOp { name: NAME, infer_shape: shape, cpu } }
    kiln::register_converter!(NAME, convert);
}

/// The test op's CPU reference is the oracle below, so it is pinned by hand first (no GPU needed).
#[test]
fn bias_act_reference_is_right() {
    let t = Tracer::new();
    let (x, r) = (t.input("x", &[1, 2, 1, 2]), t.input("r", &[1, 2, 1, 2]));
    t.output("y", &x.custom(bias_act_op::NAME, &[("act", 1.0), ("residual", 1.0)], &[&r]).expect("trace"));
    let xs = HostTensor::new(vec![1, 2, 1, 2], vec![3.0, -1.0, 0.5, 2.0]);
    let rs = HostTensor::new(vec![1, 2, 1, 2], vec![0.5, 0.5, -3.0, 0.0]);
    let y = &kiln::run_cpu(&t.graph(), &[("x", &xs), ("r", &rs)]).expect("cpu")["y"];
    // scale = [0.5, 0.61], bias = [-1.1, -0.73]: relu(3·0.5 - 1.1 + 0.5), relu(-1·0.5 - 1.1 + 0.5),
    // relu(0.5·0.61 - 0.73 - 3), relu(2·0.61 - 0.73)
    let want = [0.9f32, 0.0, 0.0, 0.49];
    assert!(y.data.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-6), "{:?}", y.data);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn bias_activation_residual_epilogue() {
    for dims in [[7usize, 5, 6], [16, 3, 5]] {
        for (act, act_name) in [(0.0, "none"), (1.0, "relu"), (2.0, "leaky"), (3.0, "sigmoid")] {
            for residual in [0.0, 1.0] {
                let name = format!("bias+{act_name}{} {dims:?}", if residual != 0.0 { "+residual" } else { "" });
                check(&name, &[("x", &dims), ("r", &dims)], |x| {
                    Ok(vec![x[0].custom(bias_act_op::NAME, &[("act", act), ("residual", residual)], &[&x[1]])?])
                });
            }
        }
    }
}

// ---- CenterNet decode ----------------------------------------------------------------------

/// How far an engine decode agrees with the CPU's on the same detections.
struct Agreement {
    /// GPU detections (class and centre) found among the CPU's of the same image.
    same_set: usize,
    /// Rows equal at the same rank (near-equal scores may legitimately swap neighbours).
    same_rank: usize,
    rows: usize,
    max_score_err: f32,
}

/// Engine and CPU decode on the same inputs (for FP16, inputs already rounded to f16, so both
/// see the same logits).
fn decode_agreement(gpu: &Arc<Gpu>, precision: Precision, hm: &HostTensor, wh: &HostTensor, reg: &HostTensor, k: usize) -> Agreement {
    let tracer = Tracer::new();
    let [_, c, h, w] = hm.shape[..] else { panic!("hm rank") };
    let t_hm = tracer.input("hm", &[1, c, h, w]);
    let t_wh = tracer.input("wh", &[1, 2, h, w]);
    let t_reg = tracer.input("reg", &[1, 2, h, w]);
    let out = t_hm.custom("centernet_decode", &[("k", k as f64)], &[&t_wh, &t_reg]).expect("trace decode");
    tracer.output("det", &out);
    let graph = tracer.graph();
    let max_batch = hm.shape[0].max(3);
    let config = BuildConfig::default().precision(precision).batch(1, max_batch, max_batch).cuda_graphs(false);
    let engine =
        Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph).unwrap_or_else(|e| panic!("build ({precision:?}): {e}")));
    let mut ctx = engine.context().expect("context");
    let bound = [("hm", hm), ("wh", wh), ("reg", reg)];
    let want = &kiln::run_cpu(&graph, &bound).expect("cpu decode")["det"];
    let got = &ctx.run(&bound).expect("gpu decode")["det"];
    assert_eq!(got.shape, want.shape);
    // Detections are f32 in every precision; FP16's wh and reg are the same f16 values the CPU
    // was given, so centres agree to f32 rounding.
    let tol = |v: f32| 1e-5 * (1.0 + v.abs());
    let centre = |r: &[f32]| ((r[0] + r[2]) / 2.0, (r[1] + r[3]) / 2.0);
    let same = |g: &[f32], w: &[f32]| {
        let ((gx, gy), (wx, wy)) = (centre(g), centre(w));
        g[5] == w[5] && (gx - wx).abs() <= tol(wx) && (gy - wy).abs() <= tol(wy)
    };
    let mut a = Agreement { same_set: 0, same_rank: 0, rows: got.data.len() / 6, max_score_err: 0.0 };
    for (gi, wi) in got.data.chunks(6 * k).zip(want.data.chunks(6 * k)) {
        for (g, w) in gi.chunks(6).zip(wi.chunks(6)) {
            a.same_rank += same(g, w) as usize;
            a.same_set += wi.chunks(6).any(|w| same(g, w)) as usize;
            a.max_score_err = a.max_score_err.max((g[4] - w[4]).abs());
        }
    }
    a
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn centernet_decode_matches_the_cpu_reference() {
    // Linked for its `centernet_decode` registrations (custom op + GPU converter).
    let _ = kiln_models::centernet::DEFAULT_K;
    let Some(gpu) = gpu() else { return };
    for precision in [Precision::Fp32, Precision::Fp16] {
        // Small (one tile per image), then CenterNet's real size: 80 classes at 128x128, 320
        // tiles per image and two merge passes.
        for (batch, c, h, w, k) in [(1usize, 7usize, 20usize, 24usize, 50usize), (3, 7, 20, 24, 50), (2, 80, 128, 128, 100)] {
            let seed = (batch * 1000 + c) as u64;
            let mut hm = random(&[batch, c, h, w], seed, 4.0);
            let mut wh = random(&[batch, 2, h, w], seed + 1, 8.0);
            let mut reg = random(&[batch, 2, h, w], seed + 2, 0.5);
            if precision == Precision::Fp16 {
                (hm, wh, reg) = (to_f16(&hm), to_f16(&wh), to_f16(&reg));
            }
            let a = decode_agreement(&gpu, precision, &hm, &wh, &reg, k);
            println!(
                "decode {precision:?} [{batch}, {c}, {h}, {w}] k={k}: {}/{} detections found by both, {} at the same rank, max score err {:.2e}",
                a.same_set, a.rows, a.same_rank, a.max_score_err
            );
            assert!(a.same_set * 100 >= a.rows * 98, "{precision:?}: only {} of {} detections agree", a.same_set, a.rows);
            assert!(a.max_score_err < if precision == Precision::Fp32 { 1e-5 } else { 1e-3 }, "score error {}", a.max_score_err);
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn centernet_decode_ties_and_suppressed_positions() {
    let _ = kiln_models::centernet::DEFAULT_K;
    let Some(gpu) = gpu() else { return };
    // A ramp rising to the bottom-right corner: one peak per class, so the other picks are the
    // suppressed positions' zeros, lowest flat index first (the tile's "fewer peaks than k" path).
    let (c, h, w) = (3, 16, 12);
    let ramp = HostTensor::new(
        vec![1, c, h, w],
        (0..c * h * w).map(|i| ((i % (h * w)) as f32) * 0.01 - 1.0 + (i / (h * w)) as f32 * 0.1).collect(),
    );
    // All equal: every position is a peak and ties go to the lower index.
    let flat = HostTensor::new(vec![1, c, h, w], vec![0.5; c * h * w]);
    let wh = random(&[1, 2, h, w], 5, 4.0);
    let reg = random(&[1, 2, h, w], 6, 0.5);
    for (name, hm) in [("ramp", &ramp), ("flat", &flat)] {
        for precision in [Precision::Fp32, Precision::Fp16] {
            let (hm, wh, reg) =
                if precision == Precision::Fp16 { (to_f16(hm), to_f16(&wh), to_f16(&reg)) } else { (hm.clone(), wh.clone(), reg.clone()) };
            let a = decode_agreement(&gpu, precision, &hm, &wh, &reg, 40);
            println!("decode {name} {precision:?}: {}/{} at the same rank", a.same_rank, a.rows);
            assert_eq!(a.same_rank, a.rows, "{name} {precision:?}: ties are broken by index, so every rank must agree");
        }
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn decode_every_selection_path_matches_the_cpu_reference() {
    let _ = kiln_models::centernet::DEFAULT_K;
    let Some(gpu) = gpu() else { return };
    // Plateaus of one logit make every position a peak with the same score, so the order is the
    // index alone: [1, 8, 64, 64] flat leaves 32768 candidates (radix select over the list),
    // [1, 80, 128, 128] flat 1.3M (over the whole map); a few spikes on a ramp leave fewer than
    // k logit peaks (the unfiltered collect, where suppressed positions' zeros rank). CenterNet's
    // size at batch 32 checks the batch-sized grid (strips of 16 rows) against batch 1's
    // (strips of 1 row), and C = 7 the scalar (unvectorized) sweeps.
    let few_peaks = |shape: &[usize]| {
        // A ramp along each plane (one peak per class at its end) with a few spikes.
        let plane = shape[2] * shape[3];
        let ramp = (0..shape.iter().product::<usize>()).map(|i| -3.0 + 0.001 * (i % plane) as f32).collect();
        let mut t = HostTensor::new(shape.to_vec(), ramp);
        for (i, v) in t.data.iter_mut().enumerate().step_by(997) {
            *v = (i % 13) as f32 * 0.25;
        }
        t
    };
    let cases: Vec<(&str, HostTensor, usize)> = vec![
        ("flat [1,8,64,64]", HostTensor::new(vec![1, 8, 64, 64], vec![0.25; 8 * 64 * 64]), 100),
        ("flat [1,80,128,128]", HostTensor::new(vec![1, 80, 128, 128], vec![-1.5; 80 * 128 * 128]), 100),
        ("few peaks [2,8,40,40]", few_peaks(&[2, 8, 40, 40]), 100),
        ("random [1,80,128,128]", random(&[1, 80, 128, 128], 41, 4.0), 100),
        ("random [32,80,128,128]", random(&[32, 80, 128, 128], 42, 4.0), 100),
        ("random [4,7,33,45] k=300", random(&[4, 7, 33, 45], 43, 4.0), 300),
    ];
    for (name, hm, k) in &cases {
        let [n, _, h, w] = hm.shape[..] else { panic!("hm rank") };
        let wh = random(&[n, 2, h, w], 44, 8.0);
        let reg = random(&[n, 2, h, w], 45, 0.5);
        for precision in [Precision::Fp32, Precision::Fp16] {
            let (hm, wh, reg) =
                if precision == Precision::Fp16 { (to_f16(hm), to_f16(&wh), to_f16(&reg)) } else { (hm.clone(), wh.clone(), reg.clone()) };
            let a = decode_agreement(&gpu, precision, &hm, &wh, &reg, *k);
            println!("decode {name} {precision:?}: {}/{} at the same rank, max score err {:.2e}", a.same_rank, a.rows, a.max_score_err);
            if name.starts_with("random") {
                // exp in double rounded to f32 may differ from the CPU's expf in a last bit on
                // rare values among millions, swapping near-equal neighbours.
                assert!(a.same_set * 100 >= a.rows * 99, "{name} {precision:?}: only {} of {} detections agree", a.same_set, a.rows);
                assert!(a.max_score_err < 1e-6, "{name} {precision:?}: score error {}", a.max_score_err);
            } else {
                assert_eq!(a.same_rank, a.rows, "{name} {precision:?}: equal scores go by index, every rank must agree");
                assert_eq!(a.max_score_err, 0.0, "{name} {precision:?}");
            }
        }
    }
}

// ---- timings (printed, for the report) -------------------------------------------------------

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn timings() {
    let _ = kiln_models::centernet::DEFAULT_K;
    let Some(gpu) = gpu() else { return };
    let time = |name: &str, graph: Graph, batch: usize, inputs: Vec<(&str, HostTensor)>| {
        let config = BuildConfig::default().precision(Precision::Fp16).batch(1, batch, batch).cuda_graphs(false);
        let engine = Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph).expect("build"));
        let mut ctx = engine.context().expect("context");
        let bound: Vec<(&str, &HostTensor)> = inputs.iter().map(|(n, t)| (*n, t)).collect();
        ctx.run(&bound).expect("run");
        let ms = ctx.time(batch, 5, 50).expect("time");
        println!(
            "timing {name:<52} FP16 batch {batch:>2}: {:>8.1} us (engine: {})",
            ms * 1e3,
            engine.layers().map(|l| l.kind()).collect::<Vec<_>>().join(", ")
        );
    };
    let one = |dims: &[usize], f: &dyn Fn(&Tensor) -> kiln::Result<Tensor>| {
        let t = Tracer::new();
        let x = t.input("x", &[&[1][..], dims].concat());
        t.output("y", &f(&x).expect("trace"));
        t.graph()
    };
    for batch in [1, 32] {
        let stem = [64, 112, 112];
        time(
            "reformats only: relu [64,112,112]",
            one(&stem, &|x| x.relu()),
            batch,
            vec![("x", random(&[&[batch][..], &stem].concat(), 1, 1.0))],
        );
        time(
            "reformats + max_pool 3x3 s2 p1 [64,112,112]",
            one(&stem, &|x| record(Op::Pool(Pool::Max(pool([3, 3], [2, 2], [1, 1], false, true))), x)),
            batch,
            vec![("x", random(&[&[batch][..], &stem].concat(), 2, 1.0))],
        );
        let head = [2048, 7, 7];
        time(
            "reformats + global avg pool + flatten [2048,7,7]",
            one(&head, &|x| record(Op::Pool(Pool::AdaptiveAvg { output: [1, 1] }), x)?.flatten(1)),
            batch,
            vec![("x", random(&[&[batch][..], &head].concat(), 3, 1.0))],
        );
    }
    for batch in [1, 32] {
        let (c, h, w) = (80, 128, 128);
        let t = Tracer::new();
        let hm = t.input("hm", &[1, c, h, w]);
        let (twh, treg) = (t.input("wh", &[1, 2, h, w]), t.input("reg", &[1, 2, h, w]));
        t.output("det", &hm.custom("centernet_decode", &[("k", 100.0)], &[&twh, &treg]).expect("trace"));
        let inputs = vec![
            ("hm", random(&[batch, c, h, w], 7, 4.0)),
            ("wh", random(&[batch, 2, h, w], 8, 8.0)),
            ("reg", random(&[batch, 2, h, w], 9, 0.5)),
        ];
        time("reformats + centernet decode [80,128,128] k=100", t.graph(), batch, inputs);
    }
}
