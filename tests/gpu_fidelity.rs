//! FP16 fidelity against PyTorch's own FP16 (issue 28, item 5): for every bundled classifier,
//! Kiln's FP16 engine (every layer in FP16, no per-layer rules) must be no further from FP32
//! PyTorch than 1.2x PyTorch's own FP16 run of the same module on the same input (rel L2 of the
//! logits), or within 2e-3 where PyTorch's FP16 is closer than that.
//!
//! References: `$KILN_REFERENCE_DIR/fidelity/<model>.reference.safetensors` (`input`,
//! `output.logits` in FP32, `fp16.logits` from PyTorch's `.half()` run) and the weights beside it,
//! written on the device by `tools/export_fp16_reference.py` (tools/speed-check.sh runs it).
//! `KILN_FIDELITY_MODELS` (comma-separated) picks models. Without `KILN_REFERENCE_DIR` the test
//! says so and checks nothing.
//!
//! On the device: `.carry/bin/gpu_fidelity --include-ignored --nocapture --test-threads 1`.

use kiln::engine::{BuildConfig, EngineBuilder, Precision};
use kiln::files::read_safetensors;
use kiln::VarBuilder;
use std::path::PathBuf;
use std::sync::Arc;

mod common;
use common::{gpu, rel_l2};

/// Kiln's FP16 may lose at most this much more than PyTorch's FP16 ...
const RATIO: f64 = 1.2;
/// ... or this much in all, where PyTorch's own FP16 is closer.
const FLOOR: f64 = 2e-3;

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/speed-check.sh)"]
fn fp16_is_no_worse_than_pytorch_fp16() {
    let Some(gpu) = gpu() else { return };
    let Some(dir) = std::env::var_os("KILN_REFERENCE_DIR").map(|d| PathBuf::from(d).join("fidelity")) else {
        println!("KILN_REFERENCE_DIR is unset: no fidelity references to check (tools/export_fp16_reference.py writes them)");
        return;
    };
    let pick = std::env::var("KILN_FIDELITY_MODELS").ok();
    let models: Vec<&str> = kiln_models::BUNDLED
        .iter()
        .filter(|m| m.family() == "classifier")
        .map(|m| m.name)
        .filter(|m| pick.as_deref().is_none_or(|p| p.split(',').any(|x| x == *m)))
        .collect();
    let cache = std::env::temp_dir().join(format!("kiln-gpu-fidelity-{}.timing.json", std::process::id()));
    let (mut checked, mut failed, mut missing) = (0, Vec::new(), Vec::new());
    println!("{:<22} {:>12} {:>12} {:>8} {:>10}", "model", "Kiln FP16", "torch FP16", "ratio", "bound");
    for model in models {
        let Ok(refs) = read_safetensors(dir.join(format!("{model}.reference.safetensors"))) else {
            missing.push(model);
            continue;
        };
        let vb = VarBuilder::from_safetensors(&[&dir.join(format!("{model}.weights.safetensors"))]).expect("weights file");
        let x = &refs["input"];
        let (want, torch16) = (&refs["output.logits"], &refs["fp16.logits"]);
        let graph = kiln_models::trace_hw(model, vb, x.shape[0], [x.shape[2], x.shape[3]]).expect("trace");
        let config = BuildConfig::default().precision(Precision::Fp16).batch(1, 1, 1).timing_cache(cache.clone());
        let built = std::panic::catch_unwind(|| EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph));
        let engine = match built {
            Ok(Ok(e)) => Arc::new(e),
            Ok(Err(e)) => {
                println!("{model}: build failed: {e}");
                failed.push(model);
                continue;
            }
            Err(_) => {
                failed.push(model);
                continue;
            }
        };
        let got = engine.context().and_then(|mut c| c.run(&[("input", x)]));
        let got = match got {
            Ok(g) => g,
            Err(e) => {
                println!("{model}: run failed: {e}");
                failed.push(model);
                continue;
            }
        };
        let (kiln, _) = rel_l2(&got["logits"].data, &want.data);
        let (torch, _) = rel_l2(&torch16.data, &want.data);
        let bound = (RATIO * torch).max(FLOOR);
        let verdict = if kiln <= bound { "" } else { "  OVER" };
        println!("{model:<22} {kiln:>12.3e} {torch:>12.3e} {:>8.2} {bound:>10.3e}{verdict}", kiln / torch.max(1e-30));
        println!("FIDELITY {model} kiln_fp16 {kiln:.4e} torch_fp16 {torch:.4e}");
        checked += 1;
        if kiln > bound {
            failed.push(model);
        }
    }
    assert!(missing.is_empty(), "no fidelity reference in {} for {missing:?}", dir.display());
    assert!(checked > 0, "no model was checked");
    assert!(failed.is_empty(), "Kiln FP16 loses more than {RATIO}x PyTorch's FP16 (or {FLOOR:e}) on {failed:?}");
}
