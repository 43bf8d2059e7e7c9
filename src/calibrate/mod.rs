//! Post-training quantisation: calibration (TensorRT's entropy, percentile and min-max methods, and
//! Model Optimizer's MSE search),
//! the JSON calibration cache, and the pass that turns a calibrated graph into an explicit Q/DQ
//! graph, which both the CPU fake-quant simulation and the 8-bit engines run.
//!
//! **What is quantised** (the same points for the CPU simulation and the engine):
//! - the activation input of every `conv2d` with `groups == 1` (not transposed) and every
//!   `linear`: one scale per tensor, from the calibration cache (`amax / 127` for int8,
//!   `amax / 448` for fp8; the MSE method picks each format's own amax). A value read by several
//!   such layers gets one fake-quantiser, shared, named after the value;
//! - their weights, symmetric, computed at build time from the (BatchNorm-folded) weights: int8
//!   per output channel (`max |w[c]| / 127`, range ±127 as TensorRT), fp8 per tensor
//!   (`max |w| / 448`: within its normal range e4m3's relative precision does not depend on the
//!   scale, so per-channel scales change nothing measurable, docs/QUANT.md; and Hopper's FP8
//!   GEMMs take one scale per operand);
//! - the residual a conv adds in its epilogue (the skip connection of a ResNet block), with that
//!   value's own scale: so a block's input and output are one 8-bit tensor each, which the engine
//!   keeps in 8 bits between its 8-bit convs (TensorRT's QAT recipe quantises the same input);
//! - in FP8, each such layer's bias is corrected for its weight's rounding where the cache holds
//!   the layer's input means (`bias.rs`: the mean output shift `ΔW · E[x]` subtracted, channel by
//!   channel; `kiln calibrate` records the means unless `--no-bias-correction`);
//! - nothing else: biases are added in f32 in the layer's epilogue; grouped and depthwise convs,
//!   transposed convs, pooling, matmul and elementwise layers run in FP16;
//! - in FP8, only the layers an FP8 kernel runs and whose input is not a clamp's (ReLU6) output
//!   ([`fp8_point`]): the others compute in FP16 either way, and a ReLU6 output crowds where
//!   e4m3's step is an eighth of the value; both cost MobileNetV2 its answers (docs/QUANT.md,
//!   "Why FP8 lost MobileNetV2's answers").
//!
//! Because every 8-bit reader of a value quantises it with that value's one scale, an engine that
//! keeps the value in 8 bits between 8-bit layers (the producer requantises in its epilogue) and
//! one that quantises at each reader's input compute the same numbers; the simulation is exact for
//! both.
//!
//! A graph that already holds `quantize` / `dequantize` / `fake_quantize` nodes (quantisation-aware
//! training, explicit precision) is built with exactly those scales and needs no cache.

use crate::graph::{ConvAttrs, Gemm, Graph, HostTensor, NodeId, Op, Quant, QuantFormat, QuantParams};
use crate::hash::{fnv1a_extend, FNV_OFFSET};
pub use crate::number_format::symmetric_scale;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// The calibration cache format this code writes and reads.
pub const CACHE_VERSION: u32 = 2;
/// Histogram bins over `[0, amax]` (TensorRT's).
pub const HIST_BINS: usize = 2048;
/// Quantisation levels of the entropy method's candidate distributions (int8's positive half).
pub const ENTROPY_LEVELS: usize = 128;

/// How a tensor's range is chosen from its recorded values.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CalibrationMethod {
    /// TensorRT's default: the threshold minimising the KL divergence between the histogram
    /// clipped there and its 128-level quantisation.
    Entropy,
    /// The given percentile of `|x|` (TensorRT uses 99.99; the `percentile` flag means 99.99).
    Percentile(f64),
    /// `max |x|`.
    MinMax,
    /// The threshold minimising the mean squared error between the recorded values and their
    /// quantised copies, searched over candidates up to `max |x|`, for each format apart (NVIDIA
    /// Model Optimizer's `mse` calibrator; here on the histogram, see
    /// [`Histogram::mse_threshold`]).
    Mse,
}

impl Default for CalibrationMethod {
    /// MSE, for INT8 and FP8: chosen by the held-out photos (docs/QUANT.md, "Calibration by
    /// evidence"): the only method whose engines keep FP32's top-1 on all 12 in both formats.
    fn default() -> Self {
        Self::Mse
    }
}

impl CalibrationMethod {
    /// `entropy`, `percentile` (99.99), `percentile=99.9`, `minmax`/`max`, `mse` (CLI flags).
    pub fn parse(s: &str) -> Result<Self> {
        let bad = |reason: String| Error::Flag { flag: "--method".into(), reason };
        Ok(match s {
            "entropy" => Self::Entropy,
            "percentile" => Self::Percentile(99.99),
            "minmax" | "min-max" | "max" => Self::MinMax,
            "mse" => Self::Mse,
            _ => match s.strip_prefix("percentile=") {
                Some(p) => {
                    let p: f64 = p.parse().map_err(|_| bad(format!("`{s}`: the percentile is not a number")))?;
                    if !(p > 0.0 && p <= 100.0) {
                        return Err(bad(format!("`{s}`: the percentile must be in (0, 100]")));
                    }
                    Self::Percentile(p)
                }
                None => return Err(bad(format!("unknown method `{s}`: entropy, percentile, percentile=P, minmax or mse"))),
            },
        })
    }
}

/// One tensor's calibrated range and the scales it gives.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorRange {
    /// The clipping threshold of INT8 (`int8_scale × 127`). FP8's is `fp8_scale × 448`: the
    /// same for every method but MSE, which chooses each format's own.
    pub amax: f32,
    pub int8_scale: f32,
    pub fp8_scale: f32,
}

impl TensorRange {
    /// One threshold for both formats.
    pub fn from_amax(amax: f32) -> Self {
        Self::per_format(amax, amax)
    }
    /// A threshold per format.
    pub fn per_format(int8_amax: f32, fp8_amax: f32) -> Self {
        Self {
            amax: int8_amax,
            int8_scale: symmetric_scale(int8_amax, QuantFormat::Int8),
            fp8_scale: symmetric_scale(fp8_amax, QuantFormat::Fp8E4m3),
        }
    }
    pub fn scale(&self, format: QuantFormat) -> f32 {
        match format {
            QuantFormat::Int8 => self.int8_scale,
            QuantFormat::Fp8E4m3 => self.fp8_scale,
        }
    }
}

/// A calibration cache: per-tensor ranges of one graph, readable JSON that later builds reuse
/// without data. `graph_hash` ties it to the optimised graph it was recorded on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CalibrationCache {
    pub version: u32,
    pub method: CalibrationMethod,
    pub graph_hash: String,
    /// Images the ranges were recorded on.
    pub images: usize,
    /// Tensor name (the producing node's module path, or the input's name) → range.
    pub tensors: BTreeMap<String, TensorRange>,
    /// Layer (its tensor name: the module path) → the means of its input per channel and filter tap, for bias
    /// correction (`bias.rs`). Empty in caches written without (`kiln calibrate
    /// --no-bias-correction`, or before it existed): no correction.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub input_means: BTreeMap<String, Vec<f32>>,
}

impl CalibrationCache {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a calibration cache serialises") + "\n"
    }
    /// Writes the cache, after the checks `load` makes (JSON has no NaN or infinity: such a range
    /// would be written as `null`, which no loader reads back).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        self.check_ranges().map_err(|reason| Error::Calibration { path: path.display().to_string(), reason })?;
        std::fs::write(path, self.to_json()).map_err(Error::io(path))
    }
    /// Reads and checks a cache: only a regular file is opened (a FIFO is named, never waited
    /// on), then its version, every amax finite and non-negative and every scale positive and
    /// finite.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bad = |reason: String| Error::Calibration { path: path.display().to_string(), reason };
        let bytes = crate::host::read_regular(path, "the path of a JSON calibration cache (`kiln calibrate -o`)", bad)?;
        let cache: Self = serde_json::from_slice(&bytes).map_err(|e| bad(format!("not a calibration cache: {e}")))?;
        if cache.version != CACHE_VERSION {
            return Err(bad(format!("cache version {} (this Kiln reads version {CACHE_VERSION}); recalibrate", cache.version)));
        }
        cache.check_ranges().map_err(bad)?;
        Ok(cache)
    }
    /// Every amax finite and non-negative, every scale positive and finite, and within what a
    /// quantiser takes (`number_format::check_scale`).
    fn check_ranges(&self) -> std::result::Result<(), String> {
        for (name, r) in &self.tensors {
            if !(r.amax.is_finite() && r.amax >= 0.0) {
                return Err(format!("tensor `{name}`: amax {} is not finite and non-negative", r.amax));
            }
            for (what, s, format) in [("int8_scale", r.int8_scale, QuantFormat::Int8), ("fp8_scale", r.fp8_scale, QuantFormat::Fp8E4m3)] {
                if !(s.is_finite() && s > 0.0) {
                    return Err(format!("tensor `{name}`: {what} {s} is not positive and finite"));
                }
                // A subnormal scale (1e-45) has an infinite reciprocal: its simulation is NaN.
                crate::number_format::check_scale(s, format).map_err(|reason| format!("tensor `{name}`: {what}: {reason}"))?;
            }
        }
        for (layer, means) in &self.input_means {
            if let Some(v) = means.iter().find(|v| !v.is_finite()) {
                return Err(format!("layer `{layer}`: input mean {v} is not finite"));
            }
        }
        Ok(())
    }
}

/// A layer the engine runs in 8 bits: its activation input, its weight, and the residual it adds
/// (a conv's fused skip connection), if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantPoint {
    pub node: NodeId,
    pub activation: NodeId,
    pub weight: NodeId,
    pub residual: Option<NodeId>,
}

impl QuantPoint {
    /// The activations this layer reads in 8 bits: its input, then its residual.
    pub fn activations(&self) -> impl Iterator<Item = NodeId> {
        std::iter::once(self.activation).chain(self.residual)
    }
}

/// Whether `op` has an 8-bit implementation (see the module docs).
pub fn quantizable(op: &Op) -> bool {
    matches!(op, Op::Conv(ConvAttrs { transposed: false, groups: 1, .. }) | Op::Gemm(Gemm::Linear { .. }))
}

/// The 8-bit layers of `graph` whose weight is a constant, in graph order.
pub fn quant_points(graph: &Graph) -> Vec<QuantPoint> {
    graph
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| quantizable(&n.op) && n.inputs.len() >= 2)
        .filter(|(_, n)| matches!(graph.nodes[n.inputs[1]].op, Op::Weight { .. }))
        .map(|(id, n)| {
            let residual = match &n.op {
                Op::Conv(a) if a.residual => n.inputs.last().copied(),
                _ => None,
            };
            QuantPoint { node: id, activation: n.inputs[0], weight: n.inputs[1], residual }
        })
        .collect()
}

/// A unique name for every node's value: the graph input's name, or the module path, with
/// `#k` appended to the k-th repeat of a path.
pub fn tensor_names(graph: &Graph) -> Vec<String> {
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    graph
        .nodes
        .iter()
        .map(|n| {
            let base = match &n.op {
                Op::Input { name } => name.as_str(),
                _ => n.path.as_str(),
            };
            let k = seen.entry(base).or_insert(0);
            *k += 1;
            if *k == 1 {
                base.to_string()
            } else {
                format!("{base}#{}", *k - 1)
            }
        })
        .collect()
}

/// A hash of the graph's structure (ops with their attributes, inputs, per-image shapes, paths),
/// independent of the batch it was traced at; weights' values are not part of it.
pub fn graph_hash(graph: &Graph) -> String {
    let mut h = FNV_OFFSET;
    for n in &graph.nodes {
        let attrs = serde_json::to_string(&n.op).unwrap_or_default();
        let line = format!("{attrs}|{:?}|{:?}|{}\n", n.inputs, n.shape.get(1..).unwrap_or(&[]), n.path);
        h = fnv1a_extend(h, line.as_bytes());
    }
    for (name, id) in &graph.outputs {
        h = fnv1a_extend(h, format!("out {name}={id}\n").as_bytes());
    }
    format!("{h:016x}")
}

/// Whether the graph carries its own quantisation (explicit Q/DQ nodes).
pub fn has_quant_nodes(graph: &Graph) -> bool {
    graph.nodes.iter().any(|n| matches!(n.op, Op::Quant(_)))
}

/// A histogram of `|x|` over `[0, range]` in `HIST_BINS` bins; exact zeros are counted apart
/// (they quantise to zero at any scale, so they say nothing about the threshold, and a ReLU's
/// zeros would swamp the first bin).
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    pub range: f32,
    pub zeros: u64,
    pub bins: Vec<u64>,
}

impl Histogram {
    pub fn new(range: f32) -> Self {
        Self { range, zeros: 0, bins: vec![0; HIST_BINS] }
    }
    pub fn add(&mut self, data: &[f32]) {
        let per_unit = if self.range > 0.0 { HIST_BINS as f64 / self.range as f64 } else { 0.0 };
        for &v in data {
            let a = v.abs();
            if a == 0.0 || a.is_nan() {
                self.zeros += 1;
                continue;
            }
            let b = ((a as f64 * per_unit) as usize).min(HIST_BINS - 1);
            self.bins[b] += 1;
        }
    }
    fn bin_width(&self) -> f64 {
        self.range as f64 / HIST_BINS as f64
    }

    /// The upper edge of the bin where the `p`-th percentile of `|x|` (zeros included) falls.
    pub fn percentile(&self, p: f64) -> f32 {
        let total = self.zeros + self.bins.iter().sum::<u64>();
        let want = (p / 100.0 * total as f64).ceil() as u64;
        let mut cum = self.zeros;
        if cum >= want {
            return 0.0;
        }
        for (b, &c) in self.bins.iter().enumerate() {
            cum += c;
            if cum >= want {
                return ((b + 1) as f64 * self.bin_width()) as f32;
            }
        }
        self.range
    }

    /// TensorRT's entropy threshold: for each candidate `i` from `ENTROPY_LEVELS` bins up, the
    /// reference `P` is the first `i` bins with everything beyond added to the last; the candidate
    /// `Q` quantises those `i` bins to `ENTROPY_LEVELS` levels (each level's count spread evenly
    /// over its non-empty bins); the threshold with the smallest KL(P || Q) wins (the first, on a
    /// tie). Returns the upper edge of the winning bin.
    pub fn entropy_threshold(&self) -> f32 {
        let n = self.bins.len();
        let total: u64 = self.bins.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let mut suffix = vec![0u64; n + 1];
        for i in (0..n).rev() {
            suffix[i] = suffix[i + 1] + self.bins[i];
        }
        let mut best = (f64::INFINITY, n);
        let mut q = vec![0f64; n];
        for i in ENTROPY_LEVELS..=n {
            // Q: `i` bins quantised to ENTROPY_LEVELS levels (level g covers [g*i/L, (g+1)*i/L)).
            for g in 0..ENTROPY_LEVELS {
                let (lo, hi) = (g * i / ENTROPY_LEVELS, (g + 1) * i / ENTROPY_LEVELS);
                let bins = &self.bins[lo..hi];
                let count: u64 = bins.iter().sum();
                let nonzero = bins.iter().filter(|&&c| c > 0).count();
                for (j, &c) in bins.iter().enumerate() {
                    q[lo + j] = if c > 0 { count as f64 / nonzero as f64 } else { 0.0 };
                }
            }
            let q_total: f64 = q[..i].iter().sum();
            let p_total = total as f64;
            let mut kl = 0.0;
            for (j, (&count, &qj)) in self.bins[..i].iter().zip(&q[..i]).enumerate() {
                let p = if j == i - 1 { (count + suffix[i]) as f64 } else { count as f64 };
                if p == 0.0 {
                    continue;
                }
                let (p, qj) = (p / p_total, qj / q_total);
                if qj == 0.0 {
                    kl = f64::INFINITY;
                    break;
                }
                kl += p * (p / qj).ln();
            }
            if kl < best.0 {
                best = (kl, i);
            }
        }
        (best.1 as f64 * self.bin_width()) as f32
    }

    /// The MSE method's threshold for `format`: of the candidates at every `MSE_STRIDE`-th bin
    /// edge from `MSE_FIRST_BIN` up to the range, the one whose symmetric quantisation (rounded
    /// and clipped as the engine does) has the least squared error summed over the histogram.
    /// Each bin's values are taken as spread evenly over it (`MSE_SAMPLES` points a bin), so the
    /// error of a grid finer than the bins is not lost to aliasing at the bins' centres; exact
    /// zeros cost nothing at any threshold. The smallest candidate wins a tie.
    pub fn mse_threshold(&self, format: QuantFormat) -> f32 {
        if self.bins.iter().all(|&c| c == 0) || self.range.is_nan() || self.range <= 0.0 {
            return self.range.max(0.0);
        }
        let width = self.bin_width();
        let candidates = (MSE_FIRST_BIN..HIST_BINS).step_by(MSE_STRIDE).chain(std::iter::once(HIST_BINS));
        let mut best = (f64::INFINITY, HIST_BINS);
        for edge in candidates {
            let amax = edge as f64 * width;
            let error = self.squared_error(amax, format);
            if error < best.0 {
                best = (error, edge);
            }
        }
        (best.1 as f64 * width) as f32
    }

    /// The summed squared quantisation error of the histogram's values at threshold `amax`.
    fn squared_error(&self, amax: f64, format: QuantFormat) -> f64 {
        let width = self.bin_width();
        let scale = f64::from(symmetric_scale(amax as f32, format));
        let mut total = 0.0;
        for (b, &count) in self.bins.iter().enumerate() {
            if count == 0 {
                continue;
            }
            let mut bin = 0.0;
            for j in 0..MSE_SAMPLES {
                let x = (b as f64 + (j as f64 + 0.5) / MSE_SAMPLES as f64) * width;
                let d = x - quantise_magnitude(x, scale, format);
                bin += d * d;
            }
            total += count as f64 * bin / MSE_SAMPLES as f64;
        }
        total
    }
}

/// The MSE method's smallest candidate threshold, in bins (1/128 of the recorded range, where
/// INT8's step is already finer than a bin and the histogram cannot judge finer grids).
pub const MSE_FIRST_BIN: usize = 16;
/// Bins between the MSE method's candidate thresholds.
pub const MSE_STRIDE: usize = 8;
/// Points of each bin the MSE method quantises.
pub const MSE_SAMPLES: usize = 4;

/// `x >= 0` symmetrically quantised with `scale` and back, as the fake-quantisers round: INT8 to
/// the nearest integer step (ties to even), clipped at 127 steps; FP8 to the nearest e4m3 value of
/// `x / scale`, saturating at 448.
fn quantise_magnitude(x: f64, scale: f64, format: QuantFormat) -> f64 {
    let v = (x / scale) as f32;
    let q = match format {
        QuantFormat::Int8 => v.round_ties_even().min(127.0),
        QuantFormat::Fp8E4m3 => crate::number_format::round_e4m3(v.min(crate::number_format::E4M3_MAX)),
    };
    f64::from(q) * scale
}

/// Per-tensor statistics recorded over a calibration set, from which any method's cache is made.
#[derive(Clone, Debug)]
pub struct CalibrationStats {
    pub graph_hash: String,
    pub images: usize,
    /// Tensor name → (max |x|, histogram of |x| over [0, max]).
    pub tensors: BTreeMap<String, (f32, Histogram)>,
    /// Layer → its input's means per channel and tap (`CalibrationCache::input_means`).
    pub input_means: BTreeMap<String, Vec<f32>>,
}

impl CalibrationStats {
    /// The cache of one method.
    pub fn cache(&self, method: CalibrationMethod) -> CalibrationCache {
        let tensors = self
            .tensors
            .iter()
            .map(|(name, (amax, hist))| {
                let range = match method {
                    CalibrationMethod::MinMax => TensorRange::from_amax(*amax),
                    CalibrationMethod::Percentile(p) => TensorRange::from_amax(hist.percentile(p)),
                    CalibrationMethod::Entropy => TensorRange::from_amax(hist.entropy_threshold()),
                    CalibrationMethod::Mse => {
                        TensorRange::per_format(hist.mse_threshold(QuantFormat::Int8), hist.mse_threshold(QuantFormat::Fp8E4m3))
                    }
                };
                (name.clone(), range)
            })
            .collect();
        CalibrationCache {
            version: CACHE_VERSION,
            method,
            graph_hash: self.graph_hash.clone(),
            images: self.images,
            tensors,
            input_means: self.input_means.clone(),
        }
    }
}

/// Runs a graph over a calibration set on the CPU executor and records the range of every tensor
/// an 8-bit layer reads. Calibration runs on the optimised graph (BatchNorm folded, ReLUs fused),
/// the one the engine is built from.
pub struct Calibrator {
    graph: Graph,
    /// (tensor name, node) of each quantised activation, once each.
    tensors: Vec<(String, NodeId)>,
    /// (layer path, layer, its activation's tensor name) of each 8-bit layer, for bias correction.
    layers: Vec<(String, NodeId, String)>,
    /// What the calibration set is, in errors (`--data`'s path).
    source: String,
}

impl Calibrator {
    /// Names the calibration set (its file or folder) in errors about its values.
    pub fn with_source(self, source: impl Into<String>) -> Self {
        Self { source: source.into(), ..self }
    }

    pub fn new(graph: &Graph) -> Result<Self> {
        let graph = crate::passes::optimize(graph)?;
        let names = tensor_names(&graph);
        let mut tensors: Vec<(String, NodeId)> = vec![];
        let points = quant_points(&graph);
        for a in points.iter().flat_map(QuantPoint::activations) {
            if !tensors.iter().any(|(_, id)| *id == a) && !matches!(graph.nodes[a].op, Op::Quant(_)) {
                tensors.push((names[a].clone(), a));
            }
        }
        let layers = points
            .iter()
            .filter(|p| !matches!(graph.nodes[p.activation].op, Op::Quant(_)))
            .map(|p| (names[p.node].clone(), p.node, names[p.activation].clone()))
            .collect();
        Ok(Self { graph, tensors, layers, source: "the calibration data".into() })
    }

    /// The optimised graph calibration runs on.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The names of the tensors that get a range.
    pub fn tensor_names(&self) -> Vec<&str> {
        self.tensors.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// One run recording every calibrated tensor.
    fn run(&self, input: &HostTensor) -> Result<BTreeMap<String, HostTensor>> {
        let mut g = self.graph.clone();
        g.outputs = self.tensors.iter().map(|(n, id)| (n.clone(), *id)).collect();
        let names = g.input_names();
        let [name] = names.as_slice() else {
            return Err(Error::Config { reason: format!("calibration feeds graphs of one input; this one has {names:?}") });
        };
        crate::cpu::run(&g, &[(name, input)])
    }

    /// Records ranges over `batches` (each `[N, ...]` for the graph's one input): a first pass for
    /// `max |x|`, a second for histograms over `[0, max]`. NaN or infinity in the data, or in a
    /// calibrated tensor (non-finite weights, or an overflow), is an error naming the image or the
    /// tensor: no range could be drawn from it.
    pub fn collect(&self, batches: &[HostTensor]) -> Result<CalibrationStats> {
        self.collect_with_progress(batches, |_| {})
    }

    /// `collect`, calling `progress(done)` after each of its `2 * batches.len()` CPU runs (a
    /// progress bar's position).
    pub fn collect_with_progress(&self, batches: &[HostTensor], mut progress: impl FnMut(usize)) -> Result<CalibrationStats> {
        if batches.is_empty() {
            return Err(Error::Config { reason: "calibration needs at least one batch".into() });
        }
        self.check_data(batches)?;
        let mut amax: BTreeMap<String, f32> = self.tensors.iter().map(|(n, _)| (n.clone(), 0.0)).collect();
        let mut sums: Vec<bias::InputSums> = vec![Default::default(); self.layers.len()];
        let mut done = 0;
        for b in batches {
            let outputs = self.run(b)?;
            for ((_, node, input), s) in self.layers.iter().zip(&mut sums) {
                if let Some(x) = outputs.get(input) {
                    s.add(&self.graph, *node, x);
                }
            }
            for (name, t) in outputs {
                let m = self.finite_amax(&name, &t.data)?;
                let e = amax.entry(name).or_insert(0.0);
                *e = e.max(m);
            }
            done += 1;
            progress(done);
        }
        let input_means = self.layers.iter().zip(&sums).filter_map(|((path, ..), s)| Some((path.clone(), s.means()?))).collect();
        let mut hists: BTreeMap<String, Histogram> = amax.iter().map(|(n, &a)| (n.clone(), Histogram::new(a))).collect();
        for b in batches {
            for (name, t) in self.run(b)? {
                if let Some(h) = hists.get_mut(&name) {
                    h.add(&t.data);
                }
            }
            done += 1;
            progress(done);
        }
        tracing::debug!(batches = batches.len(), tensors = amax.len(), "calibration ranges and histograms recorded");
        let tensors = hists.into_iter().map(|(n, h)| (n.clone(), (amax[&n], h))).collect();
        let images = batches.iter().map(|b| b.shape.first().copied().unwrap_or(0)).sum();
        Ok(CalibrationStats { graph_hash: graph_hash(&self.graph), images, tensors, input_means })
    }

    /// Every value of the calibration set finite; else an error naming the first bad image.
    fn check_data(&self, batches: &[HostTensor]) -> Result<()> {
        let mut first_image = 0;
        for b in batches {
            let per = b.data.len() / b.shape.first().copied().unwrap_or(1).max(1);
            if let Some(at) = b.data.iter().position(|v| !v.is_finite()) {
                let bad = b.data.iter().filter(|v| !v.is_finite()).count();
                return Err(Error::Calibration {
                    path: self.source.clone(),
                    reason: format!(
                        "image {} holds {} (the first of {bad} NaN or infinite value(s) in its batch): calibration data must be finite",
                        first_image + at / per.max(1),
                        b.data[at]
                    ),
                });
            }
            first_image += b.shape.first().copied().unwrap_or(0);
        }
        Ok(())
    }

    /// `max |x|` of a calibrated tensor, which must be finite.
    fn finite_amax(&self, name: &str, data: &[f32]) -> Result<f32> {
        let mut m = 0f32;
        for &v in data {
            if !v.is_finite() {
                let bad = data.iter().filter(|v| !v.is_finite()).count();
                return Err(Error::Calibration {
                    path: self.source.clone(),
                    reason: format!(
                        "tensor `{name}` holds {bad} NaN or infinite value(s) on finite data: the weights are not finite \
                         (`kiln run --strict` names them) or the activations overflow f32"
                    ),
                });
            }
            m = m.max(v.abs());
        }
        Ok(m)
    }

    /// `collect` then one method's cache.
    pub fn calibrate(&self, batches: &[HostTensor], method: CalibrationMethod) -> Result<CalibrationCache> {
        Ok(self.collect(batches)?.cache(method))
    }
}

mod bias;
mod quantise;
mod sensitivity;
pub(crate) use quantise::check_rules_on_explicit;
pub use quantise::{
    fold_constant_quant, layer_precision, prepare_for_best, prepare_for_engine, quant_summary, quantised_layers, quantize_graph, simulate,
    simulate_with_rules, simulation, weight_scales,
};
pub use sensitivity::{quant_sensitivity, ScopeError};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entropy_clips_a_long_tail() {
        // A dense bulk in [0, 1) and a few outliers out to 10: the threshold lands near the bulk.
        let mut h = Histogram::new(10.0);
        let bulk: Vec<f32> = (0..20000).map(|i| (i as f32 / 20000.0).powf(1.5)).collect();
        h.add(&bulk);
        h.add(&[4.0, 7.5, 10.0]);
        let t = h.entropy_threshold();
        println!("entropy threshold {t}, percentile 99.99 {}", h.percentile(99.99));
        assert!(t > 0.6 && t < 2.0, "threshold {t}");
        assert!(h.percentile(100.0) >= 9.99);
        assert!(h.percentile(50.0) < 0.7);
    }

    #[test]
    fn cache_round_trips_through_json() {
        let mut tensors = BTreeMap::new();
        tensors.insert("layer1.0.relu".to_string(), TensorRange::from_amax(2.7182817));
        let c = CalibrationCache {
            version: CACHE_VERSION,
            method: CalibrationMethod::Percentile(99.99),
            graph_hash: "ab".into(),
            images: 4,
            tensors,
            input_means: BTreeMap::from([("layer2.conv".to_string(), vec![0.5, 1.25])]),
        };
        let back: CalibrationCache = serde_json::from_str(&c.to_json()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn layers_report_their_precision() {
        let tracer = crate::Tracer::new();
        let x = tracer.input("input", &[1, 2, 4, 4]);
        let q = x.fake_quantize(QuantParams::int8(0.1)).unwrap();
        let w = crate::tensor::Param { name: "w".into(), value: Arc::new(HostTensor::new(vec![3, 2, 1, 1], vec![0.5; 6])) };
        let y = crate::tensor::Tensor::record("conv", Op::Conv(ConvAttrs::default()), &[&q], &[&w]).unwrap();
        y.relu().unwrap().mark_output("y");
        let g = tracer.graph();
        assert_eq!(layer_precision(&g, "conv", "fp16"), "int8 (q/dq, fp16 math)");
        assert_eq!(layer_precision(&g, &g.nodes[q.id()].path, "fp16"), "int8");
        assert_eq!(layer_precision(&g, "conv.relu", "fp16"), "fp16");
        assert!(quant_summary(&g, 0).unwrap().contains("1 conv/linear"));
    }

    /// A cache with `int8_scale` 1e-45 (a subnormal: its reciprocal is infinite) loaded and
    /// simulated as all NaN; scales outside what a quantiser takes are refused at load, and the
    /// scales `from_amax` gives are always inside.
    #[test]
    fn a_cache_scale_a_quantiser_cannot_take_is_refused() {
        let path = std::env::temp_dir().join(format!("kiln-calib-scales-{}.json", std::process::id()));
        let cache = |r: TensorRange| CalibrationCache {
            version: CACHE_VERSION,
            method: CalibrationMethod::MinMax,
            graph_hash: "ab".into(),
            images: 1,
            tensors: BTreeMap::from([("conv1".to_string(), r)]),
            input_means: BTreeMap::new(),
        };
        for (int8_scale, says) in [(1e-45, "int8_scale: a scale must be positive, finite and within"), (3e37, "got 3e37")] {
            let r = TensorRange { int8_scale, ..TensorRange::from_amax(1.0) };
            std::fs::write(&path, cache(r).to_json()).expect("write");
            let e = CalibrationCache::load(&path).expect_err("refused");
            assert!(matches!(e, Error::Calibration { .. }) && e.to_string().contains(says), "{e}");
            assert!(cache(r).save(&path).is_err(), "save checks as load does");
        }
        for amax in [0.0, 1e-45, 1e-30, 1.0, 3e38, f32::MAX] {
            let r = TensorRange::from_amax(amax);
            for (s, format) in [(r.int8_scale, QuantFormat::Int8), (r.fp8_scale, QuantFormat::Fp8E4m3)] {
                crate::number_format::check_scale(s, format).unwrap_or_else(|e| panic!("amax {amax}: {e}"));
            }
        }
        std::fs::remove_file(&path).ok();
    }

    /// `n` values of `|x|` for x Laplace-distributed with scale `b` (a long-tailed activation),
    /// by the inverse CDF over an even grid of quantiles.
    fn laplace(n: usize, b: f64) -> Vec<f32> {
        (0..n).map(|i| (-b * (1.0 - (i as f64 + 0.5) / n as f64).ln()) as f32).collect()
    }

    fn histogram_of(data: &[f32]) -> Histogram {
        let mut h = Histogram::new(data.iter().fold(0f32, |m, v| m.max(v.abs())));
        h.add(data);
        h
    }

    /// The squared error of fake-quantising `data` with the op the simulation runs.
    fn exact_squared_error(data: &[f32], amax: f32, format: QuantFormat) -> f64 {
        let mut q = HostTensor::new(vec![data.len()], data.to_vec());
        QuantParams::symmetric(format, symmetric_scale(amax, format)).fake_quantize(&mut q);
        data.iter().zip(&q.data).map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2)).sum()
    }

    #[test]
    fn mse_error_on_the_histogram_matches_the_quantiser_on_the_data() {
        let data = laplace(200_000, 1.0);
        let h = histogram_of(&data);
        for format in [QuantFormat::Int8, QuantFormat::Fp8E4m3] {
            for fraction in [0.1f32, 0.3, 0.6, 1.0] {
                let amax = h.range * fraction;
                let (approx, exact) = (h.squared_error(f64::from(amax), format), exact_squared_error(&data, amax, format));
                let off = (approx - exact).abs() / exact;
                assert!(off < 0.05, "{} at {fraction} of the range: histogram {approx:.4e}, data {exact:.4e} ({off:.3})", format.name());
            }
        }
    }

    #[test]
    fn mse_picks_the_threshold_of_least_error() {
        let data = laplace(200_000, 1.0);
        let h = histogram_of(&data);
        for format in [QuantFormat::Int8, QuantFormat::Fp8E4m3] {
            let t = h.mse_threshold(format);
            let at = exact_squared_error(&data, t, format);
            // No candidate of the grid the search walks is better by more than the histogram's
            // approximation; a threshold clipping far less or far more is clearly worse.
            for edge in (MSE_FIRST_BIN..=HIST_BINS).step_by(MSE_STRIDE) {
                let other = exact_squared_error(&data, (edge as f64 * h.bin_width()) as f32, format);
                assert!(other > 0.95 * at, "{}: threshold {t} errs {at:.4e}, {edge} bins {other:.4e}", format.name());
            }
            assert!(exact_squared_error(&data, h.range, format) > 1.05 * at || t > 0.9 * h.range, "{}: {t}", format.name());
        }
        // INT8's even grid clips a long tail: at 8 bits the least-MSE clip of a Laplace(b) is
        // 9.89 b (Banner et al., "Post training 4-bit quantization of convolutional networks", 2019), below this sample's
        // max of 12.9 b. e4m3's logarithmic grid keeps small values precise at any scale, so it
        // clips less.
        let (int8, fp8) = (h.mse_threshold(QuantFormat::Int8), h.mse_threshold(QuantFormat::Fp8E4m3));
        assert!((int8 - 9.89).abs() < 0.5, "int8 threshold {int8} of {}", h.range);
        assert!(fp8 > int8, "fp8 threshold {fp8}, int8 {int8}");
    }

    #[test]
    fn mse_keeps_the_range_of_an_even_spread() {
        // Values spread evenly over [0, 1]: clipping any of them costs more than the step it saves.
        let data: Vec<f32> = (0..100_000).map(|i| (i as f32 + 0.5) / 100_000.0).collect();
        let h = histogram_of(&data);
        for format in [QuantFormat::Int8, QuantFormat::Fp8E4m3] {
            let t = h.mse_threshold(format);
            assert!(t > 0.95 * h.range, "{}: {t}", format.name());
        }
    }

    #[test]
    fn an_mse_cache_holds_each_formats_own_threshold() {
        let data = laplace(50_000, 0.5);
        let stats = CalibrationStats {
            graph_hash: "ab".into(),
            images: 1,
            tensors: BTreeMap::from([("x".to_string(), (h_range(&data), histogram_of(&data)))]),
            input_means: BTreeMap::new(),
        };
        let r = stats.cache(CalibrationMethod::Mse).tensors["x"];
        let h = histogram_of(&data);
        assert_eq!(r.amax, h.mse_threshold(QuantFormat::Int8));
        assert_eq!(r.int8_scale, symmetric_scale(h.mse_threshold(QuantFormat::Int8), QuantFormat::Int8));
        assert_eq!(r.fp8_scale, symmetric_scale(h.mse_threshold(QuantFormat::Fp8E4m3), QuantFormat::Fp8E4m3));
        assert_ne!(r.int8_scale * 127.0, r.fp8_scale * 448.0, "the two formats' thresholds differ on a long tail");
        let minmax = stats.cache(CalibrationMethod::MinMax).tensors["x"];
        assert_eq!(minmax.int8_scale * 127.0, minmax.fp8_scale * 448.0);
    }

    fn h_range(data: &[f32]) -> f32 {
        data.iter().fold(0f32, |m, v| m.max(v.abs()))
    }

    /// FP8 quantises the conv an FP8 kernel runs on an unclamped input, and no other; INT8 every
    /// 8-bit point.
    #[test]
    fn fp8_leaves_convs_without_a_kernel_or_reading_a_clamp_in_16_bits() {
        let tracer = crate::Tracer::new();
        let x = tracer.input("input", &[1, 3, 4, 4]);
        let conv = |name: &str, x: &crate::tensor::Tensor, cin: usize, cout: usize| {
            let w = crate::tensor::Param {
                name: format!("{name}.weight"),
                value: Arc::new(HostTensor::new(vec![cout, cin, 1, 1], (0..cout * cin).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect())),
            };
            crate::tensor::Tensor::record(name, Op::Conv(ConvAttrs::default()), &[x], &[&w]).unwrap()
        };
        let c1 = conv("stem", &x, 3, 16);
        let c2 = conv("after_clamp", &c1.clamp(0.0, 6.0).unwrap(), 16, 32);
        conv("plain", &c2, 32, 32).mark_output("y");
        let g = tracer.graph();
        let tensors = tensor_names(&g).into_iter().map(|n| (n, TensorRange::from_amax(1.0))).collect();
        let cache = CalibrationCache {
            version: CACHE_VERSION,
            method: CalibrationMethod::MinMax,
            graph_hash: graph_hash(&g),
            images: 1,
            tensors,
            input_means: BTreeMap::new(),
        };
        let quantised = |format| {
            let q = quantize_graph(&g, &cache, format, &[]).unwrap();
            let mut paths: Vec<String> = q
                .nodes
                .iter()
                .filter(|n| quantizable(&n.op) && matches!(n.inputs.first().map(|&i| &q.nodes[i].op), Some(Op::Quant(_))))
                .map(|n| n.path.clone())
                .collect();
            paths.sort();
            paths
        };
        assert_eq!(quantised(QuantFormat::Int8), ["after_clamp", "plain", "stem"]);
        assert_eq!(quantised(QuantFormat::Fp8E4m3), ["plain"]);
    }

    #[test]
    fn methods_parse() {
        assert_eq!(CalibrationMethod::parse("mse").unwrap(), CalibrationMethod::Mse);
        assert_eq!(CalibrationMethod::parse("percentile").unwrap(), CalibrationMethod::Percentile(99.99));
        assert_eq!(CalibrationMethod::parse("percentile=99.9").unwrap(), CalibrationMethod::Percentile(99.9));
        assert!(CalibrationMethod::parse("percentile=120").is_err());
        assert!(CalibrationMethod::parse("kl").is_err());
    }

    /// FP16 storage changes an 8-bit code: 0.5 + 2^-12 is a tie in f16 and rounds to 0.5, which
    /// int8 at scale 1 rounds (ties to even) to 0; in f32 it rounds to 1. The engine stores the
    /// input as f16 (the entry reformat) before its quantiser, so the simulation must give 0, and
    /// the conv computing in FP16 on the Q/DQ value gets an f16 weight (1 + 2^-12 is 1 in f16).
    #[test]
    fn simulation_rounds_to_f16_before_quantising_as_the_engine_stores() {
        assert_eq!(crate::number_format::round_f16(0.5 + 2f32.powi(-12)), 0.5);
        assert_eq!(crate::number_format::round_f16(1.0 + 3.0 * 2f32.powi(-11)), 1.0 + 2f32.powi(-9), "ties to even, upwards");
        let tracer = crate::Tracer::new();
        let x = tracer.input("input", &[1, 3, 1, 1]);
        let q = x.fake_quantize(QuantParams::int8(1.0)).unwrap();
        let w = HostTensor::new(vec![1, 3, 1, 1], vec![1.0 + 2f32.powi(-12), 0.0, 0.0]);
        let w = crate::tensor::Param { name: "w".into(), value: Arc::new(w) };
        crate::tensor::Tensor::record("conv", Op::Conv(ConvAttrs::default()), &[&q], &[&w]).unwrap().mark_output("y");
        let prepared = prepare_for_engine(crate::passes::optimize(&tracer.graph()).unwrap(), QuantFormat::Int8, None, &[]).unwrap();
        let sim = simulation(&prepared, QuantFormat::Int8, &[]).unwrap();
        let y = |g: &Graph, v: f32| {
            let input = HostTensor::new(vec![1, 3, 1, 1], vec![v, 0.0, 0.0]);
            crate::cpu::run(g, &[("input", &input)]).unwrap()["y"].data[0]
        };
        let tie = 0.5 + 2f32.powi(-12);
        assert_eq!(y(&prepared, tie), 1.0 + 2f32.powi(-12), "in f32 the tie quantises to 1");
        assert_eq!(y(&sim, tie), 0.0, "stored as f16 first, it quantises to 0");
        assert_eq!(y(&sim, 3.0), 3.0, "the FP16 conv's weight is 1 in f16");
        // An f16 output: 3 · (1 + 2^-12) = 3.000732 is 3.0 + 0.375 of a step, rounded down; the
        // weight alone (f32, unmarked) would give it.
        let mut unrounded_weight = sim.clone();
        unrounded_weight.nodes.iter_mut().filter(|n| matches!(n.op, Op::Weight { .. })).for_each(|n| n.dtype = crate::graph::DType::F32);
        assert_eq!(y(&unrounded_weight, 3.0), 3.0, "the output is stored as f16");
        assert_eq!(y(&prepared, 3.0), 3.0 * (1.0 + 2f32.powi(-12)));
    }

    /// Between 8-bit convs the engine keeps codes, which are not rounded to f16; the input (read
    /// by a stored quantiser's kernel) and an 8-bit conv's FP16 output (here the graph output)
    /// are; the 8-bit convs' weights stay on their grid in f32.
    #[test]
    fn simulation_keeps_8_bit_codes_and_rounds_fp16_values() {
        use crate::nn::{Conv2d, Conv2dConfig};
        use crate::{Forward, Module, VarBuilder};
        let tracer = crate::Tracer::new();
        let x = tracer.input("input", &[1, 16, 4, 4]);
        let vb = VarBuilder::seeded();
        let c1 = Conv2d::load(vb.pp("c1"), &Conv2dConfig::new(16, 16, 1)).and_then(|c| c.forward(&x)).unwrap().relu().unwrap();
        Conv2d::load(vb.pp("c2"), &Conv2dConfig::new(16, 16, 1)).and_then(|c| c.forward(&c1)).unwrap().mark_output("y");
        let g = tracer.graph();
        let data = HostTensor::new(vec![1, 16, 4, 4], (0..256).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect());
        let cache = Calibrator::new(&g).unwrap().calibrate(std::slice::from_ref(&data), CalibrationMethod::MinMax).unwrap();
        let sim = simulate(&g, &cache, QuantFormat::Int8).unwrap();
        let f16 = |path: &str, op: &str| {
            let n = sim.nodes.iter().rev().find(|n| n.path == path && n.op.name() == op).unwrap_or_else(|| panic!("{path} {op}"));
            n.dtype == crate::graph::DType::F16
        };
        assert!(f16("input.f16", "reshape"), "the entry reformat");
        assert!(!f16("input.quantizer", "fake_quantize"), "stored codes");
        assert!(!f16("c1", "conv2d"), "requantises into c2's input codes");
        assert!(!f16("c1.quantizer", "fake_quantize"), "stored codes");
        assert!(f16("c2", "conv2d"), "an 8-bit conv's f16 output");
        assert!(sim.nodes.iter().filter(|n| matches!(n.op, Op::Weight { .. })).all(|n| n.dtype == crate::graph::DType::F32));
        let y = &crate::cpu::run(&sim, &[("input", &data)]).unwrap()["y"];
        assert!(y.data.iter().all(|&v| crate::number_format::round_f16(v) == v));
        let f32_sim =
            fold_constant_quant(&quantize_graph(&crate::passes::optimize(&g).unwrap(), &cache, QuantFormat::Int8, &[]).unwrap()).unwrap();
        let z = &crate::cpu::run(&f32_sim, &[("input", &data)]).unwrap()["y"];
        assert_ne!(y.data, z.data, "f16 storage changes the logits");
    }
}
