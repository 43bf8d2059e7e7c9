//! `EngineBuilder`: graph → `prepare` (checks, passes, the precision's quantisers) → one plan per
//! build shape (`plan::lower_plan`: a layer per node through its converter, over an arena) →
//! [`Engine`]. `Best` searches its INT8 convs here (`best::search`, lowering through this file).
//! Loading an engine file runs the same lowering with recorded tactics and no passes.

use super::best::{self, LayerTimes};
use super::choices::Tactics;
use super::gpu::Gpu;
use super::kernels::Kernels;
use super::layer::{Layer, WeightStore};
use super::plan::lower_plan;
pub use super::plan::{BuildSummary, Plan};
use super::prepare::prepare;
use super::{BuildConfig, InputDims, Precision};
use crate::graph::{DType, Graph};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

/// Builds engines from graphs.
pub struct EngineBuilder {
    pub config: BuildConfig,
    gpu: Option<Arc<Gpu>>,
    progress: Option<super::choices::Progress>,
}

/// A built engine: its plans (one per input shape it runs: layers over one planned arena),
/// shareable by many execution contexts.
pub struct Engine {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) kernels: Arc<Kernels>,
    pub config: BuildConfig,
    /// The optimised graph the engine was lowered from, with its (folded) weights, at its traced
    /// input dims; each plan is lowered from it at that plan's dims.
    pub graph: Graph,
    /// The plan at the first build shape (the first profile's opt, or the traced dims).
    pub(crate) plan: Arc<Plan>,
    /// Every plan lowered so far, `plan` first; more are added as new shapes are run.
    pub(crate) plans: RwLock<Vec<Arc<Plan>>>,
    /// Per profile, the kind chosen for each module path at its opt shape (other shapes follow).
    pub(crate) follow: Vec<BTreeMap<String, String>>,
    pub(crate) weights: WeightStore,
    pub(crate) tactics: Mutex<BTreeMap<String, String>>,
    pub summary: BuildSummary,
}

impl Engine {
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
    /// The plan at the first build shape (see [`Engine::plan_for`] for others).
    pub fn plan(&self) -> &Arc<Plan> {
        &self.plan
    }
    /// Every plan lowered so far.
    pub fn plans(&self) -> Vec<Arc<Plan>> {
        self.plans.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
    /// The first plan's layers.
    pub fn layers(&self) -> impl Iterator<Item = &dyn Layer> {
        self.plan.layers()
    }
    /// Names and per-image dims (PyTorch order) of the inputs, at the first plan's shape.
    pub fn inputs(&self) -> Vec<(&str, &[usize])> {
        self.plan.inputs()
    }
    pub fn outputs(&self) -> Vec<(&str, &[usize])> {
        self.plan.outputs()
    }
    /// The element type input `name` is declared with: f32, or u8 for a binding of bytes
    /// (`None`: no such input).
    pub fn input_dtype(&self, name: &str) -> Option<DType> {
        self.graph.input_dtype(name)
    }
    /// The recorded tactic choices (module path and problem → layer kind), of every plan.
    pub fn tactics(&self) -> BTreeMap<String, String> {
        self.tactics.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The plan for these input dims: one already lowered, or a new one, lowered now with the
    /// algorithms its profile chose at opt (each checked to run at these dims; where one does not,
    /// the same algorithm sliced differently, else the first candidate that runs: nothing is
    /// timed, so a reloaded engine lowers the same plan). An error names the dims and the ranges
    /// the engine accepts.
    pub fn plan_for(&self, dims: &InputDims) -> Result<Arc<Plan>> {
        if let Some(p) = self.plans.read().unwrap_or_else(|p| p.into_inner()).iter().find(|p| p.dims == *dims) {
            return Ok(p.clone());
        }
        let Some(profile) = self.config.profile_for(&self.graph, dims) else {
            let accepted: Vec<String> = if self.config.profiles.is_empty() {
                vec![format!("{:?} (no profiles; build with --minShapes/--optShapes/--maxShapes for others)", self.plan.dims)]
            } else {
                self.config.profiles.iter().map(|p| format!("{p:?}")).collect()
            };
            return Err(Error::Binding {
                name: dims.keys().cloned().collect::<Vec<_>>().join(","),
                reason: format!("input dims {dims:?} are outside every profile of the engine; it accepts {}", accepted.join(" or ")),
            });
        };
        let graph = self.graph.with_input_dims(dims)?;
        let mut tactics = Tactics {
            recorded: self.tactics(),
            follow: self.follow.get(profile).cloned().unwrap_or_default(),
            cache_prefix: cache_prefix(&self.gpu, &self.config),
            ..Default::default()
        };
        let (plan, _) = lower_plan(&self.gpu, &self.kernels, &graph, dims.clone(), &self.config, &mut tactics, &self.weights)?;
        let plan = Arc::new(plan);
        self.tactics.lock().unwrap_or_else(|p| p.into_inner()).extend(tactics.recorded);
        let mut plans = self.plans.write().unwrap_or_else(|p| p.into_inner());
        // Another thread may have lowered the same dims meanwhile: keep the first.
        if let Some(p) = plans.iter().find(|p| p.dims == *dims) {
            return Ok(p.clone());
        }
        plans.push(plan.clone());
        Ok(plan)
    }

    /// The engine's layers (its first plan's), one a line, with the precision each computes in
    /// and the workspace of those that have one, then every plan's dims and arena, for `inspect`.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        for (i, l) in self.plan.layers.iter().enumerate() {
            // Per-layer rules decide each layer's storage type (reformats show their reader's).
            let elem = crate::engine::Precision::name(self.config.precision_of(&self.graph.fp32_layers, l.path()).elem());
            // A layer on 8-bit tensor cores says so in its kind.
            let kind = l.kind();
            let p = if let Some(p) = super::eight_bit::precision_of_kind(&kind) {
                p.to_string()
            } else if kind.split(':').next().is_some_and(|k| k.ends_with("-fp8")) {
                "fp8".to_string()
            } else if self.config.precision == crate::engine::Precision::Best && kind != super::eight_bit::QUANT_CODES {
                // Best's other layers compute on unquantised values.
                elem.to_string()
            } else {
                crate::calibrate::layer_precision(&self.graph, l.path(), elem)
            };
            let ws = match self.plan.workspaces.get(i).map(|w| w.slot) {
                Some((_, bytes)) if bytes >= 1 << 20 => format!("  [workspace {:.2} MiB]", bytes as f64 / (1 << 20) as f64),
                Some((_, bytes)) if bytes > 0 => format!("  [workspace {:.1} KiB]", bytes as f64 / 1024.0),
                _ => String::new(),
            };
            out.push_str(&format!("{i:>4} {p:<22} {}{ws}\n", l.describe()));
        }
        // The bindings as the user hands them over (a u8 input is uploaded as bytes).
        for (name, dims) in self.plan.inputs() {
            let dtype = self.input_dtype(name).unwrap_or_default();
            out.push_str(&format!("input `{name}`: {} {dtype}\n", dims_text(dims)));
        }
        let plans = self.plans();
        if plans.len() > 1 || !self.config.profiles.is_empty() {
            for (p, profile) in self.config.profiles.iter().enumerate() {
                let ranges: Vec<String> = profile
                    .iter()
                    .map(|(n, r)| format!("{n}: min {} opt {} max {}", dims_text(&r.min), dims_text(&r.opt), dims_text(&r.max)))
                    .collect();
                out.push_str(&format!("profile {p}: {}\n", ranges.join(", ")));
            }
            for plan in plans {
                let dims: Vec<String> = plan.dims.iter().map(|(n, d)| format!("{n}: {}", dims_text(d))).collect();
                out.push_str(&format!(
                    "plan {}: {} layers, arena {:.1} MiB\n",
                    dims.join(", "),
                    plan.layers.len(),
                    plan.arena_bytes as f64 / (1 << 20) as f64
                ));
            }
        }
        out
    }
}

/// Dims as `3x480x640`.
pub fn dims_text(dims: &[usize]) -> String {
    dims.iter().map(usize::to_string).collect::<Vec<_>>().join("x")
}

impl EngineBuilder {
    pub fn new(config: BuildConfig) -> Self {
        Self { config, gpu: None, progress: None }
    }

    /// Builds on this GPU instead of opening GPU 0.
    pub fn with_gpu(mut self, gpu: Arc<Gpu>) -> Self {
        self.gpu = Some(gpu);
        self
    }

    /// Calls `f(done, total, module path)` as each node is about to be lowered and its algorithms
    /// timed (the CLI draws a progress bar with it).
    pub fn on_progress(mut self, f: impl Fn(usize, usize, &str) + Send + Sync + 'static) -> Self {
        self.progress = Some(Arc::new(f));
        self
    }

    /// Prepares the graph (`engine::prepare`: checks, passes and its precision's quantisers,
    /// before touching the GPU), lowers and plans it. Errors name the op and module path.
    pub fn build(&self, graph: &Graph) -> Result<Engine> {
        let start = Instant::now();
        let plans_before = super::cudnn_graph::plans_built();
        let c = &self.config;
        tracing::debug!(nodes = graph.nodes.len(), precision = c.precision.short_name(), batch = ?(c.min_batch, c.opt_batch, c.max_batch), "build: preparing the graph (checks, passes, quantisers)");
        let prepared = prepare(graph, &self.config)?;
        let prepare_seconds = start.elapsed().as_secs_f64();
        let ops = prepared.nodes.iter().filter(|n| !n.op.is_leaf()).count();
        tracing::debug!(ops, ms = prepare_seconds * 1e3, "build: graph prepared");
        let gpu = self.open_gpu()?;
        tracing::debug!(gpu = %gpu.info.name, sm = gpu.info.sm, "build: lowering and timing each layer's candidates");
        let mut tactics = Tactics { cache_prefix: cache_prefix(&gpu, &self.config), progress: self.progress.clone(), ..Default::default() };
        tactics.build_time.prepare = prepare_seconds;
        if let Some(path) = &self.config.timing_cache {
            tactics.load_cache(path)?;
        }
        let mut engine = match (self.config.precision, &self.config.best_int8_layers) {
            (Precision::Best, None) => lower_best(gpu, prepared, self.config.clone(), &mut tactics)?,
            _ => lower(gpu, prepared, self.config.clone(), &mut tactics)?,
        };
        if let Some(path) = &self.config.timing_cache {
            tactics.save_cache(path)?;
        }
        engine.summary.build_seconds = start.elapsed().as_secs_f64();
        engine.summary.build_time = std::mem::take(&mut tactics.build_time);
        let plans_after = super::cudnn_graph::plans_built();
        engine.summary.build_time.fused_plans = (plans_after.0 - plans_before.0, plans_after.1 - plans_before.1);
        engine.summary.build_time.fused_plans_from_disk = plans_after.2 - plans_before.2;
        tracing::debug!(
            seconds = engine.summary.build_seconds,
            timed = tactics.timed,
            from_timing_cache = tactics.cached,
            plans = engine.plans().len(),
            "build: done"
        );
        Ok(engine)
    }

    /// The GPU to build on (GPU 0 unless one was given), checked to run the precision.
    fn open_gpu(&self) -> Result<Arc<Gpu>> {
        let gpu = match &self.gpu {
            Some(g) => g.clone(),
            None => Gpu::new(0)?,
        };
        if self.config.precision == Precision::Fp8 && gpu.info.sm < 89 {
            return Err(Error::Config {
                reason: format!("FP8 needs a GPU of compute capability 8.9 or newer; {} is sm_{}", gpu.info.name, gpu.info.sm),
            });
        }
        Ok(gpu)
    }
}

/// Timing-cache key prefix: everything besides the problem that decides a winner. Restricted
/// tactic sources get their own entries, so a forced choice never poisons an unrestricted build.
pub(crate) fn cache_prefix(gpu: &Gpu, config: &BuildConfig) -> String {
    let sources = config.tactic_sources.as_ref().map(|s| format!("|only:{}", s.join(","))).unwrap_or_default();
    let fastest = if config.fastest_tactics { "|fastest" } else { "" };
    format!(
        "{}|sm{}|cudnn{}|{:?}|b{}{sources}{fastest}",
        gpu.info.name, gpu.info.sm, gpu.info.cudnn_version, config.precision, config.opt_batch
    )
}

/// Lowers an optimised graph to an engine (build and load share this): one plan per build shape
/// (`BuildConfig::build_shapes`), each profile's opt first, timed; the others follow its choices.
pub(crate) fn lower(gpu: Arc<Gpu>, graph: Graph, config: BuildConfig, tactics: &mut Tactics) -> Result<Engine> {
    let kernels = {
        let _one_build = gpu.build_lock.lock().unwrap_or_else(|p| p.into_inner());
        gpu.ctx.bind_to_thread().map_err(super::gpu::cuda_err("binding the CUDA context"))?;
        let start = std::time::Instant::now();
        let kernels = Arc::new(Kernels::new(&gpu)?);
        tactics.build_time.kernels += start.elapsed().as_secs_f64();
        kernels
    };
    let weights = WeightStore::default();
    let shapes = config.build_shapes(&graph);
    let mut plans = Vec::with_capacity(shapes.len());
    let mut follow = vec![BTreeMap::new(); config.profiles.len()];
    let mut summary = None;
    for dims in shapes {
        // Without profiles the one build shape is the traced one: the graph as it is.
        let at_shape = if config.profiles.is_empty() { graph.clone() } else { graph.with_input_dims(&dims)? };
        let profile = config.profile_for(&graph, &dims);
        // A profile's first plan is its opt (build_shapes lists the opts first): it is timed.
        let is_opt = profile.is_some_and(|p| config.profiles[p].iter().all(|(n, r)| dims.get(n) == Some(&r.opt)));
        tactics.follow = match profile {
            Some(p) if !is_opt => follow[p].clone(),
            _ => BTreeMap::new(),
        };
        let before = tactics.chosen.len();
        let shown = tracing::enabled!(tracing::Level::DEBUG).then(|| format!("{dims:?}"));
        let (plan, plan_summary) = lower_plan(&gpu, &kernels, &at_shape, dims, &config, tactics, &weights)?;
        if let Some(dims) = shown {
            let arena_mib = plan.memory.arena as f64 / (1 << 20) as f64;
            tracing::debug!(input = %dims, arena_mib, timed = is_opt || profile.is_none(), "plan for this input shape");
        }
        if let (Some(p), true) = (profile, is_opt) {
            follow[p].extend(tactics.chosen[before..].iter().cloned());
        }
        summary.get_or_insert(plan_summary);
        plans.push(Arc::new(plan));
    }
    tactics.follow.clear();
    let plan = plans.first().cloned().ok_or_else(|| Error::Config { reason: "no input shape to build for".into() })?;
    let mut summary = summary.unwrap_or_default();
    summary.memory.weights = weights.bytes();
    Ok(Engine {
        gpu,
        kernels,
        config,
        graph,
        plan,
        plans: RwLock::new(plans),
        follow,
        weights,
        tactics: Mutex::new(tactics.recorded.clone()),
        summary,
    })
}

/// Lowers a `Best` engine whose INT8 convs are not chosen yet: `best::search` lowers and profiles
/// candidate plans through this builder and keeps the fastest; its line joins the summary. With
/// nothing to search, the all-16-bit engine, unprofiled.
fn lower_best(gpu: Arc<Gpu>, graph: Graph, config: BuildConfig, tactics: &mut Tactics) -> Result<Engine> {
    let with = |layers: Vec<String>| BuildConfig { best_int8_layers: Some(layers), ..config.clone() };
    let int8 = best::int8_convs(&graph, &config, gpu.info.sm);
    if int8.is_empty() {
        return lower(gpu, graph, with(vec![]), tactics);
    }
    let mark = tactics.mark();
    let measure = |layers: Vec<String>| layer_times(lower(gpu.clone(), graph.clone(), with(layers), tactics)?, config.opt_batch);
    let (mut engine, search) = best::search(&graph, &config, gpu.info.sm, int8, measure)?;
    let summary = &mut engine.summary;
    summary.quantised = Some(summary.quantised.take().map_or(search.clone(), |q| format!("{q}\n{search}")));
    (summary.tactics_timed, summary.tactics_cached, summary.tactic_log) = tactics.since(mark);
    Ok(engine)
}

/// `engine` with the device time of each of its module paths at `batch` (`profile_layers`).
fn layer_times(engine: Engine, batch: usize) -> Result<(Engine, LayerTimes)> {
    let engine = Arc::new(engine);
    let ms = engine.context()?.profile_layers(batch, best::PROFILE_ITERS)?;
    let mut times = LayerTimes::new();
    for (layer, t) in engine.plan.layers.iter().zip(ms) {
        *times.entry(layer.path().to_string()).or_default() += t;
    }
    let engine =
        Arc::try_unwrap(engine).map_err(|_| Error::Config { reason: "a Best candidate engine is still shared after profiling".into() })?;
    Ok((engine, times))
}
