//! The op's CPU reference, traced through `DeformConv2d` and run by Kiln's CPU executor, against
//! `torchvision.ops.deform_conv2d` (fixtures written by
//! `python3 tools/export_reference.py --deform-conv-fixtures --out plugins/deform-conv/tests/fixtures`).
//! Bad inputs are typed errors naming the op, its module path and the shapes.

use kiln::compare;
use kiln::files::read_safetensors;
use kiln::{Error, HostTensor, Module, Tracer, VarBuilder};
use kiln_deform_conv::{DeformConv2d, DeformConv2dConfig, OP};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Relative L2 error allowed between the CPU reference and PyTorch, both in FP32.
const TOL: f64 = 1e-5;

fn fixture() -> PathBuf {
    let dir = std::env::var_os("KILN_DEFORM_FIXTURES")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"), PathBuf::from);
    dir.join("deform_conv2d.reference.safetensors")
}

/// One case of the fixture file: its tensors by field (`input`, `offset`, `mask`, ...).
fn cases() -> BTreeMap<String, BTreeMap<String, HostTensor>> {
    let mut cases: BTreeMap<String, BTreeMap<String, HostTensor>> = BTreeMap::new();
    for (key, t) in read_safetensors(fixture()).expect("deform_conv2d fixtures") {
        let (case, field) = key.rsplit_once('.').expect("`<case>.<field>` keys");
        cases.entry(case.to_string()).or_default().insert(field.to_string(), t);
    }
    cases
}

/// Samples of a case that land at least one pixel outside the input (zero in torchvision).
fn samples_outside(t: &BTreeMap<String, HostTensor>) -> usize {
    let (x, off, w, a) = (&t["input"].shape, &t["offset"], &t["weight"].shape, &t["attrs"].data);
    let (h, wd, kh, kw) = (x[2] as f32, x[3] as f32, w[2], w[3]);
    let (ho, wo) = (off.shape[2], off.shape[3]);
    let taps = kh * kw;
    let mut outside = 0;
    for (ch, plane) in off.data.chunks(ho * wo).enumerate() {
        if ch % 2 == 1 {
            continue;
        }
        let tap = (ch / 2) % taps;
        let dx = &off.data[(ch + 1) * ho * wo..][..ho * wo];
        for p in 0..ho * wo {
            let (oy, ox) = ((p / wo) as f32, (p % wo) as f32);
            let y = oy * a[0] - a[2] + (tap / kw) as f32 * a[4] + plane[p];
            let xx = ox * a[1] - a[3] + (tap % kw) as f32 * a[5] + dx[p];
            outside += usize::from(y <= -1.0 || y >= h || xx <= -1.0 || xx >= wd);
        }
    }
    outside
}

fn attr_pair(a: &[f32], i: usize) -> (usize, usize) {
    (a[i] as usize, a[i + 1] as usize)
}

#[test]
fn deform_conv2d_matches_torchvision() {
    let path = fixture();
    let weights = VarBuilder::from_safetensors(&[&path]).expect("fixture weights");
    let cases = cases();
    assert!(cases.len() >= 5, "expected the full set of deform_conv2d cases, found {:?}", cases.keys());
    let (mut masked, mut unmasked, mut outside_cases) = (0, 0, 0);
    let (mut batched, mut grouped, mut offset_grouped, mut non_square) = (false, false, false, false);
    for (case, t) in &cases {
        let (x, off, w) = (&t["input"], &t["offset"], &t["weight"]);
        let a = &t["attrs"].data;
        let [cout, cin_g, kh, kw] = <[usize; 4]>::try_from(w.shape.as_slice()).expect("4-d weight");
        let groups = x.shape[1] / cin_g;
        let ((sh, sw), (ph, pw), (dh, dw)) = (attr_pair(a, 0), attr_pair(a, 2), attr_pair(a, 4));
        let config = DeformConv2dConfig::new(x.shape[1], cout, kh)
            .kernel_hw(kh, kw)
            .stride_hw(sh, sw)
            .padding_hw(ph, pw)
            .dilation_hw(dh, dw)
            .groups(groups)
            .bias(t.contains_key("bias"));
        let dcn = DeformConv2d::load(weights.pp(case), &config).expect("load");
        let tracer = Tracer::new();
        let tx = tracer.input("x", &x.shape);
        let toff = tracer.input("offset", &off.shape);
        let tmask = t.get("mask").map(|m| tracer.input("mask", &m.shape));
        let y = dcn.forward(&tx, &toff, tmask.as_ref()).unwrap_or_else(|e| panic!("{case}: trace: {e}"));
        assert_eq!(y.shape(), t["output"].shape.as_slice(), "{case}: shape rule");
        tracer.output("y", &y);
        let graph = tracer.graph();
        assert!(graph.nodes.iter().any(|n| n.op.name() == OP && n.path == *case), "{case}: one `{OP}` node at the module's path");
        let mut bound: Vec<(&str, &HostTensor)> = vec![("x", x), ("offset", off)];
        bound.extend(t.get("mask").map(|m| ("mask", m)));
        let got = kiln::run_cpu(&graph, &bound).unwrap_or_else(|e| panic!("{case}: cpu: {e}"));
        let c = compare(case, &got["y"], &t["output"]);
        let outside = samples_outside(t);
        println!("{c}   ({outside} of {} samples outside)", off.data.len() / 2);
        assert!(c.passes(TOL), "{case}: {c} exceeds rel L2 {TOL}");
        // What the set covers, so that a regenerated fixture cannot silently lose a feature.
        if t.contains_key("mask") {
            masked += 1
        } else {
            unmasked += 1
        }
        outside_cases += usize::from(outside > 0);
        batched |= x.shape[0] > 1;
        grouped |= groups > 1;
        offset_grouped |= off.shape[1] > 2 * kh * kw;
        non_square |= x.shape[2] != x.shape[3] && kh != kw && sh != sw && ph != pw && dh != dw;
    }
    assert!(masked > 0 && unmasked > 0, "cases with and without a mask");
    assert!(outside_cases >= 3, "offsets that push samples outside the image");
    assert!(batched && grouped && offset_grouped && non_square, "batch > 1, groups, offset groups, non-square everything");
}

#[test]
fn bad_shapes_are_typed_errors_with_the_module_path() {
    let dcn = DeformConv2d::load(VarBuilder::seeded().pp("neck.dcn"), &DeformConv2dConfig::new(4, 8, 3).padding(1)).expect("load");
    let tracer = Tracer::new();
    let x = tracer.input("x", &[2, 4, 10, 12]);
    // 18 offset channels at 10x11 where the output is 10x12.
    let offset = tracer.input("offset", &[2, 18, 10, 11]);
    let err = dcn.forward(&x, &offset, None).expect_err("offset of the wrong size");
    match &err {
        Error::Shape { path, op, reason, got } => {
            assert_eq!((path.as_str(), op.as_str()), ("neck.dcn", OP));
            assert!(reason.to_string().contains("offset must be [2, 18, 10, 12]"), "{reason}");
            assert!(got.contains(&vec![2, 4, 10, 12]) && got.contains(&vec![2, 18, 10, 11]), "{got:?}");
        }
        other => panic!("expected a shape error, got {other}"),
    }
    println!("{err}");
    let offset = tracer.input("offset2", &[2, 18, 10, 12]);
    let mask = tracer.input("mask", &[2, 18, 10, 12]);
    let err = dcn.forward(&x, &offset, Some(&mask)).expect_err("mask with offset channels");
    assert!(err.to_string().contains("mask must be [2, 9, 10, 12]"), "{err}");
    let err = DeformConv2d::load(VarBuilder::seeded().pp("bad"), &DeformConv2dConfig::new(6, 8, 3).groups(4)).expect_err("groups");
    assert!(matches!(&err, Error::Config { reason } if reason.contains("bad") && reason.contains("groups 4")), "{err}");
    let err = DeformConv2d::load(VarBuilder::from_tensors(BTreeMap::new()), &DeformConv2dConfig::new(4, 8, 3)).expect_err("no weights");
    assert!(matches!(&err, Error::MissingWeight { key, .. } if key == "weight"), "{err}");
}

#[test]
fn the_op_and_its_converter_are_registered() {
    assert!(kiln::plugin::lookup(OP).is_some(), "CustomOp registered");
    assert!(kiln::plugin::converter(OP).expect("registry").is_some(), "GPU converter registered");
    kiln::plugin::check_registry().expect("no duplicate op names");
}
