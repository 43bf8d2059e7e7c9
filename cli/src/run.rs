//! `kiln run` (the README's main job), `kiln trace` and `kiln build`.

use super::common::{self, ms, InputData, Traced};
use super::images;
use super::shapes::{self, Profile};
use super::{BuildArgs, RunArgs, TraceArgs};
use kiln::engine::{gpu_available, DimsRange, ShapeProfile};
use kiln::{DType, Error, HostInput, HostTensor, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub fn run(a: RunArgs) -> Result<ExitCode> {
    let (batch_flag, hw_flag) = common::requested(&a.model, a.batch)?;
    let given = a.input.as_deref().map(|path| GivenInput::read(path, &a, batch_flag, hw_flag)).transpose()?;
    let (batch, hw) = match &given {
        Some(g) => (g.batch(), g.hw()),
        None if !a.image.is_empty() => (images_batch(a.image.len(), batch_flag)?, hw_flag),
        None => (batch_flag.unwrap_or(1), hw_flag),
    };
    let traced = common::load_args(&a.model, batch, hw)?;
    let gpu_reason = if a.cpu { Err("--cpu was given".to_string()) } else { gpu_available() };
    if gpu_reason.is_err() {
        common::check_cpu_memory(&traced.graph, batch, &traced.hw_text())?;
    }
    let mut photos = None;
    let (inputs, origin) = match given {
        Some(g) => {
            let origin = format!("input from {}", g.path.display());
            (vec![g.bind(&traced)?], origin)
        }
        None if !a.image.is_empty() => {
            let prep = images::Preprocess::of(&traced, "--image")?;
            let truncated = if a.accept_truncated_images { kiln_vision::Truncated::Accept } else { kiln_vision::Truncated::Refuse };
            let (x, loaded) = images::batch(&prep, &a.image, truncated)?;
            let name = traced.graph.input_names().first().map_or("input".to_string(), |n| n.to_string());
            let origin = format!("{} image(s) ({:?} preprocessing)", loaded.len(), prep.family);
            photos = Some((prep, loaded));
            (vec![(name, InputData::F32(x))], origin)
        }
        None => {
            let seed = a.seed.unwrap_or_else(kiln::dev::fresh_seed);
            let what = if traced.graph.inputs.len() == 1 { "input" } else { "inputs" };
            (common::random_inputs(&common::graph_inputs(&traced.graph), batch, seed)?, format!("random {what}, --seed {seed}"))
        }
    };
    if a.save.is_some() && photos.as_ref().is_some_and(|(p, _)| p.family == images::Family::Classifier) {
        return Err(Error::Flag { flag: "--save".into(), reason: format!("draws a detector's boxes; {} is a classifier", traced.name) });
    }
    if let Some(dir) = a.save.as_ref().filter(|p| p.is_dir()) {
        return Err(Error::Flag {
            flag: "--save".into(),
            reason: format!(
                "{} is a directory; give the path of the PNG file to write (e.g. {})",
                dir.display(),
                dir.join("boxes.png").display()
            ),
        });
    }
    let bound = common::bind(&inputs);
    let weights = match (&a.model.weights, traced.origin) {
        (Some(p), _) => format!("weights {}", p.display()),
        (None, "graph file" | "engine file") => format!("{}'s weights", traced.origin),
        (None, _) if traced.seeded => "seeded weights".to_string(),
        (None, _) => traced.weights.clone(),
    };
    // On the CPU, what runs (f32, or the simulation of an 8-bit engine) is decided, and a
    // precision it cannot run refused, before anything runs; the header names it.
    let cpu = gpu_reason.is_err().then(|| a.engine.cpu_graph(&traced.graph)).transpose()?;
    let on = cpu.as_ref().map(|(_, backend)| format!(", on the {backend}")).unwrap_or_default();
    say!("{}: batch {batch}, {}, {weights}, {origin}{on}", traced.name, traced.hw_text());
    if traced.seeded {
        say!(
            "random weights: {}'s answers below are meaningless; --weights FILE (safetensors or PyTorch .pth) loads trained ones",
            traced.name
        );
    }
    let (outputs, backend, elapsed) = match cpu {
        None => run_on_gpu(&a, &traced, &bound, batch)?,
        Some((graph, backend)) => {
            if let (Err(reason), false) = (&gpu_reason, a.cpu) {
                tracing::info!("note: no GPU ({reason}); running on the CPU reference executor instead");
            }
            let t = Instant::now();
            let out = kiln::run_cpu(&graph, &bound)?;
            (out, backend, t.elapsed())
        }
    };
    match &photos {
        Some((prep, loaded)) => {
            say_raw!("{}", images::report(prep, &traced.model, loaded, &outputs, a.top)?);
            if let Some(path) = &a.save {
                for written in images::save(prep, &outputs, loaded, path)? {
                    say!("wrote {} (boxes with score >= {})", written.display(), images::MIN_SCORE);
                }
            }
        }
        None => say_raw!("{}", common::summarize(&outputs, a.top, traced.hw.map(|[_, w]| w))),
    }
    let secs = elapsed.as_secs_f64();
    say!("{backend}: {} for batch {batch} ({:.1} images/s)", ms(secs * 1e3), batch as f64 / secs.max(1e-12));
    Ok(ExitCode::SUCCESS)
}

/// The batch of `--image`: one per file; `--batch` or `--shapes`, if given, must agree.
fn images_batch(images: usize, flag: Option<usize>) -> Result<usize> {
    match flag {
        Some(b) if b != images => Err(Error::Flag {
            flag: "--batch".into(),
            reason: format!("{b} disagrees with the {images} --image file(s), which make the batch; drop --batch"),
        }),
        _ => Ok(images),
    }
}

/// The outputs of one engine run (the second: the first captures the CUDA graph), the backend's
/// name and the time taken.
fn run_on_gpu(
    a: &RunArgs,
    traced: &Traced,
    bound: &[(&str, HostInput<'_>)],
    batch: usize,
) -> Result<(BTreeMap<String, HostTensor>, String, Duration)> {
    let gpu = common::gpu()?;
    let engine = if traced.origin == "engine file" {
        common::engine_for(&a.model.model, None, None, &a.engine, (batch, batch, batch), gpu)?.1
    } else {
        common::build_engine(&traced.graph, a.engine.config(batch, batch, batch), gpu, &traced.name)?
    };
    let precision = engine.config.precision.short_name();
    let engine = Arc::new(engine);
    say!("engine: {} layers, built in {:.2} s", engine.summary.layers, engine.summary.build_seconds);
    let mut ctx = engine.context()?;
    ctx.run(bound)?;
    let t = Instant::now();
    let out = ctx.run(bound)?;
    Ok((out, format!("GPU engine ({precision})"), t.elapsed()))
}

/// `--input`'s tensor, read before the model is loaded: its shape decides the batch (its first
/// dim) and, for a 4-D tensor, the NCHW image's H x W.
struct GivenInput {
    path: PathBuf,
    key: String,
    data: InputData,
}

impl GivenInput {
    /// Reads the file and checks it against `--batch`, `--size` and `--shapes` (which must agree).
    fn read(path: &Path, a: &RunArgs, batch_flag: Option<usize>, hw_flag: Option<[usize; 2]>) -> Result<Self> {
        let (key, data) = common::read_input_data(path)?;
        let given = GivenInput { path: path.to_path_buf(), key, data };
        let shape = given.data.shape().to_vec();
        if shape.len() < 2 || shape[0] == 0 {
            return Err(Error::Binding {
                name: "input".into(),
                reason: format!("{} holds shape {shape:?}; expected a batch of at least 1 and then the model's input dims", path.display()),
            });
        }
        let disagree = |flag: &str, given: String, have: String| Error::Flag {
            flag: flag.into(),
            reason: format!("{given} disagrees with --input {}, whose shape {shape:?} decides it ({have}); drop {flag}", path.display()),
        };
        let hw_text = |[h, w]: [usize; 2]| if h == w { h.to_string() } else { format!("{h}x{w}") };
        match (batch_flag, hw_flag) {
            (Some(b), _) if b != given.batch() => Err(disagree("--batch", b.to_string(), given.batch().to_string())),
            (_, Some(want)) if Some(want) != given.hw() => {
                let have = given.hw().map_or("no H x W: it is not an NCHW image".to_string(), hw_text);
                Err(disagree(if a.model.shapes.is_some() { "--shapes" } else { "--size" }, hw_text(want), have))
            }
            _ => Ok(given),
        }
    }

    fn batch(&self) -> usize {
        self.data.shape()[0]
    }

    /// H x W of a 4-D (NCHW) tensor.
    fn hw(&self) -> Option<[usize; 2]> {
        match self.data.shape() {
            &[_, _, h, w] => Some([h, w]),
            _ => None,
        }
    }

    /// The tensor as the model's first input, once its type and its per-image dims (channels
    /// included) are checked against that input's.
    fn bind(self, traced: &Traced) -> Result<(String, InputData)> {
        let input = common::graph_inputs(&traced.graph)
            .into_iter()
            .next()
            .ok_or_else(|| Error::Binding { name: "input".into(), reason: format!("{} has no input to take --input", traced.name) })?;
        if matches!(self.data, InputData::U8(_)) && input.dtype != DType::U8 {
            // Bytes for an f32 input: the file's values are not what the model reads.
            return Err(Error::TensorDtype { what: "input".into(), key: self.key, got: "U8".into(), path: self.path });
        }
        let shape = self.data.shape();
        if shape[1..] != input.dims[..] {
            return Err(Error::Binding {
                name: input.name.clone(),
                reason: format!(
                    "--input {} holds shape {shape:?}; {}'s input `{}` takes [N, {}]",
                    self.path.display(),
                    traced.name,
                    input.name,
                    input.dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
                ),
            });
        }
        Ok((input.name, self.data))
    }
}

/// `kiln trace`: the model's graph and weights as one graph file, with metadata saying what it is.
pub fn trace(a: TraceArgs) -> Result<ExitCode> {
    let traced = common::trace_args(&a.model, a.batch)?;
    let weights = traced.weights.clone();
    // Every input's full shape (`2x3x224x224`), comma-separated where there are several.
    let input_shape = traced.graph.inputs.iter().map(|&i| shapes::dims_text(&traced.graph.nodes[i].shape)).collect::<Vec<_>>().join(",");
    let mut meta = BTreeMap::from([
        ("model".to_string(), traced.name.clone()),
        ("weights".to_string(), weights),
        ("input_shape".to_string(), input_shape.clone()),
        ("kiln.tool".to_string(), format!("kiln trace {}", env!("CARGO_PKG_VERSION"))),
    ]);
    if traced.seeded {
        meta.insert(kiln::files::graph::KEY_RANDOM_WEIGHTS.to_string(), "true".to_string());
    }
    kiln::files::graph::write(&traced.graph, &a.output, &meta)?;
    let ops = traced.graph.nodes.iter().filter(|n| !n.op.is_leaf()).count();
    say!("wrote {}: {} ({ops} ops, {} weights, input {})", a.output.display(), traced.name, traced.graph.weights.len(), input_shape);
    Ok(ExitCode::SUCCESS)
}

/// The shapes `kiln build` makes an engine for: the batch range from --min/--opt/--max-batch, or
/// trtexec's --minShapes/--optShapes/--maxShapes (not both), whose H and W may range too (an
/// optimization profile; C must stay the model's). Returns the batch range, the profile over
/// H and W when they range, and the H x W to trace at (opt).
fn shape_range(a: &BuildArgs) -> Result<(Profile, Option<ShapeProfile>, Option<[usize; 2]>)> {
    let spec = |s: &Option<super::Shapes>| s.as_ref().map(|s| s.0.clone()).unwrap_or_default();
    let fixed = a.model.shapes.as_ref().map(|s| s.0.clone()).unwrap_or_default();
    let profiles = shapes::profiles(&fixed, &spec(&a.min_shapes), &spec(&a.opt_shapes), &spec(&a.max_shapes))?;
    if let Some((name, p)) = profiles.iter().next() {
        if profiles.len() > 1 || name != "input" {
            return Err(Error::Flag {
                flag: "--minShapes".into(),
                reason: format!("names {:?}; the model has one input, `input`", profiles.keys().collect::<Vec<_>>()),
            });
        }
        if a.min_batch.or(a.opt_batch).or(a.max_batch).is_some() {
            return Err(Error::Flag {
                flag: "--min-batch".into(),
                reason: "and the shape flags both give the batch range; give one".into(),
            });
        }
        if p.min.len() != 4 || p.min[1] != p.max[1] {
            return Err(Error::Flag {
                flag: "--minShapes".into(),
                reason: format!(
                    "input `input`: {} ..= {}: give NxCxHxW with the same C in min, opt and max",
                    shapes::dims_text(&p.min),
                    shapes::dims_text(&p.max)
                ),
            });
        }
        let spatial =
            (p.min[2..] != p.max[2..]).then(|| ShapeProfile::from([(name.clone(), DimsRange::new(&p.min[1..], &p.opt[1..], &p.max[1..]))]));
        return Ok((p.clone(), spatial, Some([p.opt[2], p.opt[3]])));
    }
    let max = a.max_batch.unwrap_or(1);
    let min = a.min_batch.unwrap_or(1);
    let opt = a.opt_batch.unwrap_or(max);
    check_batch_range(min, opt, max)?;
    Ok((Profile { min: vec![min], opt: vec![opt], max: vec![max] }, None, None))
}

/// `--min-batch`, `--opt-batch` and `--max-batch` (or their defaults): at least 1, and
/// min <= opt <= max, checked before anything looks for a GPU or traces.
fn check_batch_range(min: usize, opt: usize, max: usize) -> Result<()> {
    let flag = |flag: &str, reason: String| Err(Error::Flag { flag: flag.into(), reason });
    if let Some((name, _)) = [("--min-batch", min), ("--max-batch", max), ("--opt-batch", opt)].into_iter().find(|&(_, b)| b == 0) {
        return flag(name, "must be at least 1".into());
    }
    if min > max {
        return flag("--min-batch", format!("{min} is more than --max-batch {max}"));
    }
    if !(min..=max).contains(&opt) {
        return flag("--opt-batch", format!("{opt} must lie within --min-batch {min} and --max-batch {max}"));
    }
    Ok(())
}

pub fn build(a: BuildArgs, verbose: bool) -> Result<ExitCode> {
    let (profile, spatial, hw) = shape_range(&a)?;
    let (min, opt, max) = profile.batch();
    let hw = hw.or(common::requested(&a.model, None)?.1);
    let mut config = a.engine.config(min, opt, max);
    if let Some(spatial) = spatial {
        config = config.profile(spatial);
    }
    let traced = common::load_args(&a.model, opt, hw)?;
    let nodes = traced.graph.nodes.iter().filter(|n| !n.op.is_leaf()).count();
    say!("{}: traced {nodes} ops at {}", traced.name, traced.hw_text());
    // The 8-bit graph is made before the GPU is needed: missing scales, or Q/DQ nodes the
    // builder refuses, are reported on any machine.
    if let Some(format) = config.precision.quant_format() {
        let (graph, source) = a.engine.eight_bit_graph(kiln::engine::optimize(&traced.graph)?, format)?;
        let on_grid = graph.nodes.iter().filter(|n| matches!(&n.op, kiln::plugin::Op::Weight { quant: Some(_), .. })).count();
        say!("{}: {} engine, scales from {source}, {on_grid} weights on their 8-bit grid", traced.name, format.name().to_uppercase());
    }
    let gpu = common::gpu()?;
    let engine = common::build_engine(&traced.graph, config, gpu, &traced.name)?;
    engine.save(&a.output)?;
    let c = &engine.config;
    say!(
        "wrote {}: {}, batch {}..={} (timed at {}), {}",
        a.output.display(),
        c.precision.short_name(),
        c.min_batch,
        c.max_batch,
        c.opt_batch,
        engine.gpu().info.name
    );
    say_raw!("{}", engine.summary);
    for plan in engine.plans() {
        let dims: Vec<String> = plan.dims.iter().map(|(n, d)| format!("{n} {}", shapes::dims_text(d))).collect();
        say!("  plan {}: arena {:.1} MiB", dims.join(", "), plan.memory.arena as f64 / (1 << 20) as f64);
    }
    if verbose {
        for (problem, candidates) in &engine.summary.tactic_log {
            let list: Vec<String> = candidates.iter().map(|(kind, t)| format!("{kind} {t:.3} ms")).collect();
            say!("  timed {problem}: {}", list.join(", "));
        }
    }
    Ok(ExitCode::SUCCESS)
}
