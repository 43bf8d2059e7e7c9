//! The ResNet stem (7×7/2 conv over the image's few channels, ReLU, 3×3/2 max-pool) as one kernel
//! on tensor cores, offered as a timed candidate beside the conv and pool run apart (FP16 only).
//!
//! cuDNN runs the 7×7 conv on 3 channels at a small fraction of the tensor cores' speed, and the
//! max-pool then reads its output, the largest activation of the network, back from memory.
//! `kernels/stem.cu` keeps the conv's output in shared memory and writes only the pooled image:
//! a quarter of the bytes, one launch instead of two.

use super::launch::{launch, CudaFunction, KArg};
use super::layer::{BuildCtx, DeviceBuf, Elem, Layer, Layout, RunCtx, ValueId};
use crate::graph::{Activation, ConvAttrs, NodeId, PoolAttrs};
use crate::{Error, Result};
use cudarc::driver::sys::CUfunction_attribute;

/// `kernels/stem.cu`, compiled with NVRTC on first use.
pub const STEM_CU: &str = super::kernels::ON_DEMAND[3].1;

/// The kernel's fixed geometry (`kernels/stem.cu`): filter size, output channels, the most input
/// channels, pooled pixels per block, threads per block.
const K: usize = 7;
const COUT: usize = 64;
const MAX_CIN: usize = 4;
const TILE: [usize; 2] = [8, 7];
const THREADS: u32 = 256;
/// Blocks resident per SM (`__launch_bounds__`): the persistent grid is this many per SM.
const BLOCKS_PER_SM: u32 = 2;
/// Conv pixels under a tile of pooled pixels, and input pixels under those (with the extra column
/// the 8-tap segments reach).
const CONV_TILE: [usize; 2] = [2 * TILE[0] + 1, 2 * TILE[1] + 1];
const INPUT_TILE: [usize; 2] = [2 * (CONV_TILE[0] - 1) + K, 2 * (CONV_TILE[1] - 1) + 8];
/// Dynamic shared memory per block (`STEM_SMEM_BYTES`), in halves with padded rows: weights,
/// input tile (4 channels), conv tile.
const SMEM_BYTES: u32 = (2 * (COUT * (KTOT + 8) + INPUT_TILE[0] * INPUT_TILE[1] * 4 + CONV_TILE[0] * CONV_TILE[1] * (COUT + 8))) as u32;
/// Weight halves per output channel: 7 filter rows of 8 taps × 4 channels.
const KTOT: usize = K * 32;

pub struct StemPool {
    path: String,
    f: CudaFunction,
    x: ValueId,
    y: ValueId,
    /// `[Cout][KTOT]` f16 in (row, tap, channel) order, zeros past 7 taps and past Cin channels.
    w: DeviceBuf,
    bias: DeviceBuf,
    /// H, W, C, HC, WC, HP, WP as the kernel takes them.
    dims: [i32; 7],
    /// Blocks per image.
    tiles: usize,
    sm_count: u32,
}

/// The fused stem for a conv node carrying `pool`, or `None` where the kernel does not apply:
/// FP16, a 7×7 conv with stride 2, padding 3, no dilation, groups or residual, at most 4 input
/// and exactly 64 output channels, ReLU, and a 3×3 max-pool with stride 2 and padding 1, on a GPU
/// with `mma.m16n8k16` (sm_80 or newer).
pub fn candidate(ctx: &mut BuildCtx, node: NodeId, a: &ConvAttrs, pool: &PoolAttrs) -> Result<Option<Box<dyn Layer>>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let w = ctx.weight(node, 1)?;
    let cin = match w.shape[..] {
        [COUT, c, K, K] if c <= MAX_CIN => c,
        _ => return Ok(None),
    };
    let conv_fits = !a.transposed
        && a.stride == [2, 2]
        && a.padding == [3, 3]
        && a.dilation == [1, 1]
        && a.groups == 1
        && !a.residual
        && a.act == Activation::Relu;
    let pool_fits = pool.kernel == [3, 3] && pool.stride == [2, 2] && pool.padding == [1, 1];
    let (dx, dy) = (ctx.value(x), ctx.value(y));
    let nhwc_f16 =
        |d: &super::ValueDesc| d.elem == Elem::F16 && d.dims.len() == 3 && d.layout.same_bytes(Layout::channels_last(3), &d.dims);
    if !conv_fits || !pool_fits || ctx.elem() != Elem::F16 || ctx.gpu.info.sm < 80 || !nhwc_f16(dx) || !nhwc_f16(dy) {
        return Ok(None);
    }
    let ([c, h, wd], [cy, hp, wp]) = (dx.dims[..3].try_into().expect("rank 3"), dy.dims[..3].try_into().expect("rank 3"));
    if c != cin || cy != COUT {
        return Err(ctx.err(node, format!("the stem maps {c} channels to {cy}, its weight {:?} says {cin} to {COUT}", w.shape)));
    }
    // The conv's output extent (stride 2, padding 3, 7 taps): (len + 6 - 7) / 2 + 1.
    let conv_extent = |len: usize| len.checked_sub(1).map(|l| l / 2 + 1);
    let (Some(hc), Some(wc)) = (conv_extent(h), conv_extent(wd)) else {
        return Err(ctx.err(node, format!("an empty input {:?} for the stem", dx.dims)));
    };
    let mut dims = [0i32; 7];
    for (d, (name, v)) in dims.iter_mut().zip([("H", h), ("W", wd), ("C", c), ("HC", hc), ("WC", wc), ("HP", hp), ("WP", wp)]) {
        *d = i32::try_from(v).map_err(|_| ctx.err(node, format!("{name} = {v} exceeds the stem kernel's 32-bit range")))?;
    }
    let mut packed = vec![0f32; COUT * KTOT];
    for co in 0..COUT {
        for ch in 0..c {
            for r in 0..K {
                for s in 0..K {
                    packed[co * KTOT + r * 32 + s * 4 + ch] = w.data[((co * c + ch) * K + r) * K + s];
                }
            }
        }
    }
    let bias = if a.bias { ctx.weight(node, 2)?.data.clone() } else { vec![0.0; COUT] };
    if bias.len() != COUT {
        return Err(ctx.err(node, format!("bias has {} values for {COUT} channels", bias.len())));
    }
    let (w, bias) = (ctx.upload(&packed)?, ctx.upload_f32(&bias)?);
    ctx.kernels.add_source("stem.cu", STEM_CU)?;
    let f = ctx.kernels.get("stem_conv_pool_f16")?;
    f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, SMEM_BYTES as i32)
        .map_err(|e| ctx.err(node, format!("the stem kernel cannot have {SMEM_BYTES} bytes of shared memory: {e:?}")))?;
    let tiles = hp.div_ceil(TILE[0]) * wp.div_ceil(TILE[1]);
    let sm_count = ctx.kernels.sm_count();
    Ok(Some(Box::new(StemPool { path: ctx.node(node).path.clone(), f, x, y, w, bias, dims, tiles, sm_count })))
}

impl Layer for StemPool {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "kernel:stem_conv_pool_f16".into()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        if batch == 0 {
            return Ok(());
        }
        // Tile indices are 32-bit in the kernel.
        let out_of_range = || Error::Binding { name: self.path.clone(), reason: format!("batch {batch} exceeds the stem kernel's range") };
        let tiles = batch.checked_mul(self.tiles).and_then(|t| i32::try_from(t).ok()).ok_or_else(out_of_range)?;
        let n = i32::try_from(batch).map_err(|_| out_of_range())?;
        let blocks = (tiles as u32).min(self.sm_count * BLOCKS_PER_SM);
        let mut args =
            vec![KArg::Ptr(rt.ptr(self.x)), KArg::Ptr(self.w.ptr()), KArg::Ptr(self.bias.ptr()), KArg::Ptr(rt.ptr(self.y)), KArg::I32(n)];
        args.extend(self.dims.map(KArg::I32));
        launch(rt, &self.f, (blocks, 1, 1), (THREADS, 1, 1), SMEM_BYTES, &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_matches_the_kernel_and_fits_two_blocks_per_sm() {
        // kernels/stem.cu: (64·232 + 39·36·4 + 255·72) halves.
        assert_eq!(SMEM_BYTES, 77_648);
        // Hopper and Ampere give a block up to 227 KiB and an SM 228 KiB (1 KiB reserved per block).
        assert!(BLOCKS_PER_SM * (SMEM_BYTES + 1024) <= 228 * 1024);
    }
}
