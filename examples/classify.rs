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

use kiln::engine::{gpu_available, BuildConfig, EngineBuilder, Precision};
use kiln::{HostTensor, VarBuilder};
use kiln_vision::{imagenet_classes, top_k, ClassifyPreset};
use std::error::Error;
use std::sync::Arc;

struct Args {
    photo: String,
    model: String,
    weights: Option<String>,
    cpu: bool,
}

fn args() -> Result<Args, String> {
    let usage = "usage: classify PHOTO [--model mobilenet_v2] [--weights FILE] [--cpu]";
    let (mut photo, mut model, mut weights, mut cpu) = (None, "mobilenet_v2".to_string(), None, false);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--model" => model = it.next().ok_or(usage)?,
            "--weights" => weights = Some(it.next().ok_or(usage)?),
            "--cpu" => cpu = true,
            _ if a.starts_with('-') || photo.is_some() => return Err(format!("unexpected `{a}`; {usage}")),
            _ => photo = Some(a),
        }
    }
    Ok(Args { photo: photo.ok_or(usage)?, model, weights, cpu })
}

/// The logits of `x` from an FP16 engine on the GPU, or from the CPU executor.
fn logits(graph: &kiln::Graph, x: &HostTensor, cpu: bool) -> kiln::Result<HostTensor> {
    let mut out = match gpu_available() {
        Ok(()) if !cpu => {
            let engine = Arc::new(EngineBuilder::new(BuildConfig::default().precision(Precision::Fp16)).build(graph)?);
            engine.context()?.run(&[("input", x)])?
        }
        _ => kiln::run_cpu(&kiln::internals::passes::optimize(graph)?, &[("input", x)])?,
    };
    Ok(out.remove("logits").expect("a classifier's output is `logits`"))
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
    let graph = kiln_models::trace(&a.model, vb, 1, 224)?;
    // torchvision's preset: Resize(256), CenterCrop(224), ImageNet mean and std.
    let x = ClassifyPreset::IMAGENET.load(&[&a.photo])?;
    let logits = logits(&graph, &x, a.cpu)?;
    println!("{}:", a.photo);
    for p in top_k(&logits.data, 5) {
        println!("  {:.3}  {} ({})", p.probability, p.name(imagenet_classes()), p.class);
    }
    Ok(())
}
