//! `classify_preset` on the GPU: torchvision's classifier preset (`Resize` with PIL's antialiased
//! bilinear filter, `CenterCrop`, ImageNet normalisation) as an engine's entry stage from u8
//! frames, against its CPU reference (which equals torchvision exactly, `tests/classify_preset.rs`)
//! at several frame sizes: downscaling (a 1080p frame to 256), upscaling, same size, non-square
//! frames and crops, a crop larger than the resized frame, RGB and BGR frames, batch 1 and 2.
//! FP32 engines match exactly (the resampling is integer, the normalisation the same f32
//! operations); FP16 engines to f16 rounding of values below 4 in size, at most 2^-10 (asserted
//! ≤ 1e-3). Then MobileNetV2 behind the stage: its logits against the CPU executor's.
//!
//! Run on the device: `cargo test --release -p kiln --test gpu_classify_preset -- --include-ignored --nocapture`.

mod common;

use common::{gpu, random, rel_l2};
use kiln::engine::{BuildConfig, EngineBuilder, Precision};
use kiln::image::ChannelOrder;
use kiln::{ByteTensor, DType, Tracer, VarBuilder};
use kiln_models::classify_preset::{classify_preset, frame_input, Preset};
use std::sync::Arc;

/// Random frame bytes of `[batch, h, w * 3]`, fresh every run (`KILN_SEED` replays).
fn frame_bytes(batch: usize, h: usize, w: usize, stream: u64) -> ByteTensor {
    let values = random(&[batch, h, w * 3], stream, 1.0);
    ByteTensor::new(values.shape.clone(), values.data.iter().map(|&v| ((v + 1.0) * 127.9).floor() as u8).collect()).expect("bytes")
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device"]
fn classify_preset_layer_matches_the_cpu_reference() {
    let Some(gpu) = gpu() else { return };
    let max_batch = 2;
    let imagenet = Preset::IMAGENET;
    let cases = [
        // (frame h, w, preset): downscaling, a camera frame, upscaling, same size, odd shapes.
        (1080, 1920, imagenet),
        (480, 640, imagenet),
        (64, 80, Preset { resize: 32, crop: [32, 32], ..imagenet }),
        (100, 150, imagenet),
        (20, 30, Preset { resize: 32, crop: [28, 28], ..imagenet }),
        (256, 256, Preset { crop: [256, 256], ..imagenet }),
        (333, 97, Preset { resize: 64, crop: [48, 40], ..imagenet }),
        (16, 16, Preset { resize: 12, crop: [16, 14], ..imagenet }),
    ];
    for ((h, w, preset), order) in cases.into_iter().flat_map(|c| [(c, ChannelOrder::Rgb), (c, ChannelOrder::Bgr)]) {
        let preset = Preset { order, ..preset };
        let tracer = Tracer::new();
        let x = frame_input(&tracer, "frame", 1, [h, w]);
        tracer.output("input", &classify_preset(&x, &preset).expect("classify_preset"));
        let graph = tracer.graph();
        for (precision, tol) in [(Precision::Fp32, 0.0), (Precision::Fp16, 1e-3)] {
            let config = BuildConfig::default().precision(precision).batch(1, max_batch, max_batch);
            let engine = Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph).unwrap_or_else(|e| panic!("build: {e}")));
            assert_eq!(engine.input_dtype("frame"), Some(DType::U8));
            let mut ctx = engine.context().expect("context");
            for batch in [1, max_batch] {
                let frame = frame_bytes(batch, h, w, (h * w + batch) as u64);
                let want = kiln::run_cpu(&graph, &[("frame", &frame)]).expect("cpu")["input"].clone();
                let got = ctx.run(&[("frame", &frame)]).expect("run")["input"].clone();
                assert_eq!(got.shape, [batch, 3, preset.crop[0], preset.crop[1]]);
                let (rel, max_abs) = rel_l2(&got.data, &want.data);
                println!(
                    "classify_preset {h}x{w} {order:?} -> {} -> {:?} {precision:?} batch {batch}: rel L2 {rel:.2e}, max abs {max_abs:.2e}",
                    preset.resize, preset.crop
                );
                assert!(max_abs <= tol, "classify_preset {h}x{w} {order:?} {precision:?} batch {batch}: max abs {max_abs} > {tol}");
            }
        }
    }
}

/// MobileNetV2 (seeded weights) behind the stage, as `kiln_models::trace_frames` builds it: the
/// engine's logits against the CPU executor's on a 480x640 camera frame.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device"]
fn a_classifier_behind_the_stage_matches_the_cpu_executor() {
    let Some(gpu) = gpu() else { return };
    let graph = kiln_models::trace_frames("mobilenet_v2", VarBuilder::seeded(), 1, [480, 640], ChannelOrder::Rgb).expect("trace");
    let frame = frame_bytes(1, 480, 640, 7);
    let want = kiln::run_cpu(&graph, &[("frame", &frame)]).expect("cpu")["logits"].clone();
    for (precision, tol) in [(Precision::Fp32, 1e-4), (Precision::Fp16, 3e-2)] {
        let config = BuildConfig::default().precision(precision);
        let engine = Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph).unwrap_or_else(|e| panic!("build: {e}")));
        assert!(engine.layers().any(|l| l.kind().starts_with("kernel:classify_preset")), "the entry stage runs on the GPU");
        let got = engine.context().expect("context").run(&[("frame", &frame)]).expect("run")["logits"].clone();
        let (rel, max_abs) = rel_l2(&got.data, &want.data);
        println!("mobilenet_v2 behind classify_preset {precision:?}: logits rel L2 {rel:.2e}, max abs {max_abs:.2e}");
        assert!(rel <= tol, "mobilenet_v2 {precision:?}: rel L2 {rel} > {tol}");
    }
}
