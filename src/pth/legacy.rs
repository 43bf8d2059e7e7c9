//! The legacy stream (PyTorch < 1.6): five pickles, then the storages' bytes.

use super::pickle::{Obj, Unpickler, Value};
use super::tensors::{materialise, state_dict};
use super::{bad, Checkpoint};
use crate::Result;
use std::collections::BTreeMap;
use std::path::Path;

/// `torch.serialization`'s `MAGIC_NUMBER`, 0x1950a86a20f9469cfc6c, as little-endian bytes.
const MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];
const PROTOCOL_VERSION: i64 = 1001;

pub(super) fn decode_legacy(path: &Path, bytes: &[u8]) -> Result<Checkpoint> {
    let mut storages = BTreeMap::new();
    // 1. The magic number.
    let mut u = Unpickler::new(path, bytes, 0);
    let magic = u.run(&mut storages)?;
    if !matches!(u.obj(magic), Some(Obj::BigInt(b)) if b[..] == MAGIC[..]) {
        return Err(bad(path, "not a PyTorch checkpoint: the first pickle is not torch.save's magic number"));
    }
    // 2. The protocol version.
    let mut u = Unpickler::new(path, bytes, u.pos);
    match u.run(&mut storages)? {
        Value::Int(PROTOCOL_VERSION) => {}
        Value::Int(v) => return Err(bad(path, format!("legacy serialisation protocol {v}, not {PROTOCOL_VERSION}"))),
        _ => return Err(bad(path, "the protocol version is not an integer")),
    }
    // 3. sys_info: the byte order is all that matters here.
    let mut u = Unpickler::new(path, bytes, u.pos);
    let info = u.run(&mut storages)?;
    if let Some(Obj::Dict(pairs)) = u.obj(info) {
        if pairs.iter().any(|&(k, v)| u.str_of(k) == Some("little_endian") && matches!(v, Value::Bool(false))) {
            return Err(bad(path, "the checkpoint was saved big-endian; Kiln reads little-endian checkpoints"));
        }
    }
    // 4. The object.
    let mut main = Unpickler::new(path, bytes, u.pos);
    let value = main.run(&mut storages)?;
    let found = state_dict(&main, value)?;
    // 5. The storage keys, then each storage: an i64 element count and the raw bytes.
    let mut u = Unpickler::new(path, bytes, main.pos);
    let keys = u.run(&mut BTreeMap::new())?;
    let keys: Vec<String> = u
        .items(keys)
        .ok_or_else(|| bad(path, "the storage keys are not a list"))?
        .iter()
        .map(|&k| u.str_of(k).map(str::to_string).ok_or_else(|| bad(path, "a storage key is not a string")))
        .collect::<Result<_>>()?;
    let mut at = u.pos;
    let mut ranges: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for key in keys {
        let s = storages.get(&key).ok_or_else(|| bad(path, format!("storage `{key}` is listed but no tensor uses it")))?;
        let count =
            bytes.get(at..at.saturating_add(8)).ok_or_else(|| bad(path, format!("storage `{key}`'s size is past the end (truncated)")))?;
        let count = u64::from_le_bytes(count.try_into().map_err(|_| bad(path, "8 bytes"))?);
        let count = usize::try_from(count).map_err(|_| bad(path, format!("storage `{key}` claims {count} elements")))?;
        if count < s.numel {
            return Err(bad(path, format!("storage `{key}` holds {count} elements, but its tensors need {}", s.numel)));
        }
        let len = count.checked_mul(s.elem.size()).ok_or_else(|| bad(path, format!("storage `{key}` claims {count} elements")))?;
        let start = at + 8;
        let end = start.checked_add(len).filter(|&e| e <= bytes.len()).ok_or_else(|| {
            bad(path, format!("storage `{key}` needs {len} bytes from byte {start}, past the end of the file (truncated)"))
        })?;
        ranges.insert(key, (start, end));
        at = end;
    }
    materialise(path, bytes.len(), found, |s| {
        let &(start, end) = ranges.get(&s.key).ok_or_else(|| bad(path, format!("storage `{}` is not in the file", s.key)))?;
        Ok(&bytes[start..end])
    })
}
