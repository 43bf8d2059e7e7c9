//! The pickle machine's bounds (`pickle::Bounds`) against large generated pickles: long runs of
//! one opcode, deep nesting, many open marks, a full memo, and random mixes of long runs. Each
//! must end in `Ok` or a typed error, a bound's error naming the byte of the opcode that passed it.

use super::decode_pth;
use super::pickle::{Bounds, Unpickler};
use crate::Error;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;

/// A protocol-2 pickle: `PROTO 2`, `body`, `STOP`.
fn pickle(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 3);
    out.extend_from_slice(b"\x80\x02");
    out.extend_from_slice(body);
    out.push(b'.');
    out
}

/// `body` repeated `n` times.
fn run(body: &[u8], n: usize) -> Vec<u8> {
    body.repeat(n)
}

/// The bound and byte offset of a `PickleLimit`, or a panic naming what came instead.
fn limit_of(result: crate::Result<impl std::fmt::Debug>) -> (&'static str, usize) {
    match result {
        Err(Error::PickleLimit { bound, offset, .. }) => (bound, offset),
        other => panic!("expected a PickleLimit, got {other:?}"),
    }
}

fn unpickle(bytes: &[u8]) -> crate::Result<()> {
    Unpickler::new(Path::new("bounds.pth"), bytes, 0).run(&mut BTreeMap::new()).map(|_| ())
}

/// The repro: `\x80\x02` + 50,000,000 `]` + `.` (took 2.2 GB for 20 MB, and aborted at
/// 50 MB) stops at the stack bound, at the byte of the first `]` that would pass it.
#[test]
fn fifty_million_empty_lists_stop_at_the_stack_bound() {
    let bytes = pickle(&run(b"]", 50_000_000));
    let e = decode_pth(Path::new("deep.pth"), &bytes).expect_err("50 M lists");
    assert!(e.to_string().contains(&format!("at byte {}", 2 + Bounds::STACK)), "{e}");
    assert!(e.to_string().contains("deep.pth"), "{e}");
    assert_eq!(limit_of(Err::<(), _>(e)), ("values on the stack", 2 + Bounds::STACK));
}

#[test]
fn deep_nesting_stops_at_the_nesting_bound() {
    // TUPLE1 around TUPLE1 ...: the tuple at depth NESTING + 1 is refused.
    let bytes = pickle(&[&b")"[..], &run(b"\x85", 1 << 20)].concat());
    assert_eq!(limit_of(unpickle(&bytes)), ("levels of nesting", 3 + Bounds::NESTING - 1));
    // Lists appended into lists (APPEND): the k-th append makes depth k + 1.
    let lists = pickle(&[run(b"]", 200), run(b"a", 199)].concat());
    assert_eq!(limit_of(unpickle(&lists)), ("levels of nesting", 2 + 200 + Bounds::NESTING - 1));
    // Dicts set into dicts (SETITEM): `}` `K\x01` (a key) a hundred times, a last `}`, then
    // `s` a hundred times sets each dict as the value of the one below it.
    let mut dicts = run(b"}K\x01", 100);
    dicts.push(b'}');
    dicts.extend_from_slice(&run(b"s", 100));
    assert_eq!(limit_of(unpickle(&pickle(&dicts))).0, "levels of nesting");
    // A list appended to itself through the memo (a cycle) deepens at every append.
    let cycle = pickle(&[&b"]q\x00"[..], &run(b"h\x00a", 1000)].concat());
    assert_eq!(limit_of(unpickle(&cycle)).0, "levels of nesting");
    // As deep as the bound: accepted.
    let ok = pickle(&[&b")"[..], &run(b"\x85", Bounds::NESTING - 1)].concat());
    unpickle(&ok).expect("nesting at the bound");
}

#[test]
fn open_marks_stop_at_the_mark_bound() {
    let bytes = pickle(&run(b"(", 1_000_000));
    assert_eq!(limit_of(unpickle(&bytes)), ("marks open at once", 2 + Bounds::MARKS));
    // MARK, then a tuple of nothing, closed, a million times: never more than one open.
    let balanced = pickle(&[&run(b"(t0", 1_000_000)[..], b"N"].concat());
    unpickle(&balanced).expect("one mark at a time");
}

#[test]
fn the_memo_stops_at_the_memo_bound() {
    // One value, memoised under MEMO + 1 new indices.
    let bytes = pickle(&[&b"N"[..], &run(b"\x94", Bounds::MEMO + 10)].concat());
    assert_eq!(limit_of(unpickle(&bytes)), ("memo entries", 3 + Bounds::MEMO));
    // The same index stored over and over is one entry.
    let same = pickle(&[&b"N"[..], &run(b"q\x07", Bounds::MEMO + 10)].concat());
    unpickle(&same).expect("one memo entry");
}

#[test]
fn a_long_run_of_opcodes_stops_at_the_opcode_bound() {
    // `N` then `0` (push None, pop it): the stack never grows, only the count.
    let bytes = pickle(&[&run(b"N0", Bounds::OPCODES / 2 + 10)[..], b"N"].concat());
    // PROTO is opcode 1 at byte 0 (2 bytes long); opcode k >= 2 starts at byte k.
    assert_eq!(limit_of(unpickle(&bytes)), ("opcodes", Bounds::OPCODES + 1));
}

/// What torch.save writes, scaled up: a dict of 200,000 keys set in batches of 1,000 (about
/// 1.2 M opcodes, 400,000 memo entries) unpickles within every bound.
#[test]
fn a_large_state_dict_shaped_pickle_stays_within_the_bounds() {
    let mut body = b"}q\x00(".to_vec();
    for i in 0..200_000u32 {
        let key = format!("layer{i}.weight");
        body.push(0x8c);
        body.push(key.len() as u8);
        body.extend_from_slice(key.as_bytes());
        body.push(0x94);
        body.extend_from_slice(b"J");
        body.extend_from_slice(&i.to_le_bytes());
        body.push(0x94);
        if i % 1000 == 999 {
            body.extend_from_slice(b"u(");
        }
    }
    body.push(b'u');
    unpickle(&pickle(&body)).expect("within the bounds");
}

/// Runs of one fragment each, up to 2^21 repeats: the generator of the fuzz target below.
fn runs() -> impl Strategy<Value = Vec<u8>> {
    let fragments: Vec<&'static [u8]> = vec![
        b"(",
        b"t",
        b"\x85",
        b"\x86",
        b"}",
        b"]",
        b")",
        b"u",
        b"s",
        b"e",
        b"a",
        b"N",
        b"0",
        b"1",
        b"2",
        b"K\x01",
        b"\x94",
        b"h\x00",
        b"q\x00",
        b"l",
        b"d",
        b"\x8c\x01k",
        b"\x8f",
        b"\x90",
    ];
    let run = (proptest::sample::select(fragments), 1usize..(1 << 21));
    proptest::collection::vec(run, 1..12).prop_map(|runs| {
        let mut body = Vec::new();
        for (fragment, n) in runs {
            body.extend_from_slice(&fragment.repeat(n));
        }
        pickle(&body)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    /// Large generated pickles (long runs of containers, marks, memo traffic and pops, megabytes
    /// each) end in `Ok` or a typed error; a bound's error points inside the file.
    #[test]
    fn large_generated_pickles_end_in_ok_or_a_typed_error(bytes in runs()) {
        match decode_pth(Path::new("generated.pth"), &bytes) {
            Err(Error::PickleLimit { offset, .. }) => prop_assert!(offset < bytes.len()),
            Ok(_) | Err(Error::Checkpoint { .. }) | Err(Error::CheckpointGlobal { .. }) => {}
            Err(other) => prop_assert!(false, "untyped error: {other}"),
        }
    }
}
