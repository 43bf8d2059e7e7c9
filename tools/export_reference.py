#!/usr/bin/env python3
"""Exports PyTorch references for Kiln's bundled models and op fixtures.

Builds each model's PyTorch twin (torchvision's own classifier of the same name, CenterNet-R50 as
Kiln defines it),
loads seeded, torchvision-initialised or given weights, runs it in FP32 (TF32 off) and writes
`<model>.reference.safetensors` (`input`, `output.<name>`, `intermediate.<module path>`) and, with
`--save-weights`, `<model>.weights.safetensors` (the state_dict, loadable by Kiln's VarBuilder).
`--op-fixtures` writes `ops.reference.safetensors` instead, `--all-fixtures` every model's committed
reference (at `FIXTURE_SIZES`). See docs/REFERENCES.md.
The list of models is the `kiln` binary's (`kiln models --json`, tools/bundled.py): this script needs
the binary (--kiln), not the Rust sources. Works with torch >= 2.0 / torchvision >= 0.15.
"""

import argparse
import copy
import hashlib
import os
import re
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bundled  # noqa: E402
import seeded  # noqa: E402

# The committed references in tests/fixtures: (batch, size) by family, and the models that differ.
# 112 keeps the CPU tests fast and the files small, and is not a multiple of 32, so late stages see
# odd sizes: GoogLeNet's and SqueezeNet's ceil-mode pools keep a partial window, and the adaptive
# pools of AlexNet (2x2 -> 6x6) and VGG (3x3 -> 7x7) have overlapping bins. 160x160 keeps the YOLO
# references small (525 anchors) and the CPU executor fast.
FIXTURE_FAMILY_SIZES = {"classifier": (2, 112), "centernet": (1, 512), "yolo": (2, 160)}
FIXTURE_SIZES = {
    "resnet18": (1, 224),
    "resnet50": (1, 224),
    # ConvNeXt and RegNet halve the resolution five times (ConvNeXt's 4x4 patchify, then 2x2
    # convs): sizes divisible by 32 keep every stage whole. 96 leaves ConvNeXt's last stage 3x3
    # under its 7x7 depthwise convs (at 64 it is 2x2, and a tap that misses the input entirely
    # panics in Kiln's CPU im2col).
    "regnet_y_400mf": (2, 96),
    "convnext_tiny": (2, 96),
    # The transformers at their natural 224 (Swin-T's windows of 7 tile 56, 28, 14 and 7; ViT-B/16's
    # position embedding is built for the input size), batch 1 to keep the CPU test short.
    "swin_t": (1, 224),
    "vit_b_16": (1, 224),
    # CenterNet-R50-DCN: 128 keeps the CPU test fast (DCNs at 4x4, 8x8 and 16x16).
    "centernet_dcn": (1, 128),
    "digits_resnet": (2, 32),
}

# The bundled models by name (`kiln models --json`), read once by `main` from the kiln binary.
MODELS = {}


def load_models(kiln=None):
    MODELS.update({m["name"]: m for m in bundled.models(kiln)})


def family(model):
    return MODELS[model]["family"]


def default_size(model):
    return MODELS[model]["input_size"]


def fixture_size(model):
    return FIXTURE_SIZES.get(model) or FIXTURE_FAMILY_SIZES[family(model)]


# torchvision's builders take these for Kiln's variant of the model: GoogLeNet's inference path
# without the auxiliary classifiers (which only run in training) and without input re-scaling.
BUILD_KWARGS = {"googlenet": {"aux_logits": False, "transform_input": False, "init_weights": True}}


# ---- models ----------------------------------------------------------------------------------


class Backbone(nn.Module):
    """torchvision's ResNet-50 without avgpool and fc (keys `conv1.weight`, `layer1.0...`)."""

    def __init__(self):
        super().__init__()
        r = torchvision.models.resnet50(weights=None)
        self.conv1, self.bn1, self.relu, self.maxpool = r.conv1, r.bn1, r.relu, r.maxpool
        self.layer1, self.layer2, self.layer3, self.layer4 = r.layer1, r.layer2, r.layer3, r.layer4

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


class Upsampler(nn.Module):
    def __init__(self, cin=2048, channels=(256, 256, 256)):
        super().__init__()
        layers = []
        for c in channels:
            layers += [nn.ConvTranspose2d(cin, c, 4, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
            cin = c
        self.deconv_layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.deconv_layers(x)


def head_branch(cout):
    return nn.Sequential(nn.Conv2d(256, 64, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(64, cout, 1))


class Head(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.hm, self.wh, self.reg = head_branch(num_classes), head_branch(2), head_branch(2)

    def forward(self, x):
        return self.hm(x), self.wh(x), self.reg(x)


class CenterNet(nn.Module):
    """CenterNet-R50: 512x512 in, 128x128 maps out (hm logits, wh, reg)."""

    def __init__(self, num_classes=80):
        super().__init__()
        self.backbone, self.upsampler, self.head = Backbone(), Upsampler(), Head(num_classes)

    def forward(self, x):
        return self.head(self.upsampler(self.backbone(x)))


class DCN(torchvision.ops.DeformConv2d):
    """The original CenterNet's DCN (DCNv2's `DCN` module) on torchvision's op: a 3x3 conv
    `conv_offset_mask` predicts 27 channels, the first 18 are the (dy, dx) offsets of the 9 taps,
    the last 9 the mask (through a sigmoid). Keys: `weight`, `bias`, `conv_offset_mask.{weight,bias}`
    (Kiln's twin: kiln_models::centernet_dcn::Dcn)."""

    def __init__(self, cin, cout):
        super().__init__(cin, cout, 3, padding=1, bias=True)
        self.conv_offset_mask = nn.Conv2d(cin, 27, 3, padding=1)

    def forward(self, x):
        om = self.conv_offset_mask(x)
        return super().forward(x, om[:, :18], torch.sigmoid(om[:, 18:]))


class UpsamplerDCN(nn.Module):
    """CenterNet's `resnet_dcn` upsampler: 3 x [DCN, BN, ReLU, ConvTranspose2d(4, s=2, p=1), BN, ReLU]."""

    def __init__(self, cin=2048, channels=(256, 256, 256)):
        super().__init__()
        layers = []
        for c in channels:
            layers += [DCN(cin, c), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
            layers += [nn.ConvTranspose2d(c, c, 4, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
            cin = c
        self.deconv_layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.deconv_layers(x)


class CenterNetDCN(CenterNet):
    """CenterNet-R50-DCN: CenterNet-R50 with a deformable 3x3 conv before each upsampling deconv."""

    def __init__(self, num_classes=80):
        super().__init__(num_classes)
        self.upsampler = UpsamplerDCN()


def centernet_decode(hm, wh, reg, k=100):
    """Kiln's `centernet_decode` op: sigmoid, 3x3 peak keeping, top-K over classes x positions
    (ties: lower flat index first), boxes (x1, y1, x2, y2, score, class) in map coordinates."""
    n, c, h, w = hm.shape
    heat = torch.sigmoid(hm)
    pooled = F.max_pool2d(heat, 3, stride=1, padding=1)
    heat = torch.where(pooled == heat, heat, torch.zeros_like(heat))
    # A stable descending sort keeps equal scores in index order; torch.topk does not promise it.
    scores, idx = torch.sort(heat.reshape(n, -1), dim=1, descending=True, stable=True)
    scores, idx = scores[:, :k], idx[:, :k]
    cls, pos = idx // (h * w), idx % (h * w)
    ys, xs = pos // w, pos % w

    def at(t, ch):
        return torch.gather(t[:, ch].reshape(n, -1), 1, pos)

    cx, cy = xs.float() + at(reg, 0), ys.float() + at(reg, 1)
    bw, bh = at(wh, 0), at(wh, 1)
    return torch.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2, scores, cls.float()], dim=2)


def build_yolo(yaml):
    """Ultralytics' `DetectionModel(yaml)` with its own random init, in eval mode (not fused).
    Ultralytics imports cv2 at import time but building and running the model never calls it: where
    OpenCV is not installed, a stand-in module lets the import succeed."""
    os.environ.setdefault("YOLO_OFFLINE", "1")
    try:
        import cv2  # noqa: F401
    except ImportError:
        import types

        class _NoCv2(types.ModuleType):
            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return lambda *a, **k: 0

        stub = _NoCv2("cv2")
        stub.__version__ = "0.0.0"
        sys.modules["cv2"] = stub
    from ultralytics.nn.tasks import DetectionModel

    return DetectionModel(yaml, verbose=False).eval()


def calibrate_yolo_head(net, model, seed):
    """A random YOLO's outputs are degenerate: with Ultralytics' init every class score is ~1e-5
    (nothing passes conf 0.25), and with measured BatchNorm statistics its logits reach ~100, so
    every score is exactly 1.0 (all ties) and the DFL softmax picks one bin. Like
    `randomise_batchnorm`, this makes the random model look trained where the tests look: the last
    1x1 conv of each level's class branch is rescaled so its logits have mean -7 and std 2 on random
    images (some anchors pass 0.25, with distinct scores spread to ~0.8), and each box branch's so its
    DFL logits have mean 0 and std 2 (spread distributions, boxes of varied sizes). The calibration
    images are drawn like the references' inputs (seeded), under another name."""
    size = default_size(model)
    head = net.model[-1]
    convs = [(head.cv2[i][-1], 0.0) for i in range(head.nl)] + [(head.cv3[i][-1], -7.0) for i in range(head.nl)]
    seen = {}
    hooks = [c.register_forward_hook(lambda m, i, o, c=c: seen.__setitem__(c, o)) for c, _ in convs]
    net.eval()
    with torch.no_grad():
        net(torch.from_numpy(seeded.weight(f"calibration.{seed}", [2, 3, size, size])))
        for conv, mean in convs:
            o = seen[conv]
            k = 2.0 / o.std()
            conv.weight.mul_(k)
            conv.bias.copy_((conv.bias - o.mean()) * k + mean)
    for h in hooks:
        h.remove()


def yolo_nms(pred, conf=0.25, iou=0.7, k=300, cap=4096):
    """Kiln's `yolo_nms` op with torchvision's `batched_nms`: per anchor its best class when its
    score is > conf, the `cap` best candidates (ties to the lower anchor), class-aware NMS, the
    best `k` kept; rows (x1, y1, x2, y2, score, class), padded with (0, 0, 0, 0, 0, -1)."""
    out = torch.zeros(pred.shape[0], k, 6)
    out[..., 5] = -1
    for n, p in enumerate(pred.float().cpu()):
        scores, cls = p[4:].max(0)
        idx = (scores > conf).nonzero().squeeze(1)
        order = torch.sort(scores[idx], descending=True, stable=True).indices[:cap]
        idx = idx[order]
        xy, wh = p[:2, idx].T, p[2:4, idx].T / 2
        boxes = torch.cat((xy - wh, xy + wh), 1)
        keep = torchvision.ops.batched_nms(boxes, scores[idx], cls[idx], iou)[:k]
        rows = torch.cat((boxes[keep], scores[idx][keep, None], cls[idx][keep, None].float()), 1)
        out[n, : len(rows)] = rows
    return out


def export_yolo_nms_fixture(out_dir):
    """`yolo_nms.reference.safetensors`: synthetic predictions [2, 4 + 3, 5000] whose boxes crowd
    around 40 centres (so NMS suppresses), with unique scores (no ties) and more candidates than
    the 4096 cap, and `yolo_nms`'s output for two settings (`default`: conf 0.25, IoU 0.7, k 300;
    `strict`: conf 0.5, IoU 0.3, k 1000, fewer kept than k)."""
    g = torch.Generator().manual_seed(7)
    n, c, a = 2, 3, 5000
    centres = torch.rand(n, 2, 40, generator=g) * 200
    which = torch.randint(0, 40, (n, 1, a), generator=g).expand(n, 2, a)
    cxcy = centres.gather(2, which) + torch.randn(n, 2, a, generator=g) * 4
    wh = 10 + torch.rand(n, 2, a, generator=g) * 30
    scores = (torch.randperm(n * c * a, generator=g).float() + 1) / (n * c * a + 1)
    pred = torch.cat((cxcy, wh, scores.view(n, c, a)), 1)
    tensors = {
        "input": pred,
        "output.default": yolo_nms(pred),
        "output.strict": yolo_nms(pred, conf=0.5, iou=0.3, k=1000),
    }
    path = os.path.join(out_dir, "yolo_nms.reference.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    counts = [int((tensors[f"output.{s}"][..., 5] >= 0).sum()) for s in ("default", "strict")]
    print(f"wrote {path}: detections per setting {counts}")


def digits_resnet():
    from train_digits import DigitsResNet

    return DigitsResNet()


# The twins of the bundled models that are neither torchvision's nor Ultralytics' (a test checks
# that every such model of `BUNDLED` has one here).
OWN_BUILDERS = {"centernet": lambda: CenterNet(80), "centernet_dcn": lambda: CenterNetDCN(80), "digits_resnet": digits_resnet}


def build(model):
    if MODELS[model]["torchvision"]:
        return getattr(torchvision.models, model)(weights=None, **BUILD_KWARGS.get(model, {}))
    if family(model) == "yolo":
        # Ultralytics packages the yaml of each of its models under the model's name.
        return build_yolo(f"{model}.yaml")
    if model in OWN_BUILDERS:
        return OWN_BUILDERS[model]()
    raise SystemExit(f"no PyTorch twin for `{model}`: add its builder to OWN_BUILDERS in tools/export_reference.py")


def seeded_state_dict(module):
    out = {}
    for key, value in module.state_dict().items():
        if key.endswith("num_batches_tracked") or not value.is_floating_point():
            # Integer buffers (BatchNorm's counter, Swin's relative_position_index) stay as built.
            out[key] = value
        else:
            out[key] = torch.from_numpy(seeded.weight(key, value.shape))
    return out


def randomise_batchnorm(net, model, seed, consistent=False):
    """torchvision initialises BatchNorm to the identity (mean 0, var 1, weight 1, bias 0), which
    would hide a folding bug, and with those statistics a deep random network's activations grow
    past FP16's range. So each BatchNorm's weight and bias are drawn at random around 1 and 0 and
    its running mean and variance are measured over a few random batches.

    By default the statistics are measured first (every BatchNorm still the identity) and the
    affine parameters drawn after, so a layer's statistics do not match what its input becomes
    once the layers before it scale and shift: activations drift with depth. The model tests'
    bounds were set on these networks. `consistent=True` draws the affine parameters first and
    measures the statistics through them, as training leaves a network: every BatchNorm then
    normalises its input. tools/export_fp16_reference.py uses it, because in a drifting network
    (RegNetY-400MF: activations' std grows to 57 in its last stage) FP16's error depends on which
    way a handful of weights round, for PyTorch and Kiln alike, rather than on the mechanism."""
    g = torch.Generator().manual_seed(seed + 1)
    size = default_size(model)
    norms = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]

    def draw_affine():
        for m in norms:
            m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
            m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)

    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over the calibration batches
    net.train()
    with torch.no_grad():
        if consistent:
            draw_affine()
        for _ in range(2):
            x = torch.randn(4, 3, size, size, generator=g)
            net(x)
        if not consistent:
            draw_affine()
    net.eval()


def randomise_zero_head(net, seed):
    """torchvision initialises ViT's classifier head to zeros, so every logit would be 0 and no
    comparison could fail: the head is drawn at random instead (std 0.02, as its other Linears)."""
    g = torch.Generator().manual_seed(seed + 2)
    head = net.heads.head
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 0.02)
        head.bias.copy_(torch.randn(head.bias.shape, generator=g) * 0.02)


def load_weights(model, net, weights, seed, consistent_batchnorm=False):
    if weights == "seeded":
        net.load_state_dict(seeded_state_dict(net))
    elif weights == "torchvision":
        # torchvision's own initialisation, made reproducible: rebuild after seeding.
        torch.manual_seed(seed)
        net = build(model)
        # The classifiers' BatchNorms get measured statistics; CenterNet keeps torchvision's
        # initialisation, whose top-100 detections are well separated for the FP16 check.
        if MODELS[model]["torchvision"] or family(model) == "yolo":
            randomise_batchnorm(net, model, seed, consistent_batchnorm)
        if family(model) == "yolo":
            calibrate_yolo_head(net, model, seed)
        if model == "vit_b_16":
            randomise_zero_head(net, seed)
    else:
        net.load_state_dict(load_file(weights))
    return net


def run_model(net, model, x):
    if family(model) == "yolo":
        predictions = net(x)[0]  # eval mode: (y, raw head outputs)
        # PyTorch's own FP16 run of the same model (as Ultralytics' predictor with half=True): the
        # share of FP32 detections it keeps is the baseline tests/gpu_yolo.rs holds Kiln's FP16 to.
        half = copy.deepcopy(net).half()
        fp16 = half(x.half())[0].float()
        return {"predictions": predictions, "detections": yolo_nms(predictions), "detections_fp16": yolo_nms(fp16)}
    if family(model) == "centernet":
        hm, wh, reg = net(x)
        return {"hm": hm, "wh": wh, "reg": reg, "detections": centernet_decode(hm, wh, reg)}
    return {"logits": net(x)}


# ---- intermediates and statistics ------------------------------------------------------------


def attach_hooks(net, paths):
    """Forward hooks on named modules. A module called several times (torchvision reuses `relu`)
    records each call: `<path>` holds the last one, `<path>#<k>` every call when there are more."""
    modules = dict(net.named_modules())
    if paths == ["all"]:
        paths = [p for p, m in modules.items() if p and not list(m.children())]
    missing = [p for p in paths if p not in modules]
    if missing:
        raise SystemExit(f"--intermediates: no module named {missing} (e.g. {list(modules)[1:6]})")
    calls = {}

    def hook(path):
        def fn(_module, _inputs, output):
            if isinstance(output, tuple):
                output = output[0]
            # clone: inplace ReLUs later overwrite what this module returned.
            calls.setdefault(path, []).append(output.detach().clone())

        return fn

    handles = [modules[p].register_forward_hook(hook(p)) for p in paths]
    return calls, handles


def flatten_calls(calls):
    out = {}
    for path, values in calls.items():
        out[f"intermediate.{path}"] = values[-1]
        if len(values) > 1:
            for i, v in enumerate(values):
                out[f"intermediate.{path}#{i}"] = v
    return out


def print_stats(net, x):
    """Std and max |x| of every module's output, to check that the seeded weights keep activations
    O(1) (FP16 engines need |x| well below its 65504 limit). Prints the stages and blocks, and the
    largest |x| over all modules, leaves inside blocks included."""
    rows = []

    def hook(path):
        def fn(_m, _i, out):
            outs = out if isinstance(out, tuple) else (out,)
            for j, o in enumerate(outs):
                rows.append((path + (f"[{j}]" if len(outs) > 1 else ""), o.std().item(), o.abs().max().item()))

        return fn

    handles = [m.register_forward_hook(hook(path)) for path, m in net.named_modules() if path]
    with torch.no_grad():
        net(x)
    for h in handles:
        h.remove()
    print(f"{'module':40} {'std':>10} {'max|x|':>10}")
    for path, std, mx in rows:
        if not re.search(r"layer\d\.\d+\.", path):
            print(f"{path:40} {std:10.4f} {mx:10.3f}")
    worst = max(rows, key=lambda r: r[2])
    print(f"largest |activation| over all {len(rows)} module outputs: {worst[2]:.3f} (at {worst[0]})")


# ---- op fixtures ----------------------------------------------------------------------------


class ParamOp(nn.Module):
    """`fn(x, p)` with a constant parameter `p` (a layer scale, a position embedding)."""

    def __init__(self, name, shape, fn):
        super().__init__()
        self.name, self.fn = name, fn
        self.register_parameter(name, nn.Parameter(torch.zeros(shape)))

    def forward(self, x):
        return self.fn(x, getattr(self, self.name))


# Op fixtures whose input spans [-4, 4] (or more) rather than [-1, 1], to reach every branch.
WIDE_INPUTS = {"sigmoid": 4.0, "silu": 4.0, "hardswish": 4.0, "hardsigmoid": 4.0, "gelu_exact": 4.0, "gelu_tanh": 4.0, "tanh": 4.0}
WIDE_INPUTS.update({"exp": 4.0, "log": 4.0, "sqrt": 4.0, "rsqrt": 4.0, "erf": 4.0, "elu": 4.0, "elu_alpha": 4.0, "mish": 8.0})
WIDE_INPUTS.update({"pow_square": 3.0, "pow_cube": 3.0, "pow_sqrt": 3.0, "abs": 2.0})
WIDE_INPUTS.update({"asinh": 4.0, "clamp_relu6": 8.0, "clamp_hardtanh": 4.0, "softplus": 4.0, "softplus_beta2_threshold": 4.0})
# Quantisation cases span the saturation range of their scales.
WIDE_INPUTS.update({k: 4.0 for k in ["fake_quantize_per_tensor_affine", "fake_quantize_per_tensor_zero_point", "fake_quantize_per_channel_affine", "fake_quantize_fp8_e4m3", "fake_quantize_fp8_per_channel", "quantize_int8_per_tensor", "quantize_int8_per_channel", "quantize_fp8", "dequantize_int8_per_tensor", "dequantize_int8_per_channel", "dequantize_fp8"]})


def op_cases():
    """(case, module or function, {param: shape}, [input shapes]) for every op fixture.
    Params and inputs are seeded (named `<case>.<param>`, `<case>.input`, `<case>.other`)."""
    c = []

    def conv(name, cin, cout, k, shape, **kw):
        m = nn.Conv2d(cin, cout, k, **kw)
        c.append((name, m, [shape]))

    conv("conv2d_stride2_pad", 3, 8, 3, [1, 3, 13, 13], stride=2, padding=1)
    conv("conv2d_dilation2", 4, 5, 3, [1, 4, 12, 12], padding=2, dilation=2)
    conv("conv2d_groups", 8, 12, 3, [2, 8, 10, 10], padding=1, groups=4)
    conv("conv2d_depthwise", 6, 6, 3, [1, 6, 11, 11], stride=2, padding=1, groups=6)
    conv("conv2d_nonsquare_batch3", 3, 4, 5, [3, 3, 9, 17], padding=1, bias=False)
    c.append(("max_pool2d_ceil", nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True), [[2, 3, 10, 13]]))
    c.append(("max_pool2d_default", nn.MaxPool2d(2), [[1, 3, 9, 12]]))
    c.append(("avg_pool2d_pad", nn.AvgPool2d(3, stride=2, padding=1), [[1, 3, 9, 12]]))
    c.append(("avg_pool2d_pad_exclude", nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False), [[1, 3, 9, 12]]))
    c.append(("avg_pool2d_ceil", nn.AvgPool2d(2, stride=2, ceil_mode=True), [[2, 2, 7, 9]]))
    c.append(("adaptive_avg_pool2d_3x3", nn.AdaptiveAvgPool2d(3), [[2, 4, 7, 10]]))
    c.append(("adaptive_max_pool2d_3x3", nn.AdaptiveMaxPool2d(3), [[2, 4, 7, 10]]))
    c.append(("adaptive_max_pool2d_1x1", lambda a: F.adaptive_max_pool2d(a, 1), [[2, 8, 5, 6]]))
    c.append(("conv_transpose2d_outpad_groups", nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), [[1, 4, 5, 7]]))
    c.append(("conv_transpose2d_k4s2", nn.ConvTranspose2d(6, 4, 4, stride=2, padding=1, bias=False), [[2, 6, 5, 5]]))
    c.append(("batch_norm2d_eps", nn.BatchNorm2d(5, eps=1e-3), [[2, 5, 4, 6]]))
    c.append(("linear", nn.Linear(20, 7), [[3, 20]]))
    c.append(("leaky_relu", nn.LeakyReLU(0.2), [[2, 3, 5, 6]]))
    c.append(("sigmoid", nn.Sigmoid(), [[2, 3, 5, 6]]))
    c.append(("relu", nn.ReLU(), [[2, 3, 5, 6]]))
    c.append(("cat", lambda a, b: torch.cat([a, b], dim=1), [[2, 3, 4, 5], [2, 5, 4, 5]]))
    c.append(("mul", lambda a, b: a * b, [[2, 3, 4, 5], [2, 3, 4, 5]]))
    c.append(("add", lambda a, b: a + b, [[2, 3, 4, 5], [2, 3, 4, 5]]))
    c.append(("flatten", lambda a: torch.flatten(a, 1), [[2, 3, 4, 5]]))
    # Normalisations, reductions and matrix products (issue 7).
    from torchvision.models.convnext import LayerNorm2d

    class MatmulWeight(nn.Module):
        def __init__(self, shape):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(shape))

        def forward(self, a):
            return a @ self.weight

    c.append(("softmax_dim1", nn.Softmax(dim=1), [[2, 5, 3, 4]]))
    c.append(("softmax_last", lambda a: F.softmax(a * 4, dim=-1), [[3, 7, 33]]))
    c.append(("softmax_mid", lambda a: torch.softmax(a, dim=2), [[2, 3, 6, 5]]))
    c.append(("layer_norm_last", nn.LayerNorm(24), [[2, 5, 24]]))
    c.append(("layer_norm_convnext_nhwc", nn.LayerNorm(8, eps=1e-6), [[2, 5, 6, 8]]))
    c.append(("layer_norm_2d_torchvision", LayerNorm2d(8, eps=1e-6), [[2, 8, 5, 6]]))
    c.append(("layer_norm_two_dims", nn.LayerNorm([6, 7], eps=1e-3), [[3, 4, 6, 7]]))
    c.append(("layer_norm_no_affine", nn.LayerNorm(10, elementwise_affine=False), [[2, 3, 10]]))
    c.append(("group_norm", nn.GroupNorm(2, 6), [[2, 6, 5, 7]]))
    c.append(("group_norm_eps_rank3", nn.GroupNorm(3, 6, eps=1e-3), [[3, 6, 11]]))
    c.append(("group_norm_instance_norm_affine", nn.InstanceNorm2d(4, affine=True), [[2, 4, 6, 5]]))
    c.append(("group_norm_instance_norm", nn.InstanceNorm2d(5), [[2, 5, 4, 7]]))
    c.append(("mean_hw", lambda a: a.mean((2, 3)), [[2, 6, 5, 7]]))
    c.append(("mean_hw_keepdim", lambda a: a.mean((2, 3), keepdim=True), [[3, 4, 3, 5]]))
    c.append(("mean_last", lambda a: a.mean(-1), [[3, 4, 9]]))
    c.append(("mean_dim1_keepdim", lambda a: a.mean(1, keepdim=True), [[2, 5, 3, 4]]))
    c.append(("amax_hw", lambda a: a.amax((2, 3)), [[2, 6, 5, 7]]))
    c.append(("amax_dim1_keepdim", lambda a: torch.amax(a, 1, keepdim=True), [[2, 5, 3, 4]]))
    c.append(("argmax_dim1", lambda a: a.argmax(1).float(), [[2, 21, 6, 7]]))
    c.append(("argmax_last_keepdim", lambda a: a.argmax(-1, keepdim=True).float(), [[3, 4, 40]]))
    c.append(("matmul_bmm", torch.bmm, [[2, 5, 7], [2, 7, 3]]))
    c.append(("matmul_broadcast", torch.matmul, [[2, 3, 4, 6], [2, 1, 6, 5]]))
    c.append(("matmul_weight", MatmulWeight([9, 4]), [[2, 5, 9]]))
    c.append(("matmul_weight_batched", MatmulWeight([3, 6, 4]), [[2, 3, 5, 6]]))
    c.append(("linear_rank3", nn.Linear(12, 7), [[2, 5, 12]]))
    c.append(("linear_rank4_nobias", nn.Linear(8, 3, bias=False), [[2, 3, 4, 8]]))
    # Shape ops (src/ops/shape/): reshape, permute, flatten ranges, slices, cat on any dim, pad.
    c.append(("reshape_infer", lambda a: a.reshape(3, 2, -1, 5), [[3, 4, 3, 5]]))
    c.append(("reshape_view_flat", lambda a: a.view(2, -1), [[2, 3, 5, 7]]))
    c.append(("reshape_channel_shuffle", lambda a: a.view(2, 3, 2, 5, 7).transpose(1, 2).contiguous().view(2, 6, 5, 7), [[2, 6, 5, 7]]))
    c.append(("permute_nhwc", lambda a: a.permute(0, 2, 3, 1), [[2, 3, 4, 5]]))
    c.append(("permute_rank5", lambda a: a.permute(0, 3, 1, 4, 2), [[2, 2, 3, 4, 5]]))
    c.append(("permute_transpose_last", lambda a: a.transpose(-1, -2), [[3, 5, 7]]))
    c.append(("flatten_start2", lambda a: torch.flatten(a, 2), [[2, 3, 4, 5]]))
    c.append(("flatten_range_mid", lambda a: torch.flatten(a, 1, 2), [[3, 3, 4, 5]]))
    c.append(("slice_narrow", lambda a: a.narrow(2, 1, 3), [[2, 3, 7, 5]]))
    c.append(("slice_narrow_last", lambda a: a.narrow(-1, 2, 4), [[3, 4, 6, 9]]))
    c.append(("slice_chunk_reversed", lambda a: torch.cat(torch.chunk(a, 3, dim=3)[::-1], dim=3), [[2, 3, 4, 7]]))
    c.append(("slice_chunk_fewer", lambda a: torch.cat(torch.chunk(a, 4, dim=1)[::-1], dim=1), [[2, 6, 3, 5]]))
    c.append(("slice_split_sizes", lambda a: torch.cat(torch.split(a, [2, 4, 1], dim=1)[::-1], dim=1), [[3, 7, 2, 5]]))
    c.append(("cat_dim2", lambda a, b: torch.cat([a, b], dim=2), [[2, 3, 4, 5], [2, 3, 6, 5]]))
    c.append(("cat_last", lambda a, b: torch.cat([a, b], dim=-1), [[3, 2, 5, 3], [3, 2, 5, 4]]))
    c.append(("cat_rank2", lambda a, b: torch.cat([a, b], dim=1), [[3, 5], [3, 7]]))
    c.append(("pad_constant", lambda a: F.pad(a, (1, 2, 0, 3), value=0.5), [[2, 3, 4, 5]]))
    c.append(("pad_channels", lambda a: F.pad(a, (1, 0, 0, 2, 2, 1), value=-2.0), [[2, 3, 4, 5]]))
    c.append(("pad_zero2d", nn.ZeroPad2d((2, 1, 1, 0)), [[3, 2, 5, 4]]))
    c.append(("pad_constant2d", nn.ConstantPad2d((1, 1, 2, 2), -1.5), [[1, 3, 4, 6]]))
    c.append(("reflection_pad_2d", lambda a: F.pad(a, (2, 1, 3, 1), mode="reflect"), [[2, 3, 5, 4]]))
    c.append(("reflection_pad_1d_rank3", nn.ReflectionPad1d((3, 2)), [[2, 3, 6]]))
    c.append(("replication_pad_2d", nn.ReplicationPad2d((1, 3, 2, 0)), [[2, 3, 4, 5]]))
    c.append(("replication_pad_3d", lambda a: F.pad(a, (1, 1, 0, 2, 1, 0), mode="replicate"), [[1, 2, 3, 4, 3]]))
    # Unary ops (inputs scaled by WIDE_INPUTS so every branch of each op is exercised).
    c.append(("silu", nn.SiLU(), [[2, 3, 5, 6]]))
    c.append(("hardswish", nn.Hardswish(), [[2, 3, 5, 6]]))
    c.append(("hardsigmoid", nn.Hardsigmoid(), [[2, 3, 5, 6]]))
    c.append(("gelu_exact", nn.GELU(), [[2, 3, 5, 6]]))
    c.append(("gelu_tanh", nn.GELU(approximate="tanh"), [[2, 3, 5, 6]]))
    c.append(("tanh", nn.Tanh(), [[2, 3, 5, 6]]))
    c.append(("asinh", torch.asinh, [[2, 3, 5, 6]]))
    c.append(("clamp_relu6", nn.ReLU6(), [[2, 3, 5, 6]]))
    c.append(("clamp_hardtanh", nn.Hardtanh(-2, 3), [[2, 3, 5, 6]]))
    c.append(("clamp_tensor", lambda a: torch.clamp(a, -0.5, 0.7), [[2, 3, 5, 6]]))
    c.append(("affine_mul_add", lambda a: a * 0.5 + 3, [[2, 3, 5, 6]]))
    c.append(("affine_rsub", lambda a: 1 - a, [[2, 3, 5, 6]]))
    c.append(("affine_div", lambda a: a / 6, [[2, 3, 5, 6]]))
    c.append(("softplus", nn.Softplus(), [[2, 3, 5, 6]]))
    c.append(("softplus_beta2_threshold", nn.Softplus(beta=2.0, threshold=1.5), [[2, 3, 5, 6]]))
    # Issue 26's unary ops: math functions, ELU, Mish, pow with a number exponent.
    c.append(("exp", torch.exp, [[2, 3, 5, 6]]))
    c.append(("log", lambda a: torch.log(a.abs()), [[2, 3, 5, 6]]))
    c.append(("sqrt", lambda a: torch.sqrt(a.abs()), [[2, 3, 5, 6]]))
    c.append(("rsqrt", lambda a: torch.rsqrt(a.abs() + 0.1), [[2, 3, 5, 6]]))
    c.append(("reciprocal", lambda a: torch.reciprocal(a.abs() + 0.5), [[2, 3, 5, 6]]))
    c.append(("reciprocal_signed", lambda a: 1.0 / a, [[2, 3, 5, 6]]))
    c.append(("abs", torch.abs, [[2, 3, 5, 6]]))
    c.append(("erf", torch.erf, [[2, 3, 5, 6]]))
    c.append(("elu", nn.ELU(), [[2, 3, 5, 6]]))
    c.append(("elu_alpha", lambda a: F.elu(a, alpha=0.5), [[2, 3, 5, 6]]))
    c.append(("mish", nn.Mish(), [[2, 3, 5, 6]]))
    c.append(("pow_square", lambda a: a ** 2, [[2, 3, 5, 6]]))
    c.append(("pow_cube", lambda a: torch.pow(a, 3), [[2, 3, 5, 6]]))
    c.append(("pow_sqrt", lambda a: a.abs() ** 0.5, [[2, 3, 5, 6]]))
    c.append(("pow_minus2", lambda a: (a.abs() + 0.5) ** -2, [[2, 3, 5, 6]]))
    # Binary ops with broadcasting; constants as module parameters (seeded as `<case>.<name>`).
    c.append(("sub", lambda a, b: a - b, [[2, 3, 4, 5], [2, 3, 4, 5]]))
    c.append(("div", lambda a, b: a / (b.abs() + 0.5), [[2, 3, 4, 5], [2, 3, 4, 5]]))
    c.append(("mul_squeeze_excitation", lambda a, b: a * b, [[2, 6, 5, 7], [2, 6, 1, 1]]))
    c.append(("sub_broadcast_rows", lambda a, b: a - b, [[2, 3, 4, 5], [2, 1, 4, 5]]))
    c.append(("add_weight_c11", ParamOp("scale", [6, 1, 1], torch.add), [[2, 6, 5, 7]]))
    c.append(("mul_weight_c11", ParamOp("gamma", [6, 1, 1], torch.mul), [[2, 6, 5, 7]]))
    c.append(("add_position_embedding", ParamOp("pos_embedding", [1, 9, 8], torch.add), [[3, 9, 8]]))
    # Resize: PyTorch's legacy `nearest` and bilinear; with a scale factor the index arithmetic
    # uses 1 / scale_factor (1.7 on 7 pixels picks other pixels than 7 / 11 would).
    up = nn.Upsample
    c.append(("upsample_nearest2d_scale2", up(scale_factor=2), [[2, 3, 5, 7]]))
    c.append(("upsample_nearest2d_scale1_5", up(scale_factor=1.5), [[1, 2, 7, 9]]))
    c.append(("upsample_nearest2d_scale1_7", lambda a: F.interpolate(a, scale_factor=1.7), [[1, 2, 7, 6]]))
    c.append(("upsample_nearest2d_recompute", lambda a: F.interpolate(a, scale_factor=1.7, recompute_scale_factor=True), [[1, 2, 7, 6]]))
    c.append(("upsample_nearest2d_scale_hw", up(scale_factor=(2, 1.5)), [[2, 3, 4, 5]]))
    c.append(("upsample_nearest2d_scale_near1", up(scale_factor=1.05), [[1, 2, 10, 9]]))
    c.append(("upsample_nearest2d_size", up(size=(11, 4)), [[2, 3, 5, 7]]))
    c.append(("upsample_bilinear2d_scale2", up(scale_factor=2, mode="bilinear"), [[2, 3, 5, 7]]))
    c.append(("upsample_bilinear2d_scale2_align_corners", up(scale_factor=2, mode="bilinear", align_corners=True), [[2, 3, 5, 7]]))
    c.append(("upsample_bilinear2d_scale1_5", up(scale_factor=1.5, mode="bilinear"), [[1, 2, 7, 9]]))
    c.append(("upsample_bilinear2d_scale1_7", lambda a: F.interpolate(a, scale_factor=1.7, mode="bilinear"), [[1, 2, 7, 6]]))
    c.append(("upsample_bilinear2d_down", lambda a: F.interpolate(a, scale_factor=0.6, mode="bilinear"), [[1, 2, 10, 9]]))
    c.append(("upsample_bilinear2d_size", up(size=(9, 13), mode="bilinear"), [[3, 2, 5, 7]]))
    c.append(("upsample_bilinear2d_size_align_corners", up(size=(9, 4), mode="bilinear", align_corners=True), [[2, 3, 5, 7]]))
    # Roll (Swin's cyclic shift) and attention (src/ops/attention/): q is the input, k and v
    # are `other[:, 0]` and `other[:, 1]`; odd lengths, batch > 1, a bias that broadcasts.
    c.append(("roll_swin_shift", lambda a: torch.roll(a, shifts=(-3, -3), dims=(1, 2)), [[2, 7, 9, 5]]))
    c.append(("roll_mixed", lambda a: torch.roll(a, shifts=(11, -2), dims=(3, 1)), [[3, 4, 5, 6]]))

    class Attn(nn.Module):
        def __init__(self, bias_shape=None, scale=None):
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(bias_shape)) if bias_shape else None
            self.scale = scale

        def forward(self, q, kv):
            return F.scaled_dot_product_attention(q, kv[:, 0], kv[:, 1], attn_mask=self.bias, scale=self.scale)

    c.append(("attention_vit", Attn(), [[2, 3, 17, 16], [2, 2, 3, 13, 16]]))
    c.append(("attention_swin_bias", Attn([4, 3, 7, 7], 0.3), [[2, 4, 3, 7, 8], [2, 2, 4, 3, 7, 8]]))
    c.append(("attention_bias_rows", Attn([5, 1], None), [[3, 2, 5, 4], [3, 2, 2, 9, 4]]))

    # Packed multi-head self-attention (qkv_attention): the input's last dim is q, k, v, each
    # `heads` heads of D (`nn.MultiheadAttention`'s in_proj order, Swin's qkv Linear); the output
    # has the heads concatenated, as both models feed it to their output projection.
    class QkvAttn(nn.Module):
        def __init__(self, heads, bias_shape=None, scale=None):
            super().__init__()
            self.heads, self.scale = heads, scale
            self.bias = nn.Parameter(torch.zeros(bias_shape)) if bias_shape else None

        def forward(self, x):
            *lead, n, e3 = x.shape
            d = e3 // (3 * self.heads)
            q, k, v = x.reshape(*lead, n, 3, self.heads, d).unbind(-3)
            q, k, v = (t.transpose(-3, -2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, scale=self.scale)
            return y.transpose(-3, -2).reshape(*lead, n, self.heads * d)

    c.append(("qkv_attention_vit", QkvAttn(3), [[2, 17, 144]]))
    c.append(("qkv_attention_swin_bias", QkvAttn(3, [4, 3, 7, 7], 0.3), [[2, 4, 7, 72]]))
    c.append(("qkv_attention_head_bias", QkvAttn(2, [2, 5, 5]), [[3, 5, 30]]))
    # Quantisation (src/ops/quant.rs): PyTorch's fake-quant and quantize ops, and the fp8 e4m3
    # round trip after scaling (clamped first: Kiln saturates, PyTorch's cast would give NaN).
    def fp8(a, scale):
        inv = 1.0 / torch.tensor(scale, dtype=torch.float32)
        return torch.clamp(a * inv, -448.0, 448.0).to(torch.float8_e4m3fn).float()

    zeros3 = torch.zeros(3, dtype=torch.int32)
    ch_scales = torch.tensor([0.01, 0.02, 0.05])
    c.append(("fake_quantize_per_tensor_affine", lambda a: torch.fake_quantize_per_tensor_affine(a, 0.02, 0, -128, 127), [[2, 3, 5, 6]]))
    c.append(("fake_quantize_per_tensor_zero_point", lambda a: torch.fake_quantize_per_tensor_affine(a, 0.03, 10, 0, 255), [[2, 3, 5, 6]]))
    c.append(("fake_quantize_per_channel_affine", lambda a: torch.fake_quantize_per_channel_affine(a, ch_scales, zeros3, 1, -128, 127), [[2, 3, 5, 6]]))
    w_scales = torch.tensor([0.004, 0.01, 0.02, 0.03])
    c.append(("fake_quantize_per_channel_axis0", lambda a: torch.fake_quantize_per_channel_affine(a, w_scales, torch.zeros(4, dtype=torch.int32), 0, -127, 127), [[4, 3, 3, 3]]))
    c.append(("fake_quantize_fp8_e4m3", lambda a: fp8(a, 0.005) * torch.tensor(0.005), [[2, 3, 5, 6]]))
    fp8_ch = torch.tensor([0.001, 0.01, 0.1]).view(1, 3, 1, 1)
    c.append(("fake_quantize_fp8_per_channel", lambda a: fp8(a, fp8_ch) * fp8_ch, [[2, 3, 5, 6]]))
    c.append(("quantize_int8_per_tensor", lambda a: torch.quantize_per_tensor(a, 0.02, 0, torch.qint8).int_repr().float(), [[2, 3, 5, 6]]))
    qc = lambda a: torch.quantize_per_channel(a, ch_scales.double(), torch.zeros(3, dtype=torch.int64), 1, torch.qint8)
    c.append(("quantize_int8_per_channel", lambda a: qc(a).int_repr().float(), [[2, 3, 5, 6]]))
    c.append(("quantize_fp8", lambda a: fp8(a, 0.02), [[2, 3, 5, 6]]))
    c.append(("dequantize_int8_per_tensor", lambda a: torch.dequantize(torch.quantize_per_tensor(a, 0.03125, 0, torch.qint8)), [[2, 3, 5, 6]]))
    c.append(("dequantize_int8_per_channel", lambda a: torch.dequantize(qc(a)), [[2, 3, 5, 6]]))
    c.append(("dequantize_fp8", lambda a: fp8(a, 0.03125) * 0.03125, [[2, 3, 5, 6]]))
    return c


def export_op_fixtures(out_dir):
    tensors = {}
    for case, op, shapes in op_cases():
        inputs = []
        for name, shape in zip(["input", "other"], shapes):
            # Sigmoid's input spans [-4, 4] so both tails are exercised.
            scale = WIDE_INPUTS.get(case, 1.0)
            x = torch.from_numpy(seeded.weight(f"{case}.{name}", shape)) * scale
            tensors[f"{case}.{name}"] = x
            inputs.append(x)
        if isinstance(op, nn.Module):
            op.eval()
            sd = {k: torch.from_numpy(seeded.weight(f"{case}.{k}", v.shape)) for k, v in op.state_dict().items() if "num_batches" not in k}
            op.load_state_dict(sd, strict=False)
            for k, v in sd.items():
                tensors[f"{case}.{k}"] = v
        with torch.no_grad():
            tensors[f"{case}.output"] = op(*inputs).clone()
    path = os.path.join(out_dir, "ops.reference.safetensors")
    save_file({k: v.contiguous().float() for k, v in tensors.items()}, path)
    print(f"wrote {path}: {len(op_cases())} cases")


# ---- deform_conv2d fixtures (plugins/deform-conv) ----------------------------------------------

# (case, input [N, C, H, W], weight [Cout, C / groups, KH, KW], stride, padding, dilation,
#  offset groups, mask, bias, offset scale). Offsets are seeded in [-1, 1) times the scale, so
# the larger scales push many samples past the border (zero outside, partial corners).
DEFORM_CASES = [
    ("basic_mask_batch2", [2, 4, 9, 11], [6, 4, 3, 3], (1, 1), (1, 1), (1, 1), 1, True, True, 2.0),
    ("stride_dilation_og2_nomask", [1, 6, 12, 10], [8, 6, 3, 3], (2, 1), (2, 1), (2, 1), 2, False, False, 3.0),
    ("groups2_og3_kernel3x2", [2, 6, 7, 9], [4, 3, 3, 2], (1, 2), (1, 0), (1, 2), 3, True, True, 2.5),
    ("far_offsets_batch3", [3, 3, 5, 6], [5, 3, 3, 3], (1, 1), (0, 0), (1, 1), 1, True, False, 6.0),
    ("kernel1_og4_nomask", [2, 8, 6, 5], [3, 8, 1, 1], (1, 1), (0, 0), (1, 1), 4, False, True, 1.5),
]


def export_deform_fixtures(out_dir):
    """`torchvision.ops.deform_conv2d` on seeded tensors: `<case>.{input,offset,mask,weight,bias}`,
    `<case>.output` and `<case>.attrs` = (stride_h, stride_w, pad_h, pad_w, dil_h, dil_w)."""
    from torchvision.ops import deform_conv2d

    tensors = {}
    for case, xs, ws, stride, padding, dilation, og, use_mask, use_bias, scale in DEFORM_CASES:
        kh, kw = ws[2], ws[3]
        ho = (xs[2] + 2 * padding[0] - (dilation[0] * (kh - 1) + 1)) // stride[0] + 1
        wo = (xs[3] + 2 * padding[1] - (dilation[1] * (kw - 1) + 1)) // stride[1] + 1
        t = {
            "input": torch.from_numpy(seeded.weight(f"{case}.input", xs)),
            "offset": torch.from_numpy(seeded.weight(f"{case}.offset", [xs[0], 2 * og * kh * kw, ho, wo])) * scale,
            "weight": torch.from_numpy(seeded.weight(f"{case}.weight", ws)),
        }
        if use_mask:
            t["mask"] = (torch.from_numpy(seeded.weight(f"{case}.mask", [xs[0], og * kh * kw, ho, wo])) + 1) / 2
        if use_bias:
            t["bias"] = torch.from_numpy(seeded.weight(f"{case}.bias", [ws[0]]))
        out = deform_conv2d(t["input"], t["offset"], t["weight"], t.get("bias"), stride, padding, dilation, t.get("mask"))
        t["output"] = out
        t["attrs"] = torch.tensor([*stride, *padding, *dilation], dtype=torch.float32)
        tensors.update({f"{case}.{k}": v for k, v in t.items()})
    path = os.path.join(out_dir, "deform_conv2d.reference.safetensors")
    save_file({k: v.contiguous().float() for k, v in tensors.items()}, path)
    print(f"wrote {path}: {len(DEFORM_CASES)} cases")


# ---- main -----------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="bundled model to export (`kiln models` lists them)")
    p.add_argument("--kiln", help="the kiln binary that lists the bundled models (default: $KILN_BIN, ../kiln/kiln or ../target/release/kiln beside this script, or kiln on the PATH)")
    p.add_argument("--weights", default="seeded", help="seeded | torchvision | PATH to a state_dict safetensors file")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--size", type=parse_size, help="input height = width, or HxW such as 384x512 (default: 224 for the classifiers, 512 for CenterNet)")
    p.add_argument("--seed", type=int, default=0, help="input seed (and torch.manual_seed for --weights torchvision)")
    p.add_argument("--out", default=".", help="output directory")
    p.add_argument("--device", default="cpu", help="where PyTorch runs the model: cpu (default) or cuda (FP32, TF32 off)")
    p.add_argument("--intermediates", default="", help="comma-separated module paths to record, or `all` (leaf modules)")
    p.add_argument("--save-weights", action="store_true", help="also write <model>.weights.safetensors")
    p.add_argument("--stats", action="store_true", help="print per-stage activation std and max |x|, write nothing")
    p.add_argument("--op-fixtures", action="store_true", help="write ops.reference.safetensors and exit")
    p.add_argument("--deform-conv-fixtures", action="store_true", help="write deform_conv2d.reference.safetensors (plugins/deform-conv) and exit")
    p.add_argument("--all-fixtures", action="store_true", help="write every model's reference at its FIXTURE_SIZES (batch, size)")
    args = p.parse_args()

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_grad_enabled(False)
    os.makedirs(args.out, exist_ok=True)

    if args.op_fixtures:
        export_op_fixtures(args.out)
        return
    if args.deform_conv_fixtures:
        export_deform_fixtures(args.out)
        return
    if not args.model and not args.all_fixtures:
        p.error("--model is required (or --op-fixtures, --all-fixtures)")

    load_models(args.kiln)
    if args.all_fixtures:
        for model in MODELS:
            batch, size = fixture_size(model)
            export(args, model, batch, size)
        export_yolo_nms_fixture(args.out)
        return
    if args.model not in MODELS:
        p.error(f"--model: unknown model `{args.model}` (the bundled models are {', '.join(MODELS)})")
    export(args, args.model, args.batch, args.size or default_size(args.model))


def parse_size(text):
    """`512` (square) or `384x512` (height x width)."""
    h, _, w = text.partition("x")
    return (int(h), int(w or h))


def export(args, model, batch, size):
    net = load_weights(model, build(model), args.weights, args.seed).eval().float()
    h, w = size if isinstance(size, tuple) else (size, size)
    # The input comes from the seeded generator too, so Rust can recreate it without the file.
    x = torch.from_numpy(seeded.weight(f"input.{args.seed}", [batch, 3, h, w]))

    net, xd = net.to(args.device), x.to(args.device)
    if args.stats:
        print_stats(net, xd)
        return

    paths = [s for s in args.intermediates.split(",") if s]
    calls, handles = attach_hooks(net, paths) if paths else ({}, [])
    outputs = {k: v.cpu() for k, v in run_model(net, model, xd).items()}
    calls = {k: [v.cpu() for v in vs] for k, vs in calls.items()}
    for h in handles:
        h.remove()

    tensors = {"input": x}
    tensors.update({f"output.{k}": v for k, v in outputs.items()})
    tensors.update(flatten_calls(calls))
    # What made the reference, for `kiln compare` to hint at when its run differs (model, weights
    # by SHA-256 of the file `--weights` names, input size, seed).
    metadata = {
        "model": model,
        "weights": args.weights if args.weights in ("seeded", "torchvision") else os.path.basename(args.weights),
        "input_shape": "x".join(str(d) for d in x.shape),
        "seed": str(args.seed),
        "producer": f"tools/export_reference.py (torch {torch.__version__})",
    }
    if args.weights not in ("seeded", "torchvision"):
        metadata["weights_sha256"] = sha256_file(args.weights)
    if args.save_weights:
        wpath = os.path.join(args.out, f"{model}.weights.safetensors")
        sd = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
        save_file(sd, wpath)
        print(f"wrote {wpath}: {len(sd)} tensors")
        metadata["weights_sha256"] = sha256_file(wpath)
    path = os.path.join(args.out, f"{model}.reference.safetensors")
    # clone: the last call of a reused module is stored twice (`path` and `path#i`).
    save_file({k: v.detach().float().clone().contiguous() for k, v in tensors.items()}, path, metadata=metadata)
    summary = ", ".join(f"{k} {list(v.shape)}" for k, v in outputs.items())
    print(f"wrote {path}: input {list(x.shape)}, {summary}, {len(calls)} intermediates")
    if "logits" in outputs:
        print(f"top-1 class per image: {outputs['logits'].argmax(1).tolist()}")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()

if __name__ == "__main__":
    main()
