//! Property tests over the PyTorch checkpoint reader (`kiln::files::read_pth`), as tests/fuzz.rs does for the
//! other file decoders: mutated bytes of both formats, pickles generated from opcode fragments,
//! and tensors with generated sizes, strides and offsets. Every case must give `Ok` or a typed
//! `Err`; a panic (or an abort from an allocation) fails the test.

use kiln::files::decode_pth;
use kiln::Error;
use proptest::prelude::*;
use proptest::test_runner::Config;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

mod byte_edits;
use byte_edits::{edit, Edit};

const CASES: u32 = 10_000;

fn config() -> Config {
    Config { cases: CASES, failure_persistence: None, ..Config::default() }
}

fn fixture(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pth").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn path() -> PathBuf {
    PathBuf::from("fuzz.pth")
}

/// Opcode fragments with their arguments: containers, numbers (small, negative, huge), the
/// strings and globals a state_dict names, memo traffic, and globals that must be refused.
fn fragments() -> Vec<&'static [u8]> {
    vec![
        b"(",
        b"t",
        b"\x85",
        b"\x86",
        b"\x87",
        b"}",
        b"]",
        b")",
        b"u",
        b"s",
        b"e",
        b"a",
        b"R",
        b"b",
        b"Q",
        b"N",
        b"\x88",
        b"\x89",
        b"0",
        b"1",
        b"2",
        b".",
        b"K\x00",
        b"K\x03",
        b"K\xff",
        b"J\xff\xff\xff\xff",
        b"J\xff\xff\xff\x7f",
        b"M\xff\xff",
        b"\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f",
        b"\x8a\x01\xff",
        b"\x8b\xff\xff\xff\xff",
        b"X\x07\x00\x00\x00storage",
        b"X\x01\x00\x00\x000",
        b"X\x03\x00\x00\x00cpu",
        b"X\x01\x00\x00\x00w",
        b"X\x0a\x00\x00\x00state_dict",
        b"X\xff\xff\xff\xff",
        b"\x8c\x01w",
        b"\x8d\xff\xff\xff\xff\xff\xff\xff\xff",
        b"ctorch._utils\n_rebuild_tensor_v2\n",
        b"ctorch._utils\n_rebuild_parameter\n",
        b"ctorch\nFloatStorage\n",
        b"ctorch\nHalfStorage\n",
        b"ctorch\nLongStorage\n",
        b"ccollections\nOrderedDict\n",
        b"cos\nsystem\n",
        b"\x93",
        b"q\x00",
        b"q\x07",
        b"h\x00",
        b"h\x07",
        b"r\xff\xff\xff\xff",
        b"j\xff\xff\xff\xff",
        b"\x94",
        b"\x95\x00\x00\x00\x00\x00\x00\x00\x00",
        b"\x80\x02",
        b"\x80\x09",
        b"G\x00\x00\x00\x00\x00\x00\x00\x00",
        b"I12\n",
        b"Ixyz\n",
    ]
}

fn apply(mut bytes: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        match e {
            Edit::Set(at, b) if !bytes.is_empty() => {
                let at = at % bytes.len();
                bytes[at] = *b;
            }
            Edit::Truncate(n) => bytes.truncate(n % (bytes.len() + 1)),
            Edit::Append(extra) => bytes.extend(extra),
            Edit::Splice(at, s) if !bytes.is_empty() => {
                let at = at % bytes.len();
                for (i, b) in s.iter().enumerate() {
                    if let Some(slot) = bytes.get_mut(at + i) {
                        *slot = *b;
                    }
                }
            }
            _ => {}
        }
    }
    bytes
}

/// The zip fixture's entries, with `data.pkl` replaced by `pickle`, as a new stored archive (so
/// the mutations reach the unpickler instead of failing the archive's checksums).
fn rezip(pickle: &[u8]) -> Vec<u8> {
    let original = fixture("tiny.zip.pth");
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(&original[..])).expect("fixture zip");
    let mut out = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let options = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for i in 0..archive.len() {
        let mut file = archive.by_index(i).expect("entry");
        let name = file.name().expect("entry name").to_string();
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).expect("read");
        out.start_file(name.as_str(), options).expect("start");
        out.write_all(if name.ends_with("data.pkl") { pickle } else { &bytes }).expect("write");
    }
    out.finish().expect("finish").into_inner()
}

fn zip_pickle() -> Vec<u8> {
    let original = fixture("tiny.zip.pth");
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(&original[..])).expect("fixture zip");
    let mut file = archive.by_name("tiny.zip/data.pkl").expect("data.pkl");
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).expect("read");
    bytes
}

/// The legacy fixture's first three pickles (magic, protocol, sys_info), then `object`, then
/// the key list `["0"]` and storage "0": `count` f32 values (its element count says `claimed`).
fn legacy(object: &[u8], claimed: u64, count: usize) -> Vec<u8> {
    let tiny = fixture("tiny.legacy.pth");
    // sys_info ends at the third STOP of the fixture's header pickles (offset 137 in torch 2.x).
    let header_end = tiny.windows(2).position(|w| w == b".\x80").and_then(|a| {
        let b = a + 1 + tiny[a + 1..].windows(2).position(|w| w == b".\x80")?;
        Some(b + 1 + tiny[b + 1..].windows(2).position(|w| w == b".\x80")? + 1)
    });
    let mut out = tiny[..header_end.expect("three header pickles")].to_vec();
    out.extend_from_slice(object);
    out.extend_from_slice(b"\x80\x02]X\x01\x00\x00\x000a.");
    out.extend(claimed.to_le_bytes());
    out.extend((0..count).flat_map(|i| (i as f32).to_le_bytes()));
    out
}

/// `{"w": _rebuild_tensor_v2(storage(ty, "0", numel), offset, shape, stride, False, OrderedDict())}`.
fn tensor_pickle(ty: &str, numel: u64, offset: u64, shape: &[u64], stride: &[u64]) -> Vec<u8> {
    let int = |v: u64| {
        let mut b = vec![0x8a, 8];
        b.extend(v.to_le_bytes());
        b
    };
    let tuple = |vs: &[u64]| {
        let mut b = vec![b'('];
        for &v in vs {
            b.extend(int(v));
        }
        b.push(b't');
        b
    };
    let mut p = b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storagectorch\n".to_vec();
    p.extend(ty.as_bytes());
    p.extend(b"\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpu");
    p.extend(int(numel));
    p.extend(b"NtQ");
    p.extend(int(offset));
    p.extend(tuple(shape));
    p.extend(tuple(stride));
    p.extend(b"\x89ccollections\nOrderedDict\n)RtRs.");
    p
}

/// Any outcome but a panic is fine; a refused global must be one the fragments named.
fn check(bytes: &[u8]) {
    match decode_pth(&path(), bytes) {
        Ok(c) => {
            for t in c.tensors.values() {
                assert_eq!(kiln::dev::numel(&t.shape), Some(t.data.len()));
            }
        }
        Err(Error::CheckpointGlobal { global, .. }) => assert!(global == "os.system" || global.contains('.'), "{global}"),
        Err(_) => {}
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn legacy_checkpoints_with_mutated_bytes_never_panic(edits in prop::collection::vec(edit(fragments()), 1..6)) {
        check(&apply(fixture("mixed.legacy.pt"), &edits));
    }

    #[test]
    fn zip_checkpoints_with_mutated_bytes_never_panic(edits in prop::collection::vec(edit(fragments()), 1..6)) {
        check(&apply(fixture("mixed.zip.pt"), &edits));
    }

    #[test]
    fn zip_checkpoints_with_mutated_pickles_never_panic(edits in prop::collection::vec(edit(fragments()), 1..6)) {
        check(&rezip(&apply(zip_pickle(), &edits)));
    }

    #[test]
    fn generated_pickles_never_panic(
        parts in prop::collection::vec(prop::sample::select(fragments()), 0..40),
        claimed in prop_oneof![3 => 0u64..16, 1 => any::<u64>()],
        count in 0usize..16,
    ) {
        let object: Vec<u8> = parts.concat();
        check(&legacy(&object, claimed, count));
    }

    #[test]
    fn generated_tensors_never_panic(
        ty in prop::sample::select(vec!["FloatStorage", "HalfStorage", "BFloat16Storage", "LongStorage", "QInt8Storage"]),
        numel in prop_oneof![4 => 0u64..32, 1 => any::<u64>(), 1 => Just(1u64 << 62)],
        offset in prop_oneof![4 => 0u64..8, 1 => any::<u64>()],
        dims in prop::collection::vec((prop_oneof![4 => 0u64..5, 1 => any::<u64>()], prop_oneof![4 => 0u64..8, 1 => any::<u64>()]), 0..4),
        stored in 0usize..32,
    ) {
        let (shape, stride): (Vec<u64>, Vec<u64>) = dims.into_iter().unzip();
        let object = tensor_pickle(ty, numel, offset, &shape, &stride);
        check(&legacy(&object, numel, stored));
        check(&legacy(&object, stored as u64, stored));
    }
}

/// The hand-written tensor pickle reads back, so the generated cases start from a valid file.
#[test]
fn generated_tensor_pickle_is_valid() {
    let object = tensor_pickle("FloatStorage", 6, 1, &[2, 2], &[1, 2]);
    let c = decode_pth(&path(), &legacy(&object, 6, 6)).expect("valid");
    // Storage 0..6, offset 1, strides (1, 2): [[1, 3], [2, 4]].
    assert_eq!(c.tensors["w"].data, [1.0, 3.0, 2.0, 4.0]);
    decode_pth(&path(), &rezip(&zip_pickle())).expect("the rebuilt zip is valid");
}
