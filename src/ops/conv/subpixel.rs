//! A strided transposed convolution as one stride-1 convolution plus a depth-to-space gather (the
//! sub-pixel decomposition), offered as more timed candidates beside cuDNN's backward-data.
//!
//! Output row `oy = s·m + a` of a stride-`s` ConvTranspose2d (kernel `k`, padding `p`) only sees
//! the kernel rows `ky ≡ a + p (mod s)`: phase `a` is a stride-1 convolution of the input with
//! `T = ceil(k / s)` taps (the kernel's rows `(a + p) mod s + s·j`, flipped). All `s0·s1` phases
//! are one convolution with `s0·s1·Cout` output channels over the input padded by `T - 1 - p / s`
//! (more where the last phases need it), bias and ReLU in its epilogue (cuDNN's fused call);
//! `kernels/subpixel.cu` then moves each phase's window into the NHWC output. CenterNet's k=4,
//! s=2, p=1 deconvs become a 2×2 convolution with 4·Cout outputs on `(H+1)×(W+1)` pixels: the
//! same FLOPs as the deconv (+3% for the border row and column), run by cuDNN's forward kernels
//! instead of backward-data followed by two in-place passes (bias, ReLU).
//!
//! The convolution's output is this layer's scratch, in its workspace (the arena holds it for
//! this step alone); candidates that run the batch in slices need a slice's scratch only.

use super::ConvAttrs;
use crate::engine::cudnn::{conv_candidates_geom, ConvProblem};
use crate::engine::launch::{grid_for, launch, CudaFunction, KArg, BLOCK};
use crate::engine::layer::{Layer, RunCtx, ValueId};
use crate::graph::NodeId;
use crate::ops::BuildCtx;
use crate::LowerKind;
use crate::{Error, Result};
use std::sync::Arc;

/// `kernels/subpixel.cu`, compiled with NVRTC on first use like Kiln's other kernels.
pub const SUBPIXEL_CU: &str = crate::engine::kernels::ON_DEMAND[2].1;

/// Batch slices offered beside the whole batch: a few images' scratch (8.7 MB per image for
/// CenterNet's last deconv) stays in L2 between the convolution and the gather.
const SLICES: [usize; 3] = [2, 4, 8];

/// One spatial axis of the decomposition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AxisPlan {
    /// The transposed convolution's stride: the number of phases along this axis.
    pub s: usize,
    /// Its kernel extent.
    pub k: usize,
    /// Taps of each phase's stride-1 convolution, `ceil(k / s)`.
    pub taps: usize,
    /// `padding mod s`.
    pub pm: usize,
    /// Symmetric zero padding of the stride-1 convolution.
    pub pad: usize,
    /// Added to every phase's offset when `pad` exceeds what the first phase needs.
    pub shift: usize,
    /// The stride-1 convolution's output extent.
    pub conv_out: usize,
    /// The transposed convolution's output extent.
    pub out: usize,
}

impl AxisPlan {
    /// The plan for one axis (`d` dilation, input extent `n_in`, output extent `n_out`), or
    /// `None` where the decomposition does not apply (dilation, a padding of a whole kernel).
    pub fn new(k: usize, s: usize, p: usize, d: usize, n_in: usize, n_out: usize) -> Option<Self> {
        if d != 1 || s == 0 || k == 0 || n_in == 0 {
            return None;
        }
        let taps = k.div_ceil(s);
        // Phase a reads x[m + c_a - j] (tap j), c_a = (a + p) / s; the first phase needs the
        // most left padding: T - 1 - c_0.
        let pad_lo = (taps - 1).checked_sub(p / s)?;
        let pm = p % s;
        // Conv pixel of output index m of phase a, without extra padding: m + off(a).
        let off = |a: usize| (a + pm) / s;
        let conv_lo = n_in + 2 * pad_lo + 1 - taps;
        // The last conv pixel any phase reads, plus one.
        let needed = (0..s.min(n_out)).map(|a| (n_out - a).div_ceil(s) + off(a)).max()?;
        let shift = needed.saturating_sub(conv_lo);
        let pad = pad_lo + shift;
        Some(Self { s, k, taps, pm, pad, shift, conv_out: conv_lo + 2 * shift, out: n_out })
    }

    /// Kernel index of phase `a`'s tap `r` (taps in forward-convolution order), `None` past the
    /// kernel (a zero weight, when `s` does not divide `k`).
    pub fn tap(&self, a: usize, r: usize) -> Option<usize> {
        let ky = (a + self.pm) % self.s + self.s * (self.taps - 1 - r);
        (ky < self.k).then_some(ky)
    }

    /// `(phase, conv pixel)` that output index `o` is read from.
    #[cfg(test)]
    pub fn source(&self, o: usize) -> (usize, usize) {
        let (m, a) = (o / self.s, o % self.s);
        (a, m + (a + self.pm) / self.s + self.shift)
    }
}

/// The decomposition of one transposed convolution: both axes, the channels and the weights of
/// the stride-1 convolution.
#[derive(Clone, Debug, PartialEq)]
pub struct SubpixelPlan {
    pub axes: [AxisPlan; 2],
    pub cin: usize,
    pub cout: usize,
}

impl SubpixelPlan {
    /// For a ConvTranspose2d with `attrs`, weight `[Cin, Cout, kh, kw]` (groups 1), input
    /// `[Cin, h, w]` and output `[Cout, ho, wo]`; `None` where it does not apply.
    pub fn new(a: &ConvAttrs, [cin, cout, kh, kw]: [usize; 4], [h, w]: [usize; 2], [ho, wo]: [usize; 2]) -> Option<Self> {
        if !a.transposed || a.groups != 1 || a.residual {
            return None;
        }
        let y = AxisPlan::new(kh, a.stride[0], a.padding[0], a.dilation[0], h, ho)?;
        let x = AxisPlan::new(kw, a.stride[1], a.padding[1], a.dilation[1], w, wo)?;
        Some(Self { axes: [y, x], cin, cout })
    }

    /// Phases in all (`s0·s1`): the convolution has this many blocks of `cout` channels.
    pub fn phases(&self) -> usize {
        self.axes[0].s * self.axes[1].s
    }

    /// The stride-1 convolution's weight shape `[s0·s1·Cout, Cin, T0, T1]` (PyTorch's layout).
    pub fn conv_weight_shape(&self) -> [usize; 4] {
        [self.phases() * self.cout, self.cin, self.axes[0].taps, self.axes[1].taps]
    }

    /// The stride-1 convolution's attributes: padding `pad`, the deconv's bias and activation.
    pub fn conv_attrs(&self, a: &ConvAttrs) -> ConvAttrs {
        ConvAttrs {
            transposed: false,
            stride: [1, 1],
            padding: [self.axes[0].pad, self.axes[1].pad],
            dilation: [1, 1],
            groups: 1,
            output_padding: [0, 0],
            bias: a.bias,
            residual: false,
            act: a.act,
            pool: None,
        }
    }

    /// The stride-1 convolution's output `(C, H, W)`.
    pub fn conv_out_chw(&self) -> (usize, usize, usize) {
        (self.phases() * self.cout, self.axes[0].conv_out, self.axes[1].conv_out)
    }

    /// Rearranges the deconv weight `[Cin, Cout, kh, kw]` into the convolution's
    /// `[(a, b, co), ci, r, q]`: phase (a, b)'s taps of the flipped kernel.
    pub fn conv_weight(&self, w: &[f32]) -> Vec<f32> {
        let [ay, ax] = self.axes;
        let (cin, cout) = (self.cin, self.cout);
        let [k_out, _, t0, t1] = self.conv_weight_shape();
        let mut out = vec![0f32; k_out * cin * t0 * t1];
        for a in 0..ay.s {
            for b in 0..ax.s {
                for co in 0..cout {
                    let o = (a * ax.s + b) * cout + co;
                    for ci in 0..cin {
                        for r in 0..t0 {
                            let Some(ky) = ay.tap(a, r) else { continue };
                            for q in 0..t1 {
                                let Some(kx) = ax.tap(b, q) else { continue };
                                out[((o * cin + ci) * t0 + r) * t1 + q] = w[((ci * cout + co) * ay.k + ky) * ax.k + kx];
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// The bias of every phase block (the deconv's, repeated).
    pub fn conv_bias(&self, bias: &[f32]) -> Vec<f32> {
        (0..self.phases()).flat_map(|_| bias.iter().copied()).collect()
    }

    /// The depth-to-space on NCHW host tensors (the GPU kernel's index arithmetic, for tests):
    /// `conv` is `[n, s0·s1·Cout, TH, TW]`, the result `[n, Cout, ho, wo]`.
    #[cfg(test)]
    pub fn depth_to_space(&self, conv: &[f32], n: usize) -> Vec<f32> {
        let [ay, ax] = self.axes;
        let (cc, th, tw) = self.conv_out_chw();
        let mut out = vec![0f32; n * self.cout * ay.out * ax.out];
        for img in 0..n {
            for co in 0..self.cout {
                for oy in 0..ay.out {
                    let (a, ty) = ay.source(oy);
                    for ox in 0..ax.out {
                        let (b, tx) = ax.source(ox);
                        let c = (a * ax.s + b) * self.cout + co;
                        out[((img * self.cout + co) * ay.out + oy) * ax.out + ox] = conv[((img * cc + c) * th + ty) * tw + tx];
                    }
                }
            }
        }
        out
    }

    /// The kernel's integer arguments: TH, TW, HO, WO, C, s0, s1, pm0, pm1, sh0, sh1.
    fn kernel_dims(&self) -> Option<[i32; 11]> {
        let [ay, ax] = self.axes;
        let v = [ay.conv_out, ax.conv_out, ay.out, ax.out, self.cout, ay.s, ax.s, ay.pm, ax.pm, ay.shift, ax.shift];
        let mut out = [0i32; 11];
        for (o, x) in out.iter_mut().zip(v) {
            *o = i32::try_from(x).ok()?;
        }
        Some(out)
    }
}

/// What every candidate of one node shares.
struct Shared {
    path: String,
    x: ValueId,
    y: ValueId,
    d2s: CudaFunction,
    dims: [i32; 11],
    /// Bytes per image of the input, the output and the convolution's output (the scratch).
    x_image: usize,
    y_image: usize,
    conv_image: usize,
    /// The gather's threads per image (one per 16 bytes of output).
    y_packs: usize,
    sm_count: u32,
}

/// One candidate: a forward-convolution candidate into the scratch, then the gather; the batch
/// whole or in slices of `slice` images.
pub struct SubpixelDeconv {
    shared: Arc<Shared>,
    conv: Arc<dyn Layer>,
    slice: Option<usize>,
}

impl SubpixelDeconv {
    /// Images per convolution call at `batch`.
    fn step(&self, batch: usize) -> usize {
        self.slice.map_or(batch, |s| s.min(batch)).max(1)
    }
    fn scratch_bytes(&self, batch: usize) -> usize {
        (self.step(batch) * self.shared.conv_image).next_multiple_of(crate::engine::arena::ALIGN)
    }
}

impl Layer for SubpixelDeconv {
    fn path(&self) -> &str {
        &self.shared.path
    }
    fn kind(&self) -> String {
        format!("subpixel{}+{}", self.slice.map(|n| format!(":by{n}")).unwrap_or_default(), self.conv.kind())
    }
    fn workspace_bytes(&self, batch: usize) -> usize {
        self.scratch_bytes(batch) + self.conv.workspace_bytes(self.step(batch))
    }
    fn prepare(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let step = self.step(batch);
        self.conv.prepare(rt, step)?;
        if !batch.is_multiple_of(step) {
            self.conv.prepare(rt, batch % step)?;
        }
        Ok(())
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
        let s = &self.shared;
        let scratch_bytes = self.scratch_bytes(batch);
        if rt.workspace_bytes < scratch_bytes {
            return Err(Error::Lower {
                path: s.path.clone(),
                op: "conv_transpose2d".into(),
                kind: LowerKind::Workspace,
                reason: format!("the sub-pixel scratch needs {scratch_bytes} bytes at batch {batch}, the run gives {}", rt.workspace_bytes),
            });
        }
        let scratch = rt.workspace;
        // The convolution sees the slice's input at x and the scratch as its output y.
        let mut ptrs = rt.ptrs.to_vec();
        let (x, y) = (rt.ptr(s.x), rt.ptr(s.y));
        let step = self.step(batch);
        let mut first = 0;
        while first < batch {
            let n = step.min(batch - first);
            ptrs[s.x.0] = x + (first * s.x_image) as u64;
            ptrs[s.y.0] = scratch;
            let conv_rt = RunCtx {
                ptrs: &ptrs,
                workspace: rt.workspace + scratch_bytes as u64,
                workspace_bytes: rt.workspace_bytes - scratch_bytes,
                ..*rt
            };
            self.conv.enqueue(&conv_rt, n)?;
            let mut args = vec![KArg::Ptr(scratch), KArg::Ptr(y + (first * s.y_image) as u64), KArg::I64(n as i64)];
            args.extend(s.dims.iter().map(|&d| KArg::I32(d)));
            launch(rt, &s.d2s, grid_for(n * s.y_packs, s.sm_count), (BLOCK, 1, 1), 0, &args)?;
            first += n;
        }
        Ok(())
    }
}

/// The sub-pixel candidates of a ConvTranspose2d node (weight `[Cin, Cout, kh, kw]`, `bias` one
/// value per output channel, zeros when it has none), or none where the decomposition does not
/// apply (groups, dilation).
pub fn candidates(
    ctx: &mut BuildCtx,
    node: NodeId,
    a: &ConvAttrs,
    weight: &[f32],
    shape4: [usize; 4],
    bias: &[f32],
) -> Result<Vec<Box<dyn Layer>>> {
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let (cin, h, w) = ctx.chw(x, "input")?;
    let (cout, ho, wo) = ctx.chw(y, "output")?;
    let Some(plan) = SubpixelPlan::new(a, shape4, [h, w], [ho, wo]) else { return Ok(Vec::new()) };
    if shape4[0] != cin || shape4[1] != cout || bias.len() != cout {
        return Err(ctx.err(node, LowerKind::Weights, format!("weight {shape4:?} / bias of {} for {cin} → {cout} channels", bias.len())));
    }
    let Some(dims) = plan.kernel_dims() else { return Ok(Vec::new()) };
    let wt = plan.conv_weight(weight);
    let bt = plan.conv_bias(bias);
    let attrs = plan.conv_attrs(a);
    let (geometry, epilogue) = (attrs.geometry(), attrs.epilogue());
    let problem = ConvProblem { geometry, epilogue, weight: &wt, weight_shape: plan.conv_weight_shape(), bias: &bt, x, y, z: None };
    let convs = conv_candidates_geom(ctx, problem, plan.conv_out_chw(), false)?;
    if convs.is_empty() {
        return Ok(Vec::new());
    }
    let elem = ctx.elem();
    ctx.kernels.add_source("subpixel.cu", SUBPIXEL_CU)?;
    let (cc, th, tw) = plan.conv_out_chw();
    let shared = Arc::new(Shared {
        path: ctx.node(node).path.clone(),
        x,
        y,
        d2s: ctx.kernels.get(&format!("subpixel_d2s_{}", elem.suffix()))?,
        dims,
        x_image: cin * h * w * elem.size(),
        y_image: cout * ho * wo * elem.size(),
        conv_image: cc * th * tw * elem.size(),
        y_packs: (cout * ho * wo * elem.size()).div_ceil(16),
        sm_count: ctx.kernels.sm_count(),
    });
    // The whole batch, a few small slices, and the largest slice whose scratch fits the arena's
    // room at this layer.
    let max = ctx.config.max_batch;
    let room = ctx.workspace_budget.max(crate::engine::tactic::WORKSPACE_FLOOR);
    let mut slices: Vec<Option<usize>> = vec![None];
    slices.extend(SLICES.iter().filter(|&&n| n < max).map(|&n| Some(n)));
    if max * shared.conv_image > room {
        let fits = std::iter::successors(Some(max / 2), |n| Some(n / 2)).take_while(|&n| n >= 1).find(|&n| n * shared.conv_image <= room);
        if let Some(n) = fits.filter(|n| !SLICES.contains(n)) {
            slices.push(Some(n));
        }
    }
    let convs: Vec<Arc<dyn Layer>> = convs.into_iter().map(Arc::from).collect();
    let mut out: Vec<Box<dyn Layer>> = Vec::new();
    for slice in slices {
        for conv in &convs {
            out.push(Box::new(SubpixelDeconv { shared: shared.clone(), conv: conv.clone(), slice }));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::HostTensor;
    use crate::ops::conv::{conv2d_cpu, conv_transpose2d_cpu, Activation};

    fn uniform(shape: &[usize], seed: u64) -> HostTensor {
        crate::seeded::uniform_tensor(shape, seed)
    }

    /// The rearranged convolution followed by the depth-to-space equals the transposed
    /// convolution, both on the CPU executor's references.
    fn check(
        (cin, cout): (usize, usize),
        k: [usize; 2],
        s: [usize; 2],
        p: [usize; 2],
        op: [usize; 2],
        hw: [usize; 2],
        (bias, relu): (bool, bool),
    ) {
        let a = ConvAttrs {
            transposed: true,
            stride: s,
            padding: p,
            output_padding: op,
            bias,
            act: if relu { Activation::Relu } else { Activation::None },
            ..ConvAttrs::default()
        };
        let n = 2;
        let x = uniform(&[n, cin, hw[0], hw[1]], 1);
        let w = uniform(&[cin, cout, k[0], k[1]], 2);
        let b = uniform(&[cout], 3);
        let mut inputs = vec![&x, &w];
        if bias {
            inputs.push(&b);
        }
        let want = conv_transpose2d_cpu(&a, &inputs).expect("deconv");
        let (ho, wo) = (want.shape[2], want.shape[3]);
        let plan = SubpixelPlan::new(&a, [cin, cout, k[0], k[1]], hw, [ho, wo]).expect("applies");
        let wt = HostTensor::new(plan.conv_weight_shape().to_vec(), plan.conv_weight(&w.data));
        let bt = HostTensor::new(vec![plan.phases() * cout], plan.conv_bias(&b.data));
        let mut cin_ = vec![&x, &wt];
        if bias {
            cin_.push(&bt);
        }
        let conv = conv2d_cpu(&plan.conv_attrs(&a), &cin_).expect("conv");
        let (cc, th, tw) = plan.conv_out_chw();
        assert_eq!(conv.shape, vec![n, cc, th, tw], "conv output {k:?} {s:?} {p:?}");
        let got = plan.depth_to_space(&conv.data, n);
        assert_eq!(got.len(), want.data.len());
        let err = got.iter().zip(&want.data).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
        assert!(err < 1e-4, "k {k:?} s {s:?} p {p:?} op {op:?} hw {hw:?}: max abs error {err}");
    }

    #[test]
    fn rearranged_conv_and_depth_to_space_equal_the_transposed_conv() {
        // CenterNet's deconvs: k4 s2 p1, with the folded BatchNorm's bias and ReLU.
        check((8, 6), [4, 4], [2, 2], [1, 1], [0, 0], [5, 7], (true, true));
        check((8, 6), [4, 4], [2, 2], [1, 1], [0, 0], [5, 7], (false, false));
        // A kernel the stride does not divide, with output padding.
        check((5, 3), [3, 3], [2, 2], [1, 1], [1, 1], [4, 6], (true, false));
        check((5, 3), [3, 3], [2, 2], [0, 0], [0, 0], [4, 3], (false, true));
        // Kernel = stride (no overlap), stride 3, mixed strides, stride 1, large padding.
        check((4, 4), [2, 2], [2, 2], [0, 0], [0, 0], [3, 5], (true, false));
        check((3, 5), [5, 6], [3, 3], [2, 1], [1, 2], [4, 4], (true, true));
        check((4, 2), [4, 3], [2, 1], [1, 1], [1, 0], [3, 5], (true, false));
        check((4, 2), [3, 3], [1, 1], [1, 1], [0, 0], [5, 5], (false, false));
        check((3, 2), [4, 4], [2, 2], [3, 2], [0, 1], [6, 5], (true, false));
        check((3, 2), [1, 1], [2, 2], [0, 0], [1, 1], [3, 3], (true, false));
    }

    #[test]
    fn centernet_deconv_is_a_2x2_conv_on_one_more_row_and_column() {
        let a = ConvAttrs { transposed: true, stride: [2, 2], padding: [1, 1], ..ConvAttrs::default() };
        let plan = SubpixelPlan::new(&a, [256, 256, 4, 4], [64, 64], [128, 128]).expect("applies");
        assert_eq!(plan.conv_weight_shape(), [1024, 256, 2, 2]);
        assert_eq!(plan.conv_out_chw(), (1024, 65, 65));
        assert_eq!(plan.conv_attrs(&a).padding, [1, 1]);
        // Phase 0 reads conv pixel m, phase 1 conv pixel m + 1.
        assert_eq!((plan.axes[0].source(6), plan.axes[0].source(7)), ((0, 3), (1, 4)));
    }

    #[test]
    fn other_transposed_convs_are_left_to_cudnn() {
        let a = ConvAttrs { transposed: true, stride: [2, 2], groups: 2, ..ConvAttrs::default() };
        assert!(SubpixelPlan::new(&a, [4, 2, 4, 4], [5, 5], [12, 12]).is_none(), "groups");
        let a = ConvAttrs { transposed: true, stride: [2, 2], dilation: [2, 2], ..ConvAttrs::default() };
        assert!(SubpixelPlan::new(&a, [4, 2, 3, 3], [5, 5], [13, 13]).is_none(), "dilation");
        assert!(SubpixelPlan::new(&ConvAttrs::default(), [4, 2, 3, 3], [5, 5], [3, 3]).is_none(), "not transposed");
    }
}
