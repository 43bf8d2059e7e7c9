use kiln::Module;

#[derive(Module)]
struct Layer {
    #[module(len = 3)]
    blocks: Option<kiln::ReLU>,
}

fn main() {}
