//! Conv2d and ConvTranspose2d: layers, shape rules, CPU references.

use crate::graph::{ConvAttrs, Op};
use crate::module::{Forward, Module};
use crate::tensor::{Param, Tensor};
use crate::var_builder::VarBuilder;
use crate::Result;

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
    fn attrs(&self) -> ConvAttrs {
        ConvAttrs {
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

/// `torch.nn.Conv2d`: parameters `weight` [out, in/groups, k, k] and `bias` [out].
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
        Ok(Self { path: vb.path().to_string(), weight, bias, attrs: c.attrs() })
    }
}

impl Forward for Conv2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let params: Vec<&Param> = std::iter::once(&self.weight).chain(&self.bias).collect();
        Tensor::record(&self.path, Op::Conv2d(self.attrs), &[x], &params)
    }
}

/// `torch.nn.ConvTranspose2d`: parameters `weight` [in, out/groups, k, k] and `bias` [out].
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
        Ok(Self { path: vb.path().to_string(), weight, bias, attrs: c.attrs() })
    }
}

impl Forward for ConvTranspose2d {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let params: Vec<&Param> = std::iter::once(&self.weight).chain(&self.bias).collect();
        Tensor::record(&self.path, Op::ConvTranspose2d(self.attrs), &[x], &params)
    }
}

fn out_extent(input: usize, k: usize, s: usize, p: usize, d: usize) -> Option<usize> {
    let span = d * (k - 1) + 1;
    (input + 2 * p).checked_sub(span).map(|v| v / s + 1)
}

fn check_common(a: &ConvAttrs, inputs: &[&[usize]], kind: &str) -> Result<(), String> {
    let want = 2 + a.bias as usize + a.residual as usize;
    if inputs.len() != want {
        return Err(format!(
            "{kind} expects {want} inputs (x, weight{}{}), got {}",
            if a.bias { ", bias" } else { "" },
            if a.residual { ", residual" } else { "" },
            inputs.len()
        ));
    }
    if inputs[0].len() != 4 {
        return Err(format!("input must be NCHW (rank 4), got {:?}", inputs[0]));
    }
    if inputs[1].len() != 4 {
        return Err(format!("weight must be rank 4, got {:?}", inputs[1]));
    }
    if inputs[0][1..].contains(&0) {
        return Err(format!("input {:?} is empty", inputs[0]));
    }
    if a.groups == 0 || a.stride.contains(&0) || a.dilation.contains(&0) {
        return Err("groups, stride and dilation must be positive".into());
    }
    Ok(())
}

/// Output shape of a convolution with `inputs` = x, weight, bias?, residual?.
pub fn conv2d_shape(a: &ConvAttrs, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
    check_common(a, inputs, "conv2d")?;
    let (x, w) = (inputs[0], inputs[1]);
    if x[1] != w[1] * a.groups {
        return Err(format!("input has {} channels, but the weight {:?} with groups={} expects {}", x[1], w, a.groups, w[1] * a.groups));
    }
    if w[0] % a.groups != 0 {
        return Err(format!("{} output channels are not divisible by groups={}", w[0], a.groups));
    }
    let ext = |i: usize| out_extent(x[2 + i], w[2 + i], a.stride[i], a.padding[i], a.dilation[i]);
    let (Some(h), Some(wd)) = (ext(0), ext(1)) else {
        return Err(format!("kernel {:?} (dilation {:?}) is larger than the padded input {:?}", &w[2..], a.dilation, &x[2..]));
    };
    let out = vec![x[0], w[0], h, wd];
    if a.bias && inputs[2] != [w[0]] {
        return Err(format!("bias must have shape [{}], got {:?}", w[0], inputs[2]));
    }
    if a.residual && inputs[inputs.len() - 1] != out.as_slice() {
        return Err(format!("residual must have the output's shape {out:?}, got {:?}", inputs[inputs.len() - 1]));
    }
    Ok(out)
}

/// Output shape of a transposed convolution with `inputs` = x, weight, bias?.
pub fn conv_transpose2d_shape(a: &ConvAttrs, inputs: &[&[usize]]) -> Result<Vec<usize>, String> {
    check_common(a, inputs, "conv_transpose2d")?;
    let (x, w) = (inputs[0], inputs[1]);
    if x[1] != w[0] {
        return Err(format!("input has {} channels, but the weight {:?} expects {}", x[1], w, w[0]));
    }
    for i in 0..2 {
        if a.output_padding[i] >= a.stride[i].max(a.dilation[i]) {
            return Err(format!(
                "output_padding {:?} must be smaller than stride {:?} or dilation {:?}",
                a.output_padding, a.stride, a.dilation
            ));
        }
    }
    let ext =
        |i: usize| ((x[2 + i] - 1) * a.stride[i] + a.dilation[i] * (w[2 + i] - 1) + a.output_padding[i] + 1).checked_sub(2 * a.padding[i]);
    let (Some(h), Some(wd)) = (ext(0), ext(1)) else {
        return Err(format!("padding {:?} is larger than the output", a.padding));
    };
    let cout = w[1] * a.groups;
    if a.bias && inputs[2] != [cout] {
        return Err(format!("bias must have shape [{cout}], got {:?}", inputs[2]));
    }
    Ok(vec![x[0], cout, h, wd])
}
