//! The cuBLASLt candidates: two strided-batched GEMMs around our softmax kernel
//! (`cublaslt-attention`), and for `qkv_attention` the same between copies of q, k and v out of
//! the packed rows and of the result back (`cublaslt-attention:unpacked`).

use super::gpu::{int, mul, Dims};
use crate::engine::arena::ALIGN;
use crate::engine::gemm::{Batched, LtMatmul, GEMM_WORKSPACE};
use crate::engine::launch::{grid_for, launch, CudaFunction, KArg, BLOCK};
use crate::engine::{DeviceBuf, Elem, Layer, RunCtx, ValueId};
use crate::graph::NodeId;
use crate::ops::BuildCtx;
use crate::LowerKind;
use crate::Result;
use std::sync::Arc;

/// The cuBLASLt path's fixed part: `scale · Q·Kᵀ` to f32 scores by a strided-batched GEMM, our
/// softmax kernel (bias added) writing probabilities, `P·V` by a second batched GEMM. Q, K, V and
/// Y are contiguous `[Z, L, D]` blocks at addresses given per run.
pub(super) struct GemmCore {
    qk: LtMatmul,
    pv: LtMatmul,
    softmax: CudaFunction,
    bias: Option<Arc<DeviceBuf>>,
    dims: Dims,
    li: i32,
    si: i32,
    /// Row stride of the scores and probabilities (S rounded up to 8).
    ldi: i32,
    /// Scores (and probabilities) per image: `zimg · L · ld`.
    pub(super) scores_elems: usize,
    sm_count: u32,
}

impl GemmCore {
    pub(super) fn new(ctx: &mut BuildCtx, node: NodeId, dims: Dims, scale: f32, bias: Option<Arc<DeviceBuf>>) -> Result<Self> {
        let (li, si) = (int(ctx, node, "L", dims.l)?, int(ctx, node, "S", dims.s)?);
        // Score and probability rows are `ld` = S rounded up to 8 apart, so every f16 row and
        // matrix is 16-byte aligned.
        let ld = dims.s.next_multiple_of(8);
        let ldi = int(ctx, node, "S rounded up to 8", ld)?;
        let scores_elems = mul(ctx, node, "scores per image", dims.zimg, mul(ctx, node, "scores per problem", dims.l, ld)?)?;
        let (elem, precision, path) = (ctx.elem(), ctx.precision(), ctx.node(node).path.clone());
        let qk = LtMatmul::new_batched(
            &path,
            precision,
            elem,
            dims.d,
            dims.s,
            Batched {
                w_kn: false,
                stride_x: dims.l * dims.d,
                stride_w: dims.s * dims.d,
                stride_y: dims.l * ld,
                alpha: scale,
                out_elem: Elem::F32,
                ld_x: 0,
                ld_y: ld,
            },
        )?;
        let pv = LtMatmul::new_batched(
            &path,
            precision,
            elem,
            dims.s,
            dims.dv,
            Batched {
                w_kn: true,
                stride_x: dims.l * ld,
                stride_w: dims.s * dims.dv,
                stride_y: dims.l * dims.dv,
                alpha: 1.0,
                out_elem: elem,
                ld_x: ld,
                ld_y: 0,
            },
        )?;
        let softmax = ctx.kernels.get(&format!("attn_softmax_{}", elem.suffix()))?;
        Ok(Self { qk, pv, softmax, bias, dims, li, si, ldi, scores_elems, sm_count: ctx.kernels.sm_count() })
    }

    /// `[q, k, v, y]`, the f32 scores and the probabilities: device addresses for `batch` images.
    fn enqueue(&self, rt: &RunCtx, batch: usize, [q, k, v, y]: [u64; 4], scores: u64, probs: u64) -> Result<()> {
        let count = batch * self.dims.zimg;
        self.qk.enqueue_batched(rt, self.dims.l, count, q, k, 0, scores)?;
        let rows = count * self.dims.l;
        // One warp a row, 8 warps a block; the kernel strides over the rest.
        let blocks = (rows.div_ceil(8) as u64).min(self.sm_count as u64 * 64).max(1) as u32;
        let args = [
            KArg::Ptr(scores),
            KArg::Ptr(self.bias.as_ref().map_or(0, |b| b.ptr())),
            KArg::Ptr(probs),
            KArg::I64(rows as i64),
            KArg::I32(self.li),
            KArg::I32(self.si),
            KArg::I32(self.ldi),
            KArg::I64(self.dims.zimg.max(1) as i64),
        ];
        launch(rt, &self.softmax, (blocks, 1, 1), (256, 1, 1), 0, &args)?;
        self.pv.enqueue_batched(rt, self.dims.l, count, probs, v, 0, y)
    }
}

/// Attention as two strided-batched cuBLASLt GEMMs around our softmax kernel.
pub(super) struct GemmAttention {
    pub(super) path: String,
    pub(super) core: GemmCore,
    /// q, k, v, y.
    pub(super) io: [ValueId; 4],
    pub(super) scores: ValueId,
    pub(super) probs: ValueId,
}

impl Layer for GemmAttention {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "cublaslt-attention".into()
    }
    fn workspace_bytes(&self, _batch: usize) -> usize {
        GEMM_WORKSPACE
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        self.core.enqueue(rt, batch, self.io.map(|v| rt.ptr(v)), rt.ptr(self.scores), rt.ptr(self.probs))
    }
}

/// One launch of the general permute kernel (`kernels/permute.cu`) between addresses given per
/// run, in one element type: `meta` holds the output's sizes (outermost first), the input's
/// element strides of those dims, and the input's batch stride.
pub(super) struct Repack {
    f: CudaFunction,
    meta: DeviceBuf,
    rank: i32,
    /// Output elements per image.
    per_image: usize,
}

impl Repack {
    pub(super) fn new(
        ctx: &mut BuildCtx,
        node: NodeId,
        sizes: &[usize],
        src_strides: &[usize],
        batch_stride: usize,
        elem: Elem,
    ) -> Result<Self> {
        let meta = repack_meta(sizes, src_strides, batch_stride)
            .ok_or_else(|| ctx.err(node, LowerKind::TooLarge, format!("{sizes:?} exceeds the 64-bit range")))?;
        let bytes: Vec<u8> = meta.iter().flat_map(|v| v.to_le_bytes()).collect();
        let meta = ctx.upload_bytes(&bytes)?;
        let f = ctx.kernels.get(&format!("permute_{0}_{0}", elem.suffix()))?;
        Ok(Self { f, meta, rank: int(ctx, node, "rank", sizes.len())?, per_image: sizes.iter().product() })
    }

    fn launch(&self, rt: &RunCtx, sm_count: u32, batch: usize, src: u64, dst: u64) -> Result<()> {
        let n = batch * self.per_image;
        let args = [KArg::Ptr(src), KArg::Ptr(dst), KArg::I64(n as i64), KArg::Ptr(self.meta.ptr()), KArg::I32(self.rank)];
        launch(rt, &self.f, grid_for(n, sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

/// The permute kernel's `meta`: sizes, then source strides, then the source's batch stride.
fn repack_meta(sizes: &[usize], src_strides: &[usize], batch_stride: usize) -> Option<Vec<i64>> {
    sizes.iter().chain(src_strides).chain([&batch_stride]).map(|&v| i64::try_from(v).ok()).collect()
}

/// The unpacked candidate's scratch, one buffer for `batch` images: q, k, v and y blocks
/// (`part` bytes per image each), f32 scores and probabilities, each region `ALIGN`ed.
#[derive(Clone, Copy, Debug)]
pub(super) struct Regions {
    pub(super) part: usize,
    pub(super) scores: usize,
    pub(super) probs: usize,
}

impl Regions {
    /// Bytes per image that hold every region for any batch (each region rounds up once).
    pub(super) fn per_image(self) -> Option<usize> {
        self.part.checked_mul(4)?.checked_add(self.scores)?.checked_add(self.probs)?.checked_add(6 * ALIGN)
    }
    /// Byte offsets of q, k, v, y, the scores and the probabilities for `batch` images.
    fn offsets(self, batch: usize) -> [usize; 6] {
        let up = |b: usize| b.next_multiple_of(ALIGN);
        let part = up(batch * self.part);
        let scores = 4 * part;
        [0, part, 2 * part, 3 * part, scores, scores + up(batch * self.scores)]
    }
}

/// `qkv_attention` for any head dim: q, k and v copied out of the packed rows into scratch
/// `[Z, L, D]` blocks (three launches of the permute kernel), `GemmCore`, and the result copied
/// into the heads' places of the output rows.
pub(super) struct UnpackedGemmAttention {
    pub(super) path: String,
    pub(super) core: GemmCore,
    pub(super) unpack: Repack,
    pub(super) pack: Repack,
    /// qkv, y.
    pub(super) io: [ValueId; 2],
    pub(super) scratch: ValueId,
    pub(super) regions: Regions,
    /// Bytes from q's first element in a packed row to k's (and from k's to v's): H·D elements.
    pub(super) part_offset: u64,
    pub(super) sm_count: u32,
}

impl Layer for UnpackedGemmAttention {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "cublaslt-attention:unpacked".into()
    }
    fn workspace_bytes(&self, _batch: usize) -> usize {
        GEMM_WORKSPACE
    }
    /// The copy out of qkv comes first and only the scratch is read afterwards: the arena may
    /// reuse qkv's bytes (for y) once it is done.
    fn prologue(&self) -> Option<(ValueId, ValueId)> {
        Some((self.io[0], self.scratch))
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let [x, y] = self.io.map(|v| rt.ptr(v));
        let base = rt.ptr(self.scratch);
        let [q, k, v, ys, scores, probs] = self.regions.offsets(batch).map(|o| base + o as u64);
        for (i, dst) in [q, k, v].into_iter().enumerate() {
            self.unpack.launch(rt, self.sm_count, batch, x + i as u64 * self.part_offset, dst)?;
        }
        self.core.enqueue(rt, batch, [q, k, v, ys], scores, probs)?;
        self.pack.launch(rt, self.sm_count, batch, ys, y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Layout;

    /// The permute kernel's indexing (kernels/permute.cu) on the host.
    fn permute_on_host(src: &[f32], meta: &[i64], rank: usize, n: usize) -> Vec<f32> {
        let (size, stride, batch_stride) = (&meta[..rank], &meta[rank..2 * rank], meta[2 * rank]);
        (0..n as i64)
            .map(|i| {
                let (mut rem, mut off) = (i, 0);
                for d in (0..rank).rev() {
                    off += rem % size[d] * stride[d];
                    rem /= size[d];
                }
                src[(off + rem * batch_stride) as usize]
            })
            .collect()
    }

    #[test]
    fn unpacked_candidate_copies_are_the_cpu_split() {
        // The metas `gpu_qkv_attention` builds for [G=2, L=3, 3·H·D] with H = 2, D = 5, batch 2.
        let (g, l, h, d, batch) = (2usize, 3usize, 2usize, 5usize, 2usize);
        let dims = [g, l, 3 * h * d];
        let x = crate::seeded::weight("x", &[batch, g, l, 3 * h * d]);
        let q_dims = [g, h, l, d];
        let src_strides = Layout::contiguous(3).strides(&dims);
        let unpack = repack_meta(&q_dims, &[src_strides[0], d, 3 * h * d, 1], dims.iter().product()).unwrap();
        let part = g * h * l * d;
        // Each part is the same elements the CPU reference copies out (q, k, v in order).
        for p in 0..3 {
            let got = permute_on_host(&x.data[p * h * d..], &unpack, 4, batch * part);
            for (i, &v) in got.iter().enumerate() {
                let (b, gi, hh, li, di) = (i / part, i / (h * l * d) % g, i / (l * d) % h, i / d % l, i % d);
                assert_eq!(v, x.data[(((b * g + gi) * l + li) * 3 + p) * h * d + hh * d + di], "part {p} element {i}");
            }
        }
        // Packing writes [G, L, H·D] rows from [G, H, L, D] blocks.
        let y = crate::seeded::weight("y", &[batch, g, h, l, d]);
        let ys = Layout::contiguous(4).strides(&q_dims);
        let pack = repack_meta(&[g, l, h, d], &[ys[0], ys[2], ys[1], 1], part).unwrap();
        let got = permute_on_host(&y.data, &pack, 4, batch * part);
        for (i, &v) in got.iter().enumerate() {
            let (b, gi, li, hh, di) = (i / part, i / (l * h * d) % g, i / (h * d) % l, i / d % h, i % d);
            assert_eq!(v, y.data[(((b * g + gi) * h + hh) * l + li) * d + di], "packed element {i}");
        }
    }

    #[test]
    fn unpacked_scratch_regions_fit_and_align() {
        let r = Regions { part: 1000, scores: 3000, probs: 1500 };
        for batch in 1..5 {
            let o = r.offsets(batch);
            assert!(o.iter().all(|&v| v % ALIGN == 0), "{o:?}");
            let ends =
                [o[0] + batch * r.part, o[1] + batch * r.part, o[2] + batch * r.part, o[3] + batch * r.part, o[4] + batch * r.scores];
            assert!(ends.iter().zip(&o[1..]).all(|(end, next)| end <= next), "no overlap at batch {batch}: {o:?}");
            assert!(o[5] + batch * r.probs <= batch * r.per_image().unwrap(), "fits at batch {batch}");
        }
        assert_eq!(Regions { part: usize::MAX / 2, scores: 0, probs: 0 }.per_image(), None);
    }
}
