//! `write_repository` from the command line, until `kiln triton-repo` calls it:
//! `cargo run --release -p kiln-triton --example triton_repo -- resnet18.kiln.safetensors -o repo --name resnet18 --cpu`
//! `... --example triton_repo -- yolov8n --letterbox 720x1280 -o repo --name yolov8n` (a bundled model, taking frames)

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;
use triton_kiln::config::{parse_shapes, ProfileShapes};
use triton_kiln::{bundled_source, write_repository, InstanceKind, ModelSource, RepositoryOptions};

#[derive(Parser)]
struct Args {
    /// A bundled model (resnet50, yolov8n, ...), a graph file (.kiln.safetensors) or an engine file (.kiln).
    model: PathBuf,
    /// A bundled model's weights (a safetensors state_dict; default: seeded).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// For a bundled YOLO: take decoded frames of this size (`720x1280`), letterboxed in the engine.
    #[arg(long)]
    letterbox: Option<String>,
    /// The repository folder to write.
    #[arg(short, long)]
    output: PathBuf,
    /// The model's name in the repository (default: the bundled model's, or the file's without its extension).
    #[arg(long)]
    name: Option<String>,
    /// Triton's max_batch_size (default: an engine's max batch, else 8).
    #[arg(long)]
    max_batch_size: Option<usize>,
    /// KIND_CPU instances (Kiln's CPU executor) instead of KIND_GPU.
    #[arg(long)]
    cpu: bool,
    /// Instances per device.
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// GPUs of the instance group, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<usize>,
    /// Precision of the engine a graph file is built into (fp32, tf32, fp16, ...).
    #[arg(long)]
    precision: Option<String>,
    /// An optimization profile's smallest per-image dims, `input:3x128x128` (with --max-shapes).
    #[arg(long)]
    min_shapes: Option<String>,
    #[arg(long)]
    opt_shapes: Option<String>,
    #[arg(long)]
    max_shapes: Option<String>,
    /// The dynamic batcher's queue delay in microseconds.
    #[arg(long, default_value_t = 1000)]
    max_queue_delay_us: u64,
    /// Where kiln/libtriton_kiln.so lives, for the README's command.
    #[arg(long)]
    backend_directory: Option<PathBuf>,
}

fn main() -> ExitCode {
    let a = Args::parse();
    let shapes = |s: &Option<String>| s.as_deref().map(parse_shapes).transpose();
    let profile = match (shapes(&a.min_shapes), shapes(&a.opt_shapes), shapes(&a.max_shapes)) {
        (Ok(Some(min)), Ok(opt), Ok(Some(max))) => Some(ProfileShapes { min, opt, max }),
        (Ok(None), Ok(None), Ok(None)) => None,
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
            eprintln!("error: shapes {e}");
            return ExitCode::FAILURE;
        }
        _ => {
            eprintln!("error: --min-shapes and --max-shapes go together");
            return ExitCode::FAILURE;
        }
    };
    let precision = match a.precision.as_deref().map(|p| triton_kiln::Precision::parse(p).ok_or(p)) {
        Some(Err(p)) => {
            eprintln!("error: unknown precision `{p}`");
            return ExitCode::FAILURE;
        }
        Some(Ok(p)) => Some(p),
        None => None,
    };
    let options = RepositoryOptions {
        name: String::new(),
        max_batch_size: a.max_batch_size,
        kind: if a.cpu { InstanceKind::Cpu } else { InstanceKind::Gpu },
        count: a.count,
        gpus: a.gpus,
        precision,
        profile,
        dynamic_batching: true,
        max_queue_delay_us: a.max_queue_delay_us,
        backend_directory: a.backend_directory,
    };
    let source = if a.model.is_file() {
        ModelSource::from_path(&a.model)
    } else {
        let frame = match a.letterbox.as_deref().map(|s| s.split_once('x').and_then(|(h, w)| Some([h.parse().ok()?, w.parse().ok()?]))) {
            Some(None) => {
                eprintln!("error: --letterbox takes HxW, e.g. 720x1280");
                return ExitCode::FAILURE;
            }
            Some(Some(hw)) => Some(hw),
            None => None,
        };
        match bundled_source(&a.model.to_string_lossy(), a.weights.as_deref(), frame) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    };
    let options = RepositoryOptions { name: a.name.clone().unwrap_or_else(|| source.default_name()), ..options };
    match write_repository(&source, &a.output, &options) {
        Ok(w) => {
            println!("wrote {} ({})", w.model_dir.display(), w.model_file.display());
            println!("{}", w.serve_command);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
