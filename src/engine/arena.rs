//! One activation arena reused by lifetime: values whose lifetimes do not overlap share bytes, a
//! layer's workspace is a value that lives for that layer alone, and a layer that writes each
//! output element after reading the same element of an input (a GEMM's D over its residual C)
//! writes over that input when nothing reads it later. Pure planning, tested without a GPU.

/// Offsets are multiples of this, so every value is aligned for vectorised loads, cuDNN and
/// cuBLASLt (which want 16 bytes; 256 matches `cudaMalloc`'s own alignment).
pub const ALIGN: usize = 256;

fn aligned(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// A value to place: `bytes` long, live from step `first` to step `last` inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interval {
    pub bytes: usize,
    pub first: usize,
    pub last: usize,
}

impl Interval {
    fn meets(&self, other: &Interval) -> bool {
        self.first <= other.last && other.first <= self.last
    }
}

/// What one step (one engine layer) does with arena memory.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepUse {
    /// The arena values the step reads or writes (storage roots, by index).
    pub values: Vec<usize>,
    /// Scratch bytes the step needs while it runs.
    pub workspace: usize,
    /// `(output, input)`: the step may write `output` over `input`'s bytes. Taken when no later
    /// step touches `input`, the step touches it once, and `output` fits in it.
    pub overwrite: Option<(usize, usize)>,
}

/// Where everything goes in one arena.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ArenaPlan {
    /// The offset of each value (`None` for values no step touches).
    pub offsets: Vec<Option<usize>>,
    /// Each step's workspace: offset and length (length 0: none).
    pub workspace: Vec<(usize, usize)>,
    /// The arena's size.
    pub bytes: usize,
    /// The most bytes live at one step (values and workspace), a lower bound on `bytes`.
    pub peak: usize,
    /// The step where `peak` is reached.
    pub peak_step: usize,
    /// The bytes live at each step (values and workspace).
    pub live: Vec<usize>,
    /// The steps that write their output over an input.
    pub in_place: Vec<usize>,
    /// Each step's idle region: the offset and length of the largest value region that is live
    /// across the step but not touched by it ((0, 0): none). Values fill their regions in
    /// proportion to the batch, so below the planned batch its tail (`idle_tail`) is free while
    /// the step runs.
    pub idle: Vec<(usize, usize)>,
}

/// The free tail of an idle region (`(offset, len)`, planned at `max_batch`) while the engine runs
/// `batch`: its value fills at most `len * batch / max_batch` bytes (rounded up, then aligned).
pub fn idle_tail((offset, len): (usize, usize), batch: usize, max_batch: usize) -> (usize, usize) {
    if max_batch == 0 || batch >= max_batch {
        return (offset, 0);
    }
    let used = ((len as u128 * batch as u128).div_ceil(max_batch as u128)) as usize;
    let start = aligned(used).min(len);
    (offset + start, len - start)
}

/// Plans the arena for `steps` over values of `value_bytes` bytes each.
pub fn plan_steps(value_bytes: &[usize], steps: &[StepUse]) -> ArenaPlan {
    let n = value_bytes.len();
    let mut first = vec![usize::MAX; n];
    let mut last = vec![0usize; n];
    for (s, step) in steps.iter().enumerate() {
        for &v in &step.values {
            first[v] = first[v].min(s);
            last[v] = last[v].max(s);
        }
    }
    // Values that share bytes form groups (union-find, `group[v] == v` for a group's root), each
    // with the lifetime and size of all its members.
    let mut group: Vec<usize> = (0..n).collect();
    let find = |group: &[usize], mut v: usize| {
        while group[v] != v {
            v = group[v];
        }
        v
    };
    let (mut gfirst, mut glast, gbytes) = (first.clone(), last.clone(), value_bytes.to_vec());
    let mut in_place = Vec::new();
    for (s, step) in steps.iter().enumerate() {
        let Some((out, input)) = step.overwrite else { continue };
        let g = find(&group, input);
        let touches_g = step.values.iter().filter(|&&v| find(&group, v) == g).count();
        let fits = value_bytes[out] <= gbytes[g];
        if out != input && find(&group, out) == out && first[out] == s && glast[g] == s && touches_g == 1 && fits {
            group[out] = g;
            gfirst[g] = gfirst[g].min(first[out]);
            glast[g] = glast[g].max(last[out]);
            in_place.push(s);
        }
    }
    // One interval per touched group, then one per workspace.
    let mut intervals = Vec::new();
    let mut interval_of = vec![usize::MAX; n];
    for v in 0..n {
        if group[v] == v && first[v] != usize::MAX {
            interval_of[v] = intervals.len();
            intervals.push(Interval { bytes: gbytes[v], first: gfirst[v], last: glast[v] });
        }
    }
    let mut ws_interval = vec![usize::MAX; steps.len()];
    for (s, step) in steps.iter().enumerate() {
        if step.workspace > 0 {
            ws_interval[s] = intervals.len();
            intervals.push(Interval { bytes: step.workspace, first: s, last: s });
        }
    }
    let (offsets, bytes) = plan(&intervals);
    let live: Vec<usize> =
        (0..steps.len()).map(|s| intervals.iter().filter(|i| i.first <= s && s <= i.last).map(|i| aligned(i.bytes)).sum()).collect();
    let peak = live.iter().enumerate().fold((0, 0), |best, (s, &l)| if l > best.0 { (l, s) } else { best });
    let idle = steps
        .iter()
        .enumerate()
        .map(|(s, step)| {
            let touched: Vec<usize> = step.values.iter().map(|&v| find(&group, v)).collect();
            (0..n)
                .filter(|&g| interval_of[g] != usize::MAX && !touched.contains(&g))
                .map(|g| (intervals[interval_of[g]], offsets[interval_of[g]]))
                .filter(|(i, _)| i.first <= s && s <= i.last)
                .max_by_key(|(i, _)| i.bytes)
                .map_or((0, 0), |(i, offset)| (offset, i.bytes))
        })
        .collect();
    ArenaPlan {
        offsets: (0..n).map(|v| interval_of.get(find(&group, v)).filter(|&&i| i != usize::MAX).map(|&i| offsets[i])).collect(),
        workspace: (0..steps.len())
            .map(|s| if ws_interval[s] == usize::MAX { (0, 0) } else { (offsets[ws_interval[s]], steps[s].workspace) })
            .collect(),
        bytes,
        peak: peak.0,
        peak_step: peak.1,
        live,
        in_place,
        idle,
    }
}

/// Places every interval at an offset such that two intervals that are live at the same step never
/// overlap in memory. Greedy, each interval at the lowest offset that fits between the
/// already-placed intervals it meets in time, in two orders (largest first; longest-lived first),
/// keeping the smaller arena. Returns the offsets and the arena size.
pub fn plan(intervals: &[Interval]) -> (Vec<usize>, usize) {
    let mut by_size: Vec<usize> = (0..intervals.len()).collect();
    by_size.sort_by_key(|&i| (std::cmp::Reverse(intervals[i].bytes), intervals[i].first, i));
    let mut by_life: Vec<usize> = (0..intervals.len()).collect();
    by_life.sort_by_key(|&i| (std::cmp::Reverse(intervals[i].last - intervals[i].first), std::cmp::Reverse(intervals[i].bytes), i));
    let a = place(intervals, &by_size);
    let b = place(intervals, &by_life);
    if b.1 < a.1 {
        b
    } else {
        a
    }
}

fn place(intervals: &[Interval], order: &[usize]) -> (Vec<usize>, usize) {
    let mut offsets = vec![0usize; intervals.len()];
    let mut placed: Vec<usize> = Vec::new();
    let mut total = 0;
    for &i in order {
        let me = intervals[i];
        let size = aligned(me.bytes);
        // Memory ranges of placed values that are live at the same time as `me`, by offset.
        let mut busy: Vec<(usize, usize)> =
            placed.iter().filter(|&&j| intervals[j].meets(&me)).map(|&j| (offsets[j], offsets[j] + aligned(intervals[j].bytes))).collect();
        busy.sort_unstable();
        let mut offset = 0;
        for (lo, hi) in busy {
            if offset + size <= lo {
                break;
            }
            offset = offset.max(hi);
        }
        offsets[i] = offset;
        total = total.max(offset + size);
        placed.push(i);
    }
    (offsets, total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_disjoint(iv: &[Interval], off: &[usize]) {
        for a in 0..iv.len() {
            for b in a + 1..iv.len() {
                let live_together = iv[a].first <= iv[b].last && iv[b].first <= iv[a].last;
                let mem_overlap = off[a] < off[b] + iv[b].bytes && off[b] < off[a] + iv[a].bytes;
                assert!(!(live_together && mem_overlap), "values {a} and {b} overlap: {iv:?} at {off:?}");
            }
        }
    }

    #[test]
    fn a_chain_reuses_memory() {
        // x0 -> x1 -> x2 -> x3: each value dies when the next-but-one is made.
        let iv: Vec<Interval> = (0..4).map(|i| Interval { bytes: 1000, first: i, last: i + 1 }).collect();
        let (off, total) = plan(&iv);
        check_disjoint(&iv, &off);
        assert_eq!(total, 2 * 1024, "a chain needs two buffers, got offsets {off:?}");
        assert_eq!(off.iter().filter(|&&o| o % ALIGN != 0).count(), 0);
    }

    #[test]
    fn a_long_lived_value_keeps_its_bytes() {
        // A residual: value 0 lives across values 1..3.
        let iv = vec![
            Interval { bytes: 4096, first: 0, last: 3 },
            Interval { bytes: 512, first: 1, last: 2 },
            Interval { bytes: 512, first: 2, last: 3 },
            Interval { bytes: 8192, first: 4, last: 5 },
        ];
        let (off, total) = plan(&iv);
        check_disjoint(&iv, &off);
        assert_eq!(total, 8192, "the last value can reuse everything: {off:?}");
    }

    #[test]
    fn random_plans_are_valid() {
        let mut s = 12345u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for _ in 0..50 {
            let iv: Vec<Interval> = (0..40)
                .map(|_| {
                    let first = (next() % 30) as usize;
                    Interval { bytes: 1 + (next() % 5000) as usize, first, last: first + (next() % 6) as usize }
                })
                .collect();
            let (off, total) = plan(&iv);
            check_disjoint(&iv, &off);
            let sum: usize = iv.iter().map(|i| i.bytes.div_ceil(ALIGN) * ALIGN).sum();
            assert!(total <= sum);
        }
    }

    fn step(values: &[usize], workspace: usize, overwrite: Option<(usize, usize)>) -> StepUse {
        StepUse { values: values.to_vec(), workspace, overwrite }
    }

    /// Every pair of values (or workspaces) live at one step is disjoint in memory, unless one was
    /// written over the other by a step the plan lists as in place.
    fn check_plan(bytes: &[usize], steps: &[StepUse], p: &ArenaPlan) {
        let merged: Vec<(usize, usize)> = p.in_place.iter().filter_map(|&s| steps[s].overwrite).collect();
        let mut items = Vec::new(); // (offset, bytes, first, last, value)
        for (v, &len) in bytes.iter().enumerate() {
            let touched: Vec<usize> = steps.iter().enumerate().filter(|(_, s)| s.values.contains(&v)).map(|(i, _)| i).collect();
            match (touched.first(), touched.last(), p.offsets[v]) {
                (Some(&f), Some(&l), Some(off)) => items.push((off, len, f, l, Some(v))),
                (None, _, off) => assert_eq!(off, None, "an untouched value has no place"),
                _ => panic!("value {v} is touched but has no offset: {p:?}"),
            }
        }
        for (s, &(off, len)) in p.workspace.iter().enumerate() {
            if len > 0 {
                items.push((off, len, s, s, None));
            }
        }
        for a in 0..items.len() {
            for b in a + 1..items.len() {
                let (x, y) = (items[a], items[b]);
                let pair = x.4.zip(y.4).is_some_and(|(u, v)| merged.contains(&(u, v)) || merged.contains(&(v, u)));
                let live = x.2 <= y.3 && y.2 <= x.3;
                let overlap = x.0 < y.0 + y.1 && y.0 < x.0 + x.1;
                assert!(pair || !(live && overlap), "{x:?} and {y:?} overlap in {p:?}");
                assert!(x.0 + x.1 <= p.bytes && y.0 + y.1 <= p.bytes);
            }
        }
    }

    #[test]
    fn a_residual_is_overwritten_by_the_layer_that_reads_it_last() {
        // 0 = block input x (big), 1 = conv1(x), 2 = conv2(1), 3 = conv3(2) + x, written over x.
        let bytes = [4096, 1024, 1024, 4096];
        let steps = vec![step(&[0], 0, None), step(&[0, 1], 0, None), step(&[1, 2], 0, None), step(&[2, 0, 3], 0, Some((3, 0)))];
        let p = plan_steps(&bytes, &steps);
        check_plan(&bytes, &steps, &p);
        assert_eq!(p.in_place, vec![3]);
        assert_eq!(p.offsets[3], p.offsets[0], "the output takes the residual's bytes");
        assert_eq!(p.bytes, 4096 + 2048, "x and two small values: {p:?}");
        assert_eq!(p.peak, p.bytes);
    }

    #[test]
    fn an_input_read_later_or_twice_is_not_overwritten() {
        let bytes = [4096, 4096, 4096];
        // x is read again by step 2: the output must not take its bytes.
        let later = vec![step(&[0, 1], 0, Some((1, 0))), step(&[1, 2], 0, None), step(&[0, 2], 0, None)];
        let p = plan_steps(&bytes, &later);
        check_plan(&bytes, &later, &p);
        assert!(p.in_place.is_empty());
        assert_ne!(p.offsets[0], p.offsets[1]);
        // A step that also reads its residual as its main input (conv(x) + x) cannot write over it.
        let twice = vec![step(&[0, 0, 1], 0, Some((1, 0)))];
        let p = plan_steps(&bytes, &twice);
        assert!(p.in_place.is_empty(), "{p:?}");
        // An output bigger than the input does not fit.
        let p = plan_steps(&[1024, 4096], &[step(&[0, 1], 0, Some((1, 0)))]);
        assert!(p.in_place.is_empty());
    }

    #[test]
    fn workspaces_live_for_their_step_alone() {
        // A chain with a big workspace at step 1: it may reuse bytes dead by then, never live ones.
        let bytes = [1000, 1000, 1000];
        let steps = vec![step(&[0], 0, None), step(&[0, 1], 3000, None), step(&[1, 2], 0, None)];
        let p = plan_steps(&bytes, &steps);
        check_plan(&bytes, &steps, &p);
        assert_eq!(p.workspace[1].1, 3000);
        assert_eq!(p.workspace[0], (0, 0));
        assert_eq!(p.peak_step, 1);
        assert_eq!(p.peak, 1024 + 1024 + 3072);
    }

    #[test]
    fn random_step_plans_are_valid() {
        let mut s = 99u64;
        let mut next = move |m: u64| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s % m
        };
        for _ in 0..200 {
            let n = 1 + next(20) as usize;
            let bytes: Vec<usize> = (0..n).map(|_| 1 + next(5000) as usize).collect();
            let steps: Vec<StepUse> = (0..1 + next(15))
                .map(|_| {
                    let values: Vec<usize> = (0..1 + next(4)).map(|_| next(n as u64) as usize).collect();
                    let overwrite = (values.len() >= 2 && next(2) == 0).then(|| (values[0], values[1]));
                    StepUse { values, workspace: if next(3) == 0 { next(3000) as usize } else { 0 }, overwrite }
                })
                .collect();
            let p = plan_steps(&bytes, &steps);
            check_plan(&bytes, &steps, &p);
            assert!(p.peak <= p.bytes, "the peak is a lower bound: {p:?}");
            check_idle(&bytes, &steps, &p);
        }
    }

    /// A step's idle region overlaps neither the values it touches nor its own workspace, and
    /// belongs to a value live across the step.
    fn check_idle(bytes: &[usize], steps: &[StepUse], p: &ArenaPlan) {
        let overlaps = |a: (usize, usize), b: (usize, usize)| a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1;
        for (s, step) in steps.iter().enumerate() {
            let idle = p.idle[s];
            if idle.1 == 0 {
                continue;
            }
            assert!(!overlaps(idle, p.workspace[s]), "step {s}: idle {idle:?} meets its workspace {:?}", p.workspace[s]);
            for &v in &step.values {
                let region = (p.offsets[v].expect("a touched value has an offset"), bytes[v]);
                assert!(!overlaps(idle, region), "step {s}: idle {idle:?} meets touched value {v} at {region:?}");
            }
            // The region's value (or in-place group) is touched before and after the step.
            let here: Vec<usize> = (0..bytes.len()).filter(|&v| p.offsets[v] == Some(idle.0) && bytes[v] <= idle.1).collect();
            let touched_at =
                |v: usize, keep: &dyn Fn(usize) -> bool| steps.iter().enumerate().any(|(t, u)| keep(t) && u.values.contains(&v));
            let live_across = here.iter().any(|&v| touched_at(v, &|t| t < s)) && here.iter().any(|&v| touched_at(v, &|t| t > s));
            assert!(live_across, "step {s}: idle {idle:?} is no value live across the step");
        }
    }

    /// ResNet's downsample shape: the block input `x` waits while conv1 and conv2 run, so their
    /// steps may borrow its tail below the planned batch.
    #[test]
    fn a_waiting_residual_is_the_idle_region_of_the_steps_between() {
        let bytes = [64_000, 32_000, 8_000, 16_000];
        // x=0 read by step 0 (conv1 -> 1), step 1 (conv2: 1 -> 2), step 2 (downsample + add: 0, 2 -> 3).
        let steps = vec![step(&[0, 1], 0, None), step(&[1, 2], 5000, None), step(&[0, 2, 3], 0, None)];
        let p = plan_steps(&bytes, &steps);
        check_plan(&bytes, &steps, &p);
        check_idle(&bytes, &steps, &p);
        assert_eq!(p.idle[1], (p.offsets[0].unwrap(), 64_000), "x is idle during conv2");
        assert_eq!(p.idle[0].1, 0, "nothing waits during conv1: it reads x");
        // At batch 16 of 64 x fills its first quarter; the rest is free.
        let (at, len) = idle_tail(p.idle[1], 16, 64);
        assert_eq!(at, p.offsets[0].unwrap() + 16_128, "a quarter of x, aligned up");
        assert_eq!(len, 64_000 - 16_128);
        assert_eq!(idle_tail(p.idle[1], 64, 64).1, 0, "nothing is free at the planned batch");
        assert_eq!(idle_tail((0, 0), 1, 64), (0, 0));
    }
}
