//! FP8 GEMMs: a quantised Linear or stride-1 1×1 convolution of an FP8 (or `Best`) engine on
//! cuBLASLt's e4m3 tensor cores, its activation re-encoded from the `fake_quantize` before it. One
//! home for both: [`problem`] says where the candidate applies, [`candidates`] makes it (the conv
//! family times it beside its other candidates), [`or_fp16`] times it against a Linear's 16-bit GEMM.

use super::{encode_e4m3, round_e4m3, Quant, QuantFormat, E4M3_MAX};
use crate::engine::eight_bit::FP8_GEMM;
use crate::engine::gemm::{GemmSpec, LtMatmul, GEMM_WORKSPACE};
use crate::engine::gpu::cuda_err;
use crate::engine::launch::{grid_for, launch, CudaFunction, KArg, BLOCK};
use crate::engine::layer::{to_elem_bytes, DeviceBuf, Elem, Layer, RunCtx, ValueDesc, ValueId};
use crate::engine::{Gpu, Layout, Precision};
use crate::graph::{Graph, HostTensor, NodeId, Op};
use crate::ops::linear::Gemm;
use crate::ops::BuildCtx;
use crate::Result;

/// Where an FP8 GEMM applies its bias, residual and ReLU.
///
/// cuBLASLt's FP8 kernels (Hopper, cuBLASLt 12/13) take e4m3 A and B in the "TN" form only (A
/// transposed, B not), compute type `COMPUTE_32F` with f32 scalars, per-tensor f32 scales by device
/// pointer (`A_SCALE_POINTER`, `B_SCALE_POINTER`), 16-byte aligned operands with K and the output
/// channels multiples of 16, and for an f16 D an f16 C and f16 bias. Which epilogues each version
/// accepts with FP8 is less clear, so both forms are candidates and the timing (whose first,
/// untimed run at each batch of the range rejects a configuration cuBLASLt refuses) keeps one that
/// runs; [`probe`] prints what the device's cuBLASLt accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Epilogue {
    /// All in cuBLASLt: f16 bias and ReLU in its epilogue, the residual as C with beta = 1.
    Fused,
    /// cuBLASLt computes only `s_w·s_x·Wq·Xq` into Y; Kiln's `bias_act` kernel then adds the bias
    /// (f32) and the residual and applies ReLU, in place.
    Kernel,
}

/// A Linear or stride-1 1×1 convolution of an FP8 engine on cuBLASLt's e4m3 tensor cores (a
/// Linear's row-major `[m, k] × [n, k]ᵀ` is the 1×1 conv's GEMM over NHWC pixels): the activation
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
    matmul: LtMatmul,
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
    fn own_scratch(&self) -> Vec<ValueId> {
        vec![self.xq]
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

/// The GEMM an FP8 candidate runs for a node: the activation's per-tensor scale (one e4m3 step
/// of 1 is `sx`), `[k] → [n]` per row, and the rows per image.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Problem {
    pub sx: f32,
    pub k: usize,
    pub n: usize,
    pub rows_per_image: usize,
    /// A 1×1 conv's image, read channels-last (`[C, H, W]` stored H, W, C); else a Linear's
    /// contiguous rows (`[.., k]`).
    pub channels_last: bool,
}

/// Where an FP8 GEMM candidate applies, from the graph alone (the values' checks are
/// `candidates`'): a node of an `Fp8` or `Best` layer (`precision`) that is
/// - a stride-1 1×1 convolution (not grouped or transposed, no padding): `[C, H, W] →
///   [K, H, W]`, H·W rows per image;
/// - or a Linear (`Gemm::Linear`): `[.., k] → [.., n]`, the product of the dims between the batch
///   and the last rows per image;
///
/// whose input is a per-tensor, symmetric fp8 `fake_quantize` (or Best's int8 one, whose range the
/// FP8 GEMM clips at: its scale × qmax / 448), with k and n multiples of 16 (cuBLASLt's FP8
/// alignment). The bias, a fused ReLU and a residual (a conv's or a Linear's last input) go to the
/// GEMM's epilogue (`Fp8Epilogue`). A Linear's residual is not quantised (`calibrate::quant_points`).
pub fn problem(graph: &Graph, node: NodeId, precision: Precision) -> Option<Fp8Problem> {
    if !matches!(precision, Precision::Fp8 | Precision::Best) {
        return None;
    }
    let n = &graph.nodes[node];
    let x = &graph.nodes[*n.inputs.first()?];
    let sx = match &x.op {
        Op::Quant(Quant::FakeQuantize(p)) if p.axis.is_none() && p.scale.len() == 1 && p.zero_point.iter().all(|&z| z == 0) => {
            match p.format {
                QuantFormat::Fp8E4m3 => p.scale[0],
                // Best's quantisers are INT8's: the FP8 GEMM clips at the same range.
                QuantFormat::Int8 if precision == Precision::Best => p.scale[0] * p.qmax as f32 / E4M3_MAX,
                QuantFormat::Int8 => return None,
            }
        }
        _ => return None,
    };
    let (k, out, rows_per_image, channels_last) = match &n.op {
        Op::Conv(a) => {
            // A fused max-pool after it is a layer of its own (`Chain`): the candidate is the conv's.
            let pointwise = !a.transposed && a.groups == 1 && a.stride == [1, 1] && a.padding == [0, 0];
            let weight = &graph.nodes[*n.inputs.get(1)?].shape;
            match (&x.shape[..], &n.shape[..]) {
                ([_, c, h, w], [_, k, ..]) if pointwise && weight.get(2..) == Some(&[1, 1][..]) => (*c, *k, h * w, true),
                _ => return None,
            }
        }
        Op::Gemm(Gemm::Linear { .. }) => {
            let rows = n.shape.get(1..n.shape.len().checked_sub(1)?)?.iter().product();
            (*x.shape.last()?, *n.shape.last()?, rows, false)
        }
        _ => return None,
    };
    let aligned = k > 0 && out > 0 && k % 16 == 0 && out % 16 == 0;
    aligned.then_some(Fp8Problem { sx, k, n: out, rows_per_image, channels_last })
}

/// The FP8 GEMM candidates of `node` (one per [`Fp8Epilogue`]; a Linear over tokens, whose output
/// is not an image or a vector, only the fused form) where [`problem`] applies on a GPU
/// with FP8 tensor cores (sm_89+), its values f16 and laid out as GEMM rows (channels-last for a
/// conv, contiguous for a Linear) and `spec` agreeing with the problem; none otherwise. The
/// weight is quantised to e4m3 with one per-tensor scale (a folded FP8 weight's values are their
/// own codes).
pub fn candidates(ctx: &mut BuildCtx, node: NodeId, spec: GemmSpec) -> Result<Vec<Box<dyn Layer>>> {
    // Best on a GPU without FP8 tensor cores is FP16: it offers no 8-bit candidate.
    if ctx.gpu.info.sm < 89 {
        return Ok(vec![]);
    }
    let Some(p) = problem(ctx.graph, node, ctx.precision()) else { return Ok(vec![]) };
    let rows = |d: &ValueDesc, width: usize| {
        let layout = if p.channels_last { Layout::channels_last(d.dims.len()) } else { Layout::contiguous(d.dims.len()) };
        let last = if p.channels_last { d.chw().map(|(c, _, _)| c) } else { d.dims.last().copied() };
        last == Some(width) && d.per_image_elems() == p.rows_per_image * width && d.layout.same_bytes(layout, &d.dims)
    };
    let (dx, dy) = (ctx.value(spec.x).clone(), ctx.value(spec.y).clone());
    let agrees = spec.rows_per_image == p.rows_per_image && spec.weight.len() == p.n * p.k;
    if dx.elem != Elem::F16 || !rows(&dx, p.k) || !rows(&dy, p.n) || !agrees {
        return Ok(vec![]);
    }
    // The e4m3 copy of the input, held by the arena only where an FP8 candidate wins.
    let xq = ctx.chain_scratch(vec![p.rows_per_image * p.k], Elem::E4m3, Layout::contiguous(1));
    // `bias_act` (the `Kernel` form's epilogue) reads `[C, H, W]` channels-last or `[F]`: a
    // Linear over tokens (`[L, n]`) has the fused form only.
    let forms: &[Fp8Epilogue] =
        if p.channels_last || dy.dims.len() == 1 { &[Fp8Epilogue::Fused, Fp8Epilogue::Kernel] } else { &[Fp8Epilogue::Fused] };
    forms.iter().map(|&e| layer(ctx, node, spec, p.sx, xq, [p.k, p.n], e)).collect()
}

/// The layer of a Linear: its 16-bit GEMMs (`fp16`, cuBLASLt's first, then the wgmma GEMM's tiles
/// on sm_90; in an FP8 engine they compute the same numbers on the Q/DQ values) timed against its
/// FP8 GEMM candidates where [`candidates`] offers any, the fastest kept; a lone candidate is
/// taken without a tactic recorded, as before.
pub fn or_fp16(ctx: &mut BuildCtx, node: NodeId, spec: GemmSpec, fp16: Vec<Box<dyn Layer>>) -> Result<Box<dyn Layer>> {
    let mut fp16 = fp16.into_iter();
    let Some(first) = fp16.next() else {
        return Err(ctx.err(node, crate::LowerKind::NoAlgorithm, "no 16-bit GEMM candidate"));
    };
    // An engine file written before Linears had several candidates records no tactic for them:
    // it ran the first (cuBLASLt's) GEMM, and loads as it was built.
    let path = format!("{}|", ctx.path());
    if ctx.tactics.replay && !ctx.tactics.recorded.keys().any(|k| k.starts_with(&path)) {
        return Ok(first);
    }
    let mut all: Vec<Box<dyn Layer>> = std::iter::once(first).chain(fp16).collect();
    all.extend(candidates(ctx, node, spec)?);
    if all.len() == 1 {
        return Ok(all.pop().expect("one candidate"));
    }
    let key = ctx.problem_key(node);
    ctx.choose(&key, all)
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
    let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    let sw = crate::number_format::symmetric_scale(amax, QuantFormat::Fp8E4m3);
    (w.iter().map(|&v| encode_e4m3(round_e4m3((v * (1.0 / sw)).clamp(-E4M3_MAX, E4M3_MAX)))).collect(), sw)
}

fn layer(
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
            (LtMatmul::new_fp8(&path, k, n, bias.as_ref(), spec.relu, a_scale, b_scale)?, bias, None)
        }
        Fp8Epilogue::Kernel => {
            let act = spec.relu.then_some(crate::ops::elementwise::Unary::Relu);
            let kernel = crate::ops::elementwise::bias_act(ctx, node, spec.y, None, spec.bias, spec.residual, spec.y, act)?;
            (LtMatmul::new_fp8(&path, k, n, None, false, a_scale, b_scale)?, None, Some(kernel))
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

/// One configuration tried by [`probe`]: its description and, where cuBLASLt ran it,
/// its (relative L2, max-abs) error against the f32 product of the same e4m3 values.
pub type Fp8ProbeResult = (String, std::result::Result<(f64, f64), String>);

/// Runs cuBLASLt's FP8 GEMM (`LtMatmul::new_fp8`) on random e4m3 operands, `m` rows, `[k] → [n]`,
/// in every epilogue form (none, bias, ReLU, bias+ReLU, each with and without a residual C) and
/// compares each with the host's f32 result: which configurations this device's cuBLASLt accepts,
/// and whether they compute what Kiln expects. A diagnostic for `tests/gpu_quant.rs`.
pub fn probe(gpu: &Gpu, m: usize, k: usize, n: usize) -> Result<Vec<Fp8ProbeResult>> {
    use cudarc::driver::result as drv;
    gpu.ctx.bind_to_thread().map_err(cuda_err("binding the CUDA context"))?;
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
    let f16 = |v: &[f32]| to_elem_bytes(v, Elem::F16);
    let (xb, wb) = (DeviceBuf::from_bytes(stream, &enc(&x))?, DeviceBuf::from_bytes(stream, &enc(&w))?);
    let f32s = |v: &[f32]| to_elem_bytes(v, Elem::F32);
    let scales = DeviceBuf::from_bytes(stream, &f32s(&scale_slots(sw, sx)))?;
    // The same scales 4 bytes apart: the layout cuBLASLt refused (`SCALE_SLOT`), kept as a probe.
    let packed = DeviceBuf::from_bytes(stream, &f32s(&[sw, sx]))?;
    let (bias_b, res_b) = (DeviceBuf::from_bytes(stream, &f16(&bias))?, DeviceBuf::from_bytes(stream, &f16(&residual))?);
    let y = DeviceBuf::zeros(stream, m * n * 2)?;
    let ws = DeviceBuf::zeros(stream, GEMM_WORKSPACE)?;
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
            let mm = LtMatmul::new_fp8("fp8-probe", k, n, with_bias.then_some(&bias_b), relu, a_scale, b_scale)?;
            mm.enqueue(&rt, m, xb.ptr(), wb.ptr(), if with_c { res_b.ptr() } else { 0 }, y.ptr())?;
            let mut out = vec![half::f16::ZERO; m * n];
            // SAFETY: `y` holds m·n f16 values, as `out` does; the stream is synchronised before
            // `out` is read.
            unsafe { drv::memcpy_dtoh_async(&mut out, y.ptr(), stream.cu_stream()) }.map_err(cuda_err("copying to the host"))?;
            stream.synchronize().map_err(cuda_err("running the FP8 GEMM"))?;
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
