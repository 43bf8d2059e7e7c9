//! Linears that absorbed their residual add (`passes::fuse_linear_add`: cuBLASLt's C with beta =
//! 1, D written in place of C where nothing reads the residual later) and ConvNeXt's layer scale
//! (`passes::fold_linear_scale`), as engines against the CPU executor on the traced graph: FP32
//! and FP16, batch 1 and 3 (`common::check`). Each graph is first checked (on the CPU) to fuse.
//!
//! On the device: `cargo test --release --test gpu_linear_fusion -- --include-ignored --nocapture --test-threads 1`.

use kiln::dev::passes;
use kiln::nn::{Conv2d, Conv2dConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use kiln::plugin::{Binary, Gemm, Op};
use kiln::{Forward, Graph, Module, Tensor, Tracer, VarBuilder};

mod common;
use common::check;

fn residual_linears(build: &dyn Fn(&[Tensor]) -> kiln::Result<Vec<Tensor>>, input: &[usize]) -> usize {
    let t = Tracer::new();
    let x = t.input("x", &[&[1][..], input].concat());
    for (i, y) in build(&[x]).expect("trace").iter().enumerate() {
        t.output(&format!("y{i}"), y);
    }
    let g: Graph = passes::optimize(&t.graph()).expect("optimize");
    g.nodes.iter().filter(|n| matches!(n.op, Op::Gemm(Gemm::Linear { residual: true, .. }))).count()
}

/// A ViT encoder block's two residual adds (`out_proj`, `fc2`) on 197 tokens of 256, the block
/// input a Linear's output (as in a real encoder) so that both fuse; the first residual is read
/// again by `fc2`'s add (C kept apart from D), the second is not (D in place of C).
fn vit_block(x: &[Tensor]) -> kiln::Result<Vec<Tensor>> {
    let vb = VarBuilder::seeded();
    let lin = |p: &str, i: usize, o: usize| Linear::load(vb.pp(p), &LinearConfig::new(i, o));
    let x = lin("embed", 256, 256)?.forward(&x[0])?;
    let ln = LayerNorm::load(vb.pp("ln"), &LayerNormConfig::new(&[256]))?;
    let x = (&x + &lin("out_proj", 256, 256)?.forward(&ln.forward(&x)?)?)?;
    let h = lin("fc1", 256, 512)?.forward(&x)?.gelu(false)?;
    Ok(vec![(&lin("fc2", 512, 256)?.forward(&h)? + &x)?])
}

/// A ConvNeXt block (7×7 depthwise, permute to NHWC, LayerNorm, Linear, GELU, Linear, permute
/// back, layer scale, residual) whose input is a conv's output: the scale folds into `fc2` and the
/// residual becomes its C through a permute of the block input to NHWC.
fn convnext_block(x: &[Tensor]) -> kiln::Result<Vec<Tensor>> {
    let vb = VarBuilder::seeded();
    let c = 96;
    let x = Conv2d::load(vb.pp("stem"), &Conv2dConfig::new(c, c, 1))?.forward(&x[0])?;
    let t = Conv2d::load(vb.pp("dw"), &Conv2dConfig::new(c, c, 7).padding(3).groups(c))?.forward(&x)?.permute(&[0, 2, 3, 1])?;
    let t = LayerNorm::load(vb.pp("ln"), &LayerNormConfig::new(&[c]).eps(1e-6))?.forward(&t)?;
    let t = Linear::load(vb.pp("fc1"), &LinearConfig::new(c, 4 * c))?.forward(&t)?.gelu(false)?;
    let t = Linear::load(vb.pp("fc2"), &LinearConfig::new(4 * c, c))?.forward(&t)?.permute(&[0, 3, 1, 2])?;
    let t = t.binary_weight("layer_scale", Binary::Mul, &vb.get(&[c, 1, 1], "layer_scale")?)?;
    Ok(vec![(&t + &x)?])
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn vit_block_with_residual_linears() {
    assert_eq!(residual_linears(&vit_block, &[197, 256]), 2);
    check("vit block, residual linears", &[("x", &[197, 256])], vit_block);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn convnext_block_with_folded_scale_and_residual_linear() {
    assert_eq!(residual_linears(&convnext_block, &[96, 14, 14]), 1);
    check("convnext block, residual linear", &[("x", &[96, 14, 14])], convnext_block);
}
