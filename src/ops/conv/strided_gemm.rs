//! A strided 1×1 convolution (ResNet's downsample shortcuts) as one strided-batched cuBLASLt GEMM,
//! offered as a timed candidate beside cuDNN's.
//!
//! In NHWC, output row `(n, i)` of a 1×1 conv with stride `(s0, s1)` and no padding is the GEMM
//! `[Wo, Cin] × [Cin, Cout]` whose `Wo` input rows are pixels `(n, s0·i, s1·j)`: consecutive rows
//! `s1·Cin` elements apart (the leading dimension), consecutive output rows `s0·W·Cin` apart. When
//! `s0` divides `H` that stride also runs from one image's last output row to the next image's
//! first, so all `N·Ho` row GEMMs are one strided-batched call sharing the weight (batch stride 0)
//! and the bias: no copy of the subsampled input, bias/ReLU in the epilogue, a residual as C.

use super::{Activation, ConvAttrs};
use crate::engine::gemm::{Batched, LtMatmul};
use crate::engine::layer::{DeviceBuf, Layer, RunCtx, ValueId};
use crate::graph::NodeId;
use crate::ops::BuildCtx;
use crate::LowerKind;
use crate::Result;

/// The shape of the batched GEMM of a strided 1×1 convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedGemm {
    /// GEMM rows per matrix: the output width.
    pub m: usize,
    /// Matrices per image: the output height.
    pub count_per_image: usize,
    /// Elements between consecutive rows of X (one matrix's rows), and between matrices of X and Y.
    pub ld_x: usize,
    pub stride_x: usize,
    pub stride_y: usize,
}

impl StridedGemm {
    /// For a conv with `attrs` and weight `[Cout, Cin, kh, kw]` from `[Cin, h, w]` to
    /// `[Cout, ho, wo]`; `None` unless it is an unpadded, ungrouped, strided 1×1 convolution
    /// whose vertical stride divides the input height (then one batch stride serves all images).
    pub fn new(a: &ConvAttrs, [cout, cin, kh, kw]: [usize; 4], [h, w]: [usize; 2], [ho, wo]: [usize; 2]) -> Option<Self> {
        let [s0, s1] = a.stride;
        let pointwise = kh == 1 && kw == 1 && !a.transposed && a.groups == 1 && a.padding == [0, 0];
        if !pointwise || a.stride == [1, 1] || s0 == 0 || s1 == 0 || h % s0 != 0 || ho * s0 != h || wo != (w - 1) / s1 + 1 || cin == 0 {
            return None;
        }
        Some(Self { m: wo, count_per_image: ho, ld_x: s1 * cin, stride_x: s0 * w * cin, stride_y: wo * cout })
    }

    /// Element offset of X's row `j` of matrix `b` (`b` counts `n·Ho + i`), and of Y's (the CPU
    /// check of the addressing).
    #[cfg(test)]
    pub fn x_offset(&self, b: usize, j: usize) -> usize {
        b * self.stride_x + j * self.ld_x
    }
    #[cfg(test)]
    pub fn y_offset(&self, b: usize, j: usize, cout: usize) -> usize {
        b * self.stride_y + j * cout
    }
}

/// `Y = act(X_strided · Wᵀ + bias + residual)`: one strided-batched cuBLASLt call.
pub struct StridedGemmLayer {
    path: String,
    x: ValueId,
    y: ValueId,
    z: Option<ValueId>,
    shape: StridedGemm,
    _w: DeviceBuf,
    w_ptr: u64,
    _b: Option<DeviceBuf>,
    matmul: LtMatmul,
}

/// The candidate for a conv node, or `None` where it does not apply (see `StridedGemm::new`).
/// `weight` is PyTorch's `[Cout, Cin, 1, 1]`, i.e. the GEMM's row-major `[Cout, Cin]`.
pub fn candidate(
    ctx: &mut BuildCtx,
    node: NodeId,
    a: &ConvAttrs,
    weight: &[f32],
    shape4: [usize; 4],
    bias: Option<&[f32]>,
    y: ValueId,
) -> Result<Option<Box<dyn Layer>>> {
    let x = ctx.input(node, 0)?;
    let (cin, h, w) = ctx.chw(x, "input")?;
    let (cout, ho, wo) = ctx.chw(y, "output")?;
    let Some(shape) = StridedGemm::new(a, shape4, [h, w], [ho, wo]) else { return Ok(None) };
    if shape4[..2] != [cout, cin] || weight.len() != cout * cin || bias.is_some_and(|b| b.len() != cout) {
        return Err(ctx.err(node, LowerKind::Weights, format!("weight {shape4:?} / bias for a {cin} → {cout} 1×1 convolution")));
    }
    let residual = if a.residual { Some(ctx.input(node, if a.bias { 3 } else { 2 })?) } else { None };
    let elem = ctx.elem();
    let wbuf = ctx.upload(weight)?;
    let bbuf = bias.map(|b| ctx.upload(b)).transpose()?;
    let path = ctx.node(node).path.clone();
    let batched = Batched {
        w_kn: false,
        stride_x: shape.stride_x,
        stride_w: 0,
        stride_y: shape.stride_y,
        alpha: 1.0,
        out_elem: elem,
        ld_x: shape.ld_x,
        ld_y: 0,
    };
    let matmul = LtMatmul::new(&path, ctx.precision(), elem, cin, cout, bbuf.as_ref(), a.act == Activation::Relu)?.with_batched(batched)?;
    Ok(Some(Box::new(StridedGemmLayer { path, x, y, z: residual, shape, w_ptr: wbuf.ptr(), _w: wbuf, _b: bbuf, matmul })))
}

impl Layer for StridedGemmLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "cublaslt-strided-gemm".into()
    }
    fn workspace_bytes(&self, batch: usize) -> usize {
        self.matmul.workspace(self.shape.m, batch * self.shape.count_per_image)
    }
    fn prepare(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        self.matmul.prepare(rt, self.shape.m, batch * self.shape.count_per_image)
    }
    fn overwrites(&self) -> Option<(ValueId, ValueId)> {
        // D is written in place of C (the residual), which has D's dense layout.
        self.z.map(|z| (self.y, z))
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let c = self.z.map_or(0, |z| rt.ptr(z));
        let count = batch * self.shape.count_per_image;
        self.matmul.enqueue_batched(rt, self.shape.m, count, rt.ptr(self.x), self.w_ptr, c, rt.ptr(self.y))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::HostTensor;
    use crate::ops::conv::conv2d_cpu;

    /// The batched GEMM's addressing, computed on the host over NHWC buffers, equals the CPU
    /// executor's strided 1×1 convolution (with bias).
    #[test]
    fn batched_gemm_addressing_equals_the_strided_conv() {
        for (cin, cout, [h, w], s) in [(8, 6, [8, 7], [2, 2]), (4, 5, [9, 6], [3, 2]), (3, 4, [4, 9], [2, 3])] {
            let a = ConvAttrs { stride: s, bias: true, ..ConvAttrs::default() };
            let n = 2;
            let x = crate::seeded::uniform_tensor(&[n, cin, h, w], 5);
            let wt = crate::seeded::uniform_tensor(&[cout, cin, 1, 1], 6);
            let b = crate::seeded::uniform_tensor(&[cout], 7);
            let want = conv2d_cpu(&a, &[&x, &wt, &b]).expect("conv");
            let (ho, wo) = (want.shape[2], want.shape[3]);
            let g = StridedGemm::new(&a, [cout, cin, 1, 1], [h, w], [ho, wo]).expect("applies");
            // NHWC input; Y[b][j] = X[b][j] · Wᵀ + bias over matrices b = (n, i).
            let mut xh = vec![0f32; n * h * w * cin];
            for (ni, ci, yi, xi) in itertools(n, cin, h, w) {
                xh[((ni * h + yi) * w + xi) * cin + ci] = x.data[((ni * cin + ci) * h + yi) * w + xi];
            }
            let mut yh = vec![f32::NAN; n * ho * wo * cout];
            for bi in 0..n * g.count_per_image {
                for j in 0..g.m {
                    for co in 0..cout {
                        let row = &xh[g.x_offset(bi, j)..][..cin];
                        let dot: f32 = row.iter().zip(&wt.data[co * cin..][..cin]).map(|(p, q)| p * q).sum();
                        yh[g.y_offset(bi, j, cout) + co] = dot + b.data[co];
                    }
                }
            }
            let got = HostTensor::new(
                want.shape.clone(),
                itertools(n, cout, ho, wo).map(|(ni, co, yi, xi)| yh[((ni * ho + yi) * wo + xi) * cout + co]).collect(),
            );
            let err = got.data.iter().zip(&want.data).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            assert!(err < 1e-5, "{cin}→{cout} {h}×{w} stride {s:?}: max abs error {err}");
        }
    }

    /// NCHW indices in order.
    fn itertools(n: usize, c: usize, h: usize, w: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> {
        (0..n).flat_map(move |a| (0..c).flat_map(move |b| (0..h).flat_map(move |y| (0..w).map(move |x| (a, b, y, x)))))
    }

    #[test]
    fn only_unpadded_strided_pointwise_convs_whose_stride_divides_the_height() {
        let s2 = ConvAttrs { stride: [2, 2], ..ConvAttrs::default() };
        assert_eq!(
            StridedGemm::new(&s2, [128, 64, 1, 1], [56, 56], [28, 28]),
            Some(StridedGemm { m: 28, count_per_image: 28, ld_x: 128, stride_x: 2 * 56 * 64, stride_y: 28 * 128 })
        );
        assert!(StridedGemm::new(&s2, [8, 8, 1, 1], [7, 8], [4, 4]).is_none(), "odd height");
        assert!(StridedGemm::new(&ConvAttrs::default(), [8, 8, 1, 1], [8, 8], [8, 8]).is_none(), "stride 1: the plain GEMM");
        assert!(StridedGemm::new(&s2, [8, 8, 3, 3], [8, 8], [3, 3]).is_none(), "3×3");
        let padded = ConvAttrs { padding: [1, 1], ..s2 };
        assert!(StridedGemm::new(&padded, [8, 8, 1, 1], [8, 8], [5, 5]).is_none(), "padded");
    }
}
