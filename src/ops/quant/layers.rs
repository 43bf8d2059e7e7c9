//! Engine layers of the quantisation ops: quantize, dequantize and fake-quantize in the
//! activation type (`kernels/quant.cu`). These run where an 8-bit value meets a layer without an
//! 8-bit implementation (the FP16 fallback), with the same arithmetic as the CPU reference, so a
//! quantised engine and the CPU fake-quant simulation see the same values.

use super::Quant;
use crate::engine::eight_bit::QUANT_CODES;
use crate::engine::launch::{grid_for, launch, CudaFunction, KArg, BLOCK};
use crate::engine::layer::{DeviceBuf, Layer, RunCtx, ValueId};
use crate::graph::NodeId;
use crate::ops::BuildCtx;
use crate::ops::OpDef;
use crate::LowerKind;
use crate::Result;

/// One Q, DQ or Q/DQ node over a whole value.
pub struct QuantLayer {
    path: String,
    kind: String,
    f: CudaFunction,
    x: ValueId,
    y: ValueId,
    per_image: usize,
    scale: DeviceBuf,
    zero_point: DeviceBuf,
    inner: i64,
    channels: i32,
    mode: i32,
    format: i32,
    range: (f32, f32),
    /// Per tensor: the vectorised kernel (`quant_tensor_*`) with the scale, `1/scale` and zero
    /// point as values; it runs where the element count is a multiple of a 16-byte vector.
    per_tensor: Option<(CudaFunction, [f32; 3])>,
    elem_bytes: usize,
    sm_count: u32,
}

impl Layer for QuantLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.kind.clone()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let n = batch * self.per_image;
        let per_vec = 16 / self.elem_bytes;
        let aligned = rt.ptr(self.x).is_multiple_of(16) && rt.ptr(self.y).is_multiple_of(16);
        if let (Some((f, [s, inv_s, z])), true, true) = (&self.per_tensor, n.is_multiple_of(per_vec), aligned) {
            let nvec = n / per_vec;
            let args = [
                KArg::Ptr(rt.ptr(self.x)),
                KArg::Ptr(rt.ptr(self.y)),
                KArg::I64(nvec as i64),
                KArg::F32(*s),
                KArg::F32(*inv_s),
                KArg::F32(*z),
                KArg::I32(self.mode),
                KArg::I32(self.format),
                KArg::F32(self.range.0),
                KArg::F32(self.range.1),
            ];
            return launch(rt, f, grid_for(nvec, self.sm_count), (BLOCK, 1, 1), 0, &args);
        }
        let args = [
            KArg::Ptr(rt.ptr(self.x)),
            KArg::Ptr(rt.ptr(self.y)),
            KArg::I64(n as i64),
            KArg::Ptr(self.scale.ptr()),
            KArg::Ptr(self.zero_point.ptr()),
            KArg::I64(self.inner),
            KArg::I32(self.channels),
            KArg::I32(self.mode),
            KArg::I32(self.format),
            KArg::F32(self.range.0),
            KArg::F32(self.range.1),
        ];
        launch(rt, &self.f, grid_for(n, self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

/// Lowers a quantisation node: the channel of each element comes from the physical stride of the
/// per-channel axis in the input's layout (any layout works).
pub fn quant_layer(ctx: &mut BuildCtx, node: NodeId, op: &Quant) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let desc = ctx.value(x).clone();
    if ctx.eight_bit.stored[node] {
        return codes_layer(ctx, node, op, x, y);
    }
    if ctx.value(y).elem != desc.elem || ctx.value(y).layout != desc.layout {
        return Err(ctx.err(
            node,
            LowerKind::Operands,
            format!("input {:?} {:?} and output differ in type or layout", desc.elem, desc.layout),
        ));
    }
    let p = op.params();
    let (channels, inner) = match p.axis {
        None => (1, 1),
        Some(0) => return Err(ctx.err(node, LowerKind::Operands, "per-channel quantisation along the batch dim has no engine layer")),
        Some(a) => {
            let strides = desc.layout.strides(&desc.dims);
            let (Some(&c), Some(&s)) = (desc.dims.get(a - 1), strides.get(a - 1)) else {
                return Err(ctx.err(node, LowerKind::TooLarge, format!("axis {a} is out of range for per-image dims {:?}", desc.dims)));
            };
            (c, s)
        }
    };
    let channels =
        i32::try_from(channels).map_err(|_| ctx.err(node, LowerKind::TooLarge, format!("{channels} channels exceed 32 bits")))?;
    let zp: Vec<f32> = (0..p.scale.len()).map(|c| p.zero_point.get(c).copied().unwrap_or(0) as f32).collect();
    let scale = ctx.upload_f32(&p.scale)?;
    let zero_point = ctx.upload_f32(&zp)?;
    let f = ctx.kernels.get(&format!("quant_{}", desc.elem.suffix()))?;
    let per_tensor = match (channels, p.scale.first()) {
        (1, Some(&s)) => Some((ctx.kernels.get(&format!("quant_tensor_{}", desc.elem.suffix()))?, [s, 1.0 / s, zp[0]])),
        _ => None,
    };
    Ok(Box::new(QuantLayer {
        path: ctx.node(node).path.clone(),
        kind: format!("kernel:{}_{}", op.name(), p.format.name()),
        f,
        x,
        y,
        per_image: desc.per_image_elems(),
        scale,
        zero_point,
        inner: inner as i64,
        channels,
        mode: op.kernel_mode(),
        format: p.format as i32,
        range: (p.qmin as f32, p.qmax as f32),
        per_tensor,
        elem_bytes: desc.elem.size(),
        sm_count: ctx.kernels.sm_count(),
    }))
}

/// A quantiser whose value an 8-bit engine stores as codes (`engine::eight_bit`), where no conv before
/// it writes them: reads the FP16/FP32 value and writes its int8 or e4m3 codes.
pub struct QuantCodesLayer {
    path: String,
    f: CudaFunction,
    x: ValueId,
    y: ValueId,
    per_image: usize,
    inv_scale: f32,
    format: i32,
    range: (f32, f32),
    sm_count: u32,
}

fn codes_layer(ctx: &mut BuildCtx, node: NodeId, op: &Quant, x: ValueId, y: ValueId) -> Result<Box<dyn Layer>> {
    let p = op.params();
    let (dx, dy) = (ctx.value(x).clone(), ctx.value(y).clone());
    let [scale] = p.scale[..] else {
        return Err(ctx.err(node, LowerKind::Weights, format!("{} scales for a stored (per-tensor) quantiser", p.scale.len())));
    };
    if dx.dims != dy.dims || !dx.layout.same_bytes(dy.layout, &dx.dims) {
        return Err(ctx.err(
            node,
            LowerKind::Operands,
            format!("input {:?} {:?} and its codes {:?} {:?} differ in shape or layout", dx.dims, dx.layout, dy.dims, dy.layout),
        ));
    }
    Ok(Box::new(QuantCodesLayer {
        path: ctx.node(node).path.clone(),
        f: ctx.kernels.get(&format!("quant_codes_{}", dx.elem.suffix()))?,
        x,
        y,
        per_image: dx.per_image_elems(),
        inv_scale: 1.0 / scale,
        format: p.format as i32,
        range: (p.qmin as f32, p.qmax as f32),
        sm_count: ctx.kernels.sm_count(),
    }))
}

impl Layer for QuantCodesLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        QUANT_CODES.into()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let n = batch * self.per_image;
        let args = [
            KArg::Ptr(rt.ptr(self.x)),
            KArg::Ptr(rt.ptr(self.y)),
            KArg::I64(n as i64),
            KArg::F32(self.inv_scale),
            KArg::I32(self.format),
            KArg::F32(self.range.0),
            KArg::F32(self.range.1),
        ];
        launch(rt, &self.f, grid_for(n.div_ceil(8), self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}
