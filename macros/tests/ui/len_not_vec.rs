use kiln::Module;

#[derive(Module)]
struct Layer {
    #[module(len = 3)]
    blocks: Option<kiln::nn::ReLU>,
}

fn main() {}
