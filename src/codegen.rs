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

mod layers;
mod structured;
mod tree;

pub use structured::generate as generate_structured;

use crate::graph::{ConvAttrs, DType, Graph, Op};
use crate::{Error, Result};
use serde::Serialize;
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

/// The Rust expression that builds `op`: its serde form written as Rust (`Op::Unary(Unary::Relu)`,
/// `Op::Conv(ConvAttrs { stride: [2, 2], ..ConvAttrs::default() })`), so every op, built-in or
/// custom, has codegen without code of its own. Types named in it are added to `used`.
fn op_expr(op: &Op, used: &mut BTreeSet<&'static str>) -> Result<Doc> {
    let doc = op.serialize(RustLit { used: &mut *used }).map_err(|e| Error::Codegen { reason: format!("op `{}`: {e}", op.name()) })?;
    Ok(elide_defaults(doc))
}

/// Struct literals of types with a `Default` keep only the fields that differ from it.
fn elide_defaults(doc: Doc) -> Doc {
    match doc {
        Doc::Struct { name, fields, base: None } if name == "ConvAttrs" => {
            let default = ConvAttrs::default().serialize(RustLit { used: &mut BTreeSet::new() });
            let Ok(Doc::Struct { fields: defaults, .. }) = default else { return Doc::Struct { name, fields, base: None } };
            let fields: Vec<(String, String)> = fields.into_iter().filter(|f| !defaults.contains(f)).collect();
            if fields.is_empty() {
                return Doc::Atom("ConvAttrs::default()".into());
            }
            Doc::Struct { name, fields, base: Some("ConvAttrs::default()".into()) }
        }
        Doc::Call { head, args, tail } => Doc::Call { head, args: args.into_iter().map(elide_defaults).collect(), tail },
        other => other,
    }
}

/// A serde serializer that writes a value as a Rust expression (`Doc`).
struct RustLit<'a> {
    used: &'a mut BTreeSet<&'static str>,
}

#[derive(Debug)]
struct LitError(String);

impl std::fmt::Display for LitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LitError {}

impl serde::ser::Error for LitError {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        LitError(msg.to_string())
    }
}

/// Items of a sequence, tuple, map or struct being written.
struct LitItems<'a> {
    used: &'a mut BTreeSet<&'static str>,
    head: String,
    items: Vec<Doc>,
    fields: Vec<(String, String)>,
    key: Option<Doc>,
    kind: ItemsKind,
}

#[derive(PartialEq)]
enum ItemsKind {
    Array,
    Map,
    Struct,
    /// A tuple variant: `Name::Variant(a, b)`.
    Call,
}

impl<'a> LitItems<'a> {
    fn new(used: &'a mut BTreeSet<&'static str>, head: String, kind: ItemsKind) -> Self {
        Self { used, head, items: vec![], fields: vec![], key: None, kind }
    }

    fn finish(self) -> Doc {
        match self.kind {
            ItemsKind::Array => Doc::Array { head: self.head, items: self.items },
            ItemsKind::Map => {
                self.used.insert("BTreeMap");
                Doc::Call {
                    head: "BTreeMap::from".into(),
                    args: vec![Doc::Array { head: String::new(), items: self.items }],
                    tail: String::new(),
                }
            }
            ItemsKind::Struct => Doc::Struct { name: self.head, fields: self.fields, base: None },
            ItemsKind::Call => Doc::Call { head: self.head, args: self.items, tail: String::new() },
        }
    }
}

macro_rules! lit_atoms {
    ($($method:ident: $t:ty => $f:expr),* $(,)?) => {
        $(fn $method(self, v: $t) -> std::result::Result<Doc, LitError> {
            #[allow(clippy::redundant_closure_call)]
            Ok(Doc::Atom(($f)(v)))
        })*
    };
}

impl<'a> serde::Serializer for RustLit<'a> {
    type Ok = Doc;
    type Error = LitError;
    type SerializeSeq = LitItems<'a>;
    type SerializeTuple = LitItems<'a>;
    type SerializeTupleStruct = LitItems<'a>;
    type SerializeTupleVariant = LitItems<'a>;
    type SerializeMap = LitItems<'a>;
    type SerializeStruct = LitItems<'a>;
    type SerializeStructVariant = LitItems<'a>;

    lit_atoms! {
        serialize_bool: bool => |v: bool| v.to_string(),
        serialize_i8: i8 => |v: i8| v.to_string(),
        serialize_i16: i16 => |v: i16| v.to_string(),
        serialize_i32: i32 => |v: i32| v.to_string(),
        serialize_i64: i64 => |v: i64| v.to_string(),
        serialize_u8: u8 => |v: u8| v.to_string(),
        serialize_u16: u16 => |v: u16| v.to_string(),
        serialize_u32: u32 => |v: u32| v.to_string(),
        serialize_u64: u64 => |v: u64| v.to_string(),
        serialize_f32: f32 => f32_lit,
        serialize_f64: f64 => float_lit,
        serialize_char: char => |v: char| format!("{v:?}"),
        serialize_str: &str => |v: &str| format!("{v:?}.to_string()"),
    }
    fn serialize_bytes(self, v: &[u8]) -> std::result::Result<Doc, LitError> {
        Ok(Doc::Atom(format!("{v:?}.to_vec()")))
    }
    fn serialize_none(self) -> std::result::Result<Doc, LitError> {
        Ok(Doc::Atom("None".into()))
    }
    fn serialize_some<T: ?Sized + serde::Serialize>(self, value: &T) -> std::result::Result<Doc, LitError> {
        Ok(Doc::Call { head: "Some".into(), args: vec![value.serialize(self)?], tail: String::new() })
    }
    fn serialize_unit(self) -> std::result::Result<Doc, LitError> {
        Ok(Doc::Atom("()".into()))
    }
    fn serialize_unit_struct(self, name: &'static str) -> std::result::Result<Doc, LitError> {
        self.used.insert(name);
        Ok(Doc::Atom(name.into()))
    }
    fn serialize_unit_variant(self, name: &'static str, _i: u32, variant: &'static str) -> std::result::Result<Doc, LitError> {
        self.used.insert(name);
        Ok(Doc::Atom(format!("{name}::{variant}")))
    }
    fn serialize_newtype_struct<T: ?Sized + serde::Serialize>(self, name: &'static str, value: &T) -> std::result::Result<Doc, LitError> {
        self.used.insert(name);
        Ok(Doc::Call { head: name.into(), args: vec![value.serialize(self)?], tail: String::new() })
    }
    fn serialize_newtype_variant<T: ?Sized + serde::Serialize>(
        self,
        name: &'static str,
        _i: u32,
        variant: &'static str,
        value: &T,
    ) -> std::result::Result<Doc, LitError> {
        self.used.insert(name);
        Ok(Doc::Call { head: format!("{name}::{variant}"), args: vec![value.serialize(self)?], tail: String::new() })
    }
    fn serialize_seq(self, _len: Option<usize>) -> std::result::Result<LitItems<'a>, LitError> {
        Ok(LitItems::new(self.used, "vec!".into(), ItemsKind::Array))
    }
    fn serialize_tuple(self, _len: usize) -> std::result::Result<LitItems<'a>, LitError> {
        Ok(LitItems::new(self.used, String::new(), ItemsKind::Array))
    }
    fn serialize_tuple_struct(self, name: &'static str, _len: usize) -> std::result::Result<LitItems<'a>, LitError> {
        self.used.insert(name);
        Ok(LitItems::new(self.used, name.into(), ItemsKind::Call))
    }
    fn serialize_tuple_variant(
        self,
        name: &'static str,
        _i: u32,
        variant: &'static str,
        _len: usize,
    ) -> std::result::Result<LitItems<'a>, LitError> {
        self.used.insert(name);
        Ok(LitItems::new(self.used, format!("{name}::{variant}"), ItemsKind::Call))
    }
    fn serialize_map(self, _len: Option<usize>) -> std::result::Result<LitItems<'a>, LitError> {
        Ok(LitItems::new(self.used, String::new(), ItemsKind::Map))
    }
    fn serialize_struct(self, name: &'static str, _len: usize) -> std::result::Result<LitItems<'a>, LitError> {
        self.used.insert(name);
        Ok(LitItems::new(self.used, name.into(), ItemsKind::Struct))
    }
    fn serialize_struct_variant(
        self,
        name: &'static str,
        _i: u32,
        variant: &'static str,
        _len: usize,
    ) -> std::result::Result<LitItems<'a>, LitError> {
        self.used.insert(name);
        Ok(LitItems::new(self.used, format!("{name}::{variant}"), ItemsKind::Struct))
    }
}

impl LitItems<'_> {
    fn push<T: ?Sized + serde::Serialize>(&mut self, value: &T) -> std::result::Result<(), LitError> {
        let doc = value.serialize(RustLit { used: &mut *self.used })?;
        self.items.push(doc);
        Ok(())
    }
    fn field<T: ?Sized + serde::Serialize>(&mut self, key: &'static str, value: &T) -> std::result::Result<(), LitError> {
        let doc = value.serialize(RustLit { used: &mut *self.used })?;
        let doc = elide_defaults(doc);
        self.fields.push((key.to_string(), doc.flat()));
        Ok(())
    }
}

macro_rules! lit_items {
    ($($trait:ident :: $method:ident),*) => {
        $(impl serde::ser::$trait for LitItems<'_> {
            type Ok = Doc;
            type Error = LitError;
            fn $method<T: ?Sized + serde::Serialize>(&mut self, value: &T) -> std::result::Result<(), LitError> {
                self.push(value)
            }
            fn end(self) -> std::result::Result<Doc, LitError> {
                Ok(self.finish())
            }
        })*
    };
}

lit_items!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

impl serde::ser::SerializeMap for LitItems<'_> {
    type Ok = Doc;
    type Error = LitError;
    fn serialize_key<T: ?Sized + serde::Serialize>(&mut self, key: &T) -> std::result::Result<(), LitError> {
        self.key = Some(key.serialize(RustLit { used: &mut *self.used })?);
        Ok(())
    }
    fn serialize_value<T: ?Sized + serde::Serialize>(&mut self, value: &T) -> std::result::Result<(), LitError> {
        let key = self.key.take().ok_or_else(|| LitError("a map value without its key".into()))?;
        let value = value.serialize(RustLit { used: &mut *self.used })?;
        self.items.push(Doc::Atom(format!("({}, {})", key.flat(), value.flat())));
        Ok(())
    }
    fn end(self) -> std::result::Result<Doc, LitError> {
        Ok(self.finish())
    }
}

macro_rules! lit_fields {
    ($($trait:ident),*) => {
        $(impl serde::ser::$trait for LitItems<'_> {
            type Ok = Doc;
            type Error = LitError;
            fn serialize_field<T: ?Sized + serde::Serialize>(&mut self, key: &'static str, value: &T) -> std::result::Result<(), LitError> {
                self.field(key, value)
            }
            fn end(self) -> std::result::Result<Doc, LitError> {
                Ok(self.finish())
            }
        })*
    };
}

lit_fields!(SerializeStruct, SerializeStructVariant);

const KEYWORDS: &[&str] = &[
    "as", "async", "await", "box", "break", "const", "continue", "crate", "dyn", "else", "enum", "extern", "false", "fn", "for", "gen",
    "if", "impl", "in", "let", "loop", "match", "mod", "move", "mut", "pub", "ref", "return", "self", "static", "struct", "super", "trait",
    "true", "try", "type", "unsafe", "use", "where", "while", "yield", "abstract", "become", "do", "final", "macro", "override", "priv",
    "typeof", "unsized", "virtual", "vb", "tracer", "batch",
];

/// The op-level IR's types, which generated code imports from `kiln::plugin`: every type an op's
/// serde form names must be one of them.
const IR: &[&str] = &[
    "Activation",
    "Attention",
    "Binary",
    "ConvAttrs",
    "CustomCall",
    "Gemm",
    "GemmAct",
    "Node",
    "Norm",
    "Op",
    "Pool",
    "PoolAttrs",
    "QkvAttention",
    "Quant",
    "QuantFormat",
    "QuantParams",
    "Resize",
    "ShapeOp",
    "Unary",
];

/// The Rust expression codegen writes for `op` in its serde form, or why it cannot; and the types
/// it names that generated code could not import (not in `IR`). For the op-completeness test.
#[cfg(test)]
pub(crate) fn serde_form(op: &Op) -> Result<(String, Vec<&'static str>)> {
    let mut used = BTreeSet::new();
    let expr = op_expr(op, &mut used)?.flat();
    Ok((expr, used.into_iter().filter(|t| !IR.contains(t) && *t != "BTreeMap").collect()))
}

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

/// `use krate::{a, b};` as rustfmt writes it: on one line if it fits, else the names filled into
/// indented lines (its "mixed" imports layout).
/// The `use` lines for Kiln's `names`, each under its face: the root, `kiln::nn` (the layers) or
/// `kiln::plugin` (the graph's op-level IR).
pub(crate) fn kiln_uses(names: &[&str], width: usize) -> String {
    const ROOT: &[&str] = &["Forward", "Graph", "HostTensor", "Module", "NodeId", "Param", "Result", "Tensor", "Tracer", "VarBuilder"];
    let of = |face: &dyn Fn(&str) -> bool| names.iter().copied().filter(|n| face(n)).collect::<Vec<_>>();
    let root = of(&|n| ROOT.contains(&n));
    let nn = of(&|n| !ROOT.contains(&n) && !IR.contains(&n));
    let ir = of(&|n| IR.contains(&n));
    let mut src = String::new();
    for (krate, names) in [("kiln::nn", nn), ("kiln::plugin", ir), ("kiln", root)] {
        if !names.is_empty() {
            src += &use_statement(krate, &names, width);
        }
    }
    src + "\n"
}

fn use_statement(krate: &str, names: &[&str], width: usize) -> String {
    if let [name] = names {
        return format!("use {krate}::{name};\n");
    }
    let one = format!("use {krate}::{{{}}};\n", names.join(", "));
    if one.len() - 1 <= width {
        return one;
    }
    let mut lines = vec![String::from("   ")];
    for name in names {
        let last = lines.last_mut().expect("one line at least");
        if last.len() + 1 + name.len() + 1 > width {
            lines.push(format!("    {name},"));
        } else {
            *last += &format!(" {name},");
        }
    }
    format!("use {krate}::{{\n{}\n}};\n", lines.join("\n"))
}

/// Rust source of a function `fn_name(vb: &VarBuilder, batch: usize) -> Result<Graph>` that traces
/// `graph` again through `Tensor::record`, with the inputs' first dimension as `batch`.
pub fn generate(graph: &Graph, opts: &CodegenOptions) -> Result<String> {
    let style = Style::new(opts.max_width, opts.small_heuristics_max);
    let mut flat = Flat::new(graph, style);
    for (id, node) in graph.nodes.iter().enumerate() {
        match &node.op {
            Op::Weight { .. } => {}
            Op::Input { name } => flat.input(id, name)?,
            op => flat.record(id, op)?,
        }
    }
    flat.outputs()?;
    Ok(flat.file(opts))
}

/// The flat generator's state: the function body so far, each node's variable, the type names used.
struct Flat<'g> {
    graph: &'g Graph,
    style: Style,
    used: BTreeSet<&'static str>,
    names: Vec<Option<String>>,
    taken: HashSet<String>,
    batch: Option<usize>,
    body: String,
    ops: usize,
}

impl<'g> Flat<'g> {
    fn new(graph: &'g Graph, style: Style) -> Self {
        Self {
            graph,
            style,
            used: ["Graph", "Op", "Result", "Tensor", "Tracer", "VarBuilder"].into(),
            names: vec![None; graph.nodes.len()],
            taken: HashSet::new(),
            batch: graph.inputs.first().and_then(|&i| graph.nodes[i].shape.first().copied()),
            body: String::new(),
            ops: 0,
        }
    }

    /// A new variable for node `id`, named after its path. A path seen before (a module called
    /// twice) gets `_2`, `_3`...; the suffixed name is checked too, since `head.hm.2` alone already
    /// reads `head_hm_2`, and a repeated `let` would shadow.
    fn var(&mut self, id: usize) -> String {
        let base = ident(&self.graph.nodes[id].path);
        let mut name = base.clone();
        let mut n = 1;
        while self.taken.contains(&name) {
            n += 1;
            name = format!("{base}_{n}");
        }
        self.taken.insert(name.clone());
        self.names[id] = Some(name.clone());
        name
    }

    fn input(&mut self, id: usize, name: &str) -> Result<()> {
        let node = &self.graph.nodes[id];
        let mut dims: Vec<String> = node.shape.iter().map(|d| d.to_string()).collect();
        if let (Some(first), Some(b)) = (dims.first_mut(), self.batch) {
            if node.shape[0] == b {
                *first = "batch".into();
            }
        }
        let mut args = vec![Doc::Atom(format!("{name:?}")), Doc::Atom(format!("&[{}]", dims.join(", ")))];
        // A typed input (bytes) keeps its type: the engine's binding depends on it.
        let head = if node.dtype == DType::F32 {
            "tracer.input"
        } else {
            self.used.insert("DType");
            args.push(Doc::Atom(format!("DType::{:?}", node.dtype)));
            "tracer.input_typed"
        };
        let v = self.var(id);
        self.body += &let_statement(&v, &Doc::Call { head: head.into(), args, tail: String::new() }, 4, &self.style);
        Ok(())
    }

    /// The tensors and the weights node `id` reads, as `Tensor::record` takes them.
    fn record_args(&self, id: usize, op: &Op) -> Result<(Vec<Doc>, Vec<Doc>)> {
        let (graph, node) = (self.graph, &self.graph.nodes[id]);
        let (mut inputs, mut params) = (Vec::new(), Vec::new());
        for &i in &node.inputs {
            match (&graph.nodes[i].op, &self.names[i]) {
                (Op::Weight { name, .. }, _) => {
                    params.push(Doc::Atom(format!("&vb.get(&{}, {name:?})?", array_lit(&graph.nodes[i].shape))))
                }
                (_, Some(v)) => inputs.push(Doc::Atom(format!("&{v}"))),
                (_, None) => {
                    return Err(Error::InvalidGraph { node: id, path: node.path.clone(), reason: format!("reads %{i}, which comes later") })
                }
            }
        }
        if inputs.is_empty() {
            return Err(Error::NoTensorInput { op: op.name().to_string(), path: node.path.clone() });
        }
        // A weight read between two tensor inputs cannot be expressed by `Tensor::record`, which
        // puts tensors first.
        let is_weight = |i: &usize| matches!(graph.nodes[*i].op, Op::Weight { .. });
        if node.inputs.iter().skip_while(|i| !is_weight(i)).any(|i| !is_weight(i)) {
            return Err(Error::Codegen { reason: format!("op `{}` at `{}` reads a tensor after a weight", op.name(), node.path) });
        }
        Ok((inputs, params))
    }

    fn record(&mut self, id: usize, op: &Op) -> Result<()> {
        let (inputs, params) = self.record_args(id, op)?;
        let expr = Doc::Call {
            head: "Tensor::record".into(),
            args: vec![
                Doc::Atom(format!("{:?}", self.graph.nodes[id].path)),
                op_expr(op, &mut self.used)?,
                Doc::Array { head: "&".into(), items: inputs },
                Doc::Array { head: "&".into(), items: params },
            ],
            tail: "?".into(),
        };
        let v = self.var(id);
        self.body += &let_statement(&v, &expr, 4, &self.style);
        self.ops += 1;
        Ok(())
    }

    fn outputs(&mut self) -> Result<()> {
        for (name, id) in &self.graph.outputs {
            let v = self.names[*id].as_ref().ok_or_else(|| Error::Codegen { reason: format!("output `{name}` is a weight") })?;
            self.body += &format!("    tracer.output({name:?}, &{v});\n");
        }
        self.body += "    Ok(tracer.graph())\n";
        Ok(())
    }

    /// The whole file: doc comment, `use` lines and the function.
    fn file(mut self, opts: &CodegenOptions) -> String {
        // Types met only in fields left at their default are not named in the code.
        let header = ["Graph", "Result", "Tracer", "VarBuilder"];
        let body = &self.body;
        self.used.retain(|u| header.contains(u) || body.contains(u));
        let kiln: Vec<&str> = self.used.iter().copied().filter(|u| *u != "BTreeMap").collect();
        let mut src = String::new();
        src += &format!("//! {} as Kiln tracing calls, generated by `{}` from its traced graph.\n", opts.model, opts.command);
        src += "//!\n";
        src += &format!("//! One statement per traced op ({} ops), in graph order; weights are read by their `state_dict`\n", self.ops);
        src += "//! names through the `VarBuilder`. Edit freely: `Tensor::record` checks every shape as it traces.\n\n";
        if self.used.contains("BTreeMap") {
            src += "use std::collections::BTreeMap;\n\n";
        }
        src += &kiln_uses(&kiln, self.style.width);
        src += &format!("/// Traces {} for a batch of `batch` inputs and returns its graph.\n", opts.model);
        src += &format!("pub fn {}(vb: &VarBuilder, batch: usize) -> Result<Graph> {{\n", opts.fn_name);
        src += "    let tracer = Tracer::new();\n";
        src += &self.body;
        src += "}\n";
        src
    }
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
                    head: "Op::Conv".into(),
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
        assert_eq!(one, "    let y = Tensor::record(\"a.b\", Op::Conv(ConvAttrs { groups: 2, ..ConvAttrs::default() }), &[&x], &[])?;\n");
        // 106 columns on one line, 102 with the expression on its own line.
        let next = let_statement("y", &expr, 4, &Style::new(102, true));
        assert!(next.starts_with("    let y =\n        Tensor::record("), "{next}");
        let broken = let_statement("y", &expr, 4, &Style::new(101, true));
        assert!(
            broken.starts_with(
                "    let y = Tensor::record(\n        \"a.b\",\n        Op::Conv(ConvAttrs { groups: 2, ..ConvAttrs::default() }),\n"
            ),
            "{broken}"
        );
        let broken = let_statement("y", &expr, 4, &Style::new(60, true));
        assert!(
            broken.starts_with("    let y = Tensor::record(\n        \"a.b\",\n        Op::Conv(ConvAttrs {\n            groups: 2,\n"),
            "{broken}"
        );
        assert!(broken.ends_with("        &[],\n    )?;\n"), "{broken}");
    }

    #[test]
    fn variable_names_never_repeat() {
        let t = crate::Tracer::new();
        let x = t.input("input", &[1, 2]);
        // `a.relu` twice, then a module whose own path reads like the second one's name.
        let a = crate::Tensor::record("a.relu", Op::Unary(crate::graph::Unary::Relu), &[&x], &[]).expect("relu");
        let b = crate::Tensor::record("a.relu", Op::Unary(crate::graph::Unary::Relu), &[&a], &[]).expect("relu");
        let c = crate::Tensor::record("a.relu.2", Op::Unary(crate::graph::Unary::Sigmoid), &[&b], &[]).expect("sigmoid");
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
