//! The traced network: a list of nodes in topological order, one `Op` enum, weights held once.
//!
//! The graph knows nothing of CUDA. The CPU executor and the engine builder both consume it.

pub use crate::ops::attention::{Attention, QkvAttention};
pub use crate::ops::conv::{Activation, ConvAttrs};
pub use crate::ops::custom::CustomCall;
pub use crate::ops::elementwise::{Binary, Unary};
pub use crate::ops::linear::Gemm;
pub use crate::ops::norm::Norm;
pub use crate::ops::pool::{Pool, PoolAttrs};
pub use crate::ops::quant::{Quant, QuantFormat, QuantParams};
pub use crate::ops::resize::Resize;
pub use crate::ops::shape::ShapeOp;
use crate::ops::OpDef;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;

pub type NodeId = usize;

/// A dense row-major f32 tensor in host memory: weights, CPU executor values, references.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "HostTensor: shape {shape:?} does not match {} values", data.len());
        Self { shape, data }
    }
    /// `new` for sizes that come from a file or a flag: an overflowing element count or a length
    /// that does not match the shape is an error, not a panic.
    pub fn try_new(shape: Vec<usize>, data: Vec<f32>) -> Result<Self> {
        match numel(&shape) {
            Some(n) if n == data.len() => Ok(Self { shape, data }),
            n => Err(Error::TensorSize { expected: n.map_or("more than usize::MAX".into(), |n| n.to_string()), got: data.len(), shape }),
        }
    }
    pub fn zeros(shape: Vec<usize>) -> Self {
        let n = shape.iter().product();
        Self { shape, data: vec![0.0; n] }
    }
    pub fn numel(&self) -> usize {
        self.data.len()
    }
}

/// Logical element type of a graph value. The graph is traced in f32; engines choose their own
/// physical precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum DType {
    #[default]
    F32,
    F16,
}

/// Every operation a graph can hold: the two leaves, and one variant per op family (each family
/// lives in its own file of `src/ops/` and implements [`OpDef`]). Inputs are listed in
/// `Node::inputs`, in the order each family documents.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// A graph input (NCHW, f32).
    Input { name: String },
    /// A named constant: a key into `Graph::weights`.
    Weight { name: String },
    /// Conv2d and ConvTranspose2d, with fused bias, residual and activation (`ops::conv`).
    Conv(ConvAttrs),
    /// Linear and matmul (`ops::linear`).
    Gemm(Gemm),
    /// BatchNorm, LayerNorm, softmax: normalisations along some dims (`ops::norm`).
    Norm(Norm),
    /// Pooling and mean reductions (`ops::pool`).
    Pool(Pool),
    /// One-input elementwise ops: activations, clamp, scalar arithmetic (`ops::elementwise`).
    Unary(Unary),
    /// Two-input elementwise ops with broadcasting (`ops::elementwise`).
    Binary(Binary),
    /// Ops that move data without arithmetic: flatten, reshape, permute, cat, slice, pad (`ops::shape`).
    Shape(ShapeOp),
    /// Upsampling / interpolation (`ops::resize`).
    Resize(Resize),
    /// Scaled dot-product attention with an optional additive bias (`ops::attention`).
    Attention(Attention),
    /// Multi-head self-attention on a packed `[.., L, 3·H·D]` projection, heads concatenated in
    /// its output: no copies around the attention (`ops::attention`).
    QkvAttention(QkvAttention),
    /// Quantize, dequantize and fake-quantize, int8 and fp8 (`ops::quant`).
    Quant(Quant),
    /// A user-registered op (`ops::custom`): its name selects its shape rule, CPU reference and
    /// converter.
    Custom(CustomCall),
}

impl Op {
    /// The op's definition: the one dispatch point from a graph node to its shape rule, CPU
    /// reference, layouts, converter and label. `None` for the leaves (inputs and weights).
    pub fn def(&self) -> Option<&dyn OpDef> {
        Some(match self {
            Op::Input { .. } | Op::Weight { .. } => return None,
            Op::Conv(a) => a,
            Op::Gemm(a) => a,
            Op::Norm(a) => a,
            Op::Pool(a) => a,
            Op::Unary(a) => a,
            Op::Binary(a) => a,
            Op::Shape(a) => a,
            Op::Resize(a) => a,
            Op::Attention(a) => a,
            Op::QkvAttention(a) => a,
            Op::Quant(a) => a,
            Op::Custom(a) => a,
        })
    }

    /// The op's name: `input`, `weight`, or its definition's (`conv2d`, `relu`, a custom name).
    pub fn name(&self) -> &str {
        match self {
            Op::Input { .. } => "input",
            Op::Weight { .. } => "weight",
            _ => self.def().map_or("?", |d| d.name()),
        }
    }

    /// Output shape from input shapes, or a reason the inputs do not fit.
    pub fn infer_shape(&self, inputs: &[&[usize]]) -> std::result::Result<Vec<usize>, String> {
        self.def().ok_or_else(|| "inputs and weights have no shape rule".to_string())?.infer_shape(inputs)
    }

    /// Whether this is an input or a weight (no computation).
    pub fn is_leaf(&self) -> bool {
        matches!(self, Op::Input { .. } | Op::Weight { .. })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<NodeId>,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// The module path the node was traced in (`layer3.1.conv2`), for errors, profiles and names.
    pub path: String,
}

/// A traced network. Nodes are in topological order (every input precedes its users).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Graph {
    pub nodes: Vec<Node>,
    /// Graph inputs in binding order.
    pub inputs: Vec<NodeId>,
    /// Named outputs in binding order.
    pub outputs: Vec<(String, NodeId)>,
    /// Constants by name (`layer1.0.conv1.weight`), shared, never copied by passes that keep them.
    #[serde(skip)]
    pub weights: BTreeMap<String, Arc<HostTensor>>,
    /// Module-path patterns of nodes the model needs in FP32 whatever the engine's precision
    /// (`Tracer::require_fp32`; TensorRT's per-layer precision set in the network definition).
    /// Engines apply them before `BuildConfig::layer_precisions`, which may override them.
    #[serde(default)]
    pub fp32_layers: Vec<String>,
}

impl Graph {
    /// Appends a node after checking its inputs' shapes; the error names the module path.
    pub fn push(&mut self, op: Op, inputs: Vec<NodeId>, path: String) -> Result<NodeId> {
        let shapes: Vec<&[usize]> = inputs.iter().map(|&i| self.nodes[i].shape.as_slice()).collect();
        let shape = op.infer_shape(&shapes).map_err(|reason| Error::Shape {
            path: path.clone(),
            op: op.name().to_string(),
            reason,
            got: shapes.iter().map(|s| s.to_vec()).collect(),
        })?;
        Ok(self.push_unchecked(op, inputs, shape, path))
    }

    /// Appends a node whose shape is already known (inputs, weights, rewrites by passes).
    pub fn push_unchecked(&mut self, op: Op, inputs: Vec<NodeId>, shape: Vec<usize>, path: String) -> NodeId {
        self.nodes.push(Node { op, inputs, shape, dtype: DType::F32, path });
        self.nodes.len() - 1
    }

    /// Adds a weight constant (once per name) and returns its node.
    pub fn weight(&mut self, name: &str, value: Arc<HostTensor>) -> NodeId {
        if let Some(id) = self.nodes.iter().position(|n| matches!(&n.op, Op::Weight { name: w } if w == name)) {
            return id;
        }
        let shape = value.shape.clone();
        self.weights.insert(name.to_string(), value);
        self.push_unchecked(Op::Weight { name: name.to_string() }, vec![], shape, name.to_string())
    }

    /// The data of a weight node.
    pub fn weight_data(&self, id: NodeId) -> Option<&Arc<HostTensor>> {
        match &self.nodes[id].op {
            Op::Weight { name } => self.weights.get(name),
            _ => None,
        }
    }

    /// Marks a node as a named graph output (TensorRT's `markOutput`).
    pub fn mark_output(&mut self, name: impl Into<String>, id: NodeId) {
        let name = name.into();
        self.outputs.retain(|(n, _)| *n != name);
        self.outputs.push((name, id));
    }

    pub fn input_names(&self) -> Vec<&str> {
        self.inputs
            .iter()
            .map(|&i| match &self.nodes[i].op {
                Op::Input { name } => name.as_str(),
                _ => unreachable!("graph input is not an Input node"),
            })
            .collect()
    }

    /// How many nodes read each node's value (graph outputs count as readers).
    pub fn use_counts(&self) -> Vec<usize> {
        let mut uses = vec![0; self.nodes.len()];
        for n in &self.nodes {
            for &i in &n.inputs {
                uses[i] += 1;
            }
        }
        for (_, o) in &self.outputs {
            uses[*o] += 1;
        }
        uses
    }

    /// The same graph for other input dims: each input named in `dims` gets those per-image dims
    /// (the batch stays), and every node's shape is inferred again with its op's rule. Ops whose
    /// attributes fix a size (a reshape to given dims, a constant of the traced size added to an
    /// activation) make this an error naming the node and both shapes, not a silent mismatch.
    pub fn with_input_dims(&self, dims: &BTreeMap<String, Vec<usize>>) -> Result<Graph> {
        let mut g = self.clone();
        for (name, d) in dims {
            let node = g.inputs.iter().copied().find(|&i| matches!(&g.nodes[i].op, Op::Input { name: n } if n == name));
            let Some(node) = node else {
                return Err(Error::Binding {
                    name: name.clone(),
                    reason: format!("the graph has no such input; it has {:?}", self.input_names()),
                });
            };
            let shape = &mut g.nodes[node].shape;
            if d.len() + 1 != shape.len() {
                return Err(Error::Binding {
                    name: name.clone(),
                    reason: format!("{} per-image dims {d:?} given, the input has {} ({:?})", d.len(), shape.len() - 1, &shape[1..]),
                });
            }
            shape.truncate(1);
            shape.extend(d);
        }
        for id in 0..g.nodes.len() {
            let node = &g.nodes[id];
            if node.op.is_leaf() {
                continue;
            }
            let shapes: Vec<&[usize]> = node.inputs.iter().map(|&i| g.nodes[i].shape.as_slice()).collect();
            let shape = node.op.infer_shape(&shapes).map_err(|reason| Error::Shape {
                path: node.path.clone(),
                op: node.op.name().to_string(),
                reason: format!("{reason} (at input dims {dims:?}; the node's traced shape is {:?})", self.nodes[id].shape),
                got: shapes.iter().map(|s| s.to_vec()).collect(),
            })?;
            if numel(&shape).is_none() {
                return Err(Error::Shape {
                    path: node.path.clone(),
                    op: node.op.name().to_string(),
                    reason: format!("output shape {shape:?} has more elements than fit in memory"),
                    got: shapes.iter().map(|s| s.to_vec()).collect(),
                });
            }
            g.nodes[id].shape = shape;
        }
        Ok(g)
    }

    /// A readable listing, one node a line: `%12 = conv2d(%3, %4) [1, 64, 56, 56]  layer1.0.conv1`.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let args: Vec<String> = n.inputs.iter().map(|i| format!("%{i}")).collect();
            s += &format!("%{i} = {}({}) {:?}  {}\n", n.op.name(), args.join(", "), n.shape, n.path);
        }
        for (name, id) in &self.outputs {
            s += &format!("output {name} = %{id}\n");
        }
        s
    }
}

/// The element count of `shape`, or `None` when it overflows `usize`.
pub fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

impl Graph {
    /// Checks a graph that did not come from tracing (an engine file): every input of a node
    /// precedes it, every shape is re-inferred from its inputs with the op's own rule and equals
    /// the stored one, inputs and outputs name the right nodes, and every weight node has its
    /// data with its shape. Passes and lowering may then index freely.
    pub fn validate(&self) -> Result<()> {
        let bad = |node: usize, reason: String| {
            let path = self.nodes.get(node).map_or(String::new(), |n| n.path.clone());
            Error::InvalidGraph { node, path, reason }
        };
        for (id, node) in self.nodes.iter().enumerate() {
            if numel(&node.shape).is_none() {
                return Err(bad(id, format!("shape {:?} has more elements than fit in memory", node.shape)));
            }
            if let Some(&j) = node.inputs.iter().find(|&&j| j >= id) {
                return Err(bad(id, format!("reads %{j}, which does not precede it")));
            }
            match &node.op {
                Op::Input { .. } | Op::Weight { .. } if !node.inputs.is_empty() => {
                    return Err(bad(id, format!("a {} node has {} input(s)", node.op.name(), node.inputs.len())));
                }
                Op::Input { .. } => {}
                Op::Weight { name } => match self.weights.get(name) {
                    None => return Err(bad(id, format!("weight `{name}` has no data"))),
                    Some(w) if w.shape != node.shape => {
                        return Err(bad(id, format!("weight `{name}` has shape {:?}, the node says {:?}", w.shape, node.shape)));
                    }
                    Some(w) if numel(&w.shape) != Some(w.data.len()) => {
                        return Err(bad(id, format!("weight `{name}` holds {} values for shape {:?}", w.data.len(), w.shape)));
                    }
                    Some(_) => {}
                },
                op => {
                    let shapes: Vec<&[usize]> = node.inputs.iter().map(|&i| self.nodes[i].shape.as_slice()).collect();
                    let shape =
                        op.infer_shape(&shapes).map_err(|reason| bad(id, format!("{}: {reason}; input shapes {shapes:?}", op.name())))?;
                    if shape != node.shape {
                        return Err(bad(
                            id,
                            format!("{} infers shape {shape:?} from its inputs, the node says {:?}", op.name(), node.shape),
                        ));
                    }
                }
            }
        }
        let mut seen = std::collections::BTreeSet::new();
        for &i in &self.inputs {
            match self.nodes.get(i) {
                Some(Node { op: Op::Input { name }, .. }) if seen.insert(name.as_str()) => {}
                Some(Node { op: Op::Input { name }, .. }) => return Err(bad(i, format!("input `{name}` is listed twice"))),
                Some(n) => return Err(bad(i, format!("listed as a graph input, but it is a {} node", n.op.name()))),
                None => return Err(bad(i, format!("graph input %{i} is past the end ({} nodes)", self.nodes.len()))),
            }
        }
        if let Some(id) = self.nodes.iter().position(|n| matches!(&n.op, Op::Input { name } if !seen.contains(name.as_str()))) {
            return Err(bad(id, "an input node missing from the graph's input list".into()));
        }
        let mut names = std::collections::BTreeSet::new();
        for (name, id) in &self.outputs {
            if *id >= self.nodes.len() {
                return Err(bad(*id, format!("output `{name}` is past the end ({} nodes)", self.nodes.len())));
            }
            if !names.insert(name.as_str()) {
                return Err(bad(*id, format!("output `{name}` is listed twice")));
            }
        }
        Ok(())
    }
}
