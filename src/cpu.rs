//! The CPU reference executor: runs any graph in f32, node by node, in graph order.
//!
//! It is the oracle every other backend is checked against and the fallback where no GPU exists.
//! Every op is computed from its actual input shapes (the batch may differ from the traced one),
//! nodes no output depends on are skipped, and each value is freed after its last read; an op
//! that maps its input to an output of the same shape (activations, BatchNorm, Add) reuses the
//! input's buffer when it is that buffer's last reader.

use crate::graph::{Graph, HostTensor, NodeId, Op};
use crate::ops;
use crate::{Error, Result};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

/// Runs `graph` on `inputs` (by input name) and returns its named outputs.
///
/// Each input must be given once, with the traced shape except for the batch (dim 0).
pub fn run(graph: &Graph, inputs: &[(&str, &HostTensor)]) -> Result<BTreeMap<String, HostTensor>> {
    check_order(graph)?;
    let bound = bind_inputs(graph, inputs)?;
    let live = live_nodes(graph);
    let is_output: BTreeSet<NodeId> = graph.outputs.iter().map(|(_, id)| *id).collect();
    // Reads still to come of each value, by live nodes only.
    let mut pending = vec![0usize; graph.nodes.len()];
    for (i, n) in graph.nodes.iter().enumerate() {
        if live[i] {
            n.inputs.iter().for_each(|&j| pending[j] += 1);
        }
    }

    let mut values: Vec<Option<Cow<HostTensor>>> = vec![None; graph.nodes.len()];
    for (id, node) in graph.nodes.iter().enumerate() {
        if !live[id] {
            continue;
        }
        let value = match &node.op {
            Op::Input { name } => Cow::Borrowed(*bound.get(name.as_str()).ok_or_else(|| Error::Binding {
                name: name.clone(),
                reason: format!("node %{id} is an input node missing from the graph's input list"),
            })?),
            Op::Weight { name } => Cow::Borrowed(
                graph
                    .weights
                    .get(name)
                    .map(|w| w.as_ref())
                    .ok_or_else(|| Error::MissingWeight { key: name.clone(), source_name: "the graph's weights".into() })?,
            ),
            _ => Cow::Owned(eval_node(graph, id, &mut values, &pending, &is_output)?),
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
        let v = v.ok_or_else(|| Error::Graph(format!("output `{name}` (%{id}) was not computed")))?;
        out.insert(name.clone(), v.into_owned());
    }
    Ok(out)
}

/// Every node reads only nodes before it, and every output names a node: what the executor's
/// single forward sweep relies on (passes restore this order after each rewrite).
fn check_order(graph: &Graph) -> Result<()> {
    for (id, n) in graph.nodes.iter().enumerate() {
        if let Some(j) = n.inputs.iter().find(|&&j| j >= id) {
            return Err(Error::Graph(format!("`{}` (%{id}, {}) reads %{j}, which does not precede it", n.path, n.op.name())));
        }
    }
    if let Some((name, id)) = graph.outputs.iter().find(|(_, id)| *id >= graph.nodes.len()) {
        return Err(Error::Graph(format!("output `{name}` names %{id}, but the graph has {} nodes", graph.nodes.len())));
    }
    Ok(())
}

/// Checks the bindings against the graph's inputs: every input given once, by a known name, with
/// the traced shape except for a positive batch.
fn bind_inputs<'a>(graph: &Graph, inputs: &[(&'a str, &'a HostTensor)]) -> Result<BTreeMap<&'a str, &'a HostTensor>> {
    let names = graph.input_names();
    let mut bound = BTreeMap::new();
    for &(name, t) in inputs {
        let bad = |reason: String| Error::Binding { name: name.to_string(), reason };
        let Some(pos) = names.iter().position(|n| *n == name) else {
            return Err(bad(format!("the graph has no such input (its inputs are {names:?})")));
        };
        if bound.insert(name, t).is_some() {
            return Err(bad("given more than once".into()));
        }
        if t.shape.iter().product::<usize>() != t.data.len() {
            return Err(bad(format!("shape {:?} does not match its {} values", t.shape, t.data.len())));
        }
        let traced = &graph.nodes[graph.inputs[pos]].shape;
        let fits = t.shape.len() == traced.len() && t.shape.first().is_some_and(|&b| b > 0) && t.shape[1..] == traced[1..];
        if !fits {
            return Err(bad(format!("expected shape {traced:?} (any positive batch), got {:?}", t.shape)));
        }
    }
    if let Some(missing) = names.iter().find(|n| !bound.contains_key(*n)) {
        return Err(Error::Binding { name: missing.to_string(), reason: "not given".into() });
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

/// Computes one non-leaf node from the values of its inputs.
fn eval_node(
    graph: &Graph,
    id: NodeId,
    values: &mut [Option<Cow<HostTensor>>],
    pending: &[usize],
    is_output: &BTreeSet<NodeId>,
) -> Result<HostTensor> {
    let node = &graph.nodes[id];
    let missing = |j: NodeId| Error::Graph(format!("`{}` (%{id}) reads %{j}, which is not computed before it", node.path));
    // The first input by value: moved out when this node is its last reader, copied otherwise.
    let first = node.inputs.first().copied();
    let owned_first = |values: &mut [Option<Cow<HostTensor>>]| -> Result<HostTensor> {
        let j = first.ok_or_else(|| Error::Graph(format!("`{}` (%{id}) has no input", node.path)))?;
        let last_read = pending[j] == 1 && !is_output.contains(&j);
        let v = if last_read { values[j].take() } else { values[j].clone() };
        Ok(v.ok_or_else(|| missing(j))?.into_owned())
    };
    let shape_err =
        |reason: String, got: Vec<Vec<usize>>| Error::Shape { path: node.path.clone(), op: node.op.name().to_string(), reason, got };

    // Ops that reuse their first input's buffer.
    let in_place =
        matches!(&node.op, Op::Relu | Op::LeakyRelu { .. } | Op::Sigmoid | Op::BatchNorm2d { .. } | Op::Add | Op::Mul | Op::Flatten { .. });
    if in_place {
        let got: Vec<Vec<usize>> =
            node.inputs.iter().map(|&j| values[j].as_ref().map(|v| v.shape.clone()).ok_or_else(|| missing(j))).collect::<Result<_>>()?;
        let want = match &node.op {
            Op::Add | Op::Mul => 2,
            Op::BatchNorm2d { .. } => 5,
            _ => 1,
        };
        if node.inputs.len() != want {
            return Err(shape_err(format!("expected {want} inputs, got {}", node.inputs.len()), got));
        }
        let x = owned_first(values)?;
        let others: Vec<&HostTensor> =
            node.inputs[1..].iter().map(|&j| values[j].as_deref().ok_or_else(|| missing(j))).collect::<Result<_>>()?;
        let result = match (&node.op, others.as_slice()) {
            (Op::Relu | Op::LeakyRelu { .. } | Op::Sigmoid, []) => ops::elementwise::unary_cpu(&node.op, x),
            (Op::Flatten { start }, []) => ops::shape::flatten_cpu(*start, x),
            (Op::Add | Op::Mul, [b]) => ops::elementwise::binary_cpu(&node.op, x, b),
            (Op::BatchNorm2d { eps }, [g, b, m, v]) => ops::norm::batch_norm2d_cpu(*eps, x, [g, b, m, v]),
            _ => unreachable!("arity checked above"),
        };
        return result.map_err(|reason| shape_err(reason, got));
    }

    let args: Vec<&HostTensor> = node.inputs.iter().map(|&j| values[j].as_deref().ok_or_else(|| missing(j))).collect::<Result<_>>()?;
    let got = || args.iter().map(|t| t.shape.clone()).collect::<Vec<_>>();
    let single = || match args.as_slice() {
        [x] => Ok(*x),
        _ => Err(format!("expected 1 input, got {}", args.len())),
    };
    let result = match &node.op {
        Op::Conv2d(a) => ops::conv::conv2d_cpu(a, &args),
        Op::ConvTranspose2d(a) => ops::conv::conv_transpose2d_cpu(a, &args),
        Op::Linear { bias } => ops::linear::linear_cpu(*bias, &args),
        Op::MaxPool2d(a) => single().and_then(|x| ops::pool::max_pool2d_cpu(a, x)),
        Op::AvgPool2d(a) => single().and_then(|x| ops::pool::avg_pool2d_cpu(a, x)),
        Op::AdaptiveAvgPool2d { output } => single().and_then(|x| ops::pool::adaptive_avg_pool2d_cpu(*output, x)),
        Op::Cat { dim } => ops::shape::cat_cpu(*dim, &args),
        Op::Custom { name, attrs } => return run_custom(node, name, attrs, &args),
        Op::Input { .. } | Op::Weight { .. } => unreachable!("leaves are bound by `run`"),
        Op::Relu | Op::LeakyRelu { .. } | Op::Sigmoid | Op::BatchNorm2d { .. } | Op::Add | Op::Mul | Op::Flatten { .. } => {
            unreachable!("run in place above")
        }
    };
    result.map_err(|reason| shape_err(reason, got()))
}

/// A registered custom op's CPU reference, with its result checked against its own shape rule.
fn run_custom(node: &crate::graph::Node, name: &str, attrs: &ops::custom::Attrs, args: &[&HostTensor]) -> Result<HostTensor> {
    let op =
        ops::custom::lookup(name).ok_or_else(|| Error::NoConverter { backend: "cpu", op: name.to_string(), path: node.path.clone() })?;
    let shapes: Vec<&[usize]> = args.iter().map(|t| t.shape.as_slice()).collect();
    let shape_err = |reason: String| Error::Shape {
        path: node.path.clone(),
        op: name.to_string(),
        reason,
        got: shapes.iter().map(|s| s.to_vec()).collect(),
    };
    let expected = op.infer_shape(attrs, &shapes).map_err(shape_err)?;
    let out = (op.cpu)(attrs, args)?;
    if out.shape != expected || out.data.len() != expected.iter().product::<usize>() {
        return Err(shape_err(format!(
            "its CPU reference returned shape {:?} ({} values), but its shape rule says {expected:?}",
            out.shape,
            out.data.len()
        )));
    }
    Ok(out)
}
