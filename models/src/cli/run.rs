//! `kiln run` (the README's main job) and `kiln build`.

use super::common::{self, ms, precision_name};
use super::{BuildArgs, RunArgs};
use kiln::engine::gpu_available;
use kiln::{Error, Result};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

pub fn run(a: RunArgs) -> Result<ExitCode> {
    let (input, origin) = match &a.input {
        Some(path) => {
            let x = common::read_input(path)?;
            let (n, s) = common::input_dims(&x, path)?;
            let disagree = |flag: &str, given: usize, have: usize| Error::Flag {
                flag: flag.into(),
                reason: format!(
                    "{given} disagrees with --input {}, whose shape {:?} decides it ({have}); drop {flag}",
                    path.display(),
                    x.shape
                ),
            };
            match (a.batch, a.model.size) {
                (Some(b), _) if b != n => return Err(disagree("--batch", b, n)),
                (_, Some(size)) if size != s => return Err(disagree("--size", size, s)),
                _ => {}
            }
            let origin = format!("input from {}", path.display());
            (Some(x), origin)
        }
        None => (None, String::new()),
    };
    let (batch, size) = match &input {
        Some(x) => (x.shape[0], Some(x.shape[2])),
        None => (a.batch.unwrap_or(1), a.model.size),
    };
    let mut model = a.model.clone();
    model.size = size;
    let traced = common::trace_args(&model, batch)?;
    let gpu_reason = if a.cpu { Err("--cpu was given".to_string()) } else { gpu_available() };
    if gpu_reason.is_err() {
        common::check_cpu_memory(&traced.graph, batch, traced.size)?;
    }
    let (input, origin) = match input {
        Some(x) => (x, origin),
        None => {
            let seed = a.seed.unwrap_or_else(kiln::seeded::fresh_seed);
            (common::random_input(&[batch, 3, traced.size, traced.size], seed)?, format!("random input, --seed {seed}"))
        }
    };
    let weights = a.model.weights.as_ref().map_or("seeded weights".to_string(), |p| format!("weights {}", p.display()));
    say!("{}: batch {batch}, {}x{}, {weights}, {origin}", traced.name, traced.size, traced.size);

    let (outputs, backend, elapsed) = match gpu_reason {
        Ok(()) => {
            let gpu = common::gpu()?;
            let config = a.engine.config(batch, batch, batch);
            let precision = precision_name(config.precision);
            let engine = Arc::new(common::build_engine(&traced.graph, config, gpu, &traced.name)?);
            say!("engine: {} layers, built in {:.2} s", engine.summary.layers, engine.summary.build_seconds);
            let mut ctx = engine.context()?;
            // The first run captures the CUDA graph; the time shown is of the second.
            ctx.run(&[("input", &input)])?;
            let t = Instant::now();
            let out = ctx.run(&[("input", &input)])?;
            (out, format!("GPU engine ({precision})"), t.elapsed())
        }
        Err(reason) => {
            if !a.cpu {
                say!("note: no GPU ({reason}); running on the CPU reference executor instead");
            }
            let optimized = kiln::passes::optimize(&traced.graph)?;
            let t = Instant::now();
            let out = kiln::cpu::run(&optimized, &[("input", &input)])?;
            (out, "CPU executor (f32)".to_string(), t.elapsed())
        }
    };
    say_raw!("{}", common::summarize(&outputs, a.top, traced.size));
    let secs = elapsed.as_secs_f64();
    say!("{backend}: {} for batch {batch} ({:.1} images/s)", ms(secs * 1e3), batch as f64 / secs.max(1e-12));
    Ok(ExitCode::SUCCESS)
}

pub fn build(a: BuildArgs) -> Result<ExitCode> {
    let gpu = common::gpu()?;
    let opt = a.opt_batch.unwrap_or(a.max_batch);
    let config = a.engine.config(a.min_batch, opt, a.max_batch);
    let traced = common::trace_args(&a.model, opt)?;
    let nodes = traced.graph.nodes.iter().filter(|n| !matches!(n.op, kiln::Op::Weight { .. } | kiln::Op::Input { .. })).count();
    say!("{}: traced {nodes} ops at {}x{}", traced.name, traced.size, traced.size);
    let engine = common::build_engine(&traced.graph, config, gpu, &traced.name)?;
    engine.save(&a.output)?;
    let c = &engine.config;
    say!(
        "wrote {}: {}, batch {}..={} (timed at {}), {}",
        a.output.display(),
        precision_name(c.precision),
        c.min_batch,
        c.max_batch,
        c.opt_batch,
        engine.gpu().info.name
    );
    say_raw!("{}", engine.summary);
    if a.verbose {
        for (problem, candidates) in &engine.summary.tactic_log {
            let list: Vec<String> = candidates.iter().map(|(kind, t)| format!("{kind} {t:.3} ms")).collect();
            say!("  timed {problem}: {}", list.join(", "));
        }
    }
    Ok(ExitCode::SUCCESS)
}
