//! A photo to its top-5 ImageNet names, on the GPU (an FP16 engine) or on the CPU executor.
//!
//! ```sh
//! python3 tools/fetch_real_data.py     # torchvision's MobileNetV2 checkpoint and scikit-image's photos
//! cargo run --release --example classify -- target/real-data/photos/chelsea.png \
//!     --weights target/real-data/mobilenet_v2-b0353104.pth --cpu
//! ```
//!
//! `--model` picks another bundled classifier (default `mobilenet_v2`), `--weights` its
//! `state_dict` (safetensors or a PyTorch `.pth`). Without `--weights` the model runs on random
//! (seeded) weights, and its answer means nothing. Without `--cpu` it uses the GPU when there is one.
//!
//! `--gpu-entry` puts the preset inside the engine (`classify_preset`, kiln-models' entry op): the
//! engine takes the photo's decoded bytes (`[1, H, W * 3]` u8) and resizes, crops and normalises
//! them on the GPU (on the CPU executor with `--cpu`). It prints that top-5 and, for comparison,
//! the top-5 of the same model on kiln-vision's CPU preset, with the logits' rel L2 between them
//! (the stage computes the CPU preset's pixels exactly, so the two differ only by the engine's
//! arithmetic).

use kiln::engine::{gpu_available, BuildConfig, EngineBuilder, Precision};
use kiln::image::ChannelOrder;
use kiln::{ByteTensor, HostInput, HostTensor, VarBuilder};
use kiln_vision::{imagenet_classes, load_rgb, top_k, ClassifyPreset};
use std::error::Error;
use std::sync::Arc;

struct Args {
    photo: String,
    model: String,
    weights: Option<String>,
    cpu: bool,
    gpu_entry: bool,
}

fn args() -> Result<Args, String> {
    let usage = "usage: classify PHOTO [--model mobilenet_v2] [--weights FILE] [--cpu] [--gpu-entry]";
    let (mut photo, mut model, mut weights, mut cpu, mut gpu_entry) = (None, "mobilenet_v2".to_string(), None, false, false);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--model" => model = it.next().ok_or(usage)?,
            "--weights" => weights = Some(it.next().ok_or(usage)?),
            "--cpu" => cpu = true,
            "--gpu-entry" => gpu_entry = true,
            "-h" | "--help" => {
                println!("{usage}");
                std::process::exit(0);
            }
            _ if a.starts_with('-') || photo.is_some() => return Err(format!("unexpected `{a}`; {usage}")),
            _ => photo = Some(a),
        }
    }
    Ok(Args { photo: photo.ok_or(usage)?, model, weights, cpu, gpu_entry })
}

/// The logits of the graph's one input `x` from an FP16 engine on the GPU, or from the CPU executor.
fn logits(graph: &kiln::Graph, name: &str, x: HostInput<'_>, cpu: bool) -> kiln::Result<HostTensor> {
    let mut out = match gpu_available() {
        Ok(()) if !cpu => {
            let engine = Arc::new(EngineBuilder::new(BuildConfig::default().precision(Precision::Fp16)).build(graph)?);
            engine.context()?.run(&[(name, x)])?
        }
        _ => kiln::run_cpu(&kiln::engine::optimize(graph)?, &[(name, x)])?,
    };
    Ok(out.remove("logits").expect("a classifier's output is `logits`"))
}

fn print_top5(title: &str, logits: &HostTensor) {
    println!("{title}:");
    for p in top_k(&logits.data, 5) {
        println!("  {:.3}  {} ({})", p.probability, p.name(imagenet_classes()), p.class);
    }
}

fn main() -> Result<(), Box<dyn Error>> {
    let a = args()?;
    let vb = match &a.weights {
        Some(path) => VarBuilder::from_files(&[path])?,
        None => {
            eprintln!("warning: no --weights: {} runs on random (seeded) weights, so its answer is meaningless", a.model);
            VarBuilder::seeded()
        }
    };
    let graph = kiln_models::trace(&a.model, vb.clone(), 1, 224)?;
    // torchvision's preset: Resize(256), CenterCrop(224), ImageNet mean and std.
    let img = load_rgb(&a.photo)?;
    let x = ClassifyPreset::IMAGENET.tensor(std::slice::from_ref(&img))?;
    let on_cpu_preset = logits(&graph, "input", (&x).into(), a.cpu)?;
    if !a.gpu_entry {
        print_top5(&a.photo, &on_cpu_preset);
        return Ok(());
    }
    // The same preset as the engine's first layer, from the photo's bytes.
    let (h, w) = (img.height() as usize, img.width() as usize);
    let frames = kiln_models::trace_frames(&a.model, vb, 1, [h, w], ChannelOrder::Rgb)?;
    let frame = ByteTensor { shape: vec![1, h, w * 3], data: img.into_raw() };
    let on_entry = logits(&frames, "frame", (&frame).into(), a.cpu)?;
    let where_ = if a.cpu || gpu_available().is_err() { "CPU executor" } else { "GPU" };
    print_top5(&format!("{} (preset in the engine: classify_preset on the {where_}, {h}x{w} u8 frame)", a.photo), &on_entry);
    print_top5(&format!("{} (kiln-vision's CPU preset)", a.photo), &on_cpu_preset);
    let (num, den) = on_entry
        .data
        .iter()
        .zip(&on_cpu_preset.data)
        .fold((0f64, 0f64), |(n, d), (&g, &c)| (n + f64::from(g - c).powi(2), d + f64::from(c).powi(2)));
    let same = top_k(&on_entry.data, 5).iter().map(|p| p.class).eq(top_k(&on_cpu_preset.data, 5).iter().map(|p| p.class));
    println!("logits rel L2 {:.2e}; top-5 {}", (num / den.max(f64::MIN_POSITIVE)).sqrt(), if same { "identical" } else { "differ" });
    Ok(())
}
