//! A graph exported at batch 2 runs at any batch (issue 42), on Kiln's CPU executor: the graphs
//! kiln-torch's converters build for the batch-moving patterns (python/tests/test_any_batch.py
//! writes them, with NumPy's answer at batch 3, into tests/fixtures/any_batch_*):
//! - `stack_sum`: `torch.stack([x, relu(x), 2 * x]).sum(0)` (segmentation_models_pytorch's FPN);
//! - `token_qkv`: ViT's class token expanded to the batch and cat in front, then
//!   `qkv.reshape(B, N, 3, D).permute(2, 0, 1, 3).unbind(0)` and `q * k + v`;
//! - `windows`: window attention's batch merge (timm's Swin): `[B, H, W, C]` partitioned into
//!   windows as `[B·windows, N, C]`, a per-window constant, a softmax within each window, and back;
//! - `einsum_rows`: MViTv2's `einsum("bhwc,hck->bhwk")`, the batch moved behind `h` and merged
//!   with `w` for one batched matmul with a constant, then split off and moved back;
//! - `rnn_state`: an LSTM step of timm's Sequencer2d, the images' rows as `[B·rows, C]` sequences
//!   plus the folded initial state's `[1, B·rows, C]`, a constant of more dims than the step.

use kiln::{Graph, HostTensor};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// The pattern's graph, and its reference input and output at batch 3.
fn pattern(name: &str) -> (Graph, HostTensor, HostTensor) {
    let graph = kiln::files::graph::read(fixture(&format!("any_batch_{name}.kiln.safetensors"))).expect("graph fixture").graph;
    let mut reference = kiln::files::read_safetensors(fixture(&format!("any_batch_{name}.reference.safetensors"))).expect("reference");
    let x = reference.remove("input.x").expect("input.x");
    let y = reference.remove("output.output").expect("output.output");
    (graph, x, y)
}

/// The first `n` images of a batch.
fn images(t: &HostTensor, n: usize) -> HostTensor {
    let per = t.data.len() / t.shape[0];
    let mut shape = t.shape.clone();
    shape[0] = n;
    HostTensor::new(shape, t.data[..n * per].to_vec())
}

fn run_both(graph: &Graph, x: &HostTensor) -> [HostTensor; 2] {
    let out = |g: &Graph| kiln::run_cpu(g, &[("x", x)]).expect("run").remove("output").expect("output");
    [out(graph), out(&kiln::engine::optimize(graph).expect("optimize"))]
}

#[test]
fn graphs_exported_at_batch_2_run_at_batch_1_2_and_3() {
    for name in ["stack_sum", "token_qkv", "windows", "einsum_rows", "rnn_state"] {
        let (graph, x, want) = pattern(name);
        let traced = graph.inputs.first().map(|&i| graph.nodes[i].shape[0]);
        assert_eq!(traced, Some(2), "{name} was exported at batch 2");
        for n in [1, 2, 3] {
            for got in run_both(&graph, &images(&x, n)) {
                let c = kiln::compare("output", &got, &images(&want, n));
                assert!(c.shape_ok && c.rel_l2 < 1e-6, "{name} at batch {n}: {c}");
            }
        }
    }
}
