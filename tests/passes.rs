//! Each graph pass, checked two ways on hand-made graphs: the CPU executor gives the same outputs
//! before and after (relative L2 ≤ 1e-5 on random inputs), and the rewritten graph has the
//! expected structure.

use kiln::compare;
use kiln::dev::passes;
use kiln::plugin::OpDef;
use kiln::{
    nn::{BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, ConvTranspose2d},
    Forward, Module, Tensor, Tracer, VarBuilder,
};
use kiln::{
    plugin::{Activation, ConvAttrs, Op, Unary},
    Graph, HostTensor,
};

fn rand(shape: &[usize]) -> HostTensor {
    kiln::dev::uniform_tensor(shape, kiln::dev::fresh_seed())
}

/// Runs both graphs on the same random input (batch `batch`) and checks every output agrees.
fn assert_same_outputs(before: &Graph, after: &Graph, batch: usize) {
    let traced = &before.nodes[before.inputs[0]].shape;
    let mut shape = traced.clone();
    shape[0] = batch;
    let x = rand(&shape);
    let name = before.input_names()[0].to_string();
    let want = kiln::run_cpu(before, &[(&name, &x)]).expect("run before");
    let got = kiln::run_cpu(after, &[(&name, &x)]).expect("run after");
    assert_eq!(want.keys().collect::<Vec<_>>(), got.keys().collect::<Vec<_>>());
    for (k, w) in &want {
        let c = compare(k, &got[k], w);
        println!("{c}");
        assert!(c.passes(1e-5), "{c}");
    }
}

/// Every input precedes its reader; every weight node names a held weight and vice versa.
fn assert_well_formed(g: &Graph) {
    for (id, n) in g.nodes.iter().enumerate() {
        assert!(n.inputs.iter().all(|&i| i < id), "%{id} ({}) reads a later node:\n{}", n.path, g.to_text());
        if let Op::Weight { name, .. } = &n.op {
            assert!(g.weights.contains_key(name), "weight node `{name}` has no data");
        }
    }
    let names: Vec<&String> = g.nodes.iter().filter_map(|n| if let Op::Weight { name, .. } = &n.op { Some(name) } else { None }).collect();
    assert_eq!(names.len(), g.weights.len(), "weights held but not used, or used twice: {:?}", g.weights.keys());
    for (_, o) in &g.outputs {
        assert!(*o < g.nodes.len());
    }
}

fn count(g: &Graph, op: &str) -> usize {
    g.nodes.iter().filter(|n| n.op.name() == op).count()
}

fn conv_attrs(g: &Graph, path: &str) -> ConvAttrs {
    let node = g.nodes.iter().find(|n| n.path == path && matches!(n.op, Op::Conv(_)));
    match node.map(|n| &n.op) {
        Some(Op::Conv(a)) => *a,
        _ => panic!("no conv at `{path}`:\n{}", g.to_text()),
    }
}

fn conv(vb: &VarBuilder, path: &str, c: Conv2dConfig) -> Conv2d {
    Conv2d::load(vb.pp(path), &c).expect("conv")
}

fn bn(vb: &VarBuilder, path: &str, c: usize) -> BatchNorm2d {
    BatchNorm2d::load(vb.pp(path), &BatchNorm2dConfig::new(c)).expect("bn")
}

/// torchvision's BasicBlock with a downsample branch, traced in torchvision's order: the
/// downsample runs after conv2/bn2, so the residual is defined after the conv it joins.
fn resnet_block(x: &Tensor, vb: &VarBuilder, cin: usize, cout: usize, stride: usize) -> Tensor {
    let c3 = |i, o, s| Conv2dConfig::new(i, o, 3).stride(s).padding(1).bias(false);
    let out = conv(vb, "conv1", c3(cin, cout, stride)).forward(x).expect("trace");
    let out = bn(vb, "bn1", cout).forward(&out).and_then(|t| t.relu()).expect("trace");
    let out = conv(vb, "conv2", c3(cout, cout, 1)).forward(&out).expect("trace");
    let out = bn(vb, "bn2", cout).forward(&out).expect("trace");
    let identity = if stride != 1 || cin != cout {
        let d = conv(vb, "downsample.0", Conv2dConfig::new(cin, cout, 1).stride(stride).bias(false)).forward(x).expect("trace");
        bn(vb, "downsample.1", cout).forward(&d).expect("trace")
    } else {
        x.clone()
    };
    out.add(&identity).and_then(|t| t.relu()).expect("trace")
}

/// Two blocks: one with a downsample branch, one with an identity shortcut.
fn two_blocks() -> Graph {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let x = t.input("x", &[1, 4, 10, 9]);
    let y = resnet_block(&x, &vb.pp("layer1.0"), 4, 8, 2);
    let y = resnet_block(&y, &vb.pp("layer1.1"), 8, 8, 1);
    t.output("y", &y);
    t.graph()
}

#[test]
fn fold_batchnorm_on_resnet_blocks() {
    let g = two_blocks();
    let folded = passes::fold_batchnorm(&g).expect("fold");
    assert_well_formed(&folded);
    assert_same_outputs(&g, &folded, 2);
    assert_eq!((count(&g, "batch_norm2d"), count(&folded, "batch_norm2d")), (5, 0));
    assert_eq!(count(&folded, "conv2d"), 5);
    // Each fold drops the BN node, its 4 parameters and the conv's old weight, and adds 2 tensors.
    assert_eq!(folded.nodes.len(), g.nodes.len() - 5 * 4);
    for n in folded.nodes.iter().filter(|n| matches!(n.op, Op::Conv(a) if !a.transposed)) {
        assert!(conv_attrs(&folded, &n.path).bias, "`{}` has no folded bias", n.path);
        let names: Vec<&str> = n.inputs[1..].iter().map(|&i| folded.nodes[i].path.as_str()).collect();
        assert_eq!(names, [format!("{}.weight.folded", n.path), format!("{}.bias.folded", n.path)]);
    }
    assert!(
        !folded.weights.keys().any(|k| k.contains("bn") || k.ends_with(".weight") || k.contains("running")),
        "{:?}",
        folded.weights.keys()
    );
    // The input graph is untouched (passes are pure).
    assert_eq!(count(&g, "batch_norm2d"), 5);
}

/// A PoolFormer block's MLP as 1×1 convs with a layer scale, `x + scale·fc2(gelu(fc1(x)))`, a
/// shift written as an add after a transposed conv, and a mul by a constant that is not per
/// channel: the per-channel ones fold into their convs (and the residual then fuses), the other stays.
#[test]
fn a_per_channel_scale_or_shift_after_a_conv_folds_into_it() {
    use kiln::plugin::Binary;
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let x = t.input("x", &[1, 8, 5, 6]).relu().expect("trace");
    let fc1 = Conv2d::load(vb.pp("mlp.fc1"), &Conv2dConfig::new(8, 16, 1)).expect("fc1");
    let fc2 = Conv2d::load(vb.pp("mlp.fc2"), &Conv2dConfig::new(16, 8, 1)).expect("fc2");
    let h = fc1.forward(&x).and_then(|h| h.gelu(false)).and_then(|h| fc2.forward(&h)).expect("mlp");
    let scale = vb.get(&[8, 1, 1], "layer_scale2").expect("scale");
    let y = (&x + &h.binary_weight("layer_scale2", Binary::Mul, &scale).expect("scale")).expect("residual");
    let up = ConvTranspose2d::load(vb.pp("up"), &Conv2dConfig::new(8, 4, 2).stride(2)).expect("up");
    let shift = vb.get(&[1, 4, 1, 1], "up.shift").expect("shift");
    let z = up.forward(&y).and_then(|z| z.binary_weight("up.add", Binary::Add, &shift)).expect("shift");
    let grid = vb.get(&[10, 12], "grid").expect("grid");
    let conv = Conv2d::load(vb.pp("last"), &Conv2dConfig::new(4, 4, 3).padding(1)).expect("last");
    let w = conv.forward(&z).and_then(|w| w.binary_weight("grid", Binary::Mul, &grid)).expect("grid");
    t.output("y", &w);
    let g = t.graph();
    let folded = passes::fold_conv_affine(&g).expect("fold");
    assert_well_formed(&folded);
    assert_same_outputs(&g, &folded, 2);
    assert_eq!((count(&g, "mul"), count(&folded, "mul")), (2, 1), "{}", folded.to_text());
    assert_eq!((count(&g, "add"), count(&folded, "add")), (2, 1), "the residual add stays: {}", folded.to_text());
    for path in ["mlp.fc2", "up"] {
        let n = folded.nodes.iter().find(|n| n.path == path).expect("conv");
        let names: Vec<&str> = n.inputs[1..].iter().map(|&i| folded.nodes[i].path.as_str()).collect();
        assert_eq!(names, [format!("{path}.weight.folded"), format!("{path}.bias.folded")]);
    }
    let optimized = passes::optimize(&g).expect("optimize");
    assert_same_outputs(&g, &optimized, 3);
    assert!(conv_attrs(&optimized, "mlp.fc2").residual, "the block's add is fc2's residual once the scale is folded");
}

/// A conv's layer scale of 1e-6 (ConvNeXt's and PoolFormer's initial value) would fold into
/// weights FP16 cannot hold: it stays a multiply, as PyTorch runs it.
#[test]
fn a_scale_too_small_for_fp16_weights_stays_after_the_conv() {
    use kiln::plugin::Binary;
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let x = t.input("x", &[1, 8, 5, 6]).relu().expect("trace");
    let fc = Conv2d::load(vb.pp("fc"), &Conv2dConfig::new(8, 8, 1)).expect("fc");
    let gamma = kiln::Param { name: "gamma".into(), value: std::sync::Arc::new(kiln::HostTensor::new(vec![8, 1, 1], vec![1e-6; 8])) };
    let y = fc.forward(&x).and_then(|h| h.binary_weight("ls", Binary::Mul, &gamma)).expect("scale");
    t.output("y", &(&x + &y).expect("residual"));
    let g = t.graph();
    let folded = passes::fold_conv_affine(&g).expect("fold");
    assert_eq!(count(&folded, "mul"), 1, "{}", folded.to_text());
    assert_same_outputs(&g, &folded, 2);
}

#[test]
fn fuse_conv_add_relu_on_resnet_blocks() {
    let g = passes::fold_batchnorm(&two_blocks()).expect("fold");
    let fused = passes::fuse_conv_activation(&g).expect("fuse");
    assert_well_formed(&fused);
    assert_same_outputs(&g, &fused, 3);
    assert_eq!((count(&fused, "add"), count(&fused, "relu")), (0, 0), "{}", fused.to_text());
    // 4 ReLUs and 2 Adds absorbed.
    assert_eq!(fused.nodes.len(), g.nodes.len() - 6);
    let relu = |residual| ConvAttrs { residual, act: Activation::Relu, ..Default::default() };
    for (path, want) in [
        ("layer1.0.conv1", relu(false)),
        ("layer1.0.conv2", relu(true)),
        ("layer1.0.downsample.0", ConvAttrs::default()),
        ("layer1.1.conv1", relu(false)),
        ("layer1.1.conv2", relu(true)),
    ] {
        let a = conv_attrs(&fused, path);
        assert_eq!((a.residual, a.act), (want.residual, want.act), "{path}");
    }
    // layer1.0.conv2's residual is the downsample conv, which now precedes it.
    let id = |path: &str| fused.nodes.iter().position(|n| n.path == path && n.op.name() == "conv2d").expect("conv");
    let conv2 = &fused.nodes[id("layer1.0.conv2")];
    assert_eq!(conv2.inputs.len(), 4);
    assert_eq!(*conv2.inputs.last().expect("residual"), id("layer1.0.downsample.0"));
    // layer1.1.conv2's residual is the previous block's output.
    assert_eq!(*fused.nodes[id("layer1.1.conv2")].inputs.last().expect("residual"), id("layer1.0.conv2"));
    // The graph output is the last fused conv.
    assert_eq!(fused.outputs, vec![("y".to_string(), id("layer1.1.conv2"))]);
}

#[test]
fn optimize_runs_every_pass() {
    let g = two_blocks();
    let o = passes::optimize(&g).expect("optimize");
    assert_well_formed(&o);
    assert_same_outputs(&g, &o, 1);
    let ops: Vec<&str> = o.nodes.iter().filter(|n| !matches!(n.op, Op::Weight { .. })).map(|n| n.op.name()).collect();
    assert_eq!(ops, ["input", "conv2d", "conv2d", "conv2d", "conv2d", "conv2d"]);
    // Already optimised: a second run changes nothing.
    let again = passes::optimize(&o).expect("optimize again");
    assert_eq!(again.nodes, o.nodes);
    assert_eq!(again.outputs, o.outputs);
}

#[test]
fn deconv_batchnorm_relu() {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let x = t.input("x", &[1, 6, 5, 4]);
    // Grouped, so the fold must pick each weight row's output channel by group.
    let c = Conv2dConfig::new(6, 4, 4).stride(2).padding(1).groups(2).output_padding(1).bias(true);
    let deconv = ConvTranspose2d::load(vb.pp("up.0"), &c).expect("deconv");
    let y = deconv.forward(&x).and_then(|y| bn(&vb, "up.1", 4).forward(&y)).and_then(|y| y.relu()).expect("trace");
    t.output("y", &y);
    let g = t.graph();
    let o = passes::optimize(&g).expect("optimize");
    assert_well_formed(&o);
    assert_same_outputs(&g, &o, 2);
    let ops: Vec<&str> = o.nodes.iter().map(|n| n.op.name()).collect();
    assert_eq!(ops, ["input", "weight", "weight", "conv_transpose2d"]);
    let a = conv_attrs(&o, "up.0");
    assert!(a.bias && a.groups == 2 && a.output_padding == [1, 1] && a.act == Activation::Relu && !a.residual, "{a:?}");
    assert_eq!(o.weights.keys().collect::<Vec<_>>(), ["up.0.bias.folded", "up.0.weight.folded"]);
}

#[test]
fn transposed_conv_takes_no_residual() {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let x = t.input("x", &[1, 4, 3, 3]);
    let c = Conv2dConfig::new(4, 4, 4).stride(2).padding(1);
    let up = ConvTranspose2d::load(vb.pp("up"), &c).expect("deconv").forward(&x).expect("trace");
    let skip = ConvTranspose2d::load(vb.pp("skip"), &c).expect("deconv").forward(&x).expect("trace");
    let y = up.add(&skip).and_then(|y| y.relu()).expect("trace");
    t.output("y", &y);
    let g = t.graph();
    let o = passes::fuse_conv_activation(&g).expect("fuse");
    assert_same_outputs(&g, &o, 1);
    assert_eq!(o.nodes, g.nodes);
}

#[test]
fn dead_branch_is_removed() {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let x = t.input("x", &[1, 3, 6, 6]);
    let a = conv(&vb, "a", Conv2dConfig::new(3, 4, 3).padding(1)).forward(&x).and_then(|y| y.relu()).expect("trace");
    let dead = conv(&vb, "b", Conv2dConfig::new(3, 4, 1)).forward(&x).and_then(|y| y.sigmoid()).expect("trace");
    let _dead_too = dead.mul(&a).expect("trace");
    let out = a.sigmoid().expect("trace");
    t.output("out", &out);
    let g = t.graph();
    let clean = passes::remove_dead_nodes(&g).expect("dead-node removal");
    assert_well_formed(&clean);
    assert_same_outputs(&g, &clean, 2);
    let ops: Vec<(&str, &str)> = clean.nodes.iter().map(|n| (n.op.name(), n.path.as_str())).collect();
    assert_eq!(
        ops,
        [("input", "x"), ("weight", "a.weight"), ("weight", "a.bias"), ("conv2d", "a"), ("relu", "relu"), ("sigmoid", "sigmoid")]
    );
    assert_eq!(clean.weights.keys().collect::<Vec<_>>(), ["a.bias", "a.weight"]);
    assert_eq!((clean.inputs.clone(), clean.outputs.clone()), (vec![0], vec![("out".to_string(), 5)]));
}

#[test]
fn unused_inputs_stay_bound() {
    let t = Tracer::new();
    let x = t.input("x", &[1, 2, 3, 3]);
    let _unused = t.input("mask", &[1, 2, 3, 3]);
    t.output("y", &x.relu().expect("trace"));
    let clean = passes::remove_dead_nodes(&t.graph()).expect("dead-node removal");
    assert_eq!(clean.input_names(), ["x", "mask"]);
    assert_eq!(clean.nodes.len(), 3);
}

#[test]
fn marked_intermediates_block_fusion() {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let x = t.input("x", &[1, 4, 6, 6]);
    // A conv marked as an output keeps its BatchNorm and its ReLU.
    let c1 = conv(&vb, "c1", Conv2dConfig::new(4, 4, 3).padding(1).bias(false)).forward(&x).expect("trace");
    t.output("c1", &c1);
    let b1 = bn(&vb, "b1", 4).forward(&c1).and_then(|y| y.relu()).expect("trace");
    // A marked BatchNorm folds (the folded conv carries its value) but keeps its ReLU.
    let c2 = conv(&vb, "c2", Conv2dConfig::new(4, 4, 3).padding(1).bias(false)).forward(&b1).expect("trace");
    let b2 = bn(&vb, "b2", 4).forward(&c2).expect("trace");
    t.output("b2", &b2);
    let r2 = b2.relu().expect("trace");
    // A marked Add absorbs its conv but keeps its ReLU.
    let c3 = conv(&vb, "c3", Conv2dConfig::new(4, 4, 1)).forward(&r2).expect("trace");
    let sum = c3.add(&r2).expect("trace");
    t.output("sum", &sum);
    t.output("y", &sum.relu().expect("trace"));
    let g = t.graph();
    let o = passes::optimize(&g).expect("optimize");
    assert_well_formed(&o);
    assert_same_outputs(&g, &o, 2);
    assert_eq!(count(&o, "batch_norm2d"), 1);
    assert_eq!(count(&o, "relu"), 3);
    assert_eq!(count(&o, "add"), 0);
    let plain = |a: ConvAttrs| (a.residual, a.act);
    assert_eq!(plain(conv_attrs(&o, "c1")), (false, Activation::None));
    assert_eq!(plain(conv_attrs(&o, "c2")), (false, Activation::None));
    assert!(conv_attrs(&o, "c2").bias);
    assert_eq!(plain(conv_attrs(&o, "c3")), (true, Activation::None));
    let output = |name: &str| &o.nodes[o.outputs.iter().find(|(n, _)| n == name).expect("output").1];
    assert_eq!((output("c1").path.as_str(), output("b2").path.as_str(), output("sum").path.as_str()), ("c1", "c2", "c3"));
}

#[test]
fn add_is_commutative_and_shared_values_stay() {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let x = t.input("x", &[1, 3, 5, 5]);
    // identity + conv: the conv is the second operand.
    let c = conv(&vb, "c", Conv2dConfig::new(3, 3, 3).padding(1)).forward(&x).expect("trace");
    let s = x.add(&c).and_then(|y| y.relu()).expect("trace");
    // conv + conv: the first becomes the fused node, the second its residual.
    let p = conv(&vb, "p", Conv2dConfig::new(3, 3, 1)).forward(&s).expect("trace");
    let q = conv(&vb, "q", Conv2dConfig::new(3, 3, 1)).forward(&s).expect("trace");
    let pq = p.add(&q).expect("trace");
    // A conv read twice (by an add and a mul) is not fused; neither is add(conv, conv) of one conv.
    let r = conv(&vb, "r", Conv2dConfig::new(3, 3, 1)).forward(&pq).expect("trace");
    let twice = r.add(&r).expect("trace");
    let y = twice.mul(&r).expect("trace");
    t.output("y", &y);
    let g = t.graph();
    let o = passes::fuse_conv_activation(&g).expect("fuse");
    assert_well_formed(&o);
    assert_same_outputs(&g, &o, 2);
    let attrs = |p: &str| {
        let a = conv_attrs(&o, p);
        (a.residual, a.act)
    };
    assert_eq!(attrs("c"), (true, Activation::Relu));
    assert_eq!(attrs("p"), (true, Activation::None));
    assert_eq!(attrs("q"), (false, Activation::None));
    assert_eq!(attrs("r"), (false, Activation::None));
    assert_eq!((count(&o, "add"), count(&o, "relu"), count(&o, "mul")), (1, 0, 1));
}

#[test]
fn a_module_applied_twice_folds_under_distinct_names() {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let (a, b) = (t.input("a", &[1, 3, 5, 5]), t.input("b", &[1, 3, 5, 5]));
    let c = conv(&vb, "shared.conv", Conv2dConfig::new(3, 4, 3).padding(1));
    let n = bn(&vb, "shared.bn", 4);
    let ya = c.forward(&a).and_then(|y| n.forward(&y)).expect("trace");
    let yb = c.forward(&b).and_then(|y| n.forward(&y)).expect("trace");
    t.output("y", &ya.mul(&yb).expect("trace"));
    let g = t.graph();
    let o = passes::fold_batchnorm(&g).expect("fold");
    assert_well_formed(&o);
    assert_eq!(count(&o, "batch_norm2d"), 0);
    let names: Vec<&String> = o.weights.keys().collect();
    let want = ["shared.conv.bias.folded", "shared.conv.bias.folded.1", "shared.conv.weight.folded", "shared.conv.weight.folded.1"];
    assert_eq!(names, want);
    let (xa, xb) = (rand(&[1, 3, 5, 5]), rand(&[1, 3, 5, 5]));
    let run = |g: &Graph| kiln::run_cpu(g, &[("a", &xa), ("b", &xb)]).expect("run").remove("y").expect("y");
    let c = compare("y", &run(&o), &run(&g));
    assert!(c.passes(1e-5), "{c}");
}

#[test]
fn conv_read_by_two_nodes_keeps_its_batchnorm() {
    let vb = VarBuilder::seeded();
    let t = Tracer::new();
    let x = t.input("x", &[1, 3, 5, 5]);
    let c = conv(&vb, "c", Conv2dConfig::new(3, 3, 3).padding(1)).forward(&x).expect("trace");
    let b = bn(&vb, "b", 3).forward(&c).expect("trace");
    t.output("y", &b.add(&c).expect("trace"));
    let g = t.graph();
    let o = passes::fold_batchnorm(&g).expect("fold");
    assert_eq!(o.nodes, g.nodes);
}

#[test]
fn topological_order_is_stable_and_detects_cycles() {
    let g = two_blocks();
    let keep = vec![true; g.nodes.len()];
    assert_eq!(passes::topological_order(&g, &keep).expect("order"), (0..g.nodes.len()).collect::<Vec<_>>());
    let mut cyclic = g.clone();
    let last = cyclic.nodes.len() - 1;
    cyclic.nodes[1].inputs.push(last);
    let err = passes::topological_order(&cyclic, &keep).expect_err("cycle");
    assert!(err.to_string().contains("cycle"), "{err}");
}

/// ResNet-18 (seeded weights) through every pass: same logits, every BN folded, and every ReLU
/// fused except the stem's... which follows a conv too, so none remain.
#[test]
fn optimize_resnet18() {
    let g = kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 64).expect("trace resnet18");
    let o = passes::optimize(&g).expect("optimize");
    assert_well_formed(&o);
    assert_same_outputs(&g, &o, 2);
    assert_eq!((count(&o, "batch_norm2d"), count(&o, "add"), count(&o, "relu")), (0, 0, 0));
    assert_eq!(count(&o, "conv2d"), 20);
    let residual = o.nodes.iter().filter(|n| matches!(n.op, Op::Conv(a) if a.residual)).count();
    assert_eq!(residual, 8);
}

/// ResNet-50 at 224×224 and CenterNet at 512×512, batch 1, on the CPU executor (run with
/// `--release --ignored`).
#[test]
#[ignore = "timing: cargo test --release -p kiln --test passes -- --ignored --nocapture"]
fn time_models_cpu() {
    for (model, size) in [("resnet50", 224), ("centernet", 512)] {
        let g = kiln_models::trace(model, VarBuilder::seeded(), 1, size).expect("trace");
        let o = passes::optimize(&g).expect("optimize");
        let x = rand(&[1, 3, size, size]);
        for (name, graph) in [("traced", &g), ("optimized", &o)] {
            let mut times = vec![];
            for _ in 0..3 {
                let start = std::time::Instant::now();
                kiln::run_cpu(graph, &[("input", &x)]).expect("run");
                times.push(format!("{:.3}", start.elapsed().as_secs_f64()));
            }
            println!("{model} {size}x{size} batch 1, {name} graph: {} s", times.join(", "));
        }
    }
}

/// CenterNet's upsampler (transposed conv → BN → ReLU, three times) ends up as three transposed
/// convs with folded BN and fused ReLU: no BatchNorm and no ReLU reading a transposed conv remain,
/// so the engine needs no rewrite of its own.
#[test]
fn centernet_upsampler_is_fully_fused() {
    let g = kiln_models::trace("centernet", VarBuilder::seeded(), 1, 64).expect("trace");
    let o = passes::optimize(&g).expect("optimize");
    assert_well_formed(&o);
    assert_eq!(count(&o, "batch_norm2d"), 0, "{}", o.to_text());
    let deconvs: Vec<&ConvAttrs> =
        o.nodes.iter().filter_map(|n| if let Op::Conv(a) = &n.op { a.transposed.then_some(a) } else { None }).collect();
    assert_eq!(deconvs.len(), 3);
    assert!(deconvs.iter().all(|a| a.act == Activation::Relu && a.bias), "{deconvs:?}");
    let relu_after_deconv =
        o.nodes.iter().any(|n| matches!(n.op, Op::Unary(Unary::Relu)) && matches!(o.nodes[n.inputs[0]].op, Op::Conv(a) if a.transposed));
    assert!(!relu_after_deconv, "{}", o.to_text());
}

/// The arena planner on ResNet-50's optimised graph at batch 64 in FP16 (what the builder
/// estimates before lowering): each residual is overwritten by the conv that adds it, so the plan
/// needs no more than the live peak. That peak is in layer2.0, where the block input (needed by
/// the downsample) lives beside conv1's and conv2's outputs: 159.25 MiB.
#[test]
fn resnet50_plans_its_arena_at_the_live_peak() {
    let graph = kiln_models::trace("resnet50", VarBuilder::seeded(), 1, 224).expect("trace");
    let g = passes::optimize(&graph).expect("optimize");
    let (batch, elem) = (64, 2);
    let (p, step_of) = kiln::dev::plan::estimate_arena(&g, elem, batch);
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let at = step_of.iter().position(|&s| s == Some(p.peak_step)).map(|n| g.nodes[n].path.clone()).unwrap_or_default();
    println!("arena {:.2} MiB, live peak {:.2} MiB at `{at}`, {} convs in place", mib(p.bytes), mib(p.peak), p.in_place.len());
    assert_eq!(p.in_place.len(), 16, "every bottleneck's residual is overwritten");
    let floor = (256 * 56 * 56 + 128 * 56 * 56 + 128 * 28 * 28) * batch * elem;
    assert_eq!((p.peak, at.as_str()), (floor, "layer2.0.conv2"), "peak {:.2} MiB", mib(p.peak));
    assert!(p.bytes <= p.peak + p.peak / 50, "the greedy plan is within 2% of the peak: {:.2} MiB", mib(p.bytes));
}

/// The ResNet stem: conv → BN → ReLU → max-pool. After `optimize` it is one conv carrying the
/// pool (and the output is the same); a conv whose ReLU output another node also reads, or a conv
/// without a ReLU, keeps its max-pool apart.
#[test]
fn fuse_conv_max_pool_on_the_stem() {
    let stem = |relu: bool, tap: bool| {
        let vb = VarBuilder::seeded();
        let t = Tracer::new();
        let x = t.input("x", &[1, 3, 23, 18]);
        let y = conv(&vb, "conv1", Conv2dConfig::new(3, 16, 7).stride(2).padding(3).bias(false)).forward(&x).expect("trace");
        let mut y = bn(&vb, "bn1", 16).forward(&y).expect("trace");
        if relu {
            y = y.relu().expect("trace");
        }
        if tap {
            t.output("tap", &y);
        }
        let pool = kiln::nn::MaxPool2d::load(vb.pp("maxpool"), &kiln::nn::Pool2dConfig::new(3).stride(2).padding(1)).expect("pool");
        t.output("y", &pool.forward(&y).expect("trace"));
        t.graph()
    };
    let g = stem(true, false);
    let o = passes::optimize(&g).expect("optimize");
    assert_well_formed(&o);
    assert_same_outputs(&g, &o, 2);
    assert_eq!(count(&o, "max_pool2d"), 0, "{}", o.to_text());
    let a = conv_attrs(&o, "conv1");
    let pool = a.pool.expect("the pool is fused");
    assert_eq!((a.act, pool.kernel, pool.stride, pool.padding), (Activation::Relu, [3, 3], [2, 2], [1, 1]));
    let fused = o.nodes.iter().find(|n| n.path == "conv1").expect("conv1");
    assert_eq!(fused.shape, [1, 16, 6, 5], "the node's shape is the pool's output");
    let label = a.label();
    assert!(label.ends_with("+relu +max_pool k3 s2 p1"), "{label}");

    for (relu, tap) in [(true, true), (false, false)] {
        let o = passes::optimize(&stem(relu, tap)).expect("optimize");
        assert_eq!(count(&o, "max_pool2d"), 1, "relu {relu}, tap {tap}: {}", o.to_text());
        assert!(conv_attrs(&o, "conv1").pool.is_none());
    }
}
