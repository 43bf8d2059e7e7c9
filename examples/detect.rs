//! YOLOv8n on a photo: its boxes printed with COCO names and drawn to a PNG.
//!
//! ```sh
//! cargo run --release --example detect -- street.jpg --weights yolov8n.safetensors -o boxes.png [--cpu]
//! ```
//!
//! `--weights` is an Ultralytics checkpoint's `state_dict` as safetensors (README, "Bring a YOLO",
//! shows the two-line conversion of `yolov8n.pt`). The photo is letterboxed to 640x640 as
//! Ultralytics does (RGB, padding 114, /255); boxes are mapped back onto the photo. Without a GPU,
//! or with `--cpu`, the CPU executor runs it.

use kiln::engine::{gpu_available, BuildConfig, EngineBuilder, Precision};
use kiln::VarBuilder;
use kiln_vision::{coco_classes, detections, draw_detections, letterbox, load_rgb, save_png};
use std::error::Error;
use std::sync::Arc;

const SIZE: usize = 640;
/// Ultralytics' default confidence threshold.
const MIN_SCORE: f32 = 0.25;

fn main() -> Result<(), Box<dyn Error>> {
    let usage = "usage: detect PHOTO [--weights yolov8n.safetensors] [-o boxes.png] [--cpu]";
    let (mut photo, mut weights, mut out, mut cpu) = (None, None, "boxes.png".to_string(), false);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--weights" => weights = Some(it.next().ok_or(usage)?),
            "-o" | "--output" => out = it.next().ok_or(usage)?,
            "--cpu" => cpu = true,
            _ if a.starts_with('-') || photo.is_some() => return Err(format!("unexpected `{a}`; {usage}").into()),
            _ => photo = Some(a),
        }
    }
    let photo = photo.ok_or(usage)?;
    let vb = match &weights {
        Some(path) => VarBuilder::from_files(&[path])?,
        None => {
            eprintln!("warning: no --weights: yolov8n runs on random (seeded) weights, so its boxes are meaningless");
            VarBuilder::seeded()
        }
    };
    // Outputs `predictions` and `detections` ([1, 300, 6]: x1, y1, x2, y2, score, class).
    let graph = kiln_models::trace("yolov8n", vb, 1, SIZE)?;
    let mut img = load_rgb(&photo)?;
    let (x, geometry) = letterbox(&img, [SIZE, SIZE])?;
    let outputs = match gpu_available() {
        Ok(()) if !cpu => {
            let engine = Arc::new(EngineBuilder::new(BuildConfig::default().precision(Precision::Fp16)).build(&graph)?);
            engine.context()?.run(&[("input", &x)])?
        }
        _ => kiln::run_cpu(&kiln::internals::passes::optimize(&graph)?, &[("input", &x)])?,
    };
    let found = detections(&outputs["detections"], 0, MIN_SCORE, |b| geometry.unmap_box(b));
    println!("{photo}: {} detections", found.len());
    for d in &found {
        let [x1, y1, x2, y2] = d.bbox;
        let name = coco_classes().get(d.class).copied().unwrap_or("?");
        println!("  {name:<14} {:.2}  ({x1:.0}, {y1:.0}) - ({x2:.0}, {y2:.0})", d.score);
    }
    draw_detections(&mut img, &found, coco_classes());
    save_png(&img, &out)?;
    println!("wrote {out}");
    Ok(())
}
