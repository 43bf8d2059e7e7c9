//! `forward` bodies: each statement of a struct's calls as a Module DSL expression, a value read
//! once by the next statement written inside it.

use super::fields::Field;
use super::types::SlotUse;
use super::{render_slots, Writer};
use crate::codegen::ident;
use crate::codegen::layers::{inline, Operands, Tpl};
use crate::codegen::tree::{Child, Instance, Stmt, Val};
use std::collections::{BTreeMap, BTreeSet};

impl Writer<'_, '_, '_, '_> {
    /// Whether struct `t`'s `forward` reads a knob or a weight (then it stores them, and its
    /// `load` is written by hand rather than derived).
    pub(super) fn needs_state(&self, t: usize) -> (bool, BTreeSet<usize>) {
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
    pub(super) fn body(&self, t: usize, fields: &[Field], args: &[String]) -> String {
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
