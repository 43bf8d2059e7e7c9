//! Every op, one family a file. Each family is an enum (or attribute struct) that implements
//! [`OpDef`]: its name, shape rule, CPU reference, engine layouts, GPU converter, DOT label and
//! colour and the kernels it launches live together, with its engine layers, modules, `Tensor`
//! methods and fixture twins; `Op::def` is the one place that dispatches from the graph's `Op` to
//! them.
//!
//! Adding an op: add a variant to its family's enum (or a family file and one `Op` variant), fill
//! in the `OpDef` match arms the compiler then asks for, add a PyTorch fixture to
//! `tools/export_reference.py` and its Kiln twin to the family's `FIXTURE_TWINS`, its `torch.nn`
//! layer (in the family's `pub mod nn` and `NN_LAYERS`), the ATen ops kiln-torch imports as it (the
//! family's `ATEN`, an activation's `Unary::form`) and their converter in
//! python/kiln_torch/ops.py, and, when it needs one, a kernel in `kernels/`. Codegen needs nothing:
//! it writes the op's serde form as Rust, or the method and layer of an activation's form (see
//! `codegen`). The op-completeness test (`completeness.rs`) names any part that is missing.

pub mod attention;
pub mod conv;
pub mod custom;
pub mod elementwise;
pub mod image;
pub mod linear;
pub mod lower;
pub mod norm;
pub mod pool;
pub mod quant;
pub mod resize;
pub mod shape;

#[cfg(test)]
mod completeness;

use crate::engine::{Layer, Layout};
use crate::error::OpError;
use crate::graph::{Binary, ConvAttrs, Gemm, HostTensor, NodeId, Norm, Op, Pool, Quant, Resize, ShapeOp, Unary};
use crate::tensor::{Tensor, Tracer};
use crate::var_builder::VarBuilder;
pub use lower::BuildCtx;
use std::borrow::Cow;
use strum::IntoEnumIterator;

/// One op of every built-in kind (attributes at their defaults), for the op-completeness test:
/// each family's enum lists its own variants, so a new variant is on this list by itself.
pub fn builtin_ops() -> Vec<Op> {
    let convs = [false, true].map(|transposed| Op::Conv(ConvAttrs { transposed, ..Default::default() }));
    convs
        .into_iter()
        .chain(Gemm::iter().map(Op::Gemm))
        .chain(Norm::iter().map(Op::Norm))
        .chain(Pool::iter().map(Op::Pool))
        .chain(Unary::iter().map(Op::Unary))
        .chain(Binary::iter().map(Op::Binary))
        .chain(ShapeOp::iter().map(Op::Shape))
        .chain(Resize::iter().map(Op::Resize))
        .chain([Op::Attention(attention::Attention::default()), Op::QkvAttention(attention::QkvAttention::default())])
        .chain(Quant::iter().map(Op::Quant))
        .collect()
}

/// Checks that every node of `graph` has a GPU converter, before any GPU work: built-in ops
/// always do (each family's `OpDef::convert`); a custom op needs a registered one
/// (`custom::check_converters`). The error names the op and its module path.
pub fn check_converters(graph: &crate::graph::Graph) -> crate::Result<()> {
    custom::check_converters(graph)
}

/// What every op provides. Implemented by each op family; reached through `Op::def`.
pub trait OpDef {
    /// The op's name (`conv2d`, `relu`): fixture case prefix, profile and error label.
    fn name(&self) -> &str;

    /// The output shape (NCHW, batch first) from the input shapes, or why they do not fit.
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError>;

    /// The CPU reference in f32, with PyTorch's semantics, on the inputs' actual shapes (the batch
    /// may differ from the traced one). `args.take(0)` hands over the first input's buffer when
    /// this node is its last reader, for ops that can work in place.
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, OpError>;

    /// The engine layouts this op's converter reads and writes. `inputs[i]` is the layout input
    /// `i` is in (`None` for weights); the plan says which layout each input must be given in and
    /// which layout the output is written in. The builder inserts reformats where they differ.
    /// By default every activation is read and written in PyTorch's contiguous order.
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        LayoutPlan::all(inputs, Layout::contiguous(out_rank))
    }

    /// Lowers the node to one engine layer (`ctx.input(node, i)` gives each input in the layout
    /// `layouts` asked for).
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> crate::Result<Box<dyn Layer>>;

    /// The node's label in Graphviz drawings: the name and the attributes that matter.
    fn label(&self) -> String {
        self.name().to_string()
    }

    /// The fill colour of the node's box in Graphviz drawings. By default the colour of the
    /// compute-heavy ops (convolutions, GEMMs, attention); the other families name their own.
    fn colour(&self) -> &'static str {
        "#8ecae6"
    }

    /// The NVRTC entry points the layers of this op's family launch (`activation_f16`, ...), for
    /// CI's NVRTC test to find each defined once ([`kernel_entry_points`] gathers them). Ops of
    /// one family may return the same list.
    fn entry_points(&self) -> Vec<String> {
        Vec::new()
    }
}

/// The 8-bit storage plan of `graph` for an engine of `config` whose nodes compute in
/// `precisions`: which tensors live in 8 bits, decided by the ops that read and write them (the
/// 8-bit convolutions, `conv::conv8::plan`). The builder asks here, not the conv family.
pub fn eight_bit_plan(
    graph: &crate::graph::Graph,
    config: &crate::engine::BuildConfig,
    precisions: &[crate::engine::Precision],
    sm: u32,
) -> crate::engine::eight_bit::EightBitPlan {
    conv::conv8::plan(graph, config, precisions, sm)
}

/// Whether each node of `graph` is an activation quantiser: a fake-quantize of a computed value,
/// not of a weight. A `Best` engine lowers those it does not store as 8-bit codes as aliases of
/// their input (`EightBitPlan::aliased`).
pub fn activation_quantisers(graph: &crate::graph::Graph) -> Vec<bool> {
    let is_weight = |i: NodeId| matches!(graph.nodes[i].op, Op::Weight { .. });
    graph
        .nodes
        .iter()
        .map(|n| matches!(n.op, Op::Quant(Quant::FakeQuantize(_))) && n.inputs.first().is_some_and(|&i| !is_weight(i)))
        .collect()
}

/// Every NVRTC entry point Kiln's layers may launch: the engine's own (reformats, strided
/// copies) and every op family's (`OpDef::entry_points` of [`builtin_ops`]), sorted, each once.
pub fn kernel_entry_points() -> Vec<String> {
    let mut names: std::collections::BTreeSet<String> = crate::engine::reformat::entry_points().into_iter().collect();
    names.extend(crate::engine::strided::entry_points());
    names.extend(builtin_ops().iter().filter_map(Op::def).flat_map(|d| d.entry_points()));
    // The convolution family's depthwise kernels (its other kernels are compiled on demand).
    names.extend(conv::depthwise::entry_points());
    names.into_iter().collect()
}

/// What the Kiln twin of one PyTorch op fixture case gets (`op_cases()` in
/// tools/export_reference.py, checked by tests/op_fixtures.rs): the case's name, its parameters
/// (`<case>.weight`, ...), its input and its second input, if the case has one.
#[doc(hidden)]
pub struct Fixture<'a> {
    pub case: &'a str,
    pub vb: VarBuilder,
    pub x: &'a Tensor,
    pub other: Option<&'a Tensor>,
}

impl<'a> Fixture<'a> {
    /// The case's second input, or an error naming the case.
    pub fn other(&self) -> crate::Result<&'a Tensor> {
        self.other.ok_or_else(|| crate::Error::MissingWeight { key: format!("{}.other", self.case), source_name: "the op fixtures".into() })
    }
}

/// A fixture case's name and its Kiln twin. Each family lists its own beside its ops
/// (`FIXTURE_TWINS`), so adding an op and its fixture touches no test.
#[doc(hidden)]
pub type FixtureTwin = (&'static str, fn(Fixture<'_>) -> crate::Result<Tensor>);

/// Every family's fixture twins.
#[doc(hidden)]
pub fn fixture_twins() -> Vec<FixtureTwin> {
    [
        elementwise::FIXTURE_TWINS,
        pool::FIXTURE_TWINS,
        norm::FIXTURE_TWINS,
        linear::FIXTURE_TWINS,
        shape::FIXTURE_TWINS,
        resize::FIXTURE_TWINS,
        attention::FIXTURE_TWINS,
        quant::FIXTURE_TWINS,
    ]
    .concat()
}

/// One `kiln::nn` layer and a trace of it on an input of its choosing, for the op-completeness
/// test to see which op it records. Each family lists its own (`NN_LAYERS`) beside its layers.
#[doc(hidden)]
pub type NnLayer = (&'static str, fn(VarBuilder, &Tracer) -> crate::Result<Tensor>);

/// Every family's `kiln::nn` layers.
#[doc(hidden)]
pub fn nn_layers() -> Vec<NnLayer> {
    [
        conv::NN_LAYERS,
        elementwise::NN_LAYERS,
        linear::NN_LAYERS,
        norm::NN_LAYERS,
        pool::NN_LAYERS,
        quant::NN_LAYERS,
        resize::NN_LAYERS,
        shape::NN_LAYERS,
    ]
    .concat()
}

/// An op (by name) and the ATen ops, or whole PyTorch modules, that kiln-torch
/// (python/kiln_torch/ops.py) imports as it. Each family lists its own (`ATEN`); the activations
/// name theirs in their forms (`Unary::form`).
#[doc(hidden)]
pub type AtenImport = (&'static str, &'static [&'static str]);

/// Every op's ATen imports, by op name (an op named in several rows gets them all).
#[doc(hidden)]
pub fn aten_imports() -> std::collections::BTreeMap<String, Vec<&'static str>> {
    // The attention family's, until ops/attention.rs (being split into a folder) can hold them.
    const ATTENTION: &[AtenImport] = &[
        ("attention", &["aten.scaled_dot_product_attention.default"]),
        (
            "qkv_attention",
            &["torch.nn.modules.activation.MultiheadAttention", "torchvision.models.swin_transformer.ShiftedWindowAttention"],
        ),
    ];
    let unary = Unary::examples().into_iter().map(|op| (op.name().to_string(), op.form().aten));
    let families = [conv::ATEN, elementwise::ATEN, linear::ATEN, norm::ATEN, pool::ATEN, quant::ATEN, resize::ATEN, shape::ATEN, ATTENTION];
    let rows = unary.chain(families.concat().into_iter().map(|(op, aten)| (op.to_string(), aten)));
    let mut by_op: std::collections::BTreeMap<String, Vec<&'static str>> = Default::default();
    for (op, aten) in rows {
        let names = by_op.entry(op).or_default();
        let new: Vec<&'static str> = aten.iter().copied().filter(|a| !names.contains(a)).collect();
        names.extend(new);
    }
    by_op
}

/// The layouts a converter wants its inputs in (`None`: a weight, or any layout) and the layout
/// it writes its output in.
#[derive(Clone, Debug, PartialEq)]
pub struct LayoutPlan {
    pub inputs: Vec<Option<Layout>>,
    pub output: Layout,
}

impl LayoutPlan {
    /// Every activation input in `layout`'s family (its rank adjusted per input), output in `layout`.
    pub fn all(inputs: &[Option<Layout>], output: Layout) -> Self {
        let same = |l: &Option<Layout>| l.map(|l| output.with_rank(l.rank()));
        Self { inputs: inputs.iter().map(same).collect(), output }
    }
    /// Inputs read as they are; the output in `output`.
    pub fn any_input(inputs: &[Option<Layout>], output: Layout) -> Self {
        Self { inputs: vec![None; inputs.len()], output }
    }
}

/// The inputs of a node being run on the CPU.
pub struct CpuArgs<'a> {
    values: Vec<Option<Cow<'a, HostTensor>>>,
}

impl<'a> CpuArgs<'a> {
    pub fn new(values: Vec<Cow<'a, HostTensor>>) -> Self {
        Self { values: values.into_iter().map(Some).collect() }
    }
    pub fn len(&self) -> usize {
        self.values.len()
    }
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
    /// Input `i`; an error if the node has no such input or it was taken.
    pub fn get(&self, i: usize) -> Result<&HostTensor, OpError> {
        self.values.get(i).and_then(|v| v.as_deref()).ok_or_else(|| OpError::Shape(format!("input {i} is missing")))
    }
    /// Input `i` by value: its buffer when this node is its last reader, a copy otherwise.
    pub fn take(&mut self, i: usize) -> Result<HostTensor, OpError> {
        self.values.get_mut(i).and_then(Option::take).map(Cow::into_owned).ok_or_else(|| OpError::Shape(format!("input {i} is missing")))
    }
    /// All inputs, borrowed.
    pub fn all(&self) -> Result<Vec<&HostTensor>, OpError> {
        (0..self.len()).map(|i| self.get(i)).collect()
    }
    /// The inputs' shapes.
    pub fn shapes(&self) -> Result<Vec<&[usize]>, OpError> {
        (0..self.len()).map(|i| self.get(i).map(|t| t.shape.as_slice())).collect()
    }
    /// Exactly `n` inputs, or an error saying how many there are.
    pub fn expect(&self, n: usize) -> Result<(), OpError> {
        if self.len() == n {
            Ok(())
        } else {
            Err(OpError::Arity { expected: n.to_string(), got: self.len() })
        }
    }
}

/// The ops of one input, for shape rules: `[x]` or an error naming the count.
pub fn one_input<'a>(inputs: &[&'a [usize]]) -> Result<&'a [usize], OpError> {
    match inputs {
        [x] => Ok(x),
        _ => Err(OpError::Arity { expected: "1".into(), got: inputs.len() }),
    }
}

/// A label part for a pair attribute: `""` at its default, ` s2` when square, ` s2,1` otherwise.
pub fn pair_label(tag: &str, v: [usize; 2], default: usize) -> String {
    match v {
        [a, b] if a == b && a == default => String::new(),
        [a, b] if a == b => format!(" {tag}{a}"),
        [a, b] => format!(" {tag}{a},{b}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kernels::FAMILIES;

    #[test]
    fn every_entry_point_is_named_in_its_family_source() {
        let names = kernel_entry_points();
        for some in ["cast_u8_f16", "shape_roll_v16", "activation_f16", "flash_attn_tc_d64_f16", "depthwise_k7_f32"] {
            assert!(names.iter().any(|n| n == some), "the engine's and every family's entry points, {some} missing from {names:?}");
        }
        for name in &names {
            // Stamped by a macro: `activation_##S` with S = f32 (`cast_##S` with S = u8_f16), or a
            // plain `decode_merge(`.
            let mut stem = name.as_str();
            while let Some(shorter) = ["_f32", "_f16", "_u8"].iter().find_map(|t| stem.strip_suffix(t)) {
                stem = shorter;
            }
            let found = FAMILIES.iter().any(|(_, src)| src.contains(&format!(" {stem}_##S")) || src.contains(&format!(" {name}(")));
            assert!(found, "no family defines `{name}`");
        }
    }
}
