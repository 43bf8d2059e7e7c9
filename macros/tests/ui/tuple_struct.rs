use kiln::Module;

#[derive(Module)]
struct Pair(kiln::nn::Conv2d, kiln::nn::ReLU);

fn main() {}
