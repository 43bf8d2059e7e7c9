//! `compare --layerwise` finds a planted error: one layer's weights of ResNet-18 are perturbed, the
//! model runs on the CPU executor against a reference made by the CPU executor with the original
//! weights (in the export script's format: `input`, `output.<name>`, `intermediate.<path>`), and
//! the report must name exactly that layer as the first whose error jumps.

use kiln::dev::layerwise::{mark_all, run, LayerwiseReport};
use kiln::{Graph, HostTensor, VarBuilder};
use std::collections::BTreeMap;

/// Small inputs keep the CPU runs quick; every layer still runs.
const SIZE: usize = 64;

fn trace(vb: VarBuilder) -> Graph {
    kiln_models::trace("resnet18", vb, 1, SIZE).expect("trace resnet18")
}

/// A reference as tools/export_reference.py writes it, made by the CPU executor.
fn reference() -> BTreeMap<String, HostTensor> {
    let x = kiln::dev::weight("input.0", &[1, 3, SIZE, SIZE]);
    let out = kiln::run_cpu(&mark_all(&trace(VarBuilder::seeded())), &[("input", &x)]).expect("cpu reference");
    let mut r: BTreeMap<String, HostTensor> =
        out.into_iter().map(|(k, v)| if k.starts_with("intermediate.") { (k, v) } else { (format!("output.{k}"), v) }).collect();
    r.insert("input".into(), x);
    r
}

/// The seeded weights with `key` changed by `f`.
fn perturbed(key: &str, f: impl Fn(f32) -> f32) -> VarBuilder {
    let mut weights: BTreeMap<String, HostTensor> =
        trace(VarBuilder::seeded()).weights.iter().map(|(k, v)| (k.clone(), HostTensor::clone(v))).collect();
    let w = weights.get_mut(key).unwrap_or_else(|| panic!("no weight `{key}`"));
    w.data.iter_mut().for_each(|v| *v = f(*v));
    VarBuilder::from_tensors(weights)
}

fn layerwise(vb: VarBuilder, reference: &BTreeMap<String, HostTensor>) -> LayerwiseReport {
    run(&trace(vb), reference, 1e-5, |g, x| kiln::run_cpu(g, &[("input", x)])).expect("layerwise")
}

#[test]
fn unperturbed_weights_pass_everywhere() {
    let reference = reference();
    let report = layerwise(VarBuilder::seeded(), &reference);
    println!("{report}");
    assert!(report.passes());
    assert!(report.first_jump().is_none());
    // Every op of ResNet-18 was compared: each has a reference intermediate under its path.
    let ops = trace(VarBuilder::seeded())
        .nodes
        .iter()
        .filter(|n| !matches!(n.op, kiln::plugin::Op::Weight { .. } | kiln::plugin::Op::Input { .. }))
        .count();
    assert_eq!(report.layers.len(), ops);
    assert_eq!(report.outputs.len(), 1);
}

#[test]
fn a_perturbed_conv_is_named() {
    let reference = reference();
    let report = layerwise(perturbed("layer2.1.conv1.weight", |v| v * 1.5), &reference);
    println!("{report}");
    assert!(!report.passes());
    let jump = report.first_jump().expect("a jump");
    assert_eq!(jump.path, "layer2.1.conv1");
    assert_eq!(jump.upstream, 0.0, "everything before it matches exactly");
    // Layers after it carry the error forward without being named.
    let after = report.layers.iter().filter(|l| l.node > jump.node && !l.passes(1e-5)).count();
    assert!(after > 5, "the error propagates: {after} failing layers after the jump");
    assert!(report.to_string().contains("first layer whose error jumps: `layer2.1.conv1` (conv2d)"));
}

#[test]
fn a_perturbed_batchnorm_deep_in_the_network_is_named() {
    let reference = reference();
    let report = layerwise(perturbed("layer4.0.bn2.running_var", |v| v * 4.0), &reference);
    assert_eq!(report.first_jump().map(|l| l.path.as_str()), Some("layer4.0.bn2"), "{report}");
}
