//! Empty: a build script makes Cargo build the `[build-dependencies]` above with the proc-macros'
//! feature set, so that they unify with the proc-macros' own.
fn main() {}
