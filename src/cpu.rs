//! The CPU reference executor: runs any graph in f32, node by node, in graph order.
//!
//! It is the oracle every other backend is checked against and the fallback where no GPU exists.
//! Every op is computed from its actual input shapes (the batch may differ from the traced one),
//! nodes no output depends on are skipped, and each value is freed after its last read; an op
//! that maps its input to an output of the same shape (activations, BatchNorm, Add) reuses the
//! input's buffer when it is that buffer's last reader. A node marked f16 (`Node::dtype`: only
//! the CPU simulation of an 8-bit engine marks them, `calibrate::simulation`) has its value, or
//! a weight's, rounded to IEEE half as the engine stores it.

use crate::graph::{DType, Graph, HostInput, HostTensor, NodeId, Op};
use crate::ops::CpuArgs;
use crate::{Error, Result};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

/// Runs `graph` on `inputs` (by input name) and returns its named outputs.
///
/// Each input must be given once, with the traced shape except for the batch (dim 0). Inputs are
/// `&HostTensor`s, or [`HostInput`]s where some are bytes: an input declared u8 takes bytes
/// (`&ByteTensor`, computed with as their f32 values) or f32 values that are integers in 0..=255,
/// as an engine does.
pub fn run<'a, T: Into<HostInput<'a>> + Copy>(graph: &Graph, inputs: &[(&str, T)]) -> Result<BTreeMap<String, HostTensor>> {
    run_with_progress(graph, inputs, |_, _, _| {})
}

/// `run`, calling `progress(done, total, module path)` before each op it computes (a progress
/// bar over a long CPU run: `kiln compare --layerwise`).
pub fn run_with_progress<'a, T: Into<HostInput<'a>> + Copy>(
    graph: &Graph,
    inputs: &[(&str, T)],
    mut progress: impl FnMut(usize, usize, &str),
) -> Result<BTreeMap<String, HostTensor>> {
    check_order(graph)?;
    let inputs: Vec<(&str, HostInput<'a>)> = inputs.iter().map(|&(name, t)| (name, t.into())).collect();
    let mut bound = bind_inputs(graph, &inputs)?;
    let live = live_nodes(graph);
    // A custom op without a registration is named before anything runs.
    for (id, node) in graph.nodes.iter().enumerate() {
        if let Op::Custom(call) = &node.op {
            if live[id] && crate::ops::custom::lookup(&call.name).is_none() {
                return Err(Error::NoConverter { backend: "cpu", op: call.name.clone(), path: node.path.clone() });
            }
        }
    }
    let is_output: BTreeSet<NodeId> = graph.outputs.iter().map(|(_, id)| *id).collect();
    // Reads still to come of each value, by live nodes only.
    let mut pending = vec![0usize; graph.nodes.len()];
    for (i, n) in graph.nodes.iter().enumerate() {
        if live[i] {
            n.inputs.iter().for_each(|&j| pending[j] += 1);
        }
    }

    let mut values: Vec<Option<Cow<HostTensor>>> = vec![None; graph.nodes.len()];
    let total = graph.nodes.iter().enumerate().filter(|(i, n)| live[*i] && !n.op.is_leaf()).count();
    let batch = inputs.first().map(|(_, x)| x.shape().first().copied().unwrap_or(0));
    tracing::debug!(ops = total, inputs = inputs.len(), batch, "run: CPU executor starts");
    let start = std::time::Instant::now();
    let op_timing = tracing::enabled!(tracing::Level::TRACE);
    let mut done = 0;
    for (id, node) in graph.nodes.iter().enumerate() {
        if !live[id] {
            continue;
        }
        if !node.op.is_leaf() {
            progress(done, total, &node.path);
            done += 1;
        }
        let value = match &node.op {
            // Each input node is visited once: its value moves out of the bindings.
            Op::Input { name } => bound.remove(name.as_str()).ok_or_else(|| Error::Binding {
                name: name.clone(),
                reason: format!("node %{id} is an input node missing from the graph's input list"),
            })?,
            Op::Weight { name, .. } => {
                let w = graph
                    .weights
                    .get(name)
                    .map(|w| w.as_ref())
                    .ok_or_else(|| Error::MissingWeight { key: name.clone(), source_name: "the graph's weights".into() })?;
                match node.dtype {
                    DType::F16 => Cow::Owned(stored_f16(w.clone())),
                    _ => Cow::Borrowed(w),
                }
            }
            _ if op_timing => {
                let t = std::time::Instant::now();
                let value = eval_node(graph, id, &mut values, &pending, &is_output)?;
                let ms = t.elapsed().as_secs_f64() * 1e3;
                tracing::trace!(node = id, path = %node.path, op = node.op.name(), shape = ?value.shape, ms, "run: op");
                Cow::Owned(value)
            }
            _ => Cow::Owned(eval_node(graph, id, &mut values, &pending, &is_output)?),
        };
        let value = match (node.dtype, value) {
            (DType::F16, Cow::Owned(v)) if !node.op.is_leaf() => Cow::Owned(stored_f16(v)),
            (_, v) => v,
        };
        for &j in &node.inputs {
            pending[j] -= 1;
            if pending[j] == 0 && !is_output.contains(&j) {
                values[j] = None;
            }
        }
        values[id] = Some(value);
    }

    let mut out = BTreeMap::new();
    for (k, (name, id)) in graph.outputs.iter().enumerate() {
        // A value marked under several names is copied for all but its last name.
        let last_name = !graph.outputs[k + 1..].iter().any(|(_, o)| o == id);
        let v = if last_name { values[*id].take() } else { values[*id].clone() };
        let v = v.ok_or_else(|| Error::Binding { name: name.clone(), reason: format!("the output (%{id}) was not computed") })?;
        out.insert(name.clone(), v.into_owned());
    }
    tracing::debug!(ops = total, outputs = out.len(), ms = start.elapsed().as_secs_f64() * 1e3, "run: CPU executor done");
    Ok(out)
}

/// A value a graph marks f16 (the CPU simulation of an engine's FP16 storage,
/// `calibrate::simulation`), rounded as the engine stores it.
fn stored_f16(mut t: HostTensor) -> HostTensor {
    t.data.iter_mut().for_each(|v| *v = crate::number_format::round_f16(*v));
    t
}

/// Every node reads only nodes before it, and every output names a node: what the executor's
/// single forward sweep relies on (passes restore this order after each rewrite).
fn check_order(graph: &Graph) -> Result<()> {
    for (id, n) in graph.nodes.iter().enumerate() {
        if let Some(j) = n.inputs.iter().find(|&&j| j >= id) {
            return Err(Error::InvalidGraph {
                node: id,
                path: n.path.clone(),
                reason: format!("{} reads %{j}, which does not precede it", n.op.name()),
            });
        }
    }
    if let Some((name, id)) = graph.outputs.iter().find(|(_, id)| *id >= graph.nodes.len()) {
        return Err(Error::Binding {
            name: name.clone(),
            reason: format!("the output names %{id}, but the graph has {} nodes", graph.nodes.len()),
        });
    }
    Ok(())
}

/// Checks the bindings against the graph's inputs: every input given once, by a known name, with
/// the traced shape except for a positive batch, and data its declared type accepts (bytes
/// become f32 values here).
fn bind_inputs<'a, 'n>(graph: &Graph, inputs: &[(&'n str, HostInput<'a>)]) -> Result<BTreeMap<&'n str, Cow<'a, HostTensor>>> {
    let names = graph.input_names();
    let mut bound = BTreeMap::new();
    for &(name, t) in inputs {
        let bad = |reason: String| Error::Binding { name: name.to_string(), reason };
        let Some(pos) = names.iter().position(|n| *n == name) else {
            return Err(bad(format!("the graph has no such input (its inputs are {names:?})")));
        };
        if bound.contains_key(name) {
            return Err(bad("given more than once".into()));
        }
        let node = &graph.nodes[graph.inputs[pos]];
        let t = t.to_f32(name, node.dtype)?;
        let traced = &node.shape;
        // The traced batch (even a 0 from a file) is not a requirement: any positive batch runs.
        let per_image: Vec<String> = traced.iter().skip(1).map(|d| d.to_string()).collect();
        let want = format!("[N, {}] (any positive batch N; traced at {traced:?})", per_image.join(", "));
        if t.shape.len() != traced.len() || t.shape.get(1..) != traced.get(1..) {
            return Err(bad(format!("expected shape {want}, got {:?}", t.shape)));
        }
        if t.shape.first() == Some(&0) {
            return Err(bad(format!("got shape {:?}: a batch of 0; the batch must be at least 1 (the input takes {want})", t.shape)));
        }
        bound.insert(name, t);
    }
    if let Some(missing) = names.iter().find(|n| !bound.contains_key(*n)) {
        return Err(Error::Binding { name: missing.to_string(), reason: "not given".into() });
    }
    // The batch is one per run, as in an engine (broadcasting must not hide a mismatch).
    let mut batches = bound.iter().map(|(name, t)| (*name, t.shape[0]));
    if let Some((first, b0)) = batches.next() {
        if let Some((name, b)) = batches.find(|(_, b)| *b != b0) {
            return Err(Error::Binding {
                name: name.to_string(),
                reason: format!("has batch {b}, but `{first}` has batch {b0}: all inputs share one batch"),
            });
        }
    }
    Ok(bound)
}

/// Which nodes some output depends on.
fn live_nodes(graph: &Graph) -> Vec<bool> {
    let mut live = vec![false; graph.nodes.len()];
    let mut stack: Vec<NodeId> = graph.outputs.iter().map(|(_, id)| *id).collect();
    while let Some(id) = stack.pop() {
        if !std::mem::replace(&mut live[id], true) {
            stack.extend(&graph.nodes[id].inputs);
        }
    }
    live
}

/// Computes one non-leaf node from the values of its inputs, through its op's CPU reference. The
/// first input is handed over by value when this node is its last reader (ops that work in place
/// reuse its buffer).
fn eval_node<'g>(
    graph: &'g Graph,
    id: NodeId,
    values: &mut [Option<Cow<'g, HostTensor>>],
    pending: &[usize],
    is_output: &BTreeSet<NodeId>,
) -> Result<HostTensor> {
    let node = &graph.nodes[id];
    let missing = |j: NodeId| Error::InvalidGraph {
        node: id,
        path: node.path.clone(),
        reason: format!("reads %{j}, which is not computed before it"),
    };
    let def =
        node.op.def().ok_or_else(|| Error::InvalidGraph { node: id, path: node.path.clone(), reason: "is a leaf, not an op".into() })?;
    let mut args = Vec::with_capacity(node.inputs.len());
    if let Some(&j) = node.inputs.first().filter(|&&j| pending[j] == 1 && !is_output.contains(&j)) {
        args.push(values[j].take().ok_or_else(|| missing(j))?);
    }
    for &j in &node.inputs[args.len()..] {
        args.push(Cow::Borrowed(values[j].as_deref().ok_or_else(|| missing(j))?));
    }
    let got = args.iter().map(|t| t.shape.clone()).collect();
    let mut args = CpuArgs::new(args);
    def.cpu(&mut args).map_err(|reason| Error::Shape { path: node.path.clone(), op: node.op.name().to_string(), reason, got })
}
