//! Kiln: define a convolutional network in Rust, load its PyTorch weights, trace it into a graph,
//! and run it on the CPU (the reference) or compile it to a CUDA engine.
//!
//! ```text
//! Module structs ──forward(symbolic Tensor)──► Graph ──passes──► CPU executor | EngineBuilder ──► Engine
//! ```

#![warn(clippy::undocumented_unsafe_blocks)]

pub mod calibrate;
pub mod codegen;
pub mod compare;
pub mod cpu;
pub mod dot;
pub mod engine;
pub mod error;
pub mod graph;
pub mod graph_file;
mod hash;
pub mod host;
pub mod layerwise;
pub mod module;
pub mod ops;
pub mod passes;
pub mod pnm;
pub mod pth;
pub mod registry;
pub mod seeded;
pub mod tensor;
pub mod var_builder;

pub use error::{Error, Result};
pub use graph::{
    Activation, Attention, Binary, ByteTensor, ConvAttrs, CustomCall, DType, Gemm, Graph, HostInput, HostTensor, Node, NodeId, Norm, Op,
    Pool, PoolAttrs, QkvAttention, Resize, ShapeOp, Unary,
};
pub use kiln_macros::Module;
pub use module::{Dropout, Forward, Identity, Module, Sequential};
pub use ops::conv::{Conv2d, Conv2dConfig, ConvTranspose2d};
pub use ops::elementwise::{Hardsigmoid, Hardswish, Hardtanh, LeakyReLU, LeakyReLUConfig, ReLU, ReLU6, SiLU, Sigmoid, Tanh, GELU};
pub use ops::linear::{Linear, LinearConfig};
pub use ops::norm::{BatchNorm2d, BatchNorm2dConfig, LayerNorm, LayerNorm2d, LayerNormConfig, Softmax};
pub use ops::pool::{AdaptiveAvgPool2d, AvgPool2d, MaxPool2d, Pool2dConfig};
pub use ops::resize::{InterpolateMode, Upsample, UpsampleConfig};
pub use ops::shape::{ConstantPad2d, ConstantPad2dConfig, ZeroPad2d};
pub use tensor::{Param, Tensor, Tracer};
pub use var_builder::VarBuilder;

/// Re-exported for `inventory::submit!` in user crates registering ops and converters.
pub use inventory;

/// The README's Rust examples are compiled (and the CPU one run) as doctests, so they cannot rot.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
