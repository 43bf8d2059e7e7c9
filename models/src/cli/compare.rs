//! `kiln compare`: outputs (and with `--layerwise`, every intermediate) against a PyTorch reference.

use super::common::{self, precision_name};
use super::CompareArgs;
use kiln::engine::Precision;
use kiln::{Error, Graph, HostTensor, Result};
use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;

/// Runs `graph` on `x` on the CPU executor or through an engine built for exactly its batch.
fn execute(graph: &Graph, x: &HostTensor, a: &CompareArgs) -> Result<BTreeMap<String, HostTensor>> {
    if a.cpu {
        return kiln::cpu::run(graph, &[("input", x)]);
    }
    let gpu = common::gpu()?;
    let batch = x.shape[0];
    let engine = Arc::new(common::build_engine(graph, a.engine.config(batch, batch, batch), gpu, &a.model.model)?);
    let mut ctx = engine.context()?;
    ctx.run(&[("input", x)])
}

fn default_rtol(a: &CompareArgs) -> f64 {
    if a.cpu {
        return 1e-5;
    }
    match a.engine.precision() {
        Precision::Fp32 => 1e-4,
        Precision::Tf32 => 2e-3,
        Precision::Fp16 => 1e-2,
    }
}

pub fn compare(a: CompareArgs) -> Result<ExitCode> {
    if !a.cpu {
        // Fail before reading a large reference when the engine cannot be built anyway.
        kiln::engine::gpu_available().map_err(|r| Error::NoGpu(format!("{r}; pass --cpu to compare the CPU executor")))?;
    }
    let reference = kiln::var_builder::read_safetensors(&a.reference)?;
    let x = reference.get("input").ok_or_else(|| Error::Safetensors {
        path: a.reference.clone(),
        reason: "holds no tensor named `input` (write references with tools/export_reference.py)".into(),
    })?;
    let (batch, size) = common::input_dims(x, &a.reference)?;
    let mut model = a.model.clone();
    model.size = Some(size);
    let traced = common::trace_args(&model, batch)?;
    let rtol = a.rtol.unwrap_or_else(|| default_rtol(&a));
    let backend = if a.cpu { "CPU executor".to_string() } else { format!("GPU engine ({})", precision_name(a.engine.precision())) };
    println!("{} on {backend} against {} (batch {batch}, {size}x{size}), rtol {rtol:.1e}", traced.name, a.reference.display());

    if a.layerwise {
        let report = kiln::layerwise::run(&traced.graph, &reference, rtol, |g, input| execute(g, input, &a))?;
        if report.layers.is_empty() {
            return Err(Error::Safetensors {
                path: a.reference.clone(),
                reason: "holds no `intermediate.<module path>` tensors matching the model; export with --intermediates all".into(),
            });
        }
        println!("{report}");
        return Ok(if report.passes() { ExitCode::SUCCESS } else { ExitCode::FAILURE });
    }

    // The CPU executor runs the optimised graph, as the engine does.
    let graph = if a.cpu { kiln::passes::optimize(&traced.graph)? } else { traced.graph.clone() };
    let outputs = execute(&graph, x, &a)?;
    let mut all_pass = true;
    let mut compared = 0;
    for (name, got) in &outputs {
        let Some(r) = reference.get(&format!("output.{name}")) else {
            println!("{name}: no `output.{name}` in the reference, not compared");
            continue;
        };
        let c = kiln::compare::compare(name, got, r);
        let pass = c.passes(rtol);
        all_pass &= pass;
        compared += 1;
        println!("{c}  {}", if pass { "pass" } else { "FAIL" });
        if name == "logits" && c.shape_ok {
            let (ours, theirs) = (kiln::compare::top1(got), kiln::compare::top1(r));
            let same = ours.iter().zip(&theirs).filter(|(a, b)| a == b).count();
            println!("  top-1 class agrees on {same} of {} images", theirs.len());
        }
    }
    if compared == 0 {
        return Err(Error::Safetensors {
            path: a.reference.clone(),
            reason: "holds no `output.<name>` tensor for any output of the model".into(),
        });
    }
    println!("{}", if all_pass { "PASS" } else { "FAIL" });
    Ok(if all_pass { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
