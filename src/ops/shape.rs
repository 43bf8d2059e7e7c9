//! Ops that move data without arithmetic: flatten and cat.

use crate::engine::{BuildCtx, Layer, Layout};
use crate::graph::{HostTensor, NodeId};
use crate::ops::{CpuArgs, LayoutPlan, OpDef};
use serde::{Deserialize, Serialize};

/// Data movement. Inputs: one tensor, except Cat (any number, equal except along `dim`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, strum::EnumIter)]
pub enum ShapeOp {
    /// `torch.flatten(x, start)`.
    Flatten { start: usize },
    /// `torch.cat(xs, dim)`.
    Cat { dim: usize },
}

impl OpDef for ShapeOp {
    fn name(&self) -> &str {
        match self {
            ShapeOp::Flatten { .. } => "flatten",
            ShapeOp::Cat { .. } => "cat",
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match *self {
            ShapeOp::Flatten { start } => flatten_shape(start, inputs),
            ShapeOp::Cat { dim } => cat_shape(dim, inputs),
        }
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, String> {
        match *self {
            ShapeOp::Flatten { start } => {
                args.expect(1)?;
                flatten_cpu(start, args.take(0)?)
            }
            ShapeOp::Cat { dim } => cat_cpu(dim, &args.all()?),
        }
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        match self {
            // The engine's flatten reads NHWC maps and writes PyTorch's order.
            ShapeOp::Flatten { .. } => LayoutPlan::any_input(inputs, Layout::contiguous(out_rank)),
            ShapeOp::Cat { .. } => LayoutPlan::all(inputs, Layout::native(out_rank)),
        }
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> crate::Result<Box<dyn Layer>> {
        match *self {
            ShapeOp::Flatten { start } => crate::engine::kernel_layers::flatten(ctx, node, start),
            ShapeOp::Cat { dim } => crate::engine::kernel_layers::concat(ctx, node, dim),
        }
    }
    fn label(&self) -> String {
        match self {
            ShapeOp::Flatten { start } => format!("flatten start={start}"),
            ShapeOp::Cat { dim } => format!("cat dim={dim}"),
        }
    }
}

pub fn flatten_shape(start: usize, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
    let [x] = inputs else { return Err(format!("expected 1 input, got {}", inputs.len())) };
    if start >= x.len() {
        return Err(format!("start dim {start} is out of range for shape {x:?}"));
    }
    let mut out = x[..start].to_vec();
    out.push(x[start..].iter().product());
    Ok(out)
}

pub fn cat_shape(dim: usize, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
    let first = inputs.first().ok_or("cat needs at least one input")?;
    if dim >= first.len() {
        return Err(format!("dim {dim} is out of range for shape {first:?}"));
    }
    let mut out = first.to_vec();
    for s in &inputs[1..] {
        let same_rest = s.len() == first.len() && s.iter().zip(first.iter()).enumerate().all(|(i, (a, b))| i == dim || a == b);
        if !same_rest {
            return Err(format!("shapes {first:?} and {s:?} differ outside dim {dim}"));
        }
        out[dim] += s[dim];
    }
    Ok(out)
}

// ---- CPU reference

/// `torch.flatten(x, start)`: the data is already in that order, only the shape changes.
pub fn flatten_cpu(start: usize, mut x: HostTensor) -> Result<HostTensor, String> {
    x.shape = flatten_shape(start, &[&x.shape])?;
    Ok(x)
}

/// `torch.cat(inputs, dim)`: for each index of the dims before `dim`, the inputs' contiguous blocks
/// follow one another.
pub fn cat_cpu(dim: usize, inputs: &[&HostTensor]) -> Result<HostTensor, String> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let out_shape = cat_shape(dim, &shapes)?;
    let outer: usize = out_shape[..dim].iter().product();
    let blocks: Vec<usize> = inputs.iter().map(|t| t.shape[dim..].iter().product()).collect();
    let mut out = Vec::with_capacity(out_shape.iter().product());
    for o in 0..outer {
        for (t, &len) in inputs.iter().zip(&blocks) {
            out.extend_from_slice(&t.data[o * len..(o + 1) * len]);
        }
    }
    Ok(HostTensor::new(out_shape, out))
}
