//! Views of a graph for people: a one-line description of each op, a text listing, and Graphviz DOT
//! (`dot -Tsvg graph.dot -o graph.svg`), the role Netron plays for ONNX.
//!
//! Weight constants are not drawn as nodes: each op lists its weights' shapes instead, so the picture
//! shows the data flow. A convolution that carries a fused bias, residual add or activation is drawn
//! in its own colour with the fused parts in its label, so a before/after pair shows what fusion did.

use crate::graph::{Activation, DType, Graph, Node, Op};
use std::fmt::Write;

/// A short description of an op with its non-default attributes: `conv2d 3x3 s2 p1 +bias +add +relu`
/// (its definition's label, with the kernel size of a rank-4 weight after the op's name).
pub fn describe_op(graph: &Graph, node: &Node) -> String {
    let Some(def) = node.op.def() else {
        return match &node.op {
            Op::Input { name } if node.dtype == DType::F32 => format!("input `{name}`"),
            Op::Input { name } => format!("input `{name}` {}", node.dtype),
            Op::Weight { name, .. } => format!("weight `{name}`"),
            _ => unreachable!("only leaves have no definition"),
        };
    };
    let label = def.label();
    // Only a convolution's rank-4 weight is a kernel (Swin's attention bias is rank 4 too).
    let conv = matches!(node.op, Op::Conv(_));
    let kernel = node.inputs.get(1).map(|&w| &graph.nodes[w]).filter(|w| conv && matches!(w.op, Op::Weight { .. }) && w.shape.len() == 4);
    match (kernel, label.split_once(' ')) {
        (Some(w), Some((name, rest))) => format!("{name} {}x{} {rest}", w.shape[2], w.shape[3]),
        (Some(w), None) => format!("{label} {}x{}", w.shape[2], w.shape[3]),
        (None, _) => label,
    }
}

/// Whether a node is a convolution carrying work fused into it by a pass (residual, activation or
/// max-pool).
pub fn is_fused(node: &Node) -> bool {
    matches!(&node.op, Op::Conv(a) if a.residual || a.act != Activation::None || a.pool.is_some())
}

/// The tensor inputs of a node (its weight inputs left out), and its weights' shapes.
fn split_inputs<'g>(graph: &'g Graph, node: &Node) -> (Vec<usize>, Vec<&'g [usize]>) {
    let (mut data, mut weights) = (Vec::new(), Vec::new());
    for &i in &node.inputs {
        match graph.nodes[i].op {
            Op::Weight { .. } => weights.push(graph.nodes[i].shape.as_slice()),
            _ => data.push(i),
        }
    }
    (data, weights)
}

/// A readable listing without the weight nodes, one op a line:
/// `%5    conv2d 7x7 s2 p3        [1, 64, 112, 112]  conv1   <- %0`.
pub fn to_text(graph: &Graph) -> String {
    let mut s = String::new();
    let ops = graph.nodes.iter().filter(|n| !matches!(n.op, Op::Weight { .. } | Op::Input { .. })).count();
    let weights: usize = graph.weights.values().map(|w| w.numel()).sum();
    let _ = writeln!(s, "{ops} ops, {} weight tensors ({weights} values)", graph.weights.len());
    for (id, node) in graph.nodes.iter().enumerate() {
        if matches!(node.op, Op::Weight { .. }) {
            continue;
        }
        let (data, _) = split_inputs(graph, node);
        let args: Vec<String> = data.iter().map(|i| format!("%{i}")).collect();
        let from = if args.is_empty() { String::new() } else { format!("  <- {}", args.join(", ")) };
        let shape = format!("{:?}", node.shape);
        let _ = writeln!(s, "{:<6} {:<36} {:<20} {}{from}", format!("%{id}"), describe_op(graph, node), shape, node.path);
    }
    for (name, id) in &graph.outputs {
        let _ = writeln!(s, "output `{name}` = %{id} {:?}", graph.nodes[*id].shape);
    }
    s
}

fn quote(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    q.push('"');
    for c in s.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            '\n' => q.push_str("\\n"),
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

fn fill(node: &Node) -> &'static str {
    match node.op.def() {
        _ if is_fused(node) => "#f4a259",
        Some(def) => def.colour(),
        None => "#ffffff",
    }
}

/// Graphviz DOT of `graph`: one box per op labelled with its op, module path and output shape;
/// fused convolutions in orange, with `+bias +add +relu` in the label; outputs as ellipses.
pub fn to_dot(graph: &Graph, title: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "digraph {} {{", quote(title));
    let _ = writeln!(s, "  graph [label={}, labelloc=t, fontname=\"Helvetica\"];", quote(title));
    let _ = writeln!(s, "  node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=10];");
    let _ = writeln!(s, "  edge [color=\"#555555\"];");
    for (id, node) in graph.nodes.iter().enumerate() {
        if matches!(node.op, Op::Weight { .. }) {
            continue;
        }
        let (data, weights) = split_inputs(graph, node);
        let mut label = format!("{}\n{}\n{:?}", describe_op(graph, node), node.path, node.shape);
        if !weights.is_empty() {
            let w: Vec<String> = weights.iter().map(|w| format!("{w:?}")).collect();
            label += &format!("\nweights {}", w.join(" "));
        }
        let shape = if matches!(node.op, Op::Input { .. }) { ", shape=invhouse" } else { "" };
        let pen = if is_fused(node) { ", penwidth=2" } else { "" };
        let _ = writeln!(s, "  n{id} [label={}, fillcolor={}{shape}{pen}];", quote(&label), quote(fill(node)));
        for i in data {
            let _ = writeln!(s, "  n{i} -> n{id};");
        }
    }
    for (k, (name, id)) in graph.outputs.iter().enumerate() {
        let _ = writeln!(s, "  out{k} [label={}, shape=ellipse, style=filled, fillcolor=\"#d8f3dc\"];", quote(&format!("output `{name}`")));
        let _ = writeln!(s, "  n{id} -> out{k};");
    }
    s.push_str("}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::{Conv2d, Conv2dConfig};
    use crate::{Forward, Module, Tracer, VarBuilder};

    fn small() -> Graph {
        let vb = VarBuilder::seeded();
        let t = Tracer::new();
        let x = t.input("input", &[1, 3, 8, 8]);
        let conv = Conv2d::load(vb.pp("stem").pp("conv"), &Conv2dConfig::new(3, 4, 3).padding(1).stride(2)).expect("seeded conv");
        let y = conv.forward(&x).and_then(|y| y.relu()).expect("trace");
        t.output("out \"quoted\"", &y);
        t.graph()
    }

    #[test]
    fn dot_names_ops_paths_and_shapes_and_hides_weights() {
        let g = small();
        let dot = to_dot(&g, "small");
        assert!(dot.starts_with("digraph \"small\" {"));
        assert!(dot.contains("conv2d 3x3 s2 p1 +bias\\nstem.conv\\n[1, 4, 4, 4]\\nweights [4, 3, 3, 3] [4]"), "{dot}");
        assert!(dot.contains("stem.relu"), "{dot}");
        // Each family's colour: the conv's (the default), the activation's, the input's.
        for colour in ["#8ecae6", "#e9ecef", "#ffffff"] {
            assert!(dot.contains(&format!("fillcolor=\"{colour}\"")), "{colour}:\n{dot}");
        }
        assert!(!dot.contains("stem.conv.weight"), "weights are not drawn as nodes:\n{dot}");
        // The output name's quotes are escaped, so the file stays valid DOT.
        assert!(dot.contains("output `out \\\"quoted\\\"`"), "{dot}");
        // Edges go from the input to the conv and the conv to the relu, skipping the weights.
        let conv = g.nodes.iter().position(|n| n.path == "stem.conv").expect("conv node");
        let relu = g.nodes.iter().position(|n| n.path == "stem.relu").expect("relu node");
        assert!(dot.contains(&format!("n0 -> n{conv};")) && dot.contains(&format!("n{conv} -> n{relu};")), "{dot}");
        assert_eq!(dot.matches(" -> ").count(), 3);
    }

    #[test]
    fn fused_convs_are_marked() {
        let mut g = small();
        let conv = g.nodes.iter().position(|n| n.path == "stem.conv").expect("conv node");
        assert!(!is_fused(&g.nodes[conv]));
        if let Op::Conv(a) = &mut g.nodes[conv].op {
            a.act = Activation::Relu;
        }
        assert!(is_fused(&g.nodes[conv]));
        let dot = to_dot(&g, "fused");
        assert!(dot.contains("conv2d 3x3 s2 p1 +bias +relu\\nstem.conv"), "{dot}");
        assert!(dot.contains("fillcolor=\"#f4a259\", penwidth=2"), "{dot}");
        let text = to_text(&g);
        assert!(text.contains("conv2d 3x3 s2 p1 +bias +relu") && text.contains("stem.conv"), "{text}");
        assert!(!text.contains("weight `"), "the listing leaves weights out:\n{text}");
    }
}
