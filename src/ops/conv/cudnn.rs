//! A conv node spelled out for the cuDNN layers (`engine::cudnn`): its geometry and epilogue as
//! the engine's plain [`ConvGeometry`] and [`Epilogue`], its weight, bias, input, output and
//! fused residual as a [`ConvProblem`].

use super::{Activation, ConvAttrs};
use crate::engine::cudnn::{ConvGeometry, ConvProblem, Epilogue};
use crate::engine::ValueId;
use crate::graph::{HostTensor, NodeId};
use crate::ops::BuildCtx;
use crate::LowerKind;
use crate::Result;

impl ConvAttrs {
    /// The stride, padding, dilation and groups, as cuDNN's descriptor takes them.
    pub(crate) fn geometry(&self) -> ConvGeometry {
        ConvGeometry { stride: self.stride, padding: self.padding, dilation: self.dilation, groups: self.groups }
    }

    /// The bias and ReLU the layer applies after the sum.
    pub(crate) fn epilogue(&self) -> Epilogue {
        Epilogue { bias: self.bias, relu: self.act == Activation::Relu }
    }
}

/// Zeros for a conv node without a bias: one per output channel.
pub(super) fn zero_bias(ctx: &BuildCtx, node: NodeId) -> Result<Vec<f32>> {
    Ok(vec![0.0; ctx.node(node).shape.get(1).copied().unwrap_or(0)])
}

/// The cuDNN layers' description of a conv node writing `y`: geometry and epilogue, weight
/// (PyTorch layout), bias (`zeros` when the node has none), input, output and fused residual.
pub(super) fn problem<'a>(
    ctx: &BuildCtx<'a>,
    node: NodeId,
    a: &ConvAttrs,
    w: &'a HostTensor,
    zeros: &'a [f32],
    y: ValueId,
) -> Result<ConvProblem<'a>> {
    let weight_shape: [usize; 4] =
        w.shape.as_slice().try_into().map_err(|_| ctx.err(node, LowerKind::Weights, format!("weight has shape {:?}", w.shape)))?;
    let bias = if a.bias { ctx.weight(node, 2)?.data.as_slice() } else { zeros };
    if bias.len() != zeros.len() {
        return Err(ctx.err(node, LowerKind::Weights, format!("bias has {} values for {} output channels", bias.len(), zeros.len())));
    }
    let residual = if a.residual { Some(ctx.input(node, if a.bias { 3 } else { 2 })?) } else { None };
    let (geometry, epilogue) = (a.geometry(), a.epilogue());
    Ok(ConvProblem { geometry, epilogue, weight: &w.data, weight_shape, bias, x: ctx.input(node, 0)?, y, z: residual })
}
