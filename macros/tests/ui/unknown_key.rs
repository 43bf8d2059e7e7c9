use kiln::Module;

#[derive(Module)]
#[module(config = usize)]
struct Block {
    #[module(config = kiln::nn::Conv2dConfig::new(*cfg, *cfg, 3), padding = 1)]
    conv: kiln::nn::Conv2d,
}

#[derive(Module)]
#[module(cfg = usize)]
struct Other {
    relu: kiln::nn::ReLU,
}

fn main() {}
