use kiln::Module;

#[derive(Module)]
struct Pair(kiln::Conv2d, kiln::ReLU);

fn main() {}
