//! What a custom op needs. Register the op (its name, shape rule and CPU reference) as a
//! [`CustomOp`] with `kiln::inventory::submit!`, and its GPU converter with
//! [`register_converter!`](crate::register_converter). The converter reads its node through
//! [`BuildCtx`], compiles its CUDA source through the kernel cache of the [`LayerCtx`] it derefs to
//! (which also uploads weights, plans scratch and chooses among candidates), and returns a
//! [`Layer`]: a [`KernelLayer`] when one entry point over a grid-stride grid does the work (its
//! [`Arg`]s are resolved at each run), or a layer of its own whose `enqueue` calls [`launch`].
//! Built-in op families implement [`OpDef`] the same way.
//!
//! The graph's op-level IR is here too: [`Op`] and its families' attributes, which a converter
//! reads from its [`Node`] and which `kiln codegen --flat` writes.

pub use crate::engine::gemm::LtMatmul;
pub use crate::engine::kernels::{compile_source, image_has_symbol, nvrtc_available, Kernels};
pub use crate::engine::launch::{grid_for, launch, Arg, CudaFunction, KArg, KernelLayer, BLOCK};
pub use crate::engine::layer::{DeviceBuf, Elem, Layer, LayerCtx, Layout, RunCtx, ValueDesc, ValueId, MAX_RANK};
pub use crate::error::OpError;
pub use crate::graph::{
    Activation, Attention, Binary, ConvAttrs, Gemm, GemmAct, Node, Norm, Op, Pool, PoolAttrs, QkvAttention, Quant, QuantFormat,
    QuantParams, Resize, ShapeOp, Unary,
};
pub use crate::ops::custom::{attr, Attrs, CustomCall, CustomOp, ShapeRule};
pub use crate::ops::custom::{check_converters, check_registry, converter, lookup, Converter};
pub use crate::ops::elementwise::bias_act;
pub use crate::ops::{BuildCtx, OpDef};
