//! What structured codegen writes for one node: the Kiln layer a leaf module's call maps to (its
//! type and the config expression that loads it), or the Module DSL call of an op written inline
//! (`x.relu()?`, `(&a + &b)?`, `x.reshape(&[-1, 64, 49])?`), each with the values that may differ
//! between the calls of one struct (its *slots*), which become the struct's configuration.

use super::{f32_lit, float_lit, op_expr};
use crate::graph::{Activation, Binary, ConvAttrs, Gemm, Graph, NodeId, Norm, Op, Pool, Resize, ShapeOp, Unary};
use crate::ops::elementwise::{ConfigForm, FormArg};
use std::collections::BTreeSet;

/// A literal value of a slot.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Lit {
    Usize(usize),
    Isize(isize),
    F32(f32),
    F64(f64),
    Bool(bool),
    Pair([usize; 2]),
    Usizes(Vec<usize>),
    Isizes(Vec<isize>),
    I64s(Vec<i64>),
    /// A whole op, where an op varies in ways no DSL call names.
    Op(Op),
    /// A child struct's configuration: its type, and its knobs with their values.
    Config(String, Vec<(String, Lit)>),
    /// A `Vec` field's configurations (element type, one per element).
    Configs(String, Vec<Lit>),
    /// This call does not have the slot's statement (an absent optional child): matches anything.
    Absent,
}

impl Lit {
    /// The literal as an expression where a slice or array is expected (`[1, 2]`, used as `&[1, 2]`).
    pub fn expr(&self) -> String {
        match self {
            Lit::Usize(v) => v.to_string(),
            Lit::Isize(v) => v.to_string(),
            Lit::F32(v) => f32_lit(*v),
            Lit::F64(v) => float_lit(*v),
            Lit::Bool(v) => v.to_string(),
            Lit::Pair(v) => format!("[{}, {}]", v[0], v[1]),
            Lit::Usizes(v) => list(v),
            Lit::Isizes(v) => list(v),
            Lit::I64s(v) => list(v),
            Lit::Op(op) => op_expr(op, &mut BTreeSet::new()).map(|d| d.flat()).unwrap_or_else(|e| format!("/* {e} */")),
            Lit::Config(ty, fields) if fields.is_empty() => format!("{ty} {{}}"),
            Lit::Config(ty, fields) => {
                format!("{ty} {{ {} }}", fields.iter().map(|(k, v)| format!("{k}: {}", v.value())).collect::<Vec<_>>().join(", "))
            }
            Lit::Configs(_, items) => format!("[{}]", items.iter().map(Lit::value).collect::<Vec<_>>().join(", ")),
            Lit::Absent => "Default::default()".into(),
        }
    }

    /// The literal as the value of a config field of type `ty()` (`vec![1, 2]` for a list).
    pub fn value(&self) -> String {
        match self {
            Lit::Usizes(_) | Lit::Isizes(_) | Lit::I64s(_) | Lit::Configs(..) => format!("vec!{}", self.expr()),
            _ => self.expr(),
        }
    }

    /// The Rust type of a config field holding this literal.
    pub fn ty(&self) -> String {
        match self {
            Lit::Usize(_) => "usize".into(),
            Lit::Isize(_) => "isize".into(),
            Lit::F32(_) => "f32".into(),
            Lit::F64(_) => "f64".into(),
            Lit::Bool(_) => "bool".into(),
            Lit::Pair(_) => "[usize; 2]".into(),
            Lit::Usizes(_) => "Vec<usize>".into(),
            Lit::Isizes(_) => "Vec<isize>".into(),
            Lit::I64s(_) => "Vec<i64>".into(),
            Lit::Op(_) => "Op".into(),
            Lit::Config(ty, _) => ty.clone(),
            Lit::Configs(ty, _) => format!("Vec<{ty}>"),
            Lit::Absent => "()".into(),
        }
    }

    /// Whether a field of this type is `Copy` (otherwise the config struct is only `Clone`).
    pub fn is_copy(&self) -> bool {
        match self {
            Lit::Usizes(_) | Lit::Isizes(_) | Lit::I64s(_) | Lit::Op(_) | Lit::Configs(..) => false,
            Lit::Config(_, fields) => fields.iter().all(|(_, v)| v.is_copy()),
            _ => true,
        }
    }

    /// Equal, or one of them absent.
    pub fn matches(&self, other: &Lit) -> bool {
        matches!(self, Lit::Absent) || matches!(other, Lit::Absent) || self == other
    }
}

fn list<T: std::fmt::Display>(v: &[T]) -> String {
    format!("[{}]", v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", "))
}

/// A value that may differ between calls: a name for it, and its value in this call.
#[derive(Clone, Debug)]
pub(super) struct Slot {
    pub hint: String,
    pub lit: Lit,
}

fn slot(hint: &str, lit: Lit) -> Slot {
    Slot { hint: hint.to_string(), lit }
}

/// A slot as written: a literal, or a config field (`cfg.stride`, `self.dims`).
#[derive(Clone, Debug)]
pub(super) struct R {
    pub text: String,
    /// The slot is a literal equal to its default (the builder call can be left out).
    pub literal: Option<Lit>,
}

impl R {
    fn is(&self, lit: &Lit) -> bool {
        self.literal.as_ref() == Some(lit)
    }
}

/// The operands of an inline op as written: each input as a method receiver (`x`) and by
/// reference (`&x`), and each weight (`&self.pos_embedding`).
#[derive(Clone, Debug, Default)]
pub(super) struct Operands {
    pub recv: Vec<String>,
    pub by_ref: Vec<String>,
    pub params: Vec<String>,
}

type Render = Box<dyn Fn(&[R], &Operands) -> String>;

/// Something written with slots: a layer's config expression or an inline op's expression.
pub(super) struct Tpl {
    pub slots: Vec<Slot>,
    pub render: Render,
}

impl Tpl {
    fn new(slots: Vec<Slot>, render: impl Fn(&[R], &Operands) -> String + 'static) -> Self {
        Self { slots, render: Box::new(render) }
    }
}

/// The Kiln layer a leaf module's one node maps to.
pub(super) struct LayerSpec {
    pub ty: &'static str,
    /// The config expression (`None`: the layer's default, `()` for activations).
    pub config: Option<Tpl>,
}

fn spec(ty: &'static str, config: Option<Tpl>) -> Option<LayerSpec> {
    Some(LayerSpec { ty, config })
}

/// The weights of node `id` are exactly `path.<names>` in this order.
fn weights_are(g: &Graph, id: NodeId, path: &str, names: &[&str]) -> bool {
    let ws: Vec<&str> = g.nodes[id]
        .inputs
        .iter()
        .filter_map(|&i| match &g.nodes[i].op {
            Op::Weight { name, .. } => Some(name.as_str()),
            _ => None,
        })
        .collect();
    ws.len() == names.len() && ws.iter().zip(names).all(|(w, n)| *w == format!("{path}.{n}"))
}

fn square(v: [usize; 2]) -> Option<usize> {
    (v[0] == v[1]).then_some(v[0])
}

/// The layer node `id` is the one call of, for a leaf module at `path`; `None` when no Kiln layer
/// is that op (the module is then written with its ops inline).
pub(super) fn layer(g: &Graph, id: NodeId, path: &str) -> Option<LayerSpec> {
    let node = &g.nodes[id];
    let w = |i: usize| node.inputs.get(i).map(|&n| g.nodes[n].shape.as_slice());
    match &node.op {
        Op::Conv(a) => conv(g, id, path, a, w(1)?),
        Op::Norm(Norm::BatchNorm2d { eps }) if weights_are(g, id, path, &["weight", "bias", "running_mean", "running_var"]) => {
            let slots = vec![slot("channels", Lit::Usize(w(1)?[0])), slot("eps", Lit::F32(*eps))];
            spec(
                "BatchNorm2d",
                Some(Tpl::new(slots, |s, _| match s[1].is(&Lit::F32(1e-5)) {
                    true => format!("BatchNorm2dConfig::new({})", s[0].text),
                    false => format!("BatchNorm2dConfig {{ eps: {}, ..BatchNorm2dConfig::new({}) }}", s[1].text, s[0].text),
                })),
            )
        }
        Op::Gemm(Gemm::Linear { bias, residual: false })
            if weights_are(g, id, path, if *bias { &["weight", "bias"] } else { &["weight"] }) =>
        {
            let ws = w(1)?;
            let slots =
                vec![slot("in_features", Lit::Usize(ws[1])), slot("out_features", Lit::Usize(ws[0])), slot("bias", Lit::Bool(*bias))];
            spec(
                "Linear",
                Some(Tpl::new(slots, |s, _| match s[2].is(&Lit::Bool(true)) {
                    true => format!("LinearConfig::new({}, {})", s[0].text, s[1].text),
                    false => format!("LinearConfig {{ bias: {}, ..LinearConfig::new({}, {}) }}", s[2].text, s[0].text, s[1].text),
                })),
            )
        }
        Op::Norm(Norm::LayerNorm { dim, shape, eps, affine }) => layer_norm(g, id, path, *dim, shape, *eps, *affine),
        _ if node.inputs.len() != 1 => None,
        Op::Unary(u) => activation(*u),
        Op::Pool(Pool::Max(a)) | Op::Pool(Pool::Avg(a)) => pool(&node.op, a),
        Op::Pool(Pool::AdaptiveAvg { output }) => {
            spec("AdaptiveAvgPool2d", Some(Tpl::new(vec![slot("output_size", Lit::Pair(*output))], |s, _| s[0].text.clone())))
        }
        Op::Norm(Norm::Softmax { dim }) => {
            spec("Softmax", Some(Tpl::new(vec![slot("dim", Lit::Isize(*dim as isize))], |s, _| s[0].text.clone())))
        }
        Op::Resize(r) => spec("Upsample", Some(upsample(r))),
        _ => None,
    }
}

/// `LayerNorm` over the trailing dims, or torchvision's `LayerNorm2d` over the channels.
fn layer_norm(g: &Graph, id: NodeId, path: &str, dim: usize, shape: &[usize], eps: f32, affine: bool) -> Option<LayerSpec> {
    let node = &g.nodes[id];
    let names: &[&str] = if affine { &["weight", "bias"] } else { &[] };
    let ty = if dim + shape.len() == node.shape.len() {
        "LayerNorm"
    } else if dim == 1 && shape.len() == 1 {
        "LayerNorm2d"
    } else {
        return None;
    };
    if !weights_are(g, id, path, names) {
        return None;
    }
    let slots = vec![slot("normalized_shape", Lit::Usizes(shape.to_vec())), slot("eps", Lit::F32(eps)), slot("affine", Lit::Bool(affine))];
    spec(
        ty,
        Some(Tpl::new(slots, |s, _| {
            let mut e = format!("LayerNormConfig::new(&{})", s[0].text);
            if !s[1].is(&Lit::F32(1e-5)) {
                e += &format!(".eps({})", s[1].text);
            }
            if !s[2].is(&Lit::Bool(true)) {
                e += &format!(".elementwise_affine({})", s[2].text);
            }
            e
        })),
    )
}

fn conv(g: &Graph, id: NodeId, path: &str, a: &ConvAttrs, w: &[usize]) -> Option<LayerSpec> {
    if a.residual || a.act != Activation::None || a.pool.is_some() || w.len() != 4 || w[2] != w[3] {
        return None;
    }
    if !weights_are(g, id, path, if a.bias { &["weight", "bias"] } else { &["weight"] }) {
        return None;
    }
    let (stride, padding, dilation) = (square(a.stride)?, square(a.padding)?, square(a.dilation)?);
    let output_padding = square(a.output_padding)?;
    let (cin, cout) = if a.transposed { (w[0], w[1] * a.groups) } else { (w[1] * a.groups, w[0]) };
    let slots = vec![
        slot("in_channels", Lit::Usize(cin)),
        slot("out_channels", Lit::Usize(cout)),
        slot("kernel_size", Lit::Usize(w[2])),
        slot("stride", Lit::Usize(stride)),
        slot("padding", Lit::Usize(padding)),
        slot("dilation", Lit::Usize(dilation)),
        slot("groups", Lit::Usize(a.groups)),
        slot("bias", Lit::Bool(a.bias)),
        slot("output_padding", Lit::Usize(output_padding)),
    ];
    let render = |s: &[R], _: &Operands| {
        let mut e = format!("Conv2dConfig::new({}, {}, {})", s[0].text, s[1].text, s[2].text);
        let defaults = [Lit::Usize(1), Lit::Usize(0), Lit::Usize(1), Lit::Usize(1), Lit::Bool(true), Lit::Usize(0)];
        for (i, (name, default)) in ["stride", "padding", "dilation", "groups", "bias", "output_padding"].iter().zip(defaults).enumerate() {
            if !s[3 + i].is(&default) {
                e += &format!(".{name}({})", s[3 + i].text);
            }
        }
        e
    };
    spec(if a.transposed { "ConvTranspose2d" } else { "Conv2d" }, Some(Tpl::new(slots, render)))
}

/// The layer of an activation, as its family's form of it says (`Unary::form`).
fn activation(u: Unary) -> Option<LayerSpec> {
    let layer = u.form().layer?;
    let slots: Vec<Slot> = layer.args.iter().map(|&(name, v)| slot(name, form_lit(v))).collect();
    let config = match layer.config {
        ConfigForm::Unit => None,
        ConfigForm::Value => Some(Tpl::new(slots, |s, _| s[0].text.clone())),
        ConfigForm::Tuple => Some(Tpl::new(slots, |s, _| format!("({})", texts(s).join(", ")))),
        ConfigForm::Struct(ty) => {
            let names: Vec<&'static str> = layer.args.iter().map(|(name, _)| *name).collect();
            Some(Tpl::new(slots, move |s, _| {
                let fields: Vec<String> = names.iter().zip(texts(s)).map(|(n, v)| format!("{n}: {v}")).collect();
                format!("{ty} {{ {} }}", fields.join(", "))
            }))
        }
    };
    Some(LayerSpec { ty: layer.ty, config })
}

fn form_lit(v: FormArg) -> Lit {
    match v {
        FormArg::F32(v) => Lit::F32(v),
        FormArg::Bool(v) => Lit::Bool(v),
    }
}

fn texts(s: &[R]) -> Vec<&str> {
    s.iter().map(|r| r.text.as_str()).collect()
}

fn pool(op: &Op, a: &crate::graph::PoolAttrs) -> Option<LayerSpec> {
    let (k, s, p) = (square(a.kernel)?, square(a.stride)?, square(a.padding)?);
    let slots = vec![
        slot("kernel_size", Lit::Usize(k)),
        slot("stride", Lit::Usize(s)),
        slot("padding", Lit::Usize(p)),
        slot("ceil_mode", Lit::Bool(a.ceil_mode)),
        slot("count_include_pad", Lit::Bool(a.count_include_pad)),
    ];
    let max = matches!(op, Op::Pool(Pool::Max(_)));
    let render = move |s: &[R], _: &Operands| {
        let mut e = format!("Pool2dConfig::new({})", s[0].text);
        if s[1].text != s[0].text {
            e += &format!(".stride({})", s[1].text);
        }
        if !s[2].is(&Lit::Usize(0)) {
            e += &format!(".padding({})", s[2].text);
        }
        if !s[3].is(&Lit::Bool(false)) {
            e += &format!(".ceil_mode({})", s[3].text);
        }
        if !max && !s[4].is(&Lit::Bool(true)) {
            e = format!("Pool2dConfig {{ count_include_pad: {}, ..{e} }}", s[4].text);
        }
        e
    };
    spec(if max { "MaxPool2d" } else { "AvgPool2d" }, Some(Tpl::new(slots, render)))
}

/// `UpsampleConfig::size(h, w)` / `::scale2(sh, sw)`, `.bilinear(align_corners)`.
fn upsample(r: &Resize) -> Tpl {
    let (size, scale, bilinear, ac) = match *r {
        Resize::Nearest { size, scale } => (size, scale, false, false),
        Resize::Bilinear { size, scale, align_corners } => (size, scale, true, align_corners),
    };
    let mut slots = match (size, scale) {
        (Some([h, w]), _) => vec![slot("height", Lit::Usize(h)), slot("width", Lit::Usize(w))],
        (None, Some([h, w])) => vec![slot("scale_h", Lit::F64(h)), slot("scale_w", Lit::F64(w))],
        (None, None) => vec![slot("height", Lit::Usize(0)), slot("width", Lit::Usize(0))],
    };
    slots.push(slot("align_corners", Lit::Bool(ac)));
    let by_size = size.is_some();
    Tpl::new(slots, move |s, _| {
        let mut e = if by_size {
            format!("UpsampleConfig::size({}, {})", s[0].text, s[1].text)
        } else if s[0].text == s[1].text {
            format!("UpsampleConfig::scale({})", s[0].text)
        } else {
            format!("UpsampleConfig::scale2({}, {})", s[0].text, s[1].text)
        };
        if bilinear {
            e += &format!(".bilinear({})", s[2].text);
        }
        e
    })
}

/// The Module DSL expression of an op written inline, with `?` (Kiln's `Tensor` methods and
/// operators where one names the op, `Tensor::record` otherwise).
pub(super) fn inline(op: &Op, n_args: usize, n_params: usize) -> Tpl {
    let name = op.name().to_string();
    match (op, n_args, n_params) {
        (Op::Unary(u), 1, 0) => unary(*u),
        (Op::Binary(b), 2, 0) => {
            let sym = match b {
                Binary::Add => "+",
                Binary::Sub => "-",
                Binary::Mul => "*",
                Binary::Div => "/",
            };
            Tpl::new(vec![], move |_, o| format!("({} {sym} {})?", o.by_ref[0], o.by_ref[1]))
        }
        (Op::Binary(b), 1, 1) => {
            let b = format!("{b:?}");
            Tpl::new(vec![], move |_, o| {
                format!("{}.binary_weight(&{}.scope_path({:?}), Binary::{b}, {})?", o.recv[0], o.recv[0], b.to_lowercase(), o.params[0])
            })
        }
        (Op::Shape(s), _, 0) => shape(s, n_args).unwrap_or_else(|| record(op, name)),
        (Op::Pool(Pool::Mean { dims, keepdim }), 1, 0) => {
            let slots = vec![slot("dims", Lit::Usizes(dims.clone())), slot("keepdim", Lit::Bool(*keepdim))];
            Tpl::new(slots, |s, o| format!("{}.mean(&{}, {})?", o.recv[0], s[0].text, s[1].text))
        }
        (Op::Pool(Pool::AdaptiveAvg { output }), 1, 0) => {
            Tpl::new(vec![slot("output_size", Lit::Pair(*output))], |s, o| format!("{}.adaptive_avg_pool2d({})?", o.recv[0], s[0].text))
        }
        (Op::Norm(Norm::Softmax { dim }), 1, 0) => {
            Tpl::new(vec![slot("dim", Lit::Isize(*dim as isize))], |s, o| format!("{}.softmax({})?", o.recv[0], s[0].text))
        }
        (Op::Gemm(Gemm::Matmul), 2, 0) => Tpl::new(vec![], |_, o| format!("{}.matmul({})?", o.recv[0], o.by_ref[1])),
        (Op::Gemm(Gemm::Matmul), 1, 1) => {
            Tpl::new(vec![], |_, o| format!("{}.matmul_weight(&{}.scope_path(\"matmul\"), {})?", o.recv[0], o.recv[0], o.params[0]))
        }
        (Op::Resize(r), 1, 0) => {
            let up = upsample(r);
            let slots = up.slots.clone();
            Tpl::new(slots, move |s, o| format!("{}.interpolate(&{})?", o.recv[0], (up.render)(s, o)))
        }
        (Op::QkvAttention(a), 1, 0) => {
            let slots = vec![slot("heads", Lit::Usize(a.heads)), slot("scale", Lit::F32(a.scale))];
            Tpl::new(slots, |s, o| format!("{}.qkv_attention({}, None, Some({}))?", o.recv[0], s[0].text, s[1].text))
        }
        (Op::QkvAttention(a), 1, 1) => {
            let slots = vec![slot("heads", Lit::Usize(a.heads)), slot("scale", Lit::F32(a.scale))];
            Tpl::new(slots, |s, o| {
                let (x, p) = (&o.recv[0], &o.params[0]);
                format!("{x}.qkv_attention_weight(&{x}.scope_path(\"qkv_attention\"), {}, {p}, Some({}))?", s[0].text, s[1].text)
            })
        }
        (Op::Attention(a), _, _) if matches!((n_args, n_params), (3 | 4, 0) | (3, 1)) => attention(a.scale, n_params),
        _ => record(op, name),
    }
}

/// `q.attention(k, v, bias, scale)`, or `attention_weight` with a constant bias.
fn attention(scale: f32, n_params: usize) -> Tpl {
    if n_params == 0 {
        return Tpl::new(vec![slot("scale", Lit::F32(scale))], |s, o| {
            let bias = o.by_ref.get(3).map_or("None".to_string(), |b| format!("Some({b})"));
            format!("{}.attention({}, {}, {bias}, Some({}))?", o.recv[0], o.by_ref[1], o.by_ref[2], s[0].text)
        });
    }
    Tpl::new(vec![slot("scale", Lit::F32(scale))], |s, o| {
        let x = &o.recv[0];
        format!(
            "{x}.attention_weight(&{x}.scope_path(\"attention\"), {}, {}, {}, Some({}))?",
            o.by_ref[1], o.by_ref[2], o.params[0], s[0].text
        )
    })
}

/// `x.<method>(args)?`, as the activation's family's form of it says (`Unary::form`).
fn unary(u: Unary) -> Tpl {
    let form = u.form();
    let slots = form.args.iter().map(|&(name, v)| slot(name, form_lit(v))).collect();
    let method = form.method;
    Tpl::new(slots, move |s, o| format!("{}.{method}({})?", o.recv[0], texts(s).join(", ")))
}

fn shape(s: &ShapeOp, n_args: usize) -> Option<Tpl> {
    if n_args != 1 && !matches!(s, ShapeOp::Cat { .. }) {
        return None;
    }
    let isizes = |v: &[usize]| Lit::Isizes(v.iter().map(|&d| d as isize).collect());
    Some(match s {
        ShapeOp::Flatten { start } => {
            Tpl::new(vec![slot("start", Lit::Usize(*start))], |s, o| format!("{}.flatten({})?", o.recv[0], s[0].text))
        }
        ShapeOp::Reshape { dims } => {
            let dims: Vec<isize> = std::iter::once(-1).chain(dims.iter().map(|&d| d as isize)).collect();
            Tpl::new(vec![slot("dims", Lit::Isizes(dims))], |s, o| format!("{}.reshape(&{})?", o.recv[0], s[0].text))
        }
        ShapeOp::Permute { dims } => Tpl::new(vec![slot("dims", isizes(dims))], |s, o| format!("{}.permute(&{})?", o.recv[0], s[0].text)),
        ShapeOp::Slice { dim, start, len } => {
            let slots = vec![slot("dim", Lit::Isize(*dim as isize)), slot("start", Lit::Usize(*start)), slot("len", Lit::Usize(*len))];
            Tpl::new(slots, |s, o| format!("{}.narrow({}, {}, {})?", o.recv[0], s[0].text, s[1].text, s[2].text))
        }
        ShapeOp::Cat { dim } => {
            Tpl::new(vec![slot("dim", Lit::Usize(*dim))], |s, o| format!("Tensor::cat(&[{}], {})?", o.by_ref.join(", "), s[0].text))
        }
        ShapeOp::Pad { pads, value } => Tpl::new(vec![slot("pads", isizes(pads)), slot("value", Lit::F32(*value))], |s, o| {
            format!("{}.pad(&{}, {})?", o.recv[0], s[0].text, s[1].text)
        }),
        ShapeOp::Roll { shifts, dims } => Tpl::new(vec![slot("shifts", Lit::I64s(shifts.clone())), slot("dims", isizes(dims))], |s, o| {
            format!("{}.roll(&{}, &{})?", o.recv[0], s[0].text, s[1].text)
        }),
        ShapeOp::ReflectPad { pads } => {
            Tpl::new(vec![slot("pads", Lit::Usizes(pads.clone()))], |s, o| format!("{}.reflection_pad(&{})?", o.recv[0], s[0].text))
        }
        ShapeOp::ReplicatePad { pads } => {
            Tpl::new(vec![slot("pads", Lit::Usizes(pads.clone()))], |s, o| format!("{}.replication_pad(&{})?", o.recv[0], s[0].text))
        }
    })
}

/// `Tensor::record(&x.scope_path("<op>"), <op>, &[inputs], &[weights])?`: any op, named in the
/// scope of its first input, as the Module DSL's inline ops are.
fn record(op: &Op, name: String) -> Tpl {
    Tpl::new(vec![slot("op", Lit::Op(op.clone()))], move |s, o| {
        format!(
            "Tensor::record(&{}.scope_path({name:?}), {}, &[{}], &[{}])?",
            o.recv[0],
            s[0].text,
            o.by_ref.join(", "),
            o.params.join(", ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `t` written with its slots as literals, on the operand `x`.
    fn written(t: &Tpl) -> String {
        let slots: Vec<R> = t.slots.iter().map(|s| R { text: s.lit.expr(), literal: Some(s.lit.clone()) }).collect();
        let operands = Operands { recv: vec!["x".into()], by_ref: vec!["&x".into()], params: vec![] };
        (t.render)(&slots, &operands)
    }

    #[test]
    fn activations_are_written_as_their_forms_say() {
        let cases = [
            (
                Unary::Softplus { beta: 2.0, threshold: 1.5 },
                "x.softplus(2.0, 1.5)?",
                Some(("Softplus", "SoftplusConfig { beta: 2.0, threshold: 1.5 }")),
            ),
            (Unary::Elu { alpha: 0.5 }, "x.elu(0.5)?", Some(("ELU", "ELUConfig { alpha: 0.5 }"))),
            (Unary::Mish, "x.mish()?", Some(("Mish", "()"))),
            (Unary::Clamp { min: 0.0, max: 6.0 }, "x.clamp(0.0, 6.0)?", Some(("ReLU6", "()"))),
            (Unary::Clamp { min: -2.0, max: 3.0 }, "x.clamp(-2.0, 3.0)?", Some(("Hardtanh", "(-2.0, 3.0)"))),
            (Unary::Gelu { tanh: true }, "x.gelu(true)?", Some(("GELU", "true"))),
            (Unary::LeakyRelu { slope: 0.25 }, "x.leaky_relu(0.25)?", Some(("LeakyReLU", "LeakyReLUConfig { negative_slope: 0.25 }"))),
            (Unary::Pow { exponent: 2.0 }, "x.pow(2.0)?", None),
            (Unary::Exp, "x.exp()?", None),
        ];
        for (op, inline_form, layer_form) in cases {
            assert_eq!(written(&unary(op)), inline_form, "{op:?}");
            let layer = activation(op).map(|l| (l.ty, l.config.as_ref().map_or("()".to_string(), written)));
            assert_eq!(layer, layer_form.map(|(ty, config)| (ty, config.to_string())), "{op:?}");
        }
        let names = Unary::layer_names();
        for name in ["ELU", "ELUConfig", "Mish", "Softplus", "SoftplusConfig", "ReLU", "LeakyReLUConfig"] {
            assert!(names.contains(&name), "{name} is not among the names generated code may import: {names:?}");
        }
    }
}
