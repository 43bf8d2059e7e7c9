use kiln::Module;

#[derive(Module)]
enum Head {
    Conv(kiln::nn::Conv2d),
    Linear(kiln::nn::Linear),
}

fn main() {}
