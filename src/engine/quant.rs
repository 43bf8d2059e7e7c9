//! Engine layers of the quantisation ops (`ops::quant`): quantize, dequantize and fake-quantize
//! in the activation type (`kernels/quant.cu`). These run where an 8-bit value meets a layer
//! without an 8-bit implementation (the FP16 fallback), with the same arithmetic as the CPU
//! reference, so a quantised engine and the CPU fake-quant simulation see the same values.

use super::gemm::GemmSpec;
use super::kernel_layers::{grid_for, launch, CudaFunction, KArg, BLOCK};
use super::layer::{BuildCtx, DeviceBuf, Layer, RunCtx, ValueId};
use crate::graph::NodeId;
use crate::ops::quant::Quant;
use crate::ops::OpDef;
use crate::Result;

/// One Q, DQ or Q/DQ node over a whole value.
pub struct QuantLayer {
    path: String,
    kind: String,
    f: CudaFunction,
    x: ValueId,
    y: ValueId,
    per_image: usize,
    scale: DeviceBuf,
    zero_point: DeviceBuf,
    inner: i64,
    channels: i32,
    mode: i32,
    format: i32,
    range: (f32, f32),
    sm_count: u32,
}

impl Layer for QuantLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.kind.clone()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let n = batch * self.per_image;
        let args = [
            KArg::Ptr(rt.ptr(self.x)),
            KArg::Ptr(rt.ptr(self.y)),
            KArg::I64(n as i64),
            KArg::Ptr(self.scale.ptr()),
            KArg::Ptr(self.zero_point.ptr()),
            KArg::I64(self.inner),
            KArg::I32(self.channels),
            KArg::I32(self.mode),
            KArg::I32(self.format),
            KArg::F32(self.range.0),
            KArg::F32(self.range.1),
        ];
        launch(rt, &self.f, grid_for(n, self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

/// Lowers a quantisation node: the channel of each element comes from the physical stride of the
/// per-channel axis in the input's layout (any layout works).
pub fn quant_layer(ctx: &mut BuildCtx, node: NodeId, op: &Quant) -> Result<Box<dyn Layer>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let desc = ctx.value(x).clone();
    if ctx.value(y).elem != desc.elem || ctx.value(y).layout != desc.layout {
        return Err(ctx.err(node, format!("input {:?} {:?} and output differ in type or layout", desc.elem, desc.layout)));
    }
    let p = op.params();
    let (channels, inner) = match p.axis {
        None => (1, 1),
        Some(0) => return Err(ctx.err(node, "per-channel quantisation along the batch dim has no engine layer".into())),
        Some(a) => {
            let strides = desc.layout.strides(&desc.dims);
            let (Some(&c), Some(&s)) = (desc.dims.get(a - 1), strides.get(a - 1)) else {
                return Err(ctx.err(node, format!("axis {a} is out of range for per-image dims {:?}", desc.dims)));
            };
            (c, s)
        }
    };
    let channels = i32::try_from(channels).map_err(|_| ctx.err(node, format!("{channels} channels exceed 32 bits")))?;
    let zp: Vec<f32> = (0..p.scale.len()).map(|c| p.zero_point.get(c).copied().unwrap_or(0) as f32).collect();
    let scale = ctx.upload_f32(&p.scale)?;
    let zero_point = ctx.upload_f32(&zp)?;
    let f = ctx.kernels.get(&format!("quant_{}", desc.elem.suffix()))?;
    Ok(Box::new(QuantLayer {
        path: ctx.node(node).path.clone(),
        kind: format!("kernel:{}_{}", op.name(), p.format.name()),
        f,
        x,
        y,
        per_image: desc.per_image_elems(),
        scale,
        zero_point,
        inner: inner as i64,
        channels,
        mode: op.kernel_mode(),
        format: p.format as i32,
        range: (p.qmin as f32, p.qmax as f32),
        sm_count: ctx.kernels.sm_count(),
    }))
}

// ---- FP8 GEMM -------------------------------------------------------------------------------

/// A stride-1 1×1 convolution of an FP8 engine on cuBLASLt's e4m3 tensor cores: the activation
/// (already fake-quantised by its `fake_quantize` node, per tensor) is re-encoded as e4m3 bytes
/// with the same scale (exact: its values lie on the grid), the weight is stored as e4m3 with its
/// per-tensor scale, and one `LtMatmul` computes `act(s_w·s_x·Wq·Xq + bias) + residual` in f16.
/// A tactic candidate beside the FP16 layers, which compute the same numbers.
pub struct Fp8GemmLayer {
    path: String,
    x: ValueId,
    xq: ValueId,
    y: ValueId,
    z: Option<ValueId>,
    rows_per_image: usize,
    k: usize,
    inv_sx: f32,
    to_e4m3: CudaFunction,
    w: DeviceBuf,
    _scales: DeviceBuf,
    _bias: Option<DeviceBuf>,
    matmul: super::gemm::LtMatmul,
    sm_count: u32,
}

impl Layer for Fp8GemmLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "cublaslt-gemm-fp8".into()
    }
    fn workspace_bytes(&self, _batch: usize) -> usize {
        super::gemm::GEMM_WORKSPACE
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let m = batch * self.rows_per_image;
        let n = m * self.k;
        let args = [KArg::Ptr(rt.ptr(self.x)), KArg::Ptr(rt.ptr(self.xq)), KArg::I64(n as i64), KArg::F32(self.inv_sx)];
        launch(rt, &self.to_e4m3, grid_for(n, self.sm_count), (BLOCK, 1, 1), 0, &args)?;
        let c = self.z.map_or(0, |z| rt.ptr(z));
        self.matmul.enqueue(rt, m, rt.ptr(self.xq), self.w.ptr(), c, rt.ptr(self.y))
    }
}

/// The FP8 GEMM candidate of `node`, when it applies: an `Fp8` engine, the node's input produced
/// by a per-tensor fp8 `fake_quantize`, f16 values, and channel counts that are multiples of 16
/// (cuBLASLt's FP8 alignment). `None` otherwise. The weight is already on the e4m3 grid of one
/// per-tensor scale (a folded quantiser).
pub fn fp8_gemm_candidate(ctx: &mut BuildCtx, node: NodeId, spec: GemmSpec) -> Result<Option<Box<dyn Layer>>> {
    use crate::graph::{Op, QuantFormat};
    use crate::ops::quant::{encode_e4m3, round_e4m3, E4M3_MAX};
    if ctx.precision() != super::Precision::Fp8 {
        return Ok(None);
    }
    let src = ctx.node(node).inputs[0];
    let sx = match &ctx.graph.nodes[src].op {
        Op::Quant(Quant::FakeQuantize(p)) if p.format == QuantFormat::Fp8E4m3 && p.axis.is_none() => p.scale[0],
        _ => return Ok(None),
    };
    let (dx, dy) = (ctx.value(spec.x).clone(), ctx.value(spec.y).clone());
    let (Some((k, _, _)), Some((n, _, _))) = (dx.chw(), dy.chw()) else { return Ok(None) };
    if dx.elem != super::layer::Elem::F16 || k % 16 != 0 || n % 16 != 0 || spec.weight.len() != n * k {
        return Ok(None);
    }
    let amax = spec.weight.iter().fold(0f32, |m, v| m.max(v.abs()));
    let sw = crate::calibrate::symmetric_scale(amax, QuantFormat::Fp8E4m3);
    let wq: Vec<u8> = spec.weight.iter().map(|&v| encode_e4m3(round_e4m3((v * (1.0 / sw)).clamp(-E4M3_MAX, E4M3_MAX)))).collect();
    let w = ctx.upload_bytes(&wq)?;
    let scales = ctx.upload_f32(&[sw, sx])?;
    let bias = match spec.bias {
        Some(b) => Some(ctx.upload(b)?),
        None => None,
    };
    let path = ctx.node(node).path.clone();
    let (a_scale, b_scale) = (scales.ptr(), scales.ptr() + std::mem::size_of::<f32>() as u64);
    let matmul = super::gemm::LtMatmul::new_fp8(&path, k, n, bias.as_ref(), spec.relu, a_scale, b_scale)?;
    let xq = ctx.scratch(spec.rows_per_image * k);
    let to_e4m3 = ctx.kernels.get("to_e4m3_f16")?;
    Ok(Some(Box::new(Fp8GemmLayer {
        path,
        x: spec.x,
        xq,
        y: spec.y,
        z: spec.residual,
        rows_per_image: spec.rows_per_image,
        k,
        inv_sx: 1.0 / sx,
        to_e4m3,
        w,
        _scales: scales,
        _bias: bias,
        matmul,
        sm_count: ctx.kernels.sm_count(),
    })))
}
