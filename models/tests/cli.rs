//! The `kiln` binary, run as a user runs it. Everything here works without a GPU: where one is
//! present, `run` uses it and the GPU-only commands are exercised by the device scripts instead.

use kiln::{HostTensor, VarBuilder};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().expect("run the kiln binary")
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn no_gpu() -> bool {
    kiln::engine::gpu_available().is_err()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[test]
fn help_mentions_every_command_and_examples() {
    let out = kiln(&["--help"]);
    let (stdout, _) = text(&out);
    assert!(out.status.success());
    for cmd in ["run", "build", "bench", "profile", "compare", "inspect", "codegen"] {
        assert!(stdout.contains(&format!("\n  {cmd} ")), "--help lists `{cmd}`:\n{stdout}");
    }
    assert!(stdout.contains("Examples:") && stdout.contains("kiln run resnet50"), "{stdout}");
    // The list of models comes from the one table, `kiln_models::BUNDLED`.
    let unwrapped = stdout.split_whitespace().collect::<Vec<_>>().join(" ");
    for m in kiln_models::BUNDLED {
        assert!(unwrapped.contains(&format!("{} ({}x{})", m.name, m.input_size, m.input_size)), "--help lists `{}`:\n{stdout}", m.name);
    }
    let build = text(&kiln(&["build", "--help"])).0;
    for flag in ["--fp16", "--fp32", "--tf32", "--min-batch", "--opt-batch", "--max-batch", "--workspace", "--timing-cache", "--output"] {
        assert!(build.contains(flag), "build --help explains {flag}:\n{build}");
    }
    let bench = text(&kiln(&["bench", "--help"])).0;
    for flag in ["--warmup", "--iterations", "--duration", "--json", "--batch"] {
        assert!(bench.contains(flag), "bench --help explains {flag}:\n{bench}");
    }
}

#[test]
fn inspect_prints_both_graphs_with_module_paths_and_writes_dot() {
    let dir = temp_dir("inspect");
    let (before, after) = (dir.join("before.dot"), dir.join("after.dot"));
    let out = kiln(&["inspect", "resnet18", "--no-engine", "--dot", before.to_str().unwrap(), "--dot-optimized", after.to_str().unwrap()]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("== traced graph: resnet18"), "{stdout}");
    assert!(stdout.contains("== optimised graph"), "{stdout}");
    let conv = stdout.lines().find(|l| l.contains("layer3.1.conv2")).unwrap_or_else(|| panic!("a node with its module path:\n{stdout}"));
    assert!(conv.contains("conv2d 3x3 p1") && conv.contains("[1, 256, 14, 14]"), "{conv}");
    assert!(stdout.contains("batch_norm2d"), "the traced graph has BatchNorms");
    let optimized = stdout.split("== optimised graph").nth(1).expect("optimised section");
    assert!(!optimized.contains("batch_norm2d"), "BatchNorms are folded in the optimised graph");
    assert!(optimized.contains("+add +relu"), "residual add and ReLU fused into convs:\n{optimized}");
    let (b, a) = (std::fs::read_to_string(&before).expect("before.dot"), std::fs::read_to_string(&after).expect("after.dot"));
    assert!(b.starts_with("digraph") && a.starts_with("digraph"));
    assert!(b.contains("layer1.0.bn1") && !a.contains("batch_norm2d"));
    assert!(a.contains("+relu\\nlayer1.0.conv1"), "fused convs are labelled as such");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_falls_back_to_the_cpu_and_prints_top5() {
    let out = kiln(&["run", "resnet18", "--seed", "7"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    if no_gpu() {
        assert!(stdout.contains("note: no GPU ("), "{stdout}");
        assert!(stdout.contains("running on the CPU reference executor"), "{stdout}");
        assert!(stdout.contains("CPU executor (f32):"), "{stdout}");
    }
    assert!(stdout.contains("image 0: top-5:"), "{stdout}");
    assert_eq!(stdout.lines().filter(|l| l.trim_start().starts_with("class ")).count(), 5, "{stdout}");
    assert!(stdout.contains("--seed 7"));
}

#[test]
fn run_with_a_given_input_is_deterministic() {
    let dir = temp_dir("input");
    let path = dir.join("x.safetensors");
    let x = kiln::seeded::weight("input.0", &[2, 3, 64, 64]);
    kiln::var_builder::write_safetensors(&path, &BTreeMap::from([("input".to_string(), x)])).expect("write input");
    let run = || text(&kiln(&["run", "resnet18", "--cpu", "--input", path.to_str().unwrap()])).0;
    let (a, b) = (run(), run());
    assert!(a.contains("batch 2, 64x64") && a.contains("image 1: top-5:"), "{a}");
    let classes = |s: &str| s.lines().filter(|l| l.contains("class ")).map(str::to_string).collect::<Vec<_>>();
    assert_eq!(classes(&a), classes(&b));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unknown_model_is_a_clear_error() {
    let out = kiln(&["run", "resnet19"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert_eq!(stderr.trim(), format!("error: unknown model `resnet19`; the bundled models are: {}", kiln_models::bundled_names()));
}

#[test]
fn missing_weight_file_names_the_file() {
    let out = kiln(&["run", "resnet18", "--weights", "/nonexistent/rn18.safetensors"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.starts_with("error: ") && stderr.contains("/nonexistent/rn18.safetensors"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn weight_file_with_a_wrong_shape_names_the_key() {
    let dir = temp_dir("weights");
    let path = dir.join("bad.safetensors");
    let mut weights: BTreeMap<String, HostTensor> = kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 64)
        .expect("trace")
        .weights
        .iter()
        .map(|(k, v)| (k.clone(), HostTensor::clone(v)))
        .collect();
    weights.insert("fc.bias".into(), HostTensor::zeros(vec![10]));
    kiln::var_builder::write_safetensors(&path, &weights).expect("write weights");
    let out = kiln(&["run", "resnet18", "--cpu", "--weights", path.to_str().unwrap()]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success());
    assert!(stderr.contains("error: weight `fc.bias` has shape [10], but the model expects [1000]"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gpu_commands_without_a_gpu_say_why() {
    if !no_gpu() {
        println!("skipped: a GPU is present");
        return;
    }
    for args in [&["build", "resnet18", "-o", "/tmp/never.kiln"][..], &["bench", "resnet18"], &["profile", "resnet18"]] {
        let out = kiln(args);
        let (_, stderr) = text(&out);
        assert!(!out.status.success(), "{args:?}");
        assert!(stderr.starts_with("error: no GPU available: "), "{args:?}: {stderr}");
    }
    assert!(!std::path::Path::new("/tmp/never.kiln").exists());
}

#[test]
fn cpu_bench_writes_json() {
    let dir = temp_dir("bench");
    let json = dir.join("bench.json");
    let out = kiln(&[
        "bench",
        "resnet18",
        "--cpu",
        "--size",
        "64",
        "--batch",
        "1,2",
        "--warmup",
        "0",
        "--iterations",
        "3",
        "--duration",
        "0",
        "--json",
        json.to_str().unwrap(),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("median") && stdout.contains("p99") && stdout.contains("images/s"), "{stdout}");
    let records: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("valid JSON");
    assert_eq!(records.len(), 2);
    for (r, batch) in records.iter().zip([1, 2]) {
        assert_eq!(r["model"], "resnet18");
        assert_eq!(r["batch"], batch);
        assert_eq!(r["mode"], "cpu");
        assert_eq!(r["iterations"], 3);
        let (median, p99) = (r["median_ms"].as_f64().expect("median"), r["p99_ms"].as_f64().expect("p99"));
        assert!(median > 0.0 && p99 >= median, "{r}");
        assert!(r["img_s"].as_f64().expect("img/s") > 0.0);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn compare_layerwise_on_the_cpu_names_a_planted_error() {
    let dir = temp_dir("compare");
    let graph = kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 64).expect("trace");
    // The reference: the CPU executor's own run with seeded weights, in the export script's format.
    let x = kiln::seeded::weight("input.0", &[1, 3, 64, 64]);
    let out = kiln::cpu::run(&kiln::layerwise::mark_all(&graph), &[("input", &x)]).expect("reference");
    let mut reference: BTreeMap<String, HostTensor> =
        out.into_iter().map(|(k, v)| if k.starts_with("intermediate.") { (k, v) } else { (format!("output.{k}"), v) }).collect();
    reference.insert("input".into(), x);
    let ref_path = dir.join("ref.safetensors");
    kiln::var_builder::write_safetensors(&ref_path, &reference).expect("write reference");
    let mut weights: BTreeMap<String, HostTensor> = graph.weights.iter().map(|(k, v)| (k.clone(), HostTensor::clone(v))).collect();
    let w_path = dir.join("weights.safetensors");
    kiln::var_builder::write_safetensors(&w_path, &weights).expect("write weights");
    let compare = |w: &PathBuf, layerwise: bool| {
        let mut args = vec!["compare", "resnet18", "--cpu", "--reference", ref_path.to_str().unwrap(), "--weights", w.to_str().unwrap()];
        if layerwise {
            args.push("--layerwise");
        }
        kiln(&args)
    };

    let good = compare(&w_path, false);
    let (stdout, stderr) = text(&good);
    assert!(good.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("logits: rel_l2") && stdout.contains("pass") && stdout.contains("PASS"), "{stdout}");

    weights.get_mut("layer3.0.conv2.weight").expect("key").data.iter_mut().for_each(|v| *v *= -1.0);
    let bad_path = dir.join("bad.safetensors");
    kiln::var_builder::write_safetensors(&bad_path, &weights).expect("write weights");
    let bad = compare(&bad_path, false);
    assert!(!bad.status.success());
    assert!(text(&bad).0.contains("FAIL"));
    let layerwise = compare(&bad_path, true);
    let (stdout, stderr) = text(&layerwise);
    assert!(!layerwise.status.success(), "{stderr}");
    assert!(stdout.contains("first layer whose error jumps: `layer3.0.conv2` (conv2d)"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn codegen_writes_rust_that_names_the_weights() {
    let out = kiln(&["codegen", "resnet18"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("pub fn build(vb: &VarBuilder, batch: usize) -> Result<Graph>"), "{stdout}");
    assert!(stdout.contains("vb.get(&[512, 256, 3, 3], \"layer4.0.conv1.weight\")?"), "{stdout}");
    assert!(stdout.contains("tracer.output(\"logits\", &fc);"), "{stdout}");
}
