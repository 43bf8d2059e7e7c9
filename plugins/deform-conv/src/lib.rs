//! `torchvision.ops.deform_conv2d` (deformable convolution v2: offsets, mask, stride, padding,
//! dilation, groups, offset groups, bias) for Kiln, written as a user's plugin: this crate uses
//! only Kiln's public API and registers the op by name, without a line of Kiln changed.
//!
//! - `op.rs`: the op's attributes, shape rule and CPU reference (`CustomOp`), the registrations,
//!   and `DeformConv2d` (`torchvision.ops.DeformConv2d`) for models;
//! - `gpu.rs` + `kernels/deform_conv.cu`: the GPU converter (deformable im2col kernel + cuBLASLt GEMM).
//!
//! ```
//! use kiln::{Module, Tracer, VarBuilder};
//! use kiln_deform_conv::{DeformConv2d, DeformConv2dConfig};
//!
//! let tracer = Tracer::new();
//! let x = tracer.input("x", &[1, 8, 12, 12]);
//! let offset = tracer.input("offset", &[1, 18, 12, 12]);
//! let dcn = DeformConv2d::load(VarBuilder::seeded().pp("dcn"), &DeformConv2dConfig::new(8, 16, 3).padding(1)).unwrap();
//! let y = dcn.forward(&x, &offset, None).unwrap();
//! assert_eq!(y.shape(), [1, 16, 12, 12]);
//! kiln::plugin::check_converters(&tracer.graph()).expect("the GPU converter is registered");
//! ```
//! The walkthrough is this crate's README.

pub mod gpu;
pub mod op;

pub use op::{DeformAttrs, DeformConv2d, DeformConv2dConfig, OP};
