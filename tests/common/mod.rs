//! Helpers shared by the GPU tests: the GPU (or the reason there is none), fresh random inputs,
//! and `check`, which runs a traced graph as an engine (FP32 and FP16, batch 1 and 3) against the
//! CPU executor.
#![allow(dead_code)]

use kiln::engine::{gpu_available, BuildConfig, CalibrationCache, CalibrationMethod, Calibrator, Engine, EngineBuilder, Gpu, Precision};
use kiln::{Graph, HostTensor};
use kiln::{Tensor, Tracer};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// The GPU, opened once per test binary; `None` (with the reason printed) where there is none.
pub fn gpu() -> Option<Arc<Gpu>> {
    static GPU: OnceLock<Result<Arc<Gpu>, String>> = OnceLock::new();
    match GPU.get_or_init(|| gpu_available().and_then(|()| Gpu::new(0).map_err(|e| e.to_string()))) {
        Ok(g) => Some(g.clone()),
        Err(why) => {
            println!("skipped: no GPU ({why})");
            None
        }
    }
}

/// Batch sizes every engine runs (built for 1..=3, one engine for all).
pub const BATCHES: [usize; 2] = [1, 3];

/// Uniform inputs in [-scale, scale), fresh every run (`KILN_SEED` replays), one stream per `stream`.
pub fn random(shape: &[usize], stream: u64, scale: f32) -> HostTensor {
    let mut t = kiln::dev::uniform_tensor(shape, kiln::dev::run_seed().wrapping_add(stream));
    t.data.iter_mut().for_each(|v| *v *= scale);
    t
}

/// Rounds to f16 and back: what an FP16 engine sees of an input.
pub fn to_f16(t: &HostTensor) -> HostTensor {
    HostTensor::new(t.shape.clone(), t.data.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect())
}

pub fn rel_l2(got: &[f32], want: &[f32]) -> (f64, f64) {
    let (mut num, mut den, mut max_abs) = (0f64, 0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = (g - w) as f64;
        num += d * d;
        den += (w as f64) * (w as f64);
        max_abs = max_abs.max(d.abs());
    }
    ((num / den.max(1e-30)).sqrt(), max_abs)
}

pub fn build(gpu: &Arc<Gpu>, graph: &Graph, precision: Precision) -> Arc<Engine> {
    build_with(gpu, graph, precision, None)
}

/// [`build`], its layers' candidates restricted to `sources` (kind prefixes) where a layer has one.
pub fn build_with(gpu: &Arc<Gpu>, graph: &Graph, precision: Precision, sources: Option<&[&str]>) -> Arc<Engine> {
    let mut config = BuildConfig::default().precision(precision).batch(1, 3, 3).cuda_graphs(false);
    if let Some(sources) = sources {
        config = config.tactic_sources(sources);
    }
    Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(graph).unwrap_or_else(|e| panic!("build ({precision:?}): {e}")))
}

/// Traces `f` over inputs of the given per-image shapes (batch 1), then for each precision and
/// batch runs the engine and the CPU executor on fresh random inputs and compares every output.
pub fn check(name: &str, inputs: &[(&str, &[usize])], f: impl Fn(&[Tensor]) -> kiln::Result<Vec<Tensor>>) {
    check_forced(name, None, inputs, f)
}

/// [`check`] with the engines' candidates restricted to `kind` (a kind prefix) where a layer has
/// one, and a layer of that kind asserted to be in each engine.
pub fn check_forced(name: &str, kind: Option<&str>, inputs: &[(&str, &[usize])], f: impl Fn(&[Tensor]) -> kiln::Result<Vec<Tensor>>) {
    let Some(gpu) = gpu() else { return };
    let tracer = Tracer::new();
    let xs: Vec<Tensor> = inputs.iter().map(|(n, s)| tracer.input(n, &[&[1][..], s].concat())).collect();
    for (i, y) in f(&xs).unwrap_or_else(|e| panic!("{name}: trace: {e}")).iter().enumerate() {
        tracer.output(&format!("y{i}"), y);
    }
    let graph = tracer.graph();
    for (precision, tol) in [(Precision::Fp32, 1e-5), (Precision::Fp16, 1e-2)] {
        let sources = kind.map(|k| [k]);
        let engine = build_with(&gpu, &graph, precision, sources.as_ref().map(|s| &s[..]));
        if let Some(kind) = kind {
            assert!(engine.layers().any(|l| l.kind().starts_with(kind)), "{name} {precision:?}: no {kind} layer");
        }
        let mut ctx = engine.context().expect("context");
        for (k, batch) in BATCHES.into_iter().enumerate() {
            let seed = name.bytes().fold(k as u64 * 7919, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
            let host: Vec<HostTensor> =
                inputs.iter().enumerate().map(|(i, (_, s))| random(&[&[batch][..], s].concat(), seed + i as u64, 2.0)).collect();
            let bound: Vec<(&str, &HostTensor)> = inputs.iter().zip(&host).map(|((n, _), t)| (*n, t)).collect();
            let want = kiln::run_cpu(&graph, &bound).unwrap_or_else(|e| panic!("{name}: cpu: {e}"));
            let got = ctx.run(&bound).unwrap_or_else(|e| panic!("{name} {precision:?} batch {batch}: {e}"));
            for (out, w) in &want {
                let g = &got[out];
                assert_eq!(g.shape, w.shape, "{name} {out}");
                let (rel, max_abs) = rel_l2(&g.data, &w.data);
                println!("{name:<34} {precision:?} batch {batch} {out} {:?}: rel L2 {rel:.2e}, max abs {max_abs:.2e}", w.shape);
                assert!(rel <= tol, "{name} {precision:?} batch {batch} {out}: rel L2 {rel:.3e} > {tol:e}");
            }
        }
    }
}

/// Reference detections found among ours: same class, centre within 0.1 pixel of the map.
pub fn matching_detections(got: &HostTensor, want: &HostTensor, image: usize) -> usize {
    let k = want.shape[1];
    let rows = |t: &HostTensor| -> Vec<[f32; 6]> {
        t.data[image * k * 6..(image + 1) * k * 6].chunks_exact(6).map(|r| r.try_into().expect("6 columns")).collect()
    };
    let (g, w) = (rows(got), rows(want));
    let centre = |r: &[f32; 6]| ((r[0] + r[2]) / 2.0, (r[1] + r[3]) / 2.0);
    w.iter()
        .filter(|wr| {
            let (wx, wy) = centre(wr);
            g.iter().any(|gr| {
                let (gx, gy) = centre(gr);
                gr[5] == wr[5] && (gx - wx).abs() < 0.1 && (gy - wy).abs() < 0.1
            })
        })
        .count()
}

/// A depthwise conv case: (channels, H, W, kernel, stride, padding, bias, relu, residual).
pub type DepthwiseCase = (usize, usize, usize, usize, usize, usize, bool, bool, bool);

/// The block a depthwise case traces: the conv (seeded weights), then the residual add and the
/// ReLU where the case asks for them.
pub fn depthwise_block(x: &Tensor, case: DepthwiseCase) -> kiln::Result<Tensor> {
    use kiln::nn::{Conv2d, Conv2dConfig};
    use kiln::{Forward, Module, VarBuilder};
    let (c, _, _, k, stride, padding, bias, relu, residual) = case;
    let cfg = Conv2dConfig::new(c, c, k).stride(stride).padding(padding).groups(c).bias(bias);
    let mut y = Conv2d::load(VarBuilder::seeded().pp("dw"), &cfg)?.forward(x)?;
    if residual {
        y = y.add(x)?;
    }
    if relu {
        y = y.relu()?;
    }
    Ok(y)
}

/// A min-max calibration cache of `graph` over `input`, saved to a temporary file named after
/// `name` for the builds to read.
pub fn min_max_cache(graph: &Graph, input: &HostTensor, name: &str) -> (CalibrationCache, PathBuf) {
    let cache =
        Calibrator::new(graph).and_then(|c| c.calibrate(std::slice::from_ref(input), CalibrationMethod::MinMax)).expect("calibrate");
    let path = std::env::temp_dir().join(format!("kiln-{name}-{}.json", std::process::id()));
    cache.save(&path).expect("save");
    (cache, path)
}
