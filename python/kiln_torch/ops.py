"""The op table: every ATen op Kiln imports, and how it becomes Kiln ops. Pure Python (no torch),
so the table is tested without PyTorch (python/tests/test_ops.py).

Each converter is `fn(cx, a)`: `a` holds the ATen op's arguments by schema name (activations as
`Act`, constants as `Const`, everything else as Python values), and `cx` (`convert.Builder`)
pushes Kiln nodes. A converter returns the op's value (an `Act`, a tuple for ops with several
outputs), or raises `Unsupported` with the reason. Kiln's ops are written in their serde form, as
Kiln's `Graph` JSON holds them (src/ops/*.rs).
"""

from __future__ import annotations

import math

import numpy as np

from .graph import Act, Const


def to_numpy_(v):
    from .convert import to_numpy

    return to_numpy(v)


class Unsupported(Exception):
    """This node cannot become Kiln ops; the message says why (shown in the export report)."""


# ---- Kiln ops in their serde form

F32_MAX = 3.4028234663852886e38


def conv(stride, padding, dilation, groups, bias, transposed=False, output_padding=(0, 0)):
    return {
        "Conv": {
            "transposed": transposed,
            "stride": list(stride),
            "padding": list(padding),
            "dilation": list(dilation),
            "groups": int(groups),
            "output_padding": list(output_padding),
            "bias": bool(bias),
            "residual": False,
            "act": "None",
        }
    }


def unary(name, **attrs):
    """`Unary::Relu` is `"Relu"`; a variant with fields is `{"Clamp": {"min": .., "max": ..}}`."""
    return {"Unary": {name: attrs} if attrs else name}


def binary(name):
    return {"Binary": name}


def affine(scale, shift):
    return unary("Affine", scale=float(scale), shift=float(shift))


def clamp(lo, hi):
    lo = -F32_MAX if lo is None or lo == -math.inf else float(lo)
    hi = F32_MAX if hi is None or hi == math.inf else float(hi)
    return unary("Clamp", min=lo, max=hi)


def shape_op(name, **attrs):
    return {"Shape": {name: attrs}}


def pool(kind, kernel, stride, padding, ceil_mode=False, count_include_pad=True):
    attrs = {"kernel": list(kernel), "stride": list(stride), "padding": list(padding), "ceil_mode": bool(ceil_mode)}
    attrs["count_include_pad"] = bool(count_include_pad)
    return {"Pool": {kind: attrs}}


def custom(name, attrs):
    return {"Custom": {"name": name, "attrs": {k: float(v) for k, v in sorted(attrs.items())}}}


# ---- argument helpers


def pair(v, what="value"):
    """A PyTorch int-or-pair argument as `[a, b]` (`3` and `[3]` are `[3, 3]`)."""
    if isinstance(v, (int, float)):
        return [int(v), int(v)]
    v = list(v)
    if len(v) == 1:
        return [int(v[0])] * 2
    if len(v) != 2:
        raise Unsupported(f"{what} {v} is not 2-D (Kiln's convolutions and pooling are 2-D)")
    return [int(x) for x in v]


def norm_dim(d, rank):
    d = int(d)
    if not -rank <= d < max(rank, 1):
        raise Unsupported(f"dim {d} is out of range for rank {rank}")
    return d % rank if rank else 0


def is_act(v):
    return isinstance(v, Act)


def act(v, what="input"):
    if isinstance(v, Act):
        return v
    if isinstance(v, Const):
        raise Unsupported(f"its {what} is a constant where Kiln needs an activation")
    raise Unsupported(f"its {what} is {v!r}, not a tensor")


def const(v, what):
    if isinstance(v, Const):
        return v
    if isinstance(v, Act):
        raise Unsupported(f"its {what} is computed from the input; Kiln needs it constant (a parameter or buffer)")
    raise Unsupported(f"its {what} is {v!r}, not a tensor")


def is_scalar(v):
    return isinstance(v, (int, float, bool)) and not isinstance(v, Act)


def scalar_of(v):
    """A Python number, or a one-element constant read as one."""
    if is_scalar(v):
        return float(v)
    if isinstance(v, Const) and v.value.size == 1:
        return float(np.asarray(v.value).reshape(()))
    return None


# ---- the table

TABLE: dict = {}


def aten(*names):
    """Registers a converter under one or more ATen op names (`aten.relu.default`)."""

    def register(fn):
        for name in names:
            if name in TABLE:
                raise ValueError(f"{name} is registered twice")
            TABLE[name] = fn
        return fn

    return register


def lookup(name: str):
    return TABLE.get(name)


# Ops that are the identity at inference, or copies Kiln does not need.
IDENTITY = (
    "aten.clone.default",
    "aten.alias.default",
    "aten.contiguous.default",
    "aten.detach.default",
    "aten.lift_fresh_copy.default",
    "aten.dropout.default",
    "aten.feature_dropout.default",
    "aten.alpha_dropout.default",
)


@aten(*IDENTITY)
def identity(cx, a):
    return a.get("self", a.get("input"))


@aten("aten._assert_tensor_metadata.default")
def assert_tensor_metadata(cx, a):
    """A check torch.export writes before a cast (`argmax(..).float()`); it computes nothing."""
    return None


@aten("aten._to_copy.default", "aten.to.dtype", "aten.type_as.default")
def to_copy(cx, a):
    dtype = a.get("dtype")
    if dtype not in (None, "float32", "torch.float32"):
        raise Unsupported(f"a cast to {dtype}: Kiln computes in f32 (graph inputs may be u8)")
    return a["self"]


# -- activations

SIMPLE_UNARY = {
    "aten.relu.default": "Relu",
    "aten.sigmoid.default": "Sigmoid",
    "aten.silu.default": "Silu",
    "aten.hardswish.default": "Hardswish",
    "aten.hardsigmoid.default": "Hardsigmoid",
    "aten.tanh.default": "Tanh",
    "aten.asinh.default": "Asinh",
    "aten.exp.default": "Exp",
    "aten.log.default": "Log",
    "aten.sqrt.default": "Sqrt",
    "aten.rsqrt.default": "Rsqrt",
    "aten.reciprocal.default": "Reciprocal",
    "aten.abs.default": "Abs",
    "aten.erf.default": "Erf",
    "aten.mish.default": "Mish",
}


def _simple(kind):
    return lambda cx, a: cx.node(unary(kind), [act(a["self"])], kind.lower())


for _name, _kind in SIMPLE_UNARY.items():
    aten(_name)(_simple(_kind))


@aten("aten.gelu.default")
def gelu(cx, a):
    return cx.node(unary("Gelu", tanh=a.get("approximate", "none") == "tanh"), [act(a["self"])], "gelu")


@aten("aten.leaky_relu.default")
def leaky_relu(cx, a):
    return cx.node(unary("LeakyRelu", slope=float(a.get("negative_slope", 0.01))), [act(a["self"])], "leaky_relu")


@aten("aten.hardtanh.default")
def hardtanh(cx, a):
    return cx.node(clamp(a.get("min_val", -1.0), a.get("max_val", 1.0)), [act(a["self"])], "clamp")


@aten("aten.relu6.default")
def relu6(cx, a):
    return cx.node(clamp(0.0, 6.0), [act(a["self"])], "clamp")


@aten("aten.clamp.default", "aten.clamp_min.default", "aten.clamp_max.default")
def clamp_op(cx, a):
    lo, hi = a.get("min"), a.get("max")
    if any(v is not None and not is_scalar(v) for v in (lo, hi)):
        raise Unsupported("clamp with tensor bounds (Kiln's clamp takes numbers)")
    return cx.node(clamp(lo, hi), [act(a["self"])], "clamp")


@aten("aten.elu.default")
def elu(cx, a):
    """`F.elu`, and SELU / CELU as PyTorch writes them: `scale * elu(input_scale * x, alpha)`."""
    x = act(a["self"])
    scale, input_scale = float(a.get("scale", 1.0)), float(a.get("input_scale", 1.0))
    if input_scale != 1.0:
        x = cx.node(affine(input_scale, 0.0), [x], "affine", tshape=x.tshape)
    y = cx.node(unary("Elu", alpha=float(a.get("alpha", 1.0))), [x], "elu", tshape=x.tshape)
    return y if scale == 1.0 else cx.node(affine(scale, 0.0), [y], "affine")


@aten("aten.softplus.default")
def softplus(cx, a):
    """`F.softplus(x, beta, threshold)`: `log1p(exp(beta * x)) / beta`, and `x` where `beta * x > threshold`."""
    attrs = {"beta": float(a.get("beta", 1.0)), "threshold": float(a.get("threshold", 20.0))}
    return cx.node(unary("Softplus", **attrs), [act(a["self"])], "softplus")


@aten("aten.pow.Tensor_Scalar")
def pow_scalar(cx, a):
    e = scalar_of(a["exponent"])
    if e is None:
        raise Unsupported("pow with a tensor exponent (Kiln's pow takes a number)")
    x = act(a["self"])
    if e == 1.0:
        return x
    return cx.node(unary("Pow", exponent=float(e)), [x], "pow")


@aten("aten.neg.default")
def neg(cx, a):
    return cx.node(affine(-1.0, 0.0), [act(a["self"])], "affine")


# -- arithmetic


def _scalar_affine(cx, op, x, s, reverse=False):
    """`x op s` (or `s op x`) with a number `s`, as one `x * scale + shift`."""
    if not reverse and ((op in ("Add", "Sub") and s == 0.0) or (op in ("Mul", "Div") and s == 1.0)):
        return x  # exact: PyTorch's `1.0 / x` is `reciprocal(x) * 1.0`
    if op == "Add":
        return cx.node(affine(1.0, s), [x], "affine")
    if op == "Sub":
        return cx.node(affine(-1.0, s) if reverse else affine(1.0, -s), [x], "affine")
    if op == "Mul":
        return cx.node(affine(s, 0.0), [x], "affine")
    if reverse:
        # s / x as reciprocal(x) * s (one rounding more than PyTorch's division when s is not 1).
        r = cx.node(unary("Reciprocal"), [x], "reciprocal", tshape=x.tshape)
        return r if s == 1.0 else cx.node(affine(s, 0.0), [r], "affine")
    return cx.node(affine(1.0 / s, 0.0), [x], "affine")


def arith(cx, op, x, y, alpha=1):
    if alpha != 1:
        if op not in ("Add", "Sub"):
            raise Unsupported(f"alpha={alpha}")
        if is_act(y):
            y = cx.node(affine(alpha, 0.0), [y], "affine", tshape=y.tshape)
        elif (s := scalar_of(y)) is not None:
            y = s * alpha
        else:
            y = cx.const_value(np.asarray(y.value, dtype=np.float32) * alpha, "scaled")
    if not is_act(x) and not is_act(y):
        raise Unsupported("both operands are constants (they should have been folded)")
    if is_act(x) and (s := scalar_of(y)) is not None and not (isinstance(y, Const) and y.value.ndim > 0):
        return _scalar_affine(cx, op, x, s)
    if is_act(y) and (s := scalar_of(x)) is not None and not (isinstance(x, Const) and x.value.ndim > 0):
        return _scalar_affine(cx, op, y, s, reverse=True)
    if not is_act(x) and op in ("Add", "Mul"):
        x, y = y, x
    elif not is_act(x) and op == "Sub":
        # c - y as (-y) + c: the same f32 result, with the activation first.
        return cx.binary("Add", cx.node(affine(-1.0, 0.0), [y], "affine", tshape=y.tshape), x)
    elif not is_act(x):
        # c / y as reciprocal(y) * c, the constant a weight.
        return cx.binary("Mul", cx.node(unary("Reciprocal"), [y], "reciprocal", tshape=y.tshape), x)
    return cx.binary(op, x, y)


@aten("aten.add.Tensor", "aten.add.Scalar")
def add(cx, a):
    return arith(cx, "Add", a["self"], a["other"], a.get("alpha", 1))


@aten("aten.sub.Tensor", "aten.sub.Scalar")
def sub(cx, a):
    return arith(cx, "Sub", a["self"], a["other"], a.get("alpha", 1))


@aten("aten.rsub.Scalar", "aten.rsub.Tensor")
def rsub(cx, a):
    return arith(cx, "Sub", a["other"], a["self"], a.get("alpha", 1))


@aten("aten.mul.Tensor", "aten.mul.Scalar")
def mul(cx, a):
    return arith(cx, "Mul", a["self"], a["other"])


@aten("aten.div.Tensor", "aten.div.Scalar")
def div(cx, a):
    return arith(cx, "Div", a["self"], a["other"])


@aten("aten.div.Tensor_mode")
def div_mode(cx, a):
    if a.get("rounding_mode") is not None:
        raise Unsupported(f"division with rounding_mode={a['rounding_mode']!r}")
    return arith(cx, "Div", a["self"], a["other"])


# -- convolution, normalisation, linear


def _conv(cx, x, w, b, stride, padding, dilation, groups, transposed=False, output_padding=(0, 0)):
    w = const(w, "weight")
    if w.value.ndim == 3:
        return _conv1d(cx, x, w, b, stride, padding, dilation, groups, transposed, output_padding)
    if w.value.ndim == 5:
        return _conv3d_of_planes(cx, x, w, b, stride, padding, dilation, groups, transposed)
    x = act(x)
    if x.lifted and x.bdim == 0 and len(x.tshape) == 4 and x.tshape[0] != cx.batch and w.value.ndim == 4:
        return _conv_of_rows(cx, x, w, b, stride, padding, dilation, groups, transposed, output_padding)
    x = cx.batched(x, 4, "a 2-D convolution")
    if w.value.ndim != 4:
        raise Unsupported(f"a {w.value.ndim - 2}-D convolution (Kiln's are 2-D)")
    if isinstance(padding, str):
        padding = _same_padding(padding, w.value.shape[2:], pair(dilation, "dilation"), pair(stride, "stride"))
    inputs = [x, w] + ([const(b, "bias")] if b is not None else [])
    op = conv(pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation"), groups, b is not None, transposed,
              pair(output_padding, "output_padding"))
    return cx.node(op, inputs, "conv_transpose2d" if transposed else "conv2d")


# The most weight elements a convolution of rows may repeat (`_conv_of_rows`): 16 Mi f32, 64 MiB.
MAX_REPEATED_WEIGHTS = 1 << 24


def _conv_of_rows(cx, x, w, b, stride, padding, dilation, groups, transposed, output_padding):
    """A convolution of images merged with other rows, `[B·m, C, H, W]` (EfficientViT-M's
    convolutions per window), as one grouped convolution of Kiln's `[B, m·C, H, W]`: the weight
    repeated for each of the `m` rows, `m` times the groups. Exact: each row's sums are the same."""
    if transposed:
        raise Unsupported("a transposed convolution of rows merged with the batch")
    m = x.tshape[0] // cx.batch
    _, c, h, wd = x.tshape
    kernel = np.asarray(to_numpy_(w.value), dtype=np.float32)
    if kernel.size * m > MAX_REPEATED_WEIGHTS:
        raise Unsupported(f"a convolution of {m} rows per image (the batch merged into dim 0): its weight repeated {m} times "
                          f"would hold {kernel.size * m} values")
    if isinstance(padding, str):
        padding = _same_padding(padding, kernel.shape[2:], pair(dilation, "dilation"), pair(stride, "stride"))
    out = tuple(cx.out_shape)
    o, oh, ow = out[1:]
    rows = cx.node(shape_op("Reshape", dims=[m * c, h, wd]), [x], "reshape", (cx.batch, m * c, h, wd), lifted=False, helper=True)
    inputs = [rows, Const(f"{w.name}.repeated_{m}", np.tile(kernel, (m, 1, 1, 1)))]
    if b is not None:
        inputs.append(Const(f"{const(b, 'bias').name}.repeated_{m}", np.tile(np.asarray(to_numpy_(b.value), dtype=np.float32), m)))
    op = conv(pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation"), int(groups) * m, b is not None)
    y = cx.node(op, inputs, "conv2d", (cx.batch, m * o, oh, ow))
    return cx.node(shape_op("Reshape", dims=[m, o, oh, ow]), [y], "reshape", out, lifted=True, helper=True, bdim=0)


def _triple(v, what):
    v = [int(v)] * 3 if isinstance(v, (int, float)) else [int(d) for d in v]
    if len(v) == 1:
        v = v * 3
    if len(v) != 3:
        raise Unsupported(f"a 3-D convolution's {what} {v}")
    return v


def _conv3d_of_planes(cx, x, w, b, stride, padding, dilation, groups, transposed):
    """A 3-D convolution whose kernel is 1 along a spatial dim (stride 1, no padding there: timm's
    LambdaLayer, `Conv3d(1, K, (r, r, 1))` over `[B, 1, H, W, V]`) as one grouped 2-D convolution:
    the planes along that dim (`V` of them) moved beside the channels, `[B, V·C, H, W]`, the kernel
    repeated for each plane and `V` times the groups, then moved back. Exact: each plane's sums are
    the 2-D convolution's. A 3-D convolution over all three dims is not one of Kiln's."""
    if transposed:
        raise Unsupported("a transposed 3-D convolution (Kiln's convolutions are 2-D)")
    if isinstance(padding, str):
        padding = [0, 0, 0] if padding == "valid" else None
        if padding is None:
            raise Unsupported("a 3-D convolution with padding='same'")
    stride, padding, dilation = _triple(stride, "stride"), _triple(padding, "padding"), _triple(dilation, "dilation")
    kernel = np.asarray(to_numpy_(w.value), dtype=np.float32)
    axes = [d for d in range(3) if kernel.shape[2 + d] == 1 and stride[d] == 1 and padding[d] == 0]
    if not axes:
        raise Unsupported(f"a 3-D convolution with kernel {list(kernel.shape[2:])} (Kiln's convolutions are 2-D; one of "
                          "size 1 along a dim, stride 1 and no padding there, is a grouped 2-D convolution)")
    d = axes[-1]
    x = act(x)
    if len(x.tshape) != 5:
        raise Unsupported(f"a 3-D convolution of a {len(x.tshape)}-D value of shape {list(x.tshape)}")
    n, c = x.tshape[:2]
    planes = x.tshape[2 + d]
    if kernel.size * planes > MAX_REPEATED_WEIGHTS:
        raise Unsupported(f"a 3-D convolution of {planes} planes: its weight repeated {planes} times would hold "
                          f"{kernel.size * planes} values")
    keep = [k for k in range(3) if k != d]
    out = tuple(cx.out_shape)
    o = out[1]
    # [N, C, S0, S1, S2] -> [N, planes, C, Sa, Sb] -> [N, planes·C, Sa, Sb]; the data movement is
    # named after the convolution, which keeps the module's path.
    claimed, cx._named = cx._named, True
    t = cx.permute(x, [0, 2 + d, 1] + [2 + k for k in keep])
    t = cx.reshape(t, (n, planes * c) + tuple(x.tshape[2 + k] for k in keep))
    cx._named = claimed
    w4 = np.tile(kernel.reshape(kernel.shape[:2] + tuple(kernel.shape[2 + k] for k in keep)), (planes, 1, 1, 1))
    inputs = [t, Const(f"{w.name}.planes_{planes}", w4)]
    if b is not None:
        inputs.append(Const(f"{const(b, 'bias').name}.planes_{planes}", np.tile(np.asarray(to_numpy_(b.value), dtype=np.float32), planes)))
    sa, sb = (out[2 + k] for k in keep)
    op = conv([stride[k] for k in keep], [padding[k] for k in keep], [dilation[k] for k in keep], int(groups) * planes, b is not None)
    saved = cx.out_shape
    cx.out_shape = (n, planes * o, sa, sb)
    try:
        y = cx.node(op, [cx.unlift(inputs[0])] + inputs[1:], "conv2d")
    finally:
        cx.out_shape = saved
        cx._named = True
    # [N, planes·O, Sa, Sb] -> [N, planes, O, Sa, Sb] -> [N, O, S0, S1, S2]
    y = cx.reshape(y, (n, planes, o, sa, sb))
    back = [0, 2]
    for k in range(3):
        back.append(1 if k == d else 3 + keep.index(k))
    return cx.permute(y, back)


def _one(v):
    """A 1-D convolution's int-or-[int] argument as an int."""
    return int(v if isinstance(v, (int, float)) else list(v)[0])


def _conv1d(cx, x, w, b, stride, padding, dilation, groups, transposed, output_padding):
    """A 1-D convolution as a 2-D one over `[N, C, 1, L]` with a `[O, C/g, 1, K]` kernel (stored
    under the weight's own name, in that shape): exact, the same products and sums."""
    x = cx.batched(act(x), 3, "a 1-D convolution")
    n, c, length = x.tshape
    if isinstance(padding, str):
        padding = _same_padding(padding, w.value.shape[2:], [_one(dilation)], [_one(stride)])
    w4 = Const(w.name, np.asarray(to_numpy_(w.value), dtype=np.float32)[:, :, None, :])
    # A helper: the convolution keeps the module's path (`c1`, not `c1.conv2d`).
    x4 = cx.node(shape_op("Reshape", dims=[c, 1, length]), [x], "reshape", (n, c, 1, length), helper=True)
    out = tuple(cx.out_shape)
    cx.out_shape = (out[0], out[1], 1, out[2])
    try:
        y = _conv(cx, x4, w4, b, [1, _one(stride)], [0, _one(padding)], [1, _one(dilation)], groups, transposed,
                  [0, _one(output_padding)])
    finally:
        cx.out_shape = out
    return cx.reshape(y, out)


def _same_padding(mode, kernel, dilation, stride):
    if mode == "valid":
        return [0, 0]
    pads = []
    for k, d in zip(kernel, dilation):
        total = d * (k - 1)
        if total % 2:
            raise Unsupported(f"padding='same' with kernel {list(kernel)} pads unevenly (Kiln pads both sides alike)")
        pads.append(total // 2)
    return pads


@aten("aten.conv2d.default", "aten.conv2d.padding", "aten.conv1d.default", "aten.conv1d.padding")
def conv2d(cx, a):
    """`F.conv2d`, and `F.conv1d` (by its 3-D weight, `_conv1d`)."""
    return _conv(cx, a["input"], a["weight"], a.get("bias"), a.get("stride", 1), a.get("padding", 0), a.get("dilation", 1),
                 a.get("groups", 1))


@aten("aten.convolution.default")
def convolution(cx, a):
    return _conv(cx, a["input"], a["weight"], a.get("bias"), a["stride"], a["padding"], a["dilation"], a["groups"],
                 a["transposed"], a["output_padding"])


@aten("aten.conv_transpose1d.default")
def conv_transpose1d(cx, a):
    if _one(a.get("dilation", 1)) != 1:
        raise Unsupported("a dilated transposed convolution")
    return _conv(cx, a["input"], a["weight"], a.get("bias"), a.get("stride", 1), a.get("padding", 0), 1, a.get("groups", 1),
                 True, a.get("output_padding", 0))


@aten("aten.conv_transpose2d.input")
def conv_transpose2d(cx, a):
    if pair(a.get("dilation", 1)) != [1, 1]:
        raise Unsupported("a dilated transposed convolution")
    return _conv(cx, a["input"], a["weight"], a.get("bias"), a.get("stride", 1), a.get("padding", 0), 1, a.get("groups", 1),
                 True, a.get("output_padding", 0))


def _norm_param(cx, v, n, fill, what):
    if v is None:
        return cx.const_value(np.full([n], fill, dtype=np.float32), what)
    return const(v, what)


def _batch_norm(cx, x, w, b, mean, var, eps):
    x = act(x)
    if len(x.tshape) < 2:
        raise Unsupported(f"batch norm of a {len(x.tshape)}-D value")
    c = x.tshape[1]
    params = [_norm_param(cx, w, c, 1.0, "weight"), _norm_param(cx, b, c, 0.0, "bias"), const(mean, "running_mean"),
              const(var, "running_var")]
    if x.lifted or x.moved:
        return _batch_norm_affine(cx, x, params, eps)
    op = {"Norm": {"BatchNorm2d": {"eps": float(eps)}}}
    if len(x.tshape) == 4:
        return cx.node(op, [cx.batched(x, 4, "batch norm")] + params, "batch_norm2d")
    # BatchNorm1d: [N, C] or [N, C, L] normalised as [N, C, L, 1].
    shape4 = tuple(x.tshape) + (1,) * (4 - len(x.tshape))
    y = cx.node(op, [cx.reshape(cx.batched(x, len(x.tshape), "batch norm"), shape4)] + params, "batch_norm2d", tshape=shape4)
    return cx.reshape(y, x.tshape)


def _batch_norm_affine(cx, x, params, eps):
    """Batch norm (eval) of a value whose dim 0 is not the batch (LeViT's BatchNorm1d of
    `x.flatten(0, 1)`, tokens of every image as rows) as what it is, a per-channel `x * scale +
    shift` of dim 1: two elementwise ops with the scale and shift folded from the statistics,
    which follow the batch wherever it is."""
    w, b, mean, var = (np.asarray(to_numpy_(p.value), dtype=np.float64) for p in params)
    scale = w / np.sqrt(var + float(eps))
    shift = b - mean * scale
    per_channel = (len(scale),) + (1,) * (len(x.tshape) - 2)
    y = cx.binary("Mul", x, cx.const_value(scale.astype(np.float32).reshape(per_channel), "scale"), tshape=x.tshape)
    return cx.binary("Add", y, cx.const_value(shift.astype(np.float32).reshape(per_channel), "shift"), tshape=x.tshape)


@aten("aten._native_batch_norm_legit_no_training.default")
def batch_norm_legit(cx, a):
    y = _batch_norm(cx, a["input"], a.get("weight"), a.get("bias"), a["running_mean"], a["running_var"], a["eps"])
    return (y, None, None)


@aten("aten.batch_norm.default")
def batch_norm(cx, a):
    if a.get("training"):
        raise Unsupported("batch norm in training mode (call model.eval() before exporting)")
    return _batch_norm(cx, a["input"], a.get("weight"), a.get("bias"), a["running_mean"], a["running_var"], a["eps"])


@aten("aten.layer_norm.default")
def layer_norm(cx, a):
    x = act(a["input"])
    shape = [int(d) for d in a["normalized_shape"]]
    w, b = a.get("weight"), a.get("bias")
    affine_ = w is not None or b is not None
    x = cx.along(x, range(len(x.tshape) - len(shape), len(x.tshape)), "a layer norm")
    if affine_:
        params = [const(w, "weight") if w is not None else cx.const_value(np.ones(shape, np.float32), "weight"),
                  const(b, "bias") if b is not None else cx.const_value(np.zeros(shape, np.float32), "bias")]
    else:
        params = []
    op = {"Norm": {"LayerNorm": {"dim": len(x.kshape) - len(shape), "shape": shape, "eps": float(a.get("eps", 1e-5)),
                                 "affine": affine_}}}
    return cx.node(op, [x] + params, "layer_norm")


@aten("aten.native_layer_norm.default")
def native_layer_norm(cx, a):
    return (layer_norm(cx, dict(a, eps=a["eps"])), None, None)


def _group_norm(cx, x, groups, w, b, eps):
    x = act(x)
    if len(x.tshape) < 2:
        raise Unsupported(f"group norm of a {len(x.tshape)}-D value")
    x = cx.unlift(x)
    c = x.tshape[1]
    affine_ = w is not None or b is not None
    params = [_norm_param(cx, w, c, 1.0, "weight"), _norm_param(cx, b, c, 0.0, "bias")] if affine_ else []
    op = {"Norm": {"GroupNorm": {"groups": int(groups), "eps": float(eps), "affine": affine_}}}
    return cx.node(op, [x] + params, "group_norm", tshape=x.tshape)


@aten("aten.group_norm.default")
def group_norm(cx, a):
    return _group_norm(cx, a["input"], a["num_groups"], a.get("weight"), a.get("bias"), a.get("eps", 1e-5))


@aten("aten.native_group_norm.default")
def native_group_norm(cx, a):
    return (_group_norm(cx, a["input"], a["group"], a.get("weight"), a.get("bias"), a["eps"]), None, None)


@aten("aten.instance_norm.default")
def instance_norm(cx, a):
    """`nn.InstanceNorm*d`: with the input's statistics (the default) a GroupNorm of one channel a
    group; with running statistics (`track_running_stats=True`, eval) a BatchNorm."""
    x = act(a["input"])
    if not a.get("use_input_stats", True):
        return _batch_norm(cx, x, a.get("weight"), a.get("bias"), a["running_mean"], a["running_var"], a["eps"])
    return _group_norm(cx, x, x.tshape[1], a.get("weight"), a.get("bias"), a["eps"])


@aten("aten.linear.default")
def linear(cx, a):
    x, w, b = act(a["input"]), a["weight"], a.get("bias")
    if is_act(w):
        raise Unsupported("F.linear with a computed weight (use matmul)")
    w = const(w, "weight")
    if w.value.ndim != 2:
        raise Unsupported(f"a linear weight of shape {list(w.value.shape)}")
    if len(x.kshape) < 2:
        x = cx.lift(x)
    inputs = [x, w] + ([const(b, "bias")] if b is not None else [])
    return cx.node({"Gemm": {"Linear": {"bias": b is not None}}}, inputs, "linear")


@aten("aten.matmul.default", "aten.bmm.default", "aten.mm.default")
def matmul(cx, a):
    x, y = a["self"], a.get("other", a.get("mat2"))
    if not is_act(x):
        raise Unsupported("matmul whose first operand is a constant")
    if len(x.tshape) < 2 or len(y.tshape) < 2:
        raise Unsupported("matmul of a vector (Kiln's matmul takes matrices)")
    if is_act(y):
        if x.lifted != y.lifted or len(x.tshape) != len(y.tshape):
            x, y = cx.lift(x), cx.lift(y)
    elif len(y.tshape) > len(x.tshape) or (len(y.tshape) == len(x.tshape) and not x.lifted and y.tshape[0] != 1):
        x = cx.lift(x)
    return cx.node({"Gemm": "Matmul"}, [x, y], "matmul")


@aten("aten.scaled_dot_product_attention.default")
def sdpa(cx, a):
    q, k, v = act(a["query"], "query"), act(a["key"], "key"), act(a["value"], "value")
    if a.get("dropout_p", 0.0) not in (0, 0.0):
        raise Unsupported("attention with dropout_p > 0 (export in eval mode)")
    if a.get("enable_gqa"):
        raise Unsupported("grouped-query attention (enable_gqa=True)")
    if len({x.lifted for x in (q, k, v)}) > 1:
        q, k, v = cx.lift(q), cx.lift(k), cx.lift(v)
    d = q.tshape[-1]
    scale = a.get("scale")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    mask = a.get("attn_mask")
    if a.get("is_causal"):
        if mask is not None:
            raise Unsupported("is_causal together with attn_mask")
        ql, kl = q.tshape[-2], k.tshape[-2]
        mask = Const("causal", np.triu(np.full((ql, kl), -np.inf, np.float32), 1))
        mask = cx.const_value(mask.value, "causal_mask")
    inputs = [q, k, v]
    if mask is not None:
        if is_act(mask):
            raise Unsupported("an attention mask computed from the input (Kiln's attention takes a constant or additive mask)")
        m = np.asarray(mask.value)
        if m.dtype == np.bool_:
            m = np.where(m, 0.0, -np.inf).astype(np.float32)
            mask = cx.const_value(m, "attn_mask")
        inputs.append(mask)
    op = {"Attention": {"scale": scale, "bias": mask is not None}}
    return cx.node(op, inputs, "attention")


# -- pooling and reductions


@aten("aten.max_pool2d.default", "aten.max_pool2d_with_indices.default")
def max_pool2d(cx, a):
    x = cx.batched(act(a["self"]), 4, "max pooling")
    k = pair(a["kernel_size"], "kernel_size")
    s = pair(a.get("stride") or k, "stride")
    if pair(a.get("dilation", 1), "dilation") != [1, 1]:
        raise Unsupported("dilated max pooling")
    y = cx.node(pool("Max", k, s, pair(a.get("padding", 0)), a.get("ceil_mode", False)), [x], "max_pool2d")
    return (y, None) if "with_indices" in cx.target else y


@aten("aten.avg_pool2d.default")
def avg_pool2d(cx, a):
    x = cx.batched(act(a["self"]), 4, "average pooling")
    if a.get("divisor_override") is not None:
        raise Unsupported("avg_pool2d with divisor_override")
    k = pair(a["kernel_size"], "kernel_size")
    s = pair(a.get("stride") or k, "stride")
    op = pool("Avg", k, s, pair(a.get("padding", 0)), a.get("ceil_mode", False), a.get("count_include_pad", True))
    return cx.node(op, [x], "avg_pool2d")


@aten("aten.adaptive_avg_pool2d.default", "aten._adaptive_avg_pool2d.default")
def adaptive_avg_pool2d(cx, a):
    x = cx.batched(act(a["self"]), 4, "adaptive average pooling")
    out = pair(a["output_size"], "output_size")
    return cx.node({"Pool": {"AdaptiveAvg": {"output": out}}}, [x], "adaptive_avg_pool2d")


@aten("aten.adaptive_max_pool2d.default")
def adaptive_max_pool2d(cx, a):
    x = cx.batched(act(a["self"]), 4, "adaptive max pooling")
    out = pair(a["output_size"], "output_size")
    return (cx.node({"Pool": {"AdaptiveMax": {"output": out}}}, [x], "adaptive_max_pool2d"), None)


def _mean(cx, x, dims, keepdim):
    x = act(x)
    rank = len(x.tshape)
    dims = sorted({norm_dim(d, rank) for d in (dims if dims else range(rank))})
    x = cx.along(x, dims, "a mean")
    kd = [x.kdim(d) for d in dims]
    return cx.node({"Pool": {"Mean": {"dims": kd, "keepdim": bool(keepdim)}}}, [x], "mean", bdim=cx.reduced_bdim(x, dims, keepdim))


@aten("aten.mean.dim", "aten.mean.default")
def mean(cx, a):
    return _mean(cx, a["self"], a.get("dim"), a.get("keepdim", False))


def _reduce(cx, kind, x, dims, keepdim, what):
    """`Pool::Amax` over `dims` or `Pool::Argmax` along one dim; the batch stays."""
    x = act(x)
    rank = len(x.tshape)
    dims = sorted({norm_dim(d, rank) for d in (dims if dims not in (None, []) else range(rank))})
    if kind == "Argmax" and len(dims) != 1:
        raise Unsupported("argmax over the flattened tensor (give dim)")
    x = cx.along(x, dims, f"an {what}")
    kd = [x.kdim(d) for d in dims]
    bdim = cx.reduced_bdim(x, dims, keepdim)
    if kind == "Argmax":
        return cx.node({"Pool": {"Argmax": {"dim": kd[0], "keepdim": bool(keepdim)}}}, [x], what, bdim=bdim)
    return cx.node({"Pool": {"Amax": {"dims": kd, "keepdim": bool(keepdim)}}}, [x], what, bdim=bdim)


@aten("aten.amax.default")
def amax(cx, a):
    return _reduce(cx, "Amax", a["self"], a.get("dim"), a.get("keepdim", False), "amax")


@aten("aten.argmax.default")
def argmax(cx, a):
    return _reduce(cx, "Argmax", a["self"], None if a.get("dim") is None else [a["dim"]], a.get("keepdim", False), "argmax")


@aten("aten.max.dim")
def max_dim(cx, a):
    """`x.max(dim)`: the values and the indices (as f32), each made only when read."""
    x, d, keep = a["self"], [a["dim"]], a.get("keepdim", False)
    return (_Lazy(lambda: _reduce(cx, "Amax", x, d, keep, "amax")), _Lazy(lambda: _reduce(cx, "Argmax", x, d, keep, "argmax")))


class _Lazy:
    """An output of a multi-output op, converted when first read (`getitem`)."""

    def __init__(self, make):
        self.make, self.value = make, None

    def __call__(self):
        if self.value is None:
            self.value = self.make()
        return self.value


@aten("aten.sum.dim_IntList")
def sum_dims(cx, a):
    x = act(a["self"])
    dims = a.get("dim") or range(len(x.tshape))
    n = int(np.prod([x.tshape[norm_dim(d, len(x.tshape))] for d in dims]))
    return cx.node(affine(float(n), 0.0), [_mean(cx, x, a.get("dim"), a.get("keepdim", False))], "affine")


@aten("aten.linalg_vector_norm.default")
def linalg_vector_norm(cx, a):
    """`torch.linalg.vector_norm` (and `torch.norm(x, p, dim)`, ConvNeXt-V2's Global Response
    Norm) over `dim` from Kiln's reductions: ord 2 is sqrt(sum(x * x)), 1 sum(|x|), inf max(|x|),
    another positive p (sum(|x| ^ p)) ^ (1 / p)."""
    x = act(a["self"])
    order = float(a.get("ord", 2))
    dims, keepdim = a.get("dim"), bool(a.get("keepdim", False))
    rank = len(x.tshape)
    reduced = sorted({norm_dim(d, rank) for d in (dims if dims else range(rank))})
    if not math.isfinite(order) and order > 0:
        return _reduce(cx, "Amax", cx.node(unary("Abs"), [x], "abs", x.tshape), reduced, keepdim, "amax")
    if not (order > 0 and math.isfinite(order)):
        raise Unsupported(f"a vector norm of ord {order} (Kiln's are of a positive, finite ord or inf)")
    n = int(np.prod([x.tshape[d] for d in reduced]))
    if order == 2:
        powered = cx.binary("Mul", x, x, tshape=x.tshape)
    else:
        powered = cx.node(unary("Abs"), [x], "abs", x.tshape)
        if order != 1:
            powered = cx.node(unary("Pow", exponent=order), [powered], "pow", x.tshape)
    total = cx.node(affine(float(n), 0.0), [_mean(cx, powered, reduced, keepdim)], "affine")
    if order == 1:
        return total
    if order == 2:
        return cx.node(unary("Sqrt"), [total], "sqrt")
    return cx.node(unary("Pow", exponent=1.0 / order), [total], "pow")


@aten("aten.softmax.int", "aten._softmax.default")
def softmax(cx, a):
    x = act(a["self"])
    d = norm_dim(a["dim"], len(x.tshape))
    x = cx.along(x, [d], "a softmax")
    return cx.node({"Norm": {"Softmax": {"dim": x.kdim(d)}}}, [x], "softmax", bdim=x.bdim)


# -- resizing


def _resize(cx, mode, x, size, scales, align_corners=False):
    x = cx.batched(act(x), 4, "interpolation")
    attrs = {"size": None, "scale": None}
    if scales is not None and all(s is not None for s in scales):
        attrs["scale"] = [float(s) for s in scales]
    elif size is not None:
        attrs["size"] = pair(size, "size")
    else:
        attrs["size"] = list(cx.out_shape[2:])
    if mode == "Bilinear":
        attrs["align_corners"] = bool(align_corners)
    return cx.node({"Resize": {mode: attrs}}, [x], "interpolate")


@aten("aten.upsample_nearest2d.vec")
def upsample_nearest_vec(cx, a):
    return _resize(cx, "Nearest", a["input"], a.get("output_size"), a.get("scale_factors"))


@aten("aten.upsample_nearest2d.default")
def upsample_nearest(cx, a):
    return _resize(cx, "Nearest", a["self"], a.get("output_size"), [a.get("scales_h"), a.get("scales_w")])


@aten("aten.upsample_bilinear2d.vec")
def upsample_bilinear_vec(cx, a):
    return _resize(cx, "Bilinear", a["input"], a.get("output_size"), a.get("scale_factors"), a.get("align_corners", False))


@aten("aten.upsample_bilinear2d.default")
def upsample_bilinear(cx, a):
    return _resize(cx, "Bilinear", a["self"], a.get("output_size"), [a.get("scales_h"), a.get("scales_w")],
                   a.get("align_corners", False))


def bicubic_matrix(n_in: int, n_out: int, align_corners: bool, scale=None) -> np.ndarray:
    """`[n_out, n_in]`: PyTorch's bicubic interpolation along one axis (`upsample_bicubic2d`: Keys'
    cubic with A = -0.75, the four taps clamped to the border), so that a resize is `M_h @ x @ M_wᵀ`.
    `scale` is the given scale factor (PyTorch then maps by 1 / scale, not n_in / n_out)."""
    a = -0.75

    def near(t):  # |t| <= 1
        return ((a + 2) * t - (a + 3)) * t * t + 1

    def far(t):  # 1 < |t| < 2
        return ((a * t - 5 * a) * t + 8 * a) * t - 4 * a

    if align_corners:
        step = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    else:
        step = 1.0 / scale if scale else n_in / n_out
    m = np.zeros((n_out, n_in), np.float64)
    for o in range(n_out):
        real = step * o if align_corners else step * (o + 0.5) - 0.5
        base = math.floor(real)
        t = real - base
        for k, c in enumerate((far(t + 1), near(t), near(1 - t), far(2 - t))):
            m[o, min(max(base - 1 + k, 0), n_in - 1)] += c
    return m


def _bicubic(cx, x, scales, align_corners):
    """`F.interpolate(mode="bicubic")` as two matmuls with constant interpolation matrices, along
    W then along H (a permute either side): each output is the same weighted sum of 4×4 taps,
    the zeros of the matrices adding exact zeros."""
    x = cx.batched(act(x), 4, "interpolation")
    n, c, h, w = x.tshape
    oh, ow = (int(d) for d in cx.out_shape[2:])
    sh, sw = (None, None) if scales is None else (list(scales) + [None, None])[:2]
    mw = cx.const_value(bicubic_matrix(w, ow, bool(align_corners), sw).T.astype(np.float32), "bicubic_w")
    mh = cx.const_value(bicubic_matrix(h, oh, bool(align_corners), sh).T.astype(np.float32), "bicubic_h")
    y = cx.node({"Gemm": "Matmul"}, [x, mw], "matmul", (n, c, h, ow))
    y = cx.permute(y, [0, 1, 3, 2])
    y = cx.node({"Gemm": "Matmul"}, [y, mh], "matmul", (n, c, ow, oh))
    return cx.permute(y, [0, 1, 3, 2])


@aten("aten.upsample_bicubic2d.vec")
def upsample_bicubic_vec(cx, a):
    return _bicubic(cx, a["input"], a.get("scale_factors"), a.get("align_corners", False))


@aten("aten.upsample_bicubic2d.default")
def upsample_bicubic(cx, a):
    return _bicubic(cx, a["self"], [a.get("scales_h"), a.get("scales_w")], a.get("align_corners", False))


# -- data movement


@aten(
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.reshape.default",
    "aten.flatten.using_ints",
    "aten.unflatten.int",
    "aten.squeeze.dim",
    "aten.squeeze.dims",
    "aten.squeeze.default",
    "aten.unsqueeze.default",
)
def view(cx, a):
    return cx.reshape(act(a["self"]), cx.out_shape)


@aten("aten.expand.default", "aten.expand_as.default")
def expand(cx, a):
    x = act(a["self"])
    out = tuple(cx.out_shape)
    if tuple(x.tshape) == out:
        return x
    # A broadcast copy: x + zeros of the expanded dims (exact: x + 0 is x).
    pad = len(out) - len(x.tshape)
    src = (1,) * pad + tuple(x.tshape)
    zeros = [o if s == 1 and o != 1 else 1 for s, o in zip(src, out)]
    while len(zeros) > 1 and zeros[0] == 1:
        zeros = zeros[1:]
    if pad or (zeros and zeros[0] != 1 and len(zeros) == len(out) and not x.lifted):
        x = cx.lift(x) if len(zeros) >= len(x.tshape) + x.offset else x
    return cx.binary("Add", x, cx.const_value(np.zeros(zeros, np.float32), "expand"))


@aten("aten.copy.default")
def copy(cx, a):
    """`aten.copy(self, src)`, what torch.export makes of `self.copy_(src)` (MViTv2's
    `attn[:, :, 0:, 0:] = ...`): the values of `src` in the shape of `self`, broadcast as
    `expand` does; `self` is only its shape."""
    src = a["src"]
    if not is_act(src):
        raise Unsupported("a copy of a constant (it should have been folded)")
    return expand(cx, {"self": src})


@aten("aten.permute.default")
def permute(cx, a):
    x = act(a["self"])
    rank = len(x.tshape)
    dims = [norm_dim(d, rank) for d in a["dims"]]
    return cx.permute(x, dims)


@aten("aten.transpose.int")
def transpose(cx, a):
    x = act(a["self"])
    rank = len(x.tshape)
    dims = list(range(rank))
    d0, d1 = norm_dim(a["dim0"], rank), norm_dim(a["dim1"], rank)
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return cx.permute(x, dims)


@aten("aten.t.default", "aten.numpy_T.default")
def t(cx, a):
    x = act(a["self"])
    return cx.permute(x, list(range(len(x.tshape)))[::-1])


@aten("aten.cat.default", "aten.concat.default")
def cat(cx, a):
    parts = [p for p in a["tensors"] if not (isinstance(p, (Act, Const)) and 0 in p.tshape)]
    rank = len(parts[0].tshape)
    d = norm_dim(a.get("dim", 0), rank)
    return cx.cat(parts, d)


@aten("aten.stack.default")
def stack(cx, a):
    """`torch.stack(tensors, dim)` as the cat of each unsqueezed at `dim` (CrossViT's mean of its
    heads, `torch.stack(list).sum(0)`): the batch of each moves past the new dim and back."""
    parts = [p for p in a["tensors"]]
    if not any(is_act(p) for p in parts):
        raise Unsupported("stack of constants only (it should have been folded)")
    d = norm_dim(a.get("dim", 0), len(parts[0].tshape) + 1)
    unsqueezed = []
    for p in parts:
        shape = list(p.tshape)
        shape.insert(d, 1)
        unsqueezed.append(cx.reshape(p, shape) if is_act(p) else Const(f"{const(p, 'tensor').name}.unsqueezed",
                                                                       np.asarray(to_numpy_(p.value)).reshape(shape)))
    return cx.cat(unsqueezed, d)


@aten("aten.slice.Tensor")
def slice_(cx, a):
    x = act(a["self"])
    rank = len(x.tshape)
    d = norm_dim(a.get("dim", 0), rank)
    n = x.tshape[d]
    start, end, step = a.get("start"), a.get("end"), a.get("step", 1)
    start = 0 if start is None else start
    end = n if end is None else end
    start = max(0, min(n, start + n if start < 0 else start))
    end = max(start, min(n, end + n if end < 0 else end))
    return cx.slice(x, d, start, end, int(step))


@aten("aten.narrow.default")
def narrow(cx, a):
    x = act(a["self"])
    d = norm_dim(a["dim"], len(x.tshape))
    start = a["start"] % x.tshape[d] if a["start"] < 0 else a["start"]
    return cx.slice(x, d, start, start + a["length"], 1)


@aten("aten.select.int")
def select(cx, a):
    x = act(a["self"])
    d = norm_dim(a["dim"], len(x.tshape))
    i = a["index"] % x.tshape[d]
    return cx.reshape(cx.slice(x, d, i, i + 1, 1), cx.out_shape)


def _split(cx, x, sizes, d):
    """Each part as a thunk: a part becomes a Kiln node only when something reads it."""
    parts, start = [], 0
    for s in sizes:
        parts.append(_Part(cx, x, d, start, start + s))
        start += s
    return tuple(parts)


class _Part:
    """One output of a split, sliced when first read (`getitem`)."""

    def __init__(self, cx, x, d, start, end):
        self.cx, self.x, self.d, self.start, self.end, self.value = cx, x, d, start, end, None

    def __call__(self):
        if self.value is None:
            self.value = self.cx.slice(self.x, self.d, self.start, self.end, 1)
        return self.value


@aten("aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.unsafe_split.Tensor")
def split(cx, a):
    x = act(a["self"])
    d = norm_dim(a.get("dim", 0), len(x.tshape))
    n = x.tshape[d]
    if "split_sizes" in a:
        sizes = list(a["split_sizes"])
    elif "chunks" in a:
        step = -(-n // a["chunks"])
        sizes = [min(step, n - i) for i in range(0, n, step)]
    else:
        step = a["split_size"]
        sizes = [min(step, n - i) for i in range(0, n, step)]
    return _split(cx, x, sizes, d)


@aten("aten.unbind.int")
def unbind(cx, a):
    x = act(a["self"])
    d = norm_dim(a.get("dim", 0), len(x.tshape))
    shape = tuple(s for i, s in enumerate(x.tshape) if i != d)
    return tuple(_Reshaped(p, cx, shape) for p in _split(cx, x, [1] * x.tshape[d], d))


class _Reshaped:
    def __init__(self, part, cx, shape):
        self.part, self.cx, self.shape, self.value = part, cx, shape, None

    def __call__(self):
        if self.value is None:
            self.value = self.cx.reshape(self.part(), self.shape)
        return self.value


# The most windows `Tensor.unfold` may take along its dim (each is a slice, a permute and a cat input).
MAX_UNFOLD_WINDOWS = 64


@aten("aten.unfold.default")
def unfold(cx, a):
    """`x.unfold(dim, size, step)` (HaloNet's blocked attention): the `n` windows `x[.., i·step :
    i·step + size, ..]` along `dim`, each with that dim moved last, side by side in `dim`. Exact:
    slices and copies."""
    x = act(a["self"])
    rank = len(x.tshape)
    d, size, step = norm_dim(a["dimension"], max(rank, 1)), int(a["size"]), int(a["step"])
    n = (x.tshape[d] - size) // step + 1
    if n > MAX_UNFOLD_WINDOWS:
        raise Unsupported(f"an unfold into {n} windows (Kiln slices each; at most {MAX_UNFOLD_WINDOWS})")
    order = [i for i in range(rank) if i != d] + [d]
    windows = []
    for i in range(n):
        w = cx.permute(cx.slice(x, d, i * step, i * step + size), order)
        shape = list(w.tshape)
        windows.append(cx.reshape(w, shape[:d] + [1] + shape[d:]))
    return windows[0] if n == 1 else cx.cat(windows, d)


# The longest dim `aten.flip` reverses (one slice an element).
MAX_FLIP_LENGTH = 256


@aten("aten.flip.default")
def flip(cx, a):
    """`x.flip(dims)` (Sequencer's bidirectional LSTM) as each reversed dim's one-element slices
    in reverse order, side by side. Exact: slices and copies. The batch dim is not reversed (it
    would mix the images)."""
    x = act(a["self"])
    rank = len(x.tshape)
    for d in sorted({norm_dim(d, max(rank, 1)) for d in a["dims"]}):
        n = x.tshape[d]
        if n > MAX_FLIP_LENGTH:
            raise Unsupported(f"a flip of a dim of {n} (Kiln slices each element; at most {MAX_FLIP_LENGTH})")
        if n > 1:
            x = cx.cat([cx.slice(x, d, i, i + 1, 1) for i in reversed(range(n))], d)
    return x


EDGE_PADS = {"reflect": "ReflectPad", "replicate": "ReplicatePad"}


def _edge_pad(cx, x, pads, mode):
    """Reflect or replicate padding of the trailing dims (`pads` last dim first)."""
    if mode not in EDGE_PADS:
        raise Unsupported(f"padding mode {mode!r} (Kiln pads with a constant, by reflection or by replication)")
    pads = [int(p) for p in pads]
    if any(p < 0 for p in pads):
        raise Unsupported(f"negative padding {pads}")
    if not any(pads):
        return x
    x, pads = _pads_per_image(cx, x, pads)
    name = "reflection_pad" if mode == "reflect" else "replication_pad"
    return cx.node(shape_op(EDGE_PADS[mode], pads=pads), [x], name)


@aten("aten.reflection_pad1d.default", "aten.reflection_pad2d.default", "aten.reflection_pad3d.default")
def reflection_pad(cx, a):
    return _edge_pad(cx, act(a["self"]), a["padding"], "reflect")


@aten("aten.replication_pad1d.default", "aten.replication_pad2d.default", "aten.replication_pad3d.default")
def replication_pad(cx, a):
    return _edge_pad(cx, act(a["self"]), a["padding"], "replicate")


@aten("aten.constant_pad_nd.default", "aten.pad.default")
def pad(cx, a):
    x = act(a["self"])
    mode = a.get("mode", "constant")
    if mode != "constant":
        return _edge_pad(cx, x, a["pad"], mode)
    pads = [int(p) for p in a["pad"]]
    value = a.get("value")
    value = 0.0 if value is None else float(value)
    if any(p < 0 for p in pads):
        raise Unsupported(f"negative padding {pads}")
    if not any(pads):
        return x
    x, pads = _pads_per_image(cx, x, pads)
    return cx.node(shape_op("Pad", pads=pads, value=value), [x], "pad")


def _pads_per_image(cx, x, pads):
    """`x` and `pads` (PyTorch's, last dim first) for a Kiln pad of its trailing dims: pads that
    reach dim 0 with zeros there are cut to the other dims; nonzero ones pad the batch, so `x`
    is lifted (at batch 1) or refused (`Builder.along`)."""
    rank = len(x.tshape)
    if len(pads) // 2 < rank:
        return x, pads
    if not any(pads[2 * (rank - 1) :]):
        return x, pads[: 2 * (rank - 1)]
    if x.lifted and cx.batch == 1:
        return x, pads
    return cx.along(x, [0], "a pad"), pads


@aten("aten.roll.default")
def roll(cx, a):
    x = act(a["self"])
    rank = len(x.tshape)
    dims = [norm_dim(d, rank) for d in a.get("dims", [])]
    if not dims:
        raise Unsupported("roll over the flattened tensor (give dims)")
    x = cx.along(x, dims, "a roll")
    return cx.node(shape_op("Roll", shifts=[int(s) for s in a["shifts"]], dims=[x.kdim(d) for d in dims]), [x], "roll", bdim=x.bdim)


# -- quantisation
#
# PyTorch writes quantisation three ways, all onto Kiln's `Quant` ops (src/ops/quant/), whose
# engine builds them with exactly these scales:
# - QAT's fake-quantisers (`aten.fake_quantize_per_*_affine`) → `Quant::FakeQuantize`;
# - PT2E's activations, a `quantized_decomposed.quantize_per_tensor` read by one
#   `dequantize_per_tensor` per reader (the same parameters) → one `FakeQuantize` of the value
#   (`dequantize`): TensorRT's Q/DQ pair, the form Kiln's 8-bit layers read. The `Quantize` node
#   is then read by no one and dropped;
# - PT2E's weights, int8 constants with a `dequantize_per_channel` after them, computed once by
#   PyTorch as constants (`frontend`'s fold) → the f32 weight, carrying its grid
#   (`Op::Weight::quant`, `weight_grid`): 8-bit layers read their codes from it.

# Integer dtypes of `quantized_decomposed` ops and the range each holds.
INT_DTYPES = {"int8": (-128, 127), "uint8": (0, 255)}


def _qvalues(v, what, n=None):
    """A quantisation parameter (a number, or a constant of one or `n` values) as a list."""
    if (s := scalar_of(v)) is not None and n is None:
        return [s]
    if not isinstance(v, Const):
        raise Unsupported(f"its {what} is {'computed from the input' if is_act(v) else repr(v)}; Kiln needs constant quantisation parameters")
    values = np.asarray(to_numpy_(v.value), dtype=np.float64).reshape(-1)
    if n is not None and values.size != n:
        raise Unsupported(f"{values.size} {what} values for {n} channels")
    return values.tolist()


def quant_params(scale, zero_point, qmin, qmax, axis=None, n=None, dtype=None):
    """Kiln's `QuantParams` (serde form) of int8 parameters: `qmin..=qmax`, a zero point per scale,
    per tensor (`axis=None`) or `n` values along Kiln dim `axis`. `dtype` (PT2E's integer type)
    must hold the range."""
    if dtype is not None:
        dtype = str(dtype).replace("torch.", "")
        if dtype not in INT_DTYPES:
            raise Unsupported(f"quantisation to {dtype}: Kiln's 8-bit formats are int8 and uint8 (and fp8 e4m3)")
    scales = [float(s) for s in _qvalues(scale, "scale", n)]
    zps = [int(round(z)) for z in _qvalues(zero_point, "zero point", len(scales) if n is not None else None)]
    if len(zps) != len(scales):
        raise Unsupported(f"{len(zps)} zero points for {len(scales)} scales")
    if not all(math.isfinite(s) and s > 0 for s in scales):
        raise Unsupported(f"scales must be positive and finite, got {scales}")
    qmin, qmax = int(qmin), int(qmax)
    if qmin < -128 or qmax > 255 or qmin >= qmax or qmax - qmin > 255:
        raise Unsupported(f"an integer range [{qmin}, {qmax}] that is not 8-bit")
    if dtype is not None and not INT_DTYPES[dtype][0] <= qmin < qmax <= INT_DTYPES[dtype][1]:
        raise Unsupported(f"the range [{qmin}, {qmax}] does not fit {dtype}")
    if any(not qmin <= z <= qmax for z in zps):
        raise Unsupported(f"zero points {zps} outside [{qmin}, {qmax}]")
    return {"format": "Int8", "scale": scales, "zero_point": zps, "axis": axis, "qmin": qmin, "qmax": qmax}


def _prepare(cx, x, scale, zero_point, qmin, qmax, axis=None, dtype=None):
    """`(x, params)`: int8 parameters of a quantisation of `x` per tensor or along `axis` of the
    PyTorch value, made a dim of Kiln's full shape (the batch is dim 0; `x` is lifted for axis 0)."""
    x = act(x)
    n = None
    if axis is not None:
        rank = len(x.tshape)
        axis = norm_dim(axis, rank)
        x = cx.along(x, [axis], "a per-channel quantiser")
        n = x.tshape[axis]
        axis = x.kdim(axis)
    return x, quant_params(scale, zero_point, qmin, qmax, axis, n, dtype)


def _quant(cx, kind, x, scale, zero_point, qmin, qmax, axis=None, what="quantize", dtype=None):
    """`Quant::<kind>` of int8 parameters (see `_prepare`); returns its `Act` and the parameters."""
    x, params = _prepare(cx, x, scale, zero_point, qmin, qmax, axis, dtype)
    return cx.node({"Quant": {kind: params}}, [x], what), params


@aten("aten.fake_quantize_per_tensor_affine.default", "aten.fake_quantize_per_tensor_affine.tensor_qparams")
def fake_quantize_per_tensor(cx, a):
    """`torch.fake_quantize_per_tensor_affine` (a QAT model's activation and weight quantisers)."""
    return _quant(cx, "FakeQuantize", a["self"], a["scale"], a["zero_point"], a["quant_min"], a["quant_max"], what="fake_quantize")[0]


@aten("aten.fake_quantize_per_channel_affine.default")
def fake_quantize_per_channel(cx, a):
    return _quant(cx, "FakeQuantize", a["self"], a["scale"], a["zero_point"], a["quant_min"], a["quant_max"], a["axis"],
                  "fake_quantize")[0]


def _decomposed_args(a, per_channel):
    if per_channel:
        return a["scales"], a["zero_points"], a["axis"]
    return a["scale"], a["zero_point"], None


def _decomposed_quantize(per_channel):
    """`quantized_decomposed.quantize_per_tensor` / `_per_channel` (PT2E): a `Quantize` node (the
    integer codes as values), remembered so that its dequantizes become one fake-quantiser."""
    def convert(cx, a):
        scale, zp, axis = _decomposed_args(a, per_channel)
        x = act(a["input"])
        q, params = _quant(cx, "Quantize", x, scale, zp, a["quant_min"], a["quant_max"], axis, "quantize", a.get("dtype"))
        cx.quantized[q.id] = (x, params)
        return q

    return convert


def _decomposed_dequantize(per_channel):
    """`quantized_decomposed.dequantize_per_tensor` / `_per_channel` (PT2E). Of a `quantize` with
    the same parameters: the `FakeQuantize` of that quantize's input (one per value and
    parameters, however many readers PT2E gave their own dequantize). Of other codes: a
    `Dequantize` node."""
    def convert(cx, a):
        out_dtype = a.get("out_dtype")
        if out_dtype is not None and str(out_dtype).replace("torch.", "") != "float32":
            raise Unsupported(f"a dequantize to {out_dtype}: Kiln computes in f32")
        scale, zp, axis = _decomposed_args(a, per_channel)
        q, params = _prepare(cx, act(a["input"], "input (codes)"), scale, zp, a["quant_min"], a["quant_max"], axis, a.get("dtype"))
        x, qparams = cx.quantized.get(q.id, (None, None))
        # (The node is checked too: a whole-module conversion that gave up may have reused the id.)
        if qparams != params or cx.graph.nodes[q.id]["op"] != {"Quant": {"Quantize": qparams}}:
            # Codes from elsewhere, or dequantised with other parameters: computed as written.
            return cx.node({"Quant": {"Dequantize": params}}, [q], "dequantize")
        key = (x.id, repr(params))
        if key not in cx.fake_quantized:
            # Named after the value it quantises (PT2E's quantize nodes belong to no module).
            path = f"{cx.graph.nodes[x.id]['path']}.quantizer"
            node = cx.graph.push({"Quant": {"FakeQuantize": params}}, [x.id], x.kshape, path)
            cx.fake_quantized[key] = Act(node, x.tshape, x.lifted, x.bdim)
        return cx.fake_quantized[key]

    return convert


aten("quantized_decomposed.quantize_per_tensor.default", "quantized_decomposed.quantize_per_tensor.tensor")(
    _decomposed_quantize(False))
aten("quantized_decomposed.quantize_per_channel.default")(_decomposed_quantize(True))
aten("quantized_decomposed.dequantize_per_tensor.default", "quantized_decomposed.dequantize_per_tensor.tensor")(
    _decomposed_dequantize(False))
aten("quantized_decomposed.dequantize_per_channel.default")(_decomposed_dequantize(True))


def weight_grid(target, a):
    """The 8-bit grid of a constant that PyTorch quantised while exporting, as Kiln's
    `QuantParams` (serde form) for `Op::Weight::quant`: a PT2E weight (int8 codes, then
    `dequantize_per_channel`) or a QAT weight (`fake_quantize_per_channel_affine` of the weight).
    `None` for every other folded op. The axis is the weight's own dim (a weight has no batch dim)."""
    if target.startswith("quantized_decomposed.dequantize_per_"):
        scale, zp, axis = _decomposed_args(a, "per_channel" in target)
        codes, qmin, qmax, dtype = a["input"], a["quant_min"], a["quant_max"], a.get("dtype")
    elif target.startswith("aten.fake_quantize_per_"):
        scale, zp, axis = a["scale"], a["zero_point"], a.get("axis")
        codes, qmin, qmax, dtype = a["self"], a["quant_min"], a["quant_max"], None
    else:
        return None
    if not isinstance(codes, Const):
        return None
    n = None
    if axis is not None:
        axis = norm_dim(axis, codes.value.ndim)
        n = codes.tshape[axis]
    return quant_params(scale, zp, qmin, qmax, axis, n, dtype)


# -- torchvision ops


@aten("torchvision.deform_conv2d.default")
def deform_conv2d(cx, a):
    """`torchvision.ops.deform_conv2d` → the `kiln-deform-conv` plugin's op `deform_conv2d`."""
    x = cx.batched(act(a["input"]), 4, "a deformable convolution")
    offset = cx.batched(act(a["offset"], "offset"), 4, "a deformable convolution")
    w = const(a["weight"], "weight")
    use_mask = bool(a.get("use_mask"))
    bias = a.get("bias")
    has_bias = bias is not None and not (isinstance(bias, Const) and not np.any(np.asarray(bias.value)))
    inputs = [x, offset]
    if use_mask:
        inputs.append(cx.batched(act(a["mask"], "mask"), 4, "a deformable convolution"))
    inputs.append(w)
    if has_bias:
        inputs.append(const(bias, "bias"))
    attrs = {
        "stride_h": a["stride_h"], "stride_w": a["stride_w"], "pad_h": a["pad_h"], "pad_w": a["pad_w"],
        "dil_h": a["dilation_h"], "dil_w": a["dilation_w"], "mask": int(use_mask), "bias": int(has_bias),
    }
    return cx.node(custom("deform_conv2d", attrs), inputs, "deform_conv2d")


# ---- user-registered custom ops


class CustomOp:
    """How a node becomes a Kiln custom op (a `CustomOp` registered in Rust under `name`).

    By default its tensor arguments become the node's inputs in order (activations first, then
    constants, as `Tensor::record` takes them) and its numbers become attributes named after the
    op's arguments (a list `[a, b]` as `name_0`, `name_1`; booleans as 0 or 1). `attrs` may be a
    function of the arguments (by name) returning the attributes instead.
    """

    def __init__(self, name: str, attrs=None):
        self.name, self.attrs = name, attrs

    def __call__(self, cx, a):
        inputs = [v for v in _tensors(a.values()) if is_act(v)] + [v for v in _tensors(a.values()) if isinstance(v, Const)]
        if not any(is_act(v) for v in inputs):
            raise Unsupported(f"custom op `{self.name}` has no activation input")
        acts = [cx.unlift(v) if is_act(v) else v for v in inputs]
        attrs = self.attrs(a) if callable(self.attrs) else _number_attrs(a)
        return cx.node(custom(self.name, attrs), acts, self.name)


def _tensors(values):
    for v in values:
        if isinstance(v, (Act, Const)):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def _number_attrs(a):
    attrs = {}
    for k, v in a.items():
        if isinstance(v, bool):
            attrs[k] = int(v)
        elif isinstance(v, (int, float)):
            attrs[k] = v
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float)) for x in v):
            attrs.update({f"{k}_{i}": x for i, x in enumerate(v)})
    return attrs


def custom_table(custom_ops: dict | None) -> dict:
    """A user's table `{op name: Kiln custom op name or CustomOp}` as converters, keyed as the
    report names ops (`mylib.swish.default`); `mylib::swish` matches every overload."""
    out = {}
    for key, spec in (custom_ops or {}).items():
        conv_ = spec if isinstance(spec, CustomOp) else CustomOp(str(spec))
        out[key.replace("::", ".")] = conv_
    return out


def find(name: str, user: dict):
    """The converter of the ATen op `name` (`aten.relu.default`): the user's table first."""
    for key in (name, name.rsplit(".", 1)[0]):
        if key in user:
            return user[key]
    return TABLE.get(name)


# ---- whole modules

MODULES: dict = {}


def module(*classes):
    """Registers a converter for every call of a module class, replacing the ops it traces into.
    It gets the module's attributes, its activation inputs and its parameters (by name under the
    module), and raises `Unsupported` to fall back to converting the call op by op."""

    def register(fn):
        for c in classes:
            MODULES[c] = fn
        return fn

    return register


@module("torch.nn.modules.activation.MultiheadAttention")
def multihead_attention(cx, attrs, inputs, params):
    """`nn.MultiheadAttention(E, heads, batch_first=True)` as self-attention with no masks and no
    weights returned: `in_proj` (a Linear on the packed `in_proj_weight`), one `qkv_attention` on
    its output, and `out_proj`, as Kiln's own ViT (models/src/vit.rs)."""
    if not attrs.get("batch_first") or not attrs.get("qkv_same_embed_dim") or attrs.get("bias_k") or attrs.get("add_zero_attn"):
        raise Unsupported("a MultiheadAttention other than batch-first self-attention")
    if len(inputs) != 1 or not is_act(inputs[0]):
        raise Unsupported("attention over several inputs, or with masks")
    x = inputs[0]
    heads, e = int(attrs["num_heads"]), int(attrs["embed_dim"])
    w, b = params.get("in_proj_weight"), params.get("in_proj_bias")
    ow, ob = params.get("out_proj.weight"), params.get("out_proj.bias")
    if w is None or ow is None:
        raise Unsupported("MultiheadAttention without its in_proj_weight / out_proj")
    shape = tuple(x.tshape[:-1])
    qkv = cx.node({"Gemm": {"Linear": {"bias": b is not None}}}, [x, w] + ([b] if b is not None else []), "in_proj", shape + (3 * e,))
    y = cx.node({"QkvAttention": {"heads": heads, "scale": 1.0 / math.sqrt(e // heads), "bias": False}}, [qkv], "qkv_attention",
                shape + (e,))
    out = cx.node({"Gemm": {"Linear": {"bias": ob is not None}}}, [y, ow] + ([ob] if ob is not None else []), "out_proj", shape + (e,))
    cx.graph.modules[f"{cx.scope}.out_proj" if cx.scope else "out_proj"] = "torch.nn.modules.linear.NonDynamicallyQuantizableLinear"
    return [out]


@module("torchvision.models.convnext.LayerNorm2d")
def layer_norm2d(cx, attrs, inputs, params):
    """torchvision's `LayerNorm2d` (permute to NHWC, LayerNorm over C, permute back) as one
    LayerNorm over dim 1, as Kiln's `LayerNorm2d`: the same sums, no copies."""
    shape = list(attrs.get("normalized_shape") or [])
    if len(inputs) != 1 or not is_act(inputs[0]) or len(shape) != 1 or len(inputs[0].tshape) != 4:
        raise Unsupported("a LayerNorm2d other than over the channels of NCHW")
    x = cx.batched(inputs[0], 4, "LayerNorm2d")
    w, b = params.get("weight"), params.get("bias")
    affine_ = w is not None
    op = {"Norm": {"LayerNorm": {"dim": 1, "shape": shape, "eps": float(attrs["eps"]), "affine": affine_}}}
    return [cx.node(op, [x] + ([w, b] if affine_ else []), "layer_norm", x.tshape)]


def shifted_window_mask(ph: int, pw: int, w: int, shift: int) -> np.ndarray:
    """torchvision's mask of shifted windows for a padded `ph`×`pw` map, `[windows, w², w²]`: 0
    where two positions of a window come from the same region of the rolled map, -100 elsewhere.
    The regions along an axis of size `s` are `[0, s - w)`, `[s - w, s - shift)`, `[s - shift, s)`."""
    def region(x, size):
        return (x >= size - w).astype(np.int64) + (x >= size - shift).astype(np.int64)

    labels = region(np.arange(ph), ph)[:, None] * 3 + region(np.arange(pw), pw)[None, :]
    windows = labels.reshape(ph // w, w, pw // w, w).transpose(0, 2, 1, 3).reshape(-1, w * w)
    return np.where(windows[:, :, None] != windows[:, None, :], -100.0, 0.0).astype(np.float32)


@module("torchvision.models.swin_transformer.ShiftedWindowAttention")
def shifted_window_attention(cx, attrs, inputs, params):
    """torchvision's Swin (V1) window attention on `[B, H, W, C]`: pad to whole windows, roll by
    the shift, windows as `[B, windows, N, C]` (the batch stays in front), `qkv`, one packed
    `qkv_attention` whose bias is the relative position bias plus the shifted-window mask (one
    constant), `proj`, and back. Kiln's own Swin (models/src/swin.rs) is the same graph."""
    ws, shifts, heads = list(attrs["window_size"]), list(attrs["shift_size"]), int(attrs["num_heads"])
    rel = attrs.get("relative_position_bias")
    if len(inputs) != 1 or not is_act(inputs[0]) or len(inputs[0].tshape) != 4 or ws[0] != ws[1] or rel is None:
        raise Unsupported("a ShiftedWindowAttention other than square windows on [B, H, W, C]")
    x = cx.batched(inputs[0], 4, "window attention")
    b, h, w, c = x.tshape
    win = ws[0]
    pad_r, pad_b = (win - w % win) % win, (win - h % win) % win
    ph, pw = h + pad_b, w + pad_r
    shift = [0 if win >= ph else shifts[0], 0 if win >= pw else shifts[1]]
    if shift[0] != shift[1]:
        raise Unsupported(f"a shift along one axis only ({shift})")
    if pad_r or pad_b:
        x = cx.node(shape_op("Pad", pads=[0, 0, 0, pad_r, 0, pad_b], value=0.0), [x], "pad", (b, ph, pw, c))
    if shift[0]:
        x = cx.node(shape_op("Roll", shifts=[-shift[0], -shift[1]], dims=[1, 2]), [x], "roll", x.tshape)
    nh, nw, n = ph // win, pw // win, win * win
    x = cx.reshape(x, (b, nh, win, nw, win, c))
    x = cx.permute(x, [0, 1, 3, 2, 4, 5])
    x = cx.reshape(x, (b, nh * nw, n, c))
    qw, qb, pwt, pb = params.get("qkv.weight"), params.get("qkv.bias"), params.get("proj.weight"), params.get("proj.bias")
    qkv = cx.node({"Gemm": {"Linear": {"bias": qb is not None}}}, [x, qw] + ([qb] if qb is not None else []), "qkv", (b, nh * nw, n, 3 * c))
    bias = np.asarray(rel, dtype=np.float32).reshape(heads, n, n)
    name = "relative_position_bias"
    if shift[0]:
        bias = bias[None] + shifted_window_mask(ph, pw, win, shift[0])[:, None]
        name += "+shifted_window_mask"
    scale = float((c // heads) ** -0.5)
    y = cx.node({"QkvAttention": {"heads": heads, "scale": scale, "bias": True}}, [qkv, Const(f"{cx.scope}.{name}", bias)], "attention",
                (b, nh * nw, n, c))
    y = cx.node({"Gemm": {"Linear": {"bias": pb is not None}}}, [y, pwt] + ([pb] if pb is not None else []), "proj", y.tshape)
    y = cx.reshape(y, (b, nh, nw, win, win, c))
    y = cx.permute(y, [0, 1, 3, 2, 4, 5])
    y = cx.reshape(y, (b, ph, pw, c))
    if shift[0]:
        y = cx.node(shape_op("Roll", shifts=[shift[0], shift[1]], dims=[1, 2]), [y], "roll", y.tshape)
    y = cx.slice(y, 1, 0, h)
    y = cx.slice(y, 2, 0, w)
    for child in ("qkv", "proj"):
        cx.graph.modules[f"{cx.scope}.{child}"] = "torch.nn.modules.linear.Linear"
    return [y]


@module("torchvision.models.swin_transformer.PatchMerging")
def patch_merging(cx, attrs, inputs, params):
    """torchvision's `PatchMerging` (V1): the four 2×2 phases concatenated on the channels as one
    view, permute and view (`[B, H/2, 2, W/2, 2, C]` → `[B, H/2, W/2, 2(col), 2(row), C]`: channel
    block col·2 + row, torchvision's x0, x1, x2, x3), then `norm` and `reduction`."""
    if len(inputs) != 1 or not is_act(inputs[0]) or len(inputs[0].tshape) != 4:
        raise Unsupported("a PatchMerging other than on [B, H, W, C]")
    x = cx.batched(inputs[0], 4, "patch merging")
    b, h, w, c = x.tshape
    if h % 2 or w % 2:
        x = cx.node(shape_op("Pad", pads=[0, 0, 0, w % 2, 0, h % 2], value=0.0), [x], "pad", (b, h + h % 2, w + w % 2, c))
    h2, w2 = -(-h // 2), -(-w // 2)
    x = cx.reshape(x, (b, h2, 2, w2, 2, c))
    x = cx.permute(x, [0, 1, 3, 4, 2, 5])
    x = cx.reshape(x, (b, h2, w2, 4 * c))
    nw, nb, rw, rb = params.get("norm.weight"), params.get("norm.bias"), params.get("reduction.weight"), params.get("reduction.bias")
    op = {"Norm": {"LayerNorm": {"dim": 3, "shape": [4 * c], "eps": float(attrs["norm_eps"]), "affine": nw is not None}}}
    x = cx.node(op, [x] + ([nw, nb] if nw is not None else []), "norm", x.tshape)
    out = (b, h2, w2, int(rw.tshape[0]))
    return [cx.node({"Gemm": {"Linear": {"bias": rb is not None}}}, [x, rw] + ([rb] if rb is not None else []), "reduction", out)]
