//! The 8-bit conv on Hopper's wgmma (`kernels/conv8_hopper.cu`, compiled for `sm_90a`): one more
//! candidate of the conv8 family on sm_90 devices, timed against the mma.sync tiles and cuDNN's
//! fused engines; it computes the same conv and epilogue (its layer takes `Conv8Layer`'s
//! arguments, plus two TMA tensor maps and the patch shape).
//!
//! What the host decides ([`plan`]): GEMM mode for a 1×1 stride-1 conv without padding (the
//! activation is the matrix `[N·H·W, C]`), patch mode otherwise (a block's 128 output pixels are a
//! `patch_h × patch_w` patch of one image, each filter tap's input a 4-D TMA box with traversal
//! strides), with the patch shape that computes the fewest pixels past the output's edges. A conv
//! it cannot run (another device, stride above 8, a reduction whose s32 sums could overflow) gets
//! no candidate, and the reason is logged.
//! The weight's map is encoded once per layer; the activation's at every enqueue (its address
//! and batch change), as the wgmma GEMM does.

use super::{kernel_args, Conv8Problem, Epilogue8, Store8};
use crate::engine::eight_bit::EightBitPlan;
use crate::engine::kernels::{hopper_arch, CONV8_HOPPER};
use crate::engine::launch::{launch, CudaFunction, KArg};
use crate::engine::layer::{DeviceBuf, Layer, RunCtx, ValueId};
use crate::engine::tma::{TiledMap, TmaElem, TmaSwizzle};
use crate::graph::NodeId;
use crate::ops::quant::QuantFormat;
use crate::ops::BuildCtx;
use crate::{Error, LowerKind, Result};
use cudarc::driver::sys::CUfunction_attribute;

/// Output pixels per block: two consumer warpgroups of 64.
const BM: usize = 128;
/// A producer warpgroup and two consumer warpgroups.
const THREADS: u32 = 384;
/// Channels per box of the output's and the residual's code tiles.
const CODE_BOX: usize = 64;
/// TMA's limits on a box's extent and on traversal strides.
const MAX_BOX: usize = 256;
const MAX_TRAVERSAL_STRIDE: usize = 8;
/// The longest reduction whose int8 sums fit s32: (2^31 − 1) / (128 · 128) products.
const MAX_REDUCTION: usize = (i32::MAX as usize) / (128 * 128);

/// Why FP8 convs get no wgmma candidate: measured on an H200, the kernel's e4m3 sums drifted 1.4e-3
/// (rel L2) from f32 sums after one requantised conv and 1.3-3e-2 after four, where the mma.sync
/// kernel stays under 1e-3, with or without promoting each stage's sums to f32 registers.
const FP8_REFUSAL: &str = "wgmma's e4m3 sums keep fewer bits than f32 (FP8 convs stay on the mma.sync kernel)";

/// One compiled tile: `bn` output channels per block, `bk` codes of the reduction per stage (one
/// swizzled shared-memory row), `stages` in the ring, `blocks` resident on an SM (the persistent
/// grid's blocks per SM; `CONV8_HOPPER` in the kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HopperVariant {
    bn: usize,
    bk: usize,
    stages: usize,
    blocks: usize,
}

impl HopperVariant {
    /// 64-code stages suit C = 64 (a 128-code stage would be half zeros), 128-code ones deeper
    /// channels; 64 to 256 output channels per block.
    /// The staging tile beside the ring leaves 256-channel blocks 3 stages of 64 codes. Two
    /// 64-channel blocks fit an SM with 4 stages each (their consumers at 104 registers a thread).
    const ALL: [HopperVariant; 5] = [
        HopperVariant { bn: 64, bk: 64, stages: 8, blocks: 1 },
        HopperVariant { bn: 64, bk: 64, stages: 4, blocks: 2 },
        HopperVariant { bn: 128, bk: 64, stages: 8, blocks: 1 },
        HopperVariant { bn: 128, bk: 128, stages: 4, blocks: 1 },
        HopperVariant { bn: 256, bk: 64, stages: 3, blocks: 1 },
    ];

    /// The variants compiled for `format`: int8's alone (see [`FP8_REFUSAL`]).
    fn of(format: QuantFormat) -> impl Iterator<Item = HopperVariant> {
        Self::ALL.into_iter().filter(move |_| format == QuantFormat::Int8)
    }

    fn entry(self, format: QuantFormat) -> String {
        let blocks = if self.blocks > 1 { format!("_x{}", self.blocks) } else { String::new() };
        format!("conv8_{}_wgmma_n{}_bk{}_s{}{blocks}", EightBitPlan::elem(format).suffix(), self.bn, self.bk, self.stages)
    }
    fn swizzle(self) -> TmaSwizzle {
        if self.bk == 128 {
            TmaSwizzle::B128
        } else {
            TmaSwizzle::B64
        }
    }
    /// Dynamic shared memory: the ring of (A, B) stages, then the epilogue's f32 staging tile
    /// (rows of `bn` + 8 floats; apart from the ring, which the next tile's loads fill meanwhile)
    /// or, where codes go out, four tiles of codes in the same bytes, and 1 KiB to align the ring.
    fn shared_bytes(self) -> usize {
        self.stages * (BM + self.bn) * self.bk + BM * (self.bn + 8) * 4 + 1024
    }
}

/// How a block's 128 output pixels cover the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tiling {
    /// Rows of the `[N·P·Q, C]` matrix (1×1 stride-1 convs without padding).
    Gemm,
    /// `h` rows × `w` columns of output pixels of one image (`w · h` = 128).
    Patch { w: usize, h: usize },
}

impl Tiling {
    /// The kernel's `patch_w`, `patch_h` (0, 0: GEMM mode).
    fn kernel_args(self) -> [i32; 2] {
        match self {
            Tiling::Gemm => [0, 0],
            Tiling::Patch { w, h } => [w as i32, h as i32],
        }
    }
    /// Pixel tiles of a batch of `batch` images of `p × q` output pixels.
    fn pixel_tiles(self, batch: usize, p: usize, q: usize) -> Option<usize> {
        match self {
            Tiling::Gemm => Some(batch.checked_mul(p)?.checked_mul(q)?.div_ceil(BM)),
            Tiling::Patch { w, h } => batch.checked_mul(p.div_ceil(h))?.checked_mul(q.div_ceil(w)),
        }
    }
}

/// The conv as the kernel sees it: `[n][h][w][c]` codes in, `[k][r][s][c]` codes of weight,
/// `p × q` output pixels per image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Geometry {
    c: usize,
    h: usize,
    w: usize,
    k: usize,
    r: usize,
    s: usize,
    p: usize,
    q: usize,
    stride: [usize; 2],
    padding: [usize; 2],
}

impl Geometry {
    fn of(p: &Conv8Problem) -> Self {
        let [c, h, w, k, r, s, pp, q] = p.dims;
        Geometry { c, h, w, k, r, s, p: pp, q, stride: p.stride, padding: p.padding }
    }
}

/// How the kernel covers conv `g` on a device of architecture `arch`, or why it cannot.
fn plan(arch: &str, g: &Geometry) -> std::result::Result<Tiling, String> {
    if hopper_arch(arch).is_none() {
        return Err(format!("needs an sm_90 device (this one is {arch})"));
    }
    if !g.c.is_multiple_of(16) || !g.k.is_multiple_of(16) {
        return Err(format!("needs C and K multiples of 16 (TMA's 16-byte strides, 16-channel epilogue), got C = {}, K = {}", g.c, g.k));
    }
    // An int8 reduction's s32 sum must not overflow: at most 128 · 128 per product.
    let reduction = g.r.checked_mul(g.s).and_then(|rs| rs.checked_mul(g.c));
    if reduction.is_none_or(|n| n > MAX_REDUCTION) {
        return Err(format!("a reduction of {}×{}×{} codes could overflow its s32 sums (at most {MAX_REDUCTION})", g.r, g.s, g.c));
    }
    if [g.r, g.s] == [1, 1] && g.stride == [1, 1] && g.padding == [0, 0] {
        return Ok(Tiling::Gemm);
    }
    let [sh, sw] = g.stride;
    if !(1..=MAX_TRAVERSAL_STRIDE).contains(&sh) || !(1..=MAX_TRAVERSAL_STRIDE).contains(&sw) {
        return Err(format!("stride {sh}×{sw} is beyond TMA's traversal strides (1 to {MAX_TRAVERSAL_STRIDE})"));
    }
    // Patches of 128 pixels whose input boxes (patch · stride) TMA can take: the one computing the
    // fewest pixels; on a tie the squarer (the taps' boxes overlap most, so L2 serves more of
    // them), then the wider (longer contiguous rows per box).
    (0..=BM.trailing_zeros())
        .map(|e| 1usize << e)
        .map(|w| (w, BM / w))
        .filter(|&(w, h)| w * sw <= MAX_BOX && h * sh <= MAX_BOX)
        .filter_map(|(w, h)| Some((g.p.div_ceil(h).checked_mul(h)?.checked_mul(g.q.div_ceil(w).checked_mul(w)?)?, w, h)))
        .min_by_key(|&(computed, w, h)| (computed, w + h, std::cmp::Reverse(w)))
        .map(|(_, w, h)| Tiling::Patch { w, h })
        .ok_or_else(|| format!("no 128-pixel patch fits TMA's {MAX_BOX}-element boxes at stride {sh}×{sw}"))
}

/// The activation's map for `batch` images at `x`: the `[N·H·W][C]` matrix in 128-row boxes (GEMM
/// mode), or the 4-D `[N][H][W][C]` tensor whose box is a patch's input pixels, every stride-th.
/// Boxes are `bk` codes wide, swizzled as the variant's wgmma descriptor reads them.
fn activation_map(tiling: Tiling, v: HopperVariant, x: u64, batch: usize, g: &Geometry) -> TiledMap {
    let (c, h, w, n) = (g.c as u64, g.h as u64, g.w as u64, batch as u64);
    let (dims, strides, boxes, element_strides) = match tiling {
        Tiling::Gemm => (vec![c, n * h * w], vec![c], vec![v.bk as u32, BM as u32], vec![1, 1]),
        Tiling::Patch { w: pw, h: ph } => {
            let [sh, sw] = g.stride;
            (
                vec![c, w, h, n],
                vec![c, w * c, h * w * c],
                vec![v.bk as u32, (pw * sw) as u32, (ph * sh) as u32, 1],
                vec![1, sw as u32, sh as u32, 1],
            )
        }
    };
    TiledMap { elem: TmaElem::U8, address: x, dims, strides, boxes, element_strides, swizzle: v.swizzle() }
}

/// The output's (or the residual's) map where the kernel moves tiles of codes by TMA: the
/// `[N·P·Q][K]` matrix in 128-row boxes (GEMM mode), or the 4-D `[N][P][Q][K]` tensor whose box is
/// one patch; boxes 64 codes wide, swizzled over 64 bytes (`c8h_code_offset`).
fn output_map(tiling: Tiling, y: u64, batch: usize, g: &Geometry) -> TiledMap {
    let (k, p, q, n) = (g.k as u64, g.p as u64, g.q as u64, batch as u64);
    let (dims, strides, boxes) = match tiling {
        Tiling::Gemm => (vec![k, n * p * q], vec![k], vec![CODE_BOX as u32, BM as u32]),
        Tiling::Patch { w, h } => (vec![k, q, p, n], vec![k, q * k, p * q * k], vec![CODE_BOX as u32, w as u32, h as u32, 1]),
    };
    let element_strides = vec![1; dims.len()];
    TiledMap { elem: TmaElem::U8, address: y, dims, strides, boxes, element_strides, swizzle: TmaSwizzle::B64 }
}

/// The weight's map: `[K][R·S][C]` codes at `w`, boxes of `bn` channels × `bk` codes of one tap.
fn weight_map(v: HopperVariant, w: u64, g: &Geometry) -> TiledMap {
    let (c, taps, k) = (g.c as u64, (g.r * g.s) as u64, g.k as u64);
    TiledMap {
        elem: TmaElem::U8,
        address: w,
        dims: vec![c, taps, k],
        strides: vec![c, taps * c],
        boxes: vec![v.bk as u32, 1, v.bn as u32],
        element_strides: vec![1, 1, 1],
        swizzle: v.swizzle(),
    }
}

/// The wgmma candidates of conv `node` (one per [`HopperVariant`]); none where [`plan`] refuses
/// it (the reason is logged) or the device cannot give a variant its shared memory.
pub(super) fn candidates(ctx: &mut BuildCtx, node: NodeId, p: &Conv8Problem) -> Result<Vec<Box<dyn Layer>>> {
    if HopperVariant::of(p.format).next().is_none() {
        tracing::debug!(path = %p.path, why = FP8_REFUSAL, "no wgmma 8-bit conv candidate");
        return Ok(vec![]);
    }
    let g = Geometry::of(p);
    let tiling = match plan(ctx.kernels.arch(), &g) {
        Ok(t) => t,
        Err(why) => {
            tracing::debug!(path = %p.path, %why, "no wgmma 8-bit conv candidate");
            return Ok(vec![]);
        }
    };
    let arch = hopper_arch(ctx.kernels.arch()).expect("checked by plan");
    let (name, source) = CONV8_HOPPER;
    ctx.kernels.add_source_for(name, source, &arch)?;
    let mut out: Vec<Box<dyn Layer>> = Vec::new();
    for variant in HopperVariant::of(p.format) {
        let entry = variant.entry(p.format);
        let f = ctx.kernels.get(&entry)?;
        let smem = variant.shared_bytes();
        if let Err(e) = f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32) {
            tracing::debug!(path = %p.path, %entry, smem, error = ?e, "the device cannot give this wgmma conv its shared memory");
            continue;
        }
        // Two blocks an SM need the whole of its unified L1 as shared memory.
        if variant.blocks > 1 {
            if let Err(e) = f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100) {
                tracing::debug!(path = %p.path, %entry, error = ?e, "the device refuses the wgmma conv's shared-memory carveout");
                continue;
            }
        }
        let w = ctx.upload_bytes(&p.codes)?;
        let w_map = weight_map(variant, w.ptr(), &g);
        debug_assert_eq!(w_map.box_bytes(), (variant.bn * variant.bk) as u64, "the kernel's B stage");
        let w_map = w_map.encode().map_err(|e| ctx.err(node, LowerKind::Unsupported, e))?;
        let alpha = ctx.upload_f32(&p.alpha)?;
        let bias = p.bias.as_deref().map(|b| ctx.upload_f32(b)).transpose()?;
        out.push(Box::new(Conv8HopperLayer {
            path: p.path.clone(),
            entry,
            variant,
            tiling,
            geometry: g,
            f,
            x: p.x,
            y: p.y,
            z: p.z,
            w,
            w_map: w_map.opaque,
            alpha,
            bias,
            epilogue: p.epilogue,
            geo: p.geo,
            sms: ctx.kernels.sm_count(),
        }));
    }
    Ok(out)
}

/// A conv of an 8-bit engine on the wgmma kernel: input (and residual) read as codes, output
/// written as f16 or requantised codes, as `Conv8Layer`.
struct Conv8HopperLayer {
    path: String,
    entry: String,
    variant: HopperVariant,
    tiling: Tiling,
    geometry: Geometry,
    f: CudaFunction,
    x: ValueId,
    y: ValueId,
    z: Option<ValueId>,
    /// `[K][R][S][C]` codes, and their tensor map's bytes.
    w: DeviceBuf,
    w_map: [u64; 16],
    /// `s_x · s_w[k]` per output channel.
    alpha: DeviceBuf,
    bias: Option<DeviceBuf>,
    epilogue: Epilogue8,
    /// H, W, C, K, R, S, P, Q, stride, padding and dilation as the kernel takes them.
    geo: [i32; 14],
    /// The device's SMs: the persistent grid's size at most.
    sms: u32,
}

impl Conv8HopperLayer {
    /// Tiles of a launch over `batch` images: pixel tiles × channel tiles, checked against the
    /// kernel's 32-bit indices (rows, and the tile index).
    fn tiles(&self, batch: usize) -> std::result::Result<u32, String> {
        let g = &self.geometry;
        let rows = batch.checked_mul(g.p).and_then(|r| r.checked_mul(g.q));
        if rows.is_none_or(|r| r > i32::MAX as usize - BM) {
            return Err(format!("batch {batch} exceeds the wgmma conv's 32-bit range of output pixels"));
        }
        self.tiling
            .pixel_tiles(batch, g.p, g.q)
            .and_then(|t| t.checked_mul(g.k.div_ceil(self.variant.bn)))
            .and_then(|b| u32::try_from(b).ok().filter(|&b| b <= i32::MAX as u32))
            .ok_or_else(|| format!("batch {batch} needs more blocks of the wgmma conv than a grid has"))
    }
}

impl Layer for Conv8HopperLayer {
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
        let binding = |reason: String| Error::Binding { name: self.path.clone(), reason };
        let tiles = self.tiles(batch).map_err(binding)?;
        // Persistent: `blocks` an SM (as many fit, `__launch_bounds__(384, blocks)`), each walking
        // its tiles.
        let blocks = tiles.min(self.sms.max(1).saturating_mul(self.variant.blocks as u32));
        let y = rt.ptr(self.y);
        if !y.is_multiple_of(16) || self.z.is_some_and(|z| !rt.ptr(z).is_multiple_of(16)) {
            return Err(binding("the wgmma conv's output and residual must be 16-byte aligned".into()));
        }
        let x = rt.ptr(self.x);
        let x_map = activation_map(self.tiling, self.variant, x, batch, &self.geometry);
        debug_assert_eq!(x_map.box_bytes(), (BM * self.variant.bk) as u64, "the kernel's A stage");
        let x_map = x_map
            .encode()
            .map_err(|reason| Error::Cuda { context: format!("the wgmma conv `{}`'s input tensor map", self.path), reason })?;
        let z = self.z.map_or(0, |z| rt.ptr(z));
        // The output's and the residual's maps, where the kernel reads them; zeros otherwise.
        let code_map = |address: u64, what: &str| -> Result<[u64; 16]> {
            let map = output_map(self.tiling, address, batch, &self.geometry);
            debug_assert_eq!(map.box_bytes(), (BM * CODE_BOX) as u64, "a box of the kernel's code tiles");
            let map = map
                .encode()
                .map_err(|reason| Error::Cuda { context: format!("the wgmma conv `{}`'s {what} tensor map", self.path), reason })?;
            Ok(map.opaque)
        };
        let codes = self.epilogue.codes_out();
        let y_map = if codes { code_map(y, "output")? } else { [0; 16] };
        let z_map = if codes && self.epilogue.z_store == Store8::Codes { code_map(z, "residual")? } else { [0; 16] };
        let pointers = [x, self.w.ptr(), self.alpha.ptr(), self.bias.as_ref().map_or(0, DeviceBuf::ptr), z, y];
        let mut args = vec![KArg::TensorMap(x_map.opaque), KArg::TensorMap(self.w_map), KArg::TensorMap(y_map), KArg::TensorMap(z_map)];
        args.extend(kernel_args(pointers, &self.epilogue, &self.geo, batch as i32, (0, 1)));
        args.extend(self.tiling.kernel_args().map(KArg::I32));
        args.push(KArg::I32(tiles as i32));
        launch(rt, &self.f, (blocks, 1, 1), (THREADS, 1, 1), self.variant.shared_bytes() as u32, &args)
    }
}

/// Every entry point of `kernels/conv8_hopper.cu` the layers launch, for the NVRTC test.
pub fn entry_points() -> Vec<String> {
    [QuantFormat::Int8, QuantFormat::Fp8E4m3].into_iter().flat_map(|f| HopperVariant::of(f).map(move |v| v.entry(f))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(c: usize, hw: [usize; 2], k: usize, rs: usize, stride: usize, pad: usize) -> Geometry {
        let out = |i: usize| (i + 2 * pad - rs) / stride + 1;
        Geometry { c, h: hw[0], w: hw[1], k, r: rs, s: rs, p: out(hw[0]), q: out(hw[1]), stride: [stride; 2], padding: [pad; 2] }
    }

    #[test]
    fn convs_outside_the_kernel_are_refused_with_the_reason() {
        let g = conv(64, [56, 56], 64, 3, 1, 1);
        assert!(plan("sm_90", &g).is_ok());
        assert!(plan("sm_89", &g).unwrap_err().contains("sm_90"));
        assert!(plan("sm_100", &g).unwrap_err().contains("sm_90"));
        assert!(plan("sm_90", &Geometry { c: 24, ..g }).unwrap_err().contains("multiples of 16"));
        assert!(plan("sm_90", &Geometry { k: 40, ..g }).unwrap_err().contains("multiples of 16"));
        assert!(plan("sm_90", &conv(64, [64, 64], 64, 3, 9, 1)).unwrap_err().contains("traversal strides"));
        assert_eq!(MAX_REDUCTION, 131_071);
        assert!(plan("sm_90", &conv(14_560, [8, 8], 64, 3, 1, 1)).is_ok(), "9 × 14560 = 131040 codes");
        assert!(plan("sm_90", &conv(14_576, [8, 8], 64, 3, 1, 1)).unwrap_err().contains("overflow"));
        assert!(plan("sm_90", &Geometry { r: usize::MAX, ..g }).unwrap_err().contains("overflow"));
        // Strides up to 8 take narrower patches: 16 × 8 needs boxes of 128 × 64 inputs.
        assert_eq!(plan("sm_90", &conv(64, [256, 256], 64, 1, 8, 0)), Ok(Tiling::Patch { w: 16, h: 8 }));
    }

    #[test]
    fn one_by_one_stride_one_convs_are_plain_gemms_and_the_rest_patches() {
        assert_eq!(plan("sm_90", &conv(64, [56, 56], 256, 1, 1, 0)), Ok(Tiling::Gemm));
        // A strided or padded 1×1 conv is not the activation matrix.
        assert!(matches!(plan("sm_90", &conv(256, [56, 56], 512, 1, 2, 0)), Ok(Tiling::Patch { .. })));
        assert!(matches!(plan("sm_90", &conv(16, [9, 11], 16, 1, 1, 1)), Ok(Tiling::Patch { .. })));
        // 56 × 56: 16 × 8 patches compute 56 × 64 pixels, as 8 × 16, 32 × 4 and 64 × 2 do: the
        // squarest, then the wider wins; 7 × 7: 16 × 8 and 8 × 16 compute 128, 32 × 4 256.
        assert_eq!(plan("sm_90", &conv(64, [56, 56], 64, 3, 1, 1)), Ok(Tiling::Patch { w: 16, h: 8 }));
        assert_eq!(plan("sm_90", &conv(512, [7, 7], 512, 3, 1, 1)), Ok(Tiling::Patch { w: 16, h: 8 }));
        // A wide, short output: 3 × 100 pixels take three 128 × 1 patches (384 pixels; 64 × 2
        // would compute 4 × 128).
        assert_eq!(plan("sm_90", &conv(32, [3, 100], 32, 3, 1, 1)), Ok(Tiling::Patch { w: 128, h: 1 }));
        // Stride 2 at 128 columns needs a 256-pixel box: still within TMA's limit.
        assert_eq!(plan("sm_90", &conv(32, [2, 300], 32, 1, 2, 0)), Ok(Tiling::Patch { w: 128, h: 1 }));
    }

    #[test]
    fn patches_cover_the_output_and_waste_least() {
        for g in [
            conv(64, [56, 56], 64, 3, 1, 1),
            conv(128, [28, 28], 128, 3, 2, 1),
            conv(16, [9, 11], 48, 3, 2, 1),
            conv(32, [5, 3], 80, 3, 1, 1),
        ] {
            let Ok(Tiling::Patch { w, h }) = plan("sm_90", &g) else { panic!("{g:?}") };
            assert_eq!(w * h, BM);
            let computed = g.p.div_ceil(h) * h * g.q.div_ceil(w) * w;
            for e in 0..=7 {
                let (w2, h2) = (1 << e, BM >> e);
                assert!(computed <= g.p.div_ceil(h2) * h2 * g.q.div_ceil(w2) * w2, "{g:?}: {w}×{h} wastes more than {w2}×{h2}");
            }
            let tiles = Tiling::Patch { w, h }.pixel_tiles(3, g.p, g.q).expect("small");
            assert!(tiles * BM >= 3 * g.p * g.q, "{g:?}: {tiles} tiles");
        }
        assert_eq!(Tiling::Gemm.pixel_tiles(1, 7, 7), Some(1));
        assert_eq!(Tiling::Gemm.pixel_tiles(64, 56, 56), Some(64 * 56 * 56 / 128));
        assert_eq!(Tiling::Gemm.pixel_tiles(usize::MAX, 2, 1), None);
    }

    /// `c8h_code_offset` of the kernel: channel `lc` of row `lr` in a tile of code boxes.
    fn code_offset(lr: usize, lc: usize) -> usize {
        (lc >> 6) * (BM * CODE_BOX) + lr * 64 + ((((lc >> 4) & 3) ^ ((lr >> 1) & 3)) << 4) + (lc & 15)
    }

    #[test]
    fn code_tiles_hold_each_code_once_and_a_warps_pairs_meet_no_bank_twice() {
        for bn in [64, 128, 256] {
            let mut seen = vec![false; BM * bn];
            for lr in 0..BM {
                for lc in 0..bn {
                    let o = code_offset(lr, lc);
                    assert!(o < BM * bn && !seen[o], "bn {bn}: ({lr}, {lc}) at {o}");
                    seen[o] = true;
                    // The 64-byte swizzle moves 16-byte chunks within their 64-byte row.
                    assert_eq!(o / 64, (lc >> 6) * BM + lr);
                }
            }
            // A warp's accumulator pair i (wgmma_acc_row/col): 8 rows × 4 lanes of 2 codes.
            for warp in 0..4 {
                for i in (0..bn / 2).step_by(2) {
                    let words: std::collections::BTreeSet<usize> = (0..32)
                        .map(|lane| {
                            let t = warp * 32 + lane;
                            let (lr, lc) = ((t >> 5) * 16 + ((t & 31) >> 2) + ((i >> 1) & 1) * 8, (i >> 2) * 8 + (t & 3) * 2);
                            code_offset(lr, lc) / 4
                        })
                        .collect();
                    let banks: std::collections::BTreeSet<usize> = words.iter().map(|w| w % 32).collect();
                    // 32 lanes of 2 codes, two lanes a 4-byte word: 16 words, each in a bank of its own.
                    assert_eq!((words.len(), banks.len()), (16, 16), "bn {bn} warp {warp} pair {i}");
                }
            }
        }
    }

    #[test]
    fn tensor_maps_bring_the_bytes_the_kernel_expects() {
        // The kernel expects 128 · BK bytes of activation and BN · BK of weight per stage.
        for v in HopperVariant::ALL {
            for g in [
                conv(64, [56, 56], 64, 1, 1, 0),
                conv(64, [56, 56], 64, 3, 1, 1),
                conv(144, [9, 11], 16, 3, 2, 1),
                conv(16, [9, 11], 48, 1, 2, 0),
            ] {
                let tiling = plan("sm_90", &g).expect("applies");
                for batch in [1, 64] {
                    let x = activation_map(tiling, v, 0x10_0000, batch, &g);
                    assert_eq!(x.check(), Ok(()), "{g:?} {v:?}");
                    assert_eq!(x.box_bytes(), (BM * v.bk) as u64, "{g:?} {v:?} {tiling:?}");
                    let elements: u64 = x.dims.iter().product();
                    assert_eq!(elements, (batch * g.h * g.w * g.c) as u64);
                }
                for batch in [1, 64] {
                    let y = output_map(tiling, 0x30_0000, batch, &g);
                    assert_eq!(y.check(), Ok(()), "{g:?} {tiling:?}");
                    assert_eq!(y.box_bytes(), (BM * CODE_BOX) as u64, "{g:?} {tiling:?}");
                    assert_eq!(y.dims.iter().product::<u64>(), (batch * g.p * g.q * g.k) as u64);
                }
                let w = weight_map(v, 0x20_0000, &g);
                assert_eq!(w.check(), Ok(()));
                assert_eq!(w.box_bytes(), (v.bn * v.bk) as u64);
                assert_eq!(w.dims.iter().product::<u64>(), (g.k * g.r * g.s * g.c) as u64);
            }
        }
        // A patch's box: a stride-2 conv's 28 × 28 outputs take 32 × 4 patches (28 × 32 pixels
        // computed; 16 × 8 would compute 32 × 32), each reading 64 × 8 inputs, every second.
        let g = conv(64, [56, 56], 128, 3, 2, 1);
        assert_eq!(plan("sm_90", &g), Ok(Tiling::Patch { w: 32, h: 4 }));
        let x = activation_map(Tiling::Patch { w: 32, h: 4 }, HopperVariant::ALL[0], 0, 2, &g);
        assert_eq!(x.dims, [64, 56, 56, 2]);
        assert_eq!(x.strides, [64, 56 * 64, 56 * 56 * 64]);
        assert_eq!(x.boxes, [64, 64, 8, 1]);
        assert_eq!(x.element_strides, [1, 2, 2, 1]);
    }

    /// What a TMA box of `map` starting at `start` brings, in shared-memory order (dim 0 fastest,
    /// swizzle aside: it permutes bytes within rows, which wgmma's descriptor undoes): every
    /// traversal-stride-th element along each dim, zero outside the tensor.
    fn tma_box(map: &TiledMap, data: &[i8], start: &[i64]) -> Vec<i8> {
        let counts: Vec<i64> = map.boxes.iter().zip(&map.element_strides).map(|(&b, &e)| i64::from(b.div_ceil(e))).collect();
        let byte_strides: Vec<i64> = [1].into_iter().chain(map.strides.iter().map(|&s| s as i64)).collect();
        let total: i64 = counts.iter().product();
        (0..total)
            .map(|mut i| {
                let mut offset = 0i64;
                for d in 0..counts.len() {
                    let at = start[d] + (i % counts[d]) * i64::from(map.element_strides[d]);
                    i /= counts[d];
                    if at < 0 || at >= map.dims[d] as i64 {
                        return 0;
                    }
                    offset += at * byte_strides[d];
                }
                data[offset as usize]
            })
            .collect()
    }

    /// The kernel's work, step for step, on the host: its persistent grid of `grid` blocks, each
    /// walking every `grid`-th tile (`c8h_tile`), the producer's box coordinates per (tap, channel
    /// block), the consumers' sums over the boxes, and the epilogue's rows (its row rule); the s32
    /// sums of every output, and how often each was written.
    fn emulate(g: &Geometry, dilation: [usize; 2], v: HopperVariant, batch: usize, grid: usize, x: &[i8], w: &[i8]) -> (Vec<i32>, Vec<u8>) {
        let tiling = plan("sm_90", g).expect("applies");
        let (x_map, w_map) = (activation_map(tiling, v, 0, batch, g), weight_map(v, 0, g));
        let [patch_w, patch_h] = tiling.kernel_args().map(|a| a as i64);
        let (p, q, k) = (g.p as i64, g.q as i64, g.k as i64);
        let (n_tiles, c_blocks) = (g.k.div_ceil(v.bn), g.c.div_ceil(v.bk));
        let m_tiles = tiling.pixel_tiles(batch, g.p, g.q).expect("small");
        let (mut out, mut writes) = (vec![0i32; batch * g.p * g.q * g.k], vec![0u8; batch * g.p * g.q * g.k]);
        let tiles = m_tiles * n_tiles;
        for tile in (0..grid.min(tiles)).flat_map(|block| (block..tiles).step_by(grid)) {
            let (tile_m, col0) = ((tile / n_tiles) as i64, ((tile % n_tiles) * v.bn) as i64);
            let (m0, img, p0, q0) = if patch_w == 0 {
                (tile_m * BM as i64, 0, 0, 0)
            } else {
                let (tiles_p, tiles_q) = ((p + patch_h - 1) / patch_h, (q + patch_w - 1) / patch_w);
                let rest = tile_m % (tiles_p * tiles_q);
                (0, tile_m / (tiles_p * tiles_q), (rest / tiles_q) * patch_h, (rest % tiles_q) * patch_w)
            };
            let mut acc = vec![0i32; BM * v.bn];
            for it in 0..g.r * g.s * c_blocks {
                let (tap, c0) = ((it / c_blocks) as i64, ((it % c_blocks) * v.bk) as i64);
                let a = if patch_w == 0 {
                    tma_box(&x_map, x, &[c0, m0])
                } else {
                    let (r, fs) = (tap / g.s as i64, tap % g.s as i64);
                    let iw = q0 * g.stride[1] as i64 - g.padding[1] as i64 + fs * dilation[1] as i64;
                    let ih = p0 * g.stride[0] as i64 - g.padding[0] as i64 + r * dilation[0] as i64;
                    tma_box(&x_map, x, &[c0, iw, ih, img])
                };
                let b = tma_box(&w_map, w, &[c0, tap, col0]);
                assert_eq!((a.len(), b.len()), (BM * v.bk, v.bn * v.bk), "the boxes' bytes are the stage's");
                for (lr, arow) in a.chunks(v.bk).enumerate() {
                    for (n, brow) in b.chunks(v.bk).enumerate() {
                        acc[lr * v.bn + n] += arow.iter().zip(brow).map(|(&x, &w)| i32::from(x) * i32::from(w)).sum::<i32>();
                    }
                }
            }
            for lr in 0..BM as i64 {
                let row = if patch_w == 0 {
                    Some(m0 + lr).filter(|&r| r < batch as i64 * p * q)
                } else {
                    let (pp, qq) = (p0 + lr / patch_w, q0 + lr % patch_w);
                    (pp < p && qq < q).then_some((img * p + pp) * q + qq)
                };
                let Some(row) = row else { continue };
                for n in 0..v.bn as i64 {
                    if col0 + n < k {
                        let at = (row * k + col0 + n) as usize;
                        out[at] = acc[(lr * v.bn as i64 + n) as usize];
                        writes[at] += 1;
                    }
                }
            }
        }
        (out, writes)
    }

    /// The direct convolution of NHWC `x` by `[K][R][S][C]` `w`, in s32.
    fn direct(g: &Geometry, dilation: [usize; 2], batch: usize, x: &[i8], w: &[i8]) -> Vec<i32> {
        let mut out = vec![0i32; batch * g.p * g.q * g.k];
        for (n, pp, qq, kk) in (0..batch)
            .flat_map(|n| (0..g.p).flat_map(move |pp| (0..g.q).map(move |qq| (n, pp, qq))))
            .flat_map(|(n, pp, qq)| (0..g.k).map(move |kk| (n, pp, qq, kk)))
        {
            let mut sum = 0i32;
            for (r, fs, c) in (0..g.r).flat_map(|r| (0..g.s).flat_map(move |fs| (0..g.c).map(move |c| (r, fs, c)))) {
                let ih = (pp * g.stride[0] + r * dilation[0]) as i64 - g.padding[0] as i64;
                let iw = (qq * g.stride[1] + fs * dilation[1]) as i64 - g.padding[1] as i64;
                if ih < 0 || iw < 0 || ih >= g.h as i64 || iw >= g.w as i64 {
                    continue;
                }
                let xv = x[((n * g.h + ih as usize) * g.w + iw as usize) * g.c + c];
                sum += i32::from(xv) * i32::from(w[((kk * g.r + r) * g.s + fs) * g.c + c]);
            }
            out[((n * g.p + pp) * g.q + qq) * g.k + kk] = sum;
        }
        out
    }

    #[test]
    fn the_kernels_tiles_and_boxes_compute_the_conv() {
        // (C, H × W, K, R, stride, padding, dilation): both modes; C and K partial tiles; C below
        // one stage; stride 2 with patches overhanging both edges; dilation; batch 1 and 3.
        let cases = [
            (32, [9, 11], 48, 1, 1, 0, 1),
            (16, [5, 7], 16, 1, 1, 0, 1),
            (48, [9, 11], 80, 3, 1, 1, 1),
            (80, [9, 11], 32, 3, 2, 1, 1),
            (48, [9, 11], 16, 1, 2, 0, 1),
            (48, [9, 11], 32, 3, 1, 2, 2),
            (144, [6, 5], 16, 3, 1, 1, 1),
            (16, [3, 40], 272, 3, 2, 1, 1),
            // 64 × 2 patches whose first and last filter rows' boxes lie wholly outside; 128 × 1
            // patches of 256-pixel stride-2 boxes (tests/gpu_conv8_hopper.rs's `edges`).
            (16, [2, 258], 32, 3, 1, 2, 2),
            (32, [2, 258], 32, 3, 2, 1, 1),
        ];
        let seed = crate::seeded::run_seed();
        for (i, &(c, hw, k, rs, stride, pad, dil)) in cases.iter().enumerate() {
            let out = |n: usize| (n + 2 * pad - dil * (rs - 1) - 1) / stride + 1;
            let g =
                Geometry { c, h: hw[0], w: hw[1], k, r: rs, s: rs, p: out(hw[0]), q: out(hw[1]), stride: [stride; 2], padding: [pad; 2] };
            for batch in [1, 3] {
                let code =
                    |stream: u64, j: usize| (crate::seeded::uniform(seed.wrapping_add(stream), j as u64) * 255.0 - 127.5).round() as i8;
                let x: Vec<i8> = (0..batch * g.h * g.w * c).map(|j| code(2 * i as u64, j)).collect();
                let w: Vec<i8> = (0..k * rs * rs * c).map(|j| code(2 * i as u64 + 1, j)).collect();
                let want = direct(&g, [dil; 2], batch, &x, &w);
                // Grids of one block, a few, and more blocks than tiles.
                for (v, grid) in HopperVariant::ALL.into_iter().flat_map(|v| [1, 3, 132].map(|g| (v, g))) {
                    let (got, writes) = emulate(&g, [dil; 2], v, batch, grid, &x, &w);
                    assert!(writes.iter().all(|&n| n == 1), "{g:?} batch {batch} {v:?}, {grid} blocks: every output written once");
                    assert_eq!(got, want, "{g:?} batch {batch} {v:?}, {grid} blocks");
                }
            }
        }
    }

    #[test]
    fn variants_fit_the_shared_memory_of_one_block() {
        for v in HopperVariant::ALL {
            // sm_90's opt-in limit per block is 227 KiB, 228 KiB an SM with 1 KiB reserved per
            // block; stages stay 1024-byte aligned.
            assert!(v.shared_bytes() <= 227 * 1024, "{v:?}: {} bytes", v.shared_bytes());
            assert!(v.blocks * (v.shared_bytes() + 1024) <= 228 * 1024, "{v:?}: {} blocks an SM", v.blocks);
            assert!(v.blocks == 1 || v.bn == 64, "{v:?}: two blocks leave a consumer 104 registers, room for 64 accumulators");
            assert_eq!(((BM + v.bn) * v.bk) % 1024, 0, "{v:?}");
            assert!(v.bk == 64 || v.bk == 128);
            assert_eq!(v.shared_bytes(), v.stages * (BM + v.bn) * v.bk + BM * (v.bn + 8) * 4 + 1024, "the ring, then the staging tile");
            assert!(v.stages >= 3, "{v:?}: a ring deep enough to load ahead");
            assert!(v.bn.is_multiple_of(CODE_BOX) && 4 * BM * v.bn <= BM * (v.bn + 8) * 4, "{v:?}: four code tiles in the staging bytes");
        }
        assert_eq!(HopperVariant::ALL[1].entry(QuantFormat::Int8), "conv8_i8_wgmma_n64_bk64_s4_x2");
        assert_eq!(HopperVariant::ALL[3].entry(QuantFormat::Int8), "conv8_i8_wgmma_n128_bk128_s4");
        assert_eq!(HopperVariant::ALL[4].entry(QuantFormat::Int8), "conv8_i8_wgmma_n256_bk64_s3");
        assert_eq!(entry_points().len(), 5, "five int8 tiles and no FP8 one");
        assert_eq!(HopperVariant::of(QuantFormat::Fp8E4m3).count(), 0, "{FP8_REFUSAL}");
        assert!(entry_points().iter().all(|e| crate::engine::eight_bit::precision_of_kind(&format!("kernel:{e}")).is_some()));
    }

    /// An mbarrier as the kernel uses it: `completed` phases so far, and the arrivals still
    /// missing from the current one. `try_wait.parity(p)` succeeds once the phase of parity `p`
    /// is complete, i.e. when the current phase's parity is not `p` (so before the first phase
    /// completes, parity 1 already passes: the producer's first pass over the ring).
    struct Barrier {
        completed: u32,
        missing: u32,
        count: u32,
    }

    impl Barrier {
        fn new(count: u32) -> Self {
            Barrier { completed: 0, missing: count, count }
        }
        fn passes(&self, parity: u32) -> bool {
            self.completed & 1 != parity
        }
        fn arrive(&mut self, n: u32) {
            assert!(n <= self.missing, "more arrivals than the barrier's count");
            self.missing -= n;
            if self.missing == 0 {
                self.completed += 1;
                self.missing = self.count;
            }
        }
    }

    /// One consumer warpgroup's walk, as `kernels/conv8_hopper.cu` writes it: the block's tiles
    /// k = first, first + step, ... ; tile k's stages from g0 = k·k_iters, stage `g0 % stages`,
    /// phase `(g0 / stages) & 1`, then running counters; each stage freed after the next one's
    /// MMAs are issued, the tile's last after all of them.
    struct Consumer {
        first: usize,
        step: usize,
        k: usize,
        it: usize,
        s: usize,
        phase: u32,
        prev: Option<usize>,
        reading: Vec<(usize, usize)>,
        done: usize,
    }

    impl Consumer {
        /// Ping-pong's order: warpgroup 0 may start its j-th tile's main loop once warpgroup 1 has
        /// issued its (j - 1)-th, and warpgroup 1 its j-th once warpgroup 0 has issued its j-th,
        /// (`order[wg]`, parity as the kernel computes it), so that no warpgroup waits on a stage
        /// whose previous use has not completed (a parity wait cannot tell them apart).
        fn order_parity(&self, wg: usize) -> Option<u32> {
            let j = self.done;
            match wg {
                0 if j == 0 => None,
                0 => Some(((j - 1) & 1) as u32),
                _ => Some((j & 1) as u32),
            }
        }
    }

    /// Runs the kernel's ring protocol for one block of `tiles` tiles under a seeded random
    /// schedule of its producer and consumers: `Err` on a deadlock or on a consumer reading a
    /// stage that does not hold its tile's box (or that the producer refills before it is freed).
    fn ring_protocol(tiles: usize, k_iters: usize, stages: usize, ping_pong: bool, seed: u64) -> std::result::Result<usize, String> {
        let warps_per_reader = if ping_pong { 4 } else { 8 };
        let mut full: Vec<Barrier> = (0..stages).map(|_| Barrier::new(1)).collect();
        let mut empty: Vec<Barrier> = (0..stages).map(|_| Barrier::new(warps_per_reader)).collect();
        let mut content: Vec<Option<usize>> = vec![None; stages];
        let mut order: Vec<Barrier> = (0..2).map(|_| Barrier::new(4)).collect();
        let mut consumers: Vec<Consumer> = (0..2)
            .map(|wg| {
                let (first, step) = if ping_pong { (wg, 2) } else { (0, 1) };
                Consumer { first, step, k: first, it: 0, s: 0, phase: 0, prev: None, reading: vec![], done: 0 }
            })
            .collect();
        for c in &mut consumers {
            let g0 = c.first * k_iters;
            (c.s, c.phase) = (g0 % stages, ((g0 / stages) & 1) as u32);
        }
        let total = tiles * k_iters;
        let (mut produced, mut rng, mut reads) = (0usize, seed | 1, 0usize);
        let arrivals = 4; // a warpgroup's four warps arrive together
        loop {
            let finished = produced == total && consumers.iter().all(|c| c.k >= tiles);
            if finished {
                return Ok(reads);
            }
            // Who can move: the producer (0) or a consumer (1, 2).
            let mut ready = vec![];
            if produced < total && empty[produced % stages].passes((((produced / stages) & 1) as u32) ^ 1) {
                ready.push(0);
            }
            for (i, c) in consumers.iter().enumerate() {
                let ordered = !ping_pong || c.it > 0 || c.order_parity(i).is_none_or(|p| order[i].passes(p));
                if c.k < tiles && ordered && full[c.s].passes(c.phase) {
                    ready.push(i + 1);
                }
            }
            if ready.is_empty() {
                return Err(format!(
                    "deadlock: produced {produced} of {total}, consumers at tiles {:?}",
                    consumers.iter().map(|c| c.k).collect::<Vec<_>>()
                ));
            }
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let who = ready[(rng % ready.len() as u64) as usize];
            if who == 0 {
                let s = produced % stages;
                if consumers.iter().any(|c| c.reading.iter().any(|&(rs, _)| rs == s)) {
                    return Err(format!("stage {s} refilled with g = {produced} while a consumer still reads it"));
                }
                content[s] = Some(produced);
                full[s].arrive(1);
                produced += 1;
                continue;
            }
            let c = &mut consumers[who - 1];
            let g = c.k * k_iters + c.it;
            if content[c.s] != Some(g) {
                return Err(format!("consumer {} read stage {} holding {:?}, wanted g = {g}", who - 1, c.s, content[c.s]));
            }
            reads += 1;
            c.reading.push((c.s, g));
            // After this stage's MMAs are issued, the previous one is freed.
            if let Some(p) = c.prev.take() {
                c.reading.retain(|&(rs, _)| rs != p);
                empty[p].arrive(arrivals);
            }
            c.prev = Some(c.s);
            c.s += 1;
            if c.s == stages {
                c.s = 0;
                c.phase ^= 1;
            }
            c.it += 1;
            if c.it == k_iters {
                // The main loop is issued: the other warpgroup's may start.
                if ping_pong {
                    order[1 - (who - 1)].arrive(arrivals);
                }
                // The tile's last stage, freed after every group.
                let p = c.prev.take().expect("a stage");
                c.reading.retain(|&(rs, _)| rs != p);
                empty[p].arrive(arrivals);
                c.done += 1;
                c.k += c.step;
                c.it = 0;
                let g0 = c.k * k_iters;
                (c.s, c.phase) = (g0 % stages, ((g0 / stages) & 1) as u32);
            }
        }
    }

    #[test]
    fn the_ring_feeds_each_warpgroup_its_own_tiles_in_ping_pong_and_cooperatively() {
        // Shapes of the variants' rings against reductions shorter than, as long as and longer
        // than the ring, over odd and even tile counts a block.
        for (stages, k_iters) in [(8, 9), (8, 1), (8, 8), (4, 18), (3, 36), (4, 2), (8, 17)] {
            for tiles in [1, 2, 3, 7, 48] {
                for seed in 1..40u64 {
                    let pp = ring_protocol(tiles, k_iters, stages, true, seed)
                        .unwrap_or_else(|e| panic!("ping-pong {stages} stages, {k_iters} k-steps, {tiles} tiles: {e}"));
                    assert_eq!(pp, tiles * k_iters, "every stage read once in ping-pong");
                    let coop = ring_protocol(tiles, k_iters, stages, false, seed)
                        .unwrap_or_else(|e| panic!("cooperative {stages} stages, {k_iters} k-steps, {tiles} tiles: {e}"));
                    assert_eq!(coop, 2 * tiles * k_iters, "every stage read by both warpgroups cooperatively");
                }
            }
        }
    }
}
