//! The compile-fail cases in `tests/ui`: each `#[derive(Module)]` misuse there must be reported
//! with the message and at the token that its `.stderr` file records (rustc's rendering: `error:
//! <message>`, then ` --> <file>:<line>:<column>` and a `^^^` underline of the token).
//!
//! The derive runs here on the case's own tokens, with real line and column spans (proc-macro2's
//! `span-locations`), so the check takes milliseconds and needs no compiler run. A case whose
//! recorded error is rustc's own (`error[E0308]`, a config expression of the wrong type) must expand,
//! and the expansion must carry the recorded token with its own span, which is where rustc then
//! points. After changing a message on purpose, edit the `.stderr` file beside its case.

use crate::module::expand;
use std::path::Path;

/// One error as the user sees it: the message, where the token starts (1-based line and column),
/// and how many columns the underline covers.
#[derive(Debug, PartialEq)]
struct Reported {
    message: String,
    line: usize,
    column: usize,
    width: usize,
}

/// The errors the derive reports for every `#[derive(Module)]` item of a case, in source order,
/// and the tokens of the expansions (with their spans) where the derive accepted the item.
fn derive_errors(source: &str) -> (Vec<Reported>, Vec<Reported>) {
    let file = syn::parse_file(source).expect("the case parses as Rust");
    let derives =
        |attrs: &[syn::Attribute]| attrs.iter().any(|a| a.path().is_ident("derive") && quote::quote!(#a).to_string().contains("Module"));
    let (mut out, mut expanded) = (Vec::new(), Vec::new());
    for item in file.items {
        let tokens = match &item {
            syn::Item::Struct(s) if derives(&s.attrs) => quote::quote!(#s),
            syn::Item::Enum(e) if derives(&e.attrs) => quote::quote!(#e),
            syn::Item::Union(u) if derives(&u.attrs) => quote::quote!(#u),
            _ => continue,
        };
        let input: syn::DeriveInput = syn::parse2(tokens).expect("a derive input");
        match expand(&input) {
            Ok(tokens) => tokens_of(tokens, &mut expanded),
            Err(errors) => out.extend(errors.into_iter().map(|e| at(e.to_string(), e.span()))),
        }
    }
    (out, expanded)
}

fn at(message: String, span: proc_macro2::Span) -> Reported {
    let (start, end) = (span.start(), span.end());
    let width = if end.line == start.line { end.column - start.column } else { usize::MAX };
    Reported { message, line: start.line, column: start.column + 1, width }
}

/// Every token of an expansion, as its text and span.
fn tokens_of(tokens: proc_macro2::TokenStream, out: &mut Vec<Reported>) {
    for t in tokens {
        match t {
            proc_macro2::TokenTree::Group(g) => tokens_of(g.stream(), out),
            t => out.push(at(t.to_string(), t.span())),
        }
    }
}

/// The errors a `.stderr` file records: each `error: ` line (the derive's) or `error[E…]: ` line
/// (rustc's, recorded with an empty message), its ` --> ` location and the number of `^` under the
/// token.
fn recorded_errors(stderr: &str, case: &str) -> Vec<Reported> {
    let mut out = Vec::new();
    let mut lines = stderr.lines().peekable();
    while let Some(l) = lines.next() {
        let message = match l.strip_prefix("error") {
            Some(m) if m.starts_with(": ") => &m[2..],
            Some(m) if m.starts_with('[') => "",
            _ => continue,
        };
        let at = lines.next().and_then(|l| l.trim_start().strip_prefix("--> ")).unwrap_or_else(|| panic!("{case}: no `-->` after `{l}`"));
        let mut parts = at.rsplitn(3, ':');
        let column = parts.next().and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("{case}: column in `{at}`"));
        let line = parts.next().and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("{case}: line in `{at}`"));
        let width = lines.by_ref().find(|l| l.contains('^')).map_or(0, |l| l.chars().filter(|&c| c == '^').count());
        out.push(Reported { message: message.to_string(), line, column, width });
    }
    out
}

#[test]
fn derive_module_misuse_is_reported_at_the_right_token() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ui");
    let mut cases: Vec<_> = std::fs::read_dir(&dir).expect("tests/ui").map(|e| e.expect("entry").path()).collect();
    cases.retain(|p| p.extension().is_some_and(|e| e == "rs"));
    cases.sort();
    assert!(cases.len() >= 5, "the compile-fail cases are in {}", dir.display());
    for case in &cases {
        let name = case.file_name().expect("name").to_string_lossy().into_owned();
        let source = std::fs::read_to_string(case).expect("case");
        let stderr = std::fs::read_to_string(case.with_extension("stderr")).unwrap_or_else(|_| panic!("{name} has no .stderr"));
        let ((got, expanded), recorded) = (derive_errors(&source), recorded_errors(&stderr, &name));
        assert!(!recorded.is_empty(), "{name}: its .stderr records no error");
        let (rustc, derive): (Vec<Reported>, Vec<Reported>) = recorded.into_iter().partition(|r| r.message.is_empty());
        assert_eq!(got, derive, "{name}: the derive's errors");
        for r in &rustc {
            let carried = expanded.iter().any(|t| (t.line, t.column, t.width) == (r.line, r.column, r.width));
            assert!(carried, "{name}: rustc's error at {}:{} needs a token there in the expansion", r.line, r.column);
        }
        println!("{name}: {} error(s) of the derive and {} of rustc, each at its recorded token", derive.len(), rustc.len());
    }
}
