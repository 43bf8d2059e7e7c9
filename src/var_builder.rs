//! Weights by `state_dict` name: a `VarBuilder` is a dotted-path prefix over a weight source
//! (memory-mapped safetensors files, or the seeded generator used for fixtures and benchmarks).
//! Every lookup checks name, shape and dtype; keys the model never asked for are reported.

use crate::graph::HostTensor;
use crate::tensor::Param;
use crate::{Error, Result};
use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
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
}

struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    range: (usize, usize),
}

enum Source {
    Safetensors { files: Vec<(PathBuf, Mmap)>, entries: BTreeMap<String, Entry> },
    Tensors(BTreeMap<String, HostTensor>),
    Seeded,
}

impl Source {
    fn describe(&self) -> String {
        match self {
            Source::Safetensors { files, .. } => files.iter().map(|(p, _)| p.display().to_string()).collect::<Vec<_>>().join(", "),
            Source::Tensors(_) => "the given tensors".into(),
            Source::Seeded => "the seeded generator".into(),
        }
    }
}

/// Keys that PyTorch saves but inference never reads.
fn is_bookkeeping(key: &str) -> bool {
    key.ends_with("num_batches_tracked")
}

impl VarBuilder {
    fn with_source(source: Source) -> Self {
        Self { store: Arc::new(Store { source, used: Mutex::new(BTreeSet::new()) }), prefix: String::new() }
    }

    /// Memory-maps safetensors files (as written by `safetensors.torch.save_file(model.state_dict())`).
    pub fn from_safetensors<P: AsRef<Path>>(paths: &[P]) -> Result<Self> {
        let mut files = Vec::new();
        let mut entries = BTreeMap::new();
        for (index, path) in paths.iter().enumerate() {
            let path = path.as_ref().to_path_buf();
            let bad = |reason: String| Error::Safetensors { path: path.clone(), reason };
            let file = std::fs::File::open(&path).map_err(Error::io(&path))?;
            // SAFETY: the file is opened read-only; like every mmap user we assume nobody truncates
            // it while the model loads.
            let mmap = unsafe { Mmap::map(&file) }.map_err(Error::io(&path))?;
            let tensors = SafeTensors::deserialize(&mmap).map_err(|e| bad(explain(&e)))?;
            let base = mmap.as_ptr() as usize;
            for (name, view) in tensors.tensors() {
                let start = view.data().as_ptr() as usize - base;
                let entry =
                    Entry { file: index, dtype: view.dtype(), shape: view.shape().to_vec(), range: (start, start + view.data().len()) };
                entries.insert(name, entry);
            }
            files.push((path, mmap));
        }
        Ok(Self::with_source(Source::Safetensors { files, entries }))
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
        let key = self.key(name);
        match &self.store.source {
            Source::Safetensors { entries, .. } => entries.contains_key(&key),
            Source::Tensors(t) => t.contains_key(&key),
            Source::Seeded => true,
        }
    }

    /// Loads `name` under this prefix as f32, checking that it has exactly `shape`.
    pub fn get(&self, shape: &[usize], name: &str) -> Result<Param> {
        let key = self.key(name);
        let missing = || Error::MissingWeight { key: key.clone(), source_name: self.store.source.describe() };
        let value = match &self.store.source {
            Source::Seeded => crate::seeded::weight(&key, shape),
            Source::Tensors(t) => t.get(&key).ok_or_else(missing)?.clone(),
            Source::Safetensors { files, entries } => {
                let e = entries.get(&key).ok_or_else(missing)?;
                let bytes = &files[e.file].1[e.range.0..e.range.1];
                let data = decode(e.dtype, bytes).ok_or_else(|| Error::WeightDtype {
                    key: key.clone(),
                    got: format!("{:?}", e.dtype),
                    source_name: self.store.source.describe(),
                })?;
                HostTensor::new(e.shape.clone(), data)
            }
        };
        if value.shape != shape {
            return Err(Error::WeightShape { key, expected: shape.to_vec(), got: value.shape, source_name: self.store.source.describe() });
        }
        self.store.used.lock().expect("weight bookkeeping lock").insert(key.clone());
        Ok(Param { name: key, value: Arc::new(value) })
    }

    /// Keys in the source that no `get` asked for (PyTorch's bookkeeping keys excluded).
    pub fn unused(&self) -> Vec<String> {
        let used = self.store.used.lock().expect("weight bookkeeping lock");
        let keys: Vec<&String> = match &self.store.source {
            Source::Safetensors { entries, .. } => entries.keys().collect(),
            Source::Tensors(t) => t.keys().collect(),
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

/// The safetensors crate's errors print as their variant names; say what is wrong with the file.
fn explain(e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall => "the file is shorter than the 8-byte header length (truncated or not safetensors)".into(),
        E::HeaderTooLarge | E::InvalidHeaderLength => {
            "the header length in the first 8 bytes exceeds the file (truncated, corrupt, or not safetensors)".into()
        }
        E::InvalidHeader => "the header is not valid UTF-8 (corrupt file)".into(),
        E::InvalidHeaderStart | E::InvalidHeaderDeserialization | E::JsonError(_) => {
            format!("the header is not a valid safetensors JSON table (corrupt file): {e:?}")
        }
        E::MetadataIncompleteBuffer => "the tensor data does not end where the header says (truncated or corrupt file)".into(),
        E::InvalidOffset(name) => format!("the data offsets of tensor `{name}` are out of order or out of range (corrupt file)"),
        E::TensorInvalidInfo | E::ValidationOverflow => "a tensor's byte size does not match its shape and dtype (corrupt file)".into(),
        other => format!("{other:?}"),
    }
}

/// The values of an f32, f16 or bf16 tensor as f32; `None` for any other dtype.
fn decode(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let pairs = bytes.chunks_exact(2).map(|b| [b[0], b[1]]);
    Some(match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::F16 => pairs.map(|b| f16::from_le_bytes(b).to_f32()).collect(),
        Dtype::BF16 => pairs.map(|b| bf16::from_le_bytes(b).to_f32()).collect(),
        _ => return None,
    })
}

/// Reads every tensor of a safetensors file (references, inputs) as f32, by name.
pub fn read_safetensors(path: impl AsRef<Path>) -> Result<BTreeMap<String, HostTensor>> {
    let vb = VarBuilder::from_safetensors(&[path.as_ref()])?;
    let Source::Safetensors { entries, .. } = &vb.store.source else { unreachable!() };
    let shapes: Vec<(String, Vec<usize>)> = entries.iter().map(|(k, e)| (k.clone(), e.shape.clone())).collect();
    shapes.into_iter().map(|(k, shape)| Ok((k.clone(), Arc::unwrap_or_clone(vb.get(&shape, &k)?.value)))).collect()
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
