//! The GPU converter: a `deform_conv2d` node becomes one engine layer that runs our deformable
//! im2col kernel (`kernels/deform_conv.cu`) into a column buffer, then one cuBLASLt GEMM through
//! Kiln's public `LtMatmul` (f32 accumulation in both precisions, bias in its epilogue).
//!
//! Layouts: custom ops see activations in the engine's native layout, so `x`, `offset` and
//! `mask` arrive channels-last (NHWC) and the output is written NHWC; the builder inserts any
//! reformat around the layer. Weights are constants of the graph, rearranged here once.

use crate::op::{geometry, DeformAttrs, Geometry};
use kiln::plugin::LtMatmul;
use kiln::plugin::{grid_for, launch, CudaFunction, KArg, BLOCK};
use kiln::plugin::{BuildCtx, DeviceBuf, Layer, Layout, RunCtx, ValueId};
use kiln::Result;
use kiln::{plugin::Op, NodeId};

/// The kernels, compiled by Kiln's NVRTC cache the first time a layer of this op is built.
pub const DEFORM_CONV_CU: &str = include_str!("../kernels/deform_conv.cu");

/// Every entry point the layer launches (checked against `DEFORM_CONV_CU` by the NVRTC test).
pub fn entry_points() -> Vec<String> {
    ["f32", "f16"].iter().map(|t| format!("deform_im2col_{t}")).collect()
}

/// Workspace offered to cuBLASLt (Kiln's GEMM layers ask for the same 32 MiB; the context's
/// workspace is the largest any layer asks for).
const GEMM_WORKSPACE: usize = 32 << 20;

/// Columns are padded to a multiple of this, so f16 rows are whole 16-byte packs.
const K_ALIGN: usize = 8;

pub struct DeformConvLayer {
    path: String,
    x: ValueId,
    offset: ValueId,
    mask: Option<ValueId>,
    y: ValueId,
    /// The column matrix `[N * HO * WO, KP]`, scratch sized per image.
    col: ValueId,
    im2col: CudaFunction,
    /// H, W, C, HO, WO, KH, KW, sh, sw, ph, pw, dh, dw, OG, KP as the kernel takes them.
    dims: [i32; 15],
    kp: usize,
    rows_per_image: usize,
    /// `[Cout, KP]` weights in the columns' (tap, channel) order, zero across groups and padding.
    _w: DeviceBuf,
    w_ptr: u64,
    _b: Option<DeviceBuf>,
    /// `y[m, Cout] = col[m, KP] · Wᵀ + bias`.
    matmul: LtMatmul,
    sm_count: u32,
}

impl Layer for DeformConvLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "user-kernel:deform_conv2d(im2col+gemm)".into()
    }
    fn workspace_bytes(&self, _batch: usize) -> usize {
        GEMM_WORKSPACE
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let rows = batch * self.rows_per_image;
        let mask = self.mask.map_or(0, |m| rt.ptr(m));
        let col = rt.ptr(self.col);
        let mut args =
            vec![KArg::Ptr(rt.ptr(self.x)), KArg::Ptr(rt.ptr(self.offset)), KArg::Ptr(mask), KArg::Ptr(col), KArg::I64(rows as i64)];
        args.extend(self.dims.iter().map(|&d| KArg::I32(d)));
        launch(rt, &self.im2col, grid_for(rows * self.kp, self.sm_count), (BLOCK, 1, 1), 0, &args)?;
        self.matmul.enqueue(rt, rows, col, self.w_ptr, 0, rt.ptr(self.y))
    }
}

/// Rearranges PyTorch's `[Cout, Cin / groups, KH, KW]` weights into `[Cout, KP]` rows over the
/// columns' `(tap, channel)` order. Output channel `o` of group `g` reads only its group's input
/// channels; the other groups' columns get zeros, so one GEMM serves every group.
pub fn column_weights(g: &Geometry, weight: &[f32], kp: usize) -> Vec<f32> {
    let (cin_g, cout_g, taps) = (g.cin / g.groups, g.cout / g.groups, g.taps());
    let mut out = vec![0f32; g.cout * kp];
    for o in 0..g.cout {
        let grp = o / cout_g;
        for ci in 0..cin_g {
            let c = grp * cin_g + ci;
            for t in 0..taps {
                out[o * kp + t * g.cin + c] = weight[(o * cin_g + ci) * taps + t];
            }
        }
    }
    out
}

/// The converter registered for `deform_conv2d` (see `op.rs`).
pub fn convert(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
    let n = ctx.node(node);
    let Op::Custom(call) = &n.op else { return Err(ctx.err(node, kiln::LowerKind::Unsupported, "is not a deform_conv2d node")) };
    let attrs = DeformAttrs::from_attrs(&call.attrs).map_err(|r| ctx.err(node, kiln::LowerKind::Operands, r))?;
    let shapes: Vec<&[usize]> = n.inputs.iter().map(|&i| ctx.node(i).shape.as_slice()).collect();
    let g = geometry(&attrs, &shapes).map_err(|r| ctx.err(node, kiln::LowerKind::Operands, r))?;
    let (mask_at, weight_at, bias_at) = attrs.positions();
    let (x, offset, y) = (ctx.input(node, 0)?, ctx.input(node, 1)?, ctx.output(node)?);
    let mask = mask_at.map(|i| ctx.input(node, i)).transpose()?;
    let elem = ctx.elem();
    for (name, v) in [("input", Some(x)), ("offset", Some(offset)), ("mask", mask), ("output", Some(y))] {
        let Some(v) = v else { continue };
        let d = ctx.value(v);
        if !d.layout.same_bytes(Layout::channels_last(3), &d.dims) || d.elem != elem {
            return Err(ctx.err(
                node,
                kiln::LowerKind::Unsupported,
                format!("{name} must be an NHWC image of {elem:?}, got {:?} {:?} {:?}", d.dims, d.layout, d.elem),
            ));
        }
    }
    let weight = ctx.weight(node, weight_at)?.clone();
    let bias = bias_at.map(|i| ctx.weight(node, i).cloned()).transpose()?;

    let k = g.taps().checked_mul(g.cin).ok_or_else(|| ctx.err(node, kiln::LowerKind::TooLarge, "K = KH * KW * Cin overflows"))?;
    let kp = k.next_multiple_of(K_ALIGN);
    let rows_per_image = g.ho * g.wo;
    let col_bytes = rows_per_image
        .checked_mul(kp)
        .and_then(|v| v.checked_mul(elem.size()))
        .ok_or_else(|| ctx.err(node, kiln::LowerKind::TooLarge, format!("the column matrix of {rows_per_image} x {kp} overflows")))?;
    let int =
        |v: usize| i32::try_from(v).map_err(|_| ctx.err(node, kiln::LowerKind::TooLarge, format!("{v} exceeds the kernel's 32-bit sizes")));
    // The kernel indexes within an image with 32-bit ints.
    int(g.h * g.w * g.cin)?;
    int(rows_per_image * 2 * g.offset_groups * g.taps())?;
    let a = &g.attrs;
    let dims = [
        int(g.h)?,
        int(g.w)?,
        int(g.cin)?,
        int(g.ho)?,
        int(g.wo)?,
        int(g.kh)?,
        int(g.kw)?,
        int(a.stride[0])?,
        int(a.stride[1])?,
        int(a.padding[0])?,
        int(a.padding[1])?,
        int(a.dilation[0])?,
        int(a.dilation[1])?,
        int(g.offset_groups)?,
        int(kp)?,
    ];

    let path = n.path.clone();
    let wbuf = ctx.upload(&column_weights(&g, &weight.data, kp))?;
    let bbuf = bias.map(|b| ctx.upload(&b.data)).transpose()?;
    let matmul = LtMatmul::new(&path, ctx.precision(), elem, kp, g.cout, bbuf.as_ref(), false)?;
    let col = ctx.scratch(col_bytes);
    ctx.kernels.add_source("deform_conv.cu", DEFORM_CONV_CU)?;
    let im2col = ctx.kernels.get(&format!("deform_im2col_{}", elem.suffix()))?;
    Ok(Box::new(DeformConvLayer {
        path,
        x,
        offset,
        mask,
        y,
        col,
        im2col,
        dims,
        kp,
        rows_per_image,
        w_ptr: wbuf.ptr(),
        _w: wbuf,
        _b: bbuf,
        matmul,
        sm_count: ctx.kernels.sm_count(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{bilinear, DeformAttrs, OP};
    use kiln::HostTensor;

    /// NCHW `[N, C, H, W]` to NHWC, as the engine stores images.
    fn nhwc(t: &HostTensor) -> Vec<f32> {
        let [_, c, h, w] = <[usize; 4]>::try_from(t.shape.as_slice()).expect("4-d");
        let mut out = vec![0f32; t.data.len()];
        for (i, &v) in t.data.iter().enumerate() {
            let (b, ch, y, x) = (i / (c * h * w), i / (h * w) % c, i / w % h, i % w);
            out[((b * h + y) * w + x) * c + ch] = v;
        }
        out
    }

    /// The layer on the CPU: `deform_im2col` element by element with the kernel's index maths
    /// (NHWC inputs, `[rows, KP]` columns), then the GEMM with `column_weights` and the bias. It
    /// must give the CPU reference's output, in NHWC.
    #[test]
    fn the_kernels_index_maths_reproduce_the_cpu_reference() {
        let a = DeformAttrs { stride: [1, 2], padding: [1, 0], dilation: [2, 1], mask: true, bias: true };
        let (n, cin, h, w, cout, kh, kw, og, groups) = (2, 6, 7, 9, 4, 3, 2, 3, 2);
        let x = kiln::dev::weight("t.input", &[n, cin, h, w]);
        let g = geometry(&a, &[&x.shape, &[n, 2 * og * kh * kw, 5, 4], &[n, og * kh * kw, 5, 4], &[cout, cin / groups, kh, kw], &[cout]])
            .expect("geometry");
        let (ho, wo, taps) = (g.ho, g.wo, g.taps());
        let mut offset = kiln::dev::weight("t.offset", &[n, 2 * og * taps, ho, wo]);
        offset.data.iter_mut().for_each(|v| *v *= 3.0);
        let mask = kiln::dev::weight("t.mask", &[n, og * taps, ho, wo]);
        let weight = kiln::dev::weight("t.weight", &[cout, cin / groups, kh, kw]);
        let bias = kiln::dev::weight("t.bias", &[cout]);
        let attrs = a.to_attrs().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        let want = (kiln::plugin::lookup(OP).expect("registered").cpu)(&attrs, &[&x, &offset, &mask, &weight, &bias]).expect("cpu");

        let (xs, offs, masks) = (nhwc(&x), nhwc(&offset), nhwc(&mask));
        let k_all = taps * cin;
        let kp = k_all.next_multiple_of(K_ALIGN);
        let rows = n * ho * wo;
        let c_per_group = cin / og;
        let mut col = vec![0f32; rows * kp];
        for (i, slot) in col.iter_mut().enumerate() {
            let (row, k) = (i / kp, i % kp);
            if k >= k_all {
                continue;
            }
            let (t, c) = (k / cin, k % cin);
            let (ti, tj) = (t / kw, t % kw);
            let grp = c / c_per_group;
            let (b, p) = (row / (ho * wo), row % (ho * wo));
            let (oy, ox) = (p / wo, p % wo);
            let off = row * (2 * og * taps) + 2 * (grp * taps + t);
            let [sh, sw, ph, pw, dh, dw] =
                [a.stride[0], a.stride[1], a.padding[0], a.padding[1], a.dilation[0], a.dilation[1]].map(|v| v as i64);
            let y = (oy as i64 * sh - ph + ti as i64 * dh) as f32 + offs[off];
            let xf = (ox as i64 * sw - pw + tj as i64 * dw) as f32 + offs[off + 1];
            let m = masks[row * (og * taps) + grp * taps + t];
            // The kernel reads channel c of the NHWC image: the plane of channel c, gathered.
            let plane: Vec<f32> = (0..h * w).map(|q| xs[(b * h * w + q) * cin + c]).collect();
            *slot = m * bilinear(&plane, h, w, y, xf);
        }
        let wc = column_weights(&g, &weight.data, kp);
        let mut got = vec![0f32; rows * cout];
        for r in 0..rows {
            for o in 0..cout {
                got[r * cout + o] = bias.data[o] + (0..kp).map(|k| col[r * kp + k] * wc[o * kp + k]).sum::<f32>();
            }
        }
        let want = nhwc(&want);
        let max = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        println!("kernel index maths vs CPU reference: max abs {max:.2e} over {} values", want.len());
        assert!(max < 1e-5, "max abs {max}");
    }

    /// The column weights times a column matrix built in the kernel's (tap, channel) order equal
    /// the grouped weights times torchvision's (channel, tap) columns: the GEMM the layer runs
    /// computes the CPU reference's sums.
    #[test]
    fn column_weights_reorder_groups_and_pad() {
        let a = DeformAttrs { padding: [1, 1], ..Default::default() };
        let (n, cin, cout, groups, kh, kw) = (1, 6, 4, 2, 2, 3);
        let g = geometry(&a, &[&[n, cin, 5, 5], &[n, 2 * kh * kw, 6, 5], &[cout, cin / groups, kh, kw]]).expect("geometry");
        let w = kiln::dev::weight("w", &[cout, cin / groups, kh, kw]);
        let taps = kh * kw;
        let kp = (taps * cin).next_multiple_of(K_ALIGN);
        assert_eq!(kp, 40);
        let wc = column_weights(&g, &w.data, kp);
        // A "column": value v(c, t) for every channel and tap.
        let v = |c: usize, t: usize| (c * 7 + t * 3) as f32 * 0.01 - 0.2;
        for o in 0..cout {
            let ours: f32 = (0..kp).map(|k| if k < taps * cin { wc[o * kp + k] * v(k % cin, k / cin) } else { wc[o * kp + k] }).sum();
            let (cin_g, grp) = (cin / groups, o / (cout / groups));
            let want: f32 = (0..cin_g)
                .flat_map(|ci| (0..taps).map(move |t| (ci, t)))
                .map(|(ci, t)| w.data[(o * cin_g + ci) * taps + t] * v(grp * cin_g + ci, t))
                .sum();
            assert!((ours - want).abs() < 1e-5, "output channel {o}: {ours} vs {want}");
        }
        assert!(wc.chunks(kp).all(|row| row[taps * cin..].iter().all(|&z| z == 0.0)), "padding columns are zero");
    }
}
