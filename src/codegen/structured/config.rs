//! A struct's configuration: the slots whose values differ between its calls become its knobs
//! (`BasicBlockConfig { in_channels, out_channels, stride, downsample }`), each parent passing its
//! children's.

use super::fields::{short_field, snake};
use super::types::{Knobs, SlotUse, TypeDef, Types};
use crate::codegen::ident;
use crate::codegen::layers::{inline, layer, Lit, Slot};
use crate::codegen::tree::{Child, Instance, Stmt};
use crate::{Error, Result};

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
    pub(super) fn config_lit(&self, t: usize, m: usize) -> Lit {
        let def = &self.defs[t];
        Lit::Config(config_name(def), def.knobs.iter().map(|(k, v)| (k.clone(), v[m].clone())).collect())
    }

    /// Finds struct `t`'s knobs: the slots whose values differ between its members.
    pub(super) fn configure(&mut self, t: usize) -> Result<()> {
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
