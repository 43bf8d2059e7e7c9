//! Ops that move data without arithmetic: flatten, reshape, permute, cat, slice, roll and pad
//! (constant, reflect, replicate).
//!
//! The engine keeps the batch as dim 0 of every value, so these ops never move, merge or split
//! dim 0: their shape rules reject it, naming the op and the shapes. On the GPU, reshape, flatten
//! and permute move nothing (the output aliases the input's bytes: a reshape of the contiguous
//! layout, a permute re-expressed as the permuted layout), and slice, pad and cat are strided
//! copies (`kernels/shape.cu`) in whatever layout their input is in.

use crate::engine::launch::{grid_for, launch, same_elem, to_i32, typed_entry_points, Arg, CudaFunction, KArg, KernelLayer, BLOCK};
use crate::engine::strided::{CopyDim, CopyKind, StridedCopy, StridedLayer};
use crate::engine::{Layer, Layout, RunCtx, ValueId};
use crate::error::OpError;
use crate::graph::{HostTensor, NodeId, Op};
use crate::module::{Forward, Module};
use crate::ops::BuildCtx;
use crate::ops::{one_input, CpuArgs, FixtureTwin, LayoutPlan, OpDef};
use crate::tensor::Tensor;
use crate::var_builder::VarBuilder;
use crate::LowerKind;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

mod modules;
pub use modules::{Flatten, FlattenConfig, ReflectionPad2d, ReplicationPad2d, ATEN, NN_LAYERS};

/// This family's layers, as `kiln::nn` shows them.
pub mod nn {
    pub use super::{ConstantPad2d, ConstantPad2dConfig, Flatten, FlattenConfig, ReflectionPad2d, ReplicationPad2d, ZeroPad2d};
}

/// Data movement. Inputs: one tensor, except Cat (any number, equal except along `dim`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, strum::EnumIter)]
pub enum ShapeOp {
    /// `torch.flatten(x, start)` (to the last dim).
    Flatten { start: usize },
    /// `torch.cat(xs, dim)`.
    Cat { dim: usize },
    /// `x.reshape(N, *dims)`: the per-image dims after the batch (PyTorch's `-1` is resolved
    /// when tracing, see `Tensor::reshape`).
    Reshape { dims: Vec<usize> },
    /// `x.permute(*dims)`: output dim `j` is input dim `dims[j]`; `dims[0]` is 0 (the batch stays).
    Permute { dims: Vec<usize> },
    /// `x.narrow(dim, start, len)` (`dim >= 1`).
    Slice { dim: usize, start: usize, len: usize },
    /// `F.pad(x, pads, value=value)`, constant mode: `pads` in PyTorch's order, last dim first,
    /// `(before, after)` pairs.
    Pad { pads: Vec<usize>, value: f32 },
    /// `torch.roll(x, shifts, dims)` (`dims >= 1`; a shift may be negative or exceed the size).
    Roll { shifts: Vec<i64>, dims: Vec<usize> },
    /// `F.pad(x, pads, mode="reflect")` (`nn.ReflectionPad2d`): the border mirrored, without
    /// repeating the edge; each pad is below its dim's size.
    ReflectPad { pads: Vec<usize> },
    /// `F.pad(x, pads, mode="replicate")` (`nn.ReplicationPad2d`): the edge repeated.
    ReplicatePad { pads: Vec<usize> },
}

impl OpDef for ShapeOp {
    fn name(&self) -> &str {
        match self {
            ShapeOp::Flatten { .. } => "flatten",
            ShapeOp::Cat { .. } => "cat",
            ShapeOp::Reshape { .. } => "reshape",
            ShapeOp::Permute { .. } => "permute",
            ShapeOp::Slice { .. } => "slice",
            ShapeOp::Pad { .. } => "pad",
            ShapeOp::Roll { .. } => "roll",
            ShapeOp::ReflectPad { .. } => "reflection_pad",
            ShapeOp::ReplicatePad { .. } => "replication_pad",
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
        match self {
            ShapeOp::Flatten { start } => flatten_shape(*start, inputs),
            ShapeOp::Cat { dim } => cat_shape(*dim, inputs),
            ShapeOp::Reshape { dims } => reshape_shape(dims, one_input(inputs)?),
            ShapeOp::Permute { dims } => permute_shape(dims, one_input(inputs)?),
            ShapeOp::Slice { dim, start, len } => slice_shape(*dim, *start, *len, one_input(inputs)?),
            ShapeOp::Pad { pads, .. } => pad_shape(pads, one_input(inputs)?),
            ShapeOp::Roll { shifts, dims } => roll_shape(shifts, dims, one_input(inputs)?),
            ShapeOp::ReflectPad { pads } => edge_pad_shape(pads, true, one_input(inputs)?),
            ShapeOp::ReplicatePad { pads } => edge_pad_shape(pads, false, one_input(inputs)?),
        }
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, OpError> {
        if !matches!(self, ShapeOp::Cat { .. }) {
            args.expect(1)?;
        }
        match self {
            ShapeOp::Flatten { start } => flatten_cpu(*start, args.take(0)?),
            ShapeOp::Cat { dim } => cat_cpu(*dim, &args.all()?),
            ShapeOp::Reshape { dims } => reshape_cpu(dims, args.take(0)?),
            ShapeOp::Permute { dims } => permute_cpu(dims, args.get(0)?),
            ShapeOp::Slice { dim, start, len } => slice_cpu(*dim, *start, *len, args.get(0)?),
            ShapeOp::Pad { pads, value } => pad_cpu(pads, *value, args.get(0)?),
            ShapeOp::Roll { shifts, dims } => roll_cpu(shifts, dims, args.get(0)?),
            ShapeOp::ReflectPad { pads } => edge_pad_cpu(pads, true, args.get(0)?),
            ShapeOp::ReplicatePad { pads } => edge_pad_cpu(pads, false, args.get(0)?),
        }
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        let first = inputs.first().copied().flatten().filter(|l| l.rank() == out_rank);
        match self {
            // A reshape of the contiguous layout moves nothing (the builder reformats first where
            // the input is in another layout and the bytes differ).
            ShapeOp::Flatten { .. } | ShapeOp::Reshape { .. } => LayoutPlan::all(inputs, Layout::contiguous(out_rank)),
            // Channels of images in NHWC are the fast path; other dims copy in the native layout.
            ShapeOp::Cat { .. } => LayoutPlan::all(inputs, Layout::native(out_rank)),
            // The permuted order of the input's layout: the output is the input's bytes.
            ShapeOp::Permute { dims } => {
                let out = inputs.first().copied().flatten().and_then(|l| permuted_layout(l, dims)).unwrap_or(Layout::contiguous(out_rank));
                LayoutPlan::any_input(inputs, out)
            }
            // Copies written in the input's own layout.
            ShapeOp::Slice { .. } | ShapeOp::Pad { .. } | ShapeOp::Roll { .. } => {
                LayoutPlan::any_input(inputs, first.unwrap_or(Layout::contiguous(out_rank)))
            }
            // One gather kernel over contiguous per-image dims.
            ShapeOp::ReflectPad { .. } | ShapeOp::ReplicatePad { .. } => LayoutPlan::all(inputs, Layout::contiguous(out_rank)),
        }
    }
    fn entry_points(&self) -> Vec<String> {
        // The strided copies of the other shape ops are the engine's (`engine::strided`).
        typed_entry_points(&["concat_channels", "shape_pad_edge"])
    }
    fn colour(&self) -> &'static str {
        "#dee2e6"
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        match self {
            ShapeOp::Flatten { .. } | ShapeOp::Reshape { .. } => gpu_reshape(ctx, node),
            ShapeOp::Cat { dim } => gpu_cat(ctx, node, *dim),
            ShapeOp::Permute { dims } => gpu_permute(ctx, node, dims),
            ShapeOp::Slice { dim, start, .. } => gpu_slice(ctx, node, *dim, *start),
            ShapeOp::Pad { pads, value } => gpu_pad(ctx, node, pads, *value),
            ShapeOp::Roll { shifts, dims } => gpu_roll(ctx, node, shifts, dims),
            ShapeOp::ReflectPad { pads } => gpu_edge_pad(ctx, node, pads, true),
            ShapeOp::ReplicatePad { pads } => gpu_edge_pad(ctx, node, pads, false),
        }
    }
    fn label(&self) -> String {
        match self {
            ShapeOp::Flatten { start } => format!("flatten start={start}"),
            ShapeOp::Cat { dim } => format!("cat dim={dim}"),
            ShapeOp::Reshape { dims } => format!("reshape N,{}", list(dims)),
            ShapeOp::Permute { dims } => format!("permute {}", list(dims)),
            ShapeOp::Slice { dim, start, len } => format!("slice dim={dim} [{start}, {})", start.saturating_add(*len)),
            ShapeOp::Pad { pads, value } => format!("pad {} value={value}", list(pads)),
            ShapeOp::Roll { shifts, dims } => {
                format!("roll {} dims={}", shifts.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(","), list(dims))
            }
            ShapeOp::ReflectPad { pads } | ShapeOp::ReplicatePad { pads } => format!("{} {}", self.name(), list(pads)),
        }
    }
}

fn list(v: &[usize]) -> String {
    v.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",")
}

// ---- shape rules

/// The product of `dims`, or an error naming them when it overflows.
fn numel(dims: &[usize]) -> Result<usize, OpError> {
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| OpError::TooLarge(format!("the element count of {dims:?} overflows")))
}

pub fn flatten_shape(start: usize, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    let x = one_input(inputs)?;
    if start >= x.len() {
        return Err(format!("start dim {start} is out of range for shape {x:?}").into());
    }
    if start == 0 && x.len() > 1 {
        return Err(format!("flatten from dim 0 merges the batch of {x:?} into other dims: the engine keeps the batch as dim 0").into());
    }
    let mut out = x[..start].to_vec();
    out.push(numel(&x[start..])?);
    Ok(out)
}

pub fn cat_shape(dim: usize, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    let first = inputs.first().ok_or("cat needs at least one input")?;
    if dim >= first.len() {
        return Err(format!("dim {dim} is out of range for shape {first:?}").into());
    }
    let mut out = first.to_vec();
    for s in &inputs[1..] {
        let same_rest = s.len() == first.len() && s.iter().zip(first.iter()).enumerate().all(|(i, (a, b))| i == dim || a == b);
        if !same_rest {
            return Err(format!("shapes {first:?} and {s:?} differ outside dim {dim}").into());
        }
        out[dim] = out[dim].checked_add(s[dim]).ok_or_else(|| format!("the size of dim {dim} overflows"))?;
    }
    Ok(out)
}

/// `[N, *dims]` when `dims` holds as many elements as one image of `x`.
pub fn reshape_shape(dims: &[usize], x: &[usize]) -> Result<Vec<usize>, OpError> {
    let (&n, per_image) = x.split_first().ok_or("reshape needs an input with a batch dim")?;
    let (have, want) = (numel(per_image)?, numel(dims)?);
    if have != want {
        return Err(format!(
            "cannot reshape {x:?} to [N, {}]: {have} elements per image against {want} (the engine keeps the batch as dim 0)",
            list(dims)
        )
        .into());
    }
    Ok([&[n][..], dims].concat())
}

/// Checks that `dims` permutes `0..x.len()` and keeps the batch first.
pub fn permute_shape(dims: &[usize], x: &[usize]) -> Result<Vec<usize>, OpError> {
    if dims.len() != x.len() {
        return Err(format!("permutation {dims:?} has {} dims, the input {x:?} has {}", dims.len(), x.len()).into());
    }
    let mut seen = vec![false; x.len()];
    for &d in dims {
        if d >= x.len() || std::mem::replace(&mut seen[d], true) {
            return Err(format!("{dims:?} is not a permutation of the dims of {x:?}").into());
        }
    }
    if dims.first() != Some(&0) {
        return Err(format!("permutation {dims:?} of {x:?} moves the batch: the engine keeps the batch as dim 0").into());
    }
    Ok(dims.iter().map(|&d| x[d]).collect())
}

pub fn slice_shape(dim: usize, start: usize, len: usize, x: &[usize]) -> Result<Vec<usize>, OpError> {
    if dim == 0 {
        return Err(format!("slicing dim 0 of {x:?} changes the batch: the engine keeps the batch as dim 0").into());
    }
    let size = *x.get(dim).ok_or_else(|| format!("dim {dim} is out of range for shape {x:?}"))?;
    if len == 0 {
        return Err(format!("an empty slice of dim {dim} of {x:?} (start {start}, length 0)").into());
    }
    if start.checked_add(len).is_none_or(|end| end > size) {
        return Err(format!("slice [{start}, {start} + {len}) of dim {dim} is out of range for shape {x:?}").into());
    }
    let mut out = x.to_vec();
    out[dim] = len;
    Ok(out)
}

/// `x` grown by `pads` (last dim first, `(before, after)` pairs).
pub fn pad_shape(pads: &[usize], x: &[usize]) -> Result<Vec<usize>, OpError> {
    if !pads.len().is_multiple_of(2) {
        return Err(format!("pads {pads:?} must come in (before, after) pairs").into());
    }
    if pads.len() / 2 >= x.len() {
        return Err(format!(
            "pads {pads:?} pad {} dims of {x:?}, which would pad the batch: the engine keeps the batch as dim 0",
            pads.len() / 2
        )
        .into());
    }
    let mut out = x.to_vec();
    for (i, pair) in pads.chunks(2).enumerate() {
        let d = x.len() - 1 - i;
        out[d] =
            x[d].checked_add(pair[0]).and_then(|v| v.checked_add(pair[1])).ok_or_else(|| format!("padding dim {d} of {x:?} overflows"))?;
    }
    Ok(out)
}

/// Checks that `shifts` and `dims` pair up and that no dim is the batch or out of range.
pub fn roll_shape(shifts: &[i64], dims: &[usize], x: &[usize]) -> Result<Vec<usize>, OpError> {
    if shifts.len() != dims.len() || dims.is_empty() {
        return Err(format!("roll needs one shift per dim, got shifts {shifts:?} and dims {dims:?}").into());
    }
    if let Some(d) = dims.iter().find(|&&d| d == 0 || d >= x.len()) {
        return Err(format!("roll dim {d} of {x:?} is the batch or out of range (the engine keeps the batch as dim 0)").into());
    }
    Ok(x.to_vec())
}

/// The net shift of each dim of `shape`, in `[0, size)` (repeated dims add up, as PyTorch's).
fn roll_per_dim(shifts: &[i64], dims: &[usize], shape: &[usize]) -> Vec<usize> {
    let mut per = vec![0usize; shape.len()];
    for (&s, &d) in shifts.iter().zip(dims) {
        if let Some(&size) = shape.get(d).filter(|&&n| n > 0) {
            let size = size as i128;
            per[d] = ((per[d] as i128 + s as i128).rem_euclid(size)) as usize;
        }
    }
    per
}

/// The `(before, after)` padding of each dim of a rank-`rank` tensor.
/// The shape of a reflect (`reflect`) or replicate pad: as a constant pad's, and each padded dim
/// must hold an element (replicate) or more than its pads (reflect), as PyTorch requires.
pub fn edge_pad_shape(pads: &[usize], reflect: bool, x: &[usize]) -> Result<Vec<usize>, OpError> {
    let out = pad_shape(pads, x)?;
    for (d, &(before, after)) in pads_per_dim(pads, x.len()).iter().enumerate() {
        if before == 0 && after == 0 {
            continue;
        }
        if x[d] == 0 || (reflect && (before >= x[d] || after >= x[d])) {
            let mode = if reflect { "reflect" } else { "replicate" };
            return Err(format!("{mode} padding ({before}, {after}) of dim {d} of {x:?}: each pad must be below the dim's size").into());
        }
    }
    Ok(out)
}

/// The input index an output index `i` of a dim padded by `before` reads, for an input of `n`
/// (`n > 0`; reflect: the pads are below `n`).
fn edge_source(i: usize, before: usize, n: usize, reflect: bool) -> usize {
    let j = i as isize - before as isize;
    let last = n as isize - 1;
    let k = match (j < 0, j > last, reflect) {
        (true, _, true) => -j,
        (true, _, false) => 0,
        (_, true, true) => 2 * last - j,
        (_, true, false) => last,
        _ => j,
    };
    k as usize
}

/// `F.pad(x, pads, mode="reflect" | "replicate")`.
pub fn edge_pad_cpu(pads: &[usize], reflect: bool, x: &HostTensor) -> Result<HostTensor, OpError> {
    let shape = edge_pad_shape(pads, reflect, &x.shape)?;
    let per = pads_per_dim(pads, x.shape.len());
    let xs = contiguous_strides(&x.shape);
    let n = numel(&shape)?;
    let mut out = Vec::with_capacity(n);
    let mut idx = vec![0usize; shape.len()];
    for _ in 0..n {
        let off: usize = (0..shape.len()).map(|k| edge_source(idx[k], per[k].0, x.shape[k], reflect) * xs[k]).sum();
        out.push(x.data[off]);
        for k in (0..shape.len()).rev() {
            idx[k] += 1;
            if idx[k] < shape[k] {
                break;
            }
            idx[k] = 0;
        }
    }
    Ok(HostTensor::new(shape, out))
}

fn pads_per_dim(pads: &[usize], rank: usize) -> Vec<(usize, usize)> {
    let mut per = vec![(0, 0); rank];
    for (i, pair) in pads.chunks(2).enumerate() {
        if let (Some(slot), [a, b]) = (rank.checked_sub(1 + i).and_then(|d| per.get_mut(d)), pair) {
            *slot = (*a, *b);
        }
    }
    per
}

// ---- CPU reference

fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for k in (0..shape.len().saturating_sub(1)).rev() {
        strides[k] = strides[k + 1] * shape[k + 1];
    }
    strides
}

/// Calls `f(i, offset)` for each index `i` of `shape` in row-major order, with
/// `offset = base + sum(index[k] * strides[k])`.
fn for_each_offset(shape: &[usize], strides: &[usize], base: usize, mut f: impl FnMut(usize, usize)) {
    let n: usize = shape.iter().product();
    let mut idx = vec![0; shape.len()];
    let mut off = base;
    for i in 0..n {
        f(i, off);
        for k in (0..shape.len()).rev() {
            idx[k] += 1;
            off += strides[k];
            if idx[k] < shape[k] {
                break;
            }
            off -= strides[k] * shape[k];
            idx[k] = 0;
        }
    }
}

/// A tensor of `shape` whose element `i` is `x[base + sum(index[k] * strides[k])]`.
fn gather(x: &[f32], shape: Vec<usize>, strides: &[usize], base: usize) -> HostTensor {
    let mut out = vec![0.0; shape.iter().product()];
    for_each_offset(&shape, strides, base, |i, off| out[i] = x[off]);
    HostTensor::new(shape, out)
}

/// `torch.flatten(x, start)`: the data is already in that order, only the shape changes.
pub fn flatten_cpu(start: usize, mut x: HostTensor) -> Result<HostTensor, OpError> {
    x.shape = flatten_shape(start, &[&x.shape])?;
    Ok(x)
}

/// `x.reshape(N, *dims)`: the data is already in that order.
pub fn reshape_cpu(dims: &[usize], mut x: HostTensor) -> Result<HostTensor, OpError> {
    x.shape = reshape_shape(dims, &x.shape)?;
    Ok(x)
}

/// `x.permute(*dims)`.
pub fn permute_cpu(dims: &[usize], x: &HostTensor) -> Result<HostTensor, OpError> {
    let shape = permute_shape(dims, &x.shape)?;
    let xs = contiguous_strides(&x.shape);
    let strides: Vec<usize> = dims.iter().map(|&d| xs[d]).collect();
    Ok(gather(&x.data, shape, &strides, 0))
}

/// `x.narrow(dim, start, len)`.
pub fn slice_cpu(dim: usize, start: usize, len: usize, x: &HostTensor) -> Result<HostTensor, OpError> {
    let shape = slice_shape(dim, start, len, &x.shape)?;
    let xs = contiguous_strides(&x.shape);
    Ok(gather(&x.data, shape, &xs, start * xs[dim]))
}

/// `F.pad(x, pads, value=value)`: `value` everywhere, `x` copied inside.
pub fn pad_cpu(pads: &[usize], value: f32, x: &HostTensor) -> Result<HostTensor, OpError> {
    let shape = pad_shape(pads, &x.shape)?;
    let ys = contiguous_strides(&shape);
    let base = pads_per_dim(pads, x.shape.len()).iter().zip(&ys).map(|((before, _), s)| before * s).sum();
    let mut out = vec![value; shape.iter().product()];
    for_each_offset(&x.shape, &ys, base, |i, off| out[off] = x.data[i]);
    Ok(HostTensor::new(shape, out))
}

/// `torch.roll(x, shifts, dims)`: output index `i` along each dim reads input index `i - shift`
/// modulo the dim's size.
pub fn roll_cpu(shifts: &[i64], dims: &[usize], x: &HostTensor) -> Result<HostTensor, OpError> {
    let shape = roll_shape(shifts, dims, &x.shape)?;
    let per = roll_per_dim(shifts, dims, &shape);
    let xs = contiguous_strides(&shape);
    let n = numel(&shape)?;
    let mut out = vec![0.0; n];
    let mut idx = vec![0usize; shape.len()];
    for (i, o) in out.iter_mut().enumerate() {
        let mut rem = i;
        for k in (0..shape.len()).rev() {
            idx[k] = rem % shape[k];
            rem /= shape[k];
        }
        let off: usize = idx.iter().zip(&shape).zip(&per).zip(&xs).map(|(((&j, &n), &s), &st)| ((j + n - s) % n) * st).sum();
        *o = x.data[off];
    }
    Ok(HostTensor::new(shape, out))
}

/// `torch.cat(inputs, dim)`: for each index of the dims before `dim`, the inputs' contiguous blocks
/// follow one another.
pub fn cat_cpu(dim: usize, inputs: &[&HostTensor]) -> Result<HostTensor, OpError> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let out_shape = cat_shape(dim, &shapes)?;
    let outer: usize = out_shape[..dim].iter().product();
    let blocks: Vec<usize> = inputs.iter().map(|t| t.shape[dim..].iter().product()).collect();
    let mut out = Vec::with_capacity(numel(&out_shape)?);
    for o in 0..outer {
        for (t, &len) in inputs.iter().zip(&blocks) {
            out.extend_from_slice(&t.data[o * len..(o + 1) * len]);
        }
    }
    Ok(HostTensor::new(out_shape, out))
}

// ---- engine

/// The layout that makes `permute(dims)` of a value in `input` the same bytes: each physical
/// position keeps its data, now named by its output dim. `None` if the ranks do not fit.
pub fn permuted_layout(input: Layout, dims: &[usize]) -> Option<Layout> {
    // Per-image permutation: output dim j is input dim q[j].
    let q: Vec<usize> = dims.get(1..)?.iter().map(|&d| d.checked_sub(1)).collect::<Option<_>>()?;
    if q.len() != input.rank() {
        return None;
    }
    let mut inverse = vec![usize::MAX; q.len()];
    for (j, &d) in q.iter().enumerate() {
        *inverse.get_mut(d)? = j;
    }
    Layout::from_order(&input.order().iter().map(|&d| inverse[d]).collect::<Vec<_>>())
}

fn nop(ctx: &BuildCtx, node: NodeId) -> Box<dyn Layer> {
    Box::new(crate::engine::layer::Nop { path: ctx.node(node).path.clone() })
}

/// Reshape and flatten: the output aliases the contiguous input.
fn gpu_reshape(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let (dx, dy) = (ctx.value(x), ctx.value(y));
    let contiguous = |l: Layout, dims: &[usize]| l.same_bytes(Layout::contiguous(dims.len()), dims);
    if !contiguous(dx.layout, &dx.dims) || !contiguous(dy.layout, &dy.dims) {
        let why = format!("reshapes contiguous values only, got {:?} {:?} -> {:?} {:?}", dx.layout, dx.dims, dy.layout, dy.dims);
        return Err(ctx.err(node, LowerKind::Operands, why));
    }
    ctx.alias(y, x)?;
    Ok(nop(ctx, node))
}

/// Permute: an alias when the output's layout is the input's permuted (as planned), otherwise a
/// strided copy.
fn gpu_permute(ctx: &mut BuildCtx, node: NodeId, dims: &[usize]) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let (dx, dy) = (ctx.value(x).clone(), ctx.value(y).clone());
    if permuted_layout(dx.layout, dims).is_some_and(|l| l.same_bytes(dy.layout, &dy.dims)) {
        ctx.alias(y, x)?;
        return Ok(nop(ctx, node));
    }
    let xs = dx.layout.strides(&dx.dims);
    let src_strides: Vec<usize> = dims[1..].iter().map(|&d| xs[d - 1]).collect();
    let copy = gather_copy(ctx, node, x, y, &src_strides, &vec![0; dy.dims.len()], &dy.dims, 0, 0.0)?;
    Ok(strided_layer(ctx, node, "permute", vec![copy]))
}

/// Slice: a strided copy from an offset of the input, written in the output's layout.
fn gpu_slice(ctx: &mut BuildCtx, node: NodeId, dim: usize, start: usize) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let dx = ctx.value(x).clone();
    let xs = dx.layout.strides(&dx.dims);
    let k = dim
        .checked_sub(1)
        .filter(|&k| k < xs.len())
        .ok_or_else(|| ctx.err(node, LowerKind::Unsupported, format!("cannot slice dim {dim}")))?;
    let copy = gather_copy(ctx, node, x, y, &xs, &vec![0; xs.len()], &dx.dims, start * xs[k], 0.0)?;
    Ok(strided_layer(ctx, node, "slice", vec![copy]))
}

/// Constant pad: each output element reads the input, or `value` outside it.
fn gpu_pad(ctx: &mut BuildCtx, node: NodeId, pads: &[usize], value: f32) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let dx = ctx.value(x).clone();
    let xs = dx.layout.strides(&dx.dims);
    // Per-image dims: the full tensor's dims without the batch.
    let before: Vec<usize> = pads_per_dim(pads, dx.dims.len() + 1)[1..].iter().map(|p| p.0).collect();
    let copy = gather_copy(ctx, node, x, y, &xs, &before, &dx.dims, 0, value)?;
    Ok(strided_layer(ctx, node, "pad", vec![copy]))
}

/// Reflect or replicate padding: `shape_pad_edge_*` over contiguous per-image dims, one thread an
/// output element. Its meta, per dim: the output's size, the input's size, the padding before
/// and the input's stride; then the elements per image of the output and of the input.
fn gpu_edge_pad(ctx: &mut BuildCtx, node: NodeId, pads: &[usize], reflect: bool) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let elem = same_elem(ctx, &[x, y])?;
    let (dx, dy) = (ctx.value(x).clone(), ctx.value(y).clone());
    let before: Vec<usize> = pads_per_dim(pads, dx.dims.len() + 1)[1..].iter().map(|p| p.0).collect();
    let xs = contiguous_strides(&dx.dims);
    let meta: Vec<i64> = [&dy.dims[..], &dx.dims[..], &before[..], &xs[..], &[dy.per_image_elems(), dx.per_image_elems()][..]]
        .concat()
        .into_iter()
        .map(|v| v as i64)
        .collect();
    let bytes: Vec<u8> = meta.iter().flat_map(|v| v.to_le_bytes()).collect();
    let meta = ctx.upload_bytes(&bytes)?;
    let rank = to_i32(ctx, "rank", dx.dims.len())?;
    let args = vec![
        Arg::Value(x),
        Arg::Value(y),
        Arg::PerBatch(dy.per_image_elems()),
        Arg::buf(meta),
        Arg::Const(KArg::I32(rank)),
        Arg::Const(KArg::I32(reflect as i32)),
    ];
    let layer = KernelLayer::new(ctx, &format!("shape_pad_edge_{}", elem.suffix()), args, dy.per_image_elems())?;
    let name = if reflect { "reflection_pad" } else { "replication_pad" };
    Ok(Box::new(layer.kind(format!("kernel:{name}"))))
}

/// Roll: one gather (`shape_roll_*`) in the input's layout, which the output shares.
fn gpu_roll(ctx: &mut BuildCtx, node: NodeId, shifts: &[i64], dims: &[usize]) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let (dx, dy) = (ctx.value(x).clone(), ctx.value(y).clone());
    if !dx.layout.same_bytes(dy.layout, &dy.dims) || dx.elem != dy.elem {
        return Err(ctx.err(
            node,
            LowerKind::Unsupported,
            format!("input {:?} {:?} and output {:?} {:?} must share a layout", dx.layout, dx.dims, dy.layout, dy.dims),
        ));
    }
    // Per-image shifts (dims after the batch), then both lists in physical order.
    let full: Vec<usize> = [&[1usize][..], &dx.dims].concat();
    let per = roll_per_dim(shifts, dims, &full);
    let order = dy.layout.order();
    let sizes: Vec<usize> = order.iter().map(|&k| dy.dims[k]).collect();
    let shifts: Vec<usize> = order.iter().map(|&k| per[k + 1]).collect();
    let path = ctx.node(node).path.clone();
    let copy = StridedCopy::roll(ctx, &path, x, y, &sizes, &shifts)?;
    Ok(strided_layer(ctx, node, "roll", vec![copy]))
}

/// Cat: channels of NHWC images (or `[F]` vectors) by the vectorised concat kernel; any other dim
/// by one strided copy per input into its slice of the output.
fn gpu_cat(ctx: &mut BuildCtx, node: NodeId, dim: usize) -> Result<Box<dyn Layer>> {
    let y = ctx.output(node)?;
    let dy = ctx.value(y).clone();
    let k = match dim.checked_sub(1) {
        Some(k) if k < dy.dims.len() => k,
        _ => {
            return Err(ctx.err(
                node,
                LowerKind::Operands,
                format!("the GPU engine concatenates along dims 1 to {} (the batch stays), got dim {dim}", dy.dims.len()),
            ))
        }
    };
    let ins: Vec<ValueId> = (0..ctx.node(node).inputs.len()).map(|i| ctx.input(node, i)).collect::<Result<_>>()?;
    let channels_last = |v: ValueId| {
        let d = ctx.value(v);
        d.layout.same_bytes(Layout::channels_last(d.dims.len()), &d.dims)
    };
    if k == 0 && matches!(dy.dims.len(), 1 | 3) && channels_last(y) && ins.iter().all(|&v| channels_last(v)) {
        return concat_channels(ctx, node, dim);
    }
    let ys = dy.layout.strides(&dy.dims);
    let mut copies = Vec::with_capacity(ins.len());
    let mut at = 0usize;
    for x in ins {
        let dx = ctx.value(x).clone();
        if dx.dims.len() != dy.dims.len() {
            return Err(ctx.err(node, LowerKind::Operands, format!("input {:?} does not fit output {:?}", dx.dims, dy.dims)));
        }
        copies.push(scatter_copy(ctx, node, x, y, &ys, at * ys[k])?);
        at += dx.dims[k];
    }
    Ok(strided_layer(ctx, node, "cat", copies))
}

/// `cat` along the channels of NHWC values: one `concat_channels` launch per input.
struct ConcatLayer {
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
fn concat_channels(ctx: &mut BuildCtx, node: NodeId, dim: usize) -> Result<Box<dyn Layer>> {
    let n_in = ctx.node(node).inputs.len();
    let y = ctx.output(node)?;
    let ins: Vec<ValueId> = (0..n_in).map(|i| ctx.input(node, i)).collect::<Result<_>>()?;
    let mut all = ins.clone();
    all.push(y);
    let elem = same_elem(ctx, &all)?;
    let dy = ctx.value(y).clone();
    let rank = dy.dims.len() + 1;
    if dim != 1 {
        return Err(ctx.err(
            node,
            LowerKind::Unsupported,
            format!("the GPU engine concatenates along channels (dim 1) only, got dim {dim} of a rank-{rank} tensor"),
        ));
    }
    let (cout, h, w) =
        dy.chw().ok_or_else(|| ctx.err(node, LowerKind::Unsupported, format!("cannot concatenate values of dims {:?}", dy.dims)))?;
    let mut inputs = Vec::with_capacity(n_in);
    for v in ins {
        let d = ctx.value(v);
        let (c, hi, wi) =
            d.chw().ok_or_else(|| ctx.err(node, LowerKind::Unsupported, format!("cannot concatenate values of dims {:?}", d.dims)))?;
        if (hi, wi) != (h, w) || !d.layout.same_bytes(Layout::channels_last(d.dims.len()), &d.dims) {
            return Err(ctx.err(node, LowerKind::Operands, format!("input {:?} {:?} does not fit output {:?}", d.layout, d.dims, dy.dims)));
        }
        inputs.push((v, c));
    }
    to_i32(ctx, "channels", cout)?;
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

/// A gather writing all of `y` (in its layout): output element at logical index `i` reads
/// `x[offset + sum((i[k] - before[k]) * src_strides[k])]`, or `fill` where `i[k] - before[k]`
/// falls outside `0..src_dims[k]`.
#[allow(clippy::too_many_arguments)]
fn gather_copy(
    ctx: &mut BuildCtx,
    node: NodeId,
    x: ValueId,
    y: ValueId,
    src_strides: &[usize],
    before: &[usize],
    src_dims: &[usize],
    offset: usize,
    fill: f32,
) -> Result<StridedCopy> {
    let dy = ctx.value(y).clone();
    let dims: Vec<CopyDim> =
        dy.layout.order().iter().map(|&k| CopyDim::gather(dy.dims[k], src_strides[k], before[k], src_dims[k])).collect();
    let (path, op) = (ctx.node(node).path.clone(), ctx.node(node).op.name().to_string());
    StridedCopy::new(ctx, &path, &op, CopyKind::Gather { fill }, x, y, &dims, offset)
}

/// A scatter reading all of `x` (in its layout) into `y` at `offset + sum(i[k] * dst_strides[k])`.
fn scatter_copy(ctx: &mut BuildCtx, node: NodeId, x: ValueId, y: ValueId, dst_strides: &[usize], offset: usize) -> Result<StridedCopy> {
    let dx = ctx.value(x).clone();
    let dims: Vec<CopyDim> = dx.layout.order().iter().map(|&k| CopyDim::plain(dx.dims[k], dst_strides[k])).collect();
    let (path, op) = (ctx.node(node).path.clone(), ctx.node(node).op.name().to_string());
    StridedCopy::new(ctx, &path, &op, CopyKind::Scatter, x, y, &dims, offset)
}

fn strided_layer(ctx: &BuildCtx, node: NodeId, what: &str, copies: Vec<StridedCopy>) -> Box<dyn Layer> {
    Box::new(StridedLayer::new(ctx, &ctx.node(node).path, what, copies))
}

// ---- tracing: Tensor methods and modules

/// A trace-time error in the arguments of a shape method, naming the op and the input.
fn arg_err(x: &Tensor, op: &str, reason: String) -> Error {
    Error::Shape { path: x.scope_path(op), op: op.to_string(), reason: reason.into(), got: vec![x.shape().to_vec()] }
}

/// A PyTorch dim (negative counts from the end) of a rank-`rank` tensor.
fn norm_dim(x: &Tensor, op: &str, d: isize) -> Result<usize> {
    let rank = x.shape().len() as isize;
    let k = if d < 0 { d + rank } else { d };
    if (0..rank).contains(&k) {
        Ok(k as usize)
    } else {
        Err(arg_err(x, op, format!("dim {d} is out of range for a rank-{rank} tensor")))
    }
}

impl Tensor {
    /// Flattens dimensions `start..` into one, as `torch.flatten(x, start)`.
    pub fn flatten(&self, start: usize) -> Result<Tensor> {
        Tensor::record_inline(Op::Shape(ShapeOp::Flatten { start }), &[self])
    }
    /// Concatenates along `dim`, as `torch.cat`.
    pub fn cat(tensors: &[&Tensor], dim: usize) -> Result<Tensor> {
        Tensor::record_inline(Op::Shape(ShapeOp::Cat { dim }), tensors)
    }
    /// `x.reshape(shape)`, with at most one `-1` (inferred), as PyTorch. Dim 0 must stay the batch.
    pub fn reshape(&self, shape: &[isize]) -> Result<Tensor> {
        let x = self.shape();
        let total =
            x.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| arg_err(self, "reshape", "too many elements".into()))?;
        let mut dims = Vec::with_capacity(shape.len());
        let mut infer = None;
        for (i, &d) in shape.iter().enumerate() {
            match d {
                -1 if infer.is_none() => {
                    infer = Some(i);
                    dims.push(1);
                }
                -1 => return Err(arg_err(self, "reshape", format!("{shape:?} infers more than one dim"))),
                d if d < 0 => return Err(arg_err(self, "reshape", format!("{shape:?} has the invalid size {d}"))),
                d => dims.push(d as usize),
            }
        }
        let known = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| arg_err(self, "reshape", format!("{shape:?} is too large")))?;
        if let Some(i) = infer {
            if known == 0 || total % known != 0 {
                return Err(arg_err(self, "reshape", format!("cannot infer the -1 of {shape:?}")));
            }
            dims[i] = total / known;
        } else if known != total {
            return Err(arg_err(self, "reshape", format!("{shape:?} has {known} elements, the input {total}")));
        }
        if dims.first() != x.first() {
            return Err(arg_err(self, "reshape", format!("{dims:?} changes the batch: the engine keeps the batch as dim 0")));
        }
        Tensor::record_inline(Op::Shape(ShapeOp::Reshape { dims: dims[1..].to_vec() }), &[self])
    }
    /// `x.view(shape)`: the same as `reshape` (layouts are the engine's business).
    pub fn view(&self, shape: &[isize]) -> Result<Tensor> {
        self.reshape(shape)
    }
    /// `x.contiguous()`: records nothing (the engine chooses layouts).
    pub fn contiguous(&self) -> Result<Tensor> {
        Ok(self.clone())
    }
    /// `x.permute(dims)` (negative dims count from the end). `dims[0]` must be the batch.
    pub fn permute(&self, dims: &[isize]) -> Result<Tensor> {
        let dims = dims.iter().map(|&d| norm_dim(self, "permute", d)).collect::<Result<Vec<_>>>()?;
        Tensor::record_inline(Op::Shape(ShapeOp::Permute { dims }), &[self])
    }
    /// `x.transpose(d0, d1)`: a permute swapping two dims (neither of them the batch).
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let (a, b) = (norm_dim(self, "transpose", d0)?, norm_dim(self, "transpose", d1)?);
        let mut dims: Vec<usize> = (0..self.shape().len()).collect();
        dims.swap(a, b);
        Tensor::record_inline(Op::Shape(ShapeOp::Permute { dims }), &[self])
    }
    /// `torch.flatten(x, start, end)`; `flatten(start)` is `flatten_range(start, -1)`.
    pub fn flatten_range(&self, start: isize, end: isize) -> Result<Tensor> {
        let (s, e) = (norm_dim(self, "flatten", start)?, norm_dim(self, "flatten", end)?);
        if s > e {
            return Err(arg_err(self, "flatten", format!("start dim {start} comes after end dim {end}")));
        }
        if e + 1 == self.shape().len() {
            return self.flatten(s);
        }
        if s == 0 {
            return Err(arg_err(self, "flatten", "flattening from dim 0 merges the batch: the engine keeps the batch as dim 0".into()));
        }
        let x = self.shape();
        let mut shape: Vec<isize> = x[..s].iter().map(|&d| d as isize).collect();
        shape.push(-1);
        shape.extend(x[e + 1..].iter().map(|&d| d as isize));
        if x[s..=e].contains(&0) {
            return Err(arg_err(self, "flatten", "cannot flatten dims of size 0".into()));
        }
        self.reshape(&shape)
    }
    /// `x.narrow(dim, start, len)`: `len` entries of `dim` from `start` (a copy on the GPU).
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        let dim = norm_dim(self, "narrow", dim)?;
        Tensor::record_inline(Op::Shape(ShapeOp::Slice { dim, start, len }), &[self])
    }
    /// `torch.split(x, sizes, dim)` with a list of sizes that sum to the dim's size.
    pub fn split(&self, sizes: &[usize], dim: isize) -> Result<Vec<Tensor>> {
        let d = norm_dim(self, "split", dim)?;
        let total = sizes.iter().try_fold(0usize, |a, &s| a.checked_add(s));
        if total != Some(self.shape()[d]) {
            return Err(arg_err(self, "split", format!("sizes {sizes:?} do not sum to the size {} of dim {d}", self.shape()[d])));
        }
        let mut start = 0;
        let mut out = Vec::with_capacity(sizes.len());
        for &len in sizes {
            out.push(self.narrow(d as isize, start, len)?);
            start += len;
        }
        Ok(out)
    }
    /// `torch.split(x, size, dim)` with one size: chunks of `size`, the last one smaller.
    pub fn split_size(&self, size: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = norm_dim(self, "split", dim)?;
        if size == 0 {
            return Err(arg_err(self, "split", "split size 0".into()));
        }
        let n = self.shape()[d];
        let sizes: Vec<usize> = (0..n).step_by(size).map(|s| size.min(n - s)).collect();
        self.split(&sizes, dim)
    }
    /// `torch.chunk(x, chunks, dim)`: PyTorch's sizes, `ceil(size / chunks)` each and the last
    /// smaller, so there may be fewer than `chunks` pieces.
    pub fn chunk(&self, chunks: usize, dim: isize) -> Result<Vec<Tensor>> {
        let d = norm_dim(self, "chunk", dim)?;
        if chunks == 0 {
            return Err(arg_err(self, "chunk", "0 chunks".into()));
        }
        self.split_size(self.shape()[d].div_ceil(chunks).max(1), dim)
    }
    /// `torch.roll(x, shifts, dims)` (negative dims count from the end; never the batch).
    pub fn roll(&self, shifts: &[i64], dims: &[isize]) -> Result<Tensor> {
        let dims = dims.iter().map(|&d| norm_dim(self, "roll", d)).collect::<Result<Vec<_>>>()?;
        Tensor::record_inline(Op::Shape(ShapeOp::Roll { shifts: shifts.to_vec(), dims }), &[self])
    }
    /// `F.pad(x, pads, mode="reflect")`: `pads` last dim first, `(before, after)` pairs, each
    /// below its dim's size.
    pub fn reflection_pad(&self, pads: &[usize]) -> Result<Tensor> {
        Tensor::record_inline(Op::Shape(ShapeOp::ReflectPad { pads: pads.to_vec() }), &[self])
    }
    /// `F.pad(x, pads, mode="replicate")`: `pads` last dim first, `(before, after)` pairs.
    pub fn replication_pad(&self, pads: &[usize]) -> Result<Tensor> {
        Tensor::record_inline(Op::Shape(ShapeOp::ReplicatePad { pads: pads.to_vec() }), &[self])
    }
    /// `F.pad(x, pads, value=value)` in constant mode: `pads` last dim first, `(before, after)`
    /// pairs, non-negative (PyTorch's negative pads crop: use `narrow`).
    pub fn pad(&self, pads: &[isize], value: f32) -> Result<Tensor> {
        if let Some(p) = pads.iter().find(|&&p| p < 0) {
            return Err(arg_err(self, "pad", format!("negative pad {p} in {pads:?}: only constant padding by >= 0 is supported")));
        }
        let pads = pads.iter().map(|&p| p as usize).collect();
        Tensor::record_inline(Op::Shape(ShapeOp::Pad { pads, value }), &[self])
    }
}

/// `torch.nn.ConstantPad2d(padding, value)`: `padding` is (left, right, top, bottom).
#[derive(Clone, Debug)]
pub struct ConstantPad2d {
    pub path: String,
    pub padding: [usize; 4],
    pub value: f32,
}

/// What `ConstantPad2d` needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConstantPad2dConfig {
    /// (left, right, top, bottom).
    pub padding: [usize; 4],
    pub value: f32,
}

impl Module for ConstantPad2d {
    type Config = ConstantPad2dConfig;
    fn load(vb: VarBuilder, c: &ConstantPad2dConfig) -> Result<Self> {
        Ok(Self { path: vb.path().to_string(), padding: c.padding, value: c.value })
    }
}

impl Forward for ConstantPad2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::record(&self.path, Op::Shape(ShapeOp::Pad { pads: self.padding.to_vec(), value: self.value }), &[x], &[])
    }
}

/// `torch.nn.ZeroPad2d(padding)`: `padding` is (left, right, top, bottom).
#[derive(Clone, Debug)]
pub struct ZeroPad2d(pub ConstantPad2d);

impl Module for ZeroPad2d {
    type Config = [usize; 4];
    fn load(vb: VarBuilder, padding: &[usize; 4]) -> Result<Self> {
        ConstantPad2d::load(vb, &ConstantPad2dConfig { padding: *padding, value: 0.0 }).map(Self)
    }
}

impl Forward for ZeroPad2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.0.forward(x)
    }
}

/// `chunks` in reverse order, concatenated along `dim`: the slice fixtures' way of using every
/// piece.
fn cat_reversed(chunks: Vec<Tensor>, dim: usize) -> Result<Tensor> {
    Tensor::cat(&chunks.iter().rev().collect::<Vec<_>>(), dim)
}

/// The Kiln twins of this family's PyTorch op fixtures (`op_cases()` in tools/export_reference.py).
#[doc(hidden)]
pub const FIXTURE_TWINS: &[FixtureTwin] = &[
    ("cat", |f| Tensor::cat(&[f.x, f.other()?], 1)),
    ("cat_dim2", |f| Tensor::cat(&[f.x, f.other()?], 2)),
    ("cat_last", |f| Tensor::cat(&[f.x, f.other()?], 3)),
    ("cat_rank2", |f| Tensor::cat(&[f.x, f.other()?], 1)),
    ("flatten", |f| f.x.flatten(1)),
    ("flatten_start2", |f| f.x.flatten(2)),
    ("flatten_range_mid", |f| f.x.flatten_range(1, 2)),
    ("reshape_infer", |f| f.x.reshape(&[3, 2, -1, 5])),
    ("reshape_view_flat", |f| f.x.view(&[2, -1])),
    ("reshape_channel_shuffle", |f| f.x.view(&[2, 3, 2, 5, 7])?.transpose(1, 2)?.contiguous()?.view(&[2, 6, 5, 7])),
    ("permute_nhwc", |f| f.x.permute(&[0, 2, 3, 1])),
    ("permute_rank5", |f| f.x.permute(&[0, 3, 1, 4, 2])),
    ("permute_transpose_last", |f| f.x.transpose(-1, -2)),
    ("slice_narrow", |f| f.x.narrow(2, 1, 3)),
    ("slice_narrow_last", |f| f.x.narrow(-1, 2, 4)),
    ("slice_chunk_reversed", |f| cat_reversed(f.x.chunk(3, 3)?, 3)),
    ("slice_chunk_fewer", |f| cat_reversed(f.x.chunk(4, 1)?, 1)),
    ("slice_split_sizes", |f| cat_reversed(f.x.split(&[2, 4, 1], 1)?, 1)),
    ("pad_constant", |f| f.x.pad(&[1, 2, 0, 3], 0.5)),
    ("pad_channels", |f| f.x.pad(&[1, 0, 0, 2, 2, 1], -2.0)),
    ("pad_zero2d", |f| ZeroPad2d::load(f.vb, &[2, 1, 1, 0])?.forward(f.x)),
    ("reflection_pad_2d", |f| f.x.reflection_pad(&[2, 1, 3, 1])),
    ("reflection_pad_1d_rank3", |f| f.x.reflection_pad(&[3, 2])),
    ("replication_pad_2d", |f| f.x.replication_pad(&[1, 3, 2, 0])),
    ("replication_pad_3d", |f| f.x.replication_pad(&[1, 1, 0, 2, 1, 0])),
    ("pad_constant2d", |f| ConstantPad2d::load(f.vb, &ConstantPad2dConfig { padding: [1, 1, 2, 2], value: -1.5 })?.forward(f.x)),
    ("roll_swin_shift", |f| f.x.roll(&[-3, -3], &[1, 2])),
    ("roll_mixed", |f| f.x.roll(&[11, -2], &[3, 1])),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tracer;

    fn t(shape: &[usize]) -> HostTensor {
        let n = shape.iter().product::<usize>();
        HostTensor::new(shape.to_vec(), (0..n).map(|v| v as f32).collect())
    }

    #[test]
    fn shape_rules_reject_moving_the_batch() {
        let x: &[usize] = &[2, 3, 4];
        assert!(permute_shape(&[1, 0, 2], x).unwrap_err().to_string().contains("batch"));
        assert!(permute_shape(&[0, 2], x).unwrap_err().to_string().contains("has 2 dims"));
        assert!(permute_shape(&[0, 2, 2], x).unwrap_err().to_string().contains("not a permutation"));
        assert!(permute_shape(&[0, 3, 1], x).unwrap_err().to_string().contains("not a permutation"));
        assert_eq!(permute_shape(&[0, 2, 1], x).unwrap(), vec![2, 4, 3]);
        assert!(slice_shape(0, 0, 1, x).unwrap_err().to_string().contains("batch"));
        assert!(slice_shape(3, 0, 1, x).unwrap_err().to_string().contains("out of range"));
        assert!(slice_shape(2, 3, 2, x).unwrap_err().to_string().contains("out of range"));
        assert!(slice_shape(2, usize::MAX, 2, x).unwrap_err().to_string().contains("out of range"));
        assert!(slice_shape(2, 1, 0, x).unwrap_err().to_string().contains("empty"));
        assert!(flatten_shape(0, &[x]).unwrap_err().to_string().contains("batch"));
        assert!(flatten_shape(3, &[x]).unwrap_err().to_string().contains("out of range"));
        assert!(pad_shape(&[1, 1, 1, 1, 1, 1], x).unwrap_err().to_string().contains("batch"));
        assert!(pad_shape(&[1], x).unwrap_err().to_string().contains("pairs"));
        assert!(pad_shape(&[usize::MAX, 1], x).unwrap_err().to_string().contains("overflows"));
        assert_eq!(pad_shape(&[1, 2, 0, 3], x).unwrap(), vec![2, 6, 7]);
        assert!(reshape_shape(&[5, 2], x).unwrap_err().to_string().contains("12 elements per image against 10"));
        assert!(reshape_shape(&[usize::MAX, 2], x).unwrap_err().to_string().contains("overflows"));
        assert_eq!(reshape_shape(&[2, 2, 3], x).unwrap(), vec![2, 2, 2, 3]);
        assert!(cat_shape(1, &[&[2, 3], &[2, usize::MAX]]).unwrap_err().to_string().contains("overflows"));
    }

    #[test]
    fn tensor_methods_check_their_arguments() {
        let tracer = Tracer::new();
        let x = tracer.input("x", &[2, 6, 4, 5]);
        fn err<T: std::fmt::Debug>(r: Result<T>) -> String {
            r.unwrap_err().to_string()
        }
        assert!(err(x.reshape(&[-1, 4, 5])).contains("batch"));
        assert!(err(x.reshape(&[2, -1, -1])).contains("more than one"));
        assert!(err(x.reshape(&[2, 7, -1])).contains("cannot infer"));
        assert!(err(x.reshape(&[2, 0, -1])).contains("cannot infer"));
        assert!(err(x.reshape(&[2, -3, 40])).contains("invalid size"));
        assert!(err(x.reshape(&[2, 6, 21])).contains("elements"));
        assert!(err(x.reshape(&[4, 3, 4, 5])).contains("batch"));
        assert_eq!(x.reshape(&[2, 3, -1, 5]).unwrap().shape(), &[2, 3, 8, 5]);
        assert_eq!(x.view(&[-1, 120]).unwrap().shape(), &[2, 120]);
        assert!(err(x.transpose(0, 1)).contains("batch"));
        assert!(err(x.transpose(1, 4)).contains("out of range"));
        assert!(err(x.permute(&[0, 1, 2])).contains("has 3 dims"));
        assert_eq!(x.transpose(-1, -2).unwrap().shape(), &[2, 6, 5, 4]);
        assert_eq!(x.permute(&[0, 2, 3, 1]).unwrap().shape(), &[2, 4, 5, 6]);
        assert!(err(x.flatten_range(0, 1)).contains("batch"));
        assert!(err(x.flatten_range(2, 1)).contains("after"));
        assert_eq!(x.flatten_range(1, 2).unwrap().shape(), &[2, 24, 5]);
        assert_eq!(x.flatten_range(2, -1).unwrap().shape(), &[2, 6, 20]);
        assert!(err(x.narrow(0, 0, 1)).contains("batch"));
        assert!(err(x.narrow(-1, 3, 3)).contains("out of range"));
        assert!(err(x.split(&[2, 3], 1)).contains("sum"));
        assert!(err(x.chunk(0, 1)).contains("0 chunks"));
        let shapes = |ts: Vec<Tensor>| ts.iter().map(|t| t.shape()[1]).collect::<Vec<_>>();
        assert_eq!(shapes(x.chunk(4, 1).unwrap()), vec![2, 2, 2], "PyTorch: ceil(6 / 4) = 2 each, 3 chunks");
        assert_eq!(shapes(x.split_size(4, 1).unwrap()), vec![4, 2]);
        assert_eq!(shapes(x.chunk(5, 1).unwrap()), vec![2, 2, 2]);
        assert!(err(x.pad(&[1, -1], 0.0)).contains("negative pad"));
        assert!(err(x.pad(&[1, 1, 1, 1, 1, 1, 1, 1], 0.0)).contains("batch"));
        assert_eq!(x.pad(&[1, 2], 0.5).unwrap().shape(), &[2, 6, 4, 8]);
        assert_eq!(x.contiguous().unwrap().id(), x.id());
    }

    #[test]
    fn cpu_references() {
        let x = t(&[1, 2, 3]);
        let p = permute_cpu(&[0, 2, 1], &x).unwrap();
        assert_eq!((p.shape, p.data), (vec![1, 3, 2], vec![0., 3., 1., 4., 2., 5.]));
        let s = slice_cpu(2, 1, 2, &x).unwrap();
        assert_eq!((s.shape, s.data), (vec![1, 2, 2], vec![1., 2., 4., 5.]));
        let q = pad_cpu(&[1, 0, 0, 1], -1.0, &x).unwrap();
        assert_eq!((q.shape, q.data), (vec![1, 3, 4], vec![-1., 0., 1., 2., -1., 3., 4., 5., -1., -1., -1., -1.]));
        let r = reshape_cpu(&[3, 2], x.clone()).unwrap();
        assert_eq!((r.shape, r.data), (vec![1, 3, 2], x.data.clone()));
        assert!(reshape_cpu(&[4], x).is_err());
    }

    #[test]
    fn permuted_layouts_keep_the_bytes() {
        // NHWC [C, H, W] permuted to [H, W, C] is contiguous.
        assert_eq!(permuted_layout(Layout::channels_last(3), &[0, 2, 3, 1]), Some(Layout::contiguous(3)));
        // Contiguous [A, B, C] transposed to [B, A, C] is stored A, B, C: order [1, 0, 2].
        assert_eq!(permuted_layout(Layout::contiguous(3), &[0, 2, 1, 3]), Layout::from_order(&[1, 0, 2]));
        assert_eq!(permuted_layout(Layout::contiguous(3), &[0, 1, 2]), None);
        let dims = [2usize, 3, 4];
        let out_dims = [3usize, 4, 2];
        for input in [Layout::contiguous(3), Layout::channels_last(3), Layout::from_order(&[1, 0, 2]).unwrap()] {
            let l = permuted_layout(input, &[0, 2, 3, 1]).unwrap();
            let (xs, ys) = (input.strides(&dims), l.strides(&out_dims));
            assert_eq!([ys[0], ys[1], ys[2]], [xs[1], xs[2], xs[0]], "{input:?}");
        }
    }
}
