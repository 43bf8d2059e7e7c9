//! The launch toolkit for Kiln's own kernels: typed arguments, one `launch` on a run's stream,
//! grid sizes for the grid-stride kernels of `kernels/*.cu`, and the checks a layer builder makes
//! of the values it launches on.

use super::gpu::cuda_err;
use super::layer::{BuildCtx, Elem, Layout, RunCtx, ValueId};
use crate::graph::NodeId;
use crate::Result;
pub use cudarc::driver::CudaFunction;
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// One kernel argument. Pointers are device addresses (`RunCtx::ptr`), 0 for "none".
#[derive(Clone, Copy, Debug)]
pub enum KArg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// Enqueues `f` on the run's stream.
pub fn launch(rt: &RunCtx, f: &CudaFunction, grid: (u32, u32, u32), block: (u32, u32, u32), shared: u32, args: &[KArg]) -> Result<()> {
    let mut lb = rt.stream.launch_builder(f);
    for a in args {
        match a {
            KArg::Ptr(p) => lb.arg(p),
            KArg::I32(v) => lb.arg(v),
            KArg::I64(v) => lb.arg(v),
            KArg::F32(v) => lb.arg(v),
        };
    }
    let cfg = LaunchConfig { grid_dim: grid, block_dim: block, shared_mem_bytes: shared };
    // SAFETY: every kernel's signature is the argument list its layer builds (kernels/*.cu), and
    // the addresses come from the context's arena, bindings or the layer's own buffers.
    unsafe { lb.launch(cfg) }.map_err(cuda_err("launching a kernel"))?;
    Ok(())
}

/// Threads per block of the grid-stride kernels.
pub const BLOCK: u32 = 256;

/// A 1-D grid for `work` grid-stride items: enough blocks to fill the device, no more.
pub fn grid_for(work: usize, sm_count: u32) -> (u32, u32, u32) {
    let blocks = work.div_ceil(BLOCK as usize).clamp(1, sm_count as usize * 16);
    (blocks as u32, 1, 1)
}

/// Elements per 16-byte pack, the vector width the kernels use when channels allow.
pub fn pack(elem: Elem) -> usize {
    16 / elem.size()
}

/// `v` as a 32-bit kernel argument, or an error naming the node and what overflowed.
pub fn to_i32(ctx: &BuildCtx, node: NodeId, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| ctx.err(node, format!("{what} = {v} exceeds the kernels' 32-bit range")))
}

/// The NHWC `(C, H, W)` of an activation, or an error naming the node.
pub fn nhwc(ctx: &BuildCtx, node: NodeId, v: ValueId) -> Result<(usize, usize, usize)> {
    let d = ctx.value(v);
    match d.dims.as_slice() {
        [c, h, w] if d.layout.same_bytes(Layout::channels_last(3), &d.dims) => Ok((*c, *h, *w)),
        _ => Err(ctx.err(node, format!("expects an NHWC image activation, got {:?} {:?}", d.layout, d.dims))),
    }
}

/// The element type all of `vs` share, or an error naming the node and the two types it mixes.
pub fn same_elem(ctx: &BuildCtx, node: NodeId, vs: &[ValueId]) -> Result<Elem> {
    let e = ctx.value(vs[0]).elem;
    if let Some(other) = vs.iter().map(|&v| ctx.value(v).elem).find(|&o| o != e) {
        return Err(ctx.err(node, format!("mixes element types {e:?} and {other:?}")));
    }
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_cover_small_work_and_cap_large_work() {
        assert_eq!(grid_for(0, 132), (1, 1, 1));
        assert_eq!(grid_for(1, 132), (1, 1, 1));
        assert_eq!(grid_for(257, 132), (2, 1, 1));
        assert_eq!(grid_for(1 << 30, 132), (132 * 16, 1, 1), "grid-stride loops cover the rest");
    }
}
