//! Grouping the calls of the module tree into structs ([`Types`]): the calls of one class whose
//! bodies agree (some of them perhaps lacking optional children, as `downsample`) are one struct,
//! children before parents, each named after its class.

use crate::codegen::layers::{layer, Lit};
use crate::codegen::tree::{last, Child, Instance, Stmt, Tree, Val, IMPLICIT_LIST};
use crate::graph::Op;
use crate::graph::Unary;
use crate::Result;
use std::collections::{BTreeMap, HashMap};

/// What a struct is made of.
pub(super) struct TypeDef<'a> {
    pub name: String,
    pub class: String,
    /// The calls it is, the first of which has every statement.
    pub(super) members: Vec<&'a Instance>,
    /// Per member: which of the first member's statements it lacks (optional children).
    pub(super) skipped: Vec<Vec<bool>>,
    /// The configuration: name and each member's value.
    pub(super) knobs: Knobs,
    /// Per statement of the first member, per slot: a literal, or a knob's index.
    pub(super) slots: Vec<Vec<SlotUse>>,
    /// An `nn.Sequential` of one struct: written as a `Vec` of it in the parent.
    pub(super) vec_of: Option<usize>,
}

/// A struct's config fields: each knob's name and its value in each member.
pub(super) type Knobs = Vec<(String, Vec<Lit>)>;

#[derive(Clone, Debug)]
pub(super) enum SlotUse {
    Lit(Lit),
    Knob(usize),
}

/// All structs, children first; and which struct and member each call is.
pub(super) struct Types<'t, 'g, 'a> {
    pub(super) tree: &'t Tree<'g>,
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
    pub(super) fn type_of(&self, inst: &Instance) -> (usize, usize) {
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

    pub(super) fn child_path(&self, n: usize) -> String {
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
    pub(super) fn outs(&self) -> usize {
        match self {
            Stmt::Call { outs, .. } => outs.len(),
            Stmt::Op { .. } => 1,
        }
    }
    /// A call that may be absent from some calls of its parent's class (`downsample`).
    fn skippable(&self) -> bool {
        matches!(self, Stmt::Call { args, outs, .. } if args.len() == 1 && outs.len() == 1)
    }
    pub(super) fn module(&self) -> Option<&Instance> {
        match self {
            Stmt::Call { child: Child::Module(c), .. } => Some(c),
            _ => None,
        }
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
