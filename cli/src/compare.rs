//! `kiln compare`: outputs (and with `--layerwise`, every intermediate) against a PyTorch reference
//! or outputs saved by an earlier run (Polygraphy's `--save-outputs`/`--load-outputs`): relative
//! L2 per output, and with `--atol`/`--rtol` Polygraphy's elementwise rule; a JSON report.

use super::common::{self, InputData, Traced};
use super::CompareArgs;
use kiln::engine::Precision;
use kiln::{Error, Graph, HostInput, HostTensor, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

/// Runs `graph` on `inputs` (by name) on the CPU executor or through an engine built for exactly
/// their batch.
fn execute(graph: &Graph, inputs: &[(&str, HostInput<'_>)], batch: usize, a: &CompareArgs) -> Result<BTreeMap<String, HostTensor>> {
    if a.cpu {
        if !a.layerwise {
            return kiln::run_cpu(graph, inputs);
        }
        // Every intermediate is kept: a long run, shown op by op.
        let bar = common::progress_bar(0, "comparing layer by layer (CPU executor)");
        let out = kiln::dev::run_with_progress(graph, inputs, |done, total, path| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(path.to_string());
        });
        bar.finish_and_clear();
        return out;
    }
    let gpu = common::gpu()?;
    let engine = if common::is_engine_file(&a.model.model) {
        common::engine_for(&a.model.model, None, None, &a.engine, (batch, batch, batch), gpu)?.1
    } else {
        common::build_engine(graph, a.engine.config(batch, batch, batch), gpu, &a.model.model)?
    };
    let mut ctx = Arc::new(engine).context()?;
    ctx.run(inputs)
}

fn default_l2_tol(a: &CompareArgs) -> f64 {
    let precision = a.engine.precision();
    // The CPU executor in f32 computes what PyTorch does; its simulation of an 8-bit engine, what
    // the engine does.
    if a.cpu && precision.quant_format().is_none() {
        return 1e-5;
    }
    match precision {
        Precision::Fp32 => 1e-4,
        Precision::Tf32 => 2e-3,
        Precision::Fp16 => 1e-2,
        // 8-bit engines are compared with FP32 PyTorch: quantisation error, not a bug, dominates.
        Precision::Int8 | Precision::Fp8 | Precision::Best => 1e-1,
    }
}

fn check_tolerance(flag: &str, v: Option<f64>) -> Result<()> {
    match v.filter(|r| !r.is_finite() || *r < 0.0) {
        Some(v) => Err(Error::Flag { flag: flag.into(), reason: format!("must be a finite, non-negative tolerance, got {v}") }),
        None => Ok(()),
    }
}

/// Polygraphy's elementwise check: how many elements break |got - ref| <= atol + rtol * |ref|, and
/// the worst one (flat index, got, ref). Non-finite values always break it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Elementwise {
    pub atol: f64,
    pub rtol: f64,
    pub failing: usize,
    pub total: usize,
    /// The element with the largest |got - ref| - (atol + rtol * |ref|): (flat index, got, ref).
    pub worst: Option<(usize, f32, f32)>,
}

pub fn elementwise(got: &HostTensor, reference: &HostTensor, atol: f64, rtol: f64) -> Elementwise {
    let (mut failing, mut worst, mut worst_excess) = (0, None, f64::NEG_INFINITY);
    for (i, (&g, &r)) in got.data.iter().zip(&reference.data).enumerate() {
        let excess = (g as f64 - r as f64).abs() - (atol + rtol * (r as f64).abs());
        let bad = excess.is_nan() || excess > 0.0;
        if bad {
            failing += 1;
        }
        if bad && (excess > worst_excess || (excess.is_nan() && worst.is_none())) {
            worst_excess = excess;
            worst = Some((i, g, r));
        }
    }
    Elementwise { atol, rtol, failing, total: got.data.len().min(reference.data.len()), worst }
}

/// One output's line of the JSON report.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct OutputReport {
    pub name: String,
    pub shape: Vec<usize>,
    pub shape_ok: bool,
    pub rel_l2: f64,
    pub max_abs: f64,
    pub elementwise: Option<Elementwise>,
    pub pass: bool,
}

/// `--report`'s JSON.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct Report {
    pub model: String,
    pub backend: String,
    pub reference: Option<String>,
    pub input_shape: Vec<usize>,
    pub l2_tol: f64,
    pub outputs: Vec<OutputReport>,
    /// Where the reference's metadata disagrees with this run (model, weights, input).
    pub hints: Vec<String>,
    pub pass: bool,
}

/// SHA-256 of a file, hex (tools/export_reference.py writes the same of the weights it saves).
pub fn sha256_file(path: &Path) -> Result<String> {
    let bytes = kiln::files::read_regular(path, "a file", |reason| Error::Safetensors { path: path.into(), reason })?;
    Ok(Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect())
}

/// The inputs' shapes as metadata holds them: `2x3x224x224` for one input, `x:2x16,y:2x4` for several.
fn inputs_shape_text(inputs: &[(String, InputData)]) -> String {
    match inputs {
        [(_, only)] => super::shapes::dims_text(only.shape()),
        more => more.iter().map(|(n, d)| format!("{n}:{}", super::shapes::dims_text(d.shape()))).collect::<Vec<_>>().join(","),
    }
}

/// The metadata a reference or saved-outputs file carries: what produced it.
pub fn run_metadata(
    traced: &Traced,
    a: &CompareArgs,
    inputs: &[(String, InputData)],
    seed: Option<u64>,
    backend: &str,
) -> Result<BTreeMap<String, String>> {
    let mut m = BTreeMap::from([
        ("model".to_string(), traced.model.clone()),
        ("input_shape".to_string(), inputs_shape_text(inputs)),
        ("backend".to_string(), backend.to_string()),
        ("producer".to_string(), format!("kiln compare {}", env!("CARGO_PKG_VERSION"))),
    ]);
    match &a.model.weights {
        Some(p) => {
            m.insert("weights".into(), p.display().to_string());
            m.insert("weights_sha256".into(), sha256_file(p)?);
        }
        None => {
            m.insert("weights".into(), traced.weights.clone());
        }
    }
    if let Some(seed) = seed {
        m.insert("seed".into(), seed.to_string());
    }
    Ok(m)
}

/// Where a reference's metadata disagrees with this run: each a hint for the reader of a FAIL.
pub fn metadata_hints(
    meta: &BTreeMap<String, String>,
    traced: &Traced,
    a: &CompareArgs,
    inputs: &[(String, InputData)],
) -> Result<Vec<String>> {
    let mut hints = Vec::new();
    if meta.is_empty() {
        return Ok(hints);
    }
    if let Some(model) = meta.get("model").filter(|m| **m != traced.model) {
        hints.push(format!("the reference was made for model `{model}`, this run is `{}`", traced.model));
    }
    match (&a.model.weights, meta.get("weights_sha256")) {
        (Some(p), Some(want)) => {
            let have = sha256_file(p)?;
            if *want != have {
                hints.push(format!(
                    "the reference's weights have SHA-256 {}..., --weights {} has {}...",
                    &want[..want.len().min(12)],
                    p.display(),
                    &have[..12]
                ));
            }
        }
        (None, _) if traced.origin == "bundled" || traced.origin == "user" => {
            if let Some(w) = meta.get("weights").filter(|w| **w != traced.weights) {
                hints.push(format!("the reference used the weights `{w}`, this run the {} weights (pass --weights)", traced.weights));
            }
        }
        _ => {}
    }
    let have = inputs_shape_text(inputs);
    if let Some(shape) = meta.get("input_shape").filter(|s| **s != have) {
        hints.push(format!("the metadata says input {shape}, the file's input is {have}"));
    }
    Ok(hints)
}

/// The inputs of a reference file: `input.<name>` for each (kiln-torch, `--save-outputs`), or one
/// unnamed `input` (older files, tools/export_reference.py), which binds to a one-input model
/// whatever its input is called.
#[derive(Debug)]
enum ReferenceInputs {
    Named(BTreeMap<String, HostTensor>),
    Unnamed(HostTensor),
}

impl ReferenceInputs {
    /// Every input tensor, for the batch and size checks made before the model is loaded.
    fn tensors(&self) -> Vec<&HostTensor> {
        match self {
            ReferenceInputs::Named(m) => m.values().collect(),
            ReferenceInputs::Unnamed(t) => vec![t],
        }
    }

    /// The tensors bound to `traced`'s inputs by name, in its binding order: each input needs its
    /// `input.<name>`, and a name the model lacks is an error too (a reference of another model).
    fn bind(self, traced: &Traced, path: &Path) -> Result<Vec<(String, InputData)>> {
        let names: Vec<String> = traced.graph.input_names().iter().map(|n| n.to_string()).collect();
        let no_such = |name: &str, reason: String| Error::Binding { name: name.into(), reason };
        match self {
            ReferenceInputs::Unnamed(t) => match names.as_slice() {
                [only] => Ok(vec![(only.clone(), InputData::F32(t))]),
                _ => Err(no_such(
                    "input",
                    format!(
                        "{} holds one unnamed `input`; {} has {} inputs {names:?}: store each as `input.<name>`",
                        path.display(),
                        traced.name,
                        names.len()
                    ),
                )),
            },
            ReferenceInputs::Named(mut m) => {
                let held: Vec<String> = m.keys().cloned().collect();
                if let Some(extra) = held.iter().find(|k| !names.contains(k)) {
                    return Err(no_such(
                        extra,
                        format!(
                            "{} holds `input.{extra}`, but {} has no such input (its inputs are {names:?})",
                            path.display(),
                            traced.name
                        ),
                    ));
                }
                names
                    .iter()
                    .map(|n| match m.remove(n) {
                        Some(t) => Ok((n.clone(), InputData::F32(t))),
                        None => Err(no_such(
                            n,
                            format!(
                                "{} holds no `input.{n}` (it holds the inputs {held:?}) for {}'s input `{n}`",
                                path.display(),
                                traced.name
                            ),
                        )),
                    })
                    .collect()
            }
        }
    }
}

/// What a comparison runs against: the reference's tensors (`output.*`, `intermediate.*`) and
/// metadata, its inputs, and the seed that drew them when there is no reference.
struct Against {
    reference: BTreeMap<String, HostTensor>,
    meta: BTreeMap<String, String>,
    inputs: Vec<(String, InputData)>,
    seed: Option<u64>,
}

/// The batch (dim 0, the same for every input) and, for an NCHW first input, H x W of the
/// reference's inputs.
fn reference_dims(inputs: &ReferenceInputs, path: &Path) -> Result<(usize, Option<[usize; 2]>)> {
    let tensors = inputs.tensors();
    let bad = |reason: String| Error::Safetensors { path: path.to_path_buf(), reason };
    let Some(first) = tensors.first() else { return Err(bad("holds no input".into())) };
    let batch = match first.shape.first() {
        Some(&n) if n > 0 => n,
        _ => return Err(bad(format!("holds an input of shape {:?}; expected a batch of at least 1 first", first.shape))),
    };
    if let Some(t) = tensors.iter().find(|t| t.shape.first() != Some(&batch)) {
        return Err(bad(format!("holds inputs of batch {batch} and of shape {:?}: every input needs the same batch", t.shape)));
    }
    let hw = match first.shape.as_slice() {
        &[_, _, h, w] => Some([h, w]),
        _ => None,
    };
    Ok((batch, hw))
}

pub fn compare(a: CompareArgs) -> Result<ExitCode> {
    check_flags(&a)?;
    let (traced, against) = match &a.reference {
        Some(path) => {
            let ReferenceFile { tensors: reference, meta, inputs } = read_reference(path)?;
            let (batch, hw) = reference_dims(&inputs, path)?;
            let traced = match common::load_args(&a.model, batch, hw) {
                Ok(traced) => traced,
                // The first input's H x W may not be the model's because the reference is another
                // model's: then which inputs it lacks is the error to show.
                Err(e) => match hw.and_then(|_| common::load_args(&a.model, batch, None).ok()) {
                    Some(at_own_size) => return Err(inputs.bind(&at_own_size, path).err().unwrap_or(e)),
                    None => return Err(e),
                },
            };
            let inputs = inputs.bind(&traced, path)?;
            check_shapes_against_reference(&a, path, &inputs)?;
            (traced, Against { reference, meta, inputs, seed: None })
        }
        None => random_inputs(&a)?,
    };
    let batch = against.inputs.first().map_or(1, |(_, d)| d.shape()[0]);
    if a.cpu {
        common::check_cpu_memory(&traced.graph, batch, &traced.hw_text())?;
    }
    let l2_tol = a.l2_tol.unwrap_or_else(|| default_l2_tol(&a));
    // On the CPU: the optimised graph in f32, or the simulation of an 8-bit engine, decided (and a
    // precision with no simulation refused) before anything runs.
    let cpu = a.cpu.then(|| a.engine.cpu_graph(&traced.graph)).transpose()?;
    let backend = match &cpu {
        Some((_, backend)) => backend.clone(),
        None => format!("GPU engine ({})", a.engine.precision().short_name()),
    };
    let hints = metadata_hints(&against.meta, &traced, &a, &against.inputs)?;
    for h in &hints {
        tracing::warn!("hint: {h}");
    }
    let shown = a.reference.as_ref().map(|p| p.display().to_string());
    let what = shown.clone().unwrap_or_else(|| format!("nothing (random input, --seed {})", a.seed));
    say!("{} on {backend} against {what} (batch {batch}, {}), l2-tol {l2_tol:.1e}", traced.name, traced.hw_text());
    if a.layerwise {
        return layerwise(&a, &traced, &against, l2_tol);
    }

    // The CPU executor runs the optimised graph, as the engine does.
    let graph = match cpu {
        Some((graph, _)) => graph,
        None => traced.graph.clone(),
    };
    let outputs = execute(&graph, &common::bind(&against.inputs), batch, &a)?;
    if let Some(path) = &a.save_outputs {
        save_outputs(path, &outputs, &run_metadata(&traced, &a, &against.inputs, against.seed, &backend)?, &against.inputs)?;
    }
    let rows = compare_outputs(&a, &outputs, &against.reference, l2_tol)?;
    let pass = rows.iter().all(|r| r.pass);
    if let Some(path) = &a.report {
        let report = Report {
            model: traced.name.clone(),
            backend,
            reference: shown,
            input_shape: against.inputs.first().map(|(_, d)| d.shape().to_vec()).unwrap_or_default(),
            l2_tol,
            outputs: rows.clone(),
            hints: hints.clone(),
            pass,
        };
        write_report(path, &report)?;
    }
    if rows.is_empty() {
        say!("nothing compared (no reference); outputs of the random input, --seed {}:", a.seed);
        say_raw!("{}", common::summarize(&outputs, 5, traced.hw.map(|[_, w]| w)));
        return Ok(ExitCode::SUCCESS);
    }
    if !pass && !hints.is_empty() {
        say!("FAIL (the reference may not match this run: {})", hints.join("; "));
    } else {
        say!("{}", if pass { "PASS" } else { "FAIL" });
    }
    Ok(if pass { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// Checks what can fail before any file is read: a GPU unless `--cpu`, and the tolerances.
fn check_flags(a: &CompareArgs) -> Result<()> {
    if !a.cpu {
        // Fail before reading a large reference when the engine cannot be built anyway.
        kiln::engine::gpu_available().map_err(|r| Error::NoGpu(format!("{r}; pass --cpu to compare the CPU executor")))?;
    }
    check_tolerance("--rtol", a.rtol)?;
    check_tolerance("--atol", a.atol)?;
    check_tolerance("--l2-tol", a.l2_tol)
}

/// With a reference, its inputs decide the shapes: `--shapes` may only repeat them.
fn check_shapes_against_reference(a: &CompareArgs, path: &Path, inputs: &[(String, InputData)]) -> Result<()> {
    let Some(shapes) = &a.model.shapes else { return Ok(()) };
    let text = |dims: &[usize]| super::shapes::dims_text(dims);
    for s in &shapes.0 {
        match inputs.iter().find(|(n, _)| *n == s.name) {
            Some((_, d)) if d.shape() != s.dims.as_slice() => {
                return Err(Error::Flag {
                    flag: "--shapes".into(),
                    reason: format!("{}:{} disagrees with the input of {}, {}", s.name, text(&s.dims), path.display(), text(d.shape())),
                })
            }
            _ => {}
        }
    }
    Ok(())
}

/// A reference file as read: its tensors (`output.*`, `intermediate.*`), metadata and inputs.
struct ReferenceFile {
    tensors: BTreeMap<String, HostTensor>,
    meta: BTreeMap<String, String>,
    inputs: ReferenceInputs,
}

/// A reference or saved-outputs file: only `input`, `input.*`, `output.*` and `intermediate.*`
/// are the reference; anything else is left alone, with a note.
fn read_reference(path: &Path) -> Result<ReferenceFile> {
    // Inputs are bounded as `--input` is, from the header before anything is decoded (a 8.7 GB
    // reference input was decoded, then refused); outputs and intermediates by the readers' own
    // limit on any tensor.
    let limit = |k: &str| match k {
        "input" => Some(common::MAX_INPUT_ELEMENTS),
        _ if k.starts_with("input.") => Some(common::MAX_INPUT_ELEMENTS),
        _ if k.starts_with("output.") || k.starts_with("intermediate.") => Some(usize::MAX),
        _ => None,
    };
    let (mut reference, ignored) = kiln::files::read_tensors_limited(path, "reference", limit)?;
    if let Some(first) = ignored.first() {
        tracing::info!(
            "note: {} tensor(s) of {} are not `input`, `input.*`, `output.*` or `intermediate.*` and were ignored (e.g. `{first}`)",
            ignored.len(),
            path.display()
        );
    }
    let meta = kiln::files::read_metadata(path)?;
    let named: BTreeMap<String, HostTensor> = reference
        .keys()
        .filter_map(|k| k.strip_prefix("input.").map(|n| (k.clone(), n.to_string())))
        .collect::<Vec<_>>()
        .into_iter()
        .filter_map(|(key, name)| reference.remove(&key).map(|t| (name, t)))
        .collect();
    let inputs = match (reference.remove("input"), named.is_empty()) {
        (Some(t), true) => ReferenceInputs::Unnamed(t),
        (None, false) => ReferenceInputs::Named(named),
        (Some(_), false) => {
            return Err(Error::Safetensors {
                path: path.to_path_buf(),
                reason: format!("holds both an unnamed `input` and named inputs {:?}; keep one form", named.keys().collect::<Vec<_>>()),
            })
        }
        (None, true) => {
            return Err(Error::Safetensors {
                path: path.to_path_buf(),
                reason: "holds no input: neither `input.<name>` tensors (kiln-torch --reference, kiln compare --save-outputs) nor `input` (tools/export_reference.py)".into(),
            })
        }
    };
    Ok(ReferenceFile { tensors: reference, meta, inputs })
}

/// No reference: random inputs of `--seed` (for every input of the model, at the batch and size
/// the flags ask for), with the model loaded for them.
fn random_inputs(a: &CompareArgs) -> Result<(Traced, Against)> {
    let (batch, hw) = common::requested(&a.model, a.batch)?;
    let batch = batch.unwrap_or(1);
    let traced = common::load_args(&a.model, batch, hw)?;
    let inputs = common::random_inputs(&common::graph_inputs(&traced.graph), batch, a.seed)?;
    Ok((traced, Against { reference: BTreeMap::new(), meta: BTreeMap::new(), inputs, seed: Some(a.seed) }))
}

/// `--layerwise`: every intermediate of the reference, and the first layer whose error jumps. An
/// INT8/FP8 engine is compared on its own fused, quantised graph (kiln::dev::layerwise::run_quantised).
fn layerwise(a: &CompareArgs, traced: &Traced, against: &Against, l2_tol: f64) -> Result<ExitCode> {
    let (name, input) = match against.inputs.as_slice() {
        [(name, InputData::F32(t))] => (name.as_str(), t),
        _ => {
            return Err(Error::Flag {
                flag: "--layerwise".into(),
                reason: format!("compares a model of one f32 input; {} takes {}", traced.name, traced.hw_text()),
            })
        }
    };
    let mut with_input = against.reference.clone();
    with_input.insert("input".into(), input.clone());
    let precision = a.engine.precision();
    let run = |g: &Graph, input: &HostTensor| execute(g, &[(name, HostInput::F32(input))], input.shape[0], a);
    let report = match precision.quant_format().filter(|_| precision != Precision::Best) {
        Some(format) => {
            let cache = a.engine.calibration_cache.as_deref().map(kiln::engine::CalibrationCache::load).transpose()?;
            kiln::dev::layerwise::run_quantised(&traced.graph, cache.as_ref(), format, &with_input, l2_tol, a.engine.rules(), run)?
        }
        None => kiln::dev::layerwise::run(&traced.graph, &with_input, l2_tol, run)?,
    };
    if report.layers.is_empty() {
        return Err(Error::Safetensors {
            path: a.reference.clone().unwrap_or_default(),
            reason: "holds no `intermediate.<module path>` tensors matching the model; export with --intermediates all".into(),
        });
    }
    say!("{report}");
    Ok(if report.passes() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `--save-outputs`: the inputs (`input.<name>`) and this run's outputs (`output.<name>`) in the
/// reference format, with `meta`. A u8 input is stored as its f32 values, as the model reads it.
fn save_outputs(
    path: &Path,
    outputs: &BTreeMap<String, HostTensor>,
    meta: &BTreeMap<String, String>,
    inputs: &[(String, InputData)],
) -> Result<()> {
    let as_f32: Vec<(String, HostTensor)> = inputs
        .iter()
        .map(|(n, d)| match d {
            InputData::F32(t) => Ok((format!("input.{n}"), t.clone())),
            InputData::U8(b) => {
                Ok((format!("input.{n}"), HostTensor::try_new(b.shape.clone(), b.data.iter().map(|&v| f32::from(v)).collect())?))
            }
        })
        .collect::<Result<_>>()?;
    let mut tensors: BTreeMap<String, &HostTensor> = outputs.iter().map(|(k, v)| (format!("output.{k}"), v)).collect();
    tensors.extend(as_f32.iter().map(|(k, t)| (k.clone(), t)));
    kiln::files::write_safetensors_with_metadata(path, &tensors, meta)?;
    say!("wrote {} ({} input(s) and {} output(s); compare against it with --load-outputs)", path.display(), inputs.len(), outputs.len());
    Ok(())
}

/// Compares every output that has an `output.<name>` in the reference, printing a line each;
/// with a reference, none in common is an error.
fn compare_outputs(
    a: &CompareArgs,
    outputs: &BTreeMap<String, HostTensor>,
    reference: &BTreeMap<String, HostTensor>,
    l2_tol: f64,
) -> Result<Vec<OutputReport>> {
    let elementwise_tol = (a.atol.is_some() || a.rtol.is_some()).then(|| (a.atol.unwrap_or(0.0), a.rtol.unwrap_or(0.0)));
    let mut rows = Vec::new();
    for (name, got) in outputs {
        match reference.get(&format!("output.{name}")) {
            Some(r) => rows.push(compare_output(name, got, r, l2_tol, elementwise_tol)?),
            None if a.reference.is_some() => say!("{name}: no `output.{name}` in the reference, not compared"),
            None => {}
        }
    }
    if rows.is_empty() && a.reference.is_some() {
        return Err(Error::Safetensors {
            path: a.reference.clone().unwrap_or_default(),
            reason: "holds no `output.<name>` tensor for any output of the model".into(),
        });
    }
    Ok(rows)
}

/// One output against its reference: relative L2, Polygraphy's elementwise rule when asked
/// (`(atol, rtol)`), and for detections and logits how many agree; printed and returned.
fn compare_output(name: &str, got: &HostTensor, r: &HostTensor, l2_tol: f64, tol: Option<(f64, f64)>) -> Result<OutputReport> {
    let c = kiln::compare(name, got, r);
    let ew = tol.filter(|_| c.shape_ok).map(|(atol, rtol)| elementwise(got, r, atol, rtol));
    let pass = c.passes(l2_tol) && ew.as_ref().is_none_or(|e| e.failing == 0);
    say!("{c}  {}", if pass { "pass" } else { "FAIL" });
    if let Some(e) = &ew {
        let worst = e.worst.map_or(String::new(), |(i, g, r)| format!("; worst at flat index {i}: {g} vs {r}"));
        say!("  elementwise |out - ref| <= {} + {} * |ref|: {} of {} elements fail{worst}", e.atol, e.rtol, e.failing, e.total);
    }
    if name == "detections" && c.shape_ok {
        let (matched, total) = matching_detections(got, r);
        say!("  {matched} of {total} reference detections found with the same class and centre (within half a map cell)");
    }
    if name == "logits" && c.shape_ok {
        let (ours, theirs) = (kiln::top1(got), kiln::top1(r));
        let same = ours.iter().zip(&theirs).filter(|(a, b)| a == b).count();
        say!("  top-1 class agrees on {same} of {} images", theirs.len());
    }
    Ok(OutputReport {
        name: name.to_string(),
        shape: got.shape.clone(),
        shape_ok: c.shape_ok,
        rel_l2: c.rel_l2,
        max_abs: c.max_abs,
        elementwise: ew,
        pass,
    })
}

/// `--report`: the comparison as JSON.
fn write_report(path: &Path, report: &Report) -> Result<()> {
    let text = serde_json::to_string_pretty(report).map_err(|e| Error::Serialize { what: "the report".into(), reason: e.to_string() })?;
    std::fs::write(path, text + "\n").map_err(Error::io(path))?;
    tracing::info!("wrote {} (the comparison as JSON)", path.display());
    Ok(())
}

/// Decoded detections ([N, k, 6] rows of x1, y1, x2, y2, score, class) of `got` that match one of
/// `reference` each: same class, centres within half a map cell. Near-equal scores may come out in
/// another order (FP16), so rows are matched as sets, not position by position. Returns
/// (matched, reference rows).
pub fn matching_detections(got: &HostTensor, reference: &HostTensor) -> (usize, usize) {
    let rows = |t: &HostTensor| -> Vec<[f32; 6]> { t.data.chunks_exact(6).map(|r| [r[0], r[1], r[2], r[3], r[4], r[5]]).collect() };
    let k = reference.shape.get(1).copied().unwrap_or(0).max(1);
    let (ours, theirs) = (rows(got), rows(reference));
    let centre = |r: &[f32; 6]| ((r[0] + r[2]) / 2.0, (r[1] + r[3]) / 2.0);
    let mut matched = 0;
    for (image, want) in theirs.chunks(k).enumerate() {
        let mut free: Vec<&[f32; 6]> = ours.chunks(k).nth(image).map(|c| c.iter().collect()).unwrap_or_default();
        for w in want {
            let (wx, wy) = centre(w);
            let hit = free.iter().position(|g| {
                let (gx, gy) = centre(g);
                g[5] == w[5] && (gx - wx).abs() <= 0.5 && (gy - wy).abs() <= 0.5
            });
            if let Some(i) = hit {
                free.swap_remove(i);
                matched += 1;
            }
        }
    }
    (matched, theirs.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detections_match_as_sets_by_class_and_centre() {
        let reference = HostTensor::new(vec![1, 3, 6], vec![0., 0., 2., 2., 0.9, 1., 4., 4., 6., 6., 0.8, 2., 8., 8., 9., 9., 0.7, 3.]);
        // Swapped order, a small shift, a wrong class on the third.
        let got = HostTensor::new(vec![1, 3, 6], vec![4.2, 4., 6.2, 6., 0.8, 2., 0., 0., 2., 2., 0.9, 1., 8., 8., 9., 9., 0.7, 4.]);
        assert_eq!(matching_detections(&got, &reference), (2, 3));
        assert_eq!(matching_detections(&reference, &reference), (3, 3));
    }

    #[test]
    fn elementwise_follows_polygraphys_rule() {
        let reference = HostTensor::new(vec![4], vec![1.0, -2.0, 100.0, 0.0]);
        let got = HostTensor::new(vec![4], vec![1.05, -2.0, 101.0, 0.02]);
        // |d| = 0.05, 0, 1, 0.02; bounds with atol 0.03, rtol 0.01: 0.04, 0.05, 1.03, 0.03.
        let e = elementwise(&got, &reference, 0.03, 0.01);
        assert_eq!((e.failing, e.total), (1, 4));
        assert_eq!(e.worst.map(|w| w.0), Some(0));
        assert_eq!(elementwise(&got, &reference, 0.1, 0.0).failing, 1, "|d| = 1 at 100 fails without rtol");
        let nan = HostTensor::new(vec![4], vec![f32::NAN, -2.0, 100.0, 0.0]);
        assert_eq!(elementwise(&nan, &reference, 1.0, 1.0).failing, 1, "NaN always fails");
    }
}
