//! The zip container (PyTorch >= 1.6): `<root>/data.pkl` and one entry per storage.

use super::pickle::Unpickler;
use super::tensors::{materialise, state_dict, storage_bytes};
use super::{bad, Checkpoint};
use crate::{Error, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::Path;

type Archive<'a> = ::zip::ZipArchive<std::io::Cursor<&'a [u8]>>;

pub(super) fn decode_zip(path: &Path, bytes: &[u8]) -> Result<Checkpoint> {
    let zip_err = |e: ::zip::result::ZipError| bad(path, format!("not a readable zip archive: {e}"));
    let mut archive = ::zip::ZipArchive::new(std::io::Cursor::new(bytes)).map_err(zip_err)?;
    if archive.is_empty() {
        return Err(bad(path, "is an empty zip archive (not a torch.save checkpoint)"));
    }
    // The zip reader keeps the last of two members of one name: a second data.pkl or storage
    // would silently replace the first. torch.save never writes one name twice.
    if archive.has_duplicate_names() {
        return Err(bad(
            path,
            "the zip archive names one member twice in its central directory (torch.save never does; the archive was edited or is hostile)",
        ));
    }
    let pkl = archive
        .file_names()
        .filter_map(|n| n.ok())
        .filter(|n| n.ends_with("/data.pkl") || n == "data.pkl")
        .min_by_key(|n| n.len())
        .ok_or_else(|| bad(path, "the zip archive has no data.pkl (not a torch.save checkpoint)"))?
        .to_string();
    let root = pkl.strip_suffix("data.pkl").unwrap_or("").to_string();
    if archive.index_for_name(&format!("{root}byteorder")).is_some() {
        let order = read_entry(path, &mut archive, bytes.len(), &format!("{root}byteorder"), None)?;
        if order != b"little" {
            return Err(bad(path, "the checkpoint was saved big-endian; Kiln reads little-endian checkpoints"));
        }
    }
    let pickle = read_entry(path, &mut archive, bytes.len(), &pkl, None)?;
    let mut storages = BTreeMap::new();
    let mut u = Unpickler::new(path, &pickle, 0);
    let value = u.run(&mut storages)?;
    let found = state_dict(&u, value)?;
    // Only the storages of tensors Kiln decodes are read.
    let wanted: BTreeSet<&str> = found.tensors.values().filter(|t| t.storage.elem.is_float()).map(|t| t.storage.key.as_str()).collect();
    let mut loaded: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (key, s) in &storages {
        if !wanted.contains(key.as_str()) {
            continue;
        }
        let need = storage_bytes(path, s)?;
        let data = read_entry(path, &mut archive, bytes.len(), &format!("{root}data/{key}"), Some(need))?;
        loaded.insert(key.clone(), data);
    }
    materialise(path, bytes.len(), found, |s| {
        loaded.get(&s.key).map(Vec::as_slice).ok_or_else(|| bad(path, format!("storage `{}` was not read", s.key)))
    })
}

/// The bytes of entry `name`: its first `need` bytes when given (the entry must hold them), else
/// all of it. Entries must be stored uncompressed, as torch.save writes them, so a size is
/// checked against the archive's own bytes before anything is allocated.
fn read_entry(path: &Path, archive: &mut Archive, archive_len: usize, name: &str, need: Option<usize>) -> Result<Vec<u8>> {
    let mut file = archive.by_name(name).map_err(|e| bad(path, format!("entry `{name}`: {e}")))?;
    let size = file.size();
    if file.compression() != ::zip::CompressionMethod::Stored {
        return Err(bad(path, format!("entry `{name}` is compressed ({}); torch.save stores entries uncompressed", file.compression())));
    }
    if size > archive_len as u64 {
        return Err(bad(
            path,
            format!("entry `{name}` claims {size} bytes, more than the whole archive's {archive_len} (corrupt archive)"),
        ));
    }
    if size > file.compressed_size() {
        return Err(bad(path, format!("entry `{name}` claims {size} bytes but stores {} (corrupt archive)", file.compressed_size())));
    }
    let want = match need {
        Some(n) if (n as u64) > size => {
            return Err(bad(path, format!("entry `{name}` holds {size} bytes, but its storage needs {n} (truncated or corrupt)")))
        }
        Some(n) => n,
        None => usize::try_from(size).map_err(|_| bad(path, format!("entry `{name}` is too large")))?,
    };
    let mut out = Vec::new();
    out.try_reserve_exact(want).map_err(|_| Error::OutOfMemory { what: format!("entry `{name}` of {}", path.display()), bytes: want })?;
    (&mut file).take(want as u64).read_to_end(&mut out).map_err(|e| bad(path, format!("entry `{name}`: {e}")))?;
    if out.len() != want {
        return Err(bad(path, format!("entry `{name}` ends after {} of {want} bytes (truncated or corrupt)", out.len())));
    }
    Ok(out)
}
