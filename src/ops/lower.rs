//! What a converter sees: [`BuildCtx`], the engine's op-agnostic [`LayerCtx`] (which it derefs
//! to) plus the graph being lowered and the node being converted. The engine's layer kinds take a
//! `LayerCtx` and know no node; a converter reads its node's inputs, weights and attributes here
//! and hands them to them.

use crate::engine::eight_bit::EightBitPlan;
use crate::engine::layer::LayerCtx;
use crate::engine::{Precision, ValueId};
use crate::graph::{HostTensor, Node, NodeId};
use crate::{Error, Graph, LowerKind, Result};
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// What a converter sees: the layer context (GPU, kernels, values, tactics, uploads, through
/// `Deref`) and the node being converted, with the graph it belongs to.
pub struct BuildCtx<'a> {
    /// The engine side: what layers are built with.
    pub layer: LayerCtx<'a>,
    /// The optimised graph being lowered.
    pub graph: &'a Graph,
    /// The value of each node (None for weights).
    pub(crate) node_values: Vec<Option<ValueId>>,
    /// The node being converted.
    pub(crate) current: NodeId,
    /// Each node's precision (`engine::resolve::node_precisions`): the engine's unless a per-layer rule says otherwise.
    pub(crate) precisions: Vec<Precision>,
    /// An 8-bit engine's 8-bit convs and stored quantisers (empty plan otherwise).
    pub eight_bit: EightBitPlan,
}

impl<'a> Deref for BuildCtx<'a> {
    type Target = LayerCtx<'a>;
    fn deref(&self) -> &LayerCtx<'a> {
        &self.layer
    }
}

impl DerefMut for BuildCtx<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.layer
    }
}

impl<'a> BuildCtx<'a> {
    /// Makes `id` the node being converted: the layer context takes its module path, op name,
    /// precision and output value. The values it reads are set by the builder (`LayerCtx::reads`).
    pub(crate) fn set_current(&mut self, id: NodeId) {
        let n = &self.graph.nodes[id];
        self.current = id;
        self.layer.path.clone_from(&n.path);
        self.layer.op = n.op.name().to_string();
        self.layer.precision = self.precisions.get(id).copied().unwrap_or(self.layer.config.precision);
        self.layer.writes = self.node_values[id];
    }

    pub fn node(&self, id: NodeId) -> &'a Node {
        &self.graph.nodes[id]
    }

    /// The value of a node's `i`-th input, which must be an activation (not a weight).
    /// For the node being converted, the value in the layout its op asked for.
    pub fn input(&self, node: NodeId, i: usize) -> Result<ValueId> {
        let n = self.node(node);
        let src = *n.inputs.get(i).ok_or_else(|| self.err(node, LowerKind::Operands, format!("has no input {i}")))?;
        let v = if node == self.current { self.layer.reads.get(i).copied().flatten() } else { self.node_values[src] };
        v.ok_or_else(|| self.err(node, LowerKind::Weights, format!("input {i} is a weight, but an activation is expected here")))
    }

    /// The node's output value.
    pub fn output(&self, node: NodeId) -> Result<ValueId> {
        self.node_values[node].ok_or_else(|| self.err(node, LowerKind::Operands, "has no output value"))
    }

    /// The host data of a node's `i`-th input, which must be a weight.
    pub fn weight(&self, node: NodeId, i: usize) -> Result<&'a Arc<HostTensor>> {
        let n = self.node(node);
        let src = *n.inputs.get(i).ok_or_else(|| self.err(node, LowerKind::Operands, format!("has no input {i}")))?;
        self.graph
            .weight_data(src)
            .ok_or_else(|| self.err(node, LowerKind::Weights, format!("input {i} must be a weight (constant), but it is computed")))
    }

    /// A tactic key for the node's problem: its op with attributes, its inputs' and its output's
    /// per-image dims. Equal keys share a timing (and a timing-cache entry).
    pub fn problem_key(&self, node: NodeId) -> String {
        let n = self.node(node);
        let ins: Vec<String> = n.inputs.iter().map(|&i| format!("{:?}", self.node(i).shape[1..].to_vec())).collect();
        format!("{} {:?} in {} out {:?}", n.op.name(), n.op, ins.join(","), &n.shape[1..])
    }

    /// An error naming the node's op and module path.
    pub fn err(&self, node: NodeId, kind: LowerKind, reason: impl std::fmt::Display) -> Error {
        let n = self.node(node);
        Error::Lower { path: n.path.clone(), op: n.op.name().to_string(), kind, reason: reason.to_string() }
    }
}
