//! `Precision::Best`, TensorRT's `--best`: per layer the fastest of FP16, FP8 GEMMs and INT8 convs
//! on 8-bit tensor cores, by timing.
//!
//! FP16 and the FP8 GEMMs read and write FP16 values, so each layer's tactic timing already picks
//! between them. An INT8 conv reads and writes 8-bit codes, so its choice is not its own: every
//! reader of a stored tensor must be an 8-bit conv (`ops::eight_bit_plan`). The build therefore lowers two
//! whole plans, every conv in 16 bits (FP16 or FP8 GEMM) and every conv that can on INT8, and
//! profiles both layer by layer. It then searches the sets of INT8 convs that `ops::eight_bit_plan`
//! allows, starting from all of them and moving groups of convs that must agree (the readers of
//! one stored tensor; the 8-bit stem with the convs reading its codes) to 16 bits while the
//! modelled time falls. The model costs each node by its measured time in the plan where it ran
//! as it would run in the candidate set, and a quantiser that the set newly lowers as a kernel
//! (its producer no longer writes its codes) by its bytes ([`QUANTISE_BYTES_PER_MS`]). The chosen
//! set is lowered (its tactics come from the first two plans' timings) and profiled too, and the
//! fastest of the measured plans is the engine. Its INT8 convs are recorded in the engine's
//! `BuildConfig::best_int8_layers`, so a loaded engine lowers the same plan without searching.

use super::config::BuildConfig;
use super::eight_bit::{self, EightBitPlan};
use super::resolve::node_precisions;
use crate::graph::{Graph, NodeId, Op};
use crate::Result;
use std::collections::{BTreeMap, HashSet};

/// Device time per module path, in milliseconds, summed over the path's layers.
pub type LayerTimes = BTreeMap<String, f64>;

/// A quantiser kernel's assumed throughput where no profiled plan ran it: bytes moved (2 read, 1
/// written per element) per millisecond. About 60% of an H100's 3.35 TB/s, what the FP16→code
/// kernels reach on ResNet-sized tensors.
pub const QUANTISE_BYTES_PER_MS: f64 = 2.0e9;
/// A kernel's fixed cost, added to each estimated quantiser (ms).
const LAUNCH_MS: f64 = 0.002;
/// Replays per layer when profiling a candidate plan.
pub(crate) const PROFILE_ITERS: usize = 20;

/// The convs a `Best` build starts its search from: every conv that can run on INT8 (module
/// paths). Empty where there is nothing to search: no conv can, or the tactic sources leave out
/// the 8-bit kernels (Best keeps its 16-bit layers).
pub(crate) fn int8_convs(graph: &Graph, config: &BuildConfig, sm: u32) -> Vec<String> {
    let precisions = node_precisions(graph, config);
    let all = crate::ops::eight_bit_plan(graph, &BuildConfig { best_int8_layers: None, ..config.clone() }, &precisions, sm);
    let allowed = config.tactic_sources.as_ref().is_none_or(|sources| {
        sources.iter().any(|s| [eight_bit::KIND, eight_bit::LIBRARY_KIND].iter().any(|k| k.starts_with(s.as_str()) || s.starts_with(k)))
    });
    if allowed {
        paths(graph, &all.conv)
    } else {
        Vec::new()
    }
}

/// Searches a `Best` engine's INT8 convs (module docs) from `int8` (`int8_convs`, not empty):
/// `measure` lowers the graph with the INT8 convs it is given and profiles the plan layer by
/// layer at the opt batch (the builder's lowering and `profile_layers`). Returns the fastest
/// measured engine and the search's line for the build summary.
pub(crate) fn search<E>(
    graph: &Graph,
    config: &BuildConfig,
    sm: u32,
    int8: Vec<String>,
    mut measure: impl FnMut(Vec<String>) -> Result<(E, LayerTimes)>,
) -> Result<(E, String)> {
    let batch = config.opt_batch;
    let mut sets = vec![vec![], int8.clone()];
    let mut measured = Vec::new();
    for layers in sets.clone() {
        measured.push(measure(layers)?);
    }
    let chosen = choose(graph, config, sm, batch, &measured[0].1, &measured[1].1);
    if !chosen.is_empty() && chosen != int8 {
        sets.push(chosen.clone());
        measured.push(measure(chosen)?);
    }
    let totals: Vec<f64> = measured.iter().map(|(_, t)| t.values().sum()).collect();
    let fastest = (0..totals.len()).min_by(|&a, &b| totals[a].total_cmp(&totals[b])).expect("two plans were measured");
    let (engine, _) = measured.swap_remove(fastest);
    let int8_layers = sets[fastest].len();
    let mixed = totals.get(2).map(|t| format!(", the modelled mix {t:.3} ms")).unwrap_or_default();
    let line = format!(
        "best search at batch {batch}, layers profiled one by one: every conv in 16 bits {:.3} ms, every conv that can ({}) on INT8 {:.3} ms{mixed}; kept the {} plan ({int8_layers} INT8 convs)",
        totals[0],
        int8.len(),
        totals[1],
        ["16-bit", "INT8", "mixed"][fastest],
    );
    Ok((engine, line))
}

/// The module paths of the nodes `which` marks.
fn paths(graph: &Graph, which: &[bool]) -> Vec<String> {
    graph.nodes.iter().zip(which).filter(|(_, &w)| w).map(|(n, _)| n.path.clone()).collect()
}

/// The INT8 convs (module paths) of the fastest mix the model finds (module docs), from the
/// layer times of the all-16-bit plan (`fp16`) and of the all-INT8 plan (`int8`) at `batch`.
/// Empty when every conv is faster in 16 bits.
pub fn choose(graph: &Graph, config: &BuildConfig, sm: u32, batch: usize, fp16: &LayerTimes, int8: &LayerTimes) -> Vec<String> {
    let precisions = node_precisions(graph, config);
    let plan_of = |layers: Option<Vec<String>>| {
        crate::ops::eight_bit_plan(graph, &BuildConfig { best_int8_layers: layers, ..config.clone() }, &precisions, sm)
    };
    let all = plan_of(None);
    let cost = |plan: &EightBitPlan| modelled_ms(graph, plan, &all, batch, fp16, int8);
    let groups = groups(graph, &all);
    let (mut current, mut best) = (all.conv.clone(), cost(&all));
    // Each pass tries every group the other way; a few passes settle any graph seen so far.
    for _ in 0..4 {
        let mut improved = false;
        for group in &groups {
            let on = !current[group[0]];
            let mut set = current.clone();
            group.iter().for_each(|&c| set[c] = on);
            let plan = plan_of(Some(paths(graph, &set)));
            let c = cost(&plan);
            if c < best - 1e-9 {
                (current, best) = (plan.conv, c);
                improved = true;
            }
        }
        if !improved {
            break;
        }
    }
    paths(graph, &current)
}

/// The modelled time of `plan` (ms): each node's measured time in the plan where it runs as it
/// would here (its INT8 conv in `int8`, anything else in `fp16`), plus the quantisers `plan`
/// lowers as kernels: measured where `all` (the all-INT8 plan) lowered them too, estimated from
/// their bytes where `all`'s producer wrote their codes.
fn modelled_ms(graph: &Graph, plan: &EightBitPlan, all: &EightBitPlan, batch: usize, fp16: &LayerTimes, int8: &LayerTimes) -> f64 {
    let writes_codes = |p: &EightBitPlan, q: NodeId| graph.nodes[q].inputs.first().is_some_and(|&src| p.requant[src] == Some(q));
    let mut seen = HashSet::new();
    let mut total = 0.0;
    for (id, node) in graph.nodes.iter().enumerate() {
        if !seen.insert(node.path.as_str()) {
            continue;
        }
        let time = |t: &LayerTimes| t.get(&node.path).copied().unwrap_or(0.0);
        total += match &node.op {
            Op::Quant(_) if plan.stored[id] && !plan.folded[id] && !writes_codes(plan, id) => {
                if all.stored[id] && !writes_codes(all, id) {
                    time(int8)
                } else {
                    let bytes = node.shape.iter().skip(1).product::<usize>() as f64 * batch as f64 * 3.0;
                    bytes / QUANTISE_BYTES_PER_MS + LAUNCH_MS
                }
            }
            // Aliased, folded into the stem, or written by the conv before it.
            Op::Quant(_) => 0.0,
            _ if plan.conv[id] => time(int8),
            _ => time(fp16),
        };
    }
    total
}

/// The convs of `all`'s 8-bit set that must agree, as groups (each a list of node ids): the
/// readers of one stored tensor, and the 8-bit stem, which writes only codes, with the readers
/// of its output.
fn groups(graph: &Graph, all: &EightBitPlan) -> Vec<Vec<NodeId>> {
    let len = graph.nodes.len();
    let mut parent: Vec<NodeId> = (0..len).collect();
    fn root(parent: &mut [NodeId], mut i: NodeId) -> NodeId {
        while parent[i] != i {
            parent[i] = parent[parent[i]];
            i = parent[i];
        }
        i
    }
    let readers = graph.readers();
    let mut join = |a: NodeId, b: NodeId| {
        let (ra, rb) = (root(&mut parent, a), root(&mut parent, b));
        parent[ra] = rb;
    };
    for q in (0..len).filter(|&q| all.stored[q]) {
        readers[q].windows(2).for_each(|w| join(w[0], w[1]));
    }
    for (id, n) in graph.nodes.iter().enumerate() {
        if let (true, Op::Conv(a), Some(q)) = (all.conv[id], &n.op, all.requant[id]) {
            if a.pool.is_some() {
                readers[q].iter().for_each(|&r| join(id, r));
            }
        }
    }
    let mut groups: BTreeMap<NodeId, Vec<NodeId>> = BTreeMap::new();
    for id in (0..len).filter(|&id| all.conv[id]) {
        groups.entry(root(&mut parent, id)).or_default().push(id);
    }
    groups.into_values().collect()
}
