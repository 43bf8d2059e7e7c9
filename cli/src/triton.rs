//! `kiln triton-repo`: a ready Triton Inference Server model repository for a bundled model, a
//! graph file or an engine file, written by kiln-triton's `write_repository` (the model file, a
//! `config.pbtxt` the Kiln backend loads as it is, and a README with the server's command).

use super::common::{self, Source};
use clap::Args;
use kiln::{Error, Result};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use triton_kiln::config::{parse_shapes, ProfileShapes};
use triton_kiln::{bundled_source, write_repository, InstanceKind, ModelSource, RepositoryOptions};

#[derive(Args, Debug)]
pub struct TritonRepoArgs {
    /// A bundled model (resnet50, yolov8n, ...), a graph file (.kiln.safetensors) or an engine file (.kiln).
    pub model: String,
    /// Weights for a bundled model or a graph file (safetensors or a PyTorch .pth; default: the model's own).
    #[arg(long, value_name = "FILE")]
    pub weights: Option<PathBuf>,
    /// For a bundled YOLO: serve decoded frames of this size (`720x1280`, u8 `[N, H, W * 3]`), letterboxed in the engine.
    #[arg(long, value_name = "HxW")]
    pub letterbox: Option<String>,
    /// The repository folder to write (created if needed; this model's folder is replaced).
    #[arg(short, long, value_name = "DIR")]
    pub output: PathBuf,
    /// The model's name in the repository (default: the bundled model's, or the file's without its extension).
    #[arg(long)]
    pub name: Option<String>,
    /// Triton's max_batch_size (default: an engine file's max batch, else 8).
    #[arg(long, value_name = "N")]
    pub max_batch_size: Option<usize>,
    /// KIND_CPU instances (Kiln's CPU executor; no GPU needed) instead of KIND_GPU.
    #[arg(long)]
    pub cpu: bool,
    /// Instances per device.
    #[arg(long, default_value_t = 1)]
    pub count: usize,
    /// GPUs of the KIND_GPU instance group, comma-separated (default: every GPU Triton sees).
    #[arg(long, value_delimiter = ',', conflicts_with = "cpu")]
    pub gpus: Vec<usize>,
    /// Precision of the engine a graph file is built into on first load (fp32, tf32, fp16, int8, fp8; default fp16).
    #[arg(long)]
    pub precision: Option<String>,
    /// An optimization profile's smallest per-image dims, `input:3x128x128` (with --max-shapes; graph sources only).
    #[arg(long, value_name = "NAME:DIMS", requires = "max_shapes")]
    pub min_shapes: Option<String>,
    /// The profile's dims engines are tuned for (default: the traced dims).
    #[arg(long, value_name = "NAME:DIMS", requires = "min_shapes")]
    pub opt_shapes: Option<String>,
    /// The profile's largest per-image dims (with --min-shapes).
    #[arg(long, value_name = "NAME:DIMS", requires = "min_shapes")]
    pub max_shapes: Option<String>,
    /// The dynamic batcher's queue delay, in microseconds.
    #[arg(long, value_name = "US", default_value_t = 1000)]
    pub max_queue_delay_us: u64,
    /// Where kiln/libtriton_kiln.so lives, for the README's server command (default: a placeholder).
    #[arg(long, value_name = "DIR")]
    pub backend_directory: Option<PathBuf>,
    /// Refuse requests whose FP32 inputs hold NaN or infinity (HTTP 400) instead of answering NaN.
    #[arg(long)]
    pub refuse_non_finite: bool,
}

fn flag(flag: &str, reason: String) -> Error {
    Error::Flag { flag: flag.into(), reason }
}

/// `--min-shapes`/`--opt-shapes`/`--max-shapes` as a profile.
fn profile(a: &TritonRepoArgs) -> Result<Option<ProfileShapes>> {
    let parse = |name: &str, s: &Option<String>| s.as_deref().map(parse_shapes).transpose().map_err(|e| flag(name, e));
    let (min, opt, max) =
        (parse("--min-shapes", &a.min_shapes)?, parse("--opt-shapes", &a.opt_shapes)?, parse("--max-shapes", &a.max_shapes)?);
    Ok(match (min, max) {
        (Some(min), Some(max)) => Some(ProfileShapes { min, opt, max }),
        _ => None,
    })
}

/// What to serve: a bundled model traced here (with `--letterbox`, behind the YOLO letterbox), a
/// graph file copied (or traced again with `--weights`), an engine file copied.
fn model_source(a: &TritonRepoArgs) -> Result<ModelSource> {
    let backend = |e: triton_kiln::BackendError| Error::Config { reason: e.to_string() };
    let source = common::source(&a.model)?;
    if let Some(text) = &a.letterbox {
        let Source::Bundled(info) = source else {
            return Err(flag("--letterbox", format!("puts a bundled YOLO model behind its letterbox; {} is not one", a.model)));
        };
        let hw = text.split_once('x').and_then(|(h, w)| Some([h.parse().ok()?, w.parse().ok()?]));
        let hw = hw.ok_or_else(|| flag("--letterbox", format!("takes HxW, e.g. 720x1280; got `{text}`")))?;
        return bundled_source(info.name, a.weights.as_deref(), Some(hw)).map_err(backend);
    }
    match source {
        Source::EngineFile(path) if a.weights.is_some() => {
            Err(flag("--weights", format!("cannot change the folded weights of the engine file {}", path.display())))
        }
        Source::EngineFile(path) => Ok(ModelSource::EngineFile(path)),
        Source::GraphFile(path) if a.weights.is_none() => Ok(ModelSource::GraphFile(path)),
        _ => {
            let traced = common::load(&a.model, a.weights.as_deref(), false, 1, None)?;
            let metadata = BTreeMap::from([("model".to_string(), traced.model.clone()), ("weights".to_string(), traced.weights.clone())]);
            Ok(ModelSource::Graph { graph: Box::new(traced.graph), metadata })
        }
    }
}

pub fn triton_repo(a: TritonRepoArgs) -> Result<ExitCode> {
    if a.count == 0 {
        return Err(flag("--count", "must be at least 1".into()));
    }
    // Triton's max_batch_size is an int32, and Kiln's engines take at most MAX_BATCH.
    let most = kiln::files::engine::MAX_BATCH;
    match a.max_batch_size {
        Some(0) => return Err(flag("--max-batch-size", "must be at least 1".into())),
        Some(n) if n > most => {
            return Err(flag("--max-batch-size", format!("must be at most {most} (Kiln's largest engine batch), got {n}")))
        }
        _ => {}
    }
    // The server command is printed and written into the README: a newline would split it.
    for (name, path) in [("--output", Some(&a.output)), ("--backend-directory", a.backend_directory.as_ref())] {
        if let Some(p) = path.filter(|p| p.to_string_lossy().chars().any(char::is_control)) {
            return Err(flag(name, format!("{p:?} holds a control character (a newline would split the server command)")));
        }
    }
    let precision = match a.precision.as_deref() {
        Some(p) => Some(
            kiln::engine::Precision::parse(p)
                .ok_or_else(|| flag("--precision", format!("`{p}` is not one of fp32, tf32, fp16, int8, fp8")))?,
        ),
        None => None,
    };
    let source = model_source(&a)?;
    let options = RepositoryOptions {
        name: a.name.clone().unwrap_or_else(|| source.default_name()),
        max_batch_size: a.max_batch_size,
        kind: if a.cpu { InstanceKind::Cpu } else { InstanceKind::Gpu },
        count: a.count,
        gpus: a.gpus.clone(),
        precision,
        profile: profile(&a)?,
        dynamic_batching: true,
        max_queue_delay_us: a.max_queue_delay_us,
        backend_directory: a.backend_directory.clone(),
        refuse_non_finite: a.refuse_non_finite,
    };
    let written = write_repository(&source, &a.output, &options).map_err(|e| Error::Config { reason: e.to_string() })?;
    say!("wrote {} ({})", written.model_dir.display(), written.model_file.display());
    say!("{}", written.serve_command);
    Ok(ExitCode::SUCCESS)
}
