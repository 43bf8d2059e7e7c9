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
//!
//! `--gpu-entry` puts the letterbox inside the engine (`yolo_letterbox` reading RGB frames, and
//! the NMS mapping boxes onto the frame): the engine takes the photo's decoded bytes as they are.

use kiln::engine::{gpu_available, BuildConfig, EngineBuilder, Precision};
use kiln::image::ChannelOrder;
use kiln::{ByteTensor, HostInput, HostTensor, VarBuilder};
use kiln_vision::{coco_classes, detections, draw_detections, letterbox, load_rgb, save_png};
use std::collections::BTreeMap;
use std::error::Error;
use std::sync::Arc;

const SIZE: usize = 640;
/// Ultralytics' default confidence threshold.
const MIN_SCORE: f32 = 0.25;

/// The graph's outputs for its one input `x`, from an FP16 engine on the GPU or the CPU executor.
fn run(graph: &kiln::Graph, name: &str, x: HostInput<'_>, cpu: bool) -> kiln::Result<BTreeMap<String, HostTensor>> {
    match gpu_available() {
        Ok(()) if !cpu => {
            let engine = Arc::new(EngineBuilder::new(BuildConfig::default().precision(Precision::Fp16)).build(graph)?);
            engine.context()?.run(&[(name, x)])
        }
        _ => kiln::run_cpu(&kiln::engine::optimize(graph)?, &[(name, x)]),
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let usage = "usage: detect PHOTO [--weights yolov8n.safetensors] [-o boxes.png] [--cpu] [--gpu-entry]";
    let (mut photo, mut weights, mut out, mut cpu, mut gpu_entry) = (None, None, "boxes.png".to_string(), false, false);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--weights" => weights = Some(it.next().ok_or(usage)?),
            "-o" | "--output" => out = it.next().ok_or(usage)?,
            "--cpu" => cpu = true,
            "--gpu-entry" => gpu_entry = true,
            "-h" | "--help" => {
                println!("{usage}");
                std::process::exit(0);
            }
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
    let mut img = load_rgb(&photo)?;
    let (h, w) = (img.height() as usize, img.width() as usize);
    // Outputs `predictions` and `detections` ([1, 300, 6]: x1, y1, x2, y2, score, class): in the
    // model input's pixels, or with the entry stage in the frame's.
    let (outputs, unmap) = if gpu_entry {
        let graph = kiln_models::trace_frames("yolov8n", vb, 1, [h, w], ChannelOrder::Rgb)?;
        let frame = ByteTensor { shape: vec![1, h, w * 3], data: img.as_raw().clone() };
        (run(&graph, "frame", (&frame).into(), cpu)?, None)
    } else {
        let (x, geometry) = letterbox(&img, [SIZE, SIZE])?;
        (run(&kiln_models::trace("yolov8n", vb, 1, SIZE)?, "input", (&x).into(), cpu)?, Some(geometry))
    };
    let found = detections(&outputs["detections"], 0, MIN_SCORE, |b| unmap.map_or(b, |g| g.unmap_box(b)));
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
