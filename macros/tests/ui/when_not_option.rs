use kiln::Module;

#[derive(Module)]
#[module(config = bool)]
struct Block {
    #[module(when = *cfg)]
    downsample: kiln::nn::Conv2d,
}

fn main() {}
