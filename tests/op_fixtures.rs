//! Every op fixture of `tests/fixtures/ops.reference.safetensors` (PyTorch, written by
//! `python3 tools/export_reference.py --op-fixtures --out tests/fixtures`) rebuilt through Kiln's
//! layers by its Kiln twin (each op family lists its own, `FIXTURE_TWINS` beside its ops), loading
//! the case's parameters from that file (`<case>.weight`, ...), run on the CPU executor and
//! compared with PyTorch's output.

use kiln::compare;
use kiln::dev::ops::{Fixture, FixtureTwin};
use kiln::files::read_safetensors;
use kiln::{
    nn::{Conv2d, Conv2dConfig, ConvTranspose2d},
    Forward, Module, Tensor, Tracer, VarBuilder,
};
use std::collections::BTreeMap;
use std::path::PathBuf;

const TOL: f64 = 1e-5;

/// `tests/fixtures/ops.reference.safetensors`, or under `KILN_FIXTURES` (carried test binaries).
fn fixture() -> PathBuf {
    let dir =
        std::env::var_os("KILN_FIXTURES").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"), PathBuf::from);
    dir.join("ops.reference.safetensors")
}

fn conv(vb: VarBuilder, x: &Tensor, c: Conv2dConfig) -> kiln::Result<Tensor> {
    Conv2d::load(vb, &c)?.forward(x)
}

/// The convolution family's twins, until they move beside its ops as every other family's did.
const CONV_TWINS: &[FixtureTwin] = &[
    ("conv2d_stride2_pad", |f| conv(f.vb, f.x, Conv2dConfig::new(3, 8, 3).stride(2).padding(1))),
    ("conv2d_dilation2", |f| conv(f.vb, f.x, Conv2dConfig::new(4, 5, 3).padding(2).dilation(2))),
    ("conv2d_groups", |f| conv(f.vb, f.x, Conv2dConfig::new(8, 12, 3).padding(1).groups(4))),
    ("conv2d_depthwise", |f| conv(f.vb, f.x, Conv2dConfig::new(6, 6, 3).stride(2).padding(1).groups(6))),
    ("conv2d_nonsquare_batch3", |f| conv(f.vb, f.x, Conv2dConfig::new(3, 4, 5).padding(1).bias(false))),
    ("conv_transpose2d_outpad_groups", |f| {
        ConvTranspose2d::load(f.vb, &Conv2dConfig::new(4, 6, 3).stride(2).padding(1).output_padding(1).groups(2))?.forward(f.x)
    }),
    ("conv_transpose2d_k4s2", |f| ConvTranspose2d::load(f.vb, &Conv2dConfig::new(6, 4, 4).stride(2).padding(1).bias(false))?.forward(f.x)),
];

/// The Kiln twin of each PyTorch case in `op_cases()` of the export script, by case: each op
/// family's (`kiln::dev::ops::fixture_twins`), and the convolutions'. A case named twice is an error.
fn twins() -> BTreeMap<&'static str, FixtureTwin> {
    let all: Vec<FixtureTwin> = kiln::dev::ops::fixture_twins().into_iter().chain(CONV_TWINS.iter().copied()).collect();
    let by_case: BTreeMap<&'static str, FixtureTwin> = all.iter().map(|t| (t.0, *t)).collect();
    assert_eq!(by_case.len(), all.len(), "a fixture case has two twins");
    by_case
}

/// The case names of the fixture file.
fn cases(tensors: &BTreeMap<String, kiln::HostTensor>) -> Vec<&str> {
    tensors.keys().filter_map(|k| k.strip_suffix(".output")).collect()
}

#[test]
fn every_op_fixture_matches_pytorch() {
    let path = fixture();
    let tensors = read_safetensors(&path).expect("op fixtures");
    let weights = VarBuilder::from_safetensors(&[&path]).expect("op fixtures");
    let cases = cases(&tensors);
    assert!(cases.len() >= 20, "expected the full set of op fixtures, found {cases:?}");
    let twins = twins();
    let stale: Vec<&&str> = twins.keys().filter(|t| !cases.contains(t)).collect();
    assert!(stale.is_empty(), "twins of cases the fixture file does not have (regenerate it?): {stale:?}");
    let mut failures = vec![];
    for case in &cases {
        let tracer = Tracer::new();
        let x = tracer.input("input", &tensors[&format!("{case}.input")].shape);
        let other_value = tensors.get(&format!("{case}.other"));
        let other = other_value.map(|o| tracer.input("other", &o.shape));
        let twin = twins.get(case).unwrap_or_else(|| panic!("no Kiln twin for op fixture `{case}`")).1;
        let out = twin(Fixture { case, vb: weights.pp(case), x: &x, other: other.as_ref() })
            .unwrap_or_else(|e| panic!("{case}: trace failed: {e}"));
        out.mark_output("output");
        let graph = tracer.graph();

        let mut inputs = vec![("input", &tensors[&format!("{case}.input")])];
        if let Some(o) = other_value {
            inputs.push(("other", o));
        }
        let got = kiln::run_cpu(&graph, &inputs).unwrap_or_else(|e| panic!("{case}: cpu run failed: {e}"));
        let c = compare(case, &got["output"], &tensors[&format!("{case}.output")]);
        println!("{c}");
        if !c.passes(TOL) {
            failures.push(c.to_string());
        }
    }
    // Every parameter PyTorch stored for a case was loaded by its Kiln twin (no bias silently
    // dropped, no buffer ignored); inputs and outputs are not parameters.
    let unused: Vec<String> =
        weights.unused().into_iter().filter(|k| !(k.ends_with(".input") || k.ends_with(".other") || k.ends_with(".output"))).collect();
    assert!(unused.is_empty(), "parameters in the fixture that no Kiln layer loaded: {unused:?}");
    assert!(failures.is_empty(), "op fixtures above rel L2 {TOL}:\n{}", failures.join("\n"));
}

/// No op can be half-added: every built-in op (one of each variant of every family, from
/// `kiln::dev::ops::builtin_ops`) has at least one PyTorch fixture case named after it (`<op>` or
/// `<op>_<variant>`), which `every_op_fixture_matches_pytorch` runs through its CPU reference.
/// Its shape rule, CPU reference and converter are methods of `OpDef`, which the compiler asks
/// every family to implement for every variant.
#[test]
fn every_builtin_op_has_a_pytorch_fixture() {
    let tensors = read_safetensors(fixture()).expect("op fixtures");
    let cases = cases(&tensors);
    let names: std::collections::BTreeSet<String> = kiln::dev::ops::builtin_ops().iter().map(|op| op.name().to_string()).collect();
    println!("{} built-in ops: {names:?}", names.len());
    let missing: Vec<&String> = names.iter().filter(|n| !cases.iter().any(|c| c == n || c.starts_with(&format!("{n}_")))).collect();
    assert!(missing.is_empty(), "built-in ops without a PyTorch fixture in ops.reference.safetensors: {missing:?}");
}
