//! One activation arena reused by tensor lifetime: values whose lifetimes do not overlap share
//! bytes. Pure planning, tested without a GPU.

/// Offsets are multiples of this, so every value is aligned for vectorised loads, cuDNN and
/// cuBLASLt (which want 16 bytes; 256 matches `cudaMalloc`'s own alignment).
pub const ALIGN: usize = 256;

/// A value to place: `bytes` long, live from step `first` to step `last` inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interval {
    pub bytes: usize,
    pub first: usize,
    pub last: usize,
}

/// Places every interval at an offset such that two intervals that are live at the same step never
/// overlap in memory. Greedy: largest first, each at the lowest offset that fits between the
/// already-placed intervals it meets in time. Returns the offsets and the arena size.
pub fn plan(intervals: &[Interval]) -> (Vec<usize>, usize) {
    let mut order: Vec<usize> = (0..intervals.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(intervals[i].bytes), intervals[i].first, i));
    let mut offsets = vec![0usize; intervals.len()];
    let mut placed: Vec<usize> = Vec::new();
    let mut total = 0;
    for i in order {
        let me = intervals[i];
        let size = me.bytes.div_ceil(ALIGN) * ALIGN;
        // Memory ranges of placed values that are live at the same time as `me`, by offset.
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .filter(|&&j| intervals[j].first <= me.last && me.first <= intervals[j].last)
            .map(|&j| (offsets[j], offsets[j] + intervals[j].bytes.div_ceil(ALIGN) * ALIGN))
            .collect();
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
}
