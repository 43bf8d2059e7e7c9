//! Engine layers that launch Kiln's own kernels (`kernels/*.cu`): activations, add/mul, the
//! bias + activation (+ residual) epilogue, pooling, concat, flatten and the layout/precision
//! reformats at the engine's edges. The converters in `ops/*.rs` are one-liners over these.
//!
//! Layers hold value handles, never addresses: the context's arena is planned after conversion
//! and every run reads the addresses from `RunCtx`. The batch is a kernel argument.

use super::gpu::cuda_err;
use super::layer::{BuildCtx, DeviceBuf, Elem, Layer, Layout, RunCtx, ValueDesc, ValueId};
use crate::graph::{NodeId, Op, PoolAttrs};
use crate::{Error, Result};
pub use cudarc::driver::CudaFunction;
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Activation codes of `kernels/common.cuh` (`ACT_*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelAct {
    None,
    Relu,
    Leaky(f32),
    Sigmoid,
}

impl KernelAct {
    /// `(code, slope)` as the kernels take them.
    pub fn code(self) -> (i32, f32) {
        match self {
            KernelAct::None => (0, 0.0),
            KernelAct::Relu => (1, 0.0),
            KernelAct::Leaky(s) => (2, s),
            KernelAct::Sigmoid => (3, 0.0),
        }
    }
    fn name(self) -> &'static str {
        match self {
            KernelAct::None => "",
            KernelAct::Relu => "+relu",
            KernelAct::Leaky(_) => "+leaky",
            KernelAct::Sigmoid => "+sigmoid",
        }
    }
}

/// One kernel argument. Pointers are device addresses (`RunCtx::ptr`), 0 for "none".
#[derive(Clone, Copy, Debug)]
pub enum KArg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// Enqueues `f` on the run's stream.
pub fn launch(rt: &RunCtx, f: &CudaFunction, grid: (u32, u32, u32), block: (u32, u32, u32), shared: u32, args: &[KArg]) -> Result<()> {
    let mut lb = rt.stream.launch_builder(f);
    for a in args {
        match a {
            KArg::Ptr(p) => lb.arg(p),
            KArg::I32(v) => lb.arg(v),
            KArg::I64(v) => lb.arg(v),
            KArg::F32(v) => lb.arg(v),
        };
    }
    let cfg = LaunchConfig { grid_dim: grid, block_dim: block, shared_mem_bytes: shared };
    // SAFETY: every kernel's signature is the argument list its layer builds (kernels/*.cu), and
    // the addresses come from the context's arena, bindings or the layer's own buffers.
    unsafe { lb.launch(cfg) }.map_err(cuda_err("launching a kernel"))?;
    Ok(())
}

/// Threads per block of the grid-stride kernels.
pub const BLOCK: u32 = 256;

/// A 1-D grid for `work` grid-stride items: enough blocks to fill the device, no more.
pub fn grid_for(work: usize, sm_count: u32) -> (u32, u32, u32) {
    let blocks = work.div_ceil(BLOCK as usize).clamp(1, sm_count as usize * 16);
    (blocks as u32, 1, 1)
}

/// Elements per 16-byte pack, the vector width the kernels use when channels allow.
fn pack(elem: Elem) -> usize {
    16 / elem.size()
}

fn to_i32(ctx: &BuildCtx, node: NodeId, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| ctx.err(node, format!("{what} = {v} exceeds the kernels' 32-bit range")))
}

/// The NHWC `(C, H, W)` of an activation, or an error naming the node.
fn nhwc(ctx: &BuildCtx, node: NodeId, v: ValueId) -> Result<(usize, usize, usize)> {
    let d = ctx.value(v);
    match (d.layout, d.dims.as_slice()) {
        (Layout::Nhwc, [c, h, w]) => Ok((*c, *h, *w)),
        _ => Err(ctx.err(node, format!("expects an NHWC image activation, got {:?} {:?}", d.layout, d.dims))),
    }
}

fn same_elem(ctx: &BuildCtx, node: NodeId, vs: &[ValueId]) -> Result<Elem> {
    let e = ctx.value(vs[0]).elem;
    if let Some(other) = vs.iter().map(|&v| ctx.value(v).elem).find(|&o| o != e) {
        return Err(ctx.err(node, format!("mixes element types {e:?} and {other:?}")));
    }
    Ok(e)
}

// ---- elementwise --------------------------------------------------------------------------

/// `y = act(x)`, or `y = act(a + b)` / `act(a * b)`, over the whole value.
pub struct ElementwiseLayer {
    path: String,
    kind: String,
    f: CudaFunction,
    inputs: Vec<ValueId>,
    y: ValueId,
    per_image: usize,
    act: KernelAct,
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
        let (code, slope) = self.act.code();
        let mut args: Vec<KArg> = self.inputs.iter().map(|&v| KArg::Ptr(rt.ptr(v))).collect();
        args.extend([KArg::Ptr(rt.ptr(self.y)), KArg::I64(n as i64), KArg::I32(code), KArg::F32(slope)]);
        launch(rt, &self.f, grid_for(n / 4, self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

/// `act(x)` for a unary node (relu, leaky_relu, sigmoid).
pub fn activation(ctx: &mut BuildCtx, node: NodeId, act: KernelAct) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let elem = same_elem(ctx, node, &[x, y])?;
    let f = ctx.kernels.get(&format!("activation_{}", elem.suffix()))?;
    Ok(Box::new(ElementwiseLayer {
        path: ctx.node(node).path.clone(),
        kind: format!("kernel:activation{}", act.name()),
        f,
        inputs: vec![x],
        y,
        per_image: ctx.value(y).per_image_elems(),
        act,
        sm_count: ctx.kernels.sm_count(),
    }))
}

/// `act(a + b)` or `act(a * b)` for a binary node of two same-shaped activations.
pub fn binary(ctx: &mut BuildCtx, node: NodeId, mul: bool, act: KernelAct) -> Result<Box<dyn Layer>> {
    let (a, b, y) = (ctx.input(node, 0)?, ctx.input(node, 1)?, ctx.output(node)?);
    let elem = same_elem(ctx, node, &[a, b, y])?;
    let (da, db) = (ctx.value(a), ctx.value(b));
    if da.dims != db.dims || da.layout != db.layout {
        return Err(ctx.err(node, format!("operands differ: {:?} {:?} and {:?} {:?}", da.layout, da.dims, db.layout, db.dims)));
    }
    let op = if mul { "mul" } else { "add" };
    let f = ctx.kernels.get(&format!("{op}_{}", elem.suffix()))?;
    Ok(Box::new(ElementwiseLayer {
        path: ctx.node(node).path.clone(),
        kind: format!("kernel:{op}{}", act.name()),
        f,
        inputs: vec![a, b],
        y,
        per_image: ctx.value(y).per_image_elems(),
        act,
        sm_count: ctx.kernels.sm_count(),
    }))
}

/// `y = act(x + bias[c] + residual)` over NHWC (or `[N, F]`) values: the epilogue of layers whose
/// library call cannot fuse it (e.g. a deconvolution's bias, a GEMM without the epilogue).
pub struct BiasActLayer {
    path: String,
    f: CudaFunction,
    x: ValueId,
    bias: Option<DeviceBuf>,
    residual: Option<ValueId>,
    y: ValueId,
    rows_per_image: usize,
    channels: usize,
    act: KernelAct,
    sm_count: u32,
}

impl Layer for BiasActLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        format!("kernel:bias{}{}", if self.residual.is_some() { "+residual" } else { "" }, self.act.name())
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let rows = batch * self.rows_per_image;
        let (code, slope) = self.act.code();
        let args = [
            KArg::Ptr(rt.ptr(self.x)),
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

/// Builds a [`BiasActLayer`] for `node` reading `x` and writing `y` (which may be `x`: in place).
/// `bias` has one value per channel (uploaded as f32 whatever the precision).
pub fn bias_act(
    ctx: &mut BuildCtx,
    node: NodeId,
    x: ValueId,
    bias: Option<&[f32]>,
    residual: Option<ValueId>,
    y: ValueId,
    act: KernelAct,
) -> Result<Box<dyn Layer>> {
    let mut vals = vec![x, y];
    vals.extend(residual);
    let elem = same_elem(ctx, node, &vals)?;
    let (c, h, w) =
        ctx.value(y).chw().ok_or_else(|| ctx.err(node, format!("bias epilogue needs [C, H, W] or [F], got {:?}", ctx.value(y).dims)))?;
    if ctx.value(y).layout != Layout::Nhwc && h * w != 1 {
        return Err(ctx.err(node, "bias epilogue runs on NHWC values".into()));
    }
    if let Some(b) = bias {
        if b.len() != c {
            return Err(ctx.err(node, format!("bias has {} values for {c} channels", b.len())));
        }
    }
    let bias = bias.map(|b| ctx.upload_f32(b)).transpose()?;
    let f = ctx.kernels.get(&format!("bias_act_{}", elem.suffix()))?;
    Ok(Box::new(BiasActLayer {
        path: ctx.node(node).path.clone(),
        f,
        x,
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

#[derive(Clone, Copy, Debug, PartialEq)]
enum PoolKind {
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

impl Layer for PoolLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        match self.kind {
            PoolKind::Max => "kernel:max_pool2d".into(),
            PoolKind::Avg { .. } => "kernel:avg_pool2d".into(),
            PoolKind::Adaptive if self.dims[3] == 1 && self.dims[4] == 1 => "kernel:global_avg_pool".into(),
            PoolKind::Adaptive => "kernel:adaptive_avg_pool2d".into(),
        }
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let [h, w, c, oh, ow] = self.dims;
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

fn pool_layer(ctx: &mut BuildCtx, node: NodeId, kind: PoolKind, window: [usize; 6]) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
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
        PoolKind::Adaptive => "adaptive_avg_pool2d",
    };
    let f = ctx.kernels.get(&format!("{name}_{}", elem.suffix()))?;
    let vec = if c % pack(elem) == 0 { pack(elem) } else { 1 };
    Ok(Box::new(PoolLayer { path: ctx.node(node).path.clone(), kind, f, x, y, dims, window: win, vec, sm_count: ctx.kernels.sm_count() }))
}

fn window(a: &PoolAttrs) -> [usize; 6] {
    [a.kernel[0], a.kernel[1], a.stride[0], a.stride[1], a.padding[0], a.padding[1]]
}

/// `max_pool2d` / `avg_pool2d` / `adaptive_avg_pool2d` nodes (NHWC, PyTorch's semantics).
pub fn pool(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
    match &ctx.node(node).op {
        Op::MaxPool2d(a) => pool_layer(ctx, node, PoolKind::Max, window(a)),
        Op::AvgPool2d(a) => pool_layer(ctx, node, PoolKind::Avg { count_include_pad: a.count_include_pad }, window(a)),
        Op::AdaptiveAvgPool2d { .. } => pool_layer(ctx, node, PoolKind::Adaptive, [0; 6]),
        other => Err(ctx.err(node, format!("is not a pooling op ({})", other.name()))),
    }
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
pub fn concat(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
    let Op::Cat { dim } = ctx.node(node).op else { return Err(ctx.err(node, "is not a cat".into())) };
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
        if (hi, wi) != (h, w) || (h * w != 1 && d.layout != Layout::Nhwc) {
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

/// A layer converting `src` to `dst`, deciding from their descriptions: NCHW -> NHWC (the
/// engine's input; `dst` may have more channels than `src`, padded with zeros), NHWC -> NCHW
/// (the engine's output), or a precision cast where the layouts agree or the value has no
/// spatial extent (`[F]`, `[F, 1, 1]`, `[K, 6]`: both layouts are the same bytes).
pub fn reformat_layer(ctx: &mut BuildCtx, src: ValueId, dst: ValueId, path: &str) -> Result<Box<dyn Layer>> {
    let (s, d) = (ctx.value(src).clone(), ctx.value(dst).clone());
    let fail = |why: String| Error::Graph(format!("cannot reformat `{}` to `{}` (at `{path}`): {why}", s.name, d.name));
    let pair = format!("{}_{}", s.elem.suffix(), d.elem.suffix());
    let spatial = |v: &ValueDesc| v.chw().map(|(_, h, w)| h * w);
    // Layout means nothing for a value without spatial extent ([F], [K, 6]): the same bytes.
    let flat = |v: &ValueDesc| !matches!(spatial(v), Some(hw) if hw != 1);
    let plain = s.layout == d.layout || (flat(&s) && flat(&d));
    let (entry, transpose) = if plain && s.dims == d.dims {
        (format!("cast_{pair}"), None)
    } else {
        let (sc, sh, sw) = s.chw().ok_or_else(|| fail(format!("source dims {:?} are not an image", s.dims)))?;
        let (dc, dh, dw) = d.chw().ok_or_else(|| fail(format!("target dims {:?} are not an image", d.dims)))?;
        if (sh, sw) != (dh, dw) {
            return Err(fail(format!("spatial sizes differ: {:?} and {:?}", s.dims, d.dims)));
        }
        let hw = sh * sw;
        let (name, c, cs) = match (s.layout, d.layout) {
            (Layout::Nchw, Layout::Nhwc) if dc >= sc => ("nchw_to_nhwc", sc, dc),
            (Layout::Nhwc, Layout::Nchw) if sc >= dc => ("nhwc_to_nchw", dc, sc),
            _ => return Err(fail(format!("no reformat from {:?} {:?} to {:?} {:?}", s.layout, s.dims, d.layout, d.dims))),
        };
        let int = |v: usize| i32::try_from(v).map_err(|_| fail(format!("{v} exceeds the kernels' 32-bit range")));
        let small = if cs <= SMALL_CHANNELS { "_small" } else { "" };
        (format!("{name}{small}_{pair}"), Some((int(c)?, int(hw)?, int(cs)?)))
    };
    let small = transpose.is_some_and(|(_, _, cs)| cs as usize <= SMALL_CHANNELS);
    let f = ctx.kernels.get(&entry)?;
    Ok(Box::new(ReformatLayer {
        path: path.to_string(),
        kind: format!("kernel:{entry}"),
        f,
        src,
        dst,
        transpose,
        small,
        per_image: d.per_image_elems(),
        sm_count: ctx.kernels.sm_count(),
    }))
}

/// `flatten(1)`: NCHW order of an NHWC map. Moves nothing when the map is 1x1 (ResNet's pooled
/// features) or already flat; otherwise an NHWC -> NCHW transpose in the engine's precision.
pub fn flatten(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
    let Op::Flatten { start } = ctx.node(node).op else { return Err(ctx.err(node, "is not a flatten".into())) };
    if start != 1 {
        return Err(ctx.err(node, format!("the GPU engine flattens from dim 1 only (the batch stays), got start {start}")));
    }
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let dx = ctx.value(x).clone();
    match dx.chw() {
        Some((_, h, w)) if h * w > 1 && dx.layout == Layout::Nhwc => {
            let path = ctx.node(node).path.clone();
            flatten_transpose(ctx, node, x, y, &path)
        }
        _ => {
            ctx.alias(y, x)?;
            Ok(Box::new(super::layer::Nop { path: ctx.node(node).path.clone() }))
        }
    }
}

fn flatten_transpose(ctx: &mut BuildCtx, node: NodeId, x: ValueId, y: ValueId, path: &str) -> Result<Box<dyn Layer>> {
    let elem = same_elem(ctx, node, &[x, y])?;
    let (c, h, w) = nhwc(ctx, node, x)?;
    let entry = format!("nhwc_to_nchw_{0}_{0}", elem.suffix());
    let f = ctx.kernels.get(&entry)?;
    let (c, hw) = (to_i32(ctx, node, "channels", c)?, to_i32(ctx, node, "H*W", h * w)?);
    Ok(Box::new(ReformatLayer {
        path: path.to_string(),
        kind: format!("kernel:flatten:{entry}"),
        f,
        src: x,
        dst: y,
        transpose: Some((c, hw, c)),
        small: false,
        per_image: ctx.value(y).per_image_elems(),
        sm_count: ctx.kernels.sm_count(),
    }))
}

/// Every kernel entry point the layers above may launch, for the NVRTC test to check.
pub fn entry_points() -> Vec<String> {
    let mut names = Vec::new();
    for t in ["f32", "f16"] {
        for k in [
            "activation",
            "add",
            "mul",
            "bias_act",
            "max_pool2d",
            "avg_pool2d",
            "adaptive_avg_pool2d",
            "concat_channels",
            "decode_select",
            "decode_tile_max",
        ] {
            names.push(format!("{k}_{t}"));
        }
        for u in ["f32", "f16"] {
            for k in ["nchw_to_nhwc", "nhwc_to_nchw", "nchw_to_nhwc_small", "nhwc_to_nchw_small", "cast", "decode_boxes"] {
                names.push(format!("{k}_{t}_{u}"));
            }
        }
    }
    names.push("decode_merge".into());
    names.push("decode_threshold".into());
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
    fn activation_codes_match_the_kernels() {
        for (act, name) in [
            (KernelAct::None, "ACT_NONE"),
            (KernelAct::Relu, "ACT_RELU"),
            (KernelAct::Leaky(0.1), "ACT_LEAKY"),
            (KernelAct::Sigmoid, "ACT_SIGMOID"),
        ] {
            assert_eq!(Some(act.code().0), define(name), "{name}");
        }
        assert_eq!(KernelAct::Leaky(0.25).code().1, 0.25);
    }

    #[test]
    fn grids_cover_small_work_and_cap_large_work() {
        assert_eq!(grid_for(0, 132), (1, 1, 1));
        assert_eq!(grid_for(1, 132), (1, 1, 1));
        assert_eq!(grid_for(257, 132), (2, 1, 1));
        assert_eq!(grid_for(1 << 30, 132), (132 * 16, 1, 1), "grid-stride loops cover the rest");
    }

    #[test]
    fn every_entry_point_is_named_in_its_family_source() {
        let names = entry_points();
        let unique: std::collections::BTreeSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "duplicate entry points");
        for name in &names {
            // Stamped by a macro: `activation_##S` with S = f32, or a plain `decode_merge(`.
            let (stem, _) = name.split_once("_f").unwrap_or((name.as_str(), ""));
            let found = FAMILIES.iter().any(|(_, src)| src.contains(&format!(" {stem}_##S(")) || src.contains(&format!(" {name}(")));
            assert!(found, "no family defines `{name}`");
        }
    }
}
