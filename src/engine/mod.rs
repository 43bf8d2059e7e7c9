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
mod config;
mod converters;
pub mod cudnn;
pub mod cudnn_graph;
pub mod eight_bit;
mod eight_bit_alloc;
pub mod exec;
pub mod file;
pub mod gemm;
pub mod gpu;
pub mod kernels;
pub mod launch;
pub mod layer;
mod plan;
mod precision;
mod prepare;
pub mod reformat;
pub mod strided;
pub mod tactic;

pub use builder::{Engine, EngineBuilder};
pub use config::{node_precisions, BuildConfig, DimsRange, InputDims, ShapeProfile};
pub use converters::{check_converters, converter, Converter};
pub use exec::ExecutionContext;
pub use gpu::{gpu_available, Gpu, GpuInfo};
pub use layer::{BuildCtx, DeviceBuf, Elem, Layer, Layout, RunCtx, ValueDesc, ValueId, MAX_RANK};
pub use plan::{estimate_arena, BuildSummary, MemorySummary, Plan};
pub use precision::{glob_match, LayerPrecision, Precision, LAYER_PRECISIONS_FLAG};
