//! Structured codegen on the graph files kiln-torch exported (tests/fixtures/imported/): the Rust
//! each one gives is committed in tests/generated/imported/ (compiled and run by tests/imported.rs),
//! and regenerating it must give the committed file, laid out by rustfmt with Kiln's rustfmt.toml.
//!
//! Every activation (`Unary::examples()`) as kiln-torch would export it, as a `torch.nn` module
//! where its form (`Unary::form`) names a layer and inline in every case, gives
//! tests/generated/every_activation.rs: compiled here, it must trace the same ops again, so every
//! method and layer an activation's form names exists and takes the arguments codegen writes.
//!
//! After a deliberate change to the generator or the fixtures, refresh the files with
//! `KILN_BLESS=1 cargo test --test imported_codegen`.

#[path = "generated/every_activation.rs"]
mod every_activation;

use kiln::dev::codegen::{generate_structured, CodegenOptions};
use kiln::plugin::{Op, ShapeOp, Unary};
use kiln::{Graph, Tensor, Tracer, VarBuilder};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The fixtures, as in tests/imported.rs.
pub const FIXTURES: &[&str] = &[
    "tiny_resnet",
    "tiny_mobilenet_v2",
    "handwritten",
    "tiny_swin",
    "tiny_swin_opwise",
    "tiny_vit",
    "tiny_deeplab",
    "tiny_lraspp",
    "tiny_efficientnet_v2",
    "tiny_regnet",
    "tiny_yolov8",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn options(name: &str) -> CodegenOptions {
    CodegenOptions {
        fn_name: "build".into(),
        model: name.into(),
        command: format!("kiln codegen tests/fixtures/imported/{name}.kiln.safetensors"),
        ..CodegenOptions::default()
    }
}

/// `src` laid out by rustfmt with Kiln's rustfmt.toml, or `None` without rustfmt.
fn rustfmt(src: &str) -> Option<String> {
    let mut child = Command::new("rustfmt")
        .args(["--edition", "2021", "--config-path"])
        .arg(root().join("rustfmt.toml"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    child.stdin.take()?.write_all(src.as_bytes()).ok()?;
    let out = child.wait_with_output().ok()?;
    assert!(out.status.success(), "rustfmt rejects the generated code:\n{}\n{src}", String::from_utf8_lossy(&out.stderr));
    Some(String::from_utf8(out.stdout).expect("utf-8"))
}

#[test]
fn committed_structured_code_is_what_codegen_emits() {
    let mut stale = Vec::new();
    for name in FIXTURES {
        let graph = Graph::load(root().join(format!("tests/fixtures/imported/{name}.kiln.safetensors"))).expect("graph file");
        let src = generate_structured(&graph, &options(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let Some(src) = rustfmt(&src) else {
            println!("skipped: rustfmt is not installed");
            return;
        };
        let path = root().join(format!("tests/generated/imported/{name}.rs"));
        if std::env::var_os("KILN_BLESS").is_some() {
            std::fs::create_dir_all(path.parent().expect("dir")).expect("create dir");
            std::fs::write(&path, &src).expect("write");
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        if committed != src {
            stale.push(path.strip_prefix(root()).unwrap_or(Path::new(name)).display().to_string());
        }
        // One struct per module class, no trace of `Tensor::record` for the common layers.
        assert!(src.contains("#[derive(Module)]") || src.contains("impl Module for"), "{name}: no module struct");
    }
    assert!(stale.is_empty(), "stale: {stale:?}; regenerate with `KILN_BLESS=1 cargo test --test imported_codegen`");
}

#[test]
fn a_graph_without_module_classes_is_refused_with_the_reason() {
    let graph = kiln_models::trace("resnet18", kiln::VarBuilder::seeded(), 1, 64).expect("trace");
    let err = generate_structured(&graph, &options("resnet18")).unwrap_err().to_string();
    assert!(err.contains("kiln-torch") && err.contains("flat"), "{err}");
}

/// Each activation on the input: as a leaf module `layer_<i>` of its `torch.nn` class where its
/// form names a layer, and inline (`<op>_<i>`, in the model's own scope) in every case; the
/// results concatenated along the channels.
fn every_activation(batch: usize) -> Graph {
    let tracer = Tracer::new();
    let x = tracer.input("input", &[batch, 2, 3]);
    let mut classes = std::collections::BTreeMap::new();
    let mut ys = Vec::new();
    for (i, op) in Unary::examples().into_iter().enumerate() {
        let form = op.form();
        if let Some(layer) = &form.layer {
            let path = format!("layer_{i}");
            ys.push(Tensor::record(&path, Op::Unary(op), &[&x], &[]).expect("layer"));
            classes.insert(path, format!("torch.nn.modules.activation.{}", layer.ty));
        }
        ys.push(Tensor::record(&format!("{}_{i}", form.method), Op::Unary(op), &[&x], &[]).expect("inline"));
    }
    let cat = Tensor::record("cat", Op::Shape(ShapeOp::Cat { dim: 1 }), &ys.iter().collect::<Vec<_>>(), &[]).expect("cat");
    tracer.output("output", &cat);
    let mut graph = tracer.graph();
    graph.modules = classes;
    graph
}

#[test]
fn every_activations_form_compiles_and_traces_the_same_ops() {
    let graph = every_activation(1);
    let opts = CodegenOptions {
        fn_name: "build".into(),
        model: "every_activation".into(),
        command: "tests/imported_codegen.rs".into(),
        ..CodegenOptions::default()
    };
    let src = generate_structured(&graph, &opts).expect("generate");
    let Some(src) = rustfmt(&src) else {
        println!("skipped: rustfmt is not installed");
        return;
    };
    let path = root().join("tests/generated/every_activation.rs");
    if std::env::var_os("KILN_BLESS").is_some() {
        std::fs::write(&path, &src).expect("write");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == src,
        "tests/generated/every_activation.rs is stale; regenerate with `KILN_BLESS=1 cargo test --test imported_codegen`"
    );
    for ty in ["Softplus", "SoftplusConfig", "ELU", "ELUConfig", "Mish", "Hardtanh", "ReLU6"] {
        assert!(src.contains(&format!(" {ty}")), "{ty} is not written:\n{src}");
    }
    let ops = |g: &Graph| g.nodes.iter().filter(|n| !n.op.is_leaf()).map(|n| n.op.clone()).collect::<Vec<_>>();
    for batch in [1, 2] {
        let generated = every_activation::build(VarBuilder::seeded(), batch).expect("the generated code traces");
        assert_eq!(ops(&generated), ops(&every_activation(batch)), "batch {batch}");
    }
}
