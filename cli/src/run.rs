//! `kiln run` (the README's main job), `kiln trace` and `kiln build`.

use super::common::{self, ms, InputData};
use super::shapes::{self, Profile};
use super::{BuildArgs, RunArgs, TraceArgs};
use kiln::engine::{gpu_available, DimsRange, ShapeProfile};
use kiln::{Error, Result};
use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

pub fn run(a: RunArgs) -> Result<ExitCode> {
    let (batch_flag, hw_flag) = common::requested(&a.model, a.batch)?;
    let (input, origin) = match &a.input {
        Some(path) => {
            let x = common::read_input(path)?;
            let (n, hw) = common::input_dims(&x, path)?;
            let disagree = |flag: &str, given: String, have: String| Error::Flag {
                flag: flag.into(),
                reason: format!(
                    "{given} disagrees with --input {}, whose shape {:?} decides it ({have}); drop {flag}",
                    path.display(),
                    x.shape
                ),
            };
            match (batch_flag, hw_flag) {
                (Some(b), _) if b != n => return Err(disagree("--batch", b.to_string(), n.to_string())),
                (_, Some(want)) if want != hw => {
                    let given = if want[0] == want[1] { want[0].to_string() } else { format!("{}x{}", want[0], want[1]) };
                    let have = if hw[0] == hw[1] { hw[0].to_string() } else { format!("{}x{}", hw[0], hw[1]) };
                    return Err(disagree(if a.model.shapes.is_some() { "--shapes" } else { "--size" }, given, have));
                }
                _ => {}
            }
            let origin = format!("input from {}", path.display());
            (Some(x), origin)
        }
        None => (None, String::new()),
    };
    let (batch, hw) = match &input {
        Some(x) => (x.shape[0], Some([x.shape[2], x.shape[3]])),
        None => (batch_flag.unwrap_or(1), hw_flag),
    };
    let traced = common::load(&a.model.model, a.model.weights.as_deref(), a.model.strict, batch, hw)?;
    let gpu_reason = if a.cpu { Err("--cpu was given".to_string()) } else { gpu_available() };
    if gpu_reason.is_err() {
        common::check_cpu_memory(&traced.graph, batch, &traced.hw_text())?;
    }
    let (inputs, origin) = match input {
        // The file's image is the model's NCHW input (checked against it above).
        Some(x) => {
            let name = traced.graph.input_names().first().map_or("input".to_string(), |n| n.to_string());
            (vec![(name, InputData::F32(x))], origin)
        }
        None => {
            let seed = a.seed.unwrap_or_else(kiln::seeded::fresh_seed);
            let what = if traced.graph.inputs.len() == 1 { "input" } else { "inputs" };
            (common::random_inputs(&common::graph_inputs(&traced.graph), batch, seed)?, format!("random {what}, --seed {seed}"))
        }
    };
    let bound = common::bind(&inputs);
    let weights = a.model.weights.as_ref().map_or(
        if traced.origin == "bundled" || traced.origin == "user" {
            "seeded weights".to_string()
        } else {
            format!("{}'s weights", traced.origin)
        },
        |p| format!("weights {}", p.display()),
    );
    say!("{}: batch {batch}, {}, {weights}, {origin}", traced.name, traced.hw_text());

    let (outputs, backend, elapsed) = match gpu_reason {
        Ok(()) => {
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
            // The first run captures the CUDA graph; the time shown is of the second.
            ctx.run(&bound)?;
            let t = Instant::now();
            let out = ctx.run(&bound)?;
            (out, format!("GPU engine ({precision})"), t.elapsed())
        }
        Err(reason) => {
            if !a.cpu {
                tracing::info!("note: no GPU ({reason}); running on the CPU reference executor instead");
            }
            let optimized = kiln::passes::optimize(&traced.graph)?;
            let t = Instant::now();
            let out = kiln::cpu::run(&optimized, &bound)?;
            (out, "CPU executor (f32)".to_string(), t.elapsed())
        }
    };
    say_raw!("{}", common::summarize(&outputs, a.top, traced.hw.map(|[_, w]| w)));
    let secs = elapsed.as_secs_f64();
    say!("{backend}: {} for batch {batch} ({:.1} images/s)", ms(secs * 1e3), batch as f64 / secs.max(1e-12));
    Ok(ExitCode::SUCCESS)
}

/// `kiln trace`: the model's graph and weights as one graph file, with metadata saying what it is.
pub fn trace(a: TraceArgs) -> Result<ExitCode> {
    let (batch, _) = common::requested(&a.model, Some(a.batch))?;
    let batch = batch.unwrap_or(a.batch);
    let traced = common::trace_args(&a.model, batch)?;
    let weights = a.model.weights.as_ref().map_or(
        if traced.origin == "bundled" || traced.origin == "user" { "seeded".to_string() } else { traced.origin.to_string() },
        |p| p.display().to_string(),
    );
    // Every input's full shape (`2x3x224x224`), comma-separated where there are several.
    let input_shape = traced.graph.inputs.iter().map(|&i| shapes::dims_text(&traced.graph.nodes[i].shape)).collect::<Vec<_>>().join(",");
    let meta = BTreeMap::from([
        ("model".to_string(), traced.name.clone()),
        ("weights".to_string(), weights),
        ("input_shape".to_string(), input_shape.clone()),
        ("kiln.tool".to_string(), format!("kiln trace {}", env!("CARGO_PKG_VERSION"))),
    ]);
    kiln::graph_file::write(&traced.graph, &a.output, &meta)?;
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
    Ok((Profile { min: vec![min], opt: vec![opt], max: vec![max] }, None, None))
}

pub fn build(a: BuildArgs, verbose: bool) -> Result<ExitCode> {
    let (profile, spatial, hw) = shape_range(&a)?;
    let (min, opt, max) = profile.batch();
    let gpu = common::gpu()?;
    let mut config = a.engine.config(min, opt, max);
    if let Some(spatial) = spatial {
        config = config.profile(spatial);
    }
    let hw = hw.or(common::requested(&a.model, None)?.1);
    let traced = common::load(&a.model.model, a.model.weights.as_deref(), a.model.strict, opt, hw)?;
    let nodes = traced.graph.nodes.iter().filter(|n| !n.op.is_leaf()).count();
    say!("{}: traced {nodes} ops at {}", traced.name, traced.hw_text());
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
