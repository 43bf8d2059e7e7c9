//! From the unpickled object to tensors: the state_dict's keys, then each tensor's elements read
//! through its storage, offset and strides.

use super::pickle::{Obj, Unpickler, Value};
use super::{bad, Checkpoint, StorageRef, TensorRef};
use crate::graph::{numel, HostTensor};
use crate::var_builder::MAX_TENSOR_ELEMENTS;
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// The keys under which training scripts nest a state_dict, in the order they are tried.
pub(super) const NESTED: [&str; 3] = ["state_dict", "model", "model_state_dict"];

/// A state_dict found in a checkpoint: its tensors by key (later duplicates win, as Python's dict
/// does), the key of `NESTED` it was under, and the other keys of `NESTED` holding other tensors.
pub(super) struct Found {
    pub(super) tensors: BTreeMap<String, TensorRef>,
    pub(super) under: Option<String>,
    pub(super) unread: Vec<String>,
}

/// The state_dict of `root`: under the first key of `NESTED` that holds one, else `root` itself.
pub(super) fn state_dict(u: &Unpickler, root: Value) -> Result<Found> {
    let as_tensors = |v: Value| -> Option<BTreeMap<String, TensorRef>> {
        let Some(Obj::Dict(pairs)) = u.obj(v) else { return None };
        let mut out = BTreeMap::new();
        for &(k, v) in pairs {
            match (u.str_of(k), u.obj(v)) {
                (Some(k), Some(Obj::Tensor(t))) => out.insert(k.to_string(), (**t).clone()),
                _ => return None,
            };
        }
        Some(out)
    };
    let Some(Obj::Dict(pairs)) = u.obj(root) else {
        return Err(bad(u.path, "the checkpoint is not a dict, so it holds no state_dict"));
    };
    let nested: Vec<(&str, BTreeMap<String, TensorRef>)> = NESTED
        .iter()
        .filter_map(|&name| {
            let &(_, v) = pairs.iter().rev().find(|(k, _)| u.str_of(*k) == Some(name))?;
            Some((name, as_tensors(v)?))
        })
        .collect();
    if let Some(((name, tensors), rest)) = nested.split_first() {
        let unread = rest.iter().filter(|(_, t)| t != tensors).map(|(n, _)| n.to_string()).collect();
        return Ok(Found { tensors: tensors.clone(), under: Some(name.to_string()), unread });
    }
    let tensors = as_tensors(root).ok_or_else(|| {
        let keys: Vec<String> =
            pairs.iter().take(12).map(|(k, _)| u.str_of(*k).map_or("(not a string)".into(), |s| format!("`{s}`"))).collect();
        bad(
            u.path,
            format!(
                "no state_dict found: the checkpoint is a dict that is neither string keys to tensors nor holds one under {}; its keys: {}",
                NESTED.map(|k| format!("`{k}`")).join(", "),
                keys.join(", ")
            ),
        )
    })?;
    Ok(Found { tensors, under: None, unread: Vec::new() })
}

/// Materialises every tensor from its storage's bytes (`storage(key)` gives a root storage's
/// bytes, already checked to hold its `numel` elements). A file of `file_len` bytes decodes to at
/// most `DECODED_PER_BYTE` times as many bytes of f32: f16 doubles, and a storage shared by a
/// few keys is decoded once per key; a small file naming one storage a million times is refused.
pub(super) fn materialise<'b>(
    path: &Path,
    file_len: usize,
    found: Found,
    mut storage: impl FnMut(&StorageRef) -> Result<&'b [u8]>,
) -> Result<Checkpoint> {
    let mut out = Checkpoint { under: found.under, unread: found.unread, ..Checkpoint::default() };
    let budget = file_len.saturating_mul(DECODED_PER_BYTE).saturating_add(1 << 20);
    let mut decoded = 0usize;
    for (key, t) in found.tensors {
        let elem = t.storage.elem;
        if !elem.is_float() {
            out.other.insert(key, elem.name().to_string());
            continue;
        }
        let root = storage(&t.storage)?;
        let (start, len) = t.storage.view.unwrap_or((0, t.storage.numel));
        let view = start
            .checked_add(len)
            .and_then(|end| root.get(start.checked_mul(elem.size())?..end.checked_mul(elem.size())?))
            .ok_or_else(|| bad(path, format!("tensor `{key}`: its storage view {start}+{len} is outside its storage")))?;
        let bytes = gather(path, &key, &t, view, elem.size())?;
        decoded = decoded.saturating_add(bytes.len() / elem.size() * 4);
        if decoded > budget {
            return Err(Error::TooLarge {
                what: format!("checkpoint {}", path.display()),
                reason: format!(
                    "its tensors decode to more than {DECODED_PER_BYTE} times its {file_len} bytes (storages named over and over)"
                ),
            });
        }
        let data = crate::var_builder::decode(elem.name(), &bytes, &key, path)?.unwrap_or_default();
        out.tensors.insert(key, HostTensor::try_new(t.shape, data)?);
    }
    Ok(out)
}

/// How many bytes of f32 one byte of a checkpoint may decode to (see `materialise`).
const DECODED_PER_BYTE: usize = 8;

/// The bytes of `t`'s elements in row-major order, read through its offset and strides from
/// `storage`; every index is checked against the storage first. A tensor may not hold more
/// elements than its storage (a broadcast view, stride 0, would let a few bytes claim gigabytes).
fn gather(path: &Path, key: &str, t: &TensorRef, storage: &[u8], size: usize) -> Result<Vec<u8>> {
    let n = numel(&t.shape).filter(|&n| n <= MAX_TENSOR_ELEMENTS).ok_or_else(|| Error::TooLarge {
        what: format!("tensor `{key}` in {}", path.display()),
        reason: format!("shape {:?} has more than {MAX_TENSOR_ELEMENTS} elements", t.shape),
    })?;
    let have = storage.len() / size;
    if n > have {
        return Err(bad(
            path,
            format!("tensor `{key}` has {n} elements but its storage only {have} (an expanded view: save it with .contiguous())"),
        ));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    {
        let last = t.shape.iter().zip(&t.stride).try_fold(t.offset, |at, (&d, &s)| (d - 1).checked_mul(s)?.checked_add(at));
        if last.is_none_or(|l| l >= have) {
            return Err(bad(
                path,
                format!(
                    "tensor `{key}`: size {:?}, stride {:?} and offset {} reach past its storage of {have} elements",
                    t.shape, t.stride, t.offset
                ),
            ));
        }
    }
    let mut out = Vec::new();
    out.try_reserve_exact(n * size)
        .map_err(|_| Error::OutOfMemory { what: format!("tensor `{key}` of {}", path.display()), bytes: n * size })?;
    let contiguous = {
        let mut expect = 1;
        t.shape.iter().zip(&t.stride).rev().all(|(&d, &s)| {
            let ok = d == 1 || s == expect;
            expect *= d;
            ok
        })
    };
    if contiguous {
        // Checked above: offset + n - 1 < have.
        out.extend_from_slice(&storage[t.offset * size..(t.offset + n) * size]);
        return Ok(out);
    }
    let mut index = vec![0usize; t.shape.len()];
    for _ in 0..n {
        let at = t.offset + index.iter().zip(&t.stride).map(|(i, s)| i * s).sum::<usize>();
        out.extend_from_slice(&storage[at * size..(at + 1) * size]);
        for d in (0..index.len()).rev() {
            index[d] += 1;
            if index[d] < t.shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    Ok(out)
}

/// The bytes `s`'s root storage needs: `numel` elements.
pub(super) fn storage_bytes(path: &Path, s: &StorageRef) -> Result<usize> {
    s.numel.checked_mul(s.elem.size()).ok_or_else(|| bad(path, format!("storage `{}` of {} elements is too large", s.key, s.numel)))
}
