use kiln::Module;

#[derive(Module)]
#[module(config = usize)]
struct Block {
    #[module(config = kiln::Conv2dConfig::new(*cfg, *cfg, 3), padding = 1)]
    conv: kiln::Conv2d,
}

#[derive(Module)]
#[module(cfg = usize)]
struct Other {
    relu: kiln::ReLU,
}

fn main() {}
