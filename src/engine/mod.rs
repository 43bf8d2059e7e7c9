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

pub(crate) mod arena;
pub(crate) mod best;
pub(crate) mod builder;
pub(crate) mod choices;
pub(crate) mod config;
pub(crate) mod cudnn;
pub(crate) mod cudnn_graph;
pub(crate) mod eight_bit;
pub(crate) mod eight_bit_alloc;
pub(crate) mod exec;
pub(crate) mod file;
pub(crate) mod gemm;
pub(crate) mod gpu;
pub(crate) mod hopper_gemm;
pub(crate) mod kernels;
pub(crate) mod launch;
pub(crate) mod layer;
pub(crate) mod plan;
pub(crate) mod precision;
pub(crate) mod prepare;
pub(crate) mod reformat;
pub(crate) mod resolve;
pub(crate) mod strided;
pub(crate) mod tactic;
pub(crate) mod tma;

pub use crate::calibrate::{quant_sensitivity, CalibrationCache, CalibrationMethod, CalibrationStats, Calibrator, ScopeError};
/// FNV-1a (64 bit) of bytes: the engine file's checksum, and a content key for caches of engines.
pub use crate::hash::checksum;
pub use crate::number_format::QuantFormat;
/// The graph passes the builder runs first (BatchNorm folding, conv fusion, dead nodes): what the
/// CPU executor runs to match an engine layer for layer.
pub use crate::passes::optimize;
pub use builder::{dims_text, Engine, EngineBuilder};
pub use config::{BuildConfig, DimsRange, InputDims, ShapeProfile};
pub use exec::ExecutionContext;
pub use gpu::{gpu_available, Gpu, GpuInfo};
pub use plan::{BuildSummary, BuildTime, MemorySummary, Plan};
pub use precision::{LayerPrecision, Precision};

// Crate-internal shorthands (the plugin face re-exports the layer API publicly).

pub(crate) use layer::{DeviceBuf, Elem, Layer, Layout, RunCtx, ValueDesc, ValueId};
