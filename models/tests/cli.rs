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

// ---- docs/RELIABILITY.md: one test per CLI row ------------------------------------------------

/// Runs `kiln` with extra environment variables.
fn kiln_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).envs(env.iter().copied()).output().expect("run the kiln binary")
}

/// Asserts `kiln args` fails with exit status 1 (an error, not a panic's 101 or an abort's 134)
/// and that its stderr contains every one of `says`; returns stderr.
fn fails_with(args: &[&str], says: &[&str]) -> String {
    fails_with_env(args, &[], says)
}

fn fails_with_env(args: &[&str], env: &[(&str, &str)], says: &[&str]) -> String {
    let out = kiln_env(args, env);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "kiln {args:?}: expected exit 1\nstdout: {stdout}\nstderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for s in says {
        assert!(stderr.contains(s), "kiln {args:?}: expected `{s}` in stderr: {stderr}");
    }
    stderr
}

/// A safetensors file from (name, dtype, shape, bytes) entries.
fn raw_safetensors(entries: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let (mut offset, mut header, mut data) = (0, serde_json::Map::new(), Vec::new());
    for (name, dtype, shape, bytes) in entries {
        header.insert(
            name.to_string(),
            serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes.len()] }),
        );
        data.extend_from_slice(bytes);
        offset += bytes.len();
    }
    let header = serde_json::Value::Object(header).to_string();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend(data);
    file
}

fn f32_bytes(t: &HostTensor) -> Vec<u8> {
    t.data.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// ResNet-18's seeded weights as a state_dict file, with `edit` applied.
fn resnet18_weights(dir: &std::path::Path, name: &str, edit: impl FnOnce(&mut BTreeMap<String, HostTensor>)) -> PathBuf {
    let graph = kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 32).expect("trace");
    let mut state: BTreeMap<String, HostTensor> = graph.weights.iter().map(|(k, v)| (k.clone(), HostTensor::clone(v))).collect();
    edit(&mut state);
    let path = dir.join(name);
    kiln::var_builder::write_safetensors(&path, &state).expect("write weights");
    path
}

/// A CPU reference for ResNet-18 at 32x32 (`input`, `output.logits`) plus `extra` entries.
fn resnet18_reference(dir: &std::path::Path, name: &str, extra: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> PathBuf {
    let graph = kiln::passes::optimize(&kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 32).expect("trace")).expect("optimize");
    let x = kiln::seeded::uniform_tensor(&[1, 3, 32, 32], 3);
    let logits = kiln::cpu::run(&graph, &[("input", &x)]).expect("cpu").remove("logits").expect("logits");
    let mut entries =
        vec![("input", "F32", x.shape.clone(), f32_bytes(&x)), ("output.logits", "F32", logits.shape.clone(), f32_bytes(&logits))];
    entries.extend(extra.iter().cloned());
    let path = dir.join(name);
    std::fs::write(&path, raw_safetensors(&entries)).expect("write reference");
    path
}

#[test]
fn c01_batch_zero_says_batch_must_be_at_least_1() {
    let stderr = fails_with(&["run", "resnet18", "--cpu", "--batch", "0"], &["error: --batch must be at least 1"]);
    assert!(!stderr.contains("any positive batch"), "{stderr}");
}

#[test]
fn c02_batch_of_a_billion_is_too_large_not_an_abort() {
    fails_with(&["run", "resnet18", "--cpu", "--batch", "1000000000"], &["--batch 1000000000", "is too large", "150528000000000 elements"]);
}

#[test]
fn c03_size_100000_is_too_large_not_an_abort() {
    fails_with(&["run", "resnet18", "--cpu", "--size", "100000"], &["--size 100000", "is too large", "lower --batch or --size"]);
}

#[test]
fn c04_batch_beyond_memory_is_refused_before_allocating() {
    // The limit stands in for a machine with 100 MB free, so the row does not depend on this one.
    let env = [("KILN_CPU_MEMORY_BYTES", "100000000")];
    fails_with_env(
        &["run", "resnet18", "--cpu", "--batch", "64"],
        &env,
        &["out of memory: the CPU executor at --batch 64", "100000000 bytes are available"],
    );
}

#[test]
fn c05_size_zero_says_size_must_be_at_least_1() {
    fails_with(&["run", "resnet18", "--cpu", "--size", "0"], &["error: --size must be at least 1"]);
}

#[test]
fn c06_bench_duration_inf_is_a_clear_error() {
    fails_with(
        &["bench", "resnet18", "--cpu", "--size", "32", "--duration", "inf"],
        &["--duration must be a finite, non-negative number of seconds, got inf"],
    );
}

#[test]
fn c07_bench_duration_negative_is_a_clear_error() {
    fails_with(&["bench", "resnet18", "--cpu", "--size", "32", "--duration=-1"], &["--duration must be", "got -1"]);
}

#[test]
fn c08_closed_stdout_pipe_is_a_clean_exit() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["run", "resnet18", "--cpu", "--size", "32", "--seed", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn kiln");
    drop(child.stdout.take()); // `| head -0`: the reader is gone before the first line.
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}: {stderr}", out.status.code());
    assert!(!stderr.contains("panicked") && !stderr.contains("Broken pipe"), "{stderr}");
}

#[test]
fn c09_directory_as_weights_says_it_is_a_directory() {
    let dir = temp_dir("c09");
    fails_with(
        &["run", "resnet18", "--cpu", "--weights", dir.to_str().unwrap()],
        &["is a directory", "give the path of a .safetensors file"],
    );
}

#[cfg(unix)]
#[test]
fn c10_fifo_as_weights_is_rejected_without_hanging() {
    let fifo = temp_dir("c10").join("w.fifo");
    let _ = std::fs::remove_file(&fifo);
    assert!(Command::new("mkfifo").arg(&fifo).status().expect("mkfifo").success());
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["run", "resnet18", "--cpu", "--weights", fifo.to_str().unwrap()])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("spawn kiln");
    let start = std::time::Instant::now();
    while child.try_wait().expect("try_wait").is_none() {
        if start.elapsed().as_secs() > 60 {
            child.kill().expect("kill");
            panic!("kiln hung on a FIFO");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("wait");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a regular file (a FIFO, socket or device)"));
}

#[test]
fn c11_rtol_nan_is_rejected() {
    let dir = temp_dir("c11");
    let reference = resnet18_reference(&dir, "ref.safetensors", &[]);
    fails_with(
        &["compare", "resnet18", "--cpu", "--reference", reference.to_str().unwrap(), "--rtol", "nan"],
        &["--rtol must be a finite, non-negative tolerance, got NaN"],
    );
}

#[test]
fn c12_rtol_negative_is_rejected() {
    let dir = temp_dir("c12");
    let reference = resnet18_reference(&dir, "ref.safetensors", &[]);
    fails_with(
        &["compare", "resnet18", "--cpu", "--reference", reference.to_str().unwrap(), "--rtol=-0.5"],
        &["--rtol must be", "got -0.5"],
    );
}

#[test]
fn c13_fn_name_that_is_not_an_identifier_is_rejected_and_nothing_is_written() {
    let out = temp_dir("c13").join("gen.rs");
    fails_with(
        &["codegen", "resnet18", "--fn-name", "fn bad name", "-o", out.to_str().unwrap()],
        &["--fn-name must be a Rust identifier", "\"fn bad name\""],
    );
    assert!(!out.exists());
    fails_with(&["codegen", "resnet18", "--fn-name", "match"], &["--fn-name must be a Rust identifier"]);
}

#[test]
fn c14_size_that_disagrees_with_input_is_an_error() {
    let dir = temp_dir("c14");
    let x = kiln::seeded::uniform_tensor(&[1, 3, 32, 32], 1);
    let input = dir.join("x.safetensors");
    kiln::var_builder::write_safetensors(&input, &BTreeMap::from([("input".to_string(), x)])).unwrap();
    fails_with(
        &["run", "resnet18", "--cpu", "--input", input.to_str().unwrap(), "--size", "64"],
        &["--size 64 disagrees with --input", "[1, 3, 32, 32]"],
    );
    fails_with(&["run", "resnet18", "--cpu", "--input", input.to_str().unwrap(), "--batch", "2"], &["--batch 2 disagrees with --input"]);
}

#[test]
fn c15_pth_weights_get_a_conversion_hint() {
    let path = temp_dir("c15").join("resnet18.pth");
    std::fs::write(&path, b"PK\x03\x04\x14\x00\x00\x00\x08\x00archive/data.pkl").unwrap();
    fails_with(
        &["run", "resnet18", "--cpu", "--weights", path.to_str().unwrap()],
        &["resnet18.pth", "PyTorch pickle", "safetensors.torch.save_file(model.state_dict()"],
    );
}

#[test]
fn c16_dataparallel_prefixed_weights_get_a_hint() {
    let dir = temp_dir("c16");
    let path = dir.join("dp.safetensors");
    let w = HostTensor::new(vec![2], vec![0.0; 2]);
    kiln::var_builder::write_safetensors(&path, &BTreeMap::from([("module.conv1.weight".to_string(), w)])).unwrap();
    fails_with(
        &["run", "resnet18", "--cpu", "--weights", path.to_str().unwrap()],
        &["weight `conv1.weight` is missing", "`module.conv1.weight` is there", "DataParallel", "strip the prefix"],
    );
}

#[test]
fn c17_nan_weights_warn_and_fail_with_strict() {
    let dir = temp_dir("c17");
    let path = resnet18_weights(&dir, "nan.safetensors", |s| s.get_mut("layer1.0.conv1.weight").unwrap().data[0] = f32::NAN);
    let p = path.to_str().unwrap();
    let out = kiln(&["run", "resnet18", "--cpu", "--size", "32", "--weights", p]);
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("warning: 1 weight(s) of") && stderr.contains("`layer1.0.conv1.weight`: 1 value(s)"), "{stderr}");
    fails_with(
        &["run", "resnet18", "--cpu", "--size", "32", "--strict", "--weights", p],
        &["weight `layer1.0.conv1.weight` holds 1 non-finite value(s)"],
    );
}

#[test]
fn c18_unrelated_tensor_in_a_reference_is_ignored_with_a_note() {
    let dir = temp_dir("c18");
    let reference = resnet18_reference(&dir, "ref.safetensors", &[("labels", "I64", vec![1], vec![0; 8])]);
    let out = kiln(&["compare", "resnet18", "--cpu", "--reference", reference.to_str().unwrap()]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("1 tensor(s) of") && stderr.contains("were ignored (e.g. `labels`)"), "{stderr}");
    assert!(stdout.contains("logits: rel_l2") && stdout.contains("PASS"), "{stdout}");
}

#[test]
fn c19_reference_tensor_of_a_wrong_dtype_is_called_a_reference() {
    let dir = temp_dir("c19");
    let path = dir.join("ref.safetensors");
    std::fs::write(&path, raw_safetensors(&[("input", "I64", vec![1], vec![0; 8])])).unwrap();
    let stderr =
        fails_with(&["compare", "resnet18", "--cpu", "--reference", path.to_str().unwrap()], &["reference tensor `input` has dtype I64"]);
    assert!(!stderr.contains("weight"), "{stderr}");
}

#[test]
fn c20_input_tensor_of_a_wrong_dtype_is_called_an_input() {
    let dir = temp_dir("c20");
    let path = dir.join("x.safetensors");
    std::fs::write(&path, raw_safetensors(&[("input", "U8", vec![1, 3, 2, 2], vec![0; 12])])).unwrap();
    fails_with(&["run", "resnet18", "--cpu", "--input", path.to_str().unwrap()], &["input tensor `input` has dtype U8"]);
}

#[test]
fn c21_weights_with_a_bad_json_header_name_the_file_and_the_error() {
    let dir = temp_dir("c21");
    let path = dir.join("bad.safetensors");
    let header = "{\"conv1.weight\": {\"dtype\": \"F32\" \"shape\": [1]}}";
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    std::fs::write(&path, bytes).unwrap();
    let stderr = fails_with(
        &["run", "resnet18", "--cpu", "--weights", path.to_str().unwrap()],
        &["bad.safetensors", "not valid JSON", "expected `,` or `}` at line 1 column"],
    );
    assert!(!stderr.contains("InvalidHeaderDeserialization"), "{stderr}");
}

#[test]
fn c22_inspect_batch_zero_is_a_clear_error() {
    fails_with(&["inspect", "resnet18", "--no-engine", "--batch", "0"], &["error: --batch must be at least 1"]);
}
