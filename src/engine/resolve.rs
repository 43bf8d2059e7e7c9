//! A [`BuildConfig`] read against the graph it builds: its profiles checked against the graph's
//! inputs, the input dims each plan is lowered for, the profile a shape falls in, and the
//! precision each node computes in ([`node_precisions`]).

use super::config::{BuildConfig, DimsRange, InputDims, ShapeProfile};
use super::precision::Precision;
use crate::graph::{Graph, Op};
use crate::{Error, Result};
use std::collections::BTreeMap;

impl BuildConfig {
    /// Checks the profiles against the graph's inputs: each names existing inputs, with as many
    /// dims as the input has, `1 <= min <= opt <= max` dim by dim, and sizes that cannot overflow
    /// at the max batch.
    pub(crate) fn validate_profiles(&self, graph: &Graph) -> Result<()> {
        let inputs: BTreeMap<&str, usize> = graph.input_names().into_iter().zip(graph.inputs.iter().copied()).collect();
        for (p, profile) in self.profiles.iter().enumerate() {
            for (name, r) in profile {
                let bad = |reason: String| Error::Config { reason: format!("profile {p}, input `{name}`: {reason}") };
                let Some(&node) = inputs.get(name.as_str()) else {
                    return Err(bad(format!("the graph has no such input; it has {:?}", inputs.keys().collect::<Vec<_>>())));
                };
                let rank = graph.nodes[node].shape.len().saturating_sub(1);
                if [&r.min, &r.opt, &r.max].iter().any(|d| d.len() != rank) {
                    return Err(bad(format!(
                        "min {:?}, opt {:?} and max {:?} must each give the input's {rank} per-image dims (traced: {:?})",
                        r.min,
                        r.opt,
                        r.max,
                        &graph.nodes[node].shape[1..]
                    )));
                }
                if (0..rank).any(|d| !(1 <= r.min[d] && r.min[d] <= r.opt[d] && r.opt[d] <= r.max[d])) {
                    return Err(bad(format!(
                        "each dim must satisfy 1 <= min <= opt <= max, got min {:?}, opt {:?}, max {:?}",
                        r.min, r.opt, r.max
                    )));
                }
                if crate::graph::numel(&r.max).and_then(|n| n.checked_mul(self.max_batch)).is_none() {
                    return Err(bad(format!("max {:?} at batch {} has more elements than fit in memory", r.max, self.max_batch)));
                }
            }
        }
        Ok(())
    }

    /// The input dims each plan made at build is lowered for: per profile `opt` first (timed),
    /// then `max` and `min`; the traced dims when there are no profiles. Each entry gives every
    /// input's per-image dims by name; duplicates are dropped.
    pub fn build_shapes(&self, graph: &Graph) -> Vec<InputDims> {
        let traced: InputDims =
            graph.input_names().into_iter().zip(&graph.inputs).map(|(n, &i)| (n.to_string(), graph.nodes[i].shape[1..].to_vec())).collect();
        let mut shapes: Vec<InputDims> = Vec::new();
        let pick = |profile: &ShapeProfile, which: fn(&DimsRange) -> &Vec<usize>| {
            let mut dims = traced.clone();
            for (name, r) in profile {
                dims.insert(name.clone(), which(r).clone());
            }
            dims
        };
        for profile in &self.profiles {
            shapes.push(pick(profile, |r| &r.opt));
        }
        for profile in &self.profiles {
            shapes.push(pick(profile, |r| &r.max));
            shapes.push(pick(profile, |r| &r.min));
        }
        if shapes.is_empty() {
            shapes.push(traced);
        }
        let mut seen = Vec::new();
        shapes.retain(|s| {
            if seen.contains(s) {
                false
            } else {
                seen.push(s.clone());
                true
            }
        });
        shapes
    }

    /// The profile whose ranges hold `dims` (every input named by it inside its range, every other
    /// input at its traced dims), if any.
    pub fn profile_for(&self, graph: &Graph, dims: &InputDims) -> Option<usize> {
        let traced = |name: &str| {
            graph
                .inputs
                .iter()
                .find(|&&i| matches!(&graph.nodes[i].op, Op::Input { name: n } if n == name))
                .map(|&i| &graph.nodes[i].shape[1..])
        };
        self.profiles.iter().position(|p| {
            dims.iter().all(|(name, d)| match p.get(name) {
                Some(r) => r.contains(d),
                None => traced(name) == Some(d.as_slice()),
            })
        })
    }
}

/// The precision each node of an optimised graph computes in: the engine's, unless a rule of the
/// graph (`Graph::fp32_layers`) or of the config (`BuildConfig::layer_precisions`) matches its
/// module path. A graph input takes its first reader's, so an FP32 first layer reads the f32
/// binding without a round trip through f16. Needs no GPU.
pub fn node_precisions(graph: &Graph, config: &BuildConfig) -> Vec<Precision> {
    let mut p: Vec<Precision> = graph.nodes.iter().map(|n| config.precision_of(&graph.fp32_layers, &n.path)).collect();
    for (id, node) in graph.nodes.iter().enumerate() {
        if matches!(node.op, Op::Input { .. }) {
            if let Some(reader) = graph.nodes.iter().position(|m| m.inputs.contains(&id)) {
                p[id] = p[reader];
            }
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::{Conv2d, Conv2dConfig};
    use crate::{Forward, Module, Tracer, VarBuilder};

    /// A conv, a ReLU and a second conv: each node gets its rule's precision, the input its
    /// first reader's, and the passes keep the graph's own FP32 patterns.
    #[test]
    fn nodes_lower_in_their_rules_precision() {
        let tracer = Tracer::new();
        let x = tracer.input("input", &[1, 3, 8, 8]);
        let vb = VarBuilder::seeded();
        let y = Conv2d::load(vb.pp("stem"), &Conv2dConfig::new(3, 8, 3).padding(1)).and_then(|c| c.forward(&x)).expect("stem");
        let y = y.relu().expect("relu");
        let y = Conv2d::load(vb.pp("head.conv"), &Conv2dConfig::new(8, 4, 1)).and_then(|c| c.forward(&y)).expect("head");
        tracer.output("y", &y.sigmoid().expect("sigmoid"));
        tracer.require_fp32("head.sigmoid");
        let graph = crate::passes::optimize(&tracer.graph()).expect("passes");
        assert_eq!(graph.fp32_layers, ["head.sigmoid"], "the passes keep the graph's rules");
        let of = |config: &BuildConfig| -> Vec<(String, Precision)> {
            let p = node_precisions(&graph, config);
            graph.nodes.iter().zip(p).filter(|(n, _)| !matches!(n.op, Op::Weight { .. })).map(|(n, p)| (n.path.clone(), p)).collect()
        };
        let fp16 = BuildConfig::default();
        let mixed = fp16.clone().layer_precision("stem", Precision::Fp32);
        // The ReLU is fused into the stem's conv, which keeps the conv's path.
        let paths: Vec<String> = of(&fp16).into_iter().map(|(p, _)| p).collect();
        assert_eq!(paths, ["input", "stem", "head.conv", "head.sigmoid"]);
        use Precision::{Fp16, Fp32};
        assert_eq!(of(&fp16).into_iter().map(|(_, p)| p).collect::<Vec<_>>(), [Fp16, Fp16, Fp16, Fp32]);
        assert_eq!(of(&mixed).into_iter().map(|(_, p)| p).collect::<Vec<_>>(), [Fp32, Fp32, Fp16, Fp32]);
        let all32 = BuildConfig::default().precision(Precision::Fp32).layer_precision("head", Precision::Fp16);
        assert_eq!(of(&all32).into_iter().map(|(_, p)| p).collect::<Vec<_>>(), [Fp32, Fp32, Fp16, Fp16]);
    }
}
