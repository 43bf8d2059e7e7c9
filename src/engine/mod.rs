//! The CUDA engine: what TensorRT's builder does, reached straight from our graph.
//!
//! ```text
//! Graph ──passes::optimize──► converters (one per op, inventory) ──► Layers ──► Engine ──► ExecutionContext
//!                                         │ tactic timing (+ cache)        │ engine file
//! ```
//!
//! Physical layout inside an engine: every activation is NHWC, batch-major, element type f32
//! (`Fp32`/`Tf32`) or f16 (`Fp16`), allocated for `max_batch` in one arena planned by tensor
//! lifetime. The user's inputs and outputs are NCHW f32 bindings (an input declared u8 is a
//! binding of bytes); reformat layers convert at the edges.

pub mod arena;
pub mod best;
pub mod builder;
pub mod conv8;
pub mod cudnn;
pub mod cudnn_graph;
pub mod exec;
pub mod file;
pub mod gemm;
pub mod gpu;
pub mod im2col;
pub mod kernel_layers;
pub mod kernels;
pub mod launch;
pub mod layer;
pub mod quant;
pub mod reformat;
pub mod stem;
pub mod strided;
pub mod strided_gemm;
pub mod subpixel;
pub mod tactic;

pub use builder::{estimate_arena, BuildSummary, Engine, EngineBuilder, MemorySummary, Plan};
pub use exec::ExecutionContext;
pub use gpu::{gpu_available, Gpu, GpuInfo};
pub use layer::{BuildCtx, DeviceBuf, Elem, Layer, Layout, RunCtx, ValueDesc, ValueId, MAX_RANK};

use crate::graph::{Graph, NodeId, Op};
use crate::registry::build_table;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::OnceLock;

/// Arithmetic of an engine. `Fp32` forbids TF32 (cuDNN FMA math, cuBLASLt `COMPUTE_32F`); `Tf32`
/// keeps f32 storage and lets tensor cores round inputs to TF32; `Fp16` stores activations and
/// weights in f16 and accumulates in f32. `Int8` and `Fp8` quantise the inputs and weights of
/// convolutions and Linear layers with a calibration cache's scales (or a graph's own Q/DQ
/// nodes), see `kiln::calibrate`; every other layer runs in FP16. `Fp8` needs sm_89 or newer.
/// `Best` is TensorRT's `--best`: per layer the fastest of FP16, FP8 GEMMs and INT8 convs on 8-bit
/// tensor cores, by timing (`engine::best`), with the cache's scales and no quantiser where a
/// 16-bit layer wins (`calibrate::prepare_for_best`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Precision {
    Fp32,
    Tf32,
    #[default]
    Fp16,
    Int8,
    Fp8,
    Best,
}

impl Precision {
    /// The element type activations and weights are stored in.
    pub fn elem(self) -> Elem {
        match self {
            Precision::Fp32 | Precision::Tf32 => Elem::F32,
            Precision::Fp16 | Precision::Int8 | Precision::Fp8 | Precision::Best => Elem::F16,
        }
    }

    /// `fp32` / `fp16`: the name of a storage type, for layer listings (`u8` for a byte binding).
    pub fn name(elem: Elem) -> &'static str {
        match elem {
            Elem::F32 => "fp32",
            Elem::F16 => "fp16",
            Elem::U8 => "u8",
            Elem::I8 => "int8",
            Elem::E4m3 => "fp8",
        }
    }

    /// Parses a precision name as the CLI writes it (`fp32`, `tf32`, `fp16`, `int8`, `fp8`,
    /// `best`; any case).
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name.to_ascii_lowercase().as_str() {
            "fp32" => Precision::Fp32,
            "tf32" => Precision::Tf32,
            "fp16" => Precision::Fp16,
            "int8" => Precision::Int8,
            "fp8" => Precision::Fp8,
            "best" => Precision::Best,
            _ => return None,
        })
    }

    /// The 8-bit format this precision quantises to (`None`: not a quantised precision).
    pub fn quant_format(self) -> Option<crate::graph::QuantFormat> {
        match self {
            Precision::Int8 => Some(crate::graph::QuantFormat::Int8),
            Precision::Fp8 => Some(crate::graph::QuantFormat::Fp8E4m3),
            // Best's 8-bit chains are INT8 (as fast as FP8 on the same tensor cores, and closer to
            // FP32); its FP8 GEMMs clip at the same ranges (`engine::quant`).
            Precision::Best => Some(crate::graph::QuantFormat::Int8),
            Precision::Fp32 | Precision::Tf32 | Precision::Fp16 => None,
        }
    }
}

/// One per-layer precision rule, TensorRT's `--layerPrecisions` with `--precisionConstraints=obey`:
/// the nodes whose module path matches `pattern` compute in `precision` (weights and activations
/// stored in its type) whatever the engine's precision. A pattern matches a path when it matches
/// the whole path or one of its ancestors (`model.22` covers `model.22.dfl.conv`); `*` matches any
/// run of characters, dots included, and `?` one character. The last matching rule wins.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerPrecision {
    pub pattern: String,
    pub precision: Precision,
}

/// The flag whose syntax [`LayerPrecision::parse_list`] reads, named in its errors.
pub const LAYER_PRECISIONS_FLAG: &str = "--layer-precisions";

impl LayerPrecision {
    pub fn new(pattern: impl Into<String>, precision: Precision) -> Self {
        Self { pattern: pattern.into(), precision }
    }

    /// Parses `pattern:precision[,pattern:precision...]` (`model.22.*:fp32,stem:fp32`), as
    /// trtexec's `--layerPrecisions`. Precisions are `fp32`, `tf32` and `fp16`; the pattern is what
    /// comes before the last `:`. Errors are `Error::Flag` naming `--layer-precisions`.
    pub fn parse_list(spec: &str) -> Result<Vec<Self>> {
        let bad = |reason: String| Error::Flag { flag: LAYER_PRECISIONS_FLAG.into(), reason };
        let mut rules = Vec::new();
        for item in spec.split(',').map(str::trim) {
            let Some((pattern, name)) = item.rsplit_once(':') else {
                return Err(bad(format!("`{item}` is not `pattern:precision` (e.g. `model.22.*:fp32`)")));
            };
            let pattern = pattern.trim();
            if pattern.is_empty() {
                return Err(bad(format!("`{item}` has an empty module-path pattern (`*` matches every layer)")));
            }
            let precision = Precision::parse(name.trim())
                .ok_or_else(|| bad(format!("`{item}`: unknown precision `{}` (expected fp32, tf32 or fp16)", name.trim())))?;
            let rule = Self::new(pattern, precision);
            rule.check().map_err(bad)?;
            rules.push(rule);
        }
        Ok(rules)
    }

    /// Only storage precisions can be asked per layer: an 8-bit layer needs calibration scales.
    fn check(&self) -> std::result::Result<(), String> {
        match self.precision {
            Precision::Fp32 | Precision::Tf32 | Precision::Fp16 => Ok(()),
            p => Err(format!("`{}:{}`: per-layer {p:?} is not supported (use fp32, tf32 or fp16)", self.pattern, p.short_name())),
        }
    }

    /// Whether the rule covers the node at `path` (the path itself or one of its ancestors).
    pub fn matches(&self, path: &str) -> bool {
        let ancestors = path.match_indices('.').map(|(i, _)| &path[..i]);
        ancestors.chain(std::iter::once(path)).any(|p| glob_match(&self.pattern, p))
    }
}

impl Precision {
    /// `fp32`, `tf32`, `fp16`, `int8`, `fp8`, `best`: the name `parse` reads.
    pub fn short_name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Fp16 => "fp16",
            Precision::Int8 => "int8",
            Precision::Fp8 => "fp8",
            Precision::Best => "best",
        }
    }
}

/// Whether `text` matches the glob `pattern` as a whole: `*` any run of characters (dots too),
/// `?` exactly one; everything else literally.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    // The classic two-pointer match with backtracking to the last `*` (linear in practice).
    let (mut i, mut j, mut star, mut mark) = (0, 0, None, 0);
    while j < t.len() {
        if i < p.len() && (p[i] == '?' || p[i] == t[j]) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some(i);
            mark = j;
            i += 1;
        } else if let Some(s) = star {
            i = s + 1;
            mark += 1;
            j = mark;
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

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
    /// (`Graph::fp32_layers`); the last matching rule wins. Engines built before these existed
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
        // An 8-bit engine's rules apply to the layers it does not quantise, which run in FP16.
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
        if !self.layer_precisions.is_empty() && self.precision.quant_format().is_some() {
            return Err(Error::Flag {
                flag: LAYER_PRECISIONS_FLAG.into(),
                reason: format!("is not supported in {:?} engines yet (only in fp32, tf32 and fp16 ones)", self.precision),
            });
        }
        Ok(())
    }

    /// Checks the profiles against the graph's inputs: each names existing inputs, with as many
    /// dims as the input has, `1 <= min <= opt <= max` dim by dim, and sizes that cannot overflow
    /// at the max batch.
    pub(crate) fn validate_profiles(&self, graph: &Graph) -> Result<()> {
        let inputs: BTreeMap<&str, usize> = graph.input_names().into_iter().zip(graph.inputs.iter().copied()).collect();
        for (p, profile) in self.profiles.iter().enumerate() {
            for (name, r) in profile {
                let bad = |reason: String| Error::Config { reason: format!("profile {p}, input `{name}`: {reason}") };
                let Some(&node) = inputs.get(name.as_str()) else {
                    return Err(bad(format!("the graph has no such input; it has {:?}", inputs.keys().collect::<Vec<_>>())));
                };
                let rank = graph.nodes[node].shape.len().saturating_sub(1);
                if [&r.min, &r.opt, &r.max].iter().any(|d| d.len() != rank) {
                    return Err(bad(format!(
                        "min {:?}, opt {:?} and max {:?} must each give the input's {rank} per-image dims (traced: {:?})",
                        r.min,
                        r.opt,
                        r.max,
                        &graph.nodes[node].shape[1..]
                    )));
                }
                if (0..rank).any(|d| !(1 <= r.min[d] && r.min[d] <= r.opt[d] && r.opt[d] <= r.max[d])) {
                    return Err(bad(format!(
                        "each dim must satisfy 1 <= min <= opt <= max, got min {:?}, opt {:?}, max {:?}",
                        r.min, r.opt, r.max
                    )));
                }
                if crate::graph::numel(&r.max).and_then(|n| n.checked_mul(self.max_batch)).is_none() {
                    return Err(bad(format!("max {:?} at batch {} has more elements than fit in memory", r.max, self.max_batch)));
                }
            }
        }
        Ok(())
    }

    /// The input dims each plan made at build is lowered for: per profile `opt` first (timed),
    /// then `max` and `min`; the traced dims when there are no profiles. Each entry gives every
    /// input's per-image dims by name; duplicates are dropped.
    pub fn build_shapes(&self, graph: &Graph) -> Vec<InputDims> {
        let traced: InputDims =
            graph.input_names().into_iter().zip(&graph.inputs).map(|(n, &i)| (n.to_string(), graph.nodes[i].shape[1..].to_vec())).collect();
        let mut shapes: Vec<InputDims> = Vec::new();
        let pick = |profile: &ShapeProfile, which: fn(&DimsRange) -> &Vec<usize>| {
            let mut dims = traced.clone();
            for (name, r) in profile {
                dims.insert(name.clone(), which(r).clone());
            }
            dims
        };
        for profile in &self.profiles {
            shapes.push(pick(profile, |r| &r.opt));
        }
        for profile in &self.profiles {
            shapes.push(pick(profile, |r| &r.max));
            shapes.push(pick(profile, |r| &r.min));
        }
        if shapes.is_empty() {
            shapes.push(traced);
        }
        let mut seen = Vec::new();
        shapes.retain(|s| {
            if seen.contains(s) {
                false
            } else {
                seen.push(s.clone());
                true
            }
        });
        shapes
    }

    /// The profile whose ranges hold `dims` (every input named by it inside its range, every other
    /// input at its traced dims), if any.
    pub fn profile_for(&self, graph: &Graph, dims: &InputDims) -> Option<usize> {
        let traced = |name: &str| {
            graph
                .inputs
                .iter()
                .find(|&&i| matches!(&graph.nodes[i].op, Op::Input { name: n } if n == name))
                .map(|&i| &graph.nodes[i].shape[1..])
        };
        self.profiles.iter().position(|p| {
            dims.iter().all(|(name, d)| match p.get(name) {
                Some(r) => r.contains(d),
                None => traced(name) == Some(d.as_slice()),
            })
        })
    }
}

/// Every input's per-image dims, by name: the shape a plan is lowered for.
pub type InputDims = BTreeMap<String, Vec<usize>>;

/// A custom op's GPU converter: lowers one node of the custom op `op` to an engine layer.
/// Register with [`register_converter!`](crate::register_converter) next to the op's
/// registration (built-in ops convert through `OpDef::convert`).
pub struct Converter {
    pub op: &'static str,
    pub convert: fn(&mut BuildCtx<'_>, NodeId) -> Result<Box<dyn Layer>>,
}

inventory::collect!(Converter);

/// Registers a GPU converter for `op` (the `Op::name()`, or a custom op's name):
/// `kiln::register_converter!("asinh", convert_asinh);` with
/// `fn convert_asinh(ctx: &mut kiln::engine::BuildCtx, node: kiln::NodeId) -> kiln::Result<Box<dyn kiln::engine::Layer>>`.
#[macro_export]
macro_rules! register_converter {
    ($op:expr, $convert:path) => {
        $crate::inventory::submit! {
            $crate::engine::Converter { op: $op, convert: $convert }
        }
    };
}

type Table = HashMap<&'static str, &'static Converter>;

fn table() -> &'static std::result::Result<Table, String> {
    static TABLE: OnceLock<std::result::Result<Table, String>> = OnceLock::new();
    TABLE.get_or_init(|| build_table(inventory::iter::<Converter>.into_iter(), |c| c.op))
}

/// The converter registered for `op`; a registry with a duplicate name is an error for every op.
pub fn converter(op: &str) -> Result<Option<&'static Converter>> {
    match table() {
        Ok(t) => Ok(t.get(op).copied()),
        Err(dup) => Err(Error::DuplicateConverter { op: dup.clone() }),
    }
}

/// The precision each node of an optimised graph computes in: the engine's, unless a rule of the
/// graph (`Graph::fp32_layers`) or of the config (`BuildConfig::layer_precisions`) matches its
/// module path. A graph input takes its first reader's, so an FP32 first layer reads the f32
/// binding without a round trip through f16. Needs no GPU.
pub fn node_precisions(graph: &Graph, config: &BuildConfig) -> Vec<Precision> {
    let mut p: Vec<Precision> = graph.nodes.iter().map(|n| config.precision_of(&graph.fp32_layers, &n.path)).collect();
    for (id, node) in graph.nodes.iter().enumerate() {
        if matches!(node.op, Op::Input { .. }) {
            if let Some(reader) = graph.nodes.iter().position(|m| m.inputs.contains(&id)) {
                p[id] = p[reader];
            }
        }
    }
    p
}

/// Ops the builder handles itself rather than through a converter.
pub(crate) fn is_structural(op: &Op) -> bool {
    op.is_leaf()
}

/// Checks, before any GPU work, that every custom op has a converter (built-in ops always have
/// one); the error names the op and the module path of the first node without one. Needs no GPU.
pub fn check_converters(graph: &Graph) -> Result<()> {
    for node in &graph.nodes {
        let Op::Custom(call) = &node.op else { continue };
        if converter(&call.name)?.is_none() {
            return Err(Error::NoConverter { backend: "GPU", op: node.op.name().to_string(), path: node.path.clone() });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Conv2d, Conv2dConfig, Forward, Module, Tracer, VarBuilder};

    #[test]
    fn globs_match_whole_paths() {
        assert!(glob_match("model.22.*", "model.22.dfl.conv"));
        assert!(glob_match("*", ""));
        assert!(glob_match("layer?.0.conv1", "layer3.0.conv1"));
        assert!(glob_match("*.se.*", "trunk_output.block1.block1-0.f.se.fc1"));
        assert!(glob_match("a*b*c", "axxbyybc"));
        assert!(!glob_match("model.22.*", "model.22"));
        assert!(!glob_match("layer?.conv", "layer10.conv"));
        assert!(!glob_match("stem", "stem.0"));
    }

    #[test]
    fn a_pattern_covers_a_path_and_what_is_under_it() {
        let rule = LayerPrecision::new("trunk_output.block1", Precision::Fp32);
        assert!(rule.matches("trunk_output.block1"));
        assert!(rule.matches("trunk_output.block1.block1-0.f.a.0"));
        assert!(!rule.matches("trunk_output.block10.x"), "ancestors end at a dot");
        assert!(!rule.matches("trunk_output"));
        assert!(LayerPrecision::new("*.f.a", Precision::Fp32).matches("trunk_output.block2.block2-1.f.a.0"));
    }

    #[test]
    fn layer_precision_specs_parse_as_trtexec_writes_them() {
        let rules = LayerPrecision::parse_list("model.22.*:fp32, stem:FP16,layer?.0:tf32").expect("valid");
        assert_eq!(
            rules,
            [
                LayerPrecision::new("model.22.*", Precision::Fp32),
                LayerPrecision::new("stem", Precision::Fp16),
                LayerPrecision::new("layer?.0", Precision::Tf32)
            ]
        );
        // A pattern may hold a colon: the precision is after the last one.
        assert_eq!(LayerPrecision::parse_list("a:b:fp32").expect("valid")[0].pattern, "a:b");
        for (spec, why) in [
            ("model.22", "not `pattern:precision`"),
            (":fp32", "empty module-path pattern"),
            ("stem:fp64", "unknown precision `fp64`"),
            ("stem:int8", "per-layer Int8 is not supported"),
            ("stem:fp32,", "not `pattern:precision`"),
        ] {
            let err = LayerPrecision::parse_list(spec).expect_err(spec);
            assert!(matches!(&err, Error::Flag { flag, .. } if flag == LAYER_PRECISIONS_FLAG), "{spec}: {err:?}");
            let text = err.to_string();
            assert!(text.starts_with("--layer-precisions") && text.contains(why), "{spec}: {text}");
        }
    }

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
        let int8 = BuildConfig::default().precision(Precision::Int8).layer_precision("fc", Precision::Fp32);
        let err = int8.validate().expect_err("per-layer rules in an INT8 engine");
        assert!(err.to_string().starts_with("--layer-precisions"), "{err}");
        let bad = BuildConfig::default().layer_precision("fc", Precision::Fp8);
        assert!(bad.validate().is_err());
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

    /// A conv, a ReLU and a second conv: each node gets its rule's precision, the input its
    /// first reader's, and the passes keep the graph's own FP32 patterns.
    #[test]
    fn nodes_lower_in_their_rules_precision() {
        let tracer = Tracer::new();
        let x = tracer.input("input", &[1, 3, 8, 8]);
        let vb = VarBuilder::seeded();
        let y = Conv2d::load(vb.pp("stem"), &Conv2dConfig::new(3, 8, 3).padding(1)).and_then(|c| c.forward(&x)).expect("stem");
        let y = y.relu().expect("relu");
        let y = Conv2d::load(vb.pp("head.conv"), &Conv2dConfig::new(8, 4, 1)).and_then(|c| c.forward(&y)).expect("head");
        tracer.output("y", &y.sigmoid().expect("sigmoid"));
        tracer.require_fp32("head.sigmoid");
        let graph = crate::passes::optimize(&tracer.graph()).expect("passes");
        assert_eq!(graph.fp32_layers, ["head.sigmoid"], "the passes keep the graph's rules");
        let of = |config: &BuildConfig| -> Vec<(String, Precision)> {
            let p = node_precisions(&graph, config);
            graph.nodes.iter().zip(p).filter(|(n, _)| !matches!(n.op, Op::Weight { .. })).map(|(n, p)| (n.path.clone(), p)).collect()
        };
        let fp16 = BuildConfig::default();
        let mixed = fp16.clone().layer_precision("stem", Precision::Fp32);
        // The ReLU is fused into the stem's conv, which keeps the conv's path.
        let paths: Vec<String> = of(&fp16).into_iter().map(|(p, _)| p).collect();
        assert_eq!(paths, ["input", "stem", "head.conv", "head.sigmoid"]);
        use Precision::{Fp16, Fp32};
        assert_eq!(of(&fp16).into_iter().map(|(_, p)| p).collect::<Vec<_>>(), [Fp16, Fp16, Fp16, Fp32]);
        assert_eq!(of(&mixed).into_iter().map(|(_, p)| p).collect::<Vec<_>>(), [Fp32, Fp32, Fp16, Fp32]);
        let all32 = BuildConfig::default().precision(Precision::Fp32).layer_precision("head", Precision::Fp16);
        assert_eq!(of(&all32).into_iter().map(|(_, p)| p).collect::<Vec<_>>(), [Fp32, Fp32, Fp16, Fp16]);
    }
}
