//! Post-training quantisation on the CPU: the trained digits ResNet (`tools/train_digits.py`) on
//! its held-out set in FP32, and through the fake-quant simulation of INT8 (each calibration
//! method) and FP8 engines; calibration determinism and the cache's round trip; explicit Q/DQ
//! graphs built with exactly their `state_dict` scales.

use kiln::dev::quant::{graph_hash, prepare_for_best, prepare_for_engine, quant_points, quantize_graph, simulate};
use kiln::engine::{CalibrationCache, CalibrationMethod, Calibrator};
use kiln::files::read_safetensors;
use kiln::nn::{FakeQuantize, FakeQuantizeConfig};
use kiln::{
    nn::{Conv2d, Conv2dConfig},
    Error, Forward, Module, Tracer, VarBuilder,
};
use kiln::{
    plugin::{Op, Quant, QuantFormat, QuantParams},
    Graph, HostTensor,
};
use std::collections::BTreeMap;
use std::path::PathBuf;

mod quant_graphs;
use quant_graphs::transformer_like;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `[N, 1, 32, 32]` digits repeated over the model's 3 input channels.
fn rgb(x: &HostTensor) -> HostTensor {
    let (n, plane) = (x.shape[0], x.shape[2] * x.shape[3]);
    let mut data = Vec::with_capacity(n * 3 * plane);
    for img in x.data.chunks_exact(plane) {
        for _ in 0..3 {
            data.extend_from_slice(img);
        }
    }
    HostTensor::new(vec![n, 3, x.shape[2], x.shape[3]], data)
}

struct Digits {
    graph: Graph,
    heldout: HostTensor,
    labels: Vec<usize>,
    calib: HostTensor,
}

fn digits() -> Digits {
    let data = read_safetensors(root().join("tests/fixtures/digits.safetensors")).expect("digits fixture");
    let vb = VarBuilder::from_safetensors(&[root().join(kiln_models::DIGITS_WEIGHTS)]).expect("digits weights");
    let heldout = rgb(&data["heldout"]);
    let graph = kiln_models::trace("digits_resnet", vb.clone(), heldout.shape[0], 32).expect("trace");
    vb.check_all_used().expect("every trained weight is used");
    let labels = data["heldout_labels"].data.iter().map(|&l| l as usize).collect();
    Digits { graph, heldout, labels, calib: rgb(&data["calib"]) }
}

fn top1(graph: &Graph, x: &HostTensor, labels: &[usize]) -> (f64, Vec<f32>) {
    let out = kiln::run_cpu(graph, &[("input", x)]).expect("cpu run");
    let logits = &out["logits"];
    let classes = logits.shape[1];
    let correct = logits
        .data
        .chunks_exact(classes)
        .zip(labels)
        .filter(|(row, &l)| row.iter().enumerate().fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 == l)
        .count();
    (100.0 * correct as f64 / labels.len() as f64, logits.data.clone())
}

#[test]
fn digits_int8_and_fp8_simulation_stay_within_half_a_point_of_fp32() {
    let d = digits();
    let (fp32, _) = top1(&d.graph, &d.heldout, &d.labels);
    println!("held-out top-1 on {} images: Kiln CPU FP32 {fp32:.2}%", d.labels.len());
    assert!(fp32 > 95.0, "the trained network should classify digits, got {fp32:.2}%");

    let calibrator = Calibrator::new(&d.graph).expect("calibrator");
    let stats = calibrator.collect(std::slice::from_ref(&d.calib)).expect("calibrate");
    println!("{} calibrated tensors: {:?}", stats.tensors.len(), calibrator.tensor_names());
    let mut rows = vec![];
    for (format, method) in [
        (QuantFormat::Int8, CalibrationMethod::Entropy),
        (QuantFormat::Int8, CalibrationMethod::Percentile(99.99)),
        (QuantFormat::Int8, CalibrationMethod::MinMax),
        (QuantFormat::Fp8E4m3, CalibrationMethod::MinMax),
        (QuantFormat::Fp8E4m3, CalibrationMethod::Entropy),
    ] {
        let cache = stats.cache(method);
        let sim = simulate(&d.graph, &cache, format).expect("simulate");
        let (acc, _) = top1(&sim, &d.heldout, &d.labels);
        println!("  {} {method:?}: {acc:.2}% ({:+.2} points)", format.name(), acc - fp32);
        rows.push((format, method, acc));
    }
    let bad: Vec<_> = rows.iter().filter(|r| (r.2 - fp32).abs() > 0.5).collect();
    assert!(bad.is_empty(), "more than 0.5 points from FP32 ({fp32:.2}%): {bad:?}");
}

/// Bias correction on the trained digits network: calibration records every 8-bit layer's input
/// means; the FP8 simulation with them has each quantised layer's bias replaced by a corrected
/// one and its logits closer to FP32's than without them (rel L2 printed); INT8 ignores them
/// (the same graph with and without).
#[test]
fn fp8_biases_are_corrected_for_the_weights_rounding() {
    let d = digits();
    let stats = Calibrator::new(&d.graph).expect("calibrator").collect(std::slice::from_ref(&d.calib)).expect("calibrate");
    let points = quant_points(&kiln::dev::passes::optimize(&d.graph).expect("optimize")).len();
    assert_eq!(stats.input_means.len(), points, "a mean per 8-bit layer: {:?}", stats.input_means.keys());
    let with = stats.cache(CalibrationMethod::default());
    let mut without = with.clone();
    without.input_means.clear();
    let fp32 = &kiln::run_cpu(&d.graph, &[("input", &d.heldout)]).expect("fp32")["logits"];
    let mut errors = vec![];
    for cache in [&without, &with] {
        let sim = simulate(&d.graph, cache, QuantFormat::Fp8E4m3).expect("simulate");
        let corrected = sim.nodes.iter().filter(|n| n.path.ends_with(".bias.corrected")).count();
        let got = &kiln::run_cpu(&sim, &[("input", &d.heldout)]).expect("sim")["logits"];
        let rel = kiln::compare("logits", got, fp32).rel_l2;
        println!("fp8 simulation, {corrected} biases corrected: rel L2 {rel:.3e} against FP32");
        errors.push((corrected, rel));
    }
    assert_eq!(errors[0].0, 0);
    assert!(errors[1].0 > 0 && errors[1].0 <= points, "{errors:?}");
    assert!(errors[1].1 < errors[0].1, "the correction brings FP8 closer to FP32: {errors:?}");
    // Means of the wrong size for a layer (a cache edited, or of another model): an error naming
    // the layer and both sizes.
    let mut bad = with.clone();
    let layer = "layer1.0.conv1";
    bad.input_means.get_mut(layer).expect("an FP8 layer's means").push(0.0);
    let Err(e) = simulate(&d.graph, &bad, QuantFormat::Fp8E4m3) else { panic!("means of the wrong size accepted") };
    let text = e.to_string();
    println!("{text}");
    assert!(text.contains(layer) && text.contains("recalibrate") && text.contains("145 values"), "{text}");
    let int8 = |c: &CalibrationCache| simulate(&d.graph, c, QuantFormat::Int8).expect("simulate");
    let (a, b) = (int8(&with), int8(&without));
    assert!(a.nodes.iter().all(|n| !n.path.ends_with(".bias.corrected")), "INT8 corrects no bias");
    assert_eq!(a.nodes.len(), b.nodes.len());
}

#[test]
fn calibrating_twice_gives_the_same_cache_and_the_cache_round_trips() {
    let d = digits();
    let calibrator = Calibrator::new(&d.graph).expect("calibrator");
    let first = calibrator.calibrate(std::slice::from_ref(&d.calib), CalibrationMethod::Entropy).expect("calibrate");
    let second = calibrator.calibrate(std::slice::from_ref(&d.calib), CalibrationMethod::Entropy).expect("calibrate");
    assert_eq!(first.images, 100);
    assert_eq!(first.to_json(), second.to_json(), "calibration is deterministic");
    assert_eq!(first.graph_hash, graph_hash(calibrator.graph()));

    let dir = std::env::temp_dir().join(format!("kiln-quant-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("digits.calib.json");
    first.save(&path).expect("save");
    let text = std::fs::read_to_string(&path).expect("read");
    assert!(text.contains("\"method\": \"entropy\"") && text.contains("int8_scale"), "readable JSON:\n{text}");
    let loaded = CalibrationCache::load(&path).expect("load");
    assert_eq!(loaded, first);

    // A build from the file needs no data: it yields exactly the graph the in-memory cache does.
    let optimized = kiln::engine::optimize(&d.graph).expect("optimize");
    let from_file = prepare_for_engine(optimized.clone(), QuantFormat::Int8, Some(&path), &[]).expect("from the cache file");
    let again = prepare_for_engine(optimized.clone(), QuantFormat::Int8, Some(&path), &[]).expect("again");
    assert_eq!(from_file.nodes, again.nodes);
    let x = HostTensor::new(vec![4, 3, 32, 32], d.heldout.data[..4 * 3 * 1024].to_vec());
    // The simulation of the graph built from the file (its FP16 storage marked as the engine's)
    // is the in-memory cache's simulation.
    let from_file_sim = kiln::dev::quant::simulation(&from_file, QuantFormat::Int8, &[]).expect("simulation");
    let a = kiln::run_cpu(&from_file_sim, &[("input", &x)]).expect("run");
    let b = kiln::run_cpu(&simulate(&d.graph, &first, QuantFormat::Int8).expect("simulate"), &[("input", &x)]).expect("run");
    assert_eq!(a["logits"], b["logits"], "the graph built from the cache file simulates as the in-memory cache's");
    println!("cache: {} tensors, {} bytes; rebuilt graphs identical", loaded.tensors.len(), text.len());

    // Without a cache an INT8 build is refused, naming the way out; a cache of another graph too.
    let err = prepare_for_engine(optimized.clone(), QuantFormat::Int8, None, &[]).expect_err("needs a cache");
    assert!(matches!(&err, Error::Config { reason } if reason.contains("calibration cache")), "{err}");
    let mut other = first.clone();
    other.graph_hash = "0000000000000000".into();
    let err = quantize_graph(&optimized, &other, QuantFormat::Int8, &[]).expect_err("other graph");
    assert!(err.to_string().contains("recalibrate"), "{err}");
    let mut missing = first.clone();
    let name = missing.tensors.keys().next().cloned().expect("a tensor");
    missing.tensors.remove(&name);
    let err = quantize_graph(&optimized, &missing, QuantFormat::Int8, &[]).expect_err("missing tensor");
    assert!(err.to_string().contains(&format!("`{name}`")), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn simulation_quantises_exactly_the_documented_points() {
    let d = digits();
    let calibrator = Calibrator::new(&d.graph).expect("calibrator");
    let cache = calibrator.calibrate(std::slice::from_ref(&d.calib), CalibrationMethod::MinMax).expect("calibrate");
    let optimized = calibrator.graph();
    let points = quant_points(optimized);
    // 9 convs (stem, 2 per block, 2 downsamples) and the fc.
    assert_eq!(points.len(), 10, "{}", optimized.to_text());
    let sim = quantize_graph(optimized, &cache, QuantFormat::Int8, &[]).expect("quantize");
    let fq: Vec<&kiln::plugin::Node> = sim.nodes.iter().filter(|n| matches!(n.op, Op::Quant(_))).collect();
    let activations = fq.iter().filter(|n| n.path.ends_with(".quantizer")).count();
    let weights = fq.iter().filter(|n| n.path.ends_with(".weight_quantizer")).count();
    // Each block's input is read by its conv1, its downsample and (in a block without one) as the
    // residual of conv2: one shared quantiser. A downsample's output is quantised as conv2's
    // residual (the stem, which absorbed its ReLU, is layer1.0's skip).
    assert_eq!((activations, weights), (cache.tensors.len(), 10));
    assert_eq!(cache.tensors.len(), 10);
    let residuals: Vec<&str> = points.iter().filter_map(|p| p.residual).map(|r| optimized.nodes[r].path.as_str()).collect();
    assert_eq!(residuals, ["conv1", "layer2.0.downsample.0", "layer3.0.downsample.0"], "the skip connections");
    for n in &fq {
        let Op::Quant(Quant::FakeQuantize(p)) = &n.op else { panic!("{} is not a fake-quantize", n.path) };
        if n.path.ends_with(".weight_quantizer") {
            assert_eq!(p.axis, Some(0));
        } else {
            let name = n.path.trim_end_matches(".quantizer");
            assert_eq!(p.scale, vec![cache.tensors[name].int8_scale], "{name}");
        }
    }
}

/// `--layer-precisions` in an 8-bit engine: the layers a rule covers lose their quantisers (the
/// stem and all of layer3 here, in both formats and in Best), every other point keeps its own, and
/// the simulation of that engine computes those layers on unquantised values: it is closer to
/// FP32 than the fully quantised simulation, and differs from it. A rule on a layer that a graph
/// quantises with its own Q/DQ nodes is an error naming the flag, the rule and the layer.
#[test]
fn layer_precision_rules_keep_their_layers_unquantised() {
    use kiln::engine::{LayerPrecision, Precision};
    let d = digits();
    let calibrator = Calibrator::new(&d.graph).expect("calibrator");
    let cache = calibrator.calibrate(std::slice::from_ref(&d.calib), CalibrationMethod::MinMax).expect("calibrate");
    let optimized = calibrator.graph().clone();
    let rules = LayerPrecision::parse_list("conv1:fp16,layer3:fp32").expect("rules");
    let covered = |path: &str| rules.iter().any(|r| r.matches(path));
    let quantised_layers = |g: &Graph| -> Vec<String> {
        let mut v: Vec<String> = g
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Conv(_) | Op::Gemm(_)))
            .filter(|n| n.inputs.iter().any(|&i| matches!(g.nodes[i].op, Op::Quant(_))))
            .map(|n| n.path.clone())
            .collect();
        v.sort();
        v
    };
    let points: Vec<String> = quant_points(&optimized).iter().map(|p| optimized.nodes[p.node].path.clone()).collect();
    let kept: Vec<&String> = points.iter().filter(|p| covered(p)).collect();
    assert_eq!(kept.len(), 4, "the stem and layer3's three convs: {points:?}");
    for format in [QuantFormat::Int8, QuantFormat::Fp8E4m3] {
        let all = quantised_layers(&quantize_graph(&optimized, &cache, format, &[]).expect("quantise"));
        let some = quantised_layers(&quantize_graph(&optimized, &cache, format, &rules).expect("quantise with rules"));
        let want: Vec<String> = all.iter().filter(|p| !covered(p)).cloned().collect();
        assert_eq!(some, want, "{format:?}: every point but the covered ones");
        assert!(all.len() > some.len() && !some.is_empty(), "{format:?}: {all:?} / {some:?}");
    }
    let path = std::env::temp_dir().join(format!("kiln-rules-{}.json", std::process::id()));
    cache.save(&path).expect("save");
    let best = prepare_for_best(optimized.clone(), Some(&path), &rules).expect("best");
    let _ = std::fs::remove_file(&path);
    assert!(quantised_layers(&best).iter().all(|p| !covered(p)), "Best leaves them unquantised too");

    // The simulation with the rules: nearer FP32 than without, and not the same numbers.
    let fp32 = kiln::run_cpu(&d.graph, &[("input", &d.heldout)]).expect("fp32")["logits"].clone();
    for format in [QuantFormat::Int8, QuantFormat::Fp8E4m3] {
        let run = |rules: &[LayerPrecision]| {
            let g = kiln::dev::quant::simulate_with_rules(&d.graph, &cache, format, rules).expect("simulate");
            kiln::run_cpu(&g, &[("input", &d.heldout)]).expect("simulation")["logits"].clone()
        };
        let (all, some) = (run(&[]), run(&rules));
        let rel = |a: &[f32], b: &[f32]| {
            let d: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
            (d / b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>()).sqrt()
        };
        let err = |t: &HostTensor| rel(&t.data, &fp32.data);
        println!(
            "{format:?}: simulation vs FP32 rel L2 {:.3e} fully quantised, {:.3e} with conv1 and layer3 unquantised",
            err(&all),
            err(&some)
        );
        assert!(err(&some) < err(&all), "{format:?}: {} !< {}", err(&some), err(&all));
        assert!(rel(&some.data, &all.data) > 1e-4, "{format:?}: the rules change the simulation");
    }

    // Explicit quantisation (Q/DQ nodes in the graph, as kiln-torch imports a model quantised in
    // PyTorch): a rule on a quantised layer cannot be obeyed.
    let q = quantize_graph(&optimized, &cache, QuantFormat::Int8, &[]).expect("quantise");
    let rule = [LayerPrecision::new("layer1.0.conv1", Precision::Fp16)];
    let err = prepare_for_engine(q.clone(), QuantFormat::Int8, None, &rule).expect_err("a rule on a quantised layer");
    let text = err.to_string();
    assert!(
        text.starts_with("--layer-precisions") && text.contains("layer1.0.conv1:fp16") && text.contains("own quantize/dequantize"),
        "{text}"
    );
    // `kiln compare --layerwise` refuses it in the same words.
    let err = kiln::dev::layerwise::run_quantised(&q, None, QuantFormat::Int8, &BTreeMap::new(), 0.1, &rule, |_, _| Ok(BTreeMap::new()))
        .expect_err("a layerwise rule on a quantised layer");
    assert_eq!(err.to_string(), text);
    // A rule on a layer it leaves unquantised is obeyed (only the precision of the others changes).
    prepare_for_engine(q, QuantFormat::Int8, None, &[LayerPrecision::new("nothing.here", Precision::Fp32)]).expect("a rule elsewhere");
}

/// `quant_sensitivity` on the digits network: one entry per quantised layer and per module
/// holding two to a quarter of them, best first; its numbers are the simulation's (the fully quantised error is
/// `simulate`'s, the best scope's is `simulate_with_rules`'s with that scope in FP16), and keeping
/// some scope in FP16 helps.
#[test]
fn sensitivity_ranks_the_scopes_by_the_simulations_error() {
    use kiln::engine::{quant_sensitivity, LayerPrecision, Precision};
    let d = digits();
    let calibrator = Calibrator::new(&d.graph).expect("calibrator");
    let cache = calibrator.calibrate(std::slice::from_ref(&d.calib), CalibrationMethod::default()).expect("calibrate");
    let x = HostTensor::new([vec![16], d.heldout.shape[1..].to_vec()].concat(), d.heldout.data[..16 * 3 * 32 * 32].to_vec());
    let rel = |a: &[f32], b: &[f32]| {
        let e: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
        (e / b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>()).sqrt()
    };
    let fp32 = kiln::run_cpu(&d.graph, &[("input", &x)]).expect("fp32")["logits"].clone();
    for format in [QuantFormat::Int8, QuantFormat::Fp8E4m3] {
        let mut calls = vec![];
        let (all, scopes) = quant_sensitivity(&d.graph, &cache, format, std::slice::from_ref(&x), |done, total| calls.push((done, total)))
            .expect("sensitivity");
        let sim = simulate(&d.graph, &cache, format).expect("simulate");
        let want_all = rel(&kiln::run_cpu(&sim, &[("input", &x)]).expect("sim")["logits"].data, &fp32.data);
        // Its FP32 is the optimised graph (BatchNorm folded): the same to rounding.
        assert!((all - want_all).abs() <= 1e-4 * want_all, "{format:?}: {all} against {want_all}");
        let layers = sim
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Conv(_) | Op::Gemm(_)) && n.inputs.iter().any(|&i| matches!(sim.nodes[i].op, Op::Quant(_))))
            .count();
        let singles = scopes.iter().filter(|s| s.layers == 1).count();
        assert_eq!(singles, layers, "{format:?}: every quantised layer is a scope");
        assert!(scopes.iter().any(|s| s.scope == "layer1" && s.layers >= 2), "{format:?}: the modules too: {scopes:?}");
        assert!(scopes.windows(2).all(|w| w[0].rel_l2 <= w[1].rel_l2), "{format:?}: best first");
        assert_eq!(calls.last(), Some(&(scopes.len() + 1, scopes.len() + 1)), "{format:?}: progress reaches its total");
        let best = &scopes[0];
        assert!(best.rel_l2 < all, "{format:?}: some scope in FP16 helps: {best:?}, all {all}");
        let rule = [LayerPrecision::new(best.scope.as_str(), Precision::Fp16)];
        let g = kiln::dev::quant::simulate_with_rules(&d.graph, &cache, format, &rule).expect("simulate");
        let want = rel(&kiln::run_cpu(&g, &[("input", &x)]).expect("sim")["logits"].data, &fp32.data);
        assert!((best.rel_l2 - want).abs() <= 1e-4 * want, "{format:?}: {best:?} against {want}");
        println!("{format:?}: all quantised {all:.3e}; best {} ({} layers) {:.3e}", best.scope, best.layers, best.rel_l2);
    }
}

/// `Best` (TensorRT's `--best`): its graph has one INT8 quantiser per calibrated tensor with the
/// cache's scale (the FP8 GEMMs clip at the same ranges), and keeps the original weights under
/// their own names for its 16-bit layers, each carrying the per-channel INT8 grid its INT8 conv
/// rounds it onto (an INT8 engine's weights are folded onto that grid instead).
#[test]
fn best_keeps_int8_scales_and_unquantised_weights_on_their_grid() {
    let d = digits();
    let calibrator = Calibrator::new(&d.graph).expect("calibrator");
    let cache = calibrator.calibrate(std::slice::from_ref(&d.calib), CalibrationMethod::MinMax).expect("calibrate");
    let path = std::env::temp_dir().join(format!("kiln-best-{}.json", std::process::id()));
    cache.save(&path).expect("save");
    let optimized = calibrator.graph().clone();
    let best = prepare_for_best(optimized.clone(), Some(&path), &[]).expect("best");
    let int8 = prepare_for_engine(optimized.clone(), QuantFormat::Int8, Some(&path), &[]).expect("int8");
    let _ = std::fs::remove_file(&path);
    let quantisers: Vec<(&str, f32)> = best
        .nodes
        .iter()
        .filter_map(|n| match &n.op {
            Op::Quant(Quant::FakeQuantize(p)) => {
                assert_eq!(p.format, QuantFormat::Int8, "{}", n.path);
                assert!(!matches!(best.nodes[n.inputs[0]].op, Op::Weight { .. }), "{} quantises a weight", n.path);
                Some((n.path.trim_end_matches(".quantizer"), p.scale[0]))
            }
            _ => None,
        })
        .collect();
    assert_eq!(quantisers.len(), cache.tensors.len());
    for (name, scale) in quantisers {
        assert_eq!(scale, cache.tensors[name].int8_scale, "{name}");
    }
    let weights = |g: &Graph| -> Vec<(String, Option<QuantParams>)> {
        let mut w: Vec<_> = g
            .nodes
            .iter()
            .filter_map(|n| if let Op::Weight { name, quant } = &n.op { Some((name.clone(), quant.clone())) } else { None })
            .collect();
        w.sort_by(|a, b| a.0.cmp(&b.0));
        w
    };
    let (best_w, int8_w) = (weights(&best), weights(&int8));
    let names = |w: &[(String, Option<QuantParams>)]| w.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&best_w), names(&weights(&optimized)), "Best reads the optimised graph's own weights");
    // The same grids as the INT8 engine's folded weights, on the original values.
    let grids = |w: &[(String, Option<QuantParams>)]| w.iter().filter_map(|(_, q)| q.clone()).collect::<Vec<_>>();
    assert_eq!(grids(&best_w).len(), quant_points(&optimized).len());
    assert_eq!(grids(&best_w), grids(&int8_w));
    for (name, q) in &best_w {
        assert_eq!(best.weights[name], optimized.weights[name], "{name} keeps its values");
        if let Some(q) = q {
            assert!(int8.weights[&format!("{name}.int8")].data != best.weights[name].data, "{name}: INT8 folds it, Best does not");
            assert_eq!(q.axis, Some(0), "{name}: per output channel");
        }
    }
    // Without a cache, Best is refused as the other 8-bit precisions are, naming itself.
    let err = prepare_for_best(optimized, None, &[]).expect_err("no cache");
    assert!(err.to_string().contains("best engine needs a calibration cache"), "{err}");
}

/// A QAT-style model: fake-quantisers with `scale`/`zero_point` buffers in its `state_dict`.
#[test]
fn explicit_qdq_graphs_build_with_exactly_their_state_dict_scales() {
    let mut sd = BTreeMap::new();
    sd.insert("quant.scale".to_string(), HostTensor::new(vec![1], vec![0.0123]));
    sd.insert("quant.zero_point".to_string(), HostTensor::new(vec![1], vec![0.0]));
    sd.insert("conv.weight".to_string(), kiln::dev::weight("conv.weight", &[4, 3, 3, 3]));
    sd.insert("conv.bias".to_string(), kiln::dev::weight("conv.bias", &[4]));
    sd.insert("wq.scale".to_string(), HostTensor::new(vec![4], vec![0.002, 0.003, 0.004, 0.005]));
    let vb = VarBuilder::from_tensors(sd);
    let quant = FakeQuantize::load(vb.pp("quant"), &FakeQuantizeConfig::default()).expect("load");
    let wq = FakeQuantize::load(vb.pp("wq"), &FakeQuantizeConfig { format: QuantFormat::Fp8E4m3, channels: Some(4), ..Default::default() })
        .expect("load");
    let conv = Conv2d::load(vb.pp("conv"), &Conv2dConfig::new(3, 4, 3).padding(1)).expect("load");
    vb.check_all_used().expect("every buffer used");

    let tracer = Tracer::new();
    let x = tracer.input("input", &[2, 3, 6, 6]);
    let y = wq.forward(&conv.forward(&quant.forward(&x).expect("q")).expect("conv")).expect("wq");
    y.mark_output("y");
    let graph = tracer.graph();
    let engine_graph =
        prepare_for_engine(kiln::engine::optimize(&graph).expect("optimize"), QuantFormat::Int8, None, &[]).expect("explicit");
    let scales: Vec<Vec<f32>> =
        engine_graph.nodes.iter().filter_map(|n| if let Op::Quant(q) = &n.op { Some(q.params().scale.clone()) } else { None }).collect();
    assert_eq!(scales, vec![vec![0.0123], vec![0.002, 0.003, 0.004, 0.005]], "the state_dict's scales, unchanged");

    // The CPU executor runs them: the same as quantising by hand.
    let input = kiln::dev::uniform_tensor(&[2, 3, 6, 6], 7);
    let got = kiln::run_cpu(&engine_graph, &[("input", &input)]).expect("run");
    let mut xq = input.clone();
    QuantParams::int8(0.0123).fake_quantize(&mut xq);
    let tracer = Tracer::new();
    let x = tracer.input("input", &[2, 3, 6, 6]);
    conv.forward(&x).expect("conv").mark_output("y");
    let mut want = kiln::run_cpu(&tracer.graph(), &[("input", &xq)]).expect("run").remove("y").expect("y");
    QuantParams::fp8(1.0).per_channel(1, vec![0.002, 0.003, 0.004, 0.005]).fake_quantize(&mut want);
    let c = kiln::compare("explicit Q/DQ", &got["y"], &want);
    println!("{c}");
    assert!(c.passes(1e-6), "{c}");
}

#[test]
fn fp8_on_the_cpu_and_bad_scales_in_a_state_dict() {
    let mut sd = BTreeMap::new();
    sd.insert("q.scale".to_string(), HostTensor::new(vec![1], vec![-1.0]));
    sd.insert("q.zero_point".to_string(), HostTensor::new(vec![1], vec![0.0]));
    let err = FakeQuantize::load(VarBuilder::from_tensors(sd).pp("q"), &FakeQuantizeConfig::default()).expect_err("negative scale");
    assert!(err.to_string().contains("q") && err.to_string().contains("positive"), "{err}");
}

/// A reference as `tools/export_reference.py --intermediates all` writes it (`input`,
/// `output.<name>`, `intermediate.<path>`), made by the CPU executor in FP32 on `graph`.
fn reference_of(graph: &Graph, x: &HostTensor) -> BTreeMap<String, HostTensor> {
    let out = kiln::run_cpu(&kiln::dev::layerwise::mark_all(graph), &[("input", x)]).expect("cpu reference");
    let mut r: BTreeMap<String, HostTensor> =
        out.into_iter().map(|(k, v)| if k.starts_with("intermediate.") { (k, v) } else { (format!("output.{k}"), v) }).collect();
    r.insert("input".into(), x.clone());
    r
}

/// `fused_keys` maps each node of the optimised graph to the traced value it computes: ResNet-18
/// (torchvision's repeated `relu` per block) optimised and run in FP32 matches the unoptimised
/// reference at every node, which it could not if a fused conv were compared before its
/// BatchNorm, residual add or ReLU.
#[test]
fn fused_nodes_are_compared_with_the_value_they_compute() {
    let traced = kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 64).expect("trace");
    let x = kiln::dev::weight("input.0", &[1, 3, 64, 64]);
    let reference = reference_of(&traced, &x);
    let optimized = kiln::engine::optimize(&traced).expect("optimize");
    let keys = kiln::dev::layerwise::fused_keys(&traced, &optimized);
    let (marked, pairs) = kiln::dev::layerwise::mark_intermediates(&optimized, &keys, &reference);
    let computed = optimized.nodes.iter().filter(|n| !n.op.is_leaf()).count();
    assert_eq!(pairs.len(), computed, "every node of the optimised graph has a reference");
    let got = kiln::run_cpu(&marked, &[("input", &x)]).expect("run");
    let mut worst = (0.0, String::new());
    for (key, id) in &pairs {
        let c = kiln::compare(key, &got[key], &reference[key]);
        if c.rel_l2 > worst.0 {
            worst = (c.rel_l2, format!("{} ({key})", optimized.nodes[*id].path));
        }
        assert!(c.passes(1e-5), "{} against {c}", optimized.nodes[*id].path);
    }
    println!("{} fused nodes against the traced reference; worst rel L2 {:.2e} at {}", pairs.len(), worst.0, worst.1);
    // e.g. layer1.0.conv2 absorbed bn2, the residual add and the block's second relu.
    let conv2 = pairs.iter().find(|(_, id)| optimized.nodes[*id].path == "layer1.0.conv2").map(|(k, _)| k.as_str());
    assert_eq!(conv2, Some("intermediate.layer1.0.relu#1"));
}

/// `kiln compare --layerwise` on INT8/FP8: `layerwise::run_quantised` runs the quantised graph
/// (here the CPU fake-quant simulation, as `--cpu` does) with every fused layer compared with the
/// FP32 reference: each layer's error is quantisation-sized (≤ 0.25; entropy clipping on these
/// digits gives 1e-2 at the stem, up to 2.1e-1 deeper in FP8, whose skip connections are e4m3
/// too), and
/// the marked outputs leave the logits exactly the simulation's.
#[test]
fn layerwise_runs_on_quantised_graphs() {
    let d = digits();
    let x = HostTensor::new(vec![4, 3, 32, 32], d.heldout.data[..4 * 3 * 1024].to_vec());
    let reference = reference_of(&d.graph, &x);
    let cache =
        Calibrator::new(&d.graph).and_then(|c| c.calibrate(std::slice::from_ref(&d.calib), CalibrationMethod::Entropy)).expect("calibrate");
    for format in [QuantFormat::Int8, QuantFormat::Fp8E4m3] {
        let sim = simulate(&d.graph, &cache, format).expect("simulate");
        let mut ran = None;
        let report = kiln::dev::layerwise::run_quantised(&d.graph, Some(&cache), format, &reference, 0.25, &[], |g, input| {
            ran = Some(g.clone());
            kiln::run_cpu(g, &[("input", input)])
        })
        .expect("layerwise");
        println!("{} simulation, layer by layer against FP32:\n{report}", format.name());
        let ran = ran.expect("executed");
        assert!(kiln::dev::quant::has_quant_nodes(&ran), "the executed graph is the Q/DQ graph");
        // The executed graph's layers, less the input's FP16 entry (`input.f16`, no layer of the
        // traced graph), which the simulation adds as the engine converts its f32 binding.
        let entry = |path: &str, dtype: kiln::DType| path.ends_with(".f16") && dtype == kiln::DType::F16;
        let layers = ran.nodes.iter().filter(|n| !n.op.is_leaf() && !matches!(n.op, Op::Quant(_)) && !entry(&n.path, n.dtype)).count();
        assert_eq!(report.layers.len(), layers, "every fused layer is compared");
        assert!(report.passes(), "quantisation error stays under 0.25 at every layer");
        let errors: Vec<f64> = report.layers.iter().map(|l| l.comparison.rel_l2).collect();
        assert!(errors.iter().all(|&e| e > 0.0), "every layer sees quantisation error: {errors:?}");
        let want = kiln::run_cpu(&sim, &[("input", &x)]).expect("simulation");
        let logits = kiln::compare("logits", &kiln::run_cpu(&ran, &[("input", &x)]).expect("run")["logits"], &want["logits"]);
        assert_eq!(logits.rel_l2, 0.0, "marking outputs changes nothing: {logits}");
    }
    // Without a cache (and no Q/DQ nodes in the graph) it is a clear error.
    let err = kiln::dev::layerwise::run_quantised(&d.graph, None, QuantFormat::Int8, &reference, 0.1, &[], |_, _| Ok(BTreeMap::new()))
        .expect_err("needs a cache");
    assert!(matches!(&err, Error::Config { reason } if reason.contains("--calibration-cache")), "{err}");
}

/// The graph an INT8 engine of the digits network is lowered from: optimised, quantised with a
/// min-max cache of the calibration images, weights folded onto their grids.
fn digits_int8_engine_graph(d: &Digits) -> kiln::Graph {
    let cache =
        Calibrator::new(&d.graph).and_then(|c| c.calibrate(std::slice::from_ref(&d.calib), CalibrationMethod::MinMax)).expect("calibrate");
    let path = std::env::temp_dir().join(format!("kiln-int8-{}-{:?}.json", std::process::id(), std::thread::current().id()));
    cache.save(&path).expect("save");
    let g = prepare_for_engine(kiln::engine::optimize(&d.graph).expect("optimize"), QuantFormat::Int8, Some(&path), &[]).expect("quantise");
    let _ = std::fs::remove_file(&path);
    g
}

/// Which values an INT8 engine of the digits network keeps in 8 bits (`kiln::dev::plan::eight_bit_plan`, no
/// GPU): every conv but the 3-channel stem runs on the 8-bit kernel; each block's input is one
/// stored tensor read by its convs (and as the skip connection); convs whose only reader is a
/// stored quantiser requantise into it. Below sm_80, in FP16, or for a conv a per-layer rule keeps
/// in FP16, nothing (or less) is 8-bit.
#[test]
fn eight_bit_plan_of_the_digits_network() {
    use kiln::{
        dev::plan::eight_bit_plan,
        engine::{BuildConfig, Precision},
    };
    let g = digits_int8_engine_graph(&digits());
    let plan_for = |config: &BuildConfig, sm: u32| eight_bit_plan(&g, config, sm);
    let names = |v: &[bool]| -> Vec<String> { v.iter().enumerate().filter(|(_, &b)| b).map(|(i, _)| g.nodes[i].path.clone()).collect() };
    let config = BuildConfig::default().precision(Precision::Int8);
    let plan = plan_for(&config, 90);
    let convs = names(&plan.conv);
    println!("8-bit convs {convs:?}\nstored {:?}", names(&plan.stored));
    let all_convs: Vec<String> = g.nodes.iter().filter(|n| matches!(n.op, Op::Conv(_))).map(|n| n.path.clone()).collect();
    assert_eq!(convs.len(), all_convs.len() - 1, "every conv but the stem: {convs:?} of {all_convs:?}");
    assert!(!convs.contains(&"conv1".to_string()), "the stem reads 3 channels");
    // The stem's quantiser (read by a conv the kernel cannot run) and the fc's stay FP16 Q/DQ.
    for (id, n) in g.nodes.iter().enumerate() {
        if let Op::Quant(_) = n.op {
            let readers: Vec<usize> = (0..g.nodes.len()).filter(|&r| g.nodes[r].inputs.contains(&id)).collect();
            assert_eq!(plan.stored[id], readers.iter().all(|&r| plan.conv[r]), "{}", n.path);
        }
    }
    // Every stored value written by an 8-bit conv comes from the conv's epilogue.
    for (id, q) in plan.requant.iter().enumerate() {
        if let Some(q) = q {
            assert!(plan.conv[id] && plan.stored[*q] && g.nodes[*q].inputs == [id], "{}", g.nodes[id].path);
        }
    }
    let requantising = plan.requant.iter().filter(|q| q.is_some()).count();
    println!("{requantising} convs requantise in their epilogue");
    assert!(requantising >= convs.len() - 2, "all but the last block's convs write 8-bit codes");
    assert_eq!(
        plan_for(&config, 75),
        kiln::dev::plan::EightBitPlan {
            format: None,
            conv: vec![false; g.nodes.len()],
            stored: vec![false; g.nodes.len()],
            requant: vec![None; g.nodes.len()],
            folded: vec![false; g.nodes.len()]
        }
    );
    assert!(plan_for(&BuildConfig::default().precision(Precision::Fp16), 90).conv.iter().all(|&b| !b));
    // A conv kept in FP16 by a per-layer rule leaves the kernel, and so does its input's storage.
    let kept = "layer2.0.conv1";
    let plan = plan_for(&config.clone().layer_precision(kept, Precision::Fp16), 90);
    let id = g.nodes.iter().position(|n| n.path == kept).expect("conv");
    assert!(!plan.conv[id] && !plan.stored[g.nodes[id].inputs[0]], "{kept} is FP16, its input is not stored");
}

/// Best's search (`engine::best::choose`, no GPU) on the digits network with made-up layer times:
/// every conv on INT8 when each is faster there, none when none is, the convs of one block moved
/// to 16 bits when their INT8 times are far worse, and kept on INT8 when they are worse by less
/// than the quantiser kernels the move would add cost.
#[test]
fn best_moves_convs_to_16_bits_only_where_it_pays() {
    use kiln::dev::plan::{best_int8_layers as choose, LayerTimes};
    use kiln::{
        dev::plan::eight_bit_plan,
        engine::{BuildConfig, Precision},
    };
    let d = digits();
    let cache =
        Calibrator::new(&d.graph).and_then(|c| c.calibrate(std::slice::from_ref(&d.calib), CalibrationMethod::MinMax)).expect("calibrate");
    let path = std::env::temp_dir().join(format!("kiln-best-choose-{}.json", std::process::id()));
    cache.save(&path).expect("save");
    let g = prepare_for_best(kiln::engine::optimize(&d.graph).expect("optimize"), Some(&path), &[]).expect("best graph");
    let _ = std::fs::remove_file(&path);
    let config = BuildConfig::default().precision(Precision::Best);
    let all = eight_bit_plan(&g, &config, 90);
    let int8: Vec<String> = g.nodes.iter().zip(&all.conv).filter(|(_, &c)| c).map(|(n, _)| n.path.clone()).collect();
    let block = "layer2.0.";
    let in_block = int8.iter().filter(|p| p.starts_with(block)).count();
    println!("INT8-capable convs {int8:?}; {in_block} in {block}");
    assert!(int8.len() >= 8 && in_block >= 2, "{int8:?}");
    let times = |f: &dyn Fn(&str) -> f64| -> LayerTimes { g.nodes.iter().map(|n| (n.path.clone(), f(&n.path))).collect() };
    let fp16 = times(&|_| 1.0);
    assert_eq!(choose(&g, &config, 90, 1, &fp16, &times(&|_| 0.5)), int8, "INT8 is faster everywhere");
    assert!(choose(&g, &config, 90, 1, &fp16, &times(&|_| 2.0)).is_empty(), "16 bits is faster everywhere");
    let slow_block = |by: f64| times(&|p: &str| if p.starts_with(block) { 1.0 + by } else { 0.5 });
    let chosen = choose(&g, &config, 90, 1, &fp16, &slow_block(2.0));
    let rest: Vec<String> = int8.iter().filter(|p| !p.starts_with(block)).cloned().collect();
    assert_eq!(chosen, rest, "{block}'s convs move to 16 bits, the others stay on INT8");
    // 1e-4 ms slower on INT8 each, but moving them needs quantiser kernels (2 µs or more each).
    assert_eq!(choose(&g, &config, 90, 1, &fp16, &slow_block(1e-4)), int8, "the quantisers a move needs cost more than it saves");
    // A per-layer choice already made is the plan's: only those convs are INT8.
    let mut kept = config.clone();
    kept.best_int8_layers = Some(rest.clone());
    let plan = eight_bit_plan(&g, &kept, 90);
    let planned: Vec<String> = g.nodes.iter().zip(&plan.conv).filter(|(_, &c)| c).map(|(n, _)| n.path.clone()).collect();
    assert_eq!(planned, rest);
}

/// The ResNet stem in an 8-bit engine (`kiln::dev::plan::eight_bit_plan`, no GPU): the 7×7 conv + ReLU +
/// max-pool runs on the 8-bit stem, which folds in the quantiser of its input (that quantiser is
/// neither lowered nor stored: the stem reads the FP16 input) and writes the codes of the
/// quantiser after it, which layer1's convs read. A per-layer rule keeping the stem in FP16 leaves
/// both quantisers to their own layers.
#[test]
fn eight_bit_plan_of_the_resnet_stem() {
    use kiln::{
        dev::plan::eight_bit_plan,
        engine::{BuildConfig, Precision},
    };
    let traced = kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 64).expect("trace");
    let x = kiln::dev::weight("input.0", &[2, 3, 64, 64]);
    let cache = Calibrator::new(&traced).and_then(|c| c.calibrate(std::slice::from_ref(&x), CalibrationMethod::MinMax)).expect("calibrate");
    let path = std::env::temp_dir().join(format!("kiln-stem8-{}.json", std::process::id()));
    cache.save(&path).expect("save");
    for (precision, format) in [(Precision::Int8, QuantFormat::Int8), (Precision::Fp8, QuantFormat::Fp8E4m3)] {
        let g = prepare_for_engine(kiln::engine::optimize(&traced).expect("optimize"), format, Some(&path), &[]).expect("quantise");
        let id = |p: &str| g.nodes.iter().position(|n| n.path == p).unwrap_or_else(|| panic!("no node {p}"));
        let (stem, q_in) = (id("conv1"), id("input.quantizer"));
        assert_eq!(g.nodes[stem].inputs[0], q_in, "the stem reads the input's quantiser");
        let config = BuildConfig::default().precision(precision);
        let plan = eight_bit_plan(&g, &config, 90);
        let q_out = plan.requant[stem].unwrap_or_else(|| panic!("{precision:?}: the stem writes the codes of the quantiser after it"));
        println!("{precision:?}: conv1 writes {}, folds {}", g.nodes[q_out].path, g.nodes[q_in].path);
        assert!(plan.conv[stem] && plan.stored[q_out], "{precision:?}");
        assert!(plan.folded[q_in] && !plan.stored[q_in], "{precision:?}: the input's quantiser folds into the stem");
        assert_eq!(plan.folded.iter().filter(|&&f| f).count(), 1, "only the stem folds a quantiser");
        for r in (0..g.nodes.len()).filter(|&r| g.nodes[r].inputs.contains(&q_out)) {
            assert!(plan.conv[r], "{} reads the stem's codes on an 8-bit kernel", g.nodes[r].path);
        }
        let kept = config.clone().layer_precision("conv1", Precision::Fp16);
        let plan = eight_bit_plan(&g, &kept, 90);
        assert!(!plan.conv[stem] && !plan.folded[q_in] && plan.requant[stem].is_none(), "{precision:?}: an FP16 stem");
    }
    let _ = std::fs::remove_file(&path);
}

/// An INT8 engine's graph through the engine file: every folded weight keeps its 8-bit grid
/// (`Op::Weight::quant`, which the 8-bit convs read their codes and scales from), so a loaded
/// engine plans the same 8-bit layers as the build did.
#[test]
fn weight_grids_survive_the_engine_file() {
    use kiln::files::engine::{decode, encode, Header, Payload, FORMAT_VERSION};
    use kiln::{
        dev::plan::eight_bit_plan,
        engine::{BuildConfig, Precision},
    };
    let g = digits_int8_engine_graph(&digits());
    let grids = g.nodes.iter().filter(|n| matches!(&n.op, Op::Weight { quant: Some(q), .. } if q.axis == Some(0))).count();
    assert_eq!(grids, 10, "every 8-bit layer's weight is on a per-channel int8 grid");
    let config = BuildConfig::default().precision(Precision::Int8);
    let header = Header { version: FORMAT_VERSION, sm: 90, driver_version: 13000, cudnn_version: 91400 };
    let payload = Payload { config: config.clone(), graph: g.clone(), tactics: Default::default() };
    let (_, loaded) = decode(&encode(&header, &payload).expect("encode"), "digits.kiln").expect("decode");
    assert_eq!(loaded.graph.nodes, g.nodes, "ops, grids included, survive");
    let plan = |g: &kiln::Graph| eight_bit_plan(g, &config, 90);
    assert_eq!(plan(&loaded.graph), plan(&g));
}

/// Where FP8 and Best engines offer the FP8 GEMM (`fp8_gemm::problem`, the planning half of the
/// candidate, no GPU): on the transformer-like graph, the Linears whose k and n are multiples of
/// 16 (rows per image: the 8 tokens, 1 after the flatten), each with its input quantiser's scale
/// (Best's INT8 range read as e4m3: scale × 127 / 448); none in FP16 or INT8 engines. On a block
/// of 1×1 convs and a 3×3 conv, the 1×1 convs (H·W rows per image) and not the 3×3.
#[test]
fn fp8_gemm_candidates_go_to_aligned_linears_and_pointwise_convs() {
    use kiln::dev::plan::{fp8_gemm_problem as problem, Fp8Problem};
    use kiln::engine::Precision;
    let plan = |graph: &Graph, input: &HostTensor, what: &str| {
        let optimized = kiln::engine::optimize(graph).expect("optimize");
        let cache =
            Calibrator::new(graph).and_then(|c| c.calibrate(std::slice::from_ref(input), CalibrationMethod::MinMax)).expect("calibrate");
        let path = std::env::temp_dir().join(format!("kiln-fp8-plan-{what}-{}.json", std::process::id()));
        cache.save(&path).expect("save");
        let fp8 = prepare_for_engine(optimized.clone(), QuantFormat::Fp8E4m3, Some(&path), &[]).expect("fp8");
        let int8 = prepare_for_engine(optimized.clone(), QuantFormat::Int8, Some(&path), &[]).expect("int8");
        let best = prepare_for_best(optimized.clone(), Some(&path), &[]).expect("best");
        let _ = std::fs::remove_file(&path);
        let problems = |g: &Graph, p: Precision| -> BTreeMap<String, Fp8Problem> {
            (0..g.nodes.len()).filter_map(|id| problem(g, id, p).map(|f| (g.nodes[id].path.clone(), f))).collect()
        };
        // Each candidate's scale is its input quantiser's: the cache's fp8 scale of the tensor.
        let input_range = |g: &Graph, path: &str| {
            let node = g.nodes.iter().find(|n| n.path == path && !matches!(n.op, Op::Quant(_))).expect("node");
            let q = &g.nodes[node.inputs[0]];
            cache.tensors[q.path.trim_end_matches(".quantizer")]
        };
        assert!(problems(&optimized, Precision::Fp16).is_empty(), "{what}: an FP16 graph has no quantisers");
        assert!(problems(&fp8, Precision::Fp16).is_empty() && problems(&int8, Precision::Int8).is_empty(), "{what}");
        let (on_fp8, on_best) = (problems(&fp8, Precision::Fp8), problems(&best, Precision::Best));
        for (path, p) in &on_fp8 {
            let range = input_range(&fp8, path);
            assert_eq!(p.sx, range.fp8_scale, "{what} {path}");
            assert_eq!(on_best[path].sx, range.int8_scale * 127.0 / 448.0, "{what} {path}: Best clips at the INT8 range");
            assert_eq!(Fp8Problem { sx: p.sx, ..on_best[path] }, *p, "{what} {path}: the same GEMM in Best");
        }
        assert_eq!(on_fp8.len(), on_best.len(), "{what}");
        on_fp8.into_iter().map(|(path, p)| (path, [p.k, p.n, p.rows_per_image], p.channels_last)).collect::<Vec<_>>()
    };
    let graph = transformer_like(2);
    let input = kiln::dev::uniform_tensor(&[2, 8, 64], 3);
    let linears = plan(&graph, &input, "transformer");
    println!("transformer-like: {linears:?}");
    assert_eq!(
        linears,
        [("cls".to_string(), [512, 32, 1], false), ("fc1".to_string(), [64, 128, 8], false), ("fc2".to_string(), [128, 64, 8], false)]
    );

    let tracer = Tracer::new();
    let x = tracer.input("input", &[2, 32, 7, 5]);
    let vb = VarBuilder::seeded();
    let conv = |name: &str, cfg: Conv2dConfig, t: &kiln::Tensor| Conv2d::load(vb.pp(name), &cfg)?.forward(t);
    let h = conv("c1", Conv2dConfig::new(32, 64, 1), &x).and_then(|h| h.relu()).expect("c1");
    let y = conv("c2", Conv2dConfig::new(64, 32, 1), &h).and_then(|y| y.add(&x)).and_then(|y| y.relu()).expect("c2");
    conv("c3", Conv2dConfig::new(32, 32, 3).padding(1), &y).expect("c3").mark_output("y");
    let graph = tracer.graph();
    let convs = plan(&graph, &kiln::dev::uniform_tensor(&[2, 32, 7, 5], 5), "convs");
    println!("convs: {convs:?}");
    assert_eq!(convs, [("c1".to_string(), [32, 64, 35], true), ("c2".to_string(), [64, 32, 35], true)]);
}

/// What bias correction does to the FP8 simulations of ResNets (seeded weights, random inputs,
/// calibrated on other random inputs with the default method): rel L2 and min cosine of the
/// logits against FP32 with the cache's input means and without them (INT8, which never
/// corrects, for comparison). A diagnosis:
/// prints the table of docs/QUANT.md ("Bias correction"). `KILN_BIAS_MODELS` picks the models
/// (default `resnet18,resnet50`).
#[test]
#[ignore = "a diagnosis (minutes on two cores): prints docs/QUANT.md's bias-correction table"]
fn bias_correction_on_resnet_simulations() {
    let models = std::env::var("KILN_BIAS_MODELS").unwrap_or_else(|_| "resnet18,resnet50".into());
    let n = 4;
    for model in models.split(',') {
        let graph = kiln_models::trace(model, VarBuilder::seeded(), n, 224).expect("trace");
        let input = kiln::dev::uniform_tensor(&[n, 3, 224, 224], 50);
        let input = HostTensor::new(input.shape.clone(), input.data.iter().map(|v| v * 2.0).collect());
        let calib: Vec<HostTensor> = (0..4)
            .map(|i| {
                let t = kiln::dev::uniform_tensor(&[2, 3, 224, 224], 500 + i);
                HostTensor::new(t.shape.clone(), t.data.iter().map(|v| v * 2.0).collect())
            })
            .collect();
        let t = std::time::Instant::now();
        let stats = Calibrator::new(&graph).expect("calibrator").collect(&calib).expect("calibrate");
        println!(
            "{model}: calibrated on 8 images in {:.1} s, {} layers with input means",
            t.elapsed().as_secs_f64(),
            stats.input_means.len()
        );
        let fp32 = kiln::run_cpu(&graph, &[("input", &input)]).expect("fp32").remove("logits").expect("logits");
        for format in [QuantFormat::Int8, QuantFormat::Fp8E4m3] {
            for corrected in [false, true].into_iter().filter(|&c| !c || format == QuantFormat::Fp8E4m3) {
                let mut cache = stats.cache(CalibrationMethod::default());
                if !corrected {
                    cache.input_means.clear();
                }
                let sim = simulate(&graph, &cache, format).expect("simulate");
                let got = kiln::run_cpu(&sim, &[("input", &input)]).expect("sim").remove("logits").expect("logits");
                let rel = kiln::compare("logits", &got, &fp32).rel_l2;
                let classes = fp32.shape[1];
                let cos = got
                    .data
                    .chunks_exact(classes)
                    .zip(fp32.data.chunks_exact(classes))
                    .map(|(a, b)| {
                        let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
                        let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
                        dot / (norm(a) * norm(b))
                    })
                    .fold(f64::INFINITY, f64::min);
                println!(
                    "{model} {} {}: rel L2 {rel:.3e}, min cosine {cos:.5}",
                    format.name(),
                    if corrected { "bias-corrected" } else { "as before" }
                );
            }
        }
    }
}
