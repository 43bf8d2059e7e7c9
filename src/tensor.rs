//! Symbolic tensors: calling `forward` on them records nodes into a `Graph`.
//!
//! Tracing records what ran, like PyTorch's trace-based exporter: Rust control flow in `forward`
//! (an `if` on a config value, a loop over blocks) is resolved while tracing and fixed in the graph.
//! There is no data-dependent control flow, because symbolic tensors carry no data.

use crate::graph::{DType, Graph, HostTensor, NodeId, Op};
use crate::{Error, Result};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

/// A named parameter, as loaded by a `VarBuilder`: its `state_dict` key and its value.
#[derive(Clone, Debug)]
pub struct Param {
    pub name: String,
    pub value: Arc<HostTensor>,
}

impl Param {
    pub fn shape(&self) -> &[usize] {
        &self.value.shape
    }
}

/// Records a trace. Cheap to clone: all clones share one graph.
#[derive(Clone, Default)]
pub struct Tracer(Rc<RefCell<Graph>>);

impl Tracer {
    pub fn new() -> Self {
        Self::default()
    }

    /// A new graph input of the given shape (NCHW for images), holding f32 values.
    pub fn input(&self, name: &str, shape: &[usize]) -> Tensor {
        self.input_typed(name, shape, DType::F32)
    }

    /// A new graph input whose data have the element type `dtype`: `DType::U8` for bytes (a
    /// decoded `uint8` image), which an engine uploads one byte per element and converts to its
    /// own precision on entry (TensorRT's `kUINT8` input). Every op reads the input as f32 values.
    pub fn input_typed(&self, name: &str, shape: &[usize], dtype: DType) -> Tensor {
        let mut g = self.0.borrow_mut();
        let id = g.push_unchecked(Op::Input { name: name.to_string() }, vec![], shape.to_vec(), name.to_string());
        g.nodes[id].dtype = dtype;
        g.inputs.push(id);
        Tensor { tracer: self.clone(), id, shape: shape.to_vec(), scope: Rc::from("") }
    }

    /// Marks `t` as a graph output named `name` (also for intermediates, as TensorRT's `markOutput`).
    pub fn output(&self, name: &str, t: &Tensor) {
        self.0.borrow_mut().mark_output(name, t.id);
    }

    /// Asks engines to compute the nodes matching `pattern` (a module path or glob, see
    /// `engine::LayerPrecision`) in FP32 whatever their precision: for values whose f16 rounding
    /// the model cannot afford (YOLO's box decode, in pixels up to 640).
    pub fn require_fp32(&self, pattern: &str) {
        let mut g = self.0.borrow_mut();
        if !g.fp32_layers.iter().any(|p| p == pattern) {
            g.fp32_layers.push(pattern.to_string());
        }
    }

    /// The graph recorded so far.
    pub fn graph(&self) -> Graph {
        self.0.borrow().clone()
    }
}

/// A symbolic tensor: a node of a trace with its shape, and the module scope it was made in.
#[derive(Clone)]
pub struct Tensor {
    tracer: Tracer,
    id: NodeId,
    shape: Vec<usize>,
    /// The module path of the module whose `forward` produced this value (`layer1.0` for the
    /// output of `layer1.0.bn3`); ops written inline in a `forward` are named under it.
    scope: Rc<str>,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor(%{}, {:?}, scope `{}`)", self.id, self.shape, self.scope)
    }
}

fn parent(path: &str) -> &str {
    path.rfind('.').map_or("", |i| &path[..i])
}

fn join(scope: &str, name: &str) -> String {
    if scope.is_empty() {
        name.to_string()
    } else {
        format!("{scope}.{name}")
    }
}

impl Tensor {
    pub fn id(&self) -> NodeId {
        self.id
    }
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn dims4(&self) -> Option<[usize; 4]> {
        <[usize; 4]>::try_from(self.shape.as_slice()).ok()
    }
    pub fn tracer(&self) -> &Tracer {
        &self.tracer
    }

    /// The path an inline op named `op` would get in this tensor's scope (`layer1.0.add`).
    pub fn scope_path(&self, op: &str) -> String {
        join(&self.scope, op)
    }

    /// The same value, with the inline ops recorded from it named under `scope` (`scope.softmax`):
    /// groups a `forward`'s inline ops under one path, e.g. for a per-layer precision rule.
    pub fn in_scope(&self, scope: &str) -> Tensor {
        Tensor { scope: Rc::from(scope), ..self.clone() }
    }

    /// Records `op` applied to `inputs` and `params`, as the layer at `path`.
    pub fn record(path: &str, op: Op, inputs: &[&Tensor], params: &[&Param]) -> Result<Tensor> {
        let first = inputs.first().ok_or_else(|| Error::NoTensorInput { op: op.name().to_string(), path: path.to_string() })?;
        if inputs.iter().any(|t| !Rc::ptr_eq(&t.tracer.0, &first.tracer.0)) {
            return Err(Error::MixedTraces { path: path.to_string() });
        }
        let tracer = first.tracer.clone();
        let id = {
            let mut g = tracer.0.borrow_mut();
            let mut ids: Vec<NodeId> = inputs.iter().map(|t| t.id).collect();
            for p in params {
                ids.push(g.weight(&p.name, p.value.clone()));
            }
            g.push(op, ids, path.to_string())?
        };
        let shape = tracer.0.borrow().nodes[id].shape.clone();
        Ok(Tensor { tracer, id, shape, scope: Rc::from(parent(path)) })
    }

    /// Records an op written inline in a `forward` (no module of its own): it is named
    /// `<scope>.<op>`, in the scope of its first input.
    pub fn record_inline(op: Op, inputs: &[&Tensor]) -> Result<Tensor> {
        let scope = inputs.first().map(|t| t.scope.clone()).unwrap_or_else(|| Rc::from(""));
        let path = join(&scope, op.name());
        let mut t = Self::record(&path, op, inputs, &[])?;
        t.scope = scope;
        Ok(t)
    }

    /// Marks this tensor as a graph output named `name`.
    pub fn mark_output(&self, name: &str) {
        self.tracer.output(name, self);
    }
}
