//! A struct's fields as the writer names them (after the `state_dict` segment, or the child's
//! type where the segment is an index), their Rust types, and how each is loaded.

use super::config::config_name;
use super::{render_slots, Writer};
use crate::codegen::ident;
use crate::codegen::layers::{layer, Lit, Operands, R};
use crate::codegen::tree::{Child, Instance, Stmt};
use std::collections::BTreeSet;

impl Writer<'_, '_, '_, '_> {
    /// One field of a struct: its Rust name, `state_dict` segment and statement indices.
    pub(super) fn fields(&self, t: usize) -> Vec<Field> {
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
    pub(super) fn field_type(&self, t: usize, k: usize) -> (String, bool) {
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
pub(super) fn short_field(ty: &str) -> String {
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

pub(super) fn snake(s: &str) -> String {
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
    pub(super) fn load_expr(&self, t: usize, f: &Field, derive: bool) -> (Vec<String>, String) {
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
