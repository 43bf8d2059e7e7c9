use kiln::Module;

#[derive(Module)]
enum Head {
    Conv(kiln::Conv2d),
    Linear(kiln::Linear),
}

fn main() {}
