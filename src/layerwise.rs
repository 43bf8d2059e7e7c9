//! Layer-by-layer comparison with a reference (what Polygraphy's `--mark all` is used for): every
//! intermediate the reference holds is marked as a graph output, the graph runs once, and each
//! layer's error is reported in graph order with the first layer whose error *jumps*, the likely
//! culprit, named by its module path.
//!
//! The reference is a safetensors file from `tools/export_reference.py --intermediates all`:
//! `input`, `output.<name>` and `intermediate.<module path>`. A module PyTorch calls several times
//! (torchvision reuses `relu` within a block) is also stored per call as `intermediate.<path>#<k>`;
//! the k-th Kiln node with that path is matched to call k.

use crate::compare::{compare, Comparison};
use crate::graph::{Graph, HostTensor, NodeId, Op};
use crate::{Error, Result};
use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// A layer's error is a jump when it exceeds the tolerance and is this many times the largest error
/// of the compared layers feeding it: error that is only carried forward grows slowly, a broken
/// layer multiplies it.
pub const JUMP_FACTOR: f64 = 10.0;

/// One compared intermediate.
#[derive(Clone, Debug)]
pub struct LayerError {
    /// The graph node (in the graph given to [`run`]).
    pub node: NodeId,
    /// Its module path (`layer2.0.conv1`).
    pub path: String,
    /// Its key in the reference (`intermediate.layer2.0.conv1`, or `...relu#1` for a repeated call).
    pub key: String,
    pub op: String,
    pub comparison: Comparison,
    /// The largest error among the compared layers this one reads (through uncompared nodes).
    pub upstream: f64,
}

impl LayerError {
    /// The error passes the tolerance.
    pub fn passes(&self, rtol: f64) -> bool {
        self.comparison.passes(rtol)
    }
    /// Fails the tolerance and is at least `JUMP_FACTOR` times the error it was fed.
    pub fn is_jump(&self, rtol: f64) -> bool {
        // Written so that a NaN error counts as a jump.
        let carried = self.comparison.rel_l2 <= JUMP_FACTOR * self.upstream;
        !self.passes(rtol) && !carried
    }
}

/// The result of a layerwise comparison.
#[derive(Clone, Debug)]
pub struct LayerwiseReport {
    pub rtol: f64,
    /// Compared intermediates, in graph order.
    pub layers: Vec<LayerError>,
    /// The final outputs against `output.<name>`.
    pub outputs: Vec<Comparison>,
    /// Reference intermediates no graph node matched (modules Kiln traces differently or not at all).
    pub unmatched: Vec<String>,
}

impl LayerwiseReport {
    /// The first layer (graph order) whose error jumps; where none does but some layer fails, the
    /// first failing one.
    pub fn first_jump(&self) -> Option<&LayerError> {
        self.layers.iter().find(|l| l.is_jump(self.rtol)).or_else(|| self.first_failure())
    }
    /// The first layer over the tolerance.
    pub fn first_failure(&self) -> Option<&LayerError> {
        self.layers.iter().find(|l| !l.passes(self.rtol))
    }
    /// Every intermediate and output passes.
    pub fn passes(&self) -> bool {
        self.layers.iter().all(|l| l.passes(self.rtol)) && self.outputs.iter().all(|c| c.passes(self.rtol))
    }
}

impl fmt::Display for LayerwiseReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let jump = self.first_jump().map(|l| l.node);
        writeln!(f, "{:<44} {:<22} {:>10} {:>10}  ", "layer (module path)", "op", "rel_l2", "max_abs")?;
        for l in &self.layers {
            let c = &l.comparison;
            let mark = match () {
                _ if Some(l.node) == jump => "  <-- first jump",
                _ if !l.passes(self.rtol) => "  FAIL",
                _ => "",
            };
            if c.shape_ok {
                writeln!(
                    f,
                    "{:<44} {:<22} {:>10.2e} {:>10.2e}{mark}",
                    l.key.trim_start_matches("intermediate."),
                    l.op,
                    c.rel_l2,
                    c.max_abs
                )?;
            } else {
                writeln!(f, "{:<44} {:<22} shape {:?} vs reference {:?}{mark}", l.path, l.op, c.got_shape, c.shape)?;
            }
        }
        for c in &self.outputs {
            writeln!(f, "output {c}  {}", if c.passes(self.rtol) { "pass" } else { "FAIL" })?;
        }
        if !self.unmatched.is_empty() {
            writeln!(
                f,
                "{} reference intermediates matched no node (e.g. {:?})",
                self.unmatched.len(),
                &self.unmatched[..self.unmatched.len().min(3)]
            )?;
        }
        match self.first_jump() {
            Some(l) => write!(
                f,
                "first layer whose error jumps: `{}` ({}): rel_l2 {:.2e}, fed {:.2e} by the layers before it",
                l.path, l.op, l.comparison.rel_l2, l.upstream
            ),
            None => {
                let failing: Vec<&str> = self.outputs.iter().filter(|c| !c.passes(self.rtol)).map(|c| c.name.as_str()).collect();
                if failing.is_empty() {
                    write!(f, "{} layers and {} outputs within rel_l2 {:.1e}", self.layers.len(), self.outputs.len(), self.rtol)
                } else {
                    write!(f, "{} layers within rel_l2 {:.1e}, but not the output(s) {}", self.layers.len(), self.rtol, failing.join(", "))
                }
            }
        }
    }
}

/// The reference key of each op node: `intermediate.<path>` or, when several nodes share a path,
/// `intermediate.<path>#<k>` for the k-th (and the plain key for the last, as the export script
/// stores the last call under it). Inputs and weights have none.
pub fn intermediate_keys(graph: &Graph) -> Vec<(NodeId, Vec<String>)> {
    let mut count: HashMap<&str, usize> = HashMap::new();
    for n in &graph.nodes {
        if !matches!(n.op, Op::Input { .. } | Op::Weight { .. }) {
            *count.entry(n.path.as_str()).or_default() += 1;
        }
    }
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut keys = Vec::new();
    for (id, n) in graph.nodes.iter().enumerate() {
        if matches!(n.op, Op::Input { .. } | Op::Weight { .. }) {
            continue;
        }
        let total = count[n.path.as_str()];
        let k = seen.entry(n.path.as_str()).or_default();
        let mut names = Vec::new();
        if total > 1 {
            names.push(format!("intermediate.{}#{k}", n.path));
        }
        if *k + 1 == total {
            names.push(format!("intermediate.{}", n.path));
        }
        *k += 1;
        keys.push((id, names));
    }
    keys
}

/// `graph` with, for each `(node, keys)`, the first key the reference holds marked as an output
/// (per-call keys come first: the plain key holds only the last call), and those (key, node) pairs
/// in graph order.
pub fn mark_intermediates(
    graph: &Graph,
    keys: &[(NodeId, Vec<String>)],
    reference: &BTreeMap<String, HostTensor>,
) -> (Graph, Vec<(String, NodeId)>) {
    let mut marked = graph.clone();
    let mut pairs = Vec::new();
    for (id, names) in keys {
        if let Some(key) = names.iter().find(|k| reference.contains_key(*k)) {
            marked.mark_output(key.clone(), *id);
            pairs.push((key.clone(), *id));
        }
    }
    (marked, pairs)
}

/// Every op node marked as an output under its reference key, for making a reference with Kiln
/// itself (tests, or checking one backend against another).
pub fn mark_all(graph: &Graph) -> Graph {
    let mut marked = graph.clone();
    for (id, names) in intermediate_keys(graph) {
        for key in names {
            marked.mark_output(key, id);
        }
    }
    marked
}

/// Runs `graph` once with every intermediate of `reference` marked as an output and compares each
/// against it. `execute` runs a graph on the reference's `input` (the CPU executor, or an engine
/// built from the graph) and returns its outputs by name.
pub fn run(
    graph: &Graph,
    reference: &BTreeMap<String, HostTensor>,
    rtol: f64,
    execute: impl FnOnce(&Graph, &HostTensor) -> Result<BTreeMap<String, HostTensor>>,
) -> Result<LayerwiseReport> {
    let keys = intermediate_keys(graph);
    run_keyed(graph, &keys, reference, rtol, execute)
}

/// `run` for an INT8/FP8 engine: the graph that runs is the quantised engine's own (`traced`
/// optimised, BatchNorm folded and ReLUs and residual adds fused, then Q/DQ nodes from `cache`, or
/// the graph's own Q/DQ nodes when it has them and `cache` is `None`), so marking intermediates
/// changes neither the fusion nor the quantisation (marking the traced graph would keep every
/// BatchNorm and ReLU apart, and the calibration cache, recorded on the fused graph, would not
/// apply). Each node of that graph is compared with the reference of the traced node whose value
/// it computes (`fused_keys`): a conv that absorbed `bn`, the residual add and `relu` against the
/// reference after the `relu`. `execute` gets the explicit Q/DQ graph: an engine builds it with
/// exactly its scales, the CPU executor runs the fake-quant simulation.
pub fn run_quantised(
    traced: &Graph,
    cache: Option<&crate::calibrate::CalibrationCache>,
    format: crate::graph::QuantFormat,
    reference: &BTreeMap<String, HostTensor>,
    rtol: f64,
    rules: &[crate::engine::LayerPrecision],
    execute: impl FnOnce(&Graph, &HostTensor) -> Result<BTreeMap<String, HostTensor>>,
) -> Result<LayerwiseReport> {
    let optimized = crate::passes::optimize(traced)?;
    let quantised = match cache {
        _ if crate::calibrate::has_quant_nodes(&optimized) => {
            crate::calibrate::check_rules_on_explicit(&optimized, rules)?;
            optimized
        }
        Some(cache) => crate::calibrate::quantize_graph(&optimized, cache, format, rules)?,
        None => {
            return Err(Error::Config {
                reason: format!("a layerwise comparison of a {} engine needs its calibration cache (--calibration-cache)", format.name()),
            })
        }
    };
    // The graph the CPU simulation runs: weights folded onto their grids and FP16 stored where
    // the engine stores it (`calibrate::simulation`), so that its logits are `simulate`'s.
    let simulated = crate::calibrate::simulation(&crate::calibrate::fold_constant_quant(&quantised)?, format, rules)?;
    let keys = fused_keys(traced, &simulated);
    run_keyed(&simulated, &keys, reference, rtol, execute)
}

/// For each node of `optimized` (`traced` after `passes::optimize`, possibly with Q/DQ nodes
/// inserted), the reference keys of the traced node whose value it computes: the node with the
/// same module path and op (the k-th such for the k-th), and for a conv that absorbed nodes the
/// last of them: its BatchNorm (when that BatchNorm's path is gone from `optimized`), then the
/// residual add (`residual`), the ReLU (`act`) and the max-pool (`pool`), in the order `passes`
/// fuses them; for a Linear (or the permute back after it) its folded layer scale, then its
/// residual add. Nodes with no traced counterpart (quantisers, a Linear whose permute took its
/// scale or add) get none.
pub fn fused_keys(traced: &Graph, optimized: &Graph) -> Vec<(NodeId, Vec<String>)> {
    use crate::graph::{Activation, Binary, Norm, Unary};
    let traced_keys: HashMap<NodeId, Vec<String>> = intermediate_keys(traced).into_iter().collect();
    let remaining: std::collections::HashSet<&str> = optimized.nodes.iter().map(|n| n.path.as_str()).collect();
    let readers = traced.readers();
    let only_reader = |id: NodeId, want: &dyn Fn(&Op) -> bool| match readers[id][..] {
        [r] if want(&traced.nodes[r].op) => Some(r),
        _ => None,
    };
    // Traced nodes by (path, op name), in graph order; each optimized node takes the next one.
    let mut by_name: HashMap<(&str, &str), std::collections::VecDeque<NodeId>> = HashMap::new();
    for (id, n) in traced.nodes.iter().enumerate() {
        if !n.op.is_leaf() {
            by_name.entry((n.path.as_str(), n.op.name())).or_default().push_back(id);
        }
    }
    let mut keys = Vec::new();
    for (id, n) in optimized.nodes.iter().enumerate() {
        if n.op.is_leaf() {
            continue;
        }
        let Some(mut t) = by_name.get_mut(&(n.path.as_str(), n.op.name())).and_then(|q| q.pop_front()) else { continue };
        if let Op::Conv(a) = &n.op {
            if let Some(bn) = only_reader(t, &|op| matches!(op, Op::Norm(Norm::BatchNorm2d { .. }))) {
                if !remaining.contains(traced.nodes[bn].path.as_str()) {
                    t = bn;
                }
            }
            if a.residual {
                t = only_reader(t, &|op| matches!(op, Op::Binary(Binary::Add))).unwrap_or(t);
            }
            if a.act == Activation::Relu {
                t = only_reader(t, &|op| matches!(op, Op::Unary(Unary::Relu))).unwrap_or(t);
            }
            if a.pool.is_some() {
                t = only_reader(t, &|op| matches!(op, Op::Pool(crate::graph::Pool::Max(_)))).unwrap_or(t);
            }
        }
        // `passes::fold_linear_scale` and `fuse_linear_add`: a Linear (or the permute after it)
        // that absorbed a constant Mul (gone from `optimized`) and an Add computes the Add's value;
        // a Linear whose permute took them computes none the trace has (scaled, in NHWC).
        let is_mul = |op: &Op| matches!(op, Op::Binary(Binary::Mul));
        let folded_mul = |t: NodeId| only_reader(t, &is_mul).filter(|&m| !remaining.contains(traced.nodes[m].path.as_str()));
        let residual_linear = |i: NodeId| matches!(optimized.nodes[i].op, Op::Gemm(crate::graph::Gemm::Linear { residual: true, .. }));
        let is_permute = |op: &Op| matches!(op, Op::Shape(crate::graph::ShapeOp::Permute { .. }));
        let mut keyless = false;
        match &n.op {
            Op::Gemm(crate::graph::Gemm::Linear { residual, .. }) => {
                if let Some(p) = only_reader(t, &is_permute) {
                    keyless = *residual || folded_mul(p).is_some();
                } else {
                    t = folded_mul(t).unwrap_or(t);
                    if *residual {
                        t = only_reader(t, &|op| matches!(op, Op::Binary(Binary::Add))).unwrap_or(t);
                    }
                }
            }
            Op::Shape(crate::graph::ShapeOp::Permute { .. })
                if n.inputs.first().is_some_and(|&i| optimized.nodes[i].op.name() == "linear") =>
            {
                t = folded_mul(t).unwrap_or(t);
                if residual_linear(n.inputs[0]) {
                    t = only_reader(t, &|op| matches!(op, Op::Binary(Binary::Add))).unwrap_or(t);
                }
            }
            _ => {}
        }
        keys.push((id, if keyless { Vec::new() } else { traced_keys.get(&t).cloned().unwrap_or_default() }));
    }
    keys
}

/// Marks the reference's intermediates on `graph` (`mark_intermediates`), runs it once and compares
/// each marked value with the reference.
fn run_keyed(
    graph: &Graph,
    keys: &[(NodeId, Vec<String>)],
    reference: &BTreeMap<String, HostTensor>,
    rtol: f64,
    execute: impl FnOnce(&Graph, &HostTensor) -> Result<BTreeMap<String, HostTensor>>,
) -> Result<LayerwiseReport> {
    let input = reference.get("input").ok_or_else(|| Error::MissingWeight { key: "input".into(), source_name: "the reference".into() })?;
    let (marked, pairs) = mark_intermediates(graph, keys, reference);
    let got = execute(&marked, input)?;
    let mut by_node: HashMap<NodeId, f64> = HashMap::new();
    let mut layers = Vec::new();
    for (key, id) in &pairs {
        let value = got.get(key).ok_or_else(|| Error::NoSuchOutput {
            name: key.to_string(),
            model: "the run".into(),
            outputs: got.keys().cloned().collect(),
            hint: String::new(),
        })?;
        let comparison = compare(key, value, &reference[key]);
        // A shape mismatch has infinite error; it still ranks as the culprit.
        by_node.insert(*id, comparison.rel_l2);
        let node = &graph.nodes[*id];
        layers.push(LayerError {
            node: *id,
            path: node.path.clone(),
            key: key.clone(),
            op: node.op.name().to_string(),
            comparison,
            upstream: 0.0,
        });
    }
    // The error each node was fed: the max over its inputs of their own error if compared, else of
    // what they were fed (nodes are in topological order).
    let mut fed = vec![0.0f64; graph.nodes.len()];
    let mut carried = vec![0.0f64; graph.nodes.len()];
    for (id, node) in graph.nodes.iter().enumerate() {
        fed[id] = node.inputs.iter().map(|&i| carried[i]).fold(0.0, f64::max);
        carried[id] = by_node.get(&id).copied().unwrap_or(fed[id]);
    }
    for l in &mut layers {
        l.upstream = fed[l.node];
    }
    let mut outputs = Vec::new();
    for (name, _) in &graph.outputs {
        if let (Some(value), Some(r)) = (got.get(name), reference.get(&format!("output.{name}"))) {
            outputs.push(compare(name, value, r));
        }
    }
    let matched: Vec<&String> = pairs.iter().map(|(k, _)| k).collect();
    let unmatched = reference
        .keys()
        .filter(|k| k.starts_with("intermediate.") && !matched.contains(k))
        // A repeated module's plain key duplicates its last `#k` call.
        .filter(|k| k.contains('#') || !reference.contains_key(&format!("{k}#0")))
        .cloned()
        .collect();
    Ok(LayerwiseReport { rtol, layers, outputs, unmatched })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain() -> Graph {
        // input -> a.conv? no weights needed: relu, sigmoid, relu with a repeated path.
        let t = crate::Tracer::new();
        let x = t.input("input", &[1, 2]);
        let a = crate::Tensor::record("block.relu", Op::Unary(crate::graph::Unary::Relu), &[&x], &[]).expect("relu");
        let b = crate::Tensor::record("block.act", Op::Unary(crate::graph::Unary::Sigmoid), &[&a], &[]).expect("sigmoid");
        let c = crate::Tensor::record("block.relu", Op::Unary(crate::graph::Unary::Relu), &[&b], &[]).expect("relu");
        t.output("out", &c);
        t.graph()
    }

    #[test]
    fn repeated_paths_get_per_call_keys() {
        let g = chain();
        let keys = intermediate_keys(&g);
        assert_eq!(
            keys.iter().map(|(_, k)| k.clone()).collect::<Vec<_>>(),
            vec![
                vec!["intermediate.block.relu#0".to_string()],
                vec!["intermediate.block.act".to_string()],
                vec!["intermediate.block.relu#1".to_string(), "intermediate.block.relu".to_string()]
            ]
        );
    }

    #[test]
    fn a_planted_error_is_named_and_errors_downstream_are_not() {
        let g = chain();
        let x = HostTensor::new(vec![1, 2], vec![0.5, -1.0]);
        let reference_run = crate::cpu::run(&mark_all(&g), &[("input", &x)]).expect("cpu");
        let mut reference: BTreeMap<String, HostTensor> =
            reference_run.into_iter().map(|(k, v)| if k == "out" { ("output.out".to_string(), v) } else { (k, v) }).collect();
        reference.insert("input".into(), x);
        // An engine that gets `block.act` wrong: its output is off, and so is everything after it.
        let report = run(&g, &reference, 1e-5, |graph, input| {
            let mut out = crate::cpu::run(graph, &[("input", input)])?;
            for (name, v) in out.iter_mut() {
                if name == "intermediate.block.act" || name.starts_with("intermediate.block.relu#1") || name == "out" {
                    v.data.iter_mut().for_each(|x| *x += 0.25);
                }
            }
            Ok(out)
        })
        .expect("layerwise");
        assert_eq!(report.layers.len(), 3);
        assert!(report.layers[0].passes(1e-5));
        let jump = report.first_jump().expect("a jump");
        assert_eq!(jump.path, "block.act");
        assert!(!report.passes());
        assert!(report.to_string().contains("first layer whose error jumps: `block.act`"), "{report}");
        assert!(report.unmatched.is_empty(), "{:?}", report.unmatched);
    }
}
