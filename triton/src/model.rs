//! One model of the repository: its file (an engine or a graph file), its checked config, and
//! the engines its GPU instances run (one per device, built once and cached in the version folder).

use crate::config::{self, Binding, ElemType, KilnParameters, ModelConfig, ModelSpec};
use crate::error::{BackendError, Result};
use crate::kiln_api::{checksum, optimize, BuildConfig, DType, Engine, EngineBuilder, Gpu, Graph, InputDims};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

/// The engine file name the backend looks for.
pub const ENGINE_FILE: &str = "model.kiln";
/// The graph file name the backend looks for.
pub const GRAPH_FILE: &str = "model.kiln.safetensors";

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SourceKind {
    Engine,
    Graph,
}

/// What a model's version folder holds, read and checked against its config.
pub struct LoadedModel {
    pub name: String,
    pub version_dir: PathBuf,
    pub file: PathBuf,
    pub kind: SourceKind,
    pub config: ModelConfig,
    pub spec: ModelSpec,
    /// The batch range and profiles: the engine file's own, or a graph file's from the parameters.
    pub build: BuildConfig,
    /// The graph as traced (a graph file) or as the engine holds it (already optimised).
    pub graph: Graph,
    /// `parameters["refuse_non_finite"]`: requests with NaN or infinity in an FP32 input are refused.
    pub refuse_non_finite: bool,
    /// Identifies the graph file's bytes, for the engine cache's name.
    content_hash: u64,
    /// The graph the CPU executor runs, per input dims (optimised once, re-inferred per size).
    cpu_graphs: Mutex<HashMap<InputDims, Arc<Graph>>>,
    cpu_base: OnceLock<std::result::Result<Arc<Graph>, String>>,
    /// Engines by device ordinal; building one holds the lock, so two instances never build twice.
    engines: Mutex<HashMap<usize, Arc<Engine>>>,
}

/// Finds the model file in `version_dir`: `default_model_filename` when config.pbtxt sets it,
/// else `model.kiln` or `model.kiln.safetensors` (not both).
pub fn find_model_file(model: &str, version_dir: &Path, default_name: &str) -> Result<(PathBuf, SourceKind)> {
    let err = |reason: String| BackendError::ModelFile { model: model.into(), dir: version_dir.to_path_buf(), reason };
    let kind_of = |name: &str| if name.ends_with(Graph::FILE_EXTENSION) { SourceKind::Graph } else { SourceKind::Engine };
    if !default_name.is_empty() {
        // A file of the version folder: not a path out of it (`../`, `/etc/...`).
        let plain = Path::new(default_name).components().all(|c| matches!(c, std::path::Component::Normal(_)));
        if !plain {
            return Err(err(format!(
                "default_model_filename `{default_name}` must name a file in the version folder, not a path out of it"
            )));
        }
        let path = version_dir.join(default_name);
        if !path.is_file() {
            return Err(err(format!("default_model_filename `{default_name}` does not exist")));
        }
        return Ok((path, kind_of(default_name)));
    }
    let found: Vec<&str> = [ENGINE_FILE, GRAPH_FILE].into_iter().filter(|f| version_dir.join(f).is_file()).collect();
    match found.as_slice() {
        [one] => Ok((version_dir.join(one), kind_of(one))),
        [] => Err(err(format!("no model file: expected {ENGINE_FILE} (a Kiln engine) or {GRAPH_FILE} (a graph file from `kiln trace`)"))),
        _ => Err(err(format!("both {ENGINE_FILE} and {GRAPH_FILE} are there; remove one or set default_model_filename in config.pbtxt"))),
    }
}

impl LoadedModel {
    /// Reads the model file, works out what it offers and checks config.pbtxt against it.
    pub fn load(config: ModelConfig, version_dir: &Path) -> Result<Self> {
        let name = config.name.clone();
        let (file, kind) = find_model_file(&name, version_dir, &config.default_model_filename)?;
        let params = config.kiln_parameters()?;
        let bytes = std::fs::read(&file).map_err(|e| BackendError::ModelFile {
            model: name.clone(),
            dir: version_dir.to_path_buf(),
            reason: format!("cannot read {}: {e}", file.display()),
        })?;
        let file_name = file.file_name().map_or_else(|| file.display().to_string(), |f| f.to_string_lossy().into_owned());
        let (graph, build) = match kind {
            SourceKind::Graph => {
                let graph = Graph::from_file_bytes(&bytes, &file).map_err(BackendError::kiln(format!("model `{name}`")))?;
                let profile =
                    params.profile.as_ref().map(|p| config::shape_profile(p, &traced_dims(&graph))).transpose().map_err(|reason| {
                        BackendError::Config { model: name.clone(), field: "parameters[\"min_shapes\"/\"max_shapes\"]".into(), reason }
                    })?;
                (graph, config::build_config(&config, &params, profile, version_dir))
            }
            SourceKind::Engine => {
                // `refuse_non_finite` is checked per request, not built in: an engine takes it.
                if (KilnParameters { refuse_non_finite: false, ..params.clone() }) != engine_defaults() {
                    return Err(BackendError::Config {
                        model: name.clone(),
                        field: "parameters".into(),
                        reason: format!("set build options, but {file_name} is an engine file, built already with its own; remove them, or serve a graph file"),
                    });
                }
                Engine::read_contents(&bytes, &file.display().to_string()).map_err(BackendError::kiln(format!("model `{name}`")))?
            }
        };
        let spec =
            model_spec(&graph, &build, &file_name, kind == SourceKind::Engine).map_err(BackendError::kiln(format!("model `{name}`")))?;
        config::check(&config, &spec)?;
        Ok(Self {
            name,
            version_dir: version_dir.to_path_buf(),
            file,
            kind,
            config,
            spec,
            build,
            graph,
            refuse_non_finite: params.refuse_non_finite,
            content_hash: checksum(&bytes),
            cpu_graphs: Mutex::new(HashMap::new()),
            cpu_base: OnceLock::new(),
            engines: Mutex::new(HashMap::new()),
        })
    }

    /// The largest batch a request (or a batch the dynamic batcher forms) may have.
    pub fn max_batch(&self) -> usize {
        self.config.max_batch_size.max(1) as usize
    }

    /// Whether the model runs these per-image input dims: the traced ones, or any inside one of
    /// its optimization profiles.
    pub fn accepts(&self, dims: &InputDims) -> bool {
        if self.build.profiles.is_empty() {
            return traced_dims(&self.graph) == *dims;
        }
        self.build.profile_for(&self.graph, dims).is_some()
    }

    /// What the model accepts, for errors: `input 3x224x224`, or each profile's ranges.
    pub fn accepted_text(&self) -> String {
        if self.build.profiles.is_empty() {
            return traced_dims(&self.graph).iter().map(|(n, d)| format!("{n} {}", config::dims_text(d))).collect::<Vec<_>>().join(", ");
        }
        let profiles: Vec<String> = self
            .build
            .profiles
            .iter()
            .map(|p| {
                p.iter()
                    .map(|(n, r)| format!("{n} {}..{}", config::dims_text(&r.min), config::dims_text(&r.max)))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .collect();
        profiles.join(" or ")
    }

    /// The graph the CPU executor runs at `dims` (which `accepts`).
    pub fn cpu_graph(&self, dims: &InputDims) -> Result<Arc<Graph>> {
        let base = self
            .cpu_base
            .get_or_init(|| match self.kind {
                // An engine's graph is optimised already.
                SourceKind::Engine => Ok(Arc::new(self.graph.clone())),
                SourceKind::Graph => optimize(&self.graph).map(Arc::new).map_err(|e| e.to_string()),
            })
            .clone()
            .map_err(|reason| BackendError::Unsupported { what: format!("model `{}` on the CPU", self.name), reason })?;
        if traced_dims(&base) == *dims {
            return Ok(base);
        }
        let mut cache = self.cpu_graphs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(g) = cache.get(dims) {
            return Ok(g.clone());
        }
        let g = Arc::new(base.with_input_dims(dims).map_err(BackendError::kiln(format!("model `{}` at input dims {dims:?}", self.name)))?);
        // A long-running server sees few distinct sizes; bound the cache all the same.
        if cache.len() >= 16 {
            cache.clear();
        }
        cache.insert(dims.clone(), g.clone());
        Ok(g)
    }

    /// The engine for GPU `device`: loaded from the engine file, or from the cached build of the
    /// graph file (rebuilt when the cache does not load on this GPU), or built now and cached.
    pub fn engine(&self, device: usize, log: &dyn Fn(&str)) -> Result<Arc<Engine>> {
        let mut engines = self.engines.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = engines.get(&device) {
            return Ok(e.clone());
        }
        let what = format!("model `{}` on GPU {device}", self.name);
        let gpu = Gpu::new(device).map_err(BackendError::kiln(what.clone()))?;
        let engine = match self.kind {
            SourceKind::Engine => {
                Engine::load(&self.file, &gpu).map_err(BackendError::kiln(format!("{what}: loading {}", self.file.display())))?
            }
            SourceKind::Graph => {
                let cache = self.engine_cache_path(&gpu);
                match Engine::load(&cache, &gpu) {
                    Ok(e) if same_build(&e.config, &self.build) => {
                        log(&format!("{what}: loaded the cached engine {}", cache.display()));
                        e
                    }
                    cached => {
                        if let Err(e) = &cached {
                            if cache.exists() {
                                log(&format!("{what}: rebuilding, the cached engine {} does not load here: {e}", cache.display()));
                            }
                        }
                        log(&format!(
                            "{what}: building a {} engine for batch 1..={} from {} (first load; cached for the next)",
                            self.build.precision.short_name(),
                            self.build.max_batch,
                            self.file.display()
                        ));
                        let start = std::time::Instant::now();
                        let e = EngineBuilder::new(self.build.clone())
                            .with_gpu(gpu.clone())
                            .build(&self.graph)
                            .map_err(BackendError::kiln(format!("{what}: building")))?;
                        log(&format!("{what}: built in {:.1} s", start.elapsed().as_secs_f64()));
                        // A read-only repository still serves; it only builds again next time.
                        let tmp = cache.with_extension(format!("kiln.tmp{}", std::process::id()));
                        match e.save(&tmp).and_then(|()| std::fs::rename(&tmp, &cache).map_err(crate::kiln_api::KilnError::io(&cache))) {
                            Ok(()) => log(&format!("{what}: cached the engine as {}", cache.display())),
                            Err(err) => {
                                let _ = std::fs::remove_file(&tmp);
                                log(&format!("{what}: could not cache the engine ({err}); it will be built again on the next load"));
                            }
                        }
                        e
                    }
                }
            }
        };
        let engine = Arc::new(engine);
        engines.insert(device, engine.clone());
        Ok(engine)
    }

    /// `model.sm90-<hash>.kiln` in the version folder: one per GPU architecture, graph file and
    /// build config, so a changed config or graph never reuses a stale engine.
    pub fn engine_cache_path(&self, gpu: &Gpu) -> PathBuf {
        let config = serde_json::to_string(&self.build).unwrap_or_default();
        let key = checksum(format!("{:016x}|{}|{config}", self.content_hash, gpu.info.name).as_bytes());
        self.version_dir.join(format!("model.sm{}-{key:016x}.kiln", gpu.info.sm))
    }
}

/// Whether a cached engine was built with this config (`Best` records its per-layer choice in the
/// engine's config after the build).
fn same_build(engine: &BuildConfig, wanted: &BuildConfig) -> bool {
    let chosen = |c: &BuildConfig| BuildConfig { best_int8_layers: None, ..c.clone() };
    chosen(engine) == chosen(wanted)
}

/// The parameters of a config that sets none.
fn engine_defaults() -> KilnParameters {
    KilnParameters {
        precision: crate::kiln_api::Precision::Fp16,
        opt_batch: None,
        cuda_graphs: true,
        calibration_cache: None,
        profile: None,
        refuse_non_finite: false,
    }
}

/// Each input's per-image dims as traced, by name.
pub fn traced_dims(graph: &Graph) -> InputDims {
    graph.input_names().into_iter().zip(&graph.inputs).map(|(n, &i)| (n.to_string(), graph.nodes[i].shape[1..].to_vec())).collect()
}

fn elem_of(dtype: Option<DType>) -> ElemType {
    match dtype {
        Some(DType::U8) => ElemType::U8,
        _ => ElemType::F32,
    }
}

/// The model's bindings: inputs with the ranges its profiles allow, outputs with the dims they
/// take across those ranges (re-inferred at each profile's min and max).
pub fn model_spec(graph: &Graph, build: &BuildConfig, file: &str, is_engine: bool) -> crate::kiln_api::KilnResult<ModelSpec> {
    let traced = traced_dims(graph);
    let mut inputs: Vec<Binding> = traced.iter().map(|(n, d)| Binding::fixed(n, elem_of(graph.input_dtype(n)), d)).collect();
    // Inputs in the graph's order, not by name.
    let order: Vec<&str> = graph.input_names();
    inputs.sort_by_key(|b| order.iter().position(|n| *n == b.name));
    let out_dims = |g: &Graph| -> BTreeMap<String, Vec<usize>> {
        g.outputs.iter().map(|(n, id)| (n.clone(), g.nodes[*id].shape[1..].to_vec())).collect()
    };
    let traced_out = out_dims(graph);
    let mut outputs: Vec<Binding> = graph.outputs.iter().map(|(n, _)| Binding::fixed(n, ElemType::F32, &traced_out[n])).collect();
    for profile in &build.profiles {
        for end in [0, 1] {
            let mut dims = traced.clone();
            for (name, r) in profile {
                dims.insert(name.clone(), if end == 0 { r.min.clone() } else { r.max.clone() });
            }
            for b in inputs.iter_mut() {
                widen(&mut b.range, &dims[&b.name]);
            }
            let at = out_dims(&graph.with_input_dims(&dims)?);
            for b in outputs.iter_mut() {
                widen(&mut b.range, &at[&b.name]);
            }
        }
    }
    let batch = is_engine.then_some((build.min_batch, build.max_batch));
    Ok(ModelSpec { file: file.to_string(), inputs, outputs, batch })
}

fn widen(range: &mut [(usize, usize)], dims: &[usize]) {
    for (r, &d) in range.iter_mut().zip(dims) {
        *r = (r.0.min(d), r.1.max(d));
    }
}
