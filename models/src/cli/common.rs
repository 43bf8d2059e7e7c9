//! What the commands share: tracing a bundled model with its weights, making or reading an input,
//! building or loading an engine (with a progress bar), and summarising outputs for people.

use super::{EngineArgs, ModelArgs};
use indicatif::{ProgressBar, ProgressStyle};
use kiln::engine::{BuildConfig, Engine, EngineBuilder, Gpu, Precision};
use kiln::{Error, Graph, HostTensor, Result, VarBuilder};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// A traced bundled model.
pub struct Traced {
    pub name: String,
    pub graph: Graph,
    pub size: usize,
}

/// The weights a command asked for: a safetensors file or the seeded generator.
pub fn weights(path: Option<&Path>) -> Result<VarBuilder> {
    match path {
        Some(p) => VarBuilder::from_safetensors(&[p]),
        None => Ok(VarBuilder::seeded()),
    }
}

/// The most elements an input may have: 2^31 (8 GiB as f32).
pub const MAX_INPUT_ELEMENTS: usize = 1 << 31;

/// Checks `--batch` and `--size` before anything is traced or allocated: both at least 1, and an
/// input of batch × 3 × size × size that neither overflows nor exceeds `MAX_INPUT_ELEMENTS`.
pub fn check_input_dims(batch: usize, size: usize) -> Result<()> {
    let flag = |flag: &str, reason: String| Error::Flag { flag: flag.into(), reason };
    if batch == 0 {
        return Err(flag("--batch", "must be at least 1".into()));
    }
    if size == 0 {
        return Err(flag("--size", "must be at least 1".into()));
    }
    let what = || format!("an input of --batch {batch} at --size {size} ({batch} x 3 x {size} x {size})");
    match kiln::graph::numel(&[batch, 3, size, size]) {
        None => Err(Error::TooLarge { what: what(), reason: "its element count overflows".into() }),
        Some(n) if n > MAX_INPUT_ELEMENTS => Err(Error::TooLarge {
            what: what(),
            reason: format!("{n} elements, more than the limit of {MAX_INPUT_ELEMENTS} (8 GiB as f32); lower --batch or --size"),
        }),
        Some(_) => Ok(()),
    }
}

/// Bytes of memory the CPU executor may use: `KILN_CPU_MEMORY_BYTES`, else the kernel's
/// `MemAvailable`; `None` when neither is known (then nothing is checked).
fn available_memory() -> Option<usize> {
    if let Some(v) = std::env::var("KILN_CPU_MEMORY_BYTES").ok().and_then(|v| v.parse().ok()) {
        return Some(v);
    }
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    line.split_whitespace().nth(1)?.parse::<usize>().ok()?.checked_mul(1024)
}

/// The CPU executor's peak activation memory for `graph`, in bytes: values live from the node that
/// makes them to their last reader (as `kiln::cpu::run` frees them), doubled for scratch (im2col,
/// allocator slack). Weights are already in memory and not counted.
pub fn cpu_peak_bytes(graph: &Graph) -> usize {
    let size = |id: usize| kiln::graph::numel(&graph.nodes[id].shape).map_or(usize::MAX, |n| n.saturating_mul(4));
    let mut last = vec![0usize; graph.nodes.len()];
    for (i, n) in graph.nodes.iter().enumerate() {
        n.inputs.iter().for_each(|&j| last[j] = i);
    }
    graph.outputs.iter().for_each(|&(_, o)| last[o] = usize::MAX);
    let (mut live, mut peak) = (0usize, 0usize);
    for (i, n) in graph.nodes.iter().enumerate() {
        if matches!(n.op, kiln::Op::Weight { .. }) {
            continue;
        }
        live = live.saturating_add(size(i));
        peak = peak.max(live);
        for &j in &n.inputs {
            if last[j] == i && !matches!(graph.nodes[j].op, kiln::Op::Weight { .. }) {
                live = live.saturating_sub(size(j));
            }
        }
    }
    peak.saturating_mul(2)
}

/// Refuses a CPU run whose activations cannot fit in the memory available, before allocating.
pub fn check_cpu_memory(graph: &Graph, batch: usize, size: usize) -> Result<()> {
    let bytes = cpu_peak_bytes(graph);
    match available_memory() {
        Some(avail) if bytes > avail => Err(Error::OutOfMemory {
            what: format!("the CPU executor at --batch {batch}, {size}x{size} (only {avail} bytes are available; lower --batch or --size)"),
            bytes,
        }),
        _ => Ok(()),
    }
}

/// A random input of `shape` whose memory is requested with `try_reserve`.
pub fn random_input(shape: &[usize], seed: u64) -> Result<HostTensor> {
    kiln::seeded::try_uniform_tensor(shape, seed)
}

/// Traces `model` at `batch` × 3 × size × size, checking (with `strict`) that every weight was used
/// and that none holds NaN or infinity (without `strict`, both are warnings).
pub fn trace(model: &str, weights_path: Option<&Path>, strict: bool, batch: usize, size: Option<usize>) -> Result<Traced> {
    let info = kiln_models::bundled(model)?;
    let size = size.unwrap_or(info.input_size);
    check_input_dims(batch, size)?;
    let vb = weights(weights_path)?;
    let graph = kiln_models::trace(info.name, vb.clone(), batch, size)?;
    if let Some(p) = weights_path {
        let unused = vb.unused();
        if strict {
            vb.check_all_used()?;
            vb.check_finite()?;
        } else {
            if !unused.is_empty() {
                eprintln!(
                    "note: {} key(s) of {} were not used by {model} (e.g. `{}`); --strict makes this an error",
                    unused.len(),
                    p.display(),
                    unused[0]
                );
            }
            let bad = vb.non_finite();
            if let Some((key, count)) = bad.first() {
                eprintln!(
                    "warning: {} weight(s) of {} hold NaN or infinity (e.g. `{key}`: {count} value(s)); outputs will not be finite; --strict makes this an error",
                    bad.len(),
                    p.display()
                );
            }
        }
    }
    Ok(Traced { name: info.name.to_string(), graph, size })
}

pub fn trace_args(m: &ModelArgs, batch: usize) -> Result<Traced> {
    trace(&m.model, m.weights.as_deref(), m.strict, batch, m.size)
}

/// Reads an input tensor from a safetensors file: the tensor named `input`, or its only tensor.
pub fn read_input(path: &Path) -> Result<HostTensor> {
    let (mut tensors, _) = kiln::var_builder::read_tensors(path, "input", |_| true)?;
    if let Some(t) = tensors.remove("input") {
        return Ok(t);
    }
    if tensors.len() == 1 {
        return Ok(tensors.into_values().next().expect("one tensor"));
    }
    Err(Error::Safetensors {
        path: path.to_path_buf(),
        reason: format!("holds no tensor named `input` and {} others: {:?}", tensors.len(), tensors.keys().take(5).collect::<Vec<_>>()),
    })
}

/// Checks an input is [N, 3, S, S] and returns (N, S).
pub fn input_dims(x: &HostTensor, what: &Path) -> Result<(usize, usize)> {
    match x.shape.as_slice() {
        [n, 3, h, w] if h == w && *n > 0 => Ok((*n, *h)),
        s => Err(Error::Binding { name: "input".into(), reason: format!("{} holds shape {s:?}; expected [N, 3, S, S]", what.display()) }),
    }
}

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

    pub fn config(&self, min: usize, opt: usize, max: usize) -> BuildConfig {
        let mut c = BuildConfig::default().precision(self.precision()).batch(min, opt, max);
        // MiB from a flag: saturate rather than wrap (the builder treats it as a limit).
        c.workspace_bytes = self.workspace.saturating_mul(1 << 20);
        if let Some(tc) = &self.timing_cache {
            c = c.timing_cache(tc.clone());
        }
        if let Some(cal) = &self.calibration_cache {
            c = c.calibration_cache(cal.clone());
        }
        c
    }
}

pub fn precision_name(p: Precision) -> &'static str {
    match p {
        Precision::Fp32 => "fp32",
        Precision::Tf32 => "tf32",
        Precision::Fp16 => "fp16",
        Precision::Int8 => "int8",
        Precision::Fp8 => "fp8",
        Precision::Best => "best",
    }
}

/// The GPU, or `Error::NoGpu` with the reason (commands that need one stop here).
pub fn gpu() -> Result<Arc<Gpu>> {
    kiln::engine::gpu_available().map_err(Error::NoGpu)?;
    Gpu::new(0)
}

/// Builds an engine, with a progress bar over the graph's nodes while their algorithms are timed.
pub fn build_engine(graph: &Graph, config: BuildConfig, gpu: Arc<Gpu>, what: &str) -> Result<Engine> {
    let bar = ProgressBar::new(0);
    let style = ProgressStyle::with_template("{prefix} [{elapsed}] {wide_bar} {pos}/{len} {msg}").map(|s| s.progress_chars("=> "));
    bar.set_style(style.unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_prefix(format!(
        "building {what} ({}, batch {}..={}): timing",
        precision_name(config.precision),
        config.min_batch,
        config.max_batch
    ));
    bar.enable_steady_tick(Duration::from_millis(200));
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

/// Whether a command's model argument names an engine file rather than a bundled model.
pub fn is_engine_file(arg: &str) -> bool {
    arg.ends_with(".kiln") || (kiln_models::bundled(arg).is_err() && Path::new(arg).is_file())
}

/// An engine for `model` (a bundled name, built here, or an engine file, loaded).
pub fn engine_for(
    model: &str,
    weights: Option<&PathBuf>,
    size: Option<usize>,
    args: &EngineArgs,
    batch: (usize, usize, usize),
    gpu: Arc<Gpu>,
) -> Result<(String, Engine)> {
    if is_engine_file(model) {
        let engine = Engine::load(model, &gpu)?;
        let c = &engine.config;
        if batch.0 < c.min_batch || batch.2 > c.max_batch {
            return Err(Error::Binding {
                name: "batch".into(),
                reason: format!("{model} was built for batch {}..={}, asked for {}..={}", c.min_batch, c.max_batch, batch.0, batch.2),
            });
        }
        return Ok((model.to_string(), engine));
    }
    let traced = trace(model, weights.map(|p| p.as_path()), false, batch.1, size)?;
    let engine = build_engine(&traced.graph, args.config(batch.0, batch.1, batch.2), gpu, &traced.name)?;
    Ok((traced.name, engine))
}

/// Softmax of one row, for showing class probabilities.
fn softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = row.iter().map(|v| (v - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    exp.iter().map(|e| e / sum).collect()
}

/// How many images' summaries to print at most.
const SHOWN_IMAGES: usize = 4;

/// People-readable outputs: top-k classes for logits, top-k detections for CenterNet, shapes and
/// ranges for anything else.
pub fn summarize(outputs: &BTreeMap<String, HostTensor>, top: usize, input_size: usize) -> String {
    let mut s = String::new();
    if let Some(logits) = outputs.get("logits").filter(|t| t.shape.len() == 2) {
        let (n, classes) = (logits.shape[0], logits.shape[1]);
        for (img, row) in logits.data.chunks_exact(classes.max(1)).enumerate().take(SHOWN_IMAGES) {
            let p = softmax(row);
            let mut idx: Vec<usize> = (0..classes).collect();
            idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            let best: Vec<String> = idx.iter().take(top).map(|&c| format!("class {c:>4} (logit {:>7.3}, p {:.3})", row[c], p[c])).collect();
            s += &format!("image {img}: top-{}:\n    {}\n", best.len(), best.join("\n    "));
        }
        if n > SHOWN_IMAGES {
            s += &format!("({} more images)\n", n - SHOWN_IMAGES);
        }
    }
    if let Some(det) = outputs.get("detections").filter(|t| t.shape.len() == 3 && t.shape[2] == 6) {
        let (n, k) = (det.shape[0], det.shape[1]);
        // Boxes are in output-map coordinates; the maps are at stride input/map.
        let stride = outputs.get("hm").and_then(|hm| hm.shape.get(3)).map(|&w| input_size as f32 / w as f32).unwrap_or(1.0);
        for img in 0..n.min(SHOWN_IMAGES) {
            s += &format!("image {img}: top-{} of {k} detections (box in input pixels):\n", top.min(k));
            for d in det.data[img * k * 6..(img + 1) * k * 6].chunks_exact(6).take(top) {
                s += &format!(
                    "    class {:>2}  score {:.3}  box ({:.1}, {:.1}) - ({:.1}, {:.1})\n",
                    d[5],
                    d[4],
                    d[0] * stride,
                    d[1] * stride,
                    d[2] * stride,
                    d[3] * stride
                );
            }
        }
    }
    for (name, t) in outputs {
        if name == "logits" || name == "detections" {
            continue;
        }
        let (lo, hi) = t.data.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let mean = t.data.iter().map(|&v| v as f64).sum::<f64>() / t.numel().max(1) as f64;
        s += &format!("{name}: {:?}, min {lo:.3}, max {hi:.3}, mean {mean:.3}\n", t.shape);
    }
    s
}

/// Milliseconds, with enough digits for both 0.3 ms and 3000 ms.
pub fn ms(d: f64) -> String {
    if d < 10.0 {
        format!("{d:.3} ms")
    } else {
        format!("{d:.1} ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_summary_lists_the_top_classes_in_order() {
        let logits = HostTensor::new(vec![1, 5], vec![0.1, 3.0, -1.0, 2.0, 2.5]);
        let s = summarize(&BTreeMap::from([("logits".to_string(), logits)]), 3, 224);
        let classes: Vec<&str> = s.lines().filter(|l| l.contains("class")).map(|l| l.split_whitespace().nth(1).unwrap_or("")).collect();
        assert_eq!(classes, ["1", "4", "3"], "{s}");
        assert!(s.starts_with("image 0: top-3:"), "{s}");
    }

    #[test]
    fn detections_are_scaled_to_input_pixels() {
        // One image, two detections (x1, y1, x2, y2, score, class) on 4x4 maps of a 16x16 input.
        let det = HostTensor::new(vec![1, 2, 6], vec![1.0, 2.0, 3.0, 4.0, 0.9, 7.0, 0.0, 0.0, 1.0, 1.0, 0.5, 2.0]);
        let hm = HostTensor::zeros(vec![1, 80, 4, 4]);
        let s = summarize(&BTreeMap::from([("detections".to_string(), det), ("hm".to_string(), hm)]), 1, 16);
        assert!(s.contains("class  7  score 0.900  box (4.0, 8.0) - (12.0, 16.0)"), "{s}");
        assert!(!s.contains("class 2"), "only the top 1 is shown:\n{s}");
        assert!(s.contains("hm: [1, 80, 4, 4]"), "{s}");
    }

    #[test]
    fn random_inputs_are_reproducible_by_seed() {
        let (a, b) = (kiln::seeded::uniform_tensor(&[1, 3, 2, 2], 5), kiln::seeded::uniform_tensor(&[1, 3, 2, 2], 5));
        assert_eq!(a, b);
        assert_ne!(a, kiln::seeded::uniform_tensor(&[1, 3, 2, 2], 6));
        assert!(a.data.iter().all(|v| (-1.0..1.0).contains(v)));
    }
}
