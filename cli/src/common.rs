//! What the commands share: finding the model a command names (a bundled or user model, a graph
//! file, an engine file), tracing it with its weights, making or reading an input, building or
//! loading an engine (with a progress bar), and summarising outputs for people.

use super::{EngineArgs, ModelArgs, TraceFn};
use indicatif::{ProgressBar, ProgressStyle};
use kiln::engine::{BuildConfig, Engine, EngineBuilder, Gpu, Precision};
use kiln::files::FileKind;
use kiln::{ByteTensor, DType, Error, Graph, HostInput, HostTensor, Result, VarBuilder};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A traced (or loaded) model, ready to run.
pub struct Traced {
    pub name: String,
    /// The model's own name: `name` for bundled and user models, a graph file's `model` metadata.
    pub model: String,
    pub graph: Graph,
    /// The input's height and width, when its first input is an NCHW image (`None` for other
    /// inputs, such as a letterboxed model's `[N, H, W * 3]` frame of bytes).
    pub hw: Option<[usize; 2]>,
    /// Where it came from, for messages and metadata (`bundled`, `user`, `graph file`, `engine file`).
    pub origin: &'static str,
    /// Its weights, as metadata and messages name them: `seeded`, a `--weights` file, the
    /// built-in trained weights of `digits_resnet`, or the graph or engine file's own.
    pub weights: String,
    /// The weights are the seeded generator's: random, so the model's answers mean nothing.
    pub seeded: bool,
}

impl Traced {
    /// `HxW` for messages; for a model of other inputs, each input's per-image dims and type
    /// (`frame 720x3840 u8`).
    pub fn hw_text(&self) -> String {
        match self.hw {
            Some([h, w]) => format!("{h}x{w}"),
            None => inputs_text(&self.graph),
        }
    }

    /// The H × W of the model's NCHW input, or an error that `command` needs one.
    pub fn nchw_hw(&self, command: &str) -> Result<[usize; 2]> {
        self.hw.ok_or_else(|| Error::Flag {
            flag: command.into(),
            reason: format!("needs a model whose input is an NCHW image; {} takes {}", self.name, self.hw_text()),
        })
    }
}

/// One graph input as the commands make data for it: name, per-image dims, declared type.
#[derive(Clone, Debug, PartialEq)]
pub struct InputSpec {
    pub name: String,
    pub dims: Vec<usize>,
    pub dtype: DType,
}

/// Each input's name, per-image dims and type, for messages: `frame 720x3840 u8`.
fn inputs_text(graph: &Graph) -> String {
    let inputs = graph_inputs(graph);
    inputs.iter().map(|i| format!("{} {} {}", i.name, super::shapes::dims_text(&i.dims), i.dtype)).collect::<Vec<_>>().join(", ")
}

/// The inputs of a graph, in binding order.
pub fn graph_inputs(graph: &Graph) -> Vec<InputSpec> {
    graph
        .inputs
        .iter()
        .zip(graph.input_names())
        .map(|(&i, name)| InputSpec { name: name.to_string(), dims: graph.nodes[i].shape[1..].to_vec(), dtype: graph.nodes[i].dtype })
        .collect()
}

/// The inputs of an engine at its first plan's dims, in binding order.
pub fn engine_inputs(engine: &Engine) -> Vec<InputSpec> {
    engine
        .inputs()
        .into_iter()
        .map(|(name, dims)| InputSpec { name: name.to_string(), dims: dims.to_vec(), dtype: engine.input_dtype(name).unwrap_or_default() })
        .collect()
}

/// One input's data as a command holds it: f32 values, or bytes for an input declared u8.
#[derive(Clone, Debug, PartialEq)]
pub enum InputData {
    F32(HostTensor),
    U8(ByteTensor),
}

impl InputData {
    pub fn as_input(&self) -> HostInput<'_> {
        match self {
            InputData::F32(t) => HostInput::F32(t),
            InputData::U8(t) => HostInput::U8(t),
        }
    }
}

/// Named inputs as `run` takes them.
pub fn bind(inputs: &[(String, InputData)]) -> Vec<(&str, HostInput<'_>)> {
    inputs.iter().map(|(n, d)| (n.as_str(), d.as_input())).collect()
}

/// Random data for `inputs` at `batch`: uniform in [-1, 1) for f32 inputs, uniform bytes for u8
/// ones (an image as decoded). The k-th input is drawn from `seed + k`, so a one-input model's
/// input depends on `seed` alone, as `--seed` promises.
pub fn random_inputs(inputs: &[InputSpec], batch: usize, seed: u64) -> Result<Vec<(String, InputData)>> {
    let mut out = Vec::with_capacity(inputs.len());
    for (k, spec) in inputs.iter().enumerate() {
        let shape: Vec<usize> = std::iter::once(batch).chain(spec.dims.iter().copied()).collect();
        let values = random_input(&shape, seed.wrapping_add(k as u64))?;
        let data = match spec.dtype {
            // [-1, 1) onto the 256 levels, each equally likely.
            DType::U8 => {
                InputData::U8(ByteTensor::new(shape, values.data.iter().map(|v| ((v + 1.0) * 128.0).clamp(0.0, 255.0) as u8).collect())?)
            }
            _ => InputData::F32(values),
        };
        out.push((spec.name.clone(), data));
    }
    Ok(out)
}

/// The models a program added with `main_with`, by name.
static USER_MODELS: Mutex<Vec<(String, TraceFn)>> = Mutex::new(Vec::new());

pub fn set_user_models(models: &[(&str, TraceFn)]) {
    let mut m = USER_MODELS.lock().unwrap_or_else(|p| p.into_inner());
    *m = models.iter().map(|(n, f)| (n.to_string(), *f)).collect();
}

/// The names of the models a program added with `main_with`.
pub fn user_model_names() -> Vec<String> {
    USER_MODELS.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(n, _)| n.clone()).collect()
}

fn user_model(name: &str) -> Option<TraceFn> {
    USER_MODELS.lock().unwrap_or_else(|p| p.into_inner()).iter().find(|(n, _)| n == name).map(|(_, f)| *f)
}

/// What a command's model argument names.
#[derive(Clone, Debug)]
pub enum Source {
    User(String, TraceFn),
    Bundled(&'static kiln_models::BundledModel),
    GraphFile(PathBuf),
    EngineFile(PathBuf),
}

/// Decides what `arg` names: a program's own model, a bundled model, then a file by its content
/// (`kiln::files::kind`: the engine magic `KILNENG`, or a safetensors header holding the graph;
/// its name does not matter); anything else is an error listing what is accepted.
pub fn source(arg: &str) -> Result<Source> {
    if let Some(f) = user_model(arg) {
        return Ok(Source::User(arg.to_string(), f));
    }
    if let Ok(info) = kiln_models::bundled(arg) {
        return Ok(Source::Bundled(info));
    }
    let path = PathBuf::from(arg);
    if !path.exists() {
        if arg.ends_with(".kiln") || arg.ends_with(".safetensors") || arg.contains(std::path::MAIN_SEPARATOR) {
            return Err(Error::Io { path, source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file") });
        }
        let mut known = kiln_models::bundled_names();
        let users = user_model_names();
        if !users.is_empty() {
            known = format!("{known}; this program's own: {}", users.join(", "));
        }
        return Err(Error::UnknownModel { name: arg.to_string(), known });
    }
    match kiln::files::kind(&path) {
        FileKind::Engine => Ok(Source::EngineFile(path)),
        // A safetensors file without a graph, a directory or a FIFO: the graph-file reader says
        // what it is (a state_dict goes to --weights; only a regular file is read).
        FileKind::Graph | FileKind::Safetensors => Ok(Source::GraphFile(path)),
        FileKind::Other if !path.is_file() => Ok(Source::GraphFile(path)),
        FileKind::Other => Err(Error::GraphFile {
            path: arg.to_string(),
            reason: "is neither a graph file (.kiln.safetensors by convention, from `kiln trace`: a safetensors file whose metadata holds `kiln.graph`) \
                     nor an engine file (.kiln by convention, from `kiln build`: it starts with KILNENG)"
                .into(),
        }),
    }
}

/// Whether a command's model argument names an engine file.
pub fn is_engine_file(arg: &str) -> bool {
    matches!(source(arg), Ok(Source::EngineFile(_)))
}

/// `digits_resnet`'s trained weights (`kiln_models::DIGITS_WEIGHTS`, built into the binary, so
/// `kiln` finds them wherever it runs), the default of that model.
const DIGITS_TRAINED: &[u8] = include_bytes!("../../models/weights/digits_resnet.safetensors");

/// How `DIGITS_TRAINED` is named in messages and metadata.
pub const DIGITS_TRAINED_LABEL: &str = "trained weights (models/weights/digits_resnet.safetensors, built in)";

/// The weights a command asked for (a safetensors file or a PyTorch checkpoint, `.pth`/`.pt`,
/// told apart by their bytes), else the model's default: `digits_resnet`'s trained weights, or
/// the seeded generator. Returns them with their label and whether they are seeded.
pub fn weights(path: Option<&Path>, model: &str) -> Result<(VarBuilder, String, bool)> {
    match path {
        Some(p) => Ok((VarBuilder::from_files(&[p])?, p.display().to_string(), false)),
        None if model == "digits_resnet" => {
            let shown = Path::new(kiln_models::DIGITS_WEIGHTS);
            let (tensors, _) = kiln::files::decode_safetensors(shown, DIGITS_TRAINED, "weight")?;
            Ok((VarBuilder::from_tensors(tensors), DIGITS_TRAINED_LABEL.to_string(), false))
        }
        None => Ok((VarBuilder::seeded(), "seeded".to_string(), true)),
    }
}

/// The most elements an input may have: 2^31 (8 GiB as f32).
pub const MAX_INPUT_ELEMENTS: usize = 1 << 31;

/// Checks `--batch` and `--size` before anything is traced or allocated: both at least 1, and an
/// input of batch × 3 × H × W that neither overflows nor exceeds `MAX_INPUT_ELEMENTS`.
pub fn check_input_dims(batch: usize, hw: [usize; 2]) -> Result<()> {
    let flag = |flag: &str, reason: String| Error::Flag { flag: flag.into(), reason };
    if batch == 0 {
        return Err(flag("--batch", "must be at least 1".into()));
    }
    if hw[0] == 0 || hw[1] == 0 {
        return Err(flag("--size", "must be at least 1".into()));
    }
    let [h, w] = hw;
    let what = if h == w {
        format!("an input of --batch {batch} at --size {h} ({batch} x 3 x {h} x {w})")
    } else {
        format!("an input of --batch {batch} at {h}x{w} ({batch} x 3 x {h} x {w})")
    };
    match kiln::dev::numel(&[batch, 3, h, w]) {
        None => Err(Error::TooLarge { what, reason: "its element count overflows".into() }),
        Some(n) if n > MAX_INPUT_ELEMENTS => Err(Error::TooLarge {
            what,
            reason: format!("{n} elements, more than the limit of {MAX_INPUT_ELEMENTS} (8 GiB as f32); lower --batch or --size"),
        }),
        Some(_) => Ok(()),
    }
}

/// The batch and H × W a command asked for, from `--batch`, `--size` and `--shapes input:NxCxHxW`
/// together; flags that disagree are an error naming both.
pub fn requested(m: &ModelArgs, batch: Option<usize>) -> Result<(Option<usize>, Option<[usize; 2]>)> {
    let size = m.size.map(|s| [s, s]);
    let Some(shapes) = &m.shapes else { return Ok((batch, size)) };
    let spec = match shapes.0.as_slice() {
        [one] => one,
        more => {
            return Err(Error::Flag { flag: "--shapes".into(), reason: format!("names {} inputs; the model has one, `input`", more.len()) })
        }
    };
    let [n, _, h, w] = spec.dims[..] else {
        return Err(Error::Flag {
            flag: "--shapes".into(),
            reason: format!("gives {} dims for `{}`; the input is NxCxHxW", spec.dims.len(), spec.name),
        });
    };
    let disagree = |flag: &str, given: String| Error::Flag {
        flag: flag.into(),
        reason: format!("{given} disagrees with --shapes {}:{}", spec.name, super::shapes::dims_text(&spec.dims)),
    };
    if let Some(b) = batch.filter(|&b| b != n) {
        return Err(disagree("--batch", b.to_string()));
    }
    if let Some(s) = m.size.filter(|&s| [s, s] != [h, w]) {
        return Err(disagree("--size", s.to_string()));
    }
    Ok((Some(n), Some([h, w])))
}

/// The input H × W of a graph whose first input is an NCHW image, for graph files and user
/// models; `None` for other inputs (they run at their traced per-image dims).
fn graph_hw(graph: &Graph) -> Option<[usize; 2]> {
    match graph.inputs.first().map(|&i| graph.nodes[i].shape.as_slice()) {
        Some(&[_, _, h, w]) => Some([h, w]),
        _ => None,
    }
}

/// `check_input_dims` for a graph of any inputs: a batch of at least 1, and every input at
/// `batch` within `MAX_INPUT_ELEMENTS`.
fn check_graph_inputs(batch: usize, graph: &Graph, name: &str) -> Result<()> {
    if let Some(hw) = graph_hw(graph) {
        return check_input_dims(batch, hw);
    }
    if batch == 0 {
        return Err(Error::Flag { flag: "--batch".into(), reason: "must be at least 1".into() });
    }
    for spec in graph_inputs(graph) {
        let what = format!("input `{}` of {name} at --batch {batch} ({batch} x {})", spec.name, super::shapes::dims_text(&spec.dims));
        match spec.dims.iter().try_fold(batch, |n, &d| n.checked_mul(d)) {
            None => return Err(Error::TooLarge { what, reason: "its element count overflows".into() }),
            Some(n) if n > MAX_INPUT_ELEMENTS => {
                return Err(Error::TooLarge {
                    what,
                    reason: format!("{n} elements, more than the limit of {MAX_INPUT_ELEMENTS}; lower --batch"),
                })
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Replaces a loaded graph's weights with those of `--weights`, by name, each checked for shape.
fn replace_weights(graph: &mut Graph, path: &Path, strict: bool) -> Result<()> {
    let vb = VarBuilder::from_files(&[path])?;
    for (name, t) in graph.weights.iter_mut() {
        *t = vb.get(&t.shape, name)?.value;
    }
    if strict {
        vb.check_all_used()?;
        vb.check_finite()?;
    }
    Ok(())
}

/// A graph or engine file's own weights: NaN or infinity fails `--strict`, else is a warning.
fn check_own_weights(graph: &Graph, path: &Path, strict: bool) -> Result<()> {
    let shown = path.display().to_string();
    if strict {
        return graph.check_finite_weights(&shown);
    }
    warn_non_finite(&graph.non_finite_weights(), &shown);
    Ok(())
}

/// The warning for weights holding NaN or infinity (`bad`: key and count), from `source`.
fn warn_non_finite(bad: &[(String, usize)], source: &str) {
    if let Some((key, count)) = bad.first() {
        tracing::warn!(
            "warning: {} weight(s) of {source} hold NaN or infinity (e.g. `{key}`: {count} value(s)); outputs will not be finite; --strict makes this an error",
            bad.len()
        );
    }
}

/// Loads the model `m` names at the batch `--batch` gives (`batch`: `None` when the flag was not
/// typed), else `--shapes`'s N, else 1 (a trace for bundled and user models; graph and engine
/// files hold their graph, which the CPU executor runs at any batch), checking (with `--strict`)
/// that every weight was used and that none holds NaN or infinity (without it, both are warnings).
pub fn trace_args(m: &ModelArgs, batch: Option<usize>) -> Result<Traced> {
    let (batch, hw) = requested(m, batch)?;
    load_args(m, batch.unwrap_or(1), hw)
}

/// `load` of the model, weights and strictness `m` names, at `batch` and `hw`, then
/// `check_shapes` of its `--shapes`.
pub fn load_args(m: &ModelArgs, batch: usize, hw: Option<[usize; 2]>) -> Result<Traced> {
    if let Some(frames) = &m.frames {
        return load_frames(m, batch, frames);
    }
    let traced = load(&m.model, m.weights.as_deref(), m.strict, batch, hw)?;
    check_shapes(m.shapes.as_ref(), &graph_inputs(&traced.graph), &traced.name)?;
    Ok(traced)
}

/// `--frames HxW[:rgb|:bgr]`: the bundled model `m` names behind its entry op
/// (`kiln_models::trace_frames`), its input `frame` `[batch, H, W * 3]` u8.
fn load_frames(m: &ModelArgs, batch: usize, text: &str) -> Result<Traced> {
    use kiln::image::ChannelOrder;
    let bad = |reason: String| Error::Flag { flag: "--frames".into(), reason };
    let (dims, order) = match text.rsplit_once(':') {
        None => (text, ChannelOrder::Rgb),
        Some((dims, "rgb")) => (dims, ChannelOrder::Rgb),
        Some((dims, "bgr")) => (dims, ChannelOrder::Bgr),
        Some((_, other)) => return Err(bad(format!("`{other}` is not a channel order; write HxW (RGB) or HxW:bgr"))),
    };
    let hw = dims.split_once('x').and_then(|(h, w)| Some([h.parse::<usize>().ok()?, w.parse::<usize>().ok()?]));
    let hw = hw.filter(|hw| hw.iter().all(|&v| (1..=1 << 16).contains(&v)));
    let hw = hw.ok_or_else(|| bad(format!("takes HxW with sides of 1 to 65536 pixels, e.g. 480x640 or 720x1280:bgr; got `{text}`")))?;
    let Source::Bundled(info) = source(&m.model)? else {
        return Err(bad(format!("puts a bundled classifier or YOLO behind its entry stage; {} is not a bundled model", m.model)));
    };
    if !matches!(info.family(), "classifier" | "yolo") {
        return Err(bad(format!("{} has no entry stage; the classifiers and the YOLO detectors have one", info.name)));
    }
    let (vb, label, seeded) = weights(m.weights.as_deref(), info.name)?;
    let graph = kiln_models::trace_frames(info.name, vb.clone(), batch, hw, order)?;
    if m.strict && m.weights.is_some() {
        vb.check_all_used()?;
        vb.check_finite()?;
    }
    check_graph_inputs(batch, &graph, info.name)?;
    Ok(Traced { name: info.name.into(), model: info.name.into(), graph, hw: None, origin: "bundled", weights: label, seeded })
}

/// `--shapes NAME:DIMS` against the model's inputs (per-image dims, as `graph_inputs` and
/// `engine_inputs` give them): each name must be an input's, and its dims the input's, except the
/// batch and an image's H x W, which the flag sets. An error names the flag, the input and both
/// shapes.
pub fn check_shapes(shapes: Option<&super::Shapes>, inputs: &[InputSpec], model: &str) -> Result<()> {
    let Some(shapes) = shapes else { return Ok(()) };
    let text = |dims: &[usize]| super::shapes::dims_text(dims);
    for spec in &shapes.0 {
        let given = format!("{}:{}", spec.name, text(&spec.dims));
        let Some(input) = inputs.iter().find(|i| i.name == spec.name) else {
            let have: Vec<String> = inputs.iter().map(|i| format!("`{}` Nx{}", i.name, text(&i.dims))).collect();
            return Err(Error::Flag {
                flag: "--shapes".into(),
                reason: format!("{given}: {model} has no input `{}`; its inputs: {}", spec.name, have.join(", ")),
            });
        };
        // An image's H and W are the flag's to set; every other dim is the model's.
        let fixed = |dims: &[usize]| if dims.len() == 3 { dims[..1].to_vec() } else { dims.to_vec() };
        if spec.dims.len() != input.dims.len() + 1 || fixed(&spec.dims[1..]) != fixed(&input.dims) {
            return Err(Error::Flag {
                flag: "--shapes".into(),
                reason: format!("{given}: {model}'s input `{}` is Nx{}", input.name, text(&input.dims)),
            });
        }
    }
    Ok(())
}

/// `trace_args` from the parts of the flags.
pub fn load(model: &str, weights_path: Option<&Path>, strict: bool, batch: usize, hw: Option<[usize; 2]>) -> Result<Traced> {
    // Graph and engine files hold a graph traced at one size: another H x W re-infers every
    // shape (an op that fixed a size makes that a typed error naming it). An engine runs it only
    // inside one of its profiles; that is checked when it runs.
    let fixed = |graph: Graph, name: String, model: String, origin: &'static str, weights: String, seeded: bool| -> Result<Traced> {
        let graph = match (hw, graph_hw(&graph)) {
            (Some([h, w]), Some(have)) if [h, w] != have => {
                let c = graph.inputs.first().map_or(3, |&i| graph.nodes[i].shape[1]);
                let dims = kiln::engine::InputDims::from([("input".to_string(), vec![c, h, w])]);
                graph.with_input_dims(&dims).map_err(|e| Error::Flag {
                    flag: "--size/--shapes".into(),
                    reason: format!("{name} was traced at {}x{} and does not run at {h}x{w}: {e}", have[0], have[1]),
                })?
            }
            (Some([h, w]), None) => {
                return Err(Error::Flag {
                    flag: "--size/--shapes".into(),
                    reason: format!("{h}x{w} is for an NCHW image input; {name} takes {}, at its traced dims", inputs_text(&graph)),
                });
            }
            _ => graph,
        };
        check_graph_inputs(batch, &graph, &name)?;
        Ok(Traced { name, model, hw: graph_hw(&graph), graph, origin, weights, seeded })
    };
    let (name, graph, vb, origin, (label, seeded)) = match source(model)? {
        Source::GraphFile(path) => {
            let file = kiln::files::graph::read(&path)?;
            let mut graph = file.graph;
            match weights_path {
                Some(w) => replace_weights(&mut graph, w, strict)?,
                None => check_own_weights(&graph, &path, strict)?,
            }
            let shown = path.display().to_string();
            let model = file.metadata.get("model").cloned().unwrap_or_else(|| shown.clone());
            // `kiln trace` records the weights it traced with.
            let (weights, seeded) = match weights_path {
                Some(w) => (w.display().to_string(), false),
                None => ("graph file".to_string(), file.metadata.get("weights").is_some_and(|w| w == "seeded")),
            };
            return fixed(graph, shown, model, "graph file", weights, seeded);
        }
        Source::EngineFile(path) => {
            let (_, payload) = kiln::files::engine::read(&path)?;
            if weights_path.is_some() {
                return Err(Error::Flag {
                    flag: "--weights".into(),
                    reason: format!("cannot change the folded weights of the engine file {model}"),
                });
            }
            check_own_weights(&payload.graph, &path, strict)?;
            tracing::info!("note: {model} is an engine file: its optimised graph (folded, fused) is used");
            let shown = path.display().to_string();
            return fixed(payload.graph, shown.clone(), shown, "engine file", "engine file".into(), false);
        }
        Source::Bundled(info) => {
            let hw = hw.unwrap_or([info.input_size, info.input_size]);
            check_input_dims(batch, hw)?;
            let (vb, label, seeded) = weights(weights_path, info.name)?;
            if !seeded && weights_path.is_none() {
                tracing::info!("note: {} loads its {label}", info.name);
            }
            (info.name.to_string(), kiln_models::trace_hw(info.name, vb.clone(), batch, hw)?, vb, "bundled", (label, seeded))
        }
        Source::User(name, f) => {
            if let Some(hw) = hw {
                check_input_dims(batch, hw)?;
            }
            let (vb, label, seeded) = weights(weights_path, "")?;
            let graph = f(vb.clone(), batch, hw)?;
            (name, graph, vb, "user", (label, seeded))
        }
    };
    check_graph_inputs(batch, &graph, &name)?;
    let hw = graph_hw(&graph);
    if let Some(p) = weights_path {
        let unused = vb.unused();
        if strict {
            vb.check_all_used()?;
            vb.check_finite()?;
        } else {
            if !unused.is_empty() {
                tracing::warn!(
                    "note: {} key(s) of {} were not used by {name} (e.g. `{}`); --strict makes this an error",
                    unused.len(),
                    p.display(),
                    unused[0]
                );
            }
            warn_non_finite(&vb.non_finite(), &p.display().to_string());
        }
    }
    Ok(Traced { model: name.clone(), name, graph, hw, origin, weights: label, seeded })
}

/// The CPU executor's peak activation memory for `graph`, in bytes: values live from the node that
/// makes them to their last reader (as `kiln::run_cpu` frees them), doubled for scratch (im2col,
/// allocator slack). Weights are already in memory and not counted.
pub fn cpu_peak_bytes(graph: &Graph) -> usize {
    let size = |id: usize| kiln::dev::numel(&graph.nodes[id].shape).map_or(usize::MAX, |n| n.saturating_mul(4));
    let mut last = vec![0usize; graph.nodes.len()];
    for (i, n) in graph.nodes.iter().enumerate() {
        n.inputs.iter().for_each(|&j| last[j] = i);
    }
    graph.outputs.iter().for_each(|&(_, o)| last[o] = usize::MAX);
    let (mut live, mut peak) = (0usize, 0usize);
    for (i, n) in graph.nodes.iter().enumerate() {
        if matches!(n.op, kiln::plugin::Op::Weight { .. }) {
            continue;
        }
        live = live.saturating_add(size(i));
        peak = peak.max(live);
        for &j in &n.inputs {
            if last[j] == i && !matches!(graph.nodes[j].op, kiln::plugin::Op::Weight { .. }) {
                live = live.saturating_sub(size(j));
            }
        }
    }
    peak.saturating_mul(2)
}

/// Refuses a CPU run whose activations cannot fit in the memory available, before allocating.
/// The graph may be traced at another batch than the run's: its peak is scaled to `batch`.
/// `shape` describes the input for the message (`224x224`).
pub fn check_cpu_memory(graph: &Graph, batch: usize, shape: &str) -> Result<()> {
    let traced_batch = graph.inputs.first().and_then(|&i| graph.nodes[i].shape.first().copied()).unwrap_or(1).max(1);
    let bytes = (cpu_peak_bytes(graph) / traced_batch).saturating_mul(batch);
    // The smallest of MemAvailable, `ulimit -v`/`-d` and the memory cgroup's limit.
    match kiln::dev::memory_available() {
        Some(kiln::dev::Available { bytes: avail, limit }) if bytes > avail => Err(Error::OutOfMemory {
            what: format!(
                "the CPU executor at --batch {batch}, {shape} (only {avail} bytes are available ({limit}); lower --batch or --size)"
            ),
            bytes,
        }),
        _ => Ok(()),
    }
}

/// A random input of `shape` whose memory is requested with `try_reserve`.
pub fn random_input(shape: &[usize], seed: u64) -> Result<HostTensor> {
    kiln::dev::try_uniform_tensor(shape, seed)
}

/// Reads an input tensor from a safetensors file: the tensor named `input`, or its only tensor.
pub fn read_input(path: &Path) -> Result<HostTensor> {
    let (mut tensors, _) = kiln::files::read_tensors_within(path, "input", |_| true, MAX_INPUT_ELEMENTS)?;
    if let Some(t) = tensors.remove("input") {
        return Ok(t);
    }
    if tensors.len() == 1 {
        return Ok(tensors.into_values().next().expect("one tensor"));
    }
    Err(Error::Safetensors {
        path: path.to_path_buf(),
        reason: format!("holds no tensor named `input` and {} others: {:?}", tensors.len(), tensors.keys().take(5).collect::<Vec<_>>()),
    })
}

/// `--input`'s tensor as a command binds it: f32 values (from f32, f16 or bf16), or bytes where the
/// file stores it as U8 (a decoded frame for a model whose input is declared u8). Returns its key
/// in the file (`input`, or the file's only tensor) and its data.
pub fn read_input_data(path: &Path) -> Result<(String, InputData)> {
    match read_input(path) {
        Ok(t) => Ok(("input".into(), InputData::F32(t))),
        Err(Error::TensorDtype { got, key, what, path: p }) if got == "U8" => match read_u8_input(path)? {
            Some((key, t)) => Ok((key, InputData::U8(t))),
            None => Err(Error::TensorDtype { got, key, what, path: p }),
        },
        Err(e) => Err(e),
    }
}

/// The U8 tensor `input`, or the file's only tensor, of a safetensors file (`None` when that
/// tensor is not U8). The header is checked first, and the file's size is limited before it is read.
fn read_u8_input(path: &Path) -> Result<Option<(String, ByteTensor)>> {
    let bad = |reason: String| Error::Safetensors { path: path.to_path_buf(), reason };
    kiln::files::read_metadata(path)?;
    let size = std::fs::metadata(path).map_err(Error::io(path))?.len();
    // One byte per element, and room for a header.
    if size > (MAX_INPUT_ELEMENTS as u64).saturating_add(1 << 24) {
        return Err(Error::TooLarge {
            what: format!("--input {}", path.display()),
            reason: format!("{size} bytes, more than an input of {MAX_INPUT_ELEMENTS} elements"),
        });
    }
    let bytes = std::fs::read(path).map_err(Error::io(path))?;
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(format!("{e:?}")))?;
    let names = file.names();
    let key = match names.as_slice() {
        _ if names.iter().any(|n| *n == "input") => "input".to_string(),
        [only] => only.to_string(),
        _ => return Err(bad(format!("holds no tensor named `input` and {} others", names.len()))),
    };
    let view = file.tensor(&key).map_err(|e| bad(format!("tensor `{key}`: {e:?}")))?;
    if view.dtype() != safetensors::Dtype::U8 {
        return Ok(None);
    }
    Ok(Some((key, ByteTensor::new(view.shape().to_vec(), view.data().to_vec())?)))
}

impl InputData {
    pub fn shape(&self) -> &[usize] {
        match self {
            InputData::F32(t) => &t.shape,
            InputData::U8(t) => &t.shape,
        }
    }
}

/// Checks an input is [N, C, H, W] with N at least 1 and returns (N, [H, W]); the model's own
/// channel count is checked when the input is bound.
pub fn input_dims(x: &HostTensor, what: &Path) -> Result<(usize, [usize; 2])> {
    match x.shape.as_slice() {
        [n, _, h, w] if *n > 0 => Ok((*n, [*h, *w])),
        s => Err(Error::Binding { name: "input".into(), reason: format!("{} holds shape {s:?}; expected [N, C, H, W]", what.display()) }),
    }
}

impl EngineArgs {
    pub fn precision(&self) -> Precision {
        if self.fp32 {
            Precision::Fp32
        } else if self.tf32 {
            Precision::Tf32
        } else if self.int8 {
            Precision::Int8
        } else if self.fp8 {
            Precision::Fp8
        } else if self.best {
            Precision::Best
        } else {
            Precision::Fp16
        }
    }

    pub fn config(&self, min: usize, opt: usize, max: usize) -> BuildConfig {
        let mut c = BuildConfig::default().precision(self.precision()).batch(min, opt, max);
        // MiB from a flag: saturate rather than wrap (the builder treats it as a limit).
        c.workspace_bytes = self.workspace.saturating_mul(1 << 20);
        c.fastest_tactics = self.fastest;
        if let Some(tc) = &self.timing_cache {
            c = c.timing_cache(tc.clone());
        }
        if let Some(cal) = &self.calibration_cache {
            c = c.calibration_cache(cal.clone());
        }
        if let Some(rules) = &self.layer_precisions {
            c = c.layer_precisions(rules.0.iter().cloned());
        }
        c
    }
}

/// The GPU, or `Error::NoGpu` with the reason (commands that need one stop here).
pub fn gpu() -> Result<Arc<Gpu>> {
    kiln::engine::gpu_available().map_err(Error::NoGpu)?;
    Gpu::new(0)
}

/// A progress bar over `len` steps of long CPU work, on standard error (hidden when it is not a
/// terminal, as in tests and pipes).
pub fn progress_bar(len: usize, prefix: &str) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    let style = ProgressStyle::with_template("{prefix} [{elapsed}] {wide_bar} {pos}/{len} {msg}").map(|s| s.progress_chars("=> "));
    bar.set_style(style.unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_prefix(prefix.to_string());
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// Builds an engine, with a progress bar over the graph's nodes while their algorithms are timed.
pub fn build_engine(graph: &Graph, config: BuildConfig, gpu: Arc<Gpu>, what: &str) -> Result<Engine> {
    let bar = progress_bar(
        0,
        &format!("building {what} ({}, batch {}..={}): timing", config.precision.short_name(), config.min_batch, config.max_batch),
    );
    let shown = bar.clone();
    let engine = EngineBuilder::new(config)
        .with_gpu(gpu)
        .on_progress(move |done, total, path| {
            shown.set_length(total as u64);
            shown.set_position(done as u64);
            shown.set_message(path.to_string());
        })
        .build(graph);
    bar.finish_and_clear();
    engine
}

/// An engine for `model` (a bundled or user model or graph file, built here; or an engine file,
/// loaded and checked to accept the batch range).
pub fn engine_for(
    model: &str,
    weights: Option<&PathBuf>,
    hw: Option<[usize; 2]>,
    args: &EngineArgs,
    batch: (usize, usize, usize),
    gpu: Arc<Gpu>,
) -> Result<(String, Engine)> {
    if let Source::EngineFile(path) = source(model)? {
        let engine = Engine::load(&path, &gpu)?;
        let c = &engine.config;
        if batch.0 < c.min_batch || batch.2 > c.max_batch {
            return Err(Error::Binding {
                name: "batch".into(),
                reason: format!("{model} was built for batch {}..={}, asked for {}..={}", c.min_batch, c.max_batch, batch.0, batch.2),
            });
        }
        if let Some([h, w]) = hw {
            // The plan for that size: made now if it lies inside one of the engine's profiles.
            let mut dims = engine.plan().dims.clone();
            if let Some(d) = dims.get_mut("input").filter(|d| d.len() == 3) {
                d[1..].copy_from_slice(&[h, w]);
            }
            engine
                .plan_for(&dims)
                .map_err(|e| Error::Binding { name: "input".into(), reason: format!("{model}, asked for {h}x{w}: {e}") })?;
        }
        return Ok((model.to_string(), engine));
    }
    let traced = load(model, weights.map(|p| p.as_path()), false, batch.1, hw)?;
    let engine = build_engine(&traced.graph, args.config(batch.0, batch.1, batch.2), gpu, &traced.name)?;
    Ok((traced.name, engine))
}

/// Softmax of one row, for showing class probabilities.
fn softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = row.iter().map(|v| (v - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    exp.iter().map(|e| e / sum).collect()
}

/// How many images' summaries to print at most.
const SHOWN_IMAGES: usize = 4;

/// People-readable outputs: top-k classes for logits, top-k detections for CenterNet, shapes and
/// ranges for anything else. `input_width` (of an NCHW input) scales CenterNet's boxes to pixels.
pub fn summarize(outputs: &BTreeMap<String, HostTensor>, top: usize, input_width: Option<usize>) -> String {
    let mut s = String::new();
    if let Some(logits) = outputs.get("logits").filter(|t| t.shape.len() == 2) {
        let (n, classes) = (logits.shape[0], logits.shape[1]);
        for (img, row) in logits.data.chunks_exact(classes.max(1)).enumerate().take(SHOWN_IMAGES) {
            let p = softmax(row);
            let mut idx: Vec<usize> = (0..classes).collect();
            idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            let best: Vec<String> = idx.iter().take(top).map(|&c| format!("class {c:>4} (logit {:>7.3}, p {:.3})", row[c], p[c])).collect();
            s += &format!("image {img}: top-{}:\n    {}\n", best.len(), best.join("\n    "));
        }
        if n > SHOWN_IMAGES {
            s += &format!("({} more images)\n", n - SHOWN_IMAGES);
        }
    }
    if let Some(det) = outputs.get("detections").filter(|t| t.shape.len() == 3 && t.shape[2] == 6) {
        let (n, k) = (det.shape[0], det.shape[1]);
        // Boxes are in output-map coordinates; the maps are at stride input/map.
        let stride = match (outputs.get("hm").and_then(|hm| hm.shape.get(3)), input_width) {
            (Some(&w), Some(input)) => input as f32 / w as f32,
            _ => 1.0,
        };
        for img in 0..n.min(SHOWN_IMAGES) {
            s += &format!("image {img}: top-{} of {k} detections (box in input pixels):\n", top.min(k));
            for d in det.data[img * k * 6..(img + 1) * k * 6].chunks_exact(6).take(top) {
                s += &format!(
                    "    class {:>2}  score {:.3}  box ({:.1}, {:.1}) - ({:.1}, {:.1})\n",
                    d[5],
                    d[4],
                    d[0] * stride,
                    d[1] * stride,
                    d[2] * stride,
                    d[3] * stride
                );
            }
        }
    }
    for (name, t) in outputs {
        if name == "logits" || name == "detections" {
            continue;
        }
        let (lo, hi) = t.data.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let mean = t.data.iter().map(|&v| v as f64).sum::<f64>() / t.numel().max(1) as f64;
        s += &format!("{name}: {:?}, min {lo:.3}, max {hi:.3}, mean {mean:.3}\n", t.shape);
    }
    s
}

/// Milliseconds, with enough digits for both 0.3 ms and 3000 ms.
pub fn ms(d: f64) -> String {
    if d < 10.0 {
        format!("{d:.3} ms")
    } else {
        format!("{d:.1} ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_summary_lists_the_top_classes_in_order() {
        let logits = HostTensor::new(vec![1, 5], vec![0.1, 3.0, -1.0, 2.0, 2.5]);
        let s = summarize(&BTreeMap::from([("logits".to_string(), logits)]), 3, Some(224));
        let classes: Vec<&str> = s.lines().filter(|l| l.contains("class")).map(|l| l.split_whitespace().nth(1).unwrap_or("")).collect();
        assert_eq!(classes, ["1", "4", "3"], "{s}");
        assert!(s.starts_with("image 0: top-3:"), "{s}");
    }

    #[test]
    fn detections_are_scaled_to_input_pixels() {
        // One image, two detections (x1, y1, x2, y2, score, class) on 4x4 maps of a 16x16 input.
        let det = HostTensor::new(vec![1, 2, 6], vec![1.0, 2.0, 3.0, 4.0, 0.9, 7.0, 0.0, 0.0, 1.0, 1.0, 0.5, 2.0]);
        let hm = HostTensor::zeros(vec![1, 80, 4, 4]);
        let s = summarize(&BTreeMap::from([("detections".to_string(), det), ("hm".to_string(), hm)]), 1, Some(16));
        assert!(s.contains("class  7  score 0.900  box (4.0, 8.0) - (12.0, 16.0)"), "{s}");
        assert!(!s.contains("class 2"), "only the top 1 is shown:\n{s}");
        assert!(s.contains("hm: [1, 80, 4, 4]"), "{s}");
    }

    #[test]
    fn random_inputs_are_reproducible_by_seed() {
        let (a, b) = (kiln::dev::uniform_tensor(&[1, 3, 2, 2], 5), kiln::dev::uniform_tensor(&[1, 3, 2, 2], 5));
        assert_eq!(a, b);
        assert_ne!(a, kiln::dev::uniform_tensor(&[1, 3, 2, 2], 6));
        assert!(a.data.iter().all(|v| (-1.0..1.0).contains(v)));
    }
}
