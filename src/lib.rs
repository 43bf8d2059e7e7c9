//! Kiln: define a network in Rust, load its PyTorch weights, trace it into a graph, and run it on
//! the CPU (the reference) or compile it to a CUDA engine.
//!
//! ```text
//! Module structs ──forward(symbolic Tensor)──► Graph ──passes──► run_cpu | engine::EngineBuilder ──► Engine
//! ```
//!
//! The crate shows seven faces, each for one audience:
//! - this root: tracing ([`Tensor`], [`Tracer`]), modules ([`Module`], [`Forward`]), weights
//!   ([`VarBuilder`]), the traced [`Graph`], host tensors, the CPU reference ([`run_cpu`]) and the
//!   comparison against reference outputs ([`compare`]);
//! - [`nn`]: the layers and their configs, named as in `torch.nn`;
//! - [`engine`]: compile a graph into an engine, run it, calibrate it for 8-bit precisions;
//! - [`files`]: safetensors and PyTorch checkpoints into [`HostTensor`]s, graph files, engine files;
//! - [`image`]: the image geometry of the entry presets (letterbox, torchvision's resize and crop);
//! - [`plugin`]: what a custom op needs: its registration, its GPU layer, kernel compilation and
//!   launch;
//! - [`dev`]: for tools and test suites: seeded tensors, the CPU simulation of 8-bit engines,
//!   layer-by-layer comparison, DOT and code generation, the build's planning decisions.
//!
//! Every other module is private.

#![warn(clippy::undocumented_unsafe_blocks)]

mod calibrate;
mod codegen;
mod compare;
mod cpu;
pub mod dev;
mod dot;
pub mod engine;
mod error;
pub mod files;
mod graph;
mod graph_file;
mod hash;
mod host;
mod host_tensor;
pub mod image;
mod layerwise;
mod module;
pub mod nn;
mod number_format;
mod ops;
mod passes;
pub mod plugin;
mod pnm;
mod pth;
mod registry;
mod seeded;
mod tensor;
mod var_builder;

pub use compare::{compare, top1, Comparison};
pub use cpu::run as run_cpu;
pub use error::{Error, LowerKind, Result};
pub use graph::{ByteTensor, DType, Graph, HostInput, HostTensor, NodeId};
pub use kiln_macros::Module;
pub use module::{Forward, Module};
pub use tensor::{Param, Tensor, Tracer};
pub use var_builder::VarBuilder;

/// Re-exported for `inventory::submit!` in user crates registering ops and converters.
pub use inventory;

/// The README's Rust examples are compiled (and the CPU one run) as doctests, so they cannot rot.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
