//! `kiln bench` (latency percentiles and throughput, trtexec-style) and `kiln profile` (per-layer
//! device time by module path).

use super::common::{self, ms, precision_name};
use super::{BenchArgs, ProfileArgs};
use kiln::engine::{Engine, ExecutionContext};
use kiln::{Error, HostTensor, Result};
use serde::Serialize;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One benchmark result, as written by `--json` (read by tools/bench_side_by_side.py).
#[derive(Serialize, Debug, Clone)]
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
    pub iterations: usize,
    /// Images per second over the whole timed loop (batch × runs / time).
    pub img_s: f64,
    pub device: String,
    pub driver_version: u32,
    pub cudnn_version: u32,
    pub build_seconds: f64,
}

/// Latency statistics of a list of per-run times (ms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
    pub min: f64,
}

/// Nearest-rank percentiles of `times` (sorted here).
pub fn stats(times: &mut [f64]) -> Stats {
    times.sort_by(f64::total_cmp);
    let n = times.len();
    if n == 0 {
        return Stats { median: f64::NAN, p90: f64::NAN, p99: f64::NAN, mean: f64::NAN, min: f64::NAN };
    }
    let pct = |p: f64| times[((p / 100.0 * n as f64).ceil() as usize).clamp(1, n) - 1];
    Stats { median: pct(50.0), p90: pct(90.0), p99: pct(99.0), mean: times.iter().sum::<f64>() / n as f64, min: times[0] }
}

/// Runs `once` for `warmup`, then at least `iterations` times and at least `duration`; returns each
/// timed run's milliseconds and the total timed seconds.
fn time_loop(warmup: Duration, iterations: usize, duration: Duration, mut once: impl FnMut() -> Result<()>) -> Result<(Vec<f64>, f64)> {
    let start = Instant::now();
    once()?;
    while start.elapsed() < warmup {
        once()?;
    }
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < iterations.max(1) || start.elapsed() < duration {
        let t = Instant::now();
        once()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok((times, start.elapsed().as_secs_f64()))
}

fn print_record(r: &Record) -> Result<()> {
    say!(
        "{:<10} batch {:<4} {:<7} {:<10} median {:>10}  p90 {:>10}  p99 {:>10}  {:>10.1} images/s  ({} runs)",
        r.model,
        r.batch,
        r.precision,
        r.mode,
        ms(r.median_ms),
        ms(r.p90_ms),
        ms(r.p99_ms),
        r.img_s,
        r.iterations
    );
    Ok(())
}

fn record(model: &str, batch: usize, size: usize, precision: &str, mode: &str, mut times: Vec<f64>, total_s: f64) -> Record {
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
        iterations: times.len(),
        img_s: batch as f64 * times.len() as f64 / total_s.max(1e-12),
        device: String::new(),
        driver_version: 0,
        cudnn_version: 0,
        build_seconds: 0.0,
    }
}

/// The input size of an engine (its `input` binding is [3, S, S] per image).
fn engine_size(engine: &Engine) -> usize {
    engine.inputs().first().and_then(|(_, dims)| dims.get(1).copied()).unwrap_or(0)
}

fn engine_input(engine: &Engine, batch: usize) -> Result<HostTensor> {
    let (_, dims) = engine
        .inputs()
        .into_iter()
        .next()
        .ok_or_else(|| Error::Binding { name: "input".into(), reason: "the engine has no input".into() })?;
    let mut shape = vec![batch];
    shape.extend_from_slice(dims);
    Ok(kiln::seeded::uniform_tensor(&shape, kiln::seeded::fresh_seed()))
}

pub fn bench(a: BenchArgs) -> Result<ExitCode> {
    let warmup = Duration::from_millis(a.warmup);
    let duration = Duration::try_from_secs_f64(a.duration).map_err(|_| Error::Flag {
        flag: "--duration".into(),
        reason: format!("must be a finite, non-negative number of seconds, got {}", a.duration),
    })?;
    let mut records = Vec::new();
    if a.batch.is_empty() || a.batch.contains(&0) {
        return Err(Error::Binding { name: "batch".into(), reason: format!("batch sizes must be positive, got {:?}", a.batch) });
    }
    if a.cpu {
        if common::is_engine_file(&a.model) {
            return Err(Error::Flag {
                flag: "--cpu".into(),
                reason: format!("benchmarks a bundled model, not the engine file {}", a.model),
            });
        }
        for &batch in &a.batch {
            let traced = common::trace(&a.model, a.weights.as_deref(), false, batch, a.size)?;
            let graph = kiln::passes::optimize(&traced.graph)?;
            common::check_cpu_memory(&graph, batch, traced.size)?;
            let x = common::random_input(&[batch, 3, traced.size, traced.size], kiln::seeded::fresh_seed())?;
            let (times, total) = time_loop(warmup, a.iterations, duration, || kiln::cpu::run(&graph, &[("input", &x)]).map(|_| ()))?;
            let mut r = record(&traced.name, batch, traced.size, "cpu-f32", "cpu", times, total);
            r.device = "CPU executor".into();
            print_record(&r)?;
            records.push(r);
        }
    } else {
        let gpu = common::gpu()?;
        let modes: Vec<bool> = match (a.cuda_graphs_only, a.no_cuda_graphs) {
            (true, _) => vec![true],
            (_, true) => vec![false],
            _ => vec![true, false],
        };
        let loaded = if common::is_engine_file(&a.model) {
            let (min, max) = (a.batch.iter().min().copied().unwrap_or(1), a.batch.iter().max().copied().unwrap_or(1));
            Some(Arc::new(common::engine_for(&a.model, None, None, &a.engine, (min, max, max), gpu.clone())?.1))
        } else {
            None
        };
        for &batch in &a.batch {
            let (name, engine) = match &loaded {
                Some(e) => (a.model.clone(), e.clone()),
                None => {
                    let (name, e) =
                        common::engine_for(&a.model, a.weights.as_ref(), a.size, &a.engine, (batch, batch, batch), gpu.clone())?;
                    (name, Arc::new(e))
                }
            };
            let x = engine_input(&engine, batch)?;
            let mut ctx: ExecutionContext = engine.context()?;
            ctx.run(&[("input", &x)])?;
            for &graphs in &modes {
                ctx.set_cuda_graphs(graphs);
                let (times, total) = time_loop(warmup, a.iterations, duration, || {
                    ctx.execute(batch)?;
                    ctx.synchronize()
                })?;
                let mode = if graphs { "cuda-graph" } else { "no-graph" };
                let mut r = record(&name, batch, engine_size(&engine), precision_name(engine.config.precision), mode, times, total);
                let info = &engine.gpu().info;
                (r.device, r.driver_version, r.cudnn_version) = (info.name.clone(), info.driver_version, info.cudnn_version);
                r.build_seconds = engine.summary.build_seconds;
                print_record(&r)?;
                records.push(r);
            }
        }
    }
    if let Some(path) = &a.json {
        let text =
            serde_json::to_string_pretty(&records).map_err(|e| Error::Serialize { what: "the results".into(), reason: e.to_string() })?;
        std::fs::write(path, text + "\n").map_err(Error::io(path))?;
        say!("wrote {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

pub fn profile(a: ProfileArgs) -> Result<ExitCode> {
    let gpu = common::gpu()?;
    let (name, engine) = common::engine_for(&a.model, a.weights.as_ref(), a.size, &a.engine, (a.batch, a.batch, a.batch), gpu)?;
    let engine = Arc::new(engine);
    let x = engine_input(&engine, a.batch)?;
    let mut ctx = engine.context()?;
    ctx.set_cuda_graphs(false);
    ctx.run(&[("input", &x)])?;
    let times = ctx.profile_layers(a.batch, a.iterations.max(1))?;
    let layers: Vec<_> = engine.layers().collect();
    let total: f64 = times.iter().sum();
    let mut rows: Vec<(usize, f64)> = times.iter().copied().enumerate().collect();
    rows.sort_by(|x, y| y.1.total_cmp(&x.1));
    let shown = if a.top == 0 { rows.len() } else { a.top.min(rows.len()) };
    say!(
        "{name}: batch {}, {}, {} layers; each layer captured alone in a CUDA graph, mean of {} back-to-back replays",
        a.batch,
        precision_name(engine.config.precision),
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
    say!("sum of layers: {} ({:.1} images/s if run back to back)", ms(total), a.batch as f64 / (total / 1e3).max(1e-12));
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
        let mut one = vec![3.0];
        assert_eq!(stats(&mut one).p99, 3.0);
        assert!(stats(&mut []).median.is_nan());
    }

    #[test]
    fn time_loop_runs_at_least_the_iterations() {
        let mut n = 0;
        let (times, _) = time_loop(Duration::ZERO, 5, Duration::ZERO, || {
            n += 1;
            Ok(())
        })
        .expect("loop");
        assert_eq!(times.len(), 5);
        assert_eq!(n, 6, "one warm-up run, five timed");
    }
}
