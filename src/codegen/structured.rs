//! Structured codegen: a graph exported by `kiln-torch` as Kiln modules that read like the
//! bundled models (`models/src/resnet.rs`): one `#[derive(Module)]` struct per PyTorch module class,
//! its fields named as the `state_dict` (`conv1`, `layer1`, `downsample`), its `forward` made of
//! the Module DSL's calls (`self.conv1.forward(x)?`, `(&a + &b)?`, `x.flatten(1)?`).
//!
//! The calls of one class become one struct when their bodies agree: the same children called in
//! the same order on the same values, and the same inline ops. What differs between the calls
//! (channels, strides, whether a `downsample` exists, how many blocks a stage has) becomes the
//! struct's configuration (`BasicBlockConfig { in_channels, out_channels, stride, downsample }`),
//! each parent passing its children's. Calls that do not agree (torchvision's `InvertedResidual`
//! with and without its residual add) become one struct each (`InvertedResidual`,
//! `InvertedResidual2`). An `nn.Sequential` of one struct is a `Vec` field.

use super::layers::{inline, layer, Lit, Operands, Slot, Tpl, R};
use super::tree::{last, Child, Instance, Stmt, Tree, Val, IMPLICIT_LIST};
use super::{ident, CodegenOptions};
use crate::graph::{Graph, Op, Unary};
use crate::{Error, Result};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// What a struct is made of.
pub(super) struct TypeDef<'a> {
    pub name: String,
    pub class: String,
    /// The calls it is, the first of which has every statement.
    members: Vec<&'a Instance>,
    /// Per member: which of the first member's statements it lacks (optional children).
    skipped: Vec<Vec<bool>>,
    /// The configuration: name and each member's value.
    knobs: Knobs,
    /// Per statement of the first member, per slot: a literal, or a knob's index.
    slots: Vec<Vec<SlotUse>>,
    /// An `nn.Sequential` of one struct: written as a `Vec` of it in the parent.
    vec_of: Option<usize>,
}

/// A struct's config fields: each knob's name and its value in each member.
type Knobs = Vec<(String, Vec<Lit>)>;

#[derive(Clone, Debug)]
enum SlotUse {
    Lit(Lit),
    Knob(usize),
}

/// All structs, children first; and which struct and member each call is.
pub(super) struct Types<'t, 'g, 'a> {
    tree: &'t Tree<'g>,
    pub defs: Vec<TypeDef<'a>>,
    of: HashMap<*const Instance, (usize, usize)>,
}

fn as_ptr(i: &Instance) -> *const Instance {
    std::ptr::from_ref(i)
}

/// Every call of `inst` and of the modules below it, children first.
fn post_order<'a>(inst: &'a Instance, out: &mut Vec<(&'a Instance, usize)>) -> usize {
    let mut height = 0;
    for s in &inst.stmts {
        if let Stmt::Call { child: Child::Module(c), .. } = s {
            height = height.max(1 + post_order(c, out));
        }
    }
    out.push((inst, height));
    height
}

/// The last segment of a PyTorch class name as a Rust type name (`_DenseLayer` → `DenseLayer`).
fn type_name(class: &str, field: &str) -> String {
    let short = last(class).trim_start_matches('_');
    let base = if class == IMPLICIT_LIST || short == "Sequential" || short == "ModuleList" || short.is_empty() {
        camel(field)
    } else {
        short.to_string()
    };
    if base.is_empty() || base.starts_with(|c: char| c.is_ascii_digit()) {
        format!("Block{base}")
    } else if base.len() > 1 && base.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit()) {
        // Rust spells an acronym as a word (`ASPP` → `Aspp`, `MLP` → `Mlp`).
        base[..1].to_string() + &base[1..].to_ascii_lowercase()
    } else {
        base
    }
}

fn camel(s: &str) -> String {
    s.split(|c: char| !c.is_ascii_alphanumeric()).filter(|w| !w.is_empty()).map(|w| w[..1].to_uppercase() + &w[1..]).collect()
}

/// Kiln names a generated struct must not take.
const RESERVED: &[&str] = &[
    "AdaptiveAvgPool2d",
    "AvgPool2d",
    "BatchNorm2d",
    "Conv2d",
    "ConvTranspose2d",
    "GELU",
    "Hardsigmoid",
    "Hardswish",
    "Hardtanh",
    "LayerNorm",
    "LayerNorm2d",
    "LeakyReLU",
    "Linear",
    "MaxPool2d",
    "ReLU",
    "ReLU6",
    "SiLU",
    "Sigmoid",
    "Softmax",
    "Tanh",
    "Tensor",
    "Upsample",
    "Graph",
    "Op",
    "Param",
    "Module",
    "Forward",
    "Result",
    "Tracer",
    "VarBuilder",
    "Sequential",
    "Identity",
    "Dropout",
];

impl<'t, 'g, 'a> Types<'t, 'g, 'a> {
    /// Groups the calls below `root` into structs, children before parents: all calls of a class
    /// at once (a container's by depth: an `nn.Sequential` of blocks and one inside a block are
    /// not alike), once every child of every call has its struct.
    pub fn new(tree: &'t Tree<'g>, root: &'a Instance) -> Result<Self> {
        let mut all = Vec::new();
        post_order(root, &mut all);
        let mut pending: BTreeMap<(String, usize), Vec<(&'a Instance, usize)>> = BTreeMap::new();
        for &(inst, h) in &all {
            let depth = if is_container(&inst.class) { h } else { 0 };
            pending.entry((inst.class.clone(), depth)).or_default().push((inst, h));
        }
        let mut types = Self { tree, defs: Vec::new(), of: HashMap::new() };
        while !pending.is_empty() {
            let ready = pending.iter().find(|(_, insts)| insts.iter().all(|(i, _)| types.children_typed(i))).map(|(k, _)| k.clone());
            let key = match ready {
                Some(k) => k,
                // A class nested in itself: its lowest calls first.
                None => {
                    let (k, insts) = pending.iter_mut().min_by_key(|(_, v)| v.iter().map(|(_, h)| *h).min()).expect("pending");
                    let low = insts.iter().map(|(_, h)| *h).min().unwrap_or(0);
                    let (now, later): (Vec<_>, Vec<_>) = insts.drain(..).partition(|(_, h)| *h == low);
                    *insts = later;
                    let k = k.clone();
                    if pending[&k].is_empty() {
                        pending.remove(&k);
                    }
                    types.group(now.into_iter().map(|(i, _)| i).collect())?;
                    continue;
                }
            };
            let mut insts: Vec<&'a Instance> = pending.remove(&key).unwrap_or_default().into_iter().map(|(i, _)| i).collect();
            insts.sort_by_key(|i| std::cmp::Reverse(i.stmts.len()));
            types.group(insts)?;
        }
        Ok(types)
    }

    fn children_typed(&self, inst: &Instance) -> bool {
        inst.stmts.iter().filter_map(Stmt::module).all(|c| self.of.contains_key(&as_ptr(c)))
    }

    fn group(&mut self, insts: Vec<&'a Instance>) -> Result<()> {
        let first = self.defs.len();
        let insts_paths: Vec<(String, String)> = insts.iter().map(|i| (i.path.clone(), i.class.clone())).collect();
        for inst in insts {
            let fit = (first..self.defs.len()).find_map(|t| {
                let rep = self.defs[t].members[0];
                self.align(rep, inst).map(|skipped| (t, skipped))
            });
            let (t, skipped) = match fit {
                Some(found) => found,
                None => {
                    let field = last(&inst.path).to_string();
                    let field = if field.chars().all(|c| c.is_ascii_digit()) {
                        named_sibling(&insts_paths, &inst.class).unwrap_or(field)
                    } else {
                        field
                    };
                    self.defs.push(TypeDef {
                        name: type_name(&inst.class, &field),
                        class: inst.class.clone(),
                        members: Vec::new(),
                        skipped: Vec::new(),
                        knobs: Vec::new(),
                        slots: Vec::new(),
                        vec_of: None,
                    });
                    (self.defs.len() - 1, vec![false; inst.stmts.len()])
                }
            };
            let def = &mut self.defs[t];
            self.of.insert(as_ptr(inst), (t, def.members.len()));
            def.members.push(inst);
            def.skipped.push(skipped);
        }
        for t in first..self.defs.len() {
            self.defs[t].vec_of = self.vec_of(t);
            self.configure(t)?;
        }
        self.name_types(first);
        Ok(())
    }

    /// Unique names for the new structs: a class met again (variants, or two classes of one
    /// name) is numbered.
    fn name_types(&mut self, first: usize) {
        for t in first..self.defs.len() {
            let base = self.defs[t].name.clone();
            let reserved = RESERVED.contains(&base.as_str()) || Unary::layer_names().contains(&base.as_str());
            let base = if reserved { format!("{base}Block") } else { base };
            let mut name = base.clone();
            let mut n = 1;
            while self.defs[..t].iter().any(|d| d.name == name) {
                n += 1;
                name = format!("{base}{n}");
            }
            self.defs[t].name = name;
        }
    }

    /// The struct and member of a call.
    fn type_of(&self, inst: &Instance) -> (usize, usize) {
        self.of[&as_ptr(inst)]
    }

    /// What a statement is, whatever its values: the key two calls' statements must share.
    fn key(&self, s: &Stmt) -> String {
        match s {
            Stmt::Call { field, child: Child::Layer(n), outs, .. } => {
                let ty = layer(self.tree.graph, *n, &self.child_path(*n)).map_or("?", |l| l.ty);
                format!("call {field} {ty} {}", outs.len())
            }
            Stmt::Call { field, child: Child::Module(c), outs, .. } => format!("call {field} #{} {}", self.type_of(c).0, outs.len()),
            Stmt::Op { node, params, args } => {
                let op = &self.tree.graph.nodes[*node].op;
                let fields: Vec<&str> = params.iter().map(|p| p.field.as_str()).collect();
                format!("op {} {} {fields:?}", op_kind(op), args.len())
            }
        }
    }

    fn child_path(&self, n: usize) -> String {
        self.tree.graph.nodes[n].path.clone()
    }

    /// How `other` is `rep` with some of `rep`'s one-in-one-out calls left out, if it is: the
    /// statements it lacks.
    fn align(&self, rep: &Instance, other: &Instance) -> Option<Vec<bool>> {
        if rep.args.len() != other.args.len() || rep.rets.len() != other.rets.len() || rep.class != other.class {
            return None;
        }
        // A container's calls are alike only with the same children (a stage of 3 blocks is not
        // one of 6 with 3 left out).
        if is_container(&rep.class) && rep.stmts.len() != other.stmts.len() {
            return None;
        }
        let mut skipped = vec![false; rep.stmts.len()];
        let mut at = vec![0usize; rep.stmts.len()];
        let mut j = 0;
        let map = |v: Val, skipped: &[bool], at: &[usize]| -> Option<Val> {
            let mut v = v;
            loop {
                match v {
                    Val::Arg(_) => return Some(v),
                    Val::Out(k, o) if !skipped[k] => return Some(Val::Out(at[k], o)),
                    Val::Out(k, _) => v = *rep.stmts[k].args().first()?,
                }
            }
        };
        for (i, s) in rep.stmts.iter().enumerate() {
            let same = other.stmts.get(j).is_some_and(|o| {
                self.key(s) == self.key(o)
                    && s.args().len() == o.args().len()
                    && s.args().iter().zip(o.args()).all(|(a, b)| map(*a, &skipped, &at) == Some(*b))
            });
            if same {
                at[i] = j;
                j += 1;
            } else if s.skippable() {
                skipped[i] = true;
            } else {
                return None;
            }
        }
        let rets_match = rep.rets_vals().iter().zip(other.rets_vals()).all(|(a, b)| map(*a, &skipped, &at) == Some(b));
        (j == other.stmts.len() && rets_match).then_some(skipped)
    }

    /// `Some(t)` when struct `t` is an `nn.Sequential` that chains calls of one struct `t` through
    /// children `0`, `1`, ...: its parent holds a `Vec`.
    fn vec_of(&self, t: usize) -> Option<usize> {
        let def = &self.defs[t];
        if !is_container(&def.class) {
            return None;
        }
        let mut elem = None;
        for (m, &inst) in def.members.iter().enumerate() {
            if def.skipped[m].iter().any(|&s| s) || inst.args.len() != 1 || inst.rets.len() != 1 {
                return None;
            }
            for (k, s) in inst.stmts.iter().enumerate() {
                let Stmt::Call { field, child: Child::Module(c), args, outs } = s else { return None };
                let prev = if k == 0 { Val::Arg(0) } else { Val::Out(k - 1, 0) };
                let ty = self.type_of(c).0;
                if field != &k.to_string() || args != &[prev] || outs.len() != 1 || *elem.get_or_insert(ty) != ty {
                    return None;
                }
            }
            if inst.rets_vals() != [Val::Out(inst.stmts.len().checked_sub(1)?, 0)] {
                return None;
            }
        }
        elem
    }
}

impl Stmt {
    pub(super) fn args(&self) -> &[Val] {
        match self {
            Stmt::Call { args, .. } | Stmt::Op { args, .. } => args,
        }
    }
    fn outs(&self) -> usize {
        match self {
            Stmt::Call { outs, .. } => outs.len(),
            Stmt::Op { .. } => 1,
        }
    }
    /// A call that may be absent from some calls of its parent's class (`downsample`).
    fn skippable(&self) -> bool {
        matches!(self, Stmt::Call { args, outs, .. } if args.len() == 1 && outs.len() == 1)
    }
}

impl Instance {
    /// The returned nodes as values of the body.
    pub(super) fn rets_vals(&self) -> Vec<Val> {
        let mut made: BTreeMap<usize, Val> = self.args.iter().enumerate().map(|(i, &n)| (n, Val::Arg(i))).collect();
        for (k, s) in self.stmts.iter().enumerate() {
            match s {
                Stmt::Call { outs, .. } => made.extend(outs.iter().enumerate().map(|(j, &o)| (o, Val::Out(k, j)))),
                Stmt::Op { node, .. } => {
                    made.insert(*node, Val::Out(k, 0));
                }
            }
        }
        self.rets.iter().filter_map(|r| made.get(r).copied()).collect()
    }
}

/// A name for a struct of calls named by index (`classifier.0`): the first of them with a name.
fn named_sibling(paths: &[(String, String)], class: &str) -> Option<String> {
    paths.iter().filter(|(_, c)| c == class).map(|(p, _)| last(p)).find(|f| !f.chars().all(|c| c.is_ascii_digit())).map(str::to_string)
}

/// `nn.Sequential`, `nn.ModuleList` (or a path that only groups modules).
fn is_container(class: &str) -> bool {
    class == IMPLICIT_LIST || matches!(last(class), "Sequential" | "ModuleList")
}

/// The key of an op for matching statements: its name, and for resizes how the size is given.
fn op_kind(op: &Op) -> String {
    match op {
        Op::Resize(r) => {
            format!("{r:?}").split(['{', ' ']).next().unwrap_or("").to_string()
                + if format!("{r:?}").contains("size: Some") { "size" } else { "scale" }
        }
        Op::Unary(u) => format!("{u:?}").split([' ', '{']).next().unwrap_or("").to_string(),
        op => op.name().to_string(),
    }
}

// ---- configuration

impl Types<'_, '_, '_> {
    /// The slots of statement `k` of `inst` (the member's own statement, present).
    fn stmt_slots(&self, inst: &Instance, s: &Stmt) -> Vec<Slot> {
        match s {
            Stmt::Call { child: Child::Layer(n), .. } => {
                layer(self.tree.graph, *n, &self.child_path(*n)).and_then(|l| l.config).map(|c| c.slots).unwrap_or_default()
            }
            Stmt::Call { field, child: Child::Module(c), .. } => {
                let (t, m) = self.type_of(c);
                let def = &self.defs[t];
                match def.vec_of {
                    Some(e) if self.defs[e].knobs.is_empty() => vec![Slot { hint: format!("{field}_len"), lit: Lit::Usize(c.stmts.len()) }],
                    Some(e) => {
                        let elems: Vec<&Instance> = c.stmts.iter().filter_map(Stmt::module).collect();
                        let configs = elems.iter().map(|el| self.config_lit(e, self.type_of(el).1)).collect();
                        vec![Slot { hint: field.clone(), lit: Lit::Configs(config_name(&self.defs[e]), configs) }]
                    }
                    None => def.knobs.iter().map(|(name, vals)| Slot { hint: name.clone(), lit: vals[m].clone() }).collect(),
                }
            }
            Stmt::Op { node, args, params } => {
                let g = self.tree.graph;
                let mut slots = inline(&g.nodes[*node].op, args.len(), params.len()).slots;
                slots.extend(
                    params.iter().map(|p| Slot { hint: format!("{}_shape", p.field), lit: Lit::Usizes(g.nodes[p.node].shape.clone()) }),
                );
                let _ = inst;
                slots
            }
        }
    }

    /// Member `m` of struct `t`'s configuration as a literal.
    fn config_lit(&self, t: usize, m: usize) -> Lit {
        let def = &self.defs[t];
        Lit::Config(config_name(def), def.knobs.iter().map(|(k, v)| (k.clone(), v[m].clone())).collect())
    }

    /// Finds struct `t`'s knobs: the slots whose values differ between its members.
    fn configure(&mut self, t: usize) -> Result<()> {
        let def = &self.defs[t];
        let rep = def.members[0];
        // Per statement: the slots' hints, and per member their values (absent statements: Absent).
        let mut hints: Vec<Vec<String>> = Vec::new();
        let mut values: Vec<Vec<Vec<Lit>>> = Vec::new();
        for (k, s) in rep.stmts.iter().enumerate() {
            let rep_slots = self.stmt_slots(rep, s);
            let field = match s {
                Stmt::Call { field, .. } => field.clone(),
                Stmt::Op { node, .. } => self.tree.graph.nodes[*node].op.name().to_string(),
            };
            let optional = def.skipped.iter().any(|sk| sk[k]);
            let mut h: Vec<String> = rep_slots.iter().map(|sl| sl.hint.clone()).collect();
            if optional {
                h.push(self.field_hint(s, &field));
            }
            let mut per_member = Vec::new();
            for (m, &inst) in def.members.iter().enumerate() {
                let mut v: Vec<Lit> = if def.skipped[m][k] {
                    vec![Lit::Absent; rep_slots.len()]
                } else {
                    let own = self.own_stmt(rep, inst, &def.skipped[m], k);
                    self.stmt_slots(inst, own).into_iter().map(|sl| sl.lit).collect()
                };
                if v.len() != rep_slots.len() {
                    return Err(Error::Codegen { reason: format!("`{}`: its calls' statement {k} differ in their slots", inst.path) });
                }
                if optional {
                    v.push(Lit::Bool(!def.skipped[m][k]));
                }
                per_member.push(v);
            }
            hints.push(h);
            values.push(per_member);
        }
        let (knobs, slots) = knobs(&hints, &values, def.members.len(), &prefixes(rep));
        let def = &mut self.defs[t];
        def.knobs = knobs;
        def.slots = slots;
        Ok(())
    }

    /// A name for a child's field: its segment, or after its type when the segment is an index.
    fn field_hint(&self, s: &Stmt, field: &str) -> String {
        if !field.chars().all(|c| c.is_ascii_digit()) {
            return ident(field);
        }
        match s {
            Stmt::Call { child: Child::Layer(n), .. } => {
                short_field(layer(self.tree.graph, *n, &self.child_path(*n)).map_or("layer", |l| l.ty))
            }
            Stmt::Call { child: Child::Module(c), .. } => snake(&self.defs[self.type_of(c).0].name),
            Stmt::Op { .. } => ident(field),
        }
    }

    /// Member `inst`'s statement that matches `rep`'s statement `k`.
    fn own_stmt<'a>(&self, rep: &Instance, inst: &'a Instance, skipped: &[bool], k: usize) -> &'a Stmt {
        let j = (0..k).filter(|&i| !skipped[i]).count();
        let _ = rep;
        &inst.stmts[j]
    }
}

impl Stmt {
    fn module(&self) -> Option<&Instance> {
        match self {
            Stmt::Call { child: Child::Module(c), .. } => Some(c),
            _ => None,
        }
    }
}

/// The field each statement's slots are prefixed with when their hints clash.
fn prefixes(rep: &Instance) -> Vec<String> {
    rep.stmts
        .iter()
        .map(|s| match s {
            Stmt::Call { field, .. } => ident(field),
            Stmt::Op { .. } => String::new(),
        })
        .collect()
}

/// The knobs of a struct from its statements' slot values: a slot equal in every member is a
/// literal; the others are knobs, one per distinct column of values (absent values match any),
/// named after the first slot's hint (prefixed with its field when the plain name is taken).
fn knobs(hints: &[Vec<String>], values: &[Vec<Vec<Lit>>], members: usize, prefixes: &[String]) -> (Knobs, Vec<Vec<SlotUse>>) {
    let mut knobs: Knobs = Vec::new();
    let mut uses = Vec::new();
    for (k, stmt_hints) in hints.iter().enumerate() {
        let mut row = Vec::new();
        for (i, hint) in stmt_hints.iter().enumerate() {
            let column: Vec<Lit> = (0..members).map(|m| values[k][m][i].clone()).collect();
            let present: Vec<&Lit> = column.iter().filter(|l| !matches!(l, Lit::Absent)).collect();
            if present.windows(2).all(|w| w[0] == w[1]) {
                row.push(SlotUse::Lit(present.first().map_or(Lit::Absent, |l| (*l).clone())));
                continue;
            }
            let same = knobs.iter().position(|(_, vals)| vals.len() == column.len() && vals.iter().zip(&column).all(|(a, b)| a.matches(b)));
            if let Some(j) = same {
                for (slot, v) in knobs[j].1.iter_mut().zip(&column) {
                    if matches!(slot, Lit::Absent) {
                        *slot = v.clone();
                    }
                }
                row.push(SlotUse::Knob(j));
                continue;
            }
            let mut name = ident(hint);
            if knobs.iter().any(|(n, _)| *n == name) && !prefixes[k].is_empty() {
                name = format!("{}_{}", prefixes[k], name);
            }
            let base = name.clone();
            let mut n = 1;
            while knobs.iter().any(|(existing, _)| *existing == name) {
                n += 1;
                name = format!("{base}_{n}");
            }
            knobs.push((name, column));
            row.push(SlotUse::Knob(knobs.len() - 1));
        }
        uses.push(row);
    }
    // An absent value of a knob takes another member's (it is never read: its statement is absent).
    for (_, vals) in &mut knobs {
        let fill = vals.iter().find(|l| !matches!(l, Lit::Absent)).cloned().unwrap_or(Lit::Bool(false));
        vals.iter_mut().filter(|l| matches!(l, Lit::Absent)).for_each(|l| *l = fill.clone());
    }
    (knobs, uses)
}

pub(super) fn config_name(def: &TypeDef<'_>) -> String {
    format!("{}Config", def.name)
}

// ---- writing

/// How a slot is written where it is used: `cfg.<knob>` while loading, `self.<knob>` in `forward`.
fn render_slots(def: &TypeDef<'_>, k: usize, owner: &str) -> Vec<R> {
    def.slots[k]
        .iter()
        .map(|u| match u {
            SlotUse::Lit(l) => R { text: l.expr(), literal: Some(l.clone()) },
            SlotUse::Knob(j) => R { text: format!("{owner}.{}", def.knobs[*j].0), literal: None },
        })
        .collect()
}

/// Writes every struct and the entry function.
pub(super) struct Writer<'t, 'g, 'a, 'w> {
    types: &'w Types<'t, 'g, 'a>,
    opts: &'w CodegenOptions,
}

impl<'t, 'g, 'a, 'w> Writer<'t, 'g, 'a, 'w> {
    pub fn new(types: &'w Types<'t, 'g, 'a>, opts: &'w CodegenOptions) -> Self {
        Self { types, opts }
    }

    fn graph(&self) -> &Graph {
        self.types.tree.graph
    }

    /// One field of a struct: its Rust name, `state_dict` segment and statement indices.
    fn fields(&self, t: usize) -> Vec<Field> {
        let def = &self.types.defs[t];
        let rep = def.members[0];
        let mut fields: Vec<Field> = Vec::new();
        for (k, s) in rep.stmts.iter().enumerate() {
            match s {
                Stmt::Call { field, .. } => match fields.iter_mut().find(|f| f.segment == *field && !f.param) {
                    Some(f) => f.stmts.push(k),
                    None => fields.push(Field { name: String::new(), segment: field.clone(), stmts: vec![k], param: false }),
                },
                Stmt::Op { params, .. } => {
                    for p in params {
                        if !fields.iter().any(|f| f.param && f.segment == p.name) {
                            fields.push(Field { name: p.field.clone(), segment: p.name.clone(), stmts: vec![k], param: true });
                        }
                    }
                }
            }
        }
        let mut taken = BTreeSet::new();
        for f in &mut fields {
            let base = if !f.name.is_empty() {
                f.name.clone()
            } else if f.segment.contains('.') {
                ident(&f.segment)
            } else if f.segment.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && ident(&f.segment) == f.segment {
                f.segment.clone()
            } else {
                short_field(&self.field_type(t, f.stmts[0]).0)
            };
            let mut name = base.clone();
            let mut n = 1;
            while !taken.insert(name.clone()) {
                n += 1;
                name = format!("{base}_{n}");
            }
            f.name = name;
        }
        fields
    }

    /// The Rust type of the child called by statement `k` of struct `t`'s first member, and
    /// whether it is a `Vec` element type.
    fn field_type(&self, t: usize, k: usize) -> (String, bool) {
        let rep = self.types.defs[t].members[0];
        match &rep.stmts[k] {
            Stmt::Call { child: Child::Layer(n), .. } => {
                (layer(self.graph(), *n, &self.graph().nodes[*n].path).map_or("?", |l| l.ty).to_string(), false)
            }
            Stmt::Call { child: Child::Module(c), .. } => {
                let def = &self.types.defs[self.types.type_of(c).0];
                match def.vec_of {
                    Some(e) => (self.types.defs[e].name.clone(), true),
                    None => (def.name.clone(), false),
                }
            }
            Stmt::Op { .. } => ("Param".into(), false),
        }
    }
}

pub(super) struct Field {
    pub name: String,
    pub segment: String,
    pub stmts: Vec<usize>,
    pub param: bool,
}

/// A field name for a child named by its index (`nn.Sequential`'s `0`), after its type.
fn short_field(ty: &str) -> String {
    let known = [
        ("Conv2d", "conv"),
        ("ConvTranspose2d", "deconv"),
        ("BatchNorm2d", "bn"),
        ("Linear", "linear"),
        ("ReLU", "relu"),
        ("ReLU6", "relu6"),
        ("SiLU", "silu"),
        ("GELU", "gelu"),
        ("MaxPool2d", "maxpool"),
        ("AvgPool2d", "avgpool"),
        ("AdaptiveAvgPool2d", "avgpool"),
        ("LayerNorm", "norm"),
        ("LayerNorm2d", "norm"),
        ("Upsample", "upsample"),
    ];
    known.iter().find(|(t, _)| *t == ty).map_or_else(|| snake(ty), |(_, f)| f.to_string())
}

fn snake(s: &str) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if c.is_ascii_uppercase() {
            let prev_lower = i > 0 && s.chars().nth(i - 1).is_some_and(|p| p.is_ascii_lowercase() || p.is_ascii_digit());
            if prev_lower {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

impl Writer<'_, '_, '_, '_> {
    /// The expression loading field `f` of struct `t` (`cfg` is its config).
    fn load_expr(&self, t: usize, f: &Field, derive: bool) -> (Vec<String>, String) {
        let def = &self.types.defs[t];
        let k = f.stmts[0];
        let slots = render_slots(def, k, "cfg");
        let rep = def.members[0];
        let optional = def.skipped.iter().any(|s| s[k]);
        let (ty, is_vec) = self.field_type(t, k);
        let mut attrs = Vec::new();
        if f.name != f.segment && !f.param {
            attrs.push(format!("name = {:?}", f.segment));
        }
        let config = match &rep.stmts[k] {
            Stmt::Call { child: Child::Layer(n), .. } => layer(self.graph(), *n, &self.graph().nodes[*n].path)
                .and_then(|l| l.config)
                .map(|c| (c.render)(&slots, &Operands::default())),
            Stmt::Call { child: Child::Module(c), .. } => self.child_config(c, &slots, is_vec, &mut attrs),
            Stmt::Op { .. } => None,
        };
        if optional {
            attrs.push(format!("when = {}", slots.last().map_or("true".into(), |r| r.text.clone())));
        }
        if let Some(c) = &config {
            attrs.push(format!("config = {c}"));
        }
        let _ = derive;
        (attrs, ty)
    }

    /// The config expression of a child struct (`BasicBlockConfig { stride: 2, .. }`), or of a
    /// `Vec` field's element `i` (with its `len`).
    fn child_config(&self, c: &Instance, slots: &[R], is_vec: bool, attrs: &mut Vec<String>) -> Option<String> {
        let def = &self.types.defs[self.types.type_of(c).0];
        if is_vec {
            let slot = &slots[0];
            let elem = &self.types.defs[def.vec_of?];
            return match &slot.literal {
                Some(Lit::Usize(n)) => {
                    attrs.push(format!("len = {n}"));
                    None
                }
                None if elem.knobs.is_empty() => {
                    attrs.push(format!("len = {}", slot.text));
                    None
                }
                Some(Lit::Configs(_, items)) => {
                    attrs.push(format!("len = {}", items.len()));
                    if elem.knobs.is_empty() {
                        None
                    } else if items.windows(2).all(|w| w[0] == w[1]) {
                        Some(items[0].expr())
                    } else if items[1..].windows(2).all(|w| w[0] == w[1]) {
                        Some(format!("if i == 0 {{ {} }} else {{ {} }}", items[0].expr(), items[1].expr()))
                    } else {
                        Some(format!("{}[i]", slot.text))
                    }
                }
                _ => {
                    attrs.push(format!("len = {}.len()", slot.text));
                    (!elem.knobs.is_empty()).then(|| format!("{}[i]", slot.text))
                }
            };
        }
        if def.knobs.is_empty() {
            return None;
        }
        let fields: Vec<String> = def
            .knobs
            .iter()
            .zip(slots)
            .map(|((k, v), r)| match &r.literal {
                Some(lit) => format!("{k}: {}", lit.value()),
                None => format!("{k}: {}{}", r.text, if v[0].is_copy() { "" } else { ".clone()" }),
            })
            .collect();
        Some(format!("{} {{ {} }}", config_name(def), fields.join(", ")))
    }
}

// ---- forward bodies

impl Writer<'_, '_, '_, '_> {
    /// Whether struct `t`'s `forward` reads a knob or a weight (then it stores them, and its
    /// `load` is written by hand rather than derived).
    fn needs_state(&self, t: usize) -> (bool, BTreeSet<usize>) {
        let def = &self.types.defs[t];
        let rep = def.members[0];
        let mut knobs = BTreeSet::new();
        let mut params = false;
        for (k, s) in rep.stmts.iter().enumerate() {
            if let Stmt::Op { params: p, node, args } = s {
                params |= !p.is_empty();
                let used = inline(&self.graph().nodes[*node].op, args.len(), p.len()).slots.len();
                for u in &def.slots[k][..used] {
                    if let SlotUse::Knob(j) = u {
                        knobs.insert(*j);
                    }
                }
            }
        }
        (params, knobs)
    }

    /// The body of struct `t`'s forward, with its arguments named `args`. A value read once, by
    /// the next statement, is written inside it (`self.bn1.forward(&self.conv1.forward(x)?)?`).
    fn body(&self, t: usize, fields: &[Field], args: &[String]) -> String {
        let rep = self.types.defs[t].members[0];
        let uses = use_counts(rep);
        let last_use = last_uses(rep);
        let rets = rep.rets_vals();
        let mut vars: Vec<Vec<String>> = Vec::new();
        let mut taken: BTreeMap<String, usize> = BTreeMap::new();
        // The expression of the previous statement, to be written inside this one, and how many
        // calls deep it is.
        let mut pending: Option<(usize, String, usize)> = None;
        let mut lines = Vec::new();
        let mut tail = false;
        for (k, s) in rep.stmts.iter().enumerate() {
            let mut ops = Operands::default();
            let mut depth = 1;
            for a in s.args() {
                let (text, is_ref) = match (a, &pending) {
                    (Val::Arg(i), _) => (args[*i].clone(), true),
                    (Val::Out(j, _), Some((p, e, d))) if p == j => {
                        depth = d + 1;
                        (e.clone(), false)
                    }
                    (Val::Out(j, o), _) => (vars[*j][*o].clone(), false),
                };
                ops.by_ref.push(if is_ref { text.clone() } else { format!("&{text}") });
                ops.recv.push(text);
            }
            let expr = self.stmt_expr(t, k, s, fields, &ops);
            pending = None;
            vars.push(vec![String::new(); s.outs()]);
            let out = Val::Out(k, 0);
            let inline_next = s.outs() == 1
                && depth < MAX_DEPTH
                && uses.get(&out) == Some(&1)
                && rep.stmts.get(k + 1).is_some_and(|n| n.args().contains(&out))
                && self.reads_once(t, k + 1, out);
            if inline_next {
                pending = Some((k, expr, depth));
            } else if k + 1 == rep.stmts.len() && rets == [out] {
                lines.push(unwrap_parens(expr.strip_suffix('?').unwrap_or(&expr)).to_string());
                tail = true;
            } else {
                let names: Vec<String> = (0..s.outs()).map(|o| self.var_name(s, o, k, &mut taken, &last_use)).collect();
                let bind = if names.len() == 1 { names[0].clone() } else { format!("({})", names.join(", ")) };
                lines.push(format!("let {bind} = {expr};"));
                vars[k] = names;
            }
        }
        if !tail {
            let rets: Vec<String> = rets
                .iter()
                .map(|v| match v {
                    Val::Arg(i) => format!("{}.clone()", args[*i]),
                    Val::Out(j, o) => vars[*j][*o].clone(),
                })
                .collect();
            lines.push(if rets.len() == 1 { format!("Ok({})", rets[0]) } else { format!("Ok(({}))", rets.join(", ")) });
        }
        lines.iter().map(|l| format!("        {l}\n")).collect()
    }

    /// Whether statement `k`'s expression names the value `v` once, and not as the start of a
    /// `Vec`'s fold (an expression written in
    /// place of a value named twice, as in `x.binary_weight(&x.scope_path(..))`, would run twice).
    fn reads_once(&self, t: usize, k: usize, v: Val) -> bool {
        let rep = self.types.defs[t].members[0];
        let Some(s) = rep.stmts.get(k) else { return false };
        let mark = |i: usize, a: &Val| if *a == v { "ARG#".to_string() } else { format!("a{i}") };
        let ops = Operands {
            recv: s.args().iter().enumerate().map(|(i, a)| mark(i, a)).collect(),
            by_ref: s.args().iter().enumerate().map(|(i, a)| format!("&{}", mark(i, a))).collect(),
            params: vec![],
        };
        let expr = self.stmt_expr(t, k, s, &[], &ops);
        expr.matches("ARG#").count() == 1 && !expr.contains("try_fold")
    }

    fn var_name(&self, s: &Stmt, o: usize, k: usize, taken: &mut BTreeMap<String, usize>, last_use: &BTreeMap<Val, usize>) -> String {
        let base = match s {
            Stmt::Call { field, outs, .. } => {
                let f = if field.chars().all(|c| c.is_ascii_digit()) { format!("x{field}") } else { ident(field) };
                if outs.len() > 1 {
                    format!("{f}_{o}")
                } else {
                    f
                }
            }
            Stmt::Op { node, .. } => ident(self.graph().nodes[*node].op.name()),
        };
        let mut name = base.clone();
        let mut n = 1;
        // A name may be reused (shadowed) once its previous value is read no more.
        while taken.get(&name).is_some_and(|&until| until > k) {
            n += 1;
            name = format!("{base}_{n}");
        }
        taken.insert(name.clone(), last_use.get(&Val::Out(k, o)).copied().unwrap_or(usize::MAX));
        name
    }

    /// Statement `k`'s expression, with `?`.
    fn stmt_expr(&self, t: usize, k: usize, s: &Stmt, fields: &[Field], ops: &Operands) -> String {
        let def = &self.types.defs[t];
        let field_name = |k: usize| fields.iter().find(|f| f.stmts.contains(&k) && !f.param).map_or(String::new(), |f| f.name.clone());
        match s {
            Stmt::Call { child: Child::Module(c), .. } if self.types.defs[self.types.type_of(c).0].vec_of.is_some() => {
                let x = ops.recv[0].trim_start_matches('&');
                format!("self.{}.iter().try_fold({x}.clone(), |x, m| m.forward(&x))?", field_name(k))
            }
            Stmt::Call { .. } => format!("self.{}.forward({})?", field_name(k), ops.by_ref.join(", ")),
            Stmt::Op { node, params, args } => {
                let tpl: Tpl = inline(&self.graph().nodes[*node].op, args.len(), params.len());
                let slots = render_slots(def, k, "self");
                let mut ops = ops.clone();
                ops.params = params
                    .iter()
                    .map(|p| {
                        format!(
                            "&self.{}",
                            fields.iter().find(|f| f.param && f.segment == p.name).map_or(p.field.as_str(), |f| f.name.as_str())
                        )
                    })
                    .collect();
                (tpl.render)(&slots, &ops)
            }
        }
    }
}

/// `(a + b)` as `a + b` (the tail of a body needs no parentheses).
fn unwrap_parens(e: &str) -> &str {
    let Some(inner) = e.strip_prefix('(').and_then(|r| r.strip_suffix(')')) else { return e };
    let mut depth = 0i32;
    for c in inner.chars() {
        depth += match c {
            '(' | '[' | '{' => 1,
            ')' | ']' | '}' => -1,
            _ => 0,
        };
        if depth < 0 {
            return e;
        }
    }
    inner
}

/// The most calls written inside one another in one statement (`relu(bn(conv(x)))`).
const MAX_DEPTH: usize = 3;

/// How often each value of a body is read (returns included).
fn use_counts(inst: &Instance) -> BTreeMap<Val, usize> {
    let mut uses = BTreeMap::new();
    for s in &inst.stmts {
        for a in s.args() {
            *uses.entry(*a).or_insert(0) += 1;
        }
    }
    for r in inst.rets_vals() {
        *uses.entry(r).or_insert(0) += 1;
    }
    uses
}

/// The last statement reading each value (returns count as after the last statement).
fn last_uses(inst: &Instance) -> BTreeMap<Val, usize> {
    let mut last = BTreeMap::new();
    for (k, s) in inst.stmts.iter().enumerate() {
        for a in s.args() {
            last.insert(*a, k);
        }
    }
    for r in inst.rets_vals() {
        last.insert(r, inst.stmts.len());
    }
    last
}

// ---- structs

impl Writer<'_, '_, '_, '_> {
    fn doc(&self, t: usize) -> String {
        let def = &self.types.defs[t];
        let paths: Vec<String> = def.members.iter().map(|m| m.path.clone()).collect();
        let mut shown: Vec<String> = Vec::new();
        for p in &paths {
            if !shown.contains(p) {
                shown.push(p.clone());
            }
        }
        let n = shown.len();
        let listed: Vec<String> = shown.iter().take(4).map(|p| if p.is_empty() { "the model".into() } else { format!("`{p}`") }).collect();
        let more = if n > 4 { format!(" and {} more", n - 4) } else { String::new() };
        format!("/// `{}`: {}{more}.\n", def.class, listed.join(", "))
    }

    /// The config struct of `t`, if it has knobs.
    fn config_struct(&self, t: usize) -> String {
        let def = &self.types.defs[t];
        if def.knobs.is_empty() {
            return String::new();
        }
        let copy = def.knobs.iter().all(|(_, v)| v[0].is_copy());
        let mut s = format!("/// What differs between the calls of [`{}`].\n", def.name);
        s += if copy { "#[derive(Clone, Copy, Debug, PartialEq)]\n" } else { "#[derive(Clone, Debug, PartialEq)]\n" };
        s += &format!("pub struct {} {{\n", config_name(def));
        for (k, v) in &def.knobs {
            s += &format!("    pub {k}: {},\n", v[0].ty());
        }
        s + "}\n\n"
    }

    /// The struct, its `load` (derived, or written out when `forward` needs stored values) and
    /// its `forward`.
    pub fn structure(&self, t: usize) -> String {
        let def = &self.types.defs[t];
        if def.vec_of.is_some() {
            return String::new();
        }
        let fields = self.fields(t);
        let (params, knobs) = self.needs_state(t);
        // A list element called by its index (`cv2.1`) loads from a dotted path, which
        // `#[module(name = ..)]` does not take.
        let manual = params || !knobs.is_empty() || fields.iter().any(|f| f.segment.contains('.'));
        let mut s = self.config_struct(t) + &self.doc(t);
        if manual {
            s += &self.manual_struct(t, &fields, &knobs);
        } else {
            s += &self.derived_struct(t, &fields);
        }
        s + "\n" + &self.forward(t, &fields)
    }

    fn field_ty(&self, t: usize, f: &Field) -> String {
        let def = &self.types.defs[t];
        let (ty, is_vec) = self.field_type(t, f.stmts[0]);
        if is_vec {
            format!("Vec<{ty}>")
        } else if def.skipped.iter().any(|s| s[f.stmts[0]]) && !f.param {
            format!("Option<{ty}>")
        } else {
            ty
        }
    }

    fn derived_struct(&self, t: usize, fields: &[Field]) -> String {
        let def = &self.types.defs[t];
        let mut s = String::from("#[derive(Module)]\n");
        if !def.knobs.is_empty() {
            s += &format!("#[module(config = {})]\n", config_name(def));
        }
        s += &format!("pub struct {} {{\n", def.name);
        for f in fields {
            let (attrs, _) = self.load_expr(t, f, true);
            if !attrs.is_empty() {
                s += &format!("    #[module({})]\n", attrs.join(", "));
            }
            s += &format!("    {}: {},\n", f.name, self.field_ty(t, f));
        }
        s + "}\n"
    }

    fn manual_struct(&self, t: usize, fields: &[Field], knobs: &BTreeSet<usize>) -> String {
        let def = &self.types.defs[t];
        let mut s = format!("pub struct {} {{\n", def.name);
        for f in fields {
            s += &format!("    {}: {},\n", f.name, self.field_ty(t, f));
        }
        for &j in knobs {
            s += &format!("    {}: {},\n", def.knobs[j].0, def.knobs[j].1[0].ty());
        }
        s += "}\n\n";
        let cfg = if def.knobs.is_empty() { "()".to_string() } else { config_name(def) };
        s += &format!("impl Module for {} {{\n    type Config = {cfg};\n", def.name);
        let used = if def.knobs.is_empty() { "_cfg" } else { "cfg" };
        s += &format!("    fn load(vb: VarBuilder, {used}: &{cfg}) -> Result<Self> {{\n        Ok(Self {{\n");
        for f in fields {
            s += &format!("            {}: {},\n", f.name, self.manual_load(t, f));
        }
        for &j in knobs {
            let k = &def.knobs[j].0;
            s += &format!("            {k}: cfg.{k}{},\n", if def.knobs[j].1[0].is_copy() { "" } else { ".clone()" });
        }
        s + "        })\n    }\n}\n"
    }

    /// A field's load expression in a hand-written `load`.
    fn manual_load(&self, t: usize, f: &Field) -> String {
        let def = &self.types.defs[t];
        if f.param {
            let k = f.stmts[0];
            let rep = def.members[0];
            let Stmt::Op { params, .. } = &rep.stmts[k] else { return "?".into() };
            let i = params.iter().position(|p| p.name == f.segment).unwrap_or(0);
            let slots = render_slots(def, k, "cfg");
            let shape_slot = &slots[slots.len() - params.len() + i];
            return format!("vb.get(&{}, {:?})?", shape_slot.text, f.segment);
        }
        let (attrs, ty) = self.load_expr(t, f, false);
        let get = |key: &str| attrs.iter().find_map(|a| a.strip_prefix(&format!("{key} = ")).map(str::to_string));
        let config = get("config").map_or("&Default::default()".to_string(), |c| format!("&({c})"));
        let vb = format!("vb.pp({:?})", f.segment);
        if let Some(len) = get("len") {
            return format!("(0..{len}).map(|i| {ty}::load({vb}.pp(i), {config})).collect::<Result<_>>()?");
        }
        if let Some(when) = get("when") {
            return format!("if {when} {{ Some({ty}::load({vb}, {config})?) }} else {{ None }}");
        }
        format!("{ty}::load({vb}, {config})?")
    }

    fn forward(&self, t: usize, fields: &[Field]) -> String {
        let def = &self.types.defs[t];
        let rep = def.members[0];
        let args: Vec<String> = if rep.path.is_empty() {
            rep.args.iter().map(|&a| ident(&self.graph().nodes[a].path)).collect()
        } else if rep.args.len() == 1 {
            vec!["x".into()]
        } else {
            (0..rep.args.len()).map(|i| format!("x{i}")).collect()
        };
        let body = self.body(t, fields, &args);
        let params: Vec<String> = args.iter().map(|a| format!("{a}: &Tensor")).collect();
        if rep.args.len() == 1 && rep.rets.len() == 1 {
            return format!(
                "impl Forward for {} {{\n    fn forward(&self, {}) -> Result<Tensor> {{\n{body}    }}\n}}\n",
                def.name, params[0]
            );
        }
        let ret = if rep.rets.len() == 1 { "Tensor".to_string() } else { format!("({})", vec!["Tensor"; rep.rets.len()].join(", ")) };
        format!("impl {} {{\n    pub fn forward(&self, {}) -> Result<{ret}> {{\n{body}    }}\n}}\n", def.name, params.join(", "))
    }
}

// ---- the file

/// Kiln names the generated code may use; those it does are imported.
const KILN_NAMES: &[&str] = &[
    "AdaptiveAvgPool2d",
    "Attention",
    "AvgPool2d",
    "BatchNorm2d",
    "BatchNorm2dConfig",
    "Binary",
    "Conv2d",
    "Conv2dConfig",
    "ConvAttrs",
    "ConvTranspose2d",
    "CustomCall",
    "Forward",
    "GELU",
    "Gemm",
    "Graph",
    "Hardsigmoid",
    "Hardswish",
    "Hardtanh",
    "LayerNorm",
    "LayerNorm2d",
    "LayerNormConfig",
    "LeakyReLU",
    "LeakyReLUConfig",
    "Linear",
    "LinearConfig",
    "MaxPool2d",
    "Module",
    "Norm",
    "Op",
    "Param",
    "Pool",
    "Pool2dConfig",
    "PoolAttrs",
    "QkvAttention",
    "ReLU",
    "ReLU6",
    "Resize",
    "Result",
    "SiLU",
    "ShapeOp",
    "Sigmoid",
    "Softmax",
    "Tanh",
    "Tensor",
    "Tracer",
    "Unary",
    "Upsample",
    "UpsampleConfig",
    "VarBuilder",
    "Activation",
];

fn words(code: &str) -> BTreeSet<&str> {
    code.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .flat_map(|l| l.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')))
        .filter(|w| !w.is_empty())
        .collect()
}

/// The Rust source of graph `graph` (exported by kiln-torch) as Kiln modules, and a function
/// `fn_name(vb, batch)` that loads them and traces them again. Lay it out with rustfmt.
pub fn generate(graph: &Graph, opts: &CodegenOptions) -> Result<String> {
    let tree = Tree::new(graph)?;
    let root = tree.root()?;
    let types = Types::new(&tree, &root)?;
    let writer = Writer::new(&types, opts);
    let mut body = String::new();
    for t in 0..types.defs.len() {
        let s = writer.structure(t);
        if !s.is_empty() {
            body += &s;
            body += "\n";
        }
    }
    body += &writer.entry(types.defs.len() - 1)?;
    let used = words(&body);
    let names = KILN_NAMES.iter().copied().chain(Unary::layer_names().into_iter().filter(|n| !KILN_NAMES.contains(n)));
    let kiln: Vec<&str> = names.filter(|n| used.contains(n) && !types.defs.iter().any(|d| d.name == *n)).collect();
    let mut src = format!("//! {} as Kiln modules, generated by `{}` from its graph file.\n", opts.model, opts.command);
    src += "//!\n//! One struct per PyTorch module class, its fields named as the `state_dict`; what differs between the\n";
    src += "//! calls of a class is its config. Load the weights with `VarBuilder::from_safetensors` (the graph\n";
    src += "//! file holds them) and `check_all_used` for a strict check.\n\n";
    if used.contains("BTreeMap") {
        src += "use std::collections::BTreeMap;\n\n";
    }
    src += &super::kiln_uses(&kiln, usize::MAX);
    Ok(src + &body)
}

impl Writer<'_, '_, '_, '_> {
    /// `pub fn <fn_name>(vb: VarBuilder, batch: usize) -> Result<Graph>`: loads the root struct
    /// and traces it on the graph's inputs (batch `batch`), marking its outputs.
    fn entry(&self, root: usize) -> Result<String> {
        let g = self.graph();
        let def = &self.types.defs[root];
        let inst = def.members[0];
        let batch = g.inputs.first().and_then(|&i| g.nodes[i].shape.first().copied());
        let mut s = format!("/// Loads {} from `vb` and traces it for a batch of `batch` inputs.\n", self.opts.model);
        s += &format!("pub fn {}(vb: VarBuilder, batch: usize) -> Result<Graph> {{\n", self.opts.fn_name);
        let cfg = if def.knobs.is_empty() { "()".to_string() } else { self.types.config_lit(root, 0).expr() };
        s += &format!("    let model = {}::load(vb, &{cfg})?;\n    let tracer = Tracer::new();\n", def.name);
        let mut names = Vec::new();
        for &i in &inst.args {
            let Op::Input { name } = &g.nodes[i].op else {
                return Err(Error::Codegen { reason: format!("the model reads %{i}, which is not an input") });
            };
            let dims: Vec<String> = g.nodes[i]
                .shape
                .iter()
                .enumerate()
                .map(|(d, n)| if d == 0 && Some(*n) == batch { "batch".into() } else { n.to_string() })
                .collect();
            let v = ident(name);
            s += &format!("    let {v} = tracer.input({name:?}, &[{}]);\n", dims.join(", "));
            names.push(format!("&{v}"));
        }
        let outs: Vec<String> = g
            .outputs
            .iter()
            .map(|(n, _)| ident(n))
            .map(|n| if names.iter().any(|i| i.trim_start_matches('&') == n) { format!("{n}_out") } else { n })
            .collect();
        let bind = if outs.len() == 1 { outs[0].clone() } else { format!("({})", outs.join(", ")) };
        s += &format!("    let {bind} = model.forward({})?;\n", names.join(", "));
        for ((name, _), v) in g.outputs.iter().zip(&outs) {
            s += &format!("    tracer.output({name:?}, &{v});\n");
        }
        Ok(s + "    Ok(tracer.graph())\n}\n")
    }
}
