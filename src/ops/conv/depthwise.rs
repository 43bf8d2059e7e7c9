//! Kiln's depthwise convolution kernel (`kernels/depthwise.cu`): a tactic candidate beside
//! cuDNN's for `groups == channels` convolutions.

use super::{Activation, ConvAttrs};
use crate::engine::launch::{grid_for, launch, nhwc, pack, same_elem, to_i32, CudaFunction, KArg, BLOCK};
use crate::engine::layer::{BuildCtx, DeviceBuf, Layer, RunCtx, ValueId};
use crate::graph::NodeId;
use crate::LowerKind;
use crate::{Error, Result};

/// A depthwise K x K convolution of NHWC images (`kernels/depthwise.cu`), bias, residual and ReLU
/// fused: a tactic candidate beside cuDNN's for `groups == channels` convolutions.
pub struct DepthwiseLayer {
    path: String,
    kind: String,
    f: CudaFunction,
    x: ValueId,
    residual: Option<ValueId>,
    y: ValueId,
    w: DeviceBuf,
    bias: Option<DeviceBuf>,
    /// H, W, C, OH, OW, sh, sw, ph, pw, relu
    dims: [i32; 10],
    vec: usize,
    sm_count: u32,
}

impl Layer for DepthwiseLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.kind.clone()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let n = i32::try_from(batch).map_err(|_| Error::Binding {
            name: self.path.clone(),
            reason: format!("batch {batch} exceeds the depthwise kernel's range"),
        })?;
        let mut args = vec![
            KArg::Ptr(rt.ptr(self.x)),
            KArg::Ptr(self.w.ptr()),
            KArg::Ptr(self.bias.as_ref().map_or(0, DeviceBuf::ptr)),
            KArg::Ptr(self.residual.map_or(0, |r| rt.ptr(r))),
            KArg::Ptr(rt.ptr(self.y)),
            KArg::I32(n),
        ];
        args.extend(self.dims.map(KArg::I32));
        args.push(KArg::I32((self.vec > 1) as i32));
        let [_, _, c, oh, ow, ..] = self.dims;
        let work = batch * (oh as usize) * (ow as usize) * (c as usize) / self.vec;
        launch(rt, &self.f, grid_for(work, self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

/// The [`DepthwiseLayer`] candidate for a Conv2d node, or `None` where it does not apply: not
/// transposed, `groups == Cin == Cout`, a square 3x3 or 5x5 kernel, dilation 1, stride 1 or 2.
/// Inputs as the conv converter reads them: x, weight `[C, 1, K, K]`, bias?, residual?.
pub fn candidate(ctx: &mut BuildCtx, node: NodeId, a: &ConvAttrs, y: ValueId) -> Result<Option<Box<dyn Layer>>> {
    let w = ctx.weight(node, 1)?;
    let k = match w.shape[..] {
        [_, 1, k, k2] if k == k2 && matches!(k, 3 | 5 | 7) => k,
        _ => return Ok(None),
    };
    let c = w.shape[0];
    let fits = !a.transposed && a.groups == c && a.dilation == [1, 1] && a.stride.iter().all(|s| (1..=2).contains(s));
    if !fits {
        return Ok(None);
    }
    let x = ctx.input(node, 0)?;
    let residual = if a.residual { Some(ctx.input(node, if a.bias { 3 } else { 2 })?) } else { None };
    let mut vals = vec![x, y];
    vals.extend(residual);
    let elem = same_elem(ctx, node, &vals)?;
    let (cx, h, wd) = nhwc(ctx, node, x)?;
    let (cy, oh, ow) = nhwc(ctx, node, y)?;
    if cx != c || cy != c {
        return Ok(None);
    }
    // [C, 1, K, K] -> [K*K, C]: tap-major, channels innermost.
    let taps = k * k;
    let mut wt = vec![0f32; taps * c];
    for ch in 0..c {
        for t in 0..taps {
            wt[t * c + ch] = w.data[ch * taps + t];
        }
    }
    let bias = if a.bias { Some(ctx.weight(node, 2)?.data.clone()) } else { None };
    if bias.as_ref().is_some_and(|b| b.len() != c) {
        return Err(ctx.err(node, LowerKind::Weights, format!("bias has {} values for {c} channels", bias.as_ref().map_or(0, Vec::len))));
    }
    let relu = a.act == Activation::Relu;
    let mut dims = [0i32; 10];
    let named = [("H", h), ("W", wd), ("C", c), ("OH", oh), ("OW", ow), ("stride", a.stride[0]), ("stride", a.stride[1])];
    for (d, (name, v)) in
        dims.iter_mut().zip(named.into_iter().chain([("padding", a.padding[0]), ("padding", a.padding[1]), ("relu", relu as usize)]))
    {
        *d = to_i32(ctx, node, name, v)?;
    }
    let w = ctx.upload_f32(&wt)?;
    let bias = bias.map(|b| ctx.upload_f32(&b)).transpose()?;
    let entry = format!("depthwise_k{k}_{}", elem.suffix());
    let f = ctx.kernels.get(&entry)?;
    let vec = if c % pack(elem) == 0 { pack(elem) } else { 1 };
    Ok(Some(Box::new(DepthwiseLayer {
        path: ctx.node(node).path.clone(),
        kind: format!("kernel:{entry}"),
        f,
        x,
        residual,
        y,
        w,
        bias,
        dims,
        vec,
        sm_count: ctx.kernels.sm_count(),
    })))
}

/// The depthwise kernels' entry points (`kernels/depthwise.cu`), for the list every family's
/// kernels are compiled and checked from.
pub(crate) fn entry_points() -> Vec<String> {
    crate::engine::launch::typed_entry_points(&["depthwise_k3", "depthwise_k5", "depthwise_k7"])
}
