use kiln::Module;

/// A config expression of the wrong type: the error points at the expression.
/// (A field whose type is not a module is reported at that field's type too, but rustc's message
/// lists every `Module` impl, which would make this case change with each new layer.)
#[derive(Module)]
struct Head {
    #[module(config = 3)]
    fc: kiln::nn::Linear,
}

fn main() {}
