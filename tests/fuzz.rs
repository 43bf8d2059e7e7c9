//! Property tests over everything Kiln reads from a file or a flag: safetensors weights, reference
//! files, engine payloads and graph files (a toy graph, and a real ResNet-18 traced here), JSON
//! calibration caches, PGM/PPM calibration folders, and the CLI's flag strings. Each target runs
//! 10,000 cases of mutated or generated input; every case must give `Ok` or a typed `Err`, and a
//! panic fails the test. No GPU is needed: `engine::file::decode` is pure and validates the
//! payload before anything could lower it.
//!
//! Outputs are checked too: every graph that decodes (graph files, engine payloads) runs on the CPU
//! before and after `passes::optimize`, with a NaN input pixel in some cases, and both runs must
//! agree, NaN included (`optimize_agrees`).
//!
//! A failing case is saved under `target/tmp/fuzz-failures/` (`saving_failures`); copied into
//! `tests/fixtures/fuzz-corpus/` with a `.expect` file, it is replayed by every run
//! (`corpus_is_replayed`).

use kiln::engine::{BuildConfig, LayerPrecision, Precision};
use kiln::engine::{CalibrationCache, CalibrationMethod, Calibrator};
use kiln::files::engine::{checksum, decode, decode_payload, encode, Header, Payload, FORMAT_VERSION};
use kiln::files::{read_safetensors, read_tensors, write_safetensors};
use kiln::{
    plugin::{ConvAttrs, Norm, Op, PoolAttrs},
    DType, Graph, HostTensor, VarBuilder,
};
use proptest::prelude::*;
use proptest::test_runner::Config;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

const CASES: u32 = 10_000;

/// `KILN_FUZZ_CASES` overrides `CASES` (a quick local run, or a longer one).
fn cases() -> u32 {
    std::env::var("KILN_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(CASES)
}

fn config() -> Config {
    Config { cases: cases(), failure_persistence: None, ..Config::default() }
}

/// One file or folder per target, rewritten by every case (cases of one target run one after another).
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

/// Runs `check`; if it panics, `bytes` (the case) are saved as `target/tmp/fuzz-failures/<name>`
/// first, so that the smallest failing case proptest shrinks to can join the corpus.
fn saving_failures<R>(name: &str, bytes: &[u8], check: impl FnOnce() -> R) -> R {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(check)) {
        Ok(r) => r,
        Err(panic) => {
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures");
            let saved = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join(name), bytes));
            match saved {
                Ok(()) => eprintln!(
                    "the failing case is saved as {}; copy it into tests/fixtures/fuzz-corpus/ with a .expect file to replay it every run",
                    dir.join(name).display()
                ),
                Err(e) => eprintln!("could not save the failing case: {e}"),
            }
            std::panic::resume_unwind(panic)
        }
    }
}

// ---- the CPU check: `optimize` changes no output ----------------------------------------------

/// The CPU check runs graphs whose every activation has at most this many elements.
const CPU_MAX_ACTIVATION: usize = 1 << 16;
/// A weight, BatchNorm scale or shift larger than this may overflow f32 in one order of
/// operations and not in the other; outputs are then only checked to exist with their shapes.
const BOUNDED: f32 = 1e3;

/// Inputs for `g` at their traced shapes: seeded values (integers 0..=255 for a u8 input), with
/// NaN at flat index `nan_at` (modulo its size) of the first f32 input.
fn cpu_inputs(g: &Graph, seed: u64, nan_at: Option<usize>) -> Vec<(String, HostTensor)> {
    let mut nan_at = nan_at;
    g.inputs
        .iter()
        .map(|&i| {
            let node = &g.nodes[i];
            let name = match &node.op {
                Op::Input { name } => name.clone(),
                _ => String::new(),
            };
            let mut t = kiln::dev::uniform_tensor(&node.shape, seed);
            if node.dtype == DType::U8 {
                t.data.iter_mut().for_each(|v| *v = ((*v + 1.0) * 127.5).round());
            } else if let Some(at) = nan_at.take().filter(|_| !t.data.is_empty()) {
                let len = t.data.len();
                t.data[at % len] = f32::NAN;
            }
            (name, t)
        })
        .collect()
}

/// Whether rounding alone can tell the two runs apart: every weight, and every BatchNorm's
/// per-channel scale and shift (what folding multiplies into the conv), NaN or at most `BOUNDED`.
fn bounded(g: &Graph) -> bool {
    let small = |v: &f32| v.is_nan() || v.abs() <= BOUNDED;
    if !g.weights.values().all(|w| w.data.iter().all(small)) {
        return false;
    }
    g.nodes.iter().all(|n| {
        let Op::Norm(Norm::BatchNorm2d { eps }) = n.op else { return true };
        let params: Option<Vec<&Arc<HostTensor>>> = n.inputs.get(1..).unwrap_or(&[]).iter().map(|&i| g.weight_data(i)).collect();
        match params.as_deref() {
            Some([gamma, beta, mean, var]) => {
                let (scale, shift) = kiln::dev::passes::batch_norm_scale_shift(&gamma.data, &beta.data, &mean.data, &var.data, eps);
                scale.iter().chain(&shift).all(small)
            }
            _ => true,
        }
    })
}

/// Runs `g` on the CPU before and after `passes::optimize` and checks that both agree: the same
/// outputs of the same shapes, NaN at the same places, other values within rounding. A graph too
/// large for the check, or that `optimize` refuses with a typed error, is skipped; where the
/// original runs, the optimised graph must run too.
fn optimize_agrees(g: &Graph, seed: u64, nan_at: Option<usize>) {
    let Ok(opt) = kiln::engine::optimize(g) else { return };
    let small = |g: &Graph| {
        g.nodes.iter().all(|n| matches!(n.op, Op::Weight { .. }) || kiln::dev::numel(&n.shape).is_some_and(|e| e <= CPU_MAX_ACTIVATION))
    };
    if !small(g) || !small(&opt) {
        return;
    }
    let inputs = cpu_inputs(g, seed, nan_at);
    let bound: Vec<(&str, &HostTensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let Ok(before) = kiln::run_cpu(g, &bound) else { return };
    let after =
        kiln::run_cpu(&opt, &bound).unwrap_or_else(|e| panic!("the graph runs, its optimised form does not: {e}\n{}", opt.to_text()));
    assert_eq!(before.keys().collect::<Vec<_>>(), after.keys().collect::<Vec<_>>(), "the outputs differ");
    let comparable = bounded(g);
    for (name, b) in &before {
        let a = &after[name];
        assert_eq!(a.shape, b.shape, "output `{name}`");
        let scale = b.data.iter().filter(|v| v.is_finite()).fold(1f32, |m, v| m.max(v.abs()));
        if !comparable || scale > 1e20 || b.data.iter().any(|v| v.is_infinite()) {
            continue;
        }
        for (i, (&x, &y)) in b.data.iter().zip(&a.data).enumerate() {
            let agree = if x.is_nan() || y.is_nan() { x.is_nan() && y.is_nan() } else { (x - y).abs() <= 1e-3 * scale };
            assert!(agree, "output `{name}`[{i}]: {x} before `optimize`, {y} after (scale {scale})\n{}", g.to_text());
        }
    }
}

/// Whether `a` and `b` compute the same (module paths and output names aside): the CPU check of
/// a mutated file that decodes to the base's graph over the base's weights is the base's.
fn same_computation(a: &Graph, b: &Graph) -> bool {
    let same_node = |(x, y): (&kiln::plugin::Node, &kiln::plugin::Node)| {
        x.op == y.op && x.inputs == y.inputs && x.shape == y.shape && x.dtype == y.dtype
    };
    a.inputs == b.inputs
        && a.outputs.iter().map(|o| o.1).eq(b.outputs.iter().map(|o| o.1))
        && a.nodes.len() == b.nodes.len()
        && a.nodes.iter().zip(&b.nodes).all(same_node)
}

// ---- byte-level mutations -------------------------------------------------------------------

/// Byte-level mutations: set bytes, then maybe truncate or append.
#[derive(Debug, Clone)]
enum Edit {
    Set(usize, u8),
    Truncate(usize),
    Append(Vec<u8>),
    /// Overwrite with an ASCII fragment that JSON headers are made of.
    Splice(usize, &'static str),
}

fn edit() -> impl Strategy<Value = Edit> {
    let fragments = prop::sample::select(vec![
        "\"a\"",
        "\"F32\"",
        "\"I64\"",
        "[0,4]",
        "[4,0]",
        "99999999999999999999",
        "4611686018427387904",
        "{",
        "}",
        ",",
        ":",
        "\"shape\"",
        "\"data_offsets\"",
        "null",
        "-1",
        "0",
        "1e308",
        "[]",
        "\"a\":{}",
        "\"U8\"",
        "\"quant\":{\"format\":\"Int8\",\"scale\":[0]}",
    ]);
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Edit::Set(at, b)),
        1 => any::<usize>().prop_map(Edit::Truncate),
        1 => prop::collection::vec(any::<u8>(), 1..16).prop_map(Edit::Append),
        3 => (any::<usize>(), fragments).prop_map(|(at, s)| Edit::Splice(at, s)),
    ]
}

/// Room after a base file for appended bytes.
const SPARE: usize = 256;

/// A base file in a buffer, mutated in place and restored after each case: copying ResNet-18's
/// 47 MB per case would cost more than checking it. Edits land in the first `head` bytes (the
/// headers, where the structure is), one in 16 anywhere.
struct InPlace {
    buf: Vec<u8>,
    len: usize,
    head: usize,
}

impl InPlace {
    fn new(bytes: &[u8], head: usize) -> Self {
        let mut buf = bytes.to_vec();
        buf.resize(bytes.len() + SPARE, 0);
        Self { buf, len: bytes.len(), head: head.clamp(1, bytes.len().max(1)) }
    }

    /// Applies `edits`, runs `f` on the result and whether any byte past `head` changed, then
    /// restores the base.
    fn with<R>(&mut self, edits: &[Edit], f: impl FnOnce(&[u8], bool) -> R) -> R {
        let mut undo: Vec<(usize, u8)> = Vec::new();
        let mut len = self.len;
        let (buf, head) = (&mut self.buf, self.head);
        let mut write = |at: usize, b: u8, undo: &mut Vec<(usize, u8)>| {
            undo.push((at, buf[at]));
            buf[at] = b;
        };
        let place = |at: usize, len: usize| if at.is_multiple_of(16) { (at / 16) % len } else { (at / 16) % head.min(len) };
        for e in edits {
            match e {
                Edit::Set(at, b) if len > 0 => write(place(*at, len), *b, &mut undo),
                Edit::Splice(at, s) if len > 0 => {
                    let at = place(*at, len);
                    for (i, b) in s.bytes().enumerate().take(len.saturating_sub(at)) {
                        write(at + i, b, &mut undo);
                    }
                }
                Edit::Truncate(n) => len = n % (len + 1),
                Edit::Append(extra) if len + extra.len() <= self.len + SPARE => {
                    for (i, &b) in extra.iter().enumerate() {
                        write(len + i, b, &mut undo);
                    }
                    len += extra.len();
                }
                _ => {}
            }
        }
        let data_touched = len != self.len || undo.iter().any(|&(at, _)| at >= head);
        let r = f(&self.buf[..len], data_touched);
        for &(at, b) in undo.iter().rev() {
            self.buf[at] = b;
        }
        r
    }
}

/// `bytes` with `edits` applied (small files).
fn apply(bytes: &[u8], edits: &[Edit]) -> Vec<u8> {
    InPlace::new(bytes, bytes.len()).with(edits, |b, _| b.to_vec())
}

// ---- JSON number mutations ------------------------------------------------------------------

/// Numbers that stress sizes and indices.
fn number() -> impl Strategy<Value = serde_json::Value> {
    prop_oneof![
        3 => (0u64..16).prop_map(serde_json::Value::from),
        1 => any::<u64>().prop_map(serde_json::Value::from),
        1 => Just(serde_json::Value::from(1u64 << 62)),
        1 => Just(serde_json::Value::from(u64::MAX)),
        1 => any::<i32>().prop_map(serde_json::Value::from),
        1 => any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(serde_json::Value::Null, serde_json::Value::Number)),
    ]
}

/// How many numbers `v` holds, at any depth.
fn count_numbers(v: &serde_json::Value) -> usize {
    match v {
        serde_json::Value::Number(_) => 1,
        serde_json::Value::Array(a) => a.iter().map(count_numbers).sum(),
        serde_json::Value::Object(o) => o.values().map(count_numbers).sum(),
        _ => 0,
    }
}

/// Replaces the `n`-th number (in `count_numbers`' visiting order) with `value`.
fn set_nth_number(v: &mut serde_json::Value, n: usize, value: serde_json::Value) {
    fn walk(v: &mut serde_json::Value, n: &mut usize, value: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::Number(_) => {
                if *n == 0 {
                    *v = value.clone();
                    return true;
                }
                *n -= 1;
                false
            }
            serde_json::Value::Array(a) => a.iter_mut().any(|x| walk(x, n, value)),
            serde_json::Value::Object(o) => o.values_mut().any(|x| walk(x, n, value)),
            _ => false,
        }
    }
    let mut n = n;
    walk(v, &mut n, &value);
}

/// `json` with the numbers `picks` chose replaced.
fn with_numbers(json: &serde_json::Value, picks: &[(prop::sample::Index, serde_json::Value)]) -> serde_json::Value {
    let mut json = json.clone();
    for (index, value) in picks {
        let count = count_numbers(&json);
        if count > 0 {
            set_nth_number(&mut json, index.index(count), value.clone());
        }
    }
    json
}

fn picks() -> impl Strategy<Value = Vec<(prop::sample::Index, serde_json::Value)>> {
    prop::collection::vec((any::<prop::sample::Index>(), number()), 1..4)
}

/// A NaN input pixel in about a third of the cases.
fn nan_at() -> impl Strategy<Value = Option<usize>> {
    prop::option::weighted(0.35, any::<usize>())
}

// ---- safetensors ----------------------------------------------------------------------------

/// A valid weight file: f32, f16 and bf16 tensors, as `write_safetensors` and a hand writer make them.
fn valid_weights() -> Vec<u8> {
    let header = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"b":{"dtype":"F16","shape":[4],"data_offsets":[24,32]},"c.d":{"dtype":"BF16","shape":[1,2],"data_offsets":[32,36]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend((0..6).flat_map(|i| (i as f32 * 0.5).to_le_bytes()));
    file.extend((0..4).flat_map(|i| half::f16::from_f32(i as f32).to_le_bytes()));
    file.extend((0..2).flat_map(|i| half::bf16::from_f32(-(i as f32)).to_le_bytes()));
    file
}

/// Loads `path` as weights and asks for every key with its stored shape, then reads it as a
/// reference and as an input; any typed outcome is fine.
fn load_everything(path: &Path) {
    if let Ok(vb) = VarBuilder::from_safetensors(&[path]) {
        for (key, shape) in [("a", vec![2, 3]), ("b", vec![4]), ("c.d", vec![1, 2]), ("x", vec![1])] {
            let _ = vb.get(&shape, key);
        }
        let _ = vb.check_finite();
        let _ = vb.check_all_used();
    }
    let _ = read_safetensors(path);
    if let Ok((tensors, _)) = kiln::files::read_tensors_within(path, "input", |_| true, 4) {
        assert!(tensors.values().all(|t| t.numel() <= 4), "the input limit holds");
    }
}

/// A generated header entry: dtype (valid or not), shape (small, zero or overflowing), offsets.
fn entry() -> impl Strategy<Value = (String, String, Vec<u64>, [u64; 2])> {
    let name = prop::sample::select(vec!["a", "b", "module.a", "input", "output.y", "intermediate.l"]).prop_map(String::from);
    let dtype = prop::sample::select(vec!["F32", "F16", "BF16", "I64", "U8", "BOOL", "Q4", ""]).prop_map(String::from);
    let dim = prop_oneof![6 => 0u64..5, 1 => Just(1u64 << 62), 1 => any::<u64>()];
    let offset = prop_oneof![4 => 0u64..64, 1 => any::<u64>()];
    (name, dtype, prop::collection::vec(dim, 0..4), [offset.clone(), offset])
}

fn generated_file(entries: &[(String, String, Vec<u64>, [u64; 2])], data_len: usize, sequential: bool) -> Vec<u8> {
    let mut header = String::from("{");
    let mut at = 0u64;
    for (i, (name, dtype, shape, offsets)) in entries.iter().enumerate() {
        let size = match dtype.as_str() {
            "F32" => 4u64,
            "F16" | "BF16" => 2,
            "I64" => 8,
            _ => 1,
        };
        let offsets = if sequential {
            let n = shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).and_then(|n| n.checked_mul(size)).unwrap_or(u64::MAX);
            let o = [at, at.saturating_add(n)];
            at = o[1];
            o
        } else {
            *offsets
        };
        if i > 0 {
            header.push(',');
        }
        header += &format!(r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{},{}]}}"#, offsets[0], offsets[1]);
    }
    header.push('}');
    let data_len = if sequential && at < 4096 { at as usize } else { data_len };
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend((0..data_len).map(|i| (i * 37 % 251) as u8));
    file
}

// ---- graph files and engine payloads ----------------------------------------------------------

/// The toy graph of `valid_engine` and `valid_graph_file`: the ops of a ResNet block.
fn sample_graph() -> Graph {
    let mut g = Graph::default();
    let x = g.push_unchecked(Op::Input { name: "input".into() }, vec![], vec![1, 3, 8, 8], "input".into());
    let w = g.weight("conv.weight", Arc::new(HostTensor::new(vec![4, 3, 3, 3], vec![0.1; 108])));
    let b = g.weight("conv.bias", Arc::new(HostTensor::new(vec![4], vec![0.0; 4])));
    let attrs = ConvAttrs { padding: [1, 1], bias: true, act: kiln::plugin::Activation::Relu, ..ConvAttrs::default() };
    let c = g.push(Op::Conv(attrs), vec![x, w, b], "conv".into()).expect("conv");
    let pool = PoolAttrs { kernel: [2, 2], stride: [2, 2], padding: [0, 0], ceil_mode: false, count_include_pad: true };
    let p = g.push(Op::Pool(kiln::plugin::Pool::Max(pool)), vec![c], "pool".into()).expect("pool");
    let a = g.push(Op::Binary(kiln::plugin::Binary::Add), vec![p, p], "add".into()).expect("add");
    let q = g.push(Op::Pool(kiln::plugin::Pool::AdaptiveAvg { output: [1, 1] }), vec![a], "avgpool".into()).expect("avgpool");
    let f = g.push(Op::Shape(kiln::plugin::ShapeOp::Flatten { start: 1 }), vec![q], "flatten".into()).expect("flatten");
    let fw = g.weight("fc.weight", Arc::new(HostTensor::new(vec![2, 4], vec![0.2; 8])));
    let y = g.push(Op::Gemm(kiln::plugin::Gemm::Linear { bias: false, residual: false }), vec![f, fw], "fc".into()).expect("fc");
    g.inputs.push(x);
    g.mark_output("logits", y);
    g
}

/// A real ResNet-18 (seeded weights) traced at 1×3×16×16: 11.7 M weights, BatchNorms, residual
/// adds, strided downsamples, max-pool, average pool and Linear.
fn resnet18() -> &'static Graph {
    static G: OnceLock<Graph> = OnceLock::new();
    G.get_or_init(|| kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 16).expect("trace ResNet-18"))
}

/// `g` as a graph file.
fn graph_file(g: &Graph) -> Vec<u8> {
    let bytes = kiln::files::graph::encode(g, &BTreeMap::new()).expect("encode");
    kiln::files::graph::decode(&bytes, Path::new("valid.kiln.safetensors")).expect("the unmutated graph file is valid");
    bytes
}

/// The length of a safetensors file's header (its first 8 bytes plus the JSON).
fn safetensors_head(bytes: &[u8]) -> usize {
    8 + u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize
}

/// The engine payload of `g` (optimised first), for batch 1..=4.
fn engine_file(g: &Graph) -> Vec<u8> {
    let header = Header { version: FORMAT_VERSION, sm: 90, driver_version: 13000, cudnn_version: 91400 };
    let graph = kiln::engine::optimize(g).expect("optimize");
    let payload = Payload { config: BuildConfig::default().batch(1, 2, 4), graph, tactics: BTreeMap::new() };
    let bytes = encode(&header, &payload).expect("encode");
    decode(&bytes, "valid.kiln").expect("the unmutated engine is valid");
    bytes
}

const HEADER_LEN: usize = 40;

/// The toy graph file, and the toy engine file (the ops of a ResNet block).
fn valid_graph_file() -> &'static [u8] {
    static B: OnceLock<Vec<u8>> = OnceLock::new();
    B.get_or_init(|| graph_file(&sample_graph()))
}

fn valid_engine() -> &'static [u8] {
    static B: OnceLock<Vec<u8>> = OnceLock::new();
    B.get_or_init(|| engine_file(&sample_graph()))
}

/// ResNet-18's graph file and engine file, checked once on the CPU (`optimize_agrees`, with and
/// without a NaN pixel): a mutated file that decodes to the same computation needs no new run.
fn resnet18_graph_file() -> &'static [u8] {
    static B: OnceLock<Vec<u8>> = OnceLock::new();
    B.get_or_init(|| {
        optimize_agrees(resnet18(), 1, None);
        optimize_agrees(resnet18(), 1, Some(100));
        graph_file(resnet18())
    })
}

fn resnet18_engine() -> &'static [u8] {
    static B: OnceLock<Vec<u8>> = OnceLock::new();
    B.get_or_init(|| engine_file(resnet18()))
}

/// The engine payload's metadata length and its end (where the weights start, in the body).
fn engine_meta(body: &[u8]) -> (usize, usize) {
    let len = u64::from_le_bytes(body[..8].try_into().expect("8 bytes")) as usize;
    (len, 8 + len)
}

/// `good`'s header with the length and checksum of `body`, then `body`.
fn with_checksum(good: &[u8], body: &[u8]) -> Vec<u8> {
    let mut out = good[..24].to_vec();
    out.extend((body.len() as u64).to_le_bytes());
    out.extend(checksum(body).to_le_bytes());
    out.extend(body);
    out
}

/// A graph file decoded from mutated bytes: on the CPU before and after `optimize`, unless it
/// computes what `base` (already checked) computes over the same weights.
fn check_graph_file(bytes: &[u8], base: Option<&Graph>, data_touched: bool, seed: u64, nan: Option<usize>) {
    if let Ok(file) = kiln::files::graph::decode(bytes, Path::new("fuzz.kiln.safetensors")) {
        if data_touched || nan.is_some() || !base.is_some_and(|b| same_computation(b, &file.graph)) {
            optimize_agrees(&file.graph, seed, nan);
        }
    }
}

/// An engine payload that decodes runs on the CPU, and again optimised (passes may apply to a
/// payload whose graph was changed).
fn check_engine_payload(result: kiln::Result<Payload>, base: Option<&Graph>, data_touched: bool, seed: u64, nan: Option<usize>) {
    if let Ok(payload) = result {
        if data_touched || nan.is_some() || !base.is_some_and(|b| same_computation(b, &payload.graph)) {
            optimize_agrees(&payload.graph, seed, nan);
        }
    }
}

/// The decoded ResNet-18 graph and engine graph, for `same_computation`.
fn resnet18_decoded() -> &'static (Graph, Graph) {
    static G: OnceLock<(Graph, Graph)> = OnceLock::new();
    G.get_or_init(|| {
        let g = kiln::files::graph::decode(resnet18_graph_file(), Path::new("r18.kiln.safetensors")).expect("decodes").graph;
        let e = decode(resnet18_engine(), "r18.kiln").expect("decodes").1.graph;
        (g, e)
    })
}

/// A header of numbers-mutated JSON written in place over a base's, padded with spaces (JSON
/// allows them) to the base's room, so the data after it need not move.
struct PaddedHeader {
    buf: Vec<u8>,
    /// Where the header's text starts and how much room it has.
    at: usize,
    room: usize,
}

impl PaddedHeader {
    /// `prefix_len` bytes of length field (u64 LE) then the header, then `data`; the header gets
    /// `slack` bytes of room beyond `header`'s length.
    fn new(header: &[u8], data: &[u8], slack: usize) -> Self {
        let room = header.len() + slack;
        let mut buf = (room as u64).to_le_bytes().to_vec();
        buf.extend(header);
        buf.resize(8 + room, b' ');
        buf.extend(data);
        Self { buf, at: 8, room }
    }

    /// The file with `header` in place; `None` when it does not fit.
    fn with(&mut self, header: &[u8]) -> Option<&[u8]> {
        if header.len() > self.room {
            return None;
        }
        self.buf[self.at..self.at + header.len()].copy_from_slice(header);
        self.buf[self.at + header.len()..self.at + self.room].fill(b' ');
        Some(&self.buf)
    }
}

/// The parts of ResNet-18's graph file: its safetensors header's text before and after the graph
/// (a JSON string in its metadata), the graph JSON, and the tensor data.
#[allow(clippy::type_complexity)]
fn resnet18_graph_parts() -> &'static ((String, String), serde_json::Value, Vec<u8>) {
    static P: OnceLock<((String, String), serde_json::Value, Vec<u8>)> = OnceLock::new();
    P.get_or_init(|| {
        let bytes = resnet18_graph_file();
        let head = safetensors_head(bytes);
        let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..head]).expect("header");
        let slot = &mut header["__metadata__"][kiln::files::graph::KEY_GRAPH];
        let graph = serde_json::from_str(slot.as_str().expect("graph JSON")).expect("graph");
        *slot = "@@graph@@".into();
        let text = header.to_string();
        let (before, after) = text.split_once("\"@@graph@@\"").expect("the marker");
        ((before.to_string(), after.to_string()), graph, bytes[head..].to_vec())
    })
}

thread_local! {
    static R18_GRAPH_BYTES: std::cell::RefCell<Option<InPlace>> = const { std::cell::RefCell::new(None) };
    static R18_ENGINE_BYTES: std::cell::RefCell<Option<InPlace>> = const { std::cell::RefCell::new(None) };
    static R18_GRAPH_NUMBERS: std::cell::RefCell<Option<PaddedHeader>> = const { std::cell::RefCell::new(None) };
    static R18_ENGINE_NUMBERS: std::cell::RefCell<Option<PaddedHeader>> = const { std::cell::RefCell::new(None) };
}

// ---- graph files written by kiln-torch ------------------------------------------------------------

/// Graph files that kiln-torch (python/) wrote from PyTorch models: its own metadata (`kiln.tool`,
/// `model`, `torch`, `input_shape`), each module's class by path (`modules`), torchvision's module
/// paths (`features.0.1`), and ops a trace of Kiln's own models never has.
const KILN_TORCH_FILES: [&str; 6] = ["handwritten", "tiny_resnet", "tiny_deeplab", "tiny_mobilenet_v2", "tiny_vit", "tiny_swin"];

/// The file's bytes, its graph, its header (the `kiln.graph` string taken out) and graph JSON, and
/// its tensor data; checked once on the CPU.
struct TorchFile {
    bytes: Vec<u8>,
    graph: Graph,
    header: serde_json::Value,
    graph_json: serde_json::Value,
    data: Vec<u8>,
}

fn kiln_torch_file(i: usize) -> &'static TorchFile {
    static F: OnceLock<Vec<TorchFile>> = OnceLock::new();
    &F.get_or_init(|| {
        KILN_TORCH_FILES
            .iter()
            .map(|name| {
                let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/imported/{name}.kiln.safetensors"));
                let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                let graph = kiln::files::graph::decode(&bytes, &path).unwrap_or_else(|e| panic!("{e}")).graph;
                optimize_agrees(&graph, 1, None);
                let head = safetensors_head(&bytes);
                let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..head]).expect("header");
                let slot = header["__metadata__"][kiln::files::graph::KEY_GRAPH].take();
                let graph_json = serde_json::from_str(slot.as_str().expect("graph JSON")).expect("graph");
                let data = bytes[head..].to_vec();
                TorchFile { bytes, graph, header, graph_json, data }
            })
            .collect::<Vec<_>>()
    })[i]
}

/// A decoded kiln-torch file as a build reads it: the precision of each node by its module path
/// (the file's `fp32_layers` and a config's rules), its text form, then the CPU check.
fn check_kiln_torch_file(bytes: &[u8], base: &Graph, data_touched: bool, nan: Option<usize>) {
    let Ok(file) = kiln::files::graph::decode(bytes, Path::new("torch.kiln.safetensors")) else { return };
    let g = &file.graph;
    let rules = LayerPrecision::parse_list("features.*:fp32,head:fp16,*.1:tf32").expect("rules");
    let config = BuildConfig::default().precision(Precision::Fp16).layer_precisions(rules);
    assert_eq!(kiln::dev::plan::node_precisions(g, &config).len(), g.nodes.len());
    let _ = g.to_text();
    if data_touched || nan.is_some() || !same_computation(base, g) {
        optimize_agrees(g, 9, nan);
    }
}

/// Strings that stress names and module paths: empty, dots, globs, another node's name, control
/// and non-ASCII characters, a long one, and names of ops and activations.
fn string() -> impl Strategy<Value = serde_json::Value> {
    let named = prop::sample::select(vec![
        "",
        ".",
        "..",
        "a..b",
        "*",
        "**",
        "features.*",
        "input",
        "logits",
        "fc.weight",
        "conv1.weight",
        "\u{0}",
        "\n",
        "é∂",
        "None",
        "Relu",
        "Sigmoid",
        "Bogus",
        "F16",
        "U8",
        "F32",
        "torch.nn.modules.conv.Conv2d",
        "os.system",
        "kiln-graph",
        "input:1x3x32x32",
        "input:0x3x32x32",
        "input:1x3x99999999999x1",
    ]);
    prop_oneof![
        20 => named.prop_map(serde_json::Value::from),
        1 => Just(serde_json::Value::from("x".repeat(300))),
    ]
}

fn count_strings(v: &serde_json::Value) -> usize {
    match v {
        serde_json::Value::String(_) => 1,
        serde_json::Value::Array(a) => a.iter().map(count_strings).sum(),
        serde_json::Value::Object(o) => o.values().map(count_strings).sum(),
        _ => 0,
    }
}

/// Replaces the `n`-th string value (in `count_strings`' order) with `value`.
fn set_nth_string(v: &mut serde_json::Value, n: &mut usize, value: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::String(_) => {
            if *n == 0 {
                *v = value.clone();
                return true;
            }
            *n -= 1;
            false
        }
        serde_json::Value::Array(a) => a.iter_mut().any(|x| set_nth_string(x, n, value)),
        serde_json::Value::Object(o) => o.values_mut().any(|x| set_nth_string(x, n, value)),
        _ => false,
    }
}

fn with_strings(json: &mut serde_json::Value, picks: &[(prop::sample::Index, serde_json::Value)]) {
    for (index, value) in picks {
        let count = count_strings(json);
        if count > 0 {
            set_nth_string(json, &mut index.index(count), value);
        }
    }
}

thread_local! {
    static TORCH_BYTES: std::cell::RefCell<Vec<Option<InPlace>>> = std::cell::RefCell::new((0..KILN_TORCH_FILES.len()).map(|_| None).collect());
}

// ---- generated graphs ---------------------------------------------------------------------------

/// One layer of a generated graph: the patterns `optimize` rewrites (conv → BatchNorm, conv → ReLU,
/// conv → add → ReLU, conv+ReLU → max-pool, transposed conv → ReLU) and their neighbours.
#[derive(Debug, Clone)]
enum Layer {
    Conv {
        out: usize,
        k: usize,
        stride: usize,
        groups: usize,
        bias: bool,
    },
    ConvTranspose {
        out: usize,
        bias: bool,
    },
    BatchNorm {
        eps: f32,
    },
    Relu,
    /// Adds the `back`-th earlier activation of the same shape (a residual), if there is one.
    Add {
        back: usize,
    },
    MaxPool,
    AvgPool,
}

fn layer() -> impl Strategy<Value = Layer> {
    prop_oneof![
        4 => (1usize..5, prop::sample::select(vec![1usize, 3]), 1usize..3, 1usize..3, any::<bool>())
            .prop_map(|(out, k, stride, groups, bias)| Layer::Conv { out, k, stride, groups, bias }),
        1 => (1usize..4, any::<bool>()).prop_map(|(out, bias)| Layer::ConvTranspose { out, bias }),
        3 => prop::sample::select(vec![1e-5f32, 1e-3, 0.0]).prop_map(|eps| Layer::BatchNorm { eps }),
        3 => Just(Layer::Relu),
        2 => (0usize..4).prop_map(|back| Layer::Add { back }),
        1 => Just(Layer::MaxPool),
        1 => Just(Layer::AvgPool),
    ]
}

/// A value planted among a generated graph's weights: NaN, infinity, zero (a BatchNorm variance of
/// 0 with eps 0 divides by zero), or a negative variance.
fn special() -> impl Strategy<Value = Option<(usize, f32)>> {
    prop::option::weighted(0.4, (any::<usize>(), prop::sample::select(vec![f32::NAN, f32::INFINITY, 0.0, -1.0, 900.0])))
}

/// Builds the graph `layers` describe on an input of `shape` (a layer whose shapes do not fit is
/// left out), with seeded weights and `special` planted in the `k`-th weight value.
fn generated_graph(shape: [usize; 4], layers: &[Layer], special: Option<(usize, f32)>) -> Graph {
    let mut g = Graph::default();
    let mut x = g.push_unchecked(Op::Input { name: "input".into() }, vec![], shape.to_vec(), "input".into());
    g.inputs.push(x);
    let mut activations = vec![x];
    let mut seed = 10;
    let mut weight = |g: &mut Graph, name: String, shape: Vec<usize>, positive: bool| {
        seed += 1;
        let mut t = kiln::dev::uniform_tensor(&shape, seed);
        if positive {
            t.data.iter_mut().for_each(|v| *v = v.abs() + 0.5);
        }
        g.weight(&name, Arc::new(t))
    };
    for (i, l) in layers.iter().enumerate() {
        let c = g.nodes[x].shape[1];
        let path = format!("l{i}");
        let op_inputs = match *l {
            Layer::Conv { out, k, stride, groups, bias } => {
                let groups = if c % groups == 0 && (out * groups) % groups == 0 { groups } else { 1 };
                let w = weight(&mut g, format!("{path}.weight"), vec![out * groups, c / groups, k, k], false);
                let mut inputs = vec![x, w];
                if bias {
                    inputs.push(weight(&mut g, format!("{path}.bias"), vec![out * groups], false));
                }
                let attrs = ConvAttrs { stride: [stride; 2], padding: [k / 2; 2], groups, bias, ..ConvAttrs::default() };
                Some((Op::Conv(attrs), inputs))
            }
            Layer::ConvTranspose { out, bias } => {
                let w = weight(&mut g, format!("{path}.weight"), vec![c, out, 2, 2], false);
                let mut inputs = vec![x, w];
                if bias {
                    inputs.push(weight(&mut g, format!("{path}.bias"), vec![out], false));
                }
                let attrs = ConvAttrs { transposed: true, stride: [2, 2], bias, ..ConvAttrs::default() };
                Some((Op::Conv(attrs), inputs))
            }
            Layer::BatchNorm { eps } => {
                let params: Vec<_> = [("weight", false), ("bias", false), ("running_mean", false), ("running_var", true)]
                    .into_iter()
                    .map(|(name, positive)| weight(&mut g, format!("{path}.{name}"), vec![c], positive))
                    .collect();
                Some((Op::Norm(Norm::BatchNorm2d { eps }), [vec![x], params].concat()))
            }
            Layer::Relu => Some((Op::Unary(kiln::plugin::Unary::Relu), vec![x])),
            Layer::Add { back } => {
                let same: Vec<_> = activations.iter().copied().filter(|&a| a != x && g.nodes[a].shape == g.nodes[x].shape).collect();
                same.get(back % same.len().max(1)).map(|&r| (Op::Binary(kiln::plugin::Binary::Add), vec![x, r]))
            }
            Layer::MaxPool | Layer::AvgPool => {
                let p = PoolAttrs { kernel: [2, 2], stride: [2, 2], padding: [0, 0], ceil_mode: false, count_include_pad: true };
                Some((
                    if matches!(l, Layer::MaxPool) { Op::Pool(kiln::plugin::Pool::Max(p)) } else { Op::Pool(kiln::plugin::Pool::Avg(p)) },
                    vec![x],
                ))
            }
        };
        if let Some((op, inputs)) = op_inputs {
            if let Ok(y) = g.push(op, inputs, path) {
                x = y;
                activations.push(y);
            }
        }
    }
    g.mark_output("y", x);
    let mut g = kiln::dev::passes::remove_dead_nodes(&g).expect("dead weights go");
    if let Some((k, v)) = special {
        let total: usize = g.weights.values().map(|w| w.data.len()).sum();
        if total > 0 {
            let mut k = k % total;
            for w in g.weights.values_mut() {
                if k < w.data.len() {
                    Arc::make_mut(w).data[k] = v;
                    break;
                }
                k -= w.data.len();
            }
        }
    }
    g
}

// ---- calibration caches -----------------------------------------------------------------------

/// The toy graph optimised, and a min-max calibration cache recorded on it.
fn calibrated() -> &'static (Graph, CalibrationCache) {
    static C: OnceLock<(Graph, CalibrationCache)> = OnceLock::new();
    C.get_or_init(|| {
        let calibrator = Calibrator::new(&sample_graph()).expect("calibrator");
        let x = kiln::dev::uniform_tensor(&[2, 3, 8, 8], 3);
        let cache = calibrator.calibrate(std::slice::from_ref(&x), CalibrationMethod::MinMax).expect("calibrate");
        (calibrator.graph().clone(), cache)
    })
}

/// Loads a cache file; one that loads has sound ranges, and quantises the graph it was recorded on
/// (int8 and fp8), which then runs on the CPU.
fn check_calibration_cache(path: &Path) {
    let Ok(cache) = CalibrationCache::load(path) else { return };
    for r in cache.tensors.values() {
        assert!(r.amax.is_finite() && r.amax >= 0.0 && r.int8_scale > 0.0 && r.fp8_scale.is_finite(), "{r:?}");
    }
    let (graph, _) = calibrated();
    for format in [kiln::plugin::QuantFormat::Int8, kiln::plugin::QuantFormat::Fp8E4m3] {
        if let Ok(q) = kiln::dev::quant::quantize_graph(graph, &cache, format, &[]) {
            let x = kiln::dev::uniform_tensor(&[1, 3, 8, 8], 4);
            kiln::run_cpu(&q, &[("input", &x)]).expect("a quantised graph of a loaded cache runs");
            if let Ok(folded) = kiln::dev::quant::fold_constant_quant(&q) {
                kiln::run_cpu(&folded, &[("input", &x)]).expect("its folded form runs");
            }
        }
    }
}

#[derive(Debug, Clone)]
enum CacheEdit {
    Bytes(Vec<Edit>),
    Numbers(Vec<(prop::sample::Index, serde_json::Value)>),
}

// ---- PGM/PPM folders --------------------------------------------------------------------------

/// One entry of a generated calibration folder.
#[derive(Debug, Clone)]
enum PnmEntry {
    /// A binary image (P5 gray or P6 colour) of `size`×`size` with `edits` applied.
    Image { colour: bool, size: usize, edits: Vec<Edit> },
    /// A symbolic link to a FIFO (opening it for reading would wait for a writer).
    Fifo,
    /// A directory with an image's name.
    Directory,
    /// A link to `/dev/zero` (a device that never ends).
    Device,
    /// Not an image by its extension: ignored.
    Other,
}

fn pnm_entry() -> impl Strategy<Value = PnmEntry> {
    prop_oneof![
        8 => (any::<bool>(), 1usize..6, prop::collection::vec(edit(), 0..3)).prop_map(|(colour, size, edits)| PnmEntry::Image { colour, size, edits }),
        1 => Just(PnmEntry::Fifo),
        1 => Just(PnmEntry::Directory),
        1 => Just(PnmEntry::Device),
        1 => Just(PnmEntry::Other),
    ]
}

/// A valid binary PGM or PPM of `size`×`size`, with a comment in its header.
fn pnm_image(colour: bool, size: usize) -> Vec<u8> {
    let mut img = format!("{}\n# kiln\n{size} {size}\n255\n", if colour { "P6" } else { "P5" }).into_bytes();
    img.extend((0..size * size * if colour { 3 } else { 1 }).map(|i| (i * 53 % 256) as u8));
    img
}

fn normalisation() -> impl Strategy<Value = f32> {
    prop_oneof![6 => -2.0f32..2.0, 1 => Just(f32::NAN), 1 => Just(f32::INFINITY), 1 => Just(0.0f32)]
}

/// A FIFO for the folders to link to, made once.
fn fifo() -> &'static Path {
    static F: OnceLock<PathBuf> = OnceLock::new();
    F.get_or_init(|| {
        let path = scratch("fifo");
        let _ = std::fs::remove_file(&path);
        assert!(std::process::Command::new("mkfifo").arg(&path).status().expect("mkfifo").success());
        path
    })
}

/// Writes `entries` as files of `dir` (emptied first); returns how many have an image's extension.
fn write_folder(dir: &Path, entries: &[PnmEntry]) -> usize {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).expect("folder");
    let mut images = 0;
    for (i, e) in entries.iter().enumerate() {
        let name = dir.join(format!("{i}.{}", ["pgm", "PPM", "pnm"][i % 3]));
        images += 1;
        match e {
            PnmEntry::Image { colour, size, edits } => std::fs::write(&name, apply(&pnm_image(*colour, *size), edits)).expect("image"),
            PnmEntry::Fifo => std::os::unix::fs::symlink(fifo(), &name).expect("link"),
            PnmEntry::Directory => std::fs::create_dir(&name).expect("dir"),
            PnmEntry::Device => std::os::unix::fs::symlink("/dev/zero", &name).expect("link"),
            PnmEntry::Other => {
                std::fs::write(dir.join(format!("{i}.txt")), b"P5\n1 1\n255\n\0").expect("file");
                images -= 1;
            }
        }
    }
    images
}

/// Reads a folder: `Ok` holds one normalised, finite image per image file (at most `limit`), an
/// error names a file of the folder or a flag.
fn check_folder(dir: &Path, images: usize, size: usize, mean: &[f32], std: &[f32], limit: Option<usize>) {
    match kiln::image::pnm::read_folder(dir, size, mean, std, limit) {
        Ok(t) => {
            assert_eq!(t.shape, [images.min(limit.unwrap_or(usize::MAX)), 3, size, size]);
            assert!(t.data.iter().all(|v| v.is_finite()), "normalised pixels are finite");
        }
        Err(kiln::Error::Image { path, .. }) => assert!(path.starts_with(dir), "{}", path.display()),
        Err(kiln::Error::Flag { flag, .. }) => assert!(flag == "--mean" || flag == "--std", "{flag}"),
        Err(kiln::Error::Io { .. } | kiln::Error::OutOfMemory { .. } | kiln::Error::TooLarge { .. }) => {}
        Err(other) => panic!("an unexpected error for a calibration folder: {other:?}"),
    }
}

// ---- CLI flag strings ---------------------------------------------------------------------------

/// A flag value made of the pieces flags are made of.
fn flag_text() -> impl Strategy<Value = String> {
    let piece = prop::sample::select(vec![
        "input",
        "x",
        ":",
        "x",
        "1",
        "3",
        "224",
        "0",
        "18446744073709551615",
        "4294967296",
        ",",
        "'",
        "\"",
        " ",
        "*",
        "?",
        ".",
        "layer1",
        "conv1",
        "fp32",
        "FP16",
        "tf32",
        "int8",
        "best",
        "percentile",
        "=",
        "99.9",
        "nan",
        "-1",
        "é",
        "",
        "x0",
        "model.22.*",
    ]);
    prop::collection::vec(piece, 0..12).prop_map(|p| p.concat())
}

/// A glob matcher written another way (dynamic programming over pattern and text suffixes), to
/// check `glob_match`'s backtracking against.
fn naive_glob(p: &[char], t: &[char]) -> bool {
    // m[i][j]: p[i..] matches t[j..].
    let mut m = vec![vec![false; t.len() + 1]; p.len() + 1];
    m[p.len()][t.len()] = true;
    for i in (0..p.len()).rev() {
        for j in (0..=t.len()).rev() {
            m[i][j] = match p[i] {
                '*' => m[i + 1][j] || (j < t.len() && m[i][j + 1]),
                c => j < t.len() && (c == '?' || c == t[j]) && m[i + 1][j + 1],
            };
        }
    }
    m[0][0]
}

/// Module paths of ResNet-18's nodes, the texts `--layer-precisions` patterns match.
fn resnet18_paths() -> &'static [String] {
    static P: OnceLock<Vec<String>> = OnceLock::new();
    P.get_or_init(|| resnet18().nodes.iter().map(|n| n.path.clone()).collect())
}

/// Parses flag strings as the CLI does; what parses is sound.
fn check_flags(texts: &[String]) {
    use kiln_cli::shapes::{dims_text, parse_shapes, profiles};
    let parsed: Vec<Vec<kiln_cli::shapes::ShapeSpec>> = texts.iter().map(|t| parse_shapes(t).unwrap_or_default()).collect();
    for specs in &parsed {
        for s in specs {
            assert!(!s.dims.is_empty() && !s.dims.contains(&0) && kiln::dev::numel(&s.dims).is_some(), "{s:?}");
            let again = parse_shapes(&format!("{}:{}", s.name, dims_text(&s.dims))).expect("a parsed spec parses again");
            assert_eq!(again[0].dims, s.dims);
        }
    }
    if let [a, b, c, d, ..] = &parsed[..] {
        if let Ok(profiles) = profiles(a, b, c, d) {
            for p in profiles.values() {
                assert!(p.min.iter().zip(&p.opt).zip(&p.max).all(|((lo, mid), hi)| lo <= mid && mid <= hi), "{p:?}");
            }
        }
    }
    for t in texts {
        if let Ok(rules) = LayerPrecision::parse_list(t) {
            for rule in &rules {
                assert!(matches!(rule.precision, Precision::Fp32 | Precision::Tf32 | Precision::Fp16));
                let pattern: Vec<char> = rule.pattern.chars().collect();
                for path in resnet18_paths().iter().step_by(7) {
                    let text: Vec<char> = path.chars().collect();
                    assert_eq!(kiln::dev::plan::glob_match(&rule.pattern, path), naive_glob(&pattern, &text), "{} on {path}", rule.pattern);
                    let _ = rule.matches(path);
                }
            }
        }
        let _ = CalibrationMethod::parse(t);
        let _ = Precision::parse(t);
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn safetensors_with_mutated_bytes_never_panic(edits in prop::collection::vec(edit(), 1..6)) {
        let path = scratch("mutated.safetensors");
        let bytes = apply(&valid_weights(), &edits);
        std::fs::write(&path, &bytes).expect("write");
        saving_failures("mutated.safetensors", &bytes, || load_everything(&path));
    }

    #[test]
    fn safetensors_with_generated_headers_never_panic(
        entries in prop::collection::vec(entry(), 0..5),
        data_len in 0usize..128,
        sequential in any::<bool>(),
    ) {
        let path = scratch("generated.safetensors");
        let bytes = generated_file(&entries, data_len, sequential);
        std::fs::write(&path, &bytes).expect("write");
        saving_failures("generated.safetensors", &bytes, || {
            if let Ok(vb) = VarBuilder::from_safetensors(&[&path]) {
                for (name, _, shape, _) in &entries {
                    let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
                    let _ = vb.get(&shape, name);
                    let _ = vb.get(&[1], name);
                }
            }
            let _ = read_safetensors(&path);
        });
    }

    #[test]
    fn reference_files_never_panic(
        entries in prop::collection::vec(entry(), 0..5),
        data_len in 0usize..128,
        edits in prop::collection::vec(edit(), 0..3),
    ) {
        let path = scratch("reference.safetensors");
        let bytes = apply(&generated_file(&entries, data_len, true), &edits);
        std::fs::write(&path, &bytes).expect("write");
        let is_reference = |k: &str| k == "input" || k.starts_with("output.") || k.starts_with("intermediate.");
        if let Ok((tensors, _)) = read_tensors(&path, "reference", is_reference) {
            let probe = HostTensor::new(vec![1], vec![0.5]);
            for (name, t) in &tensors {
                let c = kiln::compare(name, t, t);
                prop_assert!(c.shape_ok);
                let _ = kiln::compare(name, &probe, t).passes(1e-5);
            }
        }
    }

    #[test]
    fn engine_payloads_with_mutated_bytes_run_on_the_cpu(edits in prop::collection::vec(edit(), 1..6), nan in nan_at()) {
        let good = valid_engine();
        let body = apply(&good[HEADER_LEN..], &edits);
        let file = with_checksum(good, &body);
        saving_failures("engine-mutated-bytes.kiln", &file, || {
            check_engine_payload(decode(&file, "fuzz.kiln").map(|(_, p)| p), None, true, 2, nan);
        });
    }

    #[test]
    fn engine_payloads_with_mutated_numbers_run_on_the_cpu(picks in picks(), nan in nan_at()) {
        let good = valid_engine();
        let (meta_len, end) = engine_meta(&good[HEADER_LEN..]);
        let meta: serde_json::Value = serde_json::from_slice(&good[HEADER_LEN + 8..HEADER_LEN + end]).expect("json");
        let json = serde_json::to_vec(&with_numbers(&meta, &picks)).expect("json");
        let mut body = (json.len() as u64).to_le_bytes().to_vec();
        body.extend(&json);
        body.extend(&good[HEADER_LEN + 8 + meta_len..]);
        let file = with_checksum(good, &body);
        saving_failures("engine-mutated-numbers.kiln", &file, || {
            check_engine_payload(decode(&file, "fuzz.kiln").map(|(_, p)| p), None, true, 2, nan);
        });
    }

    #[test]
    fn graph_files_with_mutated_bytes_agree_before_and_after_optimize(edits in prop::collection::vec(edit(), 1..6), nan in nan_at()) {
        let bytes = apply(valid_graph_file(), &edits);
        saving_failures("graph-mutated-bytes.kiln.safetensors", &bytes, || check_graph_file(&bytes, None, true, 3, nan));
    }

    #[test]
    fn graph_files_with_mutated_numbers_agree_before_and_after_optimize(picks in picks(), nan in nan_at()) {
        let graph = sample_graph();
        let json = with_numbers(&serde_json::to_value(&graph).expect("json"), &picks);
        let meta = BTreeMap::from([
            (kiln::files::graph::KEY_FORMAT.to_string(), kiln::files::graph::FORMAT.to_string()),
            (kiln::files::graph::KEY_VERSION.to_string(), kiln::files::graph::VERSION.to_string()),
            (kiln::files::graph::KEY_GRAPH.to_string(), json.to_string()),
        ]);
        let tensors: BTreeMap<String, &HostTensor> = graph.weights.iter().map(|(k, t)| (k.clone(), t.as_ref())).collect();
        let bytes = kiln::files::encode_safetensors(&tensors, &meta).expect("encode");
        saving_failures("graph-mutated-numbers.kiln.safetensors", &bytes, || check_graph_file(&bytes, None, true, 3, nan));
    }

    #[test]
    fn kiln_torch_graph_files_with_mutated_bytes_agree_before_and_after_optimize(
        which in 0..KILN_TORCH_FILES.len(),
        edits in prop::collection::vec(edit(), 1..6),
        nan in prop::option::weighted(0.05, any::<usize>()),
    ) {
        TORCH_BYTES.with_borrow_mut(|slots| {
            let base = kiln_torch_file(which);
            let file = slots[which].get_or_insert_with(|| InPlace::new(&base.bytes, safetensors_head(&base.bytes)));
            file.with(&edits, |b, data_touched| {
                saving_failures("kiln-torch-mutated-bytes.kiln.safetensors", b, || check_kiln_torch_file(b, &base.graph, data_touched, nan))
            })
        });
    }

    #[test]
    fn kiln_torch_graph_files_with_mutated_names_and_numbers_agree_before_and_after_optimize(
        which in 0..KILN_TORCH_FILES.len(),
        graph_strings in prop::collection::vec((any::<prop::sample::Index>(), string()), 0..3),
        meta_strings in prop::collection::vec((any::<prop::sample::Index>(), string()), 0..2),
        numbers in prop::collection::vec((any::<prop::sample::Index>(), number()), 0..2),
    ) {
        let base = kiln_torch_file(which);
        let mut graph = with_numbers(&base.graph_json, &numbers);
        with_strings(&mut graph, &graph_strings);
        let mut header = base.header.clone();
        with_strings(&mut header["__metadata__"], &meta_strings);
        header["__metadata__"][kiln::files::graph::KEY_GRAPH] = graph.to_string().into();
        let text = header.to_string();
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend(text.as_bytes());
        bytes.extend(&base.data);
        saving_failures("kiln-torch-mutated-names.kiln.safetensors", &bytes, || check_kiln_torch_file(&bytes, &base.graph, false, None));
    }

    #[test]
    fn generated_graphs_agree_before_and_after_optimize(
        shape in (1usize..3, 1usize..5, 1usize..10, 1usize..10),
        layers in prop::collection::vec(layer(), 1..9),
        special in special(),
        nan in nan_at(),
    ) {
        let g = generated_graph([shape.0, shape.1, shape.2, shape.3], &layers, special);
        // As a graph file, it reads back as it was written.
        let bytes = graph_file(&g);
        let back = kiln::files::graph::decode(&bytes, Path::new("generated.kiln.safetensors")).expect("decodes").graph;
        prop_assert!(same_computation(&g, &back));
        saving_failures("generated.kiln.safetensors", &bytes, || optimize_agrees(&g, 7, nan));
    }

    #[test]
    fn resnet18_graph_files_with_mutated_bytes_agree_before_and_after_optimize(
        edits in prop::collection::vec(edit(), 1..6),
        nan in prop::option::weighted(0.02, any::<usize>()),
    ) {
        R18_GRAPH_BYTES.with_borrow_mut(|slot| {
            let bytes = resnet18_graph_file();
            let file = slot.get_or_insert_with(|| InPlace::new(bytes, safetensors_head(bytes)));
            file.with(&edits, |b, data_touched| {
                saving_failures("resnet18-mutated-bytes.kiln.safetensors", b, || {
                    check_graph_file(b, Some(&resnet18_decoded().0), data_touched, 5, nan)
                })
            })
        });
    }

    #[test]
    fn resnet18_graph_files_with_mutated_numbers_agree_before_and_after_optimize(picks in picks()) {
        let (header, graph, data) = resnet18_graph_parts();
        let graph = serde_json::to_string(&with_numbers(graph, &picks).to_string()).expect("a JSON string");
        let text = format!("{}{graph}{}", header.0, header.1);
        R18_GRAPH_NUMBERS.with_borrow_mut(|slot| {
            let file = slot.get_or_insert_with(|| PaddedHeader::new(resnet18_graph_file()[8..safetensors_head(resnet18_graph_file())].as_ref(), data, 1024));
            if let Some(b) = file.with(text.as_bytes()) {
                saving_failures("resnet18-mutated-numbers.kiln.safetensors", b, || {
                    check_graph_file(b, Some(&resnet18_decoded().0), false, 5, None)
                });
            }
        });
    }

    #[test]
    fn resnet18_engine_payloads_with_mutated_bytes_run_on_the_cpu(
        edits in prop::collection::vec(edit(), 1..6),
        nan in prop::option::weighted(0.02, any::<usize>()),
    ) {
        R18_ENGINE_BYTES.with_borrow_mut(|slot| {
            let body = &resnet18_engine()[HEADER_LEN..];
            let payload = slot.get_or_insert_with(|| InPlace::new(body, engine_meta(body).1));
            payload.with(&edits, |b, data_touched| {
                saving_failures("resnet18-mutated-bytes.payload", b, || {
                    check_engine_payload(decode_payload(b, "fuzz.kiln"), Some(&resnet18_decoded().1), data_touched, 6, nan)
                })
            })
        });
    }

    #[test]
    fn resnet18_engine_payloads_with_mutated_numbers_run_on_the_cpu(picks in picks()) {
        let body = &resnet18_engine()[HEADER_LEN..];
        let (_, end) = engine_meta(body);
        let meta: serde_json::Value = serde_json::from_slice(&body[8..end]).expect("json");
        let text = serde_json::to_vec(&with_numbers(&meta, &picks)).expect("json");
        R18_ENGINE_NUMBERS.with_borrow_mut(|slot| {
            let payload = slot.get_or_insert_with(|| PaddedHeader::new(&body[8..end], &body[end..], 1024));
            if let Some(b) = payload.with(&text) {
                saving_failures("resnet18-mutated-numbers.payload", b, || {
                    check_engine_payload(decode_payload(b, "fuzz.kiln"), Some(&resnet18_decoded().1), false, 6, None)
                });
            }
        });
    }

    #[test]
    fn calibration_caches_load_or_are_refused_and_quantise_what_they_load(
        edit in prop_oneof![
            prop::collection::vec(edit(), 1..5).prop_map(CacheEdit::Bytes),
            picks().prop_map(CacheEdit::Numbers),
        ],
    ) {
        let (_, cache) = calibrated();
        let json = cache.to_json();
        let bytes = match &edit {
            CacheEdit::Bytes(edits) => apply(json.as_bytes(), edits),
            CacheEdit::Numbers(picks) => {
                let value: serde_json::Value = serde_json::from_str(&json).expect("json");
                with_numbers(&value, picks).to_string().into_bytes()
            }
        };
        let path = scratch("cache.json");
        std::fs::write(&path, &bytes).expect("write");
        saving_failures("calibration-cache.json", &bytes, || check_calibration_cache(&path));
    }

    #[test]
    fn pnm_folders_are_read_or_refused_by_file(
        entries in prop::collection::vec(pnm_entry(), 0..4),
        size in 1usize..6,
        limit in prop::option::of(0usize..4),
        mean in prop::collection::vec(normalisation(), 3),
        std in prop::collection::vec(normalisation(), 2..4),
    ) {
        let dir = scratch("pnm-folder");
        let images = write_folder(&dir, &entries);
        check_folder(&dir, images, size, &mean, &std, limit);
    }

    #[test]
    fn cli_flag_strings_parse_or_are_refused(texts in prop::collection::vec(flag_text(), 4)) {
        check_flags(&texts);
    }
}

// ---- the corpus -------------------------------------------------------------------------------

/// Every file of `tests/fixtures/fuzz-corpus/<kind>/` is checked as its kind's fuzz target checks
/// a case, and must give what its `.expect` file says: `ok`, or words of its error.
#[test]
fn corpus_is_replayed() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fuzz-corpus");
    let mut replayed = 0;
    for kind in ["graph", "engine", "safetensors", "calibration", "pnm", "flags", "pth", "image", "triton"] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(root.join(kind))
            .unwrap_or_else(|e| panic!("{}: {e}", root.join(kind).display()))
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_none_or(|e| e != "expect"))
            .collect();
        files.sort();
        for path in files {
            let expect_path = PathBuf::from(format!("{}.expect", path.display()));
            let expect = std::fs::read_to_string(&expect_path).unwrap_or_else(|e| panic!("{}: {e}", expect_path.display()));
            let expect = expect.trim();
            let bytes = std::fs::read(&path).expect("corpus file");
            let outcome: Result<(), String> = match kind {
                "graph" => kiln::files::graph::decode(&bytes, &path).map(|f| {
                    optimize_agrees(&f.graph, 1, None);
                    optimize_agrees(&f.graph, 1, Some(0));
                }),
                "engine" => decode(&bytes, &path.display().to_string()).map(|(_, p)| {
                    optimize_agrees(&p.graph, 1, None);
                    optimize_agrees(&p.graph, 1, Some(0));
                }),
                "safetensors" => {
                    load_everything(&path);
                    read_safetensors(&path).map(|_| ())
                }
                "calibration" => {
                    check_calibration_cache(&path);
                    CalibrationCache::load(&path).map(|_| ())
                }
                "pnm" => {
                    let size = expect.split_whitespace().find_map(|w| w.strip_prefix("size=")).map_or(2, |s| s.parse().expect("size"));
                    kiln::image::pnm::parse(&bytes, size).map(|_| ()).map_err(|reason| kiln::Error::Image { path: path.clone(), reason })
                }
                "pth" => kiln::files::decode_pth(&path, &bytes).map(|c| {
                    for t in c.tensors.values() {
                        assert_eq!(kiln::dev::numel(&t.shape), Some(t.data.len()));
                    }
                }),
                "image" => kiln_vision::decode_rgb(&bytes, &path)
                    .map(|_| ())
                    .map_err(|e| kiln::Error::Image { path: path.clone(), reason: e.to_string() }),
                "triton" => triton_config(&bytes).map_err(|reason| kiln::Error::Flag { flag: "config.pbtxt".into(), reason }),
                _ => {
                    let texts: Vec<String> = String::from_utf8_lossy(&bytes).lines().map(String::from).collect();
                    check_flags(&texts);
                    kiln_cli::shapes::parse_shapes(texts.first().map_or("", |t| t.as_str()))
                        .map(|_| ())
                        .map_err(|reason| kiln::Error::Flag { flag: "--shapes".into(), reason })
                }
            }
            .map_err(|e| e.to_string());
            let want = expect.split(" size=").next().unwrap_or(expect);
            match (&outcome, want) {
                (Ok(()), "ok") => {}
                (Err(e), words) if words != "ok" && e.contains(words) => {}
                _ => panic!("{}: expected `{want}`, got {outcome:?}", path.display()),
            }
            replayed += 1;
        }
    }
    // A FIFO cannot be committed: the corpus's calibration folder with `x.pgm` as a FIFO is made here.
    let dir = scratch("corpus-fifo-folder");
    let images = write_folder(&dir, &[PnmEntry::Fifo]);
    check_folder(&dir, images, 2, &[0.5; 3], &[0.25; 3], None);
    assert!(kiln::image::pnm::read_folder(&dir, 2, &[0.5; 3], &[0.25; 3], None).unwrap_err().to_string().contains("FIFO"));
    assert!(replayed >= 10, "only {replayed} corpus files");
    println!("replayed {replayed} corpus files");
}

/// A Triton model config (Triton's JSON) read as the backend reads it, without a model file: its
/// Kiln parameters, and its profile against a model whose input `input` is 3x32x32 (each range is
/// then asked whether it holds those dims, as a CPU instance asks of each request).
fn triton_config(bytes: &[u8]) -> Result<(), String> {
    let c = triton_kiln::config::ModelConfig::from_json(&String::from_utf8_lossy(bytes)).map_err(|e| e.to_string())?;
    let params = c.kiln_parameters().map_err(|e| e.to_string())?;
    let traced = BTreeMap::from([("input".to_string(), vec![3usize, 32, 32])]);
    if let Some(p) = &params.profile {
        for (name, range) in triton_kiln::config::shape_profile(p, &traced)? {
            let _ = range.contains(&traced[&name]);
        }
    }
    Ok(())
}

/// The writer's own files load back: the fuzzed readers accept what Kiln writes.
#[test]
fn written_files_load_back() {
    let path = scratch("written.safetensors");
    let t = HostTensor::new(vec![2, 2], vec![1.0, -2.0, 3.5, f32::MIN_POSITIVE]);
    write_safetensors(&path, &BTreeMap::from([("w".to_string(), t.clone())])).expect("write");
    assert_eq!(read_safetensors(&path).expect("read")["w"], t);
    std::fs::write(scratch("valid.safetensors"), valid_weights()).expect("write");
    let vb = VarBuilder::from_safetensors(&[scratch("valid.safetensors")]).expect("valid weights");
    assert_eq!(vb.get(&[4], "b").expect("b").value.data, [0.0, 1.0, 2.0, 3.0]);
    vb.get(&[2, 3], "a").expect("a");
    vb.get(&[1, 2], "c.d").expect("c.d");
    vb.check_all_used().expect("every key read");
}
