//! Moving bytes between Triton's buffers and Kiln's: plain copies between host buffers, and the
//! CUDA driver (through cudarc) wherever one side is GPU memory. With unified addressing the
//! driver tells host from device pointers itself, and copies between GPUs too.

use crate::error::{BackendError, Result};
use crate::ffi::memory;
use cudarc::driver::{sys, CudaContext};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One side of a copy: an address and where it lives.
#[derive(Clone, Copy, Debug)]
pub struct Place {
    pub ptr: u64,
    pub memory: u32,
    pub device: i64,
}

impl Place {
    pub fn host(ptr: *const u8) -> Self {
        Self { ptr: ptr as u64, memory: memory::CPU, device: 0 }
    }
    pub fn is_gpu(&self) -> bool {
        self.memory == memory::GPU
    }
}

/// Copies `bytes` from `src` to `dst`. Host to host is a plain copy; anything touching a GPU goes
/// through the driver: ordered on `stream` when given (the caller synchronises it before either
/// side is released), else synchronously in the primary context of the GPU side's device.
///
/// # Safety
/// Both places hold at least `bytes` bytes, valid (and `dst` writable) until the copy completes.
pub unsafe fn copy(dst: Place, src: Place, bytes: usize, stream: Option<sys::CUstream>) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    if !dst.is_gpu() && !src.is_gpu() {
        // SAFETY: both are host buffers of at least `bytes` bytes (the caller's contract), and a
        // request's input never aliases a response's output.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr as *const u8, dst.ptr as *mut u8, bytes) };
        return Ok(());
    }
    let failed = |call: &'static str| move |e: cudarc::driver::DriverError| BackendError::Cuda { call, reason: format!("{e:?}") };
    match stream {
        // SAFETY: unified addressing: the driver infers each side's kind from the address; the
        // caller keeps both alive until the stream is synchronised.
        Some(s) => unsafe { sys::cuMemcpyAsync(dst.ptr, src.ptr, bytes, s) }.result().map_err(failed("cuMemcpyAsync")),
        None => {
            let device = if dst.is_gpu() { dst.device } else { src.device };
            primary_context(device)?.bind_to_thread().map_err(failed("cuCtxSetCurrent"))?;
            // SAFETY: as above, synchronous.
            unsafe { sys::cuMemcpy(dst.ptr, src.ptr, bytes) }.result().map_err(failed("cuMemcpy"))
        }
    }
}

/// Enqueues a copy of `bytes` from `src` to `dst` on `stream` of a context on GPU `own`, where at
/// least one side is GPU memory (host-to-host copies are the caller's). Between two GPUs it is a
/// peer copy (`cuMemcpyPeerAsync`, naming both devices' primary contexts): direct over NVLink or
/// PCIe once [`enable_peer_access`] has run, never staged through the host by this backend.
/// Anything else (device to device on one GPU, host and device) is `cuMemcpyAsync` with unified
/// addressing.
///
/// # Safety
/// Both places hold at least `bytes` bytes, valid (and `dst` writable) until `stream` has been
/// synchronised; a host side that is not page-locked makes the driver copy synchronously.
pub unsafe fn copy_async(dst: Place, src: Place, bytes: usize, own: i64, stream: sys::CUstream) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let failed = |call: &'static str| move |e: cudarc::driver::DriverError| BackendError::Cuda { call, reason: format!("{e:?}") };
    if dst.is_gpu() && src.is_gpu() && dst.device != src.device {
        let (to, from) = (primary_context(dst.device)?, primary_context(src.device)?);
        if dst.device != own && src.device != own {
            return Err(BackendError::Unsupported {
                what: format!("a copy from GPU {} to GPU {} on GPU {own}'s stream", src.device, dst.device),
                reason: "one side of a request's copy must be the instance's GPU".into(),
            });
        }
        // SAFETY: both contexts are primary contexts kept for the process; the caller keeps both
        // buffers alive until the stream is synchronised.
        return unsafe { sys::cuMemcpyPeerAsync(dst.ptr, to.cu_ctx(), src.ptr, from.cu_ctx(), bytes, stream) }
            .result()
            .map_err(failed("cuMemcpyPeerAsync"));
    }
    // SAFETY: unified addressing: the driver infers each side's kind from the address; the caller
    // keeps both alive until the stream is synchronised.
    unsafe { sys::cuMemcpyAsync(dst.ptr, src.ptr, bytes, stream) }.result().map_err(failed("cuMemcpyAsync"))
}

/// Lets the current context (GPU `own`'s primary context, bound to this thread) read and write
/// every other GPU's memory directly, where the hardware allows: Triton's CUDA shared-memory
/// regions live on the GPU their client chose (perf_analyzer: GPU 0), and an instance on another
/// GPU copies each request from there. Without peer access the driver stages such copies through
/// host memory. Returns the GPUs it can reach; leaves `own`'s context bound.
pub fn enable_peer_access(own: usize) -> Result<Vec<usize>> {
    let failed = |call: &'static str| move |e: cudarc::driver::DriverError| BackendError::Cuda { call, reason: format!("{e:?}") };
    let count = CudaContext::device_count().map_err(failed("cuDeviceGetCount"))?;
    let me = primary_context(own as i64)?;
    let mut peers = Vec::new();
    for other in (0..count.max(0) as usize).filter(|&d| d != own) {
        let peer = primary_context(other as i64)?;
        let mut can = 0i32;
        // SAFETY: `can` outlives the call; both devices come from live contexts.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, me.cu_device(), peer.cu_device()) }
            .result()
            .map_err(failed("cuDeviceCanAccessPeer"))?;
        if can == 0 {
            continue;
        }
        me.bind_to_thread().map_err(failed("cuCtxSetCurrent"))?;
        // SAFETY: the current context is `own`'s primary context; `peer` is another GPU's primary
        // context, kept for the process.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.cu_ctx(), 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => peers.push(other),
            e => return Err(failed("cuCtxEnablePeerAccess")(cudarc::driver::DriverError(e))),
        }
    }
    me.bind_to_thread().map_err(failed("cuCtxSetCurrent"))?;
    Ok(peers)
}

/// The primary context of `device` (the one Triton's own CUDA runtime uses), kept for the process.
fn primary_context(device: i64) -> Result<Arc<CudaContext>> {
    static CONTEXTS: Mutex<Option<HashMap<i64, Arc<CudaContext>>>> = Mutex::new(None);
    let mut map = CONTEXTS.lock().unwrap_or_else(|p| p.into_inner());
    let map = map.get_or_insert_with(HashMap::new);
    if let Some(c) = map.get(&device) {
        return Ok(c.clone());
    }
    let ordinal = usize::try_from(device)
        .map_err(|_| BackendError::Cuda { call: "cuDevicePrimaryCtxRetain", reason: format!("device id {device}") })?;
    let mut current: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `current` outlives the call.
    unsafe { sys::cuCtxGetCurrent(&mut current) }
        .result()
        .map_err(|e| BackendError::Cuda { call: "cuCtxGetCurrent", reason: format!("{e:?}") })?;
    let ctx = CudaContext::new(ordinal).map_err(|e| BackendError::Cuda { call: "cuDevicePrimaryCtxRetain", reason: format!("{e:?}") })?;
    // `CudaContext::new` binds the new context; the caller's stays current.
    if !current.is_null() {
        // SAFETY: `current` was this thread's context a moment ago and is still alive (its owner
        // is the caller).
        unsafe { sys::cuCtxSetCurrent(current) }
            .result()
            .map_err(|e| BackendError::Cuda { call: "cuCtxSetCurrent", reason: format!("{e:?}") })?;
    }
    map.insert(device, ctx.clone());
    Ok(ctx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_to_host_copies_without_a_gpu() {
        let src = [1u8, 2, 3, 4, 5];
        let mut dst = [0u8; 5];
        // SAFETY: both arrays hold 5 bytes.
        unsafe { copy(Place::host(dst.as_mut_ptr()), Place::host(src.as_ptr()), 5, None) }.unwrap();
        assert_eq!(dst, src);
        let pinned = Place { memory: memory::CPU_PINNED, ..Place::host(src.as_ptr()) };
        let mut again = [0u8; 3];
        // SAFETY: 3 bytes on each side.
        unsafe { copy(Place::host(again.as_mut_ptr()), pinned, 3, None) }.unwrap();
        assert_eq!(again, [1, 2, 3]);
    }
}
