//! Hardening, round two, as a user meets it through the `kiln` binary (docs/RELIABILITY.md,
//! "Round two"): one test per item, `chNN_` after the item. Each failed before its fix. The
//! library side of each item is tests/hardening.rs.

mod common;

use common::*;

use kiln::{
    plugin::{ConvAttrs, Op, Unary},
    Graph, HostTensor,
};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Arc;

/// Runs `kiln args` (through `sh -c` with `prefix` first, e.g. a `ulimit`), killing it after
/// 60 s: a hang is a failure, not a stuck test run.
fn kiln_in(prefix: &str, args: &[&str]) -> Output {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!("{prefix} exec \"$0\" \"$@\""))
        .arg(kiln_exe())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the kiln binary");
    let start = std::time::Instant::now();
    while child.try_wait().expect("try_wait").is_none() {
        if start.elapsed().as_secs() > 60 {
            child.kill().expect("kill");
            panic!("kiln {args:?} hung");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

fn kiln(args: &[&str]) -> Output {
    kiln_in("", args)
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Asserts `out` is a clean error (exit 1, no panic, no abort) whose stderr says every one of
/// `says`; returns stderr.
fn failed(args: &[&str], out: &Output, says: &[&str]) -> String {
    let (stdout, stderr) = text(out);
    assert_eq!(out.status.code(), Some(1), "kiln {args:?}: expected exit 1, got {:?}\nstdout: {stdout}\nstderr: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    for s in says {
        assert!(stderr.contains(s), "kiln {args:?}: expected `{s}` in stderr: {stderr}");
    }
    stderr
}

fn fails_with(args: &[&str], says: &[&str]) -> String {
    failed(args, &kiln(args), says)
}

/// The issue's repro graph: input [1, 3, 2, 2] → 1×1 conv (`conv.weight` [1, 3, 1, 1]) → relu,
/// output `y`; `edit` may change the graph JSON and the weight first.
fn tiny_graph_file(dir: &Path, name: &str, edit: impl FnOnce(&mut serde_json::Value, &mut HostTensor)) -> String {
    let mut g = Graph::default();
    let x = g.push_unchecked(Op::Input { name: "input".into() }, vec![], vec![1, 3, 2, 2], "input".into());
    let w = g.weight("conv.weight", Arc::new(HostTensor::new(vec![1, 3, 1, 1], vec![1.0, 1.0, 1.0])));
    let c = g.push(Op::Conv(ConvAttrs::default()), vec![x, w], "conv".into()).expect("conv");
    let r = g.push(Op::Unary(Unary::Relu), vec![c], "relu".into()).expect("relu");
    g.inputs.push(x);
    g.mark_output("y", r);
    let mut json = serde_json::to_value(&g).expect("json");
    let mut weight = HostTensor::clone(&g.weights["conv.weight"]);
    edit(&mut json, &mut weight);
    let meta = BTreeMap::from([
        (kiln::files::graph::KEY_FORMAT.to_string(), kiln::files::graph::FORMAT.to_string()),
        (kiln::files::graph::KEY_VERSION.to_string(), kiln::files::graph::VERSION.to_string()),
        (kiln::files::graph::KEY_GRAPH.to_string(), json.to_string()),
    ]);
    let path = dir.join(name);
    kiln::files::write_safetensors_with_metadata(&path, &BTreeMap::from([("conv.weight".to_string(), &weight)]), &meta)
        .expect("write graph file");
    path.to_str().expect("utf-8 path").to_string()
}

fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    assert!(Command::new("mkfifo").arg(path).status().expect("mkfifo").success());
}

/// Item 1: `kiln run --cpu` runs the fused graph; a NaN input pixel now reaches the output (the
/// fused ReLU made it 0: `mean 0.000`), as the unfused graph and PyTorch give.
#[test]
fn ch01_nan_input_gives_nan_through_the_fused_relu() {
    let dir = temp_dir("ch01");
    // Negative weights: every finite pixel is below 0 before the ReLU.
    let model = tiny_graph_file(&dir, "nan_fused_relu.kiln.safetensors", |_, w| w.data.fill(-1.0));
    let mut x = HostTensor::new(vec![1, 3, 2, 2], vec![0.5; 12]);
    x.data[0] = f32::NAN;
    let input = dir.join("nan_input.safetensors");
    kiln::files::write_safetensors(&input, &BTreeMap::from([("input".to_string(), x)])).expect("write input");
    let args = ["run", &model, "--cpu", "--input", input.to_str().unwrap()];
    let out = kiln(&args);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("y: [1, 1, 2, 2]") && stdout.contains("mean NaN"), "{stdout}");
}

/// Item 2: a graph file's own NaN weight is warned about as `--weights` ones are, and `--strict`
/// fails (exit 0 and no word before).
#[test]
fn ch02_nan_weights_of_a_graph_file_warn_and_fail_with_strict() {
    let dir = temp_dir("ch02");
    let model = tiny_graph_file(&dir, "nan_weight_tiny.kiln.safetensors", |_, w| w.data[1] = f32::NAN);
    let out = kiln(&["run", &model, "--cpu"]);
    let (_, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning: 1 weight(s) of") && stderr.contains("`conv.weight`: 1 value(s)); outputs will not be finite"),
        "{stderr}"
    );
    fails_with(&["run", &model, "--cpu", "--strict"], &["error: weight `conv.weight` holds 1 non-finite value(s) (NaN or infinity) (in"]);
}

/// A calibration set of `n` digits-sized images [n, 3, 32, 32], with `bad` at one pixel of image 1.
fn calibration_set(dir: &Path, name: &str, bad: f32) -> String {
    let mut x = kiln::dev::uniform_tensor(&[4, 3, 32, 32], 5);
    x.data[3 * 32 * 32 + 17] = bad;
    let path = dir.join(name);
    kiln::files::write_safetensors(&path, &BTreeMap::from([("input".to_string(), x)])).expect("write set");
    path.to_str().expect("utf-8 path").to_string()
}

/// Item 3: `kiln calibrate` on data holding infinity wrote `"amax": null` (which its own loader
/// refused), and on NaN data or with `--mean nan,nan,nan` a plausible cache: each is now an error
/// naming the file or the flag, and nothing is written.
#[test]
fn ch03_calibration_names_non_finite_data_and_flags() {
    let dir = temp_dir("ch03");
    let out_path = dir.join("c.json");
    let out = out_path.to_str().unwrap();
    for (name, bad, method) in [("calib_inf.safetensors", f32::INFINITY, "percentile"), ("calib_nan.safetensors", f32::NAN, "minmax")] {
        let data = calibration_set(&dir, name, bad);
        fails_with(
            &["calibrate", "digits_resnet", "--data", &data, "--method", method, "-o", out],
            &[&format!("error: calibration ({data}): image 1 holds"), "calibration data must be finite"],
        );
        assert!(!out_path.exists(), "no cache is written");
    }
    let folder = dir.join("images");
    std::fs::create_dir_all(&folder).expect("folder");
    let mut img = b"P5\n32 32\n255\n".to_vec();
    img.extend((0..32 * 32).map(|i| (i % 251) as u8));
    std::fs::write(folder.join("a.pgm"), img).expect("image");
    let data = folder.to_str().unwrap();
    fails_with(
        &["calibrate", "digits_resnet", "--data", data, "--mean", "nan,nan,nan", "-o", out],
        &["error: --mean must be three finite values (one per channel), got [NaN, NaN, NaN]"],
    );
    // The same folder with sound flags calibrates, and the cache loads back.
    let ok = kiln(&["calibrate", "digits_resnet", "--data", data, "-o", out]);
    assert!(ok.status.success(), "{}", text(&ok).1);
    kiln::engine::CalibrationCache::load(&out_path).expect("the written cache loads");
}

/// Item 4: FIFOs as a calibration image (`x.pgm` in a `--data` folder), as a model file and as an
/// `--input` are named at once; the first used to block `kiln calibrate` for good.
#[test]
fn ch04_fifos_are_named_without_blocking() {
    let dir = temp_dir("ch04");
    let folder = dir.join("data");
    std::fs::create_dir_all(&folder).expect("folder");
    mkfifo(&folder.join("x.pgm"));
    let out = dir.join("c.json");
    fails_with(
        &["calibrate", "digits_resnet", "--data", folder.to_str().unwrap(), "-o", out.to_str().unwrap()],
        &["error: cannot read image", "x.pgm: is not a regular file (a FIFO, socket or device)"],
    );
    for name in ["model.kiln.safetensors", "model.kiln"] {
        let fifo = dir.join(name);
        mkfifo(&fifo);
        fails_with(&["run", fifo.to_str().unwrap(), "--cpu"], &["is not a regular file (a FIFO, socket or device)"]);
    }
    let fifo = dir.join("x.safetensors");
    mkfifo(&fifo);
    fails_with(&["run", "resnet18", "--cpu", "--input", fifo.to_str().unwrap()], &["is not a regular file (a FIFO, socket or device)"]);
}

/// Item 5: under `ulimit -v 3000000` the CPU executor's memory check refuses batch 1000 with a
/// typed error naming the limit; it checked `MemAvailable` only, and the run aborted (exit 134).
#[test]
fn ch05_the_address_space_limit_is_checked_before_running() {
    let args = ["run", "resnet18", "--cpu", "--batch", "1000"];
    let out = kiln_in("ulimit -v 3000000 &&", &args);
    failed(&args, &out, &["error: out of memory: the CPU executor at --batch 1000", "bytes are available (ulimit -v)"]);
}

/// Item 6: a graph file whose `fc.weight` is declared as 2^31 values (8.6 GB of holes; the graph
/// says [1000, 512]) is refused from its header, and an `--input` of 2.19e9 values (8.7 GB of
/// holes) from its header: both were read and decoded first (8.5 GB and 42 s; 17.1 GB and 24 s).
#[test]
fn ch06_graph_files_and_inputs_are_refused_before_their_data_is_read() {
    let dir = temp_dir("ch06");
    // The issue's make_sparse_repros.py, from a ResNet-18 graph file at 32x32.
    let graph = kiln_models::trace("resnet18", kiln::VarBuilder::seeded(), 1, 32).expect("trace");
    let r18 = dir.join("r18.kiln.safetensors");
    kiln::files::graph::write(&graph, &r18, &BTreeMap::new()).expect("write");
    let bytes = std::fs::read(&r18).expect("read");
    let hl = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..8 + hl]).expect("header");
    let data = &bytes[8 + hl..];
    let fc = header.remove("fc.weight").expect("fc.weight");
    let (fs, fe) = (fc["data_offsets"][0].as_u64().unwrap() as usize, fc["data_offsets"][1].as_u64().unwrap() as usize);
    let mut rest = data[..fs].to_vec();
    rest.extend(&data[fe..]);
    for v in header.values_mut().filter(|v| v.get("data_offsets").is_some()) {
        for k in 0..2 {
            let o = v["data_offsets"][k].as_u64().unwrap() as usize;
            v["data_offsets"][k] = (if o >= fe { o - (fe - fs) } else { o }).into();
        }
    }
    let n: u64 = 1 << 31;
    header.insert(
        "fc.weight".into(),
        serde_json::json!({"dtype": "F32", "shape": [n], "data_offsets": [rest.len(), rest.len() as u64 + 4 * n]}),
    );
    let h = serde_json::Value::Object(header).to_string();
    let path = dir.join("g_fc_2e31.kiln.safetensors");
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend(h.as_bytes());
    file.extend(&rest);
    std::fs::write(&path, &file).expect("write");
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(file.len() as u64 + 4 * n).unwrap();
    let start = std::time::Instant::now();
    fails_with(
        &["run", path.to_str().unwrap(), "--cpu"],
        &["(`fc.weight`): weight `fc.weight` has shape [2147483648], the node says [1000, 512]"],
    );
    assert!(start.elapsed().as_secs() < 20, "{:?}", start.elapsed());

    let m: u64 = 3 * 27000 * 27000;
    let h = format!(r#"{{"input":{{"dtype":"F32","shape":[1,3,27000,27000],"data_offsets":[0,{}]}}}}"#, 4 * m);
    let x = dir.join("x_big.safetensors");
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend(h.as_bytes());
    std::fs::write(&x, &file).expect("write");
    std::fs::OpenOptions::new().write(true).open(&x).unwrap().set_len(file.len() as u64 + 4 * m).unwrap();
    let start = std::time::Instant::now();
    fails_with(
        &["run", "resnet18", "--cpu", "--input", x.to_str().unwrap()],
        &[
            "error: input tensor `input` of shape [1, 3, 27000, 27000] in",
            "is too large: 2187000000 elements, more than the limit of 2147483648",
        ],
    );
    assert!(start.elapsed().as_secs() < 20, "{:?}", start.elapsed());
}

/// Item 8: a weight's 8-bit grid with scale 0 and an empty int8 range ran; an engine file's
/// batch-0 input was accepted by `kiln inspect`.
#[test]
fn ch08_weight_grids_and_batch_0_engine_inputs_are_refused_at_load() {
    let dir = temp_dir("ch08");
    let model = tiny_graph_file(&dir, "weight_quant_unchecked.kiln.safetensors", |json, _| {
        json["nodes"][1]["op"]["Weight"]["quant"] =
            serde_json::json!({"format": "Int8", "scale": [0.0], "zero_point": [], "axis": null, "qmin": 127, "qmax": -128});
    });
    fails_with(&["run", &model, "--cpu"], &["weight `conv.weight`: its 8-bit grid: scales must be positive and finite, got 0"]);

    let graph = kiln::files::graph::read(tiny_graph_file(&dir, "g.kiln.safetensors", |json, _| {
        for node in [0, 2, 3] {
            json["nodes"][node]["shape"][0] = 0.into();
        }
    }));
    assert!(graph.is_err(), "graph files refuse a batch-0 input");
    let mut g = kiln::files::graph::read(tiny_graph_file(&dir, "ok.kiln.safetensors", |_, _| {})).expect("graph").graph;
    for node in [0, 2, 3] {
        g.nodes[node].shape[0] = 0;
    }
    let header =
        kiln::files::engine::Header { version: kiln::files::engine::FORMAT_VERSION, sm: 90, driver_version: 13000, cudnn_version: 91400 };
    let payload = kiln::files::engine::Payload { config: kiln::engine::BuildConfig::default(), graph: g, tactics: BTreeMap::new() };
    let engine = dir.join("efuzz_small_input_batch0.kiln");
    std::fs::write(&engine, kiln::files::engine::encode(&header, &payload).expect("encode")).expect("write");
    fails_with(&["inspect", engine.to_str().unwrap()], &["input `input` has shape [0, 3, 2, 2]; inputs need a batch dim and no zero dims"]);
}
