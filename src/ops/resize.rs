//! Upsampling and interpolation (`nn.Upsample`, `F.interpolate`).

use crate::engine::{BuildCtx, Layer};
use crate::graph::{HostTensor, NodeId};
use crate::ops::{CpuArgs, OpDef};
use serde::{Deserialize, Serialize};

/// Resizing ops of NCHW tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, strum::EnumIter)]
pub enum Resize {}

impl OpDef for Resize {
    fn name(&self) -> &str {
        match *self {}
    }
    fn infer_shape(&self, _inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
        match *self {}
    }
    fn cpu(&self, _args: &mut CpuArgs) -> Result<HostTensor, String> {
        match *self {}
    }
    fn convert(&self, _ctx: &mut BuildCtx, _node: NodeId) -> crate::Result<Box<dyn Layer>> {
        match *self {}
    }
}
