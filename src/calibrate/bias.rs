//! Bias correction: an 8-bit layer's rounded weight `Wq = W + ΔW` shifts its output by
//! `ΔW · x`, whose mean over the data, `ΔW · E[x]`, is the same at every pixel of an output
//! channel. Calibration records `E[x]` for each input channel and filter tap (the mean of the
//! input pixel each tap reads, over every output pixel, zero where the tap reads padding), and
//! the quantised graph subtracts `Σ ΔW[k] · E[x]` from the layer's bias, channel by channel
//! (Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias Correction", 2019,
//! in its empirical form). What is left of the weight's rounding error is its part that varies
//! with the input. After a ReLU the inputs' means are large beside their spread, so this part is
//! most of FP8's weight error: e4m3's 3-bit mantissa rounds each weight by up to 1/16 of itself,
//! where INT8's per-channel grid rounds it by under 1/254 of its channel's largest.

use crate::graph::{ConvAttrs, Gemm, Graph, HostTensor, NodeId, Op};

/// The input means of one 8-bit layer: per input channel and filter tap `[C][R][S]` for a conv,
/// per input feature for a Linear, summed over the data until [`InputSums::means`].
#[derive(Clone, Debug, Default)]
pub(super) struct InputSums {
    sums: Vec<f64>,
    /// Output pixels (conv) or rows (Linear) summed over.
    count: u64,
}

impl InputSums {
    /// Adds one batch `x` (the layer's activation input) of layer `node` in `graph`. Returns
    /// false where the layer is not a conv or Linear this knows (nothing is recorded).
    pub(super) fn add(&mut self, graph: &Graph, node: NodeId, x: &HostTensor) -> bool {
        match &graph.nodes[node].op {
            Op::Conv(a) if !a.transposed && a.groups == 1 => {
                let Some(&w) = graph.nodes[node].inputs.get(1) else { return false };
                let [_, _, r, s] = graph.nodes[w].shape[..] else { return false };
                self.add_conv(a, [r, s], x)
            }
            Op::Gemm(Gemm::Linear { .. }) => self.add_linear(x),
            _ => false,
        }
    }

    fn add_conv(&mut self, a: &ConvAttrs, [r, s]: [usize; 2], x: &HostTensor) -> bool {
        let [n, c, h, w] = x.shape[..] else { return false };
        let [dh, dw] = a.dilation;
        // The conv's own output size (a fused max-pool's output is the node's shape).
        let out =
            |size: usize, k: usize, axis: usize| crate::ops::conv::out_extent(size, k, a.stride[axis], a.padding[axis], a.dilation[axis]);
        let (Some(p), Some(q)) = (out(h, r, 0), out(w, s, 1)) else { return false };
        if self.sums.is_empty() {
            self.sums = vec![0.0; c * r * s];
        }
        if self.sums.len() != c * r * s {
            return false;
        }
        let plane = h * w;
        for img in 0..n {
            for ch in 0..c {
                let xp = &x.data[(img * c + ch) * plane..(img * c + ch + 1) * plane];
                for fr in 0..r {
                    for fs in 0..s {
                        let mut sum = 0f64;
                        for op in 0..p {
                            let Some(ih) = (op * a.stride[0] + fr * dh).checked_sub(a.padding[0]).filter(|&i| i < h) else { continue };
                            let row = &xp[ih * w..(ih + 1) * w];
                            for oq in 0..q {
                                if let Some(iw) = (oq * a.stride[1] + fs * dw).checked_sub(a.padding[1]).filter(|&i| i < w) {
                                    sum += row[iw] as f64;
                                }
                            }
                        }
                        self.sums[(ch * r + fr) * s + fs] += sum;
                    }
                }
            }
        }
        self.count += (n * p * q) as u64;
        true
    }

    fn add_linear(&mut self, x: &HostTensor) -> bool {
        let Some(&c) = x.shape.last() else { return false };
        if c == 0 {
            return false;
        }
        if self.sums.is_empty() {
            self.sums = vec![0.0; c];
        }
        if self.sums.len() != c {
            return false;
        }
        for row in x.data.chunks_exact(c) {
            for (s, &v) in self.sums.iter_mut().zip(row) {
                *s += v as f64;
            }
        }
        self.count += (x.data.len() / c) as u64;
        true
    }

    /// The means, or None before any data.
    pub(super) fn means(&self) -> Option<Vec<f32>> {
        (self.count > 0).then(|| self.sums.iter().map(|&s| (s / self.count as f64) as f32).collect())
    }
}

/// The bias that cancels the mean output shift of rounding `w` to `wq` (both `[K, ...]`, the
/// layer's weight before and after its quantiser) on inputs of means `means` (one per weight
/// element of an output channel): `bias[k] − Σ (wq − w)[k] · means`. `bias` is the layer's own,
/// None for a layer without one (zeros). None where the sizes disagree.
pub(super) fn corrected_bias(w: &HostTensor, wq: &HostTensor, means: &[f32], bias: Option<&[f32]>) -> Option<Vec<f32>> {
    let k = *w.shape.first()?;
    let per = means.len();
    if per == 0 || w.data.len() != k.checked_mul(per)? || wq.data.len() != w.data.len() || bias.is_some_and(|b| b.len() != k) {
        return None;
    }
    Some(
        (0..k)
            .map(|ch| {
                let range = ch * per..(ch + 1) * per;
                let shift: f64 = w.data[range.clone()]
                    .iter()
                    .zip(&wq.data[range])
                    .zip(means)
                    .map(|((&a, &b), &m)| (b as f64 - a as f64) * m as f64)
                    .sum();
                (bias.map_or(0.0, |b| b[ch] as f64) - shift) as f32
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::QuantParams;

    /// The corrected bias makes the quantised layer's mean output over the data equal the exact
    /// layer's, channel by channel, on a 3×3 conv with padding and stride 2 (where border taps
    /// read zeros): measured by running both convs on the CPU.
    #[test]
    fn the_corrected_bias_cancels_the_mean_shift_of_the_rounded_weight() {
        let (c, k) = (5, 4);
        let attrs = ConvAttrs { stride: [2, 2], padding: [1, 1], bias: true, ..Default::default() };
        let uniform = |shape: &[usize], seed: u64| crate::dev::uniform_tensor(shape, seed);
        // Post-ReLU-like inputs: positive, with a large mean.
        let mut x = uniform(&[3, c, 9, 7], 1);
        x.data.iter_mut().for_each(|v| *v = v.abs() * 2.0 + 0.5);
        let w = uniform(&[k, c, 3, 3], 2);
        let b = uniform(&[k], 3);
        let mut wq = w.clone();
        QuantParams::fp8(crate::number_format::symmetric_scale(1.0, crate::graph::QuantFormat::Fp8E4m3)).fake_quantize(&mut wq);

        let tracer = crate::Tracer::new();
        let xi = tracer.input("x", &x.shape);
        let param = |name: &str, v: &HostTensor| crate::tensor::Param { name: name.into(), value: std::sync::Arc::new(v.clone()) };
        crate::tensor::Tensor::record("conv", Op::Conv(attrs), &[&xi], &[&param("conv.weight", &w), &param("conv.bias", &b)])
            .unwrap()
            .mark_output("y");
        let g = tracer.graph();
        let conv = g.nodes.iter().position(|n| matches!(n.op, Op::Conv(_))).unwrap();
        let mut sums = InputSums::default();
        assert!(sums.add(&g, conv, &x));
        let means = sums.means().unwrap();
        assert_eq!(means.len(), c * 9);
        let fixed = corrected_bias(&w, &wq, &means, Some(&b.data)).unwrap();

        let run = |w: &HostTensor, b: &[f32]| -> Vec<f64> {
            let mut g = g.clone();
            g.weights.insert("conv.weight".into(), std::sync::Arc::new(w.clone()));
            g.weights.insert("conv.bias".into(), std::sync::Arc::new(HostTensor::new(vec![k], b.to_vec())));
            let y = crate::cpu::run(&g, &[("x", &x)]).unwrap().remove("y").unwrap();
            let [n, _, p, q] = y.shape[..] else { panic!() };
            (0..k)
                .map(|ch| {
                    let mut s = 0f64;
                    for img in 0..n {
                        s += y.data[(img * k + ch) * p * q..(img * k + ch + 1) * p * q].iter().map(|&v| v as f64).sum::<f64>();
                    }
                    s / (n * p * q) as f64
                })
                .collect()
        };
        let exact = run(&w, &b.data);
        let rounded = run(&wq, &b.data);
        let corrected = run(&wq, &fixed);
        for ch in 0..k {
            let before = (rounded[ch] - exact[ch]).abs();
            let after = (corrected[ch] - exact[ch]).abs();
            println!("channel {ch}: mean shift {before:.3e} rounded, {after:.3e} corrected");
            assert!(after < 1e-5 + before * 1e-3, "channel {ch}: {after} after, {before} before");
        }
        assert!(rounded.iter().zip(&exact).any(|(a, b)| (a - b).abs() > 1e-3), "the rounding shifts the mean: {rounded:?} {exact:?}");
    }

    /// Each tap's mean is the mean output of the conv whose weight picks that one tap (a one-hot
    /// weight run by the CPU executor), on a conv with stride, padding and dilation in both axes;
    /// a Linear's are its input's column means over every leading dim.
    #[test]
    fn tap_means_are_what_the_conv_itself_reads() {
        let (c, r, s) = (3, 3, 2);
        let attrs = ConvAttrs { stride: [2, 1], padding: [2, 1], dilation: [2, 3], ..Default::default() };
        let x = crate::dev::uniform_tensor(&[2, c, 11, 9], 7);
        let tracer = crate::Tracer::new();
        let xi = tracer.input("x", &x.shape);
        let w = HostTensor::new(vec![1, c, r, s], vec![0.0; c * r * s]);
        let param = crate::tensor::Param { name: "conv.weight".into(), value: std::sync::Arc::new(w.clone()) };
        crate::tensor::Tensor::record("conv", Op::Conv(attrs), &[&xi], &[&param]).unwrap().mark_output("y");
        let g = tracer.graph();
        let conv = g.nodes.iter().position(|n| matches!(n.op, Op::Conv(_))).unwrap();
        let mut sums = InputSums::default();
        assert!(sums.add(&g, conv, &x));
        let means = sums.means().unwrap();
        assert_eq!(means.len(), c * r * s);
        for (tap, &mean) in means.iter().enumerate() {
            let mut one_hot = w.clone();
            one_hot.data[tap] = 1.0;
            let mut g = g.clone();
            g.weights.insert("conv.weight".into(), std::sync::Arc::new(one_hot));
            let y = crate::cpu::run(&g, &[("x", &x)]).unwrap().remove("y").unwrap();
            let want = y.data.iter().map(|&v| v as f64).sum::<f64>() / y.data.len() as f64;
            assert!((mean as f64 - want).abs() < 1e-6, "tap {tap}: {mean} against the conv's {want}");
        }

        let x = crate::dev::uniform_tensor(&[2, 3, 4], 8);
        let mut sums = InputSums::default();
        assert!(sums.add_linear(&x));
        let means = sums.means().unwrap();
        assert_eq!(means.len(), 4);
        for (f, &mean) in means.iter().enumerate() {
            let want = x.data.iter().skip(f).step_by(4).map(|&v| v as f64).sum::<f64>() / 6.0;
            assert!((mean as f64 - want).abs() < 1e-6, "feature {f}");
        }
    }

    #[test]
    fn sizes_that_disagree_give_no_correction() {
        let w = HostTensor::new(vec![2, 3], vec![0.0; 6]);
        assert!(corrected_bias(&w, &w, &[1.0; 3], Some(&[0.0, 0.0])).is_some());
        assert!(corrected_bias(&w, &w, &[1.0; 4], None).is_none());
        assert!(corrected_bias(&w, &w, &[1.0; 3], Some(&[0.0])).is_none());
        assert!(corrected_bias(&w, &HostTensor::new(vec![1, 3], vec![0.0; 3]), &[1.0; 3], None).is_none());
    }
}
