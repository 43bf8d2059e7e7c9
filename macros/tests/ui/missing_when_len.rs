use kiln::Module;

#[derive(Module)]
struct Layer {
    downsample: Option<kiln::nn::Conv2d>,
    blocks: Vec<kiln::nn::ReLU>,
}

fn main() {}
