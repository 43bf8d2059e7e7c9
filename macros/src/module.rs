//! `#[derive(Module)]`: writes `kiln::Module::load` for a struct whose named fields are modules.
//!
//! The generated `load` is what one would write by hand: `Ok(Self { field: .., .. })` whose
//! initialisers load each field from `vb.pp("<field>")`, in declaration order. Initialisers rather
//! than `let`s, so that a field named `cfg` or `vb` cannot shadow the parameters for later fields.

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::{quote, quote_spanned};
use syn::ext::IdentExt;
use syn::meta::ParseNestedMeta;
use syn::spanned::Spanned;
use syn::{Attribute, Data, DeriveInput, Error, Expr, Field, Fields, GenericArgument, Ident, LitStr, PathArguments, Type};

/// The names the generated `load` binds, which attribute expressions may use.
const CONFIG_VAR: &str = "cfg";
const INDEX_VAR: &str = "i";

pub fn expand(input: &DeriveInput) -> syn::Result<TokenStream> {
    let fields = match &input.data {
        Data::Struct(s) => match &s.fields {
            Fields::Named(named) => &named.named,
            Fields::Unnamed(unnamed) => {
                return Err(Error::new_spanned(
                    unnamed,
                    "`#[derive(Module)]` needs named fields: each field's name is its `state_dict` segment \
                     (for numeric segments such as `0`, name the field and add `#[module(name = \"0\")]`)",
                ))
            }
            Fields::Unit => {
                return Err(Error::new_spanned(
                    &input.ident,
                    "`#[derive(Module)]` needs a struct with named fields (a unit struct loads nothing)",
                ))
            }
        },
        Data::Enum(e) => {
            return Err(Error::new(
                e.enum_token.span,
                "`#[derive(Module)]` supports structs only: an enum has no fixed set of sub-modules to load; \
                 implement `kiln::Module` by hand",
            ))
        }
        Data::Union(u) => return Err(Error::new(u.union_token.span, "`#[derive(Module)]` supports structs only, not unions")),
    };

    let config_ty = struct_config(&input.attrs)?;
    // Collect every field's error so that one build reports all misuses at once.
    let mut specs = Vec::new();
    let mut errors: Option<Error> = None;
    for field in fields {
        match FieldSpec::parse(field) {
            Ok(spec) => specs.push(spec),
            Err(e) => match &mut errors {
                Some(all) => all.combine(e),
                None => errors = Some(e),
            },
        }
    }
    if let Some(e) = errors {
        return Err(e);
    }

    // Name the parameters `_vb` / `_cfg` when nothing reads them, so that a struct whose fields all
    // use default configs compiles without unused-variable warnings in the user's crate.
    let uses_cfg = specs.iter().any(|s| s.exprs().any(|e| mentions(e, CONFIG_VAR)));
    let cfg = Ident::new(if uses_cfg { CONFIG_VAR } else { "_cfg" }, Span::call_site());
    let vb = Ident::new(if specs.is_empty() { "_vb" } else { "vb" }, Span::call_site());

    let inits = specs.iter().map(|s| s.init(&vb));
    let name = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();
    let config_ty = config_ty.map_or_else(|| quote!(()), |ty| quote!(#ty));
    Ok(quote! {
        impl #impl_generics ::kiln::Module for #name #ty_generics #where_clause {
            type Config = #config_ty;
            fn load(#vb: ::kiln::VarBuilder, #cfg: &Self::Config) -> ::kiln::Result<Self> {
                ::core::result::Result::Ok(Self {
                    #(#inits)*
                })
            }
        }
    })
}

/// `#[module(config = Type)]` on the struct.
fn struct_config(attrs: &[Attribute]) -> syn::Result<Option<Type>> {
    let mut config = None;
    for attr in attrs.iter().filter(|a| a.path().is_ident("module")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("config") {
                set_once(&meta, &mut config, meta.value()?.parse::<Type>()?)
            } else {
                Err(unknown_key(&meta, "on a struct the only key is `config = <Type>`"))
            }
        })?;
    }
    Ok(config)
}

struct FieldSpec {
    ident: Ident,
    /// The `state_dict` segment: the field name, or `#[module(name = "..")]`.
    segment: LitStr,
    config: Option<Expr>,
    kind: Kind,
}

enum Kind {
    /// Always loaded.
    One(Type),
    /// `Option<T>` with `when`: `Some` only when the condition holds.
    Optional { inner: Type, when: Expr },
    /// `Vec<T>` with `len`: element `i` loads from `<segment>.<i>`.
    Repeated { elem: Type, len: Expr },
}

impl FieldSpec {
    fn parse(field: &Field) -> syn::Result<Self> {
        let ident = field.ident.clone().expect("named fields have identifiers");
        let (mut config, mut name, mut when, mut len) = (None, None, None::<(Expr, Span)>, None::<(Expr, Span)>);
        for attr in field.attrs.iter().filter(|a| a.path().is_ident("module")) {
            attr.parse_nested_meta(|meta| {
                let key_span = meta.path.span();
                if meta.path.is_ident("config") {
                    set_once(&meta, &mut config, meta.value()?.parse::<Expr>()?)
                } else if meta.path.is_ident("name") {
                    let lit: LitStr = meta.value()?.parse()?;
                    let value = lit.value();
                    if value.is_empty() || value.contains('.') {
                        return Err(Error::new_spanned(&lit, "a `state_dict` segment must be non-empty and contain no `.`"));
                    }
                    set_once(&meta, &mut name, lit)
                } else if meta.path.is_ident("when") {
                    set_once(&meta, &mut when, (meta.value()?.parse::<Expr>()?, key_span))
                } else if meta.path.is_ident("len") {
                    set_once(&meta, &mut len, (meta.value()?.parse::<Expr>()?, key_span))
                } else {
                    Err(unknown_key(&meta, "expected `config`, `name`, `when` or `len`"))
                }
            })?;
        }

        let ty = &field.ty;
        let shown = show(ty);
        let kind = match (when, len, wrapped(ty, "Option"), wrapped(ty, "Vec")) {
            (Some(_), Some((_, span)), ..) => return Err(Error::new(span, "`when` and `len` cannot be combined on one field")),
            (Some((when, _)), None, Some(inner), _) => Kind::Optional { inner: inner.clone(), when },
            (Some((_, span)), None, None, _) => {
                return Err(Error::new(span, format!("`when` applies to `Option<_>` fields, but `{ident}` has type `{shown}`")))
            }
            (None, Some((len, _)), _, Some(elem)) => Kind::Repeated { elem: elem.clone(), len },
            (None, Some((_, span)), _, None) => {
                return Err(Error::new(span, format!("`len` applies to `Vec<_>` fields, but `{ident}` has type `{shown}`")))
            }
            (None, None, Some(_), _) => {
                return Err(Error::new_spanned(ty, format!("`Option<_>` field `{ident}` needs `#[module(when = <bool expression>)]`")))
            }
            (None, None, _, Some(_)) => {
                return Err(Error::new_spanned(ty, format!("`Vec<_>` field `{ident}` needs `#[module(len = <usize expression>)]`")))
            }
            (None, None, None, None) => Kind::One(ty.clone()),
        };
        let segment = name.unwrap_or_else(|| LitStr::new(&ident.unraw().to_string(), ident.span()));
        Ok(Self { ident, segment, config, kind })
    }

    /// The attribute expressions, in which `cfg` (and `i` for `Vec` fields) may appear.
    fn exprs(&self) -> impl Iterator<Item = &Expr> {
        let extra = match &self.kind {
            Kind::One(_) => None,
            Kind::Optional { when: e, .. } | Kind::Repeated { len: e, .. } => Some(e),
        };
        self.config.iter().chain(extra)
    }

    /// `<field>: <load>?,`
    fn init(&self, vb: &Ident) -> TokenStream {
        let (ident, segment) = (&self.ident, &self.segment);
        // `&Default::default()` infers the field's own `Config`; an expression given by the user is
        // parenthesised only where `&` would otherwise bind tighter than it.
        // Spans: a type error in a config is reported at the user's expression, and a field type
        // that is not a module (or whose config has no default) at that type.
        let config = |ty: &Type| match &self.config {
            None => quote_spanned!(ty.span()=> &::core::default::Default::default()),
            Some(e) if binds_tighter_than_ref(e) => quote_spanned!(e.span()=> &#e),
            Some(e) => quote_spanned!(e.span()=> &(#e)),
        };
        let load = |ty: &Type, vb: TokenStream| {
            let config = config(ty);
            quote_spanned!(ty.span()=> <#ty as ::kiln::Module>::load(#vb, #config))
        };
        match &self.kind {
            Kind::One(ty) => {
                let load = load(ty, quote!(#vb.pp(#segment)));
                quote!(#ident: #load?,)
            }
            Kind::Optional { inner, when } => {
                let load = load(inner, quote!(#vb.pp(#segment)));
                quote! {
                    #ident: if #when {
                        ::core::option::Option::Some(#load?)
                    } else {
                        ::core::option::Option::None
                    },
                }
            }
            Kind::Repeated { elem, len } => {
                let uses_index = self.config.as_ref().is_some_and(|e| mentions(quote!(#e), INDEX_VAR));
                let i = Ident::new(if uses_index { INDEX_VAR } else { "_i" }, Span::call_site());
                let load = load(elem, quote!(#vb.pp(#segment).pp(#i)));
                quote! {
                    #ident: (0..#len)
                        .map(|#i: usize| #load)
                        .collect::<::kiln::Result<::std::vec::Vec<_>>>()?,
                }
            }
        }
    }
}

fn set_once<T>(meta: &ParseNestedMeta, slot: &mut Option<T>, value: T) -> syn::Result<()> {
    if slot.is_some() {
        return Err(meta.error(format!("duplicate `{}` key", quote_path(meta))));
    }
    *slot = Some(value);
    Ok(())
}

fn unknown_key(meta: &ParseNestedMeta, hint: &str) -> Error {
    meta.error(format!("unknown `module` attribute key `{}`: {hint}", quote_path(meta)))
}

fn quote_path(meta: &ParseNestedMeta) -> String {
    let path = &meta.path;
    quote!(#path).to_string().replace(' ', "")
}

/// `T` when `ty` is written `<wrapper><T>` (`Option<Block>`, `std::vec::Vec<Block>`). Judged by
/// spelling, as any derive must: a type alias of `Option` is not recognised.
fn wrapped<'a>(ty: &'a Type, wrapper: &str) -> Option<&'a Type> {
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last().filter(|s| p.qself.is_none() && s.ident == wrapper)?;
    let PathArguments::AngleBracketed(args) = &last.arguments else { return None };
    match args.args.iter().collect::<Vec<_>>().as_slice() {
        [GenericArgument::Type(inner)] => Some(inner),
        _ => None,
    }
}

/// A type as the user would write it (`Option<Block>`, not `Option < Block >`).
fn show(ty: &Type) -> String {
    let spaced = quote!(#ty).to_string();
    [(" :: ", "::"), (":: ", "::"), (" <", "<"), ("< ", "<"), (" >", ">"), (" ,", ","), ("& ", "&")]
        .iter()
        .fold(spaced, |s, (from, to)| s.replace(from, to))
}

/// Whether the identifier `name` appears anywhere in `tokens` (including nested groups).
fn mentions(tokens: impl quote::ToTokens, name: &str) -> bool {
    fn walk(tokens: TokenStream, name: &str) -> bool {
        tokens.into_iter().any(|t| match t {
            TokenTree::Ident(i) => i == name,
            TokenTree::Group(g) => walk(g.stream(), name),
            _ => false,
        })
    }
    walk(tokens.into_token_stream(), name)
}

/// Expressions for which `&expr` means `&(expr)`: postfix and primary forms.
fn binds_tighter_than_ref(e: &Expr) -> bool {
    matches!(
        e,
        Expr::Path(_)
            | Expr::Call(_)
            | Expr::MethodCall(_)
            | Expr::Field(_)
            | Expr::Lit(_)
            | Expr::Struct(_)
            | Expr::Macro(_)
            | Expr::Paren(_)
            | Expr::Index(_)
            | Expr::Tuple(_)
            | Expr::Array(_)
            | Expr::Block(_)
    )
}

#[cfg(test)]
mod tests {
    //! Expansion and error messages, checked on token streams (fast; the spans shown to users are
    //! checked against the compile-fail cases in `tests/ui` by `ui_cases`).
    use super::*;

    fn expand_str(src: &str) -> Result<String, String> {
        let input: DeriveInput = syn::parse_str(src).expect("test input parses");
        expand(&input).map(|t| t.to_string()).map_err(|e| e.to_compile_error().to_string())
    }

    fn err(src: &str) -> String {
        expand_str(src).expect_err("expansion should fail")
    }

    #[test]
    fn plain_fields_load_by_name_with_default_config() {
        let out = expand_str("struct B { conv: Conv2d, relu: ReLU }").unwrap();
        assert!(out.contains("type Config = ()"), "{out}");
        assert!(out.contains("fn load (vb : :: kiln :: VarBuilder , _cfg : & Self :: Config)"), "{out}");
        assert!(
            out.contains(
                "Ok (Self { conv : < Conv2d as :: kiln :: Module > :: load (vb . pp (\"conv\") , & :: core :: default :: Default :: default ()) ?"
            ),
            "{out}"
        );
        assert!(out.contains("relu : < ReLU as :: kiln :: Module > :: load (vb . pp (\"relu\")"), "{out}");
    }

    #[test]
    fn struct_config_and_field_expressions() {
        let out = expand_str(
            "#[module(config = BlockConfig)] struct B { \
               #[module(config = Conv2dConfig::new(cfg.cin, cfg.cout, 3).padding(1))] conv: Conv2d, \
               #[module(name = \"0\", config = cfg.n + 1)] first: Foo }",
        )
        .unwrap();
        assert!(out.contains("type Config = BlockConfig"), "{out}");
        assert!(out.contains(", cfg : & Self :: Config"), "{out}");
        assert!(out.contains("& Conv2dConfig :: new (cfg . cin , cfg . cout , 3) . padding (1)"), "{out}");
        // A binary expression is parenthesised so that `&` covers all of it.
        assert!(out.contains("vb . pp (\"0\") , & (cfg . n + 1)"), "{out}");
    }

    #[test]
    fn optional_and_repeated_fields() {
        let out = expand_str(
            "#[module(config = C)] struct B { \
               #[module(when = cfg.stride != 1)] down: Option<Down>, \
               #[module(len = cfg.depth, config = BlockConfig::new(i))] blocks: Vec<Block>, \
               #[module(len = 2)] heads: Vec<Head> }",
        )
        .unwrap();
        assert!(out.contains("down : if cfg . stride != 1 { :: core :: option :: Option :: Some (< Down as :: kiln :: Module >"), "{out}");
        assert!(
            out.contains("(0 .. cfg . depth) . map (| i : usize | < Block as :: kiln :: Module > :: load (vb . pp (\"blocks\") . pp (i)"),
            "{out}"
        );
        // The index is only named `i` where the config reads it.
        assert!(
            out.contains("(0 .. 2) . map (| _i : usize | < Head as :: kiln :: Module > :: load (vb . pp (\"heads\") . pp (_i)"),
            "{out}"
        );
    }

    #[test]
    fn raw_identifiers_lose_their_prefix() {
        assert_eq!(show(&syn::parse_str("std::option::Option<Vec<(A, &B)>>").unwrap()), "std::option::Option<Vec<(A, &B)>>");
        let out = expand_str("struct B { r#type: Conv2d }").unwrap();
        assert!(out.contains("vb . pp (\"type\")"), "{out}");
    }

    #[test]
    fn generics_are_kept() {
        let out = expand_str("struct B<T: Clone> where T: Copy { inner: Wrap<T> }").unwrap();
        assert!(out.contains("impl < T : Clone > :: kiln :: Module for B < T > where T : Copy"), "{out}");
    }

    #[test]
    fn empty_struct_names_unused_parameters() {
        let out = expand_str("struct Nothing {}").unwrap();
        assert!(out.contains("fn load (_vb : :: kiln :: VarBuilder , _cfg"), "{out}");
    }

    #[test]
    fn misuse_is_reported() {
        assert!(err("enum E { A }").contains("supports structs only"));
        assert!(err("union U { a: u32 }").contains("supports structs only"));
        assert!(err("struct T(Conv2d);").contains("needs named fields"));
        assert!(err("struct U;").contains("unit struct"));
        assert!(err("#[module(cfg = X)] struct B { a: A }").contains("unknown `module` attribute key `cfg`"));
        assert!(err("struct B { #[module(size = 3)] a: A }").contains("unknown `module` attribute key `size`"));
        assert!(err("struct B { #[module(when = true)] a: Conv2d }")
            .contains("`when` applies to `Option<_>` fields, but `a` has type `Conv2d`"));
        assert!(
            err("struct B { #[module(len = 3)] a: Option<A> }").contains("`len` applies to `Vec<_>` fields, but `a` has type `Option<A>`")
        );
        assert!(err("struct B { a: Option<A> }").contains("needs `#[module(when = <bool expression>)]`"));
        assert!(err("struct B { a: Vec<A> }").contains("needs `#[module(len = <usize expression>)]`"));
        assert!(err("struct B { #[module(when = true, len = 2)] a: Option<A> }").contains("cannot be combined"));
        assert!(err("struct B { #[module(config = 1, config = 2)] a: A }").contains("duplicate `config` key"));
        assert!(err("struct B { #[module(name = \"a.b\")] a: A }").contains("contain no `.`"));
        assert!(err("struct B { #[module(name = \"\")] a: A }").contains("non-empty"));
    }

    #[test]
    fn every_field_error_is_reported_at_once() {
        let e = err("struct B { #[module(len = 3)] a: A, #[module(bogus)] b: B }");
        assert!(e.contains("`len` applies to `Vec<_>`") && e.contains("unknown `module` attribute key `bogus`"), "{e}");
    }
}
