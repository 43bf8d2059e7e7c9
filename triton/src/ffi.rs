//! Triton's C API, declared here from its public documentation (`tritonbackend.h` and
//! `tritonserver.h` of triton-inference-server/core, backend API 1.19).
//!
//! Two halves: the entry points Triton calls in us are `#[no_mangle]` functions in `lib.rs`; the
//! functions we call in Triton are looked up by name in the server process when the backend is
//! initialised ([`api`]), not linked. So the library builds and its tests run where no Triton is
//! installed, and a server that lacks a function fails the backend's load naming it.

use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

/// The backend API version this backend was written against (Triton's checks: same major, a
/// minor at least this).
pub const API_MAJOR: u32 = 1;
pub const API_MINOR: u32 = 19;

/// Declares opaque C types: handles that are only ever passed back to Triton.
macro_rules! opaque {
    ($($(#[$doc:meta])* $name:ident;)*) => {$(
        $(#[$doc])*
        #[repr(C)]
        pub struct $name {
            _private: [u8; 0],
        }
    )*};
}

opaque! {
    /// `TRITONSERVER_Error`: owned by whoever created it until handed to Triton.
    ServerError;
    /// `TRITONSERVER_Message`: a serialised JSON document (model configs).
    Message;
    /// `TRITONBACKEND_Backend`.
    Backend;
    /// `TRITONBACKEND_Model`.
    Model;
    /// `TRITONBACKEND_ModelInstance`.
    ModelInstance;
    /// `TRITONBACKEND_Request`: owned by the backend from a successful execute until released.
    Request;
    /// `TRITONBACKEND_Input`: lives as long as its request.
    Input;
    /// `TRITONBACKEND_Response`.
    Response;
    /// `TRITONBACKEND_Output`: lives as long as its response.
    Output;
}

/// `TRITONSERVER_Error_Code`.
pub mod code {
    pub const UNKNOWN: u32 = 0;
    pub const INTERNAL: u32 = 1;
    pub const NOT_FOUND: u32 = 2;
    pub const INVALID_ARG: u32 = 3;
    pub const UNAVAILABLE: u32 = 4;
    pub const UNSUPPORTED: u32 = 5;
}

/// `TRITONSERVER_DataType` (the values a request's inputs carry).
pub mod datatype {
    pub const INVALID: u32 = 0;
    pub const BOOL: u32 = 1;
    pub const UINT8: u32 = 2;
    pub const UINT16: u32 = 3;
    pub const UINT32: u32 = 4;
    pub const UINT64: u32 = 5;
    pub const INT8: u32 = 6;
    pub const INT16: u32 = 7;
    pub const INT32: u32 = 8;
    pub const INT64: u32 = 9;
    pub const FP16: u32 = 10;
    pub const FP32: u32 = 11;
    pub const FP64: u32 = 12;
    pub const BYTES: u32 = 13;
    pub const BF16: u32 = 14;

    /// The name Triton's protocols use (`FP32`), for error messages.
    pub fn name(t: u32) -> &'static str {
        const NAMES: [&str; 15] = [
            "INVALID", "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES",
            "BF16",
        ];
        NAMES.get(t as usize).copied().unwrap_or("UNKNOWN")
    }
}

/// `TRITONSERVER_MemoryType`.
pub mod memory {
    pub const CPU: u32 = 0;
    pub const CPU_PINNED: u32 = 1;
    pub const GPU: u32 = 2;
}

/// `TRITONSERVER_InstanceGroupKind`.
pub mod kind {
    pub const AUTO: u32 = 0;
    pub const CPU: u32 = 1;
    pub const GPU: u32 = 2;
    pub const MODEL: u32 = 3;
}

/// `TRITONSERVER_LogLevel`.
pub mod log_level {
    pub const INFO: u32 = 0;
    pub const WARN: u32 = 1;
    pub const ERROR: u32 = 2;
    pub const VERBOSE: u32 = 3;
}

/// `TRITONSERVER_REQUEST_RELEASE_ALL`.
pub const REQUEST_RELEASE_ALL: u32 = 1;
/// `TRITONSERVER_RESPONSE_COMPLETE_FINAL`.
pub const RESPONSE_COMPLETE_FINAL: u32 = 1;
/// `TRITONBACKEND_ARTIFACT_FILESYSTEM`.
pub const ARTIFACT_FILESYSTEM: u32 = 0;

type Err = *mut ServerError;

/// Declares the table of Triton functions the backend calls, one field per C function with its
/// C signature, and the code that looks each up by its C name.
macro_rules! triton_api {
    ($($name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty;)*) => {
        /// Triton's functions, resolved from the server process.
        #[allow(non_snake_case)]
        pub struct Api {
            $(pub $name: unsafe extern "C" fn($($ty),*) -> $ret,)*
        }

        impl Api {
            /// Looks every function up in the process (the server's `libtritonserver.so`, which
            /// the `tritonserver` executable links).
            fn resolve() -> Result<Self, String> {
                let this = libloading::os::unix::Library::this();
                Ok(Self {
                    $($name: {
                        let symbol = concat!(stringify!($name), "\0").as_bytes();
                        // SAFETY: the symbol is Triton's function of this name, whose C signature
                        // (tritonbackend.h / tritonserver.h, API 1.19) is the field's type.
                        let f = unsafe { this.get::<unsafe extern "C" fn($($ty),*) -> $ret>(symbol) }
                            .map_err(|e| format!("the server has no `{}` ({e}); is this Triton 2.x with backend API {API_MAJOR}.{API_MINOR} or newer?", stringify!($name)))?;
                        *f
                    },)*
                })
            }
        }
    };
}

triton_api! {
    TRITONSERVER_ErrorNew(code: u32, msg: *const c_char) -> Err;
    TRITONSERVER_ErrorDelete(error: Err) -> ();
    TRITONSERVER_ErrorCode(error: Err) -> u32;
    TRITONSERVER_ErrorMessage(error: Err) -> *const c_char;
    TRITONSERVER_MessageSerializeToJson(message: *mut Message, base: *mut *const c_char, byte_size: *mut usize) -> Err;
    TRITONSERVER_MessageDelete(message: *mut Message) -> Err;
    TRITONSERVER_LogIsEnabled(level: u32) -> bool;
    TRITONSERVER_LogMessage(level: u32, filename: *const c_char, line: i32, msg: *const c_char) -> Err;

    TRITONBACKEND_ApiVersion(major: *mut u32, minor: *mut u32) -> Err;

    TRITONBACKEND_ModelName(model: *mut Model, name: *mut *const c_char) -> Err;
    TRITONBACKEND_ModelVersion(model: *mut Model, version: *mut u64) -> Err;
    TRITONBACKEND_ModelRepository(model: *mut Model, artifact_type: *mut u32, location: *mut *const c_char) -> Err;
    TRITONBACKEND_ModelConfig(model: *mut Model, config_version: u32, config: *mut *mut Message) -> Err;
    TRITONBACKEND_ModelState(model: *mut Model, state: *mut *mut c_void) -> Err;
    TRITONBACKEND_ModelSetState(model: *mut Model, state: *mut c_void) -> Err;

    TRITONBACKEND_ModelInstanceName(instance: *mut ModelInstance, name: *mut *const c_char) -> Err;
    TRITONBACKEND_ModelInstanceKind(instance: *mut ModelInstance, kind: *mut u32) -> Err;
    TRITONBACKEND_ModelInstanceDeviceId(instance: *mut ModelInstance, device_id: *mut i32) -> Err;
    TRITONBACKEND_ModelInstanceModel(instance: *mut ModelInstance, model: *mut *mut Model) -> Err;
    TRITONBACKEND_ModelInstanceState(instance: *mut ModelInstance, state: *mut *mut c_void) -> Err;
    TRITONBACKEND_ModelInstanceSetState(instance: *mut ModelInstance, state: *mut c_void) -> Err;
    TRITONBACKEND_ModelInstanceReportStatistics(
        instance: *mut ModelInstance,
        request: *mut Request,
        success: bool,
        exec_start_ns: u64,
        compute_start_ns: u64,
        compute_end_ns: u64,
        exec_end_ns: u64,
    ) -> Err;
    TRITONBACKEND_ModelInstanceReportBatchStatistics(
        instance: *mut ModelInstance,
        batch_size: u64,
        exec_start_ns: u64,
        compute_start_ns: u64,
        compute_end_ns: u64,
        exec_end_ns: u64,
    ) -> Err;

    TRITONBACKEND_RequestId(request: *mut Request, id: *mut *const c_char) -> Err;
    TRITONBACKEND_RequestInputCount(request: *mut Request, count: *mut u32) -> Err;
    TRITONBACKEND_RequestInputByIndex(request: *mut Request, index: u32, input: *mut *mut Input) -> Err;
    TRITONBACKEND_RequestOutputCount(request: *mut Request, count: *mut u32) -> Err;
    TRITONBACKEND_RequestOutputName(request: *mut Request, index: u32, name: *mut *const c_char) -> Err;
    TRITONBACKEND_RequestRelease(request: *mut Request, release_flags: u32) -> Err;

    TRITONBACKEND_InputProperties(
        input: *mut Input,
        name: *mut *const c_char,
        datatype: *mut u32,
        shape: *mut *const i64,
        dims_count: *mut u32,
        byte_size: *mut u64,
        buffer_count: *mut u32,
    ) -> Err;
    TRITONBACKEND_InputBuffer(
        input: *mut Input,
        index: u32,
        buffer: *mut *const c_void,
        buffer_byte_size: *mut u64,
        memory_type: *mut u32,
        memory_type_id: *mut i64,
    ) -> Err;

    TRITONBACKEND_ResponseNew(response: *mut *mut Response, request: *mut Request) -> Err;
    TRITONBACKEND_ResponseDelete(response: *mut Response) -> Err;
    TRITONBACKEND_ResponseOutput(
        response: *mut Response,
        output: *mut *mut Output,
        name: *const c_char,
        datatype: u32,
        shape: *const i64,
        dims_count: u32,
    ) -> Err;
    TRITONBACKEND_ResponseSend(response: *mut Response, send_flags: u32, error: Err) -> Err;
    TRITONBACKEND_OutputBuffer(
        output: *mut Output,
        buffer: *mut *mut c_void,
        buffer_byte_size: u64,
        memory_type: *mut u32,
        memory_type_id: *mut i64,
    ) -> Err;
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

/// Triton's functions, looked up once per process; the error names the first that is missing.
pub fn api() -> Result<&'static Api, String> {
    API.get_or_init(Api::resolve).as_ref().map_err(Clone::clone)
}
