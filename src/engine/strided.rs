//! Strided copies on `kernels/shape.cu`: the gathers of slice, pad and permute (and of the
//! general reformat), the scatters of cat, and roll.
//!
//! A copy is planned once, at build: dims that stay contiguous on both sides are merged (Swin's
//! rank-6 window partition is a rank-3 copy), and where the innermost dim is contiguous on both
//! sides and every offset is a multiple of 16 bytes, the kernel moves 16-byte units instead of
//! elements. Index arithmetic inside an image is 32-bit, so an image's elements must fit in u32
//! (a typed error otherwise). The launch covers images on the grid's y axis.

use super::launch::{launch, KArg, BLOCK};
use super::layer::{DeviceBuf, Elem, Layer, LayerCtx, RunCtx, ValueId};
use crate::LowerKind;
use crate::{Error, Result};
use cudarc::driver::CudaFunction;

/// One dim of a copy, on the side walked linearly (in its physical order): its size, the other
/// side's stride, and for gathers the padding before and the source's size along it (outside
/// `before .. before + bound` the gather writes its fill value).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyDim {
    pub size: usize,
    pub stride: usize,
    pub before: usize,
    pub bound: usize,
}

impl CopyDim {
    /// A dim with no padding.
    pub fn plain(size: usize, stride: usize) -> Self {
        Self { size, stride, before: 0, bound: size }
    }
    /// A gather's dim: `bound` is clamped to what the walked side reaches, so a slice (no
    /// padding, a larger source) is a plain dim.
    pub fn gather(size: usize, stride: usize, before: usize, bound: usize) -> Self {
        Self { size, stride, before, bound: bound.min(size.saturating_sub(before)) }
    }
    fn padded(&self) -> bool {
        self.before != 0 || self.bound != self.size
    }
}

/// What a copy does with its dims.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CopyKind {
    /// The walked side is the destination; strides are the source's; outside the source, `fill`.
    Gather { fill: f32 },
    /// The walked side is the source; strides are the destination's.
    Scatter,
}

/// A planned copy: dims merged and, where possible, counted in 16-byte units.
#[derive(Clone, Debug, PartialEq)]
pub struct CopyPlan {
    pub dims: Vec<CopyDim>,
    /// Offset into the strided side, in units.
    pub offset: usize,
    /// The strided side's units per image.
    pub strided_per_image: usize,
    /// Elements per unit: 1, or 16 bytes' worth.
    pub unit: usize,
}

impl CopyPlan {
    /// Plans a copy of `dims` (outermost first) for elements of `elem_size` bytes.
    pub fn new(dims: &[CopyDim], offset: usize, strided_per_image: usize, elem_size: usize) -> Self {
        let mut merged: Vec<CopyDim> = Vec::with_capacity(dims.len());
        for &d in dims.iter().filter(|d| d.size != 1 || d.padded()) {
            match merged.last_mut() {
                // The outer dim steps exactly over the inner one on the strided side too.
                Some(o) if !o.padded() && !d.padded() && o.stride == d.stride * d.size => *o = CopyDim::plain(o.size * d.size, d.stride),
                _ => merged.push(d),
            }
        }
        if merged.is_empty() {
            merged.push(CopyDim::plain(1, 1));
        }
        let mut plan = Self { dims: merged, offset, strided_per_image, unit: 1 };
        let v = 16 / elem_size.max(1);
        let last = *plan.dims.last().expect("at least one dim");
        let others_aligned = plan.dims[..plan.dims.len() - 1].iter().all(|d| d.stride.is_multiple_of(v));
        if v > 1
            && last.stride == 1
            && !last.padded()
            && last.size.is_multiple_of(v)
            && others_aligned
            && offset.is_multiple_of(v)
            && strided_per_image.is_multiple_of(v)
        {
            let n = plan.dims.len();
            for (i, d) in plan.dims.iter_mut().enumerate() {
                if i + 1 == n {
                    *d = CopyDim::plain(d.size / v, 1);
                } else {
                    d.stride /= v;
                }
            }
            plan.offset /= v;
            plan.strided_per_image /= v;
            plan.unit = v;
        }
        plan
    }

    /// Units per image on the walked side.
    pub fn walked_per_image(&self) -> usize {
        self.dims.iter().map(|d| d.size).product()
    }

    /// The kernel's meta: sizes, strides (and for gathers padding and bounds), offset, the
    /// strided side's units per image.
    fn meta(&self, kind: CopyKind) -> Vec<usize> {
        let mut m: Vec<usize> = self.dims.iter().map(|d| d.size).collect();
        m.extend(self.dims.iter().map(|d| d.stride));
        if let CopyKind::Gather { .. } = kind {
            m.extend(self.dims.iter().map(|d| d.before));
            m.extend(self.dims.iter().map(|d| d.bound));
        }
        m.push(self.offset);
        m.push(self.strided_per_image);
        m
    }
}

/// What a planned copy launches: the kernel family (`shape_gather`, ...), the unit (elements per
/// 16-byte unit, or 1), the merged rank, the units walked per image, the meta, the fill value.
struct Launch {
    name: &'static str,
    unit: usize,
    rank: usize,
    walked: usize,
    meta: Vec<usize>,
    fill: Option<f32>,
}

/// Dims per copy after merging (`SHAPE_MAX_RANK` in kernels/shape.cu).
const MAX_COPY_RANK: usize = 8;

/// One launch of a `kernels/shape.cu` entry point.
pub struct StridedCopy {
    x: ValueId,
    y: ValueId,
    f: CudaFunction,
    entry: String,
    meta: DeviceBuf,
    rank: i32,
    /// Units per image on the walked side (the kernel's `n`).
    walked: u32,
    /// Bytes per image of x and y (the launch offsets images past 65,535, the grid's y limit).
    x_image_bytes: u64,
    y_image_bytes: u64,
    fill: Option<f32>,
}

/// The shape family's entry point for `kind` (`shape_gather_f16`, `shape_scatter_v16`, ...).
fn entry(kind: &str, elem: Elem, unit: usize) -> String {
    match (kind, unit) {
        ("shape_gather", 1) => format!("shape_gather_{}", elem.suffix()),
        ("shape_gather", _) => format!("shape_gather_v16_{}", elem.suffix()),
        (k, 1) => format!("{k}_{}", elem.suffix()),
        (k, _) => format!("{k}_v16"),
    }
}

/// Every entry point the strided copies launch (kernels/shape.cu): each kind, per element type,
/// by element and by 16-byte unit.
pub fn entry_points() -> Vec<String> {
    let mut names = Vec::new();
    for kind in ["shape_gather", "shape_scatter", "shape_roll"] {
        for elem in [Elem::F32, Elem::F16] {
            names.extend([1, 16 / elem.size()].map(|unit| entry(kind, elem, unit)));
        }
    }
    names.sort();
    names.dedup();
    names
}

/// Checks that every meta value and the walked units fit the kernels' 32-bit arithmetic.
fn check_u32(path: &str, op: &str, values: &[usize]) -> Result<()> {
    match values.iter().find(|&&v| u32::try_from(v).is_err()) {
        None => Ok(()),
        Some(v) => Err(Error::Lower {
            path: path.to_string(),
            op: op.to_string(),
            kind: LowerKind::TooLarge,
            reason: format!("a copy of {v} elements per image exceeds the shape kernels' 32-bit index range"),
        }),
    }
}

impl StridedCopy {
    /// A gather into all of `y` or a scatter of all of `x`, planned from `dims` (the walked side's
    /// dims in its physical order, with the other side's strides).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: &mut LayerCtx,
        path: &str,
        op: &str,
        kind: CopyKind,
        x: ValueId,
        y: ValueId,
        dims: &[CopyDim],
        offset: usize,
    ) -> Result<Self> {
        let (dx, dy) = (ctx.value(x).clone(), ctx.value(y).clone());
        if dx.elem != dy.elem {
            return Err(Error::Lower {
                path: path.into(),
                op: op.into(),
                kind: LowerKind::Operands,
                reason: format!("mixes element types {:?} and {:?}", dx.elem, dy.elem),
            });
        }
        let strided_per_image = match kind {
            CopyKind::Gather { .. } => dx.per_image_elems(),
            CopyKind::Scatter => dy.per_image_elems(),
        };
        let plan = CopyPlan::new(dims, offset, strided_per_image, dx.elem.size());
        let (name, fill) = match kind {
            CopyKind::Gather { fill } => ("shape_gather", Some(fill)),
            CopyKind::Scatter => ("shape_scatter", None),
        };
        let launch = Launch { name, unit: plan.unit, rank: plan.dims.len(), walked: plan.walked_per_image(), meta: plan.meta(kind), fill };
        Self::finish(ctx, path, op, x, y, launch)
    }

    /// `torch.roll` of `x` into `y` (one layout): `dims` sizes and shifts in physical order.
    pub fn roll(ctx: &mut LayerCtx, path: &str, x: ValueId, y: ValueId, sizes: &[usize], shifts: &[usize]) -> Result<Self> {
        let d = ctx.value(y).clone();
        // Unshifted inner dims move as one; 16-byte units where that run allows.
        let mut sizes = sizes.to_vec();
        let mut shifts = shifts.to_vec();
        while sizes.len() >= 2 && shifts[sizes.len() - 1] == 0 && shifts[sizes.len() - 2] == 0 {
            let inner = sizes.pop().expect("two dims");
            shifts.pop();
            *sizes.last_mut().expect("one dim") *= inner;
        }
        let v = 16 / d.elem.size();
        let unit = match (sizes.last(), shifts.last()) {
            (Some(&s), Some(&0)) if s.is_multiple_of(v) => {
                *sizes.last_mut().expect("one dim") /= v;
                v
            }
            _ => 1,
        };
        let launch = Launch {
            name: "shape_roll",
            unit,
            rank: sizes.len(),
            walked: sizes.iter().product(),
            meta: [&sizes[..], &shifts[..]].concat(),
            fill: None,
        };
        Self::finish(ctx, path, "roll", x, y, launch)
    }

    /// The checks and the upload every copy ends with: its dims fit the kernels' meta, every
    /// size and offset fits their 32-bit arithmetic, and the entry point exists.
    fn finish(ctx: &mut LayerCtx, path: &str, op: &str, x: ValueId, y: ValueId, launch: Launch) -> Result<Self> {
        let (dx, dy) = (ctx.value(x).clone(), ctx.value(y).clone());
        if launch.rank > MAX_COPY_RANK {
            let reason = format!("a copy of {} dims exceeds the shape kernels' {MAX_COPY_RANK}", launch.rank);
            return Err(Error::Lower { path: path.into(), op: op.into(), kind: LowerKind::TooLarge, reason });
        }
        check_u32(path, op, &[&launch.meta[..], &[launch.walked, dx.per_image_elems(), dy.per_image_elems()]].concat())?;
        let entry = entry(launch.name, dx.elem, launch.unit);
        let f = ctx.kernels.get(&entry)?;
        let bytes: Vec<u8> = launch.meta.iter().flat_map(|&v| (v as i64).to_le_bytes()).collect();
        Ok(Self {
            x,
            y,
            f,
            entry,
            meta: ctx.upload_bytes(&bytes)?,
            rank: launch.rank as i32,
            walked: launch.walked as u32,
            x_image_bytes: dx.bytes(1) as u64,
            y_image_bytes: dy.bytes(1) as u64,
            fill: launch.fill,
        })
    }

    fn enqueue(&self, rt: &RunCtx, batch: usize, sm_count: u32) -> Result<()> {
        const MAX_GRID_Y: usize = 65_535;
        let (x, y) = (rt.ptr(self.x), rt.ptr(self.y));
        let mut first = 0;
        while first < batch {
            let images = (batch - first).min(MAX_GRID_Y);
            // Enough blocks in all to fill the device a few times over, at least one per image.
            let per_image = (self.walked as usize).div_ceil(BLOCK as usize);
            let blocks = per_image.min((sm_count as usize * 16).div_ceil(images)).max(1) as u32;
            let mut args = vec![
                KArg::Ptr(x + first as u64 * self.x_image_bytes),
                KArg::Ptr(y + first as u64 * self.y_image_bytes),
                KArg::I32(self.walked as i32),
                KArg::Ptr(self.meta.ptr()),
                KArg::I32(self.rank),
            ];
            args.extend(self.fill.map(KArg::F32));
            launch(rt, &self.f, (blocks, images as u32, 1), (BLOCK, 1, 1), 0, &args)?;
            first += images;
        }
        Ok(())
    }
}

/// The copies of one node (a cat has one per input).
pub struct StridedLayer {
    path: String,
    kind: String,
    copies: Vec<StridedCopy>,
    sm_count: u32,
}

impl StridedLayer {
    /// `what` names the op in the layer's kind (`kernel:slice:shape_gather_v16_f16`).
    pub fn new(ctx: &LayerCtx, path: &str, what: &str, copies: Vec<StridedCopy>) -> Self {
        let entry = copies.first().map_or(String::new(), |c| c.entry.clone());
        Self { path: path.to_string(), kind: format!("kernel:{what}:{entry}"), copies, sm_count: ctx.kernels.sm_count() }
    }
}

impl Layer for StridedLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.kind.clone()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        self.copies.iter().try_for_each(|c| c.enqueue(rt, batch, self.sm_count))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_runs_merge_and_move_in_16_byte_units() {
        // A slice of channels 96..192 of a [56, 56, 288] f16 image: rows of 96 contiguous halves.
        let dims = [CopyDim::plain(56, 56 * 288), CopyDim::plain(56, 288), CopyDim::plain(96, 1)];
        let plan = CopyPlan::new(&dims, 96, 56 * 56 * 288, 2);
        // H and W merge (W steps 288, H steps 56·288); channels become 12 units of 8 halves.
        assert_eq!(plan.dims, vec![CopyDim::plain(56 * 56, 36), CopyDim::plain(12, 1)]);
        assert_eq!((plan.offset, plan.strided_per_image, plan.unit), (12, 56 * 56 * 36, 8));
        assert_eq!(plan.walked_per_image(), 56 * 56 * 12);
    }

    #[test]
    fn transposes_padding_and_odd_offsets_stay_in_elements() {
        // A transpose: the innermost dim is strided on the source side.
        let t = CopyPlan::new(&[CopyDim::plain(64, 1), CopyDim::plain(32, 64)], 0, 2048, 2);
        assert_eq!((t.unit, t.dims.len()), (1, 2));
        // Padding on the innermost dim.
        let p = CopyPlan::new(&[CopyDim::plain(4, 10), CopyDim { size: 10, stride: 1, before: 1, bound: 8 }], 0, 32, 4);
        assert_eq!(p.unit, 1);
        assert_eq!(p.dims[1], CopyDim { size: 10, stride: 1, before: 1, bound: 8 });
        // An offset that is not a multiple of 16 bytes.
        let o = CopyPlan::new(&[CopyDim::plain(4, 64), CopyDim::plain(32, 1)], 3, 256, 4);
        assert_eq!((o.unit, o.offset), (1, 3));
    }

    #[test]
    fn unit_dims_vanish_and_a_single_element_is_one_dim() {
        let plan = CopyPlan::new(&[CopyDim::plain(1, 7), CopyDim::plain(5, 3), CopyDim::plain(1, 1)], 2, 15, 4);
        assert_eq!(plan.dims, vec![CopyDim::plain(5, 3)]);
        let one = CopyPlan::new(&[CopyDim::plain(1, 9)], 4, 10, 4);
        assert_eq!(one.dims, vec![CopyDim::plain(1, 1)]);
        assert_eq!(one.offset, 4);
    }

    #[test]
    fn a_slice_of_a_larger_source_is_unpadded() {
        assert_eq!(CopyDim::gather(4, 1, 0, 10), CopyDim::plain(4, 1));
        assert_eq!(CopyDim::gather(6, 1, 1, 10), CopyDim { size: 6, stride: 1, before: 1, bound: 5 });
        assert_eq!(CopyDim::gather(6, 1, 1, 3), CopyDim { size: 6, stride: 1, before: 1, bound: 3 });
    }

    #[test]
    fn padded_dims_do_not_merge() {
        let dims = [CopyDim { size: 6, stride: 4, before: 1, bound: 4 }, CopyDim::plain(4, 1)];
        let plan = CopyPlan::new(&dims, 0, 16, 4);
        assert_eq!(plan.dims.len(), 2);
        // The inner run still moves in units: the padding is on an outer dim.
        assert_eq!((plan.unit, plan.dims[1]), (4, CopyDim::plain(1, 1)));
        assert_eq!(plan.dims[0], CopyDim { size: 6, stride: 1, before: 1, bound: 4 });
    }
}
