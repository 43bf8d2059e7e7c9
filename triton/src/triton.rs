//! Small safe helpers over Triton's API: its errors both ways, strings, messages, the log and
//! the clock its statistics use.

use crate::error::{BackendError, Result};
use crate::ffi::{self, Api};
use std::ffi::{c_char, CStr, CString};

/// Turns a returned Triton error into ours (deleting Triton's object); null is success.
pub fn check(api: &Api, call: &'static str, err: *mut ffi::ServerError) -> Result<()> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: `err` is a live error Triton handed us; we own it and delete it once read.
    let (code, message) = unsafe {
        let code = (api.TRITONSERVER_ErrorCode)(err);
        let message = cstr((api.TRITONSERVER_ErrorMessage)(err));
        (api.TRITONSERVER_ErrorDelete)(err);
        (code, message)
    };
    Err(BackendError::Triton { call, code, message })
}

/// A new Triton error with this code and message (owned by the receiver).
pub fn new_error(api: &Api, code: u32, message: &str) -> *mut ffi::ServerError {
    let msg = c_string(message);
    // SAFETY: `msg` is a valid NUL-terminated string for the duration of the call (Triton copies it).
    unsafe { (api.TRITONSERVER_ErrorNew)(code, msg.as_ptr()) }
}

/// A Rust string as C's, any interior NUL replaced.
pub fn c_string(s: &str) -> CString {
    CString::new(s.replace('\0', " ")).unwrap_or_default()
}

/// Copies a C string Triton owns (null reads as empty).
///
/// # Safety
/// `p` is null or points to a NUL-terminated string alive for the call.
pub unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Reads a message as JSON text and deletes it (the caller owned it).
///
/// # Safety
/// `message` is a live message the caller owns.
pub unsafe fn take_json(api: &Api, message: *mut ffi::Message) -> Result<String> {
    let (mut base, mut len) = (std::ptr::null::<c_char>(), 0usize);
    // SAFETY: `message` is live; the out-pointers outlive the call.
    let read = check(api, "TRITONSERVER_MessageSerializeToJson", unsafe {
        (api.TRITONSERVER_MessageSerializeToJson)(message, &mut base, &mut len)
    });
    let text = read.map(|()| {
        // SAFETY: Triton returned `len` bytes at `base`, alive until the message is deleted below.
        let bytes = if base.is_null() { &[][..] } else { unsafe { std::slice::from_raw_parts(base.cast::<u8>(), len) } };
        String::from_utf8_lossy(bytes).into_owned()
    });
    // SAFETY: we own `message` and no longer read from it.
    let deleted = check(api, "TRITONSERVER_MessageDelete", unsafe { (api.TRITONSERVER_MessageDelete)(message) });
    let text = text?;
    deleted?;
    Ok(text)
}

/// Writes to Triton's log (shown with `--log-verbose=1` for `VERBOSE`).
pub fn log(api: &Api, level: u32, msg: &str) {
    // SAFETY: a plain query.
    if !unsafe { (api.TRITONSERVER_LogIsEnabled)(level) } {
        return;
    }
    let (file, msg) = (c_string(file!()), c_string(msg));
    // SAFETY: both strings live for the call; a failure to log is dropped (deleted) below.
    let err = unsafe { (api.TRITONSERVER_LogMessage)(level, file.as_ptr(), line!() as i32, msg.as_ptr()) };
    let _ = check(api, "TRITONSERVER_LogMessage", err);
}

/// Nanoseconds of the monotonic clock, as Triton's statistics (`steady_clock`) take them.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` outlives the call; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
