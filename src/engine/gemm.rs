//! cuBLASLt layers: a stride-1 1×1 convolution in NHWC is the GEMM `[N·H·W, Cin] × [Cin, Cout]`,
//! and Linear is `[N·L, in] × [in, out]` (`[N, L, in]` inputs, L = 1 for `[N, in]`). Bias and ReLU run in the GEMM's epilogue; a residual is
//! passed as C with beta = 1 (ANCHORS: 1.9× faster than cuDNN's fused call on ResNet-50's 1×1s).
//!
//! cuBLAS is column-major, so the row-major `Y[M, Cout] = X[M, Cin] · Wᵀ` is computed as the
//! column-major `Yᵀ[Cout, M] = W[Cout, Cin] · Xᵀ[Cin, M]`: A = W read transposed from its
//! row-major `[Cout, Cin]` storage, B = X as stored, D = Y as stored; the bias runs along D's rows.

use super::gpu::cuda_err;
use super::layer::{DeviceBuf, Elem, Layer, LayerCtx, RunCtx, ValueId};
use super::Precision;
use crate::LowerKind;
use crate::{Error, Result};
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, Mutex};

/// Workspace offered to cuBLASLt's heuristic (kernels with split-K need some).
pub const GEMM_WORKSPACE: usize = 32 << 20;

struct MatDesc(sys::cublasLtMatmulDesc_t);
struct MatLayout(sys::cublasLtMatrixLayout_t);
// SAFETY: host-side descriptors, immutable after set-up; cuBLASLt reads them from any thread.
unsafe impl Send for MatDesc {}
// SAFETY: as for `Send`: shared use only reads them.
unsafe impl Sync for MatDesc {}
// SAFETY: as for `MatDesc`.
unsafe impl Send for MatLayout {}
// SAFETY: as for `MatDesc`.
unsafe impl Sync for MatLayout {}
impl Drop for MatDesc {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_desc` and destroyed once, here.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}
impl Drop for MatLayout {
    fn drop(&mut self) {
        // SAFETY: created by `create_matrix_layout` and destroyed once, here.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

fn cuda_type(elem: Elem) -> sys::cudaDataType {
    match elem {
        Elem::F32 => sys::cudaDataType::CUDA_R_32F,
        Elem::F16 => sys::cudaDataType::CUDA_R_16F,
        Elem::U8 => sys::cudaDataType::CUDA_R_8U,
        Elem::I8 => sys::cudaDataType::CUDA_R_8I,
        Elem::E4m3 => sys::cudaDataType::CUDA_R_8F_E4M3,
    }
}

/// FP32 must not use TF32; TF32 may; FP16 accumulates in f32.
fn compute_type(p: Precision) -> sys::cublasComputeType_t {
    match p {
        Precision::Fp32 | Precision::Fp16 | Precision::Int8 | Precision::Fp8 | Precision::Best => {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        }
        Precision::Tf32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
    }
}

/// # Safety
/// `d` is a live matmul descriptor and `T` is the type cuBLASLt documents for `attr`.
unsafe fn set_attr<T>(d: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, v: &T) -> Result<()> {
    lt::set_matmul_desc_attribute(d, attr, v as *const T as *const c_void, size_of::<T>())
        .map_err(cuda_err("cublasLtMatmulDescSetAttribute"))
}

/// The reduction schemes a GEMM with output type `d` may use: for f16, split-K sums in f32 only
/// (`COMPUTE_TYPE`; unsplit algorithms have no reduction and always pass), unless
/// `KILN_GEMM_REDUCED_PRECISION_REDUCTION=1` restores cuBLASLt's default (any scheme, as PyTorch's
/// `allow_fp16_reduced_precision_reduction`), for A/B measurements. `None`: no mask.
fn f16_reduction_mask(d: sys::cudaDataType) -> Option<u32> {
    let reduced = std::env::var("KILN_GEMM_REDUCED_PRECISION_REDUCTION").is_ok_and(|v| v == "1");
    (d == sys::cudaDataType::CUDA_R_16F && !reduced)
        .then_some(sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32)
}

struct Plan {
    a: MatLayout,
    b: MatLayout,
    c: MatLayout,
    algo: sys::cublasLtMatmulAlgo_t,
    /// The bytes of workspace `algo` needs.
    workspace: usize,
}

/// Kiln's one cuBLASLt matmul: the row-major `Y[m, n] = act(X[m, k] · Wᵀ + bias) + beta·C`, with
/// `W` row-major `[n, k]` (PyTorch's Linear / 1×1 conv layout). Holds the descriptor with its
/// epilogue and a cache of plans (matrix layouts + the heuristic's algorithm) by row count `m`.
/// Used by every cuBLASLt layer: 1×1 convs, Linear, matmul by a constant, im2col convs.
pub struct LtMatmul {
    path: String,
    k: usize,
    n: usize,
    elem: Elem,
    /// The type of A and B: `elem`'s, or e4m3 for FP8 GEMMs (`new_fp8`).
    ab_type: sys::cudaDataType,
    desc: MatDesc,
    /// Plans by (rows, batch count).
    plans: Mutex<HashMap<(usize, usize), Arc<Plan>>>,
    batched: Option<Batched>,
}

/// A strided-batched product of two activations (attention's `Q·Kᵀ` and `P·V`, `matmul` of two
/// activations): `count` matrices per call, each operand `stride` elements after the previous.
#[derive(Clone, Copy, Debug)]
pub struct Batched {
    /// W is stored row-major `[k, n]` (a plain right operand) rather than Linear's `[n, k]`.
    pub w_kn: bool,
    /// Element strides between consecutive matrices of X, W and Y.
    pub stride_x: usize,
    pub stride_w: usize,
    pub stride_y: usize,
    /// `Y = alpha · X·W` (attention's scale).
    pub alpha: f32,
    /// Y's element type: f32 scores from f16 operands keep the softmax's input exact.
    pub out_elem: Elem,
    /// Row strides (elements) of X and Y when wider than their rows (0: k and n): attention pads
    /// its score rows to a multiple of 8 so every f16 row and matrix starts 16-byte aligned.
    pub ld_x: usize,
    pub ld_y: usize,
}

impl LtMatmul {
    /// `bias` (device, `n` values of `elem`) and `relu` go into the epilogue.
    pub fn new(path: &str, precision: Precision, elem: Elem, k: usize, n: usize, bias: Option<&DeviceBuf>, relu: bool) -> Result<Self> {
        Self::with_types(path, compute_type(precision), elem, cuda_type(elem), k, n, bias, relu)
    }

    /// An FP8 GEMM: A (the weight) and B (the activation) in e4m3 with per-tensor scales read from
    /// device f32 scalars `a_scale` / `b_scale`, f32 accumulation (`COMPUTE_32F`, f32 alpha and
    /// beta), C and D in f16, `bias` (f16, `BIAS_DATA_TYPE` 16F) and ReLU in the epilogue.
    /// cuBLASLt's FP8 kernels on sm_89/sm_90 take only the "TN" form: A transposed (the row-major
    /// `[n, k]` weight read as column-major `[k, n]`), B not (`[m, k]` rows, column-major
    /// `[k, m]`), so K-contiguous operands; K and n must be multiples of 16 (16-byte rows).
    #[allow(clippy::too_many_arguments)]
    pub fn new_fp8(path: &str, k: usize, n: usize, bias: Option<&DeviceBuf>, relu: bool, a_scale: u64, b_scale: u64) -> Result<Self> {
        let m = Self::with_types(
            path,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            Elem::F16,
            sys::cudaDataType::CUDA_R_8F_E4M3,
            k,
            n,
            bias,
            relu,
        )?;
        use sys::cublasLtMatmulDescAttributes_t as A;
        // SAFETY: `m.desc.0` is live; the scale attributes take device pointers to f32 scalars,
        // which the caller keeps alive as long as this matmul.
        unsafe {
            set_attr(m.desc.0, A::CUBLASLT_MATMUL_DESC_TRANSB, &0i32)?; // CUBLAS_OP_N: the TN form
            set_attr(m.desc.0, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale)?;
            set_attr(m.desc.0, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale)?;
        }
        Ok(m)
    }

    #[allow(clippy::too_many_arguments)]
    fn with_types(
        path: &str,
        compute: sys::cublasComputeType_t,
        elem: Elem,
        ab_type: sys::cudaDataType,
        k: usize,
        n: usize,
        bias: Option<&DeviceBuf>,
        relu: bool,
    ) -> Result<Self> {
        let raw = lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F).map_err(cuda_err("cublasLtMatmulDescCreate"))?;
        let desc = MatDesc(raw);
        use sys::cublasLtEpilogue_t as E;
        let epilogue = match (bias.is_some(), relu) {
            (true, true) => E::CUBLASLT_EPILOGUE_RELU_BIAS,
            (true, false) => E::CUBLASLT_EPILOGUE_BIAS,
            (false, true) => E::CUBLASLT_EPILOGUE_RELU,
            (false, false) => E::CUBLASLT_EPILOGUE_DEFAULT,
        };
        use sys::cublasLtMatmulDescAttributes_t as A;
        // SAFETY: `desc.0` is live; each value has the type its attribute takes.
        unsafe {
            set_attr(desc.0, A::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?; // CUBLAS_OP_T
            set_attr(desc.0, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
            if let Some(b) = bias {
                set_attr(desc.0, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &b.ptr())?;
                set_attr(desc.0, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &cuda_type(elem))?;
            }
        }
        Ok(Self { path: path.to_string(), k, n, elem, ab_type, desc, plans: Mutex::new(HashMap::new()), batched: None })
    }

    /// A strided-batched `Y = alpha · X[m, k] · W` of two activations (no bias, no epilogue).
    pub fn new_batched(path: &str, precision: Precision, elem: Elem, k: usize, n: usize, batched: Batched) -> Result<Self> {
        Self::new(path, precision, elem, k, n, None, false)?.with_batched(batched)
    }

    /// This matmul (its epilogue kept) as a strided-batched one. A `stride_w` of 0 shares one
    /// weight among the matrices, and the bias is shared too (cuBLASLt's bias batch stride is 0):
    /// a strided 1×1 convolution (`ops::conv::strided_gemm`).
    pub fn with_batched(mut self, batched: Batched) -> Result<Self> {
        if batched.w_kn {
            // SAFETY: `self.desc.0` is live; TRANSA takes an i32 (`cublasOperation_t`).
            unsafe { set_attr(self.desc.0, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, &0i32)? };
            // CUBLAS_OP_N
        }
        self.batched = Some(batched);
        Ok(self)
    }

    /// The plan for `m` rows, made once (cuBLAS is column-major: `Yᵀ[n, m] = W[n, k] · Xᵀ[k, m]`,
    /// A = W read transposed from its row-major storage, B = X and D = Y as stored).
    /// Batched: `count` such products, each layout strided by its operand's stride; a `[k, n]` W
    /// is A = W as stored (col-major `[n, k]`, not transposed).
    fn plan(&self, rt: &RunCtx, m: usize, count: usize) -> Result<Arc<Plan>> {
        let mut plans = self.plans.lock().map_err(|_| Error::Poisoned { path: self.path.clone(), what: "GEMM plan".into() })?;
        if let Some(p) = plans.get(&(m, count)) {
            return Ok(p.clone());
        }
        let t = cuda_type(self.elem);
        let layout = |t: sys::cudaDataType, rows: usize, cols: usize, ld: usize, stride: Option<usize>| {
            let l = lt::create_matrix_layout(t, rows as u64, cols as u64, ld as i64)
                .map(MatLayout)
                .map_err(cuda_err("cublasLtMatrixLayoutCreate"))?;
            if let Some(stride) = stride {
                let (count, stride) = (
                    i32::try_from(count).map_err(|_| self.too_large("batch count", count))?,
                    i64::try_from(stride).map_err(|_| self.too_large("batch stride", stride))?,
                );
                use sys::cublasLtMatrixLayoutAttribute_t as L;
                // SAFETY: `l.0` is live; BATCH_COUNT takes an i32, STRIDED_BATCH_OFFSET an i64.
                unsafe {
                    lt::set_matrix_layout_attribute(l.0, L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count as *const i32 as *const c_void, 4)
                        .and_then(|_| {
                            lt::set_matrix_layout_attribute(
                                l.0,
                                L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                &stride as *const i64 as *const c_void,
                                8,
                            )
                        })
                        .map_err(cuda_err("cublasLtMatrixLayoutSetAttribute"))?;
                }
            }
            Ok::<_, Error>(l)
        };
        let bt = self.batched;
        let a = match bt {
            Some(b) if b.w_kn => layout(self.ab_type, self.n, self.k, self.n, Some(b.stride_w))?,
            _ => layout(self.ab_type, self.k, self.n, self.k, bt.map(|b| b.stride_w))?,
        };
        let ld = |ld: usize, dense: usize| if ld == 0 { dense } else { ld };
        let b = layout(self.ab_type, self.k, m, ld(bt.map_or(0, |b| b.ld_x), self.k), bt.map(|b| b.stride_x))?;
        let c_type = bt.map_or(t, |b| cuda_type(b.out_elem));
        let c = layout(c_type, self.n, m, ld(bt.map_or(0, |b| b.ld_y), self.n), bt.map(|b| b.stride_y))?;
        let pref = lt::create_matmul_pref().map_err(cuda_err("cublasLtMatmulPreferenceCreate"))?;
        // Plans are made with one workspace limit wherever they are made (build, timing or run),
        // so an engine and its reload choose alike; the arena then holds what the plan needs.
        let ws = GEMM_WORKSPACE;
        // SAFETY: `pref`, the descriptor and the layouts are live; `ws` and the reduction masks
        // (u32, the type REDUCTION_SCHEME_MASK takes) outlive the calls; `pref` is destroyed
        // once, after its last use.
        let heuristic = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const usize as *const c_void,
                size_of::<usize>(),
            );
            // Split-K partial sums of an f16 output in f32, not f16 (the OUTPUT_TYPE and INPLACE
            // schemes add parts up in the output type): a K = 960 row split four ways rounds
            // three more times in f16 (issue 28, item 5). The mask is dropped again only if no
            // algorithm passes it.
            let masked = f16_reduction_mask(c_type).map(|mask| {
                lt::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                    &mask as *const u32 as *const c_void,
                    size_of::<u32>(),
                )
            });
            let mut h = set.and_then(|_| lt::get_matmul_algo_heuristic(rt.handles.lt, self.desc.0, a.0, b.0, c.0, c.0, pref));
            if h.is_err() && matches!(masked, Some(Ok(()))) {
                let all = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_MASK as u32;
                h = lt::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                    &all as *const u32 as *const c_void,
                    size_of::<u32>(),
                )
                .and_then(|_| lt::get_matmul_algo_heuristic(rt.handles.lt, self.desc.0, a.0, b.0, c.0, c.0, pref));
            }
            let _ = lt::destroy_matmul_pref(pref);
            h.map_err(|e| Error::Cuda {
                context: format!("cuBLASLt has no algorithm for `{}` with {m} rows", self.path),
                reason: format!("{e:?}"),
            })?
        };
        let p = Arc::new(Plan { a, b, c, algo: heuristic.algo, workspace: heuristic.workspaceSize });
        plans.insert((m, count), p.clone());
        Ok(p)
    }

    fn too_large(&self, what: &str, v: usize) -> Error {
        Error::Cuda { context: format!("cuBLASLt GEMM `{}`", self.path), reason: format!("{what} {v} exceeds cuBLASLt's range") }
    }

    /// The workspace the plan for `m` rows (`count` strided matrices) needs: exact once the plan
    /// is made (`prepare`), the heuristic's limit before.
    pub fn workspace(&self, m: usize, count: usize) -> usize {
        let plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        plans.get(&(m, count)).map_or(GEMM_WORKSPACE, |p| p.workspace)
    }

    /// Makes the plan for `m` rows (`count` strided matrices) now rather than at the first run.
    pub fn prepare(&self, rt: &RunCtx, m: usize, count: usize) -> Result<()> {
        self.plan(rt, m, count).map(|_| ())
    }

    /// Enqueues `Y = act(X · Wᵀ + bias) + C` (`c` = 0: no C) for `m` rows at device addresses.
    pub fn enqueue(&self, rt: &RunCtx, m: usize, x: u64, w: u64, c: u64, y: u64) -> Result<()> {
        self.enqueue_batched(rt, m, 1, x, w, c, y)
    }

    /// `enqueue` for `count` strided matrices (a batched matmul; `count` is 1 otherwise).
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue_batched(&self, rt: &RunCtx, m: usize, count: usize, x: u64, w: u64, c: u64, y: u64) -> Result<()> {
        let p = self.plan(rt, m, count)?;
        if rt.workspace_bytes < p.workspace {
            return Err(Error::Cuda {
                context: format!("cublasLtMatmul for `{}` with {m} rows", self.path),
                reason: format!("its algorithm needs {} bytes of workspace, the run gives {}", p.workspace, rt.workspace_bytes),
            });
        }
        let alpha = self.batched.map_or(1f32, |b| b.alpha);
        let beta = if c != 0 { 1f32 } else { 0f32 };
        let c = if c != 0 { c } else { y };
        // SAFETY: the plan's layouts describe `m` rows of X and Y and the `[n, k]` weight (`count`
        // strided copies of each when batched), which the callers' buffers hold (arena values sized
        // for the run's batch, uploaded weights); the workspace is this layer's part of the arena,
        // `rt.workspace_bytes` long, at least the `p.workspace` bytes checked above.
        unsafe {
            lt::matmul(
                rt.handles.lt,
                self.desc.0,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w as *const c_void,
                p.a.0,
                x as *const c_void,
                p.b.0,
                c as *const c_void,
                p.c.0,
                y as *mut c_void,
                p.c.0,
                &p.algo,
                rt.workspace as *mut c_void,
                rt.workspace_bytes,
                rt.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(cuda_err("cublasLtMatmul"))
    }
}

/// `Y = act(X · Wᵀ + bias + residual)` over NHWC rows.
pub struct GemmLayer {
    path: String,
    x: ValueId,
    y: ValueId,
    z: Option<ValueId>,
    /// GEMM rows per image (H·W for a 1×1 conv, the product of the middle dims for Linear).
    rows_per_image: usize,
    _w: DeviceBuf,
    w_ptr: u64,
    _b: Option<DeviceBuf>,
    matmul: LtMatmul,
}

/// What a GEMM layer is asked to do (cuBLASLt's FP16/FP32 GEMM, or the FP8 candidate of
/// `ops::quant::fp8_gemm`).
#[derive(Clone, Copy)]
pub struct GemmSpec<'a> {
    pub x: ValueId,
    pub y: ValueId,
    pub residual: Option<ValueId>,
    pub rows_per_image: usize,
    /// Row-major `[out, in]` (PyTorch's Linear and 1×1 conv layout).
    pub weight: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub relu: bool,
}

impl GemmLayer {
    pub fn new(ctx: &mut LayerCtx, spec: GemmSpec) -> Result<Self> {
        let n_out = ctx
            .value(spec.y)
            .chw()
            .map(|(c, _, _)| c)
            .ok_or_else(|| ctx.err(LowerKind::Unsupported, "output is not an image or vector"))?;
        let k =
            ctx.value(spec.x).chw().map(|(c, _, _)| c).ok_or_else(|| ctx.err(LowerKind::Unsupported, "input is not an image or vector"))?;
        Self::with_dims(ctx, spec, k, n_out)
    }

    /// A GEMM over the rows of contiguous values `[..., K]` -> `[..., N]` (Linear on `[N, L, in]`,
    /// `x @ W`): K and N are the last dims, `spec.rows_per_image` the product of the others.
    pub fn new_matrix(ctx: &mut LayerCtx, spec: GemmSpec) -> Result<Self> {
        let (dx, dy) = (ctx.value(spec.x).clone(), ctx.value(spec.y).clone());
        let contiguous = |d: &super::layer::ValueDesc| d.layout.same_bytes(super::layer::Layout::contiguous(d.dims.len()), &d.dims);
        let (k, n_out) = match (dx.dims.last(), dy.dims.last()) {
            (Some(&k), Some(&n)) if contiguous(&dx) && contiguous(&dy) => (k, n),
            _ => {
                return Err(ctx.err(
                    LowerKind::Unsupported,
                    format!("GEMM rows need contiguous values, got {:?} {:?} -> {:?} {:?}", dx.layout, dx.dims, dy.layout, dy.dims),
                ))
            }
        };
        let rows = spec.rows_per_image;
        if rows.checked_mul(k) != Some(dx.per_image_elems()) || rows.checked_mul(n_out) != Some(dy.per_image_elems()) {
            return Err(ctx.err(LowerKind::Operands, format!("{rows} rows per image do not fit {:?} -> {:?}", dx.dims, dy.dims)));
        }
        Self::with_dims(ctx, spec, k, n_out)
    }

    fn with_dims(ctx: &mut LayerCtx, spec: GemmSpec, k: usize, n_out: usize) -> Result<Self> {
        if spec.weight.len() != n_out * k {
            return Err(ctx.err(LowerKind::Weights, format!("weight has {} values for a {k} → {n_out} GEMM", spec.weight.len())));
        }
        let elem = ctx.elem();
        let w = ctx.upload(spec.weight)?;
        let b = match spec.bias {
            Some(b) => Some(ctx.upload(b)?),
            None => None,
        };
        let path = ctx.path().to_string();
        let matmul = LtMatmul::new(&path, ctx.precision(), elem, k, n_out, b.as_ref(), spec.relu)?;
        Ok(Self { path, x: spec.x, y: spec.y, z: spec.residual, rows_per_image: spec.rows_per_image, w_ptr: w.ptr(), _w: w, _b: b, matmul })
    }
}

impl Layer for GemmLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "cublaslt-gemm".into()
    }
    fn workspace_bytes(&self, batch: usize) -> usize {
        self.matmul.workspace(batch * self.rows_per_image, 1)
    }
    fn prepare(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        self.matmul.prepare(rt, batch * self.rows_per_image, 1)
    }
    fn overwrites(&self) -> Option<(ValueId, ValueId)> {
        // cuBLASLt computes D in place of C when both have one layout (as here: C is the residual).
        self.z.map(|z| (self.y, z))
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let c = self.z.map_or(0, |z| rt.ptr(z));
        self.matmul.enqueue(rt, batch * self.rows_per_image, rt.ptr(self.x), self.w_ptr, c, rt.ptr(self.y))
    }
}

/// `Y = X · W` of two activations over `batch · count_per_image` strided matrices (`torch.matmul`
/// of `[.., M, K]` and `[.., K, N]` with the same leading dims), one cuBLASLt call.
pub struct BatchedGemmLayer {
    path: String,
    x: ValueId,
    w: ValueId,
    y: ValueId,
    m: usize,
    count_per_image: usize,
    matmul: LtMatmul,
}

impl BatchedGemmLayer {
    /// X `[count, m, k]`, W `[count, k, n]`, Y `[count, m, n]` per image, all contiguous.
    #[allow(clippy::too_many_arguments)]
    pub fn new(ctx: &LayerCtx, x: ValueId, w: ValueId, y: ValueId, [m, k, n]: [usize; 3], count_per_image: usize) -> Result<Self> {
        let elem = ctx.value(y).elem;
        if ctx.value(x).elem != elem || ctx.value(w).elem != elem {
            return Err(ctx.err(LowerKind::Unsupported, "a batched GEMM needs one element type for its operands and output"));
        }
        let path = ctx.path().to_string();
        let batched =
            Batched { w_kn: true, stride_x: m * k, stride_w: k * n, stride_y: m * n, alpha: 1.0, out_elem: elem, ld_x: 0, ld_y: 0 };
        let matmul = LtMatmul::new_batched(&path, ctx.precision(), elem, k, n, batched)?;
        Ok(Self { path, x, w, y, m, count_per_image, matmul })
    }
}

impl Layer for BatchedGemmLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "cublaslt-batched-gemm".into()
    }
    fn workspace_bytes(&self, _batch: usize) -> usize {
        GEMM_WORKSPACE
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        self.matmul.enqueue_batched(rt, self.m, batch * self.count_per_image, rt.ptr(self.x), rt.ptr(self.w), 0, rt.ptr(self.y))
    }
}
