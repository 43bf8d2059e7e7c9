//! A user-defined network written with `#[derive(Module)]`: loaded from the seeded generator and
//! from a safetensors file, traced, and checked for module paths, shapes and parameter names.

use kiln::files::write_safetensors;
use kiln::{
    nn::{AdaptiveAvgPool2d, BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, Linear, LinearConfig, ReLU},
    plugin::Op,
    Error, Forward, Graph, HostTensor, Module, Tensor, Tracer, VarBuilder,
};
use std::collections::{BTreeMap, BTreeSet};

#[derive(Clone, Copy, Debug)]
struct BlockConfig {
    cin: usize,
    cout: usize,
    stride: usize,
}

/// torchvision's `downsample`: an `nn.Sequential(conv1x1, bn)`, hence the numeric names.
#[derive(Module)]
#[module(config = BlockConfig)]
struct Downsample {
    #[module(name = "0", config = Conv2dConfig::new(cfg.cin, cfg.cout, 1).stride(cfg.stride).bias(false))]
    conv: Conv2d,
    #[module(name = "1", config = BatchNorm2dConfig::new(cfg.cout))]
    bn: BatchNorm2d,
}

impl Forward for Downsample {
    fn forward(&self, x: &Tensor) -> kiln::Result<Tensor> {
        self.bn.forward(&self.conv.forward(x)?)
    }
}

/// conv-bn-relu with a residual, projected when the shape changes.
#[derive(Module)]
#[module(config = BlockConfig)]
struct Block {
    #[module(config = Conv2dConfig::new(cfg.cin, cfg.cout, 3).stride(cfg.stride).padding(1).bias(false))]
    conv1: Conv2d,
    #[module(config = BatchNorm2dConfig::new(cfg.cout))]
    bn1: BatchNorm2d,
    relu: ReLU,
    #[module(when = cfg.stride != 1 || cfg.cin != cfg.cout, config = *cfg)]
    downsample: Option<Downsample>,
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> kiln::Result<Tensor> {
        let y = self.bn1.forward(&self.conv1.forward(x)?)?;
        let shortcut = self.downsample.forward(x)?;
        self.relu.forward(&(&y + &shortcut)?)
    }
}

struct NetConfig {
    in_channels: usize,
    widths: Vec<usize>,
    classes: usize,
}

#[derive(Module)]
#[module(config = NetConfig)]
struct Net {
    #[module(config = Conv2dConfig::new(cfg.in_channels, cfg.widths[0], 3).padding(1))]
    stem: Conv2d,
    #[module(
        len = cfg.widths.len(),
        config = BlockConfig {
            cin: cfg.widths[i.saturating_sub(1)],
            cout: cfg.widths[i],
            stride: if i == 1 { 2 } else { 1 },
        }
    )]
    layers: Vec<Block>,
    #[module(config = [1, 1])]
    pool: AdaptiveAvgPool2d,
    #[module(config = LinearConfig::new(*cfg.widths.last().expect("at least one block"), cfg.classes))]
    head: Linear,
}

impl Net {
    fn forward(&self, x: &Tensor) -> kiln::Result<Tensor> {
        let mut x = self.stem.forward(x)?;
        for block in &self.layers {
            x = block.forward(&x)?;
        }
        self.head.forward(&self.pool.forward(&x)?.flatten(1)?)
    }
}

fn config() -> NetConfig {
    // Block 0: 4 -> 4, stride 1 (no downsample); block 1: 4 -> 8, stride 2; block 2: 8 -> 8.
    NetConfig { in_channels: 3, widths: vec![4, 8, 8], classes: 5 }
}

/// Every parameter of `Net` with `config()`, by `state_dict` name, as PyTorch would list them.
fn expected_params() -> BTreeMap<String, Vec<usize>> {
    let mut p = BTreeMap::new();
    let mut add = |name: &str, shape: &[usize]| p.insert(name.to_string(), shape.to_vec());
    add("stem.weight", &[4, 3, 3, 3]);
    add("stem.bias", &[4]);
    for (i, (cin, cout)) in [(4, 4), (4, 8), (8, 8)].into_iter().enumerate() {
        add(&format!("layers.{i}.conv1.weight"), &[cout, cin, 3, 3]);
        for stat in ["weight", "bias", "running_mean", "running_var"] {
            add(&format!("layers.{i}.bn1.{stat}"), &[cout]);
            if i == 1 {
                add(&format!("layers.{i}.downsample.1.{stat}"), &[cout]);
            }
        }
    }
    add("layers.1.downsample.0.weight", &[8, 4, 1, 1]);
    add("head.weight", &[5, 8]);
    add("head.bias", &[5]);
    p
}

fn trace(net: &Net, shape: &[usize]) -> kiln::Result<Graph> {
    let tracer = Tracer::new();
    let x = tracer.input("image", shape);
    let y = net.forward(&x)?;
    tracer.output("logits", &y);
    Ok(tracer.graph())
}

/// The (op, shape) of the node traced at `path`.
fn node<'g>(g: &'g Graph, path: &str) -> (&'g str, &'g [usize]) {
    let matches: Vec<_> = g.nodes.iter().filter(|n| n.path == path && !matches!(n.op, Op::Weight { .. })).collect();
    assert_eq!(matches.len(), 1, "expected one node at `{path}`, got {}:\n{}", matches.len(), g.to_text());
    (matches[0].op.name(), &matches[0].shape)
}

#[test]
fn traced_nodes_carry_module_paths_and_shapes() {
    let net = Net::load(VarBuilder::seeded(), &config()).unwrap();
    assert_eq!(net.layers.len(), 3);
    assert!(net.layers[0].downsample.is_none() && net.layers[1].downsample.is_some() && net.layers[2].downsample.is_none());

    let g = trace(&net, &[2, 3, 16, 12]).unwrap();
    let expected: &[(&str, &str, &[usize])] = &[
        ("stem", "conv2d", &[2, 4, 16, 12]),
        ("layers.0.conv1", "conv2d", &[2, 4, 16, 12]),
        ("layers.0.bn1", "batch_norm2d", &[2, 4, 16, 12]),
        // Inline ops are named in the scope of their first input's module.
        ("layers.0.add", "add", &[2, 4, 16, 12]),
        ("layers.0.relu", "relu", &[2, 4, 16, 12]),
        ("layers.1.conv1", "conv2d", &[2, 8, 8, 6]),
        ("layers.1.bn1", "batch_norm2d", &[2, 8, 8, 6]),
        ("layers.1.downsample.0", "conv2d", &[2, 8, 8, 6]),
        ("layers.1.downsample.1", "batch_norm2d", &[2, 8, 8, 6]),
        ("layers.1.add", "add", &[2, 8, 8, 6]),
        ("layers.2.conv1", "conv2d", &[2, 8, 8, 6]),
        ("layers.2.relu", "relu", &[2, 8, 8, 6]),
        ("pool", "adaptive_avg_pool2d", &[2, 8, 1, 1]),
        ("flatten", "flatten", &[2, 8]),
        ("head", "linear", &[2, 5]),
    ];
    for &(path, op, shape) in expected {
        assert_eq!(node(&g, path), (op, shape), "node at `{path}`");
    }
    // stem, 3 × (conv1, bn1, add, relu), the downsample's conv and bn, pool, flatten, head.
    let computing = g.nodes.iter().filter(|n| !matches!(n.op, Op::Weight { .. } | Op::Input { .. })).count();
    assert_eq!(computing, 1 + 3 * 4 + 2 + 3);
    assert_eq!(g.outputs.len(), 1);
    assert_eq!(g.nodes[g.outputs[0].1].shape, [2, 5]);

    // Parameter names are exactly the PyTorch `state_dict` keys, with the shapes PyTorch has.
    let params: BTreeMap<String, Vec<usize>> = g.weights.iter().map(|(k, v)| (k.clone(), v.shape.clone())).collect();
    assert_eq!(params, expected_params());
    // Each weight node feeds the layer its name says it belongs to.
    for n in g.nodes.iter().filter(|n| !matches!(n.op, Op::Weight { .. } | Op::Input { .. })) {
        for &i in &n.inputs {
            if let Op::Weight { name, .. } = &g.nodes[i].op {
                assert_eq!(name.rsplit_once('.').map(|(owner, _)| owner), Some(n.path.as_str()), "weight `{name}` feeds `{}`", n.path);
            }
        }
    }
}

#[test]
fn seeded_weights_are_generated_by_key() {
    let net = Net::load(VarBuilder::seeded(), &config()).unwrap();
    let ds = net.layers[1].downsample.as_ref().unwrap();
    assert_eq!(ds.conv.weight.name, "layers.1.downsample.0.weight");
    assert_eq!(*ds.conv.weight.value, kiln::dev::weight("layers.1.downsample.0.weight", &[8, 4, 1, 1]));
    assert_eq!(*net.layers[2].bn1.params[3].value, kiln::dev::weight("layers.2.bn1.running_var", &[8]));
}

/// A `state_dict` whose every tensor is distinct: element `j` of the `k`-th key is `k + j / 1000`.
fn distinct_state_dict() -> BTreeMap<String, HostTensor> {
    expected_params()
        .into_iter()
        .enumerate()
        .map(|(k, (name, shape))| {
            let n = shape.iter().product::<usize>();
            (name, HostTensor::new(shape, (0..n).map(|j| k as f32 + j as f32 / 1000.0).collect()))
        })
        .collect()
}

#[test]
fn loads_each_field_from_its_own_safetensors_entry() {
    let dir = tempdir("derive-load");
    let path = dir.join("net.safetensors");
    let state = distinct_state_dict();
    write_safetensors(&path, &state).unwrap();

    let vb = VarBuilder::from_safetensors(&[&path]).unwrap();
    let net = Net::load(vb.clone(), &config()).unwrap();
    vb.check_all_used().unwrap();

    // Reach each tensor through the struct's fields (not through the names it reports) and compare
    // values with what the file holds under the PyTorch key.
    let ds = net.layers[1].downsample.as_ref().unwrap();
    let by_field: Vec<(&str, &HostTensor)> = vec![
        ("stem.weight", &net.stem.weight.value),
        ("stem.bias", &net.stem.bias.as_ref().unwrap().value),
        ("layers.0.conv1.weight", &net.layers[0].conv1.weight.value),
        ("layers.2.conv1.weight", &net.layers[2].conv1.weight.value),
        ("layers.1.bn1.weight", &net.layers[1].bn1.params[0].value),
        ("layers.1.bn1.bias", &net.layers[1].bn1.params[1].value),
        ("layers.1.bn1.running_mean", &net.layers[1].bn1.params[2].value),
        ("layers.1.bn1.running_var", &net.layers[1].bn1.params[3].value),
        ("layers.1.downsample.0.weight", &ds.conv.weight.value),
        ("layers.1.downsample.1.running_var", &ds.bn.params[3].value),
        ("head.weight", &net.head.weight.value),
        ("head.bias", &net.head.bias.as_ref().unwrap().value),
    ];
    for (key, loaded) in by_field {
        assert_eq!(loaded, &state[key], "field loaded for `{key}`");
    }

    // The traced graph holds the same values under the same names.
    let g = trace(&net, &[1, 3, 8, 8]).unwrap();
    for (name, value) in &state {
        assert_eq!(*g.weights[name], *value, "graph weight `{name}`");
    }
}

#[test]
fn a_missing_entry_names_the_field_path() {
    let dir = tempdir("derive-missing");
    let path = dir.join("net.safetensors");
    let mut state = distinct_state_dict();
    state.remove("layers.1.downsample.1.running_var");
    write_safetensors(&path, &state).unwrap();
    let vb = VarBuilder::from_safetensors(&[&path]).unwrap();
    match Net::load(vb, &config()) {
        Err(Error::MissingWeight { key, .. }) => assert_eq!(key, "layers.1.downsample.1.running_var"),
        Err(other) => panic!("expected MissingWeight, got {other}"),
        Ok(_) => panic!("loading succeeded without `layers.1.downsample.1.running_var`"),
    }
}

/// A struct with no configurable field: `Config = ()`, every field `Default::default()`.
#[derive(Module)]
struct Activations {
    relu: ReLU,
    #[module(name = "act")]
    sigmoid: kiln::nn::Sigmoid,
}

#[test]
fn default_configs_and_renamed_segments() {
    let m = Activations::load(VarBuilder::seeded().pp("head"), &()).unwrap();
    let tracer = Tracer::new();
    let y = m.sigmoid.forward(&m.relu.forward(&tracer.input("x", &[1, 2, 3, 3])).unwrap()).unwrap();
    tracer.output("y", &y);
    let g = tracer.graph();
    assert_eq!(node(&g, "head.relu"), ("relu", &[1usize, 2, 3, 3][..]));
    assert_eq!(node(&g, "head.act"), ("sigmoid", &[1usize, 2, 3, 3][..]));
    let paths: BTreeSet<&str> = g.nodes.iter().map(|n| n.path.as_str()).collect();
    assert!(!paths.contains("head.sigmoid"), "{paths:?}");
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-test-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Fields may be named like the generated `load`'s parameters without shadowing them.
#[derive(Module)]
#[module(config = usize)]
struct Shadowing {
    #[module(config = Conv2dConfig::new(*cfg, *cfg, 1))]
    cfg: Conv2d,
    vb: ReLU,
    #[module(config = BatchNorm2dConfig::new(*cfg))]
    after: BatchNorm2d,
}

#[test]
fn fields_named_cfg_and_vb_do_not_shadow_the_parameters() {
    let m = Shadowing::load(VarBuilder::seeded().pp("s"), &6).unwrap();
    assert_eq!((m.cfg.path.as_str(), m.cfg.weight.shape()), ("s.cfg", &[6usize, 6, 1, 1][..]));
    assert_eq!(m.vb.0.path, "s.vb");
    assert_eq!((m.after.path.as_str(), m.after.params[3].name.as_str()), ("s.after", "s.after.running_var"));
    assert_eq!(m.after.params[3].shape(), [6]);
}
