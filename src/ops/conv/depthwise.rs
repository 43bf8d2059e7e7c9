//! Kiln's depthwise convolution kernels (`kernels/depthwise.cu`): tactic candidates beside
//! cuDNN's for `groups == channels` convolutions. The simple kernel (a thread per output pixel and
//! 16-byte pack), the register-tiled one (`dw_tile_*`: a thread per 1x8 or 2x8 output tile and
//! 8-byte pack, each input row loaded once per tile) and the shared-memory one (`dw_smem_*`: a
//! block per 8x16 output tile and 32 channels, its input staged once in shared memory) are timed
//! against each other and cuDNN.

use super::{Activation, ConvAttrs};
use crate::engine::launch::{grid_for, launch, nhwc, pack, same_elem, to_i32, CudaFunction, KArg, BLOCK};
use crate::engine::layer::{DeviceBuf, Layer, RunCtx, ValueId};
use crate::graph::NodeId;
use crate::ops::BuildCtx;
use crate::LowerKind;
use crate::{Error, Result};

/// A depthwise K x K convolution of NHWC images (`kernels/depthwise.cu`), bias, residual and ReLU
/// fused: a tactic candidate beside cuDNN's for `groups == channels` convolutions.
pub struct DepthwiseLayer {
    path: String,
    kind: String,
    f: CudaFunction,
    x: ValueId,
    residual: Option<ValueId>,
    y: ValueId,
    w: DeviceBuf,
    bias: Option<DeviceBuf>,
    /// H, W, C, OH, OW, sh, sw, ph, pw, relu
    dims: [i32; 10],
    vec: usize,
    kernel: Kernel,
    sm_count: u32,
}

/// Which of `kernels/depthwise.cu`'s kernels a [`DepthwiseLayer`] launches.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kernel {
    /// `depthwise_k*`: a thread per output pixel and `vec` channels.
    Simple,
    /// `dw_tile_*`: a thread per `rows x cols` output pixels and `vec` channels.
    Tiled { rows: usize, cols: usize },
    /// `dw_smem_*`: a block per [`SMEM_TILE`] output pixels and [`SMEM_CHANNELS`] channels.
    Shared,
}

/// The output rows and columns of a `dw_smem_*` block's tile (`DWS_TH`, `DWS_TW` in the kernel).
const SMEM_TILE: (usize, usize) = (8, 16);
/// The channels of a `dw_smem_*` block (`DWS_CB`), one a lane.
const SMEM_CHANNELS: usize = 32;

impl Layer for DepthwiseLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.kind.clone()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let n = i32::try_from(batch).map_err(|_| Error::Binding {
            name: self.path.clone(),
            reason: format!("batch {batch} exceeds the depthwise kernel's range"),
        })?;
        let mut args = vec![
            KArg::Ptr(rt.ptr(self.x)),
            KArg::Ptr(self.w.ptr()),
            KArg::Ptr(self.bias.as_ref().map_or(0, DeviceBuf::ptr)),
            KArg::Ptr(self.residual.map_or(0, |r| rt.ptr(r))),
            KArg::Ptr(rt.ptr(self.y)),
            KArg::I32(n),
        ];
        let [h, w, c, oh, ow, _sh, _sw, ph, pw, relu] = self.dims;
        let (c, oh, ow) = (c as usize, oh as usize, ow as usize);
        // The tiled kernels' stride is in their entry point's name.
        let tiled_args = [h, w, c as i32, oh as i32, ow as i32, ph, pw, relu].map(KArg::I32);
        let work = match self.kernel {
            Kernel::Simple => {
                args.extend(self.dims.map(KArg::I32));
                args.push(KArg::I32((self.vec > 1) as i32));
                batch * oh * ow * c / self.vec
            }
            Kernel::Tiled { rows, cols } => {
                args.extend(tiled_args);
                batch * oh.div_ceil(rows) * ow.div_ceil(cols) * (c / self.vec)
            }
            Kernel::Shared => {
                args.extend(tiled_args);
                // One block of BLOCK threads a tile; the grid is capped and the blocks stride.
                let tiles = batch * oh.div_ceil(SMEM_TILE.0) * ow.div_ceil(SMEM_TILE.1) * (c / SMEM_CHANNELS);
                tiles * BLOCK as usize
            }
        };
        launch(rt, &self.f, grid_for(work, self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

/// The [`DepthwiseLayer`] candidates for a Conv2d node, none where they do not apply: not
/// transposed, `groups == Cin == Cout`, a square 3x3, 5x5 or 7x7 kernel, dilation 1, stride 1 or
/// 2. The simple kernel always; the tiled kernel in 1- and 2-row tiles where C is a multiple of
/// its 8-byte pack; the shared-memory kernel at stride 1 where C is a multiple of 32. Inputs as the conv converter reads them: x, weight `[C, 1, K, K]`, bias?,
/// residual?.
pub fn candidate(ctx: &mut BuildCtx, node: NodeId, a: &ConvAttrs, y: ValueId) -> Result<Vec<Box<dyn Layer>>> {
    let w = ctx.weight(node, 1)?;
    let k = match w.shape[..] {
        [_, 1, k, k2] if k == k2 && matches!(k, 3 | 5 | 7) => k,
        _ => return Ok(Vec::new()),
    };
    let c = w.shape[0];
    let fits = !a.transposed && a.groups == c && a.dilation == [1, 1] && a.stride.iter().all(|s| (1..=2).contains(s));
    if !fits {
        return Ok(Vec::new());
    }
    let x = ctx.input(node, 0)?;
    let residual = if a.residual { Some(ctx.input(node, if a.bias { 3 } else { 2 })?) } else { None };
    let mut vals = vec![x, y];
    vals.extend(residual);
    let elem = same_elem(ctx, &vals)?;
    let (cx, h, wd) = nhwc(ctx, x)?;
    let (cy, oh, ow) = nhwc(ctx, y)?;
    if cx != c || cy != c {
        return Ok(Vec::new());
    }
    // [C, 1, K, K] -> [K*K, C]: tap-major, channels innermost.
    let taps = k * k;
    let mut wt = vec![0f32; taps * c];
    for ch in 0..c {
        for t in 0..taps {
            wt[t * c + ch] = w.data[ch * taps + t];
        }
    }
    let bias = if a.bias { Some(ctx.weight(node, 2)?.data.clone()) } else { None };
    if bias.as_ref().is_some_and(|b| b.len() != c) {
        return Err(ctx.err(node, LowerKind::Weights, format!("bias has {} values for {c} channels", bias.as_ref().map_or(0, Vec::len))));
    }
    let relu = a.act == Activation::Relu;
    let mut dims = [0i32; 10];
    let named = [("H", h), ("W", wd), ("C", c), ("OH", oh), ("OW", ow), ("stride", a.stride[0]), ("stride", a.stride[1])];
    for (d, (name, v)) in
        dims.iter_mut().zip(named.into_iter().chain([("padding", a.padding[0]), ("padding", a.padding[1]), ("relu", relu as usize)]))
    {
        *d = to_i32(ctx, name, v)?;
    }
    let path = ctx.node(node).path.clone();
    let sm_count = ctx.kernels.sm_count();
    // The simple kernel: 16-byte packs where C allows, else one channel a thread.
    let mut variants =
        vec![(format!("depthwise_k{k}_{}", elem.suffix()), if c % pack(elem) == 0 { pack(elem) } else { 1 }, Kernel::Simple)];
    // The tiled kernel: 8-byte packs, 8 output columns a thread at stride 1, 4 at stride 2.
    let (v8, s) = (8 / elem.size(), a.stride[0]);
    if c % v8 == 0 && a.stride[0] == a.stride[1] {
        let tw = if s == 1 { 8 } else { 4 };
        variants.extend([1, 2].map(|th| (format!("dw_tile_k{k}_s{s}_h{th}_{}", elem.suffix()), v8, Kernel::Tiled { rows: th, cols: tw })));
    }
    if c % SMEM_CHANNELS == 0 && a.stride == [1, 1] {
        variants.push((format!("dw_smem_k{k}_{}", elem.suffix()), 1, Kernel::Shared));
    }
    let mut out: Vec<Box<dyn Layer>> = Vec::new();
    for (entry, vec, kernel) in variants {
        // Uploads of the same bytes share one buffer (the engine's weight store).
        let w = ctx.upload_f32(&wt)?;
        let bias = bias.as_ref().map(|b| ctx.upload_f32(b)).transpose()?;
        let f = ctx.kernels.get(&entry)?;
        let kind = format!("kernel:{entry}");
        out.push(Box::new(DepthwiseLayer { path: path.clone(), kind, f, x, residual, y, w, bias, dims, vec, kernel, sm_count }));
    }
    Ok(out)
}

/// The depthwise kernels' entry points (`kernels/depthwise.cu`), for the list every family's
/// kernels are compiled and checked from.
pub(crate) fn entry_points() -> Vec<String> {
    let tiled: Vec<String> =
        [3, 5, 7].iter().flat_map(|k| [1, 2].iter().flat_map(move |s| [1, 2].map(|h| format!("dw_tile_k{k}_s{s}_h{h}")))).collect();
    let mut stems = vec!["depthwise_k3", "depthwise_k5", "depthwise_k7", "dw_smem_k3", "dw_smem_k5", "dw_smem_k7"];
    stems.extend(tiled.iter().map(String::as_str));
    crate::engine::launch::typed_entry_points(&stems)
}
