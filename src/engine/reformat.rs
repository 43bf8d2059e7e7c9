//! Layout and precision reformats: the casts, the tiled NCHW <-> NHWC transposes and the general
//! permute the builder inserts between a value and a reader that wants it in another layout or
//! element type (and at the engine's input and output bindings). `kernels/reformat.cu` and
//! `kernels/permute.cu`.

use super::launch::{grid_for, launch, Arg, CudaFunction, KArg, KernelLayer, BLOCK};
use super::layer::{Layer, LayerCtx, Layout, RunCtx, ValueDesc, ValueId};
use super::strided::{CopyDim, CopyKind, StridedCopy, StridedLayer};
use crate::LowerKind;
use crate::{Error, Result};

/// A batched `[C, HW]` <-> `[HW, cs]` transpose with a precision change, or a plain cast.
pub struct ReformatLayer {
    path: String,
    kind: String,
    f: CudaFunction,
    src: ValueId,
    dst: ValueId,
    /// `Some((C, HW, cs))` for a transpose; `None` for a cast of `per_image` elements.
    transpose: Option<(i32, i32, i32)>,
    /// The transpose has at most `SMALL_CHANNELS` channels on its NHWC side: one thread per
    /// pixel (`*_small` entry points) instead of mostly idle 32×32 tiles.
    small: bool,
    per_image: usize,
    sm_count: u32,
}

impl Layer for ReformatLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.kind.clone()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let (src, dst) = (KArg::Ptr(rt.ptr(self.src)), KArg::Ptr(rt.ptr(self.dst)));
        match self.transpose {
            Some((c, hw, cs)) if self.small => {
                let pixels = batch * hw as usize;
                let args = [src, dst, KArg::I32(c), KArg::I64(hw as i64), KArg::I32(cs), KArg::I64(pixels as i64)];
                launch(rt, &self.f, grid_for(pixels, self.sm_count), (BLOCK, 1, 1), 0, &args)
            }
            Some((c, hw, cs)) => {
                let batch = u32::try_from(batch).ok().filter(|&b| b <= 65535).ok_or_else(|| Error::Binding {
                    name: self.path.clone(),
                    reason: format!("batch {batch} exceeds the reformat kernel's grid limit of 65535"),
                })?;
                let grid = ((hw as u32).div_ceil(32), (c.max(cs) as u32).div_ceil(32), batch);
                launch(rt, &self.f, grid, (32, 8, 1), 0, &[src, dst, KArg::I32(c), KArg::I32(hw), KArg::I32(cs)])
            }
            None => {
                let n = batch * self.per_image;
                launch(rt, &self.f, grid_for(n, self.sm_count), (BLOCK, 1, 1), 0, &[src, dst, KArg::I64(n as i64)])
            }
        }
    }
}

/// Channel counts (NHWC side) up to which reformats run one thread per pixel (`SMALL_C` in
/// kernels/reformat.cu).
const SMALL_CHANNELS: usize = 8;

/// The general reformat: copies `src` into `dst`'s memory order and element type (`permute_*`,
/// one thread an element). `src_strides` are the source's element strides of each logical dim
/// (the dims of `dst`), and `batch_stride` is the source's per-image size.
pub fn permute_layer(
    ctx: &mut LayerCtx,
    path: &str,
    src: ValueId,
    src_strides: &[usize],
    batch_stride: usize,
    dst: ValueId,
) -> Result<Box<dyn Layer>> {
    let d = ctx.value(dst).clone();
    let s_elem = ctx.value(src).elem;
    let order = d.layout.order();
    let mut meta: Vec<i64> = order.iter().map(|&k| d.dims[k] as i64).collect();
    meta.extend(order.iter().map(|&k| src_strides[k] as i64));
    meta.push(batch_stride as i64);
    let bytes: Vec<u8> = meta.iter().flat_map(|v| v.to_le_bytes()).collect();
    let meta = ctx.upload_bytes(&bytes)?;
    let entry = format!("permute_{}_{}", s_elem.suffix(), d.elem.suffix());
    let per_image = d.per_image_elems();
    let args = vec![Arg::Value(src), Arg::Value(dst), Arg::PerBatch(per_image), Arg::buf(meta), Arg::Const(KArg::I32(order.len() as i32))];
    Ok(Box::new(KernelLayer::at(ctx, path, &entry, args, per_image)?))
}

/// A layer converting `src` to `dst` (the same logical dims, or `dst` with zero-padded channels
/// at the engine's input), deciding from their descriptions: a precision cast where the layouts
/// are the same bytes; the tiled NCHW <-> NHWC transposes for images; the general permute otherwise.
pub fn reformat_layer(ctx: &mut LayerCtx, src: ValueId, dst: ValueId, path: &str) -> Result<Box<dyn Layer>> {
    let (s, d) = (ctx.value(src).clone(), ctx.value(dst).clone());
    let fail = |why: String| Error::Lower {
        path: path.to_string(),
        op: "reformat".into(),
        kind: LowerKind::Unsupported,
        reason: format!("cannot reformat `{}` to `{}`: {why}", s.name, d.name),
    };
    let pair = format!("{}_{}", s.elem.suffix(), d.elem.suffix());
    if s.dims == d.dims && s.layout.same_bytes(d.layout, &s.dims) {
        let f = ctx.kernels.get(&format!("cast_{pair}"))?;
        return Ok(Box::new(ReformatLayer {
            path: path.to_string(),
            kind: format!("kernel:cast_{pair}"),
            f,
            src,
            dst,
            transpose: None,
            small: false,
            per_image: d.per_image_elems(),
            sm_count: ctx.kernels.sm_count(),
        }));
    }
    let image = |v: &ValueDesc| v.dims.len() == 3;
    let (nchw, nhwc) = (Layout::contiguous(3), Layout::channels_last(3));
    let tiled = image(&s) && image(&d) && s.dims[1..] == d.dims[1..];
    let (name, c, cs) = match (s.layout, d.layout) {
        (a, b) if tiled && a == nchw && b == nhwc && d.dims[0] >= s.dims[0] => ("nchw_to_nhwc", s.dims[0], d.dims[0]),
        (a, b) if tiled && a == nhwc && b == nchw && s.dims[0] >= d.dims[0] => ("nhwc_to_nchw", d.dims[0], s.dims[0]),
        _ if s.dims == d.dims => {
            let strides = s.layout.strides(&s.dims);
            if s.elem == d.elem {
                // The shape kernels' planned gather: merged dims, 16-byte units where it can.
                let dims: Vec<CopyDim> = d.layout.order().iter().map(|&k| CopyDim::plain(d.dims[k], strides[k])).collect();
                let copy = StridedCopy::new(ctx, path, "reformat", CopyKind::Gather { fill: 0.0 }, src, dst, &dims, 0)?;
                return Ok(Box::new(StridedLayer::new(ctx, path, "reformat", vec![copy])));
            }
            return permute_layer(ctx, path, src, &strides, s.per_image_elems(), dst);
        }
        _ => return Err(fail(format!("no reformat from {:?} {:?} to {:?} {:?}", s.layout, s.dims, d.layout, d.dims))),
    };
    let hw = s.dims[1] * s.dims[2];
    let int = |v: usize| i32::try_from(v).map_err(|_| fail(format!("{v} exceeds the kernels' 32-bit range")));
    let small = cs <= SMALL_CHANNELS;
    let entry = format!("{name}{}_{pair}", if small { "_small" } else { "" });
    let f = ctx.kernels.get(&entry)?;
    Ok(Box::new(ReformatLayer {
        path: path.to_string(),
        kind: format!("kernel:{entry}"),
        f,
        src,
        dst,
        transpose: Some((int(c)?, int(hw)?, int(cs)?)),
        small,
        per_image: d.per_image_elems(),
        sm_count: ctx.kernels.sm_count(),
    }))
}

/// Every entry point the reformats launch: between the 32- and 16-bit types both ways, and from
/// a u8 input binding into the engine's type.
pub fn entry_points() -> Vec<String> {
    let mut names = Vec::new();
    for t in ["f32", "f16"] {
        for u in ["f32", "f16"] {
            for k in ["nchw_to_nhwc", "nhwc_to_nchw", "nchw_to_nhwc_small", "nhwc_to_nchw_small", "cast", "permute"] {
                names.push(format!("{k}_{t}_{u}"));
            }
        }
        for k in ["nchw_to_nhwc", "nchw_to_nhwc_small", "cast", "permute"] {
            names.push(format!("{k}_u8_{t}"));
        }
    }
    names
}
