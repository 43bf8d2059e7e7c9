//! Loading the model a command names: tracing a bundled or user model with its weights (a
//! `--weights` file, `digits_resnet`'s built-in trained weights or the seeded generator), reading a
//! graph or engine file, or putting a bundled model behind its entry stage (`--frames`).

use super::dims::{check_graph_inputs, check_input_dims, check_shapes, graph_hw, requested};
use super::inputs::{graph_inputs, inputs_text};
use super::source::{source, Source};
use crate::ModelArgs;
use kiln::{Error, Graph, Result, VarBuilder};
use std::path::Path;

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

/// `digits_resnet`'s trained weights (`kiln_models::DIGITS_WEIGHTS`, built into the binary, so
/// `kiln` finds them wherever it runs), the default of that model.
const DIGITS_TRAINED: &[u8] = include_bytes!("../../../models/weights/digits_resnet.safetensors");

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
    let traced = load_checked(&m.model, m.weights.as_deref(), m.strict, batch, hw, m.shapes.as_ref())?;
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

/// The `-v` line of a model traced since `start`.
fn traced_event(model: &str, graph: &Graph, start: std::time::Instant) {
    let ops = graph.nodes.iter().filter(|n| !n.op.is_leaf()).count();
    let weights = graph.weights.len();
    tracing::debug!(model, ops, weights, ms = start.elapsed().as_secs_f64() * 1e3, "trace: graph recorded");
}

/// `trace_args` from the parts of the flags.
pub fn load(model: &str, weights_path: Option<&Path>, strict: bool, batch: usize, hw: Option<[usize; 2]>) -> Result<Traced> {
    load_checked(model, weights_path, strict, batch, hw, None)
}

/// `load`, with a graph or engine file's `--shapes` checked against its traced inputs before its
/// shapes are re-inferred at the flag's H x W (so that a channels-last `x:1x224x224x3` gets the
/// NCHW shape meant, not a re-inference at 224x3).
fn load_checked(
    model: &str,
    weights_path: Option<&Path>,
    strict: bool,
    batch: usize,
    hw: Option<[usize; 2]>,
    shapes: Option<&crate::Shapes>,
) -> Result<Traced> {
    // Graph and engine files hold a graph traced at one size: another H x W re-infers every
    // shape (an op that fixed a size makes that a typed error naming it). An engine runs it only
    // inside one of its profiles; that is checked when it runs.
    let fixed = |graph: Graph, name: String, model: String, origin: &'static str, weights: String, seeded: bool| -> Result<Traced> {
        let graph = match (hw, graph_hw(&graph)) {
            (Some([h, w]), Some(have)) if [h, w] != have => {
                check_shapes(shapes, &graph_inputs(&graph), &name)?;
                // The image input (the graph's first, whatever its name: kiln-torch names it
                // after `forward`'s argument).
                let c = graph.inputs.first().map_or(3, |&i| graph.nodes[i].shape[1]);
                let input = graph.input_names().first().map_or("input", |n| n).to_string();
                let dims = kiln::engine::InputDims::from([(input, vec![c, h, w])]);
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
            // `kiln trace` and kiln-torch record the weights they traced with.
            let (weights, seeded) = match weights_path {
                Some(w) => (w.display().to_string(), false),
                None => ("graph file".to_string(), kiln::files::graph::has_random_weights(&file.metadata)),
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
            let start = std::time::Instant::now();
            let graph = kiln_models::trace_hw(info.name, vb.clone(), batch, hw)?;
            traced_event(info.name, &graph, start);
            (info.name.to_string(), graph, vb, "bundled", (label, seeded))
        }
        Source::User(name, f) => {
            if let Some(hw) = hw {
                check_input_dims(batch, hw)?;
            }
            let (vb, label, seeded) = weights(weights_path, "")?;
            let start = std::time::Instant::now();
            let graph = f(vb.clone(), batch, hw)?;
            traced_event(&name, &graph, start);
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
