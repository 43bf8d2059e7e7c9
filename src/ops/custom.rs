//! User-defined ops. A crate registers a `CustomOp` (shape rule + CPU reference) with
//! `inventory::submit!`, and a GPU converter under the same name (see `engine`), without
//! touching Kiln. Tracing applies it with `Tensor::custom(name, attrs, others)`.

use crate::engine::{BuildCtx, Layer, Layout};
use crate::graph::{HostTensor, NodeId};
use crate::ops::{CpuArgs, LayoutPlan, OpDef};
use crate::registry::build_table;
use crate::tensor::Tensor;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::sync::OnceLock;

pub type Attrs = BTreeMap<String, f64>;

/// A node applying a registered custom op: its name and its named scalar attributes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CustomCall {
    pub name: String,
    pub attrs: Attrs,
}

impl CustomCall {
    fn registered(&self) -> std::result::Result<&'static CustomOp, String> {
        lookup(&self.name).ok_or_else(|| format!("custom op `{}` is not registered", self.name))
    }
}

impl Tensor {
    /// Applies a user-registered custom op (see `ops::custom`).
    pub fn custom(&self, name: &str, attrs: &[(&str, f64)], others: &[&Tensor]) -> Result<Tensor> {
        let attrs = attrs.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        let mut inputs = vec![self];
        inputs.extend_from_slice(others);
        Tensor::record_inline(crate::graph::Op::Custom(CustomCall { name: name.to_string(), attrs }), &inputs)
    }
}

/// Custom ops go through the same interface as the built-in ones: the shape rule and CPU
/// reference of their `CustomOp` registration, and the converter registered under their name.
/// Their converters see activations in the engine's native layout (`Layout::native`): NHWC for
/// images, PyTorch's order otherwise.
impl OpDef for CustomCall {
    fn name(&self) -> &str {
        &self.name
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> std::result::Result<Vec<usize>, String> {
        self.registered()?.infer_shape(&self.attrs, inputs)
    }
    fn cpu(&self, args: &mut CpuArgs) -> std::result::Result<HostTensor, String> {
        let op = self.registered()?;
        let inputs = args.all()?;
        let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
        let expected = op.infer_shape(&self.attrs, &shapes)?;
        let out = (op.cpu)(&self.attrs, &inputs).map_err(|e| e.to_string())?;
        if out.shape != expected || out.data.len() != expected.iter().product::<usize>() {
            return Err(format!(
                "its CPU reference returned shape {:?} ({} values), but its shape rule says {expected:?}",
                out.shape,
                out.data.len()
            ));
        }
        Ok(out)
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        LayoutPlan { inputs: inputs.iter().map(|l| l.map(|l| Layout::native(l.rank()))).collect(), output: Layout::native(out_rank) }
    }
    fn colour(&self) -> &'static str {
        "#cdb4db"
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        let path = ctx.node(node).path.clone();
        let conv =
            crate::engine::converter(&self.name)?.ok_or_else(|| Error::NoConverter { backend: "GPU", op: self.name.clone(), path })?;
        (conv.convert)(ctx, node)
    }
    fn label(&self) -> String {
        let attrs: Vec<String> = self.attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!("{} {}", self.name, attrs.join(" "))
    }
}

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
    attrs.get(key).copied().ok_or_else(|| Error::Attribute { op: op.to_string(), key: key.to_string() })
}
