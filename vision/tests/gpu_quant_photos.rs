//! INT8 and FP8 engines of torchvision's trained MobileNetV2 on the scikit-image photos, against
//! FP32 and against their own CPU simulation (issue 38's targets on the device). The same photos,
//! views and folds as `quant_photos.rs`: each fold is calibrated with the default method on its
//! own photos' views and judged on the other fold's centre crops, so every photo is judged once,
//! by a cache that never saw it.
//!
//! Needs a GPU and `$KILN_REAL_DATA` (`tools/fetch_real_data.py`); `#[ignore]`d, run by
//! `tools/gpu-test.sh` with `--include-ignored`.

mod photos;

use kiln::dev::quant::simulate_with_rules;
use kiln::engine::{gpu_available, BuildConfig, EngineBuilder, Gpu, Precision, QuantFormat};
use kiln_vision::top_k;
use photos::*;
use std::sync::Arc;
use std::time::Instant;

fn gpu() -> Option<Arc<Gpu>> {
    match gpu_available().and_then(|()| Gpu::new(0).map_err(|e| e.to_string())) {
        Ok(g) => Some(g),
        Err(why) => {
            println!("skipped: no GPU ({why})");
            None
        }
    }
}

#[test]
#[ignore = "needs a GPU and the real photos: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn int8_fp8_engines_keep_fp32_answers_and_match_their_simulation() {
    let Some(gpu) = gpu() else { return };
    let Some(dir) = real_data() else { return };
    let data = load(&dir);
    let fp32 = fp32_logits(&data);
    let stats = fold_stats(&data);
    let method = method_from_env();
    let rules = rules_from_env();
    println!("calibration: {method:?}; layers kept out of 8 bits: {rules:?}");
    let tmp = std::env::temp_dir().join(format!("kiln-gpu-quant-photos-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("temp dir");
    let mut failures = vec![];
    for (precision, format) in [(Precision::Int8, QuantFormat::Int8), (Precision::Fp8, QuantFormat::Fp8E4m3)] {
        if precision == Precision::Fp8 && gpu.info.sm < 89 {
            println!("FP8 skipped: sm_{} has no FP8", gpu.info.sm);
            continue;
        }
        let (mut engine_vs_fp32, mut sim_vs_fp32) = (Agreement::default(), Agreement::default());
        let (mut same_top1, mut judged, mut worst_vs_sim) = (0, 0, 0f64);
        for (f, stats) in stats.iter().enumerate() {
            let cache = stats.cache(method);
            let path = tmp.join(format!("{}-fold{f}.json", format.name()));
            cache.save(&path).expect("save cache");
            let x = batch(&data, fold(1 - f), 1);
            let n = x.shape[0];
            let mut config =
                BuildConfig::default().precision(precision).batch(1, n, n).calibration_cache(&path).layer_precisions(rules.iter().cloned());
            // `KILN_TACTIC_SOURCES=kernel:conv8` (the CLI's --tactic-sources) keeps the 8-bit
            // convs on Kiln's own kernels, whose epilogue the simulation mirrors, away from
            // cuDNN's fused graphs.
            if let Ok(sources) = std::env::var("KILN_TACTIC_SOURCES") {
                config = config.tactic_sources(&sources.split(',').collect::<Vec<_>>());
            }
            let t0 = Instant::now();
            let engine = match EngineBuilder::new(config).with_gpu(gpu.clone()).build(&data.graph) {
                Ok(e) => Arc::new(e),
                Err(e) => {
                    failures.push(format!("{} fold {f}: build: {e}", format.name()));
                    continue;
                }
            };
            let summary = engine.summary.to_string();
            let time = summary.lines().find(|l| l.starts_with("build time")).unwrap_or("");
            println!("{} fold {f}: built in {:.1} s; {time}", format.name(), t0.elapsed().as_secs_f64());
            let got = engine.context().expect("context").run(&[("input", &x)]).expect("engine run")["logits"].clone();
            let sim = logits(&simulate_with_rules(&data.graph, &cache, format, &rules).expect("simulation"), &x);
            engine_vs_fp32.add(&got, &fp32[1 - f].0);
            sim_vs_fp32.add(&sim, &fp32[1 - f].0);
            for (i, ((g, s), e)) in got.data.chunks(1000).zip(sim.data.chunks(1000)).zip(rel_l2_per_image(&got, &sim)).enumerate() {
                let (gk, sk) = (top_k(g, 1)[0].class, top_k(s, 1)[0].class);
                let photo = PHOTOS[fold(1 - f).nth(i).expect("photo")];
                println!("  {} {photo:24} engine class {gk:4}, simulation {sk:4}, rel L2 engine vs simulation {e:.2e}", format.name());
                same_top1 += usize::from(gk == sk);
                judged += 1;
                worst_vs_sim = worst_vs_sim.max(e);
            }
        }
        println!(
            "{} ({method:?}) against FP32, top-1 | top-5 | mean rel L2 | worst: engine {}; simulation {}; engine top-1 = simulation's on {same_top1}/{judged}, worst rel L2 engine vs simulation {worst_vs_sim:.2e}",
            format.name(),
            engine_vs_fp32.text(),
            sim_vs_fp32.text()
        );
        if engine_vs_fp32.top1 < 11 || engine_vs_fp32.top5 < 54 {
            failures.push(format!("{} engine keeps FP32's answers on {}", format.name(), engine_vs_fp32.text()));
        }
        if same_top1 != judged || judged != PHOTOS.len() {
            failures.push(format!("{} engine's top-1 equals the simulation's on {same_top1} of {judged} photos", format.name()));
        }
        // The simulation predicts the engine's error: both against FP32, their mean rel L2 within
        // 1e-2 of each other. Logit by logit they differ more (`worst_vs_sim`, printed): the engine
        // and the simulation sum in other orders, so values near an 8-bit rounding step land on
        // either side, and over 50 requantising layers those flips are as large as the
        // quantisation noise itself (docs/QUANT.md, "What the simulation predicts").
        let mean = |a: &Agreement| a.sum_rel_l2 / a.images.max(1) as f64;
        let gap = (mean(&engine_vs_fp32) - mean(&sim_vs_fp32)).abs();
        if gap > 1e-2 {
            failures.push(format!(
                "{}: mean rel L2 against FP32 {:.3} (engine) and {:.3} (simulation)",
                format.name(),
                mean(&engine_vs_fp32),
                mean(&sim_vs_fp32)
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    assert!(failures.is_empty(), "{failures:#?}");
}
