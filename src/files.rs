//! Files in and out: PyTorch's and safetensors' weights read into [`HostTensor`](crate::HostTensor)s,
//! Kiln's graph files and engine files, and user paths opened safely.
//!
//! Every reader here bounds what it allocates by the file's size and checks sizes from headers with
//! checked arithmetic; a bad file is an [`Error`](crate::Error) naming the file and the key.
//! - safetensors: [`read_safetensors`] (a `state_dict`, or a reference file of expected outputs),
//!   [`write_safetensors`], and the metadata and byte-level forms;
//! - PyTorch checkpoints (`torch.save`, zip or legacy): [`read_pth`], read without running any code;
//! - [`graph`]: graph files (`kiln trace`, [`Graph::save`](crate::Graph::save)), a safetensors file
//!   whose metadata holds the graph;
//! - [`engine`]: engine files (`kiln build`, `Engine::save`): header, checksum, payload;
//! - [`kind`]: which of these a file is, by its content.

/// The timing cache (`BuildConfig::timing_cache`): tactic choices recorded per layer and problem.
pub use crate::engine::choices::Tactics;
pub use crate::graph_file::{kind, FileKind};
pub use crate::host::{map_regular, open_regular, read_regular};
pub use crate::pth::{decode_pth, looks_like_checkpoint, read_pth, Checkpoint};
pub use crate::var_builder::{
    decode_safetensors, encode_safetensors, read_metadata, read_safetensors, read_tensors, read_tensors_limited, read_tensors_within,
    write_safetensors, write_safetensors_with_metadata,
};

/// Graph files: a safetensors file of the graph's weights whose metadata holds the graph itself
/// (JSON under `KEY_GRAPH`), its format name and version.
pub mod graph {
    pub use crate::graph_file::{
        decode, encode, has_random_weights, is_graph_metadata, read, write, GraphFile, EXTENSION, FORMAT, KEY_FORMAT, KEY_GRAPH,
        KEY_RANDOM_WEIGHTS, KEY_VERSION, MAX_NODES, VERSION,
    };
}

/// Engine files: a fixed header (magic, format version, GPU architecture, CUDA and cuDNN versions,
/// payload length and checksum), then the payload (optimised graph, folded weights, recorded
/// tactics, build config). Reading and checking them needs no GPU.
pub mod engine {
    pub use crate::engine::file::{
        check_device, decode, decode_header, decode_payload, encode, read, validate, Header, Payload, FORMAT_VERSION, MAGIC, MAX_BATCH,
    };
    pub use crate::hash::checksum;
}
