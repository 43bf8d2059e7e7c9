use kiln::Module;

#[derive(Module)]
struct Layer {
    downsample: Option<kiln::Conv2d>,
    blocks: Vec<kiln::ReLU>,
}

fn main() {}
