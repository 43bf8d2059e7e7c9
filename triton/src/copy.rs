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
    let ctx = CudaContext::new(ordinal).map_err(|e| BackendError::Cuda { call: "cuDevicePrimaryCtxRetain", reason: format!("{e:?}") })?;
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
