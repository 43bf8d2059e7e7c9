//! The byte-level mutations that the file fuzzers (tests/fuzz_pth.rs, tests/fuzz_inputs.rs) apply
//! to a valid file; each fuzzer decides where an edit lands.
#![allow(dead_code)]

use proptest::prelude::*;

/// One mutation of a file's bytes.
#[derive(Debug, Clone)]
pub enum Edit {
    Set(usize, u8),
    Truncate(usize),
    Append(Vec<u8>),
    /// Overwrite with a fragment of what the format's headers are made of.
    Splice(usize, &'static [u8]),
}

/// Edits, weighted towards setting bytes and splicing in `fragments`.
pub fn edit(fragments: Vec<&'static [u8]>) -> impl Strategy<Value = Edit> {
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Edit::Set(at, b)),
        1 => any::<usize>().prop_map(Edit::Truncate),
        1 => prop::collection::vec(any::<u8>(), 1..16).prop_map(Edit::Append),
        3 => (any::<usize>(), prop::sample::select(fragments)).prop_map(|(at, s)| Edit::Splice(at, s)),
    ]
}
