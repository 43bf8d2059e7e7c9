//! Hardening, round two (docs/RELIABILITY.md, "Round two"): one test per library item, named
//! `hNN_` after the item it checks. Each failed before its fix.

use kiln::engine::{CalibrationCache, CalibrationMethod, Calibrator};
use kiln::{
    plugin::{Activation, Binary, ConvAttrs, Op, Unary},
    Error, Graph, HostTensor,
};
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
    let pool = kiln::plugin::PoolAttrs { kernel: [2, 2], stride: [2, 2], padding: [0, 0], ceil_mode: false, count_include_pad: true };
    let p = g.push(Op::Pool(kiln::plugin::Pool::Max(pool)), vec![r2], "pool".into()).unwrap();
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
        let opt = kiln::engine::optimize(&g).unwrap();
        let fused = opt.nodes.iter().filter(|n| matches!(&n.op, Op::Conv(a) if a.act == Activation::Relu)).count();
        assert_eq!(fused, 2, "both ReLUs are fused:\n{}", opt.to_text());
        let before = kiln::run_cpu(&g, &[("input", input)]).unwrap().remove("y").unwrap();
        let after = kiln::run_cpu(&opt, &[("input", input)]).unwrap().remove("y").unwrap();
        assert!(!nans(&before).is_empty(), "the unfused graph gives NaN: {:?}", before.data);
        assert_eq!(nans(&after), nans(&before), "fused: {:?}, unfused: {:?}", after.data, before.data);
    }
}

// ---- helpers for files ----------------------------------------------------------------------

/// A tiny graph file: input [1, 3, 2, 2] → 1×1 conv (`conv.weight` [1, 3, 1, 1]) → relu, whose
/// graph JSON and tensors `edit` may change first (the repro files of the issue are made so).
fn tiny_graph_file(edit: impl FnOnce(&mut serde_json::Value, &mut BTreeMap<String, HostTensor>)) -> Vec<u8> {
    let mut g = Graph::default();
    let x = g.push_unchecked(Op::Input { name: "input".into() }, vec![], vec![1, 3, 2, 2], "input".into());
    let w = g.weight("conv.weight", Arc::new(HostTensor::new(vec![1, 3, 1, 1], vec![0.5, -0.25, 1.0])));
    let c = g.push(Op::Conv(ConvAttrs::default()), vec![x, w], "conv".into()).unwrap();
    let r = g.push(Op::Unary(Unary::Relu), vec![c], "relu".into()).unwrap();
    g.inputs.push(x);
    g.mark_output("y", r);
    let mut json = serde_json::to_value(&g).unwrap();
    let mut tensors: BTreeMap<String, HostTensor> = g.weights.iter().map(|(k, t)| (k.clone(), HostTensor::clone(t))).collect();
    edit(&mut json, &mut tensors);
    let meta = BTreeMap::from([
        (kiln::files::graph::KEY_FORMAT.to_string(), kiln::files::graph::FORMAT.to_string()),
        (kiln::files::graph::KEY_VERSION.to_string(), kiln::files::graph::VERSION.to_string()),
        (kiln::files::graph::KEY_GRAPH.to_string(), json.to_string()),
    ]);
    let refs: BTreeMap<String, &HostTensor> = tensors.iter().map(|(k, t)| (k.clone(), t)).collect();
    kiln::files::encode_safetensors(&refs, &meta).unwrap()
}

fn graph_file_err(bytes: &[u8]) -> String {
    match kiln::files::graph::decode(bytes, Path::new("g.kiln.safetensors")) {
        Err(e @ Error::GraphFile { .. }) => e.to_string(),
        Err(other) => panic!("expected a graph-file error, got {other:?}"),
        Ok(_) => panic!("accepted"),
    }
}

fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    assert!(std::process::Command::new("mkfifo").arg(path).status().unwrap().success(), "mkfifo {}", path.display());
}

/// Runs `f` on another thread and fails if it has not returned within 10 s (it would block
/// forever on a FIFO nobody writes).
fn within_10_s<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap_or_else(|_| panic!("{what} blocked for 10 s"))
}

/// Set in a child process that re-runs one test of this binary under a `ulimit`.
const CHILD: &str = "KILN_HARDENING_CHILD";

/// Re-runs the test `name` of this binary in a child process whose address space is limited to
/// `kib` KiB (`ulimit -v`), and asserts it passed. Returns false in that child (go on with the
/// test's body), true in the parent (the child ran it).
fn ran_in_child_with_ulimit(name: &str, kib: u64) -> bool {
    if std::env::var_os(CHILD).is_some() {
        return false;
    }
    let exe = std::env::current_exe().unwrap();
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {kib} && exec \"$0\" --exact {name} --nocapture --test-threads 1"))
        .arg(&exe)
        .env(CHILD, "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{stdout}{stderr}");
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child under ulimit -v {kib} failed: {:?}\n{stdout}\n{stderr}",
        out.status
    );
    true
}

// ---- item 2: non-finite weights of a graph file ---------------------------------------------

/// Item 2: a graph file's own NaN or infinite weights are reported by name (the CLI warns, and
/// `--strict` fails: models/tests/cli_hardening.rs); nothing reported them before.
#[test]
fn h02_non_finite_weights_of_a_graph_file_are_named() {
    let bytes = tiny_graph_file(|_, t| {
        let w = t.get_mut("conv.weight").unwrap();
        w.data[0] = f32::NAN;
        w.data[2] = f32::INFINITY;
    });
    let g = kiln::files::graph::decode(&bytes, Path::new("nan.kiln.safetensors")).unwrap().graph;
    assert_eq!(g.non_finite_weights(), vec![("conv.weight".to_string(), 2)]);
    let e = g.check_finite_weights("nan.kiln.safetensors").unwrap_err();
    assert!(matches!(&e, Error::NonFinite { key, count: 2, .. } if key == "conv.weight"), "{e:?}");
    assert_eq!(e.to_string(), "weight `conv.weight` holds 2 non-finite value(s) (NaN or infinity) (in nan.kiln.safetensors)");
    let fine = kiln::files::graph::decode(&tiny_graph_file(|_, _| {}), Path::new("g.kiln.safetensors")).unwrap().graph;
    assert!(fine.non_finite_weights().is_empty());
    fine.check_finite_weights("g.kiln.safetensors").unwrap();
}

// ---- item 3: calibration ----------------------------------------------------------------------

/// input [N, 3, 4, 4] → conv 3→4 (+bias) → relu → conv 4→2: two 8-bit layers to calibrate.
fn calibration_graph(first_weight: f32) -> Graph {
    let mut g = Graph::default();
    let x = g.push_unchecked(Op::Input { name: "input".into() }, vec![], vec![1, 3, 4, 4], "input".into());
    let mut w1: Vec<f32> = (0..12).map(|i| (i as f32 - 5.5) / 8.0).collect();
    w1[0] = first_weight;
    let w1 = g.weight("c1.weight", Arc::new(HostTensor::new(vec![4, 3, 1, 1], w1)));
    let b1 = g.weight("c1.bias", Arc::new(HostTensor::new(vec![4], vec![0.1, -0.1, 0.2, 0.0])));
    let c1 = g.push(Op::Conv(ConvAttrs { bias: true, ..ConvAttrs::default() }), vec![x, w1, b1], "c1".into()).unwrap();
    let r = g.push(Op::Unary(Unary::Relu), vec![c1], "relu".into()).unwrap();
    let w2 = g.weight("c2.weight", Arc::new(HostTensor::new(vec![2, 4, 1, 1], (0..8).map(|i| i as f32 / 8.0).collect())));
    let c2 = g.push(Op::Conv(ConvAttrs::default()), vec![r, w2], "c2".into()).unwrap();
    g.inputs.push(x);
    g.mark_output("y", c2);
    g
}

fn calibration_error(r: kiln::Result<CalibrationCache>) -> String {
    match r {
        Err(e @ Error::Calibration { .. }) => e.to_string(),
        Err(other) => panic!("expected a calibration error, got {other:?}"),
        Ok(c) => panic!("a cache was made: {}", c.to_json()),
    }
}

/// Item 3: infinity in the data no longer gives `"amax": null` (a cache its own loader refused),
/// and NaN data, NaN weights and a NaN `--mean` no longer give a plausible cache: each is a typed
/// error naming the data (the file `--data` gave), the tensor or the flag.
#[test]
fn h03_calibration_refuses_non_finite_data_weights_and_normalisation() {
    let good = kiln::dev::uniform_tensor(&[2, 3, 4, 4], 7);
    let calibrator = Calibrator::new(&calibration_graph(0.5)).unwrap().with_source("calib.safetensors");
    for method in [CalibrationMethod::Percentile(99.99), CalibrationMethod::MinMax, CalibrationMethod::Entropy] {
        saves_and_loads_back(&calibrator.calibrate(std::slice::from_ref(&good), method).unwrap());
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut x = good.clone();
            x.data[3 * 16 + 5] = bad;
            let e = calibration_error(calibrator.calibrate(&[good.clone(), x], method));
            assert!(e.starts_with("calibration (calib.safetensors): image 3 holds"), "{e}");
            assert!(e.contains("calibration data must be finite"), "{e}");
        }
    }
    // NaN weights make NaN activations from finite data: named by the tensor.
    let nan_weights = Calibrator::new(&calibration_graph(f32::NAN)).unwrap();
    let e = calibration_error(nan_weights.calibrate(std::slice::from_ref(&good), CalibrationMethod::MinMax));
    assert!(e.contains("(the calibration data)") && e.contains("tensor `c1`") && e.contains("NaN or infinite"), "{e}");
    // A cache that holds a non-finite range is never written.
    let dir = tempdir("h03");
    let mut cache = calibrator.calibrate(std::slice::from_ref(&good), CalibrationMethod::MinMax).unwrap();
    cache.tensors.values_mut().next().unwrap().amax = f32::INFINITY;
    let path = dir.join("inf.json");
    let e = cache.save(&path).unwrap_err().to_string();
    assert!(e.contains("amax inf is not finite and non-negative"), "{e}");
    assert!(!path.exists(), "nothing was written");
    // --mean nan is named as a flag before any image is read.
    let e = kiln::image::pnm::read_folder(&dir, 4, &[f32::NAN; 3], &[0.25; 3], None).unwrap_err().to_string();
    assert!(e.starts_with("--mean must be three finite values"), "{e}");
}

/// A cache from finite data saves, and loads back equal.
fn saves_and_loads_back(cache: &CalibrationCache) {
    let path = tempdir("h03-ok").join(format!("{:?}.json", cache.method));
    cache.save(&path).unwrap();
    assert_eq!(&CalibrationCache::load(&path).unwrap(), cache);
}

// ---- item 4: nothing that is not a regular file is opened for reading -------------------------

/// Item 4: a FIFO given as a calibration cache, in a calibration folder as `x.pgm`, or as a graph
/// file, engine file, input or timing cache, is named at once (each used to block on open or
/// read, waiting for a writer); so are a directory and a device.
#[test]
fn h04_fifos_directories_and_devices_are_named_without_blocking() {
    let dir = tempdir("h04");
    let fifo = dir.join("x.pgm");
    mkfifo(&fifo);
    let says = |e: Error, want: &str| {
        let msg = e.to_string();
        assert!(msg.contains(want) && msg.contains("x.pgm"), "`{msg}` should say `{want}`");
        println!("{msg}");
    };
    let fifo_msg = "is not a regular file (a FIFO, socket or device)";
    let f = fifo.clone();
    says(within_10_s("CalibrationCache::load", move || CalibrationCache::load(&f)).unwrap_err(), fifo_msg);
    let d = dir.clone();
    let e = within_10_s("pnm::read_folder", move || kiln::image::pnm::read_folder(&d, 4, &[0.0; 3], &[1.0; 3], None)).unwrap_err();
    assert!(matches!(&e, Error::Image { .. }), "{e:?}");
    says(e, fifo_msg);
    let f = fifo.clone();
    says(within_10_s("graph_file::read", move || kiln::files::graph::read(&f)).unwrap_err(), fifo_msg);
    let f = fifo.clone();
    says(within_10_s("engine::file::read", move || kiln::files::engine::read(&f)).unwrap_err(), fifo_msg);
    let f = fifo.clone();
    let e = within_10_s("read_tensors_within", move || kiln::files::read_tensors_within(&f, "input", |_| true, 1 << 31));
    says(e.unwrap_err(), fifo_msg);
    let f = fifo.clone();
    let mut tactics = kiln::files::Tactics::default();
    says(within_10_s("Tactics::load_cache", move || tactics.load_cache(&f)).unwrap_err(), fifo_msg);
    // A directory named like an image, and a device, are named too.
    let sub = dir.join("sub");
    std::fs::create_dir_all(sub.join("x.pgm")).unwrap();
    let e = kiln::image::pnm::read_folder(&sub, 4, &[0.0; 3], &[1.0; 3], None).unwrap_err();
    says(e, "is a directory; give a binary PGM (P5) or PPM (P6) image");
    let e = kiln::files::read_regular(Path::new("/dev/null"), "a file", |reason| Error::Image { path: "/dev/null".into(), reason });
    assert!(e.unwrap_err().to_string().contains(fifo_msg));
}

// ---- item 5: the memory the CPU executor checks against -------------------------------------

/// Item 5: under `ulimit -v 3000000` the memory available is at most that limit less what the
/// process has mapped, and says so (only `MemAvailable` was read, so `kiln run --cpu --batch
/// 1000` passed its check and aborted; the CLI row is models/tests/cli_hardening.rs).
#[test]
fn h05_memory_available_honours_the_address_space_limit() {
    if ran_in_child_with_ulimit("h05_memory_available_honours_the_address_space_limit", 3_000_000) {
        return;
    }
    std::env::remove_var("KILN_CPU_MEMORY_BYTES");
    let a = kiln::dev::memory_available().expect("limits are known on Linux");
    println!("{a:?}");
    assert_eq!(a.limit, "ulimit -v", "{a:?}");
    assert!(a.bytes < 3_000_000 * 1024, "{a:?}");
    // What is left is really allocatable, and a little more than it is not.
    let mut v: Vec<u8> = Vec::new();
    v.try_reserve_exact(a.bytes / 2).expect("half of what is available");
    drop(v);
    let mut w: Vec<u8> = Vec::new();
    assert!(w.try_reserve_exact(a.bytes + (64 << 20)).is_err(), "more than the limit allows was allocated");
}

// ---- item 6: sizes are checked before memory is spent ---------------------------------------

/// Bytes this process has read through `read(2)` so far (`/proc/self/io`'s `rchar`).
fn bytes_read() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").unwrap();
    io.lines().find_map(|l| l.strip_prefix("rchar:")).unwrap().trim().parse().unwrap()
}

/// `bytes` with `extra` bytes of holes appended (a sparse file: nothing on disk).
fn sparse(path: &Path, bytes: &[u8], extra: u64) {
    std::fs::write(path, bytes).unwrap();
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(bytes.len() as u64 + extra).unwrap();
}

/// Item 6: a graph file whose tensor is larger than its weight node is refused from its header
/// (the file used to be read whole and every tensor decoded first: 8.5 GB and 42 s for the
/// issue's repro); an input's size limit is checked against its header before it is decoded.
#[test]
fn h06_graph_files_and_inputs_are_checked_before_their_data_is_read() {
    let dir = tempdir("h06");
    // `conv.weight` declared as 2^28 f32 (1 GiB of holes) while its node says [1, 3, 1, 1].
    let n: u64 = 1 << 28;
    let good = tiny_graph_file(|_, _| {});
    let header_len = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&good[8..8 + header_len]).unwrap();
    header["conv.weight"] = serde_json::json!({"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]});
    let header = header.to_string();
    let mut head = (header.len() as u64).to_le_bytes().to_vec();
    head.extend(header.as_bytes());
    let path = dir.join("big.kiln.safetensors");
    sparse(&path, &head, 4 * n);
    let (read_before, start) = (bytes_read(), std::time::Instant::now());
    let e = kiln::files::graph::read(&path).unwrap_err().to_string();
    let (read, took) = (bytes_read() - read_before, start.elapsed());
    println!("{e} ({read} bytes read, {took:?})");
    assert!(e.contains("weight `conv.weight` has shape [268435456], the node says [1, 3, 1, 1]"), "{e}");
    assert!(read < 16 << 20, "{read} bytes were read before the graph file was refused");
    assert!(took.as_secs() < 2, "{took:?}");

    // An input of 1 x 3 x 27000 x 27000 f32 (8.7 GB of holes), over a 2^31-element limit.
    let m: u64 = 3 * 27000 * 27000;
    let header = format!(r#"{{"input":{{"dtype":"F32","shape":[1,3,27000,27000],"data_offsets":[0,{}]}}}}"#, 4 * m);
    let mut head = (header.len() as u64).to_le_bytes().to_vec();
    head.extend(header.as_bytes());
    let path = dir.join("x_big.safetensors");
    sparse(&path, &head, 4 * m);
    let start = std::time::Instant::now();
    let e = kiln::files::read_tensors_within(&path, "input", |_| true, 1 << 31).unwrap_err();
    assert!(matches!(&e, Error::TooLarge { .. }), "{e:?}");
    let e = e.to_string();
    println!("{e}");
    assert!(e.starts_with("input tensor `input` of shape [1, 3, 27000, 27000] in") && e.contains("x_big.safetensors"), "{e}");
    assert!(e.ends_with("is too large: 2187000000 elements, more than the limit of 2147483648 (8 GiB as f32)"), "{e}");
    assert!(start.elapsed().as_secs() < 2, "nothing was decoded");
}

// ---- item 8: quantisation settings of weights, and batch-0 inputs of engine files ------------

/// Item 8: a weight node's 8-bit grid is checked when a file is loaded (scale 0, a negative or
/// NaN scale, an empty int8 range, a count that does not match the channels were all accepted,
/// and `f32::clamp` then panics on the empty range); an engine file's batch-0 input is refused as
/// a graph file's is.
#[test]
fn h08_weight_grids_and_batch_0_inputs_are_validated_at_load() {
    let with_quant = |quant: serde_json::Value| tiny_graph_file(move |json, _| json["nodes"][1]["op"]["Weight"]["quant"] = quant);
    let grid = |scale: serde_json::Value, qmin: i32, qmax: i32| serde_json::json!({"format": "Int8", "scale": scale, "zero_point": [], "axis": null, "qmin": qmin, "qmax": qmax});
    let sound = kiln::files::graph::decode(&with_quant(grid(serde_json::json!([0.5]), -127, 127)), Path::new("g.kiln.safetensors"));
    sound.expect("a sound grid loads");
    for (quant, want) in [
        (grid(serde_json::json!([0.0]), -128, 127), "scales must be positive and finite, got 0"),
        (grid(serde_json::json!([-0.5]), -128, 127), "scales must be positive and finite, got -0.5"),
        (grid(serde_json::json!([0.5]), 127, -128), "int8 range [127, -128] is empty"),
        (grid(serde_json::json!([0.5, 0.5]), -128, 127), "per-tensor quantisation needs 1 scale(s), got 2"),
    ] {
        let e = graph_file_err(&with_quant(quant));
        println!("{e}");
        assert!(e.contains("node %1 (`conv.weight`): weight `conv.weight`: its 8-bit grid: ") && e.contains(want), "{e}");
    }
    // JSON has no NaN: a graph built in memory carries it to `validate`.
    let mut g = kiln::files::graph::decode(&tiny_graph_file(|_, _| {}), Path::new("g.kiln.safetensors")).unwrap().graph;
    g.nodes[1].op = Op::Weight { name: "conv.weight".into(), quant: Some(kiln::plugin::QuantParams::int8(f32::NAN)) };
    assert!(g.validate().unwrap_err().to_string().contains("scales must be positive and finite, got NaN"));

    // An engine payload whose input has batch 0 (the fuzzer's `efuzz_small_input_batch0`).
    let mut payload = kiln::files::engine::Payload {
        config: kiln::engine::BuildConfig::default(),
        graph: kiln::files::graph::decode(&tiny_graph_file(|_, _| {}), Path::new("g.kiln.safetensors")).unwrap().graph,
        tactics: BTreeMap::new(),
    };
    payload.graph.nodes[0].shape[0] = 0;
    payload.graph.nodes[2].shape[0] = 0;
    payload.graph.nodes[3].shape[0] = 0;
    payload.graph.validate().expect("a batch of 0 is a valid shape");
    let header =
        kiln::files::engine::Header { version: kiln::files::engine::FORMAT_VERSION, sm: 90, driver_version: 13000, cudnn_version: 91400 };
    let bytes = kiln::files::engine::encode(&header, &payload).unwrap();
    let e = kiln::files::engine::decode(&bytes, "batch0.kiln").unwrap_err().to_string();
    assert_eq!(e, "engine file batch0.kiln: input `input` has shape [0, 3, 2, 2]; inputs need a batch dim and no zero dims");
}
