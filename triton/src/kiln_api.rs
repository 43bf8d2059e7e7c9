//! Every name this crate takes from Kiln, in one place: when Kiln's public modules move, only
//! these paths change. The rest of the crate says `crate::kiln_api::…`.

pub use kiln::cpu;
pub use kiln::engine::file::{checksum, decode as decode_engine_file};
pub use kiln::engine::{BuildConfig, DimsRange, Engine, EngineBuilder, ExecutionContext, Gpu, InputDims, Precision, ShapeProfile};
pub use kiln::graph_file::{self, EXTENSION as GRAPH_FILE_EXTENSION};
pub use kiln::passes::optimize;
pub use kiln::{ByteTensor, DType, Error as KilnError, Graph, HostInput, HostTensor, Result as KilnResult};

#[cfg(test)]
pub use kiln::engine::file::{encode as encode_engine_file, Header, Payload, FORMAT_VERSION};
#[cfg(test)]
pub use kiln::Tracer;
