//! What converters produce and what execution runs: `Layer`s over value handles.
//!
//! A layer is built with a `LayerCtx` (the GPU, the kernels, the engine's values, the tactic
//! helper, and the module path, op name and precision of the node it is for); a converter sees it
//! through `ops::BuildCtx`, which adds the node, and returns one `Layer`. At run time a layer
//! sees a `RunCtx`: the stream, the context's library handles and the device address of every
//! value.

use super::choices::Tactics;
use super::gpu::{cuda_err, Gpu, Handles};
use super::kernels::Kernels;
pub use super::precision::Elem;
use super::{BuildConfig, Precision};
use crate::LowerKind;
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A value of the engine: an activation in the arena, a binding (user input/output) or a
/// layer's scratch buffer. Index into the engine's value table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ValueId(pub usize);

/// The most per-image dims a value of the engine may have.
pub const MAX_RANK: usize = 7;

/// Memory order of a value's per-image dims (the batch is always outermost): `order()[p]` is the
/// logical dim (PyTorch's order) stored at physical position `p`, outermost first. Bindings and
/// most shape ops use the contiguous order; convolutions and pooling use channels-last (NHWC for
/// `[C, H, W]`). Converters state which they read and write (`OpDef::layouts`); the builder
/// reformats between them.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    rank: u8,
    order: [u8; MAX_RANK],
}

impl std::fmt::Debug for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.rank >= 2 && *self == Layout::channels_last(self.rank()) {
            write!(f, "ChannelsLast")
        } else if *self == Layout::contiguous(self.rank()) {
            write!(f, "Contiguous")
        } else {
            write!(f, "Order{:?}", self.order())
        }
    }
}

impl Layout {
    /// PyTorch's own order.
    pub fn contiguous(rank: usize) -> Self {
        let mut order = [0u8; MAX_RANK];
        (0..rank.min(MAX_RANK)).for_each(|i| order[i] = i as u8);
        Self { rank: rank.min(MAX_RANK) as u8, order }
    }
    /// Dim 0 of the per-image dims (channels) innermost: `[C, H, W]` stored as `H, W, C`.
    pub fn channels_last(rank: usize) -> Self {
        let mut l = Self::contiguous(rank);
        if rank >= 2 {
            l.order[..rank].rotate_left(1);
        }
        l
    }
    /// The engine's native layout at `rank`: channels-last for images (`[C, H, W]`), PyTorch's
    /// order for everything else (`[F]`, `[K, 6]`, `[L, D]`).
    pub fn native(rank: usize) -> Self {
        if rank == 3 {
            Layout::channels_last(3)
        } else {
            Layout::contiguous(rank)
        }
    }
    /// A layout from a physical order of logical dims, or `None` if it is not a permutation.
    pub fn from_order(order: &[usize]) -> Option<Self> {
        let mut l = Self::contiguous(order.len());
        let mut seen = [false; MAX_RANK];
        for (p, &d) in order.iter().enumerate() {
            if order.len() > MAX_RANK || d >= order.len() || std::mem::replace(&mut seen[d], true) {
                return None;
            }
            l.order[p] = d as u8;
        }
        Some(l)
    }
    pub fn rank(&self) -> usize {
        self.rank as usize
    }
    pub fn order(&self) -> Vec<usize> {
        self.order[..self.rank()].iter().map(|&d| d as usize).collect()
    }
    pub fn is_channels_last(&self) -> bool {
        self.rank >= 2 && *self == Layout::channels_last(self.rank())
    }
    /// The same kind of layout (channels-last or contiguous) at another rank.
    pub fn with_rank(self, rank: usize) -> Self {
        if self.is_channels_last() {
            Layout::channels_last(rank)
        } else {
            Layout::contiguous(rank)
        }
    }
    /// Whether a value of logical `dims` has the same bytes in both layouts (dims of size 1 do not
    /// change the order, so `[C, 1, 1]` is the same in NCHW and NHWC).
    pub fn same_bytes(self, other: Layout, dims: &[usize]) -> bool {
        let big = |l: Layout| -> Vec<usize> { l.order().into_iter().filter(|&d| dims.get(d).is_some_and(|&n| n != 1)).collect() };
        self.rank() == dims.len() && other.rank() == dims.len() && big(self) == big(other)
    }
    /// Element strides of each logical dim of `dims` stored in this layout.
    pub fn strides(&self, dims: &[usize]) -> Vec<usize> {
        let mut strides = vec![0; dims.len()];
        let mut s = 1;
        for &d in self.order().iter().rev() {
            strides[d] = s;
            s *= dims[d];
        }
        strides
    }
}

/// Where a value lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Storage {
    /// In the activation arena, at an offset planned by lifetime.
    Arena,
    /// A user input or output buffer owned by the execution context.
    Binding,
    /// Shares the bytes of another value (a reshape that moves nothing).
    Alias(ValueId),
}

/// Shape, type and place of one value. `dims` are the logical per-image dims in PyTorch order
/// (`[C, H, W]` or `[F]`); the batch is dimension 0 of every value and is chosen per run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ValueDesc {
    pub name: String,
    pub dims: Vec<usize>,
    pub elem: Elem,
    pub layout: Layout,
    pub storage: Storage,
}

impl ValueDesc {
    pub fn per_image_elems(&self) -> usize {
        self.dims.iter().product()
    }
    pub fn bytes(&self, batch: usize) -> usize {
        batch * self.per_image_elems() * self.elem.size()
    }
    /// `(C, H, W)` of an image value; a `[F]` value reads as `(F, 1, 1)`. Layers that read it
    /// this way expect channels-last (or a value whose layouts are the same bytes).
    pub fn chw(&self) -> Option<(usize, usize, usize)> {
        match self.dims.as_slice() {
            [c, h, w] => Some((*c, *h, *w)),
            [f] => Some((*f, 1, 1)),
            _ => None,
        }
    }
}

/// Device memory owned by a layer (its weights) or a context (arena, bindings). Weights uploaded
/// through a `WeightStore` may be shared by several layers (the plans of one engine at several
/// input shapes); the memory is freed with the last of them.
pub struct DeviceBuf {
    alloc: Arc<Alloc>,
    ptr: u64,
}

struct Alloc {
    buf: CudaSlice<u8>,
    /// A count of live bytes this buffer is part of (the engine's weights), decreased on drop.
    counted: Option<Arc<AtomicUsize>>,
}

impl Drop for Alloc {
    fn drop(&mut self) {
        if let Some(c) = &self.counted {
            c.fetch_sub(self.buf.len(), Ordering::Relaxed);
        }
    }
}

impl DeviceBuf {
    fn new(buf: CudaSlice<u8>, stream: &Arc<CudaStream>) -> Self {
        let ptr = buf.device_ptr(stream).0;
        Self { alloc: Arc::new(Alloc { buf, counted: None }), ptr }
    }
    /// Allocates `bytes` (at least 1) of zeroed device memory on `stream`.
    pub fn zeros(stream: &Arc<CudaStream>, bytes: usize) -> Result<Self> {
        let buf = stream.alloc_zeros::<u8>(bytes.max(1)).map_err(|e| match e.0 {
            cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory { what: "device memory".into(), bytes },
            _ => cuda_err("allocating device memory")(e),
        })?;
        Ok(Self::new(buf, stream))
    }
    /// Copies raw bytes to a new device buffer and waits for the copy.
    pub fn from_bytes(stream: &Arc<CudaStream>, bytes: &[u8]) -> Result<Self> {
        let buf = stream.clone_htod(bytes).map_err(cuda_err("uploading to the device"))?;
        stream.synchronize().map_err(cuda_err("uploading to the device"))?;
        Ok(Self::new(buf, stream))
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.alloc.buf.len()
    }
    pub fn is_empty(&self) -> bool {
        self.alloc.buf.is_empty()
    }
}

/// An engine's uploaded weights, by content: a second upload of the same bytes (the same layer
/// lowered for another input shape) shares the first one's memory while it lives. Counts the
/// bytes alive, so losing tactic candidates' copies, freed, are not counted.
#[derive(Default)]
pub struct WeightStore {
    bytes: Arc<AtomicUsize>,
    by_content: std::sync::Mutex<std::collections::HashMap<(u64, u64, usize), std::sync::Weak<Alloc>>>,
}

impl WeightStore {
    /// Bytes of weights alive.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// `bytes` on the device: the live upload of the same content, or a new one.
    pub fn upload(&self, stream: &Arc<CudaStream>, bytes: &[u8]) -> Result<DeviceBuf> {
        use std::hash::{Hash, Hasher};
        // Two independent 64-bit hashes and the length: a false match is not a practical risk.
        let mut sip = std::collections::hash_map::DefaultHasher::new();
        bytes.hash(&mut sip);
        let key = (crate::hash::checksum(bytes), sip.finish(), bytes.len());
        // A panic elsewhere leaves the map consistent (entries are inserted whole).
        let mut map = self.by_content.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(alloc) = map.get(&key).and_then(std::sync::Weak::upgrade) {
            let ptr = alloc.buf.device_ptr(stream).0;
            return Ok(DeviceBuf { alloc, ptr });
        }
        map.retain(|_, w| w.strong_count() > 0);
        let mut buf = DeviceBuf::from_bytes(stream, bytes)?;
        self.bytes.fetch_add(buf.len(), Ordering::Relaxed);
        Arc::get_mut(&mut buf.alloc).expect("a new allocation has one owner").counted = Some(self.bytes.clone());
        map.insert(key, Arc::downgrade(&buf.alloc));
        Ok(buf)
    }
}

/// Host values converted to an element type, as bytes.
pub fn to_elem_bytes(data: &[f32], elem: Elem) -> Vec<u8> {
    match elem {
        Elem::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Elem::F16 => data.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        // Saturating, as a u8 binding's values are; no weight is stored as bytes.
        Elem::U8 => data.iter().map(|&v| v as u8).collect(),
        // 8-bit weights: their codes as values (integers, or values on the e4m3 grid), as bytes.
        Elem::I8 => data.iter().map(|&v| v as i8 as u8).collect(),
        Elem::E4m3 => data.iter().map(|&v| crate::number_format::encode_e4m3(v)).collect(),
    }
}

/// What a layer sees when it is enqueued.
pub struct RunCtx<'a> {
    pub stream: &'a Arc<CudaStream>,
    pub handles: &'a Handles,
    /// Device address of each value, indexed by `ValueId` (0 for values this run does not hold).
    pub ptrs: &'a [u64],
    pub workspace: u64,
    pub workspace_bytes: usize,
}

impl RunCtx<'_> {
    pub fn ptr(&self, v: ValueId) -> u64 {
        self.ptrs[v.0]
    }
}

/// One step of an engine: a cuDNN call, a cuBLASLt GEMM, a kernel launch.
pub trait Layer: Send + Sync {
    /// The module path of the node(s) it came from (`layer3.1.conv2`).
    fn path(&self) -> &str;
    /// What runs, including the tactic (`cudnn-fused:IMPLICIT_PRECOMP_GEMM`, `cublaslt-gemm`).
    /// Candidates of one tactic choice must have distinct kinds: the kind is what is recorded.
    fn kind(&self) -> String;
    /// Enqueues the layer on `rt.stream` for `batch` images. Must not synchronise (it may be
    /// captured into a CUDA graph).
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()>;
    /// Scratch memory needed at `batch`, exact once `prepare` has run for that batch (the arena
    /// holds it for this layer's step alone).
    fn workspace_bytes(&self, _batch: usize) -> usize {
        0
    }
    /// Makes what running at `batch` needs ahead of time (cuBLASLt plans); the builder calls it for
    /// every batch of the range, so runs (and CUDA-graph captures) find everything made.
    fn prepare(&self, _rt: &RunCtx, _batch: usize) -> Result<()> {
        Ok(())
    }
    /// `(output, input)` when the layer reads each element of `input` before it writes the same
    /// element of `output`, in one layout: the arena may then give `output` the bytes of `input`
    /// if nothing reads `input` later (a residual overwritten by the conv that adds it).
    fn overwrites(&self) -> Option<(ValueId, ValueId)> {
        None
    }
    /// `(src, dst)` when the layer first copies `src` into `dst` (scratch) and reads only `dst`
    /// afterwards (the channel padding of an FP16 stem): the arena lets `src` die after the copy.
    fn prologue(&self) -> Option<(ValueId, ValueId)> {
        None
    }
    /// The candidate scratch values (`LayerCtx::prologue_scratch`, `LayerCtx::chain_scratch`) this
    /// layer uses: the arena holds those of the chosen layer for its step.
    fn own_scratch(&self) -> Vec<ValueId> {
        self.prologue().map(|(_, dst)| dst).into_iter().collect()
    }
    /// A one-line description for `inspect` and build summaries.
    fn describe(&self) -> String {
        format!("{:<28} {}", self.kind(), self.path())
    }
}

/// A layer that does nothing: the result of a converter that only aliased its output.
pub struct Nop {
    pub path: String,
}

impl Layer for Nop {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "nop".into()
    }
    fn enqueue(&self, _rt: &RunCtx, _batch: usize) -> Result<()> {
        Ok(())
    }
}

/// Two layers as one candidate, `second` after `first`. With `mid`, `first` writes it (a
/// `LayerCtx::chain_scratch`) and `second` reads it: a conv and the max-pool fused after it,
/// where no single kernel does both. Without, `second` works in place on what `first` wrote (a
/// GEMM, then the activation its library cannot fuse): no intermediate, so `first`'s in-place
/// claims stand.
pub struct Chain {
    pub first: Box<dyn Layer>,
    pub second: Box<dyn Layer>,
    pub mid: Option<ValueId>,
}

impl Layer for Chain {
    fn path(&self) -> &str {
        self.first.path()
    }
    fn kind(&self) -> String {
        format!("{}+{}", self.first.kind(), self.second.kind())
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        self.first.enqueue(rt, batch)?;
        self.second.enqueue(rt, batch)
    }
    fn workspace_bytes(&self, batch: usize) -> usize {
        self.first.workspace_bytes(batch).max(self.second.workspace_bytes(batch))
    }
    fn prepare(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        self.first.prepare(rt, batch)?;
        self.second.prepare(rt, batch)
    }
    fn prologue(&self) -> Option<(ValueId, ValueId)> {
        self.first.prologue()
    }
    fn overwrites(&self) -> Option<(ValueId, ValueId)> {
        self.mid.is_none().then(|| self.first.overwrites()).flatten()
    }
    fn own_scratch(&self) -> Vec<ValueId> {
        let mut own = self.first.own_scratch();
        own.extend(self.second.own_scratch());
        own.extend(self.mid);
        own
    }
}

/// What an engine layer is built with: the GPU, the config, the kernels, the engine's values,
/// the tactic helper and the weight store, and who the layer is for (the module path and op name
/// that errors and scratch names carry, and the precision it computes in). It knows no graph: the
/// op side's converter context (`ops::BuildCtx`) wraps it and adds the node.
pub struct LayerCtx<'a> {
    pub gpu: &'a Arc<Gpu>,
    pub config: &'a BuildConfig,
    pub kernels: &'a Kernels,
    pub(crate) values: Vec<ValueDesc>,
    /// The values the layer being built reads, in the layouts its op asked for (None for weights).
    pub(crate) reads: Vec<Option<ValueId>>,
    /// The value the layer being built writes, if any.
    pub(crate) writes: Option<ValueId>,
    /// Scratch values requested by the layer being built: held by whichever candidate wins.
    pub(crate) scratch: Vec<ValueId>,
    /// Scratch values only some candidates use (a prologue's copy, a chain's intermediate): held
    /// only if the winner names one in `Layer::own_scratch`.
    pub(crate) candidate_scratch: Vec<ValueId>,
    pub(crate) tactics: &'a mut Tactics,
    /// Workspace the layer being built may use without growing the arena past its activation
    /// peak (see `plan::estimate_arena`).
    pub(crate) workspace_budget: usize,
    /// The engine's uploaded weights, shared by its plans (losing tactic candidates free theirs).
    pub(crate) weights: &'a WeightStore,
    /// The module path of the node the layer is for (`layer3.1.conv2`).
    pub(crate) path: String,
    /// The name of that node's op (`conv2d`), for errors.
    pub(crate) op: String,
    /// That node's precision: the engine's, or its per-layer rule's.
    pub(crate) precision: Precision,
}

impl<'a> LayerCtx<'a> {
    /// A context for layers of an engine of `config`, with `values` allocated; no layer yet.
    pub(crate) fn new(
        gpu: &'a Arc<Gpu>,
        config: &'a BuildConfig,
        kernels: &'a Kernels,
        tactics: &'a mut Tactics,
        weights: &'a WeightStore,
        values: Vec<ValueDesc>,
    ) -> Self {
        Self {
            gpu,
            config,
            kernels,
            values,
            reads: Vec::new(),
            writes: None,
            scratch: Vec::new(),
            candidate_scratch: Vec::new(),
            tactics,
            workspace_budget: 0,
            weights,
            path: String::new(),
            op: String::new(),
            precision: config.precision,
        }
    }

    /// The precision of the layer being built: the engine's, or its node's per-layer rule's.
    pub fn precision(&self) -> Precision {
        self.precision
    }
    /// The element type of the layer being built's activations and weights.
    pub fn elem(&self) -> Elem {
        self.precision().elem()
    }
    /// The module path of the node the layer is for.
    pub fn path(&self) -> &str {
        &self.path
    }
    pub fn value(&self, v: ValueId) -> &ValueDesc {
        &self.values[v.0]
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.gpu.stream
    }

    /// Uploads host values converted to the engine's element type.
    pub fn upload(&mut self, data: &[f32]) -> Result<DeviceBuf> {
        let bytes = to_elem_bytes(data, self.elem());
        self.upload_bytes(&bytes)
    }
    /// Uploads host values as f32 whatever the precision (e.g. scales a kernel reads as float).
    pub fn upload_f32(&mut self, data: &[f32]) -> Result<DeviceBuf> {
        self.upload_bytes(&to_elem_bytes(data, Elem::F32))
    }
    /// Uploads bytes as a weight (shared with an upload of the same bytes still alive).
    pub fn upload_bytes(&mut self, bytes: &[u8]) -> Result<DeviceBuf> {
        self.weights.upload(&self.gpu.stream, bytes)
    }

    /// Declares that `out` is the same bytes as `src` (a reshape that moves nothing). The
    /// converter then returns a `Nop` layer.
    pub fn alias(&mut self, out: ValueId, src: ValueId) -> Result<()> {
        let (a, b) = (self.value(out), self.value(src));
        if a.bytes(1) != b.bytes(1) || a.elem != b.elem {
            return Err(self.err(LowerKind::Unsupported, format!("cannot alias {:?} to {:?}: sizes differ", a.dims, b.dims)));
        }
        self.values[out.0].storage = Storage::Alias(src);
        Ok(())
    }

    /// Stores the layer being built's output in `elem` rather than the engine's precision
    /// (e.g. detections whose coordinates f16 would round). Only the node's own converter may
    /// call it: later layers and the output reformat read the new type, earlier ones never saw it.
    pub fn set_output_elem(&mut self, elem: Elem) -> Result<()> {
        let out = self.writes.ok_or_else(|| self.err(LowerKind::Operands, "has no output value"))?;
        self.values[out.0].elem = elem;
        Ok(())
    }

    /// A scratch buffer of `bytes_per_image * batch` bytes, live only while this node's layer runs.
    pub fn scratch(&mut self, bytes_per_image: usize) -> ValueId {
        let id = self.new_scratch(bytes_per_image);
        self.scratch.push(id);
        id
    }

    /// A scratch buffer that only some candidates use, as the `dst` of their `Layer::prologue`:
    /// the arena holds it only if the chosen layer's prologue names it.
    pub fn prologue_scratch(&mut self, bytes_per_image: usize) -> ValueId {
        let id = self.new_scratch(bytes_per_image);
        self.candidate_scratch.push(id);
        id
    }

    /// An intermediate image that only some candidates use (`Chain`'s): per-image `dims` in
    /// PyTorch's order, stored in `elem` and `layout`; the arena holds it only if the chosen layer
    /// names it in `own_scratch`.
    pub fn chain_scratch(&mut self, dims: Vec<usize>, elem: Elem, layout: Layout) -> ValueId {
        let id = self.new_scratch(0);
        self.values[id.0] = ValueDesc { dims, elem, layout, ..self.values[id.0].clone() };
        self.candidate_scratch.push(id);
        id
    }

    fn new_scratch(&mut self, bytes_per_image: usize) -> ValueId {
        let id = ValueId(self.values.len());
        let name = format!("{}.scratch{}", self.path, self.scratch.len() + self.candidate_scratch.len());
        // Scratch is typed f32 so its size in bytes rounds up to whole words.
        let dims = vec![bytes_per_image.div_ceil(4)];
        self.values.push(ValueDesc { name, dims, elem: Elem::F32, layout: Layout::contiguous(1), storage: Storage::Arena });
        id
    }

    /// An error naming the layer's op and module path.
    pub fn err(&self, kind: LowerKind, reason: impl std::fmt::Display) -> Error {
        Error::Lower { path: self.path.clone(), op: self.op.clone(), kind, reason: reason.to_string() }
    }

    /// `v`'s `(C, H, W)` (a vector `[F]` as `(F, 1, 1)`), or an `Unsupported` error naming the
    /// layer and `role` (`"input"`, `"output"`): what the image layers (convolutions) read.
    pub fn chw(&self, v: ValueId, role: &str) -> Result<(usize, usize, usize)> {
        self.value(v).chw().ok_or_else(|| self.err(LowerKind::Unsupported, format!("{role} is not an image")))
    }
}
