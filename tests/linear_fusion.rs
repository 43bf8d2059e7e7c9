//! Linear → Add as one Linear with a residual input (`passes::fuse_linear_add`, cuBLASLt's C on
//! the GPU), ConvNeXt's layer scale folded into its Linear (`passes::fold_linear_scale`) and a
//! BatchNorm1d's shift into its bias (`passes::fold_linear_shift`), on the CPU: which graphs fuse and which must not, outputs before and after, the new attribute in
//! graph files, and what the bundled transformers (ViT-B/16, Swin-T, ConvNeXt-T) fuse.

use kiln::dev::passes;
use kiln::nn::{Linear, LinearConfig};
use kiln::plugin::{Binary, Gemm, GemmAct, Op, ShapeOp};
use kiln::{compare, Forward, Graph, HostTensor, Module, Tracer, VarBuilder};
use std::sync::Arc;

fn rand(shape: &[usize]) -> HostTensor {
    kiln::dev::uniform_tensor(shape, kiln::dev::fresh_seed())
}

fn linear(vb: &VarBuilder, path: &str, fin: usize, fout: usize) -> Linear {
    Linear::load(vb.pp(path), &LinearConfig::new(fin, fout)).expect("linear")
}

fn outputs(g: &Graph, x: &HostTensor) -> std::collections::BTreeMap<String, HostTensor> {
    let name = g.input_names()[0].to_string();
    kiln::run_cpu(g, &[(&name, x)]).expect("cpu run")
}

fn count(g: &Graph, op: &str) -> usize {
    g.nodes.iter().filter(|n| n.op.name() == op).count()
}

/// `(bias, residual)` of the Linear at `path`.
fn linear_attrs(g: &Graph, path: &str) -> (bool, bool) {
    match g.nodes.iter().find(|n| n.path == path && matches!(n.op, Op::Gemm(Gemm::Linear { .. }))).map(|n| &n.op) {
        Some(Op::Gemm(Gemm::Linear { bias, residual })) => (*bias, *residual),
        _ => panic!("no linear at `{path}`:\n{}", g.to_text()),
    }
}

/// A ViT encoder block on `[N, L, E]` tokens: `x + out_proj(ln(x))`, then `x + fc2(gelu(fc1(x)))`;
/// the block input is a Linear's output (not the graph input), as in a real encoder.
fn vit_like() -> Graph {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let input = t.input("x", &[1, 5, 8]);
    let x = linear(&vb, "embed", 8, 8).forward(&input).expect("trace");
    let ln = kiln::nn::LayerNorm::load(vb.pp("ln"), &kiln::nn::LayerNormConfig::new(&[8])).expect("ln");
    let x = (&x + &linear(&vb, "out_proj", 8, 8).forward(&ln.forward(&x).expect("trace")).expect("trace")).expect("trace");
    let h = linear(&vb, "fc1", 8, 16).forward(&x).and_then(|h| h.gelu(false)).expect("trace");
    // The residual is the first operand here: add is commutative.
    let y = (&linear(&vb, "fc2", 16, 8).forward(&h).expect("trace") + &x).expect("trace");
    t.output("y", &y);
    t.graph()
}

#[test]
fn vit_block_adds_become_residual_linears_with_equal_outputs() {
    let g = vit_like();
    let o = passes::fuse_linear_add(&g).expect("fuse");
    assert_eq!(count(&g, "add"), 2);
    assert_eq!(count(&o, "add"), 0, "{}", o.to_text());
    assert_eq!(linear_attrs(&o, "out_proj"), (true, true));
    assert_eq!(linear_attrs(&o, "fc2"), (true, true));
    assert_eq!(linear_attrs(&o, "fc1"), (true, false));
    assert_eq!(linear_attrs(&o, "embed"), (true, false), "its value is read by the LayerNorm and the add");
    // The residual is the fused node's last input, and the output is the last fused linear.
    let fc2 = o.nodes.iter().position(|n| n.path == "fc2").expect("fc2");
    assert_eq!(o.nodes[*o.nodes[fc2].inputs.last().expect("inputs")].path, "out_proj");
    assert_eq!(o.outputs, [("y".to_string(), fc2)]);
    // The CPU sums are the separate Add's: bit-identical, at two batch sizes.
    for batch in [1, 3] {
        let x = rand(&[batch, 5, 8]);
        assert_eq!(outputs(&g, &x), outputs(&o, &x), "batch {batch}");
    }
    // `optimize` runs the pass.
    assert_eq!(count(&passes::optimize(&g).expect("optimize"), "add"), 0);
}

#[test]
fn a_linear_read_twice_an_output_a_broadcast_or_a_graph_input_keeps_its_add() {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let input = t.input("x", &[2, 4, 6]);
    // Added to the graph input: not fused (the engine reads input bindings as they are).
    let a = (&linear(&vb, "a", 6, 6).forward(&input).expect("trace") + &input).expect("trace");
    // Read by the add and by a mul.
    let b = linear(&vb, "b", 6, 6).forward(&a).expect("trace");
    let b2 = (&b + &a).and_then(|s| s.mul(&b)).expect("trace");
    // A graph output.
    let c = linear(&vb, "c", 6, 6).forward(&b2).expect("trace");
    t.output("c", &c);
    let c2 = (&c + &b2).expect("trace");
    // A broadcast operand ([2, 1, 6], a mean over the tokens).
    let d = linear(&vb, "d", 6, 6).forward(&c2).expect("trace");
    let d2 = (&d + &c2.mean(&[1], true).expect("trace")).expect("trace");
    // add(e, e): no other operand.
    let e = linear(&vb, "e", 6, 6).forward(&d2).expect("trace");
    let e2 = (&e + &e).expect("trace");
    // A Linear read through a reshape is not read by the add itself (one that changes the shape:
    // an identity reshape is removed by `collapse_view_chains`, and then the add is fused).
    let f = linear(&vb, "f", 6, 6).forward(&e2).expect("trace").reshape(&[2, 24]).expect("trace");
    let y = (&f + &e2.reshape(&[2, 24]).expect("trace")).expect("trace");
    t.output("y", &y);
    let g = t.graph();
    let o = passes::optimize(&g).expect("optimize");
    for p in ["a", "b", "c", "d", "e", "f"] {
        assert_eq!(linear_attrs(&o, p), (true, false), "{p}:\n{}", o.to_text());
    }
    assert_eq!(count(&o, "add"), count(&g, "add"));
    let x = rand(&[2, 4, 6]);
    assert_eq!(outputs(&g, &x), outputs(&o, &x));
}

/// A ConvNeXt block on `[N, C, H, W]`: permute to NHWC, Linear, Linear, permute back, times the
/// `[C, 1, 1]` layer scale, plus the block input (a ReLU's output, not the graph input).
fn convnext_like(scale_shape: &[usize]) -> Graph {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let input = t.input("x", &[1, 4, 3, 5]);
    let x = input.relu().expect("trace");
    let h = linear(&vb, "pwconv1", 4, 8).forward(&x.permute(&[0, 2, 3, 1]).expect("trace")).expect("trace");
    let h = linear(&vb, "pwconv2", 8, 4).forward(&h.gelu(false).expect("trace")).expect("trace");
    let scale = vb.get(scale_shape, "layer_scale").expect("scale");
    let y = h.permute(&[0, 3, 1, 2]).and_then(|y| y.binary_weight("layer_scale", Binary::Mul, &scale)).expect("trace");
    let y = (&y + &x).expect("trace");
    t.output("y", &y);
    t.graph()
}

#[test]
fn convnext_layer_scale_folds_and_the_residual_goes_through_the_permute() {
    let g = convnext_like(&[4, 1, 1]);
    let o = passes::optimize(&g).expect("optimize");
    assert_eq!((count(&o, "mul"), count(&o, "add")), (0, 0), "{}", o.to_text());
    assert_eq!(linear_attrs(&o, "pwconv2"), (true, true));
    assert!(o.weights.contains_key("pwconv2.weight.scaled") && o.weights.contains_key("pwconv2.bias.scaled"));
    assert!(!o.weights.contains_key("layer_scale") && !o.weights.contains_key("pwconv2.weight"), "{:?}", o.weights.keys());
    // The block input is permuted to NHWC for the Linear's C, the sum permuted back.
    let residual = o.nodes.iter().find(|n| n.path == "pwconv2.residual").expect("the residual's permute");
    assert_eq!(residual.op, Op::Shape(ShapeOp::Permute { dims: vec![0, 2, 3, 1] }));
    assert_eq!(residual.shape, [1, 3, 5, 4]);
    assert_eq!(o.nodes[o.outputs[0].1].op, Op::Shape(ShapeOp::Permute { dims: vec![0, 3, 1, 2] }));
    // The scale's rows change the f32 rounding a little.
    for batch in [1, 2] {
        let x = rand(&[batch, 4, 3, 5]);
        let (want, got) = (outputs(&g, &x), outputs(&o, &x));
        let c = compare("y", &got["y"], &want["y"]);
        println!("batch {batch}: {c}");
        assert!(c.passes(1e-6), "{c}");
    }
}

#[test]
fn a_scale_that_is_not_per_feature_stays_a_mul() {
    // [3, 1] scales H (not C); [1, 1, 1] is one factor, folded.
    let g = convnext_like(&[3, 1]);
    let o = passes::fold_linear_scale(&g).expect("fold");
    assert_eq!(count(&o, "mul"), 1);
    let o = passes::fuse_linear_add(&o).expect("fuse");
    assert_eq!(linear_attrs(&o, "pwconv2"), (true, false), "the mul sits between the permute and the add");
    let scalar = convnext_like(&[1, 1, 1]);
    let o = passes::optimize(&scalar).expect("optimize");
    assert_eq!(count(&o, "mul"), 0);
    let x = rand(&[2, 4, 3, 5]);
    let c = compare("y", &outputs(&o, &x)["y"], &outputs(&scalar, &x)["y"]);
    assert!(c.passes(1e-6), "{c}");
    // A Linear's value read by its permute and by another node keeps the mul.
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let x = t.input("x", &[1, 3, 2, 4]).relu().expect("trace");
    let h = linear(&vb, "l", 4, 4).forward(&x).expect("trace");
    let s = vb.get(&[4], "s").expect("scale");
    let y = h.binary_weight("s", Binary::Mul, &s).expect("trace");
    t.output("y", &(&y + &h).expect("trace"));
    let g = t.graph();
    let o = passes::optimize(&g).expect("optimize");
    assert_eq!((count(&o, "mul"), linear_attrs(&o, "l")), (1, (true, false)));
}

/// DeiT-III's layer scale of 1e-6: folded into weights of about 0.1 it would leave weights FP16
/// holds with a few bits at most (under 2^-16), so it stays a multiply after the Linear, as
/// PyTorch runs it. A scale of 0.1 beside it still folds.
#[test]
fn a_layer_scale_too_small_for_fp16_weights_stays_a_mul() {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let x = t.input("x", &[1, 5, 8]).relu().expect("trace");
    let scaled = |path: &str, value: f32| {
        let h = linear(&vb, path, 8, 8).forward(&x).expect("trace");
        let gamma = kiln::Param { name: format!("{path}.gamma"), value: Arc::new(HostTensor::new(vec![8], vec![value; 8])) };
        h.binary_weight(&format!("{path}.ls"), Binary::Mul, &gamma).expect("trace")
    };
    t.output("tiny", &scaled("tiny", 1e-6));
    t.output("small", &scaled("small", 0.1));
    let g = t.graph();
    let o = passes::fold_linear_scale(&g).expect("fold");
    assert_eq!(count(&o, "mul"), 1, "{}", o.to_text());
    assert!(o.weights.contains_key("small.weight.scaled") && !o.weights.contains_key("tiny.weight.scaled"), "{:?}", o.weights.keys());
    let x = rand(&[2, 5, 8]);
    let (want, got) = (outputs(&g, &x), outputs(&o, &x));
    for out in ["tiny", "small"] {
        let c = compare(out, &got[out], &want[out]);
        println!("{out}: {c}");
        assert!(c.passes(1e-6), "{c}");
    }
}

/// LeViT's `Linear(bias=False) → BatchNorm1d` on tokens, as kiln-torch imports it (a mul by the
/// BatchNorm's scale, then an add of its shift), and the same through a permute to NCHW.
#[test]
fn a_batchnorm_after_a_linear_becomes_its_weights_and_bias() {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let x = t.input("x", &[1, 6, 8]).relu().expect("trace");
    let plain = Linear::load(vb.pp("qkv.linear"), &LinearConfig { bias: false, ..LinearConfig::new(8, 12) }).expect("linear");
    let (s, b) = (vb.get(&[12], "qkv.bn.scale").expect("scale"), vb.get(&[12], "qkv.bn.shift").expect("shift"));
    let y = plain.forward(&x).and_then(|h| h.binary_weight("qkv.bn", Binary::Mul, &s)).expect("trace");
    let y = y.binary_weight("qkv.bn.add", Binary::Add, &b).expect("trace");
    t.output("tokens", &y.relu().expect("trace"));
    // Through a permute back to NCHW, on a Linear with a bias: the shift per channel, `[C, 1, 1]`.
    let img = t.input("img", &[1, 4, 3, 5]).relu().expect("trace");
    let h = linear(&vb, "pw", 4, 4).forward(&img.permute(&[0, 2, 3, 1]).expect("trace")).expect("trace");
    let shift = vb.get(&[4, 1, 1], "pw.shift").expect("shift");
    let z = h.permute(&[0, 3, 1, 2]).and_then(|h| h.binary_weight("pw.add", Binary::Add, &shift)).expect("trace");
    t.output("image", &z.relu().expect("trace"));
    // A constant that is not one value per feature stays an add.
    let other = linear(&vb, "other", 8, 12).forward(&x).expect("trace");
    let grid = vb.get(&[6, 12], "other.grid").expect("grid");
    t.output("grid", &other.binary_weight("other.add", Binary::Add, &grid).expect("trace"));
    let g = t.graph();
    let o = passes::optimize(&g).expect("optimize");
    assert_eq!((count(&o, "mul"), count(&o, "add")), (0, 1), "{}", o.to_text());
    assert_eq!(linear_attrs(&o, "qkv.linear"), (true, false), "the bias-less Linear got the shift as its bias");
    assert_eq!(linear_attrs(&o, "pw"), (true, false));
    assert!(o.weights.contains_key("qkv.linear.bias.shifted") && o.weights.contains_key("pw.bias.shifted"), "{:?}", o.weights.keys());
    let inputs = [("x", rand(&[2, 6, 8])), ("img", rand(&[2, 4, 3, 5]))];
    let refs: Vec<(&str, &HostTensor)> = inputs.iter().map(|(n, t)| (*n, t)).collect();
    let (want, got) = (kiln::run_cpu(&g, &refs).expect("before"), kiln::run_cpu(&o, &refs).expect("after"));
    for name in ["tokens", "image", "grid"] {
        let c = compare(name, &got[name], &want[name]);
        println!("{name}: {c}");
        assert!(c.passes(1e-6), "{c}");
    }
}

#[test]
fn the_residual_must_have_the_output_shape() {
    let mut g = Graph::default();
    let x = g.push_unchecked(Op::Input { name: "x".into() }, vec![], vec![2, 6], "x".into());
    g.inputs.push(x);
    let w = g.weight("l.weight", Arc::new(rand(&[3, 6])));
    let r = g.push_unchecked(Op::Input { name: "r".into() }, vec![], vec![2, 4], "r".into());
    let e = g.push(Op::Gemm(Gemm::Linear { bias: false, residual: true }), vec![x, w, r], "l".into()).unwrap_err().to_string();
    assert!(e.contains("residual [2, 4]") && e.contains("output shape [2, 3]"), "{e}");
    let e = g.push(Op::Gemm(Gemm::Linear { bias: false, residual: true }), vec![x, w], "l".into()).unwrap_err().to_string();
    assert!(e.contains("expects 3 inputs, got 2"), "{e}");
}

#[test]
fn graph_files_keep_the_residual_and_old_files_load_without_it() {
    let dir = std::env::temp_dir().join(format!("kiln-linear-fusion-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let fused = passes::optimize(&vit_like()).expect("optimize");
    let path = dir.join("fused.kiln.safetensors");
    fused.save(&path).expect("save");
    let back = Graph::load(&path).expect("load");
    assert_eq!(back.nodes, fused.nodes);
    assert_eq!(linear_attrs(&back, "fc2"), (true, true));
    // A file written before the field existed: the graph JSON has no `residual` (blanked here
    // without moving a byte, so the safetensors header keeps its length).
    let traced = vit_like();
    let old = dir.join("old.kiln.safetensors");
    traced.save(&old).expect("save");
    let bytes = std::fs::read(&old).expect("read");
    let field = br#",\"residual\":false"#;
    let mut blanked = bytes.clone();
    let mut n = 0;
    while let Some(at) = blanked.windows(field.len()).position(|w| w == field) {
        blanked[at..at + field.len()].fill(b' ');
        n += 1;
    }
    assert_eq!(n, count(&traced, "linear"), "every linear wrote the field");
    let g = Graph::from_file_bytes(&blanked, &old).expect("an old file loads");
    assert_eq!(g.nodes, traced.nodes);
    let _ = std::fs::remove_dir_all(&dir);
}

/// What `optimize` fuses in the bundled transformers (seeded weights, batch 1). ViT-B/16: both
/// adds of each of the 12 blocks (`out_proj`, `mlp.3`); the add left is the position embedding's
/// (a constant). Swin-T: the 12 MLP adds (`fc2`); each attention add reads the window reverse
/// (reshape, permute, roll, crop) after `proj`, not a Linear. ConvNeXt-T: each of the 18 blocks'
/// layer scale folds into `pwconv2` and its add becomes that Linear's C through the permute.
#[test]
fn bundled_transformers_fuse_their_residual_adds() {
    let residual_linears = |g: &Graph| g.nodes.iter().filter(|n| matches!(n.op, Op::Gemm(Gemm::Linear { residual: true, .. }))).count();
    for (model, size, fused, adds_left, muls_left) in
        [("vit_b_16", 224, 24, 1, 0), ("swin_t", 224, 12, 12, 0), ("convnext_tiny", 96, 18, 0, 0)]
    {
        let g = kiln_models::trace(model, VarBuilder::seeded(), 1, size).expect("trace");
        let o = passes::optimize(&g).expect("optimize");
        println!(
            "{model}: {} residual linears; add {} -> {}, mul {} -> {}",
            residual_linears(&o),
            count(&g, "add"),
            count(&o, "add"),
            count(&g, "mul"),
            count(&o, "mul")
        );
        assert_eq!((residual_linears(&o), count(&o, "add"), count(&o, "mul")), (fused, adds_left, muls_left), "{model}");
    }
}

/// `layerwise::fused_keys` (quantised layerwise comparisons) compares a residual Linear with the
/// traced Add it absorbed, the permute back after ConvNeXt's `pwconv2` with its Add, and gives
/// the NHWC `pwconv2` (scaled, with the residual) no reference.
#[test]
fn layerwise_keys_follow_the_fused_linears() {
    let key_of = |traced: &Graph, optimized: &Graph, pick: &dyn Fn(&kiln::plugin::Node) -> bool| {
        let keys = kiln::dev::layerwise::fused_keys(traced, optimized);
        let id = optimized.nodes.iter().position(pick).expect("node");
        keys.into_iter().find(|(i, _)| *i == id).map(|(_, k)| k).unwrap_or_default()
    };
    let add_keys = |g: &Graph| -> Vec<Vec<String>> {
        let keys = kiln::dev::layerwise::intermediate_keys(g);
        g.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.op.name() == "add")
            .map(|(i, _)| keys.iter().find(|(k, _)| *k == i).unwrap().1.clone())
            .collect()
    };
    let g = vit_like();
    let o = passes::optimize(&g).expect("optimize");
    let adds = add_keys(&g);
    assert_eq!(key_of(&g, &o, &|n| n.path == "out_proj"), adds[0]);
    assert_eq!(key_of(&g, &o, &|n| n.path == "fc2"), adds[1]);
    assert_eq!(key_of(&g, &o, &|n| n.path == "fc1"), ["intermediate.fc1"]);
    let g = convnext_like(&[4, 1, 1]);
    let o = passes::optimize(&g).expect("optimize");
    assert!(key_of(&g, &o, &|n| n.path == "pwconv2").is_empty());
    let back = o.outputs[0].1;
    assert_eq!(key_of(&g, &o, &|n| std::ptr::eq(n, &o.nodes[back])), add_keys(&g)[0]);
    assert!(key_of(&g, &o, &|n| n.path == "pwconv2.residual").is_empty());
}

/// `(bias, act)` of the fused Linear + activation at `path`, if it is one.
fn linear_act(g: &Graph, path: &str) -> Option<(bool, GemmAct)> {
    g.nodes.iter().find(|n| n.path == path).and_then(|n| match n.op {
        Op::Gemm(Gemm::LinearAct { bias, act }) => Some((bias, act)),
        _ => None,
    })
}

#[test]
fn linear_then_gelu_becomes_one_node_with_equal_outputs() {
    let g = vit_like();
    // After `optimize` (the builder's order for 16- and 32-bit engines), which leaves it alone.
    let optimized = passes::optimize(&g).expect("optimize");
    assert_eq!(count(&optimized, "gelu"), 1, "calibration caches key the optimised graph: unchanged");
    let o = passes::fuse_linear_activation(&optimized).expect("fuse");
    assert_eq!(count(&g, "gelu"), 1);
    assert_eq!(count(&o, "gelu"), 0, "{}", o.to_text());
    assert_eq!(linear_act(&o, "fc1"), Some((true, GemmAct::Gelu)));
    assert_eq!(linear_attrs(&o, "fc2"), (true, true), "the add after still fuses");
    // The CPU applies the same unary op to the same f32 sums: bit-identical.
    for batch in [1, 3] {
        let x = rand(&[batch, 5, 8]);
        assert_eq!(outputs(&g, &x), outputs(&o, &x), "batch {batch}");
    }
    // Every activation with a fused form, and one without (sigmoid stays a node).
    let vb = VarBuilder::seeded();
    for (name, want) in
        [("relu", Some(GemmAct::Relu)), ("gelu_tanh", Some(GemmAct::GeluTanh)), ("silu", Some(GemmAct::Silu)), ("sigmoid", None)]
    {
        let t = Tracer::new();
        let x = t.input("x", &[1, 3, 8]);
        let h = linear(&vb, "fc", 8, 16).forward(&x).expect("trace");
        let y = match name {
            "relu" => h.relu(),
            "gelu_tanh" => h.gelu(true),
            "silu" => h.silu(),
            _ => h.sigmoid(),
        }
        .expect("trace");
        t.output("y", &y);
        let g = t.graph();
        let o = passes::fuse_linear_activation(&g).expect("fuse");
        assert_eq!(linear_act(&o, "fc").map(|(_, a)| a), want, "{name}");
        let x = rand(&[2, 3, 8]);
        assert_eq!(outputs(&g, &x), outputs(&o, &x), "{name}");
    }
}

#[test]
fn a_linear_read_twice_or_an_output_keeps_its_activation_apart() {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let x = t.input("x", &[1, 3, 8]);
    let h = linear(&vb, "fc", 8, 8).forward(&x).expect("trace");
    let y = (&h.gelu(false).expect("trace") + &h).expect("trace");
    t.output("y", &y);
    let o = passes::fuse_linear_activation(&t.graph()).expect("fuse");
    assert_eq!(linear_act(&o, "fc"), None, "the Linear's value is read by the add too");
    let t = Tracer::new();
    let x = t.input("x", &[1, 3, 8]);
    let h = linear(&vb, "fc", 8, 8).forward(&x).expect("trace");
    t.output("h", &h);
    t.output("y", &h.gelu(false).expect("trace"));
    let o = passes::fuse_linear_activation(&t.graph()).expect("fuse");
    assert_eq!(linear_act(&o, "fc"), None, "the Linear is a graph output");
}
