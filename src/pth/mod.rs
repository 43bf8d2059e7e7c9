//! PyTorch checkpoints (`torch.save`, `.pth`/`.pt`), read without running any of their code.
//!
//! Two containers:
//! - the zip archive (PyTorch ≥ 1.6): `<root>/data.pkl` is the pickled object, each storage is the
//!   raw little-endian bytes of `<root>/data/<key>`;
//! - the legacy stream: five pickles one after another (the magic number, the protocol version,
//!   `sys_info`, the object itself, the list of storage keys), then each storage as an 8-byte
//!   element count and its raw bytes, in the order of that list.
//!
//! In both, a tensor is `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`
//! over a storage named by a persistent id `("storage", torch.FloatStorage, key, location,
//! numel[, view])`. The unpickler here knows only the globals such a state_dict needs (the
//! rebuild functions, the storage types, `collections.OrderedDict`); any other global is an
//! `Error::CheckpointGlobal` naming it, raised as soon as the pickle names it. Sizes from the file
//! are checked before anything is allocated, and every read is bounds-checked. The pickle machine
//! itself is bounded (opcodes, stack, memo, open marks, nesting: `pickle::Bounds`, sized for
//! torch.save's state_dicts); passing a bound is an `Error::PickleLimit` naming the byte offset.

mod legacy;
mod pickle;
mod tensors;
mod zip;

use crate::graph::HostTensor;
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// The tensors of a checkpoint's state_dict, by key.
#[derive(Clone, Debug, Default)]
pub struct Checkpoint {
    /// f32, f16 and bf16 tensors, as f32.
    pub tensors: BTreeMap<String, HostTensor>,
    /// Tensors of other dtypes (`num_batches_tracked` is int64), with their dtype's name (`I64`).
    pub other: BTreeMap<String, String>,
    /// The key of the checkpoint's dict the state_dict was read from (`state_dict`, `model`,
    /// `model_state_dict`), `None` for a bare state_dict.
    pub under: Option<String>,
    /// Other keys of those that hold different tensors, not read.
    pub unread: Vec<String>,
}

impl Checkpoint {
    /// How errors name these weights: the file, and the key they were read from when nested
    /// (`ckpt.pth's `state_dict` (`model` holds other tensors, not read)`).
    pub fn source_name(&self, path: &Path) -> String {
        let file = path.display();
        match (&self.under, self.unread.as_slice()) {
            (None, _) => file.to_string(),
            (Some(key), []) => format!("{file}'s `{key}`"),
            (Some(key), unread) => format!(
                "{file}'s `{key}` ({} also hold(s) tensors, not read: Kiln reads the first of {}; save the one you mean alone)",
                unread.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", "),
                tensors::NESTED.map(|k| format!("`{k}`")).join(", "),
            ),
        }
    }
}

/// Whether `bytes` start like `torch.save` output: a zip archive or a pickle (protocol ≥ 2).
pub fn looks_like_checkpoint(bytes: &[u8]) -> bool {
    is_zip(bytes) || bytes.first() == Some(&0x80)
}

/// Whether `bytes` start like a zip archive: a member's local header, or the end record alone
/// (an empty archive).
fn is_zip(bytes: &[u8]) -> bool {
    bytes.starts_with(b"PK\x03\x04") || bytes.starts_with(b"PK\x05\x06")
}

/// Reads the state_dict of the checkpoint at `path`: a bare state_dict, or a dict holding one
/// under `state_dict`, `model` or `model_state_dict`.
pub fn read_pth(path: impl AsRef<Path>) -> Result<Checkpoint> {
    let path = path.as_ref();
    // Mapped, not read: only the pickle and the storages of the tensors decoded are touched, and a
    // checkpoint larger than memory costs no more than its tensors.
    let bytes =
        crate::host::map_regular(path, "the path of a PyTorch checkpoint", |reason| Error::Checkpoint { path: path.into(), reason })?;
    decode_pth(path, &bytes)
}

/// `read_pth` on a checkpoint already in memory; `path` names it in errors.
pub fn decode_pth(path: &Path, bytes: &[u8]) -> Result<Checkpoint> {
    if is_zip(bytes) {
        self::zip::decode_zip(path, bytes)
    } else {
        legacy::decode_legacy(path, bytes)
    }
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint { path: path.to_path_buf(), reason: reason.into() }
}

// ---- storages and tensors ------------------------------------------------------------------

/// A storage type's element: `torch.FloatStorage` holds F32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Elem {
    F32,
    F16,
    BF16,
    F64,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl Elem {
    fn of_storage(name: &str) -> Option<Elem> {
        Some(match name {
            "FloatStorage" => Elem::F32,
            "HalfStorage" => Elem::F16,
            "BFloat16Storage" => Elem::BF16,
            "DoubleStorage" => Elem::F64,
            "LongStorage" => Elem::I64,
            "IntStorage" => Elem::I32,
            "ShortStorage" => Elem::I16,
            "CharStorage" => Elem::I8,
            "ByteStorage" => Elem::U8,
            "BoolStorage" => Elem::Bool,
            _ => return None,
        })
    }
    /// The dtypes Kiln decodes (as f32).
    fn is_float(self) -> bool {
        matches!(self, Elem::F32 | Elem::F16 | Elem::BF16)
    }
    fn size(self) -> usize {
        match self {
            Elem::F64 | Elem::I64 => 8,
            Elem::F32 | Elem::I32 => 4,
            Elem::F16 | Elem::BF16 | Elem::I16 => 2,
            Elem::I8 | Elem::U8 | Elem::Bool => 1,
        }
    }
    /// The safetensors name of the dtype, as `VarBuilder` reports dtypes.
    fn name(self) -> &'static str {
        match self {
            Elem::F32 => "F32",
            Elem::F16 => "F16",
            Elem::BF16 => "BF16",
            Elem::F64 => "F64",
            Elem::I64 => "I64",
            Elem::I32 => "I32",
            Elem::I16 => "I16",
            Elem::I8 => "I8",
            Elem::U8 => "U8",
            Elem::Bool => "BOOL",
        }
    }
}

/// A persistent id's storage: `numel` elements of `elem` under `key`, or a view of `size`
/// elements from `offset` into it (legacy files only).
#[derive(Clone, Debug, PartialEq)]
struct StorageRef {
    elem: Elem,
    key: String,
    numel: usize,
    view: Option<(usize, usize)>,
}

#[derive(Clone, Debug, PartialEq)]
struct TensorRef {
    storage: StorageRef,
    offset: usize,
    shape: Vec<usize>,
    stride: Vec<usize>,
}

#[cfg(test)]
mod bounds_tests;

#[cfg(test)]
mod tests {
    use super::pickle::Unpickler;
    use super::*;
    use crate::VarBuilder;
    use std::path::PathBuf;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pth").join(name)
    }

    fn expected() -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(fixture("expected.json")).expect("expected.json")).expect("json")
    }

    /// Every fixture holds exactly the tensors `tools/make_pth_fixtures.py` saved, bit for bit.
    #[test]
    fn fixtures_match_torch() {
        let expected = expected();
        for (file, tensors) in expected.as_object().expect("object") {
            let c = read_pth(fixture(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
            for (key, want) in tensors.as_object().expect("object") {
                let shape: Vec<usize> = serde_json::from_value(want["shape"].clone()).expect("shape");
                let values: Vec<f32> = serde_json::from_value(want["values"].clone()).expect("values");
                match want["dtype"].as_str().expect("dtype") {
                    "int64" => assert_eq!(c.other.get(key).map(String::as_str), Some("I64"), "{file}: {key}"),
                    _ => {
                        let t = c.tensors.get(key).unwrap_or_else(|| panic!("{file}: {key} missing"));
                        assert_eq!(t.shape, shape, "{file}: {key}");
                        assert_eq!(t.data, values, "{file}: {key}");
                    }
                }
            }
            assert_eq!(c.tensors.len() + c.other.len(), tensors.as_object().expect("object").len(), "{file}");
        }
    }

    #[test]
    fn both_formats_load_into_a_var_builder_strictly() {
        for file in ["tiny.zip.pth", "tiny.legacy.pth", "model.proto4.pth"] {
            let vb = VarBuilder::from_files(&[fixture(file)]).expect(file);
            vb.get(&[4, 3, 3, 3], "conv.weight").expect("conv.weight");
            vb.pp("conv").get(&[4], "bias").expect("conv.bias");
            for name in ["weight", "bias", "running_mean", "running_var"] {
                vb.pp("bn").get(&[4], name).expect(name);
            }
            vb.pp("fc").get(&[2, 4], "weight").expect("fc.weight");
            assert!(vb.check_all_used().is_err(), "{file}: fc.bias is unused");
            vb.pp("fc").get(&[2], "bias").expect("fc.bias");
            vb.check_all_used().expect("only num_batches_tracked is left, which is bookkeeping");
            // An int64 tensor is named with its dtype, not called missing.
            let e = vb.pp("bn").get(&[], "num_batches_tracked").expect_err("int64");
            assert!(matches!(e, Error::WeightDtype { ref got, .. } if got == "I64"), "{e}");
            let e = vb.get(&[4, 3, 3, 3], "missing.weight").expect_err("missing");
            assert!(e.to_string().contains(file), "the error names the file: {e}");
        }
    }

    #[test]
    fn a_foreign_global_is_refused_by_name() {
        let e = read_pth(fixture("args.zip.pth")).expect_err("argparse.Namespace");
        assert!(matches!(e, Error::CheckpointGlobal { ref global, .. } if global == "argparse.Namespace"), "{e}");
        // Hand-made pickles: GLOBAL and STACK_GLOBAL of something that runs code.
        let global = b"\x80\x02cos\nsystem\n(X\x02\x00\x00\x00lst.";
        let e = decode_zipless(global).expect_err("os.system");
        assert!(matches!(e, Error::CheckpointGlobal { ref global, .. } if global == "os.system"), "{e}");
        let stack = b"\x80\x04\x8c\x08builtins\x8c\x04eval\x93.";
        let e = decode_zipless(stack).expect_err("builtins.eval");
        assert!(matches!(e, Error::CheckpointGlobal { ref global, .. } if global == "builtins.eval"), "{e}");
    }

    /// A legacy stream whose object pickle is `object` (the real first three pickles before it).
    fn decode_zipless(object: &[u8]) -> Result<Checkpoint> {
        let legacy = std::fs::read(fixture("tiny.legacy.pth")).expect("fixture");
        let mut u = Unpickler::new(Path::new("x"), &legacy, 0);
        for _ in 0..3 {
            u.run(&mut BTreeMap::new()).expect("header pickles");
            u = Unpickler::new(Path::new("x"), &legacy, u.pos);
        }
        let mut bytes = legacy[..u.pos].to_vec();
        bytes.extend_from_slice(object);
        decode_pth(Path::new("hand-made.pth"), &bytes)
    }

    #[test]
    fn every_truncation_is_an_error() {
        for file in ["tiny.legacy.pth", "mixed.legacy.pt", "tiny.zip.pth"] {
            let bytes = std::fs::read(fixture(file)).expect(file);
            decode_pth(Path::new(file), &bytes).expect(file);
            for n in 0..bytes.len() {
                assert!(decode_pth(Path::new(file), &bytes[..n]).is_err(), "{file} cut to {n} bytes");
            }
        }
    }

    #[test]
    fn a_tensor_past_its_storage_is_an_error() {
        // {"w": _rebuild_tensor_v2(storage(FloatStorage, "0", 2 elements), 1, (2,), (1,), False, OrderedDict())}
        let object = b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02NtQK\x01K\x02\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtRs.";
        let mut tail = b"\x80\x02]X\x01\x00\x00\x000a.".to_vec();
        tail.extend(2u64.to_le_bytes());
        tail.extend([1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()));
        let mut good = object.to_vec();
        good.extend(&tail);
        let e = decode_zipless(&good).expect_err("offset 1 + 2 elements > 2");
        assert!(e.to_string().contains("reach past its storage"), "{e}");
        // The same tensor at offset 0 reads.
        let mut fixed = good.clone();
        let at = fixed.windows(4).position(|w| w == b"QK\x01K").expect("offset") + 2;
        fixed[at] = 0;
        let c = decode_zipless(&fixed).expect("in range");
        assert_eq!(c.tensors["w"].data, [1.0, 2.0]);
    }

    /// `{"state_dict": {"w": T}, "model": {"v": T}}` as the object pickle of a legacy stream,
    /// with T a 2-element tensor, then the storage list and the storage.
    fn two_state_dicts() -> Vec<u8> {
        let tensor: &[u8] = b"ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x02NtQK\x00K\x02\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR";
        let mut object = b"\x80\x02}(X\x0a\x00\x00\x00state_dict}X\x01\x00\x00\x00w".to_vec();
        object.extend_from_slice(tensor);
        object.extend_from_slice(b"sX\x05\x00\x00\x00model}X\x01\x00\x00\x00v");
        object.extend_from_slice(tensor);
        object.extend_from_slice(b"su.\x80\x02]X\x01\x00\x00\x000a.");
        object.extend(2u64.to_le_bytes());
        object.extend([1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()));
        object
    }

    /// A checkpoint holding a state_dict under both `state_dict` and `model` reads the first,
    /// and every error about its weights says which it read and that the other was not.
    #[test]
    fn a_second_state_dict_is_named_in_the_weights_source() {
        let c = decode_zipless(&two_state_dicts()).expect("two state_dicts");
        assert_eq!(c.tensors.keys().collect::<Vec<_>>(), ["w"]);
        assert_eq!((c.under.as_deref(), c.unread.as_slice()), (Some("state_dict"), &["model".to_string()][..]));
        let name = c.source_name(Path::new("both.pth"));
        assert!(name.starts_with("both.pth's `state_dict` (`model` also hold(s) tensors, not read"), "{name}");
        // Through a VarBuilder: the missing weight's message carries it.
        let path = std::env::temp_dir().join(format!("kiln-pth-both-{}.pth", std::process::id()));
        let legacy = std::fs::read(fixture("tiny.legacy.pth")).expect("fixture");
        let mut u = Unpickler::new(Path::new("x"), &legacy, 0);
        for _ in 0..3 {
            u.run(&mut BTreeMap::new()).expect("header pickles");
            u = Unpickler::new(Path::new("x"), &legacy, u.pos);
        }
        std::fs::write(&path, [&legacy[..u.pos], &two_state_dicts()[..]].concat()).expect("write");
        let vb = VarBuilder::from_files(&[&path]).expect("reads");
        let e = vb.get(&[2], "v").expect_err("v is under `model`");
        assert!(e.to_string().contains("`model` also hold(s) tensors, not read"), "{e}");
        std::fs::remove_file(&path).ok();
    }

    /// The zip reader keeps the last of two members of one name; torch.save never writes two,
    /// so an archive naming one twice is refused.
    #[test]
    fn a_zip_naming_one_member_twice_is_refused() {
        let bytes = std::fs::read(fixture("tiny.zip.pth")).expect("fixture");
        decode_pth(Path::new("tiny.zip.pth"), &bytes).expect("the fixture reads");
        let twice = replace_all(&bytes, b"tiny.zip/data/2", b"tiny.zip/data/1");
        let e = decode_pth(Path::new("twice.pth"), &twice).expect_err("data/1 twice");
        assert!(e.to_string().contains("names one member twice"), "{e}");
    }

    fn replace_all(bytes: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
        let mut out = bytes.to_vec();
        let mut at = 0;
        while let Some(i) = out[at..].windows(from.len()).position(|w| w == from) {
            out[at + i..at + i + to.len()].copy_from_slice(to);
            at += i + from.len();
        }
        out
    }

    /// A member whose two declared sizes agree but pass the archive's own size is named as such
    /// (the message used to read "claims 4294967294 bytes but stores 4294967294").
    #[test]
    fn a_member_larger_than_its_archive_is_named_as_such() {
        let mut bytes = std::fs::read(fixture("tiny.zip.pth")).expect("fixture");
        let name = b"tiny.zip/data.pkl";
        let central = bytes
            .windows(4)
            .enumerate()
            .filter(|(_, w)| *w == b"PK\x01\x02")
            .map(|(i, _)| i)
            .find(|&i| bytes[i + 46..].starts_with(name))
            .expect("data.pkl's central header");
        for field in [20, 24] {
            bytes[central + field..central + field + 4].copy_from_slice(&0xffff_fffeu32.to_le_bytes());
        }
        let e = decode_pth(Path::new("big.pth"), &bytes).expect_err("sizes past the archive");
        assert!(e.to_string().contains("claims 4294967294 bytes, more than the whole archive's"), "{e}");
    }

    #[test]
    fn an_empty_zip_is_named_as_one() {
        let empty = [&b"PK\x05\x06"[..], &[0u8; 18]].concat();
        assert!(looks_like_checkpoint(&empty));
        let e = decode_pth(Path::new("empty.pth"), &empty).expect_err("no members");
        assert!(e.to_string().contains("empty.pth: is an empty zip archive"), "{e}");
    }
}
