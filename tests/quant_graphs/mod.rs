//! Graphs the CPU quantisation tests (`tests/quant.rs`) and the device's (`tests/gpu_quant.rs`)
//! share: what the planning test says an engine does is what the device test runs.

use kiln::{Forward, Graph, Module, Tracer, VarBuilder};

/// A transformer-like graph over 8 tokens of 64 features (`x` `[N, 8, 64]`): LayerNorm, `fc1`
/// (64 → 128), GELU, `fc2` (128 → 64), the residual add, LayerNorm, then `head` (64 → 24), `out`
/// (24 → 32) as output `y`, and `cls` (512 → 32) on the flattened residual stream as output `z`.
/// Its FP8 GEMM candidates (`ops::quant::fp8_gemm::problem`, no GPU) are fc1, fc2 and cls:
/// `head`'s 24 outputs and `out`'s 24 inputs are not multiples of 16.
pub fn transformer_like(batch: usize) -> Graph {
    use kiln::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig, GELU};
    let vb = VarBuilder::seeded();
    let tracer = Tracer::new();
    let x = tracer.input("input", &[batch, 8, 64]);
    let trace = || -> kiln::Result<()> {
        let linear = |name: &str, i: usize, o: usize, t: &kiln::Tensor| Linear::load(vb.pp(name), &LinearConfig::new(i, o))?.forward(t);
        let t = LayerNorm::load(vb.pp("ln1"), &LayerNormConfig::new(&[64]))?.forward(&x)?;
        let t = GELU::load(vb.pp("act"), &false)?.forward(&linear("fc1", 64, 128, &t)?)?;
        let h = (&x + &linear("fc2", 128, 64, &t)?)?;
        let u = LayerNorm::load(vb.pp("ln2"), &LayerNormConfig::new(&[64]))?.forward(&h)?;
        linear("out", 24, 32, &linear("head", 64, 24, &u)?)?.mark_output("y");
        linear("cls", 512, 32, &h.flatten(1)?)?.mark_output("z");
        Ok(())
    };
    trace().expect("trace");
    tracer.graph()
}
