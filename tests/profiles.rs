//! Optimization profiles without a GPU: a graph re-inferred at other input dims equals one traced
//! there, profiles are checked against the graph with errors that name what is wrong, and the
//! build shapes and profile lookup follow TensorRT's rules (opt timed first, then max and min).

use kiln::engine::{BuildConfig, DimsRange, InputDims, ShapeProfile};
use kiln::Graph;
use kiln::VarBuilder;

fn dims(c: usize, h: usize, w: usize) -> InputDims {
    InputDims::from([("input".to_string(), vec![c, h, w])])
}

fn shapes(g: &Graph) -> Vec<(String, Vec<usize>)> {
    g.nodes.iter().map(|n| (n.path.clone(), n.shape.clone())).collect()
}

#[test]
fn a_graph_at_new_input_dims_equals_one_traced_there() {
    for (model, traced, other) in [("resnet18", [224, 224], [200, 288]), ("centernet", [512, 512], [384, 640])] {
        let g = kiln_models::trace_hw(model, VarBuilder::seeded(), 1, traced).expect("trace");
        let there = kiln_models::trace_hw(model, VarBuilder::seeded(), 1, other).expect("trace");
        let moved = g.with_input_dims(&dims(3, other[0], other[1])).expect("re-inferred");
        assert_eq!(shapes(&moved), shapes(&there), "{model} at {other:?}");
        // The optimised graph (what an engine holds) moves the same way.
        let (opt, opt_there) = (kiln::engine::optimize(&g).expect("passes"), kiln::engine::optimize(&there).expect("passes"));
        assert_eq!(shapes(&opt.with_input_dims(&dims(3, other[0], other[1])).expect("re-inferred")), shapes(&opt_there));
        println!("{model}: {} nodes re-inferred at {other:?}", moved.nodes.len());
    }
}

#[test]
fn a_graph_that_fixed_its_size_says_where() {
    // ViT's position embedding has the traced number of patches: another size cannot be added to it.
    let g = kiln_models::trace_hw("vit_b_16", VarBuilder::seeded(), 1, [224, 224]).expect("trace");
    let e = g.with_input_dims(&dims(3, 256, 256)).unwrap_err().to_string();
    println!("{e}");
    // The patch grid is flattened to the traced 196 patches: the reshape names both shapes.
    assert!(e.contains("reshape") && e.contains("[1, 16, 16, 768]") && e.contains("traced shape is [1, 196, 768]"), "{e}");
    let e = g.with_input_dims(&InputDims::from([("image".to_string(), vec![3, 8, 8])])).unwrap_err().to_string();
    assert!(e.contains("image") && e.contains("no such input"), "{e}");
    let e = g.with_input_dims(&InputDims::from([("input".to_string(), vec![8, 8])])).unwrap_err().to_string();
    assert!(e.contains("2 per-image dims"), "{e}");
}

fn profile(min: [usize; 3], opt: [usize; 3], max: [usize; 3]) -> ShapeProfile {
    ShapeProfile::from([("input".to_string(), DimsRange::new(&min, &opt, &max))])
}

#[test]
fn build_shapes_are_each_profiles_opt_then_max_and_min() {
    let g = kiln_models::trace_hw("resnet18", VarBuilder::seeded(), 1, [224, 224]).expect("trace");
    let config = BuildConfig::default().profile(profile([3, 128, 128], [3, 224, 224], [3, 320, 256])).profile(profile(
        [3, 480, 480],
        [3, 512, 512],
        [3, 512, 512],
    ));
    let got = config.build_shapes(&g);
    let want = [dims(3, 224, 224), dims(3, 512, 512), dims(3, 320, 256), dims(3, 128, 128), dims(3, 480, 480)];
    assert_eq!(got, want, "opts first (timed), then each profile's max and min, no duplicates");
    assert_eq!(config.profile_for(&g, &dims(3, 200, 160)), Some(0));
    assert_eq!(config.profile_for(&g, &dims(3, 500, 512)), Some(1));
    assert_eq!(config.profile_for(&g, &dims(3, 400, 400)), None, "between the profiles");
    assert_eq!(config.profile_for(&g, &dims(4, 224, 224)), None, "channels outside");
    assert_eq!(BuildConfig::default().build_shapes(&g), [dims(3, 224, 224)], "no profile: the traced dims");
}

#[test]
fn bad_profiles_are_refused_naming_the_input() {
    let g = kiln_models::trace_hw("resnet18", VarBuilder::seeded(), 1, [64, 64]).expect("trace");
    let engine_error = |config: BuildConfig| {
        // Checked before any GPU work: the error is the same with or without a GPU.
        kiln::engine::EngineBuilder::new(config).build(&g).err().map(|e| e.to_string()).unwrap_or_default()
    };
    let e = engine_error(BuildConfig::default().profile(profile([3, 64, 64], [3, 32, 64], [3, 96, 96])));
    assert!(e.contains("profile 0, input `input`") && e.contains("min <= opt <= max"), "{e}");
    let e = engine_error(
        BuildConfig::default().profile(ShapeProfile::from([("x".into(), DimsRange::new(&[3, 8, 8], &[3, 8, 8], &[3, 8, 8]))])),
    );
    assert!(e.contains("input `x`") && e.contains("no such input"), "{e}");
    let e = engine_error(BuildConfig::default().profile(ShapeProfile::from([("input".into(), DimsRange::new(&[8, 8], &[8, 8], &[8, 8]))])));
    assert!(e.contains("3 per-image dims"), "{e}");
    let huge = usize::MAX / 4;
    let e = engine_error(BuildConfig::default().profile(profile([3, 8, 8], [3, 8, 8], [3, huge, 8])));
    assert!(e.contains("more elements than fit"), "{e}");
    println!("{e}");
}
