//! Derive macros for Kiln. Thin entry points only.
use proc_macro::TokenStream;

#[proc_macro_derive(Module, attributes(module))]
pub fn derive_module(_input: TokenStream) -> TokenStream {
    TokenStream::new()
}
