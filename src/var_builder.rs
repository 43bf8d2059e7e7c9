//! Weights by `state_dict` name: a `VarBuilder` is a dotted-path prefix over a weight source
//! (memory-mapped safetensors files, PyTorch checkpoints read by `crate::pth`, or the seeded
//! generator used for fixtures and benchmarks).
//! Every lookup checks name, shape and dtype; keys the model never asked for are reported.

use crate::graph::HostTensor;
use crate::tensor::Param;
use crate::{Error, Result};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::Dtype;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

#[derive(Clone)]
pub struct VarBuilder {
    store: Arc<Store>,
    prefix: String,
}

struct Store {
    source: Source,
    used: Mutex<BTreeSet<String>>,
    /// Keys read so far that held NaN or infinity, with how many such values.
    non_finite: Mutex<BTreeMap<String, usize>>,
}

/// One tensor of a safetensors header, checked against the file but not decoded.
pub(crate) struct Entry {
    file: usize,
    /// The safetensors dtype name (`F32`, `BF16`, `I64`, ...).
    pub(crate) dtype: String,
    pub(crate) shape: Vec<usize>,
    /// Its bytes in the file.
    range: (usize, usize),
}

enum Source {
    Safetensors {
        files: Vec<(PathBuf, Mmap)>,
        entries: BTreeMap<String, Entry>,
    },
    Tensors(BTreeMap<String, HostTensor>),
    /// PyTorch checkpoints, decoded when opened; `other` holds the keys of dtypes Kiln cannot load.
    Checkpoint {
        name: String,
        tensors: BTreeMap<String, HostTensor>,
        other: BTreeMap<String, String>,
    },
    Seeded,
}

impl Source {
    fn describe(&self) -> String {
        match self {
            Source::Safetensors { files, .. } => files.iter().map(|(p, _)| p.display().to_string()).collect::<Vec<_>>().join(", "),
            Source::Tensors(_) => "the given tensors".into(),
            Source::Checkpoint { name, .. } => name.clone(),
            Source::Seeded => "the seeded generator".into(),
        }
    }
}

/// Keys that PyTorch saves but inference never reads, or that Kiln recomputes: Swin's
/// `relative_position_index` is a constant of the window size (`kiln_models::swin`).
fn is_bookkeeping(key: &str) -> bool {
    key.ends_with("num_batches_tracked") || key.ends_with("relative_position_index")
}

impl Store {
    /// Whether the source holds the full key `key`.
    fn has(&self, key: &str) -> bool {
        match &self.source {
            Source::Safetensors { entries, .. } => entries.contains_key(key),
            Source::Tensors(t) => t.contains_key(key),
            Source::Checkpoint { tensors, other, .. } => tensors.contains_key(key) || other.contains_key(key),
            Source::Seeded => true,
        }
    }
}

impl VarBuilder {
    fn with_source(source: Source) -> Self {
        let store = Store { source, used: Mutex::new(BTreeSet::new()), non_finite: Mutex::new(BTreeMap::new()) };
        Self { store: Arc::new(store), prefix: String::new() }
    }

    /// Memory-maps safetensors files (as written by `safetensors.torch.save_file(model.state_dict())`).
    ///
    /// Only regular files are opened (a directory or a FIFO is named as such, never waited on); each
    /// header is parsed and checked against the file here, so a key named twice (in one header or
    /// in two files) is an error naming both places, and no tensor is decoded until it is asked for.
    pub fn from_safetensors<P: AsRef<Path>>(paths: &[P]) -> Result<Self> {
        let mut files = Vec::new();
        let mut entries: BTreeMap<String, Entry> = BTreeMap::new();
        for (index, path) in paths.iter().enumerate() {
            let path = path.as_ref().to_path_buf();
            let mmap = map_safetensors(&path)?;
            for (name, entry) in parse_header(&path, &mmap, index)? {
                if let Some(first) = entries.get(&name) {
                    let first: &Path = files.get(first.file).map_or(path.as_path(), |(p, _): &(PathBuf, Mmap)| p.as_path());
                    return Err(Error::DuplicateTensor {
                        key: name,
                        first: first.display().to_string(),
                        second: path.display().to_string(),
                    });
                }
                entries.insert(name, entry);
            }
            files.push((path, mmap));
        }
        Ok(Self::with_source(Source::Safetensors { files, entries }))
    }

    /// Reads PyTorch checkpoints (`torch.save`, `.pth`/`.pt`; zip or legacy format): a bare
    /// state_dict or a dict holding one (`crate::pth::read_pth`). A key in two files is an error.
    pub fn from_pth<P: AsRef<Path>>(paths: &[P]) -> Result<Self> {
        let mut tensors = BTreeMap::new();
        let mut other = BTreeMap::new();
        let mut first: BTreeMap<String, PathBuf> = BTreeMap::new();
        let mut names = Vec::new();
        for path in paths {
            let path = path.as_ref();
            let c = crate::pth::read_pth(path)?;
            names.push(c.source_name(path));
            for key in c.tensors.keys().chain(c.other.keys()) {
                if let Some(was) = first.insert(key.clone(), path.to_path_buf()) {
                    return Err(Error::DuplicateTensor {
                        key: key.clone(),
                        first: was.display().to_string(),
                        second: path.display().to_string(),
                    });
                }
            }
            tensors.extend(c.tensors);
            other.extend(c.other);
        }
        Ok(Self::with_source(Source::Checkpoint { name: names.join(", "), tensors, other }))
    }

    /// Weights files of either kind: PyTorch checkpoints (recognised by their first bytes) go to
    /// `from_pth`, anything else to `from_safetensors`. The files must all be of one kind.
    pub fn from_files<P: AsRef<Path>>(paths: &[P]) -> Result<Self> {
        let mut pth = Vec::new();
        for path in paths {
            let path = path.as_ref();
            let mut file =
                crate::host::open_regular(path, "the path of a weights file", |reason| Error::Safetensors { path: path.into(), reason })?;
            let mut head = [0u8; 16];
            let n = std::io::Read::read(&mut file, &mut head).map_err(Error::io(path))?;
            let head = &head[..n];
            if let Some(kind) = foreign_format(head) {
                return Err(Error::WeightsFile {
                    path: path.into(),
                    reason: format!("is {kind}, neither a safetensors file nor a PyTorch checkpoint (torch.save's zip archive or pickle)"),
                });
            }
            pth.push(crate::pth::looks_like_checkpoint(head));
        }
        let start = std::time::Instant::now();
        let (vb, kind) = match (pth.iter().all(|&p| p), pth.iter().any(|&p| p)) {
            (true, true) => (Self::from_pth(paths)?, "PyTorch checkpoint"),
            (_, false) => (Self::from_safetensors(paths)?, "safetensors"),
            _ => {
                return Err(Error::Checkpoint {
                    path: paths[pth.iter().position(|&p| p).unwrap_or(0)].as_ref().into(),
                    reason: "is a PyTorch checkpoint, given with safetensors files: give weights files of one kind".into(),
                })
            }
        };
        let files: Vec<String> = paths.iter().map(|p| p.as_ref().display().to_string()).collect();
        tracing::debug!(?files, kind, ms = start.elapsed().as_secs_f64() * 1e3, "load: weights opened");
        Ok(vb)
    }

    /// Weights from tensors already in memory.
    pub fn from_tensors(tensors: BTreeMap<String, HostTensor>) -> Self {
        Self::with_source(Source::Tensors(tensors))
    }

    /// Deterministic weights from `seeded::weight` (the same values the export script writes).
    pub fn seeded() -> Self {
        Self::with_source(Source::Seeded)
    }

    /// One more segment of the dotted path: `vb.pp("layer1").pp(0)` reads `layer1.0.*`.
    pub fn pp(&self, segment: impl std::fmt::Display) -> Self {
        let prefix = if self.prefix.is_empty() { segment.to_string() } else { format!("{}.{segment}", self.prefix) };
        Self { store: self.store.clone(), prefix }
    }

    /// The module path of this builder (`layer1.0.conv1`).
    pub fn path(&self) -> &str {
        &self.prefix
    }

    fn key(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    /// Whether the source holds `name` under this prefix.
    pub fn contains(&self, name: &str) -> bool {
        self.store.has(&self.key(name))
    }

    /// Loads `name` under this prefix as f32, checking that it has exactly `shape`. The stored
    /// shape and dtype are checked before anything is decoded, and the decoded values' memory is
    /// requested with `try_reserve`, so a hostile file is an error, never an abort.
    pub fn get(&self, shape: &[usize], name: &str) -> Result<Param> {
        let key = self.key(name);
        let source_name = || self.store.source.describe();
        let missing = || match &self.store.source {
            Source::Safetensors { .. } | Source::Checkpoint { .. } if self.store.has(&format!("module.{key}")) => {
                Error::MissingWeightPrefixed { key: key.clone(), prefix: "module.".into(), source_name: source_name() }
            }
            _ => Error::MissingWeight { key: key.clone(), source_name: source_name() },
        };
        let value = match &self.store.source {
            Source::Seeded => crate::seeded::weight(&key, shape),
            Source::Tensors(t) => t.get(&key).ok_or_else(missing)?.clone(),
            Source::Checkpoint { tensors, other, .. } => match (tensors.get(&key), other.get(&key)) {
                (Some(t), _) => t.clone(),
                (None, Some(dtype)) => return Err(Error::WeightDtype { key, got: dtype.clone(), source_name: source_name() }),
                (None, None) => return Err(missing()),
            },
            Source::Safetensors { files, entries } => {
                let e = entries.get(&key).ok_or_else(missing)?;
                if e.shape != shape {
                    return Err(Error::WeightShape { key, expected: shape.to_vec(), got: e.shape.clone(), source_name: source_name() });
                }
                let bytes = &files[e.file].1[e.range.0..e.range.1];
                let data = decode(&e.dtype, bytes, &key, &files[e.file].0)?.ok_or_else(|| Error::WeightDtype {
                    key: key.clone(),
                    got: e.dtype.clone(),
                    source_name: source_name(),
                })?;
                HostTensor::try_new(e.shape.clone(), data)?
            }
        };
        if value.shape != shape {
            return Err(Error::WeightShape { key, expected: shape.to_vec(), got: value.shape, source_name: source_name() });
        }
        let bad = value.data.iter().filter(|v| !v.is_finite()).count();
        if bad > 0 {
            self.store.non_finite.lock().expect("weight bookkeeping lock").insert(key.clone(), bad);
        }
        self.store.used.lock().expect("weight bookkeeping lock").insert(key.clone());
        Ok(Param { name: key, value: Arc::new(value) })
    }

    /// Keys read so far that hold NaN or infinity, with how many such values each.
    pub fn non_finite(&self) -> Vec<(String, usize)> {
        self.store.non_finite.lock().expect("weight bookkeeping lock").iter().map(|(k, n)| (k.clone(), *n)).collect()
    }

    /// Strict mode: an error naming the first key read so far that holds NaN or infinity.
    pub fn check_finite(&self) -> Result<()> {
        match self.non_finite().into_iter().next() {
            Some((key, count)) => Err(Error::NonFinite { key, count, source_name: self.store.source.describe() }),
            None => Ok(()),
        }
    }

    /// Keys in the source that no `get` asked for (PyTorch's bookkeeping keys excluded).
    pub fn unused(&self) -> Vec<String> {
        let used = self.store.used.lock().expect("weight bookkeeping lock");
        let keys: Vec<&String> = match &self.store.source {
            Source::Safetensors { entries, .. } => entries.keys().collect(),
            Source::Tensors(t) => t.keys().collect(),
            Source::Checkpoint { tensors, other, .. } => tensors.keys().chain(other.keys()).collect(),
            Source::Seeded => vec![],
        };
        keys.into_iter().filter(|k| !used.contains(*k) && !is_bookkeeping(k)).cloned().collect()
    }

    /// Strict mode: an error listing every key the model never used.
    pub fn check_all_used(&self) -> Result<()> {
        let keys = self.unused();
        if keys.is_empty() {
            return Ok(());
        }
        Err(Error::UnusedWeights { count: keys.len(), keys, source_name: self.store.source.describe() })
    }
}

/// The most elements one tensor read from a file may have: 2^32 (16 GiB as f32). Larger is
/// corrupt or hostile, never a convolutional network's weight or activation.
pub const MAX_TENSOR_ELEMENTS: usize = 1 << 32;

/// Maps a safetensors file: a directory, FIFO, socket or device is named as such, never opened
/// for reading or waited on (`host::map_regular`).
fn map_safetensors(path: &Path) -> Result<Mmap> {
    crate::host::map_regular(path, "the path of a .safetensors file", |reason| Error::Safetensors { path: path.into(), reason })
}

const PTH_HINT: &str = "this looks like a PyTorch pickle (torch.save, .pth/.pt/.bin), which `from_safetensors` does not read: \
     load it with `VarBuilder::from_pth` or `from_files`, or convert it with \
     `safetensors.torch.save_file(model.state_dict(), \"model.safetensors\")`";

/// Whether `bytes`/`path` look like `torch.save` output: a zip archive, a raw pickle, or the extension.
fn looks_like_pickle(path: &Path, bytes: &[u8]) -> bool {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    bytes.starts_with(b"PK\x03\x04") || bytes.first() == Some(&0x80) || matches!(ext, "pth" | "pt" | "bin" | "ckpt")
}

/// The bytes per element of a safetensors dtype name; `None` for a name safetensors does not define.
fn dtype_size(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

/// The largest safetensors header read, 100 MB: the safetensors crate's own limit (a header
/// names each tensor in about 100 bytes, so a million tensors fit).
pub const MAX_HEADER_BYTES: usize = 100_000_000;

/// A JSON object's members in file order, duplicates kept (serde_json's maps keep the last).
struct Members(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object of tensors")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Members, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry::<String, serde_json::Value>()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(V)
    }
}

#[derive(Deserialize)]
struct TensorInfo {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: [usize; 2],
}

/// Parses and checks the header of the safetensors file `bytes`: its length, its JSON (every key
/// once), each tensor's dtype, byte size against its shape, and offsets that tile the data exactly.
/// Errors name the file and say what is wrong in the user's terms.
fn parse_header(path: &Path, bytes: &[u8], file: usize) -> Result<Vec<(String, Entry)>> {
    let bad = |reason: String| Error::Safetensors { path: path.into(), reason };
    let hint = |reason: String| if looks_like_pickle(path, bytes) { bad(format!("{reason}; {PTH_HINT}")) } else { bad(reason) };
    if bytes.starts_with(b"PK\x03\x04") {
        // torch.save's zip archive: no safetensors header length starts with these bytes.
        return Err(bad(PTH_HINT.to_string()));
    }
    if bytes.len() < 8 {
        return Err(hint(format!(
            "the file is {} bytes, shorter than the 8-byte header length (truncated or not safetensors)",
            bytes.len()
        )));
    }
    let len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    let rest = bytes.len() - 8;
    if len > MAX_HEADER_BYTES as u64 && len <= rest as u64 {
        // JSON parsed into values takes several times its text: bounded as the safetensors
        // crate bounds it (no file it writes or reads has a larger header).
        return Err(bad(format!("the header is {len} bytes, more than the limit of {MAX_HEADER_BYTES} (corrupt or hostile file)")));
    }
    let header = match usize::try_from(len) {
        Ok(n) if n <= rest => &bytes[8..8 + n],
        _ => {
            return Err(hint(format!(
            "the header length in the first 8 bytes ({len}) exceeds the {rest} bytes after them (truncated, corrupt, or not safetensors)"
        )))
        }
    };
    let data_len = rest - header.len();
    let text = std::str::from_utf8(header).map_err(|e| hint(format!("the header is not valid UTF-8 (corrupt file): {e}")))?;
    let Members(members) = serde_json::from_str(text).map_err(|e| hint(format!("the header is not valid JSON (corrupt file): {e}")))?;
    let mut seen = BTreeSet::new();
    let mut entries = Vec::with_capacity(members.len());
    for (name, value) in members {
        if !seen.insert(name.clone()) {
            return Err(Error::DuplicateTensor {
                key: name,
                first: path.display().to_string(),
                second: format!("{} (the same header)", path.display()),
            });
        }
        if name == "__metadata__" {
            continue;
        }
        let info: TensorInfo = serde_json::from_value(value)
            .map_err(|e| bad(format!("the header entry of tensor `{name}` is not a safetensors tensor description: {e}")))?;
        let size = dtype_size(&info.dtype).ok_or_else(|| bad(format!("tensor `{name}` has unknown dtype `{}`", info.dtype)))?;
        let [start, end] = info.data_offsets;
        let want = crate::graph::numel(&info.shape).and_then(|n| n.checked_mul(size));
        if want != end.checked_sub(start) {
            let want = want.map_or("more than usize::MAX".into(), |w| w.to_string());
            return Err(bad(format!(
                "tensor `{name}`: its byte size ({start}..{end}) does not match its shape {:?} and dtype {} ({want} bytes) (corrupt file)",
                info.shape, info.dtype
            )));
        }
        entries.push((name, Entry { file, dtype: info.dtype, shape: info.shape, range: (start, end) }));
    }
    // The data must be tiled exactly by the tensors, in offset order, as safetensors writes it.
    let mut order: Vec<&(String, Entry)> = entries.iter().collect();
    order.sort_by_key(|(_, e)| e.range);
    let mut at = 0;
    for (name, e) in order {
        if e.range.0 != at {
            return Err(bad(format!("the data offsets of tensor `{name}` are out of order or out of range (corrupt file)")));
        }
        at = e.range.1;
    }
    if at != data_len {
        return Err(bad(format!(
            "the tensor data does not end where the header says: the header covers {at} bytes, the file holds {data_len} (truncated or corrupt file)"
        )));
    }
    // Offsets are relative to the end of the header.
    let base = 8 + header.len();
    Ok(entries.into_iter().map(|(n, e)| (n, Entry { range: (base + e.range.0, base + e.range.1), ..e })).collect())
}

/// The values of an f32, f16 or bf16 tensor as f32; `Ok(None)` for any other dtype. Memory is
/// requested with `try_reserve`, and a tensor over `MAX_TENSOR_ELEMENTS` is refused first.
pub(crate) fn decode(dtype: &str, bytes: &[u8], key: &str, path: &Path) -> Result<Option<Vec<f32>>> {
    let size = match dtype {
        "F32" => 4,
        "F16" | "BF16" => 2,
        _ => return Ok(None),
    };
    let n = bytes.len() / size;
    if n > MAX_TENSOR_ELEMENTS {
        return Err(Error::TooLarge {
            what: format!("tensor `{key}` in {}", path.display()),
            reason: format!("{n} elements, more than the limit of {MAX_TENSOR_ELEMENTS} (16 GiB as f32)"),
        });
    }
    let mut out = Vec::new();
    out.try_reserve_exact(n)
        .map_err(|_| Error::OutOfMemory { what: format!("tensor `{key}` of {}", path.display()), bytes: n.saturating_mul(4) })?;
    let pairs = bytes.chunks_exact(2).map(|b| [b[0], b[1]]);
    match dtype {
        "F32" => out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        "F16" => out.extend(pairs.map(|b| f16::from_le_bytes(b).to_f32())),
        _ => out.extend(pairs.map(|b| bf16::from_le_bytes(b).to_f32())),
    }
    Ok(Some(out))
}

/// Reads every tensor of a safetensors file (references, inputs) as f32, by name.
pub fn read_safetensors(path: impl AsRef<Path>) -> Result<BTreeMap<String, HostTensor>> {
    read_tensors(path, "stored", |_| true).map(|(tensors, _)| tensors)
}

/// Reads the tensors of a safetensors file whose key `keep` accepts, as f32; returns them and the
/// keys left out. `what` names the file's role in errors ("reference", "input"), so a tensor of
/// an unreadable dtype is not called a weight.
pub fn read_tensors(
    path: impl AsRef<Path>,
    what: &str,
    keep: impl Fn(&str) -> bool,
) -> Result<(BTreeMap<String, HostTensor>, Vec<String>)> {
    read_tensors_within(path, what, keep, MAX_TENSOR_ELEMENTS)
}

/// [`read_tensors`] with a tighter limit on each tensor's elements (an `--input`'s), checked
/// against the header for every tensor kept before any is decoded or allocated.
pub fn read_tensors_within(
    path: impl AsRef<Path>,
    what: &str,
    keep: impl Fn(&str) -> bool,
    max_elements: usize,
) -> Result<(BTreeMap<String, HostTensor>, Vec<String>)> {
    read_tensors_limited(path, what, |key| keep(key).then_some(max_elements))
}

/// [`read_tensors`] with a limit per key: `limit(key)` is the most elements tensor `key` may
/// hold, `None` to leave it out (a reference's inputs are bounded as an `--input` is, its outputs
/// as any tensor). Every limit is checked against the header before any tensor is decoded.
pub fn read_tensors_limited(
    path: impl AsRef<Path>,
    what: &str,
    limit: impl Fn(&str) -> Option<usize>,
) -> Result<(BTreeMap<String, HostTensor>, Vec<String>)> {
    let path = path.as_ref();
    let keep = |key: &str| limit(key).is_some();
    let vb = VarBuilder::from_safetensors(&[path])?;
    let Source::Safetensors { entries, files } = &vb.store.source else { unreachable!("from_safetensors makes a safetensors source") };
    for (key, e, max_elements) in entries.iter().filter_map(|(k, e)| Some((k, e, limit(k)?))) {
        // The header's shapes were checked against the file's bytes: they cannot overflow.
        let n = crate::graph::numel(&e.shape).unwrap_or(usize::MAX);
        if n > max_elements {
            return Err(Error::TooLarge {
                what: format!("{what} tensor `{key}` of shape {:?} in {}", e.shape, path.display()),
                reason: format!("{n} elements, more than the limit of {max_elements} ({} GiB as f32)", (max_elements as u128 * 4) >> 30),
            });
        }
    }
    let mut out = BTreeMap::new();
    let mut skipped = Vec::new();
    for (key, e) in entries {
        if !keep(key) {
            skipped.push(key.clone());
            continue;
        }
        let data = decode(&e.dtype, &files[e.file].1[e.range.0..e.range.1], key, path)?.ok_or_else(|| Error::TensorDtype {
            what: what.to_string(),
            key: key.clone(),
            got: e.dtype.clone(),
            path: path.to_path_buf(),
        })?;
        out.insert(key.clone(), HostTensor::try_new(e.shape.clone(), data)?);
    }
    Ok((out, skipped))
}

/// Writes f32 tensors to a safetensors file.
pub fn write_safetensors(path: impl AsRef<Path>, tensors: &BTreeMap<String, HostTensor>) -> Result<()> {
    let path = path.as_ref();
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> =
        tensors.iter().map(|(k, t)| (k.clone(), t.data.iter().flat_map(|v| v.to_le_bytes()).collect(), t.shape.clone())).collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
        .iter()
        .map(|(k, b, s)| {
            Ok((
                k.clone(),
                safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b)
                    .map_err(|e| Error::Safetensors { path: path.into(), reason: format!("{e:?}") })?,
            ))
        })
        .collect::<Result<_>>()?;
    safetensors::serialize_to_file(views, &None, path).map_err(|e| Error::Safetensors { path: path.into(), reason: format!("{e:?}") })
}

/// The `__metadata__` of a safetensors header as a string map (empty when the file has none).
/// `bytes` must be a file whose header `parse_header` accepted.
fn metadata_of(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, String>> {
    let bad = |reason: String| Error::Safetensors { path: path.into(), reason };
    let len = bytes.get(..8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))).unwrap_or(0);
    let header = usize::try_from(len).ok().and_then(|n| bytes.get(8..8usize.checked_add(n)?)).unwrap_or(&[]);
    let value: serde_json::Value =
        serde_json::from_slice(header).map_err(|e| bad(format!("the header is not valid JSON (corrupt file): {e}")))?;
    let Some(meta) = value.get("__metadata__") else { return Ok(BTreeMap::new()) };
    let object = meta.as_object().ok_or_else(|| bad("`__metadata__` is not a JSON object of strings".into()))?;
    object
        .iter()
        .map(|(k, v)| match v.as_str() {
            Some(s) => Ok((k.clone(), s.to_string())),
            None => Err(bad(format!("`__metadata__` entry `{k}` is not a string"))),
        })
        .collect()
}

/// Reads every tensor (f32, f16 or bf16, as f32) and the `__metadata__` of a safetensors file
/// already in memory; `path` names it in errors and `what` names its role ("graph", "outputs").
/// The header is checked as `VarBuilder::from_safetensors` checks it.
pub fn decode_safetensors(path: &Path, bytes: &[u8], what: &str) -> Result<(BTreeMap<String, HostTensor>, BTreeMap<String, String>)> {
    let (entries, metadata) = header_of(path, bytes)?;
    let mut out = BTreeMap::new();
    for (key, e) in entries {
        let t = decode_entry(path, bytes, &key, &e, what)?;
        out.insert(key, t);
    }
    Ok((out, metadata))
}

/// A safetensors header: its tensors by name (none decoded) and its `__metadata__`.
pub(crate) type Header = (Vec<(String, Entry)>, BTreeMap<String, String>);

/// The checked header of a safetensors file in memory.
pub(crate) fn header_of(path: &Path, bytes: &[u8]) -> Result<Header> {
    let entries = parse_header(path, bytes, 0)?;
    Ok((entries, metadata_of(path, bytes)?))
}

/// Whether a tensor of this dtype decodes to f32 (f32, f16, bf16).
pub(crate) fn is_readable_dtype(dtype: &str) -> bool {
    matches!(dtype, "F32" | "F16" | "BF16")
}

/// Decodes one entry of `header_of(path, bytes)` as f32; `what` names the file's role in errors.
pub(crate) fn decode_entry(path: &Path, bytes: &[u8], key: &str, e: &Entry, what: &str) -> Result<HostTensor> {
    let data = decode(&e.dtype, &bytes[e.range.0..e.range.1], key, path)?.ok_or_else(|| Error::TensorDtype {
        what: what.to_string(),
        key: key.to_string(),
        got: e.dtype.clone(),
        path: path.to_path_buf(),
    })?;
    HostTensor::try_new(e.shape.clone(), data)
}

/// The `__metadata__` of a safetensors file (checked header, no tensor decoded).
pub fn read_metadata(path: impl AsRef<Path>) -> Result<BTreeMap<String, String>> {
    let path = path.as_ref();
    let mmap = map_safetensors(path)?;
    parse_header(path, &mmap, 0)?;
    metadata_of(path, &mmap)
}

/// Writes f32 tensors to a safetensors file with `metadata` as its `__metadata__`.
pub fn write_safetensors_with_metadata(
    path: impl AsRef<Path>,
    tensors: &BTreeMap<String, &HostTensor>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let path = path.as_ref();
    let bytes = encode_safetensors(tensors, metadata).map_err(|reason| Error::Safetensors { path: path.into(), reason })?;
    std::fs::write(path, bytes).map_err(Error::io(path))
}

/// The bytes of a safetensors file holding f32 `tensors` and `metadata`.
pub fn encode_safetensors(tensors: &BTreeMap<String, &HostTensor>, metadata: &BTreeMap<String, String>) -> Result<Vec<u8>, String> {
    let bytes: Vec<(&String, Vec<u8>, &Vec<usize>)> =
        tensors.iter().map(|(k, t)| (k, t.data.iter().flat_map(|v| v.to_le_bytes()).collect(), &t.shape)).collect();
    let views = bytes
        .iter()
        .map(|(k, b, s)| {
            Ok(((*k).clone(), safetensors::tensor::TensorView::new(Dtype::F32, (*s).clone(), b).map_err(|e| format!("{e:?}"))?))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let meta: std::collections::HashMap<String, String> = metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let meta = if meta.is_empty() { None } else { Some(meta) };
    safetensors::serialize(views, &meta).map_err(|e| format!("{e:?}"))
}

/// What the first bytes of a weights file say it is, when that is neither safetensors nor a
/// checkpoint: an image, an archive, or text (a safetensors file's first 8 bytes are its header
/// length, which as text would claim exabytes).
fn foreign_format(head: &[u8]) -> Option<&'static str> {
    // A safetensors header (its length, then `{`) is never taken for anything else.
    if head.get(8) == Some(&b'{') {
        return None;
    }
    const MAGIC: [(&[u8], &str); 7] = [
        (b"\x89PNG", "a PNG image"),
        (b"\xff\xd8\xff", "a JPEG image"),
        (b"GIF8", "a GIF image"),
        (b"BM", "a BMP image"),
        (b"\x1f\x8b", "a gzip file"),
        (b"KILNENG", "a Kiln engine file (give it as the model, not as --weights)"),
        (b"\x93NUMPY", "a NumPy array (.npy)"),
    ];
    if let Some((_, kind)) = MAGIC.iter().find(|(m, _)| head.starts_with(m)) {
        return Some(kind);
    }
    if head.len() >= 12 && head.starts_with(b"RIFF") && &head[8..12] == b"WEBP" {
        return Some("a WebP image");
    }
    if head.starts_with(b"PK") && !crate::pth::looks_like_checkpoint(head) {
        return Some("a zip archive of an unknown kind");
    }
    let text = |b: &u8| b.is_ascii_graphic() || b.is_ascii_whitespace();
    if head.len() >= 8 && head[..8].iter().all(text) {
        return Some("a text file");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header over 100 MB is refused from its length, before the JSON is parsed.
    #[test]
    fn a_header_over_the_limit_is_refused_from_its_length() {
        let len = MAX_HEADER_BYTES + 1;
        let mut bytes = (len as u64).to_le_bytes().to_vec();
        bytes.resize(8 + len, b' ');
        let e = parse_header(Path::new("big.safetensors"), &bytes, 0).err().expect("too long");
        assert!(e.to_string().contains("the header is 100000001 bytes, more than the limit of 100000000"), "{e}");
    }

    /// A file that is neither safetensors nor a checkpoint is named for what it is, not called a
    /// broken safetensors file; an empty zip goes to the checkpoint reader.
    #[test]
    fn weights_files_of_other_kinds_are_named() {
        let dir = std::env::temp_dir().join(format!("kiln-vb-kinds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let png = [&b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR"[..], &[0u8; 16]].concat();
        for (name, bytes, says) in [
            ("notes.txt", b"hello, these are not weights\n".to_vec(), "cannot read weights file"),
            ("cat.png", png, "is a PNG image, neither a safetensors file nor a PyTorch checkpoint"),
            ("empty.zip", [&b"PK\x05\x06"[..], &[0u8; 18]].concat(), "cannot read PyTorch checkpoint"),
        ] {
            let path = dir.join(name);
            std::fs::write(&path, bytes).expect("write");
            let e = VarBuilder::from_files(&[&path]).err().unwrap_or_else(|| panic!("{name} read as weights"));
            assert!(e.to_string().contains(says), "{name}: {e}");
            assert!(!e.to_string().contains("cannot read safetensors"), "{name}: {e}");
        }
        let e = VarBuilder::from_files(&[dir.join("notes.txt")]).err().expect("text");
        assert!(
            e.to_string()
                .ends_with("is a text file, neither a safetensors file nor a PyTorch checkpoint (torch.save's zip archive or pickle)"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
