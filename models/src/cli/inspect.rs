//! `kiln inspect` (graphs as text and Graphviz DOT, engine layers) and `kiln codegen`.

use super::common::{self, precision_name};
use super::{CodegenArgs, InspectArgs};
use kiln::codegen::{generate, CodegenOptions};
use kiln::{Error, Result};
use std::process::ExitCode;

pub fn inspect(a: InspectArgs) -> Result<ExitCode> {
    let traced = common::trace_args(&a.model, a.batch)?;
    let optimized = kiln::passes::optimize(&traced.graph)?;
    println!("== traced graph: {} (batch {}, {}x{}) ==", traced.name, a.batch, traced.size, traced.size);
    print!("{}", kiln::dot::to_text(&traced.graph));
    println!();
    println!("== optimised graph (BatchNorm folded, conv+bias+add+ReLU fused, dead nodes removed) ==");
    print!("{}", kiln::dot::to_text(&optimized));
    let fused = optimized.nodes.iter().filter(|n| kiln::dot::is_fused(n)).count();
    println!("{fused} fused convolutions");
    for (path, graph, title) in [(&a.dot, &traced.graph, "traced"), (&a.dot_optimized, &optimized, "optimised")] {
        if let Some(path) = path {
            let dot = kiln::dot::to_dot(graph, &format!("{} ({title})", traced.name));
            std::fs::write(path, dot).map_err(Error::io(path))?;
            println!("wrote {} ({title} graph; render with `dot -Tsvg {} -o graph.svg`)", path.display(), path.display());
        }
    }
    println!();
    if a.no_engine {
        return Ok(ExitCode::SUCCESS);
    }
    match kiln::engine::gpu_available() {
        Ok(()) => {
            let config = a.engine.config(a.batch, a.batch, a.batch);
            let precision = precision_name(config.precision);
            let engine = common::build_engine(&traced.graph, config, common::gpu()?, &traced.name)?;
            println!("== engine layers ({precision}, batch {}) ==", a.batch);
            print!("{}", engine.describe());
            print!("{}", engine.summary);
        }
        Err(reason) => println!("engine layers: not shown, no GPU ({reason})"),
    }
    Ok(ExitCode::SUCCESS)
}

pub fn codegen(a: CodegenArgs) -> Result<ExitCode> {
    let traced = common::trace_args(&a.model, 1)?;
    let mut command = format!("kiln codegen {}", traced.name);
    if a.model.size.is_some() {
        command += &format!(" --size {}", traced.size);
    }
    if a.max_width != 100 {
        command += &format!(" --max-width {}", a.max_width);
    }
    if a.small_heuristics_max {
        command += " --small-heuristics-max";
    }
    let opts = CodegenOptions {
        fn_name: a.fn_name.clone(),
        model: traced.name.clone(),
        max_width: a.max_width,
        small_heuristics_max: a.small_heuristics_max,
        command,
    };
    let src = generate(&traced.graph, &opts)?;
    match &a.output {
        Some(path) if path.as_os_str() != "-" => {
            std::fs::write(path, &src).map_err(Error::io(path))?;
            let ops = traced.graph.nodes.iter().filter(|n| !matches!(n.op, kiln::Op::Weight { .. } | kiln::Op::Input { .. })).count();
            eprintln!(
                "wrote {} ({ops} ops, {} lines): `{}(vb, batch)` rebuilds {}",
                path.display(),
                src.lines().count(),
                a.fn_name,
                traced.name
            );
        }
        _ => print!("{src}"),
    }
    Ok(ExitCode::SUCCESS)
}
