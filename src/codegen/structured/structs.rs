//! Each struct as Rust source: its doc line, its config struct, the struct with its `load`
//! (derived, or written out when `forward` needs stored values) and its `forward`.

use super::config::config_name;
use super::fields::Field;
use super::{render_slots, Writer};
use crate::codegen::ident;
use crate::codegen::tree::Stmt;
use std::collections::BTreeSet;

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
