//! Tactics: per-layer algorithm choice by timing candidates on the device, as TensorRT does.
//!
//! A choice is recorded twice: in the engine (keyed by module path and problem, so loading an
//! engine file replays it without timing) and in the timing cache (keyed by device, precision, opt
//! batch and problem, so rebuilding any engine with the same layers times nothing); both live in
//! [`Tactics`](super::choices::Tactics).

use super::config::BuildConfig;
use super::gpu::cuda_err;
use super::layer::{DeviceBuf, Layer, LayerCtx, RunCtx, ValueId};
use crate::LowerKind;
use crate::Result;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;

/// Workspace any layer may have whatever the arena's room at it: small engines (batch 1) would
/// otherwise rule out algorithms over a few MiB that cost nothing in absolute terms.
pub const WORKSPACE_FLOOR: usize = 8 << 20;

impl LayerCtx<'_> {
    /// Picks the fastest of `candidates` (TensorRT's tactics): recorded choices (engine being
    /// loaded, timing cache) are reused, otherwise each candidate is timed on the device at the
    /// opt batch. Candidates that fail to run are skipped; if none runs the error lists why.
    /// `key` names the problem (shapes, attributes), not the node: equal keys share a timing.
    pub fn choose(&mut self, key: &str, candidates: Vec<Box<dyn Layer>>) -> Result<Box<dyn Layer>> {
        let start = std::time::Instant::now();
        let layer = choose(self, key, candidates);
        self.tactics.build_time.choosing += start.elapsed().as_secs_f64();
        let layer = layer?;
        self.tactics.chosen.push((self.path.clone(), layer.kind()));
        Ok(layer)
    }
}

/// The layer for one problem (`key`) of the node being converted, from its candidates: recorded,
/// the only one, followed from a profile's opt shape, cached, or the fastest by timing (in that
/// order). The choice is recorded in the engine, and a timed one in the timing cache.
fn choose(ctx: &mut LayerCtx, key: &str, candidates: Vec<Box<dyn Layer>>) -> Result<Box<dyn Layer>> {
    let key = problem_key(ctx, key);
    let rkey = format!("{}|{key}", ctx.path);
    if candidates.is_empty() {
        return Err(ctx.err(LowerKind::NoAlgorithm, format!("no candidate layer for {key}")));
    }
    let mut candidates = restrict_to_sources(ctx.config, candidates);
    // A recorded choice (a loaded engine, or the same problem already lowered for another shape).
    if let Some(kind) = ctx.tactics.recorded.get(&rkey).cloned() {
        return take(candidates, &kind)
            .ok_or_else(|| ctx.err(LowerKind::NoAlgorithm, format!("recorded tactic `{kind}` is not available on this device")));
    }
    if candidates.len() == 1 {
        return only(ctx, rkey, candidates);
    }
    if let Some(layer) = followed(ctx, &rkey, &mut candidates)? {
        return Ok(layer);
    }
    if ctx.tactics.replay {
        return Err(ctx.err(LowerKind::NoAlgorithm, format!("the engine file records no tactic for {key}")));
    }
    let ckey = format!("{}|{key}", ctx.tactics.cache_prefix);
    if let Some(kind) = ctx.tactics.cache.get(&ckey).cloned() {
        if candidates.iter().any(|c| c.kind() == kind) {
            tracing::debug!(path = %ctx.path, problem = %key, chosen = %kind, "tactic from the timing cache");
            ctx.tactics.cached += 1;
            ctx.tactics.recorded.insert(rkey, kind.clone());
            return Ok(take(candidates, &kind).expect("present"));
        }
    }
    let layer = fastest(ctx, &key, candidates)?;
    ctx.tactics.recorded.insert(rkey, layer.kind());
    // A choice among restricted sources is not the problem's fastest: the timing cache keeps
    // only unrestricted choices, so that a later build without --tactic-sources times afresh.
    if ctx.config.tactic_sources.is_none() {
        ctx.tactics.cache.insert(ckey, layer.kind());
    }
    Ok(layer)
}

/// The problem as the engine and the timing cache know it: a layer in another precision than the
/// engine's (a per-layer rule) is another problem, with its own timings and cache entry.
fn problem_key(ctx: &LayerCtx, key: &str) -> String {
    if ctx.precision() != ctx.config.precision {
        format!("{key} @{}", ctx.precision().short_name())
    } else {
        key.to_string()
    }
}

/// `candidates` of the tactic sources only, where any is of one; a layer with none of their kinds
/// keeps all of its own.
fn restrict_to_sources(config: &BuildConfig, mut candidates: Vec<Box<dyn Layer>>) -> Vec<Box<dyn Layer>> {
    if let Some(sources) = &config.tactic_sources {
        let allowed = |kind: String| sources.iter().any(|p| kind.starts_with(p.as_str()));
        if candidates.iter().any(|c| allowed(c.kind())) {
            candidates.retain(|c| allowed(c.kind()));
        }
    }
    candidates
}

/// The candidate of `kind`, if there is one.
fn take(candidates: Vec<Box<dyn Layer>>, kind: &str) -> Option<Box<dyn Layer>> {
    candidates.into_iter().find(|c| c.kind() == kind)
}

/// The one candidate. One left alone by `tactic_sources` is the user's choice, not the only way
/// to lower the node: it is run once here, so a configuration the device refuses is a build error
/// naming it rather than a failure at the first run.
fn only(ctx: &mut LayerCtx, rkey: String, candidates: Vec<Box<dyn Layer>>) -> Result<Box<dyn Layer>> {
    if ctx.config.tactic_sources.is_some() && !ctx.tactics.replay {
        if let [Err(reason)] = &time_candidates(ctx, &candidates, false)?[..] {
            return Err(
                ctx.err(LowerKind::NoAlgorithm, format!("the forced tactic `{}` does not run here: {reason}", candidates[0].kind()))
            );
        }
    }
    let only = candidates.into_iter().next().expect("one candidate");
    ctx.tactics.recorded.insert(rkey, only.kind());
    Ok(only)
}

/// For another shape of a profile: the kind chosen at its opt shape, else the same algorithm
/// sliced differently (the arena's room differs between shapes), else the first candidate that
/// runs here. Never timed, so a built engine and its reload lower the same shape alike. `None`
/// where the node follows nothing, or no candidate runs.
fn followed(ctx: &mut LayerCtx, rkey: &str, candidates: &mut Vec<Box<dyn Layer>>) -> Result<Option<Box<dyn Layer>>> {
    let Some(kind) = ctx.tactics.follow.get(&ctx.path).cloned() else { return Ok(None) };
    let kinds: Vec<String> = candidates.iter().map(|c| c.kind()).collect();
    let mut order: Vec<usize> = (0..kinds.len()).filter(|&i| kinds[i] == kind).collect();
    order.extend((0..kinds.len()).filter(|&i| kinds[i] != kind && unsliced(&kinds[i]) == unsliced(&kind)));
    order.extend((0..kinds.len()).filter(|&i| unsliced(&kinds[i]) != unsliced(&kind)));
    for i in order {
        if let [Ok(_)] = time_candidates(ctx, &candidates[i..=i], false)?[..] {
            ctx.tactics.recorded.insert(rkey.to_string(), kinds[i].clone());
            return Ok(Some(candidates.remove(i)));
        }
    }
    Ok(None)
}

/// Times every candidate and takes the fastest, or the fastest within the arena's room
/// (`within_room`); logs the times. An error lists why each failed when none ran.
fn fastest(ctx: &mut LayerCtx, key: &str, candidates: Vec<Box<dyn Layer>>) -> Result<Box<dyn Layer>> {
    let times = time_candidates(ctx, &candidates, true)?;
    let mut best: Option<(usize, f32)> = None;
    let mut failures = Vec::new();
    let mut log = Vec::new();
    let mut ran = Vec::new();
    for (i, t) in times.into_iter().enumerate() {
        match t {
            Ok(ms) => {
                log.push((candidates[i].kind(), ms));
                ran.push((i, ms));
                if best.is_none_or(|(_, b)| ms < b) {
                    best = Some((i, ms));
                }
            }
            Err(reason) => failures.push(format!("{}: {reason}", candidates[i].kind())),
        }
    }
    let no_candidate =
        |failures: &[String]| ctx.err(LowerKind::NoAlgorithm, format!("no candidate ran for {key}: {}", failures.join("; ")));
    let Some((mut winner, _)) = best else { return Err(no_candidate(&failures)) };
    if let Some((i, ms, room)) = within_room(ctx, &candidates, &ran, winner) {
        log.push((format!("chosen: {} ({ms:.4} ms), the fastest within the arena's room of {room} bytes", candidates[i].kind()), ms));
        winner = i;
    }
    // Candidates were timed at the opt batch alone: the winner must also run at the range's
    // ends (some cuDNN algorithms take a batch of 8 and refuse a batch of 1), else the next.
    if range(ctx.config) != [ctx.config.opt_batch] {
        while let [Err(reason)] = &time_candidates(ctx, &candidates[winner..=winner], false)?[..] {
            failures.push(format!("{}: {reason}", candidates[winner].kind()));
            ran.retain(|&(i, _)| i != winner);
            let Some(&(next, _)) = ran.iter().min_by(|a, b| a.1.total_cmp(&b.1)) else { return Err(no_candidate(&failures)) };
            winner = next;
        }
    }
    if tracing::enabled!(tracing::Level::DEBUG) {
        let path = &ctx.path;
        for &(i, ms) in &ran {
            let memory = memory_need(ctx, candidates[i].as_ref());
            tracing::trace!(%path, problem = %key, candidate = %candidates[i].kind(), ms, memory, room = ctx.workspace_budget, "timed");
        }
        let ms = ran.iter().find(|&&(i, _)| i == winner).map_or(f32::NAN, |&(_, ms)| ms);
        tracing::debug!(%path, problem = %key, chosen = %candidates[winner].kind(), ms, of = ran.len(), failed = failures.len(), "tactic");
    }
    let layer = candidates.into_iter().nth(winner).expect("winner index");
    ctx.tactics.timed += 1;
    ctx.tactics.log.push((key.to_string(), log));
    Ok(layer)
}

/// Memory beyond the room the arena has at this layer (a workspace, or a candidate's scratch)
/// would grow every context's arena. Where the fastest candidate (`winner`) needs more than the
/// room (at least `WORKSPACE_FLOOR`), the fastest of those that ran (`ran`: index and ms) that
/// fits, and the room; `None` where the winner fits, none does, or `fastest_tactics` is on.
fn within_room(ctx: &LayerCtx, candidates: &[Box<dyn Layer>], ran: &[(usize, f32)], winner: usize) -> Option<(usize, f32, usize)> {
    let room = ctx.workspace_budget.max(WORKSPACE_FLOOR);
    let need = |i: usize| memory_need(ctx, candidates[i].as_ref());
    if need(winner) <= room || ctx.config.fastest_tactics {
        return None;
    }
    ran.iter().filter(|&&(i, _)| need(i) <= room).min_by(|a, b| a.1.total_cmp(&b.1)).map(|&(i, ms)| (i, ms, room))
}

/// The memory a candidate needs beyond the values the node reads and writes, at the max batch: its
/// workspace plus the scratch only it uses (a prologue's copy, a chain's intermediate).
fn memory_need(ctx: &LayerCtx, c: &dyn Layer) -> usize {
    let scratch: usize =
        c.own_scratch().into_iter().filter(|d| ctx.candidate_scratch.contains(d)).map(|d| ctx.value(d).bytes(ctx.config.max_batch)).sum();
    c.workspace_bytes(ctx.config.max_batch) + scratch
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
/// that fails (unsupported algorithm, workspace over the limit) gets its reason instead of a time.
/// With `timed` false, candidates are only run (time 0), at each batch of `range`: whether they
/// work here, at the smallest and largest batch too (some cuDNN algorithms accept a batch of 8
/// and reject a batch of 1).
fn time_candidates(ctx: &LayerCtx, candidates: &[Box<dyn Layer>], timed: bool) -> Result<Vec<std::result::Result<f32, String>>> {
    let batch = ctx.config.opt_batch;
    // Timed, each runs at the opt batch alone, so that the losers' plans for other batches are
    // never built (`fastest` checks the winner over the range); otherwise over the range.
    let batches = if timed { vec![batch] } else { range(ctx.config) };
    let stream = &ctx.gpu.stream;
    // Plans made on several threads first (cuDNN's runtime fusion compiles each); a candidate
    // that cannot be prepared fails again below, with its reason, when it runs.
    if candidates.len() > 1 {
        super::plan::prepare_in_parallel(ctx.gpu, candidates, &batches)?;
    }
    let (ptrs, _values) = value_buffers(ctx)?;
    let limit = ctx.config.workspace_bytes;
    let need = |c: &dyn Layer| batches.iter().map(|&b| c.workspace_bytes(b)).max().unwrap_or(0);
    let ws_bytes = candidates.iter().map(|c| need(c.as_ref())).filter(|&b| b <= limit).max().unwrap_or(0);
    let ws = DeviceBuf::zeros(stream, ws_bytes).map_err(|e| e.out_of_memory_in(for_timing(ctx, "the workspace".into())))?;
    let rt = RunCtx { stream, handles: &ctx.gpu.handles, ptrs: &ptrs, workspace: ws.ptr(), workspace_bytes: ws_bytes };

    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let events = (
        ctx.gpu.ctx.new_event(timing).map_err(cuda_err("creating an event"))?,
        ctx.gpu.ctx.new_event(timing).map_err(cuda_err("creating an event"))?,
    );
    let mut out = Vec::new();
    for c in candidates {
        if need(c.as_ref()) > limit {
            out.push(Err(format!("needs {} bytes of workspace, over the limit of {limit}", need(c.as_ref()))));
            continue;
        }
        out.push(run_candidate(c.as_ref(), &rt, &batches, batch, timed.then_some(&events))?);
    }
    Ok(out)
}

/// The batches every chosen layer must run: the range's ends and the opt batch.
fn range(config: &BuildConfig) -> Vec<usize> {
    let mut batches = vec![config.min_batch, config.opt_batch, config.max_batch];
    batches.dedup();
    batches
}

/// Zeroed device buffers for the values the node being converted touches (its inputs in the
/// layouts its converter asked for, its output, its scratch), and each value's address (0 for
/// the others).
fn value_buffers(ctx: &LayerCtx) -> Result<(Vec<u64>, Vec<DeviceBuf>)> {
    let mut touched: Vec<ValueId> = ctx.reads.iter().flatten().copied().collect();
    touched.extend(ctx.writes);
    touched.extend(ctx.scratch.iter().chain(&ctx.candidate_scratch).copied());
    let mut ptrs = vec![0u64; ctx.values.len()];
    let mut bufs = Vec::new();
    for v in touched {
        let buf = DeviceBuf::zeros(&ctx.gpu.stream, ctx.value(v).bytes(ctx.config.max_batch))
            .map_err(|e| e.out_of_memory_in(for_timing(ctx, format!("value `{}`", ctx.value(v).name))))?;
        ptrs[v.0] = buf.ptr();
        bufs.push(buf);
    }
    Ok((ptrs, bufs))
}

/// What an out-of-memory error names: `what`, of the layer being converted, for tactic timing.
fn for_timing<'a>(ctx: &'a LayerCtx, what: String) -> impl FnOnce() -> String + 'a {
    let c = ctx.config;
    move || {
        format!("{what} of layer `{}` for tactic timing (engine for batch {}..={}, {:?})", ctx.path, c.min_batch, c.max_batch, c.precision)
    }
}

/// Runs `c` once per batch of the range, which catches unsupported configurations and warms
/// caches (its reason where it fails), then, with `events`, times it at `batch`.
fn run_candidate(
    c: &dyn Layer,
    rt: &RunCtx,
    batches: &[usize],
    batch: usize,
    events: Option<&(CudaEvent, CudaEvent)>,
) -> Result<std::result::Result<f32, String>> {
    let stream = rt.stream;
    let warm = batches
        .iter()
        .try_for_each(|&b| c.enqueue(rt, b).and_then(|_| stream.synchronize().map_err(cuda_err("synchronising after a tactic run"))));
    if let Err(e) = warm {
        return Ok(Err(e.to_string()));
    }
    let Some((start, end)) = events else { return Ok(Ok(0.0)) };
    // Timed as engines run: captured once into a CUDA graph and replayed, so a candidate of
    // many small calls (batch slices, im2col chunks) is not charged the host's launch time.
    let graph = capture(stream, || c.enqueue(rt, batch));
    let run = |iters: usize| -> Result<f32> {
        start.record(stream).map_err(cuda_err("recording an event"))?;
        for _ in 0..iters {
            match &graph {
                Some(g) => g.launch().map_err(cuda_err("launching a tactic's CUDA graph"))?,
                None => c.enqueue(rt, batch)?,
            }
        }
        end.record(stream).map_err(cuda_err("recording an event"))?;
        Ok(start.elapsed_ms(end).map_err(cuda_err("timing a tactic"))? / iters as f32)
    };
    // Enough iterations for about 2 ms of work, at most 20, so small layers are not noise.
    let once = run(1)?;
    let iters = ((2.0 / once.max(1e-3)) as usize).clamp(2, 20);
    Ok(Ok(run(iters)?))
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
