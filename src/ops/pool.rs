//! Pooling: MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, adaptive max pooling, and the mean over any dims (`Tensor::mean`).

use crate::engine::launch::{
    grid_for, launch, nhwc, pack, same_elem, split_grid, to_i32, typed_entry_points, CudaFunction, KArg, BLOCK, SPLIT_BLOCK,
};
use crate::engine::{Layer, Layout, RunCtx, ValueId};
use crate::error::OpError;
use crate::graph::{NodeId, Op};
use crate::module::{Forward, Module};
use crate::ops::BuildCtx;
use crate::ops::{one_input, pair_label, AtenImport, CpuArgs, FixtureTwin, LayoutPlan, NnLayer, OpDef};
use crate::tensor::Tensor;
use crate::var_builder::VarBuilder;
use crate::LowerKind;
use crate::Result;
use serde::{Deserialize, Serialize};

/// This family's layers, as `kiln::nn` shows them.
pub mod nn {
    pub use super::{AdaptiveAvgPool2d, AdaptiveMaxPool2d, AvgPool2d, MaxPool2d, Pool2dConfig};
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct PoolAttrs {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub ceil_mode: bool,
    /// AvgPool2d only: whether padded zeros count in the average (PyTorch's default: true).
    pub count_include_pad: bool,
}

impl PoolAttrs {
    /// kh, kw, sh, sw, ph, pw: the window as the pooling kernels take it.
    pub fn window(&self) -> [usize; 6] {
        [self.kernel[0], self.kernel[1], self.stride[0], self.stride[1], self.padding[0], self.padding[1]]
    }
}

/// Pooling over the spatial dims of an NCHW tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, strum::EnumIter)]
pub enum Pool {
    Max(PoolAttrs),
    Avg(PoolAttrs),
    AdaptiveAvg {
        output: [usize; 2],
    },
    /// `nn.AdaptiveMaxPool2d(output)` (its values; the indices are not computed).
    AdaptiveMax {
        output: [usize; 2],
    },
    /// `x.mean(dims, keepdim)`: `dims` sorted, distinct, >= 1 (the batch is dim 0).
    Mean {
        dims: Vec<usize>,
        keepdim: bool,
    },
    /// `x.amax(dims, keepdim)`: the maximum over `dims` (as `Mean`'s); NaN wins, as in PyTorch.
    Amax {
        dims: Vec<usize>,
        keepdim: bool,
    },
    /// `x.argmax(dim, keepdim)` (`dim` >= 1): the index of the first maximum (of the first NaN),
    /// as an f32 value (exact below 2^24; an FP16 engine stores it exactly below 2049).
    Argmax {
        dim: usize,
        keepdim: bool,
    },
}

impl OpDef for Pool {
    fn name(&self) -> &str {
        match self {
            Pool::Max(_) => "max_pool2d",
            Pool::Avg(_) => "avg_pool2d",
            Pool::AdaptiveAvg { .. } => "adaptive_avg_pool2d",
            Pool::AdaptiveMax { .. } => "adaptive_max_pool2d",
            Pool::Mean { .. } => "mean",
            Pool::Amax { .. } => "amax",
            Pool::Argmax { .. } => "argmax",
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
        match self {
            Pool::Max(a) | Pool::Avg(a) => pool2d_shape(a, inputs),
            Pool::AdaptiveAvg { output } | Pool::AdaptiveMax { output } => adaptive_avg_pool2d_shape(*output, inputs),
            Pool::Mean { dims, keepdim } | Pool::Amax { dims, keepdim } => mean_shape(dims, *keepdim, inputs),
            Pool::Argmax { dim, keepdim } => mean_shape(&[*dim], *keepdim, inputs),
        }
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, OpError> {
        args.expect(1)?;
        let x = args.get(0)?;
        match self {
            Pool::Max(a) => max_pool2d_cpu(a, x),
            Pool::Avg(a) => avg_pool2d_cpu(a, x),
            Pool::AdaptiveAvg { output } => adaptive_avg_pool2d_cpu(*output, x),
            Pool::AdaptiveMax { output } => adaptive_max_pool2d_cpu(*output, x),
            Pool::Mean { dims, keepdim } => mean_cpu(dims, *keepdim, x),
            Pool::Amax { dims, keepdim } => reduce_cpu(dims, *keepdim, x, Reduce::Amax),
            Pool::Argmax { dim, keepdim } => reduce_cpu(&[*dim], *keepdim, x, Reduce::Argmax),
        }
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        match self {
            // The reduction reads any layout through its strides.
            Pool::Mean { .. } | Pool::Amax { .. } | Pool::Argmax { .. } => LayoutPlan::any_input(inputs, Layout::contiguous(out_rank)),
            _ => LayoutPlan::all(inputs, Layout::channels_last(out_rank)),
        }
    }
    fn entry_points(&self) -> Vec<String> {
        typed_entry_points(KERNELS)
    }
    fn colour(&self) -> &'static str {
        "#b7e4c7"
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        match self {
            Pool::Max(a) => pool_layer(ctx, node, PoolKind::Max, a.window()),
            Pool::Avg(a) => pool_layer(ctx, node, PoolKind::Avg { count_include_pad: a.count_include_pad }, a.window()),
            Pool::AdaptiveAvg { .. } => pool_layer(ctx, node, PoolKind::Adaptive, [0; 6]),
            Pool::AdaptiveMax { .. } => pool_layer(ctx, node, PoolKind::AdaptiveMax, [0; 6]),
            Pool::Mean { dims, .. } => gpu_reduce(ctx, node, dims, Reduce::Mean),
            Pool::Amax { dims, .. } => gpu_reduce(ctx, node, dims, Reduce::Amax),
            Pool::Argmax { dim, .. } => gpu_reduce(ctx, node, &[*dim], Reduce::Argmax),
        }
    }
    fn label(&self) -> String {
        match self {
            Pool::Max(a) | Pool::Avg(a) => {
                let mut s = format!("{} {}x{}", self.name(), a.kernel[0], a.kernel[1])
                    + &pair_label("s", a.stride, 0)
                    + &pair_label("p", a.padding, 0);
                if a.ceil_mode {
                    s += " ceil";
                }
                s
            }
            Pool::AdaptiveAvg { output } | Pool::AdaptiveMax { output } => format!("{} -> {}x{}", self.name(), output[0], output[1]),
            Pool::Mean { dims, keepdim } | Pool::Amax { dims, keepdim } => {
                format!("{} {dims:?}{}", self.name(), if *keepdim { " keepdim" } else { "" })
            }
            Pool::Argmax { dim, keepdim } => format!("argmax {dim}{}", if *keepdim { " keepdim" } else { "" }),
        }
    }
}

/// Options of `MaxPool2d` / `AvgPool2d` with PyTorch's defaults (stride = kernel, square windows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool2dConfig {
    pub kernel_size: usize,
    /// `None`: the kernel size, as in PyTorch.
    pub stride: Option<usize>,
    pub padding: usize,
    pub ceil_mode: bool,
    pub count_include_pad: bool,
}

impl Default for Pool2dConfig {
    fn default() -> Self {
        Self { kernel_size: 1, stride: None, padding: 0, ceil_mode: false, count_include_pad: true }
    }
}

impl Pool2dConfig {
    pub fn new(kernel_size: usize) -> Self {
        Self { kernel_size, ..Default::default() }
    }
    pub fn stride(self, stride: usize) -> Self {
        Self { stride: Some(stride), ..self }
    }
    pub fn padding(self, padding: usize) -> Self {
        Self { padding, ..self }
    }
    pub fn ceil_mode(self, ceil_mode: bool) -> Self {
        Self { ceil_mode, ..self }
    }
    fn attrs(&self) -> PoolAttrs {
        PoolAttrs {
            kernel: [self.kernel_size; 2],
            stride: [self.stride.unwrap_or(self.kernel_size); 2],
            padding: [self.padding; 2],
            ceil_mode: self.ceil_mode,
            count_include_pad: self.count_include_pad,
        }
    }
}

macro_rules! pool_module {
    ($(#[$doc:meta])* $name:ident, $variant:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug)]
        pub struct $name {
            pub path: String,
            pub attrs: PoolAttrs,
        }

        impl Module for $name {
            type Config = Pool2dConfig;
            fn load(vb: VarBuilder, c: &Pool2dConfig) -> Result<Self> {
                Ok(Self { path: vb.path().to_string(), attrs: c.attrs() })
            }
        }

        impl Forward for $name {
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                Tensor::record(&self.path, Op::Pool(Pool::$variant(self.attrs)), &[x], &[])
            }
        }
    };
}

pool_module!(
    /// `torch.nn.MaxPool2d` (padding is -inf).
    MaxPool2d, Max
);
pool_module!(
    /// `torch.nn.AvgPool2d`.
    AvgPool2d, Avg
);

/// `torch.nn.AdaptiveAvgPool2d(output_size)`.
#[derive(Clone, Debug)]
pub struct AdaptiveAvgPool2d {
    pub path: String,
    pub output: [usize; 2],
}

impl Module for AdaptiveAvgPool2d {
    type Config = [usize; 2];
    fn load(vb: VarBuilder, output: &[usize; 2]) -> Result<Self> {
        Ok(Self { path: vb.path().to_string(), output: *output })
    }
}

impl Forward for AdaptiveAvgPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::record(&self.path, Op::Pool(Pool::AdaptiveAvg { output: self.output }), &[x], &[])
    }
}

/// `torch.nn.AdaptiveMaxPool2d(output_size)` (`return_indices=False`: the values only).
#[derive(Clone, Debug)]
pub struct AdaptiveMaxPool2d {
    pub path: String,
    pub output: [usize; 2],
}

impl Module for AdaptiveMaxPool2d {
    type Config = [usize; 2];
    fn load(vb: VarBuilder, output: &[usize; 2]) -> Result<Self> {
        Ok(Self { path: vb.path().to_string(), output: *output })
    }
}

impl Forward for AdaptiveMaxPool2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::record(&self.path, Op::Pool(Pool::AdaptiveMax { output: self.output }), &[x], &[])
    }
}

impl Tensor {
    /// `F.adaptive_avg_pool2d(x, output)`, inline.
    pub fn adaptive_avg_pool2d(&self, output: [usize; 2]) -> Result<Tensor> {
        Tensor::record_inline(Op::Pool(Pool::AdaptiveAvg { output }), &[self])
    }
    /// `x.amax(dims, keepdim)` inline (dims >= 1, in any order).
    pub fn amax(&self, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        let mut dims = dims.to_vec();
        dims.sort_unstable();
        dims.dedup();
        Tensor::record_inline(Op::Pool(Pool::Amax { dims, keepdim }), &[self])
    }
    /// `x.argmax(dim, keepdim)` inline (`dim` >= 1): the index of the first maximum, as f32.
    pub fn argmax(&self, dim: usize, keepdim: bool) -> Result<Tensor> {
        Tensor::record_inline(Op::Pool(Pool::Argmax { dim, keepdim }), &[self])
    }
    /// `F.adaptive_max_pool2d(x, output)` (its values), inline.
    pub fn adaptive_max_pool2d(&self, output: [usize; 2]) -> Result<Tensor> {
        Tensor::record_inline(Op::Pool(Pool::AdaptiveMax { output }), &[self])
    }
    /// `x.mean(dims, keepdim)` inline: the mean over `dims` (each >= 1: the batch is dim 0; the
    /// order does not matter), e.g. `x.mean(&[2, 3], false)` is global average pooling of NCHW.
    pub fn mean(&self, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        let mut dims = dims.to_vec();
        dims.sort_unstable();
        Tensor::record_inline(Op::Pool(Pool::Mean { dims, keepdim }), &[self])
    }
}

/// `inputs` = x; `dims` sorted and distinct, each in `1..rank`.
pub fn mean_shape(dims: &[usize], keepdim: bool, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    let x = one_input(inputs)?;
    if dims.is_empty() {
        return Err(format!("mean over no dims of {x:?}: name the dims to reduce").into());
    }
    if dims.contains(&0) {
        return Err(format!("mean over dims {dims:?} of {x:?} includes dim 0: the engine keeps the batch as dim 0").into());
    }
    if let Some(d) = dims.iter().find(|&&d| d >= x.len()) {
        return Err(format!("mean dim {d} is out of range for shape {x:?}").into());
    }
    if dims.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!("mean dims {dims:?} must be sorted and distinct (shape {x:?})").into());
    }
    let out = x.iter().enumerate().filter_map(|(i, &n)| match dims.contains(&i) {
        true if keepdim => Some(1),
        true => None,
        false => Some(n),
    });
    Ok(out.collect())
}

/// PyTorch's pooled extent, including its ceil_mode rule: the last window must start inside the
/// input or the left padding.
pub fn pooled_extent(input: usize, k: usize, s: usize, p: usize, ceil: bool) -> Option<usize> {
    // Checked: sizes and attributes may come from a file.
    let span = input.checked_add(p.checked_mul(2)?)?.checked_sub(k)?;
    let mut out = if ceil { span.div_ceil(s) } else { span / s } + 1;
    if ceil && (out - 1).checked_mul(s)? >= input.checked_add(p)? {
        out -= 1;
    }
    Some(out)
}

pub fn pool2d_shape(a: &PoolAttrs, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    let x = one_input(inputs)?;
    if x.len() != 4 {
        return Err(format!("input must be NCHW (rank 4), got {x:?}").into());
    }
    if a.stride.contains(&0) || a.kernel.contains(&0) {
        return Err("kernel and stride must be positive".into());
    }
    if a.padding[0] > a.kernel[0] / 2 || a.padding[1] > a.kernel[1] / 2 {
        return Err(format!("padding {:?} must be at most half the kernel {:?}", a.padding, a.kernel).into());
    }
    let ext = |i: usize| pooled_extent(x[2 + i], a.kernel[i], a.stride[i], a.padding[i], a.ceil_mode);
    match (ext(0), ext(1)) {
        (Some(h), Some(w)) => Ok(vec![x[0], x[1], h, w]),
        _ => Err(format!("kernel {:?} is larger than the padded input {:?}", a.kernel, &x[2..]).into()),
    }
}

pub fn adaptive_avg_pool2d_shape(output: [usize; 2], inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    let x = one_input(inputs)?;
    if x.len() != 4 || output.contains(&0) {
        return Err(format!("expects an NCHW input and a positive output size, got {x:?} and {output:?}").into());
    }
    Ok(vec![x[0], x[1], output[0], output[1]])
}

// ---- CPU reference

use crate::graph::HostTensor;

/// The input rows (or columns) of output index `o`, before and after clipping, as PyTorch computes
/// them: `(start, end)` unclipped except that `end` stops at `len + pad`, then clipped to `0..len`.
fn window(o: usize, k: usize, s: usize, p: usize, len: usize) -> ((isize, isize), (usize, usize)) {
    let start = (o * s) as isize - p as isize;
    let end = (start + k as isize).min((len + p) as isize);
    ((start, end), (start.max(0) as usize, end.min(len as isize).max(0) as usize))
}

/// Runs `f(plane, out_plane)` over every (image, channel) plane of `x` into a fresh `[n, c, oh, ow]`.
fn per_plane(x: &HostTensor, out_shape: Vec<usize>, mut f: impl FnMut(&[f32], &mut [f32])) -> HostTensor {
    let (in_plane, out_plane) = (x.shape[2] * x.shape[3], out_shape[2] * out_shape[3]);
    let mut out = vec![0.0f32; out_shape.iter().product()];
    if in_plane > 0 && out_plane > 0 {
        for (src, dst) in x.data.chunks_exact(in_plane).zip(out.chunks_exact_mut(out_plane)) {
            f(src, dst);
        }
    }
    HostTensor::new(out_shape, out)
}

/// `x.mean(dims, keepdim)`, summed in f64. Empty reductions give NaN, as in PyTorch.
pub fn mean_cpu(dims: &[usize], keepdim: bool, x: &HostTensor) -> Result<HostTensor, OpError> {
    reduce_cpu(dims, keepdim, x, Reduce::Mean)
}

/// A reduction over `dims` (`Mean`'s rules): the mean in f64, the maximum, or the index along the
/// one dim of the first maximum (NaN counts as the largest, as in PyTorch).
pub fn reduce_cpu(dims: &[usize], keepdim: bool, x: &HostTensor, how: Reduce) -> Result<HostTensor, OpError> {
    let out_shape = mean_shape(dims, keepdim, &[&x.shape])?;
    let strides: Vec<usize> = (0..x.shape.len()).map(|d| x.shape[d + 1..].iter().product()).collect();
    let kept: Vec<usize> = (0..x.shape.len()).filter(|d| !dims.contains(d)).collect();
    let n_out: usize = kept.iter().map(|&d| x.shape[d]).product();
    let count: usize = dims.iter().map(|&d| x.shape[d]).product();
    let offsets = |ds: &[usize], mut i: usize| {
        let mut off = 0;
        for &d in ds.iter().rev() {
            off += (i % x.shape[d]) * strides[d];
            i /= x.shape[d];
        }
        off
    };
    let reduced: Vec<usize> = (0..count).map(|r| offsets(dims, r)).collect();
    let out = (0..n_out)
        .map(|i| {
            let base = offsets(&kept, i);
            let values = reduced.iter().map(|&r| x.data[base + r]);
            match how {
                Reduce::Mean => (values.map(f64::from).sum::<f64>() / count as f64) as f32,
                Reduce::Amax | Reduce::Argmax => {
                    let (mut best, mut at) = (f32::NEG_INFINITY, 0);
                    for (k, v) in values.enumerate() {
                        if v > best || (v.is_nan() && !best.is_nan()) {
                            (best, at) = (v, k);
                        }
                    }
                    if how == Reduce::Amax {
                        best
                    } else {
                        at as f32
                    }
                }
            }
        })
        .collect();
    Ok(HostTensor::new(out_shape, out))
}

/// `torch.nn.MaxPool2d`: padding counts as -inf; NaN propagates as in PyTorch.
pub fn max_pool2d_cpu(a: &PoolAttrs, x: &HostTensor) -> Result<HostTensor, OpError> {
    let out_shape = pool2d_shape(a, &[&x.shape])?;
    let ([h, w], [oh, ow]) = ([x.shape[2], x.shape[3]], [out_shape[2], out_shape[3]]);
    Ok(per_plane(x, out_shape, |src, dst| {
        for oy in 0..oh {
            let (_, (y0, y1)) = window(oy, a.kernel[0], a.stride[0], a.padding[0], h);
            for ox in 0..ow {
                let (_, (x0, x1)) = window(ox, a.kernel[1], a.stride[1], a.padding[1], w);
                let mut m = f32::NEG_INFINITY;
                for row in src[y0 * w..y1 * w].chunks_exact(w) {
                    for &v in &row[x0..x1] {
                        if v > m || v.is_nan() {
                            m = v;
                        }
                    }
                }
                dst[oy * ow + ox] = m;
            }
        }
    }))
}

/// `torch.nn.AvgPool2d` (no divisor override): the divisor is the window clipped to the padded
/// input when `count_include_pad`, else the window clipped to the input itself.
pub fn avg_pool2d_cpu(a: &PoolAttrs, x: &HostTensor) -> Result<HostTensor, OpError> {
    let out_shape = pool2d_shape(a, &[&x.shape])?;
    let ([h, w], [oh, ow]) = ([x.shape[2], x.shape[3]], [out_shape[2], out_shape[3]]);
    Ok(per_plane(x, out_shape, |src, dst| {
        for oy in 0..oh {
            let ((py0, py1), (y0, y1)) = window(oy, a.kernel[0], a.stride[0], a.padding[0], h);
            for ox in 0..ow {
                let ((px0, px1), (x0, x1)) = window(ox, a.kernel[1], a.stride[1], a.padding[1], w);
                let sum: f32 = src[y0 * w..y1 * w].chunks_exact(w).map(|row| row[x0..x1].iter().sum::<f32>()).sum();
                let count = if a.count_include_pad { (py1 - py0) * (px1 - px0) } else { ((y1 - y0) * (x1 - x0)) as isize };
                dst[oy * ow + ox] = sum / count as f32;
            }
        }
    }))
}

/// `torch.nn.AdaptiveMaxPool2d`: output cell `i` is the maximum of the cells
/// `adaptive_avg_pool2d_cpu` averages; NaN wins, as in PyTorch.
pub fn adaptive_max_pool2d_cpu(output: [usize; 2], x: &HostTensor) -> Result<HostTensor, OpError> {
    adaptive_pool2d_cpu(output, x, |rows, _| rows.flatten().fold(f32::NEG_INFINITY, |m, &v| if v > m || v.is_nan() { v } else { m }))
}

/// `torch.nn.AdaptiveAvgPool2d`: output cell `i` averages input `floor(i·H/o) .. ceil((i+1)·H/o)`.
pub fn adaptive_avg_pool2d_cpu(output: [usize; 2], x: &HostTensor) -> Result<HostTensor, OpError> {
    adaptive_pool2d_cpu(output, x, |rows, n| rows.map(|row| row.iter().sum::<f32>()).sum::<f32>() / n as f32)
}

/// Adaptive pooling: `reduce(rows, count)` of each output cell, whose input rows are
/// `floor(i·H/o) .. ceil((i+1)·H/o)` and columns alike.
fn adaptive_pool2d_cpu(
    output: [usize; 2],
    x: &HostTensor,
    reduce: impl Fn(&mut dyn Iterator<Item = &[f32]>, usize) -> f32,
) -> Result<HostTensor, OpError> {
    let out_shape = adaptive_avg_pool2d_shape(output, &[&x.shape])?;
    let (h, w) = (x.shape[2], x.shape[3]);
    if h == 0 || w == 0 {
        return Err(format!("cannot pool an empty {h}x{w} input").into());
    }
    let bounds = |i: usize, len: usize, o: usize| (i * len / o, ((i + 1) * len).div_ceil(o));
    Ok(per_plane(x, out_shape, |src, dst| {
        for oy in 0..output[0] {
            let (y0, y1) = bounds(oy, h, output[0]);
            for ox in 0..output[1] {
                let (x0, x1) = bounds(ox, w, output[1]);
                let mut rows = src[y0 * w..y1 * w].chunks_exact(w).map(|row| &row[x0..x1]);
                dst[oy * output[1] + ox] = reduce(&mut rows, (y1 - y0) * (x1 - x0));
            }
        }
    }))
}

// ---- GPU converter for the mean (kernels/norm.cu)

// ---- engine layers (kernels/pool.cu) ----------------------------------------------------------

/// The kernels this family's layers launch, stamped per element type.
const KERNELS: &[&str] =
    &["max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d", "global_avg_pool", "mean", "reduce_max"];

/// Which pooling a `PoolLayer` runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PoolKind {
    Max,
    Avg { count_include_pad: bool },
    Adaptive,
    AdaptiveMax,
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
            PoolKind::AdaptiveMax => "kernel:adaptive_max_pool2d".into(),
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
        if !matches!(self.kind, PoolKind::Adaptive | PoolKind::AdaptiveMax) {
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
    let elem = same_elem(ctx, &[x, y])?;
    let (c, h, w) = nhwc(ctx, x)?;
    let (c2, oh, ow) = nhwc(ctx, y)?;
    if c2 != c {
        return Err(ctx.err(node, LowerKind::Operands, format!("pooling maps {c} channels to {c2}")));
    }
    // Launch arguments are 32-bit; the batch is checked when the layer runs.
    let mut dims = [0i32; 5];
    for (d, (name, v)) in dims.iter_mut().zip([("H", h), ("W", w), ("C", c), ("OH", oh), ("OW", ow)]) {
        *d = to_i32(ctx, name, v)?;
    }
    let mut win = [0i32; 6];
    for (d, v) in win.iter_mut().zip(window) {
        *d = to_i32(ctx, "window", v)?;
    }
    let name = match kind {
        PoolKind::Max => "max_pool2d",
        PoolKind::Avg { .. } => "avg_pool2d",
        PoolKind::Adaptive if (oh, ow) == (1, 1) => "global_avg_pool",
        PoolKind::Adaptive => "adaptive_avg_pool2d",
        PoolKind::AdaptiveMax => "adaptive_max_pool2d",
    };
    let f = ctx.kernels.get(&format!("{name}_{}", elem.suffix()))?;
    let vec = if c % pack(elem) == 0 { pack(elem) } else { 1 };
    Ok(Box::new(PoolLayer { path: ctx.node(node).path.clone(), kind, f, x, y, dims, window: win, vec, sm_count: ctx.kernels.sm_count() }))
}

/// The mean, maximum or argmax over `dims` of a value in any layout, writing the contiguous output
/// (`mode`: how the threads share the outputs).
struct MeanLayer {
    path: String,
    how: Reduce,
    f: CudaFunction,
    x: ValueId,
    y: ValueId,
    meta: crate::engine::DeviceBuf,
    kept: i32,
    red: i32,
    scale: f32,
    per_image: usize,
    mode: ReduceMode,
    sm_count: u32,
}

/// How a reduction's threads share its outputs (`REDUCE_*` in kernels/norm.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReduceMode {
    /// One thread an output.
    Thread = 0,
    /// One warp an output: the innermost reduced dim is contiguous and at least a warp long.
    Warp = 1,
    /// A block of `SPLIT_BLOCK` threads takes `SPLIT_LANES` neighbouring outputs and splits each
    /// one's reduction over its groups: few outputs over long reductions (a squeeze-excitation
    /// mean of a channels-last image at batch 1).
    Split = 2,
}

/// Reductions at least this long get the split kernel as a timed candidate beside one thread an
/// output.
const SPLIT_MIN_LEN: usize = 64;

/// What a reduction layer computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Mean,
    Amax,
    Argmax,
}

impl Layer for MeanLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        let name = match self.how {
            Reduce::Mean => "mean",
            Reduce::Amax => "amax",
            Reduce::Argmax => "argmax",
        };
        let mode = match self.mode {
            ReduceMode::Thread => "",
            ReduceMode::Warp => "_warp",
            ReduceMode::Split => "_split",
        };
        format!("kernel:{name}{mode}")
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let n = batch * self.per_image;
        let args = [
            KArg::Ptr(rt.ptr(self.x)),
            KArg::Ptr(rt.ptr(self.y)),
            KArg::I64(n as i64),
            KArg::Ptr(self.meta.ptr()),
            KArg::I32(self.kept),
            KArg::I32(self.red),
            // `mean` scales the sum; `reduce_max` writes the maximum or its index.
            if self.how == Reduce::Mean { KArg::F32(self.scale) } else { KArg::I32((self.how == Reduce::Argmax) as i32) },
            KArg::I32(self.mode as i32),
        ];
        match self.mode {
            ReduceMode::Thread => launch(rt, &self.f, grid_for(n, self.sm_count), (BLOCK, 1, 1), 0, &args),
            ReduceMode::Warp => launch(rt, &self.f, grid_for(n * 32, self.sm_count), (BLOCK, 1, 1), 0, &args),
            ReduceMode::Split => launch(rt, &self.f, split_grid(n, self.sm_count), (SPLIT_BLOCK, 1, 1), 0, &args),
        }
    }
}

fn gpu_reduce(ctx: &mut BuildCtx, node: NodeId, dims: &[usize], how: Reduce) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let (dx, dy) = (ctx.value(x).clone(), ctx.value(y).clone());
    if dx.elem != dy.elem || !dy.layout.same_bytes(Layout::contiguous(dy.dims.len()), &dy.dims) {
        return Err(ctx.err(
            node,
            LowerKind::Operands,
            format!("expects a contiguous output of the input's type, got {:?} {:?}", dy.layout, dy.elem),
        ));
    }
    let strides = dx.layout.strides(&dx.dims);
    // Per-image dims: logical dim d of the tensor is per-image dim d - 1.
    let reduced: Vec<usize> = dims.iter().map(|&d| d - 1).collect();
    let kept: Vec<usize> = (0..dx.dims.len()).filter(|d| !reduced.contains(d)).collect();
    // The reduced dims, largest stride first: the innermost loop walks the smallest stride.
    let mut red = reduced.clone();
    red.sort_by_key(|&d| std::cmp::Reverse(strides[d]));
    let mut meta: Vec<i64> = kept.iter().map(|&d| dx.dims[d] as i64).collect();
    meta.extend(kept.iter().map(|&d| strides[d] as i64));
    meta.extend(red.iter().map(|&d| dx.dims[d] as i64));
    meta.extend(red.iter().map(|&d| strides[d] as i64));
    meta.push(dx.per_image_elems() as i64);
    let count: usize = red.iter().map(|&d| dx.dims[d]).product();
    let warp = red.last().is_some_and(|&d| strides[d] == 1 && dx.dims[d] >= 32);
    let bytes: Vec<u8> = meta.iter().flat_map(|v| v.to_le_bytes()).collect();
    let name = if how == Reduce::Mean { "mean" } else { "reduce_max" };
    let f = ctx.kernels.get(&format!("{name}_{}", dx.elem.suffix()))?;
    let path = ctx.node(node).path.clone();
    let layer = |ctx: &mut BuildCtx, mode| -> Result<Box<dyn Layer>> {
        Ok(Box::new(MeanLayer {
            how,
            path: path.clone(),
            f: f.clone(),
            x,
            y,
            meta: ctx.upload_bytes(&bytes)?,
            kept: kept.len() as i32,
            red: red.len() as i32,
            scale: if count == 0 { f32::NAN } else { 1.0 / count as f32 },
            per_image: dy.per_image_elems(),
            mode,
            sm_count: ctx.kernels.sm_count(),
        }))
    };
    if warp {
        return layer(ctx, ReduceMode::Warp);
    }
    if count < SPLIT_MIN_LEN {
        return layer(ctx, ReduceMode::Thread);
    }
    // Few outputs over a long strided reduction want the split kernel, many outputs one thread
    // each: timing picks, at the batch the engine is built for.
    let candidates = vec![layer(ctx, ReduceMode::Thread)?, layer(ctx, ReduceMode::Split)?];
    let key = ctx.problem_key(node);
    ctx.choose(&key, candidates)
}

/// This family's `kiln::nn` layers, each traced on an input (for `ops::completeness`).
#[doc(hidden)]
pub const NN_LAYERS: &[NnLayer] = &[
    ("MaxPool2d", |vb, t| nn::MaxPool2d::load(vb, &nn::Pool2dConfig::new(2))?.forward(&t.input("x", &[1, 3, 4, 4]))),
    ("AvgPool2d", |vb, t| nn::AvgPool2d::load(vb, &nn::Pool2dConfig::new(2))?.forward(&t.input("x", &[1, 3, 4, 4]))),
    ("AdaptiveAvgPool2d", |vb, t| nn::AdaptiveAvgPool2d::load(vb, &[1, 1])?.forward(&t.input("x", &[1, 3, 4, 4]))),
    ("AdaptiveMaxPool2d", |vb, t| nn::AdaptiveMaxPool2d::load(vb, &[2, 2])?.forward(&t.input("x", &[1, 3, 4, 4]))),
];

/// The ATen ops kiln-torch imports as this family's ops (a sum is a mean and an affine).
#[doc(hidden)]
pub const ATEN: &[AtenImport] = &[
    ("max_pool2d", &["aten.max_pool2d.default", "aten.max_pool2d_with_indices.default"]),
    ("avg_pool2d", &["aten.avg_pool2d.default"]),
    ("adaptive_avg_pool2d", &["aten.adaptive_avg_pool2d.default", "aten._adaptive_avg_pool2d.default"]),
    ("adaptive_max_pool2d", &["aten.adaptive_max_pool2d.default"]),
    ("mean", &["aten.mean.dim", "aten.mean.default", "aten.sum.dim_IntList"]),
    ("amax", &["aten.amax.default", "aten.max.dim"]),
    ("argmax", &["aten.argmax.default", "aten.max.dim"]),
];

/// The Kiln twins of this family's PyTorch op fixtures (`op_cases()` in tools/export_reference.py).
#[doc(hidden)]
pub const FIXTURE_TWINS: &[FixtureTwin] = &[
    ("max_pool2d_ceil", |f| MaxPool2d::load(f.vb, &Pool2dConfig::new(3).stride(2).padding(1).ceil_mode(true))?.forward(f.x)),
    ("max_pool2d_default", |f| MaxPool2d::load(f.vb, &Pool2dConfig::new(2))?.forward(f.x)),
    ("avg_pool2d_pad", |f| AvgPool2d::load(f.vb, &Pool2dConfig::new(3).stride(2).padding(1))?.forward(f.x)),
    ("avg_pool2d_pad_exclude", |f| {
        let cfg = Pool2dConfig { count_include_pad: false, ..Pool2dConfig::new(3).stride(2).padding(1) };
        AvgPool2d::load(f.vb, &cfg)?.forward(f.x)
    }),
    ("avg_pool2d_ceil", |f| AvgPool2d::load(f.vb, &Pool2dConfig::new(2).stride(2).ceil_mode(true))?.forward(f.x)),
    ("adaptive_avg_pool2d_3x3", |f| AdaptiveAvgPool2d::load(f.vb, &[3, 3])?.forward(f.x)),
    ("adaptive_max_pool2d_3x3", |f| AdaptiveMaxPool2d::load(f.vb, &[3, 3])?.forward(f.x)),
    ("adaptive_max_pool2d_1x1", |f| f.x.adaptive_max_pool2d([1, 1])),
    ("mean_hw", |f| f.x.mean(&[2, 3], false)),
    ("mean_hw_keepdim", |f| f.x.mean(&[3, 2], true)),
    ("mean_last", |f| f.x.mean(&[f.x.shape().len() - 1], false)),
    ("mean_dim1_keepdim", |f| f.x.mean(&[1], true)),
    ("amax_hw", |f| f.x.amax(&[2, 3], false)),
    ("amax_dim1_keepdim", |f| f.x.amax(&[1], true)),
    ("argmax_dim1", |f| f.x.argmax(1, false)),
    ("argmax_last_keepdim", |f| f.x.argmax(2, true)),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_from_a_file_that_overflow_are_errors() {
        let x: &[usize] = &[1, 3, 8, 8];
        let big =
            PoolAttrs { kernel: [usize::MAX, 3], stride: [1, 1], padding: [usize::MAX / 2, 1], ceil_mode: true, count_include_pad: true };
        assert!(pool2d_shape(&big, &[x]).is_err());
        assert_eq!(pooled_extent(usize::MAX, 3, 1, 1, false), None);
        assert_eq!(pooled_extent(8, 3, usize::MAX, 1, true), Some(1));
        let ok = PoolAttrs { kernel: [3, 3], stride: [2, 2], padding: [1, 1], ceil_mode: false, count_include_pad: true };
        assert_eq!(pool2d_shape(&ok, &[x]), Ok(vec![1, 3, 4, 4]));
    }

    #[test]
    fn mean_shape_errors_name_the_shape() {
        let x: &[usize] = &[2, 3, 4, 5];
        assert!(mean_shape(&[], false, &[x]).unwrap_err().to_string().contains("[2, 3, 4, 5]"));
        assert!(mean_shape(&[0, 2], false, &[x]).unwrap_err().to_string().contains("batch"));
        assert!(mean_shape(&[4], false, &[x]).unwrap_err().to_string().contains("out of range"));
        assert!(mean_shape(&[2, 2], false, &[x]).unwrap_err().to_string().contains("distinct"));
        assert!(mean_shape(&[2], false, &[x, x]).is_err());
        assert_eq!(mean_shape(&[2, 3], false, &[x]), Ok(vec![2, 3]));
        assert_eq!(mean_shape(&[2, 3], true, &[x]), Ok(vec![2, 3, 1, 1]));
    }

    #[test]
    fn mean_reduces_non_adjacent_dims() {
        // [1, 2, 2, 2], mean over dims 1 and 3: out[h] = mean of x[:, :, h, :].
        let x = HostTensor::new(vec![1, 2, 2, 2], (0..8).map(|v| v as f32).collect());
        let y = mean_cpu(&[1, 3], false, &x).unwrap();
        assert_eq!(y.shape, vec![1, 2]);
        assert_eq!(y.data, vec![(0.0 + 1.0 + 4.0 + 5.0) / 4.0, (2.0 + 3.0 + 6.0 + 7.0) / 4.0]);
        let empty = HostTensor::new(vec![1, 0, 2], vec![]);
        assert!(mean_cpu(&[1], false, &empty).unwrap().data.iter().all(|v| v.is_nan()), "an empty mean is NaN, as PyTorch");
    }
}
