//! Compile-fail tests of `#[derive(Module)]`: each misuse in `tests/ui/*.rs` must fail to compile
//! with the error recorded beside it in `*.stderr`, pointing at the offending token.
//! (After changing a message on purpose: `TRYBUILD=overwrite cargo test --test derive_ui`.)
//!
//! trybuild type-checks the cases in its own target folder (`target/tests/trybuild`), which the
//! first run fills by checking kiln's dependencies once: 170 s of a 635 s CI run on 2 cores, 15 s
//! afterwards. Kept because spans can only be seen this way; the message texts alone are also
//! unit-tested inside `kiln-macros`, in milliseconds.

#[test]
fn derive_module_misuse_is_a_compile_error_at_the_right_token() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
