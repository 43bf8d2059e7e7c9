//! Engine files: a fixed header, then a checksummed payload (optimised graph, folded weights,
//! recorded tactics, build config). Loading checks the header against the device, verifies the
//! checksum, and lowers the graph again with the recorded tactics: no passes, no timing.
//!
//! ```text
//! offset  size  field
//!      0     8  magic "KILNENG\0"
//!      8     4  format version (u32 LE)
//!     12     4  GPU architecture, major*10+minor (90 = sm_90)
//!     16     4  CUDA driver version (13000 = 13.0)
//!     20     4  cuDNN version (91400 = 9.14)
//!     24     8  payload length in bytes
//!     32     8  FNV-1a 64 checksum of the payload
//!     40     …  payload: u64 metadata length, metadata JSON, weights as f32 LE in metadata order
//! ```
//! Header and payload logic is pure (no GPU), so it is tested everywhere.

use super::builder::{cache_prefix, lower, Engine};
use super::choices::Tactics;
use super::gpu::{Gpu, GpuInfo};
use super::BuildConfig;
use crate::graph::{Graph, HostTensor};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

pub const MAGIC: [u8; 8] = *b"KILNENG\0";
/// 2: ops grouped by family (`Op::Conv`, `Op::Unary`, ...), per-value layouts.
/// 3: a conv may carry a fused max-pool (`ConvAttrs::pool`), which version-2 readers would drop.
/// 4: a weight may carry its 8-bit grid (`Op::Weight::quant`), which 8-bit convs read their codes
///    and scales from; version-3 readers would drop it.
pub const FORMAT_VERSION: u32 = 4;
const HEADER_LEN: usize = 40;

/// The device facts a file was built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    pub sm: u32,
    pub driver_version: u32,
    pub cudnn_version: u32,
}

impl Header {
    pub fn for_gpu(info: &GpuInfo) -> Self {
        Self { version: FORMAT_VERSION, sm: info.sm, driver_version: info.driver_version, cudnn_version: info.cudnn_version }
    }
}

/// Everything an engine is rebuilt from.
#[derive(Debug)]
pub struct Payload {
    pub config: BuildConfig,
    pub graph: Graph,
    pub tactics: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize)]
struct Meta {
    config: BuildConfig,
    graph: Graph,
    tactics: BTreeMap<String, String>,
    /// Weight names and shapes, in the order of the f32 data after the metadata.
    weights: Vec<(String, Vec<usize>)>,
}

pub use crate::hash::checksum;

/// Serialises an engine's payload behind a header.
pub fn encode(header: &Header, payload: &Payload) -> Result<Vec<u8>> {
    let weights: Vec<(String, Vec<usize>)> = payload.graph.weights.iter().map(|(n, t)| (n.clone(), t.shape.clone())).collect();
    let meta = Meta { config: payload.config.clone(), graph: payload.graph.clone(), tactics: payload.tactics.clone(), weights };
    let json = serde_json::to_vec(&meta).map_err(|e| Error::Serialize { what: "the engine".into(), reason: e.to_string() })?;
    let data_len: usize = payload.graph.weights.values().map(|t| t.data.len() * 4).sum();
    let mut body = Vec::with_capacity(8 + json.len() + data_len);
    body.extend((json.len() as u64).to_le_bytes());
    body.extend(&json);
    for t in payload.graph.weights.values() {
        for v in &t.data {
            body.extend(v.to_le_bytes());
        }
    }
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend(MAGIC);
    for v in [header.version, header.sm, header.driver_version, header.cudnn_version] {
        out.extend(v.to_le_bytes());
    }
    out.extend((body.len() as u64).to_le_bytes());
    out.extend(checksum(&body).to_le_bytes());
    out.extend(body);
    Ok(out)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Reads the header; `path` is only for errors.
pub fn decode_header(bytes: &[u8], path: &str) -> Result<Header> {
    let err = |reason: String| Error::EngineFile { path: path.to_string(), reason };
    if bytes.len() < HEADER_LEN {
        return Err(err(format!("truncated: {} bytes, shorter than the {HEADER_LEN}-byte header", bytes.len())));
    }
    if bytes[..8] != MAGIC {
        return Err(err(format!("not a Kiln engine (magic {:?}, expected {:?})", String::from_utf8_lossy(&bytes[..8]), "KILNENG")));
    }
    let header =
        Header { version: u32_at(bytes, 8), sm: u32_at(bytes, 12), driver_version: u32_at(bytes, 16), cudnn_version: u32_at(bytes, 20) };
    if header.version != FORMAT_VERSION {
        return Err(err(format!(
            "format version {} is not supported (this Kiln reads version {FORMAT_VERSION}); rebuild the engine",
            header.version
        )));
    }
    Ok(header)
}

/// Checks that a file built for `header` may run on `device`: same architecture and cuDNN (the
/// recorded algorithms are cuDNN's). A different driver is accepted (drivers are compatible).
pub fn check_device(header: &Header, device: &GpuInfo, path: &str) -> Result<()> {
    let err = |reason: String| Error::EngineFile { path: path.to_string(), reason };
    if header.sm != device.sm {
        return Err(err(format!(
            "built for sm_{}, but this GPU ({}) is sm_{}; rebuild the engine on this GPU",
            header.sm, device.name, device.sm
        )));
    }
    if header.cudnn_version != device.cudnn_version {
        return Err(err(format!(
            "built with cuDNN {}, but cuDNN {} is loaded; rebuild the engine",
            header.cudnn_version, device.cudnn_version
        )));
    }
    Ok(())
}

/// Verifies length and checksum and decodes the payload.
pub fn decode(bytes: &[u8], path: &str) -> Result<(Header, Payload)> {
    let err = |reason: String| Error::EngineFile { path: path.to_string(), reason };
    let header = decode_header(bytes, path)?;
    let len = u64_at(bytes, 24) as usize;
    let body = &bytes[HEADER_LEN..];
    if body.len() != len {
        return Err(err(format!("payload is {} bytes, the header says {len} (truncated or padded file)", body.len())));
    }
    let (want, got) = (u64_at(bytes, 32), checksum(body));
    if want != got {
        return Err(err(format!("checksum mismatch (header {want:016x}, payload {got:016x}): the file is corrupt")));
    }
    Ok((header, decode_payload(body, path)?))
}

/// Decodes a payload whose checksum was verified. Its metadata, the weights' sizes and the graph
/// (against the shapes the metadata declares) are checked before any weight is decoded.
pub fn decode_payload(body: &[u8], path: &str) -> Result<Payload> {
    let err = |reason: String| Error::EngineFile { path: path.to_string(), reason };
    if body.len() < 8 {
        return Err(err("payload has no metadata".into()));
    }
    let meta_len = usize::try_from(u64_at(body, 0)).map_err(|_| err("metadata length does not fit in memory".into()))?;
    let json = 8usize
        .checked_add(meta_len)
        .and_then(|end| body.get(8..end))
        .ok_or_else(|| err(format!("metadata of {meta_len} bytes runs past the end of the file")))?;
    let meta: Meta = serde_json::from_slice(json).map_err(|e| err(format!("metadata: {e}")))?;
    let mut data = &body[8 + meta_len..];
    // Where each weight's bytes lie, checked against the file before anything is decoded.
    let mut stored: BTreeMap<&str, (&[usize], &[u8])> = BTreeMap::new();
    for (name, shape) in &meta.weights {
        let bytes = crate::graph::numel(shape)
            .and_then(|n| n.checked_mul(4))
            .ok_or_else(|| err(format!("weight `{name}` has shape {shape:?}, whose size overflows (corrupt or hostile file)")))?;
        if data.len() < bytes {
            return Err(err(format!(
                "weight `{name}` of shape {shape:?} needs {bytes} bytes, only {} are left: it runs past the end of the file",
                data.len()
            )));
        }
        if stored.insert(name, (shape, &data[..bytes])).is_some() {
            return Err(err(format!("weight `{name}` is stored twice")));
        }
        data = &data[bytes..];
    }
    if !data.is_empty() {
        return Err(err(format!("{} unexpected bytes after the weights", data.len())));
    }
    let mut graph = meta.graph;
    check(&meta.config, &graph, |name| stored.get(name).map(|(shape, bytes)| (*shape, bytes.len() / 4)), path)?;
    for (name, (shape, bytes)) in stored {
        let mut values = Vec::new();
        values
            .try_reserve_exact(bytes.len() / 4)
            .map_err(|_| Error::OutOfMemory { what: format!("weight `{name}` of {path}"), bytes: bytes.len() })?;
        values.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        let tensor = HostTensor::try_new(shape.to_vec(), values).map_err(|e| err(format!("weight `{name}`: {e}")))?;
        graph.weights.insert(name.to_string(), Arc::new(tensor));
    }
    Ok(Payload { config: meta.config, graph, tactics: meta.tactics })
}

/// The largest batch an engine file may declare: far above any real engine, low enough that
/// activation sizes planned for it cannot overflow.
pub const MAX_BATCH: usize = 1 << 20;

/// Checks a decoded payload before anything lowers it: the graph (topological order, shapes
/// re-inferred by each op's rule, inputs, outputs, weights) and the build config. A checksum only
/// proves the file is what was written, not that what was written is sound.
pub fn validate(payload: &Payload, path: &str) -> Result<()> {
    let g = &payload.graph;
    check(&payload.config, g, |name| g.weights.get(name).map(|w| (w.shape.as_slice(), w.data.len())), path)
}

/// `validate` where `stored(name)` gives each weight's shape and element count (the metadata's,
/// before the weights are decoded).
fn check<'w>(config: &BuildConfig, g: &Graph, stored: impl Fn(&str) -> Option<(&'w [usize], usize)>, path: &str) -> Result<()> {
    let err = |reason: String| Error::EngineFile { path: path.to_string(), reason };
    config.validate().map_err(|e| err(format!("build config: {e}")))?;
    if config.max_batch > MAX_BATCH {
        return Err(err(format!("build config: max batch {} exceeds the limit of {MAX_BATCH}", config.max_batch)));
    }
    g.validate_with(stored).map_err(|e| err(e.to_string()))?;
    config.validate_profiles(g).map_err(|e| err(format!("build config: {e}")))?;
    g.check_bindings().map_err(err)?;
    for &i in &g.inputs {
        let shape = &g.nodes[i].shape;
        let per_image = crate::graph::numel(shape.get(1..).unwrap_or(&[]));
        if shape.is_empty() || per_image.and_then(|n| n.checked_mul(config.max_batch)).is_none() {
            return Err(err(format!("input `{}` has shape {shape:?}, too large for max batch {}", g.nodes[i].path, config.max_batch)));
        }
    }
    Ok(())
}

/// The bytes of an engine file; a directory or FIFO is named, never read or waited on.
fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    let shown = path.display().to_string();
    crate::host::read_regular(path, "the path of a .kiln engine file", |reason| Error::EngineFile { path: shown, reason })
}

/// Reads and decodes an engine file without a GPU (its payload validated, nothing lowered).
pub fn read(path: impl AsRef<Path>) -> Result<(Header, Payload)> {
    let path = path.as_ref();
    decode(&read_bytes(path)?, &path.display().to_string())
}

impl Engine {
    /// Writes the engine file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let payload = Payload { config: self.config.clone(), graph: self.graph.clone(), tactics: self.tactics() };
        let bytes = encode(&Header::for_gpu(&self.gpu.info), &payload)?;
        std::fs::write(path, bytes).map_err(Error::io(path))
    }

    /// An engine file's optimised graph and build config, read without a GPU: the header, the
    /// checksum and the payload are checked; the device check waits for [`Engine::load`].
    pub fn read_contents(bytes: &[u8], source: &str) -> Result<(Graph, BuildConfig)> {
        decode(bytes, source).map(|(_, p)| (p.graph, p.config))
    }

    /// Loads an engine file onto `gpu`: header checked against the device, no passes, no timing.
    pub fn load(path: impl AsRef<Path>, gpu: &Arc<Gpu>) -> Result<Engine> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let read = std::time::Instant::now();
        let bytes = read_bytes(path)?;
        let header = decode_header(&bytes, &shown)?;
        check_device(&header, &gpu.info, &shown)?;
        let (_, payload) = decode(&bytes, &shown)?;
        tracing::debug!(path = %shown, bytes = bytes.len(), ms = read.elapsed().as_secs_f64() * 1e3, "load: engine file read and decoded");
        let mut tactics =
            Tactics { recorded: payload.tactics, replay: true, cache_prefix: cache_prefix(gpu, &payload.config), ..Default::default() };
        let start = std::time::Instant::now();
        let mut engine = lower(gpu.clone(), payload.graph, payload.config, &mut tactics)?;
        engine.summary.build_seconds = start.elapsed().as_secs_f64();
        // Lowering includes the kernels' NVRTC compilation (or their cache) and the weights' upload.
        tracing::debug!(path = %shown, ms = engine.summary.build_seconds * 1e3, layers = engine.summary.layers, "load: plans lowered (kernels, weights, arena)");
        Ok(engine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{ConvAttrs, Op};

    fn sample() -> (Header, Payload) {
        let mut graph = Graph::default();
        let x = graph.push_unchecked(Op::Input { name: "x".into() }, vec![], vec![1, 3, 8, 8], "x".into());
        let w = graph.weight("conv.weight", Arc::new(HostTensor::new(vec![4, 3, 1, 1], (0..12).map(|i| i as f32 * 0.5).collect())));
        let y = graph.push(Op::Conv(ConvAttrs::default()), vec![x, w], "conv".into()).expect("valid conv");
        graph.inputs.push(x);
        graph.mark_output("y", y);
        let tactics = BTreeMap::from([("conv|k1".to_string(), "cublaslt-gemm".to_string())]);
        (
            Header { version: FORMAT_VERSION, sm: 90, driver_version: 13000, cudnn_version: 91400 },
            Payload { config: BuildConfig::default(), graph, tactics },
        )
    }

    fn reason(e: Error) -> String {
        match e {
            Error::EngineFile { reason, .. } => reason,
            other => panic!("expected an engine-file error, got {other}"),
        }
    }

    #[test]
    fn round_trip_keeps_graph_weights_and_tactics() {
        let (h, p) = sample();
        let bytes = encode(&h, &p).expect("encodes");
        let (h2, p2) = decode(&bytes, "e.kiln").expect("decodes");
        assert_eq!(h, h2);
        assert_eq!(p2.config, p.config);
        assert_eq!(p2.tactics, p.tactics);
        assert_eq!(p2.graph.nodes, p.graph.nodes);
        assert_eq!(p2.graph.weights["conv.weight"].data, p.graph.weights["conv.weight"].data);
    }

    #[test]
    fn a_u8_input_keeps_its_dtype() {
        let (h, mut p) = sample();
        p.graph.nodes[0].dtype = crate::graph::DType::U8;
        let (_, p2) = decode(&encode(&h, &p).expect("encodes"), "e.kiln").expect("decodes");
        assert_eq!(p2.graph.input_dtype("x"), Some(crate::graph::DType::U8));
        assert_eq!(p2.graph.nodes, p.graph.nodes);
    }

    #[test]
    fn every_corrupted_byte_is_rejected() {
        let (h, p) = sample();
        let bytes = encode(&h, &p).expect("encodes");
        // Flip one byte at a time across the header fields that matter and the whole payload.
        for at in (0..8).chain(24..bytes.len()) {
            let mut bad = bytes.clone();
            bad[at] ^= 0x20;
            assert!(decode(&bad, "e.kiln").is_err(), "a flipped byte at {at} was accepted");
        }
        let mut bad = bytes.clone();
        bad[HEADER_LEN + 20] ^= 1;
        assert!(reason(decode(&bad, "e.kiln").unwrap_err()).contains("checksum"));
    }

    #[test]
    fn truncated_and_foreign_files_are_rejected_with_the_reason() {
        let (h, p) = sample();
        let bytes = encode(&h, &p).expect("encodes");
        assert!(reason(decode(&bytes[..bytes.len() - 3], "e.kiln").unwrap_err()).contains("truncated"));
        assert!(reason(decode(&bytes[..10], "e.kiln").unwrap_err()).contains("truncated"));
        let mut foreign = bytes.clone();
        foreign[..8].copy_from_slice(b"PK\x03\x04abcd");
        assert!(reason(decode(&foreign, "e.kiln").unwrap_err()).contains("not a Kiln engine"));
        let mut newer = bytes.clone();
        newer[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        assert!(reason(decode(&newer, "e.kiln").unwrap_err()).contains("format version"));
    }

    #[test]
    fn another_architecture_or_cudnn_is_rejected() {
        let (h, _) = sample();
        let h100 = GpuInfo { name: "H100".into(), sm: 90, driver_version: 12080, cudnn_version: 91400 };
        check_device(&h, &h100, "e.kiln").expect("same arch and cuDNN, other driver: accepted");
        let a100 = GpuInfo { sm: 80, ..h100.clone() };
        assert!(reason(check_device(&h, &a100, "e.kiln").unwrap_err()).contains("sm_90"));
        let other_dnn = GpuInfo { cudnn_version: 90100, ..h100 };
        assert!(reason(check_device(&h, &other_dnn, "e.kiln").unwrap_err()).contains("cuDNN"));
    }
}
