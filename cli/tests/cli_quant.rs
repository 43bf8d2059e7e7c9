//! `kiln run --cpu` and `kiln compare --cpu` with `--int8`/`--fp8` (issue 38, item 3): with a
//! calibration cache they run the CPU simulation of that engine and say so; a precision with no
//! CPU simulation, or an 8-bit one with no scales, stops with an error instead of running f32.

mod common;

use common::*;

use kiln::HostTensor;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A calibration set of 4 smooth 32×32 images, `dir/calib.safetensors`.
fn calibration_set(dir: &Path) -> PathBuf {
    let data = dir.join("calib.safetensors");
    let n = 4 * 3 * 32 * 32;
    let x = HostTensor::new(vec![4, 3, 32, 32], (0..n).map(|i| ((i as f32) * 0.37).sin() * 1.5).collect());
    kiln::files::write_safetensors(&data, &BTreeMap::from([("input".to_string(), x)])).expect("calibration set");
    data
}

/// A calibration cache of resnet18 at 32×32 (seeded weights) over [`calibration_set`].
fn calibration_cache(dir: &Path) -> PathBuf {
    let data = calibration_set(dir);
    let cache = dir.join("resnet18.calib.json");
    let out = kiln(&["calibrate", "resnet18", "--size", "32", "--data", arg(&data), "-o", arg(&cache)]);
    assert!(out.status.success(), "{}", text(&out).1);
    cache
}

/// The printed outputs of a run (every line after the header, the backend's timing line left out).
fn answers(stdout: &str) -> String {
    stdout.lines().skip(1).filter(|l| !l.contains(" for batch ")).collect::<Vec<_>>().join("\n")
}

#[test]
fn run_cpu_simulates_int8_and_fp8_engines() {
    let dir = temp_dir("run");
    let cache = calibration_cache(&dir);
    let base = ["run", "resnet18", "--cpu", "--size", "32", "--seed", "7", "--top", "3"];
    let f32_run = kiln(&base);
    let (f32_out, stderr) = text(&f32_run);
    assert!(f32_run.status.success(), "{stderr}");
    assert!(f32_out.contains("CPU executor (f32)"), "{f32_out}");
    for (flag, name) in [("--int8", "INT8"), ("--fp8", "FP8")] {
        let out = kiln(&[&base[..], &[flag, "--calibration-cache", arg(&cache)]].concat());
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        let header = stdout.lines().next().unwrap_or_default();
        assert!(header.contains(&format!("on the CPU simulation of the {name} engine (calibration cache")), "{stdout}");
        assert!(stdout.contains(&format!("CPU simulation of the {name} engine")), "{stdout}");
        // Quantised numbers, not FP32's.
        assert_ne!(answers(&stdout), answers(&f32_out), "{flag} printed FP32's outputs:\n{stdout}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--layer-precisions` in the simulation of an 8-bit engine: the covered layers are not
/// quantised, so the answers differ from the fully quantised simulation's (and from FP32's), and
/// the header names the rules.
#[test]
fn run_cpu_simulates_the_layers_a_rule_keeps_out_of_8_bits() {
    let dir = temp_dir("rules");
    let cache = calibration_cache(&dir);
    let base = ["run", "resnet18", "--cpu", "--size", "32", "--seed", "7", "--top", "3", "--fp8", "--calibration-cache", arg(&cache)];
    let all = kiln(&base);
    let (all_out, stderr) = text(&all);
    assert!(all.status.success(), "{stderr}");
    let kept = kiln(&[&base[..], &["--layer-precisions", "layer4:fp16,conv1:fp32"]].concat());
    let (kept_out, stderr) = text(&kept);
    assert!(kept.status.success(), "{stderr}");
    let header = kept_out.lines().next().unwrap_or_default();
    assert!(header.contains("not quantised: --layer-precisions layer4:fp16,conv1:fp32"), "{kept_out}");
    assert_ne!(answers(&kept_out), answers(&all_out), "the rules changed nothing:\n{kept_out}");
    let f32_run = kiln(&base[..9]);
    assert_ne!(answers(&kept_out), answers(&text(&f32_run).0), "with rules the simulation is still quantised");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kiln calibrate --sensitivity`: after the cache, the table of scopes kept in FP16 and the rule
/// to build with; a format it does not know is a usage error.
#[test]
fn calibrate_measures_the_sensitivity_of_the_8_bit_engine() {
    let dir = temp_dir("sensitivity");
    let data = calibration_set(&dir);
    let cache = dir.join("c.json");
    let base = ["calibrate", "resnet18", "--size", "32", "--data", arg(&data), "-o", arg(&cache)];
    let out = kiln(&[&base[..], &["--sensitivity", "int8", "--sensitivity-images", "2"]].concat());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(cache.exists(), "the cache is written first");
    assert!(stdout.contains("INT8 simulation against FP32 on 2 image(s): rel L2"), "{stdout}");
    assert!(stdout.contains("layer4") && stdout.contains("rel L2  layers  scope"), "{stdout}");
    assert!(stdout.contains("build with --layer-precisions "), "{stdout}");
    let bad = kiln(&[&base[..], &["--sensitivity", "int4"]].concat());
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad).1);
    assert!(text(&bad).1.contains("--sensitivity"), "{}", text(&bad).1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn compare_cpu_simulates_the_8_bit_engine_it_names() {
    let dir = temp_dir("compare");
    let cache = calibration_cache(&dir);
    let saved = dir.join("fp32.safetensors");
    let out = kiln(&["compare", "resnet18", "--cpu", "--size", "32", "--seed", "3", "--save-outputs", arg(&saved)]);
    assert!(out.status.success(), "{}", text(&out).1);
    // Against FP32's outputs the FP8 simulation differs (by quantisation), within the 8-bit
    // default tolerance; the header names what ran.
    let out = kiln(&["compare", "resnet18", "--cpu", "--fp8", "--calibration-cache", arg(&cache), "--load-outputs", arg(&saved)]);
    let (stdout, stderr) = text(&out);
    assert!(stdout.contains("on CPU simulation of the FP8 engine (calibration cache"), "{stdout}\n{stderr}");
    assert!(stdout.contains("l2-tol 1.0e-1"), "8-bit tolerance: {stdout}");
    let exact = kiln(&[
        "compare",
        "resnet18",
        "--cpu",
        "--int8",
        "--calibration-cache",
        arg(&cache),
        "--load-outputs",
        arg(&saved),
        "--l2-tol",
        "0",
    ]);
    let (stdout, _) = text(&exact);
    assert!(stdout.contains("FAIL"), "the INT8 simulation is not FP32: {stdout}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cpu_runs_stop_where_nothing_simulates_the_precision() {
    let dir = temp_dir("refuse");
    let cache = calibration_cache(&dir);
    let base = ["run", "resnet18", "--cpu", "--size", "32", "--seed", "1"];
    for flag in ["--int8", "--fp8"] {
        fails_with(&[&base[..], &[flag]].concat(), &["--calibration-cache", "CPU simulation", "quantize/dequantize nodes"]);
    }
    for flag in ["--fp16", "--tf32"] {
        fails_with(&[&base[..], &[flag]].concat(), &[flag, "has no CPU simulation", "drop --cpu"]);
    }
    fails_with(&[&base[..], &["--best", "--calibration-cache", arg(&cache)]].concat(), &["--best", "has no CPU simulation"]);
    fails_with(&["compare", "resnet18", "--cpu", "--size", "32", "--fp16"], &["--fp16", "has no CPU simulation"]);
    fails_with(&["compare", "resnet18", "--cpu", "--size", "32", "--int8"], &["--calibration-cache", "CPU simulation"]);
    // A cache of another graph is named, not ignored.
    fails_with(
        &["run", "resnet18", "--cpu", "--size", "64", "--seed", "1", "--int8", "--calibration-cache", arg(&cache)],
        &["resnet18.calib.json", "recalibrate"],
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kiln calibrate` writes each 8-bit layer's input means (bias correction) and says so;
/// `--no-bias-correction` writes none. The FP8 simulation of the two caches differs (its biases
/// corrected or not), the INT8 one does not (INT8 never corrects).
#[test]
fn calibrate_records_input_means_unless_told_not_to() {
    let dir = temp_dir("bias");
    let data = calibration_set(&dir);
    let (with, without) = (dir.join("with.json"), dir.join("without.json"));
    let base = ["calibrate", "resnet18", "--size", "32", "--data", arg(&data)];
    let out = kiln(&[&base[..], &["-o", arg(&with)]].concat());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("input means of 21 layer(s) for bias correction"), "{stdout}");
    let out = kiln(&[&base[..], &["-o", arg(&without), "--no-bias-correction"]].concat());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("no bias correction"), "{stdout}");
    let means = |p: &Path| kiln::engine::CalibrationCache::load(p).expect("cache").input_means.len();
    assert_eq!((means(&with), means(&without)), (21, 0));
    let run = |flag: &str, cache: &Path| {
        let out = kiln(&["run", "resnet18", "--cpu", "--size", "32", "--seed", "7", "--top", "3", flag, "--calibration-cache", arg(cache)]);
        assert!(out.status.success(), "{}", text(&out).1);
        answers(&text(&out).0)
    };
    assert_ne!(run("--fp8", &with), run("--fp8", &without), "FP8 corrects its biases");
    assert_eq!(run("--int8", &with), run("--int8", &without), "INT8 does not");
    let _ = std::fs::remove_dir_all(&dir);
}
