//! The backend's errors. Each becomes a Triton error with a code: a request's error goes back in
//! its response (the server and its other models stay up), a load error fails that model's load.

use crate::ffi::code;
use crate::kiln_api::KilnError;
use std::path::PathBuf;

pub type Result<T, E = BackendError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The model's config.pbtxt disagrees with the model file, or asks for what Kiln cannot do.
    #[error("model `{model}`: config.pbtxt {field}: {reason}")]
    Config { model: String, field: String, reason: String },

    /// No model file, two candidates, or an unreadable one.
    #[error("model `{model}`: {reason} (in {dir})")]
    ModelFile { model: String, dir: PathBuf, reason: String },

    /// A request's input is missing, unknown, of the wrong type, shape or size.
    #[error("input `{name}`: {reason}")]
    Input { name: String, reason: String },

    /// A request asks for an output the model does not have.
    #[error("output `{name}`: {reason}")]
    Output { name: String, reason: String },

    /// The request as a whole (batch size, inputs that disagree).
    #[error("request: {reason}")]
    Request { reason: String },

    /// An instance kind or memory placement this backend does not serve.
    #[error("{what} is not supported: {reason}")]
    Unsupported { what: String, reason: String },

    /// A Triton API call failed.
    #[error("Triton {call} failed: {message}")]
    Triton { call: &'static str, code: u32, message: String },

    /// A CUDA driver call of the backend's own copies failed.
    #[error("CUDA {call} failed: {reason}")]
    Cuda { call: &'static str, reason: String },

    /// Kiln refused or failed (building, loading, running).
    #[error("{context}: {source}")]
    Kiln {
        context: String,
        #[source]
        source: Box<KilnError>,
    },

    /// A panic, caught before it could cross into Triton.
    #[error("internal error (a panic in the Kiln backend, caught) in {during}: {message}")]
    Panic { during: String, message: String },
}

impl BackendError {
    /// A Kiln error with what the backend was doing.
    pub fn kiln(context: impl Into<String>) -> impl FnOnce(KilnError) -> BackendError {
        let context = context.into();
        move |source| BackendError::Kiln { context, source: Box::new(source) }
    }

    /// The Triton error code: the caller's mistakes are INVALID_ARG, a missing file NOT_FOUND,
    /// what Kiln cannot do UNSUPPORTED, everything else INTERNAL.
    pub fn code(&self) -> u32 {
        match self {
            BackendError::Input { .. } | BackendError::Output { .. } | BackendError::Request { .. } | BackendError::Config { .. } => {
                code::INVALID_ARG
            }
            BackendError::ModelFile { .. } => code::NOT_FOUND,
            BackendError::Unsupported { .. } => code::UNSUPPORTED,
            BackendError::Triton { code, .. } => *code,
            BackendError::Kiln { source, .. } => match source.as_ref() {
                KilnError::Binding { .. } | KilnError::NotAByte { .. } | KilnError::TensorSize { .. } => code::INVALID_ARG,
                KilnError::NoGpu(_) => code::UNAVAILABLE,
                _ => code::INTERNAL,
            },
            BackendError::Cuda { .. } | BackendError::Panic { .. } => code::INTERNAL,
        }
    }

    /// A caught panic's payload as text.
    pub fn from_panic(during: impl Into<String>, payload: Box<dyn std::any::Any + Send>) -> Self {
        let message = match payload.downcast::<String>() {
            Ok(s) => *s,
            Err(p) => p.downcast::<&str>().map_or_else(|_| "(no message)".to_string(), |s| s.to_string()),
        };
        BackendError::Panic { during: during.into(), message }
    }
}

/// An error as it goes back to Triton: its code and message (one batch's failure answers each
/// of its requests, so it is cloned).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub code: u32,
    pub message: String,
}

impl From<&BackendError> for Failure {
    fn from(e: &BackendError) -> Self {
        Failure { code: e.code(), message: e.to_string() }
    }
}

/// Runs `f`, turning a panic into [`BackendError::Panic`] so that none unwinds into Triton.
pub fn catch<T>(during: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| Err(BackendError::from_panic(during, p)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_internal_error_with_its_message() {
        let e = catch::<()>("execute", || panic!("boom {}", 7)).unwrap_err();
        assert_eq!(e.code(), code::INTERNAL);
        assert_eq!(e.to_string(), "internal error (a panic in the Kiln backend, caught) in execute: boom 7");
        let e = catch::<()>("load", || panic!("static")).unwrap_err();
        assert!(e.to_string().ends_with("load: static"), "{e}");
    }

    #[test]
    fn callers_mistakes_are_invalid_arguments() {
        let e = BackendError::Input { name: "input".into(), reason: "FP64, expected FP32".into() };
        assert_eq!(e.code(), code::INVALID_ARG);
        let e = BackendError::kiln("running")(KilnError::Binding { name: "input".into(), reason: "outside".into() });
        assert_eq!(e.code(), code::INVALID_ARG);
        let e = BackendError::kiln("building")(KilnError::Config { reason: "x".into() });
        assert_eq!(e.code(), code::INTERNAL);
    }
}
