//! `Binary`: `+ - * /` of two tensors with NumPy/PyTorch broadcasting, its shape rule, CPU
//! reference and layers (the packed same-shape kernel and the strided broadcasting kernel).

use super::{f32_arg, i32_arg, KERNELS};
use crate::engine::launch::{pack, same_elem, typed_entry_points, Arg, KernelLayer};
use crate::engine::{Layer, Layout, ValueId};
use crate::error::OpError;
use crate::graph::{HostTensor, NodeId};
use crate::ops::BuildCtx;
use crate::ops::{CpuArgs, LayoutPlan, OpDef};
use crate::LowerKind;
use crate::Result;
use serde::{Deserialize, Serialize};

/// Two-input elementwise arithmetic with broadcasting (trailing dims aligned, size-1 dims
/// stretched), as PyTorch's `+ - * /` on tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, strum::EnumIter)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
}

impl Binary {
    pub fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            Binary::Add => a + b,
            Binary::Sub => a - b,
            Binary::Mul => a * b,
            Binary::Div => a / b,
        }
    }
    /// The op's code in the kernels (`BIN_*` in kernels/elementwise.cu).
    pub fn kernel_code(self) -> i32 {
        match self {
            Binary::Add => 0,
            Binary::Sub => 1,
            Binary::Mul => 2,
            Binary::Div => 3,
        }
    }
}

/// The broadcast of two shapes, as PyTorch: dims aligned from the right, each pair equal or 1.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>, OpError> {
    let rank = a.len().max(b.len());
    let dim = |s: &[usize], i: usize| if i < rank - s.len() { 1 } else { s[i - (rank - s.len())] };
    (0..rank)
        .map(|i| match (dim(a, i), dim(b, i)) {
            (x, y) if x == y || y == 1 => Ok(x),
            (1, y) => Ok(y),
            (x, y) => Err(format!("shapes {a:?} and {b:?} do not broadcast: {x} against {y} at dim {i}").into()),
        })
        .collect()
}

/// Row-major strides of `shape` read as a broadcast into `out` (0 along stretched dims).
pub fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let pad = out.len() - shape.len();
    let mut strides = vec![0; out.len()];
    let mut s = 1;
    for i in (0..shape.len()).rev() {
        strides[pad + i] = if shape[i] == 1 { 0 } else { s };
        s *= shape[i];
    }
    strides
}

impl OpDef for Binary {
    fn name(&self) -> &str {
        match self {
            Binary::Add => "add",
            Binary::Sub => "sub",
            Binary::Mul => "mul",
            Binary::Div => "div",
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
        match inputs {
            [a, b] => broadcast_shape(a, b),
            _ => Err(OpError::Arity { expected: "2".into(), got: inputs.len() }),
        }
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, OpError> {
        args.expect(2)?;
        let out = self.infer_shape(&args.shapes()?)?;
        if args.get(0)?.shape == out && args.get(1)?.shape == out {
            let mut a = args.take(0)?;
            let b = args.get(1)?;
            a.data.iter_mut().zip(&b.data).for_each(|(x, y)| *x = self.apply(*x, *y));
            return Ok(a);
        }
        let (a, b) = (args.get(0)?, args.get(1)?);
        let (sa, sb) = (broadcast_strides(&a.shape, &out), broadcast_strides(&b.shape, &out));
        let n: usize = out.iter().product();
        let mut data = Vec::with_capacity(n);
        let mut index = vec![0usize; out.len()];
        for _ in 0..n {
            let ia: usize = index.iter().zip(&sa).map(|(i, s)| i * s).sum();
            let ib: usize = index.iter().zip(&sb).map(|(i, s)| i * s).sum();
            data.push(self.apply(a.data[ia], b.data[ib]));
            for d in (0..out.len()).rev() {
                index[d] += 1;
                if index[d] < out[d] {
                    break;
                }
                index[d] = 0;
            }
        }
        Ok(HostTensor::new(out, data))
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        // The output takes the engine's native layout if an operand of the output's rank has it,
        // else the first such operand's; operands are read through strides, in whatever layout
        // they are. Preferring the native layout ends a permuted layout at the first add that
        // meets a native operand: ViT's residual stream, permuted by the patch embedding, made
        // every residual add read one operand transposed and every LayerNorm reformat its input.
        let same_rank = || inputs.iter().flatten().filter(|l| l.rank() == out_rank).copied();
        let native = Layout::native(out_rank);
        let out = same_rank().find(|&l| l == native).or_else(|| same_rank().next()).unwrap_or(Layout::contiguous(out_rank));
        LayoutPlan::any_input(inputs, out)
    }
    fn entry_points(&self) -> Vec<String> {
        typed_entry_points(KERNELS)
    }
    fn colour(&self) -> &'static str {
        "#dee2e6"
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        binary(ctx, node, *self)
    }
}

// ---- engine layers ----------------------------------------------------------------------------

/// A binary elementwise node (`+ - * /` with PyTorch's broadcasting). Two activations of the
/// output's dims in its layout take the packed same-shape kernel; anything else (a broadcast
/// operand, another layout, a constant such as a `[C, 1, 1]` layer scale or a `[1, L, D]` position
/// embedding, uploaded here) takes the strided broadcasting kernel.
pub fn binary(ctx: &mut BuildCtx, node: NodeId, op: Binary) -> Result<Box<dyn Layer>> {
    let y = ctx.output(node)?;
    let n_in = ctx.node(node).inputs.len();
    if n_in != 2 {
        return Err(ctx.err(node, LowerKind::Operands, format!("expects 2 operands, got {n_in}")));
    }
    let is_weight = |ctx: &BuildCtx, i: usize| ctx.graph.weight_data(ctx.node(node).inputs[i]).is_some();
    let dy = ctx.value(y).clone();
    if !is_weight(ctx, 0) && !is_weight(ctx, 1) {
        let (a, b) = (ctx.input(node, 0)?, ctx.input(node, 1)?);
        let elem = same_elem(ctx, &[a, b, y])?;
        let same = |v: ValueId| {
            let d = ctx.value(v);
            d.dims == dy.dims && d.layout.same_bytes(dy.layout, &dy.dims)
        };
        if same(a) && same(b) {
            let per_image = dy.per_image_elems();
            let args = vec![
                Arg::Value(a),
                Arg::Value(b),
                Arg::Value(y),
                Arg::PerBatch(per_image),
                i32_arg(op.kernel_code()),
                i32_arg(0),
                f32_arg(0.0),
            ];
            let layer = KernelLayer::new(ctx, &format!("binary_{}", elem.suffix()), args, per_image)?;
            return Ok(Box::new(layer.kind(format!("kernel:{}", op.name())).items(4)));
        }
    }
    broadcast_binary(ctx, node, op, y)
}

/// Element strides of each output dim (logical order) for one operand of a broadcast, and its
/// batch stride: an activation of the output's rank in its own layout, or a constant weight
/// (its own row-major shape, aligned to the output's dims from the right, batch stride 0).
fn operand_strides(ctx: &BuildCtx, node: NodeId, i: usize, out: &[usize]) -> Result<(Vec<usize>, usize, Option<Vec<f32>>)> {
    let bad = |what: String| {
        ctx.err(node, LowerKind::Operands, format!("operand {i} {what} does not broadcast to the output {out:?} (per image)"))
    };
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

/// `y = a op b` through per-operand strides (`binary_bcast_*`): strides in the output's physical
/// order, size-1 dims dropped and runs that are contiguous for both operands merged (an SE
/// block's `[C, H, W] * [C, 1, 1]` in NHWC becomes `[HW, C]` by `[0, 1]`).
fn broadcast_binary(ctx: &mut BuildCtx, node: NodeId, op: Binary, y: ValueId) -> Result<Box<dyn Layer>> {
    let dy = ctx.value(y).clone();
    let elem = dy.elem;
    let mut operands = Vec::with_capacity(2);
    let mut strides = Vec::with_capacity(2);
    let mut batch = [0usize; 2];
    for (i, batch_stride) in batch.iter_mut().enumerate() {
        let (s, b, data) = operand_strides(ctx, node, i, &dy.dims)?;
        let operand = match data {
            Some(w) => Arg::buf(ctx.upload(&w)?),
            None => {
                let v = ctx.input(node, i)?;
                if ctx.value(v).elem != elem {
                    return Err(ctx.err(node, LowerKind::Operands, format!("mixes element types {:?} and {elem:?}", ctx.value(v).elem)));
                }
                Arg::Value(v)
            }
        };
        operands.push(operand);
        strides.push(s);
        *batch_stride = b;
    }
    if operands.iter().all(|o| matches!(o, Arg::Buf(_))) {
        return Err(ctx.err(node, LowerKind::Operands, "both operands are constants (fold them before building)"));
    }
    let (merged, vec) = broadcast_plan(&dy.dims, dy.layout, [&strides[0], &strides[1]], batch, pack(elem));
    let mut meta: Vec<i64> = merged.iter().map(|d| d[0] as i64).collect();
    meta.extend(merged.iter().map(|d| d[1] as i64));
    meta.extend(merged.iter().map(|d| d[2] as i64));
    meta.extend(batch.map(|b| b as i64));
    let bytes: Vec<u8> = meta.iter().flat_map(|v| v.to_le_bytes()).collect();
    let meta = ctx.upload_bytes(&bytes)?;
    let per_image = dy.per_image_elems();
    let mut args = operands;
    args.extend([Arg::Value(y), Arg::PerBatch(per_image), Arg::buf(meta)]);
    args.extend([merged.len() as i32, op.kernel_code(), vec as i32].map(i32_arg));
    let layer = KernelLayer::new(ctx, &format!("binary_bcast_{}", elem.suffix()), args, per_image)?;
    Ok(Box::new(layer.kind(format!("kernel:{}_broadcast", op.name())).items(if vec { 4 } else { 1 })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_follows_pytorch() {
        assert_eq!(broadcast_shape(&[2, 3, 4, 5], &[3, 1, 1]).unwrap(), [2, 3, 4, 5]);
        assert_eq!(broadcast_shape(&[2, 1, 4], &[5, 1]).unwrap(), [2, 5, 4]);
        assert!(broadcast_shape(&[2, 3], &[4]).unwrap_err().to_string().contains("do not broadcast"));
        assert_eq!(broadcast_strides(&[3, 1, 1], &[2, 3, 4, 5]), [0, 1, 0, 0]);
    }

    /// `binary_bcast`'s indexing, run on the host over the plan `broadcast_binary` makes, against
    /// the CPU reference of `Binary` (activations in NCHW and NHWC, broadcasts of every kind).
    #[test]
    fn broadcast_plans_index_like_the_cpu_reference() {
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
            let out = broadcast_shape(&da, &db).unwrap();
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
}
