//! The launch toolkit for Kiln's own kernels: typed arguments, one `launch` on a run's stream,
//! grid sizes for the grid-stride kernels of `kernels/*.cu`, the checks a layer builder makes on
//! the values it launches over, and [`KernelLayer`]: one entry point over a grid-stride grid, the
//! op-agnostic layer most op families build their kernels' layers from.

use super::gpu::cuda_err;
use super::layer::{DeviceBuf, Elem, Layer, LayerCtx, Layout, RunCtx, ValueId};
use crate::LowerKind;
use crate::{Error, Result};
pub use cudarc::driver::CudaFunction;
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// One kernel argument. Pointers are device addresses (`RunCtx::ptr`), 0 for "none".
#[derive(Clone, Copy, Debug)]
pub enum KArg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
    /// A TMA descriptor (`CUtensorMap`'s 128 opaque bytes, `engine::tma`), passed by value to a
    /// `const __grid_constant__ TensorMap` parameter.
    TensorMap([u64; 16]),
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
            KArg::TensorMap(m) => lb.arg(m),
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

/// Outputs a block of a split reduction takes (`SPLIT_LANES` in kernels/norm.cu), and its threads
/// (`SPLIT_BLOCK`): its groups of `SPLIT_LANES` threads share each output's reduction.
pub const SPLIT_LANES: usize = 32;
pub const SPLIT_BLOCK: u32 = 1024;

/// The grid of a split reduction over `outputs`: a block per `SPLIT_LANES` of them, at most two
/// blocks an SM (the blocks stride over the rest).
pub fn split_grid(outputs: usize, sm_count: u32) -> (u32, u32, u32) {
    (outputs.div_ceil(SPLIT_LANES).clamp(1, sm_count as usize * 2) as u32, 1, 1)
}

/// Entry points stamped per element type by a family's macro: `activation` gives
/// `activation_f32` and `activation_f16`.
pub fn typed_entry_points(stems: &[&str]) -> Vec<String> {
    ["f32", "f16"].iter().flat_map(|t| stems.iter().map(move |s| format!("{s}_{t}"))).collect()
}

/// Elements per 16-byte pack, the vector width the kernels use when channels allow.
pub fn pack(elem: Elem) -> usize {
    16 / elem.size()
}

/// `v` as a 32-bit kernel argument, or an error naming the layer and what overflowed.
pub fn to_i32(ctx: &LayerCtx, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| ctx.err(LowerKind::TooLarge, format!("{what} = {v} exceeds the kernels' 32-bit range")))
}

/// The NHWC `(C, H, W)` of an activation, or an error naming the layer.
pub fn nhwc(ctx: &LayerCtx, v: ValueId) -> Result<(usize, usize, usize)> {
    let d = ctx.value(v);
    match d.dims.as_slice() {
        [c, h, w] if d.layout.same_bytes(Layout::channels_last(3), &d.dims) => Ok((*c, *h, *w)),
        _ => Err(ctx.err(LowerKind::Operands, format!("expects an NHWC image activation, got {:?} {:?}", d.layout, d.dims))),
    }
}

/// The element type all of `vs` share, or an error naming the layer and the two types it mixes.
pub fn same_elem(ctx: &LayerCtx, vs: &[ValueId]) -> Result<Elem> {
    let e = ctx.value(vs[0]).elem;
    if let Some(other) = vs.iter().map(|&v| ctx.value(v).elem).find(|&o| o != e) {
        return Err(ctx.err(LowerKind::Operands, format!("mixes element types {e:?} and {other:?}")));
    }
    Ok(e)
}

/// One argument of a [`KernelLayer`]'s launch, resolved each time the layer runs.
pub enum Arg {
    /// The device address of a value (arena, binding or scratch).
    Value(ValueId),
    /// The device address of a value, or null.
    MaybeValue(Option<ValueId>),
    /// The device address of a buffer the layer owns (a constant, an index table), or null.
    Buf(Option<DeviceBuf>),
    /// A value fixed at build time.
    Const(KArg),
    /// `batch * n` as an i64: the elements (or rows) of a run.
    PerBatch(usize),
    /// The batch as an i32 (an error past its range).
    Batch,
}

impl Arg {
    /// The device address of a buffer the layer owns.
    pub fn buf(b: DeviceBuf) -> Self {
        Arg::Buf(Some(b))
    }
}

/// One kernel entry point launched over a 1-D grid-stride grid of `batch * per_image / per_item`
/// work items, `BLOCK` threads a block: the layer of an elementwise op, an epilogue, a resize.
pub struct KernelLayer {
    path: String,
    kind: String,
    f: CudaFunction,
    args: Vec<Arg>,
    per_image: usize,
    per_item: usize,
    sm_count: u32,
}

impl KernelLayer {
    /// `entry` launched at the module path of the layer being built with `args`, one work item
    /// per element of `per_image` (see [`KernelLayer::items`]); its kind is `kernel:<entry>`
    /// unless [`KernelLayer::kind`] names another.
    pub fn new(ctx: &LayerCtx, entry: &str, args: Vec<Arg>, per_image: usize) -> Result<Self> {
        Self::at(ctx, ctx.path(), entry, args, per_image)
    }
    /// [`KernelLayer::new`] for a layer at `path` rather than the current one (a reformat the
    /// builder inserts).
    pub fn at(ctx: &LayerCtx, path: &str, entry: &str, args: Vec<Arg>, per_image: usize) -> Result<Self> {
        Ok(Self {
            path: path.to_string(),
            kind: format!("kernel:{entry}"),
            f: ctx.kernels.get(entry)?,
            args,
            per_image,
            per_item: 1,
            sm_count: ctx.kernels.sm_count(),
        })
    }
    /// The kind shown in layer listings and profiles.
    pub fn kind(mut self, kind: String) -> Self {
        self.kind = kind;
        self
    }
    /// Each work item covers `per_item` elements (a vector of 4, a 16-byte pack).
    pub fn items(mut self, per_item: usize) -> Self {
        self.per_item = per_item.max(1);
        self
    }
}

impl Layer for KernelLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.kind.clone()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let args = self
            .args
            .iter()
            .map(|a| {
                Ok(match a {
                    Arg::Value(v) => KArg::Ptr(rt.ptr(*v)),
                    Arg::MaybeValue(v) => KArg::Ptr(v.map_or(0, |v| rt.ptr(v))),
                    Arg::Buf(b) => KArg::Ptr(b.as_ref().map_or(0, DeviceBuf::ptr)),
                    Arg::Const(k) => *k,
                    Arg::PerBatch(n) => KArg::I64((batch * n) as i64),
                    Arg::Batch => KArg::I32(i32::try_from(batch).map_err(|_| Error::Binding {
                        name: self.path.clone(),
                        reason: format!("batch {batch} exceeds the range of {}", self.kind),
                    })?),
                })
            })
            .collect::<Result<Vec<KArg>>>()?;
        let work = batch * self.per_image / self.per_item;
        launch(rt, &self.f, grid_for(work, self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
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
