//! Engine layers of the quantisation ops (`ops::quant`): quantize, dequantize and fake-quantize
//! in the activation type (`kernels/quant.cu`). These run where an 8-bit value meets a layer
//! without an 8-bit implementation (the FP16 fallback), with the same arithmetic as the CPU
//! reference, so a quantised engine and the CPU fake-quant simulation see the same values.

use super::eight_bit::{FP8_GEMM, QUANT_CODES};
use super::gemm::GemmSpec;
use super::kernel_layers::{grid_for, launch, CudaFunction, KArg, BLOCK};
use super::layer::{BuildCtx, DeviceBuf, Layer, RunCtx, ValueId};
use crate::graph::{HostTensor, NodeId};
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
    /// Per tensor: the vectorised kernel (`quant_tensor_*`) with the scale, `1/scale` and zero
    /// point as values; it runs where the element count is a multiple of a 16-byte vector.
    per_tensor: Option<(CudaFunction, [f32; 3])>,
    elem_bytes: usize,
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
        let per_vec = 16 / self.elem_bytes;
        let aligned = rt.ptr(self.x).is_multiple_of(16) && rt.ptr(self.y).is_multiple_of(16);
        if let (Some((f, [s, inv_s, z])), true, true) = (&self.per_tensor, n.is_multiple_of(per_vec), aligned) {
            let nvec = n / per_vec;
            let args = [
                KArg::Ptr(rt.ptr(self.x)),
                KArg::Ptr(rt.ptr(self.y)),
                KArg::I64(nvec as i64),
                KArg::F32(*s),
                KArg::F32(*inv_s),
                KArg::F32(*z),
                KArg::I32(self.mode),
                KArg::I32(self.format),
                KArg::F32(self.range.0),
                KArg::F32(self.range.1),
            ];
            return launch(rt, f, grid_for(nvec, self.sm_count), (BLOCK, 1, 1), 0, &args);
        }
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
    if ctx.eight_bit.stored[node] {
        return codes_layer(ctx, node, op, x, y);
    }
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
    let per_tensor = match (channels, p.scale.first()) {
        (1, Some(&s)) => Some((ctx.kernels.get(&format!("quant_tensor_{}", desc.elem.suffix()))?, [s, 1.0 / s, zp[0]])),
        _ => None,
    };
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
        per_tensor,
        elem_bytes: desc.elem.size(),
        sm_count: ctx.kernels.sm_count(),
    }))
}

/// A quantiser whose value an 8-bit engine stores as codes (`engine::eight_bit`), where no conv before
/// it writes them: reads the FP16/FP32 value and writes its int8 or e4m3 codes.
pub struct QuantCodesLayer {
    path: String,
    f: CudaFunction,
    x: ValueId,
    y: ValueId,
    per_image: usize,
    inv_scale: f32,
    format: i32,
    range: (f32, f32),
    sm_count: u32,
}

fn codes_layer(ctx: &mut BuildCtx, node: NodeId, op: &Quant, x: ValueId, y: ValueId) -> Result<Box<dyn Layer>> {
    let p = op.params();
    let (dx, dy) = (ctx.value(x).clone(), ctx.value(y).clone());
    let [scale] = p.scale[..] else { return Err(ctx.err(node, format!("{} scales for a stored (per-tensor) quantiser", p.scale.len()))) };
    if dx.dims != dy.dims || !dx.layout.same_bytes(dy.layout, &dx.dims) {
        return Err(ctx.err(
            node,
            format!("input {:?} {:?} and its codes {:?} {:?} differ in shape or layout", dx.dims, dx.layout, dy.dims, dy.layout),
        ));
    }
    Ok(Box::new(QuantCodesLayer {
        path: ctx.node(node).path.clone(),
        f: ctx.kernels.get(&format!("quant_codes_{}", dx.elem.suffix()))?,
        x,
        y,
        per_image: dx.per_image_elems(),
        inv_scale: 1.0 / scale,
        format: p.format as i32,
        range: (p.qmin as f32, p.qmax as f32),
        sm_count: ctx.kernels.sm_count(),
    }))
}

impl Layer for QuantCodesLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        QUANT_CODES.into()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let n = batch * self.per_image;
        let args = [
            KArg::Ptr(rt.ptr(self.x)),
            KArg::Ptr(rt.ptr(self.y)),
            KArg::I64(n as i64),
            KArg::F32(self.inv_scale),
            KArg::I32(self.format),
            KArg::F32(self.range.0),
            KArg::F32(self.range.1),
        ];
        launch(rt, &self.f, grid_for(n.div_ceil(8), self.sm_count), (BLOCK, 1, 1), 0, &args)
    }
}

// ---- FP8 GEMM -------------------------------------------------------------------------------

/// Where an FP8 GEMM applies its bias, residual and ReLU.
///
/// cuBLASLt's FP8 kernels (Hopper, cuBLASLt 12/13) take e4m3 A and B in the "TN" form only (A
/// transposed, B not), compute type `COMPUTE_32F` with f32 scalars, per-tensor f32 scales by device
/// pointer (`A_SCALE_POINTER`, `B_SCALE_POINTER`), 16-byte aligned operands with K and the output
/// channels multiples of 16, and for an f16 D an f16 C and f16 bias. Which epilogues each version
/// accepts with FP8 is less clear, so both forms are candidates and the timing (whose first,
/// untimed run at each batch of the range rejects a configuration cuBLASLt refuses) keeps one that
/// runs; [`fp8_gemm_probe`] prints what the device's cuBLASLt accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Epilogue {
    /// All in cuBLASLt: f16 bias and ReLU in its epilogue, the residual as C with beta = 1.
    Fused,
    /// cuBLASLt computes only `s_w·s_x·Wq·Xq` into Y; Kiln's `bias_act` kernel then adds the bias
    /// (f32) and the residual and applies ReLU, in place.
    Kernel,
}

/// A stride-1 1×1 convolution of an FP8 engine on cuBLASLt's e4m3 tensor cores: the activation
/// (already fake-quantised by its `fake_quantize` node, per tensor) is re-encoded as e4m3 bytes
/// with the same scale (exact: its values lie on the grid), the weight is stored as e4m3 with its
/// per-tensor scale, and one `LtMatmul` computes `act(s_w·s_x·Wq·Xq + bias + residual)` in f16
/// (its epilogue fused or a kernel, [`Fp8Epilogue`]). A tactic candidate beside the FP16 layers,
/// which compute the same numbers.
pub struct Fp8GemmLayer {
    path: String,
    x: ValueId,
    xq: ValueId,
    y: ValueId,
    /// The residual, read by cuBLASLt as C (`Fused`) or by the epilogue kernel (`Kernel`).
    z: Option<ValueId>,
    rows_per_image: usize,
    k: usize,
    inv_sx: f32,
    to_e4m3: CudaFunction,
    w: DeviceBuf,
    _scales: DeviceBuf,
    _bias: Option<DeviceBuf>,
    matmul: super::gemm::LtMatmul,
    /// `Kernel`: the bias/residual/ReLU layer run on Y after the GEMM.
    epilogue: Option<Box<dyn Layer>>,
    sm_count: u32,
}

impl Layer for Fp8GemmLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        match self.epilogue {
            None => format!("{FP8_GEMM}:fused"),
            Some(_) => format!("{FP8_GEMM}:bias-kernel"),
        }
    }
    fn workspace_bytes(&self, batch: usize) -> usize {
        self.matmul.workspace(batch * self.rows_per_image, 1)
    }
    fn prepare(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        self.matmul.prepare(rt, batch * self.rows_per_image, 1)
    }
    fn overwrites(&self) -> Option<(ValueId, ValueId)> {
        // cuBLASLt writes D over C in place; the epilogue kernel needs the residual after the GEMM.
        self.z.filter(|_| self.epilogue.is_none()).map(|z| (self.y, z))
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let m = batch * self.rows_per_image;
        let n = m * self.k;
        let args = [KArg::Ptr(rt.ptr(self.x)), KArg::Ptr(rt.ptr(self.xq)), KArg::I64(n as i64), KArg::F32(self.inv_sx)];
        launch(rt, &self.to_e4m3, grid_for(n, self.sm_count), (BLOCK, 1, 1), 0, &args)?;
        match &self.epilogue {
            None => {
                let c = self.z.map_or(0, |z| rt.ptr(z));
                self.matmul.enqueue(rt, m, rt.ptr(self.xq), self.w.ptr(), c, rt.ptr(self.y))
            }
            Some(epilogue) => {
                self.matmul.enqueue(rt, m, rt.ptr(self.xq), self.w.ptr(), 0, rt.ptr(self.y))?;
                epilogue.enqueue(rt, batch)
            }
        }
    }
}

/// The FP8 GEMM candidates of `node` (one per [`Fp8Epilogue`]), when they apply: an `Fp8` or
/// `Best` engine, the node's input produced by a per-tensor fp8 `fake_quantize` (or Best's int8
/// one, whose range it clips at), f16 values, and channel counts that are multiples of 16
/// (cuBLASLt's FP8 alignment). None otherwise. The weight is quantised to e4m3 with one
/// per-tensor scale (a folded FP8 weight's values are their own codes).
pub fn fp8_gemm_candidates(ctx: &mut BuildCtx, node: NodeId, spec: GemmSpec) -> Result<Vec<Box<dyn Layer>>> {
    use crate::graph::{Op, QuantFormat};
    // Best on a GPU without FP8 tensor cores is FP16: it offers no 8-bit candidate.
    if !matches!(ctx.precision(), super::Precision::Fp8 | super::Precision::Best) || ctx.gpu.info.sm < 89 {
        return Ok(vec![]);
    }
    let src = ctx.node(node).inputs[0];
    let sx = match &ctx.graph.nodes[src].op {
        Op::Quant(Quant::FakeQuantize(p)) if p.axis.is_none() && p.scale.len() == 1 => match p.format {
            QuantFormat::Fp8E4m3 => p.scale[0],
            // Best's quantisers are INT8's: the FP8 GEMM clips at the same range.
            QuantFormat::Int8 if ctx.config.precision == super::Precision::Best => p.scale[0] * p.qmax as f32 / crate::ops::quant::E4M3_MAX,
            QuantFormat::Int8 => return Ok(vec![]),
        },
        _ => return Ok(vec![]),
    };
    let (dx, dy) = (ctx.value(spec.x).clone(), ctx.value(spec.y).clone());
    let (Some((k, _, _)), Some((n, _, _))) = (dx.chw(), dy.chw()) else { return Ok(vec![]) };
    if dx.elem != super::layer::Elem::F16 || k % 16 != 0 || n % 16 != 0 || spec.weight.len() != n * k {
        return Ok(vec![]);
    }
    let xq = ctx.scratch(spec.rows_per_image * k);
    [Fp8Epilogue::Fused, Fp8Epilogue::Kernel].into_iter().map(|e| fp8_gemm_layer(ctx, node, spec, sx, xq, [k, n], e)).collect()
}

/// Bytes between the A and B scales of an FP8 GEMM in their device buffer. cuBLASLt refuses
/// (`NOT_SUPPORTED`, at `cublasLtMatmul`, after its heuristic accepted the problem) a scale
/// pointer that is not 16-byte aligned: two f32 scalars packed 4 bytes apart failed every FP8
/// configuration on the H100 (cuBLASLt 13.1), the same scales 16 bytes apart run.
const SCALE_SLOT: u64 = 16;

/// `a` and `b` in one buffer, each at the start of its 16-byte slot (`SCALE_SLOT`).
fn scale_slots(a: f32, b: f32) -> [f32; 8] {
    let mut s = [0f32; 8];
    s[0] = a;
    s[SCALE_SLOT as usize / 4] = b;
    s
}

/// The e4m3 bytes of `w` and its per-tensor scale (`max|w| / 448`).
fn e4m3_weight(w: &[f32]) -> (Vec<u8>, f32) {
    use crate::graph::QuantFormat;
    use crate::ops::quant::{encode_e4m3, round_e4m3, E4M3_MAX};
    let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    let sw = crate::calibrate::symmetric_scale(amax, QuantFormat::Fp8E4m3);
    (w.iter().map(|&v| encode_e4m3(round_e4m3((v * (1.0 / sw)).clamp(-E4M3_MAX, E4M3_MAX)))).collect(), sw)
}

fn fp8_gemm_layer(
    ctx: &mut BuildCtx,
    node: NodeId,
    spec: GemmSpec,
    sx: f32,
    xq: ValueId,
    [k, n]: [usize; 2],
    epilogue: Fp8Epilogue,
) -> Result<Box<dyn Layer>> {
    let (wq, sw) = e4m3_weight(spec.weight);
    let w = ctx.upload_bytes(&wq)?;
    let scales = ctx.upload_f32(&scale_slots(sw, sx))?;
    let (a_scale, b_scale) = (scales.ptr(), scales.ptr() + SCALE_SLOT);
    let path = ctx.node(node).path.clone();
    let (matmul, bias, epilogue) = match epilogue {
        Fp8Epilogue::Fused => {
            let bias = spec.bias.map(|b| ctx.upload(b)).transpose()?;
            (super::gemm::LtMatmul::new_fp8(&path, k, n, bias.as_ref(), spec.relu, a_scale, b_scale)?, bias, None)
        }
        Fp8Epilogue::Kernel => {
            let act = spec.relu.then_some(crate::ops::elementwise::Unary::Relu);
            let kernel = super::kernel_layers::bias_act(ctx, node, spec.y, None, spec.bias, spec.residual, spec.y, act)?;
            (super::gemm::LtMatmul::new_fp8(&path, k, n, None, false, a_scale, b_scale)?, None, Some(kernel))
        }
    };
    Ok(Box::new(Fp8GemmLayer {
        path,
        x: spec.x,
        xq,
        y: spec.y,
        z: spec.residual,
        rows_per_image: spec.rows_per_image,
        k,
        inv_sx: 1.0 / sx,
        to_e4m3: ctx.kernels.get("to_e4m3_f16")?,
        w,
        _scales: scales,
        _bias: bias,
        matmul,
        epilogue,
        sm_count: ctx.kernels.sm_count(),
    }))
}

/// One configuration tried by [`fp8_gemm_probe`]: its description and, where cuBLASLt ran it,
/// its (relative L2, max-abs) error against the f32 product of the same e4m3 values.
pub type Fp8ProbeResult = (String, std::result::Result<(f64, f64), String>);

/// Runs cuBLASLt's FP8 GEMM (`LtMatmul::new_fp8`) on random e4m3 operands, `m` rows, `[k] → [n]`,
/// in every epilogue form (none, bias, ReLU, bias+ReLU, each with and without a residual C) and
/// compares each with the host's f32 result: which configurations this device's cuBLASLt accepts,
/// and whether they compute what Kiln expects. A diagnostic for `tests/gpu_quant.rs`.
pub fn fp8_gemm_probe(gpu: &super::Gpu, m: usize, k: usize, n: usize) -> Result<Vec<Fp8ProbeResult>> {
    use crate::ops::quant::{encode_e4m3, round_e4m3};
    use cudarc::driver::result as drv;
    gpu.ctx.bind_to_thread().map_err(super::gpu::cuda_err("binding the CUDA context"))?;
    let stream = &gpu.stream;
    let uniform = |count: usize, seed: u64, scale: f32| -> Vec<f32> {
        crate::seeded::uniform_tensor(&[count], seed).data.iter().map(|v| round_e4m3(v * scale)).collect()
    };
    // Operands on the e4m3 grid (|v| < 8), scales that are not powers of two.
    let (x, w) = (uniform(m * k, 1, 8.0), uniform(n * k, 2, 8.0));
    let (sx, sw) = (0.0123f32, 0.0071f32);
    let bias: Vec<f32> = uniform(n, 3, 1.0).iter().map(|v| half::f16::from_f32(*v).to_f32()).collect();
    let residual: Vec<f32> = uniform(m * n, 4, 1.0).iter().map(|v| half::f16::from_f32(*v).to_f32()).collect();
    let enc = |v: &[f32]| v.iter().map(|&t| encode_e4m3(t)).collect::<Vec<u8>>();
    let f16 = |v: &[f32]| super::layer::to_elem_bytes(v, super::layer::Elem::F16);
    let (xb, wb) = (DeviceBuf::from_bytes(stream, &enc(&x))?, DeviceBuf::from_bytes(stream, &enc(&w))?);
    let f32s = |v: &[f32]| super::layer::to_elem_bytes(v, super::layer::Elem::F32);
    let scales = DeviceBuf::from_bytes(stream, &f32s(&scale_slots(sw, sx)))?;
    // The same scales 4 bytes apart: the layout cuBLASLt refused (`SCALE_SLOT`), kept as a probe.
    let packed = DeviceBuf::from_bytes(stream, &f32s(&[sw, sx]))?;
    let (bias_b, res_b) = (DeviceBuf::from_bytes(stream, &f16(&bias))?, DeviceBuf::from_bytes(stream, &f16(&residual))?);
    let y = DeviceBuf::zeros(stream, m * n * 2)?;
    let ws = DeviceBuf::zeros(stream, super::gemm::GEMM_WORKSPACE)?;
    let rt = RunCtx { stream, handles: &gpu.handles, ptrs: &[], workspace: ws.ptr(), workspace_bytes: ws.len() };
    let mut results = Vec::new();
    let configs = [false, true].into_iter().flat_map(|b| [false, true].into_iter().flat_map(move |r| [(b, r, false), (b, r, true)]));
    for (with_bias, relu, with_c, aligned) in configs.map(|(b, r, c)| (b, r, c, true)).chain([(false, false, false, false)]) {
        let label = format!(
            "m {m} k {k} n {n}: epilogue {}{}, {}{}",
            if with_bias { "bias" } else { "none" },
            if relu { "+relu" } else { "" },
            if with_c { "residual as C (beta 1)" } else { "no C" },
            if aligned { "" } else { ", scales 4 bytes apart" }
        );
        let (a_scale, b_scale) = if aligned {
            (scales.ptr(), scales.ptr() + SCALE_SLOT)
        } else {
            (packed.ptr(), packed.ptr() + std::mem::size_of::<f32>() as u64)
        };
        let run = || -> Result<Vec<f32>> {
            let mm = super::gemm::LtMatmul::new_fp8("fp8-probe", k, n, with_bias.then_some(&bias_b), relu, a_scale, b_scale)?;
            mm.enqueue(&rt, m, xb.ptr(), wb.ptr(), if with_c { res_b.ptr() } else { 0 }, y.ptr())?;
            let mut out = vec![half::f16::ZERO; m * n];
            // SAFETY: `y` holds m·n f16 values, as `out` does; the stream is synchronised before
            // `out` is read.
            unsafe { drv::memcpy_dtoh_async(&mut out, y.ptr(), stream.cu_stream()) }
                .map_err(super::gpu::cuda_err("copying to the host"))?;
            stream.synchronize().map_err(super::gpu::cuda_err("running the FP8 GEMM"))?;
            Ok(out.iter().map(|v| v.to_f32()).collect())
        };
        let outcome = run().map_err(|e| e.to_string()).map(|got| {
            let want: Vec<f32> = (0..m * n)
                .map(|i| {
                    let (r, c) = (i / n, i % n);
                    let dot: f64 = (0..k).map(|j| x[r * k + j] as f64 * w[c * k + j] as f64).sum();
                    let mut v = (dot * sx as f64 * sw as f64) as f32;
                    if with_c {
                        v += residual[i];
                    }
                    if with_bias {
                        v += bias[c];
                    }
                    if relu {
                        v = v.max(0.0);
                    }
                    v
                })
                .collect();
            let c = crate::compare::compare(&label, &HostTensor::new(vec![m, n], got), &HostTensor::new(vec![m, n], want));
            (c.rel_l2, c.max_abs)
        });
        results.push((label, outcome));
    }
    Ok(results)
}
