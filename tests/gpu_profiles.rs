//! Optimization profiles on the GPU: one engine, built once, runs CenterNet at 384×512, 512×512
//! and 640×480 and a ResNet-18 at non-square sizes, each shape its own plan (layers, arena, CUDA
//! graph) over shared weights, each matching PyTorch (references exported on the device at that
//! size under `KILN_REFERENCE_DIR/shapes/HxW/`) or, where none was exported, the CPU executor.
//!
//! Run on the device: `bash tools/gpu-test.sh` (it exports the CenterNet references per size).

mod common;

use common::{gpu, matching_detections, random, rel_l2};
use kiln::engine::{BuildConfig, DimsRange, Engine, EngineBuilder, InputDims, Precision, ShapeProfile};
use kiln::files::read_safetensors;
use kiln::VarBuilder;
use kiln::{Graph, HostTensor};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

fn profile(min: [usize; 3], opt: [usize; 3], max: [usize; 3]) -> ShapeProfile {
    ShapeProfile::from([("input".to_string(), DimsRange::new(&min, &opt, &max))])
}

fn build(graph: &Graph, config: BuildConfig) -> Arc<Engine> {
    let gpu = gpu().expect("GPU");
    Arc::new(EngineBuilder::new(config).with_gpu(gpu).build(graph).unwrap_or_else(|e| panic!("build: {e}")))
}

/// PyTorch's outputs for CenterNet (seeded weights) at `h`×`w`, with the input they were made from.
fn pytorch(h: usize, w: usize) -> Option<(HostTensor, BTreeMap<String, HostTensor>)> {
    let dir = PathBuf::from(std::env::var_os("KILN_REFERENCE_DIR")?).join(format!("shapes/{h}x{w}"));
    let refs = read_safetensors(dir.join("centernet.reference.safetensors")).ok()?;
    let input = refs.get("input")?.clone();
    let outputs = refs.iter().filter_map(|(k, v)| k.strip_prefix("output.").map(|n| (n.to_string(), v.clone()))).collect();
    Some((input, outputs))
}

/// Compares every output; detections by matching rows, the rest by rel L2 within `tol`.
fn check(label: &str, got: &BTreeMap<String, HostTensor>, want: &BTreeMap<String, HostTensor>, tol: f64) {
    for (name, w) in want {
        let g = &got[name];
        assert_eq!(g.shape, w.shape, "{label} {name}: shapes");
        if name == "detections" {
            let found = (0..w.shape[0]).map(|i| matching_detections(g, w, i)).min().unwrap_or(0);
            println!("  {label} detections: {found} of {} identical in class and position", w.shape[1]);
            assert!(found >= 98, "{label}: only {found} detections match");
            continue;
        }
        let (rel, max_abs) = rel_l2(&g.data, &w.data);
        println!("  {label} {name} {:?}: rel L2 {rel:.2e}, max abs {max_abs:.2e}", w.shape);
        assert!(rel <= tol, "{label} {name}: rel L2 {rel:.3e} > {tol:e}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn centernet_runs_three_shapes_from_one_build() {
    if gpu().is_none() {
        return;
    }
    let graph = kiln_models::trace_hw("centernet", VarBuilder::seeded(), 1, [512, 512]).expect("trace");
    let shapes = [(384, 512), (640, 480), (512, 512), (384, 512)];
    for (precision, tol) in [(Precision::Fp32, 1e-4), (Precision::Fp16, 1e-2)] {
        let config =
            BuildConfig::default().precision(precision).batch(1, 2, 2).profile(profile([3, 384, 480], [3, 512, 512], [3, 640, 512]));
        let engine = build(&graph, config);
        let built = engine.plans().len();
        let weights = engine.summary.memory.weights;
        println!("centernet {precision:?}: {} plans at build, {}", built, engine.summary);
        let mut ctx = engine.context().expect("context");
        for (h, w) in shapes {
            let label = format!("centernet {precision:?} {h}x{w}");
            let (input, want, source) = match pytorch(h, w) {
                Some((x, refs)) => (x, refs, "PyTorch"),
                None => {
                    let x = random(&[1, 3, h, w], (h * w) as u64, 1.0);
                    let at = graph.with_input_dims(&InputDims::from([("input".into(), vec![3, h, w])])).expect("re-inferred");
                    let want = kiln::run_cpu(&at, &[("input", &x)]).expect("cpu");
                    (x, want, "the CPU executor")
                }
            };
            let first = ctx.run(&[("input", &input)]).unwrap_or_else(|e| panic!("{label}: {e}"));
            // The second run replays the shape's CUDA graph.
            let again = ctx.run(&[("input", &input)]).unwrap_or_else(|e| panic!("{label}: {e}"));
            println!("{label} against {source} (plan arena {:.1} MiB):", ctx.plan().memory.arena as f64 / (1 << 20) as f64);
            check(&label, &first, &want, tol);
            assert_eq!(first, again, "{label}: a CUDA-graph replay differs from the first run");
        }
        let plans = engine.plans();
        println!(
            "centernet {precision:?}: {} plans after the runs: {:?}",
            plans.len(),
            plans.iter().map(|p| p.dims["input"].clone()).collect::<Vec<_>>()
        );
        assert_eq!(plans.len(), built + 2, "384x512 and 640x480 lie inside the profile and were lowered on first use");
        assert_eq!(engine.summary.memory.weights, weights);
        let e = ctx.run(&[("input", &random(&[1, 3, 256, 256], 1, 1.0))]).unwrap_err().to_string();
        println!("outside the profile: {e}");
        assert!(e.contains("outside every profile"), "{e}");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn resnet18_runs_non_square_shapes_and_saved_engines_keep_their_profiles() {
    if gpu().is_none() {
        return;
    }
    let graph = kiln_models::trace_hw("resnet18", VarBuilder::seeded(), 1, [224, 224]).expect("trace");
    let path = std::env::temp_dir().join(format!("kiln-profiles-{}.kiln", std::process::id()));
    for (precision, tol) in [(Precision::Fp32, 1e-4), (Precision::Fp16, 1e-2)] {
        let config =
            BuildConfig::default().precision(precision).batch(1, 4, 4).profile(profile([3, 160, 160], [3, 224, 224], [3, 320, 288]));
        let engine = build(&graph, config);
        let mut ctx = engine.context().expect("context");
        engine.save(&path).expect("save");
        let loaded = Arc::new(Engine::load(&path, &engine.gpu().clone()).expect("load"));
        let mut loaded_ctx = loaded.context().expect("context");
        for (batch, h, w) in [(3, 200, 288), (1, 320, 160), (4, 224, 224), (2, 161, 257)] {
            let label = format!("resnet18 {precision:?} batch {batch} {h}x{w}");
            let x = random(&[batch, 3, h, w], (batch * h * w) as u64, 1.0);
            let at = graph.with_input_dims(&InputDims::from([("input".into(), vec![3, h, w])])).expect("re-inferred");
            let want = kiln::run_cpu(&at, &[("input", &x)]).expect("cpu");
            let got = ctx.run(&[("input", &x)]).unwrap_or_else(|e| panic!("{label}: {e}"));
            check(&label, &got, &want, tol);
            // Seeded random weights give near ties: an image whose reference top-2 gap is inside
            // twice the engine's max abs error may swap them, which no tolerance rules out.
            let (g, w) = (&got["logits"], &want["logits"]);
            let max_abs = g.data.iter().zip(&w.data).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            let tops = kiln::top1(g).into_iter().zip(kiln::top1(w));
            for (i, ((gt, wt), wr)) in tops.zip(w.data.chunks(w.shape[1])).enumerate() {
                let mut sorted = wr.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                let gap = sorted[0] - sorted[1];
                if gt != wt && gap <= 2.0 * max_abs {
                    println!("  {label} image {i}: top-1 {gt} against {wt}, a near tie (gap {gap:.2e}, max abs error {max_abs:.2e})");
                    continue;
                }
                assert_eq!(gt, wt, "{label} image {i}: top-1 (reference gap {gap:.2e}, max abs error {max_abs:.2e})");
            }
            let from_file = loaded_ctx.run(&[("input", &x)]).unwrap_or_else(|e| panic!("{label} (loaded): {e}"));
            let (rel, _) = rel_l2(&from_file["logits"].data, &got["logits"].data);
            println!("  {label}: the loaded engine differs from the built one by rel L2 {rel:.2e}");
            assert!(rel <= 1e-6, "{label}: loaded engine differs by {rel:e}");
        }
        print!(
            "{}",
            engine
                .describe()
                .lines()
                .filter(|l| l.starts_with("profile") || l.starts_with("plan"))
                .map(|l| format!("{l}\n"))
                .collect::<String>()
        );
    }
    let _ = std::fs::remove_file(&path);
}
