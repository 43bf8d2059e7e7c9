//! Quantisation ops: `quantize`, `dequantize` and their composition `fake_quantize` (a Q/DQ pair,
//! TensorRT's explicit-precision form and PyTorch's QAT op), per tensor or per channel, in two
//! 8-bit formats:
//!
//! - **int8** (affine, symmetric when the zero point is 0), PyTorch's arithmetic
//!   (`torch.fake_quantize_per_tensor_affine` / `..._per_channel_affine`, `torch.quantize_per_*`):
//!   `q = clamp(nearbyint(x · (1/scale)) + zp, qmin, qmax)` with `1/scale` in f32 and
//!   round-half-to-even; `dequantize(q) = (q − zp) · scale`.
//! - **fp8 e4m3** (`torch.float8_e4m3fn`, Hopper's FP8): `q = e4m3(clamp(x · (1/scale), ±448))`,
//!   rounded to nearest even with subnormals, saturating at ±448 (PyTorch's cast would give NaN
//!   past 480); `dequantize(q) = q · scale`.
//!
//! The graph is f32: a quantised value holds the integers (or e4m3 values) as f32, exactly. The
//! engine stores them in its activation type and runs these ops with `kernels/quant.cu` (`layers`); an 8-bit
//! layer reads the scales of the Q/DQ nodes around it (see `calibrate` for where they go).

pub mod fp8_gemm;
mod layers;

use crate::engine::{Layer, Layout};
use crate::error::OpError;
use crate::graph::{HostTensor, NodeId, Op};
use crate::module::{Forward, Module};
use crate::ops::BuildCtx;
use crate::ops::{one_input, AtenImport, CpuArgs, FixtureTwin, LayoutPlan, NnLayer, OpDef};
use crate::tensor::Tensor;
use crate::var_builder::VarBuilder;
use crate::Result;
use serde::{Deserialize, Serialize};

pub use crate::number_format::{encode_e4m3, round_e4m3, QuantFormat, E4M3_MAX};

/// This family's layers, as `kiln::nn` shows them.
pub mod nn {
    pub use super::{FakeQuantize, FakeQuantizeConfig};
}

/// Scales (and zero points) of a quantisation: one per tensor (`axis: None`), or one per index of
/// `axis` (a dim of the full NCHW shape, batch = 0; weights use their output-channel dim 0).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
pub struct QuantParams {
    pub format: QuantFormat,
    pub scale: Vec<f32>,
    /// Int8 zero points, one per scale; empty means all 0 (symmetric). Fp8 takes none.
    #[serde(default)]
    pub zero_point: Vec<i32>,
    pub axis: Option<usize>,
    /// Int8's integer range.
    pub qmin: i32,
    pub qmax: i32,
}

impl QuantParams {
    /// Symmetric int8 with one scale: `[-128, 127]`, zero point 0.
    pub fn int8(scale: f32) -> Self {
        Self { format: QuantFormat::Int8, scale: vec![scale], zero_point: vec![], axis: None, qmin: -128, qmax: 127 }
    }
    /// Symmetric fp8 e4m3 with one scale.
    pub fn fp8(scale: f32) -> Self {
        Self { format: QuantFormat::Fp8E4m3, scale: vec![scale], zero_point: vec![], axis: None, qmin: 0, qmax: 0 }
    }
    /// A symmetric quantisation in `format` with one scale.
    pub fn symmetric(format: QuantFormat, scale: f32) -> Self {
        match format {
            QuantFormat::Int8 => Self::int8(scale),
            QuantFormat::Fp8E4m3 => Self::fp8(scale),
        }
    }
    /// Per-channel scales along `axis` (same format and range).
    pub fn per_channel(mut self, axis: usize, scales: Vec<f32>) -> Self {
        self.axis = Some(axis);
        self.scale = scales;
        self
    }
    /// Int8 zero points (affine quantisation), one per scale.
    pub fn zero_points(mut self, zp: Vec<i32>) -> Self {
        self.zero_point = zp;
        self
    }
    /// Int8 range `[qmin, qmax]` (`0..=255` for quint8, `-127..=127` for TensorRT's narrow range).
    pub fn range(mut self, qmin: i32, qmax: i32) -> Self {
        (self.qmin, self.qmax) = (qmin, qmax);
        self
    }

    /// Whether all zero points are 0 (what the engine's 8-bit layers require).
    pub fn is_symmetric(&self) -> bool {
        self.zero_point.iter().all(|&z| z == 0)
    }

    /// The zero point of channel `c`.
    fn zp(&self, c: usize) -> i32 {
        self.zero_point.get(c).copied().unwrap_or(0)
    }

    /// Checks the parameters against an input shape: scales positive and finite, one per tensor
    /// or one per index of `axis`, zero points inside the range.
    pub fn check(&self, shape: &[usize]) -> Result<(), OpError> {
        let want = match self.axis {
            None => 1,
            Some(a) => *shape.get(a).ok_or_else(|| format!("axis {a} is out of range for shape {shape:?}"))?,
        };
        if self.scale.len() != want {
            let what = self.axis.map_or("per-tensor".to_string(), |a| format!("per-channel along axis {a} of {shape:?}"));
            return Err(format!("{what} quantisation needs {want} scale(s), got {}", self.scale.len()).into());
        }
        if let Some(s) = self.scale.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            return Err(format!("scales must be positive and finite, got {s}").into());
        }
        if let Some(Err(reason)) = self.scale.iter().map(|&s| crate::number_format::check_scale(s, self.format)).find(|r| r.is_err()) {
            return Err(OpError::Attribute(reason));
        }
        match self.format {
            QuantFormat::Int8 => {
                if self.qmin >= self.qmax {
                    return Err(format!("int8 range [{}, {}] is empty", self.qmin, self.qmax).into());
                }
                // 8 bits: [-128, 127] (qint8), [0, 255] (quint8) or a narrower range inside them.
                if self.qmin < -128 || self.qmax > 255 || self.qmax - self.qmin > 255 {
                    return Err(OpError::Attribute(format!(
                        "int8 range [{}, {}] is not 8 bits: it must lie within [-128, 127] or [0, 255]",
                        self.qmin, self.qmax
                    )));
                }
                if !self.zero_point.is_empty() && self.zero_point.len() != want {
                    return Err(format!("{} zero point(s) for {want} scale(s)", self.zero_point.len()).into());
                }
                if let Some(z) = self.zero_point.iter().find(|&&z| z < self.qmin || z > self.qmax) {
                    return Err(format!("zero point {z} is outside [{}, {}]", self.qmin, self.qmax).into());
                }
            }
            QuantFormat::Fp8E4m3 if !self.is_symmetric() => return Err("fp8 takes no zero point".into()),
            QuantFormat::Fp8E4m3 => {}
        }
        Ok(())
    }

    /// `(channels, inner)` for an NCHW-contiguous shape: the channel of flat index `i` is
    /// `(i / inner) % channels`.
    fn channel_split(&self, shape: &[usize]) -> (usize, usize) {
        match self.axis {
            None => (1, 1),
            Some(a) => (shape[a], shape[a + 1..].iter().product()),
        }
    }

    /// Applies `f(value, channel)` to every element of `x` (NCHW-contiguous).
    fn map(&self, x: &mut HostTensor, f: impl Fn(f32, usize) -> f32) {
        let (channels, inner) = self.channel_split(&x.shape);
        let inner = inner.max(1);
        for (k, block) in x.data.chunks_mut(inner).enumerate() {
            let c = k % channels;
            block.iter_mut().for_each(|v| *v = f(*v, c));
        }
    }

    /// The quantised value of `x` in channel `c` (an integer, or an e4m3 value, as f32).
    pub fn quantize_value(&self, x: f32, c: usize) -> f32 {
        let inv = 1.0f32 / self.scale[c];
        match self.format {
            QuantFormat::Int8 => ((x * inv).round_ties_even() + self.zp(c) as f32).clamp(self.qmin as f32, self.qmax as f32),
            QuantFormat::Fp8E4m3 => round_e4m3((x * inv).clamp(-E4M3_MAX, E4M3_MAX)),
        }
    }

    /// The real value of quantised `q` in channel `c`.
    pub fn dequantize_value(&self, q: f32, c: usize) -> f32 {
        match self.format {
            QuantFormat::Int8 => (q - self.zp(c) as f32) * self.scale[c],
            QuantFormat::Fp8E4m3 => q * self.scale[c],
        }
    }

    /// Fake-quantises a whole NCHW-contiguous tensor in place (quantise, then dequantise).
    pub fn fake_quantize(&self, x: &mut HostTensor) {
        self.map(x, |v, c| self.dequantize_value(self.quantize_value(v, c), c));
    }
}

/// Quantisation ops. Input: the value; the parameters are attributes (from a QAT `state_dict`,
/// a calibration cache, or per-channel weight ranges).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, strum::EnumIter)]
pub enum Quant {
    /// Real values to quantised values (integers or e4m3 values, as f32).
    Quantize(QuantParams),
    /// Quantised values back to real values.
    Dequantize(QuantParams),
    /// Quantise then dequantise: the real value an 8-bit engine sees.
    FakeQuantize(QuantParams),
}

impl Quant {
    pub fn params(&self) -> &QuantParams {
        match self {
            Quant::Quantize(p) | Quant::Dequantize(p) | Quant::FakeQuantize(p) => p,
        }
    }
    /// The kernel's mode code (`kernels/quant.cu`).
    pub fn kernel_mode(&self) -> i32 {
        match self {
            Quant::FakeQuantize(_) => 0,
            Quant::Quantize(_) => 1,
            Quant::Dequantize(_) => 2,
        }
    }
}

impl OpDef for Quant {
    fn name(&self) -> &str {
        match self {
            Quant::Quantize(_) => "quantize",
            Quant::Dequantize(_) => "dequantize",
            Quant::FakeQuantize(_) => "fake_quantize",
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
        let x = one_input(inputs)?;
        self.params().check(x)?;
        Ok(x.to_vec())
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, OpError> {
        args.expect(1)?;
        let mut x = args.take(0)?;
        let p = self.params();
        p.check(&x.shape)?;
        match self {
            Quant::Quantize(_) => p.map(&mut x, |v, c| p.quantize_value(v, c)),
            Quant::Dequantize(_) => p.map(&mut x, |v, c| p.dequantize_value(v, c)),
            Quant::FakeQuantize(_) => p.fake_quantize(&mut x),
        }
        Ok(x)
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        // An image is quantised channels-last, as the convs that read it want it (and as an 8-bit
        // engine stores its codes); anything else keeps its layout (the kernel finds the channel
        // of an element from the layout's strides).
        if out_rank == 3 {
            return LayoutPlan::all(inputs, Layout::channels_last(3));
        }
        let keep = inputs.first().copied().flatten().unwrap_or(Layout::contiguous(out_rank));
        LayoutPlan::any_input(inputs, keep)
    }
    fn entry_points(&self) -> Vec<String> {
        // The quantisers (`engine::quant`), and the e4m3 conversion of the FP8 GEMMs' inputs.
        crate::engine::launch::typed_entry_points(&["quant", "quant_tensor", "quant_codes", "to_e4m3"])
    }
    fn colour(&self) -> &'static str {
        "#ffc8dd"
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        layers::quant_layer(ctx, node, self)
    }
    fn label(&self) -> String {
        let p = self.params();
        let how = match p.axis {
            None => format!(" s={}", p.scale.first().copied().unwrap_or(0.0)),
            Some(a) => format!(" axis={a} ({} scales)", p.scale.len()),
        };
        format!("{} {}{how}", self.name(), p.format.name())
    }
}

impl Tensor {
    /// `torch.quantize_per_tensor` / `..._per_channel` (the integer representation), or an fp8 cast.
    pub fn quantize(&self, p: QuantParams) -> Result<Tensor> {
        Tensor::record_inline(Op::Quant(Quant::Quantize(p)), &[self])
    }
    /// `torch.dequantize` of quantised values.
    pub fn dequantize(&self, p: QuantParams) -> Result<Tensor> {
        Tensor::record_inline(Op::Quant(Quant::Dequantize(p)), &[self])
    }
    /// `torch.fake_quantize_per_tensor_affine` / `..._per_channel_affine`, or an fp8 round trip.
    pub fn fake_quantize(&self, p: QuantParams) -> Result<Tensor> {
        Tensor::record_inline(Op::Quant(Quant::FakeQuantize(p)), &[self])
    }
}

/// Options of a [`FakeQuantize`] layer: the format, int8 range and per-channel axis; the scales
/// come from the `state_dict`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FakeQuantizeConfig {
    pub format: QuantFormat,
    pub qmin: i32,
    pub qmax: i32,
    /// `None`: one scale per tensor; `Some(c)`: `c` scales along axis 1 (channels).
    pub channels: Option<usize>,
}

impl Default for FakeQuantizeConfig {
    fn default() -> Self {
        Self { format: QuantFormat::Int8, qmin: -128, qmax: 127, channels: None }
    }
}

/// A quantisation-aware-trained model's fake-quantiser (`torch.ao.quantization.FakeQuantize`'s
/// `scale` and `zero_point` buffers): explicit quantisation, built with exactly these scales.
/// Loads `scale` (`[1]` or `[C]`) and, for int8, `zero_point` (same shape, integers stored as
/// floats).
#[derive(Clone, Debug)]
pub struct FakeQuantize {
    pub path: String,
    pub params: QuantParams,
}

impl Module for FakeQuantize {
    type Config = FakeQuantizeConfig;
    fn load(vb: VarBuilder, cfg: &FakeQuantizeConfig) -> Result<Self> {
        let n = cfg.channels.unwrap_or(1);
        let scale = vb.get(&[n], "scale")?;
        let zero_point = match cfg.format {
            QuantFormat::Int8 => vb.get(&[n], "zero_point")?.value.data.iter().map(|&z| z.round() as i32).collect(),
            QuantFormat::Fp8E4m3 => vec![],
        };
        let params = QuantParams {
            format: cfg.format,
            scale: scale.value.data.clone(),
            zero_point,
            axis: cfg.channels.map(|_| 1),
            qmin: cfg.qmin,
            qmax: cfg.qmax,
        };
        // Bad scales name the layer now rather than at the first trace.
        params.check(&[1, n]).map_err(|reason| crate::Error::Shape {
            path: vb.path().to_string(),
            op: "fake_quantize".into(),
            reason,
            got: vec![vec![n]],
        })?;
        Ok(Self { path: vb.path().to_string(), params })
    }
}

impl Forward for FakeQuantize {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Tensor::record(&self.path, Op::Quant(Quant::FakeQuantize(self.params.clone())), &[x], &[])
    }
}

/// This family's `kiln::nn` layers, each traced on an input (for `ops::completeness`).
#[doc(hidden)]
pub const NN_LAYERS: &[NnLayer] = &[("FakeQuantize", |vb, t| {
    // A scale and zero point of its own: a seeded scale may be negative.
    let qparams = [("scale", 0.05), ("zero_point", 0.0)].map(|(k, v)| (vb.pp(k).path().to_string(), HostTensor::new(vec![1], vec![v])));
    let vb = VarBuilder::from_tensors(qparams.into_iter().collect()).pp(vb.path());
    nn::FakeQuantize::load(vb, &nn::FakeQuantizeConfig::default())?.forward(&t.input("x", &[1, 3, 4, 4]))
})];

/// The ATen ops kiln-torch imports as this family's ops: PyTorch's fake-quantisers (a QAT model)
/// and the quantize / dequantize pairs of a PT2E-quantised one.
#[doc(hidden)]
pub const ATEN: &[AtenImport] = &[
    (
        "fake_quantize",
        &[
            "aten.fake_quantize_per_tensor_affine.default",
            "aten.fake_quantize_per_tensor_affine.tensor_qparams",
            "aten.fake_quantize_per_channel_affine.default",
        ],
    ),
    // A PT2E quantize read by its dequantizes (the same parameters) becomes one fake_quantize.
    (
        "quantize",
        &[
            "quantized_decomposed.quantize_per_tensor.default",
            "quantized_decomposed.quantize_per_tensor.tensor",
            "quantized_decomposed.quantize_per_channel.default",
        ],
    ),
    (
        "dequantize",
        &[
            "quantized_decomposed.dequantize_per_tensor.default",
            "quantized_decomposed.dequantize_per_tensor.tensor",
            "quantized_decomposed.dequantize_per_channel.default",
        ],
    ),
];

/// The Kiln twins of this family's PyTorch op fixtures (`op_cases()` in tools/export_reference.py).
#[doc(hidden)]
pub const FIXTURE_TWINS: &[FixtureTwin] = &[
    ("fake_quantize_per_tensor_affine", |f| f.x.fake_quantize(QuantParams::int8(0.02))),
    ("fake_quantize_per_tensor_zero_point", |f| f.x.fake_quantize(QuantParams::int8(0.03).zero_points(vec![10]).range(0, 255))),
    ("fake_quantize_per_channel_affine", |f| f.x.fake_quantize(QuantParams::int8(1.0).per_channel(1, vec![0.01, 0.02, 0.05]))),
    ("fake_quantize_per_channel_axis0", |f| {
        f.x.fake_quantize(QuantParams::int8(1.0).range(-127, 127).per_channel(0, vec![0.004, 0.01, 0.02, 0.03]))
    }),
    ("fake_quantize_fp8_e4m3", |f| f.x.fake_quantize(QuantParams::fp8(0.005))),
    ("fake_quantize_fp8_per_channel", |f| f.x.fake_quantize(QuantParams::fp8(1.0).per_channel(1, vec![0.001, 0.01, 0.1]))),
    ("quantize_int8_per_tensor", |f| f.x.quantize(QuantParams::int8(0.02))),
    ("quantize_int8_per_channel", |f| f.x.quantize(QuantParams::int8(1.0).per_channel(1, vec![0.01, 0.02, 0.05]))),
    ("quantize_fp8", |f| f.x.quantize(QuantParams::fp8(0.02))),
    ("dequantize_int8_per_tensor", |f| f.x.quantize(QuantParams::int8(0.03125))?.dequantize(QuantParams::int8(0.03125))),
    ("dequantize_int8_per_channel", |f| {
        let p = QuantParams::int8(1.0).per_channel(1, vec![0.01, 0.02, 0.05]);
        f.x.quantize(p.clone())?.dequantize(p)
    }),
    ("dequantize_fp8", |f| f.x.quantize(QuantParams::fp8(0.03125))?.dequantize(QuantParams::fp8(0.03125))),
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Every e4m3 value, from its bits (sign, 4 exponent bits with bias 7, 3 mantissa bits).
    fn e4m3_values() -> Vec<f32> {
        let mut v = vec![];
        for bits in 0u8..0x7f {
            let (e, m) = ((bits >> 3) as i32, (bits & 7) as f32);
            v.push(if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) });
        }
        v
    }

    /// An "int8" range of ±2^31 was accepted; a range must be 8 bits, and a scale one whose
    /// reciprocal is finite (1e-45 made every value NaN).
    #[test]
    fn int8_ranges_are_8_bits_and_scales_have_finite_reciprocals() {
        let shape = [1, 3, 2, 2];
        let e = QuantParams::int8(0.1).range(i32::MIN, i32::MAX).check(&shape).expect_err("2^32 codes");
        assert!(e.to_string().contains("int8 range [-2147483648, 2147483647] is not 8 bits"), "{e}");
        for (qmin, qmax) in [(-129, 127), (0, 256), (-128, 255)] {
            assert!(QuantParams::int8(0.1).range(qmin, qmax).check(&shape).is_err(), "[{qmin}, {qmax}]");
        }
        for (qmin, qmax) in [(-128, 127), (0, 255), (-127, 127), (-8, 7)] {
            QuantParams::int8(0.1).range(qmin, qmax).check(&shape).unwrap_or_else(|e| panic!("[{qmin}, {qmax}]: {e}"));
        }
        for scale in [1e-45, f32::MAX] {
            let e = QuantParams::int8(scale).check(&shape).expect_err("scale");
            assert!(e.to_string().contains("a scale must be positive, finite and within"), "{e}");
            assert!(QuantParams::fp8(scale).check(&shape).is_err());
        }
        // Through the DSL: the op is refused where it is traced.
        let tracer = crate::Tracer::new();
        let x = tracer.input("input", &shape);
        assert!(x.fake_quantize(QuantParams::int8(0.1).range(i32::MIN, i32::MAX)).is_err());
    }

    #[test]
    fn e4m3_rounding_is_nearest_even_over_every_value() {
        let values = e4m3_values();
        assert_eq!(values.last().copied(), Some(448.0));
        for &v in &values {
            assert_eq!(round_e4m3(v), v, "{v} is representable");
            assert_eq!(round_e4m3(-v), -v);
        }
        // Midpoints go to the neighbour with an even mantissa; points just off them go nearest.
        for w in values.windows(2) {
            let (lo, hi) = (w[0], w[1]);
            let mid = 0.5 * (lo + hi);
            let lo_even = (values.iter().position(|&x| x == lo).unwrap() % 2) == 0;
            assert_eq!(round_e4m3(mid), if lo_even { lo } else { hi }, "midpoint of {lo} and {hi}");
            assert_eq!(round_e4m3(mid - (hi - lo) * 0.01), lo);
            assert_eq!(round_e4m3(mid + (hi - lo) * 0.01), hi);
        }
        assert_eq!(round_e4m3(1e6), 448.0);
        for (bits, &v) in values.iter().enumerate() {
            assert_eq!(encode_e4m3(v), bits as u8, "{v}");
            assert_eq!(encode_e4m3(-v), bits as u8 | 0x80, "-{v}");
        }
        assert!(round_e4m3(f32::NAN).is_nan());
    }

    #[test]
    fn int8_rounds_half_to_even_and_saturates() {
        let p = QuantParams::int8(0.5);
        let got: Vec<f32> = [0.25f32, 0.75, -0.25, 1.25, 100.0, -100.0].iter().map(|&x| p.quantize_value(x, 0)).collect();
        assert_eq!(got, vec![0.0, 2.0, -0.0, 2.0, 127.0, -128.0]);
        let mut t = HostTensor::new(vec![1, 2, 1, 2], vec![0.3, -0.3, 0.3, -0.3]);
        p.clone().per_channel(1, vec![0.1, 0.2]).fake_quantize(&mut t);
        assert!((t.data[0] - 0.3).abs() < 1e-6 && (t.data[2] - 0.4).abs() < 1e-6, "{:?}", t.data);
    }

    #[test]
    fn bad_params_are_errors() {
        assert!(QuantParams::int8(0.0).check(&[1, 3]).is_err());
        assert!(QuantParams::int8(f32::NAN).check(&[1, 3]).is_err());
        assert!(QuantParams::int8(1.0).per_channel(1, vec![1.0; 2]).check(&[1, 3]).unwrap_err().to_string().contains("3 scale"));
        assert!(QuantParams::int8(1.0).per_channel(4, vec![1.0]).check(&[1, 3]).is_err());
        assert!(QuantParams::fp8(1.0).zero_points(vec![1]).check(&[1]).is_err());
        assert!(QuantParams::int8(1.0).zero_points(vec![300]).check(&[1]).is_err());
    }
}
