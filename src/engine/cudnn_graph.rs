//! cuDNN's graph (backend) API: one convolution and a chain of pointwise steps after it, run as one
//! fused engine (cuDNN's runtime fusion), over NHWC tensors of any storage type cuDNN takes.
//!
//! The 8-bit convs use it as a library candidate beside `kernels/conv8.cu` (docs/QUANT.md,
//! "Library survey"): on sm_90, cuDNN 9.14's fused INT8 convs run ResNet-50's 3×3 layers 2-3×
//! faster than our `mma.sync` kernel, while our kernel wins where a residual is added. The tactic
//! timer decides per layer.
//!
//! A layer of this module is one engine configuration (cuDNN's engine index and knob choices, as
//! the heuristics list them for the opt batch), so timing candidates costs no plan building. Plans
//! are built per batch slice on first use (`prepare` makes every one a run needs, ahead of CUDA-graph
//! capture): a batch runs as slices of the planned sizes (the max and opt batch, and powers of two),
//! largest first.

use super::cudnn::{check, data_type};
use super::gpu::Gpu;
use super::layer::{DeviceBuf, Elem, Layer, RunCtx, ValueId};
use crate::{Error, Result};
use cudarc::cudnn::sys as dnn;
use dnn::cudnnBackendAttributeName_t as Attr;
use dnn::cudnnBackendAttributeType_t as Ty;
use dnn::cudnnBackendDescriptorType_t as Kind;
use std::collections::BTreeMap;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// One backend descriptor, destroyed with its owner.
struct Desc(dnn::cudnnBackendDescriptor_t);

// SAFETY: a finalized backend descriptor is immutable host data; cuDNN allows using it from any
// thread, and this module only mutates descriptors before sharing them.
unsafe impl Send for Desc {}
// SAFETY: as for `Send`: shared use only reads (executes) finalized descriptors.
unsafe impl Sync for Desc {}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from cudnnBackendCreateDescriptor and is destroyed once, here.
        let _ = unsafe { dnn::cudnnBackendDestroyDescriptor(self.0) };
    }
}

impl Desc {
    fn new(kind: Kind) -> Result<Self> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer for the new descriptor.
        check(unsafe { dnn::cudnnBackendCreateDescriptor(kind, &mut raw) }, "creating a cuDNN backend descriptor")?;
        Ok(Self(raw))
    }

    /// Sets `name` to `values`, whose Rust type must be the C type `ty` names.
    fn set<V>(&self, name: Attr, ty: Ty, values: &[V]) -> Result<()> {
        // SAFETY: `values` is a live slice of `values.len()` elements of the type `ty` describes (each
        // caller below pairs them: i64 with INT64, descriptors with BACKEND_DESCRIPTOR, ...); cuDNN
        // copies them before returning.
        let status = unsafe { dnn::cudnnBackendSetAttribute(self.0, name, ty, values.len() as i64, values.as_ptr() as *const c_void) };
        check(status, &format!("setting the cuDNN attribute {name:?}"))
    }
    fn set_i64s(&self, name: Attr, v: &[i64]) -> Result<()> {
        self.set(name, Ty::CUDNN_TYPE_INT64, v)
    }
    fn set_descs(&self, name: Attr, v: &[&Desc]) -> Result<()> {
        let raw: Vec<dnn::cudnnBackendDescriptor_t> = v.iter().map(|d| d.0).collect();
        self.set(name, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw)
    }
    fn set_type(&self, name: Attr, t: dnn::cudnnDataType_t) -> Result<()> {
        self.set(name, Ty::CUDNN_TYPE_DATA_TYPE, &[t])
    }
    fn finalize(self, what: &str) -> Result<Self> {
        // SAFETY: `self.0` is a live descriptor with its required attributes set.
        check(unsafe { dnn::cudnnBackendFinalize(self.0) }, what)?;
        Ok(self)
    }

    /// Reads `name` into `out`, whose type must be the C type `ty` names; returns how many
    /// elements cuDNN has (which may exceed `out.len()`).
    fn get<V>(&self, name: Attr, ty: Ty, out: &mut [V]) -> Result<usize> {
        let mut count = 0i64;
        // SAFETY: `out` is a live, writable slice of `out.len()` elements of the type `ty` describes
        // (descriptor arrays hold descriptors created by the caller for cuDNN to fill).
        let status =
            unsafe { dnn::cudnnBackendGetAttribute(self.0, name, ty, out.len() as i64, &mut count, out.as_mut_ptr() as *mut c_void) };
        check(status, &format!("reading the cuDNN attribute {name:?}"))?;
        Ok(count.max(0) as usize)
    }
    fn get_i64(&self, name: Attr) -> Result<i64> {
        let mut v = [0i64];
        self.get(name, Ty::CUDNN_TYPE_INT64, &mut v)?;
        Ok(v[0])
    }
    /// Descriptors of `kind` that cuDNN fills from attribute `name` (an array of up to `max`).
    fn get_descs(&self, name: Attr, kind: Kind, max: usize) -> Result<Vec<Desc>> {
        let descs = (0..max).map(|_| Desc::new(kind)).collect::<Result<Vec<_>>>()?;
        let mut raw: Vec<dnn::cudnnBackendDescriptor_t> = descs.iter().map(|d| d.0).collect();
        let n = self.get(name, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, &mut raw)?;
        Ok(descs.into_iter().take(n).collect())
    }
}

/// A constant operand of a pointwise step: one f32 per output channel, or one f32.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Operand {
    Channels(usize),
    Scalar(usize),
}

/// One pointwise step of the epilogue, applied to the running f32 value `v`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Step {
    Mul(Operand),
    Add(Operand),
    /// `v + z · scale`: the residual input, in its storage type.
    Residual(Operand),
    Relu,
    Max(Operand),
    Min(Operand),
}

/// What the fused engine computes: `y = steps(conv(x, w))` for NHWC `x` `[C, H, W]` per image, KRSC
/// `w`, NHWC `y` `[K, P, Q]`, and the residual `z` in `y`'s shape when a step reads it.
#[derive(Clone, Debug)]
pub struct FusedConv {
    pub x: Elem,
    pub y: Elem,
    pub z: Option<Elem>,
    /// C, H, W, K, R, S, P, Q.
    pub dims: [usize; 8],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    /// Constants are bound by index (`Operand`), as the layer's `constants` buffers.
    pub steps: Vec<Step>,
}

const X: i64 = 1;
const W: i64 = 2;
const Y: i64 = 3;
const Z: i64 = 4;
const CONSTANTS: i64 = 10;
const VIRTUALS: i64 = 1000;

fn nhwc_strides([_, c, h, w]: [i64; 4]) -> [i64; 4] {
    [c * h * w, 1, w * c, c]
}

fn tensor(uid: i64, elem: Elem, dims: [i64; 4], strides: [i64; 4], virtual_: bool) -> Result<Desc> {
    let t = Desc::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    t.set_type(Attr::CUDNN_ATTR_TENSOR_DATA_TYPE, data_type(elem))?;
    t.set_i64s(Attr::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?;
    t.set_i64s(Attr::CUDNN_ATTR_TENSOR_STRIDES, &strides)?;
    t.set_i64s(Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[uid])?;
    t.set_i64s(Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[16])?;
    t.set(Attr::CUDNN_ATTR_TENSOR_IS_VIRTUAL, Ty::CUDNN_TYPE_BOOLEAN, &[virtual_])?;
    t.finalize("finalizing a cuDNN tensor descriptor")
}

/// A finalized operation graph and every descriptor it refers to (kept alive with it).
struct OpGraph {
    graph: Desc,
    _parts: Vec<Desc>,
}

impl FusedConv {
    fn i64s(v: &[usize]) -> Vec<i64> {
        v.iter().map(|&d| d as i64).collect()
    }

    /// The operation graph at `batch` images.
    fn op_graph(&self, handle: dnn::cudnnHandle_t, batch: usize) -> Result<OpGraph> {
        let [c, h, w, k, r, s, p, q] = self.dims.map(|d| d as i64);
        let n = batch as i64;
        let y_dims = [n, k, p, q];
        let mut parts: Vec<Desc> = Vec::new();
        let xt = tensor(X, self.x, [n, c, h, w], nhwc_strides([n, c, h, w]), false)?;
        let wt = tensor(W, self.x, [k, c, r, s], nhwc_strides([k, c, r, s]), false)?;
        let compute = if self.x == Elem::I8 { dnn::cudnnDataType_t::CUDNN_DATA_INT32 } else { dnn::cudnnDataType_t::CUDNN_DATA_FLOAT };
        let conv = Desc::new(Kind::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
        conv.set_type(Attr::CUDNN_ATTR_CONVOLUTION_COMP_TYPE, compute)?;
        conv.set(
            Attr::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
            Ty::CUDNN_TYPE_CONVOLUTION_MODE,
            &[dnn::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION],
        )?;
        conv.set_i64s(Attr::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, &[2])?;
        conv.set_i64s(Attr::CUDNN_ATTR_CONVOLUTION_DILATIONS, &Self::i64s(&self.dilation))?;
        conv.set_i64s(Attr::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, &Self::i64s(&self.stride))?;
        conv.set_i64s(Attr::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, &Self::i64s(&self.padding))?;
        conv.set_i64s(Attr::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, &Self::i64s(&self.padding))?;
        let conv = conv.finalize("finalizing a cuDNN convolution descriptor")?;

        let mut next_uid = VIRTUALS;
        let mut uid = || {
            next_uid += 1;
            next_uid
        };
        let last = self.steps.len();
        let y_tensor = || tensor(Y, self.y, y_dims, nhwc_strides(y_dims), false);
        let f32_tensor = |uid: i64| tensor(uid, Elem::F32, y_dims, nhwc_strides(y_dims), true);
        let acc = if last == 0 { y_tensor()? } else { f32_tensor(uid())? };
        let conv_op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR)?;
        conv_op.set_descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, &[&xt])?;
        conv_op.set_descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, &[&wt])?;
        conv_op.set_descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, &[&acc])?;
        conv_op.set_descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, &[&conv])?;
        conv_op.set(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, Ty::CUDNN_TYPE_FLOAT, &[1f32])?;
        conv_op.set(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA, Ty::CUDNN_TYPE_FLOAT, &[0f32])?;
        let mut ops = vec![conv_op.finalize("finalizing cuDNN's convolution operation")?];

        let operand = |o: Operand| -> Result<Desc> {
            match o {
                Operand::Channels(i) => tensor(CONSTANTS + i as i64, Elem::F32, [1, k, 1, 1], [k, 1, k, k], false),
                Operand::Scalar(i) => tensor(CONSTANTS + i as i64, Elem::F32, [1, 1, 1, 1], [1, 1, 1, 1], false),
            }
        };
        // A pointwise operation y = mode(x, b), and its descriptors (kept alive with the graph).
        let pointwise = |parts: &mut Vec<Desc>, mode: dnn::cudnnPointwiseMode_t, x: &Desc, b: Option<Desc>, y: &Desc| -> Result<Desc> {
            let pw = Desc::new(Kind::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
            pw.set(Attr::CUDNN_ATTR_POINTWISE_MODE, Ty::CUDNN_TYPE_POINTWISE_MODE, &[mode])?;
            pw.set_type(Attr::CUDNN_ATTR_POINTWISE_MATH_PREC, dnn::cudnnDataType_t::CUDNN_DATA_FLOAT)?;
            let pw = pw.finalize("finalizing a cuDNN pointwise descriptor")?;
            let op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
            op.set_descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?;
            op.set_descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[x])?;
            if let Some(b) = &b {
                op.set_descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[b])?;
            }
            op.set_descs(Attr::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[y])?;
            let op = op.finalize("finalizing a cuDNN pointwise operation")?;
            parts.push(pw);
            parts.extend(b);
            Ok(op)
        };
        use dnn::cudnnPointwiseMode_t::*;
        let mut v = acc;
        for (i, step) in self.steps.iter().enumerate() {
            let out = if i + 1 == last { y_tensor()? } else { f32_tensor(uid())? };
            let op = match *step {
                Step::Mul(o) => pointwise(&mut parts, CUDNN_POINTWISE_MUL, &v, Some(operand(o)?), &out)?,
                Step::Add(o) => pointwise(&mut parts, CUDNN_POINTWISE_ADD, &v, Some(operand(o)?), &out)?,
                Step::Max(o) => pointwise(&mut parts, CUDNN_POINTWISE_MAX, &v, Some(operand(o)?), &out)?,
                Step::Min(o) => pointwise(&mut parts, CUDNN_POINTWISE_MIN, &v, Some(operand(o)?), &out)?,
                Step::Relu => pointwise(&mut parts, CUDNN_POINTWISE_RELU_FWD, &v, None, &out)?,
                Step::Residual(scale) => {
                    let z = tensor(Z, self.z.unwrap_or(self.y), y_dims, nhwc_strides(y_dims), false)?;
                    let scaled = f32_tensor(uid())?;
                    ops.push(pointwise(&mut parts, CUDNN_POINTWISE_MUL, &z, Some(operand(scale)?), &scaled)?);
                    parts.push(z);
                    pointwise(&mut parts, CUDNN_POINTWISE_ADD, &v, Some(scaled), &out)?
                }
            };
            ops.push(op);
            parts.push(std::mem::replace(&mut v, out));
        }
        parts.extend([xt, wt, conv, v]);
        let graph = Desc::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set_descs(Attr::CUDNN_ATTR_OPERATIONGRAPH_OPS, &ops.iter().collect::<Vec<_>>())?;
        graph.set(Attr::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, Ty::CUDNN_TYPE_HANDLE, &[handle])?;
        let graph = graph.finalize("finalizing the cuDNN operation graph")?;
        parts.extend(ops);
        Ok(OpGraph { graph, _parts: parts })
    }
}

/// One of cuDNN's engine configurations: the engine's global index and its knob choices (type,
/// value), named as cudnn-frontend names them (`eng4_k24=1`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    pub index: i64,
    pub knobs: Vec<(i32, i64)>,
}

impl EngineConfig {
    pub fn name(&self) -> String {
        let knobs: String = self.knobs.iter().map(|(t, v)| format!("_k{t}={v}")).collect();
        format!("eng{}{knobs}", self.index)
    }
}

/// Engine configurations that run but compute wrong values, so they are never candidates:
/// - INT8, engine 2 (cuDNN 9.14, H200): on ResNet-18's `layer2.0.downsample.0` (a 1×1 stride-2
///   conv, 64 → 128 channels, 56×56 → 28×28, INT8 codes out) inside an engine, it took the
///   network to 2e-1 rel L2 from FP32 where the INT8 simulation is 1.2e-2, deterministically;
///   with every fused conv on engine 4 instead, 1.8e-2. The same configuration alone on random
///   inputs, in buffers of its own, computed the right codes, so the fault depends on what lies
///   around its tensors; cuDNN's timing picks it nowhere else in ResNet-18 or ResNet-50, so
///   leaving it out costs no speed there.
fn known_wrong(conv: &FusedConv, cfg: &EngineConfig) -> bool {
    conv.x == Elem::I8 && cfg.index == 2
}

/// The most knob choices one engine configuration has (`CUDNN_KNOB_TYPE_COUNTS` is below this).
const MAX_KNOBS: usize = 64;

/// The engine configurations cuDNN's heuristics (mode A) rank for `conv` at `batch`, best first, at
/// most `max`; empty where cuDNN has no engine for the graph (an unsupported fusion).
pub fn engine_configs(handle: dnn::cudnnHandle_t, conv: &FusedConv, batch: usize, max: usize) -> Result<Vec<EngineConfig>> {
    let og = match conv.op_graph(handle, batch) {
        Ok(g) => g,
        Err(_) => return Ok(Vec::new()),
    };
    let heur = Desc::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heur.set_descs(Attr::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[&og.graph])?;
    heur.set(Attr::CUDNN_ATTR_ENGINEHEUR_MODE, Ty::CUDNN_TYPE_HEUR_MODE, &[dnn::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A])?;
    let Ok(heur) = heur.finalize("finalizing cuDNN's heuristics") else { return Ok(Vec::new()) };
    let cfgs = heur.get_descs(Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS, Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, max)?;
    let mut out = Vec::new();
    for cfg in &cfgs {
        let Some(engine) = cfg.get_descs(Attr::CUDNN_ATTR_ENGINECFG_ENGINE, Kind::CUDNN_BACKEND_ENGINE_DESCRIPTOR, 1)?.pop() else {
            continue;
        };
        let index = engine.get_i64(Attr::CUDNN_ATTR_ENGINE_GLOBAL_INDEX)?;
        let mut knobs = Vec::new();
        for choice in cfg.get_descs(Attr::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, Kind::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, MAX_KNOBS)? {
            // Read as a plain integer: a knob type newer than cudarc's enum must not become an
            // invalid Rust enum value.
            let mut t = [0i32];
            choice.get(Attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, Ty::CUDNN_TYPE_KNOB_TYPE, &mut t)?;
            knobs.push((t[0], choice.get_i64(Attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE)?));
        }
        knobs.sort();
        let c = EngineConfig { index, knobs };
        if !out.contains(&c) && !known_wrong(conv, &c) {
            out.push(c);
        }
    }
    Ok(out)
}

/// An execution plan for one batch size, with the descriptors it was made from.
struct Plan {
    plan: Desc,
    workspace: usize,
    /// The descriptors a plan made here was finalized from (none for one read from the plan cache).
    _made_from: Option<(OpGraph, Desc, Vec<Desc>, Desc)>,
}

/// The plan of `conv` on `cfg` at `batch` images on `gpu`, made with `handle` (one of the GPU's;
/// one thread's at a time): one already built for the same problem while any layer holds it, else
/// a new one. A finalized plan is immutable and bound to no buffer (a run passes its pointers), so
/// layers of one problem (ResNet's repeated blocks) and the candidates of one timed problem share
/// plans instead of compiling each again: runtime fusion compiles a kernel per plan, most of an
/// 8-bit build's time. Threads preparing layers in parallel (`plan::prepare_in_parallel`) wait for each
/// other only on one problem: its slot is locked while it compiles.
fn shared_plan(gpu: &Gpu, handle: dnn::cudnnHandle_t, conv: &FusedConv, cfg: &EngineConfig, batch: usize) -> Result<Arc<Plan>> {
    type Slot = Arc<Mutex<Weak<Plan>>>;
    static PLANS: OnceLock<Mutex<HashMap<(usize, String), Slot>>> = OnceLock::new();
    let plans = PLANS.get_or_init(Default::default);
    // A plan alive keeps its layer's GPU alive, and with it the context: a context's address is
    // not reused while a plan made in it can be found here.
    let key = (gpu.ctx.cu_ctx() as usize, format!("{conv:?}|{}|{batch}", cfg.name()));
    let slot = {
        let mut plans = plans.lock().unwrap_or_else(|p| p.into_inner());
        // A slot being filled is locked and kept; a free one whose plan is gone is dropped.
        plans.retain(|_, s| s.try_lock().map_or(true, |p| p.strong_count() > 0));
        plans.entry(key).or_default().clone()
    };
    let mut held = slot.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(plan) = held.upgrade() {
        return Ok(plan);
    }
    let plan = Arc::new(make_plan(gpu, handle, conv, cfg, batch)?);
    *held = Arc::downgrade(&plan);
    Ok(plan)
}

/// Plans made in this process (built or read from the plan cache), the nanoseconds they took, and
/// how many of them the plan cache held: what the build summary's time line reports
/// (`plans_built`).
static PLANS_BUILT: (AtomicU64, AtomicU64, AtomicU64) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));

/// How many fused plans this process has made, the seconds they took, and how many of them came
/// from the plan cache.
pub(crate) fn plans_built() -> (u64, f64, u64) {
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    (load(&PLANS_BUILT.0), load(&PLANS_BUILT.1) as f64 * 1e-9, load(&PLANS_BUILT.2))
}

fn make_plan(gpu: &Gpu, handle: dnn::cudnnHandle_t, conv: &FusedConv, cfg: &EngineConfig, batch: usize) -> Result<Plan> {
    let start = std::time::Instant::now();
    let cached = PlanCache::of(gpu, conv, cfg, batch);
    let loaded = cached.as_ref().and_then(|c| c.load(handle));
    if loaded.is_some() {
        PLANS_BUILT.2.fetch_add(1, Ordering::Relaxed);
    }
    let plan = match loaded {
        Some(p) => Ok(p),
        None => make_plan_untimed(handle, conv, cfg, batch).inspect(|p| {
            if let Some(c) = &cached {
                c.store(p);
            }
        }),
    };
    PLANS_BUILT.0.fetch_add(1, Ordering::Relaxed);
    PLANS_BUILT.1.fetch_add(u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    plan
}

/// Finalized plans on disk, beside Kiln's compiled kernels (`kernels::cache_dir`): cuDNN's JSON
/// form of a runtime-fusion plan (`CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION`), which restores
/// the plan without compiling its kernel again. Finalizing a plan costs 0.2-0.5 s on an H200 even
/// when the driver has its kernel cached, and an 8-bit ResNet-50 build makes 171-248 of them.
/// One file per plan, keyed by cuDNN's and the driver's versions, the GPU, the problem, the engine configuration
/// and the batch; the file's first line is that key in full (a hash collision or a foreign file
/// is a miss). A file cuDNN does not take is a miss too: the plan is built and the file
/// rewritten. Off with `KILN_CUDNN_PLAN_CACHE=0`.
struct PlanCache {
    path: std::path::PathBuf,
    key: String,
}

impl PlanCache {
    fn of(gpu: &Gpu, conv: &FusedConv, cfg: &EngineConfig, batch: usize) -> Option<Self> {
        static ON: OnceLock<bool> = OnceLock::new();
        if !*ON.get_or_init(|| std::env::var("KILN_CUDNN_PLAN_CACHE").map_or(true, |v| v != "0")) {
            return None;
        }
        let i = &gpu.info;
        let key = format!(
            "kiln cuDNN plan 1; cudnn {}; driver {}; {} sm_{}; {conv:?}; {}; batch {batch}",
            i.cudnn_version,
            i.driver_version,
            i.name,
            i.sm,
            cfg.name()
        );
        let hash = crate::hash::fnv1a_extend(crate::hash::FNV_OFFSET, key.as_bytes());
        Some(Self { path: super::kernels::cache_dir().join(format!("cudnn-plan-{hash:016x}.json")), key })
    }

    fn load(&self, handle: dnn::cudnnHandle_t) -> Option<Plan> {
        let bytes = std::fs::read(&self.path).ok()?;
        let split = bytes.iter().position(|&b| b == b'\n')?;
        if bytes[..split] != *self.key.as_bytes() {
            return None;
        }
        let json = &bytes[split + 1..];
        let restore = || -> Result<Plan> {
            let plan = Desc::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
            plan.set(Attr::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, Ty::CUDNN_TYPE_HANDLE, &[handle])?;
            plan.set(Attr::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, Ty::CUDNN_TYPE_CHAR, json)?;
            let plan = plan.finalize("restoring a cuDNN plan from the plan cache")?;
            let workspace = plan.get_i64(Attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?.max(0) as usize;
            Ok(Plan { plan, workspace, _made_from: None })
        };
        restore().map_err(|e| tracing::debug!(path = %self.path.display(), "plan cache miss: {e}")).ok()
    }

    /// Writes `plan`'s JSON form (a plan cuDNN cannot serialise, or a cache that cannot be
    /// written, is only slower next time).
    fn store(&self, plan: &Plan) {
        let json = || -> Result<Vec<u8>> {
            let mut none: [u8; 0] = [];
            let len = plan.plan.get(Attr::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, Ty::CUDNN_TYPE_CHAR, &mut none)?;
            let mut json = vec![0u8; len];
            let got = plan.plan.get(Attr::CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, Ty::CUDNN_TYPE_CHAR, &mut json)?;
            json.truncate(got.min(len));
            Ok(json)
        };
        match json() {
            Ok(json) if !json.is_empty() => {
                let mut bytes = Vec::with_capacity(self.key.len() + 1 + json.len());
                bytes.extend_from_slice(self.key.as_bytes());
                bytes.push(b'\n');
                bytes.extend_from_slice(&json);
                if let Err(e) = crate::host::write_atomically(&self.path, &bytes) {
                    tracing::debug!(path = %self.path.display(), "plan cache not written: {e}");
                }
            }
            Ok(_) => {}
            Err(e) => tracing::debug!("a cuDNN plan without a JSON form: {e}"),
        }
    }
}

fn make_plan_untimed(handle: dnn::cudnnHandle_t, conv: &FusedConv, cfg: &EngineConfig, batch: usize) -> Result<Plan> {
    let og = conv.op_graph(handle, batch)?;
    let engine = Desc::new(Kind::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
    engine.set_descs(Attr::CUDNN_ATTR_ENGINE_OPERATION_GRAPH, &[&og.graph])?;
    engine.set_i64s(Attr::CUDNN_ATTR_ENGINE_GLOBAL_INDEX, &[cfg.index])?;
    let engine = engine.finalize("finalizing a cuDNN engine")?;
    let mut knobs = Vec::new();
    for &(t, v) in &cfg.knobs {
        let k = Desc::new(Kind::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR)?;
        k.set(Attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE, Ty::CUDNN_TYPE_KNOB_TYPE, &[t])?;
        k.set_i64s(Attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, &[v])?;
        knobs.push(k.finalize("finalizing a cuDNN knob choice")?);
    }
    let ec = Desc::new(Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)?;
    ec.set_descs(Attr::CUDNN_ATTR_ENGINECFG_ENGINE, &[&engine])?;
    if !knobs.is_empty() {
        ec.set_descs(Attr::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, &knobs.iter().collect::<Vec<_>>())?;
    }
    let ec = ec.finalize("finalizing a cuDNN engine configuration")?;
    let plan = Desc::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    plan.set(Attr::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, Ty::CUDNN_TYPE_HANDLE, &[handle])?;
    plan.set_descs(Attr::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[&ec])?;
    let plan = plan.finalize(&format!("building cuDNN's {} plan at batch {batch}", cfg.name()))?;
    let workspace = plan.get_i64(Attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?.max(0) as usize;
    Ok(Plan { plan, workspace, _made_from: Some((og, engine, knobs, ec)) })
}

/// The batch sizes that get a plan of their own for an engine of `opt` and `max` images: those
/// two and the powers of two below `max`, largest first.
fn planned_sizes(opt: usize, max: usize) -> Vec<usize> {
    let mut sizes: Vec<usize> = (0..usize::BITS).map(|b| 1usize << b).take_while(|&s| s <= max).collect();
    sizes.extend([opt, max]);
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.dedup();
    sizes
}

/// `batch` as slices of the planned `sizes` (largest first; 1 is among them).
fn slices(sizes: &[usize], batch: usize) -> Vec<usize> {
    let mut left = batch;
    let mut out = Vec::new();
    for &s in sizes {
        while s > 0 && left >= s {
            out.push(s);
            left -= s;
        }
    }
    out
}

/// A fused conv on one cuDNN engine configuration.
pub struct FusedConvLayer {
    /// Plans are built with this GPU's cuDNN handle (and run with the run's).
    gpu: Arc<Gpu>,
    path: String,
    kind: String,
    conv: FusedConv,
    cfg: EngineConfig,
    x: ValueId,
    y: ValueId,
    z: Option<ValueId>,
    w: DeviceBuf,
    constants: Vec<DeviceBuf>,
    /// Batch sizes with a plan of their own, largest first; other batches run in slices of these.
    sizes: Vec<usize>,
    plans: Mutex<BTreeMap<usize, Arc<Plan>>>,
}

impl FusedConvLayer {
    /// `kind_prefix` names the layer family (`cudnn-graph-i8`); `w` holds the KRSC weight in `x`'s
    /// storage type; `opt` and `max` are the engine's batch sizes.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Arc<Gpu>,
        path: &str,
        kind_prefix: &str,
        conv: FusedConv,
        cfg: EngineConfig,
        (x, y, z): (ValueId, ValueId, Option<ValueId>),
        w: DeviceBuf,
        constants: Vec<DeviceBuf>,
        (opt, max): (usize, usize),
    ) -> Self {
        let kind = format!("{kind_prefix}:{}", cfg.name());
        let sizes = planned_sizes(opt, max);
        Self { gpu: gpu.clone(), path: path.to_string(), kind, conv, cfg, x, y, z, w, constants, sizes, plans: Mutex::new(BTreeMap::new()) }
    }

    /// The plan at `size` images, made with `handle` where it is not made yet.
    fn plan(&self, handle: dnn::cudnnHandle_t, size: usize) -> Result<Arc<Plan>> {
        let poisoned = || Error::Poisoned { path: self.path.clone(), what: "cuDNN plan".into() };
        if let Some(p) = self.plans.lock().map_err(|_| poisoned())?.get(&size) {
            return Ok(p.clone());
        }
        let p = shared_plan(&self.gpu, handle, &self.conv, &self.cfg, size)?;
        self.plans.lock().map_err(|_| poisoned())?.insert(size, p.clone());
        Ok(p)
    }
}

impl Layer for FusedConvLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        self.kind.clone()
    }
    fn workspace_bytes(&self, batch: usize) -> usize {
        // A plan that does not build needs nothing: `enqueue` reports why it does not run.
        slices(&self.sizes, batch)
            .into_iter()
            .filter_map(|s| self.plan(self.gpu.handles.cudnn, s).ok())
            .map(|p| p.workspace)
            .max()
            .unwrap_or(0)
    }
    fn prepare(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        slices(&self.sizes, batch).into_iter().try_for_each(|s| self.plan(rt.handles.cudnn, s).map(|_| ()))
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let [c, h, w, k, _, _, p, q] = self.conv.dims;
        // Bytes per image of x, y and z.
        let image = |e: Elem, dims: [usize; 3]| (dims.iter().product::<usize>() * e.size()) as u64;
        let x_image = image(self.conv.x, [c, h, w]);
        let y_image = image(self.conv.y, [k, p, q]);
        let z_image = self.conv.z.map_or(0, |e| image(e, [k, p, q]));
        let mut first = 0u64;
        for size in slices(&self.sizes, batch) {
            let plan = self.plan(rt.handles.cudnn, size)?;
            if plan.workspace > rt.workspace_bytes {
                return Err(Error::Binding {
                    name: self.path.clone(),
                    reason: format!(
                        "cuDNN's {} needs {} bytes of workspace, the run has {}",
                        self.cfg.name(),
                        plan.workspace,
                        rt.workspace_bytes
                    ),
                });
            }
            let mut uids = vec![X, W, Y];
            let mut ptrs = vec![rt.ptr(self.x) + first * x_image, self.w.ptr(), rt.ptr(self.y) + first * y_image];
            if let Some(z) = self.z {
                uids.push(Z);
                ptrs.push(rt.ptr(z) + first * z_image);
            }
            for (i, c) in self.constants.iter().enumerate() {
                uids.push(CONSTANTS + i as i64);
                ptrs.push(c.ptr());
            }
            let ptrs: Vec<*mut c_void> = ptrs.into_iter().map(|p| p as *mut c_void).collect();
            let pack = Desc::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
            pack.set_i64s(Attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &uids)?;
            pack.set(Attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, Ty::CUDNN_TYPE_VOID_PTR, &ptrs)?;
            pack.set(Attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, Ty::CUDNN_TYPE_VOID_PTR, &[rt.workspace as *mut c_void])?;
            let pack = pack.finalize("finalizing a cuDNN variant pack")?;
            // SAFETY: the plan and pack are finalized; the pack's pointers are this run's device
            // buffers of the shapes the plan was built for, and the workspace is at least the plan's.
            check(unsafe { dnn::cudnnBackendExecute(rt.handles.cudnn, plan.plan.0, pack.0) }, "running a cuDNN fused conv")?;
            first += size as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_run_as_slices_of_planned_sizes() {
        let sizes = planned_sizes(24, 100);
        assert_eq!(sizes, [100, 64, 32, 24, 16, 8, 4, 2, 1]);
        assert_eq!(slices(&sizes, 100), [100]);
        assert_eq!(slices(&sizes, 24), [24]);
        assert_eq!(slices(&sizes, 99), [64, 32, 2, 1]);
        assert_eq!(slices(&sizes, 0), Vec::<usize>::new());
        assert_eq!(planned_sizes(1, 1), [1]);
    }

    #[test]
    fn int8_convs_never_take_engine_2() {
        let conv = |x| FusedConv {
            x,
            y: x,
            z: None,
            dims: [64, 56, 56, 128, 1, 1, 28, 28],
            stride: [2, 2],
            padding: [0, 0],
            dilation: [1, 1],
            steps: vec![],
        };
        let eng = |index| EngineConfig { index, knobs: vec![(24, 23)] };
        assert!(known_wrong(&conv(Elem::I8), &eng(2)));
        assert!(!known_wrong(&conv(Elem::I8), &eng(4)));
        assert!(!known_wrong(&conv(Elem::E4m3), &eng(2)));
    }

    #[test]
    fn engine_configs_are_named_as_cudnn_frontend_names_them() {
        let cfg = EngineConfig { index: 4, knobs: vec![(3, 0), (24, 1)] };
        assert_eq!(cfg.name(), "eng4_k3=0_k24=1");
        assert_eq!(EngineConfig { index: 2, knobs: vec![] }.name(), "eng2");
    }
}
