//! `write_repository`: a ready Triton model repository for a Kiln model (what `kiln triton-repo`
//! writes): the model file, a config.pbtxt the backend accepts as it is, and a README saying how
//! to start the server.
//!
//! ```text
//! out/README.md
//! out/<name>/config.pbtxt
//! out/<name>/1/model.kiln.safetensors   (a traced model or a graph file)  or  model.kiln (an engine)
//! ```

use crate::config::{self, Binding, KilnParameters, ModelConfig, ModelSpec, Parameter, ProfileShapes, TensorConfig};
use crate::error::{BackendError, Result};
use crate::kiln_api::{BuildConfig, Engine, Graph, Precision};
use crate::model::{self, model_spec, traced_dims, ENGINE_FILE, GRAPH_FILE};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// What to serve.
pub enum ModelSource {
    /// A traced graph (a bundled model): written as a graph file, with this metadata.
    Graph { graph: Box<Graph>, metadata: BTreeMap<String, String> },
    /// A graph file (`kiln trace`), copied.
    GraphFile(PathBuf),
    /// An engine file (`kiln build`), copied; it keeps its own batch range and profiles.
    EngineFile(PathBuf),
}

impl ModelSource {
    /// The name a repository gives the model when none is chosen: a traced model's `model`
    /// metadata (`resnet18`), else the file's name without `.kiln.safetensors` / `.kiln`.
    pub fn default_name(&self) -> String {
        let stem = |p: &Path| {
            let name = p.file_name().map_or_else(String::new, |f| f.to_string_lossy().into_owned());
            name.trim_end_matches(Graph::FILE_EXTENSION).trim_end_matches(".kiln").to_string()
        };
        match self {
            ModelSource::Graph { metadata, .. } => metadata.get("model").cloned().unwrap_or_else(|| "model".into()),
            ModelSource::GraphFile(p) | ModelSource::EngineFile(p) => stem(p),
        }
    }

    /// A file by its name: `*.kiln.safetensors` is a graph file, anything else an engine file.
    pub fn from_path(path: impl Into<PathBuf>) -> Self {
        let path = path.into();
        if path.to_string_lossy().ends_with(Graph::FILE_EXTENSION) {
            ModelSource::GraphFile(path)
        } else {
            ModelSource::EngineFile(path)
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum InstanceKind {
    /// Kiln's CPU executor (no GPU needed).
    Cpu,
    /// An engine on each GPU of `gpus` (all GPUs when empty).
    #[default]
    Gpu,
}

/// How the repository is written; `Default` gives a GPU model named `model`.
#[derive(Clone, Debug)]
pub struct RepositoryOptions {
    /// The model's name in the repository (its folder and `name:`).
    pub name: String,
    /// Triton's max_batch_size. Default: an engine file's max batch, else 8.
    pub max_batch_size: Option<usize>,
    pub kind: InstanceKind,
    /// Instances per device (per GPU, or on the CPU).
    pub count: usize,
    /// The GPUs of a `Gpu` instance group (empty: every GPU Triton sees).
    pub gpus: Vec<usize>,
    /// The precision a graph file is built in on first load (default fp16; engines keep theirs).
    pub precision: Option<Precision>,
    /// An optimization profile over the inputs' per-image dims (graph sources only).
    pub profile: Option<ProfileShapes>,
    /// The dynamic batcher (on by default): how long a request may wait for others.
    pub dynamic_batching: bool,
    pub max_queue_delay_us: u64,
    /// Where `kiln/libtriton_kiln.so` is, for the README's command (a placeholder when unknown).
    pub backend_directory: Option<PathBuf>,
    /// `parameters["refuse_non_finite"]`: refuse requests whose FP32 inputs hold NaN or infinity.
    pub refuse_non_finite: bool,
}

impl Default for RepositoryOptions {
    fn default() -> Self {
        Self {
            name: "model".into(),
            max_batch_size: None,
            kind: InstanceKind::Gpu,
            count: 1,
            gpus: Vec::new(),
            precision: None,
            profile: None,
            dynamic_batching: true,
            max_queue_delay_us: 1000,
            backend_directory: None,
            refuse_non_finite: false,
        }
    }
}

/// What was written.
#[derive(Clone, Debug)]
pub struct WrittenRepository {
    pub model_dir: PathBuf,
    pub model_file: PathBuf,
    pub config_pbtxt: String,
    /// The command that starts Triton on the repository (also in its README.md).
    pub serve_command: String,
}

fn invalid(name: &str, field: &str, reason: String) -> BackendError {
    BackendError::Config { model: name.into(), field: field.into(), reason }
}

/// Writes a ready model repository for `source` under `out` (created if needed; this model's
/// folder is replaced). The config is checked as the backend will check it, so it loads.
pub fn write_repository(source: &ModelSource, out: &Path, options: &RepositoryOptions) -> Result<WrittenRepository> {
    let name = options.name.as_str();
    if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
        return Err(invalid(name, "name", "must be a plain folder name".into()));
    }
    let (graph, engine_build, file_name) = read_source(source, name)?;
    if engine_build.is_some() && (options.precision.is_some() || options.profile.is_some()) {
        return Err(invalid(
            name,
            "parameters",
            "an engine file keeps the precision and profiles it was built with; give a graph file to choose them".into(),
        ));
    }
    let max_batch = options.max_batch_size.unwrap_or_else(|| engine_build.as_ref().map_or(8, |b| b.max_batch));
    // Saturating: `config::check` refuses anything past Kiln's batch limit, which fits an int32.
    let mut config = ModelConfig { name: name.into(), max_batch_size: i64::try_from(max_batch).unwrap_or(i64::MAX), ..Default::default() };
    for (field, path) in [("output", Some(out)), ("backend_directory", options.backend_directory.as_deref())] {
        if let Some(p) = path.filter(|p| p.to_string_lossy().chars().any(char::is_control)) {
            return Err(invalid(name, field, format!("{p:?} holds a control character (a newline would split the server command)")));
        }
    }
    if let Some(p) = options.precision {
        config.parameters.insert("precision".into(), Parameter { string_value: p.short_name().into() });
    }
    if options.refuse_non_finite {
        config.parameters.insert("refuse_non_finite".into(), Parameter { string_value: "true".into() });
    }
    if let Some(p) = &options.profile {
        let text =
            |m: &BTreeMap<String, Vec<usize>>| m.iter().map(|(n, d)| format!("{n}:{}", config::dims_text(d))).collect::<Vec<_>>().join(",");
        config.parameters.insert("min_shapes".into(), Parameter { string_value: text(&p.min) });
        if let Some(opt) = &p.opt {
            config.parameters.insert("opt_shapes".into(), Parameter { string_value: text(opt) });
        }
        config.parameters.insert("max_shapes".into(), Parameter { string_value: text(&p.max) });
    }
    let build = match engine_build {
        Some(b) => b,
        None => {
            let params: KilnParameters = config.kiln_parameters()?;
            let profile = params
                .profile
                .as_ref()
                .map(|p| config::shape_profile(p, &traced_dims(&graph)))
                .transpose()
                .map_err(|reason| invalid(name, "profile", reason))?;
            config::build_config(&config, &params, profile, &out.join(name).join("1"))
        }
    };
    let spec: ModelSpec = model_spec(&graph, &build, file_name, matches!(source, ModelSource::EngineFile(_)))
        .map_err(BackendError::kiln(format!("model `{name}`")))?;
    let tensor = |b: &Binding| TensorConfig {
        name: b.name.clone(),
        data_type: b.elem.config_name().into(),
        dims: b.config_dims(),
        ..Default::default()
    };
    config.input = spec.inputs.iter().map(tensor).collect();
    config.output = spec.outputs.iter().map(tensor).collect();
    config::check(&config, &spec)?;

    let model_dir = out.join(name);
    let version_dir = model_dir.join("1");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |e: std::io::Error| BackendError::ModelFile { model: name.into(), dir: path, reason: format!("cannot write: {e}") }
    };
    if model_dir.exists() {
        std::fs::remove_dir_all(&model_dir).map_err(io(&model_dir))?;
    }
    std::fs::create_dir_all(&version_dir).map_err(io(&version_dir))?;
    let model_file = version_dir.join(file_name);
    match source {
        ModelSource::Graph { graph, metadata } => {
            graph.save_with_metadata(&model_file, metadata).map_err(BackendError::kiln(format!("writing {}", model_file.display())))?
        }
        ModelSource::GraphFile(path) | ModelSource::EngineFile(path) => {
            std::fs::copy(path, &model_file).map_err(io(&model_file))?;
        }
    }
    let pbtxt = config_pbtxt(&config, &spec, options);
    let config_path = model_dir.join("config.pbtxt");
    std::fs::write(&config_path, &pbtxt).map_err(io(&config_path))?;

    let repo = std::path::absolute(out).unwrap_or_else(|_| out.to_path_buf());
    let backends = options
        .backend_directory
        .as_ref()
        .map_or("<dir holding kiln/libtriton_kiln.so>".to_string(), |d| shell_quote(&d.display().to_string()));
    let serve_command =
        format!("tritonserver --model-repository={} --backend-directory={backends}", shell_quote(&repo.display().to_string()));
    let readme_path = out.join("README.md");
    std::fs::write(&readme_path, readme(name, &model_file, max_batch, options, &serve_command)).map_err(io(&readme_path))?;
    Ok(WrittenRepository { model_dir, model_file, config_pbtxt: pbtxt, serve_command })
}

/// `s` as one word of a POSIX shell command: as it is when it holds only characters no shell
/// treats specially, else in single quotes (a `'` written `'\''`).
fn shell_quote(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./=:@%+,".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The model's graph, the build config an engine file was made with, and the file name it takes
/// in the version folder.
fn read_source(source: &ModelSource, name: &str) -> Result<(Graph, Option<BuildConfig>, &'static str)> {
    Ok(match source {
        ModelSource::Graph { graph, .. } => ((**graph).clone(), None, GRAPH_FILE),
        ModelSource::GraphFile(path) => {
            (Graph::load(path).map_err(BackendError::kiln(format!("reading {}", path.display())))?, None, GRAPH_FILE)
        }
        ModelSource::EngineFile(path) => {
            let bytes = std::fs::read(path).map_err(|e| BackendError::ModelFile {
                model: name.into(),
                dir: path.clone(),
                reason: format!("cannot read it: {e}"),
            })?;
            let (graph, config) = Engine::read_contents(&bytes, &path.display().to_string())
                .map_err(BackendError::kiln(format!("reading {}", path.display())))?;
            (graph, Some(config), ENGINE_FILE)
        }
    })
}

/// The repository's README: what was written and the command that serves it.
fn readme(name: &str, model_file: &Path, max_batch: usize, options: &RepositoryOptions, serve_command: &str) -> String {
    format!(
        "# Triton model repository written by kiln triton-repo\n\n\
         Model `{name}` ({}, max_batch_size {max_batch}, {} instances, dynamic batching {}).\n\n\
         Start the server (the Kiln backend is `<backend-directory>/kiln/libtriton_kiln.so`):\n\n    {serve_command}\n",
        model_file.file_name().map_or(String::new(), |f| f.to_string_lossy().into_owned()),
        match options.kind {
            InstanceKind::Cpu => "KIND_CPU",
            InstanceKind::Gpu => "KIND_GPU",
        },
        if options.dynamic_batching { "on" } else { "off" },
    )
}

/// config.pbtxt's text (protobuf text format).
fn config_pbtxt(config: &ModelConfig, spec: &ModelSpec, options: &RepositoryOptions) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Written by kiln triton-repo for {}", spec.file);
    let _ = writeln!(s, "name: \"{}\"", config.name);
    s += "backend: \"kiln\"\n";
    let _ = writeln!(s, "max_batch_size: {}", config.max_batch_size);
    for (section, list) in [("input", &config.input), ("output", &config.output)] {
        let _ = writeln!(s, "{section} [");
        for (i, t) in list.iter().enumerate() {
            let dims = t.dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ");
            let _ = write!(s, "  {{\n    name: \"{}\"\n    data_type: {}\n    dims: [ {dims} ]\n  }}", t.name, t.data_type);
            s += if i + 1 < list.len() { ",\n" } else { "\n" };
        }
        s += "]\n";
    }
    if options.dynamic_batching {
        let _ = writeln!(s, "dynamic_batching {{\n  max_queue_delay_microseconds: {}\n}}", options.max_queue_delay_us);
    }
    let kind = match options.kind {
        InstanceKind::Cpu => "KIND_CPU",
        InstanceKind::Gpu => "KIND_GPU",
    };
    let gpus = if options.kind == InstanceKind::Gpu && !options.gpus.is_empty() {
        format!("\n    gpus: [ {} ]", options.gpus.iter().map(|g| g.to_string()).collect::<Vec<_>>().join(", "))
    } else {
        String::new()
    };
    let _ = writeln!(s, "instance_group [\n  {{\n    count: {}\n    kind: {kind}{gpus}\n  }}\n]", options.count.max(1));
    for (key, p) in &config.parameters {
        let _ = writeln!(s, "parameters {{\n  key: \"{key}\"\n  value: {{ string_value: \"{}\" }}\n}}", p.string_value);
    }
    s
}

/// The config a written repository's model loads with, as the backend reads it (for tests and
/// tools that check a repository without a server): config.pbtxt's fields this backend uses.
pub fn read_written_config(written: &WrittenRepository) -> Result<ModelConfig> {
    parse_pbtxt(&written.config_pbtxt)
}

/// A reader for the config.pbtxt files `write_repository` writes (not for protobuf text in
/// general): the fields the backend reads.
fn parse_pbtxt(text: &str) -> Result<ModelConfig> {
    let mut config = ModelConfig::default();
    let bad = |reason: String| BackendError::Config { model: config_name(text), field: "config.pbtxt".into(), reason };
    let mut section: Option<&str> = None;
    let mut current = TensorConfig::default();
    let mut key = String::new();
    for line in text.lines().map(str::trim) {
        let value = |l: &str| l.split_once(':').map(|(_, v)| v.trim().trim_matches('"').to_string()).unwrap_or_default();
        match line {
            l if l.starts_with("input [") => section = Some("input"),
            l if l.starts_with("output [") => section = Some("output"),
            "]" => section = None,
            l if l.starts_with("}") && section.is_some() => {
                let t = std::mem::take(&mut current);
                if section == Some("input") {
                    config.input.push(t)
                } else {
                    config.output.push(t)
                }
            }
            l if section.is_some() && l.starts_with("name:") => current.name = value(l),
            l if section.is_some() && l.starts_with("data_type:") => current.data_type = value(l),
            l if section.is_some() && l.starts_with("dims:") => {
                current.dims = value(l)
                    .trim_matches(|c| c == '[' || c == ']')
                    .split(',')
                    .map(|d| d.trim().parse::<i64>())
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|e| bad(format!("dims in `{l}`: {e}")))?
            }
            l if l.starts_with("name:") => config.name = value(l),
            l if l.starts_with("max_batch_size:") => {
                config.max_batch_size = value(l).parse().map_err(|e| bad(format!("max_batch_size: {e}")))?
            }
            l if l.starts_with("key:") => key = value(l),
            l if l.starts_with("value:") => {
                let v = l
                    .split_once("string_value:")
                    .map(|(_, v)| v.trim().trim_end_matches('}').trim().trim_matches('"').to_string())
                    .unwrap_or_default();
                config.parameters.insert(std::mem::take(&mut key), Parameter { string_value: v });
            }
            _ => {}
        }
    }
    Ok(config)
}

fn config_name(text: &str) -> String {
    text.lines().find_map(|l| l.trim().strip_prefix("name:")).map(|v| v.trim().trim_matches('"').to_string()).unwrap_or_default()
}

/// Loads a written repository's model as the backend would (no server): a check for tests and tools.
pub fn load_written(written: &WrittenRepository) -> Result<model::LoadedModel> {
    model::LoadedModel::load(read_written_config(written)?, &written.model_dir.join("1"))
}
