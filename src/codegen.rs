//! Rust source from a traced graph: one `Tensor::record` statement per node, weights read by their
//! `state_dict` names through a `VarBuilder`, so a user can read and edit exactly what will be built
//! (as people write TensorRT networks by hand with its layer API).
//!
//! The output is laid out the way rustfmt lays it out for the given `max_width` and heuristics
//! (default, or `use_small_heuristics = "Max"`), so it stays clean under `cargo fmt`. Re-tracing the generated
//! function gives back the same graph: same nodes in the same order, attributes, shapes and paths.
//!
//! Generate from the *traced* graph, not an optimised one: passes create weights (folded
//! BatchNorm) that no `state_dict` holds.

use crate::graph::{Activation, ConvAttrs, Graph, Op, PoolAttrs};
use crate::{Error, Result};
use std::collections::{BTreeSet, HashSet};

/// What to generate.
#[derive(Clone, Debug)]
pub struct CodegenOptions {
    /// The generated function's name.
    pub fn_name: String,
    /// The model's name, for the file's doc comment.
    pub model: String,
    /// The line width to lay out for (rustfmt's `max_width`; Kiln's own rustfmt.toml uses 140).
    pub max_width: usize,
    /// Lay out as rustfmt with `use_small_heuristics = "Max"` (as Kiln's own rustfmt.toml).
    pub small_heuristics_max: bool,
    /// The command that produced the file, quoted in its doc comment.
    pub command: String,
}

impl Default for CodegenOptions {
    fn default() -> Self {
        Self { fn_name: "build".into(), model: "model".into(), max_width: 100, small_heuristics_max: false, command: "kiln codegen".into() }
    }
}

/// A piece of an expression that can be laid out flat or broken over lines.
#[derive(Clone, Debug)]
enum Doc {
    Atom(String),
    /// `head(args...)tail`, e.g. `Tensor::record(...)?`.
    Call {
        head: String,
        args: Vec<Doc>,
        tail: String,
    },
    /// `head[items...]`, e.g. `&[...]`.
    Array {
        head: String,
        items: Vec<Doc>,
    },
    /// `Name { field: value, ..base }`.
    Struct {
        name: String,
        fields: Vec<(String, String)>,
        base: Option<String>,
    },
}

impl Doc {
    fn flat(&self) -> String {
        match self {
            Doc::Atom(s) => s.clone(),
            Doc::Call { head, args, tail } => format!("{head}({}){tail}", args.iter().map(Doc::flat).collect::<Vec<_>>().join(", ")),
            Doc::Array { head, items } => format!("{head}[{}]", items.iter().map(Doc::flat).collect::<Vec<_>>().join(", ")),
            Doc::Struct { name, fields, base } => {
                let mut parts: Vec<String> = fields.iter().map(|(k, v)| format!("{k}: {v}")).collect();
                parts.extend(base.iter().map(|b| format!("..{b}")));
                if parts.is_empty() {
                    format!("{name} {{}}")
                } else {
                    format!("{name} {{ {} }}", parts.join(", "))
                }
            }
        }
    }

    /// Whether rustfmt would keep this doc on one line under `style`'s width heuristics (the whole
    /// line's width is checked by the caller).
    fn may_be_flat(&self, style: &Style) -> bool {
        let joined = |docs: &[Doc]| docs.iter().map(|d| d.flat().len()).sum::<usize>() + 2 * docs.len().saturating_sub(1);
        // rustfmt "overflows" a list's only item when it is itself delimited (a call, an array, a
        // struct): the list's width heuristic does not apply, only the line width.
        let lone_delimited = |docs: &[Doc]| docs.len() == 1 && docs[0].is_delimited();
        match self {
            Doc::Atom(_) => true,
            Doc::Call { args, .. } => (lone_delimited(args) || joined(args) <= style.fn_call) && args.iter().all(|a| a.may_be_flat(style)),
            Doc::Array { items, .. } => {
                (lone_delimited(items) || joined(items) <= style.array) && items.iter().all(|a| a.may_be_flat(style))
            }
            Doc::Struct { name, .. } => self.flat().len() - name.len() - 4 <= style.struct_lit,
        }
    }

    /// Ends in a closing delimiter (`f(x)`, `&[..]`, `S { .. }`, `g(y)?`).
    fn is_delimited(&self) -> bool {
        match self {
            Doc::Atom(s) => s.trim_end_matches('?').ends_with([')', ']', '}']),
            _ => true,
        }
    }

    /// Lays the doc out starting at column `col` of a line indented by `indent`, with `after`
    /// characters that must still follow it on its last line (`;`, `,`, `)`).
    fn layout(&self, indent: usize, col: usize, after: usize, style: &Style) -> String {
        let flat = self.flat();
        if col + flat.len() + after <= style.width && self.may_be_flat(style) {
            return flat;
        }
        let pad = " ".repeat(indent + 4);
        let close = " ".repeat(indent);
        let vertical =
            |docs: &[Doc]| -> String { docs.iter().map(|a| format!("{pad}{},\n", a.layout(indent + 4, indent + 4, 1, style))).collect() };
        match self {
            Doc::Atom(s) => s.clone(),
            // rustfmt lets a call's only argument, if it is delimited, continue on the call's line.
            Doc::Call { head, args, tail }
                if args.len() == 1 && matches!(args[0], Doc::Call { .. } | Doc::Array { .. } | Doc::Struct { .. }) =>
            {
                let inner = args[0].layout(indent, col + head.len() + 1, after + 1 + tail.len(), style);
                format!("{head}({inner}){tail}")
            }
            Doc::Call { head, args, tail } => format!("{head}(\n{}{close}){tail}", vertical(args)),
            Doc::Array { head, items } => format!("{head}[\n{}{close}]", vertical(items)),
            Doc::Struct { name, fields, base } => {
                let mut lines: Vec<String> = fields.iter().map(|(k, v)| format!("{pad}{k}: {v},\n")).collect();
                lines.extend(base.iter().map(|b| format!("{pad}..{b}\n")));
                format!("{name} {{\n{}{close}}}", lines.concat())
            }
        }
    }
}

/// rustfmt's line width and width heuristics (`use_small_heuristics`).
#[derive(Clone, Copy, Debug)]
struct Style {
    width: usize,
    fn_call: usize,
    struct_lit: usize,
    array: usize,
}

impl Style {
    fn new(width: usize, max_heuristics: bool) -> Self {
        if max_heuristics {
            return Self { width, fn_call: width, struct_lit: width, array: width };
        }
        // rustfmt's defaults for max_width = 100, scaled to the width.
        let scaled = |w: usize| (w as f64 * width as f64 / 100.0).round() as usize;
        Self { width, fn_call: scaled(60), struct_lit: scaled(18), array: scaled(60) }
    }
}

/// `let name = expr;` as rustfmt writes it: on one line if it fits, else the expression alone on
/// the next line if it fits there, else the expression broken up.
fn let_statement(name: &str, expr: &Doc, indent: usize, style: &Style) -> String {
    let pad = " ".repeat(indent);
    let head = format!("let {name} = ");
    let flat = expr.flat();
    let semicolon = ";".len();
    if indent + head.len() + flat.len() + semicolon <= style.width && expr.may_be_flat(style) {
        return format!("{pad}{head}{flat};\n");
    }
    if indent + 4 + flat.len() + semicolon <= style.width && expr.may_be_flat(style) {
        return format!("{pad}let {name} =\n{pad}    {flat};\n");
    }
    format!("{pad}{head}{};\n", expr.layout(indent, indent + head.len(), 1, style))
}

fn array_lit(v: &[usize]) -> String {
    format!("[{}]", v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", "))
}

fn float_lit(v: f64) -> String {
    if v.is_nan() {
        "f64::NAN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "f64::INFINITY" } else { "f64::NEG_INFINITY" }.into()
    } else {
        // Debug prints the shortest string that reads back to the same value, always with a `.` or
        // an exponent, so it is a float literal.
        format!("{v:?}")
    }
}

fn f32_lit(v: f32) -> String {
    if v.is_finite() {
        format!("{v:?}")
    } else {
        float_lit(v as f64).replace("f64", "f32")
    }
}

fn conv_attrs(a: &ConvAttrs, used: &mut BTreeSet<&'static str>) -> Doc {
    let d = ConvAttrs::default();
    let mut fields = Vec::new();
    let mut arr = |name: &str, v: [usize; 2], dv: [usize; 2]| {
        if v != dv {
            fields.push((name.to_string(), array_lit(&v)));
        }
    };
    arr("stride", a.stride, d.stride);
    arr("padding", a.padding, d.padding);
    arr("dilation", a.dilation, d.dilation);
    if a.groups != d.groups {
        fields.push(("groups".into(), a.groups.to_string()));
    }
    if a.output_padding != d.output_padding {
        fields.push(("output_padding".into(), array_lit(&a.output_padding)));
    }
    for (name, v, dv) in [("bias", a.bias, d.bias), ("residual", a.residual, d.residual)] {
        if v != dv {
            fields.push((name.into(), v.to_string()));
        }
    }
    if a.act != d.act {
        used.insert("Activation");
        let act = match a.act {
            Activation::None => "Activation::None",
            Activation::Relu => "Activation::Relu",
        };
        fields.push(("act".into(), act.into()));
    }
    used.insert("ConvAttrs");
    if fields.is_empty() {
        return Doc::Atom("ConvAttrs::default()".into());
    }
    Doc::Struct { name: "ConvAttrs".into(), fields, base: Some("ConvAttrs::default()".into()) }
}

fn pool_attrs(a: &PoolAttrs, used: &mut BTreeSet<&'static str>) -> Doc {
    used.insert("PoolAttrs");
    let fields = vec![
        ("kernel".into(), array_lit(&a.kernel)),
        ("stride".into(), array_lit(&a.stride)),
        ("padding".into(), array_lit(&a.padding)),
        ("ceil_mode".into(), a.ceil_mode.to_string()),
        ("count_include_pad".into(), a.count_include_pad.to_string()),
    ];
    Doc::Struct { name: "PoolAttrs".into(), fields, base: None }
}

/// The Rust expression that builds `op`.
fn op_expr(op: &Op, used: &mut BTreeSet<&'static str>) -> Doc {
    let call = |head: &str, arg: Doc| Doc::Call { head: head.into(), args: vec![arg], tail: String::new() };
    let named = |name: &str, fields: Vec<(String, String)>| Doc::Struct { name: name.into(), fields, base: None };
    match op {
        Op::Conv2d(a) => call("Op::Conv2d", conv_attrs(a, used)),
        Op::ConvTranspose2d(a) => call("Op::ConvTranspose2d", conv_attrs(a, used)),
        Op::BatchNorm2d { eps } => named("Op::BatchNorm2d", vec![("eps".into(), f32_lit(*eps))]),
        Op::Linear { bias } => named("Op::Linear", vec![("bias".into(), bias.to_string())]),
        Op::Relu => Doc::Atom("Op::Relu".into()),
        Op::Sigmoid => Doc::Atom("Op::Sigmoid".into()),
        Op::Add => Doc::Atom("Op::Add".into()),
        Op::Mul => Doc::Atom("Op::Mul".into()),
        Op::LeakyRelu { slope } => named("Op::LeakyRelu", vec![("slope".into(), f32_lit(*slope))]),
        Op::MaxPool2d(a) => call("Op::MaxPool2d", pool_attrs(a, used)),
        Op::AvgPool2d(a) => call("Op::AvgPool2d", pool_attrs(a, used)),
        Op::AdaptiveAvgPool2d { output } => named("Op::AdaptiveAvgPool2d", vec![("output".into(), array_lit(output))]),
        Op::Flatten { start } => named("Op::Flatten", vec![("start".into(), start.to_string())]),
        Op::Cat { dim } => named("Op::Cat", vec![("dim".into(), dim.to_string())]),
        Op::Custom { name, attrs } => {
            let pairs: Vec<Doc> = attrs.iter().map(|(k, v)| Doc::Atom(format!("({:?}.to_string(), {})", k, float_lit(*v)))).collect();
            let attrs = Doc::Call {
                head: "BTreeMap::from".into(),
                args: vec![Doc::Array { head: String::new(), items: pairs }],
                tail: String::new(),
            };
            used.insert("BTreeMap");
            Doc::Struct {
                name: "Op::Custom".into(),
                fields: vec![("name".into(), format!("{name:?}.to_string()")), ("attrs".into(), attrs.flat())],
                base: None,
            }
        }
        Op::Input { .. } | Op::Weight { .. } => unreachable!("inputs and weights are not recorded ops"),
    }
}

const KEYWORDS: &[&str] = &[
    "as", "async", "await", "box", "break", "const", "continue", "crate", "dyn", "else", "enum", "extern", "false", "fn", "for", "gen",
    "if", "impl", "in", "let", "loop", "match", "mod", "move", "mut", "pub", "ref", "return", "self", "static", "struct", "super", "trait",
    "true", "try", "type", "unsafe", "use", "where", "while", "yield", "abstract", "become", "do", "final", "macro", "override", "priv",
    "typeof", "unsized", "virtual", "vb", "tracer", "batch",
];

/// A Rust identifier for a module path: `layer1.0.conv1` → `layer1_0_conv1`.
fn ident(path: &str) -> String {
    let mut s: String = path.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).collect();
    s = s.trim_matches('_').to_string();
    if s.is_empty() {
        s = "x".into();
    }
    if s.starts_with(|c: char| c.is_ascii_digit()) || KEYWORDS.contains(&s.as_str()) {
        s = format!("x_{s}");
    }
    s
}

/// Rust source of a function `fn_name(vb: &VarBuilder, batch: usize) -> Result<Graph>` that traces
/// `graph` again through `Tensor::record`, with the inputs' first dimension as `batch`.
pub fn generate(graph: &Graph, opts: &CodegenOptions) -> Result<String> {
    let style = Style::new(opts.max_width, opts.small_heuristics_max);
    let mut used: BTreeSet<&'static str> = ["Graph", "Op", "Result", "Tensor", "Tracer", "VarBuilder"].into();
    let mut names: Vec<Option<String>> = vec![None; graph.nodes.len()];
    let mut taken: HashSet<String> = HashSet::new();
    let batch = graph.inputs.first().and_then(|&i| graph.nodes[i].shape.first().copied());
    let mut body = String::new();
    let mut ops = 0;
    for (id, node) in graph.nodes.iter().enumerate() {
        // A path seen before (a module called twice) gets `_2`, `_3`...; the suffixed name is checked
        // too, since `head.hm.2` alone already reads `head_hm_2`, and a repeated `let` would shadow.
        let mut var = || {
            let base = ident(&node.path);
            let mut name = base.clone();
            let mut n = 1;
            while taken.contains(&name) {
                n += 1;
                name = format!("{base}_{n}");
            }
            taken.insert(name.clone());
            name
        };
        match &node.op {
            Op::Weight { .. } => continue,
            Op::Input { name } => {
                let mut dims: Vec<String> = node.shape.iter().map(|d| d.to_string()).collect();
                if let (Some(first), Some(b)) = (dims.first_mut(), batch) {
                    if node.shape[0] == b {
                        *first = "batch".into();
                    }
                }
                let v = var();
                let expr = Doc::Call {
                    head: "tracer.input".into(),
                    args: vec![Doc::Atom(format!("{name:?}")), Doc::Atom(format!("&[{}]", dims.join(", ")))],
                    tail: String::new(),
                };
                body += &let_statement(&v, &expr, 4, &style);
                names[id] = Some(v);
            }
            op => {
                let mut inputs = Vec::new();
                let mut params = Vec::new();
                for &i in &node.inputs {
                    match &graph.nodes[i].op {
                        Op::Weight { name } => params.push(Doc::Atom(format!("&vb.get(&{}, {name:?})?", array_lit(&graph.nodes[i].shape)))),
                        _ => match &names[i] {
                            Some(v) => inputs.push(Doc::Atom(format!("&{v}"))),
                            None => {
                                return Err(Error::Graph(format!("codegen: node %{id} (`{}`) reads %{i}, which comes later", node.path)))
                            }
                        },
                    }
                }
                if inputs.is_empty() {
                    return Err(Error::Graph(format!("codegen: op `{}` at `{}` has no tensor input", op.name(), node.path)));
                }
                // A weight read between two tensor inputs cannot be expressed by `Tensor::record`,
                // which puts tensors first.
                if node
                    .inputs
                    .iter()
                    .skip_while(|&&i| !matches!(graph.nodes[i].op, Op::Weight { .. }))
                    .any(|&i| !matches!(graph.nodes[i].op, Op::Weight { .. }))
                {
                    return Err(Error::Graph(format!("codegen: op `{}` at `{}` reads a tensor after a weight", op.name(), node.path)));
                }
                let v = var();
                let expr = Doc::Call {
                    head: "Tensor::record".into(),
                    args: vec![
                        Doc::Atom(format!("{:?}", node.path)),
                        op_expr(op, &mut used),
                        Doc::Array { head: "&".into(), items: inputs },
                        Doc::Array { head: "&".into(), items: params },
                    ],
                    tail: "?".into(),
                };
                body += &let_statement(&v, &expr, 4, &style);
                names[id] = Some(v);
                ops += 1;
            }
        }
    }
    for (name, id) in &graph.outputs {
        let v = names[*id].as_ref().ok_or_else(|| Error::Graph(format!("codegen: output `{name}` is a weight")))?;
        body += &format!("    tracer.output({name:?}, &{v});\n");
    }
    body += "    Ok(tracer.graph())\n";

    let kiln: Vec<&str> = used.iter().copied().filter(|u| *u != "BTreeMap").collect();
    let mut src = String::new();
    src += &format!("//! {} as Kiln tracing calls, generated by `{}` from its traced graph.\n", opts.model, opts.command);
    src += "//!\n";
    src += &format!("//! One statement per traced op ({ops} ops), in graph order; weights are read by their `state_dict`\n");
    src += "//! names through the `VarBuilder`. Edit freely: `Tensor::record` checks every shape as it traces.\n\n";
    if used.contains("BTreeMap") {
        src += "use std::collections::BTreeMap;\n\n";
    }
    src += &format!("use kiln::{{{}}};\n\n", kiln.join(", "));
    src += &format!("/// Traces {} for a batch of `batch` inputs and returns its graph.\n", opts.model);
    src += &format!("pub fn {}(vb: &VarBuilder, batch: usize) -> Result<Graph> {{\n", opts.fn_name);
    src += "    let tracer = Tracer::new();\n";
    src += &body;
    src += "}\n";
    Ok(src)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_valid_and_readable() {
        assert_eq!(ident("layer1.0.conv1"), "layer1_0_conv1");
        assert_eq!(ident("0.conv"), "x_0_conv");
        assert_eq!(ident("head.type"), "head_type");
        assert_eq!(ident("type"), "x_type");
        assert_eq!(ident(""), "x");
    }

    #[test]
    fn long_calls_break_like_rustfmt() {
        let expr = Doc::Call {
            head: "Tensor::record".into(),
            args: vec![
                Doc::Atom("\"a.b\"".into()),
                Doc::Call {
                    head: "Op::Conv2d".into(),
                    args: vec![Doc::Struct {
                        name: "ConvAttrs".into(),
                        fields: vec![("groups".into(), "2".into())],
                        base: Some("ConvAttrs::default()".into()),
                    }],
                    tail: String::new(),
                },
                Doc::Array { head: "&".into(), items: vec![Doc::Atom("&x".into())] },
                Doc::Array { head: "&".into(), items: vec![] },
            ],
            tail: "?".into(),
        };
        let one = let_statement("y", &expr, 4, &Style::new(140, true));
        assert_eq!(one, "    let y = Tensor::record(\"a.b\", Op::Conv2d(ConvAttrs { groups: 2, ..ConvAttrs::default() }), &[&x], &[])?;\n");
        // 108 columns on one line, 104 with the expression on its own line.
        let next = let_statement("y", &expr, 4, &Style::new(104, true));
        assert!(next.starts_with("    let y =\n        Tensor::record("), "{next}");
        let broken = let_statement("y", &expr, 4, &Style::new(103, true));
        assert!(
            broken.starts_with(
                "    let y = Tensor::record(\n        \"a.b\",\n        Op::Conv2d(ConvAttrs { groups: 2, ..ConvAttrs::default() }),\n"
            ),
            "{broken}"
        );
        let broken = let_statement("y", &expr, 4, &Style::new(60, true));
        assert!(
            broken.starts_with("    let y = Tensor::record(\n        \"a.b\",\n        Op::Conv2d(ConvAttrs {\n            groups: 2,\n"),
            "{broken}"
        );
        assert!(broken.ends_with("        &[],\n    )?;\n"), "{broken}");
    }

    #[test]
    fn variable_names_never_repeat() {
        let t = crate::Tracer::new();
        let x = t.input("input", &[1, 2]);
        // `a.relu` twice, then a module whose own path reads like the second one's name.
        let a = crate::Tensor::record("a.relu", Op::Relu, &[&x], &[]).expect("relu");
        let b = crate::Tensor::record("a.relu", Op::Relu, &[&a], &[]).expect("relu");
        let c = crate::Tensor::record("a.relu.2", Op::Sigmoid, &[&b], &[]).expect("sigmoid");
        t.output("out", &c);
        let src = generate(&t.graph(), &CodegenOptions::default()).expect("generate");
        for name in ["let a_relu =", "let a_relu_2 =", "let a_relu_2_2 ="] {
            assert_eq!(src.matches(name).count(), 1, "{name}:\n{src}");
        }
        assert!(src.contains("&[&a_relu_2]") && src.contains("tracer.output(\"out\", &a_relu_2_2);"), "{src}");
    }

    #[test]
    fn float_literals_read_back() {
        assert_eq!(f32_lit(1e-5), "1e-5");
        assert_eq!(f32_lit(0.1), "0.1");
        assert_eq!(float_lit(2.0), "2.0");
        assert_eq!(f32_lit(f32::INFINITY), "f32::INFINITY");
    }
}
