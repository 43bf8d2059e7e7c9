//! Engine layers that launch Kiln's own kernels (`kernels/*.cu`): activations, add/mul, the
//! bias + activation (+ residual) epilogue, pooling, concat, flatten and the layout/precision
//! reformats at the engine's edges. The converters in `ops/*.rs` are one-liners over these.
//!
//! Layers hold value handles, never addresses: the context's arena is planned after conversion
//! and every run reads the addresses from `RunCtx`. The batch is a kernel argument.

pub use super::launch::{grid_for, launch, CudaFunction, KArg, BLOCK};
use super::launch::{nhwc, pack, same_elem, to_i32};
use super::layer::{BuildCtx, DeviceBuf, Layer, Layout, RunCtx, ValueDesc, ValueId};
use super::strided::{CopyDim, CopyKind, StridedCopy, StridedLayer};
use crate::graph::NodeId;
use crate::ops::elementwise::{Binary, Unary};
use crate::ops::OpDef;
use crate::{Error, Result};

/// The activation an epilogue applies, as the kernels take it: `(code, p0, p1)`.
fn act_code(act: Option<Unary>) -> (i32, f32, f32) {
    act.map_or((0, 0.0, 0.0), Unary::kernel_code)
}

fn act_suffix(act: Option<Unary>) -> String {
    act.map_or(String::new(), |a| format!("+{}", a.name()))
}

// ---- elementwise --------------------------------------------------------------------------

/// `y = op(x)`, or `y = a op b`, over the whole value (operands of one shape and layout).
pub struct ElementwiseLayer {
    path: String,
    kind: String,
    f: CudaFunction,
    inputs: Vec<ValueId>,
    y: ValueId,
    per_image: usize,
    /// The arguments after the pointers and the element count.
    args: Vec<KArg>,
    sm_count: u32,
}

impl Layer for ElementwiseLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.kind.clone()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let n = batch * self.per_image;
        let mut args: Vec<KArg> = self.inputs.iter().map(|&v| KArg::Ptr(rt.ptr(v))).collect();
        args.extend([KArg::Ptr(rt.ptr(self.y)), KArg::I64(n as i64)]);
        args.extend_from_slice(&self.args);
        launch(rt, &self.f, grid_for(n / 4, self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

/// A unary elementwise node (activations, clamp, scalar arithmetic).
pub fn activation(ctx: &mut BuildCtx, node: NodeId, op: Unary) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let elem = same_elem(ctx, node, &[x, y])?;
    let f = ctx.kernels.get(&format!("activation_{}", elem.suffix()))?;
    let (code, p0, p1) = op.kernel_code();
    Ok(Box::new(ElementwiseLayer {
        path: ctx.node(node).path.clone(),
        kind: format!("kernel:{}", op.name()),
        f,
        inputs: vec![x],
        y,
        per_image: ctx.value(y).per_image_elems(),
        args: vec![KArg::I32(code), KArg::F32(p0), KArg::F32(p1)],
        sm_count: ctx.kernels.sm_count(),
    }))
}

/// A binary elementwise node (`+ - * /` with PyTorch's broadcasting). Two activations of the
/// output's dims in its layout take the packed same-shape kernel; anything else (a broadcast
/// operand, another layout, a constant such as a `[C, 1, 1]` layer scale or a `[1, L, D]` position
/// embedding, uploaded here) takes the strided broadcasting kernel.
pub fn binary(ctx: &mut BuildCtx, node: NodeId, op: Binary) -> Result<Box<dyn Layer>> {
    let y = ctx.output(node)?;
    let n_in = ctx.node(node).inputs.len();
    if n_in != 2 {
        return Err(ctx.err(node, format!("expects 2 operands, got {n_in}")));
    }
    let is_weight = |ctx: &BuildCtx, i: usize| ctx.graph.weight_data(ctx.node(node).inputs[i]).is_some();
    let dy = ctx.value(y).clone();
    if !is_weight(ctx, 0) && !is_weight(ctx, 1) {
        let (a, b) = (ctx.input(node, 0)?, ctx.input(node, 1)?);
        let elem = same_elem(ctx, node, &[a, b, y])?;
        let same = |v: ValueId| {
            let d = ctx.value(v);
            d.dims == dy.dims && d.layout.same_bytes(dy.layout, &dy.dims)
        };
        if same(a) && same(b) {
            let f = ctx.kernels.get(&format!("binary_{}", elem.suffix()))?;
            return Ok(Box::new(ElementwiseLayer {
                path: ctx.node(node).path.clone(),
                kind: format!("kernel:{}", op.name()),
                f,
                inputs: vec![a, b],
                y,
                per_image: dy.per_image_elems(),
                args: vec![KArg::I32(op.kernel_code()), KArg::I32(0), KArg::F32(0.0)],
                sm_count: ctx.kernels.sm_count(),
            }));
        }
    }
    broadcast_binary(ctx, node, op, y)
}

/// One operand of a broadcasting binary layer: an activation, or a constant the layer owns.
enum Operand {
    Value(ValueId),
    Const(DeviceBuf),
}

impl Operand {
    fn ptr(&self, rt: &RunCtx) -> u64 {
        match self {
            Operand::Value(v) => rt.ptr(*v),
            Operand::Const(b) => b.ptr(),
        }
    }
}

/// `y = a op b` through per-operand strides (`binary_bcast_*`).
pub struct BroadcastBinaryLayer {
    path: String,
    kind: String,
    f: CudaFunction,
    operands: [Operand; 2],
    y: ValueId,
    meta: DeviceBuf,
    rank: i32,
    op_code: i32,
    vec: bool,
    per_image: usize,
    sm_count: u32,
}

impl Layer for BroadcastBinaryLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.kind.clone()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let n = batch * self.per_image;
        let args = [
            KArg::Ptr(self.operands[0].ptr(rt)),
            KArg::Ptr(self.operands[1].ptr(rt)),
            KArg::Ptr(rt.ptr(self.y)),
            KArg::I64(n as i64),
            KArg::Ptr(self.meta.ptr()),
            KArg::I32(self.rank),
            KArg::I32(self.op_code),
            KArg::I32(self.vec as i32),
        ];
        let work = if self.vec { n / 4 } else { n };
        launch(rt, &self.f, grid_for(work, self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

/// Element strides of each output dim (logical order) for one operand of a broadcast, and its
/// batch stride: an activation of the output's rank in its own layout, or a constant weight
/// (its own row-major shape, aligned to the output's dims from the right, batch stride 0).
fn operand_strides(ctx: &BuildCtx, node: NodeId, i: usize, out: &[usize]) -> Result<(Vec<usize>, usize, Option<Vec<f32>>)> {
    let bad = |what: String| ctx.err(node, format!("operand {i} {what} does not broadcast to the output {out:?} (per image)"));
    let src = ctx.node(node).inputs[i];
    if let Some(w) = ctx.graph.weight_data(src) {
        // The weight's dims against the full output [batch, out...]: its leading dims beyond the
        // output's per-image rank must be 1 (a constant is shared by every image).
        let rank = out.len() + 1;
        if w.shape.len() > rank {
            return Err(bad(format!("(a constant of shape {:?})", w.shape)));
        }
        let full: Vec<usize> = std::iter::repeat_n(1, rank - w.shape.len()).chain(w.shape.iter().copied()).collect();
        if full[0] != 1 {
            return Err(bad(format!(
                "(a constant of shape {:?} whose dim {} lines up with the batch; the engine keeps the batch as dim 0 and shares constants across it)",
                w.shape,
                w.shape.len() - out.len() - 1
            )));
        }
        let dims = &full[1..];
        let mut strides = vec![0; out.len()];
        let mut s = 1;
        for d in (0..out.len()).rev() {
            if dims[d] != out[d] && dims[d] != 1 {
                return Err(bad(format!("(a constant of shape {:?})", w.shape)));
            }
            strides[d] = if dims[d] == 1 { 0 } else { s };
            s *= dims[d];
        }
        return Ok((strides, 0, Some(w.data.clone())));
    }
    let v = ctx.input(node, i)?;
    let d = ctx.value(v);
    if d.dims.len() != out.len() {
        return Err(bad(format!(
            "{:?} (an activation of another rank: its batch dim would not line up with the output's; the engine keeps the batch as dim 0)",
            d.dims
        )));
    }
    let strides = activation_strides(&d.dims, d.layout, out).ok_or_else(|| bad(format!("{:?}", d.dims)))?;
    Ok((strides, d.per_image_elems(), None))
}

/// Element strides of each dim of `out` for a value of `dims` stored in `layout` (0 along the
/// dims it is broadcast over), or `None` if it does not broadcast to `out` (same rank).
fn activation_strides(dims: &[usize], layout: Layout, out: &[usize]) -> Option<Vec<usize>> {
    let mut strides = layout.strides(dims);
    for (k, s) in strides.iter_mut().enumerate() {
        match (dims[k], out[k]) {
            (a, b) if a == b => {}
            (1, _) => *s = 0,
            _ => return None,
        }
    }
    Some(strides)
}

/// The broadcasting kernel's plan: `[size, stride a, stride b]` per dim of y in its physical
/// order (outermost first), size-1 dims dropped and runs that are contiguous for both operands
/// merged; and whether the packed path applies (innermost size a multiple of `width`, innermost
/// strides 0 or 1, every other stride and both batch strides multiples of `width`).
fn broadcast_plan(out: &[usize], layout: Layout, strides: [&[usize]; 2], batch: [usize; 2], width: usize) -> (Vec<[usize; 3]>, bool) {
    let mut merged: Vec<[usize; 3]> = Vec::with_capacity(out.len());
    for k in layout.order().into_iter().filter(|&k| out[k] != 1) {
        let d = [out[k], strides[0][k], strides[1][k]];
        match merged.last_mut() {
            Some(outer) if outer[1] == d[1] * d[0] && outer[2] == d[2] * d[0] => *outer = [outer[0] * d[0], d[1], d[2]],
            _ => merged.push(d),
        }
    }
    if merged.is_empty() {
        merged.push([1, 0, 0]);
    }
    let inner = merged[merged.len() - 1];
    let aligned = |s: usize| s.is_multiple_of(width);
    let vec = aligned(inner[0])
        && inner[1] <= 1
        && inner[2] <= 1
        && merged[..merged.len() - 1].iter().all(|d| aligned(d[1]) && aligned(d[2]))
        && batch.iter().all(|&b| aligned(b));
    (merged, vec)
}

/// A [`BroadcastBinaryLayer`]: strides in the output's physical order, size-1 dims dropped and
/// runs that are contiguous for both operands merged (an SE block's `[C, H, W] * [C, 1, 1]` in
/// NHWC becomes `[HW, C]` by `[0, 1]`).
fn broadcast_binary(ctx: &mut BuildCtx, node: NodeId, op: Binary, y: ValueId) -> Result<Box<dyn Layer>> {
    let dy = ctx.value(y).clone();
    let elem = dy.elem;
    let mut operands = Vec::with_capacity(2);
    let mut strides = Vec::with_capacity(2);
    let mut batch = [0usize; 2];
    for (i, batch_stride) in batch.iter_mut().enumerate() {
        let (s, b, data) = operand_strides(ctx, node, i, &dy.dims)?;
        let operand = match data {
            Some(w) => Operand::Const(ctx.upload(&w)?),
            None => {
                let v = ctx.input(node, i)?;
                if ctx.value(v).elem != elem {
                    return Err(ctx.err(node, format!("mixes element types {:?} and {elem:?}", ctx.value(v).elem)));
                }
                Operand::Value(v)
            }
        };
        operands.push(operand);
        strides.push(s);
        *batch_stride = b;
    }
    if operands.iter().all(|o| matches!(o, Operand::Const(_))) {
        return Err(ctx.err(node, "both operands are constants (fold them before building)".into()));
    }
    let (merged, vec) = broadcast_plan(&dy.dims, dy.layout, [&strides[0], &strides[1]], batch, pack(elem));
    let mut meta: Vec<i64> = merged.iter().map(|d| d[0] as i64).collect();
    meta.extend(merged.iter().map(|d| d[1] as i64));
    meta.extend(merged.iter().map(|d| d[2] as i64));
    meta.extend(batch.map(|b| b as i64));
    let bytes: Vec<u8> = meta.iter().flat_map(|v| v.to_le_bytes()).collect();
    let meta = ctx.upload_bytes(&bytes)?;
    let f = ctx.kernels.get(&format!("binary_bcast_{}", elem.suffix()))?;
    let operands: [Operand; 2] = operands.try_into().unwrap_or_else(|_| unreachable!("two operands were pushed"));
    Ok(Box::new(BroadcastBinaryLayer {
        path: ctx.node(node).path.clone(),
        kind: format!("kernel:{}_broadcast", op.name()),
        f,
        operands,
        y,
        meta,
        rank: merged.len() as i32,
        op_code: op.kernel_code(),
        vec,
        per_image: dy.per_image_elems(),
        sm_count: ctx.kernels.sm_count(),
    }))
}
/// `y = act(x + bias[c] + residual)` over NHWC (or `[N, F]`) values: the epilogue of layers whose
/// library call cannot fuse it (e.g. a deconvolution's bias, a GEMM without the epilogue).
pub struct BiasActLayer {
    path: String,
    f: CudaFunction,
    x: ValueId,
    scale: Option<DeviceBuf>,
    bias: Option<DeviceBuf>,
    residual: Option<ValueId>,
    y: ValueId,
    rows_per_image: usize,
    channels: usize,
    act: Option<Unary>,
    sm_count: u32,
}

impl Layer for BiasActLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        let scale = if self.scale.is_some() { "scale+" } else { "" };
        format!("kernel:{scale}bias{}{}", if self.residual.is_some() { "+residual" } else { "" }, act_suffix(self.act))
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let rows = batch * self.rows_per_image;
        let (code, slope, _) = act_code(self.act);
        let args = [
            KArg::Ptr(rt.ptr(self.x)),
            KArg::Ptr(self.scale.as_ref().map_or(0, |b| b.ptr())),
            KArg::Ptr(self.bias.as_ref().map_or(0, |b| b.ptr())),
            KArg::Ptr(self.residual.map_or(0, |r| rt.ptr(r))),
            KArg::Ptr(rt.ptr(self.y)),
            KArg::I64(rows as i64),
            KArg::I32(self.channels as i32),
            KArg::I32(code),
            KArg::F32(slope),
        ];
        launch(rt, &self.f, grid_for(rows * self.channels / 4, self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

/// Builds a [`BiasActLayer`] for `node` reading `x` and writing `y` (which may be `x`: in place):
/// `act(x * scale + bias + residual)`. `scale` and `bias` have one value per channel (uploaded as
/// f32 whatever the precision); an unfolded BatchNorm is this with its scale and shift.
#[allow(clippy::too_many_arguments)]
pub fn bias_act(
    ctx: &mut BuildCtx,
    node: NodeId,
    x: ValueId,
    scale: Option<&[f32]>,
    bias: Option<&[f32]>,
    residual: Option<ValueId>,
    y: ValueId,
    act: Option<Unary>,
) -> Result<Box<dyn Layer>> {
    let mut vals = vec![x, y];
    vals.extend(residual);
    let elem = same_elem(ctx, node, &vals)?;
    let (c, h, w) =
        ctx.value(y).chw().ok_or_else(|| ctx.err(node, format!("bias epilogue needs [C, H, W] or [F], got {:?}", ctx.value(y).dims)))?;
    if !ctx.value(y).layout.same_bytes(Layout::channels_last(ctx.value(y).dims.len()), &ctx.value(y).dims) {
        return Err(ctx.err(node, "bias epilogue runs on NHWC values".into()));
    }
    for (what, v) in [("scale", scale), ("bias", bias)] {
        if let Some(v) = v.filter(|v| v.len() != c) {
            return Err(ctx.err(node, format!("{what} has {} values for {c} channels", v.len())));
        }
    }
    let scale = scale.map(|s| ctx.upload_f32(s)).transpose()?;
    let bias = bias.map(|b| ctx.upload_f32(b)).transpose()?;
    let f = ctx.kernels.get(&format!("bias_act_{}", elem.suffix()))?;
    Ok(Box::new(BiasActLayer {
        path: ctx.node(node).path.clone(),
        f,
        x,
        scale,
        bias,
        residual,
        y,
        rows_per_image: h * w,
        channels: to_i32(ctx, node, "channels", c)? as usize,
        act,
        sm_count: ctx.kernels.sm_count(),
    }))
}

// ---- pooling ------------------------------------------------------------------------------

/// Which pooling a `PoolLayer` runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PoolKind {
    Max,
    Avg { count_include_pad: bool },
    Adaptive,
}

pub struct PoolLayer {
    path: String,
    kind: PoolKind,
    f: CudaFunction,
    x: ValueId,
    y: ValueId,
    /// H, W, C, OH, OW
    dims: [i32; 5],
    /// kh, kw, sh, sw, ph, pw (unused by adaptive pooling)
    window: [i32; 6],
    vec: usize,
    sm_count: u32,
}

/// Rows of the global-average-pool kernel's blocks (`GAP_ROWS` in kernels/pool.cu).
const GAP_ROWS: u32 = 8;

impl PoolLayer {
    /// Adaptive pooling to 1×1: a reduction over every pixel, with a kernel of its own.
    fn is_global(&self) -> bool {
        self.kind == PoolKind::Adaptive && self.dims[3] == 1 && self.dims[4] == 1
    }
}

impl Layer for PoolLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        match self.kind {
            PoolKind::Max => "kernel:max_pool2d".into(),
            PoolKind::Avg { .. } => "kernel:avg_pool2d".into(),
            PoolKind::Adaptive if self.is_global() => "kernel:global_avg_pool".into(),
            PoolKind::Adaptive => "kernel:adaptive_avg_pool2d".into(),
        }
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let [h, w, c, oh, ow] = self.dims;
        if self.is_global() {
            // One block per (image, 32 channel packs): `GAP_ROWS` rows of 32 lanes. A pack is 16
            // bytes where C and both pointers allow it (the kernel makes the same choice).
            let aligned = rt.ptr(self.x).is_multiple_of(16) && rt.ptr(self.y).is_multiple_of(16);
            let vec = if aligned { self.vec } else { 1 };
            let grid = (batch as u32, (c as u32).div_ceil(32 * vec as u32), 1);
            let args = [KArg::Ptr(rt.ptr(self.x)), KArg::Ptr(rt.ptr(self.y)), KArg::I32(h * w), KArg::I32(c)];
            return launch(rt, &self.f, grid, (32 * GAP_ROWS, 1, 1), 0, &args);
        }
        let mut args = vec![KArg::Ptr(rt.ptr(self.x)), KArg::Ptr(rt.ptr(self.y)), KArg::I32(batch as i32)];
        args.extend([h, w, c, oh, ow].map(KArg::I32));
        if self.kind != PoolKind::Adaptive {
            args.extend(self.window.map(KArg::I32));
        }
        if let PoolKind::Avg { count_include_pad } = self.kind {
            args.push(KArg::I32(count_include_pad as i32));
        }
        let work = batch * (oh * ow) as usize * c as usize / self.vec;
        launch(rt, &self.f, grid_for(work, self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

/// A pooling layer over NHWC values; `window` = kh, kw, sh, sw, ph, pw (unused by adaptive pooling).
pub fn pool_layer(ctx: &mut BuildCtx, node: NodeId, kind: PoolKind, window: [usize; 6]) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    pool_layer_between(ctx, node, kind, window, x, y)
}

/// `pool_layer` from `x` to `y` rather than the node's input and output (a conv's fused max-pool
/// reads the conv's output from scratch).
pub fn pool_layer_between(
    ctx: &mut BuildCtx,
    node: NodeId,
    kind: PoolKind,
    window: [usize; 6],
    x: ValueId,
    y: ValueId,
) -> Result<Box<dyn Layer>> {
    let elem = same_elem(ctx, node, &[x, y])?;
    let (c, h, w) = nhwc(ctx, node, x)?;
    let (c2, oh, ow) = nhwc(ctx, node, y)?;
    if c2 != c {
        return Err(ctx.err(node, format!("pooling maps {c} channels to {c2}")));
    }
    // Launch arguments are 32-bit; the batch is checked when the layer runs.
    let mut dims = [0i32; 5];
    for (d, (name, v)) in dims.iter_mut().zip([("H", h), ("W", w), ("C", c), ("OH", oh), ("OW", ow)]) {
        *d = to_i32(ctx, node, name, v)?;
    }
    let mut win = [0i32; 6];
    for (d, v) in win.iter_mut().zip(window) {
        *d = to_i32(ctx, node, "window", v)?;
    }
    let name = match kind {
        PoolKind::Max => "max_pool2d",
        PoolKind::Avg { .. } => "avg_pool2d",
        PoolKind::Adaptive if (oh, ow) == (1, 1) => "global_avg_pool",
        PoolKind::Adaptive => "adaptive_avg_pool2d",
    };
    let f = ctx.kernels.get(&format!("{name}_{}", elem.suffix()))?;
    let vec = if c % pack(elem) == 0 { pack(elem) } else { 1 };
    Ok(Box::new(PoolLayer { path: ctx.node(node).path.clone(), kind, f, x, y, dims, window: win, vec, sm_count: ctx.kernels.sm_count() }))
}

// ---- resize --------------------------------------------------------------------------------

/// Nearest or bilinear upsampling of an NHWC image through per-axis index (and weight) tables.
pub struct ResizeLayer {
    path: String,
    kind: &'static str,
    f: CudaFunction,
    x: ValueId,
    y: ValueId,
    /// H, W, C, OH, OW
    dims: [i32; 5],
    tab: DeviceBuf,
    /// Bilinear weights (`None` for nearest).
    lam: Option<DeviceBuf>,
    vec: usize,
    sm_count: u32,
}

impl Layer for ResizeLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        format!("kernel:{}", self.kind)
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let [h, w, c, oh, ow] = self.dims;
        let n = i32::try_from(batch)
            .map_err(|_| Error::Binding { name: self.path.clone(), reason: format!("batch {batch} exceeds the resize kernel's range") })?;
        let mut args = vec![KArg::Ptr(rt.ptr(self.x)), KArg::Ptr(rt.ptr(self.y)), KArg::I32(n)];
        args.extend([h, w, c, oh, ow].map(KArg::I32));
        args.push(KArg::Ptr(self.tab.ptr()));
        if let Some(lam) = &self.lam {
            args.push(KArg::Ptr(lam.ptr()));
        }
        args.push(KArg::I32((self.vec > 1) as i32));
        let work = batch * (oh as usize) * (ow as usize) * (c as usize) / self.vec;
        launch(rt, &self.f, grid_for(work, self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

/// A [`ResizeLayer`] for a `Resize` node (NHWC in and out); the tables come from the op's own
/// index arithmetic, the one the CPU reference uses.
pub fn resize(ctx: &mut BuildCtx, node: NodeId, op: &crate::ops::resize::Resize) -> Result<Box<dyn Layer>> {
    use crate::ops::resize::Resize;
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let elem = same_elem(ctx, node, &[x, y])?;
    let (c, h, w) = nhwc(ctx, node, x)?;
    let (c2, oh, ow) = nhwc(ctx, node, y)?;
    if c2 != c || op.output_hw([h, w]).map_err(|e| ctx.err(node, e))? != [oh, ow] {
        return Err(ctx.err(node, format!("resize maps [{c}, {h}, {w}] to [{c2}, {oh}, {ow}]")));
    }
    let mut dims = [0i32; 5];
    for (d, (name, v)) in dims.iter_mut().zip([("H", h), ("W", w), ("C", c), ("OH", oh), ("OW", ow)]) {
        *d = to_i32(ctx, node, name, v)?;
    }
    let ints = |v: Vec<usize>| -> Vec<u8> { v.into_iter().flat_map(|i| (i as i32).to_le_bytes()).collect() };
    let (kind, tab, lam) = match *op {
        Resize::Nearest { scale, .. } => {
            let mut t = Resize::nearest_indices(scale.map(|s| s[0]), h, oh);
            t.extend(Resize::nearest_indices(scale.map(|s| s[1]), w, ow));
            ("resize_nearest", ints(t), None)
        }
        Resize::Bilinear { scale, align_corners, .. } => {
            let ty = Resize::linear_indices(scale.map(|s| s[0]), align_corners, h, oh);
            let tx = Resize::linear_indices(scale.map(|s| s[1]), align_corners, w, ow);
            let mut idx = Vec::with_capacity(2 * (oh + ow));
            let mut lam = Vec::with_capacity(2 * (oh + ow));
            for t in [&ty, &tx] {
                idx.extend(t.iter().map(|e| e.0));
                idx.extend(t.iter().map(|e| e.1));
                lam.extend(t.iter().map(|e| e.2));
                lam.extend(t.iter().map(|e| e.3));
            }
            ("resize_bilinear", ints(idx), Some(lam))
        }
    };
    let tab = ctx.upload_bytes(&tab)?;
    let lam = lam.map(|l| ctx.upload_f32(&l)).transpose()?;
    let f = ctx.kernels.get(&format!("{kind}_{}", elem.suffix()))?;
    let vec = if c % pack(elem) == 0 { pack(elem) } else { 1 };
    Ok(Box::new(ResizeLayer { path: ctx.node(node).path.clone(), kind, f, x, y, dims, tab, lam, vec, sm_count: ctx.kernels.sm_count() }))
}

// ---- concat -------------------------------------------------------------------------------

pub struct ConcatLayer {
    path: String,
    f: CudaFunction,
    /// Each input and its channel count, in output order.
    inputs: Vec<(ValueId, usize)>,
    y: ValueId,
    rows_per_image: usize,
    out_channels: usize,
    sm_count: u32,
}

impl Layer for ConcatLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        format!("kernel:concat_channels(x{})", self.inputs.len())
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let rows = batch * self.rows_per_image;
        let mut offset = 0;
        for &(x, cin) in &self.inputs {
            let args = [
                KArg::Ptr(rt.ptr(x)),
                KArg::Ptr(rt.ptr(self.y)),
                KArg::I64(rows as i64),
                KArg::I32(cin as i32),
                KArg::I32(self.out_channels as i32),
                KArg::I32(offset as i32),
            ];
            launch(rt, &self.f, grid_for(rows * cin / 4, self.sm_count), (BLOCK, 1, 1), 0, &args)?;
            offset += cin;
        }
        Ok(())
    }
}

/// `cat` along channels (dim 1 of NCHW, the innermost of NHWC). Other dims are rejected.
pub fn concat(ctx: &mut BuildCtx, node: NodeId, dim: usize) -> Result<Box<dyn Layer>> {
    let n_in = ctx.node(node).inputs.len();
    let y = ctx.output(node)?;
    let ins: Vec<ValueId> = (0..n_in).map(|i| ctx.input(node, i)).collect::<Result<_>>()?;
    let mut all = ins.clone();
    all.push(y);
    let elem = same_elem(ctx, node, &all)?;
    let dy = ctx.value(y).clone();
    let rank = dy.dims.len() + 1;
    if dim != 1 {
        return Err(
            ctx.err(node, format!("the GPU engine concatenates along channels (dim 1) only, got dim {dim} of a rank-{rank} tensor"))
        );
    }
    let (cout, h, w) = dy.chw().ok_or_else(|| ctx.err(node, format!("cannot concatenate values of dims {:?}", dy.dims)))?;
    let mut inputs = Vec::with_capacity(n_in);
    for v in ins {
        let d = ctx.value(v);
        let (c, hi, wi) = d.chw().ok_or_else(|| ctx.err(node, format!("cannot concatenate values of dims {:?}", d.dims)))?;
        if (hi, wi) != (h, w) || !d.layout.same_bytes(Layout::channels_last(d.dims.len()), &d.dims) {
            return Err(ctx.err(node, format!("input {:?} {:?} does not fit output {:?}", d.layout, d.dims, dy.dims)));
        }
        inputs.push((v, c));
    }
    to_i32(ctx, node, "channels", cout)?;
    let f = ctx.kernels.get(&format!("concat_channels_{}", elem.suffix()))?;
    Ok(Box::new(ConcatLayer {
        path: ctx.node(node).path.clone(),
        f,
        inputs,
        y,
        rows_per_image: h * w,
        out_channels: cout,
        sm_count: ctx.kernels.sm_count(),
    }))
}

// ---- reformat and flatten -----------------------------------------------------------------

/// A batched `[C, HW]` <-> `[HW, cs]` transpose with a precision change, or a plain cast.
pub struct ReformatLayer {
    path: String,
    kind: String,
    f: CudaFunction,
    src: ValueId,
    dst: ValueId,
    /// `Some((C, HW, cs))` for a transpose; `None` for a cast of `per_image` elements.
    transpose: Option<(i32, i32, i32)>,
    /// The transpose has at most `SMALL_CHANNELS` channels on its NHWC side: one thread per
    /// pixel (`*_small` entry points) instead of mostly idle 32×32 tiles.
    small: bool,
    per_image: usize,
    sm_count: u32,
}

impl Layer for ReformatLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.kind.clone()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let (src, dst) = (KArg::Ptr(rt.ptr(self.src)), KArg::Ptr(rt.ptr(self.dst)));
        match self.transpose {
            Some((c, hw, cs)) if self.small => {
                let pixels = batch * hw as usize;
                let args = [src, dst, KArg::I32(c), KArg::I64(hw as i64), KArg::I32(cs), KArg::I64(pixels as i64)];
                launch(rt, &self.f, grid_for(pixels, self.sm_count), (BLOCK, 1, 1), 0, &args)
            }
            Some((c, hw, cs)) => {
                let batch = u32::try_from(batch).ok().filter(|&b| b <= 65535).ok_or_else(|| Error::Binding {
                    name: self.path.clone(),
                    reason: format!("batch {batch} exceeds the reformat kernel's grid limit of 65535"),
                })?;
                let grid = ((hw as u32).div_ceil(32), (c.max(cs) as u32).div_ceil(32), batch);
                launch(rt, &self.f, grid, (32, 8, 1), 0, &[src, dst, KArg::I32(c), KArg::I32(hw), KArg::I32(cs)])
            }
            None => {
                let n = batch * self.per_image;
                launch(rt, &self.f, grid_for(n, self.sm_count), (BLOCK, 1, 1), 0, &[src, dst, KArg::I64(n as i64)])
            }
        }
    }
}

/// Channel counts (NHWC side) up to which reformats run one thread per pixel (`SMALL_C` in
/// kernels/reformat.cu).
const SMALL_CHANNELS: usize = 8;

/// Copies a value into another memory order and element type: the general reformat.
pub struct PermuteLayer {
    path: String,
    kind: String,
    f: CudaFunction,
    src: ValueId,
    dst: ValueId,
    /// Sizes (in `dst`'s physical order), `src` strides of those dims, `src`'s batch stride.
    meta: DeviceBuf,
    rank: i32,
    per_image: usize,
    sm_count: u32,
}

impl Layer for PermuteLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.kind.clone()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let n = batch * self.per_image;
        let args = [
            KArg::Ptr(rt.ptr(self.src)),
            KArg::Ptr(rt.ptr(self.dst)),
            KArg::I64(n as i64),
            KArg::Ptr(self.meta.ptr()),
            KArg::I32(self.rank),
        ];
        launch(rt, &self.f, grid_for(n, self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

/// A [`PermuteLayer`] reading `src` (logical dims `dims`, in `src_layout`, with its own strides)
/// into `dst`. `src_strides` are the element strides of each logical dim of the source view, and
/// `src_offset` its first element (for slices); `batch_stride` is the source's per-image size.
pub fn permute_layer(
    ctx: &mut BuildCtx,
    path: &str,
    src: ValueId,
    src_strides: &[usize],
    batch_stride: usize,
    dst: ValueId,
) -> Result<Box<dyn Layer>> {
    let d = ctx.value(dst).clone();
    let s_elem = ctx.value(src).elem;
    let order = d.layout.order();
    let mut meta: Vec<i64> = order.iter().map(|&k| d.dims[k] as i64).collect();
    meta.extend(order.iter().map(|&k| src_strides[k] as i64));
    meta.push(batch_stride as i64);
    let bytes: Vec<u8> = meta.iter().flat_map(|v| v.to_le_bytes()).collect();
    let meta = ctx.upload_bytes(&bytes)?;
    let entry = format!("permute_{}_{}", s_elem.suffix(), d.elem.suffix());
    let f = ctx.kernels.get(&entry)?;
    Ok(Box::new(PermuteLayer {
        path: path.to_string(),
        kind: format!("kernel:{entry}"),
        f,
        src,
        dst,
        meta,
        rank: order.len() as i32,
        per_image: d.per_image_elems(),
        sm_count: ctx.kernels.sm_count(),
    }))
}

/// A layer converting `src` to `dst` (the same logical dims, or `dst` with zero-padded channels
/// at the engine's input), deciding from their descriptions: a precision cast where the layouts
/// are the same bytes; the tiled NCHW <-> NHWC transposes for images; the general permute otherwise.
pub fn reformat_layer(ctx: &mut BuildCtx, src: ValueId, dst: ValueId, path: &str) -> Result<Box<dyn Layer>> {
    let (s, d) = (ctx.value(src).clone(), ctx.value(dst).clone());
    let fail = |why: String| Error::Lower {
        path: path.to_string(),
        op: "reformat".into(),
        reason: format!("cannot reformat `{}` to `{}`: {why}", s.name, d.name),
    };
    let pair = format!("{}_{}", s.elem.suffix(), d.elem.suffix());
    if s.dims == d.dims && s.layout.same_bytes(d.layout, &s.dims) {
        let f = ctx.kernels.get(&format!("cast_{pair}"))?;
        return Ok(Box::new(ReformatLayer {
            path: path.to_string(),
            kind: format!("kernel:cast_{pair}"),
            f,
            src,
            dst,
            transpose: None,
            small: false,
            per_image: d.per_image_elems(),
            sm_count: ctx.kernels.sm_count(),
        }));
    }
    let image = |v: &ValueDesc| v.dims.len() == 3;
    let (nchw, nhwc) = (Layout::contiguous(3), Layout::channels_last(3));
    let tiled = image(&s) && image(&d) && s.dims[1..] == d.dims[1..];
    let (name, c, cs) = match (s.layout, d.layout) {
        (a, b) if tiled && a == nchw && b == nhwc && d.dims[0] >= s.dims[0] => ("nchw_to_nhwc", s.dims[0], d.dims[0]),
        (a, b) if tiled && a == nhwc && b == nchw && s.dims[0] >= d.dims[0] => ("nhwc_to_nchw", d.dims[0], s.dims[0]),
        _ if s.dims == d.dims => {
            let strides = s.layout.strides(&s.dims);
            if s.elem == d.elem {
                // The shape kernels' planned gather: merged dims, 16-byte units where it can.
                let dims: Vec<CopyDim> = d.layout.order().iter().map(|&k| CopyDim::plain(d.dims[k], strides[k])).collect();
                let copy = StridedCopy::new(ctx, path, "reformat", CopyKind::Gather { fill: 0.0 }, src, dst, &dims, 0)?;
                return Ok(Box::new(StridedLayer::new(ctx, path, "reformat", vec![copy])));
            }
            return permute_layer(ctx, path, src, &strides, s.per_image_elems(), dst);
        }
        _ => return Err(fail(format!("no reformat from {:?} {:?} to {:?} {:?}", s.layout, s.dims, d.layout, d.dims))),
    };
    let hw = s.dims[1] * s.dims[2];
    let int = |v: usize| i32::try_from(v).map_err(|_| fail(format!("{v} exceeds the kernels' 32-bit range")));
    let small = cs <= SMALL_CHANNELS;
    let entry = format!("{name}{}_{pair}", if small { "_small" } else { "" });
    let f = ctx.kernels.get(&entry)?;
    Ok(Box::new(ReformatLayer {
        path: path.to_string(),
        kind: format!("kernel:{entry}"),
        f,
        src,
        dst,
        transpose: Some((int(c)?, int(hw)?, int(cs)?)),
        small,
        per_image: d.per_image_elems(),
        sm_count: ctx.kernels.sm_count(),
    }))
}

/// Every kernel entry point the layers above may launch, for the NVRTC test to check.
pub fn entry_points() -> Vec<String> {
    let mut names = Vec::new();
    for t in ["f32", "f16"] {
        for k in [
            "activation",
            "binary",
            "binary_bcast",
            "bias_act",
            "max_pool2d",
            "avg_pool2d",
            "adaptive_avg_pool2d",
            "concat_channels",
            "softmax",
            "layer_norm",
            "mean",
            "matmul",
            "shape_gather",
            "shape_scatter",
            "resize_nearest",
            "resize_bilinear",
            "depthwise_k3",
            "depthwise_k5",
            "depthwise_k7",
            "global_avg_pool",
            "shape_roll",
            "attn_softmax",
            "flash_attn_d32",
            "flash_attn_d64",
            "quant",
            "to_e4m3",
        ] {
            names.push(format!("{k}_{t}"));
        }
        names.push(format!("shape_gather_v16_{t}"));
        if t == "f16" {
            names.extend(["flash_attn_tc_d32_f16".to_string(), "flash_attn_tc_d64_f16".to_string()]);
        }
        for u in ["f32", "f16"] {
            for k in ["nchw_to_nhwc", "nhwc_to_nchw", "nchw_to_nhwc_small", "nhwc_to_nchw_small", "cast", "permute"] {
                names.push(format!("{k}_{t}_{u}"));
            }
        }
        // From a u8 input binding into the engine (`t` is the engine's type here).
        for k in ["nchw_to_nhwc", "nchw_to_nhwc_small", "cast", "permute"] {
            names.push(format!("{k}_u8_{t}"));
        }
    }
    names.extend(["shape_scatter_v16".to_string(), "shape_roll_v16".to_string()]);
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kernels::{FAMILIES, PRELUDE};

    /// The value of `#define NAME value` in the kernels' prelude.
    fn define(name: &str) -> Option<i32> {
        PRELUDE.lines().find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("#define") && w.next() == Some(name)).then(|| w.next()?.parse().ok()).flatten()
        })
    }

    #[test]
    fn op_codes_match_the_kernels() {
        for (op, name) in [
            (Unary::Relu, "ACT_RELU"),
            (Unary::LeakyRelu { slope: 0.1 }, "ACT_LEAKY"),
            (Unary::Sigmoid, "ACT_SIGMOID"),
            (Unary::Silu, "ACT_SILU"),
            (Unary::Hardswish, "ACT_HARDSWISH"),
            (Unary::Hardsigmoid, "ACT_HARDSIGMOID"),
            (Unary::Gelu { tanh: false }, "ACT_GELU"),
            (Unary::Gelu { tanh: true }, "ACT_GELU_TANH"),
            (Unary::Tanh, "ACT_TANH"),
            (Unary::Asinh, "ACT_ASINH"),
            (Unary::Clamp { min: 0.0, max: 6.0 }, "ACT_CLAMP"),
            (Unary::Affine { scale: 1.0, shift: 0.0 }, "ACT_AFFINE"),
        ] {
            assert_eq!(Some(op.kernel_code().0), define(name), "{name}");
        }
        assert_eq!(act_code(None).0, define("ACT_NONE").unwrap());
        let elementwise = FAMILIES.iter().find(|(n, _)| *n == "elementwise.cu").map(|(_, s)| *s).expect("elementwise.cu");
        for (op, name) in [(Binary::Add, "BIN_ADD"), (Binary::Sub, "BIN_SUB"), (Binary::Mul, "BIN_MUL"), (Binary::Div, "BIN_DIV")] {
            assert!(elementwise.contains(&format!("#define {name} {}", op.kernel_code())), "{name}");
        }
    }

    /// `binary_bcast`'s indexing, run on the host over the plan `broadcast_binary` makes, against
    /// the CPU reference of `Binary` (activations in NCHW and NHWC, broadcasts of every kind).
    #[test]
    fn broadcast_plans_index_like_the_cpu_reference() {
        use crate::graph::HostTensor;
        use crate::ops::{CpuArgs, OpDef};
        use std::borrow::Cow;
        let (nchw, nhwc) = (Layout::contiguous(3), Layout::channels_last(3));
        // (a dims, a layout, b dims, b layout, y layout), per image.
        let cases = [
            ([8, 5, 6], nhwc, [8, 1, 1], nhwc, nhwc),
            ([8, 5, 6], nhwc, [8, 1, 1], nchw, nhwc),
            ([5, 4, 6], nchw, [5, 1, 1], nchw, nchw),
            ([3, 4, 8], nhwc, [1, 4, 8], nchw, nhwc),
            ([3, 1, 8], nchw, [1, 4, 1], nhwc, nchw),
            ([8, 4, 8], nhwc, [8, 4, 8], nchw, nhwc),
            ([1, 1, 1], nhwc, [6, 2, 3], nchw, nchw),
        ];
        for (da, la, db, lb, ly) in cases {
            let out = crate::ops::elementwise::broadcast_shape(&da, &db).unwrap();
            let batch = 2;
            let logical = |dims: &[usize], seed: u64| crate::seeded::uniform_tensor(&[&[batch][..], dims].concat(), seed);
            let (a, b) = (logical(&da, 1), logical(&db, 2));
            // Each operand's bytes in its layout.
            let physical = |t: &HostTensor, dims: &[usize], l: Layout| -> Vec<f32> {
                let per: usize = dims.iter().product();
                let strides = l.strides(dims);
                let mut v = vec![0f32; t.data.len()];
                for (i, &x) in t.data.iter().enumerate() {
                    let (n, mut rem, mut off) = (i / per, i % per, 0);
                    for k in (0..dims.len()).rev() {
                        off += (rem % dims[k]) * strides[k];
                        rem /= dims[k];
                    }
                    v[n * per + off] = x;
                }
                v
            };
            let (pa, pb) = (physical(&a, &da, la), physical(&b, &db, lb));
            let sa = activation_strides(&da, la, &out).unwrap();
            let sb = activation_strides(&db, lb, &out).unwrap();
            let bs = [da.iter().product::<usize>(), db.iter().product::<usize>()];
            for width in [1, 4, 8] {
                let (plan, _vec) = broadcast_plan(&out, ly, [&sa, &sb], bs, width);
                let per: usize = out.iter().product();
                let y: Vec<f32> = (0..batch * per)
                    .map(|i| {
                        let (mut rem, mut oa, mut ob) = (i, 0, 0);
                        for d in plan.iter().rev() {
                            oa += (rem % d[0]) * d[1];
                            ob += (rem % d[0]) * d[2];
                            rem /= d[0];
                        }
                        pa[oa + rem * bs[0]] * pb[ob + rem * bs[1]]
                    })
                    .collect();
                let mut args = CpuArgs::new(vec![Cow::Owned(a.clone()), Cow::Owned(b.clone())]);
                let want = Binary::Mul.cpu(&mut args).unwrap();
                let want = physical(&want, &out, ly);
                assert_eq!(y, want, "{da:?} {la:?} * {db:?} {lb:?} -> {ly:?}, plan {plan:?}");
            }
        }
        // The squeeze-excitation plan: [HW, C] by [0, 1] on the packed path.
        let sa = activation_strides(&[16, 5, 6], nhwc, &[16, 5, 6]).unwrap();
        let sb = activation_strides(&[16, 1, 1], nhwc, &[16, 5, 6]).unwrap();
        assert_eq!(broadcast_plan(&[16, 5, 6], nhwc, [&sa, &sb], [480, 16], 8), (vec![[30, 16, 0], [16, 1, 1]], true));
        assert!(!broadcast_plan(&[12, 5, 6], nhwc, [&sa, &sb], [360, 12], 8).1, "12 channels are not whole packs of 8");
    }

    #[test]
    fn every_entry_point_is_named_in_its_family_source() {
        let names = entry_points();
        let unique: std::collections::BTreeSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "duplicate entry points");
        for name in &names {
            // Stamped by a macro: `activation_##S` with S = f32 (`cast_##S` with S = u8_f16), or a
            // plain `decode_merge(`.
            let mut stem = name.as_str();
            while let Some(shorter) = ["_f32", "_f16", "_u8"].iter().find_map(|t| stem.strip_suffix(t)) {
                stem = shorter;
            }
            let found = FAMILIES.iter().any(|(_, src)| src.contains(&format!(" {stem}_##S")) || src.contains(&format!(" {name}(")));
            assert!(found, "no family defines `{name}`");
        }
    }
}
