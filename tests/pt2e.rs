//! Models quantised in PyTorch (issue 38 item 4), as kiln-torch exports them
//! (tests/fixtures/pt2e/, written by `python tools/pt2e_check.py --fixtures tests/fixtures/pt2e`):
//!
//! - `tiny_resnet_pt2e`: a small ResNet (BasicBlocks, max-pool, a strided downsample, average
//!   pool, Linear) quantised with PyTorch's PT2E flow (torchao's `prepare_pt2e`/`convert_pt2e`,
//!   XNNPACKQuantizer's per-channel config with symmetric activations): its quantize/dequantize
//!   pairs became `fake_quantize` nodes, its int8 weights f32 weights carrying their grid;
//! - `tiny_resnet_qat_pt2e`: the same ResNet prepared for quantisation-aware training
//!   (`prepare_qat_pt2e`: torchao's fake-quant modules in the exported graph, its BatchNorms kept
//!   apart from the fake-quantised weights), a few training-mode passes, then eval with the
//!   observers off;
//! - `fake_quant_net`: eager QAT's `torch.ao.quantization.FakeQuantize` modules on activations
//!   and weights (observers off).
//!
//! Each runs as the CLI's `--cpu --int8` runs it (the CPU simulation of the INT8 engine, built from
//! the graph's own Q/DQ nodes) against PyTorch's quantised model on 4 inputs stored in the
//! fixture.

use kiln::compare;
use kiln::dev::quant::{has_quant_nodes, prepare_for_engine};
use kiln::engine::{BuildConfig, Precision, QuantFormat};
use kiln::files::read_safetensors;
use kiln::plugin::{Op, Quant};
use kiln::{Graph, HostTensor};
use std::path::PathBuf;

/// The fixtures match PyTorch exactly on these inputs (rel L2 0, 0 and 6e-8): every quantiser
/// rounds the same values to the same codes. A difference in the order of a sum can move a value
/// near a rounding boundary to the neighbouring code (tools/pt2e_check.py measures how far that
/// goes on ResNet-18 and MobileNetV2), so this is a bound, not a demand for bits.
const TOL: f64 = 1e-5;

fn fixture(name: &str) -> PathBuf {
    let dir =
        std::env::var_os("KILN_FIXTURES").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"), PathBuf::from);
    dir.join("pt2e").join(name)
}

fn load(name: &str) -> (Graph, HostTensor, HostTensor) {
    let graph = Graph::load(fixture(&format!("{name}.kiln.safetensors"))).expect("graph file");
    let mut refs = read_safetensors(fixture(&format!("{name}.reference.safetensors"))).expect("reference file");
    let x = refs.remove("input.input").expect("reference input");
    let y = refs.remove("output.output").expect("reference output");
    (graph, x, y)
}

/// The graph an INT8 engine lowers (and the CPU simulation runs): optimised, Q/DQ nodes as they
/// are, weight quantisers folded. No calibration cache: the scales are the graph's.
fn int8_graph(graph: &Graph) -> Graph {
    let optimized = kiln::engine::optimize(graph).expect("optimize");
    assert!(has_quant_nodes(&optimized), "the graph carries its own quantisation");
    prepare_for_engine(optimized, QuantFormat::Int8, None, &[]).expect("an INT8 engine's graph")
}

fn count(g: &Graph, f: impl Fn(&Op) -> bool) -> usize {
    g.nodes.iter().filter(|n| f(&n.op)).count()
}

#[test]
fn pytorch_quantised_models_match_pytorch_on_the_cpu_simulation() {
    for (name, quantisers, on_grid) in [("tiny_resnet_pt2e", 13, 7), ("tiny_resnet_qat_pt2e", 13, 7), ("fake_quant_net", 3, 3)] {
        let (graph, x, want) = load(name);
        // What kiln-torch made of PyTorch's quantisation: fake-quantisers only (no lone
        // quantize/dequantize), and every conv and Linear weight on its per-channel int8 grid.
        let fq = count(&graph, |op| matches!(op, Op::Quant(Quant::FakeQuantize(_))));
        let lone = count(&graph, |op| matches!(op, Op::Quant(Quant::Quantize(_) | Quant::Dequantize(_))));
        let grids: Vec<_> = graph
            .nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Weight { quant: Some(q), .. } => Some((n.path.clone(), q.clone())),
                _ => None,
            })
            .collect();
        println!("{name}: {fq} fake-quantisers, {lone} lone Q/DQ, {} weights on a grid", grids.len());
        assert_eq!((fq, lone, grids.len()), (quantisers, 0, on_grid), "{name}");
        for (path, q) in &grids {
            assert!(q.axis == Some(0) && q.is_symmetric() && (q.qmin, q.qmax) == (-127, 127), "{name}: {path}: {q:?}");
        }
        let sim = int8_graph(&graph);
        let got = kiln::run_cpu(&sim, &[("input", &x)]).unwrap_or_else(|e| panic!("{name}: {e}"));
        let c = compare(&format!("{name} (INT8 simulation against PyTorch's quantised model)"), &got["output"], &want);
        println!("{c}");
        assert!(c.rel_l2 <= TOL, "{c}");
        // The same graph run as it is (no precision): its Q/DQ nodes are its arithmetic.
        let plain = kiln::run_cpu(&graph, &[("input", &x)]).expect("the graph as it is");
        let c = compare(&format!("{name} (f32 executor)"), &plain["output"], &want);
        assert!(c.rel_l2 <= TOL, "{c}");
    }
}

/// What an INT8 engine of the PT2E graph puts on the 8-bit kernel (`dev::plan::eight_bit_plan` at
/// sm_90, no GPU): the weights' grids are the engine's (per output channel, symmetric), and the
/// activation quantisers are per tensor and symmetric, so a conv whose input quantiser only
/// 8-bit convs read runs on it. PT2E quantises each conv's output before the residual add
/// (XNNPACK's pattern), so the add stays outside the conv, and a block input that the add reads
/// as well is not stored as codes: a conv reading it computes in FP16 on its Q/DQ values.
#[test]
fn pt2e_graph_plans_its_convs_as_an_int8_engine_would() {
    let (graph, _, _) = load("tiny_resnet_pt2e");
    let g = int8_graph(&graph);
    let config = BuildConfig::default().precision(Precision::Int8);
    let plan = kiln::dev::plan::eight_bit_plan(&g, &config, 90);
    let names = |v: &[bool]| -> Vec<String> { v.iter().enumerate().filter(|(_, &b)| b).map(|(i, _)| g.nodes[i].path.clone()).collect() };
    let convs: Vec<String> = g.nodes.iter().filter(|n| matches!(n.op, Op::Conv(_))).map(|n| n.path.clone()).collect();
    println!("convs {convs:?}\n8-bit convs {:?}\nstored {:?}", names(&plan.conv), names(&plan.stored));
    assert_eq!(plan.format, Some(QuantFormat::Int8));
    // Every weight the convs read lies on the grid the engine's 8-bit kernels take.
    for n in g.nodes.iter().filter(|n| matches!(n.op, Op::Conv(_))) {
        assert!(matches!(&g.nodes[n.inputs[1]].op, Op::Weight { quant: Some(_), .. }), "{}", n.path);
    }
    // The convs whose input quantiser is read by 8-bit convs alone run on the kernel.
    for (id, n) in g.nodes.iter().enumerate().filter(|(_, n)| matches!(n.op, Op::Conv(_))) {
        let input = n.inputs[0];
        let readers: Vec<usize> = (0..g.nodes.len()).filter(|&r| g.nodes[r].inputs.contains(&input)).collect();
        if plan.conv[id] {
            assert!(plan.stored[input] && readers.iter().all(|&r| plan.conv[r]), "{}", n.path);
        }
    }
    // `conv1` reads 3 channels; `layer1.conv1` reads the max-pool's quantiser, which the block's
    // residual add reads too. The others run on the kernel.
    assert_eq!(names(&plan.conv), ["layer1.conv2", "layer2.conv1", "layer2.conv2", "layer2.downsample.0"]);
}
