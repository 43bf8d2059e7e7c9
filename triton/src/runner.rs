//! What an instance runs a batch on: Kiln's CPU executor (`KIND_CPU`) or an engine's execution
//! context on the instance's GPU (`KIND_GPU`). Both take the batch's requests in place, run once,
//! and hand out each request's slice of each output wherever Triton wants it.

use crate::config::ElemType;
use crate::copy::{copy, Place};
use crate::error::{BackendError, Result};
use crate::ffi::memory;
use crate::kiln_api::{run_cpu, ByteTensor, Engine, ExecutionContext, HostInput, HostTensor, InputDims};
use crate::model::LoadedModel;
use crate::request::{Checked, RequestData};
use std::collections::BTreeMap;
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

pub trait Runner: Send {
    /// Where this runner would like Triton's buffers: (memory type, device id).
    fn preferred(&self) -> (u32, i64);
    /// Runs `members` (of equal per-image dims, `total` images) as one batch.
    fn run(&mut self, model: &LoadedModel, dims: &InputDims, members: &[Member], total: usize) -> Result<()>;
    /// The per-image dims output `name` had in the last run.
    fn output_dims(&self, name: &str) -> Result<Vec<usize>>;
    /// Copies images `offset..offset + count` of output `name` of the last run to `dst`.
    fn write_output(&mut self, name: &str, offset: usize, count: usize, dst: Dest) -> Result<()>;
    /// Waits for every copy `write_output` started.
    fn finish(&mut self) -> Result<()>;
}

/// Copies each member's buffers of input `index` (model order) to `base`, one image after
/// another: `per_image` bytes an image.
///
/// # Safety
/// `base` holds `total * per_image` bytes (writable); members' buffers are alive and checked to
/// hold their batch's bytes.
unsafe fn gather(
    base: Place,
    members: &[Member],
    index: usize,
    per_image: usize,
    stream: Option<cudarc::driver::sys::CUstream>,
) -> Result<()> {
    for m in members {
        let input = &m.data.inputs[m.checked.inputs[index]];
        let mut at = base.ptr + (m.offset * per_image) as u64;
        for b in &input.buffers {
            let src = Place { ptr: b.ptr as u64, memory: b.memory, device: b.device };
            // SAFETY: the request's buffers hold exactly `batch * per_image` bytes in all (checked),
            // which land inside the member's part of `base` (the caller's contract).
            unsafe { copy(Place { ptr: at, ..base }, src, b.len, stream) }?;
            at += b.len as u64;
        }
    }
    Ok(())
}

/// Kiln's CPU executor over the model's graph (optimised once, re-inferred per input size).
pub struct CpuRunner {
    outputs: BTreeMap<String, HostTensor>,
}

impl CpuRunner {
    pub fn new() -> Self {
        Self { outputs: BTreeMap::new() }
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
                    unsafe { gather(Place::host(data.as_mut_ptr().cast()), members, index, per_image * 4, None) }?;
                    Gathered::F32(HostTensor::new(shape, data))
                }
                ElemType::U8 => {
                    let mut data = vec![0u8; total * per_image];
                    // SAFETY: as above, one byte an element.
                    unsafe { gather(Place::host(data.as_mut_ptr()), members, index, per_image, None) }?;
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

    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// An engine's execution context on the instance's GPU: inputs are copied into its bindings,
/// outputs out of them, on the context's stream.
pub struct GpuRunner {
    ctx: ExecutionContext,
    device: usize,
}

impl GpuRunner {
    pub fn new(engine: Arc<Engine>, device: usize) -> Result<Self> {
        let ctx = ExecutionContext::new(engine).map_err(BackendError::kiln(format!("creating an execution context on GPU {device}")))?;
        Ok(Self { ctx, device })
    }

    fn stream(&self) -> cudarc::driver::sys::CUstream {
        self.ctx.stream().cu_stream()
    }

    fn bind(&self) -> Result<()> {
        self.ctx.engine().gpu().ctx.bind_to_thread().map_err(|e| BackendError::Cuda { call: "cuCtxSetCurrent", reason: format!("{e:?}") })
    }

    fn per_image_bytes(&self, name: &str, elem: ElemType) -> Result<usize> {
        let plan = self.ctx.plan();
        let dims = plan
            .inputs()
            .into_iter()
            .chain(plan.outputs())
            .find(|(n, _)| *n == name)
            .map(|(_, d)| d.iter().product::<usize>())
            .ok_or_else(|| BackendError::Output { name: name.into(), reason: "is not a binding of the engine".into() })?;
        Ok(dims * elem.size())
    }
}

impl Runner for GpuRunner {
    fn preferred(&self) -> (u32, i64) {
        (memory::GPU, self.device as i64)
    }

    fn run(&mut self, model: &LoadedModel, dims: &InputDims, members: &[Member], total: usize) -> Result<()> {
        let what = || format!("model `{}` on GPU {}", model.name, self.device);
        // Triton runs an instance on a thread of its own, not the one that made the context.
        self.bind()?;
        self.ctx.set_input_dims(dims).map_err(BackendError::kiln(what()))?;
        let stream = self.stream();
        for (index, b) in model.spec.inputs.iter().enumerate() {
            let per_image = self.per_image_bytes(&b.name, b.elem)?;
            let base = self.ctx.binding_ptr(&b.name).map_err(BackendError::kiln(what()))?;
            let room = self.ctx.binding_bytes(&b.name).map_err(BackendError::kiln(what()))?;
            if room < total * per_image {
                return Err(BackendError::Request {
                    reason: format!("batch {total} does not fit the binding of `{}` ({room} bytes)", b.name),
                });
            }
            let place = Place { ptr: base, memory: memory::GPU, device: self.device as i64 };
            // SAFETY: the binding holds `total` images (checked above); the members' buffers stay
            // alive until `finish` has synchronised the stream.
            unsafe { gather(place, members, index, per_image, Some(stream)) }?;
        }
        self.ctx.execute(total).map_err(BackendError::kiln(what()))?;
        // Compute ends when the engine has run: Triton's statistics time it apart from the copies.
        self.ctx.synchronize().map_err(BackendError::kiln(what()))
    }

    fn output_dims(&self, name: &str) -> Result<Vec<usize>> {
        let plan = self.ctx.plan();
        plan.outputs()
            .into_iter()
            .find(|(n, _)| *n == name)
            .map(|(_, d)| d.to_vec())
            .ok_or_else(|| BackendError::Output { name: name.into(), reason: "is not an output of the engine".into() })
    }

    fn write_output(&mut self, name: &str, offset: usize, count: usize, dst: Dest) -> Result<()> {
        let per_image = self.per_image_bytes(name, ElemType::F32)?;
        let bytes = count * per_image;
        if dst.len < bytes {
            return Err(BackendError::Output { name: name.into(), reason: format!("Triton gave {} bytes for {bytes}", dst.len) });
        }
        let base = self.ctx.binding_ptr(name).map_err(BackendError::kiln("reading an output binding"))?;
        let src = Place { ptr: base + (offset * per_image) as u64, memory: memory::GPU, device: self.device as i64 };
        self.bind()?;
        // SAFETY: the binding holds the run's images (offset + count <= total); `dst` holds
        // `bytes` (checked) and stays alive until `finish`.
        unsafe { copy(dst.place, src, bytes, Some(self.stream())) }
    }

    fn finish(&mut self) -> Result<()> {
        self.ctx.synchronize().map_err(BackendError::kiln("copying outputs"))
    }
}
