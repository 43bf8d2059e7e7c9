//! Hardening, round two (docs/RELIABILITY.md, "Round two"): one test per library item, named
//! `hNN_` after the item it checks. Each failed before its fix.

use kiln::calibrate::{CalibrationCache, CalibrationMethod, Calibrator};
use kiln::{Activation, Binary, ConvAttrs, Error, Graph, HostTensor, Op, Unary};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-hardening-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The positions of NaN in `t`.
fn nans(t: &HostTensor) -> Vec<usize> {
    t.data.iter().enumerate().filter(|(_, v)| v.is_nan()).map(|(i, _)| i).collect()
}

/// conv (bias) → add (a residual) → relu, conv → relu → max-pool: every fusion `optimize` makes.
fn fusable_graph(weight: f32) -> Graph {
    let mut g = Graph::default();
    let x = g.push_unchecked(Op::Input { name: "input".into() }, vec![], vec![1, 2, 4, 4], "input".into());
    let w = g.weight("a.weight", Arc::new(HostTensor::new(vec![2, 2, 1, 1], vec![weight, 0.5, -0.25, 1.0])));
    let b = g.weight("a.bias", Arc::new(HostTensor::new(vec![2], vec![-10.0, -10.0])));
    let conv = ConvAttrs { bias: true, ..ConvAttrs::default() };
    let a = g.push(Op::Conv(conv), vec![x, w, b], "a".into()).unwrap();
    let add = g.push(Op::Binary(Binary::Add), vec![a, x], "add".into()).unwrap();
    let r = g.push(Op::Unary(Unary::Relu), vec![add], "relu".into()).unwrap();
    let w2 = g.weight("b.weight", Arc::new(HostTensor::new(vec![2, 2, 1, 1], vec![1.0, 0.0, 0.0, -1.0])));
    let c = g.push(Op::Conv(ConvAttrs::default()), vec![r, w2], "b".into()).unwrap();
    let r2 = g.push(Op::Unary(Unary::Relu), vec![c], "relu2".into()).unwrap();
    let pool = kiln::PoolAttrs { kernel: [2, 2], stride: [2, 2], padding: [0, 0], ceil_mode: false, count_include_pad: true };
    let p = g.push(Op::Pool(kiln::Pool::Max(pool)), vec![r2], "pool".into()).unwrap();
    g.inputs.push(x);
    g.mark_output("y", p);
    g
}

/// Item 1: NaN reaches the output of fused convolutions on the CPU (`v.max(0.0)` made it 0), as
/// it does unfused and in PyTorch, whether it comes from an input pixel or a weight.
#[test]
fn h01_nan_survives_fused_conv_epilogues_on_the_cpu() {
    // The bias of -10 puts every value below 0 before the ReLU: only NaN can get through.
    let mut x = HostTensor::new(vec![1, 2, 4, 4], vec![0.5; 32]);
    x.data[5] = f32::NAN;
    for (weight, input) in [(1.0, &x), (f32::NAN, &HostTensor::new(vec![1, 2, 4, 4], vec![0.5; 32]))] {
        let g = fusable_graph(weight);
        let opt = kiln::passes::optimize(&g).unwrap();
        let fused = opt.nodes.iter().filter(|n| matches!(&n.op, Op::Conv(a) if a.act == Activation::Relu)).count();
        assert_eq!(fused, 2, "both ReLUs are fused:\n{}", opt.to_text());
        let before = kiln::cpu::run(&g, &[("input", input)]).unwrap().remove("y").unwrap();
        let after = kiln::cpu::run(&opt, &[("input", input)]).unwrap().remove("y").unwrap();
        assert!(!nans(&before).is_empty(), "the unfused graph gives NaN: {:?}", before.data);
        assert_eq!(nans(&after), nans(&before), "fused: {:?}, unfused: {:?}", after.data, before.data);
    }
}
