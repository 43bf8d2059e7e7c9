//! The 8-bit plan's rules for the builder's value allocation: which nodes are not lowered (their
//! value is another node's), what a node's value is stored as, and which input is read straight
//! from its binding. `conv8::plan` decides where 8 bits go; these say what that means for values.

use super::config::BuildConfig;
use super::eight_bit::EightBitPlan;
use super::layer::Elem;
use super::precision::Precision;
use crate::graph::{Graph, NodeId};

/// What a computed node's value is: its name, its storage type, and the quantiser whose codes it
/// holds when its producer requantises in its epilogue.
pub(crate) struct NodeValue<'g> {
    pub name: &'g str,
    pub elem: Elem,
    /// The quantiser this value is the output of too (it is not lowered: its producer writes its
    /// codes).
    pub codes_of: Option<NodeId>,
}

impl EightBitPlan {
    /// The nodes an engine lowers as aliases of their input's value (no layer, no value of their
    /// own), or, for a quantiser a conv requantises into, of that conv's value:
    /// - a `Best` engine's activation quantisers but the `stored` ones (`best_aliases`);
    /// - quantisers folded into the 8-bit stem after them (`folded`);
    /// - quantisers whose codes the conv before them writes (`requant`).
    pub(crate) fn aliased(&self, graph: &Graph, config: &BuildConfig) -> Vec<bool> {
        let mut aliased = self.best_aliases(graph, config);
        aliased.iter_mut().zip(&self.folded).for_each(|(a, &f)| *a |= f);
        if self.format.is_some() {
            for &q in self.requant.iter().flatten() {
                aliased[q] = true;
            }
        }
        aliased
    }

    /// The nodes a `Best` engine lowers as aliases of their input: its activation quantisers
    /// (`calibrate::prepare_for_best`) but the `stored` ones, whose codes its INT8 convs read. They
    /// carry scales for the FP8 candidates of the layers that read them and compute nothing
    /// themselves. None in other precisions.
    fn best_aliases(&self, graph: &Graph, config: &BuildConfig) -> Vec<bool> {
        let best = config.precision == Precision::Best;
        crate::ops::activation_quantisers(graph).into_iter().zip(&self.stored).map(|(q, &stored)| best && !stored && q).collect()
    }

    /// Node `id`'s value, where it computes in `computed`: a conv that requantises writes its
    /// quantiser's value (the codes, named after the quantiser); a stored quantiser's value is its
    /// codes; anything else is stored in its own precision.
    pub(crate) fn node_value<'g>(&self, graph: &'g Graph, id: NodeId, computed: Elem) -> NodeValue<'g> {
        let codes = self.format.map(EightBitPlan::elem);
        let own = |elem| NodeValue { name: graph.nodes[id].path.as_str(), elem, codes_of: None };
        match (self.requant[id], codes) {
            (Some(q), Some(elem)) => NodeValue { name: graph.nodes[q].path.as_str(), elem, codes_of: Some(q) },
            (_, Some(elem)) if self.stored[id] => own(elem),
            _ => own(computed),
        }
    }

    /// Whether f32 input `id` is read from its binding as the user hands it over (NCHW f32): its
    /// only reader is a quantiser folded into the 8-bit stem, so no entry reformat runs.
    pub(crate) fn reads_binding(&self, readers: &[Vec<NodeId>], id: NodeId) -> bool {
        matches!(readers[id][..], [q] if self.folded[q])
    }
}
