//! The CUDA engine: what TensorRT's builder does, reached straight from our graph.
//!
//! ```text
//! Graph ──passes::optimize──► converters (one per op, inventory) ──► Layers ──► Engine ──► ExecutionContext
//!                                         │ tactic timing (+ cache)        │ engine file
//! ```
//!
//! Physical layout inside an engine: every activation is NHWC, batch-major, element type f32
//! (`Fp32`/`Tf32`) or f16 (`Fp16`), allocated for `max_batch` in one arena planned by tensor
//! lifetime. The user's inputs and outputs are NCHW f32 bindings; reformat layers convert at the
//! edges.

pub mod arena;
pub mod builder;
pub mod cudnn;
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
pub mod strided_gemm;
pub mod subpixel;
pub mod tactic;

pub use builder::{estimate_arena, BuildSummary, Engine, EngineBuilder, MemorySummary};
pub use exec::ExecutionContext;
pub use gpu::{gpu_available, Gpu, GpuInfo};
pub use layer::{BuildCtx, DeviceBuf, Elem, Layer, Layout, RunCtx, ValueDesc, ValueId, MAX_RANK};

use crate::graph::{Graph, NodeId, Op};
use crate::registry::build_table;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

/// Arithmetic of an engine. `Fp32` forbids TF32 (cuDNN FMA math, cuBLASLt `COMPUTE_32F`); `Tf32`
/// keeps f32 storage and lets tensor cores round inputs to TF32; `Fp16` stores activations and
/// weights in f16 and accumulates in f32. `Int8` and `Fp8` quantise the inputs and weights of
/// convolutions and Linear layers with a calibration cache's scales (or a graph's own Q/DQ
/// nodes), see `kiln::calibrate`; every other layer runs in FP16. `Fp8` needs sm_89 or newer.
/// `Best` is TensorRT's `--best`: per layer, the fastest of FP16, INT8 and FP8.
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

    /// `fp32` / `fp16`: the name of a storage type, for layer listings.
    pub fn name(elem: Elem) -> &'static str {
        match elem {
            Elem::F32 => "fp32",
            Elem::F16 => "fp16",
        }
    }

    /// The 8-bit format this precision quantises to (`None`: not a quantised precision).
    pub fn quant_format(self) -> Option<crate::graph::QuantFormat> {
        match self {
            Precision::Int8 | Precision::Best => Some(crate::graph::QuantFormat::Int8),
            Precision::Fp8 => Some(crate::graph::QuantFormat::Fp8E4m3),
            Precision::Fp32 | Precision::Tf32 | Precision::Fp16 => None,
        }
    }
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
}

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
    pub fn timing_cache(mut self, path: impl Into<PathBuf>) -> Self {
        self.timing_cache = Some(path.into());
        self
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
        Ok(())
    }
}

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
