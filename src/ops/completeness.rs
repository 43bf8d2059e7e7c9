//! The op-completeness test: every built-in op, and every activation, is whole in its family.
//!
//! Its shape rule, CPU reference and converter are `OpDef` methods, which the compiler asks of
//! every family for every variant. Beside them, for each op (by name) this test checks:
//! - **nn layer**: a `kiln::nn` layer records it (the family's `NN_LAYERS`, traced), unless
//!   `torch.nn` has no module for it (`NO_NN_LAYER`) or PyTorch has no such op (`NO_PYTORCH`);
//! - **codegen form**: codegen can write its serde form with types generated code imports, and an
//!   activation's form (`Unary::form`) names a layer only where that layer records that op;
//! - **kiln-torch import**: the family names the ATen ops kiln-torch imports as it (`ATEN`,
//!   `Unary::form`), and python/kiln_torch/ops.py registers each of them;
//! - **PyTorch fixture**: tests/fixtures/ops.reference.safetensors has a case `<op>` or `<op>_*`
//!   (tests/op_fixtures.rs runs each through its Kiln twin).
//!
//! A failure names the op and the missing part. The exception lists are checked too: an op
//! listed there that has the part after all is an error, so they cannot go stale.

use super::{aten_imports, builtin_ops, nn_layers};
use crate::graph::{Op, Unary};
use crate::tensor::Tracer;
use crate::var_builder::VarBuilder;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// Ops PyTorch has no op or module of its own for (it computes them with others, and their
/// fixtures compare with that): no nn layer is expected.
const NO_PYTORCH: &[(&str, &str)] = &[
    ("affine", "`x * scale + shift` with numbers: PyTorch writes it as arithmetic with a Python scalar (`x + 3`, `x / 6`, `1 - x`)"),
    (
        "qkv_attention",
        "Kiln's attention over a packed `[.., L, 3·H·D]` projection; PyTorch's is inside `nn.MultiheadAttention` (a Linear, this op, a Linear)",
    ),
];

/// Ops `torch.nn` has no module for (PyTorch has them as functions or tensor methods only).
const NO_NN_LAYER: &[(&str, &str)] = &[
    ("asinh", "`torch.asinh` only"),
    ("exp", "`torch.exp` only"),
    ("log", "`torch.log` only"),
    ("sqrt", "`torch.sqrt` only"),
    ("rsqrt", "`torch.rsqrt` only"),
    ("reciprocal", "`torch.reciprocal` only"),
    ("abs", "`torch.abs` only"),
    ("erf", "`torch.erf` only"),
    ("pow", "`torch.pow` / `**` only"),
    ("add", "the `+` operator only"),
    ("sub", "the `-` operator only"),
    ("mul", "the `*` operator only"),
    ("div", "the `/` operator only"),
    ("matmul", "`torch.matmul` / `@` only (`nn.Linear` is the `linear` op)"),
    ("mean", "`torch.mean` only"),
    ("amax", "`torch.amax` only"),
    ("argmax", "`torch.argmax` only"),
    ("cat", "`torch.cat` only"),
    ("permute", "`Tensor.permute` / `transpose` only"),
    ("slice", "indexing, `narrow`, `split` and `chunk` only"),
    ("roll", "`torch.roll` only"),
    ("attention", "`F.scaled_dot_product_attention` only (`nn.MultiheadAttention` is a Linear, `qkv_attention` and a Linear)"),
    ("quantize", "`torch.quantize_per_tensor` only (`torch.ao` modules run on quantised tensor types, which Kiln's f32 codes are not)"),
    ("dequantize", "`Tensor.dequantize` only"),
];

/// Ops kiln-torch writes from no ATen op.
const NO_ATEN: &[(&str, &str)] = &[];

/// The repository's root (the `kiln` crate's manifest directory).
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The ATen ops and module classes python/kiln_torch/ops.py registers: its double-quoted names
/// under `aten.`, `torchvision.`, `quantized_decomposed.` and `torch.nn.` (the keys of `@aten`,
/// `@module`, `SIMPLE_UNARY` and `IDENTITY`; the docstrings quote names in backticks).
fn kiln_torch_names() -> BTreeSet<String> {
    let path = root().join("python/kiln_torch/ops.py");
    let src = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let prefixes = ["aten.", "torchvision.", "quantized_decomposed.", "torch.nn."];
    src.split('"')
        .skip(1)
        .step_by(2)
        .filter(|s| prefixes.iter().any(|p| s.starts_with(p)) && !s.contains(' '))
        .map(str::to_string)
        .collect()
}

/// The case names of the PyTorch op fixtures.
fn fixture_cases() -> Vec<String> {
    let path = root().join("tests/fixtures/ops.reference.safetensors");
    let tensors = crate::var_builder::read_safetensors(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    tensors.keys().filter_map(|k| k.strip_suffix(".output")).map(str::to_string).collect()
}

/// Each `kiln::nn` layer's name, and the ops (by name) it records when traced.
fn layer_ops() -> BTreeMap<&'static str, BTreeSet<String>> {
    let mut by_layer: BTreeMap<&'static str, BTreeSet<String>> = BTreeMap::new();
    for (name, trace) in nn_layers() {
        let tracer = Tracer::new();
        trace(VarBuilder::seeded().pp("layer"), &tracer).unwrap_or_else(|e| panic!("nn layer `{name}`: trace failed: {e}"));
        let graph = tracer.graph();
        let ops = graph.nodes.iter().filter(|n| n.path == "layer" && n.op.def().is_some()).map(|n| n.op.name().to_string());
        by_layer.entry(name).or_default().extend(ops);
    }
    by_layer
}

/// The ops the test walks: one of every built-in kind, and every activation example (the
/// parameters that change an activation's form: ReLU6 is a clamp, Hardtanh another).
fn walked_ops() -> Vec<Op> {
    builtin_ops().into_iter().chain(Unary::examples().into_iter().map(Op::Unary)).collect()
}

/// What is missing of each op, one line per part (`<op>: <part>: <why>`).
fn missing_parts() -> Vec<String> {
    let layers = layer_ops();
    let torch_names = kiln_torch_names();
    let cases = fixture_cases();
    let imports = aten_imports();
    let reason = |list: &[(&str, &str)], op: &str| list.iter().any(|(o, _)| *o == op);
    let mut missing = Vec::new();
    let mut names = BTreeSet::new();
    for op in walked_ops() {
        let Some(def) = op.def() else {
            missing.push(format!("{op:?}: converter: the op has no `OpDef`"));
            continue;
        };
        let name = def.name().to_string();
        // Codegen: the serde form of every example, and an activation's layer.
        match crate::codegen::serde_form(&op) {
            Err(e) => missing.push(format!("{name}: codegen form: its serde form cannot be written as Rust: {e}")),
            Ok((expr, unimportable)) if !unimportable.is_empty() => missing
                .push(format!("{name}: codegen form: `{expr}` names {unimportable:?}, which generated code does not import (codegen::IR)")),
            Ok(_) => {}
        }
        if let Op::Unary(u) = &op {
            if let Some(layer) = u.form().layer {
                match layers.get(layer.ty) {
                    None => missing.push(format!("{name}: codegen form: `{u:?}` is written as `{}`, which kiln::nn lacks", layer.ty)),
                    Some(ops) if !ops.contains(&name) => {
                        missing.push(format!("{name}: codegen form: `{u:?}` is written as `{}`, which records {ops:?}", layer.ty))
                    }
                    Some(_) => {}
                }
            }
        }
        if !names.insert(name.clone()) {
            continue;
        }
        // The nn layer.
        let recorded_by: Vec<&str> = layers.iter().filter(|(_, ops)| ops.contains(&name)).map(|(l, _)| *l).collect();
        let exempt = reason(NO_NN_LAYER, &name) || reason(NO_PYTORCH, &name);
        match (recorded_by.is_empty(), exempt) {
            (true, false) => missing.push(format!(
                "{name}: nn layer: no kiln::nn layer records it (add one to its family's `pub mod nn` and `NN_LAYERS`, or list it in NO_NN_LAYER with why)"
            )),
            (false, true) => missing.push(format!("{name}: nn layer: listed as having none, but {recorded_by:?} records it")),
            _ => {}
        }
        // The kiln-torch import.
        let aten = imports.get(&name).cloned().unwrap_or_default();
        if aten.is_empty() && !reason(NO_ATEN, &name) {
            missing.push(format!(
                "{name}: kiln-torch import: its family names no ATen op for it (`ATEN`, or `Unary::form`; or list it in NO_ATEN with why)"
            ));
        }
        if !aten.is_empty() && reason(NO_ATEN, &name) {
            missing.push(format!("{name}: kiln-torch import: listed in NO_ATEN, but imported from {aten:?}"));
        }
        for a in aten.iter().filter(|a| !torch_names.contains(**a)) {
            missing.push(format!("{name}: kiln-torch import: `{a}` is not in python/kiln_torch/ops.py's table"));
        }
        // The PyTorch fixture.
        if !cases.iter().any(|c| *c == name || c.starts_with(&format!("{name}_"))) {
            missing.push(format!(
                "{name}: PyTorch fixture: no case `{name}` or `{name}_*` in tests/fixtures/ops.reference.safetensors (tools/export_reference.py)"
            ));
        }
    }
    // Every exception names an op, and every ATen row an op.
    for (list, what) in [(NO_PYTORCH, "NO_PYTORCH"), (NO_NN_LAYER, "NO_NN_LAYER"), (NO_ATEN, "NO_ATEN")] {
        missing.extend(
            list.iter().filter(|(op, _)| !names.contains(*op)).map(|(op, _)| format!("{op}: {what} lists an op that does not exist")),
        );
    }
    missing.extend(
        imports.keys().filter(|op| !names.contains(*op)).map(|op| format!("{op}: a family's ATEN names an op that does not exist")),
    );
    missing
}

#[test]
fn every_op_is_whole_in_its_family() {
    let missing = missing_parts();
    assert!(missing.is_empty(), "{} missing part(s):\n{}", missing.len(), missing.join("\n"));
}

#[test]
fn the_walk_covers_every_family_and_its_sources() {
    // The test cannot pass by walking nothing: every family's ops, layers and tables are seen.
    let names: BTreeSet<String> = walked_ops().iter().map(|op| op.name().to_string()).collect();
    for op in [
        "conv2d",
        "linear",
        "softmax",
        "max_pool2d",
        "softplus",
        "mish",
        "add",
        "flatten",
        "upsample_bilinear2d",
        "attention",
        "fake_quantize",
    ] {
        assert!(names.contains(op), "{op} is not walked: {names:?}");
    }
    let layers = layer_ops();
    for (layer, op) in [("ELU", "elu"), ("Mish", "mish"), ("Softplus", "softplus"), ("GroupNorm", "group_norm"), ("Flatten", "reshape")] {
        assert!(layers.get(layer).is_some_and(|ops| ops.contains(op)), "{layer} should record {op}: {layers:?}");
    }
    let torch = kiln_torch_names();
    assert!(torch.contains("aten.relu.default") && torch.contains("torch.nn.modules.activation.MultiheadAttention"), "{torch:?}");
    assert!(!torch.iter().any(|n| n.contains('`')), "names are read from quotes, not docstrings: {torch:?}");
    assert!(fixture_cases().len() > 100);
}
