//! Graph files exported by kiln-torch (tests/fixtures/imported/, written by
//! `python3 tools/export_imported_fixtures.py`): each one runs on the CPU executor against PyTorch's
//! outputs, at the exported batch and at batch 2; and the structured code generated from it
//! (tests/generated/imported/, kept current by tests/imported_codegen.rs) compiles here, loads the
//! graph file's weights with every key used, and traces a graph with the same outputs.

#[path = "generated/imported/handwritten.rs"]
mod handwritten;
#[path = "generated/imported/tiny_deeplab.rs"]
mod tiny_deeplab;
#[path = "generated/imported/tiny_efficientnet_v2.rs"]
mod tiny_efficientnet_v2;
#[path = "generated/imported/tiny_lraspp.rs"]
mod tiny_lraspp;
#[path = "generated/imported/tiny_mobilenet_v2.rs"]
mod tiny_mobilenet_v2;
#[path = "generated/imported/tiny_regnet.rs"]
mod tiny_regnet;
#[path = "generated/imported/tiny_resnet.rs"]
mod tiny_resnet;
#[path = "generated/imported/tiny_swin.rs"]
mod tiny_swin;
#[path = "generated/imported/tiny_swin_opwise.rs"]
mod tiny_swin_opwise;
#[path = "generated/imported/tiny_vit.rs"]
mod tiny_vit;
#[path = "generated/imported/tiny_yolov8.rs"]
mod tiny_yolov8;

use kiln::compare;
use kiln::files::read_safetensors;
use kiln::{Graph, HostTensor, Result, VarBuilder};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Relative L2 error allowed between Kiln's CPU executor and PyTorch, both in FP32.
const TOL: f64 = 1e-5;
/// Between the graph file and the graph its generated code traces: the same ops on the same
/// weights.
const GENERATED_TOL: f64 = 1e-6;

type Build = fn(VarBuilder, usize) -> Result<Graph>;

const FIXTURES: &[(&str, Build)] = &[
    ("tiny_resnet", tiny_resnet::build),
    ("tiny_mobilenet_v2", tiny_mobilenet_v2::build),
    ("handwritten", handwritten::build),
    ("tiny_swin", tiny_swin::build),
    ("tiny_swin_opwise", tiny_swin_opwise::build),
    ("tiny_vit", tiny_vit::build),
    ("tiny_deeplab", tiny_deeplab::build),
    ("tiny_lraspp", tiny_lraspp::build),
    ("tiny_efficientnet_v2", tiny_efficientnet_v2::build),
    ("tiny_regnet", tiny_regnet::build),
    ("tiny_yolov8", tiny_yolov8::build),
];

fn fixture(name: &str) -> PathBuf {
    let dir =
        std::env::var_os("KILN_FIXTURES").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"), PathBuf::from);
    dir.join("imported").join(name)
}

fn graph_file(name: &str) -> PathBuf {
    fixture(&format!("{name}.kiln.safetensors"))
}

/// (the input, PyTorch's outputs by name) of a fixture.
fn reference(name: &str) -> (HostTensor, BTreeMap<String, HostTensor>) {
    let mut refs = read_safetensors(fixture(&format!("{name}.reference.safetensors"))).expect("reference file");
    // kiln-torch stores inputs by name (`input.input`); fixtures of older versions hold `input`.
    let x = refs.remove("input.input").or_else(|| refs.remove("input")).expect("reference input");
    let outputs = refs.into_iter().filter_map(|(k, v)| k.strip_prefix("output.").map(|k| (k.to_string(), v))).collect();
    (x, outputs)
}

/// `t` twice along the batch.
fn twice(t: &HostTensor) -> HostTensor {
    let mut shape = t.shape.clone();
    shape[0] *= 2;
    HostTensor::new(shape, [t.data.clone(), t.data.clone()].concat())
}

#[test]
fn imported_graphs_match_pytorch_on_the_cpu() {
    for (name, _) in FIXTURES {
        let graph = Graph::load(graph_file(name)).expect("graph file");
        assert!(!graph.modules.is_empty(), "{name}: kiln-torch records the module classes");
        let (x, want) = reference(name);
        for batch in [1, 2] {
            let input = if batch == 1 { x.clone() } else { twice(&x) };
            let got = kiln::run_cpu(&graph, &[("input", &input)]).unwrap_or_else(|e| panic!("{name}: {e}"));
            for (out, r) in &want {
                let r = if batch == 1 { r.clone() } else { twice(r) };
                let c = compare(&format!("{name}.{out} (batch {batch})"), &got[out], &r);
                println!("{c}");
                assert!(c.rel_l2 <= TOL, "{c}");
            }
        }
    }
}

#[test]
fn generated_modules_load_the_weights_and_reproduce_the_graph() {
    for (name, build) in FIXTURES {
        let path = graph_file(name);
        let file = Graph::load(&path).expect("graph file");
        let vb = VarBuilder::from_safetensors(&[&path]).expect("weights");
        let generated = build(vb.clone(), 1).unwrap_or_else(|e| panic!("{name}: the generated code does not trace: {e}"));
        vb.check_all_used().unwrap_or_else(|e| panic!("{name}: {e}"));
        let (x, _) = reference(name);
        let want = kiln::run_cpu(&file, &[("input", &x)]).expect("graph file on the CPU");
        let got = kiln::run_cpu(&generated, &[("input", &x)]).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (out, w) in &want {
            let c = compare(&format!("{name}.{out} (generated)"), &got[out], w);
            println!("{c}");
            assert!(c.rel_l2 <= GENERATED_TOL, "{c}");
        }
        let ops = |g: &Graph| g.nodes.iter().filter(|n| !n.op.is_leaf()).count();
        println!("{name}: {} ops traced by the generated code, {} in the graph file", ops(&generated), ops(&file));
    }
}
