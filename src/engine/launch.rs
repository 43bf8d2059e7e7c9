//! The launch toolkit for Kiln's own kernels: typed arguments, one `launch` on a run's stream,
//! and grid sizes for the grid-stride kernels of `kernels/*.cu`.

use super::gpu::cuda_err;
use super::layer::RunCtx;
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
