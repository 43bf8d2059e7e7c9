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
        // 8-bit engines are compared with FP32 PyTorch: quantisation error, not a bug, dominates.
        Precision::Int8 | Precision::Fp8 | Precision::Best => 1e-1,
    }
}

pub fn compare(a: CompareArgs) -> Result<ExitCode> {
    if !a.cpu {
        // Fail before reading a large reference when the engine cannot be built anyway.
        kiln::engine::gpu_available().map_err(|r| Error::NoGpu(format!("{r}; pass --cpu to compare the CPU executor")))?;
    }
    if let Some(rtol) = a.rtol.filter(|r| !r.is_finite() || *r < 0.0) {
        return Err(Error::Flag { flag: "--rtol".into(), reason: format!("must be a finite, non-negative tolerance, got {rtol}") });
    }
    // Only `input`, `output.*` and `intermediate.*` are the reference; anything else is left alone.
    let is_reference = |k: &str| k == "input" || k.starts_with("output.") || k.starts_with("intermediate.");
    let (reference, ignored) = kiln::var_builder::read_tensors(&a.reference, "reference", is_reference)?;
    if let Some(first) = ignored.first() {
        eprintln!(
            "note: {} tensor(s) of {} are not `input`, `output.*` or `intermediate.*` and were ignored (e.g. `{first}`)",
            ignored.len(),
            a.reference.display()
        );
    }
    let x = reference.get("input").ok_or_else(|| Error::Safetensors {
        path: a.reference.clone(),
        reason: "holds no tensor named `input` (write references with tools/export_reference.py)".into(),
    })?;
    let (batch, size) = common::input_dims(x, &a.reference)?;
    let mut model = a.model.clone();
    model.size = Some(size);
    let traced = common::trace_args(&model, batch)?;
    if a.cpu {
        common::check_cpu_memory(&traced.graph, batch, size)?;
    }
    let rtol = a.rtol.unwrap_or_else(|| default_rtol(&a));
    let backend = if a.cpu { "CPU executor".to_string() } else { format!("GPU engine ({})", precision_name(a.engine.precision())) };
    say!("{} on {backend} against {} (batch {batch}, {size}x{size}), rtol {rtol:.1e}", traced.name, a.reference.display());

    if a.layerwise {
        let report = kiln::layerwise::run(&traced.graph, &reference, rtol, |g, input| execute(g, input, &a))?;
        if report.layers.is_empty() {
            return Err(Error::Safetensors {
                path: a.reference.clone(),
                reason: "holds no `intermediate.<module path>` tensors matching the model; export with --intermediates all".into(),
            });
        }
        say!("{report}");
        return Ok(if report.passes() { ExitCode::SUCCESS } else { ExitCode::FAILURE });
    }

    // The CPU executor runs the optimised graph, as the engine does.
    let graph = if a.cpu { kiln::passes::optimize(&traced.graph)? } else { traced.graph.clone() };
    let outputs = execute(&graph, x, &a)?;
    let mut all_pass = true;
    let mut compared = 0;
    for (name, got) in &outputs {
        let Some(r) = reference.get(&format!("output.{name}")) else {
            say!("{name}: no `output.{name}` in the reference, not compared");
            continue;
        };
        let c = kiln::compare::compare(name, got, r);
        let pass = c.passes(rtol);
        all_pass &= pass;
        compared += 1;
        say!("{c}  {}", if pass { "pass" } else { "FAIL" });
        if name == "detections" && c.shape_ok {
            let (matched, total) = matching_detections(got, r);
            say!("  {matched} of {total} reference detections found with the same class and centre (within half a map cell)");
        }
        if name == "logits" && c.shape_ok {
            let (ours, theirs) = (kiln::compare::top1(got), kiln::compare::top1(r));
            let same = ours.iter().zip(&theirs).filter(|(a, b)| a == b).count();
            say!("  top-1 class agrees on {same} of {} images", theirs.len());
        }
    }
    if compared == 0 {
        return Err(Error::Safetensors {
            path: a.reference.clone(),
            reason: "holds no `output.<name>` tensor for any output of the model".into(),
        });
    }
    say!("{}", if all_pass { "PASS" } else { "FAIL" });
    Ok(if all_pass { ExitCode::SUCCESS } else { ExitCode::FAILURE })
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
}
