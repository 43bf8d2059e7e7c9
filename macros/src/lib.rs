//! Derive macros for Kiln. Thin entry points only; each derive lives in its own module.
//!
//! Misuse is reported as a compile error pointing at the offending token (the cases in `tests/ui`,
//! each with the message and location rustc shows, are checked by `ui_cases`).

use proc_macro::TokenStream;
use syn::{parse_macro_input, DeriveInput};

mod module;
#[cfg(test)]
mod ui_cases;

/// Implements `kiln::Module` for a struct of modules: each field loads from `vb.pp("<field>")`.
///
/// ```ignore
/// #[derive(Module)]
/// #[module(config = BlockConfig)]               // `Module::Config` (default `()`), `cfg` below
/// struct Block {
///     #[module(config = Conv2dConfig::new(cfg.cin, cfg.cout, 3).padding(1))]
///     conv1: Conv2d,                            // loads `conv1.*`
///     relu: ReLU,                               // config `Default::default()`
///     #[module(name = "0")]
///     first: Conv2d,                            // loads `0.*`
///     #[module(when = cfg.stride != 1, config = ...)]
///     downsample: Option<Downsample>,           // loaded only when true, else `None`
///     #[module(len = cfg.depth, config = BlockConfig::new(if i == 0 { 64 } else { 128 }))]
///     blocks: Vec<Block>,                       // element `i` loads `blocks.<i>.*`
/// }
/// ```
///
/// `forward` stays an ordinary method: every leaf layer keeps the `VarBuilder` path it was loaded
/// from, which is the module path its traced nodes carry.
#[proc_macro_derive(Module, attributes(module))]
pub fn derive_module(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    module::expand(&input).unwrap_or_else(syn::Error::into_compile_error).into()
}
