//! 8-bit convolutions (`kernels/conv8.cu`, and cuDNN's fused engines) and the plan of which
//! values an INT8 or FP8 engine keeps in 8 bits between them (the plan's type, [`EightBitPlan`],
//! is the engine's: the builder allocates by it).
//!
//! The quantised graph (`calibrate::prepare_for_engine`) says *what* is quantised: a
//! `fake_quantize` in front of each 8-bit conv's input and residual, weights folded onto their
//! grid (`Op::Weight::quant`). [`EightBitPlan`] decides *how it is stored*:
//! - an activation quantiser whose every reader is a conv the 8-bit kernel runs is stored as its
//!   codes (`Elem::I8` / `Elem::E4m3`) with the quantiser's scale;
//! - such a conv reads the codes of its input and residual directly, and multiplies on 8-bit
//!   tensor cores;
//! - where a conv's only reader is such a quantiser, the conv requantises in its epilogue and
//!   writes the codes itself: the quantiser computes nothing (TensorRT's "requantise in the
//!   epilogue"). Elsewhere the quantiser runs as a kernel writing codes (`ops::quant`).
//!
//! The numbers are the CPU fake-quant simulation's: the conv accumulates exact integer (or e4m3)
//! products, scales them by `s_x · s_w[k]` in f32, adds the f32 bias and the dequantised
//! residual, applies ReLU, and rounds to the next quantiser's grid as `kernels/quant.cu` does.

use super::{Activation, ConvAttrs};
use crate::engine::cudnn::kcrs_to_krsc;
use crate::engine::cudnn_graph::{engine_configs, FusedConv, FusedConvLayer, Operand, Step};
use crate::engine::eight_bit::{EightBitPlan, LIBRARY_KIND};
use crate::engine::launch::{grid_for, launch, CudaFunction, KArg, BLOCK};
use crate::engine::layer::{to_elem_bytes, DeviceBuf, Elem, Layer, Layout, RunCtx, ValueDesc, ValueId};
use crate::engine::{BuildConfig, Precision};
use crate::graph::{Graph, NodeId, Op};
use crate::ops::pool::PoolAttrs;
use crate::ops::quant::{Quant, QuantFormat, QuantParams};
use crate::ops::BuildCtx;
use crate::LowerKind;
use crate::{Error, Result};
use cudarc::driver::sys::CUfunction_attribute;

pub mod hopper;

/// `kernels/conv8.cu`, compiled with NVRTC on first use.
pub const CONV8_CU: &str = crate::engine::kernels::ON_DEMAND[4].1;

/// Reduction bytes per stage and pipeline depth (`C8_BK`, `C8_STAGES` in the kernel).
const BK: usize = 64;
const STAGES: usize = 3;

/// The per-tensor, symmetric activation quantiser of `format` at `id`, if it is one.
fn activation_quantiser(graph: &Graph, id: NodeId, format: QuantFormat) -> Option<&QuantParams> {
    let n = &graph.nodes[id];
    let Op::Quant(Quant::FakeQuantize(p)) = &n.op else { return None };
    let on_activation = n.inputs.first().is_some_and(|&i| !matches!(graph.nodes[i].op, Op::Weight { .. }));
    let symmetric = p.zero_point.iter().all(|&z| z == 0);
    (on_activation && p.format == format && p.axis.is_none() && p.scale.len() == 1 && symmetric).then_some(p)
}

/// Whether conv `id`'s weight is folded onto the engine's 8-bit grid (int8 per output channel or
/// per tensor; fp8 per tensor).
fn weight_on_grid(graph: &Graph, id: NodeId, format: QuantFormat) -> bool {
    let Some(&w) = graph.nodes[id].inputs.get(1) else { return false };
    let Op::Weight { quant: Some(q), .. } = &graph.nodes[w].op else { return false };
    q.format == format
        && q.zero_point.iter().all(|&z| z == 0)
        && match q.axis {
            None => q.scale.len() == 1,
            Some(0) => format == QuantFormat::Int8 && q.scale.len() == graph.nodes[w].shape[0],
            Some(_) => false,
        }
}

/// A conv the 8-bit kernel can run, its quantisers aside: a plain (not transposed, not grouped,
/// no pool) conv with ReLU or no activation, input and output channels multiples of 16 (16-byte
/// vectors of codes), and a weight on the 8-bit grid.
fn kernel_fits(graph: &Graph, id: NodeId, format: QuantFormat) -> bool {
    tile_shape_fits(graph, id) && weight_on_grid(graph, id, format)
}

/// A conv the 8-bit tile kernels take by its shape and attributes: plain (not transposed or
/// grouped, no pool), ReLU or no activation, input and output channels multiples of 16.
fn tile_shape_fits(graph: &Graph, id: NodeId) -> bool {
    let n = &graph.nodes[id];
    let Op::Conv(a) = &n.op else { return false };
    let plain = !a.transposed && a.groups == 1 && a.pool.is_none() && matches!(a.act, Activation::None | Activation::Relu);
    plain && n.inputs.get(1).is_some_and(|&w| matches!(graph.nodes[w].shape[..], [k, c, _, _] if c % 16 == 0 && k % 16 == 0))
}

/// Whether conv `id` of an unquantised graph has an 8-bit kernel at all, by its shape: the tile
/// kernels' (`tile_shape_fits`) or the 8-bit stem's. A conv without one computes in 16 bits in an
/// 8-bit engine whatever its quantisers; `calibrate::quantize_graph` leaves such a conv
/// unquantised in FP8 engines, where e4m3 rounding of its inputs costs answers and buys no speed.
pub fn has_kernel(graph: &Graph, id: NodeId) -> bool {
    let n = &graph.nodes[id];
    let Op::Conv(a) = &n.op else { return false };
    let stem = match (a.pool, n.inputs.get(1)) {
        (Some(pool), Some(&w)) => super::stem::fits(a, &pool, &graph.nodes[w].shape),
        _ => false,
    };
    stem || tile_shape_fits(graph, id)
}

/// A conv the 8-bit stem runs (`stem::fits`: ResNet's 7×7/2 conv, ReLU and 3×3/2
/// max-pool on at most 4 channels), with its weight on the 8-bit grid and its input an activation
/// quantiser of the format (the stem quantises with its scale).
fn stem_fits(graph: &Graph, id: NodeId, format: QuantFormat) -> bool {
    let n = &graph.nodes[id];
    let Op::Conv(a) = &n.op else { return false };
    let (Some(pool), Some(&w)) = (a.pool, n.inputs.get(1)) else { return false };
    super::stem::fits(a, &pool, &graph.nodes[w].shape)
        && weight_on_grid(graph, id, format)
        && activation_quantiser(graph, n.inputs[0], format).is_some()
}

/// The 8-bit plan of `graph` for an engine of `config` whose nodes compute in `precisions` (a
/// node a per-layer rule keeps in FP16/FP32 is not 8-bit; a `Best` engine's 8-bit convs are its
/// `best_int8_layers`, every conv that can where it has none). Empty for 16- and 32-bit
/// precisions, and for INT8 below sm_80 (`mma.m16n8k32`); FP8 engines need sm_89, which the
/// builder checks.
pub fn plan(graph: &Graph, config: &BuildConfig, precisions: &[Precision], sm: u32) -> EightBitPlan {
    let len = graph.nodes.len();
    let mut plan =
        EightBitPlan { format: None, conv: vec![false; len], stored: vec![false; len], requant: vec![None; len], folded: vec![false; len] };
    let precision = config.precision;
    let format = match precision.quant_format() {
        Some(QuantFormat::Int8) if sm >= 80 => QuantFormat::Int8,
        Some(QuantFormat::Fp8E4m3) if sm >= 89 => QuantFormat::Fp8E4m3,
        _ => return plan,
    };
    plan.format = Some(format);
    let eight_bit = |id: NodeId| precisions.get(id) == Some(&precision);
    let chosen: Option<std::collections::HashSet<&str>> = match (precision, &config.best_int8_layers) {
        (Precision::Best, Some(paths)) => Some(paths.iter().map(String::as_str).collect()),
        _ => None,
    };
    let chosen = |id: NodeId| chosen.as_ref().is_none_or(|c| c.contains(graph.nodes[id].path.as_str()));
    let readers = graph.readers();
    let output = |id: NodeId| graph.outputs.iter().any(|(_, o)| *o == id);
    let stem = |id: NodeId| stem_fits(graph, id, format);
    // The conv's 8-bit activations, read as codes: its input and its residual (none for the stem,
    // which reads FP16 values).
    let activations = |id: NodeId| -> Vec<NodeId> {
        let n = &graph.nodes[id];
        match &n.op {
            _ if stem(id) => vec![],
            Op::Conv(a) if a.residual => vec![n.inputs[0], *n.inputs.last().expect("a residual conv has inputs")],
            _ => vec![n.inputs[0]],
        }
    };
    for id in 0..len {
        plan.conv[id] = eight_bit(id) && chosen(id) && (kernel_fits(graph, id, format) || stem(id));
        plan.stored[id] = eight_bit(id) && activation_quantiser(graph, id, format).is_some() && !output(id);
    }
    // A stored value needs every reader to be an 8-bit conv reading it as an activation, and an
    // 8-bit conv needs its activations stored: drop what fails until nothing changes.
    loop {
        let mut changed = false;
        for (id, reads) in readers.iter().enumerate() {
            if plan.conv[id] && !activations(id).iter().all(|&a| plan.stored[a]) {
                plan.conv[id] = false;
                changed = true;
            }
            let readers_ok =
                reads.iter().all(|&r| plan.conv[r] && graph.nodes[r].inputs.iter().all(|&i| i != id || activations(r).contains(&i)));
            if plan.stored[id] && !readers_ok {
                plan.stored[id] = false;
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    for id in (0..len).filter(|&id| plan.conv[id] && !output(id)) {
        if let [q] = readers[id][..] {
            if plan.stored[q] {
                plan.requant[id] = Some(q);
            }
        }
    }
    // The 8-bit stem writes only codes: one whose output is read otherwise stays FP16. Where it
    // runs, the quantiser of its input folds into it if nothing else reads that.
    let stems: Vec<NodeId> = (0..len).filter(|&id| plan.conv[id] && stem(id)).collect();
    for id in stems {
        if plan.requant[id].is_none() {
            plan.conv[id] = false;
            continue;
        }
        let q = graph.nodes[id].inputs[0];
        plan.folded[q] = readers[q] == [id] && !output(q);
    }
    plan
}

/// One compiled tile shape: output pixels and channels per block, and whether it is the
/// persistent pointwise kernel (`CONV8_PW`: 1×1 convs, blocks walk their tiles through a
/// pipeline) rather than a tile per block (`CONV8`).
#[derive(Clone, Copy, Debug)]
struct Variant {
    bm: usize,
    bn: usize,
    /// The pointwise kernel's pipeline stages (2 or 3); 0 for a tile per block.
    pw_stages: usize,
}

/// The pointwise kernel's most input channels (its weights, input and residual tiles must fit in
/// shared memory, and its int8 accumulators, at most 256 products, convert to floats exactly
/// without the conversion unit: `small_int_to_float` in kernels/eight_bit.cuh). It takes C = 32,
/// 64, 128 or 256.
const PW_MAX_C: usize = 256;

impl Variant {
    /// 128-pixel tiles for large batches; 64-pixel tiles give small ones more blocks.
    const ALL: [Variant; 3] =
        [Variant { bm: 128, bn: 64, pw_stages: 0 }, Variant { bm: 128, bn: 128, pw_stages: 0 }, Variant { bm: 64, bn: 64, pw_stages: 0 }];
    /// 3 stages keep more bytes in flight per block; 2 leave room for two blocks per SM where C
    /// is 128.
    const POINTWISE: [Variant; 2] = [Variant { bm: 128, bn: 128, pw_stages: 2 }, Variant { bm: 128, bn: 128, pw_stages: 3 }];
    fn pointwise(self) -> bool {
        self.pw_stages > 0
    }
    fn threads(self) -> u32 {
        (128 * self.bn / 64) as u32
    }
    /// Shared memory for `c` input channels. A tile per block: the pipeline's stages, or the
    /// epilogue's f32 staging tile (rows padded by 4) if larger. Pointwise: alpha and bias, the
    /// weights, and per stage the input and residual tiles, rows padded by 16 bytes.
    fn smem_bytes(self, c: usize) -> u32 {
        let bytes = if self.pointwise() {
            2 * self.bn * 4 + self.bn * (c + 16) + self.pw_stages * self.bm * (c + 16 + self.bn + 16)
        } else {
            (STAGES * (self.bm + self.bn) * BK).max(self.bm * (self.bn + 4) * 4)
        };
        bytes as u32
    }
    fn entry(self, format: QuantFormat) -> String {
        match self.pointwise() {
            true => format!("conv8_{}_pw{}", EightBitPlan::elem(format).suffix(), self.pw_stages),
            false => format!("conv8_{}_m{}n{}", EightBitPlan::elem(format).suffix(), self.bm, self.bn),
        }
    }
    /// Blocks of a launch over `rows` output pixels and `k` channels. A tile per block: one per
    /// (pixel tile, channel tile, split). Pointwise: as many as fit on the GPU at once (2 per SM
    /// at most, fewer where shared memory is short), a multiple of the channel tiles so that each
    /// block keeps one channel tile's weights.
    fn blocks(self, rows: usize, k: usize, splits: usize, c: usize, sm_count: u32) -> usize {
        let tiles = rows.div_ceil(self.bm) * k.div_ceil(self.bn);
        if !self.pointwise() {
            return tiles * splits;
        }
        let per_sm = (228 * 1024 / (self.smem_bytes(c) as usize + 1024)).clamp(1, 2);
        let n_tiles = k.div_ceil(self.bn);
        (tiles.min(sm_count as usize * per_sm) / n_tiles).max(1) * n_tiles
    }
}

/// Every entry point the 8-bit conv layers launch from `kernels/conv8.cu` (the tile shapes of both
/// formats and split-K's finishing kernels), for the NVRTC test.
pub fn entry_points() -> Vec<String> {
    let formats = [QuantFormat::Int8, QuantFormat::Fp8E4m3];
    let tiles = formats.iter().flat_map(|&f| Variant::ALL.into_iter().chain(Variant::POINTWISE).map(move |v| v.entry(f)));
    tiles.chain(formats.map(finish_entry)).collect()
}

/// Split-K's second kernel for `format`.
fn finish_entry(format: QuantFormat) -> String {
    format!("conv8_finish_{}", EightBitPlan::elem(format).suffix())
}

/// Engine configurations of cuDNN's heuristics timed per 8-bit conv (its best-ranked ones).
const LIBRARY_CANDIDATES: usize = 4;

/// What the kernel's epilogue stores (`C8_*` in the kernel).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Store8 {
    None = 0,
    F16 = 1,
    Codes = 2,
}

/// What the 8-bit epilogue reads and stores besides the bias: the residual's codes and scale, the
/// output as f16 or as codes (`1/s_y` and the codes' range), and ReLU.
#[derive(Clone, Copy, Debug)]
struct Epilogue8 {
    z_store: Store8,
    z_scale: f32,
    y_store: Store8,
    inv_y_scale: f32,
    range: (f32, f32),
    relu: bool,
}

impl Epilogue8 {
    /// Codes out, and an 8-bit residual or none: what the persistent pointwise kernel takes, and
    /// where the wgmma kernel moves whole tiles of codes by TMA.
    fn codes_out(&self) -> bool {
        self.y_store == Store8::Codes && self.z_store != Store8::F16
    }
}

/// A conv of an 8-bit engine on 8-bit tensor cores: input (and residual) read as codes, output
/// written as f16 or requantised codes.
pub struct Conv8Layer {
    path: String,
    entry: String,
    variant: Variant,
    f: CudaFunction,
    x: ValueId,
    y: ValueId,
    z: Option<ValueId>,
    /// `[K][R][S][C]` codes.
    w: DeviceBuf,
    /// `s_x · s_w[k]` per output channel.
    alpha: DeviceBuf,
    bias: Option<DeviceBuf>,
    epilogue: Epilogue8,
    /// H, W, C, K, R, S, P, Q, stride, padding and dilation (h, w) as the kernel takes them.
    geo: [i32; 14],
    /// Output pixels per image (the GEMM's rows).
    rows_per_image: usize,
    /// Split-K: blocks sharing one tile's reduction (1: none), and the kernel that adds their
    /// partial sums (kept in the layer's workspace) and runs the epilogue.
    splits: usize,
    finish: Option<CudaFunction>,
    sm_count: u32,
}

/// Split-K factors tried for the 64-pixel tile where the reduction has at least twice as many
/// 64-byte k-blocks (a small batch's deep layers: one tile per block leaves most SMs idle).
const SPLITS: [usize; 2] = [4, 8];

/// The 8-bit kernel's candidates for conv `node` of the plan (one per tile shape, timed), the
/// wgmma kernel's on sm_90 (`hopper`), and cuDNN's fused engines on the same conv and epilogue;
/// the 8-bit stem for a conv carrying a pool.
pub fn candidates(ctx: &mut BuildCtx, node: NodeId, a: &ConvAttrs) -> Result<Vec<Box<dyn Layer>>> {
    let Some(format) = ctx.eight_bit.format else {
        return Err(ctx.err(node, LowerKind::Operands, format!("a {:?} engine has no 8-bit convs", ctx.config.precision)));
    };
    let (codes, w_scale) = weight_codes(ctx, node, format)?;
    if let Some(pool) = &a.pool {
        return stem_candidates(ctx, node, (a, pool), format, (&codes, &w_scale));
    }
    let problem = Conv8Problem::new(ctx, node, a, format, (&codes, &w_scale))?;
    ctx.kernels.add_source("conv8.cu", CONV8_CU)?;
    let mut out = kernel_candidates(ctx, node, &problem)?;
    out.extend(hopper::candidates(ctx, node, &problem)?);
    out.extend(library_candidates(ctx, &problem)?);
    Ok(out)
}

/// The activation quantiser `id` that conv `node` reads or writes as its `what`, or why it is not
/// one of the engine's.
fn quantiser<'a>(ctx: &BuildCtx<'a>, node: NodeId, id: NodeId, format: QuantFormat, what: &str) -> Result<&'a QuantParams> {
    activation_quantiser(ctx.graph, id, format)
        .ok_or_else(|| ctx.err(node, LowerKind::Weights, format!("its {what} is not an 8-bit activation quantiser")))
}

/// The 8-bit stem (`stem::eight_bit_candidates`) for a conv that carries its max-pool: it writes
/// the codes of the stored quantiser after it, quantising its input with the quantiser before.
fn stem_candidates(
    ctx: &mut BuildCtx,
    node: NodeId,
    (a, pool): (&ConvAttrs, &PoolAttrs),
    format: QuantFormat,
    weight: (&[f32], &[f32]),
) -> Result<Vec<Box<dyn Layer>>> {
    let (graph, n) = (ctx.graph, ctx.node(node));
    let Some(q) = ctx.eight_bit.requant[node] else {
        return Err(ctx.err(node, LowerKind::Weights, "the 8-bit stem writes codes, and no stored quantiser reads its output"));
    };
    let shapes: Vec<&[usize]> = n.inputs.iter().map(|&i| graph.nodes[i].shape.as_slice()).collect();
    let conv = super::conv2d_shape(&ConvAttrs { pool: None, ..*a }, &shapes).map_err(|e| ctx.err(node, LowerKind::Operands, e))?;
    let quantisers = (quantiser(ctx, node, n.inputs[0], format, "input")?, quantiser(ctx, node, q, format, "output")?);
    super::stem::eight_bit_candidates(ctx, node, (a, pool), [conv[2], conv[3]], quantisers, weight)
}

/// One 8-bit conv as its candidates take it: operands, the weight's codes and alphas, what the
/// epilogue reads and stores, and the geometry.
struct Conv8Problem {
    format: QuantFormat,
    path: String,
    x: ValueId,
    y: ValueId,
    z: Option<ValueId>,
    y_elem: Elem,
    /// `[K][R][S][C]` codes, as bytes.
    codes: Vec<u8>,
    /// `s_x · s_w[k]` per output channel.
    alpha: Vec<f32>,
    bias: Option<Vec<f32>>,
    epilogue: Epilogue8,
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
    /// C, H, W, K, R, S, P, Q (cuDNN's `FusedConv::dims`).
    dims: [usize; 8],
    /// The same as the kernel takes them (`Conv8Layer::geo`).
    geo: [i32; 14],
}

impl Conv8Problem {
    /// Checks conv `node`'s values (NHWC codes in, NHWC f16 or codes out, a residual of codes) and
    /// gathers what its layers need; `weight` is its codes `[K, C, R, S]` and scale per channel.
    fn new(ctx: &BuildCtx, node: NodeId, a: &ConvAttrs, format: QuantFormat, weight: (&[f32], &[f32])) -> Result<Self> {
        let (graph, n) = (ctx.graph, ctx.node(node));
        let sx = quantiser(ctx, node, n.inputs[0], format, "input")?.scale[0];
        let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
        let z = if a.residual { Some(ctx.input(node, n.inputs.len() - 1)?) } else { None };
        let w = ctx.weight(node, 1)?;
        let [k, c, r, s] = w.shape[..] else {
            return Err(ctx.err(node, LowerKind::Weights, format!("weight shape {:?} is not [K, C, R, S]", w.shape)));
        };
        let (dx, dy) = (ctx.value(x).clone(), ctx.value(y).clone());
        let elem = EightBitPlan::elem(format);
        let nhwc = |d: &ValueDesc| d.dims.len() == 3 && d.layout.same_bytes(Layout::channels_last(3), &d.dims);
        if dx.elem != elem || !nhwc(&dx) || !nhwc(&dy) || dx.dims[0] != c || dy.dims[0] != k {
            return Err(ctx.err(
                node,
                LowerKind::Unsupported,
                format!(
                    "the 8-bit conv reads {:?} {:?} {:?} and writes {:?} {:?}; it needs NHWC {elem:?} [{c}, H, W] in",
                    dx.elem, dx.dims, dx.layout, dy.elem, dy.dims
                ),
            ));
        }
        let codes = to_elem_bytes(&kcrs_to_krsc(weight.0, [k, c, r, s]), elem);
        let alpha: Vec<f32> = weight.1.iter().map(|sw| sx * sw).collect();
        let bias = if a.bias { Some(ctx.weight(node, 2)?.data.clone()) } else { None };
        let (z_store, z_scale) = residual_store(ctx, node, format, z, &dy.dims)?;
        let (y_store, inv_y_scale, range) = output_store(ctx, node, format, dy.elem)?;
        let shapes: Vec<&[usize]> = n.inputs.iter().map(|&i| graph.nodes[i].shape.as_slice()).collect();
        let out = super::conv2d_shape(a, &shapes).map_err(|e| ctx.err(node, LowerKind::Operands, e))?;
        let dims = [c, dx.dims[1], dx.dims[2], k, r, s, out[2], out[3]];
        let geo = kernel_geometry(ctx, node, a, dims)?;
        let relu = a.act == Activation::Relu;
        let epilogue = Epilogue8 { z_store, z_scale, y_store, inv_y_scale, range, relu };
        Ok(Self {
            format,
            path: n.path.clone(),
            x,
            y,
            z,
            y_elem: dy.elem,
            codes,
            alpha,
            bias,
            epilogue,
            stride: a.stride,
            padding: a.padding,
            dilation: a.dilation,
            dims,
            geo,
        })
    }

    /// Whether the persistent pointwise kernel applies: 1×1, stride 1, whole 32-byte k-steps,
    /// requantised output.
    fn pointwise(&self) -> bool {
        let [c, _, _, _, r, s, ..] = self.dims;
        [r, s] == [1, 1]
            && self.stride == [1, 1]
            && self.padding == [0, 0]
            && c.is_power_of_two()
            && (32..=PW_MAX_C).contains(&c)
            && self.epilogue.codes_out()
    }

    /// The kernel's layer of one tile shape (`splits` > 1: split-K, finished by `finish`), with its
    /// own copies of the codes, alphas and bias.
    fn layer(
        &self,
        ctx: &mut BuildCtx,
        (entry, variant, splits): (String, Variant, usize),
        f: CudaFunction,
        finish: Option<CudaFunction>,
    ) -> Result<Conv8Layer> {
        let w = ctx.upload_bytes(&self.codes)?;
        let alpha = ctx.upload_f32(&self.alpha)?;
        let bias = self.bias.as_deref().map(|b| ctx.upload_f32(b)).transpose()?;
        let [.., p, q] = self.dims;
        Ok(Conv8Layer {
            path: self.path.clone(),
            entry,
            variant,
            f,
            x: self.x,
            y: self.y,
            z: self.z,
            w,
            alpha,
            bias,
            epilogue: self.epilogue,
            geo: self.geo,
            rows_per_image: p * q,
            splits,
            finish,
            sm_count: ctx.kernels.sm_count(),
        })
    }

    /// The epilogue as cuDNN's pointwise steps over their constants: `· alpha[k]`, `+ bias[k]`,
    /// `+ s_z · z`, ReLU, and requantised output's `· 1/s_y` clamped to the codes' range (int8:
    /// `[qmin, qmax]`; e4m3: ±448, saturating).
    fn library_epilogue(&self) -> (Vec<Vec<f32>>, Vec<Step>) {
        let e = self.epilogue;
        let mut constants = vec![self.alpha.clone()];
        let mut steps = vec![Step::Mul(Operand::Channels(0))];
        if let Some(b) = &self.bias {
            constants.push(b.clone());
            steps.push(Step::Add(Operand::Channels(constants.len() - 1)));
        }
        if self.z.is_some() {
            constants.push(vec![e.z_scale]);
            steps.push(Step::Residual(Operand::Scalar(constants.len() - 1)));
        }
        if e.relu {
            steps.push(Step::Relu);
        }
        if e.y_store == Store8::Codes {
            let (lo, hi) = match self.format {
                QuantFormat::Int8 => e.range,
                QuantFormat::Fp8E4m3 => (-448.0, 448.0),
            };
            for (v, step) in [(e.inv_y_scale, Step::Mul as fn(Operand) -> Step), (lo, Step::Max), (hi, Step::Min)] {
                constants.push(vec![v]);
                steps.push(step(Operand::Scalar(constants.len() - 1)));
            }
        }
        (constants, steps)
    }
}

/// How conv `node` reads its residual `z`: as the codes of its quantiser, of the output's
/// `dims`, with that quantiser's scale; nothing without one.
fn residual_store(ctx: &BuildCtx, node: NodeId, format: QuantFormat, z: Option<ValueId>, dims: &[usize]) -> Result<(Store8, f32)> {
    let Some(zv) = z else { return Ok((Store8::None, 0.0)) };
    let elem = EightBitPlan::elem(format);
    if ctx.value(zv).elem != elem || ctx.value(zv).dims != dims {
        return Err(ctx.err(
            node,
            LowerKind::Operands,
            format!("its residual is {:?} {:?}, not {elem:?} {:?}", ctx.value(zv).elem, ctx.value(zv).dims, dims),
        ));
    }
    let n = ctx.node(node);
    Ok((Store8::Codes, quantiser(ctx, node, *n.inputs.last().expect("residual"), format, "residual")?.scale[0]))
}

/// What conv `node` writes as `y_elem`: the codes of the stored quantiser that reads it (its
/// `1/scale` and range), or f16.
fn output_store(ctx: &BuildCtx, node: NodeId, format: QuantFormat, y_elem: Elem) -> Result<(Store8, f32, (f32, f32))> {
    match (y_elem, ctx.eight_bit.requant[node]) {
        (e, Some(q)) if e == EightBitPlan::elem(format) => {
            let p = quantiser(ctx, node, q, format, "output")?;
            Ok((Store8::Codes, 1.0 / p.scale[0], (p.qmin as f32, p.qmax as f32)))
        }
        (Elem::F16, None) => Ok((Store8::F16, 0.0, (0.0, 0.0))),
        (e, _) => Err(ctx.err(node, LowerKind::Unsupported, format!("the 8-bit conv cannot write {e:?}"))),
    }
}

/// `dims` (C, H, W, K, R, S, P, Q) and `a`'s stride, padding and dilation as the kernel takes
/// them, each checked to fit its 32-bit arguments.
fn kernel_geometry(ctx: &BuildCtx, node: NodeId, a: &ConvAttrs, [c, h, wd, k, r, s, p, q]: [usize; 8]) -> Result<[i32; 14]> {
    let mut geo = [0i32; 14];
    let named = [
        ("H", h),
        ("W", wd),
        ("C", c),
        ("K", k),
        ("R", r),
        ("S", s),
        ("P", p),
        ("Q", q),
        ("stride", a.stride[0]),
        ("stride", a.stride[1]),
        ("padding", a.padding[0]),
        ("padding", a.padding[1]),
        ("dilation", a.dilation[0]),
        ("dilation", a.dilation[1]),
    ];
    for (g, (name, v)) in geo.iter_mut().zip(named) {
        *g = i32::try_from(v)
            .map_err(|_| ctx.err(node, LowerKind::TooLarge, format!("{name} = {v} exceeds the 8-bit kernel's 32-bit range")))?;
    }
    Ok(geo)
}

/// One layer per tile shape of the 8-bit kernel: the three tiles, split-K on the 64-pixel tile
/// where the reduction is deep enough, and the pointwise kernel where it applies.
fn kernel_candidates(ctx: &mut BuildCtx, node: NodeId, p: &Conv8Problem) -> Result<Vec<Box<dyn Layer>>> {
    let [c, _, _, _, r, s, ..] = p.dims;
    let kblocks = (c * r * s).div_ceil(BK);
    let finish_name = finish_entry(p.format);
    let shapes = Variant::ALL
        .into_iter()
        .map(|v| (v, 1))
        .chain(SPLITS.into_iter().filter(|&n| kblocks >= 2 * n).map(|n| (Variant { bm: 64, bn: 64, pw_stages: 0 }, n)))
        .chain(Variant::POINTWISE.into_iter().filter(|_| p.pointwise()).map(|v| (v, 1)));
    let mut out: Vec<Box<dyn Layer>> = Vec::new();
    for (variant, splits) in shapes {
        let entry = variant.entry(p.format);
        let finish = if splits > 1 { Some(ctx.kernels.get(&finish_name)?) } else { None };
        let f = ctx.kernels.get(&entry)?;
        // The limit belongs to the function, which every layer of this entry shares: the
        // pointwise kernel's depends on C, so it is set to its largest (where the GPU allows that
        // much; elsewhere the kernel is no candidate).
        let smem = if variant.pointwise() { variant.smem_bytes(PW_MAX_C) } else { variant.smem_bytes(c) };
        let limit = f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32);
        match limit {
            Err(_) if variant.pointwise() => continue,
            Err(e) => {
                return Err(ctx.err(node, LowerKind::Unsupported, format!("`{entry}` cannot have {smem} bytes of shared memory: {e:?}")))
            }
            Ok(()) => {}
        }
        out.push(Box::new(p.layer(ctx, (entry, variant, splits), f, finish)?));
    }
    Ok(out)
}

/// The same conv and epilogue on cuDNN's fused engines (its best-ranked configurations).
fn library_candidates(ctx: &mut BuildCtx, p: &Conv8Problem) -> Result<Vec<Box<dyn Layer>>> {
    let elem = EightBitPlan::elem(p.format);
    let (constants, steps) = p.library_epilogue();
    let fused = FusedConv {
        x: elem,
        y: p.y_elem,
        z: p.z.map(|_| elem),
        dims: p.dims,
        stride: p.stride,
        padding: p.padding,
        dilation: p.dilation,
        steps,
    };
    let (opt, max) = (ctx.config.opt_batch, ctx.config.max_batch);
    let prefix = format!("{LIBRARY_KIND}{}", elem.suffix());
    let mut out: Vec<Box<dyn Layer>> = Vec::new();
    for cfg in engine_configs(ctx.gpu.handles.cudnn, &fused, opt, LIBRARY_CANDIDATES)? {
        let w = ctx.upload_bytes(&p.codes)?;
        let consts = constants.iter().map(|c| ctx.upload_f32(c)).collect::<Result<Vec<_>>>()?;
        out.push(Box::new(FusedConvLayer::new(ctx.gpu, &p.path, &prefix, fused.clone(), cfg, (p.x, p.y, p.z), w, consts, (opt, max))));
    }
    Ok(out)
}

/// The codes of conv `node`'s weight on its 8-bit grid (`[K, C, R, S]`, as values: integers, or
/// values on the e4m3 grid) and its scale per output channel: value / scale rounded as its
/// quantiser rounds (a folded weight's values already lie on the grid).
fn weight_codes(ctx: &BuildCtx, node: NodeId, format: QuantFormat) -> Result<(Vec<f32>, Vec<f32>)> {
    let Op::Weight { quant: Some(wq), .. } = &ctx.graph.nodes[ctx.node(node).inputs[1]].op else {
        return Err(ctx.err(node, LowerKind::Weights, "its weight is not on an 8-bit grid"));
    };
    let w = ctx.weight(node, 1)?;
    let k = w
        .shape
        .first()
        .copied()
        .filter(|&k| k > 0)
        .ok_or_else(|| ctx.err(node, LowerKind::Weights, format!("weight shape {:?}", w.shape)))?;
    let w_scale = (0..k)
        .map(|kk| wq.scale.get(if wq.axis.is_some() { kk } else { 0 }).copied())
        .collect::<Option<Vec<f32>>>()
        .ok_or_else(|| ctx.err(node, LowerKind::Weights, format!("{} weight scales for {k} output channels", wq.scale.len())))?;
    let per_k = w.data.len() / k;
    if wq.format != format {
        return Err(ctx.err(
            node,
            LowerKind::Weights,
            format!("its weight is on the {} grid, the engine's codes are {}", wq.format.name(), format.name()),
        ));
    }
    let channel = |i: usize| if wq.axis.is_some() { i / per_k } else { 0 };
    let codes = w.data.iter().enumerate().map(|(i, &v)| wq.quantize_value(v, channel(i))).collect();
    Ok((codes, w_scale))
}

/// The arguments every 8-bit conv entry point takes (`CONV8_PARAMS`, kernels/conv8_epilogue.cuh),
/// in order: the pointers (input, weight codes, alpha, bias, residual, output; 0 for none), the
/// epilogue's scalars, the batch, the geometry, and split-K's workspace and splits (1: none).
fn kernel_args(pointers: [u64; 6], e: &Epilogue8, geo: &[i32; 14], batch: i32, (workspace, splits): (u64, usize)) -> Vec<KArg> {
    let mut args: Vec<KArg> = pointers.into_iter().map(KArg::Ptr).collect();
    args.extend([
        KArg::F32(e.z_scale),
        KArg::F32(e.inv_y_scale),
        KArg::F32(e.range.0),
        KArg::F32(e.range.1),
        KArg::I32(e.z_store as i32),
        KArg::I32(e.y_store as i32),
        KArg::I32(e.relu as i32),
        KArg::I32(batch),
    ]);
    args.extend(geo.map(KArg::I32));
    args.extend([KArg::Ptr(workspace), KArg::I32(splits as i32)]);
    args
}

impl Layer for Conv8Layer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        match self.splits {
            1 => format!("kernel:{}", self.entry),
            n => format!("kernel:{}:split{n}", self.entry),
        }
    }
    fn workspace_bytes(&self, batch: usize) -> usize {
        match self.splits {
            1 => 0,
            n => n * batch * self.rows_per_image * self.geo[3] as usize * 4,
        }
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        if batch == 0 {
            return Ok(());
        }
        // Output pixels index 32-bit in the kernel.
        let rows = batch.checked_mul(self.rows_per_image).filter(|&m| i32::try_from(m).is_ok()).ok_or_else(|| Error::Binding {
            name: self.path.clone(),
            reason: format!("batch {batch} exceeds the 8-bit conv's 32-bit range"),
        })?;
        let k = self.geo[3] as usize;
        // One block per (pixel tile, channel tile, split), splits then channel tiles fastest (the
        // kernel's order).
        let c = self.geo[2] as usize;
        let blocks = self.variant.blocks(rows, k, self.splits, c, self.sm_count);
        let blocks = u32::try_from(blocks).map_err(|_| Error::Binding {
            name: self.path.clone(),
            reason: format!("batch {batch} needs {blocks} blocks of the 8-bit conv"),
        })?;
        let grid = (blocks, 1, 1);
        if self.splits > 1 && rt.workspace_bytes < self.workspace_bytes(batch) {
            return Err(Error::Binding {
                name: self.path.clone(),
                reason: format!("split-K needs {} bytes of workspace, the run has {}", self.workspace_bytes(batch), rt.workspace_bytes),
            });
        }
        let ptr = |v: Option<ValueId>| v.map_or(0, |v| rt.ptr(v));
        let pointers =
            [rt.ptr(self.x), self.w.ptr(), self.alpha.ptr(), self.bias.as_ref().map_or(0, |b| b.ptr()), ptr(self.z), rt.ptr(self.y)];
        let args = kernel_args(pointers, &self.epilogue, &self.geo, batch as i32, (rt.workspace, self.splits));
        launch(rt, &self.f, grid, (self.variant.threads(), 1, 1), self.variant.smem_bytes(c), &args)?;
        match &self.finish {
            Some(f) => launch(rt, f, grid_for(rows * k / 16, self.sm_count), (BLOCK, 1, 1), 0, &args),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kernels/eight_bit.cuh's conversion-free int8 arithmetic (the pointwise conv's epilogue),
    /// step for step in f32 and u32, against the plain conversions and the CPU simulation's
    /// rounding: every code decodes exactly, every accumulator of up to 256 products converts
    /// exactly, and requantisation gives quantize_value's code, ties and saturation included.
    #[test]
    fn the_conversion_free_int8_arithmetic_is_exact() {
        const F_MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
        const I_MAGIC: i32 = 0x4B40_0000;
        // __byte_perm(x, y, s): byte n of the result is byte s's nibble n of (y:x).
        let byte_perm = |x: u32, y: u32, s: u32| -> u32 {
            let bytes = (u64::from(y) << 32) | u64::from(x);
            (0..4).map(|n| ((bytes >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n)).sum::<u64>() as u32
        };
        let small_int_to_float = |x: i32| f32::from_bits((x + I_MAGIC) as u32) - F_MAGIC;
        let code_value = |flipped: u32, b: u32| f32::from_bits(byte_perm(flipped, 0x4B00_0000, 0x7540 + b)) - 8_388_736.0;
        let code_bits = |v: f32, inv_s: f32, lo: f32, hi: f32| ((v * inv_s) + F_MAGIC).max(lo + F_MAGIC).min(hi + F_MAGIC).to_bits();
        let pack2 = |a: u32, b: u32| byte_perm(a, b, 0x0040) & 0xffff;

        for code in -128i32..=127 {
            let word = (code as u8 as u32) * 0x0101_0101;
            for b in 0..4 {
                assert_eq!(code_value(word ^ 0x8080_8080, b), code as f32, "code {code}, byte {b}");
            }
        }
        let bound = 256 * 128 * 128;
        for x in (-bound..=bound).step_by(997).chain([-bound, -1, 0, 1, bound]) {
            assert_eq!(small_int_to_float(x), x as f32, "accumulator {x}");
        }
        let seed = crate::seeded::run_seed();
        let mut values: Vec<f32> = (0..20_000).map(|i| (300.0 * (crate::seeded::uniform(seed, i) - 0.5)) as f32).collect();
        // Ties, both saturations, huge values and signed zeros.
        values.extend([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -127.5, -128.5, 1e9, -1e9, 0.0, -0.0]);
        for (qmin, qmax) in [(-128, 127), (0, 127), (-127, 127)] {
            // The engine passes the kernel 1/scale, as the simulation computes it.
            for scale in [1.0f32, 2.7] {
                let q = QuantParams { qmin, qmax, ..QuantParams::int8(scale) };
                for &v in &values {
                    let got = code_bits(v, 1.0 / scale, qmin as f32, qmax as f32) as u8 as i8;
                    assert_eq!(f32::from(got), q.quantize_value(v, 0), "value {v} / {scale} in [{qmin}, {qmax}]");
                }
            }
        }
        assert_eq!(pack2(code_bits(-3.0, 1.0, -128.0, 127.0), code_bits(5.0, 1.0, -128.0, 127.0)), 0x05FD);
    }

    #[test]
    fn shared_memory_matches_the_kernel() {
        // kernels/conv8.cu: C8_STAGES × (A tile BM × 64 bytes + B tile BN × 64 bytes), or the
        // epilogue's BM × (BN + 4) floats.
        assert_eq!(Variant::ALL.map(|v| v.smem_bytes(64)), [36_864, 67_584, 24_576]);
        // Pointwise (kernels/conv8.cu `conv8_pw`): 2·128 floats, 128 weight rows of C + 16 bytes,
        // 2 or 3 stages of 128 input rows (C + 16) and 128 residual rows (128 + 16).
        let [pw2, pw3] = Variant::POINTWISE;
        assert_eq!(pw3.smem_bytes(64), 1024 + 128 * 80 + 3 * 128 * (80 + 144));
        assert_eq!(pw2.smem_bytes(128), 1024 + 128 * 144 + 2 * 128 * (144 + 144));
        // Two blocks per SM at C = 64 (3 stages) and C = 128 (2 stages), one at C = 256, within an
        // SM's 228 KiB.
        assert!(2 * (pw3.smem_bytes(64) + 1024) <= 228 * 1024);
        assert!(2 * (pw2.smem_bytes(128) + 1024) <= 228 * 1024);
        assert!(pw3.smem_bytes(PW_MAX_C) + 1024 <= 228 * 1024);
        assert_eq!([pw2, pw3].map(|v| v.entry(QuantFormat::Fp8E4m3)), ["conv8_e4m3_pw2", "conv8_e4m3_pw3"]);
        // Persistent grid: a multiple of the channel tiles, at most 2 per SM, at most the tiles.
        assert_eq!(pw3.blocks(802_816, 256, 1, 64, 132), 264);
        assert_eq!(pw3.blocks(50_176, 1024, 1, 256, 132), 128);
        assert_eq!(pw3.blocks(100, 256, 1, 64, 132), 2);
        assert_eq!(Variant::ALL[0].blocks(1000, 256, 2, 64, 132), 8 * 4 * 2);
        assert_eq!(Variant::ALL.map(|v| v.threads()), [128, 256, 128]);
        assert_eq!(Variant::ALL.map(|v| v.entry(QuantFormat::Int8)), ["conv8_i8_m128n64", "conv8_i8_m128n128", "conv8_i8_m64n64"]);
    }
}
