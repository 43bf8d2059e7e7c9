//! `EngineBuilder`: graph → passes → one layer per node through its converter → arena plan.
//! Loading an engine file runs the same lowering with recorded tactics and no passes.

use super::arena::{self, StepUse};
use super::gpu::{cuda_err, Gpu};
use super::kernels::{self, Kernels};
use super::layer::{BuildCtx, Elem, Layer, Layout, RunCtx, Storage, ValueDesc, ValueId, WeightStore, MAX_RANK};
use super::tactic::Tactics;
use super::{check_converters, is_structural, BuildConfig, InputDims};
use crate::graph::{DType, Graph, Op};
use crate::ops::LayoutPlan;
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

/// Builds engines from graphs.
pub struct EngineBuilder {
    pub config: BuildConfig,
    gpu: Option<Arc<Gpu>>,
    progress: Option<super::tactic::Progress>,
}

/// What a build did, for the CLI and logs.
#[derive(Clone, Debug, Default)]
pub struct BuildSummary {
    pub layers: usize,
    /// One line per layer that does the work of several graph nodes (conv+bias+residual+ReLU).
    pub fused: Vec<String>,
    pub memory: MemorySummary,
    pub tactics_timed: usize,
    pub tactics_cached: usize,
    pub build_seconds: f64,
    /// Per timed choice: the problem and (kind, ms) of each candidate.
    pub tactic_log: Vec<(String, Vec<(String, f32)>)>,
    /// For an INT8/FP8 engine: which layers are quantised (`calibrate::quant_summary`).
    pub quantised: Option<String>,
}

/// Device memory of an engine, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemorySummary {
    /// Weights, held once by the engine (the layers chosen; losing candidates' copies are freed).
    pub weights: usize,
    /// Each execution context's arena: activations and layer workspaces, planned by lifetime.
    pub arena: usize,
    /// The most bytes live at one layer, a lower bound on `arena`.
    pub peak_live: usize,
    /// The layer where `peak_live` is reached.
    pub peak_at: String,
    /// The largest workspace of one layer (inside the arena).
    pub largest_workspace: usize,
    /// Layers that write their output over an input that dies with them.
    pub in_place: usize,
    /// Each context's input and output bindings at the max batch.
    pub bindings: usize,
}

impl MemorySummary {
    /// Weights and one context's arena: the device memory an engine with one context needs
    /// besides its bindings.
    pub fn total(&self) -> usize {
        self.weights + self.arena
    }
}

impl std::fmt::Display for MemorySummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        write!(
            f,
            "memory {:.1} MiB = weights {:.1} MiB + arena {:.1} MiB per context (live peak {:.1} MiB at `{}`, largest workspace {:.1} MiB, {} layers in place); bindings {:.1} MiB per context",
            mib(self.total()),
            mib(self.weights),
            mib(self.arena),
            mib(self.peak_live),
            self.peak_at,
            mib(self.largest_workspace),
            self.in_place,
            mib(self.bindings)
        )
    }
}

impl std::fmt::Display for BuildSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} layers ({} fused); {} tactics timed, {} from cache; built in {:.2} s",
            self.layers,
            self.fused.len(),
            self.tactics_timed,
            self.tactics_cached,
            self.build_seconds
        )?;
        writeln!(f, "{}", self.memory)?;
        for line in &self.fused {
            writeln!(f, "  fused: {line}")?;
        }
        if let Some(q) = &self.quantised {
            writeln!(f, "  {q}")?;
        }
        Ok(())
    }
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

/// An engine lowered for one set of input dims: layers over one planned arena.
pub struct Plan {
    /// Every input's per-image dims.
    pub dims: InputDims,
    pub(crate) layers: Vec<Box<dyn Layer>>,
    pub(crate) values: Vec<ValueDesc>,
    /// Arena offset of each arena value (aliases resolved), `usize::MAX` for bindings.
    pub(crate) offsets: Vec<usize>,
    pub(crate) arena_bytes: usize,
    /// Each layer's workspace in the arena: offset and length.
    pub(crate) workspaces: Vec<(usize, usize)>,
    pub(crate) inputs: Vec<(String, ValueId)>,
    pub(crate) outputs: Vec<(String, ValueId)>,
    pub memory: MemorySummary,
}

impl Plan {
    pub fn layers(&self) -> impl Iterator<Item = &dyn Layer> {
        self.layers.iter().map(|l| l.as_ref())
    }
    /// Names and per-image dims (PyTorch order) of the inputs.
    pub fn inputs(&self) -> Vec<(&str, &[usize])> {
        self.inputs.iter().map(|(n, v)| (n.as_str(), self.values[v.0].dims.as_slice())).collect()
    }
    pub fn outputs(&self) -> Vec<(&str, &[usize])> {
        self.outputs.iter().map(|(n, v)| (n.as_str(), self.values[v.0].dims.as_slice())).collect()
    }
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
            let ws = match self.plan.workspaces.get(i) {
                Some(&(_, bytes)) if bytes >= 1 << 20 => format!("  [workspace {:.2} MiB]", bytes as f64 / (1 << 20) as f64),
                Some(&(_, bytes)) if bytes > 0 => format!("  [workspace {:.1} KiB]", bytes as f64 / 1024.0),
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

    /// Runs the passes, checks every op has a converter (before touching the GPU), lowers and
    /// plans. Errors name the op and module path.
    pub fn build(&self, graph: &Graph) -> Result<Engine> {
        let start = Instant::now();
        self.config.validate()?;
        self.config.validate_profiles(graph)?;
        check_converters(graph)?;
        let optimized = crate::passes::optimize(graph)?;
        check_converters(&optimized)?;
        let optimized = match self.config.precision {
            super::Precision::Best => crate::calibrate::prepare_for_best(optimized, self.config.calibration_cache.as_deref())?,
            p => match p.quant_format() {
                Some(format) => crate::calibrate::prepare_for_engine(optimized, format, self.config.calibration_cache.as_deref())?,
                // A Q/DQ graph in FP16/FP32 runs its quantisers as they are; weights' are folded.
                None if crate::calibrate::has_quant_nodes(&optimized) => crate::calibrate::fold_constant_quant(&optimized)?,
                None => optimized,
            },
        };
        let gpu = match &self.gpu {
            Some(g) => g.clone(),
            None => Gpu::new(0)?,
        };
        if self.config.precision == super::Precision::Fp8 && gpu.info.sm < 89 {
            return Err(Error::Config {
                reason: format!("FP8 needs a GPU of compute capability 8.9 or newer; {} is sm_{}", gpu.info.name, gpu.info.sm),
            });
        }
        let mut tactics = Tactics { cache_prefix: cache_prefix(&gpu, &self.config), progress: self.progress.clone(), ..Default::default() };
        if let Some(path) = &self.config.timing_cache {
            tactics.load_cache(path)?;
        }
        let mut engine = match (self.config.precision, &self.config.best_int8_layers) {
            (super::Precision::Best, None) => super::best::build(gpu, optimized, self.config.clone(), &mut tactics)?,
            _ => lower(gpu, optimized, self.config.clone(), &mut tactics)?,
        };
        if let Some(path) = &self.config.timing_cache {
            tactics.save_cache(path)?;
        }
        engine.summary.build_seconds = start.elapsed().as_secs_f64();
        Ok(engine)
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

/// The arena the graph's activations need at `batch` with `elem_bytes` per element, planned
/// before lowering: one step per computed node (no reformats, scratch or workspace), each residual
/// overwritten by the conv that adds it. Returns the plan and each node's step (`None` for
/// weights). The builder gives each layer's tactics the room this leaves at its step as their
/// workspace budget.
pub fn estimate_arena(graph: &Graph, elem_bytes: usize, batch: usize) -> (arena::ArenaPlan, Vec<Option<usize>>) {
    let computed = |i: usize| !matches!(graph.nodes[i].op, Op::Weight { .. });
    let bytes: Vec<usize> =
        graph.nodes.iter().map(|n| n.shape.iter().skip(1).product::<usize>().saturating_mul(batch).saturating_mul(elem_bytes)).collect();
    let mut step_of = vec![None; graph.nodes.len()];
    let mut steps = Vec::new();
    for (id, n) in graph.nodes.iter().enumerate().filter(|&(id, _)| computed(id)) {
        let mut values: Vec<usize> = n.inputs.iter().copied().filter(|&i| computed(i)).collect();
        values.push(id);
        let overwrite = match &n.op {
            Op::Conv(a) if a.residual => n.inputs.last().map(|&z| (id, z)),
            _ => None,
        };
        step_of[id] = Some(steps.len());
        steps.push(StepUse { values, workspace: 0, overwrite });
    }
    // Graph outputs stay live to the end.
    let outputs: Vec<usize> = graph.outputs.iter().map(|(_, id)| *id).collect();
    steps.push(StepUse { values: outputs, ..Default::default() });
    (arena::plan_steps(&bytes, &steps), step_of)
}

/// The layout of each node's value (`None` for weights).
type NodeLayouts = Vec<Option<Layout>>;

/// The layout of every value and the layouts each node reads its inputs in, from each op's
/// `OpDef::layouts`. A graph input takes the layout its first reader asks for (so the input
/// reformat writes it there directly); one read by nothing is contiguous.
fn plan_layouts(graph: &Graph) -> Result<(NodeLayouts, Vec<Option<LayoutPlan>>)> {
    let mut layout: Vec<Option<Layout>> = vec![None; graph.nodes.len()];
    let mut plans = vec![None; graph.nodes.len()];
    for (id, node) in graph.nodes.iter().enumerate() {
        let rank = node.shape.len().checked_sub(1).filter(|&r| r <= MAX_RANK).ok_or_else(|| Error::Lower {
            path: node.path.clone(),
            op: node.op.name().to_string(),
            reason: format!("shape {:?}: the engine takes 1 to {MAX_RANK} dims after the batch", node.shape),
        })?;
        let Some(def) = node.op.def() else { continue };
        let has: Vec<Option<Layout>> = node
            .inputs
            .iter()
            .map(|&j| match &graph.nodes[j].op {
                Op::Weight { .. } => None,
                _ => Some(layout[j].unwrap_or(Layout::contiguous(graph.nodes[j].shape.len() - 1))),
            })
            .collect();
        let plan = def.layouts(&has, rank);
        for (k, &j) in node.inputs.iter().enumerate() {
            if matches!(graph.nodes[j].op, Op::Input { .. }) && layout[j].is_none() {
                layout[j] = plan.inputs.get(k).copied().flatten().or(has[k]);
            }
        }
        layout[id] = Some(plan.output);
        plans[id] = Some(plan);
    }
    for (id, node) in graph.nodes.iter().enumerate() {
        if matches!(node.op, Op::Input { .. }) && layout[id].is_none() {
            layout[id] = Some(Layout::contiguous(node.shape.len() - 1));
        }
    }
    Ok((layout, plans))
}

/// Copies of values in another layout or element type, made once each: a second reader wanting
/// the same (layout, type) reuses the copy, and a reader wanting a copy's original reads the
/// original (a reformat pair that would cancel is never made). Element types differ where nodes
/// of different precisions meet (`BuildConfig::layer_precisions`): one kernel converts both.
#[derive(Default)]
struct Reformats {
    copies: HashMap<(ValueId, Layout, Elem), ValueId>,
    origin: HashMap<ValueId, ValueId>,
}

impl Reformats {
    /// `v` in `want` and `elem`, adding a reformat layer (and its lifetime) when no copy exists yet.
    fn get(
        &mut self,
        ctx: &mut BuildCtx,
        v: ValueId,
        (want, elem): (Layout, Elem),
        layers: &mut Vec<Box<dyn Layer>>,
        touches: &mut Vec<Vec<ValueId>>,
    ) -> Result<ValueId> {
        let v = self.origin.get(&v).copied().unwrap_or(v);
        let desc = ctx.value(v).clone();
        if desc.layout.same_bytes(want, &desc.dims) && desc.elem == elem {
            return Ok(v);
        }
        if let Some(&copy) = self.copies.get(&(v, want, elem)) {
            return Ok(copy);
        }
        let copy = ValueId(ctx.values.len());
        let name = if desc.elem == elem { format!("{}.{want:?}", desc.name) } else { format!("{}.{want:?}.{elem:?}", desc.name) };
        ctx.values.push(ValueDesc { name, layout: want, elem, storage: Storage::Arena, ..desc.clone() });
        let path = ctx.node(ctx.current).path.clone();
        layers.push(kernels::reformat_layer(ctx, v, copy, &path)?);
        touches.push(vec![v, copy]);
        self.copies.insert((v, want, elem), copy);
        self.origin.insert(copy, v);
        Ok(copy)
    }
}

/// Lowers an optimised graph to an engine (build and load share this): one plan per build shape
/// (`BuildConfig::build_shapes`), each profile's opt first, timed; the others follow its choices.
pub(crate) fn lower(gpu: Arc<Gpu>, graph: Graph, config: BuildConfig, tactics: &mut Tactics) -> Result<Engine> {
    let kernels = {
        let _one_build = gpu.build_lock.lock().unwrap_or_else(|p| p.into_inner());
        gpu.ctx.bind_to_thread().map_err(super::gpu::cuda_err("binding the CUDA context"))?;
        Arc::new(Kernels::new(&gpu)?)
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
        let (plan, plan_summary) = lower_plan(&gpu, &kernels, &at_shape, dims, &config, tactics, &weights)?;
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

/// The nodes a `Best` engine lowers as aliases of their input: its activation quantisers
/// (`calibrate::prepare_for_best`) but the `stored` ones, whose codes its INT8 convs read. They
/// carry scales for the FP8 candidates of the layers that read them and compute nothing
/// themselves. None in other precisions.
fn best_aliases(graph: &Graph, config: &BuildConfig, stored: &[bool]) -> Vec<bool> {
    use crate::ops::quant::Quant;
    graph
        .nodes
        .iter()
        .zip(stored)
        .map(|(n, &stored)| {
            config.precision == super::Precision::Best
                && !stored
                && matches!(n.op, Op::Quant(Quant::FakeQuantize(_)))
                && n.inputs.first().is_some_and(|&i| !matches!(graph.nodes[i].op, Op::Weight { .. }))
        })
        .collect()
}

/// Lowers a graph at one set of input dims to a plan: layouts, one layer per node through its
/// converter, reformats, workspaces and the arena.
fn lower_plan(
    gpu: &Arc<Gpu>,
    kernels: &Kernels,
    graph: &Graph,
    dims: InputDims,
    config: &BuildConfig,
    tactics: &mut Tactics,
    weights: &WeightStore,
) -> Result<(Plan, BuildSummary)> {
    // A panicked build leaves nothing half-done in the lock's data, so a poisoned lock is usable.
    let _one_build = gpu.build_lock.lock().unwrap_or_else(|p| p.into_inner());
    gpu.ctx.bind_to_thread().map_err(super::gpu::cuda_err("binding the CUDA context"))?;
    let (timed_before, cached_before, log_before) = (tactics.timed, tactics.cached, tactics.log.len());
    let elem = config.precision.elem();
    let precisions = super::node_precisions(graph, config);
    let (layouts, plans) = plan_layouts(graph)?;
    let (estimate, step_of) = estimate_arena(graph, elem.size(), config.max_batch);
    // An engine whose activations alone cannot fit is refused before any tactic is timed.
    let (free, _) = cudarc::driver::result::mem_get_info().map_err(cuda_err("reading free device memory"))?;
    if estimate.bytes > free {
        let at = step_of.iter().position(|&s| s == Some(estimate.peak_step)).map(|n| graph.nodes[n].path.as_str()).unwrap_or("?");
        return Err(Error::OutOfMemory {
            what: format!(
                "the activations of an engine for batch {}..={} ({:?}; {} bytes are live at `{at}`, {free} bytes of device memory are free; lower the max batch)",
                config.min_batch, config.max_batch, config.precision, estimate.peak
            ),
            bytes: estimate.bytes,
        });
    }
    let mut values = Vec::new();
    let mut node_values = vec![None; graph.nodes.len()];
    let mut input_bindings = Vec::new();
    let eight_bit = crate::ops::conv::conv8::plan(graph, config, &precisions, gpu.info.sm);
    let stored_elem = eight_bit.format.map(super::eight_bit::EightBitPlan::elem);
    // Best's quantisers but those its INT8 convs read, quantisers folded into the 8-bit stem
    // after them and quantisers whose codes the conv before them writes are not lowered.
    let mut aliased = best_aliases(graph, config, &eight_bit.stored);
    let readers = graph.readers();
    aliased.iter_mut().zip(&eight_bit.folded).for_each(|(a, &f)| *a |= f);
    for (id, node) in graph.nodes.iter().enumerate() {
        let Some(layout) = layouts[id] else { continue };
        if aliased[id] {
            if node_values[id].is_none() {
                node_values[id] = node_values[node.inputs[0]];
            }
            continue;
        }
        let dims = node.shape[1..].to_vec();
        if let Op::Input { name } = &node.op {
            // The binding holds what the user hands over (f32 values, or bytes for a u8 input);
            // the entry reformat converts it to the input's element type inside the engine.
            let elem = match node.dtype {
                DType::F32 => Elem::F32,
                DType::U8 => Elem::U8,
                other => {
                    return Err(Error::Lower {
                        path: node.path.clone(),
                        op: "input".into(),
                        reason: format!("input `{name}` is declared {other}; engine inputs are f32 or u8"),
                    })
                }
            };
            input_bindings.push((name.clone(), id, ValueId(values.len())));
            values.push(ValueDesc {
                name: name.clone(),
                dims: dims.clone(),
                elem,
                layout: Layout::contiguous(dims.len()),
                storage: Storage::Binding,
            });
            // An input whose only reader is a quantiser folded into the 8-bit stem is read from its
            // binding as the user hands it over (NCHW f32): no entry reformat runs.
            if elem == Elem::F32 && matches!(readers[id][..], [q] if eight_bit.folded[q]) {
                node_values[id] = Some(ValueId(values.len() - 1));
                continue;
            }
        }
        node_values[id] = Some(ValueId(values.len()));
        match (eight_bit.requant[id], stored_elem) {
            // A conv that requantises writes its quantiser's value: the codes, named after it.
            (Some(q), Some(elem)) => {
                let name = graph.nodes[q].path.clone();
                values.push(ValueDesc { name, dims, elem, layout, storage: Storage::Arena });
                node_values[q] = node_values[id];
                aliased[q] = true;
            }
            _ => {
                let elem = match stored_elem {
                    Some(e) if eight_bit.stored[id] => e,
                    _ => precisions[id].elem(),
                };
                values.push(ValueDesc { name: node.path.clone(), dims, elem, layout, storage: Storage::Arena });
            }
        }
    }
    let mut output_bindings = Vec::new();
    for (name, id) in &graph.outputs {
        let src = node_values[*id]
            .ok_or_else(|| Error::Binding { name: name.clone(), reason: "the output is a weight, not a computed value".into() })?;
        let dims = values[src.0].dims.clone();
        let layout = Layout::contiguous(dims.len());
        output_bindings.push((name.clone(), *id, src, ValueId(values.len())));
        values.push(ValueDesc { name: name.clone(), dims, elem: Elem::F32, layout, storage: Storage::Binding });
    }

    let mut ctx = BuildCtx {
        gpu,
        config,
        graph,
        kernels,
        values,
        node_values,
        current_inputs: Vec::new(),
        scratch: Vec::new(),
        candidate_scratch: Vec::new(),
        current: 0,
        tactics,
        weights,
        workspace_budget: 0,
        precisions,
        eight_bit,
    };
    // Each layer with the values it touches, for lifetimes.
    let mut layers: Vec<Box<dyn Layer>> = Vec::new();
    let mut touches: Vec<Vec<ValueId>> = Vec::new();
    let mut fused = Vec::new();
    let mut reformats = Reformats::default();
    for (name, id, binding) in &input_bindings {
        ctx.current = *id;
        let internal = ctx.node_values[*id].expect("inputs have values");
        if internal == *binding {
            continue;
        }
        layers.push(kernels::reformat_layer(&mut ctx, *binding, internal, name)?);
        touches.push(vec![internal]);
    }
    let to_lower = graph.nodes.iter().filter(|n| !is_structural(&n.op)).count();
    let mut lowered = 0;
    for (id, node) in graph.nodes.iter().enumerate() {
        let (Some(def), Some(plan)) = (node.op.def(), &plans[id]) else { continue };
        if aliased[id] {
            continue;
        }
        if let Some(progress) = &ctx.tactics.progress {
            progress(lowered, to_lower, &node.path);
        }
        lowered += 1;
        ctx.current = id;
        ctx.workspace_budget = step_of[id].map_or(0, |s| estimate.peak.saturating_sub(estimate.live[s]));
        ctx.scratch.clear();
        ctx.candidate_scratch.clear();
        // Each activation input in the layout the op asks for and the node's own element type.
        let elem = ctx.elem();
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for (k, &j) in node.inputs.iter().enumerate() {
            inputs.push(match ctx.node_values[j] {
                // 8-bit codes are read as they are, by the 8-bit convs the plan made them for, and
                // so is an input binding, by the 8-bit stem.
                Some(v) if ctx.eight_bit.stored[j] || ctx.value(v).storage == Storage::Binding => Some(v),
                Some(v) => {
                    let want = plan.inputs.get(k).copied().flatten().unwrap_or(ctx.value(v).layout);
                    Some(reformats.get(&mut ctx, v, (want, elem), &mut layers, &mut touches)?)
                }
                None => None,
            });
        }
        ctx.current_inputs = inputs;
        let layer = def.convert(&mut ctx, id)?;
        let mut touched: Vec<ValueId> = ctx.current_inputs.iter().flatten().copied().collect();
        touched.extend(ctx.node_values[id]);
        touched.extend(ctx.scratch.iter().copied());
        // A candidate's own scratch (a prologue's copy, a chain's intermediate) is held only if
        // the chosen layer uses it.
        touched.extend(layer.own_scratch().into_iter().filter(|d| ctx.candidate_scratch.contains(d)));
        // A layer doing the work of several traced nodes says so in its op's label (`+relu`).
        let label = def.label();
        if let Some((name, fused_parts)) = label.split_once(" +") {
            fused.push(format!("{} = {name} + {} as {}", node.path, fused_parts.replace(" +", " + "), layer.kind()));
        }
        layers.push(layer);
        touches.push(touched);
    }
    for (name, id, src, binding) in &output_bindings {
        ctx.current = *id;
        layers.push(kernels::reformat_layer(&mut ctx, *src, *binding, name)?);
        touches.push(vec![*src]);
    }
    let weight_bytes = weights.bytes();
    let values = ctx.values;

    // cuBLASLt plans for every batch of the range, so workspace sizes are exact.
    let rt = RunCtx { stream: &gpu.stream, handles: &gpu.handles, ptrs: &[], workspace: 0, workspace_bytes: super::gemm::GEMM_WORKSPACE };
    let batches = config.min_batch..=config.max_batch;
    let mut workspaces = Vec::with_capacity(layers.len());
    for layer in &layers {
        let mut need = 0;
        for b in batches.clone() {
            layer.prepare(&rt, b)?;
            need = need.max(layer.workspace_bytes(b));
        }
        workspaces.push(need);
    }

    // Lifetimes of arena storage roots (an alias keeps its root alive).
    let root = |mut v: ValueId| {
        while let Storage::Alias(src) = values[v.0].storage {
            v = src;
        }
        v
    };
    let in_arena = |v: ValueId| values[root(v).0].storage == Storage::Arena;
    let value_bytes: Vec<usize> = values
        .iter()
        .enumerate()
        .map(|(v, d)| if root(ValueId(v)).0 == v && in_arena(ValueId(v)) { d.bytes(config.max_batch) } else { 0 })
        .collect();
    // One step per layer, two for a layer with a prologue (its copy, then its main work).
    let mut steps: Vec<StepUse> = Vec::with_capacity(layers.len());
    let mut step_of_layer = Vec::with_capacity(layers.len());
    for ((vs, layer), &workspace) in touches.iter().zip(&layers).zip(&workspaces) {
        let mut values: Vec<usize> = vs.iter().filter(|&&v| in_arena(v)).map(|&v| root(v).0).collect();
        if let Some((src, dst)) = layer.prologue().filter(|&(s, d)| in_arena(s) && in_arena(d)) {
            let (src, dst) = (root(src).0, root(dst).0);
            steps.push(StepUse { values: vec![src, dst], ..Default::default() });
            values.retain(|&v| v != src);
        }
        step_of_layer.push(steps.len());
        let overwrite = layer.overwrites().filter(|&(o, i)| in_arena(o) && in_arena(i)).map(|(o, i)| (root(o).0, root(i).0));
        steps.push(StepUse { values, workspace, overwrite });
    }
    let plan = arena::plan_steps(&value_bytes, &steps);
    let offsets: Vec<usize> = (0..values.len()).map(|v| plan.offsets[root(ValueId(v)).0].unwrap_or(0)).collect();
    let memory = MemorySummary {
        weights: weight_bytes,
        arena: plan.bytes,
        peak_live: plan.peak,
        peak_at: step_of_layer.iter().position(|&s| s >= plan.peak_step).map(|l| layers[l].path().to_string()).unwrap_or_default(),
        largest_workspace: workspaces.iter().copied().max().unwrap_or(0),
        in_place: plan.in_place.len(),
        bindings: values.iter().filter(|d| d.storage == Storage::Binding).map(|d| d.bytes(config.max_batch)).sum(),
    };

    let summary = BuildSummary {
        layers: layers.len(),
        fused,
        memory: memory.clone(),
        tactics_timed: tactics.timed - timed_before,
        tactics_cached: tactics.cached - cached_before,
        build_seconds: 0.0,
        tactic_log: tactics.log[log_before..].to_vec(),
        quantised: match config.precision {
            super::Precision::Best => {
                let count = |f: &dyn Fn(&str) -> bool| layers.iter().filter(|l| f(&l.kind())).count();
                let int8 = count(&|k| super::eight_bit::precision_of_kind(k).is_some());
                let fp8 = count(&|k| k.starts_with(super::eight_bit::FP8_GEMM));
                Some(crate::calibrate::best_summary(graph, int8, fp8))
            }
            _ => {
                let native = layers.iter().filter(|l| super::eight_bit::precision_of_kind(&l.kind()).is_some()).count();
                crate::calibrate::quant_summary(graph, native)
            }
        },
    };
    let plan = Plan {
        dims,
        layers,
        values,
        offsets,
        workspaces: step_of_layer.iter().map(|&s| plan.workspace[s]).collect(),
        arena_bytes: plan.bytes,
        inputs: input_bindings.into_iter().map(|(n, _, b)| (n, b)).collect(),
        outputs: output_bindings.into_iter().map(|(n, _, _, b)| (n, b)).collect(),
        memory,
    };
    Ok((plan, summary))
}
