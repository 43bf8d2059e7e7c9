//! Kiln's backend for NVIDIA's Triton Inference Server, `libtriton_kiln.so`, and the writer of
//! ready model repositories ([`write_repository`], behind `kiln triton-repo`).
//!
//! ```text
//! repo/<model>/config.pbtxt               backend: "kiln", inputs/outputs named as in the graph
//! repo/<model>/1/model.kiln               a Kiln engine file (kiln build), or
//! repo/<model>/1/model.kiln.safetensors   a graph file (kiln trace): KIND_GPU instances build an
//!                                         engine on first load and cache it beside it
//! <backend-directory>/kiln/libtriton_kiln.so
//! ```
//! `KIND_CPU` instances run Kiln's CPU executor; `KIND_GPU` instances an execution context of the
//! engine on the instance's GPU. Triton's scheduler (the dynamic batcher) hands an instance
//! several requests at once; they run as one batch. Each request that is wrong gets its own
//! error response; no panic crosses into Triton.

#![warn(clippy::undocumented_unsafe_blocks)]

pub mod bundled;
pub mod config;
mod copy;
pub mod error;
mod execute;
pub mod ffi;
mod gather;
mod kiln_api;
pub mod model;
pub mod repository;
pub mod request;
mod runner;
mod triton;

#[cfg(test)]
mod tests;

pub use bundled::bundled_source;
pub use error::{BackendError, Result};
pub use repository::{write_repository, InstanceKind, ModelSource, RepositoryOptions, WrittenRepository};

use error::catch;
use execute::InstanceState;
use ffi::{Api, ServerError};
use model::LoadedModel;
use runner::{CpuRunner, GpuRunner, Runner};
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Arc;
use triton::{check, cstr, log, new_error, take_json};

/// Runs one entry point's body with Triton's API, turning errors and panics into a Triton error.
fn entry(during: &str, f: impl FnOnce(&Api) -> Result<()>) -> *mut ServerError {
    let api = match ffi::api() {
        Ok(api) => api,
        Err(reason) => {
            // Without the API there is no way to make a Triton error: this is not a Triton process.
            eprintln!("kiln backend: {during}: {reason}");
            return std::ptr::null_mut();
        }
    };
    match catch(during, || f(api)) {
        Ok(()) => std::ptr::null_mut(),
        Err(e) => {
            log(api, ffi::log_level::ERROR, &format!("kiln backend: {during}: {e}"));
            new_error(api, e.code(), &e.to_string())
        }
    }
}

/// Checks that the server's backend API is one this backend was written for.
///
/// # Safety
/// Called by Triton with a live backend.
#[no_mangle]
pub unsafe extern "C" fn TRITONBACKEND_Initialize(_backend: *mut ffi::Backend) -> *mut ServerError {
    entry("TRITONBACKEND_Initialize", |api| {
        let (mut major, mut minor) = (0u32, 0u32);
        // SAFETY: both out-pointers outlive the call.
        check(api, "TRITONBACKEND_ApiVersion", unsafe { (api.TRITONBACKEND_ApiVersion)(&mut major, &mut minor) })?;
        if major != ffi::API_MAJOR || minor < ffi::API_MINOR {
            return Err(BackendError::Unsupported {
                what: format!("Triton's backend API {major}.{minor}"),
                reason: format!("the Kiln backend needs {}.{} or a later 1.x (Triton 2.51 has 1.19)", ffi::API_MAJOR, ffi::API_MINOR),
            });
        }
        log(
            api,
            ffi::log_level::INFO,
            &format!(
                "kiln backend {} initialised (backend API {major}.{minor}, built for {}.{})",
                env!("CARGO_PKG_VERSION"),
                ffi::API_MAJOR,
                ffi::API_MINOR
            ),
        );
        Ok(())
    })
}

/// Reads the model's config and file, checks them against each other, and keeps the result as
/// the model's state.
///
/// # Safety
/// Called by Triton with a live model.
#[no_mangle]
pub unsafe extern "C" fn TRITONBACKEND_ModelInitialize(model: *mut ffi::Model) -> *mut ServerError {
    entry("TRITONBACKEND_ModelInitialize", |api| {
        // SAFETY: `model` is live for the call (Triton's contract).
        let loaded = unsafe { load_model(api, model) }?;
        let describe = |b: &[config::Binding]| {
            b.iter().map(|b| format!("{} {:?} {}", b.name, b.config_dims(), b.elem.wire_name())).collect::<Vec<_>>().join(", ")
        };
        log(
            api,
            ffi::log_level::INFO,
            &format!(
                "kiln backend: model `{}` serves {} (max_batch_size {}; inputs {}; outputs {})",
                loaded.name,
                loaded.file.display(),
                loaded.max_batch(),
                describe(&loaded.spec.inputs),
                describe(&loaded.spec.outputs)
            ),
        );
        let state = Box::into_raw(Box::new(Arc::new(loaded)));
        // SAFETY: `model` is live; the state is ours until ModelFinalize takes it back.
        let set = check(api, "TRITONBACKEND_ModelSetState", unsafe { (api.TRITONBACKEND_ModelSetState)(model, state.cast()) });
        if set.is_err() {
            // SAFETY: Triton did not take the pointer; it is still the box made above.
            drop(unsafe { Box::from_raw(state) });
        }
        set
    })
}

/// # Safety
/// `model` is live.
unsafe fn load_model(api: &Api, model: *mut ffi::Model) -> Result<LoadedModel> {
    let (mut name, mut version, mut artifact, mut location) = (std::ptr::null(), 0u64, 0u32, std::ptr::null());
    // SAFETY: `model` is live; the out-pointers outlive the calls; the strings live as long as the model.
    let (name, location) = unsafe {
        check(api, "TRITONBACKEND_ModelName", (api.TRITONBACKEND_ModelName)(model, &mut name))?;
        check(api, "TRITONBACKEND_ModelVersion", (api.TRITONBACKEND_ModelVersion)(model, &mut version))?;
        check(api, "TRITONBACKEND_ModelRepository", (api.TRITONBACKEND_ModelRepository)(model, &mut artifact, &mut location))?;
        (cstr(name), cstr(location))
    };
    if artifact != ffi::ARTIFACT_FILESYSTEM {
        return Err(BackendError::Unsupported {
            what: format!("model `{name}`'s artifact type {artifact}"),
            reason: "the Kiln backend reads models from a file system".into(),
        });
    }
    let mut message = std::ptr::null_mut();
    // SAFETY: `model` is live; we own the returned message and `take_json` deletes it.
    let json = unsafe {
        check(api, "TRITONBACKEND_ModelConfig", (api.TRITONBACKEND_ModelConfig)(model, 1, &mut message))?;
        take_json(api, message)?
    };
    log(api, ffi::log_level::VERBOSE, &format!("kiln backend: model `{name}` config: {json}"));
    let mut config = config::ModelConfig::from_json(&json).map_err(|e| match e {
        BackendError::Config { field, reason, .. } => BackendError::Config { model: name.clone(), field, reason },
        other => other,
    })?;
    if config.name.is_empty() {
        config.name = name;
    }
    let version_dir = PathBuf::from(location).join(version.to_string());
    LoadedModel::load(config, &version_dir)
}

/// # Safety
/// Called by Triton with a live model whose instances are finalised.
#[no_mangle]
pub unsafe extern "C" fn TRITONBACKEND_ModelFinalize(model: *mut ffi::Model) -> *mut ServerError {
    entry("TRITONBACKEND_ModelFinalize", |api| {
        let mut state: *mut c_void = std::ptr::null_mut();
        // SAFETY: `model` is live; `state` outlives the call.
        check(api, "TRITONBACKEND_ModelState", unsafe { (api.TRITONBACKEND_ModelState)(model, &mut state) })?;
        if !state.is_null() {
            // SAFETY: the state is the box ModelInitialize made, and Triton finalises a model once.
            drop(unsafe { Box::from_raw(state.cast::<Arc<LoadedModel>>()) });
        }
        Ok(())
    })
}

/// Makes the instance's runner: the CPU executor, or an execution context on its GPU (building
/// or loading the engine first).
///
/// # Safety
/// Called by Triton with a live instance of a model this backend initialised.
#[no_mangle]
pub unsafe extern "C" fn TRITONBACKEND_ModelInstanceInitialize(instance: *mut ffi::ModelInstance) -> *mut ServerError {
    entry("TRITONBACKEND_ModelInstanceInitialize", |api| {
        let (mut name, mut kind, mut device, mut model, mut state) =
            (std::ptr::null(), 0u32, 0i32, std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: `instance` is live; the out-pointers outlive the calls; the model state is the
        // `Arc<LoadedModel>` box of ModelInitialize, alive until ModelFinalize (after this instance's).
        let (name, loaded) = unsafe {
            check(api, "TRITONBACKEND_ModelInstanceName", (api.TRITONBACKEND_ModelInstanceName)(instance, &mut name))?;
            check(api, "TRITONBACKEND_ModelInstanceKind", (api.TRITONBACKEND_ModelInstanceKind)(instance, &mut kind))?;
            check(api, "TRITONBACKEND_ModelInstanceDeviceId", (api.TRITONBACKEND_ModelInstanceDeviceId)(instance, &mut device))?;
            check(api, "TRITONBACKEND_ModelInstanceModel", (api.TRITONBACKEND_ModelInstanceModel)(instance, &mut model))?;
            check(api, "TRITONBACKEND_ModelState", (api.TRITONBACKEND_ModelState)(model, &mut state))?;
            if state.is_null() {
                return Err(BackendError::Unsupported {
                    what: "an instance of an uninitialised model".into(),
                    reason: "the model has no state".into(),
                });
            }
            (cstr(name), (*state.cast::<Arc<LoadedModel>>()).clone())
        };
        let runner: Box<dyn Runner> = match kind {
            ffi::kind::CPU => Box::new(CpuRunner::new()),
            ffi::kind::GPU => {
                let ordinal = usize::try_from(device)
                    .map_err(|_| BackendError::Unsupported { what: format!("GPU id {device}"), reason: "not a device ordinal".into() })?;
                let say = |m: &str| log(api, ffi::log_level::INFO, &format!("kiln backend: {m}"));
                let engine = loaded.engine(ordinal, &say)?;
                let runner = GpuRunner::new(engine, ordinal)?;
                if !runner.peers().is_empty() {
                    say(&format!(
                        "instance `{name}` on GPU {device} copies requests held on GPU(s) {:?} directly (peer access)",
                        runner.peers()
                    ));
                }
                Box::new(runner)
            }
            other => {
                let kind = match other {
                    ffi::kind::AUTO => "KIND_AUTO",
                    ffi::kind::MODEL => "KIND_MODEL",
                    _ => "an unknown kind",
                };
                return Err(BackendError::Unsupported {
                    what: format!("instance `{name}` of {kind}"),
                    reason: "use KIND_CPU or KIND_GPU".into(),
                });
            }
        };
        let where_ = if kind == ffi::kind::GPU { format!("GPU {device}") } else { "the CPU executor".into() };
        log(api, ffi::log_level::INFO, &format!("kiln backend: instance `{name}` of model `{}` runs on {where_}", loaded.name));
        let state = Box::into_raw(Box::new(InstanceState { model: loaded, name, runner }));
        // SAFETY: `instance` is live; the state is ours until ModelInstanceFinalize takes it back.
        let set =
            check(api, "TRITONBACKEND_ModelInstanceSetState", unsafe { (api.TRITONBACKEND_ModelInstanceSetState)(instance, state.cast()) });
        if set.is_err() {
            // SAFETY: Triton did not take the pointer; it is still the box made above.
            drop(unsafe { Box::from_raw(state) });
        }
        set
    })
}

/// # Safety
/// Called by Triton with a live instance, once.
#[no_mangle]
pub unsafe extern "C" fn TRITONBACKEND_ModelInstanceFinalize(instance: *mut ffi::ModelInstance) -> *mut ServerError {
    entry("TRITONBACKEND_ModelInstanceFinalize", |api| {
        let mut state: *mut c_void = std::ptr::null_mut();
        // SAFETY: `instance` is live; `state` outlives the call.
        check(api, "TRITONBACKEND_ModelInstanceState", unsafe { (api.TRITONBACKEND_ModelInstanceState)(instance, &mut state) })?;
        if !state.is_null() {
            // SAFETY: the state is the box ModelInstanceInitialize made; Triton finalises once.
            drop(unsafe { Box::from_raw(state.cast::<InstanceState>()) });
        }
        Ok(())
    })
}

/// Runs a batch of requests. Once the instance's state is found, the backend owns every request
/// and answers each (see `execute::execute`); only before that does an error return them to Triton.
///
/// # Safety
/// Called by Triton with a live instance and `request_count` live requests, never twice at once
/// for one instance.
#[no_mangle]
pub unsafe extern "C" fn TRITONBACKEND_ModelInstanceExecute(
    instance: *mut ffi::ModelInstance,
    requests: *mut *mut ffi::Request,
    request_count: u32,
) -> *mut ServerError {
    let api = match ffi::api() {
        Ok(api) => api,
        Err(reason) => {
            eprintln!("kiln backend: TRITONBACKEND_ModelInstanceExecute: {reason}");
            return std::ptr::null_mut();
        }
    };
    let mut state: *mut c_void = std::ptr::null_mut();
    // SAFETY: `instance` is live; `state` outlives the call.
    if let Err(e) = check(api, "TRITONBACKEND_ModelInstanceState", unsafe { (api.TRITONBACKEND_ModelInstanceState)(instance, &mut state) })
    {
        return new_error(api, e.code(), &e.to_string());
    }
    if state.is_null() || (requests.is_null() && request_count > 0) {
        return new_error(api, ffi::code::INTERNAL, "kiln backend: execute on an instance without state");
    }
    let requests: Vec<*mut ffi::Request> = if request_count == 0 {
        Vec::new()
    } else {
        // SAFETY: Triton passes `request_count` request pointers, valid for this call; we copy them out.
        unsafe { std::slice::from_raw_parts(requests, request_count as usize) }.to_vec()
    };
    // SAFETY: the state is the InstanceState box of ModelInstanceInitialize; Triton never runs one
    // instance's execute twice at once, so this is the only reference.
    let state = unsafe { &mut *state.cast::<InstanceState>() };
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the requests are live and now ours; `instance` is theirs.
        unsafe { execute::execute(api, instance, state, &requests) }
    }));
    if ran.is_err() {
        // Every fallible step inside catches its own panics; this is the last guard, and the
        // requests are ours by now, so they must not go back to Triton.
        log(api, ffi::log_level::ERROR, "kiln backend: a panic escaped execute; some requests may not have been answered");
    }
    std::ptr::null_mut()
}
