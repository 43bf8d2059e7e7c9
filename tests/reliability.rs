//! One test per library row of docs/RELIABILITY.md: a bad input (a hostile or broken safetensors
//! file, a tampered engine payload, an impossible size) and the typed error Kiln answers with. Each
//! test asserts the variant and the words of the message the table quotes.

use kiln::engine::BuildConfig;
use kiln::files::engine::{checksum, decode, encode, Header, Payload, FORMAT_VERSION};
use kiln::files::{read_safetensors, read_tensors, write_safetensors};
use kiln::{
    plugin::{ConvAttrs, Op},
    Error, Graph, HostTensor, VarBuilder,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-reliability-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A safetensors file from a raw JSON header and data.
fn with_header(header: &str, data: &[u8]) -> Vec<u8> {
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(data);
    file
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn f32_file(dir: &Path, name: &str, tensors: &[(&str, HostTensor)]) -> PathBuf {
    let path = dir.join(name);
    write_safetensors(&path, &tensors.iter().map(|(k, t)| (k.to_string(), t.clone())).collect()).unwrap();
    path
}

fn open_err(path: &Path) -> Error {
    match VarBuilder::from_safetensors(&[path]) {
        Err(e) => e,
        Ok(_) => panic!("{} opened", path.display()),
    }
}

/// Asserts `e` is `Error::Safetensors` for `path` and its message contains every one of `says`.
fn assert_safetensors(e: Error, path: &Path, says: &[&str]) {
    let msg = e.to_string();
    assert!(matches!(&e, Error::Safetensors { path: p, .. } if p == path), "{e:?}");
    for s in says {
        assert!(msg.contains(s), "expected `{s}` in: {msg}");
    }
}

/// A file of one 10^12-element F32 tensor `x`, sparse: 4 TB that take no disk.
fn sparse_terabyte(dir: &Path) -> PathBuf {
    let n: u64 = 1_000_000_000_000;
    let header = format!(r#"{{"x": {{"dtype": "F32", "shape": [{n}], "data_offsets": [0, {}]}}}}"#, n * 4);
    let path = write(dir, "sparse.safetensors", &with_header(&header, &[]));
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len(8 + header.len() as u64 + n * 4).unwrap();
    path
}

// ---- safetensors ----------------------------------------------------------------------------

#[test]
fn r01_huge_tensor_of_the_wrong_shape_is_rejected_before_decoding() {
    let dir = tempdir("r01");
    let path = sparse_terabyte(&dir);
    let vb = VarBuilder::from_safetensors(&[&path]).unwrap();
    let start = std::time::Instant::now();
    match vb.get(&[10], "x") {
        Err(Error::WeightShape { key, got, expected, .. }) => {
            assert_eq!((key.as_str(), got, expected), ("x", vec![1_000_000_000_000], vec![10]));
        }
        other => panic!("expected WeightShape, got {other:?}"),
    }
    assert!(start.elapsed().as_secs() < 2, "nothing was decoded");
}

#[test]
fn r02_huge_reference_tensor_is_too_large_not_an_abort() {
    let dir = tempdir("r02");
    let path = sparse_terabyte(&dir);
    let e = read_safetensors(&path).unwrap_err();
    assert!(matches!(&e, Error::TooLarge { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("tensor `x`") && msg.contains("1000000000000 elements") && msg.contains("sparse.safetensors"), "{msg}");
}

#[test]
fn r03_shape_whose_element_count_overflows_is_rejected() {
    let dir = tempdir("r03");
    let header = r#"{"w": {"dtype": "F32", "shape": [4611686018427387905, 4], "data_offsets": [0, 16]}}"#;
    let path = write(&dir, "wrap.safetensors", &with_header(header, &[0; 16]));
    assert_safetensors(open_err(&path), &path, &["tensor `w`", "does not match its shape", "more than usize::MAX"]);
}

#[test]
fn r04_duplicate_key_in_one_header_is_an_error_naming_it() {
    let dir = tempdir("r04");
    let header =
        r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}"#;
    let path = write(&dir, "dup.safetensors", &with_header(header, &[0; 8]));
    let e = open_err(&path);
    assert!(matches!(&e, Error::DuplicateTensor { key, .. } if key == "a"), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("`a` appears twice") && msg.contains("dup.safetensors") && msg.contains("same header"), "{msg}");
}

#[test]
fn r05_duplicate_key_in_two_shards_names_both_files() {
    let dir = tempdir("r05");
    let one = f32_file(&dir, "shard1.safetensors", &[("fc.weight", HostTensor::new(vec![2], vec![1.0, 2.0]))]);
    let two = f32_file(&dir, "shard2.safetensors", &[("fc.weight", HostTensor::new(vec![2], vec![3.0, 4.0]))]);
    let e = VarBuilder::from_safetensors(&[&one, &two]).err().expect("duplicate accepted");
    assert!(matches!(&e, Error::DuplicateTensor { key, .. } if key == "fc.weight"), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("shard1.safetensors") && msg.contains("shard2.safetensors"), "{msg}");
}

#[test]
fn r06_bad_json_header_names_the_file_and_the_json_error() {
    let dir = tempdir("r06");
    let path = write(&dir, "bad.safetensors", &with_header(r#"{"a": {"dtype": "F32",, }"#, &[]));
    assert_safetensors(open_err(&path), &path, &["not valid JSON", "line 1 column"]);
}

#[test]
fn r07_a_directory_is_named_as_a_directory() {
    let dir = tempdir("r07");
    assert_safetensors(open_err(&dir), &dir, &["is a directory"]);
}

#[cfg(unix)]
#[test]
fn r08_a_fifo_is_rejected_without_waiting_for_a_writer() {
    let dir = tempdir("r08");
    let fifo = dir.join("weights.fifo");
    let _ = std::fs::remove_file(&fifo);
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    assert_safetensors(open_err(&fifo), &fifo, &["not a regular file", "FIFO"]);
}

#[test]
fn r09_a_pth_file_gets_a_conversion_hint() {
    let dir = tempdir("r09");
    let path = write(&dir, "model.pth", b"PK\x03\x04\x14\x00\x00\x00\x00\x00archive/data.pkl");
    assert_safetensors(open_err(&path), &path, &["PyTorch pickle", "safetensors.torch.save_file(model.state_dict()"]);
}

#[test]
fn r10_dataparallel_module_prefix_gets_a_hint() {
    let dir = tempdir("r10");
    let path = f32_file(&dir, "dp.safetensors", &[("module.fc.bias", HostTensor::new(vec![2], vec![0.0; 2]))]);
    let vb = VarBuilder::from_safetensors(&[&path]).unwrap();
    let e = vb.pp("fc").get(&[2], "bias").unwrap_err();
    assert!(matches!(&e, Error::MissingWeightPrefixed { key, prefix, .. } if key == "fc.bias" && prefix == "module."), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains("`module.fc.bias` is there") && msg.contains("DataParallel") && msg.contains("strip the prefix"), "{msg}");
}

#[test]
fn r11_nan_weight_is_reported_and_fails_the_finite_check() {
    let dir = tempdir("r11");
    let path = f32_file(&dir, "nan.safetensors", &[("fc.weight", HostTensor::new(vec![3], vec![1.0, f32::NAN, f32::NAN]))]);
    let vb = VarBuilder::from_safetensors(&[&path]).unwrap();
    vb.get(&[3], "fc.weight").unwrap();
    assert_eq!(vb.non_finite(), [("fc.weight".to_string(), 2)]);
    let e = vb.check_finite().unwrap_err();
    assert!(matches!(&e, Error::NonFinite { key, count: 2, .. } if key == "fc.weight"), "{e:?}");
    assert!(e.to_string().contains("non-finite") && e.to_string().contains("nan.safetensors"), "{e}");
}

#[test]
fn r12_infinite_f16_weight_is_reported() {
    let dir = tempdir("r12");
    let inf = half::f16::INFINITY.to_le_bytes();
    let header = r#"{"b": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}"#;
    let path = write(&dir, "inf.safetensors", &with_header(header, &[inf[0], inf[1], 0, 0]));
    let vb = VarBuilder::from_safetensors(&[&path]).unwrap();
    assert_eq!(vb.get(&[2], "b").unwrap().value.data[0], f32::INFINITY);
    assert_eq!(vb.non_finite(), [("b".to_string(), 1)]);
    assert!(matches!(vb.check_finite(), Err(Error::NonFinite { .. })));
}

#[test]
fn r13_unknown_dtype_name_is_rejected() {
    let dir = tempdir("r13");
    let path = write(&dir, "q4.safetensors", &with_header(r#"{"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}"#, &[0]));
    assert_safetensors(open_err(&path), &path, &["tensor `a`", "unknown dtype `Q4`"]);
}

#[test]
fn r14_reference_tensor_of_an_unreadable_dtype_is_called_a_reference() {
    let dir = tempdir("r14");
    let path = write(
        &dir,
        "ref.safetensors",
        &with_header(r#"{"output.logits": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}"#, &[0; 8]),
    );
    let e = read_tensors(&path, "reference", |_| true).unwrap_err();
    assert!(
        matches!(&e, Error::TensorDtype { what, key, got, .. } if what == "reference" && key == "output.logits" && got == "I64"),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(msg.starts_with("reference tensor `output.logits` has dtype I64") && !msg.contains("weight"), "{msg}");
}

#[test]
fn r15_unrelated_tensors_are_left_out_unread() {
    let dir = tempdir("r15");
    let header = r#"{"input": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "labels": {"dtype": "I64", "shape": [1], "data_offsets": [4, 12]}}"#;
    let path = write(&dir, "ref.safetensors", &with_header(header, &[0; 12]));
    let (tensors, skipped) = read_tensors(&path, "reference", |k| k == "input").unwrap();
    assert_eq!((tensors.keys().collect::<Vec<_>>(), skipped), (vec![&"input".to_string()], vec!["labels".to_string()]));
}

#[test]
fn r16_header_length_past_the_end_is_named() {
    let dir = tempdir("r16");
    let mut bytes = with_header("{}", &[]);
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    let path = write(&dir, "len.safetensors", &bytes);
    assert_safetensors(open_err(&path), &path, &["header length", &u64::MAX.to_string()]);
}

#[test]
fn r17_truncated_data_is_named() {
    let dir = tempdir("r17");
    let path = write(&dir, "cut.safetensors", &with_header(r#"{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}"#, &[0; 9]));
    assert_safetensors(open_err(&path), &path, &["does not end where the header says", "covers 16 bytes", "holds 9"]);
}

#[test]
fn r18_reversed_offsets_are_rejected() {
    let dir = tempdir("r18");
    let path = write(&dir, "rev.safetensors", &with_header(r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}"#, &[0; 4]));
    assert_safetensors(open_err(&path), &path, &["tensor `a`", "(4..0) does not match its shape"]);
}

#[test]
fn r19_header_entry_without_offsets_is_named() {
    let dir = tempdir("r19");
    let path = write(&dir, "nooff.safetensors", &with_header(r#"{"a": {"dtype": "F32", "shape": [1]}}"#, &[0; 4]));
    assert_safetensors(open_err(&path), &path, &["tensor `a`", "data_offsets"]);
}

#[test]
fn r20_header_that_is_not_an_object_is_a_json_error() {
    let dir = tempdir("r20");
    let path = write(&dir, "array.safetensors", &with_header("[1, 2]", &[]));
    assert_safetensors(open_err(&path), &path, &["not valid JSON", "a JSON object of tensors"]);
}

#[test]
fn r21_host_tensor_with_overflowing_shape_is_an_error() {
    let e = HostTensor::try_new(vec![1 << 62, 8], vec![0.0; 4]).unwrap_err();
    assert!(matches!(&e, Error::TensorSize { got: 4, .. }), "{e:?}");
    assert!(e.to_string().contains("more than usize::MAX"), "{e}");
}

#[test]
fn r22_host_tensor_with_too_few_values_is_an_error() {
    let e = HostTensor::try_new(vec![2, 3], vec![0.0; 5]).unwrap_err();
    assert_eq!(e.to_string(), "a tensor of shape [2, 3] holds 6 values, but 5 were given");
}

#[test]
fn r23_random_input_of_overflowing_shape_is_too_large() {
    let e = kiln::dev::try_uniform_tensor(&[1 << 40, 3, 1 << 20, 1 << 20], 1).unwrap_err();
    assert!(matches!(&e, Error::TooLarge { .. }), "{e:?}");
    assert!(e.to_string().contains("overflows"), "{e}");
}

/// Issue 29, item 10: a batch-0 input (or a graph traced at batch 0, as an engine file may hold)
/// read "expected [0, 3, 8, 8] (any positive batch), got [0, 3, 8, 8]". The message now says the
/// batch is 0, and shows the traced batch as N.
#[test]
fn r24_a_batch_of_0_is_named_as_such_by_the_cpu_executor() {
    let zero = HostTensor::new(vec![0, 3, 8, 8], vec![]);
    let mut traced_at_0 = graph();
    let x = traced_at_0.inputs[0];
    traced_at_0.nodes[x].shape[0] = 0;
    for g in [graph(), traced_at_0] {
        let msg = kiln::run_cpu(&g, &[("x", &zero)]).unwrap_err().to_string();
        assert!(msg.contains("a batch of 0; the batch must be at least 1") && msg.contains("[N, 3, 8, 8]"), "{msg}");
        assert!(!msg.contains("expected shape [0"), "{msg}");
    }
    let wrong = HostTensor::new(vec![2, 1, 8, 8], vec![0.0; 128]);
    let msg = kiln::run_cpu(&graph(), &[("x", &wrong)]).unwrap_err().to_string();
    assert!(msg.contains("expected shape [N, 3, 8, 8] (any positive batch N; traced at [1, 3, 8, 8]), got [2, 1, 8, 8]"), "{msg}");
}

// ---- engine files ---------------------------------------------------------------------------

fn header() -> Header {
    Header { version: FORMAT_VERSION, sm: 90, driver_version: 13000, cudnn_version: 91400 }
}

/// x → conv(w) → y, with a 4×3×1×1 weight.
fn graph() -> Graph {
    let mut g = Graph::default();
    let x = g.push_unchecked(Op::Input { name: "x".into() }, vec![], vec![1, 3, 8, 8], "x".into());
    let w = g.weight("conv.weight", Arc::new(HostTensor::new(vec![4, 3, 1, 1], vec![0.5; 12])));
    let y = g.push(Op::Conv(ConvAttrs::default()), vec![x, w], "conv".into()).unwrap();
    g.inputs.push(x);
    g.mark_output("y", y);
    g
}

fn payload(graph: Graph, config: BuildConfig) -> Payload {
    Payload { config, graph, tactics: BTreeMap::new() }
}

/// Encodes `graph` then lets `edit` change the metadata JSON and the weight bytes, and writes a
/// valid header and checksum around the result: what a hostile tool would do.
fn tampered(graph: Graph, edit: impl FnOnce(&mut serde_json::Value, &mut Vec<u8>)) -> Vec<u8> {
    let bytes = encode(&header(), &payload(graph, BuildConfig::default())).unwrap();
    let body = &bytes[40..];
    let meta_len = u64::from_le_bytes(body[..8].try_into().unwrap()) as usize;
    let mut meta: serde_json::Value = serde_json::from_slice(&body[8..8 + meta_len]).unwrap();
    let mut data = body[8 + meta_len..].to_vec();
    edit(&mut meta, &mut data);
    reassemble(&bytes[..40], &serde_json::to_vec(&meta).unwrap(), &data)
}

fn reassemble(head: &[u8], json: &[u8], data: &[u8]) -> Vec<u8> {
    let mut body = (json.len() as u64).to_le_bytes().to_vec();
    body.extend_from_slice(json);
    body.extend_from_slice(data);
    let mut out = head[..24].to_vec();
    out.extend((body.len() as u64).to_le_bytes());
    out.extend(checksum(&body).to_le_bytes());
    out.extend(body);
    out
}

/// Decodes `bytes` expecting `Error::EngineFile` whose reason contains every one of `says`.
fn engine_err(bytes: &[u8], says: &[&str]) {
    match decode(bytes, "bad.kiln") {
        Err(e @ Error::EngineFile { .. }) => {
            let msg = e.to_string();
            assert!(msg.starts_with("engine file bad.kiln: "), "{msg}");
            for s in says {
                assert!(msg.contains(s), "expected `{s}` in: {msg}");
            }
        }
        Err(other) => panic!("expected EngineFile, got {other:?}"),
        Ok(_) => panic!("a tampered engine decoded"),
    }
}

#[test]
fn e01_weight_shape_2_pow_62_is_rejected() {
    let bytes = tampered(graph(), |m, _| m["weights"][0][1] = serde_json::json!([1u64 << 62]));
    engine_err(&bytes, &["weight `conv.weight`", "[4611686018427387904]", "overflows"]);
}

#[test]
fn e02_wrapping_weight_shape_with_16_bytes_is_rejected() {
    let bytes = tampered(graph(), |m, d| {
        m["weights"][0][1] = serde_json::json!([(1u64 << 62) + 1, 4]);
        d.truncate(16);
    });
    engine_err(&bytes, &["weight `conv.weight`", "overflows"]);
}

#[test]
fn e03_node_input_index_999999_is_rejected() {
    let bytes = tampered(graph(), |m, _| m["graph"]["nodes"][2]["inputs"][1] = serde_json::json!(999999));
    engine_err(&bytes, &["node %2 (`conv`)", "reads %999999, which does not precede it"]);
}

#[test]
fn e04_node_reading_itself_is_rejected() {
    let bytes = tampered(graph(), |m, _| m["graph"]["nodes"][2]["inputs"][0] = serde_json::json!(2));
    engine_err(&bytes, &["reads %2, which does not precede it"]);
}

#[test]
fn e05_stored_shape_that_its_op_does_not_infer_is_rejected() {
    let bytes = tampered(graph(), |m, _| m["graph"]["nodes"][2]["shape"] = serde_json::json!([1, 4, 9, 8]));
    engine_err(&bytes, &["conv2d infers shape [1, 4, 8, 8] from its inputs, the node says [1, 4, 9, 8]"]);
}

#[test]
fn e06_conv_with_a_missing_input_is_rejected() {
    let bytes = tampered(graph(), |m, _| m["graph"]["nodes"][2]["inputs"] = serde_json::json!([0]));
    engine_err(&bytes, &["node %2 (`conv`)", "conv2d"]);
}

#[test]
fn e07_output_past_the_end_is_rejected() {
    let bytes = tampered(graph(), |m, _| m["graph"]["outputs"][0][1] = serde_json::json!(77));
    engine_err(&bytes, &["output `y` is past the end (3 nodes)"]);
}

#[test]
fn e08_graph_input_that_is_not_an_input_node_is_rejected() {
    let bytes = tampered(graph(), |m, _| m["graph"]["inputs"][0] = serde_json::json!(1));
    engine_err(&bytes, &["listed as a graph input, but it is a weight node"]);
}

#[test]
fn e09_batch_range_out_of_order_is_rejected() {
    let bytes = encode(&header(), &payload(graph(), BuildConfig::default().batch(8, 4, 2))).unwrap();
    engine_err(&bytes, &["build config", "min 8 opt 4 max 2"]);
}

#[test]
fn e10_absurd_max_batch_is_rejected() {
    let bytes = encode(&header(), &payload(graph(), BuildConfig::default().batch(1, 1, usize::MAX))).unwrap();
    engine_err(&bytes, &["max batch", "exceeds the limit"]);
}

#[test]
fn e11_weight_node_without_data_is_rejected() {
    let bytes = tampered(graph(), |m, d| {
        m["weights"] = serde_json::json!([]);
        d.clear();
    });
    engine_err(&bytes, &["weight `conv.weight` has no data"]);
}

#[test]
fn e12_weight_data_of_another_shape_is_rejected() {
    let bytes = tampered(graph(), |m, _| m["weights"][0][1] = serde_json::json!([2, 6, 1, 1]));
    engine_err(&bytes, &["weight `conv.weight` has shape [2, 6, 1, 1], the node says [4, 3, 1, 1]"]);
}

#[test]
fn e13_unregistered_custom_op_is_rejected() {
    let bytes = tampered(graph(), |m, _| m["graph"]["nodes"][2]["op"] = serde_json::json!({"Custom": {"name": "evil", "attrs": {}}}));
    engine_err(&bytes, &["custom op `evil` is not registered"]);
}

#[test]
fn e14_metadata_length_past_the_end_is_rejected() {
    let good = encode(&header(), &payload(graph(), BuildConfig::default())).unwrap();
    let mut body = good[40..].to_vec();
    body[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    let bytes = reassemble(&good[..40], &[], &[]);
    let mut bytes = bytes[..40].to_vec();
    bytes[24..32].copy_from_slice(&(body.len() as u64).to_le_bytes());
    bytes[32..40].copy_from_slice(&checksum(&body).to_le_bytes());
    bytes.extend(body);
    engine_err(&bytes, &["metadata of 18446744073709551615 bytes runs past the end"]);
}

#[test]
fn e15_weight_stored_twice_is_rejected() {
    let bytes = tampered(graph(), |m, d| {
        let w = m["weights"][0].clone();
        m["weights"].as_array_mut().unwrap().push(w);
        let again = d.clone();
        d.extend(again);
    });
    engine_err(&bytes, &["weight `conv.weight` is stored twice"]);
}

#[test]
fn e16_a_real_optimised_model_round_trips_through_validation() {
    let traced = kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 32).unwrap();
    let optimized = kiln::engine::optimize(&traced).unwrap();
    let bytes = encode(&header(), &payload(optimized.clone(), BuildConfig::default().batch(1, 2, 4))).unwrap();
    let (_, p) = decode(&bytes, "rn18.kiln").expect("a real engine payload is valid");
    assert_eq!(p.graph.nodes, optimized.nodes);
}
