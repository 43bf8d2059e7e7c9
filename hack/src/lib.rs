//! No code: see Cargo.toml. Depending on this crate gives every shared dependency one feature set.
