//! Ops that move data without arithmetic: flatten, reshape, permute, cat, slice, roll and pad
//! (constant, reflect, replicate).
//!
//! The engine keeps the batch as dim 0 of every value, so these ops never move, merge or split
//! dim 0: their shape rules reject it, naming the op and the shapes. On the GPU, reshape, flatten
//! and permute move nothing (the output aliases the input's bytes: a reshape of the contiguous
//! layout, a permute re-expressed as the permuted layout), and slice, pad and cat are strided
//! copies (`kernels/shape.cu`) in whatever layout their input is in.
//!
//! Here: the op, its `Tensor` methods and the constant pads' modules; `modules` holds the other
//! `torch.nn` layers and the family's tables, `rules` the shape rules, `cpu` the CPU references,
//! `gpu` the converters.

mod cpu;
mod gpu;
mod modules;
mod rules;

pub(crate) use cpu::contiguous_strides;
pub use modules::{Flatten, FlattenConfig, ReflectionPad2d, ReplicationPad2d, ATEN, NN_LAYERS};

use crate::engine::launch::typed_entry_points;
use crate::engine::{Layer, Layout};
use crate::error::OpError;
use crate::graph::{HostTensor, NodeId, Op};
use crate::module::{Forward, Module};
use crate::ops::BuildCtx;
use crate::ops::{one_input, CpuArgs, FixtureTwin, LayoutPlan, OpDef};
use crate::tensor::Tensor;
use crate::var_builder::VarBuilder;
use crate::{Error, Result};
use cpu::{cat_cpu, edge_pad_cpu, flatten_cpu, pad_cpu, permute_cpu, reshape_cpu, roll_cpu, slice_cpu};
use gpu::{gpu_cat, gpu_edge_pad, gpu_pad, gpu_permute, gpu_reshape, gpu_roll, gpu_slice, permuted_layout};
use rules::{cat_shape, edge_pad_shape, flatten_shape, pad_shape, permute_shape, reshape_shape, roll_shape, slice_shape};
use serde::{Deserialize, Serialize};

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
}
