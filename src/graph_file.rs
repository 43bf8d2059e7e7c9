//! Graph files: a traced graph and its weights in one safetensors file. The weights are tensors
//! under their `state_dict` names; the graph (nodes with their ops, inputs, shapes and module
//! paths; graph inputs; named outputs) is JSON in the safetensors `__metadata__`, so Python reads
//! it with `safetensors.safe_open(path, "np").metadata()["kiln.graph"]`.
//!
//! ```text
//! __metadata__: { "format": "kiln-graph", "kiln.version": "1", "kiln.graph": "<Graph as JSON>", ... }
//! tensors:      conv1.weight, bn1.running_mean, ... (f32)
//! ```
//! Loading is untrusted input: the metadata is checked (format, version), every weight node must
//! have its tensor and every tensor a weight node, and `Graph::validate` re-infers every shape with
//! its op's rule (input indices, arities, attributes) before anything runs the graph.

use crate::graph::{numel, Graph, Op};
use crate::var_builder::{decode_entry, encode_safetensors, header_of, is_readable_dtype, Entry};
use crate::{Error, HostTensor, Result};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// The `format` metadata value that marks a graph file.
pub const FORMAT: &str = "kiln-graph";
/// The version of the graph JSON this Kiln writes and reads.
pub const VERSION: u32 = 1;
/// Metadata keys Kiln writes (others, such as `model`, are the caller's and kept as they are).
pub const KEY_FORMAT: &str = "format";
pub const KEY_VERSION: &str = "kiln.version";
pub const KEY_GRAPH: &str = "kiln.graph";
/// Metadata key (`"true"`) of a graph whose weights are random (seeded or PyTorch's
/// initialisation, as kiln-torch exports without `--weights`): `kiln run` warns its answers are
/// meaningless.
pub const KEY_RANDOM_WEIGHTS: &str = "kiln.random_weights";

/// Whether a graph file's metadata says its weights are random: `KEY_RANDOM_WEIGHTS` is `true`,
/// or `weights` is `seeded` (as `kiln trace` writes it).
pub fn has_random_weights(metadata: &BTreeMap<String, String>) -> bool {
    metadata.get(KEY_RANDOM_WEIGHTS).is_some_and(|v| v == "true") || metadata.get("weights").is_some_and(|w| w == "seeded")
}
/// The extension `kiln trace` suggests: `model.kiln.safetensors`.
pub const EXTENSION: &str = ".kiln.safetensors";
/// The most nodes a graph file may hold: far above any real network, low enough to bound work.
pub const MAX_NODES: usize = 1 << 20;

/// A decoded graph file: the validated graph (weights attached) and the file's metadata (without
/// the graph JSON itself).
#[derive(Debug)]
pub struct GraphFile {
    pub graph: Graph,
    pub metadata: BTreeMap<String, String>,
}

/// The bytes of a graph file for `graph`, with `extra` metadata (e.g. `model`, `weights`).
pub fn encode(graph: &Graph, extra: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let json = serde_json::to_string(graph).map_err(|e| Error::Serialize { what: "the graph".into(), reason: e.to_string() })?;
    let mut metadata = extra.clone();
    metadata.insert(KEY_FORMAT.into(), FORMAT.into());
    metadata.insert(KEY_VERSION.into(), VERSION.to_string());
    metadata.insert(KEY_GRAPH.into(), json);
    let tensors: BTreeMap<String, &HostTensor> = graph.weights.iter().map(|(k, t)| (k.clone(), t.as_ref())).collect();
    encode_safetensors(&tensors, &metadata).map_err(|reason| Error::Serialize { what: "the graph file".into(), reason })
}

/// Whether `metadata` (a safetensors `__metadata__`) marks a graph file.
pub fn is_graph_metadata(metadata: &BTreeMap<String, String>) -> bool {
    metadata.get(KEY_FORMAT).map(String::as_str) == Some(FORMAT)
}

/// Decodes and validates a graph file already in memory; `path` names it in errors.
///
/// Everything is checked against the header before any tensor is decoded or allocated: the
/// metadata, the graph (`Graph::validate_with` the header's shapes, so a tensor larger than its
/// weight node is refused unread), one tensor per weight node of a readable dtype, and the
/// graph's inputs and outputs.
pub fn decode(bytes: &[u8], path: &Path) -> Result<GraphFile> {
    let shown = path.display().to_string();
    let err = |reason: String| Error::GraphFile { path: shown.clone(), reason };
    let (entries, mut metadata) = header_of(path, bytes)?;
    if !is_graph_metadata(&metadata) {
        return Err(err(format!(
            "is a safetensors file but not a Kiln graph file (its metadata has no `{KEY_FORMAT}: {FORMAT}`); \
             a state_dict goes to --weights, a graph file comes from `kiln trace` or `Graph::save`"
        )));
    }
    match metadata.get(KEY_VERSION).map(|v| v.parse::<u32>()) {
        Some(Ok(VERSION)) => {}
        Some(Ok(v)) => return Err(err(format!("graph format version {v} is not supported (this Kiln reads version {VERSION})"))),
        _ => return Err(err(format!("metadata `{KEY_VERSION}` is missing or not a number"))),
    }
    let json = metadata.remove(KEY_GRAPH).ok_or_else(|| err(format!("metadata has no `{KEY_GRAPH}` (the graph JSON)")))?;
    let mut graph: Graph = serde_json::from_str(&json).map_err(|e| err(format!("metadata `{KEY_GRAPH}`: {e}")))?;
    if graph.nodes.len() > MAX_NODES {
        return Err(err(format!("{} nodes, more than the limit of {MAX_NODES}", graph.nodes.len())));
    }
    let mut unused: BTreeMap<&str, &Entry> = entries.iter().map(|(k, e)| (k.as_str(), e)).collect();
    let mut named: BTreeMap<&str, &Entry> = BTreeMap::new();
    for (id, node) in graph.nodes.iter().enumerate() {
        if let Op::Weight { name, .. } = &node.op {
            if named.contains_key(name.as_str()) {
                return Err(err(format!("weight `{name}` is named by two weight nodes")));
            }
            let entry = unused
                .remove(name.as_str())
                .ok_or_else(|| err(format!("weight node %{id} (`{}`) names tensor `{name}`, which the file does not hold", node.path)))?;
            named.insert(name, entry);
            if !is_readable_dtype(&entry.dtype) {
                return Err(Error::TensorDtype {
                    what: "graph file".into(),
                    key: name.clone(),
                    got: entry.dtype.clone(),
                    path: path.into(),
                });
            }
        }
    }
    if let Some(extra) = unused.keys().next() {
        return Err(err(format!("tensor `{extra}` is not a weight of the graph ({} such tensor(s))", unused.len())));
    }
    // The header's shapes are checked against its byte ranges: their element counts exist.
    graph
        .validate_with(|name| named.get(name).map(|e| (e.shape.as_slice(), numel(&e.shape).unwrap_or(0))))
        .map_err(|e| err(e.to_string()))?;
    graph.check_bindings().map_err(err)?;
    for (name, entry) in named {
        let t = decode_entry(path, bytes, name, entry, "graph file")?;
        graph.weights.insert(name.to_string(), Arc::new(t));
    }
    Ok(GraphFile { graph, metadata })
}

/// Reads a graph file: only a regular file is opened (a directory or FIFO is named, never waited
/// on), and it is mapped, so only its header is read before it is checked.
pub fn read(path: impl AsRef<Path>) -> Result<GraphFile> {
    let path = path.as_ref();
    let shown = path.display().to_string();
    let give = format!("the path of a {EXTENSION} graph file");
    let bytes = crate::host::map_regular(path, &give, |reason| Error::GraphFile { path: shown, reason })?;
    let file = decode(&bytes, path)?;
    tracing::debug!(path = %path.display(), nodes = file.graph.nodes.len(), weights = file.graph.weights.len(), "loaded graph file");
    Ok(file)
}

/// Writes `graph` and its weights as a graph file with `extra` metadata.
pub fn write(graph: &Graph, path: impl AsRef<Path>, extra: &BTreeMap<String, String>) -> Result<()> {
    let path = path.as_ref();
    let bytes = encode(graph, extra)?;
    std::fs::write(path, &bytes).map_err(Error::io(path))?;
    tracing::debug!(path = %path.display(), bytes = bytes.len(), "wrote graph file");
    Ok(())
}

/// What a model file holds, told by its content, never by its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// An engine file: it starts with `KILNENG` (`Engine::save`, `kiln build`).
    Engine,
    /// A graph file: a safetensors file whose metadata holds `kiln.graph` (`Graph::save`, `kiln trace`).
    Graph,
    /// Another safetensors file (a `state_dict`, a reference), or one whose header does not parse.
    Safetensors,
    /// Anything else, including what is not a regular file (never opened, so a FIFO cannot block).
    Other,
}

/// Tells an engine file from a graph file by their first bytes: the engine magic, or a
/// safetensors header (8-byte length, then JSON) whose metadata holds [`KEY_GRAPH`].
pub fn kind(path: impl AsRef<Path>) -> FileKind {
    let path = path.as_ref();
    let mut head = [0u8; 9];
    let regular = std::fs::metadata(path).is_ok_and(|m| m.is_file());
    let read = regular.then(|| std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head)));
    match read {
        Some(Ok(())) if head[..8] == crate::engine::file::MAGIC => FileKind::Engine,
        Some(Ok(())) if head[8] == b'{' => match crate::var_builder::read_metadata(path) {
            Ok(meta) if meta.contains_key(KEY_GRAPH) => FileKind::Graph,
            _ => FileKind::Safetensors,
        },
        _ => FileKind::Other,
    }
}

impl Graph {
    /// Writes the graph with its weights as one safetensors file: a graph file (`.kiln.safetensors`).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        write(self, path, &BTreeMap::new())
    }

    /// Reads a graph file written by [`Graph::save`], validated as untrusted input.
    pub fn load(path: impl AsRef<Path>) -> Result<Graph> {
        read(path).map(|f| f.graph)
    }

    /// [`Graph::save`] with string metadata beside the graph's own (a model's name, its source).
    pub fn save_with_metadata(&self, path: impl AsRef<Path>, metadata: &BTreeMap<String, String>) -> Result<()> {
        write(self, path, metadata)
    }

    /// A graph file's bytes, read from `source` (named in errors), validated as [`Graph::load`] does.
    pub fn from_file_bytes(bytes: &[u8], source: &Path) -> Result<Graph> {
        decode(bytes, source).map(|f| f.graph)
    }

    /// How a graph file's name ends: `.kiln.safetensors`.
    pub const FILE_EXTENSION: &'static str = EXTENSION;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::ConvAttrs;

    fn sample() -> Graph {
        let mut g = Graph::default();
        let x = g.push_unchecked(Op::Input { name: "input".into() }, vec![], vec![2, 3, 8, 8], "input".into());
        let w = g.weight("conv.weight", Arc::new(HostTensor::new(vec![4, 3, 1, 1], (0..12).map(|i| i as f32 * 0.25 - 1.0).collect())));
        let y = g.push(Op::Conv(ConvAttrs::default()), vec![x, w], "conv".into()).expect("valid conv");
        g.inputs.push(x);
        g.mark_output("y", y);
        g
    }

    fn reason(e: Error) -> String {
        match e {
            Error::GraphFile { reason, .. } => reason,
            other => panic!("expected a graph-file error, got {other}"),
        }
    }

    #[test]
    fn round_trip_keeps_nodes_weights_and_metadata() {
        let g = sample();
        let extra = BTreeMap::from([("model".to_string(), "tiny".to_string())]);
        let f = decode(&encode(&g, &extra).expect("encodes"), Path::new("g.kiln.safetensors")).expect("decodes");
        assert_eq!(f.graph.nodes, g.nodes);
        assert_eq!(f.graph.inputs, g.inputs);
        assert_eq!(f.graph.outputs, g.outputs);
        assert_eq!(f.graph.weights["conv.weight"], g.weights["conv.weight"]);
        assert_eq!(f.metadata["model"], "tiny");
        assert_eq!(f.metadata[KEY_FORMAT], FORMAT);
    }

    /// `sample()` as a graph file whose graph JSON, metadata and tensors `edit` changed first.
    fn edited(
        edit: impl FnOnce(&mut serde_json::Value, &mut BTreeMap<String, String>, &mut BTreeMap<String, HostTensor>),
    ) -> Result<GraphFile> {
        let g = sample();
        let mut json = serde_json::to_value(&g).expect("json");
        let mut meta = BTreeMap::from([(KEY_FORMAT.to_string(), FORMAT.to_string()), (KEY_VERSION.to_string(), VERSION.to_string())]);
        let mut tensors: BTreeMap<String, HostTensor> = g.weights.iter().map(|(k, t)| (k.clone(), HostTensor::clone(t))).collect();
        edit(&mut json, &mut meta, &mut tensors);
        meta.entry(KEY_GRAPH.to_string()).or_insert_with(|| json.to_string());
        let refs: BTreeMap<String, &HostTensor> = tensors.iter().map(|(k, t)| (k.clone(), t)).collect();
        decode(&encode_safetensors(&refs, &meta).expect("encodes"), Path::new("g.kiln.safetensors"))
    }

    fn says(r: Result<GraphFile>, want: &str) {
        let e = reason(r.expect_err("rejected"));
        assert!(e.contains(want), "`{e}` should say `{want}`");
        println!("graph file g.kiln.safetensors: {e}");
    }

    #[test]
    fn g00_the_unedited_file_is_accepted() {
        let f = edited(|_, _, _| {}).expect("valid");
        assert_eq!(f.graph.nodes, sample().nodes);
    }

    #[test]
    fn g01_a_state_dict_is_not_a_graph_file() {
        let t = HostTensor::new(vec![2], vec![1.0, 2.0]);
        let bytes = encode_safetensors(&BTreeMap::from([("w".to_string(), &t)]), &BTreeMap::new()).expect("encodes");
        says(decode(&bytes, Path::new("w.safetensors")), "is a safetensors file but not a Kiln graph file");
    }

    #[test]
    fn g02_a_newer_format_version_is_named() {
        says(edited(|_, m, _| drop(m.insert(KEY_VERSION.into(), "2".into()))), "graph format version 2 is not supported");
    }

    #[test]
    fn g03_graph_json_that_does_not_parse_names_the_key() {
        says(edited(|_, m, _| drop(m.insert(KEY_GRAPH.into(), "{\"nodes\": [".into()))), "metadata `kiln.graph`: EOF");
    }

    #[test]
    fn g04_node_input_index_999999_is_rejected() {
        says(edited(|j, _, _| j["nodes"][2]["inputs"][1] = 999_999.into()), "reads %999999, which does not precede it");
    }

    #[test]
    fn g05_a_stored_shape_its_op_does_not_infer_is_rejected() {
        says(
            edited(|j, _, _| j["nodes"][2]["shape"][2] = 9.into()),
            "conv2d infers shape [2, 4, 8, 8] from its inputs, the node says [2, 4, 9, 8]",
        );
    }

    #[test]
    fn g06_a_weight_node_without_its_tensor_is_named() {
        says(
            edited(|_, _, t| drop(t.remove("conv.weight"))),
            "weight node %1 (`conv.weight`) names tensor `conv.weight`, which the file does not hold",
        );
    }

    #[test]
    fn g07_a_tensor_no_node_uses_is_named() {
        says(
            edited(|_, _, t| drop(t.insert("stray".into(), HostTensor::new(vec![1], vec![0.5])))),
            "tensor `stray` is not a weight of the graph",
        );
    }

    #[test]
    fn g08_a_weight_of_another_shape_than_its_node_is_rejected() {
        says(
            edited(|_, _, t| drop(t.insert("conv.weight".into(), HostTensor::new(vec![2, 6, 1, 1], vec![0.5; 12])))),
            "weight `conv.weight` has shape [2, 6, 1, 1], the node says [4, 3, 1, 1]",
        );
    }

    #[test]
    fn g09_a_graph_without_outputs_is_rejected() {
        says(edited(|j, _, _| j["outputs"] = serde_json::json!([])), "1 input(s) and 0 output(s)");
    }

    #[test]
    fn g10_an_input_of_2_pow_62_by_4_is_rejected() {
        says(edited(|j, _, _| j["nodes"][0]["shape"] = serde_json::json!([1u64 << 62, 4, 1, 1])), "has more elements than fit in memory");
    }

    #[test]
    fn g11_an_unregistered_custom_op_is_rejected() {
        says(
            edited(|j, _, _| j["nodes"][2]["op"] = serde_json::json!({"Custom": {"name": "evil", "attrs": {}}})),
            "custom op `evil` is not registered",
        );
    }

    #[test]
    fn a_u8_input_keeps_its_dtype_and_files_without_dtypes_read_as_f32() {
        let mut g = sample();
        g.nodes[0].dtype = crate::graph::DType::U8;
        let f = decode(&encode(&g, &BTreeMap::new()).expect("encodes"), Path::new("g.kiln.safetensors")).expect("decodes");
        assert_eq!(f.graph.nodes[0].dtype, crate::graph::DType::U8);
        assert_eq!(f.graph.nodes, g.nodes);
        assert_eq!(f.graph.input_dtype("input"), Some(crate::graph::DType::U8));
        // Graph files written before inputs had types have no `dtype` on their nodes.
        let old = edited(|j, _, _| {
            for n in j["nodes"].as_array_mut().expect("nodes") {
                n.as_object_mut().expect("node").remove("dtype");
            }
        })
        .expect("an older graph file");
        assert!(old.graph.nodes.iter().all(|n| n.dtype == crate::graph::DType::F32));
    }

    #[test]
    fn module_classes_round_trip_and_files_without_them_read_as_empty() {
        let mut g = sample();
        g.modules = BTreeMap::from([(String::new(), "m.Net".to_string()), ("conv".to_string(), "torch.nn.Conv2d".to_string())]);
        let f = decode(&encode(&g, &BTreeMap::new()).expect("encodes"), Path::new("g.kiln.safetensors")).expect("decodes");
        assert_eq!(f.graph.modules, g.modules);
        // `kiln trace` writes none, and files written before the field existed have none.
        let json = serde_json::to_value(sample()).expect("json");
        assert!(json.get("modules").is_none(), "an empty map is not written");
        assert!(edited(|_, _, _| {}).expect("valid").graph.modules.is_empty());
    }

    #[test]
    fn g13_only_inputs_may_be_u8() {
        says(edited(|j, _, _| j["nodes"][2]["dtype"] = "U8".into()), "a conv2d node is declared u8; only graph inputs may");
        says(edited(|j, _, _| j["nodes"][0]["dtype"] = "F16".into()), "input `input` is declared f16; inputs are f32 or u8");
    }

    #[test]
    fn g12_a_directory_is_named_as_a_directory() {
        let e = reason(read(std::env::temp_dir()).unwrap_err());
        assert!(e.contains("is a directory"), "{e}");
    }

    /// Issue 29, item 9: `kiln trace -o r18.graph` wrote a graph file that `kiln run r18.graph`
    /// refused; the kind is now told by content, whatever the name.
    #[test]
    fn g14_graph_and_engine_files_are_told_apart_by_content_not_name() {
        let dir = std::env::temp_dir().join(format!("kiln-kind-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = |name: &str, bytes: &[u8]| {
            let p = dir.join(name);
            std::fs::write(&p, bytes).expect("write");
            p
        };
        let graph = file("r18.graph", &encode(&sample(), &BTreeMap::new()).expect("encodes"));
        assert_eq!(kind(&graph), FileKind::Graph);
        let mut engine = crate::engine::file::MAGIC.to_vec();
        engine.extend([1, 2, 3]);
        assert_eq!(kind(file("engine.safetensors", &engine)), FileKind::Engine);
        let t = HostTensor::new(vec![2], vec![1.0, 2.0]);
        let state_dict = encode_safetensors(&BTreeMap::from([("w".to_string(), &t)]), &BTreeMap::new()).expect("encodes");
        assert_eq!(kind(file("w.kiln", &state_dict)), FileKind::Safetensors);
        assert_eq!(kind(file("notes.kiln.safetensors", b"hello, world")), FileKind::Other);
        assert_eq!(kind(file("short.kiln", b"KILN")), FileKind::Other);
        assert_eq!(kind(&dir), FileKind::Other);
        assert_eq!(kind(dir.join("missing")), FileKind::Other);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
