//! Building or loading an engine: the precision and build config of the engine flags, the GPU, and
//! a progress bar while the builder times its tactics.

use super::load::load;
use super::source::{source, Source};
use crate::EngineArgs;
use indicatif::{ProgressBar, ProgressStyle};
use kiln::engine::{BuildConfig, Engine, EngineBuilder, Gpu, Precision, QuantFormat};
use kiln::{Error, Graph, Result};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

impl EngineArgs {
    pub fn precision(&self) -> Precision {
        if self.fp32 {
            Precision::Fp32
        } else if self.tf32 {
            Precision::Tf32
        } else if self.int8 {
            Precision::Int8
        } else if self.fp8 {
            Precision::Fp8
        } else if self.best {
            Precision::Best
        } else {
            Precision::Fp16
        }
    }

    /// The `--layer-precisions` rules (none without the flag).
    pub fn rules(&self) -> &[kiln::engine::LayerPrecision] {
        self.layer_precisions.as_ref().map_or(&[], |r| r.0.as_slice())
    }

    /// What `--cpu` runs for the precision flags, and its name for the header: the optimised
    /// graph in f32 (no precision flag, or `--fp32`), or for `--int8`/`--fp8` the CPU simulation
    /// of that engine (`kiln::dev::quant`: the graph's own Q/DQ nodes, else `--calibration-cache`'s
    /// scales, with the weights folded onto their 8-bit grids as the builder folds them, and each
    /// value rounded to FP16 where the engine stores it in FP16: `simulation`). Any
    /// other precision, or an 8-bit one with no scales, is an error: the CPU executor never
    /// runs f32 in its place.
    pub fn cpu_graph(&self, traced: &Graph) -> Result<(Graph, String)> {
        let optimized = kiln::engine::optimize(traced)?;
        let precision = self.precision();
        let unsimulated = |flag: &str, what: &str| {
            Error::Flag {
            flag: flag.into(),
            reason: format!(
                "the CPU executor computes in f32 and simulates INT8 and FP8 engines only; {what} has no CPU simulation: drop {flag} to run in f32, or drop --cpu to build the engine"
            ),
        }
        };
        let format = match precision {
            Precision::Fp32 => return Ok((optimized, "CPU executor (f32)".into())),
            // The default precision, not asked for: the CPU run is f32, as it always was.
            Precision::Fp16 if !self.fp16 => return Ok((optimized, "CPU executor (f32)".into())),
            Precision::Fp16 => return Err(unsimulated("--fp16", "FP16")),
            Precision::Tf32 => return Err(unsimulated("--tf32", "TF32")),
            Precision::Best => return Err(unsimulated("--best", "--best (its layers' precisions are chosen by timing on the GPU)")),
            Precision::Int8 | Precision::Fp8 => precision.quant_format().expect("an 8-bit precision has a format"),
        };
        let (graph, source) = self.eight_bit_graph(optimized, format)?;
        let graph = kiln::dev::quant::simulation(&graph, format, self.rules())?;
        let kept = match self.rules() {
            [] => String::new(),
            rules => {
                let spec: Vec<String> = rules.iter().map(|r| format!("{}:{}", r.pattern, r.precision.short_name())).collect();
                format!("; not quantised: --layer-precisions {}", spec.join(","))
            }
        };
        Ok((graph, format!("CPU simulation of the {} engine ({source}{kept})", format.name().to_uppercase())))
    }

    /// The graph an 8-bit (`format`) engine lowers, from the optimised graph, and where its scales
    /// come from: the graph's own Q/DQ nodes (a model quantised in PyTorch, kiln-torch's), else
    /// `--calibration-cache`. No scales is an error naming the flag. Needs no GPU: `build` runs it
    /// first, so a graph the builder would refuse is refused on any machine.
    pub fn eight_bit_graph(&self, optimized: Graph, format: QuantFormat) -> Result<(Graph, String)> {
        let flag = format!("--{}", format.name());
        let name = format.name().to_uppercase();
        let source = if kiln::dev::quant::has_quant_nodes(&optimized) {
            // Explicit quantisation: the graph's formats are the engine's, so the flag must name one.
            let formats: Vec<QuantFormat> = optimized
                .nodes
                .iter()
                .filter_map(|n| match &n.op {
                    kiln::plugin::Op::Quant(q) => Some(q.params().format),
                    _ => None,
                })
                .collect();
            if !formats.contains(&format) {
                let other = formats[0];
                return Err(Error::Flag {
                    flag: flag.clone(),
                    reason: format!(
                        "does not fit this graph: its {} quantize/dequantize nodes are {} (none {}), so its scales are for an {} engine: use --{}",
                        formats.len(),
                        other.name(),
                        format.name(),
                        other.name().to_uppercase(),
                        other.name()
                    ),
                });
            }
            let n = formats.iter().filter(|&&f| f == format).count();
            format!("the graph's {n} {} Q/DQ nodes", format.name())
        } else {
            match &self.calibration_cache {
                Some(path) => format!("calibration cache {}", path.display()),
                None => {
                    return Err(Error::Flag {
                        flag: "--calibration-cache".into(),
                        reason: format!(
                            "{flag} (the {name} engine, or its CPU simulation with --cpu) needs its scales: a calibration cache (`kiln calibrate`) or a graph with quantize/dequantize nodes"
                        ),
                    })
                }
            }
        };
        let graph = kiln::dev::quant::prepare_for_engine(optimized, format, self.calibration_cache.as_deref(), self.rules())?;
        Ok((graph, source))
    }

    pub fn config(&self, min: usize, opt: usize, max: usize) -> BuildConfig {
        let mut c = BuildConfig::default().precision(self.precision()).batch(min, opt, max);
        // MiB from a flag: saturate rather than wrap (the builder treats it as a limit).
        c.workspace_bytes = self.workspace.saturating_mul(1 << 20);
        c.fastest_tactics = self.fastest;
        if let Some(tc) = &self.timing_cache {
            c = c.timing_cache(tc.clone());
        }
        if let Some(cal) = &self.calibration_cache {
            c = c.calibration_cache(cal.clone());
        }
        if let Some(rules) = &self.layer_precisions {
            c = c.layer_precisions(rules.0.iter().cloned());
        }
        if !self.tactic_sources.is_empty() {
            c.tactic_sources = Some(self.tactic_sources.clone());
        }
        c
    }
}

/// The GPU, or `Error::NoGpu` with the reason (commands that need one stop here).
pub fn gpu() -> Result<Arc<Gpu>> {
    kiln::engine::gpu_available().map_err(Error::NoGpu)?;
    Gpu::new(0)
}

/// A progress bar over `len` steps of long CPU work, on standard error (hidden when it is not a
/// terminal, as in tests and pipes).
pub fn progress_bar(len: usize, prefix: &str) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    let style = ProgressStyle::with_template("{prefix} [{elapsed}] {wide_bar} {pos}/{len} {msg}").map(|s| s.progress_chars("=> "));
    bar.set_style(style.unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_prefix(prefix.to_string());
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// Builds an engine, with a progress bar over the graph's nodes while their algorithms are timed.
pub fn build_engine(graph: &Graph, config: BuildConfig, gpu: Arc<Gpu>, what: &str) -> Result<Engine> {
    let bar = progress_bar(
        0,
        &format!("building {what} ({}, batch {}..={}): timing", config.precision.short_name(), config.min_batch, config.max_batch),
    );
    let shown = bar.clone();
    let engine = EngineBuilder::new(config)
        .with_gpu(gpu)
        .on_progress(move |done, total, path| {
            shown.set_length(total as u64);
            shown.set_position(done as u64);
            shown.set_message(path.to_string());
        })
        .build(graph);
    bar.finish_and_clear();
    engine
}

/// An engine for `model` (a bundled or user model or graph file, built here; or an engine file,
/// loaded and checked to accept the batch range).
pub fn engine_for(
    model: &str,
    weights: Option<&PathBuf>,
    hw: Option<[usize; 2]>,
    args: &EngineArgs,
    batch: (usize, usize, usize),
    gpu: Arc<Gpu>,
) -> Result<(String, Engine)> {
    if let Source::EngineFile(path) = source(model)? {
        let engine = Engine::load(&path, &gpu)?;
        let c = &engine.config;
        if batch.0 < c.min_batch || batch.2 > c.max_batch {
            return Err(Error::Binding {
                name: "batch".into(),
                reason: format!("{model} was built for batch {}..={}, asked for {}..={}", c.min_batch, c.max_batch, batch.0, batch.2),
            });
        }
        if let Some([h, w]) = hw {
            // The plan for that size: made now if it lies inside one of the engine's profiles.
            let mut dims = engine.plan().dims.clone();
            if let Some(d) = dims.get_mut("input").filter(|d| d.len() == 3) {
                d[1..].copy_from_slice(&[h, w]);
            }
            engine
                .plan_for(&dims)
                .map_err(|e| Error::Binding { name: "input".into(), reason: format!("{model}, asked for {h}x{w}: {e}") })?;
        }
        return Ok((model.to_string(), engine));
    }
    let traced = load(model, weights.map(|p| p.as_path()), false, batch.1, hw)?;
    let engine = build_engine(&traced.graph, args.config(batch.0, batch.1, batch.2), gpu, &traced.name)?;
    Ok((traced.name, engine))
}
