//! The GPU converters of custom ops, registered by name ([`register_converter!`](crate::register_converter)),
//! and the check that every op of a graph has one before any GPU work.

use super::layer::{BuildCtx, Layer};
use crate::graph::{Graph, NodeId, Op};
use crate::registry::build_table;
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::OnceLock;

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

type Table = HashMap<&'static str, &'static Converter>;

fn table() -> &'static std::result::Result<Table, String> {
    static TABLE: OnceLock<std::result::Result<Table, String>> = OnceLock::new();
    TABLE.get_or_init(|| build_table(inventory::iter::<Converter>.into_iter(), |c| c.op))
}

/// The converter registered for `op`; a registry with a duplicate name is an error for every op.
pub fn converter(op: &str) -> Result<Option<&'static Converter>> {
    match table() {
        Ok(t) => Ok(t.get(op).copied()),
        Err(dup) => Err(Error::DuplicateConverter { op: dup.clone() }),
    }
}

/// Ops the builder handles itself rather than through a converter.
pub(crate) fn is_structural(op: &Op) -> bool {
    op.is_leaf()
}

/// Checks, before any GPU work, that every custom op has a converter (built-in ops always have
/// one); the error names the op and the module path of the first node without one. Needs no GPU.
pub fn check_converters(graph: &Graph) -> Result<()> {
    for node in &graph.nodes {
        let Op::Custom(call) = &node.op else { continue };
        if converter(&call.name)?.is_none() {
            return Err(Error::NoConverter { backend: "GPU", op: node.op.name().to_string(), path: node.path.clone() });
        }
    }
    Ok(())
}
