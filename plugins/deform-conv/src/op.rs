//! The op itself: `torchvision.ops.deform_conv2d`'s attributes, shape rule and CPU reference, its
//! registrations with Kiln (`CustomOp` and the GPU converter of `gpu.rs`), and the traced API
//! (`DeformConv2d`, as `torchvision.ops.DeformConv2d`).
//!
//! A node of the op reads `[x, offset, mask?, weight, bias?]` (the attributes `mask` and `bias`
//! say which are present) with PyTorch's shapes:
//! - `x` `[N, Cin, H, W]`; `weight` `[Cout, Cin / groups, KH, KW]`; `bias` `[Cout]`;
//! - `offset` `[N, 2 * offset_groups * KH * KW, HO, WO]`: for offset group `g` and kernel tap
//!   `(i, j)`, channel `2 * (g * KH * KW + i * KW + j)` is the row shift `dy` and the next one the
//!   column shift `dx`;
//! - `mask` `[N, offset_groups * KH * KW, HO, WO]`: channel `g * KH * KW + i * KW + j` scales that
//!   tap's sample (DCNv2's modulation).
//!
//! `groups` and `offset_groups` follow from the shapes, as in torchvision. The output is
//! `[N, Cout, HO, WO]` with `HO = (H + 2 * pad_h - (dil_h * (KH - 1) + 1)) / stride_h + 1`.

use kiln::plugin::{Attrs, CustomOp};
use kiln::{
    plugin::{CustomCall, Op},
    HostTensor,
};
use kiln::{Error, Module, Param, Result, Tensor, VarBuilder};

/// The op's registered name (what `Tensor::custom` and the converter registry key on).
pub const OP: &str = "deform_conv2d";

/// The op's attributes, stored as the node's named scalars (`Attrs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeformAttrs {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    /// The node has a `mask` input (DCNv2); without one every tap has weight 1 (DCNv1).
    pub mask: bool,
    /// The node has a `bias` input.
    pub bias: bool,
}

impl Default for DeformAttrs {
    fn default() -> Self {
        Self { stride: [1, 1], padding: [0, 0], dilation: [1, 1], mask: false, bias: false }
    }
}

/// The attribute names, in `Attrs` (a node's `label` shows them in this order).
const KEYS: [&str; 8] = ["stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w", "mask", "bias"];

impl DeformAttrs {
    /// The node's attributes as `Tensor::custom` takes them.
    pub fn to_attrs(&self) -> Vec<(&'static str, f64)> {
        let v = [self.stride, self.padding, self.dilation].concat();
        let flags = [self.mask as usize, self.bias as usize];
        KEYS.iter().zip(v.iter().chain(&flags)).map(|(k, &v)| (*k, v as f64)).collect()
    }

    /// Reads and checks the attributes of a node (from a trace or an engine file).
    pub fn from_attrs(attrs: &Attrs) -> std::result::Result<Self, String> {
        let mut v = [0usize; 8];
        for (slot, key) in v.iter_mut().zip(KEYS) {
            let x = *attrs.get(key).ok_or_else(|| format!("attribute `{key}` is missing"))?;
            if !(x >= 0.0 && x.fract() == 0.0 && x <= i32::MAX as f64) {
                return Err(format!("attribute `{key}` must be a non-negative integer, got {x}"));
            }
            *slot = x as usize;
        }
        let a = Self {
            stride: [v[0], v[1]],
            padding: [v[2], v[3]],
            dilation: [v[4], v[5]],
            mask: flag(v[6], "mask")?,
            bias: flag(v[7], "bias")?,
        };
        if a.stride.contains(&0) || a.dilation.contains(&0) {
            return Err(format!("stride {:?} and dilation {:?} must be at least 1", a.stride, a.dilation));
        }
        Ok(a)
    }

    /// Input positions: `(mask, weight, bias)`; x is 0 and offset 1.
    pub fn positions(&self) -> (Option<usize>, usize, Option<usize>) {
        let weight = 2 + self.mask as usize;
        (self.mask.then_some(2), weight, self.bias.then_some(weight + 1))
    }
}

fn flag(v: usize, key: &str) -> std::result::Result<bool, String> {
    match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(format!("attribute `{key}` must be 0 or 1, got {v}")),
    }
}

/// Everything the shapes of one node determine: the CPU reference and the converter both work
/// from this, so they cannot disagree on the geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub n: usize,
    pub cin: usize,
    pub h: usize,
    pub w: usize,
    pub cout: usize,
    pub kh: usize,
    pub kw: usize,
    pub groups: usize,
    pub offset_groups: usize,
    pub ho: usize,
    pub wo: usize,
    pub attrs: DeformAttrs,
}

impl Geometry {
    /// Kernel taps per offset group (`KH * KW`).
    pub fn taps(&self) -> usize {
        self.kh * self.kw
    }
}

fn dims4<'a>(name: &str, s: &'a [usize]) -> std::result::Result<&'a [usize], String> {
    if s.len() == 4 {
        Ok(s)
    } else {
        Err(format!("{name} must have 4 dims, got {s:?}"))
    }
}

/// The output size along one axis, `None` when the (dilated) kernel does not fit or a size overflows.
fn out_size(size: usize, k: usize, stride: usize, pad: usize, dil: usize) -> Option<usize> {
    let span = dil.checked_mul(k.checked_sub(1)?)?.checked_add(1)?;
    let padded = size.checked_add(pad.checked_mul(2)?)?;
    Some(padded.checked_sub(span)? / stride + 1)
}

/// The shape rule, with torchvision's checks: the geometry of a node from its input shapes, or
/// why they do not fit together.
pub fn geometry(attrs: &DeformAttrs, inputs: &[&[usize]]) -> std::result::Result<Geometry, String> {
    let (mask_at, weight_at, bias_at) = attrs.positions();
    let want = weight_at + 1 + attrs.bias as usize;
    if inputs.len() != want {
        return Err(format!(
            "expects {want} inputs (x, offset{}, weight{}), got {}",
            if attrs.mask { ", mask" } else { "" },
            if attrs.bias { ", bias" } else { "" },
            inputs.len()
        ));
    }
    let x = dims4("input", inputs[0])?;
    let offset = dims4("offset", inputs[1])?;
    let weight = dims4("weight", inputs[weight_at])?;
    let (n, cin, h, w) = (x[0], x[1], x[2], x[3]);
    let (cout, cin_g, kh, kw) = (weight[0], weight[1], weight[2], weight[3]);
    if [n, cin, h, w, cout, cin_g, kh, kw].contains(&0) {
        return Err(format!("input {x:?} and weight {weight:?} must have no empty dims"));
    }
    if cin % cin_g != 0 {
        return Err(format!("input channels {cin} are not a multiple of the weight's {cin_g} per group (weight {weight:?})"));
    }
    let groups = cin / cin_g;
    if cout % groups != 0 {
        return Err(format!("output channels {cout} are not a multiple of the {groups} groups (weight {weight:?})"));
    }
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let [dh, dw] = attrs.dilation;
    let (Some(ho), Some(wo)) = (out_size(h, kh, sh, ph, dh), out_size(w, kw, sw, pw, dw)) else {
        return Err(format!(
            "the {kh}x{kw} kernel (dilation {:?}, padding {:?}) does not fit the {h}x{w} input",
            attrs.dilation, attrs.padding
        ));
    };
    let taps = kh.checked_mul(kw).ok_or_else(|| format!("kernel {kh}x{kw} is too large"))?;
    let per_group = taps * 2;
    if offset[1] == 0 || offset[1] % per_group != 0 {
        return Err(format!("offset channels {} must be a positive multiple of 2 * {kh} * {kw} = {per_group}", offset[1]));
    }
    let offset_groups = offset[1] / per_group;
    if cin % offset_groups != 0 {
        return Err(format!("input channels {cin} are not a multiple of the {offset_groups} offset groups"));
    }
    let want_offset = [n, offset[1], ho, wo];
    if offset != want_offset {
        return Err(format!("offset must be {want_offset:?} for input {x:?} and weight {weight:?}, got {offset:?}"));
    }
    if let Some(i) = mask_at {
        let want_mask = [n, offset_groups * taps, ho, wo];
        if inputs[i] != want_mask {
            return Err(format!("mask must be {want_mask:?} for {offset_groups} offset group(s), got {:?}", inputs[i]));
        }
    }
    if let Some(i) = bias_at {
        if inputs[i] != [cout] {
            return Err(format!("bias must be [{cout}], got {:?}", inputs[i]));
        }
    }
    Ok(Geometry { n, cin, h, w, cout, kh, kw, groups, offset_groups, ho, wo, attrs: *attrs })
}

fn shape_rule(attrs: &Attrs, inputs: &[&[usize]]) -> std::result::Result<Vec<usize>, String> {
    let g = geometry(&DeformAttrs::from_attrs(attrs)?, inputs)?;
    Ok(vec![g.n, g.cout, g.ho, g.wo])
}

/// Bilinear sample of one `[H, W]` plane at `(y, x)`, zero outside, exactly as torchvision's
/// `bilinear_interpolate`: nothing beyond one pixel outside, and each of the four corners
/// contributes only where it lies inside the plane.
pub fn bilinear(plane: &[f32], h: usize, w: usize, y: f32, x: f32) -> f32 {
    if y <= -1.0 || h as f32 <= y || x <= -1.0 || w as f32 <= x {
        return 0.0;
    }
    let (y0, x0) = (y.floor(), x.floor());
    let (ly, lx) = (y - y0, x - x0);
    let (hy, hx) = (1.0 - ly, 1.0 - lx);
    let (y0, x0) = (y0 as i64, x0 as i64);
    let at = |yy: i64, xx: i64| {
        if yy >= 0 && xx >= 0 && (yy as usize) < h && (xx as usize) < w {
            plane[yy as usize * w + xx as usize]
        } else {
            0.0
        }
    };
    let (v1, v2, v3, v4) = (at(y0, x0), at(y0, x0 + 1), at(y0 + 1, x0), at(y0 + 1, x0 + 1));
    hy * hx * v1 + hy * lx * v2 + ly * hx * v3 + ly * lx * v4
}

/// The CPU reference, torchvision's algorithm: per image, the deformable column matrix
/// `[Cin * KH * KW, HO * WO]` (row `c * KH * KW + i * KW + j`: channel `c` sampled at tap
/// `(i, j)` moved by its offset group's `(dy, dx)`, times its mask), then per group the GEMM with
/// the `[Cout / groups, Cin / groups * KH * KW]` weights, then the bias.
fn cpu(attrs: &Attrs, inputs: &[&HostTensor]) -> Result<HostTensor> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let g = DeformAttrs::from_attrs(attrs).and_then(|a| geometry(&a, &shapes)).map_err(|reason| Error::Shape {
        path: OP.into(),
        op: OP.into(),
        reason: reason.into(),
        got: shapes.iter().map(|s| s.to_vec()).collect(),
    })?;
    let (mask_at, weight_at, bias_at) = g.attrs.positions();
    let (x, offset, weight) = (inputs[0], inputs[1], inputs[weight_at]);
    let (taps, plane, pixels) = (g.taps(), g.h * g.w, g.ho * g.wo);
    let rows = g.cin * taps;
    let c_per_offset_group = g.cin / g.offset_groups;
    let (cin_g, cout_g) = (g.cin / g.groups, g.cout / g.groups);
    let mut out = vec![0f32; g.n * g.cout * pixels];
    let mut col = vec![0f32; rows * pixels];
    for b in 0..g.n {
        for c in 0..g.cin {
            let og = c / c_per_offset_group;
            let src = &x.data[(b * g.cin + c) * plane..][..plane];
            for (tap, (i, j)) in (0..g.kh).flat_map(|i| (0..g.kw).map(move |j| (i, j))).enumerate() {
                let ch = (b * g.offset_groups + og) * taps + tap;
                let dy = &offset.data[(2 * ch) * pixels..][..pixels];
                let dx = &offset.data[(2 * ch + 1) * pixels..][..pixels];
                let m = mask_at.map(|k| &inputs[k].data[ch * pixels..][..pixels]);
                let dst = &mut col[(c * taps + tap) * pixels..][..pixels];
                for oy in 0..g.ho {
                    // Integer base positions first, then the float offset, as torchvision does.
                    let by = (oy * g.attrs.stride[0] + i * g.attrs.dilation[0]) as i64 - g.attrs.padding[0] as i64;
                    for ox in 0..g.wo {
                        let bx = (ox * g.attrs.stride[1] + j * g.attrs.dilation[1]) as i64 - g.attrs.padding[1] as i64;
                        let p = oy * g.wo + ox;
                        let v = bilinear(src, g.h, g.w, by as f32 + dy[p], bx as f32 + dx[p]);
                        dst[p] = m.map_or(1.0, |m| m[p]) * v;
                    }
                }
            }
        }
        for grp in 0..g.groups {
            let k = cin_g * taps;
            let a = &weight.data[grp * cout_g * k..][..cout_g * k];
            let bmat = &col[grp * k * pixels..][..k * pixels];
            let cmat = &mut out[(b * g.cout + grp * cout_g) * pixels..][..cout_g * pixels];
            // SAFETY: `a` is `[cout_g, k]`, `bmat` `[k, pixels]` and `cmat` `[cout_g, pixels]`,
            // all row-major and in bounds (the slices above have exactly these lengths).
            unsafe {
                matrixmultiply::sgemm(
                    cout_g,
                    k,
                    pixels,
                    1.0,
                    a.as_ptr(),
                    k as isize,
                    1,
                    bmat.as_ptr(),
                    pixels as isize,
                    1,
                    0.0,
                    cmat.as_mut_ptr(),
                    pixels as isize,
                    1,
                );
            }
        }
        if let Some(k) = bias_at {
            for (co, &bias) in inputs[k].data.iter().enumerate() {
                out[(b * g.cout + co) * pixels..][..pixels].iter_mut().for_each(|v| *v += bias);
            }
        }
    }
    Ok(HostTensor::new(vec![g.n, g.cout, g.ho, g.wo], out))
}

// The registrations: the op (shape rule + CPU reference) and its GPU converter, by name. Kept in
// the module of `DeformConv2d::forward`, which every user of the op calls, so that the linker
// keeps them wherever the op is used.
kiln::inventory::submit! {
    CustomOp { name: OP, infer_shape: shape_rule, cpu }
}
kiln::register_converter!(OP, crate::gpu::convert);

// ---- the traced API ---------------------------------------------------------------------------

/// `torchvision.ops.DeformConv2d`'s arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeformConv2dConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub kernel_size: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
    pub bias: bool,
}

impl DeformConv2dConfig {
    /// A square `k`×`k` kernel, stride 1, no padding, one group, with a bias (torchvision's defaults).
    pub fn new(in_channels: usize, out_channels: usize, k: usize) -> Self {
        Self { in_channels, out_channels, kernel_size: [k, k], stride: [1, 1], padding: [0, 0], dilation: [1, 1], groups: 1, bias: true }
    }
    pub fn kernel_hw(mut self, kh: usize, kw: usize) -> Self {
        self.kernel_size = [kh, kw];
        self
    }
    pub fn stride(mut self, s: usize) -> Self {
        self.stride = [s, s];
        self
    }
    pub fn stride_hw(mut self, sh: usize, sw: usize) -> Self {
        self.stride = [sh, sw];
        self
    }
    pub fn padding(mut self, p: usize) -> Self {
        self.padding = [p, p];
        self
    }
    pub fn padding_hw(mut self, ph: usize, pw: usize) -> Self {
        self.padding = [ph, pw];
        self
    }
    pub fn dilation(mut self, d: usize) -> Self {
        self.dilation = [d, d];
        self
    }
    pub fn dilation_hw(mut self, dh: usize, dw: usize) -> Self {
        self.dilation = [dh, dw];
        self
    }
    pub fn groups(mut self, g: usize) -> Self {
        self.groups = g;
        self
    }
    pub fn bias(mut self, b: bool) -> Self {
        self.bias = b;
        self
    }
}

/// `torchvision.ops.DeformConv2d`: parameters `weight` `[out, in / groups, kh, kw]` and `bias`
/// `[out]`; `forward(x, offset, mask)` takes the offsets (and the optional DCNv2 mask) as
/// tensors, so any module may compute them (CenterNet's DCN predicts them with a 3×3 conv).
#[derive(Clone, Debug)]
pub struct DeformConv2d {
    pub path: String,
    pub weight: Param,
    pub bias: Option<Param>,
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
}

impl Module for DeformConv2d {
    type Config = DeformConv2dConfig;
    fn load(vb: VarBuilder, c: &DeformConv2dConfig) -> Result<Self> {
        if c.groups == 0 || !c.in_channels.is_multiple_of(c.groups) || !c.out_channels.is_multiple_of(c.groups) {
            return Err(Error::Config {
                reason: format!(
                    "{}: in_channels {} and out_channels {} must be multiples of groups {}",
                    vb.path(),
                    c.in_channels,
                    c.out_channels,
                    c.groups
                ),
            });
        }
        let [kh, kw] = c.kernel_size;
        let weight = vb.get(&[c.out_channels, c.in_channels / c.groups, kh, kw], "weight")?;
        let bias = if c.bias { Some(vb.get(&[c.out_channels], "bias")?) } else { None };
        Ok(Self { path: vb.path().to_string(), weight, bias, stride: c.stride, padding: c.padding, dilation: c.dilation })
    }
}

impl DeformConv2d {
    /// `torchvision.ops.deform_conv2d(x, offset, weight, bias, stride, padding, dilation, mask)`,
    /// recorded as one `deform_conv2d` node at this module's path.
    pub fn forward(&self, x: &Tensor, offset: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let attrs = DeformAttrs {
            stride: self.stride,
            padding: self.padding,
            dilation: self.dilation,
            mask: mask.is_some(),
            bias: self.bias.is_some(),
        };
        let call = CustomCall { name: OP.to_string(), attrs: attrs.to_attrs().into_iter().map(|(k, v)| (k.to_string(), v)).collect() };
        let inputs: Vec<&Tensor> = [x, offset].into_iter().chain(mask).collect();
        let params: Vec<&Param> = std::iter::once(&self.weight).chain(&self.bias).collect();
        Tensor::record(&self.path, Op::Custom(call), &inputs, &params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(mask: bool, bias: bool) -> DeformAttrs {
        DeformAttrs { stride: [2, 1], padding: [1, 0], dilation: [1, 2], mask, bias }
    }

    #[test]
    fn attributes_round_trip_and_are_checked() {
        let a = attrs(true, false);
        let map: Attrs = a.to_attrs().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        assert_eq!(DeformAttrs::from_attrs(&map), Ok(a));
        let mut bad = map.clone();
        bad.insert("stride_w".into(), 0.0);
        assert!(DeformAttrs::from_attrs(&bad).unwrap_err().contains("at least 1"));
        bad = map.clone();
        bad.insert("pad_h".into(), 1.5);
        assert!(DeformAttrs::from_attrs(&bad).unwrap_err().contains("pad_h"));
        bad = map.clone();
        bad.remove("dil_w");
        assert!(DeformAttrs::from_attrs(&bad).unwrap_err().contains("dil_w"));
        bad = map;
        bad.insert("mask".into(), 2.0);
        assert!(DeformAttrs::from_attrs(&bad).unwrap_err().contains("0 or 1"));
    }

    #[test]
    fn shape_rule_follows_torchvision() {
        // x [2, 6, 9, 11], weight [8, 3, 3, 2] (2 groups), 3 offset groups.
        // HO = (9 + 2 - 3) / 2 + 1 = 5, WO = (11 + 0 - 3) / 1 + 1 = 9.
        let x = [2, 6, 9, 11];
        let w = [8, 3, 3, 2];
        let (off, mask) = ([2, 3 * 2 * 6, 5, 9], [2, 3 * 6, 5, 9]);
        let g = geometry(&attrs(true, true), &[&x, &off, &mask, &w, &[8]]).expect("fits");
        assert_eq!((g.ho, g.wo, g.groups, g.offset_groups), (5, 9, 2, 3));
        let err = geometry(&attrs(true, true), &[&x, &[2, 36, 5, 8], &mask, &w, &[8]]).unwrap_err();
        assert!(err.contains("offset must be [2, 36, 5, 9]"), "{err}");
        let err = geometry(&attrs(true, true), &[&x, &off, &[2, 12, 5, 9], &w, &[8]]).unwrap_err();
        assert!(err.contains("mask must be"), "{err}");
        let err = geometry(&attrs(true, true), &[&x, &[2, 30, 5, 9], &mask, &w, &[8]]).unwrap_err();
        assert!(err.contains("multiple of 2 * 3 * 2"), "{err}");
        let err = geometry(&attrs(false, false), &[&x, &off, &[7, 4, 3, 2]]).unwrap_err();
        assert!(err.contains("not a multiple"), "{err}");
        let err = geometry(&attrs(false, true), &[&x, &off, &w]).unwrap_err();
        assert!(err.contains("expects 4 inputs"), "{err}");
        let err = geometry(&attrs(false, false), &[&[1, 6, 1, 1], &off, &w]).unwrap_err();
        assert!(err.contains("does not fit"), "{err}");
    }

    /// With zero offsets and no mask, the op is an ordinary convolution: checked against a
    /// direct loop over taps (which knows nothing of columns or bilinear sampling).
    #[test]
    fn zero_offsets_give_a_plain_convolution() {
        let (n, cin, h, w, cout, k) = (2, 4, 6, 7, 6, 3);
        let a = DeformAttrs { stride: [1, 2], padding: [1, 1], dilation: [2, 1], mask: false, bias: true };
        let groups = 2;
        let x = kiln::dev::weight("t.x", &[n, cin, h, w]);
        let wt = kiln::dev::weight("t.weight", &[cout, cin / groups, k, k]);
        let bias = kiln::dev::weight("t.bias", &[cout]);
        let g = geometry(&a, &[&x.shape, &[n, 2 * k * k, 4, 4], &wt.shape, &bias.shape]).expect("geometry");
        let offset = HostTensor::zeros(vec![n, 2 * k * k, g.ho, g.wo]);
        let map: Attrs = a.to_attrs().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        let got = cpu(&map, &[&x, &offset, &wt, &bias]).expect("cpu");
        let (cin_g, cout_g) = (cin / groups, cout / groups);
        let mut max_err = 0f32;
        for b in 0..n {
            for co in 0..cout {
                for oy in 0..g.ho {
                    for ox in 0..g.wo {
                        let mut s = bias.data[co];
                        for ci in 0..cin_g {
                            let c = co / cout_g * cin_g + ci;
                            for i in 0..k {
                                for j in 0..k {
                                    let y = (oy + i * 2) as i64 - 1;
                                    let xx = (ox * 2 + j) as i64 - 1;
                                    if y >= 0 && xx >= 0 && (y as usize) < h && (xx as usize) < w {
                                        s += wt.data[((co * cin_g + ci) * k + i) * k + j]
                                            * x.data[((b * cin + c) * h + y as usize) * w + xx as usize];
                                    }
                                }
                            }
                        }
                        let v = got.data[((b * cout + co) * g.ho + oy) * g.wo + ox];
                        max_err = max_err.max((v - s).abs());
                    }
                }
            }
        }
        println!("zero offsets vs direct convolution: max abs {max_err:.2e}");
        assert!(max_err < 1e-5, "max abs {max_err}");
    }

    #[test]
    fn bilinear_matches_torchvision_at_the_borders() {
        // A 2x3 plane; samples inside, between pixels, half outside and fully outside.
        let p = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0];
        assert_eq!(bilinear(&p, 2, 3, 1.0, 2.0), 32.0);
        assert_eq!(bilinear(&p, 2, 3, 0.5, 0.5), (1.0 + 2.0 + 8.0 + 16.0) / 4.0);
        // Half a pixel above the plane: only the bottom corners (row 0) count, weighted 0.5.
        assert_eq!(bilinear(&p, 2, 3, -0.5, 1.0), 0.5 * 2.0);
        // Past the last column but within one pixel: the left corners count.
        assert_eq!(bilinear(&p, 2, 3, 0.0, 2.25), 0.75 * 4.0);
        for (y, x) in [(-1.0, 0.0), (2.0, 0.0), (0.0, -1.0), (0.0, 3.0), (-7.5, 9.0)] {
            assert_eq!(bilinear(&p, 2, 3, y, x), 0.0, "({y}, {x}) is outside");
        }
    }
}
