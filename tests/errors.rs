//! Bad input gives a typed `kiln::Error` whose message names what the user must fix (the key, the
//! module path, both shapes, the file), never a panic.

use kiln::files::write_safetensors;
use kiln::{
    nn::{Conv2d, Conv2dConfig},
    Error, Forward, HostTensor, Module, Tracer, VarBuilder,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-test-errors-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A safetensors file assembled by hand: the 8-byte little-endian header length, the JSON header,
/// then the data. `entries` are (name, dtype, shape, bytes); offsets follow the entries' order.
fn raw_safetensors(entries: &[(&str, &str, &[usize], Vec<u8>)]) -> Vec<u8> {
    let mut offset = 0;
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in entries {
        let end = offset + bytes.len();
        header.insert(name.to_string(), serde_json::json!({ "dtype": dtype, "shape": shape, "data_offsets": [offset, end] }));
        data.extend_from_slice(bytes);
        offset = end;
    }
    with_header(&serde_json::Value::Object(header).to_string(), &data)
}

fn with_header(header: &str, data: &[u8]) -> Vec<u8> {
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(data);
    file
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The weights of `Conv2d(3, 8, 3)` at `conv`, as f32.
fn conv_state() -> BTreeMap<String, HostTensor> {
    let w = HostTensor::new(vec![8, 3, 3, 3], (0..216).map(|i| i as f32 / 216.0).collect());
    let b = HostTensor::new(vec![8], vec![0.5; 8]);
    BTreeMap::from([("conv.weight".to_string(), w), ("conv.bias".to_string(), b)])
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Opens `path` expecting `Error::Safetensors` for that file, and returns its message.
fn open_err(path: &Path) -> String {
    match VarBuilder::from_safetensors(&[path]) {
        Err(e @ Error::Safetensors { .. }) => {
            let Error::Safetensors { path: p, .. } = &e else { unreachable!() };
            assert_eq!(p, path);
            let msg = e.to_string();
            assert!(msg.contains(&path.display().to_string()), "message does not name the file: {msg}");
            msg
        }
        Err(other) => panic!("expected Error::Safetensors for {}, got {other:?}", path.display()),
        Ok(_) => panic!("{} opened although it is corrupt", path.display()),
    }
}

fn load_conv(vb: &VarBuilder) -> kiln::Result<Conv2d> {
    Conv2d::load(vb.pp("conv"), &Conv2dConfig::new(3, 8, 3))
}

#[test]
fn truncated_files_are_rejected_with_the_path() {
    let dir = tempdir("truncated");
    let good = dir.join("good.safetensors");
    write_safetensors(&good, &conv_state()).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    // Sanity: the untruncated file loads.
    load_conv(&VarBuilder::from_safetensors(&[&good]).unwrap()).unwrap();

    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for (label, keep) in [("data", bytes.len() - 5), ("header", 8 + header_len / 2), ("length", 5), ("empty", 0)] {
        let path = write(&dir, &format!("cut-{label}.safetensors"), &bytes[..keep]);
        let msg = open_err(&path);
        assert!(msg.contains("truncated"), "cut in the {label}: {msg}");
    }
}

#[test]
fn corrupt_headers_are_rejected_with_the_path() {
    let dir = tempdir("corrupt");
    let data = f32_bytes(&[1.0, 2.0]);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        // Random-looking bytes: the "header length" is absurd.
        ("garbage", (0u32..64).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 | 0x80).collect(), "header length"),
        ("bad-json", with_header("{\"conv.bias\": {\"dtype\": \"F32\", \"shape\": [2", &data), "JSON"),
        ("not-utf8", [&9u64.to_le_bytes()[..], b"{\"\xff\xfe\": 1}"].concat(), "UTF-8"),
        (
            "offset-past-end",
            with_header(r#"{"conv.bias": {"dtype": "F32", "shape": [100], "data_offsets": [0, 400]}}"#, &data),
            "does not end where the header says",
        ),
        (
            "offsets-overlap",
            with_header(
                r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}"#,
                &data,
            ),
            "offsets",
        ),
        (
            "size-not-shape",
            with_header(r#"{"conv.bias": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}"#, &data),
            "does not match its shape",
        ),
    ];
    for (label, bytes, says) in cases {
        let msg = open_err(&write(&dir, &format!("{label}.safetensors"), &bytes));
        assert!(msg.contains(says), "{label}: expected the message to mention `{says}`: {msg}");
    }
}

#[test]
fn a_missing_file_is_an_io_error_naming_it() {
    let path = tempdir("nofile").join("absent.safetensors");
    match VarBuilder::from_safetensors(&[&path]) {
        Err(e @ Error::Io { .. }) => assert!(e.to_string().contains("absent.safetensors"), "{e}"),
        Err(other) => panic!("expected Error::Io, got {other:?}"),
        Ok(_) => panic!("opened a file that does not exist"),
    }
}

#[test]
fn missing_key_names_the_key_and_the_file() {
    let dir = tempdir("missing");
    let path = dir.join("w.safetensors");
    let mut state = conv_state();
    state.remove("conv.bias");
    write_safetensors(&path, &state).unwrap();
    let err = load_conv(&VarBuilder::from_safetensors(&[&path]).unwrap()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(&err, Error::MissingWeight { key, .. } if key == "conv.bias"), "{err:?}");
    assert!(msg.contains("`conv.bias`") && msg.contains(&path.display().to_string()), "{msg}");

    // The same from in-memory tensors.
    let err = load_conv(&VarBuilder::from_tensors(state)).unwrap_err();
    assert!(matches!(&err, Error::MissingWeight { key, .. } if key == "conv.bias"), "{err:?}");
}

#[test]
fn wrong_shape_names_the_key_and_both_shapes() {
    let dir = tempdir("shape");
    let path = dir.join("w.safetensors");
    write_safetensors(&path, &conv_state()).unwrap();
    let vb = VarBuilder::from_safetensors(&[&path]).unwrap();
    // The file holds a 3×3 kernel over 3 channels; ask for 5×5 over 4.
    let err = Conv2d::load(vb.pp("conv"), &Conv2dConfig::new(4, 8, 5)).unwrap_err();
    match &err {
        Error::WeightShape { key, expected, got, .. } => {
            assert_eq!((key.as_str(), expected.as_slice(), got.as_slice()), ("conv.weight", &[8, 4, 5, 5][..], &[8, 3, 3, 3][..]));
        }
        other => panic!("expected WeightShape, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("`conv.weight`") && msg.contains("[8, 3, 3, 3]") && msg.contains("[8, 4, 5, 5]"), "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
}

#[test]
fn unsupported_dtypes_name_the_key_and_the_dtype() {
    let dir = tempdir("dtype");
    let weight = f32_bytes(&vec![0.25; 216]);
    for (dtype, elem_bytes) in [("I32", 4), ("F64", 8), ("U8", 1)] {
        let bias = vec![1u8; 8 * elem_bytes];
        let file = raw_safetensors(&[("conv.weight", "F32", &[8, 3, 3, 3], weight.clone()), ("conv.bias", dtype, &[8], bias)]);
        let path = write(&dir, &format!("{dtype}.safetensors"), &file);
        let vb = VarBuilder::from_safetensors(&[&path]).unwrap();
        let err = load_conv(&vb).unwrap_err();
        assert!(matches!(&err, Error::WeightDtype { key, got, .. } if key == "conv.bias" && got == dtype), "{dtype}: {err:?}");
        let msg = err.to_string();
        assert!(msg.contains("`conv.bias`") && msg.contains(dtype) && msg.contains(&path.display().to_string()), "{msg}");
    }
}

#[test]
fn f16_and_bf16_files_load_as_f32() {
    // The hand-written writer is also checked against loads that must succeed.
    let dir = tempdir("half");
    let values = [0.5f32, -1.25, 3.0];
    let f16: Vec<u8> = values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect();
    let bf16: Vec<u8> = values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
    let path = write(&dir, "half.safetensors", &raw_safetensors(&[("a", "F16", &[3], f16), ("b", "BF16", &[3], bf16)]));
    let vb = VarBuilder::from_safetensors(&[&path]).unwrap();
    assert_eq!(vb.get(&[3], "a").unwrap().value.data, values);
    assert_eq!(vb.get(&[3], "b").unwrap().value.data, values);
}

#[test]
fn unused_keys_are_reported_and_fail_strict_mode() {
    let dir = tempdir("unused");
    let path = dir.join("w.safetensors");
    let mut state = conv_state();
    state.insert("fc.weight".into(), HostTensor::new(vec![2, 2], vec![1.0; 4]));
    state.insert("conv.extra".into(), HostTensor::new(vec![1], vec![0.0]));
    // PyTorch's BatchNorm bookkeeping is never "unused".
    state.insert("bn.num_batches_tracked".into(), HostTensor::new(vec![1], vec![7.0]));
    write_safetensors(&path, &state).unwrap();

    let vb = VarBuilder::from_safetensors(&[&path]).unwrap();
    load_conv(&vb).unwrap();
    assert_eq!(vb.unused(), ["conv.extra", "fc.weight"]);
    let err = vb.check_all_used().unwrap_err();
    assert!(matches!(&err, Error::UnusedWeights { count: 2, keys, .. } if keys == &["conv.extra", "fc.weight"]), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("conv.extra") && msg.contains("fc.weight") && msg.contains(&path.display().to_string()), "{msg}");

    // Once every key has been read, strict mode passes.
    vb.get(&[2, 2], "fc.weight").unwrap();
    vb.get(&[1], "conv.extra").unwrap();
    vb.check_all_used().unwrap();
}

#[test]
fn channel_mismatch_at_trace_time_names_the_module_path_and_both_shapes() {
    let conv = Conv2d::load(VarBuilder::seeded().pp("layer1").pp(0).pp("conv1"), &Conv2dConfig::new(3, 8, 3)).unwrap();
    let tracer = Tracer::new();
    let x = tracer.input("x", &[1, 4, 10, 10]);
    let err = conv.forward(&x).unwrap_err();
    match &err {
        Error::Shape { path, op, got, .. } => {
            assert_eq!((path.as_str(), op.as_str()), ("layer1.0.conv1", "conv2d"));
            assert_eq!(got[..2], [vec![1, 4, 10, 10], vec![8, 3, 3, 3]]);
        }
        other => panic!("expected Error::Shape, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("`layer1.0.conv1`") && msg.contains("[1, 4, 10, 10]") && msg.contains("[8, 3, 3, 3]"), "{msg}");
    assert!(msg.contains("4 channels"), "{msg}");
}

#[test]
fn add_of_mismatched_shapes_names_both_shapes() {
    let conv = Conv2d::load(VarBuilder::seeded().pp("block").pp("conv"), &Conv2dConfig::new(3, 8, 3).stride(2)).unwrap();
    let tracer = Tracer::new();
    let x = tracer.input("x", &[1, 3, 9, 9]);
    let y = conv.forward(&x).unwrap();
    let err = (&y + &x).unwrap_err();
    match &err {
        Error::Shape { path, op, got, .. } => {
            // Inline ops are named in the scope of their first input's module.
            assert_eq!((path.as_str(), op.as_str()), ("block.add", "add"));
            assert_eq!(got, &[vec![1, 8, 4, 4], vec![1, 3, 9, 9]]);
        }
        other => panic!("expected Error::Shape, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("[1, 8, 4, 4]") && msg.contains("[1, 3, 9, 9]"), "{msg}");
    // A failed op leaves the trace usable: nothing was recorded for it.
    assert!(tracer.graph().nodes.iter().all(|n| n.op.name() != "add"));
    assert!(y.mul(&y).is_ok());
}

#[test]
fn tensors_of_two_traces_cannot_be_mixed() {
    let conv = Conv2d::load(VarBuilder::seeded().pp("head"), &Conv2dConfig::new(3, 3, 1)).unwrap();
    let (t1, t2) = (Tracer::new(), Tracer::new());
    let a = t1.input("a", &[1, 3, 4, 4]);
    let b = t2.input("b", &[1, 3, 4, 4]);
    let y = conv.forward(&a).unwrap();
    for err in [(&y + &b).unwrap_err(), kiln::Tensor::cat(&[&b, &y], 1).unwrap_err()] {
        assert!(matches!(&err, Error::MixedTraces { .. }), "{err:?}");
        assert!(err.to_string().contains("different traces"), "{err}");
    }
    match (&y * &b).unwrap_err() {
        Error::MixedTraces { path } => assert_eq!(path, "mul"),
        other => panic!("expected MixedTraces, got {other:?}"),
    }
}

#[test]
fn degenerate_layer_settings_are_shape_errors_naming_the_layer() {
    use kiln::{
        nn::{ConvTranspose2d, MaxPool2d, Pool2dConfig},
        Tensor,
    };
    let vb = VarBuilder::seeded();
    let tracer = Tracer::new();
    let x = tracer.input("x", &[1, 4, 8, 8]);
    let conv = |name: &str, c: Conv2dConfig| Conv2d::load(vb.pp(name), &c).unwrap().forward(&x);
    let deconv = |name: &str, c: Conv2dConfig| ConvTranspose2d::load(vb.pp(name), &c).unwrap().forward(&x);
    let pool = |name: &str, c: Pool2dConfig| MaxPool2d::load(vb.pp(name), &c).unwrap().forward(&x);
    let cases: Vec<(&str, kiln::Result<Tensor>)> = vec![
        ("k0", conv("k0", Conv2dConfig::new(4, 8, 0))),
        ("tk0", deconv("tk0", Conv2dConfig::new(4, 8, 0))),
        ("s0", conv("s0", Conv2dConfig::new(4, 8, 3).stride(0))),
        ("g0", conv("g0", Conv2dConfig::new(4, 8, 3).groups(0))),
        ("g3", conv("g3", Conv2dConfig::new(4, 8, 3).groups(3))),
        ("big", conv("big", Conv2dConfig::new(4, 8, 11))),
        ("tpad", deconv("tpad", Conv2dConfig::new(4, 8, 3).padding(20))),
        ("p0", pool("p0", Pool2dConfig::new(2).stride(0))),
        ("pk0", pool("pk0", Pool2dConfig::new(0))),
        ("flatten", x.flatten(4)),
        ("cat", Tensor::cat(&[&x, &tracer.input("y", &[1, 4, 8, 9])], 1)),
    ];
    for (name, result) in cases {
        match result {
            Err(Error::Shape { path, .. }) => assert!(path == name || path.ends_with(name), "{name}: error names `{path}`"),
            Err(other) => panic!("{name}: expected Error::Shape, got {other:?}"),
            Ok(t) => panic!("{name}: traced to {:?}", t.shape()),
        }
    }
    assert!(matches!(Tensor::cat(&[], 0), Err(Error::NoTensorInput { .. })));
}

/// The errors a caller acts on are typed: an op given the wrong number of inputs says so as
/// `OpError::Arity` (inside `Error::Shape`, which names the node), not only in words.
#[test]
fn an_op_with_the_wrong_number_of_inputs_is_a_typed_arity_error() {
    use kiln::plugin::{Binary, Op, OpError};
    let tracer = Tracer::new();
    let _ = tracer.input("x", &[1, 3, 4, 4]);
    let mut graph = tracer.graph();
    let err = graph.push(Op::Binary(Binary::Add), vec![0], "block.add".into()).unwrap_err();
    println!("{err}");
    match &err {
        Error::Shape { path, op, reason: OpError::Arity { expected, got }, .. } => {
            assert_eq!((path.as_str(), op.as_str(), expected.as_str(), *got), ("block.add", "add", "2", 1));
        }
        other => panic!("expected a typed arity error, got {other:?}"),
    }
    assert!(err.to_string().contains("expected 2 input(s), got 1"), "{err}");
}
