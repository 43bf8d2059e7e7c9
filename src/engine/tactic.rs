//! Tactics: per-layer algorithm choice by timing candidates on the device, as TensorRT does.
//!
//! A choice is recorded twice: in the engine (keyed by module path and problem, so loading an
//! engine file replays it without timing) and in the timing cache (keyed by device, precision, opt
//! batch and problem, so rebuilding any engine with the same layers times nothing).

use super::gpu::cuda_err;
use super::layer::{BuildCtx, DeviceBuf, Layer, RunCtx, ValueId};
use crate::{Error, Result};
use cudarc::driver::sys::CUevent_flags;
use std::collections::BTreeMap;
use std::path::Path;

/// Called as each graph node is about to be lowered (its tactics timed) with (nodes done, nodes in
/// all, its module path): what the CLI's progress bar shows during a build.
pub type Progress = std::sync::Arc<dyn Fn(usize, usize, &str) + Send + Sync>;

#[derive(Default)]
pub struct Tactics {
    /// Choices of this engine: `"{path}|{key}"` → winning layer kind.
    pub recorded: BTreeMap<String, String>,
    /// Loading an engine: every choice must come from `recorded`; nothing is timed.
    pub replay: bool,
    /// Lowering a plan for another input shape of a profile: module path → the kind chosen at the
    /// profile's opt shape. Nothing is timed (TensorRT's rule: tactics are timed at opt): that kind
    /// if it runs at this shape, else the same algorithm in another batch slicing, else the first
    /// candidate that runs.
    pub follow: BTreeMap<String, String>,
    /// Timing cache entries: `"{device}|{precision}|b{opt}|{key}"` → kind.
    pub cache: BTreeMap<String, String>,
    pub cache_prefix: String,
    /// How many choices were timed, and how many came from the cache.
    pub timed: usize,
    pub cached: usize,
    /// Per timed choice: key and (kind, ms) of each candidate that ran, for the build log.
    pub log: Vec<(String, Vec<(String, f32)>)>,
    /// Every choice made, in order: (module path, kind), whether timed, cached, recorded or
    /// followed (the builder takes a profile's opt choices from it).
    pub chosen: Vec<(String, String)>,
    /// Build progress callback (see [`Progress`]).
    pub progress: Option<Progress>,
}

impl Tactics {
    /// Reads a timing cache file; a missing file is an empty cache, a malformed one an error.
    pub fn load_cache(&mut self, path: &Path) -> Result<()> {
        let not_a_file = |reason| Error::EngineFile { path: path.display().to_string(), reason };
        match crate::host::read_regular(path, "the path of a JSON timing cache", not_a_file) {
            Ok(bytes) => {
                self.cache = serde_json::from_slice(&bytes).map_err(|e| Error::EngineFile {
                    path: path.display().to_string(),
                    reason: format!("timing cache is not valid JSON: {e}"),
                })?;
                Ok(())
            }
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub fn save_cache(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_vec_pretty(&self.cache)
            .map_err(|e| Error::Serialize { what: "the timing cache".into(), reason: e.to_string() })?;
        std::fs::write(path, json).map_err(Error::io(path))
    }
}

/// Workspace any layer may have whatever the arena's room at it: small engines (batch 1) would
/// otherwise rule out algorithms over a few MiB that cost nothing in absolute terms.
pub const WORKSPACE_FLOOR: usize = 8 << 20;

pub(crate) fn choose(ctx: &mut BuildCtx, key: &str, candidates: Vec<Box<dyn Layer>>) -> Result<Box<dyn Layer>> {
    let node = ctx.current;
    // A layer in another precision than the engine's (a per-layer rule) is another problem: its
    // timings and its cache entry are its own.
    let tagged;
    let key = if ctx.precision() != ctx.config.precision {
        tagged = format!("{key} @{}", ctx.precision().short_name());
        tagged.as_str()
    } else {
        key
    };
    let rkey = format!("{}|{key}", ctx.node(node).path);
    if candidates.is_empty() {
        return Err(ctx.err(node, format!("no candidate layer for {key}")));
    }
    let mut candidates = candidates;
    if let Some(sources) = &ctx.config.tactic_sources {
        let allowed = |kind: String| sources.iter().any(|p| kind.starts_with(p.as_str()));
        if candidates.iter().any(|c| allowed(c.kind())) {
            candidates.retain(|c| allowed(c.kind()));
        }
    }
    let pick = |candidates: Vec<Box<dyn Layer>>, kind: &str| candidates.into_iter().find(|c| c.kind() == kind);

    // A recorded choice (a loaded engine, or the same problem already lowered for another shape).
    if let Some(kind) = ctx.tactics.recorded.get(&rkey).cloned() {
        return pick(candidates, &kind).ok_or_else(|| ctx.err(node, format!("recorded tactic `{kind}` is not available on this device")));
    }
    if candidates.len() == 1 {
        // A candidate left alone by `tactic_sources` is the user's choice, not the only way to
        // lower the node: it is run once here, so a configuration the device refuses is a build
        // error naming it rather than a failure at the first run.
        if ctx.config.tactic_sources.is_some() && !ctx.tactics.replay {
            if let [Err(reason)] = &time_candidates(ctx, &candidates, false)?[..] {
                return Err(ctx.err(node, format!("the forced tactic `{}` does not run here: {reason}", candidates[0].kind())));
            }
        }
        let only = candidates.into_iter().next().expect("one candidate");
        ctx.tactics.recorded.insert(rkey, only.kind());
        return Ok(only);
    }
    let path = &ctx.node(node).path;
    if let Some(kind) = ctx.tactics.follow.get(path).cloned() {
        // Never timed, so a built engine and its reload lower the same shape alike: opt's kind,
        // else the same algorithm sliced differently (the arena's room differs between shapes),
        // else the first candidate that runs here.
        let kinds: Vec<String> = candidates.iter().map(|c| c.kind()).collect();
        let mut order: Vec<usize> = (0..kinds.len()).filter(|&i| kinds[i] == kind).collect();
        order.extend((0..kinds.len()).filter(|&i| kinds[i] != kind && unsliced(&kinds[i]) == unsliced(&kind)));
        order.extend((0..kinds.len()).filter(|&i| unsliced(&kinds[i]) != unsliced(&kind)));
        for i in order {
            if let [Ok(_)] = time_candidates(ctx, &candidates[i..=i], false)?[..] {
                ctx.tactics.recorded.insert(rkey, kinds[i].clone());
                return Ok(candidates.into_iter().nth(i).expect("index"));
            }
        }
    }
    if ctx.tactics.replay {
        return Err(ctx.err(node, format!("the engine file records no tactic for {key}")));
    }
    let ckey = format!("{}|{key}", ctx.tactics.cache_prefix);
    if let Some(kind) = ctx.tactics.cache.get(&ckey).cloned() {
        if candidates.iter().any(|c| c.kind() == kind) {
            ctx.tactics.cached += 1;
            ctx.tactics.recorded.insert(rkey, kind.clone());
            return Ok(pick(candidates, &kind).expect("present"));
        }
    }

    let times = time_candidates(ctx, &candidates, true)?;
    let mut best: Option<(usize, f32)> = None;
    let mut failures = Vec::new();
    let mut log = Vec::new();
    let mut log_times = Vec::new();
    for (i, t) in times.into_iter().enumerate() {
        match t {
            Ok(ms) => {
                log.push((candidates[i].kind(), ms));
                log_times.push((i, ms));
                if best.is_none_or(|(_, b)| ms < b) {
                    best = Some((i, ms));
                }
            }
            Err(reason) => failures.push(format!("{}: {reason}", candidates[i].kind())),
        }
    }
    let Some((mut winner, _)) = best else {
        return Err(ctx.err(node, format!("no candidate ran for {key}: {}", failures.join("; "))));
    };
    // Memory beyond the room the arena has at this layer (a workspace, or a candidate's scratch)
    // would grow every context's arena: the fastest candidate that fits the room (at least
    // `WORKSPACE_FLOOR`) is taken; the fastest overall only if none fits.
    let room = ctx.workspace_budget.max(WORKSPACE_FLOOR);
    let need = |i: usize| {
        let c = &candidates[i];
        let scratch: usize = c
            .own_scratch()
            .into_iter()
            .filter(|d| ctx.candidate_scratch.contains(d))
            .map(|d| ctx.value(d).bytes(ctx.config.max_batch))
            .sum();
        c.workspace_bytes(ctx.config.max_batch) + scratch
    };
    if need(winner) > room && !ctx.config.fastest_tactics {
        let fits = log_times.iter().filter(|&&(i, _)| need(i) <= room).min_by(|a, b| a.1.total_cmp(&b.1));
        if let Some(&(i, ms)) = fits {
            log.push((format!("chosen: {} ({ms:.4} ms), the fastest within the arena's room of {room} bytes", candidates[i].kind()), ms));
            winner = i;
        }
    }
    let layer = candidates.into_iter().nth(winner).expect("winner index");
    ctx.tactics.timed += 1;
    ctx.tactics.log.push((key.to_string(), log));
    ctx.tactics.recorded.insert(rkey, layer.kind());
    ctx.tactics.cache.insert(ckey, layer.kind());
    Ok(layer)
}

/// A layer kind without its batch slicing (`:by8`): the algorithm it runs.
fn unsliced(kind: &str) -> String {
    let mut out = String::with_capacity(kind.len());
    let mut rest = kind;
    while let Some(at) = rest.find(":by") {
        let digits = rest[at + 3..].bytes().take_while(u8::is_ascii_digit).count();
        let keep = if digits > 0 { at } else { at + 3 };
        out.push_str(&rest[..keep]);
        rest = &rest[at + 3 + digits..];
    }
    out.push_str(rest);
    out
}

/// Times each candidate at the opt batch on scratch buffers for the node's values. A candidate
/// that fails (unsupported algorithm, workspace over the limit) gets its reason instead of a time;
/// so does one that fails at the smallest or largest batch of the range (some cuDNN algorithms
/// accept a batch of 8 and reject a batch of 1). With `timed` false, candidates are only run
/// (time 0): whether they work here.
fn time_candidates(ctx: &BuildCtx, candidates: &[Box<dyn Layer>], timed: bool) -> Result<Vec<std::result::Result<f32, String>>> {
    let batch = ctx.config.opt_batch;
    let mut batches = vec![ctx.config.min_batch, batch, ctx.config.max_batch];
    batches.dedup();
    let stream = &ctx.gpu.stream;
    // The inputs in the layouts the converter asked for (reformatted copies where they differ).
    let mut touched: Vec<ValueId> = ctx.current_inputs.iter().flatten().copied().collect();
    touched.extend(ctx.node_values[ctx.current]);
    touched.extend(ctx.scratch.iter().chain(&ctx.candidate_scratch).copied());

    let mut ptrs = vec![0u64; ctx.values.len()];
    let mut bufs = Vec::new();
    let engine = |what: String| {
        let c = ctx.config;
        move || {
            format!(
                "{what} of layer `{}` for tactic timing (engine for batch {}..={}, {:?})",
                ctx.node(ctx.current).path,
                c.min_batch,
                c.max_batch,
                c.precision
            )
        }
    };
    for v in touched {
        let buf = DeviceBuf::zeros(stream, ctx.value(v).bytes(ctx.config.max_batch))
            .map_err(|e| e.out_of_memory_in(engine(format!("value `{}`", ctx.value(v).name))))?;
        ptrs[v.0] = buf.ptr();
        bufs.push(buf);
    }
    let limit = ctx.config.workspace_bytes;
    let need = |c: &dyn Layer| batches.iter().map(|&b| c.workspace_bytes(b)).max().unwrap_or(0);
    let ws_bytes = candidates.iter().map(|c| need(c.as_ref())).filter(|&b| b <= limit).max().unwrap_or(0);
    let ws = DeviceBuf::zeros(stream, ws_bytes).map_err(|e| e.out_of_memory_in(engine("the workspace".into())))?;
    let rt = RunCtx { stream, handles: &ctx.gpu.handles, ptrs: &ptrs, workspace: ws.ptr(), workspace_bytes: ws_bytes };

    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let (start, end) = (
        ctx.gpu.ctx.new_event(timing).map_err(cuda_err("creating an event"))?,
        ctx.gpu.ctx.new_event(timing).map_err(cuda_err("creating an event"))?,
    );
    let mut out = Vec::new();
    for c in candidates {
        if need(c.as_ref()) > limit {
            out.push(Err(format!("needs {} bytes of workspace, over the limit of {limit}", need(c.as_ref()))));
            continue;
        }
        // One untimed run per batch of the range catches unsupported configurations and warms caches.
        let warm = batches
            .iter()
            .try_for_each(|&b| c.enqueue(&rt, b).and_then(|_| stream.synchronize().map_err(cuda_err("synchronising after a tactic run"))));
        if let Err(e) = warm {
            out.push(Err(e.to_string()));
            continue;
        }
        if !timed {
            out.push(Ok(0.0));
            continue;
        }
        // Timed as engines run: captured once into a CUDA graph and replayed, so a candidate of
        // many small calls (batch slices, im2col chunks) is not charged the host's launch time.
        let graph = capture(stream, || c.enqueue(&rt, batch));
        let run = |iters: usize| -> Result<f32> {
            start.record(stream).map_err(cuda_err("recording an event"))?;
            for _ in 0..iters {
                match &graph {
                    Some(g) => g.launch().map_err(cuda_err("launching a tactic's CUDA graph"))?,
                    None => c.enqueue(&rt, batch)?,
                }
            }
            end.record(stream).map_err(cuda_err("recording an event"))?;
            Ok(start.elapsed_ms(&end).map_err(cuda_err("timing a tactic"))? / iters as f32)
        };
        // Enough iterations for about 2 ms of work, at most 20, so small layers are not noise.
        let once = run(1)?;
        let iters = ((2.0 / once.max(1e-3)) as usize).clamp(2, 20);
        out.push(Ok(run(iters)?));
    }
    Ok(out)
}

/// `enqueue`'s work as an instantiated CUDA graph, or `None` where it cannot be captured (then the
/// candidate is timed by direct launches).
fn capture(stream: &std::sync::Arc<cudarc::driver::CudaStream>, enqueue: impl FnOnce() -> Result<()>) -> Option<cudarc::driver::CudaGraph> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let _gate = super::gpu::capturing();
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).ok()?;
    let enqueued = enqueue();
    let captured = stream.end_capture(CUgraphInstantiate_flags(0));
    enqueued.ok()?;
    captured.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::unsliced;

    #[test]
    fn unsliced_kinds_drop_only_the_batch_slicing() {
        assert_eq!(unsliced("cudnn-fused:IMPLICIT_PRECOMP_GEMM:by8"), "cudnn-fused:IMPLICIT_PRECOMP_GEMM");
        assert_eq!(unsliced("subpixel:by16+cudnn-fused:IMPLICIT_GEMM"), "subpixel+cudnn-fused:IMPLICIT_GEMM");
        assert_eq!(unsliced("cublaslt-gemm"), "cublaslt-gemm");
        assert_eq!(unsliced("kernel:bypass:by2"), "kernel:bypass");
    }
}
