//! The device: a CUDA context, a stream, and the cuDNN / cuBLASLt handles bound to that stream.
//!
//! cudarc is built with `dynamic-loading`: it panics on the first call into a library that is not
//! installed. Machines without a GPU must get a value, not a crash, so the libraries are probed
//! with `libloading` first and the first driver calls run under `catch_unwind`.

use crate::{Error, Result};
use cudarc::cublaslt::sys as lt_sys;
use cudarc::cudnn::sys as dnn_sys;
use cudarc::driver::{CudaContext, CudaStream};
use std::sync::{Arc, OnceLock};

/// What an engine file records about the device it was built on.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GpuInfo {
    pub name: String,
    /// Compute capability as `major * 10 + minor` (90 for H100/H200).
    pub sm: u32,
    /// `cuDriverGetVersion` (13000 for CUDA 13.0).
    pub driver_version: u32,
    /// `cudnnGetVersion` (91400 for cuDNN 9.14).
    pub cudnn_version: u32,
}

impl GpuInfo {
    /// The NVRTC architecture flag for this device (`sm_90`).
    pub fn arch(&self) -> String {
        format!("sm_{}", self.sm)
    }
}

/// A cuDNN and a cuBLASLt handle bound to one stream. Each execution context owns its own,
/// since both libraries bind their work to the handle's stream.
pub struct Handles {
    pub cudnn: dnn_sys::cudnnHandle_t,
    pub lt: lt_sys::cublasLtHandle_t,
}

// SAFETY: the handles are only used from the thread that holds the owning context or builder
// (`&mut` or behind that owner's lock); the libraries allow moving a handle between threads.
unsafe impl Send for Handles {}
// SAFETY: as for `Send`: shared references never use a handle concurrently.
unsafe impl Sync for Handles {}

/// CUDA-graph captures hold it shared; creating and destroying library handles hold it alone.
/// Library handle creation and destruction may synchronise the device (cuBLAS documents it for its
/// own), and a device-wide synchronisation while another thread captures a stream invalidates that
/// capture: 16 threads creating execution contexts while others captured their first runs failed
/// with `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` and cuDNN's `EXECUTION_FAILED`
/// (`gpu_hardening::sixteen_threads_with_mixed_batches_are_bit_identical_to_one`); with the gate
/// they pass.
pub(crate) static CAPTURE_GATE: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Holds the capture gate shared for as long as the guard lives (a poisoned gate still serves:
/// it guards no data).
pub(crate) fn capturing() -> std::sync::RwLockReadGuard<'static, ()> {
    CAPTURE_GATE.read().unwrap_or_else(|e| e.into_inner())
}

fn synchronising() -> std::sync::RwLockWriteGuard<'static, ()> {
    CAPTURE_GATE.write().unwrap_or_else(|e| e.into_inner())
}

impl Handles {
    pub fn new(stream: &CudaStream) -> Result<Self> {
        stream.context().bind_to_thread().map_err(cuda_err("binding the CUDA context"))?;
        let _alone = synchronising();
        let cudnn = cudarc::cudnn::result::create_handle().map_err(cuda_err("cudnnCreate"))?;
        // SAFETY: `cudnn` is the live handle created above; the stream outlives it (both owned by `Gpu`).
        unsafe { cudarc::cudnn::result::set_stream(cudnn, stream.cu_stream() as *mut _) }.map_err(cuda_err("cudnnSetStream"))?;
        let lt = cudarc::cublaslt::result::create_handle().map_err(cuda_err("cublasLtCreate"))?;
        Ok(Self { cudnn, lt })
    }
}

impl Drop for Handles {
    fn drop(&mut self) {
        // Errors on teardown cannot be acted on; the handles are gone either way.
        let _alone = synchronising();
        // SAFETY: the handles were created in `Handles::new` and are destroyed once, here.
        unsafe {
            let _ = cudarc::cudnn::result::destroy_handle(self.cudnn);
            let _ = cudarc::cublaslt::result::destroy_handle(self.lt);
        }
    }
}

/// One GPU: context, the builder's stream and handles, and what the device is.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub handles: Handles,
    pub info: GpuInfo,
    /// Builds use the stream and handles above: one build at a time per `Gpu`.
    pub(crate) build_lock: std::sync::Mutex<()>,
    /// Streams and handles of the build's helper threads (`Gpu::helper`), kept for the GPU's
    /// life: plans a helper made (cuDNN's name their handle) outlive its thread.
    helpers: std::sync::Mutex<Vec<Helper>>,
}

/// A stream and handles for one thread of a build that prepares layers in parallel.
pub(crate) struct Helper {
    // Declared first, so dropped before the stream they are bound to.
    pub handles: Handles,
    pub stream: Arc<CudaStream>,
}

/// Maps any displayable library error to `Error::Cuda` naming the call.
pub(crate) fn cuda_err<E: std::fmt::Debug>(context: &str) -> impl FnOnce(E) -> Error + '_ {
    move |e| Error::Cuda { context: context.to_string(), reason: format!("{e:?}") }
}

/// The shared libraries an engine needs, by cudarc's base names.
const LIBS: [(&str, &str); 4] = [("cuda", "CUDA driver"), ("cudnn", "cuDNN"), ("cublasLt", "cuBLASLt"), ("nvrtc", "NVRTC")];

fn probe_libraries() -> std::result::Result<(), String> {
    for (base, what) in LIBS {
        let candidates = cudarc::get_lib_name_candidates(base);
        // SAFETY: loading a CUDA library runs its initialisers, which is what cudarc would do next.
        let found = candidates.iter().any(|name| unsafe { libloading::Library::new(name) }.is_ok());
        if !found {
            return Err(format!("the {what} library (lib{base}.so) is not installed or not on LD_LIBRARY_PATH"));
        }
    }
    Ok(())
}

fn probe_device() -> std::result::Result<(), String> {
    probe_libraries()?;
    let count = std::panic::catch_unwind(CudaContext::device_count)
        .map_err(|_| "the CUDA driver library failed to load".to_string())?
        .map_err(|e| format!("the CUDA driver found no usable device ({e:?})"))?;
    if count < 1 {
        return Err("the CUDA driver reports no device".into());
    }
    Ok(())
}

/// `Ok` when a GPU and the CUDA libraries an engine needs are present; otherwise the reason, for
/// tests to print when they skip. Probed once per process.
pub fn gpu_available() -> std::result::Result<(), String> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PROBE.get_or_init(probe_device).clone()
}

impl Gpu {
    /// Opens GPU `ordinal`; `Error::NoGpu` with the reason where there is none.
    pub fn new(ordinal: usize) -> Result<Arc<Gpu>> {
        gpu_available().map_err(Error::NoGpu)?;
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| Error::NoGpu("the CUDA driver failed to load".into()))?
            .map_err(|e| Error::NoGpu(format!("cannot open GPU {ordinal}: {e:?}")))?;
        // Kiln orders its own work: one stream per execution context, weights uploaded and
        // synchronised at build. cudarc's per-buffer events would only add host cost per call.
        // SAFETY: called once before any buffer of this context exists (see the note above).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        let handles = Handles::new(&stream)?;
        let (major, minor) = ctx.compute_capability().map_err(cuda_err("reading the compute capability"))?;
        let mut driver = 0i32;
        // SAFETY: `driver` outlives the call.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }.result().map_err(cuda_err("cuDriverGetVersion"))?;
        let info = GpuInfo {
            name: ctx.name().map_err(cuda_err("reading the device name"))?,
            sm: (major * 10 + minor) as u32,
            driver_version: driver as u32,
            cudnn_version: cudarc::cudnn::result::get_version() as u32,
        };
        Ok(Arc::new(Gpu { ctx, stream, handles, info, build_lock: std::sync::Mutex::new(()), helpers: Default::default() }))
    }

    /// A helper's stream and handles for the calling thread (the context bound to it): one kept
    /// from an earlier build, else a new one. Give it back with `Gpu::give_back`.
    pub(crate) fn helper(&self) -> Result<Helper> {
        self.ctx.bind_to_thread().map_err(cuda_err("binding the CUDA context"))?;
        if let Some(h) = self.helpers.lock().unwrap_or_else(|p| p.into_inner()).pop() {
            return Ok(h);
        }
        let stream = self.ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        Ok(Helper { handles: Handles::new(&stream)?, stream })
    }

    pub(crate) fn give_back(&self, helper: Helper) {
        self.helpers.lock().unwrap_or_else(|p| p.into_inner()).push(helper);
    }
}
