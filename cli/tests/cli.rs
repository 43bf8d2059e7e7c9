//! The `kiln` binary, run as a user runs it. Everything here works without a GPU: where one is
//! present, `run` uses it and the GPU-only commands are exercised by the device scripts instead,
//! or by the `#[ignore]`d `gpu_*` tests at the end (`--include-ignored` on the device).

mod common;

use common::*;

use kiln::{HostTensor, VarBuilder};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

fn no_gpu() -> bool {
    kiln::engine::gpu_available().is_err()
}

#[test]
fn help_mentions_every_command_and_examples() {
    let out = kiln(&["--help"]);
    let (stdout, _) = text(&out);
    assert!(out.status.success());
    for cmd in ["run", "build", "bench", "profile", "compare", "inspect", "codegen", "calibrate", "triton-repo", "models"] {
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

/// `kiln models --json` is how the Python tools (tools/bundled.py) learn the list of models:
/// it must be `kiln_models::BUNDLED`, in order, field by field.
#[test]
fn models_lists_bundled_for_people_and_as_json() {
    let out = kiln(&["models", "--json"]);
    assert!(out.status.success(), "{}", text(&out).1);
    let list: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(list.len(), kiln_models::BUNDLED.len());
    for (v, m) in list.iter().zip(kiln_models::BUNDLED) {
        assert_eq!(v["name"], m.name);
        assert_eq!(v["input_size"], m.input_size);
        assert_eq!(v["outputs"], serde_json::json!(m.outputs), "{}", m.name);
        assert_eq!(v["family"], m.family(), "{}", m.name);
        assert_eq!(v["torchvision"], m.torchvision, "{}", m.name);
        assert_eq!(v["description"], m.description);
    }
    let torchvision: Vec<&str> = kiln_models::BUNDLED.iter().filter(|m| m.torchvision).map(|m| m.name).collect();
    assert_eq!(torchvision.len(), 22, "torchvision's classifiers: {torchvision:?}");
    let (stdout, _) = text(&kiln(&["models"]));
    for m in kiln_models::BUNDLED {
        assert!(stdout.lines().any(|l| l.starts_with(&format!("{} ", m.name))), "`kiln models` lists {}:\n{stdout}", m.name);
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
    assert!(optimized.contains("0 layout copies planned"), "a CNN's convs read each other's NHWC bytes:\n{optimized}");
    let (b, a) = (std::fs::read_to_string(&before).expect("before.dot"), std::fs::read_to_string(&after).expect("after.dot"));
    assert!(b.starts_with("digraph") && a.starts_with("digraph"));
    assert!(b.contains("layer1.0.bn1") && !a.contains("batch_norm2d"));
    assert!(a.contains("+relu\\nlayer1.0.conv1"), "fused convs are labelled as such");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Swin's window partition and reverse are copies today: `inspect` names each, reader and value.
#[test]
fn inspect_lists_the_layout_copies_the_engine_will_make() {
    let out = kiln(&["inspect", "swin_t", "--no-engine"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let line = stdout.lines().find(|l| l.contains("layout copies planned")).unwrap_or_else(|| panic!("{stdout}"));
    let n: usize = line.split_whitespace().next().and_then(|w| w.parse().ok()).unwrap_or_else(|| panic!("{line}"));
    assert!(n > 0, "{line}");
    let listed: Vec<&str> =
        stdout.lines().skip_while(|l| !l.contains("layout copies planned")).skip(1).take_while(|l| l.starts_with("  ")).collect();
    assert_eq!(listed.len(), n, "{stdout}");
    assert!(listed.iter().all(|l| l.contains(" <- ") && l.trim_start().starts_with("features.")), "{listed:?}");
}

#[test]
fn run_falls_back_to_the_cpu_and_prints_top5() {
    let out = kiln(&["run", "resnet18", "--seed", "7"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    if no_gpu() {
        // The note is a diagnostic: standard error, not the results.
        assert!(stderr.contains("note: no GPU ("), "{stderr}");
        assert!(stderr.contains("running on the CPU reference executor"), "{stderr}");
        assert!(!stdout.contains("note:"), "{stdout}");
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
    let x = kiln::dev::weight("input.0", &[2, 3, 64, 64]);
    kiln::files::write_safetensors(&path, &BTreeMap::from([("input".to_string(), x)])).expect("write input");
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
    assert_eq!(stderr.trim(), "error: unknown model `resnet19`; did you mean `resnet18`? (`kiln models` lists every model)");
    let (_, stderr) = text(&kiln(&["run", "transformer"]));
    assert_eq!(stderr.trim(), format!("error: unknown model `transformer`; the bundled models are: {}", kiln_models::bundled_names()));
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
    kiln::files::write_safetensors(&path, &weights).expect("write weights");
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
    let x = kiln::dev::weight("input.0", &[1, 3, 64, 64]);
    let out = kiln::run_cpu(&kiln::dev::layerwise::mark_all(&graph), &[("input", &x)]).expect("reference");
    let mut reference: BTreeMap<String, HostTensor> =
        out.into_iter().map(|(k, v)| if k.starts_with("intermediate.") { (k, v) } else { (format!("output.{k}"), v) }).collect();
    reference.insert("input".into(), x);
    let ref_path = dir.join("ref.safetensors");
    kiln::files::write_safetensors(&ref_path, &reference).expect("write reference");
    let mut weights: BTreeMap<String, HostTensor> = graph.weights.iter().map(|(k, v)| (k.clone(), HostTensor::clone(v))).collect();
    let w_path = dir.join("weights.safetensors");
    kiln::files::write_safetensors(&w_path, &weights).expect("write weights");
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
    kiln::files::write_safetensors(&bad_path, &weights).expect("write weights");
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
    kiln::files::write_safetensors(&path, &state).expect("write weights");
    path
}

/// A CPU reference for ResNet-18 at 32x32 (`input`, `output.logits`) plus `extra` entries.
fn resnet18_reference(dir: &std::path::Path, name: &str, extra: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> PathBuf {
    let graph = kiln::engine::optimize(&kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 32).expect("trace")).expect("optimize");
    let x = kiln::dev::uniform_tensor(&[1, 3, 32, 32], 3);
    let logits = kiln::run_cpu(&graph, &[("input", &x)]).expect("cpu").remove("logits").expect("logits");
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
    let mut child = Command::new(kiln_exe())
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
    fails_with(&["run", "resnet18", "--cpu", "--weights", dir.to_str().unwrap()], &["is a directory", "give the path of a weights file"]);
}

#[cfg(unix)]
#[test]
fn c10_fifo_as_weights_is_rejected_without_hanging() {
    let fifo = temp_dir("c10").join("w.fifo");
    let _ = std::fs::remove_file(&fifo);
    assert!(Command::new("mkfifo").arg(&fifo).status().expect("mkfifo").success());
    let mut child = Command::new(kiln_exe())
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
    let x = kiln::dev::uniform_tensor(&[1, 3, 32, 32], 1);
    let input = dir.join("x.safetensors");
    kiln::files::write_safetensors(&input, &BTreeMap::from([("input".to_string(), x)])).unwrap();
    fails_with(
        &["run", "resnet18", "--cpu", "--input", input.to_str().unwrap(), "--size", "64"],
        &["--size 64 disagrees with --input", "[1, 3, 32, 32]"],
    );
    fails_with(&["run", "resnet18", "--cpu", "--input", input.to_str().unwrap(), "--batch", "2"], &["--batch 2 disagrees with --input"]);
}

/// `--weights` reads PyTorch checkpoints (`.pth`) directly; a broken one is an error naming it
/// as a checkpoint (it used to get a hint to convert it to safetensors).
#[test]
fn c15_pth_weights_are_read_as_checkpoints() {
    let path = temp_dir("c15").join("resnet18.pth");
    std::fs::write(&path, b"PK\x03\x04\x14\x00\x00\x00\x08\x00archive/data.pkl").unwrap();
    let stderr =
        fails_with(&["run", "resnet18", "--cpu", "--weights", path.to_str().unwrap()], &["cannot read PyTorch checkpoint", "resnet18.pth"]);
    assert!(!stderr.contains("safetensors.torch.save_file"), "no conversion hint: {stderr}");
}

#[test]
fn c16_dataparallel_prefixed_weights_get_a_hint() {
    let dir = temp_dir("c16");
    let path = dir.join("dp.safetensors");
    let w = HostTensor::new(vec![2], vec![0.0; 2]);
    kiln::files::write_safetensors(&path, &BTreeMap::from([("module.conv1.weight".to_string(), w)])).unwrap();
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

// ---- A user's own model: definition -> graph file -> every command ------------------------------

use kiln::{
    nn::{AdaptiveAvgPool2d, BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, Linear, LinearConfig, ReLU},
    Forward, Graph, Module, Tensor, Tracer,
};

#[derive(Clone, Copy)]
struct TinyConfig {
    classes: usize,
}

/// A small classifier written the way a user writes one: conv-BN-ReLU twice, pooled, linear.
#[derive(Module)]
#[module(config = TinyConfig)]
struct TinyNet {
    #[module(config = Conv2dConfig::new(3, 8, 3).padding(1).bias(false))]
    conv1: Conv2d,
    #[module(config = BatchNorm2dConfig::new(8))]
    bn1: BatchNorm2d,
    #[module(config = Conv2dConfig::new(8, 16, 3).padding(1).stride(2))]
    conv2: Conv2d,
    relu: ReLU,
    #[module(config = [1, 1])]
    avgpool: AdaptiveAvgPool2d,
    #[module(config = LinearConfig::new(16, cfg.classes))]
    fc: Linear,
}

impl Forward for TinyNet {
    fn forward(&self, x: &Tensor) -> kiln::Result<Tensor> {
        let x = self.relu.forward(&self.bn1.forward(&self.conv1.forward(x)?)?)?;
        let x = self.relu.forward(&self.conv2.forward(&x)?)?;
        self.fc.forward(&self.avgpool.forward(&x)?.flatten(1)?)
    }
}

/// The `TraceFn` a program hands to `kiln_cli::main_with`; its own size is 24 x 32.
fn tinynet(vb: VarBuilder, batch: usize, hw: Option<[usize; 2]>) -> kiln::Result<Graph> {
    let [h, w] = hw.unwrap_or([24, 32]);
    let net = TinyNet::load(vb, &TinyConfig { classes: 10 })?;
    let tracer = Tracer::new();
    let x = tracer.input("input", &[batch, 3, h, w]);
    tracer.output("logits", &net.forward(&x)?);
    Ok(tracer.graph())
}

/// Writes the tiny model's graph file with the embedded CLI (`kiln trace tinynet`, in process).
fn tiny_graph_file(dir: &std::path::Path) -> PathBuf {
    let path = dir.join("tinynet.kiln.safetensors");
    let code = kiln_cli::run_with(["kiln", "-q", "trace", "tinynet", "--batch", "2", "-o", arg(&path)], &[("tinynet", tinynet)]);
    assert_eq!(code, std::process::ExitCode::SUCCESS);
    path
}

#[test]
fn user_model_is_traced_by_the_embedded_cli_and_loads_back_equal() {
    let dir = temp_dir("user-trace");
    let path = tiny_graph_file(&dir);
    let direct = tinynet(VarBuilder::seeded(), 2, None).expect("trace");
    let loaded = kiln::files::graph::read(&path).expect("the written graph file loads");
    assert_eq!(loaded.graph.nodes, direct.nodes);
    assert_eq!(loaded.graph.outputs, direct.outputs);
    assert_eq!(loaded.graph.weights.keys().collect::<Vec<_>>(), direct.weights.keys().collect::<Vec<_>>());
    for (k, w) in &direct.weights {
        assert_eq!(loaded.graph.weights[k].data, w.data, "{k}");
    }
    assert_eq!(loaded.metadata["model"], "tinynet");
    assert_eq!(loaded.metadata["input_shape"], "2x3x24x32");
    // Graph::save / Graph::load are the same format.
    let again = dir.join("again.kiln.safetensors");
    direct.save(&again).expect("save");
    assert_eq!(Graph::load(&again).expect("load").nodes, direct.nodes);
    // A name the program did not register is an error listing what is known.
    let code = kiln_cli::run_with(["kiln", "trace", "nosuchnet", "-o", arg(&dir.join("x"))], &[("tinynet", tinynet)]);
    assert_eq!(code, std::process::ExitCode::FAILURE);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn user_graph_file_runs_inspects_codegens_and_benches_on_the_cpu() {
    let dir = temp_dir("user-cpu");
    let path = tiny_graph_file(&dir);
    let out = kiln(&["run", arg(&path), "--cpu", "--seed", "3", "--batch", "3"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("batch 3, 24x32, graph file's weights, random input, --seed 3"), "{stdout}");
    assert!(stdout.contains("image 2: top-5:"), "a graph file runs at another batch than traced:\n{stdout}");
    // The CPU executor's logits equal what the CLI printed (top class of image 0).
    let graph = kiln::engine::optimize(&Graph::load(&path).expect("load")).expect("optimize");
    let x = kiln::dev::try_uniform_tensor(&[3, 3, 24, 32], 3).expect("input");
    let logits = &kiln::run_cpu(&graph, &[("input", &x)]).expect("run")["logits"];
    let best = kiln::top1(logits)[0];
    let first = stdout.lines().find(|l| l.trim_start().starts_with("class")).expect("a class line");
    assert!(first.contains(&format!("class {best:>4}")), "{first} vs top-1 {best}");

    // Another size re-infers the graph's shapes (its global pool makes any size work).
    let other = kiln(&["run", arg(&path), "--cpu", "--shapes", "input:1x3x40x56"]);
    let (stdout, stderr) = text(&other);
    assert!(other.status.success(), "{stderr}");
    assert!(stdout.contains("batch 1, 40x56"), "{stdout}");

    let inspect = kiln(&["inspect", arg(&path), "--no-engine"]);
    let (stdout, stderr) = text(&inspect);
    assert!(inspect.status.success(), "{stderr}");
    assert!(stdout.contains("conv1") && stdout.contains("bn1") && stdout.contains("fc"), "{stdout}");

    let codegen = kiln(&["codegen", arg(&path)]);
    let (stdout, stderr) = text(&codegen);
    assert!(codegen.status.success(), "{stderr}");
    assert!(stdout.contains("vb.get(&[16, 8, 3, 3], \"conv2.weight\")?"), "{stdout}");

    let (json, times) = (dir.join("bench.json"), dir.join("times.json"));
    let bench = kiln(&[
        "bench",
        arg(&path),
        "--cpu",
        "--batch",
        "1,2",
        "--warmUp",
        "0",
        "--iterations",
        "4",
        "--duration",
        "0",
        "--percentile",
        "50,99.9",
        "--json",
        arg(&json),
        "--export-times",
        arg(&times),
    ]);
    let (stdout, stderr) = text(&bench);
    assert!(bench.status.success(), "{stderr}");
    assert!(stdout.contains(" max ") && stdout.contains(" std ") && stdout.contains("p99.9"), "{stdout}");
    let records: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("JSON");
    let series: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&times).expect("times")).expect("JSON");
    assert_eq!((records.len(), series.len()), (2, 2));
    for (r, t) in records.iter().zip(&series) {
        let lat: Vec<f64> = t["latency_ms"].as_array().expect("array").iter().map(|v| v.as_f64().expect("ms")).collect();
        assert_eq!(lat.len(), r["iterations"].as_u64().expect("n") as usize);
        let max = lat.iter().copied().fold(f64::MIN, f64::max);
        let mean = lat.iter().sum::<f64>() / lat.len() as f64;
        let std = (lat.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / lat.len() as f64).sqrt();
        println!("batch {}: max {max:.3} ms, std {std:.4} ms, percentiles {}", r["batch"], r["percentiles_ms"]);
        assert!((r["max_ms"].as_f64().expect("max") - max).abs() < 1e-9, "{r}");
        assert!((r["std_ms"].as_f64().expect("std") - std).abs() < 1e-9, "{r}");
        assert_eq!(r["percentiles_ms"]["99.9"].as_f64(), Some(max), "p99.9 of 4 runs is the max");
        assert_eq!(t["model"], r["model"]);
        let starts = t["start_ms"].as_array().expect("starts");
        assert!(starts.windows(2).all(|w| w[0].as_f64() <= w[1].as_f64()), "{t}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A reference for the tiny model from the unoptimised graph (as PyTorch would compute it), with
/// the export script's metadata.
fn tiny_reference(dir: &std::path::Path, path: &std::path::Path, model_in_metadata: &str, scale: f32) -> PathBuf {
    let graph = Graph::load(path).expect("load");
    let x = kiln::dev::weight("input.0", &[2, 3, 24, 32]);
    let mut y = kiln::run_cpu(&graph, &[("input", &x)]).expect("run").remove("logits").expect("logits");
    y.data.iter_mut().for_each(|v| *v *= scale);
    let out = dir.join(format!("ref-{model_in_metadata}-{scale}.safetensors").replace('/', "_"));
    let tensors = BTreeMap::from([("input".to_string(), &x), ("output.logits".to_string(), &y)]);
    let meta = BTreeMap::from([
        ("model".to_string(), model_in_metadata.to_string()),
        ("weights".to_string(), "seeded".to_string()),
        ("input_shape".to_string(), "2x3x24x32".to_string()),
        ("seed".to_string(), "0".to_string()),
    ]);
    kiln::files::write_safetensors_with_metadata(&out, &tensors, &meta).expect("write");
    out
}

#[test]
fn compare_checks_elementwise_saves_and_loads_outputs_and_writes_a_report() {
    let dir = temp_dir("user-compare");
    let path = tiny_graph_file(&dir);
    let name = arg(&path).to_string();
    let reference = tiny_reference(&dir, &path, "tinynet", 1.0);
    let report = dir.join("report.json");
    let out =
        kiln(&["compare", &name, "--cpu", "--reference", arg(&reference), "--atol", "1e-5", "--rtol", "1e-4", "--report", arg(&report)]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(!stderr.contains("hint:"), "the metadata matches the run:\n{stderr}");
    assert!(stdout.contains("elementwise |out - ref| <= 0.00001 + 0.0001 * |ref|: 0 of 20 elements fail"), "{stdout}");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).expect("report")).expect("JSON");
    println!("report: {r}");
    assert_eq!(r["pass"], true);
    assert_eq!(r["outputs"][0]["name"], "logits");
    assert_eq!(r["outputs"][0]["elementwise"]["failing"], 0);
    assert!(r["outputs"][0]["rel_l2"].as_f64().expect("rel l2") <= 1e-5, "{r}");

    // Off by 0.1 %: rel L2 1e-3 fails the CPU's 1e-5, and every element with |ref| > 0.01 fails
    // atol 1e-5 + rtol 1e-4; a hint names the model the reference's metadata says it is for.
    let scaled = tiny_reference(&dir, &path, "resnet50", 1.001);
    let out = kiln(&["compare", &name, "--cpu", "--reference", arg(&scaled), "--atol", "1e-5", "--rtol", "1e-4", "--report", arg(&report)]);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(stderr.contains("hint: the reference was made for model `resnet50`"), "{stderr}");
    assert!(stdout.contains("FAIL (the reference may not match this run"), "{stdout}");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).expect("report")).expect("JSON");
    assert_eq!(r["pass"], false);
    assert!(r["outputs"][0]["elementwise"]["failing"].as_u64().expect("count") > 0, "{r}");
    // A loose tolerance passes the same outputs (the rule is the tolerance's, not fixed).
    let loose = kiln(&["compare", &name, "--cpu", "--reference", arg(&scaled), "--l2-tol", "1e-2", "--atol", "1e-2", "--rtol", "1e-2"]);
    assert!(loose.status.success(), "{}", text(&loose).0);

    // Save the outputs of a random input, then compare a second run against them.
    let saved = dir.join("saved.safetensors");
    let out = kiln(&["compare", &name, "--cpu", "--seed", "5", "--batch", "2", "--save-outputs", arg(&saved)]);
    assert!(out.status.success(), "{}", text(&out).1);
    let meta = kiln::files::read_metadata(&saved).expect("metadata");
    assert_eq!((meta["seed"].as_str(), meta["input_shape"].as_str(), meta["weights"].as_str()), ("5", "2x3x24x32", "graph file"));
    let tensors = kiln::files::read_safetensors(&saved).expect("tensors");
    assert_eq!(tensors["input.input"], kiln::dev::try_uniform_tensor(&[2, 3, 24, 32], 5).expect("input"), "inputs are stored by name");
    let out = kiln(&["compare", &name, "--cpu", "--load-outputs", arg(&saved), "--atol", "0", "--rtol", "0"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("0 of 20 elements fail") && stdout.contains("PASS"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 29, item 9: `kiln trace -o r18.graph` wrote a graph file that `kiln run r18.graph` refused
/// ("is neither a graph file nor an engine file"); a file's kind is now told by its content.
#[test]
fn model_files_are_told_apart_by_content_not_by_extension() {
    let dir = temp_dir("kinds");
    let graph = dir.join("r18.graph");
    let out = kiln(&["trace", "resnet18", "--size", "32", "-o", arg(&graph)]);
    assert!(out.status.success(), "{}", text(&out).1);
    let (stdout, stderr) = text(&kiln(&["run", arg(&graph), "--cpu", "--seed", "1"]));
    assert!(stdout.contains("image 0: top-5:"), "{stdout}{stderr}");
    // Starts with the engine magic: read as an engine file (and rejected as one), whatever its name.
    let engine = dir.join("model.kiln.safetensors");
    std::fs::write(&engine, b"KILNENG\0 and then nothing an engine holds").expect("write");
    let stderr = fails_with(&["inspect", arg(&engine), "--no-engine"], &["error: "]);
    assert!(stderr.contains("engine") && !stderr.contains("graph file"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn files_that_are_neither_graphs_nor_engines_are_named() {
    let dir = temp_dir("not-a-model");
    let notes = dir.join("notes.txt");
    std::fs::write(&notes, "hello").expect("write");
    fails_with(&["run", arg(&notes), "--cpu"], &["is neither a graph file (.kiln.safetensors", "nor an engine file (.kiln"]);
    let weights = dir.join("weights.safetensors");
    kiln::files::write_safetensors(&weights, &BTreeMap::from([("w".to_string(), HostTensor::new(vec![1], vec![0.5]))])).expect("write");
    fails_with(&["run", arg(&weights), "--cpu"], &["is a safetensors file but not a Kiln graph file", "--weights"]);
    fails_with(&["run", "/nonexistent/model.kiln.safetensors", "--cpu"], &["/nonexistent/model.kiln.safetensors", "no such file"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn shapes_flags_pick_the_input_shape_and_disagreements_are_errors() {
    let out = kiln(&["run", "resnet18", "--cpu", "--seed", "1", "--shapes", "input:2x3x32x48"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("batch 2, 32x48"), "{stdout}");
    fails_with(
        &["run", "resnet18", "--cpu", "--batch", "1", "--shapes", "input:2x3x32x32"],
        &["--batch 1 disagrees with --shapes input:2x3x32x32"],
    );
    fails_with(&["run", "resnet18", "--cpu", "--shapes", "input:2x3x32"], &["--shapes gives 3 dims for `input`"]);
    let (_, stderr) = text(&kiln(&["run", "resnet18", "--shapes", "input:2x0x3x3"]));
    assert!(stderr.contains("every dim must be at least 1"), "{stderr}");
}

/// Issue 29, item 7: `--shapes` naming an input the model does not have, or another channel
/// count, was ignored (`kiln run resnet18 --cpu --shapes other:1x7x32x32` exited 0). Every command
/// that takes the flag now names the flag, the input and both shapes.
#[test]
fn shapes_of_an_unknown_input_or_other_channels_are_errors() {
    let unknown = ["--shapes other:1x7x32x32: resnet18 has no input `other`", "its inputs: `input` Nx3x32x32"];
    let channels = ["--shapes input:1x7x32x32: resnet18's input `input` is Nx3x32x32"];
    fails_with(&["run", "resnet18", "--cpu", "--shapes", "other:1x7x32x32"], &unknown);
    fails_with(&["run", "resnet18", "--cpu", "--shapes", "input:1x7x32x32"], &channels);
    fails_with(&["trace", "resnet18", "--shapes", "input:1x7x32x32", "-o", "/tmp/kiln-never.kiln.safetensors"], &channels);
    fails_with(&["inspect", "resnet18", "--no-engine", "--shapes", "other:1x7x32x32"], &unknown);
    fails_with(&["codegen", "resnet18", "--shapes", "input:1x7x32x32"], &channels);
    fails_with(&["compare", "resnet18", "--cpu", "--shapes", "other:1x7x32x32"], &unknown);
    let bench = ["bench", "resnet18", "--cpu", "--shapes", "input:1x7x32x32", "--iterations", "1", "--duration", "0", "--warmUp", "0"];
    fails_with(&bench, &channels);
    assert!(!std::path::Path::new("/tmp/kiln-never.kiln.safetensors").exists());
    // With a reference, its input decides the shape; --shapes may only repeat it.
    let dir = temp_dir("shapes-reference");
    let reference = resnet18_reference(&dir, "r.safetensors", &[]);
    let compare = |shapes: &str| kiln(&["compare", "resnet18", "--cpu", "--reference", arg(&reference), "--shapes", shapes]);
    assert!(compare("input:1x3x32x32").status.success());
    let out = compare("input:2x3x32x32");
    assert!(text(&out).1.contains("--shapes input:2x3x32x32 disagrees with the input of"), "{}", text(&out).1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 29, item 7: `trace`, `inspect`, `codegen` and `calibrate` took `--batch`'s default as
/// typed, so `--shapes input:2x...` failed with "--batch 1 disagrees". A typed `--batch` still must
/// agree.
#[test]
fn the_default_batch_does_not_contradict_shapes() {
    let dir = temp_dir("default-batch");
    let graph = dir.join("r18.kiln.safetensors");
    let (stdout, stderr) = text(&kiln(&["trace", "resnet18", "--shapes", "input:2x3x32x32", "-o", arg(&graph)]));
    assert!(stdout.contains("input 2x3x32x32"), "{stdout}{stderr}");
    let (stdout, stderr) = text(&kiln(&["inspect", "resnet18", "--no-engine", "--shapes", "input:2x3x32x32"]));
    assert!(stdout.contains("== traced graph: resnet18 (batch 2, 32x32) =="), "{stdout}{stderr}");
    let (stdout, stderr) = text(&kiln(&["codegen", "resnet18", "--shapes", "input:2x3x32x32"]));
    assert!(
        stdout.contains("pub fn build(vb: &VarBuilder, batch: usize)") && stdout.contains("--shapes input:2x3x32x32"),
        "{stdout}{stderr}"
    );
    let data = dir.join("calib.safetensors");
    let images = kiln::dev::uniform_tensor(&[2, 3, 32, 32], 3);
    kiln::files::write_safetensors(&data, &BTreeMap::from([("input".to_string(), images)])).expect("write");
    let cache = dir.join("c.json");
    let calibrate = ["calibrate", "digits_resnet", "--shapes", "input:2x3x32x32", "--data", arg(&data), "-o", arg(&cache)];
    let out = kiln(&calibrate);
    assert!(out.status.success(), "{}", text(&out).1);
    fails_with(&["trace", "resnet18", "--batch", "1", "--shapes", "input:2x3x32x32", "-o", arg(&graph)], &["--batch 1 disagrees"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 29, item 10: `build` looked for a GPU before it checked its batch flags, so a batch of 0
/// or a range upside down said "no GPU available" on a machine without one.
#[test]
fn build_checks_its_batch_flags_before_looking_for_a_gpu() {
    let out = "/tmp/kiln-never-batch.kiln";
    fails_with(&["build", "resnet18", "--max-batch", "0", "-o", out], &["error: --max-batch must be at least 1"]);
    fails_with(
        &["build", "resnet18", "--min-batch", "4", "--max-batch", "2", "-o", out],
        &["error: --min-batch 4 is more than --max-batch 2"],
    );
    fails_with(
        &["build", "resnet18", "--opt-batch", "8", "--max-batch", "4", "-o", out],
        &["--opt-batch 8 must lie within --min-batch 1 and --max-batch 4"],
    );
    assert!(!std::path::Path::new(out).exists());
}

/// A graph file of a 1-channel model (input [1, 1, 8, 8]).
fn one_channel_graph_file(dir: &std::path::Path) -> PathBuf {
    let tracer = Tracer::new();
    let x = tracer.input("input", &[1, 1, 8, 8]);
    conv_graph_file(&tracer, &x, 1, &dir.join("gray.kiln.safetensors"))
}

/// Issue 29, item 10: `--input` demanded 3 channels even for a 1-channel graph file, and a model
/// whose input is u8 could not take a U8 input file. The file's tensor is now checked against the
/// model's input: its dims after the batch, and its type.
#[test]
fn input_files_follow_the_models_channels_and_type() {
    let dir = temp_dir("input-kinds");
    let gray = one_channel_graph_file(&dir);
    let x = kiln::dev::uniform_tensor(&[2, 1, 8, 8], 4);
    let input = dir.join("gray-input.safetensors");
    kiln::files::write_safetensors(&input, &BTreeMap::from([("input".to_string(), x)])).expect("write");
    let (stdout, stderr) = text(&kiln(&["run", arg(&gray), "--cpu", "--input", arg(&input)]));
    assert!(stdout.contains("batch 2, 8x8") && stdout.contains("y: [2, 4, 8, 8]"), "{stdout}{stderr}");
    fails_with(
        &["run", "resnet18", "--cpu", "--input", arg(&input)],
        &["--input", "holds shape [2, 1, 8, 8]; resnet18's input `input` takes [N, 3, 8, 8]"],
    );

    let frame = frame_graph_file(&dir);
    let bytes: Vec<u8> = (0..2 * 30 * 120).map(|i| (i * 7 % 256) as u8).collect();
    let frames = dir.join("frames.safetensors");
    std::fs::write(&frames, raw_safetensors(&[("frame", "U8", vec![2, 30, 120], bytes.clone())])).expect("write");
    let (stdout, stderr) = text(&kiln(&["run", arg(&frame), "--cpu", "--input", arg(&frames)]));
    let given = kiln::ByteTensor::new(vec![2, 30, 120], bytes).expect("bytes");
    let graph = kiln::engine::optimize(&Graph::load(&frame).expect("load")).expect("optimize");
    let y = kiln::run_cpu(&graph, &[("frame", &given)]).expect("run").remove("y").expect("y");
    let mean = y.data.iter().map(|&v| v as f64).sum::<f64>() / y.numel() as f64;
    assert!(stdout.contains("batch 2, frame 30x120 u8") && stdout.contains(&format!("mean {mean:.3}")), "{stdout}{stderr}");
    // Bytes for an f32 input are still refused, naming the tensor's dtype.
    fails_with(&["run", arg(&gray), "--cpu", "--input", arg(&frames)], &["input tensor `frame` has dtype U8"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn diagnostics_follow_quiet_verbose_and_rust_log() {
    let dir = temp_dir("logging");
    let path = tiny_graph_file(&dir);
    let quiet = kiln(&["-q", "run", arg(&path), "--seed", "1"]);
    let (stdout, stderr) = text(&quiet);
    assert!(quiet.status.success(), "{stderr}");
    assert!(stderr.is_empty(), "-q leaves only errors on standard error:\n{stderr}");
    assert!(stdout.contains("top-5"), "{stdout}");
    let debug = kiln_env(&["run", arg(&path), "--cpu", "--seed", "1"], &[("RUST_LOG", "kiln=debug")]);
    let (_, stderr) = text(&debug);
    assert!(
        stderr.contains("DEBUG") && stderr.contains("loaded graph file"),
        "RUST_LOG=kiln=debug shows the library's debug lines:\n{stderr}"
    );
    let verbose = kiln(&["-v", "run", arg(&path), "--cpu", "--seed", "1"]);
    assert!(text(&verbose).1.contains("loaded graph file"), "{}", text(&verbose).1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn help_examples_are_unwrapped_and_parse() {
    use clap::{CommandFactory, Parser};
    let help = text(&kiln(&["--help"])).0;
    for example in kiln_cli::EXAMPLES {
        assert!(help.lines().any(|l| l.trim() == *example), "`{example}` is one unwrapped line of --help:\n{help}");
        let words: Vec<&str> = example.split_whitespace().collect();
        kiln_cli::Cli::try_parse_from(&words).unwrap_or_else(|e| panic!("`{example}`: {e}"));
    }
    let cli = kiln_cli::Cli::command();
    for sub in cli.get_subcommands() {
        let name = sub.get_name().to_string();
        let help = text(&kiln(&[&name, "--help"])).0;
        let examples: Vec<&str> = help.lines().map(str::trim).filter(|l| l.starts_with("kiln ")).collect();
        assert!(!examples.is_empty(), "{name} --help has examples");
        for line in examples {
            let words: Vec<&str> = line.split_whitespace().collect();
            kiln_cli::Cli::try_parse_from(&words).unwrap_or_else(|e| panic!("{name} --help: `{line}`: {e}"));
        }
        // `--batch` is documented wherever it exists.
        if let Some(batch) = sub.get_arguments().find(|a| a.get_id() == "batch") {
            assert!(batch.get_help().is_some_and(|h| !h.to_string().is_empty()), "{name} --batch has help");
        }
    }
    // trtexec's spellings are accepted.
    for args in [
        &["kiln", "bench", "--loadEngine", "e.kiln", "--warmUp", "10", "--exportTimes", "t.json"][..],
        &["kiln", "profile", "--loadEngine", "e.kiln", "--exportProfile", "p.json"],
        &[
            "kiln",
            "build",
            "resnet18",
            "--saveEngine",
            "e.kiln",
            "--minShapes",
            "input:1x3x224x224",
            "--optShapes",
            "input:4x3x224x224",
            "--maxShapes",
            "input:8x3x224x224",
        ],
    ] {
        kiln_cli::Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    }
}

// ---- GPU paths of the user model (the lead runs these on the device) ----------------------------

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn gpu_user_graph_file_builds_benches_profiles_and_compares() {
    let dir = temp_dir("user-gpu");
    let path = tiny_graph_file(&dir);
    let engine = dir.join("tinynet.kiln");
    let out = kiln(&[
        "build",
        arg(&path),
        "--fp32",
        "--minShapes",
        "input:1x3x24x32",
        "--optShapes",
        "input:2x3x24x32",
        "--maxShapes",
        "input:4x3x24x32",
        "--saveEngine",
        arg(&engine),
    ]);
    assert!(out.status.success(), "{}", text(&out).1);
    let times = dir.join("times.json");
    let out = kiln(&[
        "bench",
        "--loadEngine",
        arg(&engine),
        "--shapes",
        "input:4x3x24x32",
        "--iterations",
        "20",
        "--duration",
        "0",
        "--export-times",
        arg(&times),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    println!("{stdout}");
    let series: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&times).expect("times")).expect("JSON");
    assert!(series.iter().all(|s| s["batch"] == 4 && s["latency_ms"].as_array().is_some_and(|a| a.len() >= 20)), "{series:?}");
    let (json, csv) = (dir.join("profile.json"), dir.join("profile.csv"));
    let out = kiln(&["profile", arg(&engine), "--batch", "2", "--export-profile", arg(&json), "--csv", arg(&csv)]);
    assert!(out.status.success(), "{}", text(&out).1);
    let layers: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("JSON");
    let rows = std::fs::read_to_string(&csv).expect("csv");
    assert_eq!(rows.lines().count(), layers.len() + 1, "{rows}");
    // The engine against the CPU executor's saved outputs, elementwise (FP32: no TF32 rounding).
    let saved = dir.join("cpu.safetensors");
    let out = kiln(&["compare", arg(&path), "--cpu", "--batch", "2", "--save-outputs", arg(&saved)]);
    assert!(out.status.success(), "{}", text(&out).1);
    let out = kiln(&["compare", arg(&engine), "--load-outputs", arg(&saved), "--l2-tol", "1e-4", "--atol", "1e-4", "--rtol", "1e-3"]);
    let (stdout, stderr) = text(&out);
    println!("{stdout}");
    assert!(out.status.success(), "{stdout}{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn c23_bad_percentile_and_tolerances_are_clear_errors() {
    fails_with(&["bench", "resnet18", "--cpu", "--percentile", "101"], &["--percentile must be within 0 and 100, got 101"]);
    fails_with(&["compare", "resnet18", "--cpu", "--atol", "nan"], &["--atol must be a finite, non-negative tolerance, got NaN"]);
    fails_with(&["compare", "resnet18", "--cpu", "--l2-tol=-1"], &["--l2-tol must be a finite, non-negative tolerance, got -1"]);
}

// ---- A model whose input is a frame of bytes (u8), as YOLO's letterbox front takes ---------------

/// A graph file of a letterbox front (`frame`: `[N, 30, 40 * 3]` u8) and a 3x3 conv on its
/// 32x32 output.
fn frame_graph_file(dir: &std::path::Path) -> PathBuf {
    let tracer = Tracer::new();
    let frame = kiln_models::yolo_letterbox::frame_input(&tracer, "frame", 1, [30, 40]);
    let x = kiln_models::yolo_letterbox::letterbox(&frame, [32, 32]).expect("letterbox");
    conv_graph_file(&tracer, &x, 3, &dir.join("frame.kiln.safetensors"))
}

/// `x` (of `channels`) through a seeded 3x3 conv to 4 channels, the output `y`, saved at `path`.
fn conv_graph_file(tracer: &Tracer, x: &Tensor, channels: usize, path: &std::path::Path) -> PathBuf {
    let conv = Conv2d::load(VarBuilder::seeded().pp("conv"), &Conv2dConfig::new(channels, 4, 3).padding(1)).expect("conv");
    tracer.output("y", &conv.forward(x).expect("conv"));
    tracer.graph().save(path).expect("save");
    path.to_path_buf()
}

/// `--frames HxW[:bgr]` traces a bundled classifier behind `classify_preset` and a YOLO behind
/// `yolo_letterbox`, their input `frame` u8 in the order asked; other models and orders are
/// flag errors.
#[test]
fn frames_put_a_bundled_model_behind_its_entry_stage() {
    let dir = temp_dir("frames");
    for (model, frames, op, bgr) in [("mobilenet_v2", "48x64", "classify_preset", 0.0), ("yolov8n", "48x64:bgr", "yolo_letterbox", 1.0)] {
        let path = dir.join(format!("{model}.kiln.safetensors"));
        let out = kiln(&["trace", model, "--frames", frames, "-o", arg(&path)]);
        assert!(out.status.success(), "{}", text(&out).1);
        let graph = Graph::load(&path).expect("load");
        assert_eq!(graph.input_dtype("frame"), Some(kiln::DType::U8));
        let entry = graph.nodes.iter().find(|n| n.op.name() == op).unwrap_or_else(|| panic!("{model}: no {op}"));
        let kiln::plugin::Op::Custom(call) = &entry.op else { panic!("{op} is a custom op") };
        assert_eq!(call.attrs.get("bgr"), Some(&bgr), "{model} {frames}");
    }
    for (args, says) in [
        (["centernet", "--frames", "48x64"], "centernet has no entry stage"),
        (["mobilenet_v2", "--frames", "48x64:yuv"], "`yuv` is not a channel order"),
        (["mobilenet_v2", "--frames", "48"], "takes HxW"),
    ] {
        let out = kiln(&[&["trace"], &args[..], &["-o", arg(&dir.join("x.kiln.safetensors"))]].concat());
        let stderr = text(&out).1;
        assert!(!out.status.success() && stderr.contains("--frames") && stderr.contains(says), "{args:?}: {stderr}");
    }
}

#[test]
fn a_u8_frame_model_runs_benches_inspects_and_codegens_on_the_cpu() {
    let dir = temp_dir("u8-frame");
    let path = frame_graph_file(&dir);
    let out = kiln(&["run", arg(&path), "--cpu", "--seed", "2", "--batch", "2"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    println!("{stdout}");
    assert!(stdout.contains("batch 2, frame 30x120 u8, graph file's weights, random input, --seed 2"), "{stdout}");
    // The random input is bytes drawn from the seed: the CLI's output is the CPU executor's on them.
    let values = kiln::dev::try_uniform_tensor(&[2, 30, 120], 2).expect("values");
    let bytes =
        kiln::ByteTensor::new(values.shape.clone(), values.data.iter().map(|v| ((v + 1.0) * 128.0) as u8).collect()).expect("bytes");
    let graph = kiln::engine::optimize(&Graph::load(&path).expect("load")).expect("optimize");
    let y = kiln::run_cpu(&graph, &[("frame", &bytes)]).expect("run").remove("y").expect("y");
    let (lo, hi) = y.data.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let mean = y.data.iter().map(|&v| v as f64).sum::<f64>() / y.numel() as f64;
    let line = format!("y: [2, 4, 32, 32], min {lo:.3}, max {hi:.3}, mean {mean:.3}");
    assert!(stdout.contains(&line), "`{line}` in:\n{stdout}");

    let bench = kiln(&["bench", arg(&path), "--cpu", "--batch", "1,2", "--warmUp", "0", "--iterations", "2", "--duration", "0"]);
    let (stdout, stderr) = text(&bench);
    assert!(bench.status.success(), "{stderr}");
    assert_eq!(stdout.lines().filter(|l| l.contains("cpu-f32")).count(), 2, "{stdout}");

    let inspect = kiln(&["inspect", arg(&path), "--no-engine"]);
    let (stdout, stderr) = text(&inspect);
    assert!(inspect.status.success(), "{stderr}");
    println!("{stdout}");
    assert!(stdout.contains("input `frame` u8") && stdout.contains("frame 30x120 u8"), "{stdout}");

    let codegen = kiln(&["codegen", arg(&path)]);
    let (stdout, stderr) = text(&codegen);
    assert!(codegen.status.success(), "{stderr}");
    assert!(stdout.contains("tracer.input_typed(\"frame\", &[batch, 30, 120], DType::U8)"), "{stdout}");

    // An image size is for NCHW inputs; the frame model says what it takes instead.
    fails_with(
        &["run", arg(&path), "--cpu", "--size", "64"],
        &["--size/--shapes 64x64 is for an NCHW image input", "takes frame 30x120 u8, at its traced dims"],
    );
    // compare draws random bytes for it (inputs of any kind and name).
    let out = kiln(&["compare", arg(&path), "--cpu"]);
    assert!(out.status.success() && text(&out).0.contains("nothing compared (no reference)"), "{:?}", text(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn gpu_a_u8_frame_model_runs_builds_and_benches() {
    let dir = temp_dir("u8-frame-gpu");
    let path = frame_graph_file(&dir);
    let out = kiln(&["run", arg(&path), "--seed", "2", "--batch", "2"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("GPU engine (fp16)") && stdout.contains("y: [2, 4, 32, 32]"), "{stdout}");
    let engine = dir.join("frame.kiln");
    let out = kiln(&["build", arg(&path), "--max-batch", "4", "-o", arg(&engine)]);
    assert!(out.status.success(), "{}", text(&out).1);
    let out = kiln(&["bench", arg(&engine), "--batch", "1,4", "--iterations", "5", "--duration", "0"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    println!("{stdout}");
    let out = kiln(&["inspect", arg(&engine), "--batch", "2"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("input `frame`: 30x120 u8") && stdout.contains("kernel:cast_u8_f16"), "{stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- issue 27: photos in, labelled answers out ------------------------------------------------

/// The real data of `tools/fetch_real_data.py` (torchvision's MobileNetV2 checkpoint and
/// scikit-image's photos); a failure saying how to fetch it when it is not there (the test is
/// `#[ignore]`d, as in vision/tests/real_photos.rs, and run with `--ignored` after the fetch).
fn real_data() -> PathBuf {
    let dir = std::env::var_os("KILN_REAL_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/real-data"));
    assert!(
        dir.join("mobilenet_v2-b0353104.pth").is_file() && dir.join("photos/chelsea.png").is_file(),
        "no checkpoint and photos in {}: run `python3 tools/fetch_real_data.py` (or set KILN_REAL_DATA)",
        dir.display()
    );
    dir
}

/// The class numbers of `kiln run --image`'s lines (`    p 0.717  Egyptian cat (class 285)`), in order.
fn printed_classes(stdout: &str) -> Vec<usize> {
    stdout.lines().filter_map(|l| l.trim_end().strip_suffix(')')?.rsplit_once("(class ")?.1.parse().ok()).collect()
}

#[test]
#[ignore = "needs the real data: python3 tools/fetch_real_data.py, then run with --ignored"]
fn run_names_chelsea_a_cat_with_torchvisions_checkpoint() {
    let dir = real_data();
    let (pth, photos) = (dir.join("mobilenet_v2-b0353104.pth"), dir.join("photos"));
    let (cat, coffee) = (photos.join("chelsea.png"), photos.join("coffee.png"));
    let out = kiln(&["run", "mobilenet_v2", "--cpu", "--weights", arg(&pth), "--image", arg(&cat), "--image", arg(&coffee)]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("batch 2, 224x224, weights ") && !stdout.contains("random weights"), "{stdout}");
    let classes = printed_classes(&stdout);
    assert_eq!(classes.len(), 10, "top-5 of each photo:\n{stdout}");
    assert!((281..=285).contains(&classes[0]), "chelsea.png is a cat first:\n{stdout}");
    assert_eq!(classes[5], 967, "coffee.png is an espresso first:\n{stdout}");
    assert!(stdout.contains("chelsea.png: top-5:") && stdout.contains("espresso (class 967)"), "{stdout}");
    // The probabilities are softmax values: torchvision gives chelsea.png's top class p 0.717.
    let first = stdout.lines().find(|l| l.contains("(class ")).expect("a class line");
    let p: f64 = first.trim().strip_prefix("p ").and_then(|r| r.split_whitespace().next()).and_then(|v| v.parse().ok()).expect("p");
    assert!((0.6..0.85).contains(&p), "{first}");
}

#[test]
fn random_weights_are_said_plainly_and_digits_resnet_runs_trained() {
    let out = kiln(&["run", "resnet18", "--cpu", "--size", "32", "--seed", "1"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("random weights: resnet18's answers below are meaningless"), "{stdout}");

    let out = kiln(&["run", "digits_resnet", "--cpu", "--seed", "1"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("trained weights (models/weights/digits_resnet.safetensors, built in)"), "{stdout}");
    assert!(!stdout.contains("random weights"), "{stdout}");
    // Those are the committed weights: the CLI's logits equal the library's with that file.
    let dir = temp_dir("digits");
    let x = kiln::dev::uniform_tensor(&[1, 3, 32, 32], 4);
    let input = dir.join("x.safetensors");
    kiln::files::write_safetensors(&input, &BTreeMap::from([("input".to_string(), x.clone())])).expect("input");
    let stdout = text(&kiln(&["run", "digits_resnet", "--cpu", "--input", arg(&input), "--top", "1"])).0;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let vb = VarBuilder::from_safetensors(&[root.join(kiln_models::DIGITS_WEIGHTS)]).expect("weights");
    let graph = kiln_models::trace("digits_resnet", vb, 1, 32).expect("trace");
    let logits = &kiln::run_cpu(&graph, &[("input", &x)]).expect("run")["logits"];
    let best = kiln::top1(logits)[0];
    assert!(stdout.contains(&format!("class {best:>4}")), "top-1 {best}:\n{stdout}");
}

/// A 40x30 test card: a bright square on a dark ground.
fn test_card(path: &std::path::Path) {
    let img = kiln_vision::RgbImage::from_fn(40, 30, |x, y| {
        let inside = (10..30).contains(&x) && (5..25).contains(&y);
        kiln_vision::image::Rgb(if inside { [230, 200, 40] } else { [20, 30, 60 + y as u8] })
    });
    kiln_vision::save_png(&img, path).expect("png");
}

#[test]
fn run_images_follows_the_models_preprocessing() {
    let dir = temp_dir("images");
    let card = dir.join("card.png");
    test_card(&card);
    // A classifier: its input is torchvision's preset of the file, so its answer equals the
    // library's on kiln_vision::ClassifyPreset (here at 64x64: Resize(73), CenterCrop(64)).
    let out = kiln(&["run", "resnet18", "--cpu", "--size", "64", "--image", arg(&card), "--top", "3"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("batch 1, 64x64, seeded weights, 1 image(s) (Classifier preprocessing)"), "{stdout}");
    let x = kiln_vision::ClassifyPreset::for_input(64).load(&[&card]).expect("preset");
    let graph = kiln::engine::optimize(&kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 64).expect("trace")).expect("optimize");
    let logits = &kiln::run_cpu(&graph, &[("input", &x)]).expect("run")["logits"];
    let want: Vec<usize> = kiln_vision::top_k(&logits.data, 3).iter().map(|p| p.class).collect();
    assert_eq!(printed_classes(&stdout), want, "{stdout}");
    fails_with(
        &["run", "resnet18", "--cpu", "--size", "32", "--image", arg(&card), "--save", "x.png"],
        &["--save draws a detector's boxes"],
    );
    fails_with(&["run", "resnet18", "--cpu", "--image", arg(&card), "--batch", "2"], &["--batch 2 disagrees with the 1 --image file(s)"]);
    let garbage = dir.join("garbage.jpg");
    std::fs::write(&garbage, b"not a jpeg").unwrap();
    fails_with(&["run", "resnet18", "--cpu", "--image", arg(&garbage)], &["cannot read image", "garbage.jpg", "cannot decode it"]);

    // A detector: letterboxed, its boxes printed in the photo's pixels and drawn by --save.
    let saved = dir.join("boxes.png");
    let out = kiln(&["run", "yolov8n", "--cpu", "--size", "96", "--image", arg(&card), "--image", arg(&card), "--save", arg(&saved)]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("card.png: ") && stdout.contains("detections (score >= 0.25), boxes in image pixels"), "{stdout}");
    for n in 0..2 {
        let written = dir.join(format!("boxes_{n}.png"));
        assert!(stdout.contains(&format!("wrote {}", written.display())), "{stdout}");
        assert_eq!(kiln_vision::load_rgb(&written).expect("saved png").dimensions(), (40, 30), "drawn on the photo itself");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// CenterNet's `--image` path: the photo letterboxed to the input, every printed box mapped back
/// into the photo's pixels, and `--save` drawing on the photo itself. (Seeded weights predict some
/// negative sizes, which CenterNet's decode keeps, as PyTorch's does: corners are not ordered.)
#[test]
fn run_images_maps_centernet_boxes_into_the_photo() {
    let dir = temp_dir("images-centernet");
    let card = dir.join("card.png");
    test_card(&card);
    let saved = dir.join("centernet.png");
    let out = kiln(&["run", "centernet", "--cpu", "--size", "128", "--image", arg(&card), "--top", "100", "--save", arg(&saved)]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("card.png: ") && stdout.contains("boxes in image pixels"), "{stdout}");
    let boxes: Vec<[f32; 4]> = stdout
        .lines()
        .filter_map(|l| {
            let (_, rest) = l.split_once("  (")?;
            let nums: Vec<f32> =
                rest.split(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-')).filter_map(|t| t.parse().ok()).collect();
            Some([nums[0], nums[1], *nums.get(2)?, *nums.get(3)?])
        })
        .collect();
    println!("{} boxes printed", boxes.len());
    assert!(!boxes.is_empty(), "no boxes printed:\n{stdout}");
    // Boxes left in the 128-pixel input's coordinates would mostly clamp to the photo's edges: at
    // most half of the x corners may sit there.
    let on_edge = boxes.iter().flat_map(|b| [b[0], b[2]]).filter(|&x| x <= 0.0 || x >= 40.0).count();
    assert!(on_edge < boxes.len(), "{on_edge} of {} x corners on the photo's edges:\n{stdout}", 2 * boxes.len());
    for &[x1, y1, x2, y2] in &boxes {
        assert!((0.0..=40.0).contains(&x1) && (0.0..=40.0).contains(&x2), "x outside the 40-pixel photo: {x1} {x2}\n{stdout}");
        assert!((0.0..=30.0).contains(&y1) && (0.0..=30.0).contains(&y2), "y outside the 30-pixel photo: {y1} {y2}\n{stdout}");
    }
    assert!(stdout.contains(&format!("wrote {}", saved.display())), "{stdout}");
    assert_eq!(kiln_vision::load_rgb(&saved).expect("saved png").dimensions(), (40, 30), "drawn on the photo itself");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kiln calibrate --data` reads a folder of any images: one at the input size as it is, another
/// through the model's preprocessing; the cache equals one made from the same tensor in a file.
#[test]
fn calibrate_reads_a_folder_of_any_images() {
    let dir = temp_dir("calib-images");
    let folder = dir.join("photos");
    std::fs::create_dir_all(&folder).expect("folder");
    test_card(&folder.join("a.png"));
    let exact = kiln_vision::RgbImage::from_fn(32, 32, |x, y| kiln_vision::image::Rgb([(x * 8) as u8, (y * 8) as u8, 128]));
    exact.save_with_format(folder.join("b.bmp"), kiln_vision::image::ImageFormat::Bmp).expect("bmp");
    std::fs::write(folder.join("notes.txt"), b"not an image").unwrap();
    let (from_folder, from_file) = (dir.join("folder.json"), dir.join("file.json"));
    let out = kiln(&["calibrate", "resnet18", "--size", "32", "--data", arg(&folder), "--method", "minmax", "-o", arg(&from_folder)]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("on 2 image(s)"), "{stdout}");

    let preset = kiln_vision::ClassifyPreset::for_input(32);
    let a = preset.load(&[folder.join("a.png")]).expect("preset");
    let b = kiln_vision::to_nchw(&[exact], preset.mean, preset.std).expect("as it is");
    let data = dir.join("set.safetensors");
    let both = HostTensor::new(vec![2, 3, 32, 32], a.data.iter().chain(&b.data).copied().collect());
    kiln::files::write_safetensors(&data, &BTreeMap::from([("input".to_string(), both)])).expect("set");
    let out = kiln(&["calibrate", "resnet18", "--size", "32", "--data", arg(&data), "--method", "minmax", "-o", arg(&from_file)]);
    assert!(out.status.success(), "{}", text(&out).1);
    let (x, y) = (
        kiln::engine::CalibrationCache::load(&from_folder).expect("cache"),
        kiln::engine::CalibrationCache::load(&from_file).expect("cache"),
    );
    assert_eq!(x.tensors.len(), y.tensors.len());
    for (name, r) in &x.tensors {
        assert_eq!(r.amax, y.tensors[name].amax, "{name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn codegen_is_structured_for_imported_graphs_and_flat_on_request() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/imported/tiny_resnet.kiln.safetensors");
    let out = kiln(&["codegen", arg(&fixture)]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("#[derive(Module)]") && stdout.contains("impl Forward for"), "{stdout}");
    assert!(stdout.contains("pub fn build(vb: VarBuilder, batch: usize) -> Result<Graph>"), "{stdout}");
    let flat = kiln(&["codegen", arg(&fixture), "--flat"]);
    let (stdout, stderr) = text(&flat);
    assert!(flat.status.success(), "{stderr}");
    assert!(!stdout.contains("#[derive(Module)]") && stdout.contains("pub fn build(vb: &VarBuilder, batch: usize)"), "{stdout}");
    assert!(stdout.contains("--flat"), "the command is quoted: {stdout}");
    // A graph traced in Rust has no module classes: flat, with a note saying why.
    let (stdout, stderr) = text(&kiln(&["codegen", "resnet18"]));
    assert!(stderr.contains("records no module classes") && stderr.contains("flat op list"), "{stderr}");
    assert!(stdout.contains("vb.get("), "{stdout}");
}

#[test]
fn triton_repo_writes_a_repository_the_backend_accepts() {
    let dir = temp_dir("triton-repo");
    let graph = tiny_graph_file(&dir);
    let repo = dir.join("repo");
    let out = kiln(&["triton-repo", arg(&graph), "-o", arg(&repo), "--name", "tiny", "--cpu", "--max-batch-size", "4"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("tritonserver") && stdout.contains("--model-repository"), "{stdout}");
    let config = std::fs::read_to_string(repo.join("tiny/config.pbtxt")).expect("config.pbtxt");
    for want in ["backend: \"kiln\"", "max_batch_size: 4", "KIND_CPU", "dynamic_batching", "name: \"input\"", "name: \"logits\""] {
        assert!(config.contains(want), "{want}:\n{config}");
    }
    let copied = repo.join("tiny/1/model.kiln.safetensors");
    assert_eq!(std::fs::read(&copied).expect("model file"), std::fs::read(&graph).expect("graph file"), "the graph file is copied");
    fails_with(
        &["triton-repo", "resnet18", "-o", arg(&repo), "--letterbox", "720x1280"],
        &["a letterbox in front of resnet18", "only the YOLO detectors take frames"],
    );
    fails_with(&["triton-repo", arg(&graph), "-o", arg(&repo), "--precision", "fp64"], &["--precision", "fp64"]);
    let _ = std::fs::remove_dir_all(&dir);
}
