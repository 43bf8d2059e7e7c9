//! `kiln codegen`: the Rust it emits for ResNet-18 is committed (tests/generated/resnet18_gen.rs),
//! compiled into this test, and must rebuild exactly the traced graph; regenerating it must give
//! the committed file byte for byte, so the fixture cannot go stale.
//!
//! After a deliberate change to the generator or the model, refresh the fixture with
//! `KILN_BLESS=1 cargo test --test codegen`.

#[path = "generated/resnet18_gen.rs"]
mod resnet18_gen;

use kiln::compare;
use kiln::dev::codegen::{generate, CodegenOptions};
use kiln::engine::{gpu_available, BuildConfig, EngineBuilder, Gpu, Precision};
use kiln::{Graph, HostTensor, VarBuilder};
use std::path::Path;
use std::sync::Arc;

const FIXTURE: &str = "tests/generated/resnet18_gen.rs";

/// The options the fixture is generated with: Kiln's own rustfmt style (rustfmt.toml), so
/// `cargo fmt` leaves the committed file as it is.
fn fixture_options() -> CodegenOptions {
    CodegenOptions {
        fn_name: "build".into(),
        model: "resnet18".into(),
        max_width: 140,
        small_heuristics_max: true,
        command: "kiln codegen resnet18 --max-width 140 --small-heuristics-max".into(),
    }
}

fn traced(batch: usize) -> Graph {
    kiln_models::trace("resnet18", VarBuilder::seeded(), batch, 224).expect("trace resnet18")
}

fn input(batch: usize) -> HostTensor {
    kiln::dev::weight("input.0", &[batch, 3, 224, 224])
}

/// Same nodes (op, attributes, inputs, shape, path) in the same order, same bindings, same weights.
fn assert_same_graph(got: &Graph, want: &Graph) {
    assert_eq!(got.nodes.len(), want.nodes.len(), "node count");
    for (i, (g, w)) in got.nodes.iter().zip(&want.nodes).enumerate() {
        assert_eq!(g, w, "node %{i} differs");
    }
    assert_eq!(got.inputs, want.inputs);
    assert_eq!(got.outputs, want.outputs);
    assert_eq!(got.weights.keys().collect::<Vec<_>>(), want.weights.keys().collect::<Vec<_>>());
    for (name, w) in &want.weights {
        assert_eq!(got.weights[name], *w, "weight `{name}`");
    }
}

#[test]
fn committed_fixture_is_what_codegen_emits() {
    let src = generate(&traced(1), &fixture_options()).expect("generate");
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE);
    if std::env::var_os("KILN_BLESS").is_some() {
        std::fs::write(&path, &src).expect("write fixture");
    }
    let committed = std::fs::read_to_string(&path).expect("read fixture");
    assert!(committed == src, "{FIXTURE} is stale: regenerate it with `KILN_BLESS=1 cargo test --test codegen`");
    // One statement per op: every non-weight node but the input is one `Tensor::record`.
    let ops = traced(1).nodes.iter().filter(|n| !matches!(n.op, kiln::plugin::Op::Weight { .. } | kiln::plugin::Op::Input { .. })).count();
    assert_eq!(src.matches("Tensor::record(").count(), ops);
    assert!(src.contains("\"layer3.1.conv2.weight\""), "weights are read by their state_dict names");
}

#[test]
fn generated_code_rebuilds_the_traced_graph() {
    for batch in [1, 2] {
        let generated = resnet18_gen::build(&VarBuilder::seeded(), batch).expect("generated build");
        assert_same_graph(&generated, &traced(batch));
    }
}

#[test]
fn generated_graph_gives_equal_cpu_outputs() {
    let x = input(1);
    let generated = resnet18_gen::build(&VarBuilder::seeded(), 1).expect("generated build");
    let a = kiln::run_cpu(&generated, &[("input", &x)]).expect("cpu generated");
    let b = kiln::run_cpu(&traced(1), &[("input", &x)]).expect("cpu traced");
    let c = compare("logits", &a["logits"], &b["logits"]);
    println!("{c}");
    assert_eq!(a["logits"], b["logits"], "{c}");
}

#[test]
fn generated_code_is_rustfmt_clean_in_the_default_style() {
    let Ok(out) = std::process::Command::new("rustfmt").arg("--version").output() else {
        println!("skipped: rustfmt is not installed");
        return;
    };
    assert!(out.status.success());
    let dir = std::env::temp_dir().join(format!("kiln-codegen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for (model, size) in [("resnet50", 224), ("centernet", 512)] {
        let graph = kiln_models::trace(model, VarBuilder::seeded(), 1, size).expect("trace");
        let opts = CodegenOptions { model: model.into(), ..CodegenOptions::default() };
        let path = dir.join(format!("{model}_gen.rs"));
        std::fs::write(&path, generate(&graph, &opts).expect("generate")).expect("write");
        // An empty config file: rustfmt's defaults, whatever rustfmt.toml sits above the temp dir.
        let config = dir.join("rustfmt.toml");
        std::fs::write(&config, "").expect("write config");
        let check = std::process::Command::new("rustfmt")
            .args(["--check", "--edition", "2021", "--config-path"])
            .arg(&config)
            .arg(&path)
            .output()
            .expect("run rustfmt");
        assert!(check.status.success(), "{model}: rustfmt would change the generated code:\n{}", String::from_utf8_lossy(&check.stdout));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn generated_graph_builds_an_engine_with_equal_outputs() {
    if let Err(why) = gpu_available() {
        println!("skipped: no GPU ({why})");
        return;
    }
    let gpu: Arc<Gpu> = Gpu::new(0).expect("gpu");
    // A shared timing cache: the second build replays the first one's algorithm choices, so the
    // two engines run the same kernels and their outputs can be compared exactly.
    let cache = std::env::temp_dir().join(format!("kiln-codegen-{}.timing.json", std::process::id()));
    let x = input(2);
    let mut outputs = Vec::new();
    for graph in [traced(2), resnet18_gen::build(&VarBuilder::seeded(), 2).expect("generated build")] {
        let config = BuildConfig::default().precision(Precision::Fp32).batch(1, 2, 2).timing_cache(&cache);
        let engine = Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph).expect("build"));
        let mut ctx = engine.context().expect("context");
        outputs.push(ctx.run(&[("input", &x)]).expect("run").remove("logits").expect("logits"));
    }
    let c = compare("logits", &outputs[1], &outputs[0]);
    println!("generated vs traced engine: {c}");
    assert_eq!(outputs[0], outputs[1], "{c}");
    let _ = std::fs::remove_file(&cache);
}
