//! `kiln bench` (latency percentiles and throughput, trtexec-style) and `kiln profile` (per-layer
//! device time by module path).

use super::common::{self, ms, InputData};
use super::{BenchArgs, ProfileArgs, TargetArgs};
use kiln::engine::{Engine, ExecutionContext};
use kiln::{Error, Result};
use serde::{Deserialize, Serialize};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One benchmark result, as written by `--json` (read by tools/bench_side_by_side.py).
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct Record {
    pub model: String,
    pub batch: usize,
    pub size: usize,
    /// fp16 | fp32 | tf32 | cpu-f32
    pub precision: String,
    /// `cuda-graph`, `no-graph` or `cpu`.
    pub mode: String,
    pub median_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub mean_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    /// Population standard deviation of the per-run times.
    pub std_ms: f64,
    /// The `--percentile` values asked for, by percentile (`"99.9"`).
    #[serde(default)]
    pub percentiles_ms: std::collections::BTreeMap<String, f64>,
    pub iterations: usize,
    /// Images per second over the whole timed loop (batch × runs / time).
    pub img_s: f64,
    pub device: String,
    pub driver_version: u32,
    pub cudnn_version: u32,
    pub build_seconds: f64,
    /// Median device time of the same runs, between two CUDA events on the stream (trtexec's "GPU
    /// Compute Time"): what PyTorch peers timed with CUDA events are compared with. `None` on the
    /// CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_median_ms: Option<f64>,
}

/// Latency statistics of a list of per-run times (ms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
    pub min: f64,
    pub max: f64,
    pub std: f64,
}

/// The nearest-rank `p`-th percentile of sorted `times` (NaN when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let n = sorted.len();
    if n == 0 {
        return f64::NAN;
    }
    sorted[((p / 100.0 * n as f64).ceil() as usize).clamp(1, n) - 1]
}

/// Nearest-rank percentiles, mean, extremes and standard deviation of `times` (sorted here).
pub fn stats(times: &mut [f64]) -> Stats {
    times.sort_by(f64::total_cmp);
    let n = times.len();
    if n == 0 {
        let nan = f64::NAN;
        return Stats { median: nan, p90: nan, p99: nan, mean: nan, min: nan, max: nan, std: nan };
    }
    let mean = times.iter().sum::<f64>() / n as f64;
    let std = (times.iter().map(|t| (t - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
    Stats {
        median: percentile(times, 50.0),
        p90: percentile(times, 90.0),
        p99: percentile(times, 99.0),
        mean,
        min: times[0],
        max: times[n - 1],
        std,
    }
}

/// One timed series as `--export-times` writes it: every run's latency in order (trtexec's
/// --exportTimes, grouped per model, batch and mode).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Times {
    pub model: String,
    pub batch: usize,
    pub precision: String,
    pub mode: String,
    /// Milliseconds since the first timed run started, per run.
    pub start_ms: Vec<f64>,
    pub latency_ms: Vec<f64>,
}

/// What `bench` measured: a record per series (`--json`) and every run's time (`--export-times`).
#[derive(Default)]
struct Results {
    records: Vec<Record>,
    series: Vec<Times>,
}

impl Results {
    /// Prints a record and keeps it, with its per-run times.
    fn keep(&mut self, r: Record, batch: usize, timed: Timed) -> Result<()> {
        print_record(&r)?;
        self.series.push(Times {
            model: r.model.clone(),
            batch,
            precision: r.precision.clone(),
            mode: r.mode.clone(),
            start_ms: timed.starts,
            latency_ms: timed.times,
        });
        self.records.push(r);
        Ok(())
    }
}

/// Checks `--percentile` values: each within 0..=100.
fn check_percentiles(ps: &[f64]) -> Result<()> {
    match ps.iter().find(|p| !(0.0..=100.0).contains(*p)) {
        Some(p) => Err(Error::Flag { flag: "--percentile".into(), reason: format!("must be within 0 and 100, got {p}") }),
        None => Ok(()),
    }
}

/// A timed loop's result: each run's start (ms since the first) and latency (ms), and the total.
pub struct Timed {
    pub starts: Vec<f64>,
    pub times: Vec<f64>,
    pub total_s: f64,
}

/// Runs `once` for `warmup`, then at least `iterations` times and at least `duration`.
fn time_loop(warmup: Duration, iterations: usize, duration: Duration, mut once: impl FnMut() -> Result<()>) -> Result<Timed> {
    let start = Instant::now();
    once()?;
    while start.elapsed() < warmup {
        once()?;
    }
    let (mut times, mut starts) = (Vec::new(), Vec::new());
    let start = Instant::now();
    while times.len() < iterations.max(1) || start.elapsed() < duration {
        let t = Instant::now();
        starts.push(t.duration_since(start).as_secs_f64() * 1e3);
        once()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(Timed { starts, times, total_s: start.elapsed().as_secs_f64() })
}

fn print_record(r: &Record) -> Result<()> {
    let extra: String = r.percentiles_ms.iter().map(|(p, v)| format!("  p{p} {:>10}", ms(*v))).collect();
    let device = r.gpu_median_ms.map(|gpu| format!("  GPU compute median {:>10}", ms(gpu))).unwrap_or_default();
    say!(
        "{:<10} batch {:<4} {:<7} {:<10} median {:>10}  p90 {:>10}  p99 {:>10}{extra}  max {:>10}  std {:>10}{device}  {:>10.1} images/s  ({} runs)",
        r.model,
        r.batch,
        r.precision,
        r.mode,
        ms(r.median_ms),
        ms(r.p90_ms),
        ms(r.p99_ms),
        ms(r.max_ms),
        ms(r.std_ms),
        r.img_s,
        r.iterations
    );
    Ok(())
}

fn record(model: &str, batch: usize, size: usize, precision: &str, mode: &str, timed: &Timed, percentiles: &[f64]) -> Record {
    let (mut times, total_s) = (timed.times.clone(), timed.total_s);
    let s = stats(&mut times);
    Record {
        model: model.to_string(),
        batch,
        size,
        precision: precision.to_string(),
        mode: mode.to_string(),
        median_ms: s.median,
        p90_ms: s.p90,
        p99_ms: s.p99,
        mean_ms: s.mean,
        min_ms: s.min,
        max_ms: s.max,
        std_ms: s.std,
        percentiles_ms: percentiles.iter().map(|&p| (p.to_string(), percentile(&times, p))).collect(),
        iterations: times.len(),
        img_s: batch as f64 * times.len() as f64 / total_s.max(1e-12),
        device: String::new(),
        driver_version: 0,
        cudnn_version: 0,
        build_seconds: 0.0,
        gpu_median_ms: None,
    }
}

/// The input size of an engine whose first input is an image ([3, S, S] per image); 0 otherwise.
fn engine_size(engine: &Engine) -> usize {
    engine.inputs().first().filter(|(_, dims)| dims.len() == 3).map_or(0, |(_, dims)| dims[1])
}

/// Random data for every input of an engine at `batch` (random bytes for a u8 input), its image
/// input at `hw` when given.
fn engine_inputs(engine: &Engine, batch: usize, hw: Option<[usize; 2]>) -> Result<Vec<(String, InputData)>> {
    let mut inputs = common::engine_inputs(engine);
    if inputs.is_empty() {
        return Err(Error::Binding { name: "input".into(), reason: "the engine has no input".into() });
    }
    if let (Some(hw), 3) = (hw, inputs[0].dims.len()) {
        inputs[0].dims[1..].copy_from_slice(&hw);
    }
    common::random_inputs(&inputs, batch, kiln::dev::fresh_seed())
}

impl TargetArgs {
    /// The model argument: the positional one or `--loadEngine`.
    fn name(&self) -> String {
        self.model.clone().or_else(|| self.load_engine.as_ref().map(|p| p.display().to_string())).unwrap_or_default()
    }

    /// The batch and H × W that `--shapes input:NxCxHxW` and `--size` ask for (they must agree).
    fn shape(&self) -> Result<(Option<usize>, Option<[usize; 2]>)> {
        let (batch, hw) = match self.shapes.as_ref().map(|s| s.0.as_slice()) {
            None => (None, None),
            Some([one]) if one.dims.len() == 4 => (Some(one.dims[0]), Some([one.dims[2], one.dims[3]])),
            Some(other) => {
                let given: Vec<String> = other.iter().map(|s| format!("{}:{}", s.name, super::shapes::dims_text(&s.dims))).collect();
                let reason = format!("expected one input `input:NxCxHxW`, got {}", given.join(","));
                return Err(Error::Flag { flag: "--shapes".into(), reason });
            }
        };
        match (hw, self.size) {
            (Some(hw), Some(s)) if hw != [s, s] => {
                Err(Error::Flag { flag: "--size".into(), reason: format!("{s} disagrees with --shapes ({}x{})", hw[0], hw[1]) })
            }
            (Some(hw), _) => Ok((batch, Some(hw))),
            (None, s) => Ok((batch, s.map(|s| [s, s]))),
        }
    }
}

fn write_json<T: Serialize>(path: &std::path::Path, what: &str, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value).map_err(|e| Error::Serialize { what: what.into(), reason: e.to_string() })?;
    std::fs::write(path, text + "\n").map_err(Error::io(path))?;
    tracing::info!("wrote {} ({what})", path.display());
    Ok(())
}

pub fn bench(a: BenchArgs) -> Result<ExitCode> {
    let model = a.target.name();
    let warmup = Duration::from_millis(a.warmup);
    let duration = Duration::try_from_secs_f64(a.duration).map_err(|_| Error::Flag {
        flag: "--duration".into(),
        reason: format!("must be a finite, non-negative number of seconds, got {}", a.duration),
    })?;
    check_percentiles(&a.percentile)?;
    let (shape_batch, hw) = a.target.shape()?;
    let batches = match shape_batch {
        Some(b) => vec![b],
        None => a.batch.clone(),
    };
    if batches.is_empty() || batches.contains(&0) {
        return Err(Error::Binding { name: "batch".into(), reason: format!("batch sizes must be positive, got {batches:?}") });
    }
    let timing = (warmup, a.iterations, duration);
    let results = if a.cpu { bench_cpu(&a, &model, &batches, hw, timing)? } else { bench_gpu(&a, &model, &batches, hw, timing)? };
    if let Some(path) = &a.json {
        write_json(path, "the results", &results.records)?;
    }
    if let Some(path) = &a.export_times {
        write_json(path, "per-run times", &results.series)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `(warm-up, at least this many runs, at least this long)`, as `time_loop` takes them.
type Timing = (Duration, usize, Duration);

/// `bench --cpu`: the CPU executor on the optimised graph, a trace per batch.
fn bench_cpu(a: &BenchArgs, model: &str, batches: &[usize], hw: Option<[usize; 2]>, timing: Timing) -> Result<Results> {
    if common::is_engine_file(model) {
        return Err(Error::Flag { flag: "--cpu".into(), reason: format!("benchmarks a model or graph file, not the engine file {model}") });
    }
    let mut results = Results::default();
    for &batch in batches {
        let traced = common::load(model, a.target.weights.as_deref(), false, batch, hw)?;
        common::check_shapes(a.target.shapes.as_ref(), &common::graph_inputs(&traced.graph), &traced.name)?;
        let graph = kiln::engine::optimize(&traced.graph)?;
        common::check_cpu_memory(&graph, batch, &traced.hw_text())?;
        let inputs = common::random_inputs(&common::graph_inputs(&graph), batch, kiln::dev::fresh_seed())?;
        let bound = common::bind(&inputs);
        let timed = time_loop(timing.0, timing.1, timing.2, || kiln::run_cpu(&graph, &bound).map(|_| ()))?;
        let size = traced.hw.map_or(0, |[_, w]| w);
        let mut r = record(&traced.name, batch, size, "cpu-f32", "cpu", &timed, &a.percentile);
        r.device = "CPU executor".into();
        results.keep(r, batch, timed)?;
    }
    Ok(results)
}

/// `bench` on the GPU: an engine file runs every batch within its range; a model or graph file
/// gets an engine per batch. Each is timed with and without CUDA graphs, as asked.
fn bench_gpu(a: &BenchArgs, model: &str, batches: &[usize], hw: Option<[usize; 2]>, timing: Timing) -> Result<Results> {
    let gpu = common::gpu().map_err(|e| match e {
        Error::NoGpu(reason) => Error::NoGpu(format!("{reason}; `kiln bench --cpu` times the CPU reference executor instead")),
        e => e,
    })?;
    let modes: Vec<bool> = match (a.cuda_graphs_only, a.no_cuda_graphs) {
        (true, _) => vec![true],
        (_, true) => vec![false],
        _ => vec![true, false],
    };
    let loaded = if common::is_engine_file(model) {
        let (min, max) = (batches.iter().min().copied().unwrap_or(1), batches.iter().max().copied().unwrap_or(1));
        Some(Arc::new(common::engine_for(model, None, hw, &a.engine, (min, max, max), gpu.clone())?.1))
    } else {
        None
    };
    let mut results = Results::default();
    for &batch in batches {
        let (name, engine) = match &loaded {
            Some(e) => (model.to_string(), e.clone()),
            None => {
                let (name, e) = common::engine_for(model, a.target.weights.as_ref(), hw, &a.engine, (batch, batch, batch), gpu.clone())?;
                (name, Arc::new(e))
            }
        };
        common::check_shapes(a.target.shapes.as_ref(), &common::engine_inputs(&engine), &name)?;
        let inputs = engine_inputs(&engine, batch, hw)?;
        let mut ctx: ExecutionContext = engine.context()?;
        ctx.run(&common::bind(&inputs))?;
        for &graphs in &modes {
            ctx.set_cuda_graphs(graphs);
            // Each run between two events on the stream: the host's latency (the wall clock around
            // the call) and the device's time (the events) of the same runs.
            let mut device_ms = Vec::new();
            let timed = time_loop(timing.0, timing.1, timing.2, || {
                device_ms.push(ctx.execute_timed(batch)?);
                Ok(())
            })?;
            let mut device_ms = device_ms.split_off(device_ms.len().saturating_sub(timed.times.len()));
            let mode = if graphs { "cuda-graph" } else { "no-graph" };
            let mut r = record(&name, batch, engine_size(&engine), engine.config.precision.short_name(), mode, &timed, &a.percentile);
            r.gpu_median_ms = Some(stats(&mut device_ms).median);
            let info = &engine.gpu().info;
            (r.device, r.driver_version, r.cudnn_version) = (info.name.clone(), info.driver_version, info.cudnn_version);
            r.build_seconds = engine.summary.build_seconds;
            results.keep(r, batch, timed)?;
        }
    }
    Ok(results)
}

/// One layer's time as `profile --json/--csv` write it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct LayerTime {
    /// The layer's index in execution order.
    pub index: usize,
    pub path: String,
    pub kind: String,
    pub time_ms: f64,
    /// Percent of the sum of all layers.
    pub share: f64,
}

/// Layer times as CSV (`index,path,kind,time_ms,share`), paths quoted.
pub fn layers_csv(rows: &[LayerTime]) -> String {
    let quote = |s: &str| format!("\"{}\"", s.replace('"', "\"\""));
    let mut out = String::from("index,path,kind,time_ms,share\n");
    for r in rows {
        out += &format!("{},{},{},{},{}\n", r.index, quote(&r.path), quote(&r.kind), r.time_ms, r.share);
    }
    out
}

pub fn profile(a: ProfileArgs) -> Result<ExitCode> {
    let model = a.target.name();
    let (shape_batch, hw) = a.target.shape()?;
    let batch = shape_batch.unwrap_or(a.batch);
    if batch == 0 {
        return Err(Error::Flag { flag: "--batch".into(), reason: "must be at least 1".into() });
    }
    let gpu = common::gpu()?;
    let (name, engine) = common::engine_for(&model, a.target.weights.as_ref(), hw, &a.engine, (batch, batch, batch), gpu)?;
    common::check_shapes(a.target.shapes.as_ref(), &common::engine_inputs(&engine), &name)?;
    let engine = Arc::new(engine);
    let inputs = engine_inputs(&engine, batch, hw)?;
    let mut ctx = engine.context()?;
    ctx.set_cuda_graphs(false);
    ctx.run(&common::bind(&inputs))?;
    let times = ctx.profile_layers(batch, a.iterations.max(1))?;
    let plan = ctx.plan().clone();
    let layers: Vec<_> = plan.layers().collect();
    let total: f64 = times.iter().sum();
    let mut rows: Vec<(usize, f64)> = times.iter().copied().enumerate().collect();
    rows.sort_by(|x, y| y.1.total_cmp(&x.1));
    let shown = if a.top == 0 { rows.len() } else { a.top.min(rows.len()) };
    say!(
        "{name}: batch {}, {}, {} layers; each layer captured alone in a CUDA graph, mean of {} back-to-back replays",
        batch,
        engine.config.precision.short_name(),
        layers.len(),
        a.iterations.max(1)
    );
    say!("{:>4} {:<40} {:<34} {:>10} {:>7} {:>7}", "#", "module path", "layer", "time", "share", "cum.");
    let mut cum = 0.0;
    for &(i, t) in rows.iter().take(shown) {
        cum += t;
        let share = 100.0 * t / total.max(1e-12);
        say!(
            "{i:>4} {:<40} {:<34} {:>10} {share:>6.1}% {:>6.1}%",
            layers[i].path(),
            layers[i].kind(),
            ms(t),
            100.0 * cum / total.max(1e-12)
        );
    }
    if shown < rows.len() {
        say!("({} faster layers not shown)", rows.len() - shown);
    }
    say!("sum of layers: {} ({:.1} images/s if run back to back)", ms(total), batch as f64 / (total / 1e3).max(1e-12));
    let all: Vec<LayerTime> = times
        .iter()
        .enumerate()
        .map(|(i, &t)| LayerTime {
            index: i,
            path: layers[i].path().to_string(),
            kind: layers[i].kind().to_string(),
            time_ms: t,
            share: 100.0 * t / total.max(1e-12),
        })
        .collect();
    if let Some(path) = &a.json {
        write_json(path, "per-layer times", &all)?;
    }
    if let Some(path) = &a.csv {
        std::fs::write(path, layers_csv(&all)).map_err(Error::io(path))?;
        tracing::info!("wrote {} (per-layer times, CSV)", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut t: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = stats(&mut t);
        assert_eq!((s.median, s.p90, s.p99, s.min), (50.0, 90.0, 99.0, 1.0));
        assert_eq!(s.mean, 50.5);
        assert_eq!(s.max, 100.0);
        // The population standard deviation of 1..=100 is sqrt((100^2 - 1) / 12).
        assert!((s.std - (9999.0f64 / 12.0).sqrt()).abs() < 1e-9, "{}", s.std);
        assert_eq!(percentile(&t, 99.9), 100.0);
        let mut one = vec![3.0];
        assert_eq!(stats(&mut one).p99, 3.0);
        assert!(stats(&mut []).median.is_nan());
    }

    #[test]
    fn layer_csv_quotes_paths() {
        let rows = [LayerTime { index: 3, path: "layer1.0\"x\"".into(), kind: "conv".into(), time_ms: 0.25, share: 12.5 }];
        let csv = layers_csv(&rows);
        assert_eq!(csv.lines().nth(1), Some("3,\"layer1.0\"\"x\"\"\",\"conv\",0.25,12.5"), "{csv}");
    }

    #[test]
    fn time_loop_runs_at_least_the_iterations() {
        let mut n = 0;
        let timed = time_loop(Duration::ZERO, 5, Duration::ZERO, || {
            n += 1;
            Ok(())
        })
        .expect("loop");
        assert_eq!(timed.times.len(), 5);
        assert!(timed.starts.windows(2).all(|w| w[0] <= w[1]), "starts are in order: {:?}", timed.starts);
        assert_eq!(n, 6, "one warm-up run, five timed");
    }
}
