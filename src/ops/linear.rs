//! Linear (fully connected): `y = x Wᵀ + b` over the last dim, and `matmul` / `bmm` of two
//! activations (or of an activation and a constant), broadcasting batch dims as PyTorch.

use crate::engine::hopper_gemm::HopperAct;
use crate::engine::layer::Chain;
use crate::engine::{Layer, Layout};
use crate::error::OpError;
use crate::graph::{NodeId, Op};
use crate::module::{Forward, Module};
use crate::ops::elementwise::{activation_in_place, Unary};
use crate::ops::BuildCtx;
use crate::ops::{AtenImport, CpuArgs, FixtureTwin, LayoutPlan, NnLayer, OpDef};
use crate::tensor::{Param, Tensor};
use crate::var_builder::VarBuilder;
use crate::LowerKind;
use crate::Result;
use serde::{Deserialize, Serialize};

/// This family's layers, as `kiln::nn` shows them.
pub mod nn {
    pub use super::{Linear, LinearConfig};
}

/// Matrix products. Inputs: Linear: x `[N, ..., in]`, weight `[out, in]`, bias? `[out]`,
/// residual? (the output's shape); Matmul: a `[N, ..., M, K]`, b `[N, ..., K, P]` (an activation,
/// or a constant `[..., K, P]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, strum::EnumIter)]
pub enum Gemm {
    Linear {
        bias: bool,
        /// `x Wᵀ + b + residual`: an Add fused by `passes::fuse_linear_add` (cuBLASLt's C with
        /// beta = 1 on the GPU). Graph files written before it have no such field: false.
        #[serde(default)]
        residual: bool,
    },
    /// `act(x Wᵀ + b)`: a Linear and the activation that alone reads it, fused by
    /// `passes::fuse_linear_activation` (the wgmma GEMM's epilogue on sm_90; elsewhere cuBLASLt's
    /// GEMM and an in-place activation kernel). Inputs as Linear's without a residual.
    LinearAct { bias: bool, act: GemmAct },
    /// `torch.matmul(a, b)` with both of rank >= 2: the batch dims broadcast; `a` sets the
    /// output's rank (its dim 0 is the batch).
    Matmul,
}

/// The activation a fused Linear applies (`Gemm::LinearAct`): the ones both the wgmma GEMM's
/// epilogue and the elementwise kernels run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum GemmAct {
    #[default]
    Relu,
    /// erf-GELU (`nn.GELU()`), which cuBLASLt's epilogues lack.
    Gelu,
    /// tanh-GELU (`nn.GELU(approximate="tanh")`).
    GeluTanh,
    Silu,
}

impl GemmAct {
    /// The unary op it stands for (the CPU applies exactly that op, so a fused graph's outputs
    /// are bit-identical to the unfused one's).
    pub fn unary(self) -> Unary {
        match self {
            GemmAct::Relu => Unary::Relu,
            GemmAct::Gelu => Unary::Gelu { tanh: false },
            GemmAct::GeluTanh => Unary::Gelu { tanh: true },
            GemmAct::Silu => Unary::Silu,
        }
    }
    /// The activation that fuses as `op`, if any.
    pub fn of(op: Unary) -> Option<Self> {
        match op {
            Unary::Relu => Some(GemmAct::Relu),
            Unary::Gelu { tanh: false } => Some(GemmAct::Gelu),
            Unary::Gelu { tanh: true } => Some(GemmAct::GeluTanh),
            Unary::Silu => Some(GemmAct::Silu),
            _ => None,
        }
    }
    fn hopper(self) -> HopperAct {
        match self {
            GemmAct::Relu => HopperAct::Relu,
            GemmAct::Gelu => HopperAct::Gelu,
            GemmAct::GeluTanh => HopperAct::GeluTanh,
            GemmAct::Silu => HopperAct::Silu,
        }
    }
}

impl OpDef for Gemm {
    fn name(&self) -> &str {
        match self {
            Gemm::Linear { .. } | Gemm::LinearAct { .. } => "linear",
            Gemm::Matmul => "matmul",
        }
    }
    fn infer_shape(&self, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
        match *self {
            Gemm::Linear { bias, residual } => linear_residual_shape(bias, residual, inputs),
            Gemm::LinearAct { bias, .. } => linear_shape(bias, inputs),
            Gemm::Matmul => matmul_shape(inputs),
        }
    }
    fn cpu(&self, args: &mut CpuArgs) -> Result<HostTensor, OpError> {
        match *self {
            Gemm::Linear { bias, residual } => linear_residual_cpu(bias, residual, &args.all()?),
            Gemm::LinearAct { bias, act } => {
                let mut y = linear_cpu(bias, &args.all()?)?;
                let op = act.unary();
                y.data.iter_mut().for_each(|v| *v = op.apply(*v));
                Ok(y)
            }
            Gemm::Matmul => matmul_cpu(&args.all()?),
        }
    }
    fn layouts(&self, inputs: &[Option<Layout>], out_rank: usize) -> LayoutPlan {
        LayoutPlan::all(inputs, Layout::contiguous(out_rank))
    }
    fn entry_points(&self) -> Vec<String> {
        // Batched matmuls of activations; the rest are cuBLASLt GEMMs.
        crate::engine::launch::typed_entry_points(&["matmul"])
    }
    fn convert(&self, ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        match *self {
            Gemm::Linear { bias, residual } => gpu_linear(ctx, node, bias, residual, None),
            Gemm::LinearAct { bias, act } => gpu_linear(ctx, node, bias, false, Some(act)),
            Gemm::Matmul => gpu_matmul(ctx, node),
        }
    }
    fn label(&self) -> String {
        match self {
            Gemm::Linear { bias, residual } => {
                format!("linear{}{}", if *bias { " +bias" } else { "" }, if *residual { " +residual" } else { "" })
            }
            Gemm::LinearAct { bias, act } => format!("linear{} +{}", if *bias { " +bias" } else { "" }, act.unary().name()),
            Gemm::Matmul => "matmul".into(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearConfig {
    pub in_features: usize,
    pub out_features: usize,
    pub bias: bool,
}

impl LinearConfig {
    pub fn new(in_features: usize, out_features: usize) -> Self {
        Self { in_features, out_features, bias: true }
    }
}

impl Default for LinearConfig {
    fn default() -> Self {
        Self::new(1, 1)
    }
}

/// `torch.nn.Linear`: `weight` `[out, in]`, `bias` `[out]`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub path: String,
    pub weight: Param,
    pub bias: Option<Param>,
}

impl Module for Linear {
    type Config = LinearConfig;
    fn load(vb: VarBuilder, c: &LinearConfig) -> Result<Self> {
        let weight = vb.get(&[c.out_features, c.in_features], "weight")?;
        let bias = if c.bias { Some(vb.get(&[c.out_features], "bias")?) } else { None };
        Ok(Self { path: vb.path().to_string(), weight, bias })
    }
}

impl Forward for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let params: Vec<&Param> = std::iter::once(&self.weight).chain(&self.bias).collect();
        Tensor::record(&self.path, Op::Gemm(Gemm::Linear { bias: self.bias.is_some(), residual: false }), &[x], &params)
    }
}

/// `inputs` = x `[N, ..., in]`, weight `[out, in]`, bias? `[out]`.
pub fn linear_shape(bias: bool, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    if inputs.len() != 2 + bias as usize {
        return Err(format!("linear expects {} inputs, got {}", 2 + bias as usize, inputs.len()).into());
    }
    let (x, w) = (inputs[0], inputs[1]);
    if x.len() < 2 || w.len() != 2 {
        return Err(format!("linear expects an [N, ..., in] input and an [out, in] weight, got {x:?} and {w:?}").into());
    }
    let fin = x[x.len() - 1];
    if fin != w[1] {
        return Err(format!("input {x:?} has {fin} features, but the weight {w:?} expects {}", w[1]).into());
    }
    if bias && inputs[2] != [w[0]] {
        return Err(format!("bias must have shape [{}], got {:?}", w[0], inputs[2]).into());
    }
    let mut out = x.to_vec();
    *out.last_mut().expect("rank >= 2") = w[0];
    Ok(out)
}

/// `inputs` = x `[N, ..., in]`, weight `[out, in]`, bias? `[out]`, then with `residual` a tensor
/// of the output's shape, added to it.
pub fn linear_residual_shape(bias: bool, residual: bool, inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    if !residual {
        return linear_shape(bias, inputs);
    }
    let Some((r, rest)) = inputs.split_last().filter(|_| inputs.len() == 3 + bias as usize) else {
        return Err(format!("linear with a residual expects {} inputs, got {}", 3 + bias as usize, inputs.len()).into());
    };
    let out = linear_shape(bias, rest)?;
    if *r != out.as_slice() {
        return Err(format!("the residual {r:?} must have the linear's output shape {out:?}").into());
    }
    Ok(out)
}

impl Tensor {
    /// `torch.matmul(self, other)` of two activations (both of rank >= 2, batch dims broadcast,
    /// `other` of `self`'s rank: both carry the batch as dim 0).
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        Tensor::record_inline(Op::Gemm(Gemm::Matmul), &[self, other])
    }
    /// `torch.bmm(self, other)`: `[N, M, K] @ [N, K, P]`.
    pub fn bmm(&self, other: &Tensor) -> Result<Tensor> {
        if self.shape().len() != 3 || other.shape().len() != 3 {
            return Err(crate::Error::Shape {
                path: self.scope_path("bmm"),
                op: "bmm".into(),
                reason: "bmm expects two rank-3 tensors".into(),
                got: vec![self.shape().to_vec(), other.shape().to_vec()],
            });
        }
        self.matmul(other)
    }
    /// `self @ weight` with a constant `weight` `[..., K, P]` (a parameter, not transposed as
    /// Linear's), recorded as the layer at `path`.
    pub fn matmul_weight(&self, path: &str, weight: &Param) -> Result<Tensor> {
        Tensor::record(path, Op::Gemm(Gemm::Matmul), &[self], &[weight])
    }
}

/// `inputs` = a `[..., M, K]`, b `[..., K, P]`: the broadcast batch dims, then `[M, P]`.
pub fn matmul_shape(inputs: &[&[usize]]) -> Result<Vec<usize>, OpError> {
    let [a, b] = inputs else {
        return Err(format!("matmul expects 2 inputs, got {}", inputs.len()).into());
    };
    let (ra, rb) = (a.len(), b.len());
    if ra < 2 || rb < 2 {
        return Err(format!("matmul expects operands of rank >= 2, got {a:?} and {b:?}").into());
    }
    if rb > ra {
        return Err(format!(
            "matmul of {a:?} and {b:?}: the second operand has more dims, which would move the batch (the engine keeps the batch as dim 0)"
        )
        .into());
    }
    if a[ra - 1] != b[rb - 2] {
        return Err(format!("matmul of {a:?} and {b:?}: {} columns against {} rows", a[ra - 1], b[rb - 2]).into());
    }
    let mut out = a[..ra - 2].to_vec();
    for (i, &nb) in b[..rb - 2].iter().enumerate() {
        let o = &mut out[ra - rb + i];
        match (*o, nb) {
            (x, y) if x == y || y == 1 => {}
            (1, y) if ra - rb + i > 0 => *o = y,
            _ => return Err(format!("matmul of {a:?} and {b:?}: batch dims do not broadcast").into()),
        }
    }
    out.extend([a[ra - 2], b[rb - 1]]);
    Ok(out)
}

/// Element strides of `shape`'s dims aligned to the right of `out_batch` (0 where `shape` has
/// no such dim or broadcasts it), for the batch dims only.
fn batch_strides(shape: &[usize], out_batch: &[usize]) -> Vec<usize> {
    let r = shape.len();
    let lead = out_batch.len() - (r - 2);
    (0..out_batch.len())
        .map(|d| match d.checked_sub(lead) {
            Some(i) if shape[i] != 1 => shape[i + 1..].iter().product(),
            _ => 0,
        })
        .collect()
}

// ---- CPU reference

use crate::graph::HostTensor;

/// `x·Wᵀ + b` with `inputs` = x `[N, ..., in]` (rows: all but the last dim), weight `[out, in]`, bias? `[out]`: one GEMM onto the bias.
pub fn linear_cpu(bias: bool, inputs: &[&HostTensor]) -> Result<HostTensor, OpError> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let out_shape = linear_shape(bias, &shapes)?;
    let (x, w) = (inputs[0], inputs[1]);
    let (fin, fout) = (w.shape[1], w.shape[0]);
    let n: usize = x.shape[..x.shape.len() - 1].iter().product();
    let mut out = vec![0.0f32; n * fout];
    if bias {
        for row in out.chunks_exact_mut(fout.max(1)) {
            row.copy_from_slice(&inputs[2].data);
        }
    }
    if n > 0 && fin > 0 && fout > 0 {
        // SAFETY: x is n×fin row-major, W is fout×fin read transposed (strides 1, fin), out is n×fout;
        // the shape rule checked these extents and `out` is a distinct buffer.
        unsafe {
            matrixmultiply::sgemm(
                n,
                fin,
                fout,
                1.0,
                x.data.as_ptr(),
                fin as isize,
                1,
                w.data.as_ptr(),
                1,
                fin as isize,
                1.0,
                out.as_mut_ptr(),
                fout as isize,
                1,
            )
        }
    }
    Ok(HostTensor::new(out_shape, out))
}

/// `linear_cpu`, then with `residual` the last input added element by element: the same f32
/// sums as the separate Add it replaces, so a fused graph's CPU outputs are bit-identical.
pub fn linear_residual_cpu(bias: bool, residual: bool, inputs: &[&HostTensor]) -> Result<HostTensor, OpError> {
    if !residual {
        return linear_cpu(bias, inputs);
    }
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    linear_residual_shape(bias, true, &shapes)?;
    let (r, rest) = inputs.split_last().expect("the shape rule checked the arity");
    let mut out = linear_cpu(bias, rest)?;
    out.data.iter_mut().zip(&r.data).for_each(|(y, r)| *y += r);
    Ok(out)
}

/// `torch.matmul` with `inputs` = a `[..., M, K]`, b `[..., K, P]`: one GEMM per output batch.
pub fn matmul_cpu(inputs: &[&HostTensor]) -> Result<HostTensor, OpError> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let out_shape = matmul_shape(&shapes)?;
    let (a, b) = (inputs[0], inputs[1]);
    let r = out_shape.len();
    let (m, k, p) = (out_shape[r - 2], a.shape[a.shape.len() - 1], out_shape[r - 1]);
    let batch = &out_shape[..r - 2];
    let (sa, sb) = (batch_strides(&a.shape, batch), batch_strides(&b.shape, batch));
    let count: usize = batch.iter().product();
    let mut out = vec![0.0f32; count * m * p];
    if m * k * p == 0 {
        return Ok(HostTensor::new(out_shape, out));
    }
    for z in 0..count {
        let (mut rem, mut ao, mut bo) = (z, 0, 0);
        for d in (0..batch.len()).rev() {
            let i = rem % batch[d];
            rem /= batch[d];
            ao += i * sa[d];
            bo += i * sb[d];
        }
        let dst = &mut out[z * m * p..(z + 1) * m * p];
        // SAFETY: a's block at `ao` is m×k row-major, b's at `bo` is k×p, dst is m×p; the shape rule
        // and the broadcast strides keep every block inside its buffer.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                p,
                1.0,
                a.data[ao..].as_ptr(),
                k as isize,
                1,
                b.data[bo..].as_ptr(),
                p as isize,
                1,
                0.0,
                dst.as_mut_ptr(),
                p as isize,
                1,
            )
        }
    }
    Ok(HostTensor::new(out_shape, out))
}

// ---- GPU converter (engine::gemm)

/// Linear as one cuBLASLt GEMM with the bias in its epilogue and a residual as C (beta = 1),
/// timed against the wgmma GEMM on sm_90 (and FP8 GEMMs in FP8 engines). A fused activation
/// (`act`) is ReLU in cuBLASLt's epilogue or an in-place activation kernel after it, and the
/// wgmma GEMM's own epilogue.
fn gpu_linear(ctx: &mut BuildCtx, node: NodeId, bias: bool, residual: bool, act: Option<GemmAct>) -> Result<Box<dyn Layer>> {
    use crate::engine::gemm::{GemmLayer, GemmSpec};
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let w = ctx.weight(node, 1)?;
    let b = if bias { Some(ctx.weight(node, 2)?.data.as_slice()) } else { None };
    let residual = if residual { Some(ctx.input(node, 2 + bias as usize)?) } else { None };
    if let Some(r) = residual {
        // cuBLASLt reads C with D's layout and type: the layout plan asks for every input
        // contiguous, as Y is, and the builder casts inputs to the layer's type.
        let (dr, dy) = (ctx.value(r), ctx.value(y));
        if dr.dims != dy.dims || dr.elem != dy.elem || !dr.layout.same_bytes(dy.layout, &dy.dims) {
            let why = format!(
                "the residual ({:?} {:?} {:?}) must be stored as the output ({:?} {:?} {:?})",
                dr.elem, dr.layout, dr.dims, dy.elem, dy.layout, dy.dims
            );
            return Err(ctx.err(node, LowerKind::Operands, why));
        }
    }
    let rows_per_image = ctx.value(y).per_image_elems() / w.shape[0].max(1);
    let relu = act == Some(GemmAct::Relu);
    let spec = GemmSpec { x, y, residual, rows_per_image, weight: &w.data, bias: b, relu };
    let lt: Box<dyn Layer> = Box::new(GemmLayer::new_matrix(ctx, spec)?);
    let lt = match act.filter(|_| !relu) {
        Some(a) => Box::new(Chain { first: lt, second: Box::new(activation_in_place(ctx, y, a.unary())?), mid: None }),
        None => lt,
    };
    let mut fp16 = vec![lt];
    fp16.extend(wgmma_candidates(ctx, spec, act.map_or(HopperAct::None, GemmAct::hopper)));
    if act.is_none() {
        return crate::ops::quant::fp8_gemm::or_fp16(ctx, node, spec, fp16);
    }
    // The fused activation has no FP8 form (the fusion pass leaves quantised Linears alone).
    if fp16.len() == 1 {
        return Ok(fp16.pop().expect("one candidate"));
    }
    let key = ctx.problem_key(node);
    ctx.choose(&key, fp16)
}

/// The wgmma GEMM's tiles for a Linear where the device (sm_90), the precision (FP16) and the
/// shape (K a multiple of 8) allow it, each a candidate timed against cuBLASLt; none elsewhere. A
/// tile that cannot be built here (its kernel failed to compile or load) is left out with a
/// warning rather than failing the build: cuBLASLt still runs the layer.
fn wgmma_candidates(ctx: &mut BuildCtx, spec: crate::engine::gemm::GemmSpec, act: HopperAct) -> Vec<Box<dyn Layer>> {
    use crate::engine::hopper_gemm::{supports, HopperGemmLayer, HopperGemmSpec, HopperGrid, HopperTile};
    let (k, n) = (ctx.value(spec.x).dims.last().copied().unwrap_or(0), ctx.value(spec.y).dims.last().copied().unwrap_or(0));
    if supports(ctx.kernels.arch(), ctx.elem(), k, n).is_err() {
        return Vec::new();
    }
    let hs = HopperGemmSpec {
        x: spec.x,
        y: spec.y,
        residual: spec.residual,
        rows_per_image: spec.rows_per_image,
        weight: spec.weight,
        bias: spec.bias,
        act,
    };
    let mut out: Vec<Box<dyn Layer>> = Vec::new();
    for tile in HopperTile::ALL {
        for grid in [HopperGrid::PerTile, HopperGrid::Persistent] {
            match HopperGemmLayer::new(ctx, hs, tile, grid) {
                Ok(layer) => out.push(Box::new(layer)),
                Err(e) => tracing::warn!(path = %ctx.path(), tile = ?tile, error = %e, "wgmma GEMM candidate left out"),
            }
        }
    }
    out
}

/// `a @ W` with a constant rank-2 `W` is one cuBLASLt GEMM over a's rows (W transposed on the
/// host to Linear's `[P, K]`); every other matmul runs our batched, broadcasting tiled kernel, and
/// two activations with the same leading dims also get a strided-batched cuBLASLt candidate (the
/// faster one, timed, is kept).
fn gpu_matmul(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
    use crate::engine::gemm::{GemmLayer, GemmSpec};
    let (a, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let weight = ctx.weight(node, 1).ok().cloned();
    let (da, dy) = (ctx.value(a).clone(), ctx.value(y).clone());
    let ro = dy.dims.len() + 1;
    let full = |d: &[usize]| [&[1usize][..], d].concat();
    let (k, p) = (da.dims[ro - 2], dy.dims[ro - 2]);
    if let Some(w) = weight.as_ref().filter(|w| w.shape.len() == 2) {
        let mut wt = vec![0.0f32; k * p];
        for (i, row) in w.data.chunks_exact(p.max(1)).enumerate() {
            row.iter().enumerate().for_each(|(j, &v)| wt[j * k + i] = v);
        }
        let spec =
            GemmSpec { x: a, y, residual: None, rows_per_image: dy.per_image_elems() / p.max(1), weight: &wt, bias: None, relu: false };
        return Ok(Box::new(GemmLayer::new_matrix(ctx, spec)?));
    }
    if ro < 3 {
        return Err(ctx.err(
            node,
            LowerKind::Unsupported,
            format!("a rank-2 activation multiplies a constant [K, P] only, got {:?}", ctx.node(node).shape),
        ));
    }
    let m = dy.dims[ro - 3];
    // Shapes with a batch of 1 at dim 0 (activations) to compute the broadcast strides; a weight
    // as it is (it has no batch; one of the output's full rank must broadcast it).
    let b_shape = match &weight {
        Some(w) if w.shape.len() == ro && w.shape[0] != 1 => {
            return Err(ctx.err(
                node,
                LowerKind::Unsupported,
                format!("a constant operand {:?} of the output's rank would need the batch as its dim 0", w.shape),
            ))
        }
        Some(w) => w.shape.clone(),
        None => {
            let db = ctx.value(ctx.input(node, 1)?).dims.clone();
            if db.len() + 1 != ro {
                return Err(ctx.err(
                    node,
                    LowerKind::Unsupported,
                    format!("activation operands must have the same rank, got {:?} and {db:?} (per image)", da.dims),
                ));
            }
            full(&db)
        }
    };
    let out_batch = full(&dy.dims[..ro - 3]);
    let (sa, sb) = (batch_strides(&full(&da.dims), &out_batch), batch_strides(&b_shape, &out_batch));
    let mut meta: Vec<i64> = out_batch[1..].iter().map(|&v| v as i64).collect();
    meta.extend(sa[1..].iter().map(|&v| v as i64));
    meta.extend(sb[1..].iter().map(|&v| v as i64));
    let b_batch = if weight.is_some() { 0 } else { b_shape[1..].iter().product::<usize>() };
    let bytes: Vec<u8> = meta.iter().flat_map(|v| v.to_le_bytes()).collect();
    let meta_buf = ctx.upload_bytes(&bytes)?;
    let b = match &weight {
        Some(w) => MatmulB::Weight(ctx.upload(&w.data)?),
        None => MatmulB::Value(ctx.input(node, 1)?),
    };
    let int = |what: &str, v: usize| {
        i32::try_from(v).map_err(|_| ctx.err(node, LowerKind::TooLarge, format!("{what} = {v} exceeds the kernels' 32-bit range")))
    };
    let mkp = [int("M", m)?, int("K", k)?, int("P", p)?];
    let f = ctx.kernels.get(&format!("matmul_{}", dy.elem.suffix()))?;
    let tiled = Box::new(MatmulLayer {
        path: ctx.node(node).path.clone(),
        f,
        a,
        b,
        y,
        mkp,
        meta: meta_buf,
        nb: (out_batch.len() - 1) as i32,
        per_image_batches: out_batch[1..].iter().product(),
        a_batch: da.per_image_elems(),
        b_batch,
    });
    // Two activations with the same leading dims (attention's Q·Kᵀ written as matmuls): also a
    // strided-batched cuBLASLt GEMM, timed against the tiled kernel.
    if let MatmulB::Value(bv) = tiled.b {
        if ctx.value(bv).dims[..ro - 3] == da.dims[..ro - 3] {
            let count: usize = dy.dims[..ro - 3].iter().product();
            let lt = crate::engine::gemm::BatchedGemmLayer::new(ctx, a, bv, y, [m, k, p], count)?;
            let key = ctx.problem_key(node);
            return ctx.choose(&key, vec![tiled, Box::new(lt)]);
        }
    }
    Ok(tiled)
}

enum MatmulB {
    Value(crate::engine::ValueId),
    Weight(crate::engine::DeviceBuf),
}

/// `y = a @ b` over every output batch: our 16×16-tiled kernel (`matmul_*` in kernels/norm.cu).
struct MatmulLayer {
    path: String,
    f: crate::engine::launch::CudaFunction,
    a: crate::engine::ValueId,
    b: MatmulB,
    y: crate::engine::ValueId,
    mkp: [i32; 3],
    meta: crate::engine::DeviceBuf,
    nb: i32,
    per_image_batches: usize,
    a_batch: usize,
    b_batch: usize,
}

impl Layer for MatmulLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "kernel:matmul_tiled".into()
    }
    fn enqueue(&self, rt: &crate::engine::RunCtx, batch: usize) -> Result<()> {
        use crate::engine::launch::{launch, KArg};
        let [m, k, p] = self.mkp;
        let nbatch = batch * self.per_image_batches;
        let grid = ((p as u32).div_ceil(16).max(1), (m as u32).div_ceil(16).max(1), nbatch.clamp(1, 65535) as u32);
        let b = match &self.b {
            MatmulB::Value(v) => rt.ptr(*v),
            MatmulB::Weight(w) => w.ptr(),
        };
        let args = [
            KArg::Ptr(rt.ptr(self.a)),
            KArg::Ptr(b),
            KArg::Ptr(rt.ptr(self.y)),
            KArg::I32(m),
            KArg::I32(k),
            KArg::I32(p),
            KArg::I64(nbatch as i64),
            KArg::Ptr(self.meta.ptr()),
            KArg::I32(self.nb),
            KArg::I64(self.a_batch as i64),
            KArg::I64(self.b_batch as i64),
        ];
        launch(rt, &self.f, grid, (16, 16, 1), 0, &args)
    }
}

/// This family's `kiln::nn` layers, each traced on an input (for `ops::completeness`).
#[doc(hidden)]
pub const NN_LAYERS: &[NnLayer] =
    &[("Linear", |vb, t| nn::Linear::load(vb, &nn::LinearConfig::new(5, 3))?.forward(&t.input("x", &[2, 5])))];

/// The ATen ops kiln-torch imports as this family's ops.
#[doc(hidden)]
pub const ATEN: &[AtenImport] =
    &[("linear", &["aten.linear.default"]), ("matmul", &["aten.matmul.default", "aten.bmm.default", "aten.mm.default"])];

/// The Kiln twins of this family's PyTorch op fixtures (`op_cases()` in tools/export_reference.py).
#[doc(hidden)]
pub const FIXTURE_TWINS: &[FixtureTwin] = &[
    ("linear", |f| Linear::load(f.vb, &LinearConfig::new(20, 7))?.forward(f.x)),
    ("linear_rank3", |f| Linear::load(f.vb, &LinearConfig::new(12, 7))?.forward(f.x)),
    ("linear_rank4_nobias", |f| Linear::load(f.vb, &LinearConfig { bias: false, ..LinearConfig::new(8, 3) })?.forward(f.x)),
    ("matmul_bmm", |f| f.x.bmm(f.other()?)),
    ("matmul_broadcast", |f| f.x.matmul(f.other()?)),
    ("matmul_weight", |f| f.x.matmul_weight(f.case, &f.vb.get(&[9, 4], "weight")?)),
    ("matmul_weight_batched", |f| f.x.matmul_weight(f.case, &f.vb.get(&[3, 6, 4], "weight")?)),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_shape_takes_any_leading_dims() {
        assert_eq!(linear_shape(true, &[&[2, 5, 12], &[7, 12], &[7]]), Ok(vec![2, 5, 7]));
        assert_eq!(linear_shape(false, &[&[2, 12], &[7, 12]]), Ok(vec![2, 7]));
        assert!(linear_shape(false, &[&[12], &[7, 12]]).is_err());
        assert!(linear_shape(false, &[&[2, 5, 11], &[7, 12]]).unwrap_err().to_string().contains("[2, 5, 11]"));
        assert!(linear_shape(true, &[&[2, 12], &[7, 12], &[6]]).unwrap_err().to_string().contains("[6]"));
    }

    #[test]
    fn matmul_shape_broadcasts_and_keeps_the_batch_first() {
        assert_eq!(matmul_shape(&[&[2, 5, 7], &[2, 7, 3]]), Ok(vec![2, 5, 3]));
        assert_eq!(matmul_shape(&[&[2, 3, 4, 6], &[2, 1, 6, 5]]), Ok(vec![2, 3, 4, 5]));
        assert_eq!(matmul_shape(&[&[2, 3, 4, 6], &[6, 5]]), Ok(vec![2, 3, 4, 5]));
        assert_eq!(matmul_shape(&[&[2, 1, 4, 6], &[3, 6, 5]]), Ok(vec![2, 3, 4, 5]));
        assert!(matmul_shape(&[&[2, 5, 7], &[2, 6, 3]]).unwrap_err().to_string().contains("[2, 6, 3]"));
        assert!(matmul_shape(&[&[5, 7], &[2, 7, 3]]).unwrap_err().to_string().contains("batch"));
        assert!(matmul_shape(&[&[2, 3, 4, 6], &[2, 2, 6, 5]]).unwrap_err().to_string().contains("broadcast"));
        assert!(matmul_shape(&[&[2, 7], &[7]]).unwrap_err().to_string().contains("rank"));
        assert!(matmul_shape(&[&[1, 5, 7], &[2, 7, 3]]).is_err(), "a's batch may not broadcast to b's");
        assert!(matmul_shape(&[&[2, 5, 7]]).is_err());
    }

    #[test]
    fn matmul_cpu_broadcasts_a_shared_operand() {
        // a: two 1×2 rows; b: one shared 2×1 matrix (batch dim 1).
        let a = HostTensor::new(vec![2, 1, 2], vec![1.0, 2.0, 3.0, 4.0]);
        let b = HostTensor::new(vec![1, 2, 1], vec![10.0, 1.0]);
        let y = matmul_cpu(&[&a, &b]).unwrap();
        assert_eq!((y.shape.clone(), y.data), (vec![2, 1, 1], vec![12.0, 34.0]));
        let w = HostTensor::new(vec![2, 1], vec![10.0, 1.0]);
        assert_eq!(matmul_cpu(&[&a, &w]).unwrap().data, vec![12.0, 34.0]);
    }
}
