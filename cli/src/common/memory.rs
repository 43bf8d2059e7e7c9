//! The CPU executor's memory: its peak for a graph, and the check that it fits before a run.

use kiln::{Error, Graph, Result};

/// The CPU executor's peak activation memory for `graph`, in bytes: values live from the node that
/// makes them to their last reader (as `kiln::run_cpu` frees them), doubled for scratch (im2col,
/// allocator slack). Weights are already in memory and not counted.
pub fn cpu_peak_bytes(graph: &Graph) -> usize {
    let size = |id: usize| kiln::dev::numel(&graph.nodes[id].shape).map_or(usize::MAX, |n| n.saturating_mul(4));
    let mut last = vec![0usize; graph.nodes.len()];
    for (i, n) in graph.nodes.iter().enumerate() {
        n.inputs.iter().for_each(|&j| last[j] = i);
    }
    graph.outputs.iter().for_each(|&(_, o)| last[o] = usize::MAX);
    let (mut live, mut peak) = (0usize, 0usize);
    for (i, n) in graph.nodes.iter().enumerate() {
        if matches!(n.op, kiln::plugin::Op::Weight { .. }) {
            continue;
        }
        live = live.saturating_add(size(i));
        peak = peak.max(live);
        for &j in &n.inputs {
            if last[j] == i && !matches!(graph.nodes[j].op, kiln::plugin::Op::Weight { .. }) {
                live = live.saturating_sub(size(j));
            }
        }
    }
    peak.saturating_mul(2)
}

/// Refuses a CPU run whose activations cannot fit in the memory available, before allocating.
/// The graph may be traced at another batch than the run's: its peak is scaled to `batch`.
/// `shape` describes the input for the message (`224x224`).
pub fn check_cpu_memory(graph: &Graph, batch: usize, shape: &str) -> Result<()> {
    let traced_batch = graph.inputs.first().and_then(|&i| graph.nodes[i].shape.first().copied()).unwrap_or(1).max(1);
    let bytes = (cpu_peak_bytes(graph) / traced_batch).saturating_mul(batch);
    // The smallest of MemAvailable, `ulimit -v`/`-d` and the memory cgroup's limit.
    match kiln::dev::memory_available() {
        Some(kiln::dev::Available { bytes: avail, limit }) if bytes > avail => Err(Error::OutOfMemory {
            what: format!(
                "the CPU executor at --batch {batch}, {shape} (only {avail} bytes are available ({limit}); lower --batch or --size)"
            ),
            bytes,
        }),
        _ => Ok(()),
    }
}
