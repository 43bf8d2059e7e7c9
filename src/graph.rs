//! The traced network: a list of nodes in topological order, one `Op` enum, weights held once.
//!
//! The graph knows nothing of CUDA. The CPU executor and the engine builder both consume it.

use crate::error::OpError;
pub use crate::ops::attention::{Attention, QkvAttention};
pub use crate::ops::conv::{Activation, ConvAttrs};
pub use crate::ops::custom::CustomCall;
pub use crate::ops::elementwise::{Binary, Unary};
pub use crate::ops::linear::{Gemm, GemmAct};
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

pub use crate::host_tensor::{numel, ByteTensor, DType, HostInput, HostTensor};

/// Every operation a graph can hold: the two leaves, and one variant per op family (each family
/// lives in its own file of `src/ops/` and implements [`OpDef`]). Inputs are listed in
/// `Node::inputs`, in the order each family documents.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    /// A graph input (NCHW, f32).
    Input { name: String },
    /// A named constant: a key into `Graph::weights`. `quant`: the 8-bit grid of the constant
    /// `fake_quantize` it replaced, so that an 8-bit layer can take its codes and scales. Its
    /// values lie on that grid where the quantiser was folded in (`calibrate::fold_constant_quant`);
    /// a `Best` graph keeps the original values for its 16-bit layers (`calibrate::prepare_for_best`).
    Weight {
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        quant: Option<crate::ops::quant::QuantParams>,
    },
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
    pub fn infer_shape(&self, inputs: &[&[usize]]) -> std::result::Result<Vec<usize>, OpError> {
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
    /// F32 for every node but a graph input declared u8, and the values and weights the CPU
    /// simulation of an 8-bit engine marks F16 (stored in FP16 by the engine: the CPU executor
    /// rounds them, `calibrate::simulation`). Files written before inputs had types may lack it.
    #[serde(default)]
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
    /// The PyTorch class of each module path the nodes were traced in (`layer1.0` →
    /// `torchvision.models.resnet.BasicBlock`; `""` is the model itself), as `kiln-torch` records
    /// them from `torch.export`'s module stacks. Structured codegen writes one struct per class.
    /// Empty for graphs traced in Rust; files without it read as empty.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub modules: BTreeMap<String, String>,
}

impl Graph {
    /// The nodes that read each node, once per read, in graph order (outputs not included).
    pub fn readers(&self) -> Vec<Vec<NodeId>> {
        let mut readers = vec![Vec::new(); self.nodes.len()];
        for (id, n) in self.nodes.iter().enumerate() {
            n.inputs.iter().for_each(|&i| readers[i].push(id));
        }
        readers
    }

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
        if let Some(id) = self.nodes.iter().position(|n| matches!(&n.op, Op::Weight { name: w, .. } if w == name)) {
            return id;
        }
        let shape = value.shape.clone();
        self.weights.insert(name.to_string(), value);
        self.push_unchecked(Op::Weight { name: name.to_string(), quant: None }, vec![], shape, name.to_string())
    }

    /// The data of a weight node.
    pub fn weight_data(&self, id: NodeId) -> Option<&Arc<HostTensor>> {
        match &self.nodes[id].op {
            Op::Weight { name, .. } => self.weights.get(name),
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

    /// The element type input `name` is declared with (`None`: no such input).
    pub fn input_dtype(&self, name: &str) -> Option<DType> {
        self.inputs.iter().map(|&i| &self.nodes[i]).find(|n| matches!(&n.op, Op::Input { name: m } if m == name)).map(|n| n.dtype)
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
                reason: format!("{reason} (at input dims {dims:?}; the node's traced shape is {:?})", self.nodes[id].shape).into(),
                got: shapes.iter().map(|s| s.to_vec()).collect(),
            })?;
            if numel(&shape).is_none() {
                return Err(Error::Shape {
                    path: node.path.clone(),
                    op: node.op.name().to_string(),
                    reason: OpError::TooLarge(format!("output shape {shape:?} has more elements than fit in memory")),
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
            let dtype = if n.dtype == DType::F32 { String::new() } else { format!(" {}", n.dtype) };
            s += &format!("%{i} = {}({}) {:?}{dtype}  {}\n", n.op.name(), args.join(", "), n.shape, n.path);
        }
        for (name, id) in &self.outputs {
            s += &format!("output {name} = %{id}\n");
        }
        s
    }
}

impl Graph {
    /// Checks a graph that did not come from tracing (an engine file): every input of a node
    /// precedes it, every shape is re-inferred from its inputs with the op's own rule and equals
    /// the stored one, inputs and outputs name the right nodes, and every weight node has its
    /// data with its shape, and a weight's 8-bit grid (`Op::Weight::quant`) is sound. Passes and
    /// lowering may then index freely.
    pub fn validate(&self) -> Result<()> {
        self.validate_with(|name| self.weights.get(name).map(|w| (w.shape.as_slice(), w.data.len())))
    }

    /// [`Graph::validate`] before the weights are decoded: `stored(name)` gives the shape and
    /// element count a file declares for weight `name`, so a file's graph is checked against its
    /// header before any tensor is decoded or allocated.
    pub fn validate_with<'w>(&self, stored: impl Fn(&str) -> Option<(&'w [usize], usize)>) -> Result<()> {
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
                // Bytes exist only at the edge: readers compute in f32 whatever an input holds.
                Op::Input { name } if !matches!(node.dtype, DType::F32 | DType::U8) => {
                    return Err(bad(id, format!("input `{name}` is declared {}; inputs are f32 or u8", node.dtype)));
                }
                Op::Input { .. } => {}
                // f16: a simulation's FP16 storage (`calibrate::simulation`), computed in f32 and rounded.
                _ if !matches!(node.dtype, DType::F32 | DType::F16) => {
                    return Err(bad(
                        id,
                        format!(
                            "a {} node is declared {}; only graph inputs may have another type than f32 (or f16, a simulated FP16 value)",
                            node.op.name(),
                            node.dtype
                        ),
                    ));
                }
                Op::Weight { name, quant } => {
                    match stored(name) {
                        None => return Err(bad(id, format!("weight `{name}` has no data"))),
                        Some((shape, _)) if *shape != node.shape[..] => {
                            return Err(bad(id, format!("weight `{name}` has shape {shape:?}, the node says {:?}", node.shape)));
                        }
                        Some((shape, len)) if numel(shape) != Some(len) => {
                            return Err(bad(id, format!("weight `{name}` holds {len} values for shape {shape:?}")));
                        }
                        Some(_) => {}
                    }
                    // The grid 8-bit layers read the weight's codes and scales from.
                    if let Some(q) = quant {
                        q.check(&node.shape).map_err(|reason| bad(id, format!("weight `{name}`: its 8-bit grid: {reason}")))?;
                    }
                }
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

    /// What a model read from a file must have beyond [`Graph::validate`]: at least one input and
    /// one output, and every input a batch dim and no zero dim (graph and engine files alike).
    /// `validate` must have passed (the input ids are in range).
    pub fn check_bindings(&self) -> std::result::Result<(), String> {
        if self.inputs.is_empty() || self.outputs.is_empty() {
            return Err(format!(
                "the graph has {} input(s) and {} output(s); a model needs at least one of each",
                self.inputs.len(),
                self.outputs.len()
            ));
        }
        for &i in &self.inputs {
            let shape = &self.nodes[i].shape;
            if shape.is_empty() || shape.contains(&0) {
                return Err(format!("input `{}` has shape {shape:?}; inputs need a batch dim and no zero dims", self.nodes[i].path));
            }
        }
        Ok(())
    }

    /// The weights holding NaN or infinity, by name, with how many such values each.
    pub fn non_finite_weights(&self) -> Vec<(String, usize)> {
        self.weights
            .iter()
            .map(|(name, w)| (name.clone(), w.data.iter().filter(|v| !v.is_finite()).count()))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Strict mode for a graph's own weights: an error naming the first weight that holds NaN or
    /// infinity (`source_name`: the file they came from), as `VarBuilder::check_finite` does.
    pub fn check_finite_weights(&self, source_name: &str) -> Result<()> {
        match self.non_finite_weights().into_iter().next() {
            Some((key, count)) => Err(Error::NonFinite { key, count, source_name: source_name.to_string() }),
            None => Ok(()),
        }
    }
}
