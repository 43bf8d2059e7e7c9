//! One error type for the whole crate, grouped by the stage that raises it.
//! Every variant names what the user controls: the weight key, the module path, the file.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // ---- weights -------------------------------------------------------------------------
    #[error("weight `{key}` is missing from {source_name}")]
    MissingWeight { key: String, source_name: String },

    #[error("weight `{key}` has shape {got:?}, but the model expects {expected:?} (in {source_name})")]
    WeightShape { key: String, expected: Vec<usize>, got: Vec<usize>, source_name: String },

    #[error("weight `{key}` has dtype {got}, which Kiln cannot load: expected f32, f16 or bf16 (in {source_name})")]
    WeightDtype { key: String, got: String, source_name: String },

    #[error("{count} weight(s) in {source_name} were never used by the model: {keys:?}")]
    UnusedWeights { count: usize, keys: Vec<String>, source_name: String },

    #[error("cannot read safetensors file {path}: {reason}")]
    Safetensors { path: PathBuf, reason: String },

    #[error("cannot read weights file {path}: {reason}")]
    WeightsFile { path: PathBuf, reason: String },

    #[error("cannot read PyTorch checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },

    #[error("PyTorch checkpoint {path}: its pickle passes the limit of {limit} {bound} at byte {offset}; a state_dict saved by torch.save stays far below it (corrupt or hostile file)")]
    PickleLimit { path: PathBuf, offset: usize, bound: &'static str, limit: usize },

    #[error("PyTorch checkpoint {path} names `{global}`, which Kiln does not load: its unpickler runs no code and knows only what a state_dict's tensors need; save `model.state_dict()` alone")]
    CheckpointGlobal { path: PathBuf, global: String },

    #[error("cannot read image {path}: {reason}")]
    Image { path: PathBuf, reason: String },

    // ---- tracing -------------------------------------------------------------------------
    #[error("shape mismatch in `{path}` ({op}): {reason}; got input shapes {got:?}")]
    Shape { path: String, op: String, reason: OpError, got: Vec<Vec<usize>> },

    #[error("tensors from different traces were combined in `{path}`")]
    MixedTraces { path: String },

    #[error("op `{op}` at `{path}` has no tensor input")]
    NoTensorInput { op: String, path: String },

    #[error("op `{op}` needs attribute `{key}`")]
    Attribute { op: String, key: String },

    #[error("codegen: {reason}")]
    Codegen { reason: String },

    #[error("calibration ({path}): {reason}")]
    Calibration { path: String, reason: String },

    #[error("{}", unknown_model_text(name, suggestion.as_deref(), known))]
    UnknownModel { name: String, suggestion: Option<String>, known: String },

    // ---- compiling and running -----------------------------------------------------------
    #[error("no {backend} converter for op `{op}` (at `{path}`); register one with `kiln::register_converter!`")]
    NoConverter { backend: &'static str, op: String, path: String },

    #[error("converter for op `{op}` is registered twice")]
    DuplicateConverter { op: String },

    #[error("input `{name}`: {reason}")]
    Binding { name: String, reason: String },

    #[error("output `{name}`: {model} has no such output to read (its outputs: {outputs:?}){hint}")]
    NoSuchOutput { name: String, model: String, outputs: Vec<String>, hint: String },

    #[error("input `{name}` is declared u8, but its element {index:?} is {value}, not an integer in 0..=255")]
    NotAByte { name: String, index: Vec<usize>, value: f32 },

    #[error("cannot lower `{path}` ({op}): {reason}")]
    Lower { path: String, op: String, kind: LowerKind, reason: String },

    #[error("invalid build configuration: {reason}")]
    Config { reason: String },

    #[error("cannot serialise {what}: {reason}")]
    Serialize { what: String, reason: String },

    #[error("`{path}`: the {what} cache was poisoned by a panic on another thread")]
    Poisoned { path: String, what: String },

    #[error("engine file {path}: {reason}")]
    EngineFile { path: String, reason: String },

    #[error("graph file {path}: {reason}")]
    GraphFile { path: String, reason: String },

    #[error("no GPU available: {0}")]
    NoGpu(String),

    #[error("CUDA error in {context}: {reason}")]
    Cuda { context: String, reason: String },

    #[error("kernel `{name}` failed to compile:\n{log}")]
    KernelCompile { name: String, log: String },

    #[error("I/O error on {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },

    // ---- untrusted input: sizes, files, flags --------------------------------------------
    #[error("out of memory: {what} needs {bytes} bytes, which could not be allocated")]
    OutOfMemory { what: String, bytes: usize },

    #[error("{what} is too large: {reason}")]
    TooLarge { what: String, reason: String },

    #[error("tensor `{key}` appears twice: in {first} and in {second}; a state_dict key must be unique")]
    DuplicateTensor { key: String, first: String, second: String },

    #[error("weight `{key}` holds {count} non-finite value(s) (NaN or infinity) (in {source_name})")]
    NonFinite { key: String, count: usize, source_name: String },

    #[error("{what} tensor `{key}` has dtype {got}, which Kiln cannot read: expected f32, f16 or bf16 (in {path})")]
    TensorDtype { what: String, key: String, got: String, path: PathBuf },

    #[error("invalid graph: node %{node} (`{path}`): {reason}")]
    InvalidGraph { node: usize, path: String, reason: String },

    #[error("{flag} {reason}")]
    Flag { flag: String, reason: String },

    #[error("weight `{key}` is missing from {source_name}, but `{prefix}{key}` is there: the keys start with `{prefix}`, as saved from DataParallel; strip the prefix (`{{k.removeprefix(\"{prefix}\"): v for k, v in state_dict.items()}}`) or save `model.module.state_dict()`")]
    MissingWeightPrefixed { key: String, prefix: String, source_name: String },

    #[error("a tensor of shape {shape:?} holds {expected} values, but {got} were given")]
    TensorSize { shape: Vec<usize>, expected: String, got: usize },
}

/// Why an op refuses its inputs or attributes: the answer of its shape rule or CPU reference,
/// which the caller wraps with the node's path and op name (`Error::Shape`).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum OpError {
    /// The op takes another number of inputs.
    #[error("expected {expected} input(s), got {got}")]
    Arity { expected: String, got: usize },
    /// An attribute is outside what the op accepts (a zero stride, an unknown mode, a dim out of
    /// range).
    #[error("{0}")]
    Attribute(String),
    /// The input shapes do not fit the op's rule.
    #[error("{0}")]
    Shape(String),
    /// A size overflows what the op can hold.
    #[error("{0}")]
    TooLarge(String),
}

impl From<String> for OpError {
    fn from(reason: String) -> Self {
        OpError::Shape(reason)
    }
}

impl From<&str> for OpError {
    fn from(reason: &str) -> Self {
        OpError::Shape(reason.to_string())
    }
}

/// Why a node could not be lowered to engine layers: what a caller matches on to act (run the
/// node on the CPU, raise the workspace, try another device) while `reason` says it in words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LowerKind {
    /// The GPU engine has no kernel for this op with these attributes or operand layouts (the CPU
    /// executor may run it).
    Unsupported,
    /// A size exceeds what the kernels index (32-bit grids, 64-bit byte counts).
    TooLarge,
    /// The node's weights do not fit its op (shape, count, quantisation grid or scales).
    Weights,
    /// No algorithm or tactic runs the layer on this device, or a forced or recorded one is not
    /// available here.
    NoAlgorithm,
    /// The layer needs more workspace than the build allows.
    Workspace,
    /// The operands disagree in shape, element type or layout with what the layer was planned for.
    Operands,
}

/// `UnknownModel`'s message: the closest known name when one is near (a typo), else every name.
fn unknown_model_text(name: &str, suggestion: Option<&str>, known: &str) -> String {
    match suggestion {
        Some(s) => format!("unknown model `{name}`; did you mean `{s}`? (`kiln models` lists every model)"),
        None => format!("unknown model `{name}`; the bundled models are: {known}"),
    }
}

impl Error {
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
    }
}

impl Error {
    /// Says what an out-of-memory error was allocating (`what`); other errors pass unchanged.
    pub fn out_of_memory_in(self, what: impl FnOnce() -> String) -> Error {
        match self {
            Error::OutOfMemory { bytes, .. } => Error::OutOfMemory { what: what(), bytes },
            other => other,
        }
    }
}
