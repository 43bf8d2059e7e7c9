//! CenterNet-R50 ("Objects as Points") and its decode, registered as a custom op.
//!
//! PyTorch twin (`tools/export_reference.py`): `backbone` = torchvision ResNet-50 without
//! `avgpool`/`fc`; `upsampler.deconv_layers` = 3 x [ConvTranspose2d(4, s=2, p=1, bias=False),
//! BatchNorm2d, ReLU] (2048 → 256 → 256 → 256); `head.{hm,wh,reg}` = [Conv2d(256, 64, 3, p=1), ReLU,
//! Conv2d(64, C, 1)] with C = num_classes, 2, 2. A 512x512 input gives 128x128 maps.

use crate::resnet::{ResNet50, ResNetConfig};
use kiln::plugin::{Attrs, CustomOp};
use kiln::HostTensor;
use kiln::{
    nn::{BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, ConvTranspose2d, ReLU, Sequential},
    Error, Forward, Module, Result, Tensor, VarBuilder,
};

/// Detections kept per image by default.
pub const DEFAULT_K: usize = 100;

/// The decode's kernels (`models/kernels/decode.cu`): they live with the model that registers the
/// op, as a user's kernels would, and are compiled when a decode layer is built.
pub const DECODE_CU: &str = include_str!("../kernels/decode.cu");

/// Every entry point the decode layer launches (checked against `DECODE_CU` by the NVRTC test).
pub fn decode_entry_points() -> Vec<String> {
    let mut names = vec!["decode_clear".to_string(), "decode_threshold".to_string()];
    for t in ["f32", "f16"] {
        for v in ["", "_vec"] {
            names.push(format!("decode_hist_{t}{v}"));
            names.push(format!("decode_collect_{t}{v}"));
        }
        for o in ["f32", "f16"] {
            names.push(format!("decode_final_{t}_{o}"));
        }
    }
    names
}

/// One head: `nn.Sequential(Conv2d(256, 64, 3, padding=1), ReLU, Conv2d(64, cout, 1))`.
#[derive(Module)]
#[module(config = usize)]
pub struct HeadBranch {
    #[module(name = "0", config = Conv2dConfig::new(256, 64, 3).padding(1))]
    conv: Conv2d,
    #[module(name = "1")]
    relu: ReLU,
    #[module(name = "2", config = Conv2dConfig::new(64, *cfg, 1))]
    out: Conv2d,
}

impl Forward for HeadBranch {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.out.forward(&self.relu.forward(&self.conv.forward(x)?)?)
    }
}

/// The three heads: class heatmap logits, box sizes, centre offsets.
#[derive(Module)]
#[module(config = usize)]
pub struct Head {
    #[module(config = *cfg)]
    hm: HeadBranch,
    #[module(config = 2)]
    wh: HeadBranch,
    #[module(config = 2)]
    reg: HeadBranch,
}

/// The raw outputs of CenterNet, each at stride 4: `hm` [N, C, H, W] (logits), `wh`, `reg` [N, 2, H, W].
pub struct CenterNetOutput {
    pub hm: Tensor,
    pub wh: Tensor,
    pub reg: Tensor,
}

impl Head {
    pub fn forward(&self, x: &Tensor) -> Result<CenterNetOutput> {
        Ok(CenterNetOutput { hm: self.hm.forward(x)?, wh: self.wh.forward(x)?, reg: self.reg.forward(x)? })
    }
}

/// `upsampler.deconv_layers`: 3 x [ConvTranspose2d(k=4, s=2, p=1, bias=False), BatchNorm2d, ReLU],
/// one flat `nn.Sequential` (indices 0..8), 2048 → 256 → 256 → 256 channels.
pub struct Upsampler {
    deconv_layers: Sequential,
}

impl Upsampler {
    /// Three stages, 2048 → 256 → 256 → 256 channels, of `per_stage` layers each: what `front`
    /// pushes first (given the folder, the stage's first index, `cin` and `cout`; it returns the
    /// channels it leaves), then ConvTranspose2d(k=4, s=2, p=1, bias=False), BatchNorm2d, ReLU.
    /// CenterNet pushes nothing in front; CenterNet-DCN a DCN, BatchNorm2d and ReLU.
    pub(crate) fn load_stages(
        vb: VarBuilder,
        per_stage: usize,
        mut front: impl FnMut(&mut Sequential, &VarBuilder, usize, usize, usize) -> Result<usize>,
    ) -> Result<Self> {
        let vb = vb.pp("deconv_layers");
        let mut deconv_layers = Sequential::new();
        let mut cin = 2048;
        for (i, cout) in [256, 256, 256].into_iter().enumerate() {
            let first = per_stage * i;
            let c = front(&mut deconv_layers, &vb, first, cin, cout)?;
            let at = first + per_stage - 3;
            let deconv = Conv2dConfig::new(c, cout, 4).stride(2).padding(1).bias(false);
            deconv_layers.push(ConvTranspose2d::load(vb.pp(at), &deconv)?);
            deconv_layers.push(BatchNorm2d::load(vb.pp(at + 1), &BatchNorm2dConfig::new(cout))?);
            deconv_layers.push(ReLU::load(vb.pp(at + 2), &())?);
            cin = cout;
        }
        Ok(Self { deconv_layers })
    }
}

impl Module for Upsampler {
    type Config = ();
    fn load(vb: VarBuilder, _: &()) -> Result<Self> {
        Self::load_stages(vb, 3, |_, _, _, cin, _| Ok(cin))
    }
}

impl Forward for Upsampler {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.deconv_layers.forward(x)
    }
}

/// CenterNet-R50 with `num_classes` classes (the `Config`).
#[derive(Module)]
#[module(config = usize)]
pub struct CenterNet {
    #[module(config = ResNetConfig::new([3, 4, 6, 3], None))]
    backbone: ResNet50,
    upsampler: Upsampler,
    #[module(config = *cfg)]
    head: Head,
}

impl CenterNet {
    pub fn forward(&self, x: &Tensor) -> Result<CenterNetOutput> {
        self.head.forward(&self.upsampler.forward(&self.backbone.features(x)?)?)
    }
}

/// `centernet_r50(num_classes)`: the model of the module docs.
pub fn centernet_r50(vb: VarBuilder, num_classes: usize) -> Result<CenterNet> {
    CenterNet::load(vb, &num_classes)
}

/// Applies the `centernet_decode` op: [N, k, 6] rows of (x1, y1, x2, y2, score, class) in output
/// map coordinates, best first.
pub fn decode(out: &CenterNetOutput, k: usize) -> Result<Tensor> {
    out.hm.custom("centernet_decode", &[("k", k as f64)], &[&out.wh, &out.reg])
}

// ---- the `centernet_decode` custom op ------------------------------------------------------

fn k_attr(attrs: &Attrs) -> std::result::Result<usize, String> {
    let k = attrs.get("k").copied().unwrap_or(DEFAULT_K as f64);
    if !(k >= 1.0 && k.fract() == 0.0 && k <= u32::MAX as f64) {
        return Err(format!("attribute k must be a positive integer, got {k}"));
    }
    Ok(k as usize)
}

/// Inputs hm [N, C, H, W], wh and reg [N, 2, H, W]; output [N, k, 6].
fn decode_shape(attrs: &Attrs, inputs: &[&[usize]]) -> std::result::Result<Vec<usize>, String> {
    let k = k_attr(attrs)?;
    let [hm, wh, reg] = inputs else {
        return Err(format!("centernet_decode expects 3 inputs (hm, wh, reg), got {}", inputs.len()));
    };
    if hm.len() != 4 {
        return Err(format!("hm must be [N, C, H, W], got {hm:?}"));
    }
    let want = [hm[0], 2, hm[2], hm[3]];
    for (name, s) in [("wh", wh), ("reg", reg)] {
        if **s != want {
            return Err(format!("{name} must be {want:?} to match hm {hm:?}, got {s:?}"));
        }
    }
    let candidates = hm[1] * hm[2] * hm[3];
    if k > candidates {
        return Err(format!("k = {k} exceeds the {candidates} candidates (classes x positions) of hm {hm:?}"));
    }
    Ok(vec![hm[0], k, 6])
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The CPU reference: sigmoid, 3x3 peak keeping (a score survives where it equals its 3x3 max,
/// stride 1, padding 1), top-k over classes x positions (ties: lower flat index first), boxes
/// centred at (x + reg_x, y + reg_y) of size wh.
fn decode_cpu(attrs: &Attrs, inputs: &[&HostTensor]) -> Result<HostTensor> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let out_shape = decode_shape(attrs, &shapes).map_err(|reason| Error::Shape {
        path: "centernet_decode".into(),
        op: "centernet_decode".into(),
        reason: reason.into(),
        got: shapes.iter().map(|s| s.to_vec()).collect(),
    })?;
    let (hm, wh, reg) = (inputs[0], inputs[1], inputs[2]);
    let (n, c, h, w) = (hm.shape[0], hm.shape[1], hm.shape[2], hm.shape[3]);
    let k = out_shape[1];
    let plane = h * w;
    let mut out = Vec::with_capacity(n * k * 6);
    for img in 0..n {
        let heat: Vec<f32> = hm.data[img * c * plane..(img + 1) * c * plane].iter().map(|&v| sigmoid(v)).collect();
        let mut kept: Vec<(f32, usize)> = Vec::new();
        for ch in 0..c {
            let p = &heat[ch * plane..(ch + 1) * plane];
            for y in 0..h {
                for x in 0..w {
                    let v = p[y * w + x];
                    let mut max = v;
                    for yy in y.saturating_sub(1)..(y + 2).min(h) {
                        for xx in x.saturating_sub(1)..(x + 2).min(w) {
                            max = max.max(p[yy * w + xx]);
                        }
                    }
                    // Suppressed positions score 0 and still compete, as in the PyTorch decode.
                    kept.push((if max == v { v } else { 0.0 }, ch * plane + y * w + x));
                }
            }
        }
        // Only the best k matter: partition first, then sort those (score desc, index asc).
        let order = |a: &(f32, usize), b: &(f32, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if k < kept.len() {
            kept.select_nth_unstable_by(k - 1, order);
            kept.truncate(k);
        }
        kept.sort_unstable_by(order);
        let map = |t: &HostTensor, ch: usize, pos: usize| t.data[(img * 2 + ch) * plane + pos];
        for &(score, idx) in &kept {
            let (cls, pos) = (idx / plane, idx % plane);
            let (y, x) = (pos / w, pos % w);
            let cx = x as f32 + map(reg, 0, pos);
            let cy = y as f32 + map(reg, 1, pos);
            let (bw, bh) = (map(wh, 0, pos), map(wh, 1, pos));
            out.extend_from_slice(&[cx - bw / 2.0, cy - bh / 2.0, cx + bw / 2.0, cy + bh / 2.0, score, cls as f32]);
        }
    }
    Ok(HostTensor::new(out_shape, out))
}

kiln::inventory::submit! {
    CustomOp { name: "centernet_decode", infer_shape: decode_shape, cpu: decode_cpu }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(k: f64) -> Attrs {
        [("k".to_string(), k)].into_iter().collect()
    }

    #[test]
    fn decode_picks_peaks_with_boxes() {
        // One class, 4x4 map: peaks at (x=1, y=1) logit 3 and (x=3, y=3) logit 1; (x=2, y=1) is a
        // neighbour of the first peak and must be suppressed although its score is second best.
        let mut hm = vec![-4.0f32; 16];
        hm[5] = 3.0;
        hm[6] = 2.0;
        hm[15] = 1.0;
        let hm = HostTensor::new(vec![1, 1, 4, 4], hm);
        let mut wh = vec![0.0f32; 32];
        wh[5] = 2.0; // width at (1, 1)
        wh[16 + 5] = 4.0; // height at (1, 1)
        let wh = HostTensor::new(vec![1, 2, 4, 4], wh);
        let mut reg = vec![0.0f32; 32];
        reg[5] = 0.25;
        reg[16 + 5] = 0.5;
        let reg = HostTensor::new(vec![1, 2, 4, 4], reg);
        let out = decode_cpu(&attrs(2.0), &[&hm, &wh, &reg]).expect("decode");
        assert_eq!(out.shape, [1, 2, 6]);
        assert_eq!(&out.data[..6], &[1.25 - 1.0, 1.5 - 2.0, 1.25 + 1.0, 1.5 + 2.0, sigmoid(3.0), 0.0]);
        assert_eq!(&out.data[6..], &[3.0, 3.0, 3.0, 3.0, sigmoid(1.0), 0.0]);
    }

    #[test]
    fn ties_go_to_the_lower_flat_index_across_classes() {
        // Two classes with identical isolated peaks: class 0's comes first; then the zeros of
        // suppressed positions, lowest index first.
        let mut hm = vec![-9.0f32; 2 * 9];
        hm[4] = 1.0;
        hm[9 + 4] = 1.0;
        let hm = HostTensor::new(vec![1, 2, 3, 3], hm);
        let zeros = HostTensor::zeros(vec![1, 2, 3, 3]);
        let out = decode_cpu(&attrs(3.0), &[&hm, &zeros, &zeros]).expect("decode");
        let classes: Vec<f32> = out.data.chunks(6).map(|r| r[5]).collect();
        assert_eq!(classes, [0.0, 1.0, 0.0]);
        assert_eq!(out.data[2 * 6 + 4], 0.0, "third pick is a suppressed position");
        assert_eq!(&out.data[2 * 6..2 * 6 + 2], &[0.0, 0.0], "lowest index: (0, 0) of class 0");
    }

    #[test]
    fn bad_inputs_are_shape_errors() {
        let hm = [1, 3, 8, 8];
        assert!(decode_shape(&attrs(100.0), &[&hm, &[1, 2, 8, 8], &[1, 2, 8, 8]]).is_ok());
        assert!(decode_shape(&Attrs::new(), &[&hm, &[1, 2, 8, 8], &[1, 2, 8, 8]]).is_ok(), "k defaults to 100");
        let err = decode_shape(&attrs(10.0), &[&hm, &[1, 2, 8, 4], &[1, 2, 8, 8]]).unwrap_err();
        assert!(err.contains("wh"), "{err}");
        assert!(decode_shape(&attrs(500.0), &[&hm, &[1, 2, 8, 8], &[1, 2, 8, 8]]).unwrap_err().contains("exceeds"));
        assert!(decode_shape(&attrs(2.5), &[&hm, &[1, 2, 8, 8], &[1, 2, 8, 8]]).unwrap_err().contains("positive integer"));
        assert!(decode_shape(&attrs(10.0), &[&hm, &[1, 2, 8, 8]]).unwrap_err().contains("3 inputs"));
    }

    #[test]
    fn decode_is_registered() {
        assert!(kiln::plugin::lookup("centernet_decode").is_some());
    }
}

// ---- GPU converter: `centernet_decode` as an engine layer (kernels/decode.cu) -------------
// Registered like any user op's converter: through `kiln::register_converter!` and the public
// engine API only.

mod gpu {
    use super::k_attr;
    use kiln::plugin::{launch, CudaFunction, KArg};
    use kiln::plugin::{BuildCtx, Elem, Layer, RunCtx, ValueId};
    use kiln::Result;
    use kiln::{plugin::Op, NodeId};

    /// Constants of decode.cu: histogram bins, sweep block size, candidate list per image, keys
    /// sorted in shared memory, threads of the per-image kernels.
    const BINS: usize = 8192;
    const THREADS: usize = 256;
    const WARPS: usize = THREADS / 32;
    const CAP: usize = 65536;
    const SORT: usize = 4096;
    const FINAL_THREADS: u32 = 1024;

    /// The sweeps' grid: `(column blocks, strips, images)` and the strip height `R`. A thread
    /// walks one pixel column of `v` channels down `R` rows; `R` shrinks (to 1) until the grid
    /// fills the GPU (8 blocks of 256 threads per SM), so batch 1 gets as many blocks as rows.
    pub(super) fn sweep_grid(hwc: [usize; 3], v: usize, batch: usize, sm_count: usize) -> ((u32, u32, u32), usize) {
        let [h, w, c] = hwc;
        let xb = (w * (c / v)).div_ceil(THREADS);
        let mut r = 16;
        while r > 1 && xb * h.div_ceil(r) * batch < 8 * sm_count {
            r /= 2;
        }
        ((xb as u32, h.div_ceil(r) as u32, batch as u32), r)
    }

    pub struct DecodeLayer {
        path: String,
        clear: CudaFunction,
        threshold: CudaFunction,
        /// Scalar and 16-byte-vector variants of the two sweeps.
        hist: [CudaFunction; 2],
        collect: [CudaFunction; 2],
        fin: CudaFunction,
        hm: ValueId,
        wh: ValueId,
        reg: ValueId,
        out: ValueId,
        /// Per image: the logit-peak histogram, each sweep warp's largest logit, the threshold
        /// and candidate count, the candidate keys.
        hist_buf: ValueId,
        warp_max: ValueId,
        meta: ValueId,
        cand: ValueId,
        /// H, W, C of the heatmap.
        hwc: [usize; 3],
        /// Channels per 16-byte load.
        pack: usize,
        k: usize,
        sm_count: u32,
    }

    impl Layer for DecodeLayer {
        fn path(&self) -> &str {
            &self.path
        }
        fn kind(&self) -> String {
            format!("kernel:centernet_decode(k={})", self.k)
        }
        fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
            let [h, w, c] = self.hwc;
            // Images are the grid's z dimension (sweeps) or x dimension (per-image kernels).
            let n = u32::try_from(batch).ok().filter(|&b| b <= 65535).ok_or_else(|| kiln::Error::Binding {
                name: self.path.clone(),
                reason: format!("batch {batch} exceeds the decode's grid limit of 65535 images"),
            })?;
            let k = KArg::I32(self.k as i32);
            let hm_ptr = rt.ptr(self.hm);
            // 16-byte loads need whole packs per pixel and an aligned map.
            let vec = c.is_multiple_of(self.pack) && hm_ptr.is_multiple_of(16);
            let (v, which) = if vec { (self.pack, 1) } else { (1, 0) };
            let (grid, r) = sweep_grid(self.hwc, v, batch, self.sm_count as usize);
            let dims = [KArg::Ptr(hm_ptr), KArg::I32(h as i32), KArg::I32(w as i32), KArg::I32(c as i32)];
            let (hist, warp_max) = (KArg::Ptr(rt.ptr(self.hist_buf)), KArg::Ptr(rt.ptr(self.warp_max)));
            let (meta, cand) = (KArg::Ptr(rt.ptr(self.meta)), KArg::Ptr(rt.ptr(self.cand)));
            let block = (THREADS as u32, 1, 1);
            launch(rt, &self.clear, (n, 1, 1), (FINAL_THREADS, 1, 1), 0, &[hist])?;
            launch(rt, &self.hist[which], grid, block, 0, &[&dims[..], &[KArg::I32(r as i32), hist, warp_max]].concat())?;
            launch(rt, &self.threshold, (n, 1, 1), (FINAL_THREADS, 1, 1), 0, &[hist, k, meta])?;
            launch(rt, &self.collect[which], grid, block, 0, &[&dims[..], &[KArg::I32(r as i32), k, warp_max, meta, cand]].concat())?;
            let args = [
                KArg::Ptr(hm_ptr),
                KArg::Ptr(rt.ptr(self.wh)),
                KArg::Ptr(rt.ptr(self.reg)),
                KArg::I32(h as i32),
                KArg::I32(w as i32),
                KArg::I32(c as i32),
                k,
                meta,
                cand,
                KArg::Ptr(rt.ptr(self.out)),
            ];
            launch(rt, &self.fin, (n, 1, 1), (FINAL_THREADS, 1, 1), 0, &args)
        }
    }

    pub fn convert_decode(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        let Op::Custom(kiln::plugin::CustomCall { attrs, .. }) = &ctx.node(node).op else {
            return Err(ctx.err(node, kiln::LowerKind::Unsupported, "is not centernet_decode"));
        };
        let k = k_attr(attrs).map_err(|r| ctx.err(node, kiln::LowerKind::Operands, r))?;
        if k > SORT / 2 {
            return Err(ctx.err(
                node,
                kiln::LowerKind::Operands,
                format!("the GPU decode keeps at most {} detections per image, asked for k = {k}", SORT / 2),
            ));
        }
        let (hm, wh, reg, out) = (ctx.input(node, 0)?, ctx.input(node, 1)?, ctx.input(node, 2)?, ctx.output(node)?);
        let (dh, dwh, dreg) = (ctx.value(hm).clone(), ctx.value(wh).clone(), ctx.value(reg).clone());
        let Some((c, h, w)) = dh.chw() else {
            return Err(ctx.err(node, kiln::LowerKind::Unsupported, format!("hm must be [C, H, W], got {:?}", dh.dims)));
        };
        for (name, d) in [("hm", &dh), ("wh", &dwh), ("reg", &dreg)] {
            if !d.layout.is_channels_last() || d.elem != dh.elem {
                return Err(ctx.err(
                    node,
                    kiln::LowerKind::Unsupported,
                    format!("{name} must be an NHWC map of {:?}, got {:?} {:?}", dh.elem, d.layout, d.elem),
                ));
            }
        }
        if dwh.dims != [2, h, w] || dreg.dims != [2, h, w] {
            return Err(ctx.err(
                node,
                kiln::LowerKind::Unsupported,
                format!("wh and reg must be [2, {h}, {w}], got {:?} and {:?}", dwh.dims, dreg.dims),
            ));
        }
        if h * w * c >= i32::MAX as usize {
            return Err(ctx.err(node, kiln::LowerKind::TooLarge, format!("{c}x{h}x{w} candidates exceed the decode's 31-bit indices")));
        }
        if h > 65535 {
            return Err(ctx.err(
                node,
                kiln::LowerKind::TooLarge,
                format!("a heatmap of {h} rows exceeds the decode's grid limit of 65535"),
            ));
        }
        // Detections stay f32 in every precision: f16 would round a coordinate of 100 to 1/16.
        ctx.set_output_elem(Elem::F32)?;
        let (e, o) = (dh.elem.suffix(), ctx.value(out).elem.suffix());
        ctx.kernels.add_source("decode.cu", super::DECODE_CU)?;
        let get = |ctx: &BuildCtx, name: String| ctx.kernels.get(&name);
        let hist = [get(ctx, format!("decode_hist_{e}"))?, get(ctx, format!("decode_hist_{e}_vec"))?];
        let collect = [get(ctx, format!("decode_collect_{e}"))?, get(ctx, format!("decode_collect_{e}_vec"))?];
        let (clear, threshold) = (ctx.kernels.get("decode_clear")?, ctx.kernels.get("decode_threshold")?);
        let fin = get(ctx, format!("decode_final_{e}_{o}"))?;
        let pack = 16 / dh.elem.size();
        // Warps of the sweeps per image, at most (scalar loads, strips of one row).
        let warps = (w * c).div_ceil(THREADS) * h * WARPS;
        let hist_buf = ctx.scratch(BINS * 4);
        let warp_max = ctx.scratch(warps * 4);
        let meta = ctx.scratch(16);
        let cand = ctx.scratch(CAP * 8);
        Ok(Box::new(DecodeLayer {
            path: ctx.node(node).path.clone(),
            clear,
            threshold,
            hist,
            collect,
            fin,
            hm,
            wh,
            reg,
            out,
            hist_buf,
            warp_max,
            meta,
            cand,
            hwc: [h, w, c],
            pack,
            k,
            sm_count: ctx.kernels.sm_count(),
        }))
    }
}

kiln::register_converter!("centernet_decode", gpu::convert_decode);
