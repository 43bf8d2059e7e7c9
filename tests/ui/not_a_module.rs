use kiln::Module;

/// A field whose type is not a module: the error points at that field's type.
#[derive(Module)]
struct Block {
    relu: kiln::ReLU,
    channels: usize,
}

/// A config expression of the wrong type: the error points at the expression.
#[derive(Module)]
struct Head {
    #[module(config = 3)]
    fc: kiln::Linear,
}

fn main() {}
