//! `kiln compare`: outputs (and with `--layerwise`, every intermediate) against a PyTorch reference
//! or outputs saved by an earlier run (Polygraphy's `--save-outputs`/`--load-outputs`): relative
//! L2 per output, and with `--atol`/`--rtol` Polygraphy's elementwise rule; a JSON report.

use super::common::{self, Traced};
use super::CompareArgs;
use kiln::engine::Precision;
use kiln::{Error, Graph, HostTensor, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

/// Runs `graph` on `x` on the CPU executor or through an engine built for exactly its batch.
fn execute(graph: &Graph, x: &HostTensor, a: &CompareArgs) -> Result<BTreeMap<String, HostTensor>> {
    if a.cpu {
        if !a.layerwise {
            return kiln::run_cpu(graph, &[("input", x)]);
        }
        // Every intermediate is kept: a long run, shown op by op.
        let bar = common::progress_bar(0, "comparing layer by layer (CPU executor)");
        let out = kiln::dev::run_with_progress(graph, &[("input", x)], |done, total, path| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(path.to_string());
        });
        bar.finish_and_clear();
        return out;
    }
    let gpu = common::gpu()?;
    let batch = x.shape[0];
    let engine = if common::is_engine_file(&a.model.model) {
        common::engine_for(&a.model.model, None, None, &a.engine, (batch, batch, batch), gpu)?.1
    } else {
        common::build_engine(graph, a.engine.config(batch, batch, batch), gpu, &a.model.model)?
    };
    let mut ctx = Arc::new(engine).context()?;
    ctx.run(&[("input", x)])
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

/// The metadata a reference or saved-outputs file carries: what produced it.
pub fn run_metadata(
    traced: &Traced,
    a: &CompareArgs,
    input: &HostTensor,
    seed: Option<u64>,
    backend: &str,
) -> Result<BTreeMap<String, String>> {
    let mut m = BTreeMap::from([
        ("model".to_string(), traced.model.clone()),
        ("input_shape".to_string(), super::shapes::dims_text(&input.shape)),
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
pub fn metadata_hints(meta: &BTreeMap<String, String>, traced: &Traced, a: &CompareArgs, input: &HostTensor) -> Result<Vec<String>> {
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
    if let Some(shape) = meta.get("input_shape").filter(|s| **s != super::shapes::dims_text(&input.shape)) {
        hints.push(format!("the metadata says input {shape}, the file's `input` is {}", super::shapes::dims_text(&input.shape)));
    }
    Ok(hints)
}

/// What a comparison runs against: the reference's tensors (`output.*`, `intermediate.*`) and
/// metadata, the input, and the seed that drew it when there is no reference.
struct Against {
    reference: BTreeMap<String, HostTensor>,
    meta: BTreeMap<String, String>,
    input: HostTensor,
    seed: Option<u64>,
}

pub fn compare(a: CompareArgs) -> Result<ExitCode> {
    check_flags(&a)?;
    let against = match &a.reference {
        Some(path) => read_reference(path)?,
        None => random_input(&a)?,
    };
    let x = &against.input;
    let (batch, hw) = common::input_dims(x, a.reference.as_deref().unwrap_or(Path::new("the random input")))?;
    check_shapes_against_reference(&a, x)?;
    let traced = common::load_args(&a.model, batch, Some(hw))?;
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
    let hints = metadata_hints(&against.meta, &traced, &a, x)?;
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
    let outputs = execute(&graph, x, &a)?;
    if let Some(path) = &a.save_outputs {
        save_outputs(path, &outputs, &run_metadata(&traced, &a, x, against.seed, &backend)?, x)?;
    }
    let rows = compare_outputs(&a, &outputs, &against.reference, l2_tol)?;
    let pass = rows.iter().all(|r| r.pass);
    if let Some(path) = &a.report {
        let report = Report {
            model: traced.name.clone(),
            backend,
            reference: shown,
            input_shape: x.shape.clone(),
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

/// With a reference, its input decides the shape: `--shapes` may only repeat it.
fn check_shapes_against_reference(a: &CompareArgs, x: &HostTensor) -> Result<()> {
    let (Some(path), Some(shapes)) = (&a.reference, &a.model.shapes) else { return Ok(()) };
    let text = |dims: &[usize]| super::shapes::dims_text(dims);
    match shapes.0.iter().find(|s| s.dims != x.shape) {
        Some(s) => Err(Error::Flag {
            flag: "--shapes".into(),
            reason: format!("{}:{} disagrees with the input of {}, {}", s.name, text(&s.dims), path.display(), text(&x.shape)),
        }),
        None => Ok(()),
    }
}

/// A reference or saved-outputs file: only `input`, `output.*` and `intermediate.*` are the
/// reference; anything else is left alone, with a note.
fn read_reference(path: &Path) -> Result<Against> {
    let is_reference = |k: &str| k == "input" || k.starts_with("output.") || k.starts_with("intermediate.");
    let (mut reference, ignored) = kiln::files::read_tensors(path, "reference", is_reference)?;
    if let Some(first) = ignored.first() {
        tracing::info!(
            "note: {} tensor(s) of {} are not `input`, `output.*` or `intermediate.*` and were ignored (e.g. `{first}`)",
            ignored.len(),
            path.display()
        );
    }
    let meta = kiln::files::read_metadata(path)?;
    let input = reference.remove("input").ok_or_else(|| Error::Safetensors {
        path: path.to_path_buf(),
        reason: "holds no tensor named `input` (write references with tools/export_reference.py)".into(),
    })?;
    Ok(Against { reference, meta, input, seed: None })
}

/// No reference: a random NCHW input of `--seed` at the batch and size the flags ask for.
fn random_input(a: &CompareArgs) -> Result<Against> {
    let (batch, hw) = common::requested(&a.model, a.batch)?;
    let batch = batch.unwrap_or(1);
    let probe = common::load_args(&a.model, batch, hw)?;
    let [h, w] = probe.nchw_hw("kiln compare")?;
    let channels = probe.graph.inputs.first().map_or(3, |&i| probe.graph.nodes[i].shape[1]);
    let input = common::random_input(&[batch, channels, h, w], a.seed)?;
    Ok(Against { reference: BTreeMap::new(), meta: BTreeMap::new(), input, seed: Some(a.seed) })
}

/// `--layerwise`: every intermediate of the reference, and the first layer whose error jumps. An
/// INT8/FP8 engine is compared on its own fused, quantised graph (kiln::dev::layerwise::run_quantised).
fn layerwise(a: &CompareArgs, traced: &Traced, against: &Against, l2_tol: f64) -> Result<ExitCode> {
    let mut with_input = against.reference.clone();
    with_input.insert("input".into(), against.input.clone());
    let precision = a.engine.precision();
    let run = |g: &Graph, input: &HostTensor| execute(g, input, a);
    let report = match precision.quant_format().filter(|_| precision != Precision::Best) {
        Some(format) => {
            let cache = a.engine.calibration_cache.as_deref().map(kiln::engine::CalibrationCache::load).transpose()?;
            kiln::dev::layerwise::run_quantised(&traced.graph, cache.as_ref(), format, &with_input, l2_tol, run)?
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

/// `--save-outputs`: the input and this run's outputs in the reference format, with `meta`.
fn save_outputs(path: &Path, outputs: &BTreeMap<String, HostTensor>, meta: &BTreeMap<String, String>, x: &HostTensor) -> Result<()> {
    let mut tensors: BTreeMap<String, &HostTensor> = outputs.iter().map(|(k, v)| (format!("output.{k}"), v)).collect();
    tensors.insert("input".into(), x);
    kiln::files::write_safetensors_with_metadata(path, &tensors, meta)?;
    say!("wrote {} (input and {} output(s); compare against it with --load-outputs)", path.display(), outputs.len());
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
