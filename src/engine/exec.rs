//! `ExecutionContext`: one stream, one arena (activations and workspaces) and the bindings of one engine. Many
//! contexts of one `Arc<Engine>` run concurrently, one per thread; layers are shared read-only.

use super::builder::{Engine, Plan};
use super::gpu::{cuda_err, Handles};
use super::layer::{DeviceBuf, Elem, RunCtx, Storage};
use super::InputDims;
use crate::graph::{ByteTensor, DType, HostInput, HostTensor};
use crate::{Error, Result};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{result as drv, CudaContext, CudaEvent, CudaGraph, CudaStream};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub struct ExecutionContext {
    engine: Arc<Engine>,
    stream: Arc<CudaStream>,
    handles: Handles,
    /// One arena for every plan this context runs, sized for the largest.
    arena: DeviceBuf,
    /// One buffer per input and output binding name, sized for the largest plan at the max batch.
    bindings: BTreeMap<String, DeviceBuf>,
    /// The plans this context has run (or was made with), each with its value addresses and one
    /// captured CUDA graph per batch size.
    plans: Vec<ContextPlan>,
    /// The plan the next run uses (chosen by the inputs' dims).
    current: usize,
    use_graphs: bool,
    /// Page-locked host memory that `run` copies inputs from and outputs to (grown on demand).
    staging: Option<Pinned>,
    /// Recorded after `run`'s last copy and waited on, once a run, by sleeping (blocking sync).
    done: CudaEvent,
    /// `execute_timed`'s pair, made on first use.
    timing: Option<(CudaEvent, CudaEvent)>,
}

struct ContextPlan {
    plan: Arc<Plan>,
    ptrs: Vec<u64>,
    graphs: HashMap<usize, CudaGraph>,
}

// SAFETY: a context is used by one thread at a time (every method takes `&mut self`); its CUDA
// graphs are only launched from that thread.
unsafe impl Send for ExecutionContext {}

impl Engine {
    /// A new execution context with its own stream and memory.
    pub fn context(self: &Arc<Self>) -> Result<ExecutionContext> {
        ExecutionContext::new(self.clone())
    }
}

impl ExecutionContext {
    pub fn new(engine: Arc<Engine>) -> Result<Self> {
        let gpu = engine.gpu.clone();
        gpu.ctx.bind_to_thread().map_err(cuda_err("binding the CUDA context"))?;
        let stream = gpu.ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        let handles = Handles::new(&stream)?;
        let arena = DeviceBuf::zeros(&stream, 1)?;
        let done = gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC)).map_err(cuda_err("creating a run's event"))?;
        let mut ctx = Self {
            engine: engine.clone(),
            stream,
            handles,
            arena,
            bindings: BTreeMap::new(),
            plans: Vec::new(),
            current: 0,
            use_graphs: engine.config.cuda_graphs,
            timing: None,
            staging: None,
            done,
        };
        let plans = engine.plans();
        ctx.reserve(&plans)?;
        ctx.plans = plans.into_iter().map(|plan| ContextPlan { plan, ptrs: Vec::new(), graphs: HashMap::new() }).collect();
        ctx.place();
        ctx.stream.synchronize().map_err(cuda_err("allocating a context"))?;
        Ok(ctx)
    }

    /// Grows the arena and the bindings to hold `plans` at the max batch. Returns whether anything
    /// was reallocated (then every plan's addresses and captured graphs are stale).
    fn reserve(&mut self, plans: &[Arc<Plan>]) -> Result<bool> {
        let c = &self.engine.config;
        let max = c.max_batch;
        let mut grown = false;
        let arena = plans.iter().map(|p| p.arena_bytes).max().unwrap_or(0);
        if arena > self.arena.len() {
            // Nothing may still be running on the old memory.
            self.stream.synchronize().map_err(cuda_err("synchronising before growing the arena"))?;
            self.arena = DeviceBuf::zeros(&self.stream, arena).map_err(|e| {
                e.out_of_memory_in(|| {
                    format!(
                        "the arena of an execution context (engine for batch {}..={}, {:?}; lower the max batch or the max shapes)",
                        c.min_batch, c.max_batch, c.precision
                    )
                })
            })?;
            grown = true;
        }
        for plan in plans {
            for (name, v) in plan.inputs.iter().chain(&plan.outputs) {
                let bytes = plan.values[v.0].bytes(max);
                if self.bindings.get(name).is_none_or(|b| b.len() < bytes) {
                    self.stream.synchronize().map_err(cuda_err("synchronising before growing a binding"))?;
                    self.bindings.insert(name.clone(), DeviceBuf::zeros(&self.stream, bytes)?);
                    grown = true;
                }
            }
        }
        Ok(grown)
    }

    /// The address of each value of `plan` in this context's arena and bindings.
    fn addresses(&self, plan: &Plan) -> Vec<u64> {
        let mut ptrs = vec![0u64; plan.values.len()];
        for (name, v) in plan.inputs.iter().chain(&plan.outputs) {
            ptrs[v.0] = self.bindings.get(name).map_or(0, DeviceBuf::ptr);
        }
        for (v, desc) in plan.values.iter().enumerate() {
            if desc.storage != Storage::Binding {
                ptrs[v] = self.arena.ptr() + plan.offsets[v] as u64;
            }
        }
        ptrs
    }

    /// Computes every plan's value addresses in the current arena and bindings, dropping captured
    /// graphs (they hold the old addresses).
    fn place(&mut self) {
        for i in 0..self.plans.len() {
            self.plans[i].ptrs = self.addresses(&self.plans[i].plan);
            self.plans[i].graphs.clear();
        }
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// The plan the next run uses.
    pub fn plan(&self) -> &Arc<Plan> {
        &self.plans[self.current].plan
    }
    /// Switches CUDA graph replay on or off (off: every layer is launched from the host).
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.use_graphs = on;
    }

    /// Selects the plan for these per-image input dims (TensorRT's `setInputShape`), lowering it
    /// on first use if it lies inside one of the engine's profiles. Inputs not named keep the
    /// current plan's dims. The binding addresses stay valid unless a larger plan grows them.
    pub fn set_input_dims(&mut self, dims: &InputDims) -> Result<()> {
        let mut want = self.plan().dims.clone();
        for (name, d) in dims {
            if !want.contains_key(name) {
                return Err(Error::Binding {
                    name: name.clone(),
                    reason: format!("the engine has no input of that name; it has {:?}", want.keys().collect::<Vec<_>>()),
                });
            }
            want.insert(name.clone(), d.clone());
        }
        if let Some(i) = self.plans.iter().position(|cp| cp.plan.dims == want) {
            self.current = i;
            return Ok(());
        }
        let plan = self.engine.plan_for(&want)?;
        let grown = self.reserve(std::slice::from_ref(&plan))?;
        let ptrs = self.addresses(&plan);
        self.plans.push(ContextPlan { plan, ptrs, graphs: HashMap::new() });
        self.current = self.plans.len() - 1;
        if grown {
            self.place();
        }
        Ok(())
    }

    fn check_batch(&self, batch: usize) -> Result<()> {
        let c = &self.engine.config;
        if batch < c.min_batch || batch > c.max_batch {
            return Err(Error::Binding {
                name: "batch".into(),
                reason: format!("batch {batch} is outside the engine's range {}..={}", c.min_batch, c.max_batch),
            });
        }
        Ok(())
    }

    /// Enqueues the current plan for `batch` on the context's stream (replaying its CUDA graph
    /// when enabled, capturing it on first use of that batch size). Bindings must already hold
    /// inputs.
    pub fn execute(&mut self, batch: usize) -> Result<()> {
        self.check_batch(batch)?;
        self.engine.gpu.ctx.bind_to_thread().map_err(cuda_err("binding the CUDA context"))?;
        if !self.use_graphs {
            return self.enqueue_layers(batch);
        }
        if !self.plans[self.current].graphs.contains_key(&batch) {
            let graph = self
                .capture(|| self.enqueue_layers(batch))?
                .ok_or_else(|| Error::Cuda { context: "CUDA graph capture".into(), reason: "nothing was captured".into() })?;
            self.plans[self.current].graphs.insert(batch, graph);
        }
        self.plans[self.current].graphs[&batch].launch().map_err(cuda_err("launching a CUDA graph"))
    }

    /// [`execute`](Self::execute) between two events on the context's stream, waited for: the
    /// run's device time in milliseconds (trtexec's "GPU Compute Time"), which leaves out the
    /// host's launch and wake-up latency that a wall-clock time around the same call includes.
    pub fn execute_timed(&mut self, batch: usize) -> Result<f64> {
        self.engine.gpu.ctx.bind_to_thread().map_err(cuda_err("binding the CUDA context"))?;
        let (start, end) = match self.timing.take() {
            Some(pair) => pair,
            None => {
                let event =
                    || self.engine.gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(cuda_err("creating a timing event"));
                (event()?, event()?)
            }
        };
        start.record(&self.stream).map_err(cuda_err("recording a timing event"))?;
        self.execute(batch)?;
        end.record(&self.stream).map_err(cuda_err("recording a timing event"))?;
        end.synchronize().map_err(cuda_err("running the engine"))?;
        let ms = start.elapsed_ms(&end).map_err(cuda_err("reading a timing event"))?;
        self.timing = Some((start, end));
        Ok(ms as f64)
    }

    /// Captures what `enqueue` puts on the context's stream into an uploaded CUDA graph (`None`
    /// if it enqueued nothing). The one capture path: whole plans and single layers alike.
    fn capture(&self, enqueue: impl FnOnce() -> Result<()>) -> Result<Option<CudaGraph>> {
        let _gate = super::gpu::capturing();
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda_err("beginning CUDA graph capture"))?;
        let enqueued = enqueue();
        let captured = self.stream.end_capture(CUgraphInstantiate_flags(0));
        enqueued?;
        let graph = captured.map_err(cuda_err("ending CUDA graph capture"))?;
        if let Some(g) = &graph {
            g.upload().map_err(cuda_err("uploading a CUDA graph"))?;
        }
        Ok(graph)
    }

    /// What layer `i` of the current plan sees when it is enqueued at `batch`: its workspace is its
    /// own part of the arena (`Workspace::at`).
    fn run_ctx(&self, i: usize, batch: usize) -> RunCtx<'_> {
        let cp = &self.plans[self.current];
        let (offset, bytes) = cp.plan.workspaces[i].at(batch, cp.plan.layers[i].workspace_bytes(batch));
        RunCtx {
            stream: &self.stream,
            handles: &self.handles,
            ptrs: &cp.ptrs,
            workspace: self.arena.ptr() + offset as u64,
            workspace_bytes: bytes,
        }
    }

    fn enqueue_layers(&self, batch: usize) -> Result<()> {
        for (i, layer) in self.plan().layers.iter().enumerate() {
            layer.enqueue(&self.run_ctx(i, batch), batch).map_err(|e| match e {
                Error::Cuda { context, reason } => {
                    Error::Cuda { context: format!("{context} (layer `{}`, {}, batch {batch})", layer.path(), layer.kind()), reason }
                }
                other => other,
            })?;
        }
        Ok(())
    }

    /// The value of the binding `name` in the current plan.
    fn binding(&self, name: &str, inputs: bool) -> Result<super::ValueId> {
        let plan = self.plan();
        let list = if inputs { &plan.inputs } else { &plan.outputs };
        list.iter().find(|(n, _)| n == name).map(|(_, v)| *v).ok_or_else(|| Error::Binding {
            name: name.to_string(),
            reason: format!(
                "the engine has no {} of that name; it has {:?}",
                if inputs { "input" } else { "output" },
                list.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>()
            ),
        })
    }

    /// Runs on host tensors and waits: every input by name, every output returned (f32). The
    /// inputs' dims pick the plan (see [`ExecutionContext::set_input_dims`]). Inputs are
    /// `&HostTensor`s (f32 values), or [`HostInput`]s where some are bytes: an input declared u8
    /// is uploaded one byte per element from a `&ByteTensor` as it is, or from f32 values that
    /// are integers in 0..=255 (anything else is `Error::NotAByte`, naming the first).
    ///
    /// Many contexts run at once, one a thread, and each gets its share (issue 29, item 11). The
    /// copies go through this context's own page-locked staging buffer, so they are asynchronous
    /// DMA on its stream. Pageable copies went through the driver's staging memory, which every
    /// context of the process shares, and a pageable copy to the host returns only once it is
    /// done, so each run held that memory while it waited for its whole graph; 16 threads queued
    /// on it in no order, and one completed 3 runs while another completed 36,672. A run now waits
    /// once, on an event made with `CU_EVENT_BLOCKING_SYNC`: the thread sleeps until its copies
    /// are done instead of spinning on a core that the other threads need to stage their inputs.
    pub fn run<'a, T: Into<HostInput<'a>> + Copy>(&mut self, inputs: &[(&str, T)]) -> Result<BTreeMap<String, HostTensor>> {
        let inputs: Vec<(&str, HostInput<'a>)> = inputs.iter().map(|&(name, t)| (name, t.into())).collect();
        let (batch, mut offset) = self.bind_host_inputs(&inputs)?;
        self.execute(batch)?;
        let cp = &self.plans[self.current];
        let staging = self.staging.as_mut().expect("bind_host_inputs leaves a staging buffer");
        let mut outputs = Vec::with_capacity(cp.plan.outputs.len());
        for (name, v) in &cp.plan.outputs {
            let elems = batch * cp.plan.values[v.0].per_image_elems();
            // SAFETY: the binding holds `batch` images of this output as f32 (`reserve` sized it for
            // the max batch), and `bind_host_inputs` sized the staging buffer for them from `offset`
            // on; the event below is waited on before this range is read, written again or freed.
            unsafe { drv::memcpy_dtoh_async(staging.bytes_mut(offset, elems * 4), cp.ptrs[v.0], self.stream.cu_stream()) }
                .map_err(cuda_err("copying an output to the host"))?;
            outputs.push((name.clone(), offset, elems, &cp.plan.values[v.0].dims));
            offset += aligned(elems * 4);
        }
        self.done.record(&self.stream).map_err(cuda_err("recording the end of a run"))?;
        self.done.synchronize().map_err(cuda_err("running the engine"))?;
        let mut out = BTreeMap::new();
        for (name, offset, elems, dims) in outputs {
            let mut shape = vec![batch];
            shape.extend(dims);
            out.insert(name, HostTensor::new(shape, staging.read_f32(offset, elems)));
        }
        Ok(out)
    }

    /// Checks the inputs, selects their plan, stages them in the page-locked buffer (grown to hold
    /// them and the outputs at this batch) and enqueues their copies to the bindings. Returns the
    /// batch and the staging offset where the outputs go.
    fn bind_host_inputs(&mut self, inputs: &[(&str, HostInput)]) -> Result<(usize, usize)> {
        self.engine.gpu.ctx.bind_to_thread().map_err(cuda_err("binding the CUDA context"))?;
        let names: Vec<String> = self.plan().inputs.iter().map(|(n, _)| n.clone()).collect();
        if inputs.len() != names.len() {
            return Err(Error::Binding {
                name: "inputs".into(),
                reason: format!("expected {} input(s) {names:?}, got {}", names.len(), inputs.len()),
            });
        }
        let mut dims = InputDims::new();
        for (name, t) in inputs {
            if !names.iter().any(|n| n == name) {
                return Err(Error::Binding {
                    name: name.to_string(),
                    reason: format!("the engine has no input of that name; it has {names:?}"),
                });
            }
            let Some((_, per_image)) = t.shape().split_first() else {
                return Err(Error::Binding { name: name.to_string(), reason: "a scalar input has no batch dimension".into() });
            };
            dims.insert(name.to_string(), per_image.to_vec());
        }
        if dims != self.plan().dims {
            self.set_input_dims(&dims).map_err(|e| match e {
                Error::Binding { reason, .. } if dims.len() == 1 => {
                    Error::Binding { name: names[0].clone(), reason: format!("shape {:?}: {reason}", inputs[0].1.shape()) }
                }
                other => other,
            })?;
        }
        // Every input checked and in the type its binding takes (bytes for a u8 input, f32
        // otherwise) before anything is staged.
        let mut batch = None;
        let mut staged: Vec<(u64, Staged)> = Vec::with_capacity(inputs.len());
        for (name, t) in inputs {
            let v = self.binding(name, true)?;
            let b = t.shape()[0];
            if *batch.get_or_insert(b) != b {
                return Err(Error::Binding { name: name.to_string(), reason: "inputs have different batch sizes".into() });
            }
            self.check_batch(b)?;
            t.check_len(name)?;
            let ptr = self.plans[self.current].ptrs[v.0];
            staged.push(match self.plan().values[v.0].elem {
                Elem::U8 => (ptr, Staged::U8(t.to_u8(name)?)),
                _ => (ptr, Staged::F32(t.to_f32(name, DType::F32)?)),
            });
        }
        let batch = batch.ok_or_else(|| Error::Binding { name: "inputs".into(), reason: "the engine has no inputs".into() })?;
        let plan = self.plan();
        let in_bytes: usize = staged.iter().map(|(_, s)| aligned(s.bytes().len())).sum();
        let out_bytes: usize = plan.outputs.iter().map(|(_, v)| aligned(batch * plan.values[v.0].per_image_elems() * 4)).sum();
        let stream = self.stream.cu_stream();
        let staging = self.staging_of(in_bytes + out_bytes)?;
        let mut offset = 0;
        for (ptr, s) in &staged {
            let bytes = s.bytes();
            let range = staging.bytes_mut(offset, bytes.len());
            range.copy_from_slice(bytes);
            // The binding's device buffer holds `max_batch` images of these dims (one byte an
            // element for a u8 input, four otherwise), and `bytes` holds `batch` of them (its
            // length was checked against its shape, whose per-image dims are the plan's).
            // SAFETY: `range` fits the binding; it is page-locked memory of this context, not
            // written again or freed before `run` waits for the stream.
            unsafe { drv::memcpy_htod_async(*ptr, range, stream) }.map_err(cuda_err("copying an input to the device"))?;
            offset += aligned(bytes.len());
        }
        Ok((batch, offset))
    }

    /// The staging buffer, grown to at least `bytes`. Growing waits for the stream first: a copy
    /// of an earlier run that failed part way may still read the old buffer.
    fn staging_of(&mut self, bytes: usize) -> Result<&mut Pinned> {
        if self.staging.as_ref().is_none_or(|p| p.len < bytes) {
            self.stream.synchronize().map_err(cuda_err("synchronising before growing the staging buffer"))?;
            self.staging = None;
            self.staging = Some(Pinned::new(&self.engine.gpu.ctx, bytes)?);
        }
        Ok(self.staging.as_mut().expect("set above"))
    }

    /// This context's page-locked host memory, grown to at least `bytes` (zeroed when grown): the
    /// buffer [`ExecutionContext::run`] stages through, lent to callers that enqueue their own
    /// copies on [`ExecutionContext::stream`] (a server gathering many requests into the bindings,
    /// one host-to-device copy for all). Growing waits for the stream first and allocates as
    /// `run` does; the memory stays where it is until a later call (this or `run`) needs more.
    /// Wait for the stream before writing what a copy still reads, or reading what it writes.
    pub fn staging(&mut self, bytes: usize) -> Result<&mut [u8]> {
        let staging = self.staging_of(bytes)?;
        let len = staging.len;
        Ok(staging.bytes_mut(0, len))
    }

    /// Asynchronous run from device memory on the context's stream: copies each input (`batch`
    /// images of the current plan's dims at a device address, f32 values, or bytes for an input
    /// declared u8) into the bindings, runs,
    /// and copies each output to its device address. Returns without waiting; call
    /// `synchronize` before reading outputs. Select other dims first with `set_input_dims`.
    ///
    /// # Safety
    /// Every address must point to device memory of this engine's GPU large enough for `batch`
    /// images of that binding, valid until the stream has finished.
    pub unsafe fn enqueue_device(&mut self, batch: usize, inputs: &[(&str, u64)], outputs: &[(&str, u64)]) -> Result<()> {
        self.check_batch(batch)?;
        self.engine.gpu.ctx.bind_to_thread().map_err(cuda_err("binding the CUDA context"))?;
        for (name, ptr) in inputs {
            let v = self.binding(name, true)?;
            let bytes = self.plan().values[v.0].bytes(batch);
            drv::memcpy_dtod_async(self.plans[self.current].ptrs[v.0], *ptr, bytes, self.stream.cu_stream())
                .map_err(cuda_err("copying an input"))?;
        }
        self.execute(batch)?;
        for (name, ptr) in outputs {
            let v = self.binding(name, false)?;
            let bytes = self.plan().values[v.0].bytes(batch);
            drv::memcpy_dtod_async(*ptr, self.plans[self.current].ptrs[v.0], bytes, self.stream.cu_stream())
                .map_err(cuda_err("copying an output"))?;
        }
        Ok(())
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(cuda_err("synchronising the context's stream"))
    }

    /// The size in bytes of a binding's buffer: the max batch at the largest dims of the plans
    /// this context has, one byte per element for an input declared u8, four otherwise.
    pub fn binding_bytes(&self, name: &str) -> Result<usize> {
        self.binding(name, true).or_else(|_| self.binding(name, false))?;
        Ok(self.bindings.get(name).map_or(0, DeviceBuf::len))
    }

    /// Device address of a binding's buffer (for zero-copy use with `execute`). It holds the max
    /// batch at the largest dims of the plans this context has; selecting a plan with larger
    /// dims may move it.
    pub fn binding_ptr(&self, name: &str) -> Result<u64> {
        self.binding(name, true).or_else(|_| self.binding(name, false))?;
        Ok(self.bindings.get(name).map_or(0, DeviceBuf::ptr))
    }

    /// Median wall time of `iters` runs of `execute(batch)` on the inputs already bound, after
    /// `warmup` runs; in milliseconds.
    pub fn time(&mut self, batch: usize, warmup: usize, iters: usize) -> Result<f64> {
        for _ in 0..warmup {
            self.execute(batch)?;
        }
        self.synchronize()?;
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = std::time::Instant::now();
            self.execute(batch)?;
            self.synchronize()?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        Ok(times.get(times.len() / 2).copied().unwrap_or(f64::NAN))
    }
}

impl ExecutionContext {
    /// Device time of each layer at `batch`, in plan order and milliseconds, for `kiln profile`.
    ///
    /// Launched one by one from the host, layers would be timed with the host's launch gaps in
    /// them (a cuDNN call costs more host time than a small convolution takes on the GPU). So each
    /// layer is captured alone into a CUDA graph and replayed `iters` times back to back between
    /// two events: its time is the mean replay. Layers that enqueue nothing take 0. The replays
    /// overwrite the context's outputs; run again before reading them.
    pub fn profile_layers(&mut self, batch: usize, iters: usize) -> Result<Vec<f64>> {
        self.check_batch(batch)?;
        let ctx = &self.engine.gpu.ctx;
        ctx.bind_to_thread().map_err(cuda_err("binding the CUDA context"))?;
        let event = || ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(cuda_err("creating a profiling event"));
        let (start, end) = (event()?, event()?);
        let iters = iters.max(1);
        let plan = self.plan().clone();
        let mut times = Vec::with_capacity(plan.layers.len());
        for (i, layer) in plan.layers.iter().enumerate() {
            let Some(graph) = self.capture(|| layer.enqueue(&self.run_ctx(i, batch), batch))? else {
                times.push(0.0);
                continue;
            };
            graph.launch().map_err(cuda_err("launching a layer's CUDA graph"))?;
            start.record(&self.stream).map_err(cuda_err("recording a profiling event"))?;
            for _ in 0..iters {
                graph.launch().map_err(cuda_err("launching a layer's CUDA graph"))?;
            }
            end.record(&self.stream).map_err(cuda_err("recording a profiling event"))?;
            let ms = start.elapsed_ms(&end).map_err(cuda_err("reading a profiling event"))?;
            times.push(ms as f64 / iters as f64);
        }
        Ok(times)
    }
}

/// An input of `run` in the type its binding takes.
enum Staged<'a> {
    F32(Cow<'a, HostTensor>),
    U8(Cow<'a, ByteTensor>),
}

impl Staged<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            // SAFETY: any f32 is four initialised bytes, and u8 has no alignment to keep.
            Staged::F32(t) => unsafe { std::slice::from_raw_parts(t.data.as_ptr().cast::<u8>(), t.data.len() * 4) },
            Staged::U8(t) => &t.data,
        }
    }
}

/// Offsets in the staging buffer start at multiples of 256 bytes (whole DMA lines).
fn aligned(bytes: usize) -> usize {
    bytes.div_ceil(256) * 256
}

/// Page-locked host memory (`cuMemHostAlloc`, cached: outputs are read back from it, which
/// write-combined memory makes slow), zeroed.
struct Pinned {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
}

impl Pinned {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        ctx.bind_to_thread().map_err(cuda_err("binding the CUDA context"))?;
        // Allocating and freeing page-locked memory may synchronise the device, which would
        // invalidate another thread's capture: hold the capture gate alone, as handles do.
        let _alone = super::gpu::CAPTURE_GATE.write().unwrap_or_else(|e| e.into_inner());
        // SAFETY: asks the driver for `len` (at least 1) bytes; they are zeroed below before any read.
        let ptr = unsafe { drv::malloc_host(len.max(1), 0) }.map_err(|e| match e.0 {
            cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Error::OutOfMemory { what: "page-locked host memory for an execution context's inputs and outputs".into(), bytes: len }
            }
            _ => cuda_err("allocating page-locked host memory")(e),
        })?;
        let ptr = ptr.cast::<u8>();
        // SAFETY: `ptr` holds `len.max(1)` writable bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, len.max(1)) };
        Ok(Self { ctx: ctx.clone(), ptr, len })
    }

    /// Bytes `offset..offset + n` (panics past the end, as slicing does).
    fn bytes_mut(&mut self, offset: usize, n: usize) -> &mut [u8] {
        assert!(offset.checked_add(n).is_some_and(|end| end <= self.len), "staging range {offset}+{n} past {}", self.len);
        // SAFETY: the range lies within the `len` initialised bytes this value owns, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), n) }
    }

    /// `n` f32 values from `offset`.
    fn read_f32(&mut self, offset: usize, n: usize) -> Vec<f32> {
        let bytes = self.bytes_mut(offset, n * 4);
        let mut values = vec![0f32; n];
        // SAFETY: `values` holds `n * 4` bytes, `bytes` as many, and the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), values.as_mut_ptr().cast::<u8>(), n * 4) };
        values
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // Errors on teardown cannot be acted on; the memory is the driver's either way. Whoever
        // drops it has waited for the copies that use it (`run`, `staging_of`) or is dropping the
        // whole context.
        let _ = self.ctx.bind_to_thread();
        let _alone = super::gpu::CAPTURE_GATE.write().unwrap_or_else(|e| e.into_inner());
        // SAFETY: `ptr` came from `malloc_host` and is freed once, here.
        let _ = unsafe { drv::free_host(self.ptr.cast()) };
    }
}
