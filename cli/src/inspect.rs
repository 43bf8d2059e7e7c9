//! `kiln inspect` (graphs as text and Graphviz DOT, engine layers) and `kiln codegen`.

use super::common;
use super::{CodegenArgs, InspectArgs};
use kiln::dev::codegen::{generate, generate_structured, CodegenOptions};
use kiln::{Error, Result};
use std::process::ExitCode;

pub fn inspect(a: InspectArgs) -> Result<ExitCode> {
    let batch = common::requested(&a.model, a.batch)?.0.unwrap_or(1);
    let traced = common::trace_args(&a.model, Some(batch))?;
    let optimized = kiln::engine::optimize(&traced.graph)?;
    say!("== traced graph: {} (batch {batch}, {}) ==", traced.name, traced.hw_text());
    say_raw!("{}", kiln::dev::dot::to_text(&traced.graph));
    say!("");
    say!("== optimised graph (BatchNorm folded, conv+bias+add+ReLU(+max-pool) fused, dead nodes removed) ==");
    say_raw!("{}", kiln::dev::dot::to_text(&optimized));
    let fused = optimized.nodes.iter().filter(|n| kiln::dev::dot::is_fused(n)).count();
    say!("{fused} fused convolutions");
    let copies = kiln::dev::plan::layout_copies(&optimized)?;
    say!(
        "{} layout copies planned (a value read in another layout than it is stored in){}",
        copies.len(),
        if copies.is_empty() { "" } else { ":" }
    );
    for (reader, value) in &copies {
        say!("  {reader} <- {value}");
    }
    for (path, graph, title) in [(&a.dot, &traced.graph, "traced"), (&a.dot_optimized, &optimized, "optimised")] {
        if let Some(path) = path {
            let dot = kiln::dev::dot::to_dot(graph, &format!("{} ({title})", traced.name));
            std::fs::write(path, dot).map_err(Error::io(path))?;
            say!("wrote {} ({title} graph; render with `dot -Tsvg {} -o graph.svg`)", path.display(), path.display());
        }
    }
    say!("");
    if a.no_engine {
        return Ok(ExitCode::SUCCESS);
    }
    match kiln::engine::gpu_available() {
        Ok(()) => {
            let config = a.engine.config(batch, batch, batch);
            let precision = config.precision.short_name();
            let engine = common::build_engine(&traced.graph, config, common::gpu()?, &traced.name)?;
            say!("== engine layers ({precision}, batch {batch}) ==");
            say_raw!("{}", engine.describe());
            say_raw!("{}", engine.summary);
        }
        Err(reason) => say!("engine layers: not shown, no GPU ({reason})"),
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether `name` can name a Rust function: an identifier that is not a keyword.
fn is_rust_identifier(name: &str) -> bool {
    const KEYWORDS: &[&str] = &[
        "as", "async", "await", "break", "const", "continue", "crate", "dyn", "else", "enum", "extern", "false", "fn", "for", "gen", "if",
        "impl", "in", "let", "loop", "match", "mod", "move", "mut", "pub", "ref", "return", "self", "Self", "static", "struct", "super",
        "trait", "true", "type", "unsafe", "use", "where", "while", "abstract", "become", "box", "do", "final", "macro", "override",
        "priv", "typeof", "unsized", "virtual", "yield", "try", "_",
    ];
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c == '_' || c.is_ascii_alphabetic());
    first_ok && chars.all(|c| c == '_' || c.is_ascii_alphanumeric()) && !KEYWORDS.contains(&name)
}

pub fn codegen(a: CodegenArgs) -> Result<ExitCode> {
    if !is_rust_identifier(&a.fn_name) {
        return Err(Error::Flag {
            flag: "--fn-name".into(),
            reason: format!("must be a Rust identifier (letters, digits and `_`, not a keyword), got {:?}", a.fn_name),
        });
    }
    // The generated function takes the batch as an argument: the batch traced at does not matter.
    let traced = common::trace_args(&a.model, None)?;
    let mut command = format!("kiln codegen {}", traced.name);
    match (&a.model.shapes, traced.hw) {
        (Some(shapes), _) => {
            let specs: Vec<String> = shapes.0.iter().map(|s| format!("{}:{}", s.name, super::shapes::dims_text(&s.dims))).collect();
            command += &format!(" --shapes {}", specs.join(","));
        }
        (None, Some([h, _])) if a.model.size.is_some() => command += &format!(" --size {h}"),
        _ => {}
    }
    if a.max_width != 100 {
        command += &format!(" --max-width {}", a.max_width);
    }
    if a.small_heuristics_max {
        command += " --small-heuristics-max";
    }
    if a.flat {
        command += " --flat";
    }
    let opts = CodegenOptions {
        fn_name: a.fn_name.clone(),
        model: traced.name.clone(),
        max_width: a.max_width,
        small_heuristics_max: a.small_heuristics_max,
        command,
    };
    // Structured codegen needs the module classes a kiln-torch export records.
    let flat = a.flat || traced.graph.modules.is_empty();
    if flat && !a.flat {
        tracing::info!(
            "note: {} records no module classes (a graph traced in Rust, not exported by kiln-torch): writing the flat op list, as --flat does",
            traced.name
        );
    }
    let src = if flat { generate(&traced.graph, &opts)? } else { generate_structured(&traced.graph, &opts)? };
    match &a.output {
        Some(path) if path.as_os_str() != "-" => {
            std::fs::write(path, &src).map_err(Error::io(path))?;
            let ops = traced
                .graph
                .nodes
                .iter()
                .filter(|n| !matches!(n.op, kiln::plugin::Op::Weight { .. } | kiln::plugin::Op::Input { .. }))
                .count();
            tracing::info!(
                "wrote {} ({ops} ops, {} lines): `{}(vb, batch)` rebuilds {}",
                path.display(),
                src.lines().count(),
                a.fn_name,
                traced.name
            );
        }
        _ => say_raw!("{src}"),
    }
    Ok(ExitCode::SUCCESS)
}
