//! What an instance runs a batch on: Kiln's CPU executor (`KIND_CPU`) or an engine's execution
//! context on the instance's GPU (`KIND_GPU`). Both take the batch's requests in place, run once,
//! and hand out each request's slice of each output wherever Triton wants it.

use crate::config::ElemType;
use crate::copy::{copy, copy_async, enable_peer_access, Place};
use crate::error::{BackendError, Result};
use crate::ffi::memory;
use crate::gather::{image_range, layout, plan_input, spans, Part};
use crate::kiln_api::{run_cpu, ByteTensor, Engine, ExecutionContext, HostInput, HostTensor, InputDims};
use crate::model::LoadedModel;
use crate::request::{Buffer, Checked, RequestData};
use crate::triton::now_ns;
use cudarc::driver::sys::{CUevent_flags, CUstream};
use cudarc::driver::CudaEvent;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

/// One request of a run: its data, its checks, and where its images start in the batch.
pub struct Member<'a> {
    pub data: &'a RequestData,
    pub checked: &'a Checked,
    pub offset: usize,
}

/// Where an output slice goes: the buffer Triton gave for it.
#[derive(Clone, Copy, Debug)]
pub struct Dest {
    pub place: Place,
    pub len: usize,
}

/// One batch at a time: `run`, then `write_output` for each request's outputs, then `finish`.
/// A GPU runner only enqueues work until `finish`, which waits once; request and response buffers
/// must stay alive until it returns.
pub trait Runner: Send {
    /// Where this runner would like Triton's buffers: (memory type, device id).
    fn preferred(&self) -> (u32, i64);
    /// Gathers `members` (of equal per-image dims, `total` images) into one batch and starts it.
    fn run(&mut self, model: &LoadedModel, dims: &InputDims, members: &[Member], total: usize) -> Result<()>;
    /// The per-image dims output `name` has in the current run.
    fn output_dims(&self, name: &str) -> Result<Vec<usize>>;
    /// Copies images `offset..offset + count` of output `name` of the current run to `dst`, by the
    /// time `finish` returns.
    fn write_output(&mut self, name: &str, offset: usize, count: usize, dst: Dest) -> Result<()>;
    /// Waits for the run and every copy `write_output` started, and completes them. Returns when
    /// the computation ended (ns, the clock of Triton's statistics).
    fn finish(&mut self) -> Result<u64>;
}

/// Copies each member's buffers of input `index` (model order) to host memory at `base`, one
/// image after another: `per_image` bytes an image (the CPU executor's batch).
///
/// # Safety
/// `base` holds `total * per_image` bytes (writable); members' buffers are alive and checked to
/// hold their batch's bytes.
unsafe fn gather(base: Place, members: &[Member], index: usize, per_image: usize) -> Result<()> {
    for m in members {
        let input = &m.data.inputs[m.checked.inputs[index]];
        let mut at = base.ptr + (m.offset * per_image) as u64;
        for b in &input.buffers {
            let src = Place { ptr: b.ptr as u64, memory: b.memory, device: b.device };
            // SAFETY: the request's buffers hold exactly `batch * per_image` bytes in all (checked),
            // which land inside the member's part of `base` (the caller's contract).
            unsafe { copy(Place { ptr: at, ..base }, src, b.len, None) }?;
            at += b.len as u64;
        }
    }
    Ok(())
}

/// Kiln's CPU executor over the model's graph (optimised once, re-inferred per input size).
pub struct CpuRunner {
    outputs: BTreeMap<String, HostTensor>,
    ran_at: u64,
}

impl CpuRunner {
    pub fn new() -> Self {
        Self { outputs: BTreeMap::new(), ran_at: 0 }
    }
}

impl Default for CpuRunner {
    fn default() -> Self {
        Self::new()
    }
}

enum Gathered {
    F32(HostTensor),
    U8(ByteTensor),
}

impl Runner for CpuRunner {
    fn preferred(&self) -> (u32, i64) {
        (memory::CPU, 0)
    }

    fn run(&mut self, model: &LoadedModel, dims: &InputDims, members: &[Member], total: usize) -> Result<()> {
        self.outputs.clear();
        let graph = model.cpu_graph(dims)?;
        let mut tensors = Vec::with_capacity(model.spec.inputs.len());
        for (index, b) in model.spec.inputs.iter().enumerate() {
            let per_image: usize = dims[&b.name].iter().product();
            let mut shape = vec![total];
            shape.extend(&dims[&b.name]);
            let t = match b.elem {
                ElemType::F32 => {
                    let mut data = vec![0f32; total * per_image];
                    // SAFETY: `data` holds `total` images of f32; the members' buffers were checked.
                    unsafe { gather(Place::host(data.as_mut_ptr().cast()), members, index, per_image * 4) }?;
                    Gathered::F32(HostTensor::new(shape, data))
                }
                ElemType::U8 => {
                    let mut data = vec![0u8; total * per_image];
                    // SAFETY: as above, one byte an element.
                    unsafe { gather(Place::host(data.as_mut_ptr()), members, index, per_image) }?;
                    Gathered::U8(ByteTensor::new(shape, data).map_err(BackendError::kiln("gathering a batch"))?)
                }
            };
            tensors.push((b.name.as_str(), t));
        }
        let inputs: Vec<(&str, HostInput)> = tensors
            .iter()
            .map(|(n, t)| {
                (
                    *n,
                    match t {
                        Gathered::F32(t) => HostInput::F32(t),
                        Gathered::U8(t) => HostInput::U8(t),
                    },
                )
            })
            .collect();
        self.outputs = run_cpu(&graph, &inputs).map_err(BackendError::kiln(format!("model `{}` on the CPU executor", model.name)))?;
        self.ran_at = now_ns();
        Ok(())
    }

    fn output_dims(&self, name: &str) -> Result<Vec<usize>> {
        let t = self.outputs.get(name).ok_or_else(|| BackendError::Output { name: name.into(), reason: "was not computed".into() })?;
        Ok(t.shape[1..].to_vec())
    }

    fn write_output(&mut self, name: &str, offset: usize, count: usize, dst: Dest) -> Result<()> {
        let t = self.outputs.get(name).ok_or_else(|| BackendError::Output { name: name.into(), reason: "was not computed".into() })?;
        let per_image: usize = t.shape[1..].iter().product();
        let slice = &t.data[offset * per_image..(offset + count) * per_image];
        let bytes = std::mem::size_of_val(slice);
        if dst.len < bytes {
            return Err(BackendError::Output { name: name.into(), reason: format!("Triton gave {} bytes for {bytes}", dst.len) });
        }
        // SAFETY: `slice` is `bytes` long and `dst` holds at least that many (checked above).
        unsafe { copy(dst.place, Place::host(slice.as_ptr().cast()), bytes, None) }
    }

    fn finish(&mut self) -> Result<u64> {
        Ok(self.ran_at)
    }
}

/// An engine's execution context on the instance's GPU. A batch costs one wait: the requests'
/// inputs are copied straight into the engine's input bindings on the context's stream (device to
/// device on the GPU; peer copies from another GPU; page-locked host buffers directly; pageable
/// host inputs through the context's page-locked staging memory with one host-to-device copy for
/// all), the engine runs, each response's outputs are copied from the output bindings (straight
/// into GPU and page-locked buffers; pageable host buffers from one device-to-host copy of each
/// output into staging, split after the wait: a copy to pageable memory would make the driver
/// stage it and return only when done), and the thread sleeps until the stream is done.
pub struct GpuRunner {
    ctx: ExecutionContext,
    device: usize,
    /// The other GPUs whose memory this context reads and writes directly.
    peers: Vec<usize>,
    /// Recorded after a batch's last copy and waited on by sleeping, not spinning on a core that
    /// the server's threads need.
    done: CudaEvent,
    batch: Option<Batch>,
}

/// The batch in flight on a GPU runner.
struct Batch {
    total: usize,
    /// The page-locked staging memory's address (this batch's layout, see `GpuRunner::start`).
    staging: u64,
    outputs: Vec<StagedOutput>,
    /// Host buffers to fill from staging once the stream is done: (output index, bytes of the
    /// binding, where).
    to_host: Vec<(usize, Range<usize>, Dest)>,
}

/// One output binding of the batch, and the staging region its host-bound images go through.
struct StagedOutput {
    name: String,
    dims: Vec<usize>,
    per_image: usize,
    binding: u64,
    staged_at: usize,
    /// Whether some response wants it in host memory (then one device-to-host copy of the batch).
    to_host: bool,
}

impl GpuRunner {
    pub fn new(engine: Arc<Engine>, device: usize) -> Result<Self> {
        let ctx = ExecutionContext::new(engine).map_err(BackendError::kiln(format!("creating an execution context on GPU {device}")))?;
        let peers = enable_peer_access(device)?;
        let gpu = ctx.engine().gpu().clone();
        gpu.ctx.bind_to_thread().map_err(|e| BackendError::Cuda { call: "cuCtxSetCurrent", reason: format!("{e:?}") })?;
        // cudarc's flag type is an enum of single flags: blocking sync alone (timing stays on, as
        // in Kiln's own `run`).
        let done = gpu
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(|e| BackendError::Cuda { call: "cuEventCreate", reason: format!("{e:?}") })?;
        Ok(Self { ctx, device, peers, done, batch: None })
    }

    /// The other GPUs this instance copies from and to directly (peer access).
    pub fn peers(&self) -> &[usize] {
        &self.peers
    }

    fn stream(&self) -> CUstream {
        self.ctx.stream().cu_stream()
    }

    fn bind(&self) -> Result<()> {
        self.ctx.engine().gpu().ctx.bind_to_thread().map_err(|e| BackendError::Cuda { call: "cuCtxSetCurrent", reason: format!("{e:?}") })
    }

    fn on_gpu(&self, ptr: u64) -> Place {
        Place { ptr, memory: memory::GPU, device: self.device as i64 }
    }

    /// Enqueues the batch: plans every copy (checked) before anything moves, stages host inputs,
    /// enqueues the copies into the input bindings and the engine.
    fn start(&mut self, model: &LoadedModel, dims: &InputDims, members: &[Member], total: usize) -> Result<()> {
        let what = || format!("model `{}` on GPU {}", model.name, self.device);
        // Triton runs an instance on a thread of its own, not the one that made the context.
        self.bind()?;
        self.ctx.set_input_dims(dims).map_err(BackendError::kiln(what()))?;
        let plan = self.ctx.plan().clone();
        let mut inputs = Vec::with_capacity(model.spec.inputs.len());
        for (index, b) in model.spec.inputs.iter().enumerate() {
            let per_image = binding_dims(&plan.inputs(), &b.name)?.iter().product::<usize>() * b.elem.size();
            let base = self.ctx.binding_ptr(&b.name).map_err(BackendError::kiln(what()))?;
            let room = self.ctx.binding_bytes(&b.name).map_err(BackendError::kiln(what()))?;
            let buffers: Vec<&[Buffer]> = members.iter().map(|m| m.data.inputs[m.checked.inputs[index]].buffers.as_slice()).collect();
            let lens: Vec<Vec<usize>> = buffers.iter().map(|bs| bs.iter().map(|b| b.len).collect()).collect();
            let parts: Vec<Part> =
                members.iter().zip(&lens).map(|(m, lens)| Part { offset: m.offset, batch: m.checked.batch, buffers: lens }).collect();
            // The batch's part of the binding, which is also the size of its staging region.
            let bytes = checked_bytes(total, per_image)?;
            if bytes > room {
                return Err(BackendError::Request {
                    reason: format!("batch {total} ({bytes} bytes) does not fit the binding of `{}` ({room} bytes)", b.name),
                });
            }
            let segments = plan_input(&parts, per_image, bytes).map_err(|e| match e {
                BackendError::Request { reason } => BackendError::Input { name: b.name.clone(), reason },
                other => other,
            })?;
            for s in &segments {
                let m = buffers[s.member][s.buffer].memory;
                if ![memory::CPU, memory::CPU_PINNED, memory::GPU].contains(&m) {
                    return Err(BackendError::Unsupported {
                        what: format!("input `{}` in memory type {m}", b.name),
                        reason: "not CPU or GPU memory".into(),
                    });
                }
            }
            let host = spans(&segments, |s| buffers[s.member][s.buffer].memory == memory::CPU);
            let staged = if host.is_empty() { 0 } else { bytes };
            inputs.push((base, segments, host, buffers, staged));
        }
        let mut outputs = Vec::new();
        for (name, d) in plan.outputs() {
            let per_image = d.iter().product::<usize>() * ElemType::F32.size();
            let binding = self.ctx.binding_ptr(name).map_err(BackendError::kiln(what()))?;
            outputs.push(StagedOutput { name: name.to_string(), dims: d.to_vec(), per_image, binding, staged_at: 0, to_host: false });
        }
        let sizes: Vec<usize> =
            inputs.iter().map(|i| Ok(i.4)).chain(outputs.iter().map(|o| checked_bytes(total, o.per_image))).collect::<Result<_>>()?;
        let (offsets, need) = layout(&sizes)?;
        // May grow it, which first waits for the stream (nothing of an earlier batch is pending).
        let staging = self.ctx.staging(need).map_err(BackendError::kiln(what()))?.as_mut_ptr() as u64;
        for (o, &at) in outputs.iter_mut().zip(&offsets[inputs.len()..]) {
            o.staged_at = at;
        }
        let (own, stream) = (self.device as i64, self.stream());
        for ((base, segments, host, buffers, _), &at) in inputs.iter().zip(&offsets) {
            for s in segments {
                let src = &buffers[s.member][s.buffer];
                if src.memory == memory::CPU {
                    // SAFETY: the request's buffer holds `s.len` bytes (checked against its shape);
                    // the staging region for this input holds `total * per_image` bytes, and
                    // `s.at + s.len` lies within them (`plan_input` was given that bound).
                    unsafe { std::ptr::copy_nonoverlapping(src.ptr, (staging as usize + at + s.at) as *mut u8, s.len) };
                } else {
                    let from = Place { ptr: src.ptr as u64, memory: src.memory, device: src.device };
                    // SAFETY: `s.at + s.len` lies within the batch's part of the binding (`plan_input`
                    // checked it); the request buffer stays alive until `finish` (or the failure path
                    // of `run`) has waited for the stream.
                    unsafe { copy_async(self.on_gpu(base + s.at as u64), from, s.len, own, stream) }?;
                }
            }
            for span in host {
                let from = Place { ptr: staging + (at + span.start) as u64, memory: memory::CPU_PINNED, device: 0 };
                // SAFETY: the span lies within the binding and within the input's staging region,
                // which is page-locked and not touched again before the stream is waited for.
                unsafe { copy_async(self.on_gpu(base + span.start as u64), from, span.len(), own, stream) }?;
            }
        }
        self.ctx.execute(total).map_err(BackendError::kiln(what()))?;
        self.batch = Some(Batch { total, staging, outputs, to_host: Vec::new() });
        Ok(())
    }

    /// Enqueues each host-bound output's copy to staging, waits once, and fills the host buffers.
    fn complete(&mut self, batch: &Batch) -> Result<u64> {
        self.bind()?;
        let (own, stream) = (self.device as i64, self.stream());
        for o in batch.outputs.iter().filter(|o| o.to_host) {
            let to = Place { ptr: batch.staging + o.staged_at as u64, memory: memory::CPU_PINNED, device: 0 };
            // SAFETY: the output's staging region holds the batch's `total` images (`start` laid it
            // out), as does the binding.
            unsafe { copy_async(to, self.on_gpu(o.binding), batch.total * o.per_image, own, stream) }?;
        }
        let failed = |call: &'static str| move |e: cudarc::driver::DriverError| BackendError::Cuda { call, reason: format!("{e:?}") };
        self.done.record(self.ctx.stream()).map_err(failed("cuEventRecord"))?;
        self.done.synchronize().map_err(failed("cuEventSynchronize"))?;
        let ended = now_ns();
        for (o, range, dst) in &batch.to_host {
            let o = &batch.outputs[*o];
            // SAFETY: the range lies within the output's staging region (`image_range` against the
            // batch), now written; `dst` holds at least `range.len()` bytes (`write_output`).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (batch.staging as usize + o.staged_at + range.start) as *const u8,
                    dst.place.ptr as *mut u8,
                    range.len(),
                )
            };
        }
        Ok(ended)
    }
}

/// The per-image dims of input binding `name` among `list`.
fn binding_dims<'a>(list: &[(&str, &'a [usize])], name: &str) -> Result<&'a [usize]> {
    list.iter()
        .find(|(n, _)| *n == name)
        .map(|(_, d)| *d)
        .ok_or_else(|| BackendError::Input { name: name.into(), reason: "is not an input binding of the engine".into() })
}

/// `images * per_image` bytes, or a request error when that overflows.
fn checked_bytes(images: usize, per_image: usize) -> Result<usize> {
    images.checked_mul(per_image).ok_or_else(|| BackendError::Request { reason: format!("{images} images of {per_image} bytes overflow") })
}

impl Runner for GpuRunner {
    fn preferred(&self) -> (u32, i64) {
        (memory::GPU, self.device as i64)
    }

    fn run(&mut self, model: &LoadedModel, dims: &InputDims, members: &[Member], total: usize) -> Result<()> {
        self.batch = None;
        let started = self.start(model, dims, members, total);
        if started.is_err() {
            // Copies from the requests' buffers may be queued; Triton frees those buffers once the
            // requests are answered, so wait for them now (an error here adds nothing to report).
            let _ = self.ctx.synchronize();
            self.batch = None;
        }
        started
    }

    fn output_dims(&self, name: &str) -> Result<Vec<usize>> {
        let batch = self.batch.as_ref().ok_or_else(|| BackendError::Output { name: name.into(), reason: "no batch is running".into() })?;
        batch
            .outputs
            .iter()
            .find(|o| o.name == name)
            .map(|o| o.dims.clone())
            .ok_or_else(|| BackendError::Output { name: name.into(), reason: "is not an output of the engine".into() })
    }

    fn write_output(&mut self, name: &str, offset: usize, count: usize, dst: Dest) -> Result<()> {
        let (own, stream) = (self.device as i64, self.stream());
        self.bind()?;
        let batch = self.batch.as_mut().ok_or_else(|| BackendError::Output { name: name.into(), reason: "no batch is running".into() })?;
        let index = batch
            .outputs
            .iter()
            .position(|o| o.name == name)
            .ok_or_else(|| BackendError::Output { name: name.into(), reason: "is not an output of the engine".into() })?;
        let o = &mut batch.outputs[index];
        let range = image_range(offset, count, o.per_image, batch.total)?;
        if dst.len < range.len() {
            return Err(BackendError::Output { name: name.into(), reason: format!("Triton gave {} bytes for {}", dst.len, range.len()) });
        }
        if dst.place.is_gpu() || dst.place.memory == memory::CPU_PINNED {
            // GPU memory (on any GPU), or page-locked host memory: a copy on the stream, no staging.
            let src = Place { ptr: o.binding + range.start as u64, memory: memory::GPU, device: own };
            // SAFETY: the range lies within the batch's images of the binding; `dst` holds at least
            // as many bytes (checked) and stays alive until `finish` has waited for the stream.
            unsafe { copy_async(dst.place, src, range.len(), own, stream) }
        } else {
            o.to_host = true;
            batch.to_host.push((index, range, dst));
            Ok(())
        }
    }

    fn finish(&mut self) -> Result<u64> {
        let Some(batch) = self.batch.take() else { return Ok(now_ns()) };
        let done = self.complete(&batch);
        if done.is_err() {
            // As in `run`: nothing may still read or write Triton's buffers once they are answered.
            let _ = self.ctx.synchronize();
        }
        done
    }
}
