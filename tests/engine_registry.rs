//! Engine checks that need no GPU: the converter registry, the missing-converter error raised
//! before any GPU work, batch-range validation, and a clean `NoGpu` where there is no GPU.

use kiln::{
    engine::{gpu_available, BuildConfig, EngineBuilder, Gpu},
    plugin::{check_converters, converter},
};
use kiln::{
    nn::{Conv2d, Conv2dConfig},
    Error, Forward, Module, Tracer, VarBuilder,
};
use kiln::{
    plugin::{CustomCall, Op},
    Graph,
};
use std::collections::BTreeMap;

/// conv → a custom op nobody registered a converter for → output.
fn graph_with_unknown_op() -> Graph {
    let tracer = Tracer::new();
    let x = tracer.input("x", &[1, 3, 8, 8]);
    let y = Conv2d::load(VarBuilder::seeded().pp("stem"), &Conv2dConfig::new(3, 4, 3)).expect("conv").forward(&x).expect("trace");
    tracer.output("y", &y);
    let mut g = tracer.graph();
    // The op's shape rule is not registered either, so it is appended with its shape given.
    let id = g.push_unchecked(
        Op::Custom(CustomCall { name: "mish".into(), attrs: BTreeMap::new() }),
        vec![y.id()],
        vec![1, 4, 6, 6],
        "head.act".into(),
    );
    g.mark_output("y", id);
    g
}

#[test]
fn every_op_the_models_use_has_a_converter() {
    // Built-in ops convert through their `OpDef`; only custom ops are looked up by name.
    assert!(converter("centernet_decode").expect("registry").is_some(), "CenterNet's decode registers its converter");
    assert!(converter("conv2d").expect("registry").is_none(), "built-in ops are not in the custom registry");
    for model in kiln_models::BUNDLED.iter().map(|m| m.name) {
        let g = kiln_models::trace(model, VarBuilder::seeded(), 1, 64).expect("trace");
        check_converters(&g).unwrap_or_else(|e| panic!("{model}: {e}"));
    }
}

#[test]
fn a_missing_converter_is_reported_with_op_and_path_before_any_gpu_work() {
    let err = check_converters(&graph_with_unknown_op()).expect_err("mish has no converter");
    match &err {
        Error::NoConverter { op, path, .. } => assert_eq!((op.as_str(), path.as_str()), ("mish", "head.act")),
        other => panic!("expected NoConverter, got {other}"),
    }
    // The builder fails the same way, on machines with and without a GPU alike.
    let err = EngineBuilder::new(BuildConfig::default()).build(&graph_with_unknown_op()).err().expect("build must fail");
    assert!(matches!(err, Error::NoConverter { .. }), "{err}");
    println!("{err}");
    assert!(err.to_string().contains("mish") && err.to_string().contains("head.act"));
}

#[test]
fn a_bad_batch_range_is_an_error() {
    let g = kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 64).expect("trace");
    let err = EngineBuilder::new(BuildConfig::default().batch(4, 2, 8)).build(&g).err().expect("min > opt");
    assert!(err.to_string().contains("min <= opt"), "{err}");
}

#[test]
fn without_a_gpu_opening_one_is_an_error_not_a_crash() {
    match gpu_available() {
        Ok(()) => println!("a GPU is present: nothing to check here"),
        Err(why) => {
            println!("no GPU: {why}");
            match Gpu::new(0) {
                Err(Error::NoGpu(reason)) => assert_eq!(reason, why),
                Err(other) => panic!("expected NoGpu, got {other}"),
                Ok(_) => panic!("gpu_available said no GPU, but Gpu::new succeeded"),
            }
            let g = kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 64).expect("trace");
            let err = EngineBuilder::new(BuildConfig::default()).build(&g).err().expect("no GPU, no engine");
            assert!(matches!(err, Error::NoGpu(_)), "{err}");
        }
    }
}

/// The engine's own kernel (`kernels/pad.cu`, used by the conv converter) compiles for sm_90
/// wherever NVRTC is installed (CI installs it; see .ci/run); needs no GPU.
#[test]
fn the_channel_padding_kernel_compiles_for_sm_90() {
    use kiln::plugin::{compile_source, image_has_symbol, nvrtc_available};
    if let Err(why) = nvrtc_available() {
        println!("skipped: {why}");
        return;
    }
    let cubin = compile_source("pad.cu", kiln::dev::kernels::PAD_CU, "sm_90").unwrap_or_else(|e| panic!("{e}"));
    for entry in ["pad_channels_f16", "pad_channels_f32"] {
        assert!(image_has_symbol(&cubin, entry), "{entry} missing from the compiled pad.cu");
    }
}
