//! The quantised graphs: the explicit Q/DQ form of a calibrated graph ([`quantize_graph`]),
//! weights folded onto their grids, the CPU simulation of an 8-bit engine ([`simulate`],
//! [`simulation`]), the graphs 8-bit and Best builds are lowered from, and their summaries. What
//! is quantised, and why, is in the parent module's docs.

use super::*;
use crate::engine::precision::LAYER_PRECISIONS_FLAG;
use crate::engine::LayerPrecision;

/// Per-output-channel symmetric scales of a weight `[Cout, ...]`: `max |w[c]| / max_abs`.
pub fn weight_scales(w: &HostTensor, format: QuantFormat) -> Vec<f32> {
    let cout = w.shape.first().copied().unwrap_or(1).max(1);
    let per = w.data.len() / cout;
    w.data.chunks(per.max(1)).map(|c| symmetric_scale(c.iter().fold(0f32, |m, v| m.max(v.abs())), format)).collect()
}

/// The weight quantiser of an 8-bit layer: int8 per output channel over ±127 (TensorRT's), fp8
/// per tensor (see the module docs).
fn weight_quantiser(w: &HostTensor, format: QuantFormat) -> QuantParams {
    match format {
        QuantFormat::Int8 => QuantParams::int8(1.0).range(-127, 127).per_channel(0, weight_scales(w, format)),
        QuantFormat::Fp8E4m3 => QuantParams::fp8(symmetric_scale(w.data.iter().fold(0f32, |m, v| m.max(v.abs())), QuantFormat::Fp8E4m3)),
    }
}

/// Whether an FP8 graph quantises point `p`: its layer has an FP8 kernel ([`has_fp8_kernel`]),
/// and its input is not a clamp's output (ReLU6, Hardtanh). A clamp's values crowd up to its
/// bound, where e4m3's step is an eighth of the value: with ReLU6's 6 at 448, every value in
/// [3.4, 6) rounds to a step of 0.43, INT8's is 0.047. On MobileNetV2 the convs reading ReLU6
/// outputs (the linear bottlenecks) kept in 16 bits took the FP8 simulation's logits from rel L2
/// 0.18 to 0.07 against FP32, and its top-1 on the held-out photos from 10 to 12 of 12
/// (docs/QUANT.md).
fn fp8_point(graph: &Graph, p: &QuantPoint) -> bool {
    let clamped = matches!(graph.nodes[p.activation].op, Op::Unary(crate::graph::Unary::Clamp { .. }));
    has_fp8_kernel(graph, p.node) && !clamped
}

/// Whether an FP8 engine runs layer `id` on FP8 tensor cores: a conv the 8-bit kernels take
/// (`conv8::has_kernel`: channels in multiples of 16, or the 8-bit stem), a Linear whose in and
/// out features are multiples of 16 (cuBLASLt's FP8 GEMM). Any other 8-bit point computes in FP16
/// on its Q/DQ values, and e4m3's 3-bit mantissa there only costs accuracy: MobileNetV2's first
/// conv (3 input channels, 27 products an output) alone took its logits' rel L2 against FP32 from
/// 0.21 to 0.26 (docs/QUANT.md). So an FP8 graph quantises only these layers.
fn has_fp8_kernel(graph: &Graph, id: NodeId) -> bool {
    let n = &graph.nodes[id];
    match &n.op {
        Op::Conv(_) => crate::ops::conv::conv8::has_kernel(graph, id),
        Op::Gemm(Gemm::Linear { .. }) => {
            let k = n.inputs.first().and_then(|&x| graph.nodes[x].shape.last().copied());
            let out = n.shape.last().copied();
            matches!((k, out), (Some(k), Some(o)) if k % 16 == 0 && o % 16 == 0 && k > 0 && o > 0)
        }
        _ => false,
    }
}

/// The explicit Q/DQ form of an optimised graph: a `fake_quantize` (per tensor, the cache's
/// scale) on the activation input of every 8-bit layer (in FP8, those of `fp8_point`) and one
/// on its weight (`weight_quantiser`), but at the layers a per-layer precision rule covers
/// (`rules`, `--layer-precisions`: TensorRT's `--layerPrecisions` in an INT8 build), which stay
/// unquantised and compute in the rule's precision. In FP8, where the cache holds a layer's
/// input means, its bias is corrected for its weight's rounding (`bias.rs`, `corrects_bias`).
/// `graph` must be the optimised graph the cache was recorded on (its hash is checked).
pub fn quantize_graph(graph: &Graph, cache: &CalibrationCache, format: QuantFormat, rules: &[LayerPrecision]) -> Result<Graph> {
    quantize_graph_with(graph, cache, format, rules, true)
}

/// Whether a `format` graph corrects its layers' biases for their weights' rounding (where the
/// cache holds their input means): FP8's. e4m3 rounds a weight by up to 1/16 of itself, and the
/// correction took the FP8 simulations' rel L2 against FP32 from 4.6–5.9e-2 to 1.5–1.9e-2 on
/// ResNet-18/34/50 (seeded weights); INT8's per-channel grid rounds by under 1/254 of a
/// channel's largest weight, and there it moved the ResNets by a fifth (1.4e-2 to 1.15e-2 on
/// ResNet-50) and the trained MobileNetV2's photos not at all but for their top-1 and top-5
/// coin tosses, which went the other way (docs/QUANT.md, "Bias correction").
fn corrects_bias(format: QuantFormat) -> bool {
    format == QuantFormat::Fp8E4m3
}

/// [`quantize_graph`], with bias correction (where [`corrects_bias`]) or without (Best: its
/// 16-bit candidates read the unrounded weights, which the corrected bias would shift).
fn quantize_graph_with(
    graph: &Graph,
    cache: &CalibrationCache,
    format: QuantFormat,
    rules: &[LayerPrecision],
    correct_bias: bool,
) -> Result<Graph> {
    let hash = graph_hash(graph);
    if cache.graph_hash != hash {
        return Err(Error::Calibration {
            path: "the calibration cache".into(),
            reason: format!(
                "it was recorded on graph {}, this graph is {hash}: recalibrate for this model and input size",
                cache.graph_hash
            ),
        });
    }
    let names = tensor_names(graph);
    let points: Vec<QuantPoint> = quant_points(graph)
        .into_iter()
        .filter(|p| format != QuantFormat::Fp8E4m3 || fp8_point(graph, p))
        .filter(|p| !rules.iter().any(|r| r.matches(&graph.nodes[p.node].path)))
        .collect();
    let mut out = Graph { weights: graph.weights.clone(), fp32_layers: graph.fp32_layers.clone(), ..Default::default() };
    let mut map: Vec<NodeId> = Vec::with_capacity(graph.nodes.len());
    // The fake-quantised copy of each value already made (shared by all its 8-bit readers).
    let mut quantised: BTreeMap<NodeId, NodeId> = BTreeMap::new();
    for (id, node) in graph.nodes.iter().enumerate() {
        let mut inputs: Vec<NodeId> = node.inputs.iter().map(|&j| map[j]).collect();
        let mut op = node.op.clone();
        if let Some(p) = points.iter().find(|p| p.node == id) {
            let slots = [Some((0, p.activation)), p.residual.map(|r| (inputs.len() - 1, r))];
            for (slot, a) in slots.into_iter().flatten() {
                if matches!(graph.nodes[a].op, Op::Quant(_)) {
                    continue;
                }
                inputs[slot] = match quantised.get(&a) {
                    Some(&q) => q,
                    None => {
                        let name = &names[a];
                        let range = cache.tensors.get(name).ok_or_else(|| Error::Calibration {
                            path: "the calibration cache".into(),
                            reason: format!("has no range for tensor `{name}` (read by `{}`)", node.path),
                        })?;
                        let params = QuantParams::symmetric(format, range.scale(format));
                        let q = out.push(Op::Quant(Quant::FakeQuantize(params)), vec![map[a]], format!("{name}.quantizer"))?;
                        quantised.insert(a, q);
                        q
                    }
                };
            }
            let w = graph.weight_data(p.weight).ok_or_else(|| Error::InvalidGraph {
                node: id,
                path: node.path.clone(),
                reason: "an 8-bit layer's weight has no data".into(),
            })?;
            let params = weight_quantiser(w, format);
            if let Some(means) = cache.input_means.get(&names[id]).filter(|_| correct_bias && corrects_bias(format)) {
                let mut wq = w.as_ref().clone();
                params.fake_quantize(&mut wq);
                let has_bias = matches!(&node.op, Op::Conv(a) if a.bias) || matches!(&node.op, Op::Gemm(Gemm::Linear { bias: true, .. }));
                let bias = if has_bias { node.inputs.get(2).and_then(|&b| graph.weight_data(b)) } else { None };
                if has_bias && bias.is_none() {
                    return Err(Error::InvalidGraph {
                        node: id,
                        path: node.path.clone(),
                        reason: "an 8-bit layer's bias has no data".into(),
                    });
                }
                let corrected =
                    super::bias::corrected_bias(w, &wq, means, bias.map(|b| b.data.as_slice())).ok_or_else(|| Error::Calibration {
                        path: "the calibration cache".into(),
                        reason: format!(
                            "its input means of `{}` are {} values; the layer's weight {:?} takes {} an output channel: recalibrate",
                            names[id],
                            means.len(),
                            w.shape,
                            w.shape.iter().skip(1).product::<usize>()
                        ),
                    })?;
                let name = format!("{}.bias.corrected", names[id]);
                let k = corrected.len();
                out.weights.insert(name.clone(), Arc::new(HostTensor::new(vec![k], corrected)));
                let b = out.push_unchecked(Op::Weight { name: name.clone(), quant: None }, vec![], vec![k], name);
                if has_bias {
                    inputs[2] = b;
                } else {
                    inputs.insert(2, b);
                    match &mut op {
                        Op::Conv(a) => a.bias = true,
                        Op::Gemm(Gemm::Linear { bias, .. }) => *bias = true,
                        _ => unreachable!("a quantisation point is a conv or a Linear"),
                    }
                }
            }
            inputs[1] = out.push(Op::Quant(Quant::FakeQuantize(params)), vec![inputs[1]], format!("{}.weight_quantizer", node.path))?;
        }
        let new = match &node.op {
            Op::Weight { name, .. } => out.push_unchecked(node.op.clone(), vec![], node.shape.clone(), name.clone()),
            _ => out.push_unchecked(op, inputs, node.shape.clone(), node.path.clone()),
        };
        // A u8 input stays one.
        out.nodes[new].dtype = node.dtype;
        map.push(new);
    }
    out.inputs = graph.inputs.iter().map(|&i| map[i]).collect();
    out.outputs = graph.outputs.iter().map(|(n, i)| (n.clone(), map[*i])).collect();
    Ok(out)
}

/// Replaces every `fake_quantize` of a constant by the constant it computes (`<weight>.<format>`),
/// so that layers read plain weights whose values lie on the 8-bit grid. Returns the new graph.
pub fn fold_constant_quant(graph: &Graph) -> Result<Graph> {
    replace_weight_quantizers(graph, true)
}

/// Replaces every `fake_quantize` of a constant by a constant carrying the quantiser's grid: the
/// one it computes (`<weight>.<format>`) with `fold`, else the weight it reads, whose 8-bit layers
/// round it onto that grid while its 16-bit layers read it as it is.
fn replace_weight_quantizers(graph: &Graph, fold: bool) -> Result<Graph> {
    let mut g = graph.clone();
    for id in 0..g.nodes.len() {
        let Op::Quant(Quant::FakeQuantize(p)) = &g.nodes[id].op else { continue };
        let Some(&src) = g.nodes[id].inputs.first() else { continue };
        let Op::Weight { name, .. } = &g.nodes[src].op else { continue };
        let w = g
            .weights
            .get(name)
            .cloned()
            .ok_or_else(|| Error::MissingWeight { key: name.clone(), source_name: "the graph's weights".into() })?;
        p.check(&w.shape).map_err(|reason| Error::InvalidGraph { node: id, path: g.nodes[id].path.clone(), reason: reason.to_string() })?;
        let (name, quant) = if fold {
            let mut w = w.as_ref().clone();
            p.fake_quantize(&mut w);
            let folded = format!("{name}.{}", p.format.name());
            g.weights.insert(folded.clone(), Arc::new(w));
            (folded, Some(p.clone()))
        } else {
            (name.clone(), Some(p.clone()))
        };
        g.nodes[id].op = Op::Weight { name, quant };
        g.nodes[id].inputs.clear();
    }
    crate::passes::remove_dead_nodes(&g)
}

/// The graph the CPU executor runs to simulate a `format` engine built with `cache`: the graph
/// the builder lowers ([`prepare_for_engine`]: optimised, Q/DQ nodes at the engine's quantisation
/// points, weights folded onto their grids), with each value stored as the engine stores it
/// ([`simulation`]).
pub fn simulate(graph: &Graph, cache: &CalibrationCache, format: QuantFormat) -> Result<Graph> {
    simulate_with_rules(graph, cache, format, &[])
}

/// [`simulate`] for an engine built with per-layer precision rules (`--layer-precisions`): the
/// layers they cover are not quantised, and compute (and store) in their rule's precision.
pub fn simulate_with_rules(graph: &Graph, cache: &CalibrationCache, format: QuantFormat, rules: &[LayerPrecision]) -> Result<Graph> {
    simulate_optimized(&crate::passes::optimize(graph)?, cache, format, rules)
}

/// [`simulate_with_rules`] of a graph already optimised (`passes::optimize`), for callers that
/// simulate one graph under many rule sets.
pub(super) fn simulate_optimized(
    optimized: &Graph,
    cache: &CalibrationCache,
    format: QuantFormat,
    rules: &[LayerPrecision],
) -> Result<Graph> {
    simulation(&fold_constant_quant(&quantize_graph(optimized, cache, format, rules)?)?, format, rules)
}

/// The GPU whose 8-bit plan a simulation follows: one with both formats' 8-bit kernels (FP8's
/// need sm_89; INT8's plan is the same from sm_80 on).
const SIMULATED_SM: u32 = 90;

/// The CPU simulation of the `format` engine the builder lowers from `prepared` (the graph of
/// [`prepare_for_engine`]): the same nodes, each value marked with the type the engine stores it
/// in, which the CPU executor rounds to (`Node::dtype` F16: IEEE half, nearest even,
/// `number_format::round_f16`). Everything is computed in f32 as before; only storage is
/// simulated, boundary by boundary, by the engine's own plan (`node_precisions`,
/// `ops::eight_bit_plan` for an sm_90 GPU):
/// - **graph inputs** read by FP16 layers: the entry reformat (f32 → NHWC f16) rounds them, here
///   an identity reshape marked f16 after the input. Not where the 8-bit stem reads the f32
///   binding itself (`EightBitPlan::folded`: it quantises the f32 values);
/// - **8-bit codes** (a stored quantiser, a conv that requantises into one, a quantiser folded
///   into the stem): not rounded. The 8-bit kernels dequantise codes in f32
///   (`acc · s_x · s_w[k] + bias`, f32 bias, residual `code · s_r`) and requantise `rint(v · (1/s))` saturated,
///   ties to even (int8, `cvt.rni` + `cvt.pack.sat`) or `cvt.rn.satfinite.e4m3x2` (fp8): the
///   arithmetic of `fake_quantize` in f32 (`kernels/conv8.cu`, `kernels/eight_bit.cuh`);
/// - **every other value of an FP16 node** is f16 (the layer computes in f32 and writes f16):
///   the output of a conv on the 8-bit kernel that does not requantise, of the FP16 layers
///   (depthwise convs, convs without an 8-bit kernel, Linears, pooling, elementwise), of a
///   non-stored quantiser (`quant_tensor_f16` writes the Q/DQ value `q · s` rounded to f16), the
///   logits before the exit reformat. A node kept in FP32 (`Graph::fp32_layers`) stays f32;
/// - **weights**: the weight and bias of an FP16 conv (but a depthwise one) or Linear are
///   uploaded as f16 (cuDNN, cuBLASLt, im2col), so they are marked f16; a depthwise conv's (Kiln's
///   depthwise kernel takes f32 weights and bias) and the 8-bit kernels' (codes, f32 scales and
///   bias) stay f32. The wgmma GEMM also takes an f32 bias: where it wins a Linear's timing, its
///   bias is finer than here.
///
/// What is not simulated: the order of f32 sums (the engine's tensor-core and split-K
/// reductions round differently from the CPU's loops, ~1e-7 relative), and any reduced
/// accumulation precision of the FP8 tensor cores.
pub fn simulation(prepared: &Graph, format: QuantFormat, rules: &[LayerPrecision]) -> Result<Graph> {
    use crate::engine::{layer::Elem, BuildConfig, Precision};
    let precision = match format {
        QuantFormat::Int8 => Precision::Int8,
        QuantFormat::Fp8E4m3 => Precision::Fp8,
    };
    let config = BuildConfig::default().precision(precision).layer_precisions(rules.iter().cloned());
    let precisions = crate::engine::resolve::node_precisions(prepared, &config);
    let plan = crate::ops::eight_bit_plan(prepared, &config, &precisions, SIMULATED_SM);
    let readers = prepared.readers();
    let fp16 = |id: NodeId| precisions[id].elem() == Elem::F16;
    let codes = |id: NodeId| plan.stored[id] || plan.requant[id].is_some() || plan.folded[id];
    // A layer that uploads its weight and bias in the engine's type (16-bit library layers).
    let f16_weights = |r: NodeId| {
        fp16(r)
            && !plan.conv[r]
            && match &prepared.nodes[r].op {
                Op::Conv(a) => a.groups == 1 || a.transposed,
                Op::Gemm(Gemm::Linear { .. }) => true,
                _ => false,
            }
    };
    let mut out = prepared.clone();
    out.nodes.clear();
    // Each node's copy, and the value its readers read (an input's entry reformat, if any).
    let (mut own, mut map): (Vec<NodeId>, Vec<NodeId>) = (Vec::new(), Vec::new());
    for (id, node) in prepared.nodes.iter().enumerate() {
        let inputs = node.inputs.iter().map(|&j| map[j]).collect();
        let new = out.push_unchecked(node.op.clone(), inputs, node.shape.clone(), node.path.clone());
        own.push(new);
        out.nodes[new].dtype = match &node.op {
            Op::Input { .. } => node.dtype,
            Op::Weight { .. } if !readers[id].is_empty() && readers[id].iter().all(|&r| f16_weights(r)) => crate::graph::DType::F16,
            Op::Weight { .. } => node.dtype,
            _ if fp16(id) && !codes(id) => crate::graph::DType::F16,
            _ => node.dtype,
        };
        let entry =
            matches!(node.op, Op::Input { .. }) && node.dtype == crate::graph::DType::F32 && fp16(id) && !plan.reads_binding(&readers, id);
        map.push(match entry {
            true => {
                let dims = node.shape[1..].to_vec();
                let r = out.push_unchecked(
                    Op::Shape(crate::graph::ShapeOp::Reshape { dims }),
                    vec![new],
                    node.shape.clone(),
                    format!("{}.f16", node.path),
                );
                out.nodes[r].dtype = crate::graph::DType::F16;
                r
            }
            false => new,
        });
    }
    out.inputs = prepared.inputs.iter().map(|&i| own[i]).collect();
    out.outputs = prepared.outputs.iter().map(|(n, i)| (n.clone(), map[*i])).collect();
    Ok(out)
}

/// What the engine builder lowers for an 8-bit precision: an optimised graph that already has
/// Q/DQ nodes as it is, anything else quantised with the cache (an error without one) but at the
/// layers `rules` covers ([`quantize_graph`]); weight fake-quantisers are then folded into the
/// weights.
pub fn prepare_for_engine(optimized: Graph, format: QuantFormat, cache: Option<&Path>, rules: &[LayerPrecision]) -> Result<Graph> {
    if has_quant_nodes(&optimized) {
        check_rules_on_explicit(&optimized, rules)?;
        return fold_constant_quant(&optimized);
    }
    fold_constant_quant(&quantize_with_cache(&optimized, format, cache, format.name(), rules, true)?)
}

/// What the engine builder lowers for `Best` (TensorRT's `--best`): the optimised graph with INT8
/// activation quantisers from the cache at the 8-bit points (but the layers `rules` covers), and
/// the weights as they are, each carrying its per-channel INT8 grid. The convs that timing puts
/// on INT8 tensor cores (`engine::best`) round their weights onto it and read their inputs'
/// codes; every other quantiser is lowered as an alias of its input, so a layer whose timing a
/// 16-bit candidate wins computes on unquantised values, and an FP8 GEMM candidate takes the
/// quantiser's range as its input scale and quantises its own input and weight. A graph with its
/// own Q/DQ nodes (explicit quantisation) keeps its scales, weights folded, as for the other
/// 8-bit precisions.
pub fn prepare_for_best(optimized: Graph, cache: Option<&Path>, rules: &[LayerPrecision]) -> Result<Graph> {
    if has_quant_nodes(&optimized) {
        check_rules_on_explicit(&optimized, rules)?;
        return fold_constant_quant(&optimized);
    }
    let g = quantize_with_cache(&optimized, QuantFormat::Int8, cache, "best", rules, false)?;
    replace_weight_quantizers(&g, false)
}

/// In a graph with its own Q/DQ nodes the graph decides what is quantised: a per-layer rule may
/// set the precision of its unquantised layers, and a rule covering a layer that reads a
/// quantiser is an error naming the flag, the rule and the layer (it cannot be obeyed).
pub(crate) fn check_rules_on_explicit(graph: &Graph, rules: &[LayerPrecision]) -> Result<()> {
    for node in graph.nodes.iter().filter(|n| quantizable(&n.op)) {
        let quantised = node.inputs.iter().any(|&i| matches!(graph.nodes[i].op, Op::Quant(_)));
        if let Some(rule) = rules.iter().find(|r| quantised && r.matches(&node.path)) {
            return Err(Error::Flag {
                flag: LAYER_PRECISIONS_FLAG.into(),
                reason: format!(
                    "`{}:{}` covers `{}`, which this graph quantises with its own quantize/dequantize nodes: a model quantised in PyTorch keeps its quantised layers 8-bit (remove its quantizers there, or narrow the pattern)",
                    rule.pattern,
                    rule.precision.short_name(),
                    node.path
                ),
            });
        }
    }
    Ok(())
}

/// `optimized` quantised with the cache at `cache` (an error naming the file, or asking for a
/// cache, for a `precision` engine).
fn quantize_with_cache(
    optimized: &Graph,
    format: QuantFormat,
    cache: Option<&Path>,
    precision: &str,
    rules: &[LayerPrecision],
    correct_bias: bool,
) -> Result<Graph> {
    let Some(path) = cache else {
        return Err(Error::Config {
            reason: format!(
                "a {precision} engine needs a calibration cache (BuildConfig::calibration_cache, `kiln calibrate`) or a graph with quantize/dequantize nodes"
            ),
        });
    };
    let cache = CalibrationCache::load(path)?;
    quantize_graph_with(optimized, &cache, format, rules, correct_bias).map_err(|e| match e {
        Error::Calibration { reason, .. } => Error::Calibration { path: path.display().to_string(), reason },
        e => e,
    })
}

/// The precision each engine layer computes in, by module path, for `kiln inspect` and the build
/// summary: `int8`/`fp8` for the quantisers, `int8 (q/dq, fp16 math)` for a layer whose input and
/// weights are on the 8-bit grid but which multiplies in FP16 (no native 8-bit kernel yet), and
/// `elem` (the engine's storage type) for everything else.
pub fn layer_precision(graph: &Graph, path: &str, elem: &str) -> String {
    let Some(node) = graph.nodes.iter().rev().find(|n| n.path == path && !n.op.is_leaf()) else {
        return elem.to_string();
    };
    if let Op::Quant(q) = &node.op {
        return q.params().format.name().to_string();
    }
    let quant_input = |i: usize| match node.inputs.get(i).map(|&j| &graph.nodes[j].op) {
        Some(Op::Quant(q)) => Some(q.params().format),
        _ => None,
    };
    match (quantizable(&node.op), quant_input(0)) {
        (true, Some(f)) => format!("{} (q/dq, {elem} math)", f.name()),
        _ => elem.to_string(),
    }
}

/// One line for a build summary: how many layers of a quantised graph are 8-bit, and how many of
/// those (`native`) the engine runs on 8-bit tensor cores between 8-bit activations.
pub fn quant_summary(graph: &Graph, native: usize) -> Option<String> {
    if !has_quant_nodes(graph) {
        return None;
    }
    let quantisers = graph.nodes.iter().filter(|n| matches!(n.op, Op::Quant(_))).count();
    let layers = quantised_layers(graph);
    Some(format!(
        "quantised: {layers} conv/linear layer(s) read 8-bit inputs and weights ({quantisers} quantisers); {native} run on 8-bit tensor cores with 8-bit activations between them (`conv8`), the others compute in FP16 on the Q/DQ values unless an FP8 GEMM (`cublaslt-gemm-fp8`) won their timing; all other layers FP16"
    ))
}

/// The conv/linear layers whose activation input is a quantiser's output.
pub fn quantised_layers(graph: &Graph) -> usize {
    graph.nodes.iter().filter(|n| quantizable(&n.op) && matches!(n.inputs.first().map(|&j| &graph.nodes[j].op), Some(Op::Quant(_)))).count()
}
