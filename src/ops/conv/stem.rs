//! The ResNet stem (7×7/2 conv over the image's few channels, ReLU, 3×3/2 max-pool) as one kernel
//! on tensor cores: in FP16 a timed candidate beside the conv and pool run apart; in INT8 and FP8
//! engines the 8-bit stem, which quantises the FP16 input as it loads it and writes the codes the
//! next convs read (`conv8::plan` decides where it runs).
//!
//! cuDNN runs the 7×7 conv on 3 channels at a small fraction of the tensor cores' speed, and the
//! max-pool then reads its output, the largest activation of the network, back from memory.
//! `kernels/stem.cu` keeps the conv's output in shared memory and writes only the pooled image:
//! a quarter of the bytes, one launch instead of two.

use super::{Activation, ConvAttrs};
use crate::engine::eight_bit::EightBitPlan;
use crate::engine::launch::{launch, CudaFunction, KArg};
use crate::engine::layer::{to_elem_bytes, DeviceBuf, Elem, Layer, Layout, RunCtx, ValueDesc, ValueId};
use crate::graph::NodeId;
use crate::ops::pool::PoolAttrs;
use crate::ops::quant::QuantParams;
use crate::ops::BuildCtx;
use crate::LowerKind;
use crate::{Error, Result};
use cudarc::driver::sys::CUfunction_attribute;

/// `kernels/stem.cu`, compiled with NVRTC on first use.
pub const STEM_CU: &str = crate::engine::kernels::ON_DEMAND[3].1;

/// The kernel's fixed geometry (`kernels/stem.cu`): filter size, output channels, the most input
/// channels, weight halves per output channel (7 filter rows of 8 taps × 4 channels).
const K: usize = 7;
const COUT: usize = 64;
const MAX_CIN: usize = 4;
const KTOT: usize = K * 32;

/// The kernels' tile shape (`StemLarge` in `kernels/stem.cu`): pooled pixels per block (rows,
/// columns), threads, and blocks resident per SM (the `__launch_bounds__`; the persistent grid is
/// this many per SM). A 4×4 tile measured no faster at batch 1, where the layer is latency-bound
/// (docs/PERFORMANCE.md step 8).
#[derive(Clone, Copy, Debug)]
struct Variant {
    tile: [usize; 2],
    threads: u32,
    blocks_per_sm: u32,
}

const VARIANT: Variant = Variant { tile: [8, 7], threads: 256, blocks_per_sm: 2 };

/// What a stem kernel reads and writes: FP16 NHWC in and out (`stem_conv_pool_f16`), or 8-bit
/// codes out from FP16 NHWC (`conv8_<format>_stem`) or from the engine's NCHW f32 input binding
/// read as it is (`conv8_<format>_stem_nchw`: no reformat runs before it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Io {
    F16,
    EightBit,
    EightBitNchw,
}

impl Io {
    /// The kernel's entry point for codes of `elem`.
    fn entry(self, elem: Elem) -> String {
        match self {
            Io::F16 => "stem_conv_pool_f16".into(),
            Io::EightBit => format!("conv8_{}_stem", elem.suffix()),
            Io::EightBitNchw => format!("conv8_{}_stem_nchw", elem.suffix()),
        }
    }
}

impl Variant {
    /// Dynamic shared memory per block, with the kernels' padded rows: weights, input tile (the
    /// extra column the 8-tap segments reach) and conv tile. FP16 (`StemGeo::SMEM_BYTES`): f16
    /// values, 4 channels a pixel. 8-bit (`Stem8Geo::SMEM_BYTES`): codes, a pixel's 4 a word, and
    /// a float4 of alphas and biases per channel pair; reading NCHW f32, also the staging area of
    /// each thread's input pixels (`STAGE_BYTES`: 4 channels of f32 per pixel).
    const fn smem_bytes(&self, io: Io) -> u32 {
        let conv = [2 * self.tile[0] + 1, 2 * self.tile[1] + 1];
        let input = [2 * (conv[0] - 1) + K, 2 * (conv[1] - 1) + 8];
        let eight_bit = COUT * (K * 32 + 16) + input[0] * input[1] * 4 + conv[0] * conv[1] * (COUT + 16) + COUT / 2 * 16;
        let threads = self.threads as usize;
        let bytes = match io {
            Io::F16 => 2 * (COUT * (KTOT + 8) + input[0] * input[1] * 4 + conv[0] * conv[1] * (COUT + 8)),
            Io::EightBit => eight_bit,
            Io::EightBitNchw => eight_bit + (input[0] * input[1]).div_ceil(threads) * 4 * threads * 4,
        };
        bytes as u32
    }
}

pub struct StemPool {
    path: String,
    entry: String,
    f: CudaFunction,
    x: ValueId,
    y: ValueId,
    /// `[Cout][KTOT]` f16 in (row, tap, channel) order, zeros past 7 taps and past Cin channels;
    /// the 8-bit stem's codes `[Cout][7][32]` in the same order.
    w: DeviceBuf,
    bias: DeviceBuf,
    /// H, W, C, HC, WC, HP, WP as the kernel takes them.
    dims: [i32; 7],
    io: Io,
    /// Blocks per image.
    tiles: usize,
    sm_count: u32,
    eight_bit: Option<EightBit>,
}

/// What the 8-bit stem takes beyond the FP16 one: `s_x · s_w[k]` per output channel, and the
/// input's and output's quantisers (1/scale, qmin, qmax each).
struct EightBit {
    alpha: DeviceBuf,
    quantisers: [f32; 6],
}

/// Whether the kernel's fixed geometry runs this conv and its pool: a 7×7 conv with stride 2,
/// padding 3, no dilation, groups or residual, at most 4 input and exactly 64 output channels
/// (`weight` is `[K, C, R, S]`), ReLU, and a 3×3 max-pool with stride 2 and padding 1.
pub fn fits(a: &ConvAttrs, pool: &PoolAttrs, weight: &[usize]) -> bool {
    let conv = !a.transposed
        && a.stride == [2, 2]
        && a.padding == [3, 3]
        && a.dilation == [1, 1]
        && a.groups == 1
        && !a.residual
        && a.act == Activation::Relu
        && matches!(weight, &[COUT, c, K, K] if c <= MAX_CIN);
    conv && pool.kernel == [3, 3] && pool.stride == [2, 2] && pool.padding == [1, 1]
}

/// The checked geometry of a stem node whose input is what `io` reads and whose output is NHWC
/// in `y_elem`: the kernel's dims, blocks per image and input channels; none where it does not
/// apply (see [`fits`]; the kernels need sm_80's `mma`).
fn geometry(
    ctx: &BuildCtx,
    node: NodeId,
    (a, pool): (&ConvAttrs, &PoolAttrs),
    conv_hw: [usize; 2],
    (io, y_elem): (Io, Elem),
) -> Result<Option<([i32; 7], usize, usize)>> {
    let w = ctx.weight(node, 1)?;
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let (dx, dy) = (ctx.value(x), ctx.value(y));
    let is = |d: &ValueDesc, e: Elem, l: Layout| d.elem == e && d.dims.len() == 3 && d.layout.same_bytes(l, &d.dims);
    let x_ok = match io {
        Io::F16 | Io::EightBit => is(dx, Elem::F16, Layout::channels_last(3)),
        Io::EightBitNchw => is(dx, Elem::F32, Layout::contiguous(3)),
    };
    if !fits(a, pool, &w.shape) || ctx.gpu.info.sm < 80 || !x_ok || !is(dy, y_elem, Layout::channels_last(3)) {
        return Ok(None);
    }
    let ([c, h, wd], [cy, hp, wp]) = (dx.dims[..3].try_into().expect("rank 3"), dy.dims[..3].try_into().expect("rank 3"));
    if c != w.shape[1] || cy != COUT {
        return Err(ctx.err(
            node,
            LowerKind::Weights,
            format!("the stem maps {c} channels to {cy}, its weight {:?} says {} to {COUT}", w.shape, w.shape[1]),
        ));
    }
    let [hc, wc] = conv_hw;
    let mut dims = [0i32; 7];
    for (d, (name, v)) in dims.iter_mut().zip([("H", h), ("W", wd), ("C", c), ("HC", hc), ("WC", wc), ("HP", hp), ("WP", wp)]) {
        *d = i32::try_from(v)
            .map_err(|_| ctx.err(node, LowerKind::TooLarge, format!("{name} = {v} exceeds the stem kernel's 32-bit range")))?;
    }
    let tiles = hp.div_ceil(VARIANT.tile[0]) * wp.div_ceil(VARIANT.tile[1]);
    Ok(Some((dims, tiles, c)))
}

/// A `[64, c, 7, 7]` weight (values or codes) in the kernels' order: `[64][7 rows][32]`, a row's
/// 8 taps × 4 channels, zeros past 7 taps and past `c` channels.
fn pack_rows(weight: &[f32], c: usize) -> Vec<f32> {
    let mut packed = vec![0f32; COUT * KTOT];
    for co in 0..COUT {
        for ch in 0..c {
            for r in 0..K {
                for s in 0..K {
                    packed[co * KTOT + r * 32 + s * 4 + ch] = weight[((co * c + ch) * K + r) * K + s];
                }
            }
        }
    }
    packed
}

/// The bias of a stem conv, checked against its 64 channels.
fn bias_of(ctx: &BuildCtx, node: NodeId, a: &ConvAttrs) -> Result<Vec<f32>> {
    let bias = if a.bias { ctx.weight(node, 2)?.data.clone() } else { vec![0.0; COUT] };
    if bias.len() != COUT {
        return Err(ctx.err(node, LowerKind::Weights, format!("bias has {} values for {COUT} channels", bias.len())));
    }
    Ok(bias)
}

/// `entry` of `kernels/stem.cu`, with the variant's shared memory for `io` allowed.
fn function(ctx: &BuildCtx, node: NodeId, entry: &str, io: Io) -> Result<CudaFunction> {
    ctx.kernels.add_source("stem.cu", STEM_CU)?;
    let f = ctx.kernels.get(entry)?;
    let smem = VARIANT.smem_bytes(io);
    f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
        .map_err(|e| ctx.err(node, LowerKind::Unsupported, format!("`{entry}` cannot have {smem} bytes of shared memory: {e:?}")))?;
    Ok(f)
}

/// The fused FP16 stem for a conv node carrying `pool`, or none where the kernel does not apply
/// ([`fits`], FP16 NHWC values, sm_80 or newer). `conv_hw` is the conv's output size (before the
/// pool), from the conv's shape rule.
pub fn candidates(ctx: &mut BuildCtx, node: NodeId, a: &ConvAttrs, pool: &PoolAttrs, conv_hw: [usize; 2]) -> Result<Vec<Box<dyn Layer>>> {
    if ctx.elem() != Elem::F16 {
        return Ok(Vec::new());
    }
    let Some((dims, tiles, c)) = geometry(ctx, node, (a, pool), conv_hw, (Io::F16, Elem::F16))? else { return Ok(Vec::new()) };
    let packed = pack_rows(&ctx.weight(node, 1)?.data, c);
    let bias = bias_of(ctx, node, a)?;
    let entry = Io::F16.entry(Elem::F16);
    let f = function(ctx, node, &entry, Io::F16)?;
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let (path, sm_count) = (ctx.node(node).path.clone(), ctx.kernels.sm_count());
    // Uploads of equal bytes share one buffer (`WeightStore`).
    let (w, bias) = (ctx.upload(&packed)?, ctx.upload_f32(&bias)?);
    Ok(vec![Box::new(StemPool { path, entry, f, x, y, w, bias, dims, io: Io::F16, tiles, sm_count, eight_bit: None })])
}

/// The 8-bit stem of an INT8 or FP8 engine (`conv8::plan` made the node an 8-bit conv): it reads
/// the FP16 NHWC input, or the engine's NCHW f32 input binding where the builder hands it that
/// (nothing else reads the input), and quantises it with `input`'s parameters, multiplies the codes with the
/// weight's codes (`codes`: `[K, C, R, S]` values on the 8-bit grid, `w_scale` per output
/// channel) and writes the codes of `output`, the quantiser after it.
pub fn eight_bit_candidates(
    ctx: &mut BuildCtx,
    node: NodeId,
    (a, pool): (&ConvAttrs, &PoolAttrs),
    conv_hw: [usize; 2],
    (input, output): (&QuantParams, &QuantParams),
    (codes, w_scale): (&[f32], &[f32]),
) -> Result<Vec<Box<dyn Layer>>> {
    let elem = EightBitPlan::elem(input.format);
    let io = if ctx.value(ctx.input(node, 0)?).elem == Elem::F32 { Io::EightBitNchw } else { Io::EightBit };
    let Some((dims, tiles, c)) = geometry(ctx, node, (a, pool), conv_hw, (io, elem))? else {
        return Err(ctx.err(
            node,
            LowerKind::Unsupported,
            "the 8-bit stem needs NHWC FP16 or NCHW f32 input and NHWC 8-bit output on sm_80 or newer",
        ));
    };
    let packed = pack_rows(codes, c);
    let alpha: Vec<f32> = w_scale.iter().map(|s| input.scale[0] * s).collect();
    let bias = bias_of(ctx, node, a)?;
    let entry = io.entry(elem);
    let f = function(ctx, node, &entry, io)?;
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let (path, sm_count) = (ctx.node(node).path.clone(), ctx.kernels.sm_count());
    let w = ctx.upload_bytes(&to_elem_bytes(&packed, elem))?;
    let (alpha, bias) = (ctx.upload_f32(&alpha)?, ctx.upload_f32(&bias)?);
    let quantisers =
        [1.0 / input.scale[0], input.qmin as f32, input.qmax as f32, 1.0 / output.scale[0], output.qmin as f32, output.qmax as f32];
    let eight_bit = Some(EightBit { alpha, quantisers });
    Ok(vec![Box::new(StemPool { path, entry, f, x, y, w, bias, dims, io, tiles, sm_count, eight_bit })])
}

impl Layer for StemPool {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        format!("kernel:{}", self.entry)
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        if batch == 0 {
            return Ok(());
        }
        // Tile indices are 32-bit in the kernel.
        let out_of_range = || Error::Binding { name: self.path.clone(), reason: format!("batch {batch} exceeds the stem kernel's range") };
        let tiles = batch.checked_mul(self.tiles).and_then(|t| i32::try_from(t).ok()).ok_or_else(out_of_range)?;
        let n = i32::try_from(batch).map_err(|_| out_of_range())?;
        let blocks = (tiles as u32).min(self.sm_count * VARIANT.blocks_per_sm);
        let mut args = vec![KArg::Ptr(rt.ptr(self.x)), KArg::Ptr(self.w.ptr())];
        if let Some(e) = &self.eight_bit {
            args.push(KArg::Ptr(e.alpha.ptr()));
        }
        args.extend([KArg::Ptr(self.bias.ptr()), KArg::Ptr(rt.ptr(self.y)), KArg::I32(n)]);
        args.extend(self.dims.map(KArg::I32));
        if let Some(e) = &self.eight_bit {
            args.extend(e.quantisers.map(KArg::F32));
        }
        let smem = VARIANT.smem_bytes(self.io);
        launch(rt, &self.f, (blocks, 1, 1), (VARIANT.threads, 1, 1), smem, &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_matches_the_kernel_and_fits_the_blocks_per_sm() {
        // kernels/stem.cu: (64·232 + 39·36·4 + 255·72) halves; 64·240 + 39·36·4 + 255·80 + 32·16
        // bytes; and 6 pixels of 4 f32 channels per thread staged.
        let io = [Io::F16, Io::EightBit, Io::EightBitNchw];
        assert_eq!(io.map(|io| VARIANT.smem_bytes(io)), [77_648, 41_888, 41_888 + 6 * 4 * 256 * 4]);
        for io in io {
            // Hopper and Ampere give an SM 228 KiB (1 KiB reserved per block).
            assert!(VARIANT.blocks_per_sm * (VARIANT.smem_bytes(io) + 1024) <= 228 * 1024);
        }
        assert_eq!([Io::EightBit, Io::EightBitNchw].map(|io| io.entry(Elem::I8)), ["conv8_i8_stem", "conv8_i8_stem_nchw"]);
        // Two 16-row M tiles per warp cover the conv tile.
        let conv = (2 * VARIANT.tile[0] + 1) * (2 * VARIANT.tile[1] + 1);
        assert!(conv <= 2 * 16 * VARIANT.threads as usize / 32);
    }

    #[test]
    fn the_geometry_is_the_resnet_stem_only() {
        let stem = ConvAttrs { stride: [2, 2], padding: [3, 3], act: Activation::Relu, ..ConvAttrs::default() };
        let pool = PoolAttrs { kernel: [3, 3], stride: [2, 2], padding: [1, 1], ..PoolAttrs::default() };
        assert!(fits(&stem, &pool, &[64, 3, 7, 7]));
        assert!(fits(&stem, &pool, &[64, 4, 7, 7]));
        assert!(!fits(&stem, &pool, &[64, 5, 7, 7]), "at most 4 input channels");
        assert!(!fits(&stem, &pool, &[32, 3, 7, 7]), "64 output channels");
        assert!(!fits(&ConvAttrs { act: Activation::None, ..stem }, &pool, &[64, 3, 7, 7]), "ReLU");
        assert!(!fits(&ConvAttrs { residual: true, ..stem }, &pool, &[64, 3, 7, 7]));
        assert!(!fits(&stem, &PoolAttrs { stride: [1, 1], ..pool }, &[64, 3, 7, 7]));
    }
}
