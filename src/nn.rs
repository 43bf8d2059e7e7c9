//! The layers, named and configured as in `torch.nn`. Each loads its weights from a
//! [`VarBuilder`](crate::VarBuilder) under the `state_dict` names and records its op when traced.
//! Every op family declares its own layers; this face gathers them.

pub use crate::module::{Dropout, Identity, Sequential};
pub use crate::ops::conv::nn::*;
pub use crate::ops::elementwise::nn::*;
pub use crate::ops::linear::nn::*;
pub use crate::ops::norm::nn::*;
pub use crate::ops::pool::nn::*;
pub use crate::ops::quant::nn::*;
pub use crate::ops::resize::nn::*;
pub use crate::ops::shape::nn::*;
