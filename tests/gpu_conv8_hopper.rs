//! The 8-bit conv on Hopper's wgmma (`kernels/conv8_hopper.cu`) forced in INT8 engines, every
//! tile variant alone and all of them left to timing, against the CPU fake-quant simulation and
//! the mma.sync kernel, whose exact s32 sums and epilogue it shares, so the two must agree to the
//! last code, at batch 1, 7 and 48. FP8 engines must not use it (its e4m3 sums drift from f32
//! ones: `hopper.rs`'s `FP8_REFUSAL`). The convs cover both of its modes and its ragged edges:
//! - GEMM mode (1×1 stride 1): 32 → 48 channels (a partial channel tile; a reduction of 32 codes,
//!   less than one stage), requantising into two readers; 16 → 16 (16 codes); 32 → 32 adding an
//!   8-bit residual, writing f16;
//! - patch mode: 3×3 stride 1 (48 → 80: C and K partial tiles, 9 stages through a ring of at most
//!   8), 3×3 stride 2 on a 9 × 11 image (80 → 32: output 5 × 6, patches overhanging both edges),
//!   1×1 stride 2, 3×3 dilation 2 with padding 2, and 3×3 over 512 channels (a reduction of 4608
//!   products, as deep as ResNet's layer4);
//! - codes out through TMA's code tiles: with no residual (most of the above), and adding an
//!   8-bit residual into an 8-bit reader, 1×1 (GEMM mode) and 3×3 (patch mode), over 160 channels
//!   (a partial 64-channel box, and 3, 2 or 1 channel tiles);
//! - batch 1: 99 output pixels, one partial 128-row tile; batch 48: many tiles;
//! - wide, short images (`edges`): 64 × 2 patches whose edge taps' boxes lie wholly outside the
//!   image, and 128 × 1 patches of stride-2 boxes 256 pixels wide (TMA's limit).
//!
//! Every result is compared with rel L2 (printed with max-abs): the simulation within 1e-2 (as
//! conv8's own test), the mma.sync kernel within 1e-3. Skips without a GPU, or on one that is not
//! sm_90.
//!
//! On the device: `gpu_conv8_hopper --include-ignored --nocapture --test-threads 1`
//! (docs/KERNELS.md, "8-bit convolution on wgmma", has the compute-sanitizer commands).

use kiln::dev::quant::simulate;
use kiln::engine::{BuildConfig, Engine, EngineBuilder, Gpu, Precision};
use kiln::nn::{Conv2d, Conv2dConfig};
use kiln::plugin::QuantFormat;
use kiln::{Forward, Graph, HostTensor, Module, VarBuilder};
use std::collections::HashMap;
use std::sync::Arc;

mod common;
use common::{gpu, min_max_cache, rel_l2};

/// The batches every engine runs (built for 1 up to the last, timed at the last): 1, 7 and 48, or
/// `$CONV8_HOPPER_BATCHES` (e.g. `1` under compute-sanitizer, whose racecheck takes minutes a
/// launch of a large grid).
fn batches() -> Vec<usize> {
    std::env::var("CONV8_HOPPER_BATCHES").ok().map_or(vec![1, 7, 48], |b| {
        b.split(',').map(|n| n.trim().parse().expect("CONV8_HOPPER_BATCHES: batch sizes, comma-separated")).collect()
    })
}

fn hopper_gpu() -> Option<Arc<Gpu>> {
    let gpu = gpu()?;
    if gpu.info.sm != 90 {
        println!("skipped: the wgmma 8-bit conv needs an sm_90 GPU, this is sm_{}", gpu.info.sm);
        return None;
    }
    Some(gpu)
}

/// A graph of 8-bit convs, all of which the wgmma kernel takes, over one input of `input`'s
/// per-image shape.
struct Case {
    name: &'static str,
    input: [usize; 3],
    graph: Graph,
    convs: &'static [&'static str],
    outputs: &'static [&'static str],
}

fn trace(name: &'static str, input: [usize; 3], body: impl FnOnce(&kiln::Tensor, &dyn Fn(&str, Conv2dConfig) -> Conv2d)) -> Graph {
    let tracer = kiln::Tracer::new();
    let x = tracer.input("input", &[1, input[0], input[1], input[2]]);
    let vb = VarBuilder::seeded().pp(name);
    body(&x, &|conv: &str, c: Conv2dConfig| Conv2d::load(vb.pp(conv), &c).expect(conv));
    tracer.graph()
}

/// The convs of the module comment.
fn shapes() -> Case {
    let graph = trace("shapes", [32, 9, 11], |x, conv| {
        let a1 = conv("a1", Conv2dConfig::new(32, 48, 1)).forward(x).and_then(|h| h.relu()).expect("a1");
        let a2 = conv("a2", Conv2dConfig::new(48, 80, 3).padding(1)).forward(&a1).and_then(|h| h.relu()).expect("a2");
        let a3 = conv("a3", Conv2dConfig::new(80, 32, 3).stride(2).padding(1)).forward(&a2).and_then(|h| h.relu()).expect("a3");
        let a4 = conv("a4", Conv2dConfig::new(32, 32, 1)).forward(&a3).and_then(|y| y.add(&a3)).and_then(|y| y.relu()).expect("a4");
        a4.mark_output("y1");
        let a5 = conv("a5", Conv2dConfig::new(32, 16, 3).padding(1)).forward(&a3).and_then(|h| h.relu()).expect("a5");
        conv("a6", Conv2dConfig::new(16, 16, 1)).forward(&a5).expect("a6").mark_output("y2");
        conv("a7", Conv2dConfig::new(48, 16, 1).stride(2)).forward(&a1).expect("a7").mark_output("y3");
        conv("a8", Conv2dConfig::new(48, 32, 3).padding(2).dilation(2)).forward(&a1).expect("a8").mark_output("y4");
        let a9 = conv("a9", Conv2dConfig::new(32, 512, 1)).forward(&a3).and_then(|h| h.relu()).expect("a9");
        conv("a10", Conv2dConfig::new(512, 64, 3).padding(1)).forward(&a9).expect("a10").mark_output("y5");
        let a11 = conv("a11", Conv2dConfig::new(32, 160, 3).padding(1)).forward(&a3).and_then(|h| h.relu()).expect("a11");
        let a12 = conv("a12", Conv2dConfig::new(160, 160, 1)).forward(&a11).and_then(|y| y.add(&a11)).and_then(|y| y.relu()).expect("a12");
        let a13 = conv("a13", Conv2dConfig::new(160, 160, 3).padding(1))
            .forward(&a12)
            .and_then(|y| y.add(&a12))
            .and_then(|y| y.relu())
            .expect("a13");
        conv("a14", Conv2dConfig::new(160, 16, 1)).forward(&a13).expect("a14").mark_output("y6");
    });
    Case {
        name: "shapes",
        input: [32, 9, 11],
        graph,
        convs: &[
            "shapes.a1",
            "shapes.a2",
            "shapes.a3",
            "shapes.a4",
            "shapes.a5",
            "shapes.a6",
            "shapes.a7",
            "shapes.a8",
            "shapes.a9",
            "shapes.a10",
            "shapes.a11",
            "shapes.a12",
            "shapes.a13",
            "shapes.a14",
        ],
        outputs: &["y1", "y2", "y3", "y4", "y5", "y6"],
    }
}

/// Wide, short images, where the host picks 64 × 2 and 128 × 1 patches: with padding 2 and
/// dilation 2, the first filter row's boxes lie wholly above the image (all zero fill), and a
/// stride-2 conv's 256-pixel boxes are TMA's widest.
fn edges() -> Case {
    let graph = trace("edges", [16, 2, 258], |x, conv| {
        let e1 = conv("e1", Conv2dConfig::new(16, 32, 3).padding(2).dilation(2)).forward(x).and_then(|h| h.relu()).expect("e1");
        conv("e2", Conv2dConfig::new(32, 16, 1).stride(2)).forward(&e1).expect("e2").mark_output("z1");
        conv("e3", Conv2dConfig::new(32, 32, 3).stride(2).padding(1)).forward(&e1).expect("e3").mark_output("z2");
    });
    Case { name: "edges", input: [16, 2, 258], graph, convs: &["edges.e1", "edges.e2", "edges.e3"], outputs: &["z1", "z2"] }
}

/// `graph` as a `precision` engine with its tactics restricted to `source`; a build error is
/// noted in `failures`.
fn build(
    gpu: &Arc<Gpu>,
    graph: &Graph,
    precision: Precision,
    cache: &std::path::Path,
    source: &str,
    failures: &mut Vec<String>,
) -> Option<Arc<Engine>> {
    let max = *batches().last().expect("a batch");
    let config = BuildConfig::default().precision(precision).batch(1, max, max).calibration_cache(cache).tactic_sources(&[source]);
    EngineBuilder::new(config)
        .with_gpu(gpu.clone())
        .build(graph)
        .map(Arc::new)
        .map_err(|e| failures.push(format!("`{source}` must build: {e}")))
        .ok()
}

/// Each batch's outputs of `engine` on the first images of `input`.
fn run(engine: &Arc<Engine>, input: &HostTensor) -> Vec<HashMap<String, HostTensor>> {
    let mut ctx = engine.context().expect("context");
    let per: usize = input.shape[1..].iter().product();
    batches()
        .into_iter()
        .map(|b| {
            let x = HostTensor::new([&[b][..], &input.shape[1..]].concat(), input.data[..b * per].to_vec());
            ctx.run(&[("input", &x)]).expect("run").into_iter().collect()
        })
        .collect()
}

#[test]
#[ignore = "needs an sm_90 GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn wgmma_conv8_matches_the_simulation_and_the_mma_sync_kernel() {
    check(shapes());
}

#[test]
#[ignore = "needs an sm_90 GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn wgmma_conv8_at_the_edges_of_wide_short_images() {
    check(edges());
}

/// `case` in INT8 engines, each variant forced and all timed, against the simulation and the
/// mma.sync kernel, at every batch of `batches()`; then (unless one source is named, as for the
/// sanitizers) an FP8 engine, timed, that must not use it.
fn check(case: Case) {
    let Some(gpu) = hopper_gpu() else { return };
    let graph = &case.graph;
    let batches = batches();
    let max = *batches.last().expect("a batch");
    let input = common::random(&[&[max][..], &case.input[..]].concat(), 31, 2.0);
    let (cache, path) = min_max_cache(graph, &input, &format!("conv8-hopper-{}", case.name));
    let mut failures = vec![];
    {
        let (precision, format, code) = (Precision::Int8, QuantFormat::Int8, "i8");
        // The simulation reads the input rounded to f16, as the engine's quantiser does.
        let seen = common::to_f16(&input);
        let sim = kiln::run_cpu(&simulate(graph, &cache, format).expect("simulate"), &[("input", &seen)]).expect("cpu");
        // INT8's twin on the mma.sync kernel: the same s32 sums and epilogue.
        let twin = build(&gpu, graph, precision, &path, "kernel:conv8_i8_m128n64", &mut failures).map(|e| run(&e, &input));
        let all = format!("kernel:conv8_{code}_wgmma");
        // `CONV8_HOPPER_SOURCE=n128_bk64_s8` (a variant; `all`: the timed choice among them) runs
        // only that source, for compute-sanitizer.
        let only = std::env::var("CONV8_HOPPER_SOURCE").ok();
        // Every tile variant the library lists (`conv8_<fmt>_wgmma_n<BN>_bk<BK>_s<STAGES>`), each
        // forced alone, then all of them timed.
        let variants: Vec<String> = kiln::dev::kernels::conv8_hopper_entry_points()
            .into_iter()
            .filter(|e| all.strip_prefix("kernel:").is_some_and(|a| e.starts_with(a)))
            .collect();
        assert!(variants.len() >= 2, "{format:?}: the wgmma variants {variants:?}");
        let sources = variants.iter().map(|v| format!("kernel:{v}")).chain([all.clone()]);
        let chosen = |s: &String| only.as_deref().is_none_or(|o| if o == "all" { *s == all } else { s.ends_with(o) });
        for source in sources.filter(chosen) {
            let Some(engine) = build(&gpu, graph, precision, &path, &source, &mut failures) else { continue };
            print!("{}{}", engine.describe(), engine.summary);
            // Every conv is 8-bit, and every one took the forced kernel.
            let eight_bit: Vec<String> =
                engine.layers().filter(|l| kiln::dev::plan::precision_of_kind(&l.kind()).is_some()).map(|l| l.path().to_string()).collect();
            let forced: Vec<String> = engine.layers().filter(|l| l.kind().starts_with(&source)).map(|l| l.path().to_string()).collect();
            if eight_bit != case.convs || forced != case.convs {
                let want = case.convs;
                failures
                    .push(format!("`{source}`: 8-bit layers {eight_bit:?}, on the forced kernel {forced:?}, expected {want:?} for both"));
            }
            for (i, got) in run(&engine, &input).iter().enumerate() {
                let batch = batches[i];
                for &name in case.outputs {
                    let y = &got[name].data;
                    let (rel, max_abs) = rel_l2(y, &sim[name].data[..y.len()]);
                    println!(
                        "`{source}` batch {batch} {name}: rel L2 {rel:.2e}, max abs {max_abs:.2e} against the {} simulation",
                        format.name()
                    );
                    if rel.is_nan() || rel >= 1e-2 {
                        failures.push(format!("`{source}` batch {batch} {name}: rel L2 {rel:.2e} against the simulation"));
                    }
                    if let Some(twin) = &twin {
                        let (rel, max_abs) = rel_l2(y, &twin[i][name].data);
                        println!("`{source}` batch {batch} {name}: rel L2 {rel:.2e}, max abs {max_abs:.2e} against the mma.sync kernel");
                        if rel.is_nan() || rel >= 1e-3 {
                            failures.push(format!("`{source}` batch {batch} {name}: rel L2 {rel:.2e} against the mma.sync kernel"));
                        }
                    }
                }
            }
        }
    }
    // FP8, every tactic timed: no conv may take the wgmma kernel.
    if std::env::var("CONV8_HOPPER_SOURCE").is_ok() {
        let _ = std::fs::remove_file(&path);
        assert!(failures.is_empty(), "{failures:#?}");
        return;
    }
    let config = BuildConfig::default().precision(Precision::Fp8).batch(1, max, max).calibration_cache(&path);
    match EngineBuilder::new(config).with_gpu(gpu.clone()).build(graph) {
        Ok(engine) => {
            let wgmma: Vec<String> = engine.layers().filter(|l| l.kind().contains("_wgmma_")).map(|l| l.path().to_string()).collect();
            println!("FP8 engine: {} layers, {} on a wgmma conv", engine.layers().count(), wgmma.len());
            if !wgmma.is_empty() {
                failures.push(format!("FP8 convs {wgmma:?} took the wgmma conv, which has no FP8 form"));
            }
        }
        Err(e) => failures.push(format!("the FP8 engine must build: {e}")),
    }
    let _ = std::fs::remove_file(&path);
    assert!(failures.is_empty(), "{failures:#?}");
}
