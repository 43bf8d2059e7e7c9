//! The data-movement family's `torch.nn` layers beyond the constant pads: `Flatten`,
//! `ReflectionPad2d` and `ReplicationPad2d`; and the family's tables for `ops::completeness` (its
//! layers, traced, and the ATen ops kiln-torch imports as its ops).

use super::{arg_err, norm_dim, ShapeOp};
use crate::graph::Op;
use crate::module::{Forward, Module};
use crate::ops::{AtenImport, NnLayer};
use crate::tensor::Tensor;
use crate::var_builder::VarBuilder;
use crate::Result;

/// Options of [`Flatten`], with PyTorch's defaults (`start_dim=1, end_dim=-1`); negative dims
/// count from the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlattenConfig {
    pub start_dim: isize,
    pub end_dim: isize,
}

impl Default for FlattenConfig {
    fn default() -> Self {
        Self { start_dim: 1, end_dim: -1 }
    }
}

/// `torch.nn.Flatten(start_dim, end_dim)`: dims `start_dim..=end_dim` as one. To the last dim it
/// records a flatten, otherwise a reshape; never from dim 0 (the batch).
#[derive(Clone, Debug)]
pub struct Flatten {
    pub path: String,
    pub config: FlattenConfig,
}

impl Module for Flatten {
    type Config = FlattenConfig;
    fn load(vb: VarBuilder, config: &FlattenConfig) -> Result<Self> {
        Ok(Self { path: vb.path().to_string(), config: *config })
    }
}

impl Forward for Flatten {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (start, end) = (norm_dim(x, "flatten", self.config.start_dim)?, norm_dim(x, "flatten", self.config.end_dim)?);
        if start > end {
            let reason = format!("start dim {} comes after end dim {}", self.config.start_dim, self.config.end_dim);
            return Err(arg_err(x, "flatten", reason));
        }
        let shape = x.shape();
        if end + 1 == shape.len() {
            return Tensor::record(&self.path, Op::Shape(ShapeOp::Flatten { start }), &[x], &[]);
        }
        if start == 0 {
            return Err(arg_err(x, "flatten", "flattening from dim 0 merges the batch: the engine keeps the batch as dim 0".into()));
        }
        let merged = shape[start..=end]
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| arg_err(x, "flatten", format!("dims {start}..={end} of {shape:?} hold too many elements")))?;
        let dims: Vec<usize> = shape[1..start].iter().copied().chain([merged]).chain(shape[end + 1..].iter().copied()).collect();
        Tensor::record(&self.path, Op::Shape(ShapeOp::Reshape { dims }), &[x], &[])
    }
}

/// `torch.nn.ReflectionPad2d(padding)`: `padding` is (left, right, top, bottom), each below its
/// dim's size.
#[derive(Clone, Debug)]
pub struct ReflectionPad2d {
    pub path: String,
    pub padding: [usize; 4],
}

impl Module for ReflectionPad2d {
    type Config = [usize; 4];
    fn load(vb: VarBuilder, padding: &[usize; 4]) -> Result<Self> {
        Ok(Self { path: vb.path().to_string(), padding: *padding })
    }
}

impl Forward for ReflectionPad2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::record(&self.path, Op::Shape(ShapeOp::ReflectPad { pads: self.padding.to_vec() }), &[x], &[])
    }
}

/// `torch.nn.ReplicationPad2d(padding)`: `padding` is (left, right, top, bottom).
#[derive(Clone, Debug)]
pub struct ReplicationPad2d {
    pub path: String,
    pub padding: [usize; 4],
}

impl Module for ReplicationPad2d {
    type Config = [usize; 4];
    fn load(vb: VarBuilder, padding: &[usize; 4]) -> Result<Self> {
        Ok(Self { path: vb.path().to_string(), padding: *padding })
    }
}

impl Forward for ReplicationPad2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::record(&self.path, Op::Shape(ShapeOp::ReplicatePad { pads: self.padding.to_vec() }), &[x], &[])
    }
}

/// This family's `kiln::nn` layers, each traced on an input (for `ops::completeness`).
#[doc(hidden)]
pub const NN_LAYERS: &[NnLayer] = &[
    ("Flatten", |vb, t| super::nn::Flatten::load(vb, &super::nn::FlattenConfig::default())?.forward(&t.input("x", &[2, 3, 4, 5]))),
    ("Flatten", |vb, t| {
        super::nn::Flatten::load(vb, &super::nn::FlattenConfig { start_dim: 1, end_dim: 2 })?.forward(&t.input("x", &[2, 3, 4, 5]))
    }),
    ("ConstantPad2d", |vb, t| {
        let config = super::nn::ConstantPad2dConfig { padding: [1, 1, 2, 0], value: 0.5 };
        super::nn::ConstantPad2d::load(vb, &config)?.forward(&t.input("x", &[1, 3, 4, 4]))
    }),
    ("ZeroPad2d", |vb, t| super::nn::ZeroPad2d::load(vb, &[1, 1, 2, 0])?.forward(&t.input("x", &[1, 3, 4, 4]))),
    ("ReflectionPad2d", |vb, t| super::nn::ReflectionPad2d::load(vb, &[1, 1, 2, 0])?.forward(&t.input("x", &[1, 3, 4, 4]))),
    ("ReplicationPad2d", |vb, t| super::nn::ReplicationPad2d::load(vb, &[1, 1, 2, 0])?.forward(&t.input("x", &[1, 3, 4, 4]))),
];

/// The ATen ops kiln-torch imports as this family's ops: views become a reshape (a flatten when
/// they merge trailing dims), splits and selects slices.
#[doc(hidden)]
pub const ATEN: &[AtenImport] = &[
    ("flatten", &["aten.flatten.using_ints", "aten.view.default", "aten.reshape.default"]),
    ("cat", &["aten.cat.default", "aten.concat.default"]),
    (
        "reshape",
        &[
            "aten.view.default",
            "aten._unsafe_view.default",
            "aten.reshape.default",
            "aten.flatten.using_ints",
            "aten.unflatten.int",
            "aten.squeeze.dim",
            "aten.squeeze.dims",
            "aten.squeeze.default",
            "aten.unsqueeze.default",
            "aten.select.int",
        ],
    ),
    ("permute", &["aten.permute.default", "aten.transpose.int", "aten.t.default", "aten.numpy_T.default"]),
    (
        "slice",
        &[
            "aten.slice.Tensor",
            "aten.narrow.default",
            "aten.select.int",
            "aten.split.Tensor",
            "aten.split_with_sizes.default",
            "aten.chunk.default",
            "aten.unsafe_split.Tensor",
            "aten.unbind.int",
        ],
    ),
    ("pad", &["aten.constant_pad_nd.default", "aten.pad.default"]),
    ("roll", &["aten.roll.default"]),
    (
        "reflection_pad",
        &["aten.reflection_pad1d.default", "aten.reflection_pad2d.default", "aten.reflection_pad3d.default", "aten.pad.default"],
    ),
    (
        "replication_pad",
        &["aten.replication_pad1d.default", "aten.replication_pad2d.default", "aten.replication_pad3d.default", "aten.pad.default"],
    ),
];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tracer;

    /// The op each traced layer records last.
    fn op_of(layer: fn(VarBuilder, &Tracer) -> Result<Tensor>) -> Op {
        let t = Tracer::new();
        let y = layer(VarBuilder::seeded(), &t).expect("trace");
        t.graph().nodes[y.id()].op.clone()
    }

    #[test]
    fn flatten_records_a_flatten_to_the_last_dim_and_a_reshape_otherwise() {
        assert_eq!(op_of(NN_LAYERS[0].1), Op::Shape(ShapeOp::Flatten { start: 1 }));
        assert_eq!(op_of(NN_LAYERS[1].1), Op::Shape(ShapeOp::Reshape { dims: vec![12, 5] }));
        let t = Tracer::new();
        let x = t.input("x", &[2, 3, 4]);
        let from_batch = Flatten::load(VarBuilder::seeded().pp("f"), &FlattenConfig { start_dim: 0, end_dim: 1 }).expect("load");
        let err = from_batch.forward(&x).expect_err("dim 0 is the batch").to_string();
        assert!(err.contains("merges the batch"), "{err}");
        let reversed = Flatten::load(VarBuilder::seeded(), &FlattenConfig { start_dim: 2, end_dim: 1 }).expect("load");
        assert!(reversed.forward(&x).expect_err("start after end").to_string().contains("comes after"));
    }
}
