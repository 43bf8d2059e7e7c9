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
/// channels, weight halves per output channel (7 filter rows of 8 taps × 4 channels).
const K: usize = 7;
const COUT: usize = 64;
const MAX_CIN: usize = 4;
const KTOT: usize = K * 32;

/// One tile shape of the kernel (`StemGeo` in `kernels/stem.cu`).
#[derive(Clone, Copy, Debug)]
struct Variant {
    entry: &'static str,
    /// Pooled pixels per block (rows, columns).
    tile: [usize; 2],
    threads: u32,
    /// Blocks resident per SM (its `__launch_bounds__`): the persistent grid is this many per SM.
    blocks_per_sm: u32,
}

/// The tile shapes compiled (a 4×4 tile measured no faster at batch 1, where the layer is
/// latency-bound; docs/PERFORMANCE.md step 8).
const VARIANTS: [Variant; 1] = [Variant { entry: "stem_conv_pool_f16", tile: [8, 7], threads: 256, blocks_per_sm: 2 }];

impl Variant {
    /// Dynamic shared memory per block (`StemGeo::SMEM_BYTES`), in halves with padded rows:
    /// weights, input tile (4 channels, with the extra column the 8-tap segments reach), conv tile.
    const fn smem_bytes(&self) -> u32 {
        let conv = [2 * self.tile[0] + 1, 2 * self.tile[1] + 1];
        let input = [2 * (conv[0] - 1) + K, 2 * (conv[1] - 1) + 8];
        (2 * (COUT * (KTOT + 8) + input[0] * input[1] * 4 + conv[0] * conv[1] * (COUT + 8))) as u32
    }
}

pub struct StemPool {
    path: String,
    variant: Variant,
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

/// The fused stem's tile shapes for a conv node carrying `pool`, or none where the kernel does not apply:
/// FP16, a 7×7 conv with stride 2, padding 3, no dilation, groups or residual, at most 4 input
/// and exactly 64 output channels, ReLU, and a 3×3 max-pool with stride 2 and padding 1, on a GPU
/// with `mma.m16n8k16` (sm_80 or newer). `conv_hw` is the conv's output size (before the pool),
/// from the conv's shape rule.
pub fn candidates(ctx: &mut BuildCtx, node: NodeId, a: &ConvAttrs, pool: &PoolAttrs, conv_hw: [usize; 2]) -> Result<Vec<Box<dyn Layer>>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let w = ctx.weight(node, 1)?;
    let cin = match w.shape[..] {
        [COUT, c, K, K] if c <= MAX_CIN => c,
        _ => return Ok(Vec::new()),
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
        return Ok(Vec::new());
    }
    let ([c, h, wd], [cy, hp, wp]) = (dx.dims[..3].try_into().expect("rank 3"), dy.dims[..3].try_into().expect("rank 3"));
    if c != cin || cy != COUT {
        return Err(ctx.err(node, format!("the stem maps {c} channels to {cy}, its weight {:?} says {cin} to {COUT}", w.shape)));
    }
    let [hc, wc] = conv_hw;
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
    ctx.kernels.add_source("stem.cu", STEM_CU)?;
    let (path, sm_count) = (ctx.node(node).path.clone(), ctx.kernels.sm_count());
    let mut out: Vec<Box<dyn Layer>> = Vec::new();
    for variant in VARIANTS {
        let f = ctx.kernels.get(variant.entry)?;
        let smem = variant.smem_bytes();
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .map_err(|e| ctx.err(node, format!("`{}` cannot have {smem} bytes of shared memory: {e:?}", variant.entry)))?;
        let tiles = hp.div_ceil(variant.tile[0]) * wp.div_ceil(variant.tile[1]);
        // Uploads of equal bytes share one buffer (`WeightStore`).
        let (w, bias) = (ctx.upload(&packed)?, ctx.upload_f32(&bias)?);
        out.push(Box::new(StemPool { path: path.clone(), variant, f, x, y, w, bias, dims, tiles, sm_count }));
    }
    Ok(out)
}

impl Layer for StemPool {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        format!("kernel:{}", self.variant.entry)
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        if batch == 0 {
            return Ok(());
        }
        // Tile indices are 32-bit in the kernel.
        let out_of_range = || Error::Binding { name: self.path.clone(), reason: format!("batch {batch} exceeds the stem kernel's range") };
        let tiles = batch.checked_mul(self.tiles).and_then(|t| i32::try_from(t).ok()).ok_or_else(out_of_range)?;
        let n = i32::try_from(batch).map_err(|_| out_of_range())?;
        let v = &self.variant;
        let blocks = (tiles as u32).min(self.sm_count * v.blocks_per_sm);
        let mut args =
            vec![KArg::Ptr(rt.ptr(self.x)), KArg::Ptr(self.w.ptr()), KArg::Ptr(self.bias.ptr()), KArg::Ptr(rt.ptr(self.y)), KArg::I32(n)];
        args.extend(self.dims.map(KArg::I32));
        launch(rt, &self.f, (blocks, 1, 1), (v.threads, 1, 1), v.smem_bytes(), &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_matches_the_kernel_and_fits_the_blocks_per_sm() {
        // kernels/stem.cu: (64·232 + 39·36·4 + 255·72) halves.
        assert_eq!(VARIANTS.map(|v| v.smem_bytes()), [77_648]);
        for v in VARIANTS {
            // Hopper and Ampere give an SM 228 KiB (1 KiB reserved per block).
            assert!(v.blocks_per_sm * (v.smem_bytes() + 1024) <= 228 * 1024, "{v:?}");
            // Two 16-row M tiles per warp cover the conv tile.
            let conv = (2 * v.tile[0] + 1) * (2 * v.tile[1] + 1);
            assert!(conv <= 2 * 16 * v.threads as usize / 32, "{v:?}");
        }
    }
}
