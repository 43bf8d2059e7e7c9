//! Fusion by pattern: rewrites that recognise the maths of an imported graph, whatever sequence of
//! reshapes, permutes and slices it was written with (issue 41, item 3).
//!
//! A chain of `reshape`/`flatten`/`permute`/`slice` nodes reads its source's elements without
//! computing anything: it is a strided view of the source (an offset and a stride per dim, in
//! elements of one image of the source, which is contiguous in PyTorch's order). Two chains that
//! give the same view are the same tensor, so the passes compare views, not op sequences:
//! - [`attention_from_matmuls`]: `matmul(softmax(scale·matmul(q, kᵀ) + bias), v)` → `attention`;
//! - [`packed_attention_from_views`]: an `attention` whose q, k and v are the three thirds of one
//!   packed projection `[.., L, 3·H·D]` (heads `D` apart, rows `3·H·D` apart) → `qkv_attention`
//!   on that projection, its output viewed back as `[.., H, L, D]`;
//! - [`collapse_view_chains`]: a chain of reshapes and permutes whose view is contiguous is one
//!   reshape of its source, or the source itself (chains that cancel);
//! - [`commute_reshape_permute`]: a reshape that merges dims then a permute of the merged groups
//!   → the permute first, then the reshape, where the source is stored in the permuted order (a
//!   conv's channels-last output: ViT's `flatten(2).transpose(1, 2)` patch embedding), so the
//!   engine's reshape reads the conv's bytes in place instead of a copy to NCHW;
//! - [`split_before_permute`]: a permute then a reshape that splits the permuted dims → the
//!   split first, then the permute, where the source is stored contiguously (a Linear's tokens:
//!   SegFormer's `x.transpose(1, 2).reshape(n, c, h, w)` before its convs), so the conv reads the
//!   tokens as its channels-last image instead of a copy to NCHW and a reformat back.

use super::{redirect, remove_dead_nodes};
use crate::graph::{Binary, Gemm, Graph, NodeId, Norm, Op, ShapeOp, Unary};
use crate::ops::attention::{qkv_attention_shape, Attention, QkvAttention};
use crate::ops::shape::contiguous_strides;
use crate::Result;

/// A strided view of one image of a source tensor stored contiguously: element `i` of the view
/// (one index per dim) is element `offset + Σ i_d·stride_d` of the source.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct View {
    pub offset: usize,
    pub sizes: Vec<usize>,
    pub strides: Vec<usize>,
}

impl View {
    /// The whole source, of per-image dims `sizes`.
    pub fn of(sizes: &[usize]) -> Self {
        Self { offset: 0, sizes: sizes.to_vec(), strides: contiguous_strides(sizes) }
    }
    /// Equal element by element: same sizes, offset, and strides wherever a dim has more than one
    /// element.
    pub fn same(&self, other: &View) -> bool {
        self.sizes == other.sizes
            && self.offset == other.offset
            && self.sizes.iter().zip(self.strides.iter().zip(&other.strides)).all(|(&n, (a, b))| n <= 1 || a == b)
    }
    /// Whether the view is its source's first `numel` elements in order (a reshape of it).
    pub fn is_contiguous(&self) -> bool {
        self.same(&View { offset: 0, sizes: self.sizes.clone(), strides: contiguous_strides(&self.sizes) })
    }
    /// `x.permute(dims)` over the per-image dims.
    pub fn permute(&self, dims: &[usize]) -> Option<View> {
        if dims.len() != self.sizes.len() {
            return None;
        }
        let pick = |v: &[usize]| dims.iter().map(|&d| v.get(d).copied()).collect::<Option<Vec<_>>>();
        Some(View { offset: self.offset, sizes: pick(&self.sizes)?, strides: pick(&self.strides)? })
    }
    /// `x.narrow(dim, start, len)` over the per-image dims.
    pub fn slice(&self, dim: usize, start: usize, len: usize) -> Option<View> {
        let n = *self.sizes.get(dim)?;
        if start.checked_add(len)? > n {
            return None;
        }
        let mut v = self.clone();
        v.offset += start * v.strides[dim];
        v.sizes[dim] = len;
        Some(v)
    }
    /// `x.view(sizes)`: `None` where PyTorch's `view` would need a copy (ATen's `computeStride`).
    pub fn reshape(&self, sizes: &[usize]) -> Option<View> {
        let numel: usize = self.sizes.iter().product();
        if sizes.iter().product::<usize>() != numel {
            return None;
        }
        if numel == 0 || self.sizes.is_empty() {
            return Some(View { offset: self.offset, sizes: sizes.to_vec(), strides: contiguous_strides(sizes) });
        }
        let (old, old_stride) = (&self.sizes, &self.strides);
        let mut strides = vec![0; sizes.len()];
        let mut view_d = sizes.len() as isize - 1;
        let mut chunk_base = *old_stride.last().expect("not empty");
        let (mut tensor_numel, mut view_numel) = (1usize, 1usize);
        for d in (0..old.len()).rev() {
            tensor_numel *= old[d];
            if d == 0 || (old[d - 1] != 1 && old_stride[d - 1] != tensor_numel * chunk_base) {
                while view_d >= 0 && (view_numel < tensor_numel || sizes[view_d as usize] == 1) {
                    strides[view_d as usize] = view_numel * chunk_base;
                    view_numel *= sizes[view_d as usize];
                    view_d -= 1;
                }
                if view_numel != tensor_numel {
                    return None;
                }
                if d > 0 {
                    chunk_base = old_stride[d - 1];
                    tensor_numel = 1;
                    view_numel = 1;
                }
            }
        }
        (view_d == -1).then(|| View { offset: self.offset, sizes: sizes.to_vec(), strides })
    }
}

/// The source of `id` through a chain of view ops (reshape, flatten, permute, and slice when
/// `slices`) and the view of it that `id` is, with the chain's length. A node that is no view op
/// is its own source (length 0).
pub(crate) fn chain_view(g: &Graph, id: NodeId, slices: bool) -> Option<(NodeId, View, usize)> {
    let mut chain = Vec::new();
    let mut src = id;
    loop {
        match &g.nodes[src].op {
            Op::Shape(ShapeOp::Reshape { .. } | ShapeOp::Flatten { .. } | ShapeOp::Permute { .. }) => {}
            Op::Shape(ShapeOp::Slice { .. }) if slices => {}
            _ => break,
        }
        chain.push(src);
        src = *g.nodes[src].inputs.first()?;
    }
    let mut view = View::of(g.nodes[src].shape.get(1..)?);
    for &n in chain.iter().rev() {
        let node = &g.nodes[n];
        view = match &node.op {
            Op::Shape(ShapeOp::Reshape { .. } | ShapeOp::Flatten { .. }) => view.reshape(node.shape.get(1..)?)?,
            Op::Shape(ShapeOp::Permute { dims }) if dims.first() == Some(&0) => {
                view.permute(&dims[1..].iter().map(|&d| d.checked_sub(1)).collect::<Option<Vec<_>>>()?)?
            }
            Op::Shape(ShapeOp::Slice { dim, start, len }) => view.slice(dim.checked_sub(1)?, *start, *len)?,
            _ => return None,
        };
    }
    Some((src, view, chain.len()))
}

/// The scalar a value is multiplied by: `x * s` (an affine without shift) or `x * c`, `c * x` with
/// `c` a one-element constant. Returns `(x, s)`.
fn scaled(g: &Graph, id: NodeId) -> Option<(NodeId, f32)> {
    let node = &g.nodes[id];
    match node.op {
        Op::Unary(Unary::Affine { scale, shift: 0.0 }) => Some((node.inputs[0], scale)),
        Op::Binary(Binary::Mul) => {
            let [a, b] = node.inputs[..] else { return None };
            let scalar = |c: NodeId| g.weight_data(c).filter(|t| t.data.len() == 1).map(|t| t.data[0]);
            match (scalar(a), scalar(b)) {
                (None, Some(s)) if g.nodes[a].shape == node.shape => Some((a, s)),
                (Some(s), None) if g.nodes[b].shape == node.shape => Some((b, s)),
                _ => None,
            }
        }
        _ => None,
    }
}

/// `matmul(softmax(z, last dim), v)` where `z` is `matmul(q, kᵀ)`, maybe scaled (before the
/// product, on `q`, or after it) and maybe plus a bias, `kᵀ` being a permute that swaps the last
/// two dims of `k` → one `attention` node (q, k, v, bias), which keeps the second matmul's module
/// path. Every absorbed node must be read only by the next one of the pattern and not be an output.
pub fn attention_from_matmuls(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let uses = g.use_counts();
    let single = |id: NodeId| uses[id] == 1;
    for out in 0..g.nodes.len() {
        if g.nodes[out].op != Op::Gemm(Gemm::Matmul) {
            continue;
        }
        let [p, v] = g.nodes[out].inputs[..] else { continue };
        let rank = g.nodes[p].shape.len();
        if g.nodes[p].op != Op::Norm(Norm::Softmax { dim: rank - 1 }) || !single(p) || rank < 3 {
            continue;
        }
        let mut z = g.nodes[p].inputs[0];
        let mut bias = None;
        if g.nodes[z].op == Op::Binary(Binary::Add) && single(z) {
            let [a, b] = g.nodes[z].inputs[..] else { continue };
            let score = |id: NodeId| matches!(g.nodes[id].op, Op::Gemm(Gemm::Matmul) | Op::Unary(_) | Op::Binary(Binary::Mul));
            let (s, other) = if score(a) && g.nodes[a].shape == g.nodes[z].shape { (a, b) } else { (b, a) };
            if s == other || g.nodes[s].shape != g.nodes[z].shape {
                continue;
            }
            bias = Some(other);
            z = s;
        }
        let mut scale = 1.0f32;
        if let Some((x, s)) = scaled(&g, z).filter(|_| single(z)) {
            scale *= s;
            z = x;
        }
        if g.nodes[z].op != Op::Gemm(Gemm::Matmul) || !single(z) {
            continue;
        }
        let [mut q, kt] = g.nodes[z].inputs[..] else { continue };
        if let Some((x, s)) = scaled(&g, q).filter(|_| single(q)) {
            scale *= s;
            q = x;
        }
        let r = g.nodes[kt].shape.len();
        let swaps_last_two = match &g.nodes[kt].op {
            Op::Shape(ShapeOp::Permute { dims }) => {
                r >= 3 && dims.len() == r && dims[..r - 2].iter().enumerate().all(|(i, &d)| i == d) && dims[r - 2..] == [r - 1, r - 2]
            }
            _ => false,
        };
        if !swaps_last_two {
            continue;
        }
        let k = g.nodes[kt].inputs[0];
        let op = Op::Attention(Attention { scale, bias: bias.is_some() });
        let inputs: Vec<NodeId> = [q, k, v].into_iter().chain(bias).collect();
        let shapes: Vec<&[usize]> = inputs.iter().map(|&i| g.nodes[i].shape.as_slice()).collect();
        if op.infer_shape(&shapes).ok().as_ref() != Some(&g.nodes[out].shape) {
            continue;
        }
        g.nodes[out].op = op;
        g.nodes[out].inputs = inputs;
    }
    remove_dead_nodes(&g)
}

/// `attention(q, k, v)` (self-attention: q, k and v of one shape `[N, G..., H, L, D]`) whose q, k
/// and v are views of one tensor that, seen as `[N, G..., L, 3·H·D]`, holds q, k and v side by side
/// with each head's `D` values together (`nn.MultiheadAttention`'s and Swin's `qkv` Linear, split
/// by any reshape/permute/slice chain) → `qkv_attention` on that tensor (reshaped to it when its
/// dims differ), its `[N, G..., L, H·D]` output reshaped and permuted back to the attention's
/// `[N, G..., H, L, D]` (which [`collapse_view_chains`] then cancels against the chain that joins
/// the heads). A bias must broadcast to `[1, G..., H, L, L]` (`qkv_attention`'s rule).
pub fn packed_attention_from_views(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    for a in 0..g.nodes.len() {
        let Op::Attention(Attention { scale, bias }) = g.nodes[a].op else { continue };
        let ins = g.nodes[a].inputs.clone();
        let shape = g.nodes[ins[0]].shape.clone();
        let r = shape.len();
        if r < 3 || ins[..3].iter().any(|&i| g.nodes[i].shape != shape) || g.nodes[a].shape != shape {
            continue;
        }
        let Some(views) = ins[..3].iter().map(|&i| chain_view(&g, i, true)).collect::<Option<Vec<_>>>() else { continue };
        let src = views[0].0;
        if views.iter().any(|(s, _, _)| *s != src) {
            continue;
        }
        // Per image: [G..., H, L, D] (H = 1 where q has no dim before L).
        let per = &shape[1..];
        let (l, d) = (per[per.len() - 2], per[per.len() - 1]);
        let (groups, heads) = match per.len() {
            2 => (&per[..0], 1),
            n => (&per[..n - 3], per[n - 3]),
        };
        let packed: Vec<usize> = groups.iter().copied().chain([l, 3 * heads * d]).collect();
        if g.nodes[src].shape[1..].iter().product::<usize>() != packed.iter().product::<usize>() {
            continue;
        }
        let st = contiguous_strides(&packed);
        let gs = groups.len();
        let want = |third: usize| {
            let mut sizes: Vec<usize> = groups.to_vec();
            let mut strides: Vec<usize> = st[..gs].to_vec();
            if per.len() > 2 {
                sizes.push(heads);
                strides.push(d);
            }
            sizes.extend([l, d]);
            strides.extend([3 * heads * d, 1]);
            View { offset: third * heads * d, sizes, strides }
        };
        if !(0..3).all(|t| views[t].1.same(&want(t))) {
            continue;
        }
        let n = shape[0];
        let full: Vec<usize> = [n].into_iter().chain(packed.iter().copied()).collect();
        let bias_shape = bias.then(|| g.nodes[ins[3]].shape.clone());
        let mut check: Vec<&[usize]> = vec![&full];
        check.extend(bias_shape.as_deref());
        let Ok(out_shape) = qkv_attention_shape(heads, bias, &check) else { continue };
        let path = g.nodes[a].path.clone();
        let qkv = if g.nodes[src].shape == full {
            src
        } else {
            g.push_unchecked(Op::Shape(ShapeOp::Reshape { dims: packed.clone() }), vec![src], full.clone(), format!("{path}.qkv"))
        };
        let mut inputs = vec![qkv];
        inputs.extend(bias.then(|| ins[3]));
        let y = g.push_unchecked(Op::QkvAttention(QkvAttention { heads, scale, bias }), inputs, out_shape, path.clone());
        // [N, G..., L, H, D] → [N, G..., H, L, D].
        let split: Vec<usize> = [n].into_iter().chain(groups.iter().copied()).chain([l, heads, d]).collect();
        let y = g.push_unchecked(Op::Shape(ShapeOp::Reshape { dims: split[1..].to_vec() }), vec![y], split, format!("{path}.heads"));
        let mut dims: Vec<usize> = (0..=gs).collect();
        dims.extend([gs + 2, gs + 1, gs + 3]);
        let y = g.push_unchecked(Op::Shape(ShapeOp::Permute { dims }), vec![y], shape.clone(), format!("{path}.heads"));
        redirect(&mut g, a, y);
        g.nodes[a].inputs.clear();
    }
    let g = super::rebuild(&g, |_, _| true)?;
    remove_dead_nodes(&g)
}

/// A chain of reshapes, flattens and permutes whose view of its source is contiguous (the
/// permutes cancel, or move only dims of size 1) → one reshape of the source, or the source itself
/// where the shapes are equal (and the chain's end is not a graph output). A single reshape of a
/// computed value stays as it is.
pub fn collapse_view_chains(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let outputs: Vec<NodeId> = g.outputs.iter().map(|(_, o)| *o).collect();
    for v in 0..g.nodes.len() {
        if !matches!(g.nodes[v].op, Op::Shape(ShapeOp::Reshape { .. } | ShapeOp::Flatten { .. } | ShapeOp::Permute { .. })) {
            continue;
        }
        let Some((src, view, len)) = chain_view(&g, v, false) else { continue };
        if !view.is_contiguous() {
            continue;
        }
        if g.nodes[src].shape == g.nodes[v].shape && !outputs.contains(&v) {
            redirect(&mut g, v, src);
        } else if len >= 2 || matches!(g.nodes[v].op, Op::Shape(ShapeOp::Permute { .. })) {
            let dims = g.nodes[v].shape[1..].to_vec();
            g.nodes[v].op = Op::Shape(ShapeOp::Reshape { dims });
            g.nodes[v].inputs = vec![src];
        }
    }
    remove_dead_nodes(&g)
}

/// A reshape (or flatten) that only merges runs of its input's dims, read only by a permute of
/// those runs → the permute of the input's dims (each run's dims kept together, in the permute's
/// order), then a reshape to the permute's shape, where the input's producer stores its output in
/// exactly that permuted order (its `OpDef::layouts`: a conv's channels-last image). The engine's
/// permute is then an alias of the stored bytes and its reshape needs no copy; before, the reshape
/// wanted PyTorch's order and the engine copied the conv's output to NCHW. The new permute takes
/// the old permute's module path; the reshape keeps its own.
pub fn commute_reshape_permute(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let users = g.readers();
    let uses = g.use_counts();
    for r in 0..g.nodes.len() {
        if !matches!(g.nodes[r].op, Op::Shape(ShapeOp::Reshape { .. } | ShapeOp::Flatten { .. })) || uses[r] != 1 {
            continue;
        }
        let [p] = users[r][..] else { continue };
        let Op::Shape(ShapeOp::Permute { dims }) = &g.nodes[p].op else { continue };
        let x = g.nodes[r].inputs[0];
        let (xs, ys) = (&g.nodes[x].shape[1..], &g.nodes[r].shape[1..]);
        if xs.contains(&1) || ys.contains(&1) || dims.first() != Some(&0) {
            continue;
        }
        // The run of input dims each output dim merges.
        let Some(runs) = runs_of(xs, ys) else { continue };
        let order: Vec<usize> = dims[1..].iter().flat_map(|&d| runs[d - 1].iter().copied()).collect();
        if order.windows(2).all(|w| w[0] < w[1]) {
            continue;
        }
        let Some(def) = g.nodes[x].op.def() else { continue };
        let stored = def.layouts(&vec![None; g.nodes[x].inputs.len()], xs.len()).output.order();
        if stored != order {
            continue;
        }
        let mut full = vec![0];
        full.extend(order.iter().map(|&d| d + 1));
        let shape: Vec<usize> = full.iter().map(|&d| g.nodes[x].shape[d]).collect();
        let path = g.nodes[p].path.clone();
        let permuted = g.push_unchecked(Op::Shape(ShapeOp::Permute { dims: full }), vec![x], shape, path);
        let out = g.nodes[p].shape.clone();
        g.nodes[r].op = Op::Shape(ShapeOp::Reshape { dims: out[1..].to_vec() });
        g.nodes[r].inputs = vec![permuted];
        g.nodes[r].shape = out;
        redirect(&mut g, p, r);
        g.nodes[p].inputs.clear();
    }
    let g = super::rebuild(&g, |_, _| true)?;
    remove_dead_nodes(&g)
}

/// The dims of `fine` (their indices) that each dim of `coarse` is the product of, in order, or
/// `None` unless `coarse` only merges runs of `fine`'s dims (every dim used once, none split).
fn runs_of(fine: &[usize], coarse: &[usize]) -> Option<Vec<Vec<usize>>> {
    let mut runs = Vec::with_capacity(coarse.len());
    let mut i = 0;
    for &size in coarse {
        let mut run = Vec::new();
        let mut prod = 1;
        while prod < size && i < fine.len() {
            prod *= fine[i];
            run.push(i);
            i += 1;
        }
        if prod != size {
            return None;
        }
        runs.push(run);
    }
    (i == fine.len()).then_some(runs)
}

/// A permute read only by a reshape that splits its dims (each permuted dim into a run of the
/// reshape's dims) → the reshape of the permute's input (each of its dims split as its permuted
/// dim is), then the permute of the runs, where the input's producer stores its output
/// contiguously (`OpDef::layouts`: a Linear's or a LayerNorm's tokens). The reshape is then an
/// alias of those bytes, and the permute an alias in the layout they already have, which a
/// channels-last reader (a conv) takes as it is. Before, the reshape wanted its input contiguous,
/// so the engine copied the permuted tokens to NCHW, and the conv's input reformat copied them
/// back to NHWC. The new reshape takes the old reshape's module path, the permute its own.
pub fn split_before_permute(graph: &Graph) -> Result<Graph> {
    let mut g = graph.clone();
    let users = g.readers();
    for (p, readers) in users.iter().enumerate() {
        let Op::Shape(ShapeOp::Permute { dims }) = &g.nodes[p].op else { continue };
        let dims = dims.clone();
        let [r] = readers[..] else { continue };
        if !matches!(g.nodes[r].op, Op::Shape(ShapeOp::Reshape { .. })) || dims.first() != Some(&0) {
            continue;
        }
        let x = g.nodes[p].inputs[0];
        let (ps, ys) = (g.nodes[p].shape[1..].to_vec(), g.nodes[r].shape[1..].to_vec());
        if ps.contains(&1) || ys.contains(&1) {
            continue;
        }
        // The run of reshape dims each permuted dim splits into (their sizes).
        let Some(runs) = runs_of(&ys, &ps) else { continue };
        let runs: Vec<Vec<usize>> = runs.iter().map(|run| run.iter().map(|&k| ys[k]).collect()).collect();
        if runs.iter().all(|run| run.len() == 1) {
            continue;
        }
        let Some(def) = g.nodes[x].op.def() else { continue };
        let stored = def.layouts(&vec![None; g.nodes[x].inputs.len()], ps.len()).output.order();
        if stored.windows(2).any(|w| w[0] > w[1]) {
            continue;
        }
        // Permuted dim j is the input's dim q[j]; the input's dim d is split as its permuted dim.
        let q: Vec<usize> = dims[1..].iter().map(|&d| d - 1).collect();
        let mut of_input = vec![0; q.len()];
        for (j, &d) in q.iter().enumerate() {
            of_input[d] = j;
        }
        let split: Vec<usize> = of_input.iter().flat_map(|&j| runs[j].iter().copied()).collect();
        let mut start = vec![0; q.len()];
        for d in 1..q.len() {
            start[d] = start[d - 1] + runs[of_input[d - 1]].len();
        }
        let mut full = vec![0];
        full.extend(q.iter().enumerate().flat_map(|(j, &d)| (start[d]..start[d] + runs[j].len()).map(|k| k + 1)));
        let mut shape = vec![g.nodes[x].shape[0]];
        shape.extend(&split);
        let (reshape_path, permute_path) = (g.nodes[r].path.clone(), g.nodes[p].path.clone());
        let reshaped = g.push_unchecked(Op::Shape(ShapeOp::Reshape { dims: split }), vec![x], shape, reshape_path);
        let out = g.nodes[r].shape.clone();
        let permuted = g.push_unchecked(Op::Shape(ShapeOp::Permute { dims: full }), vec![reshaped], out, permute_path);
        redirect(&mut g, r, permuted);
        g.nodes[r].inputs.clear();
        g.nodes[p].inputs.clear();
    }
    let g = super::rebuild(&g, |_, _| true)?;
    remove_dead_nodes(&g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::HostTensor;
    use crate::{Module, Tracer, VarBuilder};
    use std::collections::BTreeMap;

    fn count(g: &Graph, op: &str) -> usize {
        g.nodes.iter().filter(|n| n.op.name() == op).count()
    }

    /// Runs both graphs on the same seeded inputs (at `batch`) and asserts every output within
    /// 1e-5 rel L2, printing it.
    fn same_outputs(before: &Graph, after: &Graph, batch: usize, what: &str) {
        let inputs: Vec<(String, HostTensor)> = before
            .inputs
            .iter()
            .map(|&i| {
                let mut shape = before.nodes[i].shape.clone();
                shape[0] = batch;
                let name = before.input_names()[before.inputs.iter().position(|&j| j == i).expect("input")].to_string();
                (name, crate::seeded::uniform_tensor(&shape, crate::seeded::fresh_seed()))
            })
            .collect();
        let refs: Vec<(&str, &HostTensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let a: BTreeMap<String, HostTensor> = crate::run_cpu(before, &refs).expect("cpu before");
        let b: BTreeMap<String, HostTensor> = crate::run_cpu(after, &refs).expect("cpu after");
        for (name, r) in &a {
            let c = crate::compare(name, &b[name], r);
            println!("{what}: output {name} at batch {batch}: rel L2 {:.2e} (max abs {:.2e})", c.rel_l2, c.max_abs);
            assert!(c.rel_l2 <= 1e-5, "{what}: {name} rel L2 {}", c.rel_l2);
        }
    }

    #[test]
    fn views_follow_pytorch_view_rules() {
        let v = View::of(&[5, 24]);
        let split = v.reshape(&[5, 3, 2, 4]).expect("split");
        assert_eq!(split.strides, [24, 8, 4, 1]);
        let p = split.permute(&[1, 2, 0, 3]).expect("permute");
        assert_eq!((p.sizes.clone(), p.strides.clone()), (vec![3, 2, 5, 4], vec![8, 4, 24, 1]));
        let k = p.slice(0, 1, 1).expect("slice").reshape(&[2, 5, 4]).expect("drop the 1");
        assert_eq!((k.offset, k.strides.clone()), (8, vec![4, 24, 1]));
        // Merging dims that are not adjacent in memory needs a copy: not a view.
        assert_eq!(p.reshape(&[6, 20]), None);
        assert!(View::of(&[2, 3]).permute(&[1, 0]).expect("t").permute(&[1, 0]).expect("tt").is_contiguous());
        assert!(View::of(&[1, 6]).permute(&[1, 0]).expect("size-1 move").is_contiguous());
    }

    /// Swin's attention as another library writes it: `(q * scale) @ k.transpose(-2, -1) + bias`,
    /// softmax, `@ v`.
    #[test]
    fn matmul_softmax_matmul_becomes_one_attention() {
        let t = Tracer::new();
        let (q, k, v) = (t.input("q", &[1, 3, 5, 8]), t.input("k", &[1, 3, 5, 8]), t.input("v", &[1, 3, 5, 8]));
        let bias = t.input("bias", &[1, 3, 5, 5]);
        let s = q.affine(0.35, 0.0).and_then(|q| q.matmul(&k.transpose(-2, -1)?)).expect("scores");
        let y = (&s + &bias).and_then(|z| z.softmax(-1)).and_then(|p| p.matmul(&v)).expect("trace");
        // The scale after the product instead, and no bias.
        let s2 = q.matmul(&k.transpose(-1, -2).expect("t")).and_then(|s| s.affine(0.5, 0.0)).expect("scores");
        let y2 = s2.softmax(-1).and_then(|p| p.matmul(&v)).expect("trace");
        t.output("y", &y);
        t.output("y2", &y2);
        let g = t.graph();
        let o = attention_from_matmuls(&g).expect("pass");
        assert_eq!((count(&g, "matmul"), count(&g, "softmax")), (4, 2));
        assert_eq!((count(&o, "matmul"), count(&o, "softmax"), count(&o, "attention")), (0, 0, 2), "{}", o.to_text());
        let scales: Vec<f32> = o.nodes.iter().filter_map(|n| if let Op::Attention(a) = n.op { Some(a.scale) } else { None }).collect();
        assert_eq!(scales, [0.35, 0.5]);
        same_outputs(&g, &o, 2, "matmul → softmax → matmul");
    }

    #[test]
    fn scores_read_twice_or_softmax_not_on_the_last_dim_stay_matmuls() {
        let t = Tracer::new();
        let (q, k, v) = (t.input("q", &[1, 4, 6]), t.input("k", &[1, 4, 6]), t.input("v", &[1, 4, 4]));
        let s = q.matmul(&k.transpose(-2, -1).expect("t")).expect("s");
        let y = s.softmax(-1).and_then(|p| p.matmul(&v)).expect("y");
        t.output("y", &y);
        t.output("scores", &s);
        let y2 = s.softmax(1).and_then(|p| p.matmul(&v)).expect("y2");
        t.output("y2", &y2);
        let g = t.graph();
        let o = attention_from_matmuls(&g).expect("pass");
        assert_eq!(count(&o, "attention"), 0, "{}", o.to_text());
    }

    /// `F.multi_head_attention_forward` op by op: the packed projection split by reshape →
    /// permute → slice, each head by reshape → transpose, attention, heads joined by transpose →
    /// reshape; and Swin's windows (a group dim before the heads).
    #[test]
    fn packed_thirds_become_qkv_attention_and_the_head_join_cancels() {
        let (h, d) = (2, 4);
        let t = Tracer::new();
        let qkv = t.input("qkv", &[1, 5, 3 * h * d]);
        let split = qkv.reshape(&[-1, 5, 3, (h * d) as isize]).and_then(|x| x.permute(&[0, 2, 1, 3])).expect("split");
        let third = |i| {
            split.narrow(1, i, 1).and_then(|x| x.reshape(&[-1, 5, h as isize, d as isize])).and_then(|x| x.transpose(1, 2)).expect("head")
        };
        let (q, k, v) = (third(0), third(1), third(2));
        let y = q.attention(&k, &v, None, Some(0.5)).expect("attention");
        let y = y.transpose(1, 2).and_then(|y| y.reshape(&[-1, 5, (h * d) as isize])).and_then(|y| y.relu()).expect("join");
        t.output("y", &y);
        // Windows: [N, 4, 5, 3·H·D] → [N, 4, 5, 3, H, D] → [3, N, 4, H, 5, D] (torchvision's
        // permute(3, 0, 1, 4, 2, 5), batch first here).
        let w = t.input("w", &[1, 4, 5, 3 * h * d]);
        let s = w.reshape(&[-1, 4, 5, 3, h as isize, d as isize]).and_then(|x| x.permute(&[0, 3, 1, 4, 2, 5])).expect("split");
        let third = |i| s.narrow(1, i, 1).and_then(|x| x.reshape(&[-1, 4, h as isize, 5, d as isize])).expect("third");
        let y = third(0).attention(&third(1), &third(2), None, None).expect("attention");
        let y = y.transpose(2, 3).and_then(|y| y.reshape(&[-1, 4, 5, (h * d) as isize])).and_then(|y| y.relu()).expect("join");
        t.output("w", &y);
        let g = t.graph();
        let o = collapse_view_chains(&packed_attention_from_views(&g).expect("packed")).expect("collapse");
        assert_eq!((count(&o, "attention"), count(&o, "qkv_attention")), (0, 2), "{}", o.to_text());
        assert_eq!((count(&o, "slice"), count(&o, "permute"), count(&o, "reshape")), (0, 0, 0), "{}", o.to_text());
        same_outputs(&g, &o, 3, "packed attention from views");
    }

    #[test]
    fn thirds_of_another_layout_stay_attention() {
        // q, k, v each [H, L, D] but the packed row is [H, 3, D] (heads outermost): not
        // `qkv_attention`'s order.
        let (h, d) = (2, 4);
        let t = Tracer::new();
        let qkv = t.input("qkv", &[1, 5, 3 * h * d]);
        let split = qkv.reshape(&[-1, 5, h as isize, 3, d as isize]).and_then(|x| x.permute(&[0, 3, 2, 1, 4])).expect("split");
        let third = |i| split.narrow(1, i, 1).and_then(|x| x.reshape(&[-1, h as isize, 5, d as isize])).expect("third");
        let y = third(0).attention(&third(1), &third(2), None, None).expect("attention");
        t.output("y", &y);
        let g = t.graph();
        let o = packed_attention_from_views(&g).expect("pass");
        assert_eq!((count(&o, "attention"), count(&o, "qkv_attention")), (1, 0), "{}", o.to_text());
    }

    #[test]
    fn view_chains_that_cancel_go() {
        let t = Tracer::new();
        let x = t.input("x", &[1, 6, 4]);
        // A size-1 dim in and out of place, as `F.multi_head_attention_forward` leaves them.
        let a = x.reshape(&[-1, 1, 6, 4]).and_then(|x| x.permute(&[0, 2, 1, 3])).and_then(|x| x.reshape(&[-1, 6, 4])).expect("a");
        let b = x.transpose(1, 2).and_then(|x| x.transpose(1, 2)).and_then(|x| x.relu()).expect("b");
        let c = x.reshape(&[-1, 3, 2, 4]).and_then(|x| x.reshape(&[-1, 24])).expect("c");
        let kept = x.transpose(1, 2).and_then(|x| x.reshape(&[-1, 24])).expect("a real transpose");
        let sum = (&a.relu().expect("relu") + &b).expect("sum");
        t.output("sum", &sum);
        t.output("c", &c);
        t.output("kept", &kept);
        let g = t.graph();
        let o = collapse_view_chains(&g).expect("pass");
        assert_eq!((count(&g, "reshape") + count(&g, "permute")), 9);
        // `c` is one reshape of x; `kept` keeps its transpose and reshape.
        assert_eq!((count(&o, "reshape"), count(&o, "permute")), (2, 1), "{}", o.to_text());
        same_outputs(&g, &o, 2, "chains that cancel");
    }

    /// ViT's patch embedding as torchvision writes it: `conv(x).flatten(2).transpose(1, 2)`.
    #[test]
    fn flatten_then_transpose_of_a_conv_becomes_permute_then_reshape() {
        let vb = VarBuilder::seeded();
        let t = Tracer::new();
        let x = t.input("x", &[1, 3, 8, 8]);
        let conv = crate::nn::Conv2d::load(vb.pp("conv_proj"), &crate::nn::Conv2dConfig::new(3, 16, 4).stride(4)).expect("conv");
        let y = crate::Forward::forward(&conv, &x).expect("conv");
        let tokens = y.flatten(2).and_then(|y| y.transpose(1, 2)).and_then(|y| y.relu()).expect("tokens");
        t.output("y", &tokens);
        // The same on a value stored in PyTorch's order stays: the reshape is free there already.
        let v = t.input("v", &[1, 16, 2, 2]);
        let other = v.flatten(2).and_then(|y| y.transpose(1, 2)).expect("other");
        t.output("other", &other);
        let g = t.graph();
        let o = commute_reshape_permute(&g).expect("pass");
        let ops: Vec<String> = o.nodes.iter().map(|n| format!("{:?}", n.op)).collect();
        let conv_at = o.nodes.iter().position(|n| matches!(n.op, Op::Conv(_))).expect("conv");
        let reader = o.nodes.iter().position(|n| n.inputs == [conv_at]).expect("conv reader");
        assert_eq!(o.nodes[reader].op, Op::Shape(ShapeOp::Permute { dims: vec![0, 2, 3, 1] }), "{ops:?}");
        assert_eq!(count(&o, "flatten"), 1, "the graph input's flatten stays: {}", o.to_text());
        assert_eq!(count(&o, "reshape"), 1, "{}", o.to_text());
        same_outputs(&g, &o, 2, "flatten → transpose as permute → reshape");
    }

    /// SegFormer's Mix-FFN as segmentation_models_pytorch writes it: `fc1` → `transpose(1, 2)` →
    /// `reshape(n, c, h, w)` → depthwise 3×3 conv → `flatten(2).transpose(1, 2)` → GELU → `fc2`.
    #[test]
    fn tokens_transposed_then_split_become_split_then_permute() {
        let vb = VarBuilder::seeded();
        let t = Tracer::new();
        let (h, w, c, hidden) = (4, 6, 16, 32);
        let x = t.input("x", &[1, h * w, c]);
        let linear =
            |name: &str, fin, fout| crate::nn::Linear::load(vb.pp(name), &crate::nn::LinearConfig::new(fin, fout)).expect("linear");
        let conv = crate::nn::Conv2d::load(vb.pp("dwconv"), &crate::nn::Conv2dConfig::new(hidden, hidden, 3).padding(1).groups(hidden))
            .expect("dwconv");
        let tokens = crate::Forward::forward(&linear("fc1", c, hidden), &x).expect("fc1");
        let image = tokens.transpose(1, 2).and_then(|y| y.reshape(&[1, hidden as isize, h as isize, w as isize])).expect("image");
        let y = crate::Forward::forward(&conv, &image).expect("dwconv");
        let y = y.flatten(2).and_then(|y| y.transpose(1, 2)).and_then(|y| y.gelu(false)).expect("tokens");
        let y = crate::Forward::forward(&linear("fc2", hidden, c), &y).expect("fc2");
        t.output("y", &y);
        // A transpose whose reshape merges dims, and one of a graph input, stay.
        let v = t.input("v", &[1, 6, 8]);
        let merged = v.transpose(1, 2).and_then(|y| y.reshape(&[1, 48])).expect("merged");
        t.output("merged", &merged);
        let g = t.graph();
        let o = split_before_permute(&g).expect("pass");
        let at = |path: &str| o.nodes.iter().position(|n| n.path == path).unwrap_or_else(|| panic!("{path}: {}", o.to_text()));
        let fc1 = at("fc1");
        let reader = o.nodes.iter().position(|n| n.inputs == [fc1]).expect("fc1's reader");
        assert_eq!(o.nodes[reader].op, Op::Shape(ShapeOp::Reshape { dims: vec![h, w, hidden] }), "{}", o.to_text());
        let permute = o.nodes.iter().position(|n| n.inputs == [reader]).expect("the reshape's reader");
        assert_eq!(o.nodes[permute].op, Op::Shape(ShapeOp::Permute { dims: vec![0, 3, 1, 2] }), "{}", o.to_text());
        assert_eq!(o.nodes[permute].shape, vec![1, hidden, h, w]);
        assert_eq!(count(&o, "permute"), count(&g, "permute"), "the graph input's transpose stays: {}", o.to_text());
        same_outputs(&g, &o, 2, "transpose → split as split → permute");
        same_outputs(&g, &o, 3, "transpose → split as split → permute");
    }
}
