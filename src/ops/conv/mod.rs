//! Conv2d and ConvTranspose2d: layers, attributes, shape rules, CPU references, converters.

pub mod conv8;
mod cudnn;
pub mod depthwise;
pub mod im2col;
pub mod stem;
pub mod strided_gemm;
pub mod subpixel;

use crate::engine::layer::Chain;
use crate::engine::{Layer, Layout, ValueId};
use crate::error::OpError;
use crate::graph::{NodeId, Op, PoolAttrs};
use crate::module::{Forward, Module};
use crate::ops::pool::PoolKind;
use crate::ops::pool::{max_pool2d_cpu, pool2d_shape};
use crate::ops::BuildCtx;
use crate::ops::{pair_label, AtenImport, CpuArgs, LayoutPlan, NnLayer, OpDef};
use crate::tensor::{Param, Tensor};
use crate::var_builder::VarBuilder;
use crate::LowerKind;
use crate::Result;
use serde::{Deserialize, Serialize};

/// This family's layers, as `kiln::nn` shows them.
pub mod nn {
    pub use super::{Conv2d, Conv2dConfig, ConvTranspose2d};
}

/// The fused activation of a convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub enum Activation {
    #[default]
    None,
    Relu,
}

/// Convolution attributes. After fusion a conv may also carry a residual input (added before the
/// activation), an activation and a max-pool after it: `pool(act(conv(x, w) + b + residual))`.
/// Inputs: x, weight
/// (`[Cout, Cin/g, kh, kw]`, or `[Cin, Cout/g, kh, kw]` transposed), bias? `[Cout]`, residual?
/// (the output's shape; Conv2d only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConvAttrs {
    /// `ConvTranspose2d` rather than `Conv2d`.
    #[serde(default)]
    pub transposed: bool,
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
    /// Only for `ConvTranspose2d`.
    pub output_padding: [usize; 2],
    pub bias: bool,
    pub residual: bool,
    pub act: Activation,
    /// A `MaxPool2d` applied to the activation's output (conv → ReLU → max-pool, the ResNet stem);
    /// the node's shape is the pool's output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolAttrs>,
}

impl Default for ConvAttrs {
    fn default() -> Self {
        Self {
            transposed: false,
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
            output_padding: [0, 0],
            bias: false,
            residual: false,
            act: Activation::None,
            pool: None,
        }
    }
}

impl OpDef for ConvAttrs {
    fn name(&self) -> &str {
        if self.transposed {
            "conv_transpose2d"
        } else {
            "conv2d"
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
        let conv = if self.transposed { conv_transpose2d_shape(self, inputs)? } else { conv2d_shape(self, inputs)? };
        if self.transposed && self.pool.is_some() {
            return Err("a max-pool is fused after a Conv2d only, not a ConvTranspose2d".into());
        }
        match &self.pool {
            Some(p) => pool2d_shape(p, &[&conv]).map_err(|e| format!("the fused max-pool: {e}").into()),
            None => Ok(conv),
        }
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, OpError> {
        let inputs = args.all()?;
        let conv = if self.transposed { conv_transpose2d_cpu(self, &inputs)? } else { conv2d_cpu(self, &inputs)? };
        match &self.pool {
            Some(p) => max_pool2d_cpu(p, &conv),
            None => Ok(conv),
        }
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        LayoutPlan::all(inputs, Layout::channels_last(out_rank))
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        if self.transposed {
            gpu_conv_transpose2d(ctx, node, *self)
        } else {
            gpu_conv2d(ctx, node, *self)
        }
    }
    fn label(&self) -> String {
        let a = self;
        let mut s = self.name().to_string()
            + &pair_label("s", a.stride, 1)
            + &pair_label("p", a.padding, 0)
            + &pair_label("d", a.dilation, 1)
            + &pair_label("op", a.output_padding, 0);
        if a.groups != 1 {
            s += &format!(" g{}", a.groups);
        }
        for (on, part) in [(a.bias, " +bias"), (a.residual, " +add"), (a.act == Activation::Relu, " +relu")] {
            if on {
                s += part;
            }
        }
        if let Some(p) = &a.pool {
            s += &format!(" +max_pool{}", pair_label("k", p.kernel, 0) + &pair_label("s", p.stride, 1) + &pair_label("p", p.padding, 0));
        }
        s
    }
}

/// Options of `Conv2d` / `ConvTranspose2d`, with PyTorch's defaults (square kernels).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub kernel_size: usize,
    pub stride: usize,
    pub padding: usize,
    pub dilation: usize,
    pub groups: usize,
    pub bias: bool,
    /// `ConvTranspose2d` only.
    pub output_padding: usize,
}

impl Default for Conv2dConfig {
    fn default() -> Self {
        Self {
            in_channels: 1,
            out_channels: 1,
            kernel_size: 1,
            stride: 1,
            padding: 0,
            dilation: 1,
            groups: 1,
            bias: true,
            output_padding: 0,
        }
    }
}

impl Conv2dConfig {
    pub fn new(in_channels: usize, out_channels: usize, kernel_size: usize) -> Self {
        Self { in_channels, out_channels, kernel_size, ..Default::default() }
    }
    pub fn stride(self, stride: usize) -> Self {
        Self { stride, ..self }
    }
    pub fn padding(self, padding: usize) -> Self {
        Self { padding, ..self }
    }
    pub fn dilation(self, dilation: usize) -> Self {
        Self { dilation, ..self }
    }
    pub fn groups(self, groups: usize) -> Self {
        Self { groups, ..self }
    }
    pub fn bias(self, bias: bool) -> Self {
        Self { bias, ..self }
    }
    pub fn output_padding(self, output_padding: usize) -> Self {
        Self { output_padding, ..self }
    }
    fn attrs(&self, transposed: bool) -> ConvAttrs {
        ConvAttrs {
            transposed,
            stride: [self.stride; 2],
            padding: [self.padding; 2],
            dilation: [self.dilation; 2],
            groups: self.groups,
            output_padding: [self.output_padding; 2],
            bias: self.bias,
            ..Default::default()
        }
    }
}

/// `torch.nn.Conv2d`: parameters `weight` `[out, in/groups, k, k]` and `bias` `[out]`.
#[derive(Clone, Debug)]
pub struct Conv2d {
    pub path: String,
    pub weight: Param,
    pub bias: Option<Param>,
    pub attrs: ConvAttrs,
}

impl Module for Conv2d {
    type Config = Conv2dConfig;
    fn load(vb: VarBuilder, c: &Conv2dConfig) -> Result<Self> {
        let weight = vb.get(&[c.out_channels, c.in_channels / c.groups.max(1), c.kernel_size, c.kernel_size], "weight")?;
        let bias = if c.bias { Some(vb.get(&[c.out_channels], "bias")?) } else { None };
        Ok(Self { path: vb.path().to_string(), weight, bias, attrs: c.attrs(false) })
    }
}

impl Forward for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let params: Vec<&Param> = std::iter::once(&self.weight).chain(&self.bias).collect();
        Tensor::record(&self.path, Op::Conv(self.attrs), &[x], &params)
    }
}

/// `torch.nn.ConvTranspose2d`: parameters `weight` `[in, out/groups, k, k]` and `bias` `[out]`.
#[derive(Clone, Debug)]
pub struct ConvTranspose2d {
    pub path: String,
    pub weight: Param,
    pub bias: Option<Param>,
    pub attrs: ConvAttrs,
}

impl Module for ConvTranspose2d {
    type Config = Conv2dConfig;
    fn load(vb: VarBuilder, c: &Conv2dConfig) -> Result<Self> {
        let weight = vb.get(&[c.in_channels, c.out_channels / c.groups.max(1), c.kernel_size, c.kernel_size], "weight")?;
        let bias = if c.bias { Some(vb.get(&[c.out_channels], "bias")?) } else { None };
        Ok(Self { path: vb.path().to_string(), weight, bias, attrs: c.attrs(true) })
    }
}

impl Forward for ConvTranspose2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let params: Vec<&Param> = std::iter::once(&self.weight).chain(&self.bias).collect();
        Tensor::record(&self.path, Op::Conv(self.attrs), &[x], &params)
    }
}

/// This family's `kiln::nn` layers, each traced on an input (for `ops::completeness`).
#[doc(hidden)]
pub const NN_LAYERS: &[NnLayer] = &[
    ("Conv2d", |vb, t| nn::Conv2d::load(vb, &nn::Conv2dConfig::new(3, 4, 3))?.forward(&t.input("x", &[1, 3, 8, 8]))),
    ("ConvTranspose2d", |vb, t| nn::ConvTranspose2d::load(vb, &nn::Conv2dConfig::new(3, 4, 3))?.forward(&t.input("x", &[1, 3, 8, 8]))),
];

/// The ATen ops kiln-torch imports as this family's ops (1-D convolutions as 2-D ones of height 1).
#[doc(hidden)]
pub const ATEN: &[AtenImport] = &[
    ("conv2d", &["aten.conv2d.default", "aten.conv2d.padding", "aten.conv1d.default", "aten.conv1d.padding", "aten.convolution.default"]),
    ("conv_transpose2d", &["aten.conv_transpose2d.input", "aten.conv_transpose1d.default", "aten.convolution.default"]),
];

/// Sizes come from files: every step is checked, and `None` covers overflow as well as a kernel
/// larger than the padded input.
pub(crate) fn out_extent(input: usize, k: usize, s: usize, p: usize, d: usize) -> Option<usize> {
    let span = d.checked_mul(k.checked_sub(1)?)?.checked_add(1)?;
    input.checked_add(p.checked_mul(2)?)?.checked_sub(span).map(|v| v / s + 1)
}

/// A transposed convolution's output extent, checked like `out_extent`.
fn transposed_extent(input: usize, k: usize, s: usize, p: usize, d: usize, out_pad: usize) -> Option<usize> {
    (input - 1).checked_mul(s)?.checked_add(d.checked_mul(k - 1)?)?.checked_add(out_pad)?.checked_add(1)?.checked_sub(p.checked_mul(2)?)
}

fn check_common(a: &ConvAttrs, inputs: &[&[usize]], kind: &str) -> Result<(), OpError> {
    let want = 2 + a.bias as usize + a.residual as usize;
    if inputs.len() != want {
        return Err(format!(
            "{kind} expects {want} inputs (x, weight{}{}), got {}",
            if a.bias { ", bias" } else { "" },
            if a.residual { ", residual" } else { "" },
            inputs.len()
        )
        .into());
    }
    if inputs[0].len() != 4 {
        return Err(format!("input must be NCHW (rank 4), got {:?}", inputs[0]).into());
    }
    if inputs[1].len() != 4 {
        return Err(format!("weight must be rank 4, got {:?}", inputs[1]).into());
    }
    if inputs[0][1..].contains(&0) {
        return Err(format!("input {:?} is empty", inputs[0]).into());
    }
    // The extent rules subtract 1 from the kernel size.
    if inputs[1][2..].contains(&0) {
        return Err(format!("kernel size must be positive, got weight {:?}", inputs[1]).into());
    }
    if a.groups == 0 || a.stride.contains(&0) || a.dilation.contains(&0) {
        return Err("groups, stride and dilation must be positive".into());
    }
    Ok(())
}

/// Output shape of a convolution with `inputs` = x, weight, bias?, residual?.
pub fn conv2d_shape(a: &ConvAttrs, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    check_common(a, inputs, "conv2d")?;
    let (x, w) = (inputs[0], inputs[1]);
    if w[1].checked_mul(a.groups) != Some(x[1]) {
        let expects = w[1].checked_mul(a.groups).map_or("more than usize::MAX".into(), |c| c.to_string());
        return Err(format!("input has {} channels, but the weight {:?} with groups={} expects {expects}", x[1], w, a.groups).into());
    }
    if w[0] % a.groups != 0 {
        return Err(format!("{} output channels are not divisible by groups={}", w[0], a.groups).into());
    }
    let ext = |i: usize| out_extent(x[2 + i], w[2 + i], a.stride[i], a.padding[i], a.dilation[i]);
    let (Some(h), Some(wd)) = (ext(0), ext(1)) else {
        return Err(format!("kernel {:?} (dilation {:?}) is larger than the padded input {:?}", &w[2..], a.dilation, &x[2..]).into());
    };
    let out = vec![x[0], w[0], h, wd];
    if a.bias && inputs[2] != [w[0]] {
        return Err(format!("bias must have shape [{}], got {:?}", w[0], inputs[2]).into());
    }
    if a.residual && inputs[inputs.len() - 1] != out.as_slice() {
        return Err(format!("residual must have the output's shape {out:?}, got {:?}", inputs[inputs.len() - 1]).into());
    }
    Ok(out)
}

/// Output shape of a transposed convolution with `inputs` = x, weight, bias?.
pub fn conv_transpose2d_shape(a: &ConvAttrs, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    check_common(a, inputs, "conv_transpose2d")?;
    let (x, w) = (inputs[0], inputs[1]);
    if x[1] != w[0] {
        return Err(format!("input has {} channels, but the weight {:?} expects {}", x[1], w, w[0]).into());
    }
    for i in 0..2 {
        if a.output_padding[i] >= a.stride[i].max(a.dilation[i]) {
            return Err(format!(
                "output_padding {:?} must be smaller than stride {:?} or dilation {:?}",
                a.output_padding, a.stride, a.dilation
            )
            .into());
        }
    }
    let ext = |i: usize| transposed_extent(x[2 + i], w[2 + i], a.stride[i], a.padding[i], a.dilation[i], a.output_padding[i]);
    let (Some(h), Some(wd)) = (ext(0), ext(1)) else {
        return Err(format!("padding {:?} is larger than the output, or the output overflows", a.padding).into());
    };
    let cout = w[1].checked_mul(a.groups).ok_or_else(|| format!("{} x {} groups output channels overflow", w[1], a.groups))?;
    if a.bias && inputs[2] != [cout] {
        return Err(format!("bias must have shape [{cout}], got {:?}", inputs[2]).into());
    }
    Ok(vec![x[0], cout, h, wd])
}

// ---- CPU reference

use crate::graph::HostTensor;

fn dims4(t: &HostTensor) -> [usize; 4] {
    [t.shape[0], t.shape[1], t.shape[2], t.shape[3]]
}

fn shapes_of<'a>(inputs: &[&'a HostTensor]) -> Vec<&'a [usize]> {
    inputs.iter().map(|t| t.shape.as_slice()).collect()
}

/// Applies a fused activation in place.
pub fn apply_activation(act: Activation, data: &mut [f32]) {
    match act {
        Activation::None => {}
        // Unary::Relu keeps NaN, as PyTorch's relu does (`f32::max` would turn it into 0).
        Activation::Relu => data.iter_mut().for_each(|v| *v = crate::ops::elementwise::Unary::Relu.apply(*v)),
    }
}

/// One spatial extent of im2col: for output index `o` the input index is `o * s + k * d - p`.
/// Returns the range of outputs whose input index lies inside `0..len`.
fn valid_range(out: usize, len: usize, s: usize, offset: isize) -> (usize, usize) {
    // Smallest o with o*s + offset >= 0, and smallest o with o*s + offset >= len.
    let first = |bound: isize| -> usize {
        let need = bound - offset;
        if need <= 0 {
            0
        } else {
            (need as usize).div_ceil(s)
        }
    };
    let lo = first(0).min(out);
    let hi = first(len as isize).min(out).max(lo);
    (lo, hi)
}

/// Unfolds one image's `c` channels into `col` [c·kh·kw, oh·ow], zeros where the window leaves the input.
#[allow(clippy::too_many_arguments)]
fn im2col(x: &[f32], c: usize, [h, w]: [usize; 2], [kh, kw]: [usize; 2], [oh, ow]: [usize; 2], a: &ConvAttrs, col: &mut [f32]) {
    let (s, p, d) = (a.stride, a.padding, a.dilation);
    let mut rows = col.chunks_exact_mut(oh * ow);
    for ci in 0..c {
        let plane = &x[ci * h * w..(ci + 1) * h * w];
        for ki in 0..kh {
            let off_y = (ki * d[0]) as isize - p[0] as isize;
            let (ylo, yhi) = valid_range(oh, h, s[0], off_y);
            for kj in 0..kw {
                let off_x = (kj * d[1]) as isize - p[1] as isize;
                let (xlo, xhi) = valid_range(ow, w, s[1], off_x);
                let row = rows.next().expect("im2col buffer holds c*kh*kw rows");
                for (oy, dst) in row.chunks_exact_mut(ow).enumerate() {
                    if oy < ylo || oy >= yhi {
                        dst.fill(0.0);
                        continue;
                    }
                    let src = &plane[(oy as isize * s[0] as isize + off_y) as usize * w..][..w];
                    dst[..xlo].fill(0.0);
                    dst[xhi..].fill(0.0);
                    // A tap that misses the input for every output column reads nothing (its
                    // first column would lie outside the row).
                    if xlo >= xhi {
                        continue;
                    }
                    let x0 = xlo as isize * s[1] as isize + off_x;
                    if s[1] == 1 {
                        dst[xlo..xhi].copy_from_slice(&src[x0 as usize..x0 as usize + (xhi - xlo)]);
                    } else {
                        for (k, v) in dst[xlo..xhi].iter_mut().enumerate() {
                            *v = src[x0 as usize + k * s[1]];
                        }
                    }
                }
            }
        }
    }
}

/// `c[m×n] += a[m×k] · b[k×n]`, each given by its row and column strides.
#[allow(clippy::too_many_arguments)]
fn gemm_acc(m: usize, k: usize, n: usize, a: &[f32], (rsa, csa): (usize, usize), b: &[f32], (rsb, csb): (usize, usize), c: &mut [f32]) {
    // The largest element each operand's strides can reach must be inside its slice.
    let reach = |rows: usize, cols: usize, rs: usize, cs: usize| (rows.max(1) - 1) * rs + (cols.max(1) - 1) * cs + 1;
    assert!(a.len() >= reach(m, k, rsa, csa) && b.len() >= reach(k, n, rsb, csb) && c.len() >= m * n, "gemm operands too small");
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    // SAFETY: the assertion above keeps every strided access inside the three slices, and `c`
    // is borrowed mutably so it cannot alias `a` or `b`.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            1.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        )
    }
}

/// A zeroed f32 buffer of `dims`' element count; `what` of that many elements is an error where
/// its bytes overflow (a graph whose numbers were tampered with), not an allocator's panic.
fn zeroed(what: &str, dims: &[usize]) -> Result<Vec<f32>, OpError> {
    let fits = crate::host_tensor::numel(dims).filter(|n| n.checked_mul(4).is_some_and(|b| b <= isize::MAX as usize));
    let n = fits.ok_or_else(|| OpError::from(format!("{what} of {dims:?} elements has more bytes than fit in memory")))?;
    Ok(vec![0.0; n])
}

/// Fills `out` [n, cout, plane] with the bias (per channel) plus the residual, the GEMM's starting value.
fn init_output(out: &mut [f32], cout: usize, plane: usize, bias: Option<&HostTensor>, residual: Option<&HostTensor>) {
    if let Some(r) = residual {
        out.copy_from_slice(&r.data);
    }
    if let Some(b) = bias {
        for (i, chunk) in out.chunks_exact_mut(plane).enumerate() {
            let v = b.data[i % cout];
            chunk.iter_mut().for_each(|o| *o += v);
        }
    }
}

/// `act(conv2d(x, w) + bias + residual)` with `inputs` = x, weight, bias?, residual?: im2col per image
/// and group, then one GEMM accumulating onto the bias and residual.
pub fn conv2d_cpu(a: &ConvAttrs, inputs: &[&HostTensor]) -> Result<HostTensor, OpError> {
    let out_shape = conv2d_shape(a, &shapes_of(inputs))?;
    let (x, w) = (inputs[0], inputs[1]);
    let bias = a.bias.then(|| inputs[2]);
    let residual = a.residual.then(|| inputs[inputs.len() - 1]);
    let [n, cin, h, wd] = dims4(x);
    let [cout, cin_g, kh, kw] = dims4(w);
    let [_, _, oh, ow] = [out_shape[0], out_shape[1], out_shape[2], out_shape[3]];
    let (g, plane) = (a.groups, oh * ow);
    let (cout_g, krows) = (cout / g, cin_g * kh * kw);

    let mut out = zeroed("the output", &out_shape)?;
    init_output(&mut out, cout, plane, bias, residual);
    // A 1×1 stride-1 unpadded conv reads the input itself as the GEMM's right operand.
    let direct = kh == 1 && kw == 1 && a.stride == [1, 1] && a.padding == [0, 0];
    let mut col = if direct { Vec::new() } else { zeroed("the im2col columns", &[cin_g, kh, kw, oh, ow])? };
    for b in 0..n {
        for gi in 0..g {
            let xg = &x.data[(b * cin + gi * cin_g) * h * wd..][..cin_g * h * wd];
            let rhs: &[f32] = if direct {
                xg
            } else {
                im2col(xg, cin_g, [h, wd], [kh, kw], [oh, ow], a, &mut col);
                &col
            };
            let wg = &w.data[gi * cout_g * krows..][..cout_g * krows];
            let c = &mut out[(b * cout + gi * cout_g) * plane..][..cout_g * plane];
            gemm_acc(cout_g, krows, plane, wg, (krows, 1), rhs, (plane, 1), c);
        }
    }
    apply_activation(a.act, &mut out);
    Ok(HostTensor::new(out_shape, out))
}

/// `act(conv_transpose2d(x, w) + bias + residual)` with `inputs` = x, weight [Cin, Cout/g, kh, kw],
/// bias?, residual?: per image and group one GEMM `Wᵀ·x` into columns, then col2im scatters them.
pub fn conv_transpose2d_cpu(a: &ConvAttrs, inputs: &[&HostTensor]) -> Result<HostTensor, OpError> {
    let out_shape = conv_transpose2d_shape(a, &shapes_of(inputs))?;
    let residual = a.residual.then(|| inputs[inputs.len() - 1]);
    if let Some(r) = residual {
        if r.shape != out_shape {
            return Err(format!("residual must have the output's shape {out_shape:?}, got {:?}", r.shape).into());
        }
    }
    let (x, w) = (inputs[0], inputs[1]);
    let bias = a.bias.then(|| inputs[2]);
    let [n, cin, h, wd] = dims4(x);
    let [_, cout_g, kh, kw] = dims4(w);
    let [_, cout, oh, ow] = [out_shape[0], out_shape[1], out_shape[2], out_shape[3]];
    let g = a.groups;
    if cin % g != 0 {
        return Err(format!("{cin} input channels are not divisible by groups={g}").into());
    }
    let (cin_g, in_plane, out_plane, krows) = (cin / g, h * wd, oh * ow, cout_g * kh * kw);
    let (s, p, d) = (a.stride, a.padding, a.dilation);

    let mut out = zeroed("the output", &out_shape)?;
    init_output(&mut out, cout, out_plane, bias, residual);
    let mut col = zeroed("the columns", &[cout_g, kh, kw, h, wd])?;
    for b in 0..n {
        for gi in 0..g {
            let xg = &x.data[(b * cin + gi * cin_g) * in_plane..][..cin_g * in_plane];
            let wg = &w.data[gi * cin_g * krows..][..cin_g * krows];
            col.fill(0.0);
            // col[r, j] = Σ_c w[c, r] · x[c, j]: the weight read transposed through its strides.
            gemm_acc(krows, cin_g, in_plane, wg, (1, krows), xg, (in_plane, 1), &mut col);
            let og = &mut out[(b * cout + gi * cout_g) * out_plane..][..cout_g * out_plane];
            for co in 0..cout_g {
                let dst = &mut og[co * out_plane..][..out_plane];
                for ki in 0..kh {
                    let off_y = (ki * d[0]) as isize - p[0] as isize;
                    for kj in 0..kw {
                        let off_x = (kj * d[1]) as isize - p[1] as isize;
                        let src = &col[((co * kh + ki) * kw + kj) * in_plane..][..in_plane];
                        for iy in 0..h {
                            let oy = iy as isize * s[0] as isize + off_y;
                            if oy < 0 || oy >= oh as isize {
                                continue;
                            }
                            let row = &mut dst[oy as usize * ow..][..ow];
                            for (ix, v) in src[iy * wd..][..wd].iter().enumerate() {
                                let ox = ix as isize * s[1] as isize + off_x;
                                if ox >= 0 && ox < ow as isize {
                                    row[ox as usize] += v;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    apply_activation(a.act, &mut out);
    Ok(HostTensor::new(out_shape, out))
}

// ---- GPU converter (engine::cudnn, engine::gemm)

/// Conv2d: every cuDNN algorithm (fused bias+residual+ReLU, or separate calls), and for a
/// 1×1 convolution also a cuBLASLt GEMM (strided-batched when the conv is strided); the fastest
/// on the device wins.
fn gpu_conv2d(ctx: &mut BuildCtx, node: NodeId, a: ConvAttrs) -> Result<Box<dyn Layer>> {
    let key = ctx.problem_key(node);
    if ctx.eight_bit.conv[node] {
        // Between 8-bit values of an INT8/FP8 engine: only the 8-bit kernel reads their codes. Its
        // problem is another than the same conv's in 16 bits (a Best build times both), and
        // another again where it writes FP16 rather than codes (fewer kernels apply).
        let key = format!("{key} 8-bit to {:?}", ctx.value(ctx.output(node)?).elem);
        let candidates = conv8::candidates(ctx, node, &a)?;
        return ctx.choose(&key, candidates);
    }
    let y = ctx.output(node)?;
    let Some(pool) = a.pool else {
        let candidates = conv2d_candidates(ctx, node, a, y)?;
        return ctx.choose(&key, candidates);
    };
    // Conv → ReLU → max-pool: Kiln's fused stem kernel where it applies, against the best conv
    // (into scratch) followed by the pooling kernel.
    let (x, out) = (ctx.value(ctx.input(node, 0)?).clone(), ctx.value(y).clone());
    let shapes: Vec<&[usize]> = ctx.node(node).inputs.iter().map(|&i| ctx.node(i).shape.as_slice()).collect();
    let conv_shape = conv2d_shape(&a, &shapes).map_err(|e| ctx.err(node, LowerKind::Operands, e))?;
    let mid = ctx.chain_scratch(conv_shape[1..].to_vec(), out.elem, x.layout);
    let inner = conv2d_candidates(ctx, node, ConvAttrs { pool: None, ..a }, mid)?;
    let conv = ctx.choose(&format!("{key} before its max-pool"), inner)?;
    let pool_layer = crate::ops::pool::pool_layer_between(ctx, node, PoolKind::Max, pool.window(), mid, y)?;
    let mut candidates: Vec<Box<dyn Layer>> = vec![Box::new(Chain { first: conv, second: pool_layer, mid: Some(mid) })];
    candidates.extend(stem::candidates(ctx, node, &a, &pool, [conv_shape[2], conv_shape[3]])?);
    ctx.choose(&key, candidates)
}

/// Every way to run the conv of `a` (no pool) into `y`: cuDNN's algorithms, and where they apply
/// cuBLASLt GEMMs (1×1), a strided GEMM (strided 1×1), im2col + GEMM (few input channels) and
/// Kiln's depthwise kernel.
fn conv2d_candidates(ctx: &mut BuildCtx, node: NodeId, a: ConvAttrs, y: ValueId) -> Result<Vec<Box<dyn Layer>>> {
    use crate::engine::gemm::{GemmLayer, GemmSpec};
    let (zeros, w) = (cudnn::zero_bias(ctx, node)?, ctx.weight(node, 1)?);
    let problem = cudnn::problem(ctx, node, &a, w, &zeros, y)?;
    let mut candidates = crate::engine::cudnn::conv_candidates_with(ctx, problem)?;
    let pointwise = w.shape[2..] == [1, 1] && a.stride == [1, 1] && a.padding == [0, 0] && a.groups == 1;
    if pointwise {
        let x = ctx.input(node, 0)?;
        let (_, h, wd) = ctx.chw(y, "output")?;
        let bias = if a.bias { Some(ctx.weight(node, 2)?.data.as_slice()) } else { None };
        let residual = if a.residual { Some(ctx.input(node, if a.bias { 3 } else { 2 })?) } else { None };
        let spec = GemmSpec { x, y, residual, rows_per_image: h * wd, weight: &w.data, bias, relu: a.act == Activation::Relu };
        candidates.push(Box::new(GemmLayer::new(ctx, spec)?));
        // An FP8 engine's quantised 1×1 conv also runs on e4m3 tensor cores (`ops::quant::fp8_gemm`).
        candidates.extend(crate::ops::quant::fp8_gemm::candidates(ctx, node, spec)?);
    }
    // A strided 1×1 (ResNet's downsample): one strided-batched GEMM over the output rows.
    if let [k, c, 1, 1] = w.shape[..] {
        let bias = if a.bias { Some(ctx.weight(node, 2)?.data.as_slice()) } else { None };
        candidates.extend(strided_gemm::candidate(ctx, node, &a, &w.data, [k, c, 1, 1], bias, y)?);
    }
    // Few input channels (the stem): im2col + GEMM competes too (`im2col` decides where it applies).
    if let [k, c, r, s] = w.shape[..] {
        let zeros;
        let bias = if a.bias {
            ctx.weight(node, 2)?.data.as_slice()
        } else {
            zeros = vec![0f32; k];
            zeros.as_slice()
        };
        let x = ctx.input(node, 0)?;
        candidates.extend(im2col::candidates(ctx, node, &a, &w.data, [k, c, r, s], bias, x, y, a.residual)?);
    }
    // Depthwise 3x3 / 5x5 (groups == channels): Kiln's own NHWC kernel competes too.
    candidates.extend(depthwise::candidate(ctx, node, &a, y)?);
    Ok(candidates)
}

/// ConvTranspose2d through cuDNN's backward-data (bias and ReLU in place after it), and as one
/// stride-1 convolution per output phase plus a depth-to-space (`subpixel`); timing picks.
fn gpu_conv_transpose2d(ctx: &mut BuildCtx, node: NodeId, a: ConvAttrs) -> Result<Box<dyn Layer>> {
    let key = ctx.problem_key(node);
    let (zeros, w) = (cudnn::zero_bias(ctx, node)?, ctx.weight(node, 1)?);
    let problem = cudnn::problem(ctx, node, &a, w, &zeros, ctx.output(node)?)?;
    let (weight_shape, bias) = (problem.weight_shape, problem.bias);
    let mut candidates = subpixel::candidates(ctx, node, &a, &w.data, weight_shape, bias)?;
    candidates.extend(crate::engine::cudnn::deconv_candidates(ctx, problem)?);
    ctx.choose(&key, candidates)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(transposed: bool, f: impl Fn(&mut ConvAttrs)) -> ConvAttrs {
        let mut a = ConvAttrs { transposed, ..ConvAttrs::default() };
        f(&mut a);
        a
    }

    #[test]
    fn attributes_from_a_file_that_overflow_are_errors() {
        let (x, w): (&[usize], &[usize]) = (&[1, 4, 8, 8], &[8, 4, 3, 3]);
        assert!(conv2d_shape(&attrs(false, |a| a.padding = [usize::MAX / 2 + 1, 1]), &[x, w]).is_err());
        assert!(conv2d_shape(&attrs(false, |a| a.dilation = [usize::MAX, 1]), &[x, w]).is_err());
        assert!(conv2d_shape(&attrs(false, |a| a.groups = usize::MAX), &[x, &[8, 2, 3, 3]]).is_err());
        let wt: &[usize] = &[4, 8, 3, 3];
        assert!(conv_transpose2d_shape(&attrs(true, |a| a.stride = [usize::MAX, 1]), &[x, wt]).is_err());
        assert!(conv_transpose2d_shape(&attrs(true, |a| a.groups = usize::MAX), &[x, wt]).is_err());
        assert_eq!(conv2d_shape(&ConvAttrs::default(), &[x, w]), Ok(vec![1, 8, 6, 6]));
    }
}
