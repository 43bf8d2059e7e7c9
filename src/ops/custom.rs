//! User-defined ops. A crate registers a `CustomOp` (shape rule + CPU reference) with
//! `inventory::submit!`, and a GPU converter under the same name (see `engine`), without
//! touching Kiln. Tracing applies it with `Tensor::custom(name, attrs, others)`.

use crate::graph::HostTensor;
use crate::registry::build_table;
use crate::{Error, Result};
use std::collections::{BTreeMap, HashMap};
use std::sync::OnceLock;

pub type Attrs = BTreeMap<String, f64>;

/// A shape rule: output shape from the attributes and input shapes, or why they do not fit.
pub type ShapeRule = fn(&Attrs, &[&[usize]]) -> Result<Vec<usize>, String>;

/// A custom op's registration: its name, shape rule and CPU reference.
pub struct CustomOp {
    pub name: &'static str,
    pub infer_shape: ShapeRule,
    pub cpu: fn(&Attrs, &[&HostTensor]) -> Result<HostTensor>,
}

impl CustomOp {
    pub fn infer_shape(&self, attrs: &Attrs, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        (self.infer_shape)(attrs, inputs)
    }
}

inventory::collect!(CustomOp);

fn table() -> &'static Result<HashMap<&'static str, &'static CustomOp>, String> {
    static TABLE: OnceLock<Result<HashMap<&'static str, &'static CustomOp>, String>> = OnceLock::new();
    TABLE.get_or_init(|| build_table(inventory::iter::<CustomOp>.into_iter(), |op| op.name))
}

/// The registered custom op `name`, if any.
pub fn lookup(name: &str) -> Option<&'static CustomOp> {
    table().as_ref().ok()?.get(name).copied()
}

/// Checks the registry once: a name registered twice is an error.
pub fn check_registry() -> Result<()> {
    match table() {
        Ok(_) => Ok(()),
        Err(op) => Err(Error::DuplicateConverter { op: op.clone() }),
    }
}

/// Reads a required attribute.
pub fn attr(attrs: &Attrs, op: &str, key: &str) -> Result<f64> {
    attrs.get(key).copied().ok_or_else(|| Error::Graph(format!("custom op `{op}` needs attribute `{key}`")))
}
