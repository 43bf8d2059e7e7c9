//! What the builder is asked for: [`BuildConfig`], with its batch range, its optimization
//! profiles over the inputs' dims and its per-layer precision rules. What they mean for one graph
//! (the profiles checked against its inputs, the precision each node computes in) is
//! `engine::resolve`'s.

use super::precision::{LayerPrecision, Precision, LAYER_PRECISIONS_FLAG};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// What the builder is asked for. Any batch in `[min_batch, max_batch]` runs from one engine;
/// algorithms are timed at `opt_batch`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BuildConfig {
    pub precision: Precision,
    pub min_batch: usize,
    pub opt_batch: usize,
    pub max_batch: usize,
    /// Upper bound on one layer's scratch memory (cuDNN / cuBLASLt workspace). A limit, not an
    /// allocation: contexts allocate the largest workspace the chosen layers need. The default
    /// (4 GiB) keeps cuDNN's fast transposed-conv algorithm for FP32 CenterNet at batch 32, which
    /// 256 MiB ruled out (853 ms against 76 ms on an H200).
    pub workspace_bytes: usize,
    /// A timing cache file: read before timing, written after, so a rebuild times nothing.
    pub timing_cache: Option<PathBuf>,
    /// Capture the plan as one CUDA graph per batch size.
    pub cuda_graphs: bool,
    /// Restricts tactics to layer kinds starting with one of these prefixes (`"cublaslt"`,
    /// `"cudnn-fused"`, `"cudnn-conv"`), like TensorRT's tactic sources; a layer with no
    /// candidate of these kinds keeps all of its own. `None`: every kind competes.
    #[serde(default)]
    pub tactic_sources: Option<Vec<String>>,
    /// The calibration cache (`kiln calibrate`) an `Int8`/`Fp8` build takes its activation scales
    /// from, unless the graph has its own quantize/dequantize nodes.
    #[serde(default)]
    pub calibration_cache: Option<PathBuf>,
    /// Optimization profiles over the inputs' per-image dims (TensorRT's): the engine runs any
    /// input dims inside one of them, with any batch of the batch range. Empty: the traced dims
    /// only. See [`ShapeProfile`].
    #[serde(default)]
    pub profiles: Vec<ShapeProfile>,
    /// Each layer takes its fastest candidate within `workspace_bytes` (TensorRT's rule), even when
    /// its workspace grows the arena past the activations' own peak. Off (the default): the
    /// fastest candidate that fits the room the arena has at that layer, the fastest overall only
    /// if none does (ResNet-18's stem at batch 256: 8-image slices, 0.5 ms slower, instead of
    /// 490 MiB more arena).
    #[serde(default)]
    pub fastest_tactics: bool,
    /// Per-layer precisions (`--layer-precisions`), applied after the graph's own
    /// (`Graph::fp32_layers`); the last matching rule wins. In an 8-bit engine the layers a rule
    /// covers are not quantised (`calibrate::quantize_graph`). Engines built before these existed
    /// read as having none.
    #[serde(default)]
    pub layer_precisions: Vec<LayerPrecision>,
    /// A `Best` engine's convs on INT8 tensor cores (module paths), which its build chose by
    /// timing (`engine::best`) and a loaded engine lowers again. `None`: not chosen yet, every
    /// conv that can. Other precisions ignore it.
    #[serde(default)]
    pub best_int8_layers: Option<Vec<String>>,
}

/// The per-image dims (PyTorch order, without the batch) one input accepts: every dim in
/// `min..=max`, algorithms timed at `opt`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DimsRange {
    pub min: Vec<usize>,
    pub opt: Vec<usize>,
    pub max: Vec<usize>,
}

impl DimsRange {
    pub fn new(min: &[usize], opt: &[usize], max: &[usize]) -> Self {
        Self { min: min.to_vec(), opt: opt.to_vec(), max: max.to_vec() }
    }
    /// Whether `dims` lies inside the range, dim by dim.
    pub fn contains(&self, dims: &[usize]) -> bool {
        dims.len() == self.min.len() && (0..dims.len()).all(|d| self.min[d] <= dims[d] && dims[d] <= self.max[d])
    }
}

/// One optimization profile: a range per input name. An input it does not name keeps its traced
/// dims. An engine lowers one plan per input shape it runs (its layers, descriptors and arena are
/// made for that shape; weights are shared): the plan at each profile's `opt` is timed at build,
/// the plans at `min` and `max` are made at build with `opt`'s algorithms (so the arena is sized
/// and both ends are known to run), and any other shape is lowered on its first run the same way.
pub type ShapeProfile = BTreeMap<String, DimsRange>;

impl Default for BuildConfig {
    fn default() -> Self {
        Self {
            precision: Precision::Fp16,
            min_batch: 1,
            opt_batch: 1,
            max_batch: 1,
            workspace_bytes: 4 << 30,
            timing_cache: None,
            cuda_graphs: true,
            tactic_sources: None,
            calibration_cache: None,
            profiles: Vec::new(),
            fastest_tactics: false,
            layer_precisions: Vec::new(),
            best_int8_layers: None,
        }
    }
}

impl BuildConfig {
    pub fn precision(mut self, p: Precision) -> Self {
        self.precision = p;
        self
    }
    /// Sets the batch range `min..=max`, timed at `opt`.
    pub fn batch(mut self, min: usize, opt: usize, max: usize) -> Self {
        (self.min_batch, self.opt_batch, self.max_batch) = (min, opt, max);
        self
    }
    pub fn cuda_graphs(mut self, on: bool) -> Self {
        self.cuda_graphs = on;
        self
    }
    pub fn tactic_sources(mut self, prefixes: &[&str]) -> Self {
        self.tactic_sources = Some(prefixes.iter().map(|p| p.to_string()).collect());
        self
    }
    pub fn workspace(mut self, bytes: usize) -> Self {
        self.workspace_bytes = bytes;
        self
    }
    pub fn calibration_cache(mut self, path: impl Into<PathBuf>) -> Self {
        self.calibration_cache = Some(path.into());
        self
    }
    /// Adds an optimization profile (see [`ShapeProfile`]).
    pub fn profile(mut self, profile: ShapeProfile) -> Self {
        self.profiles.push(profile);
        self
    }
    pub fn timing_cache(mut self, path: impl Into<PathBuf>) -> Self {
        self.timing_cache = Some(path.into());
        self
    }
    /// Adds a per-layer precision rule (see [`LayerPrecision`]): `.layer_precision("model.22.*", Precision::Fp32)`.
    pub fn layer_precision(mut self, pattern: &str, precision: Precision) -> Self {
        self.layer_precisions.push(LayerPrecision::new(pattern, precision));
        self
    }
    pub fn layer_precisions(mut self, rules: impl IntoIterator<Item = LayerPrecision>) -> Self {
        self.layer_precisions.extend(rules);
        self
    }

    /// The precision a node at `path` computes in: the last rule of `graph_fp32` (patterns the
    /// graph requires in FP32) then of `layer_precisions` that matches, else the engine's.
    pub fn precision_of(&self, graph_fp32: &[String], path: &str) -> Precision {
        let model = graph_fp32.iter().filter(|p| LayerPrecision::new(p.as_str(), Precision::Fp32).matches(path)).map(|_| Precision::Fp32);
        let user = self.layer_precisions.iter().filter(|r| r.matches(path)).map(|r| r.precision);
        // In an 8-bit engine a layer a rule covers is not quantised (`calibrate::quantize_graph`)
        // and computes in the rule's precision; the others that are not quantised run in FP16.
        model.chain(user).last().unwrap_or(self.precision)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let ok = 1 <= self.min_batch && self.min_batch <= self.opt_batch && self.opt_batch <= self.max_batch;
        if !ok {
            return Err(Error::Config {
                reason: format!(
                    "batch range must satisfy 1 <= min <= opt <= max, got min {} opt {} max {}",
                    self.min_batch, self.opt_batch, self.max_batch
                ),
            });
        }
        for rule in &self.layer_precisions {
            rule.check().map_err(|reason| Error::Flag { flag: LAYER_PRECISIONS_FLAG.into(), reason })?;
        }
        Ok(())
    }
}

/// Every input's per-image dims, by name: the shape a plan is lowered for.
pub type InputDims = BTreeMap<String, Vec<usize>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_matching_rule_decides_and_overrides_the_graphs() {
        let config = BuildConfig::default().layer_precision("*", Precision::Fp32).layer_precision("layer4", Precision::Fp16);
        assert_eq!(config.precision_of(&[], "layer3.0.conv1"), Precision::Fp32);
        assert_eq!(config.precision_of(&[], "layer4.1.conv2"), Precision::Fp16);
        let plain = BuildConfig::default();
        let graph_fp32 = ["head.decode".to_string()];
        assert_eq!(plain.precision_of(&graph_fp32, "head.decode.add"), Precision::Fp32);
        assert_eq!(plain.precision_of(&graph_fp32, "head.cls"), Precision::Fp16);
        let user = BuildConfig::default().layer_precision("head.*", Precision::Fp16);
        assert_eq!(user.precision_of(&graph_fp32, "head.decode.add"), Precision::Fp16, "the user's rule comes last");
    }

    #[test]
    fn rules_are_checked_with_the_config() {
        // In an 8-bit engine a rule keeps its layers out of 8 bits (`calibrate::quantize_graph`).
        let int8 = BuildConfig::default().precision(Precision::Int8).layer_precision("fc", Precision::Fp32);
        int8.validate().expect("fp32 in int8");
        // A per-layer 8-bit precision would need scales: refused, naming the flag.
        let bad = BuildConfig::default().layer_precision("fc", Precision::Fp8);
        let err = bad.validate().expect_err("per-layer fp8");
        assert!(err.to_string().starts_with("--layer-precisions"), "{err}");
        BuildConfig::default().layer_precision("fc", Precision::Fp32).validate().expect("fp32 in fp16");
    }

    #[test]
    fn engine_files_without_rules_still_read() {
        let config = BuildConfig::default().layer_precision("fc", Precision::Fp32);
        let json = serde_json::to_value(&config).expect("json");
        assert_eq!(serde_json::from_value::<BuildConfig>(json.clone()).expect("round trip"), config);
        let mut old = json;
        old.as_object_mut().expect("object").remove("layer_precisions");
        assert_eq!(serde_json::from_value::<BuildConfig>(old).expect("an older engine's config").layer_precisions, []);
    }
}
