//! cuDNN layers over NHWC activations: convolution with bias, residual and ReLU fused
//! (`cudnnConvolutionBiasActivationForward`, the residual as `z`), the same as separate calls
//! where the fused call does not run, and transposed convolution (backward-data).
//!
//! Descriptors depend on the batch, so each layer creates them per batch size on first use and
//! keeps them; the algorithm is chosen once at the opt batch (a tactic).

use super::gpu::cuda_err;
use super::layer::{DeviceBuf, Elem, Layer, LayerCtx, RunCtx, ValueId};
use super::Precision;
use crate::LowerKind;
use crate::{Error, Result};
use cudarc::cudnn::sys as dnn;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub(super) fn check(status: dnn::cudnnStatus_t, what: &str) -> Result<()> {
    status.result().map_err(cuda_err(what))
}

/// A cuDNN descriptor that is destroyed with its owner. Descriptors are host structs, immutable
/// after set-up, so sharing them between threads is sound.
struct Desc<T: Copy> {
    raw: T,
    destroy: unsafe fn(T) -> dnn::cudnnStatus_t,
}
// SAFETY: a descriptor is plain data owned by this value; cuDNN descriptors may be used from any thread.
unsafe impl<T: Copy> Send for Desc<T> {}
// SAFETY: shared use only reads the descriptor (cuDNN calls take it as const).
unsafe impl<T: Copy> Sync for Desc<T> {}
impl<T: Copy> Drop for Desc<T> {
    fn drop(&mut self) {
        // Nothing to do about a failed destroy at teardown.
        // SAFETY: `raw` was created by the matching cuDNN create call and is destroyed once, here.
        let _ = unsafe { (self.destroy)(self.raw) };
    }
}

pub(super) fn data_type(elem: Elem) -> dnn::cudnnDataType_t {
    match elem {
        Elem::F32 => dnn::cudnnDataType_t::CUDNN_DATA_FLOAT,
        Elem::F16 => dnn::cudnnDataType_t::CUDNN_DATA_HALF,
        Elem::U8 => dnn::cudnnDataType_t::CUDNN_DATA_UINT8,
        Elem::I8 => dnn::cudnnDataType_t::CUDNN_DATA_INT8,
        Elem::E4m3 => dnn::cudnnDataType_t::CUDNN_DATA_FP8_E4M3,
    }
}

fn tensor(elem: Elem, [n, c, h, w]: [usize; 4]) -> Result<Desc<dnn::cudnnTensorDescriptor_t>> {
    let raw = cudarc::cudnn::result::create_tensor_descriptor().map_err(cuda_err("cudnnCreateTensorDescriptor"))?;
    let d = Desc { raw, destroy: dnn::cudnnDestroyTensorDescriptor };
    let dims = [n as i32, c as i32, h as i32, w as i32];
    // SAFETY: `d.raw` is a live tensor descriptor created above.
    unsafe { cudarc::cudnn::result::set_tensor4d_descriptor(d.raw, dnn::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC, data_type(elem), dims) }
        .map_err(cuda_err("cudnnSetTensor4dDescriptor"))?;
    Ok(d)
}

fn filter(elem: Elem, [k, c, h, w]: [usize; 4]) -> Result<Desc<dnn::cudnnFilterDescriptor_t>> {
    let raw = cudarc::cudnn::result::create_filter_descriptor().map_err(cuda_err("cudnnCreateFilterDescriptor"))?;
    let d = Desc { raw, destroy: dnn::cudnnDestroyFilterDescriptor };
    let dims = [k as i32, c as i32, h as i32, w as i32];
    // SAFETY: `d.raw` is a live filter descriptor created above.
    unsafe { cudarc::cudnn::result::set_filter4d_descriptor(d.raw, data_type(elem), dnn::cudnnTensorFormat_t::CUDNN_TENSOR_NHWC, dims) }
        .map_err(cuda_err("cudnnSetFilter4dDescriptor"))?;
    Ok(d)
}

/// FP32 must not use TF32: FMA math. FP16 uses tensor cores. For f32 data cuDNN picks TF32
/// tensor-core kernels under its default math (as PyTorch sets it with `allow_tf32`), not under
/// `TENSOR_OP_MATH` (measured: FP32-level error there on the H200).
fn math_type(p: Precision) -> dnn::cudnnMathType_t {
    match p {
        Precision::Fp32 => dnn::cudnnMathType_t::CUDNN_FMA_MATH,
        Precision::Tf32 => dnn::cudnnMathType_t::CUDNN_DEFAULT_MATH,
        Precision::Fp16 | Precision::Int8 | Precision::Fp8 | Precision::Best => dnn::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
    }
}

fn conv_desc(a: &ConvGeometry, p: Precision) -> Result<Desc<dnn::cudnnConvolutionDescriptor_t>> {
    let raw = cudarc::cudnn::result::create_convolution_descriptor().map_err(cuda_err("cudnnCreateConvolutionDescriptor"))?;
    let d = Desc { raw, destroy: dnn::cudnnDestroyConvolutionDescriptor };
    // SAFETY: `d.raw` is a live convolution descriptor created above; the arrays outlive the calls.
    unsafe {
        // Accumulate in f32 for every precision (cuDNN's "pseudo half" for f16 data).
        cudarc::cudnn::result::set_convolution2d_descriptor(
            d.raw,
            a.padding[0] as i32,
            a.padding[1] as i32,
            a.stride[0] as i32,
            a.stride[1] as i32,
            a.dilation[0] as i32,
            a.dilation[1] as i32,
            dnn::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
            dnn::cudnnDataType_t::CUDNN_DATA_FLOAT,
        )
        .map_err(cuda_err("cudnnSetConvolution2dDescriptor"))?;
        cudarc::cudnn::result::set_convolution_math_type(d.raw, math_type(p)).map_err(cuda_err("cudnnSetConvolutionMathType"))?;
        cudarc::cudnn::result::set_convolution_group_count(d.raw, a.groups as i32).map_err(cuda_err("cudnnSetConvolutionGroupCount"))?;
    }
    Ok(d)
}

fn activation(relu: bool) -> Result<Desc<dnn::cudnnActivationDescriptor_t>> {
    let raw = cudarc::cudnn::result::create_activation_descriptor().map_err(cuda_err("cudnnCreateActivationDescriptor"))?;
    let d = Desc { raw, destroy: dnn::cudnnDestroyActivationDescriptor };
    let mode = if relu { dnn::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU } else { dnn::cudnnActivationMode_t::CUDNN_ACTIVATION_IDENTITY };
    // SAFETY: `d.raw` is a live activation descriptor created above.
    unsafe { cudarc::cudnn::result::set_activation_descriptor(d.raw, mode, dnn::cudnnNanPropagation_t::CUDNN_NOT_PROPAGATE_NAN, 0.0) }
        .map_err(cuda_err("cudnnSetActivationDescriptor"))?;
    Ok(d)
}

/// Weights of a convolution as the NHWC filter format wants them: `[K, kh, kw, C]` from
/// PyTorch's `[K, C, kh, kw]`.
pub fn kcrs_to_krsc(w: &[f32], [k, c, r, s]: [usize; 4]) -> Vec<f32> {
    let mut out = vec![0f32; w.len()];
    for ki in 0..k {
        for ci in 0..c {
            for ri in 0..r {
                for si in 0..s {
                    out[((ki * r + ri) * s + si) * c + ci] = w[((ki * c + ci) * r + ri) * s + si];
                }
            }
        }
    }
    out
}

/// The geometry of a convolution as cuDNN's descriptor takes it (forward view), per spatial axis
/// (h, w).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvGeometry {
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
}

impl Default for ConvGeometry {
    fn default() -> Self {
        Self { stride: [1, 1], padding: [0, 0], dilation: [1, 1], groups: 1 }
    }
}

/// What a convolution layer applies after the sum: the bias (when `false`, `ConvProblem::bias`
/// holds zeros, which the separate calls skip) and ReLU. The residual is `ConvProblem::z`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Epilogue {
    pub bias: bool,
    pub relu: bool,
}

/// Shapes of one convolution (forward view: x → y).
#[derive(Clone, Copy, Debug)]
struct Geom {
    cin: usize,
    h: usize,
    w: usize,
    cout: usize,
    ho: usize,
    wo: usize,
}

struct BatchDescs {
    x: Desc<dnn::cudnnTensorDescriptor_t>,
    y: Desc<dnn::cudnnTensorDescriptor_t>,
}

/// How a forward convolution runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// One `cudnnConvolutionBiasActivationForward`.
    Fused,
    /// `cudnnConvolutionForward`, then bias, residual and ReLU as separate cuDNN calls.
    Separate,
}

/// Shared by all candidates of one node: weights are uploaded once.
struct ConvShared {
    path: String,
    geom: Geom,
    elem: Elem,
    x: ValueId,
    y: ValueId,
    z: Option<ValueId>,
    relu: bool,
    bias_given: bool,
    w: DeviceBuf,
    b: DeviceBuf,
    filter: Desc<dnn::cudnnFilterDescriptor_t>,
    conv: Desc<dnn::cudnnConvolutionDescriptor_t>,
    bias: Desc<dnn::cudnnTensorDescriptor_t>,
    act: Desc<dnn::cudnnActivationDescriptor_t>,
    relu_act: Desc<dnn::cudnnActivationDescriptor_t>,
    descs: Mutex<HashMap<usize, Arc<BatchDescs>>>,
}

/// The parts of a convolution that `ConvShared::new` sets up.
struct ConvSetup<'a> {
    geom: Geom,
    x: ValueId,
    y: ValueId,
    z: Option<ValueId>,
    conv: ConvGeometry,
    epilogue: Epilogue,
    /// PyTorch layout, with `shape` (uploaded as KRSC).
    weight: &'a [f32],
    shape: [usize; 4],
    /// One value per output channel of the layer (`geom.cout`).
    bias: &'a [f32],
}

impl ConvShared {
    /// Uploads the weights and bias and creates the descriptors of one convolution (shared by
    /// forward convolutions, their channel-padded variant and transposed convolutions).
    fn new(ctx: &mut LayerCtx, path: &str, s: ConvSetup) -> Result<Self> {
        // cuDNN's tensor descriptors count elements in 32 bits.
        let g = s.geom;
        let max = ctx.config.max_batch;
        for (what, dims) in [("input", [max, g.cin, g.h, g.w]), ("output", [max, g.cout, g.ho, g.wo])] {
            let elems = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            if elems.is_none_or(|n| n > i32::MAX as usize) {
                return Err(Error::Lower {
                    path: path.to_string(),
                    op: "conv2d".into(),
                    kind: LowerKind::TooLarge,
                    reason: format!(
                        "the {what} {dims:?} at the max batch {max} has more than 2^31 - 1 elements, the most cuDNN describes; lower the max batch"
                    ),
                });
            }
        }
        let elem = ctx.elem();
        let relu = s.epilogue.relu;
        Ok(Self {
            path: path.to_string(),
            geom: s.geom,
            elem,
            x: s.x,
            y: s.y,
            z: s.z,
            relu,
            bias_given: s.epilogue.bias,
            w: ctx.upload(&kcrs_to_krsc(s.weight, s.shape))?,
            b: ctx.upload(s.bias)?,
            filter: filter(elem, s.shape)?,
            conv: conv_desc(&s.conv, ctx.precision())?,
            bias: tensor(elem, [1, s.bias.len(), 1, 1])?,
            act: activation(relu)?,
            relu_act: activation(true)?,
            descs: Mutex::new(HashMap::new()),
        })
    }

    fn descs(&self, batch: usize) -> Result<Arc<BatchDescs>> {
        let mut map = self.descs.lock().map_err(|_| Error::Poisoned { path: self.path.clone(), what: "cuDNN descriptor".into() })?;
        if let Some(d) = map.get(&batch) {
            return Ok(d.clone());
        }
        let g = self.geom;
        let d =
            Arc::new(BatchDescs { x: tensor(self.elem, [batch, g.cin, g.h, g.w])?, y: tensor(self.elem, [batch, g.cout, g.ho, g.wo])? });
        map.insert(batch, d.clone());
        Ok(d)
    }
}

/// Channel padding before a convolution whose input channels tensor cores cannot use as they are
/// (the 3-channel stem in FP16): `kernels/pad.cu` writes the input with `cp` channels into scratch.
struct PadStep {
    kernel: cudarc::driver::CudaFunction,
    src: ValueId,
    dst: ValueId,
    pixels_per_image: usize,
    c: usize,
    cp: usize,
    sm_count: u32,
}

/// `kernels/pad.cu`, compiled with NVRTC on first use like Kiln's other kernels.
pub use super::kernels::ON_DEMAND;

/// The channel-padding kernel family (`kernels/pad.cu`).
pub const PAD_CU: &str = ON_DEMAND[0].1;

/// A forward convolution with its algorithm and mode (one tactic candidate).
pub struct ConvLayer {
    shared: Arc<ConvShared>,
    algo: dnn::cudnnConvolutionFwdAlgo_t,
    mode: Mode,
    /// The workspace of the largest need seen: at the max batch when made, then at every batch
    /// `prepare` saw (cuDNN's need is not monotonic in the batch).
    workspace: AtomicUsize,
    /// The need at each batch `prepare` saw, so the arena reserves the max batch's and lends a
    /// smaller batch's larger need from its idle bytes (`plan::Workspace`).
    by_batch: Mutex<BTreeMap<usize, usize>>,
    pad: Option<Arc<PadStep>>,
    /// Runs the batch in slices of at most this many images, so the workspace (which grows with
    /// the batch) fits the arena's room at this layer.
    split: Option<usize>,
}

fn algo_name(a: dnn::cudnnConvolutionFwdAlgo_t) -> String {
    format!("{a:?}").trim_start_matches("CUDNN_CONVOLUTION_FWD_ALGO_").to_string()
}

const FWD_ALGOS: [dnn::cudnnConvolutionFwdAlgo_t; 8] = {
    use dnn::cudnnConvolutionFwdAlgo_t as A;
    [
        A::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM,
        A::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM,
        A::CUDNN_CONVOLUTION_FWD_ALGO_GEMM,
        A::CUDNN_CONVOLUTION_FWD_ALGO_DIRECT,
        A::CUDNN_CONVOLUTION_FWD_ALGO_FFT,
        A::CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING,
        A::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD,
        A::CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED,
    ]
};

/// FFT and Winograd transform the problem and round differently from a direct sum; strict FP32
/// (rel L2 1e-4 against PyTorch over 50 layers) keeps to the GEMM-like and direct algorithms.
fn exact_algo(a: dnn::cudnnConvolutionFwdAlgo_t) -> bool {
    use dnn::cudnnConvolutionFwdAlgo_t as A;
    matches!(
        a,
        A::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM
            | A::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM
            | A::CUDNN_CONVOLUTION_FWD_ALGO_GEMM
            | A::CUDNN_CONVOLUTION_FWD_ALGO_DIRECT
    )
}

impl Layer for ConvLayer {
    fn path(&self) -> &str {
        &self.shared.path
    }
    fn kind(&self) -> String {
        let m = match self.mode {
            Mode::Fused => "cudnn-fused",
            Mode::Separate => "cudnn-conv",
        };
        let pad = if let Some(p) = &self.pad { format!("pad{}+", p.cp) } else { String::new() };
        let split = self.split.map(|n| format!(":by{n}")).unwrap_or_default();
        format!("{pad}{m}:{}{split}", algo_name(self.algo))
    }
    fn workspace_bytes(&self, batch: usize) -> usize {
        let seen = self.by_batch.lock().unwrap_or_else(|p| p.into_inner()).get(&batch).copied();
        seen.unwrap_or_else(|| self.workspace.load(Ordering::Relaxed))
    }
    fn prepare(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let slice = self.split.unwrap_or(batch).min(batch).max(1);
        if let Some(ws) = fwd_workspace(rt.handles.cudnn, &self.shared, self.algo, slice)? {
            self.workspace.fetch_max(ws, Ordering::Relaxed);
            self.by_batch.lock().unwrap_or_else(|p| p.into_inner()).insert(batch, ws);
        }
        Ok(())
    }
    fn overwrites(&self) -> Option<(ValueId, ValueId)> {
        // The fused call adds z in its epilogue, element by element; the separate calls accumulate
        // the convolution onto y (beta = 1) when y already holds z.
        self.shared.z.map(|z| (self.shared.y, z))
    }
    fn prologue(&self) -> Option<(ValueId, ValueId)> {
        self.pad.as_ref().map(|p| (p.src, p.dst))
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let s = &self.shared;
        if let Some(p) = &self.pad {
            use super::launch::{grid_for, launch, KArg, BLOCK};
            let pixels = batch * p.pixels_per_image;
            let args = [
                KArg::Ptr(rt.ptr(p.src)),
                KArg::Ptr(rt.ptr(p.dst)),
                KArg::I64(pixels as i64),
                KArg::I32(p.c as i32),
                KArg::I32(p.cp as i32),
            ];
            launch(rt, &p.kernel, grid_for(pixels, p.sm_count), (BLOCK, 1, 1), 0, &args)?;
        }
        let slice = self.split.unwrap_or(batch).max(1);
        let g = s.geom;
        let (x_image, y_image) = ((g.cin * g.h * g.w * s.elem.size()) as u64, (g.cout * g.ho * g.wo * s.elem.size()) as u64);
        let mut first = 0;
        while first < batch {
            let n = slice.min(batch - first);
            let at = first as u64;
            let z = s.z.map(|z| rt.ptr(z) + at * y_image);
            self.convolve(rt, n, rt.ptr(s.x) + at * x_image, rt.ptr(s.y) + at * y_image, z)?;
            first += n;
        }
        Ok(())
    }
}

impl ConvLayer {
    /// The convolution of `batch` images at `x` into `y` (adding `z`), as the layer's mode says.
    fn convolve(&self, rt: &RunCtx, batch: usize, x: u64, y: u64, z: Option<u64>) -> Result<()> {
        let s = &self.shared;
        let d = s.descs(batch)?;
        let h = rt.handles.cudnn;
        let (x, y) = (x as *const c_void, y as *mut c_void);
        let (ws, ws_len) = (rt.workspace as *mut c_void, rt.workspace_bytes);
        let one = 1f32;
        let zero = 0f32;
        let p = |v: &f32| v as *const f32 as *const c_void;
        match self.mode {
            Mode::Fused => {
                // Without a residual, z aliases y with alpha2 = 0 (cuDNN reads z only when alpha2 != 0).
                let (z, alpha2) = match z {
                    Some(z) => (z as *const c_void, 1f32),
                    None => (y as *const c_void, 0f32),
                };
                // SAFETY: descriptors are live (owned by `s` and `d`); the addresses come from the context's arena,
                // bindings and workspace, sized for `batch` by the builder; the scalars outlive the call.
                unsafe {
                    check(
                        dnn::cudnnConvolutionBiasActivationForward(
                            h,
                            p(&one),
                            d.x.raw,
                            x,
                            s.filter.raw,
                            s.w.ptr() as *const c_void,
                            s.conv.raw,
                            self.algo,
                            ws,
                            ws_len,
                            p(&alpha2),
                            d.y.raw,
                            z,
                            s.bias.raw,
                            s.b.ptr() as *const c_void,
                            s.act.raw,
                            d.y.raw,
                            y,
                        ),
                        "cudnnConvolutionBiasActivationForward",
                    )
                }
            }
            // SAFETY: as in the fused call above: live descriptors, arena/binding/workspace addresses sized for `batch`.
            Mode::Separate => unsafe {
                // Written over its residual, y holds z already: accumulate onto it.
                let in_place = z.is_some_and(|z| z == y as u64);
                check(
                    dnn::cudnnConvolutionForward(
                        h,
                        p(&one),
                        d.x.raw,
                        x,
                        s.filter.raw,
                        s.w.ptr() as *const c_void,
                        s.conv.raw,
                        self.algo,
                        ws,
                        ws_len,
                        p(if in_place { &one } else { &zero }),
                        d.y.raw,
                        y,
                    ),
                    "cudnnConvolutionForward",
                )?;
                if s.bias_given {
                    check(
                        dnn::cudnnAddTensor(h, p(&one), s.bias.raw, s.b.ptr() as *const c_void, p(&one), d.y.raw, y),
                        "cudnnAddTensor (bias)",
                    )?;
                }
                if let Some(z) = z.filter(|_| !in_place) {
                    check(dnn::cudnnAddTensor(h, p(&one), d.y.raw, z as *const c_void, p(&one), d.y.raw, y), "cudnnAddTensor (residual)")?;
                }
                if s.relu {
                    check(
                        dnn::cudnnActivationForward(h, s.relu_act.raw, p(&one), d.y.raw, y, p(&zero), d.y.raw, y),
                        "cudnnActivationForward",
                    )?;
                }
                Ok(())
            },
        }
    }
}

/// A convolution spelled out for the cuDNN layers: what a converter hands them (Conv2d and
/// ConvTranspose2d, and ops that are convolutions in disguise, as BatchNorm2d is a depthwise 1×1
/// convolution). The layers never read the graph's op.
pub struct ConvProblem<'a> {
    pub geometry: ConvGeometry,
    pub epilogue: Epilogue,
    /// PyTorch layout `[Cout, Cin/g, kh, kw]`.
    pub weight: &'a [f32],
    pub weight_shape: [usize; 4],
    /// One value per output channel (zeros when the op has none).
    pub bias: &'a [f32],
    pub x: ValueId,
    pub y: ValueId,
    pub z: Option<ValueId>,
}

pub fn conv_candidates_with(ctx: &mut LayerCtx, p: ConvProblem) -> Result<Vec<Box<dyn Layer>>> {
    let out = ctx.chw(p.y, "output")?;
    conv_candidates_geom(ctx, p, out, true)
}

/// The forward-convolution candidates with the output's `(C, H, W)` given rather than read from
/// `p.y`'s value: a layer that convolves into its own scratch (the sub-pixel transposed
/// convolution, `ops::conv::subpixel`) passes its scratch geometry and points `p.y` at the scratch
/// when it enqueues. `pad_variants`: also the channel-padded FP16 variants (which need a
/// prologue scratch of their own).
pub fn conv_candidates_geom(
    ctx: &mut LayerCtx,
    p: ConvProblem,
    (cout, ho, wo): (usize, usize, usize),
    pad_variants: bool,
) -> Result<Vec<Box<dyn Layer>>> {
    let (x, y, z, shape4) = (p.x, p.y, p.z, p.weight_shape);
    let (cin, h, wd) = ctx.chw(x, "input")?;
    let elem = ctx.elem();
    let path = ctx.path().to_string();
    let geom = Geom { cin, h, w: wd, cout, ho, wo };
    let setup = ConvSetup { geom, x, y, z, conv: p.geometry, epilogue: p.epilogue, weight: p.weight, shape: shape4, bias: p.bias };
    let shared = Arc::new(ConvShared::new(ctx, &path, setup)?);
    let mut out = fwd_layers(ctx, &shared, None)?;

    // FP16 tensor-core kernels want input channels in multiples of 8: also offer the convolution
    // on a zero-padded copy of the input (zero weights for the extra channels).
    if pad_variants && elem == Elem::F16 && p.geometry.groups == 1 && cin % 8 != 0 {
        let cp = cin.next_multiple_of(8);
        let [k, _, r, sz] = shape4;
        let mut wp = vec![0f32; k * cp * r * sz];
        for ki in 0..k {
            let src = &p.weight[ki * cin * r * sz..(ki + 1) * cin * r * sz];
            wp[ki * cp * r * sz..ki * cp * r * sz + src.len()].copy_from_slice(src);
        }
        let padded_shape = [k, cp, r, sz];
        let scratch = ctx.prologue_scratch(h * wd * cp * elem.size());
        ctx.kernels.add_source("pad.cu", PAD_CU)?;
        let pad = Arc::new(PadStep {
            kernel: ctx.kernels.get("pad_channels_f16")?,
            src: x,
            dst: scratch,
            pixels_per_image: h * wd,
            c: cin,
            cp,
            sm_count: ctx.kernels.sm_count(),
        });
        let setup = ConvSetup {
            geom: Geom { cin: cp, ..shared.geom },
            x: scratch,
            y,
            z,
            conv: p.geometry,
            epilogue: p.epilogue,
            weight: &wp,
            shape: padded_shape,
            bias: p.bias,
        };
        let padded = Arc::new(ConvShared::new(ctx, &path, setup)?);
        out.extend(fwd_layers(ctx, &padded, Some(pad))?);
    }
    Ok(out)
}

/// One candidate per usable algorithm (fused where cuDNN allows it, and separate calls).
fn fwd_layers(ctx: &LayerCtx, shared: &Arc<ConvShared>, pad: Option<Arc<PadStep>>) -> Result<Vec<Box<dyn Layer>>> {
    let mut out: Vec<Box<dyn Layer>> = Vec::new();
    let limit = ctx.config.workspace_bytes;
    let strict = ctx.precision() == Precision::Fp32;
    let room = ctx.workspace_budget.max(super::tactic::WORKSPACE_FLOOR);
    for algo in FWD_ALGOS {
        // The max batch's workspace is what the arena's room must hold; a smaller batch that needs
        // more (cuDNN's need is not monotonic in the batch) borrows idle bytes (`plan::Workspace`).
        let Some(ws) = fwd_workspace(ctx.gpu.handles.cudnn, shared, algo, ctx.config.max_batch)? else { continue };
        if ws > limit || (strict && !exact_algo(algo)) {
            continue;
        }
        // cuDNN's fused call supports the identity activation only with IMPLICIT_PRECOMP_GEMM.
        let fused_ok = shared.relu || algo == dnn::cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM;
        let mut add = |workspace: usize, split: Option<usize>| {
            if fused_ok {
                let workspace = AtomicUsize::new(workspace);
                let by_batch = Mutex::default();
                out.push(Box::new(ConvLayer {
                    shared: shared.clone(),
                    algo,
                    mode: Mode::Fused,
                    workspace,
                    by_batch,
                    pad: pad.clone(),
                    split,
                }));
            }
            let (workspace, by_batch) = (AtomicUsize::new(workspace), Mutex::default());
            out.push(Box::new(ConvLayer {
                shared: shared.clone(),
                algo,
                mode: Mode::Separate,
                workspace,
                by_batch,
                pad: pad.clone(),
                split,
            }));
        };
        add(ws, None);
        // A workspace that outgrows the arena's room at this layer also runs in batch slices
        // small enough for the room, as one more candidate: the largest slice (halving from the
        // max batch) whose workspace fits.
        if ws > room {
            let mut n = ctx.config.max_batch / 2;
            while n >= 1 {
                if let Some(ws_n) = fwd_workspace(ctx.gpu.handles.cudnn, shared, algo, n)?.filter(|&w| w <= room) {
                    add(ws_n, Some(n));
                    break;
                }
                n /= 2;
            }
        }
    }
    Ok(out)
}

/// The workspace `algo` needs for `batch` images, or `None` where cuDNN does not support it.
fn fwd_workspace(
    handle: dnn::cudnnHandle_t,
    shared: &ConvShared,
    algo: dnn::cudnnConvolutionFwdAlgo_t,
    batch: usize,
) -> Result<Option<usize>> {
    let d = shared.descs(batch)?;
    let mut ws = 0usize;
    // SAFETY: the handle and descriptors are live; `ws` outlives the call.
    let st = unsafe {
        dnn::cudnnGetConvolutionForwardWorkspaceSize(handle, d.x.raw, shared.filter.raw, shared.conv.raw, d.y.raw, algo, &mut ws)
    };
    Ok(st.result().is_ok().then_some(ws))
}

/// A transposed convolution as cuDNN's backward-data of the matching forward convolution, then
/// bias and ReLU in place when the node has them.
pub struct DeconvLayer {
    shared: Arc<ConvShared>,
    algo: dnn::cudnnConvolutionBwdDataAlgo_t,
    workspace: usize,
}

const BWD_ALGOS: [dnn::cudnnConvolutionBwdDataAlgo_t; 6] = {
    use dnn::cudnnConvolutionBwdDataAlgo_t as A;
    [
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0,
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1,
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT,
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING,
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD,
        A::CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED,
    ]
};

impl Layer for DeconvLayer {
    fn path(&self) -> &str {
        &self.shared.path
    }
    fn kind(&self) -> String {
        format!("cudnn-deconv:{}", format!("{:?}", self.algo).trim_start_matches("CUDNN_CONVOLUTION_BWD_DATA_ALGO_"))
    }
    fn workspace_bytes(&self, _batch: usize) -> usize {
        self.workspace
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let s = &self.shared;
        // Forward view of the matching convolution: "x" is the deconv's output, "y" its input.
        let d = s.descs(batch)?;
        let h = rt.handles.cudnn;
        let (input, out) = (rt.ptr(s.x) as *const c_void, rt.ptr(s.y) as *mut c_void);
        let (one, zero) = (1f32, 0f32);
        let p = |v: &f32| v as *const f32 as *const c_void;
        // SAFETY: live descriptors (owned by `s` and `d`); arena, binding and workspace addresses sized for `batch`.
        unsafe {
            check(
                dnn::cudnnConvolutionBackwardData(
                    h,
                    p(&one),
                    s.filter.raw,
                    s.w.ptr() as *const c_void,
                    d.y.raw,
                    input,
                    s.conv.raw,
                    self.algo,
                    rt.workspace as *mut c_void,
                    rt.workspace_bytes,
                    p(&zero),
                    d.x.raw,
                    out,
                ),
                "cudnnConvolutionBackwardData",
            )?;
            if s.bias_given {
                check(
                    dnn::cudnnAddTensor(h, p(&one), s.bias.raw, s.b.ptr() as *const c_void, p(&one), d.x.raw, out),
                    "cudnnAddTensor (bias)",
                )?;
            }
            if s.relu {
                check(
                    dnn::cudnnActivationForward(h, s.relu_act.raw, p(&one), d.x.raw, out, p(&zero), d.x.raw, out),
                    "cudnnActivationForward",
                )?;
            }
        }
        Ok(())
    }
}

/// The cuDNN candidates for a ConvTranspose2d node (weight `[Cin, Cout/g, kh, kw]`).
pub fn deconv_candidates(ctx: &mut LayerCtx, p: ConvProblem) -> Result<Vec<Box<dyn Layer>>> {
    let (x, y) = (p.x, p.y);
    if p.z.is_some() {
        return Err(ctx.err(LowerKind::Unsupported, "a transposed convolution cannot take a fused residual"));
    }
    let path = ctx.path().to_string();
    let (cin, h, wd) = ctx.chw(x, "input")?;
    let (cout, ho, wo) = ctx.chw(y, "output")?;
    let shape4 = p.weight_shape;
    // The filter of the forward convolution that maps the deconv's output (Cout) to its input
    // (Cin) is the deconv weight itself: K = Cin, C = Cout/g. In the forward view x is the
    // deconv output (Cout, Ho, Wo) and y the deconv input.
    let setup = ConvSetup {
        geom: Geom { cin: cout, h: ho, w: wo, cout: cin, ho: h, wo: wd },
        x,
        y,
        z: None,
        conv: p.geometry,
        epilogue: p.epilogue,
        weight: p.weight,
        shape: shape4,
        bias: p.bias,
    };
    let shared = Arc::new(ConvShared::new(ctx, &path, setup)?);
    let handle = ctx.gpu.handles.cudnn;
    let d = shared.descs(ctx.config.max_batch)?;
    let mut out: Vec<Box<dyn Layer>> = Vec::new();
    for algo in BWD_ALGOS {
        let mut ws = 0usize;
        // SAFETY: the handle and descriptors are live; `ws` outlives the call.
        let st = unsafe {
            dnn::cudnnGetConvolutionBackwardDataWorkspaceSize(handle, shared.filter.raw, d.y.raw, shared.conv.raw, d.x.raw, algo, &mut ws)
        };
        let direct = matches!(
            algo,
            dnn::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_0
                | dnn::cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_1
        );
        let strict = ctx.precision() == Precision::Fp32;
        if st.result().is_err() || ws > ctx.config.workspace_bytes || (strict && !direct) {
            continue;
        }
        out.push(Box::new(DeconvLayer { shared: shared.clone(), algo, workspace: ws }));
    }
    Ok(out)
}
