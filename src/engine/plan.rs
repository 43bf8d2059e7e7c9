//! A [`Plan`]: an engine lowered for one set of input dims, and how one is lowered. [`lower_plan`]
//! runs named phases in order: pre-check (the activations fit), allocate (a value per node),
//! bind (the outputs), convert (a layer per node, reformats between), workspaces, lifetimes (the
//! arena) and summarise.

use super::arena::{self, ArenaPlan, StepUse};
use super::config::{BuildConfig, InputDims};

use super::choices::{Tactics, TacticsMark};
use super::eight_bit::FP8_GEMM;
use super::eight_bit::{self, EightBitPlan};
use super::gpu::{cuda_err, Gpu};
use super::kernels::Kernels;
use super::layer::{Elem, Layer, LayerCtx, Layout, RunCtx, Storage, ValueDesc, ValueId, WeightStore, MAX_RANK};
use super::precision::Precision;
use super::reformat::reformat_layer;
use super::resolve::node_precisions;
use crate::graph::{DType, Graph, NodeId, Op};
use crate::ops::{BuildCtx, LayoutPlan, OpDef};
use crate::LowerKind;
use crate::{Error, Result};
use std::collections::HashMap;
use std::sync::Arc;

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
    /// Where the build's seconds went.
    pub build_time: BuildTime,
}

/// Where a build's seconds went: the graph's preparation, the kernels' compilation (or their
/// on-disk cache), and the layers: their converters (which make each candidate: cuDNN plans,
/// weights laid out) and, within that, choosing among the candidates (timing them, or a
/// recorded, cached or followed choice). A `Best` build adds up every plan it lowered.
#[derive(Clone, Debug, Default)]
pub struct BuildTime {
    pub prepare: f64,
    pub kernels: f64,
    pub layers: f64,
    pub choosing: f64,
    /// cuDNN fused-conv plans built (runtime fusion compiles one kernel each), and their seconds:
    /// part of making candidates and of choosing (plans are built on first run).
    pub fused_plans: (u64, f64),
    /// How many of those plans the plan cache on disk held (restored, not compiled).
    pub fused_plans_from_disk: u64,
    /// Module path and seconds (converting and choosing) of each lowered node, in build order.
    pub per_layer: Vec<(String, f64)>,
}

impl BuildTime {
    /// The `n` slowest nodes to lower, slowest first.
    pub fn slowest(&self, n: usize) -> Vec<(String, f64)> {
        let mut all = self.per_layer.clone();
        all.sort_by(|a, b| b.1.total_cmp(&a.1));
        all.truncate(n);
        all
    }
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
        let t = &self.build_time;
        if t.layers > 0.0 {
            let slowest: Vec<String> = t.slowest(3).iter().map(|(p, s)| format!("`{p}` {s:.2} s")).collect();
            writeln!(
                f,
                "build time: graph prepared {:.2} s, kernels {:.2} s, layers lowered {:.2} s (choosing tactics {:.2} s, making candidates {:.2} s; {} cuDNN fused plans built in {:.2} s, {} from the plan cache), other {:.2} s; slowest layers: {}",
                t.prepare,
                t.kernels,
                t.layers,
                t.choosing,
                (t.layers - t.choosing).max(0.0),
                t.fused_plans.0,
                t.fused_plans.1,
                t.fused_plans_from_disk,
                (self.build_seconds - t.prepare - t.kernels - t.layers).max(0.0),
                slowest.join(", ")
            )?;
        }
        for line in &self.fused {
            writeln!(f, "  fused: {line}")?;
        }
        if let Some(q) = &self.quantised {
            writeln!(f, "  {q}")?;
        }
        Ok(())
    }
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
    /// Each layer's workspace in the arena.
    pub(crate) workspaces: Vec<Workspace>,
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

/// Lowers a graph at one set of input dims to a plan, phase by phase: pre-check, allocate, bind,
/// convert, workspaces, lifetimes, summarise.
pub(crate) fn lower_plan(
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
    gpu.ctx.bind_to_thread().map_err(cuda_err("binding the CUDA context"))?;
    let mark = tactics.mark();
    let precisions = node_precisions(graph, config);
    let (layouts, op_layouts) = plan_layouts(graph)?;
    let estimate = check_activations_fit(graph, config)?;
    let eight_bit = crate::ops::eight_bit_plan(graph, config, &precisions, gpu.info.sm);
    let aliased = eight_bit.aliased(graph, config);
    let mut allocated = allocate(graph, &layouts, &precisions, &eight_bit, &aliased)?;
    let outputs = bind_outputs(graph, &mut allocated)?;
    let mut ctx = BuildCtx {
        layer: LayerCtx::new(gpu, config, kernels, tactics, weights, allocated.values),
        graph,
        node_values: allocated.node_values,
        current: 0,
        precisions,
        eight_bit,
    };
    let lowered = convert(&mut ctx, &op_layouts, &aliased, &estimate, &allocated.inputs, &outputs)?;
    let weight_bytes = weights.bytes();
    let values = ctx.layer.values;
    let needs = workspace_needs(gpu, config, &lowered.layers)?;
    let arena = lifetimes(&values, &lowered, &needs, config);
    let memory = memory(&values, &arena, &needs, weight_bytes, config.max_batch);
    let summary = summarise(graph, config, tactics, mark, &lowered, memory.clone());
    let plan = Plan {
        dims,
        layers: lowered.layers,
        values,
        offsets: arena.offsets,
        arena_bytes: arena.plan.bytes,
        workspaces: arena.workspaces,
        inputs: allocated.inputs.into_iter().map(|(n, _, b)| (n, b)).collect(),
        outputs: outputs.into_iter().map(|o| (o.name, o.binding)).collect(),
        memory,
    };
    Ok((plan, summary))
}

/// The arena the graph's activations need at `batch` with `elem_bytes` per element, planned
/// before lowering: one step per computed node (no reformats, scratch or workspace), each residual
/// overwritten by the conv that adds it. Returns the plan and each node's step (`None` for
/// weights). The builder gives each layer's tactics the room this leaves at its step as their
/// workspace budget.
pub fn estimate_arena(graph: &Graph, elem_bytes: usize, batch: usize) -> (ArenaPlan, Vec<Option<usize>>) {
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
            kind: LowerKind::Unsupported,
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

/// The reformats the engine will make of `graph` (an optimised graph): `(reader, value)` module
/// paths wherever a node asks for an input in another layout than the one its producer stores
/// (`OpDef::layouts`), so the builder copies it (`kiln inspect` prints them; no GPU needed).
pub fn layout_copies(graph: &Graph) -> Result<Vec<(String, String)>> {
    let (layouts, plans) = plan_layouts(graph)?;
    let mut copies = Vec::new();
    for (id, node) in graph.nodes.iter().enumerate() {
        let Some(plan) = &plans[id] else { continue };
        for (k, &j) in node.inputs.iter().enumerate() {
            let (Some(want), Some(has)) = (plan.inputs.get(k).copied().flatten(), layouts[j]) else { continue };
            if !want.same_bytes(has, &graph.nodes[j].shape[1..]) {
                copies.push((node.path.clone(), graph.nodes[j].path.clone()));
            }
        }
    }
    Ok(copies)
}

/// The activations' arena as estimated before lowering (`estimate_arena`), with each node's step.
struct ActivationEstimate {
    plan: ArenaPlan,
    step_of: Vec<Option<usize>>,
}

impl ActivationEstimate {
    /// The workspace node `id`'s tactics may take without growing the arena past the activations'
    /// own peak.
    fn room_at(&self, id: NodeId) -> usize {
        self.step_of[id].map_or(0, |s| self.plan.peak.saturating_sub(self.plan.live[s]))
    }
}

/// Pre-check: an engine whose activations alone cannot fit in the free device memory is refused
/// before any tactic is timed.
fn check_activations_fit(graph: &Graph, config: &BuildConfig) -> Result<ActivationEstimate> {
    let (plan, step_of) = estimate_arena(graph, config.precision.elem().size(), config.max_batch);
    let (free, _) = cudarc::driver::result::mem_get_info().map_err(cuda_err("reading free device memory"))?;
    if plan.bytes > free {
        let at = step_of.iter().position(|&s| s == Some(plan.peak_step)).map(|n| graph.nodes[n].path.as_str()).unwrap_or("?");
        return Err(Error::OutOfMemory {
            what: format!(
                "the activations of an engine for batch {}..={} ({:?}; {} bytes are live at `{at}`, {free} bytes of device memory are free; lower the max batch)",
                config.min_batch, config.max_batch, config.precision, plan.peak
            ),
            bytes: plan.bytes,
        });
    }
    Ok(ActivationEstimate { plan, step_of })
}

/// A plan's values as allocation made them.
struct Values {
    values: Vec<ValueDesc>,
    /// The value of each node (`None` for weights; an alias shares its input's).
    node_values: Vec<Option<ValueId>>,
    /// Each graph input: its name, its node and its binding.
    inputs: Vec<(String, NodeId, ValueId)>,
}

/// Allocate: a value for each computed node in the layout planned for it and the type its
/// precision or the 8-bit plan stores it in (`EightBitPlan::node_value`); an alias
/// (`EightBitPlan::aliased`) shares its input's value, and an input gets its binding too.
fn allocate(graph: &Graph, layouts: &NodeLayouts, precisions: &[Precision], eight_bit: &EightBitPlan, aliased: &[bool]) -> Result<Values> {
    let mut v = Values { values: Vec::new(), node_values: vec![None; graph.nodes.len()], inputs: Vec::new() };
    let readers = graph.readers();
    for (id, node) in graph.nodes.iter().enumerate() {
        let Some(layout) = layouts[id] else { continue };
        if aliased[id] {
            if v.node_values[id].is_none() {
                v.node_values[id] = v.node_values[node.inputs[0]];
            }
            continue;
        }
        let dims = node.shape[1..].to_vec();
        if let Op::Input { name } = &node.op {
            let binding = ValueId(v.values.len());
            let desc = input_binding(graph, id, name, &dims)?;
            let read_as_bound = desc.elem == Elem::F32 && eight_bit.reads_binding(&readers, id);
            v.inputs.push((name.clone(), id, binding));
            v.values.push(desc);
            if read_as_bound {
                v.node_values[id] = Some(binding);
                continue;
            }
        }
        v.node_values[id] = Some(ValueId(v.values.len()));
        let value = eight_bit.node_value(graph, id, precisions[id].elem());
        if let Some(q) = value.codes_of {
            v.node_values[q] = v.node_values[id];
        }
        v.values.push(ValueDesc { name: value.name.to_string(), dims, elem: value.elem, layout, storage: Storage::Arena });
    }
    Ok(v)
}

/// Input `id`'s binding: what the user hands over (f32 values, or bytes for a u8 input); the
/// entry reformat converts it to the input's element type inside the engine.
fn input_binding(graph: &Graph, id: NodeId, name: &str, dims: &[usize]) -> Result<ValueDesc> {
    let node = &graph.nodes[id];
    let elem = match node.dtype {
        DType::F32 => Elem::F32,
        DType::U8 => Elem::U8,
        other => {
            return Err(Error::Lower {
                path: node.path.clone(),
                op: "input".into(),
                kind: LowerKind::Unsupported,
                reason: format!("input `{name}` is declared {other}; engine inputs are f32 or u8"),
            })
        }
    };
    Ok(ValueDesc { name: name.to_string(), dims: dims.to_vec(), elem, layout: Layout::contiguous(dims.len()), storage: Storage::Binding })
}

/// A graph output's binding, written by its exit reformat from the value `src` of node `node`.
struct OutputBinding {
    name: String,
    node: NodeId,
    src: ValueId,
    binding: ValueId,
}

/// Bind: an f32, contiguous binding for each graph output.
fn bind_outputs(graph: &Graph, values: &mut Values) -> Result<Vec<OutputBinding>> {
    let mut bindings = Vec::new();
    for (name, id) in &graph.outputs {
        let src = values.node_values[*id]
            .ok_or_else(|| Error::Binding { name: name.clone(), reason: "the output is a weight, not a computed value".into() })?;
        let dims = values.values[src.0].dims.clone();
        let layout = Layout::contiguous(dims.len());
        bindings.push(OutputBinding { name: name.clone(), node: *id, src, binding: ValueId(values.values.len()) });
        values.values.push(ValueDesc { name: name.clone(), dims, elem: Elem::F32, layout, storage: Storage::Binding });
    }
    Ok(bindings)
}

/// The layers made so far, each with the values it touches (for lifetimes).
#[derive(Default)]
struct Lowered {
    layers: Vec<Box<dyn Layer>>,
    touches: Vec<Vec<ValueId>>,
    /// One line per layer that does the work of several graph nodes.
    fused: Vec<String>,
}

impl Lowered {
    fn push(&mut self, layer: Box<dyn Layer>, touched: Vec<ValueId>) {
        self.layers.push(layer);
        self.touches.push(touched);
    }
}

/// Convert: the entry reformats of the inputs, one layer per node through its converter (tactics
/// are timed there), then the exit reformats of the outputs.
fn convert(
    ctx: &mut BuildCtx,
    op_layouts: &[Option<LayoutPlan>],
    aliased: &[bool],
    estimate: &ActivationEstimate,
    inputs: &[(String, NodeId, ValueId)],
    outputs: &[OutputBinding],
) -> Result<Lowered> {
    let mut lowered = Lowered::default();
    for (name, id, binding) in inputs {
        ctx.set_current(*id);
        let internal = ctx.node_values[*id].expect("inputs have values");
        if internal == *binding {
            continue;
        }
        let layer = reformat_layer(ctx, *binding, internal, name)?;
        lowered.push(layer, vec![internal]);
    }
    let graph = ctx.graph;
    let to_lower = graph.nodes.iter().filter(|n| !n.op.is_leaf()).count();
    let mut done = 0;
    let mut reformats = Reformats::default();
    for (id, node) in graph.nodes.iter().enumerate() {
        let (Some(def), Some(layouts)) = (node.op.def(), &op_layouts[id]) else { continue };
        if aliased[id] {
            continue;
        }
        if let Some(progress) = &ctx.tactics.progress {
            progress(done, to_lower, &node.path);
        }
        done += 1;
        ctx.set_current(id);
        ctx.workspace_budget = estimate.room_at(id);
        let start = std::time::Instant::now();
        convert_node(ctx, def, layouts, &mut reformats, &mut lowered)?;
        let seconds = start.elapsed().as_secs_f64();
        ctx.tactics.build_time.layers += seconds;
        ctx.tactics.build_time.per_layer.push((node.path.clone(), seconds));
    }
    for out in outputs {
        ctx.set_current(out.node);
        let layer = reformat_layer(ctx, out.src, out.binding, &out.name)?;
        lowered.push(layer, vec![out.src]);
    }
    Ok(lowered)
}

/// The layer of the node `ctx.current`: its inputs in the layouts `layouts` asks for and its own
/// element type, then its converter. Records the values it touches, and a line when it fuses.
fn convert_node(ctx: &mut BuildCtx, def: &dyn OpDef, layouts: &LayoutPlan, reformats: &mut Reformats, lowered: &mut Lowered) -> Result<()> {
    let id = ctx.current;
    let node = ctx.node(id);
    ctx.scratch.clear();
    ctx.candidate_scratch.clear();
    let elem = ctx.elem();
    let mut inputs = Vec::with_capacity(node.inputs.len());
    for (k, &j) in node.inputs.iter().enumerate() {
        inputs.push(match ctx.node_values[j] {
            // 8-bit codes are read as they are, by the 8-bit convs the plan made them for, and
            // so is an input binding, by the 8-bit stem.
            Some(v) if ctx.eight_bit.stored[j] || ctx.value(v).storage == Storage::Binding => Some(v),
            Some(v) => {
                let want = layouts.inputs.get(k).copied().flatten().unwrap_or(ctx.value(v).layout);
                Some(reformats.get(ctx, v, (want, elem), lowered)?)
            }
            None => None,
        });
    }
    ctx.reads = inputs;
    let layer = def.convert(ctx, id)?;
    let mut touched: Vec<ValueId> = ctx.reads.iter().flatten().copied().collect();
    touched.extend(ctx.node_values[id]);
    touched.extend(ctx.scratch.iter().copied());
    // A candidate's own scratch (a prologue's copy, a chain's intermediate) is held only if
    // the chosen layer uses it.
    touched.extend(layer.own_scratch().into_iter().filter(|d| ctx.candidate_scratch.contains(d)));
    // A layer doing the work of several traced nodes says so in its op's label (`+relu`).
    if let Some((name, fused_parts)) = def.label().split_once(" +") {
        lowered.fused.push(format!("{} = {name} + {} as {}", node.path, fused_parts.replace(" +", " + "), layer.kind()));
    }
    lowered.push(layer, touched);
    Ok(())
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
    fn get(&mut self, ctx: &mut BuildCtx, v: ValueId, (want, elem): (Layout, Elem), lowered: &mut Lowered) -> Result<ValueId> {
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
        let path = ctx.path().to_string();
        let layer = reformat_layer(ctx, v, copy, &path)?;
        lowered.push(layer, vec![v, copy]);
        self.copies.insert((v, want, elem), copy);
        self.origin.insert(copy, v);
        Ok(copy)
    }
}

/// Each layer's workspace at every batch of the range (index `batch - min_batch`). Every layer is
/// prepared for every batch first (cuBLASLt and cuDNN plans made), so the sizes are exact.
fn workspace_needs(gpu: &Gpu, config: &BuildConfig, layers: &[Box<dyn Layer>]) -> Result<Vec<Vec<usize>>> {
    let batches: Vec<usize> = (config.min_batch..=config.max_batch).collect();
    // The first failing layer's error, in layer order, is the build's.
    prepare_in_parallel(gpu, layers, &batches)?.into_iter().collect::<Result<()>>()?;
    Ok(layers.iter().map(|layer| batches.iter().map(|&b| layer.workspace_bytes(b)).collect()).collect())
}

/// Prepares each layer at each of `batches` on several threads, and says for each layer whether
/// that worked. An 8-bit build's fused convs compile a kernel per plan in cuDNN (runtime fusion):
/// CPU work that took most of ResNet-50 INT8's build on one thread. Each thread takes the next
/// unprepared layer and prepares it with its own stream and handles (`Gpu::helper`). Used for a
/// plan's layers (`workspace_needs`) and for a tactic's candidates before they are timed one by
/// one (`tactic::time_candidates`). The outer error is a thread's own failure (no helper).
pub(super) fn prepare_in_parallel(gpu: &Gpu, layers: &[Box<dyn Layer>], batches: &[usize]) -> Result<Vec<Result<()>>> {
    let prepare = |rt: &RunCtx, layer: &dyn Layer| batches.iter().try_for_each(|&b| layer.prepare(rt, b));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(PREPARE_THREADS).min(layers.len());
    if threads <= 1 {
        let rt = unbound(&gpu.stream, &gpu.handles);
        return Ok(layers.iter().map(|layer| prepare(&rt, layer.as_ref())).collect());
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: std::sync::Mutex<Vec<Option<Result<()>>>> = std::sync::Mutex::new((0..layers.len()).map(|_| None).collect());
    let work = || -> Result<()> {
        let helper = gpu.helper()?;
        let rt = unbound(&helper.stream, &helper.handles);
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(layer) = layers.get(i) else { break };
            let r = prepare(&rt, layer.as_ref());
            results.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
        }
        helper.stream.synchronize().map_err(cuda_err("synchronising a build helper's stream"))?;
        gpu.give_back(helper);
        Ok(())
    };
    let threads: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(work)).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(Error::Poisoned { path: String::new(), what: "a build helper thread".into() })))
            .collect()
    });
    threads.into_iter().collect::<Result<()>>()?;
    let results = results.into_inner().unwrap_or_else(|p| p.into_inner());
    Ok(results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Err(Error::Poisoned { path: String::new(), what: "a layer no helper prepared".into() })))
        .collect())
}

/// The run context a layer is prepared with: a stream and handles, no buffer (no value addresses,
/// no workspace).
fn unbound<'a>(stream: &'a Arc<cudarc::driver::CudaStream>, handles: &'a super::gpu::Handles) -> RunCtx<'a> {
    RunCtx { stream, handles, ptrs: &[], workspace: 0, workspace_bytes: super::gemm::GEMM_WORKSPACE }
}

/// At most this many threads prepare layers: cuDNN's runtime-fusion compiles scale with cores.
const PREPARE_THREADS: usize = 16;

/// Where a layer's workspace lives in the arena. Its slot holds the workspace at the max batch,
/// which tactics chose within the arena's room. An algorithm may need more at a smaller batch
/// (cuDNN's implicit-precomp GEMM takes 2.6 MiB at some batches of ResNet-50's `layer2.0.conv2`
/// and 643 bytes at 64); there the values are smaller too, so it borrows the free tail of the step's
/// idle region (`arena::idle_tail`) rather than growing the arena. A batch whose workspace fits
/// neither makes the slot that large.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Workspace {
    /// Offset and length of the layer's own slot.
    pub slot: (usize, usize),
    /// The step's idle region (offset, length at the max batch), `(0, 0)` for none.
    pub idle: (usize, usize),
    pub max_batch: usize,
}

impl Workspace {
    /// Offset and length of the workspace the layer gets at `batch`, where it needs `need` bytes.
    pub fn at(&self, batch: usize, need: usize) -> (usize, usize) {
        let tail = super::arena::idle_tail(self.idle, batch, self.max_batch);
        if need > self.slot.1 && need <= tail.1 {
            tail
        } else {
            self.slot
        }
    }

    /// The slot a layer needs, given its workspace at each batch from `min_batch` (`by_batch`) and
    /// the idle region its step has: the max batch's workspace, or more where a smaller batch's
    /// does not fit the idle tail.
    fn slot_bytes(by_batch: &[usize], min_batch: usize, idle: (usize, usize)) -> usize {
        let max_batch = min_batch + by_batch.len().saturating_sub(1);
        let at_max = by_batch.last().copied().unwrap_or(0);
        let spilled = |(i, &need): (usize, &usize)| need > super::arena::idle_tail(idle, min_batch + i, max_batch).1;
        by_batch.iter().enumerate().filter(|&(i, need)| *need > at_max && spilled((i, need))).map(|(_, &n)| n).fold(at_max, usize::max)
    }
}

/// Where a plan's values and workspaces live in its arena.
struct ArenaLayout {
    plan: ArenaPlan,
    /// Each value's offset (an alias's is its root's).
    offsets: Vec<usize>,
    /// Each layer's workspace.
    workspaces: Vec<Workspace>,
    /// The module path of the layer where the live bytes peak.
    peak_at: String,
}

/// Lifetimes: the arena, planned over the storage roots each layer touches (an alias keeps its
/// root alive), one step per layer, two for a layer with a prologue (its copy, then its main work).
fn lifetimes(values: &[ValueDesc], lowered: &Lowered, needs: &[Vec<usize>], config: &BuildConfig) -> ArenaLayout {
    let max_batch = config.max_batch;
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
        .map(|(v, d)| if root(ValueId(v)).0 == v && in_arena(ValueId(v)) { d.bytes(max_batch) } else { 0 })
        .collect();
    let mut steps: Vec<StepUse> = Vec::with_capacity(lowered.layers.len());
    let mut step_of_layer = Vec::with_capacity(lowered.layers.len());
    for ((vs, layer), by_batch) in lowered.touches.iter().zip(&lowered.layers).zip(needs) {
        let workspace = by_batch.last().copied().unwrap_or(0);
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
    // Idle regions depend on lifetimes alone, so slots grown for a smaller batch keep them.
    let mut plan = arena::plan_steps(&value_bytes, &steps);
    let mut grown = false;
    for (l, &s) in step_of_layer.iter().enumerate() {
        let slot = Workspace::slot_bytes(&needs[l], config.min_batch, plan.idle[s]);
        grown |= slot != steps[s].workspace;
        steps[s].workspace = slot;
    }
    if grown {
        plan = arena::plan_steps(&value_bytes, &steps);
    }
    ArenaLayout {
        offsets: (0..values.len()).map(|v| plan.offsets[root(ValueId(v)).0].unwrap_or(0)).collect(),
        workspaces: step_of_layer.iter().map(|&s| Workspace { slot: plan.workspace[s], idle: plan.idle[s], max_batch }).collect(),
        peak_at: step_of_layer.iter().position(|&s| s >= plan.peak_step).map(|l| lowered.layers[l].path().to_string()).unwrap_or_default(),
        plan,
    }
}

/// The plan's device memory: `weight_bytes` of weights, its arena, and its bindings at `max_batch`.
fn memory(values: &[ValueDesc], arena: &ArenaLayout, needs: &[Vec<usize>], weight_bytes: usize, max_batch: usize) -> MemorySummary {
    MemorySummary {
        weights: weight_bytes,
        arena: arena.plan.bytes,
        peak_live: arena.plan.peak,
        peak_at: arena.peak_at.clone(),
        largest_workspace: needs.iter().flatten().copied().max().unwrap_or(0),
        in_place: arena.plan.in_place.len(),
        bindings: values.iter().filter(|d| d.storage == Storage::Binding).map(|d| d.bytes(max_batch)).sum(),
    }
}

/// Summarise: the build summary of one plan (tactics counted from `mark`).
fn summarise(
    graph: &Graph,
    config: &BuildConfig,
    tactics: &Tactics,
    mark: TacticsMark,
    lowered: &Lowered,
    memory: MemorySummary,
) -> BuildSummary {
    let (tactics_timed, tactics_cached, tactic_log) = tactics.since(mark);
    BuildSummary {
        layers: lowered.layers.len(),
        fused: lowered.fused.clone(),
        memory,
        tactics_timed,
        tactics_cached,
        build_seconds: 0.0,
        tactic_log,
        quantised: quantised(graph, config, &lowered.layers),
        build_time: BuildTime::default(),
    }
}

/// The summary's quantisation line: for `Best`, how many layers won on INT8 convs and on FP8
/// GEMMs; otherwise `calibrate::quant_summary` with the layers on 8-bit tensor cores.
fn quantised(graph: &Graph, config: &BuildConfig, layers: &[Box<dyn Layer>]) -> Option<String> {
    let count = |f: &dyn Fn(&str) -> bool| layers.iter().filter(|l| f(&l.kind())).count();
    let int8 = count(&|k| eight_bit::precision_of_kind(k).is_some());
    match config.precision {
        Precision::Best => {
            let fp8 = count(&|k| k.starts_with(FP8_GEMM));
            Some(format!(
                "best: of {} conv/linear layer(s) with a calibrated range, {int8} won their timing on INT8 tensor cores (`conv8`) and {fp8} on FP8 GEMMs (`{FP8_GEMM}`); every other layer computes in FP16 on unquantised values",
                crate::calibrate::quantised_layers(graph),
            ))
        }
        _ => crate::calibrate::quant_summary(graph, int8),
    }
}

#[cfg(test)]
mod tests {
    use super::Workspace;

    /// Issue 29, item 12: cuDNN asks 2.6 MiB at some batches below 64 and 643 bytes at 64 for
    /// ResNet-50's `layer2.0.conv2`, whose block input (98 MiB at 64) waits beside it. The slot
    /// keeps the max batch's workspace; the smaller batches borrow the input's free tail.
    #[test]
    fn a_smaller_batchs_larger_workspace_borrows_the_idle_tail() {
        const MIB: usize = 1 << 20;
        let idle = (4096, 98 * MIB);
        let mut by_batch = vec![643; 64];
        by_batch[7] = 2_760_000; // batch 8
        by_batch[62] = 2_760_000; // batch 63: x fills all but 1.5 MiB of its region
        assert_eq!(Workspace::slot_bytes(&by_batch, 1, idle), 2_760_000, "batch 63's tail is too short, so the slot grows");
        by_batch[62] = 643;
        assert_eq!(Workspace::slot_bytes(&by_batch, 1, idle), 643, "batch 8 fits the idle tail");
        let ws = Workspace { slot: (1 << 30, 643), idle, max_batch: 64 };
        let (at, len) = ws.at(8, 2_760_000);
        assert!(at >= idle.0 + 98 * MIB / 8 && at + len <= idle.0 + idle.1, "batch 8 uses x's last seven eighths: {at} + {len}");
        assert!(len >= 2_760_000);
        assert_eq!(ws.at(64, 643), (1 << 30, 643), "the max batch uses the slot");
        assert_eq!(ws.at(8, 600), (1 << 30, 643), "a workspace that fits the slot stays there");
        assert_eq!(Workspace::slot_bytes(&[0, 5000, 100], 1, (0, 0)), 5000, "no idle region: the slot is the largest");
        assert_eq!(Workspace::slot_bytes(&[], 1, idle), 0);
    }
}

#[cfg(test)]
mod layout_tests {
    use super::plan_layouts;
    use crate::engine::Layout;
    use crate::graph::Graph;
    use crate::nn::{Conv2d, Conv2dConfig, Linear, LinearConfig};
    use crate::{Forward, Module, Tracer, VarBuilder};

    fn reformats(g: &Graph) -> Vec<(String, String)> {
        super::layout_copies(g).unwrap()
    }

    /// PoolFormer's token mixer on a conv's channels-last output: GroupNorm(1) → avg-pool − x →
    /// residual add → GroupNorm(1) → 1×1 conv. GroupNorm reads and writes NHWC as it comes, so
    /// nothing is copied (two copies a GroupNorm while it read NCHW only).
    #[test]
    fn group_norms_of_a_channels_last_stream_plan_no_copy() {
        use crate::nn::{AvgPool2d, GroupNorm, GroupNormConfig, Pool2dConfig};
        let vb = VarBuilder::seeded();
        let tracer = Tracer::new();
        let x = tracer.input("x", &[1, 3, 16, 16]);
        let stem = Conv2d::load(vb.pp("stem"), &Conv2dConfig::new(3, 16, 3).padding(1)).unwrap();
        let norm1 = GroupNorm::load(vb.pp("norm1"), &GroupNormConfig::new(1, 16)).unwrap();
        let norm2 = GroupNorm::load(vb.pp("norm2"), &GroupNormConfig::new(4, 16)).unwrap();
        let pool = AvgPool2d::load(vb.pp("pool"), &Pool2dConfig::new(3).stride(1).padding(1)).unwrap();
        let fc = Conv2d::load(vb.pp("fc"), &Conv2dConfig::new(16, 16, 1)).unwrap();
        let h = stem.forward(&x).unwrap();
        let n = norm1.forward(&h).unwrap();
        let h = h.add(&pool.forward(&n).unwrap().sub(&n).unwrap()).unwrap();
        let y = fc.forward(&norm2.forward(&h).unwrap()).unwrap();
        tracer.output("y", &y);
        let g = tracer.graph();
        assert_eq!(reformats(&g), vec![], "{}", g.to_text());
        let (layouts, _) = plan_layouts(&g).unwrap();
        let at = |path: &str| layouts[g.nodes.iter().position(|n| n.path == path).unwrap_or_else(|| panic!("{path}"))].unwrap();
        assert!(at("norm1").is_channels_last() && at("norm2").is_channels_last());
    }

    /// SegFormer's tokens into a depthwise conv (`fc1` → `transpose(1, 2)` → `reshape(n, c, h,
    /// w)` → conv): after `optimize` the conv reads the Linear's bytes as its NHWC image, with no
    /// copy to NCHW and no reformat back (two copies of the tokens before `split_before_permute`).
    #[test]
    fn tokens_split_into_an_image_reach_a_conv_without_a_copy() {
        let vb = VarBuilder::seeded();
        let tracer = Tracer::new();
        let x = tracer.input("x", &[1, 24, 16]);
        let fc1 = Linear::load(vb.pp("fc1"), &LinearConfig::new(16, 32)).unwrap();
        let conv = Conv2d::load(vb.pp("dwconv"), &Conv2dConfig::new(32, 32, 3).padding(1).groups(32)).unwrap();
        let image = fc1.forward(&x).unwrap().transpose(1, 2).unwrap().reshape(&[1, 32, 4, 6]).unwrap();
        let y = conv.forward(&image).unwrap().relu().unwrap();
        tracer.output("y", &y);
        let g = tracer.graph();
        let before = crate::passes::commute_reshape_permute(&crate::passes::collapse_view_chains(&g).unwrap()).unwrap();
        assert_eq!(reformats(&before).len(), 2, "without the pass: {:?}", reformats(&before));
        let after = crate::passes::optimize(&g).unwrap();
        assert_eq!(reformats(&after), vec![], "{}", after.to_text());
    }

    /// ViT's patch embedding: a convolution (NHWC) to `[N, E, h, w]`, permuted to `[N, h, w, E]`
    /// and flattened to `[N, h·w, E]`. The permute is the NHWC output read as it lies, so both it
    /// and the reshape stay contiguous and alias the convolution's output.
    #[test]
    fn a_channels_last_permute_then_flatten_needs_no_copy() {
        let tracer = Tracer::new();
        let x = tracer.input("x", &[1, 3, 32, 32]);
        let conv = Conv2d::load(VarBuilder::seeded().pp("conv_proj"), &Conv2dConfig::new(3, 16, 16).stride(16)).unwrap();
        let y = conv.forward(&x).unwrap().permute(&[0, 2, 3, 1]).unwrap().reshape(&[1, 4, 16]).unwrap();
        tracer.output("y", &y);
        let g = tracer.graph();
        let (layouts, _) = plan_layouts(&g).unwrap();
        let at = |path: &str| {
            let id = g.nodes.iter().position(|n| n.path == path).unwrap_or_else(|| panic!("{path}"));
            (layouts[id].unwrap(), g.nodes[id].shape[1..].to_vec())
        };
        let (conv_layout, conv_dims) = at("conv_proj");
        assert!(!conv_layout.same_bytes(Layout::contiguous(3), &conv_dims), "the conv writes NHWC: {conv_layout:?}");
        for path in ["permute", "reshape"] {
            let (layout, dims) = at(path);
            assert!(layout.same_bytes(Layout::contiguous(dims.len()), &dims), "{path}: {layout:?} {dims:?}");
        }
    }
}
