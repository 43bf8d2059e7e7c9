//! The GPU converters: each op's candidates (the cuBLASLt path of `gemm`, the fused kernels of
//! `fused`), timed per layer by `BuildCtx::choose`, and the kernels they launch.

use super::bias_strides;
use super::fused::{FusedAttention, FusedIo, FusedKernel, FUSED_HEAD_DIMS};
use super::gemm::{GemmAttention, GemmCore, Regions, Repack, UnpackedGemmAttention};
use super::{Attention, QkvAttention};
use crate::engine::{DeviceBuf, Elem, Layer, Layout, ValueDesc};
use crate::error::OpError;
use crate::graph::{HostTensor, NodeId};
use crate::ops::BuildCtx;
use crate::LowerKind;
use crate::Result;
use std::sync::Arc;

/// The problem of one attention node: `zimg` (head, window, ...) problems per image.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dims {
    pub(super) zimg: usize,
    pub(super) l: usize,
    pub(super) s: usize,
    pub(super) d: usize,
    pub(super) dv: usize,
}

/// Broadcasts a constant bias to f32 `[zimg, L, S]` (the same for every image): the layout every
/// candidate reads. `q` is one image's q `[..., L, D]` (for the packed op, `[G..., H, L, D]`).
fn host_bias(bias: &HostTensor, q: &[usize], dims: Dims) -> std::result::Result<Vec<f32>, OpError> {
    // Full scores shape with a batch of 1: the bias must not vary along the batch.
    let scores: Vec<usize> = [&[1usize][..], &q[..q.len() - 1], &[dims.s][..]].concat();
    let st = bias_strides(&bias.shape, &scores)?;
    let lead = &scores[1..scores.len() - 2];
    let r = scores.len();
    let mut out = Vec::with_capacity(dims.zimg * dims.l * dims.s);
    for z in 0..dims.zimg {
        let (mut rem, mut base) = (z, 0);
        for i in (0..lead.len()).rev() {
            base += (rem % lead[i]) * st[i + 1];
            rem /= lead[i];
        }
        for i in 0..dims.l {
            out.extend((0..dims.s).map(|j| bias.data[base + i * st[r - 2] + j * st[r - 1]]));
        }
    }
    Ok(out)
}

/// The node's constant bias (input `index`) broadcast by `host_bias` and uploaded, when it has one.
fn upload_bias(ctx: &mut BuildCtx, node: NodeId, index: usize, q: &[usize], dims: Dims) -> Result<Option<Arc<DeviceBuf>>> {
    let b = ctx
        .weight(node, index)
        .map_err(|_| ctx.err(node, LowerKind::Weights, "the GPU engine takes a constant attention bias only (a weight)"))?;
    let host = host_bias(b, q, dims).map_err(|e| ctx.err(node, LowerKind::Operands, e))?;
    Ok(Some(Arc::new(ctx.upload_f32(&host)?)))
}

fn is_contiguous(d: &ValueDesc) -> bool {
    d.layout.same_bytes(Layout::contiguous(d.dims.len()), &d.dims)
}

/// `v` as a kernel's 32-bit argument, or an error naming what it is.
pub(super) fn int(ctx: &BuildCtx, node: NodeId, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| ctx.err(node, LowerKind::TooLarge, format!("{what} = {v} exceeds the kernels' 32-bit range")))
}

/// `v` as a kernel's 64-bit argument (row strides), or an error naming what it is.
fn long(ctx: &BuildCtx, node: NodeId, what: &str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| ctx.err(node, LowerKind::TooLarge, format!("{what} = {v} exceeds the kernels' 64-bit range")))
}

/// `a · b`, or an error naming the product.
pub(super) fn mul(ctx: &BuildCtx, node: NodeId, what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| ctx.err(node, LowerKind::TooLarge, format!("{what} ({a} × {b}) overflows")))
}

pub(super) fn gpu_attention(ctx: &mut BuildCtx, node: NodeId, attrs: Attention) -> Result<Box<dyn Layer>> {
    let (q, k, v, y) = (ctx.input(node, 0)?, ctx.input(node, 1)?, ctx.input(node, 2)?, ctx.output(node)?);
    let (dq, dk, dvv, dy) = (ctx.value(q).clone(), ctx.value(k).clone(), ctx.value(v).clone(), ctx.value(y).clone());
    if ![&dq, &dk, &dvv, &dy].iter().all(|d| is_contiguous(d)) {
        return Err(ctx.err(
            node,
            LowerKind::Operands,
            format!(
                "attention reads contiguous q, k, v and writes a contiguous y, got {:?} {:?} {:?} {:?}",
                dq.layout, dk.layout, dvv.layout, dy.layout
            ),
        ));
    }
    let r = dq.dims.len();
    if r < 2 || dk.dims.len() != r || dvv.dims.len() != r {
        return Err(ctx.err(
            node,
            LowerKind::Unsupported,
            format!("q {:?}, k {:?} and v {:?} need [.., L, D] per image", dq.dims, dk.dims, dvv.dims),
        ));
    }
    let dims =
        Dims { zimg: dq.dims[..r - 2].iter().product(), l: dq.dims[r - 2], s: dk.dims[r - 2], d: dq.dims[r - 1], dv: dvv.dims[r - 1] };
    let bias = if attrs.bias { upload_bias(ctx, node, 3, &dq.dims, dims)? } else { None };
    let elem = ctx.elem();
    let path = ctx.node(node).path.clone();
    let mut candidates: Vec<Box<dyn Layer>> = Vec::new();

    // (a) cuBLASLt: scores (f32) = scale · Q·Kᵀ, softmax kernel, Y = P·V.
    let core = GemmCore::new(ctx, node, dims, attrs.scale, bias.clone())?;
    let (scores_bytes, probs_bytes) =
        (mul(ctx, node, "scores", core.scores_elems, Elem::F32.size())?, mul(ctx, node, "probabilities", core.scores_elems, elem.size())?);
    let (scores, probs) = (ctx.scratch(scores_bytes), ctx.scratch(probs_bytes));
    candidates.push(Box::new(GemmAttention { path: path.clone(), core, io: [q, k, v, y], scores, probs }));

    // (b), (c) the fused kernels, for the head dims they are stamped for: q, k, v and y are
    // `[Z, L, D]` blocks, i.e. one head per problem with rows D apart.
    if dims.d == dims.dv && FUSED_HEAD_DIMS.contains(&dims.d) {
        let ld = long(ctx, node, "D", dims.d)?;
        let io = FusedIo { q: (q, 0), k: (k, 0), v: (v, 0), y, heads: 1, ldq: ld, ldkv: ld, ldy: ld };
        for kernel in FusedKernel::for_elem(elem) {
            if let Some(c) = FusedAttention::new(ctx, node, kernel, io, dims, attrs.scale, bias.clone())? {
                candidates.push(Box::new(c));
            }
        }
    }
    let key = ctx.problem_key(node);
    ctx.choose(&key, candidates)
}

pub(super) fn gpu_qkv_attention(ctx: &mut BuildCtx, node: NodeId, attrs: QkvAttention) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let (dx, dy) = (ctx.value(x).clone(), ctx.value(y).clone());
    if !is_contiguous(&dx) || !is_contiguous(&dy) {
        return Err(ctx.err(
            node,
            LowerKind::Operands,
            format!("qkv_attention reads a contiguous qkv and writes a contiguous y, got {:?} and {:?}", dx.layout, dy.layout),
        ));
    }
    let r = dx.dims.len();
    let h = attrs.heads;
    let packed = mul(ctx, node, "3 · heads", 3, h)?;
    if r < 2 || h == 0 || !dx.dims[r - 1].is_multiple_of(packed) || dy.dims.len() != r {
        return Err(ctx.err(
            node,
            LowerKind::Unsupported,
            format!("qkv {:?} needs [.., L, 3·{h}·D] per image (output {:?})", dx.dims, dy.dims),
        ));
    }
    let (groups, l, d) = (&dx.dims[..r - 2], dx.dims[r - 2], dx.dims[r - 1] / packed);
    let hd = h * d;
    let zimg = mul(ctx, node, "problems per image", groups.iter().product(), h)?;
    let dims = Dims { zimg, l, s: l, d, dv: d };
    // One image's q as `attention` would see it, `[G..., H, L, D]`: the problems are (G..., H).
    let q_dims: Vec<usize> = [groups, &[h, l, d][..]].concat();
    let bias = if attrs.bias { upload_bias(ctx, node, 1, &q_dims, dims)? } else { None };
    let elem = ctx.elem();
    let hd_bytes = mul(ctx, node, "H·D bytes", hd, elem.size())? as u64;
    let path = ctx.node(node).path.clone();
    let mut candidates: Vec<Box<dyn Layer>> = Vec::new();

    // (a), (b) the fused kernels read q, k and v in place: rows 3·H·D apart, k and v H·D and
    // 2·H·D elements after q; y's rows are H·D apart, head h at h·D.
    if FUSED_HEAD_DIMS.contains(&d) {
        let (ld_in, ld_out) = (long(ctx, node, "3·H·D", 3 * hd)?, long(ctx, node, "H·D", hd)?);
        let heads = int(ctx, node, "heads", h)?;
        let io = FusedIo { q: (x, 0), k: (x, hd_bytes), v: (x, 2 * hd_bytes), y, heads, ldq: ld_in, ldkv: ld_in, ldy: ld_out };
        for kernel in FusedKernel::for_elem(elem).into_iter().rev() {
            if let Some(c) = FusedAttention::new(ctx, node, kernel, io, dims, attrs.scale, bias.clone())? {
                candidates.push(Box::new(c));
            }
        }
    }

    // (c) any head dim: q, k and v copied into scratch `[Z, L, D]` blocks, the cuBLASLt path, and
    // the result copied into place. Its scratch is one prologue buffer (the copy of qkv), held by
    // the arena only if this candidate is chosen.
    let core = GemmCore::new(ctx, node, dims, attrs.scale, bias)?;
    let part = mul(ctx, node, "q, k or v per image", mul(ctx, node, "q, k or v per image", zimg, l)?, d)?;
    let regions = Regions {
        part: mul(ctx, node, "q, k or v bytes", part, elem.size())?,
        scores: mul(ctx, node, "scores bytes", core.scores_elems, Elem::F32.size())?,
        probs: mul(ctx, node, "probabilities bytes", core.scores_elems, elem.size())?,
    };
    let per_image = regions
        .per_image()
        .ok_or_else(|| ctx.err(node, LowerKind::TooLarge, format!("the scratch of {zimg} problems of {l}×{d} overflows")))?;
    let scratch = ctx.prologue_scratch(per_image);
    let src_strides = Layout::contiguous(r).strides(&dx.dims);
    let g = groups.len();
    // Unpack: one image of q (k, v) as `[G..., H, L, D]`, read from the packed rows.
    let unpack_strides: Vec<usize> = [&src_strides[..g], &[d, 3 * hd, 1][..]].concat();
    let unpack = Repack::new(ctx, node, &q_dims, &unpack_strides, dx.per_image_elems(), elem)?;
    // Pack: one image of y `[G..., L, H, D]`, read from the `[G..., H, L, D]` scratch.
    let y_strides = Layout::contiguous(q_dims.len()).strides(&q_dims);
    let pack_sizes: Vec<usize> = [groups, &[l, h, d][..]].concat();
    let pack_strides: Vec<usize> = [&y_strides[..g], &[y_strides[g + 1], y_strides[g], 1][..]].concat();
    let pack = Repack::new(ctx, node, &pack_sizes, &pack_strides, part, elem)?;
    candidates.push(Box::new(UnpackedGemmAttention {
        path,
        core,
        unpack,
        pack,
        io: [x, y],
        scratch,
        regions,
        part_offset: hd_bytes,
        sm_count: ctx.kernels.sm_count(),
    }));
    let key = ctx.problem_key(node);
    ctx.choose(&key, candidates)
}

/// The kernels this family's layers launch (kernels/attention.cu): the GEMM path's softmax, and
/// each fused kernel for every head dim and element type it runs on. (The GEMM path's repacking
/// is the engine's permute.)
pub(super) fn entry_points() -> Vec<String> {
    let mut names = Vec::new();
    for elem in [Elem::F32, Elem::F16] {
        names.push(format!("attn_softmax_{}", elem.suffix()));
        for kernel in FusedKernel::for_elem(elem) {
            names.extend(FUSED_HEAD_DIMS.map(|d| kernel.entry(d, elem)));
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_bias_broadcasts_per_problem() {
        // q [N, 2 windows, 3 heads, L=2, D]; bias [2, 1, 2, 2] varies by window, not by head.
        let bias = HostTensor::new(vec![2, 1, 2, 2], (0..8).map(|v| v as f32).collect());
        let dims = Dims { zimg: 6, l: 2, s: 2, d: 4, dv: 4 };
        let out = host_bias(&bias, &[2, 3, 2, 4], dims).unwrap();
        assert_eq!(&out[..4], &[0.0, 1.0, 2.0, 3.0]);
        assert_eq!(&out[8..12], &[0.0, 1.0, 2.0, 3.0], "head 2 of window 0 reads window 0's bias");
        assert_eq!(&out[12..16], &[4.0, 5.0, 6.0, 7.0], "window 1");
    }
}
