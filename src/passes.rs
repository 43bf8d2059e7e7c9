//! Graph rewrites that need no GPU. Each pass is pure (`&Graph` in, new `Graph` out) and leaves
//! the graph in topological order with ids renumbered.
//!
//! A value marked as a graph output stays observable: a node read by an output is never absorbed
//! into another node (the output would lose its value), though it may absorb the nodes after it.

use crate::graph::{Activation, Binary, ConvAttrs, Gemm, GemmAct, Graph, HostTensor, NodeId, Norm, Op, Pool, ShapeOp, Unary};
use crate::{Error, Result};
use std::collections::BTreeSet;
use std::sync::Arc;

mod views;
pub use views::{attention_from_matmuls, collapse_view_chains, commute_reshape_permute, packed_attention_from_views, split_before_permute};

/// Every pass, in the order the engine builder wants them.
pub fn optimize(graph: &Graph) -> Result<Graph> {
    let start = std::time::Instant::now();
    let ops = |g: &Graph| g.nodes.iter().filter(|n| !n.op.is_leaf()).count();
    let step = |name: &str, g: Graph| {
        tracing::trace!(pass = name, ops = ops(&g), "optimise: pass done");
        g
    };
    let g = step("fold_batchnorm", fold_batchnorm(graph)?);
    let g = step("fold_conv_affine", fold_conv_affine(&g)?);
    // Imported forms of the bundled models' ops (issue 41, item 3; `views`): attention written
    // as matmuls, q/k/v split from a packed projection by views, view chains that cancel, a
    // conv's flatten → transpose, and tokens transposed and split into a conv's image.
    let g = step("attention_from_matmuls", attention_from_matmuls(&g)?);
    let g = step("packed_attention_from_views", packed_attention_from_views(&g)?);
    let g = step("collapse_view_chains", collapse_view_chains(&g)?);
    let g = step("commute_reshape_permute", commute_reshape_permute(&g)?);
    let g = step("split_before_permute", split_before_permute(&g)?);
    let g = step("fold_linear_scale", fold_linear_scale(&g)?);
    let g = step("fold_linear_shift", fold_linear_shift(&g)?);
    let g = step("fuse_conv_activation", fuse_conv_activation(&g)?);
    let g = step("fuse_linear_add", fuse_linear_add(&g)?);
    let g = step("fuse_conv_max_pool", fuse_conv_max_pool(&g)?);
    let g = remove_dead_nodes(&g)?;
    tracing::debug!(before = ops(graph), after = ops(&g), ms = start.elapsed().as_secs_f64() * 1e3, "optimise: folded and fused");
    Ok(g)
}

/// Conv2d / ConvTranspose2d read only by a BatchNorm2d → one conv with folded weights and bias.
///
/// The folded tensors get new names (`<conv path>.weight.folded`, `<conv path>.bias.folded`) so a
/// name never holds two values; the old ones are dropped when nothing else reads them.
pub fn fold_batchnorm(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let mut uses = g.use_counts();
    let mut removed = vec![false; g.nodes.len()];
    for bn in 0..g.nodes.len() {
        let Op::Norm(Norm::BatchNorm2d { eps }) = g.nodes[bn].op else { continue };
        let Some(&conv) = g.nodes[bn].inputs.first() else { continue };
        if uses[conv] != 1 {
            continue;
        }
        let Some((attrs, weight, bias)) = foldable_conv(&g, conv) else { continue };
        let bn_params: Option<Vec<&Arc<HostTensor>>> = g.nodes[bn].inputs[1..].iter().map(|&i| g.weight_data(i)).collect();
        let Some([gamma, beta, mean, var]) = bn_params.as_deref() else { continue };
        let (scale, shift) = crate::ops::norm::batch_norm_scale_shift(&gamma.data, &beta.data, &mean.data, &var.data, eps);
        let transposed = attrs.transposed;
        let (w, b) = fold_into_conv(&weight, bias.as_deref(), &scale, &shift, transposed, attrs.groups);

        let path = g.nodes[conv].path.clone();
        let w_name = fresh_weight_name(&g, &format!("{path}.weight.folded"));
        let w_id = g.weight(&w_name, Arc::new(w));
        let b_name = fresh_weight_name(&g, &format!("{path}.bias.folded"));
        let b_id = g.weight(&b_name, Arc::new(b));
        let x = g.nodes[conv].inputs[0];
        let node = &mut g.nodes[conv];
        node.inputs = vec![x, w_id, b_id];
        node.op = Op::Conv(ConvAttrs { bias: true, ..attrs });
        redirect(&mut g, bn, conv);
        uses[conv] = uses[bn];
        removed[bn] = true;
        g.nodes[bn].inputs.clear();
    }
    // The replaced weights and the BatchNorm parameters go unless something else reads them.
    let uses = g.use_counts();
    removed.resize(g.nodes.len(), false);
    rebuild(&g, |id, node| !removed[id] && (uses[id] > 0 || !matches!(node.op, Op::Weight { .. })))
}

/// Conv → Mul or Add of a constant per output channel (or one for all; `[C, 1, 1]`, `[1, C, 1,
/// 1]`, a scalar) → one conv with folded weights and bias, as a BatchNorm folds: a layer scale
/// after a conv (PoolFormer's and MetaFormer's MLPs as 1×1 convs, EfficientFormer), a shift written
/// as an add. The conv must be plain and read only by that node; chains (a mul, then an add) fold
/// one after the other. The folded tensors are `<conv path>.weight.folded`/`.bias.folded` (with a
/// suffix where the name is taken).
pub fn fold_conv_affine(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let mut uses = g.use_counts();
    let mut removed = vec![false; g.nodes.len()];
    for op in 0..g.nodes.len() {
        let binary = match g.nodes[op].op {
            Op::Binary(b @ (Binary::Mul | Binary::Add)) => b,
            _ => continue,
        };
        let [a, b] = g.nodes[op].inputs[..] else { continue };
        let is_conv = |id: NodeId| matches!(g.nodes[id].op, Op::Conv(_));
        let (conv, other) = match (is_conv(a), is_conv(b)) {
            (true, false) => (a, b),
            (false, true) => (b, a),
            _ => continue,
        };
        if uses[conv] != 1 || g.nodes[conv].shape != g.nodes[op].shape || g.nodes[op].shape.len() != 4 {
            continue;
        }
        let Some(constant) = g.weight_data(other).filter(|_| matches!(g.nodes[other].op, Op::Weight { quant: None, .. })).cloned() else {
            continue;
        };
        let Some(per_channel) = per_feature(&constant.shape, &constant.data, &g.nodes[op].shape, 1) else { continue };
        // A weight on an 8-bit grid (a model quantised in PyTorch) keeps its codes.
        if !matches!(g.nodes[g.nodes[conv].inputs[1]].op, Op::Weight { quant: None, .. }) {
            continue;
        }
        let Some((attrs, weight, bias)) = foldable_conv(&g, conv) else { continue };
        let (scale, shift) = match binary {
            Binary::Mul => (per_channel, vec![0.0; g.nodes[op].shape[1]]),
            _ => (vec![1.0; g.nodes[op].shape[1]], per_channel),
        };
        let (w, b) = fold_into_conv(&weight, bias.as_deref(), &scale, &shift, attrs.transposed, attrs.groups);
        if !scaled_weights_keep_fp16(&weight.data, &w.data) {
            continue;
        }
        let path = g.nodes[conv].path.clone();
        let w_name = fresh_weight_name(&g, &format!("{path}.weight.folded"));
        let w_id = g.weight(&w_name, Arc::new(w));
        let b_name = fresh_weight_name(&g, &format!("{path}.bias.folded"));
        let b_id = g.weight(&b_name, Arc::new(b));
        let x = g.nodes[conv].inputs[0];
        let node = &mut g.nodes[conv];
        node.inputs = vec![x, w_id, b_id];
        node.op = Op::Conv(ConvAttrs { bias: true, ..attrs });
        redirect(&mut g, op, conv);
        uses.resize(g.nodes.len(), 0);
        uses[conv] = uses[op];
        removed.resize(g.nodes.len(), false);
        removed[op] = true;
        g.nodes[op].inputs.clear();
    }
    let uses = g.use_counts();
    removed.resize(g.nodes.len(), false);
    rebuild(&g, |id, node| !removed[id] && (uses[id] > 0 || !matches!(node.op, Op::Weight { .. })))
}

/// Whether weights scaled by a fold (`before` → `after`, element by element) keep the precision an
/// FP16 engine stores them with: of the weights FP16 holds as normal numbers, no more than one in a
/// hundred may fall below 2^-16 (FP16's subnormals keep fewer than 9 bits there, and none below
/// 2^-24), and none may overflow. A scale that small stays a multiply after the layer, as PyTorch
/// runs it: DeiT-III's layer scale of 1e-6 folded into weights of about 0.02 would leave FP16
/// zeros, and its class token, which only such branches feed, would lose its answer.
fn scaled_weights_keep_fp16(before: &[f32], after: &[f32]) -> bool {
    const SMALLEST_NORMAL: f32 = 6.103_515_6e-5; // 2^-14
    const FEW_BITS: f32 = 1.525_878_9e-5; // 2^-16
    const LARGEST: f32 = 65504.0;
    let (mut normal, mut lost) = (0usize, 0usize);
    for (&b, &a) in before.iter().zip(after) {
        if b.abs() >= SMALLEST_NORMAL && b.abs() <= LARGEST {
            normal += 1;
            if a.abs() > LARGEST {
                return false;
            }
            lost += usize::from(a.abs() < FEW_BITS);
        }
    }
    lost.saturating_mul(100) <= normal
}

/// A conv whose output may be rescaled per output channel: plain (nothing fused yet) and with
/// constant weight and bias. Returns its attributes, weight and bias.
fn foldable_conv(g: &Graph, conv: NodeId) -> Option<(ConvAttrs, Arc<HostTensor>, Option<Arc<HostTensor>>)> {
    let node = &g.nodes[conv];
    let attrs = match node.op {
        Op::Conv(a) if !a.residual && a.act == Activation::None => a,
        _ => return None,
    };
    let weight = g.weight_data(*node.inputs.get(1)?)?.clone();
    // The shape rule of a transposed conv does not ask that its groups divide the input channels;
    // the fold needs it to find each weight row's group.
    if weight.shape.len() != 4 || attrs.groups == 0 || weight.shape[0] % attrs.groups != 0 {
        return None;
    }
    let bias = if attrs.bias { Some(g.weight_data(*node.inputs.get(2)?)?.clone()) } else { None };
    Some((attrs, weight, bias))
}

/// `bn(conv(x, w) + b)` = `conv(x, w·scale) + (b·scale + shift)`, scale and shift per output channel.
/// A Conv2d weight is [Cout, Cin/g, kh, kw]; a ConvTranspose2d weight is [Cin, Cout/g, kh, kw], whose
/// output channel is `group(ci)·Cout/g + j`.
fn fold_into_conv(
    weight: &HostTensor,
    bias: Option<&HostTensor>,
    scale: &[f32],
    shift: &[f32],
    transposed: bool,
    groups: usize,
) -> (HostTensor, HostTensor) {
    let s = &weight.shape;
    let kernel: usize = s[2..].iter().product();
    let mut w = weight.clone();
    for (row, chunk) in w.data.chunks_exact_mut(s[1] * kernel).enumerate() {
        if transposed {
            let cin_per_group = s[0] / groups;
            for (j, k) in chunk.chunks_exact_mut(kernel).enumerate() {
                let co = (row / cin_per_group) * s[1] + j;
                k.iter_mut().for_each(|v| *v *= scale[co]);
            }
        } else {
            chunk.iter_mut().for_each(|v| *v *= scale[row]);
        }
    }
    let b = (0..scale.len()).map(|co| bias.map_or(0.0, |b| b.data[co]) * scale[co] + shift[co]).collect();
    (w, HostTensor::new(vec![scale.len()], b))
}

/// Conv2d (+bias) → Add (the other operand becomes the residual) → ReLU becomes one Conv2d with
/// `residual: true, act: Relu`; also conv → ReLU and conv → Add alone, and ConvTranspose2d → ReLU
/// (CenterNet's upsampler; a transposed conv takes no residual). Each absorbed node must be read
/// only by the next one of the pattern (and not be an output). The fused node keeps the conv's
/// module path; the graph is re-sorted since the residual may be traced after the conv.
pub fn fuse_conv_activation(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let mut removed = vec![false; g.nodes.len()];
    // One fusion at a time, then re-read the users: a fusion changes who reads what.
    while let Some(conv) = next_fusable_conv(&g, &removed) {
        let users = readers(&g, &removed);
        let Op::Conv(mut attrs) = g.nodes[conv].op else { unreachable!("checked by next_fusable_conv") };
        let user = users[conv][0];
        let mut last = user;
        if matches!(g.nodes[user].op, Op::Binary(Binary::Add)) {
            let residual = g.nodes[user].inputs.iter().copied().find(|&i| i != conv).expect("the conv is read once by the add");
            attrs.residual = true;
            g.nodes[conv].inputs.push(residual);
            if g.use_counts()[user] == 1 {
                if let [relu] = users[user][..] {
                    if matches!(g.nodes[relu].op, Op::Unary(Unary::Relu)) {
                        attrs.act = Activation::Relu;
                        last = relu;
                        removed[user] = true;
                        g.nodes[user].inputs.clear();
                    }
                }
            }
        } else {
            attrs.act = Activation::Relu;
        }
        g.nodes[conv].op = Op::Conv(attrs);
        redirect(&mut g, last, conv);
        removed[last] = true;
        g.nodes[last].inputs.clear();
    }
    rebuild(&g, |id, _| !removed[id])
}

/// The first plain conv (no residual, no activation) whose value only a ReLU reads, or only an
/// Add if it is a Conv2d.
fn next_fusable_conv(g: &Graph, removed: &[bool]) -> Option<NodeId> {
    let users = readers(g, removed);
    let uses = g.use_counts();
    (0..g.nodes.len()).find(|&id| {
        let plain = |a: &ConvAttrs| !a.residual && a.act == Activation::None;
        let Some(&user) = users[id].first() else { return false };
        let pattern = match (&g.nodes[id].op, &g.nodes[user].op) {
            (Op::Conv(a), Op::Unary(Unary::Relu)) => plain(a),
            // add(conv, conv) reads the conv twice: there is no other operand to be the residual;
            // a broadcast operand (a bias-like `[C, 1, 1]`) is not a residual either.
            (Op::Conv(a), Op::Binary(Binary::Add)) => {
                let add = &g.nodes[user];
                plain(a)
                    && !a.transposed
                    && add.inputs.iter().filter(|&&i| i == id).count() == 1
                    && add.inputs.iter().all(|&i| g.nodes[i].shape == g.nodes[id].shape)
            }
            _ => false,
        };
        pattern && !removed[id] && uses[id] == 1 && users[id].len() == 1
    })
}

/// A plain Linear, maybe permuted, then a binary op with one other operand.
struct LinearThenBinary {
    linear: NodeId,
    permute: Option<NodeId>,
    /// The value the binary op reads: the permute, or the Linear.
    tail: NodeId,
    binary: NodeId,
    /// The binary op's other operand.
    other: NodeId,
}

/// A plain Linear (no residual; constant weight and bias) read only by a `op` node, or only by a
/// Permute read only by one, whose other operand is not the Linear (or its permute) too. Neither
/// the Linear nor the permute may be a graph output.
fn linear_then(g: &Graph, users: &[Vec<NodeId>], uses: &[usize], lin: NodeId, op: Binary) -> Option<LinearThenBinary> {
    let (linear, permute, binary) = linear_chain(g, users, uses, lin)?;
    let tail = permute.unwrap_or(linear);
    if g.nodes[binary].op != Op::Binary(op) {
        return None;
    }
    let [a, b] = g.nodes[binary].inputs[..] else { return None };
    if (a == tail) == (b == tail) {
        return None;
    }
    Some(LinearThenBinary { linear, permute, tail, binary, other: if a == tail { b } else { a } })
}

/// [`linear_then`] `op` where the other operand is a constant (not on an 8-bit grid) of one value
/// per output feature, or one for all, that does not widen the Linear's output: the pattern and
/// each feature's value.
fn linear_then_constant(g: &Graph, users: &[Vec<NodeId>], uses: &[usize], lin: NodeId, op: Binary) -> Option<(LinearThenBinary, Vec<f32>)> {
    let found = linear_then(g, users, uses, lin, op)?;
    if g.nodes[found.binary].shape != g.nodes[found.tail].shape || !matches!(g.nodes[found.other].op, Op::Weight { quant: None, .. }) {
        return None;
    }
    let constant = g.weight_data(found.other)?;
    let fdim = feature_dim(g, found.linear, found.permute)?;
    let values = per_feature(&constant.shape, &constant.data, &g.nodes[found.tail].shape, fdim)?;
    Some((found, values))
}

/// A plain Linear (no residual; constant weight and bias) read only by the next op, or only by
/// a Permute read only by the next op: `(linear, permute, next)`. Neither may be a graph output.
fn linear_chain(g: &Graph, users: &[Vec<NodeId>], uses: &[usize], lin: NodeId) -> Option<(NodeId, Option<NodeId>, NodeId)> {
    let node = &g.nodes[lin];
    let Op::Gemm(Gemm::Linear { bias, residual: false }) = node.op else { return None };
    let constant = |i: usize| node.inputs.get(i).is_some_and(|&w| matches!(g.nodes[w].op, Op::Weight { quant: None, .. }));
    if !constant(1) || (bias && !constant(2)) {
        return None;
    }
    let only_reader = |id: NodeId| match users[id][..] {
        [r] if uses[id] == 1 => Some(r),
        _ => None,
    };
    let next = only_reader(lin)?;
    if let Op::Shape(ShapeOp::Permute { .. }) = g.nodes[next].op {
        return Some((lin, Some(next), only_reader(next)?));
    }
    Some((lin, None, next))
}

/// The dim of `tail` (the Linear's output, or its permute) that holds the Linear's output
/// features: the last one, or where the permute moved it.
fn feature_dim(g: &Graph, lin: NodeId, permute: Option<NodeId>) -> Option<usize> {
    let last = g.nodes[lin].shape.len().checked_sub(1)?;
    match permute.map(|p| &g.nodes[p].op) {
        None => Some(last),
        Some(Op::Shape(ShapeOp::Permute { dims })) => dims.iter().position(|&d| d == last),
        Some(_) => None,
    }
}

/// Linear → (Permute →) Mul by a constant that scales each output feature (ConvNeXt's layer
/// scale, `[C, 1, 1]` after the permute back to NCHW; `[C]` or a scalar directly after the Linear)
/// → one Linear with its weight rows and bias scaled in f32, the Mul dropped (its readers read the
/// permute, or the Linear). The scaled tensors get new names (`<linear path>.weight.scaled`,
/// `<linear path>.bias.scaled`); the old ones go when nothing else reads them.
pub fn fold_linear_scale(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let mut removed = vec![false; g.nodes.len()];
    let users = g.readers();
    let uses = g.use_counts();
    for lin in 0..g.nodes.len() {
        let Some((LinearThenBinary { linear: lin, tail, binary: mul, .. }, factors)) =
            linear_then_constant(&g, &users, &uses, lin, Binary::Mul)
        else {
            continue;
        };
        let Op::Gemm(Gemm::Linear { bias, .. }) = g.nodes[lin].op else { unreachable!("checked by linear_chain") };
        let (Some(w), b) =
            (g.weight_data(g.nodes[lin].inputs[1]).cloned(), bias.then(|| g.weight_data(g.nodes[lin].inputs[2]).cloned()).flatten())
        else {
            continue;
        };
        let before = w;
        let mut w = before.as_ref().clone();
        let fin = w.shape[1];
        for (row, s) in w.data.chunks_exact_mut(fin.max(1)).zip(&factors) {
            row.iter_mut().for_each(|v| *v *= s);
        }
        if !scaled_weights_keep_fp16(&before.data, &w.data) {
            continue;
        }
        let path = g.nodes[lin].path.clone();
        let w_name = fresh_weight_name(&g, &format!("{path}.weight.scaled"));
        let w_id = g.weight(&w_name, Arc::new(w));
        g.nodes[lin].inputs[1] = w_id;
        if let Some(b) = b {
            let scaled = HostTensor::new(b.shape.clone(), b.data.iter().zip(&factors).map(|(v, s)| v * s).collect());
            let b_name = fresh_weight_name(&g, &format!("{path}.bias.scaled"));
            let b_id = g.weight(&b_name, Arc::new(scaled));
            g.nodes[lin].inputs[2] = b_id;
        }
        redirect(&mut g, mul, tail);
        removed.resize(g.nodes.len(), false);
        removed[mul] = true;
        g.nodes[mul].inputs.clear();
    }
    let uses = g.use_counts();
    removed.resize(g.nodes.len(), false);
    rebuild(&g, |id, node| !removed[id] && (uses[id] > 0 || !matches!(node.op, Op::Weight { .. })))
}

/// Linear → (Permute →) Add of a constant per output feature (or one for all) → one Linear whose
/// bias holds it, the Add dropped (its readers read the permute, or the Linear). This is a
/// BatchNorm1d after a Linear once `fold_linear_scale` took its scale (LeViT's `Linear →
/// BatchNorm1d` blocks, as kiln-torch imports them: mul then add), or a bias written as an add.
/// A Linear without a bias gets one. The new bias is `<linear path>.bias.shifted`.
pub fn fold_linear_shift(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let mut removed = vec![false; g.nodes.len()];
    let users = g.readers();
    let uses = g.use_counts();
    for lin in 0..g.nodes.len() {
        let Some((LinearThenBinary { linear: lin, tail, binary: add, .. }, shifts)) =
            linear_then_constant(&g, &users, &uses, lin, Binary::Add)
        else {
            continue;
        };
        let Op::Gemm(Gemm::Linear { bias, .. }) = g.nodes[lin].op else { unreachable!("checked by linear_chain") };
        let old = if bias {
            let Some(b) = g.weight_data(g.nodes[lin].inputs[2]).cloned() else { continue };
            b.data.clone()
        } else {
            vec![0.0; shifts.len()]
        };
        let path = g.nodes[lin].path.clone();
        let shifted = HostTensor::new(vec![shifts.len()], old.iter().zip(&shifts).map(|(b, t)| b + t).collect());
        let b_name = fresh_weight_name(&g, &format!("{path}.bias.shifted"));
        let b_id = g.weight(&b_name, Arc::new(shifted));
        if bias {
            g.nodes[lin].inputs[2] = b_id;
        } else {
            g.nodes[lin].op = Op::Gemm(Gemm::Linear { bias: true, residual: false });
            g.nodes[lin].inputs.push(b_id);
        }
        redirect(&mut g, add, tail);
        removed.resize(g.nodes.len(), false);
        removed[add] = true;
        g.nodes[add].inputs.clear();
    }
    let uses = g.use_counts();
    removed.resize(g.nodes.len(), false);
    rebuild(&g, |id, node| !removed[id] && (uses[id] > 0 || !matches!(node.op, Op::Weight { .. })))
}

/// The factor of each of `out[fdim]` features when a tensor of `shape` (values `data`) multiplies
/// one of shape `out`, or `None` unless it is one factor per feature (or one for all) that
/// broadcasts along every other dim and does not widen `out`.
fn per_feature(shape: &[usize], data: &[f32], out: &[usize], fdim: usize) -> Option<Vec<f32>> {
    let features = *out.get(fdim)?;
    let lead = out.len().checked_sub(shape.len())?;
    let mut per = false;
    for (i, &s) in shape.iter().enumerate() {
        match (lead + i == fdim, s) {
            (_, 1) => {}
            (true, s) if s == features => per = true,
            _ => return None,
        }
    }
    Some((0..features).map(|c| data[if per { c } else { 0 }]).collect())
}

/// Linear → Add of a tensor of the same shape (no broadcast) → one Linear with `residual: true`
/// and that tensor as its last input (cuBLASLt's C on the GPU); the Add's readers read the
/// Linear. Through a Permute as well (ConvNeXt's block: Linear over NHWC, permute back to NCHW,
/// add the block input): the other operand is permuted the other way into the Linear's layout
/// (a new Permute, `<linear path>.residual`; the engine aliases it where the operand is stored
/// channels-last) and the Add's readers read the permute back. The Linear and its permute must be
/// read only by the next node and not be outputs; the other operand may not be a constant, a graph
/// input or the Linear itself. The fused node keeps the Linear's module path.
pub fn fuse_linear_add(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let mut removed = vec![false; g.nodes.len()];
    let users = g.readers();
    let uses = g.use_counts();
    for lin in 0..g.nodes.len() {
        let Some(LinearThenBinary { linear: lin, permute, tail, binary: add, other }) = linear_then(&g, &users, &uses, lin, Binary::Add)
        else {
            continue;
        };
        let o = &g.nodes[other];
        if o.shape != g.nodes[tail].shape || o.dtype != g.nodes[lin].dtype || o.op.is_leaf() || g.inputs.contains(&other) {
            continue;
        }
        let residual = match permute.map(|p| &g.nodes[p].op) {
            Some(Op::Shape(ShapeOp::Permute { dims })) => {
                let mut inverse = vec![0; dims.len()];
                dims.iter().enumerate().for_each(|(i, &d)| inverse[d] = i);
                let path = format!("{}.residual", g.nodes[lin].path);
                g.push_unchecked(Op::Shape(ShapeOp::Permute { dims: inverse }), vec![other], g.nodes[lin].shape.clone(), path)
            }
            _ => other,
        };
        let Op::Gemm(Gemm::Linear { bias, .. }) = g.nodes[lin].op else { unreachable!("checked by linear_chain") };
        g.nodes[lin].op = Op::Gemm(Gemm::Linear { bias, residual: true });
        g.nodes[lin].inputs.push(residual);
        redirect(&mut g, add, tail);
        removed.resize(g.nodes.len(), false);
        removed[add] = true;
        g.nodes[add].inputs.clear();
    }
    removed.resize(g.nodes.len(), false);
    rebuild(&g, |id, _| !removed[id])
}

/// A plain Linear (no residual, constant weights, not fed by a fake-quantiser: 8-bit GEMMs have no
/// such epilogue) read only by a ReLU, GELU (erf or tanh) or SiLU → one `Gemm::LinearAct`: on
/// sm_90 the wgmma GEMM's epilogue applies it (cuBLASLt has no erf-GELU epilogue), elsewhere an
/// in-place kernel after cuBLASLt's GEMM; the CPU applies the same unary op, so outputs are
/// bit-identical to the unfused graph's. The fused node keeps the Linear's module path.
///
/// Not one of [`optimize`]'s passes: the builder runs it after them, for FP16 engines without
/// Q/DQ nodes only (`engine::prepare`), so the optimised graph that calibration caches are keyed
/// by and that quantisation rewrites (its Linears, `calibrate::quantizable`) stays as it was.
pub fn fuse_linear_activation(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let mut removed = vec![false; g.nodes.len()];
    let users = g.readers();
    let uses = g.use_counts();
    for lin in 0..g.nodes.len() {
        let Some((lin, None, next)) = linear_chain(&g, &users, &uses, lin) else { continue };
        let Op::Unary(op) = g.nodes[next].op else { continue };
        let Some(act) = GemmAct::of(op) else { continue };
        if matches!(g.nodes[g.nodes[lin].inputs[0]].op, Op::Quant(_)) {
            continue;
        }
        let Op::Gemm(Gemm::Linear { bias, .. }) = g.nodes[lin].op else { unreachable!("checked by linear_chain") };
        g.nodes[lin].op = Op::Gemm(Gemm::LinearAct { bias, act });
        redirect(&mut g, next, lin);
        removed[next] = true;
        g.nodes[next].inputs.clear();
    }
    rebuild(&g, |id, _| !removed[id])
}

/// Conv2d with ReLU read only by a MaxPool2d → one conv carrying the pool (`ConvAttrs::pool`), so
/// the ResNet stem can run as one kernel that never writes the conv's output (ops::conv::stem). Runs
/// after `fuse_conv_activation`: the ReLU is already part of the conv.
pub fn fuse_conv_max_pool(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let mut removed = vec![false; g.nodes.len()];
    let users = readers(&g, &removed);
    let uses = g.use_counts();
    for conv in 0..g.nodes.len() {
        let Op::Conv(attrs) = g.nodes[conv].op else { continue };
        let fusable = !attrs.transposed && attrs.act == Activation::Relu && attrs.pool.is_none();
        let [pool] = users[conv][..] else { continue };
        let Op::Pool(Pool::Max(p)) = g.nodes[pool].op else { continue };
        if !fusable || uses[conv] != 1 || removed[pool] {
            continue;
        }
        g.nodes[conv].op = Op::Conv(ConvAttrs { pool: Some(p), ..attrs });
        g.nodes[conv].shape = g.nodes[pool].shape.clone();
        redirect(&mut g, pool, conv);
        removed[pool] = true;
        g.nodes[pool].inputs.clear();
    }
    rebuild(&g, |id, _| !removed[id])
}

/// Removes nodes and weights that no output depends on; graph inputs always stay (they are the
/// graph's bindings), ids are renumbered and outputs and inputs remapped.
pub fn remove_dead_nodes(graph: &Graph) -> Result<Graph> {
    let mut live = vec![false; graph.nodes.len()];
    let mut stack: Vec<NodeId> = graph.outputs.iter().map(|(_, id)| *id).chain(graph.inputs.iter().copied()).collect();
    while let Some(id) = stack.pop() {
        if !std::mem::replace(&mut live[id], true) {
            stack.extend(&graph.nodes[id].inputs);
        }
    }
    rebuild(graph, |id, _| live[id])
}

/// Who reads each node, once per read, among nodes not removed (outputs not included).
fn readers(g: &Graph, removed: &[bool]) -> Vec<Vec<NodeId>> {
    let mut users = g.readers();
    users.iter_mut().for_each(|u| u.retain(|&r| !removed[r]));
    users
}

/// Makes every reader of `from` (nodes and outputs) read `to` instead.
fn redirect(g: &mut Graph, from: NodeId, to: NodeId) {
    for n in &mut g.nodes {
        n.inputs.iter_mut().filter(|i| **i == from).for_each(|i| *i = to);
    }
    g.outputs.iter_mut().filter(|(_, o)| *o == from).for_each(|(_, o)| *o = to);
}

/// `base`, or `base.1`, `base.2`... if the graph already holds a weight of that name.
fn fresh_weight_name(g: &Graph, base: &str) -> String {
    let taken =
        |name: &str| g.weights.contains_key(name) || g.nodes.iter().any(|n| matches!(&n.op, Op::Weight { name: w, .. } if w == name));
    if !taken(base) {
        return base.to_string();
    }
    (1..).map(|i| format!("{base}.{i}")).find(|n| !taken(n)).expect("some suffix is free")
}

/// A stable topological order of the nodes `keep` selects: each node stays where it was unless it
/// reads a node placed after it, which is then pulled in just before it (depth first, in input
/// order). A kept node reading a dropped one, or a cycle, is an error naming the node.
pub fn topological_order(g: &Graph, keep: &[bool]) -> Result<Vec<NodeId>> {
    #[derive(Clone, Copy, PartialEq)]
    enum State {
        New,
        Open,
        Done,
    }
    let mut state = vec![State::New; g.nodes.len()];
    let mut order = Vec::with_capacity(g.nodes.len());
    for root in (0..g.nodes.len()).filter(|&i| keep[i]) {
        if state[root] != State::New {
            continue;
        }
        state[root] = State::Open;
        let mut stack = vec![(root, 0usize)];
        while let Some((id, next)) = stack.last_mut() {
            let id = *id;
            let Some(&input) = g.nodes[id].inputs.get(*next) else {
                state[id] = State::Done;
                order.push(id);
                stack.pop();
                continue;
            };
            *next += 1;
            let node = &g.nodes[id];
            if !keep[input] {
                return Err(Error::InvalidGraph {
                    node: id,
                    path: node.path.clone(),
                    reason: format!("{} reads %{input}, which a pass removed", node.op.name()),
                });
            }
            match state[input] {
                State::New => {
                    state[input] = State::Open;
                    stack.push((input, 0));
                }
                State::Open => {
                    return Err(Error::InvalidGraph {
                        node: id,
                        path: node.path.clone(),
                        reason: format!("{} is part of a cycle", node.op.name()),
                    })
                }
                State::Done => {}
            }
        }
    }
    Ok(order)
}

/// The graph of the nodes `keep` selects, topologically sorted and renumbered, with the weights
/// its weight nodes name. Outputs must point at kept nodes.
fn rebuild(g: &Graph, keep: impl Fn(NodeId, &crate::graph::Node) -> bool) -> Result<Graph> {
    let mut keep: Vec<bool> = g.nodes.iter().enumerate().map(|(id, n)| keep(id, n)).collect();
    for &i in &g.inputs {
        keep[i] = true;
    }
    let order = topological_order(g, &keep)?;
    let mut new_id = vec![usize::MAX; g.nodes.len()];
    for (new, &old) in order.iter().enumerate() {
        new_id[old] = new;
    }
    let mut out = Graph::default();
    let mut weight_names = BTreeSet::new();
    for &old in &order {
        let mut node = g.nodes[old].clone();
        node.inputs.iter_mut().for_each(|i| *i = new_id[*i]);
        if let Op::Weight { name, .. } = &node.op {
            weight_names.insert(name.clone());
        }
        out.nodes.push(node);
    }
    out.inputs = g.inputs.iter().map(|&i| new_id[i]).collect();
    out.fp32_layers = g.fp32_layers.clone();
    for (name, id) in &g.outputs {
        if !keep[*id] {
            return Err(Error::Binding { name: name.clone(), reason: format!("the output reads %{id}, which a pass removed") });
        }
        out.outputs.push((name.clone(), new_id[*id]));
    }
    out.weights = g.weights.iter().filter(|(k, _)| weight_names.contains(*k)).map(|(k, v)| (k.clone(), v.clone())).collect();
    Ok(out)
}
