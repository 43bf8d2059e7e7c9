//! User-defined ops. A crate registers a `CustomOp` (shape rule + CPU reference) with
//! `inventory::submit!`, and a GPU converter under the same name (see `engine`), without
//! touching Kiln. Tracing applies it with `Tensor::custom(name, attrs, others)`.

use crate::engine::{Layer, Layout};
use crate::error::OpError;
use crate::graph::{HostTensor, NodeId};
use crate::ops::BuildCtx;
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
    fn registered(&self) -> std::result::Result<&'static CustomOp, OpError> {
        lookup(&self.name).ok_or_else(|| OpError::Attribute(format!("custom op `{}` is not registered", self.name)))
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
    fn infer_shape(&self, inputs: &[&[usize]]) -> std::result::Result<Vec<usize>, OpError> {
        self.registered()?.infer_shape(&self.attrs, inputs)
    }
    fn cpu(&self, args: &mut CpuArgs) -> std::result::Result<HostTensor, OpError> {
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
            )
            .into());
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
        let conv = converter(&self.name)?.ok_or_else(|| Error::NoConverter { backend: "GPU", op: self.name.clone(), path })?;
        (conv.convert)(ctx, node)
    }
    fn label(&self) -> String {
        let attrs: Vec<String> = self.attrs.iter().map(|(k, v)| format!("{k}={v}")).collect();
        format!("{} {}", self.name, attrs.join(" "))
    }
}

/// A shape rule: output shape from the attributes and input shapes, or why they do not fit (in
/// words: Kiln reports it as an `OpError::Shape` naming the node).
pub type ShapeRule = fn(&Attrs, &[&[usize]]) -> Result<Vec<usize>, String>;

/// A custom op's registration: its name, shape rule and CPU reference.
pub struct CustomOp {
    pub name: &'static str,
    pub infer_shape: ShapeRule,
    pub cpu: fn(&Attrs, &[&HostTensor]) -> Result<HostTensor>,
}

impl CustomOp {
    pub fn infer_shape(&self, attrs: &Attrs, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
        (self.infer_shape)(attrs, inputs).map_err(OpError::Shape)
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

// ---- GPU converters of custom ops: registered by name, checked before any GPU work

/// A custom op's GPU converter: lowers one node of the custom op `op` to an engine layer.
/// Register with [`register_converter!`](crate::register_converter) next to the op's
/// registration (built-in ops convert through `OpDef::convert`).
pub struct Converter {
    pub op: &'static str,
    pub convert: fn(&mut BuildCtx<'_>, NodeId) -> Result<Box<dyn Layer>>,
}

inventory::collect!(Converter);

/// Registers a GPU converter for `op` (the `Op::name()`, or a custom op's name):
/// `kiln::register_converter!("asinh", convert_asinh);` with
/// `fn convert_asinh(ctx: &mut kiln::plugin::BuildCtx, node: kiln::NodeId) -> kiln::Result<Box<dyn kiln::plugin::Layer>>`.
#[macro_export]
macro_rules! register_converter {
    ($op:expr, $convert:path) => {
        $crate::inventory::submit! {
            $crate::plugin::Converter { op: $op, convert: $convert }
        }
    };
}

type ConverterTable = HashMap<&'static str, &'static Converter>;

fn converter_table() -> &'static std::result::Result<ConverterTable, String> {
    static TABLE: OnceLock<std::result::Result<ConverterTable, String>> = OnceLock::new();
    TABLE.get_or_init(|| build_table(inventory::iter::<Converter>.into_iter(), |c| c.op))
}

/// The converter registered for `op`; a registry with a duplicate name is an error for every op.
pub fn converter(op: &str) -> Result<Option<&'static Converter>> {
    match converter_table() {
        Ok(t) => Ok(t.get(op).copied()),
        Err(dup) => Err(Error::DuplicateConverter { op: dup.clone() }),
    }
}

/// Checks, before any GPU work, that every custom op has a converter (built-in ops always have
/// one); the error names the op and the module path of the first node without one. Needs no GPU.
pub fn check_converters(graph: &crate::graph::Graph) -> Result<()> {
    for node in &graph.nodes {
        let crate::graph::Op::Custom(call) = &node.op else { continue };
        if converter(&call.name)?.is_none() {
            return Err(Error::NoConverter { backend: "GPU", op: node.op.name().to_string(), path: node.path.clone() });
        }
    }
    Ok(())
}
