//! The GPU converters: reshape, flatten and permute as aliases of their input's bytes; slice, pad,
//! roll and cat as strided copies (`engine::strided`); reflect and replicate padding and cat of
//! NHWC channels by their own kernels (`kernels/shape.cu`).

use super::cpu::contiguous_strides;
use super::rules::{pads_per_dim, roll_per_dim};
use crate::engine::launch::{grid_for, launch, same_elem, to_i32, Arg, CudaFunction, KArg, KernelLayer, BLOCK};
use crate::engine::strided::{CopyDim, CopyKind, StridedCopy, StridedLayer};
use crate::engine::{Layer, Layout, RunCtx, ValueId};
use crate::graph::NodeId;
use crate::ops::BuildCtx;
use crate::LowerKind;
use crate::Result;

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
pub(super) fn gpu_reshape(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
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
pub(super) fn gpu_permute(ctx: &mut BuildCtx, node: NodeId, dims: &[usize]) -> Result<Box<dyn Layer>> {
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
pub(super) fn gpu_slice(ctx: &mut BuildCtx, node: NodeId, dim: usize, start: usize) -> Result<Box<dyn Layer>> {
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
pub(super) fn gpu_pad(ctx: &mut BuildCtx, node: NodeId, pads: &[usize], value: f32) -> Result<Box<dyn Layer>> {
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
pub(super) fn gpu_edge_pad(ctx: &mut BuildCtx, node: NodeId, pads: &[usize], reflect: bool) -> Result<Box<dyn Layer>> {
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
pub(super) fn gpu_roll(ctx: &mut BuildCtx, node: NodeId, shifts: &[i64], dims: &[usize]) -> Result<Box<dyn Layer>> {
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
pub(super) fn gpu_cat(ctx: &mut BuildCtx, node: NodeId, dim: usize) -> Result<Box<dyn Layer>> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
