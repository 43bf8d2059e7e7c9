//! Ultralytics YOLOv8 and YOLO11 detectors (`DetectionModel("yolov8n.yaml")`, `"yolo11n.yaml"`,
//! and their `s` widths), with Ultralytics' `state_dict` names: `model.<i>.<...>` where `i` is the
//! row of the model's yaml (`model.0.conv.weight`, `model.2.m.0.cv1.bn.running_mean`,
//! `model.22.cv2.0.2.bias`, `model.22.dfl.conv.weight`; the head is `model.23` in YOLO11).
//!
//! The yaml is the `V8` / `V11` table below, and `Yolo::load` is Ultralytics' `parse_model`: it
//! scales each row's channels (`make_divisible(min(c, max_channels) * width, 8)`) and repeats
//! (`max(round(n * depth), 1)`) by the `YoloScale`. The eval-mode output is Ultralytics' first
//! return value: `[N, 4 + classes, anchors]`, boxes as (cx, cy, w, h) in input pixels then class
//! probabilities (`[N, 84, 8400]` at 640x640). Anchors and strides are computed while tracing for
//! the traced input size and enter the graph as constants (`model.<head>.anchors`,
//! `model.<head>.strides`, which are not `state_dict` keys).
//!
//! BatchNorm uses Ultralytics' `eps = 1e-3` (its `initialize_weights`), and every `Conv` is
//! conv (no bias) + BatchNorm + SiLU unless built with `act=False`.

use kiln::HostTensor;
use kiln::{
    nn::{BatchNorm2d, BatchNorm2dConfig, Conv2d, Conv2dConfig, MaxPool2d, Pool2dConfig, SiLU, Upsample, UpsampleConfig},
    Error, Forward, Module, Param, Result, Tensor, VarBuilder,
};
use std::sync::Arc;

/// DFL bins per box side (`reg_max`).
pub const REG_MAX: usize = 16;

/// The compound scaling of a yaml's `scales` row: `[depth, width, max_channels]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YoloScale {
    pub depth: f64,
    pub width: f64,
    pub max_channels: usize,
    /// YOLO11's `m`/`l`/`x` force `c3k=True` in every C3k2 (`parse_model`).
    pub c3k_everywhere: bool,
}

/// Which yaml: its layer table and its head's style.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum YoloVersion {
    V8,
    V11,
}

/// A detector: version, scale and classes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YoloConfig {
    pub version: YoloVersion,
    pub scale: YoloScale,
    pub num_classes: usize,
}

impl YoloConfig {
    /// `yolov8{n,s}.yaml` / `yolo11{n,s}.yaml` with 80 classes.
    pub fn new(version: YoloVersion, scale: char) -> Result<Self> {
        let (depth, width) = match (version, scale) {
            (YoloVersion::V8, 'n') => (0.33, 0.25),
            (YoloVersion::V8, 's') => (0.33, 0.50),
            (YoloVersion::V11, 'n') => (0.50, 0.25),
            (YoloVersion::V11, 's') => (0.50, 0.50),
            _ => {
                return Err(Error::UnknownModel {
                    name: format!("{version:?} scale `{scale}`"),
                    suggestion: None,
                    known: "yolov8n, yolov8s, yolo11n, yolo11s".into(),
                })
            }
        };
        Ok(Self { version, scale: YoloScale { depth, width, max_channels: 1024, c3k_everywhere: false }, num_classes: 80 })
    }
    fn channels(&self, c: usize) -> usize {
        // make_divisible(min(c, max_channels) * width, 8) = ceil(x / 8) * 8
        let x = c.min(self.scale.max_channels) as f64 * self.scale.width;
        (x / 8.0).ceil() as usize * 8
    }
    fn repeats(&self, n: usize) -> usize {
        if n > 1 {
            ((n as f64 * self.scale.depth).round_ties_even() as usize).max(1)
        } else {
            n
        }
    }
}

// ---- building blocks (ultralytics/nn/modules/{conv,block}.py) ----------------------------------

/// `Conv(c1, c2, k, s, g, act)`: conv (padding k/2, no bias) + BatchNorm(eps 1e-3) + SiLU.
#[derive(Clone, Copy, Debug)]
pub struct ConvSpec {
    pub c1: usize,
    pub c2: usize,
    pub k: usize,
    pub s: usize,
    pub g: usize,
    pub act: bool,
}

impl ConvSpec {
    pub fn new(c1: usize, c2: usize, k: usize) -> Self {
        Self { c1, c2, k, s: 1, g: 1, act: true }
    }
    fn stride(self, s: usize) -> Self {
        Self { s, ..self }
    }
    fn groups(self, g: usize) -> Self {
        Self { g, ..self }
    }
    fn no_act(self) -> Self {
        Self { act: false, ..self }
    }
    fn conv(&self) -> Conv2dConfig {
        Conv2dConfig::new(self.c1, self.c2, self.k).stride(self.s).padding(self.k / 2).groups(self.g).bias(false)
    }
    fn bn(&self) -> BatchNorm2dConfig {
        BatchNorm2dConfig { eps: 1e-3, ..BatchNorm2dConfig::new(self.c2) }
    }
}

/// Ultralytics' `Conv`; `DWConv(c1, c2, k)` is this with `g = gcd(c1, c2)`.
#[derive(Module)]
#[module(config = ConvSpec)]
pub struct Conv {
    #[module(config = cfg.conv())]
    conv: Conv2d,
    #[module(config = cfg.bn())]
    bn: BatchNorm2d,
    #[module(when = cfg.act, config = ())]
    act: Option<SiLU>,
}

impl Forward for Conv {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.act.forward(&self.bn.forward(&self.conv.forward(x)?)?)
    }
}

/// `Bottleneck(c1, c2, shortcut, g=1, k=(k, k), e)`.
#[derive(Clone, Copy, Debug)]
pub struct BottleneckSpec {
    pub c1: usize,
    pub c2: usize,
    pub shortcut: bool,
    pub e: f64,
}

impl BottleneckSpec {
    fn hidden(&self) -> usize {
        (self.c2 as f64 * self.e) as usize
    }
}

pub struct Bottleneck {
    cv1: Conv,
    cv2: Conv,
    add: bool,
}

impl Module for Bottleneck {
    type Config = BottleneckSpec;
    fn load(vb: VarBuilder, s: &BottleneckSpec) -> Result<Self> {
        Ok(Self {
            cv1: Conv::load(vb.pp("cv1"), &ConvSpec::new(s.c1, s.hidden(), 3))?,
            cv2: Conv::load(vb.pp("cv2"), &ConvSpec::new(s.hidden(), s.c2, 3))?,
            add: s.shortcut && s.c1 == s.c2,
        })
    }
}

impl Forward for Bottleneck {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.cv2.forward(&self.cv1.forward(x)?)?;
        if self.add {
            x + &y
        } else {
            Ok(y)
        }
    }
}

/// `C3k(c1, c2, n=2, shortcut, e=0.5, k=3)`: C3 with 3x3 bottlenecks.
pub struct C3k {
    cv1: Conv,
    cv2: Conv,
    cv3: Conv,
    m: Vec<Bottleneck>,
}

impl Module for C3k {
    /// (c1, c2, shortcut)
    type Config = (usize, usize, bool);
    fn load(vb: VarBuilder, &(c1, c2, shortcut): &Self::Config) -> Result<Self> {
        let c = c2 / 2;
        let m = (0..2)
            .map(|i| Bottleneck::load(vb.pp("m").pp(i), &BottleneckSpec { c1: c, c2: c, shortcut, e: 1.0 }))
            .collect::<Result<_>>()?;
        Ok(Self {
            cv1: Conv::load(vb.pp("cv1"), &ConvSpec::new(c1, c, 1))?,
            cv2: Conv::load(vb.pp("cv2"), &ConvSpec::new(c1, c, 1))?,
            cv3: Conv::load(vb.pp("cv3"), &ConvSpec::new(2 * c, c2, 1))?,
            m,
        })
    }
}

impl Forward for C3k {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = self.cv1.forward(x)?;
        for b in &self.m {
            y = b.forward(&y)?;
        }
        self.cv3.forward(&Tensor::cat(&[&y, &self.cv2.forward(x)?], 1)?)
    }
}

/// One entry of a C2f / C3k2's `m`.
pub enum Inner {
    Bottleneck(Box<Bottleneck>),
    C3k(Box<C3k>),
}

impl Forward for Inner {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Inner::Bottleneck(b) => b.forward(x),
            Inner::C3k(b) => b.forward(x),
        }
    }
}

/// `C2f(c1, c2, n, shortcut)` and `C3k2(c1, c2, n, c3k, e)`: the same forward, different `m`.
#[derive(Clone, Copy, Debug)]
pub struct C2fSpec {
    pub c1: usize,
    pub c2: usize,
    pub n: usize,
    pub shortcut: bool,
    pub e: f64,
    /// `None`: C2f (bottlenecks with e=1); `Some(c3k)`: C3k2 (C3k blocks, or bottlenecks with e=0.5).
    pub c3k: Option<bool>,
}

pub struct C2f {
    c: usize,
    cv1: Conv,
    cv2: Conv,
    m: Vec<Inner>,
}

impl Module for C2f {
    type Config = C2fSpec;
    fn load(vb: VarBuilder, s: &C2fSpec) -> Result<Self> {
        let c = (s.c2 as f64 * s.e) as usize;
        let mut m = Vec::with_capacity(s.n);
        for i in 0..s.n {
            let vb = vb.pp("m").pp(i);
            m.push(match s.c3k {
                None => Inner::Bottleneck(Box::new(Bottleneck::load(vb, &BottleneckSpec { c1: c, c2: c, shortcut: s.shortcut, e: 1.0 })?)),
                Some(false) => {
                    Inner::Bottleneck(Box::new(Bottleneck::load(vb, &BottleneckSpec { c1: c, c2: c, shortcut: s.shortcut, e: 0.5 })?))
                }
                Some(true) => Inner::C3k(Box::new(C3k::load(vb, &(c, c, s.shortcut))?)),
            });
        }
        Ok(Self {
            c,
            cv1: Conv::load(vb.pp("cv1"), &ConvSpec::new(s.c1, 2 * c, 1))?,
            cv2: Conv::load(vb.pp("cv2"), &ConvSpec::new((2 + s.n) * c, s.c2, 1))?,
            m,
        })
    }
}

impl Forward for C2f {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = self.cv1.forward(x)?.split(&[self.c, self.c], 1)?;
        for b in &self.m {
            let last = y.last().expect("two chunks").clone();
            y.push(b.forward(&last)?);
        }
        let refs: Vec<&Tensor> = y.iter().collect();
        self.cv2.forward(&Tensor::cat(&refs, 1)?)
    }
}

/// `SPPF(c1, c2, k=5)`: three chained 5x5 stride-1 max pools, concatenated.
pub struct Sppf {
    cv1: Conv,
    cv2: Conv,
    m: MaxPool2d,
}

impl Module for Sppf {
    type Config = (usize, usize);
    fn load(vb: VarBuilder, &(c1, c2): &(usize, usize)) -> Result<Self> {
        let c = c1 / 2;
        Ok(Self {
            // Legacy yaml rows (v8, 11) keep SiLU on cv1.
            cv1: Conv::load(vb.pp("cv1"), &ConvSpec::new(c1, c, 1))?,
            cv2: Conv::load(vb.pp("cv2"), &ConvSpec::new(4 * c, c2, 1))?,
            m: MaxPool2d::load(vb.pp("m"), &Pool2dConfig::new(5).stride(1).padding(2))?,
        })
    }
}

impl Forward for Sppf {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = vec![self.cv1.forward(x)?];
        for _ in 0..3 {
            let next = self.m.forward(y.last().expect("cv1"))?;
            y.push(next);
        }
        let refs: Vec<&Tensor> = y.iter().collect();
        self.cv2.forward(&Tensor::cat(&refs, 1)?)
    }
}

/// `Attention(dim, num_heads, attn_ratio=0.5)`: 1x1 qkv, per-head `softmax(q^T k * scale)`,
/// `v @ attn^T`, plus a depthwise 3x3 positional encoding of `v`, then a 1x1 projection.
pub struct Attention {
    heads: usize,
    key_dim: usize,
    head_dim: usize,
    scale: f32,
    qkv: Conv,
    proj: Conv,
    pe: Conv,
}

impl Module for Attention {
    /// (dim, num_heads)
    type Config = (usize, usize);
    fn load(vb: VarBuilder, &(dim, heads): &(usize, usize)) -> Result<Self> {
        let head_dim = dim / heads;
        let key_dim = head_dim / 2;
        let h = dim + key_dim * heads * 2;
        Ok(Self {
            heads,
            key_dim,
            head_dim,
            scale: (key_dim as f64).powf(-0.5) as f32,
            qkv: Conv::load(vb.pp("qkv"), &ConvSpec::new(dim, h, 1).no_act())?,
            proj: Conv::load(vb.pp("proj"), &ConvSpec::new(dim, dim, 1).no_act())?,
            pe: Conv::load(vb.pp("pe"), &ConvSpec::new(dim, dim, 3).groups(dim).no_act())?,
        })
    }
}

impl Forward for Attention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [b, c, h, w] = x.dims4().ok_or_else(|| Error::Shape {
            path: x.scope_path("attn"),
            op: "attention".into(),
            reason: "expects an NCHW input".into(),
            got: vec![x.shape().to_vec()],
        })?;
        let (heads, kd, hd) = (self.heads as isize, self.key_dim, self.head_dim);
        let qkv = self.qkv.forward(x)?.view(&[b as isize, heads, (2 * kd + hd) as isize, (h * w) as isize])?;
        let [q, k, v] = <[Tensor; 3]>::try_from(qkv.split(&[kd, kd, hd], 2)?).expect("three parts");
        let attn = q.affine(self.scale, 0.0)?.transpose(-2, -1)?.matmul(&k)?.softmax(-1)?;
        let dims = [b as isize, c as isize, h as isize, w as isize];
        let y = v.matmul(&attn.transpose(-2, -1)?)?.view(&dims)?;
        let y = (&y + &self.pe.forward(&v.reshape(&dims)?)?)?;
        self.proj.forward(&y)
    }
}

/// `PSABlock(c, attn_ratio=0.5, num_heads)`: attention and a 2-conv feed-forward, both residual.
pub struct PsaBlock {
    attn: Attention,
    ffn: [Conv; 2],
}

impl Module for PsaBlock {
    type Config = usize;
    fn load(vb: VarBuilder, &c: &usize) -> Result<Self> {
        Ok(Self {
            attn: Attention::load(vb.pp("attn"), &(c, (c / 64).max(1)))?,
            ffn: [
                Conv::load(vb.pp("ffn").pp(0), &ConvSpec::new(c, 2 * c, 1))?,
                Conv::load(vb.pp("ffn").pp(1), &ConvSpec::new(2 * c, c, 1).no_act())?,
            ],
        })
    }
}

impl Forward for PsaBlock {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (x + &self.attn.forward(x)?)?;
        let f = self.ffn[1].forward(&self.ffn[0].forward(&x)?)?;
        &x + &f
    }
}

/// `C2PSA(c1, c2, n, e=0.5)`.
pub struct C2Psa {
    c: usize,
    cv1: Conv,
    cv2: Conv,
    m: Vec<PsaBlock>,
}

impl Module for C2Psa {
    /// (c1, n)
    type Config = (usize, usize);
    fn load(vb: VarBuilder, &(c1, n): &(usize, usize)) -> Result<Self> {
        let c = c1 / 2;
        Ok(Self {
            c,
            cv1: Conv::load(vb.pp("cv1"), &ConvSpec::new(c1, 2 * c, 1))?,
            cv2: Conv::load(vb.pp("cv2"), &ConvSpec::new(2 * c, c1, 1))?,
            m: (0..n).map(|i| PsaBlock::load(vb.pp("m").pp(i), &c)).collect::<Result<_>>()?,
        })
    }
}

impl Forward for C2Psa {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [a, mut b] = <[Tensor; 2]>::try_from(self.cv1.forward(x)?.split(&[self.c, self.c], 1)?).expect("two parts");
        for blk in &self.m {
            b = blk.forward(&b)?;
        }
        self.cv2.forward(&Tensor::cat(&[&a, &b], 1)?)
    }
}

// ---- Detect (ultralytics/nn/modules/head.py) ---------------------------------------------------

/// One `cv2[i]` / `cv3[i]`: two Convs (YOLO11's class branch: two DWConv + 1x1 Conv pairs, as
/// nested `nn.Sequential`s) and a plain 1x1 `nn.Conv2d` with bias.
pub struct Branch {
    convs: Vec<Conv>,
    out: Conv2d,
}

impl Branch {
    fn load(vb: VarBuilder, cin: usize, mid: usize, cout: usize, depthwise: bool) -> Result<Self> {
        let convs = if depthwise {
            vec![
                Conv::load(vb.pp(0).pp(0), &ConvSpec::new(cin, cin, 3).groups(cin))?,
                Conv::load(vb.pp(0).pp(1), &ConvSpec::new(cin, mid, 1))?,
                Conv::load(vb.pp(1).pp(0), &ConvSpec::new(mid, mid, 3).groups(mid))?,
                Conv::load(vb.pp(1).pp(1), &ConvSpec::new(mid, mid, 1))?,
            ]
        } else {
            vec![Conv::load(vb.pp(0), &ConvSpec::new(cin, mid, 3))?, Conv::load(vb.pp(1), &ConvSpec::new(mid, mid, 3))?]
        };
        Ok(Self { convs, out: Conv2d::load(vb.pp(2), &Conv2dConfig::new(mid, cout, 1))? })
    }
}

impl Forward for Branch {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = x.clone();
        for c in &self.convs {
            y = c.forward(&y)?;
        }
        self.out.forward(&y)
    }
}

/// `Detect(nc, ch)` in eval mode: per level a box branch (`cv2`, 4 x 16 DFL logits) and a class
/// branch (`cv3`); DFL (softmax over the 16 bins, then the 1x1 conv `dfl.conv` whose weights are
/// 0..15 in Ultralytics); `dist2bbox` to (cx, cy, w, h) around the anchor points (cell centres),
/// times the level's stride; sigmoid class scores.
///
/// The decode (everything after the branches: `<head>.decode.*` and `<head>.dfl`) is required in
/// FP32 (`Tracer::require_fp32`): in f16 each of its steps rounds coordinates up to 640 pixels to
/// 0.25-0.5 px, enough to flip NMS decisions of boxes whose overlap is near the IoU threshold
/// (96% of FP16 detections matched Ultralytics with it in f16). It is a few elementwise kernels.
pub struct Detect {
    path: String,
    nc: usize,
    strides: Vec<usize>,
    cv2: Vec<Branch>,
    cv3: Vec<Branch>,
    dfl: Conv2d,
}

impl Detect {
    fn load(vb: VarBuilder, nc: usize, ch: &[usize], depthwise: bool) -> Result<Self> {
        let c2 = 16.max(ch[0] / 4).max(4 * REG_MAX);
        let c3 = ch[0].max(nc.min(100));
        let cv2 =
            ch.iter().enumerate().map(|(i, &x)| Branch::load(vb.pp("cv2").pp(i), x, c2, 4 * REG_MAX, false)).collect::<Result<_>>()?;
        let cv3 = ch.iter().enumerate().map(|(i, &x)| Branch::load(vb.pp("cv3").pp(i), x, c3, nc, depthwise)).collect::<Result<_>>()?;
        Ok(Self {
            path: vb.path().to_string(),
            nc,
            strides: vec![8, 16, 32],
            cv2,
            cv3,
            dfl: Conv2d::load(vb.pp("dfl").pp("conv"), &Conv2dConfig::new(REG_MAX, 1, 1).bias(false))?,
        })
    }

    /// `make_anchors(feats, strides, 0.5)`, transposed: anchors `[1, 2, A]` (x then y, cell
    /// centres, row-major over each level), strides `[1, 1, A]`.
    fn anchors(&self, feats: &[[usize; 2]]) -> (HostTensor, HostTensor) {
        let total: usize = feats.iter().map(|[h, w]| h * w).sum();
        let (mut xy, mut st) = (vec![0f32; 2 * total], Vec::with_capacity(total));
        let mut a = 0;
        for (&[h, w], &s) in feats.iter().zip(&self.strides) {
            for y in 0..h {
                for x in 0..w {
                    xy[a] = x as f32 + 0.5;
                    xy[total + a] = y as f32 + 0.5;
                    st.push(s as f32);
                    a += 1;
                }
            }
        }
        (HostTensor::new(vec![1, 2, total], xy), HostTensor::new(vec![1, 1, total], st))
    }

    pub fn forward(&self, xs: &[&Tensor]) -> Result<Tensor> {
        let decode = format!("{}.decode", self.path);
        if let Some(x) = xs.first() {
            x.tracer().require_fp32(&decode);
            x.tracer().require_fp32(&format!("{}.dfl", self.path));
        }
        let flat = |t: Tensor| -> Result<Tensor> {
            let s = t.shape().to_vec();
            Ok(t.view(&[s[0] as isize, s[1] as isize, -1])?.in_scope(&decode))
        };
        let (mut boxes, mut scores, mut feats) = (Vec::new(), Vec::new(), Vec::new());
        for (i, x) in xs.iter().enumerate() {
            let s = x.shape();
            feats.push([s[2], s[3]]);
            boxes.push(flat(self.cv2[i].forward(x)?)?);
            scores.push(flat(self.cv3[i].forward(x)?)?);
        }
        let boxes = Tensor::cat(&boxes.iter().collect::<Vec<_>>(), 2)?;
        let scores = Tensor::cat(&scores.iter().collect::<Vec<_>>(), 2)?;
        let (n, a) = (boxes.shape()[0] as isize, boxes.shape()[2] as isize);
        // DFL: [N, 64, A] -> [N, 4, 16, A] -> [N, 16, 4, A], softmax over the bins, 1x1 conv.
        let bins = boxes.view(&[n, 4, REG_MAX as isize, a])?.transpose(2, 1)?.softmax(1)?;
        let dist = self.dfl.forward(&bins)?.view(&[n, 4, a])?;
        // dist2bbox(xywh=True, dim=1), times the strides.
        let (anchors, strides) = self.anchors(&feats);
        let anchors = Param { name: format!("{}.anchors", self.path), value: Arc::new(anchors) };
        let strides = Param { name: format!("{}.strides", self.path), value: Arc::new(strides) };
        let [lt, rb] = <[Tensor; 2]>::try_from(dist.chunk(2, 1)?).expect("two halves");
        let sub = kiln::plugin::Binary::Sub;
        let add = kiln::plugin::Binary::Add;
        // anchor - lt, written lt - anchor negated (IEEE subtraction is sign-symmetric).
        let x1y1 = lt.binary_weight(&format!("{decode}.x1y1"), sub, &anchors)?.affine(-1.0, 0.0)?;
        let x2y2 = rb.binary_weight(&format!("{decode}.x2y2"), add, &anchors)?;
        let c_xy = (&x1y1 + &x2y2)?.affine(0.5, 0.0)?;
        let wh = (&x2y2 - &x1y1)?;
        let dbox = Tensor::cat(&[&c_xy, &wh], 1)?.binary_weight(&format!("{decode}.stride"), kiln::plugin::Binary::Mul, &strides)?;
        debug_assert_eq!(scores.shape()[1], self.nc);
        Tensor::cat(&[&dbox, &scores.sigmoid()?], 1)
    }
}

// ---- the model: the yaml's rows ----------------------------------------------------------------

/// One yaml row's module, with its unscaled arguments.
#[derive(Clone, Copy, Debug)]
enum Row {
    /// `Conv, [c, k, s]`
    Conv(usize, usize, usize),
    /// `C2f, [c, shortcut]` repeated n
    C2f(usize, usize, bool),
    /// `C3k2, [c, c3k, e]` repeated n
    C3k2(usize, usize, bool, f64),
    /// `SPPF, [c, 5]`
    Sppf(usize),
    /// `C2PSA, [c]` repeated n
    C2Psa(usize, usize),
    /// `nn.Upsample, [None, 2, "nearest"]`
    Upsample,
    /// `Concat, [1]` of the previous row and this one
    Concat(usize),
    /// `Detect, [nc]` of these rows
    Detect([usize; 3]),
}

/// `yolov8.yaml`: backbone then head; `from` is -1 except for Concat / Detect.
const V8: &[Row] = &[
    Row::Conv(64, 3, 2),
    Row::Conv(128, 3, 2),
    Row::C2f(128, 3, true),
    Row::Conv(256, 3, 2),
    Row::C2f(256, 6, true),
    Row::Conv(512, 3, 2),
    Row::C2f(512, 6, true),
    Row::Conv(1024, 3, 2),
    Row::C2f(1024, 3, true),
    Row::Sppf(1024),
    Row::Upsample,
    Row::Concat(6),
    Row::C2f(512, 3, false),
    Row::Upsample,
    Row::Concat(4),
    Row::C2f(256, 3, false),
    Row::Conv(256, 3, 2),
    Row::Concat(12),
    Row::C2f(512, 3, false),
    Row::Conv(512, 3, 2),
    Row::Concat(9),
    Row::C2f(1024, 3, false),
    Row::Detect([15, 18, 21]),
];

/// `yolo11.yaml`.
const V11: &[Row] = &[
    Row::Conv(64, 3, 2),
    Row::Conv(128, 3, 2),
    Row::C3k2(256, 2, false, 0.25),
    Row::Conv(256, 3, 2),
    Row::C3k2(512, 2, false, 0.25),
    Row::Conv(512, 3, 2),
    Row::C3k2(512, 2, true, 0.5),
    Row::Conv(1024, 3, 2),
    Row::C3k2(1024, 2, true, 0.5),
    Row::Sppf(1024),
    Row::C2Psa(1024, 2),
    Row::Upsample,
    Row::Concat(6),
    Row::C3k2(512, 2, false, 0.5),
    Row::Upsample,
    Row::Concat(4),
    Row::C3k2(256, 2, false, 0.5),
    Row::Conv(256, 3, 2),
    Row::Concat(13),
    Row::C3k2(512, 2, false, 0.5),
    Row::Conv(512, 3, 2),
    Row::Concat(10),
    Row::C3k2(1024, 2, true, 0.5),
    Row::Detect([16, 19, 22]),
];

/// A built row.
enum Layer {
    Conv(Conv),
    C2f(C2f),
    Sppf(Sppf),
    C2Psa(C2Psa),
    Upsample(Upsample),
    Concat(usize),
    Detect(Detect, [usize; 3]),
}

/// A YOLOv8 / YOLO11 `DetectionModel`; `forward` returns `[N, 4 + classes, anchors]`.
pub struct Yolo {
    config: YoloConfig,
    model: Vec<Layer>,
}

impl Module for Yolo {
    type Config = YoloConfig;
    fn load(vb: VarBuilder, cfg: &YoloConfig) -> Result<Self> {
        let rows = match cfg.version {
            YoloVersion::V8 => V8,
            YoloVersion::V11 => V11,
        };
        let vb = vb.pp("model");
        let mut ch: Vec<usize> = Vec::with_capacity(rows.len());
        let mut model = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            let vb = vb.pp(i);
            let c1 = ch.last().copied().unwrap_or(3);
            let (layer, c2) = match *row {
                Row::Conv(c, k, s) => {
                    let c2 = cfg.channels(c);
                    (Layer::Conv(Conv::load(vb, &ConvSpec::new(c1, c2, k).stride(s))?), c2)
                }
                Row::C2f(c, n, shortcut) => {
                    let c2 = cfg.channels(c);
                    let spec = C2fSpec { c1, c2, n: cfg.repeats(n), shortcut, e: 0.5, c3k: None };
                    (Layer::C2f(C2f::load(vb, &spec)?), c2)
                }
                Row::C3k2(c, n, c3k, e) => {
                    let c2 = cfg.channels(c);
                    let c3k = Some(c3k || cfg.scale.c3k_everywhere);
                    let spec = C2fSpec { c1, c2, n: cfg.repeats(n), shortcut: true, e, c3k };
                    (Layer::C2f(C2f::load(vb, &spec)?), c2)
                }
                Row::Sppf(c) => {
                    let c2 = cfg.channels(c);
                    (Layer::Sppf(Sppf::load(vb, &(c1, c2))?), c2)
                }
                Row::C2Psa(c, n) => {
                    let c2 = cfg.channels(c);
                    if c1 != c2 {
                        return Err(Error::Shape {
                            path: vb.path().to_string(),
                            op: "C2PSA".into(),
                            reason: format!("C2PSA needs as many output channels as input channels, got {c1} in and {c2} out").into(),
                            got: vec![vec![c1], vec![c2]],
                        });
                    }
                    (Layer::C2Psa(C2Psa::load(vb, &(c1, cfg.repeats(n)))?), c2)
                }
                Row::Upsample => (Layer::Upsample(Upsample::load(vb, &UpsampleConfig::scale(2.0))?), c1),
                Row::Concat(j) => (Layer::Concat(j), c1 + ch[j]),
                Row::Detect(from) => {
                    let chans = from.map(|j| ch[j]);
                    let depthwise = cfg.version == YoloVersion::V11;
                    (Layer::Detect(Detect::load(vb, cfg.num_classes, &chans, depthwise)?, from), 4 * REG_MAX + cfg.num_classes)
                }
            };
            ch.push(c2);
            model.push(layer);
        }
        Ok(Self { config: *cfg, model })
    }
}

impl Yolo {
    pub fn config(&self) -> &YoloConfig {
        &self.config
    }
}

impl Forward for Yolo {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y: Vec<Tensor> = Vec::with_capacity(self.model.len());
        for layer in &self.model {
            let prev = y.last().unwrap_or(x);
            let out = match layer {
                Layer::Conv(m) => m.forward(prev)?,
                Layer::C2f(m) => m.forward(prev)?,
                Layer::Sppf(m) => m.forward(prev)?,
                Layer::C2Psa(m) => m.forward(prev)?,
                Layer::Upsample(m) => m.forward(prev)?,
                Layer::Concat(j) => Tensor::cat(&[prev, &y[*j]], 1)?,
                Layer::Detect(m, from) => m.forward(&from.map(|j| &y[j]))?,
            };
            y.push(out);
        }
        Ok(y.pop().expect("a Detect row"))
    }
}

/// `DetectionModel("yolov8n.yaml")`.
pub fn yolov8n(vb: VarBuilder) -> Result<Yolo> {
    Yolo::load(vb, &YoloConfig::new(YoloVersion::V8, 'n')?)
}
/// `DetectionModel("yolov8s.yaml")`.
pub fn yolov8s(vb: VarBuilder) -> Result<Yolo> {
    Yolo::load(vb, &YoloConfig::new(YoloVersion::V8, 's')?)
}
/// `DetectionModel("yolo11n.yaml")`.
pub fn yolo11n(vb: VarBuilder) -> Result<Yolo> {
    Yolo::load(vb, &YoloConfig::new(YoloVersion::V11, 'n')?)
}
/// `DetectionModel("yolo11s.yaml")`.
pub fn yolo11s(vb: VarBuilder) -> Result<Yolo> {
    Yolo::load(vb, &YoloConfig::new(YoloVersion::V11, 's')?)
}
